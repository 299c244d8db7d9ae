#!/usr/bin/env python3
"""Tree building for R requests: per-request builders (a Python loop) vs the lockstep builders.

Usage, from the repository root (CPU, or on the GPU host with ``--device cuda``):

    python3 bench/tree_build.py [--device cpu|cuda] [--out results.json] [--quick] [--threads 1]

Measures, at R requests (default 8), budget B (default 64), w = the runtime's default (``default_weaver_width``; ceil(B / 16) before bench/NOTES.md section 28), children_per_node 8,
K = 512 Weaver candidates, D = 15 depths:

* ``weaver_growth`` / ``treeflash_growth``: the builders alone, with scorers that only look rows up
  in precomputed random tables (no model): ``build_weaver`` / ``build_treeflash`` once per request
  vs ``build_weaver_padded`` / ``build_treeflash_padded`` once for all;
* ``weaver_trees``: the TfM proposal end to end with a random Weaver (CPU: d_model 256, d_rank 128,
  2 layers, V 4096; CUDA: the 56.7M-parameter shape at d_model 5120, bf16, V 151936): the former
  runtime loop (``build_weaver`` + ``WeaverTreeScorer`` per request) vs ``weaver_draft_trees``
  (the runtime's ``weaver_trees`` now), and whether their trees agree;
* ``ops_per_round``: torch operator calls (aten dispatches, each one device launch or less on a
  GPU) that ``build_weaver_padded`` issues per growth round outside the scorer, counted with a
  TorchDispatchMode at two budgets (the slope removes the fixed setup).

* ``eval_throughput``: trees per second of ``weaver_padded_trees`` / ``treeflash_padded_trees``
  for a chunk of R anchors (CUDA: 64, CPU: 8) at B = 16, 32, 64, 128 (offline evaluation builds
  one tree per anchor position).

Times: best of ``--repeats`` runs after one warm-up, CUDA synchronised.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_tfm.models import Weaver, WeaverConfig, weaver_draft_trees
from vllm_tfm.tree import (
    build_treeflash,
    build_treeflash_padded,
    build_weaver,
    build_weaver_padded,
    default_weaver_width,
)


def timed(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Best of ``repeats`` wall times after one warm-up (the minimum: robust on a shared CPU)."""
    fn()
    out = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        out.append(time.perf_counter() - t0)
    return min(out)


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def random_logprobs(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    return torch.log_softmax(torch.randn(shape, generator=gen) * 2, dim=-1).to(device)


def weaver_growth(r: int, b: int, w: int, cpn: int, k: int, d: int, device: torch.device, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    table = random_logprobs((r, b + 2, k), gen, device)  # row of node id (ids <= 1 + B)
    cands = torch.stack([torch.stack([torch.randperm(4 * k, generator=gen)[:k] for _ in range(d)]) for _ in range(r)])
    cands = cands.to(device)
    roots = list(range(r))
    rows = torch.arange(r, device=device)[:, None]

    def per_request() -> None:
        for i in range(r):
            build_weaver(roots[i], cands[i], lambda ids, p, t, dd, i=i: table[i, ids], b, d, w, cpn)

    def padded() -> None:
        build_weaver_padded(roots, cands, lambda ids, p, t, dd, ok: table[rows, ids], b, d, w, cpn, check=False)

    same = all(
        build_weaver(roots[i], cands[i], lambda ids, p, t, dd, i=i: table[i, ids], b, d, w, cpn).parents.tolist()
        == tree.parents.tolist()
        for i, tree in enumerate(
            build_weaver_padded(roots, cands, lambda ids, p, t, dd, ok: table[rows, ids], b, d, w, cpn).trees()
        )
    )
    return {"per_request_s": timed(per_request, repeats, device), "padded_s": timed(padded, repeats, device), "same_trees": same}


def weaver_ops_per_round(r: int, w: int, cpn: int, k: int, d: int) -> dict:
    counts = {}
    for b in (32, 64):
        gen = torch.Generator().manual_seed(1)
        table = random_logprobs((r, b + 2, k), gen, torch.device("cpu"))
        cands = torch.arange(d * k).view(1, d, k).expand(r, d, k).contiguous()
        rows = torch.arange(r)[:, None]
        with OpCounter() as c:
            build_weaver_padded(list(range(r)), cands, lambda ids, p, t, dd, ok, tb=table, rw=rows: tb[rw, ids], b, d, w, cpn,
                                check=False)
        counts[b] = (c.ops, math.ceil(b / w))
    (o1, n1), (o2, n2) = counts[32], counts[64]
    return {"ops_b32": o1, "ops_b64": o2, "rounds_b32": n1, "rounds_b64": n2, "ops_per_round": (o2 - o1) / (n2 - n1)}


def treeflash_growth(r: int, b: int, m: int, d: int, vocab: int, device: torch.device, repeats: int) -> dict:
    gen = torch.Generator().manual_seed(2)
    marg = random_logprobs((r, d, vocab), gen, device)
    trans = random_logprobs((r, d, m, vocab), gen, device)  # rows do not depend on the previous token here
    roots = list(range(r))

    def per_request() -> None:
        for i in range(r):
            build_treeflash(roots[i], marg[i], lambda dd, prev, i=i: trans[i, dd - 1, : prev.numel()], b, d, m)

    def padded() -> None:
        build_treeflash_padded(roots, marg, lambda dd, prev: trans[:, dd - 1, : prev.shape[1]], b, d, m, check=False)

    ref = [build_treeflash(roots[i], marg[i], lambda dd, prev, i=i: trans[i, dd - 1, : prev.numel()], b, d, m) for i in range(r)]
    got = build_treeflash_padded(roots, marg, lambda dd, prev: trans[:, dd - 1, : prev.shape[1]], b, d, m).trees()
    same = all(a.parents.tolist() == g.parents.tolist() and a.tokens.tolist() == g.tokens.tolist() for a, g in zip(ref, got))
    return {"per_request_s": timed(per_request, repeats, device), "padded_s": timed(padded, repeats, device), "same_trees": same}


def previous_weaver_trees(weaver, logits, hidden, verifier, roots, embed, head, b, k, w, cpn):
    """The runtime's former weaver_trees: one build_weaver + WeaverTreeScorer per request."""
    d = logits.shape[1]
    cl, cand = torch.topk(logits.float(), k, dim=-1)
    trees = []
    for i, root in enumerate(roots.tolist()):
        scorer = weaver.tree_scorer(verifier[i], hidden[i], cand[i], cl[i].to(hidden.dtype), embed, head)
        trees.append(build_weaver(root, cand[i], scorer, b, d, w, cpn))
    return trees


def model_inputs(r: int, d: int, device: torch.device, seed: int) -> dict:
    """Random target embedding / lm_head, DFlash logits and hidden states, Weaver and TreeFlash."""
    from vllm_tfm.models import TreeFlashApproximator, TreeFlashConfig
    from vllm_tfm.models.common import RMSNorm

    if device.type == "cuda":
        h, vocab, dtype, cfg = 5120, 151936, torch.bfloat16, WeaverConfig(d_model=5120, max_depth=d)
        inter = 4096
    else:
        h, vocab, dtype = 256, 4096, torch.float32
        cfg = WeaverConfig(d_model=h, d_rank=128, n_layers=2, n_heads=4, d_mlp=384, max_depth=d)
        inter = 256
    torch.manual_seed(seed)
    weaver = Weaver(cfg).to(device=device, dtype=dtype).eval()
    approx = TreeFlashApproximator(TreeFlashConfig(hidden_size=h, intermediate_size=inter))
    torch.nn.init.normal_(approx.down.weight, std=0.02)
    approx = approx.to(device=device, dtype=dtype).eval()
    norm = RMSNorm(h).to(device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    embed = torch.randn(vocab, h, generator=gen, device=device).to(dtype)
    head = (torch.randn(vocab, h, generator=gen, device=device) * 0.05).to(dtype)
    pre = torch.randn(r, d + 1, h, generator=gen, device=device).to(dtype)
    with torch.no_grad():
        hidden = norm(pre[:, 1:])
        logits = (hidden @ head.T) * 3
    return {
        "weaver": weaver, "approx": approx, "norm": norm, "embed": embed, "head": head, "pre": pre,
        "hidden": hidden, "logits": logits, "marg": torch.log_softmax(logits.float(), -1),
        "verifier": torch.randn(r, h, generator=gen, device=device).to(dtype),
        "roots": torch.randint(0, vocab, (r,), generator=gen, device=device),
        "desc": {"d_model": h, "d_rank": cfg.d_rank, "n_layers": cfg.n_layers, "vocab": vocab, "dtype": str(dtype),
                 "treeflash_intermediate": inter},
    }


def eval_throughput(r: int, d: int, cpn: int, k: int, m: int, device: torch.device, repeats: int) -> dict:
    from vllm_tfm.models import treeflash_padded_trees, weaver_padded_trees

    x = model_inputs(r, d, device, seed=7)
    out = {"requests": r, "models": x["desc"], "weaver_trees_per_s": {}, "treeflash_trees_per_s": {}}
    for b in (16, 32, 64, 128):
        w = default_weaver_width(b)
        t = timed(lambda b=b, w=w: weaver_padded_trees(
            x["weaver"], x["logits"], x["hidden"], x["verifier"], x["roots"], x["embed"], x["head"], b, k, w, cpn
        ), repeats, device)
        out["weaver_trees_per_s"][b] = r / t
        t = timed(lambda b=b: treeflash_padded_trees(
            x["approx"], x["norm"], x["pre"], x["marg"], x["roots"], x["embed"], x["head"], b, d, m
        ), repeats, device)
        out["treeflash_trees_per_s"][b] = r / t
    return out


def weaver_end_to_end(r: int, b: int, w: int, cpn: int, k: int, d: int, device: torch.device, repeats: int) -> dict:
    x = model_inputs(r, d, device, seed=3)
    weaver, logits, hidden, verifier, roots, embed, head = (
        x[n] for n in ("weaver", "logits", "hidden", "verifier", "roots", "embed", "head")
    )

    def new() -> tuple:
        return weaver_draft_trees(weaver, logits, hidden, verifier, roots, embed, head, b, k, w, cpn,
                                  logits_dtype=hidden.dtype)

    def old() -> list:
        return previous_weaver_trees(weaver, logits, hidden, verifier, roots, embed, head, b, k, w, cpn)

    tok, par = new()
    agree = sum(
        t.parents.tolist() == par[i, : t.num_nodes].tolist() and t.tokens[1:].tolist() == tok[i, : t.num_nodes - 1].tolist()
        for i, t in enumerate(old())
    )
    return {
        "models": x["desc"],
        "per_request_s": timed(old, repeats, device),
        "padded_s": timed(new, repeats, device),
        "trees_equal": f"{agree}/{r}",
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="CPU threads (1: steadier timings on a shared machine)")
    args = ap.parse_args()
    device = torch.device(args.device)
    torch.set_num_threads(args.threads)
    r, b, cpn, k, d, m = args.requests, args.budget, 8, 512, 15, 16
    w = default_weaver_width(b)
    repeats = 2 if args.quick else args.repeats
    res = {
        "command": "python3 bench/tree_build.py " + " ".join(sys.argv[1:]),
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
                    "threads": torch.get_num_threads(), "host": platform.node()},
        "shape": {"requests": r, "budget": b, "width": w, "children_per_node": cpn, "top_k": k, "depth": d, "top_m": m},
    }
    if device.type == "cuda":
        res["machine"]["gpu"] = torch.cuda.get_device_name(device)
    res["weaver_growth"] = weaver_growth(r, b, w, cpn, k, d, device, repeats)
    res["treeflash_growth"] = treeflash_growth(r, b, m, d, 4096 if device.type == "cpu" else 151936, device, repeats)
    res["weaver_trees"] = weaver_end_to_end(r, b, w, cpn, k, d, device, repeats)
    res["ops_per_round"] = weaver_ops_per_round(r, w, cpn, k, d)
    res["eval_throughput"] = eval_throughput(64 if device.type == "cuda" else 8, d, cpn, k, m, device, repeats)
    print(json.dumps(res, indent=2))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
