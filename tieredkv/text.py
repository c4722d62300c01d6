"""Text in and out of the engine.

Operations:
- `chat_prompt(tokenizer, messages, ...)`: token ids of a conversation through the tokenizer's
  chat template, ready for the assistant's reply (or as the options of OpenAI's chat API say);
  `chat_text(...)`: the text the template writes, and `chat_ids(tokenizer, text)` its ids.
- `chars_per_token(tokenizer)`: the most characters one token stands for (a token limit as a
  character limit, to refuse a text too long for it without encoding it).
- `chat_messages(messages)`: the messages as the template takes them (list content as its text),
  or a ValueError naming the message and field at fault.
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
from tieredkv.values import check_text

Message = dict[str, Any]
ROLES = ("system", "developer", "user", "assistant")
TOOL_ROLES = ("tool", "function", "ipython")  # turns of tool calling, which the engine does not do
PROMPT_CONTEXT_TOKENS = 4  # prompt tokens that start the decoding window
REPLACEMENT_CHAR = "\ufffd"


def chat_prompt(tokenizer: Any, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Token ids of `messages` (`[{"role": ..., "content": ...}, ...]`) through the tokenizer's chat
    template, ending with the prompt of the assistant's turn (unless not `add_generation_prompt`;
    `continue_final_message`: ending in the last message, left open to be continued), the
    template given `template_kwargs` as variables of its own (e.g. `enable_thinking`)."""
    text = chat_text(tokenizer, messages, add_generation_prompt=add_generation_prompt,
                     continue_final_message=continue_final_message, template_kwargs=template_kwargs)
    return chat_ids(tokenizer, text)


def chat_text(tokenizer: Any, messages: Sequence[Message], *, add_generation_prompt: bool = True,
              continue_final_message: bool = False, template_kwargs: dict[str, Any] | None = None) -> str:
    """The text `chat_prompt` encodes: `messages` as the tokenizer's chat template writes them."""
    if tokenizer is None:
        raise ValueError("messages: chat needs a tokenizer with a chat template in the model directory")
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("messages: the model's tokenizer has no chat template; send a completion prompt instead")
    conversation = chat_messages(messages)
    try:
        return tokenizer.apply_chat_template(
            conversation, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
            tokenize=False, **(template_kwargs or {}),
        )
    except Exception as err:  # the template is user code (jinja): its errors are the request's
        raise ValueError(f"messages: the chat template failed on them: {err}") from err


def chat_ids(tokenizer: Any, text: str) -> list[int]:
    """Token ids of a chat template's text: the template wrote the special tokens, so the
    encoding adds none (as `apply_chat_template` encodes it)."""
    return tokenizer.encode(text, add_special_tokens=False)


def chars_per_token(tokenizer: Any) -> int:
    """The most characters of text one token of `tokenizer` stands for: its longest vocabulary
    entry (each symbol of an entry stands for a character or more: a byte in byte-level BPE, a
    character or `<0x..>` byte in SentencePiece), times 4 unless the tokenizer is known to have
    no normalizer, as one that composes characters (NFC) joins up to 4 into one first."""
    longest = max(map(len, tokenizer.get_vocab()))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return longest if backend is not None and backend.normalizer is None else 4 * longest


def chat_messages(messages: Sequence[Message]) -> list[Message]:
    """Each message with its content as text: a list of text parts becomes their text, joined; an
    assistant's missing content is empty. ValueError naming the message and field for a role the
    engine does not take (tool calling), a tool call, or content that is not valid text."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: expected a non-empty list of {'role': ..., 'content': ...} mappings")
    return [_message(f"messages[{i}]", m) for i, m in enumerate(messages)]


def _message(where: str, message: object) -> Message:
    if not isinstance(message, dict):
        raise ValueError(f"{where}: expected a {{'role': ..., 'content': ...}} mapping, got {type(message).__name__}")
    role = message.get("role")
    if role in TOOL_ROLES:
        raise ValueError(f"{where}.role: {role!r} is not supported (tool calling is not); use one of {ROLES}")
    if role not in ROLES:
        raise ValueError(f"{where}.role: expected one of {ROLES}, got {role!r}")
    if message.get("tool_calls"):
        raise ValueError(f"{where}.tool_calls: not supported (tool calling is not); send the content only")
    if isinstance(message.get("name"), str):
        check_text(message["name"], f"{where}.name")
    return {**message, "content": _content(where, role, message.get("content"))}


def _content(where: str, role: str, content: object) -> str:
    if content is None:
        if role == "assistant":
            return ""
        raise ValueError(f"{where}.content: missing; give a string or a list of text parts")
    if isinstance(content, str):
        return check_text(content, f"{where}.content")
    if not isinstance(content, list):
        raise ValueError(f"{where}.content: expected a string or a list of text parts, got {type(content).__name__}")
    return "".join(_text_part(f"{where}.content[{j}]", part) for j, part in enumerate(content))


def _text_part(where: str, part: object) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        raise ValueError(f"{where}: only text parts are supported ({{'type': 'text', 'text': ...}})")
    text = part.get("text")
    if not isinstance(text, str):
        raise ValueError(f"{where}.text: expected a string, got {type(text).__name__}")
    return check_text(text, f"{where}.text")


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
