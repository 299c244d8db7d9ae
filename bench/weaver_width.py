#!/usr/bin/env python3
"""Does the Weaver's width w (nodes expanded per scorer call) cost acceptance? Acceptance replay
(``vllm_tfm.reference.replay``) of the toy zoo at one budget, greedy, for TfM at several widths
next to DDTree, TreeFlash and chain on the same held-out prompts and continuations.

usage: python3 bench/weaver_width.py [--zoo zoo] [--prompts 24] [--new-tokens 96] [--budget 64]
           [--widths 1,2,4,8] [--device cpu] [--threads 2] [--out FILE]
Prompts: held-out files (the trainer's split) of this machine's site-packages.
"""

from __future__ import annotations

import argparse
import json
import site
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from vllm_tfm.reference.drafters import make_proposer
from vllm_tfm.reference.evaluate import held_out_prompts
from vllm_tfm.reference.replay import replay_cell, target_continuations, target_states
from vllm_tfm.reference.zoo import load_zoo
from vllm_tfm.tree.weaver import default_weaver_width


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--zoo", default=str(REPO / "zoo"))
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--budget", type=int, default=64)
    ap.add_argument("--widths", default="1,2,4,8")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    m = load_zoo(args.zoo)
    m.target.to(args.device)
    for mod in (m.bundle.dflash, m.bundle.weaver, m.bundle.treeflash):
        mod.to(args.device)
    depth = m.bundle.dflash.config.block_size - 1
    prompts = held_out_prompts(site.getsitepackages(), Path(args.zoo) / "tokenizer", args.prompts, args.prompt_len,
                               args.prompt_len + args.new_tokens + depth, seed=0)
    ids = target_continuations(m.target, [w[: args.prompt_len] for w in prompts.windows], args.new_tokens + depth, 0.0, 0)
    final, taps = target_states(m.target, ids, m.bundle.dflash.config.target_layer_ids)
    arms = [("chain", "chain", {}), ("ddtree", "ddtree", {}), ("treeflash", "treeflash", {})]
    arms += [(f"tfm_w{w}", "tfm", {"width": int(w)}) for w in args.widths.split(",")]
    mal = {}
    for name, method, kw in arms:
        t0 = time.time()
        proposer = make_proposer(method, m.bundle, m.target, **kw)
        rec = replay_cell(proposer, args.budget, ids, final, taps, args.prompt_len, args.new_tokens)
        flat = [a for per in rec["accepted_per_step"] for a in per]
        mal[name] = sum(a + 1 for a in flat) / len(flat)
        print(f"{name:<10} MAL {mal[name]:.3f} over {len(flat)} steps ({time.time() - t0:.0f} s)", flush=True)
    res = {
        "command": "python3 bench/weaver_width.py " + " ".join(sys.argv[1:]),
        "prompts": {"count": args.prompts, "prompt_len": args.prompt_len, "info": {k: v for k, v in prompts.info.items() if k != "files"}},
        "new_tokens": args.new_tokens, "budget": args.budget, "temperature": 0.0,
        "default_width": default_weaver_width(args.budget), "device": args.device, "mal": mal,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
