"""Parallel sampling: one request, `n` samples (`SamplingParams(n=..., best_of=...)`).

The request runs as one sequence until its prompt is computed; at its first token it forks
into the other samples, which share every block of the prompt (copy-on-write takes care of the
partly filled last one). Each sample draws from a generator of its own, so with a seed the
samples are reproducible and differ from each other. With `best_of`, that many samples are
drawn and the `n` of the highest cumulative logprob returned.
"""

from __future__ import annotations

import torch

from tieredkv.outputs import CompletionOutput
from tieredkv.sequence import Sequence, SequenceGroup


class SampleGroup(SequenceGroup):
    """The samples of one request; `seqs[i]` is sample i, `generators[i]` its generator."""

    def __init__(self, first: Sequence, generators: list[torch.Generator | None]) -> None:
        super().__init__(first)
        self.params = first.params
        assert len(generators) == self.params.num_samples, "one generator per sample"
        self.generators = generators
        first.generator = generators[0]
        if self.params.num_samples > self.params.n:  # best_of ranks the samples by it
            first.cumulative_logprob = first.cumulative_logprob or 0.0
        self.forked = False

    def width_of(self, seq: Sequence) -> int:
        return 1 if self.forked else self.params.num_samples

    def needs_fork(self, seq: Sequence) -> bool:
        """Whether `seq` is the request's first sequence about to sample its first token."""
        return not self.forked and seq is self.seqs[0]

    def adopt(self, children: list[Sequence]) -> None:
        """The other samples, forked from the first: they take their index and generator."""
        for index, child in enumerate(children, start=1):
            child.index, child.generator = index, self.generators[index]
        self.seqs += children
        self.forked = True

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def completions(self) -> list[CompletionOutput]:
        """The samples so far, by index; once finished with `best_of`, the `n` most likely."""
        seqs = self.seqs
        if len(seqs) > self.params.n and self.finished:
            seqs = sorted(seqs, key=_likelihood, reverse=True)
        return [s.completion() for s in seqs[: self.params.n]]


def _likelihood(seq: Sequence) -> float:
    return seq.cumulative_logprob if seq.cumulative_logprob is not None else float("-inf")
