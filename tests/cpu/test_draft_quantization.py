"""The fused context K/V projection of a quantized DFlash drafter (``draft_quantization``'s patch of
``DFlashQwen3Model._build_context_kv_buffers``), through vLLM 0.26's own ``_build_fused_kv_buffers`` on stand-in
layers whose quantization method stores float8 [in, out] weights with per-tensor scales and quantizes activations
per row, as vLLM's online FP8 does."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("vllm")

from vllm.model_executor.layers.linear import UnquantizedLinearMethod  # noqa: E402
from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model  # noqa: E402

from vllm_tfm.vllm_plugin.draft_quantization import dequantized_weight, install_draft_quantization  # noqa: E402
from vllm_tfm.vllm_plugin.patching import original  # noqa: E402

E4M3 = torch.float8_e4m3fn
HIDDEN, Q, KV, HEAD_DIM = 64, 48, 16, 8


class PerRowFp8Method:
    """x -> round_e4m3(x / s_row) * s_row @ (w_q * w_scale), w_q stored [in, out] (padded to 16 columns)."""

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        s = (x.float().abs().amax(dim=1, keepdim=True) / 448.0).clamp_min(1e-12)
        xq = (x.float() / s).to(E4M3).float() * s
        out = xq @ (layer.weight.float() * layer.weight_scale)
        out = out[:, : layer.output_size_per_partition]
        return (out if bias is None else out + bias).to(x.dtype)


class Linear(torch.nn.Module):
    def __init__(self, weight: torch.Tensor, method: Any, quantized: bool) -> None:
        super().__init__()
        out, n_in = weight.shape
        self.input_size_per_partition, self.output_size_per_partition = n_in, out
        self.quant_method, self.bias, self.params_dtype = method, None, weight.dtype
        if quantized:
            scale = weight.abs().amax() / 448.0
            wq = (weight / scale).to(E4M3).t()  # [in, out], as online FP8 leaves it
            pad = -out % 16
            wq = torch.cat([wq, torch.zeros(n_in, pad, dtype=E4M3)], dim=1) if pad else wq
            self.weight = torch.nn.Parameter(wq, requires_grad=False)
            self.weight_scale = torch.nn.Parameter(scale.reshape(1), requires_grad=False)
        else:
            self.weight = torch.nn.Parameter(weight, requires_grad=False)


def drafter(layers: int, quantized: bool, out: int = Q + 2 * KV, patched: bool = True) -> Any:
    """A stand-in for vLLM's DFlashQwen3Model with its real ``_build_fused_kv_buffers`` and the plugin's
    ``_build_context_kv_buffers`` (``patched``) or vLLM's."""
    torch.manual_seed(layers + 10 * quantized + out)
    attns = []
    for _ in range(layers):
        w = (torch.randn(out, HIDDEN) * 0.05).to(torch.bfloat16)
        method = PerRowFp8Method() if quantized else UnquantizedLinearMethod()
        attns.append(types.SimpleNamespace(
            qkv_proj=Linear(w, method, quantized), q_size=Q, kv_size=KV, head_dim=HEAD_DIM, num_kv_heads=KV // HEAD_DIM,
            q_norm=types.SimpleNamespace(variance_epsilon=1e-6), k_norm=types.SimpleNamespace(weight=torch.ones(HEAD_DIM)),
            rotary_emb=types.SimpleNamespace(head_size=HEAD_DIM, cos_sin_cache=torch.zeros(4, HEAD_DIM), is_neox_style=True),
            attn=object(),
        ))
    inner = types.SimpleNamespace(
        layers=[types.SimpleNamespace(self_attn=a) for a in attns],
        hidden_norm=types.SimpleNamespace(weight=torch.ones(HIDDEN)),
    )
    install_draft_quantization()
    build = DFlashQwen3Model._build_context_kv_buffers
    if not patched:
        build = original(DFlashQwen3Model, "_build_context_kv_buffers")
    inner._build_context_kv_buffers = types.MethodType(build, inner)
    inner._build_fused_kv_buffers = types.MethodType(DFlashQwen3Model._build_fused_kv_buffers, inner)
    return types.SimpleNamespace(model=inner)


def test_quantized_drafter_context_kv_matches_its_layers() -> None:
    """vLLM's own buffer cannot even be multiplied; the patched build gives, for random context rows, the K/V part
    of what each quantized layer computes (up to the layers' own per-row activation rounding)."""
    broken = drafter(3, quantized=True, patched=False)
    broken.model._build_fused_kv_buffers()
    x = torch.randn(5, HIDDEN).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        F.linear(x, broken.model._fused_kv_weight)

    d = drafter(3, quantized=True)
    d.model._build_fused_kv_buffers()  # vLLM's build (at load, or lazily after dummy weights)
    inner = d.model
    assert inner._num_attn_layers == 3 and inner._fused_kv_weight.shape == (3 * 2 * KV, HIDDEN)
    assert inner._fused_kv_weight.dtype == torch.bfloat16  # the layers' params_dtype
    exact = torch.cat([
        (a.self_attn.qkv_proj.weight.float() * a.self_attn.qkv_proj.weight_scale).t()[Q:Q + 2 * KV] for a in inner.layers
    ])
    torch.testing.assert_close(inner._fused_kv_weight.float(), exact, rtol=2 ** -8, atol=0)
    got = F.linear(x, inner._fused_kv_weight).float()
    per_layer = torch.cat([a.self_attn.qkv_proj.quant_method.apply(a.self_attn.qkv_proj, x)[:, Q:] for a in inner.layers], 1)
    rel = (got - per_layer.float()).norm() / per_layer.float().norm()
    assert rel < 0.06, rel  # only the layers' e4m3 rounding of x differs, not the weights


def test_identity_rows_read_a_quantized_weight_exactly() -> None:
    d = drafter(1, quantized=True, out=40)  # 40 columns: stored padded to 48
    linear = d.model.layers[0].self_attn.qkv_proj
    assert linear.weight.shape == (HIDDEN, 48)
    linear.params_dtype = torch.float32  # read without the bfloat16 rounding
    w = dequantized_weight(linear)
    torch.testing.assert_close(w, (linear.weight.float() * linear.weight_scale).t()[:40], rtol=1e-6, atol=0)


def test_unquantized_drafter_is_left_to_vllm() -> None:
    """Unquantized layers: the patched build's fused weight is exactly vLLM's own."""
    d, plain = drafter(2, quantized=False), drafter(2, quantized=False, patched=False)
    d.model._build_fused_kv_buffers()
    plain.model._build_fused_kv_buffers()
    assert torch.equal(d.model._fused_kv_weight, plain.model._fused_kv_weight)
    assert d.model._fused_kv_weight.shape == (2 * 2 * KV, HIDDEN)


def test_fp8_draft_head_refusals() -> None:
    """``draft_lm_head: "fp8"`` at load: one line per case where the FP8 copy would not compute vLLM's
    ``compute_logits`` (or cannot run here: CPU tensors)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from vllm_tfm.vllm_plugin.runtime.draft_head import draft_logits_head

    def stub(**change: Any) -> Any:
        head = types.SimpleNamespace(quant_method=UnquantizedEmbeddingMethod(), weight=torch.randn(64, 32).to(torch.bfloat16))
        proc = types.SimpleNamespace(soft_cap=None, scale=1.0, head_dtype=None, org_vocab_size=60)
        d = types.SimpleNamespace(lm_head=head, logits_processor=proc, draft_id_to_target_id=None)
        for key, value in change.items():
            obj, attr = key.split("__")
            setattr(d if obj == "d" else head if obj == "head" else proc, attr, value)
        return d

    cases = [
        ({}, 2, "runs on one GPU; this engine has tensor_parallel_size 2"),
        ({"head__quant_method": PerRowFp8Method()}, 1, r"the lm_head is quantized \(PerRowFp8Method\)"),
        ({"d__draft_id_to_target_id": torch.zeros(3)}, 1, "the drafter maps its own vocabulary"),
        ({"proc__soft_cap": 30.0}, 1, r"the logits are soft-capped or scaled \(soft_cap 30.0, scale 1.0\)"),
        ({"proc__scale": 0.5}, 1, r"the logits are soft-capped or scaled \(soft_cap None, scale 0.5\)"),
        ({"proc__head_dtype": torch.float32}, 1, "head_dtype torch.float32 is not the model's torch.bfloat16"),
        ({"proc__org_vocab_size": 65}, 1, r"the lm_head weight is torch.bfloat16 \(64, 32\), not torch.bfloat16 with 65 rows"),
        ({}, 1, "the inputs are not on one CUDA device"),
    ]
    for change, tp, message in cases:
        with pytest.raises(ValueError, match=r"^tfm option draft_lm_head='fp8': " + message) as info:
            draft_logits_head(stub(**change), torch.bfloat16, tp, True, None)
        assert "\n" not in str(info.value)
