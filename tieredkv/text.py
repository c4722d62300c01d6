"""Text in and out of the engine.

Operations:
- `chat_prompt(tokenizer, messages)`: token ids of a conversation through the tokenizer's chat
  template, ready for the assistant's reply.
- `IncrementalDetokenizer(tokenizer, prompt_token_ids, params)`: a request's output text, one
  token at a time; `add(token)` reports a stop string, `take_delta()` hands out the new text.

Incremental decoding re-decodes a short window of tokens for each new one (the method of
TGI and vLLM's slow path), so its cost does not grow with the output:

    ids:   ... prompt tail | t0 t1 t2 | t3
                           ^prefix    ^read
    delta = decode(ids[prefix:])[len(decode(ids[prefix:read])):]

A window whose text ends in an incomplete UTF-8 character ("\ufffd") waits for more tokens.
The window starts on the last prompt tokens, so the first token's text is what it is in
context (" Paris", not "Paris", for SentencePiece tokenizers); prompt + text is the full text.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any

from tieredkv.sampling import SamplingParams

Message = dict[str, Any]
PROMPT_CONTEXT_TOKENS = 4  # prompt tokens that start the decoding window
REPLACEMENT_CHAR = "\ufffd"


def chat_prompt(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    """Token ids of `messages` (`[{"role": ..., "content": ...}, ...]`) through the tokenizer's
    chat template, ending with the prompt of the assistant's turn."""
    if tokenizer is None:
        raise ValueError("messages: chat needs a tokenizer with a chat template in the model directory")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("messages: the model's tokenizer has no chat template; send a completion prompt instead")
    if not isinstance(messages, (list, tuple)) or not messages or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
    ):
        raise ValueError("messages: expected a non-empty list of {'role': ..., 'content': ...} mappings")
    try:
        ids = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except Exception as err:  # the template is user code (jinja): its errors are the request's
        raise ValueError(f"messages: the chat template failed on them: {err}") from err
    return list(ids)


def _decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """`decode(ids)` without clean-up of spaces (the text must grow by appending only)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the Rust tokenizer: no Python per-token work
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(
        ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False
    )


class IncrementalDetokenizer:
    """The output text of one request, built one token at a time, cut at a stop string.

    While stop strings are set, the last `max(len(stop)) - 1` characters are held back until
    the request ends (they may be the start of a stop string), so text handed out is never
    taken back."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._decode = _decoder(tokenizer, params.skip_special_tokens)
        self._stop = params.stop
        self._min_tokens = params.min_tokens
        self._hold = max(map(len, self._stop), default=1) - 1
        self._ids = self._context(list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]))
        self._prefix = 0
        self._read = len(self._ids)
        self._num_tokens = 0
        self._sent = 0
        self.text = ""  # the output text so far, cut at a stop string

    def fork(self) -> IncrementalDetokenizer:
        """An independent copy (for a forked sample): the same text so far, its own future."""
        clone = copy.copy(self)
        clone._ids = list(self._ids)
        return clone

    def _context(self, tail: list[int]) -> list[int]:
        """The longest prompt tail that decodes to whole characters."""
        while tail and REPLACEMENT_CHAR in self._decode(tail):
            tail = tail[1:]
        return tail

    def add(self, token_id: int, is_stop_token: bool = False) -> str | None:
        """Take the next output token; return the stop string it completes, if any. A stop
        token (EOS, `stop_token_ids`) ends the request without adding text."""
        self._num_tokens += 1
        if is_stop_token:
            return None
        self._ids.append(token_id)
        return self._advance(force=False)

    def flush(self) -> str | None:
        """At the end: add the text of tokens still waiting for the rest of a character;
        return the stop string it completes, if any."""
        return self._advance(force=True) if self._read < len(self._ids) else None

    def _advance(self, force: bool) -> str | None:
        """Decode the window; move it on unless its text is not new or ends in half a character."""
        prefix_text = self._decode(self._ids[self._prefix : self._read])
        full_text = self._decode(self._ids[self._prefix :])
        if not force and (len(full_text) <= len(prefix_text) or full_text.endswith(REPLACEMENT_CHAR)):
            return None
        self._prefix, self._read = self._read, len(self._ids)
        return self._append(full_text[len(prefix_text) :])

    def _append(self, delta: str) -> str | None:
        start = len(self.text)
        self.text += delta
        if not self._stop or self._num_tokens <= self._min_tokens:
            return None
        hits = [(self.text.find(s, max(0, start - len(s) + 1)), s) for s in self._stop]
        hits = [(at, s) for at, s in hits if at >= 0]
        if not hits:
            return None
        at, stop = min(hits)
        self.text = self.text[:at]
        return stop

    def take_delta(self, finished: bool) -> str:
        """The text not handed out yet (all of it once `finished`; else what cannot be the start
        of a stop string)."""
        end = len(self.text) if finished else max(self._sent, len(self.text) - self._hold)
        delta = self.text[self._sent : end]
        self._sent = end
        return delta

    @property
    def sent_text(self) -> str:
        """All the text handed out so far."""
        return self.text[: self._sent]
