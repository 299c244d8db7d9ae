"""GPU test: the one-launch top-K (``cuda/topk_rows.cu``) selects exactly what ``topk_rows_reference``
selects (values and indices, ties to the lower index, NaN first) at the Qwen3.6-27B DFlash shape (k = 512
of 248,320 bf16 logits, 15 and 120 rows) and on small rows of every dtype, cluster size and edge case; its
values equal ``torch.topk``'s; it runs inside a CUDA graph replayed on new logits; and the Weaver build's
candidates take it (``proposal_trees._candidates``).

Run on the GPU host: ``python3 -m pytest tests/gpu/test_topk_rows_gpu.py -q``.
"""

from __future__ import annotations

import pytest
import torch
from _kernel_marks import CAPTURES_A_GRAPH

from vllm_tfm.kernels import topk_rows as ktk
from vllm_tfm.kernels.loader import kernels_available, kernels_unavailable_reason

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = torch.device("cuda")


@pytest.fixture(scope="module", autouse=True)
def _kernels_must_work():
    if not kernels_available():
        pytest.skip(f"CUDA kernels unavailable: {kernels_unavailable_reason()}")


def _logits(rows: int, v: int, dtype: torch.dtype, seed: int, levels: int | None = None) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    if levels is not None:
        return (torch.randint(0, levels, (rows, v), generator=g, device=DEV).float() - levels / 2).to(dtype)
    return (torch.randn(rows, v, generator=g, device=DEV) * 3).to(dtype)


def _assert_reference(x: torch.Tensor, k: int, cluster: int | None = None) -> None:
    got_v, got_i = ktk.topk_rows(x, k, cluster=cluster)
    want_v, want_i = ktk.topk_rows_reference(x, k)
    assert torch.equal(got_i, want_i), f"indices differ at {(got_i != want_i).nonzero()[:5].tolist()}"
    assert torch.equal(got_v.nan_to_num(9.0), want_v.nan_to_num(9.0)) and torch.equal(got_v.isnan(), want_v.isnan())


@pytest.mark.parametrize("rows", [15, 120])
@pytest.mark.parametrize("levels", [None, 64])
def test_the_27b_shape_equals_the_reference_and_torch_topk_values(rows, levels) -> None:
    x = _logits(rows, 248320, torch.bfloat16, seed=rows, levels=levels)
    assert ktk.topk_rows_unsupported_reason(x, 512) is None
    _assert_reference(x, 512)
    assert torch.equal(ktk.topk_rows(x, 512)[0], torch.topk(x.float(), 512, dim=-1).values)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("cluster", [1, 2, 4, 8])
def test_small_rows_every_cluster_and_edge_case(dtype, cluster) -> None:
    x = _logits(6, 4099, dtype, seed=cluster, levels=None)
    x[1] = _logits(1, 4099, dtype, seed=99, levels=7)[0]
    x[2] = 0.5
    x[3, ::2] = float("-inf")
    x[4, [0, 17, 4098]] = float("nan")
    x[5, :2000] = -0.0
    x[5, 2000:] = 0.0
    for k in (1, 300, 1024):
        _assert_reference(x, k, cluster)
    _assert_reference(x[:, :700], 700, cluster)  # k = V on strided rows


@CAPTURES_A_GRAPH
def test_replayed_from_a_cuda_graph_on_new_logits() -> None:
    x = _logits(15, 248320, torch.bfloat16, seed=1)
    ktk.topk_rows(x, 512)  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.cuda.graph(graph, stream=s):
        vals, idx = ktk.topk_rows(x, 512)
    torch.cuda.current_stream().wait_stream(s)
    for seed in (2, 3):
        x.copy_(_logits(15, 248320, torch.bfloat16, seed=seed, levels=None if seed == 2 else 40))
        graph.replay()
        want_v, want_i = ktk.topk_rows_reference(x, 512)
        assert torch.equal(idx, want_i) and torch.equal(vals, want_v)


def test_the_weaver_candidates_take_the_kernel() -> None:
    from vllm_tfm.models.proposal_trees import _candidates

    x = _logits(30, 248320, torch.bfloat16, seed=4, levels=50).reshape(2, 15, 248320)
    vals, ids = _candidates(x, 512, kernel=True)
    want_v, want_i = ktk.topk_rows_reference(x, 512)
    assert torch.equal(ids, want_i) and torch.equal(vals, want_v)
    tv, _ = _candidates(x, 512, kernel=False)  # torch.topk: the same values
    assert torch.equal(tv, vals)
