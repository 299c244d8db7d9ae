"""What every training stage shares: run options, config files, data preparation, bf16 export,
and the model-card record of a finished loop."""

from __future__ import annotations

import copy
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from pydantic import BaseModel, ValidationError
from torch import nn

from .card import environment
from .checkpoint import Checkpointer
from .data import (
    DataConfig,
    DataManifest,
    TokenStreams,
    build_manifest,
    build_token_streams,
)
from .loop import LoopResult, run_loop

__all__ = [
    "CONFIG_DIR",
    "RunOptions",
    "load_stage_config",
    "apply_overrides",
    "prepare_data",
    "export_copy",
    "loop_record",
    "count_parameters",
]

CONFIG_DIR = Path(__file__).parent / "configs"

C = TypeVar("C", bound=BaseModel)


@dataclass
class RunOptions:
    """Command-line options common to the stages (already parsed and checked)."""

    data_roots: list[str]
    out: Path
    work_dir: Path
    device: torch.device
    command: str
    seed: int | None = None
    steps: int | None = None
    resume: bool = False
    deadline: float | None = None  # time.monotonic() instant
    stop_after: int | None = None
    progress: bool = True

    def seconds_left(self) -> float | None:
        return None if self.deadline is None else self.deadline - time.monotonic()


def load_stage_config(path: str | Path | None, cls: type[C], stage: str) -> C:
    """Parse a stage config JSON (``configs/<stage>.json`` when ``path`` is None); errors are one
    line naming the file and the field."""
    p = Path(path) if path is not None else CONFIG_DIR / f"{stage}.json"
    if not p.is_file():
        raise ValueError(f"{p}: config file not found")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{p}: not valid JSON ({e.msg} at line {e.lineno})") from None
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "<root>"
        raise ValueError(f"{p}: {loc}: {err['msg'].removeprefix('Value error, ')}") from None


def apply_overrides(config: C, opts: RunOptions) -> C:
    """--seed and --steps replace the config's ``seed`` and ``schedule.steps``."""
    update: dict[str, Any] = {}
    if opts.seed is not None:
        update["seed"] = opts.seed
    if opts.steps is not None:
        if opts.steps <= 0:
            raise ValueError(f"--steps must be > 0, got {opts.steps}")
        update["schedule"] = config.schedule.model_copy(update={"steps": opts.steps})  # type: ignore[attr-defined]
    return config.model_copy(update=update) if update else config


def prepare_data(opts: RunOptions, data: DataConfig, tokenizer_dir: str | Path) -> tuple[DataManifest, TokenStreams]:
    t = time.monotonic()
    manifest = build_manifest(opts.data_roots, data)
    streams = build_token_streams(manifest, tokenizer_dir, opts.work_dir / "tokens")
    print(
        f"[data] {len(manifest.train)} train / {len(manifest.eval)} eval files, "
        f"{streams.train.size:,} / {streams.eval.size:,} tokens ({time.monotonic() - t:.1f} s)",
        flush=True,
    )
    return manifest, streams


def export_copy(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """A CPU copy of ``module`` in ``dtype`` for saving (the training copy stays fp32)."""
    return copy.deepcopy(module).to(device="cpu", dtype=dtype)


def count_parameters(module: nn.Module) -> int:
    """Distinct parameters (tied weights counted once)."""
    return sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())


def _curve(history: list[dict[str, float]], points: int = 20) -> list[list[float]]:
    if not history:
        return []
    idx = sorted({round(i * (len(history) - 1) / max(points - 1, 1)) for i in range(points)})
    return [[history[i]["step"], round(history[i]["loss"], 5)] for i in idx]


def loop_record(
    *,
    stage: str,
    title: str,
    result: LoopResult,
    opts: RunOptions,
    seed: int,
    manifest: DataManifest,
    streams: TokenStreams,
    config: BaseModel,
    objective: str,
    parameters: int,
    files: dict[str, int],
    tokens_unit: str,
) -> dict[str, Any]:
    """The model-card record of one trained stage (see ``card.CARD_FIELDS``)."""
    return {
        "stage": stage,
        "title": title,
        "status": result.status,
        "stopped_reason": result.stopped_reason,
        "data": {**manifest.summary(), **streams.info},
        "steps": result.step,
        "steps_planned": result.total_steps,
        "planned_by": result.planned_by,
        "tokens_seen": result.tokens_seen,
        "tokens_unit": tokens_unit,
        "final_train_loss": result.final_train_loss,
        "eval_initial": result.eval_history[0] if result.eval_history else None,
        "eval_final": result.eval_history[-1] if result.eval_history else None,
        "seed": seed,
        "command": opts.command,
        "wall_seconds": result.elapsed_s,
        "environment": environment(str(opts.device)),
        "parameters": parameters,
        "files": files,
        "objective": objective,
        "loss_curve": _curve(result.train_history),
        "config": config.model_dump(mode="json"),
    }


def run_stage_loop(stage: str, module: nn.Module, config: Any, opts: RunOptions, step_fn: Any, eval_fn: Any,
                   device: torch.device) -> LoopResult:
    """The training loop of one stage with its checkpointer (keyed by the stage's config)."""
    ckpt = Checkpointer(opts.work_dir, stage, config.model_dump(mode="json"))
    return run_loop(
        stage=stage,
        module=module,
        step_fn=step_fn,
        eval_fn=eval_fn,
        schedule=config.schedule,
        device=device,
        checkpointer=ckpt,
        resume=opts.resume,
        deadline=opts.deadline,
        stop_after=opts.stop_after,
        progress=opts.progress,
    )
