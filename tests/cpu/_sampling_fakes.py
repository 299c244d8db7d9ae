"""What the tree sampler (vllm_tfm/vllm_plugin/runtime/sampler.py) reads of vLLM's SamplingMetadata, as a
namespace: by default a batch that needs no vLLM sampler (no penalties, bad words, allowed-token mask,
logprobs, active logits processor or thinking budget); keyword arguments replace fields."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any


def sampling_metadata(**kw: Any) -> SimpleNamespace:
    fields: dict[str, Any] = dict(
        top_k=None, top_p=None, generators={}, no_penalties=True, bad_words_token_ids={}, allowed_token_ids_mask=None,
        max_num_logprobs=None, thinking_budget_state_holder=None,
        logitsprocs=SimpleNamespace(argmax_invariant=[], non_argmax_invariant=[]),
    )
    return SimpleNamespace(**(fields | kw))
