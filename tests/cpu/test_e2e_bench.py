"""bench/e2e.py and its helpers on CPU: the 27B-shaped configs (exact shapes, layer pattern and
parameter count from an independent hand count), the engine configs vLLM 0.26 must accept, the
arm planning under the deadline, and the markdown tables of a results file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import e2e  # noqa: E402
import e2e_models  # noqa: E402
import e2e_report  # noqa: E402

from vllm_tfm.verify.acceptance_profile import (  # noqa: E402
    builtin_geometric_profile,
    geometric_pmf,
    mean_accepted_length,
    resize_pmf,
    synthetic_acceptance_rates,
)

# ------------------------------------------------------------------ the 27B shape


def hand_count_qwen36_27b() -> int:
    """Parameters of the Qwen3.6-27B text decoder, counted from its published dimensions."""
    d, v, inter = 5120, 248_320, 17_408
    # Gated DeltaNet: qkv (2 x 16 key heads + 48 value heads, of 128), z gate, a and b (one per value
    # head), depthwise conv over the qkv channels (width 4, no bias), A_log, dt_bias, gated RMSNorm
    # over a head (128), output projection from 48 x 128
    qkv = 2 * 16 * 128 + 48 * 128
    gdn = d * qkv + d * 48 * 128 + 2 * d * 48 + qkv * 4 + 48 + 48 + 128 + 48 * 128 * d
    # gated attention: q and its output gate (2 x 24 heads of 256), k and v (4 heads of 256), o,
    # per-head q / k RMSNorm
    attn = d * 2 * 24 * 256 + 2 * d * 4 * 256 + 24 * 256 * d + 2 * 256
    mlp = 3 * d * inter
    norms = 2 * d
    return 48 * (gdn + mlp + norms) + 16 * (attn + mlp + norms) + 2 * v * d + d


def test_target_config_has_the_27b_shape_and_parameter_count(tmp_path: Path) -> None:
    from transformers import AutoConfig, Qwen3_5ForCausalLM

    cfg = AutoConfig.from_pretrained(e2e_models.write_target(tmp_path / "t"))
    assert cfg.architectures == ["Qwen3_5ForCausalLM"]
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size) == (64, 5120, 248_320, 17_408)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim) == (16, 48, 128, 128)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (24, 4, 256)
    assert cfg.layer_types == (["linear_attention"] * 3 + ["full_attention"]) * 16
    assert cfg.mamba_ssm_dtype == "float32" and not cfg.tie_word_embeddings
    assert cfg.rope_parameters["rope_theta"] == 1e7 and cfg.rope_parameters["partial_rotary_factor"] == 0.25
    with torch.device("meta"):
        model = Qwen3_5ForCausalLM(cfg)
    assert sum(p.numel() for p in model.parameters()) == hand_count_qwen36_27b() == 26_895_998_464
    gdn = model.model.layers[0].linear_attn
    assert tuple(gdn.conv1d.weight.shape) == (10240, 1, 4) and tuple(gdn.out_proj.weight.shape) == (5120, 6144)


def test_drafter_matches_the_target_and_the_weaver_width(tmp_path: Path) -> None:
    from vllm_tfm.models.dflash import DFlashConfig
    from vllm_tfm.models.tfm_config import TfmConfig
    from vllm_tfm.vllm_plugin.drafter_checks import (
        check_drafter_against_target,
        check_weaver_shape,
    )

    d = e2e_models.write_drafter(tmp_path / "d", weaver=False)
    raw = json.loads((d / "config.json").read_text())
    block = check_drafter_against_target(raw, "config.json", target_vocab_size=248_320, target_hidden_size=5120,
                                         target_num_layers=64)
    assert block == 16
    cfg = DFlashConfig.from_dict(raw)
    assert (cfg.num_hidden_layers, cfg.fc_in_features, cfg.mask_token_id) == (5, 5 * 5120, 248_070)
    check_weaver_shape(TfmConfig.model_validate({"weaver": {"d_model": 5120, "max_depth": 15}}), "t", 5120, 15)


def test_gdn_state_bytes_by_hand() -> None:
    ssm = 48 * 128 * 128 * 4
    conv = 10240 * 2
    assert e2e_models.gdn_state_bytes_per_request(0) == 48 * (ssm + 3 * conv)
    assert e2e_models.gdn_state_bytes_per_request(64) == 48 * 65 * (ssm + 67 * conv)
    # one slot per request (gdn_state_slots "one"): vLLM's shapes, one of them; 0.158 GiB at B = 16
    assert e2e_models.gdn_state_bytes_per_request(16, one_slot=True) == 48 * (ssm + 19 * conv) == 169_672_704


# ------------------------------------------------------------------ engine configs through vLLM


@pytest.fixture(scope="module")
def big(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from _vllm_plugin_env import vllm_cpu_session, write_placeholder_safetensors

    root = tmp_path_factory.mktemp("e2e27")
    with vllm_cpu_session(root / "vllm-cache"):
        target = e2e_models.write_target(root / "target")
        drafter = e2e_models.write_drafter(root / "drafter", weaver=False)
        (drafter / "tfm_config.json").write_text(json.dumps({"proposal": "tfm", "weaver": {"d_model": 5120, "max_depth": 15}}))
        write_placeholder_safetensors(drafter / "tfm" / "weaver.safetensors")  # presence is what the config checks
        yield {"root": root, "target": str(target), "drafter": str(drafter)}


def settings(big: Any) -> dict[str, Any]:
    return {"target": big["target"], "drafter": big["drafter"], "seed": 0, "gpu_memory_utilization": 0.9,
            "max_model_len": 704, "batches": [1, 8], "max_num_batched_tokens": 4096}


def spec_config(kw: dict[str, Any]) -> Any:
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(**kw)
    return args.create_speculative_config(args.create_model_config(), ParallelConfig())


def test_dflash_arm_config_is_vllms_synthetic_chain(big: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    prof = builtin_geometric_profile(temperatures=(1.0,))
    plan = e2e.arm_profile(e2e.ARMS["dflash"], prof, 1.0, 15)
    kw = e2e.engine_kwargs(e2e.ARMS["dflash"], settings(big), plan)
    cfg = spec_config(kw)
    assert cfg.method == "dflash" and cfg.num_speculative_tokens == 15
    assert cfg.rejection_sample_method == "synthetic"
    assert cfg.synthetic_acceptance_rates == synthetic_acceptance_rates(geometric_pmf(0.75, 15), 15)
    assert plan["mal"] == pytest.approx(mean_accepted_length(geometric_pmf(0.75, 15)))


def replay_env(arm: Any, prof: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, Any]:
    """The arm's plan at T = 1, its profile entry saved and the child's VLLM_TFM_* environment set, as the
    e2e driver does for an arm's engine process."""
    from vllm_tfm.verify.acceptance_profile import AcceptanceProfile, save_profile

    plan = e2e.arm_profile(arm, prof, 1.0, 15)
    save_profile(AcceptanceProfile(source=prof.source, measured=False, entries=[plan["entry"]]), tmp_path / "p.json")
    for k, v in e2e.child_env(arm, {"seed": 3}, tmp_path).items():
        if k.startswith("VLLM_TFM_"):
            monkeypatch.setenv(k, v)
    monkeypatch.setenv("VLLM_TFM_BENCHMARK_ACCEPTANCE_REPLAY", str(tmp_path / "p.json"))
    return plan


def test_tfm_arm_config_replays_its_profile_entry(big: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from vllm_tfm.vllm_plugin.benchmark_mode import get_acceptance_replay
    from vllm_tfm.vllm_plugin.options import get_tfm_options

    prof = builtin_geometric_profile(temperatures=(1.0,))
    arm = e2e.ARMS["tfm64"]
    plan = replay_env(arm, prof, monkeypatch, tmp_path)
    cfg = spec_config(e2e.engine_kwargs(arm, settings(big), plan))
    assert cfg.method == "tfm" and cfg.num_speculative_tokens == 64
    assert get_tfm_options(cfg).proposal == "tfm"
    replay = get_acceptance_replay(cfg)
    assert replay is not None and replay.entry == "tfm B=64 T=1" and replay.seed == 3 and not replay.measured
    assert replay.accepted_pmf == pytest.approx(resize_pmf(geometric_pmf(0.87, 15), 15))
    assert plan["mal"] == pytest.approx(replay.mean_accepted_length)
    monkeypatch.delenv("VLLM_TFM_I_AM_BENCHMARKING")
    with pytest.raises(ValueError, match="set VLLM_TFM_I_AM_BENCHMARKING=1 to run it"):
        spec_config(e2e.engine_kwargs(arm, settings(big), plan))


def test_fp8_drafter_arm_quantizes_the_drafter_only(big: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The fp8draft arm is its base arm with vLLM's own ``quantization`` key in the speculative config: the
    drafter's model config carries fp8, the target's none; the base arm's drafter carries none."""
    from vllm_tfm.vllm_plugin.options import get_tfm_options

    prof = builtin_geometric_profile(temperatures=(1.0,))
    for name, want, width in (("tfm16-full-async-oneslot-fp8draft", "fp8", None), ("tfm16-full-async-oneslot", None, None),
                              ("tfm16-full-async-oneslot-fp8draft-fp8head-w4", "fp8", 4),
                              ("tfm16-full-async-oneslot-fp8draft-fp8head-dv32k", "fp8", None)):
        arm = e2e.ARMS[name]
        monkeypatch.delenv("VLLM_TFM_WIDTH", raising=False)
        plan = replay_env(arm, prof, monkeypatch, tmp_path)
        kw = e2e.engine_kwargs(arm, settings(big), plan)
        cfg = spec_config(kw)
        assert cfg.method == "tfm" and cfg.draft_model_config.quantization == want
        assert kw.get("quantization") is None
        assert get_tfm_options(cfg).width == width  # the arm's width reaches the tfm options; None: the default
        # the dv32k arm drafts from the first 32,768 ids of the drafter directory's draft_vocab.json (checked here)
        opts = get_tfm_options(cfg)
        assert (opts.draft_vocab, opts.draft_vocab_size) == (("draft_vocab.json", 32768) if "dv32k" in name else (None, None))
    desc = e2e_report._arm_desc({"kind": "tfm", "budget": 16, "draft_quantization": "fp8"})
    assert desc == "tfm (Weaver trees), B=16, DFlash drafter quantization fp8"


def test_tfm_graphs_arm_gets_piecewise_graphs_with_tree_step_sizes(big: Any, monkeypatch: pytest.MonkeyPatch,
                                                                   tmp_path: Path) -> None:
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    prof = builtin_geometric_profile(temperatures=(1.0,))
    for name, mode, sizes, eager in (
        ("tfm64-graphs", "PIECEWISE", [1, 2, 4, 8, *(65 * k for k in range(1, 9))], False),
        ("tfm64-full", "FULL_AND_PIECEWISE", [1, 2, 4, 8, *(65 * k for k in range(1, 9))], False),
        ("tfm64", None, None, True),
    ):
        arm = e2e.ARMS[name]
        plan = replay_env(arm, prof, monkeypatch, tmp_path)
        args = EngineArgs(**e2e.engine_kwargs(arm, settings(big), plan))
        args.create_speculative_config(args.create_model_config(), ParallelConfig())
        got = args.compilation_config.cudagraph_mode
        assert (None if got is None else got.name) == mode and args.enforce_eager is eager
        assert args.compilation_config.cudagraph_capture_sizes == sizes
    assert e2e_report._arm_desc({"kind": "tfm", "budget": 64, "graphs": True}) == "tfm (Weaver trees), B=64 (CUDA graphs)"


def test_an_arms_own_settings_reach_its_engine_process_only(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VLLM_TFM_GDN_VERIFY", "6")  # the driver's environment: overridden by the arm's own setting
    pinned, plain = e2e.ARMS["tfm32-full-v3"], e2e.ARMS["tfm32-full"]
    assert (pinned.budget, pinned.graphs, pinned.full) == (plain.budget, plain.graphs, plain.full)
    assert e2e.child_env(pinned, {"seed": 3}, tmp_path)["VLLM_TFM_GDN_VERIFY"] == "3"
    assert e2e.child_env(plain, {"seed": 3}, tmp_path)["VLLM_TFM_GDN_VERIFY"] == "6"
    assert e2e_report._arm_desc({"kind": "tfm", "budget": 32, "graphs": True, "full": True, "env": dict(pinned.env)}) == (
        "tfm (Weaver trees), B=32 (full CUDA graphs of tree steps), VLLM_TFM_GDN_VERIFY=3")


def test_the_one_slot_arm_is_tfm16_full_with_one_gdn_state_slot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    arm, plain = e2e.ARMS["tfm16-full-oneslot"], e2e.ARMS["tfm16-full"]
    assert (arm.kind, arm.budget, arm.graphs, arm.full, arm.async_scheduling) == (
        plain.kind, plain.budget, plain.graphs, plain.full, plain.async_scheduling)
    env = e2e.child_env(arm, {"seed": 3}, tmp_path)
    assert env["VLLM_TFM_GDN_STATE_SLOTS"] == "one"
    # the plain arms keep vLLM's per-draft layout of their earlier results, whatever tfm's default, unless the
    # environment asks for another; the no-spec arm is not given the switch
    monkeypatch.delenv("VLLM_TFM_GDN_STATE_SLOTS", raising=False)
    assert e2e.child_env(plain, {"seed": 3}, tmp_path)["VLLM_TFM_GDN_STATE_SLOTS"] == "per_draft"
    assert "VLLM_TFM_GDN_STATE_SLOTS" not in e2e.child_env(e2e.ARMS["nospec-graphs"], {"seed": 3}, tmp_path)
    monkeypatch.setenv("VLLM_TFM_GDN_STATE_SLOTS", "one")
    assert e2e.child_env(plain, {"seed": 3}, tmp_path)["VLLM_TFM_GDN_STATE_SLOTS"] == "one"
    monkeypatch.setenv("VLLM_TFM_GDN_STATE_SLOTS", "per_draft")
    assert e2e.child_env(arm, {"seed": 3}, tmp_path)["VLLM_TFM_GDN_STATE_SLOTS"] == "one"  # the arm's own wins
    asy, asy_plain = e2e.ARMS["tfm16-full-async-oneslot"], e2e.ARMS["tfm16-full-async"]
    assert (asy.kind, asy.budget, asy.graphs, asy.full, asy.async_scheduling) == (
        asy_plain.kind, asy_plain.budget, asy_plain.graphs, asy_plain.full, True)
    assert e2e.child_env(asy, {"seed": 3}, tmp_path)["VLLM_TFM_GDN_STATE_SLOTS"] == "one"


def test_the_async_arm_is_tfm16_full_with_asynchronous_scheduling(tmp_path: Path) -> None:
    arm, plain = e2e.ARMS["tfm16-full-async"], e2e.ARMS["tfm16-full"]
    assert (arm.kind, arm.budget, arm.graphs, arm.full) == (plain.kind, plain.budget, plain.graphs, plain.full)
    assert arm.env == plain.env == ()  # the engine argument alone asks for it
    envs = [e2e.child_env(a, {"seed": 3}, tmp_path) for a in (arm, plain)]
    replay = [e.pop("VLLM_TFM_BENCHMARK_ACCEPTANCE_REPLAY") for e in envs]
    assert replay == [str(tmp_path / "profile_tfm16-full-async.json"), str(tmp_path / "profile_tfm16-full.json")]
    assert envs[0] == envs[1]
    desc = {"kind": "tfm", "budget": 16, "graphs": True, "full": True, "env": {}}
    assert e2e_report._arm_desc({**desc, "async_scheduling": arm.async_scheduling}) == (
        "tfm (Weaver trees), B=16 (full CUDA graphs of tree steps), asynchronous scheduling")
    assert e2e_report._arm_desc({**desc, "async_scheduling": plain.async_scheduling}) == (
        "tfm (Weaver trees), B=16 (full CUDA graphs of tree steps)")
    plan = {"rates": [0.5] * 15}
    s = {"target": "t", "drafter": "d", "seed": 0, "gpu_memory_utilization": 0.9, "max_model_len": 4096, "batches": [1, 8],
         "max_num_batched_tokens": 4096}
    kw, plain_kw = e2e.engine_kwargs(arm, s, plan), e2e.engine_kwargs(plain, s, plan)
    assert kw.pop("async_scheduling") is True and plain_kw.pop("async_scheduling") is False  # pinned synchronous
    assert kw == plain_kw  # nothing else differs
    assert "async_scheduling" not in e2e.engine_kwargs(e2e.ARMS["nospec-graphs"], s, plan)  # vLLM's default (on)


# ------------------------------------------------------------------ planning and measurement helpers


def test_arm_parsing_and_deadline_planning() -> None:
    arms = e2e.parse_arms("tfm64,nospec,tfm64")
    assert [a.name for a in arms] == ["tfm64", "nospec"]
    assert [a.num_speculative_tokens for a in arms] == [64, 0]
    with pytest.raises(ValueError, match="unknown arm 'tfm8'"):
        e2e.parse_arms("nospec,tfm8")
    nospec, tfm = e2e.ARMS["nospec"], e2e.ARMS["tfm32"]
    # before any engine started the first-start guess applies; after, the latest measured start (the
    # first one fills the JIT caches)
    first = e2e.arm_estimate_s(nospec, [], [1, 8], 256, 1.0, clean_run=False)
    assert first == e2e.FIRST_START_GUESS_S + e2e.START_MARGIN_S + e2e.measure_estimate_s(nospec, [1, 8], 256, 1.0, False)
    later = e2e.arm_estimate_s(tfm, [(nospec, 130.0), (nospec, 40.0)], [1, 8], 256, 6.0, clean_run=False)
    assert later == 40.0 + e2e.START_MARGIN_S + e2e.measure_estimate_s(tfm, [1, 8], 256, 6.0, False)
    # a graph arm's measured start already holds its torch.compile and capture: not counted twice
    # (this session's H200: tfm32-full up in 176 s, then nospec-graphs was estimated at 414 s)
    full, graphs = e2e.ARMS["tfm32-full"], e2e.ARMS["nospec-graphs"]
    after_full = e2e.arm_estimate_s(graphs, [(full, 176.0)], [1, 8], 256, 1.0, clean_run=False)
    # (176 s is under tfm32-full's own compile estimate of 180 s: the eager part is floored at 10 s)
    assert after_full == 10.0 + 120.0 + e2e.START_MARGIN_S + e2e.measure_estimate_s(graphs, [1, 8], 256, 1.0, False)
    assert e2e.arm_estimate_s(full, [(graphs, 150.0)], [1, 8], 256, 3.9, clean_run=False) == 210.0 + (
        e2e.START_MARGIN_S + e2e.measure_estimate_s(full, [1, 8], 256, 3.9, False))
    assert e2e.arm_estimate_s(graphs, [(nospec, 40.0)], [1, 8], 256, 1.0, clean_run=False) == 160.0 + (
        e2e.START_MARGIN_S + e2e.measure_estimate_s(graphs, [1, 8], 256, 1.0, False))
    assert e2e.measure_estimate_s(tfm, [1, 8], 256, 6.0, True) > e2e.measure_estimate_s(tfm, [1, 8], 256, 6.0, False)
    assert e2e.fits(later, later) and not e2e.fits(later - 1, later)


def test_measured_mal_and_decode_rate() -> None:
    before = {"vllm:spec_decode_num_drafts": 10, "vllm:spec_decode_num_accepted_tokens": 30}
    after = {"vllm:spec_decode_num_drafts": 30, "vllm:spec_decode_num_accepted_tokens": 110}
    assert e2e.measured_mal(before, after) == 1 + 80 / 20
    assert e2e.measured_mal({}, {}) is None

    def out(n: int, first: float, last: float) -> Any:
        return SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(n)))],
                               metrics=SimpleNamespace(first_token_ts=first, last_token_ts=last))

    # 2 requests, 11 tokens each: 20 decode tokens from t = 2.0 (the later first token) to t = 6.0
    assert e2e.decode_rate([out(11, 1.0, 5.0), out(11, 2.0, 6.0)]) == 20 / 4.0
    assert e2e.decode_rate([SimpleNamespace(outputs=[], metrics=None)]) is None


# ------------------------------------------------------------------ tables


def stages(forward: float, draft: float = 0.0, tree: float = 0.0, propose: float = 0.0, sample: float = 0.5,
           commit: float = 0.0, prepare: float = 0.0, shaping: float = 0.0, replay: float = 0.0) -> dict:
    out = {"target_forward": forward, "sample": sample}
    for name, v in (("draft", draft), ("tree_build", tree), ("propose", propose), ("commit", commit),
                    ("prepare_tree", prepare), ("replay_shaping", shaping), ("replay_accept", replay)):
        if v:
            out[name] = v
    return {k: {"per_step_ms": v} for k, v in out.items()}


def results() -> dict:
    def arm(kind: str, tps: dict[int, float], st: dict[int, dict] | None = None, **kw: Any) -> dict:
        batches = {str(b): {"tokens_per_s": v * 0.9, "decode_tokens_per_s": v, "max_concurrency": b, "mal": kw.get("mal"),
                            "profiled": {"stages": (st or {}).get(b, {})}} for b, v in tps.items()}
        return {"kind": kind, "status": "ok", "batches": batches, "engine_start_s": 50.0, **kw}

    return {
        "format": "vllm-tfm-e2e/1", "command": "bash bench/run_gpu_e2e.sh", "machine": {"device": "GPU"},
        "settings": {"batches": [1, 8], "prompt_len": 256, "output_len": 256, "temperature": 1.0},
        "profile": {"measured": False, "source": "builtin"},
        "arms": {
            "nospec": arm("nospec", {1: 20.0, 8: 120.0}),
            "dflash": arm("dflash", {1: 50.0, 8: 300.0}, num_speculative_tokens=15, mal=3.9, profile_mal=3.96),
            "tfm64": arm("tfm", {1: 100.0, 8: 360.0},
                         {1: stages(20.0, draft=1.0, tree=0.5, propose=2.0, sample=0.7, commit=0.3, prepare=0.2,
                                    shaping=0.1, replay=0.2)},
                         budget=64, num_speculative_tokens=64, mal=6.8, profile_mal=6.86),
            "tfm16": {"kind": "tfm", "status": "skipped", "reason": "deadline"},
        },
        "skipped": [{"arm": "tfm16", "reason": "deadline"}],
    }


def test_stage_breakdown_by_hand() -> None:
    d = e2e_report.stage_breakdown(results()["arms"]["tfm64"]["batches"]["1"]["profiled"]["stages"])
    # overhead = (propose 2.0 - shaping 0.1) + (sample 0.7 - replay 0.2) + commit 0.3 + prepare 0.2 = 2.9
    assert d["overhead"] == pytest.approx(2.9) and d["overhead_fraction"] == pytest.approx(2.9 / 20.0)
    assert d["other_drafting"] == pytest.approx(2.0 - 1.0 - 0.5 - 0.1) and d["replay"] == pytest.approx(0.3)
    dflash = e2e_report.stage_breakdown(stages(20.0, propose=1.5, sample=0.4))
    assert dflash["draft"] == 1.5 and dflash["overhead"] == pytest.approx(1.9)


def test_render_markdown_ratios_goals_and_skips() -> None:
    res = results()
    summ = e2e_report.summarize(res)
    assert summ["batches"]["1"]["metric"] == "decode"
    assert summ["batches"]["1"]["x_nospec"]["tfm64"] == 5.0 and summ["batches"]["1"]["x_dflash"]["tfm64"] == 2.0
    assert summ["batches"]["8"]["x_nospec"]["tfm64"] == 3.0 and summ["batches"]["8"]["x_dflash"]["tfm64"] == pytest.approx(1.2)
    g = summ["goals"]["tfm64"]
    assert g["overhead_ok"] is True and g["x_nospec_ok_b1"] is True and g["x_dflash_ok_b1"] is True
    assert "tfm16" not in summ["goals"]
    md = e2e_report.render_markdown(res)
    row = next(line for line in md.splitlines() if line.startswith("| tfm64"))
    assert "| 100.0 | 5.00x | 2.00x | 360.0 | 3.00x | 1.20x |" in row and "| 6.86 | 6.80 |" in row
    assert "NOT measured (synthetic)" in md
    assert "- tfm64: overhead 14.5% (met), 5.00x over no-spec (met), 2.00x over DFlash (met)" in md
    assert "Not run: tfm16 (deadline)" in md
    # e2e tokens/s when one arm lacks vLLM's per-request timestamps
    res["arms"]["nospec"]["batches"]["1"]["decode_tokens_per_s"] = None
    assert e2e_report.summarize(res)["batches"]["1"]["metric"] == "e2e"
    with pytest.raises(ValueError, match="not a bench/e2e.py results file"):
        e2e_report.render_markdown({"format": "x"})


def test_a_batch_whose_requests_did_not_all_fit_is_marked() -> None:
    res = results()
    assert "at once" not in e2e_report.render_markdown(res)  # every batch ran whole
    res["arms"]["tfm64"]["batches"]["8"]["max_concurrency"] = 5
    res["arms"]["tfm64"]["num_gpu_blocks"] = 973
    md = e2e_report.render_markdown(res)
    row = next(line for line in md.splitlines() if line.startswith("| tfm64"))
    assert "| 360.0 (5 at once) | 3.00x | 1.20x |" in row and "| 1/5 |" in row
    assert ("- tfm64 at batch 8: at most 5 requests ran at once (its KV cache, 973 blocks, held no more), the others "
            "waited: not a batch-8 figure") in md
    assert md.count("at once") == 2  # the b1 run (1 of 1) and the other arms are not marked


def test_tokens_per_s_come_from_clean_runs_unless_told_otherwise() -> None:
    res = results()
    res["settings"]["clean_run"] = True
    assert "Tokens/s from runs with the stage timers paused (clean runs)." in e2e_report.render_markdown(res)
    res["settings"]["clean_run"] = False
    assert "Tokens/s from the timed runs (stage timers on" in e2e_report.render_markdown(res)


def forward_stages(forward: float, gdn: float, attn: float) -> dict:
    """Stage dicts as collect_stage_timings gives them (per-step sums over 48 GDN / 16 attention layers)."""
    return {"target_forward": {"per_step_ms": forward}, "sample": {"per_step_ms": 0.5},
            "gdn_layer": {"per_step_ms": gdn + 1.0}, "gdn_tree": {"per_step_ms": gdn, "host_per_step_ms": gdn - 1.5,
                                                                   "spans_per_step": 48.0},
            "gdn_tree_conv": {"per_step_ms": 3.0}, "gdn_tree_verify": {"per_step_ms": 6.0},
            "attention_layer": {"per_step_ms": attn + 2.5},
            "attention_tree": {"per_step_ms": attn, "host_per_step_ms": attn - 0.5, "spans_per_step": 16.0}}


def test_forward_split_by_hand() -> None:
    f = e2e_report.forward_split(forward_stages(47.7, gdn=20.0, attn=4.5))
    assert f["rest_of_forward"] == pytest.approx(47.7 - 20.0 - 4.5)
    assert f["tree_fraction"] == pytest.approx(24.5 / 47.7)
    assert (f["gdn_tree_host"], f["attention_tree_host"]) == (18.5, 4.0)
    assert (f["gdn_layer"], f["attention_layer"], f["gdn_tree_conv"], f["gdn_tree_verify"]) == (21.0, 7.0, 3.0, 6.0)
    assert (f["gdn_layers_per_step"], f["attention_layers_per_step"]) == (48.0, 16.0)
    nospec = e2e_report.forward_split(stages(14.8))  # no tree steps: the whole forward is the rest
    assert nospec["gdn_tree"] is None and nospec["attention_tree"] is None and nospec["rest_of_forward"] == 14.8


def test_render_markdown_splits_the_target_forward() -> None:
    res = results()
    assert "Target forward split" not in e2e_report.render_markdown(res)  # no arm ran tree steps
    res["arms"]["nospec"]["batches"]["1"]["profiled"] = {"stages": stages(14.8), "timer_host_ms_per_step": 0.03}
    res["arms"]["tfm64"]["batches"]["1"]["profiled"] = {"stages": forward_stages(47.7, gdn=20.0, attn=4.5),
                                                       "timer_host_ms_per_step": 1.25}
    md = e2e_report.render_markdown(res)
    assert "Target forward split per decode step at batch 1" in md and "Target forward split per decode step at batch 8" not in md
    rows = {line.split(" | ")[0]: line for line in md.split("Target forward split")[1].splitlines() if line.startswith("| ")}
    assert rows["| tfm64"] == ("| tfm64 | 47.70 | 20.00 (18.50) | 3.00 | 6.00 | 21.00 | 4.50 (4.00) | 7.00 | 23.20 | 51.4% "
                               "| 48/16 | 1.25 |")
    assert rows["| nospec"] == "| nospec | 14.80 | - | - | - | - | - | - | 14.80 | - | -/- | 0.03 |"
    assert "| dflash" not in rows  # no stage timings at batch 1 in this fixture: no row


def test_write_doc_replaces_between_the_markers(tmp_path: Path) -> None:
    doc = tmp_path / "e2e.md"
    doc.write_text(f"# Title\nprose\n{e2e_report.BEGIN}\nold table\n{e2e_report.END}\nafter\n")
    (tmp_path / "r.json").write_text(json.dumps(results()))
    assert e2e_report.main([str(tmp_path / "r.json"), "--write", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# Title\nprose\n") and text.endswith(f"{e2e_report.END}\nafter\n")
    assert "old table" not in text and "| tfm64" in text
    with pytest.raises(ValueError, match="missing the markers"):
        e2e_report.write_doc(tmp_path / "r.json", "x", "r.json")


# ------------------------------------------------------------------ the child and the driver, with a fake engine


class FakeLLM:
    """Stands in for vllm.LLM: generate() returns timestamped outputs and records a few stage spans
    (per-layer ones for tfm); spec-decode counters grow by 10 drafts / 30 accepted tokens per generate (MAL 4)."""

    def __init__(self, **kw: Any) -> None:
        self.kw = kw
        self.llm_engine = SimpleNamespace(vllm_config=SimpleNamespace(cache_config=SimpleNamespace(num_gpu_blocks=123)))
        self.drafts = self.accepted = 0

    def generate(self, prompts: list, params: Any, use_tqdm: bool = False) -> list:
        from vllm_tfm.vllm_plugin.runtime.stage_timing import TIMER

        n = params.max_tokens
        tfm = (self.kw.get("speculative_config") or {}).get("method") == "tfm"
        for _ in range(3):
            TIMER.note_batch(len(prompts), len(prompts))
            with TIMER.span("execute_model"), TIMER.span("target_forward"):
                for _ in range(2 if tfm else 0):  # tree steps: two GDN layers, one attention layer
                    with TIMER.span("gdn_layer"), TIMER.span("gdn_tree"):
                        pass
                if tfm:
                    with TIMER.span("attention_layer"), TIMER.span("attention_tree"):
                        pass
        self.drafts += 10
        self.accepted += 30
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(range(n)))],
                                metrics=SimpleNamespace(first_token_ts=1.0, last_token_ts=1.0 + 0.01 * (n - 1)))
                for _ in prompts]

    def collective_rpc(self, fn: Any, kwargs: dict | None = None) -> list:
        return [fn(None, **(kwargs or {}))]

    def get_metrics(self) -> list:
        return [SimpleNamespace(name="vllm:spec_decode_num_drafts", value=self.drafts),
                SimpleNamespace(name="vllm:spec_decode_num_accepted_tokens", value=self.accepted)]


@pytest.fixture()
def fake_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    vllm = pytest.importorskip("vllm")
    from vllm_tfm.vllm_plugin.runtime.stage_timing import TIMER

    monkeypatch.setattr(vllm, "LLM", FakeLLM)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "FakeGPU")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (2**34, 2**37))
    monkeypatch.setattr(TIMER, "enabled", False)


def write_fast_models(work: Path, vl: bool = False) -> dict[str, Any]:
    target = e2e_models.write_target(work / "target", vl=vl)
    drafter = e2e_models.write_drafter(work / "drafter", weaver=False)
    return {"target": str(target), "drafter": str(drafter), "vocab": 248_320, "seconds": 0.0}


def test_driver_runs_arms_and_renders_what_they_measured(fake_engine: None, monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    import time

    monkeypatch.setattr(e2e, "write_models", write_fast_models)
    seen_env: dict[str, dict] = {}

    def run_child(arm: Any, settings_path: Path, out: Path, timeout_s: float, env: dict) -> int:
        seen_env[arm.name] = env
        return e2e.run_arm(arm, settings_path)  # in-process, with the fake engine

    monkeypatch.setattr(e2e, "run_child", run_child)
    monkeypatch.setattr(e2e, "T0", time.time())
    out, work = tmp_path / "out", tmp_path / "work"
    rc = e2e.main(["--out", str(out), "--work", str(work), "--arms", "nospec,dflash,tfm32", "--batches", "1,8",
                   "--output-len", "11", "--profile", "builtin", "--deadline-s", "1000"])
    assert rc == 0
    res = json.loads((out / "e2e_27b.json").read_text())
    assert res["format"] == "vllm-tfm-e2e/1" and res["machine"]["device"] == "FakeGPU"
    assert not res["profile"]["measured"] and res["skipped"] == []
    for name in ("nospec", "dflash", "tfm32"):
        arm = res["arms"][name]
        assert arm["status"] == "ok" and arm["num_gpu_blocks"] == 123
        for b in (1, 8):
            run = arm["batches"][str(b)]
            assert run["output_tokens"] == 11 * b and run["decode_tokens_per_s"] == pytest.approx(100.0 * b)
            assert run["mal"] == 4.0 and run["max_concurrency"] == b
            assert run["profiled"]["stages"]["target_forward"]["count"] == 3
            assert run["profiled"]["timer_host_ms_per_step"] is not None
            gdn = run["profiled"]["stages"].get("gdn_tree")
            if name == "tfm32":  # the arm's JSON keeps the per-layer spans, summed per step
                assert gdn["count"] == 6 and gdn["spans_per_step"] == 2.0 and gdn["per_step_sum"]["count"] == 3
                assert run["profiled"]["stages"]["attention_tree"]["spans_per_step"] == 1.0
            else:
                assert gdn is None
    assert res["arms"]["dflash"]["engine_kwargs"]["speculative_config"]["rejection_sample_method"] == "synthetic"
    assert res["arms"]["tfm32"]["profile_entry"] == "tfm B=32 T=1"
    replay = seen_env["tfm32"]["VLLM_TFM_BENCHMARK_ACCEPTANCE_REPLAY"]
    assert json.loads(Path(replay).read_text())["entries"][0]["budget"] == 32
    assert seen_env["tfm32"]["VLLM_TFM_I_AM_BENCHMARKING"] == "1"
    assert "VLLM_TFM_BENCHMARK_ACCEPTANCE_REPLAY" not in seen_env["nospec"]
    assert seen_env["nospec"]["VLLM_TFM_PROFILE"] == "1"
    md = (out / "e2e.md").read_text()
    assert md == e2e_report.render_markdown(res) and "| tfm32: tfm (Weaver trees), B=32 |" in md
    split = md.split("Target forward split per decode step at batch 1")[1]
    assert "\n| tfm32 | " in split and "| 2/1 |" in split

    # a deadline that fits nothing: every arm is skipped, said so, with the command that runs them
    monkeypatch.setattr(e2e, "T0", time.time())
    rc = e2e.main(["--out", str(out), "--work", str(work), "--arms", "dflash,tfm64", "--profile", "builtin",
                   "--deadline-s", "60"])
    res = json.loads((out / "e2e_27b.json").read_text())
    assert rc == 0 and [x["arm"] for x in res["skipped"]] == ["dflash", "tfm64"]
    assert "Next command: bash bench/run_gpu_e2e.sh --arms nospec,dflash,tfm64" in capsys.readouterr().out


def test_a_width_arm_replays_its_own_profile_and_sets_the_width(fake_engine: None, monkeypatch: pytest.MonkeyPatch,
                                                                tmp_path: Path) -> None:
    """The w4 arm is the FP8 arm growing at width 4: VLLM_TFM_WIDTH=4 in its process only, and it replays the
    --arm-profile file's entry while the other tfm arm replays --profile's; without --arm-profile it is refused."""
    import time

    from vllm_tfm.verify.acceptance_profile import AcceptanceProfile, ProfileEntry, save_profile

    w4, base = e2e.ARMS["tfm16-full-async-oneslot-fp8draft-fp8head-w4"], e2e.ARMS["tfm16-full-async-oneslot-fp8draft-fp8head"]
    assert (w4.kind, w4.budget, w4.graphs, w4.full, w4.async_scheduling, w4.env, w4.draft_quantization) == (
        base.kind, base.budget, base.graphs, base.full, base.async_scheduling, base.env, base.draft_quantization)
    assert w4.width == 4 and base.width is None
    with pytest.raises(ValueError, match=r"grows its trees at width 4: give acceptance measured at that width with "
                                         r"--arm-profile tfm16-full-async-oneslot-fp8draft-fp8head-w4=PATH"):
        e2e.parse_arm_profiles([], [base, w4])
    with pytest.raises(ValueError, match="--arm-profile tfm64: not one of this run's arms"):
        e2e.parse_arm_profiles(["tfm64=x.json", f"{w4.name}=y.json"], [base, w4])
    with pytest.raises(ValueError, match="--arm-profile takes NAME=PATH, got 'x.json'"):
        e2e.parse_arm_profiles(["x.json"], [base, w4])

    own_pmf = geometric_pmf(0.5, 15)
    save_profile(AcceptanceProfile(source="width-4 cells", measured=True, entries=[
        ProfileEntry(method="tfm", budget=16, temperature=1.0, accepted_pmf=own_pmf, steps=10)]), tmp_path / "w4.json")
    monkeypatch.setattr(e2e, "write_models", write_fast_models)
    seen_env: dict[str, dict] = {}

    def run_child(arm: Any, settings_path: Path, out: Path, timeout_s: float, env: dict) -> int:
        seen_env[arm.name] = env
        return e2e.run_arm(arm, settings_path)

    monkeypatch.setattr(e2e, "run_child", run_child)
    monkeypatch.setattr(e2e, "T0", time.time())
    out, work = tmp_path / "out", tmp_path / "work"
    rc = e2e.main(["--out", str(out), "--work", str(work), "--arms", f"tfm16,{w4.name}", "--batches", "1",
                   "--output-len", "11", "--profile", "builtin", "--arm-profile", f"{w4.name}={tmp_path / 'w4.json'}",
                   "--deadline-s", "1000"])
    assert rc == 0
    res = json.loads((out / "e2e_27b.json").read_text())
    replayed = {n: json.loads(Path(seen_env[n]["VLLM_TFM_BENCHMARK_ACCEPTANCE_REPLAY"]).read_text()) for n in seen_env}
    assert replayed[w4.name]["entries"][0]["accepted_pmf"] == pytest.approx(own_pmf)
    assert replayed[w4.name]["source"] == "width-4 cells" and replayed[w4.name]["measured"]
    assert replayed["tfm16"]["entries"][0]["accepted_pmf"] == pytest.approx(geometric_pmf(0.80, 15))
    assert seen_env[w4.name]["VLLM_TFM_WIDTH"] == "4" and "VLLM_TFM_WIDTH" not in seen_env["tfm16"]
    plans = res["settings"]["plans"]
    assert plans[w4.name]["profile_path"] == str(tmp_path / "w4.json") and "profile_path" not in plans["tfm16"]
    assert plans[w4.name]["mal"] == pytest.approx(mean_accepted_length(own_pmf))


def test_driver_runs_the_vl_class_when_asked(fake_engine: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import time

    monkeypatch.setattr(e2e, "write_models", write_fast_models)
    monkeypatch.setattr(e2e, "run_child", lambda arm, settings_path, out, timeout_s, env: e2e.run_arm(arm, settings_path))
    monkeypatch.setattr(e2e, "T0", time.time())
    out, work = tmp_path / "out", tmp_path / "work"
    rc = e2e.main(["--out", str(out), "--work", str(work), "--arms", "tfm16", "--batches", "1", "--output-len", "5",
                   "--profile", "builtin", "--deadline-s", "1000", "--target-class", "vl"])
    assert rc == 0
    res = json.loads((out / "e2e_27b.json").read_text())
    assert res["settings"]["target_class"] == "vl" and "Qwen3_5ForConditionalGeneration" in res["settings"]["target"]
    assert res["arms"]["tfm16"]["status"] == "ok"
    assert res["arms"]["tfm16"]["engine_kwargs"]["limit_mm_per_prompt"] == {"image": 0, "video": 0}
    config = json.loads((work / "target" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForConditionalGeneration"]


def test_child_records_an_engine_failure(fake_engine: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import vllm

    def broken(**kw: Any) -> None:
        raise RuntimeError("no memory")

    monkeypatch.setattr(vllm, "LLM", broken)
    settings = {"plans": {}, "work": str(tmp_path), "target": "t", "drafter": "d", "seed": 0, "gpu_memory_utilization": 0.9,
                "max_model_len": 704, "batches": [1], "max_num_batched_tokens": 4096}
    (tmp_path / "s.json").write_text(json.dumps(settings))
    assert e2e.run_arm(e2e.ARMS["nospec"], tmp_path / "s.json") == 1
    res = json.loads((tmp_path / "arm_nospec.json").read_text())
    assert res["status"] == "error" and res["error"] == "RuntimeError: no memory" and res["batches"] == {}


def test_graph_arms_are_compared_with_graph_baselines_when_those_ran() -> None:
    def arm(kind: str, graphs: bool, tps: float) -> dict[str, Any]:
        return {"kind": kind, "graphs": graphs, "status": "ok", "batches": {"1": {"tokens_per_s": tps, "decode_tokens_per_s": tps}}}

    results = {"format": e2e_report.RESULTS_FORMAT, "settings": {"batches": [1]}, "arms": {
        "nospec": arm("nospec", False, 10.0), "dflash": arm("dflash", False, 15.0),
        "nospec-graphs": arm("nospec", True, 40.0), "tfm32": arm("tfm", False, 30.0),
        "tfm32-graphs": arm("tfm", True, 120.0)}}
    x = e2e_report.summarize(results)["batches"]["1"]
    assert x["x_nospec"]["tfm32"] == 3.0 and x["x_nospec"]["tfm32-graphs"] == 3.0
    assert x["x_dflash"]["tfm32"] == 2.0
    assert x["x_dflash"]["tfm32-graphs"] == 8.0  # no DFlash graph run: the eager one is all there is
    results["arms"]["dflash-graphs"] = arm("dflash", True, 60.0)
    assert e2e_report.summarize(results)["batches"]["1"]["x_dflash"]["tfm32-graphs"] == 2.0


def test_dflash_graphs_arm_captures_the_verify_step_sizes(big: Any) -> None:
    prof = builtin_geometric_profile(temperatures=(1.0,))
    arm = e2e.ARMS["dflash-graphs"]
    kw = e2e.engine_kwargs(arm, settings(big), e2e.arm_profile(arm, prof, 1.0, 15))
    assert kw["enforce_eager"] is False and kw["speculative_config"]["method"] == "dflash"
    assert 16 in kw["compilation_config"]["cudagraph_capture_sizes"] and 128 in kw["compilation_config"]["cudagraph_capture_sizes"]


def test_run_records_the_tfm_switches_but_not_the_benchmark_ones() -> None:
    env = {"VLLM_TFM_WEAVER_GRAPHS": "1", "VLLM_TFM_PROFILE": "1", "VLLM_TFM_I_AM_BENCHMARKING": "1", "PATH": "/bin"}
    assert e2e.tfm_switches(env) == {"VLLM_TFM_WEAVER_GRAPHS": "1"}


def test_merged_results_keep_every_arm_and_command_and_refuse_other_runs(tmp_path: Path) -> None:
    a, b = results(), results()
    a["arms"] = {"nospec": a["arms"]["nospec"]}
    b["arms"] = {"tfm64": b["arms"]["tfm64"]}
    b["command"] = "bash bench/run_gpu_e2e.sh --arms tfm64"
    b["settings"]["deadline_s"] = 99  # the deadline may differ
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    m = e2e_report.merge_results([str(pa), str(pb)], "one GPU each")
    assert list(m["arms"]) == ["nospec", "tfm64"] and m["merge_note"] == "one GPU each"
    assert [x["command"] for x in m["merged_from"]] == [a["command"], b["command"]]
    assert e2e_report.summarize(m)["goals"]["tfm64"]["x_nospec"]["1"] == pytest.approx(5.0)
    b["settings"]["output_len"] = 128
    pb.write_text(json.dumps(b))
    with pytest.raises(ValueError, match="settings differ"):
        e2e_report.merge_results([str(pa), str(pb)], "x")
    pb.write_text(json.dumps(a))
    with pytest.raises(ValueError, match="arm nospec is in more than one file"):
        e2e_report.merge_results([str(pa), str(pb)], "x")


def test_report_reads_gzip_compressed_results_like_plain_ones(tmp_path: Path) -> None:
    import gzip

    res = results()
    plain, packed = tmp_path / "r.json", tmp_path / "r.json.gz"
    plain.write_text(json.dumps(res))
    packed.write_bytes(gzip.compress(json.dumps(res).encode()))
    assert e2e_report.load_results(packed) == e2e_report.load_results(plain) == json.loads(json.dumps(res))
    assert e2e_report.render_files([str(packed)]) == e2e_report.render_files([str(plain)])


def test_render_markdown_lists_the_deferred_drafts_ab_where_it_ran() -> None:
    res = results()
    assert "Deferred drafts on / off" not in e2e_report.render_markdown(res)
    run = res["arms"]["tfm64"]["batches"]["1"]
    run["deferred_off"] = {"decode_tokens_per_s": 90.0, "placeholder_steps": 0}
    run["deferred_on_again"] = {"decode_tokens_per_s": 101.0}
    md = e2e_report.render_markdown(res)
    assert "- tfm64: batch 1: on 100.0, off 90.0, on again 101.0" in md
    assert "batch 8" not in md.split("Deferred drafts on / off")[1].split("\n\n")[1]  # batch 8 ran no A/B


def test_the_topology_wait_counts_as_tree_metadata() -> None:
    base = {"target_forward": {"per_step_ms": 20.0}, "propose": {"per_step_ms": 4.0}, "draft": {"per_step_ms": 2.0},
            "tree_build": {"per_step_ms": 1.5}, "sample": {"per_step_ms": 0.2}, "commit": {"per_step_ms": 0.3},
            "prepare_tree": {"per_step_ms": 0.1}}
    d = e2e_report.stage_breakdown(base)
    deferred = e2e_report.stage_breakdown({**base, "topology_wait": {"per_step_ms": 1.2}})
    assert deferred["prepare_tree"] == pytest.approx(1.3) and deferred["overhead"] == pytest.approx(d["overhead"] + 1.2)


def two_sequential_runs(tmp_path: Path) -> tuple[dict, dict, Path, Path]:
    """Two results files of one machine, one after the other: DFlash + no-spec with one profile, then
    tfm64 + no-spec again with another profile and a larger max_model_len."""
    a, b = results(), results()
    a["arms"] = {"dflash": a["arms"]["dflash"], "nospec": a["arms"]["nospec"]}
    a["settings"].update(max_model_len=606, plans={"dflash": {"mal": 3.96}, "nospec": {}})
    a["arms"]["dflash"]["profile_entry"] = "chain B=16 T=0"
    b["arms"] = {"tfm64": b["arms"]["tfm64"], "nospec": results()["arms"]["nospec"]}
    b["arms"]["tfm64"]["profile_entry"] = "tfm B=64 T=0"
    b["arms"]["nospec"]["batches"]["1"]["decode_tokens_per_s"] = 21.0
    b["command"] = "bash bench/run_gpu_e2e.sh --arms tfm64,nospec --profile w4.json"
    b["settings"].update(max_model_len=640, plans={"tfm64": {"mal": 6.86}, "nospec": {}})
    b["profile"] = {"measured": True, "source": "w4.json"}
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    return a, b, pa, pb


def test_sequential_merge_keeps_each_arms_profile_source_and_the_first_run_of_a_repeated_arm(tmp_path: Path) -> None:
    a, b, pa, pb = two_sequential_runs(tmp_path)
    m = e2e_report.merge_results([str(pa), str(pb)], "one machine, one call after the other", sequential=True)
    assert list(m["arms"]) == ["dflash", "nospec", "tfm64"] and m["sequential"] is True
    assert {k: arm["profile_source"] for k, arm in m["arms"].items()} == {"dflash": "builtin", "nospec": "builtin",
                                                                          "tfm64": "w4.json"}
    assert m["profile"]["per_arm"] is True and m["profile"]["measured"] is False  # the builtin one is synthetic
    assert [(s["source"], s["arms"]) for s in m["profile"]["sources"]] == [("builtin", ["dflash", "nospec"]),
                                                                           ("w4.json", ["tfm64"])]
    assert m["profile"]["source"] == "per arm: dflash, nospec: builtin; tfm64: w4.json"
    assert m["settings"]["max_model_len"] == {"dflash": 606, "nospec": 606, "tfm64": 640}
    assert list(m["settings"]["plans"]) == ["dflash", "nospec", "tfm64"]
    assert m["arms"]["nospec"]["batches"]["1"]["decode_tokens_per_s"] == 20.0  # the first file's run
    assert m["repeated_arms"] == [{"arm": "nospec", "command": b["command"], "batches": {
        "1": {"tokens_per_s": 18.0, "decode_tokens_per_s": 21.0}, "8": {"tokens_per_s": 108.0, "decode_tokens_per_s": 120.0}}}]
    x = e2e_report.summarize(m)
    assert x["batches"]["1"]["x_nospec"]["tfm64"] == 5.0 and x["batches"]["1"]["x_dflash"]["tfm64"] == 2.0
    assert x["goals"]["tfm64"]["x_dflash_ok_b1"] is True and x["goals"]["tfm64"]["x_nospec_ok_b1"] is True
    md = e2e_report.render_markdown(m)
    assert ("Acceptance: a profile per arm (runs one after another): dflash from builtin (NOT measured (synthetic), "
            "entry chain B=16 T=0); tfm64 from w4.json (measured, entry tfm B=64 T=0);") in md
    assert f"- nospec again in `{b['command']}`: b1 21.0 (table: 20.0), b8 120.0 (table: 120.0)" in md
    assert "Merged from 2 runs: one machine, one call after the other." in md
    assert "- tfm64: overhead 14.5% (met), 5.00x over no-spec (met), 2.00x over DFlash (met)" in md


def test_runs_at_the_same_time_still_need_one_profile_and_distinct_arms(tmp_path: Path) -> None:
    a, b, pa, pb = two_sequential_runs(tmp_path)
    with pytest.raises(ValueError, match=r"b.json: settings differ from .*a.json's"):  # max_model_len
        e2e_report.merge_results([str(pa), str(pb)], "x")
    b["settings"]["max_model_len"] = 606
    pb.write_text(json.dumps(b))
    with pytest.raises(ValueError, match=r"b.json: profile differ from .*a.json's"):
        e2e_report.merge_results([str(pa), str(pb)], "x")
    b["profile"] = a["profile"]
    pb.write_text(json.dumps(b))
    with pytest.raises(ValueError, match="arm nospec is in more than one file"):
        e2e_report.merge_results([str(pa), str(pb)], "x")
    m = e2e_report.merge_results([str(pa), str(pb)], "x", sequential=True)
    assert m["profile"] == a["profile"] and m["settings"]["max_model_len"] == 606  # nothing differs: kept as it was
    assert "Acceptance: NOT measured (synthetic) profile, builtin;" in e2e_report.render_markdown(m)


def test_sequential_merge_still_needs_one_machine_and_the_same_settings(tmp_path: Path) -> None:
    a, b, pa, pb = two_sequential_runs(tmp_path)
    b["machine"] = {"device": "another GPU"}
    pb.write_text(json.dumps(b))
    with pytest.raises(ValueError, match="another results format or machine"):
        e2e_report.merge_results([str(pa), str(pb)], "x", sequential=True)
    b["machine"] = a["machine"]
    b["settings"]["temperature"] = 0.0
    pb.write_text(json.dumps(b))
    with pytest.raises(ValueError, match="settings differ"):
        e2e_report.merge_results([str(pa), str(pb)], "x", sequential=True)


def test_merge_sequential_from_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _, _, pa, pb = two_sequential_runs(tmp_path)
    out = tmp_path / "ab.json"
    assert e2e_report.main([str(pa), str(pb), "--merge", str(out), "--merge-sequential"]) == 0
    m = json.loads(out.read_text())
    assert m["merge_note"] == "arms ran one after another on one machine" and len(m["repeated_arms"]) == 1
    assert "- nospec again in" in capsys.readouterr().out
    with pytest.raises(ValueError, match="settings differ"):  # without the switch: runs at the same time
        e2e_report.main([str(pa), str(pb), "--merge", str(out), "--merge-note", "x"])


def test_the_breakdown_is_a_typical_decode_step_not_a_mean_lifted_by_the_prefill() -> None:
    """Per-step sums of 10 steps, the first the prompts' prefill: the forward's median is a decode
    step's 16 ms, not the mean's 26; a stage that ran in fewer than half the steps keeps its mean
    over all steps; files without per-step sums keep per_step_ms."""
    def entry(sums: list[float], steps: int = 10) -> dict:
        srt = sorted(sums)
        mid = len(srt) // 2
        median = srt[mid] if len(srt) % 2 else (srt[mid - 1] + srt[mid]) / 2
        return {"per_step_ms": sum(sums) / steps, "per_step_sum": {"count": len(sums), "median_ms": median}}

    stages = {"execute_model": entry([120.0] + [20.0] * 9), "target_forward": entry([116.0] + [16.0] * 9),
              "propose": entry([4.0] * 10), "sample": entry([0.3] * 10), "commit": entry([0.5] * 9),
              "topology_wait": entry([1.0] * 4)}
    d = e2e_report.stage_breakdown(stages)
    assert d["target_forward"] == pytest.approx(16.0) and d["execute_model"] == pytest.approx(20.0)
    assert d["commit"] == pytest.approx(0.5)  # ran in 9 of 10 steps: its median
    assert d["prepare_tree"] == pytest.approx(0.4)  # ran in 4 of 10: its total over the 10 steps
    assert d["overhead_fraction"] == pytest.approx((4.0 + 0.3 + 0.5 + 0.4) / 16.0)
    mean_only = {k: {"per_step_ms": v["per_step_ms"]} for k, v in stages.items()}
    assert e2e_report.stage_breakdown(mean_only)["target_forward"] == pytest.approx(26.0)
    assert e2e_report.forward_split(stages)["target_forward"] == pytest.approx(16.0)


def _switch_ab_markdown(ab_key: str, flag: str, clean: float, runs: list[tuple[bool, float]]) -> str:
    res = results()
    run = res["arms"]["tfm64"]["batches"]["1"]
    run["decode_tokens_per_s"] = clean
    run[ab_key] = [{flag: on, "decode_tokens_per_s": v} for on, v in runs]
    return e2e_report.render_markdown(res)


@pytest.mark.parametrize(("ab_key", "flag", "title", "other"), [
    ("device_topology_ab", "device_topology", "Device topology of full-graph steps on / off", "The commit's reuse"),
    ("commit_reuse_ab", "commit_reuse", "The commit's reuse across full-graph replays on / off", "Device topology"),
])
def test_a_switch_ab_is_reported_in_run_order_under_its_own_title(ab_key, flag, title, other) -> None:
    md = _switch_ab_markdown(ab_key, flag, 150.0, [(False, 141.0), (True, 151.0), (False, 140.5)])
    assert md.index("- tfm64: batch 1: on 150.0, off 141.0, on 151.0, off 140.5") > md.index(title)
    assert other not in md  # no other A/B ran
    assert "A/B runs' means" not in md  # one repeat: no means


def test_a_switch_ab_sets_off_on_off_then_gives_the_setting_back(monkeypatch) -> None:
    calls: list[tuple] = []

    class LLM:
        def collective_rpc(self, fn, args=(), kwargs=None):
            calls.append((fn.__name__, args))
            return [{"hooks": {"x.hook": 3 * len(calls)}}]

    monkeypatch.setattr(e2e, "one_run", lambda llm, ps, params: {"decode_tokens_per_s": float(len(calls))})

    def set_thing(worker=None, on=None):
        return on

    runs = e2e.switch_ab_runs(LLM(), [[1]], None, set_thing, "thing", ("x.hook", "hooked_steps"))
    assert [r["thing"] for r in runs] == [False, True, False]
    assert [c[1] for c in calls if c[0] == "set_thing"] == [(False,), (True,), (False,), (None,)]
    assert all(r["hooked_steps"] == 3 for r in runs)  # the hook count read before and after each run
    assert all(r["tree_steps"] == 0 and r["decode_ms_per_step"] is None for r in runs)  # no commit hook here


def test_a_graph_selecting_switch_runs_its_off_setting_once_unrecorded_first(monkeypatch) -> None:
    calls: list[tuple] = []
    runs_seen: list[object] = []

    class LLM:
        def collective_rpc(self, fn, args=(), kwargs=None):
            calls.append((fn.__name__, args))
            return [{"hooks": {}}]

    def one_run(llm, ps, params):
        runs_seen.append([a for name, a in calls if name == "set_thing"][-1])
        return {"decode_tokens_per_s": 1.0}

    monkeypatch.setattr(e2e, "one_run", one_run)

    def set_thing(worker=None, on=None):
        return on

    runs = e2e.switch_ab_runs(LLM(), [[1]], None, set_thing, "thing", repeats=1, warm_off=True)
    assert runs_seen == [(False,), (False,), (True,), (False,)]  # the warm run first, then off / on / off
    assert [r["thing"] for r in runs] == [False, True, False]  # the warm run is not among them
    assert e2e.SWITCH_ABS["topk_kernel"].warm_off and not e2e.SWITCH_ABS["kv_compact_kernel"].warm_off
    assert e2e.SWITCH_ABS["prompt_overlap"].warm_off  # another Weaver graph too
    runs_seen.clear()
    runs = e2e.switch_ab_runs(LLM(), [[1]], None, set_thing, "thing", repeats=1, warm_on=True)
    assert runs_seen == [(True,), (False,), (True,), (False,)]  # graphs captured on first use: the on setting first
    assert [r["thing"] for r in runs] == [False, True, False]
    assert e2e.SWITCH_ABS["drafter_graphs"].warm_on and not e2e.SWITCH_ABS["drafter_graphs"].warm_off


def test_decode_ms_per_step_divides_the_decode_window_by_the_tree_steps() -> None:
    # 8 requests, 2048 tokens: 2040 after the first ones, at 850 tok/s = 2.4 s over 100 steps
    assert e2e.decode_ms_per_step({"output_tokens": 2048, "decode_tokens_per_s": 850.0, "tree_steps": 100}, 8) == 24.0
    assert e2e.decode_ms_per_step({"output_tokens": 256, "decode_tokens_per_s": None, "tree_steps": 70}, 1) is None
    assert e2e.decode_ms_per_step({"output_tokens": 256, "decode_tokens_per_s": 160.0, "tree_steps": 0}, 1) is None


def test_the_step_timeline_is_rendered_in_host_order_for_the_arms_that_have_one() -> None:
    res = results()
    run = res["arms"]["tfm64"]["batches"]["1"]
    pts = [("runner._model_forward:start", 4.8, 4.81), ("runner.execute_model:start", 0.0, 2.3),
           ("runner._sample:start", 5.3, 21.3), ("not.listed:start", 1.0, 1.0)]
    run["host_spans"] = {"timeline": {"steps": 70, "step_ms": 23.05, "points": [
        {"point": p, "host_ms": h, "gpu_ms": g, "gpu_behind_ms": round(g - h, 4), "steps": 70} for p, h, g in pts]}}
    md = e2e_report.render_markdown(res)
    assert "Where a typical tfm64 step waits at batch 1 (host-spans run, medians over 70 steps, a step 23.05 ms;" in md
    i, j, k = (md.index(f"| {p} |") for p in ("runner.execute_model:start", "runner._model_forward:start",
                                                 "runner._sample:start"))
    assert i < j < k
    assert "| runner._model_forward:start | 4.80 | 4.81 | 0.01 |" in md and "not.listed" not in md
    assert "tfm64 step waits at batch 8" not in md  # no timeline at batch 8


def test_ab_order_is_balanced_for_repeats_and_refuses_none() -> None:
    assert e2e.ab_order(1) == (False, True, False)
    assert e2e.ab_order(3) == (False, True, True, False, False, True)
    for r in (2, 4):
        order = e2e.ab_order(r)
        assert sum(order) == r and len(order) == 2 * r
        # mean position of each setting is the same: no drift favours one
        assert sum(i for i, v in enumerate(order) if v) == sum(i for i, v in enumerate(order) if not v)
    with pytest.raises(ValueError, match="--ab-repeats must be at least 1, got 0"):
        e2e.ab_order(0)


def test_a_repeated_switch_ab_reports_each_settings_mean() -> None:
    md = _switch_ab_markdown("commit_reuse_ab", "commit_reuse", 150.0,
                             [(False, 140.0), (True, 150.0), (True, 152.0), (False, 142.0)])
    assert ("- tfm64: batch 1: on 150.0, off 140.0, on 150.0, on 152.0, off 142.0 "
            "(A/B runs' means: on 151.0 of 2, off 141.0 of 2)") in md


def test_every_switch_ab_has_a_setter_and_a_report_title_and_bad_names_are_refused() -> None:
    import vllm_tfm.vllm_plugin.runtime as runtime

    assert set(e2e.SWITCH_ABS) == {"device_topology", "commit_reuse", "early_sampled_copy", "gdn_metadata_fast",
                                   "weaver_lazy_tail", "kv_compact_kernel", "greedy_accept_kernel", "one_slot_commit",
                                   "context_order_kernel", "commit_overlap", "drafter_graphs", "topk_kernel",
                                   "prompt_overlap"}
    for name, sw in e2e.SWITCH_ABS.items():
        assert callable(getattr(runtime, sw.setter)) and sw.setter in runtime.__all__
        assert e2e_report.SWITCH_AB_TITLES[sw.ab_key][0] == sw.flag
    assert set(e2e_report.SWITCH_AB_TITLES) == {sw.ab_key for sw in e2e.SWITCH_ABS.values()}
    assert e2e.parse_ab_switches(["early_sampled_copy", "commit_reuse"], commit_reuse=True, device_topology=True) == [
        "early_sampled_copy", "commit_reuse", "device_topology"]
    with pytest.raises(ValueError, match="--ab-switch: unknown switch 'early_copy'; expected one of device_topology, "
                                         "commit_reuse, early_sampled_copy, gdn_metadata_fast, weaver_lazy_tail, kv_compact_kernel, "
                                         "greedy_accept_kernel, one_slot_commit, context_order_kernel, commit_overlap, "
                                         "drafter_graphs, topk_kernel, prompt_overlap"):
        e2e.parse_ab_switches(["early_copy"])


def test_the_early_copy_ab_is_reported_under_its_title() -> None:
    md = _switch_ab_markdown("early_sampled_copy_ab", "early_sampled_copy", 160.0,
                             [(False, 150.0), (True, 161.0), (True, 159.0), (False, 152.0)])
    title = "The sampled tokens' copy before the commit (on) / after it (off) on the same engine"
    assert md.index("- tfm64: batch 1: on 160.0, off 150.0, on 161.0, on 159.0, off 152.0 "
                    "(A/B runs' means: on 160.0 of 2, off 151.0 of 2)") > md.index(title)
    assert "ms per tree step" not in md  # runs without steps


def test_a_switch_ab_with_steps_reports_each_settings_step_time() -> None:
    res = results()
    run = res["arms"]["tfm64"]["batches"]["1"]
    run["decode_tokens_per_s"] = 160.0
    run["early_sampled_copy_ab"] = [{"early_sampled_copy": on, "decode_tokens_per_s": v, "decode_ms_per_step": ms}
                                    for on, v, ms in [(False, 150.0, 21.0), (True, 161.0, 20.5), (True, 159.0, 20.7),
                                                      (False, 152.0, 21.2)]]
    md = e2e_report.render_markdown(res)
    assert "(A/B runs' means: on 160.0 of 2, off 151.0 of 2); ms per tree step, A/B runs' means: on 20.60, off 21.10" in md


def test_the_vl_target_is_the_same_language_model_in_the_published_class(tmp_path: Path) -> None:
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig

    # transformers' own classes, not AutoConfig's registry (vLLM registers its config classes there once a test
    # has built a vLLM model config in this process)
    text = Qwen3_5TextConfig.from_pretrained(e2e_models.write_target(tmp_path / "t"))
    cfg = Qwen3_5Config.from_pretrained(e2e_models.write_target(tmp_path / "vl", vl=True))
    assert cfg.architectures == ["Qwen3_5ForConditionalGeneration"] and cfg.model_type == "qwen3_5"
    tc = cfg.text_config
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size", "linear_num_value_heads",
                "linear_key_head_dim", "num_attention_heads", "num_key_value_heads", "head_dim", "layer_types",
                "mamba_ssm_dtype", "tie_word_embeddings"):
        assert getattr(tc, key) == getattr(text, key), key
    rope = tc.rope_parameters
    assert rope["mrope_section"] == [11, 11, 10] and rope["mrope_interleaved"] is True  # Qwen3.5's own split
    assert rope["rope_theta"] == 1e7 and rope["partial_rotary_factor"] == 0.25
    with torch.device("meta"):
        model = Qwen3_5ForConditionalGeneration(cfg)
    language = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("model.visual."))
    assert language == hand_count_qwen36_27b()  # the same 26.9B parameters; the vision tower is a toy
    assert sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.visual.")) < 1_000_000


def test_the_vl_arm_config_builds_as_the_multimodal_m_rope_class(big: Any, tmp_path: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs

    from _vllm_plugin_env import vllm_cpu_session

    with vllm_cpu_session(tmp_path / "vllm-cache"):
        target = e2e_models.write_target(tmp_path / "vl", vl=True)
        s = {**settings(big), "target": str(target), "target_class": "vl"}
        prof = builtin_geometric_profile(temperatures=(1.0,))
        plan = e2e.arm_profile(e2e.ARMS["tfm16-full"], prof, 1.0, 15)
        kw = e2e.engine_kwargs(e2e.ARMS["tfm16-full"], s, plan)
        assert kw["limit_mm_per_prompt"] == {"image": 0, "video": 0}
        assert "limit_mm_per_prompt" not in e2e.engine_kwargs(e2e.ARMS["tfm16-full"], settings(big), plan)
        mc = EngineArgs(**kw).create_model_config()
        assert mc.architectures == ["Qwen3_5ForConditionalGeneration"] and mc.is_multimodal_model and mc.uses_mrope
        assert spec_config(kw).method == "tfm"


def test_vl_prompts_hold_no_vision_token_and_text_prompts_are_unchanged() -> None:
    import random

    avoid = e2e.vision_token_ids("vl")
    assert avoid == {248053, 248054, 248056, 248057} and e2e.vision_token_ids("text") == frozenset()
    vocab = 248_320
    rng = random.Random(0)  # the earlier prompts, drawn as before
    before = [[rng.randrange(10, vocab - 10) for _ in range(256)] for _ in range(8)]
    assert e2e.prompts(8, 256, vocab, 0) == before
    small = 20  # ids 10..29 hold the avoided ones often: every draw that hits one is drawn again
    ps = e2e.prompts(8, 256, small + 20, 1, frozenset({12, 15, 20}))
    flat = [t for p in ps for t in p]
    assert not {12, 15, 20} & set(flat) and min(flat) >= 10 and max(flat) < small + 10
    assert {11, 13, 14, 16} <= set(flat)  # the others still come
