"""The OpenAI sampling surface over HTTP, driven by the official `openai` client against the real
server: `n`, `best_of`, `seed`, `logprobs` / `top_logprobs` (both formats), `echo`, stop strings
and `stop_token_ids`, `stream_options.include_usage`, `cached_tokens`, token ids where there is no
tokenizer, and the vLLM-named series at /metrics. Every figure is compared with the in-process
engine run on the same weights."""

from __future__ import annotations

import logging
from collections import defaultdict

import pytest

from tests.http_server import running_server
from tieredkv import LLM, AsyncLLM, SamplingParams

NAME = "tiny-chat"
PROMPT = "swap recompute prefix the cache block"
MESSAGES = [{"role": "user", "content": "swap or recompute?"}]
ENGINE = dict(block_size=16, num_gpu_blocks=256, max_num_seqs=64, max_num_batched_tokens=512)
IDS = [5, 17, 99, 4, 250, 31, 8, 77]  # a token-id prompt for the preset


@pytest.fixture(scope="module")
def server(chat_model_dir):
    with running_server(AsyncLLM(model=chat_model_dir, **ENGINE), NAME) as running:
        yield running


@pytest.fixture(scope="module")
def reference(chat_model_dir):
    with LLM(model=chat_model_dir, **ENGINE) as llm:
        yield llm


@pytest.fixture(scope="module")
def preset_server():
    with running_server(AsyncLLM(model="tiny-llama", **ENGINE), "tiny-llama") as running:
        yield running


@pytest.fixture(scope="module")
def preset_reference():
    with LLM(model="tiny-llama", **ENGINE) as llm:
        yield llm


def run(llm: LLM, prompt, **params):
    return llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0]


def sampled(out):
    """(token id, its logprobs entry) of each generated token."""
    return zip(out.token_ids, out.logprobs, strict=True)


def by_index(chunks) -> dict[int, list]:
    """Streamed choices grouped by their index, in order."""
    out = defaultdict(list)
    for c in chunks:
        for choice in c.choices:
            out[choice.index].append(choice)
    return out


# ---------------------------------------------------------------- no tokenizer: token ids


def test_a_preset_returns_its_token_ids(preset_server, preset_reference):
    want = run(preset_reference, IDS, max_tokens=8, temperature=0.0, ignore_eos=True).token_ids
    client = preset_server.client()
    got = client.completions.create(model="tiny-llama", prompt=IDS, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True}).choices[0]
    assert got.model_extra["token_ids"] == want
    assert got.text == "".join(f"token_id:{t}" for t in want)
    chunks = list(client.completions.create(model="tiny-llama", prompt=IDS, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True}, stream=True))
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == want
    assert "".join(c.choices[0].text for c in chunks) == got.text
    echoed = client.completions.create(model="tiny-llama", prompt=IDS, max_tokens=2, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith("".join(f"token_id:{t}" for t in IDS))


def test_token_ids_on_request_with_a_tokenizer(server, reference):
    want = run(reference, PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True)
    got = server.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0,
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
    assert got.choices[0].model_extra["token_ids"] == want.token_ids and got.choices[0].text == want.text
    plain = server.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=2, temperature=0)
    assert "token_ids" not in plain.choices[0].model_extra


# ---------------------------------------------------------------- n, best_of, seed


def test_n_samples_equal_in_process_with_the_same_seed(preset_server, preset_reference):
    want = run(preset_reference, IDS, n=4, seed=7, temperature=1.0, max_tokens=10, ignore_eos=True)
    expected = [c.token_ids for c in want.outputs]
    assert len({tuple(t) for t in expected}) > 1, "the samples differ from each other"
    client = preset_server.client()
    got = client.completions.create(model="tiny-llama", prompt=IDS, n=4, seed=7, temperature=1.0, max_tokens=10,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert [c.model_extra["token_ids"] for c in got.choices] == expected
    assert got.usage.completion_tokens == 40
    chunks = list(client.completions.create(model="tiny-llama", prompt=IDS, n=4, seed=7, temperature=1.0,
                                            max_tokens=10, extra_body={"ignore_eos": True}, stream=True,
                                            stream_options={"include_usage": True}))
    *tokens, last = chunks
    assert all(len(c.choices) == 1 for c in tokens) and last.choices == []
    streamed = by_index(tokens)
    assert sorted(streamed) == [0, 1, 2, 3]
    assert [[t for c in streamed[j] for t in c.model_extra["token_ids"]] for j in range(4)] == expected
    assert [streamed[j][-1].finish_reason for j in range(4)] == ["length"] * 4
    assert last.usage.completion_tokens == 40 and last.usage.prompt_tokens == len(IDS)


def test_two_prompts_with_n_number_their_choices_prompt_major(preset_server, preset_reference):
    other = IDS[::-1]
    want = preset_reference.generate([IDS, other], SamplingParams(n=2, seed=3, max_tokens=5, ignore_eos=True),
                                     use_tqdm=False)
    got = preset_server.client().completions.create(model="tiny-llama", prompt=[IDS, other], n=2, seed=3,
                                                    max_tokens=5, extra_body={"ignore_eos": True})
    assert [c.model_extra["token_ids"] for c in got.choices] == [c.token_ids for o in want for c in o.outputs]


def test_best_of_returns_the_most_likely_samples(preset_server, preset_reference):
    want = run(preset_reference, IDS, n=2, best_of=5, seed=11, max_tokens=6, ignore_eos=True)
    got = preset_server.client().completions.create(model="tiny-llama", prompt=IDS, n=2, best_of=5, seed=11,
                                                    max_tokens=6, extra_body={"ignore_eos": True})
    assert [c.model_extra["token_ids"] for c in got.choices] == [c.token_ids for c in want.outputs]


def test_the_same_seed_gives_the_same_text(server):
    client = server.client()
    texts = [client.completions.create(model=NAME, prompt=PROMPT, seed=5, temperature=1.0, max_tokens=12)
             .choices[0].text for _ in range(2)]
    assert texts[0] == texts[1]


# ---------------------------------------------------------------- logprobs


def test_completion_logprobs(server, reference):
    want = run(reference, PROMPT, max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3).outputs[0]
    client = server.client()
    got = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True}).choices[0].logprobs
    assert got.token_logprobs == pytest.approx([e[t].logprob for t, e in sampled(want)])
    assert got.tokens == [e[t].decoded_token for t, e in sampled(want)]
    # the top 3 by text: two tokens of one text ("\ufffd" halves of a character) are one key
    assert [len(top) for top in got.top_logprobs] == [len({e[i].decoded_token for i in list(e)[:3]})
                                                      for e in want.logprobs]
    # greedy: each sampled token is the most likely one
    assert [max(top, key=top.get) for top in got.top_logprobs] == got.tokens
    assert got.text_offset == [sum(map(len, got.tokens[:i])) for i in range(6)]
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3,
                                            extra_body={"ignore_eos": True}, stream=True))
    assert [t for c in chunks for t in c.choices[0].logprobs.tokens] == got.tokens
    assert [o for c in chunks for o in c.choices[0].logprobs.text_offset] == got.text_offset


def test_chat_logprobs(server, reference):
    want = reference.chat(MESSAGES, SamplingParams(max_tokens=5, temperature=0.0, logprobs=2), use_tqdm=False)
    want = want[0].outputs[0]
    got = server.client().chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=5, temperature=0,
                                                  logprobs=True, top_logprobs=2).choices[0].logprobs.content
    assert [e.token for e in got] == [e[t].decoded_token for t, e in sampled(want)]
    assert [e.logprob for e in got] == pytest.approx([e[t].logprob for t, e in sampled(want)])
    for entry in got:
        assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
    plain = server.client().chat.completions.create(model=NAME, messages=MESSAGES, max_tokens=2)
    assert plain.choices[0].logprobs is None


# ---------------------------------------------------------------- echo, stops, usage


def test_echo_puts_the_prompt_before_the_text(server, reference):
    want = run(reference, PROMPT, max_tokens=5, temperature=0.0, ignore_eos=True).text
    client = server.client()
    got = client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == PROMPT + want
    chunks = list(client.completions.create(model=NAME, prompt=PROMPT, max_tokens=5, temperature=0, echo=True,
                                            extra_body={"ignore_eos": True}, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT) and "".join(c.choices[0].text for c in chunks) == PROMPT + want


def test_stop_token_ids_end_the_choice(server, reference):
    full = run(reference, PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True).token_ids
    stop = full[3]
    cut = full[: full.index(stop) + 1]
    want = run(reference, PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True, stop_token_ids=(stop,))
    assert want.token_ids == cut
    got = server.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=12, temperature=0,
                                             extra_body={"ignore_eos": True, "stop_token_ids": [stop]})
    assert got.choices[0].finish_reason == "stop" and got.usage.completion_tokens == len(cut)
    assert got.choices[0].text == want.text


def test_cached_tokens_after_a_repeated_prompt(server):
    client = server.client()
    prompt = "a repeated document about tiers " * 6  # several full blocks
    first = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    second = client.completions.create(model=NAME, prompt=prompt, max_tokens=2, temperature=0)
    full_blocks = (first.usage.prompt_tokens - 1) // 16 * 16
    assert full_blocks >= 32 and second.usage.prompt_tokens_details.cached_tokens == full_blocks
    chunks = list(client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=2, stream=True,
        stream_options={"include_usage": True}))
    again = list(client.chat.completions.create(
        model=NAME, messages=[{"role": "user", "content": prompt}], max_tokens=2, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens < again[-1].usage.prompt_tokens_details.cached_tokens


def test_unknown_fields_are_logged(server, caplog):
    with caplog.at_level(logging.WARNING, logger="tieredkv.serve.protocol"):
        server.client().completions.create(model=NAME, prompt=PROMPT, max_tokens=1,
                                           extra_body={"some_future_field": 1, "user": "me"})
    warnings = [r.getMessage() for r in caplog.records if r.name == "tieredkv.serve.protocol"]
    assert warnings == ["ignored fields neither OpenAI's nor vLLM's API has: some_future_field"]


# ---------------------------------------------------------------- /metrics


def test_vllm_series_at_metrics(preset_server):
    before = preset_server.settled()
    client = preset_server.client()
    usages = [client.completions.create(model="tiny-llama", prompt=IDS * 5, max_tokens=4, n=2, seed=1,
                                        extra_body={"ignore_eos": True}).usage for _ in range(3)]
    after = preset_server.settled()

    def grew(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    assert grew("vllm:prompt_tokens_total") == sum(u.prompt_tokens for u in usages) == 3 * 40
    assert grew("vllm:generation_tokens_total") == sum(u.completion_tokens for u in usages) == 3 * 8
    assert grew("vllm:prefix_cache_queries_total") == 120
    assert grew("vllm:prefix_cache_hits_total") == sum(u.prompt_tokens_details.cached_tokens for u in usages) == 64
    assert grew('vllm:request_success_total{finished_reason="length"}') == 3
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds"):
        assert grew(f"vllm:{name}_count") == 3 and grew(f"vllm:{name}_sum") > 0
    assert grew("vllm:inter_token_latency_seconds_count") == 3 * 3  # 4 outputs a request: 3 gaps
    assert after["vllm:num_requests_running"] == after["vllm:num_requests_waiting"] == 0
    assert after["vllm:kv_cache_usage_perc"] == 0.0
    assert grew("tieredkv_output_tokens_total") == 24  # our own series stay
