"""Training data for the toy zoo: Python source files already on the machine, tokenized once.

Nothing is downloaded. The corpus is every ``*.py`` file under one or more roots (on the GPU host:
its site-packages), listed in a fixed order (sorted relative POSIX paths, then root index) and
split by file: a file is held out for evaluation iff ``sha1(relative path) % eval_modulus == 0``
(the hash of the UTF-8 path, read as a big-endian integer; default modulus 20, i.e. ~5% held
out). The split depends on the path only, so it is the same on every machine that has the file.

Reading order inside a split is the sha1 order of the paths (a fixed pseudo-random order, so a
byte cap samples across packages instead of taking the alphabetically first ones). Files above
``max_file_bytes`` (generated tables) and files that are not UTF-8 are skipped.

Token streams: documents joined with the end-of-text token, stored as ``uint16``/``int32`` numpy
arrays in a cache directory keyed by the tokenizer file, the file manifest and the data config.
Batches are windows of the stream at offsets drawn from ``numpy.random.default_rng([seed, step,
stream])``: the batch of a step is a pure function of (seed, step), so a resumed run sees exactly
the batches an uninterrupted run would.
"""

from __future__ import annotations

import hashlib
import json
import os
import site
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "DataConfig",
    "SourceFile",
    "DataManifest",
    "TokenStreams",
    "SITE_PACKAGES",
    "resolve_roots",
    "path_hash",
    "is_eval_path",
    "list_source_files",
    "build_manifest",
    "read_texts",
    "build_token_streams",
    "sample_windows",
    "eval_windows",
]

SITE_PACKAGES = "site-packages"
"""Special ``--data-root`` value: every existing directory of ``site.getsitepackages()``."""


class DataConfig(BaseModel):
    """How the corpus is listed, split and capped (a section of every training config)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    extensions: tuple[str, ...] = (".py",)
    eval_modulus: int = Field(default=20, ge=2, description="held out iff sha1(relpath) % eval_modulus == 0")
    max_file_bytes: int = Field(default=1_000_000, gt=0, description="larger files are skipped")
    max_train_bytes: int | None = Field(default=256_000_000, gt=0, description="cap on train text read")
    max_eval_bytes: int | None = Field(default=4_000_000, gt=0, description="cap on eval text read")


@dataclass(frozen=True)
class SourceFile:
    root_index: int
    relpath: str  # POSIX, relative to its root
    size: int
    path: Path


@dataclass(frozen=True)
class DataManifest:
    """The listed corpus: roots, the train/eval files (in reading order) and a fingerprint."""

    roots: tuple[str, ...]
    train: tuple[SourceFile, ...]
    eval: tuple[SourceFile, ...]
    sha1: str  # of the sorted (root index, relpath, size) listing and the data config
    config: DataConfig

    def summary(self) -> dict[str, object]:
        return {
            "roots": list(self.roots),
            "split_rule": f"eval iff int(sha1(relpath).hexdigest(), 16) % {self.config.eval_modulus} == 0",
            "files_train": len(self.train),
            "files_eval": len(self.eval),
            "bytes_train_listed": sum(f.size for f in self.train),
            "bytes_eval_listed": sum(f.size for f in self.eval),
            "manifest_sha1": self.sha1,
            "config": self.config.model_dump(mode="json"),
        }


def resolve_roots(values: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Expand ``site-packages`` and check every root is a directory (one-line ValueError)."""
    if not values:
        raise ValueError("no --data-root given")
    roots: list[Path] = []
    for v in values:
        if str(v) == SITE_PACKAGES:
            found = [Path(p) for p in site.getsitepackages() if Path(p).is_dir()]
            if not found:
                raise ValueError("--data-root site-packages: site.getsitepackages() lists no existing directory")
            roots.extend(found)
        else:
            p = Path(v)
            if not p.is_dir():
                raise ValueError(f"--data-root {v}: not a directory")
            roots.append(p)
    unique: list[Path] = []
    for r in roots:
        if r.resolve() not in [u.resolve() for u in unique]:
            unique.append(r)
    return unique


def path_hash(relpath: str) -> int:
    """sha1 of the UTF-8 relative path as a non-negative integer."""
    return int(hashlib.sha1(relpath.encode("utf-8")).hexdigest(), 16)


def is_eval_path(relpath: str, eval_modulus: int) -> bool:
    return path_hash(relpath) % eval_modulus == 0


def list_source_files(roots: Sequence[Path], config: DataConfig) -> list[SourceFile]:
    """Every matching regular file under ``roots`` (symlinked dirs not followed), sorted by
    (relpath, root index); files over ``max_file_bytes`` or empty are left out."""
    out: list[SourceFile] = []
    for ri, root in enumerate(roots):
        for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
            dirnames.sort()
            for name in filenames:
                if not name.endswith(config.extensions):
                    continue
                p = Path(dirpath) / name
                try:
                    st = p.stat()
                except OSError:
                    continue
                if not p.is_file() or st.st_size == 0 or st.st_size > config.max_file_bytes:
                    continue
                out.append(SourceFile(ri, p.relative_to(root).as_posix(), int(st.st_size), p))
    out.sort(key=lambda f: (f.relpath, f.root_index))
    return out


def build_manifest(roots: Sequence[str | os.PathLike[str]], config: DataConfig) -> DataManifest:
    """List and split the corpus. Raises ValueError when a split comes out empty."""
    resolved = resolve_roots(roots)
    files = list_source_files(resolved, config)
    if not files:
        raise ValueError(f"no {'/'.join(config.extensions)} files under {', '.join(map(str, resolved))}")
    h = hashlib.sha1(json.dumps(config.model_dump(mode="json"), sort_keys=True).encode())
    for f in files:
        h.update(f"{f.root_index}\t{f.relpath}\t{f.size}\n".encode())
    by_hash = sorted(files, key=lambda f: (hashlib.sha1(f.relpath.encode()).hexdigest(), f.root_index))
    train = tuple(f for f in by_hash if not is_eval_path(f.relpath, config.eval_modulus))
    held = tuple(f for f in by_hash if is_eval_path(f.relpath, config.eval_modulus))
    if not train or not held:
        which = "train" if not train else "eval"
        raise ValueError(
            f"the {which} split is empty ({len(files)} files, eval_modulus {config.eval_modulus}); "
            "add files or lower data.eval_modulus"
        )
    return DataManifest(tuple(str(r) for r in resolved), train, held, h.hexdigest(), config)


def read_texts(files: Sequence[SourceFile], max_bytes: int | None) -> list[str]:
    """UTF-8 texts of ``files`` in order, skipping undecodable ones, until ``max_bytes`` is reached
    (the file that crosses the cap is the last one read)."""
    texts: list[str] = []
    total = 0
    for f in files:
        if max_bytes is not None and total >= max_bytes:
            break
        try:
            texts.append(f.path.read_bytes().decode("utf-8"))
        except (OSError, UnicodeDecodeError):
            continue
        total += f.size
    return texts


@dataclass
class TokenStreams:
    """Token ids of each split as one stream (documents separated by ``eos_id``), numpy [N]."""

    train: np.ndarray
    eval: np.ndarray
    info: dict[str, object]


def _encode_stream(tokenizer, texts: list[str], eos_id: int, chunk: int = 256) -> np.ndarray:
    parts: list[np.ndarray] = []
    dtype = np.uint16 if tokenizer.get_vocab_size() <= 65536 else np.int32
    sep = np.array([eos_id], dtype=dtype)
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    for i in range(0, len(texts), chunk):
        for enc in encode(texts[i : i + chunk], add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=dtype))
            parts.append(sep)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def build_token_streams(
    manifest: DataManifest, tokenizer_dir: str | os.PathLike[str], cache_dir: str | os.PathLike[str] | None
) -> TokenStreams:
    """Tokenize both splits with the data tokenizer of ``tokenizer_dir`` (special-token strings in
    the sources are plain text), caching the arrays under ``cache_dir`` (None: no cache)."""
    from .tokenizer import data_tokenizer, load_tokenizer, special_token_ids

    tok_path = Path(tokenizer_dir) / "tokenizer.json"
    if not tok_path.is_file():
        raise ValueError(f"{tokenizer_dir}: missing tokenizer.json (train the tokenizer first)")
    key = hashlib.sha1(tok_path.read_bytes() + manifest.sha1.encode()).hexdigest()[:16]
    cache = Path(cache_dir) / f"tokens-{key}" if cache_dir is not None else None
    info_path = cache / "info.json" if cache is not None else None
    if cache is not None and info_path is not None and info_path.is_file():
        info = json.loads(info_path.read_text())
        return TokenStreams(np.load(cache / "train.npy"), np.load(cache / "eval.npy"), info)
    full = load_tokenizer(tokenizer_dir)
    eos = special_token_ids(full)["eos"]
    tok = data_tokenizer(full)
    cfg = manifest.config
    train_texts = read_texts(manifest.train, cfg.max_train_bytes)
    eval_texts = read_texts(manifest.eval, cfg.max_eval_bytes)
    train = _encode_stream(tok, train_texts, eos)
    held = _encode_stream(tok, eval_texts, eos)
    info = {
        "docs_train": len(train_texts),
        "docs_eval": len(eval_texts),
        "chars_train": sum(len(t) for t in train_texts),
        "chars_eval": sum(len(t) for t in eval_texts),
        "tokens_train": int(train.size),
        "tokens_eval": int(held.size),
        "cache_key": key,
    }
    if cache is not None and info_path is not None:
        cache.mkdir(parents=True, exist_ok=True)
        np.save(cache / "train.npy", train)
        np.save(cache / "eval.npy", held)
        tmp = info_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(info, indent=1))
        os.replace(tmp, info_path)  # written last: its presence marks a complete cache
    return TokenStreams(train, held, info)


def _check_length(stream: np.ndarray, length: int, what: str) -> None:
    if stream.size < length + 1:
        raise ValueError(f"the {what} token stream has {stream.size} tokens, fewer than one window of {length} + 1")


def sample_windows(stream: np.ndarray, batch: int, length: int, seed: int, step: int, stream_id: int) -> torch.Tensor:
    """``batch`` windows of ``length`` tokens at offsets drawn from rng([seed, step, stream_id]):
    int64 [batch, length]. A pure function of its arguments."""
    _check_length(stream, length, "train")
    rng = np.random.default_rng([seed, step, stream_id])
    starts = rng.integers(0, stream.size - length, size=batch)
    idx = starts[:, None] + np.arange(length)[None, :]
    return torch.from_numpy(stream[idx].astype(np.int64))


def eval_windows(stream: np.ndarray, count: int, length: int) -> torch.Tensor:
    """``count`` windows at evenly spaced offsets over the stream: int64 [count, length]."""
    _check_length(stream, length, "eval")
    starts = np.linspace(0, stream.size - length - 1, num=count).astype(np.int64)
    idx = starts[:, None] + np.arange(length)[None, :]
    return torch.from_numpy(stream[idx].astype(np.int64))
