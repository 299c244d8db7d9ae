"""``vllm-tfm demo`` through ``vllm_tfm.cli.main`` on the CPU (random tiny models and a zoo made here)."""

from __future__ import annotations

import re

import pytest
import torch

from vllm_tfm.cli import main
from vllm_tfm.reference.drafters import METHODS
from vllm_tfm.reference.toy_drafters import random_drafters
from vllm_tfm.reference.toy_targets import tiny_qwen3_5

SMALL = ["--max-new-tokens", "6", "--budget", "4", "--block-size", "4"]


@pytest.fixture(autouse=True)
def _restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def table_rows(out: str) -> dict[str, list[str]]:
    rows = {}
    lines = out.splitlines()
    start = lines.index("all methods (same prompt, same target):") + 2
    for line in lines[start:]:
        parts = line.split()
        if parts:
            rows[parts[0]] = parts[1:]
    return rows


def test_demo_with_random_models(capsys):
    assert main(["demo", "--random-models", *SMALL]) == 0
    out = capsys.readouterr().out
    assert "RANDOM" in out and "untrained" in out
    assert "no tokenizer: prompt and outputs are shown as token ids" in out
    assert re.search(r"\[tfm\] output: \[(\d+, ){5}\d+\]", out)  # the default method first, 6 token ids
    assert re.search(r"\[tfm\] .*mean accepted length \(MAL\) \d+\.\d\d", out)
    assert "[tfm] acceptance by depth d = 1..3" in out
    rows = table_rows(out)
    assert set(METHODS) | {"target"} == set(rows)
    for m in METHODS:
        tps, mal, steps, same = rows[m][:4]
        assert float(tps) > 0 and 1.0 <= float(mal) <= 4.0 and int(steps) >= 1
        assert same == "yes"  # greedy: every method reproduces the target's own output


def test_demo_loads_a_zoo_and_another_default_method(tmp_path, capsys, monkeypatch):
    target = tiny_qwen3_5(seed=5)
    zoo = tmp_path / "zoo"
    target.save_pretrained(zoo / "target")
    random_drafters(target, seed=6, block_size=4).save_pretrained(zoo / "drafter")
    monkeypatch.setenv("VLLM_TFM_ZOO", str(zoo))
    assert main(["demo", "--method", "ddtree", "--prompt-ids", "1,2", *SMALL]) == 0
    out = capsys.readouterr().out
    assert f"toy zoo {zoo}" in out and "RANDOM" not in out
    assert "prompt: [1, 2]" in out
    assert "[ddtree] output:" in out and "[tfm] output:" not in out
    assert all(table_rows(out)[m][3] == "yes" for m in METHODS)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["demo", "--zoo", "/nonexistent/zoo"], "/nonexistent/zoo is not a toy zoo"),
        (["demo", "--random-models", "--prompt", "hello"], "no tokenizer, so --prompt text cannot be encoded"),
        (["demo", "--random-models", "--method", "beam"], "unknown method 'beam'"),
        (["demo", "--random-models", "--prompt-ids", "1,500"], r"prompt token ids must lie in \[0, 96\), got 500"),
        (["demo", "--random-models", "--block-size", "9"], r"block size gamma must be in 2\.\.8"),
    ],
)
def test_demo_errors_are_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vllm-tfm: error: ") and re.search(message, err[0])


def test_unknown_command_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["bench"])
    err = capsys.readouterr().err
    assert "invalid choice: 'bench'" in err
    assert all(name in err for name in ("demo", "train", "eval"))


def test_demo_uses_the_committed_zoo_by_default(capsys):
    """The trained toy zoo under zoo/ (committed): found without flags, every method reproduces the
    target's greedy output, and speculation accepts more than one token per target forward."""
    import time
    from pathlib import Path

    zoo = Path(__file__).resolve().parents[2] / "zoo"
    assert (zoo / "target" / "model.safetensors").is_file(), "the committed toy zoo is missing"
    t0 = time.monotonic()
    assert main(["demo"]) == 0
    elapsed = time.monotonic() - t0
    out = capsys.readouterr().out
    assert f"models: toy zoo {zoo}" in out and "RANDOM" not in out
    rows = table_rows(out)
    assert set(METHODS) <= set(rows)
    for m in METHODS:
        _tokens_s, mal, _steps, same = rows[m][:4]
        assert same == "yes", m
        assert float(mal) > 1.0, m
    assert float(rows["tfm"][1]) > float(rows["chain"][1])
    assert elapsed < 60.0
