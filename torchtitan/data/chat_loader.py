"""Batches of conversations for supervised fine-tuning: padded or packed rows, truncation, an exact cursor.

A conversation of n tokens (torchtitan/data/chat.py: its ids and which of them are trained) fills n - 1 positions of
a row: inputs ids[:-1], labels ids[1:] where trained, IGNORE_INDEX elsewhere. Rows hold whole conversations:

- `pad`: one conversation per row, the rest padding (inputs EOS, labels ignored);
- `pack`: conversations in stream order, a new row whenever the next one does not fit; with document masking
  (model.attn_mask_type = "block_causal", required) positions restart at every conversation and `document_ids`
  keep each conversation's attention to itself, as for packed pretraining documents (docs/data.md). The padding
  at a row's end is a document of its own.

A conversation longer than seq_len + 1 tokens is cut to seq_len + 1 (`truncate`) or skipped (`drop`); one whose cut
leaves no trained token is skipped too. Every kind is counted and logged at the end of each epoch, as are the
conversations the template could not render.

Global row k is the same in every layout: ranks deal rows as the pretraining loader deals windows (rank r of step
n takes rows [nG + rb, nG + (r + 1)b), G = dp_degree x b), each building every row of the step. The state is the
pretraining loader's four ints: `next_doc` (with `epoch`) is the first conversation not in any delivered row, where
a resumed run starts a fresh row exactly as the uninterrupted run did; `doc_token_offset` is always 0. Tokenizing
runs in the same worker processes as for text (torchtitan/data/dataloader.py), so batches do not depend on
training.num_workers.
"""

from __future__ import annotations

import json
import pickle
from collections import Counter, deque
from collections.abc import Iterator
from typing import Any

import torch

from torchtitan.components.loss import IGNORE_INDEX
from torchtitan.data.chat import ChatEncoder
from torchtitan.data.chat_source import ConversationSource, build_chat_source
from torchtitan.data.dataloader import (
    DEFAULT_BLOCK_CHARS,
    PackedDataLoader,
    _Block,
    _check_pickles,
    _iter_blocks,
    _label,
    _start_forkserver,
    document_ids_from_positions,
)
from torchtitan.tools.logging import logger

__all__ = ["ChatDataLoader", "build_chat_dataloader", "build_sft_dataloader"]

_Item = tuple[int, int, torch.Tensor, torch.Tensor]  # epoch, raw index, inputs, labels


class _Packer:
    """Rows of whole conversations from the blocks, in stream order, with the cursor of the next unplaced one."""

    def __init__(self, blocks: Iterator[_Block], label: str, seq_len: int, pack: bool, drop: bool,
                 epoch: int, doc: int) -> None:
        self.blocks, self.label, self.seq_len, self.pack, self.drop = blocks, label, seq_len, pack, drop
        self.queue: deque[tuple[int, int, torch.Tensor]] = deque()
        self.end, self.next_position = (epoch, doc), 0
        self.pending: _Item | None = None
        self.epoch, self.from_start = epoch, doc == 0  # an epoch read from its start must yield a conversation
        self.counts: Counter[str] = Counter()  # this epoch's
        self.totals: Counter[str] = Counter()  # this pass's
        self.told: set[str] = set()

    def _pull(self) -> bool:
        item = next(self.blocks, None)
        if item is None:
            return False
        position, epoch, indices, lengths, tokens = item
        if position != self.next_position:  # the round-robin order is what makes any num_workers exact
            raise RuntimeError(f"dataloader: received block {position}, expected {self.next_position}")
        self.next_position += 1
        flat = torch.frombuffer(tokens, dtype=torch.int32) if len(tokens) else torch.empty(0, dtype=torch.int32)
        start = 0
        for index, n in zip(indices, lengths, strict=True):
            self.queue.append((epoch, index, flat[start : start + n]))
            start += n
            self.end = (epoch, index + 1)
        return True

    def cursor(self) -> tuple[int, int]:
        """(epoch, raw index) of the first conversation not in a returned row."""
        if self.pending is not None:
            return self.pending[0], self.pending[1]
        while not self.queue and self._pull():
            pass
        return (self.queue[0][0], self.queue[0][1]) if self.queue else self.end

    def _count(self, kind: str, index: int, n: int) -> None:
        self.counts[kind] += 1
        if kind in ("truncated", "dropped") and kind not in self.told:
            self.told.add(kind)
            logger.info(f"{self.label}: record {index} has {n} tokens, more than seq_len + 1 = {self.seq_len + 1}: "
                        f"{kind} (training.truncation; counts at the end of each epoch)")

    def _new_epoch(self, epoch: int) -> None:
        self.summary()
        if self.from_start and not self.counts["conversations"]:
            raise ValueError(f"{self.label}: no conversation of the epoch fits in a row ({self._counts_text()})")
        self.totals += self.counts
        self.epoch, self.from_start, self.counts = epoch, True, Counter()

    def summary(self) -> None:
        if self.counts:
            logger.info(f"{self.label}: epoch {self.epoch}: {self._counts_text()}")

    def _counts_text(self) -> str:
        c = self.counts
        parts = [f"{c['conversations']} conversations in {c['rows']} rows"]
        for kind, what in (("truncated", f"truncated to {self.seq_len + 1} tokens"), ("dropped", "dropped as longer"),
                           ("no_target", "without a trained token within seq_len + 1"),
                           ("unrenderable", "not renderable by the chat template")):
            if c[kind]:
                parts.append(f"{c[kind]} {what}")
        return ", ".join(parts)

    def _next_conversation(self) -> _Item | None:
        while self.queue or self._pull():
            epoch, index, raw = self.queue.popleft()
            if epoch != self.epoch:
                self._new_epoch(epoch)
            if not len(raw):
                self.counts["unrenderable"] += 1
                continue
            trained = raw < 0
            ids = torch.where(trained, -1 - raw, raw).long()
            if len(ids) > self.seq_len + 1:
                self._count("dropped" if self.drop else "truncated", index, len(ids))
                if self.drop:
                    continue
                ids, trained = ids[: self.seq_len + 1], trained[: self.seq_len + 1]
            if not trained[1:].any():
                self.counts["no_target"] += 1
                continue
            self.counts["conversations"] += 1
            return epoch, index, ids[:-1], torch.where(trained[1:], ids[1:], IGNORE_INDEX)
        return None

    def next_row(self) -> list[_Item] | None:
        """The next row's conversations (pack: as many as fit), or None once a finite stream is used up."""
        row: list[_Item] = []
        used = 0
        while True:
            if self.pending is None:
                self.pending = self._next_conversation()
                if self.pending is None:
                    break
            n = len(self.pending[2])
            if row and (not self.pack or used + n > self.seq_len):
                break
            row.append(self.pending)
            used, self.pending = used + n, None
            if not self.pack:
                break
        if row:
            self.counts["rows"] += 1
        return row or None


class ChatDataLoader(PackedDataLoader):
    """This dp rank's batches of conversations; the same iteration, state and worker rules as PackedDataLoader
    (its `tokenizer` is the ChatEncoder, whose ids carry the label mask)."""

    def __init__(self, *, packing: str, truncation: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.pack, self.drop = packing == "pack", truncation == "drop"
        self.totals: Counter[str] = Counter()  # the counts of the last finished or current pass, for tests and logs

    @property
    def text_tokenizer(self) -> Any:
        """The tokenizer under the chat encoding: what a Hugging Face export of the run carries."""
        return self.tokenizer.tokenizer

    @property
    def chat_template(self) -> str:
        """The Jinja source of the template the conversations are rendered with (a built-in one's too)."""
        return self.tokenizer.source

    def _batches(self, start: dict[str, int]) -> Iterator[dict[str, torch.Tensor]]:
        if start["doc_token_offset"]:
            raise ValueError(f"{_label(self.source)}: the dataloader state resumes inside a document "
                             f"({start}), which only text data does; exclude 'dataloader' from loading to start the "
                             "conversations from the beginning")
        g, b = self.global_batch_size, self.local_batch_size
        packer = _Packer(self._open_blocks(start["epoch"], start["next_doc"]), _label(self.source), self.seq_len,
                         self.pack, self.drop, start["epoch"], start["next_doc"])
        self._state, consumed = dict(start), start["sequences_consumed"]
        while True:
            rows = []
            while len(rows) < g and (row := packer.next_row()) is not None:
                rows.append(row)
            if self.infinite and len(rows) < g:
                raise RuntimeError(f"{_label(self.source)}: the conversation stream ended in infinite mode")
            if rows:
                consumed += g
                epoch, doc = packer.cursor()
                self._state = {"sequences_consumed": consumed, "next_doc": doc, "doc_token_offset": 0, "epoch": epoch}
                self.totals = packer.totals + packer.counts
                yield self._collate(rows[self.dp_rank * b : (self.dp_rank + 1) * b])
            if len(rows) < g:  # a finite pass is over (its last step was padded with empty rows)
                packer.summary()
                self.totals = packer.totals + packer.counts
                return

    def _collate(self, rows: list[list[_Item]]) -> dict[str, torch.Tensor]:  # type: ignore[override]
        b, s = self.local_batch_size, self.seq_len
        tokens = torch.full((b, s), self.tokenizer.eos_id, dtype=torch.int64)
        labels = torch.full((b, s), IGNORE_INDEX, dtype=torch.int64)
        positions = torch.zeros((b, s), dtype=torch.int64)
        for r in range(b):
            at = 0
            for _, _, inputs, targets in rows[r] if r < len(rows) else []:
                n = len(inputs)
                tokens[r, at : at + n], labels[r, at : at + n] = inputs, targets
                positions[r, at : at + n] = torch.arange(n)
                at += n
            positions[r, at:] = torch.arange(s - at)  # the padding: a document of its own
        batch = {"tokens": tokens, "labels": labels}
        if self.document_masking:
            batch["positions"] = positions
            batch["document_ids"] = document_ids_from_positions(positions)
        return batch


def _check_epoch_rows(loader: ChatDataLoader) -> None:
    """Raise unless one epoch makes at least one global batch of rows (else a step would repeat conversations)."""
    blocks = _iter_blocks(loader.source, loader.tokenizer, 0, 0, False, loader.block_chars, 0, 1)
    packer = _Packer(blocks, _label(loader.source), loader.seq_len, loader.pack, loader.drop, 0, 0)
    rows = 0
    while rows < loader.global_batch_size and packer.next_row() is not None:
        rows += 1
    if rows < loader.global_batch_size:
        raise ValueError(f"{_label(loader.source)} makes only {rows} rows of training.seq_len {loader.seq_len} per "
                         f"epoch ({packer._counts_text()}), fewer than one global batch (dp degree {loader.dp_degree} "
                         f"x training.local_batch_size {loader.local_batch_size})")


def build_chat_dataloader(
    *, source: ConversationSource, encoder: ChatEncoder, seq_len: int, local_batch_size: int, dp_rank: int,
    dp_degree: int, num_workers: int = 0, infinite: bool = True, document_masking: bool = False, packing: str = "pad",
    truncation: str = "truncate", block_chars: int = DEFAULT_BLOCK_CHARS,
) -> ChatDataLoader:  # fmt: skip
    """This dp rank's batches of `source`'s conversations: `tokens`, `labels` (int64 [local_batch_size, seq_len]),
    and with document_masking `positions` and `document_ids`. infinite=False: one pass, the last step padded with
    fully ignored rows. Raises ValueError now (infinite mode) if an epoch makes fewer rows than one global batch."""
    for wrong, message in (
        (seq_len < 1, f"training.seq_len must be >= 1, got {seq_len}"),
        (local_batch_size < 1, f"training.local_batch_size must be >= 1, got {local_batch_size}"),
        (not 0 <= dp_rank < dp_degree, f"data parallel: dp_rank {dp_rank} is not in [0, dp_degree={dp_degree})"),
        (num_workers < 0, f"training.num_workers must be >= 0, got {num_workers}"),
        (packing not in ("pad", "pack"), f"training.sft_packing: must be pad or pack, got {packing!r}"),
        (truncation not in ("truncate", "drop"), f"training.truncation: must be truncate or drop, got {truncation!r}"),
        (packing == "pack" and not document_masking, "training.sft_packing: pack needs document masking "
                                                     "(model.attn_mask_type = block_causal), or use pad"),
    ):
        if wrong:
            raise ValueError(message)
    loader = ChatDataLoader(
        source=source, tokenizer=encoder, seq_len=seq_len, local_batch_size=local_batch_size, dp_rank=dp_rank,
        dp_degree=dp_degree, num_workers=num_workers, infinite=infinite, document_masking=document_masking,
        block_chars=block_chars, packing=packing, truncation=truncation,
    )  # fmt: skip
    if num_workers:
        _check_pickles(source, encoder.tokenizer)
        probe = json.dumps([{"role": "user", "content": "2+2? <|im_end|>"}, {"role": "assistant", "content": "4"}])
        if pickle.loads(pickle.dumps(encoder)).encode(probe) != encoder.encode(probe):
            raise ValueError("training.chat_template: the chat encoder encodes differently once pickled into a "
                             "dataloader worker (set training.num_workers = 0)")
        _start_forkserver(source, encoder)
    if infinite:
        _check_epoch_rows(loader)
    return loader


def build_sft_dataloader(training: Any, source_args: dict[str, Any], loader_args: dict[str, Any],
                         key_prefix: str = "training") -> tuple[ConversationSource, ChatDataLoader]:
    """The source and loader of a [training]-like section whose dataset_format is not text (torchtitan/train.py's
    source_args and loader_args, as for text data; the text column is not used)."""
    source = build_chat_source(dataset_path=training.dataset_path, dataset_format=training.dataset_format,
                               split=source_args["split"], streaming=source_args["streaming"],
                               cache_dir=source_args.get("cache_dir"), key_prefix=key_prefix,
                               dataset=training.dataset)
    args = dict(loader_args)
    encoder = ChatEncoder(args.pop("tokenizer"), training.chat_template, training.train_on,
                          key=f"{key_prefix}.chat_template")
    loader = build_chat_dataloader(source=source, encoder=encoder, packing=training.sft_packing,
                                   truncation=training.truncation, **args)
    logger.info(f"{key_prefix}: {source.format} data, chat template {encoder.name}, labels on "
                f"{'every token' if encoder.train_all else 'assistant replies'}, {training.sft_packing} rows, "
                f"{training.truncation} conversations longer than seq_len + 1")
    return source, loader
