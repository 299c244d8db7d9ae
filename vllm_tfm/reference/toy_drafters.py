"""Random tiny drafters (DFlash + Weaver + TreeFlash approximator) shaped for a given target.

Untrained: they accept little. Used by the tests and by ``vllm-tfm demo`` when no trained toy zoo
is available. Seeded and free of global RNG side effects.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vllm_tfm.models import (
    DFlashConfig,
    DFlashDrafter,
    DrafterBundle,
    TfmConfig,
    TreeFlashApproximator,
    TreeFlashConfig,
    Weaver,
    WeaverConfig,
)

__all__ = ["default_tap_layers", "random_drafters"]


def default_tap_layers(num_layers: int) -> list[int]:
    """Two tapped target layers for a small target: layer 1 and layer L-2 (deduplicated, >= 0)."""
    return sorted({min(1, num_layers - 1), max(num_layers - 2, 0)})


def random_drafters(
    target: nn.Module,
    seed: int = 0,
    block_size: int = 8,
    target_layer_ids: list[int] | None = None,
    num_layers: int = 1,
    budget: int = 16,
) -> DrafterBundle:
    """A random :class:`DrafterBundle` that fits ``target`` (same vocab, hidden size and dtype).

    DFlash: ``num_layers`` Qwen3 layers (4 heads, 2 KV heads, head_dim 12), mask token = the last
    vocabulary id. Weaver: d_rank 32, 2 layers, 4 heads, MLP 64, max_depth = block_size - 1.
    TreeFlash: intermediate 2H, with a small random (not zero) down projection so the transitions
    differ from the marginals.
    """
    cfg = target.config
    h, vocab, n_target = cfg.hidden_size, cfg.vocab_size, cfg.num_hidden_layers
    dtype = next(target.parameters()).dtype
    taps = default_tap_layers(n_target) if target_layer_ids is None else list(target_layer_ids)
    dcfg = DFlashConfig.create(
        hidden_size=h,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        intermediate_size=2 * h,
        vocab_size=vocab,
        target_layer_ids=taps,
        mask_token_id=vocab - 1,
        block_size=block_size,
        num_target_layers=n_target,
        rope_theta=10000.0,
        dtype="float32",
    )
    wcfg = WeaverConfig(d_model=h, d_rank=32, n_layers=2, n_heads=4, d_mlp=64, max_depth=block_size - 1)
    tcfg = TreeFlashConfig(hidden_size=h, intermediate_size=2 * h)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        dflash = DFlashDrafter(dcfg)
        weaver = Weaver(wcfg)
        treeflash = TreeFlashApproximator(tcfg)
        with torch.no_grad():
            treeflash.down.weight.normal_(0.0, 0.5 / math.sqrt(tcfg.intermediate_size))
    tfm = TfmConfig(proposal="tfm", budget=budget, weaver=wcfg, treeflash=tcfg)
    bundle = DrafterBundle(dflash=dflash.to(dtype).eval(), tfm=tfm, weaver=weaver.to(dtype).eval(), treeflash=treeflash.to(dtype).eval())
    bundle.validate_against_target(cfg)
    return bundle
