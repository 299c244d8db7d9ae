"""The GDN layer's tree path after the per-layer host-work cut equals its previous version bit for bit.

The previous ``spec_tree_gdn`` / ``_tree_step_forward_core`` / ``gdn_gates`` are frozen in
``_gdn_before.py``. Compared here: the layer's outputs (``core_attn_out``) and everything it stashes
for the commit, on the torch references (what a CPU runs) and on the kernel path with the CUDA
kernels run on the CPU through ``cuda/host_emu`` (what a GPU runs: one copy for q and k, o written
into ``core_attn_out`` by the verify kernel, the gates' layer constants computed once).
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import pytest
import torch

import _gdn_before as before
from _gdn_layer import LayerCase, assert_same_layer_outcome, forward_context, random_trees, run_layer
from vllm_tfm.kernels import conv as kconv
from vllm_tfm.kernels import gdn as kgdn
from vllm_tfm.kernels import loader
from vllm_tfm.verify.gdn import gate_constants, gdn_gates
from vllm_tfm.vllm_plugin.runtime import gdn as gdn_mod
from vllm_tfm.vllm_plugin.runtime import step_kernels as sk
from vllm_tfm.vllm_plugin.runtime.kernels_or_reference import set_kernels_enabled

pytestmark = pytest.mark.usefixtures("one_thread")
CUDA_DIR = Path(__file__).resolve().parents[2] / "cuda"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_gates_with_layer_constants_equal_the_previous_gates(dtype):
    g = torch.Generator().manual_seed(3)
    a = (8 * torch.randn(50, 6, generator=g)).to(dtype)  # some a + dt_bias past softplus's threshold 20
    a[0, 0] = 30.0
    b = torch.randn(50, 6, generator=g).to(dtype)
    a_log = torch.rand(6, generator=g).log()
    dt_bias = torch.randn(6, generator=g).to(torch.bfloat16)
    want = before.gdn_gates_before(a, b, a_log, dt_bias)
    for constants in (None, gate_constants(a_log, dt_bias), gate_constants(a_log, dt_bias, torch.float64)):
        got = gdn_gates(a, b, a_log, dt_bias, constants)
        for x, y in zip(got, want):
            assert x.dtype == y.dtype and torch.equal(x, y)
    with pytest.raises(ValueError, match=r"A_log and dt_bias must have shape \[HV=6\]"):
        gdn_gates(a, b, a_log[:5], dt_bias, gate_constants(a_log, dt_bias))


def test_layer_gate_constants_follow_an_in_place_weight_update():
    a_log, dt_bias = torch.nn.Parameter(torch.rand(4).log()), torch.nn.Parameter(torch.randn(4).bfloat16())
    first = gdn_mod._gate_constants(a_log, dt_bias)
    assert gdn_mod._gate_constants(a_log, dt_bias) is first  # once per layer
    with torch.no_grad():
        a_log.copy_(torch.rand(4).log())  # a weight reload writes the parameters in place
        dt_bias.add_(1.0)
    second = gdn_mod._gate_constants(a_log, dt_bias)
    assert second is not first
    want = gate_constants(a_log.detach(), dt_bias.detach())
    assert all(torch.equal(x, y) for x, y in zip(second, want))
    with torch.inference_mode():  # inference tensors have no version counter: computed per call
        assert gdn_mod._gate_constants(torch.rand(4), torch.rand(4)) is None


@contextlib.contextmanager
def _reference_path() -> Iterator[None]:
    set_kernels_enabled(False)
    try:
        yield
    finally:
        set_kernels_enabled(True)


CASES = {
    "all_spec": {"sizes": [9, 1, 6, 4], "num_plain": 0},
    "mixed": {"sizes": [5, 7], "num_plain": 3},
    "one_request": {"sizes": [12], "num_plain": 0},
}


@pytest.mark.parametrize("piecewise", [True, False])
@pytest.mark.parametrize("name", list(CASES))
def test_reference_path_equals_the_previous_layer(name, piecewise):
    spec = CASES[name]
    case = LayerCase(random_trees(spec["sizes"], seed=5), num_plain=spec["num_plain"], seed=11, bias=name == "mixed")
    with _reference_path(), forward_context(case, piecewise), torch.inference_mode():
        want = run_layer(before.tree_step_forward_core_before, case)
        got = run_layer(gdn_mod._tree_step_forward_core, case)
    assert_same_layer_outcome(got, want)
    assert got[0].abs().sum() > 0  # the outputs were written


# ---------------------------------------------------------------------------------------------
# the kernel path, with the CUDA kernels run on the CPU (cuda/host_emu)


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed for the CPU emulation")
    return tmp_path_factory.mktemp("emu")


@contextlib.contextmanager
def _emulated_kernel_path(build_dir: Path) -> Iterator[tuple[list, dict]]:
    """The runtime's kernel path on CPU tensors: the step's kernel tables, the kernels' checks
    answering "supported", and the kernels themselves emulated on the CPU. Yields the launches made and
    the steps' kernel tables (clear them to start a new step)."""
    sys.path.insert(0, str(CUDA_DIR / "host_emu"))
    try:
        from emulate import emulated_kernels
    finally:
        sys.path.pop(0)
    tables: dict[int, sk.StepKernels] = {}

    def step_kernels(step, device):
        found = tables.get(id(step))
        if found is None or found.step is not step:
            found = tables[id(step)] = sk.StepKernels(step, device)
        return found

    try:
        with emulated_kernels(build_dir) as launches, contextlib.ExitStack() as stack:
            stack.enter_context(mock.patch.object(gdn_mod, "step_kernels", step_kernels))
            stack.enter_context(mock.patch.object(kgdn, "verify_unsupported_reason", lambda *a: None))
            stack.enter_context(mock.patch.object(kconv, "conv_unsupported_reason", lambda *a: None))
            stack.enter_context(mock.patch.object(loader, "device_smem_optin", lambda i: 227 * 1024))
            yield launches, tables
    except subprocess.CalledProcessError as exc:  # a compiler without C++20 <barrier>
        pytest.skip(f"g++ could not build the emulation: {exc.stderr[:300]}")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_path_equals_the_previous_layer_bit_for_bit(emu_dir, name, monkeypatch):
    spec = CASES[name]
    case = LayerCase(random_trees(spec["sizes"], seed=7), num_plain=spec["num_plain"], seed=13, bias=name == "mixed")
    monkeypatch.setenv("VLLM_TFM_GDN_VERIFY", "3")  # the previous layer's verify version, for bit equality
    # the separate prologue operations (the fused conv launch computes the gates with the C library's
    # expf / log1pf, torch's CPU ops with their own: ulps apart; test_fused_prologue_* below)
    monkeypatch.setattr(gdn_mod, "_prologue_extras", lambda *a: None)
    with _emulated_kernel_path(emu_dir) as (launches, tables), forward_context(case), torch.inference_mode():
        want = run_layer(before.tree_step_forward_core_before, case)
        assert [n for n, _, _ in launches] == ["tree_conv1d", "gdn_tree_pairs", "gdn_tree_verify_main"]
        got = run_layer(gdn_mod._tree_step_forward_core, case)
        assert [n for n, _, _ in launches[3:]] == ["tree_conv1d", "gdn_tree_pairs", "gdn_tree_verify_main"]
        # the default (auto): one request's grid is one wave, so these bf16 trees run version 6, one launch
        monkeypatch.delenv("VLLM_TFM_GDN_VERIFY")
        tables.clear()  # the setting is read once per step: a new step's tables
        got6 = run_layer(gdn_mod._tree_step_forward_core, case)
        assert [n for n, _, _ in launches[6:]] == ["tree_conv1d", "gdn_tree_verify_grouped"]
        # pinned to 7 (auto's choice on grids of more waves): version 7, one launch
        monkeypatch.setenv("VLLM_TFM_GDN_VERIFY", "7")
        tables.clear()
        got7 = run_layer(gdn_mod._tree_step_forward_core, case)
        assert [n for n, _, _ in launches[8:]] == ["tree_conv1d", "gdn_tree_verify_small"]
    assert_same_layer_outcome(got, want)
    # and it is the layer's function: the references' outputs, to bf16 rounding
    with _reference_path(), forward_context(case), torch.inference_mode():
        ref_out, _ = run_layer(gdn_mod._tree_step_forward_core, case)
    assert torch.allclose(got[0].float(), ref_out.float(), atol=3e-2, rtol=3e-2)
    assert torch.allclose(got6[0].float(), ref_out.float(), atol=3e-2, rtol=3e-2)
    assert torch.allclose(got7[0].float(), ref_out.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["all_spec", "mixed"])
@pytest.mark.parametrize("piecewise", [True, False])
def test_fused_prologue_writes_what_the_separate_operations_did(emu_dir, name, piecewise, monkeypatch):
    """The conv launch's extras (q and k blocks, the gates, the stash's copy of x) against the layer with
    the separate operations: the same launches otherwise, x and k bit for bit, the gates to float32
    ulps (CPU: the C library's expf / log1pf against torch's), outputs and deltas to that rounding."""
    spec = CASES[name]
    case = LayerCase(random_trees(spec["sizes"], seed=9), num_plain=spec["num_plain"], seed=17, bias=name == "mixed")
    calls = []
    real = gdn_mod._prologue_extras

    def counted(*a):
        calls.append(real(*a))
        return calls[-1]

    with _emulated_kernel_path(emu_dir) as (launches, tables), forward_context(case, piecewise), \
            torch.inference_mode():
        with mock.patch.object(gdn_mod, "_prologue_extras", lambda *a: None):
            want = run_layer(gdn_mod._tree_step_forward_core, case)
        n_before = len(launches)
        with mock.patch.object(gdn_mod, "_prologue_extras", counted):
            got = run_layer(gdn_mod._tree_step_forward_core, case)
    assert [n for n, _, _ in launches[n_before:]] == [n for n, _, _ in launches[:n_before]]
    assert len(calls) == 1 and calls[0] is not None  # the extras were taken
    (out, stash), (out0, stash0) = got, want
    assert torch.equal(stash.x, stash0.x) and torch.equal(stash.k, stash0.k)
    if piecewise and name == "all_spec":  # a copy of x (a graph piece's output is reused), written by the launch
        assert stash.x.data_ptr() != case.mixed.data_ptr()
    assert stash.g.dtype == torch.float32 and torch.allclose(stash.g, stash0.g, rtol=2e-6, atol=1e-30)
    assert torch.allclose(stash.delta, stash0.delta, rtol=1e-4, atol=1e-5)
    assert torch.allclose(out.float(), out0.float(), rtol=2e-2, atol=2e-2)
    assert out.abs().sum() > 0
