#!/usr/bin/env python3
"""Where the GDN tree verify's main kernel spends its time: phases left out, timings subtracted.

bench/NOTES.md section 24: version 4 staged the projections' q/k rows a whole tile at a time (one
wait and one barrier per tile instead of eight barriers and four exposed global latencies) and was
no faster than version 3 anywhere, so the K-chunk loop is not where the main kernel's 25.6 us at
n = 128, batch 1 go. This bench times the main kernel alone (the pairs kernel run once before, as in
a call) compiled with ``-DGDN_PROFILE_SKIP=`` (cuda/gdn_tree_verify.cu):

    0  the kernel                         4  without the forward substitution and output writes
    1  without the projections' mma       6  without the K-chunk loop and the substitution
    2  without version 3's K-chunk loop      (prologue: S0 rows, per-node tables, the epilogue)

and reports, per (n, batch), the differences: mma = t0 - t1, chunk staging = t1 - t2 (loads and
barriers of the chunk loop without the math), substitution = t0 - t4, rest = t6. Same trees,
inputs, automatic BV and CUDA-graph timing as bench/gdn_tree.py. Timing only: the skipped variants
compute wrong outputs; the run checks that skip 0 equals the shipped kernel bit for bit.

usage (GPU host, repository root):  python3 bench/gdn_phases.py [--out FILE] [--n 16 128] [--batch 1 8]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from gdn_tree import (  # noqa: E402
    HV,
    KD,
    VD,
    device_gen,
    gdn_inputs,
    machine_info,
    n_sets_for,
    time_calls,
    tree_batch,
)

from vllm_tfm.kernels import gdn as kgdn  # noqa: E402
from vllm_tfm.kernels import loader  # noqa: E402
from vllm_tfm.kernels.plan import TreePlan  # noqa: E402

SKIPS = (0, 1, 2, 4, 6)
# version 6 (cuda/gdn_tree_verify_grouped.cu, one kernel): 1 = gram tiles, 2 = projections' k-loop,
# 4 = substitution, 8 = pair coefficients, 15 = all four (what is left: loads, tables, norms, the S0
# split, the projections' epilogue, the launch)
SKIPS_V6 = (0, 1, 2, 4, 8, 15)


def phase_case(n: int, batch: int) -> tuple:
    """(plan, input sets, inputs, state pool, slots per set) of bench/gdn_tree.py's trees and inputs."""
    parents, cu, _ = tree_batch(n, batch)
    plan = TreePlan.build(parents, cu, device="cuda")
    sets = n_sets_for(batch)
    gen = device_gen(n * 100 + batch)
    inputs = [gdn_inputs(plan.num_nodes, gen) for _ in range(sets)]
    pool = torch.randn(sets * batch, HV, VD, KD, generator=gen, device="cuda") * 0.1
    slots = [torch.arange(s * batch, (s + 1) * batch, device="cuda") for s in range(sets)]
    return plan, sets, inputs, pool, slots


def phases_v6(n: int, batch: int, reps: int) -> dict:
    plan, sets, inputs, pool, slots = phase_case(n, batch)
    row: dict = dict(n=n, batch=batch, nodes=plan.num_nodes, pairs=plan.num_pairs, max_depth=plan.max_depth,
                     block_v=kgdn.GROUPED_BV, variant=6, main_us={})
    for skip in SKIPS_V6:
        per_set = []
        for s in range(sets):
            x = inputs[s]
            launches, o, d = kgdn.verify_launches(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots[s],
                                                  return_delta=True, variant=6,
                                                  extra_options=[f"-DGDN_PROFILE_SKIP={skip}"])
            if [name for name, _ in launches] != ["gdn_tree_verify_grouped"]:
                row["error"] = f"version 6 does not take n={n}: {[name for name, _ in launches]}"
                return row
            per_set.append(launches[0][1])
            if skip == 0 and s == 0:
                launches[0][1]()
                shipped = kgdn.gdn_tree_verify_planned(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots[0],
                                                       return_delta=True, variant=6)
                row["skip0_equals_kernel"] = bool(torch.equal(o, shipped[0]) and torch.equal(d, shipped[1]))
        row["main_us"][str(skip)], _ = time_calls(per_set, reps)
    t = {int(k): v for k, v in row["main_us"].items()}
    row["phase_us"] = {"gram": t[0] - t[1], "projections": t[0] - t[2], "substitution": t[0] - t[4],
                       "coefficients": t[0] - t[8], "rest": t[15]}
    return row


def phases(n: int, batch: int, reps: int, variant: int) -> dict:
    plan, sets, inputs, pool, slots = phase_case(n, batch)
    props = torch.cuda.get_device_properties(0)
    bv = kgdn.choose_block_v(plan, HV, KD, VD, loader.device_smem_optin(0), props.multi_processor_count, variant,
                             torch.bfloat16)
    row: dict = dict(n=n, batch=batch, nodes=plan.num_nodes, pairs=plan.num_pairs, max_depth=plan.max_depth,
                     block_v=bv, variant=variant, main_us={})
    shipped = None
    for skip in SKIPS:
        per_set = []
        for s in range(sets):
            x = inputs[s]
            launches, o, d = kgdn.verify_launches(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots[s],
                                                  return_delta=True, block_v=bv, variant=variant,
                                                  extra_options=[f"-DGDN_PROFILE_SKIP={skip}"])
            for _, fn in launches:  # the main kernel alone reads what the pairs kernel wrote
                fn()
            per_set.append(launches)
            if skip == 0 and s == 0:
                shipped = kgdn.gdn_tree_verify_planned(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots[0],
                                                       return_delta=True, block_v=bv, variant=variant)
                row["skip0_equals_kernel"] = bool(torch.equal(o, shipped[0]) and torch.equal(d, shipped[1]))
        row["main_us"][str(skip)], _ = time_calls([ls[1][1] for ls in per_set], reps)
        if skip == 0:
            row["pairs_us"], _ = time_calls([ls[0][1] for ls in per_set], reps)
    t = {int(k): v for k, v in row["main_us"].items()}
    row["phase_us"] = {"projection_mma": t[0] - t[1], "chunk_staging": t[1] - t[2], "substitution": t[0] - t[4],
                       "prologue_tables_epilogue": t[6]}
    return row


def table_v6(rows: list[dict]) -> str:
    lines = ["GDN tree verify version 6 by phase (us, graph-timed medians; '-x' = without x; bf16, one kernel)",
             f"{'n':>4} {'batch':>5} {'call':>7} {'-gram':>7} {'-proj':>7} {'-subst':>7} {'-coef':>7} {'-all':>7} | "
             f"{'gram':>6} {'proj':>6} {'subst':>6} {'coef':>6} {'rest':>6}"]
    for r in rows:
        if "error" in r:
            lines.append(f"{r['n']:>4} {r['batch']:>5} {r['error']}")
            continue
        m, ph = r["main_us"], r["phase_us"]
        lines.append(f"{r['n']:>4} {r['batch']:>5} {m['0']:>7.1f} {m['1']:>7.1f} {m['2']:>7.1f} {m['4']:>7.1f} "
                     f"{m['8']:>7.1f} {m['15']:>7.1f} | {ph['gram']:>6.1f} {ph['projections']:>6.1f} "
                     f"{ph['substitution']:>6.1f} {ph['coefficients']:>6.1f} {ph['rest']:>6.1f}")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    if rows and rows[0].get("variant") == 6:
        return table_v6(rows)
    head = (f"{'n':>4} {'batch':>5} {'BV':>3} {'pairs':>7} {'main':>7} {'-mma':>7} {'-chunks':>8} {'-subst':>7} "
            f"{'-both':>7} | {'mma':>6} {'staging':>8} {'subst':>6} {'rest':>6}")
    lines = ["GDN tree verify main kernel by phase (us, graph-timed medians; '-x' = without x; bf16, automatic BV)", head]
    for r in rows:
        m, ph = r["main_us"], r["phase_us"]
        lines.append(f"{r['n']:>4} {r['batch']:>5} {r['block_v']:>3} {r['pairs_us']:>7.1f} {m['0']:>7.1f} {m['1']:>7.1f} "
                     f"{m['2']:>8.1f} {m['4']:>7.1f} {m['6']:>7.1f} | {ph['projection_mma']:>6.1f} "
                     f"{ph['chunk_staging']:>8.1f} {ph['substitution']:>6.1f} {ph['prologue_tables_epilogue']:>6.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "gdn_phases.json"))
    ap.add_argument("--n", type=int, nargs="+", default=[16, 64, 128, 256])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--variant", type=int, default=3,
                    help="kernel version (3: the default; bit 2 needs 3; 6: version 6's own phases)")
    args = ap.parse_args()
    if not torch.cuda.is_available() or not loader.kernels_available():
        sys.exit(f"gdn_phases.py needs a CUDA device and the NVRTC kernels: {loader.kernels_unavailable_reason()}")
    start = time.perf_counter()
    rows = []
    for batch in args.batch:
        for n in args.n:
            print(f"phases n={n} batch={batch} ...", file=sys.stderr, flush=True)
            rows.append(phases_v6(n, batch, args.reps) if args.variant == 6 else phases(n, batch, args.reps, args.variant))
    text = table(rows)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(command=" ".join([sys.executable, *sys.argv]), machine=machine_info(), rows=rows,
                                   elapsed_s=time.perf_counter() - start), indent=1))
    Path(str(out).replace(".json", ".txt")).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
