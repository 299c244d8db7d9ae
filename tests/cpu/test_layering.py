"""Layering rule: math and models never import vLLM (DESIGN.md section 3)."""

import subprocess
import sys

import pytest

MATH_MODULES = [
    "vllm_tfm.tree",
    "vllm_tfm.verify.gdn",
    "vllm_tfm.verify.conv",
    "vllm_tfm.verify.sampling",
    "vllm_tfm.verify.logits_processing",
    "vllm_tfm.verify.tree_attention",
    "vllm_tfm.kernels.tree_attention",
    "vllm_tfm.kernels.kv_compact",
    "vllm_tfm.kernels.greedy_accept",
    "vllm_tfm.kernels.context_order",
    "vllm_tfm.models",
]


@pytest.mark.parametrize("module", MATH_MODULES)
def test_math_module_does_not_import_vllm(module: str) -> None:
    code = (
        "import sys, importlib\n"
        f"importlib.import_module({module!r})\n"
        "bad = sorted(m for m in sys.modules if m == 'vllm' or m.startswith('vllm.'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "", f"{module} pulled in vLLM modules: {out.stdout.strip()[:200]}"
