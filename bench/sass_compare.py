#!/usr/bin/env python3
"""Compare a kernel's machine code (SASS) between the working tree and a git revision, without a GPU.

A refactor of a CUDA source (a loop body moved into a helper, a variant added behind a ``#if``) should leave
the default build's machine code alone. This compiles ``cuda/SOURCE`` of the working tree and of ``--base`` with
NVRTC for ``--arch`` (no ``-lineinfo``: line numbers would change the cubin), disassembles both with ``nvdisasm``
and prints, per option set, one of:

* ``identical``: the same SASS text;
* ``same up to register names``: the same instructions at the same addresses once register numbers are
  dropped (``R12`` -> ``R``, ``UR4`` -> ``R``): another register choice, no other change;
* ``differs: N lines``: N lines of the normalised SASS differ (``--show`` prints the diff).

With ``--segments KERNEL`` it also prints, for both, KERNEL's instructions between its timeline marks (each
``CtaTimeline::mark`` reads ``SR_GLOBALTIMERLO``): the straight-line code each timed phase runs through. Version 8's
solve kernel took 0.14-0.33 us per KB of a phase's code on an H100, whatever the phase did (bench/NOTES.md
section 78), so a phase's size is a prediction of its time.

``nvdisasm`` is not part of torch or cuda-python; PyPI's ``nvidia-cuda-nvdisasm`` wheel carries it
(``pip download --no-deps nvidia-cuda-nvdisasm``, unzip, ``nvidia/cu13/bin/nvdisasm``): pass ``--nvdisasm PATH``
or put it on PATH.

usage (repository root):
    python3 bench/sass_compare.py --source gdn_tree_verify_paths.cu --base d646a3e --segments gdn_tree_paths_solve \\
        --options "-DTFM_IN=1 -DGDN_K=128 -DGDN_V=128 -DP8_BV=64 -DP8_PATH=17 -DP8_GWARPS=16 -DP8_WARPS=16 -DP8_CLUSTER=1"
    python3 bench/sass_compare.py --source gdn_tree_verify_grouped.cu --base HEAD \\
        --options "-DTFM_IN=1 -DGDN_K=128 -DGDN_V=128 -DGDN_GROUP=3 -DG6_THREADS=512 -DG6_SOLVE=1 -DG6_CLUSTER=2 -DG6_PATH_REG=17" \\
        --options "-DTFM_IN=1 -DGDN_K=128 -DGDN_V=128 -DGDN_GROUP=3 -DG6_THREADS=256 -DG6_SOLVE=1 -DG6_CLUSTER=1 -DG6_PATH_REG=17"
"""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from io import BytesIO
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

_REGISTER = re.compile(r"\bU?R[0-9]+\b")
_ADDRESS = re.compile(r"/\*[0-9a-f]+\*/")


def normalise(sass: str) -> list[str]:
    """SASS lines with register numbers and address comments dropped (``R12`` / ``UR4`` -> ``R``)."""
    return [_REGISTER.sub("R", _ADDRESS.sub("", line)).rstrip() for line in sass.splitlines()]


def verdict(base: str, new: str) -> tuple[str, list[str]]:
    """(``identical`` / ``same up to register names`` / ``differs: N lines``, unified diff of the normalised lines)."""
    if base == new:
        return "identical", []
    a, b = normalise(base), normalise(new)
    if a == b:
        return "same up to register names", []
    diff = list(difflib.unified_diff(a, b, "base", "new", n=1, lineterm=""))
    changed = sum(1 for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---"))
    return f"differs: {changed} lines", diff


def mark_segments(sass: str, kernel: str) -> list[int]:
    """Instructions of ``kernel``'s section in ``nvdisasm -c`` output between its reads of the global timer: [before
    the first read, between the first and the second, ..., from the last to the end] (a read itself counts in the
    segment it opens). ValueError when the text holds no section of that kernel."""
    sections = re.split(r"\n\s*\.section\s+", "\n" + sass)
    body = next((sec for sec in sections if re.match(rf"\.text\.{re.escape(kernel)}\b", sec)), None)
    if body is None:
        raise ValueError(f"no SASS section of kernel {kernel}")
    counts = [0]
    for line in body.splitlines():
        if not _ADDRESS.search(line):
            continue
        if "SR_GLOBALTIMER" in line:
            counts.append(0)
        counts[-1] += 1
    return counts


def sources_at(rev: str, workdir: Path) -> Path:
    """The repository's cuda/ folder at ``rev``, extracted under ``workdir``."""
    data = subprocess.run(["git", "-C", str(REPO), "archive", rev, "cuda"], capture_output=True, check=True).stdout
    with tarfile.open(fileobj=BytesIO(data)) as tar:
        tar.extractall(workdir, filter="data")
    return workdir / "cuda"


def sass_of(source: str, cuda_dir: Path, options: list[str], arch: str, nvdisasm: str) -> str:
    from vllm_tfm.kernels import loader

    text, headers = loader.read_sources(source, cuda_dir)
    cubin = loader.compile_cubin(text, source, headers, ["--std=c++17", *options], arch)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--source", required=True, help="a file of cuda/, e.g. gdn_tree_verify_grouped.cu")
    ap.add_argument("--base", default="HEAD", help="the git revision to compare the working tree with")
    ap.add_argument("--options", action="append", required=True, help="one option set (NVRTC -D options); repeatable")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--nvdisasm", default=shutil.which("nvdisasm"), help="nvdisasm's path (default: from PATH)")
    ap.add_argument("--show", action="store_true", help="print the normalised diff of option sets that differ")
    ap.add_argument("--segments", metavar="KERNEL", help="also print KERNEL's instructions between its timeline marks")
    args = ap.parse_args(argv)
    if not args.nvdisasm or not Path(args.nvdisasm).is_file():
        ap.error("nvdisasm not found: pass --nvdisasm PATH (PyPI's nvidia-cuda-nvdisasm wheel carries it)")
    worst = 0
    with tempfile.TemporaryDirectory() as tmp:
        base_dir = sources_at(args.base, Path(tmp))
        for opts in args.options:
            options = opts.split()
            base = sass_of(args.source, base_dir, options, args.arch, args.nvdisasm)
            new = sass_of(args.source, REPO / "cuda", options, args.arch, args.nvdisasm)
            v, diff = verdict(base, new)
            print(f"{v:<28} {opts}")
            if args.show and diff:
                print("\n".join(diff))
            if args.segments:
                for name, text in (("base", base), ("new", new)):
                    seg = mark_segments(text, args.segments)
                    print(f"  {name:>4} {args.segments}: {sum(seg)} instructions; between marks (KB of 1,000 "
                          "bytes, 16 an instruction) " + " ".join(f"{c} ({c * 16 / 1000:.1f} KB)" for c in seg))
            worst = max(worst, 0 if v == "identical" else 1 if v.startswith("same") else 2)
    return worst


if __name__ == "__main__":
    sys.exit(main())
