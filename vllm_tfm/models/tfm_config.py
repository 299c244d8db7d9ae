"""``tfm_config.json``: the proposal settings and the Weaver / TreeFlash configs of a drafter dir.

A drafter directory (DESIGN.md section 8) holds::

    config.json            DFlash drafter, z-lab layout (Qwen3 config + dflash_config)
    model.safetensors      DFlash weights (z-lab names; embed/lm_head shared with the target)
    tfm_config.json        this schema
    tfm/weaver.safetensors     Weaver weights (when tfm_config.weaver is set)
    tfm/treeflash.safetensors  TreeFlash AR-approximator weights (when tfm_config.treeflash is set)

Unknown fields are refused (a typo must not silently fall back to a default). Loading errors are
one-line ValueErrors naming the file and the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

__all__ = [
    "TFM_CONFIG_NAME",
    "WEAVER_WEIGHTS_NAME",
    "TREEFLASH_WEIGHTS_NAME",
    "WeaverConfig",
    "TreeFlashConfig",
    "TfmConfig",
]

TFM_CONFIG_NAME = "tfm_config.json"
# In a subfolder on purpose: vLLM's weight loader reads every top-level *.safetensors of the drafter
# directory into its DFlash model, and would reject Weaver / TreeFlash tensors found there.
WEAVER_WEIGHTS_NAME = "tfm/weaver.safetensors"
TREEFLASH_WEIGHTS_NAME = "tfm/treeflash.safetensors"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class WeaverConfig(_Strict):
    """Shape of the Weaver (DESIGN.md section 10).

    ``d_model`` is the target's hidden size (the verifier hidden, the DFlash hidden, the target
    embedding and lm_head rows all have this width). Defaults are the 56.7M-parameter shape
    inferred for Qwen3.6-27B (d_model 5120): d_rank 1024, 3 layers, 8 heads of 128, MLP 3072.
    """

    d_model: int = Field(gt=0)
    d_rank: int = Field(default=1024, gt=0)
    n_layers: int = Field(default=3, gt=0)
    n_heads: int = Field(default=8, gt=0)
    d_mlp: int = Field(default=3072, gt=0)
    max_depth: int = Field(default=15, gt=0, description="deepest draft depth D = DFlash block size - 1")
    rope_theta: float = Field(default=10000.0, gt=0)
    norm_eps: float = Field(default=1e-6, gt=0)

    @model_validator(mode="after")
    def _heads_divide(self) -> WeaverConfig:
        if self.d_rank % self.n_heads:
            raise ValueError(f"d_rank {self.d_rank} is not a multiple of n_heads {self.n_heads}")
        if (self.d_rank // self.n_heads) % 2:
            raise ValueError(f"head dim d_rank / n_heads = {self.d_rank // self.n_heads} must be even for RoPE")
        return self

    @property
    def head_dim(self) -> int:
        return self.d_rank // self.n_heads


class TreeFlashConfig(_Strict):
    """Shape of the TreeFlash AR approximator: h' = h + down(u * silu(gate)) (DESIGN.md section 10)."""

    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    norm_eps: float = Field(default=1e-6, gt=0)
    in_bias: bool = Field(default=True, description="bias of the fused [u; gate] input projection")


class TfmConfig(_Strict):
    """Proposal settings of a drafter directory plus the configs of its optional models."""

    proposal: Literal["tfm", "ddtree", "treeflash", "chain"] = "tfm"
    budget: int = Field(default=64, gt=0, description="default draft nodes per tree B (root excluded)")
    width: int | None = Field(default=None, gt=0, description="Weaver nodes expanded per call w; None = default_weaver_width(B) (2 at B = 16, 4 at B = 32 and 64)")
    top_k: int = Field(default=512, gt=0, description="DFlash candidates kept per depth K (the Weaver pool)")
    children_per_node: int = Field(default=8, gt=0, description="children an expanded node publishes to the frontier")
    treeflash_top_m: int = Field(default=16, gt=0, description="TreeFlash stage-1 previous-token candidates per depth")
    sampling: Literal["target_only", "traversal"] = "target_only"
    gdn_state_slots: Literal["auto", "per_draft", "one"] = Field(
        default="auto",
        description="GDN state slots a request holds in vLLM's cache (hybrid targets): 'per_draft' = vLLM's 1 + B, "
                    "'one' = a single slot the commit rewrites in place (vllm_plugin/runtime/one_slot.py), "
                    "'auto' = 'one' on one GPU, 'per_draft' with tensor or data parallelism",
    )
    draft_lm_head: Literal["model", "fp8"] = Field(
        default="model",
        description="the DFlash drafter's logits: 'model' = vLLM's compute_logits over the lm_head it shares with the "
                    "target, 'fp8' = an FP8 copy of that lm_head with per-row scales (half the bytes; one GPU, compute "
                    "capability >= 8.9, vllm_plugin/runtime/draft_head.py); the target still verifies with its own",
    )
    weaver_weights: Literal["model", "fp8"] = Field(
        default="model",
        description="the Weaver's projections in the tree build: 'model' = its stored weights, 'fp8' = rounded to e4m3 "
                    "with one scale per output row after its norms are folded in (weight-only FP8: the fused kernel "
                    "reads half the bytes; models/weaver_step.py); the target still verifies with its own weights",
    )
    draft_vocab: str | None = Field(
        default=None, min_length=1,
        description="a draft-vocabulary file (`vllm-tfm draft-vocab`; a relative path is in the drafter directory): "
                    "the DFlash marginals over its first draft_vocab_size tokens only, -inf at the others (FR-Spec, "
                    "models/draft_vocab.py); the target still verifies with its full vocabulary",
    )
    draft_vocab_size: int | None = Field(default=None, gt=0,
                                         description="how many of draft_vocab's most frequent tokens (None: all)")
    weaver: WeaverConfig | None = None
    treeflash: TreeFlashConfig | None = None

    @model_validator(mode="after")
    def _draft_vocab_fits(self) -> TfmConfig:
        if self.draft_vocab_size is not None and self.draft_vocab is None:
            raise ValueError("draft_vocab_size needs draft_vocab, the file it counts from")
        if self.draft_vocab_size is not None and self.draft_vocab_size < self.top_k:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} is smaller than top_k {self.top_k}, the "
                             "candidates kept per depth")
        return self

    @model_validator(mode="after")
    def _models_present(self) -> TfmConfig:
        if self.proposal == "tfm" and self.weaver is None:
            raise ValueError("proposal 'tfm' needs a 'weaver' section")
        if self.proposal == "treeflash" and self.treeflash is None:
            raise ValueError("proposal 'treeflash' needs a 'treeflash' section")
        return self

    # ------------------------------------------------------------------ files
    @classmethod
    def from_dict(cls, data: object, source: str = TFM_CONFIG_NAME) -> TfmConfig:
        """Validate a parsed JSON object; errors are one line: ``<source>: <field>: <problem>``."""
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(p) for p in err["loc"]) or "<root>"
            msg = err["msg"].removeprefix("Value error, ")
            more = f" (and {e.error_count() - 1} more)" if e.error_count() > 1 else ""
            raise ValueError(f"{source}: {loc}: {msg}{more}") from None

    @classmethod
    def load(cls, directory: str | Path) -> TfmConfig:
        path = Path(directory) / TFM_CONFIG_NAME
        if not path.is_file():
            raise ValueError(f"{directory}: missing {TFM_CONFIG_NAME}")
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        return cls.from_dict(data, str(path))

    def save(self, directory: str | Path) -> Path:
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        out = path / TFM_CONFIG_NAME
        out.write_text(json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=False) + "\n")
        return out
