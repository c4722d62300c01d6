"""What a prompt may be, checked at the API boundary.

Operations:
- `prompt_list(prompts)`: the prompts of one `generate` call as a list (a single prompt, a list
  of prompts, or a 2-D array of token ids as a batch).
- `token_ids(prompt, tokenizer, vocab_size)`: one prompt's token ids as plain ints, or a
  ValueError that says what was wrong with it.

A prompt is a string (tokenized by the model's tokenizer) or token ids: any sequence of
integers (a list, a tuple, a `range`; numpy integers too), or a 1-D integer numpy array or torch
tensor.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from tieredkv.values import check_text, is_int

Prompt = str | Sequence[int] | np.ndarray | torch.Tensor
_ARRAYS = (np.ndarray, torch.Tensor)


def prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Any]:
    """The prompts of a call: one prompt becomes a list of one, a 2-D array its rows, and a
    sequence whose first item is a number is one prompt of token ids. Only an array of more
    dimensions is refused here; each prompt is checked on its own by `token_ids`."""
    if isinstance(prompts, _ARRAYS):
        if prompts.ndim == 1:
            return [prompts]
        if prompts.ndim == 2:
            return list(prompts)
        raise ValueError(
            f"prompts: expected a 1-D array (one prompt) or a 2-D array (a batch) of token ids, "
            f"got {prompts.ndim} dimensions"
        )
    if _is_sequence(prompts):
        if prompts and isinstance(prompts[0], (numbers.Number, np.bool_)):
            return [prompts]  # token ids of one prompt
        return list(prompts)
    return [prompts]  # one prompt: a string, or something `token_ids` will explain (None, bytes, ...)


def token_ids(prompt: object, tokenizer: Any, vocab_size: int, add_special_tokens: bool = True) -> list[int]:
    """The prompt's token ids as plain ints in `[0, vocab_size)` (a text encoded with the
    tokenizer's special tokens, e.g. BOS, unless not `add_special_tokens`); ValueError saying
    what to fix."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("prompt: a string prompt needs a tokenizer in the model directory; pass token ids")
        ids = tokenizer.encode(check_text(prompt, "prompt"), add_special_tokens=add_special_tokens)
    else:
        ids = _raw_ids(prompt)
    if not ids:
        raise ValueError("prompt: is empty; give at least one token")
    if all(type(t) is int for t in ids) and 0 <= min(ids) and max(ids) < vocab_size:
        return list(ids)  # plain ints in range: the common case, checked without a per-token call
    bad = [t for t in ids if not is_int(t) or not 0 <= t < vocab_size]
    if bad:
        raise ValueError(f"prompt: token ids must be integers in [0, {vocab_size}); got {bad[:5]}")
    return [int(t) for t in ids]


def _raw_ids(prompt: object) -> list[Any]:
    if isinstance(prompt, (bytes, bytearray)):
        raise ValueError("prompt: got bytes; decode it to a str (with a tokenizer) or pass token ids")
    if isinstance(prompt, dict):
        raise ValueError("prompt: got a dict; pass the string or the token ids themselves")
    if isinstance(prompt, _ARRAYS):
        if prompt.ndim != 1:
            raise ValueError(f"prompt: expected a 1-D array of token ids, got {prompt.ndim} dimensions")
        return prompt.tolist()
    if not _is_sequence(prompt):
        raise ValueError(f"prompt: expected a string or token ids, got {type(prompt).__name__}")
    return list(prompt)


def _is_sequence(value: object) -> bool:
    """A sequence of items (token ids, or prompts), not a string of characters or bytes."""
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray))
