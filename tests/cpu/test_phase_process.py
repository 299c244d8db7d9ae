"""bench/phase_process.py: a phase's child process runs to its exit code, or is stopped at its time
cap or after its result file appeared, and its whole process group goes with it."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from phase_process import echo_log, run_phase_process  # noqa: E402

PY = sys.executable


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").is_dir() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_exit_code_and_log(tmp_path, capsys):
    log = tmp_path / "p.log"
    rc, why = run_phase_process([PY, "-c", "print('[x] hello'); raise SystemExit(3)"], log, 30, os.environ, "phase p")
    assert (rc, why) == (3, None)
    echo_log(log, ("[x]",), 5)
    assert "[x] hello" in capsys.readouterr().out


def test_timeout_kills_the_process_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    code = (f"import subprocess, sys, time; c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            f"open({str(pidfile)!r}, 'w').write(str(c.pid)); time.sleep(60)")
    t = time.monotonic()
    rc, why = run_phase_process([PY, "-c", code], tmp_path / "p.log", 3, os.environ, "phase slow")
    assert rc is None and why == "killed after 3 s" and time.monotonic() - t < 20
    grandchild = int(pidfile.read_text())
    time.sleep(0.5)
    assert not _alive(grandchild)  # what the phase started went with it
    assert "phase slow stopped: killed after 3 s" in (tmp_path / "p.log").read_text()


def test_a_phase_that_hangs_after_its_result_is_stopped_after_the_grace(tmp_path):
    done = tmp_path / "r.json"
    code = f"import time; open({str(done)!r}, 'w').write('{{}}'); time.sleep(60)"
    rc, why = run_phase_process([PY, "-c", code], tmp_path / "p.log", 50, os.environ, "phase t", done_file=done, exit_grace_s=1)
    assert rc is None and why == "still running 1 s after writing r.json"
