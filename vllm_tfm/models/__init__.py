"""Drafter models in plain torch (no vLLM import): the DFlash block drafter (z-lab checkpoint
layout), the Weaver tree scorer and the TreeFlash AR approximator, with Hugging Face style
``save_pretrained`` / ``from_pretrained`` (safetensors) and one-line load errors; ``proposal_trees``
turns their outputs into draft trees for R requests at once."""

from .dflash import DFLASH_ARCHITECTURE, ContextKV, DFlashConfig, DFlashDrafter, drafter_logits, marginal_logits
from .drafter_dir import DrafterBundle, load_drafter_dir
from .tfm_config import TfmConfig, TreeFlashConfig, WeaverConfig
from .proposal_trees import treeflash_padded_trees, weaver_draft_trees, weaver_padded_trees
from .treeflash import BatchedTreeFlashTransitionScorer, TreeFlashApproximator, TreeFlashTransitionScorer
from .weaver import BatchedWeaverTreeScorer, Weaver, WeaverTreeScorer, candidate_logprobs, weaver_param_count

__all__ = [
    "DFLASH_ARCHITECTURE",
    "ContextKV",
    "DFlashConfig",
    "DFlashDrafter",
    "marginal_logits",
    "drafter_logits",
    "DrafterBundle",
    "load_drafter_dir",
    "TfmConfig",
    "TreeFlashConfig",
    "WeaverConfig",
    "TreeFlashApproximator",
    "TreeFlashTransitionScorer",
    "BatchedTreeFlashTransitionScorer",
    "Weaver",
    "WeaverTreeScorer",
    "BatchedWeaverTreeScorer",
    "candidate_logprobs",
    "weaver_param_count",
    "weaver_padded_trees",
    "weaver_draft_trees",
    "treeflash_padded_trees",
]
