"""The tf32 tensor-core primitives of ``cuda/tfm_mma.cuh`` (``tf32_rna``, ``split_tf32``,
``mma_1688_tf32``) through the CPU emulation (cuda/host_emu), against float64 arithmetic.

The check kernel ``cuda/tfm_mma_check.cu`` builds the m16n8k8 fragments from row-major matrices
with the PTX ISA's layout, so a wrong fragment layout in the emulation (or in the kernel) shows
up as a wrong product. The same kernel runs on the GPU in tests/gpu/test_kernels_gdn.py.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vllm_tfm.kernels import loader

CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed for the CPU emulation")


def tf32_round_reference(x: torch.Tensor) -> torch.Tensor:
    """Round float32 to tf32 (10 mantissa bits), nearest with ties away from zero, in float64.

    Independent of the bit trick: scale each value's binade to an integer grid of 2^-10 ulps and
    round half away from zero there.
    """
    xd = x.double()
    mant, expo = torch.frexp(xd)  # xd = mant * 2^expo, 0.5 <= |mant| < 1
    scaled = mant * 2.0**11  # 11 significant bits: the implicit one and 10 stored
    rounded = torch.sign(scaled) * torch.floor(scaled.abs() + 0.5)
    return torch.ldexp(rounded / 2.0**11, expo)


def _bits_to_float(u: torch.Tensor) -> torch.Tensor:
    return u.to(torch.int64).to(torch.int32).view(torch.float32)


def _run_check(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, tmp: Path):
    sys.path.insert(0, str(CUDA_DIR / "host_emu"))
    try:
        from emulate import emulated_kernels
    finally:
        sys.path.pop(0)
    d1, d3 = torch.full((16, 8), float("nan")), torch.full((16, 8), float("nan"))
    hi, lo = torch.zeros(16, 8, dtype=torch.int32), torch.zeros(16, 8, dtype=torch.int32)
    try:
        with emulated_kernels(tmp):
            kern = loader.get_kernel("tfm_mma_check.cu", "tfm_mma_tf32_check", ["--std=c++17"], 0)
            loader.launch(kern, (1, 1, 1), (32, 1, 1), [a.contiguous(), b.contiguous(), c.contiguous(), d1, d3, hi, lo])
    except subprocess.CalledProcessError as exc:  # a compiler without C++20 <barrier>
        pytest.skip(f"g++ could not build the emulation: {exc.stderr[:300]}")
    return d1, d3, hi.view(torch.float32), lo.view(torch.float32)


def test_tf32_rounding_is_nearest_ties_away_from_zero(tmp_path):
    one = 1.0
    ulp = 2.0**-10  # tf32 spacing in [1, 2)
    special = [
        (one + ulp / 2, one + ulp),  # tie: away from zero
        (-(one + ulp / 2), -(one + ulp)),
        (one + 5 * ulp / 2, one + 3 * ulp),  # tie from an even neighbour: away (to even would give 1 + 2 ulp)
        (one + ulp / 2 - 2.0**-23, one),  # just below the tie
        (2.0 - 2.0**-23, 2.0),  # carry into the exponent
        (3.4028234663852886e38, float("inf")),  # the largest float rounds past the largest tf32
        (float("inf"), float("inf")),
        (-float("inf"), -float("inf")),
        (0.0, 0.0),
        (2.0**-130, 2.0**-130),  # subnormal with few bits: exact
    ]
    a = torch.zeros(16, 8)
    for i, (x, _) in enumerate(special):
        a.view(-1)[i] = x
    a.view(-1)[len(special)] = float("nan")
    gen = torch.Generator().manual_seed(1)
    rest = a.view(-1)[len(special) + 1:]
    rest.copy_(torch.randn(rest.numel(), generator=gen) * torch.exp2(torch.randint(-20, 20, (rest.numel(),), generator=gen).float()))
    _, _, hi, lo = _run_check(a, torch.eye(8), torch.zeros(16, 8), tmp_path)
    flat_hi = hi.reshape(-1)
    for i, (_, want) in enumerate(special):
        assert flat_hi[i].item() == want, (i, special[i], flat_hi[i].item())
    assert flat_hi[len(special)].isnan()
    n0 = len(special) + 1
    assert torch.equal(flat_hi[n0:].double(), tf32_round_reference(a.view(-1)[n0:]))
    assert (hi.view(torch.int32) & 0x1FFF).eq(0).all() and (lo.view(torch.int32) & 0x1FFF).eq(0).all()
    # hi + lo recovers x to ~2^-21 relative (lo is itself rounded to tf32)
    x = a.view(-1)[n0:].double()
    err = (flat_hi[n0:].double() + lo.reshape(-1)[n0:].double() - x).abs() / x.abs()
    assert err.max() <= 2.0**-21
    assert torch.equal(lo.reshape(-1)[n0:].double(), tf32_round_reference(a.view(-1)[n0:] - flat_hi[n0:]))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mma_1688_tf32_and_3xtf32_match_float64_matmuls(tmp_path, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(16, 8, generator=gen)
    b = torch.randn(8, 8, generator=gen)
    c = torch.randn(16, 8, generator=gen)
    if seed == 2:  # widely spread magnitudes per row / column
        a *= torch.exp2(torch.randint(-8, 8, (16, 1), generator=gen).float())
        b *= torch.exp2(torch.randint(-8, 8, (1, 8), generator=gen).float())
    d1, d3, _, _ = _run_check(a, b, c, tmp_path)
    # one tf32 mma: exact products of the rounded operands, float32 accumulation
    want1 = c.double() + tf32_round_reference(a) @ tf32_round_reference(b)
    scale = (c.double().abs() + tf32_round_reference(a).abs() @ tf32_round_reference(b).abs())
    assert ((d1.double() - want1).abs() / scale).max() <= 2.0**-22
    # it is not the float32 product: tf32 loses ~2^-11 per operand
    exact = c.double() + a.double() @ b.double()
    assert ((d1.double() - exact).abs() / scale).max() > 2.0**-16
    # 3xTF32: float32-accurate products
    scale3 = c.double().abs() + a.double().abs() @ b.double().abs()
    assert ((d3.double() - exact).abs() / scale3).max() <= 1e-6
    assert float((d3.double() - exact).norm() / exact.norm()) <= 1e-6
