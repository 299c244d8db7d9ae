"""Random GDN verify cases for the kernel tests that run through the CPU emulation (cuda/host_emu):
trees, inputs in vLLM's layouts, and the norm-wise relative error (tests/cpu/test_gdn_verify_v3.py,
test_gdn_verify_v6.py). Not a test module."""

from __future__ import annotations

import torch

from vllm_tfm.verify import gdn as ref_gdn


def _random_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)])


def _deep_tree(n: int, gen: torch.Generator) -> torch.Tensor:
    spine = 4 * n // 5  # a chain of 4n/5 nodes, then side branches: depth > 32 for n >= 42
    par = [-1] + list(range(spine - 1)) + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(spine, n)]
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
