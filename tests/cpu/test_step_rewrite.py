"""The tree sampler and the commit of a decode step against their previous implementation, bit for bit.

The host-work rewrite (index tables built once per step on the host, vectorised walks, no syncs,
one upload, per-group K/V indices) must not change any outcome: the previous code is frozen in
``_step_before.py`` and every result here is compared with ``torch.equal`` on random steps and
the edge cases (one request, mixed trees, chains, nothing accepted, the full path accepted).
The tables themselves are checked against walks written out independently."""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import _step_before as before
import numpy as np
import pytest
import torch
from _sampling_fakes import sampling_metadata
from _trees import TREE_KINDS, path_of, random_tree_parents

from vllm_tfm.tree.types import TreeBatch
from vllm_tfm.verify.accept_result import accept_result_from_last_node
from vllm_tfm.verify.acceptance_replay import pmf_cdf, replay_accept
from vllm_tfm.verify.logits_processing import TreeSamplingParams, process_logits
from vllm_tfm.verify.packed_upload import packed_upload
from vllm_tfm.verify.sampling import verify_greedy, verify_target_only, verify_tree
from vllm_tfm.verify.tree_tables import TreeTables
from vllm_tfm.verify.uniforms import inverse_cdf
from vllm_tfm.vllm_plugin.runtime.commit import compact_kv, compaction_rows

FIELDS = ("accepted_nodes", "num_accepted", "last_node", "bonus", "output_tokens")


def same_result(a, b) -> None:
    for name in FIELDS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.dtype == y.dtype and torch.equal(x, y), (name, x, y)


def batch(parent_list, vocab, gen, distinct=False):
    """A TreeBatch of the given trees with random tokens (small vocab: duplicate siblings happen),
    or, ``distinct``, every node its own token."""
    parents = torch.cat(parent_list)
    cu = torch.zeros(len(parent_list) + 1, dtype=torch.long)
    cu[1:] = torch.tensor([p.numel() for p in parent_list]).cumsum(0)
    depth = torch.cat([depth_of(p) for p in parent_list])
    if distinct:
        assert parents.numel() <= vocab
        tokens = torch.randperm(vocab, generator=gen)[: parents.numel()]
    else:
        tokens = torch.randint(0, vocab, (parents.numel(),), generator=gen)
    return TreeBatch(tokens, parents, depth, cu)


def seed_of(*parts) -> int:
    return sum(ord(ch) * (i + 1) for i, ch in enumerate("/".join(map(str, parts)))) % 10_000


def depth_of(parents):
    return torch.tensor([len(path_of(parents, i)) - 1 for i in range(parents.numel())])


def random_trees(gen, num_req, max_nodes=12, kinds=TREE_KINDS):
    out = []
    for _ in range(num_req):
        kind = kinds[int(torch.randint(0, len(kinds), (1,), generator=gen))]
        out.append(random_tree_parents(int(torch.randint(1, max_nodes + 1, (1,), generator=gen)), gen, kind))
    return out


CASES = [  # (name, parent lists)
    ("one request", lambda g: [random_tree_parents(9, g, "random")]),
    ("one root only", lambda g: [torch.tensor([-1])]),
    ("chains", lambda g: [torch.arange(-1, 6), torch.arange(-1, 2), torch.tensor([-1])]),
    ("mixed", lambda g: random_trees(g, 7)),
    ("deep and wide", lambda g: [random_tree_parents(33, g, "deep"), random_tree_parents(33, g, "star"),
                                 random_tree_parents(33, g, "random")]),
]


# ---------------------------------------------------------------------------------------------
# tables


@pytest.mark.parametrize("seed", range(4))
def test_tree_tables_are_the_walks(seed):
    gen = torch.Generator().manual_seed(seed)
    trees = batch(random_trees(gen, 6), 5, gen)
    tables = TreeTables.of(trees)
    assert torch.equal(tables.children, before.child_table_before(trees))
    assert torch.equal(tables.deepest, before.deepest_nodes_before(trees))
    assert tables.max_depth == int(trees.depth.max())
    gp = trees.global_parents()
    for i in range(trees.num_nodes):  # the ancestor at every depth, walked up one parent at a time
        walk, x = [], i
        while x >= 0:
            walk.append(x)
            x = int(gp[x])
        expect = walk[::-1] + [-1] * (tables.max_depth + 1 - len(walk))
        assert tables.paths[i].tolist() == expect
    assert torch.equal(tables.global_parents, gp) and torch.equal(tables.node_request, trees.request_index())


def test_packed_upload_keeps_every_array():
    arrays = {"a": np.arange(5), "b": np.array([[1, -2], [3, 4]]), "empty": np.zeros(0, dtype=np.int64), "c": np.array([7])}
    dev = packed_upload(arrays, "cpu")
    for name, a in arrays.items():
        assert dev[name].dtype == torch.int64 and dev[name].tolist() == a.tolist(), name


def test_tables_of_another_batch_are_refused():
    gen = torch.Generator().manual_seed(0)
    trees = batch([random_tree_parents(5, gen)], 9, gen)
    other = TreeTables.of(batch([random_tree_parents(6, gen)], 9, gen))
    with pytest.raises(ValueError, match="do not belong to a batch of 1 requests / 5 nodes"):
        verify_greedy(torch.randn(5, 9), trees, other)


# ---------------------------------------------------------------------------------------------
# the verifiers


def test_inverse_cdf_matches_including_zeros_and_rounding():
    gen = torch.Generator().manual_seed(3)
    w = torch.rand(64, 9, generator=gen, dtype=torch.float64)
    w[w < 0.4] = 0.0
    w[0] = 0.0  # all zero
    w[1] = torch.tensor([0, 0, 1e-300, 0, 1.0, 0, 0, 1e-300, 0], dtype=torch.float64)  # absorbed tail
    u = torch.rand(64, generator=gen, dtype=torch.float64)
    u[:8] = torch.nextafter(torch.tensor(1.0, dtype=torch.float64), torch.tensor(0.0, dtype=torch.float64))
    u[8:10] = 0.0
    assert torch.equal(inverse_cdf(w, u), before.inverse_cdf_before(w, u))
    assert torch.equal(inverse_cdf(w.float(), u.float()), before.inverse_cdf_before(w.float(), u.float()))


@pytest.mark.parametrize("name,make", CASES)
@pytest.mark.parametrize("seed", range(3))
def test_accept_result_of_every_last_node(name, make, seed):
    gen = torch.Generator().manual_seed(seed)
    trees = batch(make(gen), 6, gen)
    tables = TreeTables.of(trees)
    starts = trees.cu_nodes[:-1]
    sizes = trees.cu_nodes.diff()
    for j in range(int(sizes.max())):  # every node as the last one (clamped to each tree)
        last = starts + torch.minimum(torch.full_like(sizes, j), sizes - 1)
        bonus = torch.randint(0, 50, (trees.num_requests,), generator=gen)
        want = before.accept_result_from_last_node_before(trees, last, bonus)
        same_result(accept_result_from_last_node(trees, last, bonus, tables), want)
        same_result(accept_result_from_last_node(trees, last, bonus), want)


def planted(trees, gen, vocab, mode):
    """Logits with the argmax along a random path (``full``: to the tree's first deepest node;
    ``none``: the root's argmax matches no child)."""
    logits = torch.randn(trees.num_nodes, vocab, generator=gen, dtype=torch.float64)
    tables = TreeTables.of(trees)
    for r in range(trees.num_requests):
        s, e = int(trees.cu_nodes[r]), int(trees.cu_nodes[r + 1])
        if mode == "none":
            kids = {int(trees.tokens[c]) for c in range(s + 1, e) if int(trees.parents[c]) == 0}
            free = [t for t in range(vocab) if t not in kids]
            if free:  # (a small vocabulary may have every token among the root's children)
                logits[s, free[0]] = 100.0
            continue
        last = int(tables.deepest[r]) if mode == "full" else s + int(torch.randint(0, e - s, (1,), generator=gen))
        for node in tables.paths[last].tolist()[1:]:
            if node >= 0:
                logits[int(tables.global_parents[node]), trees.tokens[node]] = 100.0
    return logits


@pytest.mark.parametrize("name,make", CASES)
@pytest.mark.parametrize("mode", ["random", "full", "none", "path"])
def test_greedy_matches(name, make, mode):
    gen = torch.Generator().manual_seed(seed_of(name, mode))
    for vocab, distinct in ((7, False), (120, True)):
        trees = batch(make(gen), vocab, gen, distinct)
        logits = planted(trees, gen, vocab, mode) if mode != "random" else torch.randn(trees.num_nodes, vocab, generator=gen)
        want = before.verify_greedy_before(logits, trees)
        same_result(verify_greedy(logits, trees), want)
        same_result(verify_greedy(logits, trees, TreeTables.of(trees)), want)
        if mode == "full" and distinct:  # the whole deepest path accepted
            assert torch.equal(want.num_accepted, trees.depth[TreeTables.of(trees).deepest])
        if mode == "none" and distinct:
            assert int(want.num_accepted.sum()) == 0


def node_probs(trees, gen, vocab, mode, dtype):
    """Target probabilities: random, concentrated on a planted path (``full``) or on no child (``none``)."""
    if mode == "random":
        return torch.softmax(torch.randn(trees.num_nodes, vocab, generator=gen, dtype=torch.float64) * 2, -1).to(dtype)
    return torch.softmax(planted(trees, gen, vocab, mode), -1).to(dtype)


@pytest.mark.parametrize("name,make", CASES)
@pytest.mark.parametrize("mode", ["random", "full", "none"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_target_only_matches(name, make, mode, dtype):
    gen = torch.Generator().manual_seed(seed_of(name, mode, dtype))
    vocab = 6  # small: duplicate sibling tokens and children covering most of the vocabulary
    trees = batch(make(gen), vocab, gen)
    probs = node_probs(trees, gen, vocab, mode, dtype)
    width = int(trees.depth.max()) + 1
    for u in (torch.rand(trees.num_requests, width, generator=gen, dtype=torch.float64),
              torch.zeros(trees.num_requests, width, dtype=torch.float64),
              torch.full((trees.num_requests, width), 1 - 2**-53, dtype=torch.float64)):
        want = before.verify_target_only_before(probs, trees, uniforms=u)
        same_result(verify_target_only(probs, trees, uniforms=u), want)
        same_result(verify_target_only(probs, trees, uniforms=u, tables=TreeTables.of(trees)), want)
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    same_result(verify_target_only(probs, trees, generator=g1), before.verify_target_only_before(probs, trees, generator=g2))


@pytest.mark.parametrize("chunk", [1, 3 * 7, 10**9])
def test_target_only_decisions_in_chunks_match(chunk, monkeypatch):
    """Nodes decided in chunks of rows (one per node, a few, all at once): the same outcomes."""
    from vllm_tfm.verify import sampling

    gen = torch.Generator().manual_seed(21)
    trees = batch(random_trees(gen, 4, kinds=("deep", "random")), 5, gen)
    probs = node_probs(trees, gen, 5, "full", torch.float32)
    u = torch.rand(trees.num_requests, int(trees.depth.max()) + 1, generator=gen, dtype=torch.float64)
    want = before.verify_target_only_before(probs, trees, uniforms=u)
    monkeypatch.setattr(sampling, "WALK_CHUNK_ELEMENTS", chunk)
    got = verify_target_only(probs, trees, uniforms=u)
    same_result(got, want)
    assert int(want.num_accepted.max()) >= 2  # the walks go below the roots


def test_target_only_walks_a_planted_full_path():
    """Probability 1 on the path's children: every request accepts its first deepest path."""
    gen = torch.Generator().manual_seed(5)
    trees = batch(random_trees(gen, 5, kinds=("deep", "random")), 80, gen, distinct=True)
    probs = torch.softmax(planted(trees, gen, 80, "full") * 10, -1)
    res = verify_target_only(probs, trees, generator=gen)
    assert torch.equal(res.num_accepted, trees.depth[TreeTables.of(trees).deepest])
    assert int(res.num_accepted.max()) >= 3


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("temps", [[0.0, 0.0, 0.0], [1.0, 0.7, 1.3], [0.0, 1.0, 0.0], [1.0]])
def test_verify_tree_with_host_parameters_matches(seed, temps):
    gen = torch.Generator().manual_seed(seed)
    vocab = 8
    trees = batch(random_trees(gen, len(temps)), vocab, gen)
    logits = torch.randn(trees.num_nodes, vocab, generator=gen) * 3
    r = len(temps)
    top_k = np.array([vocab, 3, 0][:r])
    top_p = np.array([1.0, 0.9, 0.8][:r])
    min_p = np.array([0.0, 0.05, 0.1][:r])
    host = TreeSamplingParams.from_host(np.array(temps, dtype=np.float32), top_k, top_p, min_p, "cpu")
    plain = before.tree_sampling_params_before(np.array(temps, dtype=np.float32), top_k, top_p, min_p, "cpu")
    assert host.host_greedy.tolist() == [t == 0 for t in temps] and plain.host_greedy is None
    for name in ("temperature", "top_k", "top_p", "min_p"):
        a, b = getattr(host, name), getattr(plain, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    u = torch.rand(r, int(trees.depth.max()) + 1, generator=gen, dtype=torch.float64)
    want = before.verify_tree_before(logits, trees, plain, uniforms=u)
    same_result(verify_tree(logits, trees, host, uniforms=u, tables=TreeTables.of(trees)), want)
    same_result(verify_tree(logits, trees, plain, uniforms=u), want)
    torch.manual_seed(seed)  # the default generator: the same draws when no uniforms are given
    want = before.verify_tree_before(logits, trees, plain)
    torch.manual_seed(seed)
    same_result(verify_tree(logits, trees, host, tables=TreeTables.of(trees)), want)


def test_host_parameters_are_checked_on_the_host():
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        TreeSamplingParams.from_host(np.array([0.5, -1.0]), None, None, None, "cpu")
    with pytest.raises(ValueError, match="top_p must be in"):
        TreeSamplingParams.from_host(np.array([0.5]), None, np.array([0.0]), None, "cpu")
    with pytest.raises(ValueError, match="min_p must be in"):
        TreeSamplingParams.from_host(np.array([0.5]), None, None, np.array([1.5]), "cpu")
    with pytest.raises(ValueError, match=r"host_greedy must have shape \[2\]"):
        TreeSamplingParams(torch.zeros(2), host_greedy=np.zeros(3, dtype=bool))


@pytest.mark.parametrize("name,make", CASES)
def test_replay_matches(name, make):
    gen = torch.Generator().manual_seed(len(name))
    trees = batch(make(gen), 9, gen)
    logits = torch.randn(trees.num_nodes, 9, generator=gen)
    cdf = pmf_cdf([0.2, 0.1, 0.3, 0.1, 0.1, 0.1, 0.1])
    for u in (torch.rand(trees.num_requests, generator=gen, dtype=torch.float64),
              torch.zeros(trees.num_requests, dtype=torch.float64),  # nothing accepted
              torch.full((trees.num_requests,), 0.999, dtype=torch.float64)):  # deepest draw: clamped to the tree
        want, drawn, clamped = before.replay_accept_before(trees, logits, u, cdf)
        for tables in (None, TreeTables.of(trees)):
            out = replay_accept(trees, logits, u, cdf, tables)
            same_result(out.result, want)
            assert torch.equal(out.drawn, drawn) and torch.equal(out.clamped, clamped)


def test_process_logits_is_shared():
    """process_logits is not part of the rewrite: the oracle imports the current one."""
    assert before.process_logits is process_logits


# ---------------------------------------------------------------------------------------------
# the commit's K/V compaction


@pytest.mark.parametrize("seed", range(4))
def test_compaction_matches_with_two_block_sizes(seed):
    gen = torch.Generator().manual_seed(seed)
    rows = [5, 1, 9, 3]
    t = sum(rows)
    row_base = torch.tensor([0, 5, 6, 15])
    acc = torch.full((4, 8), -1)
    acc[0, :2] = torch.tensor([2, 4])  # a path
    acc[2, :8] = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8])  # the full chain accepted (moves onto itself)
    acc[3, :1] = torch.tensor([2])  # request 1 accepts nothing
    caches_new, caches_old, originals = [], [], []
    for bs in (4, 4, 8, 4):  # one group, caches of two block sizes
        blocks = -(-t // bs) + 3
        storage = torch.randn(blocks, bs, 2, 6, generator=gen)
        caches_new.append(storage.permute(0, 2, 1, 3))
        caches_old.append(storage.clone().permute(0, 2, 1, 3))
        originals.append(storage.clone().permute(0, 2, 1, 3))
    slot_mapping = torch.randperm(t + 8, generator=gen)[:t]
    src, dst = compaction_rows(row_base, acc)
    src0, dst0 = before.compaction_rows_before(row_base, acc)
    assert torch.equal(src, src0) and torch.equal(dst, dst0)
    compact_kv(caches_new, slot_mapping, src, dst)
    before.compact_kv_before(caches_old, slot_mapping, src0, dst0)
    for a, b in zip(caches_new, caches_old):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, o) for a, o in zip(caches_new, originals))  # something moved


# ---------------------------------------------------------------------------------------------
# the runtime: TFMTreeSampler and commit_step on steps built from stored proposals


B = 6
H, K, HV, V, W = 1, 32, 2, 16, 4


def make_step(gen, kinds, extra_prefill=False):
    from vllm_tfm.vllm_plugin.runtime.inputs import build_step_tree
    from vllm_tfm.vllm_plugin.runtime.state import ProposalStore

    store = ProposalStore()
    req_ids, sched, spec = [], [], {}
    ids, toks, pars = [], [], []
    if extra_prefill:
        req_ids.append("pre")
        sched.append(4)
    for r, kind in enumerate(kinds):
        rid = f"q{r}"
        parents = random_tree_parents(B + 1, gen, kind)
        tokens = torch.randint(0, 11, (B,), generator=gen)
        req_ids.append(rid)
        sched.append(B + 1)
        spec[rid] = tokens.tolist()
        ids.append(rid)
        toks.append(tokens)
        pars.append(parents)
    store.put(ids, torch.stack(toks), torch.stack(pars))
    step = build_step_tree(req_ids, np.array(sched), spec, store, allow_trees=True, force_tree_path=True)
    drafts = torch.tensor([t for rid in req_ids if rid in spec for t in spec[rid]], dtype=torch.int32)
    return step, drafts, req_ids


def runtime_sampler(num_req, temps, replay, B_):
    from vllm_tfm.vllm_plugin.benchmark_mode import ReplaySpec
    from vllm_tfm.vllm_plugin.runtime.replay import AcceptanceReplayer
    from vllm_tfm.vllm_plugin.runtime.sampler import TFMTreeSampler

    batch_ = SimpleNamespace(temperature_cpu=np.array(temps, dtype=np.float32), top_k_cpu=np.full(num_req, 4),
                             top_p_cpu=np.full(num_req, 0.9, dtype=np.float32))
    rep = None
    if replay:
        spec = ReplaySpec(profile="t", profile_source="t", measured=False, entry="t", accepted_pmf=[0.2] * 5 + [0.0] * (B_ - 4),
                          profile_mean_accepted_length=1.0, seed=3, spine_top1=None)
        rep = AcceptanceReplayer(spec, "cpu")
    return TFMTreeSampler(torch.nn.Identity(), SimpleNamespace(input_batch=batch_), replay=rep)


STEP_KINDS = [
    ("one tree", ["random"], False),
    ("mixed with a prefill", ["deep", "chain", "star", "random"], True),
    ("chains only", ["chain", "chain"], False),
    ("eight", ["deep", "random", "star", "chain", "random", "deep", "star", "random"], False),
]


@pytest.mark.vllm
@pytest.mark.parametrize("name,kinds,prefill", STEP_KINDS)
@pytest.mark.parametrize("sampling", ["greedy", "sampled", "mixed", "replay"])
def test_runtime_sampler_matches(name, kinds, prefill, sampling):
    pytest.importorskip("vllm")
    from vllm_tfm.vllm_plugin.runtime.metrics import Metrics
    from vllm_tfm.vllm_plugin.runtime.state import STATE

    num_req = len(kinds) + int(prefill)
    temps = {"greedy": [0.0] * num_req, "sampled": [1.0] * num_req, "replay": [1.0] * num_req,
             "mixed": [0.0 if i % 2 else 0.8 for i in range(num_req)]}[sampling]
    outs = []
    for impl in ("before", "after"):
        g = torch.Generator().manual_seed(7)
        step, drafts, _ = make_step(g, kinds, prefill)
        logits = torch.randn(int(step.sample_cu[-1]), 11, generator=g) * 2
        sampler = runtime_sampler(num_req, temps, sampling == "replay", B)
        md = SimpleNamespace(num_draft_tokens=step.num_draft.tolist(), draft_token_ids=drafts, max_spec_len=B)
        smd = sampling_metadata(top_k=torch.ones(1), top_p=torch.ones(1))
        STATE.metrics = Metrics(max_depth=B)
        STATE.step = step
        torch.manual_seed(11)
        try:
            out = before.sample_before(sampler, md, logits, smd) if impl == "before" else sampler(md, None, logits, smd)
        finally:
            STATE.step = None
        outs.append((out.sampled_token_ids, step.accept, STATE.metrics.snapshot()["accepted_hist"],
                     None if sampler.replay is None else sampler.replay.snapshot()))
    (ids0, acc0, hist0, rep0), (ids1, acc1, hist1, rep1) = outs
    assert ids0.dtype == ids1.dtype == torch.int32 and torch.equal(ids0, ids1)
    same_result(acc1, acc0)
    assert hist0 == hist1 and rep0 == rep1


class FakeLaunches:
    """Records the NVRTC launches of the kernel path (kernel, grid, block, smem, argument values)."""

    def __init__(self):
        self.calls = []

    def get_kernel(self, source, name, options, device_index=0):
        return SimpleNamespace(name=(source, name, tuple(options)), max_dynamic_smem=1 << 20, static_smem=0)

    def launch(self, kernel, grid, block, args, shared_mem=0):
        vals = [a.detach().clone() if isinstance(a, torch.Tensor) else (a.value if isinstance(a, ctypes._SimpleCData) else a)
                for a in args]
        self.calls.append((kernel.name, tuple(grid), tuple(block), shared_mem, vals))


def gdn_layers(x_gen, step, num_layers, groups, kernels):
    """Stashes of ``num_layers`` GDN layers in ``groups`` KV-cache groups (their verify ran)."""
    from vllm_tfm.vllm_plugin.runtime import gdn as gdn_mod

    rs, ts = step.num_spec_reqs, step.num_spec_tokens
    slots = rs * (1 + B) + 2
    conv_dim = 2 * H * K + HV * V
    tables = [torch.randperm(slots, generator=x_gen)[: rs * (1 + B)].view(rs, 1 + B).to(torch.int32) for _ in range(groups)]
    prev = torch.randint(1, B + 2, (rs,), generator=x_gen).to(torch.int32)
    states = []
    for i in range(num_layers):
        conv = torch.randn(slots, W - 1 + B, conv_dim, generator=x_gen).transpose(-1, -2)
        ssm = torch.randn(slots, HV, V, K, generator=x_gen)
        x = torch.randn(ts, conv_dim, generator=x_gen)
        ab = torch.randn(ts, HV, generator=x_gen)
        _, stash = gdn_mod.spec_tree_gdn(
            x, ab, ab, step.dev("spec_parents"), step.dev("spec_cu"), conv, ssm, tables[i % groups], prev,
            0.5 * torch.randn(conv_dim, W, generator=x_gen), None, "silu", torch.rand(HV, generator=x_gen).log(),
            torch.randn(HV, generator=x_gen), H, K, HV, V, kernels=kernels)
        step.gdn[f"layer{i}"] = stash
        states.append((conv, ssm))
    return states


def commit_runner(kv):
    return SimpleNamespace(_tfm_kv_groups=[(0, kv)], _tfm_num_gdn=4,
                           input_batch=SimpleNamespace(block_table=[SimpleNamespace(slot_mapping=SimpleNamespace(gpu=SLOTS))]))


SLOTS = torch.randperm(120, generator=torch.Generator().manual_seed(1))[:100]  # 30 blocks of 4


@pytest.mark.parametrize("name,kinds,prefill", STEP_KINDS)
@pytest.mark.parametrize("path", ["reference", "kernels"])
@pytest.mark.parametrize("accept", ["random", "nothing", "deepest"])
def test_commit_step_matches(name, kinds, prefill, path, accept, monkeypatch):
    """The whole commit (K/V of two attention layers, four GDN layers in two groups) on the torch
    references: same caches and states; on the kernel path (launches recorded, not run): the
    same launches with the same argument values."""
    from vllm_tfm.kernels import conv as kconv
    from vllm_tfm.kernels import gdn as kgdn
    from vllm_tfm.verify.accept_result import AcceptResult
    from vllm_tfm.vllm_plugin.runtime import gdn as gdn_mod
    from vllm_tfm.vllm_plugin.runtime import hooks
    from vllm_tfm.vllm_plugin.runtime.metrics import Metrics
    from vllm_tfm.vllm_plugin.runtime.state import STATE
    from vllm_tfm.vllm_plugin.runtime.step_kernels import StepKernels

    fake = FakeLaunches()
    if path == "kernels":
        for mod in (kgdn, kconv):
            monkeypatch.setattr(mod, "get_kernel", fake.get_kernel)
            monkeypatch.setattr(mod, "launch", fake.launch)
        for mod, fn in ((kgdn, "commit_unsupported_reason"), (kgdn, "verify_unsupported_reason"), (kconv, "conv_unsupported_reason")):
            monkeypatch.setattr(mod, fn, lambda *a, **k: None)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(multi_processor_count=132, major=9))
        monkeypatch.setattr("vllm_tfm.kernels.loader.device_smem_optin", lambda i: 227 * 1024)
        # the per-layer commit kernels, as the step before the rewrite ran them (the batched commit,
        # on by default, has its own tests: test_batched_commit.py)
        monkeypatch.setenv("VLLM_TFM_BATCHED_COMMIT", "0")
        # the layers' prologue as separate torch ops: the conv launch that would also write the gates is
        # recorded, not run (the fused prologue has its own tests: test_gdn_layer_host.py)
        monkeypatch.setattr(gdn_mod, "_prologue_extras", lambda *a: None)
    results = []
    for impl in ("before", "after"):
        fake.calls.clear()
        g = torch.Generator().manual_seed(21)
        step, _, _ = make_step(g, kinds, prefill)
        tables = StepKernels(step, torch.device("cpu")) if path == "kernels" else None
        monkeypatch.setattr(hooks, "step_kernels", lambda s, d, t=tables: t)
        monkeypatch.setattr(gdn_mod, "step_kernels", lambda s, d, t=tables: t)
        states = gdn_layers(g, step, 4, 2, tables)
        if path == "kernels":  # the verify's launches did not run: give the stash defined values
            for stash in step.gdn.values():
                stash.k = torch.randn(stash.k.shape, generator=g)
                stash.delta = torch.randn(stash.delta.shape, generator=g)
        fake.calls.clear()  # only the commit's launches
        kv = [torch.randn(30, 4, 2, 6, generator=g).permute(0, 2, 1, 3) for _ in range(2)]
        st = step.sample_tables()
        if accept == "random":
            last = st.starts + (torch.rand(step.num_reqs, generator=g) * (st.starts.new_tensor(np.diff(step.sample_cu)))).long()
        elif accept == "nothing":
            last = st.starts.clone()
        else:
            last = st.deepest.clone()
        trees = TreeBatch(torch.arange(int(step.sample_cu[-1])), step.dev("sample_parents"), step.dev("sample_depth"), step.dev("sample_cu"))
        step.accept = accept_result_from_last_node(trees, last, torch.zeros_like(last), st)
        assert isinstance(step.accept, AcceptResult)
        STATE.metrics = Metrics(max_depth=B)
        runner = commit_runner(kv)
        (before.commit_step_before if impl == "before" else hooks.commit_step)(runner, step)
        results.append((kv, states, list(fake.calls)))
    (kv0, st0, calls0), (kv1, st1, calls1) = results
    for a, b in zip(kv0 + [t for s in st0 for t in s], kv1 + [t for s in st1 for t in s]):
        assert torch.equal(a, b)
    assert len(calls0) == len(calls1) == (8 if path == "kernels" else 0)
    for c0, c1 in zip(calls0, calls1):
        assert c0[:4] == c1[:4]
        for v0, v1 in zip(c0[4], c1[4]):
            assert (torch.equal(v0, v1) and v0.dtype == v1.dtype) if isinstance(v0, torch.Tensor) else v0 == v1


def test_step_upload_is_one_copy_of_the_host_arrays_and_the_tables_another():
    from vllm_tfm.vllm_plugin.runtime.state import DERIVED_UPLOAD, STEP_UPLOAD

    gen = torch.Generator().manual_seed(8)
    step, _, _ = make_step(gen, ["deep", "chain", "star"], extra_prefill=True)
    assert step.tree_active
    dev = {name: step.dev(name) for name in STEP_UPLOAD + DERIVED_UPLOAD}
    assert step._sample_tables is None  # the sampler's tables: built and copied at its first read, after the forward
    tables = step.sample_tables()
    storages = {t.untyped_storage().data_ptr() for t in dev.values()}
    assert len(storages) == 1  # one buffer, one transfer
    table_storages = {getattr(tables, n).untyped_storage().data_ptr() for n in ("starts", "children", "paths", "deepest")}
    assert len(table_storages) == 1 and table_storages.isdisjoint(storages)  # the tables: one transfer of their own
    for name in STEP_UPLOAD:
        assert dev[name].tolist() == np.asarray(getattr(step, name)).tolist(), name
    assert dev["sample_nonroot"].tolist() == np.nonzero(step.sample_parents >= 0)[0].tolist()
    assert dev["replayed"].tolist() == (step.is_spec & (step.num_draft > 0)).astype(int).tolist()
    assert step.dev("replayed").tolist() == [0, 1, 1, 1]  # the prefill row is not replayed
    trees = TreeBatch(torch.zeros(int(step.sample_cu[-1]), dtype=torch.long), torch.from_numpy(step.sample_parents),
                      torch.from_numpy(step.sample_depth), torch.from_numpy(step.sample_cu))
    again = TreeTables.of(trees)
    for name in ("starts", "node_request", "global_parents", "children", "paths", "deepest"):
        assert torch.equal(getattr(tables, name), getattr(again, name)), name
    assert tables.max_depth == again.max_depth == int(step.sample_depth.max())
