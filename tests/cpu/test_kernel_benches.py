"""The Weaver kernel benches' shared command line and result header (``bench/gdn_tree.py``'s
``kernel_bench_parser``, ``result_header``, ``write_result``) and each bench's use of them, on
the CPU: the benches time on the GPU host only, so here every script's parser runs up to its
``--sanitize-case`` branch (replaced by a recorder) and the header is built with the GPU name
stubbed."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"
sys.path.insert(0, str(BENCH))
gdn_tree = importlib.import_module("gdn_tree")

SCRIPTS = {"candidate_scores": ("--nodes", "1x2,1x4,8x2,8x4,32x2", 50), "weaver_linear": ("--rows", "1,2,4,8,16", 50),
           "weaver_round": ("--budgets", "32,64", 30), "weaver_attention": ("--cases", "1:2,1:4,8:2,8:4,32:2", 50),
           "kv_compact": ("--batches", "1,8", 50)}


def test_parser_has_the_shared_options() -> None:
    ap = gdn_tree.kernel_bench_parser("First paragraph.\n\nMore.", repeats=7)
    args = ap.parse_args([])
    assert (args.out, args.repeats, args.sanitize_case) == (None, 7, False)
    args = ap.parse_args(["--out", "x.json", "--repeats", "3", "--sanitize-case"])
    assert (args.out, args.repeats, args.sanitize_case) == ("x.json", 3, True)
    assert ap.description == "First paragraph."


def test_budget_skips_cases_only_past_it(capsys) -> None:
    skipped: list = []
    now = gdn_tree.time.perf_counter()
    assert not gdn_tree.past_budget(now - 1e6, None, skipped, rows=15)  # no budget: never
    assert not gdn_tree.past_budget(now, 60.0, skipped, rows=15)
    assert gdn_tree.past_budget(now - 5.0, 1.5, skipped, rows=120, ties=True)
    assert skipped == [{"rows": 120, "ties": True, "why": "past --budget-s 1.5"}]
    assert "rows 120 ties True: skipped (past --budget-s)" in capsys.readouterr().out


def test_header_and_compact_result(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setattr(gdn_tree.torch.cuda, "get_device_name", lambda dev: "Some GPU")
    monkeypatch.setattr(sys, "argv", ["bench/x.py", "--rows", "1,2"])
    head = gdn_tree.result_header("bench/x.py")
    assert head["command"] == "python3 bench/x.py --rows 1,2"
    assert head["machine"]["gpu"] == "Some GPU" and head["machine"]["torch"] == gdn_tree.torch.__version__
    out = tmp_path / "r.json"
    gdn_tree.write_result(str(out), {**head, "cases": [1]})
    text = out.read_text()
    assert text.endswith("\n") and text.count("\n") == 1 and json.loads(text)["cases"] == [1]
    gdn_tree.write_result(None, {"nothing": 1})  # no path: no file, no error


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_each_bench_parses_and_reaches_its_sanitize_case(monkeypatch, name: str) -> None:
    mod = importlib.import_module(name)
    option, default, repeats = SCRIPTS[name]
    seen = []
    monkeypatch.setattr(mod, "sanitize_case", lambda: seen.append(True))
    monkeypatch.setattr(sys, "argv", [f"bench/{name}.py", "--sanitize-case"])
    assert mod.main() == 0 and seen == [True]
    captured = {}

    def parse(self, args=None, namespace=None):  # the parser main() builds, before it runs anything
        ns = type(self).parse_known_args(self, args, namespace)[0]
        captured.update(vars(ns))
        raise SystemExit(0)

    monkeypatch.setattr(gdn_tree.argparse.ArgumentParser, "parse_args", parse)
    monkeypatch.setattr(sys, "argv", [f"bench/{name}.py"])
    with pytest.raises(SystemExit):
        mod.main()
    assert captured["repeats"] == repeats and captured[option.lstrip("-")] == default and captured["out"] is None
