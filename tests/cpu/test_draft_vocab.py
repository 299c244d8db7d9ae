"""A frequency-ranked draft vocabulary (``vllm_tfm.models.draft_vocab``, FR-Spec): the file, its ranking, the
drafter's head over it, its simulation in ``vllm-tfm eval`` and the vLLM runtime's head (``draft_logits_head``)."""

from __future__ import annotations

import json
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from vllm_tfm.cli import main as cli_main
from vllm_tfm.models.draft_vocab import (
    DRAFT_VOCAB_FORMAT,
    DraftVocabHead,
    count_token_ids,
    load_draft_vocab,
    ranked_token_ids,
    subset_logits_reference,
    write_draft_vocab,
)
from vllm_tfm.reference.fp8_sim import Fp8SimHead

REPO = Path(__file__).resolve().parents[2]


def test_counts_rank_by_frequency_then_id() -> None:
    counts = count_token_ids([[3, 1, 3], [], [0, 3, 1]], 5)
    assert counts.tolist() == [1, 2, 0, 3, 0]
    assert ranked_token_ids(counts).tolist() == [3, 1, 0, 2, 4]  # ties (0, 2, 4 / 2, 4) in id order
    with pytest.raises(ValueError, match=r"token id 5 outside the vocabulary 0..4"):
        count_token_ids([[1, 5]], 5)


def test_the_file_gives_its_first_n_ids_and_refuses_bad_ones(tmp_path: Path) -> None:
    path = tmp_path / "dv.json"
    data = write_draft_vocab(path, np.array([5, 0, 7, 7, 1]), "tok", "src")
    assert data["token_ids"] == [2, 3, 0, 4, 1] and data["counts"] == [7, 7, 5, 1, 0] and data["tokens_counted"] == 20
    assert load_draft_vocab(path, 3, 5).tolist() == [0, 2, 3]  # the 3 most frequent, ascending
    assert load_draft_vocab(path, None, 5).tolist() == [0, 1, 2, 3, 4]

    def bad(content: Any, match: str, size: int | None = 2, vocab: int = 5) -> None:
        path.write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(ValueError, match=match) as info:
            load_draft_vocab(path, size, vocab)
        assert "\n" not in str(info.value)

    good = {"format": DRAFT_VOCAB_FORMAT, "vocab_size": 5, "token_ids": [1, 2, 3]}
    bad("{", r"cannot read JSON")
    bad({**good, "format": "x"}, r"not a vllm-tfm-draft-vocab/1 file \(make one with `vllm-tfm draft-vocab`\)")
    bad({**good, "token_ids": [1, True]}, r"token_ids must be a non-empty list of integers")
    bad({**good, "token_ids": []}, r"token_ids must be a non-empty list of integers")
    bad(good, r"made for a vocabulary of 5 tokens, the model has 6", vocab=6)
    bad(good, r"holds 3 token ids, cannot take the first 4", size=4)
    bad(good, r"holds 3 token ids, cannot take the first 0", size=0)
    bad({**good, "token_ids": [1, 5]}, r"token ids must be in 0..4")
    bad({**good, "token_ids": [-1, 2]}, r"token ids must be in 0..4")
    bad({**good, "token_ids": [2, 1, 2]}, r"a token id is listed twice", size=3)
    with pytest.raises(ValueError, match=r"no such file"):
        load_draft_vocab(tmp_path / "none.json", 2, 5)


def test_the_head_is_the_lm_head_at_its_tokens_and_minus_inf_elsewhere() -> None:
    g = torch.Generator().manual_seed(0)
    vocab, hidden = 50, 16
    weight = torch.randn(vocab, hidden, generator=g, dtype=torch.float64)
    ids = torch.tensor([0, 7, 8, 31, 49])
    x = torch.randn(3, 4, hidden, generator=g, dtype=torch.float64)
    got = DraftVocabHead(weight, ids)(x)
    assert got.shape == (3, 4, vocab)
    assert torch.equal(got, subset_logits_reference(x, weight, ids, vocab))
    assert torch.allclose(got[..., ids], x @ weight[ids].T, rtol=1e-12, atol=1e-12)
    rest = torch.ones(vocab, dtype=torch.bool)
    rest[ids] = False
    assert torch.isneginf(got[..., rest]).all()
    # the FP8 copy of the subset's rows: the FP8 head of those rows at the subset, -inf elsewhere
    fp8 = DraftVocabHead(weight.float(), ids, Fp8SimHead)(x.float())
    assert torch.equal(fp8[..., ids], Fp8SimHead(weight.float()[ids])(x.float()))
    assert torch.isneginf(fp8[..., rest]).all()
    with pytest.raises(ValueError, match=r"token_ids must be a non-empty \[N\] tensor of ids in 0..49"):
        DraftVocabHead(weight, torch.tensor([3, 50]))


def test_the_runtime_head_over_a_draft_vocab_equals_the_reference() -> None:
    """``draft_logits_head`` with a draft vocabulary and the model's head (no FP8): on the CPU too, the
    reference's values; its refusals name the option."""
    pytest.importorskip("vllm")
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    from vllm_tfm.vllm_plugin.runtime.draft_head import draft_logits_head

    g = torch.Generator().manual_seed(1)
    weight = torch.randn(72, 32, generator=g).to(torch.bfloat16)  # 70 real rows and 2 of padding
    head = types.SimpleNamespace(quant_method=UnquantizedEmbeddingMethod(), weight=weight)
    proc = types.SimpleNamespace(soft_cap=None, scale=1.0, head_dtype=None, org_vocab_size=70)
    d = types.SimpleNamespace(lm_head=head, logits_processor=proc, draft_id_to_target_id=None)
    assert draft_logits_head(d, torch.bfloat16, 1, False, None) is None
    ids = torch.tensor([2, 5, 11, 69])
    logits = draft_logits_head(d, torch.bfloat16, 1, False, ids)
    x = torch.randn(15, 32, generator=g).to(torch.bfloat16)
    got = logits(x)
    assert got.shape == (15, 70) and got.dtype == torch.bfloat16
    assert torch.equal(got, subset_logits_reference(x, weight[:70], ids, 70))
    with pytest.raises(ValueError, match=r"^tfm option draft_vocab: runs on one GPU; this engine has tensor_parallel_size 2$"):
        draft_logits_head(d, torch.bfloat16, 2, False, ids)
    with pytest.raises(ValueError, match=r"^tfm option draft_lm_head='fp8' and draft_vocab: the inputs are not on one CUDA"):
        draft_logits_head(d, torch.bfloat16, 1, True, ids)
    with pytest.raises(ValueError, match=r"^tfm option draft_vocab: the draft vocabulary must be token ids in 0..69$"):
        draft_logits_head(d, torch.bfloat16, 1, False, torch.tensor([1, 70]))


def test_draft_vocab_command_counts_the_training_split(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``vllm-tfm draft-vocab`` on a small corpus with the zoo's tokenizer: the counts are the tokenizer's own
    over the files the trainer's split keeps for training, the held-out ones left out."""
    from vllm_tfm.train.data import DataConfig, build_manifest, is_eval_path
    from vllm_tfm.train.tokenizer import data_tokenizer, load_tokenizer

    root = tmp_path / "corpus"
    root.mkdir()
    texts = {f"m{i}.py": f"def f{i}(x):\n    return x * {i} + {i * i}\n" * (i + 1) for i in range(12)}
    for name, text in texts.items():
        (root / name).write_text(text)
    held = [n for n in texts if is_eval_path(n, 3)]
    assert held and len(held) < len(texts)
    out = tmp_path / "dv.json"
    rc = cli_main(["draft-vocab", "--tokenizer", str(REPO / "zoo" / "tokenizer"), "--data-root", str(root),
                   "--eval-modulus", "3", "--out", str(out)])
    assert rc == 0
    data = json.loads(out.read_text())
    tok = data_tokenizer(load_tokenizer(REPO / "zoo" / "tokenizer"))
    want = np.zeros(data["vocab_size"], dtype=np.int64)
    for f in build_manifest([str(root)], DataConfig(eval_modulus=3)).train:
        np.add.at(want, tok.encode(texts[f.relpath], add_special_tokens=False).ids, 1)
    assert data["vocab_size"] == load_tokenizer(REPO / "zoo" / "tokenizer").get_vocab_size()
    assert data["token_ids"] == ranked_token_ids(want).tolist() and data["counts"] == want[data["token_ids"]].tolist()
    assert f"{len(texts) - len(held)} train-split files" in data["source"]
    assert "the first 256:" in capsys.readouterr().out


def test_eval_refuses_a_size_without_a_file(capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli_main(["eval", "--random-models", "--draft-vocab-size", "8", "--prompts", "1", "--out", "/dev/null"])
    assert rc == 2 and "--draft-vocab-size needs --draft-vocab" in capsys.readouterr().err
