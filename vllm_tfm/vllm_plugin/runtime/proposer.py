"""TFMProposer: vLLM's DFlash proposer that returns trees instead of a chain.

Built by the ``GPUModelRunner.__init__`` wrapper in place of ``DFlashProposer``
(gpu_model_runner.py:630-632, the ``use_dflash()`` branch that also turns on the aux hidden
states). Per step (``propose``):

1. Context order. The drafter turns every verified row into context K/V at the slot of the row's
   position (``copy_and_expand_dflash_inputs_kernel``, v1/spec_decode/utils.py:458-552), and takes
   the first ``rows - num_rejected`` rows of a request as its valid context. After a tree step the
   valid rows are the root and the accepted path, which are scattered among the B + 1 rows, and
   siblings share depth positions. So the rows are reordered root + accepted path first (hidden
   states and ids) and given the sequential positions ``ctx + k`` (VLLM_HOOKS.md section 8 step
   3): the path rows then sit exactly where a chain would have put them, the rejected rows after
   them, and the query positions (``last_valid_pos + 1 ...``) and ``effective_seq_lens`` come out
   as for a chain.
2. Marginals. The DFlash forward runs with D = min(B, block_size - 1) mask queries;
   ``_sample_draft_tokens`` (llm_base_proposer.py:468) keeps the logits [R * D, V] and the
   DFlash outputs instead of sampling.
3. Trees. ``chain`` / ``ddtree`` (batched on the device), ``tfm`` (Weaver) or ``treeflash`` (the
   TreeFlash AR approximator on the DFlash pre-norm stream, ``dflash_prenorm``), B draft nodes per
   request; requests in a batch that needs vLLM's own sampler get chains. The
   Weaver build replays CUDA graphs (``weaver_graphs``; ``VLLM_TFM_WEAVER_GRAPHS=0``: eager). The tokens go back to
   vLLM ([R, B]), the parents to the ``ProposalStore`` keyed by request id.

With ``VLLM_TFM_DRAFTER_GRAPHS=1`` (opt-in, one GPU) step 2's forward replays a full CUDA graph per
(requests, query tokens) instead of vLLM's piecewise drafter graphs (``drafter_graphs.py``).

At engine start-up vLLM's profile run calls ``warm_up_weaver_graphs`` (``runtime/hooks.py``): the
Weaver graphs of every batch size up to ``max_num_seqs`` are captured then, from zero drafter
outputs of the serving shapes and dtypes (the DFlash logits come from the drafter's own
``compute_logits``), so that serving captures none.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

import torch
from torch import Tensor

from vllm.v1.spec_decode.dflash import DFlashProposer

from vllm_tfm.models.draft_vocab import load_draft_vocab
from vllm_tfm.models.vocab_table import VocabTable

from ..drafter_checks import draft_vocab_path
from ..options import get_drafter_dir, get_tfm_options, loads_treeflash
from .dflash_prenorm import install_prenorm_output, split_rows
from .draft_head import draft_logits_head
from .drafter_graphs import DrafterGraphs, drafter_graphs_enabled
from .drafter_inputs import bonus_rows, dflash_context_order
from .sampler import needs_native_sampler
from .settings import settings_from_options
from .stage_timing import TIMER
from .state import STATE
from .tensor_parallel import check_same_on_tp_ranks, check_tp_trees_enabled, target_vocab_table, tp_world_size
from .tree_builder_gpu import chain_trees, ddtree_trees, treeflash_trees, weaver_trees
from .weaver_graphs import DrafterOutputs, weaver_graphs_from_env

__all__ = ["TFMProposer"]

logger = logging.getLogger("vllm.tfm")  # under vLLM's logger: printed next to its own start-up lines


class TFMProposer(DFlashProposer):
    """DFlash drafting + tree building (module docstring)."""

    _draft_logits: Callable[[Tensor], Tensor] | None = None  # draft_lm_head 'fp8' / draft_vocab (draft_head.py), at load

    def __init__(self, vllm_config: Any, device: torch.device, runner: Any = None) -> None:
        spec = vllm_config.speculative_config
        if spec is None or spec.method != "tfm":
            raise ValueError(f"TFMProposer needs speculative method 'tfm', got {getattr(spec, 'method', None)!r}")
        if spec.disable_padded_drafter_batch:
            raise ValueError("vllm-tfm needs the padded drafter batch: do not set disable_padded_drafter_batch")
        if spec.use_heterogeneous_vocab:
            raise ValueError("vllm-tfm does not support a drafter vocabulary different from the target's")
        spec.method = "dflash"  # DFlashProposer asserts it; the base keeps self.method = "dflash"
        try:
            super().__init__(vllm_config, device, runner)
        finally:
            spec.method = "tfm"
        self._tfm_runner = runner
        self.tfm_settings = settings_from_options(
            get_tfm_options(vllm_config), get_drafter_dir(vllm_config), int(spec.num_speculative_tokens), self.dflash_config
        )
        STATE.settings = self.tfm_settings
        vocab = self.draft_model_config.get_vocab_size()
        if self.tfm_settings.budget >= vocab:
            raise ValueError(f"num_speculative_tokens {self.tfm_settings.budget} must be smaller than the vocabulary ({vocab})")
        self._marginal_logits: Tensor | None = None
        self._dflash_out: Tensor | None = None
        self.weaver: torch.nn.Module | None = None
        self._target_embed: VocabTable | None = None
        self._target_lm_head: VocabTable | None = None
        self.treeflash: torch.nn.Module | None = None  # TreeFlash AR approximator (_load_treeflash)
        self._treeflash_io: tuple[Any, Any, Any] | None = None  # its final norm, embedding rows, logits head
        self._dflash_prenorm: Tensor | None = None
        # CUDA graphs of the Weaver build (on unless VLLM_TFM_WEAVER_GRAPHS=0, runtime/weaver_graphs.py)
        self._weaver_graphs = weaver_graphs_from_env()
        STATE.check_tp = check_tp_trees_enabled() and vllm_config.parallel_config.tensor_parallel_size > 1
        STATE.check_step = 0
        # full CUDA graphs of the drafter's query forward (drafter_graphs.py): VLLM_TFM_DRAFTER_GRAPHS=1, one GPU
        self._drafter_graphs = _drafter_graphs(vllm_config, device)
        self._drafter_graph_key: tuple[int, int] | None = None  # this step's key, between the inputs and the forward

    # ------------------------------------------------------------------ load
    def load_model(self, target_model: torch.nn.Module) -> None:
        super().load_model(target_model)
        self._load_draft_head()
        if self._drafter_graphs is not None:
            self._route_forward_through_graphs()
        from vllm.config import get_layers_from_vllm_config
        from vllm.model_executor.layers.attention import Attention

        from .attention import TFMTritonAttentionImpl

        layers = get_layers_from_vllm_config(self.vllm_config, Attention)
        target = {name: layer for name, layer in layers.items() if name not in self._draft_attn_layer_names}
        wrong = [name for name, layer in target.items() if not isinstance(layer.impl, TFMTritonAttentionImpl)]
        if wrong:
            raise ValueError(
                "vllm-tfm needs attention_backend='TRITON_ATTN' (tree-masked attention); "
                f"layer {wrong[0]} uses {type(target[wrong[0]].impl).__name__}"
            )
        STATE.target_attn_layers = frozenset(target)
        if self.tfm_settings.proposal == "tfm":
            self._load_weaver(target_model)
        if loads_treeflash(self.tfm_settings.tfm, self.tfm_settings.drafter_dir):
            self._load_treeflash(target_model)

    def _load_weaver(self, target_model: torch.nn.Module) -> None:
        from vllm_tfm.models.weaver import Weaver

        settings = self.tfm_settings
        if settings.tfm.weaver is None or settings.drafter_dir is None:
            raise ValueError("tfm proposal 'tfm' needs a local drafter directory whose tfm_config.json has a 'weaver' section")
        if settings.tfm.weaver.max_depth < settings.max_depth:
            raise ValueError(
                f"the Weaver scores depths 1..{settings.tfm.weaver.max_depth} but the drafter is asked for "
                f"{settings.max_depth}; lower num_speculative_tokens or the DFlash block size"
            )
        self.weaver = Weaver.from_pretrained(settings.drafter_dir, dtype=self.dtype, device=self.device).eval()
        self.weaver.fp8_weights = settings.tfm.weaver_weights == "fp8"
        if self.weaver.fp8_weights:
            logger.info("vllm-tfm: the Weaver's projections run on e4m3 rows with per-row scales (weaver_weights 'fp8')")
        tp = tp_world_size()
        self._target_embed = target_vocab_table(
            target_model, ("model.embed_tokens", "language_model.model.embed_tokens"), "input embedding", tp
        )
        self._target_lm_head = target_vocab_table(target_model, ("lm_head", "language_model.lm_head"), "lm_head", tp)

    def _load_treeflash(self, target_model: torch.nn.Module) -> None:
        """The TreeFlash approximator from the drafter directory, and the drafter's final norm
        replaced so that its forward also returns the pre-norm stream (``dflash_prenorm``)."""
        from vllm_tfm.models.tfm_config import TREEFLASH_WEIGHTS_NAME
        from vllm_tfm.models.treeflash import TreeFlashApproximator
        from vllm_tfm.models.vocab_table import table_rows

        settings = self.tfm_settings
        cfg = settings.tfm.treeflash
        if cfg is None or settings.drafter_dir is None:
            raise ValueError("tfm proposal 'treeflash' needs a local drafter directory whose tfm_config.json has a 'treeflash' section")
        if cfg.hidden_size != self.hidden_size:
            raise ValueError(f"TreeFlash hidden_size {cfg.hidden_size} does not match the DFlash drafter's hidden size {self.hidden_size}")
        try:
            approx = TreeFlashApproximator.from_pretrained(settings.drafter_dir, dtype=self.dtype, device=self.device)
        except (OSError, ValueError, RuntimeError) as e:
            raise ValueError(f"vllm-tfm: cannot load {TREEFLASH_WEIGHTS_NAME} from {settings.drafter_dir}: {e}".splitlines()[0]) from None
        self.treeflash = approx.eval()
        norm = install_prenorm_output(self.model)
        hidden = self.hidden_size
        embed = target_vocab_table(
            target_model, ("model.embed_tokens", "language_model.model.embed_tokens"), "input embedding", tp_world_size()
        )
        def final_norm(x: Tensor) -> Tensor:  # vLLM's RMSNorm on rows
            return norm(x.reshape(-1, hidden)).view(x.shape)

        def rows(ids: Tensor) -> Tensor:
            return table_rows(embed, ids)

        def head(x: Tensor) -> Tensor:  # the drafter's logits (the target's lm_head, vocabulary-gathered)
            return self._drafter_logits(x.reshape(-1, hidden)).view(*x.shape[:-1], -1)

        self._treeflash_io = (final_norm, rows, head)

    # ------------------------------------------------------------------ warm-up
    def warm_up_weaver_graphs(self, max_requests: int) -> tuple[int, ...]:
        """Capture the Weaver CUDA graphs of every batch of 1..``max_requests`` requests now
        (``WeaverGraphs.warm_up``); returns the buckets captured. Nothing without graphs
        (``VLLM_TFM_WEAVER_GRAPHS=0``), without a Weaver (proposal chain / ddtree) or where builds
        run eagerly (vocabulary-split tables)."""
        graphs, weaver = self._weaver_graphs, self.weaver
        if graphs is None or weaver is None or self._target_embed is None or self._target_lm_head is None:
            return ()
        s = self.tfm_settings
        budget = s.budget  # vLLM's num_speculative_tokens, what it passes to propose
        depth = min(s.max_depth, budget)
        verifier_size = int(self.vllm_config.model_config.get_hidden_size())
        one_row: list[DrafterOutputs] = []

        def make_inputs(rows: int) -> DrafterOutputs:
            if not one_row:  # one zero row, the serving shapes and dtypes (the logits from the drafter's own head)
                hidden = torch.zeros(depth, self.hidden_size, dtype=self.dtype, device=self.device)
                logits = self._drafter_logits(hidden)
                verifier = torch.zeros(1, verifier_size, dtype=self.dtype, device=self.device)
                roots = torch.zeros(1, dtype=torch.int32, device=self.device)
                one_row.append((logits[None], hidden[None], verifier, roots))
            logits, hidden, verifier, roots = one_row[0]
            return logits.expand(rows, -1, -1), hidden.expand(rows, -1, -1), verifier.expand(rows, -1), roots.expand(rows)

        cuda = torch.device(self.device).type == "cuda" and torch.cuda.is_available()
        free0 = torch.cuda.mem_get_info(self.device)[0] if cuda else 0
        t0 = time.perf_counter()
        done = graphs.warm_up(max_requests, make_inputs, weaver, self._target_embed, self._target_lm_head, budget,
                              s.top_k, s.width, s.children_per_node, torch.device(self.device))
        if done:
            used = (free0 - torch.cuda.mem_get_info(self.device)[0]) / (1 << 20) if cuda else 0.0
            logger.info("vllm-tfm: captured the Weaver CUDA graphs of batch buckets %s at start-up in %.2f s, "
                        "GPU memory %+.0f MiB (batches of up to %d requests replay them; none is captured while serving)",
                        list(done), time.perf_counter() - t0, used, max_requests)
        return done

    def _load_draft_head(self) -> None:
        """The drafter's own logits head where ``draft_lm_head`` is 'fp8' or ``draft_vocab`` is set (draft_head.py)."""
        tfm = self.tfm_settings.tfm
        ids = None
        if tfm.draft_vocab is not None:
            path = draft_vocab_path(tfm, get_drafter_dir(self.vllm_config))
            ids = load_draft_vocab(path, tfm.draft_vocab_size, int(self.model.logits_processor.org_vocab_size))
        self._draft_logits = draft_logits_head(self.model, self.dtype, tp_world_size(), tfm.draft_lm_head == "fp8", ids)
        if tfm.draft_lm_head == "fp8":
            logger.info("vllm-tfm: the DFlash drafter's logits read an FP8 copy of the lm_head (draft_lm_head 'fp8')")
        if ids is not None:
            logger.info("vllm-tfm: the DFlash drafter drafts from the %d tokens of draft vocabulary %s (its logits of "
                        "the other tokens are -inf)", ids.numel(), path)

    # ------------------------------------------------------------------ full drafter graphs
    def _route_forward_through_graphs(self) -> None:
        """The drafter model's forward, as an instance attribute (its class, which vLLM's proposer asserts, stays):
        a step that set a graph key and runs in mode FULL goes through ``DrafterGraphs.run``, any other call (the
        profile run, vLLM's piecewise capture, steps without a key) to the model's own forward."""
        from vllm.config import CUDAGraphMode
        from vllm.forward_context import get_forward_context

        model, graphs = self.model, self._drafter_graphs
        inner = model.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            key = self._drafter_graph_key
            if key is None or get_forward_context().cudagraph_runtime_mode != CUDAGraphMode.FULL:
                return inner(*args, **kwargs)
            replays = graphs.replays
            out = graphs.run(key, lambda: inner(*args, **kwargs))
            if STATE.metrics is not None:
                STATE.metrics.hook("proposer.drafter_graph")
                if graphs.replays > replays:
                    STATE.metrics.hook("proposer.drafter_graph_replay")
            return out

        model.forward = forward

    def set_inputs_first_pass(self, *args: Any, **kwargs: Any) -> tuple[int, Tensor, Any]:
        """DFlash's inputs; where this step's forward takes a full graph, its attention metadata's per-step tensors
        are replaced by the graphs' persistent copies and the step's key is kept for the dispatch and the forward."""
        num_tokens, token_indices, cad = super().set_inputs_first_pass(*args, **kwargs)
        self._drafter_graph_key = None
        graphs = self._drafter_graphs
        if graphs is not None and drafter_graphs_enabled():
            key = graphs.key(cad.num_reqs, 1 + int(self.num_speculative_tokens), num_tokens)
            if key is not None:
                cad = graphs.persistent_metadata(cad, key)
                self._drafter_graph_key = key
        return num_tokens, token_indices, cad

    def _determine_batch_execution_and_padding(self, num_tokens: int, use_cudagraphs: bool = True) -> tuple[Any, int, Any]:
        """Mode FULL, unpadded, for a step with a graph key (its forward replays the full graph); vLLM's dispatch
        (piecewise, padded to a capture size) otherwise."""
        key = self._drafter_graph_key
        if key is not None and use_cudagraphs and num_tokens == key[0] * key[1]:
            from vllm.config import CUDAGraphMode

            return CUDAGraphMode.FULL, num_tokens, None
        return super()._determine_batch_execution_and_padding(num_tokens, use_cudagraphs)

    # ------------------------------------------------------------------ marginals
    def _drafter_logits(self, hidden_states: Tensor) -> Tensor:
        """[M, H] -> [M, V]: the drafter's ``compute_logits``, or its own head (``draft_lm_head``, ``draft_vocab``)."""
        if self._draft_logits is not None:
            return self._draft_logits(hidden_states)
        return self.model.compute_logits(hidden_states)

    def _sample_draft_tokens(self, hidden_states: Tensor, sampling_metadata: Any) -> tuple[Tensor, Tensor | None]:
        if self.treeflash is not None:  # rows [normed | pre-norm stream] (dflash_prenorm)
            hidden_states, self._dflash_prenorm = split_rows(hidden_states, self.hidden_size)
        logits = self._drafter_logits(hidden_states)
        self._marginal_logits = logits
        self._dflash_out = hidden_states
        # vLLM's propose only reshapes and returns these ids (llm_base_proposer.py ~619-627), and ``propose``
        # below drops them for the trees: zeros instead of an argmax over [R * D, V] (14 us at batch 1 at the
        # 27B shape, bench/NOTES.md section 62)
        return torch.zeros(logits.shape[0], dtype=torch.long, device=logits.device), None

    # ------------------------------------------------------------------ propose
    def propose(
        self,
        num_speculative_tokens: int,
        target_token_ids: Tensor,
        target_positions: Tensor,
        target_hidden_states: Tensor,
        next_token_ids: Tensor,
        token_indices_to_sample: Tensor | None,
        common_attn_metadata: Any,
        sampling_metadata: Any,
        mm_embed_inputs: Any = None,
        num_rejected_tokens_gpu: Tensor | None = None,
        slot_mappings: Any = None,
    ) -> Tensor:
        metrics = STATE.metrics
        step = STATE.step
        if step is not None and step.tree_active and step.accept is not None:
            perm = dflash_context_order(
                step.dev("req_index"), step.dev("row_base"), step.dev("num_scheduled"), step.accept.accepted_nodes
            )
            target_hidden_states = target_hidden_states[perm]
            target_token_ids = target_token_ids[perm]
            target_positions = step.seq_positions
            if metrics is not None:
                metrics.hook("proposer.context_reorder")
        settings = self.tfm_settings.current()
        budget = int(num_speculative_tokens)
        depth = min(settings.max_depth, budget)
        with TIMER.span("draft"):
            try:
                super().propose(
                    depth,
                    target_token_ids,
                    target_positions,
                    target_hidden_states,
                    next_token_ids,
                    token_indices_to_sample,
                    common_attn_metadata,
                    sampling_metadata,
                    mm_embed_inputs=mm_embed_inputs,
                    num_rejected_tokens_gpu=num_rejected_tokens_gpu,
                    slot_mappings=slot_mappings,
                )
            finally:
                self._drafter_graph_key = None  # dummy runs and vLLM's captures never take a key
        num_req = next_token_ids.shape[0]
        logits = self._marginal_logits
        if logits is None:
            raise RuntimeError("vllm-tfm: the DFlash forward produced no marginals")
        logits = logits.view(num_req, depth, -1)
        if STATE.replay is not None:  # benchmark-only: spine-first marginals (runtime/replay.py)
            with TIMER.span("replay_shaping"):
                logits = STATE.replay.shape(logits)
        native = needs_native_sampler(self._tfm_runner.input_batch.sampling_metadata)
        proposal = "chain" if native else settings.proposal
        with metrics.timed(f"tree_build.{proposal}") if metrics is not None else nullcontext(), TIMER.span("tree_build"):
            tokens, parents = self._build(proposal, logits, next_token_ids, budget, depth, num_rejected_tokens_gpu)
        req_ids = list(self._tfm_runner.input_batch.req_ids[:num_req])
        if STATE.check_tp:
            STATE.check_step += 1
            check_same_on_tp_ranks("draft trees (tokens, parents)", [tokens, parents], req_ids, STATE.check_step)
            if metrics is not None:
                metrics.tp_tree_checks += 1
        tail = self._weaver_graphs.last_tail if proposal == "tfm" and self._weaver_graphs is not None else None
        STATE.store.put(req_ids, tokens, parents, finish=None if tail is None else tail.finish)
        STATE.store.retain(self._tfm_runner.requests)
        if metrics is not None:
            metrics.hook(f"proposer.{proposal}")
        self._marginal_logits = None
        self._dflash_out = None
        self._dflash_prenorm = None
        return tokens

    def _build(
        self,
        proposal: str,
        logits: Tensor,
        root_tokens: Tensor,
        budget: int,
        depth: int,
        num_rejected: Tensor | None,
    ) -> tuple[Tensor, Tensor]:
        if proposal in ("chain", "ddtree"):
            logprobs = torch.log_softmax(logits.float(), dim=-1)  # the Weaver reads raw logits
            if proposal == "chain":
                return chain_trees(logprobs, budget)
            tokens, parents, _ = ddtree_trees(logprobs, budget)
            return tokens, parents
        if proposal == "tfm":
            if self.weaver is None:
                raise ValueError("tfm proposal 'tfm' needs the Weaver, which was not loaded (no 'weaver' in tfm_config.json)")
            num_req = root_tokens.shape[0]
            dflash_hidden = self._dflash_out.view(num_req, depth, -1)
            verifier = self._verifier_hidden(num_req, num_rejected)
            s = self.tfm_settings
            graphs = self._weaver_graphs
            replays = 0 if graphs is None else graphs.replays
            extra = {} if graphs is None else {"defer_tail": bool(STATE.defer_drafts)}  # deferred_drafts.py
            out = (weaver_trees if graphs is None else graphs.weaver_trees)(
                self.weaver,
                logits,
                dflash_hidden,
                verifier,
                root_tokens,
                self._target_embed,
                self._target_lm_head,
                budget,
                s.top_k,
                s.width,
                s.children_per_node,
                **extra,
            )
            if self._weaver_graphs is not None and STATE.metrics is not None:  # which build ran (hooks fired)
                STATE.metrics.hook("weaver.graph" if self._weaver_graphs.replays > replays else "weaver.eager")
            return out
        if proposal == "treeflash":
            if self.treeflash is None or self._treeflash_io is None or self._dflash_prenorm is None:
                raise ValueError(
                    "tfm proposal 'treeflash' needs the TreeFlash approximator, which was not loaded "
                    "(no 'treeflash' section or tfm/treeflash.safetensors in the drafter directory)"
                )
            num_req = root_tokens.shape[0]
            final_norm, embed, head = self._treeflash_io
            return treeflash_trees(
                self.treeflash,
                final_norm,
                self._dflash_prenorm.view(num_req, depth, -1),
                logits,
                root_tokens,
                embed,
                head,
                budget,
                self.tfm_settings.tfm.treeflash_top_m,
            )
        raise ValueError(f"unknown tfm proposal {proposal!r}")

    def _verifier_hidden(self, num_req: int, num_rejected: Tensor | None) -> Tensor:
        """The target's final hidden state at each request's bonus row (Weaver prompt token 0).

        Request r owns logits rows [sample_cu[r], sample_cu[r + 1]); its bonus came from the row
        of its deepest accepted node: the tree's last node, or on a native chain step
        ``num_draft - num_rejected``, or row 0 when nothing was drafted.
        """
        sample_hidden = STATE.final_hidden
        step = STATE.step
        if sample_hidden is None or step is None:
            raise RuntimeError("vllm-tfm: the target's sampled hidden states were not captured this step")
        start = step.dev("sample_cu")[:-1]
        if step.tree_active and step.accept is not None:
            last = step.accept.last_node
        elif num_rejected is not None:
            last = step.dev("num_draft") - num_rejected.to(torch.long)
        else:
            last = torch.zeros(num_req, dtype=torch.long, device=start.device)
        return sample_hidden[bonus_rows(start, last)]


def _drafter_graphs(vllm_config: Any, device: torch.device) -> DrafterGraphs | None:
    """The proposer's full drafter graphs where the engine starts with ``VLLM_TFM_DRAFTER_GRAPHS=1``, on a CUDA
    device, one GPU (no tensor, pipeline or data parallelism), CUDA graphs not turned off (``enforce_eager``,
    cudagraph mode NONE, the speculative config's ``enforce_eager``); None elsewhere, and the proposer is vLLM's
    DFlash path unchanged. With them, whether a step uses them is read again per step (``set_drafter_graphs``)."""
    from vllm.config import CUDAGraphMode

    if not drafter_graphs_enabled():
        return None
    par = vllm_config.parallel_config
    if torch.device(device).type != "cuda" or par.tensor_parallel_size * par.pipeline_parallel_size * par.data_parallel_size != 1:
        return None
    if vllm_config.model_config.enforce_eager or getattr(vllm_config.speculative_config, "enforce_eager", False):
        return None
    if vllm_config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE:
        return None
    return DrafterGraphs(int(vllm_config.scheduler_config.max_num_seqs), torch.device(device))
