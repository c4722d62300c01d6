"""The wheel's packages (pyproject.toml holds everything else): every package under tieredkv/,
found rather than listed so that a new sub-package cannot be left out, and the two folders
installed inside it under other names (`[tool.setuptools.package-dir]`): kernels/ as
`tieredkv.kernels` (a top-level `kernels` would clash with another package) and configs/ as
`tieredkv.configs`."""

from setuptools import find_packages, setup

MAPPED = ["tieredkv.kernels", "tieredkv.configs"]

setup(packages=find_packages(include=["tieredkv", "tieredkv.*"]) + MAPPED)
