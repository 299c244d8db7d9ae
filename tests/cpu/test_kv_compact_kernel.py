"""The one-launch K/V compaction (``cuda/kv_compact.cu``, ``vllm_tfm.kernels.kv_compact``) on the CPU:
the kernel through the CUDA emulation (cuda/host_emu) against the torch reference, byte for byte, on
fresh random inputs (several layers, batches of requests accepting nothing, one draft, a full path,
chains where nothing moves, deep paths where rows shift by several, rows across block boundaries in
non-contiguous blocks, every physical layout and copy unit, several rounds of moves, arbitrary row
lists in one round); the launch geometry; the reasons the kernel refuses arguments; the runtime's
dispatch (``runtime/commit.py`` ``compact_kv``) and its switch."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from _emulation import emulated, emulation_build_dir
from _kv_compact_cases import LAYOUTS, Request, as_bytes, make_caches, path_rows, step_slots

from vllm_tfm.kernels import kv_compact as kkv
from vllm_tfm.kernels import loader
from vllm_tfm.vllm_plugin.runtime import commit as rcommit
from vllm_tfm.vllm_plugin.runtime import kernels_or_reference as kor
from vllm_tfm.vllm_plugin.runtime.metrics import Metrics
from vllm_tfm.vllm_plugin.runtime.state import STATE

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return emulation_build_dir(tmp_path_factory, "emu_kv_compact")


def _run_both(emu_dir: Path, caches: list[torch.Tensor], slot_mapping: torch.Tensor, src: torch.Tensor,
              dst: torch.Tensor) -> tuple[list[torch.Tensor], list]:
    """The kernel on ``caches`` (in place, emulated) and the reference on copies; returns the
    reference's caches and the launches made."""
    want = [kv.clone() for kv in caches]
    kkv.kv_compact_reference(want, slot_mapping, src, dst)
    with emulated(emu_dir) as launches:
        kkv.kv_compact_layers(caches, slot_mapping, src, dst)
    return want, list(launches)


def _assert_same(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    for i, (a, b) in enumerate(zip(got, want)):
        diff = (as_bytes(a) != as_bytes(b)).nonzero()
        assert diff.numel() == 0, f"layer {i}: {diff.shape[0]} bytes differ, first at {diff[:3].tolist()}"


MIXED = [Request(9, 5, 0), Request(12, 30, -1, "deep"), Request(1, 7, 0), Request(6, 14, 1),
         Request(8, 3, -1, "chain"), Request(17, 0, 4, "random")]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_equals_the_reference_on_a_mixed_batch_in_every_layout(emu_dir, layout, dtype):
    gen = torch.Generator().manual_seed(LAYOUTS.index(layout) * 10 + (dtype == torch.float16))
    bs, heads, width, dmax = 16, 2, 16, 8
    slot_mapping, row_base, num_blocks = step_slots(MIXED, bs, gen)
    src, dst = path_rows(MIXED, row_base, dmax, gen)
    caches = make_caches(layout, 3, num_blocks, heads, bs, width, dtype, gen)
    before = [kv.clone() for kv in caches]
    want, launches = _run_both(emu_dir, caches, slot_mapping, src, dst)
    _assert_same(caches, want)
    assert [name for name, *_ in launches] == ["kv_compact_layers"]  # one launch for all layers
    assert any(not torch.equal(as_bytes(a), as_bytes(b)) for a, b in zip(caches, before))  # something moved


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float32, torch.int8])
@pytest.mark.parametrize("layout", ["NHD", "padded2", "strided_last"])
def test_other_element_sizes_move_as_bytes(emu_dir, dtype, layout):
    gen = torch.Generator().manual_seed(5)
    reqs = [Request(10, 9, -1, "deep"), Request(7, 2, 3)]
    slot_mapping, row_base, num_blocks = step_slots(reqs, 16, gen)
    src, dst = path_rows(reqs, row_base, 9, gen)
    if dtype == torch.int8:
        caches = [torch.randint(-128, 128, (num_blocks, 16, 2, 16), generator=gen, dtype=torch.int8).permute(0, 2, 1, 3)
                  for _ in range(2)]
    else:
        caches = make_caches(layout, 2, num_blocks, 2, 16, 16, dtype, gen)
    want, _ = _run_both(emu_dir, caches, slot_mapping, src, dst)
    _assert_same(caches, want)


def test_the_copy_unit_follows_strides_and_alignment():
    gen = torch.Generator()
    units = {layout: kkv.cache_layout(make_caches(layout, 1, 4, 2, 16, 16, torch.bfloat16, gen)[0]).unit
             for layout in LAYOUTS}
    assert units == {"NHD": 16, "HND": 16, "strided_last": 2, "padded8": 8, "padded2": 2, "cross_layer": 16}
    lay = kkv.cache_layout(make_caches("strided_last", 1, 4, 2, 16, 16, torch.bfloat16, gen)[0])
    assert (lay.units_per_head, lay.s_unit) == (16, 2 * 16 * 2)  # one element per unit, the last dimension's stride


@pytest.mark.parametrize("dmax, kind", [(1, "chain"), (4, "chain"), (16, "deep"), (16, "random"), (16, "star")])
def test_path_lengths_from_nothing_to_the_full_depth(emu_dir, dmax, kind):
    gen = torch.Generator().manual_seed(dmax * 7 + len(kind))
    reqs = [Request(dmax + 1, 17, -1, kind), Request(dmax + 5, 1, 0, kind), Request(2 * dmax + 3, 31, 1, kind),
            Request(1, 4, 0), Request(dmax + 1, 16, -1, "chain")]
    slot_mapping, row_base, num_blocks = step_slots(reqs, 16, gen)
    src, dst = path_rows(reqs, row_base, dmax, gen)
    caches = make_caches("NHD", 2, num_blocks, 2, 16, 16, torch.bfloat16, gen)
    want, _ = _run_both(emu_dir, caches, slot_mapping, src, dst)
    _assert_same(caches, want)


def test_chains_move_nothing(emu_dir):
    """Every accepted node at its chain row (a_k = k + 1): every move copies a slot onto itself."""
    gen = torch.Generator().manual_seed(11)
    reqs = [Request(9, 3, -1, "chain"), Request(5, 20, -1, "chain")]
    slot_mapping, row_base, num_blocks = step_slots(reqs, 16, gen)
    src, dst = path_rows(reqs, row_base, 8, gen)
    assert torch.equal(src, dst)
    caches = make_caches("NHD", 2, num_blocks, 2, 16, 16, torch.bfloat16, gen)
    before = [kv.clone() for kv in caches]
    want, _ = _run_both(emu_dir, caches, slot_mapping, src, dst)
    _assert_same(caches, want)
    _assert_same(caches, before)


def test_one_node_trees_and_an_empty_call(emu_dir):
    gen = torch.Generator().manual_seed(12)
    reqs = [Request(1, 5, 0)]
    slot_mapping, row_base, num_blocks = step_slots(reqs, 16, gen)
    src, dst = path_rows(reqs, row_base, 1, gen)
    caches = make_caches("NHD", 2, num_blocks, 1, 16, 8, torch.bfloat16, gen)
    before = [kv.clone() for kv in caches]
    _run_both(emu_dir, caches, slot_mapping, src, dst)
    _assert_same(caches, before)
    empty = torch.zeros(0, dtype=torch.int64)
    with emulated(emu_dir) as launches:
        kkv.kv_compact_layers(caches, slot_mapping, empty, empty)
        kkv.kv_compact_layers([], slot_mapping, src, dst)
    assert launches == []


def test_deep_shifts_across_block_boundaries_and_several_column_slices(emu_dir):
    """Long paths in deep trees (rows shift by several), contexts that put the trees across block
    boundaries, and rows of 36 copy units (two CTAs per layer, the second one partly idle)."""
    gen = torch.Generator().manual_seed(13)
    reqs = [Request(40, 13, -1, "deep"), Request(33, 45, -1, "deep"), Request(20, 0, 9, "random")]
    slot_mapping, row_base, num_blocks = step_slots(reqs, 16, gen)
    src, dst = path_rows(reqs, row_base, 16, gen)
    assert int((src - dst).max()) >= 3  # some rows shift by several
    caches = make_caches("NHD", 3, num_blocks, 3, 16, 96, torch.bfloat16, gen)
    lay = kkv.cache_layout(caches[0])
    assert lay.units_per_row == 36
    want, launches = _run_both(emu_dir, caches, slot_mapping, src, dst)
    _assert_same(caches, want)
    assert launches == [("kv_compact_layers", (2, 3, 1), 0)]


def test_the_last_slot_of_the_cache_moves(emu_dir):
    """The last block's last offset as a source and as a destination (the kernel's bound checks are not
    off by one)."""
    gen = torch.Generator().manual_seed(14)
    caches = make_caches("NHD", 2, 4, 2, 16, 16, torch.bfloat16, gen)
    last = 4 * 16 - 1
    slot_mapping = torch.tensor([3, last, 17, 40, 0], dtype=torch.int64)
    src = torch.tensor([1, 3, 0], dtype=torch.int64)
    dst = torch.tensor([2, 1, 4], dtype=torch.int64)
    want, _ = _run_both(emu_dir, caches, slot_mapping, src, dst)
    _assert_same(caches, want)


def test_more_moves_than_one_round_in_list_order(emu_dir):
    """12 requests x Dmax 15 = 180 moves: two rounds of 128, request 8 cut between them (its moves
    0-7 in the first round, 8-14 in the second), with a first-round move reading a row a second-round
    move writes; exact for the rows ``compaction_rows`` makes (the ordering argument of
    cuda/kv_compact.cu)."""
    gen = torch.Generator().manual_seed(15)
    reqs = [Request(20, 3 * i, -1 if i % 3 else 5, "deep" if i % 2 else "random") for i in range(12)]
    reqs[8] = Request(40, 7, -1, "deep")
    slot_mapping, row_base, num_blocks = step_slots(reqs, 16, gen)
    src, dst = path_rows(reqs, row_base, 15, gen)
    assert src.numel() > kkv.ROUND
    first, second = set(src[:kkv.ROUND].tolist()), set(dst[kkv.ROUND:].tolist())
    assert any(r in second for r in first if r not in dst[:kkv.ROUND].tolist())  # read early, written late
    caches = make_caches("HND", 2, num_blocks, 1, 16, 8, torch.bfloat16, gen)
    want, launches = _run_both(emu_dir, caches, slot_mapping, src, dst)
    _assert_same(caches, want)
    assert launches == [("kv_compact_layers", (1, 2, 1), 0)]


@pytest.mark.parametrize("moves", [2, 9, 40, 128])
def test_any_rows_within_one_round_equal_gather_then_scatter(emu_dir, moves):
    """Rows no tree gives (swaps, cycles, a destination read by an earlier and by a later move),
    distinct destinations: within one round every load precedes every store, as the reference's
    gather precedes its scatter."""
    gen = torch.Generator().manual_seed(moves)
    t = 2 * moves + 3
    caches = make_caches("NHD", 2, -(-t // 16) + 1, 2, 16, 16, torch.bfloat16, gen)
    slot_mapping = torch.randperm(caches[0].shape[0] * 16, generator=gen)[:t]
    dst = torch.randperm(t, generator=gen)[:moves]
    src = dst[torch.randperm(moves, generator=gen)]  # a permutation of the destinations: cycles of moves
    src[::3] = torch.randint(0, t, (src[::3].numel(),), generator=gen)
    want, _ = _run_both(emu_dir, caches, slot_mapping, src, dst)
    _assert_same(caches, want)


def test_layers_of_two_layouts_take_one_launch_each(emu_dir):
    gen = torch.Generator().manual_seed(16)
    reqs = [Request(9, 3, -1, "deep"), Request(6, 21, 2)]
    slot_mapping, row_base, num_blocks = step_slots(reqs, 16, gen)
    src, dst = path_rows(reqs, row_base, 8, gen)
    nhd = make_caches("NHD", 2, num_blocks, 2, 16, 16, torch.bfloat16, gen)
    odd = make_caches("padded2", 1, num_blocks, 2, 16, 16, torch.bfloat16, gen)
    caches = [nhd[0], odd[0], nhd[1]]
    want, launches = _run_both(emu_dir, caches, slot_mapping, src, dst)
    _assert_same(caches, want)
    assert launches == [("kv_compact_layers", (1, 2, 1), 0), ("kv_compact_layers", (1, 1, 1), 0)]


def test_out_of_range_rows_and_padding_slots_are_skipped(emu_dir):
    """Moves no legal step has (a row past the slot mapping, vLLM's padding slot -1, a slot past the
    cache): skipped, the others done (memory safety)."""
    gen = torch.Generator().manual_seed(17)
    caches = make_caches("NHD", 1, 4, 2, 16, 16, torch.bfloat16, gen)
    slot_mapping = torch.tensor([5, 9, -1, 4 * 16, 30], dtype=torch.int64)
    src = torch.tensor([1, 2, 0, 7, 4], dtype=torch.int64)
    dst = torch.tensor([0, 1, 3, 0, 1], dtype=torch.int64)
    before = caches[0].clone()
    with emulated(emu_dir):
        kkv.kv_compact_layers(caches, slot_mapping, src, dst)
    after = before.clone()
    after[0, :, 5] = before[0, :, 9]  # move 0: row 1 (slot 9) -> row 0 (slot 5)
    after[0, :, 9] = before[1, :, 14]  # move 4: row 4 (slot 30) -> row 1 (slot 9); moves 1-3 are skipped
    _assert_same(caches, [after])


# ---------------------------------------------------------------------------------------------
# geometry, plans, reasons


def test_launch_geometry_at_the_27b_shape():
    kv = torch.empty(8, 16, 4, 512, dtype=torch.bfloat16).permute(0, 2, 1, 3)  # 4 KV heads x 2 x 256
    lay = kkv.cache_layout(kv)
    assert (lay.unit, lay.units_per_row) == (16, 256)  # 4 KB per row and layer in 16-byte copies
    assert kkv.launch_geometry(lay, 16, 16) == ((8, 16, 1), (64, 1, 1))  # batch 1, Dmax 16: 128 CTAs
    assert kkv.launch_geometry(lay, 16, 128) == ((8, 16, 1), (512, 1, 1))  # batch 8: still one round
    assert kkv.launch_geometry(lay, 16, 300) == ((8, 16, 1), (512, 1, 1))  # three rounds
    assert kkv.launch_geometry(lay, 16, 1) == ((8, 16, 1), (32, 1, 1))


def test_a_set_of_caches_is_uploaded_once(monkeypatch):
    from vllm_tfm.verify import packed_upload as pu

    uploads = []
    real = pu.packed_upload
    monkeypatch.setattr(pu, "packed_upload", lambda arrays, device: uploads.append(len(arrays)) or real(arrays, device))
    gen = torch.Generator().manual_seed(18)
    caches = make_caches("NHD", 3, 6, 2, 16, 16, torch.bfloat16, gen)
    rows = torch.zeros(2, dtype=torch.int64)
    slot_mapping = torch.arange(4, dtype=torch.int64)
    kkv._plans.clear()
    for _ in range(3):
        assert kkv.kv_compact_shape_reason(caches, slot_mapping, rows, rows) is None
    assert uploads == [1]
    plan = kkv._layers_plan(caches)
    assert [g.table.tolist() for g in plan] == [[kv.data_ptr() for kv in caches]]
    kkv._layers_plan(caches[:2])  # another set: its own table
    assert uploads == [1, 1]


def _reason(caches, slot_mapping=None, src=None, dst=None) -> str | None:
    rows = torch.zeros(3, dtype=torch.int64)
    slot_mapping = torch.arange(8, dtype=torch.int64) if slot_mapping is None else slot_mapping
    return kkv.kv_compact_shape_reason(caches, slot_mapping, rows if src is None else src, rows if dst is None else dst)


def test_reasons_the_kernel_refuses():
    gen = torch.Generator().manual_seed(19)
    good = make_caches("NHD", 2, 4, 2, 16, 16, torch.bfloat16, gen)
    assert _reason(good) is None
    assert "int64" in _reason(good, slot_mapping=torch.arange(8, dtype=torch.int32))
    assert "src_rows" in _reason(good, src=torch.zeros(3, dtype=torch.int64)[None])
    assert "contiguous" in _reason(good, dst=torch.zeros(6, dtype=torch.int64)[::2])
    assert "differ in length" in _reason(good, src=torch.zeros(4, dtype=torch.int64))
    assert "layer 1" in _reason([good[0], good[0][0]]) and "shape" in _reason([good[0][0]])
    assert "8" in _reason([torch.zeros(4, 2, 16, 4, dtype=torch.complex128)])
    assert "overlap" in _reason([torch.zeros(4, 2, 1, 8).expand(4, 2, 16, 8)])
    assert "share memory" in _reason([good[0], good[1], good[0]])
    assert "share memory" in _reason([good[0], good[0][:, :1]])
    assert "empty" in _reason([torch.zeros(0, 2, 16, 8)])
    # interleaved layers (vLLM's cross-layer layout, here at the finest level) share no byte; a view
    # half an element row off does
    buf = torch.zeros(4, 2, 16, 2, 8)
    assert _reason([buf[:, :, :, 0], buf[:, :, :, 1]]) is None
    shifted = torch.as_strided(buf, (4, 2, 16, 8), buf[:, :, :, 0].stride(), storage_offset=4)
    assert "layers 0 and 1 share memory" in _reason([buf[:, :, :, 0], shifted])
    with pytest.raises(ValueError, match="kv_compact_layers: .*overlap"):
        kkv.kv_compact_layers([torch.zeros(4, 2, 1, 8).expand(4, 2, 16, 8)], torch.arange(8), torch.zeros(1, dtype=torch.int64),
                              torch.zeros(1, dtype=torch.int64))
    # the runtime's check: a CPU step is NOT_CUDA before anything else
    assert kkv.kv_compact_unsupported_reason(good, torch.arange(8), torch.zeros(1, dtype=torch.int64),
                                             torch.zeros(1, dtype=torch.int64)) == kkv.NOT_CUDA


# ---------------------------------------------------------------------------------------------
# the runtime's dispatch and switch


@pytest.fixture
def switch_reset():
    yield
    rcommit.set_kv_compact_kernel(None)


@pytest.mark.parametrize("value, on", [(None, True), ("1", True), ("0", False), ("false", False), ("False", False),
                                       ("yes", True)])
def test_switch_follows_the_environment(monkeypatch, switch_reset, value, on):
    if value is None:
        monkeypatch.delenv(rcommit.KV_COMPACT_KERNEL_ENV, raising=False)
    else:
        monkeypatch.setenv(rcommit.KV_COMPACT_KERNEL_ENV, value)
    assert rcommit.KV_COMPACT_KERNEL_ENV == "VLLM_TFM_KV_COMPACT_KERNEL"
    assert rcommit.kv_compact_kernel_enabled() is on


def test_setter_overrides_the_environment_and_refuses_non_bools(monkeypatch, switch_reset):
    monkeypatch.setenv(rcommit.KV_COMPACT_KERNEL_ENV, "0")
    assert rcommit.set_kv_compact_kernel(True) is True and rcommit.kv_compact_kernel_enabled()
    assert rcommit.set_kv_compact_kernel(False) is False and not rcommit.kv_compact_kernel_enabled()
    assert rcommit.set_kv_compact_kernel(None) is False  # back to the environment's 0
    with pytest.raises(ValueError) as info:
        rcommit.set_kv_compact_kernel(1)  # type: ignore[arg-type]
    assert str(info.value) == "set_kv_compact_kernel takes True, False or None, got 1"
    assert "\n" not in str(info.value)


def _dispatch_case(seed: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    reqs = [Request(9, 3, -1, "deep"), Request(6, 21, 2)]
    slot_mapping, row_base, num_blocks = step_slots(reqs, 16, gen)
    src, dst = path_rows(reqs, row_base, 8, gen)
    return make_caches("NHD", 2, num_blocks, 2, 16, 16, torch.bfloat16, gen), slot_mapping, src, dst


def test_dispatch_runs_the_kernel_where_it_can(monkeypatch, emu_dir, switch_reset):
    monkeypatch.setattr(STATE, "metrics", Metrics(max_depth=8, device="cpu"))
    caches, slot_mapping, src, dst = _dispatch_case(20)
    want = [kv.clone() for kv in caches]
    kkv.kv_compact_reference(want, slot_mapping, src, dst)
    # a CUDA step whose kernel can run, emulated: try_kv_compact_layers' CUDA checks pass
    monkeypatch.setattr(kkv, "try_kv_compact_layers", lambda *a: kkv.kv_compact_layers(*a))
    monkeypatch.setattr(kkv, "kv_compact_reference", lambda *a: pytest.fail("the reference ran"))
    rcommit.set_kv_compact_kernel(True)
    with emulated(emu_dir) as launches:
        rcommit.compact_kv(caches, slot_mapping, src, dst)
    assert [name for name, *_ in launches] == ["kv_compact_layers"]
    _assert_same(caches, want)
    assert STATE.metrics.hooks["commit.kv_compact_kernel"] == 1 and "commit.kv_compact_reference" not in STATE.metrics.hooks


@pytest.mark.parametrize("reason, warns", [(kkv.NOT_CUDA, False), ("some unsupported layout", True)])
def test_dispatch_falls_back_to_the_reference_and_warns_once_on_a_cuda_reason(monkeypatch, switch_reset, reason, warns):
    caches, slot_mapping, src, dst = _dispatch_case(21)
    want = [kv.clone() for kv in caches]
    kkv.kv_compact_reference(want, slot_mapping, src, dst)
    monkeypatch.setattr(kkv, "try_kv_compact_layers", lambda *a: reason)
    monkeypatch.setattr(loader, "_warned", set())
    rcommit.set_kv_compact_kernel(True)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rcommit.compact_kv(caches, slot_mapping, src, dst)
        rcommit.compact_kv([kv.clone() for kv in caches], slot_mapping, src, dst)
    ours = [w for w in seen if "compact_kv falls back" in str(w.message)]
    assert len(ours) == (1 if warns else 0)
    if warns:
        assert reason in str(ours[0].message)
    _assert_same(caches, want)


def test_a_cpu_step_takes_the_reference_silently(switch_reset):
    caches, slot_mapping, src, dst = _dispatch_case(22)
    want = [kv.clone() for kv in caches]
    kkv.kv_compact_reference(want, slot_mapping, src, dst)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rcommit.compact_kv(caches, slot_mapping, src, dst)
    _assert_same(caches, want)


@pytest.mark.parametrize("off", ["switch", "kernels"])
def test_switched_off_the_kernel_is_not_tried(monkeypatch, switch_reset, off):
    monkeypatch.setattr(STATE, "metrics", Metrics(max_depth=8, device="cpu"))
    caches, slot_mapping, src, dst = _dispatch_case(23)
    want = [kv.clone() for kv in caches]
    kkv.kv_compact_reference(want, slot_mapping, src, dst)
    monkeypatch.setattr(kkv, "try_kv_compact_layers", lambda *a: pytest.fail("the kernel was tried"))
    if off == "switch":
        rcommit.set_kv_compact_kernel(False)
    else:
        rcommit.set_kv_compact_kernel(True)
        monkeypatch.setitem(kor._STATE, "enabled", False)  # VLLM_TFM_KERNELS=0
    rcommit.compact_kv(caches, slot_mapping, src, dst)
    _assert_same(caches, want)
    assert STATE.metrics.hooks["commit.kv_compact_reference"] == 1 and "commit.kv_compact_kernel" not in STATE.metrics.hooks
