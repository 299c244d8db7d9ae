"""GPU: the Weaver scorer's fused linear-layer kernel (``cuda/weaver_linear.cu``) against the float64
function of the same stored values and the torch reference it replaces.

Run on the GPU host: ``python3 -m pytest tests/gpu/test_weaver_linear_gpu.py -q``. Fresh random
inputs at the 27B drafter's layer shapes (token_in 5120 -> 1024 and the query 1024 -> 5120 with
their norms, qkv with its rotate_half rows 1024 -> 6144, o_proj and down with the residual, gate_up
with SwiGLU) for M = 1, 2, 4, 16 rows in bfloat16 and float32, odd N; the dispatch takes the kernel
on CUDA up to 16 rows and cuBLAS above; and the Weaver's log-probabilities through the scorer's
kernels stay within bfloat16 rounding of the torch path at the 27B shape; launched with programmatic dependent
launch, a chain of dependent layers gives the outputs of plain launches bit for bit, eagerly and in a CUDA graph.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from _kernel_marks import CAPTURES_A_GRAPH
from _weaver27b import VOCAB, scorer_pair_27b

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))
from _linear_reference import float64_layer

from vllm_tfm.kernels import weaver_linear as kl

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = torch.device("cuda")
OUT_RTOL = {torch.float32: 0.0, torch.bfloat16: 2.0**-8}
# (K, N, mode) of the 27B drafter's Weaver (d_model 5120, d_rank 1024, d_mlp 3072)
LAYERS = [(5120, 1024, "norm"), (1024, 6144, "norm"), (1024, 1024, "residual"), (1024, 3072, "swiglu"),
          (3072, 1024, "residual"), (1024, 5120, "norm"), (264, 7, "norm")]


def problem(seed, m, k, n, dtype, mode):
    gen = torch.Generator(device=DEV).manual_seed(seed)
    rows = 2 * n if mode == "swiglu" else n
    x = (torch.randn(m, k, generator=gen, device=DEV) * 2).to(dtype)
    w = (torch.randn(rows, k, generator=gen, device=DEV) / k**0.5).to(dtype)
    b = (torch.randn(rows, generator=gen, device=DEV) * 0.5).to(dtype) if mode != "residual" else None
    res = torch.randn(m, n, generator=gen, device=DEV).to(dtype) if mode == "residual" else None
    eps = 1e-6 if mode != "residual" else None
    return x, w, b, res, eps, mode == "swiglu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("layer", range(len(LAYERS)))
def test_matches_float64(dtype, layer: int) -> None:
    k, n, mode = LAYERS[layer]
    for m in (1, 2, 4, 16):
        args = problem(layer * 100 + m, m, k, n, dtype, mode)
        reason = kl.unsupported_reason(*args)
        assert reason is None if m <= kl.KERNEL_ROWS else kl.TOO_MANY_ROWS in reason
        y = kl.weaver_linear_kernel(*args)
        exact, scale = float64_layer(*args)
        err = (y.double() - exact).abs()
        bound = 1e-5 * scale + OUT_RTOL[dtype] * exact.abs() + 1e-30
        assert bool((err <= bound).all()), (m, k, n, mode, float((err / bound).max()))
        ref = kl.weaver_linear_reference(*args).double()
        assert bool(((y.double() - ref).abs() <= (4 * OUT_RTOL[dtype] + 1e-4) * (scale + exact.abs())).all())


def test_every_e4m3_byte_decodes_exactly_on_the_gpu() -> None:
    """The sm_89+ decode (one cvt.rn.f16x2.e4m3x2 per two bytes): all 254 finite e4m3 codes against one-hot rows."""
    codes = torch.arange(256, dtype=torch.uint8, device=DEV)
    codes[(codes == 0x7F) | (codes == 0xFF)] = 0
    w8 = codes.view(torch.float8_e4m3fn).view(16, 16)
    y = kl.weaver_linear_kernel(torch.eye(16, device=DEV), w8, None, None, None, False, torch.ones(16, device=DEV))
    assert torch.equal(y, w8.float().t())


@pytest.mark.parametrize("layer", range(len(LAYERS)))
def test_fp8_weights_match_float64(layer: int) -> None:
    """Weight-only FP8 at the 27B Weaver's layers, M = 1, 2, 4, 16 (the source's limit), bfloat16 activations: the
    function of the dequantized weights to float32 rounding plus one bfloat16 rounding; the input rows gathered from a
    table by clamped ids give the same bits as the rows themselves."""
    k, n, mode = LAYERS[layer]
    k += (-k) % 16  # FP8 rows: K a multiple of 16 (264 -> 272)
    for m in (1, 2, 4, kl.MAX_ROWS):
        x, w, b, res, eps, swiglu = problem(layer * 100 + m + 7, m, k, n, torch.bfloat16, mode)
        w8, scale = kl.quantize_weight_rows(w)
        reason = kl.unsupported_reason(x, w8, b, res, eps, swiglu, scale)
        assert reason is None if m <= kl.FP8_KERNEL_ROWS else kl.TOO_MANY_ROWS in reason
        y = kl.weaver_linear_kernel(x, w8, b, res, eps, swiglu, scale)
        exact, bound_scale = float64_layer(x, w8.double() * scale.double()[:, None], b, res, eps, swiglu)
        err = (y.double() - exact).abs()
        bound = 1e-5 * bound_scale + OUT_RTOL[torch.bfloat16] * exact.abs() + 1e-30
        assert bool((err <= bound).all()), (m, k, n, mode, float((err / bound).max()))
        table = torch.cat([torch.zeros_like(x[:1]), x])  # x's rows are table rows 1..m; id -5 reads row 0
        ids = torch.arange(1, m + 1, device=DEV)
        assert torch.equal(kl.weaver_linear_kernel(table, w8, b, res, eps, swiglu, scale, ids), y)
        ids[0] = -5
        got = kl.weaver_linear_kernel(table, w8, b, res, eps, swiglu, scale, ids)
        assert torch.equal(got[1:], y[1:]) and not torch.equal(got[:1], y[:1])


def test_dispatch_rows() -> None:
    args = problem(1, kl.KERNEL_ROWS, 1024, 1024, torch.bfloat16, "residual")
    assert torch.equal(kl.weaver_linear(*args), kl.weaver_linear_kernel(*args))  # deterministic: the kernel ran
    big = problem(2, kl.KERNEL_ROWS + 1, 1024, 1024, torch.bfloat16, "residual")
    assert kl.TOO_MANY_ROWS in kl.unsupported_reason(*big)
    assert torch.equal(kl.weaver_linear(*big), kl.weaver_linear_reference(*big))


@pytest.mark.parametrize("fp8", [False, True])
def test_weaver_scorer_at_the_27b_shape(fp8: bool) -> None:
    """The kernel path's log-probabilities against the torch path's (with weight-only FP8: both on the e4m3 rows'
    values, the kernel reading the bytes and the embedding rows gathered in the token_in layer)."""
    r, w = 2, 2
    scorers = scorer_pair_27b(r, fp8=fp8)
    node = torch.zeros(r, w, dtype=torch.long, device=DEV)
    parent = torch.full_like(node, -1)
    tok = torch.randint(0, VOCAB, (r, w), device=DEV)
    valid = torch.tensor([[True, False]] * r, device=DEV)
    with torch.inference_mode():
        ref, got = (s(node, parent, tok, torch.zeros_like(node), valid) for s in scorers)
        # a second call: children of the roots, attending to the roots' keys each path wrote
        node2 = torch.tensor([[1, 2]] * r, device=DEV)
        valid2 = torch.ones_like(valid)
        ref2, got2 = (s(node2, torch.zeros_like(node2), tok, torch.ones_like(node2), valid2) for s in scorers)
    for a, b in ((ref[:, 0], got[:, 0]), (ref2, got2)):
        p_ref, p_got = a.exp(), b.exp()
        assert float((p_ref - p_got).abs().sum(-1).max()) <= 0.05  # total variation of the 512-way softmax


def _dependent_chain(m: int, seed: int):
    """Three rounds of five layers, each reading the previous one's output (a 5120-column norm layer
    first, so its successor's early start has the longest predecessor to overlap)."""
    shapes = [(5120, 1024, "norm"), (1024, 3072, "swiglu"), (3072, 1024, "residual"), (1024, 1024, "residual"),
              (1024, 5120, "norm")] * 3
    layers = [problem(seed + i, m, k, n, torch.bfloat16, mode) for i, (k, n, mode) in enumerate(shapes)]
    x0 = layers[0][0].clone()

    def run(x: torch.Tensor) -> list[torch.Tensor]:
        outs = []
        for j in range(0, len(layers), 5):
            a, b, c, d, e = layers[j: j + 5]
            h1 = kl.weaver_linear_kernel(x, a[1], a[2], None, a[4], False)
            h2 = kl.weaver_linear_kernel(h1, b[1], b[2], None, b[4], True)
            h3 = kl.weaver_linear_kernel(h2, c[1], None, h1, None, False)
            h4 = kl.weaver_linear_kernel(h3, d[1], None, h3, None, False)
            x = kl.weaver_linear_kernel(h4, e[1], e[2], None, e[4], False)
            outs += [h1, h2, h3, h4, x]
        return outs

    return run, x0


@CAPTURES_A_GRAPH
@pytest.mark.parametrize("m", [1, 4])
def test_programmatic_launch_keeps_dependent_layers_in_order(monkeypatch, m: int) -> None:
    """The kernel launched with programmatic dependent launch (its weights loaded before it waits for
    the previous kernel) gives, eagerly and replayed from a CUDA graph with new inputs, the outputs of
    the same kernels launched without it, bit for bit, on a chain where every layer reads the last."""
    run, x0 = _dependent_chain(m, 700 + m)
    monkeypatch.setenv(kl.PDL_SWITCH, "0")
    plain = run(x0)
    x1 = torch.randn_like(x0)
    plain1 = run(x1)
    monkeypatch.setenv(kl.PDL_SWITCH, "1")
    seen: list[bool] = []
    real_launch = kl.launch

    def spy(*args, **kwargs):
        seen.append(bool(kwargs.get("programmatic")))
        return real_launch(*args, **kwargs)

    monkeypatch.setattr(kl, "launch", spy)
    eager = run(x0)
    assert seen and all(seen)
    assert all(torch.equal(p, q) for p, q in zip(plain, eager))
    static_x = x0.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run(static_x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(static_x)
    for x, want in ((x1, plain1), (x0, plain), (x1, plain1)):
        static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(p, q) for p, q in zip(want, captured))
