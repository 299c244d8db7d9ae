"""The NVRTC tree kernels' tables, built once per tree-active step and shared by every GDN layer.

The public kernel entry points (``vllm_tfm.kernels.gdn_tree_verify`` and the three others) are
library calls: each validates its arguments and builds a ``TreePlan``, with device-to-host copies
of the tree, the slot indices and the accepted nodes. The runtime calls four of them per GDN layer
per step (192 calls per step at Qwen3.6-27B's 48 GDN layers), so doing that work per call would
put hundreds of host synchronisations and plan builds into every decode step. Here:

* the plan is built once per step from the host copy of the spec requests' trees
  (``StepTree.spec_parents`` / ``spec_cu``, numpy: validated on the host, one host-to-device
  copy, no synchronisation);
* the state slots each GDN layer reads (``[n, num_accepted - 1]``) and the commit indices are
  computed once per step and KV-cache group on the device (vLLM gives every layer of a group the
  same metadata tensors), without a synchronisation;
* every layer then launches the ``*_planned`` kernels.

The commit indices carry no snapshot: every running request owns its own 1 + S GDN state blocks
(vLLM's mamba_cache_mode "none"), so no request's source slot is another request's destination,
the case the library's snapshot exists for. Layers whose tensors the kernels do not take (e.g. a
bfloat16 SSM state) use the library calls as before, which fall back to the torch references with
their one-time warning.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from vllm_tfm.kernels.plan import CommitIndices, TreePlan

from .kernels_or_reference import tree_ops
from .settings import RuntimeSwitch
from .state import STATE, StepTree

__all__ = ["ONE_SLOT_COMMIT_ENV", "CommitReuse", "GroupSlots", "StepKernels", "current_step_kernels",
           "one_slot_commit_enabled", "set_one_slot_commit", "set_step_kernels", "step_kernels"]

ONE_SLOT_COMMIT_ENV = "VLLM_TFM_ONE_SLOT_COMMIT"
_OSC = RuntimeSwitch(ONE_SLOT_COMMIT_ENV, "set_one_slot_commit")


def one_slot_commit_enabled() -> bool:
    """``VLLM_TFM_ONE_SLOT_COMMIT`` unset or not 0 / false (default on), unless ``set_one_slot_commit`` overrode it:
    an engine with one GDN state slot per request takes its commit indices from the slot column 0
    (``StepKernels._one_slot_commit_indices``) instead of the general path's gather and copies per KV-cache group."""
    return _OSC.enabled()


def set_one_slot_commit(on: bool | None) -> bool:
    """Override ``VLLM_TFM_ONE_SLOT_COMMIT`` in this process (None: back to the environment's); the setting now in
    force, read by every ``StepKernels`` made from then on. For a same-engine A/B through ``collective_rpc``."""
    return _OSC.set(on)


@dataclass
class CommitReuse:
    """What the commit of a full graph's replays (one batch size) keeps across steps
    (``VLLM_TFM_COMMIT_REUSE``, default on).

    A full graph's replays give every step the same stash tensors and slot tensors, so the batched
    commit's table rows (addresses and strides, ``kernels.batched_commit``) would be the same every
    step but for the per-step commit indices. Here those indices live in tensors filled in place each
    step (``StepKernels.commit_indices``), so the rows do not change at all: the commit launches the
    tables it uploaded at the first replay (``uploaded``), and the per-layer kernel checks, which read
    only the stash tensors' metadata, ran once for these tensors (``checked``). Host work per step:
    two small index writes, three per KV-cache group, and the launches, instead of 48 layers' checks,
    rows and an upload.

    indices: by ``id`` of a group's slot tensor: (that tensor, GDN indices, conv indices);
    shared: (accepted node int32 [R], p int32 [R], zeros int32 [R]), shared by every group.
    """

    indices: dict[int, tuple[Tensor, CommitIndices, CommitIndices]] = field(default_factory=dict)
    shared: tuple[Tensor, Tensor, Tensor] | None = None
    checked: tuple[object, ...] | None = None
    uploaded: object | None = None  # kernels.batched_commit.UploadedCommit


@dataclass
class GroupSlots:
    """The slots of one KV-cache group's GDN layers this step (spec requests, batch order).

    slots: [Rs, 1 + S] int64 (vLLM's spec_state_indices_tensor); prev_accepted: [Rs] int64 (vLLM's
    num_accepted_tokens, >= 1); start: prev_accepted - 1, the committed column / slot offset;
    read_slot: [Rs] the SSM slot the verify starts from; conv_slot: [Rs] int32, the conv window
    slot; start32: start as int32 (the conv kernel's column offsets).
    """

    slots: Tensor
    prev_accepted: Tensor
    start: Tensor
    read_slot: Tensor
    conv_slot: Tensor
    start32: Tensor
    source: Tensor  # the metadata tensor these were derived from (kept alive: its id is the key)
    commit: tuple[CommitIndices, CommitIndices] | None = field(default=None)


class StepKernels:
    """Kernel tables of one tree-active step (module docstring)."""

    def __init__(self, step: StepTree, device: torch.device, plan: TreePlan | None = None,
                 groups: dict[int, GroupSlots] | None = None, commit_reuse: CommitReuse | None = None,
                 one_slot: bool = False) -> None:
        """plan: the step's tree plan when already built (a fixed-layout plan of full CUDA graphs,
        ``full_graphs.py``), else built here from the step's trees; groups: the slots of each
        KV-cache group when they are known already (computed by a captured graph), else computed on
        first use; commit_reuse: a full graph's ``CommitReuse`` (its groups' slot tensors are the same
        objects every replay), None to make the commit indices anew; one_slot: the engine keeps one GDN state
        slot per request (``gdn_state_slots: "one"``, one_slot.py), so every commit reads and writes slot
        ``[n, 0]`` from conv column 0 (``_one_slot_commit_indices``; the general path's indices, which are the
        same values, with ``VLLM_TFM_ONE_SLOT_COMMIT=0``)."""
        self.commit_reuse = commit_reuse
        self.one_slot = one_slot and one_slot_commit_enabled()
        if isinstance(step, StepTree):
            step.complete()  # its topology arrays, if they were pending (deferred drafts)
        self.step = step
        self.device = device
        self.plan = plan if plan is not None else TreePlan.build(
            torch.from_numpy(step.spec_parents), torch.from_numpy(step.spec_cu), device=device
        )
        self._groups: dict[int, GroupSlots] = dict(groups) if groups else {}
        self._block_v: dict[tuple[int, int, int], int | None] = {}
        self._variant: dict[tuple, int] = {}
        self._accepted: tuple[Tensor, ...] | None = None  # commit indices shared by every group
        self._one_slot_shared: tuple[Tensor, Tensor, Tensor] | None = None  # the same, one GDN state slot per request

    @property
    def groups(self) -> dict[int, GroupSlots]:
        """The groups computed so far, by ``id`` of their metadata tensor."""
        return self._groups

    def group(self, state_indices: Tensor, num_accepted: Tensor) -> GroupSlots:
        """The slots of the group whose metadata holds ``state_indices`` [Rs, 1 + S] (computed once)."""
        found = self._groups.get(id(state_indices))
        if found is not None:
            return found
        slots = state_indices.to(torch.long)
        prev = num_accepted.to(torch.long)
        start = prev - 1
        g = GroupSlots(
            slots=slots,
            prev_accepted=prev,
            start=start,
            read_slot=slots.gather(1, start[:, None]).squeeze(1),
            conv_slot=slots[:, 0].to(torch.int32),
            start32=start.to(torch.int32),
            source=state_indices,
        )
        self._groups[id(state_indices)] = g
        return g

    def group_of(self, slots: Tensor) -> GroupSlots | None:
        """The group whose ``slots`` tensor this is (a stash keeps it), else None."""
        for g in self._groups.values():
            if g.slots is slots:
                return g
        return None

    def block_v(self, v_heads: int, k_dim: int, v_dim: int) -> int | None:
        """V columns per CTA of the verify kernel for this step's trees (None: a tree does not fit)."""
        key = (v_heads, k_dim, v_dim)
        if key not in self._block_v:
            from vllm_tfm.kernels.gdn import choose_block_v
            from vllm_tfm.kernels.loader import device_smem_optin

            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            sms = torch.cuda.get_device_properties(index).multi_processor_count
            self._block_v[key] = choose_block_v(self.plan, v_heads, k_dim, v_dim, device_smem_optin(index), sms)
        return self._block_v[key]

    def verify_variant(self, qk_dtype: torch.dtype, k_heads: int, v_heads: int, k_dim: int, v_dim: int) -> int:
        """The GDN verify kernel version of a layer of this shape, decided once per step and shape (not per
        layer): ``VLLM_TFM_GDN_VERIFY`` pinned to a version, or ``auto``: ``runtime_verify_variant`` on this
        step's plan."""
        key = (qk_dtype, k_heads, v_heads, k_dim, v_dim)
        if key not in self._variant:
            from .settings import verify_version_setting

            pinned = verify_version_setting()
            if pinned is not None:
                self._variant[key] = pinned
            else:
                from vllm_tfm.kernels.gdn import runtime_verify_variant
                from vllm_tfm.kernels.loader import device_smem_optin

                index = self.device.index if self.device.index is not None else torch.cuda.current_device()
                sms = torch.cuda.get_device_properties(index).multi_processor_count
                self._variant[key] = runtime_verify_variant(self.plan, qk_dtype, k_heads, v_heads, k_dim, v_dim,
                                                            device_smem_optin(index), sms)
        return self._variant[key]

    def commit_indices(self, group: GroupSlots, last_node: Tensor, num_accepted: Tensor) -> tuple[CommitIndices, CommitIndices]:
        """(GDN state, conv window) commit indices of the group, computed once per step on the device.

        last_node, num_accepted: [Rs] the deepest accepted node and the accepted draft count p.
        GDN: slot [n, prev - 1] -> slot [n, p]; conv: slot [n, 0], columns prev - 1 .. -> p ...
        The parts that do not depend on the group (accepted nodes, p as int32, zeros) are made once
        per step and shared by all groups (read-only). With one GDN state slot per request
        (``one_slot``) the indices are the slot column 0 and zeros (``_one_slot_commit_indices``).
        """
        if group.commit is None and self.one_slot:
            group.commit = self._one_slot_commit_indices(group, last_node)
        if group.commit is None and self.commit_reuse is not None:
            group.commit = self._reused_commit_indices(self.commit_reuse, group, last_node, num_accepted)
        if group.commit is None:
            shared = self._accepted
            if shared is None or shared[0] is not last_node or shared[1] is not num_accepted:
                acc = last_node.to(device=self.device, dtype=torch.int32)
                p = num_accepted.to(device=self.device, dtype=torch.long)
                shared = self._accepted = (last_node, num_accepted, acc, p, p.to(torch.int32), torch.zeros_like(acc))
            _, _, acc, p, p32, zeros = shared
            dst = group.slots.gather(1, p[:, None]).squeeze(1).to(torch.int32)
            conv = group.conv_slot
            group.commit = (
                CommitIndices(acc, group.read_slot.to(torch.int32), dst, zeros, zeros, None),
                CommitIndices(acc, conv, conv, group.start32, p32, None),
            )
        return group.commit

    def _one_slot_commit_indices(self, group: GroupSlots, last_node: Tensor) -> tuple[CommitIndices, CommitIndices]:
        """``commit_indices`` of an engine with one GDN state slot per request (``gdn_state_slots: "one"``,
        one_slot.py): the layers read slot ``[n, 0]`` (their ``prev_accepted`` is ``read_offsets``, all 1, so
        ``start`` is 0) and the commit writes it (``commit_destinations``: p = 0), so the GDN source and
        destination are both ``slots[:, 0]``, which is the group's ``conv_slot`` (int32), and the offsets are
        zeros; vLLM's slot table is still 1 + B columns wide, of which only column 0 is read. Only the accepted
        node changes from step to step: one int32 copy per step, shared by every group, and no launch per group
        (the general path gathers and copies three times per KV-cache group, ~27 launches per 27B step:
        bench/NOTES.md section 67). With ``commit_reuse`` the copy goes into the reused tensor, so the uploaded
        commit tables stay valid (the groups' slot tensors are the captured graph's, the same objects every
        replay)."""
        r = last_node.shape[0]
        reuse = self.commit_reuse
        shared = self._one_slot_shared
        if shared is None or shared[0] is not last_node:
            if reuse is not None:
                acc, _, zeros = self._reuse_shared(reuse, r)
                acc.copy_(last_node)
            else:
                acc = last_node.to(device=self.device, dtype=torch.int32)
                zeros = torch.zeros_like(acc)
            shared = self._one_slot_shared = (last_node, acc, zeros)
            if STATE.metrics is not None:
                STATE.metrics.hook("commit.one_slot_indices")
        _, acc, zeros = shared
        conv = group.conv_slot
        return CommitIndices(acc, conv, conv, zeros, zeros, None), CommitIndices(acc, conv, conv, group.start32, zeros, None)

    def _reuse_shared(self, reuse: CommitReuse, r: int) -> tuple[Tensor, Tensor, Tensor]:
        """``reuse``'s (accepted node, p, zeros) int32 [r] tensors, made at the first call for r requests (the
        kept per-group indices, made for another r, are dropped then)."""
        if reuse.shared is None or reuse.shared[0].shape[0] != r:
            reuse.shared = tuple(torch.zeros(r, dtype=torch.int32, device=self.device) for _ in range(3))  # type: ignore[assignment]
            reuse.indices.clear()
        return reuse.shared  # type: ignore[return-value]

    def _reused_commit_indices(self, reuse: CommitReuse, group: GroupSlots, last_node: Tensor,
                               num_accepted: Tensor) -> tuple[CommitIndices, CommitIndices]:
        """``commit_indices`` written into ``reuse``'s tensors (made at the first call): the same values,
        the same tensor objects every step."""
        r = last_node.shape[0]
        acc, p32, zeros = self._reuse_shared(reuse, r)
        shared = self._accepted
        if shared is None or shared[0] is not last_node or shared[1] is not num_accepted:
            acc.copy_(last_node)
            p32.copy_(num_accepted)
            shared = self._accepted = (last_node, num_accepted, num_accepted.to(device=self.device, dtype=torch.long))
        p = shared[2]
        entry = reuse.indices.get(id(group.slots))
        if entry is None or entry[0] is not group.slots:
            src, dst = torch.empty(r, dtype=torch.int32, device=self.device), torch.empty(r, dtype=torch.int32, device=self.device)
            conv = group.conv_slot
            entry = (group.slots, CommitIndices(acc, src, dst, zeros, zeros, None),
                     CommitIndices(acc, conv, conv, group.start32, p32, None))
            reuse.indices[id(group.slots)] = entry
        _, gdn_idx, conv_idx = entry
        gdn_idx.src.copy_(group.read_slot)
        gdn_idx.dst.copy_(group.slots.gather(1, p[:, None]).squeeze(1))
        return gdn_idx, conv_idx


_CURRENT: dict[str, StepKernels | None] = {"tables": None}


def current_step_kernels(step: StepTree | None) -> StepKernels | None:
    """The tables made for ``step`` so far (None when there are none or they belong to another step)."""
    tables = _CURRENT["tables"]
    return tables if tables is not None and step is not None and tables.step is step else None


def set_step_kernels(tables: StepKernels | None) -> None:
    """Make ``tables`` the current step's tables (``step_kernels`` returns them for their step)."""
    _CURRENT["tables"] = tables


def step_kernels(step: StepTree, device: torch.device) -> StepKernels | None:
    """This step's tables when the four tree operations run as kernels in this process, else None."""
    if set(tree_ops().sources.values()) != {"kernels"} or device.type != "cuda":
        return None
    tables = _CURRENT["tables"]
    if tables is None or tables.step is not step:
        tables = StepKernels(step, device, one_slot=STATE.one_slot)
        _CURRENT["tables"] = tables
    return tables
