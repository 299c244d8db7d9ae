"""The one-launch Weaver step (``cuda/weaver_step.cu`` behind ``vllm_tfm.kernels.weaver_step``) on the CPU through
the CUDA emulation, whose cooperative grids run all their blocks at once: its query rows, K/V caches and key-mask
rows equal the per-kernel path's (``weaver_linear`` + ``weaver_attention`` launches) bit for bit, for FP8 and
float32 Weavers, one to three resident blocks (the stages' blocks looped over), widths 1 and 2; the scorer uses it
only when switched on; and which calls it refuses, with the reason."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from unittest import mock

import pytest
import torch
from _emulation import emulated, emulation_build_dir
from _tiny_scorers import tiny_scorer_pair

from vllm_tfm.kernels import candidate_scores as kc
from vllm_tfm.kernels import loader
from vllm_tfm.kernels import weaver_attention as ka
from vllm_tfm.kernels import weaver_linear as kl
from vllm_tfm.kernels import weaver_step as ks
from vllm_tfm.models.weaver import BatchedWeaverTreeScorer

# (node ids, parent ids, tokens, depths) of R = 2 requests: the roots, then two children each (M = 2, then 4)
CALLS = [
    (torch.tensor([[0], [0]]), torch.tensor([[-1], [-1]]), torch.tensor([[5], [9]]), torch.tensor([[0], [0]])),
    (torch.tensor([[1, 2], [1, 2]]), torch.tensor([[0, 0], [0, 0]]), torch.tensor([[7, 11], [3, 150]]),
     torch.tensor([[1, 1], [1, 1]])),
    (torch.tensor([[3, 4], [3, 4]]), torch.tensor([[1, 2], [2, 1]]), torch.tensor([[1, 2], [4, 199]]),
     torch.tensor([[2, 2], [2, 2]])),
]


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return emulation_build_dir(tmp_path_factory, "emu_step")


def twin_scorers(seed: int, fp8: bool) -> tuple[BatchedWeaverTreeScorer, BatchedWeaverTreeScorer]:
    """Two kernel-path scorers of one Weaver on the same inputs (the second one's calls take the one-launch step)."""
    pair = tiny_scorer_pair(seed, 2, fp8=fp8)
    base = pair.kernel_path
    twin = BatchedWeaverTreeScorer(base.weaver, *pair.inputs, base.embed, base.lm_head, max_nodes=8, score_kernel=True)
    return base, twin


def run_calls(emu_dir: Path, scorers, resident: int, invalid: bool = False):
    """Every call of CALLS through both scorers (the first per kernel, the second in one launch): outputs and launches."""
    outs: list[list[torch.Tensor]] = [[], []]
    names: list[list[str]] = [[], []]
    env = {"TFM_EMU_RESIDENT_BLOCKS": str(resident)}
    with (mock.patch.dict(os.environ, env), emulated(emu_dir) as launches,
          mock.patch.object(kc, "unsupported_reason", lambda *a: None),
          mock.patch.object(kl, "unsupported_reason", lambda *a: None),
          mock.patch.object(ka, "unsupported_reason", lambda *a: None)):
        for node, parent, tok, dep in CALLS:
            valid = torch.ones_like(node, dtype=torch.bool)
            if invalid:
                valid[1, -1] = False
            for i, scorer in enumerate(scorers):
                launches.clear()
                with mock.patch.dict(os.environ, {ks.ENV_SWITCH: "1" if i else "0"}):
                    outs[i].append(scorer(node, parent, tok, dep, valid))
                names[i].append([name for name, *_ in launches])
    return outs, names


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("resident", [1, 3])
def test_one_launch_step_is_the_per_kernel_path_bit_for_bit(emu_dir: Path, fp8: bool, resident: int) -> None:
    base, twin = twin_scorers(3, fp8)
    (ref, got), names = run_calls(emu_dir, (base, twin), resident)
    layers = len(base.weaver.layers)
    assert names[0] == [["weaver_linear"] + ["weaver_linear", "weaver_node_attention"] + ["weaver_linear"] * 3
                        + (["weaver_linear", "weaver_node_attention"] + ["weaver_linear"] * 3) * (layers - 1)
                        + ["weaver_linear", "candidate_scores"]] * len(CALLS)
    assert names[1] == [["weaver_step", "candidate_scores"]] * len(CALLS)
    for a, b in zip(ref, got):
        assert torch.equal(a, b)
    for kv_a, kv_b in zip(base.kv_cache, twin.kv_cache):  # the nodes' K/V written as the per-kernel path writes them
        assert torch.equal(kv_a, kv_b)
    assert torch.equal(base.key_bias, twin.key_bias)  # and the first layer's key-mask rows
    assert bool(torch.isfinite(got[-1]).all())


def test_invalid_rows_and_fresh_seeds(emu_dir: Path) -> None:
    """An invalid row (written nowhere, its output meaningless) leaves the valid rows and the caches bit-equal."""
    for seed in (5, 6):
        base, twin = twin_scorers(seed, True)
        (ref, got), _ = run_calls(emu_dir, (base, twin), 2, invalid=True)
        for a, b in zip(ref, got):
            assert torch.equal(a[0], b[0]) and torch.equal(a[1, :-1], b[1, :-1])
        for kv_a, kv_b in zip(base.kv_cache, twin.kv_cache):
            assert torch.equal(kv_a, kv_b)


def test_switched_off_by_default_and_refused_with_a_reason(emu_dir: Path, monkeypatch) -> None:
    monkeypatch.delenv(ks.ENV_SWITCH, raising=False)
    assert not ks.enabled()
    base, twin = twin_scorers(4, True)
    node, parent, tok, dep = CALLS[0]
    valid = torch.ones_like(node, dtype=torch.bool)
    with emulated(emu_dir) as launches:
        twin(node, parent, tok, dep, valid)  # CPU tensors, switch off: the per-kernel path's references, no launch
    assert launches == []
    monkeypatch.setenv(ks.ENV_SWITCH, "1")
    with emulated(emu_dir) as launches:
        twin(node, parent, tok, dep, valid)
    assert launches == []  # on, but CPU tensors: the linear kernel's own reason
    assert twin._step_scratch[1][1] == f"token_in: {kl.NOT_CUDA}"
    folded, m = twin.folded, 6
    bufs = ks.step_buffers(folded, m, torch.float32, torch.device("cpu"))
    flat = torch.zeros(m, dtype=torch.long)
    ids = torch.zeros(2, 3, dtype=torch.long)
    args = (twin._rope_nodes, ids, ids, ids, torch.ones(2, 3, dtype=torch.bool), twin.kv_cache, twin.key_bias, 5, 0.25)
    assert ks.unsupported_reason(folded, twin.embed, flat, *args, bufs) == f"6 rows: over the FP8 kernel's {kl.FP8_KERNEL_ROWS}"
    small = ks.step_buffers(folded, 4, torch.float32, torch.device("cpu"))
    assert ks.unsupported_reason(folded, twin.embed, flat[:4], *args, bufs) == "scratch for 6 rows, not the call's 4"
    assert ks.unsupported_reason(folded, twin.embed, flat[:2], *args, small) == "scratch for 4 rows, not the call's 2"
    wide = torch.zeros(twin.embed.shape[0], twin.embed.shape[1] + 16)[:, : twin.embed.shape[1]]
    with mock.patch.object(kl, "unsupported_reason", lambda *a: None):
        assert "embedding's rows" in ks.unsupported_reason(folded, wide, flat[:4], *args, small)


def test_params_mirror_the_source_struct() -> None:
    """WsParams for L layers: the source's fields in its order (pointers and int64 8-byte aligned, then 11 ints and a
    float); the emulation's bit-equality above reads them through the compiled struct."""
    p = ks.params_type(3)
    assert ctypes.sizeof(ks.WsLinear) == 32
    names = [f[0] for f in p._fields_]
    assert names[:7] == ["token_in", "qkv", "o", "gate_up", "down", "query", "kv"]
    assert names[-1] == "attn_scale" and names[-13] == "embed_rows"
    assert ctypes.sizeof(p) == 32 * (2 + 4 * 3) + 8 * 3 + 8 * 15 + 8 + 4 * 12
    assert ks.params_type(3) is p and ks.params_type(2) is not p


def test_a_structure_argument_is_packed_and_reused_by_its_bytes() -> None:
    """loader.param_array takes a ctypes Structure (a struct passed by value): a changed field makes a new array."""
    kernel = loader.CompiledKernel(function=None, device_index=0, name="fake", max_dynamic_smem=0)
    a = ks.WsLinear(1, 2, 3, 0.5, 0)
    first = loader.param_array(kernel, [a])
    assert bytes(ks.WsLinear.from_address(first[0])) == bytes(a)
    assert loader.param_array(kernel, [ks.WsLinear(1, 2, 3, 0.5, 0)]) is first
    b = ks.WsLinear(1, 2, 3, 0.25, 0)
    second = loader.param_array(kernel, [b])
    assert second is not first and ks.WsLinear.from_address(second[0]).eps == 0.25
