"""A frequency-ranked draft vocabulary: the DFlash marginals over the target's N most frequent tokens.

The drafter's marginal logits are one GEMM against the target's lm_head, ``V x H`` (248,320 x 5,120 at the
Qwen3.6-27B shape: the largest read of a drafting step). FR-Spec (Zhao et al., "FR-Spec: Accelerating
Large-Vocabulary Language Models via Frequency-Ranked Speculative Sampling", ACL 2025, arXiv:2502.14856)
computes the draft head over the tokens most frequent in a corpus only. Here the logits of the other tokens are
-inf, so every consumer of the marginals (top-K candidates, chains, DDTree, TreeFlash) sees a full-vocabulary
row and simply never drafts those tokens. The target verifies with its full lm_head: outputs are unchanged, only
acceptance can drop (a token outside the subset is never proposed).

Files (``vllm-tfm draft-vocab`` writes them from a corpus and a tokenizer): JSON
``{"format": "vllm-tfm-draft-vocab/1", "vocab_size": V, "token_ids": [most frequent first, ...], "counts": [...],
"tokenizer": ..., "source": ...}``; a draft vocabulary of size N is the first N ``token_ids``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .common import as_weight

__all__ = [
    "DRAFT_VOCAB_FORMAT",
    "DraftVocabHead",
    "count_token_ids",
    "expand_subset_logits",
    "load_draft_vocab",
    "ranked_token_ids",
    "subset_logits_reference",
    "write_draft_vocab",
]

DRAFT_VOCAB_FORMAT = "vllm-tfm-draft-vocab/1"


def count_token_ids(id_lists: Iterable[Iterable[int]], vocab_size: int) -> np.ndarray:
    """How often each token id 0..vocab_size-1 occurs in ``id_lists`` (int64 [vocab_size]); an id outside
    the range is a ValueError."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for ids in id_lists:
        arr = np.asarray(list(ids), dtype=np.int64)
        if arr.size == 0:
            continue
        if arr.min() < 0 or arr.max() >= vocab_size:
            bad = int(arr[(arr < 0) | (arr >= vocab_size)][0])
            raise ValueError(f"token id {bad} outside the vocabulary 0..{vocab_size - 1}")
        counts += np.bincount(arr, minlength=vocab_size)
    return counts


def ranked_token_ids(counts: np.ndarray) -> np.ndarray:
    """Every token id by count, most frequent first; equal counts in id order (a stable, seed-free ranking)."""
    return np.lexsort((np.arange(counts.shape[0]), -counts.astype(np.int64)))


def write_draft_vocab(path: str | Path, counts: np.ndarray, tokenizer: str, source: str) -> dict[str, Any]:
    """The ranked vocabulary of ``counts`` as a draft-vocabulary file (module docstring); returns its content."""
    ranked = ranked_token_ids(counts)
    data = {"format": DRAFT_VOCAB_FORMAT, "vocab_size": int(counts.shape[0]), "token_ids": ranked.tolist(),
            "counts": counts[ranked].tolist(), "tokens_counted": int(counts.sum()), "tokenizer": tokenizer,
            "source": source}
    Path(path).write_text(json.dumps(data) + "\n")
    return data


def load_draft_vocab(path: str | Path, size: int | None, vocab_size: int) -> Tensor:
    """The first ``size`` token ids of a draft-vocabulary file (None: all of them), ascending, int64 on the CPU.
    A one-line ValueError for a missing or malformed file, repeated or out-of-range ids, a file made for another
    vocabulary size, or a size it does not hold."""
    p = Path(path)
    where = f"draft vocabulary {p}"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ValueError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{where}: cannot read JSON ({e})") from None
    if not isinstance(data, dict) or data.get("format") != DRAFT_VOCAB_FORMAT:
        raise ValueError(f"{where}: not a {DRAFT_VOCAB_FORMAT} file (make one with `vllm-tfm draft-vocab`)")
    ids = data.get("token_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"{where}: token_ids must be a non-empty list of integers")
    if data.get("vocab_size") != vocab_size:
        raise ValueError(f"{where}: made for a vocabulary of {data.get('vocab_size')} tokens, the model has {vocab_size}")
    if size is not None and not 1 <= size <= len(ids):
        raise ValueError(f"{where}: holds {len(ids)} token ids, cannot take the first {size}")
    chosen = torch.tensor(ids[: size if size is not None else len(ids)], dtype=torch.long)
    if int(chosen.min()) < 0 or int(chosen.max()) >= vocab_size:
        raise ValueError(f"{where}: token ids must be in 0..{vocab_size - 1}")
    chosen = chosen.sort().values
    if bool((chosen[1:] == chosen[:-1]).any()):
        raise ValueError(f"{where}: a token id is listed twice")
    return chosen


def expand_subset_logits(sub: Tensor, token_ids: Tensor, vocab_size: int) -> Tensor:
    """Logits of the draft vocabulary [..., N] -> full-vocabulary rows [..., V]: ``sub`` at ``token_ids`` [N],
    -inf at every other token (what every consumer of the marginals reads)."""
    out = sub.new_full((*sub.shape[:-1], vocab_size), float("-inf"))
    return out.index_copy_(out.dim() - 1, token_ids, sub)


def subset_logits_reference(hidden: Tensor, weight: Tensor, token_ids: Tensor, vocab_size: int) -> Tensor:
    """hidden [..., H], weight [V, H] (the full lm_head), token_ids [N] -> [..., V]: ``hidden @ weight.T`` at
    ``token_ids``, -inf elsewhere. The oracle of ``DraftVocabHead`` and the runtime's head."""
    return expand_subset_logits(hidden @ weight[token_ids].T.to(hidden.dtype), token_ids, vocab_size)


class DraftVocabHead(nn.Module):
    """The drafter's marginal logits over a draft vocabulary (``DFlashDrafter.logits_head``): the lm_head's rows
    at ``token_ids`` copied once, logits -inf at every other token.

    ``subset_head`` builds the head over those rows (default: a plain product in the input's dtype; e.g.
    ``reference.fp8_sim.Fp8SimHead`` for the FP8 copy the vLLM option ``draft_lm_head: "fp8"`` reads)."""

    def __init__(self, lm_head: nn.Module | Tensor, token_ids: Tensor,
                 subset_head: Callable[[Tensor], nn.Module] | None = None) -> None:
        super().__init__()
        w = as_weight(lm_head, "lm_head").detach()
        ids = token_ids.to(device=w.device, dtype=torch.long)
        self.vocab_size = int(w.shape[0])
        if ids.dim() != 1 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
            raise ValueError(f"token_ids must be a non-empty [N] tensor of ids in 0..{self.vocab_size - 1}")
        self.register_buffer("token_ids", ids, persistent=False)
        rows = w[ids].contiguous()
        self.subset = subset_head(rows) if subset_head is not None else None
        if self.subset is None:
            self.register_buffer("rows", rows, persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        sub = self.subset(x) if self.subset is not None else F.linear(x, self.rows.to(x.dtype))
        return expand_subset_logits(sub, self.token_ids, self.vocab_size)
