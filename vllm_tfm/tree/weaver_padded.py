"""Weaver (DySpec-w) tree growth for R requests in lockstep on the device.

The same trees as ``vllm_tfm.tree.build_weaver`` run once per request (same tokens, parents,
node order, scores, draft log-probabilities; tested against it), with all requests' state in
padded tensors and no per-request Python:

* a frontier of fixed slots [R, (2 + B) * c] (c = min(children_per_node, K)): slot ``j * c + r``
  holds the rank-r child that node j published when it was expanded (token, depth, rank-path
  code with ``DEAD_BIT`` in word 0 unless alive, path score, log q); the c slots of node 1 + B
  are a write-only trash area; ``node_slot`` [R, 2 + B] records which slot became node j;
* one round = one step of every request's reference loop: sort the frontier slots by
  ``(-path score, rank path)`` (``padded.sort_by_key``), materialise the first
  ``min(width, budget left, alive slots)`` of each request as new nodes, then ONE batched scorer
  call for the new nodes of every request that are shallower than max_depth (masked ``valid``;
  a request that reached its budget expands nothing), whose stable top-c rows become the new
  nodes' slots (dead entries for a node that is not expanded);
* path scores are float64 sums ``score(parent) + log q`` like the reference's Python floats.

A round's builder work (push the scored nodes' children, materialise the next nodes) is
``WeaverGrowth.round_fn``: ``weaver_round_reference`` below (torch), or on CUDA the one-launch
kernel ``vllm_tfm.kernels.weaver_round`` with the same signature and results (chosen by
``vllm_tfm.models.proposal_trees.weaver_growth``).

Every state tensor is allocated once (``WeaverGrowth.__init__``) and updated in place, the round
has fixed shapes and reads nothing back on the host, and the work per round does not depend on R
(one batched operation per step, no loop over requests or nodes): with fixed (R, B, width) the
first rounds can be captured in a CUDA graph (``vllm_tfm.vllm_plugin.runtime.weaver_graphs``).

Rounds. With ``S = max_r ceil(B_r / w_r)`` the first S rounds run without any host sync (each
request needs at least ceil(B_r / w_r) steps to place B_r nodes; a request that is done just
masks out). After round S one host sync asks whether any request still has budget left and
frontier entries or nodes to expand; only a short frontier (``children_per_node`` or K small,
-inf scores, max_depth binding) needs more rounds, then one sync per extra round. Scorer calls:
one for the roots, then one per round up to S - 1 (+ one per extra round): ceil(B / w) calls for
B nodes when the frontier never runs short, exactly the reference's count. The reference skips a
call when no node of the step can be expanded; the lockstep loop still calls the scorer in the
first S - 1 rounds, with every row masked, rather than sync to find out.

Batched scorer protocol::

    scorer(node_ids [R, w], parent_ids [R, w], tokens [R, w], depths [R, w], valid [R, w]) -> [R, w, K]

* int64 tensors (``valid`` bool) on ``candidates.device``; only rows with ``valid`` True are
  nodes to score, other rows hold arbitrary in-range values (node ids and parent ids in
  0..1 + max budget, depths <= max max_depth, tokens >= 0 taken from ``candidates`` or 0) and
  their outputs are ignored;
* call 1: the roots, node_ids 0, parent_ids -1, tokens = root tokens, depths 0, all valid (w = 1);
* later calls: the nodes materialised in one round (w = min(max width, max budget) columns, valid
  ones in ascending node id order); a valid node's parent was always valid in an earlier call;
* row [r, i] holds log-probabilities over ``candidates[r, depths[r, i]]`` conditioned on node
  i's root..node path in request r. Valid rows must be <= 0 without NaN (checked at the first
  host sync, ValueError).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ._common import (
    batch_size,
    check_depth_rows,
    check_positive_int,
    out_dtype,
    per_request,
)
from .padded import (
    DEAD_BIT,
    PaddedTrees,
    RankPathCode,
    per_request_tensor,
    sort_by_key,
    stable_topk,
)

__all__ = [
    "BatchedWeaverScorer",
    "RoundFn",
    "RoundOutputs",
    "WeaverGrowth",
    "pending_from_flags",
    "build_weaver_padded",
    "root_token_tensor",
    "weaver_round_reference",
]

BatchedWeaverScorer = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
"""scorer(node_ids, parent_ids, tokens, depths [R, w] int64, valid [R, w] bool) -> [R, w, K]."""

NEG_INF = float("-inf")


def root_token_tensor(root_tokens: Tensor | Sequence[int], num_requests: int, device: torch.device, check: bool) -> Tensor:
    """Root tokens as an int64 [R] tensor on ``device`` (checked >= 0 when ``check``: host sync)."""
    if isinstance(root_tokens, Tensor):
        if root_tokens.dim() != 1 or root_tokens.is_floating_point() or root_tokens.dtype == torch.bool:
            raise ValueError(
                f"root_tokens must be an integer tensor of shape [R], got {root_tokens.dtype} {tuple(root_tokens.shape)}"
            )
        roots = root_tokens.to(device=device, dtype=torch.long)
    else:
        roots = torch.tensor(list(root_tokens), dtype=torch.long, device=device)
    if roots.shape[0] != num_requests:
        raise ValueError(f"root_tokens has {roots.shape[0]} entries for {num_requests} requests")
    if check and bool((roots < 0).any()):
        raise ValueError(f"root tokens must be >= 0, got {roots.tolist()}")
    return roots


def _check_candidates(candidates: Tensor, depths: list[int]) -> None:
    """Token ids >= 0 and distinct within each depth row that request r reads (d < max_depth[r])."""
    if candidates.dtype != torch.long:
        raise ValueError(f"candidates must be int64 token ids, got dtype {candidates.dtype}")
    if candidates.shape[2] == 0:
        raise ValueError(f"candidates must hold at least one token per depth, got shape {tuple(candidates.shape)}")
    check_depth_rows(candidates.shape[1], max(depths), "candidates")
    rows = candidates[:, : max(depths)]
    read = torch.arange(rows.shape[1], device=rows.device)[None, :] < torch.tensor(depths, device=rows.device)[:, None]
    if bool(((rows < 0) & read[..., None]).any()):
        raise ValueError("candidates must be token ids >= 0")
    srt = rows.sort(dim=-1).values
    dup = (srt[..., 1:] == srt[..., :-1]).any(-1) & read
    if bool(dup.any()):
        r, d = dup.nonzero()[0].tolist()
        raise ValueError(f"candidates of request {r}, depth {d + 1} contain a repeated token id")


class WeaverGrowth:
    """The lockstep growth of ``build_weaver_padded`` as an object, one call per round.

    ``start()`` scores the roots and materialises round 1; ``advance()`` scores the nodes of the
    last round and materialises the next one; after ``fixed_rounds`` rounds (``run_fixed``)
    ``pending()`` (one host sync) says whether any request still has work, ``run_tail()`` runs
    those extra rounds, ``trees()`` reads the result. ``start`` / ``advance`` / ``trees`` issue
    no host sync and keep every persistent tensor in place: with equal per-request limits and a
    scorer that does the same, ``start(); advance() x (fixed_rounds - 1); trees()`` can be
    captured in a CUDA graph and replayed. Arguments as ``build_weaver_padded``.
    """

    def __init__(
        self,
        root_tokens: Tensor | Sequence[int],
        candidates: Tensor,
        scorer: BatchedWeaverScorer,
        budget: int | Sequence[int],
        max_depth: int | Sequence[int],
        width: int | Sequence[int],
        children_per_node: int = 8,
        check: bool = True,
    ) -> None:
        num_req = batch_size(candidates, "candidates", "[R, D, K]", 3)
        budgets = per_request(budget, num_req, "budget")
        depths = per_request(max_depth, num_req, "max_depth")
        widths = per_request(width, num_req, "width")
        cpn = check_positive_int(children_per_node, "children_per_node")
        dev = candidates.device
        if check:
            _check_candidates(candidates, depths)
        else:
            check_depth_rows(candidates.shape[1], max(depths), "candidates")
        self.roots = root_token_tensor(root_tokens, num_req, dev, check)
        self.scorer = scorer
        r_, _, k = candidates.shape
        self.r, self.k = r_, k
        self.c = c = min(cpn, k)
        bmax, self.dmax = max(budgets), max(depths)
        self.n_cap = n_cap = 1 + bmax  # node columns; column n_cap is a write-only trash column
        self.w = w = min(max(widths), bmax)
        self.fixed_rounds = max(-(-b // wd) for b, wd in zip(budgets, widths))
        self.max_rounds = 2 * bmax + 1  # every round with work places a node or empties a frontier
        code = RankPathCode(c, self.dmax)
        self.nw = nw = code.words
        self.ci = ci = 2 + nw
        self.trash_slot = n_cap * c  # slots n_cap * c .. + c - 1 belong to the trash node
        i64, f64 = torch.long, torch.float64
        # Per-request limits: Python ints when every request has the same (no index ops per round);
        # else width_limit [R], depth_limit [R, 1], budget1 (budget + 1) [R] int64
        self.width_limit: int | Tensor = widths[0] if len(set(widths)) == 1 else per_request_tensor(widths, dev)
        self.depth_limit: int | Tensor = depths[0] if len(set(depths)) == 1 else per_request_tensor(depths, dev)[:, None]
        self.ar_w = torch.arange(w, device=dev)
        self.ar_c = torch.arange(c, device=dev)
        if len(set(budgets)) == 1:
            self.budget1: int | Tensor = budgets[0] + 1
            self._base = self.ar_w + (budgets[0] + 1)  # node id of column i = budget + 1 - left + i
        else:
            self.budget1 = per_request_tensor(budgets, dev) + 1
            self._base = self.budget1[:, None] + self.ar_w
        # candidates of depths 1..dmax and one spare row, so that depth dmax indexes in range
        cand = candidates[:, : self.dmax]
        self.cand_flat = torch.cat([cand, cand[:, :1]], dim=1).reshape(r_, (self.dmax + 1) * k)
        # step[p, r]: what the rank-r child of a node at depth p adds to the node's (depth, rank-path
        # words): 1, then the words of rank r at position p; row dmax (no child) adds no words
        pos = torch.arange(self.dmax, device=dev)
        digit = code.digit(pos[:, None].expand(self.dmax, c), self.ar_c.expand(self.dmax, c))
        digit = torch.cat([digit, digit.new_zeros(1, c, nw)])  # [dmax + 1, c, W]
        self.step = torch.cat([torch.ones_like(digit[..., :1]), digit], dim=-1)  # [dmax + 1, c, 1 + W]

        # Persistent state, updated in place only. Frontier: fi [R, F, 2 + W] int64 = (token,
        # depth, rank-path words with DEAD_BIT in word 0 unless alive); ff [R, F, 2] float64 =
        # (path score, log q). node_slot [R, n_cap + 1]: the slot each node came from.
        f_len = (n_cap + 1) * c
        self.fi = torch.zeros(r_, f_len, ci, dtype=i64, device=dev)
        self.ff = torch.zeros(r_, f_len, 2, dtype=f64, device=dev)
        self.key0 = self.fi[:, :, 2]  # views, made once: word 0 of every slot, all words, scores
        self.key0.fill_(DEAD_BIT)
        self._words = self.fi[:, :, 2:]
        self._scores = self.ff[:, :, 0]
        self.node_slot = torch.full((r_, n_cap + 1), self.trash_slot, dtype=i64, device=dev)
        self.left = per_request_tensor(budgets, dev)  # nodes each request may still place
        self.fine = torch.ones((), dtype=torch.bool, device=dev)  # every valid scorer row <= 0, no NaN
        self.out_dtype: torch.dtype | None = None
        self.calls = 0
        self.rounds = 0
        # one round (push + materialise): the torch code below, or a kernel with its signature
        # (vllm_tfm.kernels.weaver_round, set by vllm_tfm.models.proposal_trees.weaver_growth)
        self.round_fn: RoundFn = weaver_round_reference

    # ------------------------------------------------------------------ rounds
    def start(self) -> None:
        """Score the roots, publish their children, materialise round 1."""
        r_, dev = self.r, self.fi.device
        zeros = torch.zeros(r_, 1, dtype=torch.long, device=dev)
        valid = torch.ones(r_, 1, dtype=torch.bool, device=dev)
        out = self.scorer(zeros, torch.full_like(zeros, -1), self.roots[:, None], zeros, valid)
        depth_words = torch.zeros(r_, 1, 1 + self.nw, dtype=torch.long, device=dev)
        self._round(out, zeros, zeros, depth_words, torch.zeros(r_, 1, dtype=torch.float64, device=dev), valid)

    def advance(self) -> None:
        """Score the nodes of the last round, publish their children, materialise the next round."""
        out = self.scorer(self.node, self.parent, self.tok, self.d, self.expand)
        self._round(out, self.node, self.d, self.depth_words, self.score, self.expand)

    def _round(self, out: Tensor, node: Tensor, d: Tensor, depth_words: Tensor, score: Tensor, valid: Tensor) -> None:
        """Check a scorer output (host-side metadata only), then one round through ``round_fn``."""
        self.calls += 1
        want = (self.r, node.shape[1], self.k)
        if not isinstance(out, Tensor) or tuple(out.shape) != want:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"scorer output (call {self.calls}) must have shape [{want[0]}, {want[1]}, {want[2]}], got {got}")
        if not out.is_floating_point():
            raise ValueError(f"scorer output (call {self.calls}) must be floating log-probabilities, got dtype {out.dtype}")
        if self.out_dtype is None:
            self.out_dtype = out_dtype(out.dtype)
        o = self.round_fn(self, out, node, d, depth_words, score, valid)
        self.node, self.parent, self.tok, self.d = o.node, o.parent, o.tok, o.d
        self.depth_words, self.score, self.expand = o.depth_words, o.score, o.expand
        self.n_alive, self.take, self.room = o.n_alive, o.take, o.room
        self.rounds += 1

    def run_fixed(self) -> None:
        """The first ``fixed_rounds`` rounds (no host sync)."""
        self.start()
        for _ in range(self.fixed_rounds - 1):
            self.advance()

    def pending_flags(self, rows: int | None = None) -> Tensor:
        """[2] bool on the device, no host sync: (does any request of the first ``rows`` still have
        work after this round, was some valid scorer row so far not log-probabilities)."""
        more = self.room & ((self.n_alive > self.take) | self.expand.any(1))
        if rows is not None:
            more = more[:rows]
        return torch.stack([more.any(), ~self.fine])

    def pending(self, rows: int | None = None) -> bool:
        """Host sync: does any request (of the first ``rows``) still have work after this round?
        Raises ValueError if a valid scorer row so far was not log-probabilities."""
        return pending_from_flags(self.pending_flags(rows).tolist())

    def run_tail(self, rows: int | None = None) -> None:
        """Rounds until no request (of the first ``rows``) has work: one host sync per round."""
        while self.pending(rows):
            if self.rounds >= self.max_rounds:
                raise RuntimeError("Weaver growth did not finish: this is a bug")
            self.advance()

    def num_nodes(self) -> Tensor:
        """[R] nodes placed per request, root included."""
        return self.budget1 - self.left

    def trees(self) -> PaddedTrees:
        """The trees so far: [R, 1 + max budget] (no host sync)."""
        r_, n = self.r, self.n_cap
        ns = self.node_slot[:, :n]
        idx = ns[..., None]
        gi = self.fi.gather(1, idx.expand(r_, n, self.ci))
        gf = self.ff.gather(1, idx.expand(r_, n, 2))
        num_nodes = self.num_nodes()
        col = torch.arange(n, device=ns.device)
        real = (col < num_nodes[:, None]) & (col > 0)  # placed draft nodes; the root is column 0
        tokens = torch.where(real, gi[..., 0], 0)
        tokens[:, 0] = self.roots
        dt = self.out_dtype or torch.float32
        return PaddedTrees(
            tokens,
            torch.where(real, ns // self.c, -1),
            torch.where(real, gi[..., 1], 0),
            torch.where(real, gf[..., 0], 0.0).to(dt),
            torch.where(real, gf[..., 1], 0.0).to(dt),
            num_nodes,
        )

def pending_from_flags(flags: list[bool]) -> bool:
    """``WeaverGrowth.pending`` from its ``pending_flags`` read on the host (raises as it does)."""
    more_any, bad = flags
    if bad:
        raise ValueError("scorer output must be log-probabilities (<= 0, no NaN) in every valid row")
    return bool(more_any)


@dataclass(frozen=True)
class RoundOutputs:
    """What one round leaves for the next: the scorer inputs of the nodes it materialised
    (node ids, parents, tokens, depths clamped to max_depth, (depth, rank-path words) [R, w, 1 + W],
    path scores float64, expand = the rows to score) and per request the alive frontier slots before
    the round, the nodes it placed, whether budget is left (n_alive, take, room [R])."""

    node: Tensor
    parent: Tensor
    tok: Tensor
    d: Tensor
    depth_words: Tensor
    score: Tensor
    expand: Tensor
    n_alive: Tensor
    take: Tensor
    room: Tensor


RoundFn = Callable[[WeaverGrowth, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor], RoundOutputs]
"""round_fn(growth, out [R, m, K], node, d [R, m] int64, depth_words [R, m, 1 + W] int64,
score [R, m] float64, valid [R, m] bool) -> RoundOutputs; updates growth.fi / ff / node_slot /
left / fine in place (``weaver_round_reference``, or the kernel ``vllm_tfm.kernels.weaver_round``)."""


def weaver_round_reference(
    g: WeaverGrowth, out: Tensor, node: Tensor, d: Tensor, depth_words: Tensor, score: Tensor, valid: Tensor
) -> RoundOutputs:
    """One round of every request in torch: push the scored nodes' children, materialise the next nodes.

    Push: the top-c children of every scored node become its frontier slots ``node * c + rank``
    (dead unless the node is valid and the child's log q is finite); ``d`` are the nodes' depths
    clamped to max_depth and ``depth_words`` their depths and rank-path words (the frontier
    columns they came from). Materialise: the best frontier slots of each request (up to its width
    and budget) become nodes; the rows to expand next are those shallower than max_depth while
    budget is left. ``out`` rows that are not ``valid`` are ignored; a NaN or positive entry in a
    valid row clears ``g.fine``.
    """
    r_, m, c = g.r, node.shape[1], g.c
    # ---- push
    valid3 = valid[..., None]
    x = torch.where(valid3, out, NEG_INF)  # an invalid row has no live child
    g.fine.logical_and_((x <= 0).all())  # NaN or a positive entry in a valid row clears it
    vals, cols = stable_topk(x, c)  # [R, m, c], best first
    vals = vals.to(torch.float64)
    child = depth_words[:, :, None, :] + g.step[d]  # [R, m, c, 1 + W]: depth + 1, words
    # a dead child's word 0 is DEAD_BIT alone: its rank path is never read (dead slots sort
    # last, are never taken, and trees() reads tokens, depths and scores only)
    child[..., 1].masked_fill_(vals == NEG_INF, DEAD_BIT)
    tok = g.cand_flat.gather(1, torch.add(cols, d[..., None], alpha=g.k).view(r_, m * c))  # d * K + col
    new_i = torch.cat([tok.view(r_, m, c, 1), child], dim=-1).view(r_, m * c, g.ci)
    new_f = torch.stack([score[..., None] + vals, vals], dim=-1).view(r_, m * c, 2)
    slot = torch.add(g.ar_c, node[..., None], alpha=c).view(r_, m * c, 1)  # node * c + rank
    g.fi.scatter_(1, slot.expand(r_, m * c, g.ci), new_i)
    g.ff.scatter_(1, slot.expand(r_, m * c, 2), new_f)
    # ---- materialise
    w = g.w
    alive = g.key0 < DEAD_BIT
    n_alive = alive.sum(1)
    if isinstance(g.width_limit, int):
        cap = g.left.clamp(max=g.width_limit)
    else:
        cap = torch.minimum(g.left, g.width_limit)
    take = torch.minimum(cap, n_alive)
    sel = sort_by_key(g._scores, g._words, alive, dead_in_words=True)[:, :w]  # best first
    ok = g.ar_w < take[:, None]
    idx = sel[..., None]
    gi = g.fi.gather(1, idx.expand(r_, w, g.ci))
    gf = g.ff.gather(1, idx.expand(r_, w, 2))
    new_node = torch.where(ok, g._base - g.left[:, None], g.n_cap)
    g.node_slot.scatter_(1, new_node, sel)
    g.key0.scatter_(1, torch.where(ok, sel, g.trash_slot), DEAD_BIT)
    g.left.sub_(take)
    room = g.left > 0
    dcl = gi[..., 1].clamp(max=g.dmax)
    expand = ok & (dcl < g.depth_limit) & room[:, None]
    return RoundOutputs(new_node, sel // c, gi[..., 0], dcl, gi[..., 1:], gf[..., 0], expand, n_alive, take, room)


def build_weaver_padded(
    root_tokens: Tensor | Sequence[int],
    candidates: Tensor,
    scorer: BatchedWeaverScorer,
    budget: int | Sequence[int],
    max_depth: int | Sequence[int],
    width: int | Sequence[int],
    children_per_node: int = 8,
    check: bool = True,
) -> PaddedTrees:
    """Weaver trees of R requests grown in lockstep (module docstring): ``build_weaver`` per request.

    Args:
        root_tokens: [R] last committed tokens (node 0 of each tree).
        candidates: [R, D, K] int64, row d - 1 = the K candidate tokens of depth d (distinct within
            a row); D >= max max_depth.
        scorer: batched scorer (module docstring), e.g. ``vllm_tfm.models.BatchedWeaverTreeScorer``.
        budget, max_depth, width: one int for all requests or one per request (all >= 1).
        children_per_node: children each expanded node publishes (clipped to K).
        check: validate root tokens and candidates (host syncs before the first round). Scorer
            outputs are always checked, at the first host sync of the loop.

    Returns a ``PaddedTrees`` of [R, 1 + max budget]; request r's first ``num_nodes[r]`` columns
    equal ``build_weaver(root_tokens[r], candidates[r], ..., budget[r], max_depth[r], width[r])``.
    """
    growth = WeaverGrowth(root_tokens, candidates, scorer, budget, max_depth, width, children_per_node, check)
    growth.run_fixed()
    growth.run_tail()
    return growth.trees()
