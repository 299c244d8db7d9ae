"""Model cards written at the end of every training stage.

Each stage stores a JSON record ``training_<stage>.json`` in its output directory and re-renders
``README.md`` from every record there (the drafter directory holds three: dflash, weaver,
treeflash). A record always carries the fields of :data:`CARD_FIELDS`: the data (roots, split
rule, file and token counts, manifest sha1), steps run and planned, tokens seen, the final train
loss and held-out metrics, the seed and the exact command, plus versions, device, parameter
count, file sizes, the objective and the full config.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

__all__ = ["CARD_FIELDS", "environment", "file_sizes", "write_card", "render_readme", "read_cards"]

CARD_FIELDS = (
    "stage",
    "status",
    "data",
    "steps",
    "steps_planned",
    "tokens_seen",
    "final_train_loss",
    "eval_final",
    "seed",
    "command",
)


def environment(device: str) -> dict[str, str]:
    """Versions and device of this run."""
    import tokenizers
    import torch
    import transformers

    import vllm_tfm

    dev = device
    if device.startswith("cuda") and torch.cuda.is_available():
        dev = f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "tokenizers": tokenizers.__version__,
        "vllm_tfm": vllm_tfm.__version__,
        "device": dev,
    }


def file_sizes(directory: str | Path, names: list[str] | None = None) -> dict[str, int]:
    d = Path(directory)
    paths = [d / n for n in names] if names is not None else sorted(p for p in d.iterdir() if p.is_file())
    return {p.name: p.stat().st_size for p in paths if p.is_file()}


def read_cards(directory: str | Path) -> list[dict[str, Any]]:
    cards = [json.loads(p.read_text()) for p in sorted(Path(directory).glob("training_*.json"))]
    order = {"tokenizer": 0, "target": 1, "dflash": 2, "weaver": 3, "treeflash": 4}
    return sorted(cards, key=lambda c: order.get(c.get("stage", ""), 99))


def write_card(directory: str | Path, record: dict[str, Any]) -> Path:
    """Save ``training_<stage>.json`` and re-render README.md; returns the README path."""
    missing = [k for k in CARD_FIELDS if k not in record]
    if missing:
        raise ValueError(f"model card record lacks {missing[0]!r}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / f"training_{record['stage']}.json").write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    readme = d / "README.md"
    readme.write_text(render_readme(d))
    return readme


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def _metrics(m: dict[str, Any] | None) -> str:
    if not m:
        return "n/a"
    return ", ".join(f"{k} {_fmt(v)}" for k, v in m.items() if k != "step")


def render_readme(directory: str | Path) -> str:
    d = Path(directory)
    cards = read_cards(d)
    lines = [
        f"# {d.name}",
        "",
        "Part of the vllm-tfm toy model zoo, trained by `vllm_tfm.train` (see `zoo/README.md` in the",
        "repository for the whole pipeline). Generated at the end of training; do not edit by hand.",
        "",
    ]
    for c in cards:
        data = c["data"]
        lines += [
            f"## {c.get('title', c['stage'])}",
            "",
            f"- Status: {c['status']}" + (f" ({c['stopped_reason']})" if c.get("stopped_reason") else ""),
            f"- Data: {data.get('files_train', '?')} train / {data.get('files_eval', '?')} held-out Python files under "
            f"{', '.join(data.get('roots', []))}; split: {data.get('split_rule', '?')}; manifest sha1 "
            f"{data.get('manifest_sha1', '?')}; {_fmt(data.get('tokens_train', 0))} train / "
            f"{_fmt(data.get('tokens_eval', 0))} held-out tokens",
            f"- Steps: {_fmt(c['steps'])} of {_fmt(c['steps_planned'])} planned ({c.get('planned_by', 'config')})",
            f"- Tokens seen: {_fmt(c['tokens_seen'])}" + (f" ({c['tokens_unit']})" if c.get("tokens_unit") else ""),
            f"- Final loss: train {_fmt(c['final_train_loss']) if c['final_train_loss'] is not None else 'n/a'}; "
            f"held-out {_metrics(c['eval_final'])}",
            f"- Held-out at step 0: {_metrics(c.get('eval_initial'))}",
            f"- Seed: {c['seed']}",
            f"- Command: `{c['command']}`",
        ]
        if "parameters" in c:
            lines.append(f"- Parameters: {_fmt(c['parameters'])}")
        if "wall_seconds" in c:
            lines.append(f"- Wall time: {c['wall_seconds']:.1f} s")
        if "environment" in c:
            lines.append("- Environment: " + ", ".join(f"{k} {v}" for k, v in c["environment"].items()))
        if "files" in c:
            lines.append("- Files: " + ", ".join(f"{k} ({v:,} B)" for k, v in c["files"].items()))
        if c.get("objective"):
            lines += ["", c["objective"]]
        if c.get("loss_curve"):
            lines += ["", "Train loss by step: " + ", ".join(f"{int(s)}: {v:.3f}" for s, v in c["loss_curve"])]
        lines += ["", "Config:", "", "```json", json.dumps(c.get("config", {}), indent=1), "```", ""]
    return "\n".join(lines)
