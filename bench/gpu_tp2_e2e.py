#!/usr/bin/env python3
"""GPU check of tfm at tensor_parallel_size=2 on vLLM's Ray executor (two GPUs), on the toy zoo.

Phases, in this order, each in its own subprocess with a timeout, all within TFM_TP2_DEADLINE_S
(default 505 s) of the runner's start (bench/run_gpu_tp2.sh; its install counts):
  tp1_tfm     vLLM's default executor, TP=1, method tfm with the drafter's tfm_config.json
              proposal ("tfm", the Weaver): greedy tokens of all prompts in one generate;
  tp2_tfm     distributed_executor_backend="ray", tensor_parallel_size=2, tfm, with
              VLLM_TFM_CHECK_TP_TREES=1 in the driver (RayExecutorV2 copies the driver's
              environment to its actors): every decode step all-gathers each rank's tree (draft
              tokens + parents) and accepted paths across the TP group and raises in the worker on
              a mismatch; the workers count the checked steps (tp_tree_checks);
  tp2_nospec  Ray, TP=2, no speculative config;
  tp2_ddtree  (only when at least TFM_TP2_OPTIONAL_MIN_S is left) as tp2_tfm with
              VLLM_TFM_PROPOSAL=ddtree (a tree option, read in the driver).
Every engine phase asks its workers what they saw (bench/gpu_ray_e2e.py's worker_info through
collective_rpc: pid, Ray actor id, rank, device, plugin state, tree options, VLLM_TFM_* variables,
the runtime's counters). Prompts: seeded random token ids in [3, vocab - 2) of mixed lengths
1..200. Verdicts (bench/tp_verdicts.py) in OUT/tp2_ray_zoo.json, rewritten after every phase;
exit code 0 when verdicts.all_ok. TFM_TP2_PHASES=a,b runs only those phases and judges them with
the other phases' files left by an earlier run on the same machine (in TFM_TP2_DIR).
--async-scheduling: the tfm phases' engines with ``async_scheduling=True`` (vLLM's asynchronous
scheduling; no-speculation engines have it by vLLM's default); verdict ``tfm_scheduling_as_asked``
(every tfm phase's workers ran with the scheduling asked for; without the flag ``async_scheduling=False``,
synchronous) joins ``all_ok``.

usage (GPU host with 2 GPUs, repository root):  bash bench/run_gpu_tp2.sh [--async-scheduling]
        or:  python3 bench/gpu_tp2_e2e.py --out OUT [--phase all|tp1_tfm|tp2_tfm|tp2_nospec|tp2_ddtree|summary]
                                          [--target DIR --drafter DIR] [--async-scheduling]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tarfile
import time
import traceback
from importlib import metadata
from pathlib import Path
from typing import Any

T0 = float(os.environ.get("TFM_TP2_T0", time.time()))
BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _p in (BENCH, REPO):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))
import gpu_ray_e2e as ray_e2e  # engine settings, worker_info, spec_counters, dump_ray_logs
from phase_process import echo_log, run_phase_process  # noqa: E402
from tp_verdicts import tokens_digest, tp_verdicts

WORK = Path(os.environ.get("TFM_TP2_DIR", "/tmp/tfm-tp2")) / "phases"  # per-phase JSON with all tokens
RESULT = "tp2_ray_zoo.json"
BUDGET = int(os.environ.get("TFM_TP2_BUDGET", "32"))
MAX_TOKENS = int(os.environ.get("TFM_TP2_MAX_TOKENS", "128"))
N_PROMPTS = int(os.environ.get("TFM_TP2_PROMPTS", "32"))
MAX_SEQS = int(os.environ.get("TFM_TP2_MAX_SEQS", "16"))
KV_BYTES = int(float(os.environ.get("TFM_TP2_KV_BYTES", str(4 * 1024**3))))  # fixed: no memory profiling
DTYPE = os.environ.get("TFM_TP2_DTYPE", "float32")
DEADLINE_S = float(os.environ.get("TFM_TP2_DEADLINE_S", "505"))  # from T0 (the runner's start), install included
OPTIONAL_MIN_S = float(os.environ.get("TFM_TP2_OPTIONAL_MIN_S", "150"))  # tp2_ddtree starts only with this much left
MIN_START_S = 60.0  # a phase with less time left is skipped
EXIT_GRACE_S = 20.0  # a phase that wrote its JSON is stopped this long after, if it has not exited
CHECK_ENV = {"VLLM_TFM_CHECK_TP_TREES": "1"}
# NVLink multicast must stay off on the shared host (NCCL, PyTorch symmetric memory, NVSHMEM); vLLM's
# symmetric-memory all-reduce is turned off as well (it only serves bf16, this run is float32).
NO_MULTICAST_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                    "VLLM_ALLREDUCE_USE_SYMM_MEM": "0"}  # fmt: skip

# name: (tensor_parallel_size, proposal (None: no speculation), driver environment, time cap in s, optional)
PHASES: dict[str, tuple[int, str | None, dict[str, str], float, bool]] = {
    "tp1_tfm": (1, "tfm", {}, 170, False),
    "tp2_tfm": (2, "tfm", CHECK_ENV, 210, False),
    "tp2_nospec": (2, None, {}, 170, False),
    "tp2_ddtree": (2, "ddtree", {**CHECK_ENV, "VLLM_TFM_PROPOSAL": "ddtree"}, 170, True),
}


def log(*args: object) -> None:
    print(f"[tfm-tp2 {time.time() - T0:7.1f}s]", *args, flush=True)


def prompts(target: str) -> list[list[int]]:
    """N_PROMPTS seeded random prompts of token ids in [3, vocab - 2), lengths 1..200 (both ends included)."""
    vocab = json.loads((Path(target) / "config.json").read_text())["vocab_size"]
    rng = random.Random(20261129)
    lens = [1, 200] + [rng.randint(1, 200) for _ in range(max(0, N_PROMPTS - 2))]
    return [[rng.randrange(3, vocab - 2) for _ in range(n)] for n in lens[:N_PROMPTS]]


def engine_kwargs(target: str, drafter: str, tp: int, proposal: str | None, async_scheduling: bool = False) -> dict[str, Any]:
    """One phase's engine arguments; ``async_scheduling`` applies to tfm engines (``proposal`` not None)."""
    kw = dict(ray_e2e.engine_settings(async_scheduling if proposal is not None else None), model=target, dtype=DTYPE, skip_tokenizer_init=True, disable_log_stats=False,
              max_num_seqs=MAX_SEQS, kv_cache_memory_bytes=KV_BYTES)  # fmt: skip
    if proposal is not None:  # the proposal itself comes from tfm_config.json or VLLM_TFM_PROPOSAL
        kw["speculative_config"] = {"method": "tfm", "model": drafter, "num_speculative_tokens": BUDGET,
                                    "attention_backend": "TRITON_ATTN"}  # fmt: skip
    if tp > 1:
        kw.update(distributed_executor_backend="ray", tensor_parallel_size=tp)
        if os.environ.get("TFM_TP2_DISABLE_CUSTOM_AR") == "1":  # fallback: NCCL all-reduce only
            kw["disable_custom_all_reduce"] = True
    return kw


# ---------------------------------------------------------------------------------------- one engine
def _write(path: Path, res: dict[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, default=str))
    tmp.replace(path)  # the driver treats the file's appearance as "the phase is done"


def phase_engine(args: argparse.Namespace, name: str) -> int:
    """One engine (TP and proposal of PHASES[name]): tokens, spec counters, workers -> WORK/<name>.json."""
    tp, proposal, env, _, _ = PHASES[name]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core in this process: get_metrics, collective_rpc
    for k, v in NO_MULTICAST_ENV.items():
        os.environ.setdefault(k, v)
    os.environ.update(env)
    res: dict[str, Any] = {"phase": name, "tp": tp, "proposal": proposal, "driver_env": env, "driver_pid": os.getpid()}
    ray = None
    try:
        kw = engine_kwargs(args.target, args.drafter, tp, proposal, args.async_scheduling)
        res["engine_kwargs"] = kw
        if tp > 1:
            import cloudpickle
            import ray

            cloudpickle.register_pickle_by_value(ray_e2e)  # worker_info travels by value to the Ray actors
            ray.init(num_gpus=tp, include_dashboard=False, object_store_memory=2 * 1024**3, log_to_driver=True)
            res["ray_version"] = ray.__version__
        from vllm import LLM, SamplingParams

        t = time.time()
        llm = LLM(**kw)
        res["engine_start_s"] = round(time.time() - t, 1)
        pc = llm.llm_engine.vllm_config.parallel_config
        res["distributed_executor_backend"] = str(pc.distributed_executor_backend)
        executor = getattr(getattr(llm.llm_engine.engine_core, "engine_core", None), "model_executor", None)
        res["executor_class"] = None if executor is None else type(executor).__name__
        log(f"{name}: engine up in {res['engine_start_s']} s, backend {res['distributed_executor_backend']}, "
            f"tp {pc.tensor_parallel_size}, executor {res['executor_class']}")  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False)
        ps = prompts(args.target)
        t = time.time()
        outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
        res["generate_s"] = round(time.time() - t, 2)
        res["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
        res["spec_counters"] = ray_e2e.spec_counters(llm)
        res["workers"] = llm.collective_rpc(ray_e2e.worker_info)
        log(f"{name}: {len(ps)} prompts generated in {res['generate_s']} s; spec counters {res['spec_counters']}")
        for w in res["workers"]:
            tm = w.get("tree_metrics") or {}
            log(f"{name}: worker rank {w.get('rank')} pid {w.get('pid')} actor {w.get('ray_actor_id')} "
                f"device {w.get('cuda_device')} proposal {(w.get('options') or {}).get('proposal')} "
                f"tree_steps {tm.get('tree_steps')} tp_tree_checks {tm.get('tp_tree_checks')} tp_accept_checks {tm.get('tp_accept_checks')} "
                f"error {w.get('error')}")  # fmt: skip
    except Exception as e:  # noqa: BLE001 - record and report
        res["error"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        print(res["traceback"], flush=True)
        if tp > 1:
            ray_e2e.dump_ray_logs()  # the actors' tracebacks, into this phase's log
    _write(WORK / f"{name}.json", res)
    log(f"{name}: wrote {name}.json")
    if ray is not None:
        try:
            ray.shutdown()
        except Exception as e:  # noqa: BLE001
            log("ray.shutdown:", e)
    sys.stdout.flush()
    os._exit(1 if "error" in res else 0)  # no engine teardown at exit: the driver stops the process group


# ---------------------------------------------------------------------------------------- driver
def run_phase(args: argparse.Namespace, name: str) -> dict[str, Any]:
    """Run one phase in a subprocess (own process group) under its time cap; -> what happened."""
    out = Path(args.out)
    left = DEADLINE_S - (time.time() - T0)
    cap, optional = PHASES[name][3], PHASES[name][4]
    need = OPTIONAL_MIN_S if optional else MIN_START_S
    if left < need:
        log(f"phase {name} skipped: {left:.0f} s left, it needs {need:.0f} s")
        return {"skipped": f"{left:.0f} s left of TFM_TP2_DEADLINE_S={DEADLINE_S:.0f}, needs {need:.0f} s"}
    timeout = min(cap, left - 5)
    logf = out / f"{name}.log"
    result = WORK / f"{name}.json"
    log(f"phase {name} (timeout {timeout:.0f} s) -> {logf.name}")
    cmd = [sys.executable, __file__, "--phase", name, "--out", str(out), "--target", args.target, "--drafter", args.drafter]
    cmd += ["--async-scheduling"] if args.async_scheduling else []
    t = time.time()
    rc, _ = run_phase_process(cmd, logf, timeout, dict(os.environ, TFM_TP2_T0=str(T0)), f"phase {name}",
                              done_file=result, exit_grace_s=EXIT_GRACE_S)  # fmt: skip
    wall = round(time.time() - t, 1)
    echo_log(logf, ("[tfm-tp2", "Traceback", "Error", "stopped:", "mismatch"), 40, tail_lines=0 if result.is_file() else 40)
    log(f"phase {name}: exit code {rc}, {wall} s")
    return {"rc": rc, "wall_s": wall, "timeout_s": round(timeout)}


def load(name: str) -> dict[str, Any]:
    p = WORK / f"{name}.json"
    return json.loads(p.read_text()) if p.is_file() else {"error": f"{p.name} missing: the phase did not finish"}


def env_info() -> dict[str, Any]:
    info: dict[str, Any] = {}
    for dist in ("torch", "vllm", "ray", "vllm-tfm", "transformers"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    for key, cmd in (("gpus", ["nvidia-smi", "--query-gpu=index,name,pci.bus_id,memory.total,driver_version",
                               "--format=csv,noheader"]), ("topology", ["nvidia-smi", "topo", "-m"])):  # fmt: skip
        try:
            info[key] = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=20).stdout.strip().splitlines()
        except (OSError, subprocess.SubprocessError) as e:
            info[key] = f"{type(e).__name__}: {e}"
    info["multicast_env"] = {k: os.environ.get(k) for k in NO_MULTICAST_ENV}
    return info


def compact_phase(ph: dict[str, Any]) -> dict[str, Any]:
    """A phase's JSON for the result file: tokens replaced by a digest (all tokens: phases.tar.gz)."""
    out = {k: v for k, v in ph.items() if k not in ("tokens", "engine_kwargs")}
    if "tokens" in ph:
        out["tokens_digest"] = tokens_digest(ph["tokens"])
        out["tokens_lengths"] = sorted({len(t) for t in ph["tokens"]})
    return out


def summary(args: argparse.Namespace, runs: dict[str, dict[str, Any]], env: dict[str, Any]) -> int:
    out = Path(args.out)
    phases = {name: (runs[name] if "skipped" in runs.get(name, {}) else load(name)) for name in PHASES if name in runs}
    judged = tp_verdicts(phases, tp=2, check_env=CHECK_ENV)
    tfm_phases = [ph for name, ph in phases.items() if PHASES[name][1] is not None and "skipped" not in ph]
    judged["verdicts"]["tfm_scheduling_as_asked"] = ray_e2e.scheduling_as_asked(tfm_phases, args.async_scheduling)
    judged["verdicts"]["all_ok"] = judged["verdicts"]["all_ok"] and judged["verdicts"]["tfm_scheduling_as_asked"]
    ps = prompts(args.target)
    ref = phases.get("tp1_tfm", {}).get("tokens")
    res = {
        "command": command(args),
        "settings": {
            "target": args.target_arg, "drafter": args.drafter_arg, "dtype": DTYPE, "budget": BUDGET, "max_tokens": MAX_TOKENS,
            "prompts": len(ps), "prompt_lengths": [len(p) for p in ps], "prompt_token_range": [3, "vocab - 2"],
            "max_num_seqs": MAX_SEQS, "kv_cache_memory_bytes": KV_BYTES, "engine_settings": ray_e2e.engine_settings(args.async_scheduling),
            "async_scheduling_tfm": args.async_scheduling, "check_env": CHECK_ENV, "phases": {k: {"tp": v[0], "proposal": v[1], "driver_env": v[2]} for k, v in PHASES.items()},
        },
        "env": env,
        "verdicts": judged["verdicts"],
        "comparisons": judged["comparisons"],
        "runs": runs,
        "phases": {name: compact_phase(ph) for name, ph in phases.items()},
        "tokens_tp1_tfm": None if ref is None else [" ".join(map(str, t)) for t in ref],
    }  # fmt: skip
    (out / RESULT).write_text(json.dumps(res, indent=1, default=str))
    v = judged["verdicts"]
    print("=" * 100)
    for k in ("tp2_tfm_equals_tp1_tfm", "tp2_tfm_equals_tp2_nospec", "tp1_tfm_equals_tp2_nospec",
              "tp1_difference_explained_by_tp_numerics", "tp2_ddtree_equals_tp2_nospec", "tfm_scheduling_as_asked", "all_ok"):  # fmt: skip
        if k in v:
            print(f"{k:42s} {v[k]}")
    for k in ("tp_tree_checks", "tp2_ddtree_tree_checks", "workers_in_distinct_actors", "tp2_ddtree_workers_in_distinct_actors"):
        if k in v:
            print(f"{k:42s} {v[k]}")
    print(f"{'mean_accepted_length':42s} {v['mean_accepted_length']}")
    for name, c in judged["comparisons"].items():
        if not c["equal"]:
            print(f"{name}: {c.get('identical_prompts')}/{c.get('prompts')} identical; first divergences "
                  f"{[(d['prompt'], d['first_divergence']) for d in c['differing']][:12]} {c.get('reason', '')}")  # fmt: skip
    for name, err in v["errors"].items():
        print(f"{name} ERROR: {err}")
    print("=" * 100, flush=True)
    return 0 if v["all_ok"] else 1


def command(args: argparse.Namespace) -> str:
    env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                   if k.startswith("TFM_TP2_") and k not in ("TFM_TP2_T0", "TFM_TP2_COMMAND"))  # fmt: skip
    base = os.environ.get("TFM_TP2_COMMAND") or (
        f"python3 bench/gpu_tp2_e2e.py --target {args.target_arg} --drafter {args.drafter_arg}"
        + (" --async-scheduling" if args.async_scheduling else ""))
    return f"{env} {base}".strip()


def pack_phases(out: Path) -> None:
    """All phases' JSON (every token) into OUT/phases.tar.gz (at most 8 files come back from OUT)."""
    with tarfile.open(out / "phases.tar.gz", "w:gz") as tar:
        for p in sorted(WORK.glob("*.json")):
            tar.add(p, arcname=f"phases/{p.name}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/tfm-tp2-out"))
    ap.add_argument("--phase", default="all", choices=["all", *PHASES, "summary"])
    ap.add_argument("--target", default="zoo/target", help="target model directory (default: the toy zoo)")
    ap.add_argument("--drafter", default="zoo/drafter", help="drafter directory (default: the toy zoo)")
    ap.add_argument("--async-scheduling", action="store_true", help="the tfm engines with async_scheduling=True")
    args = ap.parse_args()
    args.target_arg, args.drafter_arg = args.target, args.drafter
    args.target, args.drafter = str(Path(args.target).resolve()), str(Path(args.drafter).resolve())  # Ray actors' cwd differs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    for k, v in NO_MULTICAST_ENV.items():
        os.environ.setdefault(k, v)
    if args.phase in PHASES:
        return phase_engine(args, args.phase)
    env = env_info()
    earlier = {name: {"from_earlier_run": True} for name in PHASES if (WORK / f"{name}.json").is_file()}
    if args.phase == "summary":  # from the phase files already there
        return summary(args, earlier, env)
    selected = [p for p in os.environ.get("TFM_TP2_PHASES", ",".join(PHASES)).split(",") if p]
    if unknown := [p for p in selected if p not in PHASES]:
        sys.exit(f"TFM_TP2_PHASES: unknown phases {unknown}; known: {list(PHASES)}")
    for name in selected:  # phases not selected keep an earlier run's file (same machine): judged with the rest
        (WORK / f"{name}.json").unlink(missing_ok=True)
    log(f"target {args.target}, drafter {args.drafter}; phases {selected}; gpus {env.get('gpus')}")
    runs: dict[str, dict[str, Any]] = {name: earlier[name] for name in PHASES if name in earlier and name not in selected}
    rc = 1
    for name in [p for p in PHASES if p in selected]:
        runs[name] = run_phase(args, name)
        rc = summary(args, runs, env)  # after every phase: a result file exists whatever stops the run
    pack_phases(out)
    return rc


if __name__ == "__main__":
    sys.exit(main())
