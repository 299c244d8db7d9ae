"""bench/async_request_params.py's reading of its records: which vLLM request ids are probes, the first
generated token outside the allowed set, and the step whose output holds it (outputs laid end to end,
-1 padding dropped, other probes' records skipped)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import async_request_params as arp


def test_probe_names_from_vllm_request_ids() -> None:
    assert arp.probe_of("probe-allowed") == "allowed"
    assert arp.probe_of("probe-allowed-1f3a9c2e") == "allowed"
    assert arp.probe_of("probe-logprobs-00000000") == "logprobs"
    assert arp.probe_of("bg3-1f3a9c2e") is None
    assert arp.probe_of("probe-allowedx") is None


def test_first_token_outside_the_allowed_set() -> None:
    assert arp.first_outside([84, 65, 9, 199, 3]) is None
    assert arp.first_outside([84, 65, 85, 9, 453, 349]) == 4
    assert arp.first_outside([2]) == 0 and arp.first_outside([200]) == 0


def test_the_culprit_is_the_step_whose_output_holds_the_token() -> None:
    recs = [
        {"step": 1, "probe": "allowed", "out": [84, -1, -1]},
        {"step": 1, "probe": "logprobs", "out": [7, 8, 9]},
        {"step": 2, "error": "RuntimeError()"},
        {"step": 3, "probe": "allowed", "out": [65, 85, -1]},
        {"step": 4, "probe": "allowed", "out": [453, 349, -1], "path": "tree"},
    ]
    assert arp.culprit(recs, 0)["step"] == 1
    assert arp.culprit(recs, 2)["step"] == 3
    assert arp.culprit(recs, 3) == recs[4] and arp.culprit(recs, 4)["path"] == "tree"
    assert arp.culprit(recs, 5) is None


def test_the_mask_row_check_reads_vllms_convention() -> None:
    import torch

    mask = torch.ones(3, 300, dtype=torch.bool)  # vLLM: True = masked
    mask[1, 3:200] = False  # the allowed probe's row
    mask[2, :] = False  # a request without allowed ids in the same batch
    assert arp.mask_row_is_allowed(mask, 1) is True
    assert arp.mask_row_is_allowed(mask, 2) is False and arp.mask_row_is_allowed(mask, 0) is False
    assert arp.mask_row_is_allowed(mask, 3) is None and arp.mask_row_is_allowed(None, 0) is None


def test_every_probe_builds_vllm_sampling_params_with_its_own_values() -> None:
    import pytest

    pytest.importorskip("vllm")
    from vllm import SamplingParams

    for name, extra in arp.PROBES.items():
        params = SamplingParams(**arp.request_params(12, extra))  # the probe's temperature replaces the greedy default
        assert params.max_tokens == 12 and params.ignore_eos
        assert params.temperature == extra.get("temperature", 0.0), name
    assert SamplingParams(**arp.request_params(12, arp.PROBES["allowed"])).allowed_token_ids == list(range(3, 200))
