"""bench/kernel_trace.py: GPU activities attributed to the stage whose host range launched them,
per-step sums, categories, busy time; and the stage timer's annotated spans in a real CPU trace."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import kernel_trace  # noqa: E402

from vllm_tfm.vllm_plugin.runtime import stage_timing  # noqa: E402


def _range(name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": f"tfm:{name}", "ts": ts, "dur": dur, "pid": 7, "tid": tid}


def _launch(corr: int, ts: float, name: str = "cudaLaunchKernel", cat: str = "cuda_runtime", tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": 2.0, "pid": 7, "tid": tid,
            "args": {"correlation": corr}}


def _kernel(name: str, corr: int | None, ts: float, dur: float, cat: str = "kernel") -> dict:
    args = {} if corr is None else {"correlation": corr}
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7, "args": args}


def _two_steps() -> list[dict]:
    ev: list[dict] = []
    for step, t0 in enumerate((0.0, 1000.0)):
        c = 100 * (step + 1)
        ev += [
            _range("execute_model", t0, 500.0),
            _range("target_forward", t0 + 10.0, 300.0),
            _range("sample_tokens", t0 + 600.0, 300.0),
            _range("propose", t0 + 650.0, 200.0),
            _range("tree_build", t0 + 700.0, 100.0),
            # the forward: one graph launch, three kernels with its correlation id
            _launch(c + 1, t0 + 20.0, "cudaGraphLaunch"),
            _kernel("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", c + 1, t0 + 30.0, 40.0),
            _kernel("gdn_tree_verify_grouped", c + 1, t0 + 70.0, 10.0),
            _kernel("kernel_unified_attention_2d", c + 1, t0 + 80.0, 20.0),
            # launched in execute_model but outside target_forward
            _launch(c + 2, t0 + 400.0, "cudaMemcpyAsync"),
            _kernel("Memcpy HtoD (Pageable -> Device)", c + 2, t0 + 405.0, 5.0, cat="gpu_memcpy"),
            # propose, outside tree_build; then an NVRTC launch (driver API) inside tree_build
            _launch(c + 3, t0 + 660.0),
            _kernel("triton_poi_fused_add_0", c + 3, t0 + 665.0, 6.0),
            _launch(c + 4, t0 + 710.0, "cuLaunchKernelEx", cat="cuda_driver"),
            _kernel("weaver_linear_bf16", c + 4, t0 + 715.0, 8.0),
            # a launch outside every range, and an activity whose launch is not in the trace
            _launch(c + 5, t0 + 950.0),
            _kernel("elementwise_kernel", c + 5, t0 + 955.0, 4.0),
            _kernel("mystery", c + 9, t0 + 960.0, 1.0),
        ]
    # an overlapping kernel (another stream) inside step 1's forward: busy time counts the union
    ev += [_launch(999, 25.0, "cudaLaunchKernel"), _kernel("rms_norm_kernel", 999, 35.0, 10.0)]
    # instant and flow events are ignored
    ev += [{"ph": "s", "cat": "ac2g", "name": "flow", "ts": 1.0, "id": 3}, {"ph": "i", "name": "x", "ts": 2.0}]
    return ev


def test_activities_go_to_the_innermost_range_of_their_launch() -> None:
    acts, steps = kernel_trace.attribute(_two_steps())
    assert steps == 2
    stage = {a["name"]: a["stage"] for a in acts}
    assert stage["nvjet_tst_64x8_64x16_4x1_v_bz_TNT"] == "target_forward"
    assert stage["gdn_tree_verify_grouped"] == "target_forward"  # every kernel of the graph launch
    assert stage["Memcpy HtoD (Pageable -> Device)"] == "execute_model"
    assert stage["triton_poi_fused_add_0"] == "propose"
    assert stage["weaver_linear_bf16"] == "tree_build"  # driver-API launch
    assert stage["elementwise_kernel"] == "none"
    assert stage["mystery"] == "unattributed"
    assert stage["rms_norm_kernel"] == "target_forward"


def test_summary_per_step_sums_categories_and_busy_time() -> None:
    s = kernel_trace.summarize(_two_steps())
    assert s["steps"] == 2
    fwd = s["stages"]["target_forward"]
    # (40 + 10 + 20) per step plus one 10 us kernel in one of the two steps
    assert fwd["us_per_step"] == pytest.approx(75.0)
    assert fwd["activities_per_step"] == pytest.approx(3.5)
    assert fwd["categories_us_per_step"] == {"gemm": 40.0, "attention": 20.0, "tfm_gdn_verify": 10.0, "norm": 5.0}
    assert [k["name"] for k in fwd["top"]][:2] == ["nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "kernel_unified_attention_2d"]
    assert s["stages"]["execute_model"]["categories_us_per_step"] == {"memcpy": 5.0}
    assert s["stages"]["tree_build"]["top"][0]["category"] == "tfm_weaver"
    per_step = (40 + 10 + 20 + 5 + 6 + 8 + 4 + 1)
    assert s["gpu_us_per_step"] == pytest.approx(per_step + 5.0)
    # the 10 us norm kernel at 35..45 overlaps the GEMM at 30..70: busy time counts it once
    assert s["busy_us_per_step"] == pytest.approx(per_step)
    first, last = 30.0, 1000.0 + 960.0 + 1.0
    assert s["wall_us_per_step"] == pytest.approx((last - first) / 2)
    assert s["busy_fraction"] == pytest.approx(2 * per_step / (last - first), abs=1e-4)
    # stages listed by GPU time, largest first
    totals = [v["us_per_step"] for v in s["stages"].values()]
    assert totals == sorted(totals, reverse=True)


def test_categories_of_known_kernel_names() -> None:
    cases = {
        "gdn_tree_verify_grouped": "tfm_gdn_verify",
        "gdn_tree_commit_layers": "tfm_gdn_commit",
        "weaver_attention_round": "tfm_weaver",
        "candidate_scores": "tfm_weaver",
        "nvjet_tst_128x8_64x12_2x1_v_bz_splitK_TNT": "gemm",
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8>(...)": "gemm",
        "fused_recurrent_gated_delta_rule_fwd_kernel": "gdn_vllm",
        "_causal_conv1d_update_kernel": "conv1d",
        "kernel_unified_attention_2d": "attention",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "norm",
        "triton_poi_fused_mul_silu_0": "activation",
        "void at::native::vectorized_elementwise_kernel<4, ...>": "elementwise",
        "something_else": "other",
    }
    assert {n: kernel_trace.category(n) for n in cases} == cases


def test_empty_trace_and_gzip_round_trip(tmp_path: Path) -> None:
    assert kernel_trace.summarize([]) == {"steps": 0, "skip_steps": 0, "activities": 0, "stages": {}}
    p = tmp_path / "t.json.gz"
    with gzip.open(p, "wt") as f:
        json.dump({"traceEvents": _two_steps()}, f)
    assert kernel_trace.summarize(kernel_trace.load_trace(p)) == kernel_trace.summarize(_two_steps())


def test_annotated_spans_appear_as_ranges_in_a_real_profiler_trace(tmp_path: Path) -> None:
    """The stage timer's spans, annotated, are the ranges kernel_trace reads (CPU trace: no kernels)."""
    timer = stage_timing.StageTimer(enabled=True, use_cuda=False)
    timer.annotate = True
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            timer.note_batch(1, 1)
            with timer.span("execute_model"), timer.span("target_forward"):
                torch.ones(4).add_(1)
        with timer.span("propose"):
            pass
    prof.export_chrome_trace(str(tmp_path / "t.json"))
    events = kernel_trace.load_trace(tmp_path / "t.json")
    names = [e["name"] for e in events if e.get("cat") == "user_annotation"]
    assert names.count("tfm:execute_model") == 3 and names.count("tfm:target_forward") == 3
    assert names.count("tfm:propose") == 1
    _, steps = kernel_trace.attribute(events)
    assert steps == 3
    assert timer.collect()["steps"] == 3  # the timing itself still records
    timer.annotate = False
    with profile(activities=[ProfilerActivity.CPU]) as prof2:
        with timer.span("execute_model"):
            pass
    prof2.export_chrome_trace(str(tmp_path / "u.json"))
    assert not [e for e in kernel_trace.load_trace(tmp_path / "u.json") if e.get("cat") == "user_annotation"]


def test_set_stage_timing_switches_annotation() -> None:
    saved = (stage_timing.TIMER.enabled, stage_timing.TIMER.annotate)
    try:
        stage_timing.set_stage_timing(enabled=True, annotate=True)
        assert stage_timing.TIMER.annotate
        stage_timing.set_stage_timing(annotate=False)
        assert not stage_timing.TIMER.annotate and stage_timing.TIMER.enabled
    finally:
        stage_timing.TIMER.enabled, stage_timing.TIMER.annotate = saved
    assert kernel_trace.ANNOTATION_PREFIX == stage_timing.ANNOTATION_PREFIX


def _op(name: str, ts: float, dur: float, cat: str = "cpu_op", tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 7, "tid": tid}


def test_host_summary_own_times_coverage_and_self_times() -> None:
    ev: list[dict] = []
    for t0 in (0.0, 1000.0):
        ev += [
            _range("execute_model", t0, 500.0),
            _range("target_forward", t0 + 100.0, 200.0),
            _op("aten::index", t0 + 10.0, 50.0),           # top level in execute_model
            _op("aten::copy_", t0 + 20.0, 20.0),           # nested in aten::index
            _op("cudaMemcpyAsync", t0 + 25.0, 10.0, cat="cuda_runtime"),  # nested in aten::copy_
            _op("cudaGraphLaunch", t0 + 110.0, 30.0, cat="cuda_runtime"),  # top level in target_forward
            _op("aten::add", t0 + 600.0, 5.0),             # outside every range
        ]
    ev.append(_range("unrelated", 0.0, 1.0) | {"name": "not_tfm"})  # other annotations are ignored
    h = kernel_trace.host_summary(ev)
    assert h["steps"] == 2
    st = h["stages"]
    assert st["execute_model"]["own_us_per_step"] == pytest.approx(300.0)  # 500 minus the forward's 200
    assert st["target_forward"]["own_us_per_step"] == pytest.approx(200.0)
    assert st["execute_model"]["calls_us_per_step"] == pytest.approx(50.0)  # only the top-level call
    assert st["target_forward"]["calls_us_per_step"] == pytest.approx(30.0)
    selfs = {k["name"]: k["us_per_step"] for k in st["execute_model"]["top_self"]}
    assert selfs == {"aten::index": 30.0, "aten::copy_": 10.0, "cudaMemcpyAsync": 10.0}
    assert st["none"]["calls_us_per_step"] == pytest.approx(5.0)
    assert st["none"]["own_us_per_step"] is None
