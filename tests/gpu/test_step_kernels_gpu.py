"""GPU test: one GDN layer's tree verify + commit through the runtime with the per-step kernel
tables (planned NVRTC kernels, tables built once per step) equals the per-call path (library
entry points) on the same inputs, for several layers sharing one step's tables.

Run on the GPU host: ``python3 -m pytest tests/gpu/test_step_kernels_gpu.py -q``.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vllm_tfm.kernels.loader import kernels_available, kernels_unavailable_reason
from vllm_tfm.vllm_plugin.runtime.commit import commit_gdn_layer
from vllm_tfm.vllm_plugin.runtime.gdn import spec_tree_gdn
from vllm_tfm.vllm_plugin.runtime.step_kernels import StepKernels

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

DEV = torch.device("cuda")
H, K, HV, V, W, S = 2, 64, 6, 32, 4, 8
CONV_DIM = 2 * H * K + HV * V


@pytest.fixture(scope="module", autouse=True)
def _kernels_must_work():
    if not kernels_available():
        pytest.skip(f"CUDA kernels unavailable: {kernels_unavailable_reason()}")


def _tree(n: int, kind: str, g: torch.Generator) -> torch.Tensor:
    if kind == "chain":
        return torch.arange(-1, n - 1)
    if kind == "star":
        return torch.tensor([-1] + [0] * (n - 1))
    return torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g)) for i in range(1, n)])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_planned_step_equals_per_call_path(dtype):
    g = torch.Generator().manual_seed(3)
    shapes = [(1, "chain"), (S + 1, "chain"), (S + 1, "star"), (S + 1, "random"), (5, "random")]
    trees = [_tree(n, kind, g) for n, kind in shapes]
    num_req = len(trees)
    cu = np.zeros(num_req + 1, dtype=np.int64)
    cu[1:] = np.cumsum([t.numel() for t in trees])
    step = SimpleNamespace(spec_parents=torch.cat(trees).numpy(), spec_cu=cu)
    parents, cu_d = torch.cat(trees).to(DEV), torch.from_numpy(cu).to(DEV)
    t_nodes = int(cu[-1])
    num_slots = num_req * (1 + S) + 5
    slots = torch.randperm(num_slots, generator=g)[: num_req * (1 + S)].view(num_req, 1 + S).to(torch.int32).to(DEV)
    prev = torch.randint(1, S + 2, (num_req,), generator=g).to(torch.int32).to(DEV)
    last = torch.tensor([int(torch.randint(0, t.numel(), (1,), generator=g)) for t in trees], device=DEV)
    depth = []
    for t, a in zip(trees, last.tolist()):
        d, i = 0, a
        while t[i] >= 0:
            i, d = int(t[i]), d + 1
        depth.append(d)
    num_acc = torch.tensor(depth, device=DEV)
    tables = StepKernels(step, DEV)
    for layer in range(3):  # several layers share the step's tables (and one group)
        conv0 = torch.randn(num_slots, CONV_DIM, W - 1 + S, generator=g).to(DEV, dtype)
        ssm0 = torch.randn(num_slots, HV, V, K, generator=g).to(DEV)
        x = torch.randn(t_nodes, CONV_DIM, generator=g).to(DEV, dtype)
        a = torch.randn(t_nodes, HV, generator=g).to(DEV, dtype)
        b = torch.randn(t_nodes, HV, generator=g).to(DEV, dtype)
        w = (0.5 * torch.randn(CONV_DIM, W, generator=g)).to(DEV, dtype)
        bias = (0.1 * torch.randn(CONV_DIM, generator=g)).to(DEV, dtype)
        A_log = torch.rand(HV, generator=g).log().to(DEV)
        dt_bias = (0.5 * torch.randn(HV, generator=g)).to(DEV)
        outs, states = [], []
        for kernels in (None, tables):
            conv, ssm = conv0.clone(), ssm0.clone()
            out, stash = spec_tree_gdn(x, a, b, parents, cu_d, conv, ssm, slots, prev, w, bias, "silu", A_log, dt_bias,
                                       H, K, HV, V, kernels=kernels)
            commit_gdn_layer(stash, parents, cu_d, last, num_acc, kernels)
            torch.cuda.synchronize()
            outs.append(out.float())
            states.append((conv.float(), ssm))
        tol = 1e-5 if dtype == torch.float32 else 3e-3
        for got, ref in ((outs[1], outs[0]), (states[1][1], states[0][1]), (states[1][0], states[0][0])):
            err = (got - ref).norm() / ref.norm().clamp_min(1e-30)
            assert err <= tol, f"layer {layer}: relative error {err:.3g} > {tol}"
    assert len(tables._groups) == 1  # one group: the slots were derived once
