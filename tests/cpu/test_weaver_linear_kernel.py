"""The Weaver scorer's fused linear-layer kernel (``cuda/weaver_linear.cu`` behind
``vllm_tfm.kernels.weaver_linear``) on the CPU through the CUDA emulation (``cuda/host_emu``):
against the float64 function of the same stored values (norm, bias, residual, SwiGLU) and the
torch reference, on fresh random inputs in float32 / bfloat16 / float16, M from 1 to 16 rows, odd N,
K not a multiple of 256, strided rows; through ``BatchedWeaverTreeScorer`` (its log-probabilities
equal the torch path's to the activation dtype's rounding); and which inputs the kernel takes."""

from __future__ import annotations

import random
from pathlib import Path
from unittest import mock

import pytest
import torch
from _emulation import emulated, emulation_build_dir
from _linear_reference import float64_layer
from _tiny_scorers import VOCAB, tiny_scorer_pair

from vllm_tfm.kernels import candidate_scores as kc
from vllm_tfm.kernels import weaver_linear as kl

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
OUT_RTOL = {torch.float32: 0.0, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}  # one output rounding


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return emulation_build_dir(tmp_path_factory, "emu_linear")


def problem(seed, m, k, n, dtype, *, bias=True, residual=False, swiglu=False, x_pad=0):
    gen = torch.Generator().manual_seed(seed)
    rows = 2 * n if swiglu else n
    x = (torch.randn(m, k + x_pad, generator=gen) * 2).to(dtype)[:, :k]
    w = (torch.randn(rows, k, generator=gen) / k**0.5).to(dtype)
    b = (torch.randn(rows, generator=gen) * 0.5).to(dtype) if bias else None
    res = torch.randn(m, n, generator=gen).to(dtype) if residual else None
    return x, w, b, res


def check(got, exact, scale, dtype) -> None:
    err = (got.double() - exact).abs()
    bound = 1e-5 * scale + OUT_RTOL[dtype] * exact.abs() + 1e-30
    assert bool((err <= bound).all()), float((err / bound).max())


def run(emu_dir, *args):
    with emulated(emu_dir) as launches:
        y = kl.weaver_linear_kernel(*args)
    return y, launches


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["norm_bias", "residual", "swiglu", "plain"])
def test_matches_float64(emu_dir: Path, dtype, mode: str) -> None:
    for i, (m, k, n) in enumerate([(1, 8, 1), (2, 264, 7), (5, 64, 33)]):
        swiglu, residual = mode == "swiglu", mode == "residual"
        eps = None if mode in ("residual", "plain") else 1e-6
        x, w, b, res = problem(i, m, k, n, dtype, bias=mode in ("norm_bias", "swiglu"), residual=residual, swiglu=swiglu)
        reason = kl.unsupported_reason(x, w, b, res, eps, swiglu)
        assert reason == kl.NOT_CUDA if m <= kl.KERNEL_ROWS else kl.TOO_MANY_ROWS in reason
        y, launches = run(emu_dir, x, w, b, res, eps, swiglu)
        units = n if swiglu else (n + 1) // 2
        assert launches == [("weaver_linear", (-(-units * kl.k_split(units, k) // kl.WARPS), 1, 1), 0)]
        assert y.shape == (m, n) and y.dtype == dtype
        exact, scale = float64_layer(x, w, b, res, eps, swiglu)
        check(y, exact, scale, dtype)
        # the reference rounds the normalised x and z to the dtype too: within a few roundings
        ref = kl.weaver_linear_reference(x, w, b, res, eps, swiglu).double()
        assert bool(((y.double() - ref).abs() <= (4 * OUT_RTOL[dtype] + 1e-5) * (scale + exact.abs())).all())


def test_sixteen_rows_and_strided_x(emu_dir: Path) -> None:
    """M = 16 (every lane of the epilogue writes), x rows with a padded stride."""
    for swiglu in (False, True):
        x, w, b, _ = problem(9, 16, 136, 19, torch.bfloat16, swiglu=swiglu, x_pad=8)
        assert x.stride(0) == 144
        y, _ = run(emu_dir, x, w, b, None, 1e-5, swiglu)
        check(y, *float64_layer(x, w, b, None, 1e-5, swiglu), torch.bfloat16)


@pytest.mark.parametrize("split", [1, 2, 4])
def test_several_groups_of_weight_loads_at_each_k_split(emu_dir: Path, monkeypatch, split: int) -> None:
    """K past one group of weight loads (4 steps of 256 columns per warp): one group, one group and
    a partial step, two groups and a partial step, with each unit's K split over 1, 2 or 4 warps
    (partial sums gathered in shared memory); the norm's sum of squares split over the block's
    warps by step; N leaving warps past the last unit (they sum squares and write nothing)."""
    monkeypatch.setattr(kl, "k_split", lambda units, k, step=256: split)
    cases = [(3, 1024 * split, 9, False, torch.float32), (1, 1032 * split, 5, True, torch.float32),
             (4, 2312, 11, False, torch.float32), (2, 2312, 3, True, torch.bfloat16), (2, 264, 9, False, torch.float32)]
    past_the_end = []
    for i, (m, k, n, swiglu, dtype) in enumerate(cases):
        x, w, b, _ = problem(70 + i, m, k, n, dtype, swiglu=swiglu)
        y, launches = run(emu_dir, x, w, b, None, 1e-6, swiglu)
        units = n if swiglu else (n + 1) // 2
        assert launches[0][1] == (-(-units * split // kl.WARPS), 1, 1)
        past_the_end.append(units % (kl.WARPS // split) != 0)
        check(y, *float64_layer(x, w, b, None, 1e-6, swiglu), dtype)
        res = problem(80 + i, m, k, (n + 1) // 2 * 2, dtype, residual=True)  # the residual epilogue too
        y, _ = run(emu_dir, res[0], res[1], None, res[3], None, False)
        check(y, *float64_layer(res[0], res[1], None, res[3], None, False), dtype)
    assert any(past_the_end) or split == 4  # some last block has warps past the last unit


def test_k_split_at_the_27b_weaver_shapes() -> None:
    """Layers with few units and a long K get 4 warps per unit; wide layers one; never a warp
    without a step of 256 columns."""
    shapes = {"token_in": (512, 5120, 4), "down": (512, 3072, 4), "o_proj": (512, 1024, 4), "qkv": (3072, 1024, 1),
              "gate_up": (3072, 1024, 1), "query": (2560, 1024, 1), "short K": (16, 264, 2), "one step": (16, 200, 1)}
    for name, (units, k, want) in shapes.items():
        assert kl.k_split(units, k) == want, name


def test_fresh_random_shapes(emu_dir: Path) -> None:
    rng = random.Random(11)
    for i in range(5):
        m, k, n = rng.randint(1, 16), 8 * rng.randint(1, 50), rng.randint(1, 40)
        dtype, swiglu = rng.choice(DTYPES), rng.random() < 0.4
        residual = not swiglu and rng.random() < 0.5
        eps = rng.choice([None, 1e-6])
        args = problem(50 + i, m, k, n, dtype, bias=rng.random() < 0.6, residual=residual, swiglu=swiglu)
        y, _ = run(emu_dir, *args, eps, swiglu)
        check(y, *float64_layer(*args, eps, swiglu), dtype)


def test_weaver_scorer_through_the_kernels(emu_dir: Path) -> None:
    """BatchedWeaverTreeScorer(score_kernel=True) runs every linear layer and the candidate scores
    through the kernels (3 + 4 per layer + 1 launches per call) and gives the torch path's
    log-probabilities to float32 rounding."""
    pair = tiny_scorer_pair(1, 2)  # norms with non-trivial weights and biases
    scorers, cfg = pair[:2], pair.config
    calls = [
        (torch.tensor([[0], [0]]), torch.tensor([[-1], [-1]]), torch.tensor([[5], [9]]), torch.tensor([[0], [0]])),
        (torch.tensor([[1], [1]]), torch.tensor([[0], [0]]), torch.tensor([[7], [3]]), torch.tensor([[1], [1]])),
    ]
    with (emulated(emu_dir) as launches, mock.patch.object(kc, "unsupported_reason", lambda *a: None),
          mock.patch.object(kl, "unsupported_reason", lambda *a: None)):
        for node, parent, tok, dep in calls:
            valid = torch.ones_like(node, dtype=torch.bool)
            ref, got = (s(node, parent, tok, dep, valid) for s in scorers)
            assert torch.allclose(got, ref, rtol=0, atol=2e-5)
    per_call = ["weaver_linear"] * (1 + 4 * cfg.n_layers + 1) + ["candidate_scores"]
    assert [name for name, *_ in launches] == per_call * len(calls)


def test_which_inputs_the_kernel_takes() -> None:
    x, w, b, res = problem(1, 2, 16, 4, torch.bfloat16, residual=True)
    assert kl.unsupported_reason(x, w, b, res, None, False) == kl.NOT_CUDA
    assert "one of float32, bfloat16, float16" in kl.unsupported_reason(x.double(), w.double(), None, None, None, False)
    assert "one of float32" in kl.unsupported_reason(x, w.float(), None, None, None, False)
    big = torch.zeros(kl.KERNEL_ROWS + 1, 16, dtype=torch.bfloat16)
    assert kl.TOO_MANY_ROWS in kl.unsupported_reason(big, w, None, None, None, False)
    assert "not a multiple of 8" in kl.unsupported_reason(x[:, :12], w[:, :12], None, None, None, False)
    assert "SwiGLU" in kl.unsupported_reason(x, w[:3], None, None, 1e-6, True)
    assert "residual shape" in kl.unsupported_reason(x, w, None, res[:, :3], None, False)
    assert "bias shape" in kl.unsupported_reason(x, w, b[:3], None, None, False)
    odd = torch.empty(2 * 16 + 1, dtype=torch.bfloat16)[1:].view(2, 16)
    assert "16-byte aligned" in kl.unsupported_reason(odd, w, None, None, None, False)
    assert "residual's rows" in kl.unsupported_reason(x, w, None, res.t().contiguous().t(), None, False)


def test_dispatch_uses_the_reference_off_cuda_and_when_switched_off(monkeypatch) -> None:
    args = problem(2, 3, 16, 5, torch.float32, residual=True)
    with pytest.raises(ValueError, match="SwiGLU takes no residual"):
        kl.weaver_linear(*args, 1e-6, True)
    with mock.patch.object(kl, "weaver_linear_kernel", side_effect=AssertionError("no launch")):
        assert torch.equal(kl.weaver_linear(*args, None, False), kl.weaver_linear_reference(*args, None, False))
        monkeypatch.setenv(kl.ENV_SWITCH, "0")
        with mock.patch.object(kl, "unsupported_reason", lambda *a: None):
            assert torch.equal(kl.weaver_linear(*args, None, False), kl.weaver_linear_reference(*args, None, False))


def test_scorer_kernel_path_is_the_torch_path_where_no_kernel_runs() -> None:
    """Where the kernels do not take the tensors (here: CPU; on CUDA: more than KERNEL_ROWS rows),
    the scorer's kernel path falls back to references that are the torch path's own ops: the same
    log-probabilities bit for bit, so the row limit changes no scores."""
    r, vocab = 3, VOCAB
    scorers = tiny_scorer_pair(2, r)[:2]
    w = 2  # R x w = 6 > KERNEL_ROWS rows
    assert r * w > kl.KERNEL_ROWS
    node = torch.zeros(r, w, dtype=torch.long)
    node[:, 1] = 7
    args = (node, torch.full_like(node, -1), torch.randint(0, vocab, (r, w)), torch.zeros_like(node),
            torch.tensor([[True, False]] * r))
    ref, got = (s(*args) for s in scorers)
    assert torch.equal(got[:, 0], ref[:, 0])


def fp8_problem(seed, m, k, n, dtype, *, swiglu=False, residual=False):
    """``problem`` with the weight quantized to e4m3 with row scales; (x, w8, b, res, scale, dequantized float64 w)."""
    x, w, b, res = problem(seed, m, k, n, dtype, bias=not residual, residual=residual, swiglu=swiglu)
    w8, scale = kl.quantize_weight_rows(w.float() * (1 + torch.arange(w.shape[0])[:, None] % 7))  # row ranges differ
    return x, w8, b, res, scale, w8.double() * scale.double()[:, None]


def test_every_e4m3_byte_decodes_exactly(emu_dir: Path) -> None:
    """All 254 finite e4m3 bytes (subnormals, +-0, +-448) as weights against one-hot activation rows: each output is
    one weight's value times its row scale 1, exactly (float32)."""
    codes = torch.arange(256, dtype=torch.uint8)
    codes[(codes == 0x7F) | (codes == 0xFF)] = 0  # NaN codes: weights are finite by construction
    w8 = codes.view(torch.float8_e4m3fn).view(16, 16)
    x = torch.eye(16)
    y, launches = run(emu_dir, x, w8, None, None, None, False, torch.ones(16))
    assert launches[0][0] == "weaver_linear"
    assert torch.equal(y, w8.float().t())


@pytest.mark.parametrize("split", [1, 2, 4])
def test_fp8_weights_match_float64(emu_dir: Path, monkeypatch, split: int) -> None:
    """Weight-only FP8 (e4m3 with one scale per row): the function of the dequantized weights, in every epilogue, with K
    past one group of 4 steps of 512 columns and partial steps at each K split, 16 rows; the torch reference within
    one rounding."""
    monkeypatch.setattr(kl, "k_split", lambda units, k, step=256: split)
    cases = [(2, 2320, 9, "norm_bias", torch.bfloat16), (1, 272, 5, "swiglu", torch.float32),
             (16, 1040, 6, "residual", torch.float16), (3, 8208, 3, "swiglu", torch.bfloat16)]
    for i, (m, k, n, mode, dtype) in enumerate(cases):
        swiglu, residual = mode == "swiglu", mode == "residual"
        eps = None if residual else 1e-6
        x, w8, b, res, scale, wd = fp8_problem(90 + i, m, k, n, dtype, swiglu=swiglu, residual=residual)
        reason = kl.unsupported_reason(x, w8, b, res, eps, swiglu, scale)
        assert reason == kl.NOT_CUDA if m <= kl.FP8_KERNEL_ROWS else kl.TOO_MANY_ROWS in reason
        y, _ = run(emu_dir, x, w8, b, res, eps, swiglu, scale)  # the source takes up to MAX_ROWS
        assert y.dtype == dtype and y.shape == (m, n)
        exact, bound_scale = float64_layer(x, wd, b, res, eps, swiglu)
        check(y, exact, bound_scale, dtype)
        ref = kl.weaver_linear_reference(x, w8, b, res, eps, swiglu, scale).double()
        assert bool(((y.double() - ref).abs() <= (4 * OUT_RTOL[dtype] + 1e-5) * (bound_scale + exact.abs())).all())


def test_rows_gather_from_a_table_with_clamped_ids(emu_dir: Path) -> None:
    """rows: the layer's input rows are gathered from x (a table) by id, ids outside the table clamped to its ends;
    with 16-bit and FP8 weights, and the norm's sums over the gathered rows."""
    gen = torch.Generator().manual_seed(5)
    table = torch.randn(40, 528, generator=gen).to(torch.bfloat16)
    ids = torch.tensor([7, -3, 39, 1000])
    picked = table[torch.tensor([7, 0, 39, 39])]
    w = (torch.randn(11, 528, generator=gen) / 528**0.5).to(torch.bfloat16)
    b = torch.randn(11, generator=gen).to(torch.bfloat16)
    y, _ = run(emu_dir, table, w, b, None, 1e-6, False, None, ids)
    assert y.shape == (4, 11)
    check(y, *float64_layer(picked, w, b, None, 1e-6, False), torch.bfloat16)
    assert torch.equal(kl.weaver_linear_reference(table, w, b, None, 1e-6, False, None, ids),
                       kl.weaver_linear_reference(picked, w, b, None, 1e-6, False))
    w8, scale = kl.quantize_weight_rows(w)
    y8, _ = run(emu_dir, table, w8, b, None, 1e-6, False, scale, ids)
    check(y8, *float64_layer(picked, w8.double() * scale.double()[:, None], b, None, 1e-6, False), torch.bfloat16)


def test_fp8_and_rows_inputs_the_kernel_takes() -> None:
    x, w8, b, res, scale, _ = fp8_problem(3, 2, 16, 4, torch.bfloat16, residual=True)
    with pytest.raises(ValueError, match="comes with weight_scale"):
        kl.unsupported_reason(x, w8, None, res, None, False)
    with pytest.raises(ValueError, match="comes with weight_scale"):
        kl.weaver_linear_reference(x, w8.float(), None, res, None, False, scale)
    with pytest.raises(ValueError, match=r"weight_scale must be float32 \[4\]"):
        kl.weaver_linear(x, w8, None, res, None, False, scale[:3])
    many = torch.zeros(kl.FP8_KERNEL_ROWS, 16, dtype=torch.bfloat16)
    assert kl.KERNEL_ROWS <= kl.FP8_KERNEL_ROWS <= kl.MAX_ROWS
    assert kl.unsupported_reason(many, w8, None, None, None, False, scale) == kl.NOT_CUDA
    more = torch.zeros(kl.FP8_KERNEL_ROWS + 1, 16, dtype=torch.bfloat16)
    assert kl.TOO_MANY_ROWS in kl.unsupported_reason(more, w8, None, None, None, False, scale)
    with pytest.raises(ValueError, match="rows index an empty table"):
        kl.weaver_linear(x[:0], w8, None, None, None, False, scale, torch.tensor([0]))
    assert "multiple of 16" in kl.unsupported_reason(x[:, :8], w8[:, :8].contiguous(), None, None, None, False, scale)
    assert "int64 [M]" in kl.unsupported_reason(x, w8, None, None, None, False, scale, torch.tensor([0, 1], dtype=torch.int32))
    table = torch.zeros(100, 16, dtype=torch.bfloat16)  # rows count against the limit, not the table
    assert kl.unsupported_reason(table, w8, None, None, None, False, scale, torch.tensor([0, 99])) == kl.NOT_CUDA
    w8q, sq = kl.quantize_weight_rows(torch.tensor([[1.0, -2.0], [0.0, 0.0]]))
    assert torch.equal(w8q.float() * sq[:, None], torch.tensor([[1.0, -2.0], [0.0, 0.0]]))  # exact where representable
    assert float(sq[0]) == float(torch.tensor(2.0 / 448, dtype=torch.float32)) and w8q.dtype == torch.float8_e4m3fn


def test_weaver_scorer_with_fp8_weights_through_the_kernels(emu_dir: Path) -> None:
    """Weaver.fp8_weights: the kernel path reads the e4m3 rows (every linear launch gets a float8 weight) and gives
    the torch path's log-probabilities (which compute with the rounded values) to float32 rounding; both differ
    from the unrounded Weaver's by more than that (the rounding took effect)."""
    calls = [
        (torch.tensor([[0], [0]]), torch.tensor([[-1], [-1]]), torch.tensor([[5], [VOCAB + 9]]), torch.tensor([[0], [0]])),
        (torch.tensor([[1], [1]]), torch.tensor([[0], [0]]), torch.tensor([[7], [-3]]), torch.tensor([[1], [1]])),
    ]
    plain = tiny_scorer_pair(1, 2)[0]
    pair = tiny_scorer_pair(1, 2, fp8=True)
    weights = []
    real = kl.weaver_linear_kernel

    def spy(*args):
        weights.append(args[1].dtype)
        return real(*args)

    with (emulated(emu_dir), mock.patch.object(kc, "unsupported_reason", lambda *a: None),
          mock.patch.object(kl, "unsupported_reason", lambda *a: None), mock.patch.object(kl, "weaver_linear_kernel", spy)):
        for node, parent, tok, dep in calls:
            valid = torch.ones_like(node, dtype=torch.bool)
            ref, got, unrounded = (s(node, parent, tok, dep, valid) for s in (pair[0], pair[1], plain))
            assert torch.allclose(got, ref, rtol=0, atol=2e-5)
            assert float((ref - unrounded).abs().max()) > 1e-3
    assert weights and all(dt == torch.float8_e4m3fn for dt in weights)
    assert len(weights) == len(calls) * (2 + 4 * pair.config.n_layers)
