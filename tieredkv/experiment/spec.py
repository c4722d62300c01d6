"""An experiment file, read and checked before anything runs.

Operations:
- `load_experiment(path, out_dir, compare, sweep) -> Experiment`: the YAML file's engine config,
  `variants:` (each a partial config over the base one), `workload:`, load points (`sweep:` or
  `--sweep rate=0.5,1,2`), `slo:` and a warm restart (`restart_after_s`, `restart_store`, in
  the base or a variant); its `runs`, one per variant and load point. Every error names the key
  (or the trace line, or the variant) and the fix; a variant's model must be found.
- `preflight(experiment)`: what would otherwise fail after the workload ran: the results
  folder must be writable (it is emptied: it holds only the last run's files), a store must
  not be locked by another process.

Relative paths in the file (`model` directories, `cache.nvme_path`, `workload.path`) are taken
from the file's folder; `${results}` in `nvme_path` stands for the run's results folder, so that
such a store is emptied with it.
"""

from __future__ import annotations

import copy
import fcntl
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from tieredkv.config import (
    EXPERIMENT_SECTIONS,
    EngineConfig,
    check_choice,
    read_yaml,
    resolve_paths,
    unknown_key,
)
from tieredkv.experiment.slo import Slo
from tieredkv.experiment.workloads import WORKLOADS, Workload, make_workload
from tieredkv.model.locate import locate_model

RESULTS_MARK = ".tieredkv-results"  # a results folder `tieredkv run` made (and may empty)
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
RestartStore = Literal["keep", "empty"]
RESTART_KEYS = ("restart_after_s", "restart_store")  # run keys a variant may set beside engine keys


@dataclass(frozen=True)
class Restart:
    """Close the engine `after_s` seconds into the workload and open a new one on the same config
    while the clients go on. `store`: "keep" (the new engine finds the NVMe store's blocks) or
    "empty" (the store file is removed first)."""

    after_s: float
    store: RestartStore = "keep"


@dataclass(frozen=True)
class Run:
    """One engine, one workload: a variant at a load point. `point`: (workload key, value)."""

    name: str
    folder: str
    variant: str | None
    point: tuple[str, float] | None
    engine_doc: dict[str, Any]
    workload: Workload
    restart: Restart | None = None


@dataclass(frozen=True)
class Experiment:
    """A checked experiment file: what to run and where its results go."""

    path: str
    name: str
    folder: str
    runs: list[Run]
    slo: Slo | None
    sweep: tuple[str, list[float]] | None
    compare: bool


def load_experiment(path: str, out_dir: str = "results", compare: bool = False,
                    sweep: str | None = None, base_only: bool = False,
                    only: list[str] | None = None) -> Experiment:
    """Read and check the experiment file (module docstring); `base_only`: one run of the base
    config, whatever the file's variants and load points; `only`: these variants, in this order
    (a compare; run it again reversed to see what the order did)."""
    doc = read_yaml(path)
    EngineConfig.from_dict(doc, extra_sections=EXPERIMENT_SECTIONS)  # the base must be valid on its own
    name = _folder_name("name", doc.get("name", Path(path).stem))
    base_dir = os.path.dirname(os.path.abspath(path))
    if not isinstance(doc.get("workload") or {}, dict):
        raise ValueError("workload: expected a mapping with a kind and its keys")
    section = dict(doc.get("workload") or {})
    if isinstance(section.get("path"), str):
        section["path"] = os.path.normpath(os.path.join(base_dir, os.path.expanduser(section["path"])))
    points = parse_sweep(sweep) if sweep is not None else _sweep_section(doc.get("sweep"))
    if base_only:
        points, compare = None, False
    if points is not None:
        _check_sweep_key(points[0], section)
    slo = Slo.from_dict(doc["slo"]) if doc.get("slo") is not None else None
    folder = os.path.join(out_dir, name)
    compare = compare or only is not None
    listed = _variants(doc, compare or (points is not None and bool(doc.get("variants"))) and not base_only)
    if only is not None and not base_only:
        listed = _select(listed, only)
    runs = []
    for variant, override in listed:
        for value in points[1] if points else [None]:
            run_folder = os.path.join(folder, *([variant] if variant else []),
                                      *([f"{points[0]}={value:g}"] if value is not None else []))
            run_name = "/".join([name, *([variant] if variant else []),
                                 *([f"{points[0]}={value:g}"] if value is not None else [])])
            engine_doc = resolve_paths(_merge(_base(doc), _engine_keys(override)), base_dir, run_folder)
            where = variant_key(listed, variant) if variant else ""
            _check_engine(engine_doc, where)
            restart = parse_restart({**_run_keys(doc), **_run_keys(override)}, engine_doc, where)
            workload = make_workload({**section, points[0]: value} if value is not None else section)
            workload.num_requests  # noqa: B018 -- reads and checks a trace now, not after a run
            point = (points[0], value) if value is not None else None
            runs.append(Run(run_name, run_folder, variant, point, engine_doc, workload, restart))
    return Experiment(path, name, folder, runs, slo, points, len(listed) > 1 or listed[0][0] is not None)


def _check_engine(engine_doc: dict[str, Any], where: str) -> None:
    """ValueError if the run's engine config is not valid; a variant's (`where`: its key, which
    the error names) must also name a model that can be found, so that a typo fails now rather
    than after the variants before it ran."""
    try:
        config = EngineConfig.from_dict(engine_doc, extra_sections=RESTART_KEYS)  # keys a variant may set
        if where:
            locate_model(config.model.model)
    except ValueError as err:
        if not where:
            raise
        raise ValueError(f"{where}: {err}") from None


def _base(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k not in EXPERIMENT_SECTIONS}


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    merged = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _folder_name(key: str, name: Any) -> str:
    """`name`, the name of a results folder, checked (a number names one; YAML reads `yes` as
    true and `null` as None, which do not)."""
    if isinstance(name, int) and not isinstance(name, bool):
        name = str(name)
    if not isinstance(name, str):
        raise ValueError(f"{key}: expected a string naming a results folder, got {name!r}; quote it")
    if not _NAME.match(name) or name in (".", ".."):
        raise ValueError(f"{key}: {name!r} names a results folder; use letters, digits and . _ + - only")
    return name


def _variants(doc: dict[str, Any], compare: bool) -> list[tuple[str | None, dict[str, Any]]]:
    """(variant name, partial config) of each engine: the base alone, or every listed variant."""
    if not compare:
        return [(None, {})]
    listed = doc.get("variants") or []
    if not isinstance(listed, list) or not listed:
        raise ValueError("variants: --compare needs a list of variants in the YAML file")
    runs = []
    for i, variant in enumerate(listed):
        if not isinstance(variant, dict) or "name" not in variant:
            raise ValueError(f"variants[{i}]: expected a mapping with a 'name' and the keys it changes")
        name = _folder_name(f"variants[{i}].name", variant["name"])
        if name in {n for n, _ in runs}:
            raise ValueError(f"variants[{i}].name: {name!r} is used twice")
        runs.append((name, {k: v for k, v in variant.items() if k != "name"}))
    return runs


def _select(listed: list[tuple[str | None, dict[str, Any]]],
            only: list[str]) -> list[tuple[str | None, dict[str, Any]]]:
    """The variants named in `only`, in that order."""
    by_name = dict(listed)
    if unknown := [name for name in only if name not in by_name]:
        raise ValueError(f"--variants: no variant named {', '.join(map(repr, unknown))}; the file has "
                         f"{', '.join(str(name) for name in by_name)}")
    if len(set(only)) != len(only):
        raise ValueError("--variants: a variant is named twice")
    return [(name, by_name[name]) for name in only]


def variants(doc: dict[str, Any], compare: bool) -> list[tuple[str, dict[str, Any]]]:
    """(name, engine config document) of each engine the file describes (paths unresolved)."""
    name = str(doc.get("name", "experiment"))
    return [(f"{name}/{v}" if v else name, _merge(_base(doc), _engine_keys(override)))
            for v, override in _variants(doc, compare)]


def variant_key(listed: list[tuple[str | None, dict[str, Any]]], variant: str) -> str:
    """`variants[i]`, the YAML key of the variant named `variant`."""
    return f"variants[{[name for name, _ in listed].index(variant)}]"


def _run_keys(doc: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k in RESTART_KEYS}


def _engine_keys(override: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in override.items() if k not in RESTART_KEYS}


# ---------------------------------------------------------------------------- warm restart


def parse_restart(keys: dict[str, Any], engine_doc: dict[str, Any], where: str = "") -> Restart | None:
    """The run's restart from `restart_after_s` / `restart_store` (a variant's over the base's);
    None without `restart_after_s`, or with it null (a variant turning off the base's restart).
    `where`: the variant's key, for errors."""
    prefix = f"{where}." if where else ""
    after = keys.get("restart_after_s")
    store = keys.get("restart_store")
    if "restart_after_s" not in keys and store is not None:
        raise ValueError(f"{prefix}restart_store: set restart_after_s too (seconds into the workload)")
    if after is None:
        return None
    if isinstance(after, bool) or not isinstance(after, (int, float)) or not after > 0 or after == float("inf"):
        raise ValueError(f"{prefix}restart_after_s: expected seconds > 0 into the workload, or null for no "
                         f"restart, got {after!r}")
    if store is None:
        return Restart(float(after))
    check_choice(f"{prefix}restart_store", store, get_args(RestartStore))
    if not (engine_doc.get("cache") or {}).get("nvme_path"):
        raise ValueError(f"{prefix}restart_store: the run has no NVMe store to keep or empty; set cache.nvme_path "
                         "(and nvme_bytes), or drop restart_store")
    return Restart(float(after), store)


# ---------------------------------------------------------------------------- load points


def parse_sweep(text: str) -> tuple[str, list[float]]:
    """`rate=0.5,1,2` -> ("rate", [0.5, 1, 2])."""
    key, sep, values = text.partition("=")
    try:
        numbers = [float(v) for v in values.split(",")]
    except ValueError:
        numbers = []
    if not sep or not key.strip() or not numbers:
        raise ValueError(f"--sweep: expected KEY=V1,V2,... such as rate=0.5,1,2,4, got {text!r}")
    return key.strip(), _points("--sweep", numbers)


def _sweep_section(section: Any) -> tuple[str, list[float]] | None:
    if section is None:
        return None
    if not isinstance(section, dict) or len(section) != 1:
        raise ValueError("sweep: expected one workload key and its load points, e.g. sweep: {rate: [0.5, 1, 2, 4]}")
    [(key, values)] = section.items()
    if not isinstance(values, list) or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        raise ValueError(f"sweep.{key}: expected a list of numbers, got {values!r}")
    return str(key), _points(f"sweep.{key}", values)


def _points(key: str, values: list[float]) -> list[float]:
    if not values:
        raise ValueError(f"{key}: give at least one load point")
    if len(set(values)) != len(values):
        raise ValueError(f"{key}: load point listed twice in {values}")
    return sorted(int(v) if float(v).is_integer() else float(v) for v in values)


def _check_sweep_key(key: str, section: dict[str, Any]) -> None:
    kind = section.get("kind", "multi_turn")
    cls = WORKLOADS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        return  # make_workload names the bad kind
    allowed = [f for f in cls.__dataclass_fields__ if f not in ("path", "format", "seed")]
    if key not in allowed:
        raise ValueError(unknown_key(f"sweep {key}", [f"sweep {k}" for k in allowed])
                         + f" (a sweep varies a key of the {kind} workload)")


# ---------------------------------------------------------------------------- before the run


def preflight(experiment: Experiment) -> None:
    """Empty (or create) the results folder and check what the runs will need to write."""
    prepare_results(experiment.folder)
    for run in experiment.runs:
        nvme_path = (run.engine_doc.get("cache") or {}).get("nvme_path")
        if nvme_path:
            check_store(nvme_path)


def prepare_results(folder: str) -> None:
    """An empty results folder, marked as ours; ValueError if it cannot be written, or if it
    holds files that `tieredkv run` did not write."""
    try:
        if os.path.isdir(folder) and os.listdir(folder):
            if not _ours(folder):
                raise ValueError(
                    f"--out: {folder} holds files that tieredkv run did not write; move them or choose another --out")
            shutil.rmtree(folder)
        os.makedirs(folder, exist_ok=True)
        Path(folder, RESULTS_MARK).write_text("written by `tieredkv run`; emptied by the next run\n")
    except OSError as err:
        raise ValueError(f"--out: cannot write results in {folder}: {err.strerror or err}; "
                         "choose a writable folder with --out") from None


def _ours(folder: str) -> bool:
    names = set(os.listdir(folder))
    return RESULTS_MARK in names or bool(names & {"result.json", "comparison.json", "sweep.json"}) or any(
        os.path.isfile(os.path.join(folder, n, "result.json")) for n in names)


def check_store(nvme_path: str) -> None:
    """ValueError if another process holds the store at `nvme_path` (the store locks its file)."""
    from tieredkv.tiers.nvme import STORE_FILE_NAME

    file = os.path.join(nvme_path, STORE_FILE_NAME) if os.path.isdir(nvme_path) else nvme_path
    if not os.path.isfile(file):
        return
    try:
        fd = os.open(file, os.O_RDONLY)
    except OSError as err:
        raise ValueError(f"cache.nvme_path: cannot open the store {file}: {err.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(f"cache.nvme_path: the store {file} is in use by another process; stop it or give this "
                         "run another nvme_path") from None
    finally:
        os.close(fd)  # releases the lock
