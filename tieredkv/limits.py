"""What a request may ask of an engine, fixed once the engine is built.

Operations:
- `RequestLimits.check_params(params)`: the parameters, or ValueError (not a `SamplingParams`,
  more logprobs than the vocabulary).
- `RequestLimits.check_request(num_prompt_tokens, max_tokens, width_name, width)`: ValueError if
  the request can never run (longer than the model or the GPU tier, more sequences than
  `max_num_seqs`).

The engine checks every request with them; a server whose engine runs in another process checks
with a copy before it sends one, so both refuse a request with the same message.
"""

from __future__ import annotations

from dataclasses import dataclass

from tieredkv.sampling import SamplingParams


@dataclass(frozen=True)
class RequestLimits:
    """The model's vocabulary and length, the GPU tier's size, the scheduler's sequences."""

    vocab_size: int
    max_model_len: int
    num_gpu_blocks: int
    block_size: int
    max_num_seqs: int

    @property
    def max_request_tokens(self) -> int:
        """The longest request (prompt + output) that can ever run: the model's length, and the
        whole GPU tier."""
        return min(self.max_model_len, self.num_gpu_blocks * self.block_size)

    def check_params(self, params: SamplingParams | None) -> SamplingParams:
        """`params` (the defaults for None); ValueError if they can never be honoured."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params: expected a SamplingParams, got {type(params).__name__}")
        if params.logprobs is not None and params.logprobs > self.vocab_size:
            raise ValueError(f"logprobs: {params.logprobs} exceeds the vocabulary ({self.vocab_size} tokens); "
                             "ask for fewer")
        return params

    def check_sampling(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """`check_request` for a sampled request (its width: `best_of`, else `n`)."""
        name = "best_of" if params.best_of is not None else "n"
        self.check_request(num_prompt_tokens, params.max_tokens, name, params.num_samples)

    def check_request(self, num_prompt_tokens: int, max_tokens: int, width_name: str, width: int) -> None:
        """ValueError if the request does not fit the model or the GPU tier, or its `width`
        sequences (samples, beams) exceed `max_num_seqs`."""
        total = num_prompt_tokens + max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt: {num_prompt_tokens} tokens + max_tokens {max_tokens} = {total} exceeds the model's "
                f"maximum length {self.max_model_len}; shorten the prompt or lower max_tokens"
            )
        blocks = -(-total // self.block_size)
        if blocks > self.num_gpu_blocks:
            raise ValueError(
                f"prompt: {num_prompt_tokens} tokens + max_tokens {max_tokens} need {blocks} KV blocks but the GPU "
                f"tier has {self.num_gpu_blocks}; raise num_gpu_blocks or shorten the request"
            )
        if width > self.max_num_seqs:
            raise ValueError(f"{width_name}: {width} sequences per request exceed max_num_seqs ({self.max_num_seqs}); "
                             f"raise max_num_seqs or lower {width_name}")
