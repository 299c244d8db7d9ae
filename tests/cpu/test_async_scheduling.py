"""vLLM's asynchronous scheduling for method 'tfm' (vllm_plugin/async_scheduling.py): the engine config
vLLM builds with async_scheduling unset (vLLM's default at tensor parallelism 1; synchronous above or with the
trace), True and False, and what the runtime does differently when the runner
schedules asynchronously (no sampled-token copy for the bookkeeping, GDN states moved to slot 0 from
the device's accepted counts, placeholders no proposal stands for, the trace refused).

The engine configs are vLLM 0.26's own ``VllmConfig`` built on the CPU (``device="cpu"``), with the
speculative config the plugin builds for a tiny Qwen3.5 hybrid and DFlash drafter."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from _fake_runner import fake_hybrid_runner
from _vllm_plugin_env import tiny_tfm_configs, vllm_cpu_session
from vllm_tfm.vllm_plugin.runtime import deferred_drafts as dd
from vllm_tfm.vllm_plugin.runtime.accepted_offsets import AcceptedOffsets
from vllm_tfm.vllm_plugin.runtime.metrics import Metrics
from vllm_tfm.vllm_plugin.runtime.sampled_copy import SampledCopy
from vllm_tfm.vllm_plugin.runtime.state import PLACEHOLDER_DRAFT, STATE, ProposalStore

P = PLACEHOLDER_DRAFT


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("async_scheduling")
    with vllm_cpu_session(root / "vllm-cache"):
        model_config, parallel, spec = tiny_tfm_configs(root, 7)
        yield {"model_config": model_config, "parallel": parallel, "spec": spec}


def engine_config(env: Any, async_scheduling: bool | None, spec: bool = True) -> Any:
    from vllm.config import DeviceConfig, SchedulerConfig, VllmConfig

    return VllmConfig(model_config=env["model_config"], speculative_config=env["spec"] if spec else None,
                      parallel_config=env["parallel"], device_config=DeviceConfig(device="cpu"),
                      scheduler_config=SchedulerConfig.default_factory(async_scheduling=async_scheduling, max_model_len=2048))


def test_tfm_engines_take_vllms_default_at_tp_1_and_schedule_as_asked(env: Any, monkeypatch: pytest.MonkeyPatch,
                                                                       caplog: pytest.LogCaptureFixture,
                                                                       tmp_path: Path) -> None:
    import os

    from vllm_tfm.vllm_plugin import async_scheduling

    for name in [k for k in os.environ if k.startswith("VLLM_TFM_")]:
        monkeypatch.delenv(name)  # nothing but the argument says how to schedule
    sync_line = "vllm-tfm: method 'tfm' schedules synchronously here"
    with caplog.at_level(logging.INFO, logger="vllm_tfm"):
        unset = engine_config(env, None)
    assert unset.scheduler_config.async_scheduling is True  # vLLM's default for a method it lets schedule ahead
    assert unset.model_config.disable_cascade_attn  # what vLLM does for asynchronous speculative decoding
    assert sync_line not in caplog.text
    caplog.clear()
    monkeypatch.setenv("VLLM_TFM_TRACE", str(tmp_path))  # the trace reads acceptance on the host: synchronous
    with caplog.at_level(logging.INFO, logger="vllm_tfm"):
        assert engine_config(env, None).scheduler_config.async_scheduling is False
    assert (f"{sync_line} (VLLM_TFM_TRACE reads every step's acceptance on the host); --async-scheduling turns "
            "asynchronous scheduling on") in caplog.text
    monkeypatch.delenv("VLLM_TFM_TRACE")
    caplog.clear()
    on = "vllm-tfm: asynchronous scheduling is on for method 'tfm' (--async-scheduling)"
    async_scheduling._log_async_on.cache_clear()
    with caplog.at_level(logging.INFO, logger="vllm_tfm"):
        config = engine_config(env, True)
        assert engine_config(env, True).scheduler_config.async_scheduling is True
    assert config.scheduler_config.async_scheduling is True and config.speculative_config.method == "tfm"
    said = [r for r in caplog.records if r.getMessage() == on]
    assert len(said) == 1 and said[0].levelno == logging.INFO  # once per process, not a warning
    assert engine_config(env, False).scheduler_config.async_scheduling is False  # --no-async-scheduling


def test_tensor_parallelism_above_1_keeps_synchronous_scheduling_by_default(monkeypatch: pytest.MonkeyPatch,
                                                                          tmp_path: Path) -> None:
    from vllm_tfm.vllm_plugin.async_scheduling import synchronous_default_reason

    monkeypatch.delenv("VLLM_TFM_TRACE", raising=False)

    def config(tp: int) -> SimpleNamespace:
        return SimpleNamespace(parallel_config=SimpleNamespace(tensor_parallel_size=tp))

    assert synchronous_default_reason(config(1)) is None
    assert synchronous_default_reason(config(2)) == ("tensor parallelism 2: tfm has run asynchronously at tensor "
                                                     "parallelism 1 only")
    monkeypatch.setenv("VLLM_TFM_TRACE", str(tmp_path))
    assert "VLLM_TFM_TRACE" in synchronous_default_reason(config(1))
    assert synchronous_default_reason(config(4)).startswith("tensor parallelism 4")


def test_the_widened_method_names_are_what_lets_vllm_build_it(env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import typing

    import pydantic
    import vllm.config.speculative as speculative
    import vllm.config.vllm as config_module

    from vllm_tfm.vllm_plugin import patching
    from vllm_tfm.vllm_plugin.async_scheduling import install_async_scheduling_patches

    key = "vllm.config.vllm.EagleModelTypes"
    widened = config_module.EagleModelTypes
    assert set(typing.get_args(widened)) == {*typing.get_args(speculative.EagleModelTypes), "tfm"}
    assert "tfm" not in typing.get_args(speculative.EagleModelTypes)  # the Literal vLLM's config fields use
    try:
        assert patching.restore([key]) == [key]
        assert config_module.EagleModelTypes is speculative.EagleModelTypes  # vLLM's own object back
        with pytest.raises(pydantic.ValidationError, match="async scheduling is only supported with EAGLE/MTP"):
            engine_config(env, True)
    finally:
        install_async_scheduling_patches()  # idempotent for the wrapper, re-applies the names
    assert typing.get_args(config_module.EagleModelTypes) == typing.get_args(widened)
    assert engine_config(env, True).scheduler_config.async_scheduling is True


def test_engines_of_other_methods_are_untouched(env: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.config.vllm as config_module

    from vllm_tfm.vllm_plugin import patching
    from vllm_tfm.vllm_plugin.async_scheduling import install_async_scheduling_patches

    with_plugin = [engine_config(env, v, spec=False).scheduler_config.async_scheduling for v in (None, True, False)]
    key = "vllm.config.vllm.VllmConfig.__post_init__"
    try:
        assert patching.restore([key]) == [key]
        assert "__post_init__" not in patching.installed_patches()
        vllm_only = [engine_config(env, v, spec=False).scheduler_config.async_scheduling for v in (None, True, False)]
    finally:
        install_async_scheduling_patches()
    assert with_plugin == vllm_only == [True, True, False]
    assert config_module.VllmConfig.__post_init__.__wrapped__ is patching.original(config_module.VllmConfig, "__post_init__")


# ---------------------------------------------------------------------------------------- runtime
@pytest.fixture()
def fresh_state():
    saved = (STATE.store, STATE.metrics, STATE.defer_drafts, STATE.sampled_copy, STATE.offsets)
    STATE.store, STATE.metrics, STATE.defer_drafts = ProposalStore(), Metrics(max_depth=8, device="cpu"), False
    STATE.sampled_copy, STATE.offsets = SampledCopy(), AcceptedOffsets()
    yield
    STATE.store, STATE.metrics, STATE.defer_drafts, STATE.sampled_copy, STATE.offsets = saved


def test_no_sampled_copy_and_vllms_own_bookkeeping_when_asynchronous(fresh_state: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_tfm.vllm_plugin.runtime import hooks

    monkeypatch.setattr(dd, "defers_drafts", lambda sampled, so, md: True)
    sampled = torch.tensor([[5, 6, -1]], dtype=torch.int32)
    dd.record_sampled_copy(sampled, None, None, copy=False)
    assert STATE.defer_drafts and not STATE.sampled_copy.holds(sampled)  # decided, nothing queued
    dd.record_sampled_copy(sampled, None, None)
    assert STATE.sampled_copy.holds(sampled)
    seen: list[Any] = []
    bookkeeping = hooks._wrap_bookkeeping_sync(lambda self, so, out, *a: seen.append(out.sampled_token_ids))
    out = SimpleNamespace(sampled_token_ids=sampled)
    bookkeeping(SimpleNamespace(_tfm_enabled=True, use_async_scheduling=True), None, out, None)
    assert seen[-1] is sampled and STATE.sampled_copy.holds(sampled)  # the device tensor; the record not consumed
    bookkeeping(SimpleNamespace(_tfm_enabled=True, use_async_scheduling=False), None, out, None)
    assert seen[-1] is not sampled and torch.equal(seen[-1], sampled)  # synchronous: the host copy


@pytest.mark.parametrize("async_mode", [False, True])
def test_both_hooks_queue_the_copy_only_when_synchronous(fresh_state: None, monkeypatch: pytest.MonkeyPatch,
                                                          async_mode: bool) -> None:
    from vllm_tfm.vllm_plugin.runtime import hooks

    monkeypatch.setattr(dd, "defers_drafts", lambda sampled, so, md: True)
    monkeypatch.setattr(hooks, "commit_step", lambda runner, step, tokens: None)
    saved_step, saved_trace = STATE.step, STATE.trace
    STATE.step, STATE.trace = SimpleNamespace(tree_active=True, tree_gdn=True), None
    try:
        sampled = torch.tensor([[5, 6, -1]], dtype=torch.int32)
        runner = SimpleNamespace(_tfm_enabled=True, use_async_scheduling=async_mode,
                                 model_config=SimpleNamespace(is_hybrid=False), input_batch=SimpleNamespace(sampling_metadata=None))
        hooks._wrap_update_states_after(lambda self, o, s: None)(runner, sampled, None)
        hooks._wrap_propose(lambda self, *a, **k: "drafts")(runner, None, sampled, None, None, None)
        assert STATE.defer_drafts and STATE.sampled_copy.holds(sampled) is not async_mode
    finally:
        STATE.step, STATE.trace = saved_step, saved_trace


def test_placeholders_no_proposal_stands_for_are_zeros_verified_as_a_chain(fresh_state: None) -> None:
    from vllm_tfm.vllm_plugin.runtime.inputs import build_step_tree

    STATE.store.put(["a"], torch.tensor([[7, 8]]), torch.tensor([[-1, 0, 0]]))
    cpu = torch.tensor([5, P, P, 6, P, P], dtype=torch.int32)
    runner = SimpleNamespace(input_ids=SimpleNamespace(np=cpu.numpy(), cpu=cpu, gpu=torch.zeros_like(cpu)),
                             input_batch=SimpleNamespace(req_id_to_index={"a": 0, "new": 1}, spec_token_ids=[[], []],
                                                         sampling_metadata=SimpleNamespace(
                                                             no_penalties=True, bad_words_token_ids={}, allowed_token_ids_mask=None,
                                                             max_num_logprobs=None, logitsprocs=SimpleNamespace(non_argmax_invariant=[]))))
    so = SimpleNamespace(scheduled_spec_decode_tokens={"a": [P, P], "new": [P, P]})
    cu = np.array([3, 6])
    with pytest.raises(RuntimeError, match="'new' was scheduled 2 placeholder drafts but its proposal is gone"):
        dd.fill_input_ids(runner, so, cu)  # synchronous: the scheduler's placeholders always came from a proposal
    fill = dd.fill_input_ids(runner, so, cu, absent_ok=True)
    assert fill is not None and fill.host_filled == 2 and cpu.tolist() == [5, P, P, 6, 0, 0]
    runner.input_ids.gpu.copy_(cpu)  # vLLM's copy
    assert fill.apply(runner.input_ids.gpu) == 2 and runner.input_ids.gpu.tolist() == [5, 7, 8, 6, 0, 0]
    step = build_step_tree(["a", "new"], np.array([3, 3]), so.scheduled_spec_decode_tokens, STATE.store, allow_trees=True)
    assert step.is_tree.tolist() == [True, False]  # "new": a chain of the tokens in the input ids
    assert step.local_parent[3:].tolist() == [-1, 0, 1]


class _NoSync:
    """A device tensor stand-in whose host read fails the test (``AcceptedOffsets`` must not sync)."""

    def tolist(self) -> list[int]:
        raise AssertionError("host sync")


def test_a_finished_request_leaving_the_batch_costs_no_host_sync() -> None:
    off = AcceptedOffsets()
    off.end_step(["a", "b"], torch.tensor([3, 2]))
    off._last_values = _NoSync()  # what end_step kept, made unreadable
    cont = off.begin_step(["a"], set(), {"a": 0})  # b finished: gone from the runner's requests
    assert cont.tolist() == [True] and off.records == {}
    off.end_step(["a", "b"], torch.tensor([3, 2]))
    cont = off.begin_step(["a"], set(), {"a": 0, "b": 0})  # b left while running: its a is read (a sync)
    assert off.records == {"b": 2}


@pytest.mark.parametrize("async_mode", [False, True])
def test_a_continuing_row_scheduled_one_token_reads_its_state_from_slot_0(fresh_state: None, monkeypatch: pytest.MonkeyPatch,
                                                                          async_mode: bool) -> None:
    """Rows a, b, c continue from the last step, whose accepted counts were 3, 1, 4 (on the device; the
    host holds them too when synchronous, 1s when asynchronous). This step b and c get one token and no
    drafts (the token budget), a verifies drafts. c's state, at slot 4 * 2 + 3, must be in slot 8 and its
    conv window in columns 0..2; b's (a = 1) stays; a is untouched. Asynchronous: done on the device."""
    import vllm_tfm.vllm_plugin.runtime.hooks as hooks

    runner, conv, ssm, width = fake_hybrid_runner(monkeypatch, async_mode)
    so = SimpleNamespace(scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()),
                         scheduled_spec_decode_tokens={"a": [P, P, P]})
    STATE.offsets.end_step(["a", "b", "c"], torch.tensor([3, 1, 4, 1], dtype=torch.int32))
    counts = [3, 1, 4, 1]
    runner.num_accepted_tokens.gpu[:] = torch.tensor(counts)  # vLLM's device correction (both modes)
    if not async_mode:
        runner.num_accepted_tokens.np[:] = counts
    want_ssm, want_conv = ssm.clone(), conv.clone()
    want_ssm[8] = ssm[11]
    want_conv[8, :, : width - 1] = conv[8, :, 3 : 3 + width - 1]
    plan = hooks.fix_accepted_offsets(runner, so, np.array([4, 1, 1]))
    assert torch.equal(ssm, want_ssm) and torch.equal(conv, want_conv)
    assert runner.num_accepted_tokens.gpu[:3].tolist() == [3, 1, 1]
    if async_mode:
        assert plan.device_move_rows == [1, 2] and not plan.move_rows and not plan.restore_rows
        assert runner.num_accepted_tokens.np[:3].tolist() == [1, 1, 1]  # the host's placeholders, untouched
    else:
        assert plan.move_rows == [2] and plan.move_from == [4] and not plan.device_move_rows
        assert runner.num_accepted_tokens.np[:3].tolist() == [3, 1, 1]
    # the next step: every row verifies drafts again, nothing to do (no Python loop over rows)
    so.scheduled_spec_decode_tokens = {"a": [P, P, P], "b": [P, P, P], "c": [P, P, P]}
    assert hooks.fix_accepted_offsets(runner, so, np.array([4, 4, 4])) is None


def test_a_re_added_row_gets_its_count_back_when_asynchronous(fresh_state: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """b left the batch for a step while running and comes back verifying drafts: vLLM counts it as new
    (device and host 1); its count from before it left (2) is restored on the device."""
    import vllm_tfm.vllm_plugin.runtime.hooks as hooks

    runner, _, _, _ = fake_hybrid_runner(monkeypatch, True)
    so = SimpleNamespace(scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()), scheduled_spec_decode_tokens={})
    STATE.offsets.end_step(["a", "b", "c"], torch.tensor([3, 2, 4, 1], dtype=torch.int32))
    batch = runner.input_batch
    batch.num_reqs, batch.req_ids = 2, ["a", "c"]
    so.scheduled_spec_decode_tokens = {"a": [P, P, P], "c": [P, P, P]}
    assert hooks.fix_accepted_offsets(runner, so, np.array([4, 4])) is None
    STATE.offsets.end_step(["a", "c"], torch.tensor([2, 1], dtype=torch.int32))
    batch.num_reqs, batch.req_ids = 3, ["a", "b", "c"]
    runner.num_accepted_tokens.gpu[:] = torch.tensor([2, 1, 1, 1])  # b: not in the last batch, vLLM's 1
    so.scheduled_spec_decode_tokens = {"a": [P, P, P], "b": [P, P, P], "c": [P, P, P]}
    plan = hooks.fix_accepted_offsets(runner, so, np.array([4, 4, 4]))
    assert plan.restore_rows == [1] and plan.restore_values == [2] and not plan.device_move_rows
    assert runner.num_accepted_tokens.gpu[:3].tolist() == [2, 2, 1]


def test_the_trace_needs_synchronous_scheduling(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from vllm_tfm.vllm_plugin.runtime.hooks import check_engine_config

    def config(async_scheduling: bool) -> SimpleNamespace:
        return SimpleNamespace(
            compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name="NONE")),
            model_config=SimpleNamespace(is_hybrid=True, uses_xdrope_dim=0),
            cache_config=SimpleNamespace(mamba_cache_mode="none"),
            parallel_config=SimpleNamespace(pipeline_parallel_size=1, decode_context_parallel_size=1),
            scheduler_config=SimpleNamespace(async_scheduling=async_scheduling))

    check_engine_config(config(True))
    monkeypatch.setenv("VLLM_TFM_TRACE", str(tmp_path))
    check_engine_config(config(False))
    with pytest.raises(ValueError, match=r"VLLM_TFM_TRACE reads every step's acceptance on the host: it needs synchronous "
                                         r"scheduling \(unset VLLM_TFM_TRACE or drop --async-scheduling\)"):
        check_engine_config(config(True))


def test_steps_of_vllms_device_correction_and_ours_give_every_row_the_slot_its_state_is_in(
        fresh_state: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three asynchronous steps through vLLM 0.26's own correction of the accepted counts
    (``update_num_computed_tokens_for_batch_change``, run by its ``_prepare_inputs``) followed by
    ``fix_accepted_offsets``, with a request leaving the batch while running, a reorder, a row scheduled
    one token, and the request coming back. After each step's preparation every row's device count must
    be the ``a`` whose slot ``a - 1`` holds its state: the last step's accepted drafts + 1 for a row that
    verified drafts, 1 after a plain decode or a move to slot 0, the count from before it left for a
    re-added row."""
    from vllm.v1.spec_decode.utils import update_num_computed_tokens_for_batch_change

    import vllm_tfm.vllm_plugin.runtime.hooks as hooks

    runner, conv, ssm, width = fake_hybrid_runner(monkeypatch, True)
    acc, batch = runner.num_accepted_tokens, runner.input_batch
    b = 3
    so = SimpleNamespace(scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()), scheduled_spec_decode_tokens={})

    def sampled(accepted: list[int | None]) -> torch.Tensor:
        """The tree sampler's rows: accepted drafts + the bonus token, then -1 (None: a row without drafts)."""
        rows = [[7] * (1 if p is None else p + 1) + [-1] * (b - (0 if p is None else p)) for p in accepted]
        return torch.tensor(rows, dtype=torch.int32)

    def end_step(req_ids: list[str], out: torch.Tensor) -> None:  # vLLM's _update_states_after_model_execute, then ours
        acc.gpu[: out.shape[0]] = (out != -1).sum(dim=1)
        STATE.offsets.end_step(req_ids, acc.gpu)

    def prepare(req_ids: list[str], prev_ids: list[str], prev_out: torch.Tensor, prev_drafts: list[int],
                nst: list[int]) -> None:
        n = len(req_ids)
        batch.num_reqs, batch.req_ids = n, list(req_ids)
        acc.np.fill(1)  # vLLM's asynchronous _prepare_inputs: host placeholders of 1, device 1 ...
        acc.gpu.fill_(1)
        prev_positions = torch.tensor([prev_ids.index(r) if r in prev_ids else -1 for r in req_ids])
        valid = (prev_out != -1).sum(dim=1).to(torch.int32)  # what its padded drafter input counted
        update_num_computed_tokens_for_batch_change(  # ... corrected on the device for rows that drafted last step
            torch.zeros(8, dtype=torch.int32), acc.gpu[:n], prev_positions, valid,
            torch.tensor(prev_drafts, dtype=torch.int32), torch.zeros(n, dtype=torch.int32))
        so.scheduled_spec_decode_tokens = {r: [P] * b for r, k in zip(req_ids, nst) if k == b + 1}
        hooks.fix_accepted_offsets(runner, so, np.array(nst))

    out1 = sampled([1, 2, 0])  # step 1: a, b, c verified B drafts
    end_step(["a", "b", "c"], out1)
    ssm_before = ssm.clone()
    prepare(["c", "a"], ["a", "b", "c"], out1, [b, b, b], [b + 1, 1])  # b left while running; a gets one token
    assert acc.gpu[:2].tolist() == [1, 1]  # c accepted 0 drafts; a's state (a = 2) was moved to slot 0
    assert torch.equal(ssm[4], ssm_before[5]) and torch.equal(ssm[0], ssm_before[0])
    assert STATE.offsets.records == {"b": 3}
    out2 = sampled([2, None])  # step 2: c accepted 2, a decoded one token
    end_step(["c", "a"], out2)
    prepare(["a", "b", "c"], ["c", "a"], out2, [b, 0], [b + 1] * 3)  # b back; all verify drafts
    assert acc.gpu[:3].tolist() == [1, 3, 3]  # a: after a plain decode; b: restored; c: 2 accepted + 1
    assert acc.np[:3].tolist() == [1, 3, 1]  # the host holds placeholders but for the restored row
