#!/usr/bin/env python3
"""The DFlash drafter's logits at the Qwen3.6-27B shape: the bfloat16 lm_head GEMM against its FP8 copy
(``vllm_tfm.kernels.fp8_head``), on the GPU host.

usage: python3 bench/draft_head_fp8.py [--out FILE] [--rows 15,16,120,128] [--vocab 248320] [--hidden 5120]
       [--repeats 30]

Rows: batch x depths (15 depths of a DFlash block of 16: 15 at batch 1, 120 at batch 8), bfloat16 activations
and weights from a normal distribution (weights x 0.02). Per row count, medians of ``--repeats`` CUDA-event
timings after a warm-up call, eager (``gdn_tree.time_calls``): ``bf16_us`` (``F.linear``, what vLLM's ``compute_logits`` runs), ``fp8_us``
(``fp8_head_logits``: the activations' per-row quantization, the padding and the GEMM), ``fp8_gemm_us`` (the
``torch._scaled_mm`` alone on quantized inputs), ``fp8_vllm_us`` (``fp8_head_logits`` with vLLM's one-kernel
per-token quantization, what the plugin runs; where vLLM imports), and the GB/s each reads (weights only). Also the FP8 logits'
relative error against the bfloat16 ones and the overlap of the top-512 sets (random data: no peaked
distribution, so a pessimistic overlap).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from gdn_tree import time_calls  # noqa: E402

from vllm_tfm.kernels.fp8_head import fp8_head_logits, quantize_head  # noqa: E402


def median_us(fn: Any, repeats: int) -> float:
    """Median CUDA-event microseconds of one eager call (``gdn_tree.time_calls``, no graph)."""
    return time_calls([fn], repeats, graph=False)[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--rows", default="15,16,120,128")
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--top-k", type=int, default=512)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA device")
        return 2
    torch.manual_seed(0)
    v, h = args.vocab, args.hidden
    w = (torch.randn(v, h, device="cuda") * 0.02).to(torch.bfloat16)
    wq, ws = quantize_head(w)
    try:
        from vllm import _custom_ops as ops

        def vllm_rows(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
            return ops.scaled_fp8_quant(x, num_token_padding=rows, use_per_token_if_dynamic=True)
    except ImportError:
        vllm_rows = None
    cases = []
    for m in (int(r) for r in args.rows.split(",")):
        x = torch.randn(m, h, device="cuda").to(torch.bfloat16)
        ref = F.linear(x, w)
        got = fp8_head_logits(x, wq, ws, v)
        k = min(args.top_k, v)
        top_ref, top_got = ref.float().topk(k, dim=1).indices, got.float().topk(k, dim=1).indices
        overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(top_ref, top_got)) / (m * k)
        mp = -(-m // 16) * 16
        xq = torch.zeros(mp, h, device="cuda", dtype=torch.float8_e4m3fn)
        sa = torch.ones(mp, 1, device="cuda")
        case = {
            "rows": m,
            "bf16_us": median_us(lambda: F.linear(x, w), args.repeats),
            "fp8_us": median_us(lambda: fp8_head_logits(x, wq, ws, v), args.repeats),
            "fp8_gemm_us": median_us(
                lambda: torch._scaled_mm(xq, wq.t(), scale_a=sa, scale_b=ws, out_dtype=torch.bfloat16), args.repeats),
            "rel_err": float((got.float() - ref.float()).norm() / ref.float().norm()),
            f"top{k}_overlap": overlap,
        }
        if vllm_rows is not None:
            case["fp8_vllm_us"] = median_us(lambda: fp8_head_logits(x, wq, ws, v, quantize_rows=vllm_rows), args.repeats)
        case["bf16_weight_gb_s"] = w.numel() * 2 / case["bf16_us"] / 1e3
        case["fp8_weight_gb_s"] = wq.numel() / case["fp8_gemm_us"] / 1e3
        cases.append(case)
        print(json.dumps(case), flush=True)
    result = {
        "command": "python3 bench/draft_head_fp8.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__},
        "vocab": v, "hidden": h, "cases": cases,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
