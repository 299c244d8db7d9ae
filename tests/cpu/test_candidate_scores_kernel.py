"""The Weaver scorer's candidate-score kernel (``cuda/candidate_scores.cu`` behind
``vllm_tfm.kernels.candidate_scores``) on the CPU through the CUDA emulation (``cuda/host_emu``):
against a float64 evaluation of the same stored values and against the torch reference
(``candidate_scores_reference``) on fresh random inputs in every supported dtype pair, n = 1, K not
a multiple of the CTA's warps, H not a multiple of 256, strided lm_head rows, out-of-range depths
and ids (clamped); through ``BatchedWeaverTreeScorer`` (log-probabilities equal the torch path's to
float32 rounding); and which inputs the kernel takes, with the reason when it does not."""

from __future__ import annotations

import random
from pathlib import Path
from unittest import mock

import pytest
import torch
from _emulation import emulated, emulation_build_dir
from _tiny_scorers import TOP_K, tiny_scorer_pair

from vllm_tfm.kernels import candidate_scores as kc
from vllm_tfm.models.vocab_table import ShardedVocabTable, candidate_scores_reference

DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return emulation_build_dir(tmp_path_factory, "emu_cand")


def problem(seed: int, r: int, w: int, d: int, k: int, h: int, v: int, table_dtype, logit_dtype, pad: int = 0):
    gen = torch.Generator().manual_seed(seed)
    table = (torch.randn(v, h + pad, generator=gen) * 0.5).to(table_dtype)[:, :h]
    ids = torch.randint(0, v, (r, d, k), generator=gen)
    logits = (torch.randn(r, d, k, generator=gen) * 3).to(logit_dtype)
    depths = torch.randint(0, d, (r, w), generator=gen)
    queries = torch.randn(r, w, h, generator=gen).to(table_dtype)
    return table, ids, logits, depths, queries


def float64_scores(table, ids, logits, depths, queries) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, scale): the float64 function of the stored values, and per entry |logit| + sum |a b|
    (the size float32 rounding errors scale with)."""
    r, w = depths.shape
    k = ids.shape[2]
    dep = depths.clamp(0, ids.shape[1] - 1)[..., None].expand(r, w, k)
    idc = ids.gather(1, dep).clamp(0, table.shape[0] - 1)
    lg = logits.gather(1, dep).double()
    rows = table.double()[idc]  # [R, w, K, H]
    prod = rows * queries.double()[:, :, None, :]
    return lg + prod.sum(-1), lg.abs() + prod.abs().sum(-1)


def run_kernel(emu_dir: Path, *args) -> tuple[torch.Tensor, list]:
    with emulated(emu_dir) as launches:
        out = kc.candidate_scores_kernel(*args)
    return out, launches


CASES = [
    # (r, w, d, k, h, v)
    (1, 1, 1, 1, 8, 5),  # n = 1, one candidate
    (1, 2, 15, 37, 264, 300),  # K not a multiple of 4 warps, H not a multiple of 256
    (3, 5, 4, 64, 520, 1000),
    (2, 3, 6, 7, 64, 40),
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("table_dtype", DTYPES)
def test_matches_float64_and_reference(emu_dir: Path, case: int, table_dtype) -> None:
    r, w, d, k, h, v = CASES[case]
    for logit_dtype in dict.fromkeys((table_dtype, torch.float32, torch.bfloat16)):  # each dtype code of both
        args = problem(case * 10 + DTYPES.index(logit_dtype), r, w, d, k, h, v, table_dtype, logit_dtype)
        assert kc.unsupported_reason(*args) == kc.NOT_CUDA  # the kernel takes them (on CUDA)
        got, launches = run_kernel(emu_dir, *args)
        assert launches == [("candidate_scores", (-(-k // kc.WARPS), r * w, 1), 0)]
        assert got.dtype == torch.float32 and got.shape == (r, w, k)
        exact, scale = float64_scores(*args)
        err = (got.double() - exact).abs() / scale.clamp_min(1e-30)
        assert float(err.max()) <= 1e-5, (table_dtype, logit_dtype, float(err.max()))
        ref = candidate_scores_reference(*args)
        assert torch.allclose(got, ref.float(), rtol=0, atol=float(2e-5 * scale.max()))


def test_strided_table_rows_and_clamped_indices(emu_dir: Path) -> None:
    table, ids, logits, depths, queries = problem(7, 2, 3, 5, 13, 72, 50, torch.bfloat16, torch.float32, pad=8)
    assert table.stride(0) == 80 and not table.is_contiguous()
    ids[0, 0, :3] = torch.tensor([-4, 50, 10**6])  # outside [0, V): rows 0, V - 1, V - 1
    depths[1, 0], depths[0, 2] = -2, 9  # outside [0, D): depths 0 and D - 1
    depths[0, 1] = 0
    got, _ = run_kernel(emu_dir, table, ids, logits, depths, queries)
    exact, scale = float64_scores(table, ids, logits, depths, queries)
    assert float(((got.double() - exact).abs() / scale).max()) <= 1e-5
    # the clamped ids read the first and the last row
    row0 = float(logits[0, 0, 0]) + float((table[0].double() * queries[0, 1].double()).sum())
    last = float(logits[0, 0, 1]) + float((table[49].double() * queries[0, 1].double()).sum())
    assert got[0, 1, 0].item() == pytest.approx(row0, rel=1e-5)
    assert got[0, 1, 1].item() == pytest.approx(last, rel=1e-5)


def test_fresh_random_shapes(emu_dir: Path) -> None:
    rng = random.Random(3)
    for i in range(4):
        r, w, d = rng.randint(1, 4), rng.randint(1, 6), rng.randint(1, 15)
        k, h = rng.randint(1, 70), 8 * rng.randint(1, 70)
        dt = rng.choice(DTYPES)
        args = problem(100 + i, r, w, d, k, h, rng.randint(k, 4 * k + 2), dt, rng.choice((dt, torch.float32)))
        got, _ = run_kernel(emu_dir, *args)
        exact, scale = float64_scores(*args)
        assert float(((got.double() - exact).abs() / scale).max()) <= 1e-5, (r, w, d, k, h, dt)


def test_weaver_scorer_through_the_kernel(emu_dir: Path) -> None:
    """BatchedWeaverTreeScorer(score_kernel=True) gives the torch path's log-probabilities to
    float32 rounding, call after call (the kernel launched once per call)."""
    r, k = 2, TOP_K
    pair = tiny_scorer_pair(0, r, n_layers=1, perturb=False)
    scorers, inputs = pair[:2], pair.inputs
    calls = [
        (torch.tensor([[0], [0]]), torch.tensor([[-1], [-1]]), torch.tensor([[5], [9]]), torch.tensor([[0], [0]])),
        (torch.tensor([[1], [1]]), torch.tensor([[0], [0]]), torch.tensor([[7], [3]]), torch.tensor([[1], [1]])),
    ]
    with emulated(emu_dir) as launches, mock.patch.object(kc, "unsupported_reason", lambda *a: None):
        for node, parent, tok, dep in calls:
            valid = torch.ones_like(node, dtype=torch.bool)
            ref, got = (s(node, parent, tok, dep, valid) for s in scorers)
            assert got.shape == ref.shape == (r, 1, k)
            assert torch.allclose(got, ref, rtol=0, atol=1e-5)
            assert not torch.equal(got, torch.log_softmax(inputs[3][:, 0:1], -1))  # the residual matters
    assert [name for name, *_ in launches] == ["candidate_scores"] * len(calls)


def test_which_inputs_the_kernel_takes() -> None:
    args = list(problem(1, 1, 2, 3, 4, 16, 9, torch.bfloat16, torch.bfloat16))
    assert kc.unsupported_reason(*args) == kc.NOT_CUDA

    def reason(i: int, value) -> str | None:
        a = list(args)
        a[i] = value
        return kc.unsupported_reason(*a)

    sharded = ShardedVocabTable(args[0], 0, 9, 9, lambda t: t)
    assert "not a plain [V, H] tensor" in reason(0, sharded)
    assert "float32, bfloat16 or float16" in reason(0, args[0].double())
    assert "queries of the lm_head's dtype" in reason(4, args[4].float())
    assert "must be int64" in reason(1, args[1].int())
    assert "not a multiple of 8" in kc.unsupported_reason(args[0][:, :12], args[1], args[2], args[3], args[4][..., :12])
    offset = torch.empty(2 * 16 + 1, dtype=torch.bfloat16)[1:].view(1, 2, 16)  # rows 2 bytes off 16-byte alignment
    assert "16-byte aligned" in reason(4, offset)
    assert "over the kernel's" in reason(3, torch.zeros(1, kc.MAX_GRID_Y + 1, dtype=torch.long))


def test_dispatch_falls_back_to_the_reference_off_cuda_and_when_switched_off(monkeypatch) -> None:
    args = problem(2, 2, 2, 3, 5, 16, 9, torch.float32, torch.float32)
    with mock.patch.object(kc, "candidate_scores_kernel", side_effect=AssertionError("no launch")):
        assert torch.equal(kc.candidate_scores(*args), candidate_scores_reference(*args))  # CPU: the reference
        monkeypatch.setenv(kc.ENV_SWITCH, "0")
        with mock.patch.object(kc, "unsupported_reason", lambda *a: None):
            assert torch.equal(kc.candidate_scores(*args), candidate_scores_reference(*args))
