"""What a run writes: a result.json that says what produced it (schema: result.schema.json).

Operations:
- `environment()`: versions (tieredkv, torch, triton, transformers, Python), the git commit of
  a checkout, the date.
- `describe_engine(info)`: the effective engine (`EngineInfo`): its config, each tier's size in blocks,
  tokens and bytes, the I/O backend that ran, the cost model (calibrated or pinned), the device.
- `result_document(...)`: result.json of one run; `comparison_document(...)`: comparison.json.
- `validate(doc)`: check a document against the schema (needs `jsonschema`).
- `write_json(path, doc)`.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

from tieredkv.engine_core.info import EngineInfo, cpu_name
from tieredkv.experiment.metrics import RequestRecord, Summary, comparison_rows, serving_metrics

SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).with_name("result.schema.json")
PACKAGES = ("tieredkv", "torch", "triton", "transformers")
CHECKOUT = Path(__file__).resolve().parents[2]  # the folder holding the package: a checkout, or not


def environment() -> dict[str, Any]:
    """Versions, commit and date of this process."""
    return {
        "versions": {**{name: _version(name) for name in PACKAGES}, "python": platform.python_version()},
        "git_commit": _git_commit(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host_cpu": cpu_name(),
    }


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _git_commit(root: Path = CHECKOUT) -> str | None:
    """HEAD of the git checkout at `root` (`+dirty` with uncommitted changes to tracked files),
    or None where `root` is not one (a source tarball, an installed wheel)."""
    if not (root / ".git").exists():
        return None
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def describe_engine(info: EngineInfo) -> dict[str, Any]:
    """The engine as it ran (what it says of itself at start-up): config, tiers, I/O backend,
    cost model, device."""
    config, stats = info.config, info.startup_stats
    block_size, block_bytes = config.cache.block_size, info.block_bytes
    tiers = {"gpu": _tier(stats["gpu_blocks_total"], block_size, block_bytes)}
    if "cpu_blocks_total" in stats:
        tiers["cpu"] = _tier(stats["cpu_blocks_total"], block_size, block_bytes)
    if "nvme_slots_total" in stats:
        tiers["nvme"] = {**_tier(stats["nvme_slots_total"], block_size, block_bytes),
                         "path": config.cache.nvme_path, "file_bytes": config.cache.nvme_bytes}
    cost = info.cost_model
    source = None if cost is None else "pinned" if config.scheduler.cost_model is not None else "calibrated"
    return {
        "config": config.to_dict(),
        "tiers": tiers,
        "block_bytes": block_bytes,
        "io_backend": stats.get("nvme_io_backend"),
        "cost_model": None if cost is None else {**asdict(cost), "source": source},
        "preemption": config.scheduler.preemption,
        "device": info.device,
        "max_model_len": info.limits.max_model_len,
    }


def _tier(blocks: int, block_size: int, block_bytes: int) -> dict[str, int]:
    return {"blocks": blocks, "tokens": blocks * block_size, "bytes": blocks * block_bytes}


def result_document(
    name: str, engine: dict[str, Any], workload: dict[str, Any], summary: Summary, records: list[RequestRecord],
    start: float, timeline: list[dict[str, Any]], *, point: dict[str, float] | None = None,
    slo: dict[str, Any] | None = None, keep_prompt_ids: bool = False,
) -> dict[str, Any]:
    """result.json of one run; times are seconds since `start` (the monotonic clock of the
    records). `engine`: `describe_engine(...)` (or what a peer engine says of itself);
    `workload`: the workload's kind and keys; `slo`: targets, measured values and verdict."""
    return {
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "partial": summary.partial,
        "load_point": point,
        "workload": workload,
        "engine": engine,
        "environment": environment(),
        "summary": {**asdict(summary), "output_tokens_per_s": summary.output_tokens_per_s,
                    "prefix_hit_rate": summary.prefix_hit_rate},
        "metrics": serving_metrics(summary, records),
        "slo": slo,
        "requests": [_request(r, start, keep_prompt_ids) for r in records],
        "prompt_token_ids_kept": keep_prompt_ids,
        "timeline": timeline,
    }


def _request(r: RequestRecord, start: float, keep_prompt_ids: bool) -> dict[str, Any]:
    doc = {**asdict(r), "arrival": r.arrival - start, "token_times": [t - start for t in r.token_times],
           "ttft": r.ttft, "tpot": r.tpot, "e2el": r.e2el, "ttft_split": r.ttft_phases}
    if not keep_prompt_ids:
        doc.pop("prompt_token_ids")
    return doc


def comparison_document(name: str, summaries: list[Summary], folders: list[str],
                        failed: list[str] | None = None) -> dict[str, Any]:
    """comparison.json: each variant's figures and their ratios to the first variant's, and
    the variants that failed ("name: error")."""
    return {
        "schema_version": SCHEMA_VERSION,
        "name": name,
        "baseline": summaries[0].name,
        "variants": [{**row, "result": os.path.join(folder, "result.json"), "partial": s.partial}
                     for row, s, folder in zip(comparison_rows(summaries), summaries, folders, strict=True)],
        "failed": list(failed or []),
    }


def write_json(path: str, doc: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(doc, f, indent=1, default=str)


def validate(doc: dict[str, Any]) -> None:
    """Raise `jsonschema.ValidationError` if `doc` is not a result.json of this schema."""
    import jsonschema

    jsonschema.validate(doc, json.loads(SCHEMA_PATH.read_text()))
