"""The wheel: built from a copy of the source tree, it holds every module and data file of the
package (each sub-package found, none listed by hand), kernels/ and configs/ inside `tieredkv`,
and no top-level `kernels`."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = ("pyproject.toml", "setup.py", "README.md", "tieredkv", "kernels", "configs")
CONFIG_DATA = ("*.yaml", "*.jsonl", "*.txt")  # package-data of tieredkv.configs


def build_wheel(root: Path, tmp: Path) -> set[str]:
    """The file names in the wheel built from `root` (copied first: the build writes beside its sources)."""
    src = tmp / "src"
    src.mkdir()
    for name in SOURCES:
        path = root / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(path, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "--wheel-dir", str(tmp / "dist"), str(src)], check=True, capture_output=True)
    [wheel] = (tmp / "dist").glob("tieredkv-*.whl")
    return set(zipfile.ZipFile(wheel).namelist())


def installed_names(root: Path) -> set[str]:
    """Where each module and data file of the source tree lands in the installed package."""
    names = {p.relative_to(root).as_posix() for p in (root / "tieredkv").rglob("*.py")}
    kernels = root / "kernels"
    names |= {f"tieredkv/kernels/{p.relative_to(kernels).as_posix()}" for p in kernels.rglob("*.py")}
    names |= {f"tieredkv/configs/{p.name}" for pattern in CONFIG_DATA for p in (root / "configs").glob(pattern)}
    return names | {"tieredkv/experiment/result.schema.json"}


def test_the_wheel_holds_every_module_of_the_source_tree(tmp_path):
    wheel = build_wheel(ROOT, tmp_path)
    expected = installed_names(ROOT)
    assert {"tieredkv/parallel/workers.py", "tieredkv/kernels/block_copy.py", "tieredkv/configs/demo.yaml"} <= expected
    assert sorted(expected - wheel) == []
    top_level = {n.split("/")[0] for n in wheel if not n.split("/")[0].endswith(".dist-info")}
    assert top_level == {"tieredkv"}  # no `kernels` or `configs` beside it
