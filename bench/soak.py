#!/usr/bin/env python3
"""Serving soak of ``vllm serve`` with method "tfm": load, disconnects, bad requests, preemption.

GPU host, one command per phase, loopback only, bounded in count and time (``--deadline-s``):

``--phase soak`` (default): a tfm server and a no-speculation server of the same target start in
parallel (each with a fixed KV-cache size, so neither profiles memory while the other starts).
Warm-up, then the workload (``--requests`` OpenAI completions, ``--concurrency`` clients, random
prompt and output lengths including prompts ending just short of ``max_model_len``, streaming and
not, 5% of clients dropping the connection mid-stream, greedy and sampled requests at several
temperatures / top-p / top-k with seeds) goes to the tfm server, with the request-parameter probes
(docs/guarantees.md) sent alongside; then the same requests and probes go to the no-spec server
(``--nospec-gpu N``: the no-spec server runs on GPU N and its load at the same time as tfm's, so
that 2,000 requests and the second round fit one 10-minute call on two GPUs).
Reported: errors (goal 0), greedy outputs identical to no-spec (goal 100% in float32; every
divergence re-checked against the no-spec top-2 log-probability margin), GPU memory of each server
before / during / after (goal flat, see "Memory" below), p50/p99 latency and throughput of both,
the spec-decode counters from ``/metrics``, that both servers drained (no running / waiting
request, KV usage 0), the probes' outcomes, and ERROR / Traceback lines in the server logs.

``--phase preempt``: a tfm server whose KV cache holds about ``--preempt-capacity`` max-length
requests (``--kv-cache-memory-bytes`` estimated from the model shapes; the log's "Maximum
concurrency" line is recorded) and a no-spec server; 40 concurrent requests with long outputs
(mostly greedy, some sampled, 10% disconnecting) overflow the cache, so vLLM preempts running
requests and later recomputes them while their trees are in flight. ``vllm:num_preemptions_total``
must grow and greedy outputs must equal no-spec. The tfm server runs with the request trace on
(``VLLM_TFM_TRACE``, docs/metrics.md) and every load request carries ``X-Request-Id: load-<index>``;
each greedy divergence gets the trace records of its request up to a few steps past the
divergence, the other requests of those steps and a reading (bench/trace_reading.py); the trace
itself is packed into ``OUT/tfm_small_trace.jsonl.gz``.

Memory (both phases): the tfm server's load runs twice, the second round being the requests of
the first that started, again, in the same order, with the probes alongside (``X-Request-Id:
again-<index>``; its greedy outputs are compared with no-spec too). An engine allocates some
memory once, at the first batches of each size and kind (torch's caching allocator keeps the
peak of each new shape reserved; a warm-up of a few short greedy requests does not reach the
load's shapes), so the first round's growth (``memory_first_round_mib``) is reported but not
judged; the growth over the second round, which repeats the first round's shapes, is the leak
test: ``memory_flat`` is ``memory_delta_mib`` (second round, after - before, nvidia-smi's
per-process figure) <= ``memory_flat_mib``. ``--one-round`` (or a phase too short for it) judges
the first round as before. The tfm engine's stats lines end with the torch allocator's allocated
/ reserved MiB (docs/metrics.md), summarised per round as ``allocator``: growth that nvidia-smi
shows but the allocator does not is CUDA context or kernel-module memory.

Float32: vLLM runs the toy zoo in float32 with its Triton attention kernel, whose ``tl.dot`` rounds
float32 operands to tf32 (10-bit mantissa) unless ``TRITON_F32_DEFAULT`` says otherwise, while the
tree steps' attention is our own float32 kernel. A no-spec baseline with tf32 attention differs
from an exact float32 computation by about 1e-3 in the logits, enough to flip near-ties (the soak of
2026-11-29 without this setting: 3 of 610 greedy requests, no-spec top-2 margins 6.7e-5 to 2.5e-3,
the same requests in both rounds). Both servers therefore run with ``TRITON_F32_DEFAULT=ieee``
(``--triton-f32``), which makes every Triton dot product float32 in both.

Models: ``--target zoo/target --drafter zoo/drafter`` (defaults, the trained toy zoo), or
``--random``: a random float32 tiny Qwen3.5 hybrid target with decisive logits, a byte-level
tokenizer, a random DFlash drafter and a random Weaver (acceptance is near zero: it measures
correctness and robustness, not speed). Prompts: windows of the standard library's Python files
tokenized with the target's tokenizer (zoo), random token ids (random models).

usage (GPU host, repository root): ``bash bench/run_gpu_soak.sh [soak|preempt] [args]``, or after
``source .gpu-bundle/install.sh`` and installing the project: ``python3 bench/soak.py --out DIR``.
Results: ``OUT/soak.json`` / ``OUT/preempt.json``, server logs ``OUT/<role>.log``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
for _p in (BENCH, REPO):  # the bench modules, and vllm_tfm from this checkout (random models)
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

import soak_client as sc
import trace_reading as tr
from soak_probes import EXPECTED_ERRORS, MODEL_NAME, judge_probes, run_probes
from soak_server import (
    MemorySampler,
    Role,
    Server,
    _nvidia_smi,
    allocator_summary,
    graph_summary,
    log,
    log_facts,
    start_servers,
    stop_servers,
    visible_gpu_args,
    wait_drained,
)

T0 = time.monotonic()


# ============================================================================== configuration
@dataclass
class SoakConfig:
    out: Path
    target: str
    drafter: str
    budget: int = 16
    proposal: str | None = None
    requests: int = 2000
    concurrency: int = 32
    max_model_len: int = 2048
    max_num_seqs: int = 64
    seed: int = 0
    deadline_s: float = 450.0  # this phase, from ``started_at`` (default: process start)
    startup_timeout_s: float = 300.0
    port: int = 8300
    kv_cache_bytes: int = 4 << 30
    request_timeout_s: float = 180.0
    memory_flat_mib: float = 64.0
    preempt_requests: int = 40
    preempt_max_model_len: int = 1024
    preempt_capacity: float = 12.0  # estimated max-length requests the small KV cache holds
    random_models: bool = False
    command: str = ""
    trace_max_mb: float = 128.0  # bound of the tfm_small server's request trace (VLLM_TFM_TRACE_MAX_MB)
    settle_s: float = 2.0  # wait after a load has drained before reading memory
    probe_delay_s: float = 10.0  # the probes start this long after the load (capped at a quarter of its budget)
    second_round: bool = True  # run the tfm load twice and judge memory on the second round (module doc)
    first_round_share: float = 0.55  # of the tfm server's time, when a second round follows
    again_requests: int | None = None  # second round: the first N started requests again (None: all of them)
    nospec_gpu: str | None = None  # soak phase: the no-spec server on this GPU, its load alongside tfm's (module doc)
    triton_f32: str | None = "ieee"  # TRITON_F32_DEFAULT of both servers (module doc, "Float32"); None: Triton's tf32
    cuda_graphs: bool = False  # both servers with torch.compile and vLLM's CUDA graphs (tfm: full tree graphs), not eager
    async_scheduling: bool = False  # the tfm server with --async-scheduling, else --no-async-scheduling; no-spec: vLLM's default


Launcher = Callable[[Role, SoakConfig], list[str]]
LOAD_ID_PREFIX = "load-"
"""``X-Request-Id`` of load request i is ``load-<i>``: vLLM names it ``cmpl-load-<i>-0-<8 hex>``."""
AGAIN_ID_PREFIX = "again-"
"""``X-Request-Id`` of request i in the second round (its trace records stay apart from the first's)."""
TRACE_ARCHIVE = "tfm_small_trace.jsonl.gz"


def server_env(cfg: SoakConfig, role: Role) -> dict[str, str]:
    """Environment of a role's server on top of the driver's: Triton's float32 dot precision for
    both (module doc, "Float32") and, with ``nospec_gpu``, the no-spec server's GPU."""
    env = {} if cfg.triton_f32 is None else {"TRITON_F32_DEFAULT": cfg.triton_f32}
    if not role.spec and cfg.nospec_gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = cfg.nospec_gpu
    return env


def vllm_command(role: Role, cfg: SoakConfig) -> list[str]:
    """``vllm serve`` for a role, with the settings of the GPU host bundle (shared/gpu/README.md)."""
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", cfg.target,
        "--served-model-name", MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(role.port),
        "--dtype", "float32",
        "--attention-backend", "TRITON_ATTN",
        "--additional-config", json.dumps({"gdn_prefill_backend": "triton"}),
        "--compilation-config", json.dumps({"custom_ops": ["none"]}),
        *([] if cfg.cuda_graphs else ["--enforce-eager"]),
        # tfm: as asked, synchronous unless --async-scheduling (pinned, whatever tfm's default)
        *((["--async-scheduling"] if cfg.async_scheduling else ["--no-async-scheduling"]) if role.spec else []),
        "--max-model-len", str(role.max_model_len),
        "--max-num-seqs", str(cfg.max_num_seqs),
        "--gpu-memory-utilization", "0.3",
        "--kv-cache-memory-bytes", str(role.kv_cache_bytes),
        "--no-enable-prefix-caching",
        "--generation-config", "vllm",
        "--seed", str(cfg.seed),
        "--disable-uvicorn-access-log",
    ]  # fmt: skip
    if role.spec:
        spec: dict[str, Any] = {"method": "tfm", "model": cfg.drafter, "num_speculative_tokens": cfg.budget,
                                "attention_backend": "TRITON_ATTN"}
        if cfg.proposal:
            spec["proposal"] = cfg.proposal
        cmd += ["--speculative-config", json.dumps(spec)]
    return cmd


# ============================================================================== one load on one server
def load_on(
    server: Server, specs: Sequence[sc.RequestSpec], cfg: SoakConfig, budget_s: float, probe_prompt: list[int] | None,
    id_prefix: str = LOAD_ID_PREFIX,
) -> tuple[dict[str, Any], list[sc.RequestResult], dict[str, sc.Outcome]]:
    """One load (+ the probes sent alongside) on ``server``: (report, results, probe outcomes).

    The report has the load summary, the GPU memory before / every 5 s / after, whether the server
    drained, the spec-decode counters, every vLLM counter that moved and the torch allocator of a
    tfm engine from its stats lines during the load (``allocator``)."""
    res: dict[str, Any] = {"server": server.role.name, "budget_s": round(budget_s, 1), "requests_sent": len(specs)}
    log_from = len(server.log_text())
    before = server.metrics()
    res["memory_before"] = server.memory()
    t_launch_stop = time.monotonic() + budget_s
    t_hard_stop = t_launch_stop + 15.0
    probes_out: dict[str, sc.Outcome] = {}
    last_print = [0.0]

    def progress(done: int, total: int) -> None:
        if time.monotonic() - last_print[0] > 15:
            last_print[0] = time.monotonic()
            log(f"{server.role.name}: {done}/{total} requests done")

    async def main() -> tuple[list[sc.RequestResult], float]:
        load = sc.run_load(server.base_url, MODEL_NAME, specs, concurrency=cfg.concurrency,
                           stop_launching_at=t_launch_stop, hard_stop_at=t_hard_stop,
                           request_timeout_s=cfg.request_timeout_s, on_progress=progress,
                           request_id_prefix=id_prefix)
        if probe_prompt is None:
            return await load
        (results, wall), probes = await asyncio.gather(load, run_probes(server.base_url, probe_prompt, min(cfg.probe_delay_s, budget_s / 4)))
        probes_out.update(probes)
        return results, wall

    with MemorySampler(server) as sampler:
        results, wall = asyncio.run(main())
    res["memory_during"] = sampler.samples
    res["drain"] = wait_drained(server)
    time.sleep(cfg.settle_s)
    res["memory_after"] = server.memory()
    after = server.metrics()
    res["summary"] = sc.summarize(specs, results, wall)
    res["spec_decode"] = sc.spec_decode_summary(before, after)
    res["counters"] = sc.metrics_delta(before, after)
    res["preemptions"] = (sc.metric_value(after, "vllm:num_preemptions_total") or 0.0) - (
        sc.metric_value(before, "vllm:num_preemptions_total") or 0.0)
    res["probes_raw"] = {k: {"http_status": v.http_status, "error": v.error, "tokens": [v.tokens(i) for i in sorted(v.choices)]}
                         for k, v in probes_out.items()}
    res.update(memory_change(res["memory_before"], res["memory_during"], res["memory_after"]))
    res["allocator"] = allocator_summary(server.log_text()[log_from:])
    res["cuda_graphs"] = graph_summary(server.log_text()[log_from:])
    b, a = res["memory_before"].get("mib"), res["memory_after"].get("mib")
    s = res["summary"]
    log(f"{server.role.name}: {s['status_counts']} errors={s['errors']} wall={s['wall_s']}s "
        f"p50={_fmt(s['latency_s']['p50'])}s p99={_fmt(s['latency_s']['p99'])}s "
        f"tok/s={_fmt(s['throughput_tokens_per_s'])} mem {b}->{a} MiB preemptions={res['preemptions']} "
        f"MAL={_fmt(res['spec_decode']['mean_accepted_length'])} drain={res['drain']}")
    return res, results, probes_out


def memory_change(before: dict[str, Any], during: list[dict[str, Any]], after: dict[str, Any]) -> dict[str, Any]:
    """after - before and the peak, from the server's processes when nvidia-smi names them, else the whole GPU.

    (In a container nvidia-smi may not list the processes; the whole-GPU figure still shows growth,
    since the other server of the phase is idle while this one is loaded.)"""
    for key, source in (("mib", "server processes"), ("gpu_used_mib", "whole GPU")):
        b, a = before.get(key), after.get(key)
        if b is not None and a is not None:
            peak = max([b, a] + [m[key] for m in during if m.get(key) is not None])
            return {"memory_delta_mib": a - b, "memory_peak_mib": peak, "memory_source": source}
    return {"memory_delta_mib": None, "memory_peak_mib": None, "memory_source": None}


def memory_verdict(first: dict[str, Any] | None, again: dict[str, Any] | None, flat_mib: float) -> dict[str, Any]:
    """The memory lines of a verdict from the tfm server's first and second load (``load_on``
    reports; ``again`` None when no second round ran).

    With a second round its growth is the leak test (``memory_test`` "second round") and the first
    round's growth is reported as ``memory_first_round_mib`` (what the engine allocates once at the
    load's first batches); without one the first round's growth is judged. ``memory_flat``: growth
    <= ``flat_mib``, None when the growth was not measured."""
    judged = again if again is not None else first
    out: dict[str, Any] = {"memory_test": None if judged is None else ("second round" if again is not None else "first round")}
    if again is not None:
        out["memory_first_round_mib"] = None if first is None else first.get("memory_delta_mib")
    d = None if judged is None else judged.get("memory_delta_mib")
    out["memory_delta_mib"] = d
    out["memory_source"] = None if judged is None else judged.get("memory_source")
    out["memory_flat"] = None if d is None else d <= flat_mib
    return out


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3g}"


def warm_up(server: Server, prompts: sc.PromptSource, budget_s: float, n: int = 32) -> dict[str, Any]:
    """``n`` concurrent short greedy requests and one long prompt, so lazy allocations happen before measuring."""
    rng = random.Random(12345)
    specs = [sc.RequestSpec(i, tuple(prompts(rng, 16 + 8 * i)), 16, 0.0, stream=bool(i % 2)) for i in range(n)]
    specs.append(sc.RequestSpec(n, tuple(prompts(rng, server.role.max_model_len - 24)), 16, 0.0))
    t = time.monotonic()
    results, wall = asyncio.run(sc.run_load(server.base_url, MODEL_NAME, specs, concurrency=n + 1,
                                            stop_launching_at=t + budget_s, hard_stop_at=t + budget_s + 10))
    counts: dict[str, int] = {}
    for r in results:
        counts[r.status] = counts.get(r.status, 0) + 1
    return {"requests": len(specs), "status_counts": counts, "wall_s": round(wall, 1),
            "errors": [r.error for r in results if r.status == "error"][:5]}


# ============================================================================== divergence check
async def _nospec_margins(server: Server, spec: sc.RequestSpec, pos: int) -> dict[str, Any]:
    """Re-ask the no-spec server for the first pos + 1 tokens with top-5 log-probabilities."""
    import aiohttp

    body = {"model": MODEL_NAME, "prompt": list(spec.prompt), "max_tokens": pos + 1, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "logprobs": 5, "return_tokens_as_token_ids": True}
    async with aiohttp.ClientSession() as session:
        out = await sc.complete(session, server.base_url + "/v1/completions", body)
    if out.error is not None or 0 not in out.choices:
        return {"error": out.error}
    lp = out.choices[0].logprobs or {}
    tops = lp.get("top_logprobs") or []
    if len(tops) <= pos or not tops[pos]:
        return {"error": "no top_logprobs at the divergence"}
    vals = sorted(tops[pos].values(), reverse=True)
    return {"top2_margin": vals[0] - vals[1] if len(vals) > 1 else None, "rerun_tokens": out.tokens(0),
            "top5": {k: round(v, 6) for k, v in tops[pos].items()}}


def explain_divergences(nospec: Server, specs: Sequence[sc.RequestSpec], cmp: dict[str, Any], limit: int = 12) -> None:
    """Add the no-spec top-2 margin at each divergence (a near tie in float32 flips under any change of summation order)."""
    by_index = {s.index: s for s in specs}
    for d in cmp["divergences"][:limit]:
        try:
            info = asyncio.run(_nospec_margins(nospec, by_index[d["index"]], d["pos"]))
        except Exception as e:  # noqa: BLE001 - a diagnostic only
            info = {"error": f"{type(e).__name__}: {e}"}
        d["nospec_check"] = info


# ============================================================================== prompts and models
def stdlib_token_stream(tokenizer_dir: str, max_files: int = 80) -> list[int]:
    """Token ids of the standard library's Python files (sorted, the first ``max_files`` of >= 4 kB)."""
    import sysconfig

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size >= 4096)[:max_files]
    ids: list[int] = []
    for p in files:
        ids += tok.encode(p.read_text(errors="replace"), add_special_tokens=False)
    return ids


def vocab_size(model_dir: str) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    return int(cfg["vocab_size"])


def probe_prompt_of(prompts: sc.PromptSource) -> list[int]:
    """The prompt every request-parameter probe of the soak phase takes (bench/async_request_params.py takes it too)."""
    return prompts(random.Random(99), 24)


def prompt_source(cfg: SoakConfig) -> tuple[sc.PromptSource, dict[str, Any]]:
    if cfg.random_models:
        v = vocab_size(cfg.target)
        return sc.random_token_prompts(3, v - 2), {"kind": "random token ids", "range": [3, v - 2]}
    ids = stdlib_token_stream(cfg.target)
    return sc.stream_token_prompts(ids), {"kind": "standard-library Python files", "tokens": len(ids)}


RANDOM_VOCAB, RANDOM_HIDDEN, RANDOM_BLOCK = 4096, 512, 16


def write_random_models(root: Path) -> tuple[Path, Path]:
    """A random float32 Qwen3.5 hybrid (decisive logits) with a byte-level tokenizer, a DFlash drafter, a Weaver."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    sys.path.insert(0, str(REPO / "examples"))
    from _tiny_models import write_byte_tokenizer

    from vllm_tfm.models.dflash import DFlashConfig, DFlashDrafter
    from vllm_tfm.models.tfm_config import WeaverConfig
    from vllm_tfm.models.weaver import Weaver
    from vllm_tfm.reference.toy_targets import randomize_

    target, drafter = root / "target", root / "drafter"
    cfg = Qwen3_5TextConfig(
        vocab_size=RANDOM_VOCAB, hidden_size=RANDOM_HIDDEN, intermediate_size=1024, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, max_position_embeddings=4096,
        eos_token_id=256, bos_token_id=256, pad_token_id=256, tie_word_embeddings=False, torch_dtype="float32")
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg)
    randomize_(model, seed=0)
    model.float().save_pretrained(target)
    write_byte_tokenizer(target, RANDOM_VOCAB)
    torch.manual_seed(1)
    dcfg = DFlashConfig.create(
        hidden_size=RANDOM_HIDDEN, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        intermediate_size=1024, vocab_size=RANDOM_VOCAB, target_layer_ids=[1, 3, 5], mask_token_id=RANDOM_VOCAB - 1,
        block_size=RANDOM_BLOCK, rope_theta=10_000_000.0, dtype="float32")
    DFlashDrafter(dcfg).float().save_pretrained(drafter)
    torch.manual_seed(2)
    wcfg = WeaverConfig(d_model=RANDOM_HIDDEN, d_rank=64, n_layers=1, n_heads=2, d_mlp=128, max_depth=RANDOM_BLOCK - 1)
    Weaver(wcfg).float().save_pretrained(drafter)  # also tfm_config.json (proposal "tfm")
    return target, drafter


def soak_command(argv: Sequence[str], environ: Mapping[str, str]) -> str:
    """The command line a result records: the ``VLLM_TFM_*`` switches the servers inherit (they change what
    runs, e.g. ``VLLM_TFM_GDN_STATE_SLOTS``), then this script with its arguments."""
    switches = [f"{k}={v}" for k, v in sorted(environ.items()) if k.startswith("VLLM_TFM_")]
    return " ".join([*switches, "python3 bench/soak.py", *argv])


def gdn_state_slots_from_env(environ: Mapping[str, str] | None = None) -> str:
    """``"one"`` or ``"per_draft"``: the plugin's ``gdn_state_slots`` as the servers and engines started here
    (one GPU) resolve it from the ``VLLM_TFM_*`` variables they inherit (``one_slot.gdn_state_slots_from_env``)."""
    from vllm_tfm.vllm_plugin.runtime.one_slot import gdn_state_slots_from_env as resolve

    return resolve(environ)


def estimate_request_kv_bytes(target_dir: str, drafter_dir: str, budget: int, max_model_len: int, dtype_bytes: int = 4,
                              gdn_state_slots: str = "per_draft") -> int:
    """Lower estimate of the KV-cache bytes one max-length tfm request holds in vLLM 0.26.

    GDN layers: 1 + budget state slots per request (vLLM's mamba spec-decode blocks; one with
    ``gdn_state_slots="one"``, vllm_tfm/vllm_plugin/runtime/one_slot.py), each a float32
    SSM state HV x V x K and a conv window (W - 1 + budget) x conv_dim; attention layers of the
    target and of the DFlash drafter: K and V per token. vLLM pads pages of a hybrid model to one
    size, so the real figure is somewhat larger (the server log's "Maximum concurrency" is the truth).
    """
    t = json.loads((Path(target_dir) / "config.json").read_text())
    t = t.get("text_config", t)
    d = json.loads((Path(drafter_dir) / "config.json").read_text())
    n_layers = int(t["num_hidden_layers"])
    types = t.get("layer_types") or [
        "full_attention" if (i + 1) % int(t.get("full_attention_interval", 4)) == 0 else "linear_attention"
        for i in range(n_layers)
    ]
    n_gdn = sum(1 for x in types if x == "linear_attention")
    n_attn = n_layers - n_gdn
    h, hv = int(t["linear_num_key_heads"]), int(t["linear_num_value_heads"])
    k, v, w = int(t["linear_key_head_dim"]), int(t["linear_value_head_dim"]), int(t["linear_conv_kernel_dim"])
    ssm = hv * v * k * 4
    conv = (2 * h * k + hv * v) * (w - 1 + budget) * dtype_bytes
    head_dim = int(t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"])
    attn_tok = 2 * int(t["num_key_value_heads"]) * head_dim * dtype_bytes * n_attn
    d_head = int(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"])
    draft_tok = 2 * int(d["num_key_value_heads"]) * d_head * dtype_bytes * int(d["num_hidden_layers"])
    if gdn_state_slots not in ("per_draft", "one"):
        raise ValueError(f"gdn_state_slots={gdn_state_slots!r}: 'per_draft' or 'one'")
    slots = 1 if gdn_state_slots == "one" else 1 + budget
    return slots * n_gdn * (ssm + conv) + (max_model_len + budget + 1) * (attn_tok + draft_tok)


# ============================================================================== phases
def env_info() -> dict[str, Any]:
    info: dict[str, Any] = {"python": platform.python_version(), "host": platform.node()}
    for dist in ("torch", "vllm", "transformers", "aiohttp", "vllm-tfm"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = None
    smi = _nvidia_smi([*visible_gpu_args(), "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    info["cuda_visible_devices"] = os.environ.get("CUDA_VISIBLE_DEVICES")
    info["gpu"] = smi.strip() if smi else None
    return info


def _save(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, default=str))


def phase_soak(
    cfg: SoakConfig, prompts: sc.PromptSource, prompt_info: dict[str, Any], launch: Launcher = vllm_command,
    started_at: float | None = None,
) -> dict[str, Any]:
    """The soak (module docstring); ``cfg.deadline_s`` counts from ``started_at`` (default: process start)."""
    deadline = (T0 if started_at is None else started_at) + cfg.deadline_s
    path = cfg.out / "soak.json"
    res: dict[str, Any] = {"phase": "soak", "command": cfg.command, "config": _cfg_json(cfg), "prompts": prompt_info,
                           "env": env_info()}
    specs = sc.make_workload(cfg.requests, prompts, seed=cfg.seed, max_model_len=cfg.max_model_len)
    res["workload"] = _workload_stats(specs)
    probe_prompt = probe_prompt_of(prompts)
    roles = [Role("tfm", cfg.port, True, cfg.kv_cache_bytes, cfg.max_model_len),
             Role("nospec", cfg.port + 1, False, cfg.kv_cache_bytes, cfg.max_model_len)]
    servers = [Server(r, launch(r, cfg), cfg.out, cwd=REPO, env=server_env(cfg, r)) for r in roles]
    tfm, nospec = servers
    try:
        up = start_servers(servers, min(deadline - 60, time.monotonic() + cfg.startup_timeout_s))
        res["startup"] = {s.role.name: {"healthy": up[s.role.name], "seconds": s.startup_s} for s in servers}
        _save(path, res)
        if not up["tfm"]:
            res["fatal"] = "the tfm server did not become healthy"
            return _finish(res, servers, path)
        wb = max(20.0, min(90.0, (deadline - time.monotonic()) / 8))
        res["warmup"] = {s.role.name: warm_up(s, prompts, wb) for s in servers if up[s.role.name]}
        alongside = up["nospec"] and cfg.nospec_gpu is not None  # no-spec on its own GPU, at the same time
        remaining = deadline - time.monotonic() - 45.0
        tfm_s = remaining * (0.6 if up["nospec"] and not alongside else 1.0)
        tfm_until = time.monotonic() + tfm_s
        first_s = tfm_s * (cfg.first_round_share if cfg.second_round else 1.0)
        with ThreadPoolExecutor(max_workers=1) as pool:
            # the no-spec load gets the first round's launch window over the whole workload; it is the faster
            # server, so it starts at least the requests tfm starts (the comparisons skip the others)
            nospec_load = pool.submit(load_on, nospec, specs, cfg, max(10.0, first_s), probe_prompt) if alongside else None
            res["tfm"], tfm_results, tfm_probes = load_on(tfm, specs, cfg, max(10.0, first_s), probe_prompt)
            _save(path, res)
            started = [s for s, r in zip(specs, tfm_results) if r.status != "not_started"]
            again_results = None
            if cfg.second_round:  # the leak test (module doc, "Memory")
                again = started if cfg.again_requests is None else started[: cfg.again_requests]
                res["tfm_again"], again_results, _ = load_on(tfm, again, cfg, max(10.0, tfm_until - time.monotonic()),
                                                             probe_prompt, id_prefix=AGAIN_ID_PREFIX)
                _save(path, res)
            nospec_done = nospec_load.result() if nospec_load is not None else None
        res["nospec_requests"] = len(specs) if alongside else len(started)
        ref_probes = None
        if up["nospec"]:
            if nospec_done is not None:
                res["nospec"], nospec_results, ref_probes = nospec_done
            else:
                remaining = deadline - time.monotonic() - 35.0
                res["nospec"], nospec_results, ref_probes = load_on(nospec, started, cfg, max(10.0, remaining), probe_prompt)
            cmp = sc.compare_greedy(started, tfm_results, nospec_results)
            explain_divergences(nospec, started, cmp)
            res["greedy_vs_nospec"] = cmp
            if again_results is not None:
                cmp = sc.compare_greedy(started, again_results, nospec_results)
                explain_divergences(nospec, started, cmp)
                res["greedy_vs_nospec_again"] = cmp
            res["ratios"] = _ratios(res["tfm"]["summary"], res["nospec"]["summary"])
        res["probes"] = judge_probes(tfm_probes, ref_probes)
        res["after"] = _still_serving(tfm, specs, tfm_results)
    except Exception as e:  # noqa: BLE001 - keep what was measured
        import traceback

        res["fatal"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        log("FAILED:", res["fatal"])
    return _finish(res, servers, path)


def phase_preempt(
    cfg: SoakConfig, prompts: sc.PromptSource, prompt_info: dict[str, Any], launch: Launcher = vllm_command,
    kv_small: int | None = None, started_at: float | None = None,
) -> dict[str, Any]:
    """Preemption with trees in flight (module docstring); ``kv_small`` overrides the estimated small KV size."""
    deadline = (T0 if started_at is None else started_at) + cfg.deadline_s
    path = cfg.out / "preempt.json"
    res: dict[str, Any] = {"phase": "preempt", "command": cfg.command, "config": _cfg_json(cfg), "prompts": prompt_info,
                           "env": env_info()}
    mml = cfg.preempt_max_model_len
    if kv_small is None:
        slots = gdn_state_slots_from_env()
        est = estimate_request_kv_bytes(cfg.target, cfg.drafter, cfg.budget, mml, gdn_state_slots=slots)
        kv_small = math.ceil(cfg.preempt_capacity * est)
        res["kv_estimate"] = {"bytes_per_max_len_request": est, "capacity_requests": cfg.preempt_capacity,
                              "kv_cache_bytes": kv_small, "gdn_state_slots": slots}
    # long outputs: a request's attention blocks must grow well past what is left free once admission
    # has filled the cache (each request also holds 1 + B GDN state blocks from the start)
    specs = sc.make_workload(cfg.preempt_requests, prompts, seed=cfg.seed + 1, max_model_len=mml, max_new_tokens=800,
                             long_max_new_tokens=900, greedy_fraction=0.85, disconnect_fraction=0.1, near_max_fraction=0.1,
                             long_fraction=0.7)
    res["workload"] = _workload_stats(specs)
    roles = [Role("tfm_small", cfg.port + 2, True, kv_small, mml), Role("nospec", cfg.port + 3, False, cfg.kv_cache_bytes, mml)]
    trace_dir = cfg.out / "trace_tfm_small"  # the tfm server's request trace (VLLM_TFM_TRACE), packed at the end
    if trace_dir.is_dir():
        for stale in trace_dir.glob("*.jsonl"):
            stale.unlink()
    # no trace with asynchronous scheduling: the plugin refuses VLLM_TFM_TRACE there (it reads every step's acceptance)
    trace_env = {} if cfg.async_scheduling else {"VLLM_TFM_TRACE": str(trace_dir), "VLLM_TFM_TRACE_MAX_MB": f"{cfg.trace_max_mb:g}"}
    servers = [Server(r, launch(r, cfg), cfg.out, cwd=REPO, env={**server_env(cfg, r), **(trace_env if r.spec else {})})
               for r in roles]
    small, nospec = servers
    res["trace"] = ({"off": "asynchronous scheduling (the plugin refuses VLLM_TFM_TRACE with it)"} if cfg.async_scheduling
                    else {"dir": str(trace_dir), "max_mb": cfg.trace_max_mb, "request_id": f"X-Request-Id: {LOAD_ID_PREFIX}<index>"})
    try:
        up = start_servers(servers, min(deadline - 60, time.monotonic() + cfg.startup_timeout_s))
        res["startup"] = {s.role.name: {"healthy": up[s.role.name], "seconds": s.startup_s} for s in servers}
        res["tfm_small_log"] = log_facts(small.log_text())
        _save(path, res)
        if not up["tfm_small"] or not up["nospec"]:
            res["fatal"] = "a server did not become healthy"
            return _finish(res, servers, path)
        wb = max(20.0, min(60.0, (deadline - time.monotonic()) / 10))
        res["warmup"] = {s.role.name: warm_up(s, prompts, wb, n=8) for s in servers}
        conc = max(cfg.concurrency, len(specs))
        pcfg = SoakConfig(**{**asdict(cfg), "concurrency": conc})
        remaining = deadline - time.monotonic() - 40.0
        share = 0.7 if cfg.second_round else 0.6  # two full rounds of long requests; no-spec needs half of one
        tfm_until = time.monotonic() + remaining * share
        first_s = remaining * share * (cfg.first_round_share if cfg.second_round else 1.0)
        res["tfm_small"], small_results, _ = load_on(small, specs, pcfg, max(10.0, first_s), None)
        _save(path, res)
        started = [s for s, r in zip(specs, small_results) if r.status != "not_started"]
        again_results = None
        if cfg.second_round:  # the leak test (module doc, "Memory"); preempts again
            res["tfm_small_again"], again_results, _ = load_on(small, started, pcfg, max(10.0, tfm_until - time.monotonic()),
                                                               None, id_prefix=AGAIN_ID_PREFIX)
            _save(path, res)
        remaining = deadline - time.monotonic() - 30.0
        res["nospec"], nospec_results, _ = load_on(nospec, specs, pcfg, max(10.0, remaining), None)
        cmp = sc.compare_greedy(specs, small_results, nospec_results)
        explain_divergences(nospec, specs, cmp)
        res["greedy_vs_nospec"] = cmp
        if again_results is not None:
            cmp = sc.compare_greedy(started, again_results, nospec_results)
            explain_divergences(nospec, started, cmp)
            res["greedy_vs_nospec_again"] = cmp
        res["after"] = _still_serving(small, specs, small_results)
    except Exception as e:  # noqa: BLE001
        import traceback

        res["fatal"] = f"{type(e).__name__}: {e}"
        res["traceback"] = traceback.format_exc()
        log("FAILED:", res["fatal"])
    # the trace is read once the server has stopped (its last lines are written at exit)
    return _finish(res, servers, path, after_stop=None if cfg.async_scheduling
                   else lambda r: trace_divergences(r, specs, trace_dir, cfg.out / TRACE_ARCHIVE))


def request_kind(spec: sc.RequestSpec) -> str:
    """greedy / t=<temperature> [top_p=..] [top_k=..], then stream / drop@<tokens> (the trace's step mates)."""
    kind = "greedy" if spec.greedy else f"t={spec.temperature:g}"
    if spec.top_p is not None:
        kind += f" top_p={spec.top_p:g}"
    if spec.top_k is not None:
        kind += f" top_k={spec.top_k}"
    if spec.disconnect_after_tokens is not None:
        kind += f" drop@{spec.disconnect_after_tokens}"
    elif spec.stream:
        kind += " stream"
    return kind


def trace_divergences(res: dict[str, Any], specs: Sequence[sc.RequestSpec], trace_dir: Path, archive: Path,
                      limit: int = 12) -> None:
    """Each greedy divergence gets the trace at it (``trace_reading.explain``): the request's
    records, the other requests of those steps and a reading. Then the trace files go into one
    gzip archive beside the results (what comes back from the GPU host is at most 8 files)."""
    import gzip
    import shutil

    info = res.setdefault("trace", {})
    files = sorted(trace_dir.glob("trace-*.jsonl")) if trace_dir.is_dir() else []
    info["files"] = [p.name for p in files]
    info["bytes"] = sum(p.stat().st_size for p in files)
    divs = (res.get("greedy_vs_nospec") or {}).get("divergences") or []
    index_of = tr.index_from_header(LOAD_ID_PREFIX)
    if files:  # chain steps with a plain row in front of spec rows (vLLM 0.26's GDN gate misread)
        info["mixed_steps"] = tr.mixed_step_summary(({**rec, "f": f} for f, rec in tr.iter_records(files)), index_of)
    if files and divs:
        kinds = {s.index: request_kind(s) for s in specs}
        ex = tr.extract(files, index_of, [d["index"] for d in divs[:limit]])
        info.update({"records": ex.records, "truncated": ex.truncated})
        for d in divs[:limit]:
            d["trace"] = tr.explain(ex, d["index"], d["pos"], index_of, kinds, max_records=60, mate_steps=4)
    elif not files:
        info["error"] = "no trace file (was the plugin's VLLM_TFM_TRACE honoured?)"
    if files:
        with gzip.open(archive, "wt", encoding="utf-8") as out:
            for p in files:
                with open(p, encoding="utf-8") as fh:
                    shutil.copyfileobj(fh, out)
        shutil.rmtree(trace_dir, ignore_errors=True)
        info["archive"] = archive.name


def _still_serving(server: Server, specs: Sequence[sc.RequestSpec], results: Sequence[sc.RequestResult]) -> dict[str, Any]:
    """After everything: /health answers and the first greedy request that finished gives the same tokens again."""
    out: dict[str, Any] = {"healthy": server.healthy()}
    first = next((s for s, r in zip(specs, results) if s.greedy and r.status == "ok" and s.max_tokens <= 64), None)
    if first is None:
        return out
    plain = sc.RequestSpec(first.index, first.prompt, first.max_tokens, 0.0)
    t = time.monotonic()
    again, _ = asyncio.run(sc.run_load(server.base_url, MODEL_NAME, [plain], concurrency=1, stop_launching_at=t + 30,
                                       hard_stop_at=t + 60))
    before = next(r for r in results if r.index == first.index)
    out["repeat_status"] = again[0].status
    out["repeat_identical"] = again[0].token_ids == before.token_ids
    return out


def _finish(res: dict[str, Any], servers: Sequence[Server], path: Path,
            after_stop: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Read the server logs, stop the servers (their shutdown output is reported apart), run
    ``after_stop`` (errors recorded, not raised), write the verdict."""
    running = {s.role.name: s.log_text() for s in servers}
    codes = stop_servers(servers)
    if after_stop is not None:
        try:
            after_stop(res)
        except Exception as e:  # noqa: BLE001 - a diagnostic must not lose the measurements
            res["after_stop_error"] = f"{type(e).__name__}: {e}"
    for s in servers:
        text = s.log_text()
        facts = log_facts(running[s.role.name], EXPECTED_ERRORS)
        facts["shutdown"] = log_facts(text[len(running[s.role.name]) :])
        res.setdefault("server_logs", {})[s.role.name] = {**facts, "exit_code": codes[s.role.name]}
    res["verdict"] = verdict(res)
    _save(path, res)
    print(summary_text(res), flush=True)
    return res


def summary_text(res: dict[str, Any]) -> str:
    """A few lines for the console: per server errors, latency, throughput, memory; then the verdict."""
    lines = ["=" * 100, f"soak phase {res.get('phase')}: {res.get('fatal', 'completed')}"]
    for role in ("tfm", "tfm_again", "tfm_small", "tfm_small_again", "nospec"):
        run = res.get(role)
        if not run:
            continue
        s, sd = run["summary"], run["spec_decode"]
        alloc = run.get("allocator") or {}
        lines.append(
            f"{role:15s} {s['status_counts']} errors={s['errors']} p50={_fmt(s['latency_s']['p50'])}s "
            f"p99={_fmt(s['latency_s']['p99'])}s tok/s={_fmt(s['throughput_tokens_per_s'])} "
            f"memory {run['memory_source']}: {_fmt(run['memory_delta_mib'])} MiB (peak {_fmt(run['memory_peak_mib'])}) "
            f"preemptions={run['preemptions']:.0f} mean accepted length={_fmt(sd['mean_accepted_length'])}"
            + (f" allocator MiB allocated {_fmt(alloc['allocated_last_mib'])} reserved {_fmt(alloc['reserved_last_mib'])}"
               if alloc.get("lines") else "")
        )
        if s["error_kinds"]:
            lines.append(f"          errors: {s['error_kinds']}")
    ms = (res.get("trace") or {}).get("mixed_steps")
    if ms:
        lines.append(f"trace: {ms['misordered_mixed_steps']} of {ms['mixed_non_tree_steps']} mixed chain steps with a plain row "
                     f"in front of spec rows (requests behind it: {ms['requests_behind_plain_row'][:20]})")  # fmt: skip
    for key, what in (("greedy_vs_nospec", ""), ("greedy_vs_nospec_again", " (second round)")):
        cmp = res.get(key)
        if not cmp:
            continue
        lines.append(f"greedy identical to no-spec{what}: {cmp['identical']}/{cmp['compared']}")
        for d in cmp["divergences"][:5]:
            lines.append(f"   request {d['index']} ({d['kind']}) diverges at {d['pos']}: {d['a']} vs {d['b']}, "
                         f"no-spec check {d.get('nospec_check', {}).get('top2_margin')}")
            t = d.get("trace") or {}
            if t:
                lines.append("      trace: " + ((t.get("reading") or {}).get("line") or t.get("error", "")))
    if res.get("ratios"):
        lines.append("tfm / no-spec: " + ", ".join(f"{k} {_fmt(v)}" for k, v in res["ratios"].items()))
    lines.append("verdict: " + json.dumps(res["verdict"]))
    lines.append("=" * 100)
    return "\n".join(lines)


def verdict(res: dict[str, Any]) -> dict[str, Any]:
    """The pass/fail lines of a phase (each None when its measurement is missing). Errors and
    drains count both rounds of the tfm server, greedy equality both comparisons with no-spec,
    memory the second round (``memory_verdict``)."""
    spec_role = "tfm" if res.get("phase") == "soak" else "tfm_small"
    v: dict[str, Any] = {"completed": "fatal" not in res}
    run, again = res.get(spec_role), res.get(f"{spec_role}_again")
    if run:
        s = run["summary"]
        rounds = [run] if again is None else [run, again]
        v["errors"] = sum(r["summary"]["errors"] for r in rounds)
        not_started = s["status_counts"].get("not_started", 0)
        v["requests_started"] = f"{s['requests'] - not_started} of {s['requests']}"
        v["all_started"] = not_started == 0
        v["errors_zero"] = v["errors"] == 0
        planned, done, first = s["disconnects_planned"], s["disconnects_done"], s["disconnects_finished_first"]
        v["disconnects"] = f"{done} of {planned} dropped mid-stream, {first} finished first"
        v["disconnects_done"] = planned == 0 or (done > 0 and done + first == planned)
        v["drained"] = all(bool(r["drain"].get("drained")) and r["drain"].get("kv_cache_usage") == 0 for r in rounds)
        v.update(memory_verdict(run, again, float(res["config"]["memory_flat_mib"])))
    cmps = [c for c in (res.get("greedy_vs_nospec"), res.get("greedy_vs_nospec_again")) if c]
    if cmps:
        v["greedy_identical_fraction"] = cmps[0]["identical_fraction"]
        if len(cmps) > 1:
            v["greedy_identical_fraction_again"] = cmps[1]["identical_fraction"]
        v["greedy_identical"] = all(c["compared"] > 0 and c["identical"] == c["compared"] for c in cmps)
    if "probes" in res:
        v["probes_ok"] = all(p["ok"] for p in res["probes"])
        v["probes_failed"] = [p["probe"] for p in res["probes"] if not p["ok"]]
    if res.get("phase") == "preempt" and run:
        v["preemptions"] = run["preemptions"]
        v["preempted"] = run["preemptions"] > 0
    logs = res.get("server_logs", {}).get(spec_role, {})
    v["server_tracebacks_unexpected"] = logs.get("tracebacks_unexpected")
    if "async_scheduling" in logs:  # the tfm engine scheduled as asked (vLLM's "Asynchronous scheduling is ..." line)
        v["scheduling_as_asked"] = logs["async_scheduling"] is bool(res["config"].get("async_scheduling"))
    if "after" in res:  # answering again after everything; the repeat's equality is informative (a near tie may flip)
        v["still_serving"] = bool(res["after"].get("healthy")) and res["after"].get("repeat_status", "ok") == "ok"
        v["repeat_identical"] = res["after"].get("repeat_identical")
    keys = ["completed", "all_started", "errors_zero", "disconnects_done", "drained", "memory_flat", "greedy_identical", "probes_ok",
            "preempted", "still_serving", "scheduling_as_asked"]
    v["all_ok"] = all(v.get(k) is not False for k in keys) and v.get("server_tracebacks_unexpected") in (0, None)
    return v


def _ratios(tfm: dict[str, Any], nospec: dict[str, Any]) -> dict[str, Any]:
    def r(a: float | None, b: float | None) -> float | None:
        return None if a is None or b is None or b == 0 else a / b

    return {
        "throughput_tfm_over_nospec": r(tfm["throughput_tokens_per_s"], nospec["throughput_tokens_per_s"]),
        "p50_latency_tfm_over_nospec": r(tfm["latency_s"]["p50"], nospec["latency_s"]["p50"]),
        "p99_latency_tfm_over_nospec": r(tfm["latency_s"]["p99"], nospec["latency_s"]["p99"]),
        "p50_tpot_tfm_over_nospec": r(tfm["tpot_s"]["p50"], nospec["tpot_s"]["p50"]),
    }


def _workload_stats(specs: Sequence[sc.RequestSpec]) -> dict[str, Any]:
    kinds: dict[str, int] = {}
    for s in specs:
        kinds[s.kind] = kinds.get(s.kind, 0) + 1
    return {
        "requests": len(specs),
        "kinds": kinds,
        "greedy": sum(s.greedy for s in specs),
        "stream": sum(s.stream for s in specs),
        "disconnect": sum(s.disconnect_after_tokens is not None for s in specs),
        "temperatures": sorted({s.temperature for s in specs}),
        "prompt_tokens": sum(len(s.prompt) for s in specs),
        "max_prompt_len": max(len(s.prompt) for s in specs),
        "max_tokens_total": sum(s.max_tokens for s in specs),
    }


def _cfg_json(cfg: SoakConfig) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(cfg).items()}


# ============================================================================== CLI
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--phase", choices=["soak", "preempt"], default="soak")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/tfm-soak-out"))
    ap.add_argument("--target", default=str(REPO / "zoo" / "target"))
    ap.add_argument("--drafter", default=str(REPO / "zoo" / "drafter"))
    ap.add_argument("--random", action="store_true", help="random tiny models instead of the zoo (written to /tmp)")
    ap.add_argument("--budget", type=int, default=16, help="num_speculative_tokens (tree nodes per request)")
    ap.add_argument("--proposal", choices=["chain", "ddtree", "tfm"], help="override the drafter's tfm_config.json proposal")
    ap.add_argument("--requests", type=int, help="soak requests (default 2000; 600 with --random)")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--preempt-requests", type=int, default=40)
    ap.add_argument("--preempt-capacity", type=float, default=12.0,
                    help="small KV cache of the preempt phase, in estimated max-length requests (lower: more preemption)")
    ap.add_argument("--deadline-s", type=float, help="time budget from the start of the script (default: soak 450, preempt 420)")
    ap.add_argument("--one-round", action="store_true",
                    help="one tfm load instead of two (memory judged on it, warm-up growth included)")
    ap.add_argument("--again-requests", type=int, help="second round: only the first N started requests again (default: all)")
    ap.add_argument("--first-round-share", type=float, default=0.55,
                    help="share of the tfm server's time for the first round when a second round follows")
    ap.add_argument("--nospec-gpu", help="soak phase: run the no-spec server on this GPU (CUDA index) and its load "
                                         "at the same time as tfm's (kind nvidia-h200-x2)")
    ap.add_argument("--triton-f32", choices=["ieee", "tf32", "tf32x3"], default="ieee",
                    help="TRITON_F32_DEFAULT of both servers (default ieee: float32 dot products in Triton kernels)")
    ap.add_argument("--cuda-graphs", action="store_true",
                    help="serve with torch.compile and CUDA graphs, the default a user gets (tfm: full graphs of tree "
                         "steps, FULL_AND_PIECEWISE), instead of --enforce-eager")
    ap.add_argument("--async-scheduling", action="store_true",
                    help="the tfm server schedules asynchronously (--async-scheduling), "
                         "as vLLM schedules no-spec by default; the preempt phase then runs without its request trace")
    ap.add_argument("--port", type=int, default=8300)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.random:
        root = Path(f"/tmp/tfm-soak-models-{args.phase}")  # per phase: both phases may run at once (run_gpu_soak.sh both)
        log("writing random models to", root)
        target, drafter = (str(p) for p in write_random_models(root))
    else:
        target, drafter = args.target, args.drafter
        for p in (target, drafter):
            if not (Path(p) / "config.json").is_file():
                print(f"no model at {p} (config.json missing): commit the toy zoo, pass --target/--drafter, or use --random")
                return 2
    mml = min(args.max_model_len, _max_positions(target))
    cfg = SoakConfig(
        out=out, target=target, drafter=drafter, budget=args.budget, proposal=args.proposal,
        requests=args.requests or (600 if args.random else 2000), concurrency=args.concurrency, max_model_len=mml,
        preempt_requests=args.preempt_requests, preempt_capacity=args.preempt_capacity, preempt_max_model_len=min(1024, mml),
        seed=args.seed, port=args.port, random_models=args.random, second_round=not args.one_round,
        again_requests=args.again_requests, first_round_share=args.first_round_share, nospec_gpu=args.nospec_gpu,
        triton_f32=args.triton_f32, cuda_graphs=args.cuda_graphs, async_scheduling=args.async_scheduling,
        deadline_s=args.deadline_s or (450.0 if args.phase == "soak" else 420.0),
        command=soak_command(sys.argv[1:] if argv is None else argv, os.environ),
    )
    prompts, info = prompt_source(cfg)
    log(f"phase {args.phase}: target {target}, drafter {drafter}, prompts {info}")
    res = phase_soak(cfg, prompts, info) if args.phase == "soak" else phase_preempt(cfg, prompts, info)
    return 0 if res["verdict"].get("all_ok") else 1


def _max_positions(target: str) -> int:
    cfg = json.loads((Path(target) / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    return int(cfg.get("max_position_embeddings") or 1 << 30)


if __name__ == "__main__":
    sys.exit(main())
