"""bench/gpu_plugin_e2e.py's zoo prompts come from a fixed file (bench/plugin_zoo_prompts.json), not from the
live source files, whose edits changed the prompts, and the acceptance with them, from commit to commit."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _load(monkeypatch: pytest.MonkeyPatch, n: int):
    monkeypatch.setenv("TFM_E2E_ZOO", str(REPO / "zoo"))
    monkeypatch.setenv("TFM_E2E_PROMPTS", str(n))
    monkeypatch.syspath_prepend(str(REPO / "bench"))
    sys.modules.pop("gpu_plugin_e2e", None)
    mod = importlib.import_module("gpu_plugin_e2e")
    monkeypatch.setitem(sys.modules, "gpu_plugin_e2e", mod)
    return mod


def test_zoo_prompts_are_read_from_the_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    g = _load(monkeypatch, 3)
    other = tmp_path / "p.json"
    other.write_text(json.dumps({"about": "", "prompts": [[1, 2], [3], [4, 5, 6], [7]]}))
    monkeypatch.setattr(g, "PROMPT_FILE", other)
    assert g.prompts() == [[1, 2], [3], [4, 5, 6]]
    sys.modules.pop("gpu_plugin_e2e", None)


def test_zoo_prompts_are_the_fixed_file_with_the_benchs_lengths(monkeypatch: pytest.MonkeyPatch) -> None:
    g = _load(monkeypatch, 32)
    fixed = json.loads(g.PROMPT_FILE.read_text())["prompts"]
    ps = g.prompts()
    assert ps == fixed and [len(p) for p in ps] == g.PROMPT_LENS
    vocab = json.loads((REPO / "zoo" / "target" / "config.json").read_text())["vocab_size"]
    assert all(0 <= t < vocab for p in ps for t in p)
    g8 = _load(monkeypatch, 8)
    assert g8.prompts() == ps[:8] and [len(p) for p in ps[:8]] == [5, 9, 17, 33, 3, 12, 64, 7]
    with pytest.raises(SystemExit, match="holds 32 prompts"):
        _load(monkeypatch, 33).prompts()
    sys.modules.pop("gpu_plugin_e2e", None)
