"""The CUDA kernels on the CPU (``cuda/host_emu``) for CPU tests: a build folder and a context that
runs kernel launches through the emulation, skipping the test where g++ cannot build it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"


def emulation_build_dir(tmp_path_factory: pytest.TempPathFactory, name: str = "emu") -> Path:
    """A fresh folder for the emulation's shared libraries (skips the test without g++)."""
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed for the CPU emulation")
    return tmp_path_factory.mktemp(name)


@contextmanager
def emulated(build_dir: Path) -> Iterator[list]:
    """``emulated_kernels`` of cuda/host_emu/emulate.py: yields the list of launches made."""
    sys.path.insert(0, str(CUDA_DIR / "host_emu"))
    try:
        from emulate import emulated_kernels
    finally:
        sys.path.pop(0)
    try:
        with emulated_kernels(build_dir) as launches:
            yield launches
    except subprocess.CalledProcessError as exc:  # a compiler without C++20 <barrier>
        pytest.skip(f"g++ could not build the emulation: {exc.stderr[:300]}")
