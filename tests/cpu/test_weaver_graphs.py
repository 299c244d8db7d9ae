"""CUDA-graph wrapper of the Weaver build (``runtime/weaver_graphs.py``), the parts that run
without a GPU: the switch, bucket choice, static-input padding, and the eager fallback.
Graph replay itself: ``tests/gpu/test_weaver_graphs_gpu.py``."""

from __future__ import annotations

import pytest
import torch
from _models import randomize

from vllm_tfm.models import Weaver, WeaverConfig
from vllm_tfm.vllm_plugin.runtime.tree_builder_gpu import weaver_trees
from vllm_tfm.vllm_plugin.runtime.weaver_graphs import (
    DEFAULT_BUCKETS,
    StaticInputs,
    WeaverGraphs,
    bucket_for,
    graph_buckets,
    weaver_graphs_from_env,
)

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bucket_is_the_smallest_size_that_holds_the_batch():
    assert [bucket_for(r, DEFAULT_BUCKETS) for r in (1, 2, 3, 5, 8, 9, 100, 128)] == [1, 2, 4, 8, 8, 16, 128, 128]
    assert bucket_for(129, DEFAULT_BUCKETS) is None
    assert [bucket_for(r, (3, 10)) for r in (1, 3, 4, 10, 11)] == [3, 3, 10, 10, None]


def test_switch_and_bucket_list_from_the_environment():
    assert weaver_graphs_from_env({}).buckets == DEFAULT_BUCKETS  # on by default
    assert weaver_graphs_from_env({"VLLM_TFM_WEAVER_GRAPHS": "0"}) is None
    assert weaver_graphs_from_env({"VLLM_TFM_WEAVER_GRAPHS": "off"}) is None
    assert weaver_graphs_from_env({"VLLM_TFM_WEAVER_GRAPHS": "false"}) is None
    assert weaver_graphs_from_env({"VLLM_TFM_WEAVER_GRAPHS": "1"}).buckets == DEFAULT_BUCKETS
    on = {"VLLM_TFM_WEAVER_GRAPHS": "1", "VLLM_TFM_WEAVER_GRAPH_BUCKETS": "16, 4,8,4"}
    assert weaver_graphs_from_env(on).buckets == (4, 8, 16)
    assert graph_buckets(None) == graph_buckets("  ") == DEFAULT_BUCKETS
    for bad in ("a,2", "0,4", ",", "-1"):
        with pytest.raises(ValueError, match=rf"VLLM_TFM_WEAVER_GRAPH_BUCKETS='{bad}': expected comma-separated integers >= 1"):
            graph_buckets(bad)


def test_static_inputs_take_the_batch_in_their_first_rows_and_keep_the_rest():
    g = torch.Generator().manual_seed(0)
    big = [torch.randn(3, 2, 5, generator=g), torch.randn(3, 2, 4, generator=g), torch.randn(3, 4, generator=g),
           torch.tensor([7, 8, 9], dtype=torch.int32)]
    buf = StaticInputs.zeros_like(4, *big)
    assert buf.bucket == 4 and buf.roots.dtype == torch.int32
    buf.fill(*big)
    small = [x[:1] * 0 + 1 for x in big]
    buf.fill(*small)
    for got, first, second in zip((buf.logits, buf.hidden, buf.verifier, buf.roots), big, small):
        assert torch.equal(got[:1], second)  # the new batch
        assert torch.equal(got[1:3], first[1:3])  # rows of the earlier batch, untouched
        assert not got[3].any()  # never written
    with pytest.raises(ValueError, match="a batch of 5 requests does not fit a graph bucket of 4"):
        buf.fill(*[torch.cat([x, x[:2]]) for x in big])
    with pytest.raises(ValueError, match=r"input of shape \(2, 3, 5\) does not fit buffer rows of shape \(2, 5\)"):
        buf.fill(torch.zeros(2, 3, 5), *[x[:2] for x in big[1:]])


def test_cpu_batches_build_eagerly_with_the_same_trees():
    torch.manual_seed(0)
    h, vocab, r_, depth = 32, 100, 3, 4
    weaver = randomize(Weaver(WeaverConfig(d_model=h, d_rank=16, n_layers=2, n_heads=2, d_mlp=24, max_depth=depth)), 1)
    weaver = weaver.float().eval()
    embed, head = torch.randn(vocab, h), torch.randn(vocab, h) * 0.3
    args = (weaver, torch.randn(r_, depth, vocab) * 2, torch.randn(r_, depth, h), torch.randn(r_, h),
            torch.randint(0, vocab, (r_,)), embed, head, 10, 12, 2, 3)
    graphs = WeaverGraphs((4, 8))
    assert graphs.bucket(args[1], embed, head) is None
    tok, par = graphs.weaver_trees(*args)
    ref_tok, ref_par = weaver_trees(*args)
    assert torch.equal(tok, ref_tok) and torch.equal(par, ref_par)
    assert (graphs.eager_builds, graphs.replays) == (1, 0)
    with pytest.raises(ValueError, match=r"graph buckets must be integers >= 1"):
        WeaverGraphs((0, 2))
