"""Where a decode step's GPU time goes, kernel by kernel and stage by stage, from a torch profiler trace.

``bench/e2e.py --kernel-profile`` runs each batch once more under ``torch.profiler`` (CPU and CUDA
activities) with the stage timer's spans annotated (``set_stage_timing(annotate=True)``: each span
opens a ``record_function`` range ``tfm:<stage>``), and writes the Chrome trace. This module reads
such a trace (pure Python, no torch) and attributes every GPU kernel, memcpy and memset to the stage
that launched it:

* a GPU activity carries the correlation id of the host call that launched it (``cudaLaunchKernel``,
  ``cuLaunchKernelEx`` for our NVRTC kernels, ``cudaGraphLaunch`` for every kernel of a replayed CUDA
  graph, ``cudaMemcpyAsync`` ...);
* that host call ran on some thread at some time; the innermost ``tfm:`` range of that thread open at
  that time is the activity's stage (``none`` outside every range).

Per step (the number of ``tfm:execute_model`` ranges; every runner of a ``VLLM_TFM_PROFILE=1``
process opens one per step, tfm or not), :func:`summarize` gives each stage's GPU time and launches
and its top kernels, each kernel's category (:func:`category`: a name rule, good enough to read a
table, not a contract), and the GPU's busy time against the wall time between the first and the
last activity. Kernel durations are device timestamps, so the profiler's host overhead does not
change them; it does lengthen the gaps between steps, so ``busy_fraction`` under the profiler is a
lower bound.
"""

from __future__ import annotations

import bisect
import gzip
import json
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["ANNOTATION_PREFIX", "CATEGORIES", "GPU_CATS", "attribute", "category", "host_summary", "load_trace",
           "summarize"]

ANNOTATION_PREFIX = "tfm:"  # vllm_tfm/vllm_plugin/runtime/stage_timing.py ANNOTATION_PREFIX
GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")

# (category, pattern on the kernel name, case-insensitive), first match wins. Our NVRTC kernels first.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("tfm_gdn_verify", r"gdn_tree_verify"),
    ("tfm_gdn_commit", r"gdn_tree_commit|commit_layers|conv_commit"),
    ("tfm_tree_conv", r"tree_conv"),
    ("tfm_tree_attention", r"tree_attention"),
    ("tfm_weaver", r"weaver_|candidate_scores|tfm_"),
    ("memcpy", r"^memcpy|memcpy"),
    ("memset", r"^memset|memset"),
    ("gemm", r"nvjet|gemm|cutlass|xmma|cublas|splitkreduce|gemv|matmul|_mm_"),
    ("gdn_vllm", r"gated_delta|fused_recurrent|chunk_|l2norm|gdn_gating|fused_gdn|solve_tril|kkt"),
    ("conv1d", r"conv1d"),
    ("attention", r"attention|attn|flash|fmha|paged|reshape_and_cache"),
    ("norm", r"rms|norm|rsqrt"),
    ("sampling", r"sort|topk|top_k|softmax|argmax|sampl|gumbel|exponential|multinomial|logsumexp"),
    ("rotary", r"rotary|rope"),
    ("activation", r"silu|gelu|sigmoid|act_and_mul"),
    ("triton_fused", r"^triton_"),
    ("elementwise", r"elementwise|vectorized|unrolled|copy|fill|index|gather|scatter|cat|where|reduce"),
)
_COMPILED = tuple((c, re.compile(p, re.IGNORECASE)) for c, p in CATEGORIES)


def category(name: str) -> str:
    """A kernel's category by the first matching rule of :data:`CATEGORIES` (``other`` if none)."""
    for cat, pat in _COMPILED:
        if pat.search(name):
            return cat
    return "other"


def load_trace(path: str | Path) -> list[dict[str, Any]]:
    """The trace events of a Chrome trace file (``.json`` or ``.json.gz``)."""
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt") as f:
        data = json.load(f)
    return list(data["traceEvents"] if isinstance(data, Mapping) else data)


def _correlation(ev: Mapping[str, Any]) -> int | None:
    args = ev.get("args") or {}
    c = args.get("correlation")
    return int(c) if c is not None else None


class _Ranges:
    """The ``tfm:`` ranges of one host thread, for innermost-range lookups by time."""

    def __init__(self, ranges: Iterable[tuple[float, float, str]]) -> None:
        self.ranges = sorted(ranges)
        self.starts = [r[0] for r in self.ranges]

    def innermost(self, ts: float) -> str | None:
        # properly nested ranges: the containing range with the latest start is the innermost one
        i = bisect.bisect_right(self.starts, ts) - 1
        while i >= 0:
            start, end, name = self.ranges[i]
            if start <= ts <= end:
                return name
            i -= 1
        return None


def _step_starts(events: Sequence[Mapping[str, Any]]) -> list[float]:
    name = ANNOTATION_PREFIX + "execute_model"
    return sorted(float(ev["ts"]) for ev in events
                  if ev.get("ph") == "X" and ev.get("cat") == "user_annotation" and ev.get("name") == name)


def _cutoff(starts: list[float], skip_steps: int) -> float:
    """Host time from which steps count: the start of step ``skip_steps`` (0: everything)."""
    if skip_steps <= 0:
        return float("-inf")
    return starts[skip_steps] if skip_steps < len(starts) else float("inf")


def attribute(events: Sequence[Mapping[str, Any]], skip_steps: int = 0) -> tuple[list[dict[str, Any]], int]:
    """GPU activities with their stage: a list of {name, cat, ts, dur, stage}, and the number of
    ``tfm:execute_model`` ranges (the steps). ``skip_steps``: the activities launched before the
    start of that step are left out, and the steps counted after it (a run's first step is its
    prompts' prefill, not a decode step)."""
    ranges: dict[tuple[Any, Any], list[tuple[float, float, str]]] = defaultdict(list)
    launches: dict[int, tuple[Any, Any, float]] = {}
    gpu: list[Mapping[str, Any]] = []
    starts = _step_starts(events)
    cutoff = _cutoff(starts, skip_steps)
    steps = max(0, len(starts) - max(0, skip_steps))
    for ev in events:
        if ev.get("ph") != "X":
            continue
        cat, name = ev.get("cat"), str(ev.get("name", ""))
        if cat in GPU_CATS:
            gpu.append(ev)
        elif cat in HOST_LAUNCH_CATS:
            c = _correlation(ev)
            if c is not None:
                launches[c] = (ev.get("pid"), ev.get("tid"), float(ev["ts"]))
        elif cat == "user_annotation" and name.startswith(ANNOTATION_PREFIX):
            stage = name[len(ANNOTATION_PREFIX):]
            ts = float(ev["ts"])
            ranges[(ev.get("pid"), ev.get("tid"))].append((ts, ts + float(ev.get("dur", 0.0)), stage))
    lookup = {k: _Ranges(v) for k, v in ranges.items()}
    out = []
    for ev in gpu:
        c = _correlation(ev)
        stage = "unattributed"
        launched = float(ev["ts"])  # without its launch: the device's own time, on the same clock
        if c is not None and c in launches:
            pid, tid, launched = launches[c]
            r = lookup.get((pid, tid))
            stage = (r.innermost(launched) if r is not None else None) or "none"
        if launched < cutoff:
            continue
        out.append({"name": str(ev.get("name", "")), "cat": ev.get("cat"), "ts": float(ev["ts"]),
                    "dur": float(ev.get("dur", 0.0)), "stage": stage})
    return out, steps


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def summarize(events: Sequence[Mapping[str, Any]], top: int = 25, name_chars: int = 110,
              skip_steps: int = 0) -> dict[str, Any]:
    """Per step: each stage's GPU microseconds and activities, its top kernels, its categories; the
    whole trace's busy time (union of activity intervals) and wall time (first start to last end).
    ``skip_steps`` as in :func:`attribute`."""
    acts, steps = attribute(events, skip_steps)
    if not acts:
        return {"steps": steps, "skip_steps": skip_steps, "activities": 0, "stages": {}}
    per = max(steps, 1)
    by_stage: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for a in acts:
        by_stage[a["stage"]].append(a)
    stages: dict[str, Any] = {}
    for stage, items in sorted(by_stage.items(), key=lambda kv: -sum(a["dur"] for a in kv[1])):
        names: dict[str, list[float]] = defaultdict(list)
        cats: dict[str, float] = defaultdict(float)
        for a in items:
            name = a["name"] if a["cat"] == "kernel" else a["cat"]
            names[name].append(a["dur"])
            cats[category(name) if a["cat"] == "kernel" else a["cat"].removeprefix("gpu_")] += a["dur"]
        kernels = sorted(names.items(), key=lambda kv: -sum(kv[1]))
        stages[stage] = {
            "us_per_step": round(sum(a["dur"] for a in items) / per, 2),
            "activities_per_step": round(len(items) / per, 2),
            "categories_us_per_step": {c: round(v / per, 2) for c, v in sorted(cats.items(), key=lambda kv: -kv[1])},
            "top": [{"name": n[:name_chars], "category": category(n), "us_per_step": round(sum(d) / per, 2),
                     "calls_per_step": round(len(d) / per, 2), "mean_us": round(sum(d) / len(d), 2)}
                    for n, d in kernels[:top]],
        }
    first = min(a["ts"] for a in acts)
    last = max(a["ts"] + a["dur"] for a in acts)
    busy = _busy_us([(a["ts"], a["ts"] + a["dur"]) for a in acts])
    return {
        "steps": steps,
        "skip_steps": skip_steps,
        "activities": len(acts),
        "gpu_us_per_step": round(sum(a["dur"] for a in acts) / per, 2),
        "busy_us_per_step": round(busy / per, 2),
        "wall_us_per_step": round((last - first) / per, 2),
        "busy_fraction": round(busy / (last - first), 4) if last > first else None,
        "stages": stages,
    }


def host_summary(events: Sequence[Mapping[str, Any]], top: int = 12, name_chars: int = 80,
                 skip_steps: int = 0) -> dict[str, Any]:
    """Per step and stage, the host side of the same trace: each ``tfm:`` range's own wall time (its
    duration minus the ``tfm:`` ranges inside it), how much of that the traced host calls (torch ops,
    CUDA runtime / driver calls) cover at their top level, and the calls with the most self time (a
    call's duration minus the calls inside it). What the calls do not cover is Python, vLLM's and ours,
    between them. Profiler overhead inflates both; compare stages and arms, not absolute times.
    ``skip_steps``: host events before the start of that step are left out (as in :func:`attribute`)."""
    host_cats = ("cpu_op", "cuda_runtime", "cuda_driver", "user_annotation")
    per_tid: dict[tuple[Any, Any], list[tuple[float, float, str, str]]] = defaultdict(list)
    starts = _step_starts(events)
    cutoff = _cutoff(starts, skip_steps)
    steps = max(0, len(starts) - max(0, skip_steps))
    for ev in events:
        if ev.get("ph") != "X" or ev.get("cat") not in host_cats:
            continue
        name = str(ev.get("name", ""))
        if ev["cat"] == "user_annotation" and not name.startswith(ANNOTATION_PREFIX):
            continue
        ts = float(ev["ts"])
        if ts < cutoff:
            continue
        per_tid[(ev.get("pid"), ev.get("tid"))].append((ts, ts + float(ev.get("dur", 0.0)), ev["cat"], name))
    own: dict[str, float] = defaultdict(float)  # stage -> its own wall time
    covered: dict[str, float] = defaultdict(float)  # stage -> top-level host calls' time inside it
    self_us: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for items in per_tid.values():
        items.sort(key=lambda x: (x[0], -x[1]))
        stack: list[list[Any]] = []  # [start, end, cat, name, children_us, child_ranges_us, stage]

        def close(fr: list[Any]) -> None:
            start, end, cat, name, child, child_ranges, stage = fr
            if cat == "user_annotation":
                own[name[len(ANNOTATION_PREFIX):]] += (end - start) - child_ranges
            else:
                self_us[stage][name].append((end - start) - child)

        for start, end, cat, name in items:
            while stack and stack[-1][1] <= start:
                close(stack.pop())
            parent = stack[-1] if stack else None
            stage = "none"
            for fr in reversed(stack):
                if fr[2] == "user_annotation":
                    stage = fr[3][len(ANNOTATION_PREFIX):]
                    break
            if parent is not None:
                parent[4] += end - start
                if cat == "user_annotation":
                    parent[5] += end - start
                if cat != "user_annotation" and parent[2] == "user_annotation":
                    covered[stage] += end - start
            elif cat != "user_annotation":
                covered["none"] += end - start
            stack.append([start, end, cat, name, 0.0, 0.0, stage])
        while stack:
            close(stack.pop())
    per = max(steps, 1)
    stages = {}
    for stage in sorted(set(own) | set(self_us), key=lambda k: -own.get(k, 0.0)):
        calls = sorted(self_us[stage].items(), key=lambda kv: -sum(kv[1]))
        stages[stage] = {
            "own_us_per_step": round(own.get(stage, 0.0) / per, 1) if stage in own else None,
            "calls_us_per_step": round(covered.get(stage, 0.0) / per, 1),
            "top_self": [{"name": n[:name_chars], "us_per_step": round(sum(d) / per, 1),
                          "calls_per_step": round(len(d) / per, 2)} for n, d in calls[:top]],
        }
    return {"steps": steps, "skip_steps": skip_steps, "stages": stages}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="per-step GPU time by stage and kernel from a torch profiler trace")
    ap.add_argument("trace", help="Chrome trace (.json or .json.gz) of bench/e2e.py --kernel-profile")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--host", action="store_true", help="also the host side (host_summary)")
    ap.add_argument("--skip-steps", type=int, default=1,
                    help="leave out the first steps (default 1: a run's prefill step; 0 keeps every step)")
    args = ap.parse_args(argv)
    events = load_trace(args.trace)
    s = summarize(events, top=args.top, skip_steps=args.skip_steps)
    print(f"steps {s['steps']}, GPU {s.get('gpu_us_per_step')} us/step, busy {s.get('busy_us_per_step')}, "
          f"wall {s.get('wall_us_per_step')} (busy fraction {s.get('busy_fraction')})")
    for stage, st in s["stages"].items():
        print(f"\n{stage}: {st['us_per_step']} us/step, {st['activities_per_step']} activities/step; "
              + ", ".join(f"{c} {v}" for c, v in st["categories_us_per_step"].items()))
        for k in st["top"]:
            print(f"  {k['us_per_step']:9.2f} us  {k['calls_per_step']:7.2f} x {k['mean_us']:8.2f}  "
                  f"[{k['category']}] {k['name']}")
    if args.host:
        h = host_summary(events, top=args.top, skip_steps=args.skip_steps)
        print(f"\nhost, per step ({h['steps']} steps): stage own time, of it in traced calls; top calls by self time")
        for stage, st in h["stages"].items():
            print(f"\n{stage}: own {st['own_us_per_step']} us, calls {st['calls_us_per_step']} us")
            for k in st["top_self"]:
                print(f"  {k['us_per_step']:9.1f} us  {k['calls_per_step']:7.2f} x  {k['name']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
