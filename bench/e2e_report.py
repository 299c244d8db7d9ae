#!/usr/bin/env python3
"""Tables of a ``bench/e2e.py`` results file (``format: vllm-tfm-e2e/1``) as markdown.

    python3 bench/e2e_report.py bench/results/e2e_27b.json                   # print the tables
    python3 bench/e2e_report.py bench/results/e2e_27b.json --write docs/e2e.md  # refresh the doc
    python3 bench/e2e_report.py A.json B.json --merge AB.json                    # runs on two GPUs at once
    python3 bench/e2e_report.py A.json B.json --merge AB.json --merge-sequential # one machine, one after another

``--write`` replaces what lies between the markers ``<!-- e2e:begin -->`` and ``<!-- e2e:end -->``
of the doc (the prose around them stays). Plain Python: no torch, no vLLM.

Throughput: decode tokens/s (output tokens after each request's first, over the time from the
last first token to the last token, from vLLM's per-request timestamps) when every arm has it,
else end-to-end tokens/s (all output tokens over the wall time of the ``generate`` call).
Ratios compare arms of the same results file: one run, or runs merged with ``--merge`` (at the same
time on GPUs of one host, or with ``--merge-sequential`` one after another on the same machine).

Per-stage times are per decode step (the median over the profiled run's steps of the stage's
per-step sum; the prefill step is one of them and is left out by the median), from CUDA events (``vllm_tfm.vllm_plugin.runtime.stage_timing``). Drafting overhead =
``propose`` (DFlash forward, tree build and their bookkeeping) + ``sample`` (tree acceptance) +
``commit`` + ``prepare_tree``, minus the benchmark-only replay stages; its ratio to
``target_forward`` is the issue's "<= 15% at batch 1" goal.

Target forward split (tfm tree steps): ``gdn_tree`` (our GDN tree path, with its tree conv and tree
verify) and ``attention_tree`` (our tree attention rows) are sums over the layers of a step, and
rest of forward = ``target_forward - gdn_tree - attention_tree`` (projections, MLPs, norms, vLLM's
own batched attention, graph replays, host gaps). ``gdn_layer`` / ``attention_layer`` are the whole
mixer ops of those layers (vLLM's GDN / Triton attention op body with our path inside). Host
milliseconds of the tree paths are shown next to the device ones: close values mean the path is
bound by launching its kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = [
    "RESULTS_FORMAT",
    "BEGIN",
    "END",
    "GOALS",
    "stage_breakdown",
    "forward_split",
    "throughput",
    "reference_arm",
    "summarize",
    "render_markdown",
    "write_doc",
    "render_files",
    "merge_results",
]

RESULTS_FORMAT = "vllm-tfm-e2e/1"
BEGIN = "<!-- e2e:begin -->"
END = "<!-- e2e:end -->"
GOALS = {"overhead_fraction_b1": 0.15, "x_nospec": 4.5, "x_dflash": 1.3}


def _per_step(stages: dict[str, Any], name: str) -> float:
    """A stage's milliseconds in a typical decode step: the median over the steps in which it ran of
    its per-step sum, when it ran in at least half of the run's steps (``execute_model`` runs in every
    step); else, and for files without per-step sums, its total over the run's steps. The mean of a
    run also holds its first step, the prompts' prefill (~100-170 ms of target forward at the 27B
    shape, one step of ~70-260): it would lift the forward by 0.4-1.4 ms per step and lower the
    drafting overhead's ratio to it (bench/NOTES.md section 41)."""
    entry = stages.get(name) or {}
    sums = entry.get("per_step_sum") or {}
    steps = ((stages.get("execute_model") or {}).get("per_step_sum") or {}).get("count")
    if sums.get("median_ms") is not None and steps and 2 * int(sums.get("count", 0)) >= int(steps):
        return float(sums["median_ms"])
    v = entry.get("per_step_ms")
    return float(v) if v is not None else 0.0


def stage_breakdown(stages: dict[str, Any]) -> dict[str, float | None]:
    """Milliseconds per step of each stage, the drafting overhead and its ratio to the target forward."""
    forward = _per_step(stages, "target_forward")
    propose = _per_step(stages, "propose")
    draft = _per_step(stages, "draft")
    tree = _per_step(stages, "tree_build")
    shaping = _per_step(stages, "replay_shaping")
    replay_accept = _per_step(stages, "replay_accept")
    sample = _per_step(stages, "sample")
    commit = _per_step(stages, "commit")
    # with deferred drafts the tree metadata is finished in vLLM's _preprocess ("topology_wait"): its
    # events also span the end of the drafter the host waits for there, so counting it is an upper bound
    prepare = _per_step(stages, "prepare_tree") + _per_step(stages, "topology_wait")
    if "draft" not in stages:  # in-tree DFlash: the whole propose call is its drafter
        draft = propose
    overhead = (propose - shaping) + (sample - replay_accept) + commit + prepare
    return {
        "target_forward": forward,
        "draft": draft,
        "tree_build": tree,
        "other_drafting": max(0.0, propose - draft - tree - shaping) if "draft" in stages else 0.0,
        "sample": sample - replay_accept,
        "commit": commit,
        "prepare_tree": prepare,
        "replay": shaping + replay_accept,
        "overhead": overhead,
        "overhead_fraction": (overhead / forward) if forward > 0 else None,
        "execute_model": _per_step(stages, "execute_model"),
        "sample_tokens": _per_step(stages, "sample_tokens"),
    }


def _maybe(stages: dict[str, Any], name: str, key: str = "per_step_ms") -> float | None:
    if name not in stages:
        return None
    if key == "per_step_ms":
        return _per_step(stages, name)
    v = (stages.get(name) or {}).get(key)
    return float(v) if v is not None else None


def forward_split(stages: dict[str, Any]) -> dict[str, float | None]:
    """Milliseconds per step inside the target forward: our GDN and attention tree paths (sums over
    the step's layers; None where the stage never ran), their host time, and the rest."""
    forward = _per_step(stages, "target_forward")
    gdn = _maybe(stages, "gdn_tree")
    attn = _maybe(stages, "attention_tree")
    return {
        "target_forward": forward,
        "gdn_layer": _maybe(stages, "gdn_layer"),
        "gdn_tree": gdn,
        "gdn_tree_conv": _maybe(stages, "gdn_tree_conv"),
        "gdn_tree_verify": _maybe(stages, "gdn_tree_verify"),
        "gdn_tree_host": _maybe(stages, "gdn_tree", "host_per_step_ms"),
        "attention_layer": _maybe(stages, "attention_layer"),
        "attention_tree": attn,
        "attention_tree_host": _maybe(stages, "attention_tree", "host_per_step_ms"),
        "rest_of_forward": forward - (gdn or 0.0) - (attn or 0.0),
        "tree_fraction": ((gdn or 0.0) + (attn or 0.0)) / forward if forward > 0 else None,
        "gdn_layers_per_step": _maybe(stages, "gdn_tree", "spans_per_step"),
        "attention_layers_per_step": _maybe(stages, "attention_tree", "spans_per_step"),
    }


def _batch(arm: dict[str, Any], batch: int) -> dict[str, Any] | None:
    return (arm.get("batches") or {}).get(str(batch))


def throughput(results: dict[str, Any], batch: int) -> tuple[str, dict[str, float]]:
    """("decode" or "e2e", tokens/s by arm) for the arms measured at this batch size."""
    runs = {name: _batch(a, batch) for name, a in results.get("arms", {}).items()}
    runs = {k: v for k, v in runs.items() if v and v.get("tokens_per_s")}
    if runs and all(v.get("decode_tokens_per_s") for v in runs.values()):
        return "decode", {k: float(v["decode_tokens_per_s"]) for k, v in runs.items()}
    return "e2e", {k: float(v["tokens_per_s"]) for k, v in runs.items()}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def reference_arm(kind: str, arm: dict[str, Any], tps: dict[str, float]) -> str:
    """The arm a ratio divides by: like for like, so a CUDA-graph arm is compared with the graph
    run of no-spec / DFlash when that ran, and an eager arm with the eager one."""
    graphs = f"{kind}-graphs"
    return graphs if arm.get("graphs") and graphs in tps else kind


def summarize(results: dict[str, Any]) -> dict[str, Any]:
    """Ratios per batch size (vs no-spec and vs vLLM's in-tree DFlash, eager or graphs like the arm)
    and the goals."""
    batches = results.get("settings", {}).get("batches", [1, 8])
    arms = results.get("arms", {})
    out: dict[str, Any] = {"batches": {}, "goals": {}}
    for b in batches:
        metric, tps = throughput(results, b)
        out["batches"][str(b)] = {
            "metric": metric,
            "tokens_per_s": tps,
            "x_nospec": {k: _ratio(v, tps.get(reference_arm("nospec", arms.get(k, {}), tps))) for k, v in tps.items()},
            "x_dflash": {k: _ratio(v, tps.get(reference_arm("dflash", arms.get(k, {}), tps))) for k, v in tps.items()},
        }
    tfm = [n for n, a in arms.items() if a.get("kind") == "tfm" and a.get("status") != "skipped"]
    b1 = _batch_key(batches, 1)
    goals = out["goals"]
    for name in tfm:
        run = _batch(arms[name], 1) or {}
        stages = (run.get("profiled") or {}).get("stages")
        frac = stage_breakdown(stages)["overhead_fraction"] if stages else None
        bsum = out["batches"].get(b1, {}) if b1 else {}
        goals[name] = {
            "overhead_fraction_b1": frac,
            "overhead_ok": None if frac is None else frac <= GOALS["overhead_fraction_b1"],
            "x_nospec": {b: out["batches"][b]["x_nospec"].get(name) for b in out["batches"]},
            "x_dflash": {b: out["batches"][b]["x_dflash"].get(name) for b in out["batches"]},
        }
        x1 = bsum.get("x_nospec", {}).get(name) if bsum else None
        d1 = bsum.get("x_dflash", {}).get(name) if bsum else None
        goals[name]["x_nospec_ok_b1"] = None if x1 is None else x1 >= GOALS["x_nospec"]
        goals[name]["x_dflash_ok_b1"] = None if d1 is None else d1 >= GOALS["x_dflash"]
    return out


def _batch_key(batches: list[int], b: int) -> str | None:
    return str(b) if b in batches else None


def _f(v: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _arm_desc(arm: dict[str, Any]) -> str:
    kind = arm.get("kind")
    if kind == "nospec":
        return "no speculation" + (" (CUDA graphs)" if arm.get("graphs") else "")
    if kind == "dflash":
        return f"vLLM DFlash chain, K={arm.get('num_speculative_tokens')}" + (" (CUDA graphs)" if arm.get("graphs") else "")
    graphs = " (full CUDA graphs of tree steps)" if arm.get("full") else " (CUDA graphs)"
    env = "".join(f", {k}={v}" for k, v in (arm.get("env") or {}).items())
    sched = ", asynchronous scheduling" if arm.get("async_scheduling") else ""
    quant = f", DFlash drafter quantization {arm['draft_quantization']}" if arm.get("draft_quantization") else ""
    return f"tfm (Weaver trees), B={arm.get('budget')}" + (graphs if arm.get("graphs") else "") + sched + env + quant


def _short_batch(arm: dict[str, Any], b: int) -> int | None:
    """The most requests that ran at once in the arm's batch-b run when that was fewer than b (None otherwise)."""
    conc = (_batch(arm, b) or {}).get("max_concurrency")
    return conc if isinstance(conc, int) and 0 < conc < b else None


def render_markdown(results: dict[str, Any]) -> str:
    """The throughput table, the per-stage tables and the goals of one results file."""
    if results.get("format") != RESULTS_FORMAT:
        raise ValueError(f"not a bench/e2e.py results file (format {results.get('format')!r}, expected {RESULTS_FORMAT!r})")
    s = results.get("settings", {})
    m = results.get("machine", {})
    p = results.get("profile", {})
    arms = results.get("arms", {})
    batches = s.get("batches", [1, 8])
    summ = summarize(results)
    lines = [
        (f"Measured on {m.get('device', '?')} (vLLM {m.get('vllm', '?')}, torch {m.get('torch', '?')}); "
        f"command `{results.get('command', '?')}`."),
        (f"Target: {s.get('target', '?')}, dummy weights; prompt {s.get('prompt_len')} tokens, "
        f"{s.get('output_len')} output tokens per request, temperature {s.get('temperature')}, "
        f"{'eager (no CUDA graphs)' if s.get('eager', True) else 'CUDA graphs'} unless the arm says otherwise."),
        _acceptance_line(p, arms),
        ("Ratios are like for like: a CUDA-graph arm is divided by the graph run of no-spec / DFlash where that "
         "ran, an eager arm by the eager one."
         + (f" tfm switches: {', '.join(f'{k}={v}' for k, v in s['tfm_env'].items())}." if s.get("tfm_env") else "")
         + (" Tokens/s from runs with the stage timers paused (clean runs)." if s.get("clean_run")
            else " Tokens/s from the timed runs (stage timers on: they include the timers' own cost).")),
        *([f"Merged from {len(results.get('merged_from') or [])} runs: {results['merge_note']}."]
          if results.get("merge_note") else []),
        "",
    ]
    metric_names = {b: summ["batches"][str(b)]["metric"] for b in batches}
    head = ["arm", "drafts/step", "MAL profile", f"MAL measured b{batches[0]}"]
    for b in batches:
        head += [f"b{b} {metric_names[b]} tok/s", f"b{b} x no-spec", f"b{b} x DFlash"]
    head += ["max batch seen", "engine start s"]
    lines += ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    short_notes: list[str] = []
    for name, arm in arms.items():
        if arm.get("status") == "skipped":
            continue
        b1 = _batch(arm, batches[0]) or {}
        row = [f"{name}: {_arm_desc(arm)}", str(arm.get("num_speculative_tokens") or 0), _f(arm.get("profile_mal"), "{:.2f}"),
               _f(b1.get("mal"), "{:.2f}")]
        for b in batches:
            bs = summ["batches"][str(b)]
            short = _short_batch(arm, b)
            row += [_f(bs["tokens_per_s"].get(name)) + (f" ({short} at once)" if short else ""),
                    _x(bs["x_nospec"].get(name)), _x(bs["x_dflash"].get(name))]
            if short:
                short_notes.append(f"{name} at batch {b}: at most {short} requests ran at once (its KV cache, "
                                   f"{arm.get('num_gpu_blocks')} blocks, held no more), the others waited: not a "
                                   f"batch-{b} figure, and the decode window (from the last first token) counts tokens "
                                   f"made before it")
        conc = [str((_batch(arm, b) or {}).get("max_concurrency")) for b in batches]
        row += ["/".join(conc), _f(arm.get("engine_start_s"))]
        if arm.get("status") not in (None, "ok"):
            row[0] += f" ({arm.get('status')}: {str(arm.get('error', ''))[:80]})"
        lines.append("| " + " | ".join(row) + " |")
    if short_notes:
        lines += ["", *(f"- {n}." for n in short_notes)]
    lines += _repeated_arm_lines(results.get("repeated_arms") or [], arms, batches, metric_names)
    for b in batches:
        rows = []
        for name, arm in arms.items():
            stages = ((_batch(arm, b) or {}).get("profiled") or {}).get("stages")
            if not stages:
                continue
            d = stage_breakdown(stages)
            cells = [_f(d[k], "{:.2f}") for k in ("target_forward", "draft", "tree_build", "other_drafting", "sample",
                                                  "commit", "prepare_tree", "overhead")]
            frac = d["overhead_fraction"]
            cells += [_f(None if frac is None else 100 * frac, "{:.1f}%"), _f(d["replay"], "{:.2f}")]
            rows.append(f"| {name} | " + " | ".join(cells) + " |")
        if rows:
            lines += [
                "",
                f"Per decode step at batch {b}, milliseconds (CUDA events, profiled run):",
                "",
                ("| arm | target forward | draft (DFlash) | tree build | other drafting | sample | commit | tree metadata | "
                "drafting overhead | overhead / forward | replay (bench-only) |"),
                "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
                *rows,
            ]
        lines += _forward_split_table(arms, b)
    lines += _deferred_ab_lines(arms, batches)
    for ab_key, (flag, title) in SWITCH_AB_TITLES.items():
        lines += _switch_ab_lines(arms, batches, ab_key, flag, title)
    for b in batches:
        lines += _timeline_table(arms, b)
    goals = summ["goals"]
    if goals:
        lines += ["", ("Goals (issue 7): drafting overhead <= 15% of the target forward at batch 1; >= 4.5x over no-spec "
                  "and >= 1.3x over in-tree DFlash (batch 1):"), ""]
        for name, g in goals.items():
            frac = g["overhead_fraction_b1"]
            lines.append(
                f"- {name}: overhead {_f(None if frac is None else 100 * frac, '{:.1f}%')} ({_ok(g['overhead_ok'])}), "
                f"{_x(g['x_nospec'].get('1'))} over no-spec ({_ok(g['x_nospec_ok_b1'])}), "
                f"{_x(g['x_dflash'].get('1'))} over DFlash ({_ok(g['x_dflash_ok_b1'])})"
            )
    skipped = results.get("skipped") or []
    if skipped:
        lines += ["", "Not run: " + "; ".join(f"{x['arm']} ({x['reason']})" for x in skipped)]
    return "\n".join(lines) + "\n"


def _measured(flag: Any) -> str:
    return "measured" if flag else "NOT measured (synthetic)"


def _acceptance_line(profile: dict[str, Any], arms: dict[str, Any]) -> str:
    """The report's acceptance line: one profile for every arm, or (runs one after another merged with
    ``sequential``) the source and entry of each arm that replays one."""
    how = "tfm replays {} (acceptance replay), DFlash uses vLLM's synthetic rejection mode with {} chain entry."
    if not profile.get("per_arm"):
        return f"Acceptance: {_measured(profile.get('measured'))} profile, {profile.get('source', '?')}; " + how.format("it", "the")
    measured = {s.get("source"): s.get("measured") for s in profile.get("sources") or []}
    parts = [f"{name} from {arm.get('profile_source')} ({_measured(measured.get(arm.get('profile_source')))}, "
             f"entry {arm.get('profile_entry')})" for name, arm in arms.items() if arm.get("profile_entry")]
    return "Acceptance: a profile per arm (runs one after another): " + "; ".join(parts) + "; " + how.format("its entry", "its")


def _repeated_arm_lines(repeats: list[dict[str, Any]], arms: dict[str, Any], batches: list[int],
                        metrics: dict[int, str]) -> list[str]:
    """One line per arm that ran again in a later command of a sequential merge: its tokens/s next to
    the run the table shows, so that readers see the run-to-run agreement."""
    def tps(run: dict[str, Any] | None, b: int) -> float | None:
        return (run or {}).get("decode_tokens_per_s" if metrics[b] == "decode" else "tokens_per_s")

    out = []
    for rep in repeats:
        kept = arms.get(rep["arm"]) or {}
        cells = [f"b{b} {_f(tps(rep['batches'].get(str(b)), b))} (table: {_f(tps(_batch(kept, b), b))})" for b in batches]
        out.append(f"- {rep['arm']} again in `{rep['command']}`: " + ", ".join(cells))
    if not out:
        return []
    return ["", "Arms run again in a later command (the table keeps the first run), tokens/s as in the table:", "", *out]


def _ab_lines(arms: dict[str, Any], batches: list[int], cell: Any, title: str) -> list[str]:
    """Markdown lines of a same-engine A/B: ``cell(run)`` is a batch's runs as text (None: that batch
    ran no A/B), one line per arm that ran one, under ``title``."""
    out = []
    for name, arm in arms.items():
        cells = [f"batch {b}: {c}" for b in batches if (c := cell(_batch(arm, b) or {})) is not None]
        if cells:
            out.append(f"- {name}: " + "; ".join(cells))
    return ["", title, "", *out] if out else []


def _deferred_ab_lines(arms: dict[str, Any], batches: list[int]) -> list[str]:
    """The same-engine A/B of deferred drafts (``bench/e2e.py --ab-deferred``), where an arm ran it:
    decode tokens/s of the clean run (on), the run with them off, and on again."""
    def cell(run: dict[str, Any]) -> str | None:
        off, again = run.get("deferred_off"), run.get("deferred_on_again")
        if not off:
            return None
        return (f"on {_f(run.get('decode_tokens_per_s'))}, off {_f(off.get('decode_tokens_per_s'))}, "
                f"on again {_f((again or {}).get('decode_tokens_per_s'))}")

    return _ab_lines(arms, batches, cell, "Deferred drafts on / off on the same engine, decode tokens/s (clean runs "
                     "in this order; VLLM_TFM_DEFERRED_DRAFTS, runtime/deferred_drafts.py):")


def _switch_ab_lines(arms: dict[str, Any], batches: list[int], ab_key: str, flag: str, title: str) -> list[str]:
    """A runtime switch's same-engine A/B (``bench/e2e.py`` ``switch_ab_runs``: the runs under ``ab_key``,
    each marked ``flag``), where an arm ran it: decode tokens/s of the clean run (on), then off, on, off."""
    def cell(run: dict[str, Any]) -> str | None:
        ab = run.get(ab_key)
        if not ab:
            return None
        seq = [("on", run.get("decode_tokens_per_s"))] + [("on" if r.get(flag) else "off", r.get("decode_tokens_per_s"))
                                                          for r in ab]
        text = ", ".join(f"{k} {_f(v)}" for k, v in seq)
        if len(ab) >= 4:  # balanced repeats (bench/e2e.py --ab-repeats): each setting's mean over the A/B runs
            means = {k: [v for kk, v in seq[1:] if kk == k and v is not None] for k in ("on", "off")}
            text += " (A/B runs' means: " + ", ".join(
                f"{k} {_f(sum(v) / len(v))} of {len(v)}" for k, v in means.items() if v) + ")"
        ms = {k: [r["decode_ms_per_step"] for r in ab if ("on" if r.get(flag) else "off") == k
                  and r.get("decode_ms_per_step")] for k in ("on", "off")}
        if ms["on"] and ms["off"]:  # bench/e2e.py decode_ms_per_step: free of the runs' differing acceptance
            text += "; ms per tree step, A/B runs' means: " + ", ".join(
                f"{k} {sum(v) / len(v):.2f}" for k, v in ms.items())
        return text

    return _ab_lines(arms, batches, cell, title)


# bench/e2e.py SWITCH_ABS: the arm JSON's key of each switch A/B -> (its runs' flag, the report's title)
SWITCH_AB_TITLES: dict[str, tuple[str, str]] = {
    "device_topology_ab": ("device_topology", "Device topology of full-graph steps on / off on the same engine, decode "
                           "tokens/s (clean runs in this order; VLLM_TFM_DEVICE_TOPOLOGY, runtime/device_topology.py):"),
    "commit_reuse_ab": ("commit_reuse", "The commit's reuse across full-graph replays on / off on the same engine, "
                        "decode tokens/s (clean runs in this order; VLLM_TFM_COMMIT_REUSE, runtime/step_kernels.py):"),
    "early_sampled_copy_ab": ("early_sampled_copy", "The sampled tokens' copy before the commit (on) / after it (off) "
                              "on the same engine, decode tokens/s (clean runs in this order; "
                              "VLLM_TFM_EARLY_SAMPLED_COPY, runtime/deferred_drafts.py):"),
    "gdn_metadata_fast_ab": ("gdn_metadata_fast", "The GDN metadata's fast build on all-spec full-graph steps on / off "
                             "on the same engine, decode tokens/s (clean runs in this order; "
                             "VLLM_TFM_GDN_METADATA_FAST, runtime/gdn_metadata.py):"),
    "weaver_lazy_tail_ab": ("weaver_lazy_tail", "The Weaver graphs' tail check read after the forward (on) / waited "
                            "for before it (off) on the same engine, decode tokens/s (clean runs in this order; "
                            "VLLM_TFM_WEAVER_LAZY_TAIL, runtime/weaver_graphs.py):"),
    "kv_compact_kernel_ab": ("kv_compact_kernel", "The K/V compaction of the accepted paths in one kernel launch (on) / "
                             "a gather and a scatter per attention layer (off) on the same engine, decode tokens/s "
                             "(clean runs in this order; VLLM_TFM_KV_COMPACT_KERNEL, runtime/commit.py):"),
    "greedy_accept_kernel_ab": ("greedy_accept_kernel", "All-greedy tree acceptance in one kernel launch after the "
                                "argmax (on) / the torch path (off) on the same engine, decode tokens/s (clean runs in "
                                "this order; VLLM_TFM_GREEDY_ACCEPT_KERNEL, runtime/sampler.py):"),
    "one_slot_commit_ab": ("one_slot_commit", "One-slot engines' commit indices from the slot column 0, one copy per "
                           "step (on) / the general path's gather and copies per KV-cache group (off) on the same "
                           "engine, decode tokens/s (clean runs in this order; VLLM_TFM_ONE_SLOT_COMMIT, "
                           "runtime/step_kernels.py):"),
    "context_order_kernel_ab": ("context_order_kernel", "The drafter's context order of a tree step's rows in one "
                                "kernel launch (on) / the torch argsort (off) on the same engine, decode tokens/s "
                                "(clean runs in this order; VLLM_TFM_CONTEXT_ORDER_KERNEL, runtime/drafter_inputs.py):"),
    "commit_overlap_ab": ("commit_overlap", "A tree step's commit on its own CUDA stream beside the drafting (on) / "
                          "before it on the drafting's stream (off) on the same engine, decode tokens/s (clean runs in "
                          "this order; VLLM_TFM_COMMIT_OVERLAP, runtime/commit_overlap.py):"),
    "drafter_graphs_ab": ("drafter_graphs", "The DFlash drafter's query forward in one full CUDA graph per size (on) / "
                          "vLLM's piecewise drafter graphs (off) on the same engine, decode tokens/s (clean runs in this "
                          "order, after an unrecorded run that captured the graphs; VLLM_TFM_DRAFTER_GRAPHS, "
                          "runtime/drafter_graphs.py):"),
    "topk_kernel_ab": ("topk_kernel", "The DFlash top-K of the Weaver build in one kernel launch (on) / torch.topk (off) "
                       "on the same engine, decode tokens/s (clean runs in this order, after an unrecorded run that "
                       "captured the off setting's Weaver graphs; VLLM_TFM_TOPK_KERNEL, runtime/tree_builder_gpu.py):"),
    "prompt_overlap_ab": ("prompt_overlap", "The Weaver's prompt pass on its own stream beside the DFlash top-K (on) / "
                          "after it (off) on the same engine, decode tokens/s (clean runs in this order, after an "
                          "unrecorded run that captured the off setting's Weaver graphs; VLLM_TFM_WEAVER_PROMPT_OVERLAP, "
                          "runtime/tree_builder_gpu.py):"),
}


TIMELINE_POINTS = (
    "runner.execute_model:start", "runner._build_attention_metadata:start", "runner._preprocess:start",
    "runner._model_forward:start", "runner._sample:start", "runner._update_states_after_model_execute:start",
    "drafter.propose:start", "runner._bookkeeping_sync:start", "runner._bookkeeping_sync:end", "scheduler.schedule:start",
)


def _timeline_table(arms: dict[str, Any], b: int) -> list[str]:
    """Markdown lines of a typical step's timeline at batch ``b`` (``bench/e2e.py --host-spans``:
    ``host_spans.timeline``), for the arms that have one: at each point, ms since the step's start when
    the host got there and when the GPU did (CUDA events), and the GPU's backlog there (0: the GPU
    waited for the host)."""
    out = []
    for name, arm in arms.items():
        tl = (((_batch(arm, b) or {}).get("host_spans") or {}).get("timeline") or {})
        rows = {r["point"]: r for r in tl.get("points") or []}
        pts = [p for p in TIMELINE_POINTS if p in rows]
        if not pts:
            continue
        length = f", a step {_f(tl['step_ms'], '{:.2f}')} ms" if tl.get("step_ms") is not None else ""
        out += ["", (f"Where a typical {name} step waits at batch {b} (host-spans run, medians over {tl.get('steps')} "
                     f"steps{length}; ms since the step's start; GPU backlog 0.0: the GPU waits for the host):"), "",
                "| point | host at | GPU at | GPU backlog |", "| --- | --- | --- | --- |"]
        out += [f"| {p} | {_f(rows[p]['host_ms'], '{:.2f}')} | {_f(rows[p]['gpu_ms'], '{:.2f}')} | "
                f"{_f(rows[p]['gpu_behind_ms'], '{:.2f}')} |" for p in pts]
    return out


def _forward_split_table(arms: dict[str, Any], b: int) -> list[str]:
    """Markdown lines of the target-forward split at batch ``b`` (none when no arm ran tree steps)."""
    split_rows, any_tree = [], False
    for name, arm in arms.items():
        prof = (_batch(arm, b) or {}).get("profiled") or {}
        stages = prof.get("stages")
        if not stages:
            continue
        f = forward_split(stages)
        tree = f["gdn_tree"] is not None or f["attention_tree"] is not None
        any_tree = any_tree or tree
        frac = f["tree_fraction"] if tree else None
        layers = [_f(f["gdn_layers_per_step"], "{:g}"), _f(f["attention_layers_per_step"], "{:g}")]
        cells = [
            _f(f["target_forward"], "{:.2f}"),
            _with_host(f["gdn_tree"], f["gdn_tree_host"]),
            _f(f["gdn_tree_conv"], "{:.2f}"),
            _f(f["gdn_tree_verify"], "{:.2f}"),
            _f(f["gdn_layer"], "{:.2f}"),
            _with_host(f["attention_tree"], f["attention_tree_host"]),
            _f(f["attention_layer"], "{:.2f}"),
            _f(f["rest_of_forward"], "{:.2f}"),
            _f(None if frac is None else 100 * frac, "{:.1f}%"),
            "/".join(layers),
            _f(prof.get("timer_host_ms_per_step"), "{:.2f}"),
        ]
        split_rows.append(f"| {name} | " + " | ".join(cells) + " |")
    if any_tree:  # arms without tree steps show their whole forward as the rest
        return [
            "",
            (f"Target forward split per decode step at batch {b}, milliseconds (sums over the layers of a step; "
             "host ms in parentheses; rest = target forward - GDN tree - attention tree):"),
            "",
            ("| arm | target forward | GDN tree (host) | tree conv | tree verify | GDN op | attention tree (host) | "
             "attention op | rest of forward | tree paths / forward | layers per step (GDN/attention) | "
             "timer host cost |"),
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
            *split_rows,
        ]
    return []


def _with_host(device: float | None, host: float | None) -> str:
    return "-" if device is None else f"{device:.2f} ({_f(host, '{:.2f}')})"


def _ok(v: bool | None) -> str:
    return "not measured" if v is None else ("met" if v else "not met")


def write_doc(doc: str | Path, table: str, results_path: str | None = None) -> None:
    """Replace the text between :data:`BEGIN` and :data:`END` of ``doc`` with ``table`` (headed by
    its source file when ``results_path`` is given)."""
    path = Path(doc)
    text = path.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{path}: missing the markers {BEGIN} / {END}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    source = f"From `{results_path}`:\n\n" if results_path else ""
    path.write_text(f"{head}{BEGIN}\n{source}{table}{END}{tail}")


def load_results(path: str | Path) -> dict[str, Any]:
    """A results file of ``bench/e2e.py``: JSON, or gzip-compressed JSON when the name ends in ``.gz``
    (how the repository stores the larger ones)."""
    import gzip

    p = Path(path)
    raw = gzip.decompress(p.read_bytes()) if p.suffix == ".gz" else p.read_bytes()
    return json.loads(raw)


def render_files(paths: list[str]) -> str:
    """The tables of one or more results files, each under a heading naming its file."""
    if len(paths) == 1:
        return render_markdown(load_results(paths[0]))
    return "".join(f"### `{p}`\n\n{render_markdown(load_results(p))}\n" for p in paths)


_NOT_COMPARED = ("plans", "deadline_s", "host_profile")  # planning and debugging inputs, not what was measured


def _comparable(section: dict[str, Any] | None, skip: tuple[str, ...]) -> dict[str, Any]:
    return {k: v for k, v in (section or {}).items() if k not in _NOT_COMPARED + skip}


def _check_mergeable(paths: list[str], runs: list[dict[str, Any]], sequential: bool) -> None:
    """Raise unless every run has the first one's format, machine and settings (and, for runs at the
    same time, its profile; runs one after another may differ in profile and ``max_model_len``)."""
    first = runs[0]
    keys = {"settings": ("max_model_len",) if sequential else ()}
    if not sequential:
        keys["profile"] = ()
    for p, r in zip(paths[1:], runs[1:]):
        if r.get("format") != RESULTS_FORMAT or r.get("machine") != first.get("machine"):
            raise ValueError(f"{p}: another results format or machine than {paths[0]}")
        for key, skip in keys.items():
            if _comparable(first.get(key), skip) != _comparable(r.get(key), skip):
                raise ValueError(f"{p}: {key} differ from {paths[0]}'s")


def _repeated_arm(name: str, arm: dict[str, Any], command: str) -> dict[str, Any]:
    """What a later run of an arm that is already merged keeps: its command and tokens/s per batch."""
    batches = {b: {k: run.get(k) for k in ("tokens_per_s", "decode_tokens_per_s")}
               for b, run in (arm.get("batches") or {}).items()}
    return {"arm": name, "command": command, "batches": batches}


def _per_arm_profile(runs: list[dict[str, Any]], arms_of_run: list[list[str]]) -> dict[str, Any]:
    """The merged ``profile`` of runs whose profiles differ: one entry per source with the arms it fed."""
    sources: list[dict[str, Any]] = []
    for r, names in zip(runs, arms_of_run):
        prof = r.get("profile") or {}
        entry = next((s for s in sources if s["source"] == prof.get("source")), None)
        if entry is None:
            entry = {"source": prof.get("source"), "measured": prof.get("measured"),
                     "temperature": prof.get("temperature"), "arms": []}
            sources.append(entry)
        entry["arms"] += names
    temps = {s["temperature"] for s in sources}
    return {
        "per_arm": True,
        "source": "per arm: " + "; ".join(f"{', '.join(s['arms'])}: {s['source']}" for s in sources),
        "measured": all(bool(s["measured"]) for s in sources),
        "temperature": temps.pop() if len(temps) == 1 else None,
        "sources": sources,
    }


def merge_results(paths: list[str], note: str, sequential: bool = False) -> dict[str, Any]:
    """One results file from several runs of ``bench/e2e.py``, so that ratios compare them; every file's
    command is kept and ``note`` says how they ran.

    By default the runs ran at the same time on GPUs of one host (e.g. ``bench/run_gpu_pair.sh``:
    no-spec on one GPU, tfm on the other): settings and profile must agree and an arm may be in one
    file only. With ``sequential`` they ran one after another on the same machine: the profile and
    ``settings.max_model_len`` may differ (each arm records its file's profile source in
    ``profile_source``; the merged ``profile`` lists the sources per arm and ``max_model_len`` becomes
    a value per arm where the files differ), and an arm in more than one file keeps the first file's
    run while the later runs go to ``repeated_arms`` (command and tokens/s), for the run-to-run spread."""
    runs = [load_results(p) for p in paths]
    _check_mergeable(paths, runs, sequential)
    first = runs[0]
    merged = dict(first)
    merged["command"] = " + ".join(r["command"] for r in runs)
    merged["merged_from"] = [{"command": r["command"], "arms": list(r.get("arms") or {})} for r in runs]
    merged["merge_note"] = note
    merged["arms"] = {}
    merged["skipped"] = []
    repeated: list[dict[str, Any]] = []
    arms_of_run: list[list[str]] = []
    for r in runs:
        kept = []
        for name, arm in (r.get("arms") or {}).items():
            if name in merged["arms"]:
                if not sequential:
                    raise ValueError(f"arm {name} is in more than one file")
                repeated.append(_repeated_arm(name, arm, r["command"]))
                continue
            merged["arms"][name] = {**arm, "profile_source": (r.get("profile") or {}).get("source")} if sequential else arm
            kept.append(name)
        arms_of_run.append(kept)
        merged["skipped"] += list(r.get("skipped") or [])
    if sequential:
        merged["sequential"] = True
        merged["repeated_arms"] = repeated
        merged["settings"] = _sequential_settings(runs, arms_of_run)
        if any(r.get("profile") != first.get("profile") for r in runs[1:]):
            merged["profile"] = _per_arm_profile(runs, arms_of_run)
    return merged


def _sequential_settings(runs: list[dict[str, Any]], arms_of_run: list[list[str]]) -> dict[str, Any]:
    """The first run's settings with every run's arm plans, and ``max_model_len`` per arm where the
    runs' values differ (each engine is sized for its own arms)."""
    settings = dict(runs[0].get("settings") or {})
    plans: dict[str, Any] = {}
    for r in runs:
        for name, plan in ((r.get("settings") or {}).get("plans") or {}).items():
            plans.setdefault(name, plan)
    settings["plans"] = plans
    lens = [(r.get("settings") or {}).get("max_model_len") for r in runs]
    if len(set(lens)) > 1:
        settings["max_model_len"] = {name: n for n, names in zip(lens, arms_of_run) for name in names}
    return settings


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="bench/e2e.py results JSON files")
    ap.add_argument("--write", help="a markdown doc with the e2e markers to refresh (e.g. docs/e2e.md)")
    ap.add_argument("--merge", help="write the arms of all RESULTS files (runs at the same time on GPUs of one host) "
                                    "into this one results file, then report it")
    ap.add_argument("--merge-sequential", action="store_true",
                    help="with --merge: the runs ran one after another on the same machine (profiles and "
                         "max_model_len may differ; a repeated arm keeps its first run, the others are listed)")
    ap.add_argument("--merge-note", help="how the merged runs ran (default: one per GPU of one host at the same "
                                         "time, or one after another on one machine with --merge-sequential)")
    args = ap.parse_args(argv)
    if args.merge:
        note = args.merge_note or ("arms ran one after another on one machine" if args.merge_sequential
                                   else "arms ran at the same time, one per GPU of one host")
        merged = merge_results(args.results, note, sequential=args.merge_sequential)
        Path(args.merge).write_text(json.dumps(merged, separators=(",", ":")) + "\n")
        args.results = [args.merge]
    table = render_files(args.results)
    if args.write:
        write_doc(args.write, table, args.results[0] if len(args.results) == 1 else None)
        print(f"wrote {args.write}")
    else:
        sys.stdout.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
