#!/usr/bin/env python3
"""GDN tree verify / commit and tree conv1d kernels at the Qwen3.6-27B layer shape, on one GPU.

Usage, from the repository root on the GPU host:

    python3 bench/gdn_tree.py [--out bench/results/gdn_tree.json] [--quick] [--budget-s 200]
    python3 bench/gdn_tree.py --sanitize-case     # small correctness run (for compute-sanitizer)
    python3 bench/gdn_tree.py --n 17 33 65 --batch 1 2 8 32 --fixed-plan [--depth-bound 15]
        # the full CUDA graphs' plans (TreePlan.build_into), optionally with the runtime's depth bound

Shape: H = 16 q/k heads, HV = 48 value heads, K = V = 128, q/k/v bf16, fp32 state. Trees are
DDTree-like (best-first over random per-depth marginals, depth <= 16, deterministic seeds).
For each n in {16, 32, 64, 128, 256} and batch in {1, 8, 32} it times:
  * ours: vllm_tfm.kernels gdn_tree_verify_planned (the default kernel version) at BV = 16, 32,
    64 and the automatic choice, and every version (1-7) at its own automatic choice (side by side,
    same run; versions 4 and 5 are also checked bit for bit against version 3);
  * per-kernel breakdown (n in {16, 64, 128}, batch in {1, 8}): the pairs kernel alone, the main
    kernel alone and the whole call, every version, at the automatic BV;
  * per-branch: every root-to-leaf path through vLLM's fused recurrent GDN kernel
    (fused_sigmoid_gating_delta_rule_update, varlen over all paths in one launch; the gathers
    that build the paths are not timed), when vLLM is importable;
  * the torch reference (vllm_tfm.verify.gdn), eager, batch 1 (it loops over requests in Python);
  * the bytes-moved floor at the device-to-device copy bandwidth measured in the same run.
Times are medians of CUDA-event timings of CUDA-graph replays (one replay = one call per input
set; input sets and state slots rotate so that S0 is never L2-resident), after warm-up.
Commit and conv are measured the same way. A table is printed last; JSON goes to --out.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_tfm.kernels import batched_commit as kbatch  # noqa: E402
from vllm_tfm.kernels import conv as kconv  # noqa: E402
from vllm_tfm.kernels import gdn as kgdn  # noqa: E402
from vllm_tfm.kernels import loader  # noqa: E402
from vllm_tfm.kernels.plan import CommitIndices, TreePlan  # noqa: E402
from vllm_tfm.tree import depths_from_parents  # noqa: E402
from vllm_tfm.verify import conv as ref_conv  # noqa: E402
from vllm_tfm.verify import gdn as ref_gdn  # noqa: E402

DEV = "cuda"
H, HV, KD, VD = 16, 48, 128, 128
CONV_DIM, CONV_W = 2 * H * KD + HV * VD, 4
STATE_BYTES = HV * VD * KD * 4
NODE_BYTES = 2 * H * KD * 2 + HV * VD * 2 + HV * 4 * 2 + HV * VD * 2  # q, k, v, g, beta, o
L2_DEFEAT_BYTES = 240e6  # rotate input sets until the state pool is 4x the 60 MB L2
BREAKDOWN_N, BREAKDOWN_BATCH = (16, 64, 128), (1, 8)
V8_KERNELS = ["gdn_tree_paths_solve", "gdn_tree_verify_paths"]  # version 8's launches where it takes the call
PATHS_CLUSTERS = (1, 6)  # clusters timed with version 8's in-kernel solve (P8_PREGRAM=0): divisors of 6 CTAs


# ---------------------------------------------------------------------------------------------
# trees


def ddtree_parents(n: int, seed: int, max_depth: int = 16, width: int = 64) -> list[int]:
    """A DDTree-style best-first tree of n nodes (node 0 the root), depth <= max_depth.

    Per depth d a random marginal p_d over `width` ranked tokens (geometric with a random
    sharpness); pop the best frontier node (score = path log-probability), then push its next
    sibling and its first child (DDTree's expansion rule). Deterministic for a seed.
    """
    rng = random.Random(seed)
    logp = []
    for _ in range(max_depth + 1):
        t = rng.uniform(0.3, 2.0)
        w = [math.exp(-t * r) for r in range(width)]
        s = sum(w)
        logp.append([math.log(x / s) for x in w])
    parents = [-1]
    heap = [(-logp[1][0], 0, 1, 0)]  # (-score, parent, depth, rank)
    while len(parents) < n and heap:
        neg, p, d, r = heapq.heappop(heap)
        score = -neg
        i = len(parents)
        parents.append(p)
        if r + 1 < width:
            heapq.heappush(heap, (-(score - logp[d][r] + logp[d][r + 1]), p, d, r + 1))
        if d + 1 <= max_depth:
            heapq.heappush(heap, (-(score + logp[d + 1][0]), i, d + 1, 0))
    return parents


def tree_batch(n: int, batch: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    trees = [ddtree_parents(n, seed * 1000 + r) for r in range(batch)]
    cu = [0]
    for t in trees:
        cu.append(cu[-1] + len(t))
    return torch.tensor([p for t in trees for p in t]), torch.tensor(cu), trees


def root_to_leaf_paths(trees: list[list[int]], cu: list[int]) -> list[list[int]]:
    """Flat node indices of every root-to-leaf path of every tree."""
    paths = []
    for r, par in enumerate(trees):
        has_child = [False] * len(par)
        for p in par[1:]:
            has_child[p] = True
        for leaf, hc in enumerate(has_child):
            if hc:
                continue
            path, node = [], leaf
            while node >= 0:
                path.append(cu[r] + node)
                node = par[node]
            paths.append(path[::-1])
    return paths


# ---------------------------------------------------------------------------------------------
# timing


def time_calls(fns: list[Callable[[], object]], reps: int, graph: bool = True) -> tuple[float, str]:
    """Median microseconds per call over `reps` timed passes (one pass calls each fn once).

    With graph=True a CUDA graph of one pass is captured and replayed (no launch gaps);
    if capture fails the pass runs eagerly and the mode says why.
    """
    for f in fns:
        f()
    torch.cuda.synchronize()
    mode, run = "eager", None
    if graph:
        try:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for f in fns:
                    f()
            torch.cuda.current_stream().wait_stream(side)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for f in fns:
                    f()
            run, mode = g.replay, "graph"
        except Exception as exc:  # noqa: BLE001 - report and time eagerly
            torch.cuda.synchronize()
            mode = f"eager (graph capture failed: {type(exc).__name__}: {str(exc)[:80]})"
    if run is None:
        def run() -> None:
            for f in fns:
                f()
    run()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / len(fns))
    return statistics.median(times), mode


def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus bytes written."""
    a = torch.empty(nbytes // 4, dtype=torch.float32, device=DEV).normal_()
    b = torch.empty_like(a)
    b.copy_(a)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1000.0)
    del a, b
    return 2 * nbytes / statistics.median(times)


def host_us(fn: Callable[[], object], reps: int, calls: int = 10) -> float:
    """Median host microseconds to issue one call (``calls`` calls per sample, synchronised between samples)."""
    times = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - t) * 1e6 / calls)
    torch.cuda.synchronize()
    return statistics.median(times)


def kernel_bench_parser(doc: str, repeats: int) -> argparse.ArgumentParser:
    """The options the Weaver kernel benches share (bench/candidate_scores.py, weaver_linear.py,
    weaver_round.py, weaver_attention.py): --out FILE, --repeats N, --sanitize-case."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--repeats", type=int, default=repeats)
    ap.add_argument("--sanitize-case", action="store_true", help="a small kernel-vs-reference run for compute-sanitizer")
    return ap


def result_header(script: str) -> dict:
    """The first keys of a kernel bench's result file: the command that made it and the machine."""
    return {"command": f"python3 {script} " + " ".join(sys.argv[1:]),
            "machine": {"python": platform.python_version(), "torch": torch.__version__,
                        "gpu": torch.cuda.get_device_name(DEV)}}


def write_result(path: str | None, res: dict) -> None:
    """A kernel bench's results as one line of JSON at ``path`` (nothing when None)."""
    if path:
        Path(path).write_text(json.dumps(res, separators=(",", ":")) + "\n")


def past_budget(start: float, budget_s: float | None, skipped: list, **case: object) -> bool:
    """A kernel bench's ``--budget-s``: True once ``budget_s`` seconds have passed since ``start``
    (``time.perf_counter``), and then the case (its parameters, ``case``) is added to ``skipped`` with the
    reason and printed; always False without a budget."""
    if budget_s is None or time.perf_counter() - start <= budget_s:
        return False
    skipped.append({**case, "why": f"past --budget-s {budget_s:g}"})
    print(" ".join(f"{k} {v}" for k, v in case.items()) + ": skipped (past --budget-s)", flush=True)
    return True


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


# ---------------------------------------------------------------------------------------------
# inputs


def gdn_inputs(t_nodes: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random verify inputs drawn on the device (gen must be a generator of DEV)."""
    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=DEV)

    a, b = rnd(t_nodes, HV), rnd(t_nodes, HV)
    a_log = torch.rand(HV, generator=gen, device=DEV) * 2.0
    dt_bias = rnd(HV) * 0.5
    g, beta = ref_gdn.gdn_gates(a, b, a_log, dt_bias)
    return dict(q=rnd(t_nodes, H, KD).to(torch.bfloat16), k=rnd(t_nodes, H, KD).to(torch.bfloat16),
                v=rnd(t_nodes, HV, VD).to(torch.bfloat16), g=g, beta=beta, a=a, b=b, A_log=a_log, dt_bias=dt_bias)


def device_gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEV).manual_seed(seed)


def n_sets_for(batch: int) -> int:
    return max(2, math.ceil(L2_DEFEAT_BYTES / (batch * STATE_BYTES)))


# ---------------------------------------------------------------------------------------------
# verify


def bench_verify(n: int, batch: int, bw: float, reps: int, vllm_fn, allow_slow: bool, fixed_plan: bool = False,
                 depth_bound: int | None = None) -> dict:
    parents, cu, trees = tree_batch(n, batch)
    if fixed_plan:  # the full CUDA graphs' layout (runtime/full_graphs.py): capacity depth n - 1, n (n + 1) / 2 pairs
        plan = TreePlan.build_into(torch.zeros(TreePlan.fixed_size(batch, n), dtype=torch.int32, device=DEV), parents, cu, n,
                                   depth_bound=depth_bound)
    else:
        plan = TreePlan.build(parents, cu, device=DEV)
    t_nodes = plan.num_nodes
    sets = n_sets_for(batch)
    gen = device_gen(n * 100 + batch)
    inputs = [gdn_inputs(t_nodes, gen) for _ in range(sets)]
    pool = torch.randn(sets * batch, HV, VD, KD, generator=gen, device=DEV) * 0.1
    slots = [torch.arange(s * batch, (s + 1) * batch, device=DEV) for s in range(sets)]
    nbytes = batch * STATE_BYTES + t_nodes * NODE_BYTES
    row = dict(n=n, batch=batch, nodes=t_nodes, pairs=plan.num_pairs, max_depth=plan.max_depth,
               depth_bound=plan.depth_bound, tree_max_depth=max(int(depths_from_parents(torch.tensor(t)).max()) for t in trees), input_sets=sets, bytes=nbytes, floor_us=nbytes / bw * 1e6)
    t0 = time.perf_counter()
    TreePlan.build(parents, cu, device=DEV)
    torch.cuda.synchronize()
    row["plan_build_ms"] = (time.perf_counter() - t0) * 1e3

    def ours(s: int, bv: int | None, variant: int = kgdn.DEFAULT_VERIFY_VARIANT):
        x = inputs[s]
        return lambda: kgdn.gdn_tree_verify_planned(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots[s], block_v=bv,
                                                    variant=variant)

    props = torch.cuda.get_device_properties(0)
    auto_bv = kgdn.choose_block_v(plan, HV, KD, VD, loader.device_smem_optin(0), props.multi_processor_count)
    row["auto_block_v"] = auto_bv
    ours_us = {}
    for bv in (16, 32, 64):
        try:
            us, mode = time_calls([ours(s, bv) for s in range(sets)], reps)
            ours_us[f"bv{bv}"] = us
            row["ours_mode"] = mode
        except Exception as exc:  # noqa: BLE001 - e.g. shared memory
            ours_us[f"bv{bv}"] = None
            row[f"ours_bv{bv}_error"] = f"{type(exc).__name__}: {exc}"[:200]
    row["ours_us"] = ours_us
    valid = {k: v for k, v in ours_us.items() if v is not None}
    row["ours_best_us"] = min(valid.values()) if valid else None
    row["ours_best_bv"] = min(valid, key=valid.get) if valid else None
    row["ours_auto_us"] = ours_us.get(f"bv{auto_bv}")
    row["default_variant"] = kgdn.DEFAULT_VERIFY_VARIANT
    row["fixed_plan"] = fixed_plan
    row["v6_solve"] = kgdn.grouped_solve(plan, KD, HV // H, loader.device_smem_optin(0))  # 1 paths, 0 levels
    v6_threads = kgdn.grouped_threads(plan, H, VD, kgdn.grouped_smem_bytes(KD, HV // H, plan.max_nodes,
                                      plan.max_pairs_per_request, solve_levels=row["v6_solve"] == 0),
                                      kgdn.SM_SMEM_BYTES, props.multi_processor_count)
    row["v6_cluster"] = kgdn.grouped_cluster(plan, VD, v6_threads, props.major)  # CTAs per cluster (G6_CLUSTER)
    # the version the vLLM runtime runs for this plan (VLLM_TFM_GDN_VERIFY=auto)
    row["runtime_variant"] = kgdn.runtime_verify_variant(plan, torch.bfloat16, H, HV, KD, VD, loader.device_smem_optin(0),
                                                         props.multi_processor_count)
    # each version at its own automatic BV (version 4's shared memory differs for 16-bit q/k)
    auto_bv_of = {variant: kgdn.choose_block_v(plan, HV, KD, VD, loader.device_smem_optin(0), props.multi_processor_count,
                                               variant, torch.bfloat16) for variant in kgdn.VERIFY_VARIANTS}
    row["auto_block_v_by_variant"] = {f"v{v}": bv for v, bv in auto_bv_of.items()}
    for variant in kgdn.VERIFY_VARIANTS:
        try:
            row[f"v{variant}_auto_us"], _ = time_calls([ours(s, auto_bv_of[variant], variant) for s in range(sets)], reps)
        except Exception as exc:  # noqa: BLE001
            row[f"v{variant}_error"] = f"{type(exc).__name__}: {exc}"[:200]
    # version 3's error against version 2 on the same inputs (bf16 in, so both ~1e-3 of o)
    x = inputs[0]
    o2 = kgdn.gdn_tree_verify_planned(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots[0], return_delta=True,
                                      variant=2)
    o3 = kgdn.gdn_tree_verify_planned(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots[0], return_delta=True,
                                      variant=3)
    row["v3_vs_v2_delta_rel"] = rel_err(o3[1], o2[1])
    # versions 4 and 5 compute version 3's products in version 3's order: equal bit for bit at the same BV
    def call(variant: int) -> tuple[torch.Tensor, torch.Tensor]:
        return kgdn.gdn_tree_verify_planned(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots[0],
                                            return_delta=True, block_v=auto_bv_of[4], variant=variant)

    o3b = call(3)
    for variant in (4, 5):
        o_new = call(variant)
        row[f"v{variant}_equals_v3"] = bool(torch.equal(o_new[0], o3b[0]) and torch.equal(o_new[1], o3b[1]))
    # version 6 (other kernels, other summation order): its distance from version 3, and which kernel ran
    launches6, _, _ = kgdn.verify_launches(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots[0], variant=6)
    row["v6_kernels"] = [name for name, _ in launches6]

    def launches_us(variant: int, **kw) -> float:
        """A version's launches alone (one kernel; version 8 its solve kernel and verify kernel), graph-timed over the
        input sets, with verify_launches' keywords."""
        fns = []
        for s in range(sets):
            xs = inputs[s]
            ls, _, _ = kgdn.verify_launches(plan, xs["q"], xs["k"], xs["v"], xs["g"], xs["beta"], pool, slots[s],
                                            variant=variant, **kw)
            fns.append(lambda ls=ls: [fn() for _, fn in ls])
        return time_calls(fns, reps)[0]

    if row["v6_kernels"] == ["gdn_tree_verify_grouped"]:  # both CTA sizes, to check grouped_threads' choice
        row["v6_threads_us"] = {str(threads): launches_us(6, threads6=threads) for threads in (256, 512)}
    o6 = call(6)
    row["v6_vs_v3_o_rel"] = rel_err(o6[0], o3b[0])
    row["v6_vs_v3_delta_rel"] = rel_err(o6[1], o3b[1])
    # version 7 (trees of <= 32 nodes; larger ones run version 6): which kernel ran, both V widths, its
    # distance from version 6
    launches7, _, _ = kgdn.verify_launches(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots[0], variant=7)
    row["v7_kernels"] = [name for name, _ in launches7]
    if row["v7_kernels"] == ["gdn_tree_verify_small"]:
        row["v7_block_v_us"] = {str(bv7): launches_us(7, extra_options=(f"-DS7_BV={bv7}",))
                                for bv7 in kgdn.SMALL_BLOCK_VS}
        o7 = call(7)
        row["v7_vs_v6_o_rel"] = rel_err(o7[0], o6[0])
        row["v7_vs_v6_delta_rel"] = rel_err(o7[1], o6[1])
    # version 8 (trees of <= 128 nodes with paths of <= 17; others run version 6): which kernels ran, both V
    # widths, S0 in two bf16 parts instead of three for K (P8_SPLIT=2) and in three instead of two for Q (P8_QSPLIT=3),
    # the solve in the verify kernel (P8_PREGRAM=0) without and with a cluster of 6 CTAs sharing a q/k head's grams
    # (P8_CLUSTER), its distance from version 6
    launches8, _, _ = kgdn.verify_launches(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots[0], variant=8)
    row["v8_kernels"] = [name for name, _ in launches8]
    if row["v8_kernels"] == V8_KERNELS:
        row["v8_block_v_us"] = {str(bv8): launches_us(8, extra_options=(f"-DP8_BV={bv8}",))
                                for bv8 in kgdn.PATHS_BLOCK_VS}
        row["v8_warps8_us"] = {str(bv8): launches_us(8, extra_options=(f"-DP8_BV={bv8}", "-DP8_WARPS=8"))
                               for bv8 in kgdn.PATHS_BLOCK_VS}  # CTAs of 8 warps
        row["v8_warps16_us"] = launches_us(8, extra_options=("-DP8_BV=64", "-DP8_WARPS=16"))  # and of 16 (paths_warps)
        row["v8_split2_us"] = launches_us(8, extra_options=("-DP8_SPLIT=2",))
        row["v8_qsplit3_us"] = launches_us(8, extra_options=("-DP8_QSPLIT=3",))
        row["v8_ingram_us"] = {str(cl): launches_us(8, extra_options=("-DP8_PREGRAM=0", f"-DP8_CLUSTER={cl}"))
                               for cl in PATHS_CLUSTERS}
        o8 = call(8)
        row["v8_vs_v6_o_rel"] = rel_err(o8[0], o6[0])
        row["v8_vs_v6_delta_rel"] = rel_err(o8[1], o6[1])
    timed = {f"v{v}": row[f"v{v}_auto_us"] for v in kgdn.VERIFY_VARIANTS if row.get(f"v{v}_auto_us")}
    row["fastest_variant"] = min(timed, key=timed.get) if timed else None
    row["fastest_us"] = min(timed.values()) if timed else None
    if n in BREAKDOWN_N and batch in BREAKDOWN_BATCH:
        row["breakdown"] = {}
        for variant in kgdn.VERIFY_VARIANTS:
            per_set = []
            for s in range(sets):
                x = inputs[s]
                launches, _, _ = kgdn.verify_launches(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots[s],
                                                      block_v=auto_bv_of[variant], variant=variant)
                for _, fn in launches:  # the main kernel alone reads what the pairs kernel wrote
                    fn()
                per_set.append(launches)
            parts = {}
            for idx, (kname, _) in enumerate(per_set[0]):  # version 6 is one kernel ("main" here)
                name = "pairs" if kname in ("gdn_tree_pairs", "gdn_tree_paths_solve") else "main"
                parts[f"{name}_us"], _ = time_calls([ls[idx][1] for ls in per_set], reps)
            parts["call_us"], _ = time_calls([ours(s, auto_bv_of[variant], variant) for s in range(sets)], reps)
            row["breakdown"][f"v{variant}"] = parts
    row["ours_eager_us"], _ = time_calls([ours(s, None) for s in range(min(sets, 8))], max(3, reps // 4), graph=False)

    # correctness of this configuration against the torch reference (same bf16 inputs, fp32 math)
    x = inputs[0]
    o = kgdn.gdn_tree_verify_planned(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots[0])
    if allow_slow and batch == 1:
        t1 = time.perf_counter()
        o_ref = ref_gdn.gdn_tree_verify(x["q"], x["k"], x["v"], x["g"], x["beta"], parents.to(DEV), cu.to(DEV), pool, slots[0])
        torch.cuda.synchronize()
        first = time.perf_counter() - t1
        row["err_vs_reference"] = rel_err(o, o_ref)
        row["reference_us"] = first * 1e6 if first > 0.5 else time_calls(
            [lambda: ref_gdn.gdn_tree_verify(x["q"], x["k"], x["v"], x["g"], x["beta"], parents.to(DEV), cu.to(DEV), pool, slots[0])],
            3, graph=False)[0]

    # per-branch recurrence through vLLM's fused recurrent kernel
    paths = root_to_leaf_paths(trees, cu.tolist())
    row["paths"] = len(paths)
    row["path_tokens"] = sum(len(p) for p in paths)
    pool_bytes = (len(paths) + 1) * STATE_BYTES
    if vllm_fn is None:
        row["per_branch_skipped"] = "vLLM not importable"
    elif pool_bytes > 24e9 or not allow_slow:
        row["per_branch_skipped"] = f"state pool {pool_bytes / 1e9:.1f} GB" if allow_slow else "time budget"
    else:
        pb_sets = min(8, max(1, math.ceil(L2_DEFEAT_BYTES / pool_bytes)))
        idx = torch.tensor([i for p in paths for i in p], device=DEV)
        cus = torch.tensor([0] + [len(p) for p in paths], device=DEV).cumsum(0).to(torch.int32)
        lmax = max(len(p) for p in paths)
        ssm_idx = (torch.arange(1, len(paths) + 1, dtype=torch.int32, device=DEV)[:, None]).expand(len(paths), lmax).contiguous()
        fns = []
        for s in range(pb_sets):
            x = inputs[s % sets]
            pp = dict(q=x["q"][idx][None], k=x["k"][idx][None], v=x["v"][idx][None], a=x["a"][idx].contiguous(), b=x["b"][idx].contiguous())
            st = torch.empty(len(paths) + 1, HV, VD, KD, device=DEV).normal_(0, 0.1)
            fns.append(lambda x=x, pp=pp, st=st: vllm_fn(
                x["A_log"], pp["a"], pp["b"], x["dt_bias"], pp["q"], pp["k"], pp["v"], beta=1.0, threshold=20.0,
                scale=KD**-0.5, initial_state=st, inplace_final_state=True, cu_seqlens=cus, ssm_state_indices=ssm_idx,
                use_qk_l2norm_in_kernel=True))
        try:
            row["per_branch_us"], row["per_branch_mode"] = time_calls(fns, max(3, reps // 2))
        except Exception as exc:  # noqa: BLE001
            row["per_branch_error"] = f"{type(exc).__name__}: {exc}"[:300]
    if row.get("per_branch_us") and row["ours_best_us"]:
        row["speedup_vs_per_branch"] = row["per_branch_us"] / row["ours_best_us"]
    if row.get("per_branch_us") and row["fastest_us"]:  # the fastest kernel version in this run (issue 5's 20x)
        row["fastest_speedup_vs_per_branch"] = row["per_branch_us"] / row["fastest_us"]
    return row


# ---------------------------------------------------------------------------------------------
# commit and conv


def bench_commit(n: int, batch: int, bw: float, reps: int, allow_slow: bool) -> dict:
    parents, cu, trees = tree_batch(n, batch, seed=7)
    plan = TreePlan.build(parents, cu, device=DEV)
    sets = n_sets_for(batch)
    gen = device_gen(batch)
    x = gdn_inputs(plan.num_nodes, gen)
    pool = torch.randn(sets * batch, HV, VD, KD, generator=gen, device=DEV) * 0.1
    _, delta = kgdn.gdn_tree_verify_planned(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool,
                                            torch.arange(batch, device=DEV), return_delta=True)
    depth = plan.depth.tolist()
    accepted = []
    for r in range(batch):
        s, e = int(cu[r]), int(cu[r + 1])
        accepted.append(max(range(e - s), key=lambda i: depth[s + i]))  # the deepest node
    idx = [CommitIndices.build(accepted, list(range(s * batch, (s + 1) * batch)), list(range(s * batch, (s + 1) * batch)), DEV)
           for s in range(sets)]
    nbytes = 2 * batch * STATE_BYTES
    row = dict(n=n, batch=batch, accepted_depth=[depth[int(cu[r]) + a] for r, a in enumerate(accepted)][:4],
               bytes=nbytes, floor_us=nbytes / bw * 1e6)
    row["ours_us"], row["ours_mode"] = time_calls(
        [lambda i=i: kgdn.gdn_tree_commit_planned(plan, x["k"], x["g"], delta, i, pool) for i in idx], reps)
    if allow_slow and batch == 1:
        acc_t = torch.tensor(accepted, device=DEV)
        sl = torch.arange(batch, device=DEV)
        row["reference_us"], _ = time_calls(
            [lambda: ref_gdn.gdn_tree_commit(x["k"], x["g"], delta, parents.to(DEV), cu.to(DEV), acc_t, pool, sl, sl)], 3, graph=False)
    # correctness on fresh slots: ours vs the reference
    a_state = pool[:batch].clone()
    b_state = pool[:batch].clone()
    sl = torch.arange(batch, device=DEV)
    kgdn.gdn_tree_commit_planned(plan, x["k"], x["g"], delta, CommitIndices.build(accepted, list(range(batch)), list(range(batch)), DEV), a_state)
    ref_gdn.gdn_tree_commit(x["k"], x["g"], delta, parents.to(DEV), cu.to(DEV), torch.tensor(accepted, device=DEV), b_state, sl, sl)
    row["err_vs_reference"] = rel_err(a_state, b_state)
    return row


def bench_conv(n: int, batch: int, bw: float, reps: int, allow_slow: bool) -> dict:
    parents, cu, _ = tree_batch(n, batch, seed=11)
    plan = TreePlan.build(parents, cu, device=DEV)
    t_nodes = plan.num_nodes
    gen = device_gen(n + batch)
    sets = max(2, math.ceil(L2_DEFEAT_BYTES / (t_nodes * CONV_DIM * 4 + 1)))
    sets = min(sets, 16)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=DEV).to(torch.bfloat16)

    xs = [rnd(t_nodes, CONV_DIM) for _ in range(sets)]
    state, weight, bias = rnd(sets * batch, CONV_DIM, CONV_W - 1), rnd(CONV_DIM, CONV_W), rnd(CONV_DIM)
    slots = [torch.arange(s * batch, (s + 1) * batch, device=DEV) for s in range(sets)]
    nbytes = 2 * t_nodes * CONV_DIM * 2 + batch * CONV_DIM * (CONV_W - 1) * 2 + CONV_DIM * (CONV_W + 1) * 2
    row = dict(n=n, batch=batch, nodes=t_nodes, bytes=nbytes, floor_us=nbytes / bw * 1e6, input_sets=sets)
    row["ours_us"], row["ours_mode"] = time_calls(
        [lambda s=s: kconv.tree_causal_conv1d_planned(plan, xs[s], state, slots[s], weight, bias, "silu") for s in range(sets)], reps)
    y = kconv.tree_causal_conv1d_planned(plan, xs[0], state, slots[0], weight, bias, "silu")
    if allow_slow and batch == 1:
        args = (xs[0], parents.to(DEV), cu.to(DEV), state, slots[0], weight, bias, "silu")
        row["reference_us"], _ = time_calls([lambda: ref_conv.tree_causal_conv1d(*args)], 3, graph=False)
        row["err_vs_reference"] = rel_err(y, ref_conv.tree_causal_conv1d(*args))
    depth = plan.depth.tolist()
    accepted = [max(range(int(cu[r + 1] - cu[r])), key=lambda i: depth[int(cu[r]) + i]) for r in range(batch)]
    cidx = [CommitIndices.build(accepted, list(range(s * batch, (s + 1) * batch)), list(range(s * batch, (s + 1) * batch)), DEV)
            for s in range(sets)]
    row["commit_us"], _ = time_calls(
        [lambda s=s: kconv.tree_conv_commit_planned(plan, xs[s], cidx[s], state, CONV_W) for s in range(sets)], reps)
    return row


# ---------------------------------------------------------------------------------------------
# machine, sanitizer case, main


def machine_info() -> dict:
    props = torch.cuda.get_device_properties(0)
    info = dict(
        gpu=torch.cuda.get_device_name(0), sms=props.multi_processor_count,
        l2_bytes=getattr(props, "L2_cache_size", None), memory_bytes=props.total_memory,
        torch=torch.__version__, torch_cuda=torch.version.cuda, python=platform.python_version(),
        host=socket.gethostname(), date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    )
    try:
        info["nvrtc"] = "%d.%d" % loader.nvrtc_version()
        from cuda.bindings import driver

        info["driver"] = loader._check_cu(driver.cuDriverGetVersion(), "cuDriverGetVersion")
        import cuda.bindings

        info["cuda_bindings"] = cuda.bindings.__version__
    except Exception as exc:  # noqa: BLE001
        info["cuda_python_error"] = str(exc)
    for mod in ("triton", "vllm"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            info[mod] = None
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                            check=True).stdout.strip()
    except Exception:  # noqa: BLE001
        info["git_commit"] = None
    return info


def sanitize_case() -> None:
    """One small call of every kernel, checked against the float64 reference on the CPU."""
    gen = torch.Generator().manual_seed(0)
    trees = [ddtree_parents(40, 1), list(range(-1, 4)), [-1]]
    parents = torch.tensor([p for t in trees for p in t])
    cu = torch.tensor([0, 40, 45, 46])
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-3)):
        t_nodes, h, hv, kd, vd = parents.numel(), 2, 4, 128, 128
        g, beta = ref_gdn.gdn_gates(torch.randn(t_nodes, hv, generator=gen), torch.randn(t_nodes, hv, generator=gen),
                                    torch.rand(hv, generator=gen), torch.randn(hv, generator=gen))
        c = dict(q=torch.randn(t_nodes, h, kd, generator=gen).to(dtype), k=torch.randn(t_nodes, h, kd, generator=gen).to(dtype),
                 v=torch.randn(t_nodes, hv, vd, generator=gen).to(dtype), g=g, beta=beta, parents=parents, cu_nodes=cu,
                 ssm_state=torch.randn(5, hv, vd, kd, generator=gen) * 0.3, state_indices=torch.tensor([4, 0, 2]))
        c64 = {k: v.double() if v.is_floating_point() else v for k, v in c.items()}
        o_ref, d_ref = ref_gdn.gdn_tree_verify(**c64, return_delta=True)
        cg = {k: v.to(DEV) for k, v in c.items()}
        plan = TreePlan.build(cg["parents"], cg["cu_nodes"])
        for variant, bv in ((2, 16), (2, 32), (2, 64), (1, 32), (3, 16), (3, 32), (3, 64), (4, 16), (4, 32), (4, 64),
                            (5, 16), (5, 32), (5, 64), (6, None)):
            o, d = kgdn.gdn_tree_verify_planned(plan, cg["q"], cg["k"], cg["v"], cg["g"], cg["beta"], cg["ssm_state"],
                                                cg["state_indices"], return_delta=True, block_v=bv, variant=variant)
            assert rel_err(o.cpu(), o_ref) <= tol and rel_err(d.cpu(), d_ref) <= 1e-5, (dtype, bv, variant)
        acc, src, dst = [37, 4, 0], [2, 2, 0], [0, 1, 3]
        st = cg["ssm_state"].clone()
        kgdn.gdn_tree_commit(cg["k"], cg["g"], d, cg["parents"], cg["cu_nodes"], torch.tensor(acc).to(DEV), st,
                             torch.tensor(src).to(DEV), torch.tensor(dst).to(DEV))
        st_ref = c64["ssm_state"].clone()
        ref_gdn.gdn_tree_commit(c64["k"], c64["g"], d.cpu().double(), parents, cu, torch.tensor(acc), st_ref,
                                torch.tensor(src), torch.tensor(dst))
        assert rel_err(st.cpu()[dst], st_ref[dst]) <= 1e-5, dtype
        x = torch.randn(t_nodes, 96, generator=gen).to(dtype)
        cs = torch.randn(5, 96, 5, generator=gen).to(dtype)
        w, b = torch.randn(96, 4, generator=gen).to(dtype), torch.randn(96, generator=gen).to(dtype)
        sidx, ws = torch.tensor([4, 0, 2]), torch.tensor([0, 2, 1])
        y = kconv.tree_causal_conv1d(x.to(DEV), cg["parents"], cg["cu_nodes"], cs.to(DEV), sidx.to(DEV), w.to(DEV), b.to(DEV),
                                     "silu", ws.to(DEV))
        y_ref = ref_conv.tree_causal_conv1d(x.double(), parents, cu, cs.double(), sidx, w.double(), b.double(), "silu", ws)
        assert rel_err(y.cpu(), y_ref) <= tol, dtype
        # the same launch with the GDN prologue's extras (q | k blocks, a copy of x, the gates), exact sizes
        ga, gb = (torch.randn(t_nodes, 4, generator=gen).to(dtype).to(DEV) for _ in range(2))
        a_log, dtb = torch.rand(4, generator=gen).log().to(DEV), torch.randn(4, generator=gen).to(DEV)
        consts = ref_gdn.gate_constants(a_log, dtb)
        qk = torch.empty(2, t_nodes, 32, dtype=dtype, device=DEV)
        xc = torch.empty(t_nodes, 96, dtype=dtype, device=DEV)
        gg, bb = torch.empty(t_nodes, 4, device=DEV), torch.empty(t_nodes, 4, device=DEV)
        y2 = kconv.tree_causal_conv1d_planned(
            TreePlan.build(cg["parents"], cg["cu_nodes"]), x.to(DEV), cs.to(DEV), sidx.to(DEV), w.to(DEV), b.to(DEV),
            "silu", ws.to(DEV), extras=kconv.ConvExtras(qk_out=qk, qk_cols=32, x_copy=xc, gates=(ga, gb, *consts, gg, bb)))
        assert torch.equal(y2[:, 64:], y[:, 64:]) and torch.equal(qk[0], y[:, :32]) and torch.equal(qk[1], y[:, 32:64])
        assert torch.equal(xc.cpu(), x), dtype
        g_ref, b_ref = ref_gdn.gdn_gates(ga, gb, a_log, dtb, consts)
        assert torch.allclose(gg, g_ref, rtol=1e-6, atol=0) and torch.allclose(bb, b_ref, rtol=1e-6, atol=0), dtype
        csg, cs_ref = cs.to(DEV), cs.clone()
        kconv.tree_conv_commit(x.to(DEV), cg["parents"], cg["cu_nodes"], torch.tensor(acc).to(DEV), csg, torch.tensor(src).to(DEV),
                               torch.tensor(dst).to(DEV), 4, ws.to(DEV), torch.tensor([1, 0, 2]).to(DEV))
        ref_conv.tree_conv_commit(x, parents, cu, torch.tensor(acc), cs_ref, torch.tensor(src), torch.tensor(dst), 4, ws,
                                  torch.tensor([1, 0, 2]))
        assert torch.equal(csg.cpu(), cs_ref), dtype
        # the batched commit (one launch per kernel kind for all layers): two layers, the second with
        # its own state tensors, each bit for bit the per-layer commit above
        acc_d, src_d, dst_d = (torch.tensor(v).to(DEV) for v in (acc, src, dst))
        states = [cg["ssm_state"].clone(), cg["ssm_state"].clone()]
        kbatch.gdn_tree_commit_layers([cg["k"]] * 2, [cg["g"]] * 2, [d, d], cg["parents"], cg["cu_nodes"], acc_d, states,
                                      [src_d] * 2, [dst_d] * 2)
        assert all(torch.equal(s_b, st) for s_b in states), dtype
        convs = [cs.to(DEV), cs.to(DEV)]
        kbatch.tree_conv_commit_layers([x.to(DEV)] * 2, cg["parents"], cg["cu_nodes"], acc_d, convs, [src_d] * 2, [dst_d] * 2,
                                       4, [ws.to(DEV)] * 2, [torch.tensor([1, 0, 2]).to(DEV)] * 2)
        assert all(torch.equal(c_b, csg) for c_b in convs), dtype
    # versions 4 (whole-tile staging) and 5 (dependent launch) over several tiles (130 + 70 nodes: tiles of 64,
    # the last ragged), bf16
    trees = [ddtree_parents(130, 2), ddtree_parents(70, 3)]
    parents = torch.tensor([p for t in trees for p in t])
    cu = torch.tensor([0, 130, 200])
    t_nodes, h, hv, kd, vd = parents.numel(), 2, 4, 128, 128
    g, beta = ref_gdn.gdn_gates(torch.randn(t_nodes, hv, generator=gen), torch.randn(t_nodes, hv, generator=gen),
                                torch.rand(hv, generator=gen), torch.randn(hv, generator=gen))
    c = dict(q=torch.randn(t_nodes, h, kd, generator=gen).bfloat16(), k=torch.randn(t_nodes, h, kd, generator=gen).bfloat16(),
             v=torch.randn(t_nodes, hv, vd, generator=gen).bfloat16(), g=g, beta=beta, parents=parents, cu_nodes=cu,
             ssm_state=torch.randn(3, hv, vd, kd, generator=gen) * 0.3, state_indices=torch.tensor([2, 0]))
    c64 = {k: v.double() if v.is_floating_point() else v for k, v in c.items()}
    o_ref, d_ref = ref_gdn.gdn_tree_verify(**c64, return_delta=True)
    cg = {k: v.to(DEV) for k, v in c.items()}
    plan = TreePlan.build(cg["parents"], cg["cu_nodes"])
    for bv in (16, 32):
        o3, d3 = kgdn.gdn_tree_verify_planned(plan, cg["q"], cg["k"], cg["v"], cg["g"], cg["beta"], cg["ssm_state"],
                                              cg["state_indices"], return_delta=True, block_v=bv, variant=3)
        for variant in (4, 5):
            o_new, d_new = kgdn.gdn_tree_verify_planned(plan, cg["q"], cg["k"], cg["v"], cg["g"], cg["beta"],
                                                        cg["ssm_state"], cg["state_indices"], return_delta=True,
                                                        block_v=bv, variant=variant)
            assert rel_err(o_new.cpu(), o_ref) <= 3e-3 and rel_err(d_new.cpu(), d_ref) <= 1e-5, (variant, "tiles", bv)
            assert torch.equal(o_new, o3) and torch.equal(d_new, d3), (variant, "== v3", bv)
    o6, d6 = kgdn.gdn_tree_verify_planned(plan, cg["q"], cg["k"], cg["v"], cg["g"], cg["beta"], cg["ssm_state"],
                                          cg["state_indices"], return_delta=True, variant=6)  # 130 nodes: version 3
    assert rel_err(o6.cpu(), o_ref) <= 3e-3 and rel_err(d6.cpu(), d_ref) <= 1e-5, (6, "tiles")
    # version 7 on trees of 17 and 32 nodes and a single node at the 27B shape, both V widths
    trees = [ddtree_parents(17, 6), ddtree_parents(32, 7), [-1]]
    parents = torch.tensor([p for t in trees for p in t])
    cu = torch.tensor([0, 17, 49, 50])
    t_nodes, h, hv, kd, vd = parents.numel(), 16, 48, 128, 128
    g, beta = ref_gdn.gdn_gates(torch.randn(t_nodes, hv, generator=gen), torch.randn(t_nodes, hv, generator=gen),
                                torch.rand(hv, generator=gen), torch.randn(hv, generator=gen))
    c = dict(q=torch.randn(t_nodes, h, kd, generator=gen).bfloat16(), k=torch.randn(t_nodes, h, kd, generator=gen).bfloat16(),
             v=torch.randn(t_nodes, hv, vd, generator=gen).bfloat16(), g=g, beta=beta, parents=parents, cu_nodes=cu,
             ssm_state=torch.randn(4, hv, vd, kd, generator=gen) * 0.3, state_indices=torch.tensor([3, 0, 2]))
    c64 = {k: v.double() if v.is_floating_point() else v for k, v in c.items()}
    o_ref, d_ref = ref_gdn.gdn_tree_verify(**c64, return_delta=True)
    cg = {k: v.to(DEV) for k, v in c.items()}
    plan = TreePlan.build(cg["parents"], cg["cu_nodes"])
    for bv7 in kgdn.SMALL_BLOCK_VS:
        launches7, o7, d7 = kgdn.verify_launches(plan, cg["q"], cg["k"], cg["v"], cg["g"], cg["beta"], cg["ssm_state"],
                                                 cg["state_indices"], return_delta=True, variant=7,
                                                 extra_options=(f"-DS7_BV={bv7}",))
        assert [name for name, _ in launches7] == ["gdn_tree_verify_small"], launches7
        launches7[0][1]()
        assert rel_err(o7.cpu(), o_ref) <= 3e-3 and rel_err(d7.cpu(), d_ref) <= 1e-5, (7, bv7)
    # version 6 on the largest tree it takes (128 nodes, several 16-row tiles, the last of a request ragged)
    trees = [ddtree_parents(128, 4), ddtree_parents(77, 5)]
    parents = torch.tensor([p for t in trees for p in t])
    cu = torch.tensor([0, 128, 205])
    t_nodes = parents.numel()
    g, beta = ref_gdn.gdn_gates(torch.randn(t_nodes, hv, generator=gen), torch.randn(t_nodes, hv, generator=gen),
                                torch.rand(hv, generator=gen), torch.randn(hv, generator=gen))
    c = dict(q=torch.randn(t_nodes, h, kd, generator=gen).bfloat16(), k=torch.randn(t_nodes, h, kd, generator=gen).bfloat16(),
             v=torch.randn(t_nodes, hv, vd, generator=gen).bfloat16(), g=g, beta=beta, parents=parents, cu_nodes=cu,
             ssm_state=torch.randn(3, hv, vd, kd, generator=gen) * 0.3, state_indices=torch.tensor([1, 2]))
    c64 = {k: v.double() if v.is_floating_point() else v for k, v in c.items()}
    o_ref, d_ref = ref_gdn.gdn_tree_verify(**c64, return_delta=True)
    cg = {k: v.to(DEV) for k, v in c.items()}
    plan = TreePlan.build(cg["parents"], cg["cu_nodes"])
    launches6, _, _ = kgdn.verify_launches(plan, cg["q"], cg["k"], cg["v"], cg["g"], cg["beta"], cg["ssm_state"],
                                           cg["state_indices"], variant=6)
    assert [name for name, _ in launches6] == ["gdn_tree_verify_grouped"], launches6
    o6, d6 = kgdn.gdn_tree_verify_planned(plan, cg["q"], cg["k"], cg["v"], cg["g"], cg["beta"], cg["ssm_state"],
                                          cg["state_indices"], return_delta=True, variant=6)
    assert rel_err(o6.cpu(), o_ref) <= 3e-3 and rel_err(d6.cpu(), d_ref) <= 1e-5, (6, "128 nodes")
    launches6, o256, d256 = kgdn.verify_launches(plan, cg["q"], cg["k"], cg["v"], cg["g"], cg["beta"], cg["ssm_state"],
                                                 cg["state_indices"], return_delta=True, variant=6, threads6=256)
    launches6[0][1]()  # 256-thread CTAs: the same tiles on fewer warps, the same outputs
    assert torch.equal(o256, o6) and torch.equal(d256, d6), (6, "256 threads")
    # thread block clusters (G6_CLUSTER; the wrapper's choice at 128 nodes is kgdn.GROUPED_CLUSTER): every size,
    # at 512 and 256 threads, gives the same bits (the gram tiles split over the cluster, stored into each CTA)
    for cl, threads in ((1, 0), (4, 0), (8, 0), (4, 256), (8, 256)):
        launches6, o_c, d_c = kgdn.verify_launches(plan, cg["q"], cg["k"], cg["v"], cg["g"], cg["beta"], cg["ssm_state"],
                                                   cg["state_indices"], return_delta=True, variant=6,
                                                   threads6=threads or None, extra_options=(f"-DG6_CLUSTER={cl}",))
        launches6[0][1]()
        assert torch.equal(o_c, o6) and torch.equal(d_c, d6), (6, "cluster", cl, threads)
    # both solves forced on the same trees (the wrapper picks the level solve at 128 nodes): the path
    # solve's register rows (depth < G6_PATH_REG), its free-warp phase 2b at 128 nodes, at 512 and 256 threads
    for opts, threads in ((("-DG6_SOLVE=1",), 0), (("-DG6_SOLVE=1",), 256), (("-DG6_SOLVE=0",), 0)):
        launches6, o_s, d_s = kgdn.verify_launches(plan, cg["q"], cg["k"], cg["v"], cg["g"], cg["beta"], cg["ssm_state"],
                                                   cg["state_indices"], return_delta=True, variant=6,
                                                   threads6=threads or None, extra_options=opts)
        launches6[0][1]()
        assert rel_err(o_s.cpu(), o_ref) <= 3e-3 and rel_err(d_s.cpu(), d_ref) <= 1e-5, (6, opts, threads)
    torch.cuda.synchronize()
    print("sanitize case: all kernels match the reference")


def ratio(a, b):
    return a / b if a is not None and b else None


def fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def table(results: dict) -> str:
    bw = results["copy_bandwidth_Bps"]
    modes = sorted({r.get("ours_mode", "?").split(" ")[0] for r in results["verify"]})
    lines = [f"GDN tree verify, H={H} HV={HV} K=V={KD}, bf16 q/k/v, fp32 state; copy bandwidth {bw / 1e12:.2f} TB/s; "
             f"times in us (median; ours timed as {'/'.join(modes)}; eager = with Python launch overhead)",
             f"{'n':>4} {'batch':>5} {'floor':>8} {'ours':>8} {'BV':>5} {'x floor':>8} {'auto':>8} {'v1 auto':>8} "
             f"{'v1/v2':>6} {'v3 auto':>8} {'v2/v3':>6} {'v4 auto':>8} {'v3/v4':>6} {'v4==v3':>6} {'v5 auto':>8} "
             f"{'v3/v5':>6} {'v5==v3':>6} {'v6 auto':>8} {'v3/v6':>6} {'v6-v3 d':>8} {'v7 auto':>8} {'v6/v7':>6} "
             f"{'v7-v6 d':>8} {'eager':>8} "
             f"{'per-branch':>11} {'speedup':>8} {'reference':>10} {'err':>8} {'rt':>3}"]
    for r in results["verify"]:
        xf = r["ours_best_us"] / r["floor_us"] if r.get("ours_best_us") else None
        lines.append(f"{r['n']:>4} {r['batch']:>5} {fmt(r['floor_us']):>8} {fmt(r.get('ours_best_us')):>8} "
                     f"{str(r.get('ours_best_bv', '-')):>5} {fmt(xf):>8} {fmt(r.get('ours_auto_us')):>8} "
                     f"{fmt(r.get('v1_auto_us')):>8} {fmt(ratio(r.get('v1_auto_us'), r.get('v2_auto_us')), '.2f'):>6} "
                     f"{fmt(r.get('v3_auto_us')):>8} {fmt(ratio(r.get('v2_auto_us'), r.get('v3_auto_us')), '.2f'):>6} "
                     f"{fmt(r.get('v4_auto_us')):>8} {fmt(ratio(r.get('v3_auto_us'), r.get('v4_auto_us')), '.2f'):>6} "
                     f"{str(r.get('v4_equals_v3', '-')):>6} {fmt(r.get('v5_auto_us')):>8} "
                     f"{fmt(ratio(r.get('v3_auto_us'), r.get('v5_auto_us')), '.2f'):>6} {str(r.get('v5_equals_v3', '-')):>6} "
                     f"{fmt(r.get('v6_auto_us')):>8} {fmt(ratio(r.get('v3_auto_us'), r.get('v6_auto_us')), '.2f'):>6} "
                     f"{fmt(r.get('v6_vs_v3_delta_rel'), '.1e'):>8} "
                     f"{fmt(r.get('v7_auto_us') if r.get('v7_kernels') == ['gdn_tree_verify_small'] else None):>8} "
                     f"{fmt(ratio(r.get('v6_auto_us'), r.get('v7_auto_us')) if r.get('v7_kernels') == ['gdn_tree_verify_small'] else None, '.2f'):>6} "
                     f"{fmt(r.get('v7_vs_v6_delta_rel'), '.1e'):>8} "
                     f"{fmt(r.get('ours_eager_us')):>8} {fmt(r.get('per_branch_us')):>11} "
                     f"{fmt(r.get('speedup_vs_per_branch')):>8} {fmt(r.get('reference_us'), '.0f'):>10} "
                     f"{fmt(r.get('err_vs_reference'), '.1e'):>8} {'v' + str(r.get('runtime_variant', '-')):>3}")
    lines.append("versions 6 to 8 (v8 BV32 / BV64 / w8 BV32 / w8 BV64 / w16 BV64 / split2 / qsplit3 / in cl1 / cl6: version "
                 "8's launches alone at 32 and 64 V columns, with CTAs of 8 and of 16 warps, with S0 in two bf16 parts for K, in three "
                 "for Q, and with the solve in the verify kernel, its grams shared by clusters of 1 and 6 "
                 "CTAs), the fastest version and its speedup over per-branch recurrence, us")
    lines.append(f"{'n':>4} {'batch':>5} {'floor':>8} {'v6 auto':>8} {'v7 auto':>8} {'v8 auto':>8} {'v8 BV32':>8} "
                 f"{'v8 BV64':>8} {'w8 BV32':>8} {'w8 BV64':>8} {'w16 BV64':>8} {'split2':>8} {'qsplit3':>8} {'in cl1':>7} {'cl6':>7} "
                 f"{'v6/v8':>6} {'v8-v6 d':>8} {'fastest':>8} "
                 f"{'per-branch':>11} {'speedup':>8}")
    for r in results["verify"]:
        v7 = r.get("v7_auto_us") if r.get("v7_kernels") == ["gdn_tree_verify_small"] else None
        v8 = r.get("v8_auto_us") if r.get("v8_kernels") == V8_KERNELS else None
        bvs, w8 = r.get("v8_block_v_us", {}), r.get("v8_warps8_us", {})
        lines.append(f"{r['n']:>4} {r['batch']:>5} {fmt(r['floor_us']):>8} {fmt(r.get('v6_auto_us')):>8} {fmt(v7):>8} "
                     f"{fmt(v8):>8} {fmt(bvs.get('32')):>8} {fmt(bvs.get('64')):>8} {fmt(w8.get('32')):>8} "
                     f"{fmt(w8.get('64')):>8} {fmt(r.get('v8_warps16_us')):>8} {fmt(r.get('v8_split2_us')):>8} {fmt(r.get('v8_qsplit3_us')):>8} "
                     + " ".join(f"{fmt(r.get('v8_ingram_us', {}).get(str(cl))):>7}" for cl in PATHS_CLUSTERS) + " "
                     f"{fmt(ratio(r.get('v6_auto_us'), v8), '.2f'):>6} {fmt(r.get('v8_vs_v6_delta_rel'), '.1e'):>8} "
                     f"{str(r.get('fastest_variant')):>8} {fmt(r.get('per_branch_us')):>11} "
                     f"{fmt(r.get('fastest_speedup_vs_per_branch')):>8}")
    if any(r.get("fixed_plan") for r in results["verify"]):
        bounds = sorted({str(r.get("depth_bound")) for r in results["verify"] if r.get("fixed_plan")})
        lines.append(f"plans: the full CUDA graphs' fixed layout (--fixed-plan), depth_bound {', '.join(bounds)}; "
                     f"version 6's solve per row (v6_solve in the JSON): "
                     + " ".join(f"n{r['n']}b{r['batch']}={'paths' if r.get('v6_solve') else 'levels'}"
                                for r in results["verify"] if "v6_solve" in r))
    lines.append("rt: the version the vLLM runtime runs for this plan (VLLM_TFM_GDN_VERIFY=auto)")
    lines.append("version 6's thread block cluster per row (v6_cluster in the JSON): "
                 + " ".join(f"n{r['n']}b{r['batch']}={r['v6_cluster']}" for r in results["verify"] if "v6_cluster" in r))
    lines.append("verify per-kernel breakdown at the automatic BV, us (each kernel timed alone; call = whole call)")
    versions = [f"v{v}" for v in kgdn.VERIFY_VARIANTS]
    lines.append(f"{'n':>4} {'batch':>5} {'BV':>4} "
                 + " ".join(f"{v + ' pairs':>9} {v + ' main':>8} {v + ' call':>8}" for v in versions))
    for r in results["verify"]:
        b = r.get("breakdown")
        if not b:
            continue
        parts = [b.get(v, {}) for v in versions]
        lines.append(f"{r['n']:>4} {r['batch']:>5} {str(r.get('auto_block_v')):>4} "
                     + " ".join(f"{fmt(p.get('pairs_us')):>9} {fmt(p.get('main_us')):>8} {fmt(p.get('call_us')):>8}"
                                for p in parts))
    lines.append("GDN tree commit (accepted = deepest node), us")
    lines.append(f"{'n':>4} {'batch':>5} {'floor':>8} {'ours':>8} {'x floor':>8} {'reference':>10} {'err':>8}")
    for r in results["commit"]:
        lines.append(f"{r['n']:>4} {r['batch']:>5} {fmt(r['floor_us']):>8} {fmt(r['ours_us']):>8} "
                     f"{fmt(r['ours_us'] / r['floor_us']):>8} {fmt(r.get('reference_us'), '.0f'):>10} "
                     f"{fmt(r.get('err_vs_reference'), '.1e'):>8}")
    lines.append(f"tree conv1d D={CONV_DIM} W={CONV_W} bf16 (+ conv commit), us")
    lines.append(f"{'n':>4} {'batch':>5} {'floor':>8} {'ours':>8} {'x floor':>8} {'reference':>10} {'err':>8} {'commit':>8}")
    for r in results["conv"]:
        lines.append(f"{r['n']:>4} {r['batch']:>5} {fmt(r['floor_us']):>8} {fmt(r['ours_us']):>8} "
                     f"{fmt(r['ours_us'] / r['floor_us']):>8} {fmt(r.get('reference_us'), '.0f'):>10} "
                     f"{fmt(r.get('err_vs_reference'), '.1e'):>8} {fmt(r.get('commit_us')):>8}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "gdn_tree.json"))
    ap.add_argument("--quick", action="store_true", help="n in {16, 64, 256}, batch in {1, 32}, fewer repeats")
    ap.add_argument("--budget-s", type=float, default=200.0, help="stop timing baselines after this many seconds")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--n", type=int, nargs="+", help="tree sizes (default 16 32 64 128 256)")
    ap.add_argument("--batch", type=int, nargs="+", help="batch sizes (default 1 8 32)")
    ap.add_argument("--sanitize-case", action="store_true")
    ap.add_argument("--only", choices=("verify", "commit", "conv"), nargs="+", default=None,
                    help="time only these kernels (default: all three)")
    ap.add_argument("--fixed-plan", action="store_true",
                    help="verify on the full CUDA graphs' fixed-layout plans (TreePlan.build_into) instead of per-step plans")
    ap.add_argument("--depth-bound", type=int, default=None,
                    help="with --fixed-plan: the plans' depth_bound (the runtime's: the drafter's depth, 15 at the 27B "
                         "drafter's block of 16); the bench trees have depth <= 16")
    args = ap.parse_args()
    if args.depth_bound is not None and not args.fixed_plan:
        ap.error("--depth-bound is a property of the fixed-layout plans: add --fixed-plan")
    if not torch.cuda.is_available():
        sys.exit("gdn_tree.py needs a CUDA device")
    if args.sanitize_case:
        sanitize_case()
        return
    if not loader.kernels_available():
        sys.exit(f"CUDA kernels unavailable: {loader.kernels_unavailable_reason()}")
    start = time.perf_counter()
    try:
        from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (
            fused_sigmoid_gating_delta_rule_update as vllm_fn,
        )
    except Exception as exc:  # noqa: BLE001
        print(f"per-branch baseline disabled: {exc}", file=sys.stderr)
        vllm_fn = None
    ns, batches = ((16, 64, 256), (1, 32)) if args.quick else ((16, 32, 64, 128, 256), (1, 8, 32))
    ns, batches = tuple(args.n or ns), tuple(args.batch or batches)
    reps = max(5, args.reps // 2) if args.quick else args.reps
    bw = copy_bandwidth()
    results = dict(command=" ".join([sys.executable, *sys.argv]), machine=machine_info(), copy_bandwidth_Bps=bw,
                   shape=dict(H=H, HV=HV, K=KD, V=VD, conv_dim=CONV_DIM, conv_width=CONV_W),
                   verify=[], commit=[], conv=[])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        results["elapsed_s"] = time.perf_counter() - start
        out.write_text(json.dumps(results, indent=1))

    def within_budget() -> bool:
        return time.perf_counter() - start < args.budget_s

    only = set(args.only or ("verify", "commit", "conv"))
    for batch in batches if "verify" in only else ():
        for n in ns:
            print(f"verify n={n} batch={batch} ...", file=sys.stderr, flush=True)
            try:
                results["verify"].append(bench_verify(n, batch, bw, reps, vllm_fn, within_budget(), args.fixed_plan,
                                                          args.depth_bound))
            except Exception as exc:  # noqa: BLE001 - record and go on
                results["verify"].append(dict(n=n, batch=batch, floor_us=None, error=f"{type(exc).__name__}: {exc}"[:300]))
            torch.cuda.empty_cache()
            save()
    for batch in batches:
        if "commit" in only:
            print(f"commit batch={batch} ...", file=sys.stderr, flush=True)
            results["commit"].append(bench_commit(64 if 64 in ns else max(ns), batch, bw, reps, within_budget()))
            save()
        for n in sorted({min(ns), max(ns)}) if "conv" in only else ():
            print(f"conv n={n} batch={batch} ...", file=sys.stderr, flush=True)
            results["conv"].append(bench_conv(n, batch, bw, reps, within_budget()))
            save()
    results["verify"] = [r for r in results["verify"] if r.get("floor_us") is not None] + \
        [r for r in results["verify"] if r.get("floor_us") is None]
    save()
    errors = [r for r in results["verify"] if "error" in r]
    for r in errors:
        print(f"verify n={r['n']} batch={r['batch']} failed: {r['error']}", file=sys.stderr)
    text = table(dict(results, verify=[r for r in results["verify"] if "error" not in r]))
    Path(str(out).replace(".json", ".txt")).write_text(text + "\n")
    print(f"wrote {out} ({results['elapsed_s']:.0f} s)")
    print(text)


if __name__ == "__main__":
    main()
