"""Test helper: one small random Weaver and its ``BatchedWeaverTreeScorer`` twice, through the torch
path and through the scorer's kernels (``score_kernel``), on the same DFlash inputs and tables (CPU
tensors; the kernel tests run the second through the CUDA emulation)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_tfm.models import Weaver, WeaverConfig
from vllm_tfm.models.weaver import BatchedWeaverTreeScorer

HIDDEN, DEPTH, TOP_K, VOCAB = 64, 4, 24, 200


class ScorerPair(NamedTuple):
    torch_path: BatchedWeaverTreeScorer
    kernel_path: BatchedWeaverTreeScorer
    config: WeaverConfig
    inputs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]  # verifier, dflash hidden, ids, logits


def tiny_scorer_pair(seed: int, r: int, n_layers: int = 2, perturb: bool = True, fp8: bool = False) -> ScorerPair:
    """R requests, 8 node slots; ``perturb``: norms and biases made non-trivial (weights + 0.05 noise); ``fp8``: the
    Weaver's weight-only FP8 (``Weaver.fp8_weights``)."""
    torch.manual_seed(seed)
    cfg = WeaverConfig(d_model=HIDDEN, d_rank=32, n_layers=n_layers, n_heads=2, d_mlp=48, max_depth=DEPTH)
    weaver = Weaver(cfg).eval()
    if perturb:
        with torch.no_grad():
            for p in weaver.parameters():
                p.add_(torch.randn_like(p) * 0.05)
    weaver.fp8_weights = fp8
    embed, head = torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN) * 0.1
    inputs = (torch.randn(r, HIDDEN), torch.randn(r, DEPTH, HIDDEN), torch.randint(0, VOCAB, (r, DEPTH, TOP_K)),
              torch.randn(r, DEPTH, TOP_K))
    ref, kern = (BatchedWeaverTreeScorer(weaver, *inputs, embed, head, max_nodes=8, score_kernel=f) for f in (False, True))
    return ScorerPair(ref, kern, cfg, inputs)
