"""The prefill tokens launched on the GPU and not finished, and how long the loop takes to launch
a step: the GPU queue the engine loop does not see. The loop waits for the GPU only where a step
samples; through the steps that sample nothing (chunks in the middle of long prompts) it
schedules ahead of the GPU, and a sequence can reach blocks planned to arrive from the lower
tier while the GPU is still computing the chunks before them. Whether it waits for those reads
or computes their blocks depends on how much of the GPU's queue is still ahead, and on the
launch that waiting puts after the reads (`LoadPlanner.give_up_late`).

- `launched(prefill_tokens, tokens, host_s)`: a step of `tokens` (`prefill_tokens` of them
  prefill) was queued on the GPU, `host_s` after the loop began it;
- `tokens()`: the prefill tokens of the launched steps the GPU has not finished;
- `launch_s(tokens)`: the loop's time to launch a step of that many tokens, as learned from
  the steps with prefill.

On the CPU (and with ranks in processes of their own, which answer each step) a step is done when
`execute` returns: nothing is ever in flight, and the launch is not learned (it delays both
choices alike).
"""

from __future__ import annotations

from collections import deque

import torch

LAUNCH_WEIGHT = 0.2  # the latest step's share of the learned launch time per token


class LaunchedPrefill:
    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._steps: deque[tuple[torch.cuda.Event, int]] = deque()  # in launch order
        self._launch_s_per_token: float | None = None  # none learned yet

    def launched(self, prefill_tokens: int, tokens: int, host_s: float) -> None:
        """A step was queued on the device's current stream (after its kernels)."""
        if self._device.type != "cuda" or not prefill_tokens:
            return
        per_token, learned = host_s / tokens, self._launch_s_per_token
        self._launch_s_per_token = per_token if learned is None else learned + LAUNCH_WEIGHT * (per_token - learned)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self._device))
        self._steps.append((done, prefill_tokens))

    def tokens(self) -> int:
        """Prefill tokens of the launched steps not finished (a step finishes after those before it)."""
        while self._steps and self._steps[0][0].query():
            self._steps.popleft()
        return sum(tokens for _, tokens in self._steps)

    def launch_s(self, tokens: int) -> float:
        return (self._launch_s_per_token or 0.0) * tokens
