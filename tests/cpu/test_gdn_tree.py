"""GDN tree verify/commit (vllm_tfm.verify.gdn) against the per-path chain recurrence, in float64.

The oracle for node i is gdn_chain_recurrence run from the request's committed state S0 over the
root..i path; gdn_chain_recurrence itself is checked against an independent K-first loop below.
"""

from __future__ import annotations

import math

import pytest
import torch

from _trees import path_of, ragged, random_tree_parents
from vllm_tfm.verify.gdn import gdn_chain_chunked, gdn_chain_recurrence, gdn_gates, gdn_tree_commit, gdn_tree_verify

F64 = torch.float64


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want|, in float64."""
    return float((got.to(F64) - want.to(F64)).abs().max() / want.to(F64).abs().max())


def make_case(parent_list, h=1, hv=2, kd=8, vd=8, num_slots=None, seed=0, g_override=None):
    """Random float64 inputs for a ragged batch; g and beta come from gdn_gates."""
    gen = torch.Generator().manual_seed(seed)
    parents, cu = ragged(parent_list)
    t = parents.numel()
    r = len(parent_list)
    num_slots = num_slots or r + 2
    a = torch.randn(t, hv, generator=gen, dtype=F64)
    b = torch.randn(t, hv, generator=gen, dtype=F64)
    a_log = torch.log(torch.rand(hv, generator=gen, dtype=F64) * 0.9 + 0.1)
    dt_bias = torch.randn(hv, generator=gen, dtype=F64) * 0.5
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    if g_override is not None:
        g = g_override(gen, t, hv)
    return dict(
        q=torch.randn(t, h, kd, generator=gen, dtype=F64),
        k=torch.randn(t, h, kd, generator=gen, dtype=F64),
        v=torch.randn(t, hv, vd, generator=gen, dtype=F64),
        g=g,
        beta=beta,
        parents=parents,
        cu_nodes=cu,
        ssm_state=torch.randn(num_slots, hv, vd, kd, generator=gen, dtype=F64) * 0.5,
        state_indices=torch.randperm(num_slots, generator=gen)[:r],
    )


def per_path_oracle(c) -> torch.Tensor:
    """o[i] = last output of the chain recurrence over node i's root..i path, from S0."""
    out = torch.empty_like(c["v"])
    cu = c["cu_nodes"].tolist()
    for r, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        s0 = c["ssm_state"][int(c["state_indices"][r])]
        for i in range(e - s):
            p = torch.tensor(path_of(c["parents"][s:e], i)) + s
            o, _ = gdn_chain_recurrence(c["q"][p], c["k"][p], c["v"][p], c["g"][p], c["beta"][p], s0)
            out[s + i] = o[-1]
    return out


def verify(c, **kw):
    return gdn_tree_verify(c["q"], c["k"], c["v"], c["g"], c["beta"], c["parents"], c["cu_nodes"],
                           c["ssm_state"], c["state_indices"], **kw)


def max_depth(parents: torch.Tensor) -> int:
    return max(len(path_of(parents, i)) - 1 for i in range(parents.numel()))


# ---------------------------------------------------------------------------------------------
# gates and the chain oracle


def test_gates_match_vllm_formula_including_softplus_threshold():
    a = torch.tensor([[-30.0, -1.0], [0.5, 19.0], [19.9, 25.0]], dtype=F64)
    b = torch.tensor([[-3.0, 0.0], [1.0, 2.0], [10.0, -10.0]], dtype=F64)
    a_log = torch.tensor([0.3, -1.2], dtype=F64)
    dt_bias = torch.tensor([0.05, 0.5], dtype=F64)
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    x = a + dt_bias
    softplus = torch.where(x <= 20.0, torch.log1p(torch.exp(x)), x)  # vLLM: x if x > 20
    assert (x > 20).any() and (x <= 20).any()
    torch.testing.assert_close(g, -torch.exp(a_log) * softplus, rtol=1e-15, atol=0)
    torch.testing.assert_close(beta, 1.0 / (1.0 + torch.exp(-b)), rtol=1e-15, atol=0)
    g32, beta32 = gdn_gates(a.bfloat16(), b.bfloat16(), a_log.float(), dt_bias.float())
    assert g32.dtype == torch.float32 and beta32.dtype == torch.float32


@pytest.mark.parametrize("group", [1, 2, 4])
def test_chain_recurrence_matches_independent_k_first_loop(group):
    """An FLA-layout (S[k, v]) loop written here; checks V-first orientation and GVA h // group."""
    gen = torch.Generator().manual_seed(group)
    length, h, kd, vd = 6, 2, 5, 3
    hv = h * group
    q = torch.randn(length, h, kd, generator=gen, dtype=F64)
    k = torch.randn(length, h, kd, generator=gen, dtype=F64)
    v = torch.randn(length, hv, vd, generator=gen, dtype=F64)
    g = -torch.rand(length, hv, generator=gen, dtype=F64)
    beta = torch.rand(length, hv, generator=gen, dtype=F64)
    state0 = torch.randn(hv, vd, kd, generator=gen, dtype=F64)
    state0_copy = state0.clone()
    o, state = gdn_chain_recurrence(q, k, v, g, beta, state0, scale=0.7)
    assert torch.equal(state0, state0_copy)
    for head in range(hv):
        s_kv = state0[head].T.clone()  # [K, V]
        for t in range(length):
            qt = q[t, head // group] / math.sqrt(float((q[t, head // group] ** 2).sum()) + 1e-6) * 0.7
            kt = k[t, head // group] / math.sqrt(float((k[t, head // group] ** 2).sum()) + 1e-6)
            s_kv = math.exp(float(g[t, head])) * s_kv
            d = float(beta[t, head]) * (v[t, head] - s_kv.T @ kt)
            s_kv = s_kv + torch.outer(kt, d)
            torch.testing.assert_close(o[t, head], s_kv.T @ qt, rtol=1e-13, atol=1e-13)
        torch.testing.assert_close(state[head], s_kv.T, rtol=1e-13, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# verify vs per-path recurrence


@pytest.mark.parametrize(
    "kind,n",
    [("random", 1), ("random", 23), ("star", 40), ("deep", 90), ("deep", 140), ("random", 256), ("random", 300)],
)
def test_verify_equals_per_path_recurrence(kind, n):
    parents = random_tree_parents(n, torch.Generator().manual_seed(n), kind)
    if kind == "deep":
        assert max_depth(parents) >= 64
    c = make_case([parents], seed=n)
    o = verify(c)
    assert o.dtype == F64 and o.shape == c["v"].shape
    assert rel_err(o, per_path_oracle(c)) < 1e-12


def test_chain_tree_equals_chain_recurrence_over_whole_sequence():
    n = 70  # crosses a tile boundary
    c = make_case([torch.arange(-1, n - 1)], h=2, hv=4, seed=7)
    o, delta = verify(c, return_delta=True)
    s0 = c["ssm_state"][int(c["state_indices"][0])]
    want, _ = gdn_chain_recurrence(c["q"], c["k"], c["v"], c["g"], c["beta"], s0)
    assert rel_err(o, want) < 1e-12
    assert delta.shape == c["v"].shape and delta.dtype == F64


@pytest.mark.parametrize("n", [1, 2, 63, 64, 65, 200])
@pytest.mark.parametrize("chunk", [1, 16, 64])
def test_chunked_chain_equals_per_token_recurrence(n, chunk):
    """The chunked form (float32 prefill) against the per-token oracle, float64, GVA group 2,
    a nonzero entering state, chunk boundaries inside, at and past the sequence's end."""
    c = make_case([torch.arange(-1, n - 1)], h=2, hv=4, seed=11 + n)
    s0 = c["ssm_state"][int(c["state_indices"][0])]
    want_o, want_s = gdn_chain_recurrence(c["q"], c["k"], c["v"], c["g"], c["beta"], s0, scale=0.3)
    o, s = gdn_chain_chunked(c["q"], c["k"], c["v"], c["g"], c["beta"], s0, scale=0.3, chunk=chunk)
    assert rel_err(o, want_o) < 1e-12 and rel_err(s, want_s) < 1e-12
    assert o.dtype == F64 and s.dtype == F64 and not torch.equal(s, s0)


def test_chunked_chain_with_large_gates_and_float32():
    """Gates of -40 per token: e^{G_i - G_j} for j > i overflows before its mask (it must be
    masked, not multiplied); float32 inputs give float32 math within rounding of float64."""
    n = 130
    c = make_case([torch.arange(-1, n - 1)], h=1, hv=2, seed=5,
                  g_override=lambda gen, t, hv: -40.0 * torch.rand(t, hv, generator=gen, dtype=F64))
    s0 = c["ssm_state"][0]
    want_o, want_s = gdn_chain_recurrence(c["q"], c["k"], c["v"], c["g"], c["beta"], s0)
    o, s = gdn_chain_chunked(c["q"], c["k"], c["v"], c["g"], c["beta"], s0)
    assert torch.isfinite(o).all() and rel_err(o, want_o) < 1e-12 and rel_err(s, want_s) < 1e-12
    f32 = {k: c[k].float() for k in ("q", "k", "v", "g", "beta")}
    o32, s32 = gdn_chain_chunked(f32["q"], f32["k"], f32["v"], f32["g"], f32["beta"], s0.float())
    r32, t32 = gdn_chain_recurrence(f32["q"], f32["k"], f32["v"], f32["g"], f32["beta"], s0.float())
    assert o32.dtype == torch.float32 and rel_err(o32, want_o) < 1e-4 and rel_err(s32, want_s) < 1e-4
    # no less accurate than the per-token recurrence in float32 (within a small factor)
    assert rel_err(o32, want_o) < 4 * rel_err(r32, want_o) + 1e-6 and rel_err(s32, want_s) < 4 * rel_err(t32, want_s) + 1e-6
    with pytest.raises(ValueError, match="chunk must be >= 1, got 0"):
        gdn_chain_chunked(c["q"], c["k"], c["v"], c["g"], c["beta"], s0, chunk=0)


@pytest.mark.parametrize("group", [2, 4])
def test_verify_gva_grouping(group):
    parents = random_tree_parents(30, torch.Generator().manual_seed(group), "random")
    c = make_case([parents], h=2, hv=2 * group, kd=6, vd=5, seed=group)
    assert rel_err(verify(c), per_path_oracle(c)) < 1e-12


def test_ragged_batch_permuted_shared_slots_and_state_untouched():
    gen = torch.Generator().manual_seed(3)
    trees = [random_tree_parents(37, gen, "random"), torch.arange(-1, 4), random_tree_parents(12, gen, "star"),
             torch.tensor([-1]), random_tree_parents(70, gen, "deep")]
    c = make_case(trees, h=2, hv=4, num_slots=6, seed=3)
    c["state_indices"] = torch.tensor([4, 1, 4, 0, 5])  # permuted, slot 4 shared by two requests
    before = c["ssm_state"].clone()
    o = verify(c)
    assert torch.equal(c["ssm_state"], before)  # bit-identical: verify never writes state
    assert rel_err(o, per_path_oracle(c)) < 1e-12


def test_large_gates_are_masked_before_exp():
    """|g| in [50, 100] per step: off-ancestor G_i - G_j exceeds 709, where exp overflows float64."""
    parents = random_tree_parents(40, torch.Generator().manual_seed(11), "deep")
    c = make_case([parents], seed=11,
                  g_override=lambda gen, t, hv: -(50.0 + 50.0 * torch.rand(t, hv, generator=gen, dtype=F64)))
    n = parents.numel()
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        anc[i, path_of(parents, i)] = True
    big_g = torch.stack([c["g"][path_of(parents, i)].sum(0) for i in range(n)])  # [n, HV]
    diff = big_g[:, None, :] - big_g[None, :, :]
    assert float(diff[~anc].max()) > 709.8  # an unmasked exp would give inf here
    o, delta = verify(c, return_delta=True)
    assert torch.isfinite(o).all() and torch.isfinite(delta).all()
    assert rel_err(o, per_path_oracle(c)) < 1e-12


@pytest.mark.parametrize(
    "kind,n,dim,g_mag",
    [
        # measured 3.5e-7 (3.3e-7..4.3e-7 over seeds 0..5); the DESIGN.md shape: n=64, K=V=128
        ("random", 64, 128, None),
        # measured 8.2e-7: path gates G = M g reach -161 at depth 76 and G_i - G_j loses |G| * eps
        # to cancellation (the fp32 per-path recurrence: 1.8e-7)
        ("deep", 100, 32, 2.0),
    ],
)
def test_float32_math_error_vs_float64(kind, n, dim, g_mag):
    """Relative error = max-abs error over max-abs value, vs the float64 per-path recurrence."""
    parents = random_tree_parents(n, torch.Generator().manual_seed(5), kind)
    override = None
    if g_mag is not None:
        override = lambda gen, t, hv: -g_mag * (0.5 + torch.rand(t, hv, generator=gen, dtype=F64))  # noqa: E731
    c = make_case([parents], h=1, hv=2, kd=dim, vd=dim, seed=5, g_override=override)
    want = per_path_oracle(c)
    c32 = {key: (val.float() if val.is_floating_point() else val) for key, val in c.items()}
    o32 = verify(c32)
    assert o32.dtype == torch.float32
    assert rel_err(o32, want) <= 1e-5


def bf16_case(seed):
    parents = random_tree_parents(64, torch.Generator().manual_seed(seed), "random")
    c = make_case([parents], h=1, hv=2, kd=128, vd=128, seed=seed)
    cb = dict(c)
    for key in ("q", "k", "v"):
        cb[key] = c[key].bfloat16()
    for key in ("g", "beta", "ssm_state"):
        cb[key] = c[key].float()
    return c, cb


def test_bf16_inputs_fp32_math_error_vs_float64():
    """n=64, K=V=128, q/k/v rounded to bf16, fp32 math and fp32 output (v passed as fp32 holding
    bf16 values). Measured: 2.2e-3 relative vs float64 on the unrounded inputs (1.5e-3..2.6e-3
    over seeds 0..5); with a bf16 output (v in bf16) it becomes 3.4e-3 (2.2e-3..3.6e-3), the
    output rounding alone being up to 2^-8 = 3.9e-3."""
    c, cb = bf16_case(6)
    want = per_path_oracle(c)
    o = verify(dict(cb, v=cb["v"].float()))
    assert o.dtype == torch.float32
    assert rel_err(o, want) <= 3e-3


def test_bf16_output_is_the_exact_result_rounded_once():
    """With bf16 inputs the math is fp32: o equals the float64 result on the same (rounded) inputs,
    rounded to bf16; measured 2 of 16384 elements one bf16 ulp off (fp32 noise at a rounding tie)."""
    c, cb = bf16_case(6)
    want = per_path_oracle(dict(c, q=cb["q"].double(), k=cb["k"].double(), v=cb["v"].double()))
    o = verify(cb)
    assert o.dtype == torch.bfloat16
    off = o.double() != want.bfloat16().double()
    assert int(off.sum()) <= o.numel() // 1000
    assert bool(((o.double() - want).abs() <= 2.0**-7 * want.abs()).all())  # within one bf16 ulp


# ---------------------------------------------------------------------------------------------
# commit vs sequential


def commit(c, delta, accepted, src, dst):
    gdn_tree_commit(c["k"], c["g"], delta, c["parents"], c["cu_nodes"], accepted, c["ssm_state"], src, dst)


def expected_final_state(c, before, r, node, src_slot):
    s, e = int(c["cu_nodes"][r]), int(c["cu_nodes"][r + 1])
    p = torch.tensor(path_of(c["parents"][s:e], node)) + s
    _, state = gdn_chain_recurrence(c["q"][p], c["k"][p], c["v"][p], c["g"][p], c["beta"][p], before[src_slot])
    return state


def test_commit_batch_with_aliasing_equals_recurrence_final_state():
    gen = torch.Generator().manual_seed(21)
    trees = [random_tree_parents(30, gen, "random"), random_tree_parents(80, gen, "deep"),
             torch.tensor([-1]), random_tree_parents(9, gen, "star"), torch.arange(-1, 6)]
    c = make_case(trees, h=2, hv=4, num_slots=8, seed=21)
    c["state_indices"] = torch.tensor([1, 2, 5, 6, 7])
    _, delta = verify(c, return_delta=True)
    deep = trees[1]
    deepest = max(range(deep.numel()), key=lambda i: len(path_of(deep, i)))
    accepted = torch.tensor([17, deepest, 0, 0, 5])
    src = c["state_indices"]
    # request 0 and 1 swap slots (cross-request aliasing), 2 writes in place, 3 and 4 to fresh slots
    dst = torch.tensor([2, 1, 5, 0, 3])
    before = c["ssm_state"].clone()
    commit(c, delta, accepted, src, dst)
    for r in range(5):
        want = expected_final_state(c, before, r, int(accepted[r]), int(src[r]))
        assert rel_err(c["ssm_state"][int(dst[r])], want) < 1e-12
    for untouched in (4, 6, 7):
        assert torch.equal(c["ssm_state"][untouched], before[untouched])


def test_commit_root_only_single_node_tree():
    c = make_case([torch.tensor([-1]), random_tree_parents(5, torch.Generator().manual_seed(2), "random")], seed=2)
    _, delta = verify(c, return_delta=True)
    before = c["ssm_state"].clone()
    src = c["state_indices"]
    commit(c, delta, torch.tensor([0, 0]), src, src)
    for r in range(2):
        want = expected_final_state(c, before, r, 0, int(src[r]))
        assert rel_err(c["ssm_state"][int(src[r])], want) < 1e-12


def test_commit_float32_state():
    """fp32 delta and fp32 state slots; error vs float64 recurrence measured 1.1e-7."""
    parents = random_tree_parents(64, torch.Generator().manual_seed(8), "deep")
    c = make_case([parents], h=1, hv=2, kd=32, vd=32, seed=8)
    before = c["ssm_state"].clone()
    c32 = {key: (val.float() if val.is_floating_point() else val) for key, val in c.items()}
    _, delta = verify(c32, return_delta=True)
    assert delta.dtype == torch.float32
    slot = c32["state_indices"]
    gdn_tree_commit(c32["k"], c32["g"], delta, c32["parents"], c32["cu_nodes"], torch.tensor([63]),
                    c32["ssm_state"], slot, slot)
    want = expected_final_state(c, before, 0, 63, int(slot[0]))
    assert c32["ssm_state"].dtype == torch.float32
    assert rel_err(c32["ssm_state"][int(slot[0])], want) <= 1e-5


# ---------------------------------------------------------------------------------------------
# errors users can hit


def test_errors_are_clear():
    c = make_case([torch.tensor([-1, 0, 1])], h=2, hv=4)
    bad = dict(c, parents=torch.tensor([-1, 2, 1]))
    with pytest.raises(ValueError, match=r"parents\[1\] = 2 is invalid for local node 1 of request 0"):
        verify(bad)
    with pytest.raises(ValueError, match="must be a multiple of the q/k heads H=3"):
        verify(dict(c, q=c["q"].repeat(1, 2, 1)[:, :3], k=c["k"].repeat(1, 2, 1)[:, :3]))
    with pytest.raises(ValueError, match="cu_nodes must start at 0 and end at the number of nodes 3"):
        verify(dict(c, cu_nodes=torch.tensor([0, 2])))
    _, delta = verify(c, return_delta=True)
    src = c["state_indices"]
    with pytest.raises(ValueError, match=r"accepted\[0\] = 3 is not a node of request 0 \(it has 3 nodes\)"):
        commit(c, delta, torch.tensor([3]), src, src)
    two = make_case([torch.tensor([-1]), torch.tensor([-1, 0])])
    _, delta2 = verify(two, return_delta=True)
    with pytest.raises(ValueError, match="dst_indices must be distinct"):
        commit(two, delta2, torch.tensor([0, 1]), two["state_indices"], torch.tensor([1, 1]))
