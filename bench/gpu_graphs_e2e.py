#!/usr/bin/env python3
"""GPU check of tfm with CUDA graphs: greedy tokens with graphs == without, and == no speculation.

On the trained toy zoo (zoo/target in float32, zoo/drafter with its Weaver: proposal "tfm"),
tree budget B (TFM_GRAPHS_BUDGET, 32), engines in parallel subprocesses on the one GPU (fixed KV
cache, no memory profiling), each generating greedily P prompts (TFM_GRAPHS_PROMPTS, 32, from bench/graphs_zoo_prompts.json) x T new
tokens (TFM_GRAPHS_TOKENS, 64) twice: batch 8 (all prompts in one call, max_num_seqs 8) and
batch 1 (each prompt alone):

  nospec-eager   vLLM without speculation, enforce_eager=True
  nospec-graphs  vLLM without speculation, torch.compile + PIECEWISE CUDA graphs (vLLM's sizes)
  tfm-eager      tfm, enforce_eager=True
  tfm-graphs     tfm with PIECEWISE graphs of target and drafter (the default with tensor or data
                 parallelism), tfm's capture sizes
  tfm-fullpw     tfm with FULL_AND_PIECEWISE (the default on one GPU: tree steps of R requests x B
                 drafts replay full graphs with the tree verify inside, the others piecewise graphs)
  tfm-fullpw-pergroup  tfm-fullpw with VLLM_TFM_GDN_METADATA_ONCE=0 (vLLM's GDN metadata build per
                 KV-cache group instead of one build and block-table updates): same arithmetic
  tfm-fullpw-sync  tfm-fullpw with VLLM_TFM_DEFERRED_DRAFTS=0 (the scheduler gets the drafts' tokens,
                 the host waits for the drafter): the same drafts, tokens and acceptance
  tfm-fullpw-hosttopo  tfm-fullpw with VLLM_TFM_DEVICE_TOPOLOGY=0 (a full-graph step's plans and depth
                 positions built on the host, not by the topology kernel): the same tables, tokens
  tfm-fullpw-async  tfm-fullpw with vLLM's asynchronous scheduling (async_scheduling=True; the other tfm
                 engines pin async_scheduling=False, whatever tfm's default:
                 vllm_tfm/vllm_plugin/async_scheduling.py): the same tokens
                 (its acceptance is reported: steps past max_tokens count in it)
  tfm-eager-async  tfm-eager with asynchronous scheduling (its tokens against tfm-eager's are reported)
  tfm-eager-oneslot, tfm-fullpw-oneslot, tfm-fullpw-async-oneslot  tfm-eager, tfm-fullpw and tfm-fullpw-async
                 with one GDN state slot per request (VLLM_TFM_GDN_STATE_SLOTS=one,
                 vllm_tfm/vllm_plugin/runtime/one_slot.py): the same tokens. The other tfm engines pin
                 VLLM_TFM_GDN_STATE_SLOTS=per_draft (``PINNED_ENV``: the layout of their earlier results),
                 whatever tfm's default ("auto": one slot on one GPU)
  tfm-fullpw-async-auto  tfm-fullpw-async with tfm's own GDN state layout (no pin: "auto", one slot on one GPU)
  tfm-fallback-oneslot  one slot with FULL_AND_PIECEWISE where tfm's full tree graphs cannot run (the torch
                 reference ops, VLLM_TFM_KERNELS=0): vLLM's own full decode graphs are not captured, every step
                 replays piecewise graphs (runtime/graph_dispatch.py); the same tokens as no-spec

Each engine also runs the prompts in waves (label "waves"): driven step by step (LLMEngine.add_request /
step), the first 8 start together with max_tokens T, T - 4, ..., T - 28 (and so on), and whenever fewer
than 8 are in flight, TFM_GRAPHS_WAVE_HOLD (2) more steps run before the batch is refilled to 8. So the
all-spec batch shrinks and grows again many times: full tree graphs of R requests replay after those of R - 1, the case
that the shared tree-attention plan buffer of bench/NOTES.md section 50 got wrong, which the all-at-once
batch 8 (it only shrinks, at the end) never reaches. Its tokens join the verdicts as a third batch label.

Verdicts (all must hold for exit code 0): tfm-graphs == nospec-graphs, tfm-graphs == tfm-eager,
tfm-eager == nospec-eager, tfm-fullpw == nospec-graphs, tfm-fullpw == tfm-fullpw-pergroup,
tfm-fullpw == tfm-fullpw-sync, tfm-fullpw == tfm-fullpw-hosttopo, tfm-fullpw-async == nospec-graphs,
tfm-fullpw == tfm-fullpw-async, the -oneslot engines == the engines they copy and == no-spec, tfm-fallback-oneslot and
tfm-fullpw-async-auto == nospec-graphs (batch 8, batch 1 and waves, every prompt, every token); tfm-graphs and tfm-fallback-oneslot ran their tree steps in piecewise graphs (the
runtime's ``cudagraph.tree.PIECEWISE`` counter > 0) and never in a full graph; the tfm-fullpw
engines replayed full graphs for tree steps (``cudagraph.tree.FULL`` > 0); the -pergroup engine
never reused GDN metadata and, on the random models, the other tfm engines did
(``gdn.metadata_reused`` > 0); the full-graph tfm engines but the -pergroup control built some
steps' GDN metadata by the fast path (``gdn.metadata_fast`` > 0), the others none; the -sync engine handed the scheduler no placeholder drafts, every
other tfm engine some (the -async engine none: its scheduler makes its own), and the mean accepted length of
tfm-fullpw-sync equals tfm-fullpw's (tfm-fullpw-async's is reported: its steps past max_tokens count); tfm-fullpw
wrote some steps' topology on the device (``topology.device`` > 0), the -hosttopo engine none; in every engine's waves run the number of requests in
flight fell below 8 and came back to 8 at least once, and the full-graph engines replayed a tree graph
of a batch size again after one of another size (``cudagraph.tree.full_size_return`` > 0). nospec-graphs vs nospec-eager (compiled vs eager numerics) and tfm-eager vs tfm-eager-async are reported, not required. A divergence is reported
with its position and the no-spec top-2 log-probability margin there.

TFM_GRAPHS_MODELS=random: instead of the zoo, bench/gpu_plugin_e2e.py's random tiny hybrid and
drafter (written under OUT/models, random prompts). Its KV-cache layout differs from the zoo's: the
zoo's 5 attention layers (target + drafter, one spec) and 6 GDN layers make one GDN KV-cache group,
the random pair's 3 + 6 make two, so only there does the GDN metadata of a step serve a second
group through ``update_block_table`` (runtime/gdn_metadata.py; its hook counter is in the paths).
TFM_GRAPHS_MODELS=zoo-vl: the zoo with its target converted to Qwen3.6-27B's vision-language layout
(``Qwen3_5ForConditionalGeneration``, bench/vl_checkpoint.py, written under OUT/models), text-only prompts
with the image and video limits at 0.

Results: OUT/graphs.json (verdicts, per-engine timings, graph counters, final cudagraph mode and
capture sizes), OUT/<engine>.log, OUT/<engine>.json. TFM_GRAPHS_DEADLINE_S (420) bounds the run.

usage (GPU host, repository root):  bash bench/run_gpu_graphs.sh
   or, after `source .gpu-bundle/install.sh`:  python3 bench/gpu_graphs_e2e.py --out OUT
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

T0 = time.time()
REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
for _p in (str(REPO), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

__all__ = ["ENGINES", "REQUIRED", "WaveSchedule", "acceptance_async", "engine_kwargs", "graph_usage", "main", "run_waves",
           "commit_overlap_usage", "one_slot_usage", "topology_usage", "verdicts", "waves_usage"]

ZOO = REPO / "zoo"
MODELS = os.environ.get("TFM_GRAPHS_MODELS", "zoo")
if MODELS not in ("zoo", "zoo-vl", "random"):
    raise SystemExit(f"TFM_GRAPHS_MODELS={MODELS}: 'zoo' (default), 'zoo-vl' or 'random'")
BUDGET = int(os.environ.get("TFM_GRAPHS_BUDGET", "32"))
N_PROMPTS = int(os.environ.get("TFM_GRAPHS_PROMPTS", "32"))
MAX_TOKENS = int(os.environ.get("TFM_GRAPHS_TOKENS", "64"))
DEADLINE_S = float(os.environ.get("TFM_GRAPHS_DEADLINE_S", "420"))
MAX_SEQS = 8
WAVE_HOLD = int(os.environ.get("TFM_GRAPHS_WAVE_HOLD", "2"))
LABELS = ("b8", "b1", "waves")
SIZE_RETURN = "cudagraph.tree.full_size_return"

ENGINES: dict[str, dict[str, Any]] = {
    "nospec-eager": {"spec": False, "eager": True},
    "nospec-graphs": {"spec": False, "eager": False, "compilation_config": {"cudagraph_mode": "PIECEWISE"}},
    "tfm-eager": {"spec": True, "eager": True},
    "tfm-graphs": {"spec": True, "eager": False, "compilation_config": {"cudagraph_mode": "PIECEWISE"}},
    "tfm-fullpw": {"spec": True, "eager": False, "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}},
    # tfm-fullpw with vLLM's GDN metadata build per KV-cache group (runtime/gdn_metadata.py off): the
    # same arithmetic, so its tokens must equal tfm-fullpw's bit for bit, near-ties included
    "tfm-fullpw-pergroup": {"spec": True, "eager": False, "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"},
                            "env": {"VLLM_TFM_GDN_METADATA_ONCE": "0"}},
    # tfm-fullpw with deferred drafts off (runtime/deferred_drafts.py): the scheduler gets the tokens and
    # the host waits for the drafter before bookkeeping; the same drafts, so the same tokens and acceptance
    "tfm-fullpw-sync": {"spec": True, "eager": False, "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"},
                        "env": {"VLLM_TFM_DEFERRED_DRAFTS": "0"}},
    # tfm-fullpw with the full-graph steps' topology built on the host (runtime/device_topology.py off):
    # the same tables, so the same tokens bit for bit
    "tfm-fullpw-hosttopo": {"spec": True, "eager": False, "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"},
                            "env": {"VLLM_TFM_DEVICE_TOPOLOGY": "0"}},
    # tfm-fullpw with vLLM's asynchronous scheduling (the other tfm engines pin it off, engine_kwargs): the
    # scheduler runs a step ahead with placeholder drafts and vLLM corrects the counts on the device; the same
    # drafts reach the same forward, so the same tokens (its acceptance also counts steps past max_tokens)
    "tfm-fullpw-async": {"spec": True, "eager": False, "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"},
                         "async_scheduling": True},
    # tfm-eager with asynchronous scheduling: no graphs at all (NOTES 50's bisection: 3 of 16 prompts differed at
    # batch 8 before the plan fix, which cannot explain them); reported against tfm-eager, not required
    "tfm-eager-async": {"spec": True, "eager": True, "async_scheduling": True},
    # one GDN state slot per request (runtime/one_slot.py): the verify reads and the commit writes slot [n, 0]; the
    # same arithmetic on other slots, so the same tokens as the engine it copies
    "tfm-eager-oneslot": {"spec": True, "eager": True, "env": {"VLLM_TFM_GDN_STATE_SLOTS": "one"}},
    "tfm-fullpw-oneslot": {"spec": True, "eager": False, "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"},
                           "env": {"VLLM_TFM_GDN_STATE_SLOTS": "one"}},
    "tfm-fullpw-async-oneslot": {"spec": True, "eager": False, "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"},
                                 "async_scheduling": True, "env": {"VLLM_TFM_GDN_STATE_SLOTS": "one"}},
    # tfm-fullpw-oneslot with the drafter's query forward in full CUDA graphs (runtime/drafter_graphs.py): the same
    # kernels, so the same drafts, trees and mean accepted length (synchronous: its steps are those of the engine
    # it copies)
    "tfm-fullpw-oneslot-dgraph": {"spec": True, "eager": False,
                                  "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"},
                                  "env": {"VLLM_TFM_GDN_STATE_SLOTS": "one", "VLLM_TFM_DRAFTER_GRAPHS": "1"}},
    # tfm-fullpw-async with tfm's own gdn_state_slots ("auto", no pin): one slot on one GPU
    "tfm-fullpw-async-auto": {"spec": True, "eager": False, "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"},
                              "async_scheduling": True, "pin": False},
    # one slot where tfm's full tree graphs cannot run (the torch reference ops: VLLM_TFM_KERNELS=0): vLLM's own
    # full decode graphs are not captured either (runtime/graph_dispatch.py), every step replays piecewise graphs
    "tfm-fallback-oneslot": {"spec": True, "eager": False, "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"},
                             "env": {"VLLM_TFM_GDN_STATE_SLOTS": "one", "VLLM_TFM_KERNELS": "0"}},
}
PINNED_ENV: dict[str, str] = {"VLLM_TFM_GDN_STATE_SLOTS": "per_draft"}
"""What every tfm engine runs unless its own ``env`` says otherwise: vLLM's per-draft GDN state slots, the
layout of every result before bench/NOTES.md section 61 (tfm's default on one GPU is one slot
since then: the -oneslot engines)."""


def engine_env(name: str) -> dict[str, str]:
    """The ``VLLM_TFM_*`` settings engine ``name`` runs with: :data:`PINNED_ENV` for tfm engines, then its own."""
    e = ENGINES[name]
    return {**(PINNED_ENV if e["spec"] and e.get("pin", True) else {}), **(e.get("env") or {})}


def expects_one_slot(name: str) -> bool:
    """True for the tfm engines whose requests hold one GDN state slot: the plugin's resolution of their
    ``VLLM_TFM_GDN_STATE_SLOTS`` on one GPU (unset: its default, "auto")."""
    from vllm_tfm.vllm_plugin.runtime.one_slot import ONE_SLOT, gdn_state_slots_from_env

    return bool(ENGINES[name]["spec"]) and gdn_state_slots_from_env(engine_env(name)) == ONE_SLOT


REQUIRED: tuple[tuple[str, str], ...] = (
    ("tfm-graphs", "nospec-graphs"),
    ("tfm-graphs", "tfm-eager"),
    ("tfm-eager", "nospec-eager"),
    ("tfm-fullpw", "nospec-graphs"),
    ("tfm-fullpw", "tfm-fullpw-pergroup"),
    ("tfm-fullpw", "tfm-fullpw-sync"),
    ("tfm-fullpw", "tfm-fullpw-hosttopo"),
    ("tfm-fullpw-async", "nospec-graphs"),
    ("tfm-fullpw", "tfm-fullpw-async"),
    ("tfm-eager-oneslot", "tfm-eager"),
    ("tfm-fullpw-oneslot", "tfm-fullpw"),
    ("tfm-fullpw-oneslot", "nospec-graphs"),
    ("tfm-fullpw-async-oneslot", "nospec-graphs"),
    ("tfm-fallback-oneslot", "nospec-graphs"),
    ("tfm-fullpw-async-auto", "nospec-graphs"),
    ("tfm-fullpw-oneslot-dgraph", "nospec-graphs"),
    ("tfm-fullpw-oneslot-dgraph", "tfm-fullpw-oneslot"),
)
INFORMATIONAL: tuple[tuple[str, str], ...] = (("nospec-graphs", "nospec-eager"), ("tfm-eager", "tfm-eager-async"))
GRAPH_ENGINES = ("tfm-graphs", "tfm-fullpw", "tfm-fullpw-pergroup", "tfm-fullpw-sync", "tfm-fullpw-hosttopo", "tfm-fullpw-async",
                 "tfm-fullpw-oneslot", "tfm-fullpw-async-oneslot", "tfm-fallback-oneslot",
                 "tfm-fullpw-async-auto", "tfm-fullpw-oneslot-dgraph")
METADATA_REUSED = "gdn.metadata_reused"
METADATA_FAST = "gdn.metadata_fast"
DEVICE_TOPOLOGY = "topology.device"
ONE_SLOT_COMMITS = "commit.one_slot"
ONE_SLOT_INDICES = "commit.one_slot_indices"
DRAFTER_GRAPH = "proposer.drafter_graph"  # drafter forwards through the full drafter graphs (runtime/drafter_graphs.py)
DRAFTER_GRAPH_REPLAYS = "proposer.drafter_graph_replay"  # those that replayed a captured graph
COMMITS = "commit"  # every tree step's commit (runtime/hooks.py commit_step)
COMMITS_OVERLAPPED = "commit.overlap"  # those queued on the commit stream beside the drafting (runtime/commit_overlap.py)


def log(*args: object) -> None:
    print(f"[graphs {time.time() - T0:6.1f}s]", *args, flush=True)


PROMPT_FILE = REPO / "bench" / "graphs_zoo_prompts.json"


def prompts(n: int) -> list[list[int]]:
    """The first n of the fixed zoo prompts (``bench/graphs_zoo_prompts.json``: 32 windows of 5..100
    token ids of this repository's Python files as of one commit). Until section 39 of bench/NOTES.md
    they were drawn from the live source files, so every edit of those files changed some prompts
    and with them the acceptance, which then did not compare across commits."""
    fixed = json.loads(PROMPT_FILE.read_text())["prompts"]
    if n > len(fixed):
        raise SystemExit(f"TFM_GRAPHS_PROMPTS={n}: {PROMPT_FILE.name} holds {len(fixed)} prompts")
    return fixed[:n]


def random_prompts(n: int, seed: int = 1234) -> list[list[int]]:
    """Token ids of the random models' vocabulary (bench/gpu_plugin_e2e.py: 4096), 5..100 tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(2, 4094) for _ in range(rng.randint(5, 100))] for _ in range(n)]


def random_models(root: Path) -> tuple[Path, Path]:
    """bench/gpu_plugin_e2e.py's random target and drafter, written under ``root``."""
    os.environ["TFM_E2E_DIR"] = str(root)
    sys.path.insert(0, str(REPO / "bench"))
    import gpu_plugin_e2e

    gpu_plugin_e2e.make_random_models()
    return gpu_plugin_e2e.TARGET, gpu_plugin_e2e.DRAFTER


def zoo_vl_target(root: Path) -> Path:
    """The zoo's target in Qwen3.6-27B's vision-language layout (bench/vl_checkpoint.py: the same text weights
    under ``model.language_model.*``, a tiny random vision tower, M-RoPE), written under ``root``."""
    from vl_checkpoint import convert_to_vl

    dst = root / "target-vl"
    convert_to_vl(ZOO / "target", dst)
    return dst


def is_vl_target(target: str | Path) -> bool:
    cfg = json.loads((Path(target) / "config.json").read_text())
    return "vision_config" in cfg


def engine_kwargs(name: str, target: str, drafter: str, budget: int) -> dict[str, Any]:
    e = ENGINES[name]
    kw: dict[str, Any] = {
        "model": target, "dtype": "float32", "skip_tokenizer_init": True, "seed": 0, "gpu_memory_utilization": 0.12,
        "kv_cache_memory_bytes": 2_000_000_000, "max_model_len": 512, "max_num_seqs": MAX_SEQS,
        "enable_prefix_caching": False, "attention_backend": "TRITON_ATTN",
        "additional_config": {"gdn_prefill_backend": "triton"}, "disable_log_stats": True, "enforce_eager": e["eager"],
    }
    if e["eager"]:
        kw["compilation_config"] = {"custom_ops": ["none"]}
    else:
        kw["compilation_config"] = dict(e["compilation_config"])
    if e["spec"]:
        kw["speculative_config"] = {"method": "tfm", "model": drafter, "num_speculative_tokens": budget,
                                    "attention_backend": "TRITON_ATTN"}
        kw["async_scheduling"] = bool(e.get("async_scheduling", False))  # synchronous unless the engine says
    if is_vl_target(target):  # text-only prompts: no vision encoder, no multimodal profiling
        kw["limit_mm_per_prompt"] = {"image": 0, "video": 0}
    return kw


# ---------------------------------------------------------------------------------------- waves
def wave_max_tokens(i: int, max_tokens: int, max_seqs: int = MAX_SEQS) -> int:
    """max_tokens of prompt i in the waves run: T, T - 4, ..., T - 4 (max_seqs - 1), again from T (>= 1)."""
    return max(1, max_tokens - 4 * (i % max_seqs))


class WaveSchedule:
    """Which prompts join the waves run when: the first ``max_seqs`` at once; then, once fewer than
    ``max_seqs`` are in flight after a step, ``hold`` more steps run without new prompts and the batch is
    refilled to ``max_seqs`` at once (at once too when nothing is left in flight). So between batches of
    R requests, steps of fewer run (all tree steps once their prefills are done), and the batch grows back
    through a prefill step."""

    def __init__(self, n: int, max_seqs: int, hold: int) -> None:
        if n < 1 or max_seqs < 1 or hold < 0:
            raise ValueError(f"waves need n >= 1, max_seqs >= 1 and hold >= 0, got {n}, {max_seqs}, {hold}")
        self.n, self.max_seqs, self.hold = n, max_seqs, hold
        self._next = 0
        self._short = 0  # steps run since the batch was last full

    @property
    def pending(self) -> bool:
        """Prompts not yet added."""
        return self._next < self.n

    def start(self) -> list[int]:
        self._next = min(self.n, self.max_seqs)
        return list(range(self._next))

    def after_step(self, in_flight: int) -> list[int]:
        """Prompts to add now, given the number of unfinished requests after a step."""
        if not self.pending or in_flight >= self.max_seqs:
            self._short = 0
            return []
        self._short += 1
        if self._short <= self.hold and in_flight > 0:
            return []
        self._short = 0
        first, self._next = self._next, min(self.n, self._next + self.max_seqs - in_flight)
        return list(range(first, self._next))


def regrowths(in_flight: list[int], full: int) -> int:
    """How often the number of requests in flight came back to ``full`` after being below it."""
    return sum(1 for a, b in zip(in_flight, in_flight[1:]) if a < full <= b)


def run_waves(engine: Any, ps: list[list[int]], params_for: Any, max_tokens: int, max_seqs: int = MAX_SEQS,
              hold: int = WAVE_HOLD, render: Any = None) -> tuple[list[list[int]], list[int]]:
    """Generate ``ps`` through ``engine`` (vLLM's LLMEngine: add_request, step, get_num_unfinished_requests)
    in waves (:class:`WaveSchedule`, max_tokens from :func:`wave_max_tokens`): every prompt's tokens in
    prompt order, and the number of requests in flight before each step. ``render``: what LLM.generate does
    to a prompt before LLMEngine.add_request (vLLM 0.26: ``LLM._preprocess_cmpl_one``); None passes the raw
    token prompt, which vLLM's input processor still takes."""
    sched = WaveSchedule(len(ps), max_seqs, hold)
    done: dict[int, list[int]] = {}
    in_flight: list[int] = []

    def add(i: int) -> None:
        prompt = {"prompt_token_ids": ps[i]}
        engine.add_request(f"wave{i}", render(prompt) if render is not None else prompt,
                           params_for(wave_max_tokens(i, max_tokens, max_seqs)))

    for i in sched.start():
        add(i)
    while engine.has_unfinished_requests() or sched.pending:
        in_flight.append(engine.get_num_unfinished_requests())
        for o in engine.step():
            if o.finished:
                done[int(o.request_id.rsplit("-", 1)[0].removeprefix("wave"))] = list(o.outputs[0].token_ids)
        for i in sched.after_step(engine.get_num_unfinished_requests()):
            add(i)
    missing = [i for i in range(len(ps)) if i not in done]
    if missing:
        raise RuntimeError(f"waves: no finished output for prompts {missing[:8]}")
    return [done[i] for i in range(len(ps))], in_flight


# ---------------------------------------------------------------------------------------- child
def top2_margin(position_logprobs: dict[int, Any]) -> float | None:
    """Top-1 minus top-2 log-probability at one position (None with fewer than two)."""
    vals = sorted((lp.logprob for lp in position_logprobs.values()), reverse=True)
    return vals[0] - vals[1] if len(vals) > 1 else None


def run_engine(name: str, settings_path: Path) -> int:
    s = json.loads(settings_path.read_text())
    res: dict[str, Any] = {"engine": name, "status": "started"}
    path = Path(s["out"]) / f"{name}.json"
    res["env"] = engine_env(name)
    os.environ.pop("VLLM_TFM_GDN_STATE_SLOTS", None)  # the engine's layout is its own (engine_env), not the caller's
    os.environ.update(res["env"])  # before vllm_tfm reads it (engine build)

    def save() -> None:
        path.write_text(json.dumps(res, indent=1, default=str))

    save()
    try:
        import torch
        import vllm
        from vllm import LLM, SamplingParams

        import vllm_tfm
        from vllm_tfm.vllm_plugin.runtime import collect_tree_metrics

        vllm_tfm.register()
        res["machine"] = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "vllm": vllm.__version__}
        kw = engine_kwargs(name, s["target"], s["drafter"], s["budget"])
        res["engine_kwargs"] = kw
        t = time.perf_counter()
        llm = LLM(**kw)
        res["engine_start_s"] = round(time.perf_counter() - t, 1)
        cc = getattr(getattr(llm.llm_engine, "vllm_config", None), "compilation_config", None)
        res["cudagraph_mode"] = str(getattr(cc, "cudagraph_mode", None))
        res["compilation_mode"] = str(getattr(cc, "mode", None))
        res["cudagraph_capture_sizes"] = list(getattr(cc, "cudagraph_capture_sizes", None) or [])
        log(f"{name}: engine up in {res['engine_start_s']} s, cudagraph_mode {res['cudagraph_mode']}, "
            f"sizes {res['cudagraph_capture_sizes']}")
        save()
        ps = s["prompts"]
        logprobs = 2 if name == "nospec-eager" else None  # no-spec margins for divergence reports
        params = SamplingParams(temperature=0.0, max_tokens=s["max_tokens"], ignore_eos=True, detokenize=False,
                                logprobs=logprobs)

        def gen(batch: list[list[int]]) -> list[Any]:
            return [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)]

        def wave_params(max_tokens: int) -> SamplingParams:
            from vllm.sampling_params import RequestOutputKind

            return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False,
                                  output_kind=RequestOutputKind.FINAL_ONLY)  # as LLM.generate asks

        spec = ENGINES[name]["spec"]
        for label in LABELS:
            if spec:
                llm.collective_rpc(collect_tree_metrics, kwargs={"reset": True})
            t = time.perf_counter()
            if label == "waves":
                res[label], res["waves_in_flight"] = run_waves(llm.llm_engine, ps, wave_params, s["max_tokens"],
                                                               render=getattr(llm, "_preprocess_cmpl_one", None))
            else:
                outs = [c for b in ([ps] if label == "b8" else [[p] for p in ps]) for c in gen(b)]
                res[label] = [list(c.token_ids) for c in outs]
                if logprobs:
                    res[f"{label}_margins"] = [[top2_margin(pos) for pos in (c.logprobs or [])] for c in outs]
            res[f"{label}_s"] = round(time.perf_counter() - t, 2)
            if spec:
                snap = llm.collective_rpc(collect_tree_metrics, kwargs={"reset": True})[0] or {}
                res[f"{label}_tree_metrics"] = {k: snap.get(k) for k in ("steps", "tree_steps", "mean_accepted_length",
                                                                       "placeholder_steps", "placeholder_drafts_filled")}
                res[f"{label}_graph_steps"] = {k: v for k, v in (snap.get("hooks") or {}).items() if k.startswith("cudagraph.")}
                # which runtime paths ran (Weaver graph or eager build, tree attention kernel or Triton)
                res[f"{label}_paths"] = {k: v for k, v in (snap.get("hooks") or {}).items()
                                         if k == COMMITS or k.startswith(("weaver.", "attention.", "proposer.", "gdn.",
                                                                          "topology.", "commit.", "sampler."))}
            log(f"{name} {label}: {sum(map(len, res[label]))} tokens in {res[f'{label}_s']} s "
                f"{res.get(f'{label}_tree_metrics', '')} {res.get(f'{label}_graph_steps', '')}")
            save()
        res["status"] = "ok"
    except Exception as e:  # noqa: BLE001 - recorded; the driver reports it
        res["status"] = "error"
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        print(res["traceback"], flush=True)
    save()
    return 0 if res["status"] == "ok" else 1


# ---------------------------------------------------------------------------------------- verdicts
def _first_divergences(ref: list[list[int]], got: list[list[int]], margins: list[list[float | None]] | None) -> list[dict]:
    out = []
    for i, (a, b) in enumerate(zip(ref, got)):
        pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if pos is None and len(a) != len(b):
            pos = min(len(a), len(b))
        if pos is not None:
            m = margins[i][pos] if margins and i < len(margins) and pos < len(margins[i]) else None
            out.append({"prompt": i, "pos": pos, "expected": a[max(0, pos - 2): pos + 3],
                        "got": b[max(0, pos - 2): pos + 3], "nospec_top2_margin": m, "lengths": [len(a), len(b)]})
    return out


def verdicts(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Token equality of the engine pairs (REQUIRED and INFORMATIONAL) whose two engines were run,
    batch 8, batch 1 and waves; an engine that ran but has no tokens (it failed) makes its pairs unequal."""
    from e2e_controls import compare_runs

    margins = runs.get("nospec-eager", {})
    out: dict[str, Any] = {}
    for pair in (*REQUIRED, *INFORMATIONAL):
        a, b = pair
        if a not in runs or b not in runs:
            continue
        key = f"{a} == {b}"
        item: dict[str, Any] = {"required": pair in REQUIRED}
        for label in LABELS:
            ra, rb = runs.get(a, {}).get(label), runs.get(b, {}).get(label)
            if ra is None or rb is None:
                item[label] = {"missing": [n for n, r in ((a, ra), (b, rb)) if r is None]}
                continue
            cmp = compare_runs(rb, ra)
            cmp["equal"] = cmp["prompts_differing"] == 0 and len(ra) == len(rb)
            cmp["divergences"] = _first_divergences(rb, ra, margins.get(f"{label}_margins"))[:8]
            item[label] = cmp
        item["equal"] = all(isinstance(item.get(k), dict) and item[k].get("equal") for k in LABELS)
        out[key] = item
    return out


def graph_usage(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per graph engine: tree steps per cudagraph runtime mode; ok iff tfm-graphs replayed piecewise
    graphs for some tree steps and a full graph for none, and tfm-fullpw a full graph for some."""
    out: dict[str, Any] = {}
    for name in (n for n in GRAPH_ENGINES if n in runs):
        r = runs[name]
        counts: dict[str, int] = {}
        for label in LABELS:
            for k, v in (r.get(f"{label}_graph_steps") or {}).items():
                counts[k] = counts.get(k, 0) + int(v)
        if name.startswith("tfm-fullpw"):
            ok = counts.get("cudagraph.tree.FULL", 0) > 0
        else:
            ok = counts.get("cudagraph.tree.PIECEWISE", 0) > 0 and counts.get("cudagraph.tree.FULL", 0) == 0
        out[name] = {"counts": counts, "cudagraph_mode": r.get("cudagraph_mode"), "ok": ok}
    return out


def metadata_usage(runs: dict[str, dict[str, Any]], models: str) -> dict[str, Any]:
    """Per tfm engine: how many GDN KV-cache groups took the step's GDN metadata with their own block
    table, and how many builds took the fast all-spec full-graph path (runtime/gdn_metadata.py). ok iff
    the -pergroup control did neither; on the random models (two GDN groups; the zoo has one) every
    other tfm engine reused; and the engines with full graphs (the -pergroup control aside) made fast
    builds, the others none (their builder has no full-graph buffers to write)."""
    out: dict[str, Any] = {}
    for name, r in _tfm_engines(runs):
        n, fast = _path_counts(r, METADATA_REUSED, METADATA_FAST)
        off = (ENGINES[name].get("env") or {}).get("VLLM_TFM_GDN_METADATA_ONCE") == "0"
        full = "FULL" in str((ENGINES[name].get("compilation_config") or {}).get("cudagraph_mode", ""))
        ok = n == 0 if off else (n > 0 if models == "random" else True)
        ok = ok and (fast > 0 if full and not off else fast == 0)
        out[name] = {METADATA_REUSED: n, METADATA_FAST: fast, "ok": ok}
    return out


def topology_usage(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per full-graph tfm engine: steps whose topology the kernel wrote (runtime/device_topology.py).
    ok iff tfm-fullpw had some and the -hosttopo control none (the others are not judged)."""
    out: dict[str, Any] = {}
    for name in ("tfm-fullpw", "tfm-fullpw-hosttopo"):
        if name not in runs:
            continue
        (n,) = _path_counts(runs[name], DEVICE_TOPOLOGY)
        out[name] = {DEVICE_TOPOLOGY: n, "ok": n == 0 if name.endswith("hosttopo") else n > 0}
    return out


def _tfm_engines(runs: dict[str, dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(name, result) of the runs of tfm engines."""
    return [(name, r) for name, r in runs.items() if ENGINES.get(name, {}).get("spec")]


def _path_counts(r: dict[str, Any], *hooks: str) -> tuple[int, ...]:
    """Each hook's count summed over the engine's runs (batch 8, batch 1, waves)."""
    return tuple(sum(int((r.get(f"{label}_paths") or {}).get(hook, 0)) for label in LABELS) for hook in hooks)


def one_slot_usage(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per tfm engine: commits into the one GDN state slot (runtime/one_slot.py) and tree steps whose commit
    indices came from the slot column 0 (``commit.one_slot_indices``, runtime/step_kernels.py). ok iff the -oneslot
    engines and tfm-fullpw-async-auto (tfm's default layout on one GPU) made some commits and the others none (the
    engines ran the layout they were meant to), and the one-slot engines on the kernel path took the column-0
    indices while the others (per-draft slots, the torch reference ops of ``VLLM_TFM_KERNELS=0``) never did."""
    out: dict[str, Any] = {}
    for name, r in _tfm_engines(runs):
        n, m = _path_counts(r, ONE_SLOT_COMMITS, ONE_SLOT_INDICES)
        env = engine_env(name)
        indices = expects_one_slot(name) and env.get("VLLM_TFM_KERNELS") != "0" and env.get("VLLM_TFM_ONE_SLOT_COMMIT") != "0"
        ok = (n > 0 if expects_one_slot(name) else n == 0) and (m > 0 if indices else m == 0)
        out[name] = {ONE_SLOT_COMMITS: n, ONE_SLOT_INDICES: m, "ok": ok}
    return out


def commit_overlap_usage(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per tfm engine: its commits and those that ran on the commit stream beside the drafting (``commit.overlap``,
    runtime/commit_overlap.py). ok iff every commit did where the engine's environment turns it on
    (``VLLM_TFM_COMMIT_OVERLAP=1``) and none elsewhere: the engine's tokens were made with the stream layout it was
    meant to run."""
    from vllm_tfm.vllm_plugin.runtime.commit_overlap import commit_overlap_from_env

    out: dict[str, Any] = {}
    for name, r in _tfm_engines(runs):
        n, m = _path_counts(r, COMMITS, COMMITS_OVERLAPPED)
        on = commit_overlap_from_env({**os.environ, **engine_env(name)})
        out[name] = {COMMITS: n, COMMITS_OVERLAPPED: m, "ok": m == n if on else m == 0}
    return out


def drafter_graph_usage(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per tfm engine: drafter forwards through the full drafter graphs and those that replayed one. ok iff the
    engines whose environment turns them on (``VLLM_TFM_DRAFTER_GRAPHS=1``: the -dgraph engine, or every engine
    when the driver's environment sets it) replayed some and the others took none; and, where both ran, the
    -dgraph engine's mean accepted length equals tfm-fullpw-oneslot's in every run (``same_drafts``: the graphs'
    marginals are the piecewise forward's, so the trees are the same)."""
    from vllm_tfm.vllm_plugin.runtime.drafter_graphs import drafter_graphs_from_env

    out: dict[str, Any] = {}
    for name, r in _tfm_engines(runs):
        n, m = _path_counts(r, DRAFTER_GRAPH, DRAFTER_GRAPH_REPLAYS)
        on = drafter_graphs_from_env({**os.environ, **engine_env(name)})
        out[name] = {DRAFTER_GRAPH: n, DRAFTER_GRAPH_REPLAYS: m, "ok": m > 0 if on else n == 0}
    same = _same_acceptance(runs, "tfm-fullpw-oneslot", "tfm-fullpw-oneslot-dgraph")
    if same is not None:
        out["same_drafts"] = same
    return out


def deferred_usage(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per tfm engine: steps whose drafts went to the scheduler as placeholders (runtime/deferred_drafts.py).
    ok iff the -sync control had none and every other synchronous tfm engine had some (an asynchronous
    engine none: vLLM's scheduler makes its own placeholders), and the mean accepted length of the -sync
    control equals tfm-fullpw's in both batches (the same drafts reached the same forward). The -async
    engine's is only reported (:func:`acceptance_async`)."""
    out: dict[str, Any] = {}
    for name, r in _tfm_engines(runs):
        n = sum(int((r.get(f"{label}_tree_metrics") or {}).get("placeholder_steps") or 0) for label in LABELS)
        off = (ENGINES[name].get("env") or {}).get("VLLM_TFM_DEFERRED_DRAFTS") == "0"
        off = off or bool(ENGINES[name].get("async_scheduling"))
        out[name] = {"placeholder_steps": n, "ok": n == 0 if off else n > 0}
    same = _same_acceptance(runs, "tfm-fullpw", "tfm-fullpw-sync")
    if same is not None:
        out["same_acceptance"] = same
    return out


def _mean_accepted_lengths(runs: dict[str, dict[str, Any]], other: str,
                           base: str = "tfm-fullpw") -> dict[str, list[Any]] | None:
    """{batch label: [base's, other's mean accepted length]}, None unless both engines ran."""
    if base not in runs or other not in runs:
        return None
    return {label: [(runs[e].get(f"{label}_tree_metrics") or {}).get("mean_accepted_length") for e in (base, other)]
            for label in LABELS}


def _same_acceptance(runs: dict[str, dict[str, Any]], base: str, other: str) -> dict[str, Any] | None:
    """Both engines' mean accepted lengths per run and ok iff they are equal in every run; None unless both ran."""
    mal = _mean_accepted_lengths(runs, other, base)
    if mal is None:
        return None
    return {"mean_accepted_length": mal, "ok": all(a is not None and a == b for a, b in mal.values())}


def acceptance_async(runs: dict[str, dict[str, Any]]) -> dict[str, list[Any]] | None:
    """The -async engine's mean accepted length next to tfm-fullpw's, reported without a verdict:
    asynchronous scheduling schedules a request one step past its max_tokens at times, a step whose tokens
    vLLM discards and the tree metrics count (bench/NOTES.md section 50: at batch 1 its steps up to
    max_tokens equal tfm-fullpw's, drafts and accepted counts, yet its mean accepted length differs)."""
    return _mean_accepted_lengths(runs, "tfm-fullpw-async")


def waves_usage(runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per engine that ran the waves: how often its batch came back to 8 after being smaller and, for the
    full-graph engines, how often a tree graph of a size replayed again after one of another size
    (SIZE_RETURN). ok iff the batch grew back at least once and every full-graph engine (tfm-fullpw*)
    returned to a size at least once: the case the waves exist for happened."""
    out: dict[str, Any] = {}
    for name, r in runs.items():
        if "waves_in_flight" not in r:
            if r.get("status") == "ok":
                out[name] = {"ok": False, "why": "no waves run"}
            continue
        grew = regrowths(r["waves_in_flight"], MAX_SEQS)
        item: dict[str, Any] = {"regrowths": grew}
        ok = grew > 0
        if name.startswith("tfm-fullpw"):
            item[SIZE_RETURN] = int((r.get("waves_graph_steps") or {}).get(SIZE_RETURN, 0))
            ok = ok and item[SIZE_RETURN] > 0
        item["ok"] = ok
        out[name] = item
    return out


# ---------------------------------------------------------------------------------------- driver
def driver(args: argparse.Namespace) -> int:
    from phase_process import run_phase_process

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = [n.strip() for n in args.engines.split(",") if n.strip()]
    bad = [n for n in names if n not in ENGINES]
    if bad:
        raise SystemExit(f"unknown engine {bad[0]!r}; engines: {', '.join(ENGINES)}")
    if MODELS == "random":
        target, drafter, ps = (*random_models(out / "models"), random_prompts(N_PROMPTS))
    else:
        target = zoo_vl_target(out / "models") if MODELS == "zoo-vl" else ZOO / "target"
        drafter, ps = ZOO / "drafter", prompts(N_PROMPTS)
    settings = {"out": str(out), "models": MODELS, "target": str(target), "drafter": str(drafter), "budget": BUDGET,
                "max_tokens": MAX_TOKENS, "prompts": ps}
    settings_path = out / "settings.json"
    settings_path.write_text(json.dumps(settings))
    log(f"{len(names)} engines in parallel: {', '.join(names)}; B={BUDGET}, {N_PROMPTS} prompts x {MAX_TOKENS} tokens")
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", PYTHONUNBUFFERED="1")
    remaining = DEADLINE_S - (time.time() - T0)

    def one(name: str) -> tuple[int | None, str | None]:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", name, "--settings", str(settings_path)]
        return run_phase_process(cmd, out / f"{name}.log", max(30.0, remaining), env, name,
                                 done_file=None)

    with ThreadPoolExecutor(max_workers=len(names)) as pool:
        ended = dict(zip(names, pool.map(one, names)))
    runs = {}
    for name in names:
        f = out / f"{name}.json"
        runs[name] = json.loads(f.read_text()) if f.is_file() else {"status": "error", "error": "no result file"}
        rc, why = ended[name]
        runs[name]["exit"] = {"code": rc, "stopped": why}
        log(f"{name}: {runs[name]['status']} (exit {rc}{', ' + why if why else ''}) {runs[name].get('error', '')}")
    switches = {k: v for k, v in sorted(os.environ.items()) if k.startswith("VLLM_TFM_")}
    knobs = {k: v for k, v in sorted(os.environ.items()) if k.startswith("TFM_GRAPHS_")}
    result = {"command": " ".join([*(f"{k}={v}" for k, v in {**switches, **knobs}.items()), "bash bench/run_gpu_graphs.sh",
                                   *([f"--engines {args.engines}"] if args.engines != ",".join(ENGINES) else [])]),
              "tfm_env": switches, "budget": BUDGET, "prompts": N_PROMPTS, "max_tokens": MAX_TOKENS,
              "machine": next((r.get("machine") for r in runs.values() if r.get("machine")), {}),
              "verdicts": verdicts(runs), "graph_usage": graph_usage(runs),
              "metadata_usage": metadata_usage(runs, MODELS),
              "deferred_usage": deferred_usage(runs), "acceptance_async": acceptance_async(runs),
              "topology_usage": topology_usage(runs), "waves_usage": waves_usage(runs),
              "one_slot_usage": one_slot_usage(runs), "commit_overlap_usage": commit_overlap_usage(runs),
              "drafter_graph_usage": drafter_graph_usage(runs),
              "engines": {n: {k: v for k, v in r.items() if k not in (*LABELS, "b8_margins", "b1_margins", "traceback")}
                          for n, r in runs.items()}}
    required = [v["equal"] for v in result["verdicts"].values() if v["required"]]
    usages = ("graph_usage", "metadata_usage", "deferred_usage", "topology_usage", "waves_usage", "one_slot_usage",
              "commit_overlap_usage", "drafter_graph_usage")  # acceptance_async is reported, not judged
    ok = bool(required) and all(required) and all(v["ok"] for u in usages for v in result[u].values())
    result["ok"] = ok
    (out / "graphs.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    for key, v in result["verdicts"].items():
        parts = [f"{lb}: " + ("EQUAL" if v[lb].get("equal") else f"DIFF {v[lb]}") if isinstance(v.get(lb), dict) else lb
                 for lb in LABELS]
        log(f"{'REQUIRED' if v['required'] else 'info    '} {key}: " + "; ".join(
            p if len(p) < 400 else p[:400] + "..." for p in parts))
    for name, g in result["graph_usage"].items():
        log(f"graphs {name}: {'OK' if g['ok'] else 'FAIL'} mode {g['cudagraph_mode']} {g['counts']}")
    for name, m in result["metadata_usage"].items():
        log(f"gdn metadata {name}: {'OK' if m['ok'] else 'FAIL'} {METADATA_REUSED} {m[METADATA_REUSED]}"
            f" {METADATA_FAST} {m[METADATA_FAST]}")
    for name, t in result["topology_usage"].items():
        log(f"topology {name}: {'OK' if t['ok'] else 'FAIL'} {DEVICE_TOPOLOGY} {t[DEVICE_TOPOLOGY]}")
    for name, o in result["one_slot_usage"].items():
        log(f"one slot {name}: {'OK' if o['ok'] else 'FAIL'} {ONE_SLOT_COMMITS} {o[ONE_SLOT_COMMITS]}"
            f" {ONE_SLOT_INDICES} {o[ONE_SLOT_INDICES]}")
    for name, c in result["commit_overlap_usage"].items():
        log(f"commit overlap {name}: {'OK' if c['ok'] else 'FAIL'} {COMMITS} {c[COMMITS]} {COMMITS_OVERLAPPED} "
            f"{c[COMMITS_OVERLAPPED]}")
    for name, d in result["drafter_graph_usage"].items():
        log(f"drafter graphs {name}: {'OK' if d['ok'] else 'FAIL'} " + " ".join(f"{k} {x}" for k, x in d.items() if k != "ok"))
    for name, w in result["waves_usage"].items():
        log(f"waves {name}: {'OK' if w['ok'] else 'FAIL'} " + " ".join(f"{k} {x}" for k, x in w.items() if k != "ok"))
    log(("OK" if ok else "FAIL") + f": results in {out / 'graphs.json'}")
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/tfm-graphs-out"))
    ap.add_argument("--engines", default=",".join(ENGINES))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--settings", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return run_engine(args.child, Path(args.settings))
    return driver(args)


if __name__ == "__main__":
    sys.exit(main())
