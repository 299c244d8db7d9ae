"""Weaver training over the frozen target and the frozen DFlash drafter.

No Weaver training code is public (DESIGN.md section 10); this is our recipe:

* Per window, N anchors a (as for DFlash). The target gives the verifier hidden state at a - 1
  (the state whose logits produced the bonus x_a), the DFlash drafter gives its block states and
  per-depth logits; the pool of depth d is the DFlash top-K at depth d (K = ``top_k``, stored in
  ``tfm_config.json`` so inference uses the same pool size).
* Teacher forcing on realised tokens: the path is the data continuation x_a (root, depth 0),
  x_{a+1}, ..., x_{a+D-1}; the node at depth j scores the pool of depth j + 1 in one causal pass
  (``Weaver.path_queries``).
* Loss per node: forward KL from the target's next-token distribution at position a + j (given the
  true prefix) restricted to the pool and renormalised, to Weaver's distribution over the pool,
  scaled by the covered target mass m (``losses.pool_forward_kl``). Mass outside the pool gets no
  gradient: no tree can contain those tokens, so Weaver has nothing to decide about them, and a
  node whose pool misses most of the target mass counts proportionally less.
* Only nodes that a tree could contain are trained: a node at depth j counts iff every path token
  at depths 1..j is in its depth's pool (``require_path_in_pool``).
* Zero-initialised ``lm_head_query_in``: at step 0 Weaver's scores equal the DFlash pool
  distribution exactly, and training only moves away from it where the target disagrees. The
  held-out metric ``loss_dflash`` is the same loss for the plain DFlash pool scores (the baseline).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor, nn

from vllm_tfm.models import DFlashDrafter, TfmConfig, Weaver, WeaverConfig
from vllm_tfm.models.common import compute_dtype

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
from .losses import depth_weights, pool_forward_kl, weighted_mean
from .stage import (
    RunOptions,
    count_parameters,
    export_copy,
    loop_record,
    prepare_data,
    run_stage_loop,
)
from .target import SAVE_DTYPES, load_target, run_target

__all__ = [
    "WeaverModelSpec",
    "WeaverTrainConfig",
    "WeaverBatch",
    "load_frozen_drafter",
    "weaver_batch",
    "weaver_pool_logprobs",
    "weaver_losses",
    "train_weaver",
    "ensure_drafter_files",
]

STREAM_WEAVER = 3


class WeaverModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    d_rank: int = Field(gt=0)
    n_layers: int = Field(gt=0)
    n_heads: int = Field(gt=0)
    d_mlp: int = Field(gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)
    norm_eps: float = Field(default=1e-6, gt=0)


class WeaverTrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: Literal["weaver"]
    model: WeaverModelSpec
    top_k: int = Field(gt=1, description="DFlash candidates per depth (the pool), saved as tfm_config.top_k")
    seq_len: int = Field(gt=2)
    batch_size: int = Field(gt=0)
    anchors_per_seq: int = Field(gt=0)
    require_path_in_pool: bool = True
    depth_decay: float | None = Field(default=None, gt=0, description="exp(-(d-1)/gamma) node weights; null: uniform")
    eval_windows: int = Field(default=32, gt=0)
    eval_batch_size: int = Field(default=8, gt=0)
    save_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    seed: int = 0
    schedule: Schedule
    data: DataConfig = DataConfig()


@dataclass
class WeaverBatch:
    """R = B * N training trees, D = block_size - 1 depths, K candidates.

    verifier_hidden [R, H]; dflash_hidden [R, D, H] (block slots 1..D after the DFlash final norm);
    cand_ids [R, D, K] int64 and cand_logits [R, D, K] (row d - 1: depth d's pool, raw DFlash
    logits, descending); path_tokens [R, D] (column j: the realised token at depth j, column 0 the
    bonus); target_logp [R, D, K] (row j: log p_target of depth j+1's candidates, full-vocab
    normalisation); valid [R, D] bool (row j trainable)."""

    verifier_hidden: Tensor
    dflash_hidden: Tensor
    cand_ids: Tensor
    cand_logits: Tensor
    path_tokens: Tensor
    target_logp: Tensor
    valid: Tensor


def load_frozen_drafter(directory: str | Path, target: nn.Module, device: torch.device) -> DFlashDrafter:
    dtype = next(target.parameters()).dtype
    drafter = DFlashDrafter.from_pretrained(directory, dtype=dtype, device=device, target_config=target.config)
    drafter.eval()
    for p in drafter.parameters():
        p.requires_grad_(False)
    return drafter


@torch.no_grad()
def weaver_batch(
    drafter: DFlashDrafter,
    input_ids: Tensor,
    taps: Tensor,
    final_hidden: Tensor,
    target_logits: Tensor,
    anchors: Tensor,
    top_k: int,
    embed: Tensor,
    lm_head: Tensor,
    require_path_in_pool: bool,
    dtype: torch.dtype,
) -> WeaverBatch:
    """Build the Weaver inputs and targets of ``anchors [B, N]`` into windows ``input_ids [B, L]``
    (taps [B, L, F], final_hidden [B, L, H], target_logits [B, L, V] from the frozen target)."""
    dcfg = drafter.config
    depth = dcfg.block_size - 1
    if top_k > dcfg.vocab_size:
        raise ValueError(f"top_k {top_k} exceeds the vocabulary size {dcfg.vocab_size}")
    ids = block_inputs(input_ids, anchors, dcfg.block_size, dcfg.mask_token_id)
    hidden = drafter.norm(dflash_block_prenorm(drafter, taps, anchors, ids, embed))[:, :, 1:, :]
    dlogits = lm_head_logits(hidden, lm_head).float()  # [B, N, D, V]
    cand_logits, cand_ids = dlogits.topk(top_k, dim=-1)
    pos = depth_positions(anchors, depth)
    path = gather_rows(input_ids, pos)  # [B, N, D]
    t_logp = torch.log_softmax(gather_rows(target_logits, pos).float(), dim=-1).gather(-1, cand_ids)
    valid = torch.ones_like(path, dtype=torch.bool)
    if require_path_in_pool and depth > 1:
        # token at depth j (column j >= 1) must be in depth j's pool (cand row j - 1)
        in_pool = (cand_ids[:, :, :-1, :] == path[:, :, 1:, None]).any(-1)  # [B, N, D - 1]
        valid[:, :, 1:] = in_pool.int().cumprod(-1).bool()
    verifier = gather_rows(final_hidden, anchors - 1)  # [B, N, H]
    r = anchors.numel()
    return WeaverBatch(
        verifier_hidden=verifier.reshape(r, -1).to(dtype),
        dflash_hidden=hidden.reshape(r, depth, -1).to(dtype),
        cand_ids=cand_ids.reshape(r, depth, top_k),
        cand_logits=cand_logits.reshape(r, depth, top_k).to(dtype),
        path_tokens=path.reshape(r, depth),
        target_logp=t_logp.reshape(r, depth, top_k),
        valid=valid.reshape(r, depth),
    )


def weaver_pool_logprobs(weaver: Weaver, batch: WeaverBatch, embed: Tensor, lm_head: Tensor) -> Tensor:
    """[R, D, K] Weaver log-probabilities over each node's pool; equals ``Weaver.score_paths``
    (the residual is taken for the whole vocabulary and gathered, cheaper than gathering K rows
    of the lm_head per node)."""
    qry = weaver.path_queries(batch.verifier_hidden, batch.dflash_hidden, batch.path_tokens, embed)
    cd = compute_dtype(qry.dtype)
    residual = lm_head_logits(qry, lm_head).to(cd).gather(-1, batch.cand_ids)
    return torch.log_softmax(batch.cand_logits.to(cd) + residual, dim=-1)


def weaver_losses(
    weaver: Weaver, batch: WeaverBatch, embed: Tensor, lm_head: Tensor, depth_decay: float | None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Loss and detached metrics: ``coverage`` (mean pool mass m), ``loss_dflash`` (the loss of
    the plain DFlash pool scores), ``acc`` (Weaver's top candidate == the target's top candidate)."""
    logq = weaver_pool_logprobs(weaver, batch, embed, lm_head)
    per, m = pool_forward_kl(batch.target_logp, logq)
    w = depth_weights(per.shape[-1], depth_decay, device=per.device)[None, :] * batch.valid
    loss = weighted_mean(per, w)
    with torch.no_grad():
        base, _ = pool_forward_kl(batch.target_logp, torch.log_softmax(batch.cand_logits.to(logq.dtype), dim=-1))
        agree = (logq.argmax(-1) == batch.target_logp.argmax(-1)).float()
        metrics = {
            "coverage": weighted_mean(m, w),
            "loss_dflash": weighted_mean(base, w),
            "acc": weighted_mean(agree, w),
            "valid_frac": batch.valid.float().mean(),
        }
    return loss, metrics


OBJECTIVE = (
    "Objective: teacher forcing on the realised data path x_a..x_{a+D-1}; per node, forward KL from "
    "the frozen target's distribution restricted to the DFlash top-K pool of the next depth "
    "(renormalised) to Weaver's pool distribution, scaled by the pool's target mass m; out-of-pool "
    "mass gets no gradient; nodes whose path leaves the pools are skipped. lm_head_query_in starts "
    "at zero (Weaver == DFlash pool scores at step 0). Held-out: loss, loss_dflash (baseline), "
    "coverage, acc."
)


def train_weaver(
    config: WeaverTrainConfig, opts: RunOptions, target_dir: str | Path, drafter_dir: str | Path
) -> dict[str, Any]:
    """Train Weaver; write tfm/weaver.safetensors + tfm_config.json (+ card) into ``opts.out`` (a
    complete drafter directory: the DFlash files are copied there when it is not ``drafter_dir``)."""
    device = opts.device
    target = load_target(target_dir, device)
    drafter = load_frozen_drafter(drafter_dir, target, device)
    dcfg = drafter.config
    manifest, streams = prepare_data(opts, config.data, target_dir)
    spec = config.model
    wcfg = WeaverConfig(
        d_model=dcfg.hidden_size,
        d_rank=spec.d_rank,
        n_layers=spec.n_layers,
        n_heads=spec.n_heads,
        d_mlp=spec.d_mlp,
        max_depth=dcfg.max_depth,
        rope_theta=spec.rope_theta,
        norm_eps=spec.norm_eps,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        weaver = Weaver(wcfg)
    nn.init.zeros_(weaver.lm_head_query_in.weight)
    weaver.to(device)
    n_params = count_parameters(weaver)
    print(f"[weaver] {n_params:,} parameters, pool top-{config.top_k}, depths {dcfg.max_depth}", flush=True)
    embed = target.model.embed_tokens.weight
    lm_head = target.lm_head.weight
    L, g = config.seq_len, dcfg.block_size
    held = eval_windows(streams.eval, config.eval_windows, L)
    taps_ids = list(dcfg.target_layer_ids)
    wdtype = next(weaver.parameters()).dtype

    def batch_loss(w: Tensor, anchors: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        with torch.no_grad():
            t = run_target(target, w, taps_ids)
            wb = weaver_batch(
                drafter, w, t.taps, t.final, t.logits, anchors, config.top_k, embed, lm_head,
                config.require_path_in_pool, wdtype,
            )  # fmt: skip
        return weaver_losses(weaver, wb, embed, lm_head, config.depth_decay)

    step_fn, eval_fn = anchored_loop_fns(streams, held, config, g, STREAM_WEAVER, device, batch_loss)
    result = run_stage_loop("weaver", weaver, config, opts, step_fn, eval_fn, device)
    out = Path(opts.out)
    ensure_drafter_files(drafter_dir, out)
    export_copy(weaver, SAVE_DTYPES[config.save_dtype]).save_pretrained(out)
    tfm = TfmConfig.load(out)
    TfmConfig.from_dict({**tfm.model_dump(mode="json"), "top_k": config.top_k}).save(out)
    record = loop_record(
        stage="weaver",
        title=f"Weaver (pool top-{config.top_k})",
        result=result,
        opts=opts,
        seed=config.seed,
        manifest=manifest,
        streams=streams,
        config=config,
        objective=OBJECTIVE,
        parameters=n_params,
        files=file_sizes(out, ["tfm_config.json", "tfm/weaver.safetensors"]),
        tokens_unit="scored tree nodes: batch_size x anchors_per_seq x (block_size - 1) per step",
    )
    write_card(out, record)
    return record


def ensure_drafter_files(drafter_dir: str | Path, out: Path) -> None:
    """Make ``out`` a drafter directory: copy the DFlash files when writing elsewhere."""
    src = Path(drafter_dir)
    if src.resolve() == out.resolve():
        return
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors", "tfm_config.json", "training_dflash.json"):
        if (src / name).is_file() and not (out / name).is_file():
            shutil.copyfile(src / name, out / name)
