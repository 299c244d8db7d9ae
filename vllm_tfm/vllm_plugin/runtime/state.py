"""Worker-side tree state: proposals keyed by request id, and the tree metadata of the running step.

Only token ids travel from the worker to the scheduler and back (VLLM_HOOKS.md section 4), and with
deferred drafts (``deferred_drafts.py``, the default) only placeholders for them, so the topology
of each request's tree stays here:

* ``ProposalStore``: after the drafter runs, each request's B draft tokens and 1 + B local parents
  are copied to pinned host memory without a sync; the next step reads them (with deferred drafts
  right before the forward, after the build's deferred end: ``finalize``) and checks that the
  drafts the scheduler sent back are a prefix of what was proposed, or placeholders of it. Any
  mismatch (zeroed drafts, a stale proposal) falls back to reading the drafts as a chain, which is
  always a valid tree, so verification stays exact.
* ``StepTree``: everything the hooks of one decode step share (built by ``inputs.py`` in the
  ``_prepare_inputs`` wrapper, its topology filled there or, deferred, in ``_preprocess``
  (``complete``), filled by the sampler with the accepted paths and by the GDN layers with what
  the commit needs, cleared when ``sample_tokens`` returns).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor

from vllm_tfm.verify.packed_upload import packed_upload
from vllm_tfm.verify.tree_tables import TreeTables

from .accepted_offsets import AcceptedOffsets
from .sampled_copy import SampledCopy

if TYPE_CHECKING:
    from vllm_tfm.kernels.tree_attention import TreeAttentionPlan
    from vllm_tfm.verify.accept_result import AcceptResult

    from .metrics import Metrics
    from .replay import AcceptanceReplayer
    from .settings import TreeSettings
    from .trace import Tracer

__all__ = [
    "TreeRecord", "ProposalStore", "PLACEHOLDER_DRAFT", "is_placeholder", "GDNStash", "AttnTree", "StepTree", "RuntimeState", "STATE", "LOOKUP_NAMES",
    "LOOKUP_NONE", "LOOKUP_FULL", "LOOKUP_CUT", "LOOKUP_MISS", "LOOKUP_ABSENT", "LOOKUP_OFF",
]


@dataclass(frozen=True)
class TreeRecord:
    """One request's last proposal: B draft tokens and 1 + B local parents (parents[0] = -1)."""

    tokens: tuple[int, ...]
    parents: np.ndarray
    is_chain: bool


LOOKUP_NONE, LOOKUP_FULL, LOOKUP_CUT, LOOKUP_MISS, LOOKUP_ABSENT, LOOKUP_OFF = range(6)
LOOKUP_NAMES = ("", "full", "cut", "miss", "absent", "off")
"""How a request's scheduled drafts were matched to its stored proposal in a step (``StepTree.lookup``):
none (no drafts, or not a spec row), the whole proposal, a prefix of it (the scheduler truncated the
tree: token budget or ``max_model_len``), not a prefix (zeroed or stale drafts: verified as a chain),
no proposal stored, trees off this step (the batch needs vLLM's sampler)."""


def _is_chain(parents: np.ndarray) -> bool:
    return bool(np.array_equal(parents, np.arange(-1, parents.shape[0] - 1)))


PLACEHOLDER_DRAFT = -1
"""The draft id the scheduler holds for a proposal handed out as placeholders (deferred drafts,
``runtime/deferred_drafts.py``); vLLM's own placeholder for spec tokens. Real token ids are >= 0, so
a placeholder never matches a draft's value."""


def is_placeholder(drafts: Sequence[int]) -> bool:
    """Drafts the scheduler holds as placeholders: one or more, all ``PLACEHOLDER_DRAFT``."""
    return len(drafts) > 0 and all(d == PLACEHOLDER_DRAFT for d in drafts)


def _copy_to_host(tokens: Tensor, parents: Tensor, tok_h: Tensor, par_h: Tensor) -> torch.cuda.Event:
    """Queue the copies of a proposal's device tensors into its pinned buffers; the event after them."""
    tok_h.copy_(tokens, non_blocking=True)
    par_h.copy_(parents, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return event


class ProposalStore:
    """req_id -> TreeRecord of the most recent proposal that included the request.

    Deferred drafts (``runtime/deferred_drafts.py``): the scheduler may hold placeholders instead of a
    proposal's tokens. Placeholders stand for the most recent proposal that included the request (the
    scheduler's drafts of a request change only when a proposal including it is handed out, as
    tokens or as placeholders), so ``match`` pairs them with that record by length, and the input ids
    take that proposal's tokens from the device (``device_drafts``, no wait) or, for a request absent
    from the latest proposal, from the host copy (``host_drafts``). This holds on every
    tensor-parallel rank alike, although only rank 0 hands drafts to the scheduler.
    """

    def __init__(self) -> None:
        self._records: dict[str, TreeRecord] = {}
        self._pending: tuple[list[str], Tensor, Tensor, torch.cuda.Event | None] | None = None
        self._latest: tuple[dict[str, int], Tensor, Tensor] | None = None  # row by request, tokens, parents
        self._finish: Callable[[], bool] | None = None  # the latest proposal's deferred build end (finalize)
        self._live: Any = None  # the runner's requests as of the last ``retain`` (pruned at the next ingest)

    def __len__(self) -> int:
        self._ingest()
        return len(self._records)

    def put(self, req_ids: list[str], tokens: Tensor, parents: Tensor,
            finish: Callable[[], bool] | None = None) -> None:
        """Queue the proposal of this step: tokens [R, B] and parents [R, 1 + B] (any device).

        The device-to-host copy is asynchronous (pinned buffers + an event); it is read at the
        next ``lookup`` (not before: the host goes on with vLLM's bookkeeping and scheduling while
        the drafter still runs). ``finish``: the build's deferred end (``weaver_graphs.DeferredTail``),
        called by ``finalize`` before anything reads the proposal; True when it rewrote the tensors.
        """
        if tokens.dim() != 2 or parents.dim() != 2 or parents.shape != (tokens.shape[0], tokens.shape[1] + 1):
            raise ValueError(
                f"tokens must be [R, B] and parents [R, 1 + B], got {tuple(tokens.shape)} and {tuple(parents.shape)}"
            )
        if len(req_ids) != tokens.shape[0]:
            raise ValueError(f"{len(req_ids)} request ids for {tokens.shape[0]} proposals")
        self._ingest()
        if tokens.is_cuda:
            tok_h = torch.empty(tokens.shape, dtype=torch.int64, pin_memory=True)
            par_h = torch.empty(parents.shape, dtype=torch.int64, pin_memory=True)
            event = _copy_to_host(tokens, parents, tok_h, par_h)
        else:
            tok_h, par_h, event = tokens.to(torch.int64).clone(), parents.to(torch.int64).clone(), None
        self._pending = (list(req_ids), tok_h, par_h, event)
        self._finish = finish
        self._latest = ({rid: i for i, rid in enumerate(req_ids)}, tokens, parents)

    def finalize(self) -> None:
        """Run the most recent proposal's deferred end if it has one (may wait for the drafter's end);
        if that rewrote the trees, copy them to the host again. Idempotent."""
        finish, self._finish = self._finish, None
        if finish is None or not finish() or self._latest is None:
            return
        _, tokens, parents = self._latest
        if self._pending is None:  # cannot be: ingesting finalizes first
            return
        req_ids, tok_h, par_h, event = self._pending
        if tokens.is_cuda:
            event = _copy_to_host(tokens, parents, tok_h, par_h)
        else:
            tok_h.copy_(tokens)
            par_h.copy_(parents)
        self._pending = (req_ids, tok_h, par_h, event)

    def latest_is(self, tokens: Any, req_ids: Sequence[str]) -> bool:
        """Whether ``tokens`` is the most recent proposal's tokens tensor (the object the proposer
        returned to vLLM) and ``req_ids`` its requests in its order."""
        if self._latest is None or self._latest[1] is not tokens:
            return False
        rows = self._latest[0]
        return len(rows) == len(req_ids) and all(rows.get(r) == i for i, r in enumerate(req_ids))

    def _ingest(self) -> None:
        if self._pending is None:
            return
        self.finalize()
        req_ids, tok_h, par_h, event = self._pending
        self._pending = None
        if event is not None:
            event.synchronize()
        toks = tok_h.numpy().tolist()  # Python ints for the records, in one call
        pars = par_h.numpy().astype(np.int64)  # a copy: finalize may copy a rewritten proposal into par_h
        chain = np.arange(-1, pars.shape[1] - 1)
        is_chain = (pars == chain).all(axis=1).tolist()
        for i, rid in enumerate(req_ids):
            self._records[rid] = TreeRecord(tuple(toks[i]), pars[i], is_chain[i])
        if self._live is not None:
            live, self._live = self._live, None
            for rid in [r for r in self._records if r not in live]:
                del self._records[rid]

    def latest_parents(self, req_ids: Sequence[str], nodes: int) -> tuple[Tensor, list[int]] | None:
        """(device parents [P, nodes] of the most recent proposal, each request's row in it) when that
        proposal included every one of ``req_ids`` with trees of ``nodes`` nodes (no wait); else None."""
        if self._latest is None:
            return None
        rows_of, _, parents = self._latest
        if parents.shape[1] != nodes:
            return None
        rows = [rows_of.get(r) for r in req_ids]
        return None if any(i is None for i in rows) else (parents, rows)  # type: ignore[return-value]

    def device_drafts(self, req_id: str) -> tuple[Tensor, int] | None:
        """(device tokens [R, B] of the most recent proposal, the request's row) when that proposal
        included ``req_id`` (no wait); None otherwise."""
        if self._latest is None:
            return None
        row = self._latest[0].get(req_id)
        return None if row is None else (self._latest[1], row)

    def host_drafts(self, req_id: str) -> tuple[int, ...] | None:
        """The tokens of the most recent proposal that included ``req_id`` (waits for its host copy),
        or None when none is stored."""
        self._ingest()
        rec = self._records.get(req_id)
        return None if rec is None else rec.tokens

    def provisional_match(self, req_id: str, drafts: Sequence[int]) -> tuple[int, int] | None:
        """(``LOOKUP_FULL`` or ``LOOKUP_CUT``, proposal length) for placeholder drafts of the most recent
        proposal while its host copy is still in flight, without waiting for it; None otherwise (then
        ``match`` costs no wait, or the drafts are not such placeholders)."""
        if self._pending is None or self._latest is None or not is_placeholder(drafts):
            return None
        event = self._pending[3]
        if self._finish is None and event is not None and event.query():  # final and copied: match costs nothing
            return None
        rows, tokens, _ = self._latest
        full = int(tokens.shape[1])
        if req_id not in rows or len(drafts) > full:
            return None
        return (LOOKUP_FULL if len(drafts) == full else LOOKUP_CUT), full

    def lookup(self, req_id: str, drafts: list[int]) -> TreeRecord | None:
        """The record whose tokens start with ``drafts`` (the scheduler may truncate), else None.

        The returned record is cut to the scheduled prefix: 1 + len(drafts) parents (a prefix of a
        topological order is a tree).
        """
        return self.match(req_id, drafts)[0]

    def match(self, req_id: str, drafts: list[int]) -> tuple[TreeRecord | None, int, int]:
        """``lookup`` plus how it went: (record or None, one of the ``LOOKUP_*`` codes, length of
        the stored proposal or 0). Placeholder drafts (``is_placeholder``) match the record by length:
        the input ids carry its tokens (``deferred_drafts.fill_input_ids``)."""
        self._ingest()
        rec = self._records.get(req_id)
        if rec is None:
            return None, LOOKUP_ABSENT, 0
        n, full = len(drafts), len(rec.tokens)
        if n > full or not (is_placeholder(drafts) or tuple(drafts) == rec.tokens[:n]):
            return None, LOOKUP_MISS, full
        if n == full:
            return rec, LOOKUP_FULL, full
        p = rec.parents[: n + 1]
        return TreeRecord(rec.tokens[:n], p, _is_chain(p)), LOOKUP_CUT, full

    def retain(self, live_req_ids: set[str] | dict) -> None:
        """Forget requests that are gone (finished or aborted), at the next ingest of a proposal (now
        when none is pending), so that calling it right after ``put`` does not wait for the copy."""
        if self._pending is not None:
            self._live = live_req_ids
            return
        for rid in [r for r in self._records if r not in live_req_ids]:
            del self._records[rid]


@dataclass
class GDNStash:
    """What one GDN layer's tree verify leaves for the commit (spec rows only, batch order).

    x: [Ts, conv_dim] pre-conv inputs; k: [Ts, H, K] post-conv keys (not normalised);
    g: [Ts, HV] log decays; delta: [Ts, HV, V] (float32/float64); state_indices: [Rs, 1 + S]
    int32 mamba slots; prev_accepted: [Rs] int64, vLLM's num_accepted_tokens before the step;
    conv_state: [slots, conv_dim, L] view; ssm_state: [slots, HV, V, K]; width: conv kernel width.
    """

    x: Tensor
    k: Tensor
    g: Tensor
    delta: Tensor
    state_indices: Tensor
    prev_accepted: Tensor
    conv_state: Tensor
    ssm_state: Tensor
    width: int


@dataclass(frozen=True)
class AttnTree:
    """A request whose tree is not a chain: its rows [start, start + n) need the ancestor mask.

    The per-request form the fallback path (one ``unified_attention`` call per tree) reads; the
    kernel path reads the whole step's ``TreeAttentionPlan`` instead.
    """

    req_index: int
    start: int
    n: int
    bias: Tensor  # [n + pad, n] float32: 0 on ancestor-or-self pairs, -inf elsewhere, zero pad rows
    cu_q: Tensor  # [2] int32 on the device: (0, n), the query_start_loc of a one-request call


STEP_UPLOAD = ("query_start", "req_index", "depth", "num_scheduled", "num_draft", "row_base", "spec_parents",
               "spec_cu", "spec_req_index", "sample_parents", "sample_depth", "sample_cu")
"""The host arrays of a step that the hooks read on the device (copied together by ``StepTree.upload``)."""

DERIVED_UPLOAD = ("sample_nonroot", "replayed")
"""Device-only arrays of ``StepTree.upload``: the logits rows of the drafts ([N - R]) and the
requests acceptance replay replaces (spec rows with drafts, [R] 0/1)."""


@dataclass
class StepTree:
    """Tree metadata of one decode step (host arrays in numpy, device tensors in torch).

    Token-level arrays cover the T scheduled tokens in batch order; ``sample_*`` arrays cover the
    N logits rows of the spec-decode metadata (request r owns its last num_draft[r] + 1 rows).
    """

    num_reqs: int
    num_tokens: int
    tree_active: bool
    query_start: np.ndarray  # [R + 1]
    num_scheduled: np.ndarray  # [R]
    num_draft: np.ndarray  # [R]
    row_base: np.ndarray  # [R] row of each request's root (its first logits row)
    req_index: np.ndarray  # [T] request of each row
    is_spec: np.ndarray  # [R] bool: vLLM's spec-decode rows (in scheduled_spec_decode_tokens, num_scheduled == num_draft + 1)
    is_tree: np.ndarray  # [R] bool: spec row whose tree is not a chain
    local_parent: np.ndarray  # [T] int64, -1 at each request's first row
    depth: np.ndarray  # [T] int64
    sample_parents: np.ndarray  # [N] int64 local
    sample_depth: np.ndarray  # [N] int64
    sample_cu: np.ndarray  # [R + 1] int64
    spec_parents: np.ndarray  # [Ts] int64 local, spec requests only
    spec_cu: np.ndarray  # [Rs + 1]
    spec_req_index: np.ndarray  # [Rs] batch index of each spec request
    ancestor_bits: np.ndarray | None = None  # [T, 1] ancestor-or-self bitmasks of the scheduled rows (small steps)
    device: torch.device | str = "cpu"
    lookup: np.ndarray | None = None  # [R] int8 LOOKUP_* code of each request
    proposal_len: np.ndarray | None = None  # [R] length of the stored proposal its drafts matched (0: none)
    seq_positions: Tensor | None = None  # sequential positions of the T rows (for the drafter)
    accept: "AcceptResult | None" = None
    gdn: dict[str, GDNStash] = field(default_factory=dict)
    graph_capture: Any = None  # full_graphs.TreeGraphs while this is the step of a full tree graph capture
    attn_max_seq_len: int | None = None  # bound of seq_lens the tree attention sizes its key splits by (captures)
    full_graph: bool = False  # replays a full tree graph (full_graphs.TreeGraphs.prepare_replay)
    replay_graphs: Any = None  # the full_graphs.TreeGraphs this step was dispatched to replay (graph_dispatch.py)
    device_topology: bool = False  # its graph's tables and depth positions were written on the device (device_topology.py)
    gdn_tree: bool = False  # not tree-active, but its spec rows' GDN layers take the tree path (one_slot.py)
    _dev: dict[str, Tensor] = field(default_factory=dict, repr=False)
    _attn_trees: list[AttnTree] | None = field(default=None, repr=False)
    _attn_plan: TreeAttentionPlan | None = field(default=None, repr=False)
    _attn_plan_due: bool = field(default=False, repr=False)  # attn_plan is built on first read
    _sample_tables: TreeTables | None = field(default=None, repr=False)
    _uploaded: bool = field(default=False, repr=False)  # the STEP_UPLOAD / DERIVED_UPLOAD arrays are in _dev
    _topology: Callable[[], None] | None = field(default=None, repr=False)  # fills the topology arrays (deferred)
    _after_topology: list[Callable[[StepTree], None]] = field(default_factory=list, repr=False)

    @property
    def tree_gdn(self) -> bool:
        """The spec rows' GDN layers run the tree verify and the commit (``tree_active`` or ``gdn_tree``)."""
        return self.tree_active or self.gdn_tree

    @property
    def topology_pending(self) -> bool:
        """The trees' topology (parents, depths, is_tree, lookup) is not in this step's arrays yet: the
        proposal's host copy is still in flight (deferred drafts); ``complete`` waits for it."""
        return self._topology is not None

    def complete(self) -> StepTree:
        """Fill the topology arrays if they are pending (waits for the proposal's host copy), upload
        them on a tree-active step, then run what waited for them (``after_topology``), in order.
        Idempotent; every reader of the topology arrays (``dev``, ``upload``, ``attn_plan``, the full
        graph's ``prepare_replay``, the step kernels) calls it first."""
        fill, self._topology = self._topology, None
        if fill is not None:
            fill()
            if self.tree_active:
                self.defer_attn_plan()
                self.upload()
        while self._after_topology:
            self._after_topology.pop(0)(self)
        return self

    def after_topology(self, fn: Callable[[StepTree], None]) -> None:
        """Run ``fn(step)`` once the topology arrays are filled: now if they are, else in ``complete``."""
        self._after_topology.append(fn)
        if self._topology is None:
            self.complete()

    @property
    def attn_plan(self) -> TreeAttentionPlan | None:
        """The tree attention plan of the requests whose tree is not a chain (tree-active steps; None when
        none needs a mask). Built on first read (``inputs.attention_plan``): a step that replays a full
        tree graph never reads it (its graph reads the fixed-layout plan of ``full_graphs.py``)."""
        self.complete()
        if self._attn_plan_due:
            from .inputs import attention_plan

            self._attn_plan, self._attn_plan_due = attention_plan(self), False
        return self._attn_plan

    @attn_plan.setter
    def attn_plan(self, plan: TreeAttentionPlan | None) -> None:
        self._attn_plan, self._attn_plan_due = plan, False

    def defer_attn_plan(self) -> None:
        """Build ``attn_plan`` when it is first read instead of now."""
        self._attn_plan, self._attn_plan_due = None, True

    @property
    def attn_trees(self) -> list[AttnTree]:
        """Per-request masks of ``attn_plan`` for the fallback path (built, and copied, on first use)."""
        if self._attn_trees is None:
            from .inputs import per_request_trees

            self._attn_trees = per_request_trees(self.attn_plan, self.device) if self.attn_plan is not None else []
        return self._attn_trees

    def dev(self, name: str) -> Tensor:
        """A host array of this step as an int64 device tensor (read-only; uploaded once, then
        cached). On a tree-active step the arrays of ``STEP_UPLOAD`` and ``DERIVED_UPLOAD`` come
        from :meth:`upload`."""
        t = self._dev.get(name)
        if t is None:
            self.complete()
            if self.tree_gdn and (name in STEP_UPLOAD or name in DERIVED_UPLOAD):
                self.upload()
                return self._dev[name]
            t = torch.from_numpy(np.ascontiguousarray(getattr(self, name), dtype=np.int64)).to(
                self.device, non_blocking=True
            )
            self._dev[name] = t
        return t

    def upload(self) -> None:
        """Copy what the hooks read on the device in one transfer: the ``STEP_UPLOAD`` arrays and the
        ``DERIVED_UPLOAD`` ones. Idempotent; ``build_step_tree`` calls it for every tree-active step
        (with deferred drafts, ``complete`` does, between the drafter's end and the forward's launch)."""
        self.complete()  # a pending topology: fills the arrays and, on a tree-active step, uploads them
        if self._uploaded:
            return
        arrays = {n: getattr(self, n) for n in STEP_UPLOAD if n not in self._dev}
        arrays["sample_nonroot"] = np.nonzero(self.sample_parents >= 0)[0]
        arrays["replayed"] = self.is_spec & (self.num_draft > 0)
        self._dev.update(packed_upload(arrays, self.device))
        self._uploaded = True

    def sample_tables(self) -> TreeTables:
        """The ``TreeTables`` of the logits rows' trees (the tree batch the sampler verifies), built
        with numpy and copied on the first read: the sampler's, after the forward's launch, so off the
        host's path from the drafter's end to the forward (bench/step_host.py)."""
        self.complete()
        if self._sample_tables is None:
            self._sample_tables = TreeTables.from_host(self.sample_parents, self.sample_cu, self.device,
                                                       depth=self.sample_depth)
        return self._sample_tables

    @property
    def num_spec_reqs(self) -> int:
        return int(self.spec_req_index.shape[0])

    @property
    def num_spec_tokens(self) -> int:
        return int(self.spec_parents.shape[0])


class RuntimeState:
    """Process-wide state of the tfm runtime (one tfm model runner per worker process)."""

    def __init__(self) -> None:
        self.step: StepTree | None = None
        self.store = ProposalStore()
        self.settings: "TreeSettings | None" = None
        self.target_attn_layers: frozenset[str] = frozenset()
        self.metrics: "Metrics | None" = None
        self.final_hidden: Tensor | None = None  # target final hidden states of the step (Weaver prompt)
        self.replay: "AcceptanceReplayer | None" = None  # benchmark-only acceptance replay
        self.offsets = AcceptedOffsets()  # GDN state offsets across vLLM's batch removals (accepted_offsets.py)
        self.log_stats = False  # the periodic tfm stats line (hooks._log_interval_stats); rank 0 only
        self.log_stats_interval_s = 10.0
        self.check_tp = False  # VLLM_TFM_CHECK_TP_TREES on a TP > 1 engine (runtime/tensor_parallel.py)
        self.check_step = 0  # steps checked so far (named in a mismatch error)
        self.trace: "Tracer | None" = None  # VLLM_TFM_TRACE: per-request step records (runtime/trace.py), rank 0
        self.defer_drafts = False  # this step's drafts go to the scheduler as placeholders (deferred_drafts.py)
        self.sampled_copy = SampledCopy()  # the step's sampled tokens, copied before drafting (deferred_drafts.py)
        self.draft_fill: Any = None  # deferred_drafts.DraftFill of the running step, applied in _preprocess
        self.one_slot = False  # one GDN state slot per request (gdn_state_slots "one", hybrid target: one_slot.py)

    def current_step(self) -> StepTree | None:
        return self.step


STATE = RuntimeState()
