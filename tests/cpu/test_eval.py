"""``vllm-tfm eval`` (vllm_tfm.reference.evaluate) on random tiny models.

* Every (method, budget, temperature) cell is reported; MAL and acceptance by depth equal their
  definitions recomputed from the per-step accepted counts; acceptance is non-increasing in depth.
* Drafter quality: TVD in [0, 1], top-k coverage in [0, 1] and monotone in k; TVD and coverage
  equal hand-computed values on a hand-built case; with a proposal that puts the target's greedy
  token on top, depth-1 coverage@1 equals the target's own max probability (computed with HF).
* With the "cheating" proposal (the target's greedy continuation on top), greedy MAL = gamma.
* The CLI prints the table, says the models are random, writes the JSON, exits 0.
"""

from __future__ import annotations

import json

import pytest
import torch

from vllm_tfm.cli import main
from vllm_tfm.reference.drafters import METHODS, DraftInputs
from vllm_tfm.reference.evaluate import (
    EvalConfig,
    drafter_quality,
    evaluate,
    markdown_tables,
    random_prompts,
    topk_coverage,
    total_variation,
)
from vllm_tfm.reference.toy_drafters import random_drafters
from vllm_tfm.reference.toy_targets import tiny_qwen3_5
from vllm_tfm.tree.weaver import default_weaver_width

GAMMA, PROMPT_LEN, NEW = 4, 6, 8
BUDGETS, TEMPS = (4, 8), (0.0, 1.0)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    target = tiny_qwen3_5(seed=31)
    return target, random_drafters(target, seed=32, block_size=8)


@pytest.fixture(scope="module")
def prompts(models):
    target, _ = models
    return random_prompts(target.config.vocab_size, 2, PROMPT_LEN, PROMPT_LEN + NEW + GAMMA - 1, seed=5)


@pytest.fixture(scope="module")
def results(models, prompts):
    target, bundle = models
    cfg = EvalConfig(methods=METHODS, budgets=BUDGETS, temperatures=TEMPS, max_new_tokens=NEW, seed=3, gamma=GAMMA)
    return evaluate(target, bundle, prompts, cfg)


def greedy_continuation(target, tokens: list[int], n: int) -> list[int]:
    out = target.generate(torch.tensor([tokens]), do_sample=False, max_new_tokens=n, pad_token_id=0)
    return out[0, len(tokens):].tolist()


def continuation_bias(target, boost: float = 100.0):
    """The decoder tests' cheating proposal: the target's greedy continuation on top of every depth."""

    def bias(inputs: DraftInputs, max_depth: int) -> torch.Tensor:
        cont = greedy_continuation(target, inputs.tokens.tolist(), max_depth)
        b = torch.zeros(max_depth, target.config.vocab_size)
        b[torch.arange(max_depth), torch.tensor(cont)] = boost
        return b

    return bias


def test_every_cell_with_mal_and_depths_matching_the_step_counts(results):
    cells = {(c["method"], c["budget"], c["temperature"]): c for c in results["acceptance"]}
    assert set(cells) == {(m, b, t) for m in METHODS for b in BUDGETS for t in TEMPS}
    assert len(results["acceptance"]) == len(METHODS) * len(BUDGETS) * len(TEMPS)
    for c in cells.values():
        flat = [a for per in c["accepted_per_step"] for a in per]
        assert len(c["accepted_per_step"]) == 2 and c["steps"] == len(flat) > 0
        assert all(0 <= a <= GAMMA - 1 for a in flat)
        assert c["mal"] >= 1.0
        assert c["mal"] == pytest.approx(1.0 + sum(flat) / len(flat), abs=1e-12)
        want = [sum(1 for a in flat if a >= d) / len(flat) for d in range(1, GAMMA)]
        assert c["acceptance_by_depth"] == pytest.approx(want, abs=1e-12)
        assert all(x >= y for x, y in zip(c["acceptance_by_depth"], c["acceptance_by_depth"][1:]))
        assert all(1 <= n <= c["budget"] + 1 for per in c["tree_nodes_per_step"] for n in per)


def test_compact_results_keep_the_numbers_and_feed_acceptance_profiles(results):
    """The CLI's default JSON: per-cell histograms instead of per-step lists. MAL and acceptance by
    depth recomputed from the histogram equal the cell's, and a profile read from the compact file
    has the same accepted-length distribution as one read from the full per-step file."""
    from vllm_tfm.reference.evaluate import compact_cells
    from vllm_tfm.verify.acceptance_profile import profile_from_eval

    compact = compact_cells(results)
    assert "accepted_per_step" in results["acceptance"][0]  # the input is not modified
    for full, c in zip(results["acceptance"], compact["acceptance"]):
        assert "accepted_per_step" not in c and "tree_nodes_per_step" not in c
        hist = c["accepted_histogram"]
        n = sum(hist)
        assert n == c["steps"] and c["steps_per_prompt"] == [len(p) for p in full["accepted_per_step"]]
        assert sum((a + 1) * k for a, k in enumerate(hist)) / n == pytest.approx(c["mal"], abs=1e-12)
        by_depth = [sum(hist[d:]) / n for d in range(1, len(hist))]
        assert by_depth == pytest.approx(c["acceptance_by_depth"], abs=1e-12)
        flat = [x for p in full["tree_nodes_per_step"] for x in p]
        assert c["tree_nodes_mean"] == pytest.approx(sum(flat) / len(flat))
    a = profile_from_eval(results, "full")
    b = profile_from_eval(compact, "compact")
    assert [(e.method, e.budget, e.temperature, e.steps) for e in a.entries] == [
        (e.method, e.budget, e.temperature, e.steps) for e in b.entries
    ]
    for ea, eb in zip(a.entries, b.entries):
        assert ea.accepted_pmf == pytest.approx(eb.accepted_pmf, abs=1e-12)
    bad = compact_cells(results)
    bad["acceptance"][0]["accepted_histogram"] = [0] * len(bad["acceptance"][0]["accepted_histogram"])
    with pytest.raises(ValueError, match="accepted_histogram must hold"):
        profile_from_eval(bad, "bad")


def test_drafter_quality_is_in_range_and_coverage_monotone(results):
    q = results["drafter_quality"]
    assert q["depths"] == GAMMA - 1 and q["anchors"] == 2 * NEW
    for name in ("dflash", "treeflash", "weaver"):
        tvd = q[name]["tvd"]
        assert len(tvd) == GAMMA - 1 and all(0.0 <= v <= 1.0 for v in tvd)
        cov = [q[name]["coverage"][str(k)] for k in (1, 8, 64)]
        for d in range(GAMMA - 1):
            col = [c[d] for c in cov]
            assert all(0.0 <= v <= 1.0 + 1e-12 for v in col)
            assert col[0] <= col[1] <= col[2]
    table = markdown_tables(results)
    assert "| tfm | 8 |" in table and "| weaver | TVD |" in table


def test_tvd_and_coverage_on_a_hand_built_case():
    p = torch.tensor([[0.5, 0.3, 0.2, 0.0], [0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    q = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]], dtype=torch.float64)
    # 0.5 * (0.4 + 0.1 + 0.1 + 0.4) and 0.5 * (0.25 + 0.25 + 0.75 + 0.25)
    assert total_variation(p, q).tolist() == pytest.approx([0.5, 0.75])
    assert total_variation(q, q).tolist() == [0.0, 0.0]
    cov = topk_coverage(p, q, [1, 2, 3, 64])
    assert cov[1].tolist() == pytest.approx([0.1, 0.25])
    assert cov[2].tolist() == pytest.approx([0.3, 0.25])  # row 2: zero-probability tokens never count
    assert cov[3].tolist() == pytest.approx([0.6, 0.25])
    assert cov[64].tolist() == pytest.approx([0.6, 0.25])  # k above V: the whole support


def test_depth1_coverage_of_a_greedy_proposal_is_the_target_max_probability(models, prompts):
    """With the target's greedy token boosted, the depth-1 proposal is ~one-hot on it: TVD =
    1 - max p and top-1 coverage = max p of the target at the anchor (computed here with HF)."""
    target, bundle = models
    q = drafter_quality(target, bundle, prompts, NEW, GAMMA, (1, 8), continuation_bias(target))
    maxp = []
    with torch.no_grad():
        for w in prompts.windows:
            logits = target(input_ids=torch.tensor([w])).logits[0].double()
            maxp += torch.softmax(logits, -1).max(-1).values[PROMPT_LEN : PROMPT_LEN + NEW].tolist()
    want = sum(maxp) / len(maxp)
    for name in ("dflash", "treeflash"):  # both see the boost on the true prefix's greedy token
        assert q[name]["coverage"]["1"][0] == pytest.approx(want, abs=1e-6)
        assert q[name]["tvd"][0] == pytest.approx(1.0 - want, abs=1e-6)


def test_cheating_proposal_reaches_gamma(models, prompts):
    target, bundle = models
    cfg = EvalConfig(methods=METHODS, budgets=(GAMMA - 1, 8), temperatures=(0.0,), max_new_tokens=NEW, gamma=GAMMA)
    res = evaluate(target, bundle, prompts, cfg, proposal_bias=continuation_bias(target))
    for c in res["acceptance"]:
        assert c["mal"] == pytest.approx(GAMMA), (c["method"], c["budget"])
        assert c["acceptance_by_depth"] == [1.0] * (GAMMA - 1)


def test_cli_eval_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / "acc.json"
    rc = main([
        "eval", "--random-models", "--methods", "chain,tfm", "--budgets", "4", "--temperatures", "0,1",
        "--prompts", "2", "--max-new-tokens", "4", "--prompt-len", "5", "--block-size", "3", "--device", "cpu",
        "--out", str(out), "--plots-dir", str(tmp_path / "plots"),
    ])
    text = capsys.readouterr().out
    assert rc == 0
    assert "RANDOM" in text and "| method | B | MAL T=0 | MAL T=1 |" in text and "| tfm | 4 |" in text
    data = json.loads(out.read_text())
    assert data["models"] == "random" and data["model_dirs"] == "random"
    assert {(c["method"], c["budget"], c["temperature"]) for c in data["acceptance"]} == {
        (m, 4, t) for m in ("chain", "tfm") for t in (0.0, 1.0)
    }
    assert data["command"].startswith("vllm-tfm eval --random-models --methods chain,tfm --budgets 4")
    assert data["machine"]["torch"] == torch.__version__ and data["config"]["gamma"] == 3


def test_cli_eval_rejects_an_unknown_method(capsys):
    rc = main(["eval", "--random-models", "--methods", "chain,beam"])
    assert rc == 2
    assert "unknown method 'beam'" in capsys.readouterr().err


def test_held_out_prompts_come_from_held_out_files_only(tmp_path):
    from vllm_tfm.reference.evaluate import held_out_prompts, recorded_data_roots
    from vllm_tfm.train.data import is_eval_path
    from vllm_tfm.train.tokenizer import TokenizerTrainConfig, data_tokenizer, save_tokenizer, train_tokenizer

    root = tmp_path / "src"
    root.mkdir()
    texts = {}
    for i in range(24):
        body = "".join(f"def f{i}_{j}(x):\n    return x * {j} + {i}\n\n" for j in range(6 + i % 3))
        (root / f"m{i}.py").write_text(body)
        texts[f"m{i}.py"] = body
    modulus = 4
    held = sorted(p for p in texts if is_eval_path(p, modulus))
    assert len(held) >= 2  # the fixture has held-out files to draw from
    tok = train_tokenizer(list(texts.values()), TokenizerTrainConfig(stage="tokenizer", vocab_size=300))
    save_tokenizer(tok, tmp_path / "tok", 512)
    enc = data_tokenizer(tok)

    ps = held_out_prompts([str(root)], tmp_path / "tok", 2, 5, 12, seed=7, eval_modulus=modulus)
    assert ps.prompt_len == 5 and len(ps.windows) == 2
    rels = [f["relpath"] for f in ps.info["files"]]
    assert len(set(rels)) == 2 and all(r in held for r in rels)
    for w, f in zip(ps.windows, ps.info["files"]):
        ids = enc.encode(texts[f["relpath"]]).ids
        assert w == ids[f["token_offset"] : f["token_offset"] + 12]
    again = held_out_prompts([str(root)], tmp_path / "tok", 2, 5, 12, seed=7, eval_modulus=modulus)
    assert again.windows == ps.windows
    with pytest.raises(ValueError, match=r"only \d+ held-out files have >= 12 tokens \(wanted 99 prompts\)"):
        held_out_prompts([str(root)], tmp_path / "tok", 99, 5, 12, seed=7, eval_modulus=modulus)

    zoo = tmp_path / "zoo"
    (zoo / "target").mkdir(parents=True)
    card = {"data": {"roots": [str(root), str(tmp_path / "gone")], "config": {"eval_modulus": modulus}}}
    (zoo / "target" / "training_target.json").write_text(json.dumps(card))
    assert recorded_data_roots(zoo) == ([str(root)], modulus)
    assert recorded_data_roots(tmp_path / "nothing") == ([], None)


def test_cli_eval_on_a_zoo_directory_uses_held_out_files(tmp_path, capsys):
    """The zoo path end to end: target/ + drafter/ + tokenizer/ on disk, prompts from --data-root."""
    from vllm_tfm.train.data import is_eval_path
    from vllm_tfm.train.tokenizer import TokenizerTrainConfig, save_tokenizer, train_tokenizer

    root = tmp_path / "src"
    root.mkdir()
    texts = [
        "".join(f"def g{i}_{j}(a, b):\n    return a + b * {j}\n\n" for j in range(8)) for i in range(60)
    ]
    for i, t in enumerate(texts):
        (root / f"pkg{i}.py").write_text(t)
    assert sum(is_eval_path(f"pkg{i}.py", 20) for i in range(60)) >= 2
    tok = train_tokenizer(texts, TokenizerTrainConfig(stage="tokenizer", vocab_size=300))
    zoo = tmp_path / "zoo"
    save_tokenizer(tok, zoo / "tokenizer", 512)
    target = tiny_qwen3_5(seed=41, vocab_size=300)
    target.save_pretrained(zoo / "target")
    random_drafters(target, seed=42, block_size=4).save_pretrained(zoo / "drafter")
    out = tmp_path / "acc.json"
    rc = main([
        "eval", "--zoo", str(zoo), "--methods", "ddtree,treeflash", "--budgets", "4", "--temperatures", "0",
        "--prompts", "2", "--max-new-tokens", "4", "--prompt-len", "6", "--device", "cpu",
        "--data-root", str(root), "--out", str(out), "--plots-dir", str(tmp_path / "plots"),
    ])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "RANDOM" not in text and "| treeflash | 4 |" in text
    data = json.loads(out.read_text())
    assert data["models"] == "zoo" and data["model_dirs"]["target"] == str((zoo / "target").resolve())
    assert data["prompts"]["kind"] == "held-out code files"
    assert all(is_eval_path(f["relpath"], 20) for f in data["prompts"]["files"])
    assert data["config"]["gamma"] == 4 and len(data["acceptance"]) == 2



@pytest.mark.parametrize("mode", ["replay", "decode"])
def test_width_reaches_every_tfm_tree_and_the_record(models, prompts, monkeypatch, mode):
    """``EvalConfig.width`` (``vllm-tfm eval --width``) is the width every TfM tree is grown with,
    whatever the budget, and the results record it; without it the default ``default_weaver_width(B)`` holds."""
    from vllm_tfm.reference import drafters, replay

    target, bundle = models
    seen: list[tuple[int, int]] = []
    per_request, lockstep = drafters.build_weaver, replay.weaver_padded_trees

    def spy_per_request(root, cand, scorer, budget, depth, width, cpn):  # the decoder's trees
        seen.append((budget, width))
        return per_request(root, cand, scorer, budget, depth, width, cpn)

    def spy_lockstep(*args, **kwargs):  # the replay's trees: (..., budget, top_k, width, cpn, ...)
        seen.append((args[7], args[9]))
        return lockstep(*args, **kwargs)

    monkeypatch.setattr(drafters, "build_weaver", spy_per_request)
    monkeypatch.setattr(replay, "weaver_padded_trees", spy_lockstep)
    for width, want in ((3, lambda b: 3), (None, default_weaver_width)):
        seen.clear()
        cfg = EvalConfig(methods=("tfm",), budgets=(4, 40), temperatures=(0.0,), max_new_tokens=4, gamma=GAMMA,
                         mode=mode, width=width)
        res = evaluate(target, bundle, prompts, cfg)
        assert res["config"]["width"] == width
        assert {b for b, _ in seen} == {4, 40}
        assert all(w == want(b) for b, w in seen), seen
    with pytest.raises(ValueError, match="width must be >= 1, got 0"):
        EvalConfig(width=0).validate()


def test_cli_eval_width_is_recorded_in_the_config_and_the_command(tmp_path):
    out = tmp_path / "acc.json"
    rc = main([
        "eval", "--random-models", "--methods", "tfm", "--budgets", "4", "--temperatures", "0", "--prompts", "1",
        "--max-new-tokens", "3", "--prompt-len", "5", "--block-size", "3", "--device", "cpu", "--width", "2",
        "--out", str(out), "--plots-dir", str(tmp_path / "plots"),
    ])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["config"]["width"] == 2 and " --width 2" in data["command"]


def _eval_with_flag(tmp_path, monkeypatch, flag: str) -> tuple[dict, dict]:
    """``vllm-tfm eval --random-models ... <flag>``: (results JSON, the models it built, their lm_head before)."""
    from vllm_tfm.reference import zoo

    seen: dict[str, object] = {}
    made = zoo.random_demo_models

    def models(seed):
        m = made(seed)
        seen["dflash"], seen["target"], seen["weaver"] = m.bundle.dflash, m.target, m.bundle.weaver
        seen["lm_head"] = m.target.get_output_embeddings().weight.detach().clone()
        return m

    monkeypatch.setattr(zoo, "random_demo_models", models)
    out = tmp_path / "acc.json"
    rc = main([
        "eval", "--random-models", "--methods", "tfm", "--budgets", "4", "--temperatures", "0", "--prompts", "1",
        "--max-new-tokens", "3", "--prompt-len", "5", "--block-size", "3", "--device", "cpu", *flag.split(),
        "--out", str(out), "--plots-dir", str(tmp_path / "plots"),
    ])
    assert rc == 0
    data = json.loads(out.read_text())
    assert data["command"].endswith(f" {flag}")
    return data, seen


def test_cli_eval_drafter_fp8_rounds_the_drafter_and_says_so(tmp_path, monkeypatch):
    """--drafter-fp8: every linear layer of the DFlash drafter (and nothing of the target or the Weaver) goes
    through fp8_sim before the evaluation; the note and the command record it."""
    import vllm_tfm.reference.fp8_sim as fp8_sim

    calls: list[object] = []
    real = fp8_sim.simulate_fp8_linears

    def spy(module):
        calls.append(module)
        return real(module)

    monkeypatch.setattr(fp8_sim, "simulate_fp8_linears", spy)
    data, seen = _eval_with_flag(tmp_path, monkeypatch, "--drafter-fp8")
    assert any(n.startswith("--drafter-fp8: the DFlash drafter's ") for n in data["notes"])
    assert calls == [seen["dflash"]]
    assert any(isinstance(m, fp8_sim.Fp8SimLinear) for m in seen["dflash"].modules())
    assert not any(isinstance(m, torch.nn.Linear) for m in seen["dflash"].modules())
    assert not any(isinstance(m, fp8_sim.Fp8SimLinear) for m in seen["target"].modules())
    assert seen["dflash"].logits_head is None


def test_cli_eval_drafter_fp8_head_gives_the_drafter_its_own_head(tmp_path, monkeypatch):
    """--drafter-fp8-head: the drafter's marginals go through an FP8 copy of the target's lm_head; the target's
    own lm_head (which the Weaver reads) is untouched."""
    import vllm_tfm.reference.fp8_sim as fp8_sim

    data, seen = _eval_with_flag(tmp_path, monkeypatch, "--drafter-fp8-head")
    assert any(n.startswith("--drafter-fp8-head: the DFlash marginals ") for n in data["notes"])
    head = seen["dflash"].logits_head
    assert isinstance(head, fp8_sim.Fp8SimHead)
    assert torch.equal(seen["target"].get_output_embeddings().weight, seen["lm_head"])
    assert not torch.equal(head.weight, seen["lm_head"])


def test_cli_eval_weaver_weights_fp8_rounds_the_weaver_as_the_runtime(tmp_path, monkeypatch):
    """--weaver-weights fp8: the Weaver's norms folded into its projections (norm weights 1, biases 0; the projections
    biased), every projection's weight on e4m3 rows (each row an e4m3 grid of its own scale); the DFlash drafter
    untouched; the note and the command record it; with --weaver-fp8 it is refused."""
    data, seen = _eval_with_flag(tmp_path, monkeypatch, "--weaver-weights fp8")
    assert any(n.startswith("--weaver-weights fp8: the Weaver's 11 projections") for n in data["notes"])
    weaver = seen["weaver"]
    assert all(float(n.weight.detach().sub(1).abs().max()) == 0 for n in (weaver.embed_norm, weaver.layers[0].mlp_norm))
    for linear in (weaver.token_in, weaver.layers[0].qkv, weaver.layers[0].down):
        w = linear.weight.detach().float()
        scale = w.abs().amax(dim=1, keepdim=True) / 448
        assert torch.equal((w / scale).to(torch.float8_e4m3fn).float() * scale, w)
    assert weaver.token_in.bias is not None and weaver.layers[0].down.bias is None
    with pytest.raises(SystemExit, match="two roundings of the Weaver"):
        _eval_with_flag(tmp_path, monkeypatch, "--weaver-weights fp8 --weaver-fp8")


def test_cli_eval_weaver_fp8_rounds_the_weaver_only(tmp_path, monkeypatch):
    """--weaver-fp8: every linear layer of the Weaver goes through fp8_sim, the DFlash drafter and the target keep
    theirs; the note and the command record it."""
    import vllm_tfm.reference.fp8_sim as fp8_sim

    data, seen = _eval_with_flag(tmp_path, monkeypatch, "--weaver-fp8")
    assert any(n.startswith("--weaver-fp8: the Weaver's ") for n in data["notes"])
    assert any(isinstance(m, fp8_sim.Fp8SimLinear) for m in seen["weaver"].modules())
    assert not any(isinstance(m, torch.nn.Linear) for m in seen["weaver"].modules())
    assert not any(isinstance(m, fp8_sim.Fp8SimLinear) for m in seen["dflash"].modules())
    assert not any(isinstance(m, fp8_sim.Fp8SimLinear) for m in seen["target"].modules())
