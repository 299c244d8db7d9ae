"""Speculative decoding with trees against a `transformers` target: the research oracle.

* :class:`TreeTarget` (``target_tree``): tree-verify forward of a Qwen3.5 hybrid / Qwen3 HF model
  with its own weights, and the commit of an accepted path into a :class:`CommittedState`
  (``cache``: attention KV + GDN conv/recurrent states in vllm_tfm's layouts).
* :class:`BranchVerifier` (``branch_verifier``): every root-to-leaf path through the unmodified
  HF model; the slow baseline and the oracle.
* :class:`SpeculativeDecoder` (``decoder``): draft -> tree -> verify -> accept -> commit, greedy
  or sampled, with per-step statistics.
* :class:`DFlashProposer` / :func:`make_proposer` (``drafters``): DFlash marginals into the chain,
  ddtree, treeflash and tfm (Weaver) tree builders.
* ``toy_targets`` / ``toy_drafters`` / ``zoo``: random tiny models and the toy-zoo loader (demo).
"""

from .branch_verifier import BranchVerifier, HFState
from .cache import AttentionKV, CommittedState, GDNState, from_hf_cache
from .decoder import GenerationResult, SamplingConfig, SpeculativeDecoder, StepStats
from .drafters import METHODS, DFlashProposer, DraftInputs, make_proposer
from .target_tree import PrefillOutput, TreeTarget, TreeVerifyOutput

__all__ = [
    "AttentionKV",
    "BranchVerifier",
    "CommittedState",
    "DFlashProposer",
    "DraftInputs",
    "GDNState",
    "GenerationResult",
    "HFState",
    "METHODS",
    "PrefillOutput",
    "SamplingConfig",
    "SpeculativeDecoder",
    "StepStats",
    "TreeTarget",
    "TreeVerifyOutput",
    "from_hf_cache",
    "make_proposer",
]
