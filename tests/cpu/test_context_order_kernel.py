"""The DFlash context-order kernel (``cuda/context_order.cu``) on the CPU through the CUDA emulation, against its
torch reference and against the order written out with Python lists: one-node requests with prompt rows before
their root, chains, stars, deep trees, mixed batches of more rows than a CTA has threads, padding columns past
the deepest path; the runtime's dispatcher takes the kernel where it runs and the reference otherwise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from _context_order_cases import context_order_case
from _emulation import emulated, emulation_build_dir

from vllm_tfm.kernels import context_order as kco


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return emulation_build_dir(tmp_path_factory, "emu_context_order")


@pytest.mark.parametrize("num_req,max_nodes", [(1, 1), (1, 17), (3, 2), (8, 17), (40, 33), (2, 65)])
def test_kernel_equals_reference_and_lists(emu_dir, num_req, max_nodes):
    for seed in range(4):
        req_index, row_base, rows, accepted, expected = context_order_case(num_req, max_nodes, seed)
        with emulated(emu_dir) as launches:
            got = kco.dflash_context_order_kernel(req_index, row_base, rows, accepted)
        assert [name for name, _, _ in launches] == ["dflash_context_order"]
        assert got.dtype == torch.int64 and got.tolist() == expected
        assert torch.equal(kco.dflash_context_order_reference(req_index, row_base, rows, accepted), got)


def test_padding_columns_and_gaps_in_the_path_keep_the_depth_order(emu_dir):
    """accepted [[3, -1, 5, -1, -1]] (a -1 between valid entries, and spare columns): root, 3, 5, then 1, 2, 4."""
    req_index = torch.zeros(6, dtype=torch.long)
    row_base = torch.zeros(1, dtype=torch.long)
    accepted = torch.tensor([[3, -1, 5, -1, -1]])
    with emulated(emu_dir):
        got = kco.dflash_context_order_kernel(req_index, row_base, torch.tensor([6]), accepted)
    assert got.tolist() == [0, 3, 5, 1, 2, 4]
    assert kco.dflash_context_order_reference(req_index, row_base, torch.tensor([6]), accepted).tolist() == got.tolist()


def test_bad_arguments_are_refused_with_their_reason():
    req_index, row_base, rows, accepted, _ = context_order_case(3, 9, 0)
    with pytest.raises(ValueError, match="req_index must be a contiguous int64"):
        kco.dflash_context_order_kernel(req_index.int(), row_base, rows, accepted)
    with pytest.raises(ValueError, match=r"accepted_nodes must be a contiguous int64 \[3, Dmax\] tensor"):
        kco.dflash_context_order_kernel(req_index, row_base, rows, accepted[:2])
    with pytest.raises(ValueError, match=r"rows_per_req must be a \[3\] tensor"):
        kco.dflash_context_order_kernel(req_index, row_base, rows[:2], accepted)
    assert kco.unsupported_reason(req_index, row_base, rows, accepted) == kco.NOT_CUDA


def test_the_runtime_takes_the_kernel_where_it_runs_and_the_reference_otherwise(emu_dir, monkeypatch):
    from vllm_tfm.vllm_plugin.runtime import drafter_inputs as di
    from vllm_tfm.vllm_plugin.runtime import set_context_order_kernel

    req_index, row_base, rows, accepted, expected = context_order_case(6, 17, 3)
    with emulated(emu_dir) as launches:  # CPU tensors: NOT_CUDA, the reference, no warning, no launch
        assert di.dflash_context_order(req_index, row_base, rows, accepted).tolist() == expected
        assert launches == []
        monkeypatch.setattr(kco, "unsupported_reason", lambda *a: None)
        assert di.dflash_context_order(req_index, row_base, rows, accepted).tolist() == expected
        assert [name for name, _, _ in launches] == ["dflash_context_order"]
        try:
            assert set_context_order_kernel(on=False) is False
            assert di.dflash_context_order(req_index, row_base, rows, accepted).tolist() == expected
            assert len(launches) == 1  # switched off: the reference
        finally:
            assert set_context_order_kernel(on=None) is True
