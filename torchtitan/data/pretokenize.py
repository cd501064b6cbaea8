"""Pre-tokenized data: the on-disk format and its writer (`scripts/pretokenize.py`); pretokenized.py reads it.

A folder holds, for shards i = 0, 1, ...:

    shard-00000.bin      token ids of whole documents, each BOS + tokens + EOS, in source order: a flat
                         little-endian uint16 array (uint32 when the tokenizer has more than 65,536 ids)
    shard-00000.idx.npy  int64 [2, documents]: row 0 each document's first token within the shard, row 1 its
                         raw index in the source (the dataloader's `next_doc`, so a state means the same in
                         both paths); rows, not columns, so that each is contiguous and binary-searchable

plus settings.json (written first: what is tokenized, and how) and manifest.json (written last: the settings
and every shard's token and document counts). The shards concatenated are exactly one epoch of the raw-text
path's token stream. A shard closes at the first document end at or after `shard_tokens` tokens, so where
shards end depends on the documents and the tokenizer only: output bytes are the same for any worker count.

Resumable: a shard is written under .tmp names and renamed when complete, its index first and its tokens
last, so a .bin under its final name is a complete shard. A rerun keeps the complete shards and continues
after the last one's last document. A folder without manifest.json is unfinished; the reader refuses it.

This module must not import torch: tokenizer worker processes import it, and torch costs them seconds.
"""

from __future__ import annotations

import array
import hashlib
import json
import multiprocessing
import os
import pickle
import re
import time
import weakref
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from torchtitan.tools.logging import logger

__all__ = ["FORMAT", "MANIFEST", "SETTINGS", "VERSION", "pretokenize", "shard_paths", "tokenizer_fingerprint",
           "token_dtype"]  # fmt: skip

FORMAT = "torchtitan-pretokenized"
VERSION = 1
MANIFEST = "manifest.json"
SETTINGS = "settings.json"
# 2^27 tokens = 256 MiB of uint16 per shard: few files even for billions of tokens, and losing one shard to
# an interruption costs a minute or two of tokenizing.
DEFAULT_SHARD_TOKENS = 1 << 27
# As the dataloader's blocks: ~10 ms of BPE work per task, so one pickled message per block costs <1%.
DEFAULT_BLOCK_CHARS = 32_768
_SHARD_FILE = re.compile(r"shard-(\d{5,})\.(bin|idx\.npy)(\.tmp)?")
# Encoded into the fingerprint: catches tokenizers that agree on their files but not on what they emit
# (a pickled HF tokenizer that forgot encode_special_tokens encodes the specials here differently).
_PROBE = "def f(x):\n\treturn x  # naïve café 🦙 <|begin_of_text|> <|end_of_text|> <s></s> <|endoftext|> 12345"
_LOG_EVERY_S = 30.0
_fingerprints: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits (vocab_size <= 65,536), else uint32; little-endian on every machine."""
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


def shard_paths(folder: Path, shard: int) -> tuple[Path, Path]:
    """(tokens, index) file of shard number `shard`."""
    return folder / f"shard-{shard:05d}.bin", folder / f"shard-{shard:05d}.idx.npy"


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A short hash of what the tokenizer emits: its vocabulary and merges where readable, its BOS/EOS ids,
    vocab_size and the ids of a probe text. Independent of the tokenizer file's path (cached per object)."""
    try:
        return _fingerprints[tokenizer]
    except (KeyError, TypeError):  # TypeError: not weak-referenceable; computed every time then
        pass
    h = hashlib.sha256(f"{tokenizer.vocab_size} {tokenizer.bos_id} {tokenizer.eos_id}\n".encode())
    backend = getattr(tokenizer, "backend", None)  # an HF tokenizers.Tokenizer: its whole JSON
    if hasattr(backend, "to_str"):
        h.update(backend.to_str().encode())
    ranks = getattr(getattr(tokenizer, "encoding", None), "_mergeable_ranks", None)  # tiktoken's merges
    if isinstance(ranks, dict):
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            h.update(rank.to_bytes(8, "little") + len(token).to_bytes(4, "little") + token)
    h.update(json.dumps(tokenizer.encode(_PROBE, add_bos=True, add_eos=True)).encode())
    fingerprint = h.hexdigest()[:16]
    try:
        _fingerprints[tokenizer] = fingerprint
    except TypeError:
        pass
    return fingerprint


def _settings(tokenizer: Any, shard_tokens: int, source_info: dict[str, Any]) -> dict[str, Any]:
    return {
        "format": FORMAT, "version": VERSION, "source": source_info,
        "tokenizer": {"fingerprint": tokenizer_fingerprint(tokenizer), "vocab_size": tokenizer.vocab_size,
                      "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "path": str(tokenizer.path)},
        "dtype": token_dtype(tokenizer.vocab_size).name, "shard_tokens": shard_tokens,
    }  # fmt: skip


def _write_json(path: Path, data: dict[str, Any]) -> None:
    # Through a temporary file and a rename: a reader never sees half a JSON file.
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _claim(folder: Path, settings: dict[str, Any]) -> bool:
    """Create or reuse `folder` for `settings`; True when it is already complete. A folder begun with other
    settings is refused: mixing shards of two tokenizers or shard sizes would corrupt the stream silently."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / SETTINGS
    if not path.is_file():
        if any(_SHARD_FILE.fullmatch(p.name) for p in folder.iterdir()) or (folder / MANIFEST).exists():
            raise ValueError(f"pretokenize: {folder} holds shards but no {SETTINGS}: use an empty folder")
        _write_json(path, settings)
        return False
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"pretokenize: cannot read {path}: {e}") from None

    def comparable(s: dict[str, Any]) -> dict[str, Any]:
        # The tokenizer may have moved since: its fingerprint, not its path, says what it emits.
        return {**s, "tokenizer": {k: v for k, v in s.get("tokenizer", {}).items() if k != "path"}}

    if not isinstance(old, dict) or comparable(old) != comparable(settings):
        differ = sorted(k for k in set(old) | set(settings) if comparable(old).get(k) != comparable(settings).get(k))
        raise ValueError(f"pretokenize: {folder} was begun with other settings (differing: {', '.join(differ)}); "
                         f"use another output folder, or delete this one to start over")
    return (folder / MANIFEST).is_file()


def _complete_shards(folder: Path, dtype: np.dtype) -> list[tuple[dict[str, Any], int]]:
    """The complete shards 0..k-1 left by an earlier run, as (manifest entry, raw index of the last document);
    every other shard file (temporary, or after a gap) is removed so the run rewrites it from scratch."""
    done: list[tuple[dict[str, Any], int]] = []
    while True:
        tokens_path, index_path = shard_paths(folder, len(done))
        if not (tokens_path.is_file() and index_path.is_file()):
            break
        size, index = tokens_path.stat().st_size, np.load(index_path, mmap_mode="r")
        count = size // dtype.itemsize
        if size % dtype.itemsize or index.ndim != 2 or index.shape[0] != 2 or not index.shape[1] \
                or not 0 <= index[0, -1] < count:
            break  # damaged: this shard and all after it are rewritten
        done.append(({"name": tokens_path.stem, "tokens": count, "documents": index.shape[1]}, int(index[1, -1])))
    for path in folder.iterdir():
        match = _SHARD_FILE.fullmatch(path.name)
        if match and (match.group(3) or int(match.group(1)) >= len(done)):
            path.unlink()
    return done


class _ShardWriter:
    """Appends tokenized documents to shard files, closing each at the first document end >= shard_tokens."""

    def __init__(self, folder: Path, first_shard: int, dtype: np.dtype, shard_tokens: int) -> None:
        self.folder, self.shard, self.dtype, self.shard_tokens = folder, first_shard, dtype, shard_tokens
        self.written: list[dict[str, Any]] = []  # manifest entries of the shards completed by this writer
        self._file = None
        self._tokens, self._starts, self._raw = 0, [], []

    def add(self, raw: np.ndarray, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Documents with raw indexes `raw`, their tokens concatenated, `lengths` tokens each."""
        ends = np.cumsum(lengths)
        first, done = 0, 0  # documents and tokens of this block already written
        while first < len(lengths):
            if self._file is None:
                self._file = open(self._tmp(0), "wb")  # noqa: SIM115 (closed in _close)
            # Documents up to and including the one that brings the shard to shard_tokens (or all of them).
            last = min(int(np.searchsorted(ends, done + self.shard_tokens - self._tokens, side="left")) + 1,
                       len(lengths))  # fmt: skip
            end = int(ends[last - 1])
            self._starts.append(self._tokens + ends[first:last] - lengths[first:last] - done)
            self._raw.append(raw[first:last])
            self._file.write(tokens[done:end].tobytes())
            self._tokens += end - done
            first, done = last, end
            if self._tokens >= self.shard_tokens:
                self._close()

    def finish(self) -> None:
        if self._file is not None:
            self._close()

    def _tmp(self, which: int) -> Path:
        path = shard_paths(self.folder, self.shard)[which]
        return path.with_name(path.name + ".tmp")

    def _close(self) -> None:
        tokens_path, index_path = shard_paths(self.folder, self.shard)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        index = np.stack([np.concatenate(self._starts), np.concatenate(self._raw)]).astype(np.int64)
        with open(self._tmp(1), "wb") as f:
            np.save(f, index, allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        # Index first, tokens last: a final-named .bin is the mark of a complete shard.
        os.replace(self._tmp(1), index_path)
        os.replace(self._tmp(0), tokens_path)
        self.written.append({"name": tokens_path.stem, "tokens": self._tokens, "documents": index.shape[1]})
        self.shard, self._file, self._tokens, self._starts, self._raw = self.shard + 1, None, 0, [], []


def _encode(tokenizer: Any, texts: list[str], dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """The documents' BOS + tokens + EOS concatenated (as the dataloader encodes them) and their lengths."""
    buffer, lengths = array.array("q"), np.empty(len(texts), dtype=np.int64)
    for i, text in enumerate(texts):
        ids = tokenizer.encode(text, add_bos=True, add_eos=True)
        buffer.extend(ids)  # array.extend(list) runs in C: ~20x faster than numpy.fromiter over the ids
        lengths[i] = len(ids)
    flat = np.frombuffer(buffer, dtype=np.int64)
    # An id outside the vocabulary would wrap silently in uint16; the model would index past its embedding.
    if flat.size and (flat.min() < 0 or flat.max() >= tokenizer.vocab_size):
        raise ValueError(f"pretokenize: the tokenizer emitted id {int(flat.max())} (or {int(flat.min())}), "
                         f"outside its vocab_size {tokenizer.vocab_size}")  # fmt: skip
    return flat.astype(dtype), lengths


_worker_state: tuple[Any, np.dtype] | None = None


def _worker_init(tokenizer: Any, dtype: np.dtype) -> None:
    global _worker_state
    _worker_state = (tokenizer, dtype)


def _worker_encode(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    tokenizer, dtype = _worker_state  # type: ignore[misc]
    return _encode(tokenizer, texts, dtype)


def _blocks(source: Any, start: int, block_chars: int) -> Iterator[tuple[list[int], list[str]]]:
    indices, texts, chars = [], [], 0
    for index, text in source.iter_documents(start):
        indices.append(index)
        texts.append(text)
        chars += len(text)
        if chars >= block_chars:
            yield indices, texts
            indices, texts, chars = [], [], 0
    if indices:
        yield indices, texts


def _tokenized(source: Any, tokenizer: Any, start: int, dtype: np.dtype, workers: int,
               block_chars: int) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(raw indexes, tokens, lengths) of blocks of documents from raw index `start`, in source order."""
    if workers == 0:
        for indices, texts in _blocks(source, start, block_chars):
            yield (np.asarray(indices, dtype=np.int64), *_encode(tokenizer, texts, dtype))
        return
    if pickle.loads(pickle.dumps(tokenizer)).encode(_PROBE) != tokenizer.encode(_PROBE):
        raise ValueError("pretokenize: the tokenizer encodes differently once pickled into a worker process "
                         "(fix its pickling, or use --workers 0)")  # fmt: skip
    # forkserver: fork()ing a process that has run HF tokenizers' thread pool can deadlock the children.
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(workers, _worker_init, (tokenizer, dtype)) as pool:
        # A bounded window of blocks in flight (Pool.imap would read the whole source ahead); results are
        # taken in submission order, which is what makes the output independent of the worker count.
        pending: deque = deque()
        for indices, texts in _blocks(source, start, block_chars):
            pending.append((indices, pool.apply_async(_worker_encode, (texts,))))
            if len(pending) >= 4 * workers:
                indices, result = pending.popleft()
                yield (np.asarray(indices, dtype=np.int64), *result.get())
        while pending:
            indices, result = pending.popleft()
            yield (np.asarray(indices, dtype=np.int64), *result.get())


class _Progress:
    """A tqdm bar over raw documents when tqdm is installed (it comes with HF datasets), else a log line
    every 30 s."""

    def __init__(self, enabled: bool, total: int | None, initial: int) -> None:
        self.bar, self.enabled, self.done, self.tokens = None, enabled, initial, 0
        self.start = self.last_log = time.perf_counter()
        if enabled:
            try:
                from tqdm import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, initial=initial, unit="doc", unit_scale=True, desc="pretokenize")

    def update(self, next_raw: int, tokens: int) -> None:
        self.tokens += tokens
        if self.bar is not None:
            self.bar.update(next_raw - self.done)
            self.bar.set_postfix_str(f"{self.tokens:,} tokens", refresh=False)
        elif self.enabled and time.perf_counter() - self.last_log > _LOG_EVERY_S:
            self.last_log = time.perf_counter()
            rate = self.tokens / (self.last_log - self.start)
            logger.info(f"pretokenize: {next_raw:,} documents read, {self.tokens:,} tokens ({rate:,.0f}/s)")
        self.done = next_raw

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def pretokenize(source: Any, tokenizer: Any, output: str | os.PathLike, *, source_info: dict[str, Any],
                workers: int = 0, shard_tokens: int = DEFAULT_SHARD_TOKENS, block_chars: int = DEFAULT_BLOCK_CHARS,
                progress: bool = True) -> dict[str, Any]:
    """Tokenize every document of `source` into shards under `output`; returns the manifest.

    source: a DocumentSource (build_document_source); source_info: how it was named (recorded; a rerun must
    give the same). workers: tokenizer processes (0: in this process). Resumes an interrupted run in `output`.
    """
    if workers < 0 or shard_tokens < 1 or block_chars < 1:
        raise ValueError(f"pretokenize: workers must be >= 0, shard_tokens and block_chars >= 1 (got {workers}, "
                         f"{shard_tokens}, {block_chars})")  # fmt: skip
    folder, dtype = Path(output).expanduser(), token_dtype(tokenizer.vocab_size)
    settings = _settings(tokenizer, shard_tokens, source_info)
    if _claim(folder, settings):
        logger.info(f"pretokenize: {folder} is already complete")
        return json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
    kept = _complete_shards(folder, dtype)
    start = kept[-1][1] + 1 if kept else 0
    if kept:
        logger.info(f"pretokenize: resuming {folder} after {len(kept)} complete shards, at document {start}")
    writer = _ShardWriter(folder, len(kept), dtype, shard_tokens)
    bar = _Progress(progress, getattr(source, "num_documents", None), start)
    try:
        for raw, tokens, lengths in _tokenized(source, tokenizer, start, dtype, workers, block_chars):
            writer.add(raw, tokens, lengths)
            bar.update(int(raw[-1]) + 1, len(tokens))
        writer.finish()
    finally:
        bar.close()
    shards = [entry for entry, _ in kept] + writer.written
    if not shards:
        raise ValueError(f"pretokenize: '{getattr(source, 'name', source)}' has no usable documents")
    manifest = {**settings, "num_tokens": sum(s["tokens"] for s in shards),
                "num_documents": sum(s["documents"] for s in shards), "shards": shards}  # fmt: skip
    _write_json(folder / MANIFEST, manifest)  # last: its presence says the folder is complete
    return manifest
