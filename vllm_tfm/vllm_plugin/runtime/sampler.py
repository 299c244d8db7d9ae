"""Tree acceptance in place of vLLM's ``RejectionSampler`` (``GPUModelRunner.rejection_sampler``).

vLLM 0.26 calls ``self.rejection_sampler(spec_decode_metadata, draft_probs, logits,
sampling_metadata)`` from ``GPUModelRunner._sample`` (gpu_model_runner.py:3660) and expects a
``SamplerOutput`` whose ``sampled_token_ids`` is ``[R, max_spec_len + 1]`` int32: the accepted
drafts, then the bonus token, then -1. ``TFMTreeSampler`` keeps that contract:

* steps that are not tree-active (prefill-only, all-chain, a batch that needs vLLM's logits
  processors / logprobs, the profiling dummy runs) go to the wrapped in-tree sampler unchanged;
* tree-active steps verify every request's tree with ``vllm_tfm.verify.sampling.verify_tree``:
  greedy requests by the target argmax walk, the others by target-only tree acceptance on the
  processed target distribution (temperature, top-k, top-p, min-p per request; exact for trees
  whose children are fixed before verification, which is what every tfm builder produces).

A tree-active step whose requests are all greedy (host temperatures) is verified by one kernel launch
after the argmax (``vllm_tfm.kernels.greedy_accept``, ``VLLM_TFM_GREEDY_ACCEPT_KERNEL``, default on) where
the CUDA kernels run; its result equals the torch path's entry for entry (the torch path is its reference).

The accepted paths are kept in the step state for the commit (KV compaction, GDN state) and for
the drafter (which reorders root + accepted path first).

In acceptance-replay mode (benchmarks only, ``vllm_plugin.benchmark_mode``) the real verification
still runs (its cost stays in the step), then the spec requests' outcome is replaced by a path
whose depth is drawn from the recorded profile (``runtime.replay``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor, nn

from vllm_tfm.kernels import greedy_accept as kga
from vllm_tfm.kernels.loader import warn_fallback
from vllm_tfm.tree.types import TreeBatch
from vllm_tfm.verify.accept_result import AcceptResult
from vllm_tfm.verify.logits_processing import GREEDY_TEMPERATURE_EPS, TreeSamplingParams
from vllm_tfm.verify.sampling import verify_tree

from .kernels_or_reference import kernels_enabled
from .settings import RuntimeSwitch
from .stage_timing import TIMER
from .tensor_parallel import check_same_on_tp_ranks
from .state import STATE, StepTree

if TYPE_CHECKING:
    from .replay import AcceptanceReplayer

__all__ = ["GREEDY_ACCEPT_KERNEL_ENV", "TFMTreeSampler", "greedy_accept_kernel_enabled", "needs_native_sampler",
           "output_token_ids", "sample_trees", "set_greedy_accept_kernel"]

GREEDY_ACCEPT_KERNEL_ENV = "VLLM_TFM_GREEDY_ACCEPT_KERNEL"
_GAK = RuntimeSwitch(GREEDY_ACCEPT_KERNEL_ENV, "set_greedy_accept_kernel")


def greedy_accept_kernel_enabled() -> bool:
    """``VLLM_TFM_GREEDY_ACCEPT_KERNEL`` unset or not 0 / false (default on), unless ``set_greedy_accept_kernel``
    overrode it: a tree step whose requests are all greedy is verified by one kernel launch after the argmax
    (``vllm_tfm.kernels.greedy_accept``) instead of the torch path's ~45 launches."""
    return _GAK.enabled()


def set_greedy_accept_kernel(on: bool | None) -> bool:
    """Override ``VLLM_TFM_GREEDY_ACCEPT_KERNEL`` in this process (None: back to the environment's); the setting
    now in force. For a same-engine A/B (kernel vs torch path) through ``collective_rpc``."""
    return _GAK.set(on)


def _processor_active(proc: Any) -> bool:
    """Whether a non-argmax-invariant logits processor changes anything in this batch."""
    for attr in ("min_toks", "biases"):
        if hasattr(proc, attr):
            return bool(getattr(proc, attr))
    return True  # unknown processor: assume it matters


def needs_native_sampler(sampling_metadata: Any) -> bool:
    """True when the batch uses something only vLLM's own (chain) sampler applies.

    Penalties, bad words, allowed-token masks, min-tokens / logit-bias processors, thinking
    budgets and logprobs: their vLLM implementations are position-by-position along a chain. Such
    batches verify chains (still exact) through the wrapped in-tree sampler.
    """
    md = sampling_metadata
    if not md.no_penalties or md.bad_words_token_ids or md.allowed_token_ids_mask is not None:
        return True
    if md.max_num_logprobs is not None:
        return True
    if any(_processor_active(p) for p in md.logitsprocs.non_argmax_invariant):
        return True
    holder = getattr(md, "thinking_budget_state_holder", None)
    return holder is not None and holder.has_tracked_requests()


def sample_trees(step: StepTree, draft_token_ids: Tensor) -> TreeBatch:
    """The TreeBatch over the N logits rows: root rows carry token 0 (never read), the others the drafts.

    draft_token_ids: [N - R] the scheduled drafts, flat in request order (spec-decode metadata).
    The rows of the drafts come from the step's host metadata (no mask, no synchronisation).
    """
    parents = step.dev("sample_parents")
    tokens = torch.zeros(parents.shape[0], dtype=torch.long, device=parents.device)
    tokens.index_copy_(0, step.dev("sample_nonroot"), draft_token_ids.to(torch.long))
    return TreeBatch(tokens, parents, step.dev("sample_depth"), step.dev("sample_cu"))


def output_token_ids(result: AcceptResult, max_spec_len: int) -> Tensor:
    """vLLM's sampled_token_ids [R, max_spec_len + 1] int32 from an AcceptResult (-1 padding)."""
    r, w = result.output_tokens.shape
    out = torch.full((r, max_spec_len + 1), -1, dtype=torch.int32, device=result.output_tokens.device)
    out[:, :w] = result.output_tokens.to(torch.int32)
    return out


class TFMTreeSampler(nn.Module):
    """Drop-in for ``GPUModelRunner.rejection_sampler`` (see the module docstring)."""

    def __init__(
        self, inner: nn.Module, runner: Any, method: str = "target_only", replay: AcceptanceReplayer | None = None
    ) -> None:
        super().__init__()
        self.inner = inner
        self._runner = [runner]  # a list keeps nn.Module from treating the runner as an attribute to track
        self.method = method
        self.replay = replay

    def forward(self, metadata: Any, draft_probs: Tensor | None, logits: Tensor, sampling_metadata: Any) -> Any:
        step = STATE.step
        if step is None or not step.tree_active:
            return self.inner(metadata, draft_probs, logits, sampling_metadata)
        self._check(step, metadata, logits, sampling_metadata)
        return self._verify(step, metadata, logits, sampling_metadata)

    @staticmethod
    def _check(step: StepTree, metadata: Any, logits: Tensor, sampling_metadata: Any) -> None:
        drafts = list(metadata.num_draft_tokens)
        if drafts != step.num_draft.tolist() or logits.shape[0] != int(step.sample_cu[-1]):
            raise RuntimeError(
                "vllm-tfm: the spec-decode metadata of this step does not match the tree metadata "
                f"(drafts {drafts} vs {step.num_draft.tolist()}, logits rows {logits.shape[0]} vs "
                f"{int(step.sample_cu[-1])}); the step cannot be verified"
            )
        if needs_native_sampler(sampling_metadata):  # the step was built as a tree step for a batch that needed none
            raise RuntimeError(
                "vllm-tfm: a tree-verified step's batch needs vLLM's own sampler (penalties, bad words, allowed "
                "tokens, logprobs or a logits processor) that the step's preparation did not see; the step cannot "
                "be verified"
            )

    def _verify(self, step: StepTree, metadata: Any, logits: Tensor, sampling_metadata: Any) -> Any:
        runner = self._runner[0]
        batch = runner.input_batch
        r = step.num_reqs
        if greedy_accept_kernel_enabled() and kernels_enabled():
            done = self._verify_greedy_kernel(step, metadata, logits, batch.temperature_cpu[:r])
            if done is not None:
                return self._finish(step, batch, *done)
        min_p = None
        for proc in sampling_metadata.logitsprocs.argmax_invariant:
            if hasattr(proc, "min_p_cpu") and getattr(proc, "min_p_count", 0) > 0:
                min_p = proc.min_p_cpu[:r]
        # vLLM stores "top-k off" as k = vocab size and "top-p off" as 1.0, which TreeSamplingParams
        # reads the same way; checked on the host, one copy, with the host greedy mask
        params = TreeSamplingParams.from_host(
            batch.temperature_cpu[:r],
            None if sampling_metadata.top_k is None else batch.top_k_cpu[:r],
            None if sampling_metadata.top_p is None else batch.top_p_cpu[:r],
            min_p,
            logits.device,
        )
        trees = sample_trees(step, metadata.draft_token_ids)
        tables = step.sample_tables()
        generators = sampling_metadata.generators or None
        result = verify_tree(logits, trees, params, method=self.method, generator=generators, tables=tables)
        if self.replay is not None:
            result = self._replayed(step, logits, result, trees, tables)
        return self._finish(step, batch, result, output_token_ids(result, metadata.max_spec_len))

    def _verify_greedy_kernel(self, step: StepTree, metadata: Any, logits: Tensor,
                              temperature: Any) -> tuple[AcceptResult, Tensor] | None:
        """(result, vLLM's sampled tokens) of a batch whose requests are all greedy (host temperatures), from
        the argmax and one launch of ``kernels.greedy_accept``; None where the kernel does not run (a sampled
        request, no CUDA kernels: the torch path then, whose greedy walk is the kernel's reference)."""
        if not bool(np.all(np.asarray(temperature) < GREEDY_TEMPERATURE_EPS)):
            return None
        step.complete()  # the topology arrays, if they were pending (deferred drafts)
        drafts = metadata.draft_token_ids
        dmax = int(step.sample_depth.max()) if step.sample_depth.size else 0
        max_nodes = int(np.diff(step.sample_cu).max())
        cols = int(metadata.max_spec_len) + 1
        target = logits.argmax(dim=-1)
        parents, cu = step.dev("sample_parents"), step.dev("sample_cu")
        reason = kga.unsupported_reason(target, parents, cu, drafts, dmax, cols, max_nodes)
        if reason is not None:
            if reason != kga.NOT_CUDA:
                warn_fallback("tree_greedy_accept", reason)
            return None
        result, sampled = kga.tree_greedy_accept_kernel(target, parents, cu, drafts, dmax, cols)
        if STATE.metrics is not None:
            STATE.metrics.hook("sampler.greedy_kernel")
        if self.replay is not None:
            result = self._replayed(step, logits, result, None, None, drafts)
            sampled = output_token_ids(result, metadata.max_spec_len)
        return result, sampled

    def _replayed(self, step: StepTree, logits: Tensor, result: AcceptResult, trees: TreeBatch | None,
                  tables: Any, drafts: Tensor | None = None) -> AcceptResult:
        """Benchmark-only acceptance replay (``replay.py``) of the step's replayed requests, in its own timed
        span; the tree batch and tables it reads are made here when the verification did not make them (the
        greedy kernel's path), so their cost is the replay's."""
        assert self.replay is not None
        with TIMER.span("replay_accept"):
            if trees is None:
                trees, tables = sample_trees(step, drafts), step.sample_tables()
            return self.replay.accept(trees, logits, result, step.dev("replayed") != 0, tables)

    def _finish(self, step: StepTree, batch: Any, result: AcceptResult, sampled: Tensor) -> Any:
        from vllm.v1.outputs import SamplerOutput

        step.accept = result
        if STATE.check_tp:
            req_ids = list(batch.req_ids[: step.num_reqs])
            check_same_on_tp_ranks("accepted paths", [result.accepted_nodes, result.output_tokens], req_ids, STATE.check_step)
            if STATE.metrics is not None:
                STATE.metrics.tp_accept_checks += 1
        if STATE.metrics is not None:
            STATE.metrics.record_accept(step, result)
        return SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=None)
