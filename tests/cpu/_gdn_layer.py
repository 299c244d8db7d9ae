"""One GDN layer of a tree-active step, outside vLLM: a layer object with the attributes the runtime
reads, a step with the spec requests' trees, and the forward context vLLM would give the layer.

Used by the CPU and GPU tests that compare the GDN tree path with its frozen previous version
(``_gdn_before.py``). Not imported by the package.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any
from unittest import mock

import numpy as np
import torch
from torch import Tensor

from _trees import random_tree_parents


@dataclasses.dataclass
class GDNMetadata:
    """The fields of vLLM's ``GDNAttentionMetadata`` the tree path and the row split read."""

    spec_sequence_masks: Tensor | None
    num_spec_decodes: int
    num_spec_decode_tokens: int
    num_actual_tokens: int
    num_prefills: int
    num_decodes: int
    num_prefill_tokens: int
    num_decode_tokens: int
    spec_token_indx: Tensor | None
    non_spec_token_indx: Tensor | None
    spec_query_start_loc: Tensor | None
    spec_state_indices_tensor: Tensor | None
    non_spec_query_start_loc: Tensor | None
    non_spec_state_indices_tensor: Tensor | None
    num_accepted_tokens: Tensor | None


class FakeStep:
    """The parts of ``StepTree`` the GDN layer reads: the spec trees (host and device), counts, stashes."""

    def __init__(self, trees: list[Tensor], device: torch.device) -> None:
        cu = np.zeros(len(trees) + 1, dtype=np.int64)
        cu[1:] = np.cumsum([t.numel() for t in trees])
        self.spec_parents = torch.cat(trees).numpy()
        self.spec_cu = cu
        self._dev = {"spec_parents": torch.from_numpy(self.spec_parents).to(device),
                     "spec_cu": torch.from_numpy(cu).to(device)}
        self.gdn: dict[str, Any] = {}
        self.tree_active = True

    def dev(self, name: str) -> Tensor:
        return self._dev[name]

    @property
    def num_spec_reqs(self) -> int:
        return len(self.spec_cu) - 1

    @property
    def num_spec_tokens(self) -> int:
        return int(self.spec_parents.shape[0])


class LayerCase:
    """Random inputs of one GDN layer: ``num_plain`` plain rows (prefill tokens, vLLM's own path,
    here a stand-in) after the spec rows of ``trees``; bf16 activations by default, float32 state."""

    def __init__(self, trees: list[Tensor], *, h: int = 2, k: int = 32, hv: int = 4, v: int = 16, width: int = 4,
                 num_plain: int = 0, dtype: torch.dtype = torch.bfloat16, device: torch.device | str = "cpu",
                 bias: bool = False, seed: int = 0) -> None:
        dev = torch.device(device)
        g = torch.Generator().manual_seed(seed)
        s = max(t.numel() for t in trees) - 1  # speculative slots per request
        r, ts = len(trees), sum(t.numel() for t in trees)
        n = ts + num_plain
        conv_dim = 2 * h * k + hv * v
        pool = r * (1 + s) + 3
        self.step = FakeStep(trees, dev)
        conv = torch.randn(pool, width - 1 + s, conv_dim, generator=g).to(dtype).to(dev)  # [slots, L, D] storage
        self.conv = conv
        self.ssm = torch.randn(pool, hv, v, k, generator=g).to(dev)
        self.layer = SimpleNamespace(
            prefix="model.layers.0.linear_attn",
            conv1d=SimpleNamespace(weight=(0.5 * torch.randn(conv_dim, 1, width, generator=g)).to(dtype).to(dev),
                                   bias=(0.1 * torch.randn(conv_dim, generator=g)).to(dtype).to(dev) if bias else None),
            activation="silu",
            A_log=torch.rand(hv, generator=g).log().to(dev),
            dt_bias=torch.randn(hv, generator=g).to(dtype).to(dev),
            num_k_heads=h, num_v_heads=hv, head_k_dim=k, head_v_dim=v, tp_size=1,
        )
        self.mixed = torch.randn(n, conv_dim, generator=g).to(dtype).to(dev)
        self.a = (2 * torch.randn(n, hv, generator=g)).to(dtype).to(dev)
        self.b = torch.randn(n, hv, generator=g).to(dtype).to(dev)
        self.shape = (n, hv, v)
        self.dtype = dtype
        spec_rows = torch.arange(ts) if num_plain == 0 else torch.randperm(n, generator=g)[:ts].sort().values
        plain_rows = torch.tensor(sorted(set(range(n)) - set(spec_rows.tolist())), dtype=torch.long)
        slots = torch.randperm(pool, generator=g)[: r * (1 + s)].view(r, 1 + s)
        self.md = GDNMetadata(
            spec_sequence_masks=torch.ones(r, dtype=torch.bool, device=dev), num_spec_decodes=r,
            num_spec_decode_tokens=ts, num_actual_tokens=n, num_prefills=1 if num_plain else 0, num_decodes=0,
            num_prefill_tokens=num_plain, num_decode_tokens=0,
            spec_token_indx=spec_rows.to(torch.int32).to(dev) if num_plain else None,
            non_spec_token_indx=plain_rows.to(torch.int32).to(dev) if num_plain else None,
            spec_query_start_loc=None, spec_state_indices_tensor=slots.to(torch.int32).to(dev),
            non_spec_query_start_loc=None, non_spec_state_indices_tensor=None,
            num_accepted_tokens=torch.randint(1, s + 2, (r,), generator=g).to(torch.int32).to(dev),
        )

    def kv_cache(self, dim_first: bool) -> tuple[Tensor, Tensor]:
        return (self.conv.transpose(-1, -2) if dim_first else self.conv, self.ssm)

    def out(self) -> Tensor:
        return torch.zeros(self.shape, dtype=self.dtype, device=self.mixed.device)


def plain_rows_standin(self: Any, mixed_qkv: Tensor, b: Tensor, a: Tensor, core_attn_out: Tensor) -> None:
    """Stand-in for vLLM's ``_forward_core`` on the plain rows: a value that depends on each row."""
    hv, v = core_attn_out.shape[1:]
    core_attn_out.copy_((mixed_qkv[:, : hv * v].float() * a.float().repeat_interleave(v, 1)).view(-1, hv, v))


@contextlib.contextmanager
def forward_context(case: LayerCase, piecewise: bool = True) -> Iterator[None]:
    """vLLM's forward context of a decode step that holds the case's metadata (piecewise graphs:
    the pre-conv rows are copied for the commit) and the layer's caches in vLLM's conv layout."""
    import vllm.forward_context as vfc
    from vllm.config import CUDAGraphMode
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first

    case.layer.kv_cache = case.kv_cache(is_conv_state_dim_first())
    mode = CUDAGraphMode.PIECEWISE if piecewise else CUDAGraphMode.NONE
    fc = SimpleNamespace(attn_metadata={case.layer.prefix: case.md}, cudagraph_runtime_mode=mode)
    with mock.patch.object(vfc, "get_forward_context", lambda: fc), \
            mock.patch.object(vfc, "is_forward_context_available", lambda: True):
        yield


def run_layer(forward: Callable[..., Any], case: LayerCase) -> tuple[Tensor, Any]:
    """(core_attn_out, stash) of one call of a tree-active ``_forward_core`` body on the case."""
    case.step.gdn.clear()
    out = case.out()
    forward(case.layer, case.step, plain_rows_standin, case.mixed, case.b, case.a, out)
    return out, case.step.gdn[case.layer.prefix]


STASH_TENSORS = ("x", "k", "g", "delta", "state_indices", "prev_accepted")


def assert_same_layer_outcome(got: tuple[Tensor, Any], want: tuple[Tensor, Any]) -> None:
    """Outputs and stashes equal bit for bit (dtypes, shapes, values)."""
    (out, stash), (out0, stash0) = got, want
    assert out.dtype == out0.dtype and torch.equal(out, out0), "core_attn_out"
    for name in STASH_TENSORS:
        a, b = getattr(stash, name), getattr(stash0, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    for name in ("conv_state", "ssm_state"):  # views of the layer's caches (not copies)
        a, b = getattr(stash, name), getattr(stash0, name)
        assert (a.data_ptr(), a.shape, a.stride()) == (b.data_ptr(), b.shape, b.stride()), name
    assert stash.width == stash0.width


def random_trees(sizes: list[int], seed: int) -> list[Tensor]:
    g = torch.Generator().manual_seed(seed)
    kinds = ("random", "deep", "star", "chain")
    return [random_tree_parents(n, g, kinds[i % 4]) for i, n in enumerate(sizes)]
