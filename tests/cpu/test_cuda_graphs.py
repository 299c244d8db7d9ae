"""CUDA graphs for tfm engines (vllm_plugin/cuda_graphs.py, runtime/graph_dispatch.py), on CPU.

Config time: which cudagraph modes a tfm engine accepts or refuses (one-line errors), the default
mode and the capture sizes tfm sets, through vLLM's own ``EngineArgs.create_speculative_config``.
Worker time: the final-config check on vLLM's ``CompilationConfig`` (splitting ops as vLLM
resolves them). Dispatch: vLLM 0.26's real ``_determine_batch_execution_and_padding`` and
``CudagraphDispatcher`` behind the tfm wrapper: tree steps never get a full graph. The engine
itself (capture, replay, tokens) needs a GPU: tests/gpu/test_cuda_graphs_gpu.py.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from _vllm_plugin_env import vllm_cpu_session, write_drafter, write_qwen35_target

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("cuda_graphs")
    with vllm_cpu_session(root / "vllm-cache"):
        target = write_qwen35_target(root / "target")
        yield {"root": root, "target": target, "drafter": write_drafter(root / "drafter")}


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("VLLM_TFM_") or name in ("VLLM_USE_V2_MODEL_RUNNER", "VLLM_USE_BREAKABLE_CUDAGRAPH"):
            monkeypatch.delenv(name)


def engine_args(env: Any, b: int = 7, **kw: Any) -> Any:
    """EngineArgs after tfm's config-time decisions (create_speculative_config ran)."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "tfm", "model": str(env["drafter"]), "num_speculative_tokens": b}
    args = EngineArgs(model=str(env["target"]), skip_tokenizer_init=True, load_format="auto", speculative_config=spec, **kw)
    args.create_speculative_config(args.create_model_config(), ParallelConfig())
    return args


def refused(env: Any, match: str, **kw: Any) -> str:
    with pytest.raises(ValueError, match=match) as info:
        engine_args(env, **kw)
    assert "\n" not in str(info.value)
    return str(info.value)


def mode_name(args: Any) -> str | None:
    m = args.compilation_config.cudagraph_mode
    return None if m is None else m.name


# ------------------------------------------------------------------------------ capture sizes


def test_capture_sizes_cover_every_tree_step_shape() -> None:
    from vllm_tfm.vllm_plugin.cuda_graphs import tfm_capture_sizes

    # B = 64, 8 requests: a tree step of k requests has k * 65 tokens; decode steps without drafts k tokens
    assert tfm_capture_sizes(64, 8) == [1, 2, 4, 8, 65, 130, 195, 260, 325, 390, 455, 520]
    assert tfm_capture_sizes(15, 3) == [1, 2, 3, 16, 32, 48]
    assert tfm_capture_sizes(1, 1) == [1, 2]
    # max_num_seqs unknown (vLLM sets its default later) or large: tree steps of up to 1,024 tokens,
    # at least 16 and at most 64 requests
    expected = sorted({1, 2, 4, 8, 16, 32, 64} | {8 * k for k in range(1, 65)})
    assert tfm_capture_sizes(7, None) == tfm_capture_sizes(7, 256) == expected
    assert max(tfm_capture_sizes(16, 256)) == 60 * 17 and max(tfm_capture_sizes(16, 32)) == 32 * 17
    assert max(tfm_capture_sizes(32, None)) == 31 * 33 and max(tfm_capture_sizes(64, None)) == 16 * 65
    assert max(tfm_capture_sizes(1, None)) == 64 * 2  # 512 requests would fit 1,024 tokens: 64 sizes at most
    with pytest.raises(ValueError, match="tree budget must be an integer >= 1"):
        tfm_capture_sizes(0, 8)


def test_vllm_keeps_the_tree_step_sizes_under_full_and_piecewise() -> None:
    """FULL_AND_PIECEWISE rounds every size to a multiple of B + 1 (vLLM's spec-decode rule,
    config/compilation.py adjust_cudagraph_sizes_for_spec_decode): all k * (B + 1) survive."""
    from vllm.config import CompilationConfig

    from vllm_tfm.vllm_plugin.cuda_graphs import tfm_capture_sizes

    sizes = tfm_capture_sizes(64, 8)
    cc = CompilationConfig(cudagraph_capture_sizes=list(sizes), max_cudagraph_capture_size=max(sizes))
    cc.adjust_cudagraph_sizes_for_spec_decode(65, 1)
    assert cc.cudagraph_capture_sizes == [65 * k for k in range(1, 9)] and cc.max_cudagraph_capture_size == 520


# ------------------------------------------------------------------------------ config time


def test_default_is_full_and_piecewise_on_one_gpu_with_tfm_capture_sizes(env: Any) -> None:
    from vllm_tfm.vllm_plugin.cuda_graphs import tfm_capture_sizes

    args = engine_args(env, b=7)
    assert not args.enforce_eager and mode_name(args) == "FULL_AND_PIECEWISE"
    assert args.compilation_config.cudagraph_capture_sizes == tfm_capture_sizes(7, None, full=True)


def test_default_is_piecewise_with_tensor_or_data_parallelism(env: Any) -> None:
    from vllm_tfm.vllm_plugin.cuda_graphs import tfm_capture_sizes

    for kw in ({"tensor_parallel_size": 2}, {"data_parallel_size": 2}):
        args = engine_args(env, b=7, **kw)
        assert not args.enforce_eager and mode_name(args) == "PIECEWISE", kw
        assert args.compilation_config.cudagraph_capture_sizes == tfm_capture_sizes(7, None)


def test_a_none_default_would_run_eager(env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_tfm.vllm_plugin import cuda_graphs

    monkeypatch.setattr(cuda_graphs, "DEFAULT_MODE", None)
    args = engine_args(env, b=7)
    assert args.enforce_eager and mode_name(args) is None
    assert args.compilation_config.cudagraph_capture_sizes is None


def test_piecewise_opt_in_gets_tfm_capture_sizes(env: Any) -> None:
    from vllm_tfm.vllm_plugin.cuda_graphs import tfm_capture_sizes

    args = engine_args(env, b=7, compilation_config={"cudagraph_mode": "PIECEWISE"})
    assert not args.enforce_eager and mode_name(args) == "PIECEWISE"
    assert args.compilation_config.cudagraph_capture_sizes == tfm_capture_sizes(7, None)
    args = engine_args(env, b=9, max_num_seqs=4, compilation_config={"cudagraph_mode": "PIECEWISE"})
    assert args.compilation_config.cudagraph_capture_sizes == [1, 2, 4, 10, 20, 30, 40]


def test_eager_and_o0_are_left_alone(env: Any) -> None:
    args = engine_args(env, enforce_eager=True)
    assert mode_name(args) is None and args.compilation_config.cudagraph_capture_sizes is None
    args = engine_args(env, enforce_eager=True, compilation_config={"cudagraph_mode": "FULL"})  # eager wins
    assert mode_name(args) == "FULL" and args.enforce_eager
    args = engine_args(env, optimization_level=0)
    assert mode_name(args) is None and args.compilation_config.cudagraph_capture_sizes is None


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL_AND_PIECEWISE", "NONE"])
def test_accepted_modes(env: Any, mode: str) -> None:
    args = engine_args(env, compilation_config={"cudagraph_mode": mode})
    assert mode_name(args) == mode and not args.enforce_eager
    sizes = args.compilation_config.cudagraph_capture_sizes
    assert (sizes is None) is (mode == "NONE")


def test_refused_modes(env: Any) -> None:
    msg = refused(env, r"does not support cudagraph_mode=FULL \(a full graph replays the whole forward without tfm",
                  compilation_config={"cudagraph_mode": "FULL"})
    assert msg.endswith("use PIECEWISE or FULL_AND_PIECEWISE, or enforce_eager=True")
    refused(env, r"does not support cudagraph_mode=FULL_DECODE_ONLY \(it has no piecewise graphs",
            compilation_config={"cudagraph_mode": "FULL_DECODE_ONLY"})


def test_user_capture_sizes_are_kept(env: Any) -> None:
    pw = {"cudagraph_mode": "PIECEWISE"}
    args = engine_args(env, compilation_config={**pw, "cudagraph_capture_sizes": [1, 3, 24]})
    assert args.compilation_config.cudagraph_capture_sizes == [1, 3, 24] and mode_name(args) == "PIECEWISE"
    args = engine_args(env, max_cudagraph_capture_size=64, compilation_config=dict(pw))  # EngineArgs-level: vLLM's list
    assert args.compilation_config.cudagraph_capture_sizes is None
    args = engine_args(env, cudagraph_capture_sizes=[2, 4], compilation_config=dict(pw))
    assert args.compilation_config.cudagraph_capture_sizes is None and args.cudagraph_capture_sizes == [2, 4]


def test_splitting_ops_and_passes_that_capture_the_tree_code_are_refused(env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    pw = {"cudagraph_mode": "PIECEWISE"}
    refused(env, r"needs vllm::qwen_gdn_attention_core in compilation_config.splitting_ops",
            compilation_config={**pw, "splitting_ops": ["vllm::unified_attention_with_output"]})
    refused(env, r"needs vllm::unified_attention_with_output in compilation_config.splitting_ops",
            compilation_config={**pw, "splitting_ops": []})
    refused(env, r"pass_config.enable_sp=True without use_inductor_graph_partition",
            compilation_config={**pw, "pass_config": {"enable_sp": True}})
    refused(env, r"pass_config.fuse_attn_quant=True", compilation_config={**pw, "pass_config": {"fuse_attn_quant": True}})
    # the same settings without graphs are fine
    engine_args(env, compilation_config={"splitting_ops": [], "cudagraph_mode": "NONE"})
    refused(env, r"needs vllm::unified_attention_with_output in compilation_config.splitting_ops",
            compilation_config={"splitting_ops": []})  # unset mode: PIECEWISE by default, so refused too
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    refused(env, r"does not support VLLM_USE_BREAKABLE_CUDAGRAPH=1 with CUDA graphs", compilation_config=dict(pw))
    engine_args(env, enforce_eager=True)


def test_other_methods_keep_vllms_defaults(env: Any) -> None:
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(model=str(env["target"]), skip_tokenizer_init=True)
    assert args.create_speculative_config(args.create_model_config(), ParallelConfig()) is None
    assert args.compilation_config.cudagraph_mode is None and args.compilation_config.cudagraph_capture_sizes is None


# ------------------------------------------------------------------------------ worker time


def resolved(mode: str, splitting_ops: list[str] | None = None) -> Any:
    """A CompilationConfig as VllmConfig leaves it for a compiled engine (splitting ops resolved)."""
    from vllm.config import CompilationConfig, CUDAGraphMode
    from vllm.config.compilation import CompilationMode

    cc = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode[mode], splitting_ops=splitting_ops)
    cc.set_splitting_ops_for_v1("allgather_reducescatter")
    return cc


def vllm_config(cc: Any, hybrid: bool = True, dp: int = 1) -> Any:
    return SimpleNamespace(compilation_config=cc, model_config=SimpleNamespace(is_hybrid=hybrid),
                           parallel_config=SimpleNamespace(data_parallel_size=dp))


def test_final_config_check(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    from vllm_tfm.vllm_plugin.cuda_graphs import check_graph_config

    for mode in ("PIECEWISE", "FULL_AND_PIECEWISE"):  # vLLM's default splitting ops hold both tree ops
        assert check_graph_config(vllm_config(resolved(mode))) == mode
    with pytest.raises(ValueError, match="does not support cudagraph_mode=FULL_DECODE_ONLY"):
        check_graph_config(vllm_config(resolved("FULL_DECODE_ONLY")))
    only_attention = resolved("PIECEWISE", ["vllm::unified_attention_with_output"])
    with pytest.raises(ValueError, match="needs vllm::qwen_gdn_attention_core among the splitting ops"):
        check_graph_config(vllm_config(only_attention))
    assert check_graph_config(vllm_config(only_attention, hybrid=False)) == "PIECEWISE"  # Qwen3: no GDN
    with pytest.raises(ValueError, match="FULL_AND_PIECEWISE with data parallelism > 1"):
        check_graph_config(vllm_config(resolved("FULL_AND_PIECEWISE"), dp=2))
    assert check_graph_config(vllm_config(resolved("PIECEWISE"), dp=2)) == "PIECEWISE"
    monkeypatch.setenv("VLLM_USE_BREAKABLE_CUDAGRAPH", "1")
    with pytest.raises(ValueError, match="VLLM_USE_BREAKABLE_CUDAGRAPH=1"):
        check_graph_config(vllm_config(resolved("PIECEWISE")))
    assert check_graph_config(vllm_config(resolved("NONE"))) == "NONE"


# ------------------------------------------------------------------------------ dispatch


B, MAX_SEQS = 64, 8


def runner(mode: str) -> Any:
    """A stand-in GPUModelRunner carrying what vLLM's _determine_batch_execution_and_padding reads,
    with vLLM's real CudagraphDispatcher over tfm's capture sizes (rounded as vLLM rounds them)."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_tfm.vllm_plugin.cuda_graphs import tfm_capture_sizes

    cc = resolved(mode)
    cc.cudagraph_capture_sizes = tfm_capture_sizes(B, MAX_SEQS)
    cc.max_cudagraph_capture_size = max(cc.cudagraph_capture_sizes)
    if CUDAGraphMode[mode].decode_mode() == CUDAGraphMode.FULL:
        cc.adjust_cudagraph_sizes_for_spec_decode(B + 1, 1)
    vc = SimpleNamespace(compilation_config=cc, num_speculative_tokens=B, lora_config=None,
                         scheduler_config=SimpleNamespace(max_num_seqs=MAX_SEQS))
    dispatcher = CudagraphDispatcher(vc)
    dispatcher.initialize_cudagraph_keys(CUDAGraphMode[mode], B + 1)
    return SimpleNamespace(
        _tfm_enabled=True, uniform_decode_query_len=B + 1, _is_uniform_decode=GPUModelRunner._is_uniform_decode,
        model_config=SimpleNamespace(is_encoder_decoder=False), input_batch=SimpleNamespace(lora_id_to_lora_request={}),
        _pad_for_sequence_parallelism=lambda n: n, cudagraph_dispatcher=dispatcher, compilation_config=cc,
        vllm_config=SimpleNamespace(parallel_config=SimpleNamespace(data_parallel_size=1),
                                    observability_config=SimpleNamespace(cudagraph_metrics=False)))


def dispatch(r: Any, reqs: int, tree: bool | None, per_req: int = B + 1, **kw: Any) -> tuple[str, int]:
    """(mode, padded tokens) of a decode step of ``reqs`` requests with ``per_req`` tokens each;
    tree: the step verifies trees (True), chains only (False), no step state (None)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_tfm.vllm_plugin.runtime.graph_dispatch import _wrap_determine
    from vllm_tfm.vllm_plugin.runtime.state import STATE

    vllm_fn = GPUModelRunner._determine_batch_execution_and_padding
    fn = _wrap_determine(getattr(vllm_fn, "__wrapped__", vllm_fn))  # vLLM's own, runtime installed or not
    STATE.step = None if tree is None else SimpleNamespace(tree_active=tree)
    try:
        out = fn(r, num_tokens=reqs * per_req, num_reqs=reqs, num_scheduled_tokens_np=np.full(reqs, per_req),
                 max_num_scheduled_tokens=per_req, use_cascade_attn=False, **kw)
    finally:
        STATE.step = None
    return out[0].name, out[1].num_tokens


def test_tree_steps_never_replay_a_full_graph() -> None:
    pytest.importorskip("vllm")
    from vllm_tfm.vllm_plugin.runtime.metrics import Metrics
    from vllm_tfm.vllm_plugin.runtime.state import STATE

    STATE.metrics = Metrics(max_depth=B)
    try:
        full = runner("FULL_AND_PIECEWISE")
        assert dispatch(full, 8, tree=True) == ("PIECEWISE", 520)
        assert dispatch(full, 8, tree=False) == ("FULL", 520)  # chain-only step: vLLM's full decode graph
        assert dispatch(full, 3, tree=True) == ("PIECEWISE", 195)
        assert dispatch(full, 9, tree=True) == ("NONE", 585)  # past the largest size: no graph
        pw = runner("PIECEWISE")
        assert dispatch(pw, 8, tree=True) == ("PIECEWISE", 520)
        assert dispatch(pw, 5, tree=False, per_req=1) == ("PIECEWISE", 8)  # first decode, no drafts: padded 5 -> 8
        assert dispatch(pw, 1, tree=True) == ("PIECEWISE", 65)  # batch 1, B = 64
        hooks = STATE.metrics.snapshot()["hooks"]
        assert hooks["cudagraph.tree.PIECEWISE"] == 4 and hooks["cudagraph.other.FULL"] == 1
        assert hooks["cudagraph.tree.NONE"] == 1 and hooks["cudagraph.other.PIECEWISE"] == 1
    finally:
        STATE.metrics = None
    # dummy runs (profiling, capture) pass force_uniform_decode and are vLLM's: a stale tree step changes nothing
    assert dispatch(full, 8, tree=True, force_uniform_decode=True) == ("FULL", 520)
    # a runner of another method is vLLM's too
    other = runner("FULL_AND_PIECEWISE")
    other._tfm_enabled = False
    assert dispatch(other, 8, tree=True) == ("FULL", 520)


def test_a_tree_step_that_gets_a_full_graph_stops_the_engine() -> None:
    pytest.importorskip("vllm")
    from vllm.config import CUDAGraphMode

    from vllm_tfm.vllm_plugin.runtime.graph_dispatch import _wrap_determine
    from vllm_tfm.vllm_plugin.runtime.state import STATE

    def orig(self: Any, *args: Any, **kwargs: Any) -> tuple:
        return (CUDAGraphMode.FULL, SimpleNamespace(num_tokens=65), False, None, None)  # e.g. a DP-synced mode

    STATE.step = SimpleNamespace(tree_active=True)
    try:
        with pytest.raises(RuntimeError, match="dispatched to a full CUDA graph"):
            _wrap_determine(orig)(SimpleNamespace(_tfm_enabled=True), 65, 1, np.array([65]), 65, False)
    finally:
        STATE.step = None


def test_piece_outputs_are_reused_only_inside_graph_forwards() -> None:
    pytest.importorskip("vllm")
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import ForwardContext, override_forward_context

    from vllm_tfm.vllm_plugin.runtime.graph_dispatch import piece_outputs_are_reused

    assert not piece_outputs_are_reused()  # no forward running
    for mode, expected in (("NONE", False), ("PIECEWISE", True), ("FULL", True)):
        ctx = ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}, cudagraph_runtime_mode=CUDAGraphMode[mode])
        with override_forward_context(ctx):
            assert piece_outputs_are_reused() is expected
