"""Typed engine configuration.

Operations:
- `parse_size("4GiB")` turns a size string or int into bytes.
- `EngineConfig.from_kwargs(**flat)` builds a config from `LLM(...)` keywords;
  `api_config(model, config, keywords)`: the config of `LLM(...)` / `AsyncLLM(...)`, either way.
- `EngineConfig.from_dict(nested)` builds it from a YAML document (sections `cache`,
  `scheduler`, `workload`, ...).
- `find_config(path)`: a config named on the command line, also one shipped with the package;
  `read_engine_config(path)`: its engine config, paths resolved (`LLM.from_yaml`, `tieredkv serve`).

Every invalid value raises `ValueError` naming the key, the bad value and what is allowed;
an unknown key names the closest valid one.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import math
import numbers
import os
import re
import shutil
import tempfile
import urllib.parse
from collections.abc import Hashable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal, get_args

from tieredkv.policy import CostModel, Preemption
from tieredkv.replacement import ReplacementPolicy
from tieredkv.scheduling import SchedulingPolicy
from tieredkv.tiers.nvme.io_backends import IOBackend

Device = Literal["cpu", "cuda", "auto"]  # auto: CUDA when present
DType = Literal["float32", "float16", "bfloat16", "auto"]  # auto: the checkpoint's (presets: float32)
AllReduceMode = Literal["auto", "nccl"]  # auto: one-shot over peer memory for small messages where it can

__all__ = [
    "Device", "DType", "AllReduceMode", "IOBackend", "EngineConfig", "ModelConfig", "CacheConfig", "SchedulerConfig",
    "ParallelConfig",
]

MAX_SEED = 2**64 - 1  # the largest seed torch.manual_seed takes
MAX_SIZE_BYTES = 2**64
_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?(?:[eE][+-]?\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str, key: str = "size") -> int:
    """Bytes from a number or a string such as "512MiB", "4GiB", "1.5GB", "5e9"."""
    number = _size_number(value)
    if number is None:
        raise ValueError(
            f"{key}: cannot read {value!r} as a size; use an integer number of bytes or a number "
            f"with a unit ({', '.join(u for u in ('KiB', 'MiB', 'GiB', 'TiB', 'KB', 'MB', 'GB'))}), e.g. '4GiB'"
        )
    if number < 0:
        raise ValueError(f"{key}: a size cannot be negative, got {value!r}")
    if number > MAX_SIZE_BYTES:
        raise ValueError(f"{key}: {value!r} is more bytes than any machine has (at most 2**64)")
    if number.denominator != 1:
        raise ValueError(f"{key}: {value!r} is not a whole number of bytes")
    return int(number)


def _size_number(value: Any) -> Fraction | None:
    """The exact number of bytes a size value says, or None if it is not a size."""
    if isinstance(value, bool):
        return None
    if isinstance(value, numbers.Real):
        return Fraction(value) if math.isfinite(value) else None
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match and match.group(2).lower() in _SIZE_UNITS:
            return Fraction(match.group(1)) * _SIZE_UNITS[match.group(2).lower()]
    return None


def check_choice(key: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{key}: {value!r} is not allowed; choose one of {', '.join(map(repr, choices))}")


def check_int(key: str, value: Any, minimum: int, maximum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum or (
        maximum is not None and value > maximum
    ):
        bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
        raise ValueError(f"{key}: expected an integer {bound}, got {value!r}")


def _real(value: Any) -> float | int | None:
    """A finite number from a number or a numeric string (YAML 1.1 reads `5.0e10` as a string)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            try:
                value = float(value)
            except ValueError:
                return None
    if not isinstance(value, numbers.Real) or not math.isfinite(value):
        return None
    return value


def as_int(key: str, value: Any, minimum: int, maximum: int | None = None) -> int:
    """`value` as an int (integral floats and numeric strings too), or ValueError naming `key`."""
    number = _real(value)
    if number is not None and number == int(number):
        number = int(number)
        if number >= minimum and (maximum is None or number <= maximum):
            return number
    bound = f">= {minimum}" if maximum is None else f"in [{minimum}, {maximum}]"
    raise ValueError(f"{key}: expected an integer {bound}, got {value!r}")


def as_float(key: str, value: Any, minimum: float = 0.0, allow_minimum: bool = False) -> float:
    """`value` as a float above `minimum` (or equal, with `allow_minimum`), else ValueError."""
    number = _real(value)
    if number is not None and (number > minimum or (allow_minimum and number == minimum)):
        return float(number)
    bound = f">= {minimum}" if allow_minimum else f"> {minimum}"
    raise ValueError(f"{key}: expected a number {bound}, got {value!r}")


def _set(obj: Any, name: str, value: Any) -> None:
    object.__setattr__(obj, name, value)  # frozen dataclasses store their coerced values


@dataclass(frozen=True)
class ModelConfig:
    """Which model runs where. `model`: a preset, a model directory (`~` expanded) or a model id
    downloaded to the Hugging Face cache; `device` / `dtype` "auto": CUDA when present / the
    checkpoint's dtype (presets: float32), decided by `model.locate.resolve`. `enforce_eager` turns off
    the CUDA graphs of decode and mixed steps."""

    model: str = "tiny-llama"
    device: Device = "auto"
    dtype: DType = "auto"
    seed: int = 0
    max_model_len: int | None = None
    enforce_eager: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.model, (str, os.PathLike)) or not os.fspath(self.model):
            raise ValueError(f"model: expected a preset name or a model directory, got {self.model!r}")
        _set(self, "model", os.path.expanduser(os.fspath(self.model)))
        check_choice("device", self.device, get_args(Device))
        check_choice("dtype", self.dtype, get_args(DType))
        _set(self, "seed", as_int("seed", self.seed, 0, MAX_SEED))
        if self.max_model_len is not None:
            _set(self, "max_model_len", as_int("max_model_len", self.max_model_len, 1))
        if not isinstance(self.enforce_eager, bool):
            raise ValueError(f"enforce_eager: expected true or false, got {self.enforce_eager!r}")


@dataclass(frozen=True)
class CacheConfig:
    """Sizes of the KV tiers. `num_gpu_blocks=None` sizes the GPU tier from
    `gpu_memory_utilization` (CUDA) or uses 256 blocks (CPU). `remote_url` names a Redis server
    shared by engines (a tier below the CPU tier, beside or instead of NVMe), or a list of them
    (each block on one of them); `remote_bytes` is the most this engine stores there (0: no
    limit of its own, the servers' `maxmemory` rules)."""

    block_size: int = 16
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    cpu_cache_bytes: int = 0
    nvme_path: str | None = None
    nvme_bytes: int = 0
    io_backend: IOBackend = "uring"
    cpu_policy: ReplacementPolicy = "adaptive"
    nvme_policy: ReplacementPolicy = "adaptive"
    remote_url: str | tuple[str, ...] | None = None
    remote_bytes: int = 0

    def __post_init__(self) -> None:
        _set(self, "block_size", as_int("block_size", self.block_size, 1, 1024))
        if self.num_gpu_blocks is not None:
            _set(self, "num_gpu_blocks", as_int("num_gpu_blocks", self.num_gpu_blocks, 1))
        utilization = _real(self.gpu_memory_utilization)
        if utilization is None or not 0 < utilization <= 1:
            raise ValueError(
                f"gpu_memory_utilization: expected a fraction in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        _set(self, "gpu_memory_utilization", float(utilization))
        _set(self, "cpu_cache_bytes", parse_size(self.cpu_cache_bytes, "cpu_cache_bytes"))
        _set(self, "nvme_bytes", parse_size(self.nvme_bytes, "nvme_bytes"))
        if self.nvme_path is not None:
            if not isinstance(self.nvme_path, (str, os.PathLike)) or not os.fspath(self.nvme_path):
                raise ValueError(f"nvme_path: expected a directory path, got {self.nvme_path!r}")
            _set(self, "nvme_path", os.path.expanduser(os.fspath(self.nvme_path)))
        check_choice("io_backend", self.io_backend, get_args(IOBackend))
        check_choice("cpu_policy", self.cpu_policy, get_args(ReplacementPolicy))
        check_choice("nvme_policy", self.nvme_policy, get_args(ReplacementPolicy))
        if self.nvme_bytes and not self.nvme_path:
            raise ValueError("nvme_bytes: set nvme_path (a directory for the block store) to use an NVMe tier")
        if self.nvme_path and not self.nvme_bytes:
            raise ValueError("nvme_path: set nvme_bytes (the store's size, e.g. '64GiB') to use an NVMe tier")
        if self.remote_url is not None:
            _set(self, "remote_url", check_remote_urls(self.remote_url))
        _set(self, "remote_bytes", parse_size(self.remote_bytes, "remote_bytes"))
        if self.remote_bytes and self.remote_url is None:
            raise ValueError("remote_bytes: set remote_url (e.g. 'redis://127.0.0.1:6379/0') to use a remote tier")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits, how a step's tokens are shared (`scheduling_policy`, see
    `tieredkv.scheduling`) and the preemption policy. `cost_model` pins the speeds the `auto`
    policy uses; without it they are measured at start-up. `max_prefill_chunk_tokens` (None: no
    cap) and `prefill_aging` tune the `ttft` policy."""

    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    preemption: Preemption = "auto"
    cost_model: CostModel | None = None
    scheduling_policy: SchedulingPolicy = "ttft"
    max_prefill_chunk_tokens: int | None = None
    prefill_aging: float = 0.1

    def __post_init__(self) -> None:
        _set(self, "max_num_seqs", as_int("max_num_seqs", self.max_num_seqs, 1))
        _set(self, "max_num_batched_tokens", as_int("max_num_batched_tokens", self.max_num_batched_tokens, 1))
        check_choice("preemption", self.preemption, get_args(Preemption))
        check_choice("scheduling_policy", self.scheduling_policy, get_args(SchedulingPolicy))
        if self.max_prefill_chunk_tokens is not None:
            _set(self, "max_prefill_chunk_tokens", as_int("max_prefill_chunk_tokens", self.max_prefill_chunk_tokens, 1))
        _set(self, "prefill_aging", as_float("prefill_aging", self.prefill_aging, allow_minimum=True))
        if self.scheduling_policy == "fcfs" and self.max_prefill_chunk_tokens is not None:
            raise ValueError("max_prefill_chunk_tokens: caps prefill chunks of scheduling_policy 'ttft'; "
                             "set scheduling_policy: ttft or drop the cap")
        if isinstance(self.cost_model, dict):
            _set(self, "cost_model", cost_model_from_dict(self.cost_model))
        elif self.cost_model is not None and not isinstance(self.cost_model, CostModel):
            raise ValueError(f"cost_model: expected a mapping of {', '.join(_fields(CostModel))}")


REMOTE_URL_SCHEMES = ("redis", "rediss", "unix")


def check_remote_urls(value: Any) -> str | tuple[str, ...]:
    """`remote_url`: one Redis URL, or a list of them (a tuple; one alone is kept as a string),
    each checked by `check_remote_url`; ValueError for an empty list or a URL listed twice."""
    if not isinstance(value, (list, tuple)):
        return check_remote_url(value)
    if not value:
        raise ValueError("remote_url: an empty list names no server; give a Redis URL or a list of them, "
                         "e.g. ['redis://10.0.0.1:6379/0', 'redis://10.0.0.2:6379/0']")
    urls = tuple(check_remote_url(url) for url in value)
    twice = [url for i, url in enumerate(urls) if url in urls[:i]]
    if twice:
        raise ValueError(f"remote_url: {twice[0]!r} is listed twice; list each server once")
    return urls[0] if len(urls) == 1 else urls


def check_remote_url(url: Any) -> str:
    """`url` if it reads as a Redis URL (`redis://host:port/db`, `rediss://...`, `unix:///path`),
    else ValueError naming `remote_url`. Query options (`?socket_timeout=2`) are checked by the
    client when the engine connects."""
    example = "e.g. 'redis://127.0.0.1:6379/0'"
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"remote_url: expected a Redis URL, {example}; got {url!r}")
    parsed = urllib.parse.urlsplit(url)
    if parsed.scheme not in REMOTE_URL_SCHEMES:
        raise ValueError(f"remote_url: {url!r} is not a Redis URL; it must start with redis://, rediss:// or "
                         f"unix://, {example}")
    if parsed.scheme == "unix":
        if not parsed.path:
            raise ValueError(f"remote_url: {url!r} names no socket path, e.g. 'unix:///run/redis.sock'")
        return url
    try:
        parsed.port  # noqa: B018 (parsing it checks it)
    except ValueError:
        raise ValueError(f"remote_url: {url!r} has a bad port; give one in [1, 65535], {example}") from None
    if not parsed.hostname:
        raise ValueError(f"remote_url: {url!r} names no host, {example}")
    db = parsed.path.strip("/")
    if db and not db.isdigit():
        raise ValueError(f"remote_url: the database in {url!r} must be a number ({db!r}), {example}")
    return url


@dataclass(frozen=True)
class ParallelConfig:
    """How many processes run the model. `tensor_parallel_size` > 1 starts that many worker
    processes, each holding its share of every layer (and of every KV tier); on CUDA, rank r
    runs on `cuda:r` (choose the GPUs with `CUDA_VISIBLE_DEVICES`). `all_reduce` says how the
    ranks sum their partial outputs: "nccl" always through `torch.distributed` (NCCL, gloo on
    the CPU); "auto" as well, but small messages between GPUs that can read each other's memory
    go through a one-shot all-reduce in symmetric memory (`tieredkv.model.all_reduce`)."""

    tensor_parallel_size: int = 1
    all_reduce: AllReduceMode = "auto"

    def __post_init__(self) -> None:
        _set(self, "tensor_parallel_size", as_int("tensor_parallel_size", self.tensor_parallel_size, 1))
        check_choice("all_reduce", self.all_reduce, get_args(AllReduceMode))


def cost_model_from_dict(doc: dict[str, Any]) -> CostModel:
    """A CostModel from a YAML mapping: every field a number (numeric strings too), the speeds
    positive, the prefill terms and the read latency not negative; errors name `cost_model.<field>`."""
    fields = {f.name: f for f in dataclasses.fields(CostModel)}
    for key in doc:
        if key not in fields:
            raise ValueError(unknown_key(f"cost_model.{key}", [f"cost_model.{k}" for k in fields]))
    required = [name for name, f in fields.items() if f.default is dataclasses.MISSING]
    missing = [name for name in required if name not in doc]
    if missing:
        raise ValueError(f"cost_model: missing {', '.join(missing)} (required: {', '.join(required)})")
    values = {}
    for key, value in doc.items():
        if value is None and fields[key].default is None:
            values[key] = None
        else:
            at_least_zero = key.startswith("prefill") or key == "read_latency_s"
            values[key] = as_float(f"cost_model.{key}", value, allow_minimum=at_least_zero)
    return CostModel(**values)


@dataclass(frozen=True)
class EngineConfig:
    """Everything `LLM(...)` takes, grouped by section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        """Checks across sections that need no model."""
        if self.cache.cpu_cache_bytes == 0:
            if self.scheduler.preemption == "swap":
                raise ValueError("preemption: 'swap' needs a CPU tier; set cpu_cache_bytes (e.g. '4GiB')")
            if self.cache.nvme_path is not None:
                raise ValueError("nvme_path: the NVMe tier sits below the CPU tier; set cpu_cache_bytes too")
            if self.cache.remote_url is not None:
                raise ValueError("remote_url: the remote tier sits below the CPU tier; set cpu_cache_bytes too")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Build from the flat keywords of `LLM(...)`; `cache=` / `scheduler=` dicts also work."""
        sections: dict[str, dict[str, Any]] = {name: {} for name in SECTION_TYPES}
        nested = [name for name in SECTION_TYPES if name != "model"]
        for key, value in kwargs.items():
            if key in nested:
                sections[key].update(_check_section(key, value, SECTION_TYPES[key]))
            elif key in FLAT_KEYS:
                sections[FLAT_KEYS[key]][key] = value
            else:
                raise ValueError(unknown_key(key, [*FLAT_KEYS, *nested]))
        return cls(**{name: SECTION_TYPES[name](**values) for name, values in sections.items()})

    @classmethod
    def from_dict(cls, doc: dict[str, Any], extra_sections: tuple[str, ...] = ()) -> EngineConfig:
        """Build from a YAML document. Sections in `extra_sections` (e.g. `workload`) are
        allowed and ignored here; the caller reads them."""
        if not isinstance(doc, dict):
            raise ValueError(f"config: expected a mapping of keys to values at the top level, got {type(doc).__name__}")
        flat: dict[str, Any] = {}
        top_keys = [*_fields(ModelConfig), *_fields(ParallelConfig), "cache", "scheduler", "parallel", *extra_sections]
        for key, value in doc.items():
            if key in extra_sections:
                continue
            if key not in top_keys:
                raise ValueError(unknown_key(str(key), top_keys))
            flat[key] = value
        return cls.from_kwargs(**flat)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


EXPERIMENT_SECTIONS = ("name", "workload", "variants", "sweep", "slo",  # YAML sections the engine does not read
                       "restart_after_s", "restart_store")

SECTION_TYPES: dict[str, type] = {
    "model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "parallel": ParallelConfig,
}


def _fields(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


FLAT_KEYS: dict[str, str] = {key: name for name, cls in SECTION_TYPES.items() for key in _fields(cls)}


def _check_section(name: str, value: Any, cls: type) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{name}: expected a mapping of keys to values, got {value!r}")
    allowed = _fields(cls)
    for key in value:
        if key not in allowed:
            raise ValueError(unknown_key(f"{name}.{key}", [f"{name}.{k}" for k in allowed]))
    return value


def unknown_key(key: str, allowed: list[str]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1, cutoff=0.5)
    hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(allowed)}"
    return f"unknown key {key!r}: {hint}"


def api_config(model: str, config: EngineConfig | None, keywords: dict[str, Any]) -> EngineConfig:
    """The config of `LLM(model, **keywords)`, or `config` for `LLM(config=...)`; a config given
    beside keywords or another model is an error, not keywords silently ignored."""
    if config is None:
        return EngineConfig.from_kwargs(model=model, **keywords)
    if not isinstance(config, EngineConfig):
        raise TypeError(f"config: expected an EngineConfig, got {config!r}; give the other engine keys by name, "
                        "e.g. LLM(model, device='cpu')")
    if keywords:
        raise ValueError(f"config: given with {', '.join(keywords)}; set them in the config "
                         "(dataclasses.replace) or give keywords without a config")
    if model not in (ModelConfig.model, config.model.model):
        raise ValueError(f"model: {model!r} given with a config of model {config.model.model!r}; "
                         "set the model in the config")
    return config


def read_yaml(path: str) -> dict[str, Any]:
    """Parse a YAML experiment file; errors name the file and what is wrong (a key given twice
    in one mapping is an error, not last-one-wins)."""
    import yaml

    try:
        with open(os.path.expanduser(path)) as f:
            doc = yaml.load(f, Loader=_unique_key_loader())  # a SafeLoader
    except FileNotFoundError:
        raise ValueError(f"config: file {path!r} does not exist") from None
    except OSError as err:  # a folder, no permission, ...
        raise ValueError(f"config: cannot read {path!r} ({err.strerror or err})") from None
    except RecursionError:
        raise ValueError(f"config: {path} nests its mappings and lists too deeply to be a config") from None
    except DuplicateKeyError as err:
        raise ValueError(
            f"config: {path}, line {err.line}: duplicate key {err.key!r}; give each key once"
        ) from None
    except yaml.YAMLError as err:
        raise ValueError(f"config: {path} is not valid YAML: {err}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"config: {path} must hold a mapping of keys (model, cache, scheduler, workload, ...)")
    return doc


class DuplicateKeyError(Exception):
    """A YAML mapping names one key twice."""

    def __init__(self, key: Any, line: int) -> None:
        super().__init__(f"duplicate key {key!r} on line {line}")
        self.key, self.line = key, line


@functools.cache
def _unique_key_loader() -> type:
    """PyYAML's SafeLoader, refusing a key given twice in one mapping (merge keys aside)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                if isinstance(key, Hashable) and key in seen:
                    raise DuplicateKeyError(key, key_node.start_mark.line + 1)
                if isinstance(key, Hashable):
                    seen.add(key)
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


RESULTS_VAR = "${results}"  # in a YAML path: the run's results folder


def resolve_paths(doc: dict[str, Any], folder: str, results_dir: str) -> dict[str, Any]:
    """The YAML document with its relative paths (a model directory, `cache.nvme_path`) taken
    from `folder` (the file's own), `~` expanded and `${results}` replaced by `results_dir`."""
    doc = dict(doc)
    model = doc.get("model")
    if isinstance(model, str) and not os.path.isabs(model) and os.path.isdir(os.path.join(folder, model)):
        doc["model"] = os.path.normpath(os.path.join(folder, model))
    cache = doc.get("cache")
    if isinstance(cache, dict) and isinstance(cache.get("nvme_path"), str):
        path = os.path.expanduser(cache["nvme_path"].replace(RESULTS_VAR, os.path.abspath(results_dir)))
        doc["cache"] = {**cache, "nvme_path": os.path.normpath(os.path.join(folder, path))}
    return doc


def find_config(path: str) -> str:
    """`path` as given if it exists; else the config of that name shipped with tieredkv
    (`demo`, `configs/demo.yaml` and `demo.yaml` all find the demo)."""
    if os.path.exists(path):
        return path
    name = Path(path).name if Path(path).suffix else f"{Path(path).name}.yaml"
    for folder in shipped_config_dirs():
        if (folder / name).is_file():
            return str(folder / name)
    return path  # read_yaml says it does not exist


def shipped_config_dirs() -> list[Path]:
    """Where configs ship: `configs/` of a checkout, and the copy installed with the package."""
    package = Path(__file__).resolve().parent
    return [package.parent / "configs", package / "configs"]


def read_engine_config(path: str) -> tuple[EngineConfig, str | None]:
    """The engine config of the YAML file `find_config(path)` finds (its experiment sections
    ignored), relative paths taken from the file's folder; and the temporary folder made to stand
    for `${results}` in `nvme_path` (None if there is none), which the caller removes when its
    engine closes, so that such a store starts empty and leaves nothing behind."""
    path = find_config(path)
    doc = read_yaml(path)
    cache = doc.get("cache")
    scratch = None
    if isinstance(cache, dict) and RESULTS_VAR in str(cache.get("nvme_path")):
        scratch = tempfile.mkdtemp(prefix="tieredkv-results-")
    try:
        doc = resolve_paths(doc, os.path.dirname(os.path.abspath(path)), scratch or "results")  # results: unused
        return EngineConfig.from_dict(doc, extra_sections=EXPERIMENT_SECTIONS), scratch
    except BaseException:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        raise
