#!/usr/bin/env python3
"""Why greedy tfm diverges from no-spec under preemption (bench/results/preempt_zoo.json.gz): one GPU command.

Offline engines (engine core in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0), toy zoo, float32,
TRITON_ATTN, eager, prefix caching off, max_model_len 1024, B = 16. Workload: ``TFM_PREEMPT_PROMPTS``
(12) prompts (windows of the standard library's Python files in the zoo tokenizer): three quarters
short (16..96 tokens), a quarter medium (128..``TFM_PREEMPT_MAX_PROMPT``, 256), the last one ending
0..3 tokens before ``max_model_len`` minus its output (vLLM caps its drafts near the end); each with
``max_tokens`` in [9/10, 1] x ``TFM_PREEMPT_MAX_TOKENS`` (768), ignore_eos, all submitted at once.
"small" arms get a KV cache for ``TFM_PREEMPT_CAPACITY`` (6) of the workload's longest requests
(bench/soak.py's estimate, per method); "big" arms 4 GiB.

Calibration (why the first version saw no tfm preemption: 32 prompts of 16..700 tokens x 256
outputs, capacity 8). vLLM 0.26's scheduler (v1/core/sched/scheduler.py) admits a waiting request
only if its whole prompt fits now (``allocate_slots(..., full_sequence_must_fit=True)``: prompt
plus ``num_lookahead_tokens``, which is B + 1 = 17 for ``use_dflash()`` methods, 425-1000) and
preempts only when a *running* request cannot get the block its next step needs (running loop,
562-603). A tfm request holds 1 + B = 17 GDN state blocks from admission on (mamba_cache_mode
"none": ``MambaManager.get_num_blocks_to_allocate`` adds ``num_speculative_blocks`` blocks; the toy's
6 GDN layers are one KV-cache group, its 2 target and 3 drafter attention layers share the other
group's blocks), while its attention grows by one 112-token block per 112 tokens. So admission
spends most of the pool on fixed state blocks, stops one admission short of full, and 256 new
tokens (about 2.3 blocks per request) never outgrow that slack: the engine ran 8 requests at a
time instead of preempting (no-spec: 1 state block per group and 80-token blocks, so its requests
outgrow the slack and get preempted). Preemption needs the running requests' growth to exceed
the slack: short prompts and long outputs of similar length, so that the admitted requests grow
together. A model of that scheduling (admission and growth as above, B + 1 = 17 new tokens and 17
lookahead slots per decode step, 2.8 tokens per step) gives, for this workload at capacity 6 over
10 workload seeds x 3 acceptance seeds, tfm 3-20 preemptions (median 6), no-spec 5-9, dflash
3-30; for the first version's workload it gave tfm 2 where the H200 saw 0 (no-spec: 10 vs 9
seen), so expect a couple fewer. ``max_num_seqs`` (64) is not binding: about 7 tfm requests fit.

Arms, in this order, each in its own subprocess with a time cap (engine start plus generation; the
first engine of a fresh machine takes ~50 s to start), all within ``TFM_PREEMPT_DEADLINE_S`` (470 s)
of the runner's start (install included); arms that would start with less than ``MIN_START_S``
left are recorded as skipped:
  nospec_big             reference, with the top-5 log-probabilities of every output position;
  tfm_small              tfm, all greedy, small KV, request trace on;
  tfm_mixed              the soak's conditions offline: small KV, two thirds greedy, the others at
                         temperature 0.8 / 1.3 with seeds, two sampled requests aborted a third
                         into their output (rows freed mid-batch), request trace on; its greedy
                         requests are compared;
  nospec_small           no speculation, small KV: does vLLM itself diverge under preemption?
  dflash_small           vLLM's in-tree chain "dflash" (15 drafts), small KV;
  tfm_small_torch        tfm small KV with VLLM_TFM_KERNELS=0 (torch reference ops) - only when
                         tfm_small or tfm_mixed diverged;
  tfm_small_chain_forced tfm small KV, VLLM_TFM_PROPOSAL=chain, VLLM_TFM_FORCE_TREE_PATH=1 - same;
  tfm_big                tfm, 4 GiB KV: no preemption, same batch, request trace on;
  dflash_big             vLLM's in-tree "dflash", 4 GiB KV;
  tfm_big_chain          tfm, 4 GiB KV, VLLM_TFM_PROPOSAL=chain (vLLM verifies every step as chains).
The last three exist for the other workloads (``make_prompts``), both without preemption:
TFM_PREEMPT_WORKLOAD=near-max, long requests that end at max_model_len make vLLM skip the drafter
for the whole batch (zero drafts, chain steps), the condition of every divergence the serving
soak's preempt phase traced; TFM_PREEMPT_WORKLOAD=stagger, short prompts arrive one by one into
rows freed in front of running spec rows (vLLM 0.26 then reads those spec rows' GDN gates at other
tokens in chain steps: runtime/gdn.py; tfm arms count the steps it split, hook gdn.mixed_split);
TFM_PREEMPT_WORKLOAD=plain-front, the same condition made on purpose (``make_prompts``): requests
ending in front rows while the drafter is skipped leave a plain row in front of spec rows.
Every arm records its tokens, vLLM's ``vllm:num_preemptions``, a scheduler-side log of each
preemption (request id, output tokens so far: the position the resumed request restarts from) and
of steps where a running request was left out; tfm arms also the workers' tree metrics
(``resumed_requests``, ``accepted_restored``, ``states_moved``), and traced arms the request trace
(``VLLM_TFM_TRACE``, docs/metrics.md) read at every divergence (bench/trace_reading.py). The
driver compares each arm with nospec_big (bench/preempt_reading.py) and writes
OUT/preempt_repro.json (per-arm summary, divergences with their trace, the reading) after every
arm; every arm's JSON (all tokens), log and trace go to OUT/arms.tar.gz.

usage (GPU host, repository root):  bash bench/run_gpu_preempt_repro.sh
   or:  python3 bench/gpu_preempt_repro.py --out OUT [--arm all|<arm>|summary] [--arms a,b,...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tarfile
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

T0 = float(os.environ.get("TFM_PREEMPT_T0", time.time()))
BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _p in (BENCH, REPO):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import preempt_reading as pr
import trace_reading as tr
from phase_process import echo_log, run_phase_process  # noqa: E402

WORK = Path(os.environ.get("TFM_PREEMPT_DIR", "/tmp/tfm-preempt"))  # per-arm JSON, logs and traces (tarred into OUT)
DEADLINE_S = float(os.environ.get("TFM_PREEMPT_DEADLINE_S", "470"))  # from T0 (the runner's start)
N_PROMPTS = int(os.environ.get("TFM_PREEMPT_PROMPTS", "12"))
MAX_TOKENS = int(os.environ.get("TFM_PREEMPT_MAX_TOKENS", "768"))
MAX_PROMPT = int(os.environ.get("TFM_PREEMPT_MAX_PROMPT", "256"))
CAPACITY = float(os.environ.get("TFM_PREEMPT_CAPACITY", "6"))
BUDGET = 16
DFLASH_K = 15  # the drafter's block size 16 minus the bonus slot
BIG_KV = 4 << 30
MAX_MODEL_LEN = 1024
MIN_START_S = 45.0
COLD_START_S = 75.0  # the first engine on a fresh machine (Triton/NVRTC caches empty): ~50 s seen
WARM_START_S = 40.0  # later engines: 7 s seen, 35 s for the first tfm engine (kernel compilation)
TOPK = 5
MIXED_SEED = 1000
ARMS: dict[str, dict[str, Any]] = {
    "nospec_big": {"method": None, "kv": "big", "gen_s": 60},
    "tfm_small": {"method": "tfm", "kv": "small", "gen_s": 150, "trace": True},
    "tfm_mixed": {"method": "tfm", "kv": "small", "gen_s": 150, "trace": True, "mixed": True},
    "nospec_small": {"method": None, "kv": "small", "gen_s": 60},
    "dflash_small": {"method": "dflash", "kv": "small", "gen_s": 70},
    "tfm_small_torch": {"method": "tfm", "kv": "small", "gen_s": 200, "env": {"VLLM_TFM_KERNELS": "0"},
                        "only_if_tfm_diverged": True},
    "tfm_small_chain_forced": {"method": "tfm", "kv": "small", "gen_s": 170, "only_if_tfm_diverged": True,
                               "env": {"VLLM_TFM_PROPOSAL": "chain", "VLLM_TFM_FORCE_TREE_PATH": "1"}},
    "tfm_big": {"method": "tfm", "kv": "big", "gen_s": 90, "trace": True},
    "dflash_big": {"method": "dflash", "kv": "big", "gen_s": 60},
    "tfm_big_chain": {"method": "tfm", "kv": "big", "gen_s": 90, "trace": True, "env": {"VLLM_TFM_PROPOSAL": "chain"}},
}  # fmt: skip
WORKLOADS = ("preempt", "near-max", "stagger", "plain-front")
WORKLOAD = os.environ.get("TFM_PREEMPT_WORKLOAD", "preempt")
NEAR_MAX_LONG_OUTPUTS = (24, 40, 56)  # near-max: the long requests' outputs (each ends at max_model_len)
NEAR_MAX_SHORT_TOKENS = 200  # near-max: the short requests' outputs
STAGGER_FIRST_STEP, STAGGER_EVERY = 6, 4  # stagger: engine step of the first late arrival, steps between arrivals
TFM_SMALL_ARMS = ("tfm_small", "tfm_mixed")  # a divergence in one of these runs the only_if_tfm_diverged arms


def log(*args: object) -> None:
    print(f"[tfm-preempt {time.time() - T0:7.1f}s]", *args, flush=True)


# ---------------------------------------------------------------------------------------- workload
def make_prompts(
    target: str, n: int = N_PROMPTS, max_prompt: int = MAX_PROMPT, max_tokens: int = MAX_TOKENS, seed: int = 7,
    workload: str = "preempt",
) -> dict[str, Any]:
    """The workload: prompts, their lengths and each request's max_tokens.

    "preempt" (module docstring): the last request ends 0..3 tokens before ``MAX_MODEL_LEN``.
    "near-max" (big KV, no preemption): requests 3, 7, 11 (of 12) have prompts of ``MAX_MODEL_LEN``
    minus one minus their output (``NEAR_MAX_LONG_OUTPUTS``), so each ends one token short of it; the
    others are short (16..96 tokens) with ~``NEAR_MAX_SHORT_TOKENS`` outputs. While a long request's
    length plus the drafter's query passes ``max_model_len``, vLLM 0.26 skips the drafter for the
    whole batch and schedules zero drafts (gpu_model_runner.py:4575-4660, ``_input_fits_in_drafter``):
    the short greedy requests then decode through chain steps of zero drafts, the condition of every
    divergence of the serving soak's preempt phase (the request trace: ``lk`` "miss"/"absent",
    path "chains").
    """
    if workload not in WORKLOADS:
        raise ValueError(f"workload {workload!r}: choose one of {WORKLOADS}")
    rng = random.Random(seed)
    try:
        import soak

        stream = soak.stdlib_token_stream(target)
        kind = "standard-library Python files, zoo tokenizer"
    except Exception as e:  # noqa: BLE001 - fall back to random ids in the zoo's vocabulary
        vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
        stream = [rng.randrange(3, vocab - 2) for _ in range(50_000)]
        kind = f"random token ids 3..{vocab - 3} (tokenizer failed: {type(e).__name__}: {e})"
    arrive = [0] * n
    if workload == "stagger":
        # half the requests at once (the first quarter finish early, freeing rows near the batch's
        # front), then the other half one by one with prompts of 3..14 tokens: vLLM's decode-first
        # reorder counts a prompt of at most 1 + B tokens as a decode, so it stays in the row it got
        # (a freed one) in front of running spec rows - vLLM 0.26's mixed-batch GDN gate misread
        # (runtime/gdn.py, ``_chain_step_forward_core``)
        first = n // 2
        outs = [rng.randint(24, 40) if i < first // 2 else rng.randint(240, 260) if i < first else rng.randint(60, 120)
                for i in range(n)]  # fmt: skip
        lens = [rng.randint(16, 96) if i < first else rng.randint(3, 14) for i in range(n)]
        arrive = [0 if i < first else STAGGER_FIRST_STEP + STAGGER_EVERY * (i - first) for i in range(n)]
    elif workload == "plain-front":
        # the soak's misordered step made on purpose: the last two prompts are so long that the drafter
        # (1 + B query tokens) no longer fits max_model_len, so vLLM schedules zero drafts for the whole
        # batch (chain steps, one token per step) while they run; the first half of the requests end
        # within that window with 3..8 new tokens, and vLLM caps a request's drafts to the tokens it
        # has left, so each one's last step is a plain row (no drafts) in front of the spec rows of
        # the requests after it, which run on for ~90 tokens
        first = n // 2
        outs = [3 + i if i < first else (90 if i < n - 2 else 14) for i in range(n)]
        lens = [rng.randint(16, 96) if i < n - 2 else MAX_MODEL_LEN - 1 - outs[i] for i in range(n)]
    elif workload == "near-max":
        longs = list(NEAR_MAX_LONG_OUTPUTS)
        outs, lens = [], []
        for i in range(n):
            if i % 4 == 3 and longs:
                outs.append(longs.pop(0))
                lens.append(MAX_MODEL_LEN - 1 - outs[-1])
            else:
                outs.append(rng.randint(NEAR_MAX_SHORT_TOKENS * 9 // 10, NEAR_MAX_SHORT_TOKENS))
                lens.append(rng.randint(16, 96))
    else:
        outs = [rng.randint(max_tokens * 9 // 10, max_tokens) for _ in range(n)]
        lens = [rng.randint(128, max_prompt) if i % 4 == 3 else rng.randint(16, 96) for i in range(n)]
        lens[-1] = max(1, MAX_MODEL_LEN - outs[-1] - rng.randint(0, 3))  # near max_model_len
    prompts = []
    for n_tok in lens:
        start = rng.randrange(len(stream))
        prompts.append([stream[(start + j) % len(stream)] for j in range(n_tok)])
    return {"kind": kind, "workload": workload, "prompts": prompts, "lengths": lens, "max_tokens": outs,
            "arrive_step": arrive}


def sampling_kinds(n: int, mixed: bool) -> list[dict[str, Any]]:
    """Per request: temperature and seed (greedy everywhere, or for ``mixed`` two thirds greedy and
    the others at 0.8 / 1.3 with seeds), and for ``mixed`` the output count after which two sampled
    requests are aborted (``abort_after``, fraction of max_tokens)."""
    kinds: list[dict[str, Any]] = []
    for i in range(n):
        if not mixed or i % 3 != 1:
            kinds.append({"temperature": 0.0})
        else:
            kinds.append({"temperature": 0.8 if i % 6 == 1 else 1.3, "seed": MIXED_SEED + i})
    if mixed:
        for i in [i for i, k in enumerate(kinds) if k["temperature"] > 0][:2]:
            kinds[i]["abort_after"] = 1 / 3
    return kinds


def kind_label(k: dict[str, Any]) -> str:
    label = "greedy" if not k["temperature"] else f"t={k['temperature']:g} seed={k['seed']}"
    return label + (" aborted" if "abort_after" in k else "")


def kv_bytes(arm: str, target: str, drafter: str, longest: int) -> dict[str, Any]:
    """The arm's KV-cache bytes: 4 GiB, or CAPACITY x one ``longest``-token request of that arm."""
    spec = ARMS[arm]
    if spec["kv"] == "big":
        return {"kv_cache_bytes": BIG_KV}
    import soak

    budget = {"tfm": BUDGET, "dflash": DFLASH_K}.get(spec["method"] or "", 0)
    # a tfm engine holds one GDN state slot per request with VLLM_TFM_GDN_STATE_SLOTS=one (inherited from the runner)
    slots = soak.gdn_state_slots_from_env() if spec["method"] == "tfm" else "per_draft"
    est = soak.estimate_request_kv_bytes(target, drafter, budget, longest, gdn_state_slots=slots)
    if spec["method"] is None:  # no drafter layers without speculation
        d = json.loads((Path(drafter) / "config.json").read_text())
        d_head = int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"])
        est -= (longest + budget + 1) * 2 * int(d["num_key_value_heads"]) * d_head * 4 * int(d["num_hidden_layers"])
    return {"kv_cache_bytes": math.ceil(CAPACITY * est), "bytes_per_request": est, "capacity_requests": CAPACITY,
            "request_tokens": longest, "gdn_state_slots": slots}  # fmt: skip


# ---------------------------------------------------------------------------------------- one arm
class SchedulerLog:
    """Observes vLLM's scheduler in this process (read only): preemptions with the output position each
    preempted request restarts from, and steps where a running request was not scheduled."""

    def __init__(self) -> None:
        self.preemptions: list[dict[str, Any]] = []
        self.left_out: Counter[str] = Counter()
        self.steps = 0
        self.error: str | None = None
        self.scheduler: Any = None  # the engine's scheduler, seen at its first step (generate's aborts)

    def install(self) -> None:
        from vllm.v1.core.sched.scheduler import Scheduler

        orig_preempt, orig_schedule = Scheduler._preempt_request, Scheduler.schedule
        obs = self

        def _preempt_request(sched: Any, request: Any, *args: Any, **kw: Any) -> Any:
            try:
                obs.preemptions.append({
                    "request_id": request.request_id, "step": obs.steps,
                    "num_output_tokens": len(request.output_token_ids),
                    "num_computed_tokens": request.num_computed_tokens,
                    "num_output_placeholders": getattr(request, "num_output_placeholders", None),
                    "num_prompt_tokens": request.num_prompt_tokens,
                })  # fmt: skip
            except Exception as e:  # noqa: BLE001 - an observer only
                obs.error = f"{type(e).__name__}: {e}"
            return orig_preempt(sched, request, *args, **kw)

        def schedule(sched: Any, *args: Any, **kw: Any) -> Any:
            out = orig_schedule(sched, *args, **kw)
            obs.scheduler = sched
            try:
                obs.steps += 1
                scheduled = set(out.num_scheduled_tokens)
                for r in sched.running:
                    if r.request_id not in scheduled:
                        obs.left_out[r.request_id] += 1
            except Exception as e:  # noqa: BLE001
                obs.error = f"{type(e).__name__}: {e}"
            return out

        Scheduler._preempt_request = _preempt_request
        Scheduler.schedule = schedule


def worker_metrics(worker: Any) -> dict[str, Any] | None:
    """Inside the worker (collective_rpc): the tfm runtime's tree metrics (None for other methods)."""
    try:
        from vllm_tfm.vllm_plugin import runtime

        snap = runtime.snapshot_metrics()
        if snap is not None:
            snap.pop("accepted_hist", None)
        return snap
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}


def metric_values(llm: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    try:
        for m in llm.get_metrics():
            if m.name in ("vllm:num_preemptions", "vllm:prompt_tokens", "vllm:generation_tokens") or m.name.startswith(
                "vllm:spec_decode_num_"
            ):
                out[m.name] = list(m.values) if isinstance(getattr(m, "values", None), list) else getattr(m, "value", None)
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def generate(llm: Any, prompts: list[list[int]], params: list[Any], abort_after: dict[int, int], obs: SchedulerLog,
             arrive_step: list[int] | None = None) -> dict[str, Any]:
    """``LLM.generate`` opened up: the requests go in through ``LLM.enqueue`` (at once, as
    ``generate`` does, or request i before engine step ``arrive_step[i]``) and the engine is stepped
    here, so that request i can be aborted once the scheduler (``obs.scheduler``, this process)
    counts ``abort_after[i]`` output tokens for it: a client gone mid-stream. Returns tokens, request
    ids and top-k lists in prompt order, and the aborted indices (their tokens are whatever the
    engine returned, often none)."""
    arrive = arrive_step or [0] * len(prompts)
    internal: list[str] = [""] * len(prompts)
    engine = llm.llm_engine
    final: dict[int, Any] = {}
    aborted: list[int] = []
    index: dict[str, int] = {}
    pending = sorted(range(len(prompts)), key=lambda i: (arrive[i], i))
    step = 0
    while pending or engine.has_unfinished_requests():
        due = [i for i in pending if arrive[i] <= step]
        if due:
            ids = list(llm.enqueue([{"prompt_token_ids": prompts[i]} for i in due], [params[i] for i in due], use_tqdm=False))
            for i, rid in zip(due, ids, strict=True):
                internal[i] = rid
                index[rid] = index[rid.rpartition("-")[0] or rid] = i
            pending = [i for i in pending if i not in due]
        step += 1
        if not engine.has_unfinished_requests():
            continue  # idle until the next arrival
        for o in engine.step():
            i = index.get(o.request_id)  # RequestOutput carries the external id (output_processor.py:371)
            if i is not None and o.finished:
                final[i] = o
        sched = obs.scheduler
        for i, n in abort_after.items():
            req = None if sched is None or i in aborted or not internal[i] else sched.requests.get(internal[i])
            if req is not None and len(req.output_token_ids) >= n:
                engine.abort_request([internal[i]], internal=True)
                aborted.append(i)
    tokens = [list(final[i].outputs[0].token_ids) if i in final else [] for i in range(len(prompts))]
    topk = None
    if any(i in final and final[i].outputs[0].logprobs for i in range(len(prompts))):
        topk = [[sorted(([int(tok), float(lp.logprob)] for tok, lp in step.items()), key=lambda x: -x[1])
                 for step in (final[i].outputs[0].logprobs or [])] if i in final else [] for i in range(len(prompts))]  # fmt: skip
    external = [rid.rpartition("-")[0] or rid for rid in internal]
    return {"tokens": tokens, "request_ids": external, "internal_ids": internal, "aborted": sorted(aborted), "topk": topk}


def run_arm(name: str, args: argparse.Namespace) -> None:
    spec = ARMS[name]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core here: scheduler log, get_metrics, collective_rpc
    os.environ.update(spec.get("env", {}))
    trace_dir = WORK / f"trace_{name}"
    if spec.get("trace"):
        os.environ["VLLM_TFM_TRACE"] = str(trace_dir)
    res: dict[str, Any] = {"arm": name, "method": spec["method"], "env": spec.get("env", {}),
                           "trace_dir": str(trace_dir) if spec.get("trace") else None}  # fmt: skip
    path = WORK / f"{name}.json"
    try:
        w = json.loads((WORK / "prompts.json").read_text())
        prompts, max_tokens = w["prompts"], w["max_tokens"]
        kinds = sampling_kinds(len(prompts), bool(spec.get("mixed")))
        res["kinds"] = [kind_label(k) for k in kinds]
        res["greedy"] = [i for i, k in enumerate(kinds) if not k["temperature"]]
        longest = max(len(p) + m for p, m in zip(prompts, max_tokens, strict=True))
        res["kv"] = kv_bytes(name, args.target, args.drafter, min(longest, MAX_MODEL_LEN))
        import gpu_ray_e2e

        # tfm synchronous, as in this tool's results so far, whatever tfm's default
        sched = False if spec["method"] == "tfm" else None
        kw = dict(gpu_ray_e2e.engine_settings(sched), model=args.target, dtype="float32", skip_tokenizer_init=True,
                  disable_log_stats=False, max_num_seqs=64, max_model_len=MAX_MODEL_LEN,
                  kv_cache_memory_bytes=res["kv"]["kv_cache_bytes"])  # fmt: skip
        if spec["method"] == "tfm":
            kw["speculative_config"] = {"method": "tfm", "model": args.drafter, "num_speculative_tokens": BUDGET,
                                        "attention_backend": "TRITON_ATTN"}  # fmt: skip
        elif spec["method"] == "dflash":
            kw["speculative_config"] = {"method": "dflash", "model": args.drafter, "num_speculative_tokens": DFLASH_K,
                                        "attention_backend": "TRITON_ATTN"}  # fmt: skip
        res["engine_kwargs"] = kw
        obs = SchedulerLog()
        obs.install()
        from vllm import LLM, SamplingParams

        t = time.time()
        llm = LLM(**kw)
        res["engine_start_s"] = round(time.time() - t, 1)
        cc = llm.llm_engine.vllm_config.cache_config
        res["kv"].update({"num_gpu_blocks": cc.num_gpu_blocks, "block_size": cc.block_size})
        log(f"{name}: engine up in {res['engine_start_s']} s, KV {res['kv']}")
        params = [SamplingParams(temperature=k["temperature"], seed=k.get("seed"), max_tokens=m, ignore_eos=True,
                                 detokenize=False, logprobs=TOPK if name == "nospec_big" else None)
                  for k, m in zip(kinds, max_tokens, strict=True)]  # fmt: skip
        abort_after = {i: max(1, int(k["abort_after"] * m)) for i, (k, m) in enumerate(zip(kinds, max_tokens, strict=True))
                       if "abort_after" in k}  # fmt: skip
        t = time.time()
        out = generate(llm, prompts, params, abort_after, obs, w.get("arrive_step"))
        res["generate_s"] = round(time.time() - t, 2)
        res.update({k: out[k] for k in ("request_ids", "internal_ids", "tokens", "aborted")})
        if name == "nospec_big":
            res["topk"] = out["topk"]
        res["preempt_log"] = obs.preemptions
        res["left_out_steps"] = dict(obs.left_out)
        res["scheduler_steps"] = obs.steps
        res["observer_error"] = obs.error
        res["metrics"] = metric_values(llm)
        res["preemptions"] = res["metrics"].get("vllm:num_preemptions")
        path.write_text(json.dumps(res, default=str))  # the tokens are safe before the workers are asked
        if spec["method"] == "tfm":
            res["tree_metrics"] = llm.collective_rpc(worker_metrics)
            if spec.get("trace"):
                from vllm_tfm.vllm_plugin.runtime import flush_trace

                res["trace_files"] = llm.collective_rpc(flush_trace)
        log(f"{name}: {len(out['tokens'])} outputs in {res['generate_s']} s, {res['preemptions']} preemptions, "
            f"{len(obs.preemptions)} logged, aborted {out['aborted']}")  # fmt: skip
    except Exception as e:  # noqa: BLE001 - recorded; the driver goes on with the next arm
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        print(res["traceback"], flush=True)
    path.write_text(json.dumps(res, default=str))


# ---------------------------------------------------------------------------------------- driver
def load(name: str) -> dict[str, Any] | None:
    p = WORK / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def trace_divergences(a: dict[str, Any], cmp: dict[str, Any], limit: int = 8) -> dict[str, Any] | None:
    """The request trace of a traced arm (bench/trace_reading.py): its mixed chain steps, and at
    each divergence the trace read there (in place)."""
    if not a.get("trace_dir"):
        return None
    files = sorted(Path(a["trace_dir"]).glob("trace-*.jsonl"))
    if not files:
        return {"error": "no trace file"}
    index_of = tr.index_from_map(pr.prompt_index_of(a["request_ids"]))
    out: dict[str, Any] = {"files": [p.name for p in files],
                           "mixed_steps": tr.mixed_step_summary(({**r, "f": f} for f, r in tr.iter_records(files)), index_of)}
    if not cmp["divergent"]:
        return out
    kinds = dict(enumerate(a.get("kinds") or []))
    ex = tr.extract(files, index_of, [d["index"] for d in cmp["divergent"][:limit]])
    for d in cmp["divergent"][:limit]:
        d["trace"] = tr.explain(ex, d["index"], d["pos"], index_of, kinds, max_records=60, mate_steps=4)
    return {**out, "records": ex.records, "truncated": ex.truncated}


def arm_summary(name: str, run: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, Any]:
    """What the result file keeps of one arm (no tokens), with its comparison against nospec_big."""
    if "skipped" in run:
        return {"skipped": run["skipped"]}
    a = load(name)
    s: dict[str, Any] = {"rc": run.get("rc"), "wall_s": run.get("wall_s"), "timeout_s": run.get("timeout_s")}
    if a is None:
        s["error"] = "no result: the arm was killed or crashed before writing (see its log in arms.tar.gz)"
        return s
    for k in ("error", "engine_start_s", "generate_s", "preemptions", "kv", "metrics", "observer_error", "scheduler_steps",
              "aborted"):
        if k in a:
            s[k] = a[k]
    tms = a.get("tree_metrics") or []
    tm = tms[0] if tms and isinstance(tms[0], dict) else None
    if tm is not None:
        s["tree_metrics"] = {k: tm.get(k) for k in ("steps", "tree_steps", "accepted_restored", "states_moved",
                                                    "resumed_requests", "mean_accepted_length", "hooks")}  # fmt: skip
    if "tokens" not in a:
        return s
    index = pr.prompt_index_of(a["request_ids"])
    pre = pr.per_prompt_preemptions(a.get("preempt_log") or [], index)
    resumed = pr.per_prompt_counts((tm or {}).get("resumed_requests") or {}, index)
    left = pr.per_prompt_counts(a.get("left_out_steps") or {}, index)
    s["preempted_prompts"] = {str(k): v for k, v in sorted(pre.items())}
    s["left_out_prompts"] = {str(k): v for k, v in sorted(left.items())}
    if name != "nospec_big" and ref is not None and "tokens" in ref:
        only = a.get("greedy") if len(a.get("greedy") or []) < len(a["tokens"]) else None
        cmp = pr.compare_arm(ref["tokens"], a["tokens"], ref_topk=ref.get("topk"), preemptions=pre,
                             resumed=resumed if tm is not None else None, only=only)  # fmt: skip
        for d in cmp["divergent"]:
            d["left_out_steps"] = left.get(d["index"], 0)
        trace = trace_divergences(a, cmp)
        if trace is not None:
            s["trace"] = trace
        s["comparison"] = cmp
    return s


def gpu_name() -> str | None:
    """The first GPU's name as nvidia-smi gives it (None without one): the results say which card ran them."""
    from soak_server import _nvidia_smi

    text = _nvidia_smi(["--query-gpu=name", "--format=csv,noheader"])
    lines = [line.strip() for line in (text or "").splitlines() if line.strip()]
    return lines[0] if lines else None


def summary(out: Path, runs: dict[str, dict[str, Any]], workload: dict[str, Any], command: str) -> dict[str, Any]:
    ref = load("nospec_big")
    arms = {name: arm_summary(name, run, ref) for name, run in runs.items()}
    res = {
        "command": command, "device": gpu_name(), "settings": {
            "prompts": N_PROMPTS, "max_tokens": MAX_TOKENS, "max_prompt": MAX_PROMPT, "capacity_requests": CAPACITY,
            "budget": BUDGET, "dflash_k": DFLASH_K, "max_model_len": MAX_MODEL_LEN, "dtype": "float32",
            "deadline_s": DEADLINE_S, "workload": workload.get("workload", "preempt"), "prompt_source": workload.get("kind"), "prompt_lengths": workload.get("lengths"),
            "request_max_tokens": workload.get("max_tokens"),
            "mixed_kinds": [kind_label(k) for k in sampling_kinds(len(workload.get("lengths") or []), True)]},
        "arms": arms, "reading": pr.reading(arms), "elapsed_s": round(time.time() - T0, 1),
    }  # fmt: skip
    (out / "preempt_repro.json").write_text(json.dumps(res, indent=1, default=str))
    return res


def tfm_diverged(runs: dict[str, dict[str, Any]]) -> bool | None:
    """Whether tfm_small or tfm_mixed diverged from the reference (None: neither compared)."""
    ref = load("nospec_big")
    states = []
    for name in TFM_SMALL_ARMS:
        if name in runs:
            cmp = arm_summary(name, runs[name], ref).get("comparison")
            if cmp is not None:
                states.append(bool(cmp["divergent"]))
    return any(states) if states else None


def arm_timeout(name: str, first: bool) -> float:
    """Engine start (cold for the run's first engine) plus the arm's generation cap."""
    return (COLD_START_S if first else WARM_START_S) + ARMS[name]["gen_s"]


def run_one(args: argparse.Namespace, name: str, first: bool) -> dict[str, Any]:
    out = Path(args.out)
    left = DEADLINE_S - (time.time() - T0)
    if left < MIN_START_S:
        log(f"arm {name} skipped: {left:.0f} s left")
        return {"skipped": f"{left:.0f} s left of TFM_PREEMPT_DEADLINE_S={DEADLINE_S:.0f}"}
    timeout = min(arm_timeout(name, first), left)
    logf = WORK / f"{name}.log"
    log(f"arm {name} (timeout {timeout:.0f} s) -> {logf.name}")
    cmd = [sys.executable, __file__, "--arm", name, "--out", str(out), "--target", args.target, "--drafter", args.drafter]
    t = time.time()
    rc, _ = run_phase_process(cmd, logf, timeout, dict(os.environ, TFM_PREEMPT_T0=str(T0)), f"arm {name}", cwd=REPO)
    rc = -9 if rc is None else rc
    echo_log(logf, ("[tfm-preempt", "Error", "stopped:"), 20, tail_lines=25 if rc != 0 else 0)
    log(f"arm {name} exit code {rc}")
    return {"rc": rc, "wall_s": round(time.time() - t, 1), "timeout_s": round(timeout)}


def pack(out: Path) -> None:
    """Every arm's JSON (all tokens), log and request trace into OUT/arms.tar.gz (at most 8 files come
    back from OUT)."""
    with tarfile.open(out / "arms.tar.gz", "w:gz") as tar:
        for p in sorted(WORK.glob("*.json")) + sorted(WORK.glob("*.log")) + sorted(WORK.glob("trace_*/*.jsonl")):
            tar.add(p, arcname=str(p.relative_to(WORK)))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/tfm-preempt-out"))
    ap.add_argument("--arm", default="all", choices=["all", "summary", *ARMS])
    ap.add_argument("--arms", default=os.environ.get("TFM_PREEMPT_ARMS", ",".join(ARMS)),
                    help="comma-separated arms for --arm all, run in the canonical order (nospec_big always first)")
    ap.add_argument("--target", default=str(REPO / "zoo" / "target"))
    ap.add_argument("--drafter", default=str(REPO / "zoo" / "drafter"))
    args = ap.parse_args(argv)
    wanted = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in wanted if a not in ARMS]
    if unknown:
        ap.error(f"unknown arms {unknown}; known: {list(ARMS)}")
    args.arm_list = ["nospec_big"] + [a for a in ARMS if a in wanted and a != "nospec_big"]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    if args.arm not in ("all", "summary"):
        run_arm(args.arm, args)
        return 0
    command = os.environ.get("TFM_PREEMPT_COMMAND", "bash bench/run_gpu_preempt_repro.sh")
    runs: dict[str, dict[str, Any]] = {}
    if args.arm == "summary":
        workload = json.loads((WORK / "prompts.json").read_text())
        runs = {name: {} for name in args.arm_list if (WORK / f"{name}.json").is_file()}
    else:
        for stale in list(WORK.glob("*.json")) + list(WORK.glob("*.log")) + list(WORK.glob("trace_*/*.jsonl")):
            stale.unlink()
        workload = make_prompts(args.target, workload=WORKLOAD)
        (WORK / "prompts.json").write_text(json.dumps(workload))
        log(f"workload: {len(workload['prompts'])} prompts ({workload['kind']}), lengths {workload['lengths']}, "
            f"max_tokens {workload['max_tokens']}")  # fmt: skip
        for k, name in enumerate(args.arm_list):
            if ARMS[name].get("only_if_tfm_diverged") and not tfm_diverged(runs):
                runs[name] = {"skipped": "tfm_small and tfm_mixed did not diverge (or were not compared)"}
                log(f"arm {name} skipped: {runs[name]['skipped']}")
                continue
            runs[name] = run_one(args, name, first=k == 0)
            summary(out, runs, workload, command)  # after every arm: a later kill keeps what was learnt
            pack(out)
    res = summary(out, runs, workload, command)
    pack(out)
    print("=" * 100)
    for name, s in res["arms"].items():
        c = s.get("comparison")
        what = (s.get("skipped") and f"skipped ({s['skipped']})") or s.get("error") or (
            f"{c['identical']}/{c['compared']} identical, divergent {[(d['index'], d['pos'], d['preempted_at']) for d in c['divergent']]}"
            if c else "reference")  # fmt: skip
        split = ((s.get("tree_metrics") or {}).get("hooks") or {}).get("gdn.mixed_split")
        ms = (s.get("trace") or {}).get("mixed_steps")
        print(f"{name:24s} preemptions={s.get('preemptions')} gen={s.get('generate_s')}s  {what}"
              + (f"  gdn.mixed_split={split}" if split else "")
              + (f"  misordered_mixed_steps={ms['misordered_mixed_steps']}/{ms['mixed_non_tree_steps']}" if ms else ""))
        for d in (c or {}).get("divergent", [])[:6]:
            line = ((d.get("trace") or {}).get("reading") or {}).get("line")
            if line:
                print(f"    prompt {d['index']}: {line}")
    print(*res["reading"]["lines"], sep="\n")
    print(json.dumps(res["reading"]["support"], indent=1))
    print("=" * 100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
