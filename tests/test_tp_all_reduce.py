"""How the tensor-parallel ranks sum their partial outputs (`parallel.all_reduce`): the setting
is checked; on the CPU `auto` falls back to gloo with the tokens unchanged; on two GPUs the
one-shot all-reduce in symmetric memory gives the sums of `dist.all_reduce` (eagerly and in a
CUDA graph) and the engine's tokens stay transformers' with it."""

from __future__ import annotations

import multiprocessing
import socket

import pytest
import torch
import torch.distributed as dist

from tests.reference import make_prompts
from tieredkv import LLM, SamplingParams
from tieredkv.config import EngineConfig
from tieredkv.model.all_reduce import ONE_SHOT_MAX_BYTES, make_all_reduce

NEW_TOKENS = 16
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def test_all_reduce_setting_in_yaml_and_keywords():
    assert EngineConfig.from_dict({"parallel": {"all_reduce": "nccl"}}).parallel.all_reduce == "nccl"
    assert EngineConfig.from_kwargs(all_reduce="auto").parallel.all_reduce == "auto"
    assert EngineConfig().parallel.all_reduce == "auto"
    with pytest.raises(ValueError, match="all_reduce: 'one-shot' is not allowed; choose one of 'auto', 'nccl'"):
        EngineConfig.from_dict({"parallel": {"all_reduce": "one-shot"}})
    with pytest.raises(ValueError, match="did you mean 'parallel.all_reduce'"):
        EngineConfig.from_dict({"parallel": {"all_reduse": "auto"}})


def rank_description(worker) -> tuple[str, bool]:
    return worker.all_reduce.description, worker.all_reduce.one_shot is not None


def test_auto_on_the_cpu_sums_with_gloo_and_keeps_the_tokens(reference_outputs):
    prompts = make_prompts(vocab_size=512)[:3]
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)
    with LLM(model="tiny-llama", device="cpu", dtype="float32", tensor_parallel_size=2, num_gpu_blocks=64,
             all_reduce="auto") as llm:
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
        described = llm.runner.ranks.call("apply", rank_description)
    assert described == [("torch.distributed all-reduce only (device cpu: the one-shot path needs GPUs)", False)] * 2


# ---------------------------------------------------------------------- two GPUs


def one_shot_sums(rank: int, world: int, port: int) -> None:
    """On rank `rank`: the one-shot path against `dist.all_reduce` in bf16 and fp32."""
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0)
    dist.init_process_group("nccl", store=store, rank=rank, world_size=world)
    for dtype in (torch.bfloat16, torch.float32):
        check_one_shot(dtype, rank, world)
    dist.destroy_process_group()


def check_one_shot(dtype: torch.dtype, rank: int, world: int) -> None:
    """Odd and even sizes, eagerly and replayed from one CUDA graph, equal to NCCL's sums
    (exactly: two addends, one rounding); what the one-shot path cannot take goes to NCCL."""
    shapes = [(1, 2), (7, 6), (3, 130), (33, 64), (3000, 64)]
    all_reduce = make_all_reduce("auto", torch.device("cuda"), dtype, 3000 * 64)
    assert all_reduce.one_shot is not None, all_reduce.description
    inputs = [torch.randn(shape, dtype=dtype, device="cuda", generator=seeded(rank)) for shape in shapes]
    assert all(all_reduce.one_shot.takes(x) for x in inputs)
    expected = [x.clone() for x in inputs]
    for x in expected:
        dist.all_reduce(x)
    for x, want in zip(inputs, expected, strict=True):
        torch.testing.assert_close(all_reduce(x), want, rtol=0, atol=0)
    graph, outputs = graphed(lambda: [all_reduce(x) for x in inputs])
    for x in inputs:
        x.mul_(2)  # new inputs in the graph's buffers: the replay sums them
    graph.replay()
    torch.cuda.synchronize()
    for out, want in zip(outputs, expected, strict=True):
        torch.testing.assert_close(out, 2 * want, rtol=0, atol=0)
    odd = torch.ones(5, dtype=torch.bfloat16, device="cuda")  # 10 bytes: not whole 4-byte words
    too_big = torch.ones(ONE_SHOT_MAX_BYTES // 2 + 2, dtype=torch.bfloat16, device="cuda")
    assert not all_reduce.one_shot.takes(odd) and not all_reduce.one_shot.takes(too_big)
    assert all_reduce(odd).tolist() == [float(world)] * 5  # through NCCL


def seeded(rank: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(1000 + rank)


def graphed(fn) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """`fn` captured in a CUDA graph (after one warm-up run on a side stream) and its outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


@pytest.mark.gpu
@two_gpus
def test_one_shot_gives_the_sums_of_nccl_eagerly_and_in_a_cuda_graph():
    """Two processes, one per GPU (a failing rank prints its traceback and exits non-zero)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    spawn = multiprocessing.get_context("spawn")
    procs = [spawn.Process(target=one_shot_sums, args=(rank, 2, port)) for rank in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    hung = [p for p in procs if p.is_alive()]  # waiting in a collective of a rank that failed
    for p in hung:
        p.kill()
    assert [p.exitcode for p in procs] == [0, 0]


@pytest.mark.gpu
@two_gpus
@pytest.mark.parametrize("enforce_eager", [False, True], ids=["graphs", "eager"])
def test_two_gpus_with_the_one_shot_all_reduce_give_transformers_tokens(enforce_eager, reference_outputs):
    """float32 on two GPUs, decode and mixed steps in CUDA graphs (or eager): every all-reduce
    of these small steps takes the one-shot path."""
    prompts = make_prompts(vocab_size=512)
    expected = reference_outputs("tiny-llama", prompts, NEW_TOKENS)  # transformers, float32, CPU
    with LLM(model="tiny-llama", device="cuda", dtype="float32", tensor_parallel_size=2, num_gpu_blocks=128,
             enforce_eager=enforce_eager, all_reduce="auto") as llm:
        described = llm.runner.ranks.call("apply", rank_description)
        assert all(one_shot for _, one_shot in described), described
        assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == expected
