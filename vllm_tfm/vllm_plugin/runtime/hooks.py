"""Wrappers of vLLM 0.26's V1 ``GPUModelRunner`` methods (vllm/v1/worker/gpu_model_runner.py).

Each wrapper calls the original and acts only on a runner built for ``"method": "tfm"``:

* ``__init__`` (455): refuses unsupported settings, builds ``TFMProposer`` where vLLM builds
  ``DFlashProposer`` (630-632, by rebinding the module global for the duration of the call) and
  replaces ``rejection_sampler`` (built at 655-657) with ``TFMTreeSampler``;
* ``_prepare_inputs`` (1937): builds the step's tree metadata and writes depth positions into
  ``positions`` / ``mrope_positions`` after vLLM computed the slot mapping (2174-2178);
* ``_update_states_after_model_execute`` (1545, called at 4535 between sampling and drafting):
  the commit (KV compaction + GDN state / conv window) before vLLM records ``num_accepted_tokens``;
* ``propose_draft_token_ids`` (4954): keeps the target's sampled hidden states for the Weaver;
* ``_bookkeeping_sync`` (3668), ``take_draft_token_ids`` (4833), ``_prepare_input_ids`` (1761),
  ``_preprocess``: deferred drafts (``deferred_drafts.py``): the sampled tokens' early copy,
  placeholder drafts for the scheduler, and right before the forward the drafts' tokens written
  into the input ids and the spec-decode metadata on the device and the step's tree topology filled;
* ``sample_tokens`` (4497): clears the step state when the step ends, so profiling and dummy runs
  never see a stale tree;
* ``profile_run`` (6364, called once at start-up by ``Worker.determine_available_memory``, with or
  without ``kv_cache_memory_bytes``): afterwards allocates the full tree graphs' stash of every GDN
  layer (``full_graphs.TreeGraphs.reserve``) and captures the Weaver CUDA graphs of every batch
  size up to ``max_num_seqs`` (``TFMProposer.warm_up_weaver_graphs``), so that their memory is in
  vLLM's memory profile and serving captures none (as vLLM captures its own graphs at start-up).

With ``VLLM_TFM_TRACE=<dir>`` the ``_prepare_inputs`` and ``_update_states_after_model_execute``
wrappers also hand each step to the request trace (``trace.py``); without it they test one
attribute.

With ``VLLM_TFM_PROFILE=1`` (``stage_timing``) three more methods are wrapped for every runner,
tfm or not, to time the stages of each step with CUDA events: ``execute_model`` (4111),
``_model_forward`` (3824, the target forward) and ``_sample`` (3637); the wrappers above then
also time ``sample_tokens`` and ``propose_draft_token_ids`` of non-tfm runners. Without the
switch those three are not wrapped at all.
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .accepted_offsets import OffsetPlan, move_states_to_slot0, plan_offsets
from .commit import commit_gdn_layers, compact_kv, compaction_rows, spec_accepted, spec_rows
from .commit_overlap import OVERLAP
from .deferred_drafts import (
    deferred_drafts_enabled,
    early_sampled_copy_enabled,
    fill_input_ids,
    placeholder_drafts,
    record_sampled_copy,
)
from .device_topology import launch_device_topology
from .inputs import build_step_tree, tree_positions
from .metrics import Metrics
from .one_slot import (
    ONE_SLOT,
    ONES,
    chain_accepted,
    commit_destinations,
    concurrency_with_slots,
    one_slot_kv_cache_specs,
    per_draft_concurrency_notice,
    resolve_gdn_state_slots,
)
from .sampler import TFMTreeSampler, needs_native_sampler
from .settings import force_tree_path
from .stage_timing import TIMER
from .state import STATE, StepTree
from .step_kernels import step_kernels

__all__ = ["install_runner_hooks", "install_profile_hooks", "check_engine_config", "set_gdn_state_layout", "RUNNER_HOOKS", "PROFILE_HOOKS"]

stats_logger = logging.getLogger("vllm.tfm")  # under vLLM's logger: printed next to its own stats lines


def _is_tfm(runner: Any) -> bool:
    return bool(getattr(runner, "_tfm_enabled", False))


def _is_async(runner: Any) -> bool:
    """The runner schedules asynchronously (vLLM's ``--async-scheduling``; for tfm off unless asked
    for, ``vllm_plugin/async_scheduling.py``): no sampled token and no accepted count of the last step is
    read on the host before the next step is prepared."""
    return bool(getattr(runner, "use_async_scheduling", False))


def check_engine_config(vllm_config: Any) -> None:
    """One-line ValueError for the settings the tree runtime cannot run with."""
    from ..cuda_graphs import check_graph_config

    check_graph_config(vllm_config)  # CUDA graphs: tree code outside the graphs (cuda_graphs.py)
    if vllm_config.model_config.is_hybrid and vllm_config.cache_config.mamba_cache_mode != "none":
        raise ValueError(
            "vllm-tfm needs prefix caching off for hybrid models (mamba_cache_mode 'none'), "
            f"got mamba_cache_mode={vllm_config.cache_config.mamba_cache_mode!r}"
        )
    par = vllm_config.parallel_config
    if par.pipeline_parallel_size > 1:
        raise ValueError("vllm-tfm does not support pipeline parallelism (drafts exist on the last stage only)")
    if getattr(par, "decode_context_parallel_size", 1) > 1:
        raise ValueError("vllm-tfm does not support decode context parallelism")
    if vllm_config.model_config.uses_xdrope_dim > 0:
        raise ValueError("vllm-tfm does not support XD-RoPE models")
    if getattr(getattr(vllm_config, "scheduler_config", None), "async_scheduling", False):
        from .settings import trace_settings

        if trace_settings() is not None:
            raise ValueError("VLLM_TFM_TRACE reads every step's acceptance on the host: it needs synchronous "
                             "scheduling (unset VLLM_TFM_TRACE or drop --async-scheduling)")


def set_gdn_state_layout(runner: Any, vllm_config: Any) -> None:
    """``STATE.one_slot`` for a tfm runner: its drafter's ``gdn_state_slots`` resolved for the engine's
    parallelism (``one_slot.resolve_gdn_state_slots``), one slot for hybrid targets only (vLLM's chain kernel
    then never runs, its state offsets mean nothing: one_slot.py). A hybrid target's layout is logged."""
    par = vllm_config.parallel_config
    slots, why = resolve_gdn_state_slots(runner.drafter.tfm_settings.tfm.gdn_state_slots, par.tensor_parallel_size,
                                         getattr(par, "data_parallel_size", 1))
    hybrid = bool(runner.model_config.is_hybrid)
    STATE.one_slot = hybrid and slots == ONE_SLOT
    if hybrid:
        budget = int(vllm_config.speculative_config.num_speculative_tokens)
        stats_logger.info("vllm-tfm: gdn_state_slots %r (%s): %s GDN state slot(s) per request", slots, why,
                          1 if STATE.one_slot else f"1 + B = {1 + budget}")


def _wrap_init(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def __init__(self: Any, vllm_config: Any, device: Any, *args: Any, **kwargs: Any) -> None:
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "tfm":
            STATE.one_slot = False  # a later engine in this process (tests, benches) is not a one-slot tfm engine
            orig(self, vllm_config, device, *args, **kwargs)
            return
        check_engine_config(vllm_config)
        import vllm.v1.worker.gpu_model_runner as gmr

        from ..benchmark_mode import get_acceptance_replay, warn_replay
        from .proposer import TFMProposer
        from .replay import AcceptanceReplayer

        replay_spec = get_acceptance_replay(vllm_config)
        STATE.replay = None if replay_spec is None else AcceptanceReplayer(replay_spec, device)
        if replay_spec is not None:
            warn_replay(replay_spec, "worker")

        saved = gmr.DFlashProposer
        gmr.DFlashProposer = TFMProposer
        try:
            orig(self, vllm_config, device, *args, **kwargs)
        finally:
            gmr.DFlashProposer = saved
        if not isinstance(getattr(self, "drafter", None), TFMProposer):
            raise RuntimeError(
                "vllm-tfm: the model runner did not build the tfm drafter; is the tfm config patch "
                "(use_dflash() for method 'tfm') installed in this process?"
            )
        self._tfm_enabled = True
        set_gdn_state_layout(self, vllm_config)
        if STATE.one_slot:
            ONES.reserve(int(self.max_num_reqs), self.device)  # before any graph capture: a fixed address
        from .graph_dispatch import enable_tree_graphs

        # FULL_AND_PIECEWISE: tree steps in full graphs; no tree is deeper than the drafter's depth
        enable_tree_graphs(self, int(spec.num_speculative_tokens), self.drafter.tfm_settings.max_depth)
        self.rejection_sampler = TFMTreeSampler(self.rejection_sampler, self, replay=STATE.replay)
        STATE.metrics = Metrics(max_depth=int(spec.num_speculative_tokens), device=device)
        from .settings import verify_version_setting

        verify_version_setting()  # VLLM_TFM_GDN_VERIFY: a bad value fails at start-up, not in the first tree step
        STATE.store = type(STATE.store)()
        STATE.step = None
        from vllm.distributed import get_tensor_model_parallel_rank

        try:
            STATE.log_stats = get_tensor_model_parallel_rank() == 0
        except AssertionError:  # no tensor-parallel group (a runner built outside a vLLM worker)
            STATE.log_stats = True
        STATE.log_stats_interval_s = float(os.environ.get("VLLM_LOG_STATS_INTERVAL", "10"))
        if STATE.trace is not None:
            STATE.trace.close()
        STATE.trace = None
        if STATE.log_stats:  # VLLM_TFM_TRACE: rank 0 writes the per-request step records (trace.py)
            from .trace import Tracer

            settings = self.drafter.tfm_settings
            STATE.trace = Tracer.from_settings({"budget": settings.budget, "proposal": settings.proposal,
                                                "max_depth": settings.max_depth, "hybrid": bool(self.model_config.is_hybrid)})

    return __init__


def _wrap_prepare_inputs(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _prepare_inputs(self: Any, scheduler_output: Any, num_scheduled_tokens: Any) -> Any:
        out = orig(self, scheduler_output, num_scheduled_tokens)
        if not _is_tfm(self):
            return out
        if STATE.draft_fill is not None and out[1] is not None:  # the drafts vLLM's spec-decode metadata gathered
            STATE.draft_fill.draft_token_ids = out[1].draft_token_ids
        metrics = STATE.metrics
        trace = STATE.trace
        accepted_read, plan = None, None
        if self.model_config.is_hybrid:
            if trace is not None:
                accepted_read = self.num_accepted_tokens.np[: self.input_batch.num_reqs].copy()
            if not STATE.one_slot:
                plan = fix_accepted_offsets(self, scheduler_output, num_scheduled_tokens)
            else:  # every state sits at [n, 0] already (one_slot.py); the resumed requests are still counted
                STATE.metrics.resumed.update(scheduler_output.scheduled_cached_reqs.resumed_req_ids or ())
        with metrics.timed("prepare_inputs.tree"), TIMER.span("prepare_tree"):
            batch = self.input_batch
            num_req = batch.num_reqs
            native = needs_native_sampler(batch.sampling_metadata)
            step = build_step_tree(
                batch.req_ids[:num_req],
                num_scheduled_tokens,
                scheduler_output.scheduled_spec_decode_tokens,
                STATE.store,
                allow_trees=not native,
                force_tree_path=force_tree_path() or STATE.replay is not None,  # replay verifies chains too
                device=self.device,
                defer_topology=deferred_drafts_enabled(),
                one_slot=STATE.one_slot,
            )
            if step.topology_pending:
                metrics.hook("prepare_inputs.topology_deferred")  # filled in _preprocess (deferred_drafts.py)
            step.after_topology(functools.partial(_tree_positions_and_counts, self))
            STATE.step = step
        if trace is not None:
            step.complete()
            trace.begin(self, scheduler_output, step, native, accepted_read, plan)
        return out

    return _prepare_inputs


def _tree_positions_and_counts(runner: Any, step: StepTree) -> None:
    """Once the step's topology is known: depth positions (RoPE) of a tree-active step into vLLM's
    positions buffer (the sequential ones kept for the drafter), and the step's tree counters."""
    metrics = STATE.metrics
    if step.tree_active and not step.device_topology:  # else the topology kernel wrote them (device_topology.py)
        t = step.num_tokens
        pos = runner.mrope_positions.gpu[:, :t] if runner.uses_mrope else runner.positions[:t]
        step.seq_positions = pos.clone()
        pos.copy_(tree_positions(pos, step.dev("query_start"), step.dev("req_index"), step.dev("depth")))
        metrics.hook("prepare_inputs.depth_positions")
    metrics.record_step(step)


def _wrap_preprocess(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _preprocess(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _is_tfm(self):
            fill, STATE.draft_fill = STATE.draft_fill, None
            step = STATE.step
            if fill is not None or (step is not None and step.topology_pending):
                with STATE.metrics.timed("preprocess.drafts"), TIMER.span("topology_wait"):
                    if fill is not None:
                        STATE.store.finalize()  # the last build's end (may wait for the drafter)
                        STATE.metrics.placeholder_drafts_filled += fill.apply(self.input_ids.gpu) + fill.host_filled
                    # the trees' topology: on the device for a full-graph replay (its host copy is read after the
                    # forward's launch), else from the host copy now: positions, plans, uploads
                    if step is not None and not launch_device_topology(self, step):
                        step.complete()
        return orig(self, *args, **kwargs)

    return _preprocess


def _gdn_groups(runner: Any) -> list[tuple[int, list[Any]]]:
    """(KV-cache group id, GDN layers in it) for the hybrid target's mamba groups, computed once."""
    groups = getattr(runner, "_tfm_gdn_groups", None)
    if groups is None:
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

        ctx = runner.compilation_config.static_forward_context
        groups = []
        for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
            layers = [ctx[n] for n in group.layer_names if isinstance(ctx.get(n), QwenGatedDeltaNetAttention)]
            if layers:
                groups.append((gid, layers))
        runner._tfm_gdn_groups = groups
    return groups


def fix_accepted_offsets(runner: Any, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> OffsetPlan | None:
    """Give back ``num_accepted_tokens`` to rows vLLM re-added, and move committed GDN states that
    vLLM would read from slot 0 there (runtime/accepted_offsets.py). Runs after vLLM's
    ``_prepare_inputs`` synced ``num_accepted_tokens`` and before the attention metadata is built.
    Returns the plan when it acted (None when no row needed it).

    Asynchronous scheduling: the host's counts are all 1 and vLLM corrects the device's from the last
    step's sampler, so a continuing row scheduled one token (no drafts) cannot be told on the host to
    sit elsewhere: its state is moved to slot 0 on the device from the device's count (a copy onto
    itself where that count is 1), no host wait."""
    batch = runner.input_batch
    n = batch.num_reqs
    req_ids = batch.req_ids[:n]
    resumed = scheduler_output.scheduled_cached_reqs.resumed_req_ids
    if resumed:
        STATE.metrics.resumed.update(resumed)
    continuing = STATE.offsets.begin_step(req_ids, resumed, runner.requests)
    nst = np.asarray(num_scheduled_tokens[:n])
    current = runner.num_accepted_tokens.np[:n]
    # a row with one scheduled token verifies no draft: it reads slot 0 (a spec row has >= 2 tokens)
    single = nst == 1
    on_device = continuing & single if _is_async(runner) else np.zeros(n, dtype=bool)
    if continuing.all() and not (single & (current > 1)).any() and not on_device.any():
        return None  # the usual step: no row came back, no row reads a stale slot 0 (no Python loop)
    spec = scheduler_output.scheduled_spec_decode_tokens
    spec_rows = np.array([rid in spec and nst[i] == len(spec[rid]) + 1 for i, rid in enumerate(req_ids)], dtype=bool)
    decode_rows = spec_rows | (nst == 1)
    plan = plan_offsets(list(req_ids), current, continuing, spec_rows, decode_rows, STATE.offsets.records)
    plan.device_move_rows = np.nonzero(on_device)[0].tolist()
    if not plan:
        return None
    dev = runner.num_accepted_tokens.gpu.device
    if plan.restore_rows:
        rows, vals = plan.restore_rows, plan.restore_values
        runner.num_accepted_tokens.np[rows] = vals
        batch.num_accepted_tokens_cpu[rows] = vals
        runner.num_accepted_tokens.gpu[torch.tensor(rows, device=dev)] = torch.tensor(vals, dtype=torch.int32, device=dev)
        STATE.metrics.accepted_restored += len(rows)
    if plan.move_rows:
        rows = plan.move_rows
        _move_to_slot0(runner, rows, torch.tensor(plan.move_from, dtype=torch.long, device=dev), max(plan.move_from))
        runner.num_accepted_tokens.np[rows] = 1
        batch.num_accepted_tokens_cpu[rows] = 1
    if plan.device_move_rows:
        rows = plan.device_move_rows
        accepted = runner.num_accepted_tokens.gpu[torch.tensor(rows, device=dev)].to(torch.long)  # vLLM's corrected counts
        _move_to_slot0(runner, rows, accepted, int(getattr(runner, "num_spec_tokens", 0)) + 1)  # a <= 1 + B
    if not STATE.offsets.reported:
        STATE.offsets.reported = True
        stats_logger.info(  # under vLLM's logger: INFO lines of "vllm_tfm" are not printed by default
            "vllm-tfm: kept the GDN state offsets of requests vLLM re-added to its batch (%d restored, %d moved to "
            "slot 0); counted in the tree metrics as accepted_restored / states_moved", len(plan.restore_rows),
            len(plan.move_rows),
        )
    return plan


def _move_to_slot0(runner: Any, rows: list[int], accepted: Tensor, cols: int) -> None:
    """The committed GDN state of batch rows ``rows`` (their ``a``: ``accepted``, [M] int64 on the device, read
    from the first ``cols`` state slots of each row) to slot 0 in every GDN layer; their device count set to 1."""
    from .gdn import _layer_states

    dev = accepted.device
    for gid, layers in _gdn_groups(runner):
        table = runner.input_batch.block_table[gid].get_numpy_array()
        slots = torch.from_numpy(np.ascontiguousarray(table[rows, : min(cols, table.shape[1])])).to(device=dev, dtype=torch.long)
        states = [_layer_states(layer) for layer in layers]
        width = int(layers[0].conv1d.weight.shape[-1])
        move_states_to_slot0([c for c, _ in states], [s for _, s in states], slots, accepted, width)
    runner.num_accepted_tokens.gpu[torch.tensor(rows, device=dev)] = 1
    STATE.metrics.states_moved += len(rows)


def _kv_groups(runner: Any) -> list[tuple[int, list[Any]]]:
    """(KV-cache group id, caches of the target's full-attention layers in it), computed once."""
    groups = getattr(runner, "_tfm_kv_groups", None)
    if groups is None:
        ctx = runner.compilation_config.static_forward_context
        groups = []
        for gid, group in enumerate(runner.kv_cache_config.kv_cache_groups):
            caches = [ctx[n].kv_cache for n in group.layer_names if n in STATE.target_attn_layers]
            if caches:
                groups.append((gid, caches))
        runner._tfm_kv_groups = groups
    return groups


def _num_gdn_layers(runner: Any) -> int:
    n = getattr(runner, "_tfm_num_gdn", None)
    if n is None:
        from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

        ctx = runner.compilation_config.static_forward_context
        n = sum(isinstance(layer, QwenGatedDeltaNetAttention) for layer in ctx.values())
        runner._tfm_num_gdn = n
    return n


def commit_step(runner: Any, step: StepTree, output_token_ids: Tensor | None = None) -> None:
    """KV compaction of the accepted paths and the GDN commit of every layer (see commit.py).

    A ``gdn_tree`` step (one_slot.py) verified chains with vLLM's sampler: no K/V moves (a chain's accepted
    rows are where they were written), and the accepted counts come from ``output_token_ids``."""
    accept = step.accept
    if step.tree_active:
        if accept is None:
            raise RuntimeError("vllm-tfm: a tree-active step reached the commit without an acceptance result")
        src, dst = compaction_rows(step.dev("row_base"), accept.accepted_nodes)
        for gid, caches in _kv_groups(runner):
            compact_kv(caches, runner.input_batch.block_table[gid].slot_mapping.gpu, src, dst)
    elif output_token_ids is None:
        raise RuntimeError("vllm-tfm: a step whose chains vLLM's sampler verified reached the commit without its tokens")
    if step.num_spec_reqs and step.num_draft[step.spec_req_index].sum() > 0:
        expected = _num_gdn_layers(runner)
        if len(step.gdn) != expected:
            raise RuntimeError(
                f"vllm-tfm: {len(step.gdn)} of {expected} GDN layers ran the tree verify this step; "
                "the others wrote chain states, the commit cannot be done"
            )
    if step.gdn:
        if step.tree_active:
            last, num_acc = spec_accepted(step, accept)
        else:
            last, num_acc = chain_accepted(spec_rows(step, output_token_ids))
        if STATE.one_slot:
            num_acc = commit_destinations(num_acc)  # in place: slot [n, 0], conv columns from 0
            STATE.metrics.hook("commit.one_slot")
        if not step.tree_active:
            STATE.metrics.hook("commit.chain")  # chains vLLM's sampler verified, GDN on the tree path
        parents, cu = step.dev("spec_parents"), step.dev("spec_cu")
        commit_gdn_layers(list(step.gdn.values()), parents, cu, last, num_acc, step_kernels(step, last.device))
    STATE.metrics.hook("commit")


def _wrap_update_states_after(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _update_states_after_model_execute(self: Any, output_token_ids: Any, scheduler_output: Any) -> Any:
        if _is_tfm(self):
            if early_sampled_copy_enabled():  # before the commit's launches: bookkeeping waits for the sampler only
                record_sampled_copy(output_token_ids, scheduler_output, self.input_batch.sampling_metadata,
                                    copy=not _is_async(self))
            step = STATE.step
            if step is not None and step.tree_gdn:
                # on the commit stream beside the drafting (commit_overlap.py), joined when the drafting is queued
                device = getattr(self, "device", None)
                with OVERLAP.side(device, step, output_token_ids) as side, STATE.metrics.timed("commit"), \
                        TIMER.span("commit"):
                    commit_step(self, step, output_token_ids)
                    if side:
                        STATE.metrics.hook("commit.overlap")
            out = orig(self, output_token_ids, scheduler_output)
            if self.model_config.is_hybrid and not STATE.one_slot:
                n = self.input_batch.num_reqs
                STATE.offsets.end_step(list(self.input_batch.req_ids[:n]), self.num_accepted_tokens.gpu)
            if STATE.trace is not None:
                STATE.trace.end(self, output_token_ids)
            return out
        return orig(self, output_token_ids, scheduler_output)

    return _update_states_after_model_execute


def _wrap_propose(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def propose_draft_token_ids(self: Any, scheduler_output: Any, sampled_token_ids: Any, sampling_metadata: Any,
                                hidden_states: Any, sample_hidden_states: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_tfm(self):
            with TIMER.span("propose"):
                return orig(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                            sample_hidden_states, *args, **kwargs)
        STATE.final_hidden = sample_hidden_states
        # the copy bookkeeping waits for, unless queued right after the sampler (_update_states_after_model_execute);
        # none with asynchronous scheduling, whose bookkeeping reads no sampled token on the host
        record_sampled_copy(sampled_token_ids, scheduler_output, sampling_metadata, copy=not _is_async(self))
        try:
            with STATE.metrics.timed("propose"), TIMER.span("propose"):
                return orig(self, scheduler_output, sampled_token_ids, sampling_metadata, hidden_states,
                            sample_hidden_states, *args, **kwargs)
        finally:
            STATE.final_hidden = None
            OVERLAP.join()  # the drafting is queued: what comes after it waits for the commit too

    return propose_draft_token_ids


def _wrap_bookkeeping_sync(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _bookkeeping_sync(self: Any, scheduler_output: Any, sampler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_tfm(self) or _is_async(self):  # asynchronous: vLLM's bookkeeping reads no sampled token
            return orig(self, scheduler_output, sampler_output, *args, **kwargs)
        sampled = sampler_output.sampled_token_ids
        host = STATE.sampled_copy.host_for(sampled)  # deferred drafts: waits for the sampler, not the drafter
        if host is None:
            return orig(self, scheduler_output, sampler_output, *args, **kwargs)
        sampler_output.sampled_token_ids = host
        try:
            return orig(self, scheduler_output, sampler_output, *args, **kwargs)
        finally:
            sampler_output.sampled_token_ids = sampled

    return _bookkeeping_sync


def _wrap_take_draft_token_ids(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def take_draft_token_ids(self: Any) -> Any:
        if not _is_tfm(self):
            return orig(self)
        drafts, req_ids = self._draft_token_ids, self._draft_token_req_ids
        if (
            STATE.defer_drafts
            and self.num_spec_tokens
            and req_ids
            and isinstance(drafts, torch.Tensor)
            and STATE.store.latest_is(drafts, req_ids)
        ):
            from vllm.v1.outputs import DraftTokenIds

            STATE.metrics.placeholder_steps += 1
            return DraftTokenIds(list(req_ids), placeholder_drafts(len(req_ids), int(drafts.shape[1])))
        return orig(self)

    return take_draft_token_ids


def _wrap_prepare_input_ids(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _prepare_input_ids(self: Any, scheduler_output: Any, num_reqs: int, total_num_scheduled_tokens: int,
                           cu_num_tokens: np.ndarray, *args: Any, **kwargs: Any) -> Any:
        if _is_tfm(self):  # placeholder drafts: host rows now, the device rows before the forward (_preprocess)
            STATE.draft_fill = fill_input_ids(self, scheduler_output, cu_num_tokens, absent_ok=_is_async(self))
        return orig(self, scheduler_output, num_reqs, total_num_scheduled_tokens, cu_num_tokens, *args, **kwargs)

    return _prepare_input_ids


def _wrap_sample_tokens(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def sample_tokens(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not _is_tfm(self):
            with TIMER.span("sample_tokens"):
                return orig(self, *args, **kwargs)
        try:
            with STATE.metrics.timed("sample_tokens"), TIMER.span("sample_tokens"):
                return orig(self, *args, **kwargs)
        finally:
            OVERLAP.join()  # a step that drafted nothing (or raised) joins its commit here
            STATE.step = None
            STATE.draft_fill = None
            _log_interval_stats()

    return sample_tokens


def _allocator_mib() -> tuple[float, float]:
    """(allocated, reserved) MiB of torch's caching allocator on this process's current device."""
    return torch.cuda.memory_allocated() / (1 << 20), torch.cuda.memory_reserved() / (1 << 20)


def _log_interval_stats() -> None:
    """Every ``VLLM_LOG_STATS_INTERVAL`` seconds (vLLM's own stats interval, default 10), one line on
    tfm's steps (docs/metrics.md), from tensor-parallel rank 0 only; on CUDA it ends with the torch
    allocator's allocated / reserved MiB (no device sync)."""
    if STATE.metrics is None or not STATE.log_stats:
        return
    memory = _allocator_mib if torch.cuda.is_available() else None
    line = STATE.metrics.interval_report(time.monotonic(), STATE.log_stats_interval_s, memory)
    if line is not None:
        stats_logger.info(line)


def _wrap_profile_run(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def profile_run(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = orig(self, *args, **kwargs)
        if _is_tfm(self):
            reserve_tree_graph_stash(self)
            try:
                self.drafter.warm_up_weaver_graphs(int(self.max_num_reqs))
            except Exception as exc:  # noqa: BLE001 - start-up must not fail on an optimisation
                # serving then captures each graph on first use (the path before the warm-up existed)
                stats_logger.warning("vllm-tfm: capturing the Weaver CUDA graphs at start-up failed (%s: %s); "
                                     "they will be captured on first use while serving", type(exc).__name__, exc)
        return out

    return profile_run


def reserve_tree_graph_stash(runner: Any) -> int:
    """With full tree graphs: the persistent stash of every GDN layer of the target, allocated now (after
    vLLM's profile run, inside its memory profile). Returns the number of layers reserved."""
    from .graph_dispatch import tree_graphs_of

    graphs = tree_graphs_of(runner)
    if graphs is None or not runner.model_config.is_hybrid:
        return 0
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import QwenGatedDeltaNetAttention

    dtype = runner.model_config.dtype
    n = 0
    for layer in runner.compilation_config.static_forward_context.values():
        if isinstance(layer, QwenGatedDeltaNetAttention):
            graphs.reserve(layer.prefix, int(layer.conv1d.weight.shape[0]), dtype, layer.num_k_heads // layer.tp_size,
                           layer.head_k_dim, dtype, layer.num_v_heads // layer.tp_size, layer.head_v_dim, torch.float32,
                           runner.device)
            n += 1
    return n


def _wrap_update_states(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _update_states(self: Any, scheduler_output: Any) -> Any:
        event = getattr(self, "num_accepted_tokens_event", None)
        if _is_tfm(self) and event is not None and not _is_async(self):
            # The last step's accepted counts reach the host by a non-blocking copy that vLLM queues after the
            # commit (_update_states_after_model_execute) and waits for only in _prepare_inputs. vLLM's own
            # bookkeeping read of the sampled tokens waits for it; with deferred drafts tfm's reads an earlier
            # copy (deferred_drafts.py), so the host can get here first, and the row moves below (condense,
            # swaps, the decode-first reorder) would then be overwritten by the copy's late rows: a moved request
            # would read its GDN state from another slot (greedy tokens differed from no speculation at batch 8,
            # bench/NOTES.md section 59). Waiting here costs the commit's tail, not the drafter's.
            event.synchronize()
        return orig(self, scheduler_output)

    return _update_states


def _wrap_get_kv_cache_spec(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def get_kv_cache_spec(self: Any) -> Any:
        specs = orig(self)
        if _is_tfm(self) and STATE.one_slot:
            return one_slot_kv_cache_specs(specs)
        return specs

    return get_kv_cache_spec


def _wrap_initialize_kv_cache(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def initialize_kv_cache(self: Any, kv_cache_config: Any, is_profiling: bool = False) -> Any:
        out = orig(self, kv_cache_config, is_profiling=is_profiling)
        if _is_tfm(self) and not STATE.one_slot and self.model_config.is_hybrid and not is_profiling:
            try:  # advice only: a KV-cache layout vLLM's concurrency figure does not cover must not stop the engine
                now, one = concurrency_with_slots(self.vllm_config, kv_cache_config)
            except Exception as exc:  # noqa: BLE001
                stats_logger.warning("vllm-tfm: no concurrency figure for this KV cache (%s: %s)", type(exc).__name__, exc)
                return out
            notice = per_draft_concurrency_notice(now, one, int(self.scheduler_config.max_num_seqs),
                                                  int(self.speculative_config.num_speculative_tokens))
            if notice is not None:
                stats_logger.warning(notice)
        return out

    return initialize_kv_cache


RUNNER_HOOKS: dict[str, tuple[Callable[[Callable], Callable], str]] = {
    "__init__": (_wrap_init, "tfm: build TFMProposer and TFMTreeSampler, refuse unsupported settings"),
    "_prepare_inputs": (_wrap_prepare_inputs, "tfm: per-step tree metadata and depth positions"),
    "_update_states_after_model_execute": (_wrap_update_states_after, "tfm: commit the accepted path"),
    "propose_draft_token_ids": (_wrap_propose, "tfm: keep the target's sampled hidden states (Weaver)"),
    "sample_tokens": (_wrap_sample_tokens, "tfm: end the step state"),
    "_bookkeeping_sync": (_wrap_bookkeeping_sync, "tfm: read the sampled tokens' early copy (deferred drafts)"),
    "take_draft_token_ids": (_wrap_take_draft_token_ids, "tfm: placeholders for the scheduler (deferred drafts)"),
    "_prepare_input_ids": (_wrap_prepare_input_ids, "tfm: the drafts' tokens into the input ids (deferred drafts)"),
    "_preprocess": (_wrap_preprocess, "tfm: the step's tree topology before the forward (deferred drafts)"),
    "profile_run": (_wrap_profile_run, "tfm: capture the Weaver CUDA graphs of every batch size at start-up"),
    "_update_states": (_wrap_update_states, "tfm: the last step's accepted counts on the host before rows move"),
    "get_kv_cache_spec": (_wrap_get_kv_cache_spec, "tfm: one GDN state slot per request (gdn_state_slots 'one')"),
    "initialize_kv_cache": (_wrap_initialize_kv_cache, "tfm: say when per-draft GDN slots cap the requests at once"),
}


def _wrap_execute_model(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def execute_model(self: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        TIMER.note_batch(len(scheduler_output.num_scheduled_tokens), scheduler_output.total_num_scheduled_tokens)
        with TIMER.span("execute_model"):
            return orig(self, scheduler_output, *args, **kwargs)

    return execute_model


def _wrap_model_forward(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _model_forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        with TIMER.span("target_forward"):
            return orig(self, *args, **kwargs)

    return _model_forward


def _wrap_sample(orig: Callable) -> Callable:
    @functools.wraps(orig)
    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        with TIMER.span("sample"):
            return orig(self, *args, **kwargs)

    return _sample


PROFILE_HOOKS: dict[str, tuple[Callable[[Callable], Callable], str]] = {
    "execute_model": (_wrap_execute_model, "VLLM_TFM_PROFILE: time the step's forward half, note the batch shape"),
    "_model_forward": (_wrap_model_forward, "VLLM_TFM_PROFILE: time the target forward"),
    "_sample": (_wrap_sample, "VLLM_TFM_PROFILE: time the (tree) rejection sampler"),
}


def install_runner_hooks() -> None:
    """Wrap the GPUModelRunner methods above through the plugin's patch registry (idempotent)."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ..patching import replace_attribute

    for name, (wrap, reason) in RUNNER_HOOKS.items():
        replace_attribute(GPUModelRunner, name, wrap, reason=reason)


def install_profile_hooks() -> bool:
    """The stage-timing wrappers of :data:`PROFILE_HOOKS`, only when ``VLLM_TFM_PROFILE`` is on
    (returns whether they are installed; idempotent)."""
    if not TIMER.enabled:
        return False
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from ..patching import replace_attribute

    for name, (wrap, reason) in PROFILE_HOOKS.items():
        replace_attribute(GPUModelRunner, name, wrap, reason=reason)
    return True
