"""Deferred drafts: the host goes on to the next step while the drafter still runs.

In vLLM 0.26's synchronous scheduling a step's host work waits for the whole drafter three times:
the Weaver graph build's own host check (whether growth rounds past the captured ones are needed,
``weaver_graphs``), ``_bookkeeping_sync`` turning the sampled tokens into lists (``.cpu()`` on the
default stream waits for everything queued after the sampler: DFlash and the Weaver), and
``take_draft_token_ids`` waiting for the copy of the drafts. The host then does vLLM's bookkeeping,
output handling and scheduling and the next step's input preparation with the GPU idle. vLLM's
asynchronous scheduling, which overlaps all of that with the GPU, is refused by vLLM for methods other than
EAGLE / MTP / DFlash / draft models (``VllmConfig.__post_init__``; tfm takes it with ``--async-scheduling``,
``vllm_plugin/async_scheduling.py``, off by default), and tfm's trees need their topology
on the host before the next forward (the tree tables and plans, ``inputs.build_step_tree``).

Here, in tfm engines (``VLLM_TFM_DEFERRED_DRAFTS``, default on), the host waits for the drafter only
right before the next forward:

1. The Weaver graph build returns without its host check (``weaver_graphs.DeferredTail``: whether
   growth rounds past the captured ones are needed is asked later, before anything reads the
   drafts; if they are, they run then and rewrite the returned tensors in place).
2. ``SampledCopy.record``: right after the sampler, at the start of ``_update_states_after_model_execute``
   (before the commit's launches; ``VLLM_TFM_EARLY_SAMPLED_COPY=0``: at the start of
   ``propose_draft_token_ids``, after them), the sampled tokens are copied to pinned memory with an
   event; ``_bookkeeping_sync`` reads that copy, so it waits for the sampler, not the commit and the
   drafter, which the GPU runs while the host does the next step's bookkeeping and input preparation.
3. ``take_draft_token_ids`` returns ``PLACEHOLDER_DRAFT`` (-1, vLLM's own placeholder) B times per
   request instead of the tokens of the proposal just made: no wait. The scheduler needs only their
   number (it schedules 1 + B tokens per request); their values matter to it only for structured
   outputs, and to vLLM's sampler only for penalties, bad words and the other processors that send
   a batch to vLLM's own sampler (``sampler.needs_native_sampler``): a step with any of those hands
   out the real tokens, as before.
4. The next step: vLLM's ``_update_states`` and ``_prepare_inputs`` run as usual (placeholders in
   the host input ids); ``build_step_tree`` lays out the tree tables from the lengths and leaves
   their topology pending (``StepTree.complete``); vLLM's graph dispatch and attention metadata run.
   Placeholders stand for the most recent proposal that included the request (``ProposalStore``):
   a request absent from the last proposal gets its drafts from that older proposal's host copy
   in ``input_ids.cpu`` before vLLM's copy (a wait, rare), as does every request of a batch that
   needs vLLM's own sampler (also into ``input_batch.spec_token_ids``, which its penalties read).
5. ``_preprocess`` (just before the forward): the last build's end (``ProposalStore.finalize``),
   the drafts from the proposal's device tokens into ``input_ids.gpu`` and into the spec-decode
   metadata's ``draft_token_ids`` (``DraftFill``), then the topology (the trees' host copy),
   depth positions, uploads and the full graph's plans (``after_topology``).

What the host did with the GPU idle after the Weaver (vLLM's bookkeeping, output processing,
scheduling, ``_update_states``, input preparation, graph dispatch and attention metadata) now runs
while the drafter runs. Every tensor-parallel rank does the same from the same scheduler output.
The tokens each request emits are unchanged: the same drafts reach the same forward.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from torch import Tensor

from vllm_tfm.verify.packed_upload import packed_upload

from .sampler import needs_native_sampler
from .settings import RuntimeSwitch
from .state import PLACEHOLDER_DRAFT, STATE, ProposalStore, is_placeholder

__all__ = [
    "DEFERRED_DRAFTS_ENV",
    "EARLY_SAMPLED_COPY_ENV",
    "deferred_drafts_enabled",
    "set_deferred_drafts",
    "early_sampled_copy_enabled",
    "set_early_sampled_copy",
    "defers_drafts",
    "record_sampled_copy",
    "placeholder_drafts",
    "draft_positions",
    "fill_input_ids",
    "DraftFill",
]

DEFERRED_DRAFTS_ENV = "VLLM_TFM_DEFERRED_DRAFTS"
_DEFERRED = RuntimeSwitch(DEFERRED_DRAFTS_ENV, "set_deferred_drafts")
EARLY_SAMPLED_COPY_ENV = "VLLM_TFM_EARLY_SAMPLED_COPY"
_EARLY = RuntimeSwitch(EARLY_SAMPLED_COPY_ENV, "set_early_sampled_copy")


def deferred_drafts_enabled() -> bool:
    """``set_deferred_drafts``'s value if set, else ``VLLM_TFM_DEFERRED_DRAFTS`` (default on; 0 / false off)."""
    return _DEFERRED.enabled()


def set_deferred_drafts(worker: object = None, on: bool | None = None) -> bool:
    """Turn deferred drafts on or off in this process from the next step on (None: back to the
    environment); returns the setting now in force. The signature suits ``LLM.collective_rpc``
    (vLLM passes the worker first: ``llm.collective_rpc(set_deferred_drafts, args=(False,))``)."""
    return _DEFERRED.set(on)


def early_sampled_copy_enabled() -> bool:
    """``set_early_sampled_copy``'s value if set, else ``VLLM_TFM_EARLY_SAMPLED_COPY`` (default on; 0 / false
    off): the sampled tokens' copy is queued before the commit instead of after it."""
    return _EARLY.enabled()


def set_early_sampled_copy(worker: object = None, on: bool | None = None) -> bool:
    """Queue the sampled tokens' copy before the commit (True) or after it (False) from the next step on
    (None: back to the environment); returns the setting now in force. The signature suits
    ``LLM.collective_rpc`` (a same-engine A/B, bench/e2e.py ``--ab-switch early_sampled_copy``)."""
    return _EARLY.set(on)


def defers_drafts(sampled: Any, scheduler_output: Any, sampling_metadata: Any) -> bool:
    """Whether this step's drafts are deferred: the switch is on, the sampled tokens are on the GPU, and
    no request needs the drafts' real tokens in the scheduler (structured outputs) or vLLM's own
    sampler (penalties, bad words, other processors)."""
    return (
        deferred_drafts_enabled()
        and isinstance(sampled, Tensor)
        and sampled.is_cuda
        and not scheduler_output.has_structured_output_requests
        and not needs_native_sampler(sampling_metadata)
    )


def record_sampled_copy(sampled: Any, scheduler_output: Any, sampling_metadata: Any, copy: bool = True) -> None:
    """Decide this step's deferral (``STATE.defer_drafts``) and, when deferred and ``copy``, queue the
    sampled tokens' copy that ``_bookkeeping_sync`` will read (``copy=False``: asynchronous scheduling,
    whose bookkeeping reads none). Once per step: a second call for the same tensor (the early call's,
    then ``propose_draft_token_ids``'s) keeps the first decision and copy."""
    if STATE.sampled_copy.holds(sampled):
        return
    STATE.defer_drafts = defers_drafts(sampled, scheduler_output, sampling_metadata)
    if STATE.defer_drafts and copy:
        STATE.sampled_copy.record(sampled)


def placeholder_drafts(num_reqs: int, num_drafts: int) -> list[list[int]]:
    """What the scheduler gets instead of the tokens: ``PLACEHOLDER_DRAFT`` ``num_drafts`` times per request."""
    return [[PLACEHOLDER_DRAFT] * num_drafts for _ in range(num_reqs)]


def draft_positions(
    spec_tokens: dict[str, list[int]],
    req_id_to_index: dict[str, int],
    cu_num_tokens: np.ndarray,
    store: ProposalStore,
    host_only: bool = False,
    absent_ok: bool = False,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, Tensor | None, list[tuple[str, np.ndarray, tuple[int, ...]]]]:
    """Where the scheduled placeholder drafts of a step go, and where they come from.

    A request's d scheduled drafts are the last d of its scheduled tokens and, in vLLM's spec-decode
    metadata, the entries ``cu_draft[i] - d .. cu_draft[i] - 1`` of ``draft_token_ids`` (cu_draft:
    cumulative drafts in batch order; ``_calc_spec_decode_metadata``). Returns (dst, didx, src, tokens,
    host_rows): flat positions in the input ids, flat indices into ``draft_token_ids``, flat indices
    into the most recent proposal's device tokens [R, B] (``tokens``, None when no row reads it),
    and for rows whose placeholders belong to an older proposal (every row with ``host_only``),
    (request, positions, its tokens from the host copy). ``absent_ok`` (asynchronous scheduling, whose
    scheduler gives every decode placeholders): a row no stored proposal stands for (the drafter
    skipped a step) gets zeros, as vLLM zeroes skipped drafts, and ``build_step_tree`` verifies it as
    a chain (its lookup is absent); without it such a row raises.
    """
    num_draft = np.zeros(len(cu_num_tokens), dtype=np.int64)
    dev_req: list[int] = []  # batch index and proposal row of each placeholder request read from the device
    dev_row: list[int] = []
    host_rows: list[tuple[str, np.ndarray, tuple[int, ...]]] = []
    tokens: Tensor | None = None
    for rid, drafts in spec_tokens.items():
        i = req_id_to_index[rid]
        d = num_draft[i] = len(drafts)
        if d == 0 or not is_placeholder(drafts):
            continue
        dev = None if host_only else store.device_drafts(rid)
        if dev is not None:
            tokens, row = dev
            dev_req.append(i)
            dev_row.append(row)
            continue
        host = store.host_drafts(rid)
        if host is None and absent_ok:
            host = (0,) * d
        if host is None or len(host) < d:
            raise RuntimeError(
                f"vllm-tfm: request {rid!r} was scheduled {d} placeholder drafts but its proposal is gone; "
                f"set {DEFERRED_DRAFTS_ENV}=0 and report this"
            )
        end = int(cu_num_tokens[i])
        host_rows.append((rid, np.arange(end - d, end, dtype=np.int64), host[:d]))
    if tokens is None:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, None, host_rows
    req = np.asarray(dev_req, dtype=np.int64)
    d = num_draft[req]
    j = np.arange(int(d.sum()), dtype=np.int64) - np.repeat(np.cumsum(d) - d, d)  # draft index within its request
    first_draft = np.cumsum(num_draft) - num_draft
    dst = np.repeat(np.asarray(cu_num_tokens, dtype=np.int64)[req] - d, d) + j
    didx = np.repeat(first_draft[req], d) + j
    src = np.repeat(np.asarray(dev_row, dtype=np.int64) * tokens.shape[1], d) + j
    return dst, didx, src, tokens, host_rows


def fill_input_ids(runner: Any, scheduler_output: Any, cu_num_tokens: np.ndarray, absent_ok: bool = False) -> DraftFill | None:
    """Called before vLLM's ``_prepare_input_ids``. Placeholder drafts of rows whose proposal is not the
    most recent one get their tokens from the host copy in ``input_ids.cpu`` now; the others are
    written on the device just before the forward (``DraftFill.apply``, from ``_preprocess``: the
    most recent proposal's build may still be running until then). None when the step has no
    placeholders.

    A batch that needs vLLM's own sampler (a request with penalties or bad words joined requests
    holding placeholders) gets every placeholder's tokens from the host copy, in the input ids and
    in ``input_batch.spec_token_ids``, which vLLM's penalties read (a wait, on such steps only).
    ``absent_ok``: asynchronous scheduling (``draft_positions``)."""
    store = STATE.store
    spec = scheduler_output.scheduled_spec_decode_tokens
    if not spec or not any(is_placeholder(d) for d in spec.values()):
        return None
    batch = runner.input_batch
    host_only = needs_native_sampler(batch.sampling_metadata)
    dst, didx, src, tokens, host_rows = draft_positions(spec, batch.req_id_to_index, cu_num_tokens, store, host_only,
                                                        absent_ok)
    if host_rows:
        ids = runner.input_ids.np
        for rid, pos, toks in host_rows:
            ids[pos] = np.asarray(toks, dtype=ids.dtype)
            if host_only:
                batch.spec_token_ids[batch.req_id_to_index[rid]][:] = toks
    return DraftFill(dst, didx, src, tokens, sum(len(t) for _, _, t in host_rows))


class DraftFill:
    """The device half of ``fill_input_ids``: flat positions ``dst`` of the input ids and ``didx`` of
    the spec-decode metadata's ``draft_token_ids`` take the proposal's ``tokens.reshape(-1)[src]``."""

    def __init__(self, dst: np.ndarray, didx: np.ndarray, src: np.ndarray, tokens: Tensor | None,
                 host_filled: int) -> None:
        self.dst, self.didx, self.src, self.tokens, self.host_filled = dst, didx, src, tokens, host_filled
        self.draft_token_ids: Tensor | None = None  # the step's spec-decode metadata's (set after vLLM built it)

    def apply(self, input_ids_gpu: Tensor) -> int:
        """Write the drafts (queued on the current stream, no host wait); returns how many."""
        if self.tokens is None or self.dst.shape[0] == 0:
            return 0
        idx = packed_upload({"dst": self.dst, "didx": self.didx, "src": self.src}, input_ids_gpu.device)
        dst_d, didx_d, src_d = idx["dst"], idx["didx"], idx["src"]
        values = self.tokens.reshape(-1)[src_d]
        input_ids_gpu[dst_d] = values.to(input_ids_gpu.dtype)
        if self.draft_token_ids is not None:
            self.draft_token_ids[didx_d] = values.to(self.draft_token_ids.dtype)
        return int(self.dst.shape[0])
