"""Resumable training state: one ``checkpoint.pt`` per stage in the work directory.

It holds the trainable module's fp32 state, the AdamW state, the loop state (step, planned total,
tokens seen, loss/eval history, elapsed time) and the sha1 of the stage config, so ``--resume``
refuses a checkpoint made with another config instead of silently mixing runs. Batches are a pure
function of (seed, step) (see ``data.sample_windows``) and nothing else draws random numbers
during training, so no RNG state needs saving: a resumed run follows the uninterrupted one.
Writes are atomic (temporary file, then ``os.replace``).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["CHECKPOINT_NAME", "CHECKPOINT_FORMAT", "config_sha1", "Checkpointer"]

CHECKPOINT_NAME = "checkpoint.pt"
CHECKPOINT_FORMAT = 1


def config_sha1(config: dict[str, Any]) -> str:
    return hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()


class Checkpointer:
    """Save / load one stage's training state under ``work_dir / stage``."""

    def __init__(self, work_dir: str | Path, stage: str, config: dict[str, Any]) -> None:
        self.dir = Path(work_dir) / stage
        self.path = self.dir / CHECKPOINT_NAME
        self.stage = stage
        self.config_sha1 = config_sha1(config)

    def exists(self) -> bool:
        return self.path.is_file()

    def save(self, module: nn.Module, optimizer: torch.optim.Optimizer, loop_state: dict[str, Any]) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        payload = {
            "format": CHECKPOINT_FORMAT,
            "stage": self.stage,
            "config_sha1": self.config_sha1,
            "module": {k: v.detach().cpu() for k, v in module.state_dict().items()},
            "optimizer": optimizer.state_dict(),
            "loop": loop_state,
        }
        tmp = self.path.with_suffix(".tmp")
        torch.save(payload, tmp)
        os.replace(tmp, self.path)
        return self.path

    def load(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Restore module and optimizer in place; return the loop state (ValueError on mismatch)."""
        if not self.exists():
            raise ValueError(f"--resume: no checkpoint at {self.path}")
        payload = torch.load(self.path, map_location="cpu", weights_only=True)
        if payload.get("format") != CHECKPOINT_FORMAT or payload.get("stage") != self.stage:
            raise ValueError(f"{self.path}: not a {self.stage} checkpoint of format {CHECKPOINT_FORMAT}")
        if payload["config_sha1"] != self.config_sha1:
            raise ValueError(
                f"{self.path} was made with a different {self.stage} config; "
                "delete it or run without --resume to start over"
            )
        module.load_state_dict(payload["module"], strict=True)
        optimizer.load_state_dict(payload["optimizer"])
        return payload["loop"]
