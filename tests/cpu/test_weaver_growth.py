"""The in-place lockstep Weaver build (``WeaverGrowth`` + ``BatchedWeaverTreeScorer``) against the
previous implementation (frozen in ``_weaver_before``) with a real float32 Weaver: the same trees
(tokens, parents, depths, sizes) and scorer calls, scores to float32 rounding (the scorer's fused
step, ``models/weaver_step.py``, sums in another order: ``test_weaver_fused_step.py`` bounds it);
its host syncs and per-round operator count; tail rounds restricted to the first rows.

Table-scorer comparisons (ties, -inf, short frontiers, ragged limits) against the per-request
reference ``build_weaver`` and the previous builder are in ``test_padded_builders.py``."""

from __future__ import annotations

import pytest
import torch
from _models import Recorder, randomize
from _weaver_before import BatchedWeaverTreeScorerBefore, build_weaver_padded_before
from torch.utils._python_dispatch import TorchDispatchMode

from vllm_tfm.models import (
    BatchedWeaverTreeScorer,
    Weaver,
    WeaverConfig,
    weaver_padded_trees,
)
from vllm_tfm.models.proposal_trees import weaver_growth
from vllm_tfm.tree import build_weaver, build_weaver_padded
from vllm_tfm.tree.weaver_padded import WeaverGrowth

pytestmark = pytest.mark.usefixtures("one_thread")

V, H = 200, 32
FIELDS = ("tokens", "parents", "depth", "num_nodes")  # equal
CLOSE = ("scores", "draft_logprobs")  # equal to float32 rounding


def assert_close(a, b, what: str) -> None:
    assert a.dtype == b.dtype, what
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=what)


def model_inputs(r: int, depth: int, seed: int):
    """A float32 Weaver with spread weights and random drafter outputs (fresh per seed)."""
    g = torch.Generator().manual_seed(seed)
    cfg = WeaverConfig(d_model=H, d_rank=16, n_layers=2, n_heads=2, d_mlp=24, max_depth=depth)
    w = randomize(Weaver(cfg), seed=seed).float().eval()
    embed = torch.randn(V, H, generator=g)
    head = torch.randn(V, H, generator=g) * 0.5
    logits = torch.randn(r, depth, V, generator=g) * 2
    dh = torch.randn(r, depth, H, generator=g)
    vh = torch.randn(r, H, generator=g)
    roots = torch.randint(0, V, (r,), generator=g)
    return w, embed, head, logits, dh, vh, roots


def assert_same_calls(new: Recorder, old: Recorder) -> None:
    """Same number of calls, same valid rows (node, parent, token, depth), same scores on them."""
    assert len(new.calls) == len(old.calls)
    for i, ((a_new, o_new), (a_old, o_old)) in enumerate(zip(new.calls, old.calls)):
        ok = a_new[4]
        assert torch.equal(ok, a_old[4]), f"call {i}: valid rows"
        for j in range(4):
            assert torch.equal(a_new[j][ok], a_old[j][ok]), f"call {i}: argument {j}"
        assert_close(o_new[ok], o_old[ok], f"call {i}: scores differ on valid rows")


# (R, B, width, top_k, children_per_node, D): R = 1, B = 1, w > B, short frontiers (cpn < w)
CASES = [
    (1, 1, 1, 8, 8, 3),
    (1, 16, 1, 40, 8, 15),
    (5, 16, 2, 40, 8, 6),
    (3, 33, 4, 64, 8, 6),
    (4, 20, 6, 12, 2, 4),
    (2, 9, 16, 5, 3, 2),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_weaver_trees_equal_the_previous_builder_and_scorer(case):
    r_, budget, width, top_k, cpn, depth = CASES[case]
    w, embed, head, logits, dh, vh, roots = model_inputs(r_, depth, seed=100 + case)
    trees, cand = weaver_padded_trees(w, logits, dh, vh, roots, embed, head, budget, top_k, width, cpn)
    cl = logits.topk(top_k, dim=-1).values
    old_scorer = BatchedWeaverTreeScorerBefore(w, vh, dh, cand, cl, embed, head, max_nodes=1 + budget)
    old = build_weaver_padded_before(roots, cand, old_scorer, budget, depth, width, cpn, check=False)
    for name in FIELDS:
        a, b = getattr(trees, name), getattr(old, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    for name in CLOSE:
        assert_close(getattr(trees, name), getattr(old, name), name)
    assert int(trees.num_nodes.min()) > 1  # the trees grew


def test_ragged_requests_with_the_real_weaver_equal_the_previous_builder_call_by_call():
    r_, depth, top_k = 5, 5, 24
    budgets, widths, depths = [1, 17, 30, 8, 12], [1, 3, 5, 2, 8], [5, 2, 5, 4, 1]
    w, embed, head, logits, dh, vh, roots = model_inputs(r_, depth, seed=7)
    cl, cand = logits.topk(top_k, dim=-1)
    new = Recorder(BatchedWeaverTreeScorer(w, vh, dh, cand, cl, embed, head, max_nodes=1 + max(budgets)))
    got = build_weaver_padded(roots, cand, new, budgets, depths, widths, children_per_node=3)
    old = Recorder(BatchedWeaverTreeScorerBefore(w, vh, dh, cand, cl, embed, head, max_nodes=1 + max(budgets)))
    ref = build_weaver_padded_before(roots, cand, old, budgets, depths, widths, children_per_node=3)
    for name in FIELDS:
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    for name in CLOSE:
        assert_close(getattr(got, name), getattr(ref, name), name)
    assert_same_calls(new, old)
    # max_depth binds requests 1 (1 + 3 + 9 nodes at depth <= 2) and 4 (1 + 3 at depth 1)
    assert got.num_nodes.tolist() == [2, 13, 31, 9, 4]


SYNC_OPS = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
            "aten._unique2.default", "aten.repeat_interleave.Tensor", "aten.equal.default"}


class OpLog(TorchDispatchMode):
    """Operator count and host syncs (including ``tolist``, which dispatches nothing on the CPU)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops, self.syncs = 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        if str(func) in SYNC_OPS or (str(func) == "aten.lift_fresh.default" and args[0].dim() > 0):
            self.syncs.append(str(func))
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        tolist, syncs = self._tolist, self.syncs

        def logged(t):
            syncs.append("tolist")
            return tolist(t)

        torch.Tensor.tolist = logged
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)


def test_fixed_rounds_have_no_host_sync_and_an_op_count_independent_of_the_batch():
    budget, width, top_k, cpn, depth = 16, 2, 32, 8, 6
    per_round = {}
    for r_ in (1, 4, 16):
        w, embed, head, logits, dh, vh, roots = model_inputs(r_, depth, seed=r_)
        # inference_mode, as in vLLM: each torch call dispatches once (composite operators are not
        # decomposed, and their decomposition may depend on sizes, e.g. a batch of one)
        with torch.inference_mode(), OpLog() as log:
            growth, cand = weaver_growth(w, logits, dh, vh, roots, embed, head, budget, top_k, width, cpn)
            setup_and_fixed = log.ops
            growth.advance()  # one more round, to measure a round alone
            per_round[r_] = log.ops - setup_and_fixed
            growth.trees().draft_layout(cand[:, 0, 0])
        assert log.syncs == [], f"R={r_}: host syncs {log.syncs}"
        assert growth.rounds == growth.fixed_rounds + 1 == 9
        with torch.inference_mode(), OpLog() as log:
            growth.run_tail()
        assert log.syncs == ["tolist"]  # exactly one, to ask whether any request has work left
    assert per_round[1] == per_round[4] == per_round[16]


def test_tail_rounds_restricted_to_the_first_rows_ignore_the_rows_after_them():
    # request 0 (w = 1, B = 4) is done after S = 4 rounds; request 1 (w = 4, B = 16, 2 children
    # per node) has a short frontier and needs more: with rows=1 no extra round runs
    g = torch.Generator().manual_seed(3)
    depth, k = 4, 6
    table = torch.log_softmax(torch.randn(2, depth, 7, k, generator=g), -1)
    cands = torch.stack([torch.randperm(50, generator=g)[: depth * k].view(depth, k) for _ in range(2)])
    rows = torch.arange(2)[:, None]

    def scorer(ids, parents, tokens, depths, valid):
        return table[rows, depths.clamp(max=depth - 1), tokens % 7]

    def growth() -> WeaverGrowth:
        gr = WeaverGrowth([3, 4], cands, scorer, [4, 16], depth, [1, 4], children_per_node=2)
        gr.run_fixed()
        return gr

    first = growth()
    assert first.fixed_rounds == 4
    first.run_tail(rows=1)
    assert first.rounds == 4
    full = growth()
    full.run_tail()
    assert full.rounds > 4
    for r, gr in ((0, first), (0, full), (1, full)):
        ref = build_weaver([3, 4][r], cands[r], lambda i, p, t, d, r=r: table[r, d.clamp(max=depth - 1), t % 7],
                           [4, 16][r], depth, [1, 4][r], 2)
        tree = gr.trees().tree(r)
        assert tree.tokens.tolist() == ref.tokens.tolist() and tree.parents.tolist() == ref.parents.tolist()
    assert int(first.trees().num_nodes[1]) < 17 == int(full.trees().num_nodes[1])


def test_with_a_prompt_stream_everything_it_touches_is_made_before_the_fork_and_the_trees_do_not_change(monkeypatch):
    """``weaver_growth(prompt_stream=)``: the prompt stream starts after an event recorded on the build's stream, and
    memory the caching allocator hands out after that event may be a temporary the top-K queued after it still
    reads (bench/NOTES.md section 62: the first form allocated the K/V buffers in the scorer, after the top-K, and
    broke the torch-reference build on the GPU). So the K/V buffers (and the folded weights and RoPE table) are
    made, then the event is recorded, then the top-K is queued, and the scorer takes those buffers. Run on the CPU
    with the CUDA-only parts stood in for: the order of those steps, and the same trees as without a stream."""
    import vllm_tfm.models.proposal_trees as pt
    from vllm_tfm.models.weaver import BatchedWeaverTreeScorer

    budget, width, top_k, cpn, depth = 8, 2, 16, 4, 5
    w, embed, head, logits, dh, vh, roots = model_inputs(3, depth, seed=11)
    with torch.inference_mode():
        base_growth, base_cand = weaver_growth(w, logits, dh, vh, roots, embed, head, budget, top_k, width, cpn)
        base_growth.run_tail()
        want = base_growth.trees().draft_layout(base_cand[:, 0, 0])

    log: list[str] = []
    made: list[list[torch.Tensor]] = []
    real_buffers, real_candidates = BatchedWeaverTreeScorer.prompt_buffers, pt._candidates
    real_init = BatchedWeaverTreeScorer.__init__

    class Event:  # stands in for torch.cuda.Event: records where the fork is
        def record(self) -> None:
            log.append("fork")

    def buffers(*args, **kwargs):
        log.append("buffers")
        made.append(real_buffers(*args, **kwargs))
        return made[-1]

    def candidates(*args, **kwargs):
        log.append("top-K")
        return real_candidates(*args, **kwargs)

    def init(self, *args, **kwargs):
        log.append("scorer")
        assert kwargs["kv_cache"] is made[-1] and isinstance(kwargs["prompt_after"], Event)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(pt, "_runs_prompt_beside", lambda stream, hidden: stream is not None)
    monkeypatch.setattr(pt.torch.cuda, "Event", Event)
    monkeypatch.setattr(BatchedWeaverTreeScorer, "prompt_buffers", staticmethod(buffers))
    monkeypatch.setattr(BatchedWeaverTreeScorer, "__init__", init)
    monkeypatch.setattr(pt, "_candidates", candidates)
    with torch.inference_mode():
        growth, cand = weaver_growth(w, logits, dh, vh, roots, embed, head, budget, top_k, width, cpn,
                                     prompt_stream=object())  # on the CPU the scorer runs the prompt in line
        growth.run_tail()
        got = growth.trees().draft_layout(cand[:, 0, 0])
    assert log == ["buffers", "fork", "top-K", "scorer"]
    assert len(growth.scorer.kv_cache) == len(made[-1]) and all(a is b for a, b in zip(growth.scorer.kv_cache, made[-1]))
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
