"""Shared set-up of the vLLM plugin tests (test_plugin_config.py, test_plugin_registration.py).

Tiny config-only model directories (a text-only Qwen3.5 hybrid target written by transformers'
``Qwen3_5TextConfig``, a z-lab style DFlash drafter ``config.json`` written by hand, placeholder
safetensors where a presence check needs one) and :func:`vllm_cpu_session`, which imports vLLM,
registers the plugin and makes vLLM inspect model classes in-process.

Why in-process: vLLM 0.26 inspects each lazily registered model class in a fresh Python
subprocess (``registry._run_in_subprocess``) so that importing model code never initialises CUDA
in the parent. Each such subprocess re-imports vLLM (10-20 s on a 2-core CI machine). On CPU there
is no CUDA to protect, so the tests run the same inspection function in this process.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

VOCAB = 512
HIDDEN = 64
TARGET_LAYERS = 4


def write_qwen35_target(directory: Path, architecture: str = "Qwen3_5ForCausalLM") -> Path:
    """A text-only Qwen3.5 hybrid config (3 GDN layers + 1 attention layer), no weights."""
    from transformers import Qwen3_5TextConfig

    cfg = Qwen3_5TextConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=128,
        num_hidden_layers=TARGET_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        max_position_embeddings=2048,
        eos_token_id=1,
        bos_token_id=0,
        pad_token_id=0,
        torch_dtype="bfloat16",
    )
    cfg.architectures = [architecture]
    directory.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(directory)
    return directory


def write_plain_target(directory: Path, architecture: str, model_type: str) -> Path:
    """A small dense decoder config (Llama / Qwen3 style keys), no weights."""
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": TARGET_LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "torch_dtype": "bfloat16",
    }
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def drafter_config(**overrides: Any) -> dict[str, Any]:
    """A z-lab style DFlash drafter config.json for the tiny target (block size 8)."""
    cfg: dict[str, Any] = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 2048,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000000,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
        "block_size": 8,
        "dflash_config": {"mask_token_id": VOCAB - 1, "target_layer_ids": [1, 2], "block_size": 8},
    }
    cfg.update(overrides)
    return cfg


def write_placeholder_safetensors(path: Path) -> Path:
    """A valid one-tensor safetensors file: for checks that a weights file is present."""
    import torch
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({"placeholder": torch.zeros(1)}, str(path))
    return path


def write_drafter(
    directory: Path,
    config: dict[str, Any] | None = None,
    *,
    weights: bool = True,
    tfm_config: dict[str, Any] | None = None,
    weaver_weights: bool = False,
    treeflash_weights: bool = False,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config if config is not None else drafter_config()))
    if weights:
        write_placeholder_safetensors(directory / "model.safetensors")
    if tfm_config is not None:
        (directory / "tfm_config.json").write_text(json.dumps(tfm_config))
    if weaver_weights:
        write_placeholder_safetensors(directory / "tfm" / "weaver.safetensors")
    if treeflash_weights:
        write_placeholder_safetensors(directory / "tfm" / "treeflash.safetensors")
    return directory


WEAVER_SECTION = {"d_model": HIDDEN, "d_rank": 32, "n_layers": 1, "n_heads": 2, "d_mlp": 64, "max_depth": 7}
TREEFLASH_SECTION = {"hidden_size": HIDDEN, "intermediate_size": 48}


def tiny_tfm_configs(root: Path, budget: int) -> tuple[Any, Any, Any]:
    """(model config, parallel config, speculative config) that vLLM builds, with the plugin, for a tfm
    engine of the tiny target and drafter written under ``root``; call inside :func:`vllm_cpu_session`."""
    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs

    target, drafter = write_qwen35_target(root / "target"), write_drafter(root / "drafter")
    args = EngineArgs(model=str(target), skip_tokenizer_init=True, load_format="auto",
                      speculative_config={"method": "tfm", "model": str(drafter), "num_speculative_tokens": budget})
    model_config, parallel = args.create_model_config(), ParallelConfig()
    return model_config, parallel, args.create_speculative_config(model_config, parallel)


@contextlib.contextmanager
def vllm_cpu_session(cache_dir: Path) -> Iterator[Any]:
    """Import vLLM (skip the module when it cannot be imported), register vllm-tfm, and make vLLM
    inspect model classes in this process with its model-info cache under ``cache_dir``."""
    vllm = pytest.importorskip("vllm", reason="vLLM cannot be imported: the plugin tests need vLLM 0.26")
    from vllm.model_executor.models import registry

    import vllm_tfm

    vllm_tfm.register()
    mp = pytest.MonkeyPatch()
    mp.setattr(registry, "_run_in_subprocess", lambda fn: fn())
    mp.setenv("VLLM_CACHE_ROOT", str(cache_dir))
    try:
        yield vllm
    finally:
        mp.undo()
