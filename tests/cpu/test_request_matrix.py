"""docs/guarantees.md's request-parameter matrix, row by row, through the code that decides it.

Each row of the table states an outcome for one OpenAI request field; this test builds that
request the way ``vllm serve`` does (``CompletionRequest(...).to_sampling_params``, or vLLM's beam
search / ``ParentRequest`` fan-out), then takes the decisions the server takes:

1. ``SamplingParams.verify`` with a tfm speculative config (vLLM's checks + the plugin's guard):
   a ValueError is the HTTP 400, and its message must be the one in the table;
2. otherwise the request joins a real vLLM ``InputBatch`` (CPU) next to a plain greedy request,
   both with tree proposals in the ``ProposalStore``; the runtime's ``_prepare_inputs`` wrapper
   decides whether the step verifies trees, and ``TFMTreeSampler`` either verifies the trees
   itself (**trees**) or hands the step to vLLM's rejection sampler (**chain**).

The set of rows in the document and the set of cases here must be equal, so a row cannot be
added to the document without a test, nor a case without a documented row.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from _vllm_plugin_env import VOCAB, tiny_tfm_configs, vllm_cpu_session

DOC = Path(__file__).resolve().parents[2] / "docs" / "guarantees.md"
BUDGET = 4
TREE_PARENTS = [-1, 0, 0, 1, 2]  # a non-chain tree of 4 drafts (topological order)

# request field (the table's first cell) -> the JSON fields of an OpenAI completion request
CASES: dict[str, dict[str, Any]] = {
    "temperature=0": {"temperature": 0.0},
    "temperature>0": {"temperature": 0.8},
    "top_k": {"temperature": 0.8, "top_k": 5},
    "top_p": {"temperature": 0.8, "top_p": 0.9},
    "seed": {"temperature": 0.8, "seed": 7},
    "stop": {"temperature": 0.0, "stop": ["xy"], "stop_token_ids": [3]},
    "n>1": {"temperature": 0.8, "n": 3},
    "logprobs": {"temperature": 0.0, "logprobs": 2},
    "allowed_token_ids": {"temperature": 0.0, "allowed_token_ids": [5, 6, 7]},
    "min_tokens": {"temperature": 0.0, "min_tokens": 4},
    "use_beam_search": {"temperature": 0.0, "use_beam_search": True, "n": 2},
    "min_p": {"temperature": 0.8, "min_p": 0.1},
    "logit_bias": {"logit_bias": {"5": 2.0}},
    "presence_penalty": {"presence_penalty": 0.5},
    "frequency_penalty": {"frequency_penalty": 0.5},
    "repetition_penalty": {"repetition_penalty": 1.2},
    "bad_words": {"bad_words": ["ab"]},
    "prompt_logprobs": {"prompt_logprobs": 1},
    "structured_outputs": {"structured_outputs": {"choice": ["yes", "no"]}},
    "response_format": {"response_format": {"type": "json_object"}},
}


def doc_rows() -> dict[str, tuple[str, str | None]]:
    """{field: (outcome, 400 message or None)} from the 'Request parameters' table."""
    text = DOC.read_text()
    section = text.split("## Request parameters", 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in section.splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        field = re.match(r"`([^`]+)`", cells[0]).group(1)
        outcome = re.match(r"\*\*([^*]+)\*\*", cells[1]).group(1)
        message = re.search(r"`([^`]+)`", cells[1]) if outcome == "400" else None
        assert field not in rows, f"duplicate row {field}"
        rows[field] = (outcome, message.group(1) if message else None)
    return rows


# ----------------------------------------------------------------------------------- vLLM on CPU
@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("request_matrix")
    with vllm_cpu_session(root / "vllm-cache"):
        mc, _, tfm = tiny_tfm_configs(root, BUDGET)
        assert tfm.method == "tfm"
        yield SimpleNamespace(model_config=mc, tfm=tfm)


@pytest.fixture()
def cpu_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM pins host buffers when CUDA is expected; there is none here."""
    import vllm.utils.torch_utils as tu
    import vllm.v1.worker.gpu_input_batch as gib

    monkeypatch.setattr(tu, "PIN_MEMORY", False)
    monkeypatch.setattr(gib, "PIN_MEMORY", False)


@pytest.fixture()
def runtime_state():
    """The runtime's process-wide state, restored after the test."""
    from vllm_tfm.vllm_plugin.runtime.state import STATE

    saved = (STATE.step, STATE.store, STATE.metrics)
    yield STATE
    STATE.step, STATE.store, STATE.metrics = saved


def sampling_params(fields: dict[str, Any]):
    """What vllm serve's completion endpoint turns the JSON fields into (plus the input processor's EOS)."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    req = CompletionRequest(model="m", prompt=[5, 6, 7], max_tokens=16, **fields)
    params = req.to_sampling_params(16, {})
    return params


def input_batch(params_list: list[Any], generated: int = 0):
    """A real vLLM InputBatch on CPU holding one request per SamplingParams (ids r0, r1, ...), each
    with ``generated`` output tokens so far."""
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import MinTokensLogitsProcessor
    from vllm.v1.worker.gpu_input_batch import CachedRequestState, InputBatch

    cpu = torch.device("cpu")
    # with a speculative config vLLM builds only the min-tokens processor (logits_processor/__init__.py:200-209)
    batch = InputBatch(max_num_reqs=8, max_model_len=256, max_num_batched_tokens=256, device=cpu, vocab_size=VOCAB,
                       block_sizes=[16], kernel_block_sizes=[16], max_num_blocks_per_req=[16],
                       logitsprocs=LogitsProcessors([MinTokensLogitsProcessor(None, cpu, False)]), num_spec_tokens=BUDGET)
    for i, p in enumerate(params_list):
        p.update_from_generation_config({}, 1)  # the input processor adds the EOS id (input_processor.py:323)
        gen = torch.Generator().manual_seed(p.seed) if p.seed is not None else None
        batch.add_request(CachedRequestState(req_id=f"r{i}", prompt_token_ids=[5, 6, 7], mm_features=[], sampling_params=p,
                                             generator=gen, block_ids=([0],), num_computed_tokens=3 + generated,
                                             output_token_ids=[9] * generated))
    batch.refresh_metadata()
    return batch


def step_decision(batch, state) -> tuple[bool, bool]:
    """(tree-active?, did TFMTreeSampler hand the step to vLLM's sampler?) for one decode step of ``batch``."""
    from vllm_tfm.vllm_plugin.runtime.hooks import _wrap_prepare_inputs
    from vllm_tfm.vllm_plugin.runtime.metrics import Metrics
    from vllm_tfm.vllm_plugin.runtime.sampler import TFMTreeSampler
    from vllm_tfm.vllm_plugin.runtime.state import ProposalStore

    n = batch.num_reqs
    ids = list(batch.req_ids[:n])
    gen = torch.Generator().manual_seed(0)
    drafts = torch.randint(3, VOCAB - 1, (n, BUDGET), generator=gen)
    state.store, state.metrics, state.step = ProposalStore(), Metrics(max_depth=BUDGET), None
    state.store.put(ids, drafts, torch.tensor([TREE_PARENTS] * n))
    runner = SimpleNamespace(_tfm_enabled=True, input_batch=batch, uses_mrope=False, device="cpu",
                             model_config=SimpleNamespace(is_hybrid=False),  # GDN offsets: tested elsewhere
                             positions=torch.arange(3, 3 + n * (BUDGET + 1)))
    scheduled = SimpleNamespace(scheduled_spec_decode_tokens={rid: drafts[i].tolist() for i, rid in enumerate(ids)})
    _wrap_prepare_inputs(lambda *a: None)(runner, scheduled, np.full(n, BUDGET + 1))
    tree_active = state.step.tree_active
    inner_calls = []
    sampler = TFMTreeSampler(lambda *a: inner_calls.append(a) or "vllm", runner)
    md = SimpleNamespace(num_draft_tokens=[BUDGET] * n, draft_token_ids=drafts.flatten(), max_spec_len=BUDGET)
    logits = torch.randn(n * (BUDGET + 1), VOCAB, generator=gen)
    out = sampler(md, None, logits, batch.sampling_metadata)
    if inner_calls:
        assert out == "vllm"
    else:
        assert out.sampled_token_ids.shape == (n, BUDGET + 1)
    return tree_active, bool(inner_calls)


def decide(params, env, state) -> tuple[str, str | None]:
    """The server's decision for one request: ('400', message) / ('trees', None) / ('chain', None)."""
    try:
        params.verify(env.model_config, env.tfm, None, None)
    except ValueError as e:
        return "400", str(e)
    from vllm import SamplingParams

    tree_active, delegated = step_decision(input_batch([SamplingParams(temperature=0.0), params]), state)
    assert tree_active != delegated  # trees are verified by tfm, chains by vLLM, never both
    return ("trees" if tree_active else "chain"), None


def beam_search_step_params(fields: dict[str, Any]) -> list[Any]:
    """The SamplingParams vLLM's online beam search sends to the engine (it is run with a recording engine)."""
    from vllm.entrypoints.generate.beam_search.online import BeamSearchOnlineMixin
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.logprobs import Logprob

    beam = CompletionRequest(model="m", prompt=[5, 6, 7], max_tokens=3, **fields).to_beam_search_params(3, {})
    sent = []

    class Engine:
        async def generate(self, prompt, params, request_id, **kw):
            sent.append(params)
            top = {t: Logprob(logprob=-0.1 * (t - 9)) for t in range(10, 10 + params.logprobs)}
            yield SimpleNamespace(outputs=[SimpleNamespace(finish_reason="length", logprobs=[top])])

    class Server(BeamSearchOnlineMixin):
        engine_client = Engine()
        renderer = SimpleNamespace(get_tokenizer=lambda: SimpleNamespace(eos_token_id=1, decode=lambda ids: "x"))

    async def run() -> list[Any]:
        prompt = {"type": "token", "prompt_token_ids": [5, 6, 7]}
        return [o async for o in Server().beam_search(prompt, "req", beam)]

    outputs = asyncio.run(run())
    assert len(outputs[-1].outputs) == 2  # the mixin really ran: two beams of three tokens
    return sent


# ----------------------------------------------------------------------------------- the tests
def test_every_documented_row_has_a_case_and_back() -> None:
    assert set(doc_rows()) == set(CASES)


@pytest.mark.parametrize("field", sorted(CASES))
def test_row_decision(field: str, env: Any, cpu_batches: None, runtime_state: Any) -> None:
    outcome, message = doc_rows()[field]
    fields = CASES[field]
    if field == "use_beam_search":
        steps = beam_search_step_params(fields)
        assert len(steps) == 1 + 2 + 2 and all(p.max_tokens == 1 and p.logprobs == 4 for p in steps)  # 3 steps, width 2
        # one-token requests: the only token comes from the prefill, no draft is ever verified; and a
        # batch holding such a request verifies chains through vLLM's sampler
        assert decide(steps[0], env, runtime_state) == ("chain", None)
        assert outcome == "no speculation"
        return
    params = sampling_params(fields)
    if field == "n>1":
        from vllm.v1.engine.parallel_sampling import ParentRequest

        assert decide(params, env, runtime_state) == ("trees", None)  # the guard sees the parent (n = 3)
        parent = ParentRequest(SimpleNamespace(external_req_id="x", params=params, request_id="req"))
        children = [parent.get_child_info(i) for i in range(3)]
        assert len({rid for rid, _ in children}) == 3  # separate request ids: separate trees
        for _, child in children:
            assert child.n == 1 and decide(child, env, runtime_state) == ("trees", None)
        got = ("trees", None)
    else:
        got = decide(params, env, runtime_state)
    assert got == (outcome, message), f"{field}: the code decides {got}, docs/guarantees.md says {(outcome, message)}"


def test_tree_rows_reach_the_tree_sampler_with_their_parameters(env: Any, cpu_batches: None, runtime_state: Any) -> None:
    """temperature / top-k / top-p / seed arrive at tree acceptance as vLLM stored them."""
    from vllm_tfm.verify.logits_processing import TreeSamplingParams

    reqs = [sampling_params(CASES[k]) for k in ("temperature=0", "top_k", "top_p", "seed")]
    batch = input_batch(reqs)
    md = batch.sampling_metadata
    p = TreeSamplingParams.from_host(batch.temperature_cpu[:4], batch.top_k_cpu[:4], batch.top_p_cpu[:4], None, "cpu")
    assert p.temperature.tolist() == pytest.approx([0.0, 0.8, 0.8, 0.8])
    assert p.top_k.tolist() == [VOCAB, 5, VOCAB, VOCAB]  # vLLM stores "off" as the vocabulary size
    assert p.top_p.tolist() == pytest.approx([1.0, 1.0, 0.9, 1.0])
    assert set(md.generators) == {3}  # only the seeded request has its own generator
    assert step_decision(batch, runtime_state) == (True, False)


def test_a_chain_row_turns_the_whole_batch_to_chains_for_that_step(env: Any, cpu_batches: None, runtime_state: Any) -> None:
    from vllm import SamplingParams

    greedy = [SamplingParams(temperature=0.0) for _ in range(3)]
    assert step_decision(input_batch(greedy), runtime_state) == (True, False)
    step = runtime_state.step
    assert step.is_tree.tolist() == [True, True, True]
    mixed = input_batch([SamplingParams(temperature=0.0) for _ in range(2)] + [sampling_params(CASES["logprobs"])])
    assert step_decision(mixed, runtime_state) == (False, True)
    assert runtime_state.step.is_tree.tolist() == [False, False, False]  # every request's tree read as a chain


def test_min_tokens_verifies_trees_again_once_reached(env: Any, cpu_batches: None, runtime_state: Any) -> None:
    from vllm import SamplingParams

    below = input_batch([SamplingParams(temperature=0.0), sampling_params(CASES["min_tokens"])], generated=3)
    assert step_decision(below, runtime_state) == (False, True)
    reached = input_batch([SamplingParams(temperature=0.0), sampling_params(CASES["min_tokens"])], generated=4)
    assert step_decision(reached, runtime_state) == (True, False)
