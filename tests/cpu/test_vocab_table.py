"""Vocabulary-split target tables (tensor parallelism) for the Weaver: ``ShardedVocabTable``.

The claims: the ranks' partial rows / dot products sum to the unsplit table's, exactly; padding
rows of a shard are never read; and, over a real two-process ``torch.distributed`` group (gloo),
TfM trees built with vocabulary-split embedding and lm_head are identical on both ranks and equal
to the trees of the unsplit tables.
"""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _models import randomize

from vllm_tfm.models import Weaver, WeaverConfig, weaver_draft_trees
from vllm_tfm.models.vocab_table import ShardedVocabTable, candidate_residual, table_num_rows, table_rows

F64 = torch.float64
V, H = 61, 16  # V not a multiple of the shard count: the last shard has padding rows


def shards(weight: torch.Tensor, world: int, pad_to: int = 8) -> list[tuple[torch.Tensor, int, int]]:
    """vLLM-like split: equal padded shards of ceil(V / world) rows rounded up to ``pad_to``; the
    padding rows hold garbage (NaN) so that reading one would show."""
    per = -(-weight.shape[0] // world)
    per = -(-per // pad_to) * pad_to
    out = []
    for rank in range(world):
        start, end = min(rank * per, weight.shape[0]), min((rank + 1) * per, weight.shape[0])
        local = torch.full((per, weight.shape[1]), float("nan"), dtype=weight.dtype)
        local[: end - start] = weight[start:end]
        out.append((local, start, end))
    return out


def test_partial_rows_and_dots_of_the_shards_sum_to_the_unsplit_table_exactly():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, H, generator=g, dtype=torch.float32)
    ids = torch.randint(0, V, (3, 5, 7), generator=g)
    ids[0, 0, :3] = torch.tensor([0, V - 1, 31])  # both ends of the vocabulary and a shard edge
    q = torch.randn(3, 5, H, generator=g, dtype=torch.float32)
    for world in (1, 2, 3):
        tables = [ShardedVocabTable(local, s, e, V, lambda t: t) for local, s, e in shards(weight, world)]
        rows = sum(t.partial_rows(ids) for t in tables)
        assert torch.equal(rows, weight[ids])  # one non-zero term per element: exact
        dots = sum(t.partial_dots(ids, q, torch.float64) for t in tables)
        want = torch.einsum("...h,...kh->...k", q.double(), weight[ids].double())
        torch.testing.assert_close(dots, want, rtol=1e-12, atol=1e-12)
        assert not torch.isnan(rows).any() and not torch.isnan(dots).any()  # padding never read


def test_table_helpers_treat_tensors_modules_and_sharded_tables_alike():
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(V, H, generator=g, dtype=F64)
    ids = torch.randint(0, V, (4, 6), generator=g)
    q = torch.randn(4, H, generator=g, dtype=F64)
    emb = torch.nn.Embedding(V, H).double()
    with torch.no_grad():
        emb.weight.copy_(weight)
    whole = ShardedVocabTable(weight, 0, V, V, lambda t: t)  # one rank holding everything
    for table in (weight, emb, whole):
        assert table_num_rows(table, "embed") == V
        assert torch.equal(table_rows(table, ids), weight[ids])
    want = torch.einsum("rh,rkh->rk", q, weight[ids])
    for table in (weight, whole):
        torch.testing.assert_close(candidate_residual(table, ids, q), want, rtol=1e-13, atol=1e-13)


def test_sharded_table_refuses_inconsistent_shards():
    w = torch.zeros(8, H)
    with pytest.raises(ValueError, match="2-D"):
        ShardedVocabTable(torch.zeros(8), 0, 8, 8, lambda t: t)
    with pytest.raises(ValueError, match=r"shard rows \[4, 20\) must lie in \[0, 16\]"):
        ShardedVocabTable(w, 4, 20, 16, lambda t: t)
    with pytest.raises(ValueError, match=r"need 10 local rows, the shard has 8"):
        ShardedVocabTable(w, 0, 10, 16, lambda t: t)


# ------------------------------------------------------------------ two ranks over torch.distributed
def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    w = randomize(Weaver(WeaverConfig(d_model=H, d_rank=16, n_layers=2, n_heads=2, d_mlp=24, max_depth=6)), seed).eval()
    embed = torch.randn(V, H, generator=g, dtype=F64)
    head = torch.randn(V, H, generator=g, dtype=F64) * 0.5
    logits = torch.randn(4, 5, V, generator=g, dtype=F64) * 2
    dh = torch.randn(4, 5, H, generator=g, dtype=F64)
    vh = torch.randn(4, H, generator=g, dtype=F64)
    roots = torch.randint(0, V, (4,), generator=g)
    return w, embed, head, logits, dh, vh, roots


def _all_reduce(t: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(t)
    return t


def _rank_main(rank: int, world: int, port: int, result_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        out = {}
        for seed, (budget, k, width, cpn) in enumerate([(24, 12, 2, 4), (9, 5, 3, 2), (30, 20, 1, 8)]):
            w, embed, head, logits, dh, vh, roots = _inputs(100 + seed)
            tables = []
            for weight in (embed, head):
                local, s, e = shards(weight, world)[rank]
                tables.append(ShardedVocabTable(local, s, e, V, _all_reduce))
            out[seed] = weaver_draft_trees(w, logits, dh, vh, roots, tables[0], tables[1], budget, k, width, cpn)
        torch.save(out, os.path.join(result_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_trees_from_vocabulary_split_tables_are_identical_on_two_ranks_and_to_the_unsplit_trees(tmp_path):
    world = 2
    mp.spawn(_rank_main, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for seed, (budget, k, width, cpn) in enumerate([(24, 12, 2, 4), (9, 5, 3, 2), (30, 20, 1, 8)]):
        w, embed, head, logits, dh, vh, roots = _inputs(100 + seed)
        tok, par = weaver_draft_trees(w, logits, dh, vh, roots, embed, head, budget, k, width, cpn)
        for r in range(world):
            got_tok, got_par = ranks[r][seed]
            assert torch.equal(got_tok, ranks[0][seed][0]) and torch.equal(got_par, ranks[0][seed][1])
            assert torch.equal(got_tok, tok) and torch.equal(got_par, par)
        assert len(set(tok.flatten().tolist())) > 4  # real trees, not one repeated token
