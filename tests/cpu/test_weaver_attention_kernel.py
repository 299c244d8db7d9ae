"""The Weaver scorer's node-attention kernel (``cuda/weaver_attention.cu`` behind
``vllm_tfm.kernels.weaver_attention``) on the CPU through the CUDA emulation (``cuda/host_emu``):
against a float64 evaluation of the same stored values and against the torch reference
(``node_attention_reference``) on fresh random problems in float32 / bfloat16 / float16: random
forests of earlier nodes, roots (parent -1), a deep chain, n = 1, invalid rows with garbage ids,
out-of-range depths (clamped), more keys than a warp's lanes, head rows of one 16-byte vector; the
K/V and key-mask writes; through ``BatchedWeaverTreeScorer`` (one launch per layer, the torch path's
log-probabilities to float32 rounding), launched with programmatic dependent launch unless switched off, with the
candidate scores; and which inputs the kernel takes."""

from __future__ import annotations

import random
from pathlib import Path
from unittest import mock

import pytest
import torch
from _attention_problem import check_results, problem, run_on_copies, run_reference
from _emulation import emulated, emulation_build_dir
from _tiny_scorers import tiny_scorer_pair

from vllm_tfm.kernels import candidate_scores as kc
from vllm_tfm.kernels import weaver_attention as ka
from vllm_tfm.kernels import weaver_linear as kl

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return emulation_build_dir(tmp_path_factory, "emu_attn")


def run_kernel(emu_dir: Path, args, write_mask: bool):
    with emulated(emu_dir) as launches:
        out, kv, key_bias = run_on_copies(ka.node_attention_kernel, args, write_mask)
    assert [name for name, *_ in launches] == ["weaver_node_attention"]
    return out, kv, key_bias


def check_case(emu_dir: Path, args, write_mask: bool = True) -> None:
    check_results(args, write_mask, run_kernel(emu_dir, args, write_mask), run_reference(args, write_mask))


@pytest.mark.parametrize("dtype", DTYPES)
def test_random_forests_match_float64_and_the_reference(emu_dir: Path, dtype) -> None:
    check_case(emu_dir, problem(1, 3, 4, 2, 16, 5, 12, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_roots_and_a_call_without_mask_write(emu_dir: Path, dtype) -> None:
    check_case(emu_dir, problem(2, 2, 1, 3, 8 if dtype != torch.float32 else 4, 4, 6, dtype, roots=True))
    check_case(emu_dir, problem(3, 2, 3, 2, 16, 4, 9, dtype), write_mask=False)


def test_n_equals_one_and_a_deep_chain(emu_dir: Path) -> None:
    check_case(emu_dir, problem(4, 1, 1, 1, 8, 2, 2, torch.bfloat16))  # one node, one head, one slot past it
    # 70 node slots + 16 prompt keys: more keys than lanes, a chain 60 deep
    check_case(emu_dir, problem(5, 2, 2, 2, 8, 15, 70, torch.bfloat16, chain=True, invalid=0.0))
    # 240 + 16 = 256 keys (eight per lane), ten rows (more than the warps)
    check_case(emu_dir, problem(8, 1, 10, 1, 8, 15, 240, torch.float16))


def test_fresh_random_shapes(emu_dir: Path) -> None:
    g = random.Random(11)
    for case in range(3):
        dtype = g.choice(DTYPES)
        hd = g.choice([4, 8, 12]) * (1 if dtype == torch.float32 else 2)
        w = g.randint(1, 5)
        check_case(emu_dir, problem(100 + case, g.randint(1, 3), w, g.randint(1, 3), hd, g.randint(1, 6),
                                    w + g.randint(1, 10), dtype, chain=g.random() < 0.3))


def test_weaver_scorer_through_the_kernels(emu_dir: Path) -> None:
    """BatchedWeaverTreeScorer(score_kernel=True): per layer one attention launch between the qkv
    and o_proj linear layers, and the torch path's log-probabilities to float32 rounding over
    three calls (roots, children, grandchildren with one invalid row)."""
    pair = tiny_scorer_pair(3, 2)
    scorers, cfg = pair[:2], pair.config
    t = torch.tensor
    calls = [
        (t([[0, 0], [0, 0]]), t([[-1, -1], [-1, -1]]), t([[5, 0], [9, 0]]), t([[0, 0], [0, 0]]), t([[True, False]] * 2)),
        (t([[1, 2], [1, 2]]), t([[0, 0], [0, 0]]), t([[7, 8], [3, 4]]), t([[1, 1], [1, 1]]), t([[True, True]] * 2)),
        (t([[3, 4], [3, 4]]), t([[2, 1], [1, 1]]), t([[1, 2], [6, 7]]), t([[2, 2], [2, 2]]), t([[True, True], [True, False]])),
    ]
    with (emulated(emu_dir) as launches, mock.patch.object(kc, "unsupported_reason", lambda *a: None),
          mock.patch.object(kl, "unsupported_reason", lambda *a: None),
          mock.patch.object(ka, "unsupported_reason", lambda *a: None)):
        for node, parent, tok, dep, valid in calls:
            ref, got = (s(node, parent, tok, dep, valid) for s in scorers)
            assert torch.allclose(got[valid], ref[valid], rtol=0, atol=2e-5)
    layer = ["weaver_linear", "weaver_node_attention", "weaver_linear", "weaver_linear", "weaver_linear"]
    per_call = ["weaver_linear", *layer * cfg.n_layers, "weaver_linear", "candidate_scores"]
    assert [name for name, *_ in launches] == per_call * len(calls)


def test_which_inputs_the_kernel_takes(monkeypatch) -> None:
    args = list(problem(6, 2, 2, 2, 8, 3, 5, torch.bfloat16))
    assert ka.unsupported_reason(*args, True) == ka.NOT_CUDA
    bad = list(args)
    bad[6] = bad[6].float()
    assert "one of float32, bfloat16, float16 for all" in ka.unsupported_reason(*bad, True)
    bad = list(args)
    bad[5] = bad[5].long()
    assert ka.unsupported_reason(*bad, True) == "node_ids, parent_ids and depths must be int64 and valid bool"
    bad = list(args)
    bad[0] = bad[0][:, :-8]
    assert "is not [R w = 4, 6 heads hd = 96]" in ka.unsupported_reason(*bad, True)
    bad = list(args)
    bad[8] = args[8] + 1
    assert "key slots" in ka.unsupported_reason(*bad, True)
    odd = list(problem(6, 2, 2, 2, 4, 3, 5, torch.bfloat16))  # 4 bfloat16 = 8-byte head rows
    assert ka.unsupported_reason(*odd, True) == "head rows of 4 elements are not a multiple of 16 bytes"
    bad = list(args)
    bad[6] = bad[6].transpose(3, 4).contiguous().transpose(3, 4)
    assert "not contiguous" in ka.unsupported_reason(*bad, True)
    wide = list(problem(6, 1, 1, 1, 8, 3, 290, torch.bfloat16))  # 4 + 290 + 1 keys: 304 mask columns
    assert ka.unsupported_reason(*wide, True) == "key_bias has 304 columns, over the kernel's 288 (32 lanes x 9)"


def test_dispatch_uses_the_reference_off_cuda_and_when_switched_off(monkeypatch) -> None:
    args = problem(7, 2, 2, 2, 8, 3, 5, torch.float32, invalid=0.0)
    with mock.patch.object(ka, "node_attention_kernel", side_effect=AssertionError("no launch")):
        a = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
        b = [t.clone() if isinstance(t, torch.Tensor) else t for t in args]
        assert torch.equal(ka.node_attention(*a, True), ka.node_attention_reference(*b, True))
        monkeypatch.setenv(ka.ENV_SWITCH, "0")
        with mock.patch.object(ka, "unsupported_reason", lambda *x: None):
            assert torch.equal(ka.node_attention(*a, False), ka.node_attention_reference(*b, False))


def test_the_scorer_launches_attention_and_candidate_scores_with_pdl_unless_switched_off(emu_dir: Path,
                                                                                       monkeypatch) -> None:
    """VLLM_TFM_WEAVER_CHAIN_PDL (on unless 0): the attention and candidate-score launches ask for programmatic
    dependent launch like the linear ones, or not; the scores are the same either way."""
    monkeypatch.delenv(ka.CHAIN_PDL_SWITCH, raising=False)
    outs, flags = [], []
    for setting in (None, "0"):
        if setting is not None:
            monkeypatch.setenv(ka.CHAIN_PDL_SWITCH, setting)
        scorer = tiny_scorer_pair(4, 2)[1]
        node, valid = torch.zeros(2, 1, dtype=torch.long), torch.ones(2, 1, dtype=torch.bool)
        with (emulated(emu_dir) as launches, mock.patch.object(kc, "unsupported_reason", lambda *a: None),
              mock.patch.object(kl, "unsupported_reason", lambda *a: None),
              mock.patch.object(ka, "unsupported_reason", lambda *a: None)):
            outs.append(scorer(node, node - 1, torch.tensor([[5], [9]]), node, valid))
        by_name: dict[str, set[bool]] = {}
        for (name, *_), pdl in zip(launches, launches.programmatic):
            by_name.setdefault(name, set()).add(pdl)
        flags.append(by_name)
    assert flags[0] == {"weaver_linear": {True}, "weaver_node_attention": {True}, "candidate_scores": {True}}
    assert flags[1] == {"weaver_linear": {True}, "weaver_node_attention": {False}, "candidate_scores": {False}}
    assert torch.equal(outs[0], outs[1])
