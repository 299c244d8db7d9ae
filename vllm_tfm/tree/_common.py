"""Argument checks and small helpers shared by the tree builders (chain, ddtree, weaver, treeflash).

Conventions shared by every builder:

* Log-probabilities are checked once: a floating tensor, no NaN, no entry above 0. An entry of
  ``-inf`` (probability zero under the proposal) is never drafted.
* Ranking is a *stable* descending sort: among equal log-probabilities the lower index (token id,
  or candidate column for Weaver) ranks first. Builders that break ties between equal path scores
  do so by the lexicographic order of the rank path (the ranks of the tokens on root..node), which
  puts a parent before its children and a better-ranked sibling before a worse one.
* Path scores are accumulated in Python floats (IEEE double) as ``score(parent) + logq(node)``;
  the returned ``scores`` / ``draft_logprobs`` have dtype float32, or float64 when the input
  log-probabilities are float64.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch
from torch import Tensor

from .types import Tree


def check_positive_int(value: object, name: str) -> int:
    """``value`` as an int >= 1, else ValueError naming ``name``."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    try:
        v = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}") from None
    if v < 1:
        raise ValueError(f"{name} must be >= 1, got {v}")
    return v


def check_root_token(root_token: int | Tensor) -> int:
    """The root (last committed) token id as a non-negative int."""
    if isinstance(root_token, Tensor):
        if root_token.numel() != 1 or root_token.is_floating_point():
            raise ValueError(f"root_token must be one integer token id, got a tensor of shape {tuple(root_token.shape)}")
        root_token = int(root_token.item())
    if isinstance(root_token, bool):
        raise ValueError(f"root_token must be an integer token id, got {root_token!r}")
    try:
        t = operator.index(root_token)
    except TypeError:
        raise ValueError(f"root_token must be an integer token id, got {root_token!r}") from None
    if t < 0:
        raise ValueError(f"root_token must be >= 0, got {t}")
    return t


def check_logprobs(x: object, name: str, shape_desc: str, dim: int) -> Tensor:
    """Check a tensor of log-probabilities: ``dim`` dims, floating, no NaN, nothing above 0."""
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor {shape_desc}, got {type(x).__name__}")
    if x.dim() != dim:
        raise ValueError(f"{name} must have shape {shape_desc}, got shape {tuple(x.shape)}")
    if any(s == 0 for s in x.shape):
        raise ValueError(f"{name} must not be empty, got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating tensor of log-probabilities, got dtype {x.dtype}")
    if not bool((x <= 0).all()):  # one pass catches NaN and positive entries
        if bool(torch.isnan(x).any()):
            raise ValueError(f"{name} contains NaN")
        raise ValueError(f"{name} must be log-probabilities (<= 0), got max {float(x.max())}")
    return x


def check_depth_rows(rows: int, max_depth: int, name: str) -> None:
    if rows < max_depth:
        raise ValueError(f"{name} has {rows} depth rows but max_depth is {max_depth}")


def out_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64, every other floating dtype gives float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def ranked_rows(mat: Tensor, limit: int, drop_neg_inf: bool = True) -> list[tuple[list[int], list[float]]]:
    """The best ``limit`` entries of every row of a [R, N] matrix of log-probabilities, best first.

    Order: stable descending (ties: lower column first). With ``drop_neg_inf`` entries equal to
    ``-inf`` are dropped. Returns per row (columns, values) as Python lists; the values are exact
    (float32/float64 inputs convert to double without rounding).
    """
    mat = mat.detach().to("cpu", torch.float64)
    n = mat.shape[1]
    limit = min(limit, n)
    if 4 * limit >= n:
        vals, idx = torch.sort(mat, dim=1, descending=True, stable=True)
        rows = [(i[:limit], v[:limit]) for i, v in zip(idx, vals)]
    else:
        # topk does not promise an order among equal values: take every entry >= the limit-th
        # best value (ties at the boundary included), then sort those few stably.
        kth = mat.topk(limit, dim=1).values[:, -1:]
        r_idx, c_idx = (mat >= kth).nonzero().unbind(1)  # row-major, columns ascending
        vals = mat[r_idx, c_idx]
        order = torch.sort(vals, descending=True, stable=True).indices
        r_idx, c_idx, vals = r_idx[order], c_idx[order], vals[order]
        order = torch.sort(r_idx, stable=True).indices  # regroup by row, keeping value/column order
        c_idx, vals = c_idx[order], vals[order]
        counts = torch.bincount(r_idx, minlength=mat.shape[0]).tolist()
        rows = [(c[:limit], v[:limit]) for c, v in zip(c_idx.split(counts), vals.split(counts))]
    out = []
    for i, v in rows:
        if drop_neg_inf:
            keep = v > float("-inf")
            i, v = i[keep], v[keep]
        out.append((i.tolist(), v.tolist()))
    return out


def make_tree(
    tokens: list[int],
    parents: list[int],
    scores: list[float],
    draft_logprobs: list[float],
    dtype: torch.dtype,
    device: torch.device,
) -> Tree:
    """A Tree (root first, topological) with scores and draft log-probs on ``device``."""
    tree = Tree.from_parents(
        torch.tensor(tokens, dtype=torch.long),
        torch.tensor(parents, dtype=torch.long),
        torch.tensor(scores, dtype=dtype),
        torch.tensor(draft_logprobs, dtype=dtype),
    )
    return tree.to(device) if torch.device(device).type != "cpu" else tree


def per_request(value: int | Sequence[int], num_requests: int, name: str) -> list[int]:
    """Broadcast an int (or check a per-request sequence) to ``num_requests`` ints >= 1."""
    if isinstance(value, Sequence) or (isinstance(value, Tensor) and value.dim() == 1):
        vals = list(value.tolist() if isinstance(value, Tensor) else value)
        if len(vals) != num_requests:
            raise ValueError(f"{name} has {len(vals)} entries for {num_requests} requests")
        return [check_positive_int(v, f"{name}[{i}]") for i, v in enumerate(vals)]
    return [check_positive_int(value, name)] * num_requests


def check_root_tokens(root_tokens: Tensor | Sequence[int], num_requests: int) -> list[int]:
    """One root token per request."""
    toks = root_tokens.tolist() if isinstance(root_tokens, Tensor) else list(root_tokens)
    if isinstance(root_tokens, Tensor) and root_tokens.dim() != 1:
        raise ValueError(f"root_tokens must have shape [R], got shape {tuple(root_tokens.shape)}")
    if len(toks) != num_requests:
        raise ValueError(f"root_tokens has {len(toks)} entries for {num_requests} requests")
    return [check_root_token(t) for t in toks]


def batch_size(x: object, name: str, shape_desc: str, dim: int) -> int:
    """R, the leading size of a batched input of ``dim`` dims (ValueError if the rank is wrong)."""
    if not isinstance(x, Tensor) or x.dim() != dim:
        got = f"shape {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{name} must have shape {shape_desc}, got {got}")
    if x.shape[0] == 0:
        raise ValueError(f"{name} must hold at least one request, got shape {tuple(x.shape)}")
    return int(x.shape[0])
