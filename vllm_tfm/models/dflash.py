"""DFlash block drafter (z-lab layout), plain torch.

DFlash (z-lab, github.com/z-lab/dflash; "DFlash: block diffusion for flash speculative decoding")
drafts a whole block in one non-causal forward. Written from the public model description and
vLLM 0.26's ``qwen3_dflash.py`` loader; no code copied.

The function, per request (H = drafter hidden size = target hidden size):

* context feature ``c = hidden_norm(fc(target_hidden))`` [C, H], where ``target_hidden`` [C,
  n_tapped * H_target] concatenates, for every context token, the outputs of the target decoder
  layers ``target_layer_ids`` (0-based; Hugging Face ``output_hidden_states[i + 1]``, vLLM aux
  layer ``i + 1``).
* block input ``x = E_target[block_token_ids]`` [gamma, H] with block = [bonus, MASK x (gamma-1)]
  (``mask_token_id`` is a row of the target's embedding table).
* each draft layer (pre-norm Qwen3 block): ``h = input_layernorm(x)``; Q from the block only,
  K and V from ``[c ; h]`` (the context feature is NOT re-normed per layer), per-head RMSNorm
  ``q_norm`` / ``k_norm`` before rotate-half RoPE at the token positions; attention non-causal
  (every block query sees the whole context and the whole block; ``dflash_config.causal = true``
  restricts the block part to earlier-or-same block slots, as vLLM does); then SwiGLU MLP.
* output ``norm(x)`` [gamma, H]; the marginal of the token at depth d (block slot d, d =
  1..gamma-1) is ``lm_head_target(output[d])``. Slot 0 (the bonus) predicts nothing useful.

Positions: the bonus token sits at position P (= number of committed tokens before it), block
slot i at P + i, and context token j at its own position in the sequence (0..P-1 for the full
prefix). vLLM builds exactly these (``copy_and_expand_dflash_inputs_kernel``).

Checkpoint layout: names are those of z-lab's ``DFlashDraftModel`` (no ``model.`` prefix), which
vLLM's ``DFlashQwen3ForCausalLM.load_weights`` prefixes with ``model.`` and stacks (q/k/v ->
qkv_proj, gate/up -> gate_up_proj). The embedding and lm_head are NOT saved: DFlash shares the
target's (vLLM shares them when the checkpoint has no ``embed_tokens`` / ``lm_head``)::

    fc.weight                                  [H, n_tapped * H_target]
    hidden_norm.weight, norm.weight            [H]
    layers.{i}.input_layernorm.weight          [H]
    layers.{i}.post_attention_layernorm.weight [H]
    layers.{i}.self_attn.q_proj.weight         [n_heads * head_dim, H]   (+ .bias if attention_bias)
    layers.{i}.self_attn.k_proj.weight         [n_kv_heads * head_dim, H]  (+ .bias)
    layers.{i}.self_attn.v_proj.weight         [n_kv_heads * head_dim, H]  (+ .bias)
    layers.{i}.self_attn.o_proj.weight         [H, n_heads * head_dim]   (+ .bias)
    layers.{i}.self_attn.q_norm.weight         [head_dim]
    layers.{i}.self_attn.k_norm.weight         [head_dim]
    layers.{i}.mlp.gate_proj.weight            [I, H]
    layers.{i}.mlp.up_proj.weight              [I, H]
    layers.{i}.mlp.down_proj.weight            [H, I]
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .common import RMSNorm, SwiGLU, apply_rope, as_weight, masked_attention, rope_cos_sin
from .io import read_json, read_state, target_text_config, write_json, write_state

__all__ = [
    "DFLASH_ARCHITECTURE",
    "DFLASH_CONFIG_NAME",
    "DFLASH_WEIGHTS_NAME",
    "DFlashConfig",
    "DFlashDrafter",
    "ContextKV",
    "marginal_logits",
    "drafter_logits",
]

DFLASH_ARCHITECTURE = "DFlashDraftModel"
DFLASH_CONFIG_NAME = "config.json"
DFLASH_WEIGHTS_NAME = "model.safetensors"

ContextKV = list[tuple[Tensor, Tensor]]
"""Per draft layer (k, v), each [C, n_kv_heads, head_dim]; k after k_norm and RoPE."""


def _int(d: dict[str, Any], key: str, source: str, default: int | None = None) -> int:
    v = d.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool):
        raise ValueError(f"{source}: {key} must be an integer, got {v!r}")
    return v


@dataclass(frozen=True)
class DFlashConfig:
    """A z-lab DFlash ``config.json`` (a Qwen3 config plus ``dflash_config``), parsed and checked.

    ``raw`` keeps the whole JSON object so that saving writes back every field it came with.
    """

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    target_layer_ids: tuple[int, ...]
    mask_token_id: int
    block_size: int
    causal: bool
    target_hidden_size: int
    raw: dict[str, Any] = field(compare=False, repr=False)

    @property
    def max_depth(self) -> int:
        """Deepest draft depth D = block_size - 1 (slot 0 is the bonus token)."""
        return self.block_size - 1

    @property
    def fc_in_features(self) -> int:
        return len(self.target_layer_ids) * self.target_hidden_size

    # ------------------------------------------------------------------ parse
    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = DFLASH_CONFIG_NAME) -> DFlashConfig:
        """Parse a config.json object; every refusal is one line naming the field."""
        archs = raw.get("architectures")
        if not isinstance(archs, list) or DFLASH_ARCHITECTURE not in archs:
            raise ValueError(f"{source}: architectures must contain {DFLASH_ARCHITECTURE!r}, got {archs!r}")
        model_type = raw.get("model_type", "qwen3")
        if model_type != "qwen3":
            raise ValueError(f"{source}: model_type must be 'qwen3' (a Qwen3 DFlash drafter), got {model_type!r}")
        dfc = raw.get("dflash_config")
        if not isinstance(dfc, dict):
            raise ValueError(f"{source}: missing dflash_config object")
        hidden = _int(raw, "hidden_size", source)
        layers = _int(raw, "num_hidden_layers", source)
        heads = _int(raw, "num_attention_heads", source)
        kv_heads = _int(raw, "num_key_value_heads", source, heads)
        head_dim = raw.get("head_dim") or hidden // heads
        if not isinstance(head_dim, int) or head_dim % 2:
            raise ValueError(f"{source}: head_dim must be an even integer, got {head_dim!r}")
        if heads % kv_heads:
            raise ValueError(
                f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
            )
        inter = _int(raw, "intermediate_size", source)
        vocab = _int(raw, "vocab_size", source)
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act must be 'silu', got {act!r}")
        draft_vocab = raw.get("draft_vocab_size")
        if draft_vocab is not None and draft_vocab != vocab:
            raise ValueError(
                f"{source}: draft_vocab_size {draft_vocab} != vocab_size {vocab} "
                "(reduced draft vocabularies are not supported)"
            )
        rope_theta = cls._rope_theta(raw, source)
        cls._check_full_attention(raw, dfc, layers, source)

        ids = dfc.get("target_layer_ids")
        if (
            not isinstance(ids, list)
            or not ids
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
        ):
            raise ValueError(
                f"{source}: dflash_config.target_layer_ids must be a non-empty list of layer indices >= 0, got {ids!r}"
            )
        if "mask_token_id" not in dfc:
            raise ValueError(f"{source}: missing dflash_config.mask_token_id")
        mask_id = _int(dfc, "mask_token_id", f"{source}: dflash_config")
        if not 0 <= mask_id < vocab:
            raise ValueError(f"{source}: dflash_config.mask_token_id {mask_id} is outside the vocabulary [0, {vocab})")
        top_bs, dfc_bs = raw.get("block_size"), dfc.get("block_size")
        if top_bs is not None and dfc_bs is not None and top_bs != dfc_bs:
            raise ValueError(f"{source}: block_size {top_bs} disagrees with dflash_config.block_size {dfc_bs}")
        bs = dfc_bs if dfc_bs is not None else top_bs
        if not isinstance(bs, int) or isinstance(bs, bool) or bs < 2:
            raise ValueError(
                f"{source}: block size (dflash_config.block_size or block_size) must be an integer >= 2, got {bs!r}"
            )
        causal = dfc.get("causal", False)
        if causal is None:
            causal = False
        if not isinstance(causal, bool):
            raise ValueError(f"{source}: dflash_config.causal must be true/false, got {causal!r}")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=inter,
            vocab_size=vocab,
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            attention_bias=bool(raw.get("attention_bias", False)),
            target_layer_ids=tuple(ids),
            mask_token_id=mask_id,
            block_size=bs,
            causal=causal,
            target_hidden_size=_int(raw, "target_hidden_size", source, hidden),
            raw=copy.deepcopy(raw),
        )

    @staticmethod
    def _rope_theta(raw: dict[str, Any], source: str) -> float:
        params = raw.get("rope_parameters")
        if isinstance(params, dict):
            rtype = params.get("rope_type", params.get("type", "default"))
            theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        else:
            scaling = raw.get("rope_scaling")
            rtype = "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
            theta = raw.get("rope_theta", 10000.0)  # the Hugging Face Qwen3Config default
        if rtype != "default":
            raise ValueError(f"{source}: only default RoPE is supported, got rope_type {rtype!r}")
        if not isinstance(theta, (int, float)) or theta <= 0:
            raise ValueError(f"{source}: rope_theta must be a positive number, got {theta!r}")
        return float(theta)

    @staticmethod
    def _check_full_attention(raw: dict[str, Any], dfc: dict[str, Any], layers: int, source: str) -> None:
        # Hugging Face Qwen3Config: sliding_window only counts when use_sliding_window, and then
        # only for layers >= max_window_layers; vLLM reads layer_types (and dflash_config.use_swa).
        layer_types = raw.get("layer_types")
        if layer_types is None:
            window = raw.get("sliding_window") if raw.get("use_sliding_window", False) else None
            first = raw.get("max_window_layers", 28)
            layer_types = [
                "sliding_attention" if window is not None and i >= first else "full_attention" for i in range(layers)
            ]
        if len(layer_types) != layers:
            raise ValueError(f"{source}: layer_types has {len(layer_types)} entries for {layers} layers")
        bad = [i for i, t in enumerate(layer_types) if t != "full_attention"]
        if bad:
            raise ValueError(
                f"{source}: layer {bad[0]} is {layer_types[bad[0]]!r}; only full-attention DFlash layers are supported"
            )
        if dfc.get("use_swa", False):
            raise ValueError(f"{source}: dflash_config.use_swa is not supported (sliding-window DFlash layers)")
        if dfc.get("attention_sink_bias", raw.get("add_swa_attention_sink_bias", False)):
            raise ValueError(f"{source}: attention sink bias is not supported")

    @classmethod
    def create(
        cls,
        *,
        hidden_size: int,
        num_hidden_layers: int,
        num_attention_heads: int,
        num_key_value_heads: int,
        head_dim: int,
        intermediate_size: int,
        vocab_size: int,
        target_layer_ids: list[int],
        mask_token_id: int,
        block_size: int = 16,
        num_target_layers: int | None = None,
        rope_theta: float = 1_000_000.0,
        rms_norm_eps: float = 1e-6,
        max_position_embeddings: int = 40960,
        attention_bias: bool = False,
        causal: bool | None = None,
        dtype: str = "bfloat16",
    ) -> DFlashConfig:
        """A new config in the z-lab layout (block size both top level and in dflash_config)."""
        dflash_config: dict[str, Any] = {
            "block_size": block_size,
            "mask_token_id": mask_token_id,
            "target_layer_ids": list(target_layer_ids),
        }
        if causal is not None:
            dflash_config["causal"] = causal
        raw: dict[str, Any] = {
            "architectures": [DFLASH_ARCHITECTURE],
            "model_type": "qwen3",
            "attention_bias": attention_bias,
            "attention_dropout": 0.0,
            "block_size": block_size,
            "dflash_config": dflash_config,
            "dtype": dtype,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "hidden_size": hidden_size,
            "intermediate_size": intermediate_size,
            "layer_types": ["full_attention"] * num_hidden_layers,
            "max_position_embeddings": max_position_embeddings,
            "num_attention_heads": num_attention_heads,
            "num_hidden_layers": num_hidden_layers,
            "num_key_value_heads": num_key_value_heads,
            "rms_norm_eps": rms_norm_eps,
            "rope_scaling": None,
            "rope_theta": rope_theta,
            "tie_word_embeddings": False,
            "use_sliding_window": False,
            "sliding_window": None,
            "vocab_size": vocab_size,
        }
        if num_target_layers is not None:
            raw["num_target_layers"] = num_target_layers
        return cls.from_dict(raw, "DFlashConfig.create")

    def to_dict(self) -> dict[str, Any]:
        return copy.deepcopy(self.raw)

    # ------------------------------------------------------------------ target
    def validate_against_target(self, target_config: object) -> None:
        """Refuse a target this drafter cannot serve (one-line ValueError naming the mismatch)."""
        t = target_text_config(target_config)
        if self.vocab_size != t.vocab_size:
            raise ValueError(
                f"DFlash drafter vocab_size {self.vocab_size} does not match the target's vocab_size {t.vocab_size}"
            )
        if self.hidden_size != t.hidden_size:
            raise ValueError(
                f"DFlash drafter hidden_size {self.hidden_size} does not match the target's hidden_size "
                f"{t.hidden_size} (the drafter shares the target embedding and lm_head)"
            )
        if self.target_hidden_size != t.hidden_size:
            raise ValueError(
                f"DFlash drafter target_hidden_size {self.target_hidden_size} does not match the target's "
                f"hidden_size {t.hidden_size}"
            )
        top = max(self.target_layer_ids)
        if top >= t.num_hidden_layers:
            raise ValueError(
                f"DFlash dflash_config.target_layer_ids taps layer {top} "
                f"but the target has {t.num_hidden_layers} layers"
            )


# ---------------------------------------------------------------------- modules


class DFlashAttention(nn.Module):
    """Qwen3 attention whose keys/values are [context feature ; block], queries the block only."""

    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def key_value(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """x [T, H] -> k, v [T, n_kv, head_dim] (k normed per head, then rotated)."""
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.n_kv, self.head_dim)))
        v = self.v_proj(x).unflatten(-1, (self.n_kv, self.head_dim))
        return apply_rope(k, cos, sin), v

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor) -> Tensor:
        """h [Q, H] normed block states; ctx_k/ctx_v [C, n_kv, D]; mask [Q, C + Q] -> [Q, H]."""
        q = self.q_norm(self.q_proj(h).unflatten(-1, (self.n_heads, self.head_dim)))
        q = apply_rope(q, cos, sin)
        k_blk, v_blk = self.key_value(h, cos, sin)
        k = torch.cat([ctx_k, k_blk], dim=0)
        v = torch.cat([ctx_v, v_blk], dim=0)
        out = masked_attention(q, k, v, mask, self.head_dim**-0.5)
        return self.o_proj(out.flatten(-2))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashConfig) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(cfg)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx_k: Tensor, ctx_v: Tensor, mask: Tensor) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx_k, ctx_v, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def _embed(embed: nn.Module | Tensor, ids: Tensor) -> Tensor:
    if isinstance(embed, Tensor):
        return embed[ids]
    return embed(ids)


class DFlashDrafter(nn.Module):
    """The DFlash draft model; parameter names equal the z-lab checkpoint's (see module doc)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.fc = nn.Linear(config.fc_in_features, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # the drafter's own head of its marginal logits (``drafter_logits``); None: the target's lm_head, which
        # z-lab's DFlash shares. Set only to evaluate another head (``vllm-tfm eval --drafter-fp8-head``).
        self.logits_head: nn.Module | None = None

    # ------------------------------------------------------------------ pieces
    def _rope(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, dtype)

    def project_context(self, target_hidden: Tensor) -> Tensor:
        """target_hidden [C, n_tapped * H_target] -> context feature hidden_norm(fc(.)) [C, H]."""
        if target_hidden.dim() != 2 or target_hidden.shape[1] != self.config.fc_in_features:
            raise ValueError(
                f"target_hidden must be [C, {self.config.fc_in_features}] ({len(self.config.target_layer_ids)} "
                f"tapped layers x {self.config.target_hidden_size}), got shape {tuple(target_hidden.shape)}"
            )
        return self.hidden_norm(self.fc(target_hidden))

    def context_kv(self, target_hidden: Tensor, ctx_positions: Tensor) -> ContextKV:
        """Per-layer K/V of context tokens [C] (depends only on each token's own hidden and
        position, so a caller may cache it and concatenate along dim 0 as the prefix grows)."""
        ctx = self.project_context(target_hidden)
        if ctx_positions.shape != (ctx.shape[0],):
            raise ValueError(f"ctx_positions must be [{ctx.shape[0]}], got shape {tuple(ctx_positions.shape)}")
        cos, sin = self._rope(ctx_positions, ctx.dtype)
        return [layer.self_attn.key_value(ctx, cos, sin) for layer in self.layers]

    def block_tokens(self, bonus_tokens: Tensor) -> Tensor:
        """bonus_tokens [R] -> block_token_ids [R, gamma] = [bonus, MASK x (gamma - 1)]."""
        r = bonus_tokens.shape[0]
        out = torch.full(
            (r, self.config.block_size), self.config.mask_token_id, dtype=torch.long, device=bonus_tokens.device
        )
        out[:, 0] = bonus_tokens
        return out

    def _block_mask(self, req_ctx: Tensor, req_blk: Tensor, slot_blk: Tensor) -> Tensor:
        """[Q, C + Q] visibility: same request; within the block all slots, or earlier-or-same if causal."""
        see_ctx = req_blk[:, None] == req_ctx[None, :]
        see_blk = req_blk[:, None] == req_blk[None, :]
        if self.config.causal:
            see_blk = see_blk & (slot_blk[None, :] <= slot_blk[:, None])
        return torch.cat([see_ctx, see_blk], dim=1)

    # ------------------------------------------------------------------ forward
    def forward_batch_prenorm(
        self,
        ctx_kv: ContextKV,
        cu_ctx: Tensor,
        block_token_ids: Tensor,
        block_positions: Tensor,
        embed: nn.Module | Tensor,
    ) -> Tensor:
        """Residual stream before the final norm for R requests at once.

        Args:
            ctx_kv: from :meth:`context_kv` over all requests' context tokens, concatenated
                request after request ([C_total, ...]).
            cu_ctx: [R + 1] int64 prefix sums of the per-request context counts.
            block_token_ids, block_positions: [R, gamma] int64.
            embed: the target's input embedding (nn.Embedding or its [V, H] weight).
        Returns:
            [R, gamma, H] in the embedding dtype.
        """
        r, gamma = block_token_ids.shape
        if block_positions.shape != (r, gamma):
            raise ValueError(f"block_positions must be [{r}, {gamma}], got shape {tuple(block_positions.shape)}")
        if cu_ctx.shape != (r + 1,):
            raise ValueError(f"cu_ctx must be [{r + 1}], got shape {tuple(cu_ctx.shape)}")
        if len(ctx_kv) != len(self.layers):
            raise ValueError(f"ctx_kv has {len(ctx_kv)} layers, the drafter has {len(self.layers)}")
        n_ctx = ctx_kv[0][0].shape[0] if ctx_kv else 0
        if int(cu_ctx[-1]) != n_ctx or int(cu_ctx[0]) != 0:
            raise ValueError(f"cu_ctx must run from 0 to the {n_ctx} context tokens, got {cu_ctx.tolist()}")
        dev = block_token_ids.device
        req_ctx = torch.repeat_interleave(torch.arange(r, device=dev), cu_ctx.diff().to(dev))
        req_blk = torch.arange(r, device=dev).repeat_interleave(gamma)
        slot_blk = torch.arange(gamma, device=dev).repeat(r)
        mask = self._block_mask(req_ctx, req_blk, slot_blk)
        x = _embed(embed, block_token_ids.reshape(-1))
        cos, sin = self._rope(block_positions.reshape(-1), x.dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv, strict=True):
            x = layer(x, cos, sin, k, v, mask)
        return x.view(r, gamma, -1)

    def forward_batch(
        self,
        target_hidden: Tensor,
        ctx_positions: Tensor,
        cu_ctx: Tensor,
        block_token_ids: Tensor,
        block_positions: Tensor,
        embed: nn.Module | Tensor,
    ) -> Tensor:
        """Ragged batch: target_hidden [C_total, n_tapped * H_target], ctx_positions [C_total],
        cu_ctx [R + 1], block_token_ids / block_positions [R, gamma] -> normed hidden [R, gamma, H]."""
        kv = self.context_kv(target_hidden, ctx_positions)
        return self.norm(self.forward_batch_prenorm(kv, cu_ctx, block_token_ids, block_positions, embed))

    def forward_prenorm(
        self,
        target_hidden: Tensor,
        ctx_positions: Tensor,
        block_token_ids: Tensor,
        block_positions: Tensor,
        embed: nn.Module | Tensor,
    ) -> Tensor:
        """One request, before the final norm (the TreeFlash approximator corrects this): [gamma, H]."""
        kv = self.context_kv(target_hidden, ctx_positions)
        cu = torch.tensor([0, target_hidden.shape[0]], dtype=torch.long, device=block_token_ids.device)
        return self.forward_batch_prenorm(kv, cu, block_token_ids[None], block_positions[None], embed)[0]

    def forward(
        self,
        target_hidden: Tensor,
        ctx_positions: Tensor,
        block_token_ids: Tensor,
        block_positions: Tensor,
        embed: nn.Module | Tensor,
    ) -> Tensor:
        """One request.

        Args:
            target_hidden: [Tctx, n_tapped * H_target] tapped target hidden states of the context.
            ctx_positions: [Tctx] int64 positions of those tokens.
            block_token_ids: [gamma] int64 = [bonus, MASK x (gamma - 1)] (see :meth:`block_tokens`).
            block_positions: [gamma] int64 = P, P+1, ..., P+gamma-1 (P = the bonus position).
            embed: the target's input embedding (nn.Embedding or its [V, H] weight).
        Returns:
            [gamma, H] block hidden states after the final norm, in the embedding dtype.
        """
        return self.norm(self.forward_prenorm(target_hidden, ctx_positions, block_token_ids, block_positions, embed))

    # ------------------------------------------------------------------ files
    def save_pretrained(self, directory: str | Path) -> None:
        """Write config.json (z-lab layout) and model.safetensors (no embed/lm_head)."""
        raw = self.config.to_dict()
        dtype = next(self.parameters()).dtype
        raw["dtype"] = str(dtype).removeprefix("torch.")
        write_json(directory, DFLASH_CONFIG_NAME, raw)
        write_state(self, directory, DFLASH_WEIGHTS_NAME)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        target_config: object | None = None,
    ) -> DFlashDrafter:
        """Load a drafter directory (ours or a public z-lab one); dtype None keeps the stored dtype.

        With ``target_config`` the drafter is also checked against the target
        (:meth:`DFlashConfig.validate_against_target`).
        """
        raw = read_json(directory, DFLASH_CONFIG_NAME)
        config = DFlashConfig.from_dict(raw, str(Path(directory) / DFLASH_CONFIG_NAME))
        if target_config is not None:
            config.validate_against_target(target_config)
        with torch.device("meta"):
            model = cls(config)
        state = read_state(directory, DFLASH_WEIGHTS_NAME, model)
        model.load_state_dict(state, strict=True, assign=True)
        if dtype is not None or device is not None:
            model.to(device=device, dtype=dtype)
        return model

    def validate_against_target(self, target_config: object) -> None:
        self.config.validate_against_target(target_config)


def drafter_logits(drafter: DFlashDrafter, hidden: Tensor, lm_head: nn.Module | Tensor) -> Tensor:
    """:func:`marginal_logits` through the drafter's own ``logits_head`` when it has one, else the target's
    ``lm_head``. Only the marginals change: the Weaver and TreeFlash read the target's lm_head rows either way."""
    return marginal_logits(hidden, drafter.logits_head if drafter.logits_head is not None else lm_head)


def marginal_logits(hidden: Tensor, lm_head: nn.Module | Tensor) -> Tensor:
    """Per-depth DFlash marginal logits from the block output.

    Args:
        hidden: [..., gamma, H] normed block hidden states (:meth:`DFlashDrafter.forward`).
        lm_head: the target's lm_head (nn.Linear or its [V, H] weight).
    Returns:
        [..., gamma - 1, V]; row d - 1 holds the logits of the token at depth d = 1..gamma-1
        (block slot 0, the bonus token, is dropped).
    """
    h = hidden[..., 1:, :]
    if isinstance(lm_head, Tensor):
        return h @ as_weight(lm_head, "lm_head").T.to(h.dtype)
    return lm_head(h)
