"""The prefill tokens launched on the GPU and not finished: the GPU queue the engine loop does
not see. The loop waits for the GPU only where a step samples; through the steps that sample
nothing (chunks in the middle of long prompts) it schedules ahead of the GPU, and a sequence
can reach blocks planned to arrive from the lower tier while the GPU is still computing the
chunks before them. Whether it waits for those reads or computes their blocks depends on how
much of the GPU's queue is still ahead (`LoadPlanner.give_up_late`).

- `launched(prefill_tokens)`: a step with that many prefill tokens was queued on the GPU;
- `tokens()`: the prefill tokens of the launched steps the GPU has not finished.

On the CPU (and with ranks in processes of their own, which answer each step) a step is done when
`execute` returns: nothing is ever in flight.
"""

from __future__ import annotations

from collections import deque

import torch


class LaunchedPrefill:
    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._steps: deque[tuple[torch.cuda.Event, int]] = deque()  # in launch order

    def launched(self, prefill_tokens: int) -> None:
        """A step with `prefill_tokens` was queued on the device's current stream (after its kernels)."""
        if self._device.type != "cuda" or not prefill_tokens:
            return
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self._device))
        self._steps.append((done, prefill_tokens))

    def tokens(self) -> int:
        """Prefill tokens of the launched steps not finished (a step finishes after those before it)."""
        while self._steps and self._steps[0][0].query():
            self._steps.popleft()
        return sum(tokens for _, tokens in self._steps)
