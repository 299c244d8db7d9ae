#!/usr/bin/env python3
"""Requests that need vLLM's own sampler, joining a running tfm batch (a debugging tool).

Why (bench/NOTES.md sections 54-55): in the serving soak with ``--async-scheduling``, the
``allowed_token_ids`` probe (ids 3..199, greedy, 12 tokens) got two tokens outside its allowed set
(453, 349 where no-spec gave 70, 16). A batch holding such a request verifies chains through vLLM's
rejection sampler, which masks the vocabulary (``runtime/sampler.py`` ``needs_native_sampler``); a token
outside the set comes from a step that did not, or from a mask that reached the request's rows misaligned.
It was the second: vLLM 0.26's ``InputBatch.swap_states`` loses the mask of the row its decode-first reorder
moves (``vllm_tfm/vllm_plugin/allowed_token_masks.py`` fixes it; ``--without-mask-fix`` undoes the fix here).

Here, in one process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with one engine of
bench/gpu_graphs_e2e.py (default ``tfm-eager-async``) on the toy zoo: background greedy requests (the
fixed zoo prompts) start together; after ``--join-step`` engine steps the probes join (``allowed``:
``allowed_token_ids`` 3..199, and ``logprobs``: 2 log-probabilities, both greedy, 12 tokens). A wrapper
of the tree sampler's ``forward`` records, for every step whose input batch holds a probe: the step
number, the batch size, the probe's row, the step's ``tree_active``, ``needs_native_sampler`` of the
sampling metadata the sampler got and of the input batch's, whether that metadata carries the
allowed-token mask, whether the mask's row of the probe is the ``allowed`` probe's (ids 0-2 and 200 masked, 3
and 199 not; None for other probes or without a mask), the path that ran (``tree`` or ``vllm``), the probe row's
scheduled drafts and its sampled tokens. The verdict: every ``allowed`` token inside the set, and the record of the step that
emitted the first token outside it.

usage (GPU host, repository root, after ``source .gpu-bundle/install.sh`` and PYTHONPATH=$PWD):
    python3 bench/async_request_params.py --out OUT                     # tfm-eager-async
    python3 bench/async_request_params.py --out OUT --engine tfm-eager   # the synchronous engine
    python3 bench/async_request_params.py --out OUT --engine tfm-fullpw-async --max-seqs 64 --background 40 \
        --probes allowed,logprobs,min_tokens,sampled,n3 --abort-step 10 --soak-probe-prompt
                                                        # nearer the soak: full graphs, load, aborts, its probe prompt

Outcomes (bench/NOTES.md sections 54-55, ``bench/results/async_request_params_s54.json.gz``, ``_s55.json.gz``):
without new requests arriving, no run reproduced (eager batch 8; full graphs async and sync at 64 sequences).
With ``--abort-count 8 --replace-aborted`` (new prefills take the freed lowest slots, the reorder moves the probes
forward) and ``--without-mask-fix``, full graphs synchronous and asynchronous both failed: the probe moved from
row 40 to row 1, whose mask row was no longer the probe's, and vLLM's sampler gave 421. With the fix the same
run answered the soak's no-spec tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
for _p in (str(REPO), str(BENCH)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

ALLOWED = tuple(range(3, 200))
PROBE_TOKENS = 12
PROBES: dict[str, dict[str, Any]] = {  # bench/soak_probes.py's rows that the engine takes (no beam search here)
    "allowed": {"allowed_token_ids": list(ALLOWED)},
    "logprobs": {"logprobs": 2},
    "min_tokens": {"min_tokens": 8},
    "sampled": {"temperature": 0.9, "top_p": 0.9, "top_k": 40, "seed": 11},
    "n3": {"n": 3, "temperature": 0.8, "seed": 7},
}
DEFAULT_PROBES = ("allowed", "logprobs")
# no-spec's answer to the allowed probe on the soak's probe prompt (soak_zoo_graphs_async_s54.json.gz, in git history at 1c9f37b)
SOAK_NOSPEC_ALLOWED = (84, 65, 85, 9, 79, 9, 70, 16, 69, 9, 70, 16)


def soak_probe_prompt(target: str) -> list[int]:
    """The soak's probe prompt (bench/soak.py ``probe_prompt_of`` on the standard library's token stream), from this
    interpreter's standard library, as the soak's driver on the GPU host had it."""
    import soak
    import soak_client as sc

    return soak.probe_prompt_of(sc.stream_token_prompts(soak.stdlib_token_stream(target)))


def probe_of(req_id: str) -> str | None:
    """The probe name of one of vLLM's request ids (``probe-<name>`` plus vLLM's own suffix), else None."""
    for name in PROBES:
        if req_id == f"probe-{name}" or req_id.startswith(f"probe-{name}-"):
            return name
    return None


def first_outside(tokens: list[int], allowed: tuple[int, ...] = ALLOWED) -> int | None:
    """Index of the first token not in ``allowed``, None when all are."""
    ok = set(allowed)
    return next((i for i, t in enumerate(tokens) if t not in ok), None)


def culprit(records: list[dict[str, Any]], emitted_before: int) -> dict[str, Any] | None:
    """The record of the step whose ``allowed`` output holds the probe's token number ``emitted_before``
    (0-based over its generated tokens): the steps' outputs, -1 padding dropped, laid end to end."""
    seen = 0
    for rec in records:
        if rec.get("probe") != "allowed" or rec.get("out") is None:
            continue
        got = [t for t in rec["out"] if t >= 0]
        if seen <= emitted_before < seen + len(got):
            return rec
        seen += len(got)
    return None


def request_params(n_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams fields of a request: greedy, ``n_tokens`` tokens, no EOS stop, no text; a probe's ``extra``
    (its temperature, seed, ...) wins over the greedy defaults."""
    return {"temperature": 0.0, "max_tokens": n_tokens, "ignore_eos": True, "detokenize": False, **extra}


def mask_row_is_allowed(mask: Any, row: int) -> bool | None:
    """Whether row ``row`` of vLLM's allowed-token mask (True = masked) is the ``allowed`` probe's: ids 0-2 and
    200 masked, 3 and 199 not. None without a mask or past its rows."""
    if mask is None or row >= mask.shape[0] or mask.shape[1] <= 200:
        return None
    vals = mask[row, [0, 2, 3, 199, 200]].tolist()
    return vals == [True, True, False, False, True]


def install_recorder(records: list[dict[str, Any]]) -> None:
    """Wrap ``TFMTreeSampler.forward`` (the runner's rejection sampler in tfm engines): one record per
    probe in the step's input batch."""
    from vllm_tfm.vllm_plugin.runtime.sampler import TFMTreeSampler, needs_native_sampler
    from vllm_tfm.vllm_plugin.runtime.state import STATE

    orig = TFMTreeSampler.forward
    count = [0]

    def forward(self: Any, metadata: Any, draft_probs: Any, logits: Any, sampling_metadata: Any) -> Any:
        step = STATE.step
        runner = self._runner[0]
        batch = runner.input_batch
        out = orig(self, metadata, draft_probs, logits, sampling_metadata)
        count[0] += 1
        try:
            rows = {probe_of(rid): i for i, rid in enumerate(batch.req_ids[: batch.num_reqs]) if probe_of(rid)}
            if rows:
                sampled = out.sampled_token_ids
                drafts = list(metadata.num_draft_tokens)
                for name, row in rows.items():
                    records.append({
                        "step": count[0], "probe": name, "row": row, "batch": int(batch.num_reqs),
                        "tree_active": None if step is None else bool(step.tree_active),
                        "native_given": needs_native_sampler(sampling_metadata),
                        "native_batch": needs_native_sampler(batch.sampling_metadata),
                        "mask_given": sampling_metadata.allowed_token_ids_mask is not None,
                        "mask_row_is_allowed": mask_row_is_allowed(sampling_metadata.allowed_token_ids_mask, row)
                        if name == "allowed" else None,
                        "path": "tree" if step is not None and step.tree_active else "vllm",
                        "drafts": drafts[row] if row < len(drafts) else None,
                        "out": [int(t) for t in sampled[row].tolist()] if row < sampled.shape[0] else None,
                    })
        except Exception as e:  # noqa: BLE001 - a recorder must not stop the engine
            records.append({"step": count[0], "error": repr(e)})
        return out

    TFMTreeSampler.forward = forward


def run(engine_name: str, out_dir: Path, background: int, max_tokens: int, join_step: int, budget: int,
        probes: tuple[str, ...] = DEFAULT_PROBES, max_seqs: int | None = None, abort_step: int | None = None,
        soak_prompt: bool = False, abort_count: int = 2, replace_aborted: bool = False,
        mask_fix: bool = True) -> dict[str, Any]:
    import gpu_graphs_e2e as g

    os.environ.update(g.ENGINES[engine_name].get("env") or {})
    import torch
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    import vllm_tfm

    vllm_tfm.register()
    if not mask_fix:  # vLLM's own InputBatch row moves (vllm_plugin/allowed_token_masks.py), to show what they do
        from vllm.v1.worker.gpu_input_batch import InputBatch

        from vllm_tfm.vllm_plugin import patching

        patching.restore([f"{InputBatch.__module__}.InputBatch.{n}" for n in ("swap_states", "add_request")])
    records: list[dict[str, Any]] = []
    install_recorder(records)
    res: dict[str, Any] = {"engine": engine_name, "device": torch.cuda.get_device_name(0), "background": background,
                           "max_tokens": max_tokens, "join_step": join_step, "probes": list(probes), "abort_step": abort_step,
                           "abort_count": abort_count, "replace_aborted": replace_aborted, "mask_fix": mask_fix}
    kw = g.engine_kwargs(engine_name, str(g.ZOO / "target"), str(g.ZOO / "drafter"), budget)
    if max_seqs is not None:
        kw["max_num_seqs"] = max_seqs
    res["max_num_seqs"] = kw["max_num_seqs"]
    t0 = time.perf_counter()
    llm = LLM(**kw)
    res["engine_start_s"] = round(time.perf_counter() - t0, 1)
    engine = llm.llm_engine
    render = getattr(llm, "_preprocess_cmpl_one", None)

    def add(rid: str, prompt: list[int], n_tokens: int, extra: dict[str, Any]) -> None:
        params = SamplingParams(**request_params(n_tokens, extra), output_kind=RequestOutputKind.FINAL_ONLY)
        p = {"prompt_token_ids": prompt}
        engine.add_request(rid, render(p) if render is not None else p, params)

    fixed = json.loads(g.PROMPT_FILE.read_text())["prompts"]  # all of the fixed zoo prompts, cycled
    ps = [fixed[i % len(fixed)] for i in range(background + 1)]
    if soak_prompt:
        ps[background] = soak_probe_prompt(str(g.ZOO / "target"))
    res["probe_prompt"] = ps[background]
    for i in range(background):
        add(f"bg{i}", ps[i], max_tokens, {})
    outputs: dict[str, list[int]] = {}
    steps = 0
    t1 = time.perf_counter()
    while engine.has_unfinished_requests() or steps <= max(join_step, abort_step or 0):
        if steps == join_step:
            for name in probes:
                add(f"probe-{name}", ps[background], PROBE_TOKENS, PROBES[name])
        if steps == abort_step:  # the soak's disconnects: running requests dropped (and new ones arriving)
            dropped = [f"bg{i}" for i in range(min(abort_count, background))]
            engine.abort_request(dropped)
            for i in range(len(dropped) if replace_aborted else 0):  # prefills in the lowest slots: vLLM's
                add(f"new{i}", fixed[(background + 1 + i) % len(fixed)], max_tokens, {})  # reorder moves the last rows
        for o in engine.step():
            if o.finished:
                outputs[o.request_id] = list(o.outputs[0].token_ids)
        steps += 1
    res["run_s"] = round(time.perf_counter() - t1, 1)
    res["steps"] = steps
    probe_out = {probe_of(k): v for k, v in outputs.items() if probe_of(k)}
    res["probe_tokens"] = probe_out
    allowed = probe_out.get("allowed", [])
    bad = first_outside(allowed)
    res["allowed_all_inside"] = bad is None and len(allowed) == PROBE_TOKENS
    res["first_outside"] = bad
    res["culprit"] = None if bad is None else culprit(records, bad)
    if soak_prompt:  # the soak's no-spec server answered this (if this host's standard library is the soak's)
        res["allowed_equals_soak_nospec"] = allowed == list(SOAK_NOSPEC_ALLOWED)
    res["records"] = records
    path = out_dir / f"async_request_params_{engine_name}{'' if mask_fix else '-vllm-masks'}.json"
    path.write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps({k: v for k, v in res.items() if k != "records"}, indent=1))
    for rec in records:
        print(json.dumps(rec))
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/tfm-async-request-params"))
    ap.add_argument("--engine", default="tfm-eager-async", help="an engine of bench/gpu_graphs_e2e.py with method tfm")
    ap.add_argument("--background", type=int, default=6,
                    help="greedy requests running when the probes join (the engines' max_num_seqs is 8: 6 + 2 probes)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens of each background request")
    ap.add_argument("--join-step", type=int, default=6, help="engine steps before the probes join")
    ap.add_argument("--budget", type=int, default=16, help="num_speculative_tokens")
    ap.add_argument("--probes", default=",".join(DEFAULT_PROBES), help=f"comma-separated, of {', '.join(PROBES)}")
    ap.add_argument("--max-seqs", type=int, help="max_num_seqs instead of the engine's (bench/gpu_graphs_e2e.py: 8)")
    ap.add_argument("--abort-step", type=int, help="abort background requests before this engine step")
    ap.add_argument("--abort-count", type=int, default=2, help="background requests aborted at --abort-step")
    ap.add_argument("--replace-aborted", action="store_true",
                    help="as many new requests arrive at --abort-step: vLLM puts them in the freed (lowest) slots, and "
                         "its decode-first reorder then moves the batch's last rows (the probes) forward")
    ap.add_argument("--without-mask-fix", action="store_true",
                    help="undo vllm_plugin/allowed_token_masks.py in this process (vLLM 0.26's own row moves)")
    ap.add_argument("--soak-probe-prompt", action="store_true",
                    help="the probes take the soak's probe prompt (the one its allowed_token_ids probe failed on)")
    args = ap.parse_args(argv)
    probes = tuple(p.strip() for p in args.probes.split(",") if p.strip())
    if "allowed" not in probes or not set(probes) <= set(PROBES):
        raise SystemExit(f"--probes {args.probes!r}: names of {', '.join(PROBES)}, 'allowed' among them")
    import gpu_graphs_e2e as g

    if args.engine not in g.ENGINES or not g.ENGINES[args.engine]["spec"]:
        raise SystemExit(f"--engine {args.engine!r}: not a tfm engine of bench/gpu_graphs_e2e.py "
                         f"({', '.join(k for k, e in g.ENGINES.items() if e['spec'])})")
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") != "0":
        raise SystemExit("set VLLM_ENABLE_V1_MULTIPROCESSING=0: the recorder wraps the sampler in this process")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = run(args.engine, out, args.background, args.max_tokens, args.join_step, args.budget, probes, args.max_seqs,
              args.abort_step, args.soak_probe_prompt, args.abort_count, args.replace_aborted, not args.without_mask_fix)
    return 0 if res["allowed_all_inside"] else 1


if __name__ == "__main__":
    sys.exit(main())
