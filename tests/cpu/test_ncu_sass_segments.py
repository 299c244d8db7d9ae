"""bench/ncu_sass_segments.py: Nsight Compute's per-instruction source page split at the kernel's barriers."""

from __future__ import annotations

import csv
import io
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import ncu_sass_segments as nss

HEADER = ["Address", "Source", "Warp Stall Sampling (All Samples)", "Warp Stall Sampling (Not-issued Samples)",
          "# Samples", "Instructions Executed", "stall_long_sb", "stall_barrier", "stall_long_sb (Not Issued)"]


def _page(instructions: list[tuple[str, int, int]]) -> list[list[str]]:
    """What ncu prints: a kernel-name row, the header, then (address, SASS, samples, -, -, executed, reasons) rows
    with thousands separators; an instruction's samples are long_sb except at a barrier (the not-issued column
    holds a different number, which must not be counted)."""
    text = io.StringIO()
    w = csv.writer(text)
    w.writerow(["Kernel Name", "k"])
    w.writerow(HEADER)
    for i, (sass, samples, executed) in enumerate(instructions):
        bar = "BAR" in sass
        w.writerow([hex(0x1000 + 16 * i), sass, f"{samples:,}", "0", "0", f"{executed:,}",
                    str(0 if bar else samples), str(samples if bar else 0), "999"])
    return list(csv.reader(io.StringIO(text.getvalue())))


def test_segments_split_after_each_barrier_and_count_opcodes():
    rows = _page([
        ("IMAD R1, R2, R3, R4", 3, 1000),
        ("@!P0 IMAD.WIDE.U32 R2, R4, R5, R6", 1, 2500),
        ("BAR.SYNC.DEFER_BLOCKING 0x0", 5, 64),
        ("HMMA.16816.F32.BF16 R8, R12, R16, R8", 2, 4000),
        ("UCGABAR_WAIT", 0, 64),
        ("FFMA R1, R2, R3, R1", 4, 1234),
        ("EXIT", 0, 64),
    ])
    segs = nss.segments(rows)
    assert [s.first_address for s in segs] == ["0x1000", "0x1030", "0x1050"]
    assert [s.executed for s in segs] == [3564.0, 4064.0, 1298.0]  # the barrier closes its own segment
    assert [s.samples for s in segs] == [9.0, 2.0, 4.0]
    assert segs[0].opcodes == {"IMAD": 3500.0, "BAR": 64.0}  # predicate and modifiers dropped
    assert segs[0].stalls == {"long_sb": 4.0, "barrier": 5.0}  # the "(Not Issued)" column left out
    rep = nss.report(segs, ctas=2, clock_ghz=1.0)
    total = 3564 + 4064 + 1298
    assert rep["executed"] == total
    assert rep["issue_floor_us"] == pytest.approx(total / 8 / 1e3)  # 2 CTAs x 4 schedulers at 1 GHz
    assert [s["executed_share"] for s in rep["segments"]] == pytest.approx([3564 / total, 4064 / total, 1298 / total])
    assert rep["segments"][1]["top_opcodes"][0] == ("HMMA", 4000.0)
    assert rep["segments"][0]["stall_shares"] == pytest.approx({"barrier": 5 / 9, "long_sb": 4 / 9})


def test_rows_before_the_header_and_short_rows_are_skipped():
    rows = [["==PROF== note"], *_page([("LDS R1, [R2]", 1, 10), ("STS [R1], R2", 1, 20)]), ["truncated"]]
    (seg,) = nss.segments(rows)
    assert seg.executed == 30.0 and seg.opcodes == {"LDS": 10.0, "STS": 20.0}
