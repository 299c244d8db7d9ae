"""The reference speculative decoder: draft -> tree -> verify -> accept -> commit, one request.

Per step (DESIGN.md section 2): the proposer turns the committed context into a tree whose root is
the bonus token; the target verifies every node in one tree forward (:class:`TreeTarget`, or the
slow per-branch :class:`BranchVerifier`); tree acceptance (``vllm_tfm.verify.sampling``) picks
the accepted path and the bonus token; the commit advances the target state along the path and
the drafter's context gains the path's tapped hidden states.

Greedy output equals the target's own greedy decoding token for token (float32); sampled output
has the target's distribution, with ``target_only`` acceptance (exact for the fixed, top-ranked
children sets every builder here produces) or ``traversal`` (Traversal Verification in its
sibling-order mode, which is exact for any children sets too; it reads each node's
``draft_logprobs``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from vllm_tfm.tree import Tree, TreeBatch
from vllm_tfm.verify.logits_processing import TreeSamplingParams, process_logits
from vllm_tfm.verify.sampling import verify_tree
from vllm_tfm.verify.uniforms import draw_uniforms, inverse_cdf

from .branch_verifier import BranchVerifier
from .drafters import DFlashProposer, DraftInputs
from .target_tree import TreeTarget

__all__ = ["SamplingConfig", "StepStats", "GenerationResult", "SpeculativeDecoder", "VERIFIERS", "ACCEPTANCE"]

VERIFIERS = ("tree", "branch")
ACCEPTANCE = ("target_only", "traversal")


@dataclass(frozen=True)
class SamplingConfig:
    """Target sampling parameters (vLLM semantics, applied at every tree node).

    temperature 0 (or < 1e-5) is greedy; top_k None/0 = off; top_p None/1 = off; min_p None/0 = off.
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def params(self, device: torch.device | str) -> TreeSamplingParams:
        return TreeSamplingParams.from_lists(
            [self.temperature],
            None if self.top_k is None else [self.top_k],
            None if self.top_p is None else [self.top_p],
            None if self.min_p is None else [self.min_p],
            device=device,
        )


@dataclass
class StepStats:
    """One decode step: ``accepted`` drafts (the tree depth reached), the tree's size and depth,
    and seconds spent drafting (DFlash + tree building), verifying, accepting and committing."""

    accepted: int
    tree_nodes: int
    tree_depth: int
    draft_s: float
    verify_s: float
    accept_s: float
    commit_s: float


@dataclass
class GenerationResult:
    """Generated ``tokens`` (prompt excluded) and per-step statistics."""

    prompt: list[int]
    tokens: list[int]
    steps: list[StepStats] = field(default_factory=list)
    max_depth: int = 0
    prefill_s: float = 0.0
    total_s: float = 0.0
    finish_reason: str = "length"

    @property
    def mean_accepted_length(self) -> float:
        """Mean tokens per target tree forward: accepted drafts + 1 (the bonus), over all steps."""
        if not self.steps:
            return float("nan")
        return sum(s.accepted + 1 for s in self.steps) / len(self.steps)

    @property
    def acceptance_by_depth(self) -> list[float]:
        """Entry d-1 = fraction of steps whose accepted path reached depth d (d = 1..max_depth)."""
        n = len(self.steps)
        if n == 0:
            return [float("nan")] * self.max_depth
        return [sum(s.accepted >= d for s in self.steps) / n for d in range(1, self.max_depth + 1)]

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.total_s if self.total_s > 0 else float("inf")

    @property
    def stage_seconds(self) -> dict[str, float]:
        return {
            "prefill": self.prefill_s,
            "draft": sum(s.draft_s for s in self.steps),
            "verify": sum(s.verify_s for s in self.steps),
            "accept": sum(s.accept_s for s in self.steps),
            "commit": sum(s.commit_s for s in self.steps),
        }


class SpeculativeDecoder:
    """Tree speculative decoding of one `transformers` target with one proposer.

    Args:
        target: ``Qwen3_5ForCausalLM`` or ``Qwen3ForCausalLM`` (eval mode).
        proposer: a :class:`DFlashProposer` (or anything with ``reset``, ``add_context``,
            ``propose`` and ``max_depth``, and ``drafter.config.target_layer_ids``).
        budget: B, draft nodes per tree (root excluded).
        verifier: ``"tree"`` (one tree forward, the default) or ``"branch"`` (one HF forward per
            root-to-leaf path: slow, the oracle).
        acceptance: stochastic tree acceptance when sampling, ``"target_only"`` (default) or
            ``"traversal"``; greedy decoding ignores it.
    """

    def __init__(
        self,
        target: nn.Module,
        proposer: DFlashProposer,
        budget: int,
        verifier: str = "tree",
        acceptance: str = "target_only",
    ) -> None:
        if budget < 1:
            raise ValueError(f"budget must be >= 1, got {budget}")
        if verifier not in VERIFIERS:
            raise ValueError(f"unknown verifier {verifier!r}; choose one of {', '.join(VERIFIERS)}")
        if acceptance not in ACCEPTANCE:
            raise ValueError(f"unknown acceptance {acceptance!r}; choose one of {', '.join(ACCEPTANCE)}")
        self.acceptance = acceptance
        taps = tuple(proposer.drafter.config.target_layer_ids)
        self.target = target
        self.proposer = proposer
        self.budget = int(budget)
        self.backend = TreeTarget(target, taps) if verifier == "tree" else BranchVerifier(target, taps)
        self.device = next(target.parameters()).device

    # ------------------------------------------------------------------ sampling helpers
    def _first_token(self, logits: Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> int:
        """The token after the prompt, from the last prompt position's logits [V]."""
        if sampling.greedy:
            return int(torch.argmax(logits))
        cu = torch.tensor([0, 1], dtype=torch.long, device=logits.device)
        probs = process_logits(logits[None], sampling.params(logits.device), cu)
        u = draw_uniforms(1, 1, logits.device, generator)[:, 0]
        return int(inverse_cdf(probs, u)[0])

    def _accept(self, tree: Tree, logits: Tensor, sampling: SamplingConfig, generator: torch.Generator | None) -> tuple[int, int]:
        """(deepest accepted node, bonus token) of one tree given the target logits [n, V]."""
        batch = TreeBatch.from_trees([tree.to(logits.device)])
        res = verify_tree(logits, batch, sampling.params(logits.device), method=self.acceptance, generator=generator)
        return int(res.last_node[0]), int(res.bonus[0])

    # ------------------------------------------------------------------ generate
    @torch.no_grad()
    def generate(
        self,
        prompt_ids: Sequence[int] | Tensor,
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None = None,
        sampling: SamplingConfig | None = None,
        generator: torch.Generator | None = None,
    ) -> GenerationResult:
        """Generate up to ``max_new_tokens`` tokens after ``prompt_ids`` (stops after an eos token).

        ``generator`` drives every random draw (first token, tree acceptance) when sampling.
        """
        return self.sample_many(prompt_ids, 1, max_new_tokens, eos_token_id, sampling, generator)[0]

    @torch.no_grad()
    def sample_many(
        self,
        prompt_ids: Sequence[int] | Tensor,
        num_samples: int,
        max_new_tokens: int,
        eos_token_id: int | Sequence[int] | None = None,
        sampling: SamplingConfig | None = None,
        generator: torch.Generator | None = None,
    ) -> list[GenerationResult]:
        """``num_samples`` independent generations from one prompt, prefilled once.

        Each generation starts from a copy of the prefilled state; with greedy sampling they are
        all equal. ``prefill_s`` of every result is the one shared prefill.
        """
        sampling = sampling or SamplingConfig()
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).view(-1).tolist()
        if not prompt:
            raise ValueError("the prompt must hold at least one token")
        if isinstance(eos_token_id, int):
            eos = {eos_token_id}
        else:
            eos = set() if eos_token_id is None else {int(t) for t in eos_token_id}
        t0 = time.perf_counter()
        state0, pre = self.backend.prefill(torch.tensor(prompt, device=self.device))
        prefill_s = time.perf_counter() - t0
        results = []
        for i in range(num_samples):
            state = state0 if i == num_samples - 1 else state0.clone()
            results.append(self._decode(prompt, state, pre, prefill_s, max_new_tokens, eos, sampling, generator))
        return results

    def _decode(self, prompt, state, pre, prefill_s, max_new_tokens, eos, sampling, generator) -> GenerationResult:
        """The decode loop from a prefilled ``state`` (consumed) and its :class:`PrefillOutput`."""
        result = GenerationResult(prompt=prompt, tokens=[], max_depth=self.proposer.max_depth, prefill_s=prefill_s)
        t_start = time.perf_counter()
        self.proposer.reset()
        self.proposer.add_context(pre.taps, 0)
        first = self._first_token(pre.logits, sampling, generator)
        committed = prompt + [first]
        result.tokens.append(first)
        verifier_hidden = pre.final_hidden

        def finished() -> bool:
            if result.tokens[-1] in eos:
                result.finish_reason = "eos"
                return True
            return len(result.tokens) >= max_new_tokens

        while not finished():
            t0 = time.perf_counter()
            inputs = DraftInputs(
                root=committed[-1],
                position=state.prefix_len,
                verifier_hidden=verifier_hidden,
                tokens=torch.tensor(committed, device=self.device),
            )
            tree = self.proposer.propose(inputs, self.budget)
            t1 = time.perf_counter()
            out = self.backend.verify(state, tree)
            t2 = time.perf_counter()
            last, bonus = self._accept(tree, out.logits, sampling, generator)
            t3 = time.perf_counter()
            start = state.prefix_len
            path = self.backend.commit(state, tree, out, last)
            self.proposer.add_context(out.taps[path], start)
            verifier_hidden = out.final_hidden[last]
            t4 = time.perf_counter()
            result.steps.append(
                StepStats(len(path) - 1, tree.num_nodes, tree.max_depth, t1 - t0, t2 - t1, t3 - t2, t4 - t3)
            )
            new = tree.tokens[path[1:]].tolist() + [bonus]
            committed.extend(new)
            for tok in new:
                result.tokens.append(tok)
                if tok in eos or len(result.tokens) >= max_new_tokens:
                    break
        result.total_s = prefill_s + time.perf_counter() - t_start
        return result
