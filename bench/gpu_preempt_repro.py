#!/usr/bin/env python3
"""Why greedy tfm diverges from no-spec under preemption (bench/results/preempt_zoo.json): one GPU command.

Offline ``LLM.generate`` (engine core in this process: VLLM_ENABLE_V1_MULTIPROCESSING=0), toy zoo,
float32, TRITON_ATTN, eager, prefix caching off. Workload: ``TFM_PREEMPT_PROMPTS`` (32) greedy
prompts (windows of the standard library's Python files in the zoo tokenizer, lengths 16..700) x
``TFM_PREEMPT_MAX_TOKENS`` (256) tokens, ignore_eos, all in one generate, max_num_seqs 64. "small"
arms get a KV cache for about ``TFM_PREEMPT_CAPACITY`` (8) of the longest requests of that arm
(bench/soak.py's estimate, per method: a no-spec request holds 1 GDN slot, a tfm one 1 + B), so
vLLM preempts; "big" arms get 4 GiB.

Arms, in this order, each in its own subprocess with a time cap, all within
``TFM_PREEMPT_DEADLINE_S`` (500 s) of the runner's start (install included); arms that would start
with less than ``MIN_START_S`` left are recorded as skipped:
  nospec_big             reference, with the top-5 log-probabilities of every output position;
  tfm_small              tfm, B=16, small KV;
  nospec_small           no speculation, small KV: does vLLM itself diverge under preemption?
  dflash_small           vLLM's in-tree chain "dflash" (15 drafts), small KV;
  tfm_big                tfm, 4 GiB KV: no preemption, same batch;
  tfm_small_torch        tfm small KV with VLLM_TFM_KERNELS=0 (torch reference ops);
  tfm_small_chain_forced tfm small KV, VLLM_TFM_PROPOSAL=chain, VLLM_TFM_FORCE_TREE_PATH=1.
Every arm records its tokens, vLLM's ``vllm:num_preemptions``, a scheduler-side log of each
preemption (request id, output tokens so far: the position the resumed request restarts from) and
of steps where a running request was left out (the persistent-batch removals of hypothesis d);
tfm arms also the workers' tree metrics (``resumed_requests``, ``accepted_restored``,
``states_moved``). The driver compares each arm with nospec_big (bench/preempt_reading.py) and
writes OUT/preempt_repro.json (per-arm summary, divergences, the reading) after every arm; every
arm's JSON (all tokens) and log go to OUT/arms.tar.gz.

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
from phase_process import echo_log, run_phase_process  # noqa: E402

WORK = Path(os.environ.get("TFM_PREEMPT_DIR", "/tmp/tfm-preempt"))  # per-arm JSON and logs (tarred into OUT)
DEADLINE_S = float(os.environ.get("TFM_PREEMPT_DEADLINE_S", "500"))  # from T0 (the runner's start)
N_PROMPTS = int(os.environ.get("TFM_PREEMPT_PROMPTS", "32"))
MAX_TOKENS = int(os.environ.get("TFM_PREEMPT_MAX_TOKENS", "256"))
MAX_PROMPT = int(os.environ.get("TFM_PREEMPT_MAX_PROMPT", "700"))
CAPACITY = float(os.environ.get("TFM_PREEMPT_CAPACITY", "8"))
BUDGET = 16
DFLASH_K = 15  # the drafter's block size 16 minus the bonus slot
BIG_KV = 4 << 30
MAX_MODEL_LEN = 1024
MIN_START_S = 45.0
TOPK = 5
ARMS: dict[str, dict[str, Any]] = {
    "nospec_big": {"method": None, "kv": "big", "cap_s": 90},
    "tfm_small": {"method": "tfm", "kv": "small", "cap_s": 300},
    "nospec_small": {"method": None, "kv": "small", "cap_s": 90},
    "dflash_small": {"method": "dflash", "kv": "small", "cap_s": 120},
    "tfm_big": {"method": "tfm", "kv": "big", "cap_s": 150},
    "tfm_small_torch": {"method": "tfm", "kv": "small", "cap_s": 200, "env": {"VLLM_TFM_KERNELS": "0"}},
    "tfm_small_chain_forced": {"method": "tfm", "kv": "small", "cap_s": 170,
                               "env": {"VLLM_TFM_PROPOSAL": "chain", "VLLM_TFM_FORCE_TREE_PATH": "1"}},
}  # fmt: skip


def log(*args: object) -> None:
    print(f"[tfm-preempt {time.time() - T0:7.1f}s]", *args, flush=True)


# ---------------------------------------------------------------------------------------- workload
def make_prompts(target: str, n: int = N_PROMPTS, max_prompt: int = MAX_PROMPT, seed: int = 7) -> dict[str, Any]:
    """Mixed-length prompts: a quarter short (16..64), half medium (65..400), a quarter long (401..max_prompt)."""
    rng = random.Random(seed)
    try:
        import soak

        stream = soak.stdlib_token_stream(target)
        kind = "standard-library Python files, zoo tokenizer"
    except Exception as e:  # noqa: BLE001 - fall back to random ids in the zoo's vocabulary
        vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
        stream = [rng.randrange(3, vocab - 2) for _ in range(50_000)]
        kind = f"random token ids 3..{vocab - 3} (tokenizer failed: {type(e).__name__}: {e})"
    lens = []
    for i in range(n):
        band = i % 4
        lens.append(rng.randint(16, 64) if band == 0 else rng.randint(401, max_prompt) if band == 3 else rng.randint(65, 400))
    rng.shuffle(lens)
    prompts = []
    for n_tok in lens:
        start = rng.randrange(len(stream))
        prompts.append([stream[(start + j) % len(stream)] for j in range(n_tok)])
    return {"kind": kind, "prompts": prompts, "lengths": lens}


def kv_bytes(arm: str, target: str, drafter: str, longest: int) -> dict[str, Any]:
    """The arm's KV-cache bytes: 4 GiB, or CAPACITY x one ``longest``-token request of that arm."""
    spec = ARMS[arm]
    if spec["kv"] == "big":
        return {"kv_cache_bytes": BIG_KV}
    import soak

    budget = {"tfm": BUDGET, "dflash": DFLASH_K}.get(spec["method"] or "", 0)
    est = soak.estimate_request_kv_bytes(target, drafter, budget, longest)
    if spec["method"] is None:  # no drafter layers without speculation
        d = json.loads((Path(drafter) / "config.json").read_text())
        d_head = int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"])
        est -= (longest + budget + 1) * 2 * int(d["num_key_value_heads"]) * d_head * 4 * int(d["num_hidden_layers"])
    return {"kv_cache_bytes": math.ceil(CAPACITY * est), "bytes_per_request": est, "capacity_requests": CAPACITY,
            "request_tokens": longest}  # fmt: skip


# ---------------------------------------------------------------------------------------- one arm
class SchedulerLog:
    """Observes vLLM's scheduler in this process (read only): preemptions with the output position each
    preempted request restarts from, and steps where a running request was not scheduled."""

    def __init__(self) -> None:
        self.preemptions: list[dict[str, Any]] = []
        self.left_out: Counter[str] = Counter()
        self.steps = 0
        self.error: str | None = None

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


def run_arm(name: str, args: argparse.Namespace) -> None:
    spec = ARMS[name]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core here: scheduler log, get_metrics, collective_rpc
    os.environ.update(spec.get("env", {}))
    res: dict[str, Any] = {"arm": name, "method": spec["method"], "env": spec.get("env", {})}
    path = WORK / f"{name}.json"
    try:
        w = json.loads((WORK / "prompts.json").read_text())
        prompts = w["prompts"]
        longest = max(len(p) for p in prompts) + MAX_TOKENS
        res["kv"] = kv_bytes(name, args.target, args.drafter, longest)
        import gpu_ray_e2e

        kw = dict(gpu_ray_e2e.engine_settings(), model=args.target, dtype="float32", skip_tokenizer_init=True,
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
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False,
                                logprobs=TOPK if name == "nospec_big" else None)  # fmt: skip
        t = time.time()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        res["generate_s"] = round(time.time() - t, 2)
        res["request_ids"] = [o.request_id for o in outs]
        res["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        if name == "nospec_big":
            try:  # the reference's top-5 log-probabilities: the margin at every divergence
                res["topk"] = [[sorted(([int(tok), float(lp.logprob)] for tok, lp in step.items()), key=lambda x: -x[1])
                                for step in (o.outputs[0].logprobs or [])] for o in outs]  # fmt: skip
            except Exception as e:  # noqa: BLE001
                res["topk_error"] = f"{type(e).__name__}: {e}"
        res["preempt_log"] = obs.preemptions
        res["left_out_steps"] = dict(obs.left_out)
        res["scheduler_steps"] = obs.steps
        res["observer_error"] = obs.error
        res["metrics"] = metric_values(llm)
        res["preemptions"] = res["metrics"].get("vllm:num_preemptions")
        path.write_text(json.dumps(res, default=str))  # the tokens are safe before the workers are asked
        if spec["method"] == "tfm":
            res["tree_metrics"] = llm.collective_rpc(worker_metrics)
        log(f"{name}: {len(outs)} outputs in {res['generate_s']} s, {res['preemptions']} preemptions, "
            f"{len(obs.preemptions)} logged")  # fmt: skip
    except Exception as e:  # noqa: BLE001 - recorded; the driver goes on with the next arm
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        print(res["traceback"], flush=True)
    path.write_text(json.dumps(res, default=str))


# ---------------------------------------------------------------------------------------- driver
def load(name: str) -> dict[str, Any] | None:
    p = WORK / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else None


def arm_summary(name: str, run: dict[str, Any], ref: dict[str, Any] | None) -> dict[str, Any]:
    """What the result file keeps of one arm (no tokens), with its comparison against nospec_big."""
    if "skipped" in run:
        return {"skipped": run["skipped"]}
    a = load(name)
    s: dict[str, Any] = {"rc": run.get("rc"), "wall_s": run.get("wall_s"), "timeout_s": run.get("timeout_s")}
    if a is None:
        s["error"] = "no result: the arm was killed or crashed before writing (see its log in arms.tar.gz)"
        return s
    for k in ("error", "engine_start_s", "generate_s", "preemptions", "kv", "metrics", "observer_error", "scheduler_steps"):
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
        cmp = pr.compare_arm(ref["tokens"], a["tokens"], ref_topk=ref.get("topk"), preemptions=pre,
                             resumed=resumed if tm is not None else None)  # fmt: skip
        for d in cmp["divergent"]:
            d["left_out_steps"] = left.get(d["index"], 0)
        s["comparison"] = cmp
    return s


def summary(out: Path, runs: dict[str, dict[str, Any]], workload: dict[str, Any], command: str) -> dict[str, Any]:
    ref = load("nospec_big")
    arms = {name: arm_summary(name, run, ref) for name, run in runs.items()}
    res = {
        "command": command, "device": "nvidia-h200", "settings": {
            "prompts": N_PROMPTS, "max_tokens": MAX_TOKENS, "max_prompt": MAX_PROMPT, "capacity_requests": CAPACITY,
            "budget": BUDGET, "dflash_k": DFLASH_K, "max_model_len": MAX_MODEL_LEN, "dtype": "float32",
            "deadline_s": DEADLINE_S, "workload": workload.get("kind"), "prompt_lengths": workload.get("lengths")},
        "arms": arms, "reading": pr.reading(arms), "elapsed_s": round(time.time() - T0, 1),
    }  # fmt: skip
    (out / "preempt_repro.json").write_text(json.dumps(res, indent=1, default=str))
    return res


def run_one(args: argparse.Namespace, name: str) -> dict[str, Any]:
    out = Path(args.out)
    left = DEADLINE_S - (time.time() - T0)
    if left < MIN_START_S:
        log(f"arm {name} skipped: {left:.0f} s left")
        return {"skipped": f"{left:.0f} s left of TFM_PREEMPT_DEADLINE_S={DEADLINE_S:.0f}"}
    timeout = min(ARMS[name]["cap_s"], left)
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
    """Every arm's JSON (all tokens) and log into OUT/arms.tar.gz (at most 8 files come back from OUT)."""
    with tarfile.open(out / "arms.tar.gz", "w:gz") as tar:
        for p in sorted(WORK.glob("*.json")) + sorted(WORK.glob("*.log")):
            tar.add(p, arcname=p.name)


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
        for stale in list(WORK.glob("*.json")) + list(WORK.glob("*.log")):
            stale.unlink()
        workload = make_prompts(args.target)
        (WORK / "prompts.json").write_text(json.dumps(workload))
        log(f"workload: {len(workload['prompts'])} prompts ({workload['kind']}), lengths {sorted(workload['lengths'])}")
        for name in args.arm_list:
            runs[name] = run_one(args, name)
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
        print(f"{name:24s} preemptions={s.get('preemptions')} gen={s.get('generate_s')}s  {what}")
    print(*res["reading"]["lines"], sep="\n")
    print(json.dumps(res["reading"]["support"], indent=1))
    print("=" * 100)
    return 0


if __name__ == "__main__":
    sys.exit(main())
