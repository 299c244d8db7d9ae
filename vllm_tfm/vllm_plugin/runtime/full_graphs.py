"""Tree steps in full CUDA graphs (``cudagraph_mode=FULL_AND_PIECEWISE``).

A full graph replays the whole target forward without running any Python, so the tree code of
``gdn.py`` and ``attention.py`` must be inside the graph with everything that depends on the step's
trees read from device memory at fixed addresses. vLLM 0.26 captures one full graph per uniform
decode batch size (``CudagraphDispatcher``: R requests x (1 + B) tokens, B = num_speculative_tokens),
which is exactly a tree step of R requests (every request verifies B drafts). Here, per engine:

* **Capture.** While vLLM warms up and captures the full graph of R x (B + 1) tokens
  (``GPUModelRunner._warmup_and_capture``), ``STATE.step`` is a capture step of R chains whose
  tables live in this object's persistent buffers: the GDN tree plan in the fixed layout of
  ``TreePlan.build_into`` (addresses, grids, shared memory and scalars depend on R and B only; its
  ``depth_bound``, the drafter's depth, picks version 6's solve at the capture), the
  tree-attention plan of ``TreeAttentionPlan.build_into`` (every request a tree of B + 1 nodes, key
  splits sized for ``max_model_len``), and per GDN layer the tensors the commit reads (pre-conv
  inputs, keys, log decays, deltas: ``LayerStash``). The GDN and attention layers then record the
  same kernels as in any tree step; the warm-up runs (eager) compile them and allocate the stash
  before the capture. What a captured run leaves for the commit (per-layer ``GDNStash`` of views of
  the stash and the slot tensors computed inside the graph) is kept per R.
* **Replay.** When a tree step of R requests, all spec rows of B drafts, is dispatched to the full
  graph of its size (``graph_dispatch.py``), :meth:`TreeGraphs.prepare_replay` writes the step's
  GDN plan and attention bitmasks into the buffers (host-to-device copies ordered before the replay
  on the stream), and installs the kept stashes and slot tensors as the step's ``step.gdn`` and
  kernel tables: the commit after sampling reads what the replay wrote.
* Everything else stays on the piecewise graphs: mixed batches, steps with fewer drafts, steps
  whose trees are verified by vLLM (they would replay a tree graph: such steps never get FULL once
  tree graphs exist).

Full graphs of tree steps need the kernel path of every GDN layer and of the tree attention (the
torch references and the per-request Triton path are not capturable): a capture that would take
another path stops the engine start with a one-line error naming ``cudagraph_mode=PIECEWISE``.
Stage spans (``VLLM_TFM_PROFILE``) are paused during the capture; at replay the layers' inner
spans do not run (the target forward is one span).

Memory: the stash holds, per GDN layer, T = R_max (B + 1) rows of x, q|k, g and delta; at
Qwen3.6-27B's shape with R_max = 8 and B = 32 about 0.7 GB, allocated right after vLLM's memory
profile run (:meth:`TreeGraphs.reserve`), so that vLLM sizes its KV cache without it.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from vllm_tfm.kernels.plan import TreePlan
from vllm_tfm.kernels.tree_attention import TreeAttentionPlan
from vllm_tfm.tree.bitmask import ragged_ancestor_bits

from .stage_timing import TIMER
from .state import STATE, GDNStash, StepTree
from .settings import commit_reuse_enabled
from .step_kernels import CommitReuse, GroupSlots, StepKernels, set_step_kernels

__all__ = ["CapturedTreeGraph", "FullTreeGraphsUnavailable", "LayerStash", "TreeGraphs", "chain_parents", "replayable",
           "uniform_tree_step"]

NEED_KERNELS = "full CUDA graphs of tree steps need the NVRTC kernel path of every GDN layer and of the tree attention"


class FullTreeGraphsUnavailable(RuntimeError):
    """A layer cannot run its tree path as capturable kernels (no NVRTC, a bfloat16 SSM state, a
    configuration the kernels do not take...): raised in a warm-up run of the first capture, after
    which the engine captures vLLM's own full graphs and tree steps replay the piecewise graphs."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"{NEED_KERNELS} ({reason})")
        self.reason = reason


@dataclass
class LayerStash:
    """One GDN layer's persistent copies of what the commit reads, T_max rows each."""

    x: Tensor  # [T_max, conv_dim] pre-conv inputs
    qk: Tensor  # [2, T_max, H, K] q then k after the conv (the verify reads both, the commit k)
    g: Tensor  # [T_max, HV] log decays
    delta: Tensor  # [T_max, HV, V] float32


@dataclass
class CapturedTreeGraph:
    """What the captured run of R requests left for the commit of every replay."""

    num_reqs: int
    stashes: dict[str, GDNStash]
    groups: dict[int, GroupSlots]
    commit_reuse: CommitReuse = field(default_factory=CommitReuse)  # the commit's tables across replays


def chain_parents(num_reqs: int, nodes: int) -> np.ndarray:
    """[R n] local parents of R chains of n nodes (the capture step's trees)."""
    one = np.arange(-1, nodes - 1, dtype=np.int64)
    return np.tile(one, num_reqs)


def uniform_tree_step(step: StepTree, nodes: int) -> bool:
    """True when every request of the step is a spec row verifying a tree of ``nodes`` nodes (host data)."""
    return (
        step.tree_active
        and step.num_reqs > 0
        and step.num_spec_reqs == step.num_reqs
        and step.num_tokens == step.num_reqs * nodes
        and bool((step.num_scheduled == nodes).all())
        and step.spec_parents.shape[0] == step.num_tokens
    )


def replayable(step: StepTree | None, nodes: int, captured: set[int] | dict[int, Any]) -> bool:
    """True when a full tree graph of this step's size was captured and the step fits it."""
    return step is not None and uniform_tree_step(step, nodes) and step.num_reqs in captured


class TreeGraphs:
    """Persistent buffers and captures of one engine's full tree graphs (module docstring)."""

    def __init__(self, budget: int, max_reqs: int, max_seq_len: int, device: torch.device,
                 depth_bound: int | None = None) -> None:
        if budget < 1 or max_reqs < 1:
            raise ValueError(f"budget and max_reqs must be >= 1, got {budget} and {max_reqs}")
        if depth_bound is not None and depth_bound < 1:
            raise ValueError(f"depth_bound must be >= 1, got {depth_bound}")
        self.budget = int(budget)
        self.nodes = self.budget + 1
        # the drafter's depth (settings.max_depth): the GDN plans' depth_bound, which lets version 6
        # take its path solve on these plans (kernels.gdn.grouped_solve; exact for deeper trees too)
        self.depth_bound = None if depth_bound is None else int(depth_bound)
        self.max_reqs = int(max_reqs)
        self.max_seq_len = int(max_seq_len)
        self.device = torch.device(device)
        self.plan_buffer = torch.zeros(TreePlan.fixed_size(self.max_reqs, self.nodes), dtype=torch.int32, device=device)
        # one region per R: a replay writes only the bitmasks of its region (its meta stays from the first
        # write), so regions must not overlap; with one shared region, the replays of another R overwrote
        # the meta of R's plan, which its graph then read (bench/NOTES.md section 50)
        sizes = [TreeAttentionPlan.fixed_size(r, self.nodes) for r in range(1, self.max_reqs + 1)]
        self.attn_buffer = torch.zeros(sum(sizes), dtype=torch.int64, device=device)
        self._attn_regions = list(torch.split(self.attn_buffer, sizes))  # region of R: entry R - 1 (views, made once)
        self.layers: dict[str, LayerStash] = {}
        self.captured: dict[int, CapturedTreeGraph] = {}
        # the plans of the last replay of each R: the next one reuses their views and writes only contents
        self._plans: dict[int, TreePlan] = {}
        self._attn_plans: dict[int, TreeAttentionPlan] = {}
        self._capture_step: StepTree | None = None
        self._last_replay = 0  # R of the last replay (0: none yet)

    # ---- sizes -------------------------------------------------------------------------------
    def requests_of(self, num_tokens: int) -> int:
        """R of a uniform decode batch of ``num_tokens`` tokens; ValueError when no tree graph fits it."""
        r, rest = divmod(int(num_tokens), self.nodes)
        if rest or not 1 <= r <= self.max_reqs:
            raise ValueError(
                f"vllm-tfm: a full CUDA graph of {num_tokens} tokens is not a tree step of 1..{self.max_reqs} requests x "
                f"{self.nodes} tokens; set cudagraph_capture_sizes to multiples of {self.nodes} or use cudagraph_mode=PIECEWISE"
            )
        return r

    @property
    def capturing(self) -> bool:
        return self._capture_step is not None

    @property
    def capture_reqs(self) -> int:
        """R of the capture in progress (0 when none)."""
        return 0 if self._capture_step is None else self._capture_step.num_reqs

    def attn_region(self, num_reqs: int) -> Tensor:
        """The part of ``attn_buffer`` that holds the tree-attention plan of R requests (capture and replays)."""
        if not 1 <= num_reqs <= self.max_reqs:
            raise ValueError(f"num_reqs must be in 1..{self.max_reqs}, got {num_reqs}")
        return self._attn_regions[num_reqs - 1]

    # ---- capture -----------------------------------------------------------------------------
    def _step_for(self, num_reqs: int) -> StepTree:
        """The capture step of R chains, its tables written into the buffers."""
        n, r = self.nodes, num_reqs
        parents = chain_parents(r, n)
        qs = np.arange(r + 1, dtype=np.int64) * n
        depth = np.tile(np.arange(n, dtype=np.int64), r)
        sched = np.full(r, n, dtype=np.int64)
        step = StepTree(
            num_reqs=r,
            num_tokens=r * n,
            tree_active=True,
            query_start=qs,
            num_scheduled=sched,
            num_draft=sched - 1,
            row_base=qs[:-1].copy(),
            req_index=np.repeat(np.arange(r, dtype=np.int64), n),
            is_spec=np.ones(r, dtype=bool),
            is_tree=np.ones(r, dtype=bool),
            local_parent=parents,
            depth=depth,
            sample_parents=parents,
            sample_depth=depth,
            sample_cu=qs,
            spec_parents=parents,
            spec_cu=qs,
            spec_req_index=np.arange(r, dtype=np.int64),
            device=self.device,
        )
        step.graph_capture = self
        step.attn_max_seq_len = self.max_seq_len
        step.attn_plan = TreeAttentionPlan.build_into(self.attn_region(r), qs[:-1], parents, n)
        for name in ("spec_parents", "spec_cu"):  # read by the layers' fallback paths only: never uploaded in a capture
            step._dev[name] = torch.from_numpy(getattr(step, name).copy()).to(self.device)
        return step

    @contextlib.contextmanager
    def capture(self, num_reqs: int) -> Iterator[None]:
        """The warm-up runs and the capture of the full graph of R requests run inside this context."""
        if self._capture_step is not None:
            raise RuntimeError("vllm-tfm: nested full tree graph captures")
        saved_step, saved_timer = STATE.step, TIMER.enabled
        self._capture_step = self._step_for(num_reqs)
        STATE.step = self._capture_step
        TIMER.enabled = False
        try:
            yield
        finally:
            STATE.step, TIMER.enabled = saved_step, saved_timer
            self._capture_step = None
            set_step_kernels(None)

    def begin_run(self) -> None:
        """Before each dummy run of a capture: fresh kernel tables and no stash (a run computes its own)."""
        step = self._capture_step
        if step is None:
            return
        plan = TreePlan.build_into(self.plan_buffer, torch.from_numpy(step.spec_parents), torch.from_numpy(step.spec_cu),
                                   self.nodes, depth_bound=self.depth_bound)
        step.gdn = {}
        set_step_kernels(StepKernels(step, self.device, plan=plan, one_slot=STATE.one_slot))

    def end_capture_run(self, tables: StepKernels | None) -> None:
        """After the run that captured the graph: keep its stashes and slot tensors for the replays."""
        step = self._capture_step
        if step is None:
            return
        if tables is None:
            raise RuntimeError(f"vllm-tfm: {NEED_KERNELS} (the capture ran without the step's kernel tables)")
        self.captured[step.num_reqs] = CapturedTreeGraph(step.num_reqs, dict(step.gdn), dict(tables.groups))

    def layer_stash(self, prefix: str, x: Tensor, num_k_heads: int, head_k_dim: int, g_dtype: torch.dtype,
                    num_v_heads: int, head_v_dim: int, qk_dtype: torch.dtype) -> LayerStash:
        """The persistent stash of GDN layer ``prefix``: the one :meth:`reserve` made when its shapes and
        dtypes are these, else allocated now (never inside a stream capture: the warm-up runs come first)."""
        return self.reserve(prefix, x.shape[1], x.dtype, num_k_heads, head_k_dim, qk_dtype, num_v_heads, head_v_dim,
                            g_dtype, x.device)

    def reserve(self, prefix: str, conv_dim: int, x_dtype: torch.dtype, num_k_heads: int, head_k_dim: int,
                qk_dtype: torch.dtype, num_v_heads: int, head_v_dim: int, g_dtype: torch.dtype,
                device: torch.device | str) -> LayerStash:
        """Allocate (or find) the stash of GDN layer ``prefix`` for T_max = R_max (B + 1) rows. Called for
        every GDN layer right after vLLM's memory profile run (``hooks._wrap_profile_run``), so that the
        stash is in the memory vLLM leaves out of its KV cache; the capture then finds it."""
        t = self.max_reqs * self.nodes
        want = {"x": ((t, conv_dim), x_dtype), "qk": ((2, t, num_k_heads, head_k_dim), qk_dtype),
                "g": ((t, num_v_heads), g_dtype), "delta": ((t, num_v_heads, head_v_dim), torch.float32)}
        found = self.layers.get(prefix)
        dev = torch.device(device)
        if found is not None and all(
            tuple(getattr(found, k).shape) == shape and getattr(found, k).dtype == dt and getattr(found, k).device == dev
            for k, (shape, dt) in want.items()
        ):
            return found
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"vllm-tfm: the tree stash of {prefix} would be allocated inside a CUDA graph capture")
        stash = LayerStash(**{k: torch.empty(shape, dtype=dt, device=dev) for k, (shape, dt) in want.items()})
        self.layers[prefix] = stash
        return stash

    # ---- replay ------------------------------------------------------------------------------
    def replay_layouts(self, num_reqs: int) -> tuple[TreePlan, TreeAttentionPlan] | None:
        """The plan and the tree attention plan a replay of R requests wrote last (their tables live in
        ``plan_buffer`` / ``attn_region(R)`` at addresses fixed by R), or None before the first one: what
        a device-side fill of the same tables writes into (device_topology.py)."""
        plan, attn = self._plans.get(num_reqs), self._attn_plans.get(num_reqs)
        return None if plan is None or attn is None else (plan, attn)

    def prepare_replay(self, step: StepTree) -> None:
        """Write the step's trees into the buffers and give it the captured stashes and slot tensors
        (the step replays the full graph of its size next)."""
        step.complete()
        cap = self.captured.get(step.num_reqs)
        if cap is None or not uniform_tree_step(step, self.nodes):
            raise RuntimeError(f"vllm-tfm: no full tree graph fits this step ({step.num_reqs} requests)")
        r = step.num_reqs
        # a replay of a size replayed before, after one of another size: the case in which plans of
        # different sizes sharing memory would go wrong (bench/NOTES.md section 50); counted so that a
        # check can tell whether a run exercised it (``_plans`` holds every size replayed before)
        returned = r != self._last_replay and r in self._plans
        self._last_replay = r
        if step.device_topology:  # the tables are in the buffers already (device_topology.py), same layout
            plan = self._plans[r]
        else:
            # a uniform step's rows are its spec rows in order: one set of ancestor bitmasks serves both
            # plans, computed with the step's depths when it is small (inputs._topology_arrays)
            bits = step.ancestor_bits if step.ancestor_bits is not None else ragged_ancestor_bits(step.spec_parents,
                                                                                                   step.spec_cu)
            plan = TreePlan.build_into(self.plan_buffer, step.spec_parents, step.spec_cu, self.nodes,
                                       ancestor_bits=bits, depth_bound=self.depth_bound, layout=self._plans.get(r))
            self._attn_plans[r] = TreeAttentionPlan.build_into(self.attn_region(r), step.query_start[:-1],
                                                               step.local_parent, self.nodes, ancestor_bits=bits,
                                                               layout=self._attn_plans.get(r))
            self._plans[r] = plan
        step.gdn = dict(cap.stashes)
        groups = {key: dataclasses.replace(g, commit=None) for key, g in cap.groups.items()}
        reuse = cap.commit_reuse if commit_reuse_enabled() else None
        set_step_kernels(StepKernels(step, self.device, plan=plan, groups=groups, commit_reuse=reuse,
                                     one_slot=STATE.one_slot))
        step.full_graph = True
        if STATE.metrics is not None:
            STATE.metrics.hook("cudagraph.tree.full_replay")
            if returned:
                STATE.metrics.hook("cudagraph.tree.full_size_return")
