"""The toy target: a text-only Qwen3.5 hybrid (``transformers`` ``Qwen3_5ForCausalLM`` with a
``Qwen3_5TextConfig``): Gated DeltaNet layers with one gated full-attention layer every
``full_attention_interval`` layers, GVA in the GDN layers (more value heads than key heads), tied
embeddings. Trained from scratch by next-token cross-entropy on packed windows of the source-code
stream.

Without flash-linear-attention, ``transformers`` runs GDN through its torch chunked fallback
(``torch_chunk_gated_delta_rule``: per 64-token chunk a masked 64 x 64 triangular solve, then a
Python loop over chunks); it has autograd, and at this width it is launch-bound rather than
FLOP-bound on a GPU. vLLM's bundled FLA Triton kernels are forward-only (their autograd Function
has no backward), so they cannot train.

Also here: :func:`load_target` (a frozen target for the drafter stages) and :func:`run_target`,
which returns the tapped layer outputs (DFlash context features: the output of decoder layer i,
i.e. Hugging Face ``hidden_states[i + 1]`` / vLLM aux layer ``i + 1``), the final normed hidden
state and the logits in one forward.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from .card import file_sizes, write_card
from .data import DataConfig, eval_windows, sample_windows
from .loop import Schedule, StepOutput
from .stage import (
    RunOptions,
    count_parameters,
    export_copy,
    loop_record,
    prepare_data,
    run_stage_loop,
)
from .tokenizer import copy_tokenizer_files, load_tokenizer, special_token_ids

__all__ = [
    "TargetTrainConfig",
    "TargetOutputs",
    "SAVE_DTYPES",
    "build_target_config",
    "build_target",
    "load_target",
    "run_target",
    "train_target",
]

SAVE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
STREAM_TARGET = 1
_FROM_TOKENIZER = ("vocab_size", "eos_token_id", "pad_token_id", "bos_token_id")


class TargetTrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: Literal["target"]
    model: dict[str, Any] = Field(description="Qwen3_5TextConfig fields (vocab and special ids come from the tokenizer)")
    seq_len: int = Field(gt=1)
    batch_size: int = Field(gt=0)
    eval_windows: int = Field(default=64, gt=0)
    eval_batch_size: int = Field(default=16, gt=0)
    save_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    seed: int = 0
    schedule: Schedule
    data: DataConfig = DataConfig()


def build_target_config(spec: dict[str, Any], vocab_size: int, eos_id: int, pad_id: int):
    """A ``Qwen3_5TextConfig`` from the config's ``model`` section. ``full_attention_interval``
    (default 4) becomes an explicit ``layer_types`` list: layer i is full attention iff
    (i + 1) % interval == 0 (Qwen3.5's pattern: GDN x3 then attention)."""
    from transformers import Qwen3_5TextConfig

    kw = dict(spec)
    for key in _FROM_TOKENIZER:
        if key in kw:
            raise ValueError(f"target config: model.{key} is taken from the tokenizer; remove it")
    interval = int(kw.pop("full_attention_interval", 4))
    n = kw.get("num_hidden_layers")
    if not isinstance(n, int) or n <= 0:
        raise ValueError(f"target config: model.num_hidden_layers must be a positive integer, got {n!r}")
    kw.setdefault(
        "layer_types", ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    )
    cfg = Qwen3_5TextConfig(vocab_size=vocab_size, eos_token_id=eos_id, pad_token_id=pad_id, **kw)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    return cfg


def build_target(hf_config, seed: int) -> nn.Module:
    """A freshly initialised ``Qwen3_5ForCausalLM`` (on CPU, from ``torch.manual_seed(seed)``)."""
    from transformers import Qwen3_5ForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return Qwen3_5ForCausalLM(hf_config)


def load_target(directory: str | Path, device: torch.device) -> nn.Module:
    """A frozen target for the drafter stages: bf16 on CUDA, fp32 on CPU, eval mode, no grads."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    if not (Path(directory) / "config.json").is_file():
        raise ValueError(f"{directory}: no target model (missing config.json); train the target first")
    hf_logging.disable_progress_bar()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(str(directory), dtype=dtype).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


@dataclass
class TargetOutputs:
    """taps [B, L, n_taps * H] (None without taps), final [B, L, H] (after the final norm),
    logits [B, L, V]; position t's logits predict token t + 1."""

    taps: Tensor | None
    final: Tensor
    logits: Tensor


def run_target(model: nn.Module, input_ids: Tensor, tap_ids: Sequence[int] = ()) -> TargetOutputs:
    """One forward of a Qwen3.5 / Qwen3 causal LM over ``input_ids [B, L]`` recording the outputs
    of decoder layers ``tap_ids`` (concatenated in that order)."""
    layers = model.model.layers
    captured: dict[int, Tensor] = {}
    handles = []
    for lid in tap_ids:
        if not 0 <= lid < len(layers):
            raise ValueError(f"tapped layer {lid} out of range for a {len(layers)}-layer target")

        def hook(_m, _i, out, lid=lid):
            captured[lid] = out[0] if isinstance(out, tuple) else out

        handles.append(layers[lid].register_forward_hook(hook))
    try:
        final = model.model(input_ids=input_ids, use_cache=False).last_hidden_state
    finally:
        for h in handles:
            h.remove()
    taps = torch.cat([captured[i] for i in tap_ids], dim=-1) if tap_ids else None
    return TargetOutputs(taps=taps, final=final, logits=model.lm_head(final))


OBJECTIVE = (
    "Objective: next-token cross-entropy on windows of seq_len tokens drawn uniformly from the "
    "train token stream (documents joined by <|endoftext|>), AdamW, warmup + cosine LR, bf16 "
    "autocast on CUDA. Held-out metric: mean cross-entropy (nats/token) on fixed evenly spaced "
    "windows of the held-out stream."
)


def train_target(config: TargetTrainConfig, opts: RunOptions, tokenizer_dir: str | Path) -> dict[str, Any]:
    """Train the target and write it (bf16 safetensors + tokenizer files + card) to ``opts.out``.
    Returns the model-card record."""
    tok = load_tokenizer(tokenizer_dir)
    ids = special_token_ids(tok)
    hf_config = build_target_config(config.model, tok.get_vocab_size(), ids["eos"], ids["pad"])
    manifest, streams = prepare_data(opts, config.data, tokenizer_dir)
    device = opts.device
    model = build_target(hf_config, config.seed).to(device)
    n_params = count_parameters(model)
    print(f"[target] {n_params:,} parameters, layer types {hf_config.layer_types}", flush=True)
    vocab = hf_config.vocab_size
    L, B = config.seq_len, config.batch_size
    held = eval_windows(streams.eval, config.eval_windows, L + 1)

    def lm_loss(w: Tensor) -> Tensor:
        logits = model(input_ids=w[:, :-1], use_cache=False).logits
        return F.cross_entropy(logits.float().reshape(-1, vocab), w[:, 1:].reshape(-1))

    def step_fn(step: int) -> StepOutput:
        w = sample_windows(streams.train, B, L + 1, config.seed, step, STREAM_TARGET).to(device, non_blocking=True)
        return StepOutput(loss=lm_loss(w), tokens=B * L)

    def eval_fn() -> dict[str, float]:
        total = 0.0
        for i in range(0, held.shape[0], config.eval_batch_size):
            w = held[i : i + config.eval_batch_size].to(device)
            total += float(lm_loss(w)) * w.shape[0]
        return {"loss": total / held.shape[0]}

    result = run_stage_loop("target", model, config, opts, step_fn, eval_fn, device)
    out = Path(opts.out)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    export = export_copy(model, SAVE_DTYPES[config.save_dtype])
    export.save_pretrained(str(out))
    copy_tokenizer_files(tokenizer_dir, out)
    record = loop_record(
        stage="target",
        title="Target: toy Qwen3.5 hybrid (Gated DeltaNet + gated attention)",
        result=result,
        opts=opts,
        seed=config.seed,
        manifest=manifest,
        streams=streams,
        config=config,
        objective=OBJECTIVE,
        parameters=n_params,
        files=file_sizes(out, ["config.json", "model.safetensors", "tokenizer.json"]),
        tokens_unit="training tokens: batch_size x seq_len per step",
    )
    write_card(out, record)
    return record
