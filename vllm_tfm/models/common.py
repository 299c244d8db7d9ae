"""Building blocks shared by the drafter models: norms, rotary embedding, SwiGLU, masked attention.

Plain torch, no vLLM. Conventions follow Qwen3 (Hugging Face ``modeling_qwen3``) so that weights
trained here and the public z-lab DFlash checkpoints compute the same function:

* RMSNorm: statistics in float32 (float64 when the input is float64), output cast back to the
  input dtype, then scaled by the weight (Qwen order: ``weight * x_normed.to(dtype)``).
* RoPE: rotate-half ("neox") layout, inv_freq = theta^(-2i/D), cos/sin computed in float32
  (float64 for float64 inputs).
* Attention: grouped-query, query head h reads key/value head ``h // (n_heads // n_kv_heads)``
  (Hugging Face ``repeat_kv`` order); an explicit boolean mask says which keys each query sees.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "RMSNorm",
    "RMSNormWithBias",
    "SwiGLU",
    "rope_cos_sin",
    "apply_rope",
    "masked_attention",
    "compute_dtype",
    "as_weight",
]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; every other floating dtype computes statistics in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def as_weight(module_or_weight: nn.Module | Tensor, name: str) -> Tensor:
    """The [rows, H] weight of an nn.Embedding / nn.Linear (or the tensor itself)."""
    if isinstance(module_or_weight, Tensor):
        w = module_or_weight
    else:
        w = getattr(module_or_weight, "weight", None)
        if not isinstance(w, Tensor):
            raise ValueError(
                f"{name} must be a weight tensor or a module with a .weight, got {type(module_or_weight).__name__}"
            )
    if w.dim() != 2:
        raise ValueError(f"{name} weight must be 2-D [rows, hidden], got shape {tuple(w.shape)}")
    return w


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm over the last dim: ``weight * (x / sqrt(mean(x^2) + eps)).to(x.dtype)``."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        xf = x.to(compute_dtype(x.dtype))
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class RMSNormWithBias(nn.Module):
    """RMSNorm with an affine weight AND bias, all math in float32 (float64 for float64 inputs).

    ``y = (x / sqrt(mean(x^2) + eps)) * weight + bias``, returned in the input dtype. This is the
    norm of the Weaver (DESIGN.md section 10: "RMSNorm with a weight and a bias, in fp32").
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = float(eps)
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x: Tensor) -> Tensor:
        cd = compute_dtype(x.dtype)
        xf = x if x.dtype == cd else x.to(cd)  # no-op conversions skipped: fewer dispatches, same math
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        weight = self.weight if self.weight.dtype == cd else self.weight.to(cd)
        bias = self.bias if self.bias.dtype == cd else self.bias.to(cd)
        y = xf * weight + bias
        return y if y.dtype == x.dtype else y.to(x.dtype)


class SwiGLU(nn.Module):
    """Qwen/Llama MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))`` (no biases)."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=False)
        self.up_proj = nn.Linear(dim, hidden, bias=False)
        self.down_proj = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(positions: Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin of the rotate-half RoPE for integer ``positions`` [...]: each [..., head_dim].

    Computed in float32 (float64 if ``dtype`` is float64) and returned in ``dtype``.
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    cd = compute_dtype(dtype)
    inv_freq = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).to(cd) / head_dim)
    )
    freqs = positions.to(cd)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: Tensor) -> Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` [..., T, n_heads, head_dim] by cos/sin [..., T, head_dim] (broadcast over heads)."""
    cos = cos.unsqueeze(-2)
    sin = sin.unsqueeze(-2)
    return x * cos + _rotate_half(x) * sin


def masked_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """Softmax attention with an explicit key mask and grouped-query heads.

    Args:
        q: [..., Q, H, D] queries; k, v: [..., S, Hkv, D] keys/values, H % Hkv == 0.
        mask: bool, broadcastable to [..., Q, S]; True = the query sees the key. Every query must
            see at least one key.
        scale: multiplier of q.k (usually D ** -0.5).
    Returns:
        [..., Q, H, D] in q.dtype; softmax in float32 (float64 for float64 inputs).
    """
    n_heads, n_kv = q.shape[-2], k.shape[-2]
    if n_heads % n_kv:
        raise ValueError(f"query heads {n_heads} must be a multiple of key/value heads {n_kv}")
    if n_heads != n_kv:
        k = k.repeat_interleave(n_heads // n_kv, dim=-2)
        v = v.repeat_interleave(n_heads // n_kv, dim=-2)
    cd = compute_dtype(q.dtype)
    # [..., H, Q, S]
    scores = torch.einsum("...qhd,...shd->...hqs", q.to(cd), k.to(cd)) * scale
    scores = scores.masked_fill(~mask.unsqueeze(-3), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("...hqs,...shd->...qhd", probs, v.to(cd))
    return out.to(q.dtype)
