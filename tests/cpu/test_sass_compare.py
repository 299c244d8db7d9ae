"""bench/sass_compare.py's verdict on two SASS texts: identical, the same up to register names, or how many
normalised lines differ (an instruction moved counts its two lines)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import sass_compare as sc

BASE = """        /*0000*/                   IMAD.MOV.U32 R1, RZ, RZ, c[0x0][0x28] ;
        /*0010*/                   S2UR UR4, SR_CTAID.X ;
        /*0020*/                   FFMA R40, R21, R49.reuse, R40 ;
        /*0030*/                   MOV R42, RZ ;
        /*0040*/                   EXIT ;"""


def test_identical_texts() -> None:
    assert sc.verdict(BASE, BASE) == ("identical", [])


def test_other_register_numbers_only() -> None:
    renamed = BASE.replace("R40", "R7").replace("R42", "R40").replace("UR4", "UR9")
    assert sc.verdict(BASE, renamed) == ("same up to register names", [])


def test_a_moved_instruction_is_two_lines() -> None:
    lines = BASE.splitlines()
    moved = "\n".join([lines[0], lines[3], lines[1], lines[2], lines[4]])
    v, diff = sc.verdict(BASE, moved)
    assert v == "differs: 2 lines"
    assert any(line.startswith("-") and "MOV R, RZ" in line for line in diff)


def test_another_opcode_differs() -> None:
    v, _ = sc.verdict(BASE, BASE.replace("FFMA", "FMUL"))
    assert v == "differs: 2 lines"


def test_normalise_drops_addresses_and_register_numbers() -> None:
    assert sc.normalise("        /*0a0*/   IADD3 R12, UR4, R3, RZ ;  ") == ["           IADD3 R, R, R, RZ ;"]


TWO_KERNELS = """	.section	.text.other,"ax",@progbits
        /*0000*/                   CS2R R2, SR_GLOBALTIMERLO ;
        /*0010*/                   EXIT ;
	.section	.text.solve,"ax",@progbits
        /*0000*/                   S2UR UR4, SR_CTAID.X ;
        /*0010*/                   CS2R R2, SR_GLOBALTIMERLO ;
        /*0020*/                   FFMA R40, R21, R49, R40 ;
        /*0030*/                   MOV R42, RZ ;
        //## a comment line, not an instruction
        /*0040*/                   CS2R R4, SR_GLOBALTIMERLO ;
        /*0050*/                   EXIT ;"""


def test_mark_segments_counts_one_kernels_instructions_between_its_timer_reads() -> None:
    # the named kernel's section only; a timer read opens its segment; lines without an address are not counted
    assert sc.mark_segments(TWO_KERNELS, "solve") == [1, 3, 2]
    assert sc.mark_segments(TWO_KERNELS, "other") == [0, 2]
    with pytest.raises(ValueError, match="no SASS section of kernel sol$"):
        sc.mark_segments(TWO_KERNELS, "sol")  # a prefix of another kernel's name
