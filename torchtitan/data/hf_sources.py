"""Document sources read through HF `datasets`: local json/jsonl/parquet/txt files and hub datasets.

Local data (`dataset_path`: a file, folder or glob). The format comes from the extension: .json/.jsonl,
.parquet, .txt/.text (json and txt may be .gz-compressed). A folder contributes its supported files,
recursively, in sorted order, hidden ones skipped and other types ignored; a glob or file of another
type is an error; one format per dataset. Local files form the 'train' split.

- A .txt file is one document: files are natural units (a book, an article, a source file). If any
  .txt file exceeds 64 MiB, every file is read as blank-line-separated paragraphs instead, so that
  no single record must sit in memory whole and resuming stays fine-grained.
- Invalid UTF-8 is an error naming the file (and byte offset, or parquet rows): a silently damaged
  corpus is worse than a failed start, and neither the json nor the parquet reader checks it (the
  bad text would only fail when a worker converts it, mid-run). So every file is checked when the
  source is built, once per file version: the result is remembered under `cache_dir`.
- Streaming: "true", or "auto" when the files total more than 1 GB; otherwise a map-style load
  cached (as Arrow) under `cache_dir`, where skipping to any record is O(1).

Hub data: a `dataset_path` that names no local file and looks like "name" or "owner/name", with an
optional ":config", or a registry entry; streamed unless dataset_streaming is "false". Set
HF_HUB_OFFLINE=1 on machines without network: the hub client otherwise retries for ~24 s.
"""

from __future__ import annotations

import codecs
import glob
import gzip
import hashlib
import os
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torchtitan.data.source import DocumentSource
from torchtitan.tools.logging import logger

__all__ = ["build_hub_source", "build_path_source", "open_hub_dataset", "open_path_dataset"]

_STREAM_AUTO_BYTES = 1_000_000_000
_TXT_DOCUMENT_MAX_BYTES = 64 << 20
_BATCH = 1024  # records converted from Arrow per call: amortises the per-call cost (~1M docs/s)
_FORMATS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".txt": "text", ".text": "text"}
_HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?(:[\w.-]+)?")


def _one_line(err: BaseException) -> str:
    """The error as one line: multi-line messages (schema dumps, say) are joined and cut at 300 characters."""
    text = " ".join(str(err).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


class _HFSource(DocumentSource):
    """A `datasets.Dataset` (map-style: skips by index) or `IterableDataset` (streamed: `skip`).

    Both pickle small: a map-style dataset by the paths of its memory-mapped Arrow cache files, a
    stream by its file list and options.
    """

    def __init__(self, name: str, key_prefix: str, dataset: Any, column: str, streaming: bool) -> None:
        super().__init__(name, key_prefix, None if streaming else len(dataset))
        self.dataset = dataset.select_columns([column])  # only the text column is ever converted
        self.column = column
        self.streaming = streaming
        if streaming:
            try:  # the hub's metadata often knows the size of a split; local streams do not
                self.num_documents = dataset.info.splits[dataset.split].num_examples or None
            except (AttributeError, KeyError, TypeError):
                pass

    def _iter_raw(self, start: int) -> Iterator[tuple[int, Any]]:
        index = start
        try:
            if not self.streaming:
                for index in range(start, len(self.dataset), _BATCH):
                    yield from enumerate(self.dataset[index : index + _BATCH][self.column], index)
                return
            # skip() still reads the records before `start`, but nothing is tokenized on the way.
            stream = self.dataset.skip(start) if start else self.dataset
            for batch in stream.iter(batch_size=_BATCH):
                for value in batch[self.column]:
                    yield index, value
                    index += 1
        except (OSError, ValueError, ImportError) as e:  # files changed since the check, connection lost
            raise ValueError(f"{self.key_prefix}.dataset_path: reading '{self.name}' failed near record "
                             f"{index}: {_one_line(e)}") from None  # fmt: skip


def build_path_source(
    dataset_path: str, column: str, split: str, mode: str, cache_dir: str | None, p: str
) -> DocumentSource:
    """The source for `<p>.dataset_path`; mode is auto | true | false (already validated)."""
    opened = open_path_dataset(dataset_path, column, split, mode, cache_dir, p)
    if opened is None:  # not on this machine: a hub dataset
        name, _, config = dataset_path.partition(":")
        return build_hub_source(dataset_path, name, config or None, split, column, mode, cache_dir, p, "dataset_path")
    ds, streamed, where = opened
    return _checked(dataset_path, p, "dataset_path", ds, column, streamed, where)


def open_path_dataset(
    dataset_path: str, column: str | None, split: str, mode: str, cache_dir: str | None, p: str
) -> tuple[Any, bool, str] | None:
    """(datasets object, streamed, where for messages) of local data, checked file by file; None for a hub name.
    column: the text column a parquet file must hold (None: every column is checked, as chat data has several)."""
    files = _resolve_local(dataset_path, p)
    if files is None:
        return None
    if split != "train":
        raise ValueError(f"{p}.dataset_split: local files have only the 'train' split, got '{split}' "
                         f"(point {p}.dataset_path at the files of that split instead)")  # fmt: skip
    by_kind = {_FORMATS[_plain_suffix(f)]: f.name for f in files}
    if len(by_kind) > 1:
        raise ValueError(f"{p}.dataset_path: {dataset_path} mixes formats "
                         f"({', '.join(f'{k}: {v}' for k, v in sorted(by_kind.items()))}); use one")  # fmt: skip
    builder = next(iter(by_kind))
    sizes = [f.stat().st_size for f in files]
    if not any(sizes):
        raise ValueError(f"{p}.dataset_path: '{dataset_path}' has no usable documents (its files are empty)")
    if not all(sizes):  # the readers fail on empty files, which hold no records anyway
        logger.info(f"{p}.dataset_path: skipping {sizes.count(0)} empty files in {dataset_path}")
        files, sizes = [f for f, s in zip(files, sizes, strict=True) if s], [s for s in sizes if s]
    streamed = mode == "true" or (mode == "auto" and sum(sizes) > _STREAM_AUTO_BYTES)
    options: dict[str, Any] = {}
    if builder == "text":
        big = [f for f, size in zip(files, sizes, strict=True) if size > _TXT_DOCUMENT_MAX_BYTES]
        options["sample_by"] = "paragraph" if big else "document"
        if big:
            logger.info(f"{p}.dataset_path: {big[0]} is over 64 MiB: reading every .txt file as paragraphs")
    _check_files(files, builder, column, cache_dir, p)
    logger.info(f"{p}.dataset_path: {len(files)} {builder} file(s), {sum(sizes) / 1e6:.1f} MB, "
                f"{'streamed' if streamed else 'map-style'}")  # fmt: skip
    import datasets

    datasets.disable_progress_bars()  # one bar per rank per load is noise in training logs
    try:
        ds = datasets.load_dataset(builder, data_files={"train": [str(f) for f in files]}, split="train",
                                   streaming=streamed, cache_dir=cache_dir, **options)  # fmt: skip
    except Exception as e:
        cause: BaseException = e
        while cause.__cause__ or cause.__context__:  # datasets wraps the real error
            cause = cause.__cause__ or cause.__context__
        raise ValueError(f"{p}.dataset_path: cannot load {dataset_path}: {_one_line(cause)}") from None
    return ds, streamed, str(files[0]) if len(files) == 1 else dataset_path


def build_hub_source(
    name: str, path: str, config: str | None, split: str, column: str, mode: str, cache_dir: str | None,
    p: str, key: str,
) -> DocumentSource:  # fmt: skip
    """A hub dataset, streamed unless mode is "false"; `key` is the config key that named it."""
    ds, streamed, where = open_hub_dataset(name, path, config, split, mode, cache_dir, p, key)
    return _checked(name, p, key, ds, column, streamed, where)


def open_hub_dataset(
    name: str, path: str, config: str | None, split: str, mode: str, cache_dir: str | None, p: str, key: str,
) -> tuple[Any, bool, str]:  # fmt: skip
    """(datasets object, streamed, where for messages) of a hub dataset, streamed unless mode is "false"."""
    import datasets

    datasets.disable_progress_bars()
    streamed = mode != "false"
    where = f"hub dataset {path}" + (f" (config {config})" if config else "") + f" split '{split}'"
    try:
        ds = datasets.load_dataset(path, name=config, split=split, streaming=streamed, cache_dir=cache_dir)
    except Exception as e:
        local = f"no local file or folder '{name}'; " if key == "dataset_path" else ""
        raise ValueError(f"{p}.{key}: {local}cannot open {where}: {_one_line(e)} "
                         f"(offline? point {p}.dataset_path at local files)") from None  # fmt: skip
    return ds, streamed, where


def _plain_suffix(path: Path) -> str:
    """The format suffix, looking through a .gz (only json and text are read compressed)."""
    suffixes = [s.lower() for s in path.suffixes]
    if len(suffixes) >= 2 and suffixes[-1] == ".gz" and _FORMATS.get(suffixes[-2]) in ("json", "text"):
        return suffixes[-2]
    return suffixes[-1] if suffixes else ""


def is_local_path(dataset_path: str, p: str) -> bool:
    """Whether `<p>.dataset_path` names data on this machine (False: a hub name); raises as _resolve_local does
    for a path that is neither."""
    return _resolve_local(dataset_path, p) is not None


def _resolve_local(dataset_path: str, p: str) -> list[Path] | None:
    """The data files of a file, folder or glob; None if nothing local matches but it looks like a hub name."""
    expanded = os.path.expanduser(dataset_path)
    if any(c in expanded for c in "*?["):  # a glob pattern
        files = sorted(Path(f) for f in glob.glob(expanded, recursive=True) if os.path.isfile(f))
        if not files:
            raise FileNotFoundError(f"{p}.dataset_path: no files match {dataset_path}")
    elif os.path.isdir(expanded):
        root, files, others = Path(expanded), [], 0
        for dirpath, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if not d.startswith(".")]
            for fname in filenames:
                if fname.startswith("."):
                    continue
                if _plain_suffix(Path(fname)) in _FORMATS:
                    files.append(Path(dirpath) / fname)
                else:
                    others += 1
        files.sort(key=lambda f: f.relative_to(root).as_posix())  # os.walk order is filesystem-dependent
        if not files:
            raise FileNotFoundError(f"{p}.dataset_path: no .json/.jsonl/.parquet/.txt/.text files in {dataset_path}")
        if others:
            logger.info(f"{p}.dataset_path: ignoring {others} files of other types in {dataset_path}")
    elif os.path.isfile(expanded):
        files = [Path(expanded)]
    elif _HUB_NAME.fullmatch(dataset_path) and _plain_suffix(Path(dataset_path)) not in _FORMATS:
        return None
    else:
        raise FileNotFoundError(f"{p}.dataset_path: no such file or directory: {dataset_path}")
    for f in files:
        if _plain_suffix(f) not in _FORMATS:
            raise ValueError(f"{p}.dataset_path: {f}: unsupported file type (supported: .json, .jsonl, "
                             ".parquet, .txt, .text; json and txt may be .gz)")  # fmt: skip
    return files


def _check_parquet(f: Path, column: str | None, p: str) -> None:
    """The footer (a corrupt file, a missing column), then the text column's UTF-8 (every column's: None), in
    Arrow (C++)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(f)
        names = parquet.schema_arrow.names
    except (OSError, pa.ArrowException) as e:
        raise ValueError(f"{p}.dataset_path: {f} is not a readable parquet file: {_one_line(e)}") from None
    if column is not None and column not in names:
        raise ValueError(f"{p}.dataset_text_column: no column '{column}' in {f}; columns: {', '.join(names)}")
    row = 0
    try:
        for batch in parquet.iter_batches(batch_size=65536, columns=None if column is None else [column]):
            batch.validate(full=True)  # full: includes UTF-8 of string data
            row += batch.num_rows
    except (OSError, pa.ArrowException) as e:
        what = "is not valid UTF-8" if "UTF8" in str(e) else "is not readable"
        which = f" column '{column}'" if column is not None else ""
        raise ValueError(f"{p}.dataset_path: {f}{which} {what} (rows {row}-{row + 65535}): "
                         f"{_one_line(e)}") from None  # fmt: skip


def _invalid_utf8_offset(path: Path) -> int | None:
    """Byte offset of the first invalid UTF-8 in `path` (decompressed if .gz), or None if it is clean."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0
    with (gzip.open if path.suffix.lower() == ".gz" else open)(path, "rb") as f:
        while True:
            chunk = f.read(16 << 20)
            try:
                decoder.decode(chunk, final=not chunk)
            except UnicodeDecodeError as e:
                held = len(e.object) - len(chunk)  # bytes the decoder carried over from the last chunk
                return offset - held + e.start
            if not chunk:
                return None
            offset += len(chunk)


def _check_files(files: list[Path], builder: str, column: str, cache_dir: str | None, p: str) -> None:
    """Each file is readable and valid UTF-8: checked once per file version, remembered under cache_dir."""
    marks = Path(cache_dir) / "checked_files" if cache_dir else None
    start, checked = time.perf_counter(), 0
    for f in files:
        st = f.stat()
        what = f"{f.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{builder}\0{column if builder == 'parquet' else ''}"
        mark = marks / hashlib.sha256(what.encode()).hexdigest()[:32] if marks else None
        if mark is not None and mark.is_file():
            continue
        if builder == "parquet":
            _check_parquet(f, column, p)
        else:
            try:
                offset = _invalid_utf8_offset(f)
            except (OSError, EOFError) as e:  # unreadable, or a damaged .gz
                raise ValueError(f"{p}.dataset_path: cannot read {f}: {_one_line(e)}") from None
            if offset is not None:
                raise ValueError(f"{p}.dataset_path: {f} is not valid UTF-8 (byte {offset})")
        checked += st.st_size
        if mark is not None:
            mark.parent.mkdir(parents=True, exist_ok=True)
            mark.touch()
    if checked:
        logger.info(f"{p}.dataset_path: checked {checked / 1e6:.1f} MB in {time.perf_counter() - start:.1f}s")


def _checked(name: str, p: str, key: str, ds: Any, column: str, streamed: bool, where: str) -> _HFSource:
    """The text column exists and holds strings (named with the columns that do exist)."""
    columns = ds.column_names
    if columns is None:  # a stream whose schema is unknown until read: look at the first record
        try:
            columns = list(next(iter(ds)).keys())
        except StopIteration:
            raise ValueError(f"{p}.{key}: {where} has no records") from None
        except Exception as e:
            raise ValueError(f"{p}.{key}: cannot read {where}: {_one_line(e)}") from None
    if column not in columns:
        raise ValueError(f"{p}.dataset_text_column: no column '{column}' in {where}; columns: {', '.join(columns)}")
    feature = (ds.features or {}).get(column)  # None: not known before reading (some streams)
    kind = getattr(feature, "dtype", type(feature).__name__)
    if feature is not None and kind not in ("string", "large_string", "string_view"):
        raise ValueError(f"{p}.dataset_text_column: column '{column}' in {where} holds {kind}, not text")
    return _HFSource(name, p, ds, column, streamed)
