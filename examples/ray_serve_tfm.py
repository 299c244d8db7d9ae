"""A Ray Serve OpenAI deployment of a target with method "tfm" (``vllm_tfm.serve``), queried once.

Starts a local Ray cluster (or joins ``--address``), deploys ``build_tfm_openai_app(...)``: Ray
Serve LLM's OpenAI ingress in front of an ``LLMServer`` replica whose vLLM engine runs tfm with
the Ray executor, one GPU per tensor-parallel rank, autoscaling between ``--min-replicas`` and
``--max-replicas``. Then it sends a greedy completion with the ``openai`` client, shows that a
request tfm cannot serve (prompt logprobs) gets a one-line HTTP 400, and shuts Serve down (or
keeps serving with ``--keep-serving``).

Without ``--target`` it writes random tiny models with a byte-level tokenizer
(examples/_tiny_models.py) and serves them with ``load_format="dummy"``: the text is gibberish,
the point is that the deployment works end to end. Engine settings follow the GPU test host
bundle (shared/gpu/README.md): TRITON_ATTN for target and drafter, triton GDN prefill, eager.

usage (GPU host, after the bundles' install.sh and installing this project; see docs/ray.md)::

    python3 examples/ray_serve_tfm.py
    python3 examples/ray_serve_tfm.py --target Qwen/Qwen3.6-27B --drafter DIR --budget 64 \\
        --accelerator-type H200 --tensor-parallel-size 1 --max-replicas 2
    python3 examples/ray_serve_tfm.py --check-config     # CPU: print the LLMConfig, deploy nothing
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _tiny_models import add_model_args, query_and_check_refusal, resolve_models  # noqa: E402

MODEL_ID = "tfm-demo"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--accelerator-type", help="Ray accelerator type the replicas need, e.g. H200")
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=1)
    p.add_argument("--target-ongoing-requests", type=int, help="autoscaling target (needed when max > min)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--max-num-seqs", type=int, default=16, help="each request holds 1 + B GDN state slots")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--address", help="an existing Ray cluster (default: start a local one)")
    p.add_argument("--port", type=int, default=8000, help="Serve's HTTP port")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--keep-serving", action="store_true", help="keep the deployment up until Ctrl-C")
    p.add_argument("--check-config", action="store_true", help="print the Ray Serve LLM config and exit")
    return p.parse_args()


def serve_config(args: argparse.Namespace, target: str, drafter: str, random: bool) -> dict[str, Any]:
    engine: dict[str, Any] = {
        "attention_backend": "TRITON_ATTN",
        "additional_config": {"gdn_prefill_backend": "triton"},
        "compilation_config": {"custom_ops": ["none"]},
        "enforce_eager": True,
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_seqs": args.max_num_seqs,
    }
    if random:
        engine["load_format"] = "dummy"
    cfg: dict[str, Any] = {
        "model": target,
        "model_id": MODEL_ID,
        "drafter": drafter,
        "num_speculative_tokens": args.budget,
        "tensor_parallel_size": args.tensor_parallel_size,
        "min_replicas": args.min_replicas,
        "max_replicas": args.max_replicas,
        "engine_kwargs": engine,
        "env": {"VLLM_USE_FLASHINFER_SAMPLER": "0"},  # the GPU test host's bundle has no FlashInfer
    }
    if args.proposal is not None:
        cfg["tree"] = {"proposal": args.proposal}
    if args.accelerator_type:
        cfg["accelerator_type"] = args.accelerator_type
    if args.target_ongoing_requests is not None:
        cfg["target_ongoing_requests"] = args.target_ongoing_requests
    return cfg


def wait_running(name: str, timeout: float) -> None:
    from ray import serve
    from ray.serve.schema import ApplicationStatus

    deadline = time.time() + timeout
    while time.time() < deadline:
        app = serve.status().applications.get(name)
        if app is not None and app.status == ApplicationStatus.RUNNING:
            return
        if app is not None and app.status in (ApplicationStatus.DEPLOY_FAILED, ApplicationStatus.UNHEALTHY):
            raise SystemExit(f"the Serve application failed: {app.status}: {app.message}")
        time.sleep(2)
    raise SystemExit(f"the Serve application was not RUNNING after {timeout:.0f} s")


def main() -> int:
    args = parse_args()

    target, drafter, random = resolve_models(args.target, args.drafter, args.proposal, "vllm-tfm-ray-serve-")

    from vllm_tfm.serve import build_tfm_openai_app, llm_config_dict

    cfg = serve_config(args, target, drafter, random)
    print("Ray Serve LLM config:", json.dumps(llm_config_dict(cfg), indent=1))
    if args.check_config:
        return 0

    import ray
    from ray import serve

    ray.init(address=args.address)
    serve.start(http_options={"host": "0.0.0.0", "port": args.port})
    try:
        t0 = time.time()
        serve.run_many([serve.RunTarget(target=build_tfm_openai_app(cfg), name="tfm", route_prefix="/")],
                       wait_for_applications_running=False)  # fmt: skip
        wait_running("tfm", args.startup_timeout)
        print(f"application RUNNING after {time.time() - t0:.0f} s")

        ok = query_and_check_refusal(f"http://127.0.0.1:{args.port}/v1", MODEL_ID, args.max_tokens)
        if args.keep_serving:
            print(f"serving on http://<this host>:{args.port}/v1 (model {MODEL_ID!r}); Ctrl-C to stop")
            while True:
                time.sleep(3600)
        return 0 if ok else 1
    except KeyboardInterrupt:
        return 0
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    sys.exit(main())
