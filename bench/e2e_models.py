"""Qwen3.6-27B-shaped model directories for the speed benchmark (``bench/e2e.py``), no real weights.

The target is the text decoder of Qwen3.6-27B (the shape Qwen3.5-27B shares; public model cards
and config.json): 64 layers in 16 blocks of (Gated DeltaNet x 3, gated full attention x 1),
hidden 5120, SwiGLU MLP 17408, vocabulary 248320, untied embeddings; GDN with 16 key heads and 48
value heads of 128 (K = V = 128), conv width 4, SSM state in float32; attention with 24 query
heads (plus their output gate) and 4 KV heads of 256, partial RoPE (a quarter of each head) with
theta 1e7. Written by transformers' ``Qwen3_5TextConfig`` with ``architectures =
["Qwen3_5ForCausalLM"]`` (the text-only class vllm-tfm registers as hybrid); vLLM fills the
weights with ``load_format="dummy"``.

The drafter is a z-lab-layout DFlash ``config.json`` of the published Qwen3.5/3.6-27B DFlash
shape (5 full-attention Qwen3 layers of width 5120, 32 / 8 heads of 128, MLP 17408, block 16,
taps [1, 16, 31, 46, 61], mask token 248070; dummy weights too) plus ``tfm_config.json`` and a
randomly initialised Weaver (``tfm/weaver.safetensors``, the 56.7M-parameter default shape at
width 5120), which vllm-tfm loads itself and so must exist as a file.

``write_target(..., vl=True)`` writes the same language model in the layout the published
checkpoint has (``Qwen3_5ForConditionalGeneration``: the text config under ``text_config`` with
M-RoPE, sections [11, 11, 10] interleaved, as ``bench/vl_checkpoint.py`` builds it), so vLLM runs
the class users serve, M-RoPE positions included. Its vision tower is vl_checkpoint's one-block toy
(Qwen3.6-27B's own is ~0.4B parameters); with image and video limits at 0 it never runs.

Also: :func:`gdn_state_bytes_per_request`, the GDN cache a request holds in vLLM 0.26 (one state
slot per speculative token plus one, and a conv window of W - 1 + S columns per slot).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = [
    "TARGET_SHAPE",
    "DRAFTER_SHAPE",
    "DRAFT_BLOCK",
    "layer_types",
    "target_config",
    "write_target",
    "write_drafter",
    "gdn_state_bytes_per_request",
]

NUM_LAYERS = 64
FULL_ATTENTION_INTERVAL = 4

TARGET_SHAPE: dict[str, Any] = {
    "vocab_size": 248_320,
    "hidden_size": 5120,
    "intermediate_size": 17_408,
    "num_hidden_layers": NUM_LAYERS,
    "num_attention_heads": 24,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 48,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 262_144,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "eos_token_id": 248_044,
    "pad_token_id": 248_044,
}
ROPE = {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25}

DRAFT_BLOCK = 16
DRAFTER_SHAPE: dict[str, Any] = {
    "hidden_size": 5120,
    "num_hidden_layers": 5,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 17_408,
    "vocab_size": 248_320,
    "target_layer_ids": [1, 16, 31, 46, 61],
    "mask_token_id": 248_070,
    "block_size": DRAFT_BLOCK,
    "num_target_layers": NUM_LAYERS,
    "rope_theta": 10_000_000.0,
    "max_position_embeddings": 262_144,
}


def layer_types(num_layers: int = NUM_LAYERS, interval: int = FULL_ATTENTION_INTERVAL) -> list[str]:
    """Qwen3.5's pattern: every ``interval``-th layer (1-based) is full attention, the rest GDN."""
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]


def target_config(**overrides: Any) -> Any:
    """The transformers ``Qwen3_5TextConfig`` of the 27B-shaped text target."""
    from transformers import Qwen3_5TextConfig

    kw: dict[str, Any] = {**TARGET_SHAPE, "rope_parameters": dict(ROPE), "layer_types": layer_types()}
    kw.update(overrides)
    cfg = Qwen3_5TextConfig(**kw)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    cfg.mamba_ssm_dtype = "float32"
    cfg.dtype = "bfloat16"
    return cfg


def write_target(directory: str | Path, vl: bool = False) -> Path:
    """config.json of the target (no weights: serve it with ``load_format="dummy"``); ``vl``: in the
    vision-language layout (module docstring)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    if not vl:
        target_config().save_pretrained(path)
        return path
    from vl_checkpoint import vl_config  # bench/, beside this module

    (path / "config.json").write_text(json.dumps(vl_config(target_config().to_dict()), indent=1) + "\n")
    return path


def write_drafter(directory: str | Path, seed: int = 0, weaver: bool = True) -> Path:
    """The DFlash drafter config (z-lab layout) and, when ``weaver``, a random bf16 Weaver with
    its ``tfm_config.json`` (proposal ``tfm``)."""
    import torch

    from vllm_tfm.models.dflash import DFLASH_CONFIG_NAME, DFlashConfig
    from vllm_tfm.models.tfm_config import WeaverConfig
    from vllm_tfm.models.weaver import Weaver

    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    cfg = DFlashConfig.create(**DRAFTER_SHAPE, dtype="bfloat16")
    (path / DFLASH_CONFIG_NAME).write_text(json.dumps(cfg.to_dict(), indent=1) + "\n")
    if weaver:
        torch.manual_seed(seed)
        model = Weaver(WeaverConfig(d_model=DRAFTER_SHAPE["hidden_size"], max_depth=DRAFT_BLOCK - 1))
        model.to(torch.bfloat16).save_pretrained(path)
    write_speed_draft_vocab(path / DRAFT_VOCAB_NAME, seed)
    return path


DRAFT_VOCAB_NAME = "draft_vocab.json"


def write_speed_draft_vocab(path: Path, seed: int = 0) -> None:
    """A draft-vocabulary file for the target's vocabulary with a seeded random ranking (the dummy weights have
    no token frequencies; arms with ``VLLM_TFM_DRAFT_VOCAB`` measure its speed, their acceptance is a replay)."""
    import numpy as np

    from vllm_tfm.models.draft_vocab import write_draft_vocab

    counts = np.random.default_rng(seed).permutation(TARGET_SHAPE["vocab_size"])  # distinct: a random ranking
    write_draft_vocab(path, counts, "none (dummy weights)",
                      "not a corpus: the counts are a seeded random permutation, a ranking for speed only "
                      "(bench/e2e_models.py)")


def gdn_state_bytes_per_request(num_speculative_tokens: int, ssm_bytes: int = 4, conv_bytes: int = 2,
                                one_slot: bool = False) -> int:
    """Bytes of GDN cache one request holds in vLLM 0.26 with S speculative tokens per step: every
    GDN layer keeps 1 + S slots (one with ``one_slot``: tfm's ``gdn_state_slots: "one"``), each an SSM
    state [HV, V, K] and a conv window [conv_dim, W - 1 + S] (vLLM's shapes in both cases)."""
    s = int(num_speculative_tokens)
    hv, v, k = TARGET_SHAPE["linear_num_value_heads"], TARGET_SHAPE["linear_value_head_dim"], TARGET_SHAPE["linear_key_head_dim"]
    h = TARGET_SHAPE["linear_num_key_heads"]
    conv_dim = 2 * h * k + hv * v
    width = TARGET_SHAPE["linear_conv_kernel_dim"]
    slot = hv * v * k * ssm_bytes + conv_dim * (width - 1 + s) * conv_bytes
    gdn_layers = sum(t == "linear_attention" for t in layer_types())
    return gdn_layers * (1 if one_slot else 1 + s) * slot
