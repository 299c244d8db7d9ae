"""vllm_tfm.serve (Ray Serve LLM with method "tfm") and the Ray side of the plugin, on CPU.

Without a Ray cluster: the LLMConfig the builder makes (speculative config, autoscaling,
runtime_env), its one-line refusals, the entry-point requirement, and which VLLM_TFM_* variables
vLLM 0.26's own Ray helpers carry to worker actors.

With a local Ray cluster (2-core CI machine: 4 logical CPUs, no dashboard): the application
graph, then one end-to-end request through Serve's HTTP route into an ``LLMServer`` replica whose
engine is a CPU STAND-IN (tests/cpu/_serve_cpu_standin.py: the replica builds the real vLLM engine
config from our LLMConfig with Ray Serve LLM's own function, and the reference tree decoder
replaces vLLM's GPU engine for the tokens). The greedy tokens must equal the target's own greedy
decoding, computed here independently.
"""

from __future__ import annotations

import json
import os
import socket
import time
import urllib.error
import urllib.request
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("ray.serve.llm", reason="the Ray extra is not installed: pip install -e '.[ray]'")

from vllm_tfm.serve import (
    build_llm_config,
    build_tfm_openai_app,
    check_plugin_loadable,
    llm_config_dict,
    plugin_entry_point_installed,
)

HERE = Path(__file__).resolve().parent
SERVE_TIMEOUT_S = 300.0  # replica start: vLLM import + config build + model load, on 2 cores
REQUEST_TIMEOUT_S = 120.0


def base(**over: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"model": "/models/target", "drafter": "/models/drafter", "num_speculative_tokens": 16}
    cfg.update(over)
    return cfg


def one_line_error(exc_type: type[Exception], fn: Any, *args: Any, match: str, **kw: Any) -> str:
    with pytest.raises(exc_type, match=match) as info:
        fn(*args, **kw)
    message = str(info.value)
    assert "\n" not in message, message
    return message


# --------------------------------------------------------------------------- the LLMConfig


def test_llm_config_holds_the_tfm_speculative_config_scaling_and_environment() -> None:
    cfg = base(
        model_id="qwen-tfm",
        tree={"proposal": "ddtree", "top_k": 64},
        engine_kwargs={"max_model_len": 4096},
        accelerator_type="H200",
        tensor_parallel_size=2,
        min_replicas=1,
        max_replicas=3,
        target_ongoing_requests=8,
        env={"VLLM_TFM_KERNELS": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"},
        runtime_env={"env_vars": {"VLLM_TFM_KERNELS": "1", "HF_HOME": "/hf"}},
    )
    d = llm_config_dict(cfg, environ={"VLLM_TFM_PROPOSAL": "chain", "VLLM_TFM_PROFILE": "1", "PATH": "/bin"})
    assert d["model_loading_config"] == {"model_id": "qwen-tfm", "model_source": "/models/target"}
    assert d["engine_kwargs"] == {
        "max_model_len": 4096,
        "speculative_config": {
            "method": "tfm",
            "model": "/models/drafter",
            "num_speculative_tokens": 16,
            "proposal": "ddtree",
            "top_k": 64,
            "attention_backend": "TRITON_ATTN",
        },
        "tensor_parallel_size": 2,
    }
    assert d["deployment_config"] == {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 8}}
    assert d["accelerator_type"] == "H200"
    # the builder's VLLM_TFM_* variables, then the user's runtime_env, then `env` (later wins); PATH stays out
    assert d["runtime_env"]["env_vars"] == {
        "VLLM_TFM_PROPOSAL": "chain",
        "VLLM_TFM_PROFILE": "1",
        "VLLM_TFM_KERNELS": "0",
        "HF_HOME": "/hf",
        "VLLM_USE_FLASHINFER_SAMPLER": "0",
    }
    # vLLM never loads plugins in the replica (Ray Serve LLM hands it a config built in a Ray task):
    # the callback registers vllm-tfm there, so the request guard runs (vllm_tfm/serve/replica.py)
    assert d["callback_config"] == {"callback_class": "vllm_tfm.serve.replica_callback.TfmReplicaCallback"}
    no_backend = llm_config_dict(base(drafter_attention_backend=None), environ={})
    assert "attention_backend" not in no_backend["engine_kwargs"]["speculative_config"]
    assert no_backend["model_loading_config"]["model_id"] == "/models/target"  # like `vllm serve`


def test_bad_configs_are_refused_in_one_line() -> None:
    def check(cfg: dict[str, Any], match: str, exc: type[Exception] = ValueError) -> str:
        return one_line_error(exc, llm_config_dict, cfg, match=match, environ={})

    assert "fields are model, model_id, drafter" in check(base(drafter_dir="/x"), r"drafter_dir: unknown field")
    check(base(num_speculative_tokens=0), r"num_speculative_tokens: Input should be greater than or equal to 1")
    check(base(num_speculative_tokens=257), r"num_speculative_tokens: Input should be less than or equal to 256")
    check(base(tree={"topk": 3}), r"tree: unknown tree option 'topk' \(tree options are proposal, width, top_k")
    check(base(engine_kwargs={"speculative_config": {}}), r"'speculative_config' is set by the tfm builder from the fields 'drafter'")
    check(base(engine_kwargs={"distributed_executor_backend": "mp"}), r"set by the tfm builder from Ray Serve LLM")
    check(base(deployment_config={"num_replicas": 2}), r"use min_replicas, max_replicas and target_ongoing_requests")
    check(base(min_replicas=3, max_replicas=2), r"min_replicas 3 is above max_replicas 2")
    check(base(max_replicas=2), r"max_replicas 2 > min_replicas 1 needs target_ongoing_requests")
    check(base(env={"VLLM_TFM_PROPOSSAL": "chain"}), r"unknown environment variable VLLM_TFM_PROPOSSAL")
    with pytest.raises(ValueError, match=r"unknown environment variable VLLM_TFM_TOPK"):
        llm_config_dict(base(), environ={"VLLM_TFM_TOPK": "4"})  # a typo in the builder's own environment


def test_tree_options_of_a_local_drafter_are_resolved_like_the_engine_does(tmp_path: Path) -> None:
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "tfm_config.json").write_text(json.dumps({"proposal": "ddtree", "top_k": 0}))
    one_line_error(ValueError, llm_config_dict, base(drafter=str(drafter)), environ={}, match=r"tfm_config.json: top_k: Input should be greater than 0")
    (drafter / "tfm_config.json").write_text(json.dumps({"proposal": "ddtree"}))
    assert llm_config_dict(base(drafter=str(drafter)), environ={})["engine_kwargs"]["speculative_config"]["model"] == str(drafter)
    msg = one_line_error(ValueError, llm_config_dict, base(drafter=str(drafter)), environ={"VLLM_TFM_PROPOSAL": "tfm"}, match=r"proposal 'tfm' needs tfm_config.json with a 'weaver' section")
    assert msg.startswith("environment VLLM_TFM_PROPOSAL='tfm'")
    one_line_error(ValueError, llm_config_dict, base(drafter=str(drafter), tree={"sampling": "nope"}), environ={}, match=r"speculative_config sampling='nope': sampling:")


ENTRY_POINT = EntryPoint(name="tfm", value="vllm_tfm:register", group="vllm.general_plugins")
needs_installed_plugin = pytest.mark.skipif(
    not plugin_entry_point_installed(),
    reason="vllm-tfm is not pip-installed here (no vllm.general_plugins entry point): pip install -e '.[test,ray]'",
)  # CI installs it and .ci/run fails when the entry point is missing, so this never skips there


@pytest.fixture
def entry_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process sees vllm-tfm's entry point (for the builder's check), installed or not."""
    from vllm_tfm.serve import environment

    monkeypatch.setattr(environment, "entry_points", lambda group: [ENTRY_POINT] if group == ENTRY_POINT.group else [])


def test_the_plugin_entry_point_is_required(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_tfm.serve import environment

    monkeypatch.setattr(environment, "entry_points", lambda group: [ENTRY_POINT])
    check_plugin_loadable({})
    check_plugin_loadable({"VLLM_PLUGINS": "other,tfm"})
    one_line_error(ValueError, check_plugin_loadable, {"VLLM_PLUGINS": "other"}, match=r"VLLM_PLUGINS='other' leaves out 'tfm'")
    one_line_error(ValueError, build_llm_config, base(env={"VLLM_PLUGINS": "lora"}), environ={}, match=r"leaves out 'tfm'")
    one_line_error(ValueError, build_llm_config, base(), environ={"VLLM_PLUGINS": "lora"}, match=r"VLLM_PLUGINS='lora' leaves out")
    build_llm_config(base(env={"VLLM_PLUGINS": "tfm"}), environ={"VLLM_PLUGINS": "lora"})  # the replicas' own wins
    other = EntryPoint(name="tfm", value="someone_else:register", group=ENTRY_POINT.group)
    for found in ([], [other]):
        monkeypatch.setattr(environment, "entry_points", lambda group, found=found: found)
        one_line_error(RuntimeError, build_llm_config, base(), environ={}, match=r"vllm-tfm is not installed in this Python environment")


def test_ray_serve_llm_accepts_the_config_and_runs_vllm_with_the_ray_executor(entry_point: None) -> None:
    llm_config = build_llm_config(base(model_id="m", accelerator_type="H200", tensor_parallel_size=2), environ={})
    engine = llm_config.get_engine_config()
    kwargs = engine.get_initialization_kwargs()
    assert kwargs["distributed_executor_backend"] == "ray"
    assert kwargs["model"] == "/models/target" and kwargs["served_model_name"] == ["m"]
    assert kwargs["speculative_config"]["method"] == "tfm" and kwargs["tensor_parallel_size"] == 2
    assert engine.placement_bundles == [{"GPU": 1, "accelerator_type:H200": 0.001}] * 2
    with pytest.raises(ValueError, match=r"Unsupported accelerator type: H300"):
        build_llm_config(base(accelerator_type="H300"), environ={})


# --------------------------------------------------------------------------- VLLM_TFM_* to Ray workers


def test_vllm_ray_executors_carry_tfm_variables_to_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM 0.26's own helpers decide what reaches its Ray worker actors: ours must be in."""
    pytest.importorskip("vllm")
    from ray.runtime_env import RuntimeEnv
    from vllm.config import ParallelConfig
    from vllm.ray.ray_env import get_env_vars_to_copy
    from vllm.v1.executor.ray_env_utils import get_driver_env_vars
    from vllm.v1.executor.ray_executor_v2 import RayExecutorV2
    from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS

    monkeypatch.setenv("VLLM_TFM_KERNELS", "0")
    monkeypatch.setenv("VLLM_TFM_FORCE_TREE_PATH", "1")
    monkeypatch.setenv("VLLM_TFM_PROPOSAL", "chain")
    # legacy RayDistributedExecutor: names with the VLLM_ prefix present in the driver
    legacy = get_env_vars_to_copy(exclude_vars=WORKER_SPECIFIC_ENV_VARS, additional_vars=set())
    assert {"VLLM_TFM_KERNELS", "VLLM_TFM_FORCE_TREE_PATH", "VLLM_TFM_PROPOSAL"} <= legacy
    # RayExecutorV2 (the default): the driver's whole environment, applied with setdefault
    v2 = get_driver_env_vars(worker_specific_vars=WORKER_SPECIFIC_ENV_VARS)
    assert v2["VLLM_TFM_KERNELS"] == "0" and v2["VLLM_TFM_FORCE_TREE_PATH"] == "1"
    # and the worker actors' runtime_env starts from the replica's (what the Serve builder sets)
    executor = object.__new__(RayExecutorV2)
    executor.parallel_config = ParallelConfig(ray_runtime_env=RuntimeEnv(env_vars={"VLLM_TFM_KERNELS": "0"}))
    assert executor._build_runtime_env()["env_vars"]["VLLM_TFM_KERNELS"] == "0"


# --------------------------------------------------------------------------- a local Ray cluster


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def ray_cluster() -> Any:
    """A local Ray cluster sized for the 2-core CI machine; Serve and Ray are shut down after."""
    import ray
    from ray import serve

    if ray.is_initialized():
        pytest.fail("a Ray session is already running in this process")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, configure_logging=False)
    port = _free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield {"port": port}
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A random tiny Qwen3.5 hybrid target (float32 weights) and its random drafter directory
    (DFlash + Weaver, tfm_config.json proposal 'tfm')."""
    import torch

    from vllm_tfm.reference.toy_drafters import random_drafters
    from vllm_tfm.reference.toy_targets import tiny_qwen3_5

    root = tmp_path_factory.mktemp("serve-models")
    target = tiny_qwen3_5(seed=31)
    target.save_pretrained(root / "target")
    random_drafters(target, seed=32, block_size=8).save_pretrained(root / "drafter")
    prompt = [5, 17, 3, 44, 9]
    ids = torch.tensor([prompt])
    greedy = []
    with torch.no_grad():  # the target's own greedy decoding, full recompute each step
        for _ in range(12):
            nxt = int(target(ids).logits[0, -1].argmax())
            greedy.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return {"root": root, "target": root / "target", "drafter": root / "drafter", "prompt": prompt, "greedy": greedy}


def standin_config(tiny: dict[str, Any], report: Path) -> dict[str, Any]:
    python_path = os.pathsep.join(p for p in (str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    return {
        "model": str(tiny["target"]),
        "model_id": "tiny-tfm",
        "drafter": str(tiny["drafter"]),
        "num_speculative_tokens": 6,
        "tree": {"top_k": 16},
        "engine_kwargs": {"skip_tokenizer_init": True, "max_model_len": 512, "dtype": "float32"},
        "placement_group_config": {"bundles": [{"CPU": 1}]},  # CPU-only engine placement (no GPU here)
        "env": {
            "VLLM_TFM_PROPOSAL": "ddtree",  # beats tfm_config.json's 'tfm': must reach the config builder
            "VLLM_TFM_KERNELS": "0",  # a worker switch: must reach the replica
            "RAYLLM_VLLM_ENGINE_CLS": "_serve_cpu_standin:CpuStandInEngine",
            "TFM_STANDIN_REPORT": str(report),
            "PYTHONPATH": python_path,
        },
    }


def test_app_graph_is_an_openai_ingress_over_a_tfm_replica(
    ray_cluster: Any, tiny_models: dict[str, Any], tmp_path: Path, entry_point: None
) -> None:
    app = build_tfm_openai_app(standin_config(tiny_models, tmp_path / "r.json"), environ={})
    ingress = app._bound_deployment
    assert ingress.func_or_class.__name__.endswith("OpenAiIngress") or "Ingress" in ingress.name
    (model_id, llm_app), = ingress.init_kwargs["llm_deployments"].items()
    assert model_id == "tiny-tfm"
    server = llm_app._bound_deployment
    llm_config = server.init_kwargs["llm_config"]
    assert llm_config.engine_kwargs["speculative_config"]["method"] == "tfm"
    env_vars = server.ray_actor_options["runtime_env"]["env_vars"]
    assert env_vars["VLLM_TFM_PROPOSAL"] == "ddtree" and env_vars["VLLM_TFM_KERNELS"] == "0"
    assert server._deployment_config.autoscaling_config.min_replicas == 1


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=REQUEST_TIMEOUT_S) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _wait_running(name: str, deadline: float) -> None:
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    while True:
        app = serve.status().applications.get(name)
        status = app.status if app is not None else None
        if status == ApplicationStatus.RUNNING:
            return
        if status in (ApplicationStatus.DEPLOY_FAILED, ApplicationStatus.UNHEALTHY):
            pytest.fail(f"the Serve application failed: {status}: {app.message}")
        if time.time() > deadline:
            pytest.fail(f"the Serve application was not RUNNING after {SERVE_TIMEOUT_S:.0f} s: {status}: {app and app.message}")
        time.sleep(1.0)


@pytest.mark.slow
@needs_installed_plugin  # the replica's vLLM loads vllm-tfm through the installed entry point
def test_serve_answers_an_openai_completion_end_to_end_with_a_cpu_stand_in_engine(
    ray_cluster: Any, tiny_models: dict[str, Any], tmp_path: Path
) -> None:
    from ray import serve
    from ray.serve import RunTarget

    report_path = tmp_path / "replica_report.json"
    app = build_tfm_openai_app(standin_config(tiny_models, report_path), environ={})
    name = "tfm-standin"
    serve.run_many([RunTarget(target=app, name=name, route_prefix="/")], wait_for_applications_running=False)
    try:
        _wait_running(name, time.time() + SERVE_TIMEOUT_S)
        base_url = f"http://127.0.0.1:{ray_cluster['port']}/v1"
        prompt, expected = tiny_models["prompt"], tiny_models["greedy"]

        status, body = _post(f"{base_url}/completions", {"model": "tiny-tfm", "prompt": prompt, "max_tokens": len(expected), "temperature": 0.0, "return_token_ids": True})
        assert status == 200, body
        assert body["model"] == "tiny-tfm"
        assert body["choices"][0]["token_ids"] == expected  # tree speculative decoding == the target's greedy
        assert body["usage"]["completion_tokens"] == len(expected)

        # the plugin's request guard runs in the replica: prompt logprobs are refused with HTTP 400
        status, body = _post(f"{base_url}/completions", {"model": "tiny-tfm", "prompt": prompt, "max_tokens": 4, "prompt_logprobs": 1})
        assert status == 400, body
        assert "prompt_logprobs is not supported with speculative method 'tfm'" in json.dumps(body)

        with urllib.request.urlopen(f"{base_url}/models", timeout=REQUEST_TIMEOUT_S) as r:
            assert [m["id"] for m in json.loads(r.read())["data"]] == ["tiny-tfm"]

        report = json.loads(report_path.read_text())
        assert report["pid"] != os.getpid()  # the replica actor (its engine config came from a Ray task)
        assert "tfm=vllm_tfm:register" in report["entry_points"] and report["plugin_registered"]
        assert report["method"] == "tfm" and report["num_speculative_tokens"] == 6
        opts = report["tfm_options"]
        assert (opts["proposal"], opts["budget"], opts["top_k"]) == ("ddtree", 6, 16)  # env beat the file; tree beat both
        # tfm's CUDA-graph decision (vllm_plugin/cuda_graphs.py) was made where the config was built:
        # no cudagraph_mode given, so FULL_AND_PIECEWISE on one GPU (cuda_graphs.DEFAULT_MODE) with tfm's capture
        # sizes k * (B + 1) for B = 6 (max_num_seqs not set: up to min(64, max(16, 1024 // 7)) = 64 requests),
        # one-token sizes below B + 1
        assert report["enforce_eager"] is False
        assert report["cudagraph_capture_sizes"] == sorted({1, 2, 4, *(7 * k for k in range(1, 65))})
        assert report["served_model_name"] == ["tiny-tfm"] or report["served_model_name"] == "tiny-tfm"
        assert report["env"] == {"VLLM_TFM_PROPOSAL": "ddtree", "VLLM_TFM_KERNELS": "0"}
        assert report["vllm_ray_legacy_copies"] == ["VLLM_TFM_KERNELS", "VLLM_TFM_PROPOSAL"]
        assert report["vllm_ray_v2_copies"] == ["VLLM_TFM_KERNELS", "VLLM_TFM_PROPOSAL"]
    finally:
        serve.delete(name)

