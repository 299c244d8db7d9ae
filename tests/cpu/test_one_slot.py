"""One GDN state slot per request (``gdn_state_slots: "one"``, ``runtime/one_slot.py``).

The oracle is the plain chain (causal conv over [window | path], the per-token recurrence), as in
test_runtime_commit.py, with the one-slot layout: a request's state in slot ``[n, 0]``, its conv window
in columns 0 .. W - 2 of that slot, across steps that verify trees (our sampler) and steps whose chains
vLLM's sampler verified (accepted counts read from its sampled tokens). Every other slot and column
must stay as it was.
"""

from __future__ import annotations

import contextlib
import dataclasses
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from _emulation import emulated, emulation_build_dir
from _trees import path_of, proposal_store, random_tree_parents
from vllm_tfm.kernels import conv as kconv
from vllm_tfm.kernels import gdn as kgdn
from vllm_tfm.models.tfm_config import TfmConfig
from vllm_tfm.verify.gdn import gdn_chain_recurrence, gdn_gates
from vllm_tfm.vllm_plugin.options import resolve_tfm_options
from vllm_tfm.vllm_plugin.runtime import gdn as gdn_mod
from vllm_tfm.vllm_plugin.runtime import graph_dispatch, hooks
from vllm_tfm.vllm_plugin.runtime.commit import commit_gdn_layers, spec_rows
from vllm_tfm.vllm_plugin.runtime.gdn import spec_tree_gdn
from vllm_tfm.vllm_plugin.runtime.inputs import build_step_tree
from vllm_tfm.vllm_plugin.runtime.one_slot import (
    chain_accepted,
    commit_destinations,
    concurrency_with_slots,
    one_slot_kv_cache_specs,
    per_draft_concurrency_notice,
    read_offsets,
    resolve_gdn_state_slots,
)
from vllm_tfm.vllm_plugin.runtime.state import STATE, GDNStash
from vllm_tfm.vllm_plugin.runtime.step_kernels import StepKernels

F64 = torch.float64
H, K, HV, V, W, S = 2, 32, 4, 16, 4, 5  # heads, dims (the commit kernel's K: a multiple of 32), conv width, B
CONV_DIM = 2 * H * K + HV * V
L = W - 1 + S  # vLLM's conv state columns (kept in this mode: only 0 .. W - 2 are used)


@pytest.fixture(autouse=True)
def clean_state():
    saved = STATE.step, STATE.one_slot, STATE.metrics
    yield
    STATE.step, STATE.one_slot, STATE.metrics = saved


class OneSlotLayer:
    """One GDN layer's caches with one slot per request, garbage everywhere else."""

    def __init__(self, num_req: int, seed: int, dtype: torch.dtype = F64) -> None:
        g = torch.Generator().manual_seed(seed)
        self.g = g
        self.num_slots = 3 * num_req + 2
        self.conv_sd = torch.randn(self.num_slots, L, CONV_DIM, generator=g, dtype=dtype)  # vLLM's [slots, L, D] storage
        self.conv = self.conv_sd.transpose(-1, -2)
        self.ssm = torch.randn(self.num_slots, HV, V, K, generator=g, dtype=dtype)
        # vLLM's table of a one-block MambaSpec: one column
        self.slots = torch.randperm(self.num_slots, generator=g)[:num_req].view(num_req, 1).to(torch.int32)
        self.weight = 0.5 * torch.randn(CONV_DIM, W, generator=g, dtype=dtype)
        self.bias = 0.1 * torch.randn(CONV_DIM, generator=g, dtype=dtype)
        self.A_log = torch.rand(HV, generator=g, dtype=dtype).log()
        self.dt_bias = 0.5 * torch.randn(HV, generator=g, dtype=dtype)

    def chain_truth(self, window: torch.Tensor, state: torch.Tensor, xs: torch.Tensor, a: torch.Tensor,
                    b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Outputs [n, HV, V], final state and final window [W - 1, D] of the chain over xs."""
        seq = torch.cat([window, xs]).T[None]
        y = F.silu(F.conv1d(seq, self.weight[:, None, :], self.bias, groups=CONV_DIM)[0].T)
        q, k, v = torch.split(y, [H * K, H * K, HV * V], dim=-1)
        g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        o, st = gdn_chain_recurrence(q.reshape(-1, H, K), k.reshape(-1, H, K), v.reshape(-1, HV, V), g, beta, state)
        return o, st, torch.cat([window, xs])[-(W - 1):]

    def verify(self, parents_list: list[torch.Tensor], xs: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               kernels: StepKernels | None = None) -> tuple[tuple[torch.Tensor, GDNStash], torch.Tensor]:
        cu = torch.zeros(len(parents_list) + 1, dtype=torch.long)
        cu[1:] = torch.tensor([p.numel() for p in parents_list]).cumsum(0)
        return spec_tree_gdn(
            xs, a, b, torch.cat(parents_list), cu, self.conv, self.ssm, self.slots, read_offsets(self.slots),
            self.weight, self.bias, "silu", self.A_log, self.dt_bias, H, K, HV, V, kernels=kernels,
        ), cu


def _sampled_tokens(accepted: list[int], width: int) -> torch.Tensor:
    """vLLM's sampler output of chains: accepted drafts + the bonus token, -1 after."""
    out = torch.full((len(accepted), width), -1, dtype=torch.int64)
    for r, p in enumerate(accepted):
        out[r, : p + 1] = torch.arange(100 * r, 100 * r + p + 1)
    return out


def test_tree_and_chain_steps_keep_the_state_in_slot_zero():
    """Three steps (trees, chains verified by vLLM's sampler, trees): outputs and committed states are the
    chain's, always read from and written to slot [n, 0] / columns 0 .. W - 2; nothing else is written."""
    num_req = 3
    lay = OneSlotLayer(num_req, seed=3)
    g = lay.g
    windows = [lay.conv[lay.slots[n, 0], :, : W - 1].T.clone() for n in range(num_req)]
    states = [lay.ssm[lay.slots[n, 0]].clone() for n in range(num_req)]
    conv_before, ssm_before = lay.conv_sd.clone(), lay.ssm.clone()
    for kind in ("tree", "chain", "tree"):
        if kind == "tree":  # a one-node tree (a spec row without drafts) among them
            parents_list = [random_tree_parents(n, g, k) for n, k in ((1 + S, "random"), (1, "chain"), (1 + S, "deep"))]
        else:
            parents_list = [torch.arange(-1, n - 1) for n in (1 + S, 3, 1 + S)]
        n_tok = sum(p.numel() for p in parents_list)
        xs = torch.randn(n_tok, CONV_DIM, generator=g, dtype=F64)
        a = torch.randn(n_tok, HV, generator=g, dtype=F64)
        b = torch.randn(n_tok, HV, generator=g, dtype=F64)
        (out, stash), cu = lay.verify(parents_list, xs, a, b)
        assert torch.equal(lay.conv_sd, conv_before) and torch.equal(lay.ssm, ssm_before)  # the verify writes nothing
        for n, parents in enumerate(parents_list):
            s = int(cu[n])
            for i in range(parents.numel()):
                rows = [s + j for j in path_of(parents, i)]
                o_ref, _, _ = lay.chain_truth(windows[n], states[n], xs[rows], a[rows], b[rows])
                torch.testing.assert_close(out[s + i], o_ref[-1], rtol=1e-10, atol=1e-10)
        if kind == "tree":
            last = torch.tensor([int(torch.randint(0, p.numel(), (1,), generator=g)) for p in parents_list])
            num_acc = torch.tensor([len(path_of(p, int(x))) - 1 for p, x in zip(parents_list, last)])
        else:  # vLLM's sampler verified the chains: the counts from its tokens
            accepted = [int(torch.randint(0, p.numel(), (1,), generator=g)) for p in parents_list]
            last, num_acc = chain_accepted(_sampled_tokens(accepted, 1 + S))
            assert last.tolist() == accepted
        commit_gdn_layers([stash], torch.cat(parents_list), cu, last, commit_destinations(num_acc))
        for n, parents in enumerate(parents_list):
            s = int(cu[n])
            rows = [s + j for j in path_of(parents, int(last[n]))]
            _, st, win = lay.chain_truth(windows[n], states[n], xs[rows], a[rows], b[rows])
            slot = int(lay.slots[n, 0])
            torch.testing.assert_close(lay.ssm[slot], st, rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(lay.conv[slot, :, : W - 1], win.T, rtol=0, atol=0)
            windows[n], states[n] = win, st
        owned = lay.slots[:, 0].long()
        others = torch.ones(lay.num_slots, dtype=torch.bool)
        others[owned] = False
        assert torch.equal(lay.ssm[others], ssm_before[others])  # no other request's state
        assert torch.equal(lay.conv_sd[others], conv_before[others])
        assert torch.equal(lay.conv_sd[owned, W - 1:], conv_before[owned, W - 1:])  # vLLM's spare columns untouched
        conv_before, ssm_before = lay.conv_sd.clone(), lay.ssm.clone()


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return emulation_build_dir(tmp_path_factory)


@pytest.mark.slow
def test_the_kernel_paths_commit_tables_write_slot_zero_in_place(emu_dir, monkeypatch):
    """The runtime's kernel tables (``StepKernels.group`` / ``commit_indices``) on a one-column table with the
    one-slot offsets, the kernels emulated on the CPU: the same states and windows as the references."""
    num_req = 4
    trees = [random_tree_parents(n, torch.Generator().manual_seed(n), k)
             for n, k in ((1 + S, "random"), (1, "chain"), (1 + S, "deep"), (4, "star"))]
    parents = torch.cat(trees)
    cu = np.zeros(num_req + 1, dtype=np.int64)
    cu[1:] = np.cumsum([t.numel() for t in trees])
    g = torch.Generator().manual_seed(11)
    t = int(cu[-1])
    lay = OneSlotLayer(num_req, seed=5, dtype=torch.float32)
    stash = GDNStash(x=torch.randn(t, CONV_DIM, generator=g), k=torch.randn(t, H, K, generator=g),
                     g=-torch.rand(t, HV, generator=g), delta=torch.randn(t, HV, V, generator=g),
                     state_indices=lay.slots.long(), prev_accepted=read_offsets(lay.slots).long(),
                     conv_state=lay.conv, ssm_state=lay.ssm, width=W)
    last = torch.tensor([3, 0, S, 2])
    num_acc = torch.tensor([len(path_of(tr, int(a))) - 1 for tr, a in zip(trees, last)])
    want_ssm, want_conv = lay.ssm.double(), lay.conv_sd.clone()
    ref = dataclasses.replace(stash, ssm_state=want_ssm, conv_state=want_conv.transpose(-1, -2),
                              k=stash.k.double(), g=stash.g.double(), delta=stash.delta.double())
    commit_gdn_layers([ref], parents, torch.from_numpy(cu), last, commit_destinations(num_acc))
    tables = StepKernels(SimpleNamespace(spec_parents=parents.numpy(), spec_cu=cu), torch.device("cpu"), one_slot=True)
    group = tables.group(lay.slots, read_offsets(lay.slots))
    stash = dataclasses.replace(stash, state_indices=group.slots, prev_accepted=group.prev_accepted)
    monkeypatch.setattr(kgdn, "commit_unsupported_reason", lambda *a: None)
    monkeypatch.setattr(kconv, "conv_unsupported_reason", lambda *a: None)
    with emulated(emu_dir) as launches:
        assert commit_gdn_layers([stash], parents, torch.from_numpy(cu), last, commit_destinations(num_acc), tables) == 2
    assert [name for name, _, _ in launches] == ["gdn_tree_commit_layers", "tree_conv_commit_layers"]
    gdn_idx, conv_idx = group.commit
    assert torch.equal(gdn_idx.src, lay.slots[:, 0]) and torch.equal(gdn_idx.dst, lay.slots[:, 0])
    assert torch.equal(conv_idx.src_start, torch.zeros(num_req, dtype=torch.int32))
    assert torch.equal(conv_idx.dst_start, torch.zeros(num_req, dtype=torch.int32))
    assert float((lay.ssm.double() - want_ssm).norm() / want_ssm.norm()) < 1e-6
    assert torch.equal(lay.conv_sd, want_conv)


def test_chain_accepted_counts_valid_tokens_of_the_spec_rows():
    out = torch.tensor([[5, 7, -1, -1], [3, -1, -1, -1], [9, 9, 9, 9], [4, -1, -1, -1]])
    last, p = chain_accepted(out)
    assert last.tolist() == p.tolist() == [1, 0, 3, 0]
    step = SimpleNamespace(num_reqs=4, num_spec_reqs=2, dev={"spec_req_index": torch.tensor([0, 2])}.get)
    last, p = chain_accepted(spec_rows(step, out))  # rows 1 and 3 are not spec rows
    assert last.tolist() == [1, 3] and last.dtype == torch.int64
    assert chain_accepted(torch.full((1, 3), -1))[0].tolist() == [0]  # a discarded row: never below 0
    assert commit_destinations(torch.tensor([3, 0, 2])).tolist() == [0, 0, 0]
    offsets = read_offsets(torch.zeros(3, 1, dtype=torch.int32))
    assert offsets.tolist() == [1, 1, 1] and offsets.dtype == torch.int32
    assert read_offsets(torch.zeros(2, 6, dtype=torch.int32)).data_ptr() == offsets.data_ptr()  # one buffer


def test_kv_cache_specs_hold_one_block_with_vllms_page():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    mamba = MambaSpec(block_size=4096, shapes=((L, CONV_DIM), (HV, V, K)), dtypes=(torch.bfloat16, torch.float32),
                      page_size_padded=16384, num_speculative_blocks=S)
    attn = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    out = one_slot_kv_cache_specs({"gdn.0": mamba, "attn.0": attn})
    assert out["attn.0"] is attn
    got = out["gdn.0"]
    assert got.num_speculative_blocks == 0
    assert (got.shapes, got.dtypes, got.page_size_bytes, got.block_size) == (mamba.shapes, mamba.dtypes, 16384, 4096)
    cfg = SimpleNamespace(cache_config=SimpleNamespace(mamba_cache_mode="none"))
    assert mamba.max_num_blocks_per_req(cfg, 4096) == 1 + S
    assert got.max_num_blocks_per_req(cfg, 4096) == 1
    assert got.max_memory_usage_bytes(cfg) == 16384 and mamba.max_memory_usage_bytes(cfg) == (1 + S) * 16384


def test_the_runner_hook_changes_the_specs_of_one_slot_tfm_runners_only():
    from vllm.v1.kv_cache_interface import MambaSpec

    mamba = MambaSpec(block_size=64, shapes=((L, CONV_DIM),), dtypes=(torch.float32,), num_speculative_blocks=S)
    wrapped = hooks._wrap_get_kv_cache_spec(lambda self: {"gdn": mamba})
    STATE.one_slot = True
    assert wrapped(SimpleNamespace(_tfm_enabled=True))["gdn"].num_speculative_blocks == 0
    assert wrapped(SimpleNamespace(_tfm_enabled=False))["gdn"] is mamba  # not a tfm runner
    STATE.one_slot = False
    assert wrapped(SimpleNamespace(_tfm_enabled=True))["gdn"] is mamba  # per_draft


def test_steps_with_drafts_take_the_gdn_tree_path_in_one_slot_mode():
    store = proposal_store({"t": ([1, 2, 3], [-1, 0, 0, 1]), "c": ([4, 5, 6], [-1, 0, 1, 2])})
    req_ids, nst = ["t", "c", "p"], np.array([4, 4, 5])
    spec = {"t": [1, 2, 3], "c": [4, 5, 6]}
    trees = build_step_tree(req_ids, nst, spec, store, allow_trees=True, one_slot=True)
    assert trees.tree_active and not trees.gdn_tree and trees.tree_gdn
    native = build_step_tree(req_ids, nst, spec, store, allow_trees=False, one_slot=True)  # logprobs, penalties
    assert not native.tree_active and native.gdn_tree and native.tree_gdn
    assert native.dev("spec_parents").tolist() == [-1, 0, 1, 2, -1, 0, 1, 2]  # verified as chains
    assert native.dev("spec_cu").tolist() == [0, 4, 8] and native.dev("spec_req_index").tolist() == [0, 1]
    chains = build_step_tree(["c"], np.array([4]), {"c": [4, 5, 6]}, store, allow_trees=True, one_slot=True)
    assert not chains.tree_active and chains.gdn_tree  # only chains: vLLM's sampler, our GDN path
    plain = build_step_tree(["p"], np.array([1]), {}, store, allow_trees=True, one_slot=True)
    assert not plain.gdn_tree and not plain.tree_gdn  # no drafts: vLLM's own decode
    per_draft = build_step_tree(req_ids, nst, spec, store, allow_trees=False)
    assert not per_draft.gdn_tree and not per_draft.tree_gdn


@contextlib.contextmanager
def _context(md: Any):
    import vllm.forward_context as vfc

    fc = SimpleNamespace(attn_metadata={"layer.0": md}, cudagraph_runtime_mode=None)
    with mock.patch.object(vfc, "get_forward_context", lambda: fc):
        yield


def test_vllms_chain_kernel_never_sees_spec_rows_in_one_slot_mode():
    layer = SimpleNamespace(prefix="layer.0")
    calls: list[str] = []
    original = lambda self, **kw: calls.append("vllm")  # noqa: E731
    spec_md = SimpleNamespace(spec_sequence_masks=torch.ones(2, dtype=torch.bool))
    plain_md = SimpleNamespace(spec_sequence_masks=None, num_prefills=1, num_decodes=0)
    args = dict(mixed_qkv=None, b=None, a=None, core_attn_out=None)
    with mock.patch.dict(gdn_mod._ORIGINAL, {"_forward_core": original}), \
            mock.patch.object(gdn_mod, "_tree_step_forward_core", lambda *a: calls.append("tree")):
        STATE.one_slot = True
        for step in (None, SimpleNamespace(tree_gdn=False, is_spec=None)):
            STATE.step = step
            with _context(spec_md), pytest.raises(RuntimeError, match="got speculative rows .* one GDN state slot per "
                                                                      "request .* other requests' state slots"):
                gdn_mod.tree_forward_core(layer, **args)
            with _context(plain_md):  # prefills and plain decodes stay vLLM's
                gdn_mod.tree_forward_core(layer, **args)
        assert calls == ["vllm", "vllm"]
        STATE.step = SimpleNamespace(tree_gdn=True)  # a gdn_tree step: our path
        with _context(spec_md):
            gdn_mod.tree_forward_core(layer, **args)
        assert calls[-1] == "tree"
        STATE.one_slot, STATE.step = False, None  # per_draft: vLLM's chain kernel as before
        with _context(spec_md):
            gdn_mod.tree_forward_core(layer, **args)
        assert calls[-1] == "vllm"


def _dispatch(step: Any, one_slot: bool) -> tuple[str, list[bool]]:
    calls: list[bool] = []

    def orig(self: Any, num_tokens: int, num_reqs: int, nst: Any, max_nst: int, use_cascade_attn: bool, **kw: Any):
        calls.append(use_cascade_attn)
        mode = "PIECEWISE" if use_cascade_attn else "FULL"
        return SimpleNamespace(name=mode), SimpleNamespace(num_tokens=num_tokens)

    STATE.step, STATE.one_slot, STATE.metrics = step, one_slot, None
    runner = SimpleNamespace(_tfm_enabled=True, _tfm_tree_graphs=None)
    out = graph_dispatch._wrap_determine(orig)(runner, 8, 2, None, 4, False)
    return out[0].name, calls


def test_one_slot_steps_never_replay_vllms_full_graphs():
    chain_step = SimpleNamespace(tree_active=False, num_tokens=8)
    assert _dispatch(chain_step, one_slot=False) == ("FULL", [False])  # per_draft without tree graphs: vLLM decides
    assert _dispatch(chain_step, one_slot=True) == ("PIECEWISE", [True])
    assert _dispatch(None, one_slot=True) == ("PIECEWISE", [True])


def test_a_failed_tree_graph_capture_leaves_a_one_slot_engine_on_piecewise_graphs(caplog: pytest.LogCaptureFixture):
    from vllm_tfm.vllm_plugin.runtime.full_graphs import FullTreeGraphsUnavailable, TreeGraphs

    graphs = TreeGraphs(budget=4, max_reqs=3, max_seq_len=64, device=torch.device("cpu"))
    runner = SimpleNamespace(_tfm_enabled=True, _tfm_tree_graphs=graphs)
    captured: list[tuple[int, str, bool]] = []

    def orig(self: Any, desc: Any, mode: Any) -> str:
        if STATE.step is not None:
            raise FullTreeGraphsUnavailable("a bfloat16 SSM state")
        captured.append((desc.num_tokens, mode.name, desc.uniform))
        return "vllm's capture"

    wrapped = graph_dispatch._wrap_warmup_and_capture(orig)
    full, piecewise = SimpleNamespace(name="FULL"), SimpleNamespace(name="PIECEWISE")
    STATE.one_slot = True
    try:
        with caplog.at_level("WARNING", logger="vllm.tfm"):
            # the tree graph's capture fails: no tree graphs, and vLLM's own full decode graph (its chain kernel
            # would read 1 + B slots of a one-slot table) is not captured in its place
            assert wrapped(runner, SimpleNamespace(uniform=True, num_tokens=10), full) is None
        assert runner._tfm_tree_graphs is None and captured == []
        assert [r.getMessage() for r in caplog.records] == [
            "vllm-tfm: full CUDA graphs of tree steps are off: a bfloat16 SSM state. Steps with drafts replay the "
            "piecewise graphs (one GDN state slot per request: vLLM's own full decode graphs are not captured)."]
        assert wrapped(runner, SimpleNamespace(uniform=True, num_tokens=5), full) is None  # the next sizes: the same
        assert wrapped(runner, SimpleNamespace(uniform=False, num_tokens=8), piecewise) == "vllm's capture"
        assert wrapped(runner, SimpleNamespace(uniform=False, num_tokens=8), full) == "vllm's capture"  # mixed batches
        assert captured == [(8, "PIECEWISE", False), (8, "FULL", False)]
        # a runner that is no tfm runner (another engine in the process) captures as vLLM does
        assert wrapped(SimpleNamespace(), SimpleNamespace(uniform=True, num_tokens=5), full) == "vllm's capture"
    finally:
        STATE.one_slot = False
    # and these steps never replay a full graph: the dispatcher is kept off FULL (the test above)
    assert _dispatch(SimpleNamespace(tree_active=True, num_tokens=8), one_slot=True) == ("PIECEWISE", [True])


def test_commit_of_a_gdn_tree_step_takes_vllms_counts_and_moves_no_kv(monkeypatch):
    store = proposal_store({"c": ([4, 5, 6], [-1, 0, 1, 2])})
    step = build_step_tree(["p", "c"], np.array([3, 4]), {"c": [4, 5, 6]}, store, allow_trees=False, one_slot=True)
    step.gdn = {"layer.0": object(), "layer.1": object()}
    seen: dict[str, Any] = {}

    def commit(stashes, parents, cu, last, num_acc, kernels):
        seen.update(n=len(stashes), parents=parents.tolist(), cu=cu.tolist(), last=last.tolist(), dst=num_acc.tolist())

    monkeypatch.setattr(hooks, "commit_gdn_layers", commit)
    monkeypatch.setattr(hooks, "compact_kv", lambda *a: pytest.fail("a chain's K/V needs no move"))
    monkeypatch.setattr(hooks, "step_kernels", lambda *a: None)
    STATE.metrics = SimpleNamespace(hook=lambda name: None)
    runner = SimpleNamespace(_tfm_num_gdn=2)
    out = torch.tensor([[17, -1, -1, -1], [4, 5, 9, -1]])  # row 0 is a prefill; the chain accepted 2 drafts
    STATE.one_slot = True
    hooks.commit_step(runner, step, out)
    assert seen == {"n": 2, "parents": [-1, 0, 1, 2], "cu": [0, 4], "last": [2], "dst": [0]}
    STATE.one_slot = False  # the commit of such a step in the 1 + B layout would write slot [n, p]
    hooks.commit_step(runner, step, out)
    assert seen["dst"] == [2]
    with pytest.raises(RuntimeError, match="chains vLLM's sampler verified reached the commit without its tokens"):
        hooks.commit_step(runner, step)


def test_the_option_is_read_from_every_source():
    assert TfmConfig(proposal="ddtree").gdn_state_slots == "auto"
    assert resolve_tfm_options(None, {"gdn_state_slots": "one"}, 16, environ={}).gdn_state_slots == "one"
    assert resolve_tfm_options(None, {"gdn_state_slots": "per_draft"}, 16, environ={}).gdn_state_slots == "per_draft"
    env = {"VLLM_TFM_GDN_STATE_SLOTS": "one"}
    assert resolve_tfm_options(None, {}, 16, environ=env).gdn_state_slots == "one"
    with pytest.raises(ValueError, match=r"^speculative_config gdn_state_slots='two': gdn_state_slots: Input should be "
                                         r"'auto', 'per_draft' or 'one'$"):
        resolve_tfm_options(None, {"gdn_state_slots": "two"}, 16, environ={})


def test_auto_is_one_slot_on_one_gpu_and_per_draft_with_parallelism():
    assert resolve_gdn_state_slots("auto") == resolve_gdn_state_slots("auto", 1, 1) == ("one", "'auto' on one GPU")
    assert resolve_gdn_state_slots("auto", 2) == (
        "per_draft", "'auto' at tensor parallelism 2, data parallelism 1: one slot has run on one GPU only")
    assert resolve_gdn_state_slots("auto", 1, 2)[0] == "per_draft"
    for tp, dp in ((1, 1), (2, 1), (4, 2)):  # an explicit value is kept
        assert resolve_gdn_state_slots("one", tp, dp) == ("one", "set")
        assert resolve_gdn_state_slots("per_draft", tp, dp) == ("per_draft", "set")
    with pytest.raises(ValueError, match=r"^gdn_state_slots='ONE': 'auto', 'per_draft' or 'one'$"):
        resolve_gdn_state_slots("ONE", 1)


def test_a_tfm_runner_takes_the_resolved_layout(caplog: pytest.LogCaptureFixture):
    def layout(setting: str, tp: int = 1, dp: int = 1, hybrid: bool = True) -> bool:
        runner = SimpleNamespace(model_config=SimpleNamespace(is_hybrid=hybrid),
                                 drafter=SimpleNamespace(tfm_settings=SimpleNamespace(tfm=TfmConfig(proposal="ddtree",
                                                                                                    gdn_state_slots=setting))))
        cfg = SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp, data_parallel_size=dp),
                              speculative_config=SimpleNamespace(num_speculative_tokens=S))
        hooks.set_gdn_state_layout(runner, cfg)
        return STATE.one_slot

    try:
        with caplog.at_level("INFO", logger="vllm.tfm"):
            assert layout("auto") and not layout("auto", tp=2) and not layout("auto", dp=2)
            assert layout("one", tp=2) and not layout("per_draft")
            assert not layout("auto", hybrid=False)  # no GDN layers: nothing to keep in one slot, nothing logged
    finally:
        STATE.one_slot = False
    assert [r.getMessage() for r in caplog.records] == [
        "vllm-tfm: gdn_state_slots 'one' ('auto' on one GPU): 1 GDN state slot(s) per request",
        f"vllm-tfm: gdn_state_slots 'per_draft' ('auto' at tensor parallelism 2, data parallelism 1: one slot has run "
        f"on one GPU only): 1 + B = {1 + S} GDN state slot(s) per request",
        f"vllm-tfm: gdn_state_slots 'per_draft' ('auto' at tensor parallelism 1, data parallelism 2: one slot has run "
        f"on one GPU only): 1 + B = {1 + S} GDN state slot(s) per request",
        "vllm-tfm: gdn_state_slots 'one' (set): 1 GDN state slot(s) per request",
        f"vllm-tfm: gdn_state_slots 'per_draft' (set): 1 + B = {1 + S} GDN state slot(s) per request",
    ]


def test_the_layer_reads_slot_zero_whatever_vllms_accepted_counts_say():
    """``_tree_step_forward_core`` in one-slot mode (the reference path): the same outputs and stash as with
    vLLM's counts all 1, whatever counts its metadata holds; the stash's offsets are the fixed ones."""
    from _gdn_layer import LayerCase, forward_context, random_trees, run_layer

    from vllm_tfm.vllm_plugin.runtime.kernels_or_reference import set_kernels_enabled

    case = LayerCase(random_trees([6, 1, 4], seed=2), num_plain=2, seed=4, dtype=torch.float32)
    assert int(case.md.num_accepted_tokens.max()) > 1  # counts that would point past slot 0
    set_kernels_enabled(False)
    try:
        with forward_context(case), torch.inference_mode():
            STATE.one_slot = True
            out, stash = run_layer(gdn_mod._tree_step_forward_core, case)
        STATE.one_slot = False  # the per-draft layout with vLLM's counts all 1: state at slot [n, 0] too
        case.md = dataclasses.replace(case.md, num_accepted_tokens=torch.ones_like(case.md.num_accepted_tokens))
        with forward_context(case), torch.inference_mode():
            want, want_stash = run_layer(gdn_mod._tree_step_forward_core, case)
    finally:
        set_kernels_enabled(True)
    assert torch.equal(out, want) and torch.equal(stash.prev_accepted, want_stash.prev_accepted)
    assert stash.prev_accepted.tolist() == [1, 1, 1]


def _hybrid_kv_cache_config(num_blocks: int) -> Any:
    """vLLM's KV-cache config of a hybrid target: 3 GDN layers (1 + S slots a request) and 3 attention layers
    in two groups of one 16384-byte page (attention blocks of 32 tokens x 2 KV heads x 64 x K and V x bf16)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MambaSpec

    mamba = MambaSpec(block_size=1024, shapes=((L, CONV_DIM), (HV, V, K)), dtypes=(torch.bfloat16, torch.float32),
                      page_size_padded=16384, num_speculative_blocks=S)
    attn = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    assert attn.page_size_bytes == mamba.page_size_bytes == 16384
    groups = [KVCacheGroupSpec([f"gdn.{i}" for i in range(3)], mamba),
              KVCacheGroupSpec([f"attn.{i}" for i in range(3)], attn)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)


def test_the_concurrency_with_one_slot_is_vllms_figure_with_one_gdn_block():
    # the fields vLLM 0.26's specs read (a VllmConfig cannot be built without a device)
    vllm_config = SimpleNamespace(model_config=SimpleNamespace(max_model_len=1024),
                                  parallel_config=SimpleNamespace(decode_context_parallel_size=1),
                                  cache_config=SimpleNamespace(mamba_cache_mode="none"))
    # a request: 1024 / 32 = 32 attention blocks + (1 + S) GDN blocks per layer pair, one with one slot
    kv = _hybrid_kv_cache_config(num_blocks=(32 + 1 + S) * 5)
    now, one = concurrency_with_slots(vllm_config, kv)
    assert now == pytest.approx(5.0) and one == pytest.approx((32 + 1 + S) * 5 / 33)
    assert kv.kv_cache_groups[0].kv_cache_spec.num_speculative_blocks == S  # the engine's config is not touched
    notice = per_draft_concurrency_notice(now, one, max_num_seqs=8, budget=S)
    assert notice == (f"vllm-tfm: the KV cache holds 5.00 requests of max_model_len tokens at once (max_num_seqs 8): "
                      f"each keeps 1 + B = {1 + S} GDN state slots (gdn_state_slots 'per_draft'). With gdn_state_slots "
                      f"'one' it would hold {one:.2f} (docs/vllm_plugin.md, \"One GDN state slot per request\").")
    assert per_draft_concurrency_notice(now, one, max_num_seqs=5, budget=S) is None  # every request fits already
    assert per_draft_concurrency_notice(5.0, 5.0, max_num_seqs=8, budget=S) is None  # one slot would not help


def test_the_kv_cache_hook_warns_per_draft_hybrid_tfm_runners_only(caplog: pytest.LogCaptureFixture):
    calls: list[tuple[Any, bool]] = []
    wrapped = hooks._wrap_initialize_kv_cache(lambda self, cfg, is_profiling=False: calls.append((cfg, is_profiling)))
    kv = object()

    def runner(tfm: bool = True, hybrid: bool = True) -> Any:
        return SimpleNamespace(_tfm_enabled=tfm, model_config=SimpleNamespace(is_hybrid=hybrid), vllm_config="vc",
                               scheduler_config=SimpleNamespace(max_num_seqs=8),
                               speculative_config=SimpleNamespace(num_speculative_tokens=S))

    with mock.patch.object(hooks, "concurrency_with_slots", return_value=(5.56, 72.4)) as conc:
        STATE.one_slot = False
        with caplog.at_level("WARNING", logger="vllm.tfm"):
            wrapped(runner(), kv)
            wrapped(runner(), kv, is_profiling=True)  # vLLM's memory profiling pass: no notice
            wrapped(runner(tfm=False), kv)
            wrapped(runner(hybrid=False), kv)
            STATE.one_slot = True
            wrapped(runner(), kv)
        STATE.one_slot = False
    assert [c[0] for c in calls] == [kv] * 5 and conc.call_args_list == [mock.call("vc", kv)]
    assert [r.getMessage()[:60] for r in caplog.records] == ["vllm-tfm: the KV cache holds 5.56 requests of max_model_len "]
    caplog.clear()
    with mock.patch.object(hooks, "concurrency_with_slots", side_effect=ValueError("no groups")):
        with caplog.at_level("WARNING", logger="vllm.tfm"):
            wrapped(runner(), kv)  # the engine starts all the same
    assert len(calls) == 6
    assert [r.getMessage() for r in caplog.records] == ["vllm-tfm: no concurrency figure for this KV cache (ValueError: no groups)"]
