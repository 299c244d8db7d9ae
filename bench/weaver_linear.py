#!/usr/bin/env python3
"""The Weaver scorer's linear layers: the fused kernel (``cuda/weaver_linear.cu``) against the torch
path it replaces (``weaver_linear_reference``: RMSNorm, cuBLAS, epilogue kernels) at the
Qwen3.6-27B drafter's layer shapes on the GPU host.

usage: python3 bench/weaver_linear.py [--out FILE] [--rows 1,2,4,8,16] [--repeats 50]
       python3 bench/weaver_linear.py --chain [--rows 1,2,4] [--out FILE]   # one round's 14 layers in order
       python3 bench/weaver_linear.py --sanitize-case    # small kernel-vs-float64 run for compute-sanitizer

Per layer (token_in 5120 -> 1024 with its norm, qkv + rotate_half 1024 -> 6144 with its norm, o_proj
1024 -> 1024 + residual, gate_up 1024 -> 2 x 3072 with its norm and SwiGLU, down 3072 -> 1024 +
residual, query 1024 -> 5120 with its norm; bfloat16) and row count M: device microseconds of one
call, replayed from a CUDA graph of 10 calls (``bench/gdn_tree.py``'s ``time_calls``), the weight
bytes and their time at the measured copy bandwidth; and the kernel on the same weight as e4m3 rows
(``kl.quantize_weight_rows``: weight-only FP8, the tfm option ``weaver_weights: "fp8"``) with its floor.

``--chain``: the 14 linear layers of one Weaver round in the scorer's order (token_in, then per
layer qkv, o_proj, gate_up, down, then query; each reads the previous one's output, o_proj a fixed
attention output), each with its own weights (122 MB, more than the L2 holds), replayed from a CUDA
graph: microseconds per round with the kernel launched with and without programmatic dependent
launch (``VLLM_TFM_WEAVER_LINEAR_PDL``) and with and without the K split of ``kl.k_split``
(arms alternated twice), against the weight floor.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from gdn_tree import (
    copy_bandwidth,
    kernel_bench_parser,
    result_header,
    time_calls,
    write_result,
)

from vllm_tfm.kernels import weaver_linear as kl

LAYERS = [("token_in", 5120, 1024, "norm"), ("qkv_rot", 1024, 6144, "norm"), ("o_proj", 1024, 1024, "residual"),
          ("gate_up", 1024, 3072, "swiglu"), ("down", 3072, 1024, "residual"), ("query", 1024, 5120, "norm")]


def layer_args(m: int, k: int, n: int, mode: str, dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    rows = 2 * n if mode == "swiglu" else n
    x = torch.randn(m, k, generator=gen, device="cuda").to(dtype)
    w = (torch.randn(rows, k, generator=gen, device="cuda") / k**0.5).to(dtype)
    b = torch.randn(rows, generator=gen, device="cuda").to(dtype) if mode != "residual" else None
    res = torch.randn(m, n, generator=gen, device="cuda").to(dtype) if mode == "residual" else None
    return x, w, b, res, (1e-6 if mode != "residual" else None), mode == "swiglu"


def sanitize_case() -> None:
    for m, k, n, mode, dt in ((1, 8, 1, "norm", torch.float32), (3, 272, 7, "swiglu", torch.bfloat16),
                              (16, 144, 9, "residual", torch.float16), (2, 2320, 9, "norm", torch.bfloat16),
                              (4, 2056, 5, "swiglu", torch.float32)):  # the last two: several load groups, L2 prefetch
        args = layer_args(m, k, n, mode, dt)
        got = kl.weaver_linear_kernel(*args)
        x, w, b, res, eps, sw = args
        ref = kl.weaver_linear_reference(x.double(), w.double(), None if b is None else b.double(),
                                         None if res is None else res.double(), eps, sw)
        if float((got.double() - ref).abs().max()) > 0.05 * max(1.0, float(ref.abs().max())):
            raise SystemExit(f"sanitize case {m}x{k}x{n} {mode}: kernel and float64 differ")
        if dt != torch.float32:  # the same layer on e4m3 rows, its input rows gathered from a table by clamped ids
            w8, scale = kl.quantize_weight_rows(w)
            ids = torch.arange(m, device="cuda") * 3 - 1  # -1 and ids past the table's end: clamped
            table = torch.cat([x, x]) if m > 1 else x
            got8 = kl.weaver_linear_kernel(table, w8, b, res, eps, sw, scale, ids)
            ref8 = kl.weaver_linear_reference(table, w8, b, res, eps, sw, scale, ids).double()
            if float((got8.double() - ref8).abs().max()) > 0.05 * max(1.0, float(ref8.abs().max())):
                raise SystemExit(f"sanitize case {m}x{k}x{n} {mode} FP8: kernel and reference differ")
    torch.cuda.synchronize()
    print("sanitize case: the kernel equals the float64 layers to rounding")


def round_chain(m: int, seed: int = 0, fp8: bool = False):
    """A function running one round's 14 layers on [m, ...] rows, and its weight bytes; ``fp8``: the
    weights as e4m3 rows (``kl.quantize_weight_rows``)."""
    by_name = {name: (k, n, mode) for name, k, n, mode in LAYERS}
    names = ["token_in"] + ["qkv_rot", "o_proj", "gate_up", "down"] * 3 + ["query"]
    layers = [layer_args(m, *by_name[name], seed=seed + i) for i, name in enumerate(names)]
    if fp8:
        layers = [(x, *kl.quantize_weight_rows(w), b, res, eps, sw) for x, w, b, res, eps, sw in layers]
    else:
        layers = [(x, w, None, b, res, eps, sw) for x, w, b, res, eps, sw in layers]
    emb = layers[0][0]
    attn = layers[2][0]  # a fixed attention output [m, 1024]

    def lin(layer, x, residual=None, swiglu=False):
        _, w, scale, b, _, eps, _ = layer
        return kl.weaver_linear_kernel(x, w, b, residual, eps, swiglu, scale)

    def run() -> torch.Tensor:
        x = lin(layers[0], emb)
        for j in range(3):
            qkv, o, gu, down = layers[1 + 4 * j: 5 + 4 * j]
            lin(qkv, x)
            x = lin(o, attn, residual=x)
            h = lin(gu, x, swiglu=True)
            x = lin(down, h, residual=x)
        return lin(layers[-1], x)

    return run, sum(layer[1].numel() * layer[1].element_size() for layer in layers)


CHAIN_ARMS = {  # name: (programmatic dependent launch, K split by kl.k_split or 1, FP8 weights)
    "pdl_ksplit": (True, True, False), "pdl": (True, False, False), "no_pdl": (False, False, False),
    "pdl_ksplit_fp8": (True, True, True)}


def chain_bench(args, bw: float) -> dict[str, Any]:
    import os

    res: dict[str, Any] = {**result_header("bench/weaver_linear.py"), "dtype": "bfloat16",
                           "copy_bandwidth_gb_s": bw / 1e9, "arms": {k: {"pdl": v[0], "k_split": v[1]}
                                                                     for k, v in CHAIN_ARMS.items()}, "chains": []}
    for k, v in CHAIN_ARMS.items():
        res["arms"][k]["fp8_weights"] = v[2]
    k_split = getattr(kl, "k_split", None)
    if k_split is None or not hasattr(kl, "PDL_SWITCH"):  # an older package (a copy of this file beside it)
        return chain_as_is(args, bw, res)
    for m in (int(v) for v in args.rows.split(",")):
        run, moved = round_chain(m)
        run8, moved8 = round_chain(m, fp8=True)
        outs: dict[str, torch.Tensor] = {}
        times: dict[str, list[float]] = {k: [] for k in CHAIN_ARMS}
        for name in list(CHAIN_ARMS) * 2:  # alternated
            pdl, split, fp8 = CHAIN_ARMS[name]
            os.environ[kl.PDL_SWITCH] = str(int(pdl))
            kl.k_split = k_split if split else (lambda units, k, step=256: 1)
            us, mode = time_calls([run8 if fp8 else run], args.repeats)
            if mode != "graph":
                raise SystemExit(f"chain M={m} {name}: {mode}")
            times[name].append(us)
            if name not in outs:
                outs[name] = (run8 if fp8 else run)()
        os.environ.pop(kl.PDL_SWITCH, None)
        kl.k_split = k_split
        # PDL changes no arithmetic (same outputs bit for bit); the K split adds partial sums in
        # another order (float32 rounding)
        same = bool(torch.equal(outs["pdl"], outs["no_pdl"]))
        split_err = float((outs["pdl_ksplit"].float() - outs["pdl"].float()).abs().max())
        case = {"rows": m, "weight_bytes": moved, "floor_us": moved / bw * 1e6, "fp8_weight_bytes": moved8,
                "fp8_floor_us": moved8 / bw * 1e6, "us": times,
                "pdl_outputs_equal": same, "k_split_max_abs_diff": split_err}
        res["chains"].append(case)
        print(f"round chain M={m}: " + ", ".join(f"{k} {v}" for k, v in times.items()) +
              f" us; weight floor {case['floor_us']:.1f} us (FP8 {case['fp8_floor_us']:.1f}); PDL outputs equal: {same}; K split max diff {split_err:.3g}",
              flush=True)
        if not same:
            raise SystemExit("the chain's outputs differ with and without programmatic dependent launch")
    return res


def chain_as_is(args, bw: float, res: dict[str, Any]) -> dict[str, Any]:
    """The chain with the kernel as the imported package launches it (one arm: ``as_is``), for
    packages before programmatic dependent launch and the K split."""
    res["arms"] = {"as_is": {}}
    for m in (int(v) for v in args.rows.split(",")):
        run, moved = round_chain(m)
        times = [time_calls([run], args.repeats)[0] for _ in range(2)]
        res["chains"].append({"rows": m, "weight_bytes": moved, "floor_us": moved / bw * 1e6, "us": {"as_is": times}})
        print(f"round chain M={m}: as_is {times} us; weight floor {moved / bw * 1e6:.1f} us", flush=True)
    return res


def main() -> int:
    ap = kernel_bench_parser(__doc__, repeats=50)
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--chain", action="store_true", help="one round's 14 layers in order, PDL on and off")
    args = ap.parse_args()
    if args.sanitize_case:
        sanitize_case()
        return 0
    bw = copy_bandwidth()
    if args.chain:
        write_result(args.out, chain_bench(args, bw))
        return 0
    res: dict[str, Any] = {
        **result_header("bench/weaver_linear.py"),
        "dtype": "bfloat16", "copy_bandwidth_gb_s": bw / 1e9, "cases": [],
    }
    for name, k, n, mode in LAYERS:
        for m in (int(v) for v in args.rows.split(",")):
            call = layer_args(m, k, n, mode)
            ref_us, ref_mode = time_calls([lambda call=call: kl.weaver_linear_reference(*call)] * 10, args.repeats)
            ker_us, ker_mode = time_calls([lambda call=call: kl.weaver_linear_kernel(*call)] * 10, args.repeats)
            moved = call[1].numel() * 2
            case = {"layer": name, "rows": m, "k": k, "n": n, "mode": mode, "reference_us": ref_us,
                    "kernel_us": ker_us, "speedup": ref_us / ker_us, "timing": {"reference": ref_mode, "kernel": ker_mode}, "weight_bytes": moved,
                    "floor_us": moved / bw * 1e6}
            if m <= kl.MAX_ROWS:  # at every row count the source takes (the dispatch: up to kl.FP8_KERNEL_ROWS)
                w8, scale = kl.quantize_weight_rows(call[1])
                fp8_call = (call[0], w8, *call[2:], scale)
                fp8_us, fp8_mode = time_calls([lambda c=fp8_call: kl.weaver_linear_kernel(*c)] * 10, args.repeats)
                case.update(fp8_kernel_us=fp8_us, fp8_floor_us=moved / 2 / bw * 1e6)
                case["timing"]["fp8_kernel"] = fp8_mode
            res["cases"].append(case)
            fp8 = (f", FP8 kernel {case['fp8_kernel_us']:6.1f} us (floor {case['fp8_floor_us']:5.1f})"
                   if "fp8_kernel_us" in case else "")
            print(f"{name:8s} M={m:2d}: reference {ref_us:6.1f} us, kernel {ker_us:6.1f} us ({case['speedup']:.2f}x), "
                  f"weight floor {case['floor_us']:5.1f} us{fp8}", flush=True)
    write_result(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
