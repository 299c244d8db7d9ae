"""Traversal Verification of a token tree (Weng et al., "Traversal Verification for Speculative
Tree Decoding", arXiv 2505.12398, Algorithm 3), batched over a ragged TreeBatch.

Tree-sampling process assumed (what makes the output exactly the target distribution). Every node
v carries a draft distribution q_v over the vocabulary, and the children of v, *in index order*,
are the first k_v draws of sampling without replacement from q_v: the first child ~ q_v, each next
child ~ q_v with the tokens already drawn removed and renormalised. k_v may be fixed or decided by
a stopping rule on the draws made so far at v; subtree shapes may depend on any draws, never on
the verifier's uniforms. Two ways to meet it:

* ``draft_probs`` given ([T, V], row v = q_v, the drafter's full distribution at node v): the tree
  builder drew the children of v from q_v without replacement, in index order, as
  :func:`sample_tree_from_draft` does. This is the paper's setting. The guarantee holds on
  average over the random tree, not for a tree fixed in advance.
* ``draft_probs`` None: q_v is the softmax, over v's children, of their ``draft_logprobs`` (the
  sibling-restricted proposal of the authors' implementation), and the verifier itself puts the
  children of every node in a random order drawn without replacement from q_v (a Plackett-Luce
  order, the order Gumbel keys give). Then the process above holds for *any* children sets, e.g.
  a deterministic top-k tree, so this mode is lossless for every tree builder.

Algorithm (our own derivation of the paper's update rules; notation per node v: alpha_v, target
p_v, draft q_v). alpha_root = 1. Entering a child c of v: alpha_c = min(alpha_v p_v(c) / q_v(c), 1)
with v's *current* p_v, q_v. Nodes are visited in post-order (a node after all of its children
were rejected; children in the order above). Visiting v: accept the path root..v with probability
alpha_v; then the bonus is drawn from the current p_v. Otherwise v is removed and its parent w
updated with its current (alpha, p, q):

    Rm = sum_x [alpha_w p_w(x) - q_w(x)]_+
    p_w <- [alpha_w p_w - q_w]_+ / Rm
    q_w <- q_w with v's token removed, renormalised
    alpha_w <- Rm / (Rm + 1 - alpha_w)          (1 when alpha_w = 1)

Why it is exact (induction on the height of v): the subtree of v, entered with state (alpha, p,
q), ends by accepting a path through v with probability alpha and then emits token x next with
probability alpha p(x) (times the target's law of what follows), else rejects v with probability
1 - alpha. For the first child c ~ q: P(emit c next) = q(c) alpha_c = min(alpha p(c), q(c)); P(c
rejected) = sum_c [q(c) - alpha p(c)]_+ = Rm + 1 - alpha. Given the rejection, c's token has zero
residual mass and the remaining children are draws without replacement from q minus c, so the
induction applies to the updated state, which emits x with probability alpha' p'(x) = [alpha p(x) -
q(x)]_+ / (Rm + 1 - alpha); summing both routes gives alpha p(x). At the root alpha = 1, so the
first emitted token has law p_root and every later one the target conditional.

Randomness (uniforms [R, 1 + 2N], N = the largest tree of the batch, float in [0, 1)):
    column 0          the bonus: inverse CDF of the final p over token ids in increasing order;
    column 1 + t      the accept test at the t-th post-order visit (accept iff u < alpha);
    column 1 + N + c  (``draft_probs`` None only) for a node with children c_0 < c_1 < ... (local
                      indices), the k-th draw of their random order reads the column of c_k,
                      an inverse CDF over the not-yet-placed children in index order with weights
                      q_v; the last child is placed without a draw.
Unused columns are ignored.

Duplicate tokens among siblings are refused (sampling without replacement never makes them).
Cost: the visiting plan (sibling orders, post-order) is built by a Python loop over the requests
on the CPU (O(T) work, one host copy of parents/tokens and, in sibling mode, of the uniforms). The
walk is vectorised over requests with a loop over post-order steps; it keeps the (alpha, p, q) of
the nodes on the current root..node path, O(R (Dmax + 1) V) memory, and copies a few [R, V] rows
per step and entered depth. A torch reference, not the production kernel.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from vllm_tfm.tree.types import Tree, TreeBatch

from .accept_result import AcceptResult, accept_result_from_last_node
from .uniforms import Generators, check_uniforms, draw_uniforms, inverse_cdf

__all__ = ["traversal_uniform_width", "verify_traversal", "sample_tree_from_draft"]


def traversal_uniform_width(trees: TreeBatch) -> int:
    """Width 1 + 2N of the uniforms verify_traversal reads (N = nodes of the largest tree)."""
    return 1 + 2 * int(trees.cu_nodes.diff().max())


def _pick(weights: list[float], u: float) -> int:
    """Inverse CDF over a short Python list (same rule as uniforms.inverse_cdf)."""
    total = sum(weights)
    acc = 0.0
    for j, w in enumerate(weights):
        acc += w
        if u * total < acc:
            return j
    return max(j for j, w in enumerate(weights) if w > 0)


def _visit_plan(
    trees: TreeBatch, q_children: list[float] | None, uniforms: Tensor, width_nodes: int
) -> tuple[Tensor, Tensor, list[list[int]]]:
    """Post-order visits [R, N] and the nodes entered before each visit [R, N, Dmax + 1] (flat ids).

    ``enter[r, t, d]`` is the node at depth d entered right before visit t (-1 if none): before
    visit 0 the path root..first leaf, after a rejected node the path from its next sibling down
    to that sibling's first leaf. Also returns, per visit t, the depths any request enters at.
    q_children (flat, per node: its q under its parent) switches on the random sibling order.
    """
    par = trees.parents.tolist()
    tok = trees.tokens.tolist()
    dep = trees.depth.tolist()
    cu = trees.cu_nodes.tolist()
    dmax = max(dep)
    num_req = len(cu) - 1
    u_order = uniforms[:, 1 + width_nodes :].tolist() if q_children is not None else None
    visits = torch.full((num_req, width_nodes), -1, dtype=torch.long)
    enter = torch.full((num_req, width_nodes, dmax + 1), -1, dtype=torch.long)
    for r in range(num_req):
        s, n = cu[r], cu[r + 1] - cu[r]
        children: list[list[int]] = [[] for _ in range(n)]
        for i in range(1, n):
            children[par[s + i]].append(i)
        for v, ch in enumerate(children):
            seen: dict[int, int] = {}
            for c in ch:
                if tok[s + c] in seen:
                    raise ValueError(
                        f"traversal verification needs distinct sibling tokens: nodes {seen[tok[s + c]]} and {c} "
                        f"of request {r} (children of node {v}) are both token {tok[s + c]}"
                    )
                seen[tok[s + c]] = c
            if u_order is not None and len(ch) > 1:
                remaining = list(ch)
                placed = []
                for c_k in ch[:-1]:
                    j = _pick([q_children[s + c] for c in remaining], u_order[r][c_k])
                    placed.append(remaining.pop(j))
                children[v] = placed + remaining

        def first_leaf_path(x: int) -> list[int]:
            path = [x]
            while children[x]:
                x = children[x][0]
                path.append(x)
            return path

        order: list[int] = []
        stack = [(0, False)]
        while stack:
            x, expanded = stack.pop()
            if expanded:
                order.append(x)
            else:
                stack.append((x, True))
                stack.extend((c, False) for c in reversed(children[x]))
        to_enter = first_leaf_path(0)
        for t, v in enumerate(order):
            visits[r, t] = s + v
            for x in to_enter:
                enter[r, t, dep[s + x]] = s + x
            to_enter = []
            if v != 0:
                sib = children[par[s + v]]
                k = sib.index(v)
                if k + 1 < len(sib):
                    to_enter = first_leaf_path(sib[k + 1])
    entered = (enter >= 0).any(dim=0)  # [N, Dmax + 1]
    depths_per_visit = [torch.nonzero(row).squeeze(1).tolist() for row in entered]
    dev = trees.tokens.device
    return visits.to(dev), enter.to(dev), depths_per_visit


def _sibling_softmax(trees: TreeBatch) -> Tensor:
    """[T] float64: softmax of draft_logprobs over each node's siblings (0 at the roots)."""
    dl = trees.draft_logprobs.to(torch.float64)
    gp = trees.global_parents()
    nonroot = gp >= 0
    key = gp.clamp(min=0)
    neg_inf = torch.full((trees.num_nodes,), float("-inf"), dtype=torch.float64, device=dl.device)
    group_max = neg_inf.scatter_reduce(0, key[nonroot], dl[nonroot], reduce="amax")
    e = torch.where(nonroot, torch.exp(dl - group_max[key]), torch.zeros_like(dl))
    group_sum = torch.zeros_like(dl).scatter_add(0, key, e)
    return torch.where(nonroot, e / group_sum[key], torch.zeros_like(dl))


def verify_traversal(
    probs: Tensor,
    trees: TreeBatch,
    draft_probs: Tensor | None = None,
    generator: Generators = None,
    uniforms: Tensor | None = None,
) -> AcceptResult:
    """Traversal Verification (module docstring) of a ragged batch.

    probs: [T, V] processed target probabilities at every node (row i = p(. | root..i)).
    trees: the ragged batch; needs ``draft_logprobs`` when ``draft_probs`` is None.
    draft_probs: [T, V] or None, row i = the drafter's distribution q_i that node i's children were
        drawn from without replacement (rows of leaves are not read).
    generator / uniforms: randomness; uniforms [R, traversal_uniform_width(trees)] (layout in the
        module docstring) take precedence.
    Math in float64 if probs is float64, else float32.
    """
    if probs.dim() != 2 or probs.shape[0] != trees.num_nodes:
        raise ValueError(f"probs must be [T={trees.num_nodes}, V], got shape {tuple(probs.shape)}")
    num_nodes, vocab = probs.shape
    num_req = trees.num_requests
    device = probs.device
    dtype = torch.float64 if probs.dtype == torch.float64 else torch.float32
    width_nodes = int(trees.cu_nodes.diff().max())
    width = 1 + 2 * width_nodes
    if uniforms is None:
        u = draw_uniforms(num_req, width, device, generator)
    else:
        u = check_uniforms(uniforms, num_req, width, "verify_traversal").to(device)
    gp = trees.global_parents()
    nonroot = gp >= 0
    if draft_probs is None:
        if trees.draft_logprobs is None:
            raise ValueError("verify_traversal needs draft_probs or trees.draft_logprobs (log q(node | parent))")
        q_child = _sibling_softmax(trees)
        q_rows = torch.zeros(num_nodes, vocab, dtype=dtype, device=device)
        q_rows[gp[nonroot], trees.tokens[nonroot]] = q_child[nonroot].to(dtype)
        visits, enter, depths_per_visit = _visit_plan(trees, q_child.tolist(), u.cpu(), width_nodes)
    else:
        if tuple(draft_probs.shape) != (num_nodes, vocab):
            raise ValueError(f"draft_probs must be [{num_nodes}, {vocab}] like probs, got {tuple(draft_probs.shape)}")
        q_rows = draft_probs.to(dtype)
        q_own = q_rows[gp.clamp(min=0), trees.tokens]
        bad = nonroot & ~(q_own > 0)
        if bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            raise ValueError(
                f"node {i} (flat index) has token {int(trees.tokens[i])} with draft probability 0 under its "
                "parent's draft_probs row: it cannot have been drawn from q"
            )
        visits, enter, depths_per_visit = _visit_plan(trees, None, u, width_nodes)

    p_rows = probs.to(dtype)
    dmax = enter.shape[2] - 1
    rows = torch.arange(num_req, device=device)
    alpha = torch.zeros(num_req, dmax + 1, dtype=dtype, device=device)
    p_stack = torch.zeros(num_req, dmax + 1, vocab, dtype=dtype, device=device)
    q_stack = torch.zeros_like(p_stack)
    alive = torch.ones(num_req, dtype=torch.bool, device=device)
    last = trees.cu_nodes[:-1].clone()

    for t in range(width_nodes):
        # enter the nodes on the path to the next visit, top-down (their parents are final now)
        for d in depths_per_visit[t]:
            node = enter[:, t, d]
            m = (node >= 0) & alive
            nd = node.clamp(min=0)
            if d == 0:
                a_new = torch.ones(num_req, dtype=dtype, device=device)
            else:
                tk = trees.tokens[nd].unsqueeze(1)
                pp = p_stack[:, d - 1].gather(1, tk).squeeze(1)
                qq = q_stack[:, d - 1].gather(1, tk).squeeze(1)
                num = alpha[:, d - 1] * pp
                a_new = torch.where(qq > 0, (num / torch.where(qq > 0, qq, 1.0)).clamp(max=1.0), (num > 0).to(dtype))
            alpha[:, d] = torch.where(m, a_new, alpha[:, d])
            p_stack[:, d] = torch.where(m.unsqueeze(1), p_rows[nd], p_stack[:, d])
            q_stack[:, d] = torch.where(m.unsqueeze(1), q_rows[nd], q_stack[:, d])
        # visit: accept the path root..v with probability alpha_v
        v = visits[:, t]
        active = alive & (v >= 0)
        vd = v.clamp(min=0)
        dv = trees.depth[vd]
        accept = active & (u[:, 1 + t] < alpha[rows, dv].to(torch.float64))
        last = torch.where(accept, vd, last)
        alive = alive & ~accept
        # reject: remove v, update its parent's (alpha, p, q)
        reject = active & ~accept & (dv > 0)
        dw = (dv - 1).clamp(min=0)
        a_w, p_w, q_w = alpha[rows, dw], p_stack[rows, dw], q_stack[rows, dw]
        residual = (a_w.unsqueeze(1) * p_w - q_w).clamp(min=0)
        mass = residual.sum(dim=1)
        p_new = torch.where((mass > 0).unsqueeze(1), residual / torch.where(mass > 0, mass, 1.0).unsqueeze(1), p_w)
        q_new = q_w.scatter(1, trees.tokens[vd].unsqueeze(1), 0.0)
        q_sum = q_new.sum(dim=1, keepdim=True)
        q_new = torch.where(q_sum > 0, q_new / torch.where(q_sum > 0, q_sum, 1.0), q_new)
        a_new = torch.where(a_w >= 1, torch.ones_like(a_w), mass / (mass + 1 - a_w))
        alpha[rows, dw] = torch.where(reject, a_new, a_w)
        p_stack[rows, dw] = torch.where(reject.unsqueeze(1), p_new, p_w)
        q_stack[rows, dw] = torch.where(reject.unsqueeze(1), q_new, q_w)

    bonus = inverse_cdf(p_stack[rows, trees.depth[last]], u[:, 0])
    return accept_result_from_last_node(trees, last, bonus)


def sample_tree_from_draft(
    draft: Callable[[tuple[int, ...]], Tensor],
    root_token: int,
    branching: Sequence[int],
    generator: torch.Generator | None = None,
    uniforms: Tensor | None = None,
) -> tuple[Tree, Tensor]:
    """Draw a tree by the process verify_traversal assumes (children without replacement from q).

    draft: prefix (tokens root..v, a tuple) -> q_v, a [V] probability tensor.
    branching: branching[d] = number of children of every node at depth d (capped by the number of
        tokens with q_v > 0); the tree has depth len(branching).
    Nodes are created breadth-first; the k-th created non-root node consumes ``uniforms[k]`` (1-D,
    float in [0, 1); else drawn from ``generator``): an inverse CDF, in token-id order, over q_v
    with the parent's already-drawn children removed.
    Returns the Tree (``draft_logprobs`` = log q_parent(token), root 0) and draft_probs [n, V]
    (row v = q_v for nodes above depth len(branching) and the root, zeros for the deepest nodes).
    """
    tokens, parents, logq, rows = [root_token], [-1], [0.0], []
    depth = [0]
    prefixes = [(root_token,)]
    draws = 0
    v = 0
    while v < len(tokens):
        if depth[v] < len(branching) or v == 0:
            q = draft(prefixes[v]).to(torch.float64)
            rows.append(q)
            weights = q.tolist()
            k = branching[depth[v]] if depth[v] < len(branching) else 0
            for _ in range(min(k, sum(w > 0 for w in weights))):
                if uniforms is not None:
                    if draws >= uniforms.numel():
                        raise ValueError(f"sample_tree_from_draft needs more than {uniforms.numel()} uniforms")
                    u = float(uniforms[draws])
                else:
                    u = float(torch.rand((), dtype=torch.float64, generator=generator))
                draws += 1
                x = _pick(weights, u)
                tokens.append(x)
                parents.append(v)
                depth.append(depth[v] + 1)
                logq.append(math.log(float(q[x])))
                prefixes.append(prefixes[v] + (x,))
                weights[x] = 0.0
        else:
            rows.append(None)
        v += 1
    vocab = rows[0].numel()
    draft_probs = torch.stack([r if r is not None else torch.zeros(vocab, dtype=torch.float64) for r in rows])
    tree = Tree.from_parents(tokens, parents, draft_logprobs=torch.tensor(logq, dtype=torch.float64))
    return tree, draft_probs
