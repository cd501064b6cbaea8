"""Reading and writing rows of tensors inside safetensors files, without holding whole tensors.

The safetensors library reads whole tensors (or slices of one) and writes whole files from full tensors. Export by
shard (hf_sharded.py) needs the other direction too: many ranks writing disjoint pieces of one file. The format
makes that simple: an 8-byte little-endian header length, a JSON header giving each tensor's dtype, shape and
[begin, end) byte range in the data section, then the data, row-major. So the file can be laid out from shapes
alone (`plan_file`), created at full size by one rank (`create_file`: header, then a sparse zero-filled data
section), and then every rank writes its rows with `pwrite` at their offsets (`write_rows`). Reading maps the
file read-only and copies out only the rows and columns asked for (`read_rows`).

A tensor's rows are its last dimension's vectors, all other dimensions flattened (a 1-D tensor is one row): the
unit in which our tensors and the Hugging Face ones correspond (torchtitan/models/hf_common.py `RowLink`).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
          torch.int64: "I64", torch.int32: "I32", torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}
_DTYPES = {code: dtype for dtype, code in _CODES.items()}


@dataclass(frozen=True)
class Entry:
    """Where one tensor lies in its file: absolute byte offset of its data, shape, dtype."""

    path: Path
    offset: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def cols(self) -> int:
        return self.shape[-1] if self.shape else 1

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * self.itemsize


def plan_file(path: Path, tensors: list[tuple[str, tuple[int, ...], torch.dtype]],
              metadata: dict[str, str]) -> tuple[bytes, dict[str, Entry]]:
    """Header bytes and entries for a file holding `tensors` (name, shape, dtype), data packed in that order
    after sorting by element size (largest first, as safetensors does, so every tensor stays aligned)."""
    order = sorted(range(len(tensors)), key=lambda i: (-torch.empty((), dtype=tensors[i][2]).element_size(), i))
    header: dict[str, object] = {"__metadata__": metadata}
    spans: dict[str, tuple[int, tuple[int, ...], torch.dtype]] = {}
    at = 0
    for i in order:
        name, shape, dtype = tensors[i]
        n = int(np.prod(shape, dtype=np.int64)) * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _CODES[dtype], "shape": list(shape), "data_offsets": [at, at + n]}
        spans[name] = (at, tuple(shape), dtype)
        at += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)  # the data section starts 8-byte aligned
    head = struct.pack("<Q", len(text)) + text
    entries = {name: Entry(path, len(head) + begin, shape, dtype) for name, (begin, shape, dtype) in spans.items()}
    return head, entries


def create_file(path: Path, head: bytes, entries: dict[str, Entry]) -> None:
    """The file at its final size: header written, data section a hole (reads as zeros) for the ranks to fill."""
    end = max((e.offset + e.nbytes for e in entries.values()), default=len(head))
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(end)


def read_entries(path: Path) -> dict[str, Entry]:
    """Every tensor's entry from a safetensors file's header (no data is read)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    out: dict[str, Entry] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"{path}: tensor '{name}' has dtype {info['dtype']}, which this reader does not handle")
        out[name] = Entry(path, 8 + n + int(info["data_offsets"][0]), tuple(info["shape"]), _DTYPES[info["dtype"]])
    return out


def runs(ids: Tensor) -> list[tuple[int, int, int]]:
    """(position in `ids`, first id, length) of each run of consecutive ids (columns or rows of a file's tensor)."""
    if ids.numel() == 0:
        return []
    ids = ids.numpy()
    breaks = (np.flatnonzero(np.diff(ids) != 1) + 1).tolist()
    return [(a, int(ids[a]), b - a) for a, b in zip([0, *breaks], [*breaks, ids.size], strict=True)]


def whole_rows(col_runs: list[tuple[int, int, int]], entry: Entry) -> bool:
    """The column runs are every column of the file's tensor, in order: rows move whole."""
    return len(col_runs) == 1 and col_runs[0][2] == entry.cols


def write_rows(fd: int, entry: Entry, hf_rows: Tensor, cols: Tensor, data: Tensor) -> int:
    """Write `data` (n x len(cols), converted to the entry's dtype) as rows `hf_rows` (ascending), columns `cols`
    of the tensor at `entry`; consecutive full rows go out in one pwrite. Returns the elements written."""
    if hf_rows.numel() == 0:
        return 0
    size, width = entry.itemsize, entry.cols * entry.itemsize
    raw = data.to(device="cpu", dtype=entry.dtype).contiguous().view(torch.uint8).numpy()  # n x len(cols)*size
    col_runs = runs(cols)
    if whole_rows(col_runs, entry):  # one write per run of consecutive rows
        for at, row, n in runs(hf_rows):
            os.pwrite(fd, raw[at:at + n], entry.offset + row * width)
    else:
        for i, row in enumerate(hf_rows.tolist()):
            for local, first, n in col_runs:
                os.pwrite(fd, raw[i, local * size:(local + n) * size], entry.offset + row * width + first * size)
    return data.numel()


class Reader:
    """Read-only maps of safetensors files, opened once each."""

    def __init__(self) -> None:
        self._maps: dict[Path, np.memmap] = {}

    def read_rows(self, entry: Entry, hf_rows: Tensor, cols: Tensor) -> Tensor:
        """Rows `hf_rows`, columns `cols` of the tensor at `entry`: an n x len(cols) tensor of its dtype. Only
        those bytes are copied out of the file."""
        mm = self._maps.get(entry.path)
        if mm is None:
            mm = self._maps[entry.path] = np.memmap(entry.path, dtype=np.uint8, mode="r")
        size = entry.itemsize
        if hf_rows.numel() == 0 or cols.numel() == 0:
            return torch.empty(hf_rows.numel(), cols.numel(), dtype=entry.dtype)
        region = mm[entry.offset:entry.offset + entry.nbytes].reshape(entry.rows, entry.cols * size)
        rows = hf_rows.numpy()
        # Into one torch-allocated buffer (so allocator tracking sees it), straight from the map. np.take copies its
        # source to a contiguous array first unless it already is one: only whole rows may go through it (mode="clip":
        # no buffer for the result either; the rows are in range). A column run (a shard of a row-wise TP weight)
        # is copied by runs of consecutive rows instead: through np.take it would read every row of the file's
        # tensor into an untracked temporary, 436 MB per chunk for a 405B w2 under TP 8.
        out = torch.empty(rows.size, cols.numel() * size, dtype=torch.uint8)
        buf = out.numpy()
        col_runs = runs(cols)
        if whole_rows(col_runs, entry):
            np.take(region, rows, axis=0, out=buf, mode="clip")
            return out.view(entry.dtype)
        row_runs = runs(hf_rows)
        for local, first, n in col_runs:
            part, dest = region[:, first * size:(first + n) * size], buf[:, local * size:(local + n) * size]
            for at, row, length in row_runs:
                dest[at:at + length] = part[row:row + length]
        return out.view(entry.dtype)

    def close(self) -> None:
        self._maps.clear()
