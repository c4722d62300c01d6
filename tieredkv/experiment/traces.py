"""Request traces for `workload.kind: replay`: read a JSONL file, check every line, select.

Two line formats (`format:`; `auto` tells them apart by the first line's fields):
- `prompts` (this project's): `{"time": s, "prompt": [ids] | "text": str, "max_tokens": n}`.
- `mooncake` (the Mooncake FAST'25 traces, also replayed by vLLM and SGLang):
  `{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}`. Each hash id
  stands for one block of `block_tokens` (512) prompt tokens, the last one possibly partial; the
  same id gives the same tokens (`block_token_ids`: a run seeded by the id), so requests that
  share hash ids share exactly that prefix.

Operations:
- `read_trace(path, format, block_tokens) -> list[TraceLine]`: every line checked; a bad line
  raises ValueError naming the file, the line and the field.
- `select(lines, ...) -> list[TraceRequest]`: the time window, a seeded fraction of the
  conversations, the first `max_requests`; times start at 0 and are scaled; `returning` marked.
- `prompt_token_ids(request, ...)`: the prompt a Mooncake line stands for.
- `prefix_hit_bound(lines, block_tokens, block_size)`: the prefix-hit rate of a cache that never
  evicts, the most any tier setup can reach on those lines.

A line is *returning* when its hash ids begin with every full block of an earlier selected
line's prompt, beyond the leading blocks that every line of the file shares (a system prompt
common to all requests is not a conversation): a later turn, whose prefix a tier may still hold.
A conversation is a chain of such lines; `fraction` samples whole conversations.
"""

from __future__ import annotations

import difflib
import json
import math
import random
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

TraceFormat = Literal["auto", "prompts", "mooncake"]
FIELDS: dict[str, dict[str, bool]] = {  # field -> required
    "prompts": {"time": False, "prompt": False, "text": False, "max_tokens": False},
    "mooncake": {"timestamp": True, "input_length": True, "output_length": True, "hash_ids": True},
}


@dataclass(frozen=True)
class TraceLine:
    """One checked line: its 1-based number, arrival (seconds of the trace's clock), requested
    output tokens, and either a prompt (`prompts`) or a length and hash ids (`mooncake`)."""

    line: int
    time_s: float
    output_tokens: int | None
    prompt: tuple[int, ...] | str | None = None
    input_length: int = 0
    hash_ids: tuple[int, ...] = ()

    @property
    def num_prompt_tokens(self) -> int | None:
        """Prompt length where the line says it (None for a text prompt)."""
        if self.hash_ids:
            return self.input_length
        return len(self.prompt) if isinstance(self.prompt, tuple) else None


@dataclass(frozen=True)
class TraceRequest:
    """A selected line as the replay sends it: `time_s` from the start of the replay."""

    line: TraceLine
    time_s: float
    returning: bool
    conversation: int  # line number of the conversation's first line


def read_trace(path: str, fmt: TraceFormat = "auto", block_tokens: int = 512) -> list[TraceLine]:
    """Every line of the JSONL file at `path`, checked (ValueError naming the line and field)."""
    try:
        with open(path) as f:
            raw = [(i + 1, text) for i, text in enumerate(f) if text.strip()]
    except FileNotFoundError:
        raise ValueError(f"workload.path: {path!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ValueError(f"workload.path: cannot read {path!r}: {err}") from None
    if not raw:
        raise ValueError(f"workload.path: {path} holds no requests")
    rows = [(n, _json_object(path, n, text)) for n, text in raw]
    if fmt == "auto":
        fmt = "mooncake" if "hash_ids" in rows[0][1] or "timestamp" in rows[0][1] else "prompts"
    check = _mooncake_line if fmt == "mooncake" else _prompts_line
    return [check(_Where(path, n, row), block_tokens) for n, row in rows]


def _json_object(path: str, n: int, text: str) -> dict[str, Any]:
    try:
        row = json.loads(text)
    except ValueError as err:  # not JSON, or an integer of more digits than Python converts
        raise ValueError(f"workload.path: {path} line {n}: not a JSON object: {err}") from None
    if not isinstance(row, dict):
        raise ValueError(f"workload.path: {path} line {n}: expected a JSON object, got {type(row).__name__}")
    return row


@dataclass(frozen=True)
class _Where:
    path: str
    line: int
    row: dict[str, Any]

    def error(self, message: str) -> ValueError:
        return ValueError(f"workload.path: {self.path} line {self.line}: {message}")

    def check_fields(self, fmt: str) -> None:
        allowed = FIELDS[fmt]
        for key in self.row:
            if key not in allowed:
                close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.5)
                hint = f"did you mean {close[0]!r}? " if close else ""
                raise self.error(f"unknown field {key!r}: {hint}(the {fmt} format has {', '.join(allowed)})")
        for key, required in allowed.items():
            if required and key not in self.row:
                raise self.error(f"field {key!r} is missing ({fmt} format: {', '.join(allowed)})")

    def number(self, key: str, default: float | None = None, minimum: float = 0) -> float:
        value = self.row.get(key, default)
        try:
            number = None if isinstance(value, bool) or not isinstance(value, (int, float)) else float(value)
        except OverflowError:  # an integer past the largest float
            number = None
        if number is None or not minimum <= number < math.inf:
            raise self.error(f"field {key!r}: expected a finite number >= {minimum}, got {value!r:.60}")
        return number

    def integer(self, key: str, minimum: int) -> int:
        value = self.row.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(f"field {key!r}: expected an integer >= {minimum}, got {value!r}")
        return value


def _prompts_line(where: _Where, block_tokens: int) -> TraceLine:
    where.check_fields("prompts")
    row = where.row
    if ("prompt" in row) == ("text" in row):
        raise where.error("give one of the fields 'prompt' (token ids) or 'text'")
    prompt = row.get("prompt", row.get("text"))
    if "prompt" in row:
        if not isinstance(prompt, list) or not prompt or any(
                isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in prompt):
            raise where.error(f"field 'prompt': expected a non-empty list of token ids >= 0, got {prompt!r:.60}")
        prompt = tuple(prompt)
    elif not isinstance(prompt, str) or not prompt:
        raise where.error(f"field 'text': expected a non-empty string, got {prompt!r:.60}")
    output = where.integer("max_tokens", 1) if "max_tokens" in row else None
    return TraceLine(where.line, where.number("time", 0.0), output, prompt=prompt)


def _mooncake_line(where: _Where, block_tokens: int) -> TraceLine:
    where.check_fields("mooncake")
    length = where.integer("input_length", 1)
    ids = where.row["hash_ids"]
    if not isinstance(ids, list) or any(isinstance(h, bool) or not isinstance(h, int) or h < 0 for h in ids):
        raise where.error(f"field 'hash_ids': expected a list of integers >= 0, got {ids!r:.60}")
    if len(ids) != -(-length // block_tokens):
        raise where.error(
            f"field 'hash_ids': {len(ids)} hash ids for input_length {length}, but blocks of {block_tokens} "
            f"tokens need {-(-length // block_tokens)} (is workload.block_tokens right?)"
        )
    timestamp_ms = where.number("timestamp")
    return TraceLine(where.line, timestamp_ms / 1e3, where.integer("output_length", 1), input_length=length,
                     hash_ids=tuple(ids))


# ---------------------------------------------------------------------------- selection


def common_prefix(lines: list[TraceLine]) -> int:
    """How many leading hash ids every line shares."""
    first = lines[0].hash_ids
    n = len(first)
    for line in lines[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], line.hash_ids, strict=False)) if a != b),
                 min(n, len(line.hash_ids)))
    return n


def parents(lines: list[TraceLine], block_tokens: int, shared: int) -> list[int | None]:
    """For each line, the index of the latest earlier line whose full prompt blocks it begins
    with (more than `shared` of them), or None."""
    latest: dict[tuple[int, ...], int] = {}
    found: list[int | None] = []
    for i, line in enumerate(lines):
        ids = line.hash_ids
        parent = None
        for k in range(len(ids), shared, -1):  # the longest earlier prompt it extends
            parent = latest.get(ids[:k])
            if parent is not None:
                break
        found.append(parent)
        full = line.input_length // block_tokens
        if full > shared:
            latest[ids[:full]] = i
    return found


def select(
    lines: list[TraceLine], *, block_tokens: int = 512, start_s: float = 0.0, duration_s: float | None = None,
    fraction: float = 1.0, max_requests: int | None = None, max_input_tokens: int | None = None,
    time_scale: float = 1.0, rate: float | None = None, seed: int = 0,
) -> list[TraceRequest]:
    """The requests a replay sends, in time order (module docstring)."""
    lines = sorted(lines, key=lambda x: x.time_s)
    shared = common_prefix(lines) if lines[0].hash_ids else 0
    conversation = _conversations(lines, block_tokens, shared)
    rng = random.Random(seed)
    kept = {c: rng.random() < fraction for c in dict.fromkeys(conversation)}  # in order of first line
    end = float("inf") if duration_s is None else start_s + duration_s
    chosen = [(line, c) for line, c in zip(lines, conversation, strict=True)
              if start_s <= line.time_s < end and kept[c]
              and (max_input_tokens is None or (line.num_prompt_tokens or 0) <= max_input_tokens)]
    chosen = chosen[:max_requests]
    if not chosen:
        return []
    times = _replay_times([line.time_s for line, _ in chosen], time_scale, rate)
    linked = parents([line for line, _ in chosen], block_tokens, shared)
    return [TraceRequest(line, t, parent is not None, c)
            for (line, c), t, parent in zip(chosen, times, linked, strict=True)]


def _conversations(lines: list[TraceLine], block_tokens: int, shared: int) -> list[int]:
    """The line number of each line's conversation's first line."""
    if not lines[0].hash_ids:
        return [line.line for line in lines]
    conversation: list[int] = []
    for line, parent in zip(lines, parents(lines, block_tokens, shared), strict=True):
        conversation.append(line.line if parent is None else conversation[parent])
    return conversation


def _replay_times(times: list[float], time_scale: float, rate: float | None) -> list[float]:
    """Seconds from the first request: the trace's gaps times `time_scale`, or scaled so that
    requests arrive `rate` per second on average."""
    start, span = times[0], times[-1] - times[0]
    if rate is not None:
        time_scale = (len(times) - 1) / (rate * span) if span > 0 else 0.0
    return [(t - start) * time_scale for t in times]


def prefix_hit_bound(lines: list[TraceLine], block_tokens: int = 512, block_size: int = 16) -> float:
    """The share of the prompt tokens of Mooncake `lines` (in time order) that a cache which
    never evicts could serve: each prompt's longest prefix that an earlier line sent, in full
    engine blocks of `block_size` tokens, short of the prompt's last token (always computed).
    Hash ids stand for `block_tokens` tokens; an earlier line sent only the first tokens of its
    last, partial block."""
    sent: dict[tuple[int, ...], int] = {}  # hash-id prefix -> most tokens of it an earlier line sent
    hit = total = 0
    for line in lines:
        ids, length = line.hash_ids, line.input_length
        found = next((k for k in range(len(ids), 0, -1) if ids[:k] in sent), 0)
        common = min(sent[ids[:found]], length) if found else 0
        hit += min(common, length - 1) // block_size * block_size
        total += length
        for k in range(1, len(ids) + 1):
            sent[ids[:k]] = max(sent.get(ids[:k], 0), min(k * block_tokens, length))
    return hit / total if total else 0.0


def block_token_ids(hash_id: int, block_tokens: int, vocab_size: int, seed: int = 0, low: int = 4) -> list[int]:
    """The tokens a hash id stands for: `block_tokens` ids in [low, vocab_size), seeded by the id."""
    rng = np.random.Generator(np.random.PCG64([seed, hash_id]))
    return rng.integers(low, vocab_size, block_tokens).tolist()


def prompt_token_ids(line: TraceLine, block_tokens: int, vocab_size: int, seed: int = 0,
                     cache: dict[int, list[int]] | None = None) -> list[int]:
    """The prompt of a Mooncake line: its hash ids' blocks, the last one cut to `input_length`."""
    cache = {} if cache is None else cache
    tokens: list[int] = []
    for h in line.hash_ids:
        if h not in cache:
            cache[h] = block_token_ids(h, block_tokens, vocab_size, seed)
        tokens += cache[h]
    return tokens[: line.input_length]
