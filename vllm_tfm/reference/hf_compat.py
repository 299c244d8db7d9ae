"""Small adapters over `transformers` 5.x differences (5.17 on the GPU host, 5.2x in CI).

* 5.17 names the cache ``past_key_values`` (argument and output field); 5.24 renames it ``cache``
  and keeps ``past_key_values`` as a deprecated alias of the argument.
* Qwen3.5's text rotary embedding takes ``position_ids [3, B, T]`` (M-RoPE rows T/H/W; for text
  all three rows are the same position); Qwen3's takes ``[B, T]``.
* Decoder layers return a tensor in 5.x; a tuple is accepted too.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable, Sequence
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "check_supported",
    "cache_kwarg",
    "output_cache",
    "rotary_cos_sin",
    "apply_rotary_fn",
    "capture_layer_outputs",
    "capture_final_hidden",
]

SUPPORTED_MODEL_TYPES = ("qwen3_5_text", "qwen3")


def check_supported(model: nn.Module) -> None:
    """Raise ValueError unless ``model`` is a text-only Qwen3.5 or Qwen3 causal LM without sliding windows."""
    mt = getattr(model.config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"unsupported target model_type {mt!r}: the reference decoder supports Qwen3_5ForCausalLM "
            f"(qwen3_5_text) and Qwen3ForCausalLM (qwen3)"
        )
    if not hasattr(model, "model") or not hasattr(model.model, "layers") or not hasattr(model, "lm_head"):
        raise ValueError(f"{type(model).__name__} is not a causal LM with .model.layers and .lm_head")
    for i, kind in enumerate(layer_types(model)):
        if kind not in ("full_attention", "linear_attention"):
            raise ValueError(f"layer {i} of the target is {kind!r}; only full_attention and linear_attention layers are supported")


def layer_types(model: nn.Module) -> list[str]:
    """``config.layer_types`` (all ``full_attention`` when the config has none)."""
    lt = getattr(model.config, "layer_types", None)
    n = model.config.num_hidden_layers
    return list(lt) if lt is not None else ["full_attention"] * n


def cache_kwarg(model: nn.Module) -> str:
    """Name of the cache argument of ``model.forward``: ``cache`` (5.24+) or ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def output_cache(out):
    """The cache object of a model output (``.cache`` in 5.24+, ``.past_key_values`` before)."""
    c = getattr(out, "cache", None)
    if c is None:
        c = getattr(out, "past_key_values", None)
    if c is None:
        raise ValueError("the model output carries no cache; call the model with use_cache=True")
    return c


def rotary_cos_sin(model: nn.Module, x: Tensor, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos/sin of the target's own rotary module at ``positions [T]`` (int64), each [1, T, rot_dim]."""
    pos = positions.to(torch.long).view(1, -1)
    if model.config.model_type == "qwen3_5_text":
        pos = pos.view(1, 1, -1).expand(3, 1, -1)
    return model.model.rotary_emb(x, pos)


def apply_rotary_fn(attn: nn.Module) -> Callable:
    """The ``apply_rotary_pos_emb`` of the module that defines ``attn`` (handles partial RoPE)."""
    fn = getattr(sys.modules[type(attn).__module__], "apply_rotary_pos_emb", None)
    if fn is None:
        raise ValueError(f"{type(attn).__module__} has no apply_rotary_pos_emb")
    return fn


@contextmanager
def capture_layer_outputs(model: nn.Module, layer_ids: Sequence[int]):
    """Record the output hidden state of decoder layers ``layer_ids`` (before the final norm).

    Yields a dict ``{layer_id: Tensor [B, T, H]}`` filled during the forward calls made inside the
    block (the last call wins). This is vLLM's aux hidden state ``layer_id + 1`` and HF's
    ``hidden_states[layer_id + 1]`` except for the last layer, where HF returns the normed state.
    """
    captured: dict[int, Tensor] = {}
    handles = []
    n = len(model.model.layers)
    for lid in layer_ids:
        if not 0 <= lid < n:
            raise ValueError(f"tapped layer id {lid} out of range for a {n}-layer target")

        def hook(_mod, _inp, out, lid=lid):
            captured[lid] = out[0] if isinstance(out, tuple) else out

        handles.append(model.model.layers[lid].register_forward_hook(hook))
    try:
        yield captured
    finally:
        for h in handles:
            h.remove()


@contextmanager
def capture_final_hidden(model: nn.Module):
    """Record the output of the target's final norm (``model.model.norm``), ``[B, T, H]``.

    Yields a dict filled under key ``"final"`` by the forward calls made inside the block.
    """
    captured: dict[str, Tensor] = {}

    def hook(_mod, _inp, out):
        captured["final"] = out[0] if isinstance(out, tuple) else out

    handle = model.model.norm.register_forward_hook(hook)
    try:
        yield captured
    finally:
        handle.remove()
