"""Deferred drafts (runtime/deferred_drafts.py): placeholders for the scheduler, the drafts' tokens
written into the input ids from the proposal, vLLM's bookkeeping on the sampled tokens' early copy.

Each test compares the deferred path with what the synchronous path gives: the input ids vLLM
would have copied had the scheduler held the real tokens, the step tables ``build_step_tree`` builds
from real drafts."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from _trees import random_tree_parents

from vllm_tfm.vllm_plugin.runtime import deferred_drafts as dd
from vllm_tfm.vllm_plugin.runtime.inputs import build_step_tree
from vllm_tfm.vllm_plugin.runtime.metrics import Metrics
from vllm_tfm.vllm_plugin.runtime.sampled_copy import SampledCopy
from vllm_tfm.vllm_plugin.runtime.state import (
    LOOKUP_CUT,
    LOOKUP_FULL,
    LOOKUP_MISS,
    PLACEHOLDER_DRAFT,
    STATE,
    ProposalStore,
    is_placeholder,
)

P = PLACEHOLDER_DRAFT


@pytest.fixture(autouse=True)
def fresh_state():
    saved = (STATE.store, STATE.metrics, STATE.defer_drafts, STATE.sampled_copy)
    STATE.store = ProposalStore()
    STATE.metrics = Metrics(max_depth=8, device="cpu")
    STATE.defer_drafts = False
    STATE.sampled_copy = SampledCopy()
    dd.set_deferred_drafts(None, None)
    yield
    STATE.store, STATE.metrics, STATE.defer_drafts, STATE.sampled_copy = saved
    dd.set_deferred_drafts(None, None)


def put(store: ProposalStore, proposals: dict[str, tuple[list[int], list[int]]]) -> torch.Tensor:
    ids = list(proposals)
    toks = torch.tensor([proposals[i][0] for i in ids])
    store.put(ids, toks, torch.tensor([proposals[i][1] for i in ids]))
    return toks


def test_placeholders_match_the_proposal_they_stand_for_by_length():
    store = ProposalStore()
    tokens = put(store, {"a": ([7, 8, 9], [-1, 0, 0, 1]), "b": ([4, 5, 6], [-1, 0, 1, 1])})
    assert store.latest_is(tokens, ["a", "b"]) and not store.latest_is(tokens, ["b", "a"])
    assert not store.latest_is(tokens.clone(), ["a", "b"])  # not the tensor the proposer returned
    rec, code, full = store.match("a", [P, P, P])
    assert code == LOOKUP_FULL and full == 3 and rec.tokens == (7, 8, 9) and rec.parents.tolist() == [-1, 0, 0, 1]
    rec, code, _ = store.match("b", [P, P])  # the scheduler cut the drafts (token budget)
    assert code == LOOKUP_CUT and rec.tokens == (4, 5) and rec.parents.tolist() == [-1, 0, 1]
    assert store.match("a", [7, 8, 9])[1] == LOOKUP_FULL  # the tokens themselves (handed out synchronously)
    assert store.match("a", [P, P, P, P])[1] == LOOKUP_MISS  # more drafts than proposed
    assert store.match("a", [7, P, P])[1] == LOOKUP_MISS  # part placeholder: neither
    assert store.match("a", [0, 0, 0])[1] == LOOKUP_MISS  # vLLM's zeroed drafts
    assert not is_placeholder([]) and is_placeholder([P]) and not is_placeholder([P, 3])


def test_placeholders_of_a_request_absent_from_the_last_proposal_come_from_its_host_copy():
    store = ProposalStore()
    t1 = put(store, {"a": ([7, 8, 9], [-1, 0, 0, 1]), "b": ([4, 5, 6], [-1, 0, 1, 1])})
    assert store.device_drafts("a") == (t1, 0) and store.device_drafts("b")[1] == 1
    t2 = put(store, {"b": ([1, 2, 3], [-1, 0, 0, 0])})  # "a" was not in this step's batch
    assert store.device_drafts("a") is None and store.host_drafts("a") == (7, 8, 9)
    assert store.device_drafts("b") == (t2, 0)
    assert store.match("b", [P, P, P])[0].parents.tolist() == [-1, 0, 0, 0]
    assert store.match("a", [P, P])[0].tokens == (7, 8)  # still the first proposal's tree
    assert store.host_drafts("zz") is None and store.device_drafts("zz") is None


def test_a_deferred_build_end_that_rewrites_the_trees_is_what_the_records_and_the_device_hold():
    store = ProposalStore()
    tokens = torch.tensor([[7, 8, 9]])
    parents = torch.tensor([[-1, 0, 0, 1]])
    calls = []

    def finish() -> bool:  # as weaver_graphs.DeferredTail: tail rounds rewrote the trees in place
        calls.append(1)
        tokens.copy_(torch.tensor([[7, 5, 6]]))
        parents.copy_(torch.tensor([[-1, 0, 1, 2]]))
        return True

    store.put(["a"], tokens, parents, finish=finish)
    assert store.provisional_match("a", [P, P, P]) == (LOOKUP_FULL, 3)  # pending: nothing waited yet
    assert store.device_drafts("a")[0] is tokens
    rec = store.lookup("a", [P, P, P])
    assert calls == [1] and rec.tokens == (7, 5, 6) and rec.parents.tolist() == [-1, 0, 1, 2] and rec.is_chain
    store.finalize()
    assert calls == [1]  # once
    assert store.provisional_match("a", [P, P, P]) is None  # ingested: nothing to defer


def test_retain_right_after_put_waits_for_no_copy_and_prunes_at_the_next_ingest():
    store = ProposalStore()
    put(store, {"a": ([1], [-1, 0]), "b": ([2], [-1, 0])})
    assert store.lookup("a", [1]) is not None  # ingested
    put(store, {"a": ([3], [-1, 0]), "c": ([4], [-1, 0])})
    live = {"a": object(), "c": object()}
    store.retain(live)
    assert store._pending is not None  # not ingested by retain
    del live["c"]  # finished before the next step: pruned against the requests as they are then
    assert len(store) == 1 and store.lookup("a", [3]) is not None and store.lookup("b", [2]) is None


def sampling_metadata(penalties: bool = False) -> SimpleNamespace:
    """What ``sampler.needs_native_sampler`` reads of vLLM's SamplingMetadata."""
    return SimpleNamespace(no_penalties=not penalties, bad_words_token_ids={}, allowed_token_ids_mask=None,
                           max_num_logprobs=None, logitsprocs=SimpleNamespace(non_argmax_invariant=[]))


def runner_with(input_ids: np.ndarray, req_ids: list[str], penalties: bool = False) -> SimpleNamespace:
    cpu = torch.from_numpy(input_ids.copy())
    return SimpleNamespace(
        input_ids=SimpleNamespace(np=cpu.numpy(), cpu=cpu, gpu=torch.zeros_like(cpu)),
        input_batch=SimpleNamespace(req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                    sampling_metadata=sampling_metadata(penalties),
                                    spec_token_ids=[[] for _ in req_ids]),
    )


def test_fill_input_ids_gives_the_input_ids_of_the_real_drafts():
    """A batch of a prefill, two requests of the last proposal (one cut by the scheduler), one whose
    placeholders belong to an older proposal, and one whose scheduler drafts are real tokens:
    after vLLM's copy and ``DraftFill.apply`` the device ids equal those the scheduler's real
    tokens would have given."""
    store = STATE.store
    put(store, {"old": ([91, 92], [-1, 0, 0])})
    tokens = put(store, {"a": ([11, 12, 13], [-1, 0, 0, 1]), "b": ([21, 22, 23], [-1, 0, 1, 2]),
                         "real": ([31, 32, 33], [-1, 0, 1, 1])})
    req_ids = ["prefill", "a", "b", "old", "real"]
    num_sched = np.array([4, 4, 3, 3, 4])
    cu = np.cumsum(num_sched)
    real = {"a": [11, 12, 13], "b": [21, 22], "old": [91, 92], "real": [31, 32, 33]}
    sched = {"a": [P, P, P], "b": [P, P], "old": [P, P], "real": [31, 32, 33]}
    last = [100, 200, 300, 400, 500]  # each row's first token (sampled last step, or the prompt)
    want, host = [], []
    for i, rid in enumerate(req_ids):
        first = [last[i]] * (num_sched[i] - len(real.get(rid, [])))
        want += first + real.get(rid, [])
        host += first + sched.get(rid, [])
    runner = runner_with(np.array(host, dtype=np.int32), req_ids)
    fill = dd.fill_input_ids(runner, SimpleNamespace(scheduled_spec_decode_tokens=sched), cu)
    assert fill is not None and fill.tokens is tokens and fill.host_filled == 2
    runner.input_ids.gpu.copy_(runner.input_ids.cpu)  # vLLM's _prepare_input_ids
    # vLLM's _calc_spec_decode_metadata: the drafts gathered from the device ids, in batch order
    draft_rows = np.concatenate([np.arange(cu[i] - len(real[r]), cu[i]) for i, r in enumerate(req_ids) if r in real])
    fill.draft_token_ids = runner.input_ids.gpu[torch.from_numpy(draft_rows)].to(torch.long)
    assert (fill.draft_token_ids == P).sum() == 5  # before: the placeholders of the last proposal's rows
    assert fill.apply(runner.input_ids.gpu) == 5
    assert runner.input_ids.gpu.tolist() == want
    assert fill.draft_token_ids.tolist() == real["a"] + real["b"] + real["old"] + real["real"]
    assert (runner.input_ids.gpu >= 0).all()

    # the same batch when a request that needs vLLM's sampler (penalties) is in it: every placeholder
    # from the host copy, into the input ids and the spec_token_ids vLLM's penalties read
    runner = runner_with(np.array(host, dtype=np.int32), req_ids, penalties=True)
    for i, rid in enumerate(req_ids):
        runner.input_batch.spec_token_ids[i].extend(sched.get(rid, []))
    lists = [lst for lst in runner.input_batch.spec_token_ids]  # vLLM's sampling metadata holds these objects
    fill = dd.fill_input_ids(runner, SimpleNamespace(scheduled_spec_decode_tokens=sched), cu)
    assert fill is not None and fill.host_filled == 7 and fill.apply(runner.input_ids.gpu) == 0
    assert runner.input_ids.cpu.tolist() == want
    assert [lst is orig for lst, orig in zip(runner.input_batch.spec_token_ids, lists)] == [True] * 5
    assert runner.input_batch.spec_token_ids == [[], real["a"], real["b"], real["old"], real["real"]]


def test_fill_input_ids_refuses_placeholders_whose_proposal_is_gone():
    store = STATE.store
    put(store, {"z": ([3, 4], [-1, 0, 1])})  # the last proposal did not include "a", none before did
    runner = runner_with(np.array([5, P, P], dtype=np.int32), ["a"])
    with pytest.raises(RuntimeError, match="scheduled 2 placeholder drafts but its proposal is gone"):
        dd.fill_input_ids(runner, SimpleNamespace(scheduled_spec_decode_tokens={"a": [P, P]}), np.array([3]))


def test_no_placeholders_no_fill():
    put(STATE.store, {"a": ([1, 2], [-1, 0, 0])})
    runner = runner_with(np.array([5, 1, 2], dtype=np.int32), ["a"])
    assert dd.fill_input_ids(runner, SimpleNamespace(scheduled_spec_decode_tokens={"a": [1, 2]}), np.array([3])) is None


@pytest.mark.parametrize("defer_topology", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_placeholder_steps_build_the_tables_of_real_drafts(seed, defer_topology):
    """``build_step_tree`` on placeholder drafts equals it on the real drafts, field by field, for a
    batch of random trees (cut and uncut), chains and rows without drafts; with the topology deferred,
    once ``complete`` filled it (before: every topology entry -2, the shapes already right)."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    b = 8
    ids = [f"r{i}" for i in range(6)]
    proposals = {}
    for i, rid in enumerate(ids):
        parents = [-1, *range(b)] if i == 2 else random_tree_parents(b + 1, gen).tolist()
        proposals[rid] = (rng.integers(0, 1000, size=b).tolist(), parents)
    real_store, deferred = ProposalStore(), ProposalStore()
    put(real_store, proposals)
    put(deferred, proposals)
    cuts = [b, b, b, 3, 0, b]  # r3 cut by the scheduler, r4 scheduled without drafts
    num_sched = np.array([c + 1 for c in cuts])
    real = {rid: proposals[rid][0][:c] for rid, c in zip(ids, cuts)}
    placeholders = {rid: [P] * c for rid, c in zip(ids, cuts)}
    a = build_step_tree(ids, num_sched, real, real_store, allow_trees=True)
    d = build_step_tree(ids, num_sched, placeholders, deferred, allow_trees=True, defer_topology=defer_topology)
    assert a.tree_active and d.tree_active
    assert d.topology_pending == defer_topology
    if defer_topology:
        assert deferred._pending is not None  # nothing waited for the proposal's copy
        for name in ("local_parent", "depth", "sample_parents", "sample_depth", "spec_parents"):
            assert getattr(d, name).shape == getattr(a, name).shape and (getattr(d, name) == -2).all(), name
        assert d.is_tree.tolist() == [True, True, True, True, False, True]  # provisional: r2's chain not known yet
        seen = []
        d.after_topology(lambda s: seen.append(s.depth.copy()))
        assert not seen
        d.dev("depth")  # any reader of the device arrays completes the step first
        assert len(seen) == 1 and np.array_equal(seen[0], a.depth) and not d.topology_pending
    for name, value in vars(a).items():
        other = getattr(d, name)
        if isinstance(value, np.ndarray):
            assert np.array_equal(value, other), name
        elif isinstance(value, (bool, int, float, str, type(None))):
            assert value == other, name


def test_a_deferred_step_of_chains_keeps_the_tree_path():
    """When every deferred proposal turns out to be a chain, the step stays tree-active (decided before
    the topology was known) and verifies the chains on the tree path: the same parents and depths as
    the synchronous step, which runs vLLM's chain path instead."""
    b = 4
    proposals = {"x": ([1, 2, 3, 4], [-1, 0, 1, 2, 3]), "y": ([5, 6, 7, 8], [-1, 0, 1, 2, 3])}
    real_store, deferred = ProposalStore(), ProposalStore()
    put(real_store, proposals)
    put(deferred, proposals)
    num_sched = np.array([b + 1, b + 1])
    a = build_step_tree(["x", "y"], num_sched, {k: v[0] for k, v in proposals.items()}, real_store, allow_trees=True)
    d = build_step_tree(["x", "y"], num_sched, {k: [P] * b for k in proposals}, deferred, allow_trees=True,
                        defer_topology=True)
    assert not a.tree_active and d.tree_active and d.topology_pending
    d.complete()
    assert d.is_tree.tolist() == [False, False] and np.array_equal(d.local_parent, a.local_parent)
    assert np.array_equal(d.depth, a.depth) and d.lookup.tolist() == a.lookup.tolist()


def test_sampled_copy_hands_bookkeeping_the_copy_of_the_recorded_tensor_only():
    from vllm_tfm.vllm_plugin.runtime.hooks import _wrap_bookkeeping_sync

    seen = []
    bookkeeping = _wrap_bookkeeping_sync(lambda self, so, out, *a: seen.append(out.sampled_token_ids) or "done")
    sampled = torch.tensor([[5, 6, -1], [7, -1, -1]], dtype=torch.int32)
    out = SimpleNamespace(sampled_token_ids=sampled)
    STATE.sampled_copy.record(sampled)
    assert bookkeeping(SimpleNamespace(_tfm_enabled=True), None, out, None) == "done"
    assert seen[-1] is not sampled and torch.equal(seen[-1], sampled)  # the copy, same values
    assert out.sampled_token_ids is sampled  # restored
    bookkeeping(SimpleNamespace(_tfm_enabled=True), None, out, None)  # the record was consumed
    assert seen[-1] is sampled
    STATE.sampled_copy.record(torch.zeros(2, 3, dtype=torch.int32))  # another step's tensor
    bookkeeping(SimpleNamespace(_tfm_enabled=True), None, out, None)
    assert seen[-1] is sampled
    STATE.sampled_copy.record(sampled)
    bookkeeping(SimpleNamespace(), None, out, None)  # not a tfm runner: vLLM's own
    assert seen[-1] is sampled


def test_take_draft_token_ids_hands_out_placeholders_only_for_the_last_proposal():
    pytest.importorskip("vllm")
    from vllm.v1.outputs import DraftTokenIds

    from vllm_tfm.vllm_plugin.runtime.hooks import _wrap_take_draft_token_ids

    calls = []

    def orig(self):
        calls.append(1)
        return DraftTokenIds(list(self._draft_token_req_ids), self._draft_token_ids.tolist())

    take = _wrap_take_draft_token_ids(orig)
    tokens = put(STATE.store, {"a": ([7, 8, 9], [-1, 0, 0, 1]), "b": ([4, 5, 6], [-1, 0, 1, 1])})
    runner = SimpleNamespace(_tfm_enabled=True, _draft_token_ids=tokens, _draft_token_req_ids=["a", "b"],
                             num_spec_tokens=3)
    STATE.defer_drafts = True
    out = take(runner)
    assert out.req_ids == ["a", "b"] and out.draft_token_ids == [[P] * 3, [P] * 3] and not calls
    assert STATE.metrics.placeholder_steps == 1
    STATE.defer_drafts = False  # e.g. a structured-output request in the batch: the tokens
    assert take(runner).draft_token_ids == [[7, 8, 9], [4, 5, 6]] and calls == [1]
    STATE.defer_drafts = True
    runner._draft_token_req_ids = ["b", "a"]  # not the proposal's requests in its order
    assert take(runner).draft_token_ids == [[7, 8, 9], [4, 5, 6]] and calls == [1, 1]
    runner._draft_token_req_ids = ["a", "b"]
    runner._draft_token_ids = torch.zeros(2, 3, dtype=torch.long)  # vLLM zeroed the drafts (input too long)
    assert take(runner).draft_token_ids == [[0] * 3, [0] * 3] and calls == [1, 1, 1]


@pytest.mark.parametrize("env, enabled, setter, bad, shown", [
    (dd.DEFERRED_DRAFTS_ENV, dd.deferred_drafts_enabled, dd.set_deferred_drafts, "yes", "'yes'"),
    (dd.EARLY_SAMPLED_COPY_ENV, dd.early_sampled_copy_enabled, dd.set_early_sampled_copy, 1, "1"),
])
def test_the_switches_read_the_environment_unless_set(monkeypatch, env, enabled, setter, bad, shown):
    from vllm_tfm.vllm_plugin.options import env_overrides

    monkeypatch.delenv(env, raising=False)
    assert enabled()
    monkeypatch.setenv(env, "0")
    assert not enabled()
    assert setter(None, True) and enabled()
    assert setter(None, None) is False
    with pytest.raises(ValueError, match=f"{setter.__name__} takes True, False or None, got {shown}"):
        setter(None, bad)
    assert env_overrides({env: "0"})[0] == {}  # a known runtime switch, not a tree option


def test_the_switch_is_a_known_environment_variable_for_the_options_resolver():
    from vllm_tfm.vllm_plugin.options import env_overrides

    assert env_overrides({dd.DEFERRED_DRAFTS_ENV: "0", "VLLM_TFM_WIDTH": "4"})[0] == {"width": 4}


def test_complete_leaves_the_sampler_tables_to_their_first_read(monkeypatch):
    """The host's path from the drafter's end to the forward's launch (``StepTree.complete``: fill, uploads,
    positions, full-graph plans; bench/step_host.py) does not build the sampler's tree tables: the sampler's
    first read does, once, and they are the tables of the step's logits rows. The fill also keeps the rows'
    ancestor bitmasks (computed with the depths) for the full graph's plans."""
    from vllm_tfm.tree.bitmask import ragged_ancestor_bits
    from vllm_tfm.verify import tree_tables

    built = []
    real = tree_tables.tree_table_arrays
    monkeypatch.setattr(tree_tables, "tree_table_arrays", lambda *a, **k: built.append(1) or real(*a, **k))
    gen = torch.Generator().manual_seed(3)
    store = ProposalStore()
    proposals = {f"r{i}": (list(range(8)), random_tree_parents(9, gen).tolist()) for i in range(3)}
    put(store, proposals)
    step = build_step_tree(list(proposals), np.full(3, 9), {rid: [P] * 8 for rid in proposals}, store,
                           allow_trees=True, defer_topology=True)
    assert step.topology_pending and step.ancestor_bits is None
    step.complete()
    assert not step.topology_pending and built == []
    assert np.array_equal(step.ancestor_bits, ragged_ancestor_bits(step.local_parent, step.query_start))
    tables = step.sample_tables()
    assert built == [1] and step.sample_tables() is tables and built == [1]
    dmax, want = real(step.sample_parents, step.sample_cu)
    assert tables.max_depth == dmax
    for name, array in want.items():
        assert np.array_equal(getattr(tables, name).numpy(), array), name


def test_the_fill_keeps_ancestor_bitmasks_of_small_steps_only():
    # a decode step's trees (<= 512 rows, requests of <= 64): bitmasks with the depths; a long prefill chunk: none
    store = ProposalStore()
    small = build_step_tree(["a", "b"], np.array([9, 1]), {}, store, allow_trees=True)
    assert small.ancestor_bits is not None and small.ancestor_bits.shape == (10, 1)
    assert np.array_equal(small.ancestor_bits, ragged_ancestor_bits_of(small))
    long = build_step_tree(["a", "b"], np.array([65, 1]), {}, store, allow_trees=True)
    assert long.ancestor_bits is None and long.depth.tolist() == list(range(65)) + [0]


def ragged_ancestor_bits_of(step):
    from vllm_tfm.tree.bitmask import ragged_ancestor_bits

    return ragged_ancestor_bits(step.local_parent, step.query_start)


def test_weaver_builds_with_tail_rounds_are_counted_in_the_engine_metrics():
    from vllm_tfm.vllm_plugin.runtime.weaver_graphs import WeaverGraphs

    graphs = WeaverGraphs()
    graphs.count_tail(0)
    assert "weaver.tail_builds" not in STATE.metrics.hooks  # a build within its captured rounds
    graphs.count_tail(3)
    graphs.count_tail(1)
    assert STATE.metrics.hooks["weaver.tail_builds"] == 2 and STATE.metrics.hooks["weaver.tail_rounds"] == 4
    assert graphs.tail_rounds == 4


@pytest.mark.parametrize("early", [True, False])
def test_the_sampled_copy_is_queued_before_the_commit_when_early_and_once_per_step(monkeypatch, early):
    """Early (the default): the copy bookkeeping waits for is queued before the commit's launches, so the
    host's wait does not include the commit; off: at the start of the proposal, after them. Either way one
    copy per step, and the proposal keeps the decision made for its tensor."""
    from vllm_tfm.vllm_plugin.runtime import hooks

    monkeypatch.setattr(dd, "defers_drafts", lambda sampled, so, md: isinstance(sampled, torch.Tensor))
    recorded: list[torch.Tensor] = []
    record = STATE.sampled_copy.record
    monkeypatch.setattr(STATE.sampled_copy, "record", lambda t: recorded.append(t) or record(t))
    seen_at_commit: list[bool] = []
    monkeypatch.setattr(hooks, "commit_step", lambda runner, step, tokens: seen_at_commit.append(STATE.sampled_copy.holds(sampled)))
    saved_step, saved_trace = STATE.step, STATE.trace
    STATE.step, STATE.trace = SimpleNamespace(tree_active=True, tree_gdn=True), None
    dd.set_early_sampled_copy(None, early)
    try:
        sampled = torch.tensor([[5, 6, -1]], dtype=torch.int32)
        runner = SimpleNamespace(_tfm_enabled=True, model_config=SimpleNamespace(is_hybrid=False),
                                 input_batch=SimpleNamespace(sampling_metadata=None))
        so = SimpleNamespace(has_structured_output_requests=False)
        STATE.defer_drafts = False
        hooks._wrap_update_states_after(lambda self, o, s: None)(runner, sampled, so)
        assert seen_at_commit == [early] and STATE.defer_drafts is early
        propose = hooks._wrap_propose(lambda self, *a, **k: "drafts")
        assert propose(runner, so, sampled, None, None, None) == "drafts"
        assert STATE.defer_drafts and len(recorded) == 1 and recorded[0] is sampled
        assert torch.equal(STATE.sampled_copy.host_for(sampled), sampled)
    finally:
        STATE.step, STATE.trace = saved_step, saved_trace
        dd.set_early_sampled_copy(None, None)


class _PendingCopy:
    """A non-blocking device-to-host copy of accepted counts: it lands in ``host`` when its event is waited for
    (or when the test says the GPU got there)."""

    def __init__(self, host: np.ndarray, values: list[int]) -> None:
        self.host, self.values, self.landed = host, values, False

    def synchronize(self) -> None:
        if not self.landed:
            self.host[: len(self.values)] = self.values
            self.landed = True


def test_the_last_steps_accepted_counts_land_before_vllm_moves_rows() -> None:
    """Synchronous tfm with deferred drafts: the host's bookkeeping no longer waits for the copy of the accepted
    counts (queued after the commit), so the next step's row moves could run before it lands and be overwritten by
    the late copy. The runner hook waits for it first; the moved row then carries its own count."""

    from vllm_tfm.vllm_plugin.runtime import hooks

    def swap_rows(self: object, scheduler_output: object) -> None:  # vLLM's condense / swap_states on the host array
        host = self.input_batch.num_accepted_tokens_cpu
        host[0], host[1] = host[1], host[0]

    def run(runner: SimpleNamespace) -> list[int]:
        hooks._wrap_update_states(swap_rows)(runner, None)
        runner.num_accepted_tokens_event.synchronize()  # vLLM's wait in _prepare_inputs (a no-op once landed)
        return runner.input_batch.num_accepted_tokens_cpu.tolist()

    def runner(tfm: bool, is_async: bool) -> SimpleNamespace:
        host = np.ones(3, dtype=np.int32)
        return SimpleNamespace(_tfm_enabled=tfm, use_async_scheduling=is_async,
                               input_batch=SimpleNamespace(num_accepted_tokens_cpu=host),
                               num_accepted_tokens_event=_PendingCopy(host, [4, 2, 7]))

    assert run(runner(tfm=True, is_async=False)) == [2, 4, 7]  # the counts moved with their rows
    # not tfm's to fix: vLLM's own order (another method, or asynchronous scheduling, whose counts vLLM keeps on
    # the device) is left as it is; this stand-in shows what the late copy does then
    assert run(runner(tfm=False, is_async=False)) == [4, 2, 7]
    assert run(runner(tfm=True, is_async=True)) == [4, 2, 7]
