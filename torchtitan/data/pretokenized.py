"""Training on pre-tokenized folders (written by scripts/pretokenize.py; format in pretokenize.py).

`training.dataset_path` (or `validation.dataset_path`) naming such a folder makes build_document_source return
a PretokenizedSource and build_dataloader a PretokenizedDataLoader. The batches are exactly the raw-text
path's for the same documents, tokenizer, seq_len, batch and dp layout, and the state is the same four ints:

- the token stream is the shards concatenated, epoch after epoch; window k is tokens [k*W, (k+1)*W) of it,
  W = seq_len + 1, and a window may span shards and the end of an epoch, as in the raw path;
- so the global cursor `sequences_consumed` alone positions a rank: its step-n batch is tokens
  [(n*D + r)*b*W, (n*D + r + 1)*b*W), read by index arithmetic from the memmapped shards, and in-document
  positions come from a binary search of the shard's document starts. Per step a rank copies b*W tokens and
  the starts of the documents they touch, whatever the dp degree; resume is O(1) under any dp degree;
- epoch, next_doc (raw source index, from the index file) and doc_token_offset are derived from the cursor,
  so a state saved by one path resumes in the other.
"""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from torchtitan.data.dataloader import PackedDataLoader
from torchtitan.data.pretokenize import FORMAT, MANIFEST, SETTINGS, VERSION, shard_paths, tokenizer_fingerprint
from torchtitan.data.source import DocumentSource
from torchtitan.tools.logging import logger

__all__ = ["PretokenizedDataLoader", "PretokenizedSource", "ReadCounts", "build_pretokenized_dataloader",
           "open_pretokenized"]  # fmt: skip

# Open memmaps kept per source: a rank touches one or two shards per step; the bound keeps file
# descriptors in check for folders of thousands of shards.
_OPEN_SHARDS = 16


@dataclass
class ReadCounts:
    """What a loader has read from disk: the scaling test checks these do not grow with the dp degree."""

    slices: int = 0  # contiguous token ranges copied out of shard memmaps
    tokens: int = 0  # token ids copied
    index_entries: int = 0  # document-start entries copied (binary-search probes not counted)
    searches: int = 0  # binary searches in a shard's document starts


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None


def open_pretokenized(path: str, key_prefix: str = "training") -> PretokenizedSource | None:
    """The pre-tokenized folder at `path`, checked; None when `path` is not one (raw data: read as text)."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return None
    manifest = _read_json(folder / MANIFEST)
    if isinstance(manifest, dict) and manifest.get("format") == FORMAT:
        return PretokenizedSource(folder, key_prefix, manifest)
    settings = _read_json(folder / SETTINGS)
    if isinstance(settings, dict) and settings.get("format") == FORMAT:
        raise ValueError(f"{key_prefix}.dataset_path: {folder} is an unfinished pre-tokenized folder (no readable "
                         f"{MANIFEST}): run scripts/pretokenize.py again with the same arguments to finish it")
    return None


class PretokenizedSource(DocumentSource):
    """The token stream of a pre-tokenized folder: shard files memmapped on demand, read by global offset."""

    def own_loader(self, *, tokenizer: Any, seq_len: int, local_batch_size: int, dp_rank: int, dp_degree: int,
                   infinite: bool, document_masking: bool) -> PretokenizedDataLoader:
        return build_pretokenized_dataloader(
            source=self, tokenizer=tokenizer, seq_len=seq_len, local_batch_size=local_batch_size, dp_rank=dp_rank,
            dp_degree=dp_degree, infinite=infinite, document_masking=document_masking,
        )  # fmt: skip

    def __init__(self, folder: Path, key_prefix: str, manifest: dict[str, Any]) -> None:
        super().__init__(str(folder), key_prefix, None)
        self.folder, key = folder, f"{key_prefix}.dataset_path: {folder}"
        try:
            if manifest["version"] != VERSION:
                raise ValueError(f"{key}: format version {manifest['version']}, this code reads {VERSION}")
            self.tokenizer_info: dict[str, Any] = dict(manifest["tokenizer"])
            self.dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
            counts = [(int(s["tokens"]), int(s["documents"])) for s in manifest["shards"]]
        except (KeyError, TypeError, ValueError) as e:
            if str(e).startswith(key):
                raise
            raise ValueError(f"{key}/{MANIFEST} is malformed ({type(e).__name__}: {e})") from None
        if not counts or min(min(c) for c in counts) < 1:
            raise ValueError(f"{key}/{MANIFEST} lists no shards, or an empty one")
        for shard, (tokens, documents) in enumerate(counts):
            self._check_files(shard, tokens, documents, key)
        self.shard_tokens = np.array([t for t, _ in counts], dtype=np.int64)
        self.shard_starts = np.concatenate([[0], np.cumsum(self.shard_tokens)])  # epoch offset of each shard
        self.tokens_per_epoch = int(self.shard_starts[-1])
        self.num_usable_documents = sum(d for _, d in counts)
        self._open: OrderedDict[int, tuple[np.ndarray, np.ndarray]] = OrderedDict()

    def _check_files(self, shard: int, tokens: int, documents: int, key: str) -> None:
        """A missing or truncated file fails now, in one line, rather than as a bus error mid-run."""
        tokens_path, index_path = shard_paths(self.folder, shard)
        for path in (tokens_path, index_path):
            if not path.is_file():
                raise ValueError(f"{key}: {path.name} is missing (the manifest lists it)")
        if (size := tokens_path.stat().st_size) != tokens * self.dtype.itemsize:
            raise ValueError(f"{key}: {tokens_path.name} holds {size} bytes, the manifest says {tokens} tokens of "
                             f"{self.dtype.itemsize} bytes (truncated or overwritten: pre-tokenize again)")
        try:
            with open(index_path, "rb") as f:
                version = np.lib.format.read_magic(f)
                if version not in ((1, 0), (2, 0)):
                    raise ValueError(f"npy format version {version}")
                read_header = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
                    np.lib.format.read_array_header_2_0
                shape, _, dtype = read_header(f)
                complete = index_path.stat().st_size == f.tell() + math.prod(shape) * 8
        except (OSError, ValueError) as e:
            raise ValueError(f"{key}: {index_path.name} is not a readable .npy file ({e})") from None
        if shape != (2, documents) or dtype != np.dtype("<i8") or not complete:
            raise ValueError(f"{key}: {index_path.name} is not int64 [2, {documents}] as the manifest says, or is "
                             f"truncated (pre-tokenize again)")

    def _iter_raw(self, start: int) -> Iterator[tuple[int, Any]]:
        raise ValueError(f"{self.key_prefix}.dataset_path: {self.folder} holds token ids, not text (it is training "
                         f"input as it is; to re-tokenize, point scripts/pretokenize.py at the original data)")

    def _shard(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """(tokens, index) memmaps of a shard: opening maps the files, it reads nothing."""
        if shard in self._open:
            self._open.move_to_end(shard)
        else:
            tokens_path, index_path = shard_paths(self.folder, shard)
            tokens = np.memmap(tokens_path, dtype=self.dtype, mode="r", shape=(int(self.shard_tokens[shard]),))
            self._open[shard] = (tokens, np.load(index_path, mmap_mode="r"))
            if len(self._open) > _OPEN_SHARDS:
                self._open.popitem(last=False)
        return self._open[shard]

    def _locate(self, offset: int) -> tuple[int, int]:
        """(shard, offset in it) of epoch offset `offset` (< tokens_per_epoch)."""
        shard = int(np.searchsorted(self.shard_starts, offset, side="right")) - 1
        return shard, offset - int(self.shard_starts[shard])

    def read(self, first: int, count: int, counts: ReadCounts) -> tuple[np.ndarray, np.ndarray]:
        """Tokens [first, first + count) of the stream of epochs (int32) and each one's position in its document
        (int64): only those tokens and the starts of their documents are read."""
        tokens, positions = [], []
        while count > 0:
            shard, offset = self._locate(first % self.tokens_per_epoch)
            data, index = self._shard(shard)
            k = min(count, int(self.shard_tokens[shard]) - offset)
            tokens.append(np.asarray(data[offset : offset + k], dtype=np.int32))
            # The documents touching [offset, offset + k): the last starting at or before each end.
            starts = index[0]
            lo = int(np.searchsorted(starts, offset, side="right")) - 1
            hi = int(np.searchsorted(starts, offset + k - 1, side="right"))
            local = np.asarray(starts[lo:hi])
            at = np.arange(offset, offset + k, dtype=np.int64)
            positions.append(at - local[np.searchsorted(local, at, side="right") - 1])
            counts.slices, counts.tokens, counts.index_entries = counts.slices + 1, counts.tokens + k, \
                counts.index_entries + hi - lo
            counts.searches += 2
            first, count = first + k, count - k
        if not tokens:
            return np.empty(0, dtype=np.int32), np.empty(0, dtype=np.int64)
        return np.concatenate(tokens), np.concatenate(positions)

    def cursor(self, offset: int) -> tuple[int, int, int]:
        """(epoch, raw index of the document holding token `offset` of the stream, tokens of it before)."""
        epoch, rest = divmod(offset, self.tokens_per_epoch)
        shard, local = self._locate(rest)
        starts, raw = self._shard(shard)[1]
        document = int(np.searchsorted(starts, local, side="right")) - 1
        return epoch, int(raw[document]), local - int(starts[document])

    def end_document(self) -> int:
        """One past the raw index of the last document: the raw path's next_doc once a finite pass is done."""
        return int(self._shard(len(self.shard_tokens) - 1)[1][1, -1]) + 1


class PretokenizedDataLoader(PackedDataLoader):
    """PackedDataLoader's batches and state, read from a PretokenizedSource instead of tokenized text.

    Inherits the interface (iter, state_dict, load_state_dict, close, global_batch_size) and the
    collation, so padding, positions and document ids are built by the same code. No worker processes:
    a step copies b * (seq_len + 1) tokens.
    """

    def __init__(self, *, source: PretokenizedSource, tokenizer: Any, seq_len: int, local_batch_size: int,
                 dp_rank: int, dp_degree: int, infinite: bool, document_masking: bool) -> None:
        super().__init__(source=source, tokenizer=tokenizer, seq_len=seq_len, local_batch_size=local_batch_size,
                         dp_rank=dp_rank, dp_degree=dp_degree, num_workers=0, infinite=infinite,
                         document_masking=document_masking, block_chars=1)  # fmt: skip
        self.source: PretokenizedSource = source
        self.reads = ReadCounts()
        self.last_read = (0, 0)  # (first stream token, tokens) this rank read for its latest batch

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        super().load_state_dict(state_dict)
        consumed = self._state["sequences_consumed"]
        expected = self._cursor_state(consumed, None)
        if self.infinite and consumed and expected != self._state:
            # sequences_consumed is the position here; the rest should agree unless the data changed.
            logger.warning(f"{self.source.key_prefix}.dataset_path: the checkpoint's position {dict(self._state)} "
                           f"differs from global sequence {consumed} of {self.source.folder} {expected}; "
                           f"continuing at global sequence {consumed}")
            self._start, self._state = dict(expected), dict(expected)

    def _cursor_state(self, consumed: int, end: int | None) -> dict[str, int]:
        offset = consumed * (self.seq_len + 1)
        if end is not None and offset >= end:  # a finite pass is over: where the raw path's cursor stops
            epoch, doc, position = end // self.source.tokens_per_epoch - 1, self.source.end_document(), 0
        else:
            epoch, doc, position = self.source.cursor(offset)
        return {"sequences_consumed": consumed, "next_doc": doc, "doc_token_offset": position, "epoch": epoch}

    def _batches(self, start: dict[str, int]) -> Iterator[dict[str, torch.Tensor]]:
        b, window, per_epoch = self.local_batch_size, self.seq_len + 1, self.source.tokens_per_epoch
        consumed = start["sequences_consumed"]
        # A finite pass, like the raw path's, runs to the end of the epoch it starts in.
        end = None if self.infinite else (consumed * window // per_epoch + 1) * per_epoch
        self._state = dict(start)
        while end is None or consumed * window < end:
            first = (consumed + self.dp_rank * b) * window
            count = b * window if end is None else max(0, min(b * window, end - first))
            tokens, positions = self.source.read(first, count, self.reads)
            self.last_read = (first, count)
            consumed += self.global_batch_size
            self._state = self._cursor_state(consumed, end)
            yield self._collate(len(tokens), [torch.from_numpy(tokens)], [torch.from_numpy(positions)])


def check_tokenizer(source: PretokenizedSource, tokenizer: Any) -> None:
    """The folder must hold the ids the configured tokenizer emits: ids of another vocabulary would train
    silently on garbage (and with more ids than the model's, index past its embedding)."""
    info = source.tokenizer_info
    mine = {"fingerprint": tokenizer_fingerprint(tokenizer), "vocab_size": tokenizer.vocab_size,
            "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id}  # fmt: skip
    if any(info.get(k) != v for k, v in mine.items()):

        def describe(d: dict[str, Any]) -> str:
            return f"{d.get('vocab_size')} tokens, bos {d.get('bos_id')}, eos {d.get('eos_id')}, {d.get('fingerprint')}"

        raise ValueError(f"{source.key_prefix}.dataset_path: {source.folder} was tokenized with another tokenizer "
                         f"({info.get('path')}: {describe(info)}) than model.tokenizer_path gives ({describe(mine)}): "
                         f"pre-tokenize again with this tokenizer, or configure that one")


def build_pretokenized_dataloader(*, source: PretokenizedSource, tokenizer: Any, seq_len: int,
                                  local_batch_size: int, dp_rank: int, dp_degree: int, infinite: bool = True,
                                  document_masking: bool = False) -> PretokenizedDataLoader:
    """build_dataloader for a pre-tokenized source (arguments already checked there)."""
    check_tokenizer(source, tokenizer)
    loader = PretokenizedDataLoader(
        source=source, tokenizer=tokenizer, seq_len=seq_len, local_batch_size=local_batch_size, dp_rank=dp_rank,
        dp_degree=dp_degree, infinite=infinite, document_masking=document_masking,
    )  # fmt: skip
    if infinite and source.tokens_per_epoch < loader.global_batch_size * (seq_len + 1):
        raise ValueError(
            f"{source.key_prefix}.dataset_path: {source.folder} holds only {source.tokens_per_epoch // (seq_len + 1)} "
            f"sequences of training.seq_len + 1 = {seq_len + 1} tokens per epoch, fewer than one global batch (dp "
            f"degree {dp_degree} x training.local_batch_size {local_batch_size})"
        )
    return loader
