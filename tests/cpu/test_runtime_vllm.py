"""The runtime's patches against the installed vLLM 0.26 (CPU: wiring, delegation, GDN glue).

Imports vLLM (about half a minute on a small CPU machine). What needs a GPU (Triton attention,
the engine itself) is covered by tests/gpu/test_vllm_tfm_e2e.py."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm

from _sampling_fakes import sampling_metadata  # noqa: E402
from _trees import path_of, random_tree_parents  # noqa: E402
from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention  # noqa: E402
from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata  # noqa: E402
from vllm.v1.attention.backends.registry import AttentionBackendEnum  # noqa: E402
from vllm.v1.outputs import SamplerOutput  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

from vllm_tfm.vllm_plugin import runtime  # noqa: E402
from vllm_tfm.vllm_plugin.runtime import gdn as gdn_mod  # noqa: E402
from vllm_tfm.vllm_plugin.runtime.attention import TFMTritonAttentionBackend, TFMTritonAttentionImpl  # noqa: E402
from vllm_tfm.vllm_plugin.patching import original  # noqa: E402
from vllm_tfm.vllm_plugin.runtime.graph_dispatch import GRAPH_HOOKS  # noqa: E402
from vllm_tfm.vllm_plugin.runtime.hooks import RUNNER_HOOKS, check_engine_config  # noqa: E402
from vllm_tfm.vllm_plugin.runtime.inputs import build_step_tree  # noqa: E402
from vllm_tfm.vllm_plugin.runtime.sampler import TFMTreeSampler  # noqa: E402
from vllm_tfm.vllm_plugin.runtime.state import STATE, ProposalStore  # noqa: E402
from vllm_tfm.verify.gdn import gdn_chain_recurrence, gdn_gates  # noqa: E402

F64 = torch.float64


@pytest.fixture(autouse=True)
def clean_state():
    STATE.step = None
    yield
    STATE.step = None


def test_install_patches_once():
    runtime.install()
    runtime.install()
    assert runtime.is_installed()
    assert set(RUNNER_HOOKS) == {"__init__", "_prepare_inputs", "_update_states_after_model_execute",
                                 "propose_draft_token_ids", "sample_tokens", "profile_run", "_bookkeeping_sync",
                                 "take_draft_token_ids", "_prepare_input_ids", "_preprocess", "_update_states",
                                 "get_kv_cache_spec", "initialize_kv_cache"}
    assert set(GRAPH_HOOKS) == {"_determine_batch_execution_and_padding", "_warmup_and_capture", "_dummy_run"}
    for name in (*RUNNER_HOOKS, *GRAPH_HOOKS):  # wrapped exactly once, the original kept in the plugin's registry
        assert GPUModelRunner.__dict__[name].__wrapped__ is original(GPUModelRunner, name)
        assert original(GPUModelRunner, name).__module__ == "vllm.v1.worker.gpu_model_runner"  # vLLM's own
    assert QwenGatedDeltaNetAttention.__dict__["_forward_core"] is gdn_mod.tree_forward_core
    assert gdn_mod._ORIGINAL["_forward_core"] is original(QwenGatedDeltaNetAttention, "_forward_core")
    backend = AttentionBackendEnum.TRITON_ATTN.get_class()
    assert backend is TFMTritonAttentionBackend and backend.get_name() == "TRITON_ATTN"
    assert backend.get_impl_cls() is TFMTritonAttentionImpl


def test_profile_run_warms_up_the_weaver_graphs_of_a_tfm_runner_after_vllms_own():
    from vllm_tfm.vllm_plugin.runtime.hooks import _wrap_profile_run

    calls = []
    drafter = SimpleNamespace(warm_up_weaver_graphs=lambda n: calls.append(("weaver graphs", n)))
    profile_run = _wrap_profile_run(lambda self: calls.append(("vllm",)))
    profile_run(SimpleNamespace(_tfm_enabled=True, drafter=drafter, max_num_reqs=40))
    assert calls == [("vllm",), ("weaver graphs", 40)]  # max_num_seqs: the largest batch the drafter builds
    calls.clear()
    profile_run(SimpleNamespace(drafter=drafter, max_num_reqs=40))  # another runner: vLLM's only
    assert calls == [("vllm",)]


def test_a_failed_start_up_capture_warns_and_leaves_capture_to_first_use(caplog):
    from vllm_tfm.vllm_plugin.runtime.hooks import _wrap_profile_run

    def fail(n):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    profile_run = _wrap_profile_run(lambda self: "profiled")
    caplog.set_level("WARNING", logger="vllm.tfm")
    runner = SimpleNamespace(_tfm_enabled=True, drafter=SimpleNamespace(warm_up_weaver_graphs=fail), max_num_reqs=8)
    assert profile_run(runner) == "profiled"  # vLLM's result, start-up goes on
    assert any("capturing the Weaver CUDA graphs at start-up failed (RuntimeError: CUDA error: operation not permitted"
               in r.getMessage() for r in caplog.records)


def test_proposer_warm_up_captures_the_graphs_serving_replays():
    """``TFMProposer.warm_up_weaver_graphs`` captures from one zero row of each drafter output, the
    DFlash logits from the drafter's own head; a build of the serving path (``_build`` with a real
    step's shapes) then replays them: no capture while serving."""
    from _graph_recorder import RecordingGraphs, Replayed

    from vllm_tfm.models.tfm_config import TfmConfig, WeaverConfig
    from vllm_tfm.vllm_plugin.runtime.proposer import TFMProposer
    from vllm_tfm.vllm_plugin.runtime.settings import settings_from_options

    h, h_target, vocab, budget = 16, 24, 300, 16
    head = torch.randn(vocab, h)
    p = object.__new__(TFMProposer)  # the attributes vLLM's DFlashProposer and TFMProposer.__init__ / load_model set
    p.model = SimpleNamespace(compute_logits=lambda x: x @ head.T)
    p.hidden_size, p.dtype, p.device = h, torch.float32, torch.device("cpu")
    p.vllm_config = SimpleNamespace(model_config=SimpleNamespace(get_hidden_size=lambda: h_target))
    tfm = TfmConfig(weaver=WeaverConfig(d_model=h, d_rank=8, n_layers=1, n_heads=2, d_mlp=8, max_depth=15))
    p.tfm_settings = settings_from_options(tfm, "/drafter", budget, {"block_size": 16})  # depth 15
    p.weaver, p._target_embed, p._target_lm_head = object(), torch.zeros(vocab, h), torch.zeros(vocab, h)
    p._weaver_graphs = graphs = RecordingGraphs()
    assert p.warm_up_weaver_graphs(40) == (64, 32, 16, 8, 4, 2, 1)
    for r in (1, 5, 33, 40):
        p._dflash_out = torch.randn(r * 15, h)  # what the DFlash forward left, [R * D, H]
        logits = p.model.compute_logits(p._dflash_out).view(r, 15, -1)  # as propose reshapes the marginals
        p._verifier_hidden = lambda num_req, _rejected: torch.randn(num_req, h_target)
        with pytest.raises(Replayed):
            p._build("tfm", logits, torch.zeros(r, dtype=torch.int32), budget, 15, None)
    assert graphs.captured == [64, 32, 16, 8, 4, 2, 1] and graphs.late_captures == []
    p._weaver_graphs = None  # VLLM_TFM_WEAVER_GRAPHS=0
    assert p.warm_up_weaver_graphs(40) == ()
    p._weaver_graphs, p.weaver = RecordingGraphs(), None  # proposal chain / ddtree: no Weaver
    assert p.warm_up_weaver_graphs(40) == () and p._weaver_graphs.captured == []


def engine_config(**over):
    base = dict(
        compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name="NONE")),
        model_config=SimpleNamespace(is_hybrid=True, uses_xdrope_dim=0),
        cache_config=SimpleNamespace(mamba_cache_mode="none"),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, decode_context_parallel_size=1),
    )
    base.update(over)
    return SimpleNamespace(**base)


def test_engine_config_refusals():
    check_engine_config(engine_config())
    with pytest.raises(ValueError, match=r"does not support cudagraph_mode=FULL \(a full graph replays"):
        check_engine_config(engine_config(compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name="FULL"))))
    with pytest.raises(ValueError, match="mamba_cache_mode 'none'"):
        check_engine_config(engine_config(cache_config=SimpleNamespace(mamba_cache_mode="align")))
    with pytest.raises(ValueError, match="pipeline parallelism"):
        check_engine_config(engine_config(parallel_config=SimpleNamespace(pipeline_parallel_size=2, decode_context_parallel_size=1)))


# ---------------------------------------------------------------- tree attention dispatch
def fake_attention_impl(**over):
    impl = object.__new__(TFMTritonAttentionImpl)  # only the attributes the tree path reads
    attrs = {"kv_cache_dtype": "auto", "_is_per_token_head_quant": False, "sliding_window": (-1, -1),
             "logits_soft_cap": 0, "alibi_slopes": None, "sinks": None, "chunk_lookback": -1, "head_size": 16,
             "scale": 0.25}
    attrs.update(over)
    impl.__dict__.update(attrs)
    return impl


def tree_attention_call(monkeypatch, impl, reason=None, enabled=True, kernel=None, vllm_forward=None, loop=None,
                        layer_name="model.layers.3.self_attn.attn", all_trees=False, num_actual_tokens=None,
                        attn_max_seq_len=None):
    """Run TFMTritonAttentionImpl.forward on a tree step (vLLM's own forward stubbed); return the
    kernel calls and the per-request fallback calls it made."""
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    from vllm_tfm.vllm_plugin.runtime import attention as attn_mod
    from vllm_tfm.vllm_plugin.runtime import kernels_or_reference as kor

    store = ProposalStore()
    store.put(["a", "b"], torch.tensor([[5, 6, 7], [1, 2, 3]]), torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]]))
    if all_trees:  # two tree requests and nothing else: the plan's rows are the batch's
        store.put(["c"], torch.tensor([[8, 9, 4]]), torch.tensor([[-1, 0, 0, 0]]))
        STATE.step = build_step_tree(["a", "c"], np.array([4, 4]), {"a": [5, 6, 7], "c": [8, 9, 4]}, store,
                                     allow_trees=True)
    else:  # a prefill, a tree request, a chain request
        STATE.step = build_step_tree(["p", "a", "b"], np.array([2, 4, 4]), {"a": [5, 6, 7], "b": [1, 2, 3]}, store,
                                     allow_trees=True)
    monkeypatch.setattr(STATE, "target_attn_layers", frozenset({"model.layers.3.self_attn.attn"}))
    monkeypatch.setattr(TritonAttentionImpl, "forward", vllm_forward or (lambda self, layer, q, k, v, kv, md, out, *a: out))
    kernel_calls, loop_calls = [], []
    monkeypatch.setattr(attn_mod, "tree_attention_unsupported", lambda *a: reason)
    monkeypatch.setattr(attn_mod, "tree_attention_planned", kernel or (lambda *a, **kw: kernel_calls.append((*a, kw))))
    monkeypatch.setattr(attn_mod, "masked_tree_attention", loop or (lambda *a: loop_calls.append(a)))
    monkeypatch.setitem(kor._STATE, "enabled", enabled)
    layer = SimpleNamespace(layer_name=layer_name)
    query, output = torch.randn(10, 4, 16), torch.zeros(10, 4, 16)
    kv_cache = torch.randn(6, 2, 16, 32)  # vLLM's logical [blocks, Hkv, block, 2D]
    md = SimpleNamespace(block_table=torch.zeros(3, 4, dtype=torch.int32), seq_lens=torch.tensor([9, 20, 30]),
                         max_seq_len=30)
    if num_actual_tokens is not None:
        md.num_actual_tokens = num_actual_tokens
    if attn_max_seq_len is not None:  # as a full tree graph's capture sets it (full_graphs.py)
        STATE.step.attn_max_seq_len = attn_max_seq_len
    impl.forward(layer, query, None, None, kv_cache, md, output)
    return kernel_calls, loop_calls, (query, kv_cache, md, output)


def test_a_drafter_layer_on_a_tree_step_never_builds_the_steps_attention_plan(monkeypatch):
    """The DFlash drafter's attention layers run after the target's forward of a tree step. A tree step's attention
    plan is built on its first read (``defer_attn_plan``; host work, uploads from unpinned memory), and a full-graph
    step's forward never reads it (its graph has the fixed-layout tables): the drafter's first attention layer read
    it and built it for nothing, and that broke the capture of the drafter's full graphs (bench/NOTES.md section
    69). vLLM's forward runs for a drafter layer without the plan being touched."""
    from vllm_tfm.vllm_plugin.runtime import state as state_mod

    built: list[int] = []
    real = state_mod.StepTree.attn_plan

    def counting(self):
        built.append(1)
        return real.fget(self)

    monkeypatch.setattr(state_mod.StepTree, "attn_plan", property(counting, real.fset))
    vllm_calls: list[str] = []

    def vllm_forward(self, layer, q, k, v, kv, md, out, *a):
        vllm_calls.append(layer.layer_name)
        return out

    kernel, loop, _ = tree_attention_call(monkeypatch, fake_attention_impl(), vllm_forward=vllm_forward,
                                          layer_name="drafter.layers.0.self_attn.attn")
    assert built == [] and vllm_calls == ["drafter.layers.0.self_attn.attn"] and kernel == [] and loop == []
    tree_attention_call(monkeypatch, fake_attention_impl(), vllm_forward=vllm_forward)  # a target layer reads it
    assert built


@pytest.mark.parametrize("choice, kernels, loops", [(None, 1, 0), ("triton", 0, 1)])
def test_tree_attention_default_kernel_and_chosen_triton_path_run_without_a_warning(monkeypatch, choice, kernels, loops):
    # unset: one kernel call for all trees (the default); "triton": one call per tree request
    import warnings

    if choice is None:
        monkeypatch.delenv("VLLM_TFM_TREE_ATTENTION", raising=False)
    else:
        monkeypatch.setenv("VLLM_TFM_TREE_ATTENTION", choice)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernel_calls, loop_calls, _ = tree_attention_call(monkeypatch, fake_attention_impl())
    assert (len(kernel_calls), len(loop_calls)) == (kernels, loops)


def test_tree_attention_runs_one_kernel_call_for_every_tree(monkeypatch):
    monkeypatch.setenv("VLLM_TFM_TREE_ATTENTION", "kernel")
    impl = fake_attention_impl()
    kernel_calls, loop_calls, (query, kv_cache, md, output) = tree_attention_call(monkeypatch, impl)
    assert loop_calls == [] and len(kernel_calls) == 1
    plan, q, key_cache, value_cache, bt, seq_lens, scale, out, max_len, kw = kernel_calls[0]
    assert plan is STATE.step.attn_plan and plan.tree_req.tolist() == [1] and plan.tree_start.tolist() == [2]
    assert q is query and out is output and bt is md.block_table and seq_lens is md.seq_lens
    assert scale == 0.25 and max_len == 30 and kw == {"seq_len_bound": False}  # the step's own longest context
    # the caches are the TRITON_ATTN split: [blocks, block, Hkv, D] views of K and V
    assert key_cache.shape == (6, 16, 2, 16) and torch.equal(key_cache[1, 3, 1], kv_cache[1, 1, 3, :16])
    assert torch.equal(value_cache[4, 5, 0], kv_cache[4, 0, 5, 16:])


def test_tree_attention_in_a_graph_capture_sizes_its_splits_by_the_engine_bound(monkeypatch):
    # a full tree graph is captured with the engine's max_model_len as the context bound and replays at every
    # context: the kernel is told so (seq_len_bound), which keeps its key splits within one merge chunk
    monkeypatch.setenv("VLLM_TFM_TREE_ATTENTION", "kernel")
    kernel_calls, loop_calls, _ = tree_attention_call(monkeypatch, fake_attention_impl(), attn_max_seq_len=1 << 18)
    assert loop_calls == [] and len(kernel_calls) == 1
    *_, max_len, kw = kernel_calls[0]
    assert max_len == 1 << 18 and kw == {"seq_len_bound": True}


def test_tree_attention_skips_vllms_batched_forward_only_when_every_row_is_a_tree_row(monkeypatch):
    monkeypatch.setenv("VLLM_TFM_TREE_ATTENTION", "kernel")
    from vllm_tfm.vllm_plugin.runtime.metrics import Metrics

    monkeypatch.setattr(STATE, "metrics", Metrics(max_depth=3))
    vllm_calls = []

    def vllm_forward(self, layer, q, k, v, kv, md, out, *a):
        vllm_calls.append(md)
        return out

    # every row a tree row (8 rows of 2 trees): the kernel alone
    kernel_calls, loop_calls, _ = tree_attention_call(monkeypatch, fake_attention_impl(), vllm_forward=vllm_forward,
                                                      all_trees=True, num_actual_tokens=8)
    plan = STATE.step.attn_plan
    assert plan.num_rows == 8 and plan.tree_req.tolist() == [0, 1]
    assert vllm_calls == [] and len(kernel_calls) == 1 and loop_calls == []
    assert STATE.metrics.hooks["attention.batched_skipped"] == 1
    # the same batch with padding rows counted differently, or a batch with a prefill and a chain: vLLM's forward too
    for all_trees, n in ((True, 9), (False, 10), (False, None)):
        vllm_calls.clear()
        kernel_calls, loop_calls, _ = tree_attention_call(monkeypatch, fake_attention_impl(), vllm_forward=vllm_forward,
                                                          all_trees=all_trees, num_actual_tokens=n)
        assert len(vllm_calls) == 1 and len(kernel_calls) == 1 and loop_calls == []
    assert STATE.metrics.hooks["attention.batched_skipped"] == 1
    # every row a tree row but the kernel cannot run: vLLM's forward, then the per-request path
    import warnings

    vllm_calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kernel_calls, loop_calls, _ = tree_attention_call(monkeypatch, fake_attention_impl(), reason="no NVRTC here",
                                                          vllm_forward=vllm_forward, all_trees=True,
                                                          num_actual_tokens=8)
    assert len(vllm_calls) == 1 and kernel_calls == [] and len(loop_calls) == 1


def test_tree_attention_falls_back_to_one_call_per_tree_and_says_why(monkeypatch):
    import warnings

    from vllm_tfm.kernels import loader
    from vllm_tfm.vllm_plugin.runtime import attention as attn_mod

    attn_mod._said.clear()
    monkeypatch.setenv("VLLM_TFM_TREE_ATTENTION", "kernel")
    impl = fake_attention_impl(sliding_window=(127, 0))
    with pytest.warns(RuntimeWarning, match=r"one Triton call per tree request .*: sliding window \(127, 0\)"):
        kernel_calls, loop_calls, _ = tree_attention_call(monkeypatch, impl)
    assert kernel_calls == [] and len(loop_calls) == 1
    (t,) = loop_calls[0][-1]  # the per-request masks, built on first use from the plan
    assert (t.req_index, t.start, t.n) == (1, 2, 4) and t.bias.shape[1] == 4
    with warnings.catch_warnings():  # the reason is said once
        warnings.simplefilter("error")
        tree_attention_call(monkeypatch, impl)
    impl = fake_attention_impl()
    with pytest.warns(RuntimeWarning, match="no NVRTC here"):
        kernel_calls, loop_calls, _ = tree_attention_call(monkeypatch, impl, reason="no NVRTC here")
    assert kernel_calls == [] and len(loop_calls) == 1
    kernel_calls, loop_calls, _ = tree_attention_call(monkeypatch, impl, enabled=False)  # set_kernels_enabled(False)
    assert kernel_calls == [] and len(loop_calls) == 1
    monkeypatch.setenv("VLLM_TFM_TREE_ATTENTION", "triton")  # the A/B switch (read once per layer): chosen, not warned
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernel_calls, loop_calls, _ = tree_attention_call(monkeypatch, fake_attention_impl())
    assert kernel_calls == [] and len(loop_calls) == 1
    monkeypatch.setenv("VLLM_TFM_TREE_ATTENTION", "fast")
    with pytest.raises(ValueError, match="VLLM_TFM_TREE_ATTENTION must be 'kernel' or 'triton', got 'fast'"):
        tree_attention_call(monkeypatch, fake_attention_impl())
    monkeypatch.setenv("VLLM_TFM_TREE_ATTENTION", "kernel")
    # a kernel that fails to compile: this step and every later one take the per-request path
    attempts = []

    def broken(*a, **kw):
        attempts.append(a)
        raise loader.KernelCompileError("tree_attention.cu", ["-DTA_D=64"], "error: no such intrinsic")

    impl = fake_attention_impl()
    with pytest.warns(RuntimeWarning, match="(?s)KernelCompileError.*no such intrinsic"):
        _, loop_calls, _ = tree_attention_call(monkeypatch, impl, kernel=broken)
    assert len(attempts) == 1 and len(loop_calls) == 1
    _, loop_calls, _ = tree_attention_call(monkeypatch, impl, kernel=broken)
    assert len(attempts) == 1 and len(loop_calls) == 1
    attn_mod._said.clear()


def test_tree_attention_is_timed_once_per_target_layer_call(monkeypatch):
    """VLLM_TFM_PROFILE: attention_layer holds vLLM's forward and the tree rows, attention_tree only
    the tree rows; a layer that is not the target's records nothing."""
    import time

    from vllm_tfm.vllm_plugin.runtime import attention as attn_mod
    from vllm_tfm.vllm_plugin.runtime.stage_timing import StageTimer

    timer = StageTimer(enabled=True, use_cuda=False)
    monkeypatch.setattr(attn_mod, "TIMER", timer)
    monkeypatch.setenv("VLLM_TFM_TREE_ATTENTION", "triton")  # the per-request path: its calls can sleep here
    vllm_calls, loop_calls = [], []

    def vllm_forward(self, layer, q, k, v, kv, md, out, *a):
        vllm_calls.append(layer.layer_name)
        time.sleep(0.02)
        return out

    def loop(*a):
        loop_calls.append(a)
        time.sleep(0.01)

    for step in range(2):
        timer.note_batch(2, 5)
        for _ in range(3):  # three target attention layers in this step
            tree_attention_call(monkeypatch, fake_attention_impl(), vllm_forward=vllm_forward, loop=loop)
    tree_attention_call(monkeypatch, fake_attention_impl(), vllm_forward=vllm_forward, loop=loop,
                        layer_name="drafter.layers.0.self_attn.attn")  # the drafter's layer: vLLM only, untimed
    assert len(vllm_calls) == 7 and len(loop_calls) == 6
    got = timer.collect()["stages"]
    layer, tree = got["attention_layer"], got["attention_tree"]
    assert layer["count"] == tree["count"] == 6 and layer["spans_per_step"] == tree["spans_per_step"] == 3.0
    assert tree["min_ms"] >= 10.0 and layer["min_ms"] >= 30.0  # the tree rows inside, vLLM's forward around them
    assert layer["total_ms"] - tree["total_ms"] >= 6 * 20.0


def test_tree_attention_untimed_when_profiling_is_off(monkeypatch):
    from vllm_tfm.vllm_plugin.runtime import attention as attn_mod
    from vllm_tfm.vllm_plugin.runtime.stage_timing import StageTimer

    def no_events(*a, **k):
        raise AssertionError("a CUDA event was created with profiling off")

    timer = StageTimer(enabled=False, use_cuda=True)
    monkeypatch.setattr(attn_mod, "TIMER", timer)
    monkeypatch.setattr(torch.cuda, "Event", no_events)
    for path in ("kernel", "triton"):
        monkeypatch.setenv("VLLM_TFM_TREE_ATTENTION", path)
        kernel_calls, loop_calls, _ = tree_attention_call(monkeypatch, fake_attention_impl())
        assert len(kernel_calls) + len(loop_calls) == 1 and timer.collect()["stages"] == {}


# ---------------------------------------------------------------- sampler
def fake_runner(num_req):
    batch = SimpleNamespace(temperature_cpu=np.zeros(num_req, dtype=np.float32),
                            top_k_cpu=np.full(num_req, 100), top_p_cpu=np.ones(num_req, dtype=np.float32))
    return SimpleNamespace(input_batch=batch)


class Recorder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = []

    def forward(self, *args):
        self.calls.append(args)
        return "native"


def test_sampler_delegates_without_a_tree_step():
    inner = Recorder()
    sampler = TFMTreeSampler(inner, fake_runner(1))
    assert sampler("md", None, "logits", "smd") == "native" and inner.calls == [("md", None, "logits", "smd")]


def test_sampler_verifies_trees_and_checks_the_metadata():
    store = ProposalStore()
    store.put(["r0", "r1"], torch.tensor([[5, 6, 7], [1, 2, 3]]), torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]]))
    spec = {"r0": [5, 6, 7], "r1": [1, 2, 3]}
    STATE.step = build_step_tree(["r0", "r1"], np.array([4, 4]), spec, store, allow_trees=True)
    logits = torch.zeros(8, 10)
    logits[0, 6] = logits[2, 4] = 1.0  # r0: root -> node 2 (token 6), then bonus 4
    logits[4, 9] = 1.0  # r1: root argmax 9 matches no child: bonus 9
    md = SimpleNamespace(num_draft_tokens=[3, 3], draft_token_ids=torch.tensor([5, 6, 7, 1, 2, 3]), max_spec_len=3)
    sampler = TFMTreeSampler(torch.nn.Identity(), fake_runner(2))
    out = sampler(md, None, logits, sampling_metadata())
    assert isinstance(out, SamplerOutput) and out.logprobs_tensors is None
    assert out.sampled_token_ids.dtype == torch.int32
    assert out.sampled_token_ids.tolist() == [[6, 4, -1, -1], [9, -1, -1, -1]]
    assert STATE.step.accept.accepted_nodes[0, 0].item() == 2
    with pytest.raises(RuntimeError, match="does not match the tree metadata"):
        sampler(SimpleNamespace(num_draft_tokens=[3, 2], draft_token_ids=None, max_spec_len=3), None, logits, None)
    # a batch that needs vLLM's own sampler (here an allowed-token mask) reaching a tree step: refused, not verified
    masked = sampling_metadata(allowed_token_ids_mask=torch.zeros(2, 10, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="a tree-verified step's batch needs vLLM's own sampler"):
        sampler(md, None, logits, masked)
    with pytest.raises(RuntimeError, match="a tree-verified step's batch needs vLLM's own sampler"):
        sampler(md, None, logits, sampling_metadata(max_num_logprobs=2))


@pytest.mark.parametrize("seed,deferred", [(0, False), (1, False), (2, True)])
def test_sampler_greedy_kernel_gives_the_torch_paths_result(seed, deferred, tmp_path_factory, monkeypatch):
    """An all-greedy tree step verified by the one-launch kernel (``kernels.greedy_accept``, emulated on the CPU)
    returns vLLM's sampled tokens and the accepted paths of the torch path, entry for entry, with a request
    without drafts in the batch; a batch with a sampled request keeps the torch path (no launch). ``deferred``:
    the step was built on placeholder drafts with its topology pending (deferred drafts, the default with
    asynchronous scheduling), which the sampler completes before it reads the trees' depths and sizes (on the
    GPU the first version read the pending arrays, -2 everywhere, and fell back)."""
    from vllm_tfm.vllm_plugin.runtime.state import PLACEHOLDER_DRAFT

    from _emulation import emulated, emulation_build_dir

    from vllm_tfm.kernels import greedy_accept as kga
    from vllm_tfm.vllm_plugin.runtime.metrics import Metrics
    from vllm_tfm.vllm_plugin.runtime.sampler import set_greedy_accept_kernel

    gen = torch.Generator().manual_seed(seed)
    store = ProposalStore()
    kinds = ["random", "chain", "star", "deep"]
    ids = [f"q{r}" for r in range(len(kinds))]
    toks = torch.randint(0, 6, (len(kinds), 7), generator=gen)  # few tokens: siblings repeat
    store.put(ids, toks, torch.stack([random_tree_parents(8, gen, k) for k in kinds]))
    spec = {rid: toks[r].tolist() for r, rid in enumerate(ids)}
    req_ids = ["pre", *ids]
    if deferred:
        placeholders = {rid: [PLACEHOLDER_DRAFT] * 7 for rid in ids}
        STATE.step = build_step_tree(req_ids, np.array([3, 8, 8, 8, 8]), placeholders, store, allow_trees=True,
                                     defer_topology=True)
        assert STATE.step.topology_pending
    else:
        STATE.step = build_step_tree(req_ids, np.array([3, 8, 8, 8, 8]), spec, store, allow_trees=True)
    logits = torch.randn(int(STATE.step.sample_cu[-1]), 6, generator=gen)
    md = SimpleNamespace(num_draft_tokens=[0, 7, 7, 7, 7], max_spec_len=7,
                         draft_token_ids=torch.tensor([t for rid in ids for t in spec[rid]], dtype=torch.int32))
    monkeypatch.setattr(kga, "unsupported_reason", lambda *a: None)  # CPU tensors run through the emulation
    STATE.metrics = Metrics(max_depth=7)
    try:
        sampler = TFMTreeSampler(torch.nn.Identity(), fake_runner(5))
        with emulated(emulation_build_dir(tmp_path_factory, "emu_sampler_greedy")) as launches:
            set_greedy_accept_kernel(True)
            got = sampler(md, None, logits, sampling_metadata())
            got_accept = STATE.step.accept
            set_greedy_accept_kernel(False)
            want = sampler(md, None, logits, sampling_metadata())
            want_accept = STATE.step.accept
            set_greedy_accept_kernel(True)
            hot = fake_runner(5)
            hot.input_batch.temperature_cpu[2] = 0.7  # one sampled request: the torch path
            TFMTreeSampler(torch.nn.Identity(), hot)(md, None, logits, sampling_metadata())
        assert [name for name, _, _ in launches] == ["tree_greedy_accept"]
        assert STATE.metrics.hooks["sampler.greedy_kernel"] == 1
    finally:
        set_greedy_accept_kernel(None)
        STATE.metrics = None
    assert got.sampled_token_ids.dtype == torch.int32 and torch.equal(got.sampled_token_ids, want.sampled_token_ids)
    for f in ("accepted_nodes", "num_accepted", "last_node", "bonus", "output_tokens"):
        assert torch.equal(getattr(got_accept, f), getattr(want_accept, f)), f
    assert int(got_accept.num_accepted.sum()) > 0  # some drafts accepted, so the paths were compared


# ---------------------------------------------------------------- GDN glue
H, K, HV, V, W, S = 1, 4, 2, 3, 4, 3
D = 2 * H * K + HV * V


def fake_gdn_layer(gen, num_slots):
    conv_sd = torch.randn(num_slots, W - 1 + S, D, generator=gen, dtype=F64)
    return SimpleNamespace(
        prefix="model.layers.0.linear_attn",
        kv_cache=(conv_sd, torch.randn(num_slots, HV, V, K, generator=gen, dtype=F64)),
        conv1d=SimpleNamespace(weight=0.5 * torch.randn(D, 1, W, generator=gen, dtype=F64), bias=None),
        activation="silu",
        A_log=torch.rand(HV, generator=gen, dtype=F64).log(),
        dt_bias=torch.randn(HV, generator=gen, dtype=F64),
        num_k_heads=H, num_v_heads=HV, head_k_dim=K, head_v_dim=V, tp_size=1,
    )


def gdn_metadata(**kw):
    base = dict(num_prefills=0, num_prefill_tokens=0, num_decodes=0, num_decode_tokens=0)
    base.update(kw)
    return GDNAttentionMetadata(**base)


def test_gdn_patch_runs_spec_rows_as_trees_and_prefills_through_vllm(monkeypatch):
    gen = torch.Generator().manual_seed(0)
    layer = fake_gdn_layer(gen, num_slots=10)
    parents = random_tree_parents(1 + S, gen, "random")
    store = ProposalStore()
    store.put(["t"], torch.tensor([[3, 4, 5]]), parents[None])
    # batch: a 2-token prefill ("p") then the tree request ("t"); vLLM's spec token index lists
    # spec rows after the others (stable argsort of the spec mask)
    STATE.step = build_step_tree(["p", "t"], np.array([2, 1 + S]), {"t": [3, 4, 5]}, store, allow_trees=True)
    assert STATE.step.tree_active
    slots = torch.tensor([[4, 7, 1, 8]], dtype=torch.int32)
    md = gdn_metadata(num_prefills=1, num_prefill_tokens=2, num_spec_decodes=1, num_spec_decode_tokens=1 + S,
                      num_actual_tokens=2 + 1 + S, spec_sequence_masks=torch.tensor([False, True]),
                      spec_token_indx=torch.arange(2, 6, dtype=torch.int32),
                      non_spec_token_indx=torch.arange(0, 2, dtype=torch.int32),
                      spec_state_indices_tensor=slots, num_accepted_tokens=torch.tensor([2], dtype=torch.int32),
                      spec_query_start_loc=torch.tensor([0, 1 + S], dtype=torch.int32))
    attn = {layer.prefix: md}
    monkeypatch.setattr("vllm.forward_context.get_forward_context", lambda: SimpleNamespace(attn_metadata=attn))
    seen = {}

    def original(self, mixed_qkv, b, a, core_attn_out):
        sub = attn[self.prefix]
        seen.update(sub=sub, rows=mixed_qkv.clone())
        core_attn_out[: sub.num_actual_tokens] = 7.0

    monkeypatch.setitem(gdn_mod._ORIGINAL, "_forward_core", original)
    t = 2 + 1 + S
    mixed = torch.randn(t, D, generator=gen, dtype=F64)
    a = torch.randn(t, HV, generator=gen, dtype=F64)
    b = torch.randn(t, HV, generator=gen, dtype=F64)
    out = torch.zeros(t, HV, V, dtype=F64)
    conv_view = layer.kv_cache[0].transpose(-1, -2)
    window = conv_view[4, :, 1 : W].T.clone()  # num_accepted 2 -> committed columns 1..W-1 of slot [n, 0]
    s0 = layer.kv_cache[1][7].clone()  # SSM slot [n, num_accepted - 1]
    gdn_mod.tree_forward_core(layer, mixed, b, a, out)
    # prefill rows: through vLLM's code on metadata without spec rows, then scattered back
    sub = seen["sub"]
    assert sub.num_actual_tokens == 2 and sub.spec_sequence_masks is None and sub.num_spec_decodes == 0
    assert torch.equal(seen["rows"], mixed[:2]) and attn[layer.prefix] is md  # metadata restored
    assert torch.all(out[:2] == 7.0)
    # spec rows: each node = the chain recurrence over its root..node path
    for i in range(1 + S):
        rows = [2 + j for j in path_of(parents, i)]
        seq = torch.cat([window, mixed[rows]]).T[None]
        y = torch.nn.functional.silu(torch.nn.functional.conv1d(seq, layer.conv1d.weight, None, groups=D)[0].T)
        q, k, v = torch.split(y, [H * K, H * K, HV * V], dim=-1)
        g, beta = gdn_gates(a[rows], b[rows], layer.A_log, layer.dt_bias)
        o, _ = gdn_chain_recurrence(q.reshape(-1, H, K), k.reshape(-1, H, K), v.reshape(-1, HV, V), g, beta, s0)
        torch.testing.assert_close(out[2 + i], o[-1], rtol=1e-10, atol=1e-10)
    stash = STATE.step.gdn[layer.prefix]
    assert stash.prev_accepted.tolist() == [2] and stash.width == W


def vllm026_forward_core(calls):
    """A stand-in for vLLM 0.26's ``_forward_core`` with its row handling (qwen_gdn_linear_attn.py:
    1180-1497), per-token output ``x[:, :HV] * a + b``: spec rows read q/k/v at their own tokens
    but their gates ``a``/``b`` at 0-based spec positions (the kernel's ``bos`` from the spec rows'
    ``cu_seqlens``), the other rows at their own tokens. Records every call's metadata."""

    def f(x, a, b):
        return (x[:, :HV] * a + b)[:, :, None].expand(-1, -1, V)

    def forward_core(self, mixed_qkv, b, a, core_attn_out):
        md = gdn_mod_md[0][self.prefix]
        calls.append(md)
        n = md.num_actual_tokens
        x, a, b = mixed_qkv[:n], a[:n], b[:n]
        if md.spec_sequence_masks is None or (md.num_prefills == 0 and md.num_decodes == 0):
            core_attn_out[:n] = f(x, a, b)
            return
        si, ni = md.spec_token_indx.long(), md.non_spec_token_indx.long()
        ts = si.shape[0]
        core_attn_out.index_copy_(0, si, f(x[si], a[:ts], b[:ts]))  # the gates of tokens 0..ts-1
        core_attn_out.index_copy_(0, ni, f(x[ni], a[ni], b[ni]))

    return forward_core


gdn_mod_md: list = [None]


@pytest.mark.parametrize("order", ["decode_first", "spec_first"])
def test_gdn_chain_step_keeps_spec_gates_with_their_rows(monkeypatch, order):
    """A chain step (no trees) mixing a spec row with a plain decode that vLLM reclassified as a
    prefill. vLLM 0.26 reads the spec row's gates at the wrong tokens when the plain decode comes
    first; the patch then runs spec rows and other rows as two calls (and leaves a batch whose spec
    rows lead to vLLM's single call)."""
    gen = torch.Generator().manual_seed(3)
    layer = fake_gdn_layer(gen, num_slots=10)
    rows = ["d", "s"] if order == "decode_first" else ["s", "d"]
    n_sched = np.array([1, 1 + S] if order == "decode_first" else [1 + S, 1])
    STATE.step = build_step_tree(rows, n_sched, {"s": [3, 4, 5]}, ProposalStore(), allow_trees=True)
    assert not STATE.step.tree_active and STATE.step.is_spec.tolist() == [r == "s" for r in rows]
    t = 2 + S
    spec_tok = torch.arange(1, t) if order == "decode_first" else torch.arange(0, 1 + S)
    plain_tok = torch.tensor([0]) if order == "decode_first" else torch.tensor([1 + S])
    md = gdn_metadata(num_prefills=1, num_prefill_tokens=1, num_spec_decodes=1, num_spec_decode_tokens=1 + S,
                      num_actual_tokens=t, spec_sequence_masks=torch.tensor([r == "s" for r in rows]),
                      spec_token_indx=spec_tok.to(torch.int32), non_spec_token_indx=plain_tok.to(torch.int32),
                      spec_state_indices_tensor=torch.tensor([[4, 7, 1, 8]], dtype=torch.int32),
                      num_accepted_tokens=torch.tensor([1], dtype=torch.int32),
                      spec_query_start_loc=torch.tensor([0, 1 + S], dtype=torch.int32))
    attn = {layer.prefix: md}
    gdn_mod_md[0] = attn
    monkeypatch.setattr("vllm.forward_context.get_forward_context", lambda: SimpleNamespace(attn_metadata=attn))
    calls: list = []
    monkeypatch.setitem(gdn_mod._ORIGINAL, "_forward_core", vllm026_forward_core(calls))
    x = torch.randn(t, D, generator=gen, dtype=F64)
    a = torch.randn(t, HV, generator=gen, dtype=F64)
    b = torch.randn(t, HV, generator=gen, dtype=F64)
    want = (x[:, :HV] * a + b)[:, :, None].expand(-1, -1, V)
    unpatched = torch.zeros(t, HV, V, dtype=F64)
    vllm026_forward_core([])(layer, x, b, a, unpatched)
    out = torch.zeros(t, HV, V, dtype=F64)
    gdn_mod.tree_forward_core(layer, x, b, a, out)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    assert attn[layer.prefix] is md  # metadata restored
    if order == "decode_first":
        assert not torch.equal(unpatched[spec_tok], want[spec_tok])  # vLLM's own call: other tokens' gates
        spec_call, other_call = calls
        assert spec_call.num_actual_tokens == 1 + S and spec_call.num_prefills == 0 and spec_call.num_decodes == 0
        assert spec_call.spec_token_indx is None and spec_call.non_spec_state_indices_tensor is None
        assert other_call.num_actual_tokens == 1 and other_call.spec_sequence_masks is None
    else:
        torch.testing.assert_close(unpatched, want, rtol=0, atol=0)  # spec rows lead: vLLM is right
        assert calls == [md]  # one call, vLLM's metadata untouched


def test_gdn_patch_is_vllms_code_outside_tfm_steps(monkeypatch):
    """No tfm step (another method, a dummy run): vLLM's _forward_core as it is, even on a mixed batch."""
    gen = torch.Generator().manual_seed(4)
    layer = fake_gdn_layer(gen, num_slots=4)
    md = gdn_metadata(num_prefills=1, num_prefill_tokens=1, num_spec_decodes=1, num_spec_decode_tokens=1 + S,
                      num_actual_tokens=2 + S, spec_sequence_masks=torch.tensor([False, True]),
                      spec_token_indx=torch.arange(1, 2 + S, dtype=torch.int32),
                      non_spec_token_indx=torch.tensor([0], dtype=torch.int32))
    attn = {layer.prefix: md}
    gdn_mod_md[0] = attn
    monkeypatch.setattr("vllm.forward_context.get_forward_context", lambda: SimpleNamespace(attn_metadata=attn))
    calls: list = []
    monkeypatch.setitem(gdn_mod._ORIGINAL, "_forward_core", vllm026_forward_core(calls))
    x, a, b = torch.randn(2 + S, D, dtype=F64), torch.randn(2 + S, HV, dtype=F64), torch.randn(2 + S, HV, dtype=F64)
    gdn_mod.tree_forward_core(layer, x, b, a, torch.zeros(2 + S, HV, V, dtype=F64))
    assert calls == [md]


def test_spec_rows_lead():
    assert gdn_mod.spec_rows_lead(np.array([True, True, False]), 2)
    assert not gdn_mod.spec_rows_lead(np.array([False, True, True]), 2)
    assert not gdn_mod.spec_rows_lead(np.array([True, False, True]), 2)
    assert not gdn_mod.spec_rows_lead(np.array([True, True, False]), 1)  # disagrees with vLLM's count


@pytest.mark.parametrize("graph_mode", ["NONE", "PIECEWISE"])
def test_gdn_stash_outlives_a_cuda_graph_piece(graph_mode):
    """Under piecewise CUDA graphs the op's inputs are graph-pool memory that later pieces reuse:
    the pre-conv rows kept for the commit must be a copy there (a view is fine without graphs)."""
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import ForwardContext, override_forward_context

    runtime.install()  # the GDN patch keeps vLLM's _forward_core, which tree_forward_core falls back to (idempotent)
    gen = torch.Generator().manual_seed(1)
    layer = fake_gdn_layer(gen, num_slots=6)
    parents = random_tree_parents(1 + S, gen, "random")
    store = ProposalStore()
    store.put(["t"], torch.tensor([[3, 4, 5]]), parents[None])
    STATE.step = build_step_tree(["t"], np.array([1 + S]), {"t": [3, 4, 5]}, store, allow_trees=True)
    md = gdn_metadata(num_spec_decodes=1, num_spec_decode_tokens=1 + S, num_actual_tokens=1 + S,
                      spec_sequence_masks=torch.tensor([True]), spec_token_indx=torch.arange(0, 1 + S, dtype=torch.int32),
                      non_spec_token_indx=torch.zeros(0, dtype=torch.int32),
                      spec_state_indices_tensor=torch.tensor([[2, 5, 1, 3]], dtype=torch.int32),
                      num_accepted_tokens=torch.tensor([1], dtype=torch.int32),
                      spec_query_start_loc=torch.tensor([0, 1 + S], dtype=torch.int32))
    padded = 8  # the graph's padded size: rows past 1 + S are padding
    mixed = torch.randn(padded, D, generator=gen, dtype=F64)
    a, b = torch.randn(padded, HV, generator=gen, dtype=F64), torch.randn(padded, HV, generator=gen, dtype=F64)
    out = torch.zeros(padded, HV, V, dtype=F64)
    ctx = ForwardContext(no_compile_layers={}, attn_metadata={layer.prefix: md}, slot_mapping={},
                         cudagraph_runtime_mode=CUDAGraphMode[graph_mode])
    with override_forward_context(ctx):
        gdn_mod.tree_forward_core(layer, mixed, b, a, out)
    x = STATE.step.gdn[layer.prefix].x
    assert torch.equal(x, mixed[: 1 + S])
    assert (x.data_ptr() == mixed.data_ptr()) is (graph_mode == "NONE")
    mixed.fill_(float("nan"))  # what a later graph piece does to that memory at replay
    assert bool(torch.isnan(x).all()) is (graph_mode == "NONE")
    assert torch.all(out[1 + S :] == 0)  # padding rows untouched


def prefill_and_tree_step(gen):
    """A GDN layer, its metadata and inputs for a 2-token prefill followed by one tree request."""
    layer = fake_gdn_layer(gen, num_slots=10)
    parents = random_tree_parents(1 + S, gen, "random")
    store = ProposalStore()
    store.put(["t"], torch.tensor([[3, 4, 5]]), parents[None])
    STATE.step = build_step_tree(["p", "t"], np.array([2, 1 + S]), {"t": [3, 4, 5]}, store, allow_trees=True)
    md = gdn_metadata(num_prefills=1, num_prefill_tokens=2, num_spec_decodes=1, num_spec_decode_tokens=1 + S,
                      num_actual_tokens=2 + 1 + S, spec_sequence_masks=torch.tensor([False, True]),
                      spec_token_indx=torch.arange(2, 6, dtype=torch.int32),
                      non_spec_token_indx=torch.arange(0, 2, dtype=torch.int32),
                      spec_state_indices_tensor=torch.tensor([[4, 7, 1, 8]], dtype=torch.int32),
                      num_accepted_tokens=torch.tensor([2], dtype=torch.int32),
                      spec_query_start_loc=torch.tensor([0, 1 + S], dtype=torch.int32))
    t = 2 + 1 + S
    inputs = (torch.randn(t, D, generator=gen, dtype=F64), torch.randn(t, HV, generator=gen, dtype=F64),
              torch.randn(t, HV, generator=gen, dtype=F64))
    return layer, md, inputs


def test_gdn_tree_path_is_timed_once_per_layer_call_without_changing_outputs(monkeypatch):
    """VLLM_TFM_PROFILE: gdn_layer holds the whole op (vLLM's prefill rows too), gdn_tree our spec
    rows, gdn_tree_conv / gdn_tree_verify the two tree operations inside it; outputs as untimed."""
    import time

    from vllm_tfm.vllm_plugin.runtime.kernels_or_reference import tree_ops
    from vllm_tfm.vllm_plugin.runtime.stage_timing import StageTimer

    ops = tree_ops()

    def slow(fn):
        def run(*a, **k):
            time.sleep(0.01)
            return fn(*a, **k)
        return run

    slow_ops = SimpleNamespace(tree_causal_conv1d=slow(ops.tree_causal_conv1d), gdn_tree_verify=slow(ops.gdn_tree_verify))
    monkeypatch.setattr(gdn_mod, "tree_ops", lambda: slow_ops)

    def original(self, mixed_qkv, b, a, core_attn_out):  # vLLM's rows: the prefill
        time.sleep(0.02)
        core_attn_out[:2] = 7.0

    monkeypatch.setitem(gdn_mod._ORIGINAL, "_forward_core", original)
    gen = torch.Generator().manual_seed(3)
    layer, md, (mixed, a, b) = prefill_and_tree_step(gen)
    monkeypatch.setattr("vllm.forward_context.get_forward_context",
                        lambda: SimpleNamespace(attn_metadata={layer.prefix: md}))
    untimed = torch.zeros(mixed.shape[0], HV, V, dtype=F64)
    monkeypatch.setattr(gdn_mod, "TIMER", StageTimer(enabled=False, use_cuda=False))
    gdn_mod.tree_forward_core(layer, mixed, b, a, untimed)

    timer = StageTimer(enabled=True, use_cuda=False)
    monkeypatch.setattr(gdn_mod, "TIMER", timer)
    for step in range(2):
        timer.note_batch(2, 6)
        for _ in range(3):  # three GDN layers per step
            out = torch.zeros_like(untimed)
            gdn_mod.tree_forward_core(layer, mixed, b, a, out)
            assert torch.equal(out, untimed)
    got = timer.collect()["stages"]
    for name in ("gdn_layer", "gdn_tree", "gdn_tree_conv", "gdn_tree_verify"):
        assert got[name]["count"] == 6 and got[name]["spans_per_step"] == 3.0, name
        assert got[name]["per_step_sum"]["count"] == 2, name
    assert got["gdn_tree_conv"]["min_ms"] >= 10.0 and got["gdn_tree_verify"]["min_ms"] >= 10.0
    assert got["gdn_tree"]["total_ms"] >= got["gdn_tree_conv"]["total_ms"] + got["gdn_tree_verify"]["total_ms"]
    assert got["gdn_layer"]["total_ms"] - got["gdn_tree"]["total_ms"] >= 6 * 20.0  # vLLM's rows: outside gdn_tree
    assert "attention_tree" not in got


def test_gdn_untimed_outside_tree_steps_and_when_profiling_is_off(monkeypatch):
    from vllm_tfm.vllm_plugin.runtime.stage_timing import StageTimer

    def no_events(*a, **k):
        raise AssertionError("a CUDA event was created with profiling off")

    monkeypatch.setitem(gdn_mod._ORIGINAL, "_forward_core", lambda self, **kw: None)
    on = StageTimer(enabled=True, use_cuda=False)
    monkeypatch.setattr(gdn_mod, "TIMER", on)
    gdn_mod.tree_forward_core(SimpleNamespace(prefix="x"), mixed_qkv=1, b=2, a=3, core_attn_out=4)  # no tree step
    assert on.collect()["stages"] == {}
    off = StageTimer(enabled=False, use_cuda=True)
    monkeypatch.setattr(gdn_mod, "TIMER", off)
    monkeypatch.setattr(torch.cuda, "Event", no_events)
    gen = torch.Generator().manual_seed(4)
    layer, md, (mixed, a, b) = prefill_and_tree_step(gen)
    monkeypatch.setattr("vllm.forward_context.get_forward_context",
                        lambda: SimpleNamespace(attn_metadata={layer.prefix: md}))
    gdn_mod.tree_forward_core(layer, mixed, b, a, torch.zeros(mixed.shape[0], HV, V, dtype=F64))
    assert layer.prefix in STATE.step.gdn and off.collect()["stages"] == {}


def test_gdn_patch_delegates_outside_tree_steps(monkeypatch):
    calls = []
    monkeypatch.setitem(gdn_mod._ORIGINAL, "_forward_core", lambda self, **kw: calls.append(kw))
    gdn_mod.tree_forward_core(SimpleNamespace(prefix="x"), mixed_qkv=1, b=2, a=3, core_attn_out=4)
    assert calls == [dict(mixed_qkv=1, b=2, a=3, core_attn_out=4)]


# ---------------------------------------------------------------- runner hooks on a fake runner
def test_prepare_inputs_hook_writes_depth_positions_and_the_commit_moves_kv():
    from vllm_tfm.vllm_plugin.runtime.hooks import _wrap_prepare_inputs, _wrap_update_states_after
    from vllm_tfm.vllm_plugin.runtime.metrics import Metrics
    from vllm_tfm.verify.accept_result import AcceptResult

    STATE.metrics = Metrics(max_depth=3)
    STATE.store = ProposalStore()
    STATE.store.put(["a", "b"], torch.tensor([[5, 6, 7], [1, 2, 3]]), torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, 2]]))
    md = SimpleNamespace(no_penalties=True, bad_words_token_ids={}, allowed_token_ids_mask=None, max_num_logprobs=None,
                         logitsprocs=SimpleNamespace(non_argmax_invariant=[], argmax_invariant=[]),
                         thinking_budget_state_holder=None)
    positions = torch.tensor([20, 21, 22, 23, 50, 51, 52, 53, 0, 0])
    runner = SimpleNamespace(_tfm_enabled=True, device="cpu", uses_mrope=False, positions=positions,
                             model_config=SimpleNamespace(is_hybrid=False),  # GDN offsets: test_accepted_offsets.py
                             input_batch=SimpleNamespace(num_reqs=2, req_ids=["a", "b"], sampling_metadata=md))
    so = SimpleNamespace(scheduled_spec_decode_tokens={"a": [5, 6, 7], "b": [1, 2, 3]})
    out = _wrap_prepare_inputs(lambda self, s, n: "vllm")(runner, so, np.array([4, 4]))
    step = STATE.step
    assert out == "vllm" and step.tree_active and step.is_tree.tolist() == [True, False]
    assert positions.tolist() == [20, 21, 21, 22, 50, 51, 52, 53, 0, 0]  # request a: depths 0, 1, 1, 2
    assert step.seq_positions.tolist() == [20, 21, 22, 23, 50, 51, 52, 53]

    # accept node 3 (path 1 -> 3) in a, nothing in b; then the commit moves a's K/V rows 1, 3 -> 1, 2
    step.accept = AcceptResult(accepted_nodes=torch.tensor([[1, 3], [-1, -1]]), num_accepted=torch.tensor([2, 0]),
                               last_node=torch.tensor([3, 0]), bonus=torch.tensor([9, 9]),
                               output_tokens=torch.tensor([[5, 6, 9], [9, -1, -1]]))
    kv = torch.arange(4 * 1 * 4 * 2, dtype=torch.float32).view(4, 1, 4, 2)  # 4 blocks of 4 slots
    slot_mapping = torch.tensor([8, 9, 10, 11, 0, 1, 2, 3])
    runner.compilation_config = SimpleNamespace(static_forward_context={"attn0": SimpleNamespace(kv_cache=kv)})
    runner.kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=["attn0", "drafter.attn"])])
    runner.input_batch.block_table = [SimpleNamespace(slot_mapping=SimpleNamespace(gpu=slot_mapping))]
    STATE.target_attn_layers = frozenset({"attn0"})
    before = kv.clone()
    calls = []
    _wrap_update_states_after(lambda self, o, s: calls.append(o))(runner, "sampled", so)
    assert calls == ["sampled"]
    assert torch.equal(kv[2, :, 1], before[2, :, 1]) and torch.equal(kv[2, :, 2], before[2, :, 3])  # slot 10 <- 11
    kv[2, :, 2] = before[2, :, 2]
    assert torch.equal(kv, before)  # nothing else moved
    assert STATE.metrics.snapshot()["hooks"]["commit"] == 1
