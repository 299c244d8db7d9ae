#!/usr/bin/env python3
"""Mean accepted length of the graphs bench's zoo prompts by the CPU replay (torch path, no kernels).

``bench/gpu_graphs_e2e.py`` reports the GPU engines' mean accepted length on 32 zoo prompts. This
replays the same prompts on the CPU with the reference decoder (``vllm_tfm.reference.replay``: tfm,
B = 32, temperature 0, 64 new tokens, each prompt alone, the drafter's default Weaver width) so that
a change of the GPU number can be split into the prompts' part and the kernels' part.

Prompts: the committed ``bench/graphs_zoo_prompts.json`` (default), or ``--source-tree DIR``: the
windows ``gpu_graphs_e2e.py`` drew before that file existed, from DIR's ``vllm_tfm/*.py`` (e.g. a
``git archive <commit> vllm_tfm`` of an older commit; this is also how the file was made).

usage: python3 bench/zoo_prompt_mal.py [--source-tree DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "bench")]

from gpu_graphs_e2e import PROMPT_FILE, ZOO  # noqa: E402

from vllm_tfm.reference.replay import replay_cells  # noqa: E402
from vllm_tfm.reference.zoo import load_zoo  # noqa: E402


def source_windows(tree: Path, n: int = 32, seed: int = 1234) -> list[list[int]]:
    """Windows of 5..100 token ids of ``tree``'s vllm_tfm/*.py files over 4,000 bytes (zoo tokenizer)."""
    from tokenizers import Tokenizer

    rng = random.Random(seed)
    tok = Tokenizer.from_file(str(ZOO / "target" / "tokenizer.json"))
    texts = [p.read_text() for p in sorted((tree / "vllm_tfm").rglob("*.py")) if p.stat().st_size > 4000]
    out = []
    for i in range(n):
        ids = tok.encode(texts[i % len(texts)], add_special_tokens=False).ids
        length = rng.randint(5, 100)
        start = rng.randrange(0, max(1, len(ids) - length))
        out.append(ids[start : start + length])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--source-tree", type=Path, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    prompts = source_windows(args.source_tree) if args.source_tree else json.loads(PROMPT_FILE.read_text())["prompts"]
    models = load_zoo(ZOO)
    t0 = time.perf_counter()
    per_prompt, accepted_tokens, steps = [], 0.0, 0
    for p in prompts:
        cell = replay_cells(models.target, models.bundle, [p], len(p), ["tfm"], [32], [0.0], 64)[0]
        per_prompt.append({"mal": cell["mal"], "steps": cell["steps"]})
        accepted_tokens += cell["mal"] * cell["steps"]
        steps += cell["steps"]
    res = {"command": "python3 bench/zoo_prompt_mal.py " + " ".join(sys.argv[1:]),
           "prompts": str(args.source_tree or PROMPT_FILE.relative_to(REPO)), "budget": 32, "temperature": 0.0,
           "max_new_tokens": 64, "mal": accepted_tokens / steps, "steps": steps, "per_prompt": per_prompt,
           "seconds": round(time.perf_counter() - t0, 1)}
    print(f"MAL {res['mal']:.4f} over {steps} steps ({res['seconds']} s)")
    if args.out:
        Path(args.out).write_text(json.dumps(res) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
