"""Offline generation with vLLM + method "tfm", checked against the same engine without speculation.

Runs greedy generation twice (or three times with ``--also-dflash``) on the same prompts: no
speculative decoding, then ``speculative_config={"method": "tfm", ...}``; prints the tokens, the
first position where the outputs differ (greedy tfm must reproduce no-spec token for token; in
bf16 rare divergences can come from different batch shapes, use ``--dtype float32`` for an exact
check) and the acceptance counters. Exit status 0 when every output matches, 1 otherwise.

Without ``--target`` it writes random tiny models (examples/_tiny_models.py) into a temporary
directory and loads them with ``load_format="dummy"``: meaningless tokens and acceptance, but
the whole path runs. The settings follow the GPU test host bundle (shared/gpu/README.md):
TRITON_ATTN for the target and the drafter, triton GDN prefill, eager mode.

usage (GPU host, after ``source .gpu-bundle/install.sh`` and installing this project)::

    python3 examples/offline_generate.py                          # random tiny models
    python3 examples/offline_generate.py --target zoo/target --drafter zoo/drafter --dtype float32  # the toy zoo
    python3 examples/offline_generate.py --proposal chain --budget 7 --also-dflash
    python3 examples/offline_generate.py --target Qwen/Qwen3.6-27B --drafter DIR --budget 64
    python3 examples/offline_generate.py --check-config           # CPU: build the configs only
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _tiny_models import add_model_args, make_tiny_models  # noqa: E402

DEFAULT_PROMPTS = [
    "def fibonacci(n):",
    "The quick brown fox",
    "import numpy as np\n\nx = np.arange(10)\n",
]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    p.add_argument("--max-num-seqs", type=int, default=16, help="each request holds 1 + B GDN state slots")
    p.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    p.add_argument("--also-dflash", action="store_true", help="also run vLLM's in-tree DFlash (chain) arm")
    p.add_argument("--check-config", action="store_true", help="only build the engine's model and speculative configs (CPU)")
    return p.parse_args()


def resolve_models(args: argparse.Namespace) -> tuple[str, str, bool]:
    """(target, drafter, random) where random means dummy weights."""
    if (args.target is None) != (args.drafter is None):
        sys.exit("give both --target and --drafter, or neither (random tiny models)")
    if args.target is not None:
        return args.target, args.drafter, False

    root = Path(tempfile.mkdtemp(prefix="vllm-tfm-example-"))
    target, drafter = make_tiny_models(root, args.proposal or "ddtree", args.dtype)
    print(f"using RANDOM tiny models (dummy weights: tokens and acceptance are meaningless) in {root}")
    return str(target), str(drafter), True


def engine_kwargs(args: argparse.Namespace, target: str, random: bool) -> dict[str, Any]:
    kw: dict[str, Any] = dict(
        model=target,
        dtype=args.dtype,
        enforce_eager=True,
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        attention_backend="TRITON_ATTN",
        additional_config={"gdn_prefill_backend": "triton"},
        compilation_config={"custom_ops": ["none"]},  # as shared/gpu/smoke.py (the GPU bundle)
        disable_log_stats=False,
        seed=0,
    )
    if random:
        kw["load_format"] = "dummy"
    return kw


def spec_config(args: argparse.Namespace, drafter: str, method: str = "tfm") -> dict[str, Any]:
    spec: dict[str, Any] = {
        "method": method,
        "model": drafter,
        "num_speculative_tokens": args.budget,
        # the drafter's non-causal layers need a backend that supports them
        "attention_backend": "TRITON_ATTN",
    }
    if method == "tfm" and args.proposal is not None:
        spec["proposal"] = args.proposal
    return spec


def check_config(args: argparse.Namespace, target: str, drafter: str, random: bool) -> int:
    import vllm_tfm
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    vllm_tfm.register()
    kw = engine_kwargs(args, target, random)
    kw.pop("disable_log_stats")
    engine = EngineArgs(**kw, speculative_config=spec_config(args, drafter))
    model_config = engine.create_model_config()
    spec = engine.create_speculative_config(model_config, ParallelConfig())
    from vllm_tfm.vllm_plugin.options import get_drafter_dir, get_tfm_options

    print(f"target {model_config.architecture} hybrid={model_config.is_hybrid} vocab={model_config.get_vocab_size()}")
    print(
        f"speculative method={spec.method} B={spec.num_speculative_tokens} drafter={get_drafter_dir(spec)} "
        f"extra drafter slots per request={spec.max_num_new_slots_for_drafting}"
    )
    print("tfm options:", json.dumps(get_tfm_options(spec).model_dump(mode="json", exclude={"weaver", "treeflash"})))
    return 0


def metric_counts(llm: Any) -> dict[str, float]:
    try:
        metrics = llm.get_metrics()
    except Exception as e:  # metrics are a convenience here
        return {"error": f"{type(e).__name__}: {e}"}  # type: ignore[dict-item]
    out: dict[str, float] = {}
    for m in metrics:
        if m.name in ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens"):
            out[m.name.removeprefix("vllm:spec_decode_")] = float(getattr(m, "value", 0))
    return out


def run_arm(name: str, args: argparse.Namespace, kw: dict[str, Any], prompts: list[str], spec: dict | None) -> list[list[int]]:
    import torch
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    t0 = time.time()
    llm = LLM(**kw, speculative_config=spec)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    t1 = time.time()
    outs = llm.generate(prompts, params)
    t2 = time.time()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    counts = metric_counts(llm)
    print(f"[{name}] engine start {t1 - t0:.0f} s, generate {t2 - t1:.2f} s, counters {counts}")
    if counts.get("num_drafts"):
        print(f"[{name}] mean accepted length (1 + accepted / drafts): {1 + counts['num_accepted_tokens'] / counts['num_drafts']:.2f}")
    if spec is not None and spec["method"] == "tfm":
        try:
            from vllm_tfm.vllm_plugin.runtime import snapshot_metrics

            print(f"[{name}] tfm runtime metrics: {snapshot_metrics()}")
        except Exception as e:
            print(f"[{name}] tfm runtime metrics unavailable ({type(e).__name__}: {e})")
    for prompt, out in zip(prompts, outs):
        print(f"[{name}] {prompt!r} -> {out.outputs[0].text!r} ids={list(out.outputs[0].token_ids)[:16]}...")
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()
    torch.cuda.empty_cache()
    return tokens


def compare(name: str, reference: list[list[int]], other: list[list[int]]) -> bool:
    ok = True
    for i, (a, b) in enumerate(zip(reference, other)):
        if a == b:
            print(f"[{name}] prompt {i}: identical ({len(a)} tokens)")
            continue
        ok = False
        first = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        print(f"[{name}] prompt {i}: DIFFERS from no-spec at token {first}: {a[first:first + 8]} vs {b[first:first + 8]}")
    return ok


def main() -> int:
    args = parse_args()
    # in-process engine: the tfm runtime metrics live in this process
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    target, drafter, random = resolve_models(args)
    if args.check_config:
        return check_config(args, target, drafter, random)
    prompts = args.prompt or DEFAULT_PROMPTS
    kw = engine_kwargs(args, target, random)
    reference = run_arm("no-spec", args, kw, prompts, None)
    ok = compare("tfm", reference, run_arm("tfm", args, kw, prompts, spec_config(args, drafter)))
    if args.also_dflash:
        ok = compare("dflash", reference, run_arm("dflash", args, kw, prompts, spec_config(args, drafter, "dflash"))) and ok
    print("ALL MATCH" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
