"""From a step's logits to the sequences' next tokens.

Operations:
- `Decoder.process(sampling, logits)`: every sequence that sampled this step gets its next
  token; returns the requests that have news (their first sequence), in order.
- `Decoder.append(sampling, tokens)`: the same for tokens sampled already (tensor parallelism).

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

from collections.abc import Callable

import torch

from tieredkv.beam_search import BeamGroup
from tieredkv.logprobs import TokenLogprobs, token_logprobs
from tieredkv.parallel_sampling import SampleGroup
from tieredkv.sampling import FailedSample, Sampler
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
            news += self._step_beams(logits, beams)
        return list({id(s): s for s in (_first(seq) for seq in news)}.values())

    def append(self, sampling: list[Sequence], tokens: list[int | FailedSample]) -> list[Sequence]:
        """Tokens sampled elsewhere (rank 0 of a tensor-parallel engine), `tokens[i]` for
        `sampling[i]`: sequences of their own only (no samples, no beams, no logprobs, which
        `parallel/limits.py` refuses there). Returns the sequences, all with news."""
        assert all(s.group is None and s.cumulative_logprob is None for s in sampling), "plain sequences only"
        self.scheduler.append(sampling, tokens)
        return list(sampling)

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
        self.scheduler.append(seqs, tokens, self._logprobs(chosen, seqs, tokens))
        return seqs

    def _logprobs(self, logits: torch.Tensor, seqs: list[Sequence],
                  tokens: list[int | FailedSample]) -> list[TokenLogprobs | None] | None:
        """Logprobs of the rows whose sequences keep them (None: no row does)."""
        wanted = [i for i, s in enumerate(seqs) if s.cumulative_logprob is not None and isinstance(tokens[i], int)]
        if not wanted:
            return None
        num_top = [seqs[i].params.logprobs or 0 for i in wanted]
        decode = self._decode_token if any(seqs[i].params.logprobs is not None for i in wanted) else None
        found = token_logprobs(logits[wanted], [tokens[i] for i in wanted], num_top, decode)
        out: list[TokenLogprobs | None] = [None] * len(seqs)
        for i, entry in zip(wanted, found, strict=True):
            out[i] = entry
        return out

    def _step_beams(self, logits: torch.Tensor, beams: list[tuple[int, Sequence]]) -> list[Sequence]:
        """Record each beam's best next tokens and hold it; step the requests all of whose
        live beams have answered. Returns the beams of the requests that ended."""
        logprobs = torch.log_softmax(logits[[i for i, _ in beams]].float(), dim=-1)
        k = min(max(seq.group.num_candidates for _, seq in beams), logprobs.shape[1])
        top = logprobs.topk(k, dim=1)
        values, ids = top.values.cpu(), top.indices.cpu()
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


def _first(seq: Sequence) -> Sequence:
    """The sequence a request is known by (its first)."""
    return seq.group.first if seq.group is not None else seq
