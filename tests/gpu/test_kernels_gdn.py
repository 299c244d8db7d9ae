"""GPU tests: the CUDA tree kernels against the torch reference (vllm_tfm.verify) on random inputs.

Run on the GPU host: ``python3 -m pytest tests/gpu/test_kernels_gdn.py -q``. Skipped without a
CUDA device or when the kernels cannot be compiled (no cuda-python / NVRTC).

Tolerances (norm-wise relative error against a float64 reference on the same inputs):
float32 inputs 1e-5; bfloat16 / float16 inputs 3e-3 (the output itself is rounded to 16 bits).
Outputs are poisoned with NaN before each run, and every element must be written.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from vllm_tfm.kernels import conv as kconv
from vllm_tfm.kernels import gdn as kgdn
from vllm_tfm.kernels.loader import kernels_available, kernels_unavailable_reason
from vllm_tfm.kernels.plan import TreePlan
from vllm_tfm.verify import conv as ref_conv
from vllm_tfm.verify import gdn as ref_gdn

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEV = "cuda"
FP32_TOL, HALF_TOL = 1e-5, 3e-3


@pytest.fixture(scope="module", autouse=True)
def _kernels_must_work():
    if not kernels_available():
        pytest.skip(f"CUDA kernels unavailable: {kernels_unavailable_reason()}")


# ---------------------------------------------------------------------------------------------
# trees (topological parents, node 0 the root)


def chain(n: int) -> torch.Tensor:
    return torch.arange(-1, n - 1)


def star(n: int) -> torch.Tensor:
    return torch.tensor([-1] + [0] * (n - 1))


def random_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)])


def deep_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    """A spine (chain) of 4n/5 nodes, then side branches on random earlier nodes: depth 4n/5 - 1."""
    spine = max(1, 4 * n // 5)
    par = [-1] + list(range(spine - 1))
    par += [int(torch.randint(0, i, (1,), generator=gen)) for i in range(spine, n)]
    return torch.tensor(par)


def bushy_tree(n: int, gen: torch.Generator, max_depth: int = 16) -> torch.Tensor:
    """DDTree-like: new nodes attach preferably to recent shallow nodes, depth <= max_depth."""
    par, depth = [-1], [0]
    for i in range(1, n):
        cands = [j for j in range(max(0, i - 12), i) if depth[j] < max_depth] or [0]
        p = cands[int(torch.randint(0, len(cands), (1,), generator=gen))]
        par.append(p)
        depth.append(depth[p] + 1)
    return torch.tensor(par)


def max_depth(parents: torch.Tensor) -> int:
    d = [0] * parents.numel()
    for i in range(1, parents.numel()):
        d[i] = d[int(parents[i])] + 1
    return max(d)


def ragged(trees: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    cu = torch.zeros(len(trees) + 1, dtype=torch.long)
    cu[1:] = torch.tensor([t.numel() for t in trees]).cumsum(0)
    return torch.cat(trees), cu


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


# ---------------------------------------------------------------------------------------------
# verify


def make_case(trees, h=2, hv=6, kd=128, vd=128, dtype=torch.float32, seed=0, slots=None, g_scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    parents, cu = ragged(trees)
    t, r = parents.numel(), len(trees)
    slots = slots or r + 2
    g, beta = ref_gdn.gdn_gates(torch.randn(t, hv, generator=gen), torch.randn(t, hv, generator=gen),
                                torch.rand(hv, generator=gen) * 2, torch.randn(hv, generator=gen) * 0.5)
    c = dict(
        q=torch.randn(t, h, kd, generator=gen).to(dtype), k=torch.randn(t, h, kd, generator=gen).to(dtype),
        v=torch.randn(t, hv, vd, generator=gen).to(dtype), g=g * g_scale, beta=beta, parents=parents, cu_nodes=cu,
        ssm_state=torch.randn(slots, hv, vd, kd, generator=gen) * 0.3,
        state_indices=torch.randperm(slots, generator=gen)[:r],
    )
    return {k: v.to(DEV) for k, v in c.items()}


def reference(c, **kw):
    c64 = {k: v.double() if v.is_floating_point() else v for k, v in c.items()}
    return ref_gdn.gdn_tree_verify(**c64, return_delta=True, **kw)


VARIANTS = list(kgdn.VERIFY_VARIANTS)  # every verify kernel version must pass every test


def run_poisoned(c, block_v=None, variant=kgdn.DEFAULT_VERIFY_VARIANT, **kw):
    """Planned kernel call into NaN-filled outputs; returns (o, delta) and checks the state is untouched."""
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    before = c["ssm_state"].clone()
    o = torch.full(c["v"].shape, float("nan"), dtype=c["v"].dtype, device=DEV)
    d = torch.full(c["v"].shape, float("nan"), dtype=torch.float32, device=DEV)
    kgdn.gdn_tree_verify_planned(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"], c["state_indices"],
                                 return_delta=True, block_v=block_v, out=o, delta_out=d, variant=variant, **kw)
    torch.cuda.synchronize()
    assert not o.isnan().any(), "verify left output elements unwritten"
    assert not d.isnan().any(), "verify left delta elements unwritten"
    assert torch.equal(c["ssm_state"], before), "verify wrote the state"
    return o, d


def _seeded(seed):
    return torch.Generator().manual_seed(seed)


TREE_SETS = {
    "single_node": lambda g: [torch.tensor([-1])],
    "chain16": lambda g: [chain(16)],
    "star33": lambda g: [star(33)],
    "deep90_depth_ge_64": lambda g: [deep_tree(90, g)],
    "mixed_batch": lambda g: [random_tree(40, g), chain(9), star(12), torch.tensor([-1]), bushy_tree(50, g)],
    "n65_not_tile_multiple": lambda g: [random_tree(65, g), bushy_tree(97, g)],
    "n256": lambda g: [bushy_tree(256, g), random_tree(256, g)],
    "n300": lambda g: [bushy_tree(300, g)],
    "chain300": lambda g: [chain(300)],
}


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", list(TREE_SETS))
def test_verify_fp32_matches_float64_reference(name, variant):
    trees = TREE_SETS[name](_seeded(len(name)))
    if name.startswith("deep"):
        assert max_depth(trees[0]) >= 64
    c = make_case(trees, seed=1)
    o, d = run_poisoned(c, variant=variant)
    o_ref, d_ref = reference(c)
    assert rel(o, o_ref) <= FP32_TOL
    assert rel(d, d_ref) <= FP32_TOL
    if variant != kgdn.DEFAULT_VERIFY_VARIANT:
        return
    # the public wrapper (reference signature) takes the kernel path, silently, and is deterministic
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        o2, d2 = kgdn.gdn_tree_verify(**c, return_delta=True)
    assert torch.equal(o2, o) and torch.equal(d2, d)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_verify_half_inputs(dtype, variant):
    g = _seeded(7)
    c = make_case([bushy_tree(64, g), random_tree(100, g), chain(20), torch.tensor([-1])], dtype=dtype, seed=2)
    o, d = run_poisoned(c, variant=variant)
    assert o.dtype == dtype
    o_ref, d_ref = reference(c)
    assert rel(o, o_ref) <= HALF_TOL
    assert rel(d, d_ref) <= FP32_TOL  # delta is float32 math on the same (rounded) inputs


V6_SETS = ["single_node", "chain16", "star33", "deep90_depth_ge_64", "mixed_batch", "n65_not_tile_multiple"]


@pytest.mark.parametrize("group", [3, 1])
@pytest.mark.parametrize("name", V6_SETS)
def test_verify_v6_bf16_matches_float64_reference(name, group):
    # version 6 (one kernel, a CTA per q/k head serving its group of value heads) on every tree set it
    # takes: n = 1, a chain, a star, depth >= 64, a batch of mixed trees, n not a multiple of 16
    trees = TREE_SETS[name](_seeded(len(name) + group))
    c = make_case(trees, h=2, hv=2 * group, dtype=torch.bfloat16, seed=3 + group)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    launches, _, _ = kgdn.verify_launches(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"],
                                          c["state_indices"], variant=6)
    assert [kname for kname, _ in launches] == ["gdn_tree_verify_grouped"]
    o, d = run_poisoned(c, variant=6)
    o_ref, d_ref = reference(c)
    assert rel(o, o_ref) <= HALF_TOL and rel(d, d_ref) <= FP32_TOL


V7_SETS = {
    "single_node": lambda g: [torch.tensor([-1])],
    "chain32": lambda g: [chain(32)],
    "star17": lambda g: [star(17)],
    "mixed_batch": lambda g: [random_tree(17, g), chain(9), star(12), torch.tensor([-1]), bushy_tree(30, g)],
    "b8_of_17": lambda g: [bushy_tree(17, g) for _ in range(8)],
}


@pytest.mark.parametrize("block_v", [16, 32])
@pytest.mark.parametrize("group", [3, 1])
@pytest.mark.parametrize("name", list(V7_SETS))
def test_verify_v7_bf16_matches_float64_reference(name, group, block_v):
    # version 7 (trees of <= 32 nodes, a warp per value head, 16 V rows and half of K) at K = V = 128 on every tree set:
    # n = 1, a chain of 32 (depth 31), a star, a batch of mixed trees, eight trees of 17 (the runtime's B = 16)
    trees = V7_SETS[name](_seeded(len(name) + group))
    c = make_case(trees, h=2, hv=2 * group, dtype=torch.bfloat16, seed=5 + group)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    launches, o, d = kgdn.verify_launches(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"],
                                          c["state_indices"], return_delta=True, variant=7,
                                          extra_options=(f"-DS7_BV={block_v}",))
    assert [kname for kname, _ in launches] == ["gdn_tree_verify_small"]
    before = c["ssm_state"].clone()
    o.fill_(float("nan"))
    d.fill_(float("nan"))
    launches[0][1]()
    torch.cuda.synchronize()
    assert not o.isnan().any() and not d.isnan().any(), "verify left output elements unwritten"
    assert torch.equal(c["ssm_state"], before), "verify wrote the state"
    o_ref, d_ref = reference(c)
    assert rel(o, o_ref) <= HALF_TOL and rel(d, d_ref) <= FP32_TOL, (rel(o, o_ref), rel(d, d_ref))
    o6, d6 = run_poisoned(c, variant=6)
    assert rel(d, d6) <= 1e-6  # version 6: the same function summed in another order


def test_verify_v7_at_the_27b_shape_equals_version_6_within_rounding():
    # the 27B layer (16 q/k heads, 48 value heads) at batch 8 of B = 16 trees: version 7 against the float64
    # reference and version 6 (the runtime's kernel for these trees before version 7)
    gen = _seeded(77)
    c = make_case([bushy_tree(17, gen) for _ in range(8)], h=16, hv=48, dtype=torch.bfloat16, seed=78)
    o7, d7 = run_poisoned(c, variant=7)
    o6, d6 = run_poisoned(c, variant=6)
    o_ref, d_ref = reference(c)
    assert rel(o7, o_ref) <= HALF_TOL and rel(d7, d_ref) <= FP32_TOL, (rel(o7, o_ref), rel(d7, d_ref))
    assert rel(d7, d6) <= 1e-6 and rel(o7.float(), o6.float()) <= HALF_TOL


V8_SETS = {
    "single_node": lambda g: [torch.tensor([-1])],
    "chain17": lambda g: [chain(17)],
    "star128": lambda g: [star(128)],
    "bushy128_depth16": lambda g: [bushy_tree(128, g)],
    "mixed_batch": lambda g: [bushy_tree(100, g), chain(9), star(12), torch.tensor([-1]), random_tree(30, g)],
    "n65_not_tile_multiple": lambda g: [bushy_tree(65, g), bushy_tree(33, g)],
}


def _v8_launch(c, **kw):
    """Version 8's launch into NaN-poisoned outputs (it must be the kernel that runs): (o, delta)."""
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    launches, o, d = kgdn.verify_launches(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"],
                                          c["state_indices"], return_delta=True, variant=8, **kw)
    want = ["gdn_tree_verify_paths"] if "-DP8_PREGRAM=0" in kw.get("extra_options", ()) else \
        ["gdn_tree_paths_solve", "gdn_tree_verify_paths"]
    assert [kname for kname, _ in launches] == want
    before = c["ssm_state"].clone()
    o.fill_(float("nan"))
    d.fill_(float("nan"))
    for _, fn in launches:
        fn()
    torch.cuda.synchronize()
    assert not o.isnan().any() and not d.isnan().any(), "verify left output elements unwritten"
    assert torch.equal(c["ssm_state"], before), "verify wrote the state"
    return o, d


@pytest.mark.parametrize("block_v", [32, 64])
@pytest.mark.parametrize("group", [3, 1])
@pytest.mark.parametrize("name", list(V8_SETS))
def test_verify_v8_bf16_matches_float64_reference(name, group, block_v):
    # version 8 (trees of <= 128 nodes, paths of <= 17, a CTA per value head and 32 / 64 V columns) at K = V = 128
    # on every tree set: n = 1, a chain of 17 (depth 16), a star of 128, 128 nodes of depth 16, a mixed batch,
    # n not a multiple of 16
    trees = V8_SETS[name](_seeded(len(name) + group))
    c = make_case(trees, h=2, hv=2 * group, dtype=torch.bfloat16, seed=7 + group)
    o, d = _v8_launch(c, extra_options=(f"-DP8_BV={block_v}",))
    o_ref, d_ref = reference(c)
    assert rel(o, o_ref) <= HALF_TOL and rel(d, d_ref) <= FP32_TOL, (rel(o, o_ref), rel(d, d_ref))
    o6, d6 = run_poisoned(c, variant=6)
    assert rel(d, d6) <= 1e-6  # version 6: the same function summed in another order


@pytest.mark.parametrize("batch", [1, 8])
def test_verify_v8_at_the_27b_shape_equals_version_6_within_rounding(batch):
    # the 27B layer (16 q/k heads, 48 value heads) at n = 128, depth <= 16 (issue 5's size): version 8 against
    # the float64 reference and version 6; both V widths bit for bit
    gen = _seeded(80 + batch)
    c = make_case([bushy_tree(128, gen) for _ in range(batch)], h=16, hv=48, dtype=torch.bfloat16, seed=81)
    o8, d8 = _v8_launch(c)
    o32, d32 = _v8_launch(c, extra_options=("-DP8_BV=32",))
    assert torch.equal(o8, o32) and torch.equal(d8, d32)
    o6, d6 = run_poisoned(c, variant=6)
    o_ref, d_ref = reference(c)
    assert rel(o8, o_ref) <= HALF_TOL and rel(d8, d_ref) <= FP32_TOL, (rel(o8, o_ref), rel(d8, d_ref))
    assert rel(d8, d6) <= 1e-6 and rel(o8.float(), o6.float()) <= HALF_TOL


def test_verify_v8_two_ctas_a_sm_equal_one():
    # the 27B layer at n = 65, batch 8: 768 CTAs whose shared memory fits twice an SM, so the wrapper runs CTAs of
    # 8 warps (paths_warps); the same numbers as 16 warps bit for bit (which warp computes a tile changes, not its
    # arithmetic), and within the bars of the float64 reference
    gen = _seeded(85)
    c = make_case([bushy_tree(65, gen) for _ in range(8)], h=16, hv=48, dtype=torch.bfloat16, seed=86)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    assert kgdn.paths_warps(plan, 16, 48, 128, 128, 64, sms) == 8
    launches, _, _ = kgdn.verify_launches(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"],
                                          c["state_indices"], variant=8)
    assert dict(launches)["gdn_tree_verify_paths"].config[1] == (256, 1, 1)
    o8, d8 = _v8_launch(c)
    o16, d16 = _v8_launch(c, extra_options=("-DP8_WARPS=16",))
    assert torch.equal(o8, o16) and torch.equal(d8, d16)
    o_ref, d_ref = reference(c)
    assert rel(o8, o_ref) <= HALF_TOL and rel(d8, d_ref) <= FP32_TOL, (rel(o8, o_ref), rel(d8, d_ref))


@pytest.mark.parametrize("batch", [1, 8])
def test_verify_v8_replayed_in_a_cuda_graph_equals_eager(batch):
    # the solve kernel and the verify kernel (programmatic dependent launch) captured in a CUDA graph, as the runtime
    # and the bench run them: each replay, with other q / k / v / g / beta / S0 copied into the captured inputs, gives
    # the eager launches' outputs bit for bit (the verify reads T and W only after the solve kernel's writes), at the
    # 27B shape, n = 128
    gen = _seeded(90 + batch)
    c = make_case([bushy_tree(128, gen) for _ in range(batch)], h=16, hv=48, dtype=torch.bfloat16, seed=91)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    launches, o, d = kgdn.verify_launches(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"],
                                          c["state_indices"], return_delta=True, variant=8)
    assert [kname for kname, _ in launches] == ["gdn_tree_paths_solve", "gdn_tree_verify_paths"]
    for _, fn in launches:  # loaded before the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _, fn in launches:
            fn()
    for seed in (92, 93):
        new = make_case([bushy_tree(128, _seeded(90 + batch)) for _ in range(batch)], h=16, hv=48,
                        dtype=torch.bfloat16, seed=seed)
        for name in ("q", "k", "v", "g", "beta", "ssm_state"):
            c[name].copy_(new[name])
        o.fill_(float("nan"))
        d.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        o_graph, d_graph = o.clone(), d.clone()
        o_eager, d_eager = _v8_launch(c)
        assert torch.equal(o_graph, o_eager) and torch.equal(d_graph, d_eager), seed


def test_verify_v8_large_gates_and_two_part_split():
    # gates of -40 a step (decays formed on ancestor pairs only), and S0 in two bf16 parts (P8_SPLIT=2):
    # within the bars, not the three-part numbers
    g = _seeded(12)
    c = make_case([bushy_tree(90, g), star(40), chain(17)], dtype=torch.bfloat16, seed=13, g_scale=40.0)
    o, d = _v8_launch(c)
    assert torch.isfinite(o).all() and torch.isfinite(d).all()
    o_ref, d_ref = reference(c)
    assert rel(o, o_ref) <= HALF_TOL and rel(d, d_ref) <= FP32_TOL
    c2 = make_case([bushy_tree(128, g)], dtype=torch.bfloat16, seed=14)
    o3, d3 = _v8_launch(c2)
    o2, d2 = _v8_launch(c2, extra_options=("-DP8_SPLIT=2",))
    o_ref2, d_ref2 = reference(c2)
    assert rel(o2, o_ref2) <= HALF_TOL and rel(d2, d_ref2) <= FP32_TOL, (rel(o2, o_ref2), rel(d2, d_ref2))
    assert not torch.equal(d2, d3)


@pytest.mark.parametrize("name", list(V8_SETS))
def test_verify_v8_solve_kernel_and_clusters(name):
    # the solve kernel alone against its float64 reference (the same entries written into a NaN-poisoned output,
    # each value head's rows of T and W within 1e-5); the solve in the verify kernel (P8_PREGRAM=0) bit for bit as
    # the two launches (the same arithmetic) and within the bars, and with clusters of 2, 3 and 6 of a q/k head's
    # CTAs sharing its grams (P8_CLUSTER) bit for bit as without
    c = make_case(V8_SETS[name](_seeded(len(name) + 9)), h=2, hv=6, dtype=torch.bfloat16, seed=19)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    made, _, _ = kgdn.verify_launches(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"],
                                      c["state_indices"], variant=8)
    solve = dict(made)["gdn_tree_paths_solve"]
    solve.tw.fill_(float("nan"))
    solve()
    torch.cuda.synchronize()
    got = solve.tw.view(6, 2, -1).cpu()
    want = kgdn.paths_solve_reference(plan, c["q"], c["k"], c["g"], c["beta"])
    assert torch.equal(got.isnan(), want.isnan())
    for part in (0, 1):  # T, W
        live = ~want[:, part].isnan()
        assert rel(got[:, part][live], want[:, part][live]) <= 1e-5, part
    o, d = _v8_launch(c, extra_options=("-DP8_PREGRAM=0",))
    o2, d2 = _v8_launch(c)
    assert torch.equal(o2, o) and torch.equal(d2, d)
    o_ref, d_ref = reference(c)
    assert rel(o, o_ref) <= HALF_TOL and rel(d, d_ref) <= FP32_TOL, (rel(o, o_ref), rel(d, d_ref))
    for cl in (2, 3, 6):
        o1, d1 = _v8_launch(c, extra_options=("-DP8_PREGRAM=0", f"-DP8_CLUSTER={cl}"))
        assert torch.equal(o1, o) and torch.equal(d1, d), cl


@pytest.mark.parametrize("name", list(V8_SETS))
def test_verify_v8_output_layouts_agree(name):
    # a warp, a half or a quarter warp per node in phase 3 (P8_OUTW=1 / 2 / 4, BV 32 and 64) changes which lanes sum
    # an output, not the arithmetic: bit for bit
    c = make_case(V8_SETS[name](_seeded(len(name) + 5)), h=2, hv=6, dtype=torch.bfloat16, seed=17)
    o, d = _v8_launch(c)
    for opts in (("-DP8_OUTW=1",), ("-DP8_OUTW=2",), ("-DP8_BV=32", "-DP8_OUTW=1"), ("-DP8_BV=32", "-DP8_OUTW=2")):
        o1, d1 = _v8_launch(c, extra_options=opts)
        assert torch.equal(o1, o) and torch.equal(d1, d), opts


@pytest.mark.parametrize("name", ["mixed_batch", "deep70", "star33"])
def test_verify_v6_path_solve_equals_level_solve(name):
    # the path solve (G6_SOLVE=1: rows of (I + X)^-1 and Y (I + X)^-1 over each node's path, then gathers;
    # the wrapper's choice for small shallow trees) against the level-by-level substitution (G6_SOLVE=0), both
    # forced, at the 27B group (3 value heads per q/k head): both within the bars against float64, and within
    # float32 rounding of each other; deep70 has depth 55
    trees = [deep_tree(70, _seeded(42))] if name == "deep70" else TREE_SETS[name](_seeded(len(name) + 40))
    c = make_case(trees, h=2, hv=6, dtype=torch.bfloat16, seed=41)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    o_ref, d_ref = reference(c)
    outs = []
    for opts in (("-DG6_SOLVE=1",), ("-DG6_SOLVE=0",)):
        launches, o, d = kgdn.verify_launches(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"],
                                              c["state_indices"], return_delta=True, variant=6, extra_options=opts)
        assert [kname for kname, _ in launches] == ["gdn_tree_verify_grouped"]
        o.fill_(float("nan"))
        d.fill_(float("nan"))
        for _, fn in launches:
            fn()
        torch.cuda.synchronize()
        assert rel(o, o_ref) <= HALF_TOL and rel(d, d_ref) <= FP32_TOL, (opts, rel(o, o_ref), rel(d, d_ref))
        outs.append((o, d))
    assert rel(outs[0][1], outs[1][1]) <= 1e-6


@pytest.mark.parametrize("threads", [512, 256])
@pytest.mark.parametrize("name", ["mixed_batch", "n128", "chain16"])
def test_verify_v6_cluster_equals_no_cluster_bit_for_bit(name, threads):
    # G6_CLUSTER: the 8 V-slice CTAs of a (request, q/k head) split the gram tiles over a thread block cluster and
    # store each product into every CTA's shared memory; the same tiles and arithmetic, so every cluster size
    # gives the outputs of none bit for bit (27B group of 3 value heads, K = V = 128)
    gen = _seeded(len(name) + 50)
    trees = [random_tree(128, gen), random_tree(100, gen)] if name == "n128" else TREE_SETS[name](gen)
    c = make_case(trees, h=2, hv=6, dtype=torch.bfloat16, seed=51)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    outs = []
    for cl in (1, 2, 4, 8):
        launches, o, d = kgdn.verify_launches(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"],
                                              c["state_indices"], return_delta=True, variant=6, threads6=threads,
                                              extra_options=(f"-DG6_CLUSTER={cl}",))
        assert [kname for kname, _ in launches] == ["gdn_tree_verify_grouped"]
        o.fill_(float("nan"))
        d.fill_(float("nan"))
        launches[0][1]()
        torch.cuda.synchronize()
        outs.append((o, d))
    o_ref, d_ref = reference(c)
    assert rel(outs[0][0], o_ref) <= HALF_TOL and rel(outs[0][1], d_ref) <= FP32_TOL
    for cl, (o, d) in zip((2, 4, 8), outs[1:]):
        assert torch.equal(o, outs[0][0]) and torch.equal(d, outs[0][1]), cl


@pytest.mark.parametrize("variant", [4, 5])
@pytest.mark.parametrize("block_v", [16, 32, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_verify_v4_and_v5_equal_v3_bit_for_bit(dtype, block_v, variant):
    # version 4 stages whole tiles of the 16-bit q/k rows, version 5 overlaps the pairs kernel by
    # programmatic dependent launch; both issue version 3's arithmetic in version 3's order, so on the
    # tensor cores too the outputs must be identical (several tiles, depth 64, a chain, a star, n = 1)
    g = _seeded(31)
    c = make_case([bushy_tree(150, g), deep_tree(70, g), chain(33), star(9), torch.tensor([-1])], dtype=dtype, seed=9)
    o_new, d_new = run_poisoned(c, block_v=block_v, variant=variant)
    o3, d3 = run_poisoned(c, block_v=block_v, variant=3)
    assert torch.equal(o_new, o3) and torch.equal(d_new, d3)
    o_ref, d_ref = reference(c)
    assert rel(o_new, o_ref) <= (FP32_TOL if dtype == torch.float32 else HALF_TOL) and rel(d_new, d_ref) <= FP32_TOL


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("block_v", [16, 32, 64])
def test_verify_every_block_width(block_v, variant):
    g = _seeded(8)
    c = make_case([bushy_tree(130, g), star(7), deep_tree(30, g)], seed=3)
    o, d = run_poisoned(c, block_v=block_v, variant=variant)
    o_ref, d_ref = reference(c)
    assert rel(o, o_ref) <= FP32_TOL and rel(d, d_ref) <= FP32_TOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_verify_int32_and_int64_state_indices_agree(variant):
    g = _seeded(20)
    c = make_case([bushy_tree(40, g), chain(6)], dtype=torch.bfloat16, seed=8, slots=5)
    o64, d64 = run_poisoned(c, variant=variant)
    o32, d32 = run_poisoned(dict(c, state_indices=c["state_indices"].to(torch.int32)), variant=variant)
    assert torch.equal(o32, o64) and torch.equal(d32, d64)
    o_ref, _ = reference(c)
    assert rel(o64, o_ref) <= HALF_TOL


def test_verify_unknown_variant_is_a_clear_error():
    c = make_case([chain(3)], seed=9)
    with pytest.raises(ValueError, match="variant=9 is not a verify kernel version"):
        run_poisoned(c, variant=9)


def test_verify_without_l2norm_and_custom_scale_and_gqa_group_of_one():
    g = _seeded(9)
    c = make_case([random_tree(33, g), chain(5)], h=4, hv=4, kd=64, vd=64, seed=4)
    o, d = run_poisoned(c, scale=0.37, use_qk_l2norm=False)
    o_ref, d_ref = reference(c, scale=0.37, use_qk_l2norm=False)
    assert rel(o, o_ref) <= FP32_TOL and rel(d, d_ref) <= FP32_TOL


@pytest.mark.parametrize("variant", VARIANTS)
def test_verify_large_gates_masked_before_exp(variant):
    # gates of -40 per step: exp(G_i - G_j) over siblings would overflow if formed; ancestors underflow
    g = _seeded(10)
    c = make_case([deep_tree(90, g), star(40), bushy_tree(60, g)], seed=5, g_scale=40.0)
    o, d = run_poisoned(c, variant=variant)
    assert torch.isfinite(o).all() and torch.isfinite(d).all()
    o_ref, d_ref = reference(c)
    assert rel(o, o_ref) <= FP32_TOL and rel(d, d_ref) <= FP32_TOL


def test_verify_is_deterministic_across_runs():
    g = _seeded(11)
    c = make_case([bushy_tree(200, g), random_tree(77, g)], dtype=torch.bfloat16, seed=6)
    first = run_poisoned(c)
    for _ in range(3):
        again = run_poisoned(c)
        assert torch.equal(again[0], first[0]) and torch.equal(again[1], first[1])


def _tf32_round(x: torch.Tensor) -> torch.Tensor:
    """float32 -> tf32 in float64, round to nearest with ties away from zero (cvt.rna.tf32.f32)."""
    mant, expo = torch.frexp(x.double())
    scaled = mant * 2.0**11
    return torch.ldexp(torch.sign(scaled) * torch.floor(scaled.abs() + 0.5) / 2.0**11, expo)


@pytest.mark.parametrize("seed", [0, 1])
def test_tf32_mma_primitives_on_the_gpu_match_float64(seed):
    """cuda/tfm_mma_check.cu on the tensor cores: cvt.rna.tf32 bit for bit, one m16n8k8 tf32 mma as
    float64 of the rounded operands (to float32 accumulation), 3xTF32 as the float32-accurate product.
    The CPU emulation is held to the same numbers (tests/cpu/test_tf32_mma.py)."""
    from vllm_tfm.kernels import loader

    gen = _seeded(seed)
    a, b, c = torch.randn(16, 8, generator=gen), torch.randn(8, 8, generator=gen), torch.randn(16, 8, generator=gen)
    a *= torch.exp2(torch.randint(-6, 6, (16, 1), generator=gen).float())
    a.view(-1)[0] = 1.0 + 2.0**-11  # a tie: away from zero
    d1, d3 = (torch.full((16, 8), float("nan"), device=DEV) for _ in range(2))
    hi, lo = (torch.zeros(16, 8, dtype=torch.int32, device=DEV) for _ in range(2))
    kern = loader.get_kernel("tfm_mma_check.cu", "tfm_mma_tf32_check", ["--std=c++17"], torch.cuda.current_device())
    loader.launch(kern, (1, 1, 1), (32, 1, 1), [a.to(DEV), b.to(DEV), c.to(DEV), d1, d3, hi, lo])
    torch.cuda.synchronize()
    hi_f = hi.cpu().view(torch.float32)
    assert torch.equal(hi_f.double(), _tf32_round(a)) and hi_f[0, 0].item() == 1.0 + 2.0**-10
    assert torch.equal(lo.cpu().view(torch.float32).double(), _tf32_round(a - hi_f))
    want1 = c.double() + _tf32_round(a) @ _tf32_round(b)
    scale1 = c.double().abs() + _tf32_round(a).abs() @ _tf32_round(b).abs()
    assert ((d1.cpu().double() - want1).abs() / scale1).max() <= 2.0**-20  # unspecified accumulation: a few ulps
    exact = c.double() + a.double() @ b.double()
    scale3 = c.double().abs() + a.double().abs() @ b.double().abs()
    assert ((d3.cpu().double() - exact).abs() / scale3).max() <= 2e-6


# ---------------------------------------------------------------------------------------------
# commit


@pytest.mark.parametrize("kdtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("pattern", ["in_place", "shifted", "cross_alias"])
def test_commit_matches_float64_reference(kdtype, pattern):
    g = _seeded(12)
    trees = [bushy_tree(64, g), chain(30), torch.tensor([-1]), deep_tree(80, g)]
    c = make_case(trees, dtype=kdtype, seed=7, slots=6)
    _, delta = run_poisoned(c)
    gen = _seeded(13)
    accepted = [int(torch.randint(0, t.numel(), (1,), generator=gen)) for t in trees]
    accepted[1] = 29  # the whole chain
    src = {"in_place": [0, 1, 2, 3], "shifted": [0, 1, 2, 3], "cross_alias": [4, 4, 1, 0]}[pattern]
    dst = {"in_place": [0, 1, 2, 3], "shifted": [1, 2, 3, 4], "cross_alias": [0, 1, 2, 3]}[pattern]
    st = c["ssm_state"].clone()
    st_ref = c["ssm_state"].double().clone()
    args = (c["parents"], c["cu_nodes"], torch.tensor(accepted, device=DEV))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kgdn.gdn_tree_commit(c["k"], c["g"], delta, *args, st, torch.tensor(src, device=DEV), torch.tensor(dst, device=DEV))
    ref_gdn.gdn_tree_commit(c["k"].double(), c["g"].double(), delta.double(), *args, st_ref,
                            torch.tensor(src, device=DEV), torch.tensor(dst, device=DEV))
    assert rel(st[dst], st_ref[dst]) <= FP32_TOL
    untouched = [s for s in range(6) if s not in dst]
    assert torch.equal(st[untouched], c["ssm_state"][untouched])


# ---------------------------------------------------------------------------------------------
# conv


def conv_case(trees, dim=640, width=4, state_len=6, dtype=torch.bfloat16, state_dtype=None, seed=0, transposed=False):
    gen = _seeded(seed)
    parents, cu = ragged(trees)
    t, r = parents.numel(), len(trees)
    state_dtype = state_dtype or dtype
    if transposed:  # a strided view, as a [slots, L, D] buffer seen as [slots, D, L]
        cs = torch.randn(r + 2, state_len, dim, generator=gen).to(state_dtype).transpose(1, 2)
    else:
        cs = torch.randn(r + 2, dim, state_len, generator=gen).to(state_dtype)
    c = dict(x=torch.randn(t, dim, generator=gen).to(dtype), parents=parents, cu_nodes=cu, conv_state=cs,
             state_indices=torch.randperm(r + 2, generator=gen)[:r], weight=torch.randn(dim, width, generator=gen).to(dtype),
             bias=torch.randn(dim, generator=gen).to(dtype),
             window_start=torch.randint(0, state_len - width + 2, (r,), generator=gen))
    return {k: v.to(DEV) for k, v in c.items()}


@pytest.mark.parametrize("unrolled", ["0", "1"])  # VLLM_TFM_TREE_CONV_UNROLLED: the width compiled in or not
@pytest.mark.parametrize("dtype, tol", [(torch.float32, FP32_TOL), (torch.bfloat16, HALF_TOL)])
@pytest.mark.parametrize("activation, with_bias, transposed", [("silu", True, False), (None, False, True)])
def test_tree_conv1d_matches_reference(monkeypatch, dtype, tol, activation, with_bias, transposed, unrolled):
    monkeypatch.setenv(kconv.UNROLLED_SWITCH, unrolled)
    g = _seeded(14)
    c = conv_case([bushy_tree(70, g), chain(3), torch.tensor([-1]), star(9)], dtype=dtype, seed=15, transposed=transposed)
    if not with_bias:
        c["bias"] = None
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    before = c["conv_state"].clone()
    y = torch.full(c["x"].shape, float("nan"), dtype=dtype, device=DEV)
    kconv.tree_causal_conv1d_planned(plan, c["x"], c["conv_state"], c["state_indices"], c["weight"], c["bias"],
                                     activation, c["window_start"], out=y)
    torch.cuda.synchronize()
    assert not y.isnan().any()
    assert torch.equal(c["conv_state"], before)
    c64 = {k: (v.double() if v is not None and v.is_floating_point() else v) for k, v in c.items()}
    y_ref = ref_conv.tree_causal_conv1d(**c64, activation=activation)
    assert rel(y, y_ref) <= tol
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y2 = kconv.tree_causal_conv1d(**c, activation=activation)
    assert torch.equal(y2, y)


@pytest.mark.parametrize("unrolled", ["0", "1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("strided", [False, True])
def test_tree_conv1d_extras_equal_the_separate_operations(monkeypatch, dtype, strided, unrolled):
    """The conv launch's extras (the GDN layer's prologue): q and k blocks equal to y's columns, the copy
    of x equal to x, the gates equal to gdn_gates' (the same float32 operations: bit for bit on the GPU,
    checked to 1 ulp-scale here and counted), y's other columns unchanged; rows of a, b, x, g, beta
    with strides (as views of wider projection outputs are)."""
    monkeypatch.setenv(kconv.UNROLLED_SWITCH, unrolled)
    g = _seeded(31)
    trees = [bushy_tree(70, g), chain(3), torch.tensor([-1]), star(9)]
    kd, hv, vd = 2 * 64, 6, 6 * 32  # q | k | v columns: 2 kd + vd
    dim = 2 * kd + vd
    c = conv_case(trees, dim=dim, dtype=dtype, seed=32)
    t = c["x"].shape[0]
    gen = _seeded(33)
    pad = 5 if strided else 0
    x_wide = torch.randn(t, dim + pad, generator=gen).to(dtype).to(DEV)
    x = x_wide[:, :dim]
    ab = (8 * torch.randn(t, 2 * hv + pad, generator=gen)).to(dtype).to(DEV)
    ab[0, 0] = 30.0  # past softplus's threshold
    a, b = ab[:, :hv], ab[:, hv : 2 * hv]
    a_log = torch.rand(hv, generator=gen).log().to(DEV)
    dt_bias = torch.randn(hv, generator=gen).to(dtype).to(DEV)
    constants = ref_gdn.gate_constants(a_log, dt_bias)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    args = (plan, x, c["conv_state"], c["state_indices"], c["weight"], c["bias"], "silu", c["window_start"])
    y0 = kconv.tree_causal_conv1d_planned(*args)
    g_buf = torch.full((t, hv + pad), float("nan"), device=DEV)
    gout, beta = g_buf[:, :hv], torch.full((t, hv), float("nan"), device=DEV)
    qk = torch.full((2, t, kd), float("nan"), dtype=dtype, device=DEV)
    x_copy = torch.full((t, dim), float("nan"), dtype=dtype, device=DEV)
    extras = kconv.ConvExtras(qk_out=qk, qk_cols=kd, x_copy=x_copy, gates=(a, b, *constants, gout, beta))
    assert kconv.extras_unsupported_reason(x, extras) is None
    y = torch.full((t, dim), float("nan"), dtype=dtype, device=DEV)
    kconv.tree_causal_conv1d_planned(*args, out=y, extras=extras)
    torch.cuda.synchronize()
    assert torch.equal(qk[0], y0[:, :kd]) and torch.equal(qk[1], y0[:, kd : 2 * kd])
    assert torch.equal(y[:, 2 * kd :], y0[:, 2 * kd :]) and y[:, : 2 * kd].isnan().all()  # q, k columns left alone
    assert torch.equal(x_copy, x)
    g_ref, beta_ref = ref_gdn.gdn_gates(a, b, a_log, dt_bias, constants)
    assert torch.allclose(gout, g_ref, rtol=1e-6, atol=0) and torch.allclose(beta, beta_ref, rtol=1e-6, atol=0)
    print(f"gates bit for bit: g {torch.equal(gout, g_ref)}, beta {torch.equal(beta, beta_ref)}")
    assert g_buf[:, hv:].isnan().all()  # nothing past the rows' HV columns
    bad = kconv.ConvExtras(qk_out=qk[:, :-1], qk_cols=kd)
    assert "qk_out must be" in kconv.extras_unsupported_reason(x, bad)


@pytest.mark.parametrize("width", [2, 4, 8])
def test_tree_conv1d_builds_with_and_without_the_width_compiled_in_are_bit_equal(monkeypatch, width):
    """VLLM_TFM_TREE_CONV_UNROLLED changes when the loads are issued, not the arithmetic or its order."""
    g = _seeded(40 + width)
    c = conv_case([bushy_tree(70, g), chain(13), torch.tensor([-1]), star(9), bushy_tree(17, g)], dtype=torch.bfloat16,
                  seed=41 + width, width=width, state_len=width + 2)
    plan = TreePlan.build(c["parents"], c["cu_nodes"])
    ys = []
    for unrolled in ("0", "1"):
        monkeypatch.setenv(kconv.UNROLLED_SWITCH, unrolled)
        ys.append(kconv.tree_causal_conv1d_planned(plan, c["x"], c["conv_state"], c["state_indices"], c["weight"],
                                                   c["bias"], "silu", c["window_start"]))
    assert torch.equal(ys[0], ys[1])


@pytest.mark.parametrize("pattern", ["in_place", "shifted", "cross_alias"])
def test_tree_conv_commit_equals_reference_exactly(pattern):
    g = _seeded(16)
    trees = [bushy_tree(40, g), chain(2), torch.tensor([-1]), deep_tree(20, g)]
    c = conv_case(trees, dtype=torch.float32, state_dtype=torch.bfloat16, seed=17)
    gen = _seeded(18)
    accepted = torch.tensor([int(torch.randint(0, t.numel(), (1,), generator=gen)) for t in trees], device=DEV)
    src = {"in_place": [0, 1, 2, 3], "shifted": [0, 1, 2, 3], "cross_alias": [5, 5, 1, 0]}[pattern]
    dst = {"in_place": [0, 1, 2, 3], "shifted": [1, 2, 3, 4], "cross_alias": [0, 1, 2, 3]}[pattern]
    starts = [torch.tensor(s, device=DEV) for s in ([1, 0, 2, 0], [0, 2, 1, 2])]
    st, st_ref = c["conv_state"].clone(), c["conv_state"].clone()
    args = (c["x"], c["parents"], c["cu_nodes"], accepted)
    idx = (torch.tensor(src, device=DEV), torch.tensor(dst, device=DEV), 4, *starts)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kconv.tree_conv_commit(*args, st, *idx)
    ref_conv.tree_conv_commit(*args, st_ref, *idx)
    assert torch.equal(st, st_ref)


# ---------------------------------------------------------------------------------------------
# cross-check of conventions against vLLM's own recurrent GDN kernel (when vLLM is importable)


def test_chain_matches_vllm_fused_recurrent_kernel():
    try:
        from vllm.third_party.flash_linear_attention.ops.fused_sigmoid_gating import (
            fused_sigmoid_gating_delta_rule_update,
        )
    except Exception as exc:  # noqa: BLE001 - vLLM missing or not importable on this host
        pytest.skip(f"vLLM's fused recurrent kernel is not importable: {exc}")
    gen = _seeded(19)
    n, h, hv, kd, vd = 12, 2, 6, 128, 128
    a, b = torch.randn(n, hv, generator=gen), torch.randn(n, hv, generator=gen)
    a_log, dt_bias = torch.rand(hv, generator=gen) * 2, torch.randn(hv, generator=gen) * 0.5
    g, beta = ref_gdn.gdn_gates(a, b, a_log, dt_bias)
    q, k = (torch.randn(n, h, kd, generator=gen).to(torch.bfloat16) for _ in range(2))
    v = torch.randn(n, hv, vd, generator=gen).to(torch.bfloat16)
    pool = torch.randn(3, hv, vd, kd, generator=gen) * 0.3
    q, k, v, g, beta, pool, a, b, a_log, dt_bias = (x.to(DEV) for x in (q, k, v, g, beta, pool, a, b, a_log, dt_bias))
    parents, cu = chain(n).to(DEV), torch.tensor([0, n], device=DEV)
    o, delta = kgdn.gdn_tree_verify(q, k, v, g, beta, parents, cu, pool, torch.tensor([1], device=DEV), return_delta=True)
    vstate = pool.clone()
    vo, _ = fused_sigmoid_gating_delta_rule_update(
        a_log, a, b, dt_bias, q[None], k[None], v[None], beta=1.0, threshold=20.0, scale=kd**-0.5,
        initial_state=vstate, inplace_final_state=True, cu_seqlens=cu.to(torch.int32),
        ssm_state_indices=torch.ones(1, n, dtype=torch.int32, device=DEV), use_qk_l2norm_in_kernel=True,
    )
    assert rel(o, vo.reshape(n, hv, vd)) <= HALF_TOL
    ours = pool.clone()
    kgdn.gdn_tree_commit(k, g, delta, parents, cu, torch.tensor([n - 1], device=DEV), ours,
                         torch.tensor([1], device=DEV), torch.tensor([1], device=DEV))
    assert rel(ours[1], vstate[1]) <= 1e-4
