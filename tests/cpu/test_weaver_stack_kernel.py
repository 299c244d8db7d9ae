"""The Weaver stack kernel (``cuda/weaver_stack.cu`` behind ``vllm_tfm.kernels.weaver_stack``) in the
CPU emulation: one cooperative launch per scorer call, bit for bit the per-op kernels (``weaver_linear``
with one warp per unit, ``weaver_node_attention``) in the queries, the K/V caches and the key-mask
rows, and the torch reference to rounding; over grids of several blocks (grid barriers), chunked
weight streams (K over one chunk, partial steps), every dtype, 1-3 layers, 1-16 rows, invalid rows."""

from __future__ import annotations

import random
from pathlib import Path
from unittest import mock

import pytest
import torch
from _emulation import emulated, emulation_build_dir

from vllm_tfm.kernels import candidate_scores as kc
from vllm_tfm.kernels import weaver_attention as ka
from vllm_tfm.kernels import weaver_linear as kl
from vllm_tfm.kernels import weaver_stack as ks
from vllm_tfm.models import Weaver, WeaverConfig
from vllm_tfm.models.weaver import BatchedWeaverTreeScorer

DEPTH, TOP_K, VOCAB, SLOTS = 4, 8, 96, 9


@pytest.fixture(scope="module")
def emu_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return emulation_build_dir(tmp_path_factory, "emu_stack")


def scorers(seed: int, r: int, dtype: torch.dtype, hidden: int, d: int, heads: int, d_mlp: int, layers: int):
    """Two kernel-path scorers (per-op, stack) and the torch path, on the same random Weaver and inputs."""
    torch.manual_seed(seed)
    cfg = WeaverConfig(d_model=hidden, d_rank=d, n_layers=layers, n_heads=heads, d_mlp=d_mlp, max_depth=DEPTH)
    weaver = Weaver(cfg).eval()
    with torch.no_grad():
        for p in weaver.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    weaver = weaver.to(dtype)
    embed, head = torch.randn(VOCAB, hidden, dtype=dtype), torch.randn(VOCAB, hidden, dtype=dtype) * 0.1
    inputs = (torch.randn(r, hidden, dtype=dtype), torch.randn(r, DEPTH, hidden, dtype=dtype),
              torch.randint(0, VOCAB, (r, DEPTH, TOP_K)), torch.randn(r, DEPTH, TOP_K, dtype=dtype))
    return [BatchedWeaverTreeScorer(weaver, *inputs, embed, head, max_nodes=SLOTS, score_kernel=k)
            for k in (True, True, False)]


def protocol_calls(r: int, w: int, rounds: int, seed: int, invalid: float = 0.2):
    """Scorer calls of the lockstep protocol: the roots, then w new nodes per request and round under
    random earlier nodes; some rows invalid (never a root)."""
    g = random.Random(seed)
    calls = []
    depth = [{0: 0} for _ in range(r)]  # per request: node -> depth
    nxt = [1] * r
    t = torch.tensor
    calls.append((t([[0] * w] * r), t([[-1] * w] * r), t([[g.randrange(VOCAB) for _ in range(w)] for _ in range(r)]),
                  t([[0] * w] * r), t([[True] + [False] * (w - 1)] * r)))
    for _ in range(rounds):
        nodes, parents, toks, deps, valid = [], [], [], [], []
        for q in range(r):
            row = ([], [], [], [], [])
            known = dict(depth[q])
            for _ in range(w):
                ok = nxt[q] < SLOTS and g.random() >= invalid
                cands = [n for n, dd in known.items() if dd + 1 < DEPTH]
                par = g.choice(cands) if cands else 0
                nid = nxt[q] if ok else 0
                row[0].append(nid)
                row[1].append(par)
                row[2].append(g.randrange(VOCAB))
                row[3].append(known[par] + 1 if ok else 0)
                row[4].append(ok and bool(cands))
                if row[4][-1]:
                    depth[q][nid] = known[par] + 1
                    nxt[q] += 1
            for lst, vals in zip((nodes, parents, toks, deps, valid), row):
                lst.append(vals)
        calls.append(tuple(t(x) for x in (nodes, parents, toks, deps, valid)))
    return calls


def run_case(emu_dir: Path, seed: int, r: int, w: int, dtype: torch.dtype, hidden: int = 48, d: int = 32,
             heads: int = 2, d_mlp: int = 48, layers: int = 2, ctas: int = 3, rounds: int = 2) -> None:
    per_op, stacked, torch_path = scorers(seed, r, dtype, hidden, d, heads, d_mlp, layers)
    calls = protocol_calls(r, w, rounds, seed)
    none = lambda *a, **k: None  # noqa: E731  (the kernels take CPU tensors in the emulation)
    with (emulated(emu_dir) as launches, mock.patch.object(kc, "unsupported_reason", none),
          mock.patch.object(kl, "unsupported_reason", none), mock.patch.object(ka, "unsupported_reason", none),
          mock.patch.object(kl, "k_split", lambda units, k: 1), mock.patch.object(ks, "grid_size", lambda i: ctas)):
        for node, parent, tok, dep, valid in calls:
            launches.clear()
            with mock.patch.dict("os.environ", {ks.ENV_SWITCH: "0"}):
                want = per_op(node, parent, tok, dep, valid)
            assert "weaver_stack" not in [name for name, *_ in launches]
            launches.clear()
            with (mock.patch.dict("os.environ", {ks.ENV_SWITCH: "1"}),
                  mock.patch.object(ks, "unsupported_reason", none)):
                got = stacked(node, parent, tok, dep, valid)
            assert [name for name, *_ in launches] == ["weaver_stack", "candidate_scores"]
            assert launches.cooperative == [0] and launches[0][1] == (ctas, 1, 1)
            ref = torch_path(node, parent, tok, dep, valid)
            assert torch.equal(got[valid], want[valid])  # log-probabilities of the valid rows, bit for bit
            tol = 2e-5 if dtype == torch.float32 else 0.15
            assert torch.allclose(got[valid].float(), ref[valid].float(), rtol=0, atol=tol)
    for a, b in zip(per_op.kv_cache, stacked.kv_cache):
        assert torch.equal(a, b)  # every valid node's K/V in every layer
    assert torch.equal(per_op.key_bias, stacked.key_bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_stack_equals_the_per_op_kernels(emu_dir: Path, dtype) -> None:
    run_case(emu_dir, 1, 2, 2, dtype)


def test_long_rows_span_several_chunks(emu_dir: Path) -> None:
    # token_in's K = 1160 (two chunks of 1024 columns, the last step partial), down's K = 264
    run_case(emu_dir, 2, 1, 2, torch.bfloat16, hidden=1160, d=64, d_mlp=264, layers=1, ctas=2, rounds=1)
    # float32 chunks are 512 columns: three of them
    run_case(emu_dir, 3, 1, 1, torch.float32, hidden=1160, d=32, d_mlp=40, layers=1, ctas=2, rounds=1)


def test_one_block_one_row_and_sixteen_rows(emu_dir: Path) -> None:
    run_case(emu_dir, 4, 1, 1, torch.bfloat16, layers=3, ctas=1, rounds=3)
    run_case(emu_dir, 5, 4, 4, torch.float16, layers=1, ctas=5, rounds=2)


def test_fresh_random_shapes(emu_dir: Path) -> None:
    g = random.Random(7)
    for case in range(2):
        dtype = g.choice([torch.float32, torch.bfloat16, torch.float16])
        heads = g.randint(1, 3)
        hd = g.choice([8, 16])
        run_case(emu_dir, 10 + case, g.randint(1, 3), g.randint(1, 3), dtype, hidden=8 * g.randint(3, 12),
                 d=heads * hd, heads=heads, d_mlp=8 * g.randint(2, 9), layers=g.randint(1, 3), ctas=g.randint(1, 4))


def tiny_stack_args(r: int = 1, w: int = 2, dtype: torch.dtype = torch.bfloat16):
    """The stack's arguments of a tiny scorer's first call (CPU tensors), and the scorer."""
    scorer = scorers(20, r, dtype, 48, 32, 2, 48, 2)[1]
    node, parent, tok, dep, valid = protocol_calls(r, w, 0, 20)[0]
    emb = torch.randn(r * w, 48, dtype=dtype)
    with mock.patch.dict("os.environ", {ks.ENV_SWITCH: "1"}):
        assert scorer._stack(emb, node, parent, dep, valid) is None  # CPU tensors: not taken
    args = [emb, scorer._stack_weights, scorer._rope_nodes, node, parent, dep, valid, scorer.kv_cache, scorer.key_bias,
            1 + DEPTH, 16 ** -0.5]
    return args, scorer


def test_which_inputs_the_stack_takes() -> None:
    args, _ = tiny_stack_args()
    assert ks.unsupported_reason(*args) == ks.NOT_CUDA  # everything but the device
    bad = list(args)
    bad[0] = args[0].float()
    assert "share one of float32, bfloat16, float16" in ks.unsupported_reason(*bad)
    big, _ = tiny_stack_args(r=6, w=3)
    assert ks.unsupported_reason(*big) == "18 rows R w: the kernel takes at most 16"
    wts = args[1]
    bad = list(args)
    bad[1] = ks.StackWeights(wts.tok_w, wts.tok_b, wts.tok_eps, wts.layers * 3, wts.qry_w, wts.qry_b, wts.qry_eps)
    assert ks.unsupported_reason(*bad) == "6 layers and 2 K/V caches: the kernel takes 1..4 layers, one cache each"
    bad = list(args)
    lw = wts.layers[0]
    odd = ks.StackLayer(lw.qkv_w, lw.qkv_b, lw.attn_eps, lw.o_w, lw.gu_w[:, :31], lw.gu_b, lw.mlp_eps, lw.down_w)
    bad[1] = ks.StackWeights(wts.tok_w, wts.tok_b, wts.tok_eps, (odd, wts.layers[1]), wts.qry_w, wts.qry_b, wts.qry_eps)
    assert ks.unsupported_reason(*bad) == "gu_w[0] has shape (96, 31), the stack needs (96, 32)"
    bad = list(args)
    bad[7] = [args[7][0], args[7][1][:, :, :1]]
    assert ks.unsupported_reason(*bad) == "the layers' K/V caches differ in shape"
    bad = list(args)
    bad[0] = args[0].t().contiguous().t()  # the same values, column-major
    assert ks.unsupported_reason(*bad) == "emb and the weights must be contiguous and 16-byte aligned"


def test_the_switch_is_off_by_default_and_too_many_rows_fall_back(emu_dir: Path, monkeypatch) -> None:
    monkeypatch.delenv(ks.ENV_SWITCH, raising=False)
    assert not ks.stack_enabled()
    none = lambda *a, **k: None  # noqa: E731
    for r, w, env in ((1, 2, None), (6, 3, "1")):  # off by default; on, but 18 rows: the per-op kernels
        scorer = scorers(21, r, torch.bfloat16, 48, 32, 2, 48, 1)[0]
        if env is not None:
            monkeypatch.setenv(ks.ENV_SWITCH, env)
        warned = []
        with (emulated(emu_dir) as launches, mock.patch.object(kc, "unsupported_reason", none),
              mock.patch.object(ka, "unsupported_reason", none),  # the linear layers: torch (CPU tensors)
              mock.patch("vllm_tfm.models.weaver.warn_fallback", lambda *a: warned.append(a))):
            scorer(*protocol_calls(r, w, 0, 21)[0])
        names = [name for name, *_ in launches]
        assert "weaver_stack" not in names and names.count("weaver_node_attention") == 1
        assert warned == []  # the row count is not worth a warning (nor are CPU tensors)


def test_launch_config_sets_the_cooperative_attribute() -> None:
    from vllm_tfm.kernels import loader

    try:
        driver, _ = loader._import_cuda()
    except ImportError as exc:
        pytest.skip(f"cuda-python: {exc}")
    cfg = loader._launch_config(driver, (132, 1, 1), (256, 1, 1), 200_000, 0, False, 1, True)
    assert cfg.numAttrs == 1 and cfg.gridDimX == 132 and cfg.sharedMemBytes == 200_000
    assert cfg.attrs[0].id == driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_COOPERATIVE
    assert cfg.attrs[0].value.cooperative == 1
    assert loader._launch_config(driver, (2, 1, 1), (32, 1, 1), 0, 0, True, 1, False).numAttrs == 1

    class Kernel:
        name = "weaver_stack"

    with pytest.raises(loader.KernelLaunchError,
                       match="weaver_stack: a cooperative launch cannot be a programmatic dependent launch"):
        loader.launch(Kernel(), (1, 1, 1), (32, 1, 1), [], programmatic=True, cooperative=True)


def test_the_runtime_switch_and_the_weaver_graphs_key(monkeypatch) -> None:
    """``VLLM_TFM_WEAVER_STACK`` (default off) / ``set_weaver_stack`` and the Weaver graphs' key, which holds
    the setting, so that a same-engine A/B replays another graph."""
    from vllm_tfm.vllm_plugin.runtime import set_weaver_stack
    from vllm_tfm.vllm_plugin.runtime.weaver_graphs import graph_key

    monkeypatch.delenv(ks.ENV_SWITCH, raising=False)
    try:
        assert set_weaver_stack(None, True) is True and ks.stack_enabled()
        assert set_weaver_stack(None, None) is False  # back to the environment's
        monkeypatch.setenv(ks.ENV_SWITCH, "1")
        assert ks.stack_enabled() and set_weaver_stack(None, False) is False
        logits, hidden, verifier = torch.zeros(1, 3, 50), torch.zeros(1, 3, 8), torch.zeros(1, 8)
        table, weaver = torch.zeros(50, 8), torch.nn.Linear(1, 1)
        keys = {on: (ks.set_stack(on), graph_key(1, weaver, logits, hidden, verifier, table, table, 4, 5, 2, 2))[1]
                for on in (False, True)}
        assert keys[False][-1] is False and keys[True][-1] is True and keys[False][:-1] == keys[True][:-1]
    finally:
        ks.set_stack(None)


def bench_module():
    """``bench/weaver_stack.py`` as a module (its variants and timeline reading)."""
    import importlib
    import sys

    bench = str(Path(__file__).resolve().parents[2] / "bench")
    sys.path.insert(0, bench)
    try:
        return importlib.import_module("weaver_stack")
    finally:
        sys.path.remove(bench)


def bench_variant(spec: str):
    return bench_module().variant(spec)


def test_barrier_forms_and_ring_depths_give_the_same_bits(emu_dir: Path) -> None:
    """The grid barrier's two forms (``TFM_GRID_BARRIER`` 0 fences, 1 ordered atomics) and stage counters
    (``WS_SYNC=1``), rings of 2, 3 and 6 chunk slots, the epilogue's loads early (default) or late
    (``WS_EARLY_EPILOGUE=0``), as ``bench/weaver_stack.py --variants`` spells them: the same queries and K/V
    writes, over a grid of 3 blocks (the first call of a scorer's protocol)."""
    out = []
    for spec in ("0:6", "1:6", "1:3", "0:2", "1:2", "0:6:0", "1:3:0", "2:3", "2:6:0"):
        args, _ = tiny_stack_args(r=2, w=2)
        _, slots, defines = bench_variant(spec)
        with emulated(emu_dir) as launches:
            q = ks.weaver_stack_kernel(*args, ctas=3, slots=slots, defines=defines)
        assert [name for name, *_ in launches] == ["weaver_stack"]
        out.append((q, [kv.clone() for kv in args[7]], args[8].clone()))
    for q, kv, mask in out[1:]:
        assert torch.equal(q, out[0][0]) and torch.equal(mask, out[0][2])
        assert all(torch.equal(a, b) for a, b in zip(kv, out[0][1]))


def test_the_timeline_build_gives_the_same_bits_and_orders_every_stage_after_the_last(emu_dir: Path) -> None:
    """``WS_TIMELINE`` (``marks``): the queries, K/V and mask rows of the build without it; every block's
    marks of every stage in order, and no block starts a stage before every block has ended the one
    before it (the grid barrier, and the stage counters of ``WS_SYNC=1``, read on the emulation's one
    clock)."""
    runs, all_marks = [], []
    for marks, defines in ((None, ()), (torch.zeros(3, len(ks.timeline_stages(2)), 2, dtype=torch.int64), ()),
                           (torch.zeros(3, len(ks.timeline_stages(2)), 2, dtype=torch.int64), ("-DWS_SYNC=1",))):
        args, _ = tiny_stack_args(r=2, w=2)
        with emulated(emu_dir) as launches:
            q = ks.weaver_stack_kernel(*args, ctas=3, marks=marks, defines=defines)
        assert [name for name, *_ in launches] == ["weaver_stack"]
        runs.append((q, [kv.clone() for kv in args[7]], args[8].clone()))
        if marks is not None:
            all_marks.append(marks)
    for q, kv, mask in runs[1:]:
        assert torch.equal(runs[0][0], q) and torch.equal(runs[0][2], mask)
        assert all(torch.equal(a, b) for a, b in zip(runs[0][1], kv))
    assert ks.timeline_stages(2) == ["token_in", "qkv0", "attention0", "o_proj0", "gate_up0", "down0", "qkv1",
                                     "attention1", "o_proj1", "gate_up1", "down1", "query"]
    for marks in all_marks:  # the grid barrier, then the stage counters (WS_SYNC=1)
        t = marks.flatten(1)  # [blocks, 2 stages]: start, end, start, end, ...
        assert bool((t > 0).all()) and bool((t[:, 1:] >= t[:, :-1]).all())
        assert bool((marks[:, 1:, 0].min(0).values >= marks[:, :-1, 1].max(0).values).all())
    args, _ = tiny_stack_args()
    with (emulated(emu_dir) as launches,
          pytest.raises(ValueError, match=r"marks must be a contiguous int64 tensor of shape \(3, 12, 2\) on cpu")):
        ks.weaver_stack_kernel(*args, ctas=3, marks=torch.zeros(3, 12, 2, dtype=torch.int32))
    assert not launches


def test_the_bench_timeline_reads_the_marks(emu_dir: Path) -> None:
    """``bench/weaver_stack.py --timeline``'s reading of the marks: one row per stage in run order, work and
    waits not negative, a stage's span at least its longest block's work, the total at least the spans'
    sum (stages do not overlap across the barriers), the first stage without a wait; the table renders."""
    wsb = bench_module()
    args, _ = tiny_stack_args(r=2, w=2)
    with emulated(emu_dir), mock.patch.object(ks, "grid_size", lambda device: 3):
        tl = wsb.stage_timeline(args, wsb.variant("1:3")[2], 3, 1e12, runs=2)
    n = len(ks.timeline_stages(2))
    assert tl["stages"] == ks.timeline_stages(2) and tl["runs"] == 2
    assert all(len(tl[k]) == n for k in ("work_median", "work_max", "wait_median", "wait_max", "span", "floor_us"))
    assert min(tl["work_median"]) >= 0 and min(tl["wait_median"]) >= 0 and tl["wait_max"][0] == 0
    assert all(s >= w for s, w in zip(tl["span"], tl["work_max"]))
    assert tl["total_us"] >= sum(tl["span"]) - 0.01 * n  # rounded to 0.01 us per stage
    assert tl["floor_us"][2] == 0 and tl["floor_us"][0] == round(1e6 * args[1].tok_w.numel() * 2 / 1e12, 2)
    assert wsb.timeline_table(tl).splitlines()[1].split()[0] == "token_in"
    assert wsb.variant("1:3") == ("stack_b1_s3", 3, ("-DTFM_GRID_BARRIER=1", "-DWS_SYNC=0", "-DWS_EARLY_EPILOGUE=1"))
    assert wsb.variant("0:6:0") == ("stack_b0_s6_e0", 6, ("-DTFM_GRID_BARRIER=0", "-DWS_SYNC=0", "-DWS_EARLY_EPILOGUE=0"))
    assert wsb.variant("2:3") == ("stack_b2_s3", 3, ("-DWS_SYNC=1", "-DWS_EARLY_EPILOGUE=1"))
    with pytest.raises(SystemExit, match="--variants takes B:S or B:S:E, not '1'"):
        wsb.variant("1")
    with pytest.raises(SystemExit, match="--variants: B is 0, 1 or 2 and E is 0 or 1, not '3:3'"):
        wsb.variant("3:3")
