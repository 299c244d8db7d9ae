"""bench/host_spans.py: nested wall-clock spans on live engine objects (benchmark-only)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import host_spans


class _FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class _Runner:
    def __init__(self, clock: _FakeClock) -> None:
        self.clock = clock

    def execute_model(self) -> str:
        self.clock.t += 1.0
        self._prepare_inputs()
        self.clock.t += 0.5
        self._prepare_inputs()
        return "out"

    def _prepare_inputs(self) -> None:
        self.clock.t += 2.0


def test_nested_spans_split_inclusive_and_exclusive_time() -> None:
    fake = _FakeClock()
    clock = host_spans.SpanClock(clock=fake)
    runner = _Runner(fake)
    installed = host_spans.install(clock, {"runner": runner}, {"runner": ("execute_model", "_prepare_inputs", "absent")})
    assert [n for _, n in installed] == ["execute_model", "_prepare_inputs"]
    assert runner.execute_model() == "out"
    fake.t += 3.0  # outside every span
    rep = clock.report(steps=1, wall_s=fake.t)
    spans = rep["spans"]
    assert spans["runner.execute_model"] == {"calls_per_step": 1.0, "inclusive_ms_per_step": 5500.0,
                                             "exclusive_ms_per_step": 1500.0}
    assert spans["runner._prepare_inputs"] == {"calls_per_step": 2.0, "inclusive_ms_per_step": 4000.0,
                                               "exclusive_ms_per_step": 4000.0}
    assert rep["untimed_ms_per_step"] == 3000.0
    assert list(spans) == ["runner._prepare_inputs", "runner.execute_model"]  # by exclusive time


def test_uninstall_restores_the_class_methods_and_double_install_is_refused() -> None:
    fake = _FakeClock()
    clock = host_spans.SpanClock(clock=fake)
    runner = _Runner(fake)
    installed = host_spans.install(clock, {"runner": runner}, {"runner": ("execute_model",)})
    with pytest.raises(RuntimeError, match="already an instance attribute"):
        host_spans.install(clock, {"runner": runner}, {"runner": ("execute_model",)})
    host_spans.uninstall(installed)
    assert "execute_model" not in vars(runner)
    runner.execute_model()
    assert clock.stats == {}


def test_a_raising_method_still_closes_its_span() -> None:
    fake = _FakeClock()
    clock = host_spans.SpanClock(clock=fake)

    class Boom:
        def run(self) -> None:
            fake.t += 1.0
            raise ValueError("boom")

    obj = Boom()
    host_spans.install(clock, {"drafter": obj}, {"drafter": ("run",)})
    with pytest.raises(ValueError, match="boom"):
        obj.run()
    assert clock.stats["drafter.run"].inclusive_s == 1.0
    assert clock.top_level_s == 1.0


def test_engine_objects_walks_an_in_process_engine() -> None:
    class O:
        pass

    llm, engine, client, core, executor, driver, worker, runner, drafter = (O() for _ in range(9))
    llm.llm_engine, engine.engine_core, client.engine_core = engine, client, core
    core.scheduler, core.model_executor = "sched", executor
    executor.driver_worker, driver.worker, worker.model_runner = driver, worker, runner
    runner.drafter, drafter._weaver_graphs = drafter, "graphs"
    engine.output_processor = "outproc"
    found = host_spans.engine_objects(llm)
    assert found == {"engine_core": core, "scheduler": "sched", "runner": runner, "drafter": drafter,
                     "weaver_graphs": "graphs", "output_processor": "outproc"}


def test_every_target_method_exists_in_the_pinned_vllm() -> None:
    """A renamed vLLM method would silently drop out of the spans: the names are checked here."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.engine.core import EngineCore
    from vllm.v1.engine.output_processor import OutputProcessor
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_tfm.vllm_plugin.runtime.proposer import TFMProposer
    from vllm_tfm.vllm_plugin.runtime.weaver_graphs import WeaverGraphs

    classes = {"engine_core": EngineCore, "scheduler": Scheduler, "output_processor": OutputProcessor,
               "runner": GPUModelRunner, "drafter": TFMProposer, "weaver_graphs": WeaverGraphs}
    assert set(classes) == set(host_spans.TARGETS)
    missing = [f"{key}.{name}" for key, names in host_spans.TARGETS.items() for name in names
               if not callable(getattr(classes[key], name, None))]
    assert missing == []


def test_attribute_spans_patch_and_restore_static_and_plain_methods() -> None:
    import types

    fake = _FakeClock()
    clock = host_spans.SpanClock(clock=fake)
    mod = types.ModuleType("fake_mod_for_spans")

    class Plan:
        @staticmethod
        def build(n: int) -> int:
            fake.t += 1.0
            return n + 1

        def size(self) -> int:
            fake.t += 2.0
            return 7

    def helper() -> str:
        fake.t += 0.5
        return "h"

    class SubPlan(Plan):
        pass

    mod.Plan, mod.SubPlan, mod.helper = Plan, SubPlan, helper
    sys.modules["fake_mod_for_spans"] = mod
    size_fn, build_fn = vars(Plan)["size"], vars(Plan)["build"]
    try:
        saved, missing = host_spans.install_attrs(
            clock, [("fake_mod_for_spans", "Plan", "build"), ("fake_mod_for_spans", "Plan", "size"),
                    ("fake_mod_for_spans", None, "helper"), ("fake_mod_for_spans", "Plan", "absent"),
                    ("fake_mod_for_spans", "SubPlan", "size"),
                    ("no_such_module_xyz", None, "f")])
        assert missing == ["Plan.absent", "no_such_module_xyz.f"]
        assert Plan.build(1) == 2 and Plan().size() == 7 and mod.helper() == "h"
        assert SubPlan().size() == 7  # the subclass's shadow wraps the (already timed) base method
        assert {k: v.inclusive_s for k, v in clock.stats.items()} == {"Plan.build": 1.0, "Plan.size": 4.0,
                                                                      "fake_mod_for_spans.helper": 0.5,
                                                                      "SubPlan.size": 2.0}
        host_spans.uninstall_attrs(saved)
        assert vars(Plan)["build"] is build_fn and vars(Plan)["size"] is size_fn and mod.helper is helper
        assert "size" not in vars(SubPlan)  # the inherited method's shadow is gone
        Plan.build(1)
        assert clock.stats["Plan.build"].count == 1  # restored: no longer timed
    finally:
        del sys.modules["fake_mod_for_spans"]


def test_every_attribute_target_exists() -> None:
    clock = host_spans.SpanClock()
    saved, missing = host_spans.install_attrs(clock)
    host_spans.uninstall_attrs(saved)
    assert missing == []
    assert len(saved) == len(host_spans.ATTR_TARGETS)


def test_gc_clock_times_real_collections_by_generation() -> None:
    import gc

    fake = _FakeClock()
    clock = host_spans.GcClock(clock=fake)
    clock("start", {"generation": 2})
    fake.t += 0.25
    clock("stop", {"generation": 2})
    assert clock.report(steps=2) == {"ms_per_step": 125.0, "by_generation": {"2": {"collections": 1, "ms_total": 250.0}}}
    real = host_spans.GcClock()
    real.install()
    real.install()  # once only
    try:
        assert gc.callbacks.count(real) == 1
        gc.collect()
    finally:
        real.uninstall()
    assert real not in gc.callbacks
    assert real.counts.get(2) == 1 and real.seconds[2] >= 0.0


def test_marked_spans_record_a_stamp_at_entry_and_exit_in_order() -> None:
    fake = _FakeClock()
    stamps = iter(range(100))
    clock = host_spans.SpanClock(clock=fake, marker=lambda: next(stamps),
                                 marked=frozenset({"runner.execute_model", "runner._prepare_inputs"}))
    runner = _Runner(fake)
    host_spans.install(clock, {"runner": runner}, {"runner": ("execute_model", "_prepare_inputs")})
    runner.execute_model()
    assert clock.marks == [("runner.execute_model", "start", 0.0, 0), ("runner._prepare_inputs", "start", 1.0, 1),
                           ("runner._prepare_inputs", "end", 3.0, 2), ("runner._prepare_inputs", "start", 3.5, 3),
                           ("runner._prepare_inputs", "end", 5.5, 4), ("runner.execute_model", "end", 5.5, 5)]
    unmarked = host_spans.SpanClock(clock=fake, marker=lambda: 1 / 0, marked=frozenset({"other"}))
    host_spans.install(unmarked, {"runner": _Runner(fake)}, {"runner": ("execute_model",)})  # marker never called


def test_step_timeline_puts_host_and_gpu_on_one_clock_per_step() -> None:
    # Three steps of 10 ms each from host time 1.000 s; the base stamp was recorded at host 0.5 s (GPU ms 0).
    # In each step the host launches the forward at +2 ms; the GPU reaches it at +6 ms in step 2, +4 ms otherwise;
    # the sync is entered twice in the middle step only (a point in 1 of 3 steps is left out).
    marks = []
    for i, gpu_fwd in enumerate((4.0, 6.0, 4.0)):
        t0 = 1.0 + 0.01 * i
        marks.append(("runner.execute_model", "start", t0, ("gpu", 500.0 + 1e3 * (t0 - 1.0) + 1.0)))
        marks.append(("runner._model_forward", "start", t0 + 0.002, ("gpu", 500.0 + 1e3 * (t0 - 1.0) + gpu_fwd)))
        marks.append(("runner._model_forward", "end", t0 + 0.003, ("gpu", 500.0 + 1e3 * (t0 - 1.0) + gpu_fwd)))
        marks.append(("runner._model_forward", "end", t0 + 0.004, ("gpu", 500.0 + 1e3 * (t0 - 1.0) + 9.0)))
        if i == 1:
            marks.append(("runner._bookkeeping_sync", "start", t0 + 0.005, ("gpu", 0.0)))
    out = host_spans.step_timeline(marks, 0.5, ("gpu", 0.0), lambda a, b: b[1] - a[1], skip_steps=0)
    assert out["steps"] == 3 and out["skipped_steps"] == 0 and out["step_ms"] == pytest.approx(10.0)
    rows = {r["point"]: r for r in out["points"]}
    assert set(rows) == {"runner.execute_model:start", "runner._model_forward:start", "runner._model_forward:end",
                         "runner._model_forward:end#2"}
    assert rows["runner.execute_model:start"] == {"point": "runner.execute_model:start", "host_ms": 0.0,
                                                  "gpu_ms": 1.0, "gpu_behind_ms": 1.0, "steps": 3}
    assert rows["runner._model_forward:start"]["host_ms"] == pytest.approx(2.0)
    assert rows["runner._model_forward:start"]["gpu_ms"] == pytest.approx(4.0)  # the median of 4, 6, 4
    assert rows["runner._model_forward:start"]["gpu_behind_ms"] == pytest.approx(2.0)
    assert rows["runner._model_forward:end#2"]["gpu_behind_ms"] == pytest.approx(5.0)
    assert [r["point"] for r in out["points"]][0] == "runner.execute_model:start"  # by host time
    assert host_spans.step_timeline(marks, 0.5, ("gpu", 0.0), lambda a, b: b[1] - a[1], skip_steps=2)["steps"] == 1


def test_graph_wrapper_calls_are_labelled_by_what_they_did_and_for_whom(monkeypatch: pytest.MonkeyPatch) -> None:
    import enum
    import types

    import vllm.forward_context as fc

    class Mode(enum.Enum):
        FULL = 1
        PIECEWISE = 2

    step_mode = {"mode": Mode.FULL}
    monkeypatch.setattr(fc, "is_forward_context_available", lambda: True)
    monkeypatch.setattr(fc, "get_forward_context", lambda: types.SimpleNamespace(cudagraph_runtime_mode=step_mode["mode"]))
    fake = _FakeClock()
    clock = host_spans.SpanClock(clock=fake)
    mod = types.ModuleType("fake_graph_mod")

    class CUDAGraphWrapper:
        def __init__(self, mode: Mode) -> None:
            self.runtime_mode = mode

        def __call__(self) -> str:
            fake.t += 1.0
            return "y"

    mod.CUDAGraphWrapper = CUDAGraphWrapper
    sys.modules["fake_graph_mod"] = mod
    try:
        saved, missing = host_spans.install_attrs(clock, [("fake_graph_mod", "CUDAGraphWrapper", "__call__")])
        assert missing == []

        class Caller:
            def _prepare_inputs(self) -> str:
                return CUDAGraphWrapper(Mode.FULL)()

        runner = Caller()
        host_spans.install(clock, {"runner": runner}, {"runner": ("_prepare_inputs",)})
        runner._prepare_inputs()
        step_mode["mode"] = Mode.PIECEWISE
        runner._prepare_inputs()
        assert CUDAGraphWrapper(Mode.PIECEWISE)() == "y"
        monkeypatch.setattr(fc, "is_forward_context_available", lambda: False)
        CUDAGraphWrapper(Mode.FULL)()
        host_spans.uninstall_attrs(saved)
    finally:
        del sys.modules["fake_graph_mod"]
    assert {k: v.count for k, v in clock.stats.items() if k.startswith("CUDAGraphWrapper")} == {
        "CUDAGraphWrapper.__call__[FULL replay < runner._prepare_inputs]": 1,
        "CUDAGraphWrapper.__call__[FULL run:PIECEWISE < runner._prepare_inputs]": 1,
        "CUDAGraphWrapper.__call__[PIECEWISE replay < -]": 1,
        "CUDAGraphWrapper.__call__[FULL run:no-context < -]": 1,
    }
