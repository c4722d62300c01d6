"""What a newcomer meets first: `tieredkv --version`, a `--help` that starts without torch, one
readable calibration line, no matplotlib chatter, and `LLM.from_yaml` of the demo leaving no
store behind in the current folder."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import tieredkv
from tieredkv import LLM, SamplingParams
from tieredkv.cli import main

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "configs" / "demo.yaml"


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out == f"tieredkv {metadata.version('tieredkv')}\n"
    assert tieredkv.__version__ == metadata.version("tieredkv")


# Every subcommand's --help (found from the parser, so a new one is covered too), then --version;
# torch must not have been imported by any of them.
HELP_WITHOUT_TORCH = """
import argparse, contextlib, io, json, sys
from tieredkv.cli import build_parser, main
[commands] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
for argv in [["--help"], *([name, "--help"] for name in commands.choices), ["--version"]]:
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):
        main(argv)
    assert out.getvalue().startswith(("usage: tieredkv", "tieredkv ")), (argv, out.getvalue())
print(json.dumps([sorted(commands.choices), sorted(m for m in ("torch", "numpy", "transformers") if m in sys.modules)]))
"""


def test_help_and_version_do_not_import_torch():
    done = subprocess.run([sys.executable, "-c", HELP_WITHOUT_TORCH], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    commands, heavy = json.loads(done.stdout)
    assert {"run", "serve"} <= set(commands)
    assert heavy == []


def test_the_calibration_line_reads_in_units_and_names_the_backend_that_ran(tmp_path, monkeypatch, caplog):
    from tieredkv.tiers.nvme import io_backends

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setattr(io_backends, "uring_probe", lambda directory=None: (False, "no ring (test)"))
    store = tmp_path / "kv"
    with caplog.at_level(logging.INFO, logger="tieredkv"), LLM(
        model="tiny-llama", block_size=4, num_gpu_blocks=30, cpu_cache_bytes="64KiB", nvme_path=str(store),
        nvme_bytes="1MiB", io_backend="uring", preemption="auto",
    ) as llm:
        assert llm.stats()["nvme_io_backend"] == "sync"  # io_uring fell back
    [line] = [r.getMessage() for r in caplog.records if r.name == "tieredkv.calibrate" and r.levelno == logging.INFO]
    number = r"\d+\.\d+"
    assert re.fullmatch(
        rf"calibrated cpu/[0-9a-f]{{16}}: copies D2H {number} GB/s, H2D {number} GB/s; "
        rf"prefill {number} us/token \+ {number} ns/token\^2 \(timed at \d+ and \d+ tokens\); "
        rf"disk reads {number} GB/s under {re.escape(str(store))} \(sync backend, 2 KiB reads, 32 in flight\); "
        rf"cached in {re.escape(str(tmp_path / 'xdg' / 'tieredkv' / 'cost_models.json'))}",
        line,
    ), line


def test_the_first_plot_logs_nothing_from_matplotlib(tmp_path):
    # an empty MPLCONFIGDIR: matplotlib builds its font cache, as on a first run
    script = ("import logging; logging.basicConfig(level=logging.DEBUG); "
              "from tieredkv.experiment.plots import _pyplot; _pyplot().figure()")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MPLCONFIGDIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr
    assert any(p.name.startswith("fontlist") for p in tmp_path.iterdir())  # the cache was built here
    assert "matplotlib" not in done.stderr


def test_from_yaml_puts_the_results_store_in_a_folder_of_its_own_removed_at_close(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with LLM.from_yaml(str(DEMO)) as llm:
        store = Path(llm.config.cache.nvme_path)
        assert store.name == "nvme" and store.is_dir() and tmp_path not in store.parents
        [out] = llm.generate([list(range(5, 60))], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
        assert len(out.token_ids) == 3 and llm.stats()["nvme_slots_total"] > 0
        other = LLM.from_yaml(str(DEMO))  # a second engine of the same file has a store of its own
        assert other.config.cache.nvme_path != str(store)
        other.close()
        calibrated = json.loads((tmp_path / "xdg" / "tieredkv" / "cost_models.json").read_text())
        disks = [entry for entry in calibrated if "/disk:" in entry]
        assert len(disks) == 1  # its disk was not measured again for a folder of another name
        assert not Path(other.config.cache.nvme_path).parent.exists()
    assert not store.parent.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["xdg"]  # no results/ in the current folder
