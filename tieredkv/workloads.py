"""Seeded workload generators for experiments (`workload:` in the YAML file).

- `multi_turn`: U users hold T-turn conversations that share a system prompt; each turn's
  prompt is the whole conversation so far plus a new user message, so returning
  conversations find their prefix in the cache.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

from tieredkv.config import check_int, unknown_key


@dataclass(frozen=True)
class MultiTurnWorkload:
    """Conversations of `turns` turns for `users` users, sharing a system prompt."""

    users: int = 4
    turns: int = 3
    system_prompt_tokens: int = 64
    message_tokens: int = 24
    max_tokens: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            check_int(f"workload.{f.name}", getattr(self, f.name), 0 if f.name == "seed" else 1)

    def conversations(self, vocab_size: int) -> Conversations:
        return Conversations(self, vocab_size)


class Conversations:
    """The token streams of a multi-turn workload. Ids 0-3 are left out (often special)."""

    def __init__(self, workload: MultiTurnWorkload, vocab_size: int) -> None:
        self.workload = workload
        self.rng = random.Random(workload.seed)
        self.vocab_size = vocab_size
        system = self._tokens(workload.system_prompt_tokens)
        self.history = [list(system) for _ in range(workload.users)]

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(4, self.vocab_size) for _ in range(n)]

    def next_prompts(self) -> list[list[int]]:
        """Each user's next prompt: the conversation so far plus a fresh message."""
        for h in self.history:
            h.extend(self._tokens(self.workload.message_tokens))
        return [list(h) for h in self.history]

    def record_replies(self, replies: list[list[int]]) -> None:
        for h, reply in zip(self.history, replies, strict=True):
            h.extend(reply)


WORKLOADS = {"multi_turn": MultiTurnWorkload}


def make_workload(section: dict[str, Any]) -> MultiTurnWorkload:
    """Build the workload named by `section["kind"]` from the rest of its keys."""
    section = dict(section)
    kind = section.pop("kind", "multi_turn")
    if kind not in WORKLOADS:
        raise ValueError(f"workload.kind: {kind!r} is not allowed; choose one of {', '.join(map(repr, WORKLOADS))}")
    cls = WORKLOADS[kind]
    allowed = [f.name for f in dataclasses.fields(cls)]
    for key in section:
        if key not in allowed:
            raise ValueError(unknown_key(f"workload.{key}", [f"workload.{k}" for k in allowed]))
    return cls(**section)
