#!/usr/bin/env python3
"""GPU check of tfm under Ray (one GPU): the Ray executor and a Ray Serve OpenAI deployment.

Phases (``--phase all`` runs them in this order, each in its own subprocess with a timeout):
  make     random tiny Qwen3.5 hybrid target (float32, decisive logits) + random DFlash drafter +
           random Weaver (bench/gpu_plugin_e2e.py's ``make``), plus a byte-level tokenizer for the
           target so the OpenAI server can start; skipped with --target/--drafter (e.g. zoo/);
  default  ``LLM(..., speculative_config={"method": "tfm", ...})`` with vLLM's default executor:
           greedy tokens of the prompts (batch) and of prompt 0 alone;
  ray      the same with ``distributed_executor_backend="ray"`` (TP=1): vLLM's RayExecutorV2 puts
           the worker in a Ray actor, which must load vllm-tfm through its entry point;
  serve    ``vllm_tfm.serve.build_tfm_openai_app`` on a local Ray cluster: one OpenAI completion
           request (prompt 0 as token ids) over HTTP, a prompt_logprobs request that tfm must refuse
           with HTTP 400, and /v1/models.
Each engine phase asks its worker(s) what they saw (``collective_rpc``): pid, Ray actor id,
whether the plugin and its runtime hooks are installed, the tree options read from the config
(``VLLM_TFM_TOP_K`` is set in the driver only), the ``VLLM_TFM_*`` variables in the worker's
environment, and the runtime's tree counters. Verdicts in OUT/ray_results.json:
  ray_equals_default   greedy tokens with the Ray executor == with the default executor, all prompts;
  ray_worker_in_actor  the Ray run's worker ran in a Ray actor (another pid) with the plugin and its
                       hooks loaded, the option and the switch from the driver's environment, and
                       verified trees (the runtime's tree_steps > 0);
  serve_equals_default Serve's tokens for prompt 0 == the default executor's for prompt 0 alone;
  serve_refuses        the prompt_logprobs request got HTTP 400 naming tfm;
  scheduling_as_asked  with --async-scheduling (``async_scheduling=True`` in every phase's engine
                       arguments): every phase's workers ran with vLLM's asynchronous scheduling;
                       without it (``async_scheduling=False``, pinned whatever tfm's
                       default): every phase's workers ran with synchronous scheduling.

usage (GPU host, repository root):  bash bench/run_gpu_ray.sh [--async-scheduling]
        or:  python3 bench/gpu_ray_e2e.py --out OUT [--phase all|make|default|ray|serve|summary]
                                          [--target DIR --drafter DIR] [--async-scheduling]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import sys
import time
import traceback
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

T0 = float(os.environ.get("TFM_RAY_T0", time.time()))
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from phase_process import echo_log, run_phase_process  # noqa: E402

ROOT = Path(os.environ.get("TFM_RAY_DIR", "/tmp/tfm-ray-e2e"))
WORK = ROOT / "phases"  # per-phase JSON (OUT keeps the logs and ray_results.json: at most 8 files come back)
BUDGET = int(os.environ.get("TFM_RAY_BUDGET", "7"))
MAX_TOKENS = int(os.environ.get("TFM_RAY_MAX_TOKENS", "32"))
N_PROMPTS = int(os.environ.get("TFM_RAY_PROMPTS", "8"))
DTYPE = os.environ.get("TFM_RAY_DTYPE", "float32")
DEADLINE_S = float(os.environ.get("TFM_RAY_DEADLINE_S", "450"))  # all phases (the install comes on top)
PHASE_CAP_S = {"make": 90, "default": 150, "ray": 170, "serve": 240}  # each also gets at most what is left
SERVE_PORT = int(os.environ.get("TFM_RAY_SERVE_PORT", "8000"))
MODEL_ID = "tfm-tiny"
DRIVER_ONLY_ENV = {"VLLM_TFM_TOP_K": "64"}  # a tree option: must reach workers inside the config
SWITCH_ENV = {"VLLM_TFM_PROFILE": "1"}  # a worker switch: must reach workers' environment


def log(*args: object) -> None:
    print(f"[tfm-ray {time.time() - T0:7.1f}s]", *args, flush=True)


def models(args: argparse.Namespace) -> tuple[str, str]:
    if args.target:
        return args.target, args.drafter
    return str(ROOT / "target"), str(ROOT / "drafter")


def prompts(target: str) -> list[list[int]]:
    vocab = json.loads((Path(target) / "config.json").read_text()).get("vocab_size", 4096)
    rng = random.Random(1234)
    lens = [5, 9, 17, 33, 3, 12, 64, 7] + [rng.randint(1, 100) for _ in range(max(0, N_PROMPTS - 8))]
    return [[rng.randrange(2, vocab - 2) for _ in range(n)] for n in lens[:N_PROMPTS]]


def engine_settings(async_scheduling: bool | None = None) -> dict[str, Any]:
    """vLLM engine arguments of every phase (the GPU bundle's: TRITON_ATTN, triton GDN prefill, eager), with
    ``async_scheduling`` as given (this bench: True with --async-scheduling, else False, pinned whatever
    tfm's default); None leaves it unset (vLLM's default, or tfm's for method tfm)."""
    kw: dict[str, Any] = {
        "dtype": DTYPE, "enforce_eager": True, "seed": 0, "gpu_memory_utilization": 0.3, "max_model_len": 1024,
        "max_num_seqs": 16, "enable_prefix_caching": False, "attention_backend": "TRITON_ATTN",
        "compilation_config": {"custom_ops": ["none"]}, "additional_config": {"gdn_prefill_backend": "triton"},
    }  # fmt: skip
    if async_scheduling is not None:
        kw["async_scheduling"] = bool(async_scheduling)
    return kw


def spec(drafter: str) -> dict[str, Any]:
    return {"method": "tfm", "model": drafter, "num_speculative_tokens": BUDGET, "attention_backend": "TRITON_ATTN"}


# ---------------------------------------------------------------------------------------- make
def phase_make() -> None:
    os.environ["TFM_E2E_DIR"] = str(ROOT)
    sp = importlib.util.spec_from_file_location("gpu_plugin_e2e", REPO / "bench" / "gpu_plugin_e2e.py")
    e2e = importlib.util.module_from_spec(sp)
    sp.loader.exec_module(e2e)
    e2e.phase_make()  # ROOT/target (float32 Qwen3_5ForCausalLM), ROOT/drafter (DFlash + Weaver)
    sys.path.insert(0, str(REPO / "examples"))
    from _tiny_models import write_byte_tokenizer

    cfg = json.loads((ROOT / "target" / "config.json").read_text())
    write_byte_tokenizer(ROOT / "target", vocab_size=cfg["vocab_size"])
    log("models written:", sorted(os.listdir(ROOT / "target")), sorted(os.listdir(ROOT / "drafter")))


# ---------------------------------------------------------------------------------------- engines
def worker_info(worker: Any) -> dict[str, Any]:
    """Run inside each vLLM worker (collective_rpc): what the worker process sees."""
    import os

    info: dict[str, Any] = {"pid": os.getpid(), "tfm_env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_TFM_")},
                            "rank": getattr(worker, "rank", None), "local_rank": getattr(worker, "local_rank", None)}
    try:  # the scheduling the worker's config settled on (VllmConfig.__post_init__, with the plugin's default)
        info["async_scheduling"] = worker.vllm_config.scheduler_config.async_scheduling
    except Exception as e:  # noqa: BLE001
        info["async_scheduling"] = f"error: {e}"
    try:
        import torch

        d = torch.cuda.current_device()
        info["cuda_device"] = d
        info["cuda_pci_bus_id"] = getattr(torch.cuda.get_device_properties(d), "pci_bus_id", None)
    except Exception as e:  # noqa: BLE001
        info["cuda_device"] = f"error: {e}"
    try:
        import ray

        info["ray_actor_id"] = ray.get_runtime_context().get_actor_id() if ray.is_initialized() else None
    except Exception as e:  # noqa: BLE001
        info["ray_actor_id"] = f"error: {e}"
    try:
        from vllm_tfm.vllm_plugin import runtime
        from vllm_tfm.vllm_plugin.options import get_tfm_options
        from vllm_tfm.vllm_plugin.plugin import is_registered

        info["plugin_registered"] = is_registered()
        info["runtime_installed"] = runtime.is_installed()
        info["options"] = get_tfm_options(worker.vllm_config).model_dump(mode="json", exclude={"weaver", "treeflash"})
        from vllm_tfm.vllm_plugin.runtime.state import STATE

        info["one_gdn_state_slot"] = STATE.one_slot  # the worker's resolved layout (options' gdn_state_slots: "auto")
        info["tree_metrics"] = runtime.snapshot_metrics()
    except Exception as e:  # noqa: BLE001
        info["error"] = f"{type(e).__name__}: {e}"
    return info


def spec_counters(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode"):
                out[m.name] = getattr(m, "value", None) if not hasattr(m, "values") else list(m.values)
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def phase_engine(args: argparse.Namespace, executor: str) -> None:
    """Greedy tfm with the default executor or distributed_executor_backend='ray' -> OUT/<executor>.json."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: get_metrics, collective_rpc
    os.environ.update(DRIVER_ONLY_ENV)
    os.environ.update(SWITCH_ENV)
    target, drafter = models(args)
    res: dict[str, Any] = {"executor": executor}
    path = WORK / f"{executor}.json"
    try:
        kw = dict(engine_settings(args.async_scheduling), model=target, skip_tokenizer_init=True, speculative_config=spec(drafter),
                  disable_log_stats=False)  # LLM turns stats off by default: spec_counters would read nothing
        if executor == "ray":
            import ray

            ray.init(num_gpus=1, include_dashboard=False, object_store_memory=2 * 1024**3, log_to_driver=True)
            res["ray_version"] = ray.__version__
            kw["distributed_executor_backend"] = "ray"
        from vllm import LLM, SamplingParams

        t = time.time()
        llm = LLM(**kw)
        res["engine_start_s"] = round(time.time() - t, 1)
        res["distributed_executor_backend"] = str(llm.llm_engine.vllm_config.parallel_config.distributed_executor_backend)
        log(f"{executor}: engine up in {res['engine_start_s']} s, backend {res['distributed_executor_backend']}")
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
        ps = prompts(target)
        t = time.time()
        batch = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        single = llm.generate([{"prompt_token_ids": ps[0]}], params, use_tqdm=False)
        res["generate_s"] = round(time.time() - t, 2)
        res["tokens"] = [list(o.outputs[0].token_ids) for o in batch]
        res["tokens_prompt0_alone"] = list(single[0].outputs[0].token_ids)
        res["spec_counters"] = spec_counters(llm)
        res["workers"] = llm.collective_rpc(worker_info)
        res["driver_pid"] = os.getpid()
        log(f"{executor}: generated in {res['generate_s']} s; workers: {res['workers']}")
        if executor == "ray":  # the executor kills its actors while Ray is up; left to the interpreter's exit, Ray's
            # exit hook runs first and the kill starts a fresh local Ray and logs a traceback (section 58)
            try:
                llm.llm_engine.engine_core.shutdown()
                ray.shutdown()
            except Exception as e:  # noqa: BLE001 - the phase's verdicts stand; the log says what the shutdown did
                res["shutdown_error"] = f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - record and report
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        print(res["traceback"], flush=True)
        dump_ray_logs()
    path.write_text(json.dumps(res, indent=1, default=str))


def dump_ray_logs(lines: int = 60) -> None:
    """After a failure: the tails of this Ray session's logs that hold a traceback (into the phase log)."""
    logs = Path("/tmp/ray/session_latest/logs")
    for f in sorted(logs.rglob("*")) if logs.is_dir() else []:
        if f.is_file() and f.suffix in (".log", ".err", ".out"):
            text = f.read_text(errors="replace")
            if "Traceback" in text or "Error" in text:
                print(f"--- {f} (last {lines} lines) ---", *text.splitlines()[-lines:], sep="\n", flush=True)


# ---------------------------------------------------------------------------------------- serve
def _post(url: str, body: dict[str, Any], timeout: float = 120.0) -> tuple[int, Any]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except json.JSONDecodeError:
            return e.code, raw.decode(errors="replace")


def phase_serve(args: argparse.Namespace) -> None:
    """vllm_tfm.serve on a local Ray cluster; one OpenAI completion over HTTP -> OUT/serve.json."""
    os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # Ray Serve LLM's own engine layout
    os.environ.update(DRIVER_ONLY_ENV)  # copied into the replicas' runtime_env by the builder
    target, drafter = models(args)
    res: dict[str, Any] = {}
    path = WORK / "serve.json"
    try:
        import ray
        from ray import serve
        from ray.serve.schema import ApplicationStatus

        from vllm_tfm.serve import build_tfm_openai_app, llm_config_dict

        cfg = {
            "model": target,
            "model_id": MODEL_ID,
            "drafter": drafter,
            "num_speculative_tokens": BUDGET,
            "engine_kwargs": engine_settings(args.async_scheduling),
            "env": {
                **SWITCH_ENV,
                "VLLM_USE_FLASHINFER_SAMPLER": "0",
                "HF_HUB_OFFLINE": "1",
                "RAY_USAGE_STATS_ENABLED": "0",
                "VLLM_ALLOW_INSECURE_SERIALIZATION": "1",  # only for the worker_info collective_rpc below
            },
        }
        res["llm_config"] = llm_config_dict(cfg)
        ray.init(num_gpus=1, include_dashboard=False, object_store_memory=2 * 1024**3)
        serve.start(http_options={"host": "127.0.0.1", "port": SERVE_PORT})
        app = build_tfm_openai_app(cfg)
        t = time.time()
        serve.run_many([serve.RunTarget(target=app, name="tfm", route_prefix="/")], wait_for_applications_running=False)
        deadline = T0 + DEADLINE_S - 30  # leave time for the requests
        while True:
            st = serve.status().applications.get("tfm")
            if st is not None and st.status == ApplicationStatus.RUNNING:
                break
            if st is not None and st.status in (ApplicationStatus.DEPLOY_FAILED, ApplicationStatus.UNHEALTHY):
                raise RuntimeError(f"Serve application {st.status}: {st.message}")
            if time.time() > deadline:
                raise TimeoutError(f"Serve application not RUNNING in time: {st and st.status}: {st and st.message}")
            time.sleep(2)
        res["deploy_s"] = round(time.time() - t, 1)
        log(f"serve: application RUNNING after {res['deploy_s']} s")
        base = f"http://127.0.0.1:{SERVE_PORT}/v1"
        p0 = prompts(target)[0]
        t = time.time()
        code, body = _post(f"{base}/completions", {"model": MODEL_ID, "prompt": p0, "max_tokens": MAX_TOKENS, "temperature": 0.0,
                                                   "ignore_eos": True, "return_token_ids": True})  # fmt: skip
        res["completion_s"] = round(time.time() - t, 2)
        res["completion_status"] = code
        res["completion"] = body
        if code == 200:
            res["tokens_prompt0"] = body["choices"][0].get("token_ids")
        code, body = _post(f"{base}/completions", {"model": MODEL_ID, "prompt": p0, "max_tokens": 4, "prompt_logprobs": 1})
        res["refusal_status"], res["refusal"] = code, body
        with urllib.request.urlopen(f"{base}/models", timeout=30) as r:
            res["models"] = [m["id"] for m in json.loads(r.read())["data"]]
        try:  # best effort: what the replica's vLLM worker (a Ray actor) sees
            handle = serve.get_deployment_handle(f"LLMServer:{MODEL_ID}", app_name="tfm")
            res["workers"] = handle.collective_rpc.remote(method=worker_info).result(timeout_s=60)
        except Exception as e:  # noqa: BLE001
            res["workers_error"] = f"{type(e).__name__}: {e}"
        log(f"serve: completion {res['completion_status']} in {res['completion_s']} s, refusal {res['refusal_status']}")
    except Exception as e:  # noqa: BLE001
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        print(res["traceback"], flush=True)
        dump_ray_logs()
    finally:
        path.write_text(json.dumps(res, indent=1, default=str))
        try:
            from ray import serve

            serve.shutdown()
        except Exception as e:  # noqa: BLE001
            log("serve.shutdown:", e)
        try:
            import ray

            ray.shutdown()
        except Exception as e:  # noqa: BLE001
            log("ray.shutdown:", e)


# ---------------------------------------------------------------------------------------- driver
def load(name: str) -> dict[str, Any]:
    p = WORK / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else {"error": f"{p.name} missing: the phase did not finish"}


def scheduling_as_asked(phases: list[dict[str, Any]], asked: bool) -> bool:
    """Every phase reported its workers, and each worker's config settled on the scheduling asked for."""
    return all(ph.get("workers") and all(w.get("async_scheduling") is asked for w in ph["workers"]) for ph in phases)


def summary(out: Path, command: str, asked_async: bool) -> int:
    d, r, s = load("default"), load("ray"), load("serve")
    verdicts: dict[str, Any] = {}
    if "tokens" in d and "tokens" in r:
        diff = [i for i, (a, b) in enumerate(zip(d["tokens"], r["tokens"])) if a != b]
        verdicts["ray_equals_default"] = not diff and len(d["tokens"]) == len(r["tokens"]) and (
            d["tokens_prompt0_alone"] == r["tokens_prompt0_alone"])
        verdicts["ray_differs_on_prompts"] = diff
    else:
        verdicts["ray_equals_default"] = False
    workers = r.get("workers") or []
    w = workers[0] if workers else {}
    tm = w.get("tree_metrics") or {}
    verdicts["ray_worker_in_actor"] = bool(
        w and w.get("pid") != r.get("driver_pid") and w.get("ray_actor_id") and w.get("plugin_registered")
        and w.get("runtime_installed") and (w.get("options") or {}).get("top_k") == int(DRIVER_ONLY_ENV["VLLM_TFM_TOP_K"])
        and w.get("tfm_env", {}).get("VLLM_TFM_PROFILE") == SWITCH_ENV["VLLM_TFM_PROFILE"] and (tm.get("tree_steps") or 0) > 0
    )  # fmt: skip
    verdicts["serve_equals_default"] = s.get("tokens_prompt0") is not None and s.get("tokens_prompt0") == d.get("tokens_prompt0_alone")
    verdicts["serve_refuses"] = s.get("refusal_status") == 400 and "speculative method 'tfm'" in json.dumps(s.get("refusal"))
    verdicts["scheduling_as_asked"] = scheduling_as_asked([d, r, s], asked_async)
    res = {"command": command, "async_scheduling": asked_async, "budget": BUDGET, "max_tokens": MAX_TOKENS, "prompts": N_PROMPTS, "dtype": DTYPE,
           "verdicts": verdicts, "default": d, "ray": r, "serve": s}  # fmt: skip
    (out / "ray_results.json").write_text(json.dumps(res, indent=1, default=str))
    print("=" * 100)
    for k, v in verdicts.items():
        print(f"{k:24s} {v}")
    for name, ph in (("default", d), ("ray", r), ("serve", s)):
        if "error" in ph:
            print(f"{name} ERROR: {ph['error']}")
    print("=" * 100)
    return 0 if all(v is True for k, v in verdicts.items() if k != "ray_differs_on_prompts") else 1


def run_phase(args: argparse.Namespace, phase: str) -> int:
    out = Path(args.out)
    left = DEADLINE_S - (time.time() - T0)
    timeout = max(20.0, min(PHASE_CAP_S[phase], left))
    logf = out / f"{phase}.log"
    log(f"phase {phase} (timeout {timeout:.0f} s) -> {logf.name}")
    cmd = [sys.executable, __file__, "--phase", phase, "--out", str(out)]
    if args.target:
        cmd += ["--target", args.target, "--drafter", args.drafter]
    if args.async_scheduling:
        cmd.append("--async-scheduling")
    rc, _ = run_phase_process(cmd, logf, timeout, dict(os.environ, TFM_RAY_T0=str(T0)), f"phase {phase}")
    rc = -9 if rc is None else rc
    echo_log(logf, ("[tfm-ray", "Traceback", "Error", "stopped:"), 60, tail_lines=30 if rc != 0 else 0)
    log(f"phase {phase} exit code {rc}")
    return rc


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/tfm-ray-out"))
    ap.add_argument("--phase", default="all", choices=["all", "make", "default", "ray", "serve", "summary"])
    ap.add_argument("--target", help="target model directory (default: random tiny models in TFM_RAY_DIR)")
    ap.add_argument("--drafter", help="drafter directory (with --target)")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="every phase's engine with async_scheduling=True (vLLM's asynchronous scheduling)")
    args = ap.parse_args()
    if (args.target is None) != (args.drafter is None):
        sys.exit("give both --target and --drafter, or neither")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    command = "bash bench/run_gpu_ray.sh" + (f" --target {args.target} --drafter {args.drafter}" if args.target else "")
    command += " --async-scheduling" if args.async_scheduling else ""
    if args.phase == "make":
        phase_make()
    elif args.phase in ("default", "ray"):
        phase_engine(args, args.phase)
    elif args.phase == "serve":
        phase_serve(args)
    elif args.phase == "summary":
        return summary(out, command, args.async_scheduling)
    else:
        for stale in WORK.glob("*.json"):
            stale.unlink()
        if not args.target and run_phase(args, "make") != 0:
            return 2
        for phase in ("default", "ray", "serve"):
            run_phase(args, phase)
        return summary(out, command, args.async_scheduling)
    return 0


if __name__ == "__main__":
    sys.exit(main())
