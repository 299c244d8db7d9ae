"""GPU-test helper: the Weaver scorer at the 27B drafter shape, once through the torch path and once
through the scorer's kernels (``BatchedWeaverTreeScorer(score_kernel=...)``), on the same random
bfloat16 Weaver, tables and DFlash inputs."""

from __future__ import annotations

import torch

from vllm_tfm.models import Weaver, WeaverConfig
from vllm_tfm.models.weaver import BatchedWeaverTreeScorer

DEV = torch.device("cuda")
HIDDEN, DEPTH, TOP_K, VOCAB = 5120, 15, 512, 248320


def scorers_27b(r: int, kernel_flags: tuple[bool, ...], max_nodes: int = 33, seed: int = 0,
                fp8: bool = False) -> list[BatchedWeaverTreeScorer]:
    """Scorers of R requests, one per ``score_kernel`` flag, on one random bfloat16 Weaver (the default
    Weaver shape at d_model 5120; ``fp8``: its weight-only FP8, ``Weaver.fp8_weights``) and the same tables and
    DFlash inputs."""
    torch.manual_seed(seed)
    weaver = Weaver(WeaverConfig(d_model=HIDDEN, max_depth=DEPTH))
    with torch.no_grad():
        for p in weaver.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    weaver = weaver.to(device=DEV, dtype=torch.bfloat16).eval()
    weaver.fp8_weights = fp8
    embed = torch.randn(VOCAB, HIDDEN, device=DEV).to(torch.bfloat16)
    head = (torch.randn(VOCAB, HIDDEN, device=DEV) * 0.05).to(torch.bfloat16)
    inputs = (torch.randn(r, HIDDEN, device=DEV).to(torch.bfloat16),
              torch.randn(r, DEPTH, HIDDEN, device=DEV).to(torch.bfloat16),
              torch.randint(0, VOCAB, (r, DEPTH, TOP_K), device=DEV),
              (torch.randn(r, DEPTH, TOP_K, device=DEV) * 3).to(torch.bfloat16))
    return [BatchedWeaverTreeScorer(weaver, *inputs, embed, head, max_nodes=max_nodes, score_kernel=f)
            for f in kernel_flags]


def scorer_pair_27b(r: int, max_nodes: int = 33, seed: int = 0,
                    fp8: bool = False) -> tuple[BatchedWeaverTreeScorer, BatchedWeaverTreeScorer]:
    """(torch path, kernel path) scorers of R requests (the default Weaver shape at d_model 5120)."""
    ref, kern = scorers_27b(r, (False, True), max_nodes, seed, fp8)
    return ref, kern
