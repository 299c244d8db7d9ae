"""CPU tests of the CUDA kernel machinery: NVRTC loader and cache, fallback, tree plan, and the
kernels themselves run through a CPU emulation of CUDA (cuda/host_emu) against the reference.

NVRTC needs no GPU, so the sources are compiled for sm_90 here when cuda-python's NVRTC is
importable; those tests skip cleanly otherwise. The emulation test needs g++ with C++20.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import sys
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_tfm.kernels import conv as kconv
from vllm_tfm.kernels import gdn as kgdn
from vllm_tfm.kernels import loader
from vllm_tfm.kernels.plan import CommitIndices, TreePlan
from vllm_tfm.verify import conv as ref_conv
from vllm_tfm.verify import gdn as ref_gdn

REPO = Path(__file__).resolve().parents[2]
CUDA_DIR = REPO / "cuda"


def _nvrtc_importable() -> bool:
    try:
        loader._reset_for_tests()
        loader.nvrtc_version()
        return True
    except (ImportError, loader.KernelLaunchError, OSError, RuntimeError):
        return False


needs_nvrtc = pytest.mark.skipif(not _nvrtc_importable(), reason="cuda-python NVRTC is not importable")


@pytest.fixture(autouse=True)
def _fresh_loader(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TFM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("VLLM_TFM_CUDA_DIR", str(CUDA_DIR))
    loader._reset_for_tests()
    yield
    loader._reset_for_tests()


# ---------------------------------------------------------------------------------------------
# cache key and disk cache


def test_cache_key_changes_with_every_input():
    src, hdr, opts, arch, ver = "k", {"a.cuh": "x"}, ["-DA=1"], "sm_90", (13, 0)
    base = loader.cache_key(src, hdr, opts, arch, ver)
    variants = [
        loader.cache_key("k2", hdr, opts, arch, ver),
        loader.cache_key(src, {"a.cuh": "y"}, opts, arch, ver),
        loader.cache_key(src, {"b.cuh": "x"}, opts, arch, ver),
        loader.cache_key(src, hdr, ["-DA=2"], arch, ver),
        loader.cache_key(src, hdr, ["-DA=1", "-lineinfo"], arch, ver),
        loader.cache_key(src, hdr, opts, "sm_80", ver),
        loader.cache_key(src, hdr, opts, arch, (13, 1)),
    ]
    assert len({base, *variants}) == len(variants) + 1
    assert loader.cache_key(src, dict(hdr), list(opts), arch, ver) == base
    # part boundaries are length-prefixed: moving a character between parts changes the key
    assert loader.cache_key("ab", {}, ["c"], arch, ver) != loader.cache_key("a", {}, ["bc"], arch, ver)


def test_cache_hit_does_not_recompile(tmp_path, monkeypatch):
    calls = []

    def fake_compile(source, source_name, headers, options, arch):
        calls.append((source_name, tuple(options), arch))
        return b"CUBIN:" + "|".join(options).encode()

    monkeypatch.setattr(loader, "compile_cubin", fake_compile)
    monkeypatch.setattr(loader, "nvrtc_version", lambda: (13, 0))
    first = loader.get_cubin("gdn_tree_commit.cu", ["-DX=1"], "sm_90")
    second = loader.get_cubin("gdn_tree_commit.cu", ["-DX=1"], "sm_90")
    assert first == second == b"CUBIN:-DX=1"
    assert len(calls) == 1
    assert len(list((tmp_path / "cache").glob("gdn_tree_commit-sm_90-*.cubin"))) == 1
    loader.get_cubin("gdn_tree_commit.cu", ["-DX=2"], "sm_90")
    loader.get_cubin("gdn_tree_commit.cu", ["-DX=1"], "sm_80")
    assert len(calls) == 3
    # a new NVRTC version is a cache miss too
    monkeypatch.setattr(loader, "nvrtc_version", lambda: (13, 1))
    loader.get_cubin("gdn_tree_commit.cu", ["-DX=1"], "sm_90")
    assert len(calls) == 4


def test_missing_source_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_TFM_CUDA_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="VLLM_TFM_CUDA_DIR"):
        loader.read_sources("gdn_tree_verify.cu")


# ---------------------------------------------------------------------------------------------
# availability and fallback


def test_missing_cuda_python_makes_kernels_unavailable(monkeypatch):
    for name in ("cuda.bindings", "cuda.cuda", "cuda.nvrtc"):  # new and legacy layouts -> ImportError
        monkeypatch.setitem(sys.modules, name, None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    reason = loader.kernels_unavailable_reason(0)
    assert reason is not None and "cuda-python" in reason
    assert not loader.kernels_available(0)
    with pytest.raises(ImportError, match="cuda-python"):
        loader.nvrtc_version()


def test_no_cuda_device_is_reported():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert loader.kernels_unavailable_reason() == "no CUDA device is visible to torch"


def test_fallback_warns_once_and_returns_the_reference_numbers(monkeypatch):
    monkeypatch.setattr(kgdn, "_verify_unsupported", lambda *a: "cuda-python (cuda.bindings) is not importable: x")
    c = _gdn_case([torch.tensor([-1, 0, 0, 1]), torch.tensor([-1, 0])], seed=1)
    want = ref_gdn.gdn_tree_verify(**c)
    with pytest.warns(RuntimeWarning, match="falls back to the torch reference.*cuda-python") as rec:
        got = kgdn.gdn_tree_verify(**c)
    assert len(rec) == 1
    assert torch.equal(got, want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again = kgdn.gdn_tree_verify(**c)  # second call: no second warning
    assert torch.equal(again, want)


def test_cpu_inputs_use_the_reference_without_warning():
    c = _gdn_case([torch.tensor([-1, 0, 1])], seed=2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got, delta = kgdn.gdn_tree_verify(**c, return_delta=True)
    want, want_delta = ref_gdn.gdn_tree_verify(**c, return_delta=True)
    assert torch.equal(got, want) and torch.equal(delta, want_delta)
    x = torch.randn(3, 8)
    args = (x, c["parents"], c["cu_nodes"], torch.randn(2, 8, 3), torch.tensor([1]), torch.randn(8, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y = kconv.tree_causal_conv1d(*args)
    assert torch.equal(y, ref_conv.tree_causal_conv1d(*args))


# ---------------------------------------------------------------------------------------------
# NVRTC on the CPU: compile errors carry the log; every source compiles for sm_90


@needs_nvrtc
def test_nvrtc_compile_error_carries_the_log():
    src = 'extern "C" __global__ void broken(float* x) { x[0] = undefined_name_xyz; }\n'
    with pytest.raises(loader.KernelCompileError) as info:
        loader.compile_cubin(src, "broken.cu", {}, ["--std=c++17"], "sm_90")
    assert "undefined_name_xyz" in info.value.log
    assert "broken.cu" in str(info.value) and "undefined_name_xyz" in str(info.value)


VARIANTS = [
    ("gdn_tree_verify.cu", ["-DTFM_IN=1", "-DGDN_K=128", "-DGDN_V=128", "-DGDN_BV=16"]),
    ("gdn_tree_verify.cu", ["-DTFM_IN=1", "-DGDN_K=128", "-DGDN_V=128", "-DGDN_BV=32"]),
    ("gdn_tree_verify.cu", ["-DTFM_IN=1", "-DGDN_K=128", "-DGDN_V=128", "-DGDN_BV=64"]),
    ("gdn_tree_verify.cu", ["-DTFM_IN=0", "-DGDN_K=64", "-DGDN_V=64", "-DGDN_BV=32"]),
    ("gdn_tree_verify.cu", ["-DTFM_IN=2", "-DGDN_K=256", "-DGDN_V=128", "-DGDN_BV=32"]),
    ("gdn_tree_verify.cu", ["-DTFM_IN=1", "-DGDN_K=128", "-DGDN_V=128", "-DGDN_BV=32", "-DGDN_VARIANT=1"]),
    ("gdn_tree_verify.cu", ["-DTFM_IN=0", "-DGDN_K=32", "-DGDN_V=64", "-DGDN_BV=64", "-DGDN_VARIANT=1"]),
    ("gdn_tree_verify.cu", ["-DTFM_IN=1", "-DGDN_K=128", "-DGDN_V=128", "-DGDN_BV=32", "-DGDN_VARIANT=3"]),
    ("gdn_tree_verify.cu", ["-DTFM_IN=0", "-DGDN_K=128", "-DGDN_V=128", "-DGDN_BV=64", "-DGDN_VARIANT=3"]),
    ("gdn_tree_verify.cu", ["-DTFM_IN=2", "-DGDN_K=64", "-DGDN_V=32", "-DGDN_BV=16", "-DGDN_VARIANT=3"]),
    ("gdn_tree_verify.cu", ["-DTFM_IN=1", "-DGDN_K=128", "-DGDN_V=128", "-DGDN_BV=16", "-DGDN_VARIANT=4"]),
    ("gdn_tree_verify.cu", ["-DTFM_IN=2", "-DGDN_K=64", "-DGDN_V=64", "-DGDN_BV=32", "-DGDN_VARIANT=4"]),
    ("gdn_tree_verify.cu", ["-DTFM_IN=1", "-DGDN_K=128", "-DGDN_V=128", "-DGDN_BV=16", "-DGDN_VARIANT=3",
                            "-DGDN_PROFILE_SKIP=6"]),  # bench/gdn_phases.py's timing variants
    ("gdn_tree_verify.cu", ["-DTFM_IN=1", "-DGDN_K=128", "-DGDN_V=128", "-DGDN_BV=32", "-DGDN_VARIANT=5"]),
    ("gdn_tree_verify.cu", ["-DTFM_IN=0", "-DGDN_K=128", "-DGDN_V=128", "-DGDN_BV=64", "-DGDN_VARIANT=5"]),
    ("tfm_mma_check.cu", []),
    ("gdn_tree_commit.cu", ["-DTFM_IN=1", "-DGDN_K=128", "-DGDN_V=128"]),
    ("gdn_tree_commit.cu", ["-DTFM_IN=0", "-DGDN_K=32", "-DGDN_V=32"]),
    ("tree_conv.cu", ["-DTFM_IN=1", "-DCONV_ST=1", "-DCONV_WT=1"]),
    ("tree_conv.cu", ["-DTFM_IN=0", "-DCONV_ST=2", "-DCONV_WT=0"]),
    ("tree_attention.cu", ["-DTFM_IN=1", "-DTA_D=256", "-DTA_BN=32", "-DTA_MINB=2"]),
    ("tree_attention.cu", ["-DTFM_IN=2", "-DTA_D=128", "-DTA_BN=64", "-DTA_MINB=2"]),
    ("tree_attention.cu", ["-DTFM_IN=0", "-DTA_D=64", "-DTA_BN=32", "-DTA_MINB=1"]),
    ("kv_compact.cu", ["-DKVC_UNIT=16"]),
    ("kv_compact.cu", ["-DKVC_UNIT=1"]),
    # version 6 as the runtime builds it at the 27B shape (kernels/gdn.py): path solve at 512 / 256 threads, a
    # cluster of 2, the level solve; and the top-K rows kernel's three dtypes
    ("gdn_tree_verify_grouped.cu", ["-DTFM_IN=1", "-DGDN_K=128", "-DGDN_V=128", "-DGDN_GROUP=3", "-DG6_THREADS=512",
                                    "-DG6_SOLVE=1", "-DG6_CLUSTER=1", "-DG6_PATH_REG=17"]),
    ("gdn_tree_verify_grouped.cu", ["-DTFM_IN=1", "-DGDN_K=128", "-DGDN_V=128", "-DGDN_GROUP=3", "-DG6_THREADS=256",
                                    "-DG6_SOLVE=1", "-DG6_CLUSTER=2", "-DG6_PATH_REG=17"]),
    ("gdn_tree_verify_grouped.cu", ["-DTFM_IN=1", "-DGDN_K=128", "-DGDN_V=128", "-DGDN_GROUP=3", "-DG6_THREADS=512",
                                    "-DG6_SOLVE=0", "-DG6_CLUSTER=2"]),
    # version 7 as the runtime builds it at the 27B shape (16 V columns) and at 32, and at the toy zoo's shape
    ("gdn_tree_verify_small.cu", ["-DTFM_IN=1", "-DGDN_K=128", "-DGDN_V=128", "-DGDN_GROUP=3", "-DS7_BV=16"]),
    ("gdn_tree_verify_small.cu", ["-DTFM_IN=1", "-DGDN_K=128", "-DGDN_V=128", "-DGDN_GROUP=3", "-DS7_BV=32"]),
    ("gdn_tree_verify_small.cu", ["-DTFM_IN=1", "-DGDN_K=64", "-DGDN_V=64", "-DGDN_GROUP=2", "-DS7_BV=16"]),
    ("topk_rows.cu", ["-DTK_IN=0"]),
    ("topk_rows.cu", ["-DTK_IN=1"]),
    ("topk_rows.cu", ["-DTK_IN=2"]),
    # the Weaver node attention (its body is weaver_attention.cuh's) at the 27B drafter's shape
    ("weaver_attention.cu", ["-DTFM_IN=1", "-DWA_HD=128"]),
]


@needs_nvrtc
def test_every_source_compiles_for_sm90_and_is_cached(tmp_path):
    for source, defines in VARIANTS:
        cubin = loader.get_cubin(source, ["--std=c++17", "-lineinfo", *defines], "sm_90")
        assert cubin[:4] == b"\x7fELF", source
    assert len(list((tmp_path / "cache").glob("*.cubin"))) == len(VARIANTS)


# ---------------------------------------------------------------------------------------------
# tree plan


def _brute_paths(parents: list[int]) -> list[list[int]]:
    out = []
    for i in range(len(parents)):
        path, node = [], i
        while node >= 0:
            path.append(node)
            node = parents[node]
        out.append(path[::-1])
    return out


def test_plan_tables_match_brute_force():
    gen = torch.Generator().manual_seed(3)
    trees = [torch.tensor([-1]), torch.tensor([-1, 0, 1, 2, 3]), torch.tensor([-1, 0, 0, 0])]
    for n in (17, 40):
        par = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
        trees.append(torch.tensor(par))
    cu = torch.tensor([0, *torch.tensor([t.numel() for t in trees]).cumsum(0).tolist()])
    plan = TreePlan.build(torch.cat(trees), cu)
    starts = cu[:-1].tolist()
    expect_depth, expect_paths, expect_order = [], {}, []
    for r, t in enumerate(trees):
        paths = _brute_paths(t.tolist())
        for i, p in enumerate(paths):
            expect_depth.append(len(p) - 1)
            expect_paths[starts[r] + i] = [starts[r] + j for j in p]
        expect_order += sorted(range(starts[r], starts[r] + t.numel()), key=lambda i: (expect_depth[i], i))
    assert plan.depth.tolist() == expect_depth
    assert plan.perm.tolist() == expect_order
    assert plan.pos[plan.perm].tolist() == list(range(plan.num_nodes))
    off, pj = plan.pair_off.tolist(), plan.pair_j.tolist()
    for p, node in enumerate(expect_order):
        assert pj[off[p] : off[p + 1]] == expect_paths[node]
    assert plan.num_pairs == sum(d + 1 for d in expect_depth)
    assert plan.max_nodes == 40 and plan.max_depth == max(expect_depth)
    assert plan.req_of.tolist() == torch.repeat_interleave(torch.arange(len(trees)), cu.diff()).tolist()
    per_req = [sum(expect_depth[s:e]) + (e - s) for s, e in zip(cu[:-1].tolist(), cu[1:].tolist())]
    assert plan.max_pairs_per_request == max(per_req)
    assert plan.cu.dtype == torch.int32


@pytest.mark.parametrize(
    "parents, cu, message",
    [
        ([-1, 0, 2], [0, 3], r"parents\[2\] = 2 is invalid"),
        ([0, 0], [0, 2], r"parents\[0\] = 0 is invalid"),
        ([-1, 0], [0, 1], "must start at 0 and end at the number of nodes 2"),
        ([-1, -1], [0, 2, 2], "request 1 has 0 nodes"),
    ],
)
def test_plan_rejects_malformed_batches(parents, cu, message):
    with pytest.raises(ValueError, match=message):
        TreePlan.build(torch.tensor(parents), torch.tensor(cu))


def test_block_v_choice_respects_shared_memory_and_grid():
    plan = TreePlan.build(torch.tensor([-1, 0, 1, 0]), torch.tensor([0, 4]))
    # tiny grid: smallest block; big batch-like grid: the widest block that fits
    assert kgdn.choose_block_v(plan, 48, 128, 128, 227 * 1024, 132) == 16
    assert kgdn.choose_block_v(plan, 48 * 32, 128, 128, 227 * 1024, 132) == 64
    # 300-node tree: BV=64 does not fit 227 KB, BV=16 does
    big = TreePlan.build(torch.arange(-1, 299), torch.tensor([0, 300]))
    assert kgdn.verify_smem_bytes(128, 64, 300, kgdn._pair_capacity(big)) > 227 * 1024
    assert kgdn.choose_block_v(big, 48 * 32, 128, 128, 227 * 1024, 132) in (16, 32)
    assert kgdn.choose_block_v(big, 48, 128, 128, 8 * 1024, 132) is None


def test_commit_indices_snapshot_sources_only_when_slots_alias_across_requests():
    plain = CommitIndices.build([3, 0], [5, 6], [5, 6], "cpu")  # in place per request
    assert plain.snapshot is None and plain.src.tolist() == [5, 6] and plain.dst.tolist() == [5, 6]
    shared = CommitIndices.build([3, 0], [7, 7], [5, 6], "cpu")  # a shared source is only read
    assert shared.snapshot is None
    crossed = CommitIndices.build([3, 0], [6, 1], [5, 6], "cpu", [2, 1], [0, 3])  # 6: dst of r1, src of r0
    assert crossed.snapshot.tolist() == [6, 1] and crossed.src.tolist() == [0, 1]
    assert crossed.accepted.tolist() == [3, 0] and crossed.dst.tolist() == [5, 6]
    assert crossed.src_start.tolist() == [2, 1] and crossed.dst_start.tolist() == [0, 3]
    assert crossed.src.dtype == torch.int32


# ---------------------------------------------------------------------------------------------
# the kernels themselves, on the CPU through cuda/host_emu, against the float64 reference


def _gdn_case(parent_list, h=1, hv=2, kd=32, vd=32, dtype=torch.float32, seed=0, slots=4):
    gen = torch.Generator().manual_seed(seed)
    parents = torch.cat(parent_list)
    cu = torch.zeros(len(parent_list) + 1, dtype=torch.long)
    cu[1:] = torch.tensor([p.numel() for p in parent_list]).cumsum(0)
    t = parents.numel()
    g, beta = ref_gdn.gdn_gates(torch.randn(t, hv, generator=gen), torch.randn(t, hv, generator=gen),
                                torch.rand(hv, generator=gen) * 2, torch.randn(hv, generator=gen) * 0.5)
    return dict(
        q=torch.randn(t, h, kd, generator=gen).to(dtype), k=torch.randn(t, h, kd, generator=gen).to(dtype),
        v=torch.randn(t, hv, vd, generator=gen).to(dtype), g=g, beta=beta, parents=parents, cu_nodes=cu,
        ssm_state=torch.randn(slots, hv, vd, kd, generator=gen) * 0.3,
        state_indices=torch.randint(0, slots, (len(parent_list),), generator=gen),
    )


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is needed for the CPU emulation")
def test_kernels_under_cpu_emulation_match_the_reference(tmp_path):
    sys.path.insert(0, str(CUDA_DIR / "host_emu"))
    try:
        from emulate import emulated_kernels
    finally:
        sys.path.pop(0)
    # mixed batch: a 70-node random tree (two projection tiles), a chain, a single root, a star
    gen = torch.Generator().manual_seed(11)
    trees = [torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, 70)]),
             torch.arange(-1, 8), torch.tensor([-1]), torch.tensor([-1] + [0] * 11)]
    c = _gdn_case(trees, hv=2, seed=5)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    c64 = {k: v.double() if v.is_floating_point() else v for k, v in c.items()}
    o_ref, d_ref = ref_gdn.gdn_tree_verify(**c64, return_delta=True)
    state_before = c["ssm_state"].clone()
    out = torch.full(c["v"].shape, float("nan"))
    dout = torch.full(c["v"].shape, float("nan"))
    try:
        with emulated_kernels(tmp_path / "emu"):
            for variant in kgdn.VERIFY_VARIANTS:  # every kernel version, one pair window and several
                for window in (4096, 40):
                    kgdn.PAIR_WINDOW, saved = window, kgdn.PAIR_WINDOW  # 40: several windows, levels split
                    out.fill_(float("nan"))
                    dout.fill_(float("nan"))
                    try:
                        kgdn.gdn_tree_verify_planned(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"],
                                                     c["state_indices"], return_delta=True, block_v=16, out=out,
                                                     delta_out=dout, variant=variant)
                    finally:
                        kgdn.PAIR_WINDOW = saved
                    assert not out.isnan().any() and not dout.isnan().any(), (variant, window)
                    assert torch.equal(c["ssm_state"], state_before)
                    assert _rel(out, o_ref) < 1e-5 and _rel(dout, d_ref) < 1e-5, (variant, window)

            acc, src, dst = [37, 8, 0, 5], [3, 3, 1, 0], [0, 1, 2, 3]  # slots alias across requests
            st_ref = c64["ssm_state"].clone()
            ref_gdn.gdn_tree_commit(c64["k"], c64["g"], d_ref, c["parents"], c["cu_nodes"], torch.tensor(acc),
                                    st_ref, torch.tensor(src), torch.tensor(dst))
            st = c["ssm_state"].clone()
            kgdn.gdn_tree_commit_planned(plan, c["k"], c["g"], dout, CommitIndices.build(acc, src, dst, "cpu"), st)
            assert _rel(st, st_ref) < 1e-5

            x = torch.randn(plan.num_nodes, 40, generator=gen)
            cs = torch.randn(5, 40, 5, generator=gen)
            w, b = torch.randn(40, 4, generator=gen), torch.randn(40, generator=gen)
            sidx, ws = torch.tensor([4, 0, 2, 4]), torch.tensor([0, 2, 1, 0])
            y = kconv.tree_causal_conv1d_planned(plan, x, cs, sidx, w, b, "silu", ws)
            y_ref = ref_conv.tree_causal_conv1d(x.double(), c["parents"], c["cu_nodes"], cs.double(), sidx,
                                                w.double(), b.double(), "silu", ws)
            assert _rel(y, y_ref) < 1e-5
            st, st_ref = cs.clone(), cs.clone()
            cidx = CommitIndices.build(acc, [4, 4, 1, 2], [0, 1, 2, 3], "cpu", [1, 0, 0, 2], [0, 2, 1, 0])
            kconv.tree_conv_commit_planned(plan, x, cidx, st, 4)
            ref_conv.tree_conv_commit(x, c["parents"], c["cu_nodes"], torch.tensor(acc), st_ref, torch.tensor([4, 4, 1, 2]),
                                      torch.tensor([0, 1, 2, 3]), 4, torch.tensor([1, 0, 0, 2]), torch.tensor([0, 2, 1, 0]))
            assert torch.equal(st, st_ref)
    except subprocess.CalledProcessError as exc:  # a compiler without C++20 <barrier>
        pytest.skip(f"g++ could not build the emulation: {exc.stderr[:300]}")


@needs_nvrtc
def test_nvrtc_calls_leave_interned_bytes_alone(tmp_path, monkeypatch):
    """NVRTC writes into the buffer it is given; a buffer made as ``b" " * 1`` is CPython's
    shared single-byte object, and writing into it turned ``b" "`` into NUL for the whole
    interpreter (a later torch.load failed). The loader must allocate fresh buffers."""
    monkeypatch.setenv("VLLM_TFM_CACHE", str(tmp_path / "fresh-cache"))
    source, defines = VARIANTS[-1]
    loader.get_cubin(source, ["--std=c++17", *defines], "sm_90")
    one = b" " * 1
    assert one[0] == 0x20 and b"a b".split(b" ") == [b"a", b"b"]


def test_shared_memory_opt_in_counts_the_kernels_static_arrays():
    # tree attention at head_dim 64 in bf16 once had 46,080 dynamic bytes + 4,100 static (its merge's
    # weights), past 48 KB together; the H200 refused that launch (CUDA_ERROR_INVALID_VALUE) while
    # only the dynamic part was compared with 48 KB
    from vllm_tfm.kernels.loader import CompiledKernel, needs_smem_optin

    dynamic = 46_080
    assert dynamic <= 48 * 1024 < dynamic + 4100
    k = CompiledKernel(function=None, device_index=0, name="k", max_dynamic_smem=227 * 1024, static_smem=4100)
    assert needs_smem_optin(k, dynamic)
    assert not needs_smem_optin(k, 48 * 1024 - 4100)
    assert not needs_smem_optin(k, 0)
    bare = CompiledKernel(function=None, device_index=0, name="k", max_dynamic_smem=227 * 1024)
    assert not needs_smem_optin(bare, 48 * 1024) and needs_smem_optin(bare, 48 * 1024 + 1)


def test_launch_arguments_become_pointers_and_scalars():
    """What ``launch`` hands cuLaunchKernel per argument: a tensor's device pointer, a null
    pointer for None, ctypes scalars as they are; a bare int is refused (its width is unknown)."""
    t = torch.arange(6)[2:]
    assert loader._ctype_arg(t).value == t.data_ptr() != torch.arange(6).data_ptr()
    assert loader._ctype_arg(None).value is None  # c_void_p(0) reads back as None
    scalar = ctypes.c_longlong(-3)
    assert loader._ctype_arg(scalar) is scalar
    with pytest.raises(TypeError, match="kernel argument 7: pass a tensor, None, or a ctypes value"):
        loader._ctype_arg(7)


class _FakeDriver:
    """The four cuda.bindings.driver calls ``launch`` makes, recording what it passes."""

    class CUresult:
        CUDA_SUCCESS = 0

    def __init__(self, status=0):
        self.status = status
        self.launches = []

    def cuCtxGetCurrent(self):
        return (0, 1)

    def CUstream(self, handle):
        return ("stream", handle)

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, smem, stream, params, extra):
        # read every argument back through the parameter array, as the driver does
        slots = (ctypes.c_void_p * 3).from_address(params)
        args = (ctypes.c_void_p.from_address(slots[0]).value, ctypes.c_int.from_address(slots[1]).value,
                ctypes.c_void_p.from_address(slots[2]).value)
        self.launches.append((function, (gx, gy, gz), (bx, by, bz), smem, stream, args, extra))
        return (self.status,)

    def cuGetErrorName(self, err):
        return (0, b"CUDA_ERROR_INVALID_VALUE")


def test_launch_passes_pointers_scalars_and_the_stream(monkeypatch):
    """``launch`` on a fake driver: the parameter array points at each argument's value, the
    launch goes to torch's current stream, and a failing launch names the kernel and its shape."""
    fake = _FakeDriver()
    monkeypatch.setattr(loader, "_cuda_modules", (fake, None))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: SimpleNamespace(cuda_stream=77))
    kernel = loader.CompiledKernel("fn", 0, "k", 48 * 1024, 0)
    t = torch.arange(4)
    loader.launch(kernel, (2, 1, 1), (128, 1, 1), [t, ctypes.c_int(-5), None], shared_mem=256)
    assert fake.launches == [("fn", (2, 1, 1), (128, 1, 1), 256, ("stream", 77), (t.data_ptr(), -5, None), 0)]
    loader.launch(kernel, (0, 1, 1), (128, 1, 1), [t, ctypes.c_int(1), None])  # empty grid: nothing launched
    assert len(fake.launches) == 1
    fake.status = 1
    with pytest.raises(loader.KernelLaunchError, match=r"cuLaunchKernel\(k, grid=\(2, 1, 1\), block=\(128, 1, 1\), "
                       r"smem=0\) failed: CUDA_ERROR_INVALID_VALUE"):
        loader.launch(kernel, (2, 1, 1), (128, 1, 1), [t, ctypes.c_int(1), None])


def _read_back(params, kinds) -> list:
    """Every argument read through a parameter array, as the driver does (kinds: ctypes types)."""
    slots = (ctypes.c_void_p * len(kinds)).from_address(ctypes.addressof(params))
    return [kind.from_address(slots[i]).value for i, kind in enumerate(kinds)]


def test_param_array_reuses_the_kernels_last_array_only_when_that_packs_the_same_arguments():
    """Consecutive launches of a kernel with other tensors re-point the kept array; any change in a
    scalar (value, type, float bits) or in which positions hold pointers packs afresh. What the
    driver reads is always the arguments of this launch."""
    kernel, other = loader.CompiledKernel("fn", 0, "k", 0, 0), loader.CompiledKernel("fn2", 0, "k2", 0, 0)
    c_int, c_long, c_float, c_void = ctypes.c_int, ctypes.c_longlong, ctypes.c_float, ctypes.c_void_p
    kinds = [c_void, c_int, c_void, c_long, c_float]

    def args(a, b, n=3, stride=8, scale=0.5, int_type=c_int):
        return [a, int_type(n), b, c_long(stride), c_float(scale)]

    def expect(a, b, n=3, stride=8, scale=0.5):
        return [a.data_ptr() if a is not None else None, n, b.data_ptr() if b is not None else None, stride, scale]

    t = [torch.arange(4) + i for i in range(6)]
    first = loader.param_array(kernel, args(t[0], t[1]))
    assert _read_back(first, kinds) == expect(t[0], t[1])
    again = loader.param_array(kernel, args(t[2], t[3]))  # other tensors, same scalars: the same array
    assert again is first and _read_back(again, kinds) == expect(t[2], t[3])
    assert _read_back(loader.param_array(kernel, args(t[4], None)), kinds) == expect(t[4], None)
    for changed, want in (({"n": 4}, {"n": 4}), ({"stride": 9}, {"stride": 9}), ({"scale": 0.25}, {"scale": 0.25})):
        fresh = loader.param_array(kernel, args(t[0], t[5], **changed))
        assert fresh is not first and _read_back(fresh, kinds) == expect(t[0], t[5], **want)
    # the same value in another ctypes type is other bytes: packed afresh
    wide = loader.param_array(kernel, args(t[1], t[2], n=3, int_type=c_long))
    assert c_long.from_address((c_void * 5).from_address(ctypes.addressof(wide))[1]).value == 3
    # -0.0 equals 0.0 but is other bits
    zero = loader.param_array(kernel, args(t[1], t[2], scale=0.0))
    negzero = loader.param_array(kernel, args(t[1], t[2], scale=-0.0))
    assert negzero is not zero and str(_read_back(negzero, kinds)[4]) == "-0.0"
    # a scalar where a pointer was, and another kernel's launches: their own arrays
    swapped = loader.param_array(kernel, [c_void(1234), c_int(3), t[0], c_long(8), c_float(0.5)])
    assert _read_back(swapped, kinds)[0] == 1234
    mine = loader.param_array(kernel, args(t[3], t[4]))
    theirs = loader.param_array(other, args(t[0], t[1]))
    assert theirs is not mine and _read_back(mine, kinds) == expect(t[3], t[4])
    with pytest.raises(TypeError, match="pass a tensor, None, or a ctypes value"):
        loader.param_array(kernel, [t[0], 3, t[1], c_long(8), c_float(0.5)])


def test_launch_packs_each_launchs_own_arguments(monkeypatch):
    """Two launches of one kernel through ``launch``: the driver reads each launch's tensors."""
    fake = _FakeDriver()
    monkeypatch.setattr(loader, "_cuda_modules", (fake, None))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda index=None: SimpleNamespace(cuda_stream=77))
    kernel = loader.CompiledKernel("fn", 0, "k", 48 * 1024, 0)
    a, b = torch.arange(4), torch.arange(5)
    loader.launch(kernel, (1, 1, 1), (32, 1, 1), [a, ctypes.c_int(2), None])
    loader.launch(kernel, (1, 1, 1), (32, 1, 1), [b, ctypes.c_int(2), a])
    assert [x[5] for x in fake.launches] == [(a.data_ptr(), 2, None), (b.data_ptr(), 2, a.data_ptr())]
