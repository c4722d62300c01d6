"""What a value from a caller may be: the checks the API's boundaries share (sampling
parameters, prompts, chat messages, request ids), below all of them.

- `is_int(value)`, `is_real(value)`: a number (numpy scalars included), not a bool.
- `finite_number(value, low, inclusive)`: a finite int or float above `low` (a config's times,
  rates and factors).
- `check_text(text, name)`: `text` if it is valid Unicode; ValueError naming `name` if not (a
  lone surrogate, which no tokenizer can encode and no text can contain).
- `check_request_id(request_id)`: ValueError unless a caller's request id is a string.
"""

from __future__ import annotations

import math
import numbers


def is_int(value: object) -> bool:
    """An integer, numpy integers included; not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value: object) -> bool:
    """A real number, numpy scalars included; not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def finite_number(value: object, low: float, inclusive: bool) -> bool:
    """Whether `value` is a finite number above `low` (or equal, if `inclusive`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return value >= low if inclusive else value > low


def check_text(text: str, name: str) -> str:
    """`text`, if it is valid Unicode; ValueError naming `name` and the first lone surrogate."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"{name}: has a lone surrogate (U+{ord(text[err.start]):04X}) at character {err.start}; "
                         "send valid Unicode text") from None
    return text


def check_request_id(request_id: object) -> None:
    """ValueError unless `request_id` is a string (ids key dicts: a list would be a TypeError, a
    number another id than its text)."""
    if not isinstance(request_id, str):
        raise ValueError(f"request_id: expected a string, got {type(request_id).__name__}")
