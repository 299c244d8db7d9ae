"""Committed decoding state of a `transformers` target, in vllm_tfm's own layouts.

One request (batch 1). ``prefix_len`` counts the tokens the target has processed; the next tree's
root (the last committed, "bonus" token) sits at position ``prefix_len`` and has no state yet.

Per decoder layer, by ``config.layer_types[i]``:

* ``"full_attention"``: :class:`AttentionKV` holding post-RoPE keys and values,
  ``k, v: [Hkv, prefix_len, D]`` in the model dtype (the HF ``DynamicLayer`` layout minus batch).
* ``"linear_attention"`` (Gated DeltaNet): :class:`GDNState` holding
  ``conv_state [1, D_conv, W - 1]`` (model dtype): the last W-1 *pre-conv* inputs, oldest first
  (slot 0, ``window_start`` 0, as :func:`vllm_tfm.verify.conv.tree_causal_conv1d` reads it), and
  ``ssm_state [1, HV, V, K]``: the recurrent state in vLLM's V-first layout, float32 (float64 when
  the model runs in float64).

Conversion from an HF cache (transformers 5.x ``DynamicCache`` with ``LinearAttentionLayer``):
HF keeps ``conv_states[0]`` as ``[B, D_conv, W]`` = the last W pre-conv inputs (zero-padded on the
left for prompts shorter than W), so we keep its last W-1 columns; HF keeps
``recurrent_states[0]`` as ``[B, HV, K, V]`` (K-first, FLA's layout), so we transpose the last two
dims.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["AttentionKV", "GDNState", "CommittedState", "state_dtype_for", "from_hf_cache"]


@dataclass
class AttentionKV:
    """Committed keys/values of one full-attention layer: ``k, v [Hkv, L, D]`` (post-RoPE keys)."""

    k: Tensor
    v: Tensor

    def append(self, k: Tensor, v: Tensor) -> None:
        """Append ``k, v [Hkv, m, D]`` at the end of the sequence axis."""
        self.k = torch.cat([self.k, k.to(self.k.dtype)], dim=1)
        self.v = torch.cat([self.v, v.to(self.v.dtype)], dim=1)

    @property
    def length(self) -> int:
        return int(self.k.shape[1])


@dataclass
class GDNState:
    """Committed state of one Gated DeltaNet layer (one slot).

    ``conv_state [1, D_conv, W-1]`` pre-conv inputs, oldest first; ``ssm_state [1, HV, V, K]``.
    """

    conv_state: Tensor
    ssm_state: Tensor


@dataclass
class CommittedState:
    """Everything the target needs to continue after ``prefix_len`` processed tokens."""

    prefix_len: int
    layers: list[AttentionKV | GDNState] = field(default_factory=list)

    def clone(self) -> "CommittedState":
        out = []
        for layer in self.layers:
            if isinstance(layer, AttentionKV):
                out.append(AttentionKV(layer.k.clone(), layer.v.clone()))
            else:
                out.append(GDNState(layer.conv_state.clone(), layer.ssm_state.clone()))
        return CommittedState(self.prefix_len, out)


def state_dtype_for(model_dtype: torch.dtype) -> torch.dtype:
    """dtype of the GDN recurrent state: float64 for float64 models, else float32 (as HF and vLLM)."""
    return torch.float64 if model_dtype == torch.float64 else torch.float32


def from_hf_cache(
    cache, layer_types: list[str], prefix_len: int, conv_width: int | None, model_dtype: torch.dtype
) -> CommittedState:
    """Convert a transformers 5.x cache of a batch-1 prefill into a :class:`CommittedState`.

    ``cache`` is the ``DynamicCache`` returned by ``model(input_ids, use_cache=True)``; its
    ``layers[i]`` is a ``DynamicLayer`` (``keys/values [1, Hkv, L, D]``) for attention layers and a
    ``LinearAttentionLayer`` (``conv_states[0] [1, D_conv, W]``, ``recurrent_states[0]
    [1, HV, K, V]``) for GDN layers. ``prefix_len`` is the number of prefilled tokens. ``conv_width`` is W (``config.linear_conv_kernel_dim``), needed
    only when some layer is ``"linear_attention"``.
    """
    layers: list[AttentionKV | GDNState] = []
    sdt = state_dtype_for(model_dtype)
    for i, kind in enumerate(layer_types):
        hl = cache.layers[i]
        if kind == "linear_attention":
            if conv_width is None:
                raise ValueError("from_hf_cache needs conv_width for linear_attention layers")
            conv = hl.conv_states[0]
            rec = hl.recurrent_states[0]
            if conv is None or rec is None:
                raise ValueError(f"HF cache layer {i} holds no conv/recurrent state (was the prefill run with use_cache=True?)")
            if conv.dim() != 3 or conv.shape[0] != 1:
                raise ValueError(f"expected a batch-1 HF conv state [1, D, W], got {tuple(conv.shape)} at layer {i}")
            if conv.shape[-1] < conv_width - 1:
                raise ValueError(f"HF conv state of layer {i} keeps {conv.shape[-1]} columns, fewer than W-1 = {conv_width - 1}")
            conv_ours = conv[..., conv.shape[-1] - (conv_width - 1):].to(model_dtype).contiguous()
            ssm_ours = rec.transpose(-1, -2).to(sdt).contiguous()  # [1, HV, K, V] -> [1, HV, V, K]
            layers.append(GDNState(conv_ours, ssm_ours))
        elif kind == "full_attention":
            k, v = hl.keys, hl.values
            if k.dim() != 4 or k.shape[0] != 1:
                raise ValueError(f"expected batch-1 HF keys [1, Hkv, L, D], got {tuple(k.shape)} at layer {i}")
            if int(k.shape[2]) != prefix_len:
                raise ValueError(f"HF cache layer {i} holds {int(k.shape[2])} positions, expected prefix_len {prefix_len}")
            layers.append(AttentionKV(k[0].contiguous(), v[0].contiguous()))
        else:
            raise ValueError(f"unsupported layer type {kind!r} at layer {i} (supported: full_attention, linear_attention)")
    return CommittedState(prefix_len, layers)
