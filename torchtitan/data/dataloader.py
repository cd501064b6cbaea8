"""Packed next-token-prediction batches, sharded across data-parallel ranks by global sequence index.

The corpus is one endless token stream: every document becomes BOS + tokens + EOS, documents are
concatenated (epoch after epoch, in the same order), and the stream is cut into consecutive,
non-overlapping windows of seq_len + 1 tokens. Window k is global sequence k, whatever the
parallelism. The last partial window of an epoch simply continues into the next epoch.

Sharding deals sequences in chunks of local_batch_size: chunk c goes to dp rank c % dp_degree. So
step n of every rank together covers global sequences [n*G, (n+1)*G) with G = dp_degree *
local_batch_size: exactly what one process with batch G reads. Losses therefore match across
parallelism layouts, and a checkpoint's position is a single global cursor that any layout can
resume from.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterableDataset
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.data.datasets import iter_documents
from torchtitan.data.tokenizer import Tokenizer
from torchtitan.tools.logging import logger

__all__ = ["PackedDataLoader", "PackedSequenceDataset", "build_dataloader"]


class _TokenStream:
    """Cuts the endless BOS+doc+EOS stream into windows, tokenizing documents only as needed."""

    def __init__(self, documents: Callable[[], Iterator[str]], tokenizer: Tokenizer, window: int, dataset: str):
        self._documents = documents
        self._tokenizer = tokenizer
        self._window = window
        self._dataset = dataset
        self._docs: Iterator[str] = documents()
        self._docs_this_epoch = 0
        self._buf: list[int] = []
        self._pos = 0  # start of the next window inside _buf
        self.epoch = 0  # epoch of the most recently tokenized document
        self.windows_read = 0  # global index of the next window
        self.log_epochs = True

    def _fill(self) -> None:
        """Tokenize documents until the buffer holds a full window past _pos."""
        while len(self._buf) - self._pos < self._window:
            doc = next(self._docs, None)
            if doc is None:
                if self._docs_this_epoch == 0:
                    raise ValueError(f"training.dataset '{self._dataset}': the corpus has no documents")
                self.epoch += 1
                self._docs_this_epoch = 0
                self._docs = self._documents()
                if self.log_epochs:
                    logger.info(f"training.dataset '{self._dataset}': epoch {self.epoch}")
                continue
            self._docs_this_epoch += 1
            if self._pos:
                # Drop consumed tokens before growing the buffer, so it stays about one document
                # plus one window long instead of growing with the whole epoch.
                del self._buf[: self._pos]
                self._pos = 0
            self._buf.extend(self._tokenizer.encode(doc))

    def take(self) -> list[int]:
        self._fill()
        window = self._buf[self._pos : self._pos + self._window]
        self._pos += self._window
        self.windows_read += 1
        return window

    def skip(self, n: int) -> None:
        # Another rank's sequences (or the already-consumed prefix on resume): the tokens still have
        # to be produced to know where later windows start, but no tensors are built.
        for _ in range(n):
            self._fill()
            self._pos += self._window
            self.windows_read += 1


class PackedSequenceDataset(IterableDataset):
    """Yields this dp rank's `(input_ids, labels)` pairs (int64, [seq_len] each) from a packed stream.

    Position is a global cursor: `sequences_consumed` counts global sequences (all ranks) delivered
    in complete steps, so it is the same on every rank and a multiple of dp_degree *
    local_batch_size at step boundaries. Iterating starts at the cursor; a new iterator after
    load_state_dict resumes there, for any dp_degree.
    """

    def __init__(
        self,
        dataset: str,
        tokenizer: Tokenizer,
        seq_len: int,
        local_batch_size: int,
        dp_rank: int = 0,
        dp_degree: int = 1,
        documents: Callable[[], Iterator[str]] | None = None,
    ):
        if seq_len < 1:
            raise ValueError(f"training.seq_len must be >= 1, got {seq_len}")
        if local_batch_size < 1:
            raise ValueError(f"training.local_batch_size must be >= 1, got {local_batch_size}")
        if dp_degree < 1 or not 0 <= dp_rank < dp_degree:
            raise ValueError(f"data parallel: dp_rank {dp_rank} is not in [0, dp_degree={dp_degree})")
        if documents is None:
            iter_documents(dataset)  # fail fast on an unknown name, before any iteration
            documents = lambda: iter_documents(dataset)  # noqa: E731
        self.dataset = dataset
        self.tokenizer = tokenizer
        self.seq_len = seq_len
        self.local_batch_size = local_batch_size
        self.dp_rank = dp_rank
        self.dp_degree = dp_degree
        self._documents = documents
        self._sequences_consumed = 0
        self._epoch = 0
        self._checked = False

    @property
    def global_batch_size(self) -> int:
        return self.dp_degree * self.local_batch_size

    def check_epoch_size(self) -> None:
        """Raise unless one epoch holds at least one global batch of sequences.

        Otherwise a step would wrap the corpus, repeating sequences within one global batch.
        Tokenizes only the first global batch's worth of the corpus, once.
        """
        if self._checked:
            return
        need = self.global_batch_size * (self.seq_len + 1)
        tokens = 0
        for doc in self._documents():
            tokens += len(self.tokenizer.encode(doc))
            if tokens >= need:
                self._checked = True
                return
        raise ValueError(
            f"training.dataset '{self.dataset}' holds only {tokens // (self.seq_len + 1)} sequences of "
            f"training.seq_len + 1 = {self.seq_len + 1} tokens per epoch, fewer than one global batch "
            f"(dp_degree {self.dp_degree} x training.local_batch_size {self.local_batch_size}); "
            f"use a smaller training.seq_len or training.local_batch_size"
        )

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        self.check_epoch_size()
        b, g = self.local_batch_size, self.global_batch_size
        # Chunks are dealt relative to where this iteration starts, so resuming from a cursor that
        # is not a multiple of the new global batch (dp_degree changed) still gives every step a
        # contiguous block of G global sequences.
        base = self._sequences_consumed
        stream = _TokenStream(self._documents, self.tokenizer, self.seq_len + 1, self.dataset)
        # Exact but simple: every rank tokenizes the whole stream and discards other ranks' windows,
        # and resuming re-tokenizes the consumed prefix. (A later issue optimises both.)
        stream.log_epochs = False
        stream.skip(base)
        stream.log_epochs = True
        if base and stream.epoch != self._epoch:
            logger.warning(
                f"training.dataset '{self.dataset}': resumed at sequence {base} in epoch {stream.epoch}, but the "
                f"checkpoint says epoch {self._epoch}; the corpus or tokenizer changed since it was written"
            )
        step = 0
        while True:
            step_start = base + step * g
            stream.skip(step_start + self.dp_rank * b - stream.windows_read)
            chunk = [stream.take() for _ in range(b)]
            # Read to the end of the global step now, so every rank has seen the same windows and
            # so reports the same epoch in its state.
            stream.skip(step_start + g - stream.windows_read)
            for i, window in enumerate(chunk):
                if i == b - 1:
                    # Advance before the last yield: once the dataloader has the last sample of the
                    # batch, the step's sequences count as delivered.
                    self._sequences_consumed = step_start + g
                    self._epoch = stream.epoch
                tokens = torch.tensor(window, dtype=torch.int64)
                yield tokens[:-1], tokens[1:]
            step += 1

    def state_dict(self) -> dict[str, int]:
        return {"sequences_consumed": self._sequences_consumed, "epoch": self._epoch}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        try:
            consumed, epoch = state_dict["sequences_consumed"], state_dict["epoch"]
        except (KeyError, TypeError):
            raise ValueError(
                f"dataloader state: expected {{'sequences_consumed': int, 'epoch': int}}, got {state_dict!r}"
            ) from None
        if not (isinstance(consumed, int) and isinstance(epoch, int) and consumed >= 0 and epoch >= 0):
            raise ValueError(f"dataloader state: sequences_consumed and epoch must be ints >= 0, got {state_dict!r}")
        if consumed % self.global_batch_size:
            logger.warning(
                f"training.dataset '{self.dataset}': resuming at sequence {consumed}, not a multiple of the global "
                f"batch {self.global_batch_size}; steps continue from there in blocks of {self.global_batch_size}"
            )
        self._sequences_consumed = consumed
        self._epoch = epoch


class PackedDataLoader(StatefulDataLoader):
    """StatefulDataLoader (num_workers=0) whose state is the dataset's plain global cursor.

    The stock StatefulDataLoader state nests sampler/fetcher bookkeeping around the dataset state;
    for a packed stream the cursor alone determines the position, and keeping it as plain data
    lets a checkpoint written with one dp_degree be loaded with another.
    """

    dataset: PackedSequenceDataset

    def __init__(self, dataset: PackedSequenceDataset):
        # torchdata 0.11 calls torch.set_vital, which newer torch deprecates with a warning on
        # every construction; it is harmless, so silence just that message.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*set_vital.*", category=UserWarning)
            super().__init__(dataset, batch_size=dataset.local_batch_size, num_workers=0)

    def state_dict(self) -> dict[str, int]:
        return self.dataset.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.dataset.load_state_dict(state_dict)
        # Drop any live iterator: the next iter() starts a fresh stream at the loaded cursor.
        self._iterator = None
        self.next_iter_state = None
        self._initial_iter_for_state_dict = False


def build_dataloader(
    *,
    dataset: str,
    tokenizer: Tokenizer,
    seq_len: int,
    local_batch_size: int,
    dp_rank: int,
    dp_degree: int,
    documents: Callable[[], Iterator[str]] | None = None,
) -> PackedDataLoader:
    """Batches of `(input_ids, labels)`, each int64 `[local_batch_size, seq_len]`, for this dp rank.

    `documents` replaces the named dataset's document source (tests inject small corpora).
    Raises ValueError now if one epoch holds fewer than dp_degree * local_batch_size sequences.
    """
    ds = PackedSequenceDataset(
        dataset,
        tokenizer,
        seq_len=seq_len,
        local_batch_size=local_batch_size,
        dp_rank=dp_rank,
        dp_degree=dp_degree,
        documents=documents,
    )
    ds.check_epoch_size()
    return PackedDataLoader(ds)
