"""Models for the CPU demo: the trained toy zoo when present, else random tiny models.

Zoo layout looked for (a directory ``zoo``)::

    zoo/target/    a transformers checkpoint (config.json + safetensors) of the toy Qwen3.5 hybrid,
                   with its tokenizer files when it has one
    zoo/drafter/   a drafter directory (DFlash config.json + model.safetensors, tfm_config.json,
                   tfm/weaver.safetensors, tfm/treeflash.safetensors)

Search order: an explicit path, then ``$VLLM_TFM_ZOO``, then ``zoo/`` next to the ``vllm_tfm``
package (a source checkout), then ``vllm_tfm/zoo`` (an installed wheel).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from vllm_tfm.models import DrafterBundle, load_drafter_dir

from .toy_drafters import random_drafters
from .toy_targets import tiny_qwen3_5

__all__ = ["ZOO_ENV", "DemoModels", "zoo_search_paths", "is_zoo", "load_zoo", "random_demo_models"]

ZOO_ENV = "VLLM_TFM_ZOO"


@dataclass
class DemoModels:
    """A target, its drafters, an optional tokenizer, and where they came from."""

    target: nn.Module
    bundle: DrafterBundle
    tokenizer: object | None
    source: str  # "zoo" or "random"
    description: str


def zoo_search_paths() -> list[Path]:
    """Where the demo looks for a zoo when none is given, in order."""
    pkg = Path(__file__).resolve().parent.parent  # .../vllm_tfm
    paths = []
    if os.environ.get(ZOO_ENV):
        paths.append(Path(os.environ[ZOO_ENV]))
    paths += [pkg.parent / "zoo", pkg / "zoo"]
    return paths


def is_zoo(path: Path) -> bool:
    return (path / "target" / "config.json").is_file() and (path / "drafter" / "config.json").is_file()


def load_zoo(path: str | Path) -> DemoModels:
    """Load ``path/target`` (transformers, float32, eval) and ``path/drafter``; one-line errors."""
    path = Path(path)
    if not is_zoo(path):
        raise ValueError(f"{path} is not a toy zoo: expected {path / 'target' / 'config.json'} and {path / 'drafter' / 'config.json'}")
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(path / "target", dtype=torch.float32).eval()
    bundle = load_drafter_dir(path / "drafter", dtype=torch.float32, target_config=target.config)
    tokenizer = None
    tdir = path / "target"
    if any((tdir / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tdir)
    cfg = target.config
    desc = (
        f"toy zoo {path}: target {type(target).__name__} ({cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"vocab {cfg.vocab_size}); drafter with {', '.join(m for m, present in (('Weaver', bundle.weaver), ('TreeFlash', bundle.treeflash)) if present) or 'DFlash only'}"
    )
    return DemoModels(target, bundle, tokenizer, "zoo", desc)


def random_demo_models(seed: int = 0, block_size: int = 8) -> DemoModels:
    """Random tiny Qwen3.5 hybrid (GDN x3 + attention, vocab 96, hidden 48) and random drafters."""
    target = tiny_qwen3_5(seed=seed)
    bundle = random_drafters(target, seed=seed + 1, block_size=block_size)
    desc = (
        f"RANDOM tiny models (seed {seed}): target Qwen3_5ForCausalLM with random weights "
        f"(4 layers: 3 Gated DeltaNet + 1 gated attention, hidden 48, vocab 96) and random, untrained "
        f"DFlash / Weaver / TreeFlash drafters (block size {block_size})"
    )
    return DemoModels(target, bundle, None, "random", desc)
