"""DFlash drafter training against the frozen toy target.

Recipe (DFlash, Chen, Liang & Liu, arXiv 2602.06036, training section; public trainers such as
SpecForge's ``specforge/core/dflash.py`` implement the same; written here from that description):

* Per training window of L tokens, N anchor positions a are drawn without replacement from
  [1, L - gamma] (several blocks per sequence share one target forward).
* Block input: [x_a, MASK x (gamma - 1)] at positions a .. a + gamma - 1, attending (non-causally)
  to the whole block and to the projected target context of positions 0 .. a - 1 only (the bonus
  token x_a has no target hidden state yet at inference).
* Slot k = 1..gamma-1 predicts the token at depth k, x_{a+k}. Loss per slot: forward KL from the
  target's next-token distribution at position a + k - 1 (given the true prefix) to the drafter's
  softmax (``loss = "kl"``, default), or cross-entropy to the data token x_{a+k} (``"ce"``, the
  paper's choice on target-generated responses). The paper trains on responses the target itself
  generated so that the labels are the target's; the soft target labels here give the same
  alignment without a generation pass: in expectation over data prefixes their minimiser is the
  target's marginal at depth k when the data follows the target.
* Slot weights exp(-(k - 1) / gamma_w), gamma_w = ``loss_decay_gamma`` (the paper's exponential
  position decay; the shipped config uses 7 for block size 16, configurable): early slots matter
  most, since a slot only counts when every earlier draft was accepted.
* The target embedding and lm_head are shared and frozen; the drafter's layers, ``fc`` and norms
  train. Tapped layers follow z-lab's rule (``zlab_target_layer_ids``).

The batched training forward :func:`dflash_block_prenorm` computes every block of a window in one
pass over the drafter's own submodules and equals ``DFlashDrafter.forward`` block by block (a CPU
test checks it in float64).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from vllm_tfm.models import DFlashConfig, DFlashDrafter
from vllm_tfm.models.common import apply_rope

from .card import file_sizes, write_card
from .data import DataConfig, eval_windows, sample_windows
from .loop import Schedule, StepOutput
from .losses import cross_entropy_rows, depth_weights, forward_kl, weighted_mean
from .stage import (
    RunOptions,
    count_parameters,
    export_copy,
    loop_record,
    prepare_data,
    run_stage_loop,
)
from .target import SAVE_DTYPES, load_target, run_target
from .tokenizer import load_tokenizer, special_token_ids

__all__ = [
    "DFlashModelSpec",
    "DFlashTrainConfig",
    "zlab_target_layer_ids",
    "make_dflash_config",
    "sample_anchors",
    "block_inputs",
    "dflash_block_prenorm",
    "depth_positions",
    "gather_rows",
    "lm_head_logits",
    "dflash_losses",
    "train_dflash",
]

STREAM_DFLASH = 2
EVAL_STREAM = 1000


class DFlashModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    num_hidden_layers: int = Field(gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    block_size: int = Field(default=16, ge=2)
    rope_theta: float = Field(default=10000.0, gt=0)
    rms_norm_eps: float = Field(default=1e-6, gt=0)
    target_layer_ids: list[int] | None = Field(default=None, description="null: z-lab's evenly spaced rule")
    causal: bool = False


class DFlashTrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: Literal["dflash"]
    model: DFlashModelSpec
    seq_len: int = Field(gt=2)
    batch_size: int = Field(gt=0)
    anchors_per_seq: int = Field(gt=0)
    loss: Literal["kl", "ce"] = "kl"
    loss_decay_gamma: float | None = Field(default=7.0, gt=0)
    eval_windows: int = Field(default=32, gt=0)
    eval_batch_size: int = Field(default=8, gt=0)
    save_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    seed: int = 0
    schedule: Schedule
    data: DataConfig = DataConfig()


def zlab_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """z-lab's default taps (github.com/z-lab/dflash, ``build_target_layer_ids``): one per draft
    layer, evenly spaced from layer 1 to layer L - 3, rounded; a 1-layer drafter taps L // 2.
    E.g. (36, 5) -> [1, 9, 17, 25, 33] (their Qwen3-8B drafter), (8, 3) -> [1, 3, 5]."""
    if num_draft_layers < 1 or num_target_layers < 1:
        raise ValueError("num_target_layers and num_draft_layers must be >= 1")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end <= start:
        raise ValueError(f"a {num_target_layers}-layer target is too shallow for z-lab's tap rule (needs >= 5 layers)")
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def make_dflash_config(spec: DFlashModelSpec, target_config: Any, mask_token_id: int) -> DFlashConfig:
    """The drafter's z-lab config for ``target_config`` (a Hugging Face text config)."""
    n_target = int(target_config.num_hidden_layers)
    taps = spec.target_layer_ids or zlab_target_layer_ids(n_target, spec.num_hidden_layers)
    return DFlashConfig.create(
        hidden_size=int(target_config.hidden_size),
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        intermediate_size=spec.intermediate_size,
        vocab_size=int(target_config.vocab_size),
        target_layer_ids=list(taps),
        mask_token_id=mask_token_id,
        block_size=spec.block_size,
        num_target_layers=n_target,
        rope_theta=spec.rope_theta,
        rms_norm_eps=spec.rms_norm_eps,
        max_position_embeddings=int(getattr(target_config, "max_position_embeddings", 4096)),
        causal=True if spec.causal else None,
        dtype="bfloat16",
    )


def sample_anchors(batch: int, seq_len: int, n: int, block_size: int, seed: int, step: int, stream_id: int) -> Tensor:
    """[batch, n] int64 anchors per row, distinct and sorted, in [1, seq_len - block_size];
    a pure function of (seed, step, stream_id)."""
    choices = seq_len - block_size
    if n > choices:
        raise ValueError(f"anchors_per_seq {n} exceeds the {choices} anchor positions of a {seq_len}-token window")
    rng = np.random.default_rng([seed, step, stream_id, 7])
    keys = rng.random((batch, choices))
    idx = np.sort(np.argsort(keys, axis=1, kind="stable")[:, :n], axis=1) + 1
    return torch.from_numpy(idx.astype(np.int64))


def block_inputs(input_ids: Tensor, anchors: Tensor, block_size: int, mask_id: int) -> Tensor:
    """[B, N, gamma] block token ids [x_a, MASK, ..., MASK] for ``anchors [B, N]`` into ``input_ids [B, L]``."""
    b, n = anchors.shape
    out = torch.full((b, n, block_size), mask_id, dtype=torch.long, device=input_ids.device)
    out[:, :, 0] = input_ids.gather(1, anchors)
    return out


def depth_positions(anchors: Tensor, depth: int) -> Tensor:
    """[B, N, depth] positions a + j for j = 0..depth-1 (the target position whose logits give
    the distribution of the token at depth j + 1)."""
    return anchors[..., None] + torch.arange(depth, device=anchors.device)


def gather_rows(x: Tensor, positions: Tensor) -> Tensor:
    """x [B, L, ...] at positions [B, ...] (same B) -> [B, ..., x.shape[2:]]."""
    b = x.shape[0]
    bidx = torch.arange(b, device=x.device).view(b, *([1] * (positions.dim() - 1)))
    return x[bidx, positions]


def lm_head_logits(hidden: Tensor, lm_head: Tensor) -> Tensor:
    """hidden [..., H] @ lm_head [V, H]^T; the weight follows the hidden dtype outside autocast."""
    if hidden.dtype != lm_head.dtype and not torch.is_autocast_enabled(hidden.device.type):
        lm_head = lm_head.to(hidden.dtype)
    return F.linear(hidden, lm_head)


def _attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float) -> Tensor:
    """q [B, Q, h, D], k/v [B, S, hkv, D] (GQA as repeat_interleave), mask [B, Q, S] -> [B, Q, h, D]."""
    rep = q.shape[2] // k.shape[2]
    if rep > 1:
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
    if v.dtype != q.dtype:  # autocast: projections come out in bf16 unless inputs were fp64
        k, v = k.to(q.dtype), v.to(q.dtype)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask[:, None], scale=scale
    )
    return out.transpose(1, 2)


def dflash_block_prenorm(
    drafter: DFlashDrafter, taps: Tensor, anchors: Tensor, block_ids: Tensor, embed: Tensor
) -> Tensor:
    """All blocks of a batch of windows in one pass.

    Args:
        taps: [B, L, n_taps * H_target] tapped target layer outputs of each window.
        anchors: [B, N] int64 bonus positions (>= 1); block n of row b sees context 0..a-1.
        block_ids: [B, N, gamma] from :func:`block_inputs`; slot i sits at position a + i.
        embed: [V, H] target input embedding weight.
    Returns:
        [B, N, gamma, H] residual stream before the drafter's final norm (``forward_prenorm``).
    """
    cfg = drafter.config
    b, length, _ = taps.shape
    n, g = anchors.shape[1], cfg.block_size
    dev = taps.device
    wdtype = drafter.fc.weight.dtype
    ctx = drafter.project_context(taps.reshape(b * length, -1).to(wdtype)).view(b, length, -1)
    cos_c, sin_c = drafter._rope(torch.arange(length, device=dev), ctx.dtype)
    pos_b = (anchors[..., None] + torch.arange(g, device=dev)).reshape(b, n * g)
    x = F.embedding(block_ids.reshape(b, n * g), embed).to(wdtype)
    cos_b, sin_b = drafter._rope(pos_b, x.dtype)
    a_q = anchors.repeat_interleave(g, dim=1)  # [B, Q] anchor of each query
    see_ctx = torch.arange(length, device=dev)[None, None, :] < a_q[..., None]
    blk = torch.arange(n * g, device=dev) // g
    see_blk = blk[:, None] == blk[None, :]
    if cfg.causal:
        slot = torch.arange(n * g, device=dev) % g
        see_blk = see_blk & (slot[None, :] <= slot[:, None])
    mask = torch.cat([see_ctx, see_blk.expand(b, -1, -1)], dim=-1)  # [B, Q, L + Q]
    for layer in drafter.layers:
        att = layer.self_attn
        ck, cv = att.key_value(ctx, cos_c, sin_c)
        h = layer.input_layernorm(x)
        q = att.q_norm(att.q_proj(h).unflatten(-1, (att.n_heads, att.head_dim)))
        q = apply_rope(q, cos_b, sin_b)
        bk, bv = att.key_value(h, cos_b, sin_b)
        o = _attention(q, torch.cat([ck, bk], 1), torch.cat([cv, bv], 1), mask, att.head_dim**-0.5)
        x = x + att.o_proj(o.flatten(-2))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x.view(b, n, g, -1)


def dflash_losses(
    drafter: DFlashDrafter,
    config: DFlashTrainConfig,
    input_ids: Tensor,
    taps: Tensor,
    target_logits: Tensor,
    anchors: Tensor,
    embed: Tensor,
    lm_head: Tensor,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The weighted block loss and detached metrics for one batch of windows.

    input_ids [B, L]; taps [B, L, F]; target_logits [B, L, V]; anchors [B, N]; embed / lm_head [V, H].
    Metrics: ``kl`` (weighted forward KL to the target, whatever the loss), ``acc`` (drafter argmax
    == target argmax, all depths), ``acc_d1`` (depth 1) and ``accept_tf`` (mean number of leading
    depths where both argmaxes agree: a teacher-forced chain-acceptance proxy).
    """
    dcfg = drafter.config
    depth = dcfg.block_size - 1
    ids = block_inputs(input_ids, anchors, dcfg.block_size, dcfg.mask_token_id)
    pre = dflash_block_prenorm(drafter, taps, anchors, ids, embed)
    hidden = drafter.norm(pre)[:, :, 1:, :]  # [B, N, D, H]
    logits = lm_head_logits(hidden, lm_head)
    pos = depth_positions(anchors, depth)  # [B, N, D]
    t_logits = gather_rows(target_logits, pos)  # [B, N, D, V]
    w = depth_weights(depth, config.loss_decay_gamma, device=logits.device)
    kl = forward_kl(t_logits, logits)
    if config.loss == "kl":
        loss = weighted_mean(kl, w)
    else:
        loss = weighted_mean(cross_entropy_rows(logits, gather_rows(input_ids, pos + 1)), w)
    with torch.no_grad():
        agree = logits.argmax(-1) == t_logits.argmax(-1)  # [B, N, D]
        metrics = {
            "kl": weighted_mean(kl.detach(), w),
            "acc": agree.float().mean(),
            "acc_d1": agree[..., 0].float().mean(),
            "accept_tf": agree.int().cumprod(-1).sum(-1).float().mean(),
        }
    return loss, metrics


OBJECTIVE = (
    "Objective (DFlash, arXiv 2602.06036): N random anchors per window; block [x_a, MASK x "
    "(gamma-1)] at positions a.., context = projected taps of positions < a; slot k predicts the "
    "depth-k token; loss = forward KL from the frozen target's next-token distribution (or CE to "
    "the data token) weighted exp(-(k-1)/gamma_w). Held-out: the same loss, kl, top-1 agreement "
    "with the target (acc, acc_d1) and accept_tf (leading agreeing depths, teacher forced)."
)


def train_dflash(config: DFlashTrainConfig, opts: RunOptions, target_dir: str | Path) -> dict[str, Any]:
    """Train a DFlash drafter for the target in ``target_dir``; write the z-lab layout + card to
    ``opts.out``. Returns the card record."""
    device = opts.device
    target = load_target(target_dir, device)
    tok = load_tokenizer(target_dir)
    mask_id = special_token_ids(tok)["mask"]
    dcfg = make_dflash_config(config.model, target.config, mask_id)
    dcfg.validate_against_target(target.config)
    manifest, streams = prepare_data(opts, config.data, target_dir)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        drafter = DFlashDrafter(dcfg)
    drafter.to(device)
    n_params = count_parameters(drafter)
    print(f"[dflash] {n_params:,} parameters, taps {list(dcfg.target_layer_ids)}, block {dcfg.block_size}", flush=True)
    embed = target.model.embed_tokens.weight
    lm_head = target.lm_head.weight
    L, g = config.seq_len, dcfg.block_size
    held = eval_windows(streams.eval, config.eval_windows, L)
    taps_ids = list(dcfg.target_layer_ids)

    def batch_loss(w: Tensor, anchors: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        with torch.no_grad():
            t = run_target(target, w, taps_ids)
        return dflash_losses(drafter, config, w, t.taps, t.logits, anchors, embed, lm_head)

    step_fn, eval_fn = anchored_loop_fns(streams, held, config, g, STREAM_DFLASH, device, batch_loss)
    result = run_stage_loop("dflash", drafter, config, opts, step_fn, eval_fn, device)
    out = Path(opts.out)
    export_copy(drafter, SAVE_DTYPES[config.save_dtype]).save_pretrained(out)
    record = loop_record(
        stage="dflash",
        title=f"DFlash drafter (block {dcfg.block_size}, taps {list(dcfg.target_layer_ids)})",
        result=result,
        opts=opts,
        seed=config.seed,
        manifest=manifest,
        streams=streams,
        config=config,
        objective=OBJECTIVE,
        parameters=n_params,
        files=file_sizes(out, ["config.json", "model.safetensors"]),
        tokens_unit="supervised draft positions: batch_size x anchors_per_seq x (block_size - 1) per step",
    )
    write_card(out, record)
    return record


def anchored_loop_fns(streams: Any, held: Tensor, config: Any, block_size: int, stream: int, device: torch.device,
                      batch_loss: Any) -> tuple[Any, Any]:
    """step_fn / eval_fn of the anchored-block stages (DFlash, Weaver, TreeFlash).

    A step draws ``config.batch_size`` windows of ``config.seq_len`` tokens and
    ``config.anchors_per_seq`` anchors each (deterministic in seed, step and ``stream``) and
    returns ``batch_loss(windows, anchors)``; evaluation averages it over the held-out windows.
    """
    L, B, N, g = config.seq_len, config.batch_size, config.anchors_per_seq, block_size

    def step_fn(step: int) -> StepOutput:
        w = sample_windows(streams.train, B, L, config.seed, step, stream).to(device)
        anchors = sample_anchors(B, L, N, g, config.seed, step, stream).to(device)
        loss, metrics = batch_loss(w, anchors)
        return StepOutput(loss=loss, tokens=B * N * (g - 1), metrics=metrics)

    def eval_fn() -> dict[str, float]:
        sums: dict[str, float] = {}
        count = 0
        for i in range(0, held.shape[0], config.eval_batch_size):
            w = held[i : i + config.eval_batch_size].to(device)
            anchors = sample_anchors(w.shape[0], L, N, g, config.seed, i, EVAL_STREAM).to(device)
            loss, metrics = batch_loss(w, anchors)
            for k, v in {"loss": loss, **metrics}.items():
                sums[k] = sums.get(k, 0.0) + float(v) * w.shape[0]
            count += w.shape[0]
        return {k: v / count for k, v in sums.items()}

    return step_fn, eval_fn
