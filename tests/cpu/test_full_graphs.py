"""Full CUDA graphs of tree steps (runtime/full_graphs.py, graph_dispatch.py): fixed-layout plans equal the
per-step plans, and the dispatch gives FULL only to steps that fit a captured tree graph."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from vllm_tfm.kernels.plan import TreePlan, ancestor_matrix
from vllm_tfm.kernels.tree_attention import TreeAttentionPlan
from vllm_tfm.tree.bitmask import ragged_ancestor_bits
from vllm_tfm.vllm_plugin.cuda_graphs import tfm_capture_sizes


def random_parents(rng: np.random.Generator, num_reqs: int, nodes: int, kind: str = "random") -> np.ndarray:
    out = []
    for _ in range(num_reqs):
        p = [-1]
        for i in range(1, nodes):
            p.append({"chain": i - 1, "star": 0}.get(kind, int(rng.integers(0, i))))
        out.append(p)
    return np.asarray(out, dtype=np.int64).reshape(-1)


@pytest.mark.parametrize("kind", ["random", "chain", "star"])
@pytest.mark.parametrize(("num_reqs", "nodes"), [(1, 1), (1, 33), (3, 17), (8, 33), (2, 65), (1, 129)])
def test_fixed_layout_plan_has_the_tables_of_the_plan(kind: str, num_reqs: int, nodes: int) -> None:
    rng = np.random.default_rng(num_reqs * 100 + nodes)
    parents = torch.from_numpy(random_parents(rng, num_reqs, nodes, kind))
    cu = torch.arange(num_reqs + 1) * nodes
    ref = TreePlan.build(parents, cu, device="cpu")
    buf = torch.full((TreePlan.fixed_size(num_reqs, nodes) + 5,), -7, dtype=torch.int32)
    fixed = TreePlan.build_into(buf, parents, cu, nodes)
    for name in ("cu", "perm", "pos", "depth", "pair_off", "req_of"):
        assert torch.equal(getattr(fixed, name), getattr(ref, name)), name
    assert torch.equal(fixed.pair_j[: ref.num_pairs], ref.pair_j)
    assert bool((fixed.pair_j[ref.num_pairs:] == 0).all())
    cap = nodes * (nodes + 1) // 2
    assert (fixed.num_pairs, fixed.max_pairs_per_request, fixed.max_depth) == (num_reqs * cap, cap, nodes - 1)
    assert (fixed.num_nodes, fixed.num_requests, fixed.max_nodes) == (ref.num_nodes, ref.num_requests, ref.max_nodes)
    assert fixed.max_depth >= ref.max_depth and fixed.max_pairs_per_request >= ref.max_pairs_per_request
    # the layout depends on R and n only: another batch of the same size lands at the same addresses
    other = TreePlan.build_into(buf, torch.from_numpy(random_parents(rng, num_reqs, nodes, "random")), cu, nodes)
    assert all(getattr(other, n).data_ptr() == getattr(fixed, n).data_ptr() for n in ("cu", "perm", "pair_off", "pair_j"))
    assert int(buf[-1]) == -7  # nothing written past the layout


@pytest.mark.parametrize("kind", ["random", "chain", "star"])
@pytest.mark.parametrize(("num_reqs", "nodes"), [(1, 1), (1, 2), (3, 33), (2, 65), (4, 17)])
def test_ancestor_matrix_of_the_bitmasks_is_the_root_paths(kind: str, num_reqs: int, nodes: int) -> None:
    rng = np.random.default_rng(7 * nodes + num_reqs)
    parents = random_parents(rng, num_reqs, nodes, kind)
    anc = ancestor_matrix(ragged_ancestor_bits(parents, np.arange(num_reqs + 1) * nodes), num_reqs, nodes)
    expected = np.zeros((num_reqs, nodes, nodes), dtype=bool)
    for r in range(num_reqs):
        for i in range(nodes):
            j = i
            while j >= 0:  # walk up to the root
                expected[r, i, j] = True
                j = int(parents[r * nodes + j])
    assert np.array_equal(anc, expected)


def test_plans_from_given_ancestor_bitmasks_equal_the_plans_without_them() -> None:
    rng = np.random.default_rng(3)
    r, n = 3, 33
    parents = random_parents(rng, r, n)
    cu = np.arange(r + 1) * n
    bits = ragged_ancestor_bits(parents, cu)
    bufs = [torch.zeros(TreePlan.fixed_size(r, n), dtype=torch.int32) for _ in range(2)]
    TreePlan.build_into(bufs[0], parents, cu, n)
    TreePlan.build_into(bufs[1], torch.from_numpy(parents), torch.from_numpy(cu), n, ancestor_bits=bits)
    assert torch.equal(bufs[0], bufs[1])
    starts = np.arange(r, dtype=np.int64) * n
    abufs = [torch.zeros(TreeAttentionPlan.fixed_size(r, n), dtype=torch.int64) for _ in range(2)]
    TreeAttentionPlan.build_into(abufs[0], starts, parents, n)
    TreeAttentionPlan.build_into(abufs[1], starts, parents, n, ancestor_bits=bits)
    assert torch.equal(abufs[0], abufs[1])
    with pytest.raises(ValueError, match=r"ancestor_bits must be \[99, 1\]"):
        TreePlan.build_into(bufs[0], parents, cu, n, ancestor_bits=bits[:66])
    with pytest.raises(ValueError, match=r"ancestor_bits must be \[99, 1\]"):
        TreeAttentionPlan.build_into(abufs[0], starts, parents, n, ancestor_bits=np.zeros((99, 2), dtype=np.int64))
    with pytest.raises(ValueError, match=r"parents\[34\] = 1 is invalid for local node 1"):
        TreePlan.build_into(bufs[0], np.concatenate([parents[:34], [1], parents[35:]]), cu, n)


def test_fixed_layout_plan_refuses_other_node_counts_and_small_buffers() -> None:
    parents = torch.tensor([-1, 0, -1, 0, 1])
    cu = torch.tensor([0, 2, 5])
    with pytest.raises(ValueError, match="every tree must have 2 nodes"):
        TreePlan.build_into(torch.zeros(100, dtype=torch.int32), parents, cu, 2)
    with pytest.raises(ValueError, match="buffer must be a 1-d int32 tensor"):
        TreePlan.build_into(torch.zeros(3, dtype=torch.int32), torch.tensor([-1, 0]), torch.tensor([0, 2]), 2)
    with pytest.raises(ValueError, match="parents\\[1\\] = 1 is invalid"):
        TreePlan.build_into(torch.zeros(100, dtype=torch.int32), torch.tensor([-1, 1]), torch.tensor([0, 2]), 2)


@pytest.mark.parametrize(("num_reqs", "nodes"), [(1, 1), (2, 33), (5, 65), (8, 17)])
def test_fixed_layout_attention_plan_is_every_request_as_a_tree(num_reqs: int, nodes: int) -> None:
    rng = np.random.default_rng(nodes)
    parents = random_parents(rng, num_reqs, nodes)
    starts = np.arange(num_reqs, dtype=np.int64) * nodes + 3  # rows need not start at 0
    buf = torch.full((TreeAttentionPlan.fixed_size(num_reqs, nodes),), -1, dtype=torch.int64)
    plan = TreeAttentionPlan.build_into(buf, starts, parents, nodes)
    ref = TreeAttentionPlan.from_parents(np.arange(num_reqs), starts, np.full(num_reqs, nodes), parents, "cpu")
    assert torch.equal(plan.meta, ref.meta) and torch.equal(plan.bits_dev, ref.bits_dev)
    assert (plan.num_trees, plan.max_nodes, plan.words) == (num_reqs, nodes, (nodes + 63) // 64)
    cu = np.arange(num_reqs + 1) * nodes
    assert np.array_equal(plan.bits, ragged_ancestor_bits(parents, cu))
    with pytest.raises(ValueError, match="buffer must be a 1-d int64 tensor"):
        TreeAttentionPlan.build_into(buf[:-1], starts, parents, nodes)


@pytest.mark.parametrize(("budget", "seqs"), [(32, 8), (4, 16), (7, 16), (15, 3), (1, 16)])
def test_full_mode_capture_sizes_are_multiples_of_the_tree_step_from_its_size_up(budget: int, seqs: int) -> None:
    n = budget + 1
    sizes = tfm_capture_sizes(budget, seqs, full=True)
    assert all(s % n == 0 for s in sizes if s >= n)  # vLLM captures a full decode graph for each of these
    k = min(seqs, 64, max(16, 1024 // n))
    assert {r * n for r in range(1, k + 1)} <= set(sizes) and max(sizes) == k * n
    assert set(sizes) <= set(tfm_capture_sizes(budget, seqs))


# ---- the runtime: capture step, replay, dispatch (CPU tensors stand in for the device) ---------------------
from vllm_tfm.vllm_plugin.runtime import graph_dispatch  # noqa: E402
from vllm_tfm.vllm_plugin.runtime.full_graphs import TreeGraphs, chain_parents, replayable, uniform_tree_step  # noqa: E402
from vllm_tfm.vllm_plugin.runtime.metrics import Metrics  # noqa: E402
from vllm_tfm.vllm_plugin.runtime.state import STATE, StepTree  # noqa: E402
from vllm_tfm.vllm_plugin.runtime.step_kernels import current_step_kernels  # noqa: E402


def tree_step(num_reqs: int, nodes: int, rng: np.random.Generator, active: bool = True) -> StepTree:
    parents = random_parents(rng, num_reqs, nodes)
    qs = np.arange(num_reqs + 1, dtype=np.int64) * nodes
    sched = np.full(num_reqs, nodes, dtype=np.int64)
    return StepTree(num_reqs=num_reqs, num_tokens=num_reqs * nodes, tree_active=active, query_start=qs,
                    num_scheduled=sched, num_draft=sched - 1, row_base=qs[:-1], req_index=np.repeat(np.arange(num_reqs), nodes),
                    is_spec=np.ones(num_reqs, bool), is_tree=np.ones(num_reqs, bool), local_parent=parents,
                    depth=np.zeros(num_reqs * nodes, np.int64), sample_parents=parents, sample_depth=np.zeros(num_reqs * nodes, np.int64),
                    sample_cu=qs, spec_parents=parents, spec_cu=qs, spec_req_index=np.arange(num_reqs), device="cpu")


def test_uniform_tree_step_needs_every_request_a_spec_row_of_b_drafts() -> None:
    rng = np.random.default_rng(0)
    step = tree_step(3, 5, rng)
    assert uniform_tree_step(step, 5) and not uniform_tree_step(step, 6)
    assert replayable(step, 5, {3: None}) and not replayable(step, 5, {2: None}) and not replayable(None, 5, {3: None})
    step.is_spec = np.array([True, False, True])
    step.spec_req_index = np.array([0, 2])
    step.spec_parents = step.spec_parents[:10]
    assert not uniform_tree_step(step, 5)
    assert not uniform_tree_step(tree_step(2, 5, rng, active=False), 5)


def test_capture_context_sets_the_capture_step_and_restores() -> None:
    graphs = TreeGraphs(budget=4, max_reqs=3, max_seq_len=128, device=torch.device("cpu"))
    assert graphs.requests_of(15) == 3
    for bad in (14, 20, 0):
        with pytest.raises(ValueError, match="is not a tree step of 1..3 requests x 5 tokens"):
            graphs.requests_of(bad)
    before = STATE.step
    with graphs.capture(2):
        step = STATE.step
        assert step is not None and step.graph_capture is graphs and step.tree_active
        assert np.array_equal(step.spec_parents, chain_parents(2, 5)) and step.attn_max_seq_len == 128
        assert step.attn_plan.num_trees == 2 and step.attn_plan.meta.data_ptr() == graphs.attn_region(2).data_ptr()
        graphs.begin_run()
        tables = current_step_kernels(step)
        assert tables is not None and tables.plan.cu.data_ptr() == graphs.plan_buffer.data_ptr()
        with pytest.raises(RuntimeError, match="nested"):
            with graphs.capture(1):
                pass
        with pytest.raises(RuntimeError, match="the capture ran without the step.s kernel tables"):
            graphs.end_capture_run(None)
        graphs.end_capture_run(tables)
    assert STATE.step is before and not graphs.capturing and 2 in graphs.captured


def test_replay_writes_the_step_trees_and_installs_the_captured_stash() -> None:
    graphs = TreeGraphs(budget=4, max_reqs=3, max_seq_len=64, device=torch.device("cpu"))
    with graphs.capture(3):
        graphs.begin_run()
        STATE.step.gdn = {"layer.0": "stash"}  # what the captured run left (any object: installed as is)
        graphs.end_capture_run(current_step_kernels(STATE.step))
    step = tree_step(3, 5, np.random.default_rng(3))
    graphs.prepare_replay(step)
    ref = TreePlan.build(torch.from_numpy(step.spec_parents), torch.from_numpy(step.spec_cu), device="cpu")
    plan = current_step_kernels(step).plan
    assert torch.equal(plan.perm, ref.perm) and torch.equal(plan.pair_j[: ref.num_pairs], ref.pair_j)
    assert plan.cu.data_ptr() == graphs.plan_buffer.data_ptr()
    bits = ragged_ancestor_bits(step.local_parent, step.query_start)
    region = graphs.attn_region(3)
    assert torch.equal(region[6 : 6 + bits.size], torch.from_numpy(bits.reshape(-1)))
    assert step.gdn == {"layer.0": "stash"} and step.full_graph
    with pytest.raises(RuntimeError, match="no full tree graph fits"):
        graphs.prepare_replay(tree_step(2, 5, np.random.default_rng(4)))
    # later replays of R requests reuse the plans' views and write the new trees into the same buffers
    for seed in (5, 6):
        again = tree_step(3, 5, np.random.default_rng(seed))
        graphs.prepare_replay(again)
        plan2 = current_step_kernels(again).plan
        ref2 = TreePlan.build(torch.from_numpy(again.spec_parents), torch.from_numpy(again.spec_cu), device="cpu")
        assert plan2 is plan and torch.equal(plan2.perm, ref2.perm) and torch.equal(plan2.depth, ref2.depth)
        assert torch.equal(plan2.pair_off, ref2.pair_off) and torch.equal(plan2.pair_j[: ref2.num_pairs], ref2.pair_j)
        bits2 = ragged_ancestor_bits(again.local_parent, again.query_start)
        assert not np.array_equal(bits2, bits)
        assert torch.equal(region[6 : 6 + bits2.size], torch.from_numpy(bits2.reshape(-1)))
        assert torch.equal(region[:6], torch.from_numpy(
            TreeAttentionPlan.build(np.arange(3), again.query_start[:-1], np.full(3, 5), bits2, "cpu").meta.numpy()
            .view(np.int64)))  # the meta of the first write, unchanged


def test_replays_of_other_batch_sizes_leave_a_plans_meta_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A replay writes only the bitmasks of its tree-attention plan; the meta (request, first row, size, first
    bitmask row of each tree) stays from its first write. Replays of R = 3, then 2, then 3 again: the plan the
    R = 3 graph reads must still be R = 3's, meta included (when all sizes shared one region, R = 2's writes
    overwrote it: wrong attention on the full-graph steps of an engine whose batch shrank and grew, NOTES 50)."""
    graphs = TreeGraphs(budget=4, max_reqs=3, max_seq_len=64, device=torch.device("cpu"))
    captured = {}
    for r in (3, 2, 1):
        with graphs.capture(r):
            graphs.begin_run()
            captured[r] = STATE.step.attn_plan
            graphs.end_capture_run(current_step_kernels(STATE.step))
    regions = [graphs.attn_region(r) for r in (1, 2, 3)]
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in regions)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))  # no two regions overlap
    with pytest.raises(ValueError, match="num_reqs must be in 1..3"):
        graphs.attn_region(4)
    rng = np.random.default_rng(11)
    monkeypatch.setattr(STATE, "metrics", Metrics(max_depth=4))
    returns = []
    for r in (3, 2, 1, 3, 3, 2, 3):
        step = tree_step(r, 5, rng)
        graphs.prepare_replay(step)
        returns.append(STATE.metrics.hooks["cudagraph.tree.full_size_return"])
        _, attn = graphs.replay_layouts(r)
        assert attn.meta.data_ptr() == captured[r].meta.data_ptr()  # the region the captured graph reads
        bits = ragged_ancestor_bits(step.local_parent, step.query_start)
        ref = TreeAttentionPlan.build(np.arange(r), step.query_start[:-1], np.full(r, 5), bits, "cpu")
        for k in (1, 2, 3):  # every captured size's plan holds its own last trees, meta included
            plan = graphs.replay_layouts(k)
            if plan is None:
                continue
            want = ref if k == r else None
            assert torch.equal(plan[1].meta, torch.from_numpy(np.concatenate(
                [np.arange(k), np.arange(k) * 5, np.full(k, 5), np.arange(k) * 5]).astype(np.int32)))
            if want is not None:
                assert torch.equal(plan[1].bits_dev, want.bits_dev)
    # the counter a GPU run checks to know it exercised this case: a size replayed again after another size
    # (the 4th, 6th and 7th replays; not the first of each size, nor a size repeated back to back)
    assert returns == [0, 0, 0, 1, 1, 2, 3] and STATE.metrics.hooks["cudagraph.tree.full_replay"] == 7


def test_tree_graph_plans_carry_the_drafters_depth_bound() -> None:
    # the drafter's depth lets version 6 take its path solve on the fixed-layout plans (kernels.gdn.grouped_solve)
    for bound, want in ((15, 15), (None, None), (32, None)):  # a bound of n - 1 or more says nothing
        graphs = TreeGraphs(budget=32, max_reqs=2, max_seq_len=64, device=torch.device("cpu"), depth_bound=bound)
        with graphs.capture(2):
            graphs.begin_run()
            plan = current_step_kernels(STATE.step).plan
            assert (plan.depth_bound, plan.max_depth) == (want, 32)
            graphs.end_capture_run(current_step_kernels(STATE.step))
        step = tree_step(2, 33, np.random.default_rng(5))
        graphs.prepare_replay(step)
        assert current_step_kernels(step).plan.depth_bound == want
    with pytest.raises(ValueError, match="depth_bound must be >= 1, got 0"):
        TreeGraphs(budget=4, max_reqs=1, max_seq_len=64, device=torch.device("cpu"), depth_bound=0)


class FakeRunner:
    _tfm_enabled = True

    def __init__(self, graphs: TreeGraphs | None) -> None:
        self._tfm_tree_graphs = graphs
        self.calls: list[bool] = []


def fake_dispatch(pad_to: int | None = None) -> Any:
    def orig(self: FakeRunner, num_tokens: int, num_reqs: int, nst: Any, max_nst: int, use_cascade_attn: bool, **kw: Any):
        self.calls.append(use_cascade_attn)
        if use_cascade_attn:
            return SimpleNamespace(name="PIECEWISE"), SimpleNamespace(num_tokens=num_tokens)
        return SimpleNamespace(name="FULL"), SimpleNamespace(num_tokens=pad_to or num_tokens)

    return graph_dispatch._wrap_determine(orig)


def run_dispatch(runner: FakeRunner, step: StepTree | None, pad_to: int | None = None) -> str:
    saved, saved_metrics = STATE.step, STATE.metrics
    STATE.step, STATE.metrics = step, None
    try:
        t = step.num_tokens if step is not None else 1
        return fake_dispatch(pad_to)(runner, t, 1, None, 1, False)[0].name
    finally:
        STATE.step, STATE.metrics = saved, saved_metrics


def test_dispatch_gives_full_only_to_tree_steps_that_fit_a_captured_tree_graph() -> None:
    rng = np.random.default_rng(5)
    graphs = TreeGraphs(budget=4, max_reqs=3, max_seq_len=64, device=torch.device("cpu"))
    with graphs.capture(2):
        graphs.begin_run()
        graphs.end_capture_run(current_step_kernels(STATE.step))
    runner = FakeRunner(graphs)
    step = tree_step(2, 5, rng)
    assert run_dispatch(runner, step) == "FULL" and runner.calls == [False] and step.full_graph
    runner.calls.clear()
    assert run_dispatch(runner, tree_step(3, 5, rng)) == "PIECEWISE" and runner.calls == [True]  # no graph of 3
    runner.calls.clear()
    assert run_dispatch(runner, tree_step(2, 5, rng, active=False)) == "PIECEWISE" and runner.calls == [True]
    runner.calls.clear()
    assert run_dispatch(runner, None) == "PIECEWISE"  # no tree step: the full graphs verify trees
    runner.calls.clear()
    padded = tree_step(2, 5, rng)
    assert run_dispatch(runner, padded, pad_to=15) == "PIECEWISE" and runner.calls == [False, True] and not padded.full_graph
    # without tree graphs: tree steps never FULL, other steps as vLLM decides
    plain = FakeRunner(None)
    assert run_dispatch(plain, tree_step(2, 5, rng)) == "PIECEWISE" and plain.calls == [True]
    assert run_dispatch(plain, tree_step(2, 5, rng, active=False)) == "FULL"


def test_a_warm_up_poses_as_a_batch_of_spec_decodes_and_is_undone() -> None:
    runner = SimpleNamespace(num_decode_draft_tokens=SimpleNamespace(cpu=torch.zeros(6, dtype=torch.int32)),
                             num_accepted_tokens=SimpleNamespace(gpu=torch.tensor([3, 2, 5, 1, 1, 4], dtype=torch.int32)))
    undo = graph_dispatch._pose_as_spec_batch(runner, 2, 7)
    assert runner.num_decode_draft_tokens.cpu.tolist() == [7, 7, -1, -1, -1, -1]
    assert runner.num_accepted_tokens.gpu.tolist() == [1, 1, 5, 1, 1, 4]
    undo()
    assert runner.num_decode_draft_tokens.cpu.tolist() == [0] * 6
    assert runner.num_accepted_tokens.gpu.tolist() == [3, 2, 5, 1, 1, 4]


def test_a_capture_without_the_kernel_path_falls_back_to_vllms_full_graphs(caplog: pytest.LogCaptureFixture) -> None:
    from vllm_tfm.vllm_plugin.runtime.full_graphs import FullTreeGraphsUnavailable

    graphs = TreeGraphs(budget=4, max_reqs=3, max_seq_len=64, device=torch.device("cpu"))
    runner = FakeRunner(graphs)
    seen: list[bool] = []

    def orig(self: FakeRunner, desc: Any, mode: Any) -> str:
        seen.append(STATE.step is not None)
        if STATE.step is not None:  # a tree capture: a layer has no kernel path
            raise FullTreeGraphsUnavailable("a bfloat16 SSM state")
        return "vllm's capture"

    wrapped = graph_dispatch._wrap_warmup_and_capture(orig)
    desc = SimpleNamespace(uniform=True, num_tokens=10)
    with caplog.at_level("WARNING", logger="vllm.tfm"):
        assert wrapped(runner, desc, SimpleNamespace(name="FULL")) == "vllm's capture"
    assert seen == [True, False] and runner._tfm_tree_graphs is None and STATE.step is None
    assert "full CUDA graphs of tree steps are off: a bfloat16 SSM state" in caplog.text
    # once tree graphs were captured, the other full graphs cannot be vLLM's: the start stops
    graphs.captured[1] = None
    runner = FakeRunner(graphs)
    with pytest.raises(RuntimeError, match="need the NVRTC kernel path .* \\(a bfloat16 SSM state\\); use cudagraph_mode=PIECEWISE"):
        wrapped(runner, desc, SimpleNamespace(name="FULL"))
    # piecewise captures and mixed (non-uniform) full captures are vLLM's
    seen.clear()
    assert wrapped(FakeRunner(graphs), SimpleNamespace(uniform=True, num_tokens=10), SimpleNamespace(name="PIECEWISE")) == "vllm's capture"
    assert seen == [False]


def test_the_stash_reserved_after_the_profile_run_is_the_one_the_capture_uses() -> None:
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    from vllm_tfm.vllm_plugin.runtime.hooks import reserve_tree_graph_stash

    graphs = TreeGraphs(budget=4, max_reqs=3, max_seq_len=64, device=torch.device("cpu"))
    layer = QwenGatedDeltaNetAttention.__new__(QwenGatedDeltaNetAttention)
    torch.nn.Module.__init__(layer)
    layer.prefix, layer.tp_size, layer.num_k_heads, layer.head_k_dim, layer.num_v_heads, layer.head_v_dim = (
        "model.layers.0.linear_attn", 2, 4, 8, 6, 16)
    layer.conv1d = SimpleNamespace(weight=torch.zeros(2 * 2 * 8 + 3 * 16, 1, 4))
    runner = SimpleNamespace(_tfm_tree_graphs=graphs, device=torch.device("cpu"),
                             model_config=SimpleNamespace(is_hybrid=True, dtype=torch.bfloat16),
                             compilation_config=SimpleNamespace(static_forward_context={"a": layer, "b": object()}))
    assert reserve_tree_graph_stash(runner) == 1
    st = graphs.layers["model.layers.0.linear_attn"]
    assert tuple(st.x.shape) == (15, 80) and st.x.dtype == torch.bfloat16
    assert tuple(st.qk.shape) == (2, 15, 2, 8) and tuple(st.g.shape) == (15, 3) and tuple(st.delta.shape) == (15, 3, 16)
    # the layer's own request at capture time finds it; other shapes or dtypes get a new one
    x = torch.zeros(10, 80, dtype=torch.bfloat16)
    assert graphs.layer_stash("model.layers.0.linear_attn", x, 2, 8, torch.float32, 3, 16, torch.bfloat16) is st
    other = graphs.layer_stash("model.layers.0.linear_attn", x.float(), 2, 8, torch.float32, 3, 16, torch.float32)
    assert other is not st and other.x.dtype == torch.float32
    assert reserve_tree_graph_stash(SimpleNamespace(_tfm_tree_graphs=None)) == 0


def test_a_fixed_layout_plan_is_reused_only_for_its_own_buffer_size_and_bound() -> None:
    rng = np.random.default_rng(21)
    n = 9
    buf = torch.zeros(TreePlan.fixed_size(3, n), dtype=torch.int32)
    cu3, cu2 = np.arange(4) * n, np.arange(3) * n
    first = TreePlan.build_into(buf, random_parents(rng, 3, n), cu3, n, depth_bound=4)
    parents = random_parents(rng, 3, n)
    again = TreePlan.build_into(buf, parents, cu3, n, depth_bound=4, layout=first)
    ref = TreePlan.build(torch.from_numpy(parents), torch.from_numpy(cu3))
    assert again is first and torch.equal(again.perm, ref.perm) and torch.equal(again.pair_j[: ref.num_pairs], ref.pair_j)
    other_buf = torch.zeros_like(buf)
    for kwargs in ({"buffer": buf, "parents": random_parents(rng, 2, n), "cu": cu2, "bound": 4},  # another R
                   {"buffer": buf, "parents": parents, "cu": cu3, "bound": 5},  # another bound
                   {"buffer": other_buf, "parents": parents, "cu": cu3, "bound": 4}):  # another buffer
        plan = TreePlan.build_into(kwargs["buffer"], kwargs["parents"], kwargs["cu"], n, depth_bound=kwargs["bound"],
                                   layout=first)
        assert plan is not first and plan.cu.data_ptr() == kwargs["buffer"].data_ptr()
        want = TreePlan.build(torch.from_numpy(kwargs["parents"]), torch.from_numpy(kwargs["cu"]))
        assert torch.equal(plan.perm, want.perm) and plan.depth_bound == kwargs["bound"]
