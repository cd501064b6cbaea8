"""Packed next-token-prediction batches, sharded across data-parallel ranks by global sequence index.

Documents become BOS + tokens + EOS, concatenated epoch after epoch in a fixed order, cut into
non-overlapping windows of seq_len + 1 tokens: window k is global sequence k in every layout. Chunks
of local_batch_size windows go round-robin to the dp ranks, so step n of all ranks covers global
sequences [n*G, (n+1)*G), G = dp_degree * local_batch_size: what one process with batch G reads.

Tokenizing runs in `num_workers` processes: worker w tokenizes only the blocks of consecutive
documents at stream positions = w mod num_workers. torch's DataLoader returns an IterableDataset's
items round-robin in worker order, so this process receives blocks in stream order and packs,
windows and deals them itself: batches are identical for any num_workers.

The position is a global cursor of plain ints, equal on every rank at step boundaries:
sequences_consumed (global windows delivered) and where the next window starts: epoch, next_doc (raw
document index) and doc_token_offset (tokens of that document's BOS..EOS list already consumed).
Resuming restarts the source at next_doc (the consumed prefix is never re-tokenized) and deals steps
from the cursor, so any dp_degree continues at the next global sequence.
"""

from __future__ import annotations

import array
import math
import multiprocessing.forkserver
import os
import pickle
import sys
import threading
import warnings
from collections import deque
from collections.abc import Iterator, Mapping
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

import torch
from torch.utils.data import IterableDataset, get_worker_info
from torchdata.stateful_dataloader import StatefulDataLoader

from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.tools.logging import logger

if TYPE_CHECKING:
    from torchtitan.data.source import DocumentSource
    from torchtitan.data.tokenizer_base import BaseTokenizer

__all__ = ["STATE_KEYS", "PackedDataLoader", "build_dataloader", "document_ids_from_positions"]

STATE_KEYS = ("sequences_consumed", "next_doc", "doc_token_offset", "epoch")
# ~8K tokens of code per block: ~10 ms of BPE work, so one pickled message per block costs <1%.
DEFAULT_BLOCK_CHARS = 32_768
# A pass starts with small blocks that double up to block_chars: the first batch waits for one ~4K-character block,
# not 32K (and a validation pass re-reads from the start at each evaluation). Blocks end at document boundaries and
# every document is encoded alone, so block sizes change which worker encodes what, never the tokens.
FIRST_BLOCK_CHARS = 4_096
# forkserver: workers start from a clean server process, not from the trainer, which by the time a
# dataloader (or the validator's) first iterates has run multi-threaded OpenMP work (forking after it
# deadlocks children, see docs/architecture.md, 'CPU and gloo pitfalls') and holds gloo/NCCL threads
# (Python >= 3.12 warns on such forks).
# With torch preloaded into the server a worker starts in ~0.1 s; spawn costs ~3 s on every start.
_MP_CONTEXT = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"

_Block = tuple[int, int, list[int], list[int], array.array]  # position, epoch, doc indices, lengths, int32 tokens


def _iter_blocks(source: DocumentSource, tokenizer: BaseTokenizer, epoch: int, start_doc: int, infinite: bool,
                 block_chars: int, worker: int, num_workers: int) -> Iterator[_Block]:
    """Tokenized blocks in stream order from (epoch, start_doc), only those of `worker`.

    Every worker reads every document's text (cheap) so that all agree where blocks begin; only
    its own blocks are tokenized. Block positions count on across epochs, so a corpus with fewer
    blocks than workers still keeps every worker busy in infinite mode.
    """
    position, first = 0, start_doc
    while True:
        epoch_start, block, chars = position, [], 0
        for index, text in source.iter_documents(first):
            block.append((index, text))
            chars += len(text)
            if chars >= min(block_chars, FIRST_BLOCK_CHARS << min(position, 16)):
                if position % num_workers == worker:
                    yield _encode_block(tokenizer, position, epoch, block)
                position, block, chars = position + 1, [], 0
        if block:  # blocks close at the end of an epoch, so every block belongs to one epoch
            if position % num_workers == worker:
                yield _encode_block(tokenizer, position, epoch, block)
            position += 1
        if not infinite:
            return
        if position == epoch_start and first == 0:
            raise ValueError(f"{_label(source)}: the corpus has no documents")
        epoch, first = epoch + 1, 0


def _encode_block(tokenizer: BaseTokenizer, position: int, epoch: int, block: list[tuple[int, str]]) -> _Block:
    tokens, lengths = array.array("i"), []
    for _, text in block:
        ids = tokenizer.encode(text, add_bos=True, add_eos=True)
        tokens.extend(ids)
        lengths.append(len(ids))
    return position, epoch, [index for index, _ in block], lengths, tokens


class _BlockDataset(IterableDataset):
    """What a worker process runs: its share of the tokenized blocks, in stream order."""

    def __init__(self, *args: Any) -> None:
        self.args = args  # _iter_blocks's arguments from source to block_chars

    def __iter__(self) -> Iterator[_Block]:
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return _iter_blocks(*self.args, worker, num_workers)


def _check_pickles(source: DocumentSource, tokenizer: BaseTokenizer) -> None:
    """Workers get pickled copies of source and tokenizer; the copy must encode exactly like the original,
    or batches would depend on num_workers (a pickled HF tokenizer forgets encode_special_tokens)."""
    decode = getattr(tokenizer, "decode", None)
    specials = decode([tokenizer.bos_id, tokenizer.eos_id]) if decode is not None else ""
    probe = f"def f(x):\n\treturn x  # naïve café 🦙 {specials} <s></s> <|endoftext|>"
    for key, obj in ((_label(source), source), ("model.tokenizer_path", tokenizer)):
        try:
            copy = pickle.loads(pickle.dumps(obj))
        except Exception as e:
            raise ValueError(f"{key}: {type(obj).__name__} cannot be pickled for dataloader workers: {e}") from None
    if copy.encode(probe) != tokenizer.encode(probe):
        raise ValueError("model.tokenizer_path: the tokenizer encodes differently once pickled into a dataloader "
                         "worker (fix its pickling, or set training.num_workers = 0)")


def _label(source: DocumentSource) -> str:
    # Validation sources carry key_prefix "validation", so messages name the right config key.
    return f"{getattr(source, 'key_prefix', 'training')}.dataset '{source.name}'"


def _worker_init(worker_id: int) -> None:
    # Tokenizing needs no intra-op threads; one thread per worker leaves the cores to the workers.
    torch.set_num_threads(1)
    threading.Thread(target=_exit_when_closed, args=(get_worker_info().dataset.owner,), daemon=True).start()


def _exit_when_closed(owner: Connection) -> None:
    # A forkserver worker's parent is the server, so torch's parent check never sees the trainer die (and
    # its os._exit skips multiprocessing's cleanup): workers, and the server with them, would live on.
    try:
        owner.recv()  # nothing is ever sent: returns (EOFError) once the loader or its process is gone
    finally:
        os._exit(0)


def _identity(item: Any) -> Any:
    # Blocks cross the process boundary as they are (the default would turn arrays into lists).
    return item


class _Stream:
    """The training process's view of the token stream: a queue of tokenized documents and a cursor."""

    def __init__(self, blocks: Iterator[_Block], label: str, epoch: int, doc: int, offset: int):
        self._blocks, self._label = blocks, label
        self._docs: deque[list[Any]] = deque()  # [epoch, raw index, int32 tokens, tokens consumed]
        self._resume: tuple[int, int, int] | None = (epoch, doc, offset)
        self._next_position, self._logged_epoch, self.exhausted = 0, epoch, False
        self._end = (epoch, doc, 0)  # the cursor once the stream is exhausted (finite mode)

    def _pull(self) -> bool:
        item = None if self.exhausted else next(self._blocks, None)
        if item is None:
            self.exhausted = True
            return False
        position, epoch, indices, lengths, tokens = item
        if position != self._next_position:  # the round-robin order is what makes any num_workers exact
            raise RuntimeError(f"dataloader: received block {position}, expected {self._next_position}")
        self._next_position += 1
        if epoch > self._logged_epoch:
            self._logged_epoch = epoch
            logger.info(f"{self._label}: epoch {epoch}")
        flat = torch.frombuffer(tokens, dtype=torch.int32) if len(tokens) else torch.empty(0, dtype=torch.int32)
        start = 0
        for index, n in zip(indices, lengths, strict=True):
            consumed = self._resume_offset(epoch, index, n) if self._resume is not None else 0
            if consumed < n:
                self._docs.append([epoch, index, flat[start : start + n], consumed])
            start += n
            self._end = (epoch, index + 1, 0)
        return True

    def _resume_offset(self, epoch: int, index: int, n: int) -> int:
        """Tokens of the first document after a resume that earlier steps already consumed."""
        want_epoch, want_doc, offset = self._resume  # type: ignore[misc]
        self._resume, found = None, (epoch, index) == (want_epoch, want_doc)
        if offset and (not found or offset > n):
            logger.warning(f"{self._label}: the checkpoint resumes at token {offset} of document {want_doc}, but "
                           f"that is gone: the corpus or tokenizer changed; continuing at the next document")
            return n if found else 0
        return offset

    def cursor(self) -> tuple[int, int, int]:
        """(epoch, raw document index, token offset) of the next unread token; reads one block ahead if needed."""
        while not self._docs and self._pull():
            pass
        if self._docs:
            epoch, index, _, consumed = self._docs[0]
            return epoch, index, consumed
        return self._end

    def at_end(self) -> bool:
        self.cursor()
        return not self._docs

    def read(self, n: int, keep: bool) -> tuple[int, list[torch.Tensor], list[torch.Tensor]]:
        """Consume up to n tokens; with keep, also return them and their in-document positions."""
        got, tokens, positions = 0, [], []
        while got < n and (self._docs or self._pull()):
            _, _, ids, consumed = doc = self._docs[0]
            k = min(n - got, len(ids) - consumed)
            if keep:
                tokens.append(ids[consumed : consumed + k])
                positions.append(torch.arange(consumed, consumed + k, dtype=torch.int64))
            got += k
            if consumed + k == len(ids):
                self._docs.popleft()
            else:
                doc[3] = consumed + k
        return got, tokens, positions


def _check_state(state: Any) -> dict[str, int]:
    missing = [k for k in STATE_KEYS if k not in state] if isinstance(state, Mapping) else list(STATE_KEYS)
    if missing:
        raise ValueError(f"dataloader state: missing keys {', '.join(missing)} in {state!r}")
    bad = [k for k in STATE_KEYS if isinstance(state[k], bool) or not isinstance(state[k], int) or state[k] < 0]
    if bad:
        raise ValueError(f"dataloader state: {', '.join(bad)} must be ints >= 0, got {dict(state)!r}")
    return {k: int(state[k]) for k in STATE_KEYS}


class PackedDataLoader:
    """This dp rank's batches; iterable, with a plain-int `state_dict()` / `load_state_dict()`.

    Infinite mode: `iter()` continues from the current cursor (so a new iterator after
    load_state_dict resumes there). Finite mode (one pass, for validation): every `iter()` is a
    fresh pass from the most recently loaded state (the start by default); a single iterator should
    be active at a time. The authoritative state lives here, in the training process, not in the
    workers: it must describe exactly the batches already yielded, and workers run ahead of those.
    """

    def __init__(self, *, source: DocumentSource, tokenizer: BaseTokenizer, seq_len: int, local_batch_size: int,
                 dp_rank: int, dp_degree: int, num_workers: int, infinite: bool, document_masking: bool,
                 block_chars: int):
        self.source, self.tokenizer, self.seq_len, self.local_batch_size = source, tokenizer, seq_len, local_batch_size
        self.dp_rank, self.dp_degree, self.num_workers, self.block_chars = dp_rank, dp_degree, num_workers, block_chars
        self.infinite, self.document_masking = infinite, document_masking
        self.global_batch_size = dp_degree * local_batch_size
        self._start: dict[str, int] = dict.fromkeys(STATE_KEYS, 0)  # where the next (finite: every) pass starts
        self._state: dict[str, int] = dict(self._start)
        self._pool: tuple[tuple[int, int], StatefulDataLoader, Connection] | None = None

    def state_dict(self) -> dict[str, int]:
        return dict(self._state)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        state = _check_state(state_dict)
        if state["sequences_consumed"] % self.global_batch_size:
            logger.info(f"{_label(self.source)}: resuming at global sequence {state['sequences_consumed']}, not a "
                        f"multiple of the global batch {self.global_batch_size}; steps are counted from there")
        self._start, self._state = dict(state), dict(state)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self._batches(dict(self._state if self.infinite else self._start))

    def _open_blocks(self, epoch: int, doc: int) -> Iterator[_Block]:
        if self.num_workers == 0:
            return _iter_blocks(self.source, self.tokenizer, epoch, doc, self.infinite, self.block_chars, 0, 1)
        # Persistent workers stay up between passes that start at the same place (validation runs
        # each evaluation from the start); a pass from elsewhere needs workers with that start.
        if self._pool is None or self._pool[0] != (epoch, doc):
            self.close()
            dataset = _BlockDataset(self.source, self.tokenizer, epoch, doc, self.infinite, self.block_chars)
            dataset.owner, owned = multiprocessing.Pipe(duplex=False)  # only this process holds `owned`
            # Enough blocks in flight to cover a whole global step (each rank reads all of it), so
            # the workers tokenize the next step while the model computes this one.
            step_blocks = math.ceil(self.global_batch_size * (self.seq_len + 1) / self.block_chars)
            prefetch = min(64, max(2, math.ceil(step_blocks / self.num_workers) + 2))
            with warnings.catch_warnings():
                # torchdata 0.11 calls torch.set_vital, deprecated (harmlessly) in newer torch.
                warnings.filterwarnings("ignore", message=".*set_vital.*", category=UserWarning)
                loader = StatefulDataLoader(
                    dataset, batch_size=None, num_workers=self.num_workers, collate_fn=_identity,
                    multiprocessing_context=_MP_CONTEXT, worker_init_fn=_worker_init,
                    persistent_workers=True, prefetch_factor=prefetch, in_order=True, snapshot_every_n_steps=0,
                )  # fmt: skip
            self._pool = ((epoch, doc), loader, owned)
        return iter(self._pool[1])

    def close(self) -> None:
        """Stop the worker processes (also done when the loader is garbage-collected or this process ends)."""
        if self._pool is not None:
            self._pool[2].close()  # the workers see EOF on their end of this pipe and exit
            self._pool = None

    def _batches(self, start: dict[str, int]) -> Iterator[dict[str, torch.Tensor]]:
        b, window = self.local_batch_size, self.seq_len + 1
        before, after = self.dp_rank * b * window, (self.dp_degree - self.dp_rank - 1) * b * window
        blocks = self._open_blocks(start["epoch"], start["next_doc"])
        stream = _Stream(blocks, _label(self.source), start["epoch"], start["next_doc"], start["doc_token_offset"])
        self._state, consumed = dict(start), start["sequences_consumed"]
        while self.infinite or not stream.at_end():
            stream.read(before, keep=False)
            got, tokens, positions = stream.read(b * window, keep=True)
            # Read to the end of the global step now, so every rank's cursor is the same.
            stream.read(after, keep=False)
            consumed += self.global_batch_size
            epoch, doc, offset = stream.cursor()
            self._state = {"sequences_consumed": consumed, "next_doc": doc, "doc_token_offset": offset, "epoch": epoch}
            yield self._collate(got, tokens, positions)

    def _collate(self, got: int, tokens: list[torch.Tensor], positions: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        b, window = self.local_batch_size, self.seq_len + 1
        pad = b * window - got
        if self.infinite and pad:
            raise RuntimeError(f"{_label(self.source)}: the document stream ended in infinite mode")
        ids = torch.cat([*tokens, torch.full((pad,), self.tokenizer.eos_id, dtype=torch.int32)]).long().view(b, window)
        pos = torch.cat([*positions, torch.zeros(pad, dtype=torch.int64)]).view(b, window)
        inputs, labels = ids[:, :-1].contiguous(), ids[:, 1:].clone()
        if pad:
            # The end of a finite pass: padding never counts as a target, and its positions form
            # one pseudo-document per row so that document masking keeps it apart from real text.
            padded = (torch.arange(b * window) >= got).view(b, window)
            labels[padded[:, 1:]] = IGNORE_INDEX
            pos = torch.where(padded, padded.long().cumsum(1) - 1, pos)
        batch = {"tokens": inputs, "labels": labels}
        if self.document_masking:
            # Rotary positions restart at every document and at the row's start (so they stay below seq_len even
            # in a document longer than the row): row index i, or the in-document position where that is smaller.
            batch["positions"] = torch.minimum(pos[:, :-1], torch.arange(self.seq_len))
            batch["document_ids"] = document_ids_from_positions(batch["positions"])
        return batch


def document_ids_from_positions(positions: torch.Tensor) -> torch.Tensor:
    """[batch, seq] index of each token's document within its row (from 1), from its position in its document
    ([batch, seq], 0 where a document starts; the row's first token starts one in any case)."""
    starts = positions == 0
    starts[:, 0] = True
    return starts.long().cumsum(dim=1)


def _start_forkserver(source: object, tokenizer: object) -> None:
    """Start the fork server now, in the background, with the modules workers need already imported.

    Every worker it forks inherits them instead of importing torch, the source/tokenizer modules and
    the main module itself (~3 s each on 2 cores); started at build time, this overlaps model setup.
    Preloading only applies before the server first starts; later calls change nothing.
    """
    if _MP_CONTEXT != "forkserver":
        return
    main_spec = getattr(sys.modules.get("__main__"), "__spec__", None)  # `python -m pkg.mod` runs
    modules = {"torch", __name__, type(source).__module__, type(tokenizer).__module__, getattr(main_spec, "name", "")}
    multiprocessing.get_context("forkserver").set_forkserver_preload(sorted(modules - {"", "__main__", "builtins"}))
    multiprocessing.forkserver.ensure_running()


def _check_epoch_size(loader: PackedDataLoader) -> None:
    """Raise unless one epoch holds at least one global batch of windows (else a step would repeat data)."""
    need = loader.global_batch_size * (loader.seq_len + 1)
    tokens = 0
    for _, text in loader.source.iter_documents(0):
        tokens += len(loader.tokenizer.encode(text, add_bos=True, add_eos=True))
        if tokens >= need:
            return
    raise ValueError(
        f"{_label(loader.source)} holds only {tokens // (loader.seq_len + 1)} sequences of "
        f"training.seq_len + 1 = {loader.seq_len + 1} tokens per epoch, fewer than one global batch (dp degree "
        f"{loader.dp_degree} x training.local_batch_size {loader.local_batch_size}); use a smaller "
        f"training.seq_len or training.local_batch_size"
    )


def build_dataloader(
    *, source: DocumentSource, tokenizer: BaseTokenizer, seq_len: int, local_batch_size: int, dp_rank: int,
    dp_degree: int, num_workers: int = 0, infinite: bool = True, document_masking: bool = False,
    block_chars: int = DEFAULT_BLOCK_CHARS,
) -> PackedDataLoader:
    """This dp rank's batches: `{"tokens", "labels"}`, each int64 `[local_batch_size, seq_len]`.

    document_masking adds "positions" (each input token's index inside its document's BOS..EOS list, 0 at every
    BOS, counted from the row's first token when the document began before it) and "document_ids" (the
    document of each token within its row, starting at 1): the model's inputs for attention within documents.
    infinite=False: one pass; the last window is padded (inputs eos_id, labels -100) and the last
    step is filled with fully ignored rows, so every rank yields the same number of batches.
    Raises ValueError now (infinite mode) if one epoch holds fewer than dp_degree * local_batch_size
    windows. block_chars: text per worker work item (tune only for unusual corpora).
    """
    for wrong, message in (
        (seq_len < 1, f"training.seq_len must be >= 1, got {seq_len}"),
        (local_batch_size < 1, f"training.local_batch_size must be >= 1, got {local_batch_size}"),
        (not 0 <= dp_rank < dp_degree, f"data parallel: dp_rank {dp_rank} is not in [0, dp_degree={dp_degree})"),
        (num_workers < 0, f"training.num_workers must be >= 0, got {num_workers}"),
        (block_chars < 1, f"dataloader block_chars must be >= 1, got {block_chars}"),
    ):
        if wrong:
            raise ValueError(message)
    own_loader = getattr(source, "own_loader", None)  # (sources need only DocumentSource's iter_documents)
    own = own_loader(tokenizer=tokenizer, seq_len=seq_len, local_batch_size=local_batch_size, dp_rank=dp_rank,
                     dp_degree=dp_degree, infinite=infinite, document_masking=document_masking) if own_loader else None
    if own is not None:  # token shards (torchtitan/data/pretokenized.py): no tokenizing, no workers
        return own
    loader = PackedDataLoader(
        source=source, tokenizer=tokenizer, seq_len=seq_len, local_batch_size=local_batch_size, dp_rank=dp_rank,
        dp_degree=dp_degree, num_workers=num_workers, infinite=infinite, document_masking=document_masking,
        block_chars=block_chars,
    )  # fmt: skip
    if num_workers:
        _check_pickles(source, tokenizer)
        _start_forkserver(source, tokenizer)
    if infinite:
        _check_epoch_size(loader)
    return loader
