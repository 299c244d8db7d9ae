"""Tree attention benchmark on the GPU host: our one-launch kernel vs vLLM's Triton attention.

At the Qwen3.6-27B attention shape (Hq = 24, Hkv = 4, D = 256, bf16, paged KV cache in the
TRITON_ATTN layout, vLLM's hybrid block size), for R tree requests of n nodes each after a
committed context of c keys, times per call (one attention layer):

* ours: ``vllm_tfm.kernels.tree_attention.tree_attention_planned`` (one launch for all trees);
* loop: the current fallback, one vLLM ``unified_attention`` call per tree request with its
  [n, n] ancestor bias (``runtime/attention.masked_tree_attention``);
* causal: ONE batched causal ``unified_attention`` over all trees (no tree mask: wrong numbers for
  trees, the lower bound of what vLLM's Triton kernel costs for these rows).

Each is timed eagerly (CUDA events around a pass, Python launch overhead included: what the
eager tfm engine pays) and as a replayed CUDA graph (device time only), medians over repeats after
warm-up. Also: host time to build the step's metadata (plan: bitmasks + one copy; old: one bias
and one copy per request), the error of ours against the float64 reference (R <= 8) and against
the loop, and the floors / predictions of bench/NOTES.md section 12.

    python3 bench/tree_attention.py --out $OUT/tree_attention.json      # table on stdout and .txt
    python3 bench/tree_attention.py --sanitize-case                     # small case for compute-sanitizer
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from gdn_tree import ddtree_parents, machine_info, rel_err, time_calls  # noqa: E402

from vllm_tfm.kernels import tree_attention as kta  # noqa: E402
from vllm_tfm.kernels.loader import kernels_available, kernels_unavailable_reason  # noqa: E402
from vllm_tfm.tree.bitmask import ragged_ancestor_bits  # noqa: E402
from vllm_tfm.verify import tree_attention as ref  # noqa: E402

DEV = "cuda"
HQ, HKV, HD = 24, 4, 256  # Qwen3.6-27B attention layers (bench/e2e_models.py)
# vLLM's hybrid block size for that target with 64 speculative tokens (platforms/interface.py
# _align_hybrid_block_size: 16 * ceil(mamba page / (16 * attention page per token)); mamba page =
# conv (3 + 64) x 10240 x 2 B + SSM 48 x 128 x 128 x 4 B = 4,517,888 B; attention 4 x 256 x 2 x 2 B)
BLOCK_SIZE_27B = 16 * math.ceil((67 * 10240 * 2 + 48 * 128 * 128 * 4) / (16 * 4 * 256 * 2 * 2))
COPY_BW = 4.3e12  # H200 device copy bandwidth measured by bench/gdn_tree.py (bytes/s)
SM_CLOCK = 1.9e9
CYCLES_PER_CTA_TILE = 1400  # bench/NOTES.md section 12: 64 rows x 32 keys at D = 256, bf16


# ---------------------------------------------------------------------------------------------
# inputs


def tree_parents(kind: str, n: int, seed: int) -> list[int]:
    """DDTree-like best-first tree (``ddtree``), ``chain``, ``star``, ``deep`` (spine of 4n/5) or ``random``."""
    rng = np.random.default_rng(seed)
    if kind == "ddtree":
        return ddtree_parents(n, seed)
    if kind == "chain":
        return list(range(-1, n - 1))
    if kind == "star":
        return [-1] + [0] * (n - 1)
    if kind == "deep":
        spine = max(1, 4 * n // 5)
        return [-1] + list(range(spine - 1)) + [int(rng.integers(0, i)) for i in range(spine, n)]
    if kind == "random":
        return [-1] + [int(rng.integers(0, i)) for i in range(1, n)]
    raise ValueError(f"unknown tree kind {kind!r}")


def make_case(trees: list[list[int]], ctxs: list[int], hq: int = HQ, hkv: int = HKV, dim: int = HD,
              block_size: int = 16, dtype: torch.dtype = torch.bfloat16, seed: int = 0, gap_rows: int = 3,
              exact: bool = False, device: str = DEV) -> dict:
    """Arguments of ``tree_attention`` in vLLM's layout, drawn on ``device``.

    The cache is vLLM's logical [num_blocks, Hkv, block_size, 2D] split into key/value views
    [num_blocks, block_size, Hkv, D]; every request gets its blocks in random order; tree t is
    request t and its rows start ``gap_rows`` after the previous tree (rows of other requests);
    with ``exact`` the cache holds exactly the blocks in use and q has no extra rows (for the
    memory checker).
    """
    gen = torch.Generator(device=device).manual_seed(seed)
    sizes = [len(t) for t in trees]
    lens = [c + n for c, n in zip(ctxs, sizes)]
    need = [-(-kv // block_size) for kv in lens]
    max_blocks = max(need) + (0 if exact else 1)
    num_blocks = sum(need) if exact else len(trees) * max_blocks + 3
    perm = torch.randperm(num_blocks, generator=gen, device=device).to(torch.int32)
    block_table = torch.zeros(len(trees), max_blocks, dtype=torch.int32, device=device)
    used = 0
    for t, k in enumerate(need):
        block_table[t, :k] = perm[used : used + k]
        used += k
    kv = torch.randn(num_blocks, hkv, block_size, 2 * dim, generator=gen, device=device).to(dtype)
    key_cache, value_cache = kv.transpose(1, 2).split(dim, dim=-1)
    gap = 0 if exact else gap_rows
    starts, row = [], gap
    for n in sizes:
        starts.append(row)
        row += n + gap
    q = torch.randn(row, hq, dim, generator=gen, device=device).to(dtype)
    cu = np.concatenate([[0], np.cumsum(sizes)])
    bits = ragged_ancestor_bits(np.concatenate([np.asarray(t) for t in trees]), cu)
    return {
        "q": q, "key_cache": key_cache, "value_cache": value_cache, "block_table": block_table,
        "seq_lens": torch.tensor(lens, dtype=torch.int32, device=device),
        "tree_req": torch.arange(len(trees), device=device), "tree_start": torch.tensor(starts, device=device),
        "tree_size": torch.tensor(sizes, device=device), "ancestor_bits": torch.from_numpy(bits).to(device),
        "scale": dim**-0.5,
    }


def plan_of(case: dict) -> kta.TreeAttentionPlan:
    return kta.TreeAttentionPlan.build(case["tree_req"].cpu().numpy(), case["tree_start"].cpu().numpy(),
                                       case["tree_size"].cpu().numpy(), case["ancestor_bits"].cpu().numpy(),
                                       case["q"].device)


def tree_rows(case: dict) -> torch.Tensor:
    return torch.cat([torch.arange(int(s), int(s) + int(n)) for s, n in zip(case["tree_start"], case["tree_size"])])


def reference64(case: dict) -> torch.Tensor:
    c64 = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in case.items()}
    return ref.tree_attention(**c64)


# ---------------------------------------------------------------------------------------------
# the three contenders


def ours_fn(case: dict, plan: kta.TreeAttentionPlan, out: torch.Tensor, **kw):
    max_len = int(case["seq_lens"].max())

    def run() -> None:
        kta.tree_attention_planned(plan, case["q"], case["key_cache"], case["value_cache"], case["block_table"],
                                   case["seq_lens"], case["scale"], out, max_len, **kw)
    return run


def _vllm_impl(case: dict) -> tuple[SimpleNamespace, SimpleNamespace]:
    impl = SimpleNamespace(kv_cache_dtype="auto", _is_per_token_head_quant=False, head_size=case["q"].shape[2],
                           scale=case["scale"], sliding_window=(-1, -1), logits_soft_cap=0, alibi_slopes=None,
                           use_alibi_sqrt=False, sinks=None, chunk_lookback=-1, use_td=False)
    one = torch.ones(1, device=case["q"].device)
    return impl, SimpleNamespace(_k_scale=one, _v_scale=one)


def kv_cache_of(case: dict) -> torch.Tensor:
    """vLLM's [num_blocks, Hkv, block_size, 2D] tensor behind the case's key/value views."""
    k = case["key_cache"]
    return torch.as_strided(k, (k.shape[0], k.shape[2], k.shape[1], 2 * k.shape[3]),
                            (k.stride(0), k.stride(2), k.stride(1), 1))


def loop_fn(case: dict, plan: kta.TreeAttentionPlan, out: torch.Tensor):
    """The current fallback: one unified_attention call per tree request, per-request [n, n] bias."""
    from vllm_tfm.vllm_plugin.runtime.attention import masked_tree_attention
    from vllm_tfm.vllm_plugin.runtime.inputs import per_request_trees

    impl, layer = _vllm_impl(case)
    trees = per_request_trees(plan, case["q"].device)
    md = SimpleNamespace(seq_lens=case["seq_lens"], block_table=case["block_table"],
                         max_seq_len=int(case["seq_lens"].max()))
    kv = kv_cache_of(case)

    def run() -> None:
        masked_tree_attention(impl, layer, case["q"], kv, md, out, trees)
    return run


def causal_fn(case: dict, out: torch.Tensor):
    """One batched causal unified_attention over all trees' rows (no mask; needs gap_rows=0)."""
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    sizes = case["tree_size"].tolist()
    cu = torch.tensor([0, *np.cumsum(sizes).tolist()], dtype=torch.int32, device=case["q"].device)
    assert case["tree_start"].tolist() == cu[:-1].tolist(), "the batched call needs contiguous trees (gap_rows=0)"
    hkv = case["key_cache"].shape[2]
    desc = torch.ones(1, device=case["q"].device).expand(len(sizes), hkv)
    max_len = int(case["seq_lens"].max())

    def run() -> None:
        unified_attention(q=case["q"], k=case["key_cache"], v=case["value_cache"], out=out, cu_seqlens_q=cu,
                          max_seqlen_q=max(sizes), seqused_k=case["seq_lens"], max_seqlen_k=max_len,
                          softmax_scale=case["scale"], causal=True, window_size=(-1, -1),
                          block_table=case["block_table"], softcap=0, q_descale=None, k_descale=desc,
                          v_descale=desc)
    return run


# ---------------------------------------------------------------------------------------------
# model of bench/NOTES.md section 12


def predicted(r: int, n: int, ctx: int) -> dict:
    kv_bytes = r * ((ctx + n) * HKV * HD * 2 * 2 + n * HQ * HD * 2 * 2)
    flops = r * 4 * n * HQ * HD * (ctx + n)
    g = HQ // HKV
    mt = -(-n * g // 64)
    tiles = r * HKV * sum(-(-(ctx + min(n - 1, (m * 64 + 63) // g) + 1) // 32) for m in range(mt))
    return {"floor_us": kv_bytes / COPY_BW * 1e6, "flop": flops, "cta_tiles": tiles,
            "predicted_us": tiles * CYCLES_PER_CTA_TILE / SM_CLOCK / torch.cuda.get_device_properties(0).multi_processor_count * 1e6
            if torch.cuda.is_available() else None}


# ---------------------------------------------------------------------------------------------
# benchmark


def host_metadata_us(case: dict, reps: int = 20) -> tuple[float, float]:
    """Median host microseconds: the step's plan (vectorised bitmasks, one copy) vs per-request biases."""
    from vllm_tfm.vllm_plugin.runtime.inputs import per_request_trees

    sizes = case["tree_size"].cpu().numpy()
    parents = np.concatenate([np.asarray(p) for p in case["_parents"]])
    req, start = case["tree_req"].cpu().numpy(), case["tree_start"].cpu().numpy()
    new, old = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        plan = kta.TreeAttentionPlan.from_parents(req, start, sizes, parents, DEV)
        torch.cuda.synchronize()
        new.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        per_request_trees(plan, DEV)
        torch.cuda.synchronize()
        old.append(time.perf_counter() - t0)
    return statistics.median(new) * 1e6, statistics.median(old) * 1e6


def bench_one(r: int, n: int, ctx: int, block_size: int, reps: int, check_reference: bool,
              defines: tuple[str, ...] = ()) -> dict:
    trees = [tree_parents("ddtree", n, 1000 * n + k) for k in range(r)]
    case = make_case(trees, [ctx] * r, block_size=block_size, seed=r * 7 + n + ctx, gap_rows=0)
    case["_parents"] = trees
    args = {k: v for k, v in case.items() if not k.startswith("_")}
    plan = plan_of(args)
    rows = tree_rows(args)
    res = {"R": r, "n": n, "ctx": ctx, "block_size": block_size, **predicted(r, n, ctx)}
    outs = {}
    for name, make in (("ours", lambda o: ours_fn(args, plan, o, extra_options=defines)),
                       ("loop", lambda o: loop_fn(args, plan, o)),
                       ("causal", lambda o: causal_fn(args, o))):
        out = torch.zeros_like(args["q"])
        try:
            fn = make(out)
            res[f"{name}_eager_us"], _ = time_calls([fn], reps, graph=False)
            res[f"{name}_graph_us"], mode = time_calls([fn], reps, graph=True)
            if mode != "graph":
                res[f"{name}_graph_us"], res[f"{name}_graph_mode"] = None, mode
            outs[name] = out
        except Exception as exc:  # noqa: BLE001 - keep the other contenders
            res[f"{name}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    if "ours" in outs and "loop" in outs:
        res["ours_vs_loop_rel"] = rel_err(outs["ours"][rows], outs["loop"][rows])
    if check_reference and "ours" in outs:
        res["ours_vs_float64_rel"] = rel_err(outs["ours"][rows], reference64(args)[rows])
    res["plan_host_us"], res["per_request_host_us"] = host_metadata_us(case)
    for name in ("loop", "causal"):
        for mode in ("eager", "graph"):
            a, b = res.get(f"{name}_{mode}_us"), res.get(f"ours_{mode}_us")
            res[f"speedup_vs_{name}_{mode}"] = a / b if a and b else None
    return res


def fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def table(results: list[dict]) -> str:
    bs = results[0]["block_size"] if results else "-"
    lines = [(f"tree attention, Hq={HQ} Hkv={HKV} D={HD} bf16, block size {bs}; us per call (one layer), median; "
              "eager = with Python launch overhead, graph = replayed CUDA graph"),
             (f"{'R':>3} {'n':>3} {'ctx':>5} {'floor':>7} {'pred':>7} {'ours':>7} {'ours g':>7} {'loop':>8} "
              f"{'loop g':>8} {'causal':>7} {'caus g':>7} {'x loop':>7} {'x caus':>7} {'err64':>8} {'err/loop':>8} "
              f"{'meta':>6} {'old':>6}")]
    for r in results:
        lines.append(
            f"{r['R']:>3} {r['n']:>3} {r['ctx']:>5} {fmt(r['floor_us']):>7} {fmt(r.get('predicted_us')):>7} "
            f"{fmt(r.get('ours_eager_us')):>7} {fmt(r.get('ours_graph_us')):>7} {fmt(r.get('loop_eager_us')):>8} "
            f"{fmt(r.get('loop_graph_us')):>8} {fmt(r.get('causal_eager_us')):>7} {fmt(r.get('causal_graph_us')):>7} "
            f"{fmt(r.get('speedup_vs_loop_eager'), '.2f'):>7} {fmt(r.get('speedup_vs_causal_graph'), '.2f'):>7} "
            f"{fmt(r.get('ours_vs_float64_rel'), '.1e'):>8} {fmt(r.get('ours_vs_loop_rel'), '.1e'):>8} "
            f"{fmt(r.get('plan_host_us'), '.0f'):>6} {fmt(r.get('per_request_host_us'), '.0f'):>6}")
    lines.append("x loop = loop eager / ours eager; x caus = causal graph / ours graph (causal has no tree mask); "
                 "meta / old = host us to build the step's metadata (plan, one copy) / the per-request biases")
    return "\n".join(lines)


def sanitize_case() -> None:
    """Every kernel variant the plugin uses, once, on exactly sized tensors, against the reference."""
    torch.manual_seed(0)
    trees = [tree_parents("ddtree", 70, 1), [-1], tree_parents("chain", 9, 2), tree_parents("random", 33, 3)]
    ctxs = [40, 0, 300, 17]
    # block sizes below a key tile (a lookup per row) and above it (a tile's blocks located once), the
    # 27B target's 1104; 2 to 4 key tiles in flight
    for dtype, hq, hkv, dim, bs, splits, stages, tol in ((torch.bfloat16, 24, 4, 256, 16, 1, 2, 3e-3),
                                                         (torch.bfloat16, 24, 4, 256, 48, 3, 2, 3e-3),
                                                         (torch.bfloat16, 24, 4, 256, 1104, 5, 3, 3e-3),
                                                         (torch.bfloat16, 24, 4, 256, 16, 40, 2, 3e-3),  # 3 merge chunks
                                                         (torch.float16, 8, 2, 128, 32, 2, 4, 3e-3),
                                                         (torch.float16, 8, 2, 128, 80, 2, 3, 3e-3),
                                                         (torch.float32, 4, 4, 64, 16, 1, 2, 1e-5),
                                                         (torch.float32, 6, 1, 64, 112, 4, 4, 1e-5)):
        case = make_case(trees, ctxs, hq, hkv, dim, bs, dtype, seed=dim + bs, exact=True)
        out = torch.full_like(case["q"], float("nan"))
        ours_fn(case, plan_of(case), out, splits=splits, stages=stages)()
        torch.cuda.synchronize()
        err = rel_err(out, reference64(case))
        assert err <= tol, (dtype, dim, bs, splits, stages, err)
    print("sanitize case: tree attention matches the reference in every variant")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "tree_attention.json"))
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--R", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--n", type=int, nargs="+", default=[17, 33, 65])
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 4096])
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE_27B)
    ap.add_argument("--budget-s", type=float, default=300.0, help="skip remaining configurations after this long")
    ap.add_argument("--sanitize-case", action="store_true")
    ap.add_argument("--define", action="append", default=[], metavar="NAME=VALUE",
                    help="a compile constant for our kernel only, e.g. TA_PROFILE_SKIP=1 (leave the K/V copies out: "
                         "timing only, the outputs are then wrong; cuda/tree_attention.cu)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("tree_attention.py needs a CUDA device")
    if not kernels_available():
        sys.exit(f"CUDA kernels unavailable: {kernels_unavailable_reason()}")
    if args.sanitize_case:
        sanitize_case()
        return
    defines = tuple(f"-D{d}" for d in args.define)
    start = time.perf_counter()
    results = []
    for ctx in args.ctx:
        for n in args.n:
            for r in args.R:
                if time.perf_counter() - start > args.budget_s:
                    results.append({"R": r, "n": n, "ctx": ctx, "skipped": "time budget"})
                    continue
                res = bench_one(r, n, ctx, args.block_size, args.reps, check_reference=r <= 8 and not defines,
                                defines=defines)
                results.append(res)
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in res.items()}), flush=True)
    done = [r for r in results if "skipped" not in r]
    text = table(done)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": " ".join(sys.argv), "machine": machine_info(), "shape":
                               {"Hq": HQ, "Hkv": HKV, "D": HD, "dtype": "bfloat16", "block_size": args.block_size},
                               "results": results, "seconds": round(time.perf_counter() - start, 1)}, indent=1))
    out.with_suffix(".txt").write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
