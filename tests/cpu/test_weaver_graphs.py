"""CUDA-graph wrapper of the Weaver build (``runtime/weaver_graphs.py``), the parts that run
without a GPU: the switch, bucket choice, static-input padding, the eager fallback, and which
graphs are captured when (the start-up warm-up, shared input buffers, captures while serving),
with captures recorded instead of made. Graph replay itself: ``tests/gpu/test_weaver_graphs_gpu.py``."""

from __future__ import annotations

import logging

import pytest
import torch
from _graph_recorder import RecordingGraphs, Replayed
from _models import randomize

from vllm_tfm.models import Weaver, WeaverConfig
from vllm_tfm.vllm_plugin.runtime.tree_builder_gpu import weaver_trees
from vllm_tfm.vllm_plugin.runtime.weaver_graphs import (
    DEFAULT_BUCKETS,
    LAZY_TAIL_ENV,
    DeferredTail,
    StaticInputs,
    WeaverGraphs,
    bucket_for,
    graph_buckets,
    set_weaver_lazy_tail,
    warm_up_buckets,
    weaver_graphs_from_env,
    weaver_lazy_tail_enabled,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bucket_is_the_smallest_size_that_holds_the_batch():
    assert [bucket_for(r, DEFAULT_BUCKETS) for r in (1, 2, 3, 5, 8, 9, 100, 128)] == [1, 2, 4, 8, 8, 16, 128, 128]
    assert bucket_for(129, DEFAULT_BUCKETS) is None
    assert [bucket_for(r, (3, 10)) for r in (1, 3, 4, 10, 11)] == [3, 3, 10, 10, None]


def test_switch_and_bucket_list_from_the_environment():
    assert weaver_graphs_from_env({}).buckets == DEFAULT_BUCKETS  # on by default
    assert weaver_graphs_from_env({"VLLM_TFM_WEAVER_GRAPHS": "0"}) is None
    assert weaver_graphs_from_env({"VLLM_TFM_WEAVER_GRAPHS": "off"}) is None
    assert weaver_graphs_from_env({"VLLM_TFM_WEAVER_GRAPHS": "false"}) is None
    assert weaver_graphs_from_env({"VLLM_TFM_WEAVER_GRAPHS": "1"}).buckets == DEFAULT_BUCKETS
    on = {"VLLM_TFM_WEAVER_GRAPHS": "1", "VLLM_TFM_WEAVER_GRAPH_BUCKETS": "16, 4,8,4"}
    assert weaver_graphs_from_env(on).buckets == (4, 8, 16)
    assert graph_buckets(None) == graph_buckets("  ") == DEFAULT_BUCKETS
    for bad in ("a,2", "0,4", ",", "-1"):
        with pytest.raises(ValueError, match=rf"VLLM_TFM_WEAVER_GRAPH_BUCKETS='{bad}': expected comma-separated integers >= 1"):
            graph_buckets(bad)


def test_static_inputs_take_the_batch_in_their_first_rows_and_keep_the_rest():
    g = torch.Generator().manual_seed(0)
    big = [torch.randn(3, 2, 5, generator=g), torch.randn(3, 2, 4, generator=g), torch.randn(3, 4, generator=g),
           torch.tensor([7, 8, 9], dtype=torch.int32)]
    buf = StaticInputs.zeros_like(4, *big)
    assert buf.bucket == 4 and buf.roots.dtype == torch.int32
    buf.fill(*big)
    small = [x[:1] * 0 + 1 for x in big]
    buf.fill(*small)
    for got, first, second in zip((buf.logits, buf.hidden, buf.verifier, buf.roots), big, small):
        assert torch.equal(got[:1], second)  # the new batch
        assert torch.equal(got[1:3], first[1:3])  # rows of the earlier batch, untouched
        assert not got[3].any()  # never written
    with pytest.raises(ValueError, match="a batch of 5 requests does not fit a graph bucket of 4"):
        buf.fill(*[torch.cat([x, x[:2]]) for x in big])
    with pytest.raises(ValueError, match=r"input of shape \(2, 3, 5\) does not fit buffer rows of shape \(2, 5\)"):
        buf.fill(torch.zeros(2, 3, 5), *[x[:2] for x in big[1:]])


def test_cpu_batches_build_eagerly_with_the_same_trees():
    torch.manual_seed(0)
    h, vocab, r_, depth = 32, 100, 3, 4
    weaver = randomize(Weaver(WeaverConfig(d_model=h, d_rank=16, n_layers=2, n_heads=2, d_mlp=24, max_depth=depth)), 1)
    weaver = weaver.float().eval()
    embed, head = torch.randn(vocab, h), torch.randn(vocab, h) * 0.3
    args = (weaver, torch.randn(r_, depth, vocab) * 2, torch.randn(r_, depth, h), torch.randn(r_, h),
            torch.randint(0, vocab, (r_,)), embed, head, 10, 12, 2, 3)
    graphs = WeaverGraphs((4, 8))
    assert graphs.bucket(args[1], embed, head) is None
    tok, par = graphs.weaver_trees(*args)
    ref_tok, ref_par = weaver_trees(*args)
    assert torch.equal(tok, ref_tok) and torch.equal(par, ref_par)
    assert (graphs.eager_builds, graphs.replays) == (1, 0)
    with pytest.raises(ValueError, match=r"graph buckets must be integers >= 1"):
        WeaverGraphs((0, 2))


# ------------------------------------------------------------------------------ which graphs, when
D, V, H, B = 3, 50, 8, 6
WEAVER, EMBED, HEAD = object(), torch.zeros(V, H), torch.zeros(V, H)
ARGS = (WEAVER, EMBED, HEAD, B, 12, 1, 4)  # weaver, tables, budget, top_k, width, children per node


def zero_rows(asked: list[int], dtype: torch.dtype = torch.float32):
    """The proposer's warm-up inputs: one zero row of each drafter output, expanded to the bucket."""

    def make(rows: int):
        asked.append(rows)
        return (torch.zeros(1, D, V, dtype=dtype).expand(rows, -1, -1), torch.zeros(1, D, H).expand(rows, -1, -1),
                torch.zeros(1, H).expand(rows, -1), torch.zeros(1, dtype=torch.int32).expand(rows))

    return make


def batch(r: int, seed: int, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(r, D, V, generator=g).to(dtype), torch.randn(r, D, H, generator=g), torch.randn(r, H, generator=g),
            torch.randint(0, V, (r,), generator=g, dtype=torch.int32))


def serve(graphs: WeaverGraphs, r: int, seed: int, dtype: torch.dtype = torch.float32, top_k: int = 12) -> None:
    logits, hidden, verifier, roots = batch(r, seed, dtype)
    with pytest.raises(Replayed):
        graphs.weaver_trees(WEAVER, logits, hidden, verifier, roots, EMBED, HEAD, B, top_k, 1, 4)


def test_warm_up_buckets_are_every_bucket_a_batch_can_use_largest_first():
    assert warm_up_buckets(DEFAULT_BUCKETS, 64) == (64, 32, 16, 8, 4, 2, 1)
    assert warm_up_buckets(DEFAULT_BUCKETS, 40) == (64, 32, 16, 8, 4, 2, 1)  # 33..40 requests replay in 64
    assert warm_up_buckets(DEFAULT_BUCKETS, 3) == (4, 2, 1)
    assert warm_up_buckets(DEFAULT_BUCKETS, 1024) == (128, 64, 32, 16, 8, 4, 2, 1)  # larger batches build eagerly
    assert warm_up_buckets((10, 3), 1) == (3,) and warm_up_buckets((3, 10), 4) == (10, 3)
    for bad in (0, -2, True, 2.0):
        with pytest.raises(ValueError, match=r"max_requests must be an integer >= 1"):
            warm_up_buckets(DEFAULT_BUCKETS, bad)


def test_warm_up_captures_those_buckets_once_each():
    graphs, asked = RecordingGraphs(), []
    assert graphs.warmed_up is None
    assert graphs.warm_up(40, zero_rows(asked), *ARGS, device=torch.device("cpu")) == (64, 32, 16, 8, 4, 2, 1)
    assert graphs.captured == [64, 32, 16, 8, 4, 2, 1] and asked == [64, 32, 16, 8, 4, 2, 1]
    assert graphs.warmed_up == (64, 32, 16, 8, 4, 2, 1) and graphs.late_captures == []
    assert graphs.warm_up(40, zero_rows(asked), *ARGS, device=torch.device("cpu")) == ()  # already captured
    assert graphs.captured == [64, 32, 16, 8, 4, 2, 1]
    small = RecordingGraphs((8, 4))  # VLLM_TFM_WEAVER_GRAPH_BUCKETS=4,8
    assert small.warm_up(40, zero_rows([]), *ARGS, device=torch.device("cpu")) == (8, 4)
    with pytest.raises(ValueError, match="warm-up inputs for bucket 8 have 3 rows"):
        RecordingGraphs((8,)).warm_up(8, lambda rows: batch(3, 0), *ARGS, device=torch.device("cpu"))


def test_warm_up_captures_nothing_where_builds_run_eagerly():
    graphs, asked = WeaverGraphs(), []  # CPU tensors never replay graphs
    assert graphs.warm_up(64, zero_rows(asked), *ARGS, device=torch.device("cpu")) == ()
    assert asked == [] and graphs.warmed_up == () and graphs.captured == []


def test_serving_after_the_warm_up_replays_and_captures_nothing(caplog):
    graphs = RecordingGraphs()
    graphs.warm_up(40, zero_rows([]), *ARGS, device=torch.device("cpu"))
    for step, r in enumerate([33, 5, 1, 17, 40, 2, 8, 3]):
        serve(graphs, r, seed=step)
    assert graphs.captured == [64, 32, 16, 8, 4, 2, 1] and graphs.late_captures == []
    # the last batch (3 requests) went into rows 0..2 of the input buffers of bucket 4
    logits, hidden, verifier, roots = batch(3, seed=7)
    (cap,) = [c for k, c in graphs._graphs.items() if k[0] == 4]
    for got, want in zip((cap.inputs.logits, cap.inputs.hidden, cap.inputs.verifier, cap.inputs.roots),
                         (logits, hidden, verifier, roots.long())):
        assert torch.equal(got[:3], want)
    # a key the warm-up did not cover (other dtype, other top-k) is captured while serving, counted and logged once
    with caplog.at_level(logging.WARNING, logger="vllm.tfm"):
        serve(graphs, 5, seed=9, dtype=torch.float64)
        serve(graphs, 6, seed=10, dtype=torch.float64)
        serve(graphs, 2, seed=11, top_k=7)
    assert graphs.captured[7:] == [8, 2] and graphs.late_captures == [8, 2]
    warned = [r.getMessage() for r in caplog.records if "while serving" in r.getMessage()]
    assert len(warned) == 2 and warned[0].startswith("vllm-tfm: captured the Weaver CUDA graph of batch bucket 8 while serving")
    # without a warm-up, first uses capture as before and are not counted as late
    lazy = RecordingGraphs()
    serve(lazy, 5, seed=0)
    assert lazy.captured == [8] and lazy.late_captures == []


def test_graphs_share_one_set_of_input_buffers():
    graphs = RecordingGraphs()
    graphs.warm_up(64, zero_rows([]), *ARGS, device=torch.device("cpu"))
    caps = {k[0]: c for k, c in graphs._graphs.items()}
    assert len(graphs._inputs) == 1
    (shared,) = graphs._inputs.values()
    assert shared.bucket == 64 and tuple(shared.logits.shape) == (64, D, V) and shared.roots.dtype == torch.long
    for bucket, cap in caps.items():
        assert cap.inputs.bucket == bucket and tuple(cap.inputs.hidden.shape) == (bucket, D, H)
        for view, whole in zip((cap.inputs.logits, cap.inputs.hidden, cap.inputs.verifier, cap.inputs.roots),
                               (shared.logits, shared.hidden, shared.verifier, shared.roots)):
            assert view.data_ptr() == whole.data_ptr()  # rows 0..bucket-1 of the one buffer
    # a larger bucket captured later gets buffers of its own; the earlier graphs keep theirs
    serve(graphs, 100, seed=1)
    assert graphs._inputs[next(iter(graphs._inputs))].bucket == 128
    assert caps[64].inputs.logits.data_ptr() == shared.logits.data_ptr() and caps[64].inputs.logits.shape[0] == 64
    # another dtype is another signature: buffers of its own
    serve(graphs, 3, seed=2, dtype=torch.float64)
    assert len(graphs._inputs) == 2
    with pytest.raises(ValueError, match="a graph bucket of 65 does not fit input buffers of 64 rows"):
        shared.rows(65)


class FakeGrowth:
    """What ``DeferredTail`` reads of a ``WeaverGrowth``: the check's flags (CPU tensors) and the tail."""

    def __init__(self, more: bool, bad: bool = False) -> None:
        self.flags = torch.tensor([more, bad])
        self.rounds = 3
        self.tail_calls = 0

    def pending_flags(self, rows: int | None = None) -> torch.Tensor:
        return self.flags

    def run_tail(self, rows: int | None = None) -> None:
        self.tail_calls += 1
        self.rounds += 2

    def trees(self):
        class _Trees:
            def draft_layout(self, filler):
                return torch.full((2, 3), 9), torch.tensor([[-1, 0, 1, 2]] * 2)

        return _Trees()


def deferred(graphs: WeaverGraphs, growth: FakeGrowth, key: tuple, lazy: bool) -> DeferredTail:
    tail = DeferredTail(graphs, growth, 1, torch.zeros(1, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long),
                        torch.tensor([[-1, 0, 0, 0]]), key, lazy)
    graphs._unfinished = graphs.last_tail = tail
    return tail


def test_a_lazy_tail_check_does_not_hold_the_forward_and_its_key_waits_once_it_needed_a_tail(caplog, monkeypatch):
    from vllm_tfm.vllm_plugin.runtime.metrics import Metrics
    from vllm_tfm.vllm_plugin.runtime.state import STATE

    monkeypatch.setattr(STATE, "metrics", Metrics(max_depth=8, device="cpu"))
    monkeypatch.delenv(LAZY_TAIL_ENV, raising=False)
    graphs = WeaverGraphs()
    key_a, key_b = (4, 16, "a"), (8, 16, "b")
    assert graphs.defers_lazily(key_a) and graphs.defers_lazily(key_b)  # on by default
    short, full = FakeGrowth(more=True), FakeGrowth(more=False)
    t1 = deferred(graphs, short, key_a, graphs.defers_lazily(key_a))
    assert t1.finish() is False and t1.done and not t1.changed  # no tail rounds, the returned trees as they are
    assert short.tail_calls == 0 and t1.tokens.tolist() == [[0, 0, 0]] and t1.skipped is None
    assert graphs._unfinished is None and graphs._unchecked == [t1]
    t2 = deferred(graphs, full, key_b, graphs.defers_lazily(key_b))
    t2.finish()
    with caplog.at_level(logging.WARNING, logger="vllm.tfm"):
        assert graphs.check_skipped_tails() == 1  # read after the forward: t1's trees were short
    assert (t1.skipped, t2.skipped) == (True, False) and graphs._unchecked == [] and graphs.skipped_tails == 1
    assert STATE.metrics.hooks["weaver.tail_skipped"] == 1
    (warned,) = [r.getMessage() for r in caplog.records]
    assert warned.startswith("vllm-tfm: a Weaver build (batch bucket 4) needed growth rounds past the captured ones")
    # key_a waits from now on (the eager tail rewrites the trees); key_b stays lazy
    assert not graphs.defers_lazily(key_a) and graphs.defers_lazily(key_b)
    again = FakeGrowth(more=True)
    t3 = deferred(graphs, again, key_a, graphs.defers_lazily(key_a))
    assert t3.finish() is True and again.tail_calls == 1 and t3.tokens.tolist() == [[9, 9, 9]]
    assert graphs._unchecked == [] and graphs.check_skipped_tails() == 0


def test_a_lazy_check_raises_for_scores_that_were_not_log_probabilities_one_step_later():
    graphs = WeaverGraphs()
    tail = deferred(graphs, FakeGrowth(more=False, bad=True), (1,), lazy=True)
    assert tail.finish() is False  # nothing read yet
    with pytest.raises(ValueError, match="scorer output must be log-probabilities"):
        graphs.check_skipped_tails()
    waiting = deferred(graphs, FakeGrowth(more=False, bad=True), (1,), lazy=False)
    with pytest.raises(ValueError, match="scorer output must be log-probabilities"):
        waiting.finish()


def test_the_lazy_tail_switch(monkeypatch):
    graphs = WeaverGraphs()
    monkeypatch.setenv(LAZY_TAIL_ENV, "0")
    assert not weaver_lazy_tail_enabled() and not graphs.defers_lazily((1,))
    try:
        assert set_weaver_lazy_tail(True) is True and graphs.defers_lazily((1,))
        assert set_weaver_lazy_tail(None) is False
        monkeypatch.delenv(LAZY_TAIL_ENV)
        assert weaver_lazy_tail_enabled()
        with pytest.raises(ValueError, match="set_weaver_lazy_tail takes True, False or None"):
            set_weaver_lazy_tail("yes")  # type: ignore[arg-type]
    finally:
        set_weaver_lazy_tail(None)



@pytest.mark.parametrize("env, setter, enabled, position, default_on", [
    ("VLLM_TFM_TOPK_KERNEL", "set_topk_kernel", "topk_kernel_enabled", 2, True),
    ("VLLM_TFM_WEAVER_PROMPT_OVERLAP", "set_prompt_overlap", "prompt_overlap_enabled", 1, False),
])
def test_the_weaver_graphs_key_holds_each_build_switch(env, setter, enabled, position, default_on, monkeypatch) -> None:
    """The build switches of runtime/tree_builder_gpu.py: the environment (on by default, or opt-in), the in-process
    setter over it, and the Weaver graphs' key, which holds the setting in its own place, so that a same-engine A/B
    replays (or captures) the other setting's graph."""
    from vllm_tfm.vllm_plugin.runtime import tree_builder_gpu as tbg
    from vllm_tfm.vllm_plugin.runtime.weaver_graphs import graph_key

    is_on, set_on = getattr(tbg, enabled), getattr(tbg, setter)
    monkeypatch.delenv(env, raising=False)
    assert is_on() is default_on
    monkeypatch.setenv(env, "0")
    assert not is_on()
    try:
        assert set_on(True) is True
        assert set_on(None) is False  # back to the environment's
        logits, hidden, verifier = torch.zeros(1, 3, 50), torch.zeros(1, 3, 8), torch.zeros(1, 8)
        table, weaver = torch.zeros(50, 8), torch.nn.Linear(1, 1)
        keys = {on: (set_on(on), graph_key(1, weaver, logits, hidden, verifier, table, table, 4, 5, 2, 2))[1]
                for on in (False, True)}
        assert [i for i, (a, b) in enumerate(zip(keys[False], keys[True])) if a != b] == [len(keys[True]) - position]
        with pytest.raises(ValueError, match=f"{setter} takes True, False or None, got 1"):
            set_on(1)
    finally:
        set_on(None)
    monkeypatch.setenv(env, "1")
    assert is_on()


def test_the_prompt_stream_is_handed_out_only_on_cuda_and_only_when_asked_for() -> None:
    from vllm_tfm.vllm_plugin.runtime import tree_builder_gpu as tbg

    try:
        tbg.set_prompt_overlap(True)
        assert tbg.prompt_stream(torch.device("cpu")) is None  # CPU builds run the prompt pass in line
        tbg.set_prompt_overlap(False)
        assert tbg.prompt_stream(torch.device("cuda", 0)) is None  # off: no stream, whatever the device
    finally:
        tbg.set_prompt_overlap(None)
