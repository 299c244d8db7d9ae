"""Training of the toy model zoo (DESIGN.md section 8): a byte-level BPE tokenizer, a Qwen3.5-shaped
hybrid target, its DFlash drafter, Weaver and the TreeFlash approximator, from Python sources
already on the machine. Plain torch + transformers + tokenizers; never imports vLLM.

Modules: ``data`` (corpus listing, split, token streams), ``tokenizer``, ``target``, ``dflash``,
``weaver``, ``treeflash`` (one trainer each), ``losses``, ``loop`` (the shared training loop and
time budget), ``checkpoint`` (resumable state), ``card`` (model cards), ``stage`` (shared stage
plumbing), ``cli`` (``train_main(argv)``, the ``vllm-tfm train`` command). Configs: ``configs/``.
Importing this package is cheap; the trainers import torch/transformers when used.
"""

from __future__ import annotations

__all__ = ["train_main"]


def train_main(argv: list[str] | None = None) -> int:
    """``vllm-tfm train ...`` (see :mod:`vllm_tfm.train.cli`)."""
    from .cli import train_main as _main

    return _main(argv)
