"""The base of every document source: a fixed, resumable sequence of raw records (see datasets.py).

In a module of its own so that the sources (datasets.py, hf_sources.py) and the dataloader import it one way.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torchtitan.tools.logging import logger

__all__ = ["DocumentSource"]

_SKIP_LOG_EVERY = 100_000


class DocumentSource:
    """A deterministic sequence of raw records; `iter_documents` yields the usable ones with their index."""

    def __init__(self, name: str, key_prefix: str, num_documents: int | None) -> None:
        self.name = name  # for messages: the registry name or the dataset_path
        self.key_prefix = key_prefix
        self.num_documents = num_documents  # raw records, bad ones included; None when unknown
        self.skipped_documents = 0  # bad records met so far in the current (or last) pass
        self._reported = False

    def iter_documents(self, start: int = 0) -> Iterator[tuple[int, str]]:
        """(raw_index, text) for every usable record from raw index `start` on, in the fixed order."""
        if start < 0:
            raise ValueError(f"{self.key_prefix}.dataset '{self.name}': start must be >= 0, got {start}")
        self.skipped_documents = 0
        for index, value in self._iter_raw(start):
            # isspace() instead of strip(): no copy of a possibly huge document.
            if isinstance(value, str) and value and not value.isspace():
                yield index, value
                continue
            self.skipped_documents += 1
            if self.skipped_documents % _SKIP_LOG_EVERY == 0:
                logger.info(f"{self._label()}: skipped {self.skipped_documents} records so far (at {index})")
        if self.skipped_documents and not self._reported:
            self._reported = True  # once per process, not every epoch
            logger.info(f"{self._label()}: skipped {self.skipped_documents} empty or non-text records "
                        f"(of records {start} onwards); their indexes stay reserved")  # fmt: skip

    def own_loader(self, **loader_args: Any) -> Any:
        """A loader this source builds itself (a pre-tokenized folder reads its windows by index), or None: the
        dataloader then packs iter_documents (torchtitan/data/dataloader.py, which calls this with its arguments)."""
        return None

    def _label(self) -> str:
        return f"{self.key_prefix}.dataset '{self.name}'"

    def _iter_raw(self, start: int) -> Iterator[tuple[int, Any]]:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, num_documents={self.num_documents})"
