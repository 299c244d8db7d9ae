"""One bench phase in a child process: its own process group, a time cap, the group killed at the end.

Used by the GPU drivers that run each phase (an engine, a Ray cluster, a server) in a subprocess
(gpu_ray_e2e.py, gpu_tp2_e2e.py, gpu_preempt_repro.py): whatever the phase started, a local Ray
cluster included, ends with it, and a hung phase cannot eat the rest of the run's time.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

__all__ = ["echo_log", "run_phase_process"]


def run_phase_process(
    cmd: Sequence[str],
    log_path: Path,
    timeout_s: float,
    env: Mapping[str, str],
    label: str,
    cwd: Path | None = None,
    done_file: Path | None = None,
    exit_grace_s: float = 30.0,
) -> tuple[int | None, str | None]:
    """Run ``cmd`` (stdout and stderr to ``log_path``) until it exits or is stopped; -> (exit code, why
    it was stopped). Stopped: after ``timeout_s``, or ``exit_grace_s`` after ``done_file`` appeared
    while the process is still running (a result written, then a hang in shutdown). The exit code is
    None when stopped. The process group is killed in every case."""
    t0 = time.monotonic()
    seen_done: float | None = None
    rc: int | None = None
    why: str | None = None
    with open(log_path, "w") as f:
        proc = subprocess.Popen(list(cmd), stdout=f, stderr=subprocess.STDOUT, env=dict(env), start_new_session=True, cwd=cwd)
        while True:
            rc = proc.poll()
            if rc is not None:
                break
            now = time.monotonic()
            if seen_done is None and done_file is not None and done_file.is_file():
                seen_done = now
            if now - t0 > timeout_s:
                why = f"killed after {timeout_s:.0f} s"
            elif seen_done is not None and now - seen_done > exit_grace_s:
                why = f"still running {exit_grace_s:.0f} s after writing {done_file.name}"
            if why is not None:
                f.write(f"\n{label} stopped: {why}\n")
                f.flush()
                break
            time.sleep(0.5)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return rc, why


def echo_log(log_path: Path, keep: Sequence[str], last: int, tail_lines: int = 0) -> None:
    """Print the log's lines holding one of ``keep`` (the last ``last``), then, when asked, its tail."""
    lines = log_path.read_text(errors="replace").splitlines()
    print("\n".join([ln for ln in lines if any(k in ln for k in keep)][-last:]), flush=True)
    if tail_lines:
        print(f"--- last {tail_lines} lines of {log_path.name} ---", *lines[-tail_lines:], sep="\n", flush=True)
