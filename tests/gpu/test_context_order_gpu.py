"""GPU test: the DFlash context order in one launch (``cuda/context_order.cu``) equals its torch reference and the
order written out with Python lists, on the shared layouts (one-node requests with prompt rows before the root,
chains, stars, deep trees, mixed batches) and at vLLM's largest step (4,096 rows, 256 requests of B = 16 trees);
its launch reads nothing back to the host.

Run on the GPU host: ``python3 -m pytest tests/gpu/test_context_order_gpu.py -q``.
"""

from __future__ import annotations

import pytest
import torch
from _kernel_marks import CAPTURES_A_GRAPH, KERNEL_GPU_MARKS
from _context_order_cases import context_order_case

from vllm_tfm.kernels import context_order as kco

pytestmark = KERNEL_GPU_MARKS

DEV = torch.device("cuda")


@pytest.mark.parametrize("num_req,max_nodes", [(1, 1), (1, 17), (3, 2), (8, 17), (40, 33), (2, 65), (256, 17)])
def test_kernel_equals_reference_and_lists(num_req, max_nodes):
    for seed in range(3):
        req_index, row_base, rows, accepted, expected = context_order_case(num_req, max_nodes, seed, DEV)
        assert kco.unsupported_reason(req_index, row_base, rows, accepted) is None
        torch.cuda.synchronize()
        got = kco.dflash_context_order_kernel(req_index, row_base, rows, accepted)
        assert got.tolist() == expected
        assert torch.equal(kco.dflash_context_order_reference(req_index, row_base, rows, accepted), got)


@CAPTURES_A_GRAPH
def test_the_launch_reads_nothing_back_and_replays_in_a_graph():
    req_index, row_base, rows, accepted, expected = context_order_case(8, 17, 7, DEV)
    kco.dflash_context_order_kernel(req_index, row_base, rows, accepted)  # compile and load first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # any host synchronisation would fail the capture
        out = kco.dflash_context_order_kernel(req_index, row_base, rows, accepted)
    out.fill_(-7)
    graph.replay()
    assert out.tolist() == expected
