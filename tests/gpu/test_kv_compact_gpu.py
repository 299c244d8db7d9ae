"""GPU test: the one-launch K/V compaction (``cuda/kv_compact.cu``) moves exactly the bytes the torch
reference moves (``kv_compact_reference``, the per-layer gather + scatter it replaces), bit for bit, at
the Qwen3.6-27B attention shape (16 layers, 4 KV heads, head size 256, bf16, vLLM's NHD physical
order) with block size 16 and vLLM's hybrid block size for that target (1104 tokens, see
bench/tree_attention.py BLOCK_SIZE_27B); batches of 1 and 8 requests accepting nothing, one draft, a
full path of Dmax = 16, chains where nothing moves, deep paths where rows shift by several, one-node
trees; more moves than one round; arbitrary rows within one round; the other physical layouts and
element sizes (fp16, fp8, float32); the runtime's dispatch (``compact_kv``): one launch, no upload and
no host synchronisation in the steady state.

Run on the GPU host: ``python3 -m pytest tests/gpu/test_kv_compact_gpu.py -q``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
from _kv_compact_cases import LAYOUTS, Request, as_bits, as_bytes, make_caches, path_rows, step_slots

from vllm_tfm.kernels import kv_compact as kkv
from vllm_tfm.kernels.loader import kernels_available, kernels_unavailable_reason
from vllm_tfm.vllm_plugin.runtime import commit as rcommit

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = torch.device("cuda")
LAYERS, HKV, HEAD = 16, 4, 256  # Qwen3.6-27B full-attention layers
BLOCK_27B = 1104  # vLLM's hybrid block size for the 27B target (bench/tree_attention.py BLOCK_SIZE_27B)


@pytest.fixture(scope="module", autouse=True)
def _kernels_must_work():
    if not kernels_available():
        pytest.skip(f"CUDA kernels unavailable: {kernels_unavailable_reason()}")


def _gens(seed: int) -> tuple[torch.Generator, torch.Generator]:
    """(CPU generator for the trees and slots, device generator for the cache values)."""
    return torch.Generator().manual_seed(seed), torch.Generator(device=DEV).manual_seed(seed)


def _check(caches: list[torch.Tensor], slot_mapping: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
           launches_expected: int = 1) -> None:
    """The kernel on ``caches`` against the reference on copies, byte for byte; something moved unless
    every move is an identity."""
    slot_mapping, src, dst = slot_mapping.to(DEV), src.to(DEV), dst.to(DEV)
    assert kkv.kv_compact_unsupported_reason(caches, slot_mapping, src, dst) is None
    want = [kv.clone() for kv in caches]
    before = [kv.clone() for kv in caches]
    kkv.kv_compact_reference([as_bits(kv) for kv in want], slot_mapping, src, dst)
    kkv.kv_compact_layers(caches, slot_mapping, src, dst)
    assert len(kkv._layers_plan(caches)) == launches_expected
    torch.cuda.synchronize()
    for i, (a, b) in enumerate(zip(caches, want)):
        assert torch.equal(as_bytes(a), as_bytes(b)), f"layer {i} differs from the reference"
    moves = slot_mapping[src] != slot_mapping[dst]
    assert bool(moves.any()) == any(not torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(caches, before))


BATCHES = {
    "batch1_full": [Request(33, 700, 16, "deep")],
    "batch1_none": [Request(33, 41, 0)],
    "batch1_one": [Request(17, 15, 1)],
    "batch8_mixed": [Request(33, 3000, 16, "deep"), Request(33, 5, 0), Request(1, 77, 0), Request(17, 1103, 1),
                     Request(33, 16, -1, "chain"), Request(33, 2200, 9, "random"), Request(25, 1, -1, "deep"),
                     Request(33, 1090, -1, "deep")],
}


@pytest.mark.parametrize("block_size", [16, BLOCK_27B])
@pytest.mark.parametrize("case", sorted(BATCHES))
def test_27b_shape_bit_for_bit(case, block_size):
    cpu, dev = _gens(len(case) * 100 + block_size)
    reqs = BATCHES[case]
    slot_mapping, row_base, num_blocks = step_slots(reqs, block_size, cpu)
    src, dst = path_rows(reqs, row_base, 16, cpu)
    caches = make_caches("NHD", LAYERS, num_blocks, HKV, block_size, 2 * HEAD, torch.bfloat16, dev)
    _check(caches, slot_mapping, src, dst)


def test_27b_shape_more_moves_than_one_round():
    cpu, dev = _gens(3)
    reqs = [Request(33, 50 * i, -1, "deep") for i in range(12)]  # 12 x Dmax 15 = 180 moves: two rounds
    slot_mapping, row_base, num_blocks = step_slots(reqs, 16, cpu)
    src, dst = path_rows(reqs, row_base, 15, cpu)
    assert src.numel() > kkv.ROUND
    _check(make_caches("NHD", LAYERS, num_blocks, HKV, 16, 2 * HEAD, torch.bfloat16, dev), slot_mapping, src, dst)


@pytest.mark.parametrize("moves", [3, 64, 128])
def test_any_rows_in_one_round(moves):
    """Swaps and cycles of rows (no tree gives them): the gather-then-scatter result in one round."""
    cpu, dev = _gens(moves)
    t = 2 * moves + 5
    caches = make_caches("NHD", LAYERS, -(-t // 16) + 2, HKV, 16, 2 * HEAD, torch.bfloat16, dev)
    slot_mapping = torch.randperm(caches[0].shape[0] * 16, generator=cpu)[:t]
    dst = torch.randperm(t, generator=cpu)[:moves]
    src = dst[torch.randperm(moves, generator=cpu)]
    _check(caches, slot_mapping, src, dst)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float8_e4m3fn, torch.float32])
def test_layouts_and_element_sizes(layout, dtype):
    cpu, dev = _gens(LAYOUTS.index(layout))
    reqs = [Request(33, 40, 16, "deep"), Request(9, 3, 2), Request(1, 0, 0), Request(20, 17, -1, "chain")]
    slot_mapping, row_base, num_blocks = step_slots(reqs, 16, cpu)
    src, dst = path_rows(reqs, row_base, 16, cpu)
    _check(make_caches(layout, 4, num_blocks, HKV, 16, 2 * 64, dtype, dev), slot_mapping, src, dst)


def test_layers_of_two_block_sizes_take_one_launch_each():
    cpu, dev = _gens(9)
    reqs = [Request(33, 20, 16, "deep"), Request(12, 3, 4)]
    slot_mapping, row_base, _ = step_slots(reqs, 16, cpu, spare_blocks=40)
    src, dst = path_rows(reqs, row_base, 16, cpu)
    small = make_caches("NHD", 2, 64, HKV, 16, 2 * HEAD, torch.bfloat16, dev)
    big = make_caches("NHD", 1, 16, HKV, 64, 2 * HEAD, torch.bfloat16, dev)  # the same slots in blocks of 64
    _check([small[0], big[0], small[1]], slot_mapping, src, dst, launches_expected=2)


def test_runtime_dispatch_one_launch_no_upload_no_sync(monkeypatch):
    from vllm_tfm.verify import packed_upload as pu

    cpu, dev = _gens(11)
    reqs = [Request(33, 300, 16, "deep"), Request(33, 5, 3)]
    slot_mapping, row_base, num_blocks = step_slots(reqs, 16, cpu)
    src, dst = (t.to(DEV) for t in path_rows(reqs, row_base, 16, cpu))
    slot_mapping = slot_mapping.to(DEV)
    caches = make_caches("NHD", LAYERS, num_blocks, HKV, 16, 2 * HEAD, torch.bfloat16, dev)
    want = [kv.clone() for kv in caches]
    kkv.kv_compact_reference(want, slot_mapping, src, dst)
    rcommit.set_kv_compact_kernel(True)
    try:
        rcommit.compact_kv(caches, slot_mapping, src, dst)  # first call: builds and uploads the table
        torch.cuda.synchronize()
        for a, b in zip(caches, want):
            assert torch.equal(as_bytes(a), as_bytes(b))
        uploads = []
        monkeypatch.setattr(pu, "packed_upload", lambda *a: uploads.append(a) or pytest.fail("uploaded again"))
        ran = []
        real = kkv._launch
        monkeypatch.setattr(kkv, "_launch", lambda *a: ran.append(1) or real(*a))
        torch.cuda.set_sync_debug_mode("error")
        try:
            rcommit.compact_kv(caches, slot_mapping, dst, dst)  # identities: a launch that moves nothing
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert ran == [1] and uploads == []
    finally:
        rcommit.set_kv_compact_kernel(None)
