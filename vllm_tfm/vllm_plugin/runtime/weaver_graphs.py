"""CUDA graphs of the TfM (Weaver) tree build, one per (request bucket, tree shape).

On by default on CUDA; ``VLLM_TFM_WEAVER_GRAPHS=0`` turns it off in the worker (eager builds);
``VLLM_TFM_WEAVER_GRAPH_BUCKETS`` (e.g. ``1,2,4,8,16,32,64``, default :data:`DEFAULT_BUCKETS`)
lists the batch sizes that get a graph. Larger batches, CPU tensors and vocabulary-split
(tensor-parallel) embeddings build eagerly as before.

Why it works: with fixed (R, B, top_k, width, children_per_node) the Weaver build up to its first
host sync, ``models.proposal_trees.weaver_growth`` (DFlash top-K, the batched scorer's prompt
pass, the ``fixed_rounds`` growth rounds) plus ``trees().draft_layout``, has static shapes and
reads nothing back on the host (``tree.weaver_padded``: every state tensor is updated in place).
So a batch of R requests is padded up to the smallest bucket >= R:

1. the R real rows are copied into static input buffers [bucket, ...] (the other rows keep
   earlier inputs, zeros at first: finite values whose trees are computed and dropped);
2. the graph is replayed (captured at engine start-up, see "Warm-up" below; a key the warm-up did
   not cover is captured on its first batch: one eager run on the graphs' stream, then the
   capture);
3. one host sync, exactly as in the eager build, asks whether a real request needs rounds past
   the fixed ones (a short frontier: small ``children_per_node``, -inf scores, max_depth
   binding); those run eagerly on the graph's state tensors (the next replay re-initialises
   them) and the outputs are re-read;
4. the first R rows of the outputs are copied out (the graph's buffers are reused next step).

With ``defer_tail`` (deferred drafts, ``runtime/deferred_drafts.py``) step 3 waits: the question's
answer is copied to pinned memory and the outputs of the fixed rounds are returned at once, with a
:class:`DeferredTail` that asks it later (``finish``: the next step, before the forward reads the
drafts). If rounds are needed then, they run and the returned tensors are overwritten in place.
Before any other replay or capture the tail is finished first (it reads the graph's state,
which the next replay re-initialises and other graphs of the pool may reuse).

Lazy tail check (``VLLM_TFM_WEAVER_LAZY_TAIL``, default on; ``set_weaver_lazy_tail``): waiting for the
answer before the forward leaves the GPU idle while the host does its work between the wait and the
forward's launch, wherever the GPU is the bound (on the H200 at 27B shape: batch 8, 28.57 -> 27.65 ms per
step; batch 1 unchanged on a host that was the bound there; bench/NOTES.md section 46), to ask a
question whose answer at the e2e bench's shapes has always been no (no tail build in any run).
So a key that has never needed a tail does not wait: ``finish`` returns at once, the forward verifies
the trees of the fixed rounds, and the answer is read after the forward (``check_skipped_tails``, at
the next build, when the build has long ended). Verification is exact for any tree (a tree short of
nodes is completed with ``filler`` nodes, ``tree.padded.fill_to_budget``), so the tokens a request
emits do not depend on it; a build whose key did need a tail verified a tree with fewer useful
nodes: it is counted (``skipped_tails``, metric ``weaver.tail_skipped``), logged once, and builds
of that key wait for the check from then on (eager tails as above). A scorer output that was not
log-probabilities raises the same ValueError one step later.

The growth object's Python attributes (last-round tensors, counters) are restored from a snapshot
taken at capture after every replay, so the eager tail always starts from the graph's tensors.

All graphs share one memory pool: the build of one key reads only its static inputs, the weights
and what it writes itself, and its outputs are copied out before another graph is replayed, so
replaying another graph in between (which may reuse the same memory) breaks nothing. For the same
reason they share one set of input buffers (rows 0..bucket-1 of buffers sized for the largest
bucket captured first) and one CUDA stream for the eager runs and the captures: cuBLAS keeps a
workspace per stream (32 MiB on sm_90 by PyTorch's default), so a fresh stream per capture would
leave one more workspace behind with every bucket.

Warm-up (what vLLM does for its own CUDA graphs): the tfm model runner calls :meth:`WeaverGraphs.warm_up`
from vLLM's profile run at engine start-up (``runtime/hooks.py``), which captures, largest first,
the graph of every bucket a batch of 1..``max_num_seqs`` requests replays in
(:func:`warm_up_buckets`; larger buckets are never used). Their memory is then part of vLLM's
memory profile (so of the KV-cache size it derives) and of the server's memory before the first
request, and serving captures nothing: no capture pause and no memory growth at the first batch
of a new size. A capture after the warm-up (a key it did not cover) is counted in
``late_captures`` and logged once per bucket as a warning.

Numerics: a replay runs the kernels of the eager build at R = bucket, so its trees equal the
eager build of the padded batch exactly (``tests/gpu/test_weaver_graphs_gpu.py``). Against the
eager build of the R rows alone a tree can differ only where a GEMM picks a different kernel
for a different row count (last-bit differences in the Weaver scores), i.e. at near-exact ties;
verification is exact for any tree.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from vllm_tfm.models.proposal_trees import weaver_growth
from vllm_tfm.models.vocab_table import ShardedVocabTable, VocabTable
from vllm_tfm.tree.marginal_padded import check_marginals
from vllm_tfm.tree.weaver_padded import WeaverGrowth, pending_from_flags

from .kernels_or_reference import kernels_enabled
from .settings import RuntimeSwitch
from .state import STATE
from .tree_builder_gpu import growth_switches, prompt_overlap_enabled, topk_kernel_enabled, weaver_trees

__all__ = [
    "DeferredTail",
    "BUCKETS_ENV",
    "LAZY_TAIL_ENV",
    "DEFAULT_BUCKETS",
    "GRAPHS_ENV",
    "DrafterOutputs",
    "StaticInputs",
    "WeaverGraphs",
    "bucket_for",
    "graph_buckets",
    "graph_key",
    "set_weaver_lazy_tail",
    "warm_up_buckets",
    "weaver_graphs_from_env",
    "weaver_lazy_tail_enabled",
]

logger = logging.getLogger("vllm.tfm")  # under vLLM's logger: printed next to its own start-up lines

GRAPHS_ENV = "VLLM_TFM_WEAVER_GRAPHS"
BUCKETS_ENV = "VLLM_TFM_WEAVER_GRAPH_BUCKETS"
DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128)
LAZY_TAIL_ENV = "VLLM_TFM_WEAVER_LAZY_TAIL"
_LAZY_TAIL = RuntimeSwitch(LAZY_TAIL_ENV, "set_weaver_lazy_tail")


def weaver_lazy_tail_enabled() -> bool:
    """``VLLM_TFM_WEAVER_LAZY_TAIL`` unset or not 0 / false (default on), unless ``set_weaver_lazy_tail``
    overrode it: deferred tail checks of keys that never needed a tail are read after the forward."""
    return _LAZY_TAIL.enabled()


def set_weaver_lazy_tail(on: bool | None) -> bool:
    """Override ``VLLM_TFM_WEAVER_LAZY_TAIL`` in this process (None: back to the environment's); the
    setting now in force. For a same-engine A/B (bench/e2e.py --ab-switch weaver_lazy_tail)."""
    return _LAZY_TAIL.set(on)


def graph_buckets(text: str | None) -> tuple[int, ...]:
    """Bucket sizes from ``"1,2,4,..."`` (None or blank: :data:`DEFAULT_BUCKETS`), sorted, unique."""
    if text is None or not text.strip():
        return DEFAULT_BUCKETS
    try:
        sizes = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"{BUCKETS_ENV}={text!r}: expected comma-separated integers >= 1") from None
    if not sizes or sizes[0] < 1:
        raise ValueError(f"{BUCKETS_ENV}={text!r}: expected comma-separated integers >= 1")
    return tuple(sizes)


def weaver_graphs_from_env(environ: Mapping[str, str] | None = None) -> WeaverGraphs | None:
    """A ``WeaverGraphs`` unless ``VLLM_TFM_WEAVER_GRAPHS`` is 0 / false (on by default: the H200
    measured 79 -> 12 ms per Weaver build at Qwen3.6-27B shape, batch 1, bench/results/e2e_27b_eager.json.gz
    (in git history at edd14e2) vs the eager build, and tokens equal to no speculation,
    bench/results/graphs_zoo.json.gz)."""
    env = os.environ if environ is None else environ
    if env.get(GRAPHS_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    return WeaverGraphs(graph_buckets(env.get(BUCKETS_ENV)))


def bucket_for(num_requests: int, buckets: Sequence[int]) -> int | None:
    """The smallest bucket >= ``num_requests`` (``buckets`` sorted ascending), None if none is."""
    for size in buckets:
        if size >= num_requests:
            return size
    return None


def warm_up_buckets(buckets: Sequence[int], max_requests: int) -> tuple[int, ...]:
    """The buckets a batch of 1..``max_requests`` requests replays in, largest first (the order the
    warm-up captures them in, so that smaller graphs reuse the pool memory of larger ones): every
    bucket up to the one that holds ``max_requests``, all of them when none does (larger batches
    build eagerly)."""
    if isinstance(max_requests, bool) or not isinstance(max_requests, int) or max_requests < 1:
        raise ValueError(f"max_requests must be an integer >= 1, got {max_requests!r}")
    top = bucket_for(max_requests, sorted(buckets))
    return tuple(sorted((b for b in set(buckets) if top is None or b <= top), reverse=True))


DrafterOutputs = tuple[Tensor, Tensor, Tensor, Tensor]
"""(DFlash logits [R, D, V], DFlash hidden [R, D, H], verifier hidden [R, H], root tokens [R])."""


@dataclass(frozen=True)
class StaticInputs:
    """Input buffers of one graph, [bucket, ...]; rows past the batch keep their last values."""

    logits: Tensor  # [bucket, D, V] raw DFlash logits
    hidden: Tensor  # [bucket, D, H] DFlash outputs
    verifier: Tensor  # [bucket, H] target hidden state at the root rows
    roots: Tensor  # [bucket] root tokens

    @classmethod
    def zeros_like(cls, bucket: int, logits: Tensor, hidden: Tensor, verifier: Tensor, roots: Tensor) -> StaticInputs:
        def buf(x: Tensor) -> Tensor:
            return torch.zeros((bucket, *x.shape[1:]), dtype=x.dtype, device=x.device)

        return cls(buf(logits), buf(hidden), buf(verifier), buf(roots))

    @property
    def bucket(self) -> int:
        return int(self.roots.shape[0])

    def fill(self, logits: Tensor, hidden: Tensor, verifier: Tensor, roots: Tensor) -> None:
        """Copy a batch of R <= bucket requests into rows 0..R-1 (no host sync)."""
        r = int(roots.shape[0])
        if r > self.bucket:
            raise ValueError(f"a batch of {r} requests does not fit a graph bucket of {self.bucket}")
        for dst, src in ((self.logits, logits), (self.hidden, hidden), (self.verifier, verifier), (self.roots, roots)):
            if tuple(src.shape) != (r, *dst.shape[1:]):
                raise ValueError(f"input of shape {tuple(src.shape)} does not fit buffer rows of shape {tuple(dst.shape[1:])}")
            dst[:r].copy_(src)

    def rows(self, bucket: int) -> StaticInputs:
        """Views of the first ``bucket`` rows (the inputs of a smaller bucket's graph)."""
        if not 1 <= bucket <= self.bucket:
            raise ValueError(f"a graph bucket of {bucket} does not fit input buffers of {self.bucket} rows")
        return StaticInputs(self.logits[:bucket], self.hidden[:bucket], self.verifier[:bucket], self.roots[:bucket])


def _input_signature(logits: Tensor, hidden: Tensor, verifier: Tensor) -> tuple[Any, ...]:
    """What the input buffers of a graph depend on besides the bucket: shapes past the batch, dtypes, device."""
    return (tuple(logits.shape[1:]), tuple(hidden.shape[1:]), tuple(verifier.shape[1:]), logits.dtype, hidden.dtype,
            verifier.dtype, logits.device)


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    inputs: StaticInputs
    growth: WeaverGrowth
    snapshot: dict[str, Any]  # growth.__dict__ right after the capture
    filler: Tensor  # [bucket] best depth-1 candidate (completes short trees)
    tokens: Tensor  # [bucket, B] graph outputs
    parents: Tensor  # [bucket, 1 + B]

    def restore(self) -> WeaverGrowth:
        self.growth.__dict__.clear()
        self.growth.__dict__.update(self.snapshot)
        return self.growth


def _build(
    weaver: nn.Module, inputs: StaticInputs, embed: VocabTable, lm_head: VocabTable, budget: int, top_k: int, width: int, cpn: int
) -> tuple[WeaverGrowth, Tensor, Tensor, Tensor]:
    """The capturable part of ``tree_builder_gpu.weaver_trees`` on the static inputs."""
    growth, cand_ids = weaver_growth(
        weaver, inputs.logits, inputs.hidden, inputs.verifier, inputs.roots, embed, lm_head,
        budget, top_k, width, cpn, logits_dtype=inputs.hidden.dtype, **growth_switches(inputs.hidden.device),
    )
    filler = cand_ids[:, 0, 0]
    tokens, parents = growth.trees().draft_layout(filler)
    return growth, filler, tokens, parents


def _table_key(table: VocabTable) -> tuple[int, int]:
    weight = table if isinstance(table, Tensor) else getattr(table, "weight", None)
    return id(table), weight.data_ptr() if isinstance(weight, Tensor) else 0


def graph_key(
    bucket: int, weaver: nn.Module, dflash_logits: Tensor, dflash_hidden: Tensor, verifier_hidden: Tensor,
    embed: VocabTable, lm_head: VocabTable, budget: int, top_k: int, width: int, children_per_node: int,
) -> tuple[Any, ...]:
    """The key of a graph: one graph per bucket, tree shape, input shapes past the batch, dtypes,
    device, Weaver and vocabulary tables (the batch size itself and the root tokens' dtype are not
    part of it: rows are padded to the bucket, roots are copied into int64 buffers), whether the
    rounds may take the round kernel (``kernels_enabled()``) and whether the DFlash top-K may take its
    kernel (``topk_kernel_enabled()``: ``set_topk_kernel`` then picks another graph) and whether the prompt pass
    runs on its own stream (``prompt_overlap_enabled()``, ``set_prompt_overlap``)."""
    return (
        bucket, budget, top_k, width, children_per_node, tuple(dflash_logits.shape[1:]), tuple(dflash_hidden.shape[1:]),
        tuple(verifier_hidden.shape[1:]), dflash_logits.dtype, dflash_hidden.dtype, verifier_hidden.dtype,
        dflash_logits.device, id(weaver), _table_key(embed), _table_key(lm_head), kernels_enabled(),
        topk_kernel_enabled(), prompt_overlap_enabled(),
    )


class DeferredTail:
    """The host check of a replayed Weaver build, deferred (module docstring, step 3): the tail rounds,
    if any are needed, run when ``finish`` is called, and overwrite ``tokens`` / ``parents`` in place.
    ``lazy``: ``finish`` neither waits nor runs tail rounds; ``check`` reads the answer later."""

    def __init__(self, owner: WeaverGraphs, growth: Any, rows: int, filler: Tensor, tokens: Tensor,
                 parents: Tensor, key: tuple[Any, ...] | None = None, lazy: bool = False) -> None:
        self._owner, self._growth, self._rows, self._filler = owner, growth, rows, filler
        self.tokens, self.parents = tokens, parents
        self.key, self.lazy = key, lazy
        flags = growth.pending_flags(rows=rows)
        self._event: torch.cuda.Event | None = None
        if flags.is_cuda:
            self._flags = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
            self._flags.copy_(flags, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._flags = flags.clone()
        self.done = False
        self.changed = False  # tail rounds ran: tokens / parents were rewritten
        self.skipped: bool | None = None  # lazy: whether the fixed rounds' trees were short (None: not read yet)

    def _read_flags(self) -> bool:
        """Wait for the build's end (only it) and answer ``WeaverGrowth.pending`` (raises as it does)."""
        if self._event is not None:
            self._event.synchronize()
        return pending_from_flags(self._flags.tolist())

    def finish(self) -> bool:
        """Wait for the check (only the build's end), run the tail rounds if needed; whether the
        trees changed. Lazy: no wait, nothing changes (the answer is read by ``check``). Idempotent."""
        if self.done:
            return self.changed
        self.done = True
        if self._owner._unfinished is self:
            self._owner._unfinished = None
        if self.lazy:
            self._owner._unchecked.append(self)
            return False
        if not self._read_flags():
            return False
        growth = self._growth
        fixed = growth.rounds
        with torch.inference_mode():  # the graph's state and the returned tensors are inference tensors
            growth.run_tail(rows=self._rows)
            tokens, parents = growth.trees().draft_layout(self._filler)
            self.tokens.copy_(tokens[: self._rows])
            self.parents.copy_(parents[: self._rows])
        self._owner.count_tail(growth.rounds - fixed)
        self.changed = True
        return True

    def check(self) -> bool:
        """Lazy: read the answer (the build ended long ago) and record it in ``skipped``: whether the trees
        handed out were short of the tail rounds. Raises ValueError for a scorer output that was not
        log-probabilities, as the eager check does. Idempotent."""
        if self.skipped is None:
            self.skipped = self._read_flags()
        return self.skipped


class WeaverGraphs:
    """Weaver tree builds through CUDA graphs, one per key (module docstring)."""

    def __init__(self, buckets: Sequence[int] = DEFAULT_BUCKETS) -> None:
        self.buckets = tuple(sorted(set(buckets)))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"graph buckets must be integers >= 1, got {buckets!r}")
        self._graphs: dict[tuple[Any, ...], _Captured] = {}
        self._inputs: dict[tuple[Any, ...], StaticInputs] = {}  # input buffers shared by the graphs of a signature
        self._pool: Any = None
        self._stream: Any = None  # the one stream of every eager run before a capture and of the captures
        self.replays = 0
        self.tail_rounds = 0
        self.eager_builds = 0
        self.captured: list[int] = []  # the bucket of every capture, in order
        self.warmed_up: tuple[int, ...] | None = None  # buckets the warm-up covered; None before it ran
        self.late_captures: list[int] = []  # buckets captured after the warm-up (while serving)
        self._unfinished: DeferredTail | None = None  # the last replay's deferred check, not finished yet
        self.last_tail: DeferredTail | None = None  # the deferred check of the last build that deferred it
        self._unchecked: list[DeferredTail] = []  # lazy checks finished without reading their answer
        self._tail_keys: set[tuple[Any, ...]] = set()  # keys whose builds needed a tail: their checks wait
        self.skipped_tails = 0  # lazy builds whose trees were short of tail rounds (module docstring)

    def capturable(self, device: torch.device, embed: VocabTable, lm_head: VocabTable) -> bool:
        """Whether builds on ``device`` with these tables can replay graphs (not on CPU tensors,
        not inside another capture, not with vocabulary-split tables)."""
        if device.type != "cuda" or not torch.cuda.is_available():
            return False
        if torch.cuda.is_current_stream_capturing():  # inside someone else's capture: no nesting
            return False
        return not (isinstance(embed, ShardedVocabTable) or isinstance(lm_head, ShardedVocabTable))

    def bucket(self, dflash_logits: Tensor, embed: VocabTable, lm_head: VocabTable) -> int | None:
        """The bucket this batch replays in, or None when it builds eagerly (CPU tensors, a
        capture already under way, vocabulary-split tables, more requests than the largest
        bucket)."""
        if not self.capturable(dflash_logits.device, embed, lm_head):
            return None
        return bucket_for(int(dflash_logits.shape[0]), self.buckets)

    def warm_up(
        self,
        max_requests: int,
        make_inputs: Callable[[int], DrafterOutputs],
        weaver: nn.Module,
        embed: VocabTable,
        lm_head: VocabTable,
        budget: int,
        top_k: int,
        width: int,
        children_per_node: int,
        device: torch.device,
    ) -> tuple[int, ...]:
        """Capture, largest first, the graph of every bucket a batch of 1..``max_requests``
        requests replays in (:func:`warm_up_buckets`), from drafter outputs of that many rows:
        ``make_inputs(bucket)`` (values are irrelevant, shapes and dtypes must be the serving
        ones: e.g. views of one zero row). Returns the buckets captured now (keys already
        captured are skipped); nothing when builds on ``device`` cannot replay graphs."""
        sizes = warm_up_buckets(self.buckets, max_requests)
        if not self.capturable(device, embed, lm_head):
            self.warmed_up = ()
            return ()
        done: list[int] = []
        with torch.inference_mode():
            for bucket in sizes:
                logits, hidden, verifier, roots = make_inputs(bucket)
                if int(logits.shape[0]) != bucket:
                    raise ValueError(f"warm-up inputs for bucket {bucket} have {int(logits.shape[0])} rows")
                check_marginals(logits, budget)
                key = graph_key(bucket, weaver, logits, hidden, verifier, embed, lm_head, budget, top_k, width,
                                children_per_node)
                if key not in self._graphs:
                    self._graphs[key] = self._capture(bucket, weaver, logits, hidden, verifier, roots, embed, lm_head,
                                                      budget, top_k, width, children_per_node)
                    done.append(bucket)
        self.warmed_up = sizes
        return tuple(done)

    def weaver_trees(
        self,
        weaver: nn.Module,
        dflash_logits: Tensor,
        dflash_hidden: Tensor,
        verifier_hidden: Tensor,
        root_tokens: Tensor,
        embed: VocabTable,
        lm_head: VocabTable,
        budget: int,
        top_k: int,
        width: int,
        children_per_node: int,
        defer_tail: bool = False,
    ) -> tuple[Tensor, Tensor]:
        """``tree_builder_gpu.weaver_trees`` through a graph when the batch fits a bucket:
        tokens [R, B], parents [R, 1 + B] (fresh tensors). ``defer_tail``: a replayed build returns
        without its host check; ``last_tail`` is then its :class:`DeferredTail` (else None)."""
        self.last_tail = None
        if self._unfinished is not None:  # its state is the graphs' own: finish it before they run again
            self._unfinished.finish()
        self.check_skipped_tails()
        bucket = self.bucket(dflash_logits, embed, lm_head)
        if bucket is None:
            self.eager_builds += 1
            return weaver_trees(weaver, dflash_logits, dflash_hidden, verifier_hidden, root_tokens, embed, lm_head,
                                budget, top_k, width, children_per_node)
        check_marginals(dflash_logits, budget)
        r = int(root_tokens.shape[0])
        key = graph_key(bucket, weaver, dflash_logits, dflash_hidden, verifier_hidden, embed, lm_head, budget, top_k,
                        width, children_per_node)
        with torch.inference_mode():
            cap = self._graphs.get(key)
            if cap is None:
                cap = self._capture(bucket, weaver, dflash_logits, dflash_hidden, verifier_hidden, root_tokens, embed,
                                    lm_head, budget, top_k, width, children_per_node)
                self._graphs[key] = cap
                if self.warmed_up is not None:
                    self._note_late_capture(bucket, key)
            cap.inputs.fill(dflash_logits, dflash_hidden, verifier_hidden, root_tokens)
            cap.graph.replay()
            self.replays += 1
            growth = cap.restore()
            if defer_tail:
                tokens, parents = cap.tokens[:r].clone(), cap.parents[:r].clone()
                self.last_tail = self._unfinished = DeferredTail(self, growth, r, cap.filler, tokens, parents, key,
                                                                 self.defers_lazily(key))
                return tokens, parents
            fixed = growth.rounds
            growth.run_tail(rows=r)  # the one host sync of the build
            if growth.rounds == fixed:
                tokens, parents = cap.tokens, cap.parents
            else:
                self.count_tail(growth.rounds - fixed)
                tokens, parents = growth.trees().draft_layout(cap.filler)
            return tokens[:r].clone(), parents[:r].clone()

    def defers_lazily(self, key: tuple[Any, ...]) -> bool:
        """Whether a deferred check of a build of ``key`` is read after the forward (module docstring):
        the switch is on and no build of this key has needed a tail."""
        return weaver_lazy_tail_enabled() and key not in self._tail_keys

    def check_skipped_tails(self) -> int:
        """Read the answers of the lazy checks finished so far (each build has ended: a forward and its
        sampler, which the host waited for, ran after it); count the builds whose trees were short of tail
        rounds and make their keys wait from now on. The number of such builds found by this call."""
        pending, self._unchecked = self._unchecked, []
        skipped = [tail for tail in pending if tail.check()]
        for tail in skipped:
            self.skipped_tails += 1
            if STATE.metrics is not None:
                STATE.metrics.hooks["weaver.tail_skipped"] += 1
            if tail.key not in self._tail_keys:
                self._tail_keys.add(tail.key)
                logger.warning(
                    "vllm-tfm: a Weaver build (batch bucket %s) needed growth rounds past the captured ones; its "
                    "step verified the trees of the captured rounds (exact, with fewer useful nodes). Builds of "
                    "this shape now wait for that check before the forward (VLLM_TFM_WEAVER_LAZY_TAIL)",
                    tail.key[0] if tail.key else "?",
                )
        return len(skipped)

    def count_tail(self, rounds: int) -> None:
        """Rounds run past the captured ones (eagerly; with deferred drafts right before the next forward, on
        the host's critical path): this object's ``tail_rounds``, and the engine's metrics
        ``weaver.tail_builds`` / ``weaver.tail_rounds`` (bench/NOTES.md section 36)."""
        self.tail_rounds += rounds
        if STATE.metrics is not None and rounds > 0:
            STATE.metrics.hooks["weaver.tail_builds"] += 1
            STATE.metrics.hooks["weaver.tail_rounds"] += rounds

    def _note_late_capture(self, bucket: int, key: tuple[Any, ...]) -> None:
        first = bucket not in self.late_captures
        self.late_captures.append(bucket)
        if first:
            logger.warning(
                "vllm-tfm: captured the Weaver CUDA graph of batch bucket %d while serving (the start-up warm-up "
                "covered buckets %s with other shapes or dtypes; key %s): its memory was not in vLLM's profile",
                bucket, list(self.warmed_up or ()), key[:11],
            )

    def _static_inputs(self, bucket: int, logits: Tensor, hidden: Tensor, verifier: Tensor, roots: Tensor) -> StaticInputs:
        """Rows 0..bucket-1 of the input buffers of this signature (new buffers of ``bucket`` rows
        when there are none yet or they are smaller; graphs captured earlier keep theirs)."""
        sig = _input_signature(logits, hidden, verifier)
        shared = self._inputs.get(sig)
        if shared is None or shared.bucket < bucket:
            shared = StaticInputs.zeros_like(bucket, logits, hidden, verifier, roots.to(torch.long))
            self._inputs[sig] = shared
        return shared.rows(bucket)

    def _capture(
        self,
        bucket: int,
        weaver: nn.Module,
        dflash_logits: Tensor,
        dflash_hidden: Tensor,
        verifier_hidden: Tensor,
        root_tokens: Tensor,
        embed: VocabTable,
        lm_head: VocabTable,
        budget: int,
        top_k: int,
        width: int,
        cpn: int,
    ) -> _Captured:
        dev = dflash_logits.device
        inputs = self._static_inputs(bucket, dflash_logits, dflash_hidden, verifier_hidden, root_tokens)
        inputs.fill(dflash_logits, dflash_hidden, verifier_hidden, root_tokens)
        if self._stream is None:
            self._stream = torch.cuda.Stream(dev)
        side = self._stream
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # an eager run first: lazy initialisations happen outside the capture
            _build(weaver, inputs, embed, lm_head, budget, top_k, width, cpn)
        torch.cuda.current_stream(dev).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, stream=side, capture_error_mode="thread_local"):
            growth, filler, tokens, parents = _build(weaver, inputs, embed, lm_head, budget, top_k, width, cpn)
        self.captured.append(bucket)
        return _Captured(graph, inputs, growth, dict(growth.__dict__), filler, tokens, parents)
