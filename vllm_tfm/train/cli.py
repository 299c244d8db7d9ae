"""``vllm-tfm train ...``: the toy-zoo trainers as one command-line entry, ``train_main(argv)``.

    train_main(["tokenizer", "--data-root", R, "--out", DIR])
    train_main(["target",    "--data-root", R, "--tokenizer", TOK, "--out", DIR])
    train_main(["dflash",    "--data-root", R, "--target", TGT, "--out", DRAFTER])
    train_main(["weaver",    "--data-root", R, "--target", TGT, "--drafter", DRAFTER])
    train_main(["treeflash", "--data-root", R, "--target", TGT, "--drafter", DRAFTER])
    train_main(["all",       "--data-root", R, "--out", ZOO, "--max-minutes", "8"])

Every trainer takes --config (default: ``vllm_tfm/train/configs/<stage>.json``), --data-root
(repeatable; ``site-packages`` = every directory of ``site.getsitepackages()``), --out, --steps,
--resume, --device (auto | cpu | cuda), --seed, --work-dir (token cache and checkpoints; default
``out/train-work``, which git ignores), --max-minutes (wall-clock budget of the command) and
--no-progress. ``all`` runs tokenizer -> target -> dflash -> weaver -> treeflash (or --stages)
into ZOO/{tokenizer,target,drafter}, splitting the time budget by each config's
``schedule.budget_share``; with --resume it skips finished stages and continues interrupted ones.

Also runnable as ``python -m vllm_tfm.train.cli <command> ...``. Exit status: 0 done, 2 usage or
input error (one line on stderr), 3 a stage stopped early (time budget): rerun with --resume.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["STAGES", "train_main"]

STAGES = ("tokenizer", "target", "dflash", "weaver", "treeflash")
EXIT_PARTIAL = 3


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-tfm train", description="Train the vllm-tfm toy model zoo.")
    sub = p.add_subparsers(dest="command", required=True)

    def common(sp: argparse.ArgumentParser, trainer: bool = True) -> None:
        sp.add_argument("--data-root", action="append", required=True, help="corpus root (repeatable) or site-packages")
        sp.add_argument("--seed", type=int, default=None, help="override the config's seed")
        sp.add_argument("--resume", action="store_true", help="continue from the checkpoint / skip finished stages")
        sp.add_argument("--work-dir", default="out/train-work", help="token cache and checkpoints")
        sp.add_argument("--max-minutes", type=float, default=None, help="wall-clock budget of this command")
        if trainer:
            sp.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
            sp.add_argument("--no-progress", action="store_true", help="log lines instead of a tqdm bar")
            sp.add_argument("--stop-after", type=int, default=None, help="stop (resumably) after N steps of this run")

    def single(name: str, help_: str) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help_)
        sp.add_argument("--config", default=None, help=f"stage config JSON (default configs/{name}.json)")
        common(sp, trainer=name != "tokenizer")
        if name != "tokenizer":
            sp.add_argument("--steps", type=int, default=None, help="override schedule.steps")
        return sp

    single("tokenizer", "byte-level BPE tokenizer").add_argument("--out", required=True)
    t = single("target", "the Qwen3.5-hybrid toy target")
    t.add_argument("--tokenizer", required=True, help="tokenizer directory")
    t.add_argument("--out", required=True)
    d = single("dflash", "DFlash drafter against a trained target")
    d.add_argument("--target", required=True, help="target directory")
    d.add_argument("--out", required=True, help="drafter directory")
    for name in ("weaver", "treeflash"):
        s = single(name, f"{name} over a trained target and DFlash drafter")
        s.add_argument("--target", required=True, help="target directory")
        s.add_argument("--drafter", required=True, help="drafter directory (holds the DFlash)")
        s.add_argument("--out", default=None, help="output drafter directory (default: --drafter)")

    a = sub.add_parser("all", help="the whole pipeline under one time budget")
    a.add_argument("--out", required=True, help="zoo directory: tokenizer/, target/, drafter/ inside")
    a.add_argument("--stages", default=",".join(STAGES), help="comma-separated subset, in pipeline order")
    a.add_argument("--config-dir", default=None, help="directory with <stage>.json configs (default: packaged)")
    a.add_argument(
        "--keep-going",
        action="store_true",
        help="when a stage stops at its time budget, keep its (partial) model and train the next stages on it",
    )
    common(a)
    return p


def _options(args: argparse.Namespace, out: Path, command: str, start: float, deadline: float | None):
    from .loop import resolve_device
    from .stage import RunOptions

    return RunOptions(
        data_roots=list(args.data_root),
        out=out,
        work_dir=Path(args.work_dir),
        device=resolve_device(getattr(args, "device", "cpu")),
        command=command,
        seed=args.seed,
        steps=getattr(args, "steps", None),
        resume=args.resume,
        deadline=deadline,
        stop_after=getattr(args, "stop_after", None),
        progress=not getattr(args, "no_progress", False),
    )


def _config(stage: str, path: str | Path | None, opts) -> Any:
    from .stage import apply_overrides, load_stage_config

    cls = _config_class(stage)
    cfg = load_stage_config(path, cls, stage)
    if stage == "tokenizer":
        return cfg.model_copy(update={"seed": opts.seed}) if opts.seed is not None else cfg
    return apply_overrides(cfg, opts)


def _config_class(stage: str):
    if stage == "tokenizer":
        from .tokenizer import TokenizerTrainConfig

        return TokenizerTrainConfig
    if stage == "target":
        from .target import TargetTrainConfig

        return TargetTrainConfig
    if stage == "dflash":
        from .dflash import DFlashTrainConfig

        return DFlashTrainConfig
    if stage == "weaver":
        from .weaver import WeaverTrainConfig

        return WeaverTrainConfig
    from .treeflash import TreeFlashTrainConfig

    return TreeFlashTrainConfig


def _run_stage(stage: str, cfg: Any, opts, inputs: dict[str, Path]) -> dict[str, Any]:
    if stage == "tokenizer":
        from .tokenizer import run_tokenizer_stage

        return run_tokenizer_stage(cfg, opts)
    if stage == "target":
        from .target import train_target

        return train_target(cfg, opts, inputs["tokenizer"])
    if stage == "dflash":
        from .dflash import train_dflash

        return train_dflash(cfg, opts, inputs["target"])
    if stage == "weaver":
        from .weaver import train_weaver

        return train_weaver(cfg, opts, inputs["target"], inputs["drafter"])
    from .treeflash import train_treeflash

    return train_treeflash(cfg, opts, inputs["target"], inputs["drafter"])


def _stage_status(directory: Path, stage: str) -> str | None:
    card = directory / f"training_{stage}.json"
    if not card.is_file():
        return None
    try:
        return json.loads(card.read_text()).get("status")
    except json.JSONDecodeError:
        return None


def _stage_done(directory: Path, stage: str, accept_partial: bool = False) -> bool:
    status = _stage_status(directory, stage)
    return status == "complete" or (accept_partial and status == "partial")


def _run_all(args: argparse.Namespace, command: str, start: float) -> int:
    stages = [s.strip() for s in args.stages.split(",") if s.strip()]
    bad = [s for s in stages if s not in STAGES]
    if bad:
        raise ValueError(f"--stages: unknown stage {bad[0]!r} (choose from {', '.join(STAGES)})")
    if [s for s in STAGES if s in stages] != stages or len(set(stages)) != len(stages):
        raise ValueError(f"--stages must list distinct stages in pipeline order {','.join(STAGES)}")
    zoo = Path(args.out)
    dirs = {"tokenizer": zoo / "tokenizer", "target": zoo / "target", "drafter": zoo / "drafter"}
    out_of = {"tokenizer": dirs["tokenizer"], "target": dirs["target"]}
    cfg_dir = Path(args.config_dir) if args.config_dir else None
    deadline_all = start + 60.0 * args.max_minutes if args.max_minutes else None
    base = _options(args, zoo, command, start, None)
    cfgs = {s: _config(s, cfg_dir / f"{s}.json" if cfg_dir else None, base) for s in stages}
    shares = {s: (cfgs[s].schedule.budget_share if s != "tokenizer" else 0.0) for s in stages}
    partial = False
    for i, stage in enumerate(stages):
        out = out_of.get(stage, dirs["drafter"])
        if args.resume and _stage_done(out, stage):
            print(f"[all] {stage}: already complete in {out}, skipped", flush=True)
            continue
        for need, d in (("tokenizer", dirs["tokenizer"]), ("target", dirs["target"]), ("dflash", dirs["drafter"])):
            if STAGES.index(need) < STAGES.index(stage) and not _stage_done(d, need, args.keep_going):
                raise ValueError(f"stage {stage} needs a complete {need} in {d}; run that stage first")
        deadline = None
        if deadline_all is not None:
            rest = sum(shares[s] for s in stages[i:])
            now = time.monotonic()
            frac = shares[stage] / rest if rest > 0 else 0.0
            deadline = now + (deadline_all - now) * frac if stage != "tokenizer" else deadline_all
            if deadline - now < 30.0:
                print(f"[all] {stage}: less than 30 s of budget left; stopping (rerun with --resume)", flush=True)
                return EXIT_PARTIAL
        opts = _options(args, out, f"{command}  # stage {stage}", start, deadline)
        print(f"[all] {stage} -> {out}", flush=True)
        record = _run_stage(stage, cfgs[stage], opts, dirs)
        if record["status"] != "complete":
            if not args.keep_going:
                print(f"[all] {stage} stopped early ({record.get('stopped_reason')}); rerun with --resume", flush=True)
                return EXIT_PARTIAL
            print(f"[all] {stage} stopped early ({record.get('stopped_reason')}); --keep-going: next stage", flush=True)
            partial = True
    print(f"[all] done in {time.monotonic() - start:.0f} s: {zoo}", flush=True)
    return EXIT_PARTIAL if partial else 0


def train_main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``vllm-tfm train``; returns the exit status."""
    start = time.monotonic()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    command = "vllm-tfm train " + shlex.join(argv)
    try:
        if args.command == "all":
            return _run_all(args, command, start)
        deadline = start + 60.0 * args.max_minutes if args.max_minutes else None
        out = Path(args.out if args.out is not None else args.drafter)
        opts = _options(args, out, command, start, deadline)
        if args.command == "tokenizer" and args.resume and _stage_done(out, "tokenizer"):
            print(f"[tokenizer] already complete in {out}, skipped", flush=True)
            return 0
        cfg = _config(args.command, args.config, opts)
        inputs = {
            "tokenizer": Path(getattr(args, "tokenizer", None) or out),
            "target": Path(getattr(args, "target", None) or out),
            "drafter": Path(getattr(args, "drafter", None) or out),
        }
        record = _run_stage(args.command, cfg, opts, inputs)
    except ValueError as e:
        print(f"vllm-tfm train: error: {e}", file=sys.stderr)
        return 2
    return 0 if record["status"] == "complete" else EXIT_PARTIAL


if __name__ == "__main__":
    sys.exit(train_main())
