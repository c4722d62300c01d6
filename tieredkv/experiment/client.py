"""`tieredkv bench`: a YAML experiment's workload replayed against any OpenAI-compatible server.

Operations:
- `HttpClient(http, model, bar)`: the workloads' `Client` over HTTP: each request streams
  `POST /v1/completions` (prompt as token ids, or as text with a tokenizer; greedy, `ignore_eos`,
  `stream_options.include_usage`, `return_token_ids`) and records what the client sees
  (`RequestRecord`: one time per token, prompt and cached tokens from the usage chunk).
- `bench(config, base_url, out_dir, ...) -> Bench`: the file's workload (base config: no
  variants or sweeps) sent as `tieredkv run` sends it, its result.json (the same schema: the
  figures `metrics.py` makes, the SLO verdict) and plots under `OUT/<name>-bench/`.

A server that exports tieredkv's series at /metrics (`tieredkv serve`) is also sampled while the
workload runs: the blocks per tier over time (`timeline`) and its stats at the end (`summary.stats`);
of another server only the clients' figures are known, and `engine` holds its URL and model.
A chunk without `token_ids` counts as one token if it carries text (as `vllm bench serve` counts).
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm.auto import tqdm

from tieredkv.config import check_int
from tieredkv.experiment.harness import TIMELINE_KEYS
from tieredkv.experiment.metrics import RequestRecord, Summary, summarize
from tieredkv.experiment.plots import write_plots
from tieredkv.experiment.results import result_document, write_json
from tieredkv.experiment.sending import FIRST_TOKEN_ID
from tieredkv.experiment.spec import load_experiment, prepare_results
from tieredkv.experiment.workloads import describe_workload

SCRAPE_PERIOD_S = 0.25
STAT_PREFIX = "tieredkv_"


class HttpClient:
    """Sends a workload's requests to `/v1/completions` and records what it sees."""

    def __init__(self, http: httpx.AsyncClient, model: str, bar: tqdm, tokenizer: Any = None) -> None:
        self.http, self.model, self.bar, self.tokenizer = http, model, bar, tokenizer
        self.records: list[RequestRecord] = []

    async def request(self, prompt: list[int] | str, max_tokens: int, tag: str, returning: bool = False) -> list[int]:
        record = RequestRecord(tag, time.monotonic(), returning)
        self.records.append(record)
        if self.tokenizer is not None and not isinstance(prompt, str):
            prompt = self.tokenizer.decode(prompt)
        record.prompt_tokens = len(prompt) if isinstance(prompt, list) else 0
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                "return_token_ids": True}
        text: list[str] = []
        try:
            async with self.http.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    record.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')}"
                else:
                    async for line in response.aiter_lines():
                        if line.startswith("data: ") and line != "data: [DONE]":
                            self._event(record, json.loads(line[len("data: "):]), text)
        except httpx.HTTPError as err:
            record.error = f"{type(err).__name__}: {err}"
        record.finished = True
        self.bar.update(1)
        if not record.output_token_ids and self.tokenizer is not None:  # a server that sends no ids
            record.output_token_ids = self.tokenizer.encode("".join(text), add_special_tokens=False)
        return list(record.output_token_ids)

    @staticmethod
    def _event(record: RequestRecord, event: dict[str, Any], text: list[str]) -> None:
        """One SSE event: a chunk's tokens (their arrival time, once per token), the usage, or an error."""
        if "error" in event:
            record.error = str(event["error"].get("message", event["error"]))
            return
        now = time.monotonic()
        for choice in event.get("choices") or ():
            ids = choice.get("token_ids")
            count = len(ids) if ids is not None else int(bool(choice.get("text")))
            record.token_times += [now] * count
            record.output_token_ids += ids or []
            text.append(choice.get("text") or "")
        usage = event.get("usage")
        if usage:
            record.prompt_tokens = usage.get("prompt_tokens", record.prompt_tokens)
            record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0


async def server_stats(http: httpx.AsyncClient) -> dict[str, Any]:
    """tieredkv's stats as its server exports them at /metrics (`tieredkv_<stat>` gauges; those
    with a `kind` label as mappings); empty for a server that exports none."""
    try:
        from prometheus_client.parser import text_string_to_metric_families

        response = await http.get("/metrics")
    except (ImportError, httpx.HTTPError):
        return {}
    if response.status_code != 200:
        return {}
    stats: dict[str, Any] = {}
    for family in text_string_to_metric_families(response.text):
        if family.type != "gauge" or not family.name.startswith(STAT_PREFIX):
            continue
        for sample in family.samples:
            value = int(sample.value) if float(sample.value).is_integer() else sample.value
            key = family.name[len(STAT_PREFIX):]
            if "kind" in sample.labels:
                stats.setdefault(key, {})[sample.labels["kind"]] = value
            else:
                stats[key] = value
    return stats


@dataclass
class Bench:
    """What `bench` did: the run's summary, its result document and the folder it wrote."""

    summary: Summary
    result: dict[str, Any]
    folder: str


def bench(config: str, base_url: str, out_dir: str = "results", model: str | None = None,
          tokenizer: str | None = None, vocab_size: int | None = None, use_tqdm: bool = True) -> Bench:
    """Replay `config`'s workload against the server at `base_url` (module docstring); `model`:
    the served name (default: the server's first model); `vocab_size`: the range of the random
    token ids (default: the tokenizer's, else the config's model's)."""
    if vocab_size is not None:
        check_int("--vocab-size", vocab_size, FIRST_TOKEN_ID + 1)  # ids are drawn from FIRST_TOKEN_ID up
    experiment = load_experiment(config, out_dir, base_only=True)
    run = experiment.runs[0]
    folder = os.path.join(out_dir, f"{experiment.name}-bench")
    prepare_results(folder)
    tok = None
    if tokenizer is not None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer)
    vocab = vocab_size or (len(tok) if tok is not None else config_vocab_size(run.engine_doc.get("model")))
    summary, result = asyncio.run(_replay(experiment, run, base_url.rstrip("/"), model, tok, vocab, use_tqdm))
    write_json(os.path.join(folder, "result.json"), result)
    write_plots(result, folder)
    return Bench(summary, result, folder)


async def _replay(experiment: Any, run: Any, base_url: str, model: str | None, tok: Any, vocab: int,
                  use_tqdm: bool) -> tuple[Summary, dict[str, Any]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(None), limits=limits) as http:
        model = model or await served_model(http)
        name = f"{experiment.name}-bench"
        timeline: list[dict[str, Any]] = []
        with tqdm(total=run.workload.num_requests, desc=name, unit="req", disable=not use_tqdm) as bar:
            client = HttpClient(http, model, bar, tok)
            start = time.monotonic()
            sampler = asyncio.create_task(_timeline(http, start, timeline))
            try:
                await run.workload.run(client, vocab)
            finally:
                sampler.cancel()
                await asyncio.gather(sampler, return_exceptions=True)
            elapsed = time.monotonic() - start
        stats = await server_stats(http)
    summary = summarize(name, client.records, elapsed, stats)
    engine = {"config": {"model": model, "cache": {}, "scheduler": {}}, "tiers": {}, "io_backend": None,
              "cost_model": None, "device": f"the server at {base_url}",
              "server": {"base_url": base_url, "model": model}}
    result = result_document(name, engine, describe_workload(run.workload), summary, client.records, start, timeline,
                             slo=experiment.slo.report(client.records, summary) if experiment.slo else None)
    return summary, result


async def served_model(http: httpx.AsyncClient) -> str:
    """The first model the server lists at /v1/models."""
    try:
        response = await http.get("/v1/models")
        response.raise_for_status()
        return response.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as err:
        raise ValueError(f"--base-url: cannot list the server's models at {http.base_url}/v1/models ({err}); "
                         "check the URL (it ends before /v1), or name the model with --model") from None


async def _timeline(http: httpx.AsyncClient, start: float, samples: list[dict[str, Any]]) -> None:
    """The server's blocks per tier (tieredkv's series) every SCRAPE_PERIOD_S, while it exports them."""
    while True:
        stats = await server_stats(http)
        if "gpu_blocks_used" not in stats:
            return
        samples.append({"t": time.monotonic() - start, **{k: stats.get(k, 0) for k in TIMELINE_KEYS}})
        await asyncio.sleep(SCRAPE_PERIOD_S)


def config_vocab_size(model: str | None) -> int:
    """The vocabulary of the config's model: a preset's, or a model directory's config.json."""
    from tieredkv.model.presets import PRESETS

    if model in PRESETS:
        return PRESETS[model][1]["vocab_size"]
    try:
        with open(os.path.join(str(model), "config.json")) as f:
            return int(json.load(f)["vocab_size"])
    except (OSError, ValueError, KeyError) as err:
        raise ValueError(f"model: cannot read the vocabulary size of {model!r} ({err}); give --vocab-size or "
                         "--tokenizer") from None
