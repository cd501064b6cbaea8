"""Document sources: the embedded stdlib corpus, hub datasets, and local json/jsonl/parquet/txt files.

A `DocumentSource` yields `(raw_index, text)` in a fixed order, the same in every process, and can
start at any raw index without reading (let alone tokenizing) the records before it; the dataloader
keeps its resume cursor in raw indexes. Bad records (not a string, empty, whitespace-only) are
skipped and counted but keep their index, so indexes never shift. Sources pickle cheaply: dataloader
workers each get a copy. Every configuration problem is found in `build_document_source`, before
the first step, and reported in one line naming the config key and the file. Local files and hub
datasets are read through HF `datasets` (see `hf_sources.py` for formats and policies).

`python_stdlib` is the Python standard library's own sources and pydoc topics (present on every
machine, so the default config trains without downloads); `python_stdlib_val` is a held-out 2% of it.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import random
import sys
import sysconfig
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torchtitan.data import hf_sources
from torchtitan.data.source import DocumentSource

__all__ = ["DATASETS", "HubDataset", "build_document_source", "corpus_fingerprint",
           "stdlib_module_files"]

# Directory names pruned anywhere under the stdlib root. Test suites are excluded because they are
# full of deliberately odd code (bad encodings, syntax-error fixtures, huge generated literals) and
# would dominate the corpus. site-packages/ holds third-party code that differs per install.
_EXCLUDED_DIR_NAMES = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
# Build-specific generated files differ between builds of one Python version; they would make the
# corpus (and the tokenizer cache key) machine-dependent for no benefit.
_EXCLUDED_DIR_PREFIXES = ("config-",)
_EXCLUDED_FILE_PREFIXES = ("_sysconfigdata_",)
# pydoc_data/topics.py is one dict literal of help topics; its texts are added as separate documents.
_EXCLUDED_REL_PATHS = frozenset({"pydoc_data/topics.py"})
# A constant (not the training seed): the order is part of the dataset's identity.
_SHUFFLE_SEED = 20240917
# 1 in 50 documents (2%) is held out for validation, chosen by a hash of its key, so a document's
# split never depends on which other files this Python ships.
_HELD_OUT_ONE_IN = 50


@dataclass(frozen=True)
class _Source:
    """One document of the stdlib corpus: a source file (path set) or a pydoc topic (topic set)."""

    key: str  # relative path or "pydoc_data/topics:<name>"; stable across machines
    size: int  # bytes on disk, or characters of the topic text
    path: Path | None = None
    topic: str | None = None


def _stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_excluded_dir(name: str) -> bool:
    return name in _EXCLUDED_DIR_NAMES or name.startswith(_EXCLUDED_DIR_PREFIXES)


@functools.lru_cache(maxsize=1)
def _stdlib_sources() -> tuple[_Source, ...]:
    """The whole stdlib corpus (both splits), in its fixed shuffled order (cached per process)."""
    root = _stdlib_root()
    files: list[_Source] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not _is_excluded_dir(d)]  # prune: never walk into them
        for fname in filenames:
            if not fname.endswith(".py") or fname.startswith(_EXCLUDED_FILE_PREFIXES):
                continue
            path = Path(dirpath) / fname
            rel = path.relative_to(root).as_posix()
            if rel in _EXCLUDED_REL_PATHS:
                continue
            try:
                size = path.stat().st_size
            except OSError:
                continue  # dangling symlink or similar: not part of the corpus
            files.append(_Source(key=rel, size=size, path=path))
    files.sort(key=lambda s: s.key)  # os.walk order depends on the filesystem

    from pydoc_data.topics import topics

    topic_sources = [
        _Source(key=f"pydoc_data/topics:{name}", size=len(topics[name]), topic=name) for name in sorted(topics)
    ]
    sources = files + topic_sources
    # Shuffled so early batches (and the tokenizer's training sample) mix packages and prose.
    random.Random(_SHUFFLE_SEED).shuffle(sources)
    return tuple(sources)


def _is_held_out(key: str) -> bool:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % _HELD_OUT_ONE_IN == 0


def _stdlib_split(held_out: bool) -> tuple[_Source, ...]:
    return tuple(s for s in _stdlib_sources() if _is_held_out(s.key) == held_out)


def stdlib_module_files(held_out: bool) -> tuple[_Source, ...]:
    """The .py files of one split of the corpus (no pydoc topics), in its fixed order: torchtitan/data/stdlib_chat.py
    makes its conversations from them, so its held-out modules are the text corpus's held-out ones."""
    return tuple(s for s in _stdlib_split(held_out) if s.path is not None)


class _StdlibSource(DocumentSource):
    def __init__(self, name: str, key_prefix: str, sources: tuple[_Source, ...]) -> None:
        super().__init__(name, key_prefix, len(sources))
        self.sources = sources

    def _iter_raw(self, start: int) -> Iterator[tuple[int, Any]]:
        from pydoc_data.topics import topics

        for index in range(start, len(self.sources)):
            source = self.sources[index]
            if source.topic is not None:
                yield index, topics[source.topic]
                continue
            try:
                yield index, source.path.read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                yield index, None  # an unreadable file counts as a bad record


@dataclass(frozen=True)
class HubDataset:
    """A dataset on the Hugging Face hub, always streamed unless dataset_streaming is "false"."""

    path: str
    config: str | None = None
    split: str | None = None  # None: the dataset_split argument decides
    text_column: str = "text"


DATASETS: dict[str, HubDataset | None] = {
    "python_stdlib": None,  # embedded: the stdlib corpus minus the held-out 2%
    "python_stdlib_val": None,  # embedded: exactly the held-out 2%
    "c4": HubDataset("allenai/c4", "en"),
    "c4_validation": HubDataset("allenai/c4", "en", "validation"),
    "fineweb-edu": HubDataset("HuggingFaceFW/fineweb-edu", "sample-10BT"),
}


def build_document_source(
    *, dataset: str, dataset_path: str, text_column: str = "text", split: str = "train",
    streaming: str = "auto", cache_dir: str | None = None, key_prefix: str = "training",
) -> DocumentSource:  # fmt: skip
    """The source for `<key_prefix>.dataset` / `.dataset_path`, checked down to its first document.

    An empty dataset_path selects the registry entry `dataset`; otherwise dataset_path is a local
    file, folder or glob, or a hub name ("owner/name[:config]"), and `dataset` only labels messages.
    text_column applies to dataset_path data; registry entries know their own column.
    """
    p = key_prefix
    mode = str(streaming).strip().lower()
    if mode not in ("auto", "true", "false"):
        raise ValueError(f"{p}.dataset_streaming: must be auto, true or false, got {streaming!r}")
    if dataset_path and Path(dataset_path).expanduser().is_dir():  # a folder may hold token shards
        from torchtitan.data.pretokenized import open_pretokenized  # here: it imports torch, hub names need not

        if (folder := open_pretokenized(dataset_path, p)) is not None:
            return folder  # written by scripts/pretokenize.py, checked as it is opened
    if dataset_path:
        source = hf_sources.build_path_source(dataset_path, text_column, split, mode, cache_dir, p)
    elif dataset not in DATASETS:
        raise ValueError(f"{p}.dataset: unknown dataset '{dataset}'; known: {', '.join(sorted(DATASETS))}")
    elif (entry := DATASETS[dataset]) is None:
        source = _StdlibSource(dataset, p, _stdlib_split(held_out=dataset.endswith("_val")))
    else:
        source = hf_sources.build_hub_source(dataset, entry.path, entry.config, entry.split or split,
                                             entry.text_column, mode, cache_dir, p, "dataset")  # fmt: skip
    _require_a_document(source, "dataset_path" if dataset_path else "dataset")
    return source


def _require_a_document(source: DocumentSource, key: str) -> None:
    """Fail at build time, not in a worker mid-run, when nothing in the source is usable text."""
    for _ in source.iter_documents(0):
        return
    raise ValueError(f"{source.key_prefix}.{key}: '{source.name}' has no usable documents "
                     f"({source.skipped_documents} records, all empty or not text)")  # fmt: skip


def corpus_fingerprint(name: str) -> str:
    """A short hash of registry dataset `name`'s document list (the tokenizer-cache key).

    Built from document keys and sizes plus the Python version, without reading contents.
    """
    if name not in DATASETS:
        raise ValueError(f"training.dataset: unknown dataset '{name}'; known: {', '.join(sorted(DATASETS))}")
    h = hashlib.sha256()
    h.update(f"{name}\n{sys.implementation.name}-{platform.python_version()}\n".encode())
    if DATASETS[name] is None:
        for source in _stdlib_split(held_out=name.endswith("_val")):
            h.update(f"{source.key}\t{source.size}\n".encode())
    return h.hexdigest()[:12]
