"""GPU: the Weaver scorer's candidate-score kernel (``cuda/candidate_scores.cu``) against a float64
evaluation of the same stored values and the torch reference it replaces.

Run on the GPU host: ``python3 -m pytest tests/gpu/test_candidate_scores_gpu.py -q``. Fresh random
inputs per case in every supported dtype pair, from n = 1 to the 27B shape (H = 5120, K = 512,
248320-row lm_head, R x w = 32 nodes), strided lm_head rows and clamped ids / depths; the
``candidate_scores`` dispatch takes the kernel on CUDA (one launch) and the reference when switched
off; and the Weaver's log-probabilities through the kernel equal the torch path's to float32
rounding at the 27B drafter shape.
"""

from __future__ import annotations

import pytest
import torch
from _weaver27b import VOCAB, scorer_pair_27b

from vllm_tfm.kernels import candidate_scores as kc
from vllm_tfm.models.vocab_table import candidate_scores_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def problem(seed, r, w, d, k, h, v, table_dtype, logit_dtype, pad=0):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    table = (torch.randn(v, h + pad, generator=gen, device=DEV) * 0.05).to(table_dtype)[:, :h]
    ids = torch.randint(0, v, (r, d, k), generator=gen, device=DEV)
    logits = (torch.randn(r, d, k, generator=gen, device=DEV) * 3).to(logit_dtype)
    depths = torch.randint(0, d, (r, w), generator=gen, device=DEV)
    queries = torch.randn(r, w, h, generator=gen, device=DEV).to(table_dtype)
    return table, ids, logits, depths, queries


def max_scaled_error(got, table, ids, logits, depths, queries) -> float:
    """max |got - float64| / (|logit| + sum |a b|) over the entries."""
    r, w = depths.shape
    k = ids.shape[2]
    dep = depths.clamp(0, ids.shape[1] - 1)[..., None].expand(r, w, k)
    idc = ids.gather(1, dep).clamp(0, table.shape[0] - 1)
    lg = logits.gather(1, dep).double()
    err = 0.0
    for i in range(w):  # per column: bounded float64 temporaries at the 27B shape
        rows = table.double()[idc[:, i]]  # [R, K, H]
        prod = rows * queries[:, i].double()[:, None, :]
        exact = lg[:, i] + prod.sum(-1)
        scale = lg[:, i].abs() + prod.abs().sum(-1)
        err = max(err, float(((got[:, i].double() - exact).abs() / scale).max()))
    return err


CASES = [
    (1, 1, 1, 1, 8, 5),
    (1, 2, 15, 37, 264, 300),
    (3, 5, 4, 64, 520, 1000),
    (1, 2, 15, 512, 5120, 248320),  # the 27B drafter shape, batch 1, width 2
    (8, 4, 15, 512, 5120, 248320),  # batch 8, width 4
]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("table_dtype", DTYPES)
def test_matches_float64_and_reference(case: int, table_dtype) -> None:
    r, w, d, k, h, v = CASES[case]
    for logit_dtype in dict.fromkeys((table_dtype, torch.float32, torch.bfloat16)):
        args = problem(case * 10 + DTYPES.index(logit_dtype), r, w, d, k, h, v, table_dtype, logit_dtype)
        assert kc.unsupported_reason(*args) is None
        got = kc.candidate_scores_kernel(*args)
        assert got.dtype == torch.float32 and got.shape == (r, w, k)
        assert max_scaled_error(got, *args) <= 1e-5
        ref = candidate_scores_reference(*args).float()
        assert float((got - ref).abs().max()) <= 1e-3 * max(1.0, float(ref.abs().max()))


def test_strided_rows_and_clamping() -> None:
    table, ids, logits, depths, queries = problem(7, 2, 3, 5, 13, 72, 50, torch.bfloat16, torch.float32, pad=8)
    ids[0, 0, :3] = torch.tensor([-4, 50, 10**6], device=DEV)
    depths[1, 0], depths[0, 2] = -2, 9
    got = kc.candidate_scores_kernel(table, ids, logits, depths, queries)
    assert max_scaled_error(got, table, ids, logits, depths, queries) <= 1e-5


def test_dispatch(monkeypatch) -> None:
    args = problem(3, 2, 2, 15, 512, 5120, 4096, torch.bfloat16, torch.bfloat16)
    got = kc.candidate_scores(*args)
    assert torch.equal(got, kc.candidate_scores_kernel(*args))  # deterministic, and the kernel ran
    monkeypatch.setenv(kc.ENV_SWITCH, "0")
    assert torch.equal(kc.candidate_scores(*args), candidate_scores_reference(*args))


def test_weaver_scorer_at_the_27b_shape(monkeypatch) -> None:
    monkeypatch.setenv("VLLM_TFM_WEAVER_LINEAR_KERNEL", "0")  # the candidate scores alone differ
    monkeypatch.setenv("VLLM_TFM_WEAVER_ATTENTION_KERNEL", "0")
    r, w = 2, 2
    scorers = scorer_pair_27b(r)
    node = torch.zeros(r, w, dtype=torch.long, device=DEV)
    node[:, 1] = 32  # an invalid column (written to the trash slot)
    parent = torch.full_like(node, -1)
    tok = torch.randint(0, VOCAB, (r, w), device=DEV)
    dep = torch.zeros_like(node)
    valid = torch.tensor([[True, False]] * r, device=DEV)
    with torch.inference_mode():
        ref, got = (s(node, parent, tok, dep, valid) for s in scorers)
    assert got.dtype == ref.dtype == torch.float32
    assert float((got[:, 0] - ref[:, 0]).abs().max()) <= 1e-4  # log-probabilities of O(10): float32 rounding
    assert torch.equal(got.argmax(-1)[:, 0], ref.argmax(-1)[:, 0])
