"""The tree sampler and the commit of one decode step as they were before the host-work rewrite
(``vllm_tfm/verify/{sampling,accept_result,tree_children,uniforms,acceptance_replay}.py`` and
``vllm_tfm/vllm_plugin/runtime/{sampler,commit,hooks}.py`` at commit 7f4b9f6), frozen here as a
regression oracle: the current code must give the same accepted paths, output tokens, K/V caches
and GDN states bit for bit. Not imported by the package. ``bench/step_ops.py --impl before`` runs
it to count the previous host work.

Shared with the current code (not part of the rewrite): ``process_logits``, the traversal
verifier, the GDN kernels and references, the step metadata (``StepTree.dev``) and metrics."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from torch import Tensor

from vllm_tfm.tree.types import TreeBatch
from vllm_tfm.verify.accept_result import AcceptResult
from vllm_tfm.verify.logits_processing import TreeSamplingParams, process_logits
from vllm_tfm.verify.traversal import verify_traversal
from vllm_tfm.verify.uniforms import Generators, check_uniforms, draw_uniforms

# ---------------------------------------------------------------------------------------------
# vllm_tfm/verify


def child_table_before(trees: TreeBatch) -> Tensor:
    num_nodes = trees.num_nodes
    device = trees.tokens.device
    gparents = trees.global_parents()
    child = torch.nonzero(gparents >= 0).squeeze(1)
    parent = gparents[child]
    counts = torch.bincount(parent, minlength=num_nodes)
    cmax = max(int(counts.max()) if child.numel() else 0, 1)
    order = torch.argsort(parent, stable=True)
    parent, child = parent[order], child[order]
    slot = torch.arange(child.numel(), device=device) - (counts.cumsum(0) - counts)[parent]
    table = torch.full((num_nodes, cmax), -1, dtype=torch.long, device=device)
    table[parent, slot] = child
    return table


def first_occurrence_before(tokens: Tensor, valid: Tensor) -> Tensor:
    same = tokens.unsqueeze(2) == tokens.unsqueeze(1)
    earlier = torch.ones(tokens.shape[1], tokens.shape[1], dtype=torch.bool, device=tokens.device).tril(-1)
    dup = (same & earlier & valid.unsqueeze(1) & valid.unsqueeze(2)).any(dim=2)
    return valid & ~dup


def inverse_cdf_before(weights: Tensor, u: Tensor) -> Tensor:
    w = weights.to(torch.float64)
    cum = w.cumsum(dim=1)
    k = (cum <= (u.to(torch.float64) * cum[:, -1]).unsqueeze(1)).sum(dim=1)
    idx = torch.arange(w.shape[1], device=w.device)
    last_positive = torch.where(w > 0, idx, torch.zeros_like(idx)).amax(dim=1)
    return torch.where(k >= w.shape[1], last_positive, k)


def accept_result_from_last_node_before(trees: TreeBatch, last_global: Tensor, bonus: Tensor) -> AcceptResult:
    num_req = trees.num_requests
    dmax = int(trees.depth.max())
    device = trees.tokens.device
    starts = trees.cu_nodes[:-1]
    gparents = trees.global_parents()
    rows = torch.arange(num_req, device=device)
    num_accepted = trees.depth[last_global]
    accepted = torch.full((num_req, max(dmax, 1)), -1, dtype=torch.long, device=device)
    tokens_out = torch.full((num_req, dmax + 1), -1, dtype=torch.long, device=device)
    cur = last_global
    for _ in range(dmax):
        d = trees.depth[cur]
        on_path = d > 0
        col = (d - 1).clamp(min=0)
        accepted[rows, col] = torch.where(on_path, cur - starts, accepted[rows, col])
        tokens_out[rows, col] = torch.where(on_path, trees.tokens[cur], tokens_out[rows, col])
        cur = torch.where(on_path, gparents[cur], cur)
    tokens_out[rows, num_accepted] = bonus
    return AcceptResult(accepted[:, :dmax], num_accepted, last_global - starts, bonus, tokens_out)


def verify_greedy_before(logits: Tensor, trees: TreeBatch) -> AcceptResult:
    target = logits.argmax(dim=-1)
    table = child_table_before(trees)
    child_tokens = torch.where(table >= 0, trees.tokens[table.clamp(min=0)], -1)
    cur = trees.cu_nodes[:-1].clone()
    for _ in range(int(trees.depth.max())):
        match = child_tokens[cur] == target[cur].unsqueeze(1)
        found = match.any(dim=1)
        first = match.long().argmax(dim=1)
        cur = torch.where(found, table[cur, first], cur)
    return accept_result_from_last_node_before(trees, cur, target[cur])


def verify_target_only_before(
    probs: Tensor, trees: TreeBatch, generator: Generators = None, uniforms: Tensor | None = None
) -> AcceptResult:
    num_req = trees.num_requests
    dmax = int(trees.depth.max())
    if uniforms is None:
        u = draw_uniforms(num_req, dmax + 1, probs.device, generator)
    else:
        u = check_uniforms(uniforms, num_req, dmax + 1, "verify_target_only").to(probs.device)
    table = child_table_before(trees)
    num_slots = table.shape[1]
    rows = torch.arange(num_req, device=probs.device)
    cur = trees.cu_nodes[:-1].clone()
    done = torch.zeros(num_req, dtype=torch.bool, device=probs.device)
    bonus = torch.full((num_req,), -1, dtype=torch.long, device=probs.device)
    for d in range(dmax + 1):
        p = probs[cur].to(torch.float64)
        children = table[cur]
        valid = children >= 0
        tok = torch.where(valid, trees.tokens[children.clamp(min=0)], 0)
        counted = first_occurrence_before(tok, valid)
        w_children = torch.where(counted, p.gather(1, tok), 0.0)
        is_child = torch.zeros_like(p, dtype=torch.int32).scatter_add_(1, tok, valid.to(torch.int32)) > 0
        w_rest = torch.where(is_child, 0.0, p)
        k = inverse_cdf_before(torch.cat([w_children, w_rest], dim=1), u[:, d])
        to_child = k < num_slots
        live = ~done
        bonus = torch.where(live & ~to_child, k - num_slots, bonus)
        nxt = children[rows, k.clamp(max=num_slots - 1)]
        cur = torch.where(live & to_child, nxt, cur)
        done = done | ~to_child
    return accept_result_from_last_node_before(trees, cur, bonus)


def verify_tree_before(
    logits: Tensor,
    trees: TreeBatch,
    params: TreeSamplingParams,
    method: str = "target_only",
    generator: Generators = None,
    uniforms: Tensor | None = None,
    draft_probs: Tensor | None = None,
) -> AcceptResult:
    greedy_rows = params.greedy_mask().to(logits.device)
    greedy = verify_greedy_before(logits, trees)
    if bool(greedy_rows.all()):
        return greedy
    probs = process_logits(logits, params, trees.cu_nodes)
    if method == "target_only":
        sampled = verify_target_only_before(probs, trees, generator, uniforms)
    else:
        sampled = verify_traversal(probs, trees, draft_probs, generator, uniforms)
    return greedy.select(greedy_rows, sampled)


def deepest_nodes_before(trees: TreeBatch) -> Tensor:
    n = trees.num_nodes
    req = trees.request_index()
    idx = torch.arange(n, device=trees.depth.device)
    key = trees.depth * (n + 1) + (n - idx)
    best = torch.full((trees.num_requests,), -1, dtype=torch.long, device=key.device)
    best = best.scatter_reduce(0, req, key, reduce="amax", include_self=True)
    return n - best.remainder(n + 1)


def replay_accept_before(trees: TreeBatch, logits: Tensor, uniforms: Tensor, cdf: Tensor) -> tuple[AcceptResult, Tensor, Tensor]:
    """(result, drawn, clamped) of the previous ``replay_accept``."""
    k = torch.searchsorted(cdf, uniforms.to(cdf.device).to(cdf.dtype), right=True)
    drawn = k.clamp(max=cdf.numel() - 1).to(torch.long).to(trees.depth.device)
    deepest = deepest_nodes_before(trees)
    tree_depth = trees.depth[deepest]
    want = torch.minimum(drawn, tree_depth)
    gparents = trees.global_parents()
    cur = deepest
    for _ in range(int(tree_depth.max())):
        cur = torch.where(trees.depth[cur] > want, gparents[cur], cur)
    bonus = logits[cur].argmax(dim=-1).to(torch.long)
    return accept_result_from_last_node_before(trees, cur, bonus), drawn, drawn > tree_depth


# ---------------------------------------------------------------------------------------------
# vllm_tfm/vllm_plugin/runtime: sampler


def tree_sampling_params_before(temperature, top_k, top_p, min_p, device) -> TreeSamplingParams:
    f = lambda a: None if a is None else torch.as_tensor(np.asarray(a, dtype=np.float64), device=device)
    k = None if top_k is None else torch.as_tensor(np.asarray(top_k, dtype=np.int64), device=device)
    return TreeSamplingParams(f(temperature), k, f(top_p), f(min_p))


def sample_trees_before(step: Any, draft_token_ids: Tensor) -> TreeBatch:
    parents = step.dev("sample_parents")
    nonroot = parents >= 0
    tokens = torch.zeros(parents.shape[0], dtype=torch.long, device=parents.device)
    tokens[nonroot] = draft_token_ids.to(torch.long)
    return TreeBatch(tokens, parents, step.dev("sample_depth"), step.dev("sample_cu"))


def output_token_ids_before(result: AcceptResult, max_spec_len: int) -> Tensor:
    r, w = result.output_tokens.shape
    out = torch.full((r, max_spec_len + 1), -1, dtype=torch.int32, device=result.output_tokens.device)
    out[:, :w] = result.output_tokens.to(torch.int32)
    return out


def replayer_accept_before(replayer: Any, trees: TreeBatch, logits: Tensor, verified: AcceptResult, is_spec: Tensor) -> AcceptResult:
    """``AcceptanceReplayer.accept`` as it was (same generator and counters)."""
    u = torch.rand(trees.num_requests, generator=replayer.generator, device=replayer.device, dtype=torch.float64)
    result, drawn, clamped = replay_accept_before(trees, logits, u, replayer.cdf)
    spec = is_spec.to(drawn.device)
    ones = spec.to(torch.long)
    replayer._drawn.index_add_(0, drawn.clamp(max=replayer.depth), ones)
    replayer._realised.index_add_(0, result.num_accepted.clamp(max=replayer.depth), ones)
    replayer._clamped += (clamped & spec).sum()
    return result.select(spec, verified)


def sample_before(sampler: Any, metadata: Any, logits: Tensor, sampling_metadata: Any) -> Any:
    """``TFMTreeSampler.forward`` of a tree-active step as it was (checks, verify, replay, metrics)."""
    from vllm.v1.outputs import SamplerOutput

    from vllm_tfm.vllm_plugin.runtime.state import STATE

    step = STATE.step
    sampler._check(step, metadata, logits, sampling_metadata)
    batch = sampler._runner[0].input_batch
    r = step.num_reqs
    min_p = None
    for proc in sampling_metadata.logitsprocs.argmax_invariant:
        if hasattr(proc, "min_p_cpu") and getattr(proc, "min_p_count", 0) > 0:
            min_p = proc.min_p_cpu[:r]
    params = tree_sampling_params_before(
        batch.temperature_cpu[:r],
        None if sampling_metadata.top_k is None else batch.top_k_cpu[:r],
        None if sampling_metadata.top_p is None else batch.top_p_cpu[:r],
        min_p,
        logits.device,
    )
    trees = sample_trees_before(step, metadata.draft_token_ids)
    generators = sampling_metadata.generators or None
    result = verify_tree_before(logits, trees, params, method=sampler.method, generator=generators)
    if sampler.replay is not None:
        is_spec = torch.from_numpy(step.is_spec & (step.num_draft > 0)).to(logits.device)
        result = replayer_accept_before(sampler.replay, trees, logits, result, is_spec)
    step.accept = result
    if STATE.metrics is not None:
        STATE.metrics.record_accept(step, result)
    return SamplerOutput(sampled_token_ids=output_token_ids_before(result, metadata.max_spec_len), logprobs_tensors=None)


# ---------------------------------------------------------------------------------------------
# vllm_tfm/vllm_plugin/runtime: commit


def compaction_rows_before(row_base: Tensor, accepted_nodes: Tensor) -> tuple[Tensor, Tensor]:
    base = row_base.to(torch.long)[:, None]
    valid = accepted_nodes >= 0
    k = torch.arange(accepted_nodes.shape[1], device=accepted_nodes.device)[None, :]
    src = torch.where(valid, base + accepted_nodes, base)
    dst = torch.where(valid, base + 1 + k, base)
    return src.reshape(-1), dst.reshape(-1)


def compact_kv_before(kv_caches: list[Tensor], slot_mapping: Tensor, src_rows: Tensor, dst_rows: Tensor) -> None:
    if src_rows.numel() == 0:
        return
    src = slot_mapping[src_rows].to(torch.long)
    dst = slot_mapping[dst_rows].to(torch.long)
    for kv in kv_caches:
        bs = kv.shape[2]
        moved = kv[src // bs, :, src % bs]
        kv[dst // bs, :, dst % bs] = moved


def spec_accepted_before(step: Any, accept: AcceptResult) -> tuple[Tensor, Tensor]:
    idx = step.dev("spec_req_index")
    return accept.last_node.index_select(0, idx), accept.num_accepted.index_select(0, idx)


def commit_indices_before(kernels: Any, group: Any, last_node: Tensor, num_accepted: Tensor) -> Any:
    from vllm_tfm.kernels.plan import CommitIndices

    if group.commit is None:
        acc = last_node.to(device=kernels.device, dtype=torch.int32)
        p = num_accepted.to(device=kernels.device, dtype=torch.long)
        dst = group.slots.gather(1, p[:, None]).squeeze(1).to(torch.int32)
        zeros = torch.zeros_like(acc)
        conv = group.conv_slot
        group.commit = (
            CommitIndices(acc, group.read_slot.to(torch.int32), dst, zeros, zeros, None),
            CommitIndices(acc, conv, conv, group.start32, p.to(torch.int32), None),
        )
    return group.commit


def commit_gdn_layer_before(stash: Any, parents: Tensor, cu_nodes: Tensor, last_node: Tensor, num_accepted: Tensor,
                            kernels: Any = None) -> None:
    from vllm_tfm.kernels import conv as kconv
    from vllm_tfm.kernels import gdn as kgdn
    from vllm_tfm.vllm_plugin.runtime import commit as commit_mod

    group = None if kernels is None else kernels.group_of(stash.state_indices)
    if group is not None:
        gdn_idx, conv_idx = commit_indices_before(kernels, group, last_node, num_accepted)
        if kgdn.commit_unsupported_reason(stash.k, stash.delta, stash.ssm_state) is None:
            kgdn.gdn_tree_commit_planned(kernels.plan, stash.k, stash.g, stash.delta, gdn_idx, stash.ssm_state)
        else:
            commit_mod._commit_state_per_call(stash, parents, cu_nodes, last_node, num_accepted)
        if kconv.conv_unsupported_reason(stash.x, stash.conv_state, stash.width) is None:
            kconv.tree_conv_commit_planned(kernels.plan, stash.x, conv_idx, stash.conv_state, stash.width)
        else:
            commit_mod._commit_window_per_call(stash, parents, cu_nodes, last_node, num_accepted)
        return
    commit_mod._commit_state_per_call(stash, parents, cu_nodes, last_node, num_accepted)
    commit_mod._commit_window_per_call(stash, parents, cu_nodes, last_node, num_accepted)


def commit_step_before(runner: Any, step: Any) -> None:
    """``hooks.commit_step`` as it was."""
    from vllm_tfm.vllm_plugin.runtime import hooks
    from vllm_tfm.vllm_plugin.runtime.state import STATE

    accept = step.accept
    src, dst = compaction_rows_before(step.dev("row_base"), accept.accepted_nodes)
    for gid, caches in hooks._kv_groups(runner):
        compact_kv_before(caches, runner.input_batch.block_table[gid].slot_mapping.gpu, src, dst)
    if step.num_spec_reqs and step.num_draft[step.spec_req_index].sum() > 0:
        expected = hooks._num_gdn_layers(runner)
        if len(step.gdn) != expected:
            raise RuntimeError(f"{len(step.gdn)} of {expected} GDN layers ran the tree verify")
    if step.gdn:
        last, num_acc = spec_accepted_before(step, accept)
        parents, cu = step.dev("spec_parents"), step.dev("spec_cu")
        kernels = hooks.step_kernels(step, last.device)
        for stash in step.gdn.values():
            commit_gdn_layer_before(stash, parents, cu, last, num_acc, kernels)
    STATE.metrics.hook("commit")
