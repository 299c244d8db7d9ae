"""Server side of the serving soak (bench/soak.py): subprocess servers, their GPU memory, their state.

* ``Server``: a server command in its own session (its whole process group is stopped at the end),
  output to ``OUT/<role>.log``, ``/health`` polling, ``/metrics`` parsing, memory of its process tree;
* ``gpu_memory``: per-process used memory from ``nvidia-smi --query-compute-apps`` (summed over the
  server's process tree: API server + engine core) and the whole GPU's used memory;
* ``MemorySampler``: that memory every few seconds during a load; ``wait_drained``: poll until no
  request runs or waits and read the KV-cache usage; ``log_facts``: KV-cache size, maximum
  concurrency, ERROR / Traceback lines and the plugin's lines from a vLLM log; ``allocator_summary``:
  the torch allocator's allocated / reserved MiB from the tfm engine's periodic stats lines.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Self

import soak_client as sc

__all__ = [
    "MemorySampler",
    "Role",
    "Server",
    "allocator_summary",
    "graph_summary",
    "gpu_memory",
    "log",
    "log_facts",
    "parse_compute_apps",
    "process_tree",
    "start_servers",
    "stop_servers",
    "wait_drained",
]

_T0 = time.monotonic()


def log(*args: object) -> None:
    print(f"[soak {time.monotonic() - _T0:6.1f}s]", *args, flush=True)


@dataclass(frozen=True)
class Role:
    """One server of a phase: ``tfm`` / ``nospec`` / ``tfm_small`` (preemption)."""

    name: str
    port: int
    spec: bool
    kv_cache_bytes: int
    max_model_len: int


def process_tree(root: int) -> set[int]:
    """``root`` and all its descendants (Linux /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat[stat.rfind(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    tree, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in tree:
            continue
        tree.add(pid)
        todo += children.get(pid, [])
    return tree


def parse_compute_apps(text: str) -> dict[int, float]:
    """``nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`` -> {pid: MiB}."""
    out: dict[int, float] = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            try:
                out[int(parts[0])] = out.get(int(parts[0]), 0.0) + float(parts[1])
            except ValueError:
                continue
    return out


def visible_gpu_args(env: dict[str, str] | None = None) -> list[str]:
    """``-i <CUDA_VISIBLE_DEVICES>`` for per-GPU nvidia-smi queries (nvidia-smi ignores that variable),
    so a phase sharing the host with another phase on another GPU reads its own GPU only."""
    cvd = (os.environ if env is None else env).get("CUDA_VISIBLE_DEVICES", "").strip()
    return ["-i", cvd] if cvd else []


def _nvidia_smi(args: list[str]) -> str | None:
    try:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def gpu_memory(pids: set[int]) -> dict[str, Any]:
    """GPU memory (MiB) of the processes ``pids`` (per-process, from nvidia-smi) and of the whole GPU."""
    apps_text = _nvidia_smi(["--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"])
    total_text = _nvidia_smi([*visible_gpu_args(), "--query-gpu=memory.used", "--format=csv,noheader,nounits"])
    apps = parse_compute_apps(apps_text) if apps_text is not None else None
    mine = None if apps is None else {p: m for p, m in apps.items() if p in pids}
    total = None
    if total_text:
        try:
            total = sum(float(x) for x in total_text.split())
        except ValueError:
            total = None
    return {"mib": sum(mine.values()) if mine else None, "pids": sorted(mine) if mine else [], "gpu_used_mib": total,
            "t": round(time.monotonic() - _T0, 1)}


class Server:
    """A server subprocess in its own session (so its whole process group can be stopped)."""

    def __init__(self, role: Role, cmd: list[str], out: Path, cwd: Path | None = None, env: dict[str, str] | None = None) -> None:
        self.role = role
        self.cwd = cwd
        self.cmd = cmd
        self.env = dict(env or {})  # on top of this process's environment
        self.log_path = out / f"{role.name}.log"
        self.base_url = f"http://127.0.0.1:{role.port}"
        self.proc: subprocess.Popen | None = None
        self.started_at = 0.0
        self.startup_s: float | None = None

    def start(self) -> None:
        env = dict(os.environ, VLLM_USE_FLASHINFER_SAMPLER="0")
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # vllm serve runs its engine in its own process
        env.update(self.env)
        self.started_at = time.monotonic()
        log(f"start {self.role.name}: {' '.join(f'{k}={v}' for k, v in self.env.items())} {' '.join(self.cmd)}")
        with open(self.log_path, "w") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                         cwd=None if self.cwd is None else str(self.cwd))

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=5) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def wait_healthy(self, until: float) -> bool:
        while time.monotonic() < until:
            if not self.alive():
                return False
            if self.healthy():
                self.startup_s = round(time.monotonic() - self.started_at, 1)
                log(f"{self.role.name} healthy after {self.startup_s} s")
                return True
            time.sleep(1.0)
        return False

    def metrics(self) -> dict:
        with urllib.request.urlopen(f"{self.base_url}/metrics", timeout=10) as r:
            return sc.parse_prometheus(r.read().decode())

    def memory(self) -> dict[str, Any]:
        return gpu_memory(process_tree(self.proc.pid) if self.proc is not None else set())

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def interrupt(self) -> None:
        """SIGINT to the server process (vllm serve then shuts its engine core down itself)."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGINT)
            except ProcessLookupError:
                pass

    def wait_stopped(self, timeout: float = 30.0) -> int | None:
        """Wait for the exit after ``interrupt``; then SIGKILL whatever is left of its process group."""
        if self.proc is None:
            return None
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers (an engine core that outlived its server)
        except (ProcessLookupError, PermissionError):
            pass
        if self.proc.poll() is None:
            self.proc.wait(timeout=10)
        return self.proc.returncode


def stop_servers(servers: Sequence[Server], timeout: float = 30.0) -> dict[str, int | None]:
    """Interrupt all, then wait for each (so they shut down in parallel)."""
    for s in servers:
        s.interrupt()
    return {s.role.name: s.wait_stopped(timeout) for s in servers}


_LOG_FACTS = {
    "kv_cache_tokens": re.compile(r"GPU KV cache size: ([\d,]+) tokens"),
    "max_concurrency": re.compile(r"Maximum concurrency for ([\d,]+) tokens per request: ([\d.]+)x"),
    "async_scheduling": re.compile(r"Asynchronous scheduling is (enabled|disabled)\."),  # vLLM's config/vllm.py
}
_PREFIX = re.compile(r"^\([^)]*\) ")  # vLLM prefixes each line of a process: "(APIServer pid=12) ..."
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)\b")


def _exceptions(lines: Sequence[str]) -> list[str]:
    """The final 'SomeError: message' line of every traceback in a log."""
    out = []
    for i, line in enumerate(lines):
        if not line.startswith("Traceback (most recent call last):"):
            continue
        for follow in lines[i + 1 :]:
            if _EXCEPTION_LINE.match(follow):
                out.append(follow[:300])
                break
            if follow.startswith("Traceback (most recent call last):"):
                out.append("(unterminated traceback)")
                break
    return out


def log_facts(text: str, expected_errors: Sequence[str] = ()) -> dict[str, Any]:
    """What a vLLM server log says: KV-cache size and maximum concurrency, ERROR lines, tracebacks
    (those whose exception message contains one of ``expected_errors`` counted apart), tfm's lines."""
    facts: dict[str, Any] = {}
    if m := _LOG_FACTS["kv_cache_tokens"].search(text):
        facts["kv_cache_tokens"] = int(m.group(1).replace(",", ""))
    if m := _LOG_FACTS["max_concurrency"].search(text):
        facts["max_concurrency"] = {"tokens_per_request": int(m.group(1).replace(",", "")), "x": float(m.group(2))}
    said = [m.group(1) == "enabled" for m in _LOG_FACTS["async_scheduling"].finditer(text)]
    if said:  # the last line (the engine core's) decides
        facts["async_scheduling"] = said[-1]
    lines = [_PREFIX.sub("", ln) for ln in text.splitlines()]
    errors = [ln for ln in lines if " ERROR " in ln or ln.startswith("ERROR")]
    exceptions = _exceptions(lines)
    unexpected = [e for e in exceptions if not any(x in e for x in expected_errors)]
    facts["error_lines"] = len(errors)
    facts["tracebacks"] = len(exceptions)
    facts["tracebacks_unexpected"] = len(unexpected)
    facts["exceptions"] = sorted(set(exceptions))[:20]
    facts["unexpected_exceptions"] = unexpected[:10]
    facts["error_examples"] = [ln[-300:] for ln in errors[:10]]
    stats = [ln for ln in lines if any(k in ln for k in _STATS_LINES)]
    facts["tfm_lines"] = [ln[-300:] for ln in lines if ("vllm-tfm" in ln or "vllm_tfm" in ln) and ln not in stats][:15]
    # the periodic throughput / acceptance lines of vLLM and tfm, in order: where the time went
    facts["stats_lines"] = [ln[ln.find("] ") + 2 :][-400:] if "] " in ln else ln[-400:] for ln in stats][:300]
    return facts


_STATS_LINES = ("Avg generation throughput", "SpecDecoding metrics", "vllm-tfm: last ")


_ALLOCATOR = re.compile(r"vllm-tfm: last .*; GPU MiB allocated (\d+), reserved (\d+)")


def allocator_summary(text: str) -> dict[str, Any]:
    """The torch caching allocator of a tfm engine as its periodic stats lines report it
    (``vllm-tfm: last ...; GPU MiB allocated A, reserved R``, one every 10 s while it steps) in a
    slice of its log: how many lines, the last allocated / reserved and the largest reserved
    (None without such lines: a no-spec server, or no step in the slice)."""
    found = [(float(m.group(1)), float(m.group(2))) for m in _ALLOCATOR.finditer(text)]
    if not found:
        return {"lines": 0, "allocated_last_mib": None, "reserved_last_mib": None, "reserved_max_mib": None}
    return {"lines": len(found), "allocated_last_mib": found[-1][0], "reserved_last_mib": found[-1][1],
            "reserved_max_mib": max(r for _, r in found)}


_GRAPHS = re.compile(r"vllm-tfm: last [^\n]*?; graphs: ([^;\n]+)")


def graph_summary(text: str) -> dict[str, int]:
    """Steps by the CUDA graph they replayed, summed over a tfm engine's periodic stats lines in a
    slice of its log (their ``; graphs: tree.FULL 12, tree.full_replay 12, ...`` segment, the
    interval's ``cudagraph.*`` counters; docs/metrics.md). Empty for an eager engine."""
    total: dict[str, int] = {}
    for m in _GRAPHS.finditer(text):
        for item in m.group(1).split(", "):
            name, _, count = item.strip().rpartition(" ")
            if name and count.isdigit():
                total[name] = total.get(name, 0) + int(count)
    return dict(sorted(total.items()))


def start_servers(servers: Sequence[Server], until: float) -> dict[str, bool]:
    for s in servers:
        s.start()
    return {s.role.name: s.wait_healthy(until) for s in servers}



def wait_drained(server: Server, timeout_s: float = 20.0) -> dict[str, Any]:
    """Poll /metrics until nothing runs or waits; the gauges at that point."""
    until = time.monotonic() + timeout_s
    last: dict[str, Any] = {}
    while True:
        try:
            m = server.metrics()
            last = {
                "running": sc.metric_value(m, "vllm:num_requests_running"),
                "waiting": sc.metric_value(m, "vllm:num_requests_waiting"),
                "kv_cache_usage": sc.metric_value(m, "vllm:kv_cache_usage_perc"),
            }
        except (OSError, urllib.error.URLError) as e:
            last = {"error": f"{type(e).__name__}: {e}"}
        if last.get("running") == 0 and last.get("waiting") == 0:
            last["drained"] = True
            return last
        if time.monotonic() >= until:
            last["drained"] = False
            return last
        time.sleep(1.0)


class MemorySampler:
    """GPU memory of a server every ``period_s`` seconds in a background thread."""

    def __init__(self, server: Server, period_s: float = 5.0) -> None:
        self.server, self.period_s = server, period_s
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.samples.append(self.server.memory())

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)


