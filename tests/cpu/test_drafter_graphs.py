"""Full CUDA graphs of the DFlash drafter's query forward (runtime/drafter_graphs.py): which steps take a key, the
persistent metadata, the eager / capture / replay order, and the proposer's dispatch and forward routing. CUDA graph
capture itself is replaced by a recording stand-in here (no GPU)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from vllm_tfm.vllm_plugin.runtime import drafter_graphs as dg
from vllm_tfm.vllm_plugin.runtime.drafter_graphs import DRAFTER_GRAPHS_ENV, Captured, DrafterGraphs
from vllm_tfm.vllm_plugin.runtime.metrics import Metrics
from vllm_tfm.vllm_plugin.runtime.state import STATE


class _Graph:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def replay(self) -> None:
        self.log.append("replay")


def _graphs(log: list[str], fail: bool = False, max_requests: int = 4) -> DrafterGraphs:
    def capture(forward: Any) -> Captured:
        log.append("capture")
        if fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        return Captured(_Graph(log), forward())

    return DrafterGraphs(max_requests, torch.device("cpu"), capture=capture)


def _cad(r: int, q: int, seq_lens: list[int]) -> Any:
    from vllm.v1.attention.backend import CommonAttentionMetadata

    qsl = torch.arange(r + 1, dtype=torch.int32) * q
    return CommonAttentionMetadata(
        query_start_loc=qsl, query_start_loc_cpu=qsl.clone(), seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=r, num_actual_tokens=r * q, max_query_len=q, max_seq_len=max(seq_lens),
        block_table_tensor=torch.zeros(r, 4, dtype=torch.int32), slot_mapping=torch.arange(r * q), causal=False)


def test_a_key_is_requests_by_uniform_queries_within_the_buffers() -> None:
    graphs = _graphs([])
    assert graphs.key(2, 16, 32) == (2, 16)
    assert graphs.key(2, 16, 31) is None  # requests with different query counts
    assert graphs.key(5, 16, 80) is None and graphs.key(0, 16, 0) is None  # outside the buffers
    with pytest.raises(ValueError, match="max_requests must be >= 1, got 0"):
        DrafterGraphs(0, torch.device("cpu"))


def test_the_metadata_takes_the_persistent_buffers_with_this_steps_values() -> None:
    graphs = _graphs([])
    first = graphs.persistent_metadata(_cad(2, 16, [40, 57]), (2, 16))
    second = graphs.persistent_metadata(_cad(2, 16, [41, 60]), (2, 16))
    assert first.query_start_loc.data_ptr() == second.query_start_loc.data_ptr()
    assert first.seq_lens.data_ptr() == second.seq_lens.data_ptr()
    assert second.query_start_loc.tolist() == [0, 16, 32] and second.seq_lens.tolist() == [41, 60]
    assert second.num_actual_tokens == 32 and second.causal is False  # the rest as given
    one = graphs.persistent_metadata(_cad(1, 16, [9]), (1, 16))
    assert one.seq_lens.data_ptr() == second.seq_lens.data_ptr() and one.seq_lens.tolist() == [9]


def test_a_key_runs_eagerly_once_then_is_captured_and_replays() -> None:
    log: list[str] = []
    graphs = _graphs(log)
    calls = iter(range(100))

    def forward() -> int:
        n = next(calls)
        log.append(f"forward {n}")
        return n

    assert graphs.run((1, 16), forward) == 0 and log == ["forward 0"]  # Triton compiles outside a capture
    log.clear()
    assert graphs.run((1, 16), forward) == 1 and log == ["capture", "forward 1", "replay"]
    log.clear()
    assert graphs.run((1, 16), forward) == 1 and log == ["replay"]  # the captured output, no forward
    assert graphs.keys == ((1, 16),) and graphs.captures == 1 and graphs.replays == 2
    log.clear()
    assert graphs.run((2, 16), forward) == 2 and log == ["forward 2"]  # another key starts over


def test_a_failed_capture_turns_the_graphs_off_for_good(caplog: pytest.LogCaptureFixture) -> None:
    """A failed capture can leave the shared pool unusable (section 69: every later capture on that H100 failed in
    the caching allocator), so no key is taken after one, and the failure is logged with its traceback."""
    log: list[str] = []
    graphs = _graphs(log, fail=True)
    forward = lambda: log.append("forward") or 7  # noqa: E731
    graphs.run((1, 16), forward)
    log.clear()
    with caplog.at_level("WARNING", logger="vllm.tfm"):
        assert graphs.run((1, 16), forward) == 7
    assert log == ["capture", "forward"] and "could not be captured" in caplog.text
    assert "Traceback" in caplog.text and "stream is capturing" in graphs.failed
    assert graphs.key(1, 16, 16) is None and graphs.key(2, 16, 32) is None  # every size: the piecewise graphs
    log.clear()
    assert graphs.run((1, 16), forward) == 7 and log == ["forward"]


def test_the_proposer_dispatches_full_and_routes_the_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the switch on, a uniform step gets a key, the persistent metadata, mode FULL unpadded and the graphs'
    run; with it off (or steps without a key: dummy runs, vLLM's captures) vLLM's own path."""
    from vllm.config import CUDAGraphMode
    from vllm.v1.spec_decode.dflash import DFlashProposer
    import vllm.forward_context as fc

    from vllm_tfm.vllm_plugin.runtime.proposer import TFMProposer

    log: list[str] = []
    cad = _cad(2, 16, [30, 31])
    monkeypatch.setattr(DFlashProposer, "set_inputs_first_pass", lambda self, *a, **k: (32, "indices", cad))
    monkeypatch.setattr(DFlashProposer, "_determine_batch_execution_and_padding",
                        lambda self, n, use_cudagraphs=True: (CUDAGraphMode.PIECEWISE, 34, None))
    mode = SimpleNamespace(cudagraph_runtime_mode=CUDAGraphMode.FULL)
    monkeypatch.setattr(fc, "get_forward_context", lambda: mode)
    monkeypatch.setattr(STATE, "metrics", Metrics(4))
    p = TFMProposer.__new__(TFMProposer)
    p._drafter_graphs, p._drafter_graph_key, p.num_speculative_tokens = _graphs(log), None, 15
    p.model = SimpleNamespace(forward=lambda **kw: log.append("model") or "hidden")
    p._route_forward_through_graphs()

    monkeypatch.setenv(DRAFTER_GRAPHS_ENV, "1")
    n, idx, got = p.set_inputs_first_pass(target_token_ids=None)
    assert (n, idx) == (32, "indices") and p._drafter_graph_key == (2, 16)
    assert got.seq_lens.tolist() == [30, 31] and got.seq_lens is not cad.seq_lens
    assert p._determine_batch_execution_and_padding(32) == (CUDAGraphMode.FULL, 32, None)
    assert p.model.forward(input_ids=None) == "hidden" and log == ["model"]  # the key's first step: eager
    log.clear()
    assert p.model.forward(input_ids=None) == "hidden" and log == ["capture", "model", "replay"]
    assert STATE.metrics.hooks["proposer.drafter_graph"] == 2 and STATE.metrics.hooks["proposer.drafter_graph_replay"] == 1
    mode.cudagraph_runtime_mode = CUDAGraphMode.PIECEWISE  # not a FULL step: the model's own forward
    log.clear()
    assert p.model.forward(input_ids=None) == "hidden" and log == ["model"]

    monkeypatch.setenv(DRAFTER_GRAPHS_ENV, "0")
    n, idx, got = p.set_inputs_first_pass(target_token_ids=None)
    assert p._drafter_graph_key is None and got is cad
    assert p._determine_batch_execution_and_padding(32) == (CUDAGraphMode.PIECEWISE, 34, None)
    try:
        assert dg.set_drafter_graphs(True) is True and dg.drafter_graphs_enabled()
        with pytest.raises(ValueError, match="set_drafter_graphs takes True, False or None, got 'on'"):
            dg.set_drafter_graphs("on")  # type: ignore[arg-type]
    finally:
        assert dg.set_drafter_graphs(None) is False


def test_only_a_one_gpu_graphs_engine_started_with_the_switch_gets_drafter_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.config import CUDAGraphMode

    from vllm_tfm.vllm_plugin.runtime import proposer

    made: list[tuple[int, torch.device]] = []
    monkeypatch.setattr(proposer, "DrafterGraphs", lambda n, device: made.append((n, device)) or "graphs")

    def config(tp: int = 1, eager: bool = False, mode: Any = CUDAGraphMode.FULL_AND_PIECEWISE) -> Any:
        return SimpleNamespace(
            parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1, data_parallel_size=1),
            model_config=SimpleNamespace(enforce_eager=eager), speculative_config=SimpleNamespace(enforce_eager=False),
            compilation_config=SimpleNamespace(cudagraph_mode=mode), scheduler_config=SimpleNamespace(max_num_seqs=8))

    cuda = torch.device("cuda", 0)
    monkeypatch.delenv(DRAFTER_GRAPHS_ENV, raising=False)
    assert proposer._drafter_graphs(config(), cuda) is None  # opt-in: vLLM's DFlash path unchanged
    assert dg.drafter_graphs_from_env({DRAFTER_GRAPHS_ENV: "1"}) and not dg.drafter_graphs_from_env({})
    monkeypatch.setenv(DRAFTER_GRAPHS_ENV, "1")
    assert proposer._drafter_graphs(config(), cuda) == "graphs" and made == [(8, cuda)]
    for cfg, dev in ((config(tp=2), cuda), (config(eager=True), cuda), (config(mode=CUDAGraphMode.NONE), cuda),
                     (config(), torch.device("cpu"))):
        assert proposer._drafter_graphs(cfg, dev) is None
    assert len(made) == 1
