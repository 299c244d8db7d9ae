"""Gated DeltaNet (GDN) on a token tree: the exact torch reference (DESIGN.md section 4).

Kernels (CUDA, Triton) and the vLLM plugin are checked against these functions. Conventions are
vLLM 0.26's (``fused_sigmoid_gating_delta_rule_update`` and ``GatedDeltaNetAttention._forward_core``):

* per value head h (HV of them) the q/k head is ``h // (HV // H)`` (GVA grouping);
* ``g = -exp(A_log) * softplus(a + dt_bias)`` (softplus linear above 20), ``beta = sigmoid(b)``;
* q and k are L2-normalised as ``x * rsqrt(sum x^2 + 1e-6)``, then q is multiplied by ``scale``
  (default ``K ** -0.5``);
* the recurrent state is V-first, ``S[v, k]`` (state pool ``[num_slots, HV, V, K]``), so the chain
  recurrence reads ``S <- e^g S; delta = beta (v - S k); S <- S + delta k^T; o = S q``.

Tree verify (exact, no state written). Per request and value head, with M the ancestor-or-self
mask (M[i, j] = 1 iff j is on the root..i path), Ms = M - I, path gates G = M g:

    X = Ms * diag(beta) * exp(G_i - G_j) * (k_i . k_j)
    Y = M  * exp(G_i - G_j) * (q_i . k_j)
    (I + X) Delta = diag(beta) (V - diag(e^G) K S0^T)     (row i: beta_i (v_i - e^{G_i} S0 k_i))
    O = diag(e^G) Q S0^T + Y Delta                         (row i: e^{G_i} S0 q_i + sum_j Y_ij delta_j)

Commit of accepted node a: ``S* = e^{G_a} S0 + sum_{j in P(a)} e^{G_a - G_j} delta_j k_j^T``.

The algebra is the tree generalisation of the WY/UT form of the chunked delta rule (Yang et al.,
"Gated Delta Networks", arXiv 2412.06464; flash-linear-attention's chunk form), as used for tree
verification by the "Trees from Marginals" paper; this file is our own implementation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_tfm.tree.types import ancestor_mask
from vllm_tfm.verify.ragged_trees import check_per_request, check_slot_indices, path_to_root, request_bounds

__all__ = [
    "TILE",
    "gdn_gates",
    "gate_constants",
    "gdn_chain_recurrence",
    "gdn_chain_chunked",
    "gdn_tree_verify",
    "gdn_tree_commit",
    "gdn_tree_commit_layers",
]

TILE = 64
"""Rows per tile of the blocked forward substitution (the kernel's tile height)."""

SOFTPLUS_THRESHOLD = 20.0
L2NORM_EPS = 1e-6


def _math_dtype(*tensors: Tensor | None) -> torch.dtype:
    """float64 when any input is float64, else float32 (bf16/fp16 inputs get fp32 math)."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _l2norm(x: Tensor) -> Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _prepare_qk(
    q: Tensor | None, k: Tensor, hv: int, dtype: torch.dtype, scale: float | None, use_qk_l2norm: bool
) -> tuple[Tensor | None, Tensor]:
    """Cast to ``dtype``, L2-normalise, scale q, and expand the H q/k heads to HV value heads.

    q, k: [T, H, K] -> [T, HV, K] (value head h reads q/k head h // (HV // H)).
    """
    h, kd = k.shape[1], k.shape[2]
    group = hv // h
    k = k.to(dtype)
    if use_qk_l2norm:
        k = _l2norm(k)
    k = k.repeat_interleave(group, dim=1)
    if q is not None:
        q = q.to(dtype)
        if use_qk_l2norm:
            q = _l2norm(q)
        q = q * (kd**-0.5 if scale is None else scale)
        q = q.repeat_interleave(group, dim=1)
    return q, k


def _check_heads(q: Tensor | None, k: Tensor, v_heads: int, tokens: int) -> tuple[int, int]:
    """Validate q/k [T, H, K] against HV; return (H, K)."""
    if k.dim() != 3 or k.shape[0] != tokens:
        raise ValueError(f"k must have shape [T={tokens}, H, K], got {tuple(k.shape)}")
    if q is not None and q.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same shape [T, H, K]")
    h, kd = k.shape[1], k.shape[2]
    if v_heads % h != 0:
        raise ValueError(f"the number of value heads HV={v_heads} must be a multiple of the q/k heads H={h}")
    return h, kd


def _check_gate(x: Tensor, name: str, tokens: int, v_heads: int) -> None:
    if x.shape != (tokens, v_heads):
        raise ValueError(f"{name} must have shape [T={tokens}, HV={v_heads}], got {tuple(x.shape)}")


def gate_constants(A_log: Tensor, dt_bias: Tensor, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """The parts of :func:`gdn_gates` that only depend on the layer: (-exp(A_log), dt_bias), both in
    ``dtype`` (the gates' math dtype: float32, or float64 for float64 inputs), [HV]."""
    return -torch.exp(A_log.to(dtype)), dt_bias.to(dtype)


def gdn_gates(
    a: Tensor, b: Tensor, A_log: Tensor, dt_bias: Tensor, constants: tuple[Tensor, Tensor] | None = None
) -> tuple[Tensor, Tensor]:
    """Log-decay g and write strength beta from the raw projections, as vLLM computes them.

    a, b: [T, HV] (any float dtype); A_log, dt_bias: [HV].
    Returns g = -exp(A_log) * softplus(a + dt_bias) (softplus(x) = x for x > 20, vLLM's threshold)
    and beta = sigmoid(b), both [T, HV] in float32 (float64 when a is float64).
    constants: :func:`gate_constants` of (A_log, dt_bias) computed once by the caller (a layer's
    parameters do not change between steps); the same values either way. Constants of another
    dtype than the math dtype are recomputed.
    """
    if a.dim() != 2 or b.shape != a.shape:
        raise ValueError(f"a and b must both have shape [T, HV], got {tuple(a.shape)} and {tuple(b.shape)}")
    hv = a.shape[1]
    if A_log.shape != (hv,) or dt_bias.shape != (hv,):
        raise ValueError(
            f"A_log and dt_bias must have shape [HV={hv}], got {tuple(A_log.shape)} and {tuple(dt_bias.shape)}"
        )
    dtype = torch.float64 if a.dtype == torch.float64 else torch.float32
    if constants is None or constants[0].dtype != dtype or constants[1].dtype != dtype:
        constants = gate_constants(A_log, dt_bias, dtype)
    neg_exp_a, dt_bias_c = constants
    # a + dt_bias in the math dtype: a lower-precision a is widened exactly inside the add (one kernel)
    x = (a if a.dtype in _WIDENED[dtype] else a.to(dtype)) + dt_bias_c
    g = neg_exp_a * F.softplus(x, beta=1.0, threshold=SOFTPLUS_THRESHOLD)
    beta = torch.sigmoid(b.to(dtype))
    return g, beta


_WIDENED = {  # input dtypes that an add with a tensor of the key dtype promotes to it exactly
    torch.float32: (torch.float32, torch.bfloat16, torch.float16),
    torch.float64: (torch.float64,),
}


def _chain_inputs(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state0: Tensor, scale: float | None, use_qk_l2norm: bool
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Validated inputs of one sequence in the math dtype: (q, k expanded to HV heads, v, g, beta, a
    copy of state0). Raises ValueError on a shape mismatch."""
    length = v.shape[0]
    if v.dim() != 3:
        raise ValueError(f"v must have shape [L, HV, V], got {tuple(v.shape)}")
    hv, vd = v.shape[1], v.shape[2]
    _, kd = _check_heads(q, k, hv, length)
    _check_gate(g, "g", length, hv)
    _check_gate(beta, "beta", length, hv)
    if state0.shape != (hv, vd, kd):
        raise ValueError(f"state0 must have shape [HV={hv}, V={vd}, K={kd}], got {tuple(state0.shape)}")
    dtype = _math_dtype(q, k, v, g, beta, state0)
    qe, ke = _prepare_qk(q, k, hv, dtype, scale, use_qk_l2norm)
    assert qe is not None
    return qe, ke, v.to(dtype), g.to(dtype), beta.to(dtype), state0.to(dtype).clone()


def gdn_chain_recurrence(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state0: Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[Tensor, Tensor]:
    """The plain per-token gated delta rule over ONE sequence: the oracle for everything else.

    Mirrors vLLM's ``fused_sigmoid_gating_delta_rule_update`` kernel step for step, per value head:
    ``S <- e^{g_t} S; delta_t = beta_t (v_t - S k_t); S <- S + delta_t k_t^T; o_t = S q_t``.

    q, k: [L, H, K]; v: [L, HV, V]; g, beta: [L, HV]; state0: [HV, V, K] (V-first).
    Math in float32 (float64 when any input is float64). Returns o [L, HV, V] in v.dtype and the
    final state [HV, V, K] in state0.dtype. state0 is not modified.
    """
    qe, ke, ve, ge, be, state = _chain_inputs(q, k, v, g, beta, state0, scale, use_qk_l2norm)
    length, hv, vd, dtype = ve.shape[0], ve.shape[1], ve.shape[2], ve.dtype
    out = torch.empty(length, hv, vd, dtype=dtype, device=v.device)
    decay = torch.exp(ge)  # [L, HV]
    for t in range(length):
        state = state * decay[t][:, None, None]
        d = be[t][:, None] * (ve[t] - (state * ke[t][:, None, :]).sum(-1))  # S k: a V vector
        state = state + d[:, :, None] * ke[t][:, None, :]
        out[t] = (state * qe[t][:, None, :]).sum(-1)
    return out.to(v.dtype), state.to(state0.dtype)


def gdn_chain_chunked(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    state0: Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk: int = TILE,
) -> tuple[Tensor, Tensor]:
    """:func:`gdn_chain_recurrence` (same arguments and result) in chunks of ``chunk`` tokens.

    The tree verify algebra of the module docstring on a chain: per chunk and value head, with
    G the cumulative gates inside the chunk and S the state entering it,
    ``(I + X) Delta = diag(beta) (V - diag(e^G) K S^T)`` (X strictly lower), solved with one
    triangular solve; ``O = diag(e^G) Q S^T + Y Delta``; the state leaving the chunk is
    ``e^{G_C} S + sum_j e^{G_C - G_j} delta_j k_j^T``. About 20 tensor operations per chunk instead
    of about 10 per token: what makes float32 prefill usable (``fp32_prefill.py``). Equal to the
    per-token recurrence up to rounding (tested in float64).
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    qe, ke, ve, ge, be, state = _chain_inputs(q, k, v, g, beta, state0, scale, use_qk_l2norm)  # state [HV, V, K]
    length, hv, vd, dtype = ve.shape[0], ve.shape[1], ve.shape[2], ve.dtype
    # head-major: [HV, L, .]
    qh, kh, vh, gh, bh = qe.transpose(0, 1), ke.transpose(0, 1), ve.transpose(0, 1), ge.transpose(0, 1), be.transpose(0, 1)
    out = torch.empty(hv, length, vd, dtype=dtype, device=v.device)
    for s in range(0, length, chunk):
        e = min(s + chunk, length)
        n = e - s
        qc, kc, vc, bc = qh[:, s:e], kh[:, s:e], vh[:, s:e], bh[:, s:e]
        # G in float64: differences of long cumulative sums of strong gates lose float32 digits
        big_g = gh[:, s:e].to(torch.float64).cumsum(-1)  # [HV, n]
        decay = torch.exp(big_g[:, :, None] - big_g[:, None, :]).to(dtype)  # e^{G_i - G_j}; used where j <= i
        ones = torch.ones(n, n, dtype=torch.bool, device=v.device)
        decay = decay.masked_fill(~ones.tril(), 0.0)  # (j > i would overflow: masked, not multiplied)
        x = (bc[:, :, None] * decay * (kc @ kc.transpose(-1, -2))).masked_fill(~ones.tril(-1), 0.0)
        eg = torch.exp(big_g).to(dtype)  # [HV, n]
        rhs = bc[:, :, None] * (vc - eg[:, :, None] * (kc @ state.transpose(-1, -2)))  # [HV, n, V]
        ident = torch.eye(n, dtype=dtype, device=v.device)
        delta = torch.linalg.solve_triangular(ident + x, rhs, upper=False, unitriangular=True)
        y = decay * (qc @ kc.transpose(-1, -2))  # [HV, n, n], j <= i
        out[:, s:e] = eg[:, :, None] * (qc @ state.transpose(-1, -2)) + y @ delta
        last = big_g[:, -1:]  # [HV, 1]
        w = torch.exp(last - big_g).to(dtype)  # e^{G_C - G_j}: [HV, n]
        state = torch.exp(last).to(dtype)[:, :, None] * state + (w[:, :, None] * delta).transpose(-1, -2) @ kc
    return out.transpose(0, 1).to(v.dtype), state.to(state0.dtype)


def _tiled_forward_substitution(x: Tensor, rhs: Tensor, strict_anc: Tensor, tile: int = TILE) -> Tensor:
    """Solve (I + X) Delta = rhs by blocked forward substitution over the whole n x n system.

    x: [HV, n, n], zero outside strict-ancestor pairs (so strictly lower triangular, since a
    parent precedes its child); rhs: [HV, n, V]; strict_anc: [n, n] bool (j strict ancestor of i).

    Tile t covers rows a:b (``tile`` rows). Its right-hand side first loses the contribution of
    every earlier tile u that holds at least one ancestor pair with it (tiles without one are
    skipped: their block of X is zero), then the diagonal block (I + X[a:b, a:b]), unit lower
    triangular, is solved by forward substitution. Chunk-to-chunk state passing, as in the chain
    chunk form, does not exist on a tree, hence the substitution over the whole system.
    """
    n = x.shape[-1]
    delta = torch.empty_like(rhs)
    for a in range(0, n, tile):
        b = min(a + tile, n)
        acc = rhs[:, a:b].clone()
        for c in range(0, a, tile):
            d = c + tile
            if bool(strict_anc[a:b, c:d].any()):
                acc = acc - x[:, a:b, c:d] @ delta[:, c:d]
        if bool(strict_anc[a:b, a:b].any()):
            eye = torch.eye(b - a, dtype=x.dtype, device=x.device)
            acc = torch.linalg.solve_triangular(eye + x[:, a:b, a:b], acc, upper=False, unitriangular=True)
        delta[:, a:b] = acc
    return delta


def _verify_one_tree(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, parents: Tensor, state0: Tensor
) -> tuple[Tensor, Tensor]:
    """One request, all value heads at once.

    q, k: [n, HV, K] (normalised, q scaled, already expanded to HV); v: [n, HV, V]; g, beta: [n, HV];
    parents: [n] local; state0: [HV, V, K]. All in the math dtype. Returns O, Delta: [n, HV, V].
    """
    n = parents.numel()
    anc = ancestor_mask(parents.to("cpu")).to(v.device)  # [n, n] ancestor-or-self
    strict = anc & ~torch.eye(n, dtype=torch.bool, device=v.device)
    gh = (anc.to(g.dtype) @ g).transpose(0, 1)  # [HV, n] path gates G = M g
    # Mask the exponent BEFORE exp: off the ancestor pairs G_i - G_j can be large and positive
    # (siblings, cousins) and exp would overflow; exp(-inf) = 0 exactly, no inf * 0.
    expo = torch.where(anc, gh[:, :, None] - gh[:, None, :], torch.full_like(gh[:, :1, None], float("-inf")))
    decay = torch.exp(expo)  # [HV, n, n], exp(G_i - G_j) on ancestor-or-self pairs, else 0
    qh, kh, vh = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [HV, n, *]
    bh = beta.transpose(0, 1)  # [HV, n]
    x = torch.where(strict, bh[:, :, None] * decay * (kh @ kh.mT), torch.zeros((), dtype=v.dtype, device=v.device))
    y = decay * (qh @ kh.mT)
    eg = torch.exp(gh)[:, :, None]  # [HV, n, 1]
    s0t = state0.mT  # [HV, K, V]: row k_i @ S0^T = S0 k_i, a V vector
    rhs = bh[:, :, None] * (vh - eg * (kh @ s0t))
    delta = _tiled_forward_substitution(x, rhs, strict)
    out = eg * (qh @ s0t) + y @ delta
    return out.transpose(0, 1), delta.transpose(0, 1)


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
    """GDN outputs of every node of a ragged batch of trees, from the committed states; writes nothing.

    q, k: [T, H, K]; v: [T, HV, V]; g, beta: [T, HV] (from ``gdn_gates``); parents: [T] local
    (-1 at roots); cu_nodes: [R+1]; ssm_state: [num_slots, HV, V, K] (V-first);
    state_indices: [R], the slot holding each request's committed state S0 (slots may repeat).

    Node i's output equals the chain recurrence run from S0 over its root..i path. Math in float32
    (float64 when any input is float64). Returns o [T, HV, V] in v.dtype, and with return_delta
    also delta [T, HV, V] in the math dtype (the input of ``gdn_tree_commit``).
    """
    tokens = v.shape[0]
    if v.dim() != 3:
        raise ValueError(f"v must have shape [T, HV, V], got {tuple(v.shape)}")
    hv, vd = v.shape[1], v.shape[2]
    _, kd = _check_heads(q, k, hv, tokens)
    _check_gate(g, "g", tokens, hv)
    _check_gate(beta, "beta", tokens, hv)
    if ssm_state.dim() != 4 or ssm_state.shape[1:] != (hv, vd, kd):
        raise ValueError(
            f"ssm_state must have shape [num_slots, HV={hv}, V={vd}, K={kd}], got {tuple(ssm_state.shape)}"
        )
    bounds = request_bounds(parents, cu_nodes, tokens)
    slots = check_slot_indices(state_indices, len(bounds), ssm_state.shape[0], "state_indices")

    dtype = _math_dtype(q, k, v, g, beta, ssm_state)
    qe, ke = _prepare_qk(q, k, hv, dtype, scale, use_qk_l2norm)
    ve, ge, be = v.to(dtype), g.to(dtype), beta.to(dtype)
    out = torch.empty(tokens, hv, vd, dtype=dtype, device=v.device)
    delta = torch.empty(tokens, hv, vd, dtype=dtype, device=v.device)
    for (s, e), slot in zip(bounds, slots):
        state0 = ssm_state[slot].to(dtype)  # read only
        out[s:e], delta[s:e] = _verify_one_tree(qe[s:e], ke[s:e], ve[s:e], ge[s:e], be[s:e], parents[s:e], state0)
    out = out.to(v.dtype)
    return (out, delta) if return_delta else out


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
    """Advance each request's GDN state along its accepted root..a path, in place.

    k: [T, H, K] (raw, normalised here when use_qk_l2norm, as in verify); g: [T, HV];
    delta: [T, HV, V] from ``gdn_tree_verify(..., return_delta=True)``; parents: [T] local;
    cu_nodes: [R+1]; accepted: [R] local index of the deepest accepted node (0 = only the root);
    ssm_state: [num_slots, HV, V, K]; src_indices, dst_indices: [R] slots (dst distinct).

    ssm_state[dst[r]] = e^{G_a} S0 + sum_{j in P(a)} e^{G_a - G_j} delta_j k_j^T with
    S0 = ssm_state[src[r]]; every S0 is read before any slot is written, so src and dst may
    alias within a request and across requests. Math in float32 (float64 when any input is).
    """
    tokens = delta.shape[0]
    if delta.dim() != 3:
        raise ValueError(f"delta must have shape [T, HV, V], got {tuple(delta.shape)}")
    hv, vd = delta.shape[1], delta.shape[2]
    _, kd = _check_heads(None, k, hv, tokens)
    _check_gate(g, "g", tokens, hv)
    if ssm_state.dim() != 4 or ssm_state.shape[1:] != (hv, vd, kd):
        raise ValueError(
            f"ssm_state must have shape [num_slots, HV={hv}, V={vd}, K={kd}], got {tuple(ssm_state.shape)}"
        )
    bounds = request_bounds(parents, cu_nodes, tokens)
    nreq = len(bounds)
    src = check_slot_indices(src_indices, nreq, ssm_state.shape[0], "src_indices")
    dst = check_slot_indices(dst_indices, nreq, ssm_state.shape[0], "dst_indices", distinct=True)
    acc = check_per_request(accepted, nreq, "accepted")
    for r, ((s, e), a) in enumerate(zip(bounds, acc)):
        if not 0 <= a < e - s:
            raise ValueError(f"accepted[{r}] = {a} is not a node of request {r} (it has {e - s} nodes)")

    dtype = _math_dtype(k, g, delta, ssm_state)
    _, ke = _prepare_qk(None, k, hv, dtype, None, use_qk_l2norm)
    ge, de = g.to(dtype), delta.to(dtype)
    # Advanced indexing copies: every S0 is read here, before any slot is written below.
    state0 = ssm_state[torch.tensor(src, dtype=torch.long, device=ssm_state.device)].to(dtype)
    new_states = torch.empty_like(state0)
    for r, ((s, e), a) in enumerate(zip(bounds, acc)):
        path = torch.tensor(path_to_root(parents[s:e].tolist(), a), dtype=torch.long, device=delta.device) + s
        gp = ge[path]  # [d+1, HV], root first
        # Suffix sums along the path: incl[j] = G_a - G_{p(j)}, excl[j] = G_a - G_j (no cancellation).
        incl = gp.flip(0).cumsum(0).flip(0)
        excl = torch.cat([incl[1:], torch.zeros_like(incl[:1])])
        new_states[r] = torch.exp(incl[0])[:, None, None] * state0[r] + torch.einsum(
            "jh,jhv,jhk->hvk", torch.exp(excl), de[path], ke[path]
        )
    ssm_state[torch.tensor(dst, dtype=torch.long, device=ssm_state.device)] = new_states.to(ssm_state.dtype)


def gdn_tree_commit_layers(
    k: Sequence[Tensor],
    g: Sequence[Tensor],
    delta: Sequence[Tensor],
    parents: Tensor,
    cu_nodes: Tensor,
    accepted: Tensor,
    ssm_state: Sequence[Tensor],
    src_indices: Sequence[Tensor],
    dst_indices: Sequence[Tensor],
    use_qk_l2norm: bool = True,
) -> None:
    """:func:`gdn_tree_commit` of several layers that share one tree batch and accepted nodes.

    Entry ``i`` of each sequence is layer i's argument of :func:`gdn_tree_commit` (the layers may
    belong to different KV-cache groups, hence per-layer slots). The layers are committed one
    after the other; a batched implementation may run them at once, which gives the same states
    when no layer's destination slot rows are another layer's source rows in memory.
    """
    n = len(k)
    if not (len(g) == len(delta) == len(ssm_state) == len(src_indices) == len(dst_indices) == n):
        raise ValueError(
            "k, g, delta, ssm_state, src_indices and dst_indices must have one entry per layer, got "
            f"{[len(k), len(g), len(delta), len(ssm_state), len(src_indices), len(dst_indices)]}"
        )
    for i in range(n):
        gdn_tree_commit(k[i], g[i], delta[i], parents, cu_nodes, accepted, ssm_state[i], src_indices[i],
                        dst_indices[i], use_qk_l2norm)
