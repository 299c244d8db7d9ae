"""TreeFlash AR approximator: a previous-token correction of the DFlash hidden state.

From TreeFlash (ETH-DISCO/TreeFlash; DESIGN.md section 10), written from its description:
for the DFlash residual stream h at depth d (before the DFlash final norm) and the token t at
depth d - 1 (the real bonus token at d = 1)::

    a  = [embed_norm(E_target[t]) ; final_norm(h)]          (2H)
    u, gate = up_gate(a).split(I)                            (u rows first, then gate)
    h' = h + down(u * silu(gate))                            (down zero-initialised)
    transition log-probs = log_softmax(lm_head(final_norm(h')) / T)

``final_norm`` is the DFlash drafter's own ``norm`` (shared, not stored here), so at init h' == h
and the transitions equal the DFlash marginals. Parameter names (``tfm/treeflash.safetensors``)::

    embed_norm.weight [H]   up_gate.weight [2I, 2H]   up_gate.bias [2I] (if in_bias)   down.weight [H, I]
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .common import RMSNorm, as_weight, compute_dtype
from .io import read_state, target_text_config, write_state
from .tfm_config import TFM_CONFIG_NAME, TREEFLASH_WEIGHTS_NAME, TfmConfig, TreeFlashConfig

__all__ = ["BatchedTreeFlashTransitionScorer", "TreeFlashApproximator", "TreeFlashTransitionScorer"]


class TreeFlashApproximator(nn.Module):
    def __init__(self, config: TreeFlashConfig) -> None:
        super().__init__()
        self.config = config
        h, i = config.hidden_size, config.intermediate_size
        self.embed_norm = RMSNorm(h, config.norm_eps)
        self.up_gate = nn.Linear(2 * h, 2 * i, bias=config.in_bias)
        self.down = nn.Linear(i, h, bias=False)
        nn.init.zeros_(self.down.weight)

    def correction(self, prev_embeds: Tensor, hidden_normed: Tensor) -> Tensor:
        """prev_embeds, hidden_normed [..., H] -> down(u * silu(gate)) [..., H]."""
        a = torch.cat([self.embed_norm(prev_embeds), hidden_normed], dim=-1)
        u, gate = self.up_gate(a).split(self.config.intermediate_size, dim=-1)
        return self.down(u * F.silu(gate))

    def forward(self, prev_embeds: Tensor, hidden: Tensor, final_norm: nn.Module) -> Tensor:
        """prev_embeds [..., H] (target embedding of the previous token), hidden [..., H] (DFlash
        residual stream before its final norm) -> corrected pre-norm hidden h' [..., H]."""
        return hidden + self.correction(prev_embeds, final_norm(hidden))

    # ------------------------------------------------------------------ files
    def save_pretrained(self, directory: str | Path) -> None:
        """Write tfm/treeflash.safetensors and set the ``treeflash`` section of tfm_config.json."""
        path = Path(directory)
        if (path / TFM_CONFIG_NAME).is_file():
            cfg = TfmConfig.load(path)
            cfg = TfmConfig.from_dict({**cfg.model_dump(mode="json"), "treeflash": self.config.model_dump(mode="json")})
        else:
            cfg = TfmConfig(proposal="treeflash", treeflash=self.config)
        cfg.save(path)
        write_state(self, path, TREEFLASH_WEIGHTS_NAME)

    @classmethod
    def from_pretrained(
        cls,
        directory: str | Path,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
        target_config: object | None = None,
    ) -> TreeFlashApproximator:
        cfg = TfmConfig.load(directory)
        if cfg.treeflash is None:
            raise ValueError(f"{Path(directory) / TFM_CONFIG_NAME}: no 'treeflash' section")
        if target_config is not None:
            _check_width(cfg.treeflash.hidden_size, target_config)
        with torch.device("meta"):
            model = cls(cfg.treeflash)
        model.load_state_dict(read_state(directory, TREEFLASH_WEIGHTS_NAME, model), strict=True, assign=True)
        if dtype is not None or device is not None:
            model.to(device=device, dtype=dtype)
        return model

    def validate_against_target(self, target_config: object) -> None:
        _check_width(self.config.hidden_size, target_config)


def _check_width(width: int, target_config: object) -> None:
    t = target_text_config(target_config)
    if width != t.hidden_size:
        raise ValueError(f"TreeFlash hidden_size {width} does not match the target's hidden_size {t.hidden_size}")


def _head(lm_head: nn.Module | Tensor, h: Tensor) -> Tensor:
    if isinstance(lm_head, Tensor):
        return h @ as_weight(lm_head, "lm_head").T.to(h.dtype)
    return lm_head(h)


class TreeFlashTransitionScorer:
    """``transition_scorer(depth, prev_tokens [M]) -> [M, V]`` for the TreeFlash tree builder.

    Args:
        approximator: the AR approximator.
        final_norm: the DFlash drafter's final norm (``drafter.norm``).
        block_hidden_prenorm: [gamma, H] DFlash residual stream of one block
            (:meth:`DFlashDrafter.forward_prenorm`); slot d is depth d.
        embed, lm_head: the target's input embedding and lm_head (modules or [V, H] weights).
        temperature: divides the logits (1.0 = the model's distribution).
    Returns of a call: log-probabilities of the token at ``depth`` (1..gamma-1) given each
    previous token, float32 (float64 for float64 models). Inference only (``torch.no_grad``).
    """

    def __init__(
        self,
        approximator: TreeFlashApproximator,
        final_norm: nn.Module,
        block_hidden_prenorm: Tensor,
        embed: nn.Module | Tensor,
        lm_head: nn.Module | Tensor,
        temperature: float = 1.0,
    ) -> None:
        if block_hidden_prenorm.dim() != 2 or block_hidden_prenorm.shape[0] < 2:
            raise ValueError(
                f"block_hidden_prenorm must be [gamma >= 2, H], got shape {tuple(block_hidden_prenorm.shape)}"
            )
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.approximator = approximator
        self.final_norm = final_norm
        self.hidden = block_hidden_prenorm
        self.embed = embed
        self.lm_head = lm_head
        self.temperature = float(temperature)

    @property
    def max_depth(self) -> int:
        return self.hidden.shape[0] - 1

    def __call__(self, depth: int, prev_tokens: Tensor) -> Tensor:
        if not 1 <= depth <= self.max_depth:
            raise ValueError(f"depth must be in 1..{self.max_depth}, got {depth}")
        if prev_tokens.dim() != 1:
            raise ValueError(f"prev_tokens must be [M], got shape {tuple(prev_tokens.shape)}")
        with torch.no_grad():
            ids = prev_tokens.to(self.hidden.device)
            e = self.embed[ids] if isinstance(self.embed, Tensor) else self.embed(ids)
            h = self.hidden[depth].expand(ids.shape[0], -1)
            h2 = self.approximator(e.to(h.dtype), h, self.final_norm)
            logits = _head(self.lm_head, self.final_norm(h2))
            return torch.log_softmax(logits.to(compute_dtype(logits.dtype)) / self.temperature, dim=-1)


class BatchedTreeFlashTransitionScorer(TreeFlashTransitionScorer):
    """``transition_scorer(depth, prev_tokens [R, M]) -> [R, M, V]`` for R blocks at once
    (``vllm_tfm.tree.build_treeflash_padded``); row r is ``TreeFlashTransitionScorer`` of block r.

    Args: as ``TreeFlashTransitionScorer`` but ``block_hidden_prenorm`` is [R, gamma, H].
    """

    def __init__(
        self,
        approximator: TreeFlashApproximator,
        final_norm: nn.Module,
        block_hidden_prenorm: Tensor,
        embed: nn.Module | Tensor,
        lm_head: nn.Module | Tensor,
        temperature: float = 1.0,
    ) -> None:
        if block_hidden_prenorm.dim() != 3 or block_hidden_prenorm.shape[1] < 2:
            raise ValueError(
                f"block_hidden_prenorm must be [R, gamma >= 2, H], got shape {tuple(block_hidden_prenorm.shape)}"
            )
        super().__init__(approximator, final_norm, block_hidden_prenorm[0], embed, lm_head, temperature)
        self.hidden = block_hidden_prenorm

    @property
    def max_depth(self) -> int:
        return self.hidden.shape[1] - 1

    def __call__(self, depth: int, prev_tokens: Tensor) -> Tensor:
        if not 1 <= depth <= self.max_depth:
            raise ValueError(f"depth must be in 1..{self.max_depth}, got {depth}")
        r = self.hidden.shape[0]
        if prev_tokens.dim() != 2 or prev_tokens.shape[0] != r:
            raise ValueError(f"prev_tokens must be [R={r}, M], got shape {tuple(prev_tokens.shape)}")
        with torch.no_grad():
            ids = prev_tokens.to(self.hidden.device)
            e = self.embed[ids] if isinstance(self.embed, Tensor) else self.embed(ids)  # [R, M, H]
            h = self.hidden[:, depth, None, :].expand(-1, ids.shape[1], -1)
            h2 = self.approximator(e.to(h.dtype), h, self.final_norm)
            logits = _head(self.lm_head, self.final_norm(h2))
            return torch.log_softmax(logits.to(compute_dtype(logits.dtype)) / self.temperature, dim=-1)
