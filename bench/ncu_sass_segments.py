#!/usr/bin/env python3
"""Where a kernel's instructions and warp stalls fall between its barriers, from Nsight Compute's source page.

``ncu -i REPORT --page source --csv --print-source sass`` prints one row per SASS instruction with its executed
count (warp-level) and its warp-stall samples. This splits the instructions, in address order, at every CTA
barrier (``BAR.SYNC``) and cluster barrier wait (``UCGABAR_WAIT``), so each segment is one of the kernel's phases
where its code is laid out in program order (verify version 6: loads, norms, gram, coefficients, projections with
phase 2b, outputs), and prints per segment the executed instructions, the stall samples, the opcodes that execute
most, and the stall reasons the samples name most (the page's ``stall_*`` columns: ``selected`` = issuing,
``long_sb`` = waiting on global or local memory, ``short_sb`` = on shared memory or MUFU, ``barrier``, ``wait``
= fixed latency, ``math`` / ``mio`` = a pipe or its queue full, ``not_selected`` = eligible, another warp issued). The issue floor follows: executed instructions / (CTAs x 4 schedulers) is the cycles a scheduler
needs at one instruction per cycle.

usage:  python3 bench/ncu_sass_segments.py source_sass.csv [--ctas 128] [--clock-ghz 1.86] [--json OUT]
(bench/run_gpu_gdn_ncu.sh runs it on the GPU host.)
"""

from __future__ import annotations

import argparse
import csv
import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

EXECUTED = "Instructions Executed"
SAMPLES = "Warp Stall Sampling (All Samples)"
BARRIERS = ("BAR.SYNC", "UCGABAR_WAIT")


@dataclass
class Segment:
    first_address: str
    executed: float = 0.0
    samples: float = 0.0
    opcodes: Counter[str] = field(default_factory=Counter)
    stalls: Counter[str] = field(default_factory=Counter)


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def opcode(sass: str) -> str:
    """``@!P0 IMAD.WIDE.U32 R2, ...`` -> ``IMAD``: the mnemonic without its predicate and modifiers."""
    words = sass.split()
    if words and words[0].startswith("@"):
        words = words[1:]
    return words[0].split(".")[0] if words else ""


def segments(rows: list[list[str]]) -> list[Segment]:
    """Rows of the source page's CSV (the header row holds ``Address``, ``Source`` and the two counters)."""
    start = next(i for i, r in enumerate(rows) if "Address" in r and "Source" in r)
    header = rows[start]
    col = {name: header.index(name) for name in ("Address", "Source", EXECUTED, SAMPLES)}
    reasons = {name[len("stall_"):]: i for i, name in enumerate(header) if name.startswith("stall_") and "(" not in name}
    out: list[Segment] = []
    cut = True
    for r in rows[start + 1:]:
        if len(r) < len(header):
            continue
        if cut:
            out.append(Segment(r[col["Address"]]))
            cut = False
        seg, sass = out[-1], r[col["Source"]].strip()
        executed = _number(r[col[EXECUTED]])
        seg.executed += executed
        seg.samples += _number(r[col[SAMPLES]])
        seg.opcodes[opcode(sass)] += executed
        for reason, i in reasons.items():
            seg.stalls[reason] += _number(r[i])
        cut = any(b in sass for b in BARRIERS)
    return out


def report(segs: list[Segment], ctas: int, clock_ghz: float, top: int = 6) -> dict[str, object]:
    executed = sum(s.executed for s in segs)
    samples = sum(s.samples for s in segs) or 1.0
    per_scheduler = executed / (ctas * 4)
    return {
        "executed": executed,
        "issue_floor_us": per_scheduler / (clock_ghz * 1e3),
        "segments": [{"first_address": s.first_address, "executed": s.executed,
                      "executed_share": s.executed / executed if executed else 0.0,
                      "samples_share": s.samples / samples,
                      "top_opcodes": s.opcodes.most_common(top),
                      "stall_shares": {k: v / s.samples for k, v in s.stalls.most_common(top) if s.samples and v}}
                     for s in segs if s.executed or s.samples],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", type=Path)
    ap.add_argument("--ctas", type=int, default=128, help="CTAs of the profiled launch")
    ap.add_argument("--clock-ghz", type=float, default=1.86, help="SM clock for the issue floor")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    with args.csv.open(newline="") as f:
        rep = report(segments(list(csv.reader(f))), args.ctas, args.clock_ghz)
    print(f"executed warp instructions {rep['executed']:.0f}; issue floor at one per scheduler-cycle "
          f"{rep['issue_floor_us']:.2f} us")
    for i, s in enumerate(rep["segments"]):  # type: ignore[arg-type]
        ops = " ".join(f"{o}:{c / s['executed'] * 100:.0f}%" for o, c in s["top_opcodes"] if s["executed"])
        why = " ".join(f"{k}:{v * 100:.0f}%" for k, v in s["stall_shares"].items())
        print(f"{i:2d} {s['first_address']} executed {s['executed_share'] * 100:5.1f}%  stalls "
              f"{s['samples_share'] * 100:5.1f}%  {ops}\n   stall reasons: {why}")
    if args.json:
        args.json.write_text(json.dumps(rep, indent=1))


if __name__ == "__main__":
    main()
