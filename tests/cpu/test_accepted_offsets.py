"""GDN state offsets across vLLM's persistent-batch removals (runtime/accepted_offsets.py).

The vLLM behaviour the fix exists for is checked on vLLM's own ``InputBatch``: a request removed
from the batch and added back has ``num_accepted_tokens`` 1 again, although its committed state
still sits at slot ``a - 1``. Then the planning rules, the state move (against an explicit loop),
and the record keeping over a sequence of steps.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_tfm.vllm_plugin.runtime.accepted_offsets import AcceptedOffsets, move_states_to_slot0, plan_offsets


def test_vllm_input_batch_resets_num_accepted_tokens_when_a_request_is_added_back(monkeypatch):
    pytest.importorskip("vllm")
    import vllm.utils.torch_utils as tu
    import vllm.v1.worker.gpu_input_batch as gib

    monkeypatch.setattr(tu, "PIN_MEMORY", False)  # vLLM pins host buffers when CUDA is expected
    monkeypatch.setattr(gib, "PIN_MEMORY", False)
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    cpu = torch.device("cpu")
    batch = InputBatch(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=64, device=cpu, vocab_size=32,
                       block_sizes=[16], kernel_block_sizes=[16], max_num_blocks_per_req=[4],
                       logitsprocs=LogitsProcessors(), num_spec_tokens=3)
    states = {}
    for rid in ("a", "b"):
        states[rid] = CachedRequestState(req_id=rid, prompt_token_ids=[1, 2, 3], mm_features=[],
                                         sampling_params=SamplingParams(temperature=0.0), generator=None,
                                         block_ids=([0],), num_computed_tokens=3, output_token_ids=[])
        batch.add_request(states[rid])
    batch.num_accepted_tokens_cpu[batch.req_id_to_index["b"]] = 4  # b accepted 3 drafts last step
    batch.remove_request("b")  # not scheduled this step (gpu_model_runner.py:1229)
    batch.condense()
    batch.add_request(states["b"])  # scheduled again
    assert batch.num_accepted_tokens_cpu[batch.req_id_to_index["b"]] == 1  # vLLM forgot the 4


def test_plan_restores_re_added_spec_rows_and_moves_rows_that_read_slot_zero():
    ids = ["cont_spec", "readded_spec", "readded_plain", "cont_plain", "new", "chunk", "readded_same"]
    records = {"readded_spec": 5, "readded_plain": 3, "chunk": 1, "readded_same": 1, "gone": 7}
    current = np.array([4, 1, 1, 3, 1, 1, 1])
    continuing = np.array([True, False, False, True, False, False, False])
    spec = np.array([True, True, False, False, False, False, True])
    decode = spec | np.array([False, False, True, True, False, False, False])
    plan = plan_offsets(ids, current, continuing, spec, decode, records)
    assert plan.restore_rows == [1] and plan.restore_values == [5]  # vLLM says 1, the state is at slot 4
    assert plan.move_rows == [2, 3] and plan.move_from == [3, 3]  # non-spec rows read slot 0
    assert records == {"gone": 7}  # used records are consumed; others stay
    assert not plan_offsets(["x"], np.array([1]), np.array([False]), np.array([True]), np.array([True]), {})


def test_move_states_to_slot0_matches_an_explicit_copy_and_touches_nothing_else():
    g = torch.Generator().manual_seed(0)
    n_slots, conv_dim, width, spec = 12, 6, 4, 5
    conv = [torch.randn(n_slots, conv_dim, width - 1 + spec, generator=g) for _ in range(2)]
    ssm = [torch.randn(n_slots, 3, 4, 4, generator=g) for _ in range(2)]
    slots = torch.tensor([[2, 7, 9, 11, 3, 5], [0, 1, 4, 6, 8, 10]])
    accepted = torch.tensor([4, 6])
    before_ssm = ssm[0][2].clone()
    want_conv = [c.clone() for c in conv]
    want_ssm = [s.clone() for s in ssm]
    for c, s in zip(want_conv, want_ssm):
        for r in range(2):
            a = int(accepted[r])
            s[slots[r, 0]] = s[slots[r, a - 1]].clone()
            c[slots[r, 0], :, : width - 1] = c[slots[r, 0], :, a - 1 : a - 1 + width - 1].clone()
    move_states_to_slot0(conv, ssm, slots, accepted, width)
    for got, want in zip(conv + ssm, want_conv + want_ssm):
        assert torch.equal(got, want)
    assert not torch.equal(ssm[0][2], before_ssm)  # not vacuous: request 0's slot 0 (slot 2) received slot 11
    move_states_to_slot0(conv, ssm, slots[:, :1], torch.tensor([1, 1]), width)  # a = 1: a no-op
    for got, want in zip(conv + ssm, want_conv + want_ssm):
        assert torch.equal(got, want)


def test_offsets_remember_requests_that_leave_and_forget_resumed_and_finished_ones():
    off = AcceptedOffsets()
    live = {"a", "b", "c", "d"}
    assert off.begin_step(["a", "b", "c", "d"], set(), live).tolist() == [False] * 4
    off.end_step(["a", "b", "c", "d"], torch.tensor([3, 1, 5, 4, 9, 9]))  # rows past the batch are ignored
    # step 2: b and c not scheduled, d preempted
    assert off.begin_step(["a"], set(), live).tolist() == [True]
    assert off.records == {"b": 1, "c": 5, "d": 4}
    off.end_step(["a"], torch.tensor([2]))
    # step 3: c back (re-added), d resumed (prefill from scratch), b finished
    live = {"a", "c", "d"}
    cont = off.begin_step(["a", "c", "d"], {"d"}, live)
    assert cont.tolist() == [True, False, False]
    assert off.records == {"c": 5}
    plan = plan_offsets(["a", "c", "d"], np.array([2, 1, 1]), cont, np.array([True, True, False]),
                        np.array([True, True, False]), off.records)
    assert plan.restore_rows == [1] and plan.restore_values == [5] and not plan.move_rows


def test_runner_hooks_restore_and_move_on_a_fake_hybrid_runner(monkeypatch):
    """The wiring in hooks.py: end of step records, the next step's _prepare_inputs restores vLLM's
    buffers (numpy, InputBatch, device) and moves the state of a row that reads slot 0."""
    from types import SimpleNamespace

    from _fake_runner import fake_hybrid_runner

    import vllm_tfm.vllm_plugin.runtime.hooks as hooks
    from vllm_tfm.vllm_plugin.runtime.metrics import Metrics
    from vllm_tfm.vllm_plugin.runtime.state import STATE

    runner, conv, ssm, width = fake_hybrid_runner(monkeypatch)
    acc, batch = runner.num_accepted_tokens, runner.input_batch
    STATE.metrics, STATE.offsets = Metrics(max_depth=3), type(STATE.offsets)()
    so = SimpleNamespace(scheduled_cached_reqs=SimpleNamespace(resumed_req_ids={"a"}), scheduled_spec_decode_tokens={})
    hooks.fix_accepted_offsets(runner, so, np.array([4, 4, 4]))  # step 1: nothing known, nothing to do
    assert STATE.metrics.snapshot()["resumed_requests"] == {"a": 1}  # counted per request id
    so.scheduled_cached_reqs.resumed_req_ids = set()
    STATE.offsets.end_step(["a", "b", "c"], torch.tensor([3, 2, 4, 1], dtype=torch.int32))
    # step 2: only a runs (b and c were left out); then b comes back with drafts, c without
    batch.num_reqs, batch.req_ids = 1, ["a"]
    hooks.fix_accepted_offsets(runner, so, np.array([4]))
    STATE.offsets.end_step(["a"], torch.tensor([2], dtype=torch.int32))
    batch.num_reqs, batch.req_ids = 3, ["a", "b", "c"]
    acc.np[:] = [2, 1, 1, 1]  # what vLLM's _prepare_inputs synced: b and c were re-added with 1
    acc.gpu[:] = torch.tensor([2, 1, 1, 1])
    batch.num_accepted_tokens_cpu[:] = [2, 1, 1, 1]
    so.scheduled_spec_decode_tokens = {"a": [7, 8, 9], "b": [7, 8, 9]}
    want_ssm, want_conv = ssm.clone(), conv.clone()
    want_ssm[8] = ssm[11]  # c: a = 4 -> slot 8 + 3
    want_conv[8, :, : width - 1] = conv[8, :, 3 : 3 + width - 1]
    hooks.fix_accepted_offsets(runner, so, np.array([4, 4, 1]))
    assert acc.np[:3].tolist() == [2, 2, 1] and batch.num_accepted_tokens_cpu[:3].tolist() == [2, 2, 1]
    assert acc.gpu[:3].tolist() == [2, 2, 1]
    assert torch.equal(ssm, want_ssm) and torch.equal(conv, want_conv)
    snap = STATE.metrics.snapshot()
    assert snap["accepted_restored"] == 1 and snap["states_moved"] == 1
