"""GPU: CUDA-graph replays of the Weaver tree build equal the eager build.

Run on the GPU host: ``python3 -m pytest tests/gpu/test_weaver_graphs_gpu.py -q``. A replay of a
bucket runs the eager build's kernels at R = bucket, so its trees must equal, exactly, the eager
build of the padded batch the graph read (the static inputs after the call); batches that need
growth rounds past the fixed ones (short frontiers) finish eagerly after the replay. A host sync
inside the captured part would make the capture itself fail. After the start-up warm-up, serving
captures nothing and torch's reserved memory stays where the warm-up left it.
"""

from __future__ import annotations

import pytest
import torch

from vllm_tfm.models import Weaver, WeaverConfig
from vllm_tfm.vllm_plugin.runtime.tree_builder_gpu import weaver_trees
from vllm_tfm.vllm_plugin.runtime.metrics import Metrics
from vllm_tfm.vllm_plugin.runtime.state import STATE
from vllm_tfm.vllm_plugin.runtime.weaver_graphs import LAZY_TAIL_ENV, WeaverGraphs, _build

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
H, VOCAB, DEPTH = 256, 4096, 15


def weaver_and_tables(dtype: torch.dtype):
    """The zoo drafter's Weaver shape, random weights with some spread, random embed / lm_head."""
    torch.manual_seed(0)
    cfg = WeaverConfig(d_model=H, d_rank=128, n_layers=2, n_heads=4, d_mlp=384, max_depth=DEPTH)
    w = Weaver(cfg)
    with torch.no_grad():
        for p in w.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    w = w.to(DEV, dtype).eval()
    embed = torch.randn(VOCAB, H, device=DEV).to(dtype)
    head = (torch.randn(VOCAB, H, device=DEV) * 0.05).to(dtype)
    return w, embed, head


def drafter_outputs(r: int, head: torch.Tensor, dtype: torch.dtype, seed: int):
    g = torch.Generator(device=DEV).manual_seed(seed)
    hidden = torch.randn(r, DEPTH, H, generator=g, device=DEV).to(dtype)
    logits = (hidden.float() @ head.float().T) * 3
    verifier = torch.randn(r, H, generator=g, device=DEV).to(dtype)
    roots = torch.randint(0, VOCAB, (r,), generator=g, device=DEV, dtype=torch.int32)  # vLLM's dtype
    return logits, hidden, verifier, roots


def static_inputs(graphs: WeaverGraphs, bucket: int):
    (cap,) = [c for c in graphs._graphs.values() if c.inputs.bucket == bucket]
    return cap.inputs


def run_steps(dtype, batches, buckets, budget, top_k, width, cpn, warm_up_to=None):
    w, embed, head = weaver_and_tables(dtype)
    graphs = WeaverGraphs(buckets)
    if warm_up_to is not None:  # as the engine does at start-up: one zero row expanded to each bucket
        zero = [torch.zeros_like(x[:1]) for x in drafter_outputs(1, head, dtype, seed=0)]
        graphs.warm_up(warm_up_to, lambda rows: tuple(x.expand(rows, *x.shape[1:]) for x in zero), w, embed, head,
                       budget, top_k, width, cpn, DEV)
    with torch.inference_mode():
        for step, r in enumerate(batches):
            logits, hidden, verifier, roots = drafter_outputs(r, head, dtype, seed=step)
            tok, par = graphs.weaver_trees(w, logits, hidden, verifier, roots, embed, head, budget, top_k, width, cpn)
            bucket = graphs.bucket(logits, embed, head)
            x = static_inputs(graphs, bucket)
            ref_tok, ref_par = weaver_trees(w, x.logits, x.hidden, x.verifier, x.roots, embed, head, budget, top_k, width, cpn)
            assert tok.shape == (r, budget) and par.shape == (r, 1 + budget)
            assert torch.equal(tok, ref_tok[:r]), f"step {step}: tokens"
            assert torch.equal(par, ref_par[:r]), f"step {step}: parents"
            if r == bucket:  # nothing padded: the eager build of the batch itself
                e_tok, e_par = weaver_trees(w, logits, hidden, verifier, roots, embed, head, budget, top_k, width, cpn)
                assert torch.equal(tok, e_tok) and torch.equal(par, e_par), f"step {step}: unpadded"
            assert int((par[:, 1:] >= 0).all()) == 1
    return graphs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("budget", [16, 64])
def test_graph_replays_equal_the_eager_build_of_the_padded_batch(dtype, budget):
    batches = [3, 8, 5, 8, 1, 4]  # buckets 4, 8, 8, 8, 4, 4: two captures, six replays
    graphs = run_steps(dtype, batches, (4, 8), budget, top_k=512, width=-(-budget // 16), cpn=8)
    assert len(graphs._graphs) == 2 and graphs.replays == len(batches) and graphs.eager_builds == 0


def test_short_frontiers_finish_eagerly_after_the_replay():
    # 2 children per node and 4 nodes per round: the first rounds place fewer than 4 nodes, so the
    # fixed ceil(B / w) rounds do not finish the trees; later replays still start from scratch
    graphs = run_steps(torch.float32, [4, 3, 4], (4,), budget=24, top_k=16, width=4, cpn=2)
    assert graphs.tail_rounds > 0 and graphs.replays == 3


def test_batches_past_the_largest_bucket_build_eagerly():
    w, embed, head = weaver_and_tables(torch.float32)
    graphs = WeaverGraphs((2,))
    logits, hidden, verifier, roots = drafter_outputs(3, head, torch.float32, seed=9)
    with torch.inference_mode():
        tok, par = graphs.weaver_trees(w, logits, hidden, verifier, roots, embed, head, 16, 64, 1, 8)
        ref = weaver_trees(w, logits, hidden, verifier, roots, embed, head, 16, 64, 1, 8)
    assert torch.equal(tok, ref[0]) and torch.equal(par, ref[1])
    assert (graphs.eager_builds, graphs.replays) == (1, 0)


def test_after_the_warm_up_serving_captures_nothing_and_reserves_no_memory():
    batches = [3, 8, 5, 1, 2, 7, 4, 6]  # every bucket of (1, 2, 4, 8)
    graphs = run_steps(torch.float32, batches, (1, 2, 4, 8, 16), 16, 512, 1, 8, warm_up_to=6)
    assert graphs.warmed_up == (8, 4, 2, 1) and graphs.captured == [8, 4, 2, 1] and graphs.late_captures == []
    assert len(graphs._inputs) == 1 and graphs.replays == len(batches)  # one set of input buffers, 8 rows
    # serving again (no eager reference builds now): the allocator reserves nothing more
    w, embed, head = weaver_and_tables(torch.float32)
    graphs = WeaverGraphs((1, 2, 4, 8, 16))
    zero = [torch.zeros_like(x[:1]) for x in drafter_outputs(1, head, torch.float32, seed=0)]
    graphs.warm_up(6, lambda rows: tuple(x.expand(rows, *x.shape[1:]) for x in zero), w, embed, head, 16, 512, 1, 8, DEV)
    steps = [drafter_outputs(r, head, torch.float32, seed=i) for i, r in enumerate(batches)]
    with torch.inference_mode():
        for step in steps:  # every shape once
            graphs.weaver_trees(w, *step, embed, head, 16, 512, 1, 8)
        torch.cuda.synchronize()
        reserved = torch.cuda.memory_reserved()
        for _ in range(3):
            for step in steps:
                graphs.weaver_trees(w, *step, embed, head, 16, 512, 1, 8)
        torch.cuda.synchronize()
    assert torch.cuda.memory_reserved() == reserved
    assert graphs.captured == [8, 4, 2, 1] and graphs.late_captures == []


@pytest.mark.parametrize("cpn", [2, 8])
def test_a_deferred_tail_gives_the_trees_of_the_eager_build(cpn, monkeypatch):
    """``defer_tail``: the build returns after the replay and its check runs later (``DeferredTail.finish``,
    or the next build before it replays); the tensors it returned then hold the eager build's trees,
    also when tail rounds were needed (2 children per node, 4 nodes per round) and when the next
    replay came first."""
    monkeypatch.setattr(STATE, "metrics", Metrics(max_depth=24, device="cuda"))
    monkeypatch.setenv(LAZY_TAIL_ENV, "0")  # every check waits (the lazy check: the next test)
    w, embed, head = weaver_and_tables(torch.float32)
    graphs = WeaverGraphs((4,))
    budget, top_k, width = 24, 16, 4
    outs = []
    with torch.inference_mode():
        for step, r in enumerate([4, 3, 4]):
            logits, hidden, verifier, roots = drafter_outputs(r, head, torch.float32, seed=step)
            tok, par = graphs.weaver_trees(w, logits, hidden, verifier, roots, embed, head, budget, top_k, width, cpn,
                                           defer_tail=True)
            tail = graphs.last_tail
            assert tail is not None and not tail.done and tail.tokens is tok and tail.parents is par
            x = static_inputs(graphs, 4)
            ref = weaver_trees(w, x.logits, x.hidden, x.verifier, x.roots, embed, head, budget, top_k, width, cpn)
            outs.append((tok, par, tail, ref))
        assert outs[0][2].done and outs[1][2].done and not outs[2][2].done  # finished by the next builds
        outs[2][2].finish()
    for step, (tok, par, _, (ref_tok, ref_par)) in enumerate(outs):
        r = tok.shape[0]
        assert torch.equal(tok, ref_tok[:r]) and torch.equal(par, ref_par[:r]), f"step {step}"
    assert (graphs.tail_rounds > 0) == (cpn == 2) and graphs.replays == 3
    assert any(o[2].changed for o in outs) == (cpn == 2)
    hooks = STATE.metrics.hooks  # the engine's counters of builds with tail rounds (bench/NOTES.md section 36)
    assert hooks["weaver.tail_builds"] == sum(o[2].changed for o in outs)
    assert hooks["weaver.tail_rounds"] == graphs.tail_rounds


@pytest.mark.parametrize("cpn", [2, 8])
def test_a_lazy_tail_hands_out_the_captured_rounds_trees_and_its_key_then_waits(cpn, monkeypatch):
    """The lazy check (default): ``finish`` does not wait; the trees are those of the captured rounds, equal
    to an eager run of the same rounds. With 2 children per node the first build needed a tail: the next
    build finds that out (``check_skipped_tails``), counts it, and its key waits from then on, so the later
    builds give the eager build's full trees. With 8 no build needs a tail and every tree is the eager one."""
    monkeypatch.setattr(STATE, "metrics", Metrics(max_depth=24, device="cuda"))
    monkeypatch.delenv(LAZY_TAIL_ENV, raising=False)
    w, embed, head = weaver_and_tables(torch.float32)
    graphs = WeaverGraphs((4,))
    budget, top_k, width = 24, 16, 4
    with torch.inference_mode():
        for step, r in enumerate([4, 3, 4]):
            logits, hidden, verifier, roots = drafter_outputs(r, head, torch.float32, seed=step)
            tok, par = graphs.weaver_trees(w, logits, hidden, verifier, roots, embed, head, budget, top_k, width, cpn,
                                           defer_tail=True)
            tail = graphs.last_tail
            lazy = tail.lazy
            assert lazy == (step == 0 or cpn == 8)
            tail.finish()
            x = static_inputs(graphs, 4)
            full = weaver_trees(w, x.logits, x.hidden, x.verifier, x.roots, embed, head, budget, top_k, width, cpn)
            _, _, fixed_tok, fixed_par = _build(w, x, embed, head, budget, top_k, width, cpn)  # the captured rounds only
            want = (fixed_tok, fixed_par) if lazy else full
            assert torch.equal(tok, want[0][:r]) and torch.equal(par, want[1][:r]), f"step {step}"
            if cpn == 8:
                assert torch.equal(fixed_tok, full[0]) and torch.equal(fixed_par, full[1])
            elif step == 0:
                assert not torch.equal(fixed_par, full[1])  # the tail would have changed the trees
        graphs.check_skipped_tails()
    assert graphs.skipped_tails == (1 if cpn == 2 else 0)
    assert STATE.metrics.hooks["weaver.tail_skipped"] == graphs.skipped_tails


@pytest.fixture
def overlap_switch():
    from vllm_tfm.vllm_plugin.runtime.tree_builder_gpu import set_prompt_overlap

    yield set_prompt_overlap
    set_prompt_overlap(None)


@pytest.fixture
def kernels_switch():
    from vllm_tfm.vllm_plugin.runtime.kernels_or_reference import set_kernels_enabled

    yield set_kernels_enabled
    set_kernels_enabled(True)


@pytest.mark.parametrize("kernels", [True, False])
@pytest.mark.parametrize("graphs_on", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_prompt_pass_on_its_own_stream_gives_the_same_trees(kernels, graphs_on, dtype, overlap_switch,
                                                                 kernels_switch):
    """VLLM_TFM_WEAVER_PROMPT_OVERLAP: the same kernels on the same inputs in another stream, so the same trees,
    exactly, eagerly and through graph replays (each setting captures its own graph: the key holds it), with our
    kernels and with the torch references (VLLM_TFM_KERNELS=0: torch.topk of a float32 copy of the logits, whose
    memory the caching allocator may hand out again while the top-K still reads it; the K/V buffers the prompt
    stream writes are therefore made before the top-K is queued, bench/NOTES.md section 62)."""
    kernels_switch(kernels)
    w, embed, head = weaver_and_tables(dtype)
    graphs = WeaverGraphs((1, 4, 8)) if graphs_on else None
    with torch.inference_mode():
        for step, r in enumerate((1, 3, 8, 1, 8)):
            inputs = drafter_outputs(r, head, dtype, seed=40 + step)
            out = {}
            for on in (False, True):
                overlap_switch(on)
                build = graphs.weaver_trees if graphs is not None else weaver_trees
                out[on] = build(w, *inputs, embed, head, 16, 512, 2, 8)
            assert torch.equal(out[True][0], out[False][0]), f"step {step}: tokens"
            assert torch.equal(out[True][1], out[False][1]), f"step {step}: parents"
    if graphs is not None:
        assert len(graphs._graphs) == 6 and graphs.replays == 10  # buckets 1, 4, 8 for each setting


def _scorer_inputs(r: int, dtype: torch.dtype):
    w, embed, head = weaver_and_tables(dtype)
    logits, hidden, verifier, roots = drafter_outputs(r, head, dtype, seed=7)
    cand_logits, cand_ids = logits.topk(64, dim=-1)
    return w, embed, head, hidden, verifier, roots.long(), cand_ids, cand_logits.to(dtype)


def _roots_call(scorer, roots: torch.Tensor) -> torch.Tensor:
    r = roots.shape[0]
    z = torch.zeros(r, 1, dtype=torch.long, device=DEV)
    return scorer(z, z - 1, roots[:, None], z, torch.ones(r, 1, dtype=torch.bool, device=DEV))


def test_the_prompt_stream_waits_for_its_inputs_and_the_first_call_for_the_prompt():
    """The two orderings the stream needs, each made to matter by a long sleep on the other stream:
    the prompt pass reads inputs written on the current stream after a sleep (it waits for the fork
    event), and the first call reads K/V the prompt stream writes after a sleep (it joins first).
    Without either wait, the K/V or the scores would come from zeros."""
    from vllm_tfm.models.weaver import BatchedWeaverTreeScorer

    w, embed, head, hidden, verifier, roots, cand_ids, cand_logits = _scorer_inputs(3, torch.float32)
    with torch.inference_mode():
        ref = BatchedWeaverTreeScorer(w, verifier, hidden, cand_ids, cand_logits, embed, head, max_nodes=17)
        want = _roots_call(ref, roots)
        side = torch.cuda.Stream(DEV)
        # 1. the inputs are written late on the current stream; the prompt stream must wait for them
        vh, dh = torch.zeros_like(verifier), torch.zeros_like(hidden)
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time before the inputs' copies
        vh.copy_(verifier)
        dh.copy_(hidden)
        kv = BatchedWeaverTreeScorer.prompt_buffers(w, vh, dh, 17)
        fork = torch.cuda.Event()
        fork.record()
        late_inputs = BatchedWeaverTreeScorer(w, vh, dh, cand_ids, cand_logits, embed, head, max_nodes=17,
                                              prompt_stream=side, prompt_after=fork, kv_cache=kv)
        got_inputs = _roots_call(late_inputs, roots)
        # 2. the prompt stream starts late; the first call must wait for its K/V
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)
        late_prompt = BatchedWeaverTreeScorer(w, verifier, hidden, cand_ids, cand_logits, embed, head, max_nodes=17,
                                              prompt_stream=side)
        got_prompt = _roots_call(late_prompt, roots)
        torch.cuda.synchronize()
    for scorer, got in ((late_inputs, got_inputs), (late_prompt, got_prompt)):
        assert torch.equal(got, want)
        for a, b in zip(scorer.kv_cache, ref.kv_cache):
            assert torch.equal(a, b)


def test_a_prompt_stream_after_an_earlier_event_needs_buffers_made_before_it():
    from vllm_tfm.models.weaver import BatchedWeaverTreeScorer

    w, embed, head, hidden, verifier, roots, cand_ids, cand_logits = _scorer_inputs(2, torch.float32)
    fork = torch.cuda.Event()
    fork.record()
    side = torch.cuda.Stream(DEV)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="a prompt stream that starts after an earlier event needs the K/V buffers"):
            BatchedWeaverTreeScorer(w, verifier, hidden, cand_ids, cand_logits, embed, head, max_nodes=17,
                                    prompt_stream=side, prompt_after=fork)
        wrong = BatchedWeaverTreeScorer.prompt_buffers(w, verifier, hidden, 9)  # sized for 9 node slots, not 17
        with pytest.raises(ValueError, match="kv_cache must be 2 buffers of"):
            BatchedWeaverTreeScorer(w, verifier, hidden, cand_ids, cand_logits, embed, head, max_nodes=17,
                                    prompt_stream=side, prompt_after=fork, kv_cache=wrong)
