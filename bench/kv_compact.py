#!/usr/bin/env python3
"""The K/V compaction of the accepted tree paths: the one-launch kernel (``cuda/kv_compact.cu``,
``vllm_tfm.kernels.kv_compact.kv_compact_layers``) against the torch reference it replaces
(``kv_compact_reference``: per layer one gather and one scatter), at the Qwen3.6-27B attention shape on
the GPU host.

usage: python3 bench/kv_compact.py [--out FILE] [--batches 1,8] [--dmax 16] [--block-sizes 16,1104] [--repeats 50]
       python3 bench/kv_compact.py --sanitize-case   # small kernel-vs-reference run for compute-sanitizer

Shape: 16 full-attention layers, 4 KV heads, head size 256, bf16, vLLM's NHD cache order (4 KB per
token row and layer). Per batch (requests) and block size: every request accepts a full path of Dmax
drafts from a deep tree of 33 nodes (B = 32; rows shift by several), rows after a random context in
randomly ordered blocks. Times, medians of ``--repeats`` after warm-up:

* ``*_graph_us``: CUDA-event time of 10 calls replayed from a CUDA graph, per call (device time alone);
* ``*_eager_us``: CUDA-event time of 10 eager calls, per call (device time plus the launch gaps the
  host leaves: what the decode step sees when the host is the bottleneck);
* ``*_host_us``: host time to issue one call (perf_counter over 10 calls, no synchronisation inside).

Also: the bytes the moves must read and write (real moves x layers x 4 KB x 2) and the time that takes
at the measured device copy bandwidth (``bench/gdn_tree.py``'s ``copy_bandwidth``), and whether the
kernel's caches equal the reference's bit for bit. The moved rows are L2-resident after the first
call (a real step's are too: the forward just wrote them).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from gdn_tree import (  # noqa: E402
    copy_bandwidth,
    host_us,
    kernel_bench_parser,
    past_budget,
    result_header,
    time_calls,
    write_result,
)

from vllm_tfm.kernels import kv_compact as kkv  # noqa: E402
from vllm_tfm.vllm_plugin.runtime.commit import compaction_rows  # noqa: E402

LAYERS, HKV, HEAD = 16, 4, 256
TREE_NODES = 33
CALLS = 10  # calls per timed pass
# vLLM's hybrid block size for the 27B target with 64 speculative tokens (bench/tree_attention.py BLOCK_SIZE_27B)
BLOCK_27B = 1104


def deep_path(n: int, dmax: int, gen: torch.Generator) -> list[int]:
    """Local indices of the deepest path (root excluded, at most ``dmax``) of a random deep tree of ``n``
    nodes: parent i - 1 with probability 3/4, else one of the 4 nodes before (a spine with side
    branches, so path nodes sit past their chain rows)."""
    parents = [-1]
    for i in range(1, n):
        if float(torch.rand((), generator=gen)) < 0.75:
            parents.append(i - 1)
        else:
            parents.append(int(torch.randint(max(0, i - 4), i, (1,), generator=gen)))
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    node, path = max(range(n), key=lambda i: depth[i]), []
    while node > 0:
        path.append(node)
        node = parents[node]
    return path[::-1][:dmax]


def problem(batch: int, dmax: int, block_size: int, layers: int, heads: int, head: int, dtype: torch.dtype,
            seed: int, layout: str = "NHD") -> dict[str, Any]:
    """Caches, slot mapping and the rows of ``compaction_rows`` for ``batch`` requests of
    ``TREE_NODES`` rows each, every one accepting its deepest path (up to ``dmax``)."""
    gen = torch.Generator().manual_seed(seed)
    ctx = torch.randint(0, 3 * block_size, (batch,), generator=gen).tolist()
    need = [-(-(c + TREE_NODES) // block_size) for c in ctx]
    num_blocks = sum(need) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    slots, start = [], 0
    for c, k in zip(ctx, need):
        table, start = perm[start : start + k], start + k
        slots += [table[p // block_size] * block_size + p % block_size for p in range(c, c + TREE_NODES)]
    acc = torch.full((batch, dmax), -1, dtype=torch.int64)
    for r in range(batch):
        path = deep_path(TREE_NODES, dmax, gen)
        acc[r, : len(path)] = torch.tensor(path)
    src, dst = compaction_rows(torch.arange(batch) * TREE_NODES, acc)
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    if layout == "NHD":
        caches = [torch.randn(num_blocks, block_size, heads, 2 * head, generator=g, device=dev).to(dtype).permute(0, 2, 1, 3)
                  for _ in range(layers)]
    elif layout == "HND":
        caches = [torch.randn(num_blocks, heads, block_size, 2 * head, generator=g, device=dev).to(dtype)
                  for _ in range(layers)]
    else:  # strided last dimension: one-element copies
        caches = [torch.randn(num_blocks, 2 * head, block_size, heads, generator=g, device=dev).to(dtype).permute(0, 3, 2, 1)
                  for _ in range(layers)]
    slot_mapping = torch.tensor(slots + [-1, -1], dtype=torch.int64, device=dev)
    return {"caches": caches, "slot_mapping": slot_mapping, "src": src.to(dev), "dst": dst.to(dev)}


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def reference_on_bits(caches: list[torch.Tensor], sm: torch.Tensor, src: torch.Tensor, dst: torch.Tensor) -> None:
    """The reference on integer views of the caches (the same bytes move; fp8 needs no float index kernel)."""
    kkv.kv_compact_reference([kv.view(_BITS[kv.element_size()]) for kv in caches], sm, src, dst)


def same_bytes(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8)) for x, y in zip(a, b))


def sanitize_case() -> None:
    """Small calls of every copy unit (16-byte rows, 2-byte strided rows, 1-byte fp8), one and two
    rounds, against the reference (run under compute-sanitizer memcheck / racecheck)."""
    cases = [(1, 16, 16, "NHD", torch.bfloat16), (3, 8, 64, "HND", torch.float16), (2, 5, 16, "strided", torch.bfloat16),
             (9, 16, 16, "NHD", torch.float8_e4m3fn), (1, 1, 32, "NHD", torch.bfloat16)]
    for i, (batch, dmax, bs, layout, dtype) in enumerate(cases):
        p = problem(batch, dmax, bs, 3, 2, 32, dtype, seed=i, layout=layout)
        want = [kv.clone() for kv in p["caches"]]
        reference_on_bits(want, p["slot_mapping"], p["src"], p["dst"])
        reason = kkv.kv_compact_unsupported_reason(p["caches"], p["slot_mapping"], p["src"], p["dst"])
        if reason is not None:
            raise SystemExit(f"sanitize case {i}: the kernel does not run: {reason}")
        kkv.kv_compact_layers(p["caches"], p["slot_mapping"], p["src"], p["dst"])
        torch.cuda.synchronize()
        if not same_bytes(p["caches"], want):
            raise SystemExit(f"sanitize case {i} ({batch} x {dmax}, {layout}, {dtype}): kernel and reference differ")
    print("sanitize case: the kernel moves the reference's bytes")


def bench_case(batch: int, dmax: int, block_size: int, reps: int, bw: float) -> dict[str, Any]:
    p = problem(batch, dmax, block_size, LAYERS, HKV, HEAD, torch.bfloat16, seed=batch * 1000 + block_size)
    caches, sm, src, dst = p["caches"], p["slot_mapping"], p["src"], p["dst"]
    reason = kkv.kv_compact_unsupported_reason(caches, sm, src, dst)
    if reason is not None:
        raise SystemExit(f"the kernel does not run: {reason}")
    want = [kv.clone() for kv in caches]
    kkv.kv_compact_reference(want, sm, src, dst)
    kkv.kv_compact_layers(caches, sm, src, dst)
    torch.cuda.synchronize()
    equal = same_bytes(caches, want)
    del want

    def kernel() -> None:
        kkv.kv_compact_layers(caches, sm, src, dst)

    def reference() -> None:
        kkv.kv_compact_reference(caches, sm, src, dst)

    res: dict[str, Any] = {"batch": batch, "dmax": dmax, "block_size": block_size, "moves": src.numel(),
                           "real_moves": int((sm[src] != sm[dst]).sum()), "equal_bit_for_bit": equal}
    for name, fn in (("kernel", kernel), ("reference", reference)):
        res[f"{name}_graph_us"], res[f"{name}_graph_mode"] = time_calls([fn] * CALLS, reps, graph=True)
        res[f"{name}_eager_us"], _ = time_calls([fn] * CALLS, reps, graph=False)
        res[f"{name}_host_us"] = host_us(fn, reps)
    row_bytes = HKV * 2 * HEAD * 2
    res["bytes"] = 2 * res["real_moves"] * LAYERS * row_bytes
    res["floor_us"] = res["bytes"] / bw * 1e6
    res["kernel_launches"] = len(kkv._layers_plan(caches))
    return res


def main() -> int:
    ap = kernel_bench_parser(__doc__, repeats=50)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--dmax", type=int, default=16)
    ap.add_argument("--block-sizes", default=f"16,{BLOCK_27B}")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no case past this many seconds (bench/run_gpu_kernels.sh kv_compact); skipped cases are listed")
    args = ap.parse_args()
    if args.sanitize_case:
        sanitize_case()
        return 0
    bw = copy_bandwidth()
    res: dict[str, Any] = {
        **result_header("bench/kv_compact.py"),
        "shape": {"layers": LAYERS, "kv_heads": HKV, "head_size": HEAD, "dtype": "bfloat16", "layout": "NHD",
                  "tree_nodes": TREE_NODES, "dmax": args.dmax},
        "copy_bandwidth_gb_s": bw / 1e9,
        "cases": [],
        "skipped": [],
    }
    start = time.perf_counter()
    for bs in (int(v) for v in args.block_sizes.split(",")):
        for batch in (int(v) for v in args.batches.split(",")):
            if past_budget(start, args.budget_s, res["skipped"], batch=batch, block_size=bs):
                continue
            case = bench_case(batch, args.dmax, bs, args.repeats, bw)
            res["cases"].append(case)
            print(f"batch {batch:2d} block {bs:4d} moves {case['real_moves']:3d}: "
                  f"kernel {case['kernel_graph_us']:6.1f} us device / {case['kernel_eager_us']:6.1f} eager / "
                  f"{case['kernel_host_us']:6.1f} host; reference {case['reference_graph_us']:6.1f} / "
                  f"{case['reference_eager_us']:6.1f} / {case['reference_host_us']:6.1f}; floor {case['floor_us']:5.2f} us; "
                  f"equal {case['equal_bit_for_bit']}", flush=True)
    write_result(args.out, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
