"""Every script under bench/ compiles on the running Python (CI's is the oldest the project supports,
3.11): the GPU-host scripts are never imported by the CPU tests, and the GPU host runs a newer Python,
so syntax only newer ones accept (e.g. an f-string reusing its outer quotes, Python 3.12) would go
unnoticed until a user ran them."""

from __future__ import annotations

from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
SCRIPTS = sorted(BENCH.glob("*.py"))


def test_there_are_bench_scripts():
    assert len(SCRIPTS) > 10 and BENCH / "gdn_timeline.py" in SCRIPTS


@pytest.mark.parametrize("path", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_bench_script_compiles(path: Path):
    compile(path.read_text(), str(path), "exec")


SHELL_SCRIPTS = sorted(BENCH.glob("*.sh"))


@pytest.mark.parametrize("path", SHELL_SCRIPTS, ids=[p.name for p in SHELL_SCRIPTS])
def test_bench_shell_script_parses(path: Path):
    """`bash -n`: the GPU-host runners parse (a call that dies on a syntax error costs minutes of device time)."""
    import subprocess

    proc = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
