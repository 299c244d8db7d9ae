"""Reading and writing model files with one-line errors that name the problem.

Every loader in ``vllm_tfm.models`` goes through :func:`read_state` (checks the file exists, every
expected tensor is present with the expected shape, and no tensor is unknown) and
:func:`target_text_config` (reads the vocab / hidden / layer counts of a target config, Hugging
Face object or plain dict, using ``text_config`` for multimodal configs such as Qwen3.5).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

__all__ = [
    "read_json",
    "write_json",
    "read_state",
    "write_state",
    "TargetDims",
    "target_text_config",
]


def read_json(directory: str | Path, name: str) -> dict[str, Any]:
    path = Path(directory) / name
    if not Path(directory).is_dir():
        raise ValueError(f"{directory}: not a directory")
    if not path.is_file():
        raise ValueError(f"{directory}: missing {name}")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def write_json(directory: str | Path, name: str, data: Mapping[str, Any]) -> Path:
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    out = path / name
    out.write_text(json.dumps(data, indent=2) + "\n")
    return out


def write_state(module: nn.Module, directory: str | Path, name: str) -> Path:
    """Save ``module.state_dict()`` (persistent tensors only) as ``directory/name`` (safetensors)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().contiguous().cpu() for k, v in module.state_dict().items()}
    out = path / name
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out), metadata={"format": "pt"})
    return out


def _shape(s: torch.Size | tuple[int, ...]) -> str:
    return "(" + ", ".join(str(int(d)) for d in s) + ")"


def read_state(directory: str | Path, name: str, module: nn.Module) -> dict[str, Tensor]:
    """Load ``directory/name`` and check it against ``module.state_dict()`` names and shapes.

    Raises ValueError (one line) for: a missing file, an unreadable file, an unknown tensor, a
    missing tensor, a tensor of the wrong shape (naming the tensor and both shapes).
    """
    path = Path(directory) / name
    if not path.is_file():
        raise ValueError(f"{directory}: missing weights file {name}")
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{path}: unreadable safetensors file ({str(e).splitlines()[0]})") from None
    expected = module.state_dict()
    unknown = sorted(set(state) - set(expected))
    if unknown:
        more = f" (and {len(unknown) - 1} more)" if len(unknown) > 1 else ""
        raise ValueError(f"{path}: unknown tensor {unknown[0]!r}{more}")
    missing = sorted(set(expected) - set(state))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{path}: missing tensor {missing[0]!r}{more}")
    for key in sorted(expected):
        if tuple(state[key].shape) != tuple(expected[key].shape):
            raise ValueError(
                f"{path}: tensor {key!r} has shape {_shape(state[key].shape)}, expected {_shape(expected[key].shape)}"
            )
    return state


class TargetDims:
    """The target-model sizes a drafter must agree with."""

    def __init__(self, vocab_size: int, hidden_size: int, num_hidden_layers: int) -> None:
        self.vocab_size = int(vocab_size)
        self.hidden_size = int(hidden_size)
        self.num_hidden_layers = int(num_hidden_layers)


def target_text_config(target_config: object) -> TargetDims:
    """Vocab / hidden / layer count of a target config (HF ``PretrainedConfig`` or dict).

    Multimodal configs (Qwen3.5/3.6 ``Qwen3_5Config``) keep these in ``text_config``.
    """
    cfg: Any = target_config
    if isinstance(cfg, Mapping):
        cfg = cfg.get("text_config", cfg) or cfg

        def get(key: str) -> Any:
            return cfg.get(key)
    else:
        if callable(getattr(cfg, "get_text_config", None)):
            cfg = cfg.get_text_config()

        def get(key: str) -> Any:
            return getattr(cfg, key, None)

    values = {}
    for key in ("vocab_size", "hidden_size", "num_hidden_layers"):
        v = get(key)
        if not isinstance(v, int) or isinstance(v, bool):
            raise ValueError(f"target config has no integer {key!r}")
        values[key] = v
    return TargetDims(**values)
