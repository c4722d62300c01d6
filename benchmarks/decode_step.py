"""A decode step of a preset model through the model runner, for timing: `batch` sequences
of `context` cached tokens each, one new token each."""

from __future__ import annotations

import random

import torch

from tieredkv.config import ModelConfig
from tieredkv.model.runner import ModelRunner
from tieredkv.sampling import SamplingParams
from tieredkv.sequence import ScheduledSeq, Sequence

BLOCK_SIZE = 16


class DecodeStep:
    def __init__(self, batch: int, context: int, preset: str = "llama-3-8b", runner: ModelRunner | None = None) -> None:
        self.runner = runner or ModelRunner(ModelConfig(model=preset, device="cuda", dtype="bfloat16"))
        per_seq = -(-(context + 1) // BLOCK_SIZE)
        if self.runner.kv_cache is None or self.runner.kv_cache.shape[2] < batch * per_seq:
            self.runner.allocate_kv_cache(batch * per_seq, BLOCK_SIZE)
        rng = random.Random(0)
        blocks = list(range(batch * per_seq))
        rng.shuffle(blocks)  # scattered, as in a long-running engine
        self.scheduled, self.tables = [], []
        for b in range(batch):
            seq = Sequence(str(b), [rng.randrange(1000, 30000) for _ in range(context + 1)], SamplingParams())
            seq.num_computed_tokens = context
            self.scheduled.append(ScheduledSeq(seq, 1))
            self.tables.append(blocks[b * per_seq : (b + 1) * per_seq])
        spec = self.runner.kv_spec
        # every weight is read once per step, except the embedding table (one row per token)
        embedding = self.runner.model.get_input_embeddings().weight
        weights = sum(p.numel() * p.element_size() for p in self.runner.model.parameters() if p is not embedding)
        kv_read = batch * (context + 1) * spec.block_bytes(1)
        self.bytes_read = weights + kv_read

    def __call__(self) -> torch.Tensor:
        return self.runner.execute(self.scheduled, self.tables)
