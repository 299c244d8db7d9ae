"""One Weaver step of the batched tree scorer in few device kernels (inference only).

``BatchedWeaverTreeScorer`` runs one Weaver step per growth round for R x w new nodes; each round
is ~100 small kernels when it goes through the modules' own forward code (an RMSNorm with weight
and bias is 7 elementwise kernels, RoPE 5, einsum attention copies its operands into matmul
layouts). The same function here, with weights folded once per weight version:

* RMSNorm-with-bias followed by a linear layer: ``W (x_hat * g + b) = (W diag g) x_hat + W b``,
  so the pair is ``F.rms_norm`` (no affine; one fused kernel on CUDA) and one ``addmm`` with the
  folded weight and bias;
* residual adds ride in ``addmm`` (``x + o_proj(a)`` = ``addmm(x, a, W_o^T)``, likewise ``down``);
* RoPE: the qkv projection also emits ``rotate_half`` of q and k (the same rows of the weight,
  permuted and negated; zero rows for v), so the rotation is ``qkv * cos + rot * sin`` (one
  ``mul`` and one ``addcmul_``, with cos = 1 and sin = 0 for v), written straight into a
  ``[3, R, heads, w, head_dim]`` buffer: q is in the layout attention wants and k / v land in the
  per-layer cache ``[2, R, heads, S, head_dim]`` with ONE scatter;
* attention: ``F.scaled_dot_product_attention`` with an additive float mask (0 = visible, -inf)
  kept per node slot and padded to a multiple of 16 columns (aligned: CUDA's memory-efficient
  kernel takes it without a copy).

The arithmetic is the same function in a different order (folded weights, fused reductions, an
online softmax), so scores agree with the module path to float32 rounding (~1e-6), not bit for bit.

Weight-only FP8 (``Weaver.fp8_weights``, the tfm option ``weaver_weights: "fp8"``): every folded
projection is rounded to e4m3 with one scale per output row (``kernels.weaver_linear.quantize_weight_rows``)
and the folded weights hold those values (dequantized to the Weaver's dtype), so every path computes the
same function; the e4m3 bytes and scales ride beside them (``Fp8Rows``) for the fused kernel, which
reads half the bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from .common import RMSNormWithBias, compute_dtype

__all__ = ["Fp8Rows", "FoldedBlock", "FoldedWeaver", "fold_norm", "folded_weaver", "fp8_rows_values", "norm_linear",
           "prompt_pass", "rope_table"]


@dataclass(frozen=True)
class Fp8Rows:
    """A folded projection as e4m3 bytes [out, in] with one float32 scale per output row [out]."""

    q: Tensor
    scale: Tensor


@dataclass(frozen=True)
class FoldedBlock:
    """One Weaver block with its norms folded into the following projections.

    Weights are stored transposed ([in, out] views, as ``addmm`` takes them: no per-call ``t()``).
    qkv_rot: [d, 6 d], outputs (q, k, v, rotate_half(q), rotate_half(k), 0) of ``qkv`` after
    ``attn_norm``; qkv_rot_bias [6 d]. o_proj: [d, d]. gate_up [d, 2 d_mlp] / gate_up_bias after
    ``mlp_norm``; down [d_mlp, d]. eps: the two norms' epsilons.
    """

    qkv_rot: Tensor
    qkv_rot_bias: Tensor
    attn_eps: float
    o_proj: Tensor
    gate_up: Tensor
    gate_up_bias: Tensor
    mlp_eps: float
    down: Tensor
    # weight-only FP8 (module docstring): the same projections' e4m3 rows, or None
    qkv_rot_fp8: Fp8Rows | None = None
    o_proj_fp8: Fp8Rows | None = None
    gate_up_fp8: Fp8Rows | None = None
    down_fp8: Fp8Rows | None = None


@dataclass(frozen=True)
class FoldedWeaver:
    """The Weaver's inference weights for ``BatchedWeaverTreeScorer`` (``folded_weaver``)."""

    proposal_in: Tensor  # [H, d] (transposed), output_norm folded in: the prompt's input projection
    proposal_in_bias: Tensor  # [d]
    output_eps: float
    token_in: Tensor  # [H, d] (transposed), embed_norm folded in
    token_in_bias: Tensor  # [d]
    embed_eps: float
    layers: tuple[FoldedBlock, ...]
    query: Tensor  # [d, H] (transposed), out_norm folded into lm_head_query_in
    query_bias: Tensor  # [H]
    out_eps: float
    token_in_fp8: Fp8Rows | None = None  # weight-only FP8 (module docstring), or None
    query_fp8: Fp8Rows | None = None


def fold_norm(norm: RMSNormWithBias, weight: Tensor) -> tuple[Tensor, Tensor]:
    """``weight @ (x_hat * g + b)`` = ``(weight * g) @ x_hat + weight @ b``: (folded weight, bias),
    computed in float32 (float64 for float64 weights) and returned in the weight's dtype."""
    cd = compute_dtype(weight.dtype)
    w, g, b = weight.to(cd), norm.weight.to(cd), norm.bias.to(cd)
    return (w * g).to(weight.dtype), (w @ b).to(weight.dtype)


def _rotate_rows(rows: Tensor, n_heads: int, head_dim: int) -> Tensor:
    """Rows [n_heads * head_dim, ...] of a projection -> the rows that give ``rotate_half`` of its
    output per head: ``(-x2, x1)`` for ``x = (x1, x2)``."""
    r = rows.unflatten(0, (n_heads, head_dim))
    half = head_dim // 2
    return torch.cat([-r[:, half:], r[:, :half]], dim=1).flatten(0, 1)


def _fold_block(layer) -> FoldedBlock:
    d, heads, hd = layer.qkv.weight.shape[1], layer.n_heads, layer.head_dim
    w, b = fold_norm(layer.attn_norm, layer.qkv.weight)
    rot_w = torch.cat([_rotate_rows(w[:d], heads, hd), _rotate_rows(w[d : 2 * d], heads, hd), torch.zeros_like(w[:d])])
    rot_b = torch.cat([_rotate_rows(b[:d], heads, hd), _rotate_rows(b[d : 2 * d], heads, hd), torch.zeros_like(b[:d])])
    gu, gu_b = fold_norm(layer.mlp_norm, layer.gate_up.weight)
    return FoldedBlock(
        qkv_rot=torch.cat([w, rot_w]).contiguous().t(),
        qkv_rot_bias=torch.cat([b, rot_b]).contiguous(),
        attn_eps=layer.attn_norm.eps,
        o_proj=layer.o_proj.weight.t(),
        gate_up=gu.contiguous().t(),
        gate_up_bias=gu_b.contiguous(),
        mlp_eps=layer.mlp_norm.eps,
        down=layer.down.weight.t(),
    )


def fp8_rows_values(weight: Tensor) -> tuple[Tensor, Fp8Rows]:
    """A weight [out, in] -> (its values rounded to e4m3 rows, in its dtype; the rows): the rounding of
    ``Weaver.fp8_weights`` (``reference.fp8_sim.simulate_fp8_weaver_rows`` applies the same to the modules)."""
    from vllm_tfm.kernels.weaver_linear import dequantize_weight_rows, quantize_weight_rows

    q, scale = quantize_weight_rows(weight)
    return dequantize_weight_rows(q, scale, weight.dtype), Fp8Rows(q, scale)


def _fp8_pair(weight_t: Tensor) -> tuple[Tensor, Fp8Rows]:
    """A folded weight [in, out] (transposed view) -> (its e4m3-rounded values, same layout and dtype; the rows)."""
    values, rows = fp8_rows_values(weight_t.t())
    return values.t(), rows


def _fp8_folded(folded: FoldedWeaver) -> FoldedWeaver:
    """``folded`` with every projection rounded to e4m3 rows (the projections' values replaced, the rows beside)."""
    layers = []
    for lw in folded.layers:
        (qkv, qkv8), (o, o8), (gu, gu8), (dn, dn8) = (_fp8_pair(t) for t in (lw.qkv_rot, lw.o_proj, lw.gate_up, lw.down))
        layers.append(replace(lw, qkv_rot=qkv, o_proj=o, gate_up=gu, down=dn, qkv_rot_fp8=qkv8, o_proj_fp8=o8,
                              gate_up_fp8=gu8, down_fp8=dn8))
    # proposal_in: rounded values only (the prompt pass's 1 + D rows per request run cuBLAS, never the FP8 kernel)
    (prop, _), (tok, tok8), (qry, qry8) = (_fp8_pair(t) for t in (folded.proposal_in, folded.token_in, folded.query))
    return replace(folded, proposal_in=prop, token_in=tok, query=qry, layers=tuple(layers), token_in_fp8=tok8,
                   query_fp8=qry8)


def _weights_key(weaver) -> tuple:
    """Identity and version of every parameter (host-side only; inference tensors have no version
    counter, and their data does not change in place outside inference mode)."""
    key = []
    for p in weaver.parameters():
        try:
            version = p._version
        except RuntimeError:
            version = -1
        key.append((p.data_ptr(), version, p.dtype, p.device))
    return tuple(key)


def folded_weaver(weaver) -> FoldedWeaver:
    """The folded weights of ``weaver``, computed once per version of its parameters and cached on
    the module (a weight updated in place, a dtype or device change: folded again); rounded to e4m3
    rows where ``weaver.fp8_weights`` is set (module docstring)."""
    fp8 = bool(getattr(weaver, "fp8_weights", False))
    key = (*_weights_key(weaver), fp8)
    cached = weaver.__dict__.get("_folded_weaver")
    if cached is not None and cached[0] == key:
        return cached[1]
    with torch.no_grad():
        prop, prop_b = fold_norm(weaver.output_norm, weaver.proposal_in.weight)
        tok, tok_b = fold_norm(weaver.embed_norm, weaver.token_in.weight)
        qry, qry_b = fold_norm(weaver.out_norm, weaver.lm_head_query_in.weight)
        folded = FoldedWeaver(
            proposal_in=prop.contiguous().t(),
            proposal_in_bias=prop_b,
            output_eps=weaver.output_norm.eps,
            token_in=tok.contiguous().t(),
            token_in_bias=tok_b,
            embed_eps=weaver.embed_norm.eps,
            layers=tuple(_fold_block(layer) for layer in weaver.layers),
            query=qry.contiguous().t(),
            query_bias=qry_b,
            out_eps=weaver.out_norm.eps,
        )
        if fp8:
            folded = _fp8_folded(folded)
    weaver.__dict__["_folded_weaver"] = (key, folded)  # not a module attribute: no state_dict entry
    return folded


def norm_linear(x: Tensor, weight_t: Tensor, bias: Tensor, eps: float) -> Tensor:
    """``Linear(RMSNormWithBias(x))`` with the norm folded into (weight_t [in, out], bias [out]):
    x [N, in] -> [N, out]."""
    return torch.addmm(bias, F.rms_norm(x, (x.shape[-1],), eps=eps), weight_t)


def rope_table(weaver, depth: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """RoPE of positions 0..depth for (q, k, v): [1 + depth, 2 (cos, sin), 3, 1, head_dim], v with cos 1
    and sin 0 (unrotated). Row p is prompt position p; ``table[1:]`` are the node positions 1..depth,
    indexed by a node's depth as the scorer's ``_rope_nodes``. The same values as ``rope_cos_sin`` of
    those positions, computed once per (depth, dtype, device) and cached on the module: a build
    launches no kernels for them."""
    key = (depth, dtype, torch.device(device))
    cache = weaver.__dict__.setdefault("_rope_tables", {})  # not a module attribute: no state_dict entry
    table = cache.get(key)
    if table is None:
        with torch.no_grad():
            cos, sin = weaver._rope(torch.arange(1 + depth, device=device), dtype)
            ones = torch.ones_like(cos)
            table = torch.stack(
                [torch.stack([cos, cos, ones], dim=1), torch.stack([sin, sin, ones - 1], dim=1)], dim=1
            )[:, :, :, None, :].contiguous()
        cache[key] = table
    return table


def prompt_pass(weaver, folded: FoldedWeaver, verifier_hidden: Tensor, dflash_hidden: Tensor, rope: Tensor,
                kv_cache: list[Tensor]) -> None:
    """The Weaver over the prompt (verifier state, then the D DFlash states; causal) in the fused form of
    the scorer's step: each layer's rotated keys and values of the P = 1 + D prompt positions go to
    ``kv_cache[layer][:, :, :, :P]`` ([2, R, heads, S, head_dim]); nothing else is kept (the prompt's
    own outputs are never read). Folded norms, RoPE from the qkv GEMM (``rope``: ``rope_table``),
    ``scaled_dot_product_attention`` with ``is_causal``: ~15 kernels per layer on CUDA instead of the
    modules' ~45, the same function to rounding."""
    r, p0 = verifier_hidden.shape[0], 1 + dflash_hidden.shape[-2]
    seq = torch.cat([verifier_hidden.unsqueeze(-2), dflash_hidden], dim=-2).flatten(0, 1)  # [R P, H]
    x = norm_linear(seq, folded.proposal_in, folded.proposal_in_bias, folded.output_eps)  # [R P, d]
    cos, sin = rope[:, 0], rope[:, 1]  # [P, 3, 1, head_dim]
    for layer, lw, kv in zip(weaver.layers, folded.layers, kv_cache):
        heads, hd = layer.n_heads, layer.head_dim
        proj = norm_linear(x, lw.qkv_rot, lw.qkv_rot_bias, lw.attn_eps).view(r, p0, 2, 3, heads, hd)
        qkv = torch.addcmul(proj[:, :, 0] * cos, proj[:, :, 1], sin)  # [R, P, 3, heads, hd]
        kv[:, :, :, :p0] = qkv[:, :, 1:].permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(
            qkv[:, :, 0].transpose(1, 2), kv[0, :, :, :p0], kv[1, :, :, :p0], is_causal=True, scale=hd**-0.5
        )  # [R, heads, P, hd]
        x = torch.addmm(x, attn.transpose(1, 2).reshape(r * p0, heads * hd), lw.o_proj)
        gate, up = norm_linear(x, lw.gate_up, lw.gate_up_bias, lw.mlp_eps).chunk(2, dim=-1)
        x = torch.addmm(x, F.silu(gate) * up, lw.down)
