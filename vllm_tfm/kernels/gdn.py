"""Torch-facing wrappers of the GDN tree kernels (``cuda/gdn_tree_verify.cu``, ``cuda/gdn_tree_commit.cu``).

``gdn_tree_verify`` and ``gdn_tree_commit`` have exactly the signatures of the torch reference in
``vllm_tfm.verify.gdn`` and compute the same function. They run the CUDA kernels when the inputs
are CUDA tensors the kernels support (q/k/v float32, bfloat16 or float16 of one dtype, float32
state, K a multiple of 32, V a multiple of 16, HV a multiple of H with at most 32 value heads per
q/k head) and :func:`~vllm_tfm.kernels.loader.kernels_available`; otherwise they call the
reference (with a one-time warning for CUDA inputs), so the numbers never silently change.

The ``*_planned`` variants take a :class:`~vllm_tfm.kernels.plan.TreePlan` built once per decode
step (the plan only depends on the tree shapes), which is how the vLLM plugin calls them.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from vllm_tfm.kernels.loader import (
    device_smem_optin,
    get_kernel,
    kernels_unavailable_reason,
    launch,
    warn_fallback,
)
from vllm_tfm.kernels.plan import CommitIndices, TreePlan

__all__ = [
    "gdn_tree_verify",
    "gdn_tree_verify_planned",
    "gdn_tree_commit",
    "gdn_tree_commit_planned",
    "verify_smem_bytes",
    "commit_smem_bytes",
    "choose_block_v",
    "verify_unsupported_reason",
    "commit_unsupported_reason",
    "verify_launches",
    "VERIFY_VARIANTS",
    "DEFAULT_VERIFY_VARIANT",
]

VERIFY_SOURCE = "gdn_tree_verify.cu"
COMMIT_SOURCE = "gdn_tree_commit.cu"
THREADS = 256
PAIRS_WARPS = 8
RT, KC = 64, 32  # projection tile rows and staged K chunk (GDN_RT, GDN_KC in the source)
PAIR_WINDOW = 4096  # most pair entries staged in shared memory at once
COMMIT_THREADS, COMMIT_BV, COMMIT_PC = 128, 16, 32
# Kernel versions of the verify (GDN_VARIANT in the source; bench/NOTES.md): 1 = first measured,
# 2 = fewer serial latencies, 3 = version 2 with the projections on tensor cores (3xTF32), 4 =
# version 3 with each projection tile's 16-bit q/k rows staged whole by cp.async (section 24;
# float32 q/k run version 3's code; measured no faster), 5 = version 3 with the main kernel launched
# by programmatic dependent launch (it overlaps the pairs kernel until its first read of the pairs'
# outputs; section 24). All compute the same function; 3 is the default: faster than 2 at every
# measured size on the H200 (1.02-1.46x, bench/results/gdn_tree_v3.json.gz, in git history at 0c91a3e; section 19).
# 6 = one kernel per call (cuda/gdn_tree_verify_grouped.cu; section 31): a CTA per (request, q/k
# head, 16 V columns) serves every value head of the q/k head's group, computes the pair products
# itself on tensor cores and runs the projections as bf16 mma on a three-part split of S0. It takes
# bfloat16 inputs whose whole tree fits one CTA's shared memory; other calls run version 3.
# DEFAULT_VERIFY_VARIANT is the library calls' default; the vLLM runtime picks per step between 3, 6, 7 and 8
# (runtime_verify_variant, sections 34, 73 and 76).
# 7 = trees of at most 32 nodes (cuda/gdn_tree_verify_small.cu; section 73): a CTA of 4 GROUP BV threads
# per (request, q/k head, BV columns of V), a warp per (value head, 16 V rows, half of K), every n x n block
# 32 x 32, Delta in registers; two CTAs share an SM at the 27B shape. It takes the bfloat16 calls version 6
# takes whose trees have at most SMALL_MAX_NODES nodes; other calls run version 6 (or 3).
# 8 = trees of up to 128 nodes whose paths have at most PATHS_MAX_PATH nodes (cuda/gdn_tree_verify_paths.cu;
# sections 74-77): a solve kernel, a CTA per (request, q/k head), computes the grams on bf16 tensor cores and each
# node's rows of (I + X)^-1 and Y (I + X)^-1 per value head by back substitution over its path in registers; the
# verify kernel, a CTA of 16 warps (8 where two share an SM: paths_warps) per (request, value head, BV columns of
# V), the projections on bf16 tensor cores, then Delta and O as sums over path entries. It takes the bfloat16
# calls version 6 takes whose trees fit (paths_unsupported_reason); other calls run version 6 (or 3).
VERIFY_VARIANTS = (1, 2, 3, 4, 5, 6, 7, 8)
DEFAULT_VERIFY_VARIANT = 3
GROUPED_SOURCE = "gdn_tree_verify_grouped.cu"
GROUPED_THREADS, GROUPED_BV = 512, 16
GROUPED_DPAD = 16  # floats between value heads' D / O blocks (G6_DPAD)
PATH_SOLVE_MAX_DEPTH = 16  # version 6's path solve: deepest node it takes (grouped_solve; G6_PATH_REG = this + 1)
GROUPED_MARKS = 6  # timeline marks of version 6 (G6_MARKS): start, after phases 0, 1, 2, 3, end
SM_SMEM_BYTES = 228 * 1024  # shared memory of an sm_90 SM
CTA_SMEM_RESERVED = 1024  # shared memory the system reserves for each CTA on sm_80 / sm_90
SMALL_SOURCE = "gdn_tree_verify_small.cu"
SMALL_MAX_NODES = 32  # version 7's trees (S7_N)
SMALL_BLOCK_VS = (16, 32)  # V columns per value head and CTA (S7_BV)
SMALL_MARKS = 6  # timeline marks of version 7 (S7_MARKS): start, after phase 0's copies, its masks, phases 1, 2, end
PATHS_SOURCE = "gdn_tree_verify_paths.cu"
PATHS_MAX_NODES = 128  # version 8's trees (P8_N)
PATHS_MAX_PATH = 17  # most nodes on a root..node path in version 8 (P8_PATH): depth <= 16, a DFlash block
PATHS_BLOCK_VS = (32, 64)  # V columns per CTA (P8_BV)
PATHS_SOLVE_WARPS = 16  # warps of a CTA of version 8's solve kernel, one per request and q/k head (P8_GWARPS);
# -DP8_PREGRAM=0: the solve in the verify kernel, its grams shared by a cluster of a q/k head's CTAs with -DP8_CLUSTER=k
# (timing options)
PATHS_MARKS = 9  # timeline marks of version 8 (P8_MARKS): start, after the copies and node tables, after the norms and
# entry tables, after warp 0's gram tasks, after every warp's (and S0's copy), after warp 0's product scales, after the
# projections, after phase 2, end
PATHS_SOLVE_MARKS = 6  # of its solve kernel (P8_SMARKS): start, after the node paths, after the entries and q / k, after
# the norms and grams, after the scales, end

DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
NOT_CUDA = "inputs are not CUDA tensors"  # the reference is the CPU implementation: no warning


def _align4(x: int) -> int:
    return (x + 3) & ~3


def _stage_words(k_dim: int, variant: int, qk_dtype: torch.dtype | None) -> int:
    """Words of one staged q (or k) buffer (mirrors gdn_stage_words): a K chunk of the tile in float32,
    or (version 4, 16-bit q/k) the tile's whole rows as loaded."""
    if variant == 4 and qk_dtype in (torch.bfloat16, torch.float16):
        return _align4(RT * (k_dim + 8) // 2)
    return _align4(RT * (KC + 4))


def verify_smem_bytes(k_dim: int, block_v: int, n_cap: int, pcap: int, variant: int = DEFAULT_VERIFY_VARIANT,
                      qk_dtype: torch.dtype | None = None) -> int:
    """Dynamic shared memory of ``gdn_tree_verify_main`` (mirrors gdn_verify_smem_words); the kernel
    version and the q/k dtype matter for version 4 only."""
    words = (
        _align4(block_v * (k_dim + 4)) + 2 * _align4(n_cap * block_v) + 2 * _stage_words(k_dim, variant, qk_dtype)
        + 3 * _align4(pcap) + 4 * _align4(n_cap) + _align4(n_cap + 1) + 2 * _align4(n_cap) + _align4(n_cap + 2)
    )
    return 4 * words


def grouped_smem_bytes(k_dim: int, group: int, n_cap: int, pcap: int, solve_levels: bool = False) -> int:
    """Dynamic shared memory of ``gdn_tree_verify_grouped`` (mirrors g6_smem_words): q, k rows, the
    three S0 parts and v in 16 bits, R / Delta and the Q projections, the pair tables of the whole
    request (pcap entries) for ``group`` value heads (X, Y and, with the path solve, T and each entry's
    ancestor offset), the per-node and per-position tables. ``solve_levels``: the level-by-level solve
    (``-DG6_SOLVE=0``, bench/gdn_timeline.py), which has no T and no ancestor offsets."""
    n16 = (n_cap + 15) & ~15
    kp = k_dim + 8
    dw = group * (n16 * GROUPED_BV + GROUPED_DPAD)
    paths = 0 if solve_levels else 1
    words = (
        2 * _align4(n16 * kp // 2) + _align4(3 * group * GROUPED_BV * kp // 2) + _align4(n_cap * group * GROUPED_BV // 2)
        + max(2 * dw, 2 * _align4(pcap)) + (1 + paths + (2 + paths) * group) * _align4(pcap)
        + (2 + 3 * group) * _align4(n_cap) + 4 * _align4(n_cap) + _align4(n_cap + 1) + _align4(n_cap + 2)
    )
    return 4 * words


def small_smem_bytes(k_dim: int, group: int, block_v: int) -> int:
    """Dynamic shared memory of ``gdn_tree_verify_small`` (mirrors s7_smem_words): the q, k rows of 32
    nodes in 16 bits (later the raw projections of ``group`` value heads), X and Y of each value head,
    the v columns, and the per-node tables."""
    n = SMALL_MAX_NODES
    words = (max(n * (k_dim + 8), 2 * group * n * (block_v + 4)) + 2 * group * (n * n + 16)
             + _align4(n * group * block_v // 2) + (4 + 3 * group) * n)
    return 4 * words


def small_unsupported_reason(plan: TreePlan, qk_dtype: torch.dtype, h: int, hv: int, k_dim: int, v_dim: int,
                             max_smem: int, block_v: int = 16) -> str | None:
    """None when version 7 (``gdn_tree_verify_small``) takes this call, else why it runs version 6 (or 3)."""
    if qk_dtype != torch.bfloat16:
        return f"q/k/v are {qk_dtype}: version 7 takes bfloat16"
    if plan.max_nodes > SMALL_MAX_NODES:
        return f"a tree of {plan.max_nodes} nodes: version 7 takes at most {SMALL_MAX_NODES}"
    if block_v not in SMALL_BLOCK_VS or v_dim % block_v:
        return f"V={v_dim} is not a multiple of {block_v} (version 7 takes 16 or 32 columns per CTA)"
    if k_dim % 32:
        return f"K={k_dim} is not a multiple of 32"
    if (hv // h) * block_v > 256:
        return f"{hv // h} value heads per q/k head at {block_v} columns: version 7 takes at most 256 (1024 threads)"
    smem = small_smem_bytes(k_dim, hv // h, block_v)
    if smem > max_smem:
        return f"version 7 needs {smem} bytes of shared memory at K={k_dim}, {hv // h} value heads per q/k head; the device has {max_smem}"
    return None


def paths_smem_bytes(k_dim: int, block_v: int, max_nodes: int, pcap: int, solve_kernel: bool = True) -> int:
    """Dynamic shared memory of ``gdn_tree_verify_paths`` (mirrors p8_smem_words) for trees of at most
    ``max_nodes`` nodes and requests of at most ``pcap`` path entries: the q, k rows in 16 bits and the CTA's S0
    rows in float32 (later R and the Q projection), the v columns, T, W and the local node by path entry (with the
    solve in the verify kernel, ``solve_kernel`` False: also X, Y and two more index tables), the per-node tables."""
    n16 = (max_nodes + 15) & ~15
    words = (max(n16 * (k_dim + 8) + block_v * (k_dim + 8), 2 * n16 * (block_v + 4)) + n16 * block_v // 2
             + (3 if solve_kernel else 7) * _align4(pcap) + 13 * n16 + _align4(n16 + 1))
    return 4 * words


def paths_solve_smem_bytes(k_dim: int, max_nodes: int, pcap: int, group: int) -> int:
    """Dynamic shared memory of version 8's solve kernel ``gdn_tree_paths_solve`` (mirrors p8_solve_smem_words): the
    request's q and k rows in 16 bits; by path entry three index tables, the raw grams and the ``group`` value heads'
    scaled X and Y; the per-node tables and per value head g, beta and the path gate."""
    n16 = (max_nodes + 15) & ~15
    return 4 * (n16 * (k_dim + 8) + (5 + 2 * group) * _align4(pcap) + _align4(n16 + 1) + 9 * n16 + 3 * group * n16)


def paths_unsupported_reason(plan: TreePlan, qk_dtype: torch.dtype, k_dim: int, v_dim: int, max_smem: int,
                             block_v: int = 64, group: int | None = None) -> str | None:
    """None when version 8 (``gdn_tree_verify_paths``) takes this call, else why it runs version 6 (or 3).
    A fixed-layout plan's paths are bounded by its capacity (``max_depth`` = n - 1), not its ``depth_bound``:
    version 8 holds a path in registers and has no slower way for a deeper one. ``group``: value heads per q/k
    head, for the solve kernel's shared memory (None: not checked)."""
    if qk_dtype != torch.bfloat16:
        return f"q/k/v are {qk_dtype}: version 8 takes bfloat16"
    if plan.max_nodes > PATHS_MAX_NODES:
        return f"a tree of {plan.max_nodes} nodes: version 8 takes at most {PATHS_MAX_NODES}"
    if plan.max_depth + 1 > PATHS_MAX_PATH:
        return f"paths of up to {plan.max_depth + 1} nodes: version 8 takes at most {PATHS_MAX_PATH}"
    if block_v not in PATHS_BLOCK_VS or v_dim % block_v:
        return f"V={v_dim} is not a multiple of {block_v} (version 8 takes 32 or 64 columns per CTA)"
    if k_dim % 32:
        return f"K={k_dim} is not a multiple of 32 (version 8's norms read K / 4 columns a thread in 16-byte pieces)"
    smem = paths_smem_bytes(k_dim, block_v, plan.max_nodes, plan.max_pairs_per_request)
    if smem > max_smem:
        return f"version 8 needs {smem} bytes of shared memory for this plan at K={k_dim}; the device has {max_smem}"
    if group is not None:
        solve = paths_solve_smem_bytes(k_dim, plan.max_nodes, plan.max_pairs_per_request, group)
        if solve > max_smem:
            return (f"version 8's solve kernel needs {solve} bytes of shared memory for this plan at K={k_dim} and "
                    f"{group} value heads per q/k head; the device has {max_smem}")
    return None


def paths_solve_reference(plan: TreePlan, q: Tensor, k: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
                          use_qk_l2norm: bool = True) -> Tensor:
    """The float64 reference of version 8's solve kernel (``gdn_tree_paths_solve``): [HV, 2, plan.num_pairs] float32
    holding, at the path entry ``pair_off[pos[i]] + depth[j]`` of every ancestor pair (j on i's path, i itself
    included), T_ij (index 0) and W_ij (1) of each request's tree and value head: T = (I + X)^-1, W = Y T with X and Y
    as in cuda/gdn_tree_verify_paths.cu (DESIGN.md section 4), solved densely; NaN at entries of no pair (a
    fixed-layout plan's padding)."""
    q64, k64 = q.detach().cpu().double(), k.detach().cpu().double()
    g64, b64 = g.detach().cpu().double(), beta.detach().cpu().double()
    h, kd, hv = q64.shape[1], q64.shape[2], g64.shape[1]
    sc = kd**-0.5 if scale is None else float(scale)
    if use_qk_l2norm:
        k64 = k64 / (k64.square().sum(-1, keepdim=True) + 1e-6).sqrt()
        q64 = q64 * sc / (q64.square().sum(-1, keepdim=True) + 1e-6).sqrt()
    else:
        q64 = q64 * sc
    k64, q64 = k64.repeat_interleave(hv // h, dim=1), q64.repeat_interleave(hv // h, dim=1)  # [T, HV, K]
    pos, depth = plan.pos.long().cpu(), plan.depth.long().cpu()
    off, pj, cu = plan.pair_off.long().cpu(), plan.pair_j.long().cpu(), plan.cu.long().cpu()
    out = torch.full((hv, 2, plan.num_pairs), float("nan"), dtype=torch.float64)
    for r in range(plan.num_requests):
        bos, n = int(cu[r]), int(cu[r + 1] - cu[r])
        if n <= 0:
            continue
        rows, cols, entries = [], [], []
        for i in range(n):
            e0 = int(off[pos[bos + i]])
            for a in range(int(depth[bos + i]) + 1):
                rows.append(i), cols.append(int(pj[e0 + a]) - bos), entries.append(e0 + a)
        ri, cj = torch.tensor(rows), torch.tensor(cols)
        anc = torch.zeros(n, n, dtype=torch.bool)
        anc[ri, cj] = True  # j on i's path, i included
        gate = anc.double() @ g64[bos : bos + n]  # [n, HV]: G_i
        expo = torch.where(anc[None], gate.T[:, :, None] - gate.T[:, None, :], 0.0)  # [HV, n, n], ancestors only
        decay = torch.where(anc[None], expo.exp(), 0.0)
        kk = torch.einsum("ihd,jhd->hij", k64[bos : bos + n], k64[bos : bos + n])
        qk = torch.einsum("ihd,jhd->hij", q64[bos : bos + n], k64[bos : bos + n])
        strict = anc & ~torch.eye(n, dtype=torch.bool)
        x = b64[bos : bos + n].T[:, :, None] * decay * kk * strict[None]
        y = decay * qk
        eye = torch.eye(n, dtype=torch.float64).expand(hv, n, n)
        t = torch.linalg.solve_triangular(eye + x, eye, upper=False, unitriangular=True)  # node order is topological
        w = y @ t
        e = torch.tensor(entries)
        out[:, 0, e] = t[:, ri, cj]
        out[:, 1, e] = w[:, ri, cj]
    return out.float()


def paths_block_v(v_dim: int) -> int:
    """Version 8's V columns per CTA (P8_BV): 64 where V allows, else 32. An explicit ``-DP8_BV=32`` in
    ``verify_launches``' ``extra_options`` (benchmarks, tests) decides instead."""
    return 64 if v_dim % 64 == 0 else 32


def two_ctas_fit_sm(smem: int, sm_bytes: int = SM_SMEM_BYTES) -> bool:
    """Whether two CTAs of ``smem`` bytes of dynamic shared memory (and the KB each reserves) fit one SM."""
    return 2 * (smem + CTA_SMEM_RESERVED) <= sm_bytes


def paths_warps(plan: TreePlan, h: int, hv: int, k_dim: int, v_dim: int, block_v: int, num_sms: int,
                extra_options: Sequence[str] = ()) -> int:
    """Version 8's warps per CTA (P8_WARPS): 8 where two CTAs fit one SM's shared memory and the grid has more
    CTAs than the SMs, so that two CTAs share each SM (at 8 warps their registers fit too), else 16. On an H100
    (bench/NOTES.md section 76, bench/results/gdn_tree_v8_s76.txt.gz) 8 warps took n = 65 at batch 2 / 8 / 32 from
    28.0 / 83.7 / 327.3 to 22.0 / 61.0 / 229.8 us, and were within 3% at one wave (batch 1) and within 5% where one
    CTA fills the shared memory (n = 128). An explicit ``-DP8_WARPS=k`` in ``extra_options`` (benchmarks, tests)
    decides instead."""
    forced = _forced_define(extra_options, "P8_WARPS")
    if forced is not None:
        return forced
    smem = paths_smem_bytes(k_dim, block_v, plan.max_nodes, plan.max_pairs_per_request,
                            _forced_define(extra_options, "P8_PREGRAM") != 0)
    ctas = plan.num_requests * hv * (v_dim // block_v)
    return 8 if two_ctas_fit_sm(smem) and ctas > num_sms else 16


def small_block_v(v_dim: int) -> int:
    """Version 7's V columns per value head and CTA (S7_BV): 32 where V allows (grids of R H V / 32 CTAs of
    128 GROUP threads), faster than 16 at every size measured on an H100 (n = 16, 17 and 32 at batch 1, 8
    and 32; bench/results/gdn_tree_v7_s73.json.gz, bench/NOTES.md section 73), else 16. An explicit
    ``-DS7_BV=16`` in ``verify_launches``' ``extra_options`` (benchmarks, tests) decides instead."""
    return 32 if v_dim % 32 == 0 else 16


def _forced_define(extra_options: Sequence[str], name: str) -> int | None:
    """The value of the last ``-D<name>=k`` in ``extra_options`` (a benchmark's or test's explicit choice), else None."""
    values = [int(o.split("=", 1)[1]) for o in extra_options if o.startswith(f"-D{name}=")]
    return values[-1] if values else None


def grouped_solve(plan: TreePlan, k_dim: int, group: int, max_smem: int, extra_options: Sequence[str] = ()) -> int:
    """Version 6's solve for this call (G6_SOLVE): 1 = path rows (each node's rows of (I + X)^-1 and
    Y (I + X)^-1 by back substitution over its path, then gathers; no barrier per tree level), 0 = the
    level-by-level substitution. Paths where the H200 measured them faster (bench/NOTES.md sections 33,
    34: every size version 6 takes, up to 128 nodes per request) for trees of at most 16 levels below
    the root (a DFlash block; phase 2b holds a path in registers) whose larger tables (T and ancestor
    offsets) fit. A fixed-layout plan's depth is its ``depth_bound`` when it has one (full CUDA graphs:
    the drafter's depth; a deeper path is still exact, solved in shared memory). An explicit
    ``-DG6_SOLVE=k`` in ``extra_options`` (benchmarks, tests) decides instead."""
    forced = _forced_define(extra_options, "G6_SOLVE")
    if forced is not None:
        return forced
    fits = grouped_smem_bytes(k_dim, group, plan.max_nodes, plan.max_pairs_per_request) <= max_smem
    depth = plan.max_depth if plan.depth_bound is None else min(plan.max_depth, plan.depth_bound)
    return int(depth <= PATH_SOLVE_MAX_DEPTH and fits)


# grouped_cluster's cluster size where the gram takes more than one round of tiles. 2, not 4 or 8 (bench/NOTES.md
# section 44): the H200 holds 66 clusters of 2 of these CTAs at once but only 30 of 4 and 15 of 8, so batch 1's
# 128 CTAs at the 27B shape run in two waves with 4 or 8; and each remote store of the gram's scatter costs a CTA
# time that grows with the cluster (n = 33, one round either way: phase 1 2.4 / 2.9 / 4.1 / 5.9 us at 1 / 2 / 4 / 8).
GROUPED_CLUSTER = 2
GROUPED_CLUSTERS = (1, 2, 4, 8)


def grouped_cluster(plan: TreePlan, v_dim: int, threads: int, cc_major: int, extra_options: Sequence[str] = ()) -> int:
    """CTAs per thread block cluster of version 6 (G6_CLUSTER): the V / 16 CTAs of one (request, q/k head)
    split the gram tiles between them and store the products into each other's shared memory (sm_90).
    :data:`GROUPED_CLUSTER` where a CTA alone would run more than one round of gram tiles (more tiles
    than warps: n > 80 at 512 threads) and the V slices divide by it; 1 otherwise and before sm_90.
    An explicit ``-DG6_CLUSTER=k`` in ``extra_options`` (benchmarks, tests) decides instead; a size that
    does not divide the V slices is a ValueError."""
    slices = v_dim // GROUPED_BV
    c = _forced_define(extra_options, "G6_CLUSTER")
    if c is not None:
        if c not in GROUPED_CLUSTERS or slices % c:
            raise ValueError(f"G6_CLUSTER={c}: a cluster of 1, 2, 4 or 8 CTAs that divides the {slices} V slices")
        return c
    nb = (plan.max_nodes + 15) // 16
    if cc_major < 9 or slices % GROUPED_CLUSTER or nb * (nb + 1) // 2 <= threads // 32:
        return 1
    return GROUPED_CLUSTER


def grouped_threads(plan: TreePlan, h: int, v_dim: int, smem: int, max_smem_sm: int, num_sms: int) -> int:
    """Threads per CTA of version 6: 256 when two CTAs fit an SM's shared memory and the grid has at
    least two CTAs per SM (then one CTA's loads overlap the other's math), else 512 (one CTA per SM)."""
    ctas = plan.num_requests * h * (v_dim // GROUPED_BV)
    return 256 if two_ctas_fit_sm(smem, max_smem_sm) and ctas >= 2 * num_sms else GROUPED_THREADS


def grouped_unsupported_reason(plan: TreePlan, qk_dtype: torch.dtype, h: int, hv: int, k_dim: int, v_dim: int,
                               max_smem: int) -> str | None:
    """None when version 6 (``gdn_tree_verify_grouped``) takes this call, else why it runs version 3."""
    if qk_dtype != torch.bfloat16:
        return f"q/k/v are {qk_dtype}: version 6 takes bfloat16"
    if v_dim % GROUPED_BV:
        return f"V={v_dim} is not a multiple of {GROUPED_BV}"
    group = hv // h
    if group * 4 > GROUPED_THREADS:
        return f"{group} value heads per q/k head: version 6 takes at most {GROUPED_THREADS // 4}"
    smem = grouped_smem_bytes(k_dim, group, plan.max_nodes, plan.max_pairs_per_request, solve_levels=True)
    if smem > max_smem:
        return (f"a tree of {plan.max_nodes} nodes and {plan.max_pairs_per_request} pairs needs {smem} bytes of "
                f"shared memory in version 6, the device has {max_smem}")
    return None


# runtime_verify_variant's bounds (bench/NOTES.md sections 34 and 37): version 6 at every batch for trees of up to
# RUNTIME_V6_MAX_NODES nodes and on grids of one wave; with its path solve also up to RUNTIME_V6_PATH_NODES nodes at
# every batch, and at any size on grids of up to RUNTIME_V6_PATH_WAVES waves of CTAs
RUNTIME_V6_MAX_NODES = 17
RUNTIME_V6_PATH_NODES = 33
RUNTIME_V6_PATH_WAVES = 2
# version 8 (sections 76, 77): trees of more than RUNTIME_V8_MIN_NODES - 1 nodes (B > 32) whose paths fit it, on grids
# of version 6 of more than one wave, and at batch 1 too from RUNTIME_V8_ONE_WAVE_NODES + 1 nodes
RUNTIME_V8_MIN_NODES = 34
RUNTIME_V8_ONE_WAVE_NODES = 64


def runtime_verify_variant(plan: TreePlan, qk_dtype: torch.dtype, h: int, hv: int, k_dim: int, v_dim: int,
                           max_smem: int, num_sms: int) -> int:
    """The verify version the runtime runs for this plan: 7 or 8 where they take it and measured faster (below),
    else 6 where the H200 measured it faster than 3 on per-step plans and on the full CUDA graphs' fixed-layout
    plans, with and without the drafter's depth
    bound (bench/NOTES.md sections 34 and 37; bench/results/gdn_tree_tfm_sizes_s37*.json.gz), else 3:

    * a grid of one wave (R H V / 16 CTAs <= the SMs: batch 1 at the 27B shape): n = 17 to 128, 1.37-1.77x;
    * trees of up to 17 nodes (B = 16) at every batch measured: 1.02-1.15x;
    * with version 6's path solve (per-step plans, and fixed plans whose depth bound is <= 16): trees of up to
      33 nodes at every batch (1.04-1.10x at batch 2 to 32) and grids of up to two waves (n = 65 at batch 2,
      1.23-1.58x). With the level solve (a fixed plan without a bound) version 6 lost at n = 33 from batch 2
      (0.88-0.93x), and n = 65 loses from batch 8 with either solve (0.77-0.93x).

    Bfloat16 q/k only, and trees that fit version 6's shared memory (``grouped_unsupported_reason``).

    Version 7 before all of these where it takes the call (trees of at most 32 nodes) and version 6's grid is
    more than one wave (R H V / 16 CTAs > the SMs: batch 2 and more at the 27B shape): at n = 17 on an H100
    31.7 / 107.4 us against version 6's 46.1 / 168.7 at batch 8 / 32, but 11.1 against 10.8 at batch 1
    (bench/NOTES.md section 73, bench/results/gdn_tree_v7_s73.json.gz; batches 2 to 7 not measured).

    Version 8 where it takes the call (trees of up to 128 nodes whose paths have at most 17) and they have more than
    33 nodes (B > 32), if version 6's grid is more than one wave or the trees have more than 64 nodes. On an H100
    (bench/NOTES.md section 77, bench/results/gdn_tree_v8_s77.txt.gz): n = 128 at batch 1 / 8 18.8 / 95.1 us against
    version 6's 23.0 / 167.3; n = 65 at batch 1 / 8 13.0 / 59.2 against 15.2 / 106.8 (section 76, before the solve
    kernel: 15.3 as version 6 at n = 65, batch 1; batches 2 and 32 at n = 65 22.0 / 230.6 against version 6's 29.1 /
    407.5 and version 3's 35.9 / 370.4); n = 33 tied with version 6 at batch 8 and lost at batch 32 (section 75);
    batch 1 from 34 to 64 nodes not measured.
    A full CUDA graph's fixed-layout plan of more than 17 nodes never runs it: its paths are bounded by its capacity."""
    ctas = plan.num_requests * h * (v_dim // GROUPED_BV)  # version 6's grid
    if ctas > num_sms and small_unsupported_reason(plan, qk_dtype, h, hv, k_dim, v_dim, max_smem,
                                                    small_block_v(v_dim)) is None:
        return 7
    if (plan.max_nodes >= RUNTIME_V8_MIN_NODES and (ctas > num_sms or plan.max_nodes > RUNTIME_V8_ONE_WAVE_NODES)
            and paths_unsupported_reason(plan, qk_dtype, k_dim, v_dim, max_smem, paths_block_v(v_dim), hv // h) is None):
        return 8
    if grouped_unsupported_reason(plan, qk_dtype, h, hv, k_dim, v_dim, max_smem) is not None:
        return 3
    if plan.max_nodes <= RUNTIME_V6_MAX_NODES or ctas <= num_sms:
        return 6
    if grouped_solve(plan, k_dim, hv // h, max_smem) == 1 and (
        plan.max_nodes <= RUNTIME_V6_PATH_NODES or ctas <= RUNTIME_V6_PATH_WAVES * num_sms
    ):
        return 6
    return 3


def commit_smem_bytes(k_dim: int, m_cap: int) -> int:
    """Dynamic shared memory of ``gdn_tree_commit`` (mirrors gdn_commit_smem_words)."""
    return 4 * (3 * _align4(m_cap) + _align4(COMMIT_PC * (k_dim + 4)) + _align4(COMMIT_PC * COMMIT_BV) + 4)


def _pair_capacity(plan: TreePlan) -> int:
    return max(plan.max_depth + 1, min(plan.max_pairs_per_request, PAIR_WINDOW))


def choose_block_v(plan: TreePlan, v_heads: int, k_dim: int, v_dim: int, max_smem: int, num_sms: int,
                   variant: int = DEFAULT_VERIFY_VARIANT, qk_dtype: torch.dtype | None = None) -> int | None:
    """Columns of V per CTA: 64 when the grid has >= 2 CTAs per SM at 64, else 32, else 16.

    Only sizes that divide V and whose shared memory (for this kernel version and q/k dtype) fits
    ``max_smem`` are considered; None if none fits (the tree is too large for one CTA's shared memory).
    """
    pcap = _pair_capacity(plan)
    fits = [bv for bv in (64, 32, 16)
            if v_dim % bv == 0 and verify_smem_bytes(k_dim, bv, plan.max_nodes, pcap, variant, qk_dtype) <= max_smem]
    if not fits:
        return None
    for bv in fits:
        if plan.num_requests * v_heads * (v_dim // bv) >= 2 * num_sms:
            return bv
    return fits[-1]


def _is_16_aligned(*tensors: Tensor | None) -> bool:
    return all(t is None or t.data_ptr() % 16 == 0 for t in tensors)


def _verify_unsupported(q: Tensor, k: Tensor, v: Tensor, ssm_state: Tensor) -> str | None:
    """Why the CUDA verify cannot take these inputs (None when it can)."""
    if not (q.is_cuda and k.is_cuda and v.is_cuda and ssm_state.is_cuda):
        return NOT_CUDA
    if not (q.dtype == k.dtype == v.dtype) or v.dtype not in DTYPE_CODE:
        return f"q/k/v dtypes {q.dtype}/{k.dtype}/{v.dtype}: the kernel takes one of float32, bfloat16, float16"
    if ssm_state.dtype != torch.float32:
        return f"ssm_state dtype {ssm_state.dtype}: the kernel reads a float32 state"
    if q.dim() != 3 or v.dim() != 3 or ssm_state.dim() != 4:
        return "shapes are not [T, H, K] / [T, HV, V] / [slots, HV, V, K]"
    h, kd = q.shape[1], q.shape[2]
    hv, vd = v.shape[1], v.shape[2]
    if kd % 32 != 0 or vd % 16 != 0:
        return f"K={kd} must be a multiple of 32 and V={vd} of 16"
    if hv % h != 0 or hv // h > 32:
        return f"HV={hv} must be a multiple of H={h} with at most 32 value heads per q/k head"
    if ssm_state.stride(-1) != 1 or any(s % 4 for s in ssm_state.stride()[:3]) or not _is_16_aligned(ssm_state):
        return "ssm_state needs a contiguous last dimension, strides that are multiples of 4 and 16-byte alignment"
    return kernels_unavailable_reason(v.device.index)


def verify_unsupported_reason(q: Tensor, k: Tensor, v: Tensor, ssm_state: Tensor) -> str | None:
    """None when the verify kernel takes these tensors (dtypes, shapes, strides, device), else why not.

    Host-side checks of tensor metadata only (no device synchronisation), for callers of
    :func:`gdn_tree_verify_planned` that validated the tree once per step themselves.
    """
    return _verify_unsupported(q, k, v, ssm_state)


def commit_unsupported_reason(k: Tensor, delta: Tensor, ssm_state: Tensor) -> str | None:
    """As :func:`verify_unsupported_reason`, for :func:`gdn_tree_commit_planned`."""
    return _commit_unsupported(k, delta, ssm_state)


def _check_out(out: Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, name: str) -> Tensor:
    """A fresh output, or the caller's after checking shape, dtype, device, contiguity, alignment."""
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device:
        raise ValueError(f"{name} must be a {dtype} tensor of shape {list(shape)} on {device}, got {out.dtype} {list(out.shape)} on {out.device}")
    if not out.is_contiguous() or out.data_ptr() % 16 != 0:
        raise ValueError(f"{name} must be contiguous and 16-byte aligned")
    return out


def _index32(x: Tensor, device: torch.device) -> Tensor:
    return x.to(device=device, dtype=torch.int32).contiguous()


def _state_index_arg(state_indices: Tensor, dev: torch.device, variant: int) -> tuple[Tensor, int]:
    """state_indices as the kernel reads them: (tensor, 1 if int64 else 0).

    Version 2 takes int32 or int64 indices as they are (no conversion kernel per call); version 1
    converts to int32 as it did when first measured.
    """
    if variant >= 2 and state_indices.dtype in (torch.int32, torch.int64) and state_indices.device == dev \
            and state_indices.dim() == 1 and state_indices.is_contiguous():
        return state_indices, int(state_indices.dtype == torch.int64)
    return _index32(state_indices, dev), 0


def verify_launches(
    plan: TreePlan,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    ssm_state: Tensor,
    state_indices: Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    return_delta: bool = False,
    block_v: int | None = None,
    out: Tensor | None = None,
    delta_out: Tensor | None = None,
    variant: int = DEFAULT_VERIFY_VARIANT,
    extra_options: Sequence[str] = (),
    threads6: int | None = None,
    timeline6: Tensor | None = None,
    timeline7: Tensor | None = None,
    timeline8: Tensor | None = None,
    timeline8_solve: Tensor | None = None,
) -> tuple[list[tuple[str, Callable[[], None]]], Tensor, Tensor | None]:
    """Prepare one verify call: ([(kernel name, launch)], o, delta) without launching anything.

    Arguments as :func:`gdn_tree_verify_planned`. Calling the launches in order computes o
    [T, HV, V] (v.dtype) and delta [T, HV, V] float32 (None unless return_delta); the bench calls
    them one at a time to time each kernel alone. ``extra_options``: more NVRTC options, for
    benchmarks only (``-DGDN_PROFILE_SKIP=...`` in bench/gdn_phases.py leaves phases out and gives
    wrong outputs). ``threads6``: version 6's threads per CTA (256 or 512; default
    :func:`grouped_threads`), for tests and benchmarks; ``timeline6``: an int64 CUDA tensor of
    ``GROUPED_MARKS * 2`` entries per CTA that version 6 fills with the global timer and the SM clock at
    its phase boundaries (bench/gdn_timeline.py); ``timeline7`` and ``timeline8`` the same for versions 7 and 8
    (``SMALL_MARKS * 2`` / ``PATHS_MARKS * 2`` entries per CTA), and ``timeline8_solve`` version 8's solve kernel
    (``PATHS_SOLVE_MARKS * 2`` entries per CTA). Raises ValueError on a shape mismatch or an unknown variant.
    """
    if variant not in VERIFY_VARIANTS:
        raise ValueError(f"variant={variant!r} is not a verify kernel version; choose one of {VERIFY_VARIANTS}")
    t_nodes, h, kd = q.shape
    hv, vd = v.shape[1], v.shape[2]
    if t_nodes != plan.num_nodes or v.shape[0] != t_nodes or k.shape != q.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not match the plan's {plan.num_nodes} nodes")
    if g.shape != (t_nodes, hv) or beta.shape != (t_nodes, hv):
        raise ValueError(f"g and beta must have shape [T={t_nodes}, HV={hv}], got {tuple(g.shape)} and {tuple(beta.shape)}")
    dev = v.device
    dev_index = dev.index if dev.index is not None else torch.cuda.current_device()
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if not _is_16_aligned(q, k, v):
        q, k, v = q.clone(), k.clone(), v.clone()
    g32 = g.to(torch.float32).contiguous()
    b32 = beta.to(torch.float32).contiguous()
    sidx, sidx64 = _state_index_arg(state_indices, dev, variant)
    scale = kd**-0.5 if scale is None else float(scale)

    o = _check_out(out, (t_nodes, hv, vd), v.dtype, dev, "out")
    delta = _check_out(delta_out, (t_nodes, hv, vd), torch.float32, dev, "delta_out") if return_delta else None
    i32, i64, f32 = ctypes.c_int, ctypes.c_longlong, ctypes.c_float
    st = ssm_state.stride()
    if variant == 8:
        max_smem = device_smem_optin(dev_index)
        bv8 = _forced_define(extra_options, "P8_BV")
        bv8 = paths_block_v(vd) if bv8 is None else bv8
        pregram = _forced_define(extra_options, "P8_PREGRAM") != 0
        if paths_unsupported_reason(plan, q.dtype, kd, vd, max_smem, bv8, hv // h if pregram else None) is None:
            cl8 = _forced_define(extra_options, "P8_CLUSTER")
            cl8 = 1 if cl8 is None else cl8
            if not 1 <= cl8 <= 8 or (hv // h * (vd // bv8)) % cl8 or (pregram and cl8 != 1):
                raise ValueError(f"P8_CLUSTER={cl8}: a cluster of 1 to 8 CTAs that divides the {hv // h * (vd // bv8)} "
                                 "CTAs of a q/k head (1 with P8_PREGRAM=1)")
            sms = torch.cuda.get_device_properties(dev_index).multi_processor_count
            warps8 = paths_warps(plan, h, hv, kd, vd, bv8, sms, extra_options)
            gwarps = _forced_define(extra_options, "P8_GWARPS") or PATHS_SOLVE_WARPS  # benchmarks may choose
            opts = ["--std=c++17", "-lineinfo", f"-DTFM_IN={DTYPE_CODE[v.dtype]}", f"-DGDN_K={kd}", f"-DGDN_V={vd}",
                    f"-DP8_BV={bv8}", f"-DP8_PATH={PATHS_MAX_PATH}", f"-DP8_CLUSTER={cl8}",
                    f"-DP8_GWARPS={gwarps}", f"-DP8_WARPS={warps8}",
                    *[x for x in extra_options
                      if not x.startswith(("-DP8_BV=", "-DP8_CLUSTER=", "-DP8_GWARPS=", "-DP8_WARPS="))]]
            k_paths = get_kernel(PATHS_SOURCE, "gdn_tree_verify_paths", opts, dev_index)
            pcap8 = plan.max_pairs_per_request
            n16 = (plan.max_nodes + 15) & ~15
            # the solve kernel's output: each value head's rows of T and W by path entry, [HV][2][pairs]
            tw = torch.empty(2 * hv * plan.num_pairs if pregram else 0, dtype=torch.float32, device=dev)
            args = [q, k, v, g32, b32, plan.perm, plan.pair_off, plan.pair_j, plan.cu, ssm_state, sidx,
                    i32(sidx64), i64(st[0]), i64(st[1]), i64(st[2]), o, delta, i32(h), i32(hv), i32(n16), i32(pcap8),
                    f32(scale), i32(int(use_qk_l2norm)), tw, i32(plan.num_pairs), timeline8]
            grid8 = (hv // h * (vd // bv8), h, plan.num_requests)  # a q/k head's CTAs consecutive along x
            smem8 = paths_smem_bytes(kd, bv8, plan.max_nodes, pcap8, pregram)
            block8 = (32 * warps8, 1, 1)

            def run_paths() -> None:
                launch(k_paths, grid8, block8, args, shared_mem=smem8, programmatic=pregram, cluster=cl8)

            run_paths.kernel, run_paths.config = k_paths, (grid8, block8, smem8, cl8)  # type: ignore[attr-defined]
            made = [("gdn_tree_verify_paths", run_paths)]
            if pregram:  # the solve by a kernel of its own, a CTA per request and q/k head, before the verify kernel
                k_solve = get_kernel(PATHS_SOURCE, "gdn_tree_paths_solve", opts, dev_index)
                grid_s, block_s = (1, h, plan.num_requests), (32 * gwarps, 1, 1)
                smem_s = paths_solve_smem_bytes(kd, plan.max_nodes, pcap8, hv // h)
                args_s = [q, k, g32, b32, plan.perm, plan.pair_off, plan.pair_j, plan.cu, tw, i32(h), i32(hv), i32(n16),
                          i32(pcap8), i32(plan.num_pairs), f32(scale), i32(int(use_qk_l2norm)), timeline8_solve]

                def run_solve() -> None:
                    launch(k_solve, grid_s, block_s, args_s, shared_mem=smem_s)

                run_solve.kernel, run_solve.config = k_solve, (grid_s, block_s, smem_s, 1)  # type: ignore[attr-defined]
                run_solve.tw = tw  # type: ignore[attr-defined]  # its output, for the tests
                made.insert(0, ("gdn_tree_paths_solve", run_solve))
            return made, o, delta
        variant = 6  # version 8 does not take this call (paths_unsupported_reason): version 6 (or 3) does
    if variant == 7:
        max_smem = device_smem_optin(dev_index)
        bv7 = _forced_define(extra_options, "S7_BV")
        bv7 = small_block_v(vd) if bv7 is None else bv7
        if small_unsupported_reason(plan, q.dtype, h, hv, kd, vd, max_smem, bv7) is None:
            opts = ["--std=c++17", "-lineinfo", f"-DTFM_IN={DTYPE_CODE[v.dtype]}", f"-DGDN_K={kd}", f"-DGDN_V={vd}",
                    f"-DGDN_GROUP={hv // h}", f"-DS7_BV={bv7}",
                    *[x for x in extra_options if not x.startswith("-DS7_BV=")]]
            k_small = get_kernel(SMALL_SOURCE, "gdn_tree_verify_small", opts, dev_index)
            args = [q, k, v, g32, b32, plan.perm, plan.pair_off, plan.pair_j, plan.cu, ssm_state, sidx,
                    i32(sidx64), i64(st[0]), i64(st[1]), i64(st[2]), o, delta, i32(h), i32(hv), f32(scale),
                    i32(int(use_qk_l2norm)), timeline7]
            grid7 = (vd // bv7, h, plan.num_requests)
            block7 = (4 * (hv // h) * bv7, 1, 1)
            smem7 = small_smem_bytes(kd, hv // h, bv7)

            def run_small() -> None:
                launch(k_small, grid7, block7, args, shared_mem=smem7)

            run_small.kernel, run_small.config = k_small, (grid7, block7, smem7, 1)  # type: ignore[attr-defined]
            return [("gdn_tree_verify_small", run_small)], o, delta
        variant = 6  # version 7 does not take this call (small_unsupported_reason): version 6 (or 3) does
    if variant == 6:
        max_smem = device_smem_optin(dev_index)
        if grouped_unsupported_reason(plan, q.dtype, h, hv, kd, vd, max_smem) is None:
            pcap6 = plan.max_pairs_per_request
            solve = grouped_solve(plan, kd, hv // h, max_smem, extra_options)
            smem6 = grouped_smem_bytes(kd, hv // h, plan.max_nodes, pcap6, solve_levels=solve == 0)
            props = torch.cuda.get_device_properties(dev_index)
            threads = threads6 or grouped_threads(plan, h, vd, smem6, SM_SMEM_BYTES, props.multi_processor_count)
            cluster = grouped_cluster(plan, vd, threads, props.major, extra_options)
            opts = ["--std=c++17", "-lineinfo", f"-DTFM_IN={DTYPE_CODE[v.dtype]}", f"-DGDN_K={kd}", f"-DGDN_V={vd}",
                    f"-DGDN_GROUP={hv // h}", f"-DG6_THREADS={threads}", f"-DG6_SOLVE={solve}", f"-DG6_CLUSTER={cluster}",
                    *([f"-DG6_PATH_REG={PATH_SOLVE_MAX_DEPTH + 1}"] if solve else []),
                    *[o for o in extra_options if not o.startswith(("-DG6_SOLVE=", "-DG6_CLUSTER="))]]
            k_grouped = get_kernel(GROUPED_SOURCE, "gdn_tree_verify_grouped", opts, dev_index)
            args = [q, k, v, g32, b32, plan.perm, plan.pair_off, plan.pair_j, plan.cu, ssm_state, sidx, i32(sidx64),
                    i64(st[0]), i64(st[1]), i64(st[2]), o, delta, i32(h), i32(hv), i32(plan.max_nodes), i32(pcap6),
                    f32(scale), i32(int(use_qk_l2norm)), timeline6]

            grid6 = (vd // GROUPED_BV, h, plan.num_requests)
            cluster_kw = {"cluster": cluster} if cluster > 1 else {}

            def run_grouped() -> None:
                launch(k_grouped, grid6, (threads, 1, 1), args, shared_mem=smem6, **cluster_kw)

            # what the launch is, for benchmarks (bench/gdn_timeline.py: loader.max_active_clusters)
            run_grouped.kernel, run_grouped.config = k_grouped, (grid6, (threads, 1, 1), smem6, cluster)  # type: ignore[attr-defined]

            return [("gdn_tree_verify_grouped", run_grouped)], o, delta
        variant = 3  # version 6 does not take this call (grouped_unsupported_reason): version 3 does

    opts_common = ["--std=c++17", "-lineinfo", f"-DTFM_IN={DTYPE_CODE[v.dtype]}", f"-DGDN_K={kd}", f"-DGDN_V={vd}",
                   f"-DGDN_VARIANT={variant}"]
    pcap = _pair_capacity(plan)
    if block_v is None:
        props = torch.cuda.get_device_properties(dev_index)
        block_v = choose_block_v(plan, hv, kd, vd, device_smem_optin(dev_index), props.multi_processor_count,
                                 variant, q.dtype)
        if block_v is None:
            raise ValueError(
                f"a tree of {plan.max_nodes} nodes does not fit one CTA's shared memory "
                f"({verify_smem_bytes(kd, 16, plan.max_nodes, pcap, variant, q.dtype)} bytes at BV=16)"
            )
    if vd % block_v != 0:
        raise ValueError(f"block_v={block_v} must divide V={vd}")
    opts = opts_common + [f"-DGDN_BV={block_v}", *extra_options]
    k_pairs = get_kernel(VERIFY_SOURCE, "gdn_tree_pairs", opts, dev_index)
    k_main = get_kernel(VERIFY_SOURCE, "gdn_tree_verify_main", opts, dev_index)

    n_pairs = plan.num_pairs
    scratch = torch.empty(2 * hv * n_pairs + t_nodes * hv + 2 * h * t_nodes, dtype=torch.float32, device=dev)
    xs, ys, gcum, rk, rq = torch.split(scratch, [hv * n_pairs, hv * n_pairs, t_nodes * hv, h * t_nodes, h * t_nodes])
    pairs_args = [q, k, g32, b32, plan.perm, plan.pair_off, plan.pair_j, plan.depth, xs, ys, gcum, rk, rq,
                  i32(t_nodes), i32(h), i32(hv), i64(n_pairs), f32(scale), i32(int(use_qk_l2norm))]
    main_args = [q, k, v, b32, gcum, rk, rq, xs, ys, plan.perm, plan.pair_off, plan.pair_j, plan.depth, plan.cu,
                 ssm_state, sidx, i32(sidx64), i64(st[0]), i64(st[1]), i64(st[2]), o, delta,
                 i32(t_nodes), i32(h), i32(hv), i64(n_pairs), i32(plan.max_nodes), i32(pcap)]
    smem = verify_smem_bytes(kd, block_v, plan.max_nodes, pcap, variant, q.dtype)

    pdl = {"programmatic": True} if variant >= 5 else {}  # version 5: the main kernel overlaps the pairs kernel

    def run_pairs() -> None:
        launch(k_pairs, ((t_nodes + PAIRS_WARPS - 1) // PAIRS_WARPS, h, 1), (THREADS, 1, 1), pairs_args)

    def run_main() -> None:
        launch(k_main, (vd // block_v, hv, plan.num_requests), (THREADS, 1, 1), main_args, shared_mem=smem, **pdl)

    return [("gdn_tree_pairs", run_pairs), ("gdn_tree_verify_main", run_main)], o, delta


def gdn_tree_verify_planned(
    plan: TreePlan,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    ssm_state: Tensor,
    state_indices: Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    return_delta: bool = False,
    block_v: int | None = None,
    out: Tensor | None = None,
    delta_out: Tensor | None = None,
    variant: int = DEFAULT_VERIFY_VARIANT,
) -> Tensor | tuple[Tensor, Tensor]:
    """CUDA tree verify for a prebuilt plan. Shapes and result as ``vllm_tfm.verify.gdn.gdn_tree_verify``.

    q, k: [T, H, K], v: [T, HV, V] (one dtype); g, beta: [T, HV] (cast to float32);
    ssm_state: [slots, HV, V, K] float32 (read only); state_indices: [R] (int32 or int64).
    Returns o [T, HV, V] in v.dtype (and delta [T, HV, V] float32 when return_delta).
    block_v forces the V columns per CTA (16, 32 or 64); default :func:`choose_block_v`.
    out / delta_out: optional contiguous preallocated outputs ([T, HV, V], v.dtype / float32),
    written in full. variant: kernel version (1 to 8, default :data:`DEFAULT_VERIFY_VARIANT`); version 6
    uses 16 V columns per value head and CTA whatever block_v says, and runs version 3 (with block_v)
    for calls it does not take (:func:`grouped_unsupported_reason`).
    Inputs must be supported (the public wrapper checks); raises ValueError on a shape mismatch.
    """
    launches, o, delta = verify_launches(plan, q, k, v, g, beta, ssm_state, state_indices, scale, use_qk_l2norm,
                                         return_delta, block_v, out, delta_out, variant)
    for _, fn in launches:
        fn()
    return (o, delta) if return_delta else o


def gdn_tree_verify(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    parents: Tensor,
    cu_nodes: Tensor,
    ssm_state: Tensor,
    state_indices: Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    return_delta: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """GDN outputs of every tree node from the committed states (no state written).

    Same signature, shapes and result as ``vllm_tfm.verify.gdn.gdn_tree_verify``: q, k [T, H, K];
    v [T, HV, V]; g, beta [T, HV]; parents [T] local; cu_nodes [R+1]; ssm_state [slots, HV, V, K];
    state_indices [R]. Returns o [T, HV, V] in v.dtype (and delta [T, HV, V] float32).
    CUDA kernels when supported, else the torch reference.
    """
    reason = _verify_unsupported(q, k, v, ssm_state)
    if reason is None:
        _validate_verify(q, k, v, g, beta, parents, cu_nodes, ssm_state, state_indices)
        plan = TreePlan.build(parents, cu_nodes, device=v.device)
        dev_index = v.device.index if v.device.index is not None else torch.cuda.current_device()
        block_v = choose_block_v(plan, v.shape[1], q.shape[2], v.shape[2], device_smem_optin(dev_index),
                                 torch.cuda.get_device_properties(dev_index).multi_processor_count)
        if block_v is not None:
            return gdn_tree_verify_planned(
                plan, q, k, v, g, beta, ssm_state, state_indices, scale, use_qk_l2norm, return_delta, block_v
            )
        reason = f"a tree of {plan.max_nodes} nodes (depth {plan.max_depth}) does not fit one CTA's shared memory"
    from vllm_tfm.verify import gdn as reference

    if reason != NOT_CUDA:
        warn_fallback("gdn_tree_verify", reason)
    return reference.gdn_tree_verify(
        q, k, v, g, beta, parents, cu_nodes, ssm_state, state_indices, scale, use_qk_l2norm, return_delta
    )


def _validate_verify(q, k, v, g, beta, parents, cu_nodes, ssm_state, state_indices) -> None:
    """The reference's argument checks (same messages), without its math."""
    from vllm_tfm.verify.ragged_trees import check_slot_indices, request_bounds

    t_nodes, hv, vd = v.shape
    if k.dim() != 3 or k.shape[0] != t_nodes or q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape [T={t_nodes}, H, K]")
    kd = k.shape[2]
    if g.shape != (t_nodes, hv) or beta.shape != (t_nodes, hv):
        raise ValueError(f"g and beta must have shape [T={t_nodes}, HV={hv}], got {tuple(g.shape)} and {tuple(beta.shape)}")
    if ssm_state.shape[1:] != (hv, vd, kd):
        raise ValueError(f"ssm_state must have shape [num_slots, HV={hv}, V={vd}, K={kd}], got {tuple(ssm_state.shape)}")
    bounds = request_bounds(parents, cu_nodes, t_nodes)
    check_slot_indices(state_indices, len(bounds), ssm_state.shape[0], "state_indices")


# ---------------------------------------------------------------------------------------------
# commit


def _commit_unsupported(k: Tensor, delta: Tensor, ssm_state: Tensor) -> str | None:
    if not (k.is_cuda and delta.is_cuda and ssm_state.is_cuda):
        return NOT_CUDA
    if k.dtype not in DTYPE_CODE or delta.dtype != torch.float32 or ssm_state.dtype != torch.float32:
        return f"dtypes k {k.dtype}, delta {delta.dtype}, state {ssm_state.dtype}: the kernel takes float32 delta and state"
    if k.dim() != 3 or delta.dim() != 3 or ssm_state.dim() != 4:
        return "shapes are not [T, H, K] / [T, HV, V] / [slots, HV, V, K]"
    h, kd = k.shape[1], k.shape[2]
    hv, vd = delta.shape[1], delta.shape[2]
    if kd % 32 != 0 or vd % COMMIT_BV != 0 or hv % h != 0:
        return f"K={kd} must be a multiple of 32, V={vd} of {COMMIT_BV}, HV={hv} of H={h}"
    if ssm_state.stride(-1) != 1 or any(s % 4 for s in ssm_state.stride()[:3]) or not _is_16_aligned(ssm_state):
        return "ssm_state needs a contiguous last dimension, strides that are multiples of 4 and 16-byte alignment"
    return kernels_unavailable_reason(delta.device.index)


def gdn_tree_commit_planned(
    plan: TreePlan,
    k: Tensor,
    g: Tensor,
    delta: Tensor,
    idx: CommitIndices,
    ssm_state: Tensor,
    use_qk_l2norm: bool = True,
) -> None:
    """CUDA commit for a prebuilt plan and commit indices (no host synchronisation; graph-capturable).

    k [T, H, K] (float32/bfloat16/float16); g [T, HV]; delta [T, HV, V] float32;
    ssm_state [slots, HV, V, K] float32, written in place at ``idx.dst``.
    """
    dev = delta.device
    dev_index = dev.index if dev.index is not None else torch.cuda.current_device()
    _, h, kd = k.shape
    hv, vd = delta.shape[1], delta.shape[2]
    k = k.contiguous()
    delta = delta.contiguous()
    g32 = g if g.dtype == torch.float32 and g.is_contiguous() else g.to(torch.float32).contiguous()
    src_state = ssm_state if idx.snapshot is None else ssm_state[idx.snapshot].contiguous()
    m_cap = plan.max_depth + 1
    opts = ["--std=c++17", "-lineinfo", f"-DTFM_IN={DTYPE_CODE[k.dtype]}", f"-DGDN_K={kd}", f"-DGDN_V={vd}"]
    kern = get_kernel(COMMIT_SOURCE, "gdn_tree_commit", opts, dev_index)
    ss, ds = src_state.stride(), ssm_state.stride()
    i32, i64 = ctypes.c_int, ctypes.c_longlong
    launch(
        kern,
        (vd // COMMIT_BV, hv, plan.num_requests),
        (COMMIT_THREADS, 1, 1),
        [k, g32, delta, plan.cu, plan.pos, plan.depth, plan.pair_off, plan.pair_j, idx.accepted,
         src_state, idx.src, i64(ss[0]), i64(ss[1]), i64(ss[2]),
         ssm_state, idx.dst, i64(ds[0]), i64(ds[1]), i64(ds[2]),
         i32(h), i32(hv), i32(m_cap), i32(int(use_qk_l2norm))],
        shared_mem=commit_smem_bytes(kd, m_cap),
    )


def _checked_commit_args(
    k: Tensor, g: Tensor, delta: Tensor, parents: Tensor, cu_nodes: Tensor, accepted: Tensor, ssm_state: Tensor,
    src_indices: Tensor, dst_indices: Tensor,
) -> tuple[list[int], list[int], list[int]]:
    """The reference's checks of a commit's arguments (host copies of the indices): (accepted, src, dst)."""
    from vllm_tfm.verify.ragged_trees import check_per_request, check_slot_indices, request_bounds

    t_nodes, hv, vd = delta.shape
    if k.dim() != 3 or k.shape[0] != t_nodes:
        raise ValueError(f"k must have shape [T={t_nodes}, H, K], got {tuple(k.shape)}")
    if g.shape != (t_nodes, hv):
        raise ValueError(f"g must have shape [T={t_nodes}, HV={hv}], got {tuple(g.shape)}")
    if ssm_state.shape[1:] != (hv, vd, k.shape[2]):
        raise ValueError(
            f"ssm_state must have shape [num_slots, HV={hv}, V={vd}, K={k.shape[2]}], got {tuple(ssm_state.shape)}"
        )
    bounds = request_bounds(parents, cu_nodes, t_nodes)
    nreq = len(bounds)
    src = check_slot_indices(src_indices, nreq, ssm_state.shape[0], "src_indices")
    dst = check_slot_indices(dst_indices, nreq, ssm_state.shape[0], "dst_indices", distinct=True)
    acc = check_per_request(accepted, nreq, "accepted")
    for r, ((s, e), a) in enumerate(zip(bounds, acc)):
        if not 0 <= a < e - s:
            raise ValueError(f"accepted[{r}] = {a} is not a node of request {r} (it has {e - s} nodes)")
    return acc, src, dst


def gdn_tree_commit(
    k: Tensor,
    g: Tensor,
    delta: Tensor,
    parents: Tensor,
    cu_nodes: Tensor,
    accepted: Tensor,
    ssm_state: Tensor,
    src_indices: Tensor,
    dst_indices: Tensor,
    use_qk_l2norm: bool = True,
) -> None:
    """Advance each request's GDN state along its accepted path, in place.

    Same signature and semantics as ``vllm_tfm.verify.gdn.gdn_tree_commit``: k [T, H, K];
    g [T, HV]; delta [T, HV, V]; parents [T] local; cu_nodes [R+1]; accepted [R] local node;
    ssm_state [slots, HV, V, K]; src_indices, dst_indices [R] (dst distinct).
    CUDA kernel when supported, else the torch reference.
    """
    reason = _commit_unsupported(k, delta, ssm_state)
    if reason is None:
        acc, src, dst = _checked_commit_args(k, g, delta, parents, cu_nodes, accepted, ssm_state, src_indices, dst_indices)
        plan = TreePlan.build(parents, cu_nodes, device=delta.device)
        idx = CommitIndices.build(acc, src, dst, delta.device)
        gdn_tree_commit_planned(plan, k, g, delta, idx, ssm_state, use_qk_l2norm)
        return
    from vllm_tfm.verify import gdn as reference

    if reason != NOT_CUDA:
        warn_fallback("gdn_tree_commit", reason)
    reference.gdn_tree_commit(
        k, g, delta, parents, cu_nodes, accepted, ssm_state, src_indices, dst_indices, use_qk_l2norm
    )
