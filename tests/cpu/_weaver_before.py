"""The lockstep Weaver builder and batched Weaver scorer as they were before the in-place
rewrite (``vllm_tfm/tree/weaver_padded.py`` and ``vllm_tfm/models/weaver.py`` at commit 190f26e),
frozen here as a regression oracle: the current ``build_weaver_padded`` / ``WeaverGrowth`` and
``BatchedWeaverTreeScorer`` must give the same trees and, on valid rows, the same scores bit for bit.
Not imported by the package. (The independent reference remains ``vllm_tfm.tree.build_weaver``,
one Python heap per request.)"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from vllm_tfm.models.common import as_weight, masked_attention
from vllm_tfm.models.vocab_table import (
    ShardedVocabTable,
    candidate_residual,
    table_num_rows,
)
from vllm_tfm.tree._common import (
    batch_size,
    check_depth_rows,
    check_positive_int,
    out_dtype,
    per_request,
)
from vllm_tfm.tree.padded import (
    DEAD_BIT,
    PaddedTrees,
    RankPathCode,
    per_request_tensor,
    sort_by_key,
    stable_topk,
)
from vllm_tfm.tree.weaver_padded import _check_candidates, root_token_tensor

NEG_INF = float("-inf")


def build_weaver_padded_before(
    root_tokens: Tensor | Sequence[int],
    candidates: Tensor,
    scorer,
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
    roots = root_token_tensor(root_tokens, num_req, dev, check)

    r_, d_rows, k = candidates.shape
    c = min(cpn, k)
    bmax, dmax = max(budgets), max(depths)
    n_cap = 1 + bmax  # node columns; column n_cap is a write-only trash slot
    f_cap = n_cap * c  # frontier slots; slot f_cap is a write-only trash slot
    w = min(max(widths), bmax)
    code = RankPathCode(c, dmax)
    nw = code.words
    f64, i64 = torch.float64, torch.long
    budget_t = per_request_tensor(budgets, dev)
    depth_t = per_request_tensor(depths, dev)
    width_t = per_request_tensor(widths, dev)
    ar_w = torch.arange(w, device=dev)
    ar_c = torch.arange(c, device=dev)
    cand_flat = candidates.reshape(r_, d_rows * k)
    # digit[p, r]: the rank-path words of rank r at position p (a child of a node at depth p)
    pos = torch.arange(dmax, device=dev)
    digit = code.digit(pos[:, None].expand(dmax, c), ar_c.expand(dmax, c))  # [dmax, c, W]

    # Packed state (few tensors, so one gather / scatter moves a whole row):
    # nodes: ni [R, N+1, 3 + W] int64 = (token, parent, depth, rank-path words); nf [R, N+1, 2]
    # float64 = (path score, log q). Frontier slots: ei [R, F+1, 1 + W] int64 = (candidate column,
    # rank-path words with DEAD_BIT in word 0 unless alive); ef [R, F+1, 2] float64 = (score, log q).
    ni = torch.zeros(r_, n_cap + 1, 3 + nw, dtype=i64, device=dev)
    ni[:, :, 1] = -1
    ni[:, 0, 0] = roots
    nf = torch.zeros(r_, n_cap + 1, 2, dtype=f64, device=dev)
    ei = torch.zeros(r_, f_cap + 1, 1 + nw, dtype=i64, device=dev)
    ei[:, :, 1] = DEAD_BIT
    ef = torch.zeros(r_, f_cap + 1, 2, dtype=f64, device=dev)
    num_nodes = torch.ones(r_, dtype=i64, device=dev)
    bad = torch.zeros((), dtype=torch.bool, device=dev)
    dtype: list[torch.dtype] = []
    calls = 0

    def push(out: Tensor, ids: Tensor, valid: Tensor) -> None:
        """Check a scorer output; the top-c children of every valid node become slots ids * c + rank."""
        nonlocal bad, calls
        calls += 1
        m = ids.shape[1]
        want = (r_, m, k)
        if not isinstance(out, Tensor) or tuple(out.shape) != want:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            raise ValueError(f"scorer output (call {calls}) must have shape [{want[0]}, {want[1]}, {want[2]}], got {got}")
        if not out.is_floating_point():
            raise ValueError(f"scorer output (call {calls}) must be floating log-probabilities, got dtype {out.dtype}")
        if not dtype:
            dtype.append(out_dtype(out.dtype))
        x = torch.where(valid[..., None], out, 0)
        bad = bad | (~(x <= 0)).any()  # NaN or positive in a valid row
        vals, cols = stable_topk(x, c)  # [R, m, c], best first
        vals = vals.to(f64)
        nid = torch.where(valid, ids, 0)
        node = ni.gather(1, nid[..., None].expand(r_, m, 3 + nw))  # the expanded nodes' rows
        alive = valid[..., None] & (vals > NEG_INF)
        words = node[:, :, None, 3:] + digit[node[..., 2].clamp(max=dmax - 1)]  # [R, m, c, W]
        words[..., 0] += torch.where(alive, 0, DEAD_BIT)
        slot = torch.where(valid[..., None], nid[..., None] * c + ar_c, f_cap).reshape(r_, m * c, 1)
        new_i = torch.cat([cols[..., None], words], dim=-1).reshape(r_, m * c, 1 + nw)
        pscore = nf[:, :, 0].gather(1, nid)
        new_f = torch.stack([pscore[..., None] + vals, vals], dim=-1).reshape(r_, m * c, 2)
        ei.scatter_(1, slot.expand(r_, m * c, 1 + nw), new_i)
        ef.scatter_(1, slot.expand(r_, m * c, 2), new_f)

    def materialise() -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        """One step of every request: new nodes and which of them to expand."""
        nonlocal num_nodes
        alive = ei[:, :, 1] < DEAD_BIT
        n_alive = alive.sum(1)
        take = torch.minimum(torch.minimum(width_t, budget_t - num_nodes + 1), n_alive)
        sel = sort_by_key(ef[:, :, 0], ei[:, :, 1:], alive, dead_in_words=True)[:, :w]  # best first
        ok = ar_w < take[:, None]
        got_i = ei.gather(1, sel[..., None].expand(r_, w, 1 + nw))
        got_f = ef.gather(1, sel[..., None].expand(r_, w, 2))
        parent = sel // c
        d = ni[:, :, 2].gather(1, parent) + 1
        tok = cand_flat.gather(1, (d - 1).clamp(0, d_rows - 1) * k + got_i[..., 0])
        node = torch.where(ok, num_nodes[:, None] + ar_w, n_cap)
        ni.scatter_(1, node[..., None].expand(r_, w, 3 + nw), torch.cat([torch.stack([tok, parent, d], -1), got_i[..., 1:]], -1))
        nf.scatter_(1, node[..., None].expand(r_, w, 2), got_f)
        ei[:, :, 1].scatter_(1, torch.where(ok, sel, f_cap), DEAD_BIT)
        num_nodes = num_nodes + take
        room = num_nodes <= budget_t
        expand = ok & (d < depth_t[:, None]) & room[:, None]
        more = room & ((n_alive > take) | expand.any(1))
        return node, parent, tok, d.clamp(max=dmax), expand, more

    zeros = torch.zeros(r_, 1, dtype=i64, device=dev)
    all_ok = torch.ones(r_, 1, dtype=torch.bool, device=dev)
    push(scorer(zeros, zeros - 1, roots[:, None], zeros, all_ok), zeros, all_ok)
    fixed_rounds = max(-(-b // wd) for b, wd in zip(budgets, widths))
    for rnd in range(1, 2 * bmax + 2):
        node, parent, tok, d, expand, more = materialise()
        if rnd >= fixed_rounds:
            more_any, is_bad = torch.stack([more.any(), bad]).tolist()
            if is_bad:
                raise ValueError("scorer output must be log-probabilities (<= 0, no NaN) in every valid row")
            if not more_any:
                break
        push(scorer(node, parent, tok, d, expand), node, expand)
    else:  # every round with work places a node or empties a frontier
        raise RuntimeError("Weaver growth did not finish: this is a bug")

    cols = slice(0, n_cap)
    dt = dtype[0]
    return PaddedTrees(
        ni[:, cols, 0], ni[:, cols, 1], ni[:, cols, 2], nf[:, cols, 0].to(dt), nf[:, cols, 1].to(dt), num_nodes
    )


class BatchedWeaverTreeScorerBefore:
    """Weaver scoring for R trees at once, in the lockstep builder's protocol
    (``vllm_tfm.tree.build_weaver_padded``); per request the same function as ``WeaverTreeScorer``.

    ``scorer(node_ids, parent_ids, tokens, depths [R, w] int64, valid [R, w] bool) -> [R, w, K]``:
    row [r, i] (when valid) = log-probabilities over ``cand_ids[r, depths[r, i]]`` given node
    i's root..node path in request r; invalid rows are computed on clamped inputs and mean
    nothing. Node ids index a per-request buffer of ``max_nodes`` slots (the tree's 1 + B nodes):
    per layer, K/V ``[R, 1 + D + max_nodes, heads, head_dim]`` (the prompt's, then every scored
    node's) and one key mask per node slot ``[R, max_nodes, 1 + D + max_nodes]`` (the prompt, then
    ancestors-or-self: the parent's row plus the node itself). A node attends to the keys its
    mask row names: the same keys as
    ``WeaverTreeScorer`` (prompt + root..node path), summed in a different order, so outputs agree
    to rounding (float32: ~1e-6), not bit for bit. One call = one Weaver step of R x w nodes with
    fixed shapes and no host sync.

    Protocol (not checked unless ``validate``, which syncs with the host): the first call holds
    the roots (node 0, parent -1, depth 0) of every request; a valid node's parent was valid in an
    EARLIER call (never in the same call: the lockstep builder never scores a node with its
    parent) and its depth is the parent's + 1 < D; node ids are < max_nodes and not reused.

    Args:
        verifier_hidden: [R, H]; dflash_hidden: [R, D, H] (DFlash slots 1..D, after the final norm).
        cand_ids: [R, D, K] int64; cand_logits: [R, D, K] raw DFlash logits of those candidates.
        embed, lm_head: the target's input embedding and lm_head (modules, [V, H] weights, or
            ``ShardedVocabTable`` for vocabulary-split weights under tensor parallelism).
        max_nodes: node slots per request (1 + the largest budget).
    """

    def __init__(
        self,
        weaver,
        verifier_hidden: Tensor,
        dflash_hidden: Tensor,
        cand_ids: Tensor,
        cand_logits: Tensor,
        embed,
        lm_head,
        max_nodes: int,
        validate: bool = False,
    ) -> None:
        self.weaver = weaver
        depth = weaver._check_prompt(verifier_hidden, dflash_hidden)
        if verifier_hidden.dim() != 2:
            raise ValueError(f"verifier_hidden must be [R, H], got shape {tuple(verifier_hidden.shape)}")
        r = verifier_hidden.shape[0]
        if cand_ids.dim() != 3 or tuple(cand_ids.shape[:2]) != (r, depth) or cand_logits.shape != cand_ids.shape:
            raise ValueError(
                f"cand_ids and cand_logits must both be [R={r}, D={depth}, K], "
                f"got shapes {tuple(cand_ids.shape)} and {tuple(cand_logits.shape)}"
            )
        if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or max_nodes < 1:
            raise ValueError(f"max_nodes must be an integer >= 1, got {max_nodes!r}")
        self.num_requests, self.depth, self.max_nodes, self.validate = r, depth, max_nodes, validate
        self.embed = embed
        self.lm_head = lm_head if isinstance(lm_head, ShardedVocabTable) else as_weight(lm_head, "lm_head")
        self.n_embed_rows = table_num_rows(embed, "embed")
        self.cand_ids = cand_ids
        self.cand_logits = cand_logits
        with torch.no_grad():
            x = weaver.prompt_inputs(verifier_hidden, dflash_hidden)  # [R, 1 + D, d]
            dev = x.device
            cos, sin = weaver._rope(torch.arange(1 + depth, device=dev), x.dtype)
            causal = torch.ones(1 + depth, 1 + depth, dtype=torch.bool, device=dev).tril()
            # per layer, keys / values of [prompt (1 + D) | node slots (max_nodes) | trash slot]
            p0 = 1 + depth
            self.k_cache: list[Tensor] = []
            self.v_cache: list[Tensor] = []
            for layer in weaver.layers:
                q, k, v = layer.qkv_rope(x, cos, sin)
                self.k_cache.append(torch.cat([k, k.new_zeros(r, max_nodes + 1, *k.shape[2:])], dim=1))
                self.v_cache.append(torch.cat([v, v.new_zeros(r, max_nodes + 1, *v.shape[2:])], dim=1))
                x = layer.finish(x, masked_attention(q, k, v, causal, layer.head_dim**-0.5))
        # key mask of every node slot (and the trash slot): the whole prompt, then its
        # ancestors-or-self among the node slots
        self.ancestors = torch.zeros(r, max_nodes + 1, p0 + max_nodes, dtype=torch.bool, device=dev)
        self.ancestors[:, :, :p0] = True
        self._scored = torch.zeros(r, max_nodes, dtype=torch.bool, device=dev) if validate else None
        self._depths = torch.zeros(r, max_nodes, dtype=torch.long, device=dev) if validate else None

    def _check(self, node_ids: Tensor, parent_ids: Tensor, tokens: Tensor, depths: Tensor, valid: Tensor) -> None:
        """The protocol of the class docstring, for the valid rows (host sync)."""
        first = not bool(self._scored.any())
        for r, i in valid.nonzero().tolist():
            nid, pid, tok, dep = (int(t[r, i]) for t in (node_ids, parent_ids, tokens, depths))
            if not 0 <= nid < self.max_nodes:
                raise ValueError(f"request {r}: node id {nid} outside 0..{self.max_nodes - 1}")
            if bool(self._scored[r, nid]):
                raise ValueError(f"request {r}: node {nid} was already scored")
            if not 0 <= tok < self.n_embed_rows:
                raise ValueError(f"request {r}: token {tok} outside [0, {self.n_embed_rows})")
            if first != (pid == -1):
                raise ValueError(f"request {r}: node {nid} with parent {pid}: the first call holds the roots (parent -1) only")
            if pid == -1:
                if dep != 0 or nid != 0:
                    raise ValueError(f"request {r}: the root must be node 0 at depth 0, got node {nid} at depth {dep}")
            else:
                if not (0 <= pid < self.max_nodes and bool(self._scored[r, pid])):
                    raise ValueError(f"request {r}: node {nid} has parent {pid}, which was not scored in an earlier call")
                if dep != int(self._depths[r, pid]) + 1:
                    raise ValueError(f"request {r}: node {nid} has depth {dep}, its parent {pid} has depth {int(self._depths[r, pid])}")
            if dep >= self.depth:
                raise ValueError(f"request {r}: node {nid} at depth {dep} has no candidates (D = {self.depth})")
        rows, cols = valid.nonzero().unbind(1)
        self._scored[rows, node_ids[rows, cols]] = True
        self._depths[rows, node_ids[rows, cols]] = depths[rows, cols]

    def __call__(self, node_ids: Tensor, parent_ids: Tensor, tokens: Tensor, depths: Tensor, valid: Tensor) -> Tensor:
        r = self.num_requests
        if node_ids.dim() != 2 or node_ids.shape[0] != r or node_ids.shape[1] == 0:
            raise ValueError(f"node_ids must be [R={r}, w >= 1], got shape {tuple(node_ids.shape)}")
        for name, t in (("parent_ids", parent_ids), ("tokens", tokens), ("depths", depths), ("valid", valid)):
            if t.shape != node_ids.shape:
                raise ValueError(f"{name} must be {list(node_ids.shape)} like node_ids, got shape {tuple(t.shape)}")
        if self.validate:
            self._check(node_ids, parent_ids, tokens, depths, valid)
        wv, n = self.weaver, self.max_nodes
        w = node_ids.shape[1]
        dev = self.ancestors.device
        with torch.no_grad():
            valid = valid.to(dev)
            slot = torch.where(valid, node_ids.to(dev), n)  # invalid rows write to the trash slot
            parent = torch.where(valid, parent_ids.to(dev), -1)
            dep = torch.where(valid, depths.to(dev), 0).clamp(0, self.depth - 1)
            p0 = 1 + self.depth
            # key mask: the parent's row (the prompt only, for the root) plus the node itself
            row = self.ancestors.gather(1, parent.clamp(min=0)[..., None].expand(r, w, p0 + n))
            cols = torch.arange(p0 + n, device=dev)
            row = (row & ((parent >= 0)[..., None] | (cols < p0))) | (cols == p0 + slot[..., None])
            self.ancestors.scatter_(1, slot[..., None].expand(r, w, p0 + n), row)
            toks = torch.where(valid, tokens.to(dev), 0).clamp(0, self.n_embed_rows - 1)
            x = wv.token_inputs(toks, self.embed)  # [R, w, d]
            cos, sin = wv._rope(dep + 1, x.dtype)
            idx = (p0 + slot)[..., None, None]
            for li, layer in enumerate(wv.layers):
                q, k, v = layer.qkv_rope(x, cos, sin)  # [R, w, heads, hd]
                kc, vc = self.k_cache[li], self.v_cache[li]
                kc.scatter_(1, idx.expand_as(k), k)
                vc.scatter_(1, idx.expand_as(v), v)
                keys, vals = kc[:, : p0 + n], vc[:, : p0 + n]  # [R, 1 + D + n, heads, hd], views
                x = layer.finish(x, masked_attention(q, keys, vals, row, layer.head_dim**-0.5))
            qry = wv.query(x)  # [R, w, H]
            k_cand = self.cand_ids.shape[2]
            gather = dep[..., None].expand(r, w, k_cand)
            ids = self.cand_ids.gather(1, gather)  # [R, w, K]
            logits = self.cand_logits.gather(1, gather)
            residual = candidate_residual(self.lm_head, ids, qry)  # lm_head[ids] . qry: [R, w, K]
            return torch.log_softmax(logits.to(residual.dtype) + residual, dim=-1)
