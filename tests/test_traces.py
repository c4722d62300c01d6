"""Replayed traces: the Mooncake FAST'25 format, selection, and errors that name the line."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import yaml

from tieredkv.cli import main
from tieredkv.experiment.harness import run_experiment
from tieredkv.experiment.traces import prompt_token_ids, read_trace, select
from tieredkv.experiment.workloads import make_workload

BLOCK = 16  # tokens per hash id in these traces (engine blocks of 4)
VOCAB = 512  # tiny-llama


def conversation(ids, start_ms: int, turns: int, gap_ms: int, shared: list[int]) -> list[dict]:
    """`turns` requests, each extending the previous one's full blocks by two blocks and ending
    in a partial block of 8 tokens (as a chat turn's history grows)."""
    history, lines = list(shared), []
    for t in range(turns):
        full = history + [next(ids), next(ids)]
        lines.append({"timestamp": start_ms + t * gap_ms, "input_length": len(full) * BLOCK + 8,
                      "output_length": 3, "hash_ids": full + [next(ids)]})
        history = full
    return lines


def mooncake_trace() -> tuple[list[dict], set[int], dict[int, int]]:
    """30 lines, sorted by time: 8 conversations (6 of 3 turns, 2 of 2), 6 single requests and 2
    that share a conversation's first blocks without extending its prompt. Every line starts with
    hash id 0 (a system prompt all share). Returns the lines, the numbers of the returning lines,
    and each line's conversation (its first line's number)."""
    ids = itertools.count(1)
    convs = [conversation(ids, c * 1000, 3 if c < 6 else 2, 9000, [0]) for c in range(8)]
    singles = [conversation(ids, 500 + 1000 * s, 1, 0, [0]) for s in range(6)]
    first = convs[0][0]["hash_ids"]  # [0, a, b, partial]
    siblings = [[{"timestamp": 2500 + 4000 * k, "input_length": 3 * BLOCK + 4,
                  "output_length": 3, "hash_ids": first[:2] + [next(ids), next(ids)]}] for k in range(2)]
    groups = convs + singles + siblings
    tagged = sorted(((line, g, t) for g, group in enumerate(groups) for t, line in enumerate(group)),
                    key=lambda x: x[0]["timestamp"])
    lines = [line for line, _, _ in tagged]
    firsts = {g: n + 1 for n, (_, g, t) in enumerate(tagged) if t == 0}
    returning = {n + 1 for n, (_, _, t) in enumerate(tagged) if t > 0}
    return lines, returning, {n + 1: firsts[g] for n, (_, g, _) in enumerate(tagged)}


def write_trace(tmp_path, lines: list[dict], name: str = "trace.jsonl") -> str:
    path = tmp_path / name
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(path)


def test_mooncake_lines_become_prompts_sharing_exactly_their_hash_ids(tmp_path):
    lines, returning, conversation_of = mooncake_trace()
    assert len(lines) == 30
    trace = read_trace(write_trace(tmp_path, lines), block_tokens=BLOCK)
    requests = select(trace, block_tokens=BLOCK)
    assert {r.line.line for r in requests if r.returning} == returning
    assert {r.line.line: r.conversation for r in requests} == conversation_of
    prompts = [prompt_token_ids(line, BLOCK, VOCAB) for line in trace]
    for line, prompt in zip(trace, prompts, strict=True):
        assert len(prompt) == line.input_length and all(4 <= t < VOCAB for t in prompt)
    for (a, pa), (b, pb) in itertools.combinations(zip(trace, prompts, strict=True), 2):
        shared = next((i for i, (x, y) in enumerate(zip(a.hash_ids, b.hash_ids, strict=False)) if x != y),
                      min(len(a.hash_ids), len(b.hash_ids)))
        full = min(shared, a.input_length // BLOCK, b.input_length // BLOCK)
        assert pa[: full * BLOCK] == pb[: full * BLOCK]  # the same ids, the same tokens
        if shared < min(len(a.hash_ids), len(b.hash_ids)):  # then different blocks: different tokens
            assert pa[shared * BLOCK : (shared + 1) * BLOCK] != pb[shared * BLOCK : (shared + 1) * BLOCK]


def expected_hits(prompts: list[list[int]], engine_block: int) -> list[int]:
    """Prompt tokens a prefix cache holding every earlier prompt gives each request: its longest
    common prefix with one of them, in whole blocks, leaving one token to compute."""
    hits = []
    for i, prompt in enumerate(prompts):
        def common(p: list[int], prompt: list[int] = prompt) -> int:
            diffs = (k for k, (x, y) in enumerate(zip(prompt, p, strict=False)) if x != y)
            return next(diffs, min(len(prompt), len(p)))

        lcp = max((common(p) for p in prompts[:i]), default=0)
        hits.append(min(lcp, len(prompt) - 1) // engine_block * engine_block)
    return hits


def test_mooncake_replay_hits_the_shared_prefixes(tmp_path):
    """Replayed on a tiny model with a GPU cache big enough to keep every block: each request
    finds exactly its longest common prefix with an earlier one, and later turns are returning."""
    lines, returning, _ = mooncake_trace()
    path = write_trace(tmp_path, lines)
    # 23 s of trace in 2.8 s: a line's prefix is computed long before a line that extends it comes
    scale = 0.12
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump({
        "name": "exp", "model": "tiny-llama", "cache": {"block_size": 4, "num_gpu_blocks": 1024},
        "scheduler": {"preemption": "recompute", "max_num_batched_tokens": 256},
        "workload": {"kind": "replay", "path": path, "block_tokens": BLOCK, "time_scale": scale,
                     "max_output_tokens": 2}}))
    outcome = run_experiment(str(config), str(tmp_path / "out"), use_tqdm=False)
    result = json.loads((tmp_path / "out" / "exp" / "result.json").read_text())
    trace = read_trace(path, block_tokens=BLOCK)
    hits = expected_hits([prompt_token_ids(line, BLOCK, VOCAB) for line in trace], 4)
    by_tag = {r["tag"]: r for r in result["requests"]}
    assert [by_tag[f"line{n}"]["cached_tokens"] for n in range(1, 31)] == hits
    assert {int(tag[4:]) for tag, r in by_tag.items() if r["returning"]} == returning
    assert all(len(r["output_token_ids"]) == 2 for r in result["requests"])  # output_length 3, capped at 2
    [summary] = outcome.summaries
    assert summary.stats["prefix_hit_tokens"] == summary.cached_tokens == sum(hits)
    assert summary.prefix_hit_rate == pytest.approx(sum(hits) / sum(line.input_length for line in trace))
    assert result["workload"]["trace"] == {
        "format": "mooncake", "lines": 30, "requests": 30, "returning": len(returning), "conversations": 16,
        "span_s": pytest.approx(lines[-1]["timestamp"] / 1e3 * scale), "offered_rate": pytest.approx(
            29 / (lines[-1]["timestamp"] / 1e3 * scale)), "prompt_tokens": sum(line.input_length for line in trace),
        "prefix_hit_bound": pytest.approx(summary.prefix_hit_rate)}  # a GPU keeping every block reaches the bound


def test_time_scaling_window_and_sampling_are_deterministic(tmp_path):
    lines, _, conversation_of = mooncake_trace()
    trace = read_trace(write_trace(tmp_path, lines), block_tokens=BLOCK)
    times = [line["timestamp"] / 1e3 for line in lines]
    scaled = select(trace, block_tokens=BLOCK, time_scale=0.5)
    assert [r.time_s for r in scaled] == pytest.approx([t * 0.5 for t in times])
    paced = select(trace, block_tokens=BLOCK, rate=10.0)  # 30 requests at 10/s: 2.9 s from first to last
    assert paced[-1].time_s == pytest.approx(2.9) and [r.line.line for r in paced] == list(range(1, 31))
    window = select(trace, block_tokens=BLOCK, start_s=5.0, duration_s=10.0)
    assert [r.line.line for r in window] == [n + 1 for n, t in enumerate(times) if 5.0 <= t < 15.0]
    assert window[0].time_s == 0.0
    assert [r.line.line for r in select(trace, block_tokens=BLOCK, max_requests=7)] == list(range(1, 8))

    def sample(seed: int) -> list[int]:
        return [r.line.line for r in select(trace, block_tokens=BLOCK, fraction=0.5, seed=seed)]

    assert sample(3) == sample(3) and sample(4) == sample(4) and sample(3) != sample(4)
    for seed in (3, 4):  # whole conversations: every line of a kept conversation is kept
        kept = set(sample(seed))
        assert kept == {n for n, c in conversation_of.items() if c in {conversation_of[k] for k in kept}}
        assert 0 < len(kept) < 30
    # a returning line whose earlier turn was left out of the window is a first request there
    late = select(trace, block_tokens=BLOCK, start_s=15.0)
    assert not late[0].returning and conversation_of[late[0].line.line] != late[0].line.line


def test_replay_options_through_the_workload(tmp_path):
    lines, _, _ = mooncake_trace()
    path = write_trace(tmp_path, lines)
    workload = make_workload({"kind": "replay", "path": path, "block_tokens": BLOCK, "max_requests": 5,
                              "max_output_tokens": 2, "max_input_tokens": 60})
    assert workload.num_requests == 5
    assert all(r.line.input_length <= 60 and workload.output_tokens(r) == 2 for r in workload.requests)
    with pytest.raises(ValueError, match="set either rate .* or time_scale"):
        make_workload({"kind": "replay", "path": path, "rate": 2.0, "time_scale": 0.5})
    with pytest.raises(ValueError, match=r"workload.fraction: expected a fraction .* in \(0, 1\]"):
        make_workload({"kind": "replay", "path": path, "fraction": 0})
    with pytest.raises(ValueError, match="is workload.block_tokens right"):  # 16-token blocks read as 512
        make_workload({"kind": "replay", "path": path}).num_requests  # noqa: B018


GOOD = {"timestamp": 0, "input_length": 40, "output_length": 3, "hash_ids": [0, 1, 2]}


@pytest.mark.parametrize(
    "line, message",
    [
        ({**GOOD, "timestmp": 5}, "line 2: unknown field 'timestmp': did you mean 'timestamp'?"),
        ({k: v for k, v in GOOD.items() if k != "hash_ids"}, "line 2: field 'hash_ids' is missing"),
        ({**GOOD, "input_length": "40"}, "line 2: field 'input_length': expected an integer >= 1, got '40'"),
        ({**GOOD, "output_length": 0}, "line 2: field 'output_length': expected an integer >= 1, got 0"),
        ({**GOOD, "timestamp": -1}, "line 2: field 'timestamp': expected a finite number >= 0, got -1"),
        ({**GOOD, "timestamp": float("inf")}, "line 2: field 'timestamp': expected a finite number >= 0, got inf"),
        ({**GOOD, "hash_ids": [0, 1]}, "line 2: field 'hash_ids': 2 hash ids for input_length 40"),
        ({**GOOD, "hash_ids": [0, "1", 2]}, "line 2: field 'hash_ids': expected a list of integers"),
        ("{not json", "line 2: not a JSON object"),
        ([1, 2], "line 2: expected a JSON object, got list"),
    ],
)
def test_a_malformed_mooncake_line_names_line_and_field(tmp_path, line, message):
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps(GOOD) + "\n" + (line if isinstance(line, str) else json.dumps(line)) + "\n")
    with pytest.raises(ValueError, match=f"{path} {message}"):
        make_workload({"kind": "replay", "path": str(path), "block_tokens": BLOCK}).num_requests  # noqa: B018


@pytest.mark.parametrize(
    "line, message",
    [  # a prompts-format file: a Mooncake field, or a misspelt one, is not silently t = 0
        ({"timestamp": 50, "prompt": [5, 6]}, "line 2: unknown field 'timestamp'"),
        ({"tme": 0.5, "prompt": [5, 6]}, "line 2: unknown field 'tme': did you mean 'time'?"),
        ({"time": 0.5}, "line 2: give one of the fields 'prompt' .* or 'text'"),
        ({"time": "soon", "prompt": [5]}, "line 2: field 'time': expected a finite number >= 0"),
        ({"time": float("inf"), "prompt": [5]}, "line 2: field 'time': expected a finite number >= 0, got inf"),
        ({"prompt": [5, 6.5]}, "line 2: field 'prompt': expected a non-empty list of token ids"),
        # loaded, these failed only when sent, or with an error naming no line
        ({"prompt": [-1, 2]}, r"line 2: field 'prompt': expected a non-empty list of token ids >= 0, got \[-1, 2\]"),
        ({"prompt": []}, r"line 2: field 'prompt': expected a non-empty list of token ids >= 0, got \[\]"),
        ({"text": ""}, "line 2: field 'text': expected a non-empty string, got ''"),
        pytest.param('{"time": 1' + "0" * 400 + ', "prompt": [5]}',
                     "line 2: field 'time': expected a finite number >= 0, got 10", id="past-the-largest-float"),
        pytest.param('{"time": 1' + "0" * 5000 + ', "prompt": [5]}', "line 2: not a JSON object: Exceeds the limit",
                     id="past-the-digits-python-converts"),
    ],
)
def test_a_malformed_prompts_line_names_line_and_field(tmp_path, line, message):
    path = tmp_path / "trace.jsonl"
    path.write_text(json.dumps({"time": 0.0, "prompt": [5, 6, 7]}) + "\n"
                    + (line if isinstance(line, str) else json.dumps(line)) + "\n")
    with pytest.raises(ValueError, match=f"{path} {message}"):
        make_workload({"kind": "replay", "path": str(path)}).num_requests  # noqa: B018


def test_cli_names_a_bad_trace_line_before_running(tmp_path, capsys):
    path = write_trace(tmp_path, [GOOD, {**GOOD, "timestmp": 5}])
    config = tmp_path / "exp.yaml"
    config.write_text(yaml.safe_dump({"name": "exp", "model": "tiny-llama",
                                      "workload": {"kind": "replay", "path": path, "block_tokens": BLOCK}}))
    assert main(["run", str(config), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines() == [f"tieredkv: error: workload.path: {path} line 2: unknown field 'timestmp': did you "
                                "mean 'timestamp'? (the mooncake format has timestamp, input_length, output_length, "
                                "hash_ids)"]
    assert not (tmp_path / "out" / "exp" / "result.json").exists()


def test_shipped_mooncake_slice_reads_as_documented():
    from tieredkv.experiment.spec import load_experiment

    experiment = load_experiment(str(Path(__file__).resolve().parents[1] / "configs" / "mooncake_8b.yaml"))
    assert [r.name for r in experiment.runs][:3] == [f"mooncake_8b/recompute-only/rate={r}" for r in (4, 6, 8)]
    assert len(experiment.runs) == 9
    trace = experiment.runs[0].workload.describe()
    assert (trace["format"], trace["lines"], trace["requests"], trace["returning"]) == ("mooncake", 266, 158, 46)
