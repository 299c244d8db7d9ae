"""The short causal depthwise conv1d of GDN layers, on a token tree: torch reference.

vLLM 0.26 (``causal_conv1d_update``) keeps, per slot, a conv state ``[D, L]`` (L >= W-1) whose
columns ``s .. s+W-2`` hold the last W-1 committed inputs, oldest first (s is the offset
``num_accepted_tokens - 1`` in spec decoding, 0 otherwise), and computes for a chain
``y_t = act(bias + sum_w weight[:, w] * [state | x][t + w])``: ``weight[:, W-1]`` multiplies the
newest input. On a tree, node i's window is itself, its parent, grandparent, ... and then the
committed columns, most recent first; verify writes no state, and commit keeps the last W-1 inputs
of ``[committed window | x along the accepted path]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from vllm_tfm.tree.types import depths_from_parents
from vllm_tfm.verify.ragged_trees import (
    check_per_request,
    check_slot_indices,
    local_ancestor_table,
    path_to_root,
    request_bounds,
)

__all__ = ["tree_causal_conv1d", "tree_conv_commit", "tree_conv_commit_layers"]


def _math_dtype(*tensors: Tensor | None) -> torch.dtype:
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def _check_window(starts: list[int], width: int, state_len: int, name: str) -> None:
    for r, s in enumerate(starts):
        if s < 0 or s + width - 1 > state_len:
            raise ValueError(
                f"{name}[{r}] = {s}: the committed window (columns {s}..{s + width - 2}) "
                f"does not fit in a conv state of {state_len} columns"
            )


def tree_causal_conv1d(
    x: Tensor,
    parents: Tensor,
    cu_nodes: Tensor,
    conv_state: Tensor,
    state_indices: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    activation: str | None = "silu",
    window_start: Tensor | None = None,
) -> Tensor:
    """Depthwise causal conv over every node's root..node path; conv_state is not written.

    x: [T, D] pre-conv inputs; parents: [T] local (-1 at roots); cu_nodes: [R+1];
    conv_state: [num_slots, D, L] with L >= W-1; state_indices: [R] slot of each request;
    weight: [D, W]; bias: [D] or None; activation: "silu" or None;
    window_start: [R] first committed column s of each request (default 0).

    Node i's window, most recent first: x_i, x_parent, x_grandparent, ..., then the committed
    columns s+W-2, ..., s; y_i = act(bias + sum_w weight[:, w] * window[W-1-w]).
    Math in float32 (float64 when any input is float64); returns [T, D] in x.dtype.
    """
    if activation not in ("silu", None):
        raise ValueError(f"activation must be 'silu' or None, got {activation!r}")
    if x.dim() != 2:
        raise ValueError(f"x must have shape [T, D], got {tuple(x.shape)}")
    tokens, dim = x.shape
    if weight.dim() != 2 or weight.shape[0] != dim or weight.shape[1] < 1:
        raise ValueError(f"weight must have shape [D={dim}, W], got {tuple(weight.shape)}")
    width = weight.shape[1]
    if bias is not None and bias.shape != (dim,):
        raise ValueError(f"bias must have shape [D={dim}], got {tuple(bias.shape)}")
    if conv_state.dim() != 3 or conv_state.shape[1] != dim or conv_state.shape[2] < width - 1:
        raise ValueError(
            f"conv_state must have shape [num_slots, D={dim}, L >= {width - 1}], got {tuple(conv_state.shape)}"
        )
    bounds = request_bounds(parents, cu_nodes, tokens)
    slots = check_slot_indices(state_indices, len(bounds), conv_state.shape[0], "state_indices")
    starts = check_per_request(window_start, len(bounds), "window_start")
    _check_window(starts, width, conv_state.shape[2], "window_start")

    dtype = _math_dtype(x, conv_state, weight, bias)
    xe = x.to(dtype)
    w_newest_first = weight.to(dtype).flip(-1)  # [D, W]: column m multiplies window[m]
    out = torch.empty(tokens, dim, dtype=dtype, device=x.device)
    for (s, e), slot, ws in zip(bounds, slots, starts):
        par = parents[s:e].to("cpu", torch.long)
        committed = conv_state[slot, :, ws : ws + width - 1].to(dtype).transpose(0, 1)  # [W-1, D], oldest first
        ext = torch.cat([committed, xe[s:e]])  # rows 0..W-2 committed, row W-1+i = node i
        anc = local_ancestor_table(par, width)  # [n, W], m-th ancestor or -1
        depth = depths_from_parents(par)[:, None]  # [n, 1]
        m = torch.arange(width)[None, :]
        # window[m] is the m-th ancestor while m <= depth, else committed column (W-2) - (m - depth - 1)
        pos = torch.where(m <= depth, width - 1 + anc, width - 1 - m + depth).to(x.device)
        window = ext[pos]  # [n, W, D]
        out[s:e] = torch.einsum("nwd,dw->nd", window, w_newest_first)
    if bias is not None:
        out = out + bias.to(dtype)
    if activation == "silu":
        out = F.silu(out)
    return out.to(x.dtype)


def tree_conv_commit(
    x: Tensor,
    parents: Tensor,
    cu_nodes: Tensor,
    accepted: Tensor,
    conv_state: Tensor,
    src_indices: Tensor,
    dst_indices: Tensor,
    width: int,
    src_start: Tensor | None = None,
    dst_start: Tensor | None = None,
) -> None:
    """Advance each request's conv window along its accepted root..a path, in place.

    x: [T, D]; parents: [T] local; cu_nodes: [R+1]; accepted: [R] local index of the deepest
    accepted node (0 = only the root); conv_state: [num_slots, D, L]; src_indices, dst_indices: [R]
    slots (dst distinct); width: W, the conv kernel width; src_start, dst_start: [R] column offsets
    (default 0).

    Writes conv_state[dst[r], :, d : d+W-1] = the last W-1 inputs of
    [conv_state[src[r], :, s : s+W-1] | x along root..a], oldest first, cast to conv_state.dtype.
    Everything is read before anything is written, so slots may alias within and across requests.
    """
    if x.dim() != 2:
        raise ValueError(f"x must have shape [T, D], got {tuple(x.shape)}")
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    tokens, dim = x.shape
    if conv_state.dim() != 3 or conv_state.shape[1] != dim or conv_state.shape[2] < width - 1:
        raise ValueError(
            f"conv_state must have shape [num_slots, D={dim}, L >= {width - 1}], got {tuple(conv_state.shape)}"
        )
    bounds = request_bounds(parents, cu_nodes, tokens)
    nreq = len(bounds)
    src = check_slot_indices(src_indices, nreq, conv_state.shape[0], "src_indices")
    dst = check_slot_indices(dst_indices, nreq, conv_state.shape[0], "dst_indices", distinct=True)
    acc = check_per_request(accepted, nreq, "accepted")
    s_starts = check_per_request(src_start, nreq, "src_start")
    d_starts = check_per_request(dst_start, nreq, "dst_start")
    _check_window(s_starts, width, conv_state.shape[2], "src_start")
    _check_window(d_starts, width, conv_state.shape[2], "dst_start")
    for r, ((s, e), a) in enumerate(zip(bounds, acc)):
        if not 0 <= a < e - s:
            raise ValueError(f"accepted[{r}] = {a} is not a node of request {r} (it has {e - s} nodes)")

    keep = width - 1
    new_windows = []
    for (s, e), a, slot, ss in zip(bounds, acc, src, s_starts):
        path = torch.tensor(path_to_root(parents[s:e].tolist(), a), dtype=torch.long, device=x.device) + s
        seq = torch.cat([conv_state[slot, :, ss : ss + keep], x[path].to(conv_state.dtype).transpose(0, 1)], dim=1)
        new_windows.append(seq[:, seq.shape[1] - keep :].clone())  # [D, W-1], oldest first
    for window, slot, ds in zip(new_windows, dst, d_starts):
        conv_state[slot, :, ds : ds + keep] = window


def tree_conv_commit_layers(
    x: Sequence[Tensor],
    parents: Tensor,
    cu_nodes: Tensor,
    accepted: Tensor,
    conv_state: Sequence[Tensor],
    src_indices: Sequence[Tensor],
    dst_indices: Sequence[Tensor],
    width: int,
    src_start: Sequence[Tensor | None] | None = None,
    dst_start: Sequence[Tensor | None] | None = None,
) -> None:
    """:func:`tree_conv_commit` of several layers that share one tree batch, accepted nodes and width.

    Entry ``i`` of each sequence is layer i's argument of :func:`tree_conv_commit`; src_start /
    dst_start None: 0 for every layer. The layers are committed one after the other; a batched
    implementation may run them at once, which gives the same windows when no layer's destination
    columns are another layer's source columns in memory.
    """
    n = len(x)
    s_starts = [None] * n if src_start is None else list(src_start)
    d_starts = [None] * n if dst_start is None else list(dst_start)
    if not (len(conv_state) == len(src_indices) == len(dst_indices) == len(s_starts) == len(d_starts) == n):
        raise ValueError(
            "x, conv_state, src_indices, dst_indices (and src_start, dst_start when given) must have one entry "
            f"per layer, got {[len(x), len(conv_state), len(src_indices), len(dst_indices), len(s_starts), len(d_starts)]}"
        )
    for i in range(n):
        tree_conv_commit(x[i], parents, cu_nodes, accepted, conv_state[i], src_indices[i], dst_indices[i], width,
                         s_starts[i], d_starts[i])
