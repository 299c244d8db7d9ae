"""The tensor-parallel pieces of the vLLM runtime that run without a GPU: the Weaver's tables from
vLLM's vocabulary-parallel layers (with vLLM's own shard arithmetic) and the rank comparison of
``VLLM_TFM_CHECK_TP_TREES``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("vllm")

from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding, pad_vocab_size  # noqa: E402

from vllm_tfm.models.vocab_table import ShardedVocabTable  # noqa: E402
from vllm_tfm.vllm_plugin.runtime.tensor_parallel import first_mismatch, sharded_table, target_vocab_table  # noqa: E402


def _vllm_shard_indices(vocab: int, rank: int, world: int):
    """vLLM 0.26's own shard arithmetic for a vocabulary of ``vocab`` (padded to 64) on ``rank``."""
    vp = pad_vocab_size(vocab, 64)
    return VocabParallelEmbedding._get_indices(vp, vp, vocab, vocab, rank, world)


@pytest.mark.parametrize("world", [2, 4])
def test_tables_over_vllm_shards_rebuild_the_full_rows(world):
    vocab, h = 1000, 8
    weight = torch.randn(vocab, h, dtype=torch.float64)
    ids = torch.randint(0, vocab, (5, 9))
    ids[0, :2] = torch.tensor([0, vocab - 1])
    partial = torch.zeros(5, 9, h, dtype=torch.float64)
    for rank in range(world):
        si = _vllm_shard_indices(vocab, rank, world)
        local = torch.full((si.num_elements_padded, h), float("nan"), dtype=torch.float64)
        local[: si.num_org_elements] = weight[si.org_vocab_start_index : si.org_vocab_end_index]
        module = SimpleNamespace(weight=local, shard_indices=si, org_vocab_size=vocab)
        table = sharded_table(module, "lm_head")
        assert isinstance(table, ShardedVocabTable) and table.num_rows == vocab
        partial += table.partial_rows(ids)
    assert torch.equal(partial, weight[ids])


def test_sharded_table_refuses_plain_and_lora_layers():
    with pytest.raises(ValueError, match="is not a vocabulary-parallel layer"):
        sharded_table(torch.nn.Embedding(10, 4), "input embedding")
    si = SimpleNamespace(num_added_elements=3)
    with pytest.raises(ValueError, match="3 added \\(LoRA\\) vocabulary rows"):
        sharded_table(SimpleNamespace(weight=torch.zeros(4, 4), shard_indices=si, org_vocab_size=4), "lm_head")


def test_target_vocab_table_finds_the_text_and_vl_layouts_and_names_what_is_missing():
    text = torch.nn.Module()
    text.lm_head = torch.nn.Linear(4, 10, bias=False)
    assert target_vocab_table(text, ("lm_head", "language_model.lm_head"), "lm_head", 1) is text.lm_head.weight
    vl = torch.nn.Module()
    vl.language_model = torch.nn.Module()
    vl.language_model.lm_head = torch.nn.Linear(4, 10, bias=False)
    assert target_vocab_table(vl, ("lm_head", "language_model.lm_head"), "lm_head", 1) is vl.language_model.lm_head.weight
    with pytest.raises(ValueError, match="cannot find the target's lm_head \\(looked for lm_head, language_model.lm_head\\)"):
        target_vocab_table(torch.nn.Module(), ("lm_head", "language_model.lm_head"), "lm_head", 1)
    with pytest.raises(ValueError, match="not a vocabulary-parallel layer"):
        target_vocab_table(text, ("lm_head",), "lm_head", 2)  # a plain nn.Linear under TP


def test_first_mismatch_names_the_rank_and_request():
    same = torch.arange(12).view(1, 3, 4).expand(3, 3, 4).clone()
    assert first_mismatch(same) is None
    bad = same.clone()
    bad[2, 1, 3] += 1
    assert first_mismatch(bad) == (2, 1)
    bad[1, 2, 0] -= 1
    assert first_mismatch(bad) == (1, 2)  # the lowest rank first
