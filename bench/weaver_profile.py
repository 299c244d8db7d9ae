#!/usr/bin/env python3
"""Where the time of one Weaver tree build goes, kernel by kernel, at the Qwen3.6-27B drafter shape.

usage: python3 bench/weaver_profile.py [--out FILE] [--cases 1:32:2,1:32:4,8:32:2] [--repeats 10]
       python3 bench/weaver_profile.py --prompt-overlap-ab [--cases 1:16:2,2:16:2,4:16:2,8:16:2] [--repeats 25]

Per case R:B:w (requests, budget, Weaver width): the build as the runtime runs it
(``runtime/weaver_graphs.py``: one CUDA graph per bucket, its replay, the one host sync), with
the inputs, Weaver and tables of ``bench/weaver_round.py`` (random bfloat16 Weaver of the default
56.7M-parameter shape, 248320-row tables). Reports

* ``wall_ms``: CUDA events around the whole call (median and min of ``--repeats``);
* ``kernels``: torch.profiler (CUPTI) device kernels of ``--repeats`` replays, per kernel name:
  launches per build, device microseconds per build, share of the kernel sum (the 30 longest names,
  the rest summed in one row);
* ``kernel_sum_ms`` and ``gpu_busy``: the kernel sum per build and its fraction of the wall time
  (1 - gpu_busy is time the device spent between kernels: launch gaps and host work);
* ``segments``: one build's kernels split at the round kernels (``cuda/weaver_round.cu``): the
  first segment is the setup (top-K, the prompt pass) plus the roots' scorer call, each next one a
  round kernel plus the next scorer call (count, device us);
* ``sequence`` (with ``--sequence``): the first build's kernels in order (short name, microseconds),
  for attribution (~90 KB per case).

With ``--prompt-overlap-ab`` each case instead times the build with the Weaver's prompt pass on its own
stream (``VLLM_TFM_WEAVER_PROMPT_OVERLAP``, ``set_prompt_overlap``) and without, in one process on one graph
object (one graph per setting), in rounds of ``--repeats`` builds per setting in ABBA order (8 rounds), with
the DFlash logits in bfloat16 as the engine's drafter gives them; it records each setting's median and
minimum and whether the two settings' trees are equal.

Profiling adds no kernels; the wall time is measured outside the profiler. The ``VLLM_TFM_*``
environment (e.g. ``VLLM_TFM_CANDIDATE_KERNEL=0``, ``VLLM_TFM_WEAVER_ROUND_KERNEL=0``) is recorded;
``VLLM_TFM_WEAVER_WEIGHTS=fp8`` gives the Weaver its weight-only FP8 rows (the e2e default arm's).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from weaver_round import CPN, TOP_K, inputs, time_call_ms

from vllm_tfm.vllm_plugin.runtime.weaver_graphs import WeaverGraphs

KEEP_KERNELS = 30  # kernel names kept per case (by device time), the rest summed in one row


def short(name: str, n: int = 90) -> str:
    return name if len(name) <= n else name[: n - 3] + "..."


def parse_cases(text: str) -> list[tuple[int, int, int]]:
    out = []
    for part in text.split(","):
        r, b, w = (int(v) for v in part.split(":"))
        out.append((r, b, w))
    return out


def device_kernels(prof: torch.profiler.profile) -> list[tuple[float, str, float]]:
    """(start us, name, duration us) of every device kernel the profiler saw, in start order."""
    rows = []
    for evt in prof.events():
        if evt.device_type != torch.autograd.DeviceType.CUDA:
            continue
        rows.append((evt.time_range.start, evt.name, evt.time_range.elapsed_us()))
    rows.sort()
    return rows


def profile_case(x: dict[str, Any], budget: int, width: int, repeats: int, sequence: bool) -> dict[str, Any]:
    r = int(x["roots"].shape[0])
    graphs = WeaverGraphs(buckets=(r,))
    args = (x["weaver"], x["logits"], x["hidden"], x["verifier"], x["roots"], x["embed"], x["head"],
            budget, TOP_K, width, CPN)
    graphs.weaver_trees(*args)  # capture and a first replay
    (cap,) = graphs._graphs.values()
    ms = [time_call_ms(lambda: graphs.weaver_trees(*args)) for _ in range(repeats)]
    torch.cuda.synchronize()
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(repeats):
            graphs.weaver_trees(*args)
            torch.cuda.synchronize()
    rows = device_kernels(prof)
    per_build = len(rows) / repeats
    agg: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for _, name, us in rows:
        agg[name][0] += 1
        agg[name][1] += us
    total_us = sum(v[1] for v in agg.values()) / repeats
    kernels = sorted(
        ({"name": short(k), "per_build": v[0] / repeats, "us_per_build": v[1] / repeats,
          "share": v[1] / repeats / total_us if total_us else 0.0} for k, v in agg.items()),
        key=lambda d: -d["us_per_build"],
    )
    if len(kernels) > KEEP_KERNELS:  # the rest in one row
        rest = kernels[KEEP_KERNELS:]
        kernels = kernels[:KEEP_KERNELS] + [{
            "name": f"({len(rest)} other kernel names)", "per_build": sum(d["per_build"] for d in rest),
            "us_per_build": sum(d["us_per_build"] for d in rest), "share": sum(d["share"] for d in rest)}]
    first = rows[: round(per_build)]
    # one build in order: setup + the roots' scorer call, then per round the round kernel and the
    # next scorer call; split at the round kernels (cuda/weaver_round.cu)
    segments: list[list[float]] = [[]]
    for _, name, us in first:
        if "weaver_round" in name:
            segments.append([])
        segments[-1].append(us)
    seg = [{"kernels": len(s_), "us": round(sum(s_), 1)} for s_ in segments]
    rounds_us = [d["us"] for d in seg[1:-1]] or [0.0]
    case = {
        "requests": r, "budget": budget, "width": width,
        "fixed_rounds": cap.growth.fixed_rounds, "tail_rounds": graphs.tail_rounds,
        "wall_ms": {"median": statistics.median(ms), "min": min(ms)},
        "kernels_per_build": per_build,
        "kernel_sum_ms": total_us / 1000.0,
        "gpu_busy": total_us / 1000.0 / statistics.median(ms),
        "kernels": kernels,
        "segments": seg,
        "round_segment_us_median": statistics.median(rounds_us),
    }
    if sequence:
        case["sequence"] = [(short(name, 60), round(us, 2)) for _, name, us in first]
    return case


def prompt_overlap_ab(x: dict[str, Any], budget: int, width: int, repeats: int, rounds: int = 8) -> dict[str, Any]:
    """The build's wall time with the prompt pass on its own stream and without (module docstring)."""
    from vllm_tfm.vllm_plugin.runtime.tree_builder_gpu import set_prompt_overlap

    r = int(x["roots"].shape[0])
    graphs = WeaverGraphs(buckets=(r,))
    args = (x["weaver"], x["logits"].to(torch.bfloat16), x["hidden"], x["verifier"], x["roots"], x["embed"], x["head"],
            budget, TOP_K, width, CPN)
    ms: dict[bool, list[float]] = {False: [], True: []}
    trees: dict[bool, tuple[torch.Tensor, torch.Tensor]] = {}
    try:
        for on in (False, True):  # each setting's capture and a first replay
            set_prompt_overlap(on)
            trees[on] = graphs.weaver_trees(*args)
        for i in range(rounds):
            for on in ((False, True) if i % 2 == 0 else (True, False)):
                set_prompt_overlap(on)
                ms[on] += [time_call_ms(lambda: graphs.weaver_trees(*args)) for _ in range(repeats)]
    finally:
        set_prompt_overlap(None)
    same = all(torch.equal(u, v) for u, v in zip(trees[False], trees[True]))
    med = {on: statistics.median(v) for on, v in ms.items()}
    return {
        "requests": r, "budget": budget, "width": width, "builds_per_setting": len(ms[True]),
        "off_ms": {"median": med[False], "min": min(ms[False])}, "on_ms": {"median": med[True], "min": min(ms[True])},
        "delta_median_ms": med[True] - med[False], "graphs": len(graphs._graphs), "same_trees": same,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--cases", default="1:32:2,1:32:4,8:32:2")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--top", type=int, default=25, help="kernel names printed per case")
    ap.add_argument("--sequence", action="store_true", help="keep the first build's kernel order in the JSON")
    ap.add_argument("--prompt-overlap-ab", action="store_true",
                    help="time each case with the prompt pass on its own stream and without (no profile)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    res: dict[str, Any] = {
        "command": "python3 bench/weaver_profile.py " + " ".join(sys.argv[1:]),
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(dev)},
        "shape": "bench/weaver_round.py's: d_model 5120, vocab 248320, D 15, top_k 512, 8 children per node, "
                 "WeaverConfig defaults (d_rank 1024, 3 layers, 8 heads, d_mlp 3072), bfloat16",
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_TFM_")},
        "cases": [],
    }
    inputs_by_r: dict[int, dict[str, Any]] = {}
    for r, b, w in parse_cases(args.cases):
        if r not in inputs_by_r:
            inputs_by_r.clear()
            torch.cuda.empty_cache()
            inputs_by_r[r] = inputs(r, dev, seed=r)
        if args.prompt_overlap_ab:
            with torch.inference_mode():
                case = prompt_overlap_ab(inputs_by_r[r], b, w, args.repeats)
            res["cases"].append(case)
            print(f"R={r} B={b} w={w}: prompt pass beside the top-K {case['on_ms']['median']:.3f} ms, after it "
                  f"{case['off_ms']['median']:.3f} ms (median of {case['builds_per_setting']} builds each; "
                  f"{case['delta_median_ms']:+.3f} ms), same trees: {case['same_trees']}", flush=True)
            if args.out:
                Path(args.out).write_text(json.dumps(res, separators=(",", ":")) + "\n")
            continue
        with torch.inference_mode():
            case = profile_case(inputs_by_r[r], b, w, args.repeats, args.sequence)
        res["cases"].append(case)
        print(f"R={r} B={b} w={w}: wall {case['wall_ms']['median']:.3f} ms, kernels {case['kernels_per_build']:.0f} "
              f"summing to {case['kernel_sum_ms']:.3f} ms (GPU busy {case['gpu_busy']:.0%}), "
              f"rounds {case['fixed_rounds']} + tail {case['tail_rounds']}; first segment "
              f"{case['segments'][0]['us']:.0f} us, round segment {case['round_segment_us_median']:.0f} us", flush=True)
        for k in case["kernels"][: args.top]:
            print(f"   {k['us_per_build']:9.1f} us {k['per_build']:6.1f}x  {k['share']:6.1%}  {k['name']}")
        if args.out:  # written after every case: a killed run keeps what it measured
            Path(args.out).write_text(json.dumps(res, separators=(",", ":")) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
