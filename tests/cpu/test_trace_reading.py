"""Reading the request trace at a greedy divergence (bench/trace_reading.py), on hand-written traces."""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
import trace_reading as tr


def _write(path: Path, records: list[dict]) -> Path:
    lines = [json.dumps({"trace": "vllm-tfm", "version": 1})] + [json.dumps(r) for r in records]
    path.write_text("\n".join(lines) + "\n")
    return path


def rec(s: int, r: str, no: int, out: list[int], **kw) -> dict:
    return {"s": s, "r": r, "row": 0, "n": 17, "d": 16, "spec": 1, "path": "tree", "no": no, "out": out,
            "acc": len(out) - 1, "t": 0.0, **kw}  # fmt: skip


A, B, C = "cmpl-load-3-0-0a1b2c3d", "cmpl-load-12-0-deadbeef", "cmpl-load-5-0-00000001"


def test_request_ids_to_workload_indices():
    of = tr.index_from_header("load-")
    assert [of(A), of(B), of("cmpl-load-7-1-abcdef12")] == [3, 12, 7]
    assert of("cmpl-xload-3-0-0a1b2c3d") is None and of("cmpl-load-3-0") is None and of("chatcmpl-9f") is None
    m = tr.index_from_map({"0": 0, "1": 1, "a-b": 2})
    assert [m("1-0123abcd"), m("a-b-0123abcd"), m("0"), m("7-0123abcd")] == [1, 2, 0, None]


def test_explain_a_divergence_after_a_resume(tmp_path):
    """Request 3: new (outputs 0..1), a step left out (gap), back with its offset restored
    (2..4), preempted, resumed with a recompute prefill (5), a tree step (6..8) whose second token
    is output 7 = the divergence, then two more steps. Request 12 shares steps 3..6, request 5
    step 6 only."""
    records = [
        rec(0, A, 0, [1, 2], new=1, d=0, spec=0, n=30),
        rec(0, B, 0, [9], new=1, d=0, spec=0, n=8, t=0.8),
        rec(2, A, 2, [3, 4, 5], back=1, a0=1, a=3, fix="restore"),
        rec(3, B, 1, [9, 9]),
        rec(4, B, 3, [9], lk="cut", prop=16, d=3, n=4),
        rec(5, A, 5, [6], res=1, d=0, spec=0, n=35, path="chains"),
        rec(5, B, 4, [9]),
        rec(6, A, 6, [7, 8, 9], tree=1, dep=4, lk="full", prop=16),
        rec(6, B, 5, [9], tree=1, dep=2),
        rec(6, C, 0, [4], new=1, d=0, spec=0, t=1.3),
        rec(7, A, 9, [10]),
        rec(8, A, 10, [11]),
        rec(9, A, 11, [12]),
        rec(10, A, 12, [13]),
    ]
    path = _write(tmp_path / "trace-1.jsonl", records)
    with open(path, "a") as f:
        f.write('{"s": 11, "r": "cut sho')  # a line cut short by a killed writer
    of = tr.index_from_header("load-")
    ex = tr.extract([path], of, [3])
    assert ex.records == 14 and not ex.truncated and [r["s"] for r in ex.by_index[3]] == [0, 2, 5, 6, 7, 8, 9, 10]
    assert tr.record_at_position(ex.by_index[3], 7) == 3 and tr.record_at_position(ex.by_index[3], 99) is None
    out = tr.explain(ex, 3, 7, of, kinds={3: "greedy", 12: "t=0.8 stream", 5: "t=1.3"}, after_steps=2, mate_steps=2)
    assert out["divergent_step"] == 6 and [r["s"] for r in out["records"]] == [0, 2, 5, 6, 7, 8]
    assert out["records_dropped_before"] == 0
    assert out["step_mates"] == [
        {"s": 5, "path": "chains", "others": [{"i": 12, "kind": "t=0.8 stream", "n": 17, "d": 16, "t": 0.0, "acc": 0}]},
        {"s": 6, "path": "tree", "others": [{"i": 12, "kind": "t=0.8 stream", "n": 17, "d": 16, "t": 0.0, "tree": 1, "acc": 0},
                                            {"i": 5, "kind": "t=1.3", "n": 17, "d": 0, "t": 1.3, "new": 1, "acc": 0}]},
        {"s": 7, "path": "tree", "others": []},
        {"s": 8, "path": "tree", "others": []},
    ]  # fmt: skip
    rd = out["reading"]
    assert (rd["step"], rd["token_in_step"], rd["token_kind"]) == (6, 1, "accepted draft")
    assert rd["resumed_before"] == [5] and rd["left_out_before"] == [2] and rd["offsets_fixed_before"] == ["2:restore"]
    assert rd["vllm_sampler_steps_before"] == 0  # step 5 verified no drafts: a prefill
    assert rd["gaps_before"] == 2 and rd["steps_before"] == 3 and not rd["none_of_these"]
    assert rd["line"] == ("diverged at output 7: token 1 (accepted draft) of step 6 (tree path, tree depth 4, 2 drafts accepted); "
                          "resumed after a preemption at step 5; re-added after being left out at steps [2]; "
                          "GDN offsets fixed at ['2:restore']")  # fmt: skip
    # bounded: only the last max_records records are kept
    short = tr.explain(ex, 3, 7, of, after_steps=2, max_records=3)
    assert [r["s"] for r in short["records"]] == [6, 7, 8] and short["records_dropped_before"] == 3


def test_reading_of_a_plain_divergence_and_of_vllm_sampler_steps(tmp_path):
    records = [rec(0, A, 0, [1], new=1, d=0, spec=0), rec(1, A, 1, [2, 3, 4]), rec(2, A, 4, [5, 6], lk="cut", prop=16, d=5, n=6),
               rec(3, A, 6, [7], path="sampler", lk="off"), rec(4, A, 7, [8, 9], lk="miss")]  # fmt: skip
    of = tr.index_from_header("load-")
    ex = tr.extract([_write(tmp_path / "t.jsonl", records)], of, [3])
    plain = tr.explain(ex, 3, 3, of)["reading"]
    assert plain["none_of_these"] and plain["token_kind"] == "bonus" and plain["found"] == []
    assert plain["line"].endswith("none of: resumed, left out, offsets fixed, vLLM's sampler, cut tree, plain row in front")
    late = tr.explain(ex, 3, 8, of)["reading"]
    assert late["cut_trees_before"] == [2] and late["missed_lookups_before"] == [4] and late["native_sampler_steps_before"] == 1
    assert late["found"] == ["1 earlier steps verified by vLLM's sampler (needs_native_sampler)",
                             "tree cut by the scheduler at steps [2]",
                             "drafts verified as a chain (zeroed or stale) at steps [4]"]  # fmt: skip
    at_sampler = tr.explain(ex, 3, 6, of)["reading"]
    assert at_sampler["found"][0] == "the divergent step was verified by vLLM's sampler (sampler)"
    assert tr.explain(ex, 3, 50, of)["error"].startswith("no step emitted output 50")
    assert tr.explain(ex, 4, 0, of)["error"] == "no trace records for this request"


def test_records_of_two_engine_processes_do_not_mix_steps(tmp_path):
    """Step indices restart in each process's file: step mates are matched per file."""
    f1 = _write(tmp_path / "trace-1.jsonl", [rec(0, A, 0, [1]), rec(0, B, 0, [2])])
    f2 = _write(tmp_path / "trace-2.jsonl", [rec(0, C, 0, [3]), rec(1, A, 1, [4])])
    with open(f2, "a") as f:
        f.write(json.dumps({"truncated": True, "step": 2}) + "\n")
    of = tr.index_from_header("load-")
    ex = tr.extract([f1, f2], of, [3])
    assert ex.truncated and [(r["f"], r["s"]) for r in ex.by_index[3]] == [(0, 0), (1, 1)]
    out = tr.explain(ex, 3, 0, of)
    assert out["step_mates"][0]["others"] == [{"i": 12, "n": 17, "d": 16, "t": 0.0, "acc": 0}]
    assert out["trace_truncated"]


def row(s: int, r: str, i: int, spec: int, path: str = "chains", f: int | None = None, **kw) -> dict:
    """One record of a batch row (outputs not needed): spec rows verify 16 drafts, other rows are one-token decodes."""
    out = {"s": s, "r": r, "row": i, "n": 17 if spec else 1, "d": 16 if spec else 0, "spec": spec, "path": path, **kw}
    return out if f is None else {**out, "f": f}


def rid(i: int) -> str:
    return f"cmpl-load-{i}-0-{i:08x}"


# steps of one engine: 19 is the real one (row 0 spec, row 1 plain, rows 2..4 spec); 20 a tree step with the same rows;
# 21 all spec; 22 mixed with the spec rows first; 23 two plain rows in front of one spec row, a third plain row last
# (sampler path); 24 all plain; 25 mixed, spec rows lead, path plain
STEPS = [
    *[row(19, rid(i), i, int(i != 1)) for i in range(5)],
    *[row(20, rid(i), i, int(i != 1), path="tree") for i in range(5)],
    *[row(21, rid(i), i, 1) for i in range(5)],
    *[row(22, rid(i), i, int(i < 3)) for i in range(5)],
    *[row(23, rid(i), i, int(i == 2), path="sampler") for i in range(4)],
    *[row(24, rid(i), i, 0, path="plain") for i in range(3)],
    *[row(25, rid(i), i, int(i == 0), path="plain") for i in range(2)],
]


def test_misordered_steps_are_the_non_tree_mixed_steps_with_a_plain_row_in_front():
    found = tr.misordered_steps(STEPS)
    assert [(m["s"], m["path"]) for m in found] == [(19, "chains"), (23, "sampler")]
    s19, s23 = found
    assert s19["plain_in_front"] == [{"row": 1, "r": rid(1), "n": 1}]
    assert s19["spec_behind"] == [{"row": i, "r": rid(i), "n": 17} for i in (2, 3, 4)]  # row 0 leads: not behind
    assert [x["row"] for x in s23["plain_in_front"]] == [0, 1] and s23["spec_behind"] == [{"row": 2, "r": rid(2), "n": 17}]
    # the same step numbers in two engine processes' files are two steps
    two = [row(5, rid(0), 0, 0, f=0), row(5, rid(1), 1, 0, f=0), row(5, rid(2), 0, 1, f=1), row(5, rid(3), 1, 1, f=1)]
    assert tr.misordered_steps(two) == []


def test_summary_counts_mixed_and_misordered_steps():
    of = tr.index_from_header("load-")
    sm = tr.mixed_step_summary(STEPS, of)
    assert sm["mixed_non_tree_steps"] == 4 and sm["misordered_mixed_steps"] == 2  # 19, 22, 23, 25 mixed; 19, 23 misordered
    assert sm["requests_behind_plain_row"] == [2, 3, 4]
    assert sm["first_misordered"] == [{"f": None, "s": 19, "path": "chains", "plain_rows": [1], "spec_rows_behind": 3},
                                      {"f": None, "s": 23, "path": "sampler", "plain_rows": [0, 1], "spec_rows_behind": 1}]  # fmt: skip
    assert tr.mixed_step_summary(STEPS, first=1)["requests_behind_plain_row"] == [rid(i) for i in (2, 3, 4)]
    assert len(tr.mixed_step_summary(STEPS, first=1)["first_misordered"]) == 1


def test_reading_names_the_plain_row_in_front_only_for_requests_behind_it_at_or_before_the_divergence(tmp_path):
    """Step 19 as above, then a tree step 30 and a chain step 31 with a plain row 0 in front of
    spec rows 1..4 (one output per request per step). Request 3 (behind the plain row at step 19)
    diverging at step 30 gets the finding; request 0 (a spec row in front of the plain row, then the
    plain row) does not; request 1 (the plain row at 19) gets it only when it diverges at step 31,
    where it sat behind; request 4 diverging at step 19 itself gets it."""
    records = [{**r, "no": 0, "out": [1], "acc": 0, "t": 0.0} for r in STEPS[:5]]
    records += [{**row(30, rid(i), i, 1, path="tree"), "no": 1, "out": [2], "acc": 0, "t": 0.0} for i in range(5)]
    records += [{**row(31, rid(i), i, int(i != 0)), "no": 2, "out": [3], "acc": 0, "t": 0.0} for i in range(5)]
    of = tr.index_from_header("load-")
    path = _write(tmp_path / "trace-1.jsonl", records)
    ex = tr.extract([path], of, range(5))
    msg = ("chain step with a plain row in front of this spec row (vLLM 0.26 mixed-batch GDN gate misread; "
           "fixed for tfm engines in runtime/gdn.py)")  # fmt: skip
    r3 = tr.explain(ex, 3, 1, of)["reading"]
    assert r3["behind_plain_row_before"] == [19] and r3["found"][0] == "step 19: " + msg
    assert r3["line"] == "diverged at output 1: token 0 (bonus) of step 30 (tree path, 0 drafts accepted); step 19: " + msg
    assert tr.explain(ex, 4, 0, of)["reading"]["found"][0] == "step 19: " + msg
    for i, pos in ((0, 1), (0, 2), (1, 0), (1, 1)):
        rd = tr.explain(ex, i, pos, of)["reading"]
        assert rd["behind_plain_row_before"] == [] and not any(msg in x for x in rd["found"]), (i, pos, rd["found"])
    assert tr.explain(ex, 0, 1, of)["reading"]["none_of_these"]
    assert tr.explain(ex, 1, 2, of)["reading"]["found"] == ["step 31: " + msg, "the divergent step was verified by vLLM's sampler (chains)"]
    # behind at 19 and 31, diverging at 31: both steps named
    assert tr.explain(ex, 3, 2, of)["reading"]["found"][0].startswith("steps [19, 31]: chain step with a plain row")
    # reading alone: a misordered step of another file does not count
    recs3 = ex.by_index[3]
    other_file = [{**m, "f": 1} for m in tr.misordered_steps({**r, "f": 0} for r in STEPS[:5])]
    assert tr.reading(recs3, 1, 1, other_file)["behind_plain_row_before"] == []
    assert tr.reading(recs3, 1, 1, [{**m, "f": 0} for m in other_file])["behind_plain_row_before"] == [19]
