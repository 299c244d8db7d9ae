"""Text-only Qwen3.5 checkpoint -> the vision-language layout of Qwen/Qwen3.6-27B, for GPU end-to-end runs.

``convert_to_vl(src, dst)`` writes a ``Qwen3_5ForConditionalGeneration`` checkpoint directory:
- config.json: ``model_type`` "qwen3_5", ``text_config`` = the source's text config with M-RoPE
  added to its ``rope_parameters`` (``mrope_section`` splitting the rotary half-dimension in three,
  ``mrope_interleaved``: true, as in the Qwen3.5 / Qwen3.6 hub configs), a ``vision_config`` for a
  tiny vision tower, the default image/video/vision token ids (outside a small vocabulary, so text
  prompts never hold them), ``tie_word_embeddings`` taken from the text config;
- model.safetensors: the source's text tensors unchanged (bytes identical) under the hub names
  ``model.language_model.*`` (``lm_head.weight`` stays), plus randomly initialised vision tensors
  under ``model.visual.*`` (names and shapes of transformers' ``Qwen3_5VisionModel``; vLLM 0.26's
  ``Qwen3VLForConditionalGeneration.hf_to_vllm_mapper`` maps both prefixes onto its modules);
- the tokenizer and generation files, copied.
``set_ssm_dtype`` writes ``mamba_ssm_dtype`` into a config (top level for a text-only config, in
``text_config`` for a VL one, as the hub checkpoints do), which vLLM's Qwen3.5 config hook turns
into the GDN state dtype.

Only torch, safetensors and json: the layout is checked against transformers and vLLM by
tests/cpu/test_vl_checkpoint.py, not taken from them at run time.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

__all__ = [
    "VL_ARCHITECTURE",
    "convert_to_vl",
    "mrope_section",
    "prepare_target",
    "set_ssm_dtype",
    "tiny_vision_config",
    "vision_weight_shapes",
]

VL_ARCHITECTURE = "Qwen3_5ForConditionalGeneration"
TEXT_PREFIX = "model.language_model."
VISION_PREFIX = "model.visual."
COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                "vocab.json", "merges.txt", "chat_template.jinja")
# transformers' Qwen3_5Config defaults (the Qwen3.5 hub values): far above a toy vocabulary.
TOKEN_IDS = {"image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
             "vision_end_token_id": 248054}


def mrope_section(head_dim: int, partial_rotary_factor: float) -> list[int]:
    """Temporal/height/width split of the rotary frequencies (rotary_dim / 2 of them), largest first:
    head_dim 256 at factor 0.25 gives [11, 11, 10], Qwen3.5's own section."""
    rotary_dim = int(head_dim * partial_rotary_factor)
    n = rotary_dim // 2
    if n < 3:
        raise ValueError(f"rotary dimension {rotary_dim} is too small for a three-part M-RoPE section")
    t = -(-n // 3)
    h = -(-(n - t) // 2)
    return [t, h, n - t - h]


def tiny_vision_config(out_hidden_size: int) -> dict[str, Any]:
    """A one-block vision tower (hidden 32, 2 heads) feeding a language model of width ``out_hidden_size``."""
    return {
        "model_type": "qwen3_5_vision", "depth": 1, "hidden_size": 32, "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": 64, "num_heads": 2, "in_channels": 3, "patch_size": 16, "spatial_merge_size": 2,
        "temporal_patch_size": 2, "out_hidden_size": out_hidden_size, "num_position_embeddings": 16,
        "initializer_range": 0.02,
    }


def vision_weight_shapes(v: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Tensor names (without ``model.visual.``) and shapes of a Qwen3.5 vision tower with config ``v``."""
    d, f, c = v["hidden_size"], v["intermediate_size"], v["in_channels"]
    merged = d * v["spatial_merge_size"] ** 2
    shapes: dict[str, tuple[int, ...]] = {
        "patch_embed.proj.weight": (d, c, v["temporal_patch_size"], v["patch_size"], v["patch_size"]),
        "patch_embed.proj.bias": (d,),
        "pos_embed.weight": (v["num_position_embeddings"], d),
    }
    for i in range(v["depth"]):
        b = f"blocks.{i}."
        shapes.update({
            b + "norm1.weight": (d,), b + "norm1.bias": (d,), b + "norm2.weight": (d,), b + "norm2.bias": (d,),
            b + "attn.qkv.weight": (3 * d, d), b + "attn.qkv.bias": (3 * d,),
            b + "attn.proj.weight": (d, d), b + "attn.proj.bias": (d,),
            b + "mlp.linear_fc1.weight": (f, d), b + "mlp.linear_fc1.bias": (f,),
            b + "mlp.linear_fc2.weight": (d, f), b + "mlp.linear_fc2.bias": (d,),
        })
    shapes.update({
        "merger.norm.weight": (d,), "merger.norm.bias": (d,),
        "merger.linear_fc1.weight": (merged, merged), "merger.linear_fc1.bias": (merged,),
        "merger.linear_fc2.weight": (v["out_hidden_size"], merged), "merger.linear_fc2.bias": (v["out_hidden_size"],),
    })
    return shapes


def vl_name(text_name: str) -> str:
    """Hub name of a text-only checkpoint tensor in the VL layout."""
    if text_name.startswith("model."):
        return TEXT_PREFIX + text_name[len("model."):]
    if text_name.startswith("lm_head."):
        return text_name
    raise ValueError(f"unexpected tensor {text_name!r} in a text-only Qwen3.5 checkpoint (expected model.* or lm_head.*)")


def set_ssm_dtype(config: dict[str, Any], dtype: str) -> dict[str, Any]:
    """A copy of ``config`` asking for a ``dtype`` GDN state (``mamba_ssm_dtype``), where vLLM reads it."""
    out = json.loads(json.dumps(config))
    out.get("text_config", out)["mamba_ssm_dtype"] = dtype
    return out


def vl_config(text: dict[str, Any], ssm_dtype: str | None = None) -> dict[str, Any]:
    """The VL config.json around a text-only Qwen3.5 config.json."""
    text = {k: v for k, v in text.items() if k not in ("architectures", "transformers_version", "_name_or_path")}
    text["model_type"] = "qwen3_5_text"
    rope = dict(text.get("rope_parameters") or {"rope_type": "default", "rope_theta": text.get("rope_theta", 10000.0)})
    factor = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 1.0)))
    rope.update(partial_rotary_factor=factor, mrope_section=mrope_section(int(text["head_dim"]), factor),
                mrope_interleaved=True)
    text["rope_parameters"] = rope
    cfg: dict[str, Any] = {
        "architectures": [VL_ARCHITECTURE], "model_type": "qwen3_5",
        "text_config": text, "vision_config": tiny_vision_config(int(text["hidden_size"])),
        "tie_word_embeddings": bool(text.get("tie_word_embeddings", False)), **TOKEN_IDS,
    }
    if "dtype" in text:
        cfg["dtype"] = text["dtype"]
    return set_ssm_dtype(cfg, ssm_dtype) if ssm_dtype else cfg


def _copy_side_files(src: Path, dst: Path) -> list[str]:
    copied = []
    for name in COPIED_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    return copied


def convert_to_vl(src: Path, dst: Path, *, ssm_dtype: str | None = None, seed: int = 0) -> dict[str, Any]:
    """Write the VL checkpoint of the text-only Qwen3.5 checkpoint ``src`` into ``dst``; returns a summary."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    src, dst = Path(src), Path(dst)
    text = json.loads((src / "config.json").read_text())
    arch = (text.get("architectures") or [None])[0]
    if arch not in ("Qwen3_5ForCausalLM", None):
        raise ValueError(f"{src}: architecture {arch!r} is not a text-only dense Qwen3.5 (Qwen3_5ForCausalLM)")
    files = sorted(src.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{src}: no *.safetensors weights")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), "pt") as h:
            for name in h.keys():  # noqa: SIM118 - safe_open has keys(), no __iter__
                tensors[vl_name(name)] = h.get_tensor(name)
    cfg = vl_config(text, ssm_dtype)
    dtype = next(iter(tensors.values())).dtype
    g = torch.Generator().manual_seed(seed)
    std = cfg["vision_config"]["initializer_range"]
    vision = {}
    for name, shape in vision_weight_shapes(cfg["vision_config"]).items():
        is_norm_weight = "norm" in name and name.endswith(".weight")
        w = torch.ones(shape) if is_norm_weight else (
            torch.zeros(shape) if name.endswith(".bias") else std * torch.randn(shape, generator=g))
        vision[VISION_PREFIX + name] = w.to(dtype).contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    for old in dst.glob("*.safetensors"):
        old.unlink()
    save_file({**tensors, **vision}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    copied = _copy_side_files(src, dst)
    return {"source": str(src), "directory": str(dst), "architecture": VL_ARCHITECTURE,
            "text_tensors": len(tensors), "vision_tensors": len(vision), "dtype": str(dtype).removeprefix("torch."),
            "mrope_section": cfg["text_config"]["rope_parameters"]["mrope_section"],
            "mamba_ssm_dtype": cfg["text_config"].get("mamba_ssm_dtype"), "copied": copied}


def prepare_target(src: Path, dst: Path, *, vl: bool, ssm_dtype: str | None) -> dict[str, Any]:
    """The target an end-to-end run loads: ``src`` converted to VL and/or with ``mamba_ssm_dtype`` set,
    written to ``dst`` (the source is never modified)."""
    if vl:
        return convert_to_vl(src, dst, ssm_dtype=ssm_dtype)
    if not ssm_dtype:
        raise ValueError("prepare_target: nothing to change (neither vl nor ssm_dtype)")
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "config.json":
            shutil.copy2(f, dst / f.name)
    cfg = set_ssm_dtype(json.loads((src / "config.json").read_text()), ssm_dtype)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return {"source": str(src), "directory": str(dst), "architecture": cfg["architectures"][0],
            "mamba_ssm_dtype": ssm_dtype}
