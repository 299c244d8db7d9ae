"""The batched Weaver scorer as it was before the fused step (``vllm_tfm/models/weaver.py`` before
``weaver_step.py``: every RMSNorm, projection, RoPE and attention through the ``Weaver`` modules'
own forward code), frozen here as a regression oracle: the fused ``BatchedWeaverTreeScorer`` must
give the same scores to float32 rounding (1e-5 relative) and, on the test cases, the same trees.
Not imported by the package."""

from __future__ import annotations

import torch
from torch import Tensor

from vllm_tfm.models.common import as_weight, compute_dtype, masked_attention
from vllm_tfm.models.vocab_table import (
    ShardedVocabTable,
    VocabTable,
    candidate_residual,
    table_num_rows,
)
from vllm_tfm.models.weaver import Weaver, WeaverBlock


class BatchedWeaverTreeScorerUnfused:
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
        weaver: Weaver,
        verifier_hidden: Tensor,
        dflash_hidden: Tensor,
        cand_ids: Tensor,
        cand_logits: Tensor,
        embed: VocabTable,
        lm_head: VocabTable,
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
        # views of the keys / values a node may attend to (the trash slot excluded), made once
        self._keys = [kc[:, : p0 + max_nodes] for kc in self.k_cache]
        self._values = [vc[:, : p0 + max_nodes] for vc in self.v_cache]
        # key mask of every node slot, the trash slot (row max_nodes) and the root's parent (row
        # max_nodes + 1, the prompt only): the whole prompt, then its ancestors-or-self among the
        # node slots
        self.ancestors = torch.zeros(r, max_nodes + 2, p0 + max_nodes, dtype=torch.bool, device=dev)
        self.ancestors[:, :, :p0] = True
        # row s: key column of node slot s alone (row max_nodes, the trash slot: none)
        cols = torch.arange(p0 + max_nodes, device=dev)
        self._self_key = cols == p0 + torch.arange(max_nodes + 1, device=dev)[:, None]
        # RoPE of the node positions 1..D, cos and sin stacked: [D, 2, 1, 1, head_dim], indexed by
        # depth (the same values as rope_cos_sin of the positions, computed once)
        cos_n, sin_n = weaver._rope(torch.arange(1, 1 + depth, device=dev), x.dtype)
        self._rope_nodes = torch.stack([cos_n, sin_n], dim=1)[:, :, None, None, :]
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
        if node_ids.device != dev:
            node_ids, parent_ids, tokens, depths, valid = (t.to(dev) for t in (node_ids, parent_ids, tokens, depths, valid))
        with torch.no_grad():
            # invalid rows: computed on clamped inputs, written to the trash slot, ignored
            slot = torch.where(valid, node_ids, n)
            dep = depths.clamp(0, self.depth - 1)
            toks = tokens.clamp(0, self.n_embed_rows - 1)
            p0 = 1 + self.depth
            # key mask: the parent's row (row n + 1 = the prompt only, for the root's parent -1)
            # plus the node itself
            span = p0 + n
            row = self.ancestors.gather(1, parent_ids.remainder(n + 2)[..., None].expand(r, w, span))
            row.logical_or_(self._self_key[slot])
            self.ancestors.scatter_(1, slot[..., None].expand(r, w, span), row)
            hidden = row.logical_not().unsqueeze(-3)  # [R, 1, w, S]: keys each node may not see
            x = wv.token_inputs(toks, self.embed)  # [R, w, d]
            rope = self._rope_nodes[dep]  # [R, w, 2, 1, 1, hd]
            cos, sin = rope[:, :, 0], rope[:, :, 1]
            idx = (p0 + slot)[..., None, None]
            for li, layer in enumerate(wv.layers):
                q, k, v = _qkv_rope_pair(layer, x, cos, sin)  # [R, w, heads, hd]
                kc, vc = self.k_cache[li], self.v_cache[li]
                kc.scatter_(1, idx.expand_as(k), k)
                vc.scatter_(1, idx.expand_as(v), v)
                attn = _hidden_masked_attention(q, self._keys[li], self._values[li], hidden, layer.head_dim**-0.5)
                x = layer.finish(x, attn)
            qry = wv.query(x)  # [R, w, H]
            k_cand = self.cand_ids.shape[2]
            gather = dep[..., None].expand(r, w, k_cand)
            ids = self.cand_ids.gather(1, gather)  # [R, w, K]
            logits = self.cand_logits.gather(1, gather)
            residual = candidate_residual(self.lm_head, ids, qry)  # lm_head[ids] . qry: [R, w, K]
            if logits.dtype != residual.dtype:
                logits = logits.to(residual.dtype)
            return torch.log_softmax(logits + residual, dim=-1)


def _qkv_rope_pair(layer: WeaverBlock, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``layer.qkv_rope`` with q and k rotated together: cos / sin [..., T, 1, 1, hd].

    The same elementwise operations on the same values as ``apply_rope`` (``x * cos +
    rotate_half(x) * sin``), so bit for bit the same q and k; q is returned contiguous, as
    ``apply_rope`` returns it, so that the attention matmuls see the same layout.
    """
    hd = layer.head_dim
    qkv = layer.qkv(layer.attn_norm(x)).unflatten(-1, (3, layer.n_heads, hd))  # [..., T, 3, heads, hd]
    qk = qkv[..., :2, :, :]
    rot = torch.cat([-qk[..., hd // 2 :], qk[..., : hd // 2]], dim=-1)
    qk = qk * cos + rot * sin
    return qk[..., 0, :, :].contiguous(), qk[..., 1, :, :], qkv[..., 2, :, :]


def _hidden_masked_attention(q: Tensor, k: Tensor, v: Tensor, hidden: Tensor, scale: float) -> Tensor:
    """``common.masked_attention`` (equal query and key/value heads) given the complement of the
    mask, ``hidden`` [..., 1, Q, S] (True = the query does not see the key), without the no-op
    dtype conversions: the same operations, so the same values bit for bit."""
    cd = compute_dtype(q.dtype)
    qc, kc, vc = (t if t.dtype == cd else t.to(cd) for t in (q, k, v))
    scores = torch.einsum("...qhd,...shd->...hqs", qc, kc) * scale
    scores.masked_fill_(hidden, float("-inf"))
    out = torch.einsum("...hqs,...shd->...qhd", torch.softmax(scores, dim=-1), vc)
    return out if out.dtype == q.dtype else out.to(q.dtype)
