"""What the NVRTC kernel GPU tests share: their pytest marks (``gpu``; skipped without a CUDA device or where the
kernels cannot run, with the loader's reason) and the CPU tests' folder on ``sys.path`` (the case builders the
CPU emulation tests and the GPU tests both use: ``_greedy_cases``, ``_context_order_cases``, ``_trees``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

from vllm_tfm.kernels.loader import kernels_available, kernels_unavailable_reason

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cpu"))

KERNEL_GPU_MARKS = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(torch.cuda.is_available() and not kernels_available(),
                       reason=f"CUDA kernels unavailable: {kernels_unavailable_reason()}"),
]

# A test that captures a CUDA graph: skipped where PyTorch's caching allocator is off (PYTORCH_NO_CUDA_MEMORY_CACHING=1,
# as bench/gpu_common.sh's compute-sanitizer runs set it for exact bounds), since every tensor a capture makes is then a
# cudaMalloc, which CUDA refuses while a stream captures (cudaErrorStreamCaptureUnsupported).
CAPTURES_A_GRAPH = pytest.mark.skipif(os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") not in ("", "0"),
                                      reason="CUDA graph capture needs PyTorch's caching allocator "
                                             "(PYTORCH_NO_CUDA_MEMORY_CACHING is set)")
