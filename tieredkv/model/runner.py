"""The model runner: a transformers causal LM driven through our paged KV cache.

Operations:
- `ModelRunner(model_config)`: load a model directory (or a cached model id) or build a preset;
  register paged attention.
- `allocate_kv_cache(num_blocks, block_size)`: the one KV tensor of the GPU tier;
  `cpu_tier(num_blocks)`: its CPU twin and the transfer engine between them.
- `execute(scheduled, block_tables)`: one packed forward pass; logits of the last token of
  every sequence that samples this step (`run(step)` for inputs built already).
- `copy_blocks(copies)`: copy whole KV blocks within the cache (copy-on-write of forks).

With a `TPLayout` the runner holds one rank's share of the model and of the KV (its KV heads);
the tensor-parallel workers (`tieredkv/parallel/`) run one such runner per rank.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from tieredkv.config import CacheConfig, ModelConfig
from tieredkv.memory import check_fits, fit_gpu_blocks
from tieredkv.model import attention, fused, locate
from tieredkv.model.all_reduce import AllReduce
from tieredkv.model.cuda_graphs import MAX_MIXED_TOKENS, StepGraphs
from tieredkv.model.presets import PRESETS, build_preset, build_preset_shard, preset_config
from tieredkv.model.sharding import TPLayout, head_dim, num_kv_heads, shard_model
from tieredkv.model.weights import weights_id
from tieredkv.sampling import SamplingParams
from tieredkv.sequence import ScheduledSeq
from tieredkv.sequence import Sequence as Seq
from tieredkv.tiers.cpu import CPUTier
from tieredkv.transfer.engine import TransferEngine, make_transfer_engine

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
COPY_STAGING_BLOCKS = 16  # blocks one gather + scatter of `copy_blocks` moves
# the context of the warm-up's eager steps: long enough for the decode kernel's most key splits
WARM_CONTEXT_TOKENS = 16384


@dataclass(frozen=True)
class KVSpec:
    """Shape of the KV of one token in one layer."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    def block_bytes(self, block_size: int) -> int:
        """Bytes of one block, all layers, K and V."""
        elem = torch.empty((), dtype=self.dtype).element_size()
        return self.num_layers * 2 * block_size * self.num_kv_heads * self.head_dim * elem

    @classmethod
    def of(cls, hf: PretrainedConfig, dtype: str, layout: TPLayout | None = None) -> KVSpec:
        """The KV of the whole model, or of one rank's KV heads."""
        heads = num_kv_heads(hf) if layout is None else len(layout.kv_heads(hf))
        return cls(hf.num_hidden_layers, heads, head_dim(hf), getattr(torch, dtype))


def load_model(
    config: ModelConfig, layout: TPLayout | None = None, all_reduce: AllReduce | None = None
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Build a preset or load a local directory, with our paged attention installed; with a
    `layout`, only that rank's share of it, summing its partial outputs through `all_reduce`."""
    attention.register()
    dtype = getattr(torch, config.dtype)
    impl = attention.ATTN_IMPLEMENTATION
    if config.model in PRESETS:
        if layout is None:
            model = build_preset(config.model, config.seed, dtype, config.device, impl)
        else:
            model = build_preset_shard(config.model, layout, all_reduce, config.seed, dtype, config.device, impl)
        fused.install(model, config.device)
        return model, None
    model = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype, attn_implementation=impl)
    check_model_type(model.config)
    if layout is not None:
        shard_model(model, layout, all_reduce)
    fused.install(model, config.device)
    return model.to(config.device).eval(), load_tokenizer(config.model)


def weights_identity(config: ModelConfig) -> str:
    """What names the weights in the model fingerprint: preset and seed, or the files' hash."""
    return f"preset:{config.model}:seed={config.seed}" if config.model in PRESETS else weights_id(config.model)


def check_model_type(hf: PretrainedConfig) -> None:
    if hf.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model: architecture {hf.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def load_hf_config(model: str) -> PretrainedConfig:
    """The architecture of a preset or a model directory (no weights read)."""
    if model in PRESETS:
        return preset_config(model)
    hf = AutoConfig.from_pretrained(model)
    check_model_type(hf)
    return hf


def load_tokenizer(model: str) -> PreTrainedTokenizerBase | None:
    """The tokenizer of a model directory, if it has one (presets have none)."""
    if model in PRESETS:
        return None
    has_tokenizer = any(os.path.exists(os.path.join(model, f)) for f in ("tokenizer.json", "tokenizer_config.json"))
    return AutoTokenizer.from_pretrained(model) if has_tokenizer else None


def load_generation_config(model: str, hf: PretrainedConfig) -> GenerationConfig:
    """generation_config.json of a directory, else the one transformers derives from `hf`."""
    if model not in PRESETS and os.path.exists(os.path.join(model, "generation_config.json")):
        return GenerationConfig.from_pretrained(model)
    return GenerationConfig.from_model_config(hf)


def eos_token_ids(hf: PretrainedConfig, generation: GenerationConfig) -> tuple[int, ...]:
    """Every EOS id of config.json and generation_config.json: transformers' `generate` stops
    on any id of the generation config's list (Llama-3-Instruct lists three)."""
    ids: list[int] = []
    for source in (hf, generation):
        eos = getattr(source, "eos_token_id", None)
        ids += eos if isinstance(eos, list) else [] if eos is None else [eos]
    return tuple(dict.fromkeys(ids))


class ModelRunner:
    """Runs packed batches of sequences through the model and the paged KV cache."""

    def __init__(
        self, config: ModelConfig, layout: TPLayout | None = None, all_reduce: AllReduce | None = None
    ) -> None:
        """`config` may hold "auto" and model ids; they are resolved here (`locate.resolve`).
        With `layout`, this rank's share of the model (its partial outputs summed by
        `all_reduce`, None: `dist.all_reduce` over the default group)."""
        self.config = config = locate.resolve(config)
        self.device = torch.device(config.device)
        self.model, self.tokenizer = load_model(config, layout, all_reduce)
        # the whole model's architecture (a full-size preset's shard is built in its rank's shapes)
        self.hf_config = self.model.config if layout is None else load_hf_config(config.model)
        self.kv_spec = KVSpec.of(self.hf_config, config.dtype, layout)
        self.tp_layout = None if layout is None else layout.describe(self.hf_config)  # in the model fingerprint
        self.max_model_len = max_model_len(config.max_model_len, self.hf_config.max_position_embeddings)
        self.weights_id = weights_identity(config)
        self.ops = attention.attention_ops(self.device)
        self.kv_cache: torch.Tensor | None = None
        self._copy_staging: torch.Tensor | None = None
        self.block_size = 0
        self.graphs: StepGraphs | None = None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return eos_token_ids(self.model.config, self.model.generation_config)

    def num_gpu_blocks(self, cache: CacheConfig) -> int:
        """How many KV blocks the GPU tier gets (`num_gpu_blocks`, checked to fit, or what
        `gpu_memory_utilization` leaves)."""
        block_bytes = self.kv_spec.block_bytes(cache.block_size)
        if cache.num_gpu_blocks is not None:
            check_fits("num_gpu_blocks", cache.num_gpu_blocks, block_bytes, self.device)
            return cache.num_gpu_blocks
        return fit_gpu_blocks(cache, block_bytes, self.device)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> torch.Tensor:
        s = self.kv_spec
        shape = (s.num_layers, 2, num_blocks, block_size, s.num_kv_heads, s.head_dim)
        self.kv_cache = torch.zeros(shape, dtype=s.dtype, device=self.device)
        staging_shape = (min(COPY_STAGING_BLOCKS, num_blocks), s.num_layers, 2, block_size, s.num_kv_heads, s.head_dim)
        self._copy_staging = torch.empty(staging_shape, dtype=s.dtype, device=self.device)
        self.block_size = block_size
        return self.kv_cache

    def cpu_tier(self, num_blocks: int, memory: torch.Tensor | None = None) -> tuple[CPUTier, TransferEngine]:
        """A CPU tier of `num_blocks` blocks shaped like the GPU tier's (in `memory` if given,
        else allocated), pinned on CUDA, and the transfer engine between the two."""
        assert self.kv_cache is not None, "allocate_kv_cache() before cpu_tier()"
        kv = self.kv_cache
        tier = CPUTier(num_blocks, tuple(kv[:, :, 0].shape), kv.dtype, pin=kv.is_cuda, memory=memory)
        return tier, make_transfer_engine(kv, tier.data)

    def close(self) -> None:
        """Release the CUDA graphs, the KV tensor and the block copies' staging buffer. The
        graphs go first and now, not whenever the collector finds them: a graph destroyed while
        another engine in the process captures its own would break that capture. On CUDA the
        freed memory goes back to the device: kept in torch's cache, the next engine of the
        process would place its weights inside the old KV tensor's segment and find no room left
        in one piece for its own KV (--compare with a KV cache of most of the device)."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
        self.kv_cache = None
        self._copy_staging = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copy block `src` into block `dst` (all layers, K and V, bit-exact) for each
        `(src, dst)`, on the current stream: the forward passes queued after it see the copies.
        The block-copy kernels (their torch references off CUDA) gather the sources into a
        staging buffer and scatter it into the destinations."""
        assert self.kv_cache is not None and self._copy_staging is not None, "allocate_kv_cache() first"
        gather, scatter = self.ops.gather_blocks, self.ops.scatter_blocks
        step = self._copy_staging.shape[0]
        for start in range(0, len(copies), step):
            chunk = copies[start : start + step]
            src = torch.tensor([s for s, _ in chunk], dtype=torch.int64, device=self.device)
            dst = torch.tensor([d for _, d in chunk], dtype=torch.int64, device=self.device)
            staging = self._copy_staging[: len(chunk)]
            gather(self.kv_cache, src, staging)
            scatter(staging, self.kv_cache, dst)

    @torch.inference_mode()
    def execute(self, scheduled: Sequence[ScheduledSeq], block_tables: Sequence[list[int]]) -> torch.Tensor:
        """Run the new tokens of every scheduled sequence; return `[n, vocab]` float32 logits
        for the n sequences whose chunk reaches their last token."""
        return self.run(StepInputs.build(scheduled, block_tables, self.block_size))

    @torch.inference_mode()
    def run(self, step: StepInputs) -> torch.Tensor:
        """`execute` for inputs built already."""
        assert self.kv_cache is not None, "allocate_kv_cache() before execute()"
        bucket = self.graphs.bucket(step) if self.graphs is not None else None
        if bucket is not None:
            return self.graphs.run(step, bucket)
        t = step.to_tensors(self.device)
        ctx = attention.ForwardContext(self.kv_cache, t["slots"], t["block_tables"], t["cu_seqlens"], t["context_lens"])
        return self.forward(t["tokens"], t["positions"], ctx, t["logits_indices"])

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor, ctx: attention.ForwardContext, logits_indices: torch.Tensor
    ) -> torch.Tensor:
        """One packed forward pass; float32 logits of the rows in `logits_indices`."""
        with attention.forward_context(ctx, self.ops):
            out = self.model(
                input_ids=tokens.unsqueeze(0), position_ids=positions.unsqueeze(0),
                use_cache=False, logits_to_keep=logits_indices,
            )
        return out.logits[0].float()

    def capture_graphs(self, max_batch: int, max_mixed_tokens: int = MAX_MIXED_TOKENS) -> None:
        """Record forward passes as CUDA graphs: decode steps of up to `max_batch` sequences,
        and mixed steps of up to `max_mixed_tokens` tokens (0: none); later steps that fit
        replay them."""
        assert self.kv_cache is not None, "allocate_kv_cache() before capture_graphs()"
        width = min(-(-self.max_model_len // self.block_size), self.kv_cache.shape[2])
        self.graphs = StepGraphs(self, max_batch, width, max_mixed_tokens)
        self.warm_eager_steps(max_batch, max_mixed_tokens + 1)

    def warm_eager_steps(self, max_batch: int, chunk: int) -> list[tuple[int, int]]:
        """Run once the eager steps serving meets past the captured graphs: a `chunk`-token
        prefill after a long context beside 0, 1, 2, 4, ... decodes (fewer than `max_batch`).
        The attention kernels pick their variant by such shapes (the decode kernel's split count
        from the number of decodes and the longest context), and Triton compiles each variant at
        its first use, ~1 s apiece, which the first requests of a run otherwise waited for (13-17 s
        in all on an H200: BENCHMARKS.md, "Real-trace configs at 128-token blocks"). Each shape
        runs at two block-table widths, one a multiple of 16 blocks and one not: Triton compiles
        apart for integer arguments divisible by 16 (the tables' row stride is one). Writes the KV
        of the first blocks, so run it before any request does. The (decodes, context) run."""
        bs = self.block_size
        most = min(self.max_model_len, self.kv_cache.shape[2] * bs, WARM_CONTEXT_TOKENS + chunk) // bs
        widths = [w for w in (most // 16 * 16, most // 16 * 16 - 1) if w * bs >= chunk]
        decodes = [Seq(f"warm-{i}", [0, 0], SamplingParams(max_tokens=1)) for i in range(max_batch - 1)]
        for decode in decodes:
            decode.num_computed_tokens = 1
        steps = []
        for width in widths:
            context, table = width * bs - chunk, list(range(width))
            prefill = Seq("warm", [0] * (context + chunk), SamplingParams(max_tokens=1))
            prefill.num_computed_tokens = context
            for n in (0, *(1 << i for i in range(max(0, max_batch - 1).bit_length()))):
                scheduled = [ScheduledSeq(prefill, chunk), *(ScheduledSeq(d, 1) for d in decodes[:n])]
                self.execute(scheduled, [table] + [table[:1]] * n)
                steps.append((n, context))
        return steps

    def prefill_probe(self, num_tokens: int, context_tokens: int = 0) -> None:
        """One forward pass over `num_tokens` dummy tokens after `context_tokens` already in the
        cache (their KV is whatever the blocks hold), for calibration: a chunk of a long prompt
        attends to everything before it. It writes the KV of the first blocks, so run it before
        any request does."""
        total = context_tokens + num_tokens
        seq = Seq("probe", [0] * total, SamplingParams(max_tokens=1))
        seq.num_computed_tokens = context_tokens
        self.execute([ScheduledSeq(seq, num_tokens)], [list(range(-(-total // self.block_size)))])


def max_model_len(configured: int | None, positions: int) -> int:
    """The longest request: `max_model_len` if set (never past the model's positions)."""
    if configured is not None and configured > positions:
        raise ValueError(
            f"max_model_len: {configured} exceeds the model's {positions} positions "
            "(max_position_embeddings); lower it, or leave it out to use them all"
        )
    return configured or positions


@dataclass(frozen=True)
class StepInputs:
    """The packed inputs of one step, as host arrays (B sequences, T new tokens)."""

    tokens: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64: block_id * block_size + offset
    cu_seqlens: np.ndarray  # [B + 1] int32
    context_lens: np.ndarray  # [B] int32
    logits_indices: np.ndarray  # [n] int64: rows whose logits are sampled
    block_tables: np.ndarray  # [B, max_blocks] int32, zero-padded

    @property
    def is_decode(self) -> bool:
        """One new token per sequence, each sampled."""
        b = len(self.context_lens)
        return len(self.tokens) == b and len(self.logits_indices) == b

    @classmethod
    def build(cls, scheduled: Sequence[ScheduledSeq], block_tables: Sequence[list[int]], block_size: int) -> StepInputs:
        tokens: list[int] = []
        positions: list[int] = []
        cu_seqlens = [0]
        context_lens: list[int] = []
        logits_indices: list[int] = []
        tables = np.zeros((len(scheduled), max(map(len, block_tables))), dtype=np.int32)
        for i, (item, table) in enumerate(zip(scheduled, block_tables, strict=True)):
            start = item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            tokens += item.seq.token_ids[start:end]
            positions += range(start, end)
            cu_seqlens.append(len(tokens))
            context_lens.append(end)
            tables[i, : len(table)] = table
            if item.samples:
                logits_indices.append(len(tokens) - 1)
        pos = np.array(positions, dtype=np.int64)
        rows = np.repeat(np.arange(len(scheduled)), np.diff(cu_seqlens))
        slots = tables[rows, pos // block_size].astype(np.int64) * block_size + pos % block_size
        return cls(
            np.array(tokens, dtype=np.int64), pos, slots, np.array(cu_seqlens, dtype=np.int32),
            np.array(context_lens, dtype=np.int32), np.array(logits_indices, dtype=np.int64), tables,
        )

    def to_tensors(self, device: torch.device) -> dict[str, torch.Tensor]:
        return {
            name: torch.from_numpy(getattr(self, name)).to(device, non_blocking=True)
            for name in ("tokens", "positions", "slots", "cu_seqlens", "context_lens", "logits_indices", "block_tables")
        }
