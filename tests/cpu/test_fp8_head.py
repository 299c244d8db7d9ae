"""vllm_tfm.kernels.fp8_head on the CPU: the FP8 lm_head copy's layout and its float32 reference."""

from __future__ import annotations

import pytest
import torch

from vllm_tfm.kernels.fp8_head import E4M3_MAX, fp8_head_logits, fp8_head_logits_reference, fp8_head_unsupported_reason, quantize_head


def test_quantize_head_pads_to_16_rows_with_per_row_scales() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(37, 32, generator=g)
    w[5] *= 100.0
    wq, ws = quantize_head(w)
    assert wq.dtype == torch.float8_e4m3fn and wq.shape == (48, 32) and ws.shape == (1, 48)
    torch.testing.assert_close(ws[0, :37], w.abs().amax(dim=1) / E4M3_MAX)
    assert torch.equal(ws[0, 37:], torch.ones(11)) and torch.equal(wq[37:].float(), torch.zeros(11, 32))
    deq = wq[:37].float() * ws[0, :37, None]
    rel = (deq - w).abs() / w.abs().amax(dim=1, keepdim=True)
    assert rel.max() <= 2.0**-4 / 1.0 and rel.max() > 0  # e4m3's half step at the row's own range
    with pytest.raises(ValueError, match=r"must be \[V, H\], got \(3,\)"):
        quantize_head(torch.ones(3))


def test_reference_is_rounded_rows_times_dequantized_weights() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 16, generator=g, dtype=torch.float64).to(torch.bfloat16)
    x = torch.randn(5, 16, generator=g, dtype=torch.float64).to(torch.bfloat16)
    x[2] *= 1e-4
    wq, ws = quantize_head(w)
    got = fp8_head_logits_reference(x, wq, ws, 40)
    assert got.shape == (5, 40) and got.dtype == torch.bfloat16
    xs = x.double().abs().amax(dim=1, keepdim=True) / E4M3_MAX
    xr = (x.double() / xs).to(torch.float8_e4m3fn).double() * xs
    want = xr @ (wq[:40].double() * ws[0, :40, None].double()).t()
    torch.testing.assert_close(got.double(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
    exact = x.double() @ w.double().t()
    assert 0 < ((got.double() - exact).norm() / exact.norm()) < 0.08
    # the tiny row has its own scale: its logits are as accurate as the others'
    assert ((got[2].double() - exact[2]).norm() / exact[2].norm()) < 0.08


def test_cpu_inputs_take_the_reference_and_bad_inputs_are_refused() -> None:
    w = torch.randn(32, 16).to(torch.bfloat16)
    x = torch.randn(3, 16).to(torch.bfloat16)
    wq, ws = quantize_head(w)
    assert fp8_head_unsupported_reason(x, wq) == "the inputs are not on one CUDA device"
    assert torch.equal(fp8_head_logits(x, wq, ws, 30), fp8_head_logits_reference(x, wq, ws, 30))
    with pytest.raises(ValueError, match="must share H"):
        fp8_head_logits(torch.randn(3, 8).to(torch.bfloat16), wq, ws, 30)
    with pytest.raises(ValueError, match="must come from quantize_head"):
        fp8_head_logits(x, w, ws, 30)
    with pytest.raises(ValueError, match=r"vocab 33 is outside \[1, 32\]"):
        fp8_head_logits(x, wq, ws, 33)


def test_quantize_head_in_chunks_equals_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_tfm.kernels import fp8_head

    w = torch.randn(53, 32, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    one_q, one_s = quantize_head(w)
    monkeypatch.setattr(fp8_head, "_QUANT_ROWS", 8)  # 7 chunks, the last one short
    q, s = quantize_head(w)
    assert torch.equal(q.float(), one_q.float()) and torch.equal(s, one_s) and q.shape == (64, 32)
