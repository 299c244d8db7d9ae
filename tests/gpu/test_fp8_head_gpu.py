"""vllm_tfm.kernels.fp8_head on the GPU: torch._scaled_mm with row-wise scales against its float32 reference."""

from __future__ import annotations

import pytest
import torch

from vllm_tfm.kernels.fp8_head import fp8_head_logits, fp8_head_logits_reference, fp8_head_unsupported_reason, quantize_head

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _case(m: int, h: int, v: int, dtype: torch.dtype, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    w = (torch.randn(v, h, device="cuda", generator=g) * 0.02).to(dtype)
    w[3] *= 40.0  # one row with a much larger range: per-row scales keep the others fine
    x = (torch.randn(m, h, device="cuda", generator=g)).to(dtype)
    x[0] *= 1e-3  # and one small activation row
    return x, w


@pytest.mark.parametrize("m,h,v", [(1, 128, 512), (15, 256, 1024), (16, 256, 1000), (120, 512, 4096), (33, 128, 4104)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scaled_mm_matches_the_reference(m: int, h: int, v: int, dtype: torch.dtype) -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9")
    x, w = _case(m, h, v, dtype, seed=m * 7 + v)
    wq, ws = quantize_head(w)
    assert wq.shape[0] % 16 == 0 and ws.shape == (1, wq.shape[0])
    assert fp8_head_unsupported_reason(x, wq) is None
    got = fp8_head_logits(x, wq, ws, v)
    ref = fp8_head_logits_reference(x, wq, ws, v)
    assert got.shape == (m, v) and got.dtype == dtype and got.is_contiguous()
    # the same rounded operands; only the float32 accumulation order and the output rounding differ
    err = (got.float() - ref.float()).abs()
    assert (err <= 1e-2 * ref.float().abs() + 1e-3 * ref.float().abs().amax(dim=1, keepdim=True)).all(), err.max()
    # against the exact product: each of the H terms x_k w_k carries the e4m3 rounding of both factors (relative
    # error up to 2^-4 each, ~0.036 rms), so an output's error is ~0.05 x sqrt(sum_k (x_k w_k)^2), whatever the
    # output's own size (a ratio to the output itself is heavy-tailed where it is near 0)
    exact = x.float() @ w.float().t()
    spread = ((x.float() ** 2) @ (w.float() ** 2).t()).sqrt()
    rms = ((got.float() - exact) / spread).pow(2).mean().sqrt()
    assert 0.01 < rms < 0.08, rms


def test_argmax_of_a_peaked_row_survives() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9")
    x, w = _case(16, 256, 2048, torch.bfloat16, seed=5)
    w[3] /= 40.0
    target = torch.arange(16, device="cuda") * 97 % 2048
    w[target] = x.float().sign().to(w.dtype) * 0.05  # row i's logit for its target token towers over the rest
    wq, ws = quantize_head(w)
    assert torch.equal(fp8_head_logits(x, wq, ws, 2048).argmax(dim=1), target)


def test_vllm_per_token_quantization_gives_the_same_logits() -> None:
    """The plugin's ``quantize_rows``: vLLM's one-kernel per-token FP8 quantization with padded rows left
    unwritten gives the logits of the torch quantization (same scales up to vLLM's float32 arithmetic)."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9")
    ops = pytest.importorskip("vllm._custom_ops")
    x, w = _case(15, 256, 1024, torch.bfloat16, seed=11)
    wq, ws = quantize_head(w)

    def vllm_rows(rows_in: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        return ops.scaled_fp8_quant(rows_in, num_token_padding=rows, use_per_token_if_dynamic=True)

    xq, sa = vllm_rows(x, 16)
    assert xq.shape == (16, 256) and xq.dtype == torch.float8_e4m3fn and sa.shape == (16, 1)
    got = fp8_head_logits(x, wq, ws, 1024, quantize_rows=vllm_rows)
    want = fp8_head_logits(x, wq, ws, 1024)
    assert got.shape == (15, 1024) and torch.isfinite(got).all()
    err = (got.float() - want.float()).abs()
    assert (err <= 2e-2 * want.float().abs() + 2e-3 * want.float().abs().amax(dim=1, keepdim=True)).all(), err.max()


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("m", [1, 15, 120])
def test_the_runtime_head_over_a_draft_vocab(fp8: bool, m: int) -> None:
    """``draft_logits_head`` with a draft vocabulary on the GPU (runtime/draft_head.py, as the plugin builds it):
    at the draft vocabulary's tokens the plain head's logits (bf16) or the FP8 head of those rows (vLLM's
    quantization op); -inf at every other token; the argmax of a full row is the argmax over the subset."""
    if fp8 and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9")
    import types

    pytest.importorskip("vllm._custom_ops")
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from vllm_tfm.models.draft_vocab import subset_logits_reference
    from vllm_tfm.vllm_plugin.runtime.draft_head import draft_logits_head

    v, h = 4000, 256
    x, w = _case(m, h, v + 16, torch.bfloat16, seed=m + 3)  # 16 rows of vocabulary padding past org_vocab_size
    head = types.SimpleNamespace(quant_method=UnquantizedEmbeddingMethod(), weight=w)
    proc = types.SimpleNamespace(soft_cap=None, scale=1.0, head_dtype=None, org_vocab_size=v)
    drafter = types.SimpleNamespace(lm_head=head, logits_processor=proc, draft_id_to_target_id=None)
    g = torch.Generator().manual_seed(m)
    ids = torch.randperm(v, generator=g)[:1000].sort().values.cuda()
    got = draft_logits_head(drafter, torch.bfloat16, 1, fp8, ids)(x)
    assert got.shape == (m, v) and got.dtype == torch.bfloat16
    rest = torch.ones(v, dtype=torch.bool, device="cuda")
    rest[ids] = False
    assert torch.isneginf(got[:, rest]).all() and torch.isfinite(got[:, ids]).all()
    if fp8:
        ops = pytest.importorskip("vllm._custom_ops")

        def vllm_rows(rows_in: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:  # as the plugin quantizes
            return ops.scaled_fp8_quant(rows_in, num_token_padding=rows, use_per_token_if_dynamic=True)

        wq, ws = quantize_head(w[ids])  # per-row scales: the subset's rows quantize as in the full copy
        want = fp8_head_logits(x, wq, ws, ids.numel(), quantize_rows=vllm_rows)
        err = (got[:, ids].float() - want.float()).abs()
        assert (err <= 1e-2 * want.float().abs() + 1e-3 * want.float().abs().amax(dim=1, keepdim=True)).all(), err.max()
    else:
        ref = subset_logits_reference(x.double(), w[:v].double(), ids, v)
        err = (got[:, ids].double() - ref[:, ids]).abs()
        assert (err <= 1e-2 * ref[:, ids].abs() + 1e-2 * ref[:, ids].abs().amax(dim=1, keepdim=True)).all(), err.max()
        assert torch.equal(got.argmax(dim=1), ids[got[:, ids].argmax(dim=1)])
