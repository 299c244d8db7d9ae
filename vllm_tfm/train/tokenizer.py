"""Byte-level BPE tokenizer for the toy zoo (Hugging Face ``tokenizers``), saved so that
``transformers.AutoTokenizer`` and vLLM load it: ``tokenizer.json`` plus ``tokenizer_config.json``
and ``special_tokens_map.json``.

Byte-level (GPT-2 style): every byte has a token, so any text encodes; pre-tokenization is the
GPT-2 regex (runs of spaces stay together, which suits indented code); no normalizer, no BOS, no
post-processor. Special tokens take ids 0, 1, 2: ``<|endoftext|>`` (document separator and EOS),
``<|pad|>`` and ``<|mask|>`` (the DFlash mask token, never produced by text).

Training data is encoded with :func:`data_tokenizer`, the same tokenizer without its added-token
matcher, so a source file that literally contains ``<|endoftext|>`` is encoded as its bytes (it
would otherwise inject control tokens into the training stream).
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .data import DataConfig, build_manifest, read_texts

if TYPE_CHECKING:
    from .stage import RunOptions

__all__ = [
    "EOS_TOKEN",
    "PAD_TOKEN",
    "MASK_TOKEN",
    "TOKENIZER_FILES",
    "TokenizerTrainConfig",
    "train_tokenizer",
    "save_tokenizer",
    "load_tokenizer",
    "data_tokenizer",
    "special_token_ids",
    "copy_tokenizer_files",
    "run_tokenizer_stage",
]

EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
MASK_TOKEN = "<|mask|>"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


class TokenizerTrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    stage: Literal["tokenizer"]
    vocab_size: int = Field(default=8192, gt=259, description="including the 256 bytes and 3 special tokens")
    min_frequency: int = Field(default=2, ge=1)
    max_train_bytes: int = Field(default=32_000_000, gt=0, description="train-split text the BPE trainer reads")
    model_max_length: int = Field(default=4096, gt=0)
    seed: int = 0
    data: DataConfig = DataConfig()


def train_tokenizer(texts: Iterable[str], config: TokenizerTrainConfig, length: int | None = None) -> Tokenizer:
    """Train byte-level BPE on ``texts`` (deterministic for a given input and config)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=config.vocab_size,
        min_frequency=config.min_frequency,
        special_tokens=[EOS_TOKEN, PAD_TOKEN, MASK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer, length=length)
    return tok


def save_tokenizer(tok: Tokenizer, directory: str | Path, model_max_length: int) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    special = {"eos_token": EOS_TOKEN, "pad_token": PAD_TOKEN, "mask_token": MASK_TOKEN}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": model_max_length,
        "bos_token": None,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        **special,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
    return [out / n for n in TOKENIZER_FILES]


def load_tokenizer(directory: str | Path) -> Tokenizer:
    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"{directory}: missing tokenizer.json")
    return Tokenizer.from_file(str(path))


def data_tokenizer(tok: Tokenizer) -> Tokenizer:
    """``tok`` without added tokens: special-token strings in the text encode as ordinary bytes.
    Text without those strings encodes exactly as with ``tok``."""
    spec = json.loads(tok.to_str())
    spec["added_tokens"] = []
    return Tokenizer.from_str(json.dumps(spec))


def special_token_ids(tok: Tokenizer) -> dict[str, int]:
    """{"eos", "pad", "mask"} -> id (ValueError naming a missing token)."""
    out: dict[str, int] = {}
    for key, text in (("eos", EOS_TOKEN), ("pad", PAD_TOKEN), ("mask", MASK_TOKEN)):
        i = tok.token_to_id(text)
        if i is None:
            raise ValueError(f"the tokenizer has no {text} token")
        out[key] = int(i)
    return out


def copy_tokenizer_files(src: str | Path, dst: str | Path) -> None:
    """Copy the tokenizer files into a model directory (so vLLM / AutoTokenizer find them there)."""
    Path(dst).mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        s = Path(src) / name
        if not s.is_file():
            raise ValueError(f"{src}: missing {name}")
        shutil.copyfile(s, Path(dst) / name)


OBJECTIVE = (
    "Byte-level BPE (GPT-2 pre-tokenizer regex, no normalizer) trained with the tokenizers "
    "library on the first max_train_bytes of the train split in sha1 order. Held-out metric: "
    "UTF-8 bytes per token on the held-out files (higher = better compression)."
)


def run_tokenizer_stage(config: TokenizerTrainConfig, opts: RunOptions) -> dict[str, Any]:
    """Train and save the tokenizer into ``opts.out`` with its model card; returns the record."""
    from .card import environment, file_sizes, write_card

    t0 = time.monotonic()
    manifest = build_manifest(opts.data_roots, config.data)
    texts = read_texts(manifest.train, config.max_train_bytes)
    print(f"[tokenizer] training on {len(texts)} files ({sum(map(len, texts)):,} chars)", flush=True)
    tok = train_tokenizer(texts, config, length=len(texts))
    save_tokenizer(tok, opts.out, config.model_max_length)
    held = read_texts(manifest.eval, 2_000_000)
    enc = data_tokenizer(tok).encode_batch(held, add_special_tokens=False)
    n_tokens = sum(len(e.ids) for e in enc)
    n_bytes = sum(len(t.encode("utf-8")) for t in held)
    bpt = n_bytes / max(n_tokens, 1)
    train_bytes = sum(len(t.encode("utf-8")) for t in texts)
    record = {
        "stage": "tokenizer",
        "title": f"Tokenizer: byte-level BPE, {tok.get_vocab_size()} tokens",
        "status": "complete",
        "data": {**manifest.summary(), "bytes_read_train": train_bytes, "docs_train": len(texts)},
        "steps": tok.get_vocab_size() - 259,
        "steps_planned": config.vocab_size - 259,
        "planned_by": "BPE merges",
        "tokens_seen": train_bytes,
        "tokens_unit": "UTF-8 bytes the BPE trainer read",
        "final_train_loss": None,
        "eval_initial": None,
        "eval_final": {"bytes_per_token": bpt, "heldout_tokens": n_tokens, "heldout_bytes": n_bytes},
        "seed": config.seed,
        "command": opts.command,
        "wall_seconds": time.monotonic() - t0,
        "environment": environment("cpu"),
        "files": file_sizes(opts.out, list(TOKENIZER_FILES)),
        "objective": OBJECTIVE + " (steps = merges learned; tokens seen = training bytes; BPE training "
        "has no randomness, the seed is recorded for uniformity)",
        "config": config.model_dump(mode="json"),
    }
    write_card(opts.out, record)
    print(f"[tokenizer] {tok.get_vocab_size()} tokens, {bpt:.2f} held-out bytes/token", flush=True)
    return record
