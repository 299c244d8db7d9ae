"""A stand-in for vLLM's GPU model runner as ``hooks.fix_accepted_offsets`` sees it, on the CPU: one GDN
layer whose conv and SSM states are plain tensors, a block table where batch row i owns state slots
4i .. 4i + 3, and vLLM's ``num_accepted_tokens`` buffer (host and device halves)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch


def fake_hybrid_runner(monkeypatch: pytest.MonkeyPatch, async_mode: bool = False,
                       num_spec_tokens: int = 3) -> tuple[SimpleNamespace, torch.Tensor, torch.Tensor, int]:
    """(runner of requests a, b, c; conv states [16, 3, W - 1 + B] dim-first; SSM states [16, 2, 2, 2]; W = 4)."""
    import vllm_tfm.vllm_plugin.runtime.gdn as gdn_mod
    import vllm_tfm.vllm_plugin.runtime.hooks as hooks

    width = 4
    conv = torch.randn(16, 3, width - 1 + num_spec_tokens)  # dim-first [slots, conv_dim, L]
    ssm = torch.randn(16, 2, 2, 2)
    layer = SimpleNamespace(conv1d=SimpleNamespace(weight=torch.zeros(3, 1, width)))
    monkeypatch.setattr(hooks, "_gdn_groups", lambda runner: [(1, [layer])])
    monkeypatch.setattr(gdn_mod, "_layer_states", lambda lay: (conv, ssm))
    table = np.arange(16).reshape(4, 4)  # request row i owns slots 4i .. 4i + 3
    acc = SimpleNamespace(np=np.ones(4, dtype=np.int32), gpu=torch.ones(4, dtype=torch.int32))
    batch = SimpleNamespace(num_reqs=3, req_ids=["a", "b", "c"], num_accepted_tokens_cpu=np.ones(4, dtype=np.int32),
                            block_table={1: SimpleNamespace(get_numpy_array=lambda: table)})
    runner = SimpleNamespace(_tfm_enabled=True, model_config=SimpleNamespace(is_hybrid=True), input_batch=batch,
                             num_accepted_tokens=acc, requests={"a": 0, "b": 0, "c": 0}, use_async_scheduling=async_mode,
                             num_spec_tokens=num_spec_tokens)
    return runner, conv, ssm, width
