"""vllm_tfm.train: the toy-zoo trainers, end to end on CPU at tiny sizes, plus exactness checks of
the batched training forwards against the inference models and of the losses against brute force.

The tiny zoo (tokenizer -> target -> DFlash -> Weaver -> TreeFlash) is trained once per module
through ``train_main(["all", ...])`` on stdlib sources copied under fixed relative paths.
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vllm_tfm.models import DFlashConfig, DFlashDrafter, TfmConfig, Weaver, WeaverConfig, load_drafter_dir
from vllm_tfm.train.cli import STAGES, train_main
from vllm_tfm.train.data import (
    DataConfig,
    build_manifest,
    eval_windows,
    list_source_files,
    read_texts,
    sample_windows,
)
from vllm_tfm.train.dflash import block_inputs, dflash_block_prenorm, sample_anchors, zlab_target_layer_ids
from vllm_tfm.train.loop import Schedule, lr_at, plan_steps
from vllm_tfm.train.losses import depth_weights, forward_kl, pool_forward_kl
from vllm_tfm.train.tokenizer import (
    EOS_TOKEN,
    MASK_TOKEN,
    TokenizerTrainConfig,
    data_tokenizer,
    special_token_ids,
    train_tokenizer,
)
from vllm_tfm.train.weaver import WeaverBatch, weaver_batch, weaver_pool_logprobs

F64 = torch.float64
SPLIT_MODULUS = 3


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """~100 KB of real Python (stdlib json + wsgiref) under fixed relative paths."""
    import json as json_pkg
    import wsgiref

    root = tmp_path_factory.mktemp("corpus")
    for pkg in (Path(json_pkg.__file__).parent, Path(wsgiref.__file__).parent):
        for f in sorted(pkg.glob("*.py")):
            dst = root / pkg.name / f.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst)
    return root


def _schedule(steps: int, lr: float) -> dict:
    return {"steps": steps, "lr": lr, "warmup_steps": 2, "log_every": 5, "eval_every": 0, "weight_decay": 0.0}


TINY_DATA = {"eval_modulus": SPLIT_MODULUS, "max_train_bytes": None, "max_eval_bytes": None}
TINY = {
    "tokenizer": {"stage": "tokenizer", "vocab_size": 384, "data": TINY_DATA},
    "target": {
        "stage": "target",
        "model": {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 4,
            "full_attention_interval": 4,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "linear_num_key_heads": 1,
            "linear_num_value_heads": 2,
            "linear_key_head_dim": 16,
            "linear_value_head_dim": 16,
            "max_position_embeddings": 512,
            "tie_word_embeddings": True,
        },
        "seq_len": 64,
        "batch_size": 4,
        "eval_windows": 8,
        "eval_batch_size": 8,
        "schedule": _schedule(20, 5e-3),
        "data": TINY_DATA,
    },
    "dflash": {
        "stage": "dflash",
        "model": {
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 16,
            "intermediate_size": 64,
            "block_size": 4,
        },
        "seq_len": 64,
        "batch_size": 4,
        "anchors_per_seq": 8,
        "eval_windows": 4,
        "eval_batch_size": 4,
        "schedule": _schedule(15, 5e-3),
        "data": TINY_DATA,
    },
    "weaver": {
        "stage": "weaver",
        "model": {"d_rank": 16, "n_layers": 1, "n_heads": 2, "d_mlp": 32},
        "top_k": 16,
        "seq_len": 64,
        "batch_size": 4,
        "anchors_per_seq": 8,
        "eval_windows": 4,
        "eval_batch_size": 4,
        "schedule": _schedule(15, 1e-2),
        "data": TINY_DATA,
    },
    "treeflash": {
        "stage": "treeflash",
        "model": {"intermediate_size": 32},
        "seq_len": 64,
        "batch_size": 4,
        "anchors_per_seq": 8,
        "eval_windows": 4,
        "eval_batch_size": 4,
        "schedule": _schedule(15, 1e-2),
        "data": TINY_DATA,
    },
}


@pytest.fixture(scope="module")
def config_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("configs")
    for stage, cfg in TINY.items():
        (d / f"{stage}.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="module")
def zoo(tmp_path_factory, corpus, config_dir) -> dict:
    base = tmp_path_factory.mktemp("zoo")
    argv = [
        "all", "--data-root", str(corpus), "--out", str(base / "zoo"), "--config-dir", str(config_dir),
        "--work-dir", str(base / "work"), "--device", "cpu", "--no-progress", "--seed", "3",
    ]  # fmt: skip
    assert train_main(argv) == 0
    z = base / "zoo"
    cards = {}
    for stage, d in (("tokenizer", "tokenizer"), ("target", "target"), ("dflash", "drafter"), ("weaver", "drafter"), ("treeflash", "drafter")):
        cards[stage] = json.loads((z / d / f"training_{stage}.json").read_text())
    return {"dir": z, "work": base / "work", "cards": cards, "argv": argv}


# --------------------------------------------------------------------------- data


def test_split_and_order_are_a_function_of_the_paths_only(tmp_path):
    names = [f"pkg{i % 3}/mod_{i}.py" for i in range(40)] + ["big.py", "notes.txt", "bad.py", "empty.py"]
    order = names[:]
    random.Random(5).shuffle(order)  # creation order must not matter
    for n in order:
        p = tmp_path / n
        p.parent.mkdir(parents=True, exist_ok=True)
        if n == "big.py":
            p.write_text("x = 1\n" * 400)  # 2400 bytes > max_file_bytes
        elif n == "bad.py":
            p.write_bytes(b"s = '\xff\xfe'\n")  # not UTF-8
        elif n == "empty.py":
            p.write_text("")
        else:
            p.write_text(f"VALUE = {n!r}\n")
    cfg = DataConfig(eval_modulus=4, max_file_bytes=1000, max_train_bytes=None, max_eval_bytes=None)
    listed = list_source_files([tmp_path], cfg)
    rel = [f.relpath for f in listed]
    assert rel == sorted(n for n in names if n.endswith(".py") and n not in ("big.py", "empty.py"))
    man = build_manifest([tmp_path], cfg)
    again = build_manifest([tmp_path], cfg)
    assert man.sha1 == again.sha1 and man.train == again.train and man.eval == again.eval

    def h(p: str) -> int:
        return int(hashlib.sha1(p.encode("utf-8")).hexdigest(), 16)

    assert {f.relpath for f in man.eval} == {r for r in rel if h(r) % 4 == 0}
    assert {f.relpath for f in man.train} == {r for r in rel if h(r) % 4 != 0}
    assert [f.relpath for f in man.train] == sorted((f.relpath for f in man.train), key=lambda r: hashlib.sha1(r.encode()).hexdigest())
    # undecodable files are listed but never read
    texts = read_texts(man.train + man.eval, None)
    assert len(texts) == len(rel) - 1 and all("\ufffd" not in t for t in texts)
    # the fingerprint follows the content size
    (tmp_path / "pkg0/mod_0.py").write_text("VALUE = 'changed, and longer'\n")
    assert build_manifest([tmp_path], cfg).sha1 != man.sha1


def test_empty_split_and_bad_root_are_one_line_errors(tmp_path):
    (tmp_path / "a.py").write_text("a = 1\n")
    with pytest.raises(ValueError, match=r"the (train|eval) split is empty \(1 files, eval_modulus 20\)"):
        build_manifest([tmp_path], DataConfig())
    with pytest.raises(ValueError, match="--data-root .*nope: not a directory"):
        build_manifest([tmp_path / "nope"], DataConfig())


def test_windows_and_anchors_are_pure_functions_of_seed_and_step():
    stream = torch.arange(1000).numpy().astype("uint16")
    a = sample_windows(stream, 4, 16, seed=1, step=7, stream_id=2)
    assert torch.equal(a, sample_windows(stream, 4, 16, seed=1, step=7, stream_id=2))
    assert not torch.equal(a, sample_windows(stream, 4, 16, seed=1, step=8, stream_id=2))
    assert torch.equal(a[:, 1:] - a[:, :-1], torch.ones(4, 15, dtype=torch.long))  # contiguous windows
    ev = eval_windows(stream, 3, 10)
    assert ev[0, 0] == 0 and ev[-1, -1] == 998
    anc = sample_anchors(5, 20, 6, 4, seed=0, step=3, stream_id=1)
    assert torch.equal(anc, sample_anchors(5, 20, 6, 4, seed=0, step=3, stream_id=1))
    assert anc.min() >= 1 and anc.max() <= 20 - 4
    assert all(len(set(r)) == 6 and r == sorted(r) for r in anc.tolist())
    with pytest.raises(ValueError, match="anchors_per_seq 17 exceeds the 16 anchor positions"):
        sample_anchors(1, 20, 17, 4, 0, 0, 0)


# --------------------------------------------------------------------------- tokenizer


def test_tokenizer_is_deterministic_and_specials_are_not_produced_by_text(corpus):
    texts = read_texts(build_manifest([corpus], DataConfig(eval_modulus=SPLIT_MODULUS)).train, None)
    cfg = TokenizerTrainConfig(stage="tokenizer", vocab_size=300)
    a, b = train_tokenizer(texts, cfg), train_tokenizer(texts, cfg)
    assert a.to_str() == b.to_str()
    assert special_token_ids(a) == {"eos": 0, "pad": 1, "mask": 2}
    plain = "def f(x):\n    return {'a': x}  # café\n"
    assert data_tokenizer(a).encode(plain).ids == a.encode(plain).ids
    tricky = f"s = '{EOS_TOKEN}{MASK_TOKEN}'\n"
    ids = data_tokenizer(a).encode(tricky).ids
    assert not {0, 1, 2} & set(ids)
    assert a.decode(ids) == tricky
    assert 0 in a.encode(tricky).ids  # the serving tokenizer does match the special string


def test_zoo_tokenizer_loads_with_autotokenizer(zoo):
    from transformers import AutoTokenizer

    for d in ("tokenizer", "target"):
        tok = AutoTokenizer.from_pretrained(zoo["dir"] / d)
        assert (tok.eos_token_id, tok.pad_token_id, tok.mask_token_id) == (0, 1, 2)
        assert len(tok) == TINY["tokenizer"]["vocab_size"]
        s = "import os\n\n\nclass A:\n    pass\n"
        assert tok.decode(tok(s)["input_ids"]) == s
        assert tok(s)["input_ids"][0] != 0  # no BOS added


# --------------------------------------------------------------------------- every stage learns


@pytest.mark.parametrize("stage", ["target", "dflash", "weaver", "treeflash"])
def test_each_trainer_lowers_its_held_out_loss(zoo, stage):
    card = zoo["cards"][stage]
    first, last = card["eval_initial"], card["eval_final"]
    assert first["step"] == 0 and last["step"] == TINY[stage]["schedule"]["steps"]
    assert last["loss"] < 0.9 * first["loss"], (first, last)
    assert card["status"] == "complete" and card["steps"] == card["steps_planned"] == last["step"]


def test_weaver_and_treeflash_start_at_the_dflash_baseline(zoo):
    w0 = zoo["cards"]["weaver"]["eval_initial"]
    assert w0["loss"] == pytest.approx(w0["loss_dflash"], rel=1e-5)  # zero-init query: Weaver == DFlash pool
    t0 = zoo["cards"]["treeflash"]["eval_initial"]
    assert t0["loss"] == pytest.approx(t0["kl_marginal"], rel=1e-5)  # zero-init down: transitions == marginals
    assert zoo["cards"]["weaver"]["eval_final"]["loss"] < zoo["cards"]["weaver"]["eval_final"]["loss_dflash"]
    assert zoo["cards"]["treeflash"]["eval_final"]["loss"] < zoo["cards"]["treeflash"]["eval_final"]["kl_marginal"]


# --------------------------------------------------------------------------- outputs load back


def test_target_loads_with_automodel_and_reproduces_its_held_out_loss(zoo, corpus):
    from transformers import AutoModelForCausalLM

    from vllm_tfm.train.data import build_token_streams

    d = zoo["dir"] / "target"
    m = AutoModelForCausalLM.from_pretrained(d)
    assert type(m).__name__ == "Qwen3_5ForCausalLM" and next(m.parameters()).dtype == torch.bfloat16
    cfg = m.config
    assert cfg.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg.vocab_size == TINY["tokenizer"]["vocab_size"] and cfg.eos_token_id == 0
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()  # tied
    # the saved bf16 weights are the trained ones: same held-out loss up to bf16 rounding
    m = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    man = build_manifest([corpus], DataConfig(**TINY_DATA))
    streams = build_token_streams(man, d, None)
    w = eval_windows(streams.eval, TINY["target"]["eval_windows"], TINY["target"]["seq_len"] + 1)
    with torch.no_grad():
        logits = m(input_ids=w[:, :-1], use_cache=False).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, cfg.vocab_size), w[:, 1:].reshape(-1)).item()
    assert loss == pytest.approx(zoo["cards"]["target"]["eval_final"]["loss"], abs=0.05)


def test_drafter_dir_loads_and_has_the_zlab_vllm_layout(zoo):
    from transformers import AutoConfig, AutoModelForCausalLM

    d = zoo["dir"] / "drafter"
    target_cfg = AutoConfig.from_pretrained(zoo["dir"] / "target")
    bundle = load_drafter_dir(d, target_config=target_cfg)
    assert bundle.weaver is not None and bundle.treeflash is not None
    assert bundle.tfm is not None and bundle.tfm.top_k == TINY["weaver"]["top_k"]
    dc = bundle.dflash.config
    assert dc.mask_token_id == 2 and dc.block_size == 4
    assert list(dc.target_layer_ids) == zlab_target_layer_ids(4, 1) == [2]
    # model.safetensors: exactly the drafter's own tensors, no shared embed/lm_head (vLLM shares the target's)
    saved = load_file(str(d / "model.safetensors"))
    assert set(saved) == set(DFlashDrafter(dc).state_dict())
    assert all(t.dtype == torch.bfloat16 for t in saved.values())
    hf = AutoConfig.from_pretrained(d)  # how vLLM reads the drafter config
    assert hf.architectures == ["DFlashDraftModel"] and hf.dflash_config["target_layer_ids"] == [2]
    assert load_file(str(d / "tfm" / "weaver.safetensors")).keys() == Weaver(bundle.weaver.config).state_dict().keys()
    # DFlash shares the target's embedding and lm_head: widths and vocabulary agree with the saved target
    tgt = AutoModelForCausalLM.from_pretrained(zoo["dir"] / "target")
    bundle.validate_against_target(tgt.config)
    assert tgt.model.embed_tokens.weight.shape == (dc.vocab_size, dc.hidden_size)


def test_model_cards_state_data_steps_tokens_loss_seed_command(zoo):
    for stage, sub in (("tokenizer", "tokenizer"), ("target", "target"), ("dflash", "drafter"), ("weaver", "drafter"), ("treeflash", "drafter")):
        card = zoo["cards"][stage]
        readme = (zoo["dir"] / sub / "README.md").read_text()
        assert card["seed"] == 3  # --seed override
        assert card["command"].startswith("vllm-tfm train all --data-root ") and f"# stage {stage}" in card["command"]
        assert f"- Command: `{card['command']}`" in readme
        assert f"- Seed: {card['seed']}" in readme
        assert f"- Steps: {card['steps']:,} of {card['steps_planned']:,} planned" in readme
        assert f"- Tokens seen: {card['tokens_seen']:,}" in readme
        assert card["data"]["manifest_sha1"] in readme and "- Data: " in readme
        assert "- Final loss: " in readme
        assert card["data"]["split_rule"] == f"eval iff int(sha1(relpath).hexdigest(), 16) % {SPLIT_MODULUS} == 0"
    t = zoo["cards"]["target"]
    assert t["tokens_seen"] == t["steps"] * TINY["target"]["batch_size"] * TINY["target"]["seq_len"]
    assert f"- Final loss: train {t['final_train_loss']:.4f}; held-out loss {t['eval_final']['loss']:.4f}" in (
        zoo["dir"] / "target" / "README.md"
    ).read_text()


def test_all_with_resume_skips_finished_stages(zoo, capsys):
    assert train_main(zoo["argv"] + ["--resume"]) == 0
    out = capsys.readouterr().out
    for stage in STAGES:
        assert f"[all] {stage}: already complete" in out


# --------------------------------------------------------------------------- resume


def _target_argv(corpus, config_dir, zoo, out, work, *extra):
    return [
        "target", "--config", str(config_dir / "target.json"), "--data-root", str(corpus),
        "--tokenizer", str(zoo["dir"] / "tokenizer"), "--out", str(out), "--work-dir", str(work),
        "--device", "cpu", "--no-progress", "--steps", "6", *extra,
    ]  # fmt: skip


def test_interrupted_then_resumed_target_equals_an_uninterrupted_run(tmp_path, corpus, config_dir, zoo, capsys):
    assert train_main(_target_argv(corpus, config_dir, zoo, tmp_path / "a", tmp_path / "wa")) == 0
    assert train_main(_target_argv(corpus, config_dir, zoo, tmp_path / "b", tmp_path / "wb", "--stop-after", "4")) == 3
    assert json.loads((tmp_path / "b" / "training_target.json").read_text())["status"] == "partial"
    assert train_main(_target_argv(corpus, config_dir, zoo, tmp_path / "b", tmp_path / "wb", "--resume")) == 0
    a = load_file(str(tmp_path / "a" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    capsys.readouterr()
    # a checkpoint made with another config is refused, in one line
    rc = train_main(_target_argv(corpus, config_dir, zoo, tmp_path / "b", tmp_path / "wb", "--resume", "--seed", "9"))
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vllm-tfm train: error: ") and "was made with a different target config" in err
    assert "\n" not in err


def test_cli_input_errors_are_one_line(tmp_path, capsys):
    rc = train_main(["tokenizer", "--data-root", str(tmp_path / "missing"), "--out", str(tmp_path / "t")])
    assert rc == 2 and "not a directory" in capsys.readouterr().err
    rc = train_main(["all", "--data-root", str(tmp_path), "--out", str(tmp_path / "z"), "--stages", "target,tokenizer"])
    assert rc == 2 and "--stages must list distinct stages in pipeline order" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**TINY["dflash"], "stage": "weaver"}))
    rc = train_main(["dflash", "--config", str(bad), "--data-root", str(tmp_path), "--target", str(tmp_path), "--out", str(tmp_path / "d")])
    assert rc == 2 and f"{bad}: stage:" in capsys.readouterr().err


# --------------------------------------------------------------------------- exact pieces


def test_zlab_tap_rule_matches_published_drafters():
    assert zlab_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # z-lab Qwen3-8B-DFlash-b16 config
    assert zlab_target_layer_ids(8, 3) == [1, 3, 5]  # our toy target and drafter
    assert zlab_target_layer_ids(8, 1) == [4]


def _random_drafter(causal: bool | None, seed: int = 0) -> DFlashDrafter:
    cfg = DFlashConfig.create(
        hidden_size=16, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=24, vocab_size=40, target_layer_ids=[0, 2], mask_token_id=39, block_size=4,
        num_target_layers=4, causal=causal, rope_theta=10000.0,
    )  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    d = DFlashDrafter(cfg).double()
    with torch.no_grad():
        for name, p in d.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.3 + (1.0 if name.endswith("norm.weight") else 0.0))
    return d


@pytest.mark.parametrize("causal", [None, True])
def test_batched_training_forward_equals_the_drafter_block_by_block(causal):
    d = _random_drafter(causal)
    g = torch.Generator().manual_seed(1)
    b, length, n = 2, 12, 3
    taps = torch.randn(b, length, 32, generator=g, dtype=F64)
    ids = torch.randint(0, 39, (b, length), generator=g)
    embed = torch.randn(40, 16, generator=g, dtype=F64)
    anchors = sample_anchors(b, length, n, 4, seed=0, step=0, stream_id=0)
    blocks = block_inputs(ids, anchors, 4, 39)
    assert torch.equal(blocks[..., 0], ids.gather(1, anchors)) and (blocks[..., 1:] == 39).all()
    got = dflash_block_prenorm(d, taps, anchors, blocks, embed)
    for i in range(b):
        for j in range(n):
            a = int(anchors[i, j])
            ref = d.forward_prenorm(taps[i, :a], torch.arange(a), blocks[i, j], torch.arange(a, a + 4), embed)
            torch.testing.assert_close(got[i, j], ref, rtol=0, atol=1e-12)


def test_weaver_pool_logprobs_equal_score_paths_and_zero_init_gives_dflash_scores():
    g = torch.Generator().manual_seed(2)
    r, depth, k, h, v = 3, 4, 5, 16, 40
    w = Weaver(WeaverConfig(d_model=h, d_rank=8, n_layers=2, n_heads=2, d_mlp=12, max_depth=depth)).double()
    with torch.no_grad():
        for p in w.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.3)
    embed = torch.randn(v, h, generator=g, dtype=F64)
    head = torch.randn(v, h, generator=g, dtype=F64) * 0.5
    cand = torch.stack([torch.randperm(v, generator=g)[:k] for _ in range(r * depth)]).view(r, depth, k)
    batch = WeaverBatch(
        verifier_hidden=torch.randn(r, h, generator=g, dtype=F64),
        dflash_hidden=torch.randn(r, depth, h, generator=g, dtype=F64),
        cand_ids=cand,
        cand_logits=torch.randn(r, depth, k, generator=g, dtype=F64),
        path_tokens=torch.randint(0, v, (r, depth), generator=g),
        target_logp=torch.zeros(r, depth, k, dtype=F64),
        valid=torch.ones(r, depth, dtype=torch.bool),
    )
    got = weaver_pool_logprobs(w, batch, embed, head)
    ref = w.score_paths(batch.verifier_hidden, batch.dflash_hidden, batch.path_tokens, embed, head, cand, batch.cand_logits)
    assert got.dtype == F64
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-12)
    with torch.no_grad():
        w.lm_head_query_in.weight.zero_()
    torch.testing.assert_close(weaver_pool_logprobs(w, batch, embed, head), torch.log_softmax(batch.cand_logits, -1))


def test_weaver_batch_pools_targets_and_trainable_nodes_by_brute_force():
    d = _random_drafter(None, seed=4)
    g = torch.Generator().manual_seed(5)
    b, length, n, v, k = 2, 14, 3, 40, 6
    ids = torch.randint(0, 39, (b, length), generator=g)
    taps = torch.randn(b, length, 32, generator=g, dtype=F64)
    final = torch.randn(b, length, 16, generator=g, dtype=F64)
    tlogits = torch.randn(b, length, v, generator=g, dtype=F64) * 2
    embed = torch.randn(v, 16, generator=g, dtype=F64)
    head = torch.randn(v, 16, generator=g, dtype=F64)
    anchors = sample_anchors(b, length, n, 4, seed=1, step=0, stream_id=0)
    wb = weaver_batch(d, ids, taps, final, tlogits, anchors, k, embed, head, True, F64)
    depth = 3
    for i in range(b):
        for j in range(n):
            rr = i * n + j
            a = int(anchors[i, j])
            blk = block_inputs(ids[i : i + 1], anchors[i : i + 1, j : j + 1], 4, 39)[0, 0]
            hid = d.forward(taps[i, :a], torch.arange(a), blk, torch.arange(a, a + 4), embed)[1:]
            dl = hid @ head.T
            assert torch.equal(wb.verifier_hidden[rr], final[i, a - 1])
            assert wb.path_tokens[rr].tolist() == ids[i, a : a + depth].tolist()
            ok = True
            for dd in range(depth):
                top = torch.topk(dl[dd].float(), k).indices
                assert set(wb.cand_ids[rr, dd].tolist()) == set(top.tolist())
                logp = torch.log_softmax(tlogits[i, a + dd].float(), -1)
                torch.testing.assert_close(wb.target_logp[rr, dd], logp[wb.cand_ids[rr, dd]])
                if dd >= 1:  # node at depth dd is in a tree iff its token and its ancestors' are in their pools
                    ok = ok and int(ids[i, a + dd]) in set(wb.cand_ids[rr, dd - 1].tolist())
                assert bool(wb.valid[rr, dd]) == ok


def test_pool_forward_kl_by_brute_force():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 10, generator=g, dtype=F64)
    logp = torch.log_softmax(logits, -1)
    cand = torch.tensor([[0, 3, 4, 9], [1, 2, 5, 7]])
    q = torch.softmax(torch.randn(2, 4, generator=g, dtype=F64), -1)
    loss, m = pool_forward_kl(logp.gather(-1, cand), q.log())
    for r in range(2):
        p = [math.exp(logp[r, c]) for c in cand[r].tolist()]
        mass = sum(p)
        kl = sum((pc / mass) * math.log((pc / mass) / float(q[r, i])) for i, pc in enumerate(p))
        assert m[r].item() == pytest.approx(mass, rel=1e-12)
        assert loss[r].item() == pytest.approx(mass * kl, rel=1e-10)
    p_hat = torch.softmax(logits.gather(-1, cand), -1)
    zero, _ = pool_forward_kl(logp.gather(-1, cand), p_hat.log())
    assert zero.abs().max() < 1e-14


def test_forward_kl_and_depth_weights():
    g = torch.Generator().manual_seed(4)
    t, s = torch.randn(3, 7, generator=g, dtype=F64), torch.randn(3, 7, generator=g, dtype=F64)
    p, q = torch.softmax(t, -1), torch.softmax(s, -1)
    torch.testing.assert_close(forward_kl(t, s), (p * (p / q).log()).sum(-1), rtol=1e-12, atol=0)
    assert forward_kl(t, t).abs().max() < 1e-14
    torch.testing.assert_close(depth_weights(4, 7.0), torch.exp(-torch.arange(4.0) / 7.0))
    assert torch.equal(depth_weights(3, None), torch.ones(3))


def test_lr_schedule_and_time_budget_plan():
    s = Schedule(steps=100, lr=1.0, warmup_steps=10, min_lr_ratio=0.1)
    assert lr_at(0, 100, s) == pytest.approx(0.1) and lr_at(9, 100, s) == pytest.approx(1.0)
    assert lr_at(10, 100, s) == pytest.approx(1.0) and lr_at(100, 100, s) == pytest.approx(0.1)
    assert lr_at(55, 100, s) == pytest.approx(0.55)
    # 100 s left, 10 s reserve, 0.1 s/step + an eval of 2 s every 20 steps (0.1 s/step) -> 450 more steps
    assert plan_steps(step=12, max_steps=10_000, seconds_left=100, step_s=0.1, eval_s=2.0, eval_every=20, reserve_s=10) == 462
    assert plan_steps(step=12, max_steps=300, seconds_left=100, step_s=0.1, eval_s=2.0, eval_every=20, reserve_s=10) == 300
    assert plan_steps(step=12, max_steps=300, seconds_left=5, step_s=0.1, eval_s=0.0, eval_every=0, reserve_s=10) == 13


def test_shipped_configs_parse_and_fit_the_size_budget():
    from vllm_tfm.train.cli import _config_class
    from vllm_tfm.train.stage import load_stage_config
    from vllm_tfm.train.target import build_target_config

    cfgs = {s: load_stage_config(None, _config_class(s), s) for s in STAGES}
    tgt = build_target_config(cfgs["target"].model, cfgs["tokenizer"].vocab_size, 0, 1)
    assert tgt.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"]
    assert tgt.linear_num_value_heads > tgt.linear_num_key_heads  # GVA
    assert cfgs["dflash"].model.block_size == 16
    with torch.device("meta"):
        from transformers import Qwen3_5ForCausalLM

        from vllm_tfm.models import TreeFlashApproximator, TreeFlashConfig
        from vllm_tfm.train.dflash import make_dflash_config

        target = Qwen3_5ForCausalLM(tgt)
        dcfg = make_dflash_config(cfgs["dflash"].model, tgt, 2)
        wcfg = WeaverConfig(d_model=tgt.hidden_size, max_depth=dcfg.max_depth, **cfgs["weaver"].model.model_dump())
        tf = TreeFlashApproximator(TreeFlashConfig(hidden_size=tgt.hidden_size, **cfgs["treeflash"].model.model_dump()))
        models = [target, DFlashDrafter(dcfg), Weaver(wcfg), tf]
    params = sum(sum(p.numel() for p in {id(p): p for p in m.parameters()}.values()) for m in models)
    assert list(dcfg.target_layer_ids) == [1, 3, 5]
    assert 2 * params < 22_000_000  # bf16 weights; the tokenizer files and cards add < 1.5 MB
    assert TfmConfig(weaver=wcfg, top_k=cfgs["weaver"].top_k).top_k == 512


def test_vllm_tfm_train_dispatches_to_the_trainer_cli(capsys) -> None:
    from vllm_tfm.cli import main

    with pytest.raises(SystemExit) as e:
        main(["train", "--help"])
    assert e.value.code == 0
    assert "Train the vllm-tfm toy model zoo" in capsys.readouterr().out


def test_keep_going_trains_later_stages_on_a_partial_one(tmp_path, corpus, config_dir, zoo, capsys):
    """`all` stops at the first stage that ends early (exit 3) unless --keep-going, which trains the
    next stages on the partial model, marks every such card "partial" and still exits 3."""
    import shutil

    out = tmp_path / "zoo"
    out.mkdir()
    for d in ("tokenizer", "target"):
        shutil.copytree(zoo["dir"] / d, out / d)
    argv = [
        "all", "--stages", "dflash,weaver,treeflash", "--data-root", str(corpus), "--out", str(out),
        "--config-dir", str(config_dir), "--work-dir", str(tmp_path / "work"), "--device", "cpu",
        "--no-progress", "--stop-after", "1",
    ]  # fmt: skip
    assert train_main(argv) == 3
    assert not (out / "drafter" / "training_weaver.json").exists()
    capsys.readouterr()
    shutil.rmtree(out / "drafter")
    assert train_main(argv + ["--keep-going", "--work-dir", str(tmp_path / "work2")]) == 3
    text = capsys.readouterr().out
    assert text.count("--keep-going: next stage") == 3
    for stage in ("dflash", "weaver", "treeflash"):
        assert json.loads((out / "drafter" / f"training_{stage}.json").read_text())["status"] == "partial"
