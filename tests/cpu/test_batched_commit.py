"""The batched commit (``vllm_tfm.kernels.batched_commit``, ``runtime/commit.py`` ``commit_gdn_layers``):
one launch per kernel kind for all GDN layers of a step instead of two per layer.

On the CPU: the layer tables against the CUDA structs and the tensors they describe, which layers go
into one launch, the runtime's choice between the batched and the per-layer path and its switch, and
the batched kernels themselves run through the CUDA emulation (cuda/host_emu) against the per-layer
kernels, bit for bit, and against the torch references.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _emulation import emulated, emulation_build_dir
from _trees import random_tree_parents

from vllm_tfm.kernels import batched_commit as kb
from vllm_tfm.kernels import conv as kconv
from vllm_tfm.kernels import gdn as kgdn
from vllm_tfm.kernels.plan import CommitIndices
from vllm_tfm.verify import conv as ref_conv
from vllm_tfm.verify import gdn as ref_gdn
from vllm_tfm.vllm_plugin.runtime import commit as rcommit
from vllm_tfm.vllm_plugin.runtime.settings import (
    BATCHED_COMMIT_ENV,
    batched_commit_enabled,
)
from vllm_tfm.vllm_plugin.runtime.state import GDNStash
from vllm_tfm.vllm_plugin.runtime.step_kernels import StepKernels

pytestmark = pytest.mark.usefixtures("one_thread")

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"
H, K, HV, V, W, S = 1, 32, 2, 16, 4, 8
CONV_DIM = 2 * H * K + HV * V


# ---------------------------------------------------------------------------------------------
# tables


def _struct_fields(source: str, name: str) -> list[tuple[str, str]]:
    """(type, field) of ``struct name { ... };`` in a CUDA source, in declaration order."""
    text = (CUDA_DIR / source).read_text()
    body = re.search(r"struct " + name + r" \{(.*?)\};", text, re.DOTALL)
    assert body is not None, f"struct {name} not found in {source}"
    fields = []
    for decl in re.sub(r"//[^\n]*", "", body.group(1)).split(";"):
        decl = " ".join(decl.split())
        if not decl:
            continue
        first, *more = decl.split(",")
        ctype, last = first.rsplit(" ", 1)
        fields += [(ctype, n.strip()) for n in [last, *more]]
    return fields


@pytest.mark.parametrize(("source", "struct", "fields"), [
    ("gdn_tree_commit.cu", "GdnCommitLayer", kb.GDN_LAYER_FIELDS),
    ("tree_conv.cu", "ConvCommitLayer", kb.CONV_LAYER_FIELDS),
])
def test_table_fields_are_the_cuda_structs_fields(source, struct, fields):
    found = _struct_fields(source, struct)
    assert tuple(n for _, n in found) == fields
    # every field one 64-bit word (a row is len(fields) int64 values): pointers and i64 only
    assert all(t.endswith("*") or t == "i64" for t, _ in found), found


def _gdn_layer(gen: torch.Generator, t: int, acc: list[int], src: list[int], dst: list[int], slots: int = 12,
               **given: torch.Tensor) -> kb.GDNCommitLayer:
    made = {"k": lambda: torch.randn(t, H, K, generator=gen), "g": lambda: -torch.rand(t, HV, generator=gen),
            "delta": lambda: torch.randn(t, HV, V, generator=gen),
            "ssm_state": lambda: torch.randn(slots, HV, V, K, generator=gen)}
    ops = {name: given[name] if name in given else make() for name, make in made.items()}
    return kb.GDNCommitLayer(**ops, idx=CommitIndices.build(acc, src, dst, "cpu"))


def test_rows_point_at_the_normalised_operands_of_each_layer():
    g = torch.Generator().manual_seed(0)
    t = 6
    k_wide = torch.randn(t, H, 2 * K, generator=g)
    padded = torch.randn(12, HV, V, K + 4, generator=g)[..., :K]  # strides that are not the contiguous ones
    layer = _gdn_layer(g, t, [0, 2], [3, 0], [1, 4], k=k_wide[..., ::2], g=torch.randn(t, HV, generator=g).to(torch.bfloat16),
                       ssm_state=padded)
    row, made = kb.gdn_layer_row(layer)
    f = dict(zip(kb.GDN_LAYER_FIELDS, row))
    k_copy = next(m for m in made if m.data_ptr() == f["k"])
    assert k_copy.is_contiguous() and torch.equal(k_copy, layer.k)
    g_copy = next(m for m in made if m.data_ptr() == f["g"])
    assert g_copy.dtype == torch.float32 and torch.equal(g_copy, layer.g.float())
    assert f["delta"] == layer.delta.data_ptr()  # contiguous already: no copy
    assert f["src_state"] == f["dst_state"] == padded.data_ptr()
    assert (f["ss_slot"], f["ss_head"], f["ss_v"]) == padded.stride()[:3] == (f["ds_slot"], f["ds_head"], f["ds_v"])
    assert (f["src_idx"], f["dst_idx"]) == (layer.idx.src.data_ptr(), layer.idx.dst.data_ptr())
    assert len(made) == 2

    # slots that alias across requests: the row reads a snapshot of the sources, indexed 0..R-1
    aliased = _gdn_layer(g, t, [0, 2], [4, 1], [1, 4])
    assert aliased.idx.snapshot is not None
    row, made = kb.gdn_layer_row(aliased)
    f = dict(zip(kb.GDN_LAYER_FIELDS, row))
    (snap,) = made
    assert f["src_state"] == snap.data_ptr() and torch.equal(snap, aliased.ssm_state[[4, 1]])
    assert (f["ss_slot"], f["ss_head"], f["ss_v"]) == snap.stride()[:3]
    assert f["dst_state"] == aliased.ssm_state.data_ptr() and aliased.idx.src.tolist() == [0, 1]

    # conv: vLLM's dim-first view of a [slots, L, D] buffer, and x rows inside a wider tensor
    state = torch.randn(12, 6, CONV_DIM, generator=g).transpose(-1, -2)
    x_wide = torch.randn(t, CONV_DIM + 8, generator=g)
    cidx = CommitIndices.build([0, 2], [3, 5], [3, 5], "cpu", [1, 0], [0, 2])
    row, made = kb.conv_layer_row(kb.ConvCommitLayer(x_wide[:, :CONV_DIM], state, cidx, W))
    f = dict(zip(kb.CONV_LAYER_FIELDS, row))
    assert made == []
    assert (f["x"], f["x_row"]) == (x_wide.data_ptr(), CONV_DIM + 8)
    assert f["src_state"] == f["dst_state"] == state.data_ptr()
    assert (f["ss_slot"], f["ss_d"], f["ss_l"]) == (6 * CONV_DIM, 1, CONV_DIM) == (f["ds_slot"], f["ds_d"], f["ds_l"])
    assert (f["src_start"], f["dst_start"]) == (cidx.src_start.data_ptr(), cidx.dst_start.data_ptr())
    row, made = kb.conv_layer_row(kb.ConvCommitLayer(x_wide[:, ::2][:, :20], state[:, :20], cidx, W))
    assert dict(zip(kb.CONV_LAYER_FIELDS, row))["x_row"] == 20 and made[0].is_contiguous()


def test_layers_are_grouped_by_launch_key_and_cut_at_the_grid_limit():
    keys = ["a", "a", "b", "a", "b", "c"]
    assert kb.launch_batches(keys, 1) == [[0, 1, 3], [2, 4], [5]]
    assert kb.launch_batches(keys, 30000) == [[0, 1], [3], [2, 4], [5]]  # 2 * 30000 <= 65535 < 3 * 30000
    assert kb.launch_batches(keys, 3, max_blocks=7) == [[0, 1], [3], [2, 4], [5]]
    assert kb.launch_batches([], 4) == []
    with pytest.raises(ValueError, match="70000 requests exceed the kernels' grid limit of 65535"):
        kb.launch_batches(keys, 70000)


def test_tables_hold_one_row_per_layer_in_launch_order_and_upload_as_one_buffer():
    g = torch.Generator().manual_seed(1)
    t, acc = 5, [0, 3]
    layers = [_gdn_layer(g, t, acc, [0, 1], [2, 3]) for _ in range(4)]
    shared = layers[0].idx.accepted
    layers = [dataclasses.replace(lay, idx=dataclasses.replace(lay.idx, accepted=shared)) for lay in layers]
    layers[2] = dataclasses.replace(layers[2], k=layers[2].k.to(torch.bfloat16))  # another compile-time k type
    cidx = dataclasses.replace(CommitIndices.build(acc, [1, 2], [1, 2], "cpu", [0, 1], [1, 0]), accepted=shared)
    convs = [kb.ConvCommitLayer(torch.randn(t, CONV_DIM, generator=g), torch.randn(4, CONV_DIM, 5, generator=g), cidx, w)
             for w in (4, 1, 4)]
    tables = kb.build_commit_tables(layers, convs, num_requests=2)
    assert [(j.kind, j.start, j.layers) for j in tables.launches] == [
        ("gdn", 0, (0, 1, 3)), ("gdn", 3, (2,)), ("conv", 0, (0, 2))]  # width 1 keeps nothing: left out
    assert tables.launches[1].dtypes == (torch.bfloat16,) and tables.launches[0].dims == (H, HV, K, V)
    assert tables.launches[2].dims == (CONV_DIM, 4) and all(j.accepted is shared for j in tables.launches)
    order = [0, 1, 3, 2]
    assert tables.gdn_rows.shape == (4, 13) and tables.conv_rows.shape == (2, 14)
    assert tables.gdn_rows[:, 0].tolist() == [layers[i].k.data_ptr() for i in order]
    assert tables.conv_rows[:, 8].tolist() == [convs[i].conv_state.data_ptr() for i in (0, 2)]
    gdn_dev, conv_dev = kb.upload_commit_tables(tables, "cpu")
    assert gdn_dev.untyped_storage().data_ptr() == conv_dev.untyped_storage().data_ptr()  # one copy
    assert np.array_equal(gdn_dev.numpy(), tables.gdn_rows) and np.array_equal(conv_dev.numpy(), tables.conv_rows)


def test_library_entry_points_check_the_layer_counts():
    with pytest.raises(ValueError, match=r"one entry per layer, got \[2, 1, 2, 2, 2, 2\]"):
        kb.gdn_tree_commit_layers([torch.zeros(1)] * 2, [torch.zeros(1)], [torch.zeros(1)] * 2, torch.tensor([-1]),
                                  torch.tensor([0, 1]), torch.tensor([0]), [torch.zeros(1)] * 2, [torch.zeros(1)] * 2,
                                  [torch.zeros(1)] * 2)
    with pytest.raises(ValueError, match=r"one entry per layer, got \[2, 2, 2, 2, 2, 3\]"):
        ref_gdn.gdn_tree_commit_layers([torch.zeros(1)] * 2, [torch.zeros(1)] * 2, [torch.zeros(1)] * 2,
                                       torch.tensor([-1]), torch.tensor([0, 1]), torch.tensor([0]),
                                       [torch.zeros(1)] * 2, [torch.zeros(1)] * 2, [torch.zeros(1)] * 3)
    with pytest.raises(ValueError, match=r"one entry per layer, got \[1, 1, 1, 1, 2, 1\]"):
        ref_conv.tree_conv_commit_layers([torch.zeros(1)], torch.tensor([-1]), torch.tensor([0, 1]), torch.tensor([0]),
                                         [torch.zeros(1)], [torch.zeros(1)], [torch.zeros(1)], 4, [None, None])


# ---------------------------------------------------------------------------------------------
# the switch


@pytest.mark.parametrize(("value", "on"), [(None, True), ("0", False), ("false", False), ("False", False), ("1", True), ("", True)])
def test_batched_commit_is_on_unless_switched_off(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(BATCHED_COMMIT_ENV, raising=False)
    else:
        monkeypatch.setenv(BATCHED_COMMIT_ENV, value)
    assert batched_commit_enabled() is on


# ---------------------------------------------------------------------------------------------
# the runtime's choice: a step of GDN layers in KV-cache groups


class Step:
    """A step's spec trees, GDN layers (stashes) in groups, accepted paths; fresh states on demand."""

    def __init__(self, trees: list[torch.Tensor], last: list[int], num_groups: int, per_group: int, seed: int,
                 share_buffers: bool = False) -> None:
        g = torch.Generator().manual_seed(seed)
        self.trees = trees
        cu = np.zeros(len(trees) + 1, dtype=np.int64)
        cu[1:] = np.cumsum([t.numel() for t in trees])
        self.step = SimpleNamespace(spec_parents=torch.cat(trees).numpy(), spec_cu=cu)
        self.parents, self.cu = torch.cat(trees), torch.from_numpy(cu)
        r, t = len(trees), int(cu[-1])
        self.last = torch.tensor(last)
        self.num_acc = torch.tensor([_depth(tr, a) for tr, a in zip(trees, last)])
        slots = num_groups * r * (1 + S) + 3
        # every group's requests own disjoint slots (vLLM: a block belongs to one group)
        perm = torch.randperm(slots, generator=g)[: num_groups * r * (1 + S)].view(num_groups, r, 1 + S).to(torch.int32)
        prev = torch.randint(1, S + 2, (r,), generator=g).to(torch.int32)
        self.tables = StepKernels(self.step, torch.device("cpu"))
        groups = [self.tables.group(perm[i], prev) for i in range(num_groups)]
        self.ssm0, self.conv0, self.stashes = [], [], []
        for gi in range(num_groups):
            for li in range(per_group):
                if not share_buffers or gi == 0:
                    self.ssm0.append(torch.randn(slots, HV, V, K, generator=g))
                    self.conv0.append(torch.randn(slots, W - 1 + S, CONV_DIM, generator=g))
                else:  # vLLM shares one buffer between a layer of each group
                    self.ssm0.append(self.ssm0[li])
                    self.conv0.append(self.conv0[li])
                self.stashes.append(GDNStash(
                    x=torch.randn(t, CONV_DIM, generator=g), k=torch.randn(t, H, K, generator=g),
                    g=-torch.rand(t, HV, generator=g), delta=torch.randn(t, HV, V, generator=g),
                    state_indices=groups[gi].slots, prev_accepted=groups[gi].prev_accepted,
                    conv_state=None, ssm_state=None, width=W,  # type: ignore[arg-type]
                ))

    def fresh(self) -> list[GDNStash]:
        """The stashes on fresh copies of the initial states (buffers shared as at construction)."""
        copies: dict[int, torch.Tensor] = {}

        def copy(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in copies:
                copies[id(t)] = t.clone()
            return copies[id(t)]

        return [dataclasses.replace(s, ssm_state=copy(ss), conv_state=copy(cs).transpose(-1, -2))
                for s, ss, cs in zip(self.stashes, self.ssm0, self.conv0)]

    def commit(self, stashes: list[GDNStash], kernels: StepKernels | None) -> int | None:
        return rcommit.commit_gdn_layers(stashes, self.parents, self.cu, self.last, self.num_acc, kernels)


def _depth(tree: torch.Tensor, node: int) -> int:
    d = 0
    while tree[node] >= 0:
        node, d = int(tree[node]), d + 1
    return d


def _mixed_step(seed: int, num_groups: int = 3, per_group: int = 2, share_buffers: bool = False) -> Step:
    g = torch.Generator().manual_seed(seed)
    shapes = [(1, "chain"), (S + 1, "chain"), (S + 1, "star"), (S + 1, "deep"), (7, "random")]
    trees = [random_tree_parents(n, g, kind) for n, kind in shapes]
    last = [0, S, 3, S - 1, 0]  # the root only (0 drafts accepted) for two requests
    return Step(trees, last, num_groups, per_group, seed, share_buffers)


@contextmanager
def _on_kernel_path(monkeypatch: pytest.MonkeyPatch, unsupported: set[int] = frozenset()) -> Iterator[None]:
    """CPU tensors count as kernel-ready (the checks answer "inputs are not CUDA tensors" otherwise),
    except the k tensors whose id is in ``unsupported``."""
    monkeypatch.setattr(kgdn, "commit_unsupported_reason",
                        lambda k, d, s: "unsupported for the test" if id(k) in unsupported else None)
    monkeypatch.setattr(kconv, "conv_unsupported_reason", lambda x, c, w, *o: None)
    yield


@contextmanager
def _recorded_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[tuple[str, tuple]]]:
    """Kernel launches recorded, not run (the host work of the launch paths only)."""
    made: list[tuple[str, tuple]] = []

    def get_kernel(source, name, options, device_index=0):
        return SimpleNamespace(name=name)

    def launch(kernel, grid, block, args, shared_mem=0):
        made.append((kernel.name, tuple(grid)))

    for mod in (kgdn, kconv, kb):
        monkeypatch.setattr(mod, "get_kernel", get_kernel)
        monkeypatch.setattr(mod, "launch", launch)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    yield made


def test_switch_on_and_every_layer_on_the_kernel_path_gives_one_launch_per_kernel_kind(monkeypatch):
    step = _mixed_step(2)
    r, n = len(step.trees), len(step.stashes)
    with _on_kernel_path(monkeypatch), _recorded_launches(monkeypatch) as made:
        monkeypatch.setenv(BATCHED_COMMIT_ENV, "1")
        assert step.commit(step.fresh(), step.tables) == 2
        assert made == [("gdn_tree_commit_layers", (V // 16, HV, r * n)),
                        ("tree_conv_commit_layers", ((CONV_DIM + 255) // 256, r * n, 1))]
        made.clear()
        monkeypatch.setenv(BATCHED_COMMIT_ENV, "0")  # off: the per-layer path, two launches per layer
        assert step.commit(step.fresh(), step.tables) is None
        assert sorted(made) == sorted([("gdn_tree_commit", (V // 16, HV, r)),
                                       ("tree_conv_commit", ((CONV_DIM + 255) // 256, r, 1))] * n)


def test_a_layer_off_the_kernel_path_sends_every_layer_to_the_per_layer_path(monkeypatch):
    step = _mixed_step(3)
    monkeypatch.setenv(BATCHED_COMMIT_ENV, "1")
    odd = step.stashes[3]
    with _on_kernel_path(monkeypatch, unsupported={id(odd.k)}), _recorded_launches(monkeypatch) as made:
        stashes = step.fresh()
        assert step.commit(stashes, step.tables) is None
        names = [m[0] for m in made]
        # the odd layer's SSM state went through the reference (it ran: its destination slots changed)
        assert names.count("gdn_tree_commit") == len(stashes) - 1 and names.count("tree_conv_commit") == len(stashes)
        assert not any(name.endswith("_layers") for name in names)
        assert not torch.equal(stashes[3].ssm_state, step.ssm0[3])
        made.clear()
        # a layer whose slots are not one of the step's groups: per-layer path as well
        foreign = step.fresh()
        foreign[0] = dataclasses.replace(foreign[0], state_indices=foreign[0].state_indices.clone())
        monkeypatch.setattr(kgdn, "commit_unsupported_reason", lambda k, d, s: None)
        assert step.commit(foreign, step.tables) is None
        assert not any(name.endswith("_layers") for name, _ in made)
        assert rcommit.batched_commit_layers(foreign, step.tables, step.last, step.num_acc) is None
        made.clear()
        assert step.commit(step.fresh(), None) is None  # no kernel tables (a CPU step): the references
        assert made == []


# ---------------------------------------------------------------------------------------------
# the kernels, on the CPU through cuda/host_emu


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return emulation_build_dir(tmp_path_factory)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["mixed", "one_request", "shared_buffers", "bf16"])
def test_batched_kernels_equal_the_per_layer_kernels_bit_for_bit(monkeypatch, emu_dir, case):
    if case == "one_request":
        g = torch.Generator().manual_seed(7)
        step = Step([random_tree_parents(S + 1, g, "deep")], [S - 2], 3, 2, seed=7)
    else:
        step = _mixed_step(4, share_buffers=case == "shared_buffers")
    stashes_per_layer, stashes_batched = step.fresh(), step.fresh()
    if case == "bf16":  # bf16 keys and pre-conv inputs, bf16 conv window (the 27B checkpoint's dtypes)
        for stashes in (stashes_per_layer, stashes_batched):
            for i, s in enumerate(stashes):
                stashes[i] = dataclasses.replace(s, k=s.k.to(torch.bfloat16), x=s.x.to(torch.bfloat16),
                                                 conv_state=s.conv_state.to(torch.bfloat16))
    with _on_kernel_path(monkeypatch), emulated(emu_dir) as launches:
        monkeypatch.setenv(BATCHED_COMMIT_ENV, "0")
        step.commit(stashes_per_layer, step.tables)
        assert len(launches) == 2 * len(stashes_per_layer)
        monkeypatch.setenv(BATCHED_COMMIT_ENV, "1")
        assert step.commit(stashes_batched, step.tables) == 2
    assert [name for name, _, _ in launches[-2:]] == ["gdn_tree_commit_layers", "tree_conv_commit_layers"]
    changed = 0
    for a, b, ss0, cs0 in zip(stashes_per_layer, stashes_batched, step.ssm0, step.conv0):
        assert torch.equal(a.ssm_state, b.ssm_state) and torch.equal(a.conv_state, b.conv_state)
        changed += int(not torch.equal(b.ssm_state, ss0)) + int(not torch.equal(b.conv_state.transpose(-1, -2), cs0))
    assert changed == 2 * len(stashes_batched)  # every layer's state and window were written


@pytest.mark.slow
def test_library_batched_commits_match_the_references(emu_dir):
    """``gdn_tree_commit_layers`` / ``tree_conv_commit_layers`` (kernels, emulated) against the
    references' loops over layers, with slots that alias across requests (snapshots)."""
    g = torch.Generator().manual_seed(9)
    trees = [random_tree_parents(n, g, kind) for n, kind in ((6, "random"), (1, "chain"), (9, "deep"), (5, "star"))]
    parents = torch.cat(trees)
    cu = torch.zeros(len(trees) + 1, dtype=torch.long)
    cu[1:] = torch.tensor([t.numel() for t in trees]).cumsum(0)
    t, layers = parents.numel(), 3
    accepted = torch.tensor([4, 0, 7, 3])
    ks = [torch.randn(t, H, K, generator=g) for _ in range(layers)]
    gs = [-torch.rand(t, HV, generator=g) for _ in range(layers)]
    ds = [torch.randn(t, HV, V, generator=g) for _ in range(layers)]
    states = [torch.randn(7, HV, V, K, generator=g) for _ in range(layers)]
    src = [torch.tensor(s) for s in ([3, 3, 1, 0], [0, 1, 2, 3], [6, 5, 4, 3])]
    dst = [torch.tensor(s) for s in ([0, 1, 2, 3], [0, 1, 2, 3], [3, 4, 5, 6])]
    xs = [torch.randn(t, 40, generator=g) for _ in range(layers)]
    cstates = [torch.randn(5, 40, 6, generator=g) for _ in range(layers)]
    cs_src = [torch.tensor(s) for s in ([4, 4, 1, 2], [0, 1, 2, 3], [1, 2, 3, 4])]
    cs_dst = [torch.tensor(s) for s in ([0, 1, 2, 3], [0, 1, 2, 3], [1, 2, 3, 4])]
    s_start = [torch.tensor([1, 0, 0, 2]), None, torch.tensor([3, 3, 0, 1])]
    d_start = [torch.tensor([0, 2, 1, 0]), torch.tensor([1, 1, 1, 1]), None]

    want = [s.double() for s in states]
    ref_gdn.gdn_tree_commit_layers([k.double() for k in ks], [x.double() for x in gs], [d.double() for d in ds], parents,
                                   cu, accepted, want, src, dst)
    want_c = [c.clone() for c in cstates]
    ref_conv.tree_conv_commit_layers(xs, parents, cu, accepted, want_c, cs_src, cs_dst, 4, s_start, d_start)
    # CPU tensors: the kernels' checks say "not CUDA"; they are made kernel-ready for the emulation
    with emulated(emu_dir) as launches, pytest.MonkeyPatch.context() as mp:
        mp.setattr(kgdn, "commit_unsupported_reason", lambda *a: None)
        mp.setattr(kconv, "conv_unsupported_reason", lambda *a: None)
        kb.gdn_tree_commit_layers(ks, gs, ds, parents, cu, accepted, states, src, dst)
        kb.tree_conv_commit_layers(xs, parents, cu, accepted, cstates, cs_src, cs_dst, 4, s_start, d_start)
    assert [name for name, _, _ in launches] == ["gdn_tree_commit_layers", "tree_conv_commit_layers"]
    for got, ref in zip(states, want):
        assert float((got.double() - ref).norm() / ref.norm()) < 1e-5
    for got, ref in zip(cstates, want_c):
        assert torch.equal(got, ref)


# ---------------------------------------------------------------------------------------------
# reuse across full-graph replays (VLLM_TFM_COMMIT_REUSE)


def _replay_tables(step: Step, reuse: object) -> StepKernels:
    """A replay's kernel tables: the captured groups (same slot tensors), fresh per-step commit indices."""
    groups = {key: dataclasses.replace(g, commit=None) for key, g in step.tables.groups.items()}
    return StepKernels(step.step, torch.device("cpu"), plan=step.tables.plan, groups=groups, commit_reuse=reuse)


@pytest.mark.slow
def test_commit_reuse_launches_the_first_tables_again_and_writes_the_same_states(monkeypatch, emu_dir):
    from vllm_tfm.vllm_plugin.runtime.step_kernels import CommitReuse

    step = _mixed_step(5)
    r = len(step.trees)
    reused, rebuilt = step.fresh(), step.fresh()  # the same stash objects every "replay", as in a full graph
    reuse = CommitReuse()
    builds: list[int] = []
    real_build = kb.build_commit_tables
    monkeypatch.setattr(kb, "build_commit_tables", lambda *a: builds.append(1) or real_build(*a))
    accepted = [(step.last, step.num_acc), (torch.zeros(r, dtype=torch.long), torch.zeros(r, dtype=torch.long)),
                (step.last.flip(0).clamp(max=0), step.num_acc.flip(0).clamp(max=0))]
    indices = []
    monkeypatch.setenv(BATCHED_COMMIT_ENV, "1")
    with _on_kernel_path(monkeypatch), emulated(emu_dir) as launches:
        for i, (last, num_acc) in enumerate(accepted):
            tables = _replay_tables(step, reuse)
            assert rcommit.commit_gdn_layers(reused, step.parents, step.cu, last, num_acc, tables) == 2
            indices.append([tables.commit_indices(g, last, num_acc) for g in tables.groups.values()])
            assert len(builds) == 1 + i  # reuse: built and uploaded at the first replay only (+ i without reuse, below)
            assert rcommit.commit_gdn_layers(rebuilt, step.parents, step.cu, last, num_acc, _replay_tables(step, None)) == 2
            assert len(builds) == 2 + i  # without reuse: every step
            for a, b in zip(reused, rebuilt):
                assert torch.equal(a.ssm_state, b.ssm_state) and torch.equal(a.conv_state, b.conv_state)
    assert len(launches) == 4 * len(accepted)
    first = [t for pair in indices[0] for ci in pair for t in (ci.accepted, ci.src, ci.dst, ci.dst_start)]
    for later in indices[1:]:  # the same tensor objects every step (filled in place): the rows stay valid
        assert all(a is b for a, b in zip(first, [t for pair in later for ci in pair for t in (ci.accepted, ci.src, ci.dst,
                                                                                                 ci.dst_start)]))
    # the values are those of the indices made anew
    fresh = _replay_tables(step, None)
    last, num_acc = accepted[-1]
    for (got_g, got_c), g in zip(indices[-1], fresh.groups.values()):
        want_g, want_c = fresh.commit_indices(g, last, num_acc)
        for got, want in ((got_g, want_g), (got_c, want_c)):
            for f in ("accepted", "src", "dst", "src_start", "dst_start"):
                assert torch.equal(getattr(got, f).to(torch.long), getattr(want, f).to(torch.long)), f
    # another tensor behind a layer (a new stash): the checks and rows run again, then are kept again
    reused[2] = dataclasses.replace(reused[2], k=reused[2].k.clone())
    with _on_kernel_path(monkeypatch), _recorded_launches(monkeypatch):
        rcommit.commit_gdn_layers(reused, step.parents, step.cu, step.last, step.num_acc, _replay_tables(step, reuse))
        assert len(builds) == len(accepted) + 2
        rcommit.commit_gdn_layers(reused, step.parents, step.cu, step.last, step.num_acc, _replay_tables(step, reuse))
        assert len(builds) == len(accepted) + 2


def test_commit_reuse_runs_the_kernel_checks_once_per_set_of_tensors(monkeypatch):
    from vllm_tfm.vllm_plugin.runtime.step_kernels import CommitReuse

    step = _mixed_step(6)
    stashes = step.fresh()
    calls: list[int] = []
    monkeypatch.setattr(kgdn, "commit_unsupported_reason", lambda k, d, s: calls.append(1))
    monkeypatch.setattr(kconv, "conv_unsupported_reason", lambda x, c, w, *o: None)
    reuse = CommitReuse()
    for _ in range(3):
        assert rcommit.batched_commit_layers(stashes, _replay_tables(step, reuse), step.last, step.num_acc) is not None
    assert len(calls) == len(stashes)
    stashes[0] = dataclasses.replace(stashes[0], width=W - 1)  # a different conv width: checked again
    rcommit.batched_commit_layers(stashes, _replay_tables(step, reuse), step.last, step.num_acc)
    assert len(calls) == 2 * len(stashes)
    for _ in range(2):  # no reuse: every call
        rcommit.batched_commit_layers(stashes, _replay_tables(step, None), step.last, step.num_acc)
    assert len(calls) == 4 * len(stashes)
    # a failing check is never remembered
    monkeypatch.setattr(kgdn, "commit_unsupported_reason", lambda k, d, s: "no")
    assert rcommit.batched_commit_layers(stashes, _replay_tables(step, CommitReuse()), step.last, step.num_acc) is None


def test_reusing_commit_keeps_nothing_when_rows_point_into_copies_made_for_the_call(monkeypatch):
    step = _mixed_step(7)
    stashes = step.fresh()
    with _on_kernel_path(monkeypatch):
        layers = rcommit.batched_commit_layers(stashes, step.tables, step.last, step.num_acc)
    gdn, conv = layers
    with _recorded_launches(monkeypatch) as made:
        n, kept = kb.commit_layers_reusing(step.tables.plan, gdn, conv, None)
        assert n == 2 and kept is not None and kept.num_requests == len(step.trees)
        n2, kept2 = kb.commit_layers_reusing(step.tables.plan, gdn, conv, kept)
        assert n2 == 2 and kept2 is kept and len(made) == 4
        k0 = gdn[0].k
        strided = [dataclasses.replace(gdn[0], k=torch.cat([k0, k0], -1)[..., : k0.shape[-1]]), *gdn[1:]]
        assert not strided[0].k.is_contiguous()
        n3, kept3 = kb.commit_layers_reusing(step.tables.plan, strided, conv, kept)
        assert n3 == 2 and kept3 is None  # a contiguous copy of k was made for this call's rows
