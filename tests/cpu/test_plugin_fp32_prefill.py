"""Float32 GDN prefill patch: the chunked delta rule for float32, vLLM's kernel for everything else."""

import pytest
import torch

pytest.importorskip("vllm")

from vllm_tfm.verify.gdn import gdn_chain_chunked, gdn_chain_recurrence  # noqa: E402
from vllm_tfm.vllm_plugin.fp32_prefill import fp32_chunk_gated_delta_rule, install_fp32_prefill  # noqa: E402


def _inputs(dtype: torch.dtype, lengths: list[int], h: int = 2, hv: int = 4, kd: int = 8, vd: int = 8):
    g = torch.Generator().manual_seed(0)
    t = sum(lengths)
    q = torch.randn(1, t, h, kd, generator=g).to(dtype)
    k = torch.randn(1, t, h, kd, generator=g).to(dtype)
    v = torch.randn(1, t, hv, vd, generator=g).to(dtype)
    gate = -torch.rand(1, t, hv, generator=g)
    beta = torch.rand(1, t, hv, generator=g)
    state = torch.randn(len(lengths), hv, vd, kd, generator=g)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist())
    return q, k, v, gate, beta, state, cu


def test_varlen_prefill_equals_per_sequence_recurrence() -> None:
    lengths = [3, 1, 5, 130]  # the last one spans three 64-token chunks
    q, k, v, gate, beta, state, cu = _inputs(torch.float32, lengths)
    out = torch.full((sum(lengths), 4, 8), float("nan"))
    o, final = fp32_chunk_gated_delta_rule(q, k, v, gate, beta, state, True, cu, True, out)
    for n, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        # the oracle in float64 on the same float32 inputs: the chunked form is float32 rounding away
        f64 = [x.double() for x in (q[0, s:e], k[0, s:e], v[0, s:e], gate[0, s:e], beta[0, s:e], state[n])]
        ref_o, ref_s = gdn_chain_recurrence(*f64)
        assert o.dtype == torch.float32 and final.dtype == torch.float32
        torch.testing.assert_close(o[0, s:e].double(), ref_o, rtol=1e-5, atol=2e-6)
        torch.testing.assert_close(final[n].double(), ref_s, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(out, o[0], rtol=0, atol=0)  # core_attn_out fully written


def test_patch_routes_only_float32() -> None:
    from vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn import ChunkGatedDeltaRule

    from vllm_tfm.vllm_plugin import patching

    install_fp32_prefill()
    install_fp32_prefill()  # idempotent
    assert patching.is_patched(ChunkGatedDeltaRule, "forward_native")
    calls = []
    orig = patching.original(ChunkGatedDeltaRule, "forward_native")
    key = next(k for k in patching.installed_patches() if k.endswith("ChunkGatedDeltaRule.forward_native"))
    patched = patching.installed_patches()[key].replacement
    assert patched.__wrapped__ is orig

    q, k, v, gate, beta, state, cu = _inputs(torch.float32, [4])
    o, final = patched(object(), q, k, v, gate, beta, state, True, cu)
    ref_o, ref_s = gdn_chain_chunked(q[0], k[0], v[0], gate[0], beta[0], state[0])
    torch.testing.assert_close(o[0], ref_o, rtol=0, atol=0)

    # bf16 goes to vLLM's original (replaced here by a recorder to avoid running Triton on CPU)
    patching.installed_patches()  # registry untouched by the call above
    import vllm_tfm.vllm_plugin.fp32_prefill as mod

    recorder = lambda self, *args: calls.append(args[0].dtype) or ("orig", None)  # noqa: E731
    wrapped = None
    for cell in patched.__closure__ or ():
        if cell.cell_contents is orig:
            wrapped = cell
    assert wrapped is not None, "the patch must close over vLLM's original forward_native"
    wrapped.cell_contents = recorder
    try:
        qb, kb, vb, gb, bb, sb, cub = _inputs(torch.bfloat16, [2])
        assert patched(object(), qb, kb, vb, gb, bb, sb, True, cub) == ("orig", None)
    finally:
        wrapped.cell_contents = orig
    assert calls == [torch.bfloat16]
    assert mod.fp32_chunk_gated_delta_rule is fp32_chunk_gated_delta_rule
