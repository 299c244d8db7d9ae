"""Full CUDA graphs of the DFlash drafter's query forward (``VLLM_TFM_DRAFTER_GRAPHS=1``, opt-in).

vLLM 0.26 captures only piecewise graphs for a drafter (``SpecDecodeBaseProposer.initialize_cudagraph_keys``,
v1/spec_decode/llm_base_proposer.py:411-426): between the pieces, each drafter attention layer runs eagerly
(``unified_kv_cache_update`` and ``unified_attention_with_output``), one piece's replay after another's. At the
27B shape the DFlash stage of a batch-1 step spans ~0.25 ms more than its kernels on an H100 (bench/NOTES.md
section 67's trace: 86 launches); on an H200 it is ~0.7 ms above its FP8 weights' byte floor (an estimate from
section 68's 1.50 ms stage and the H100 trace's kernel times; not traced there). Measured (section 70, an H100):
the graphs replay and the drafts are the same, but a 27B step is not shorter beyond a same-engine A/B's ~0.3 ms
resolution at batch 1 or 8. The likely reason (section 67's trace: a batch-1 step is 95% GPU-busy): with
asynchronous scheduling the host queues the drafter while the GPU still runs the target's forward, so the piecewise
launches were not on the GPU's path, and graphs save host work only. Opt-in.

Here a tree step's drafter forward (R requests x (1 + D) query tokens each, the same count for every request)
replays one full graph per key (R, 1 + D):

* inputs: the forward reads buffers at fixed addresses: vLLM's ``input_ids``, ``positions`` and query slot
  mapping (written each step by DFlash's ``copy_and_expand_dflash_inputs_kernel``, v1/spec_decode/dflash.py
  :140-167), the runner's block table (a view from row 0 of its persistent tensor), and two tensors DFlash makes
  anew every step, the query start offsets and the sequence lengths (dflash.py:170, 176-186), which
  :meth:`DrafterGraphs.persistent_metadata` copies into buffers of its own (two copies on the device) and puts
  into the step's attention metadata in their place (``TFMProposer.set_inputs_first_pass``). The TRITON_ATTN
  backend's kernel takes every host-side decision from shapes and constants at these sizes (queries of
  1 + D > 1 rows: the 2D kernel), so a graph captured at one sequence length replays at any other;
* dispatch: such a step runs in CUDAGraphMode FULL, unpadded (``TFMProposer._determine_batch_execution_and_padding``),
  so the piecewise wrappers inside the compiled model pass the call through to the compiled pieces
  (compilation/cuda_graph.py:244-254) and the attention ops run inside the same capture;
* capture: a key's first step runs eagerly (Triton compiles its kernels outside any capture); its second is
  captured on a side stream into one memory pool shared by every key, then replayed; every later step of that
  key replays. A capture that raises is logged once with its traceback and turns the graphs off for good (every
  key back on the piecewise graphs): on an H100 the first failure left the pool so that every later capture
  failed in the caching allocator (bench/NOTES.md section 69);
* output: the forward's output lives in the pool until the next replay; vLLM's proposer gathers the sampled
  rows out of it at once (llm_base_proposer.py:605).

The same kernels in the same order as the eager run of the compiled pieces, so the same marginals. The
context K/V (``precompute_and_store_context_kv``) stays eager before the forward. Not with tensor, pipeline or
data parallelism (collectives, DP padding): the proposer makes no :class:`DrafterGraphs` there.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from .settings import RuntimeSwitch

__all__ = ["DRAFTER_GRAPHS_ENV", "DrafterGraphs", "drafter_graphs_enabled", "drafter_graphs_from_env",
           "set_drafter_graphs"]

logger = logging.getLogger("vllm.tfm")

DRAFTER_GRAPHS_ENV = "VLLM_TFM_DRAFTER_GRAPHS"
_SWITCH = RuntimeSwitch(DRAFTER_GRAPHS_ENV, "set_drafter_graphs", default_on=False)

T = TypeVar("T")
Key = tuple[int, int]  # (requests, query tokens per request)


def drafter_graphs_enabled() -> bool:
    """``VLLM_TFM_DRAFTER_GRAPHS`` set to 1 / true (default off), unless ``set_drafter_graphs`` overrode it: read when
    the proposer is made (an engine started without it never takes the graphs: vLLM's DFlash path unchanged) and at
    every step of an engine started with it (a same-engine A/B) (module docstring)."""
    return _SWITCH.enabled()


def drafter_graphs_from_env(environ: Mapping[str, str]) -> bool:
    """What ``drafter_graphs_enabled`` says in a process with this environment and no override (the benches'
    verdicts on their engines)."""
    return _SWITCH.enabled_in(environ)


def set_drafter_graphs(on: bool | None) -> bool:
    """Override ``VLLM_TFM_DRAFTER_GRAPHS`` in this process (None: back to the environment's); the setting now in
    force, read at every drafter forward of an engine that started with the graphs. For a same-engine A/B through
    ``collective_rpc``."""
    return _SWITCH.set(on)


@dataclass
class Captured:
    """One key's graph and what its captured forward returned (tensors in the graphs' pool)."""

    graph: Any  # torch.cuda.CUDAGraph
    output: Any


class DrafterGraphs:
    """The full drafter graphs of one proposer, their persistent metadata buffers and their counters.

    ``capture`` (tests): a function ``forward -> Captured`` used instead of CUDA graph capture."""

    def __init__(self, max_requests: int, device: torch.device,
                 capture: Callable[[Callable[[], Any]], Captured] | None = None) -> None:
        if max_requests < 1:
            raise ValueError(f"DrafterGraphs: max_requests must be >= 1, got {max_requests}")
        self.max_requests = max_requests
        self.device = torch.device(device)
        self._query_start = torch.zeros(max_requests + 1, dtype=torch.int32, device=self.device)
        self._seq_lens = torch.zeros(max_requests, dtype=torch.int32, device=self.device)
        self._graphs: dict[Key, Captured] = {}
        self._warm: set[Key] = set()  # keys that ran eagerly once
        self.failed: str | None = None  # why a capture failed (then no key is taken any more)
        self._capture_fn = capture
        self._pool: Any = None
        self._stream: torch.cuda.Stream | None = None
        self.captures = 0
        self.replays = 0

    def key(self, num_requests: int, query_per_request: int, num_tokens: int) -> Key | None:
        """The graph key of a drafter forward of ``num_tokens`` query rows, or None where it takes none: another
        row count than R x (1 + D) (requests with different query counts), more requests than the buffers hold,
        or any forward after a failed capture."""
        k = (int(num_requests), int(query_per_request))
        if not 1 <= k[0] <= self.max_requests or k[1] < 1 or int(num_tokens) != k[0] * k[1] or self.failed is not None:
            return None
        return k

    def persistent_metadata(self, cad: Any, key: Key) -> Any:
        """``cad`` (vLLM's CommonAttentionMetadata of the drafter's queries) with its query start offsets and
        sequence lengths copied into this object's buffers (fixed addresses for the graphs)."""
        r = key[0]
        query_start = self._query_start[: r + 1]
        seq_lens = self._seq_lens[:r]
        query_start.copy_(cad.query_start_loc[: r + 1], non_blocking=True)
        seq_lens.copy_(cad.seq_lens[:r], non_blocking=True)
        return cad.replace(query_start_loc=query_start, seq_lens=seq_lens)

    @property
    def keys(self) -> tuple[Key, ...]:
        """The keys captured so far."""
        return tuple(self._graphs)

    def run(self, key: Key, forward: Callable[[], T]) -> T:
        """This step's forward of ``key``: the graph's replay where it was captured, else eagerly the first time,
        else captured and replayed (module docstring)."""
        captured = self._graphs.get(key)
        if captured is None:
            if key not in self._warm or self.failed is not None:
                self._warm.add(key)
                return forward()
            try:
                captured = (self._capture_fn or self._cuda_capture)(forward)
            except Exception as e:  # noqa: BLE001 - the forward still runs, on the piecewise graphs from now on
                self.failed = f"{type(e).__name__}: {e}"
                logger.warning("vllm-tfm: the drafter's full CUDA graph for %d requests x %d queries could not be "
                               "captured (%s); the drafter runs its piecewise graphs from now on", key[0], key[1],
                               self.failed, exc_info=True)
                return forward()
            self._graphs[key] = captured
            self.captures += 1
        captured.graph.replay()
        self.replays += 1
        return captured.output

    def _cuda_capture(self, forward: Callable[[], Any]) -> Captured:
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)
        graph = torch.cuda.CUDAGraph()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.graph(graph, pool=self._pool, stream=self._stream, capture_error_mode="thread_local"):
            output = forward()
        torch.cuda.current_stream(self.device).wait_stream(self._stream)
        return Captured(graph, output)
