"""The training loop shared by every trainer: AdamW, warmup + cosine LR, bf16 autocast on CUDA
(fp32 on CPU), gradient clipping, periodic eval / checkpoint / progress, a wall-clock budget.

Time budget (the GPU host runs one command for at most 10 minutes): when a deadline is given, the
loop times steps 3..12 of a fresh run and the step-0 eval, then shrinks the planned number of
steps so that training (with a 10% margin), the periodic evals and the final eval + save end
before the deadline (never growing it beyond the config). At every log point it re-checks with
the mean step time since calibration and shrinks the plan again if the run fell behind (the
cosine then ends sooner; the card says "time budget"). The plan is stored in the checkpoint; a
resumed run keeps it. If a run is still late, the loop stops early at a step boundary,
checkpoints and reports ``status = "partial"``; ``--resume`` continues it. A run planned by the
budget is reproduced exactly by the same budget on the same machine, or approximately by
``--steps <steps from the card>`` (which plans the cosine for that many steps from the start).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from .checkpoint import Checkpointer

__all__ = [
    "Schedule",
    "StepOutput",
    "LoopResult",
    "resolve_device",
    "autocast_for",
    "lr_at",
    "plan_steps",
    "make_optimizer",
    "run_loop",
]

CALIB_FIRST, CALIB_LAST = 2, 12  # steps [2, 12) of a fresh run are timed (0-1 include warm-up costs)
CALIB_SAFETY = 1.1  # the first plan assumes steps 10% slower than measured


class Schedule(BaseModel):
    """Optimisation and bookkeeping of one stage (the ``schedule`` section of a config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    steps: int = Field(gt=0, description="planned optimizer steps (an upper bound under a time budget)")
    lr: float = Field(gt=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup_steps: int = Field(default=0, ge=0)
    weight_decay: float = Field(default=0.0, ge=0)
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float | None = Field(default=1.0, gt=0)
    eval_every: int = Field(default=0, ge=0, description="0: evaluate at the start and the end only")
    log_every: int = Field(default=20, gt=0)
    ckpt_every_steps: int = Field(default=0, ge=0, description="0: by time only")
    ckpt_every_seconds: float = Field(default=60.0, gt=0)
    budget_share: float = Field(default=1.0, gt=0, description="weight of this stage in `all --max-minutes`")


@dataclass
class StepOutput:
    """What one training step computed: the scalar loss to minimise (with grad), the number of
    target tokens it covered, and detached scalar metrics to average in the logs."""

    loss: Tensor
    tokens: int
    metrics: dict[str, Tensor] = field(default_factory=dict)


@dataclass
class LoopResult:
    status: str  # "complete" or "partial"
    step: int
    total_steps: int
    tokens_seen: int
    elapsed_s: float
    train_history: list[dict[str, float]]
    eval_history: list[dict[str, float]]
    planned_by: str
    stopped_reason: str

    @property
    def final_train_loss(self) -> float | None:
        return self.train_history[-1]["loss"] if self.train_history else None


def resolve_device(name: str) -> torch.device:
    """"auto" -> cuda if available else cpu; "cuda" without a GPU is a one-line ValueError."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {name}: only cpu and cuda are supported")
    return dev


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA; nothing on CPU (fp32)."""
    if device.type == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def lr_at(step: int, total: int, s: Schedule) -> float:
    """Linear warmup over ``warmup_steps`` then cosine from lr to lr * min_lr_ratio at ``total``."""
    if step < s.warmup_steps:
        return s.lr * (step + 1) / s.warmup_steps
    span = max(1, total - s.warmup_steps)
    progress = min(1.0, (step - s.warmup_steps) / span)
    return s.lr * (s.min_lr_ratio + (1.0 - s.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def plan_steps(
    *, step: int, max_steps: int, seconds_left: float, step_s: float, eval_s: float, eval_every: int, reserve_s: float
) -> int:
    """Largest total (<= max_steps, >= step + 1) whose remaining steps, periodic evals and a
    reserve (final eval + save) fit in ``seconds_left``."""
    per_step = step_s + (eval_s / eval_every if eval_every else 0.0)
    fit = math.floor(max(0.0, seconds_left - reserve_s) / per_step + 1e-9) if per_step > 0 else max_steps
    return max(step + 1, min(max_steps, step + fit))


def make_optimizer(module: nn.Module, s: Schedule, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on norms, biases, gates)."""
    params = [p for p in module.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the module has no trainable parameters")
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": s.weight_decay}, {"params": other, "weight_decay": 0.0}]
    kwargs: dict[str, Any] = {"lr": s.lr, "betas": (s.beta1, s.beta2)}
    if device.type == "cuda":
        kwargs["fused"] = True
    return torch.optim.AdamW([g for g in groups if g["params"]], **kwargs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Progress:
    """tqdm when installed (and wanted), else a log line at most every 15 s."""

    def __init__(self, stage: str, start: int, total: int, enabled: bool) -> None:
        self.stage, self.total = stage, total
        self.bar = None
        self.last_print = 0.0
        if enabled:
            try:
                from tqdm import tqdm

                self.bar = tqdm(total=total, initial=start, desc=stage, mininterval=10.0, ascii=True, file=sys.stderr)
            except ImportError:
                self.bar = None

    def set_total(self, total: int) -> None:
        self.total = total
        if self.bar is not None:
            self.bar.total = total
            self.bar.refresh()

    def update(self, step: int, info: dict[str, float]) -> None:
        if self.bar is not None:
            self.bar.n = step
            self.bar.set_postfix({k: f"{v:.4g}" for k, v in info.items()}, refresh=False)
            self.bar.update(0)
            return
        now = time.monotonic()
        if now - self.last_print >= 15.0 or step >= self.total:
            self.last_print = now
            extra = " ".join(f"{k}={v:.4g}" for k, v in info.items())
            print(f"[{self.stage}] step {step}/{self.total} {extra}", flush=True)

    def write(self, line: str) -> None:
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def run_loop(
    *,
    stage: str,
    module: nn.Module,
    step_fn: Callable[[int], StepOutput],
    eval_fn: Callable[[], dict[str, float]],
    schedule: Schedule,
    device: torch.device,
    checkpointer: Checkpointer,
    resume: bool,
    deadline: float | None = None,
    stop_after: int | None = None,
    progress: bool = True,
    reserve_s: float = 10.0,
) -> LoopResult:
    """Train ``module`` (its trainable parameters) with ``step_fn(step) -> StepOutput``.

    ``eval_fn()`` returns held-out metrics (run under no_grad/eval mode by the loop) at step 0,
    every ``eval_every`` steps and at the end. ``deadline`` is a ``time.monotonic()`` instant;
    ``stop_after`` caps the steps run by this call (testing, manual slicing).
    """
    run_start = time.monotonic()
    if device.type == "cuda":  # fp32 matmuls left outside autocast (GDN fallback internals) may use TF32
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    optimizer = make_optimizer(module, schedule, device)
    state: dict[str, Any]
    if resume and checkpointer.exists():
        state = checkpointer.load(module, optimizer)
        print(f"[{stage}] resumed at step {state['step']} of {state['total_steps']}", flush=True)
    else:
        state = {
            "step": 0,
            "total_steps": schedule.steps,
            "tokens_seen": 0,
            "elapsed_s": 0.0,
            "train_history": [],
            "eval_history": [],
            "planned_by": "config",
            "calibrated": False,
            "status": "running",
            "eval_s": 0.0,
        }
    elapsed_before = float(state["elapsed_s"])

    def evaluate() -> float:
        t = time.monotonic()
        was_training = module.training
        module.eval()
        with torch.no_grad(), autocast_for(device):
            metrics = eval_fn()
        module.train(was_training)
        _sync(device)
        state["eval_history"].append({"step": state["step"], **{k: float(v) for k, v in metrics.items()}})
        progress_bar.write(
            f"[{stage}] eval @ {state['step']}: " + " ".join(f"{k}={float(v):.4g}" for k, v in metrics.items())
        )
        return time.monotonic() - t

    progress_bar = _Progress(stage, state["step"], state["total_steps"], progress)
    if state["status"] == "complete":
        progress_bar.close()
        return _result(state, "already complete")
    module.train()
    if state["step"] == 0 and not state["eval_history"]:
        state["eval_s"] = evaluate()

    acc_loss = torch.zeros((), device=device, dtype=torch.float64)
    acc_metrics: dict[str, Tensor] = {}
    acc_n = 0
    log_t0 = time.monotonic()
    log_tokens = 0
    last_ckpt = time.monotonic()
    calib_t0: float | None = None
    step_s_est: float | None = None
    tm_t0: float | None = None  # step-time reference (after warm-up), evals excluded
    tm_step = 0

    def replan(step_s: float) -> None:
        """Shrink the plan so the rest fits before the deadline (never grows it)."""
        assert deadline is not None
        planned = plan_steps(
            step=state["step"],
            max_steps=state["total_steps"],
            seconds_left=deadline - time.monotonic(),
            step_s=step_s,
            eval_s=float(state["eval_s"]),
            eval_every=schedule.eval_every,
            reserve_s=reserve_s + 2.0 * float(state["eval_s"]),
        )
        if planned < state["total_steps"]:
            state["total_steps"] = planned
            state["planned_by"] = "time budget"
            progress_bar.set_total(planned)

    run_steps = 0
    start_step = state["step"]
    stopped = ""
    while state["step"] < state["total_steps"]:
        step = state["step"]
        if deadline is not None and not state["calibrated"] and step == CALIB_FIRST:
            _sync(device)
            calib_t0 = time.monotonic()
        lr = lr_at(step, state["total_steps"], schedule)
        for g in optimizer.param_groups:
            g["lr"] = lr
        with autocast_for(device):
            out = step_fn(step)
        out.loss.backward()
        if schedule.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(module.parameters(), schedule.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        acc_loss += out.loss.detach().to(torch.float64)
        for k, v in out.metrics.items():
            acc_metrics[k] = acc_metrics.get(k, 0.0) + v.detach().to(torch.float64)
        acc_n += 1
        log_tokens += out.tokens
        state["step"] = step + 1
        state["tokens_seen"] += out.tokens
        run_steps += 1
        if tm_t0 is None and start_step > 0 and run_steps == CALIB_FIRST:  # resumed: time this run's steps
            _sync(device)
            tm_t0, tm_step = time.monotonic(), state["step"]

        if calib_t0 is not None and state["step"] == CALIB_LAST:
            _sync(device)
            step_s_est = (time.monotonic() - calib_t0) / (CALIB_LAST - CALIB_FIRST)
            calib_t0 = None
            state["calibrated"] = True
            tm_t0, tm_step = time.monotonic(), state["step"]
            replan(step_s_est * CALIB_SAFETY)
            progress_bar.write(
                f"[{stage}] {step_s_est * 1000:.1f} ms/step; plan {state['total_steps']} steps "
                f"({state['planned_by']})"
            )

        if state["step"] % schedule.log_every == 0 or state["step"] == state["total_steps"]:
            now = time.monotonic()
            mean = float(acc_loss) / acc_n  # syncs
            row = {"step": state["step"], "loss": mean, "lr": lr, "tok_per_s": log_tokens / max(now - log_t0, 1e-9)}
            row.update({k: float(v) / acc_n for k, v in acc_metrics.items()})
            state["train_history"].append(row)
            if tm_t0 is not None and state["step"] > tm_step:
                step_s_est = (now - tm_t0) / (state["step"] - tm_step)
            elif step_s_est is None:
                step_s_est = (now - log_t0) / acc_n
            if deadline is not None and tm_t0 is not None and state["step"] > tm_step:
                before = state["total_steps"]
                replan(step_s_est)
                if state["total_steps"] < 0.99 * before:
                    progress_bar.write(f"[{stage}] slower than planned: plan {state['total_steps']} steps")
            acc_loss.zero_()
            acc_metrics = {}
            acc_n, log_tokens, log_t0 = 0, 0, now
            progress_bar.update(state["step"], {"loss": mean, "lr": lr, "tok/s": row["tok_per_s"]})

        if schedule.eval_every and state["step"] % schedule.eval_every == 0 and state["step"] < state["total_steps"]:
            state["eval_s"] = evaluate()
            log_t0 += state["eval_s"]  # step-time estimates exclude evals (planned separately)
            if calib_t0 is not None:
                calib_t0 += state["eval_s"]
            if tm_t0 is not None:
                tm_t0 += state["eval_s"]

        now = time.monotonic()
        state["elapsed_s"] = elapsed_before + (now - run_start)
        done = state["step"] >= state["total_steps"]
        if stop_after is not None and run_steps >= stop_after and not done:
            stopped = f"stopped after {run_steps} steps (--stop-after)"
        elif deadline is not None and not done and step_s_est is not None:
            if now + step_s_est + reserve_s + float(state["eval_s"]) > deadline:
                stopped = f"stopped by the time budget at step {state['step']} of {state['total_steps']}"
        if stopped:
            break
        if not done and (
            now - last_ckpt >= schedule.ckpt_every_seconds
            or (schedule.ckpt_every_steps and state["step"] % schedule.ckpt_every_steps == 0)
        ):
            checkpointer.save(module, optimizer, state)
            last_ckpt = time.monotonic()
            if tm_t0 is not None:  # saving is not step time
                tm_t0 += last_ckpt - now
            log_t0 += last_ckpt - now

    if acc_n:
        mean = float(acc_loss) / acc_n
        last_lr = lr_at(state["step"] - 1, state["total_steps"], schedule)
        state["train_history"].append({"step": state["step"], "loss": mean, "lr": last_lr})
    evaluate()
    state["status"] = "complete" if not stopped else "partial"
    state["elapsed_s"] = elapsed_before + (time.monotonic() - run_start)
    checkpointer.save(module, optimizer, state)
    progress_bar.close()
    return _result(state, stopped)


def _result(state: dict[str, Any], stopped: str) -> LoopResult:
    return LoopResult(
        status=state["status"],
        step=state["step"],
        total_steps=state["total_steps"],
        tokens_seen=state["tokens_seen"],
        elapsed_s=float(state["elapsed_s"]),
        train_history=list(state["train_history"]),
        eval_history=list(state["eval_history"]),
        planned_by=state["planned_by"],
        stopped_reason=stopped,
    )
