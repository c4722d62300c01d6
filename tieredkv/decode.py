"""From a step's logits to the sequences' next tokens.

Operations:
- `Decoder.process(sampling, logits)`: every sequence that sampled this step gets its next
  token; returns the requests that have news (their first sequence), in order.
- `Decoder.draws(sampling)` / `Decoder.append(sampling, drawn)`: the same, with the tokens,
  logprobs and beam candidates drawn by rank 0 of a tensor-parallel engine (`draws` says what).

What that involves, per request:
- one sequence: sample its row (and its logprobs, with `SamplingParams(logprobs=k)`);
- `n` samples (`SampleGroup`): at the first token the request forks into its samples, which all
  draw from the one row of logits, each with its own generator;
- beam search (`BeamGroup`): the beam's best next tokens are recorded and the beam is held;
  once every live beam of the request has answered, beams fork, are dropped and get their
  tokens, and the request's news is its end.

Forks, drops and tokens all go through the scheduler, which owns every sequence's progress.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from tieredkv.beam_search import BeamGroup
from tieredkv.logprobs import TokenLogprobs, sampled_logprobs, top_logprobs
from tieredkv.parallel.plan import Draw, Drawn
from tieredkv.parallel_sampling import SampleGroup
from tieredkv.sampling import Sampler
from tieredkv.scheduler import Scheduler
from tieredkv.sequence import Sequence


class Decoder:
    """Samples, forks and steps beam searches after each forward pass."""

    def __init__(self, scheduler: Scheduler, decode_token: Callable[[int], str] | None = None) -> None:
        self.scheduler = scheduler
        self.sampler = Sampler()
        self._decode_token = decode_token

    def process(self, sampling: list[Sequence], logits: torch.Tensor) -> list[Sequence]:
        """Row i of `logits` belongs to `sampling[i]`. Returns the first sequence of each
        request with news (a new token, or, for beam search, its end), in order."""
        rows, seqs, beams = self._rows(sampling)
        news = self._sample(logits, rows, seqs) if seqs else []
        if beams:
            news += self._step_beams(beams, *top_logprobs(logits[[i for i, _ in beams]], _beam_top(beams)))
        return _requests(news)

    @staticmethod
    def draws(sampling: list[Sequence]) -> tuple[Draw, ...]:
        """What `process` would take from each row, for rank 0 of a tensor-parallel engine to
        take it instead: a token for each sample the row stands for (all of a request's samples
        where it forks at this token), or a beam's best log-probs."""
        beam_top = _beam_top([(i, s) for i, s in enumerate(sampling) if isinstance(s.group, BeamGroup)])
        return tuple(
            Draw(seq.request_id, (), beam_top=beam_top) if isinstance(seq.group, BeamGroup)
            else Draw(seq.request_id, tuple(range(seq.index, seq.index + seq.width)), seq.banned_token_ids,
                      _num_top(seq))
            for seq in sampling
        )

    def append(self, sampling: list[Sequence], drawn: Drawn) -> list[Sequence]:
        """`process` for what rank 0 drew as `draws(sampling)` asked."""
        _, seqs, beams = self._rows(sampling)
        assert len(drawn.tokens) == len(seqs), "one token per sample"
        if seqs:
            self.scheduler.append(seqs, drawn.tokens, self._named(seqs, drawn.logprobs))
        news = self._step_beams(beams, *map(torch.from_numpy, drawn.beam_top)) if beams else []
        return _requests(seqs + news)

    def _rows(self, sampling: list[Sequence]) -> tuple[list[int], list[Sequence], list[tuple[int, Sequence]]]:
        """The logits row each sampling sequence draws from (requests with `n` samples fork at
        their first token: all samples draw from its row), and the beams apart."""
        rows: list[int] = []
        seqs: list[Sequence] = []
        beams: list[tuple[int, Sequence]] = []
        for i, seq in enumerate(sampling):
            group = seq.group
            if isinstance(group, BeamGroup):
                beams.append((i, seq))
                continue
            family = [seq]
            if isinstance(group, SampleGroup) and group.needs_fork(seq):
                children = self.scheduler.fork(seq, group.params.num_samples - 1)
                group.adopt(children)
                family += children
            rows += [i] * len(family)
            seqs += family
        return rows, seqs, beams

    def _sample(self, logits: torch.Tensor, rows: list[int], seqs: list[Sequence]) -> list[Sequence]:
        chosen = logits if rows == list(range(logits.shape[0])) else logits[rows]
        tokens = self.sampler.sample(chosen, [s.params for s in seqs], [s.generator for s in seqs],
                                     [s.banned_token_ids for s in seqs])
        logprobs = sampled_logprobs(chosen, tokens, [_num_top(s) for s in seqs])
        self.scheduler.append(seqs, tokens, self._named(seqs, logprobs))
        return seqs

    def _named(self, seqs: list[Sequence],
               logprobs: list[TokenLogprobs | None] | None) -> list[TokenLogprobs | None] | None:
        """`logprobs` with each token's text, where the sequence keeps them and there is a tokenizer."""
        if logprobs is None or self._decode_token is None:
            return logprobs
        decode = self._decode_token
        return [{t: dataclasses.replace(lp, decoded_token=decode(t)) for t, lp in entry.items()}
                if entry is not None and seq.params.logprobs is not None else entry
                for seq, entry in zip(seqs, logprobs, strict=True)]

    def _step_beams(self, beams: list[tuple[int, Sequence]], values: torch.Tensor,
                    ids: torch.Tensor) -> list[Sequence]:
        """Record each beam's best next tokens (row i of `values`, `ids`: beam i's, best
        first) and hold it; step the requests all of whose live beams have answered. Returns
        the beams of the requests that ended."""
        ready: list[BeamGroup] = []
        for row, (_, seq) in enumerate(beams):
            self.scheduler.hold(seq)
            if seq.group.record(seq, values[row], ids[row]) and seq.group not in ready:
                ready.append(seq.group)
        ended = []
        for group in ready:
            if self._advance(group):
                ended.append(group.first)
        return ended

    def _advance(self, group: BeamGroup) -> bool:
        """One beam-search step of a request whose live beams all answered; whether it ended."""
        live, done = group.select()
        picks: dict[str, list[int]] = {}  # beam -> positions of its continuations in `live`
        for k, c in enumerate(live):
            picks.setdefault(c.beam.seq_id, []).append(k)
        taken: list[Sequence | None] = [None] * len(live)  # the sequence that takes each one
        for beam in list(group.seqs):
            mine = picks.get(beam.seq_id, [])
            if not mine:
                self.scheduler.abort(beam)  # dropped: its blocks are freed (shared ones stay)
                continue
            for seq, k in zip([beam, *self.scheduler.fork(beam, len(mine) - 1)], mine, strict=True):
                taken[k] = seq
        self.scheduler.append(taken, [c.token for c in live])
        group.advance([(seq, c.score) for seq, c in zip(taken, live, strict=True)])
        return done


def _num_top(seq: Sequence) -> int | None:
    """How many top logprobs a sequence keeps per token (0: its token's alone; None: none)."""
    return (seq.params.logprobs or 0) if seq.cumulative_logprob is not None else None


def _beam_top(beams: list[tuple[int, Sequence]]) -> int:
    """The top-k each beam's row is read for: the most candidates any of their requests takes."""
    return max((seq.group.num_candidates for _, seq in beams), default=0)


def _requests(news: list[Sequence]) -> list[Sequence]:
    """The first sequence of each request with news, once each, in order."""
    return list({id(s): s for s in (_first(seq) for seq in news)}.values())


def _first(seq: Sequence) -> Sequence:
    """The sequence a request is known by (its first)."""
    return seq.group.first if seq.group is not None else seq
