#!/usr/bin/env python3
"""Version 6's outputs on the bench trees, saved or compared bit for bit: a check that a change of
cuda/gdn_tree_verify_grouped.cu that should not touch the arithmetic (a layout, a load order) did not.

Run once with the old sources (``VLLM_TFM_CUDA_DIR`` at a copy of the old ``cuda/``) and ``--save``, then
with the new ones and ``--against``; each in its own process (the loader caches compiled kernels).

usage (GPU host, repository root):
    VLLM_TFM_CUDA_DIR=/tmp/old/cuda python3 bench/gdn_v6_outputs.py --save /tmp/v6_old.pt
    python3 bench/gdn_v6_outputs.py --against /tmp/v6_old.pt      # exit code 1 if any output differs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
for p in (REPO, REPO / "bench"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from gdn_phases import phase_case  # noqa: E402

from vllm_tfm.kernels import gdn as kgdn  # noqa: E402

CASES = ((17, 1), (33, 8), (65, 1), (128, 1), (128, 8))  # (nodes per request, batch): the bench trees


def outputs() -> dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]]:
    res = {}
    for n, batch in CASES:
        plan, _, inputs, pool, slots = phase_case(n, batch)
        x = inputs[0]
        for solve in (0, 1):
            launches, o, d = kgdn.verify_launches(plan, x["q"], x["k"], x["v"], x["g"], x["beta"], pool, slots[0],
                                                  return_delta=True, variant=6, extra_options=(f"-DG6_SOLVE={solve}",))
            if [name for name, _ in launches] != ["gdn_tree_verify_grouped"]:
                sys.exit(f"version 6 did not take n={n} batch={batch}")
            launches[0][1]()
            res[(n, batch, solve)] = (o.cpu(), d.cpu())
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--save", metavar="FILE")
    mode.add_argument("--against", metavar="FILE")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gdn_v6_outputs.py needs a CUDA device")
    res = outputs()
    if args.save:
        torch.save(res, args.save)
        print(f"saved {len(res)} outputs to {args.save}")
        return
    old = torch.load(args.against)
    differ = 0
    for key, (o, d) in res.items():
        same = key in old and torch.equal(o, old[key][0]) and torch.equal(d, old[key][1])
        differ += not same
        print(f"n={key[0]} batch={key[1]} G6_SOLVE={key[2]}: {'bit for bit' if same else 'DIFFERENT'}")
    print(f"{len(res) - differ} of {len(res)} equal")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
