"""Random tiny `transformers` targets (seeded) for tests and for the demo without a trained zoo.

HF's default init (std 0.02 linears, RMSNorm weights at their identity) gives near-uniform,
near-periodic next-token distributions. These factories draw every weight at unit scale instead
(linears ~ N(0, 1/fan_in), embeddings ~ N(0, 1), norm weights perturbed, GDN decays moderate) so
the argmax is decisive, sampling has real spread, and every parameter is exercised by the
tree-vs-HF comparisons.
"""

from __future__ import annotations

import math

import torch
from torch import nn

__all__ = ["tiny_qwen3_5", "tiny_qwen3", "randomize_"]


def randomize_(model: nn.Module, seed: int, logit_scale: float = 3.0) -> nn.Module:
    """Redraw every parameter of a Qwen3.5/Qwen3 model in place from ``torch.Generator(seed)``."""
    gen = torch.Generator().manual_seed(seed)

    def normal(shape, std):
        return torch.randn(shape, generator=gen, dtype=torch.float64) * std

    def uniform(shape, lo, hi):
        return lo + (hi - lo) * torch.rand(shape, generator=gen, dtype=torch.float64)

    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("A_log"):
                new = uniform(p.shape, 0.1, 2.0).log()  # decay rates A in [0.1, 2]
            elif name.endswith("dt_bias"):
                new = normal(p.shape, 0.5)
            elif "conv1d" in name:
                new = normal(p.shape, 0.5)
            elif "norm" in name and leaf == "weight":
                # Qwen3.5's RMSNorm multiplies by (1 + w) (zero-init), its gated norm and Qwen3's by w
                zero_centered = type(_module_of(model, name)).__name__ == "Qwen3_5RMSNorm"
                new = uniform(p.shape, -0.3, 0.3) + (0.0 if zero_centered else 1.0)
            elif "embed_tokens" in name:
                new = normal(p.shape, 1.0)
            elif name.startswith("lm_head"):
                new = normal(p.shape, logit_scale / math.sqrt(p.shape[1]))
            elif leaf == "weight" and p.dim() == 2:
                new = normal(p.shape, 1.0 / math.sqrt(p.shape[1]))
            elif leaf == "bias":
                new = normal(p.shape, 0.1)
            else:
                raise ValueError(f"randomize_: no rule for parameter {name} {tuple(p.shape)}")
            p.copy_(new.to(p.dtype))
    return model


def _module_of(model: nn.Module, param_name: str) -> nn.Module:
    return model.get_submodule(param_name.rsplit(".", 1)[0])


def tiny_qwen3_5(
    seed: int = 0,
    vocab_size: int = 96,
    hidden_size: int = 48,
    num_layers: int = 4,
    dtype: torch.dtype = torch.float32,
    conv_width: int = 4,
    layer_types: list[str] | None = None,
    logit_scale: float = 3.0,
) -> nn.Module:
    """A random text-only ``Qwen3_5ForCausalLM``: 3 GDN layers then 1 gated attention layer per 4
    (or ``layer_types``).

    Attention: 4 query heads, 2 KV heads, head_dim 12, partial RoPE (0.25). GDN: 2 key heads of 8,
    4 value heads of 12 (GVA 2), conv width ``conv_width``. ``logit_scale``: standard deviation of
    the logits (higher = more peaked next-token distributions).
    """
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        linear_conv_kernel_dim=conv_width,
        linear_key_head_dim=8,
        linear_value_head_dim=12,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=None,
        pad_token_id=None,
        bos_token_id=None,
        layer_types=layer_types,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # HF's own init draws from the global generator before we redraw
        model = Qwen3_5ForCausalLM(cfg)
    randomize_(model, seed, logit_scale)
    return model.to(dtype).eval()


def tiny_qwen3(
    seed: int = 0,
    vocab_size: int = 96,
    hidden_size: int = 48,
    num_layers: int = 2,
    dtype: torch.dtype = torch.float32,
) -> nn.Module:
    """A random pure-attention ``Qwen3ForCausalLM`` (4 query heads, 2 KV heads, head_dim 12)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=None,
        pad_token_id=None,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(cfg)
    randomize_(model, seed)
    return model.to(dtype).eval()
