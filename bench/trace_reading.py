"""Reading tfm's request trace (``VLLM_TFM_TRACE``, vllm_tfm/vllm_plugin/runtime/trace.py) at a
greedy divergence: pure Python (no torch, no vLLM), used by bench/soak.py and
bench/gpu_preempt_repro.py, tested on CPU (tests/cpu/test_trace_reading.py).

* ``extract``: from the trace files, the records of the requests that diverged (two streaming
  passes: their records, then every record of the steps they shared with other requests);
* ``explain``: for one divergence (request, first differing output position), the records of that
  request up to a few steps after the position, the other requests of the steps around it with
  their sampling kind, and a short reading (``reading``): was it resumed after a preemption before
  the divergence, re-added after being left out, its GDN offsets restored or moved, verified by
  vLLM's sampler, its tree cut by the scheduler, a spec row behind a plain row in a chain step,
  ... or none of these;
* ``misordered_steps`` / ``mixed_step_summary``: the mixed non-tree steps whose spec rows do not
  lead the batch (vLLM 0.26 reads the gates of the spec rows behind a plain row at other tokens:
  docs/guarantees.md, "Fixed: greedy divergence in mixed chain steps"), per step and over a trace.

Request ids: the engine's ids are ``<external id>-<8 hex>``; ``vllm serve`` builds the external id
of a completion from the ``X-Request-Id`` header as ``cmpl-<header>-<choice>``, ``LLM.generate``
numbers them. ``index_from_header`` / ``index_from_map`` turn them into workload indices.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from itertools import groupby, pairwise
from pathlib import Path
from typing import Any

__all__ = [
    "MATE_KEYS",
    "TraceExtract",
    "explain",
    "extract",
    "index_from_header",
    "index_from_map",
    "iter_records",
    "misordered_steps",
    "mixed_step_summary",
    "reading",
    "record_at_position",
]

IndexOf = Callable[[str], "int | None"]
MATE_KEYS = ("n", "d", "t", "tree", "new", "res", "back", "fix", "acc")
"""What ``explain`` keeps of the other requests of a step."""
STEP_KEYS = ("tree", "dep", "lk", "prop", "new", "res", "back", "fix", "a0", "a", "n", "d", "acc")
"""What ``reading`` repeats of the divergent step's record."""
GDN_MISREAD = ("chain step with a plain row in front of this spec row (vLLM 0.26 mixed-batch GDN gate misread; "
               "fixed for tfm engines in runtime/gdn.py)")  # fmt: skip


def index_from_header(prefix: str) -> IndexOf:
    """Workload index of an engine request id whose ``X-Request-Id`` was ``<prefix><index>``."""
    pat = re.compile(r"(?:^|-)" + re.escape(prefix) + r"(\d+)-\d+-[0-9a-f]{8}$")

    def index_of(rid: str) -> int | None:
        m = pat.search(rid)
        return int(m.group(1)) if m else None

    return index_of


def index_from_map(external_to_index: Mapping[str, int]) -> IndexOf:
    """Workload index of an engine request id ``<external id>-<8 hex>`` (``LLM.generate``)."""

    def index_of(rid: str) -> int | None:
        if rid in external_to_index:
            return external_to_index[rid]
        head, sep, _ = rid.rpartition("-")
        return external_to_index.get(head) if sep else None

    return index_of


def iter_records(paths: Iterable[str | Path]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(file ordinal, record) of every step record in the files, in order. Headers and the
    truncation marker are skipped; a line cut short by a killed writer is skipped too."""
    for f, path in enumerate(paths):
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and "s" in rec and "r" in rec:
                    yield f, rec


class TraceExtract:
    """The records of some requests (by workload index) and of the steps they ran in."""

    def __init__(self) -> None:
        self.by_index: dict[int, list[dict[str, Any]]] = {}
        self.steps: dict[tuple[int, int], list[dict[str, Any]]] = {}  # (file, step) -> every record of the step
        self.files = 0
        self.records = 0
        self.truncated = False


def extract(paths: Sequence[str | Path], index_of: IndexOf, wanted: Iterable[int]) -> TraceExtract:
    """Two passes over ``paths``: the records of the ``wanted`` requests (each tagged ``f``, its
    file), then all records of the steps those requests were in."""
    want = set(wanted)
    ex = TraceExtract()
    ex.files = len(paths)
    keys: set[tuple[int, int]] = set()
    for f, rec in iter_records(paths):
        ex.records += 1
        i = index_of(str(rec["r"]))
        if i is not None and i in want:
            ex.by_index.setdefault(i, []).append({**rec, "f": f})
            keys.add((f, int(rec["s"])))
    if keys:
        for f, rec in iter_records(paths):
            k = (f, int(rec["s"]))
            if k in keys:
                ex.steps.setdefault(k, []).append(rec)
    for p in paths:
        with open(p, encoding="utf-8") as fh:
            ex.truncated = ex.truncated or any('"truncated"' in line for line in fh)
    return ex


def record_at_position(records: Sequence[Mapping[str, Any]], pos: int) -> int | None:
    """Index in ``records`` of the step that emitted output position ``pos`` (``no <= pos < no +
    len(out)``, tokens vLLM kept), else None."""
    for k, rec in enumerate(records):
        if rec.get("disc"):
            continue
        no, out = int(rec.get("no", -1)), rec.get("out") or []
        if no <= pos < no + len(out):
            return k
    return None


def _mixed_step(step: Sequence[Mapping[str, Any]]) -> dict[str, Any] | None:
    """One step's records (same ``f`` and ``s``): None unless it is a mixed non-tree step (spec rows
    and other rows, ``path`` not "tree"); else ``plain_in_front`` (the other rows with a lower
    ``row`` than the last spec row) and ``spec_behind`` (the spec rows behind the first other row),
    both empty when the spec rows lead."""
    rows = [rec for rec in step if "row" in rec]
    spec = [rec for rec in rows if rec.get("spec")]
    plain = [rec for rec in rows if not rec.get("spec")]
    if not spec or not plain or step[0].get("path") == "tree":
        return None
    first_plain, last_spec = min(int(rec["row"]) for rec in plain), max(int(rec["row"]) for rec in spec)
    return {
        "f": step[0].get("f"), "s": step[0]["s"], "path": step[0].get("path"),
        "plain_in_front": [{"row": rec["row"], "r": rec["r"], "n": rec.get("n")} for rec in plain if int(rec["row"]) < last_spec],
        "spec_behind": [{"row": rec["row"], "r": rec["r"], "n": rec.get("n")} for rec in spec if int(rec["row"]) > first_plain],
    }  # fmt: skip


def _mixed_steps(records: Iterable[Mapping[str, Any]]) -> Iterator[dict[str, Any]]:
    """``_mixed_step`` of every step; a step's records are consecutive (the tracer writes a step at once)."""
    for _, step in groupby(records, key=lambda rec: (rec.get("f"), rec["s"])):
        m = _mixed_step(list(step))
        if m is not None:
            yield m


def misordered_steps(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The misordered mixed non-tree steps of ``records`` (a step's records consecutive, steps told
    apart by file ``f`` and step ``s``): some row that vLLM does not verify as a spec decode sits in
    front of a spec row. Per step: ``f``, ``s``, ``path``, ``plain_in_front`` and ``spec_behind``
    (``row``, request id ``r``, ``n`` of each)."""
    return [m for m in _mixed_steps(records) if m["spec_behind"]]


def mixed_step_summary(records: Iterable[Mapping[str, Any]], index_of: IndexOf | None = None, first: int = 5) -> dict[str, Any]:
    """Over a whole trace: how many mixed non-tree steps, how many of them misordered, the requests
    that were spec rows behind a plain row (workload indices by ``index_of``, else request ids) and
    the ``first`` misordered steps (step, path, rows in front, number of spec rows behind)."""
    mixed = bad = 0
    indices: set[int] = set()
    ids: set[str] = set()
    firsts = []
    for m in _mixed_steps(records):
        mixed += 1
        if not m["spec_behind"]:
            continue
        bad += 1
        for x in m["spec_behind"]:
            i = index_of(str(x["r"])) if index_of is not None else None
            if i is None:
                ids.add(str(x["r"]))
            else:
                indices.add(i)
        if len(firsts) < first:
            firsts.append({"f": m["f"], "s": m["s"], "path": m["path"], "plain_rows": [x["row"] for x in m["plain_in_front"]],
                           "spec_rows_behind": len(m["spec_behind"])})  # fmt: skip
    return {"mixed_non_tree_steps": mixed, "misordered_mixed_steps": bad,
            "requests_behind_plain_row": [*sorted(indices), *sorted(ids)],
            "first_misordered": firsts}  # fmt: skip


def reading(records: Sequence[Mapping[str, Any]], k: int, pos: int,
            misordered: Sequence[Mapping[str, Any]] = ()) -> dict[str, Any]:  # fmt: skip
    """What happened to a request before (and at) the step ``records[k]`` that emitted the
    divergent output position ``pos``; ``misordered``: ``misordered_steps`` of (at least) the
    request's steps, to tell the steps at or before ``records[k]`` where it sat behind a plain row."""
    at = records[k]
    before = records[:k]
    upto = records[: k + 1]
    in_step = pos - int(at.get("no", 0))
    acc = int(at.get("acc", 0))
    r: dict[str, Any] = {
        "step": at.get("s"),
        "path": at.get("path"),
        "token_in_step": in_step,
        "token_kind": "accepted draft" if in_step < acc else "bonus",
        "step_flags": {key: at[key] for key in STEP_KEYS if key in at},
        "resumed_before": [rec.get("s") for rec in upto if rec.get("res")],
        "left_out_before": [rec.get("s") for rec in upto if rec.get("back")],
        "offsets_fixed_before": [f"{rec.get('s')}:{rec['fix']}" for rec in upto if rec.get("fix")],
        "vllm_sampler_steps_before": sum(1 for rec in before if rec.get("path") in ("chains", "sampler") and rec.get("d")),
        "native_sampler_steps_before": sum(1 for rec in before if rec.get("path") == "sampler" and rec.get("d")),
        "cut_trees_before": [rec.get("s") for rec in upto if rec.get("lk") == "cut"],
        "missed_lookups_before": [rec.get("s") for rec in upto if rec.get("lk") == "miss"],
        "steps_before": len(before),
        "gaps_before": sum(1 for a, b in pairwise(upto) if b.get("f") == a.get("f") and int(b["s"]) > int(a["s"]) + 1),
    }
    mine = {(rec.get("f"), rec.get("s")) for rec in upto}
    r["behind_plain_row_before"] = [m["s"] for m in misordered if (m.get("f"), m.get("s")) in mine
                                    and any(x["r"] == at.get("r") for x in m["spec_behind"])]  # fmt: skip
    found = []
    if r["behind_plain_row_before"]:
        steps = r["behind_plain_row_before"]
        found.append(f"step {steps[0]}: {GDN_MISREAD}" if len(steps) == 1 else f"steps {steps[-5:]}: {GDN_MISREAD}")
    if r["resumed_before"]:
        last = r["resumed_before"][-1]
        found.append(f"resumed after a preemption at step {last}" + (" (the divergent step itself)" if last == at.get("s") else ""))
    if r["left_out_before"]:
        found.append(f"re-added after being left out at steps {r['left_out_before'][-5:]}")
    if r["offsets_fixed_before"]:
        found.append(f"GDN offsets fixed at {r['offsets_fixed_before'][-5:]}")
    if at.get("path") in ("chains", "sampler"):
        found.append(f"the divergent step was verified by vLLM's sampler ({at.get('path')})")
    elif r["native_sampler_steps_before"]:
        found.append(f"{r['native_sampler_steps_before']} earlier steps verified by vLLM's sampler (needs_native_sampler)")
    if r["cut_trees_before"]:
        found.append(f"tree cut by the scheduler at steps {r['cut_trees_before'][-5:]}")
    if r["missed_lookups_before"]:
        found.append(f"drafts verified as a chain (zeroed or stale) at steps {r['missed_lookups_before'][-5:]}")
    r["found"] = found
    r["none_of_these"] = not found
    head = (f"diverged at output {pos}: token {in_step} ({r['token_kind']}) of step {at.get('s')} "
            f"({at.get('path')} path{', tree depth ' + str(at['dep']) if at.get('tree') else ''}, {acc} drafts accepted)")  # fmt: skip
    r["line"] = head + ("; " + "; ".join(found) if found else "; none of: resumed, left out, offsets fixed, vLLM's sampler, cut tree, "
                               "plain row in front")
    return r


def explain(
    ex: TraceExtract,
    index: int,
    pos: int,
    index_of: IndexOf,
    kinds: Mapping[int, str] | None = None,
    after_steps: int = 3,
    max_records: int = 120,
    mate_steps: int = 6,
) -> dict[str, Any]:
    """The trace at one divergence: this request's records up to ``after_steps`` of its steps
    after the divergent one (at most ``max_records``, the last ones), the other requests of its
    last ``mate_steps`` steps up to the divergent one and the ``after_steps`` after it (index,
    ``kinds[index]`` e.g. greedy / t=0.8, and ``MATE_KEYS``), and ``reading``."""
    recs = ex.by_index.get(index) or []
    if not recs:
        return {"error": "no trace records for this request", "trace_records_read": ex.records}
    k = record_at_position(recs, pos)
    if k is None:
        last = recs[-1]
        return {"error": f"no step emitted output {pos} (last record: step {last.get('s')}, outputs "
                         f"{last.get('no')}..{int(last.get('no', 0)) + len(last.get('out') or []) - 1})",
                "records": recs[-min(len(recs), 10):]}  # fmt: skip
    kept = recs[: k + 1 + after_steps]
    dropped = max(0, len(kept) - max_records)
    kept = kept[dropped:]
    mates = []
    for rec in recs[max(0, k - mate_steps + 1) : k + 1 + after_steps]:
        others = []
        for o in ex.steps.get((rec["f"], int(rec["s"])), []):
            if o["r"] == rec["r"]:
                continue
            i = index_of(str(o["r"]))
            m: dict[str, Any] = {"i": i} if i is not None else {"r": o["r"]}
            if kinds is not None and i is not None and i in kinds:
                m["kind"] = kinds[i]
            m.update({key: o[key] for key in MATE_KEYS if key in o})
            others.append(m)
        mates.append({"s": rec["s"], "path": rec.get("path"), "others": others})
    mine = [(rec["f"], int(rec["s"])) for rec in recs[: k + 1]]
    misordered = misordered_steps({**o, "f": key[0]} for key in mine for o in ex.steps.get(key, []))
    return {
        "divergent_step": recs[k]["s"],
        "records": kept,
        "records_dropped_before": dropped,
        "step_mates": mates,
        "reading": reading(recs, k, pos, misordered),
        "trace_truncated": ex.truncated,
    }
