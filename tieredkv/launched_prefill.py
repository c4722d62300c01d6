"""The prefill tokens launched on the GPU and not finished, and the loop's own time to make a
step: the GPU queue the engine loop does not see. The loop waits for the GPU only where a step
samples; through the steps that sample nothing (chunks in the middle of long prompts) it
schedules ahead of the GPU, and a sequence can reach blocks planned to arrive from the lower
tier while the GPU is still computing the chunks before them. Whether it waits for those reads
or computes their blocks depends on how much of the GPU's queue is still ahead, and on the
loop's time to make the step that follows the reads (`LoadPlanner.give_up_late`).

- `launched(prefill_tokens, tokens, host_s)`: a step of `tokens` (`prefill_tokens` of them
  prefill) was queued on the GPU; the loop took `host_s` from the step's beginning to its
  launch (scheduling, the tiers' bookkeeping, the block tables);
- `tokens()`: the prefill tokens of the launched steps the GPU has not finished;
- `launch_s(tokens)`: the loop's time to make a step of that many tokens, as learned from the
  steps with prefill: a time every step takes plus a time a token (`fit`), by least squares over
  the recent steps.

The launch call itself is not the loop's time: once the GPU's queue of kernels is full it waits
for the GPU (on an H200 a chunk of 4-8k tokens blocked its launch for ~40 ms with nothing queued
before it, and ~90 ms behind another chunk), and that wait is the GPU's queue, counted by
`tokens()` already.

On the CPU (and with ranks in processes of their own, which answer each step) a step is done when
`execute` returns: nothing is ever in flight, and the launch is not learned (it delays both
choices alike).

`GpuQueue` is what the scheduler asks of it (`tokens`, `launch_s`): the benchmark's simulated GPU
answers the same two questions on its own clock.
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

import torch

LAUNCH_WEIGHT = 0.05  # the latest step's weight in the launch time's fit (the last ~20 steps count)


class GpuQueue(Protocol):
    def tokens(self) -> int:
        """Prefill tokens given to the GPU and not finished."""

    def launch_s(self, tokens: int) -> float:
        """The loop's time to make a step of `tokens` tokens, up to its launch."""


class LaunchedPrefill:
    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._steps: deque[tuple[torch.cuda.Event, int]] = deque()  # in launch order
        self.launch_time = LaunchTime()

    def launched(self, prefill_tokens: int, tokens: int, host_s: float) -> None:
        """A step was queued on the device's current stream (after its kernels)."""
        if self._device.type != "cuda" or not prefill_tokens:
            return
        self.launch_time.learn(tokens, host_s)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self._device))
        self._steps.append((done, prefill_tokens))

    def tokens(self) -> int:
        """Prefill tokens of the launched steps not finished (a step finishes after those before it)."""
        while self._steps and self._steps[0][0].query():
            self._steps.popleft()
        return sum(tokens for _, tokens in self._steps)

    def launch_s(self, tokens: int) -> float:
        return self.launch_time.seconds(tokens)


class LaunchTime:
    """The loop's time to make a step: a time every step takes plus a time a token, fitted by
    least squares over the recent steps (`LAUNCH_WEIGHT`)."""

    def __init__(self) -> None:
        # weighted means of a step's tokens n and launch time t, and of n*n and n*t (none yet)
        self._means: tuple[float, float, float, float] | None = None

    def learn(self, tokens: int, host_s: float) -> None:
        step = (tokens, host_s, tokens * tokens, tokens * host_s)
        learned = self._means or step
        self._means = tuple(m + LAUNCH_WEIGHT * (x - m) for m, x in zip(learned, step, strict=True))

    def fit(self) -> tuple[float, float]:
        """The launch time learned: seconds every step takes, seconds a token (0, 0 before any).
        Steps all of one size teach no time a token: they get their mean."""
        if self._means is None:
            return 0.0, 0.0
        n, t, nn, nt = self._means
        spread = nn - n * n
        per_token = max(0.0, (nt - n * t) / spread) if spread > (0.01 * n) ** 2 else 0.0
        fixed = t - per_token * n
        if fixed < 0:  # through the origin: all of it a time a token
            return 0.0, nt / nn
        return fixed, per_token

    def seconds(self, tokens: int) -> float:
        fixed, per_token = self.fit()
        return fixed + per_token * tokens
