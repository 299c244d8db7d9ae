"""TreeFlash AR-approximator training over the frozen target and the frozen DFlash drafter.

No TreeFlash training code is public; the paper's summary is the spec (DESIGN.md section 10):
forward KL, zero-initialised down projection, teacher forcing, loss weighted toward early
positions. Concretely, per anchor a and depth d = 1..D:

* input: the DFlash residual stream h_d (block slot d, before the drafter's final norm) and the
  realised previous token x_{a+d-1} (the bonus x_a at d = 1) -- teacher forcing on data;
* output: h'_d = h_d + down(u * silu(gate)), logits = lm_head(final_norm(h'_d)) with the drafter's
  own final norm and the target's lm_head (both frozen);
* loss: KL(p_target(. | x_{<=a+d-1}) || softmax(logits)) over the full vocabulary, weighted
  exp(-(d - 1) / gamma) (``depth_decay``) and averaged.

Because ``down`` starts at zero, step 0 reproduces the DFlash marginals; the held-out metric
``kl_marginal`` is the same weighted KL of those uncorrected marginals (the baseline).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from vllm_tfm.models import DFlashDrafter, TreeFlashApproximator, TreeFlashConfig

from .card import file_sizes, write_card
from .data import DataConfig, eval_windows
from .dflash import (
    anchored_loop_fns,
    block_inputs,
    depth_positions,
    dflash_block_prenorm,
    gather_rows,
    lm_head_logits,
)
from .loop import Schedule
from .losses import depth_weights, forward_kl, weighted_mean
from .stage import (
    RunOptions,
    count_parameters,
    export_copy,
    loop_record,
    prepare_data,
    run_stage_loop,
)
from .target import SAVE_DTYPES, load_target, run_target
from .weaver import ensure_drafter_files, load_frozen_drafter

__all__ = ["TreeFlashModelSpec", "TreeFlashTrainConfig", "treeflash_losses", "train_treeflash"]

STREAM_TREEFLASH = 4


class TreeFlashModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    intermediate_size: int = Field(gt=0)
    in_bias: bool = True
    norm_eps: float = Field(default=1e-6, gt=0)


class TreeFlashTrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: Literal["treeflash"]
    model: TreeFlashModelSpec
    seq_len: int = Field(gt=2)
    batch_size: int = Field(gt=0)
    anchors_per_seq: int = Field(gt=0)
    depth_decay: float | None = Field(default=7.0, gt=0)
    eval_windows: int = Field(default=32, gt=0)
    eval_batch_size: int = Field(default=8, gt=0)
    save_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    seed: int = 0
    schedule: Schedule
    data: DataConfig = DataConfig()


def treeflash_losses(
    approx: TreeFlashApproximator,
    drafter: DFlashDrafter,
    input_ids: Tensor,
    taps: Tensor,
    target_logits: Tensor,
    anchors: Tensor,
    embed: Tensor,
    lm_head: Tensor,
    depth_decay: float | None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted transition KL and metrics (``kl_marginal`` baseline, ``acc``: argmax agreement
    with the target). input_ids [B, L], taps [B, L, F], target_logits [B, L, V], anchors [B, N]."""
    dcfg = drafter.config
    depth = dcfg.block_size - 1
    wdtype = next(approx.parameters()).dtype
    with torch.no_grad():
        ids = block_inputs(input_ids, anchors, dcfg.block_size, dcfg.mask_token_id)
        h = dflash_block_prenorm(drafter, taps, anchors, ids, embed)[:, :, 1:, :].to(wdtype)  # [B, N, D, H]
        pos = depth_positions(anchors, depth)
        prev = F.embedding(gather_rows(input_ids, pos), embed).to(wdtype)  # x_{a+d-1}, d = 1..D
        t_logits = gather_rows(target_logits, pos)
        base_logits = lm_head_logits(drafter.norm(h.to(drafter.norm.weight.dtype)), lm_head)
    norm = drafter.norm
    h2 = approx(prev, h, norm)
    logits = lm_head_logits(norm(h2), lm_head)
    kl = forward_kl(t_logits, logits)
    w = depth_weights(depth, depth_decay, device=kl.device)
    loss = weighted_mean(kl, w)
    with torch.no_grad():
        metrics = {
            "kl_marginal": weighted_mean(forward_kl(t_logits, base_logits), w),
            "acc": (logits.argmax(-1) == t_logits.argmax(-1)).float().mean(),
            "acc_marginal": (base_logits.argmax(-1) == t_logits.argmax(-1)).float().mean(),
        }
    return loss, metrics


OBJECTIVE = (
    "Objective (TreeFlash approximator): teacher forcing on the realised previous token; forward "
    "KL from the frozen target's next-token distribution to softmax(lm_head(norm(h + down(u * "
    "silu(gate))))) at every depth, weighted exp(-(d-1)/gamma); zero-initialised down (step 0 == "
    "DFlash marginals). Held-out: loss, kl_marginal (baseline), acc, acc_marginal."
)


def train_treeflash(
    config: TreeFlashTrainConfig, opts: RunOptions, target_dir: str | Path, drafter_dir: str | Path
) -> dict[str, Any]:
    """Train the approximator; write tfm/treeflash.safetensors + tfm_config.json (+ card) into ``opts.out``."""
    device = opts.device
    target = load_target(target_dir, device)
    drafter = load_frozen_drafter(drafter_dir, target, device)
    dcfg = drafter.config
    manifest, streams = prepare_data(opts, config.data, target_dir)
    tcfg = TreeFlashConfig(
        hidden_size=dcfg.hidden_size,
        intermediate_size=config.model.intermediate_size,
        in_bias=config.model.in_bias,
        norm_eps=config.model.norm_eps,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        approx = TreeFlashApproximator(tcfg)  # down is zero-initialised by the model
    approx.to(device)
    n_params = count_parameters(approx)
    print(f"[treeflash] {n_params:,} parameters", flush=True)
    embed = target.model.embed_tokens.weight
    lm_head = target.lm_head.weight
    L, g = config.seq_len, dcfg.block_size
    held = eval_windows(streams.eval, config.eval_windows, L)
    taps_ids = list(dcfg.target_layer_ids)

    def batch_loss(w: Tensor, anchors: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        with torch.no_grad():
            t = run_target(target, w, taps_ids)
        return treeflash_losses(approx, drafter, w, t.taps, t.logits, anchors, embed, lm_head, config.depth_decay)

    step_fn, eval_fn = anchored_loop_fns(streams, held, config, g, STREAM_TREEFLASH, device, batch_loss)
    result = run_stage_loop("treeflash", approx, config, opts, step_fn, eval_fn, device)
    out = Path(opts.out)
    ensure_drafter_files(drafter_dir, out)
    export_copy(approx, SAVE_DTYPES[config.save_dtype]).save_pretrained(out)
    record = loop_record(
        stage="treeflash",
        title="TreeFlash AR approximator",
        result=result,
        opts=opts,
        seed=config.seed,
        manifest=manifest,
        streams=streams,
        config=config,
        objective=OBJECTIVE,
        parameters=n_params,
        files=file_sizes(out, ["tfm_config.json", "tfm/treeflash.safetensors"]),
        tokens_unit="supervised transitions: batch_size x anchors_per_seq x (block_size - 1) per step",
    )
    write_card(out, record)
    return record
