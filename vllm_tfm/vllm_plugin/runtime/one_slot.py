"""One GDN state slot per request (``gdn_state_slots: "one"``, the default on one GPU):
the committed state always sits at slot ``[n, 0]``, conv window columns ``0 .. W - 2``.

vLLM 0.26 gives a request of a hybrid target 1 + B GDN state slots per layer when it speculates B
tokens (``MambaBase.get_kv_cache_spec``: ``MambaSpec.num_speculative_blocks = B``): its chain kernel
writes one state per draft position, and the next step reads slot ``[n, a - 1]`` with ``a`` the
accepted count (``num_accepted_tokens``). The tree verify writes no state at all and the commit
kernels read every source before they write (``cuda/gdn_tree_commit.cu``, ``cuda/tree_conv.cu``), so a
tfm request needs one slot only. In this mode:

- vLLM allocates one slot: :func:`one_slot_kv_cache_specs` sets ``num_speculative_blocks = 0`` on the
  target's ``MambaSpec`` s (the state shapes, hence the page size, stay vLLM's; the conv state keeps
  its W - 1 + B columns, of which 0 .. W - 2 are used). At the Qwen3.6-27B shape and B = 16 that is
  0.158 GiB of GDN state per request instead of 2.69 (``bench/e2e_models.py``
  ``gdn_state_bytes_per_request``).
- Every GDN layer reads ``[n, 0]``: the verify is given :func:`read_offsets` (all 1) for vLLM's
  ``num_accepted_tokens``, which then means nothing to these layers.
- Every commit writes ``[n, 0]``: :func:`commit_destinations` (all 0) for the accepted draft counts,
  in place (source and destination are the same slot).
- Every step with drafts runs the GDN layers on the tree path (``gdn.py``): vLLM's chain kernel
  indexes ``1 + B`` slot columns and must never see a one-column table. A step that keeps vLLM's
  sampler (penalties, logprobs: ``sampler.needs_native_sampler``) or holds only chains is a
  ``StepTree.gdn_tree`` step: its drafts are verified by vLLM's sampler as a chain, its GDN layers by
  the tree verify on the chain, and :func:`chain_accepted` reads the accepted path from the sampled
  tokens for the commit.
- Nothing is left for ``accepted_offsets.py`` to move: prefills, plain decodes (vLLM) and commits (ours)
  all leave the state at ``[n, 0]``.
- vLLM's own full decode graphs (which would run its chain kernel) are never captured nor replayed
  (``graph_dispatch.py``): where tfm's full tree graphs cannot run, steps with drafts replay piecewise graphs.

Prefix caching of hybrid models (``mamba_cache_mode`` 'align' / 'all') is refused for every tfm engine
(``hooks.check_engine_config``), so 'none' is the only layout handled here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["AUTO", "ONE_SLOT", "ONES", "PER_DRAFT", "resolve_gdn_state_slots", "gdn_state_slots_from_env",
           "one_slot_kv_cache_specs",
           "read_offsets", "commit_destinations", "chain_accepted", "concurrency_with_slots",
           "per_draft_concurrency_notice"]

ONE_SLOT = "one"
"""The ``gdn_state_slots`` value of this mode (``TfmConfig``)."""
PER_DRAFT = "per_draft"
"""vLLM's own layout: 1 + B GDN state slots per request."""
AUTO = "auto"
"""The default: one slot on one GPU, per_draft with tensor or data parallelism (:func:`resolve_gdn_state_slots`)."""


def resolve_gdn_state_slots(setting: str, tensor_parallel_size: int = 1, data_parallel_size: int = 1) -> tuple[str, str]:
    """(``"one"`` or ``"per_draft"``, why) for a tfm engine's ``gdn_state_slots`` setting.

    ``"auto"`` (the default) is one slot on one GPU (tensor and data parallelism 1), where the one-slot
    engines have run the zoo checks, the serving and preemption soaks, Ray and the 27B shape
    (bench/NOTES.md sections 59-61): at the Qwen3.6-27B shape and B = 16 an 80 GB card holds about 6
    per-draft requests of 608 tokens and 65-72 one-slot ones. With tensor or data parallelism ``"auto"``
    keeps vLLM's per-draft layout, as the unset CUDA-graph mode keeps PIECEWISE there
    (``vllm_plugin/cuda_graphs.py``): one slot has not run on more than one GPU. An explicit value is
    kept as it is.
    """
    if setting in (ONE_SLOT, PER_DRAFT):
        return setting, "set"
    if setting != AUTO:
        raise ValueError(f"gdn_state_slots={setting!r}: 'auto', 'per_draft' or 'one'")
    tp, dp = int(tensor_parallel_size), int(data_parallel_size)
    if tp > 1 or dp > 1:
        return PER_DRAFT, f"'auto' at tensor parallelism {tp}, data parallelism {dp}: one slot has run on one GPU only"
    return ONE_SLOT, "'auto' on one GPU"


def gdn_state_slots_from_env(environ: Mapping[str, str] | None = None) -> str:
    """``"one"`` or ``"per_draft"``: ``gdn_state_slots`` as an engine on one GPU resolves it from these
    ``VLLM_TFM_*`` variables (default ``os.environ``; unset: the default ``"auto"``), through the plugin's own
    parsing (``options.env_overrides``: an unknown ``VLLM_TFM_*`` name or a refused value raises ValueError) and
    :func:`resolve_gdn_state_slots`. For the benches, which set the variables their engines inherit."""
    from ..options import env_overrides

    return resolve_gdn_state_slots(env_overrides(environ)[0].get("gdn_state_slots") or AUTO)[0]


def _one_block(spec: Any) -> Any:
    """A ``MambaSpec`` holding one block per request (other specs as they are). Only the block count
    changes: the shapes (so the page size and its padding, which the hybrid allocator has already
    aligned with the attention groups) stay as vLLM made them."""
    from vllm.v1.kv_cache_interface import MambaSpec

    return dataclasses.replace(spec, num_speculative_blocks=0) if isinstance(spec, MambaSpec) else spec


def one_slot_kv_cache_specs(specs: dict[str, Any]) -> dict[str, Any]:
    """``GPUModelRunner.get_kv_cache_spec``'s result with every ``MambaSpec`` holding one block per request."""
    return {name: _one_block(spec) for name, spec in specs.items()}


def concurrency_with_slots(vllm_config: Any, kv_cache_config: Any) -> tuple[float, float]:
    """vLLM's maximum concurrency of a KV cache (requests of ``max_model_len`` tokens held at once, vLLM's
    ``get_max_concurrency_for_kv_cache_config``, the figure of its start-up log) as allocated, and with
    the GDN state groups at one slot per request: the same blocks, the same page size."""
    from vllm.v1.core.kv_cache_utils import get_max_concurrency_for_kv_cache_config

    now = get_max_concurrency_for_kv_cache_config(vllm_config, kv_cache_config)
    groups = [dataclasses.replace(g, kv_cache_spec=_one_block(g.kv_cache_spec)) for g in kv_cache_config.kv_cache_groups]
    one = get_max_concurrency_for_kv_cache_config(vllm_config, dataclasses.replace(kv_cache_config, kv_cache_groups=groups))
    return now, one


def per_draft_concurrency_notice(now: float, one: float, max_num_seqs: int, budget: int) -> str | None:
    """The start-up warning of a per-draft engine whose GDN state slots keep its KV cache below
    ``max_num_seqs`` requests when one slot would hold more (None otherwise). On an 80 GB H100 at the
    Qwen3.6-27B shape and B = 16: 5.56 requests of 608 tokens, 64.9 with one slot in the same 973 blocks
    (175 blocks a request against 15; the one-slot engine itself got 72.4 of 1,086: bench/NOTES.md section 60)."""
    if now >= max_num_seqs or one <= now:
        return None
    return (f"vllm-tfm: the KV cache holds {now:.2f} requests of max_model_len tokens at once (max_num_seqs "
            f"{max_num_seqs}): each keeps 1 + B = {1 + budget} GDN state slots (gdn_state_slots 'per_draft'). "
            f"With gdn_state_slots 'one' it would hold {one:.2f} (docs/vllm_plugin.md, \"One GDN state slot per request\").")


class _Ones:
    """Per-device int32 buffers of ones, grown (never replaced while a graph may hold them: ``reserve``
    them at start-up for the largest batch)."""

    def __init__(self) -> None:
        self._buf: dict[tuple[str, int], Tensor] = {}

    def reserve(self, n: int, device: torch.device | str) -> Tensor:
        """The buffer of ``device``, at least n long (made or grown here)."""
        dev = torch.device(device)
        key = (dev.type, -1 if dev.index is None else dev.index)
        have = self._buf.get(key)
        if have is None or have.shape[0] < n:
            have = self._buf[key] = torch.ones(n, dtype=torch.int32, device=dev)
        return have

    def get(self, n: int, device: torch.device | str) -> Tensor:
        return self.reserve(n, device)[:n]


ONES = _Ones()


def read_offsets(state_indices: Tensor) -> Tensor:
    """What a GDN layer is given for vLLM's ``num_accepted_tokens`` of the spec requests whose slots are
    ``state_indices`` [Rs, columns]: 1 for every row (the state at column 0), int32, at a fixed address
    for a given Rs (full tree graphs capture it)."""
    return ONES.get(state_indices.shape[0], state_indices.device)


def commit_destinations(num_accepted: Tensor) -> Tensor:
    """The commit's destination offsets for accepted draft counts ``num_accepted`` [Rs]: 0 for every row
    (slot ``[n, 0]``, conv columns from 0), in place of the counts."""
    return torch.zeros_like(num_accepted)


def chain_accepted(spec_tokens: Tensor) -> tuple[Tensor, Tensor]:
    """(last accepted node, accepted draft count) of the spec requests of a ``gdn_tree`` step, from vLLM's
    sampled tokens.

    spec_tokens: [Rs, 1 + max drafts] vLLM's sampler output for the spec requests (``commit.spec_rows``), -1
    after each row's last valid token (valid tokens are contiguous from column 0, as
    ``_update_states_after_model_execute`` counts them). A chain's node j is its j-th draft, so both results
    are the count of valid tokens minus one (the bonus), int64, on the device; no host wait.
    """
    p = (spec_tokens != -1).sum(dim=1).sub_(1).clamp_(min=0)
    return p, p
