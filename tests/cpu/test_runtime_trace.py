"""The request trace of the runtime (``VLLM_TFM_TRACE``, runtime/trace.py).

* The records of one step, from the real ``build_step_tree`` over a batch holding every case the
  trace must tell apart (a tree, a tree the scheduler cut, zeroed drafts, a new and a resumed
  prefill, a decode re-added after being left out whose offset was restored), against values
  written here by hand; then the sampled tokens of the step.
* The runner hooks with the switch on, over three steps of a real vLLM ``InputBatch`` (one request
  left out of step 2 and re-added in step 3): the JSON lines in the file.
* The file is bounded; the switch's settings and their errors.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from _trees import proposal_store
from vllm_tfm.vllm_plugin.runtime.accepted_offsets import OffsetPlan
from vllm_tfm.vllm_plugin.runtime.inputs import build_step_tree
from vllm_tfm.vllm_plugin.runtime.state import ProposalStore
from vllm_tfm.vllm_plugin.runtime.trace import Tracer, finish_records, step_records

TREE = [-1, 0, 0, 1, 1, 2]  # 5 drafts, depth 2


def test_step_records_tell_every_case_apart():
    store = proposal_store({"tree": ([11, 12, 13, 14, 15], TREE), "cut": ([21, 22, 23, 24, 25], TREE),
                    "zeroed": ([31, 32, 33, 34, 35], TREE), "back": ([41, 42, 43, 44, 45], TREE)})
    ids = ["tree", "cut", "zeroed", "fresh", "resumed", "back"]
    nst = np.array([6, 3, 6, 40, 90, 6])
    spec = {"tree": [11, 12, 13, 14, 15], "cut": [21, 22], "zeroed": [0] * 5, "back": [41, 42, 43, 44, 45]}
    step = build_step_tree(ids, nst, spec, store, allow_trees=True)
    plan = OffsetPlan(restore_rows=[5], restore_values=[4])
    recs = step_records(
        7, ids, step, native_sampler=False, new={"fresh"}, resumed={"resumed"}, last={"tree", "cut", "zeroed"},
        num_computed=np.array([100, 50, 70, 0, 0, 30]), num_output=[12, 5, 9, 0, 33, 4],
        temperature=np.array([0.0, 0.8, 0.0, 1.3, 0.0, 0.0]), accepted_read=np.array([3, 1, 2, 1, 1, 1]),
        accepted_used=np.array([3, 1, 2, 1, 1, 4]), plan=plan, t=1.23456,
    )  # fmt: skip
    base = {"s": 7, "ts": 1.235, "path": "tree"}
    assert recs == [
        {**base, "r": "tree", "row": 0, "n": 6, "d": 5, "spec": 1, "tree": 1, "dep": 2, "lk": "full", "prop": 5,
         "a0": 3, "a": 3, "nc": 100, "no": 12, "t": 0.0},
        # the scheduler cut the tree to its first two nodes [root, 0, 0]: still a tree (two children of the root)
        {**base, "r": "cut", "row": 1, "n": 3, "d": 2, "spec": 1, "tree": 1, "dep": 1, "lk": "cut", "prop": 5,
         "a0": 1, "a": 1, "nc": 50, "no": 5, "t": 0.8},
        {**base, "r": "zeroed", "row": 2, "n": 6, "d": 5, "spec": 1, "lk": "miss", "a0": 2, "a": 2, "nc": 70, "no": 9,
         "t": 0.0},
        {**base, "r": "fresh", "row": 3, "n": 40, "d": 0, "spec": 0, "new": 1, "a0": 1, "a": 1, "nc": 0, "no": 0, "t": 1.3},
        {**base, "r": "resumed", "row": 4, "n": 90, "d": 0, "spec": 0, "res": 1, "a0": 1, "a": 1, "nc": 0, "no": 33,
         "t": 0.0},
        {**base, "r": "back", "row": 5, "n": 6, "d": 5, "spec": 1, "tree": 1, "dep": 2, "lk": "full", "prop": 5,
         "back": 1, "a0": 1, "a": 4, "fix": "restore", "nc": 30, "no": 4, "t": 0.0},
    ]  # fmt: skip
    sampled = np.full((6, 6), -1)
    sampled[0, :3] = [12, 14, 99]  # two drafts accepted, then the bonus
    sampled[1, :1] = [7]
    sampled[2, :1] = [5]
    sampled[3, :1] = [8]  # a partial prefill: vLLM discards its token
    sampled[4, :1] = [6]
    sampled[5, :2] = [42, 1]
    finish_records(recs, sampled, discard=np.array([False, False, False, True, False, False]))
    assert [(r["acc"], r["out"], r.get("disc")) for r in recs] == [
        (2, [12, 14, 99], None), (0, [7], None), (0, [5], None), (0, [8], 1), (0, [6], None), (1, [42, 1], None)]


def test_paths_of_steps_without_trees():
    store = proposal_store({"a": ([1, 2], [-1, 0, 1])})  # a chain proposal
    step = build_step_tree(["a"], np.array([3]), {"a": [1, 2]}, store, allow_trees=True)
    kw = {"new": set(), "resumed": set(), "last": None, "num_computed": np.array([9]), "num_output": [3], "temperature": np.array([0.0])}
    assert step_records(0, ["a"], step, native_sampler=False, **kw)[0]["path"] == "chains"
    step = build_step_tree(["a"], np.array([3]), {"a": [1, 2]}, store, allow_trees=False)
    rec = step_records(0, ["a"], step, native_sampler=True, **kw)[0]
    assert rec["path"] == "sampler" and rec["lk"] == "off" and "a0" not in rec  # no GDN offsets given
    step = build_step_tree(["a"], np.array([5]), {}, store, allow_trees=True)
    assert step_records(0, ["a"], step, native_sampler=False, **kw)[0]["path"] == "plain"
    with pytest.raises(ValueError, match="2 request ids for a step of 1 requests"):
        step_records(0, ["a", "b"], step, native_sampler=False, **kw)


@pytest.fixture()
def no_pinning(monkeypatch):
    pytest.importorskip("vllm")
    import vllm.utils.torch_utils as tu
    import vllm.v1.worker.gpu_input_batch as gib

    monkeypatch.setattr(tu, "PIN_MEMORY", False)  # vLLM pins host buffers when CUDA is expected
    monkeypatch.setattr(gib, "PIN_MEMORY", False)


@pytest.fixture()
def runtime_state():
    from vllm_tfm.vllm_plugin.runtime.state import STATE

    saved = (STATE.step, STATE.store, STATE.metrics, STATE.offsets, STATE.trace, STATE.replay)
    yield STATE
    if STATE.trace is not None and STATE.trace is not saved[4]:
        STATE.trace.close()
    STATE.step, STATE.store, STATE.metrics, STATE.offsets, STATE.trace, STATE.replay = saved


def test_runner_hooks_write_the_records_of_each_step(tmp_path, no_pinning, runtime_state):
    """Three steps through the ``_prepare_inputs`` and ``_update_states_after_model_execute``
    wrappers: a and b decode; b is left out of step 2; b comes back in step 3 with vLLM's reset
    ``num_accepted_tokens`` (1), which the offsets fix-up restores to 3 (b accepted 2 drafts in step 1)."""
    from vllm import SamplingParams
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    from vllm_tfm.vllm_plugin.runtime.hooks import (
        _wrap_prepare_inputs,
        _wrap_update_states_after,
    )
    from vllm_tfm.vllm_plugin.runtime.metrics import Metrics

    state = runtime_state
    state.store, state.metrics, state.step, state.replay = ProposalStore(), Metrics(max_depth=3), None, None
    state.offsets = type(state.offsets)()
    state.trace = Tracer(tmp_path, 1 << 20, {"budget": 3})
    batch = InputBatch(max_num_reqs=4, max_model_len=64, max_num_batched_tokens=64, device=torch.device("cpu"),
                       vocab_size=32, block_sizes=[16], kernel_block_sizes=[16], max_num_blocks_per_req=[4],
                       logitsprocs=LogitsProcessors(), num_spec_tokens=3)
    reqs = {
        "a": CachedRequestState(req_id="a", prompt_token_ids=[1, 2, 3], mm_features=[], generator=None, block_ids=([0],),
                                sampling_params=SamplingParams(temperature=0.0), num_computed_tokens=3,
                                output_token_ids=[5]),
        "b": CachedRequestState(req_id="b", prompt_token_ids=[1, 2], mm_features=[], generator=torch.Generator(),
                                block_ids=([1],), sampling_params=SamplingParams(temperature=0.8, seed=3),
                                num_computed_tokens=2, output_token_ids=[6]),
    }  # fmt: skip
    for r in reqs.values():
        batch.add_request(r)
    batch.refresh_metadata()
    acc = SimpleNamespace(np=np.ones(4, dtype=np.int32), gpu=torch.ones(4, dtype=torch.int32))
    runner = SimpleNamespace(_tfm_enabled=True, model_config=SimpleNamespace(is_hybrid=True), input_batch=batch,
                             num_accepted_tokens=acc, requests=reqs, uses_mrope=False, device="cpu",
                             positions=torch.zeros(64, dtype=torch.long))

    def vllm_update_after(runner_, sampled, so):  # what vLLM's original does for non-align hybrids
        acc.gpu[: sampled.shape[0]] = (sampled != -1).sum(dim=1).to(torch.int32)
        batch.num_accepted_tokens_cpu[: sampled.shape[0]] = acc.gpu[: sampled.shape[0]].numpy()

    prepare = _wrap_prepare_inputs(lambda *a: None)
    update_after = _wrap_update_states_after(vllm_update_after)

    def run_step(spec: dict[str, list[int]], sampled: list[list[int]]) -> None:
        n = batch.num_reqs
        acc.np[:n] = batch.num_accepted_tokens_cpu[:n]  # vLLM's _prepare_inputs sync (gpu_model_runner.py:2109)
        acc.gpu[:n] = torch.from_numpy(acc.np[:n])
        so = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()),
                             scheduled_spec_decode_tokens=spec)
        ids = list(batch.req_ids[:n])
        state.store.put(ids, torch.tensor([spec[i] for i in ids]), torch.tensor([[-1, 0, 1, 2]] * n))  # chains
        prepare(runner, so, np.array([len(spec[i]) + 1 for i in ids]))
        update_after(runner, torch.tensor(sampled), so)
        for rid, row in zip(ids, sampled):
            reqs[rid].output_token_ids.extend(t for t in row if t != -1)

    run_step({"a": [7, 8, 9], "b": [7, 8, 9]}, [[7, 3, -1, -1], [7, 8, 4, -1]])
    batch.remove_request("b")  # left out of step 2 (gpu_model_runner.py:1229)
    batch.condense()
    run_step({"a": [1, 2, 3]}, [[9, -1, -1, -1]])
    batch.add_request(reqs["b"])  # re-added: vLLM sets its num_accepted_tokens to 1 (gpu_input_batch.py:469)
    batch.refresh_metadata()
    run_step({"a": [4, 4, 4], "b": [5, 5, 5]}, [[4, 4, 4, 2], [1, -1, -1, -1]])
    state.trace.flush()
    lines = [json.loads(x) for x in state.trace.path.read_text().splitlines()]
    head, recs = lines[0], lines[1:]
    assert head["trace"] == "vllm-tfm" and head["version"] == 1 and head["budget"] == 3
    got = [(r["s"], r["r"], r["row"], r["n"], r["d"], r["path"], r.get("back"), r["a0"], r["a"], r.get("fix"), r["no"],
            r["t"], r["acc"], r["out"]) for r in recs]  # fmt: skip
    assert got == [
        (0, "a", 0, 4, 3, "chains", None, 1, 1, None, 1, 0.0, 1, [7, 3]),
        (0, "b", 1, 4, 3, "chains", None, 1, 1, None, 1, 0.8, 2, [7, 8, 4]),
        (1, "a", 0, 4, 3, "chains", None, 2, 2, None, 3, 0.0, 0, [9]),
        (2, "a", 0, 4, 3, "chains", None, 1, 1, None, 4, 0.0, 3, [4, 4, 4, 2]),
        (2, "b", 1, 4, 3, "chains", 1, 1, 3, "restore", 4, 0.8, 0, [1]),
    ]  # fmt: skip
    assert all(r["spec"] == 1 and r["lk"] == "full" and "tree" not in r for r in recs)


def test_the_trace_file_is_bounded(tmp_path):
    tracer = Tracer(tmp_path, 2000)
    step = build_step_tree(["x"], np.array([1]), {}, ProposalStore(), allow_trees=True)
    batch = SimpleNamespace(num_reqs=1, req_ids=["x"], num_computed_tokens_cpu=np.array([5]), temperature_cpu=np.zeros(1))
    runner = SimpleNamespace(input_batch=batch, requests={}, num_accepted_tokens=None)
    so = SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=set()))
    for _ in range(100):
        tracer.begin(runner, so, step, native_sampler=False)
        tracer.end(runner, torch.tensor([[3]]))
    tracer.close()
    text = tracer.path.read_text()
    lines = text.splitlines()
    assert json.loads(lines[-1])["truncated"] is True
    assert len(text) - len(lines[-1]) - 1 <= 2000  # the records before the marker fit the bound
    assert 5 < len(lines) < 40 and tracer.stopped
    assert [json.loads(x)["s"] for x in lines[1:-1]] == list(range(len(lines) - 2))  # whole steps, in order


def test_trace_settings(monkeypatch, tmp_path):
    from vllm_tfm.vllm_plugin.runtime.settings import trace_settings

    monkeypatch.delenv("VLLM_TFM_TRACE", raising=False)
    monkeypatch.delenv("VLLM_TFM_TRACE_MAX_MB", raising=False)
    assert trace_settings() is None and Tracer.from_settings() is None
    monkeypatch.setenv("VLLM_TFM_TRACE", str(tmp_path / "t"))
    assert trace_settings() == (str(tmp_path / "t"), 256 << 20)
    monkeypatch.setenv("VLLM_TFM_TRACE_MAX_MB", "0.5")
    assert trace_settings() == (str(tmp_path / "t"), 1 << 19)
    tracer = Tracer.from_settings({"budget": 4})
    assert tracer is not None and tracer.path.parent == tmp_path / "t" and tracer.max_bytes == 1 << 19
    tracer.close()
    monkeypatch.setenv("VLLM_TFM_TRACE_MAX_MB", "lots")
    with pytest.raises(ValueError, match="VLLM_TFM_TRACE_MAX_MB must be a number of MiB, got 'lots'"):
        trace_settings()
    monkeypatch.setenv("VLLM_TFM_TRACE_MAX_MB", "-1")
    with pytest.raises(ValueError, match="must be positive"):
        trace_settings()
