"""Controls for bench/gpu_plugin_e2e.py: how much no-spec output moves with batch composition, and
which GDN implementation (NVRTC kernels or torch references) the tree verify actually ran.

- ``control_orders`` / ``compare_runs``: the baseline decodes the prompts again without speculation
  in a shuffled batch order and/or each prompt alone; ``compare_runs`` counts the prompts whose
  tokens differ from the batch-8 run and where (a tfm divergence on a prompt that also moves here is
  ordinary batch nondeterminism, not speculation).
- ``ReferenceCounter``: counts calls of the four torch references in ``vllm_tfm.verify`` (the
  kernels call them, by module attribute, when they cannot take the inputs, e.g. a bfloat16 GDN
  state); ``gdn_path`` turns a case's counts and hook counters into "kernels" / "reference" / "mixed".
"""

from __future__ import annotations

import functools
import random
from collections.abc import Callable
from typing import Any

__all__ = ["ReferenceCounter", "compare_runs", "control_orders", "gdn_path", "overlap_with_control"]

REFERENCE_OPS = {
    "vllm_tfm.verify.gdn": ("gdn_tree_verify", "gdn_tree_commit"),
    "vllm_tfm.verify.conv": ("tree_causal_conv1d", "tree_conv_commit"),
}


def control_orders(n_prompts: int, seed: int = 5) -> list[int]:
    """A fixed shuffle of the prompt indices that moves every prompt (no fixed points when n > 1), so
    each prompt meets other batch neighbours than in the original order."""
    order = list(range(n_prompts))
    if n_prompts < 2:
        return order
    rng = random.Random(seed)
    while True:
        rng.shuffle(order)
        if all(i != p for i, p in enumerate(order)):
            return order


def compare_runs(reference: list[list[int]], other: list[list[int]]) -> dict[str, Any]:
    """Prompts whose token lists differ between two no-spec runs (same prompt order), with the first
    differing position of each and the fraction of tokens before the first difference."""
    if len(reference) != len(other):
        raise ValueError(f"compare_runs: {len(reference)} reference outputs but {len(other)} others")
    first: dict[int, int] = {}
    same_tokens = 0
    total = 0
    for i, (a, b) in enumerate(zip(reference, other)):
        pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if pos is None and len(a) != len(b):
            pos = min(len(a), len(b))
        if pos is not None:
            first[i] = pos
        same_tokens += len(a) if pos is None else pos
        total += len(a)
    return {"prompts": len(reference), "prompts_differing": len(first), "differing": sorted(first),
            "first_difference": first, "identical_fraction": (len(reference) - len(first)) / max(1, len(reference)),
            "identical_token_fraction": same_tokens / max(1, total)}


def overlap_with_control(diverging: list[int], control: dict[str, Any]) -> dict[str, Any]:
    """Which of a case's diverging prompts also differ between the no-spec control runs."""
    unstable: set[int] = set()
    for run in control.values():
        if isinstance(run, dict):
            unstable.update(int(i) for i in run.get("differing", []))
    both = sorted(set(diverging) & unstable)
    return {"diverging": sorted(diverging), "also_nospec_unstable": both,
            "only_under_speculation": sorted(set(diverging) - unstable)}


class ReferenceCounter:
    """Counts calls of the torch GDN tree references, wherever they are called from.

    Install before the tfm runtime resolves its operations (``kernels_or_reference.tree_ops``
    reads the module attributes when it first runs; the kernels read them at every fallback)."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {}
        self._installed: list[tuple[Any, str, Callable]] = []

    def install(self) -> None:
        import importlib

        for module_name, names in REFERENCE_OPS.items():
            module = importlib.import_module(module_name)
            for name in names:
                orig = getattr(module, name)
                if getattr(orig, "_tfm_counted", False):
                    continue
                self.calls[name] = 0
                setattr(module, name, self._wrap(name, orig))
                self._installed.append((module, name, orig))

    def _wrap(self, name: str, orig: Callable) -> Callable:
        @functools.wraps(orig)
        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return orig(*args, **kwargs)

        counted._tfm_counted = True  # type: ignore[attr-defined]
        return counted

    def uninstall(self) -> None:
        for module, name, orig in reversed(self._installed):
            setattr(module, name, orig)
        self._installed.clear()

    def snapshot(self) -> dict[str, int]:
        return dict(self.calls)


def gdn_path(reference_calls: dict[str, int], hooks: dict[str, int]) -> str:
    """Which implementation ran a case's GDN tree verify: "kernels" (tree verifies, no reference
    verify call), "reference" (every tree verify through the torch reference), "mixed", or "none"."""
    verifies = int(hooks.get("gdn.tree_verify", 0))
    ref = int(reference_calls.get("gdn_tree_verify", 0))
    if verifies == 0:
        return "none" if ref == 0 else "reference"
    if ref == 0:
        return "kernels"
    return "reference" if ref >= verifies else "mixed"
