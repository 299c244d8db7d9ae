#!/usr/bin/env python3
"""GPU end-to-end check of the tfm runtime inside vLLM 0.26: greedy tfm output == no-spec output.

Phases (``--phase all`` runs them in this order, the engines in subprocesses):
  make      random tiny Qwen3.5 hybrid target (real float32 weights, decisive logits), a random
            DFlash drafter (z-lab layout, block size 8), a random Weaver and TreeFlash approximator + tfm_config.json, in /tmp;
  baseline  vLLM without speculation: greedy tokens of 8 prompts (batch 8) and of prompt 0 alone
            (batch 1), with the top-2 log-probability margin at every position;
  tfm       GPU unit checks of the runtime pieces (tree attention vs a torch reference, GDN tree
            step on CUDA vs float64 CPU, DDTree on CUDA vs CPU), then ONE tfm engine that runs every
            case by switching the proposal in-process: chain (vLLM's native chain path), chain with
            VLLM_TFM_FORCE_TREE_PATH=1 (our GDN verify/commit + tree sampler on chains), ddtree,
            tfm (Weaver), treeflash, and "oracle" variants whose trees carry the baseline continuation on a
            random branch up to a random depth (deep acceptance along non-first branches: KV
            compaction, GDN commit, drafter reorder), batch 8 and batch 1 each.
Every case records equality with the baseline, the first divergence (position, tokens around it,
the baseline's top-2 margin there), the runtime's tree counters and hooks fired, vLLM's
spec-decode counters, timings, and any exception with its traceback; a failing case does not stop
the others. Results: OUT/results.json (written after every case), OUT/*.log, a summary on stdout.
Optional sampling check (TFM_E2E_SAMPLING=1, TFM_E2E_SAMPLES=2000): at temperature 1.0 the
distribution of the first 2 generated tokens of prompt 0 under ddtree and tfm speculation equals
the no-spec one (two-sample chi-square homogeneity test, bench/chisquare.py; results "sampling").
Target variants (the make phase writes them under TFM_E2E_DIR; bench/vl_checkpoint.py):
  TFM_E2E_VL=1               the target converted to Qwen3_5ForConditionalGeneration (Qwen3.6-27B's
                             architecture: text_config + tiny random vision tower, M-RoPE), run with
                             text-only prompts and the image/video limits at 0 (no encoder profiling);
  TFM_E2E_SSM_DTYPE=float32  mamba_ssm_dtype in the target config: vLLM keeps the GDN state in float32
                             (the NVRTC tree kernels read float32 states; bf16 states use the references).
No-spec controls (TFM_E2E_CONTROL, a comma list; default "shuffled,alone" unless TFM_E2E_DTYPE is
float32): the baseline decodes the prompts again in a shuffled batch order / each alone, and records
which prompts differ from the batch-8 run (bench/e2e_controls.py; results "nospec_control").
Every case records which GDN path ran ("gdn_path": kernels / reference, from counted reference calls).

usage (GPU host, repository root):  bash bench/run_gpu_plugin.sh    (sets everything up)
        or:  python3 bench/gpu_plugin_e2e.py --out OUT [--phase all|make|baseline|tfm|summary]
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
from pathlib import Path

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # engine + worker in this process

T0 = time.time()
REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))  # the checkout, also without PYTHONPATH
ROOT = Path(os.environ.get("TFM_E2E_DIR", "/tmp/tfm-e2e"))
TARGET, DRAFTER = ROOT / "target", ROOT / "drafter"
VL = os.environ.get("TFM_E2E_VL", "0") == "1"
SSM_DTYPE = os.environ.get("TFM_E2E_SSM_DTYPE") or None
VOCAB, HIDDEN = 4096, 512
# TFM_E2E_ZOO=<dir>: run on a trained toy zoo (<dir>/target, <dir>/drafter) instead of random
# models; prompts are then windows of this repository's own Python files, tokenized with the zoo's
# tokenizer (text the target reads like its training data, but not from it), fixed in
# bench/plugin_zoo_prompts.json.
ZOO = os.environ.get("TFM_E2E_ZOO")
if ZOO:
    ZOO = str(Path(ZOO).resolve())
    TARGET, DRAFTER = Path(ZOO) / "target", Path(ZOO) / "drafter"
    VOCAB = json.loads((TARGET / "config.json").read_text())["vocab_size"]
    HIDDEN = json.loads((TARGET / "config.json").read_text())["hidden_size"]
    os.environ.setdefault("TFM_E2E_BLOCK", str(json.loads((DRAFTER / "config.json").read_text())["block_size"]))
SOURCE_TARGET = TARGET  # what make writes (or the zoo's); TARGET is what the engines load
if VL or SSM_DTYPE:
    TARGET = ROOT / (("target-vl" if VL else "target-text") + (f"-ssm-{SSM_DTYPE}" if SSM_DTYPE else ""))
# Size of the run, from the environment (defaults: the quick smoke run):
#   TFM_E2E_PROMPTS (8), TFM_E2E_MAX_TOKENS (32), TFM_E2E_BUDGET (7), TFM_E2E_BLOCK (8),
#   TFM_E2E_DTYPE (float32), TFM_E2E_MAX_SEQS (16: the engine's batch), TFM_E2E_CASES (all; a
#   comma list of case names from CASES), TFM_E2E_DRAFT_QUANTIZATION (none; "fp8": the speculative config's
#   quantization, the DFlash drafter's layers in FP8, bfloat16/float16 only; with VLLM_TFM_DRAFT_LM_HEAD=fp8 its
#   logits too; with VLLM_TFM_DRAFT_VOCAB=FILE [VLLM_TFM_DRAFT_VOCAB_SIZE=N] from a draft vocabulary; with
#   VLLM_TFM_WEAVER_WEIGHTS=fp8 the Weaver's projections on e4m3 rows: the drafts change, the tokens must not).
BUDGET = int(os.environ.get("TFM_E2E_BUDGET", "7"))
BLOCK = int(os.environ.get("TFM_E2E_BLOCK", "8"))
MAX_TOKENS = int(os.environ.get("TFM_E2E_MAX_TOKENS", "32"))
DTYPE = os.environ.get("TFM_E2E_DTYPE", "float32")
DRAFT_QUANTIZATION = os.environ.get("TFM_E2E_DRAFT_QUANTIZATION") or None
MAX_SEQS = int(os.environ.get("TFM_E2E_MAX_SEQS", "16"))
_N_PROMPTS = int(os.environ.get("TFM_E2E_PROMPTS", "8"))
PROMPT_LENS = [5, 9, 17, 33, 3, 12, 64, 7][:_N_PROMPTS] + [
    random.Random(99 + i).randint(1, 100) for i in range(max(0, _N_PROMPTS - 8))]
DEADLINE_S = float(os.environ.get("TFM_E2E_DEADLINE_S", "400"))  # whole run, from the first phase
CONTROL = [c for c in os.environ.get("TFM_E2E_CONTROL", "" if DTYPE == "float32" else "shuffled,alone").split(",") if c]
if set(CONTROL) - {"shuffled", "alone"}:
    raise SystemExit(f"TFM_E2E_CONTROL={','.join(CONTROL)}: the controls are 'shuffled' and 'alone'")


def log(*args: object) -> None:
    print(f"[tfm-e2e {time.time() - T0:7.1f}s]", *args, flush=True)


PROMPT_FILE = REPO / "bench" / "plugin_zoo_prompts.json"


def prompts() -> list[list[int]]:
    """Random token ids of PROMPT_LENS for the random models; with TFM_E2E_ZOO the first
    TFM_E2E_PROMPTS of the fixed zoo prompts (``bench/plugin_zoo_prompts.json``, drawn by
    :func:`draw_zoo_prompts` at one commit: drawn from the live source files, they changed with
    every edit of those files, and the acceptance with them)."""
    if not ZOO:
        rng = random.Random(1234)
        return [[rng.randrange(2, VOCAB - 2) for _ in range(n)] for n in PROMPT_LENS]
    fixed = json.loads(PROMPT_FILE.read_text())["prompts"]
    if len(PROMPT_LENS) > len(fixed):
        raise SystemExit(f"TFM_E2E_PROMPTS={len(PROMPT_LENS)}: {PROMPT_FILE.name} holds {len(fixed)} prompts")
    return fixed[: len(PROMPT_LENS)]


def draw_zoo_prompts() -> list[list[int]]:
    """How ``bench/plugin_zoo_prompts.json`` was drawn (windows of PROMPT_LENS token ids of this
    repository's Python files over 4,000 bytes, zoo tokenizer, random.Random(1234))."""
    rng = random.Random(1234)
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(SOURCE_TARGET / "tokenizer.json"))
    texts = [p.read_text() for p in sorted((REPO / "vllm_tfm").rglob("*.py")) if p.stat().st_size > 4000]
    out = []
    for i, n in enumerate(PROMPT_LENS):
        ids = tok.encode(texts[i % len(texts)], add_special_tokens=False).ids
        start = rng.randrange(0, max(1, len(ids) - n))
        out.append(ids[start : start + n])
    return out


# ---------------------------------------------------------------------------------------- make
def phase_make() -> None:
    if ZOO:
        log("TFM_E2E_ZOO:", ZOO, "(trained zoo; no models to make)")
    else:
        make_random_models()
    if TARGET != SOURCE_TARGET:
        bench = str(Path(__file__).resolve().parent)
        if bench not in sys.path:
            sys.path.insert(0, bench)
        from vl_checkpoint import prepare_target

        info = prepare_target(SOURCE_TARGET, TARGET, vl=VL, ssm_dtype=SSM_DTYPE)
        (ROOT / "prepared_target.json").write_text(json.dumps(info))
        log("target prepared:", info)


def make_random_models() -> None:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from vllm_tfm.models.dflash import DFlashConfig, DFlashDrafter
    from vllm_tfm.models.tfm_config import WeaverConfig
    from vllm_tfm.models.weaver import Weaver
    from vllm_tfm.reference.toy_targets import randomize_

    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=1024, num_hidden_layers=8,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4,
        linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
        linear_conv_kernel_dim=4, max_position_embeddings=4096, eos_token_id=1, bos_token_id=0,
        pad_token_id=0, tie_word_embeddings=False, torch_dtype="float32")
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(cfg)
    randomize_(model, seed=0)  # unit-scale weights: decisive argmax (few near-ties)
    model.float().save_pretrained(SOURCE_TARGET)
    log("target written:", SOURCE_TARGET, f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params",
        "layer types:", getattr(cfg, "layer_types", None))

    torch.manual_seed(1)
    dcfg = DFlashConfig.create(
        hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
        intermediate_size=1024, vocab_size=VOCAB, target_layer_ids=[1, 3, 5], mask_token_id=VOCAB - 1,
        block_size=BLOCK, rope_theta=10_000_000.0, dtype="float32")
    DFlashDrafter(dcfg).float().save_pretrained(DRAFTER)
    torch.manual_seed(2)
    wcfg = WeaverConfig(d_model=HIDDEN, d_rank=64, n_layers=1, n_heads=2, d_mlp=128, max_depth=BLOCK - 1)
    Weaver(wcfg).float().save_pretrained(DRAFTER)  # also writes tfm_config.json (proposal "tfm")
    from vllm_tfm.models.tfm_config import TreeFlashConfig
    from vllm_tfm.models.treeflash import TreeFlashApproximator

    torch.manual_seed(3)
    tf = TreeFlashApproximator(TreeFlashConfig(hidden_size=HIDDEN, intermediate_size=256))
    torch.nn.init.normal_(tf.down.weight, std=0.02)  # a non-zero correction (zero-init is the identity)
    tf.float().save_pretrained(DRAFTER)  # adds the treeflash section (proposal stays "tfm")
    log("drafter written:", DRAFTER, sorted(os.listdir(DRAFTER)))


# ---------------------------------------------------------------------------------------- engine
def load_plugin() -> dict:
    """Register vllm-tfm in this process (the entry point does it too when the package is installed)."""
    info: dict = {}
    try:
        import vllm_tfm

        vllm_tfm.register()
        info["register"] = "vllm_tfm.register()"
    except Exception as e:  # noqa: BLE001 - report and fall back so the run still says something
        info["register_error"] = f"{type(e).__name__}: {e}"
        log("vllm_tfm.register() failed:", info["register_error"])
        traceback.print_exc()
    from vllm_tfm.vllm_plugin import runtime

    runtime.install()
    info["runtime_installed"] = runtime.is_installed()
    from vllm import ModelRegistry

    reg = ModelRegistry.models.get("Qwen3_5ForCausalLM")
    info["Qwen3_5ForCausalLM"] = repr(reg)
    if reg is None or "qwen3_5" in repr(reg).lower() and "tfm" not in repr(reg).lower() and "tiny" not in repr(reg).lower():
        sys.path.insert(0, str(REPO / ".gpu-bundle"))
        import tiny_hybrid

        tiny_hybrid.register()
        info["Qwen3_5ForCausalLM"] = "tiny_hybrid (bundle) " + repr(ModelRegistry.models.get("Qwen3_5ForCausalLM"))
    log("plugin:", info)
    return info


def engine_kwargs(spec: bool) -> dict:
    kw = dict(
        model=str(TARGET), dtype=DTYPE, skip_tokenizer_init=True, enforce_eager=True, seed=0,
        gpu_memory_utilization=0.3, max_model_len=1024, max_num_seqs=MAX_SEQS, enable_prefix_caching=False,
        attention_backend="TRITON_ATTN", compilation_config={"custom_ops": ["none"]},
        additional_config={"gdn_prefill_backend": "triton"}, disable_log_stats=False,
    )
    if VL:  # text-only prompts: no vision encoder, no multimodal profiling (the tower's weights are skipped)
        kw["limit_mm_per_prompt"] = {"image": 0, "video": 0}
    if os.environ.get("TFM_E2E_KV_BYTES"):  # fixed KV cache: no memory profiling (GPU shared with other jobs)
        kw["kv_cache_memory_bytes"] = int(float(os.environ["TFM_E2E_KV_BYTES"]))
    if spec:
        kw["speculative_config"] = {"method": "tfm", "model": str(DRAFTER), "num_speculative_tokens": BUDGET,
                                    "attention_backend": "TRITON_ATTN"}
        if DRAFT_QUANTIZATION:
            kw["speculative_config"]["quantization"] = DRAFT_QUANTIZATION
    return kw


def generate(llm, prompt_list: list[list[int]], logprobs: int | None = None) -> list[dict]:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, detokenize=False,
                            logprobs=logprobs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_list], params, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        item = {"tokens": list(c.token_ids)}
        if logprobs:
            margins = []
            for pos in c.logprobs or []:
                vals = sorted((lp.logprob for lp in pos.values()), reverse=True)
                margins.append(vals[0] - vals[1] if len(vals) > 1 else None)
            item["margins"] = margins
        res.append(item)
    return res


# ---------------------------------------------------------------------------------------- sampling
# Optional (TFM_E2E_SAMPLING=1; off by default): speculation must leave the output DISTRIBUTION
# unchanged. Each arm draws TFM_E2E_SAMPLES (2000) samples of the first 2 generated tokens of
# prompt 0 at temperature 1.0, one request per sample with its own seed, all in ONE generate call;
# a two-sample chi-square homogeneity test over the joint (token1, token2) categories (rare ones
# pooled into "other") compares it with the no-spec samples; p >= SAMPLING_ALPHA reads ok. The
# seeds are fixed (a distinct range per arm, so the arms are independent draws): the verdict is
# deterministic for a given build. A sanity arm (no-spec at temperature 0.7 vs 1.0, baseline phase)
# must FAIL, showing the test has power at this sample size.
SAMPLING = os.environ.get("TFM_E2E_SAMPLING", "0") == "1"
N_SAMPLES = int(os.environ.get("TFM_E2E_SAMPLES", "2000"))
SAMPLING_ALPHA = 0.001
SAMPLING_ARMS = ("ddtree", "tfm")  # tfm-engine proposals checked against the no-spec samples
SAMPLING_SEEDS = {"nospec_t1.0": 0, "nospec_t0.7": 1_000_000, "ddtree": 2_000_000, "tfm": 3_000_000}


def sample_pairs(llm, prompt: list[int], temperature: float, seed0: int) -> list[list[int]]:
    """N_SAMPLES generations of 2 tokens of ``prompt`` (request i seeded seed0 + i), one generate call."""
    from vllm import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=2, ignore_eos=True, detokenize=False,
                             seed=seed0 + i) for i in range(N_SAMPLES)]
    outs = llm.generate([{"prompt_token_ids": prompt} for _ in range(N_SAMPLES)], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def pair_test(ref: list[list[int]], got: list[list[int]]) -> dict:
    """Chi-square homogeneity of the (token1, token2) samples ``got`` vs ``ref`` (bench/chisquare.py)."""
    bench = str(Path(__file__).resolve().parent)
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from chisquare import homogeneity_test

    return homogeneity_test([tuple(x) for x in ref], [tuple(x) for x in got])


def first_token_top20(llm, prompt: list[int]) -> list[list[float]]:
    """[token, probability] of the 20 most likely first tokens of ``prompt`` (no-spec, temperature 1.0)."""
    import math

    from vllm import SamplingParams

    params = SamplingParams(temperature=1.0, max_tokens=1, ignore_eos=True, detokenize=False, logprobs=20, seed=0)
    pos = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].outputs[0].logprobs[0]
    top = sorted(((tok, lp.logprob) for tok, lp in pos.items()), key=lambda x: -x[1])[:20]
    return [[tok, math.exp(lp)] for tok, lp in top]


def sampling_line(name: str, r: dict) -> str:
    return (f"sampling {name:12s}: p={r.get('p_value', float('nan')):.3g} chi2={r.get('statistic', float('nan')):.1f} "
            f"dof={r.get('dof')} categories={len(r.get('categories', []))} n={r.get('n_a')}/{r.get('n_b')} "
            f"expect={r.get('expect')} ok={r.get('ok')} {r.get('seconds', '-')}s {r.get('error', '')}")


def baseline_sampling(llm, out: Path, prompt: list[int]) -> None:
    """No-spec samples at temperature 1.0 (the reference) and the 0.7 sanity arm -> OUT/sampling_baseline.json."""
    res: dict = {"prompt": prompt, "samples": N_SAMPLES, "alpha": SAMPLING_ALPHA, "seeds": SAMPLING_SEEDS}
    try:
        res["first_token_top20"] = first_token_top20(llm, prompt)
    except Exception as e:  # noqa: BLE001 - a reference only
        res["first_token_top20"] = f"{type(e).__name__}: {e}"
    t = time.time()
    res["nospec_t1.0"] = sample_pairs(llm, prompt, 1.0, SAMPLING_SEEDS["nospec_t1.0"])
    res["seconds"] = round(time.time() - t, 2)
    t = time.time()
    cold = sample_pairs(llm, prompt, 0.7, SAMPLING_SEEDS["nospec_t0.7"])
    sanity = pair_test(res["nospec_t1.0"], cold)
    sanity.update(expect="different", ok=sanity["p_value"] < SAMPLING_ALPHA, seconds=round(time.time() - t, 2),
                  temperature=0.7)
    res["sanity_t0.7"] = sanity
    log(f"sampling no-spec t=1.0: {N_SAMPLES} samples in {res['seconds']}s; "
        f"top first-token probabilities {res['first_token_top20'][:4] if isinstance(res['first_token_top20'], list) else res['first_token_top20']}")
    log(sampling_line("nospec_t0.7", sanity))
    (out / "sampling_baseline.json").write_text(json.dumps(res))


def tfm_sampling(llm, out: Path, oracle) -> dict:
    """The ddtree and tfm arms on the tfm engine, each tested against the no-spec samples."""
    from vllm_tfm.vllm_plugin import runtime
    from vllm_tfm.vllm_plugin.runtime.settings import set_proposal_override
    from vllm_tfm.vllm_plugin.runtime.state import STATE

    path = out / "sampling_baseline.json"
    if not path.is_file():
        return {"error": f"{path} missing: the baseline phase ran without TFM_E2E_SAMPLING=1 or failed"}
    base = json.loads(path.read_text())
    res = {k: base.get(k) for k in ("prompt", "samples", "alpha", "seeds", "first_token_top20")}
    res["baseline_seconds"] = base.get("seconds")
    res["arms"] = {"nospec_t0.7": base["sanity_t0.7"]}
    for proposal in SAMPLING_ARMS:
        arm: dict = {"proposal": proposal, "expect": "same", "temperature": 1.0}
        res["arms"][proposal] = arm
        set_proposal_override(proposal)
        os.environ["VLLM_TFM_FORCE_TREE_PATH"] = "0"
        oracle.mode = None
        if STATE.metrics is not None:
            STATE.metrics.reset()
        before = spec_counters(llm)
        t = time.time()
        try:
            got = sample_pairs(llm, base["prompt"], 1.0, SAMPLING_SEEDS[proposal])
            arm.update(pair_test(base["nospec_t1.0"], got))
            arm["ok"] = arm["p_value"] >= SAMPLING_ALPHA
            t2 = pair_test([x[1:] for x in base["nospec_t1.0"]], [x[1:] for x in got])  # diagnostic only:
            arm["token2_marginal"] = {k: t2[k] for k in ("statistic", "dof", "p_value")}  # rare pairs pool to "other"
        except Exception as e:  # noqa: BLE001
            arm["error"] = f"{type(e).__name__}: {e}"
            arm["traceback"] = traceback.format_exc()
            print(arm["traceback"], flush=True)
            abort_all(llm)
        arm["seconds"] = round(time.time() - t, 2)
        arm["tree_metrics"] = runtime.snapshot_metrics()
        arm["spec_counters"] = diff_counters(before, spec_counters(llm))
        log(sampling_line(proposal, arm))
    set_proposal_override(None)
    return res


def phase_baseline(out: Path) -> None:
    info = load_plugin()
    from vllm import LLM

    t = time.time()
    llm = LLM(**engine_kwargs(spec=False))
    log(f"baseline engine up in {time.time() - t:.0f}s")
    ps = prompts()
    t = time.time()
    b8 = generate(llm, ps, logprobs=2)
    b1 = generate(llm, ps[:1], logprobs=2)
    log(f"baseline generated in {time.time() - t:.1f}s")
    base = {"prompts": ps, "b8": b8, "b1": b1, "plugin": info}
    (out / "baseline.json").write_text(json.dumps(base))
    if CONTROL:
        base["control"] = nospec_control(llm, ps, [item["tokens"] for item in b8])
        (out / "baseline.json").write_text(json.dumps(base))
    for i, item in enumerate(b8):
        m = [x for x in item["margins"] if x is not None]
        log(f"baseline prompt {i}: {item['tokens'][:12]}... min top-2 margin {min(m):.3g}")
    if SAMPLING:
        try:
            baseline_sampling(llm, out, ps[0])
        except Exception as e:  # noqa: BLE001 - the greedy baseline above stays usable
            log("sampling baseline FAILED:", f"{type(e).__name__}: {e}")
            traceback.print_exc()


def nospec_control(llm, ps: list[list[int]], b8_tokens: list[list[int]]) -> dict:
    """No-spec again, in a shuffled batch order and/or each prompt alone, vs the batch-8 run."""
    bench = str(Path(__file__).resolve().parent)
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from e2e_controls import compare_runs, control_orders

    res: dict = {}
    for kind in CONTROL:
        t = time.time()
        if time.time() - T0 > DEADLINE_S - 250:  # leave the tfm phase its time
            res[kind] = {"skipped": "time budget"}
            continue
        try:
            if kind == "shuffled":
                order = control_orders(len(ps))
                got = generate(llm, [ps[i] for i in order])
                toks: list = [None] * len(ps)
                for pos, i in enumerate(order):
                    toks[i] = got[pos]["tokens"]
                res[kind] = {"order": order, **compare_runs(b8_tokens, toks)}
            else:  # each prompt alone, as many as the time budget allows (compared over those)
                toks = []
                for p in ps:
                    if time.time() - T0 > DEADLINE_S - 200:
                        break
                    toks.append(generate(llm, [p])[0]["tokens"])
                res[kind] = compare_runs(b8_tokens[: len(toks)], toks)
                if len(toks) < len(ps):
                    res[kind]["partial"] = f"{len(toks)} of {len(ps)} prompts (time budget)"
        except Exception as e:  # noqa: BLE001 - the greedy baseline stays usable
            res[kind] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        res[kind]["seconds"] = round(time.time() - t, 2)
        log(f"no-spec control {kind}:", {k: v for k, v in res[kind].items() if k not in ("order", "traceback")})
    return res


# ---------------------------------------------------------------------------------------- GPU units
def check_tree_attention(device: str = "cuda") -> dict:
    """masked_tree_attention (one unified_attention call per tree, qq_bias mask) vs torch."""
    import torch
    from types import SimpleNamespace

    from vllm_tfm.tree.types import ancestor_mask
    from vllm_tfm.vllm_plugin.runtime.attention import masked_tree_attention
    from vllm_tfm.vllm_plugin.runtime.inputs import ancestor_bias

    g = torch.Generator(device="cpu").manual_seed(0)
    heads, kv_heads, hs, bs, nblocks = 8, 2, 64, 16, 32
    parents_list = [[-1, 0, 0, 1, 1, 2, 5, 0], [-1, 0, 1, 0, 3, 3, 1, 6]]
    ctx_lens = [37, 20]
    kv = torch.randn(nblocks, kv_heads, bs, 2 * hs, generator=g).to(device)
    block_table = torch.zeros(2, 8, dtype=torch.int32)
    perm = torch.randperm(nblocks, generator=g)
    for r in range(2):
        block_table[r] = perm[r * 8:(r + 1) * 8].to(torch.int32)
    block_table = block_table.to(device)
    n = [len(p) for p in parents_list]
    seq_lens = torch.tensor([c + k for c, k in zip(ctx_lens, n)], dtype=torch.int32, device=device)
    q = torch.randn(sum(n), heads, hs, generator=g).to(device)
    out = torch.zeros_like(q)
    trees, start = [], 0
    for r, p in enumerate(parents_list):
        trees.append(SimpleNamespace(req_index=r, start=start, n=n[r], bias=ancestor_bias(p, device),
                                     cu_q=torch.tensor([0, n[r]], dtype=torch.int32, device=device)))
        start += n[r]
    impl = SimpleNamespace(kv_cache_dtype="auto", _is_per_token_head_quant=False, head_size=hs, scale=hs ** -0.5,
                           sliding_window=(-1, -1), logits_soft_cap=0, alibi_slopes=None, use_alibi_sqrt=False,
                           sinks=None, chunk_lookback=-1, use_td=False)
    layer = SimpleNamespace(_k_scale=torch.ones(1, device=device), _v_scale=torch.ones(1, device=device))
    md = SimpleNamespace(seq_lens=seq_lens, block_table=block_table, max_seq_len=int(seq_lens.max()))
    masked_tree_attention(impl, layer, q, kv, md, out, trees)
    err = 0.0
    for r, p in enumerate(parents_list):
        slots = [int(block_table[r, t // bs]) * bs + t % bs for t in range(int(seq_lens[r]))]
        kvr = kv.permute(0, 2, 1, 3).reshape(-1, kv_heads, 2 * hs)[slots]  # [S, kvh, 2hs]
        k, v = kvr[..., :hs], kvr[..., hs:]
        anc = ancestor_mask(torch.tensor(p))
        for i in range(n[r]):
            keys = list(range(ctx_lens[r])) + [ctx_lens[r] + j for j in range(n[r]) if anc[i, j]]
            qi = q[trees[r].start + i]  # [heads, hs]
            kk = k[keys].repeat_interleave(heads // kv_heads, dim=1)  # [S', heads, hs]
            vv = v[keys].repeat_interleave(heads // kv_heads, dim=1)
            w = torch.softmax(torch.einsum("hd,shd->hs", qi, kk) * hs ** -0.5, dim=-1)
            ref = torch.einsum("hs,shd->hd", w, vv)
            err = max(err, float((out[trees[r].start + i] - ref).abs().max()))
    return {"max_abs_err": err, "ok": err < 1e-2}  # TF32 dots inside the kernel; a mask bug is O(0.1)


def check_gdn_step(device: str = "cuda") -> dict:
    """spec_tree_gdn + commit on CUDA float32 vs the same on CPU float64 (kernels or references)."""
    import torch

    from vllm_tfm.vllm_plugin.runtime.commit import commit_gdn_layer
    from vllm_tfm.vllm_plugin.runtime.gdn import spec_tree_gdn
    from vllm_tfm.vllm_plugin.runtime.kernels_or_reference import kernels_in_use

    H, K, HV, V, W, S = 4, 64, 8, 64, 4, BUDGET
    D = 2 * H * K + HV * V
    g = torch.Generator().manual_seed(0)
    parents = torch.tensor([-1, 0, 0, 1, 1, 2, 5, 0, -1, 0, 1, 2, 3, 4, 5, 6])
    cu = torch.tensor([0, 8, 16])
    t = parents.numel()
    slots = torch.tensor([[3, 5, 7, 9, 11, 13, 15, 17], [2, 4, 6, 8, 10, 12, 14, 16]], dtype=torch.int32)
    prev = torch.tensor([1, 3], dtype=torch.int32)
    args64 = dict(
        x=torch.randn(t, D, generator=g, dtype=torch.float64), a=torch.randn(t, HV, generator=g, dtype=torch.float64),
        b=torch.randn(t, HV, generator=g, dtype=torch.float64),
        conv=torch.randn(20, W - 1 + S, D, generator=g, dtype=torch.float64).transpose(-1, -2),
        ssm=0.1 * torch.randn(20, HV, V, K, generator=g, dtype=torch.float64),
        w=0.3 * torch.randn(D, W, generator=g, dtype=torch.float64),
        A_log=torch.rand(HV, generator=g, dtype=torch.float64).log(), dt=torch.randn(HV, generator=g, dtype=torch.float64))

    def run(dev: str, dtype: torch.dtype):
        a = {k: v.to(dev, dtype) for k, v in args64.items()}
        conv = a["conv"].clone()
        ssm = a["ssm"].clone()
        o, stash = spec_tree_gdn(a["x"], a["a"], a["b"], parents.to(dev), cu.to(dev), conv, ssm, slots.to(dev),
                                 prev.to(dev), a["w"], None, "silu", a["A_log"], a["dt"], H, K, HV, V)
        commit_gdn_layer(stash, parents.to(dev), cu.to(dev), torch.tensor([6, 5], device=dev),
                         torch.tensor([3, 5], device=dev))
        return o.double().cpu(), conv.double().cpu(), ssm.double().cpu()

    ref = run("cpu", torch.float64)
    got = run(device, torch.float32)
    errs = {name: float((x - y).abs().max() / (y.abs().max() + 1e-12)) for name, x, y in zip(("out", "conv", "ssm"), got, ref)}
    return {"rel_err": errs, "ok": all(e < 1e-3 for e in errs.values()), "ops": kernels_in_use()}


def check_ddtree_device(device: str = "cuda") -> dict:
    import torch

    from vllm_tfm.vllm_plugin.runtime.tree_builder_gpu import ddtree_trees

    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(3 * torch.randn(8, BLOCK - 1, VOCAB, generator=g), -1)
    cpu = ddtree_trees(lp, BUDGET)
    dev = ddtree_trees(lp.to(device), BUDGET)
    same = all(torch.equal(a, b.cpu()) for a, b in zip(cpu, dev))
    return {"ok": same}


# ---------------------------------------------------------------------------------------- oracle
class Oracle:
    """Bench-only: plants the baseline continuation on a random branch of each proposed tree."""

    def __init__(self, baseline: dict) -> None:
        self.by_prompt = {}
        for key in ("b8", "b1"):
            ps = baseline["prompts"] if key == "b8" else baseline["prompts"][:1]
            for p, item in zip(ps, baseline[key]):
                self.by_prompt.setdefault(tuple(p), item["tokens"])
        self.mode: str | None = None
        self.rng = random.Random(7)
        self.planted = 0

    def install(self) -> None:
        from vllm_tfm.vllm_plugin.runtime.proposer import TFMProposer

        orig = TFMProposer._build
        oracle = self

        def _build(proposer, proposal, logits, root_tokens, budget, depth, num_rejected):
            tokens, parents = orig(proposer, proposal, logits, root_tokens, budget, depth, num_rejected)
            if oracle.mode is None:
                return tokens, parents
            return oracle.plant(proposer._tfm_runner, tokens, parents, root_tokens, num_rejected)

        TFMProposer._build = _build

    def plant(self, runner, tokens, parents, root_tokens, num_rejected):
        from vllm_tfm.vllm_plugin.runtime.state import STATE

        step = STATE.step
        tok, par = tokens.cpu().clone(), parents.cpu()
        roots = root_tokens.tolist()
        if step is not None and step.tree_active and step.accept is not None:
            acc = step.accept.num_accepted.tolist()
        elif num_rejected is not None and step is not None:
            acc = (step.num_draft - num_rejected.cpu().numpy()).tolist()
        else:
            acc = [0] * len(roots)
        for r, rid in enumerate(runner.input_batch.req_ids[: len(roots)]):
            st = runner.requests.get(rid)
            full = None if st is None else self.by_prompt.get(tuple(st.prompt_token_ids))
            if full is None:
                continue
            root_idx = len(st.output_token_ids) + int(acc[r])
            if root_idx >= len(full) or full[root_idx] != roots[r]:
                continue  # already diverged: nothing to plant
            expected = full[root_idx + 1: root_idx + 1 + tok.shape[1]]
            node = tok.shape[1] if self.mode == "full" else self.rng.randrange(1, tok.shape[1] + 1)
            path = []
            while node > 0:
                path.append(node)
                node = int(par[r, node])
            path.reverse()
            k = len(path) if self.mode == "full" else self.rng.randrange(0, len(path) + 1)
            for i in range(min(k, len(expected))):
                tok[r, path[i] - 1] = expected[i]
                self.planted += 1
        return tok.to(tokens.device), parents


# ---------------------------------------------------------------------------------------- tfm
CASES = [
    # name, proposal, force tree path, oracle mode; in order of diagnostic value (the time budget
    # may cut the tail): each row adds one mechanism to the one before
    ("chain-native", "chain", False, None),  # TFMProposer only; vLLM verifies chains natively
    ("chain-forced", "chain", True, None),  # + tree sampler, GDN tree verify/commit, depth positions
    ("chain-forced-oracle", "chain", True, "partial"),  # + deep acceptance through our GDN commit
    ("ddtree", "ddtree", False, None),  # + ancestor-masked attention, real trees, KV compaction
    ("ddtree-oracle", "ddtree", False, "partial"),  # + accepted non-first branches, drafter reorder
    ("chain-native-oracle", "chain", False, "full"),  # sanity of the oracle itself on vLLM's path
    ("tfm", "tfm", False, None),  # Weaver trees
    ("treeflash", "treeflash", False, None),  # TreeFlash trees (AR approximator on the DFlash pre-norm stream)
    ("tfm-oracle", "tfm", False, "partial"),
]


def first_divergence(ref: dict, got: list[int]) -> dict | None:
    exp = ref["tokens"]
    for i, (a, b) in enumerate(zip(exp, got)):
        if a != b:
            lo = max(0, i - 3)
            return {"pos": i, "expected": exp[lo:i + 4], "got": got[lo:i + 4], "from": lo,
                    "baseline_top2_margin": (ref.get("margins") or [None] * (i + 1))[i]}
    if len(exp) != len(got):
        return {"pos": min(len(exp), len(got)), "len_expected": len(exp), "len_got": len(got)}
    return None


def spec_counters(llm) -> dict:
    out: dict = {}
    try:
        for m in llm.get_metrics():
            if m.name.startswith("vllm:spec_decode"):
                out[m.name] = list(m.values) if hasattr(m, "values") and isinstance(m.values, list) else getattr(m, "value", None)
    except Exception as e:  # noqa: BLE001
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def diff_counters(a: dict, b: dict) -> dict:
    res = {}
    for k, v in b.items():
        u = a.get(k)
        if isinstance(v, list) and isinstance(u, list):
            res[k] = [x - (u[i] if i < len(u) else 0) for i, x in enumerate(v)]
        elif isinstance(v, (int, float)) and isinstance(u, (int, float)):
            res[k] = v - u
        else:
            res[k] = v
    return res


def abort_all(llm) -> None:
    try:
        ids = list(llm.llm_engine.output_processor.request_states.keys())
        if ids:
            llm.llm_engine.abort_request(ids)
            log("aborted leftover requests:", ids)
    except Exception as e:  # noqa: BLE001
        log("could not abort leftover requests:", e)


def phase_tfm(out: Path) -> None:
    import torch

    results: dict = {"command": "bash bench/run_gpu_plugin.sh", "env": {}, "units": {}, "cases": []}
    res_path = out / "results.json"

    def save() -> None:
        res_path.write_text(json.dumps(results, indent=1, default=str))

    bench = str(Path(__file__).resolve().parent)
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from e2e_controls import ReferenceCounter, gdn_path, overlap_with_control

    refs = ReferenceCounter()
    refs.install()  # before the runtime resolves its GDN operations
    results["env"]["torch"] = torch.__version__
    results["env"]["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    results["plugin"] = load_plugin()
    import vllm

    results["env"]["vllm"] = vllm.__version__
    results["env"]["triton_f32_default"] = os.environ.get("TRITON_F32_DEFAULT")  # run_gpu_plugin.sh: ieee in float32
    for name, fn in (("tree_attention", check_tree_attention), ("gdn_step", check_gdn_step),
                     ("ddtree_device", check_ddtree_device)):
        t = time.time()
        try:
            results["units"][name] = fn("cuda")
        except Exception as e:  # noqa: BLE001
            results["units"][name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        results["units"][name]["seconds"] = round(time.time() - t, 2)
        log(f"unit {name}:", {k: v for k, v in results["units"][name].items() if k != "traceback"})
        if "traceback" in results["units"][name]:
            print(results["units"][name]["traceback"], flush=True)
    from vllm_tfm.vllm_plugin.runtime.kernels_or_reference import set_kernels_enabled

    gdn_unit = results["units"]["gdn_step"]
    if not gdn_unit.get("ok") and "kernels" in (gdn_unit.get("ops") or {}).values():
        set_kernels_enabled(False)  # keep the e2e about the hooks: use the torch references
        results["units"]["gdn_step_references"] = check_gdn_step("cuda")
        results["env"]["kernels_disabled"] = "the GDN kernel check failed; running on the torch references"
        log("GDN kernels disabled:", results["units"]["gdn_step_references"])
    save()

    baseline = json.loads((out / "baseline.json").read_text())
    if "control" in baseline:
        results["nospec_control"] = baseline["control"]
    prepared = ROOT / "prepared_target.json"
    results["target"] = json.loads(prepared.read_text()) if TARGET != SOURCE_TARGET and prepared.is_file() else {
        "directory": str(TARGET)}
    results["target"]["config_architecture"] = json.loads((TARGET / "config.json").read_text())["architectures"][0]
    from vllm import LLM

    from vllm_tfm.vllm_plugin import runtime
    from vllm_tfm.vllm_plugin.runtime.kernels_or_reference import kernels_in_use
    from vllm_tfm.vllm_plugin.runtime.settings import set_proposal_override
    from vllm_tfm.vllm_plugin.runtime.state import STATE

    wanted_cases = [c for c in os.environ.get("TFM_E2E_CASES", "").split(",") if c]
    if not wanted_cases or any(c.startswith("treeflash") for c in wanted_cases):
        # the treeflash case switches this engine's proposal in-process: load TreeFlash beside the Weaver
        os.environ["VLLM_TFM_LOAD_TREEFLASH"] = "1"
    results["env"]["load_treeflash"] = os.environ.get("VLLM_TFM_LOAD_TREEFLASH")
    t = time.time()
    try:
        llm = LLM(**engine_kwargs(spec=True))
    except Exception as e:  # noqa: BLE001
        results["engine_error"] = f"{type(e).__name__}: {e}"
        results["engine_traceback"] = traceback.format_exc()
        log("tfm engine FAILED:", results["engine_error"])
        print(results["engine_traceback"], flush=True)
        save()
        return
    results["engine_start_s"] = round(time.time() - t, 1)
    log(f"tfm engine up in {results['engine_start_s']}s; settings:", STATE.settings)
    results["env"]["ops"] = kernels_in_use()
    if STATE.metrics is not None:
        STATE.metrics.profile = True  # per-stage timings include the device work
    results["env"]["target_attn_layers"] = sorted(STATE.target_attn_layers)
    try:
        mc = llm.llm_engine.vllm_config.model_config
        cc = llm.llm_engine.vllm_config.cache_config
        results["env"]["model"] = {"architecture": mc.architecture, "is_hybrid": mc.is_hybrid,
                                   "is_multimodal_model": mc.is_multimodal_model, "uses_mrope": mc.uses_mrope,
                                   "mamba_ssm_cache_dtype": str(cc.mamba_ssm_cache_dtype),
                                   "mamba_cache_dtype": str(cc.mamba_cache_dtype)}
    except Exception as e:  # noqa: BLE001 - a record only
        results["env"]["model"] = {"error": f"{type(e).__name__}: {e}"}
    log("target model:", results["env"]["model"])
    oracle = Oracle(baseline)
    oracle.install()
    ps = baseline["prompts"]
    wanted = [c for c in os.environ.get("TFM_E2E_CASES", "").split(",") if c]
    results["size"] = {"prompts": len(ps), "max_tokens": MAX_TOKENS, "budget": BUDGET, "block": BLOCK,
                       "dtype": DTYPE, "max_num_seqs": MAX_SEQS, "models": f"zoo {ZOO}" if ZOO else "random",
                       "vl": VL, "ssm_dtype": SSM_DTYPE, "control": CONTROL}
    variant = ("TFM_E2E_VL=1 " if VL else "") + (f"TFM_E2E_SSM_DTYPE={SSM_DTYPE} " if SSM_DTYPE else "") + (
        f"TFM_E2E_CONTROL={','.join(CONTROL)} " if CONTROL else "") + (
        f"TFM_E2E_DRAFT_QUANTIZATION={DRAFT_QUANTIZATION} " if DRAFT_QUANTIZATION else "") + "".join(
        f"{k}={v} " for k, v in sorted(os.environ.items())
        if k in ("VLLM_TFM_DRAFT_LM_HEAD", "VLLM_TFM_DRAFT_VOCAB", "VLLM_TFM_DRAFT_VOCAB_SIZE", "VLLM_TFM_WEAVER_WEIGHTS"))
    results["command"] = variant + ("TFM_E2E_ZOO=zoo " if ZOO else "") + ("TFM_E2E_PROMPTS={} TFM_E2E_MAX_TOKENS={} TFM_E2E_BUDGET={} TFM_E2E_BLOCK={} "
                          "TFM_E2E_DTYPE={} TFM_E2E_MAX_SEQS={} TFM_E2E_CASES={} bash bench/run_gpu_plugin.sh").format(
        len(ps), MAX_TOKENS, BUDGET, BLOCK, DTYPE, MAX_SEQS, ",".join(wanted) or "all")
    if SAMPLING:
        results["command"] = f"TFM_E2E_SAMPLING=1 TFM_E2E_SAMPLES={N_SAMPLES} " + results["command"]
        results["sampling"] = tfm_sampling(llm, out, oracle)
        save()
    for name, proposal, force, mode in CASES:
        if wanted and name not in wanted:
            continue
        for batch in ("b8", "b1"):
            case = {"case": name, "batch": batch, "proposal": proposal, "force_tree_path": force, "oracle": mode}
            results["cases"].append(case)
            if time.time() - T0 > DEADLINE_S:
                case["skipped"] = "time budget"
                save()
                continue
            set_proposal_override(proposal)
            os.environ["VLLM_TFM_FORCE_TREE_PATH"] = "1" if force else "0"
            oracle.mode, oracle.planted = mode, 0
            if STATE.metrics is not None:
                STATE.metrics.reset()
            before = spec_counters(llm)
            refs_before = refs.snapshot()
            t = time.time()
            try:
                got = generate(llm, ps if batch == "b8" else ps[:1])
                case["seconds"] = round(time.time() - t, 2)
                divs = [first_divergence(ref, g["tokens"]) for ref, g in zip(baseline[batch], got)]
                case["equal"] = all(d is None for d in divs)
                case["identical_fraction"] = sum(d is None for d in divs) / len(divs)
                same = [d["pos"] if d is not None else len(r["tokens"]) for r, d in zip(baseline[batch], divs)]
                case["identical_token_fraction"] = sum(same) / sum(len(r["tokens"]) for r in baseline[batch])
                case["divergences"] = {i: d for i, d in enumerate(divs) if d is not None}
                case["tokens_first_prompt"] = got[0]["tokens"][:16]
            except Exception as e:  # noqa: BLE001
                case["seconds"] = round(time.time() - t, 2)
                case["error"] = f"{type(e).__name__}: {e}"
                case["traceback"] = traceback.format_exc()
                print(case["traceback"], flush=True)
                abort_all(llm)
            case["tree_metrics"] = runtime.snapshot_metrics()
            case["spec_counters"] = diff_counters(before, spec_counters(llm))
            case["oracle_planted_tokens"] = oracle.planted
            tm = case["tree_metrics"] or {}
            case["gdn_reference_calls"] = {k: v - refs_before.get(k, 0) for k, v in refs.snapshot().items()}
            case["gdn_path"] = gdn_path(case["gdn_reference_calls"], tm.get("hooks") or {})
            if batch == "b8" and "nospec_control" in results and "divergences" in case:
                case["vs_nospec_control"] = overlap_with_control([int(i) for i in case["divergences"]],
                                                                 results["nospec_control"])
            log(f"case {name:22s} {batch}: equal={case.get('equal')} error={case.get('error')} "
                f"{case['seconds']}s tree_steps={tm.get('tree_steps')}/{tm.get('steps')} "
                f"mean_acc_len={tm.get('mean_accepted_length')} hooks={tm.get('hooks')} planted={oracle.planted} "
                f"gdn_path={case['gdn_path']} {case.get('vs_nospec_control', '')}")
            for i, d in case.get("divergences", {}).items():
                log(f"   prompt {i} diverges: {d}")
            save()
    set_proposal_override(None)
    oracle.mode = None
    results["fallback_warnings"] = fallback_warnings()
    save()


def fallback_warnings() -> list[str]:
    """The kernels' one-time "falls back to the torch reference" reasons seen in this process."""
    try:
        from vllm_tfm.kernels import loader

        return sorted(k.replace("\0", ": ") for k in getattr(loader, "_warned", ()))
    except Exception as e:  # noqa: BLE001 - a record only
        return [f"unavailable: {type(e).__name__}: {e}"]


# ---------------------------------------------------------------------------------------- driver
def summary(out: Path) -> int:
    path = out / "results.json"
    if not path.is_file():
        print("no results.json: the tfm phase did not run (see tfm.log)")
        return 2
    res = json.loads(path.read_text())
    print("=" * 100)
    print("tfm e2e summary  env:", res.get("env"))
    print("units:", {k: v.get("ok") for k, v in res.get("units", {}).items()})
    print("target:", res.get("target"), "model:", (res.get("env") or {}).get("model"))
    for kind, ctl in (res.get("nospec_control") or {}).items():
        print(f"no-spec control {kind}: prompts differing {ctl.get('prompts_differing')}/{ctl.get('prompts')} "
              f"{ctl.get('differing', '')} {ctl.get('skipped', '')}{ctl.get('error', '')}")
    if res.get("fallback_warnings"):
        print("kernel fallbacks:", res["fallback_warnings"])
    if "engine_error" in res:
        print("ENGINE ERROR:", res["engine_error"])
        return 1
    bad = 0
    for c in res.get("cases", []):
        tm = c.get("tree_metrics") or {}
        status = "SKIP" if "skipped" in c else ("ERROR" if "error" in c else ("OK" if c.get("equal") else "DIVERGED"))
        bad += status in ("ERROR", "DIVERGED")
        print(f"{status:8s} {c['case']:22s} {c['batch']}  {c.get('seconds', '-')}s  tree_steps={tm.get('tree_steps')}"
              f"/{tm.get('steps')}  mean_acc_len={tm.get('mean_accepted_length')}  planted={c.get('oracle_planted_tokens')}"
              f"  gdn={c.get('gdn_path')}  {c.get('vs_nospec_control', '')}  {c.get('error', '')}")
        for i, d in (c.get("divergences") or {}).items():
            print(f"           prompt {i}: {d}")
    if "sampling" in res:
        smp = res["sampling"]
        if "error" in smp:
            print("SAMPLING ERROR:", smp["error"])
            bad += 1
        for name, r in (smp.get("arms") or {}).items():
            if r.get("expect") == "same":
                status = "ERROR" if "error" in r else ("OK" if r.get("ok") else "DIFFERS")
                bad += status != "OK"
            else:  # the sanity arm: the test must reject a different distribution
                status = "POWER" if r.get("ok") else "NO-POWER"
            print(f"{status:8s} {sampling_line(name, r)}")
    print("=" * 100)
    return 1 if bad else 0


def run_phase(phase: str, out: Path, deadline: float) -> int:
    """Run one phase in a subprocess until ``deadline`` seconds after T0; echo its key lines."""
    logf = out / f"{phase}.log"
    timeout = max(10.0, deadline - (time.time() - T0))
    log(f"phase {phase} (timeout {timeout:.0f}s) -> {logf}")
    cmd = [sys.executable, __file__, "--phase", phase, "--out", str(out)]
    env = dict(os.environ, TFM_E2E_T0=str(T0))
    with open(logf, "w") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = -9
            f.write(f"\nphase {phase} killed after {timeout:.0f}s\n")
    keep = ("[tfm-e2e", "Traceback", "Error", "error", "killed", "File \"/")
    lines = logf.read_text(errors="replace").splitlines()
    shown = [ln for ln in lines if any(k in ln for k in keep)]
    print("\n".join(shown[-150:]), flush=True)
    if rc != 0:
        print(f"--- last 40 lines of {logf} ---", *lines[-40:], sep="\n", flush=True)
    log(f"phase {phase} exit code {rc}")
    return rc


def main() -> int:
    global T0
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/tfm-e2e-out"))
    ap.add_argument("--phase", default="all", choices=["all", "make", "baseline", "tfm", "summary"])
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if "TFM_E2E_T0" in os.environ:
        T0 = float(os.environ["TFM_E2E_T0"])
    if args.phase == "make":
        phase_make()
    elif args.phase == "baseline":
        phase_baseline(out)
    elif args.phase == "tfm":
        phase_tfm(out)
    elif args.phase == "summary":
        return summary(out)
    else:
        phase_make()
        run_phase("baseline", out, deadline=DEADLINE_S - 150)
        if not (out / "baseline.json").is_file():
            print("baseline failed: see baseline.log", flush=True)
            return 2
        run_phase("tfm", out, deadline=DEADLINE_S + 25)
        return summary(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
