"""bench/e2e_controls.py: the no-spec batch-composition control and the GDN path record of the GPU e2e."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

from e2e_controls import (
    ReferenceCounter,
    compare_runs,
    control_orders,
    gdn_path,
    overlap_with_control,
)


def test_control_order_moves_every_prompt() -> None:
    for n in (2, 3, 8, 32):
        order = control_orders(n)
        assert sorted(order) == list(range(n))
        assert all(i != p for i, p in enumerate(order)), order
    assert control_orders(32) == control_orders(32)  # fixed: reruns compare the same batches
    assert control_orders(1) == [0]


def test_compare_runs_counts_prompts_and_first_differences() -> None:
    ref = [[1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9], [1, 1]]
    other = [[1, 2, 3, 4], [5, 6, 0, 8], [9, 9, 9, 9], [1]]
    r = compare_runs(ref, other)
    assert (r["prompts"], r["prompts_differing"], r["differing"]) == (4, 2, [1, 3])
    assert r["first_difference"] == {1: 2, 3: 1}
    assert r["identical_fraction"] == 0.5
    assert r["identical_token_fraction"] == (4 + 2 + 4 + 1) / 14
    with pytest.raises(ValueError, match="2 reference outputs but 1 others"):
        compare_runs(ref[:2], other[:1])


def test_overlap_with_control_splits_divergences() -> None:
    control = {"shuffled": {"differing": [3, 7]}, "alone": {"differing": [7, 9]}, "note": "x"}
    r = overlap_with_control([1, 7, 9], control)
    assert r == {"diverging": [1, 7, 9], "also_nospec_unstable": [7, 9], "only_under_speculation": [1]}


def test_gdn_path() -> None:
    assert gdn_path({"gdn_tree_verify": 0}, {"gdn.tree_verify": 12}) == "kernels"
    assert gdn_path({"gdn_tree_verify": 12}, {"gdn.tree_verify": 12}) == "reference"
    assert gdn_path({"gdn_tree_verify": 5}, {"gdn.tree_verify": 12}) == "mixed"
    assert gdn_path({}, {}) == "none"


def test_reference_counter_counts_the_references_the_runtime_resolves() -> None:
    """On CPU the runtime's GDN operations are the torch references: a verify through ``tree_ops`` counts."""
    import torch

    import vllm_tfm.verify.gdn as ref_gdn
    from vllm_tfm.vllm_plugin.runtime import kernels_or_reference as kor

    orig = ref_gdn.gdn_tree_verify
    counter = ReferenceCounter()
    counter.install()
    try:
        kor.set_kernels_enabled(True)  # forget resolved operations
        ops = kor.tree_ops()
        assert kor.kernels_in_use()["gdn_tree_verify"] == "reference"
        g = torch.Generator().manual_seed(0)
        t, h, k, hv, v = 3, 1, 4, 2, 4
        q, kk = torch.randn(t, h, k, generator=g), torch.randn(t, h, k, generator=g)
        vv = torch.randn(t, hv, v, generator=g)
        gate, beta = -torch.rand(t, hv, generator=g), torch.rand(t, hv, generator=g)
        parents, cu = torch.tensor([-1, 0, 0]), torch.tensor([0, 3])
        state = torch.randn(2, hv, v, k, generator=g)
        out = ops.gdn_tree_verify(q, kk, vv, gate, beta, parents, cu, state, torch.tensor([1]))
        expected = orig(q, kk, vv, gate, beta, parents, cu, state, torch.tensor([1]))
        assert torch.equal(out if isinstance(out, torch.Tensor) else out[0],
                           expected if isinstance(expected, torch.Tensor) else expected[0])
        assert counter.snapshot()["gdn_tree_verify"] == 1
        assert counter.snapshot()["gdn_tree_commit"] == 0
    finally:
        counter.uninstall()
        kor.set_kernels_enabled(True)
    assert ref_gdn.gdn_tree_verify is orig
