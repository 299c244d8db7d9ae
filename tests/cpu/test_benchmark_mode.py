"""Benchmark-only switches of the plugin: acceptance replay (refused without the confirmation flag,
carried to the workers, applied by the tree sampler) and the per-stage timer (off = nothing)."""

from __future__ import annotations

import json
import logging
import pickle
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from _sampling_fakes import sampling_metadata

from vllm_tfm.verify.acceptance_profile import (
    AcceptanceProfile,
    ProfileEntry,
    geometric_pmf,
    resize_pmf,
    save_profile,
)
from vllm_tfm.vllm_plugin.benchmark_mode import (
    CONFIRM_ENV,
    REPLAY_ENV,
    SEED_ENV,
    SPINE_ENV,
    get_acceptance_replay,
    resolve_acceptance_replay,
)
from vllm_tfm.vllm_plugin.runtime import stage_timing
from vllm_tfm.vllm_plugin.runtime.stage_timing import StageTimer, summarize

REFUSAL = (
    "VLLM_TFM_BENCHMARK_ACCEPTANCE_REPLAY is set, but acceptance replay is a benchmark mode: accepted paths are "
    "drawn from a recorded profile instead of being checked against the target, so the output is NOT the model's; "
    "set VLLM_TFM_I_AM_BENCHMARKING=1 to run it, or unset VLLM_TFM_BENCHMARK_ACCEPTANCE_REPLAY"
)


def profile_file(tmp_path: Path, entries: list[ProfileEntry] | None = None) -> Path:
    entries = entries or [
        ProfileEntry(method="ddtree", budget=7, temperature=0.0, accepted_pmf=geometric_pmf(0.5, 10)),
        ProfileEntry(method="tfm", budget=7, temperature=0.0, accepted_pmf=geometric_pmf(0.7, 10)),
    ]
    path = tmp_path / "profile.json"
    save_profile(AcceptanceProfile(source="test profile", measured=True, entries=entries), path)
    return path


# ------------------------------------------------------------------ resolution (no vLLM)


def test_replay_is_off_without_the_variable_and_refused_without_confirmation(tmp_path: Path) -> None:
    path = profile_file(tmp_path)
    assert resolve_acceptance_replay("tfm", 7, 7, environ={}) is None
    assert resolve_acceptance_replay("tfm", 7, 7, environ={CONFIRM_ENV: "1"}) is None
    for confirm in ({}, {CONFIRM_ENV: "0"}, {CONFIRM_ENV: "yes"}):
        with pytest.raises(ValueError) as info:
            resolve_acceptance_replay("tfm", 7, 7, environ={REPLAY_ENV: str(path), **confirm})
        assert str(info.value) == REFUSAL


def test_confirmed_replay_selects_the_engines_entry(tmp_path: Path) -> None:
    path = profile_file(tmp_path)
    env = {REPLAY_ENV: str(path), CONFIRM_ENV: "1"}
    spec = resolve_acceptance_replay("ddtree", 7, 7, environ=env)
    assert spec is not None and spec.entry == "ddtree B=7 T=0" and spec.measured
    assert spec.accepted_pmf == pytest.approx(resize_pmf(geometric_pmf(0.5, 10), 7))  # the engine drafts 7 deep
    assert (spec.seed, spec.spine_top1) == (0, 0.9)
    spec = resolve_acceptance_replay("tfm", 7, 7, environ={**env, SEED_ENV: "5", SPINE_ENV: "none"})
    assert spec is not None and (spec.entry, spec.seed, spec.spine_top1) == ("tfm B=7 T=0", 5, None)
    with pytest.raises(ValueError, match=r"has no entry for tfm B=8"):
        resolve_acceptance_replay("tfm", 8, 7, environ=env)
    with pytest.raises(ValueError, match=r"VLLM_TFM_BENCHMARK_REPLAY_SEED='x': expected an integer"):
        resolve_acceptance_replay("tfm", 7, 7, environ={**env, SEED_ENV: "x"})
    with pytest.raises(ValueError, match=r"VLLM_TFM_BENCHMARK_SPINE_TOP1='1.5': expected a probability"):
        resolve_acceptance_replay("tfm", 7, 7, environ={**env, SPINE_ENV: "1.5"})
    with pytest.raises(ValueError, match=r"no such file"):
        resolve_acceptance_replay("tfm", 7, 7, environ={**env, REPLAY_ENV: str(tmp_path / "nope.json")})


# ------------------------------------------------------------------ through vLLM's config path


@pytest.fixture(scope="module")
def vllm_env(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from _vllm_plugin_env import vllm_cpu_session, write_drafter, write_qwen35_target

    root = tmp_path_factory.mktemp("bench_mode")
    with vllm_cpu_session(root / "vllm-cache"):
        from vllm.engine.arg_utils import EngineArgs

        target = write_qwen35_target(root / "target")
        drafter = write_drafter(root / "drafter")  # plain DFlash drafter: proposal ddtree
        model_config = EngineArgs(model=str(target), skip_tokenizer_init=True).create_model_config()
        yield {"root": root, "target": target, "drafter": drafter, "model_config": model_config}


@pytest.fixture()
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    import os

    for name in list(os.environ):
        if name.startswith("VLLM_TFM_"):
            monkeypatch.delenv(name)
    return monkeypatch


def build_tfm(env: Any) -> Any:
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    spec = {"method": "tfm", "model": str(env["drafter"]), "num_speculative_tokens": 7}
    args = EngineArgs(model=str(env["target"]), skip_tokenizer_init=True, speculative_config=spec)
    return args.create_speculative_config(env["model_config"], ParallelConfig())


def test_engine_config_refuses_replay_without_confirmation(vllm_env: Any, clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(REPLAY_ENV, str(profile_file(vllm_env["root"])))
    with pytest.raises(ValueError) as info:
        build_tfm(vllm_env)
    assert str(info.value) == REFUSAL


def test_engine_config_carries_the_confirmed_replay_to_workers(
    vllm_env: Any, clean_env: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = build_tfm(vllm_env)
    assert get_acceptance_replay(cfg) is None  # off by default, and said so explicitly to the workers
    clean_env.setenv(REPLAY_ENV, str(profile_file(vllm_env["root"])))
    clean_env.setenv(CONFIRM_ENV, "1")
    logging.getLogger("vllm_tfm").addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm_tfm"):
            cfg = build_tfm(vllm_env)
    finally:
        logging.getLogger("vllm_tfm").removeHandler(caplog.handler)
    assert any("ACCEPTANCE REPLAY" in r.getMessage() and "NOT the model's" in r.getMessage() for r in caplog.records)
    spec = get_acceptance_replay(pickle.loads(pickle.dumps(cfg)))  # what a worker process receives
    assert spec is not None and spec.entry == "ddtree B=7 T=0"
    assert spec.accepted_pmf == pytest.approx(resize_pmf(geometric_pmf(0.5, 10), 7))


# ------------------------------------------------------------------ the sampler with replay


@pytest.mark.parametrize("path", ["torch", "greedy_kernel"])
def test_tree_sampler_replays_spec_requests_after_the_real_verification(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory, path: str
) -> None:
    """The replay follows the real verification on both verification paths: the torch path (``verify_tree``) and
    the one-launch greedy kernel (here through the CPU emulation), where the replay makes its own tree batch."""
    pytest.importorskip("vllm")
    from contextlib import nullcontext

    from _emulation import emulated, emulation_build_dir

    from vllm_tfm.kernels import greedy_accept as kga
    from vllm_tfm.vllm_plugin.benchmark_mode import ReplaySpec
    from vllm_tfm.vllm_plugin.runtime import sampler as sampler_mod
    from vllm_tfm.vllm_plugin.runtime.inputs import build_step_tree
    from vllm_tfm.vllm_plugin.runtime.replay import AcceptanceReplayer
    from vllm_tfm.vllm_plugin.runtime.state import STATE, ProposalStore

    store = ProposalStore()
    # r0: root -> 1 -> 2, plus 3 under the root; r1: a chain of 3
    store.put(["r0", "r1"], torch.tensor([[5, 6, 7], [1, 2, 3]]), torch.tensor([[-1, 0, 1, 0], [-1, 0, 1, 2]]))
    spec = {"r0": [5, 6, 7], "r1": [1, 2, 3]}
    step = build_step_tree(["p", "r0", "r1"], np.array([4, 4, 4]), spec, store, allow_trees=True)
    STATE.step = step
    try:
        vocab = 10
        logits = torch.zeros(int(step.sample_cu[-1]), vocab)
        logits[:, 9] = 1.0  # the target's argmax is 9 everywhere: real verification accepts nothing
        calls = []
        real = sampler_mod.verify_tree
        monkeypatch.setattr(sampler_mod, "verify_tree", lambda *a, **k: calls.append(1) or real(*a, **k))
        replay = AcceptanceReplayer(ReplaySpec(profile="p", profile_source="s", measured=True, entry="tfm B=3 T=0",
                                               accepted_pmf=[0.0, 0.0, 1.0, 0.0], profile_mean_accepted_length=3.0,
                                               seed=0, spine_top1=None), "cpu")
        runner = SimpleNamespace(input_batch=SimpleNamespace(temperature_cpu=np.zeros(3, dtype=np.float32),
                                                             top_k_cpu=np.full(3, 100), top_p_cpu=np.ones(3, dtype=np.float32)))
        smd = sampling_metadata()
        md = SimpleNamespace(num_draft_tokens=list(step.num_draft), draft_token_ids=torch.tensor([5, 6, 7, 1, 2, 3]),
                             max_spec_len=3)
        context = nullcontext([])
        if path == "greedy_kernel":
            monkeypatch.setattr(kga, "unsupported_reason", lambda *a: None)
            context = emulated(emulation_build_dir(tmp_path_factory, "emu_replay_greedy"))
        with context as launches:
            out = sampler_mod.TFMTreeSampler(torch.nn.Identity(), runner, replay=replay)(md, None, logits, smd)
    finally:
        STATE.step = None
    # the real verification ran (its cost stays in the step): the torch path or the kernel
    assert (calls, [name for name, _, _ in launches]) == (([1], []) if path == "torch" else ([], ["tree_greedy_accept"]))
    ids = out.sampled_token_ids.tolist()
    assert ids[0][0] == 9 and ids[0][1:] == [-1, -1, -1]  # the prefill request: its own sampled token
    assert ids[1] == [5, 6, 9, -1]  # r0: A = 2 along the deepest path root -> 1 -> 2, bonus = argmax
    assert ids[2] == [1, 2, 9, -1]  # r1: A = 2 along the chain
    snap = replay.snapshot()
    assert snap["drawn_hist"] == [0, 0, 2, 0] and snap["realised_hist"] == [0, 0, 2, 0] and snap["clamped"] == 0
    assert snap["realised_mean_accepted_length"] == 3.0


# ------------------------------------------------------------------ stage timing


def test_disabled_timer_records_nothing_and_returns_one_shared_null_context() -> None:
    timer = StageTimer(enabled=False, use_cuda=False)
    a, b = timer.span("draft"), timer.span("commit")
    assert a is b
    with a:
        pass
    timer.note_batch(8, 100)
    got = timer.collect()
    assert got["stages"] == {} and got["steps"] == 0 and got["batch_requests"] is None


def test_enabled_timer_aggregates_by_stage_and_step() -> None:
    timer = StageTimer(enabled=True, use_cuda=False)
    for ms in (10.0, 12.0, 11.0, 30.0):
        timer.add("execute_model", ms)
        timer.add("target_forward", ms - 2.0)
    timer.add("commit", 1.0)
    timer.note_batch(1, 65)
    timer.note_batch(8, 520)
    with timer.span("draft"):
        pass  # CPU: wall time
    got = timer.collect(reset=True)
    assert got["steps"] == 4 and got["clock"] == "wall"
    fwd = got["stages"]["target_forward"]
    assert (fwd["count"], fwd["total_ms"], fwd["median_ms"], fwd["min_ms"], fwd["max_ms"]) == (4, 55.0, 9.5, 8.0, 28.0)
    assert fwd["per_step_ms"] == 55.0 / 4
    assert got["stages"]["commit"]["per_step_ms"] == 0.25
    assert got["stages"]["draft"]["count"] == 1
    assert got["batch_requests"] == {"max": 8, "mean": 4.5} and got["batch_tokens_mean"] == 292.5
    assert timer.collect()["stages"] == {}  # reset


def test_layer_spans_are_summed_per_step() -> None:
    """A per-layer stage runs many times per step: per_step_ms is its total over all steps of the
    run, per_step_sum the distribution of its per-step sums, count / median per layer call."""
    timer = StageTimer(enabled=True, use_cuda=False)
    timer.note_batch(1, 256)  # step 1: a prefill, no tree
    timer.add("execute_model", 30.0)
    timer.add("target_forward", 25.0)
    for layer_ms, attn_ms in (((1.0, 2.0, 3.0), 0.5), ((4.0, 4.0, 4.0), 1.5)):  # steps 2 and 3: 3 GDN, 1 attention layer
        timer.note_batch(1, 33)
        timer.add("execute_model", 50.0)
        timer.add("target_forward", 40.0)
        for ms in layer_ms:
            timer.add("gdn_tree", ms, host_ms=ms / 2)
        timer.add("attention_tree", attn_ms)
    got = timer.collect()
    assert got["steps"] == 3
    gdn = got["stages"]["gdn_tree"]
    assert (gdn["count"], gdn["median_ms"], gdn["max_ms"]) == (6, 3.5, 4.0)  # per layer call
    assert gdn["per_step_ms"] == 18.0 / 3 and gdn["host_per_step_ms"] == 9.0 / 3
    assert gdn["spans_per_step"] == 3.0
    per_step = gdn["per_step_sum"]  # the two tree steps: 1 + 2 + 3 and 4 * 3
    assert (per_step["count"], per_step["min_ms"], per_step["max_ms"], per_step["mean_ms"]) == (2, 6.0, 12.0, 9.0)
    attn = got["stages"]["attention_tree"]
    assert attn["spans_per_step"] == 1.0 and attn["per_step_ms"] == round(2.0 / 3, 4)
    fwd = got["stages"]["target_forward"]
    assert fwd["per_step_ms"] == 35.0 and fwd["per_step_sum"]["count"] == 3
    # per step, the nested stages subtract: rest of the forward = 35 - 6 - 2/3
    assert fwd["per_step_ms"] - gdn["per_step_ms"] - attn["per_step_ms"] == pytest.approx(35.0 - 6.0 - 2.0 / 3, abs=1e-4)
    assert "gdn_tree" in stage_timing.LAYER_STAGES and "attention_tree" in stage_timing.LAYER_STAGES


class FakeDevice:
    """A stream the test drives: events are reached when the test says so (``reached``), each record
    advances the device clock by 1 ms, and ``synchronize`` on an event not yet reached makes the host
    wait (counted) until the device has caught up with everything recorded."""

    def __init__(self) -> None:
        self.clock = 0.0
        self.seq = 0
        self.reached = 0
        self.waits = 0
        self.events = 0
        self.capturing = False

    def event_class(self) -> type:
        dev = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                assert enable_timing
                dev.events += 1

            def record(self) -> None:
                dev.seq += 1
                self.seq, self.t = dev.seq, dev.clock
                dev.clock += 1.0

            def query(self) -> bool:
                return self.seq <= dev.reached

            def synchronize(self) -> None:
                if self.seq > dev.reached:
                    dev.waits += 1
                    dev.reached = dev.seq

            def elapsed_time(self, end: Any) -> float:
                assert self.seq <= dev.reached and end.seq <= dev.reached, "elapsed_time of an event not yet reached"
                return end.t - self.t

        return Event


@pytest.fixture()
def fake_device(monkeypatch: pytest.MonkeyPatch) -> FakeDevice:
    dev = FakeDevice()
    monkeypatch.setattr(torch.cuda, "Event", dev.event_class())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: dev.capturing)
    return dev


def test_event_spans_drain_without_waiting_and_stay_bounded(fake_device: FakeDevice,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(stage_timing, "DRAIN_EVERY", 4)
    monkeypatch.setattr(stage_timing, "MAX_PENDING", 8)
    timer = StageTimer(enabled=True, use_cuda=True)
    timer.note_batch(1, 33)
    for _ in range(4):
        with timer.span("gdn_tree"):
            pass
    assert len(timer._pending) == 4 and fake_device.waits == 0  # nothing reached yet: nothing resolved, no wait
    fake_device.reached = 4  # the device is past the first two spans (events 1..4)
    with timer.span("gdn_tree"):
        pass
    assert len(timer._pending) == 3 and fake_device.waits == 0  # the two reached spans resolved without waiting
    timer.note_batch(1, 33)  # step 2: earlier spans keep their step
    peak = 0
    for _ in range(5):
        with timer.span("gdn_tree"):
            pass
        peak = max(peak, len(timer._pending))
    assert peak < 8 and fake_device.waits == 1 and timer._pending == []  # MAX_PENDING: the host waited once
    with timer.span("gdn_layer"), timer.span("gdn_tree"):  # nesting: the outer pair spans the inner one
        pass
    fake_device.capturing = True
    events = fake_device.events
    with timer.span("gdn_tree"):  # inside a CUDA-graph capture: no events, nothing recorded
        pass
    assert fake_device.events == events
    got = timer.collect()
    gdn = got["stages"]["gdn_tree"]
    assert gdn["count"] == 11 and gdn["min_ms"] == gdn["max_ms"] == 1.0  # each pair: start record, end record
    assert got["stages"]["gdn_layer"]["total_ms"] == 3.0
    per_step = gdn["per_step_sum"]  # step 1: 5 spans, step 2: 5 + the nested one
    assert (per_step["count"], per_step["min_ms"], per_step["max_ms"]) == (2, 5.0, 6.0) and gdn["spans_per_step"] == 5.5
    assert got["clock"] == "cuda_events" and got["timer_host_ms_per_step"] is None  # no execute_model spans here


def test_disabled_timer_inside_a_step_creates_no_events(fake_device: FakeDevice) -> None:
    timer = StageTimer(enabled=False, use_cuda=True)
    timer.note_batch(1, 33)
    for name in stage_timing.LAYER_STAGES:
        with timer.span(name):
            pass
    assert fake_device.events == 0 and timer.collect()["stages"] == {}


def test_summarize_quantiles_by_hand() -> None:
    s = summarize([float(x) for x in range(1, 12)])  # 1..11
    assert (s["median_ms"], s["p10_ms"], s["p90_ms"], s["mean_ms"]) == (6.0, 2.0, 10.0, 6.0)


def test_profile_hooks_are_installed_only_when_profiling(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_tfm.vllm_plugin import patching
    from vllm_tfm.vllm_plugin.runtime import hooks
    from vllm_tfm.vllm_plugin.runtime.stage_timing import (
        TIMER,
        collect_stage_timings,
        set_stage_timing,
    )

    keys = {f"{GPUModelRunner.__module__}.GPUModelRunner.{n}" for n in hooks.PROFILE_HOOKS}
    monkeypatch.setattr(TIMER, "enabled", False)
    assert hooks.install_profile_hooks() is False
    assert not keys & set(patching.installed_patches())
    monkeypatch.setattr(TIMER, "enabled", True)
    try:
        assert hooks.install_profile_hooks() is True
        assert keys <= set(patching.installed_patches())
        assert GPUModelRunner.__dict__["_model_forward"].__wrapped__ is patching.original(GPUModelRunner, "_model_forward")
        set_stage_timing(None, reset=True)
        wrapped = hooks._wrap_model_forward(lambda self, x: x + 1)
        assert wrapped(object(), 41) == 42
        got = collect_stage_timings(None, reset=True)  # the collective_rpc signature: worker first
        assert got["stages"]["target_forward"]["count"] == 1
    finally:
        patching.restore(keys)
    assert not keys & set(patching.installed_patches())


def test_results_are_json(tmp_path: Path) -> None:
    from vllm_tfm.vllm_plugin.runtime.stage_timing import dump_stage_timings

    data = dump_stage_timings(tmp_path / "t.json")
    assert json.loads((tmp_path / "t.json").read_text()) == data
