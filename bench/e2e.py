#!/usr/bin/env python3
"""Decode speed at Qwen3.6-27B shape on one GPU: no speculation vs vLLM's DFlash vs tfm (issue 7).

One command on the GPU host (``bash bench/run_gpu_e2e.sh``, which installs the bundle and calls
this script) measures, for each arm, output tokens/s at batch 1 and batch 8:

  nospec         vLLM without speculation (eager, like every arm unless named otherwise)
  dflash         vLLM's in-tree DFlash, chain of K = 15 drafts, ``rejection_sample_method
                 "synthetic"`` with ``synthetic_acceptance_rates`` from the profile's chain entry
  tfm16/32/64    vllm-tfm, Weaver trees of B = 16 / 32 / 64 nodes, acceptance replay of the
                 profile's tfm entry at that budget (``vllm_tfm/vllm_plugin/benchmark_mode.py``)
  nospec-graphs  (optional) vLLM without speculation with torch.compile + CUDA graphs [1, 2, 4, 8]
                 (vLLM's default mode, FULL_AND_PIECEWISE)
  dflash-graphs  (optional) the dflash arm with torch.compile + vLLM's default CUDA graphs, capture
                 sizes [1, 2, 4, 8, 16, 32, 64, 128] (a verify step is 16 tokens per request)
  tfm16/32/64-graphs  (optional) the tfm arms with torch.compile + piecewise CUDA graphs (cudagraph_mode PIECEWISE):
                 PIECEWISE target and DFlash graphs, capture sizes k * (B + 1) for k <= max batch
                 (vllm_tfm/vllm_plugin/cuda_graphs.py); Weaver and the tree build stay eager
  tfm16/32/64-full  (optional) as -graphs with cudagraph_mode FULL_AND_PIECEWISE (tfm's default on one
                 GPU): tree steps whose requests all verify B drafts replay one full graph of the
                 target forward with the tree verify inside (vllm_tfm/vllm_plugin/runtime/full_graphs.py)
  tfm16-full-async  (optional) tfm16-full with vLLM's asynchronous scheduling (async_scheduling=True), as
                 vLLM runs its no-spec and DFlash arms by default. The other tfm arms pin
                 async_scheduling=False (the scheduling of every earlier result of theirs), whatever tfm's
                 default (vllm_tfm/vllm_plugin/async_scheduling.py)
  tfm16-full-oneslot, tfm16-full-async-oneslot  (optional) tfm16-full and tfm16-full-async with one GDN state
                 slot per request (VLLM_TFM_GDN_STATE_SLOTS=one, vllm_tfm/vllm_plugin/runtime/one_slot.py).
                 The other tfm arms pin VLLM_TFM_GDN_STATE_SLOTS=per_draft (vLLM's 1 + B slots, the layout of
                 every result before bench/NOTES.md section 61) unless the environment sets it, whatever
                 tfm's default ("auto": one slot on one GPU); tfm16-full-async-oneslot is what
                 tfm runs by default on one GPU
  tfm16-full-async-oneslot-fp8draft[-fp8head][-dv32k|-fp8weaver|-w4]  (optional) that arm with the DFlash drafter's
                 layers in FP8 (and its logits through an FP8 lm_head copy; and those logits over a draft vocabulary
                 of 32,768 tokens, or the Weaver's projections in FP8 (weaver_weights), or the Weaver at width 4,
                 which needs ``--arm-profile NAME=PATH`` with acceptance measured at width 4)
  tfm16-full-async-oneslot-fp8draft-fp8head-fp8weaver-v6  (optional) that -fp8weaver arm with the GDN tree verify
                 pinned to version 6 (VLLM_TFM_GDN_VERIFY=6; the default runs version 7 on its trees)
  tfm16-full-async-oneslot-fp8draft-fp8head-fp8weaver-convloop  (optional) that -fp8weaver arm with tree conv1d
                 in its loop build (VLLM_TFM_TREE_CONV_UNROLLED=0; the default compiles the conv width in)

The target is written here with the exact Qwen3.6-27B text shape (``bench/e2e_models.py``; with
``--target-class vl`` in the published checkpoints' class, ``Qwen3_5ForConditionalGeneration`` with
M-RoPE positions, image and video limits 0) and loaded with dummy weights (``load_format="dummy"``,
bf16, about 54 GB), the drafter is the
published 27B DFlash shape (dummy weights) plus a random Weaver. Dummy weights accept nothing, so
acceptance comes from a profile (``--profile``: a ``vllm-tfm eval`` results JSON or an acceptance
profile JSON; default ``bench/results/acceptance.json`` when it exists, otherwise a built-in
geometric profile that every output labels as NOT measured).

Each arm runs in its own subprocess (a 27B engine per process, memory freed on exit), with
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (engine and worker in that process) and
``VLLM_TFM_PROFILE=1``. Per arm: engine start (timed), a warm-up, then per batch size one run
with CUDA-event stage timings (about 10 spans per step, and in tfm tree steps one more per layer
for the GDN and attention tree paths: about 240 at the 27B shape; read through
``LLM.collective_rpc``); a run with the timing paused comes before it and its tokens/s is the one
reported (``--no-clean-run`` skips it and reports the timed run's); the timer's own host time per step is
recorded as ``timer_host_ms_per_step``. Fixed random prompts of
``--prompt-len`` token ids, ``--output-len`` tokens each, ``ignore_eos``.

Time: the whole command must end within the host's 10 minutes. ``--deadline-s`` bounds this
script; before each arm it estimates the arm's cost (engine start as measured on earlier arms,
150 s before any, plus its runs) and skips arms that do not fit, printing them and the command
that runs them (``--start-while-s S`` instead starts each arm while S seconds are left). A running arm is killed at the deadline; what it had measured is kept.

Results: OUT/e2e_27b.json (``format: vllm-tfm-e2e/1``, machine, settings, profile, per-arm runs,
skipped arms), OUT/e2e.md (``bench/e2e_report.py`` tables), OUT/arms.log (every engine's log).

usage (GPU host, repository root):  bash bench/run_gpu_e2e.sh [--arms nospec,dflash,tfm32] [...]
   or, after `source .gpu-bundle/install.sh`:  python3 bench/e2e.py --out OUT [options]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

T0 = time.time()
REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
for p in (str(REPO), str(BENCH)):
    if p not in sys.path:
        sys.path.insert(0, p)

__all__ = ["Arm", "ARMS", "DEFAULT_ARMS", "parse_arms", "arm_estimate_s", "compile_estimate_s", "measure_estimate_s",
           "fits", "tfm_switches", "resolve_profile", "arm_profile", "parse_arm_profiles", "engine_kwargs", "measured_mal", "decode_rate", "main"]

RESULTS_FORMAT = "vllm-tfm-e2e/1"
DFLASH_K = 15  # in-tree DFlash chain length: the drafter's block 16 minus the bonus slot
FIRST_START_GUESS_S = 100.0  # engine start before any was measured, compile aside (tfm16-full with its compile: 212-282 s, sessions 39-42)
START_MARGIN_S = 20.0  # process start + imports on top of a measured engine start


@dataclass(frozen=True)
class Arm:
    name: str
    kind: str  # nospec | dflash | tfm
    budget: int | None = None  # tfm tree budget B
    graphs: bool = False
    full: bool = False  # tfm with cudagraph_mode FULL_AND_PIECEWISE: tree steps replay full graphs
    # runtime settings of this arm's engine process on top of the driver's environment (a same-machine A/B
    # of one switch: tfm32-full-v3 is tfm32-full with the GDN verify pinned to version 3, the compile cache shared)
    env: tuple[tuple[str, str], ...] = ()
    # vLLM's async_scheduling for this engine; None: vLLM's default for no-spec and DFlash, False (pinned) for tfm
    async_scheduling: bool | None = None
    # the speculative config's ``quantization`` (vLLM's own key): "fp8" quantizes the DFlash drafter's linear
    # layers at load (vllm_plugin/draft_quantization.py); the lm_head it shares with the target stays bf16
    draft_quantization: str | None = None
    # the Weaver's width w (tfm option ``width``, VLLM_TFM_WIDTH); None: the runtime's default_weaver_width(B).
    # An arm with its own width replays acceptance measured at that width: it needs --arm-profile NAME=PATH
    width: int | None = None

    @property
    def num_speculative_tokens(self) -> int:
        return {"nospec": 0, "dflash": DFLASH_K}.get(self.kind, self.budget or 0)


ARMS: dict[str, Arm] = {
    "nospec": Arm("nospec", "nospec"),
    "dflash": Arm("dflash", "dflash"),
    "tfm16": Arm("tfm16", "tfm", 16),
    "tfm32": Arm("tfm32", "tfm", 32),
    "tfm64": Arm("tfm64", "tfm", 64),
    "nospec-graphs": Arm("nospec-graphs", "nospec", graphs=True),
    "dflash-graphs": Arm("dflash-graphs", "dflash", graphs=True),
    "tfm16-graphs": Arm("tfm16-graphs", "tfm", 16, graphs=True),
    "tfm32-graphs": Arm("tfm32-graphs", "tfm", 32, graphs=True),
    "tfm64-graphs": Arm("tfm64-graphs", "tfm", 64, graphs=True),
    "tfm16-full": Arm("tfm16-full", "tfm", 16, graphs=True, full=True),
    "tfm32-full": Arm("tfm32-full", "tfm", 32, graphs=True, full=True),
    "tfm64-full": Arm("tfm64-full", "tfm", 64, graphs=True, full=True),
    "tfm32-full-v3": Arm("tfm32-full-v3", "tfm", 32, graphs=True, full=True, env=(("VLLM_TFM_GDN_VERIFY", "3"),)),
    "tfm16-full-async": Arm("tfm16-full-async", "tfm", 16, graphs=True, full=True, async_scheduling=True),
    # one GDN state slot per request (vllm_tfm/vllm_plugin/runtime/one_slot.py): more KV blocks in the same memory
    "tfm16-full-oneslot": Arm("tfm16-full-oneslot", "tfm", 16, graphs=True, full=True,
                              env=(("VLLM_TFM_GDN_STATE_SLOTS", "one"),)),
    # the same with tfm's default scheduling at TP 1 (asynchronous): what `gdn_state_slots: "one"` as the default runs
    "tfm16-full-async-oneslot": Arm("tfm16-full-async-oneslot", "tfm", 16, graphs=True, full=True, async_scheduling=True,
                                    env=(("VLLM_TFM_GDN_STATE_SLOTS", "one"),)),
    # the same with the DFlash drafter's linear layers in FP8: the drafting's speed only (the acceptance replay does
    # not see what FP8 does to the drafts)
    "tfm16-full-async-oneslot-fp8draft": Arm("tfm16-full-async-oneslot-fp8draft", "tfm", 16, graphs=True, full=True,
                                             async_scheduling=True, env=(("VLLM_TFM_GDN_STATE_SLOTS", "one"),),
                                             draft_quantization="fp8"),
    # and its logits through an FP8 copy of the lm_head (tfm option draft_lm_head, vllm_plugin/runtime/draft_head.py)
    "tfm16-full-async-oneslot-fp8draft-fp8head": Arm(
        "tfm16-full-async-oneslot-fp8draft-fp8head", "tfm", 16, graphs=True, full=True, async_scheduling=True,
        env=(("VLLM_TFM_GDN_STATE_SLOTS", "one"), ("VLLM_TFM_DRAFT_LM_HEAD", "fp8")), draft_quantization="fp8"),
    # the same drafting from a draft vocabulary of 32,768 tokens (tfm option draft_vocab, FR-Spec; the drafter
    # directory's draft_vocab.json, a random ranking: speed only, the acceptance is the replay's)
    "tfm16-full-async-oneslot-fp8draft-fp8head-dv32k": Arm(
        "tfm16-full-async-oneslot-fp8draft-fp8head-dv32k", "tfm", 16, graphs=True, full=True, async_scheduling=True,
        env=(("VLLM_TFM_GDN_STATE_SLOTS", "one"), ("VLLM_TFM_DRAFT_LM_HEAD", "fp8"),
             ("VLLM_TFM_DRAFT_VOCAB", "draft_vocab.json"), ("VLLM_TFM_DRAFT_VOCAB_SIZE", "32768")),
        draft_quantization="fp8"),
    # the same with the Weaver's projections on e4m3 rows (tfm option weaver_weights, weight-only FP8: the tree
    # build's linear kernel reads half the bytes; the replay does not see what it does to the trees)
    "tfm16-full-async-oneslot-fp8draft-fp8head-fp8weaver": Arm(
        "tfm16-full-async-oneslot-fp8draft-fp8head-fp8weaver", "tfm", 16, graphs=True, full=True, async_scheduling=True,
        env=(("VLLM_TFM_GDN_STATE_SLOTS", "one"), ("VLLM_TFM_DRAFT_LM_HEAD", "fp8"), ("VLLM_TFM_WEAVER_WEIGHTS", "fp8")),
        draft_quantization="fp8"),
    # the same with the GDN tree verify pinned to version 6 (VLLM_TFM_GDN_VERIFY=6; auto runs version 7 on these
    # 17-node trees since bench/NOTES.md section 73): a two-engine A/B of the kernel, held by the full graphs
    "tfm16-full-async-oneslot-fp8draft-fp8head-fp8weaver-v6": Arm(
        "tfm16-full-async-oneslot-fp8draft-fp8head-fp8weaver-v6", "tfm", 16, graphs=True, full=True,
        async_scheduling=True,
        env=(("VLLM_TFM_GDN_STATE_SLOTS", "one"), ("VLLM_TFM_DRAFT_LM_HEAD", "fp8"), ("VLLM_TFM_WEAVER_WEIGHTS", "fp8"),
             ("VLLM_TFM_GDN_VERIFY", "6")),
        draft_quantization="fp8"),
    # the same with tree conv1d in its loop build (VLLM_TFM_TREE_CONV_UNROLLED=0, vllm_tfm/kernels/conv.py): a
    # two-engine A/B of the kernel build, since the target's full graphs hold the conv launches
    "tfm16-full-async-oneslot-fp8draft-fp8head-fp8weaver-convloop": Arm(
        "tfm16-full-async-oneslot-fp8draft-fp8head-fp8weaver-convloop", "tfm", 16, graphs=True, full=True,
        async_scheduling=True,
        env=(("VLLM_TFM_GDN_STATE_SLOTS", "one"), ("VLLM_TFM_DRAFT_LM_HEAD", "fp8"), ("VLLM_TFM_WEAVER_WEIGHTS", "fp8"),
             ("VLLM_TFM_TREE_CONV_UNROLLED", "0")),
        draft_quantization="fp8"),
    # the same growing its trees 4 nodes per Weaver call (4 calls per tree at B = 16 instead of the default width 2's 8)
    "tfm16-full-async-oneslot-fp8draft-fp8head-w4": Arm(
        "tfm16-full-async-oneslot-fp8draft-fp8head-w4", "tfm", 16, graphs=True, full=True, async_scheduling=True,
        env=(("VLLM_TFM_GDN_STATE_SLOTS", "one"), ("VLLM_TFM_DRAFT_LM_HEAD", "fp8")), draft_quantization="fp8", width=4),
}
DEFAULT_ARMS = "nospec,dflash,tfm32,tfm64,tfm16"


def log(*args: object) -> None:
    print(f"[e2e {time.time() - T0:6.1f}s]", *args, flush=True)


# ---------------------------------------------------------------------------------------- planning
def parse_arms(text: str) -> list[Arm]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in ARMS]
    if bad or not names:
        raise ValueError(f"unknown arm {bad[0] if bad else '(none)'!r}; arms: {', '.join(ARMS)}")
    return [ARMS[n] for n in dict.fromkeys(names)]


def measure_estimate_s(arm: Arm, batches: list[int], output_len: int, mal: float, clean_run: bool) -> float:
    """Seconds of an arm's warm-up and runs: a step of the eager 27B target took 85-105 ms on the
    H200 (about 0.22 s with tfm's drafting and tree verify, session 5), a run needs output_len / MAL
    steps, plus a few seconds of prefill and bookkeeping."""
    if arm.graphs:  # CUDA graphs: a 27B step took 15-17 ms without speculation, 23-32 ms with tfm (sessions 39-42)
        step_s = 0.025 if arm.kind == "nospec" else 0.05
    else:
        step_s = 0.1 if arm.kind == "nospec" else 0.22
    runs = 4 if clean_run else 1  # a clean run, --ab-deferred's two runs, the profiled run (--ab-device-topology's and --ab-commit-reuse's 3 not counted)
    per_run = output_len / max(mal, 1.0) * step_s + 3.0
    return 10.0 + runs * len(batches) * per_run


def compile_estimate_s(arm: Arm) -> float:
    """torch.compile + graph capture on top of an eager engine start (full graphs: a second set)."""
    return (120.0 + (60.0 if arm.full else 0.0)) if arm.graphs else 0.0


def arm_estimate_s(arm: Arm, measured_starts: list[tuple[Arm, float]], batches: list[int], output_len: int,
                   mal: float, clean_run: bool) -> float:
    """Engine start + measuring. The start: the latest measured one (the first engine fills the JIT
    caches, 134 s on the H200; later eager ones took ~10 s) with its arm's compile estimate swapped
    for this arm's (a graph arm's measured start already holds its compile and capture)."""
    if measured_starts:
        prev, seconds = measured_starts[-1]
        start = max(seconds - compile_estimate_s(prev), 10.0) + compile_estimate_s(arm)
    else:
        start = FIRST_START_GUESS_S + compile_estimate_s(arm)
    return start + START_MARGIN_S + measure_estimate_s(arm, batches, output_len, mal, clean_run)


def fits(remaining_s: float, estimate_s: float) -> bool:
    return remaining_s >= estimate_s


# ---------------------------------------------------------------------------------------- profile
def resolve_profile(arg: str | None, temperature: float) -> tuple[Any, str]:
    """(AcceptanceProfile, path or 'builtin'): --profile, else bench/results/acceptance.json, else builtin."""
    from vllm_tfm.verify.acceptance_profile import (
        builtin_geometric_profile,
        load_profile,
    )

    if arg and arg != "builtin":
        return load_profile(arg), arg
    default = REPO / "bench" / "results" / "acceptance.json"
    if arg is None and default.is_file():
        return load_profile(default), str(default.relative_to(REPO))
    return builtin_geometric_profile(temperatures=(temperature,)), "builtin"


def arm_profile(arm: Arm, profile: Any, temperature: float, depth: int) -> dict[str, Any]:
    """The profile entry an arm uses, its MAL at the arm's drafted depth, and the DFlash rates."""
    from vllm_tfm.verify.acceptance_profile import (
        mean_accepted_length,
        resize_pmf,
        synthetic_acceptance_rates,
    )

    if arm.kind == "nospec":
        return {}
    if arm.kind == "dflash":
        entry = profile.select_chain(DFLASH_K, temperature)
        return {"entry": entry, "label": entry.label(), "rates": synthetic_acceptance_rates(entry.accepted_pmf, DFLASH_K),
                "mal": mean_accepted_length(resize_pmf(entry.accepted_pmf, DFLASH_K))}
    entry = profile.select("tfm", arm.budget, temperature)
    return {"entry": entry, "label": entry.label(), "mal": mean_accepted_length(resize_pmf(entry.accepted_pmf, depth))}


# ---------------------------------------------------------------------------------------- child
def engine_kwargs(arm: Arm, s: dict[str, Any], plan: dict[str, Any]) -> dict[str, Any]:
    kw: dict[str, Any] = {
        "model": s["target"], "load_format": "dummy", "dtype": "bfloat16", "skip_tokenizer_init": True, "seed": s["seed"],
        "gpu_memory_utilization": s["gpu_memory_utilization"], "max_model_len": s["max_model_len"],
        "max_num_seqs": max(s["batches"]), "max_num_batched_tokens": s["max_num_batched_tokens"],
        "enable_prefix_caching": False, "attention_backend": "TRITON_ATTN", "mamba_ssm_cache_dtype": "float32",
        "additional_config": {"gdn_prefill_backend": "triton"}, "disable_log_stats": False,
        "enforce_eager": not arm.graphs, "compilation_config": {"custom_ops": ["none"]},
    }
    if s.get("target_class") == "vl":  # text-only prompts: no vision encoder run, no multimodal profiling
        kw["limit_mm_per_prompt"] = {"image": 0, "video": 0}
    if arm.graphs and arm.kind == "nospec":
        kw["compilation_config"] = {"custom_ops": ["none"], "cudagraph_capture_sizes": [1, 2, 4, 8]}
    if arm.graphs and arm.kind == "dflash":
        kw["compilation_config"] = {"custom_ops": ["none"], "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32, 64, 128]}
    if arm.graphs and arm.kind == "tfm":  # tfm picks its capture sizes
        mode = "FULL_AND_PIECEWISE" if arm.full else "PIECEWISE"
        kw["compilation_config"] = {"custom_ops": ["none"], "cudagraph_mode": mode}
    if arm.kind == "dflash":
        kw["speculative_config"] = {
            "method": "dflash", "model": s["drafter"], "num_speculative_tokens": DFLASH_K,
            "attention_backend": "TRITON_ATTN", "rejection_sample_method": "synthetic",
            "synthetic_acceptance_rates": plan["rates"],
        }
    elif arm.kind == "tfm":
        kw["speculative_config"] = {"method": "tfm", "model": s["drafter"], "num_speculative_tokens": arm.budget,
                                    "attention_backend": "TRITON_ATTN"}
        if arm.draft_quantization is not None:
            kw["speculative_config"]["quantization"] = arm.draft_quantization
    if arm.kind == "tfm":  # synchronous unless the arm says: the scheduling of the tfm arms' earlier results
        kw["async_scheduling"] = bool(arm.async_scheduling)
    elif arm.async_scheduling is not None:
        kw["async_scheduling"] = arm.async_scheduling
    return kw


def prompts(n: int, length: int, vocab: int, seed: int, avoid: frozenset[int] = frozenset()) -> list[list[int]]:
    """Random token ids in [10, vocab - 10); an id in ``avoid`` is drawn again (the VL class's vision token
    ids: a prompt holding one would ask vLLM for image or video inputs). Without ``avoid``, the prompts of
    every earlier result."""
    rng = random.Random(seed)

    def draw() -> int:
        t = rng.randrange(10, vocab - 10)
        while t in avoid:
            t = rng.randrange(10, vocab - 10)
        return t

    return [[draw() for _ in range(length)] for _ in range(n)]


def vision_token_ids(target_class: str | None) -> frozenset[int]:
    """Token ids a text prompt must not hold in the VL class (vl_checkpoint's image, video and vision markers)."""
    if target_class != "vl":
        return frozenset()
    from vl_checkpoint import TOKEN_IDS

    return frozenset(TOKEN_IDS.values())


def spec_counters(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode"):
                out[m.name] = list(m.values) if isinstance(getattr(m, "values", None), list) else getattr(m, "value", None)
    except Exception as e:  # noqa: BLE001 - counters are diagnostics
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def measured_mal(before: dict[str, Any], after: dict[str, Any]) -> float | None:
    """1 + accepted drafts / verify steps (vLLM's spec-decode counters; None without speculation)."""
    def delta(name: str) -> float | None:
        a, b = before.get(name), after.get(name)
        return None if not isinstance(b, (int, float)) else b - (a if isinstance(a, (int, float)) else 0)

    drafts = delta("vllm:spec_decode_num_drafts")
    acc = delta("vllm:spec_decode_num_accepted_tokens")
    return None if not drafts or acc is None else 1.0 + acc / drafts


def decode_rate(outs: list[Any]) -> float | None:
    """Output tokens after each request's first, per second from the last first token to the last
    token (vLLM's per-request engine timestamps); None when vLLM gives no timestamps."""
    firsts, lasts, tokens = [], [], 0
    for o in outs:
        m = getattr(o, "metrics", None)
        if m is None or not getattr(m, "first_token_ts", 0) or not getattr(m, "last_token_ts", 0):
            return None
        firsts.append(m.first_token_ts)
        lasts.append(m.last_token_ts)
        tokens += len(o.outputs[0].token_ids) - 1
    window = max(lasts) - max(firsts)
    return tokens / window if window > 0 and tokens > 0 else None


def one_run(llm: Any, batch_prompts: list[list[int]], params: Any) -> dict[str, Any]:
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in batch_prompts], params, use_tqdm=False)
    wall = time.perf_counter() - t
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    rate = decode_rate(outs)
    return {"output_tokens": n, "wall_s": round(wall, 4), "tokens_per_s": round(n / wall, 3),
            "decode_tokens_per_s": None if rate is None else round(rate, 3)}


def run_arm(arm: Arm, settings_path: Path) -> int:
    """Child: one engine, warm-up, the (clean and) timed runs per batch size -> work/arm_<name>.json."""
    s = json.loads(settings_path.read_text())
    plan = s["plans"].get(arm.name, {})
    res: dict[str, Any] = {"arm": arm.name, "kind": arm.kind, "budget": arm.budget, "graphs": arm.graphs, "full": arm.full,
                           "env": dict(arm.env), "async_scheduling": arm.async_scheduling,
                           "draft_quantization": arm.draft_quantization,
                           "num_speculative_tokens": arm.num_speculative_tokens, "status": "started",
                           "profile_entry": plan.get("label"), "profile_mal": plan.get("mal"), "batches": {}}
    path = Path(s["work"]) / f"arm_{arm.name}.json"

    def save() -> None:
        path.write_text(json.dumps(res, indent=1, default=str))

    save()
    try:
        import torch
        import vllm
        from e2e_models import gdn_state_bytes_per_request
        from vllm import LLM, SamplingParams

        import vllm_tfm
        from vllm_tfm.vllm_plugin.runtime import collect_tree_metrics
        from vllm_tfm.vllm_plugin.runtime.one_slot import ONE_SLOT, gdn_state_slots_from_env
        from vllm_tfm.vllm_plugin.runtime.stage_timing import (
            collect_stage_timings,
            set_stage_timing,
        )

        vllm_tfm.register()
        res["machine"] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "vllm": vllm.__version__,
                          "cuda": torch.version.cuda}
        # this process's environment is child_env's (a tfm arm always has the switch): the plugin's resolution
        res["gdn_state_slots"] = gdn_state_slots_from_env() if arm.kind == "tfm" else None
        res["gdn_state_gib_per_request"] = round(gdn_state_bytes_per_request(
            arm.num_speculative_tokens, one_slot=res["gdn_state_slots"] == ONE_SLOT) / 2**30, 3)
        kw = engine_kwargs(arm, s, plan)
        res["engine_kwargs"] = kw
        log(f"{arm.name}: starting the engine")
        t = time.perf_counter()
        llm = LLM(**kw)
        res["engine_start_s"] = round(time.perf_counter() - t, 1)
        free, total = torch.cuda.mem_get_info()
        res["gpu_memory_gib"] = {"free_after_start": round(free / 2**30, 2), "total": round(total / 2**30, 2)}
        comp = getattr(getattr(llm.llm_engine, "vllm_config", None), "compilation_config", None)
        res["cudagraph_mode"] = str(getattr(comp, "cudagraph_mode", None))
        res["cudagraph_capture_sizes"] = list(getattr(comp, "cudagraph_capture_sizes", None) or [])
        cache = getattr(getattr(llm.llm_engine, "vllm_config", None), "cache_config", None)
        res["num_gpu_blocks"] = getattr(cache, "num_gpu_blocks", None)
        log(f"{arm.name}: engine up in {res['engine_start_s']} s; {res['num_gpu_blocks']} KV blocks; "
            f"GDN state per request {res['gdn_state_gib_per_request']} GiB")
        save()
        ps = prompts(max(s["batches"]), s["prompt_len"], s["vocab"], s["seed"], vision_token_ids(s.get("target_class")))
        params = SamplingParams(temperature=s["temperature"], max_tokens=s["output_len"], ignore_eos=True, detokenize=False)
        warm = SamplingParams(temperature=s["temperature"], max_tokens=s["warmup_tokens"], ignore_eos=True, detokenize=False)
        t = time.perf_counter()
        for b in sorted(s["batches"], reverse=True):
            llm.generate([{"prompt_token_ids": p} for p in ps[:b]], warm, use_tqdm=False)
        res["warmup_s"] = round(time.perf_counter() - t, 1)
        for b in s["batches"]:
            run: dict[str, Any] = {}
            res["batches"][str(b)] = run
            llm.collective_rpc(collect_tree_metrics, kwargs={"reset": True})
            before = spec_counters(llm)
            if s["clean_run"]:  # stage timing paused: tokens/s without the (small) cost of the events
                llm.collective_rpc(set_stage_timing, kwargs={"enabled": False, "reset": True})
                run.update(one_run(llm, ps[:b], params))
                log(f"{arm.name} b{b} clean: {run['tokens_per_s']} tok/s (decode {run['decode_tokens_per_s']})")
                if s.get("ab_deferred") and arm.kind == "tfm":  # on (above), off, on again: order effects show
                    run["deferred_off"] = deferred_off_run(llm, ps[:b], params)
                    run["deferred_on_again"] = one_run(llm, ps[:b], params)
                    log(f"{arm.name} b{b} clean, deferred drafts off: {run['deferred_off']['decode_tokens_per_s']} "
                        f"decode tok/s, on again: {run['deferred_on_again']['decode_tokens_per_s']}")
                if arm.kind == "tfm":  # runtime switches' same-engine A/Bs: on (above), then ab_order's runs
                    for name in s.get("ab_switches", ()):
                        sw = SWITCH_ABS[name]
                        run[sw.ab_key] = switch_ab(llm, ps[:b], params, name, s.get("ab_repeats", 1))
                        log(f"{arm.name} b{b} clean, {name} " + " / ".join(
                            ("on" if r[sw.flag] else "off") for r in run[sw.ab_key]) + ": "
                            + ", ".join(str(r["decode_tokens_per_s"]) for r in run[sw.ab_key]) + " decode tok/s")
            llm.collective_rpc(set_stage_timing, kwargs={"enabled": True, "reset": True})
            prof = one_run(llm, ps[:b], params)
            prof.update(llm.collective_rpc(collect_stage_timings, kwargs={"reset": True})[0])
            llm.collective_rpc(set_stage_timing, kwargs={"enabled": False})
            if not s["clean_run"]:
                run.update({k: prof[k] for k in ("output_tokens", "wall_s", "tokens_per_s", "decode_tokens_per_s")})
            run["profiled"] = prof
            run["max_concurrency"] = (prof.get("batch_requests") or {}).get("max")
            run["mal"] = measured_mal(before, spec_counters(llm))
            run["tree_metrics"] = llm.collective_rpc(collect_tree_metrics, kwargs={"reset": True})[0]
            per_step = {k: (prof["stages"].get(k) or {}).get("per_step_ms")
                        for k in ("target_forward", "gdn_tree", "attention_tree")}
            split = (f" (GDN tree {per_step['gdn_tree']}, attention tree {per_step['attention_tree']})"
                     if per_step["gdn_tree"] is not None or per_step["attention_tree"] is not None else "")
            log(f"{arm.name} b{b}: {run['tokens_per_s']} tok/s (decode {run['decode_tokens_per_s']}), MAL {run['mal']}, "
                f"{prof['steps']} steps, target forward {per_step['target_forward']} ms/step{split}, "
                f"max batch {run['max_concurrency']}")
            if s.get("host_spans"):
                run["host_spans"] = host_spans_run(llm, ps[:b], params)
                log(f"{arm.name} b{b} host spans: {run['host_spans']['wall_ms_per_step']} ms/step, untimed "
                    f"{run['host_spans']['untimed_ms_per_step']}")
            if s.get("kernel_profile"):
                run["kernel_profile"] = kernel_profile_run(llm, ps[:b], s, Path(s["kernel_profile"]) / f"kernels_{arm.name}_b{b}.json.gz")
                kp = run["kernel_profile"]
                log(f"{arm.name} b{b} kernel profile: {kp.get('steps')} steps, GPU {kp.get('gpu_us_per_step')} us/step, "
                    f"busy fraction {kp.get('busy_fraction')}; " + ", ".join(
                        f"{k} {v['us_per_step']}" for k, v in list((kp.get("stages") or {}).items())[:8]) + (kp.get("error") or ""))
            if s.get("host_profile"):
                run["host_profile"] = host_profile_run(llm, ps[:b], params, Path(s["host_profile"]) / f"host_profile_{arm.name}_b{b}.txt")
            save()
        res["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - record the failure, the driver goes on with the next arm
        res["status"] = "error"
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        print(res["traceback"], flush=True)
    save()
    return 0 if res["status"] == "ok" else 1


# ---------------------------------------------------------------------------------------- driver
def write_models(work: Path, vl: bool = False) -> dict[str, Any]:
    from e2e_models import TARGET_SHAPE, write_drafter, write_target

    t = time.perf_counter()
    target = write_target(work / "target", vl=vl)
    drafter = write_drafter(work / "drafter")
    return {"target": str(target), "drafter": str(drafter), "vocab": TARGET_SHAPE["vocab_size"],
            "seconds": round(time.perf_counter() - t, 1)}


def run_child(arm: Arm, settings_path: Path, out: Path, timeout_s: float, env: dict[str, str]) -> int:
    logf = out / "arms.log"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", arm.name, "--settings", str(settings_path)]
    with open(logf, "a") as f:
        f.write(f"\n===== {arm.name} (timeout {timeout_s:.0f} s) =====\n")
        f.flush()
        start = f.tell()
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout_s, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = -9
            f.write(f"\n{arm.name} killed at the deadline ({timeout_s:.0f} s)\n")
    text = logf.read_text(errors="replace")[start:]
    keep = ("[e2e", "Traceback", "Error", "error:", "killed", "ACCEPTANCE REPLAY")
    shown = [ln for ln in text.splitlines() if any(k in ln for k in keep)]
    print("\n".join(shown[-60:]), flush=True)
    return rc


def deferred_off_run(llm: Any, ps: list[list[int]], params: Any) -> dict[str, Any]:
    """One clean run with deferred drafts off (then back to the environment's setting), with the tree
    counters of that run: the A half of a same-engine A/B of runtime/deferred_drafts.py."""
    from vllm_tfm.vllm_plugin.runtime import collect_tree_metrics, set_deferred_drafts

    def placeholder_steps() -> int:
        return int((llm.collective_rpc(collect_tree_metrics)[0] or {}).get("placeholder_steps") or 0)

    before = placeholder_steps()
    llm.collective_rpc(set_deferred_drafts, args=(False,))
    try:
        out = one_run(llm, ps, params)
    finally:
        llm.collective_rpc(set_deferred_drafts, args=(None,))
    out["placeholder_steps"] = placeholder_steps() - before  # 0: the run was the synchronous path
    return out


def ab_order(repeats: int) -> tuple[bool, ...]:
    """The settings of a switch A/B's runs after the arm's clean run (which has the switch on): off, on,
    off for one repeat; else ``repeats`` pairs in ABBA order (off on, on off, off on, ...), so that a
    drift over the runs, or a slow run at a fixed position, weighs on both settings alike."""
    if repeats < 1:
        raise ValueError(f"--ab-repeats must be at least 1, got {repeats}")
    if repeats == 1:
        return (False, True, False)
    return tuple(v for i in range(repeats) for v in ((False, True) if i % 2 == 0 else (True, False)))


def parse_ab_switches(names: list[str], device_topology: bool = False, commit_reuse: bool = False) -> list[str]:
    """The switch A/Bs asked for (``--ab-switch``, and the two older flags), in order, once each; a
    one-line error for an unknown name."""
    out: list[str] = []
    for name in [*names, *(["device_topology"] if device_topology else []), *(["commit_reuse"] if commit_reuse else [])]:
        if name not in SWITCH_ABS:
            raise ValueError(f"--ab-switch: unknown switch {name!r}; expected one of {', '.join(SWITCH_ABS)}")
        if name not in out:
            out.append(name)
    return out


def switch_ab_runs(llm: Any, ps: list[list[int]], params: Any, setter: Any, flag: str,
                   count: tuple[str, str] | None = None, repeats: int = 1, warm_off: bool = False,
                   warm_on: bool = False) -> list[dict[str, Any]]:
    """More clean runs after the arm's clean run (a runtime switch on), in ``ab_order(repeats)``, set in
    the worker through ``setter`` (then back to the environment's setting), each marked ``run[flag]``.
    Each run also records its tree steps (``tree_steps``: steps that committed a tree, the ``commit``
    hook) and its decode milliseconds per tree step (``decode_ms_per_step``): the replayed acceptance
    differs from run to run, so tokens/s mixes the switch with the run's accepted lengths, and the step
    time does not. With ``count`` = (tree-metrics hook, key), each run also records how many steps took
    that hook. A same-engine A/B. ``warm_off``: one unrecorded run with the switch off first, for switches
    that select another CUDA graph (captured on its first use, which must not land in a timed run); ``warm_on``
    likewise with the switch on (switches whose own graphs are captured on first use)."""
    from vllm_tfm.vllm_plugin.runtime import collect_tree_metrics

    hooks = [("commit", "tree_steps")] + ([count] if count is not None else [])

    def hooked() -> dict[str, int]:
        got = (llm.collective_rpc(collect_tree_metrics)[0] or {}).get("hooks") or {}
        return {key: int(got.get(hook) or 0) for hook, key in hooks}

    out = []
    try:
        for warm, on in ((warm_off, False), (warm_on, True)):
            if warm:
                llm.collective_rpc(setter, args=(on,))
                one_run(llm, ps, params)
        for on in ab_order(repeats):
            llm.collective_rpc(setter, args=(on,))
            before = hooked()
            run = one_run(llm, ps, params)
            run[flag] = on
            after = hooked()
            for _, key in hooks:
                run[key] = after[key] - before[key]
            run["decode_ms_per_step"] = decode_ms_per_step(run, len(ps))
            out.append(run)
    finally:
        llm.collective_rpc(setter, args=(None,))
    return out


def decode_ms_per_step(run: dict[str, Any], num_requests: int) -> float | None:
    """Milliseconds per tree step of a run's decode window (``decode_rate``'s tokens after each request's
    first, over its tokens/s, over the tree steps); None without a rate or steps."""
    rate, steps = run.get("decode_tokens_per_s"), run.get("tree_steps")
    if not rate or not steps:
        return None
    return round(1000.0 * (run["output_tokens"] - num_requests) / rate / steps, 3)


@dataclass(frozen=True)
class SwitchAB:
    """A runtime switch a same-engine A/B can flip (``--ab-switch NAME``): its setter in
    ``vllm_tfm.vllm_plugin.runtime`` (collective_rpc signature), where the runs go in the arm's JSON
    (``ab_key``, each marked ``flag``), and optionally a tree-metrics hook counted per run (hook, key)."""

    setter: str
    ab_key: str
    flag: str
    count: tuple[str, str] | None = None
    warm_off: bool = False  # switch_ab_runs' warm_off: the switch picks another CUDA graph
    warm_on: bool = False  # switch_ab_runs' warm_on: the switch's graphs are captured on their first use


SWITCH_ABS: dict[str, SwitchAB] = {
    # the full-graph steps' topology on the device (runtime/device_topology.py)
    "device_topology": SwitchAB("set_device_topology", "device_topology_ab", "device_topology",
                                ("topology.device", "topology_device_steps")),
    # the commit's tables reused across full-graph replays (VLLM_TFM_COMMIT_REUSE, runtime/step_kernels.py)
    "commit_reuse": SwitchAB("set_commit_reuse", "commit_reuse_ab", "commit_reuse"),
    # the sampled tokens' copy queued before the commit (VLLM_TFM_EARLY_SAMPLED_COPY, runtime/deferred_drafts.py)
    "early_sampled_copy": SwitchAB("set_early_sampled_copy", "early_sampled_copy_ab", "early_sampled_copy"),
    # the GDN metadata's fast build on all-spec full-graph steps (VLLM_TFM_GDN_METADATA_FAST, runtime/gdn_metadata.py)
    "gdn_metadata_fast": SwitchAB("set_gdn_metadata_fast", "gdn_metadata_fast_ab", "gdn_metadata_fast",
                                  ("gdn.metadata_fast", "gdn_metadata_fast_builds")),
    # the Weaver graphs' tail check read after the forward (VLLM_TFM_WEAVER_LAZY_TAIL, runtime/weaver_graphs.py)
    "weaver_lazy_tail": SwitchAB("set_weaver_lazy_tail", "weaver_lazy_tail_ab", "weaver_lazy_tail",
                                 ("weaver.tail_skipped", "weaver_tail_skipped")),
    # the K/V compaction of the accepted paths in one launch (VLLM_TFM_KV_COMPACT_KERNEL, runtime/commit.py)
    "kv_compact_kernel": SwitchAB("set_kv_compact_kernel", "kv_compact_kernel_ab", "kv_compact_kernel",
                                  ("commit.kv_compact_kernel", "kv_compact_kernel_calls")),
    # all-greedy tree acceptance in one launch after the argmax (VLLM_TFM_GREEDY_ACCEPT_KERNEL, runtime/sampler.py)
    "greedy_accept_kernel": SwitchAB("set_greedy_accept_kernel", "greedy_accept_kernel_ab", "greedy_accept_kernel",
                                     ("sampler.greedy_kernel", "greedy_accept_kernel_steps")),
    # one-slot engines' commit indices from the slot column 0 (VLLM_TFM_ONE_SLOT_COMMIT, runtime/step_kernels.py)
    "one_slot_commit": SwitchAB("set_one_slot_commit", "one_slot_commit_ab", "one_slot_commit",
                                ("commit.one_slot_indices", "one_slot_commit_steps")),
    # the drafter's context order of a tree step's rows in one launch (VLLM_TFM_CONTEXT_ORDER_KERNEL,
    # runtime/drafter_inputs.py)
    "context_order_kernel": SwitchAB("set_context_order_kernel", "context_order_kernel_ab", "context_order_kernel",
                                     ("proposer.context_order_kernel", "context_order_kernel_steps")),
    # a tree step's commit on its own stream beside the drafting (VLLM_TFM_COMMIT_OVERLAP, runtime/commit_overlap.py)
    "commit_overlap": SwitchAB("set_commit_overlap", "commit_overlap_ab", "commit_overlap",
                               ("commit.overlap", "commit_overlap_steps")),
    # full CUDA graphs of the DFlash drafter's query forward (VLLM_TFM_DRAFTER_GRAPHS, runtime/drafter_graphs.py;
    # the engine must start with it set); captured on a key's second use, so an unrecorded run with it on first
    "drafter_graphs": SwitchAB("set_drafter_graphs", "drafter_graphs_ab", "drafter_graphs",
                               ("proposer.drafter_graph_replay", "drafter_graph_replays"), warm_on=True),
    # the DFlash top-K of the Weaver build in one launch (VLLM_TFM_TOPK_KERNEL, runtime/tree_builder_gpu.py); the
    # Weaver graphs key on it, so the off setting's graph is captured in an unrecorded run first
    "topk_kernel": SwitchAB("set_topk_kernel", "topk_kernel_ab", "topk_kernel", warm_off=True),
    # the Weaver's prompt pass on its own stream beside the top-K (VLLM_TFM_WEAVER_PROMPT_OVERLAP,
    # runtime/tree_builder_gpu.py); the Weaver graphs key on it, as on topk_kernel
    "prompt_overlap": SwitchAB("set_prompt_overlap", "prompt_overlap_ab", "prompt_overlap", warm_off=True),
}


def switch_ab(llm: Any, ps: list[list[int]], params: Any, name: str, repeats: int = 1) -> list[dict[str, Any]]:
    """``switch_ab_runs`` of the runtime switch ``name`` of ``SWITCH_ABS``."""
    import vllm_tfm.vllm_plugin.runtime as runtime

    sw = SWITCH_ABS[name]
    return switch_ab_runs(llm, ps, params, getattr(runtime, sw.setter), sw.flag, sw.count, repeats, sw.warm_off,
                          sw.warm_on)


def host_spans_run(llm: Any, ps: list[list[int]], params: Any) -> dict[str, Any]:
    """One more run of the batch with wall-clock spans around the engine's methods (bench/host_spans.py):
    per-step host milliseconds by method, inclusive and exclusive, and a typical step's timeline: at the
    entry and exit of host_spans.MARKED, when the host got there and when the GPU did (CUDA events)."""
    import host_spans
    import torch

    def marker() -> Any:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    clock = host_spans.SpanClock(marker=marker, marked=host_spans.MARKED)
    installed = host_spans.install(clock, host_spans.engine_objects(llm))
    patched, missing = host_spans.install_attrs(clock)
    gc_clock = host_spans.GcClock()
    gc_clock.install()
    torch.cuda.synchronize()
    base = marker()  # on the idle GPU: its timestamp is (within microseconds) the host's time below
    base_s = clock.clock()
    try:
        res = one_run(llm, ps, params)
    finally:
        gc_clock.uninstall()
        host_spans.uninstall_attrs(patched)
        host_spans.uninstall(installed)
    torch.cuda.synchronize()
    steps = clock.stats.get("runner.execute_model")
    out = clock.report(steps.count if steps is not None else 0, res["wall_s"])
    out["gc"] = gc_clock.report(steps.count if steps is not None else 0)
    out["timeline"] = host_spans.step_timeline(clock.marks, base_s, base, lambda a, b: a.elapsed_time(b))
    out.update(output_tokens=res["output_tokens"], installed=[f"{type(o).__name__}.{n}" for o, n in installed],
               attrs_missing=missing)
    return out


def kernel_profile_run(llm: Any, ps: list[list[int]], s: dict[str, Any], path: Path) -> dict[str, Any]:
    """One more (short) run of the batch under torch.profiler with the stage spans annotated: every GPU
    kernel attributed to the stage that launched it (bench/kernel_trace.py), per step. The Chrome trace
    goes to ``path`` (gzip); its summary is returned. A failure is recorded, not raised."""
    import gzip
    import shutil

    import kernel_trace
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams

    from vllm_tfm.vllm_plugin.runtime.stage_timing import set_stage_timing

    params = SamplingParams(temperature=s["temperature"], max_tokens=s["kernel_profile_tokens"], ignore_eos=True,
                            detokenize=False)
    try:
        llm.collective_rpc(set_stage_timing, kwargs={"enabled": True, "reset": True, "annotate": True})
        try:
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                res = one_run(llm, ps, params)
        finally:
            llm.collective_rpc(set_stage_timing, kwargs={"enabled": False, "reset": True, "annotate": False})
        raw = path.with_suffix("")  # .json
        prof.export_chrome_trace(str(raw))
        with open(raw, "rb") as fi, gzip.open(path, "wb", compresslevel=6) as fo:
            shutil.copyfileobj(fi, fo)
        raw.unlink()
        events = kernel_trace.load_trace(path)
        out = kernel_trace.summarize(events, skip_steps=1)  # the first step is the prefill
        out["host"] = kernel_trace.host_summary(events, skip_steps=1)
        out.update(file=path.name, output_tokens=res["output_tokens"], wall_s=res["wall_s"])
        return out
    except Exception as e:  # noqa: BLE001 - the arm's other results stay
        return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


# pstats restriction (a regex on "file:line(function)"): the callees of these functions go into the host profile
HOST_PROFILE_CALLEES = (r"\((propose|_update_states_after_model_execute|commit_step|_sample|_bookkeeping_sync|"
                        r"set_inputs_first_pass|_prepare_inputs|_build_attention_metadata|_preprocess|"
                        r"precompute_and_store_context_kv|compute_logits|_sample_draft_tokens)\)")


def host_profile_run(llm: Any, ps: list[list[int]], params: Any, path: Path) -> dict[str, Any]:
    """One more run of the batch under cProfile (the engine and worker run in this process): where the
    host's Python time goes per step. Writes the top functions by own time and by cumulative time."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    res = one_run(llm, ps, params)
    prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    buf.write(f"one run under cProfile: {res['output_tokens']} tokens, wall {res['wall_s']} s (profiler overhead included)\n")
    stats.sort_stats("tottime").print_stats(45)
    stats.sort_stats("cumulative").print_stats(70)
    buf.write("\n== what the step's big host spans call (bench/host_spans.py names them), by cumulative time\n")
    stats.sort_stats("cumulative").print_callees(HOST_PROFILE_CALLEES)
    path.write_text(buf.getvalue())
    return {"file": path.name, "wall_s": res["wall_s"], "output_tokens": res["output_tokens"]}


def child_env(arm: Arm, s: dict[str, Any], work: Path) -> dict[str, str]:
    from vllm_tfm.vllm_plugin.benchmark_mode import BENCHMARK_ENV_VARS

    env = {k: v for k, v in os.environ.items() if k not in BENCHMARK_ENV_VARS}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_TFM_PROFILE="1", E2E_T0=str(T0), PYTHONUNBUFFERED="1")
    if arm.kind == "tfm":
        env.update(VLLM_TFM_BENCHMARK_ACCEPTANCE_REPLAY=str(work / f"profile_{arm.name}.json"),
                   VLLM_TFM_I_AM_BENCHMARKING="1", VLLM_TFM_BENCHMARK_REPLAY_SEED=str(s["seed"]))
        env.setdefault("VLLM_TFM_GDN_STATE_SLOTS", "per_draft")  # the earlier results' layout unless asked otherwise
    env.update(arm.env)
    if arm.width is not None:
        env["VLLM_TFM_WIDTH"] = str(arm.width)
    return env


def parse_arm_profiles(items: list[str], arms: list[Arm]) -> dict[str, str]:
    """``--arm-profile NAME=PATH`` values -> {arm name: path}; every arm with its own Weaver width needs one
    (its trees are grown differently from the profile's default-width cells). One-line ValueError otherwise."""
    names = {a.name for a in arms}
    out: dict[str, str] = {}
    for item in items:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--arm-profile takes NAME=PATH, got {item!r}")
        if name not in names:
            raise ValueError(f"--arm-profile {name}: not one of this run's arms ({', '.join(sorted(names))})")
        if name in out:
            raise ValueError(f"--arm-profile {name} given twice")
        out[name] = path
    for arm in arms:
        if arm.width is not None and arm.name not in out:
            raise ValueError(f"arm {arm.name} grows its trees at width {arm.width}: give acceptance measured at that "
                             f"width with --arm-profile {arm.name}=PATH (e.g. `vllm-tfm eval ... --width {arm.width}`)")
    return out


def tfm_switches(environ: Any) -> dict[str, str]:
    """The VLLM_TFM_* settings of this run that change the tfm runtime (not the benchmark's own)."""
    from vllm_tfm.vllm_plugin.benchmark_mode import BENCHMARK_ENV_VARS

    return {k: v for k, v in sorted(environ.items()) if k.startswith("VLLM_TFM_") and k not in BENCHMARK_ENV_VARS
            and k != "VLLM_TFM_PROFILE"}


def driver(args: argparse.Namespace) -> int:
    from e2e_models import DRAFT_BLOCK
    from e2e_report import render_markdown

    from vllm_tfm.verify.acceptance_profile import AcceptanceProfile, save_profile

    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    work.mkdir(parents=True, exist_ok=True)
    arms = parse_arms(args.arms)
    ab_order(args.ab_repeats)  # its one-line error before any engine starts
    ab_switches = parse_ab_switches(args.ab_switch, args.ab_device_topology, args.ab_commit_reuse)
    batches = sorted({int(b) for b in args.batches.split(",")})
    arm_profile_paths = parse_arm_profiles(args.arm_profile, arms)
    profile, profile_path = resolve_profile(args.profile, args.temperature)
    if not profile.measured:
        log(f"NOTE: acceptance profile NOT measured: {profile.source}")
    depth = DRAFT_BLOCK - 1  # every tfm budget here (>= 16) drafts D = min(B, 15) = 15 deep
    settings: dict[str, Any] = {
        "target": "Qwen3.6-27B text shape (64 layers: 48 GDN + 16 gated attention, hidden 5120, GDN H=16 HV=48 K=V=128, "
                  "vocab 248320)" + (" in the VL class Qwen3_5ForConditionalGeneration (M-RoPE)" if args.target_class == "vl"
                                     else ""),
        "target_class": args.target_class,
        "batches": batches, "prompt_len": args.prompt_len, "output_len": args.output_len,
        "warmup_tokens": args.warmup_tokens, "temperature": args.temperature, "seed": args.seed,
        "gpu_memory_utilization": args.gpu_memory_utilization, "clean_run": args.clean_run,
        "max_model_len": args.prompt_len + args.output_len + 2 * max(a.num_speculative_tokens for a in arms) + 64,
        "max_num_batched_tokens": max(4096, max(batches) * args.prompt_len), "eager": True,
        "deadline_s": args.deadline_s, "work": str(work), "plans": {},
        "host_profile": str(out) if args.host_profile else None,
        "host_spans": args.host_spans,
        "kernel_profile": str(out) if args.kernel_profile else None,
        "kernel_profile_tokens": args.kernel_profile_tokens,
        "ab_deferred": args.ab_deferred,
        "ab_switches": ab_switches,
        "ab_repeats": args.ab_repeats,
        # tfm switches set for this run (e.g. VLLM_TFM_WEAVER_GRAPHS=1), benchmark-only ones excluded
        "tfm_env": tfm_switches(os.environ),
    }
    results: dict[str, Any] = {
        "format": RESULTS_FORMAT,
        "command": os.environ.get("E2E_COMMAND") or "python3 bench/e2e.py " + " ".join(sys.argv[1:]),
        "machine": {}, "settings": settings,
        "profile": {"path": profile_path, "source": profile.source, "measured": profile.measured,
                    "temperature": args.temperature},
        "arms": {}, "skipped": [],
    }
    res_path, md_path = out / "e2e_27b.json", out / "e2e.md"

    def save() -> None:
        res_path.write_text(json.dumps(results, indent=1, default=str) + "\n")

    for arm in arms:
        try:
            own = arm_profile_paths.get(arm.name)
            arm_prof = resolve_profile(own, args.temperature)[0] if own else profile
            plan = arm_profile(arm, arm_prof, args.temperature, depth)
            if own:
                plan.update(profile_path=own, profile_source=arm_prof.source)
        except ValueError as e:
            results["arms"][arm.name] = {"arm": arm.name, "kind": arm.kind, "status": "error", "error": str(e)}
            log(f"{arm.name}: {e}")
            continue
        if "entry" in plan:
            entry = plan.pop("entry")
            if arm.kind == "tfm":
                save_profile(AcceptanceProfile(source=arm_prof.source, measured=arm_prof.measured, entries=[entry]),
                             work / f"profile_{arm.name}.json")
        settings["plans"][arm.name] = plan
    models = write_models(work, vl=args.target_class == "vl")
    settings.update(target_dir=models["target"], drafter_dir=models["drafter"])
    log(f"models written in {models['seconds']} s: {models['target']}, {models['drafter']}")
    child_settings = dict(settings, target=models["target"], drafter=models["drafter"], vocab=models["vocab"])
    settings_path = work / "settings.json"
    settings_path.write_text(json.dumps(child_settings, indent=1))
    save()

    starts: list[tuple[Arm, float]] = []
    for arm in arms:
        if results["arms"].get(arm.name, {}).get("status") == "error":
            continue
        remaining = args.deadline_s - (time.time() - T0)
        mal = settings["plans"].get(arm.name, {}).get("mal", 1.0)
        est = arm_estimate_s(arm, starts, batches, args.output_len, mal, settings["clean_run"])
        if args.start_while_s is not None:  # no estimate: start while that much time is left, keep what it measures
            est = args.start_while_s
        if not fits(remaining, est):
            reason = f"deadline: {remaining:.0f} s left, the arm needs about {est:.0f} s"
            results["skipped"].append({"arm": arm.name, "reason": reason})
            results["arms"][arm.name] = {"arm": arm.name, "kind": arm.kind, "status": "skipped", "reason": reason}
            log(f"SKIP {arm.name}: {reason}")
            save()
            continue
        log(f"arm {arm.name}: estimated {est:.0f} s, {remaining:.0f} s left")
        rc = run_child(arm, settings_path, out, max(30.0, remaining - 5.0), child_env(arm, settings, work))
        arm_file = work / f"arm_{arm.name}.json"
        arm_res = json.loads(arm_file.read_text()) if arm_file.is_file() else {"arm": arm.name, "status": "error"}
        if rc != 0 and arm_res.get("status") == "started":
            arm_res["status"] = "partial" if arm_res.get("batches") else "error"
            arm_res.setdefault("error", f"the arm's process ended with code {rc}")
        results["arms"][arm.name] = arm_res
        results["machine"] = results["machine"] or arm_res.get("machine", {})
        if arm_res.get("engine_start_s"):
            starts.append((arm, float(arm_res["engine_start_s"])))
        save()

    table = render_markdown(results)
    md_path.write_text(table)
    print("=" * 100)
    print(table)
    skipped = [x["arm"] for x in results["skipped"]]
    if skipped:
        again = ",".join(dict.fromkeys(["nospec", *skipped]))
        print(f"NOT RUN (deadline): {', '.join(skipped)}. Next command: bash bench/run_gpu_e2e.sh --arms {again}")
    bad = [n for n, a in results["arms"].items() if a.get("status") not in ("ok", "skipped")]
    if bad:
        print(f"FAILED or partial arms: {', '.join(bad)} (see {out / 'arms.log'})")
    print(f"results: {res_path}, table: {md_path}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    global T0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/tfm-e2e27-out"))
    ap.add_argument("--work", default="/tmp/tfm-e2e27", help="model directories, per-arm files")
    ap.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma list of {', '.join(ARMS)} (default {DEFAULT_ARMS})")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--warmup-tokens", type=int, default=16)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--profile", default=None,
                    help="acceptance profile or `vllm-tfm eval` results JSON; 'builtin' for the geometric one "
                         "(default: bench/results/acceptance.json if present, else builtin)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--target-class", choices=("text", "vl"), default="text",
                    help="the target's class: text (Qwen3_5ForCausalLM, 1-d RoPE; every result so far) or vl "
                         "(Qwen3_5ForConditionalGeneration with M-RoPE, the published checkpoints' class)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.92)
    ap.add_argument("--deadline-s", type=float, default=500.0, help="bound on this script's wall time")
    ap.add_argument("--start-while-s", type=float, default=None,
                    help="start each arm while this many seconds are left instead of estimating its cost (a running "
                         "arm is killed at the deadline; the batch sizes it finished are kept)")
    ap.add_argument("--clean-run", action=argparse.BooleanOptionalAction, default=True,
                    help="per batch, first a run with stage timing paused (its tokens/s is reported), then the timed run "
                         "(default; --no-clean-run reports the timed run's tokens/s, which include the stage timers' "
                         "cost: ~15 ms per tfm step at the 27B shape with the per-layer spans)")
    ap.add_argument("--host-profile", action="store_true",
                    help="after the timed runs, one more run per batch size under cProfile (tokens/s not used): "
                         "OUT/host_profile_<arm>_b<N>.txt, the engine process's Python by own and cumulative time")
    ap.add_argument("--host-spans", action="store_true",
                    help="one more run per batch with wall-clock timers around the engine's methods "
                         "(bench/host_spans.py): host ms per step by method, in the arm's JSON")
    ap.add_argument("--kernel-profile", action="store_true",
                    help="per arm and batch, one more run of --kernel-profile-tokens tokens under torch.profiler: "
                         "GPU time per step by stage and kernel (bench/kernel_trace.py) in the arm's JSON, the trace "
                         "in OUT/kernels_<arm>_b<N>.json.gz")
    ap.add_argument("--kernel-profile-tokens", type=int, default=32)
    ap.add_argument("--ab-deferred", action="store_true",
                    help="tfm arms: one more clean run per batch with deferred drafts off (runtime/deferred_drafts.py), "
                         "on the same engine: a same-machine before / after in the arm's JSON (deferred_off)")
    ap.add_argument("--arm-profile", action="append", default=[], metavar="NAME=PATH",
                    help="this arm replays acceptance from PATH instead of --profile (an arm with its own Weaver "
                         "width needs one: tfm16-full-async-oneslot-fp8draft-fp8head-w4)")
    ap.add_argument("--ab-switch", action="append", default=[], metavar="NAME",
                    help="tfm arms: more clean runs per batch after the clean run with the runtime switch NAME off and "
                         f"on (one of {', '.join(SWITCH_ABS)}; see SWITCH_ABS), on the same engine (<NAME>_ab in the "
                         "arm's JSON); repeatable")
    ap.add_argument("--ab-device-topology", action="store_true", help="the same as --ab-switch device_topology")
    ap.add_argument("--ab-commit-reuse", action="store_true", help="the same as --ab-switch commit_reuse")
    ap.add_argument("--ab-repeats", type=int, default=1,
                    help="--ab-switch: 1 runs off, on, off; N > 1 runs N off/on pairs in ABBA order (bench/e2e.py "
                         "ab_order), the report gives each setting's mean")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if "E2E_T0" in os.environ:
        T0 = float(os.environ["E2E_T0"])
    if args.child:
        return run_arm(ARMS[args.child], Path(args.settings))
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())

