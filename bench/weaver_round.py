#!/usr/bin/env python3
"""The Weaver tree build with the one-launch round kernel (``cuda/weaver_round.cu``) against the
torch round, at the Qwen3.6-27B drafter shape on the GPU host.

usage: python3 bench/weaver_round.py [--out FILE] [--requests 1,8] [--budgets 32,64] [--repeats 30]
       python3 bench/weaver_round.py --sanitize-case     # small equality run for compute-sanitizer

Per (R, B) with the runtime's default width (``default_weaver_width``; ceil(B / 16) before bench/NOTES.md section 28), top_k 512, children_per_node 8, D 15,
a random bfloat16 Weaver of the default 56.7M-parameter shape (d_model 5120) and random tables of
the 27B vocabulary (248320 rows): the build as the runtime runs it with CUDA graphs
(``runtime/weaver_graphs.py``: one graph per bucket = R, replay, the one host sync, the short eager
tail if any), timed with CUDA events around the whole call (median and min of ``--repeats`` after
the capture), once with the round kernel and once with the torch round (``VLLM_TFM_WEAVER_ROUND_KERNEL``
set while each graph is captured), and whether the two give the same trees (tokens and parents).
"""

from __future__ import annotations

import os
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from gdn_tree import kernel_bench_parser, result_header, write_result

from vllm_tfm.kernels import weaver_round as kw
from vllm_tfm.models import Weaver, WeaverConfig
from vllm_tfm.tree.weaver import default_weaver_width
from vllm_tfm.tree.weaver_padded import WeaverGrowth, weaver_round_reference
from vllm_tfm.vllm_plugin.runtime.weaver_graphs import WeaverGraphs

H, VOCAB, DEPTH, TOP_K, CPN = 5120, 248320, 15, 512, 8


def inputs(r: int, device: torch.device, seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    weaver = Weaver(WeaverConfig(d_model=H, max_depth=DEPTH))
    with torch.no_grad():
        for p in weaver.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    weaver = weaver.to(device=device, dtype=torch.bfloat16).eval()
    # the default arm's weight-only FP8 projections where the environment asks for them as the engine's does
    weaver.fp8_weights = os.environ.get("VLLM_TFM_WEAVER_WEIGHTS") == "fp8"
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    embed = torch.randn(VOCAB, H, generator=gen, device=device).to(torch.bfloat16)
    head = (torch.randn(VOCAB, H, generator=gen, device=device) * 0.05).to(torch.bfloat16)
    return {
        "weaver": weaver, "embed": embed, "head": head,
        "logits": torch.randn(r, DEPTH, VOCAB, generator=gen, device=device) * 3,
        "hidden": torch.randn(r, DEPTH, H, generator=gen, device=device).to(torch.bfloat16),
        "verifier": torch.randn(r, H, generator=gen, device=device).to(torch.bfloat16),
        "roots": torch.randint(0, VOCAB, (r,), generator=gen, device=device),
    }


def time_call_ms(fn: Any) -> float:
    """Milliseconds of one call of ``fn`` (no arguments) between CUDA events on the current stream, from an idle
    device to the end of what it queued there (host work and syncs inside the call included)."""
    stream = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record(stream)
    fn()
    end.record(stream)
    end.synchronize()
    return start.elapsed_time(end)


def timed_build(x: dict[str, Any], budget: int, kernel: bool, repeats: int) -> dict[str, Any]:
    os.environ[kw.ENV_SWITCH] = "1" if kernel else "0"
    graphs = WeaverGraphs(buckets=(int(x["roots"].shape[0]),))
    width = default_weaver_width(budget)
    args = (x["weaver"], x["logits"], x["hidden"], x["verifier"], x["roots"], x["embed"], x["head"],
            budget, TOP_K, width, CPN)
    tokens, parents = graphs.weaver_trees(*args)  # capture (and a first replay)
    (cap,) = graphs._graphs.values()
    kernel_used = isinstance(cap.growth.round_fn, kw.KernelRound)
    ms = [time_call_ms(lambda: graphs.weaver_trees(*args)) for _ in range(repeats)]
    os.environ.pop(kw.ENV_SWITCH, None)
    return {
        "round_kernel": kernel_used, "fixed_rounds": cap.growth.fixed_rounds,
        "tail_rounds": graphs.tail_rounds, "ms_median": statistics.median(ms), "ms_min": min(ms),
        "tokens": tokens, "parents": parents,
    }


def sanitize_case() -> None:
    """Small growths through the kernel and the torch round (fresh random scores): equal trees."""
    dev = torch.device("cuda")
    gen = random.Random(5)
    for case in range(6):
        r_ = gen.randint(1, 5)
        k = gen.choice([3, 37, 512])
        budgets = [gen.randint(1, 40) for _ in range(r_)]
        depths = [gen.randint(1, 15) for _ in range(r_)]
        widths = [gen.randint(1, 5) for _ in range(r_)]
        cands = torch.stack([torch.randperm(4 * k, device=dev)[:k].repeat(max(depths), 1) for _ in range(r_)])
        roots = torch.randint(0, 4 * k, (r_,), device=dev)
        table = torch.log_softmax(torch.randn(64, max(depths), k, device=dev) * 2, dim=-1)

        def scorer(ids, parents, tokens, depths_, valid, table=table):
            return table[(ids * 7 + tokens) % 64, depths_.clamp(max=table.shape[1] - 1)]

        trees = []
        for kernel in (False, True):
            g = WeaverGrowth(roots, cands, scorer, budgets, depths, widths, CPN)
            g.round_fn = kw.KernelRound(g) if kernel else weaver_round_reference
            g.run_fixed()
            g.run_tail()
            trees.append(g.trees())
        a, b = trees
        for name in ("tokens", "parents", "depth", "scores", "num_nodes"):
            if not torch.equal(getattr(a, name), getattr(b, name)):
                raise SystemExit(f"sanitize case {case}: {name} differ")
    torch.cuda.synchronize()
    print("sanitize case: the kernel's trees equal the torch round's")


def main() -> int:
    ap = kernel_bench_parser(__doc__, repeats=30)
    ap.add_argument("--requests", default="1,8")
    ap.add_argument("--budgets", default="32,64")
    args = ap.parse_args()
    if args.sanitize_case:
        sanitize_case()
        return 0
    dev = torch.device("cuda")
    res: dict[str, Any] = {
        **result_header("bench/weaver_round.py"),
        "shape": {"d_model": H, "vocab": VOCAB, "depth": DEPTH, "top_k": TOP_K, "children_per_node": CPN,
                  "weaver": "WeaverConfig defaults (d_rank 1024, 3 layers, 8 heads, d_mlp 3072), bfloat16"},
        "cases": [],
    }
    ok = True
    for r in (int(v) for v in args.requests.split(",")):
        x = inputs(r, dev, seed=r)
        for b in (int(v) for v in args.budgets.split(",")):
            with torch.inference_mode():
                torch_round = timed_build(x, b, False, args.repeats)
                kernel = timed_build(x, b, True, args.repeats)
            same = bool(torch.equal(torch_round.pop("tokens"), kernel.pop("tokens"))
                        and torch.equal(torch_round.pop("parents"), kernel.pop("parents")))
            ok &= same and kernel["round_kernel"] and not torch_round["round_kernel"]
            case = {"requests": r, "budget": b, "width": default_weaver_width(b), "torch_round": torch_round,
                    "round_kernel": kernel, "trees_equal": same,
                    "speedup": torch_round["ms_median"] / kernel["ms_median"]}
            res["cases"].append(case)
            print(f"R={r:2d} B={b:3d}: torch round {torch_round['ms_median']:.3f} ms -> kernel "
                  f"{kernel['ms_median']:.3f} ms, {case['speedup']:.2f}x, trees equal {same}", flush=True)
        del x
        torch.cuda.empty_cache()
    res["ok"] = ok
    write_result(args.out, res)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
