"""vLLM 0.26's input batch keeps each request's allowed_token_ids mask row with the request once the
plugin's patch is in (vllm_tfm/vllm_plugin/allowed_token_masks.py), on vLLM's real ``InputBatch`` and
its real decode-first reorder; without the patch the same moves lose a mask (the bugs the patch fixes)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

VOCAB = 64


@pytest.fixture
def vllm_batch(monkeypatch):
    import vllm.utils.torch_utils as tu
    import vllm.v1.worker.gpu_input_batch as gib

    monkeypatch.setattr(tu, "PIN_MEMORY", False)  # vLLM pins host buffers when CUDA is expected
    monkeypatch.setattr(gib, "PIN_MEMORY", False)
    from vllm import SamplingParams
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    def make(max_reqs: int = 8) -> InputBatch:
        return InputBatch(max_num_reqs=max_reqs, max_model_len=64, max_num_batched_tokens=256,
                          device=torch.device("cpu"), vocab_size=VOCAB, block_sizes=[16], kernel_block_sizes=[16],
                          max_num_blocks_per_req=[4])

    def request(rid: str, allowed: list[int] | None = None, computed: int = 3) -> CachedRequestState:
        return CachedRequestState(req_id=rid, prompt_token_ids=[1, 2, 3], mm_features=[],
                                  sampling_params=SamplingParams(temperature=0.0, allowed_token_ids=allowed),
                                  generator=None, block_ids=([0],), num_computed_tokens=computed, output_token_ids=[])

    return SimpleNamespace(make=make, request=request, InputBatch=InputBatch)


def expected_row(allowed: list[int] | None) -> torch.Tensor:
    row = torch.zeros(VOCAB, dtype=torch.bool)
    if allowed:
        row[:] = True
        row[allowed] = False
    return row


def wrong_rows(batch, allowed_of: dict[str, list[int] | None]) -> list[str]:
    """Requests of the batch whose mask row is not the one their own allowed_token_ids give."""
    mask = batch.allowed_token_ids_mask_cpu_tensor
    return [rid for i, rid in enumerate(batch.req_ids)
            if not torch.equal(mask[i], expected_row(allowed_of[rid]))]


@pytest.fixture
def patched():
    from vllm_tfm.vllm_plugin.allowed_token_masks import install_allowed_token_masks

    install_allowed_token_masks()
    yield


@pytest.fixture
def unpatched(vllm_batch, monkeypatch):
    """vLLM's own swap_states / add_request for this test, whether or not the plugin patched them."""
    from vllm_tfm.vllm_plugin import patching

    cls = vllm_batch.InputBatch
    for name in ("swap_states", "add_request"):
        if patching.is_patched(cls, name):
            monkeypatch.setattr(cls, name, patching.original(cls, name))
    yield


def soak_like_step(v, batch) -> dict[str, list[int] | None]:
    """Five running decodes, the last with allowed ids 5..9; the first two finish and two new requests
    take their slots (vLLM fills the lowest empty slots first), then vLLM's decode-first reorder
    (gpu_model_runner._may_reorder_batch) moves the running ones forward with swap_states."""
    from vllm.v1.attention.backends.utils import reorder_batch_to_split_decodes_and_prefills

    allowed_of: dict[str, list[int] | None] = {f"r{i}": None for i in range(5)}
    allowed_of["r4"] = [5, 6, 7, 8, 9]
    for rid in allowed_of:
        batch.add_request(v.request(rid, allowed_of[rid]))
    for rid in ("r0", "r1"):
        batch.remove_request(rid)
    for rid in ("n0", "n1"):
        allowed_of[rid] = None
        batch.add_request(v.request(rid, computed=0))  # new requests: prefills
    batch.condense()
    scheduled = {rid: (3 if rid.startswith("n") else 1) for rid in batch.req_ids}
    assert reorder_batch_to_split_decodes_and_prefills(batch, SimpleNamespace(num_scheduled_tokens=scheduled))
    assert batch.req_ids[-2:] in (["n0", "n1"], ["n1", "n0"])  # the reorder did move rows
    return allowed_of


def test_vllm_reorder_loses_a_mask_without_the_patch(vllm_batch, unpatched):
    batch = vllm_batch.make()
    allowed_of = soak_like_step(vllm_batch, batch)
    assert "r4" in wrong_rows(batch, allowed_of)  # r4 moved forward and now samples from the whole vocabulary
    assert not batch.allowed_token_ids_mask_cpu_tensor[batch.req_id_to_index["r4"]].any()


def test_reorder_keeps_every_mask_with_its_request(vllm_batch, patched):
    batch = vllm_batch.make()
    allowed_of = soak_like_step(vllm_batch, batch)
    assert wrong_rows(batch, allowed_of) == []
    assert batch.req_id_to_index["r4"] < 3  # it did move forward


def test_a_slot_emptied_by_condense_gives_no_old_mask_to_a_new_request(vllm_batch, patched):
    batch = vllm_batch.make()
    allowed_of = {"a": None, "b": None, "c": [3, 4]}
    for rid, allowed in allowed_of.items():
        batch.add_request(vllm_batch.request(rid, allowed))
    batch.remove_request("a")
    batch.condense()  # c moves from slot 2 to slot 0; vLLM leaves slot 2's row as it was
    allowed_of["d"] = None
    batch.add_request(vllm_batch.request("d"))  # takes slot 2
    assert batch.req_id_to_index["d"] == 2
    assert wrong_rows(batch, allowed_of) == []


def test_vllm_condense_then_add_leaks_a_mask_without_the_patch(vllm_batch, unpatched):
    batch = vllm_batch.make()
    for rid, allowed in {"a": None, "b": None, "c": [3, 4]}.items():
        batch.add_request(vllm_batch.request(rid, allowed))
    batch.remove_request("a")
    batch.condense()
    batch.add_request(vllm_batch.request("d"))
    assert torch.equal(batch.allowed_token_ids_mask_cpu_tensor[2], expected_row([3, 4]))  # d inherits c's mask


@pytest.mark.parametrize("seed", range(6))
def test_random_steps_of_removes_adds_condense_and_swaps_keep_masks(vllm_batch, patched, seed):
    """vLLM's step order (gpu_model_runner._update_states): removes, adds into the lowest empty slots,
    condense, the reorder's swaps, refresh_metadata; each request's row checked after every step,
    and the device copy the samplers read (sampling_metadata.allowed_token_ids_mask) with it."""
    rng = random.Random(seed)
    batch = vllm_batch.make(max_reqs=12)
    allowed_of: dict[str, list[int] | None] = {}
    live: list[str] = []
    for step in range(40):
        for _ in range(min(rng.randint(0, 3), len(live))):
            batch.remove_request(live.pop(rng.randrange(len(live))))
        for k in range(rng.randint(0, min(3, 12 - len(live)))):
            rid = f"q{step}.{k}"
            allowed_of[rid] = rng.sample(range(VOCAB), rng.randint(1, 8)) if rng.random() < 0.4 else None
            batch.add_request(vllm_batch.request(rid, allowed_of[rid]))
            live.append(rid)
        batch.condense()
        for _ in range(rng.randint(0, 3) if batch.num_reqs >= 2 else 0):
            batch.swap_states(*rng.sample(range(batch.num_reqs), 2))
        batch.refresh_metadata()
        if batch.allowed_token_ids_mask_cpu_tensor is None:
            continue
        assert wrong_rows(batch, allowed_of) == [], f"step {step}"
        device_mask = batch.sampling_metadata.allowed_token_ids_mask
        if any(allowed_of[rid] for rid in batch.req_ids):
            assert torch.equal(device_mask, batch.allowed_token_ids_mask_cpu_tensor[: batch.num_reqs])
        else:
            assert device_mask is None


def test_install_is_idempotent_and_registered():
    from vllm.v1.worker.gpu_input_batch import InputBatch

    from vllm_tfm.vllm_plugin import patching
    from vllm_tfm.vllm_plugin.allowed_token_masks import install_allowed_token_masks

    install_allowed_token_masks()
    swap = InputBatch.swap_states
    install_allowed_token_masks()
    assert InputBatch.swap_states is swap
    keys = patching.installed_patches()
    assert any(k.endswith("InputBatch.swap_states") for k in keys)
    assert any(k.endswith("InputBatch.add_request") for k in keys)
