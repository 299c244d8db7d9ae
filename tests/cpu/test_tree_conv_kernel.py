"""The tree conv1d kernel (``cuda/tree_conv.cu`` ``tree_conv1d``, with the runtime width and with the width compiled
in, the default: ``VLLM_TFM_TREE_CONV_UNROLLED`` unset or ``1``) through the CPU emulation (``cuda/host_emu``) against
the float64 torch reference (``vllm_tfm.verify.conv``) on fresh random inputs: widths 2, 4 and 8, a batch of mixed
trees (one node, a chain deeper than the window, a star, a random and a deep tree, node counts that are not multiples
of the kernel's 8 nodes a CTA), windows that start inside a longer state, the stash's copy of x, and no bias / no
activation. The GPU runs the same comparisons (tests/gpu/test_kernels_gdn.py)."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from _emulation import emulated, emulation_build_dir
from _trees import random_tree_parents

from vllm_tfm.kernels import conv as kconv
from vllm_tfm.kernels.plan import TreePlan
from vllm_tfm.verify import conv as ref_conv

pytestmark = pytest.mark.slow

TREES = (("random", 1), ("chain", 12), ("star", 9), ("random", 17), ("deep", 30))


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory):
    return emulation_build_dir(tmp_path_factory, "tree_conv")


def _case(width: int, dim: int, seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    trees = [random_tree_parents(n, gen, kind) for kind, n in TREES]
    parents = torch.cat(trees)
    cu = torch.zeros(len(trees) + 1, dtype=torch.long)
    cu[1:] = torch.tensor([t.numel() for t in trees]).cumsum(0)
    r, slots, state_len = len(trees), len(trees) + 2, width - 1 + 2
    return dict(
        x=torch.randn(parents.numel(), dim, generator=gen).to(dtype),
        parents=parents,
        cu_nodes=cu,
        conv_state=torch.randn(slots, dim, state_len, generator=gen).to(dtype),
        state_indices=torch.randperm(slots, generator=gen)[:r],
        weight=torch.randn(dim, width, generator=gen).to(dtype),
        bias=torch.randn(dim, generator=gen).to(dtype),
        window_start=torch.randint(0, 3, (r,), generator=gen),
    )


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _reference(c, bias, activation):
    return ref_conv.tree_causal_conv1d(c["x"].double(), c["parents"], c["cu_nodes"], c["conv_state"].double(),
                                       c["state_indices"], c["weight"].double(),
                                       None if bias is None else bias.double(), activation, c["window_start"])


@pytest.mark.parametrize("unrolled", ["0", "1"])
@pytest.mark.parametrize("width", [2, 4, 8])
def test_kernel_equals_the_reference_on_mixed_trees(emu_dir, monkeypatch, width, unrolled):
    monkeypatch.setenv(kconv.UNROLLED_SWITCH, unrolled)
    c = _case(width, dim=40, seed=width, dtype=torch.float32)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    x_copy = torch.full_like(c["x"], float("nan"))
    with emulated(emu_dir) as launches:
        y = kconv.tree_causal_conv1d_planned(plan, c["x"], c["conv_state"], c["state_indices"], c["weight"], c["bias"],
                                             "silu", c["window_start"], extras=kconv.ConvExtras(x_copy=x_copy))
        y_plain = kconv.tree_causal_conv1d_planned(plan, c["x"], c["conv_state"], c["state_indices"], c["weight"],
                                                   None, None, c["window_start"])
    assert [name for name, _, _ in launches] == ["tree_conv1d", "tree_conv1d"]
    assert _rel(y, _reference(c, c["bias"], "silu")) < 1e-5
    assert _rel(y_plain, _reference(c, None, None)) < 1e-5
    assert torch.equal(x_copy, c["x"])


def test_bfloat16_inputs_within_bfloat16_rounding_and_both_builds_bit_equal(emu_dir, monkeypatch):
    c = _case(4, dim=40, seed=11, dtype=torch.bfloat16)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    state_before = c["conv_state"].clone()
    ys = []
    with emulated(emu_dir):
        for unrolled in ("0", "1"):
            monkeypatch.setenv(kconv.UNROLLED_SWITCH, unrolled)
            ys.append(kconv.tree_causal_conv1d_planned(plan, c["x"], c["conv_state"], c["state_indices"], c["weight"],
                                                       c["bias"], "silu", c["window_start"]))
    assert ys[0].dtype == torch.bfloat16
    assert _rel(ys[1], _reference(c, c["bias"], "silu")) < 3e-3
    assert torch.equal(ys[0], ys[1])  # the same arithmetic in the same order
    assert torch.equal(c["conv_state"], state_before)  # the state is only read


def test_the_width_is_compiled_in_by_default_where_x_and_the_state_share_a_dtype(emu_dir, monkeypatch):
    """Unset, the switch is on; a float32 state under bfloat16 x takes the loop build, and its float32 copy of the
    same values gives the same outputs bit for bit."""
    monkeypatch.delenv(kconv.UNROLLED_SWITCH, raising=False)
    c = _case(4, dim=40, seed=5, dtype=torch.bfloat16)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    built: list[list[str]] = []
    with emulated(emu_dir):
        inner = kconv.get_kernel

        def recording(source, name, options, device_index=0):
            built.append([o for o in options if o.startswith("-DCONV_W=")])
            return inner(source, name, options, device_index)

        with mock.patch.object(kconv, "get_kernel", recording):
            ys = [kconv.tree_causal_conv1d_planned(plan, c["x"], state, c["state_indices"], c["weight"], c["bias"],
                                                   "silu", c["window_start"])
                  for state in (c["conv_state"], c["conv_state"].float())]
    assert built == [["-DCONV_W=4"], []]
    assert _rel(ys[0], _reference(c, c["bias"], "silu")) < 3e-3
    assert torch.equal(ys[0], ys[1])
