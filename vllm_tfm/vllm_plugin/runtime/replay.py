"""The worker side of acceptance replay (``vllm_plugin.benchmark_mode``): draws, shaping, counters.

Built by the ``GPUModelRunner.__init__`` wrapper when the engine config carries a replay spec,
kept in ``STATE.replay``; ``TFMTreeSampler`` calls :meth:`AcceptanceReplayer.accept` after the
real tree verification of a step (whose cost therefore stays in the step) and ``TFMProposer``
calls :meth:`AcceptanceReplayer.shape` on the DFlash marginals before building trees. The math is
``vllm_tfm.verify.acceptance_replay``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from vllm_tfm.tree.types import TreeBatch
from vllm_tfm.verify.accept_result import AcceptResult
from vllm_tfm.verify.acceptance_replay import pmf_cdf, replay_accept, spine_first_logits
from vllm_tfm.verify.tree_tables import TreeTables

if TYPE_CHECKING:
    from ..benchmark_mode import ReplaySpec

__all__ = ["AcceptanceReplayer"]


class AcceptanceReplayer:
    """Seeded replay of one engine: accepted counts drawn from ``spec.accepted_pmf``."""

    def __init__(self, spec: ReplaySpec, device: torch.device | str) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.cdf = pmf_cdf(spec.accepted_pmf, self.device)
        self.depth = len(spec.accepted_pmf) - 1
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(spec.seed)
        self.reset()

    def reset(self) -> None:
        self._drawn = torch.zeros(self.depth + 1, dtype=torch.long, device=self.device)
        self._realised = torch.zeros(self.depth + 1, dtype=torch.long, device=self.device)
        self._clamped = torch.zeros((), dtype=torch.long, device=self.device)

    def shape(self, logits: Tensor) -> Tensor:
        """Spine-first marginals [R, D, V] (unchanged when the spec turns shaping off)."""
        if self.spec.spine_top1 is None:
            return logits
        return spine_first_logits(logits, self.spec.spine_top1)

    def accept(self, trees: TreeBatch, logits: Tensor, verified: AcceptResult, is_spec: Tensor,
               tables: TreeTables | None = None) -> AcceptResult:
        """The replayed result for the spec requests (``is_spec`` [R] bool), ``verified`` for the
        others. tables: the batch's ``TreeTables`` (built from ``trees`` when None)."""
        u = torch.rand(trees.num_requests, generator=self.generator, device=self.device, dtype=torch.float64)
        out = replay_accept(trees, logits, u, self.cdf, tables)
        spec = is_spec.to(out.drawn.device)
        ones = spec.to(torch.long)
        self._drawn.index_add_(0, out.drawn.clamp(max=self.depth), ones)
        self._realised.index_add_(0, out.result.num_accepted.clamp(max=self.depth), ones)
        self._clamped += (out.clamped & spec).sum()
        return out.result.select(spec, verified)

    def snapshot(self) -> dict[str, Any]:
        drawn, realised = self._drawn.tolist(), self._realised.tolist()
        n = sum(drawn)
        return {
            "profile": self.spec.profile,
            "entry": self.spec.entry,
            "measured_profile": self.spec.measured,
            "seed": self.spec.seed,
            "spine_top1": self.spec.spine_top1,
            "profile_mean_accepted_length": self.spec.mean_accepted_length,
            "replayed_requests": n,
            "drawn_hist": drawn,
            "realised_hist": realised,
            "clamped": int(self._clamped),
            "realised_mean_accepted_length": (1.0 + sum(k * c for k, c in enumerate(realised)) / n) if n else None,
        }
