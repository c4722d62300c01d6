"""Beam search over forked sequences.

Operations:
- `BeamSearchParams(beam_width, max_tokens, length_penalty, ignore_eos)`: validated parameters.
- `BeamGroup(first, params, eos_token_ids)`: one request's beams. `record(seq, values, ids)`
  takes a live beam's best next tokens and their logprobs; once every live beam has given them,
  `select()` says which beams go on with which tokens (a beam picked twice forks, a beam not
  picked is dropped) and books the hypotheses that finished.
- `BeamSearchOutput` / `BeamSearchSequence`: a request's finished candidates, best first.

The rules are transformers' `generate(num_beams=W, do_sample=False, length_penalty=p)` (its
default `early_stopping=False`), step by step, in float32:

    candidates  the K = max(2, 1 + #EOS ids) * W best (beam score + token logprob) over all
                live beams; a beam's score is the sum of its tokens' logprobs
    finished    a candidate among the first W that ends in EOS (or reaches max_tokens) is a
                hypothesis, scored cum_logprob / (generated tokens) ** p; the W best are kept
    live        the W best candidates that did not finish go on
    stop        at max_tokens, or once W hypotheses are kept and the best live beam, scored at
                its current length, cannot beat the worst of them

A hypothesis's tokens include its EOS token, as `generate`'s output (and `LLM.generate`'s) do.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tieredkv.outputs import CompletionOutput
from tieredkv.sequence import Sequence, SequenceGroup
from tieredkv.values import is_int, is_real


@dataclass(frozen=True)
class BeamSearchParams:
    """Beam search of `beam_width` beams for at most `max_tokens` new tokens. Candidates are
    ranked by `cum_logprob / len(tokens) ** length_penalty`; with `ignore_eos`, EOS is an
    ordinary token."""

    beam_width: int
    max_tokens: int
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not is_int(self.beam_width) or self.beam_width < 1:
            raise ValueError(f"beam_width: expected an integer >= 1, got {self.beam_width!r}")
        if not is_int(self.max_tokens) or self.max_tokens < 1:
            raise ValueError(f"max_tokens: expected an integer >= 1, got {self.max_tokens!r}")
        if not is_real(self.length_penalty) or not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty: expected a finite number, got {self.length_penalty!r}")
        # every score divides by (generated tokens) ** length_penalty: it must stay a float
        bound = math.log(sys.float_info.max) / math.log(self.max_tokens) if self.max_tokens > 1 else math.inf
        if abs(self.length_penalty) > bound:
            raise ValueError(f"length_penalty: expected a number in [-{bound:.1f}, {bound:.1f}] with max_tokens="
                             f"{self.max_tokens} (tokens ** length_penalty overflows past it), "
                             f"got {self.length_penalty!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: expected True or False, got {self.ignore_eos!r}")
        object.__setattr__(self, "beam_width", int(self.beam_width))
        object.__setattr__(self, "max_tokens", int(self.max_tokens))
        object.__setattr__(self, "length_penalty", float(self.length_penalty))


@dataclass(frozen=True)
class BeamSearchSequence:
    """A finished candidate: its generated tokens (ending with EOS when `finish_reason` is
    "stop"), their text (with a tokenizer), the sum of their logprobs, and its rank score
    (`cum_logprob / len(token_ids) ** length_penalty`, transformers' `sequences_scores`)."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    text: str | None = None
    finish_reason: str = "length"


@dataclass(frozen=True)
class BeamSearchOutput:
    """The finished candidates of one prompt, best first (empty, with `error` set, for a prompt
    that could not run)."""

    request_id: str
    prompt_token_ids: list[int]
    sequences: list[BeamSearchSequence]
    error: str | None = None


class Continuation(NamedTuple):
    """A live beam of the next step: `beam` extended by `token`, with its new score."""

    beam: Sequence
    token: int
    score: float


class BeamGroup(SequenceGroup):
    """The live beams and finished hypotheses of one beam-search request. `seqs` are the live
    beams (the first is the prompt alone)."""

    def __init__(self, first: Sequence, params: BeamSearchParams, eos_token_ids: tuple[int, ...],
                 decode: Callable[[list[int]], str] | None = None) -> None:
        super().__init__(first)
        self.params = params
        self.eos = frozenset(() if params.ignore_eos else eos_token_ids)
        self.num_candidates = max(2, 1 + len(self.eos)) * params.beam_width
        self.scores: dict[str, float] = {first.seq_id: 0.0}  # live beam -> its cum logprob (a float32)
        self.hyps: list[BeamSearchSequence] = []
        self.done = False
        self._decode = decode
        self._pending: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def width_of(self, seq: Sequence) -> int:
        return self.params.beam_width if seq.num_output_tokens == 0 and len(self.seqs) == 1 else 1

    @property
    def finished(self) -> bool:
        """Stopped, or every live beam was aborted."""
        return self.done or all(s.is_finished for s in self.seqs)

    def record(self, seq: Sequence, values: torch.Tensor, ids: torch.Tensor) -> bool:
        """Take a live beam's best next tokens (`ids`, by descending logprob `values`, at least
        `num_candidates` of them or the whole vocabulary); whether every live beam has now.
        A beam computed twice (preempted and recomputed) keeps its first answer."""
        self._pending.setdefault(seq.seq_id, (values[: self.num_candidates].float().cpu(),
                                              ids[: self.num_candidates].cpu()))
        return len(self._pending) == len(self.seqs)

    def select(self) -> tuple[list[Continuation], bool]:
        """The live beams of the next step, best first, and whether the search is over (then
        the list is empty). Finished candidates join `hyps`."""
        width, penalty = self.params.beam_width, self.params.length_penalty
        length = self.seqs[0].num_output_tokens + 1  # generated tokens of every candidate
        final = length >= self.params.max_tokens
        values, tokens, owners = self._candidates()
        top = values.topk(min(self.num_candidates, values.numel()))
        normalized = (top.values / length**penalty).tolist()
        live = []
        for k, (score, j) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True)):
            beam, token = self.seqs[owners[j]], int(tokens[j])
            if final or token in self.eos:
                if k < width:  # only the best W candidates may finish (the rest are spares)
                    self._add_hyp(beam.output_token_ids + [token], score, normalized[k], token in self.eos)
            elif len(live) < width:
                live.append(Continuation(beam, token, score))
        self._pending.clear()
        self.done = final or not live or self._cannot_improve(live[0].score, length)
        return ([] if self.done else live), self.done

    def _candidates(self) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Every live beam's recorded tokens: (beam score + logprob in float32, token, beam)."""
        values, tokens, owners = [], [], []
        for i, seq in enumerate(self.seqs):
            lp, ids = self._pending[seq.seq_id]
            values.append(lp + torch.tensor(self.scores[seq.seq_id], dtype=torch.float32))
            tokens.append(ids)
            owners += [i] * len(ids)
        return torch.cat(values), torch.cat(tokens), owners

    def _add_hyp(self, token_ids: list[int], cum_logprob: float, score: float, eos: bool) -> None:
        text = self._decode(token_ids) if self._decode is not None else None
        hyp = BeamSearchSequence(token_ids, cum_logprob, score, text, "stop" if eos else "length")
        self.hyps = sorted([*self.hyps, hyp], key=lambda h: h.score, reverse=True)[: self.params.beam_width]

    def _cannot_improve(self, best_live_score: float, length: int) -> bool:
        """W hypotheses are kept and the best live beam, scored at its current length, does not
        beat the worst of them (transformers' heuristic with `early_stopping=False`)."""
        if len(self.hyps) < self.params.beam_width:
            return False
        best = torch.tensor(best_live_score, dtype=torch.float32) / length**self.params.length_penalty
        return not best.item() > min(h.score for h in self.hyps)

    def advance(self, live: list[tuple[Sequence, float]]) -> None:
        """The live beams of the next step (each already has its new token), best first."""
        self.seqs = [seq for seq, _ in live]
        self.scores = {seq.seq_id: score for seq, score in live}

    def completions(self) -> list[CompletionOutput]:
        """The finished hypotheses, best first (none before the search is over)."""
        if not self.done:
            return []
        return [CompletionOutput(i, h.token_ids, h.text, h.finish_reason, h.cum_logprob)
                for i, h in enumerate(self.hyps)]

    def result(self, prompt_token_ids: list[int], error: str | None = None) -> BeamSearchOutput:
        return BeamSearchOutput(self.request_id, prompt_token_ids, list(self.hyps) if self.done else [], error)
