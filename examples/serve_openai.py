"""``vllm serve`` with method "tfm", queried through the OpenAI-compatible API.

Starts ``python3 -m vllm.entrypoints.cli.main serve TARGET --speculative-config '{"method":
"tfm", ...}'`` (the vLLM plugin loads through its ``vllm.general_plugins`` entry point, so the
project must be installed), waits for ``/health``, sends greedy completions with the ``openai``
client, shows that a request tfm cannot serve (prompt logprobs) gets a one-line HTTP 400, prints
the speculative-decoding counters from ``/metrics`` and stops the server.

Without ``--target`` it writes random tiny models with a byte-level tokenizer
(examples/_tiny_models.py) and serves them with ``--load-format dummy``: the text is gibberish,
the point is that serving works end to end. Settings follow the GPU test host bundle
(shared/gpu/README.md): TRITON_ATTN for target and drafter, triton GDN prefill, eager.

usage (GPU host, after ``source .gpu-bundle/install.sh`` and installing this project)::

    python3 examples/serve_openai.py
    python3 examples/serve_openai.py --target zoo/target --drafter zoo/drafter --budget 32   # the toy zoo (run on the H200: bench/results/serve_zoo.json)
    python3 examples/serve_openai.py --target Qwen/Qwen3.6-27B --drafter DIR --budget 64 --proposal tfm
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _tiny_models import add_model_args, query_and_check_refusal, resolve_models  # noqa: E402

MODEL_NAME = "tfm-demo"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--max-num-seqs", type=int, default=16, help="each request holds 1 + B GDN state slots")
    p.add_argument("--kv-cache-memory-bytes", default=None,
                   help="fixed KV cache size (e.g. 4G): skips vLLM's memory profiling, for a GPU shared with other jobs")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    return p.parse_args()


def server_command(args: argparse.Namespace, target: str, drafter: str, random: bool) -> list[str]:
    spec = {"method": "tfm", "model": drafter, "num_speculative_tokens": args.budget, "attention_backend": "TRITON_ATTN"}
    if args.proposal is not None:
        spec["proposal"] = args.proposal
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", target,
        "--served-model-name", MODEL_NAME,
        "--port", str(args.port),
        "--speculative-config", json.dumps(spec),
        "--attention-backend", "TRITON_ATTN",
        "--additional-config", json.dumps({"gdn_prefill_backend": "triton"}),
        "--compilation-config", json.dumps({"custom_ops": ["none"]}),
        "--enforce-eager",
        "--max-model-len", str(args.max_model_len),
        "--gpu-memory-utilization", str(args.gpu_memory_utilization),
        "--max-num-seqs", str(args.max_num_seqs),
    ]  # fmt: skip
    if args.kv_cache_memory_bytes is not None:
        cmd += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    if random:
        cmd += ["--load-format", "dummy"]
    return cmd


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with status {proc.returncode} before becoming healthy")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(2)
    raise SystemExit(f"the server was not healthy after {timeout:.0f} s")


def spec_counters(base: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base.removesuffix('/v1')}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        m = re.search(rf"^vllm:spec_decode_{name}_total\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
        if m:
            out[name] = float(m.group(1))
    return out


def main() -> int:
    args = parse_args()

    target, drafter, random = resolve_models(args.target, args.drafter, args.proposal, "vllm-tfm-serve-")

    cmd = server_command(args, target, drafter, random)
    print("$", " ".join(cmd))
    proc = subprocess.Popen(cmd, env={**os.environ, "VLLM_USE_FLASHINFER_SAMPLER": "0"})
    base = f"http://127.0.0.1:{args.port}"
    try:
        t0 = time.time()
        wait_healthy(proc, base, args.startup_timeout)
        print(f"server healthy after {time.time() - t0:.0f} s")

        ok = query_and_check_refusal(f"{base}/v1", MODEL_NAME, args.max_tokens)
        counts = spec_counters(base)
        print("spec decode counters:", counts)
        if counts.get("num_drafts"):
            print(f"mean accepted length (1 + accepted / drafts): {1 + counts['num_accepted_tokens'] / counts['num_drafts']:.2f}")
        return 0 if ok else 1
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
