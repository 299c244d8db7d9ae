"""Acceptance by replay: the speculative decoder's accepted lengths from the target's own continuation.

Running :class:`~vllm_tfm.reference.decoder.SpeculativeDecoder` for every (method, budget,
temperature) cell costs one tree-verify pass of the target per step and one request at a time. The
numbers it reports can be had without the verifier:

* **Greedy.** Whatever the drafter proposes, the tokens a greedy speculative decoder emits are the
  target's greedy continuation ``c`` (the verifier only decides how many arrive per step). A step
  whose root sits at position ``a`` accepts the deepest tree node whose root..node path spells
  ``c[a + 1], ..., c[a + d]``; it emits ``d + 1`` tokens and the next root sits at ``a + d + 1``.
* **Sampling with target-only tree acceptance** (the decoder's default, ``acceptance="target_only"``):
  at every accepted node the decoder draws the next token from the target's distribution given the
  emitted prefix and moves to the child holding it, if any; so the emitted sequence is an ancestral
  sample of the target, and the accepted path is the tree's longest path along that sample. Drawing
  the sample first and reading each step's path off it gives the same joint law of (tokens,
  accepted counts). This does not hold for traversal verification, which accepts differently.

The proposer sees what the decoder would give it at root position ``a``: the DFlash context = the
target's tapped hidden states of positions ``< a``, the root ``c[a]``, the verifier hidden = the
target's final hidden state at ``a - 1``. Here they come from one causal forward over prompt +
continuation instead of the decoder's prefill and incremental tree passes: the same values up to
floating-point rounding (a near-tie between two drafter scores can flip a tree; the tests compare
replay and decoder cell by cell on CPU). Steps are run in lockstep over all prompts, so the DFlash
forward is one batched call per round.

Stopping rule (as the decoder's): the first token comes from the prefill; steps run while fewer than
``max_new_tokens`` tokens have been emitted; every step's full accepted count is recorded.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from vllm_tfm.models import DrafterBundle, drafter_logits
from vllm_tfm.models.proposal_trees import treeflash_padded_trees, weaver_padded_trees
from vllm_tfm.tree.marginal_padded import ddtree_trees
from vllm_tfm.tree.types import Tree
from vllm_tfm.tree.weaver import default_weaver_width

from .drafters import DFlashProposer, DraftInputs, ProposalBias, make_proposer
from .hf_compat import capture_final_hidden, capture_layer_outputs

__all__ = [
    "acceptance_record",
    "accepted_depth",
    "accepted_depths_padded",
    "batched_trees",
    "replay_cell",
    "replay_cells",
    "target_continuations",
    "target_states",
]


def acceptance_record(
    method: str,
    budget: int,
    temperature: float,
    max_depth: int,
    accepted: list[list[int]],
    nodes: list[list[int]],
    tokens: int,
    seconds: float,
    **extra: Any,
) -> dict[str, Any]:
    """One acceptance cell of ``vllm-tfm eval`` from per-prompt, per-step accepted counts: steps,
    MAL = mean(accepted + 1), acceptance by depth d = fraction of steps with accepted >= d."""
    flat = [a for per in accepted for a in per]
    n = len(flat)
    return {
        "method": method,
        "budget": budget,
        "temperature": temperature,
        **extra,
        "steps": n,
        "mal": (sum(a + 1 for a in flat) / n) if n else float("nan"),
        "acceptance_by_depth": [sum(a >= d for a in flat) / n if n else float("nan") for d in range(1, max_depth + 1)],
        "max_depth": max_depth,
        "tokens": tokens,
        "seconds": seconds,
        "accepted_per_step": accepted,
        "tree_nodes_per_step": nodes,
    }


@torch.no_grad()
def target_continuations(
    target: nn.Module,
    prompts: Sequence[Sequence[int]],
    new_tokens: int,
    temperature: float,
    seed: int,
    batch_size: int = 128,
) -> Tensor:
    """[P, prompt_len + new_tokens]: each prompt followed by the target's continuation.

    Greedy (argmax, lowest id on ties) when ``temperature`` < 1e-5, otherwise ancestral samples of
    softmax(logits / temperature) with one ``torch.Generator(seed + prompt index)`` per prompt (so a
    prompt's sample does not depend on the batch it ran in). All prompts must have the same length.
    End-of-text tokens do not stop a continuation. Runs the target incrementally with its cache.
    """
    lengths = {len(p) for p in prompts}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(f"prompts must be non-empty and of one length, got lengths {sorted(lengths)}")
    if new_tokens < 1:
        raise ValueError(f"new_tokens must be >= 1, got {new_tokens}")
    device = next(target.parameters()).device
    greedy = temperature < 1e-5
    # transformers renamed the cache argument and output field (past_key_values -> cache) in 5.2x
    cache_kw = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    out = []
    for b0 in range(0, len(prompts), batch_size):
        ids = torch.tensor([list(p) for p in prompts[b0 : b0 + batch_size]], dtype=torch.long, device=device)
        gens = [torch.Generator(device=device).manual_seed(seed + b0 + i) for i in range(ids.shape[0])]
        res = target(input_ids=ids, use_cache=True)
        past, logits = getattr(res, cache_kw), res.logits[:, -1]
        new = []
        for step in range(new_tokens):
            logits = logits.float()
            if greedy:
                tok = logits.argmax(-1)
            else:
                probs = torch.softmax(logits / temperature, dim=-1)
                tok = torch.cat([torch.multinomial(probs[i], 1, generator=g) for i, g in enumerate(gens)])
            new.append(tok)
            if step + 1 == new_tokens:
                break
            res = target(input_ids=tok[:, None], use_cache=True, **{cache_kw: past})
            past, logits = getattr(res, cache_kw), res.logits[:, -1]
        out.append(torch.cat([ids, torch.stack(new, dim=1)], dim=1))
    return torch.cat(out)


@torch.no_grad()
def target_states(target: nn.Module, ids: Tensor, taps: Sequence[int], batch_size: int = 32) -> tuple[Tensor, Tensor]:
    """(final hidden [P, L, H], tapped hidden [P, L, n_tap * H]) of causal forwards over ids [P, L]."""
    finals, tapped = [], []
    for b0 in range(0, ids.shape[0], batch_size):
        chunk = ids[b0 : b0 + batch_size]
        with capture_layer_outputs(target, list(taps)) as cap, capture_final_hidden(target) as fin:
            target(input_ids=chunk, use_cache=False)
        finals.append(fin["final"])
        tapped.append(torch.cat([cap[t] for t in taps], dim=-1))
    return torch.cat(finals), torch.cat(tapped)


def accepted_depth(tree: Tree, continuation: Sequence[int]) -> int:
    """Depth of the deepest node whose root..node path spells ``continuation[0 : depth]``.

    ``continuation[d - 1]`` is the token the target emits at depth d below the root."""
    tokens = tree.tokens.tolist()
    parents = tree.parents.tolist()
    depth = [0] * len(tokens)
    ok = [True] + [False] * (len(tokens) - 1)
    best = 0
    for j in range(1, len(tokens)):  # topological order: a parent precedes its children
        p = parents[j]
        depth[j] = depth[p] + 1
        d = depth[j]
        if ok[p] and d <= len(continuation) and tokens[j] == continuation[d - 1]:
            ok[j] = True
            best = max(best, d)
    return best


def accepted_depths_padded(tokens: Tensor, parents: Tensor, num_nodes: Tensor, continuation: Tensor) -> Tensor:
    """:func:`accepted_depth` for R padded trees at once: tokens / parents [R, N] (node 0 the root,
    nodes in topological order, columns >= num_nodes [R] ignored), continuation [R, D] -> [R]."""
    n = tokens.shape[1]
    dmax = continuation.shape[1]
    dev = tokens.device
    valid = torch.arange(n, device=dev)[None, :] < num_nodes[:, None]
    par = parents.clamp(min=0)
    depth = torch.zeros_like(tokens)
    for _ in range(n - 1):  # depth of a node = depth of its parent + 1; stops changing after max depth rounds
        nxt = torch.where(parents >= 0, depth.gather(1, par) + 1, 0)
        if torch.equal(nxt, depth):
            break
        depth = nxt
    want = continuation.gather(1, (depth - 1).clamp(0, dmax - 1))
    match = valid & (depth >= 1) & (depth <= dmax) & (tokens == want)
    ok = torch.zeros_like(match)
    ok[:, 0] = True
    for d in range(1, int(depth.max()) + 1):
        ok = ok | (match & (depth == d) & ok.gather(1, par))
    return (depth * ok).amax(dim=1)


@torch.no_grad()
def batched_trees(
    proposer: DFlashProposer,
    prenorm: Tensor,
    roots: Tensor,
    verifier_hidden: Tensor,
    budget: int,
    bias: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The trees :meth:`DFlashProposer.tree_from_block` builds, for R anchors in one batch.

    prenorm [R, gamma, H] (DFlash residual streams), roots [R], verifier_hidden [R, H], bias
    [R, D, V] or None (added to the marginal logits, as ``proposal_bias``). Returns tokens and
    parents [R, N] (node 0 = root, the builder's node order, N = the largest tree) and num_nodes
    [R]. Uses the lockstep builders (``vllm_tfm.tree.marginal_padded``, ``build_weaver_padded``,
    ``build_treeflash_padded``), which give each request the per-request builder's tree.
    """
    drafter = proposer.drafter
    hidden = drafter.norm(prenorm)
    logits = drafter_logits(drafter, hidden, proposer.lm_head)
    logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    if bias is not None:
        if proposer.method == "treeflash":
            raise ValueError("batched TreeFlash trees take no proposal bias (use the per-anchor path)")
        logits = logits + bias.to(logits)
    r, d, _ = logits.shape
    dev = logits.device
    method = proposer.method
    if method == "chain":
        n = min(d, budget)
        tokens = torch.cat([roots[:, None], logits.argmax(-1)[:, :n]], dim=1)
        parents = torch.arange(-1, n, device=dev).expand(r, n + 1)
        return tokens, parents, torch.full((r,), n + 1, dtype=torch.long, device=dev)
    if method == "ddtree":
        draft, parents, num_nodes = ddtree_trees(torch.log_softmax(logits, -1), budget)
        return torch.cat([roots[:, None], draft], dim=1), parents, num_nodes
    if method == "treeflash":
        trees = treeflash_padded_trees(
            proposer.treeflash, drafter.norm, prenorm, torch.log_softmax(logits, -1), roots,
            proposer.embed, proposer.lm_head, budget, d, proposer.top_m,
        )
        return trees.tokens, trees.parents, trees.num_nodes
    width = proposer.width if proposer.width is not None else default_weaver_width(budget)
    trees, _ = weaver_padded_trees(
        proposer.weaver, logits, hidden[:, 1:], verifier_hidden.to(proposer.dtype), roots,
        proposer.embed, proposer.lm_head, budget, proposer.top_k, width, proposer.children_per_node,
    )
    return trees.tokens, trees.parents, trees.num_nodes


@torch.no_grad()
def replay_cell(
    proposer: DFlashProposer,
    budget: int,
    ids: Tensor,
    final: Tensor,
    taps: Tensor,
    prompt_len: int,
    max_new_tokens: int,
    batched: bool = True,
) -> dict[str, Any]:
    """Accepted counts per step of every prompt for one (proposer, budget) over continuations ``ids``.

    ``batched``: build the round's trees with :func:`batched_trees` (one call for all live prompts)
    instead of one :meth:`DFlashProposer.tree_from_block` per prompt (used anyway for TreeFlash
    with a proposal bias).

    ids [P, L] (prompt + continuation, L >= prompt_len + max_new_tokens + max_depth - 1), final /
    taps: :func:`target_states` of ids. Returns {"accepted_per_step": [[int]], "tree_nodes_per_step":
    [[int]], "seconds": float}.
    """
    n_prompts, length = ids.shape
    depth = proposer.max_depth
    if length < prompt_len + max_new_tokens + depth - 1:
        raise ValueError(f"continuations of {length} tokens are too short for {max_new_tokens} new tokens at depth {depth}")
    drafter, gamma = proposer.drafter, proposer.gamma
    device = ids.device
    t0 = time.perf_counter()
    positions = torch.arange(length, device=device)
    ctx_all = [drafter.context_kv(taps[i].to(proposer.dtype), positions) for i in range(n_prompts)]
    ids_host = ids.tolist()
    pos = [prompt_len] * n_prompts  # root position of each prompt's next step
    emitted = [1] * n_prompts  # the prefill's token
    accepted: list[list[int]] = [[] for _ in range(n_prompts)]
    nodes: list[list[int]] = [[] for _ in range(n_prompts)]
    while True:
        live = [i for i in range(n_prompts) if emitted[i] < max_new_tokens]
        if not live:
            break
        ctx = [
            (torch.cat([ctx_all[i][layer][0][: pos[i]] for i in live]), torch.cat([ctx_all[i][layer][1][: pos[i]] for i in live]))
            for layer in range(len(ctx_all[0]))
        ]
        cu = torch.tensor([0] + [pos[i] for i in live], dtype=torch.long, device=device).cumsum(0)
        roots = torch.tensor([ids_host[i][pos[i]] for i in live], device=device)
        block = drafter.block_tokens(roots)[:, :gamma]
        blk_pos = torch.tensor(pos, device=device)[live][:, None] + torch.arange(gamma, device=device)
        prenorm = drafter.forward_batch_prenorm(ctx, cu, block, blk_pos, proposer.embed)
        inputs = [
            DraftInputs(root=ids_host[i][pos[i]], position=pos[i], verifier_hidden=final[i, pos[i] - 1], tokens=ids[i, : pos[i] + 1])
            for i in live
        ]
        if batched and not (proposer.method == "treeflash" and proposer.proposal_bias is not None):
            bias = None
            if proposer.proposal_bias is not None:
                bias = torch.stack([proposer.proposal_bias(x, depth) for x in inputs]).to(device)
            vh = torch.stack([x.verifier_hidden for x in inputs])
            tokens, parents, num_nodes = batched_trees(proposer, prenorm, roots, vh, budget, bias)
            cont = torch.stack([ids[i, pos[i] + 1 : pos[i] + 1 + depth] for i in live])
            got = accepted_depths_padded(tokens, parents, num_nodes, cont).tolist()
            sizes = num_nodes.tolist()
        else:
            got, sizes = [], []
            for r, (i, x) in enumerate(zip(live, inputs)):
                tree = proposer.tree_from_block(x, prenorm[r], budget)
                got.append(accepted_depth(tree, ids_host[i][pos[i] + 1 : pos[i] + 1 + depth]))
                sizes.append(tree.num_nodes)
        for i, d, n in zip(live, got, sizes):
            accepted[i].append(int(d))
            nodes[i].append(int(n))
            emitted[i] += d + 1
            pos[i] += d + 1
    return {"accepted_per_step": accepted, "tree_nodes_per_step": nodes, "seconds": time.perf_counter() - t0}


def replay_cells(
    target: nn.Module,
    bundle: DrafterBundle,
    windows: Sequence[Sequence[int]],
    prompt_len: int,
    methods: Sequence[str],
    budgets: Sequence[int],
    temperatures: Sequence[float],
    max_new_tokens: int,
    seed: int = 0,
    gamma: int | None = None,
    proposal_bias: ProposalBias | None = None,
    progress: Callable[[str], None] | None = None,
    deadline: float | None = None,
    skipped: list[dict[str, Any]] | None = None,
    width: int | None = None,
) -> list[dict[str, Any]]:
    """One record per (method, budget, temperature), in the layout of ``evaluate.acceptance_cells``
    (plus ``"mode": "replay"``): MAL, acceptance by depth, per-step counts.

    ``width``: the TfM Weaver's nodes per scorer call for every budget (None: the drafter's
    ``tfm_config.json`` width, else ``default_weaver_width(B)``).

    ``deadline`` (a ``time.monotonic()`` instant): cells are run budget 64 first (the budget of the
    project's goals), then the others in increasing order, and a cell that would start after the
    deadline is not run; it is appended to ``skipped`` ({"method", "budget", "temperature"}).
    The records come back in (method, budget, temperature) order whatever the run order."""
    prompts = [list(w[:prompt_len]) for w in windows]
    probe = make_proposer(methods[0], bundle, target, gamma=gamma, proposal_bias=proposal_bias)
    depth = probe.max_depth
    taps_ids = tuple(bundle.dflash.config.target_layer_ids)
    states = {}
    for temp in temperatures:
        t0 = time.perf_counter()
        ids = target_continuations(target, prompts, max_new_tokens + depth, temp, seed)
        final, taps = target_states(target, ids, taps_ids)
        states[temp] = (ids, final, taps)
        if progress is not None:
            progress(f"T={temp:g}: {len(prompts)} continuations of {max_new_tokens + depth} tokens in {time.perf_counter() - t0:.1f} s")
    canonical = [(t, m, b) for m in methods for b in budgets for t in temperatures]
    order = sorted(canonical, key=lambda c: (c[2] != 64, c[2], c[0], methods.index(c[1])))
    done: dict[tuple[float, str, int], dict[str, Any]] = {}
    for temp, method, budget in order:
        if deadline is not None and time.monotonic() > deadline:
            if skipped is not None:
                skipped.append({"method": method, "budget": budget, "temperature": temp, "reason": "time budget"})
            if progress is not None:
                progress(f"{method:<10} B={budget:<4} T={temp:g}: skipped (time budget)")
            continue
        ids, final, taps = states[temp]
        proposer = make_proposer(method, bundle, target, gamma=gamma, proposal_bias=proposal_bias,
                                 width=width)
        rec = replay_cell(proposer, budget, ids, final, taps, prompt_len, max_new_tokens)
        per_prompt = rec["accepted_per_step"]
        done[(temp, method, budget)] = acceptance_record(
            method, budget, temp, depth, per_prompt, rec["tree_nodes_per_step"],
            tokens=sum(min(sum(a + 1 for a in per) + 1, max_new_tokens) for per in per_prompt),
            seconds=rec["seconds"], mode="replay",
        )
        if progress is not None:
            c = done[(temp, method, budget)]
            progress(f"{method:<10} B={budget:<4} T={temp:g}: MAL {c['mal']:.3f} over {c['steps']} steps ({c['seconds']:.1f} s)")
    return [done[c] for c in canonical if c in done]
