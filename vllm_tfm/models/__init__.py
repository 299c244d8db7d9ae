"""Drafter models in plain torch (no vLLM import): the DFlash block drafter (z-lab checkpoint
layout), the Weaver tree scorer and the TreeFlash AR approximator, with Hugging Face style
``save_pretrained`` / ``from_pretrained`` (safetensors) and one-line load errors."""

from .dflash import DFLASH_ARCHITECTURE, ContextKV, DFlashConfig, DFlashDrafter, marginal_logits
from .drafter_dir import DrafterBundle, load_drafter_dir
from .tfm_config import TfmConfig, TreeFlashConfig, WeaverConfig
from .treeflash import TreeFlashApproximator, TreeFlashTransitionScorer
from .weaver import Weaver, WeaverTreeScorer, candidate_logprobs, weaver_param_count

__all__ = [
    "DFLASH_ARCHITECTURE",
    "ContextKV",
    "DFlashConfig",
    "DFlashDrafter",
    "marginal_logits",
    "DrafterBundle",
    "load_drafter_dir",
    "TfmConfig",
    "TreeFlashConfig",
    "WeaverConfig",
    "TreeFlashApproximator",
    "TreeFlashTransitionScorer",
    "Weaver",
    "WeaverTreeScorer",
    "candidate_logprobs",
    "weaver_param_count",
]
