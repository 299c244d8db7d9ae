"""Pure logic of the preemption diagnostic (bench/gpu_preempt_repro.py): no torch, no vLLM.

Kept apart from the GPU script so the CPU tests check it (tests/cpu/test_preempt_reading.py):

* ``prompt_index_of``: vLLM's internal request ids (``"<external>-<8 hex>"``, the worker and the
  scheduler see these) mapped to prompt indices through the ``RequestOutput.request_id`` of each
  output (the external id);
* ``per_prompt_preemptions`` / ``per_prompt_counts``: the scheduler's preemption log (output
  position of each preemption) and the worker's ``resumed_requests`` counts, per prompt;
* ``compare_arm``: one arm's greedy tokens against the no-spec reference, with for every
  divergent prompt its first divergence, whether (and where) it was preempted before it, the
  reference's top-2 log-probability margin there and the rank of the arm's token in the
  reference's top tokens;
* ``reading``: which of the hypotheses the pattern over the arms supports.

Hypotheses (the names used in the result file):
  a  requests resumed after a preemption (recompute prefill of prompt + outputs) go wrong;
  b  a write with a wrong slot/block corrupts live data when the small pool recycles blocks
     (KV compaction, GDN commit, drafter context writes);
  c  vLLM's own decoding under preemption diverges too (no speculation, or its chain "dflash");
  d  GDN state offsets lost when vLLM removes / re-adds a request in its persistent batch;
  mixed  greedy requests go wrong only next to sampled ones / aborted ones (the soak's batches).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

Tokens = Sequence[Sequence[int]]
TopK = Sequence[Sequence[Sequence[float]]]  # per prompt, per position: [[token, logprob], ...] best first
NEAR_TIE = 1e-3  # a reference top-2 margin below this is within float32 prefill-vs-decode noise
SPEC_ARMS = ("tfm_small", "tfm_mixed", "tfm_big", "tfm_small_torch", "tfm_small_chain_forced", "dflash_small")
TFM_SMALL_VARIANTS = ("tfm_small_torch", "tfm_small_chain_forced")


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where ``a`` and ``b`` differ (the shorter length if one is a prefix); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def external_id(internal: str, known: Mapping[str, int]) -> str | None:
    """The external request id of an internal one: itself if known, else without vLLM's ``-<suffix>``."""
    if internal in known:
        return internal
    head, sep, _ = internal.rpartition("-")
    return head if sep and head in known else None


def prompt_index_of(output_request_ids: Sequence[str]) -> dict[str, int]:
    """External request id (``RequestOutput.request_id``) -> prompt index (outputs come in prompt order)."""
    index = {rid: i for i, rid in enumerate(output_request_ids)}
    if len(index) != len(output_request_ids):
        raise ValueError("duplicate request ids among the outputs")
    return index


def per_prompt_counts(counts: Mapping[str, int], index: Mapping[str, int]) -> dict[int, int]:
    """``{internal or external request id: count}`` (e.g. the worker's resumed_requests) -> {prompt: count}.
    Ids that match no output are kept under key -1 (summed), so a mapping error is visible."""
    out: dict[int, int] = {}
    for rid, n in counts.items():
        ext = external_id(str(rid), index)
        key = index[ext] if ext is not None else -1
        out[key] = out.get(key, 0) + int(n)
    return out


def per_prompt_preemptions(log: Sequence[Mapping[str, Any]], index: Mapping[str, int]) -> dict[int, list[int]]:
    """The scheduler's preemption log (``request_id``, ``num_output_tokens`` at the preemption) -> {prompt:
    sorted output positions at which it was preempted}; unmatched ids under -1."""
    out: dict[int, list[int]] = {}
    for e in log:
        ext = external_id(str(e["request_id"]), index)
        key = index[ext] if ext is not None else -1
        out.setdefault(key, []).append(int(e["num_output_tokens"]))
    return {k: sorted(v) for k, v in out.items()}


def _top_at(topk: TopK | None, prompt: int, pos: int) -> Sequence[Sequence[float]] | None:
    if topk is None or prompt >= len(topk) or pos >= len(topk[prompt]):
        return None
    return topk[prompt][pos]


def compare_arm(
    ref: Tokens,
    arm: Tokens,
    *,
    ref_topk: TopK | None = None,
    preemptions: Mapping[int, Sequence[int]] | None = None,
    resumed: Mapping[int, int] | None = None,
    only: Collection[int] | None = None,
) -> dict[str, Any]:
    """One arm against the reference, prompt by prompt (``only``: these prompts, e.g. the greedy
    ones of a mixed arm).

    Per divergent prompt: ``pos`` (first divergence), ``ref``/``arm`` tokens there, ``preempted_at``
    (output positions of its preemptions, scheduler log), ``resumed`` (worker count, tfm only),
    ``after_preemption`` (some preemption at an output position <= pos: the divergent token came
    after a resume), ``since_resume`` (pos minus the last such preemption position: 0 = the first
    token after the recompute prefill), ``ref_margin`` (reference top-1 minus top-2 log-probability
    at pos), ``arm_rank`` (rank of the arm's token in the reference's top list, 0 = best).
    """
    pre = preemptions or {}
    res = resumed or {}
    if len(ref) != len(arm):
        raise ValueError(f"{len(ref)} reference prompts but {len(arm)} in the arm")
    divergent: list[dict[str, Any]] = []
    compared = sorted(set(only)) if only is not None else list(range(len(ref)))
    if compared and not 0 <= compared[0] <= compared[-1] < len(ref):
        raise ValueError(f"prompts {compared} outside the {len(ref)} compared")
    for i in compared:
        a, b = ref[i], arm[i]
        pos = first_divergence(a, b)
        if pos is None:
            continue
        at = sorted(pre.get(i, []))
        before = [p for p in at if p <= pos]
        d: dict[str, Any] = {
            "index": i, "pos": pos, "ref": a[pos] if pos < len(a) else None, "arm": b[pos] if pos < len(b) else None,
            "preempted_at": at, "resumed": res.get(i, 0), "after_preemption": bool(before),
            "since_resume": pos - before[-1] if before else None, "ref_margin": None, "arm_rank": None,
        }  # fmt: skip
        top = _top_at(ref_topk, i, pos)
        if top:
            if len(top) >= 2:
                d["ref_margin"] = float(top[0][1]) - float(top[1][1])
            ranks = [r for r, (tok, _) in enumerate(top) if int(tok) == d["arm"]]
            d["arm_rank"] = ranks[0] if ranks else None
        divergent.append(d)
    preempted_prompts = sorted(k for k, v in pre.items() if k >= 0 and v)
    return {
        "compared": len(compared),
        "identical": len(compared) - len(divergent),
        "divergent_indices": [d["index"] for d in divergent],
        "divergent": divergent,
        "preempted_prompts": preempted_prompts,
        "resumed_prompts": sorted(k for k, v in res.items() if k >= 0 and v),
        "unmatched_ids": int(len(pre.get(-1, [])) + res.get(-1, 0)),
        "divergent_after_preemption": sum(d["after_preemption"] for d in divergent),
        "divergent_never_preempted": sum(not d["preempted_at"] for d in divergent),
        "divergent_at_resume_token": sum(d["since_resume"] == 0 for d in divergent),
        "divergent_near_tie": sum(d["ref_margin"] is not None and d["ref_margin"] < NEAR_TIE for d in divergent),
    }


def _state(arms: Mapping[str, Mapping[str, Any]], name: str) -> str:
    """'absent' | 'skipped' | 'failed' | 'identical' | 'diverged'."""
    a = arms.get(name)
    if a is None:
        return "absent"
    if a.get("skipped"):
        return "skipped"
    cmp = a.get("comparison")
    if a.get("error") or not cmp:
        return "failed"
    return "identical" if cmp["identical"] == cmp["compared"] else "diverged"


def _mixed_line(arms: Mapping[str, Mapping[str, Any]], st: Mapping[str, str], preempted: Any) -> str | None:
    """One line on tfm_mixed (greedy requests among sampled ones, with aborts), or None if absent."""
    s = st["tfm_mixed"]
    if s == "absent":
        return None
    if s not in ("identical", "diverged"):
        return f"tfm_mixed: {s}"
    c = arms["tfm_mixed"]["comparison"]
    pre = "" if preempted("tfm_mixed") else " but saw NO preemption (inconclusive)"
    if s == "identical":
        return f"tfm_mixed: greedy {c['identical']}/{c['compared']} identical ({arms['tfm_mixed'].get('preemptions')} preemptions){pre}"
    return (f"tfm_mixed: greedy {c['identical']}/{c['compared']} identical, divergent {c['divergent_indices']} "
            f"({c['divergent_after_preemption']} after a preemption of that request, {c['divergent_near_tie']} near ties; "
            f"{arms['tfm_mixed'].get('preemptions')} preemptions){pre}")  # fmt: skip


def _real(cmp: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """Divergences that are not near-ties of the reference (unknown margin counts as real)."""
    return [d for d in cmp["divergent"] if d["ref_margin"] is None or d["ref_margin"] >= NEAR_TIE]


def reading(arms: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Which hypotheses the per-arm pattern supports. ``arms[name]`` holds ``comparison`` (compare_arm's
    result), ``preemptions`` (vLLM's counter), ``skipped`` / ``error``, and for tfm arms ``tree_metrics``."""
    st = {name: _state(arms, name)
          for name in ("tfm_small", "tfm_mixed", "nospec_small", "dflash_small", "tfm_big", *TFM_SMALL_VARIANTS)}
    lines: list[str] = []
    support: dict[str, str] = {}

    def preempted(name: str) -> bool:
        return bool((arms.get(name) or {}).get("preemptions"))

    small = st["tfm_small"]
    mixed_line = _mixed_line(arms, st, preempted)
    if small in ("absent", "skipped", "failed"):
        lines.append(f"tfm_small {small}: no reading")
        if mixed_line:
            lines.append(mixed_line)
        return {"states": st, "support": support, "lines": lines}
    if not preempted("tfm_small"):
        lines.append("tfm_small saw no preemption: the workload did not reproduce the condition; lower the KV capacity")
    cmp = arms["tfm_small"]["comparison"]
    div = cmp["divergent"]
    if small == "identical":
        lines.append(f"tfm_small identical on all {cmp['compared']} prompts ({arms['tfm_small'].get('preemptions')} preemptions): "
                     "not reproduced this time")  # fmt: skip
    else:
        lines.append(f"tfm_small: {len(div)} of {cmp['compared']} prompts diverge; {cmp['divergent_after_preemption']} after a "
                     f"preemption of that request ({cmp['divergent_at_resume_token']} exactly at the first token after the "
                     f"resume), {cmp['divergent_never_preempted']} never preempted, {cmp['divergent_near_tie']} near ties")  # fmt: skip
        if cmp["unmatched_ids"]:
            lines.append(f"WARNING: {cmp['unmatched_ids']} preemption/resume records matched no output request id")
        if all(d["after_preemption"] for d in div):
            support["a"] = "supported: every divergent request diverged after its own preemption"
        else:
            support["a"] = "not alone: some divergent requests diverged before any preemption of their own"
        if any(not d["after_preemption"] for d in _real(cmp)):
            support["b"] = ("supported: requests that were not (yet) preempted diverge by more than a near tie, "
                            "so live data of running requests changed")  # fmt: skip
        else:
            support["b"] = "not indicated: no real divergence in a request that was not preempted first"
    if mixed_line:
        lines.append(mixed_line)
    if st["tfm_mixed"] == "diverged" and small == "identical":
        support["mixed"] = ("supported: greedy requests diverge only in the mixed batch (sampled neighbours, aborts), "
                            "not in the all-greedy one")  # fmt: skip
    elif st["tfm_mixed"] == "identical" and small == "diverged":
        support["mixed"] = "not needed: the all-greedy batch diverges, the mixed one does not"
    elif st["tfm_mixed"] == "diverged" and small == "diverged":
        support["mixed"] = "not specific: both the all-greedy and the mixed batch diverge"
    # vLLM's own paths under the same small pool
    vllm_side = []
    for name in ("nospec_small", "dflash_small"):
        s = st[name]
        if s == "diverged":
            c = arms[name]["comparison"]
            real = _real(c)
            what = f"{len(c['divergent'])} divergent ({len(real)} beyond near ties, {c['divergent_after_preemption']} after a preemption)"
            lines.append(f"{name}: {what}; {arms[name].get('preemptions')} preemptions")
            if real:
                vllm_side.append(name)
        elif s == "identical":
            note = "" if preempted(name) else " but saw NO preemption (inconclusive)"
            lines.append(f"{name}: identical{note}")
        else:
            lines.append(f"{name}: {s}")
    if vllm_side:
        support["c"] = f"supported: {', '.join(vllm_side)} diverge too (vLLM-side under preemption)"
    elif all(st[n] == "identical" and preempted(n) for n in ("nospec_small", "dflash_small")):
        support["c"] = "refuted: vLLM without speculation and with its chain dflash stay identical under preemption"
    elif st["dflash_small"] == "identical" and preempted("dflash_small"):
        support["c"] = "refuted for vLLM's chain spec decoding (dflash identical under preemption)"
    else:
        support["c"] = "undecided (arms missing, failed or not preempted)"
    big = st["tfm_big"]
    if big == "diverged":
        support["not_preemption"] = "tfm_big diverges without a small pool: the cause is not (only) preemption"
        lines.append(f"tfm_big: diverged on {arms['tfm_big']['comparison']['divergent_indices']} "
                     f"({arms['tfm_big'].get('preemptions')} preemptions)")  # fmt: skip
    elif big == "identical":
        lines.append(f"tfm_big: identical ({arms['tfm_big'].get('preemptions')} preemptions)")
    else:
        lines.append(f"tfm_big: {big}")
    tm = (arms["tfm_small"].get("tree_metrics") or {}) if "tfm_small" in arms else {}
    restored, moved = tm.get("accepted_restored"), tm.get("states_moved")
    if restored is not None or moved is not None:
        lines.append(f"tfm_small offsets: accepted_restored={restored}, states_moved={moved}")
        if small == "diverged" and support.get("b", "").startswith("supported") and (restored or moved):
            support["d"] = ("possible: divergent requests diverged without a preemption while the offsets fix-up ran "
                            f"({restored} restored, {moved} moved); see each request's left_out_steps")  # fmt: skip
        elif small == "diverged":
            support["d"] = "not indicated"
    for name in TFM_SMALL_VARIANTS:
        s = st[name]
        if s in ("identical", "diverged") and small in ("identical", "diverged"):
            c = arms[name]["comparison"]
            lines.append(f"{name}: {s} ({len(c['divergent'])} divergent: {c['divergent_indices']}; "
                         f"{arms[name].get('preemptions')} preemptions)")  # fmt: skip
        else:
            lines.append(f"{name}: {s}")
    if small == "diverged":
        if st["tfm_small_torch"] == "identical" and preempted("tfm_small_torch"):
            support["kernels"] = "the NVRTC kernels are implicated: the torch reference ops stay identical under preemption"
        elif st["tfm_small_torch"] == "diverged":
            support["kernels"] = "not kernel-specific: the torch reference ops diverge too"
        if st["tfm_small_chain_forced"] == "diverged":
            support["trees"] = "not specific to tree proposals: chains through the tree path diverge too"
        elif st["tfm_small_chain_forced"] == "identical" and preempted("tfm_small_chain_forced"):
            support["trees"] = "specific to tree proposals: chains through the tree path stay identical"
    return {"states": st, "support": support, "lines": lines}
