"""Random GDN verify cases for the kernel tests that run through the CPU emulation (cuda/host_emu):
trees, inputs in vLLM's layouts, and the norm-wise relative error (tests/cpu/test_gdn_verify_v3.py,
test_gdn_verify_v6.py, _v7.py, _v8.py). Not a test module."""

from __future__ import annotations

import torch

from vllm_tfm.kernels import gdn as kgdn
from vllm_tfm.verify import gdn as ref_gdn


def _random_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)])


def _deep_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    spine = 4 * n // 5  # a chain of 4n/5 nodes, then side branches: depth > 32 for n >= 42
    par = [-1] + list(range(spine - 1)) + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(spine, n)]
    return torch.tensor(par)


def _bounded_tree(n: int, gen: torch.Generator, max_depth: int = 16) -> torch.Tensor:
    """A random tree of n nodes (parents before children) whose depth is exactly ``max_depth`` when
    n > max_depth: a chain to that depth first, then each node under a random earlier node of smaller depth."""
    par, depth = [-1], [0]
    for i in range(1, n):
        p = i - 1 if i <= max_depth else int(torch.randint(0, i, (1,), generator=gen))
        while depth[p] >= max_depth:
            p = par[p]
        par.append(p)
        depth.append(depth[p] + 1)
    return torch.tensor(par)


def _case(trees, h, hv, kd, vd, dtype, seed, idx_dtype=torch.int64):
    gen = torch.Generator().manual_seed(seed)
    parents = torch.cat(trees)
    cu = torch.zeros(len(trees) + 1, dtype=torch.long)
    cu[1:] = torch.tensor([t.numel() for t in trees]).cumsum(0)
    t, r = parents.numel(), len(trees)
    g, beta = ref_gdn.gdn_gates(torch.randn(t, hv, generator=gen), torch.randn(t, hv, generator=gen),
                                torch.rand(hv, generator=gen) * 2, torch.randn(hv, generator=gen) * 0.5)
    slots = r + 2
    return {"q": torch.randn(t, h, kd, generator=gen).to(dtype), "k": torch.randn(t, h, kd, generator=gen).to(dtype),
            "v": torch.randn(t, hv, vd, generator=gen).to(dtype), "g": g, "beta": beta, "parents": parents,
            "cu_nodes": cu, "ssm_state": torch.randn(slots, hv, vd, kd, generator=gen) * 0.3,
            "state_indices": torch.randperm(slots, generator=gen)[:r].to(idx_dtype)}


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def _g(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _depth_first(depth: int, width: int) -> torch.Tensor:
    """A chain of ``depth`` nodes below the root, then ``width`` children of the root: node order is not
    level order (the kernels read their tables by level position and write by node)."""
    return torch.tensor([-1] + list(range(depth)) + [0] * width)


def _reference(c, **kw):
    """The float64 reference's (o, delta) on a case of ``_case``."""
    c64 = {k: v.double() if v.is_floating_point() else v for k, v in c.items()}
    return ref_gdn.gdn_tree_verify(**c64, return_delta=True, **kw)


def _run_variant(c, plan, launches, variant, options=(), return_delta=True, **kw):
    """Verify version ``variant`` through ``verify_launches`` with NaN-poisoned outputs, under the CPU emulation
    whose launch record is ``launches``: (kernel names launched, o, delta); checks that every output element was
    written and the state left alone."""
    before = c["ssm_state"].clone()
    o = torch.full(c["v"].shape, float("nan"), dtype=c["v"].dtype)
    d = torch.full(c["v"].shape, float("nan")) if return_delta else None
    launches.clear()
    made, o, d = kgdn.verify_launches(plan, c["q"], c["k"], c["v"], c["g"], c["beta"], c["ssm_state"], c["state_indices"],
                                      return_delta=return_delta, out=o, delta_out=d, variant=variant,
                                      extra_options=options, **kw)
    for _, fn in made:
        fn()
    assert not o.isnan().any(), "o left unwritten"
    assert d is None or not d.isnan().any(), "delta left unwritten"
    assert torch.equal(c["ssm_state"], before), "the verify wrote the state"
    return [name for name, _, _ in launches], o, d
