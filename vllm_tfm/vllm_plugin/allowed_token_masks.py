"""vLLM 0.26's ``allowed_token_ids`` masks kept with their requests when the input batch moves rows.

``InputBatch`` (``vllm/v1/worker/gpu_input_batch.py``, vLLM 0.26.0) holds one row of
``allowed_token_ids_mask_cpu_tensor`` per batch slot (True = token masked); the sampler and the
rejection sampler mask row r of the logits with row r of its device copy. Two of its row moves
lose a mask:

* ``swap_states(i1, i2)`` swaps the two rows with a tuple of tensor views
  (``t[i1], t[i2] = t[i2], t[i1]``): the first assignment overwrites row i1, which the second view
  then reads, so both rows end with row i2's old mask. The request that moved out of slot i1 loses
  its mask and samples from the whole vocabulary. ``reorder_batch_to_split_decodes_and_prefills``
  swaps rows whenever a new request lands in a slot before a running one (GDN and other
  decode-first backends, every hybrid Qwen3.5 engine, speculative or not), so a request with
  ``allowed_token_ids`` that is moved forward gets tokens outside its ids from then on. This is
  what the asynchronous serving soak of bench/NOTES.md section 54 caught (two tokens outside ids
  3..199 at the request's end); it is not specific to tfm or to asynchronous scheduling. Known
  upstream: vllm-project/vllm pull request #48419 (open).
* ``condense()`` copies the last row into the hole it fills and leaves the last row as it was;
  ``add_request`` writes a row only for a request with ``allowed_token_ids``, so a request without
  them that later takes that slot inherits the old mask while any request in the batch has one
  (vllm-project/vllm issue #43894, open).

Patched here, once per process (``patching``), for every engine of the process (the fixes are
vLLM's intended behaviour, so no-spec engines in a process with the plugin get them too):

* ``InputBatch.swap_states``: the original, then both rows written from copies taken before it (while
  some request of the batch has ``allowed_token_ids``; otherwise every active row is clear and the
  swap needs no copies: a vocabulary-wide row is ~250 KB at Qwen3.5's vocabulary);
* ``InputBatch.add_request``: the original, then the new slot's row cleared when the request has
  no ``allowed_token_ids`` and the mask exists.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from .patching import replace_attribute

__all__ = ["install_allowed_token_masks"]


def _make_swap_states(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def swap_states(self: Any, i1: int, i2: int) -> None:
        mask = self.allowed_token_ids_mask_cpu_tensor
        if mask is None or not self.has_allowed_token_ids:  # every active row clear (add_request below): no copies
            return original(self, i1, i2)
        rows = (mask[i1].clone(), mask[i2].clone())
        original(self, i1, i2)
        mask[i1].copy_(rows[1])
        mask[i2].copy_(rows[0])

    return swap_states


def _make_add_request(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def add_request(self: Any, request: Any) -> Any:
        out = original(self, request)
        mask = self.allowed_token_ids_mask_cpu_tensor
        params = request.sampling_params
        if mask is not None and params is not None and not params.allowed_token_ids:
            mask[self.req_id_to_index[request.req_id]].fill_(False)
        return out

    return add_request


def install_allowed_token_masks() -> None:
    """Patch ``InputBatch.swap_states`` and ``InputBatch.add_request`` (module docstring); idempotent."""
    from vllm.v1.worker.gpu_input_batch import InputBatch

    replace_attribute(InputBatch, "swap_states", _make_swap_states,
                      reason="swap the allowed_token_ids mask rows (vLLM 0.26 swaps tensor views: one row is lost)")
    replace_attribute(InputBatch, "add_request", _make_add_request,
                      reason="a request without allowed_token_ids gets a clear mask row (vLLM 0.26 leaves a moved row's old mask)")
