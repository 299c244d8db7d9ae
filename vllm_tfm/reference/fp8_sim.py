"""The DFlash drafter's linear layers as vLLM's online FP8 runs them, simulated in the drafter's own dtype.

For ``vllm-tfm eval --drafter-fp8``: what FP8 drafter weights (``"quantization": "fp8"`` in the speculative
config, ``vllm_plugin/draft_quantization.py``) do to acceptance, measured with the reference decoder on the toy
zoo instead of on a GPU. The rounding follows vLLM 0.26's ``Fp8LinearMethod`` for an unquantized checkpoint
(``model_executor/layers/quantization/fp8.py``) as read there, not its kernels:

* weights: float8 e4m3 (largest finite 448) with one scale per tensor, ``amax / 448``; the shards vLLM fuses
  into one layer share one scale, the largest of theirs (``process_fp8_weight_tensor_strategy`` requantizes the
  logical shards to their maximum): q, k and v of an attention block, gate and up of an MLP;
* activations: e4m3 with a dynamic scale per token (row), ``amax / 448``, on H100 / H200 (cutlass FP8, vLLM's
  ``kFp8DynamicTokenSym``);
* the product accumulated in float32 (here: the drafter's dtype, float32 on the zoo), no rounding of the
  output beyond the model's dtype.

The lm_head and the input embedding are the target's and stay as they are, as in vLLM (DFlash shares them).
``Fp8SimHead`` is the other option measured here: an FP8 copy of the lm_head for the drafter's marginal logits
only (``vllm-tfm eval --drafter-fp8-head``), e4m3 weights with one scale per vocabulary row and activations
with one per row, as ``vllm_tfm.kernels.fp8_head`` runs it for the vLLM option ``draft_lm_head: "fp8"``; the
Weaver keeps reading the target's lm_head rows. The rounding helpers are that module's.

``simulate_fp8_weaver_rows`` is the Weaver's rounding under the tfm option ``weaver_weights: "fp8"``
(``vllm-tfm eval --weaver-weights fp8``), exactly: each norm folded into the projection after it, the folded
weight rounded to e4m3 with one scale per output row (``models.weaver_step.fp8_rows_values``), the folded bias
from the unrounded weight; the modules then hold those values (the norm's affine part moved into the linear
layer), so the reference decoder's Weaver computes what the runtime's batched scorer computes, to float rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vllm_tfm.kernels.fp8_head import E4M3_MAX, e4m3_scale, fp8_round, fp8_round_rows
from vllm_tfm.models.common import as_weight

__all__ = ["E4M3_MAX", "fp8_round", "fp8_round_rows", "Fp8SimLinear", "Fp8SimHead", "simulate_fp8_linears",
           "simulate_fp8_weaver_rows"]

_FUSED_SHARDS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class Fp8SimLinear(nn.Module):
    """A bias-free or biased linear layer whose weight was rounded once to e4m3 at ``weight_scale`` and whose
    input is rounded per row at every call."""

    def __init__(self, linear: nn.Linear, weight_scale: Tensor) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            self.weight = nn.Parameter(fp8_round(linear.weight.detach(), weight_scale.detach()), requires_grad=False)
            self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.weight_scale = float(weight_scale.detach())

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(fp8_round_rows(x), self.weight, self.bias)


class Fp8SimHead(nn.Module):
    """The lm_head [V, H] rounded to e4m3 with one scale per vocabulary row (``amax / 448``), its input rounded
    per row at every call; logits in the input's dtype. For ``DFlashDrafter.logits_head``."""

    def __init__(self, lm_head: nn.Module | Tensor) -> None:
        super().__init__()
        w = as_weight(lm_head, "lm_head").detach()
        scale = e4m3_scale(w.abs().amax(dim=1, keepdim=True))
        self.register_buffer("weight", fp8_round(w, scale), persistent=False)  # not in a state_dict

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(fp8_round_rows(x), self.weight.to(x.dtype))


def simulate_fp8_linears(module: nn.Module) -> int:
    """Replace every ``nn.Linear`` under ``module`` by an ``Fp8SimLinear`` (in place); returns how many. Fused
    shards (q/k/v, gate/up: siblings under one parent) share the largest of their per-tensor scales."""
    count = 0
    for parent in list(module.modules()):
        children = {name: child for name, child in parent.named_children() if isinstance(child, nn.Linear)}
        groups: list[tuple[str, ...]] = [g for g in _FUSED_SHARDS if all(n in children for n in g)]
        grouped = {n for g in groups for n in g}
        groups += [(n,) for n in children if n not in grouped]
        for group in groups:
            scale = e4m3_scale(torch.stack([children[n].weight.detach().abs().amax() for n in group]).amax())
            for name in group:
                setattr(parent, name, Fp8SimLinear(children[name], scale))
                count += 1
    return count


def simulate_fp8_weaver_rows(weaver: nn.Module) -> int:
    """Round ``weaver``'s projections as ``Weaver.fp8_weights`` does (module docstring), in place; returns how many.

    A norm followed by a projection, ``W (g * x_hat + b)``, becomes ``Q(W g) x_hat + W b``: the norm keeps no affine
    part (weight 1, bias 0) and the projection gets the rounded folded weight and the bias ``W b``; a projection
    without a norm before it (o_proj, down) gets ``Q(W)``."""
    from vllm_tfm.models.weaver_step import fold_norm, fp8_rows_values

    def fold_into(parent: nn.Module, norm_name: str, linear_name: str) -> None:
        norm, linear = getattr(parent, norm_name), getattr(parent, linear_name)
        w, b = fold_norm(norm, linear.weight.detach())
        biased = nn.Linear(linear.in_features, linear.out_features, bias=True, device=w.device, dtype=w.dtype)
        with torch.no_grad():
            biased.weight.copy_(fp8_rows_values(w)[0])
            biased.bias.copy_(b)
            norm.weight.fill_(1.0)
            norm.bias.zero_()
        setattr(parent, linear_name, biased.requires_grad_(False))

    def round_plain(linear: nn.Linear) -> None:
        with torch.no_grad():
            linear.weight.copy_(fp8_rows_values(linear.weight.detach())[0])

    pairs = [(weaver, "output_norm", "proposal_in"), (weaver, "embed_norm", "token_in"),
             (weaver, "out_norm", "lm_head_query_in")]
    for layer in weaver.layers:
        pairs += [(layer, "attn_norm", "qkv"), (layer, "mlp_norm", "gate_up")]
        round_plain(layer.o_proj)
        round_plain(layer.down)
    for parent, norm_name, linear_name in pairs:
        fold_into(parent, norm_name, linear_name)
    return len(pairs) + 2 * len(weaver.layers)
