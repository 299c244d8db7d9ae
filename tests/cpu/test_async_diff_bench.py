"""bench/async_diff.py's comparison on made-up probe records: the first record whose fields differ,
per request, named by its field; float sums within the tolerance are equal; records of only one
engine are counted, not compared."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import async_diff as ad


def _write(path: Path, recs: list[dict[str, Any]]) -> None:
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")


def _steps(s0_late: float, out_late: list[int]) -> list[dict[str, Any]]:
    return [
        {"k": "step", "phase": "b8", "r": "0", "nc": 10, "n": 3, "ids": [1, 2, 3], "pos": [10, 11, 11], "a": 1,
         "s0_all": [1.0], "x_sum": [2.0, 3.0], "out": [5, -1, -1]},
        {"k": "draft", "phase": "b8", "r": "0", "nc": 11, "next": 5, "rej": 1, "seq_len": 13, "ctx_ids": [1, 2],
         "ctx_h": [0.5, 0.25], "tokens": [7, 8], "parents": [-1, 0, 0]},
        {"k": "step", "phase": "b8", "r": "0", "nc": 11, "n": 3, "ids": [5, 7, 8], "pos": [11, 12, 12], "a": 1,
         "s0_all": [s0_late], "x_sum": [2.0, 3.0], "out": out_late},
    ]


def test_first_divergence_names_the_field(tmp_path: Path) -> None:
    _write(tmp_path / f"{ad.ENGINES[0]}.probe.jsonl", _steps(1.5, [7, 9, -1]))
    _write(tmp_path / f"{ad.ENGINES[1]}.probe.jsonl", _steps(1.6, [4, -1, -1]))
    res = ad.compare(tmp_path)
    b8 = res["b8"]
    assert b8["requests_diverging"] == 1 and b8["first_field_counts"] == {"step:s0_all": 1}
    first = b8["first_divergences"][0]
    assert first["nc"] == 11 and first["fields"] == ["s0_all", "out"] and first["async"]["s0_all"] == [1.6]


def test_noise_below_tolerance_is_equal_and_unpaired_records_are_counted(tmp_path: Path) -> None:
    a = _steps(1.5, [7, 9, -1])
    b = _steps(1.5 * (1 + 1e-6), [7, 9, -1])
    b[1]["ctx_h"] = [0.5 * (1 + 1e-6), 0.25]
    b.append({"k": "step", "phase": "b8", "r": "0", "nc": 14, "n": 1, "ids": [9], "pos": [14], "a": 1, "out": [3]})
    _write(tmp_path / f"{ad.ENGINES[0]}.probe.jsonl", a)
    _write(tmp_path / f"{ad.ENGINES[1]}.probe.jsonl", b)
    res = ad.compare(tmp_path)
    assert res["b8"]["requests_diverging"] == 0
    assert res["b8"]["record_pairs"] == {"sync_only": 0, "async_only": 1, "both": 3}
    assert res["b1"]["requests"] == 0


def test_a_draft_before_the_step_at_the_same_count(tmp_path: Path) -> None:
    """At one token count the drafter's record (made after the previous step) comes first: a difference in
    the drafts is reported there, not in the step that verified them."""
    a = _steps(1.5, [7, 9, -1])
    b = _steps(1.5, [7, -1, -1])
    b[1]["tokens"] = [7, 6]
    _write(tmp_path / f"{ad.ENGINES[0]}.probe.jsonl", a)
    _write(tmp_path / f"{ad.ENGINES[1]}.probe.jsonl", b)
    first = ad.compare(tmp_path)["b8"]["first_divergences"][0]
    assert first["kind"] == "draft" and first["fields"] == ["tokens"]


def test_another_engine_pair_is_compared_from_its_own_files(tmp_path: Path) -> None:
    pair = ad.engine_pair("tfm-eager, tfm-eager-async")
    assert pair == ("tfm-eager", "tfm-eager-async")
    _write(tmp_path / "tfm-eager.probe.jsonl", _steps(1.5, [7, 9, -1]))
    _write(tmp_path / "tfm-eager-async.probe.jsonl", _steps(1.5, [7, 8, -1]))
    res = ad.compare(tmp_path, engines=pair)
    assert res["engines"] == ["tfm-eager", "tfm-eager-async"] and res["b8"]["first_field_counts"] == {"step:out": 1}


def test_engine_pair_refuses_what_it_cannot_compare() -> None:
    import pytest

    for text, msg in (("tfm-fullpw", "two engine names, the synchronous one first"),
                      ("tfm-fullpw,nospec-graphs", "'nospec-graphs' is not a tfm engine"),
                      ("tfm-eager-async,tfm-eager", "the first must schedule synchronously and the second asynchronously"),
                      ("tfm-eager,tfm-fullpw", "the first must schedule synchronously")):
        with pytest.raises(SystemExit, match=msg):
            ad.engine_pair(text)
