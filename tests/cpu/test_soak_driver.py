"""The soak driver (bench/soak.py, soak_server.py, soak_probes.py) on CPU.

* The ``vllm serve`` command it builds parses with vLLM 0.26's own serve parser into the engine
  arguments the GPU host needs (tfm and no-spec roles).
* Helpers against hand-computed values: the KV-cache estimate, nvidia-smi parsing, the process
  tree, facts from a vLLM log.
* Both phases end to end against stand-in servers (subprocesses of tests/cpu/_openai_standin.py
  that answer like vLLM and emulate tfm's refusals): the JSON result, the verdict lines, a planted
  greedy divergence found and explained, preemptions counted, every server stopped.
"""

from __future__ import annotations

import dataclasses

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("aiohttp", reason="aiohttp (a vLLM dependency) is needed by the soak client")
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import soak
import soak_client as sc
import soak_probes
import soak_server

STANDIN = Path(__file__).resolve().parent / "_openai_standin.py"


def free_port_block(n: int) -> int:
    """A port p such that p .. p + n - 1 are free on 127.0.0.1 right now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port block")


# ----------------------------------------------------------------------------------- the command
def test_vllm_command_parses_with_vllm_serve_parser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm", reason="the serve parser needs vLLM 0.26")
    from vllm.platforms import current_platform

    monkeypatch.setattr(current_platform, "device_type", "cpu")  # building the parser needs a device type
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.openai.cli_args import (
        make_arg_parser,
        validate_parsed_serve_args,
    )
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cfg = soak.SoakConfig(out=tmp_path, target="/models/target", drafter="/models/drafter", budget=12, proposal="ddtree",
                          async_scheduling=True)
    parser = make_arg_parser(FlexibleArgumentParser())
    for role in (soak.Role("tfm", 8400, True, 3 << 30, 2048), soak.Role("nospec", 8401, False, 1 << 30, 1024)):
        cmd = soak.vllm_command(role, cfg)
        assert cmd[:5] == [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", "/models/target"]
        args = parser.parse_args(cmd[4:])  # after "serve": the model, then the options
        validate_parsed_serve_args(args)
        assert (args.host, args.port, args.served_model_name) == ("127.0.0.1", role.port, ["soak"])
        assert args.disable_uvicorn_access_log and args.generation_config == "vllm"
        args.model = args.model_tag
        ea = AsyncEngineArgs.from_cli_args(args)
        assert ea.model == "/models/target" and ea.dtype == "float32" and ea.enforce_eager
        assert ea.kv_cache_memory_bytes == role.kv_cache_bytes and ea.max_model_len == role.max_model_len
        assert ea.enable_prefix_caching is False and ea.gpu_memory_utilization == 0.3 and ea.max_num_seqs == 64
        assert str(ea.attention_backend) == "TRITON_ATTN" or getattr(ea.attention_backend, "name", "") == "TRITON_ATTN"
        assert ea.additional_config == {"gdn_prefill_backend": "triton"}
        assert ea.async_scheduling is (True if role.spec else None)  # None: vLLM's default (on for no-spec)
        if role.spec:
            assert ea.speculative_config == {"method": "tfm", "model": "/models/drafter", "num_speculative_tokens": 12,
                                             "attention_backend": "TRITON_ATTN", "proposal": "ddtree"}
        else:
            assert ea.speculative_config is None
    sync = soak.vllm_command(soak.Role("tfm", 8400, True, 3 << 30, 2048), dataclasses.replace(cfg, async_scheduling=False))
    args = parser.parse_args(sync[4:])
    args.model = args.model_tag
    assert AsyncEngineArgs.from_cli_args(args).async_scheduling is False  # --no-async-scheduling, as vLLM reads it


# ----------------------------------------------------------------------------------- helpers
def test_kv_estimate_by_hand(tmp_path: Path) -> None:
    t, d = tmp_path / "t", tmp_path / "d"
    t.mkdir()
    d.mkdir()
    (t / "config.json").write_text(json.dumps({
        "num_hidden_layers": 8, "full_attention_interval": 4, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 64, "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "num_key_value_heads": 2,
        "head_dim": 64, "hidden_size": 256, "num_attention_heads": 4}))
    (d / "config.json").write_text(json.dumps({"num_hidden_layers": 3, "num_key_value_heads": 2, "head_dim": 64,
                                               "hidden_size": 256, "num_attention_heads": 4}))
    # 6 GDN layers x 17 slots x (ssm 4*64*64*4 + conv (2*2*64 + 4*64) * (3 + 16) * 4)
    # + (1024 + 17) tokens x (2 target + 3 drafter attention layers) x 2 * 2 * 64 * 4 bytes
    expect = 17 * 6 * (65536 + 512 * 19 * 4) + 1041 * 5 * 1024
    assert soak.estimate_request_kv_bytes(str(t), str(d), budget=16, max_model_len=1024) == expect
    cfg = json.loads((t / "config.json").read_text())
    cfg["layer_types"] = ["linear_attention"] * 7 + ["full_attention"]
    (t / "config.json").write_text(json.dumps(cfg))
    assert soak.estimate_request_kv_bytes(str(t), str(d), budget=16, max_model_len=1024) == (
        17 * 7 * (65536 + 512 * 19 * 4) + 1041 * 4 * 1024)
    # one GDN state slot per request (gdn_state_slots "one"): one slot, the conv window keeps vLLM's W - 1 + B columns
    assert soak.estimate_request_kv_bytes(str(t), str(d), budget=16, max_model_len=1024, gdn_state_slots="one") == (
        1 * 7 * (65536 + 512 * 19 * 4) + 1041 * 4 * 1024)
    with pytest.raises(ValueError, match=r"^gdn_state_slots='two': 'per_draft' or 'one'$"):
        soak.estimate_request_kv_bytes(str(t), str(d), budget=16, max_model_len=1024, gdn_state_slots="two")


def test_the_recorded_command_carries_the_plugins_switches() -> None:
    env = {"VLLM_TFM_GDN_STATE_SLOTS": "one", "PATH": "/bin", "VLLM_TFM_KERNELS": "0", "VLLM_USE_V1": "1"}
    assert soak.soak_command(["--phase", "preempt", "--cuda-graphs"], env) == (
        "VLLM_TFM_GDN_STATE_SLOTS=one VLLM_TFM_KERNELS=0 python3 bench/soak.py --phase preempt --cuda-graphs")
    assert soak.soak_command([], {}) == "python3 bench/soak.py"


def test_the_gdn_state_slots_follow_the_plugins_switch() -> None:
    # the plugin's default "auto" is one slot on one GPU, where the soak's servers run
    assert soak.gdn_state_slots_from_env({}) == "one"
    assert soak.gdn_state_slots_from_env({"VLLM_TFM_GDN_STATE_SLOTS": "auto"}) == "one"
    assert soak.gdn_state_slots_from_env({"VLLM_TFM_GDN_STATE_SLOTS": "one"}) == "one"
    assert soak.gdn_state_slots_from_env({"VLLM_TFM_GDN_STATE_SLOTS": "per_draft"}) == "per_draft"
    # the plugin's parsing, not a second one: a value the plugin refuses is not turned into "one" here
    with pytest.raises(ValueError, match=r"^gdn_state_slots='ONE': 'auto', 'per_draft' or 'one'$"):
        soak.gdn_state_slots_from_env({"VLLM_TFM_GDN_STATE_SLOTS": "ONE"})


def test_nvidia_smi_parsing_and_process_tree() -> None:
    text = "1234, 2048\n1234, 16\n99, 512\nNo running processes found\n"
    assert soak_server.parse_compute_apps(text) == {1234: 2064.0, 99: 512.0}
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        tree = soak_server.process_tree(os.getpid())
        assert os.getpid() in tree and child.pid in tree
        assert soak_server.process_tree(child.pid) == {child.pid}
    finally:
        child.kill()
        child.wait()


def test_memory_change_prefers_the_server_processes() -> None:
    before = {"mib": 1000.0, "gpu_used_mib": 5000.0}
    during = [{"mib": 1300.0, "gpu_used_mib": 5300.0}, {"mib": None, "gpu_used_mib": 9000.0}]
    after = {"mib": 1010.0, "gpu_used_mib": 5020.0}
    assert soak.memory_change(before, during, after) == {"memory_delta_mib": 10.0, "memory_peak_mib": 1300.0,
                                                         "memory_source": "server processes"}
    no_pids = [{k: v for k, v in m.items() if k != "mib"} for m in (before, *during, after)]
    assert soak.memory_change(no_pids[0], no_pids[1:3], no_pids[3]) == {"memory_delta_mib": 20.0, "memory_peak_mib": 9000.0,
                                                                        "memory_source": "whole GPU"}
    assert soak.memory_change({}, [], {})["memory_delta_mib"] is None


def test_memory_verdict_judges_the_second_round() -> None:
    # the first round holds what the engine allocates once (the soak_zoo.json.gz run: +320 MiB, then +0 MiB), the second repeats it
    first, again = {"memory_delta_mib": 312.0, "memory_source": "server processes"}, {"memory_delta_mib": 2.0,
                                                                                       "memory_source": "server processes"}
    assert soak.memory_verdict(first, again, 64.0) == {
        "memory_test": "second round", "memory_first_round_mib": 312.0, "memory_delta_mib": 2.0,
        "memory_source": "server processes", "memory_flat": True}
    leak = soak.memory_verdict({"memory_delta_mib": 10.0}, {"memory_delta_mib": 65.0, "memory_source": "whole GPU"}, 64.0)
    assert leak["memory_flat"] is False and leak["memory_delta_mib"] == 65.0 and leak["memory_source"] == "whole GPU"
    assert soak.memory_verdict(first, {"memory_delta_mib": 64.0}, 64.0)["memory_flat"] is True  # the limit itself passes
    # no second round (--one-round, or no time left): the first round is judged, warm-up growth included
    one = soak.memory_verdict(first, None, 64.0)
    assert one == {"memory_test": "first round", "memory_delta_mib": 312.0, "memory_source": "server processes",
                   "memory_flat": False}
    # not measured (no nvidia-smi): no verdict either way
    assert soak.memory_verdict({"memory_delta_mib": None}, {"memory_delta_mib": None}, 64.0)["memory_flat"] is None
    assert soak.memory_verdict(None, None, 64.0) == {"memory_test": None, "memory_delta_mib": None, "memory_source": None,
                                                     "memory_flat": None}


def test_allocator_summary_reads_the_tfm_stats_lines() -> None:
    text = (
        "(EngineCore pid=7) INFO 11-29 13:41:12 [hooks.py:9] vllm-tfm: last 10.0 s: 60 steps, 12 with trees; "
        "proposals: tfm 12; host ms per step: propose 20.4; GPU MiB allocated 812, reserved 1100\n"
        "(APIServer pid=5) INFO 11-29 13:41:12 [loggers.py:310] Engine 000: Avg prompt throughput: 884.8 tokens/s\n"
        "(EngineCore pid=7) INFO 11-29 13:41:22 [hooks.py:9] vllm-tfm: last 10.0 s: 50 steps, 10 with trees; "
        "proposals: tfm 10; host ms per step: propose 21.0; GPU MiB allocated 790, reserved 1024\n"
        "(EngineCore pid=7) INFO 11-29 13:41:32 [hooks.py:9] vllm-tfm: last 10.0 s: 5 steps, 0 with trees; "
        "proposals: chain 5; host ms per step: propose 2.0\n"  # a line without the allocator (a CPU engine)
    )
    assert soak_server.allocator_summary(text) == {"lines": 2, "allocated_last_mib": 790.0, "reserved_last_mib": 1024.0,
                                                   "reserved_max_mib": 1100.0}
    assert soak_server.allocator_summary("Engine 000: Avg prompt throughput")["lines"] == 0
    # the line as the engine writes it (runtime/metrics.py)
    from vllm_tfm.vllm_plugin.runtime.metrics import Metrics

    m = Metrics(max_depth=4)
    m.interval_report(0.0, 10.0)
    m.steps += 3
    line = m.interval_report(10.0, 10.0, lambda: (300.2, 512.0))
    assert soak_server.allocator_summary(f"(EngineCore pid=7) INFO [hooks.py:9] {line}\n")["reserved_last_mib"] == 512.0


def test_graph_summary_sums_the_graph_counts_of_the_tfm_stats_lines() -> None:
    from vllm_tfm.vllm_plugin.runtime.metrics import Metrics

    m = Metrics(max_depth=4)
    m.interval_report(0.0, 10.0)
    lines = []
    for t, counts in ((10.0, {"tree.FULL": 5, "tree.full_replay": 5, "other.PIECEWISE": 2}), (20.0, {"tree.PIECEWISE": 3}),
                      (30.0, {}), (40.0, {"tree.FULL": 1, "tree.full_replay": 1})):
        m.steps += 1
        for name, c in counts.items():
            for _ in range(c):
                m.hook(f"cudagraph.{name}")
        lines.append(f"(EngineCore pid=7) INFO 11-29 [hooks.py:9] {m.interval_report(t, 10.0, lambda: (300.0, 512.0))}")
    text = "\n".join(lines) + "\n(APIServer pid=5) INFO Engine 000: Avg prompt throughput: 884.8 tokens/s\n"
    assert soak_server.graph_summary(text) == {"other.PIECEWISE": 2, "tree.FULL": 6, "tree.PIECEWISE": 3,
                                               "tree.full_replay": 6}
    assert soak_server.allocator_summary(text)["lines"] == 4  # the graphs segment keeps the allocator readable
    assert soak_server.graph_summary(lines[2]) == {}  # an interval without graph counters (an eager engine)


def test_cuda_graphs_drops_enforce_eager(tmp_path: Path) -> None:
    role = soak.Role("tfm", 8400, True, 3 << 30, 2048)
    eager = soak.vllm_command(role, soak.SoakConfig(out=tmp_path, target="/t", drafter="/d"))
    graphs = soak.vllm_command(role, soak.SoakConfig(out=tmp_path, target="/t", drafter="/d", cuda_graphs=True))
    assert "--enforce-eager" in eager and "--enforce-eager" not in graphs
    assert [a for a in eager if a != "--enforce-eager"] == graphs
    assert soak.parse_args(["--cuda-graphs"]).cuda_graphs and not soak.parse_args([]).cuda_graphs


def test_async_scheduling_for_the_tfm_server_only(tmp_path: Path) -> None:
    tfm, nospec = soak.Role("tfm", 8400, True, 3 << 30, 2048), soak.Role("nospec", 8401, False, 1 << 30, 2048)
    sync = soak.SoakConfig(out=tmp_path, target="/t", drafter="/d", cuda_graphs=True)
    asy = soak.SoakConfig(out=tmp_path, target="/t", drafter="/d", cuda_graphs=True, async_scheduling=True)
    cmd, sync_cmd = soak.vllm_command(tfm, asy), soak.vllm_command(tfm, sync)
    assert cmd.count("--async-scheduling") == 1 and "--no-async-scheduling" not in cmd
    assert sync_cmd.count("--no-async-scheduling") == 1  # pinned, whatever tfm's default
    assert [a for a in cmd if a != "--async-scheduling"] == [a for a in sync_cmd if a != "--no-async-scheduling"]
    assert soak.vllm_command(nospec, asy) == soak.vllm_command(nospec, sync)  # vLLM's default for no-spec
    assert soak.server_env(asy, tfm) == soak.server_env(sync, tfm)  # the flag alone asks for it
    assert soak.server_env(asy, nospec) == soak.server_env(sync, nospec)
    # the verdict holds the engine to what was asked, from vLLM's own log line (the engine core's, the last)
    said = ("(APIServer pid=1) INFO [vllm.py:1109] Asynchronous scheduling is enabled.\n"
            "(EngineCore pid=2) INFO [vllm.py:1109] Asynchronous scheduling is {}.\n")
    for asked, engine, ok in ((True, "enabled", True), (True, "disabled", False), (False, "disabled", True),
                              (False, "enabled", False)):
        logs = soak_server.log_facts(said.format(engine))
        assert logs["async_scheduling"] is (engine == "enabled")
        res = {"phase": "soak", "config": {"async_scheduling": asked}, "server_logs": {"tfm": logs}}
        v = soak.verdict(res)
        assert v["scheduling_as_asked"] is ok and v["all_ok"] is ok
    assert "async_scheduling" not in soak_server.log_facts("no such line")
    assert soak.parse_args(["--async-scheduling"]).async_scheduling and not soak.parse_args([]).async_scheduling


def test_log_facts() -> None:
    text = (
        "INFO 11-29 [kv_cache_utils.py:1300] GPU KV cache size: 12,345 tokens\n"
        "(EngineCore_DP0 pid=7) INFO 11-29 [kv_cache_utils.py:1305] Maximum concurrency for 1,024 tokens per request: 3.21x\n"
        "WARNING 11-29 [guards.py:150] vllm-tfm: method 'tfm' runs without CUDA graphs for now; setting enforce_eager=True\n"
        "(APIServer pid=5) ERROR 11-29 [serving.py:495] Error in completion stream generator.\n"
        "(APIServer pid=5) Traceback (most recent call last):\n"
        '(APIServer pid=5)   File "serving.py", line 300, in completion_stream_generator\n'
        "(APIServer pid=5)     async for prompt_idx, res in result_generator:\n"
        "(APIServer pid=5) ValueError: presence_penalty is not supported with speculative method 'tfm'\n"
        "(EngineCore_DP0 pid=7) ERROR 11-29 [core.py:1] EngineCore encountered a fatal error.\n"
        "(EngineCore_DP0 pid=7) Traceback (most recent call last):\n"
        '(EngineCore_DP0 pid=7)   File "hooks.py", line 1, in commit_step\n'
        "(EngineCore_DP0 pid=7) RuntimeError: vllm-tfm: 3 of 6 GDN layers ran the tree verify this step\n"
        "(APIServer pid=5) INFO 11-29 13:41:12 [loggers.py:310] Engine 000: Avg prompt throughput: 884.8 tokens/s, "
        "Avg generation throughput: 201.6 tokens/s, Running: 31 reqs\n"
        "(EngineCore_DP0 pid=7) INFO 11-29 13:41:12 [hooks.py:9] vllm-tfm: last 10.0 s: 60 steps, 12 with trees; "
        "proposals: chain 48, tfm 12; host ms per step: propose 20.4\n"
    )
    facts = soak_server.log_facts(text, expected_errors=["is not supported with speculative method 'tfm'"])
    assert facts["kv_cache_tokens"] == 12345
    assert facts["max_concurrency"] == {"tokens_per_request": 1024, "x": 3.21}
    assert facts["error_lines"] == 2 and facts["tracebacks"] == 2 and facts["tracebacks_unexpected"] == 1
    assert facts["unexpected_exceptions"] == ["RuntimeError: vllm-tfm: 3 of 6 GDN layers ran the tree verify this step"]
    assert len(facts["tfm_lines"]) == 2  # the warning and the RuntimeError line
    assert facts["stats_lines"] == [  # vLLM's and tfm's periodic lines, prefixes cut, in order
        "Engine 000: Avg prompt throughput: 884.8 tokens/s, Avg generation throughput: 201.6 tokens/s, Running: 31 reqs",
        "vllm-tfm: last 10.0 s: 60 steps, 12 with trees; proposals: chain 48, tfm 12; host ms per step: propose 20.4",
    ]
    assert soak_server.log_facts(text)["tracebacks_unexpected"] == 2


def test_probe_judging() -> None:
    refused = sc.Outcome(http_status=400, error="presence_penalty is not supported with speculative method 'tfm'", error_code=400)
    wrong_message = sc.Outcome(http_status=400, error="something else", error_code=400)
    streamed = sc.Outcome(http_status=200, error="structured output is not supported with speculative method 'tfm'",
                          error_code=400, streamed_error=True, done=True)
    full = {i: sc.Choice(token_ids=list(range(soak_probes.PROBE_MAX_TOKENS))) for i in range(2)}
    ok2 = sc.Outcome(http_status=200, done=True, choices=full)
    differs = sc.Outcome(http_status=200, done=True, choices={**full, 1: sc.Choice(token_ids=[7] * soak_probes.PROBE_MAX_TOKENS)})
    short = sc.Outcome(http_status=200, done=True, choices={0: sc.Choice(token_ids=[1, 2])})
    tfm = {"presence_penalty": refused, "frequency_penalty": wrong_message, "structured_output/stream": streamed,
           "beam_search": ok2, "logprobs": short}
    rows = {r["probe"]: r for r in soak_probes.judge_probes(tfm, {"beam_search": ok2, "logprobs": short})}
    assert rows["presence_penalty"]["ok"] and rows["presence_penalty"]["how"] == "HTTP 400"
    assert not rows["frequency_penalty"]["ok"]
    assert rows["structured_output/stream"]["ok"] and rows["structured_output/stream"]["how"].startswith("stream error event")
    assert rows["beam_search"]["ok"] and rows["beam_search"]["identical_to_nospec"]
    assert not rows["logprobs"]["ok"]  # 2 of 12 tokens
    assert not rows["min_p"]["ok"] and rows["min_p"]["why"] == "not sent"
    rows = {r["probe"]: r for r in soak_probes.judge_probes({"beam_search": ok2}, {"beam_search": differs})}
    assert not rows["beam_search"]["ok"] and rows["beam_search"]["identical_to_nospec"] is False


# ----------------------------------------------------------------------------------- phases, end to end
def _prompts() -> sc.PromptSource:
    import itertools

    counter = itertools.count(10_000)
    return lambda rng, n: [next(counter)] + [rng.randrange(3, 900) for _ in range(n - 1)]


def _launcher(extra: dict[str, list[str]]):
    def launch(role: soak.Role, cfg: soak.SoakConfig) -> list[str]:
        cmd = [sys.executable, str(STANDIN), "--port", str(role.port)]
        if role.spec:
            cmd.append("--spec")
        return cmd + extra.get(role.name, [])

    return launch


def _cfg(tmp_path: Path, **kw) -> soak.SoakConfig:
    base = {
        "out": tmp_path, "target": "unused", "drafter": "unused", "requests": 80, "concurrency": 8, "max_model_len": 300,
        "deadline_s": 150.0, "startup_timeout_s": 30.0, "port": free_port_block(4), "settle_s": 0.0, "probe_delay_s": 0.3,
        "preempt_requests": 16, "preempt_max_model_len": 300,
    }
    base.update(kw)
    return soak.SoakConfig(**base)


def _all_stopped(res: dict) -> bool:
    return all(v["exit_code"] is not None for v in res["server_logs"].values())


def test_soak_phase_end_to_end_finds_a_planted_divergence(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    prompts = _prompts()
    specs = sc.make_workload(cfg.requests, _prompts(), seed=cfg.seed, max_model_len=cfg.max_model_len)
    victim = next(s for s in specs if s.greedy and s.max_tokens >= 8 and s.disconnect_after_tokens is None)
    # the phase builds its workload from a fresh source with the same counter start: same first tokens
    res = soak.phase_soak(cfg, prompts, {"kind": "test"}, launch=_launcher({"tfm": ["--corrupt", str(victim.prompt[0])]}),
                          started_at=time.monotonic())
    assert json.loads((tmp_path / "soak.json").read_text())["verdict"] == res["verdict"]
    assert _all_stopped(res) and (tmp_path / "tfm.log").is_file() and (tmp_path / "nospec.log").is_file()
    v = res["verdict"]
    assert v["completed"] and v["errors_zero"] and v["disconnects_done"] and v["drained"] and v["probes_ok"], v
    assert v["still_serving"] and v["memory_flat"] is None  # no nvidia-smi on CPU
    assert v["greedy_identical"] is False and not v["all_ok"]
    cmp = res["greedy_vs_nospec"]
    assert cmp["identical"] == cmp["compared"] - 1
    (d,) = cmp["divergences"]
    assert d["index"] == victim.index and d["pos"] == 2
    # the stand-in's top log-probabilities are -0.1 (its token) and -2.5: margin 2.4, rerun = the no-spec prefix
    assert d["nospec_check"]["top2_margin"] == pytest.approx(2.4)
    assert d["nospec_check"]["rerun_tokens"] == d["b"][:3]
    tfm = res["tfm"]["summary"]
    assert tfm["requests"] == 80 and tfm["status_counts"] == {"disconnected": 4, "ok": 76}
    assert res["nospec_requests"] == 80 and res["nospec"]["summary"]["errors"] == 0
    # the second round: the same 80 requests again; the planted divergence shows there too
    again = res["tfm_again"]
    assert again["requests_sent"] == 80 and again["summary"]["status_counts"] == {"disconnected": 4, "ok": 76}
    assert [d["index"] for d in res["greedy_vs_nospec_again"]["divergences"]] == [victim.index]
    assert v["memory_test"] == "second round" and v["memory_first_round_mib"] is None and v["memory_delta_mib"] is None
    assert res["tfm"]["spec_decode"]["drafts"] > 0 and res["nospec"]["spec_decode"]["drafts"] == 0
    assert res["tfm"]["counters"]["vllm:request_success_total{finished_reason=abort}"] >= 4
    assert set(res["ratios"]) == {"throughput_tfm_over_nospec", "p50_latency_tfm_over_nospec", "p99_latency_tfm_over_nospec",
                                  "p50_tpot_tfm_over_nospec"}
    probes = {p["probe"]: p for p in res["probes"]}
    assert set(probes) == {p.name for p in soak_probes.PROBES}
    assert probes["min_p"]["how"] == "HTTP 400" and probes["presence_penalty/stream"]["streamed_error"]
    assert probes["beam_search"]["identical_to_nospec"] and probes["n=3 sampled"]["choices"] == 3


def _memory_by_requests_done(base: float, per_request: float, cap: int):
    """A stand-in's "GPU memory": ``base`` + ``per_request`` MiB per request it finished so far, up to ``cap``
    requests (a cap: growth that stops once the engine has seen the load, none: a leak)."""

    def memory(self: soak_server.Server) -> dict:
        done = sc.metric_value(self.metrics(), "vllm:request_success_total") or 0.0
        return {"mib": base + per_request * min(done, cap), "pids": [self.proc.pid], "gpu_used_mib": None, "t": 0.0}

    return memory


@pytest.mark.parametrize("kind", ["grows once", "leaks"])
def test_soak_memory_verdict_tells_growth_that_stops_from_a_leak(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                kind: str) -> None:
    # 33 warm-up requests, then 80 load requests per round: growing up to 60 requests done happens in the first
    # round only; 1 MiB per request without a cap grows by >= 80 MiB in the second round too
    fake = _memory_by_requests_done(1000.0, 5.0, 60) if kind == "grows once" else _memory_by_requests_done(1000.0, 1.0, 10**9)
    monkeypatch.setattr(soak_server.Server, "memory", fake)
    res = soak.phase_soak(_cfg(tmp_path), _prompts(), {"kind": "test"}, launch=_launcher({}), started_at=time.monotonic())
    v = res["verdict"]
    assert v["memory_test"] == "second round" and v["memory_source"] == "server processes"
    assert res["tfm"]["memory_delta_mib"] == v["memory_first_round_mib"] and res["tfm_again"]["memory_delta_mib"] == v["memory_delta_mib"]
    if kind == "grows once":
        assert v["memory_first_round_mib"] == 5.0 * (60 - 33) and v["memory_delta_mib"] == 0.0
        assert v["memory_flat"] is True and v["all_ok"], v
    else:
        assert v["memory_first_round_mib"] >= 80 and v["memory_delta_mib"] >= 80
        assert v["memory_flat"] is False and not v["all_ok"]
    # one round judges the first round, warm-up growth included: the growth that stops fails it as well
    one = soak.phase_soak(_cfg(tmp_path, second_round=False, port=free_port_block(4)), _prompts(), {"kind": "test"},
                          launch=_launcher({}), started_at=time.monotonic())
    assert "tfm_again" not in one and "greedy_vs_nospec_again" not in one
    assert one["verdict"]["memory_test"] == "first round" and one["verdict"]["memory_flat"] is False


def test_preempt_phase_end_to_end(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path)
    res = soak.phase_preempt(cfg, _prompts(), {"kind": "test"}, launch=_launcher({"tfm_small": ["--preemptions-per-request", "1"]}),
                             kv_small=123456, started_at=time.monotonic())
    assert json.loads((tmp_path / "preempt.json").read_text())["verdict"] == res["verdict"]
    v = res["verdict"]
    assert v["all_ok"] and v["preempted"] and v["greedy_identical"] and v["preemptions"] >= 16, v
    assert res["tfm_small"]["summary"]["requests"] == 16 and _all_stopped(res)
    assert "kv_estimate" not in res  # given explicitly
    again = res["tfm_small_again"]  # the same 16 requests again, preempted again, greedy equal to no-spec again
    assert again["requests_sent"] == 16 and again["summary"]["errors"] == 0 and again["preemptions"] >= 16
    assert res["greedy_vs_nospec_again"]["compared"] > 0 and not res["greedy_vs_nospec_again"]["divergences"]
    assert v["memory_test"] == "second round"


def test_preempt_phase_puts_the_trace_of_a_divergence_into_the_result(tmp_path: Path) -> None:
    """The tfm server runs with VLLM_TFM_TRACE under the phase's OUT; the stand-in writes its trace
    there under the X-Request-Id the load sends (two tokens a step, the second step a resume after
    a preemption); the planted divergence at output 2 is read from it."""
    cfg = _cfg(tmp_path)
    specs = sc.make_workload(cfg.preempt_requests, _prompts(), seed=cfg.seed + 1, max_model_len=cfg.preempt_max_model_len,
                             max_new_tokens=800, long_max_new_tokens=900, greedy_fraction=0.85, disconnect_fraction=0.1,
                             near_max_fraction=0.1, long_fraction=0.7)  # the phase's own workload, same prompt counter
    victim = next(s for s in specs if s.greedy and s.max_tokens >= 10 and s.disconnect_after_tokens is None)
    launch = _launcher({"tfm_small": ["--preemptions-per-request", "1", "--corrupt", str(victim.prompt[0])]})
    res = soak.phase_preempt(cfg, _prompts(), {"kind": "test"}, launch=launch, kv_small=123456, started_at=time.monotonic())
    (d,) = res["greedy_vs_nospec"]["divergences"]
    assert d["index"] == victim.index and d["pos"] == 2
    t = d["trace"]
    recs = t["records"]
    assert [r["no"] for r in recs] == [0, 2, 4, 6, 8][: len(recs)] and len(recs) == 5  # up to 3 steps past the divergent one
    assert all(r["r"].startswith(f"cmpl-load-{victim.index}-0-") for r in recs)
    rd = t["reading"]
    assert t["divergent_step"] == recs[1]["s"] and rd["step"] == recs[1]["s"] and rd["token_in_step"] == 0
    assert rd["resumed_before"] == [recs[1]["s"]] and not rd["none_of_these"]
    assert "resumed after a preemption at step" in rd["line"] and "(the divergent step itself)" in rd["line"]
    assert res["trace"]["files"] and res["trace"]["records"] > 0 and res["trace"]["archive"] == soak.TRACE_ARCHIVE
    assert res["trace"]["mixed_steps"] == {"mixed_non_tree_steps": 0, "misordered_mixed_steps": 0,  # one row a step, tree path
                                           "requests_behind_plain_row": [], "first_misordered": []}  # fmt: skip
    assert (tmp_path / soak.TRACE_ARCHIVE).is_file() and not (tmp_path / "trace_tfm_small").exists()
    saved = json.loads((tmp_path / "preempt.json").read_text())
    assert saved["greedy_vs_nospec"]["divergences"][0]["trace"]["reading"]["line"] == rd["line"]


def test_preempt_phase_with_asynchronous_scheduling_runs_without_the_trace(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin refuses VLLM_TFM_TRACE with asynchronous scheduling: the phase then runs the tfm
    server without the trace, and says so in the result."""
    envs: dict[str, dict[str, str]] = {}
    real_server = soak.Server

    def server(role: soak.Role, cmd: list[str], out: Path, cwd: Path | None = None, env: dict | None = None):
        envs[role.name] = dict(env or {})
        return real_server(role, cmd, out, cwd=cwd, env=env)

    monkeypatch.setattr(soak, "Server", server)
    cfg = _cfg(tmp_path, async_scheduling=True)
    res = soak.phase_preempt(cfg, _prompts(), {"kind": "test"}, launch=_launcher({"tfm_small": ["--preemptions-per-request", "1"]}),
                             kv_small=123456, started_at=time.monotonic())
    assert res["verdict"]["greedy_identical"] and res["verdict"]["preempted"], res["verdict"]
    assert envs["tfm_small"] == envs["nospec"] == {"TRITON_F32_DEFAULT": "ieee"}  # no trace, nothing else
    assert set(res["trace"]) == {"off"} and not (tmp_path / soak.TRACE_ARCHIVE).exists()


def test_a_server_that_never_starts_is_reported(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, startup_timeout_s=3.0)

    def launch(role: soak.Role, c: soak.SoakConfig) -> list[str]:
        return [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"] if role.spec else _launcher({})(role, c)

    res = soak.phase_soak(cfg, _prompts(), {"kind": "test"}, launch=launch, started_at=time.monotonic())
    assert res["fatal"] == "the tfm server did not become healthy"
    assert res["startup"]["tfm"]["healthy"] is False and res["server_logs"]["tfm"]["exit_code"] == 3
    assert res["verdict"]["completed"] is False and not res["verdict"]["all_ok"]


def test_soak_phase_with_the_nospec_server_on_its_own_gpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``nospec_gpu``: the no-spec server gets that GPU (only it), its load runs while tfm's rounds do,
    over the whole workload; ``again_requests`` bounds the second round; both servers get
    TRITON_F32_DEFAULT=ieee."""
    envs: dict[str, dict[str, str]] = {}
    real_server = soak.Server

    def server(role: soak.Role, cmd: list[str], out: Path, cwd: Path | None = None, env: dict | None = None):
        envs[role.name] = dict(env or {})
        return real_server(role, cmd, out, cwd=cwd, env=env)

    spans: list[tuple[str, float, float]] = []
    real_load = soak.load_on

    def load_on(srv, specs, cfg, budget_s, probe_prompt, id_prefix=soak.LOAD_ID_PREFIX):
        t0 = time.monotonic()
        try:
            return real_load(srv, specs, cfg, budget_s, probe_prompt, id_prefix=id_prefix)
        finally:
            spans.append((srv.role.name, t0, time.monotonic()))

    monkeypatch.setattr(soak, "Server", server)
    monkeypatch.setattr(soak, "load_on", load_on)
    res = soak.phase_soak(_cfg(tmp_path, nospec_gpu="7", again_requests=20), _prompts(), {"kind": "test"},
                          launch=_launcher({}), started_at=time.monotonic())
    assert envs["nospec"] == {"TRITON_F32_DEFAULT": "ieee", "CUDA_VISIBLE_DEVICES": "7"}
    assert envs["tfm"] == {"TRITON_F32_DEFAULT": "ieee"}
    (ns,) = [s for s in spans if s[0] == "nospec"]
    tfm_spans = [s for s in spans if s[0] == "tfm"]
    assert len(tfm_spans) == 2 and ns[1] < tfm_spans[0][2]  # the no-spec load began before tfm's first round ended
    assert res["nospec_requests"] == 80 and res["nospec"]["requests_sent"] == 80
    assert res["tfm_again"]["requests_sent"] == 20
    v = res["verdict"]
    assert v["all_started"] and v["requests_started"] == "80 of 80"
    assert v["greedy_identical"] and res["greedy_vs_nospec"]["compared"] > res["greedy_vs_nospec_again"]["compared"] > 0
    assert v["all_ok"], v
