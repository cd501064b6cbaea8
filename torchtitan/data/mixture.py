"""Dataset mixtures: several weighted sources interleaved, deterministically, at the level of global sequences.

`training.dataset_mixture = ["web:0.7", "code:0.2", "math:0.1"]` (CLI: `web:0.7,code:0.2,math:0.1`). Each source
is packed into its own window stream exactly as a single dataset is (dataloader.py / pretokenized.py), with its own
cursor and its own epochs. A fixed schedule says which source global sequence k comes from (earliest deadline first,
see MixtureSchedule), keeping each source within one sequence of its share in every prefix. No randomness, so no
seed: the schedule is a function of the weights alone.

With shares p_i / P in lowest terms the schedule repeats every P sequences (after P of them every source is exactly
on target again), so one period is tabulated and taken_i(k) = (k // P) * p_i + table[k % P][i] is O(1): from the global
cursor alone, every rank knows each of its sequences' source and window within that source. Ranks deal global
sequences as the single-dataset loader does (chunks of local_batch_size, round-robin), so a step of all ranks
covers global sequences [nG, (n+1)G) and any dp degree reads every window of every source exactly once, in order.

Raw-text sources are read sequentially by every rank (as a single raw dataset is); pre-tokenized folders are read
by index arithmetic, only this rank's windows. The state is plain ints: the global `sequences_consumed` and, per
source i, `mix{i}_<key>` for the single-dataset loader's four keys, equal on every rank at step boundaries.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from fractions import Fraction
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from torchtitan.data.dataloader import (  # the single loader's parts, reused as they are
    DEFAULT_BLOCK_CHARS,
    STATE_KEYS,
    PackedDataLoader,
    _check_state,
    _label,
    _Stream,
    build_dataloader,
)
from torchtitan.data.datasets import DATASETS, build_document_source
from torchtitan.data.pretokenized import PretokenizedDataLoader, PretokenizedSource
from torchtitan.tools.logging import logger

__all__ = ["MAX_PERIOD", "MixtureDataLoader", "MixtureSchedule", "MixtureSource", "build_mixture_dataloader",
           "parse_mixture"]

KEY = "training.dataset_mixture"
# The tabulated period is P x sources ints; weights of up to 4 decimals (or small integers) stay far below this.
MAX_PERIOD = 100_000


class MixtureSource(NamedTuple):
    name: str
    weight: Fraction
    text_column: str | None  # None: training.dataset_text_column, shared by the sources without their own


def parse_mixture(entries: list[str]) -> list[MixtureSource]:
    """Sources of "source:weight[:column=NAME]" entries: the weight is the last ':' field that is not an option
    (hub names hold ':'); `column=` sets that source's text column."""
    parsed: list[MixtureSource] = []
    for entry in entries:
        fields = entry.strip().split(":")
        options = {}
        while len(fields) > 1 and "=" in fields[-1]:
            key, _, value = fields.pop().partition("=")
            if key.strip() != "column" or not value.strip():
                raise ValueError(f"{KEY}: '{entry}': unknown option '{key.strip()}=' (the one option is column=NAME)")
            options["column"] = value.strip()
        name, sep, text = ":".join(fields).rpartition(":")
        name = name.strip()
        if not sep or not name:
            raise ValueError(f"{KEY}: '{entry}' is not source:weight (e.g. c4:0.7)")
        try:
            weight = Fraction(text.strip())
        except (ValueError, ZeroDivisionError):
            raise ValueError(f"{KEY}: '{entry}': the weight '{text}' is not a number (e.g. 0.7, 7 or 1/3)") from None
        if weight <= 0:
            raise ValueError(f"{KEY}: '{entry}': the weight must be > 0")
        if name in (source.name for source in parsed):
            raise ValueError(f"{KEY}: source '{name}' is listed twice")
        if "column" in options and name in DATASETS:
            raise ValueError(f"{KEY}: '{entry}': a registry dataset knows its text column; column= applies to "
                             "files and hub datasets")
        parsed.append(MixtureSource(name, weight, options.get("column")))
    if not parsed:
        raise ValueError(f"{KEY}: no sources")
    MixtureSchedule([source.weight for source in parsed])  # a period too long is a config error too
    return parsed


class MixtureSchedule:
    """Which source each global sequence comes from, and how many each source gave before it, in O(1)."""

    def __init__(self, weights: list[Fraction]) -> None:
        total = sum(weights)
        shares = [Fraction(w) / total for w in weights]
        self.period = math.lcm(*(s.denominator for s in shares))
        if self.period > MAX_PERIOD:
            raise ValueError(f"{KEY}: the weights repeat only every {self.period} sequences (at most {MAX_PERIOD}): "
                             f"round them, e.g. to 3 decimals")
        self.counts = [int(s * self.period) for s in shares]  # sequences per period, summing to period
        self.shares = [float(s) for s in shares]
        # Earliest deadline first (Tijdeman's chairman assignment, 1980), d = 1 - 1/(2(S - 1)): source i's j-th
        # sequence is released at the first k (1-based) with j - d <= share_i * k, and due before share_i * k
        # exceeds j - 1 + d; each sequence goes to the released source due first (ties to source order). His theorem:
        # every source stays within d < 1 sequence of share_i * k in every prefix (largest-deficit-first, nginx's
        # smooth round robin, lags by up to 1.25 with 6 sources). In exact integers: d = a / e, shares p_i / P.
        n, p, period = len(weights), self.counts, self.period
        a, e = (2 * n - 3, 2 * n - 2) if n > 1 else (0, 1)
        order, taken = np.empty(period, dtype=np.int64), [0] * n
        cumulative = np.zeros((period + 1, n), dtype=np.int64)
        for k in range(1, period + 1):
            best, due = -1, 0  # the released source due first: smallest (taken_i * e + a) / p_i, first on ties
            for i in range(n):
                if period * ((taken[i] + 1) * e - a) <= p[i] * k * e:
                    num = taken[i] * e + a
                    if best < 0 or num * p[best] < due * p[i]:
                        best, due = i, num
            order[k - 1], taken[best] = best, taken[best] + 1
            cumulative[k] = taken
        self.order, self.cumulative = order, cumulative

    def source(self, k: int) -> int:
        """The source of global sequence k."""
        return int(self.order[k % self.period])

    def taken(self, k: int) -> list[int]:
        """Sequences each source gave to global sequences [0, k): the next window index of each source."""
        rounds, rest = divmod(k, self.period)
        return [rounds * p + int(c) for p, c in zip(self.counts, self.cumulative[rest], strict=True)]


class _RawWindows:
    """A raw-text source's windows, in order, from its own cursor (every rank reads every window)."""

    def __init__(self, part: PackedDataLoader, state: dict[str, int]) -> None:
        blocks = part._open_blocks(state["epoch"], state["next_doc"])
        self._stream = _Stream(blocks, _label(part.source), state["epoch"], state["next_doc"],
                               state["doc_token_offset"])  # fmt: skip
        self._window, self._label = part.seq_len + 1, _label(part.source)

    def next(self, keep: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        got, tokens, positions = self._stream.read(self._window, keep)
        if got != self._window:
            raise RuntimeError(f"{self._label}: the document stream ended in infinite mode")
        return tokens, positions

    def cursor(self, consumed: int) -> dict[str, int]:
        epoch, doc, offset = self._stream.cursor()
        return {"sequences_consumed": consumed, "next_doc": doc, "doc_token_offset": offset, "epoch": epoch}


class _PretokenizedWindows:
    """A pre-tokenized source's windows: window j is tokens [j*W, (j+1)*W) of its stream; only kept ones are read."""

    def __init__(self, part: PretokenizedDataLoader, state: dict[str, int]) -> None:
        self._part, self._next, self._window = part, state["sequences_consumed"], part.seq_len + 1

    def next(self, keep: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        j, self._next = self._next, self._next + 1
        if not keep:
            return [], []
        tokens, positions = self._part.source.read(j * self._window, self._window, self._part.reads)
        return [torch.from_numpy(tokens)], [torch.from_numpy(positions)]

    def cursor(self, consumed: int) -> dict[str, int]:
        return self._part._cursor_state(consumed, None)


class MixtureDataLoader(PackedDataLoader):
    """This dp rank's batches of a mixture: PackedDataLoader's interface, batches and collation (infinite only)."""

    def __init__(self, *, labels: list[str], parts: list[PackedDataLoader], schedule: MixtureSchedule,
                 local_batch_size: int, dp_rank: int, dp_degree: int, document_masking: bool) -> None:
        first = parts[0]
        super().__init__(source=first.source, tokenizer=first.tokenizer, seq_len=first.seq_len,
                         local_batch_size=local_batch_size, dp_rank=dp_rank, dp_degree=dp_degree, num_workers=0,
                         infinite=True, document_masking=document_masking, block_chars=1)  # fmt: skip
        self.labels, self.parts, self.schedule = labels, parts, schedule
        self._start = self._state = self._mixture_state(0, [dict.fromkeys(STATE_KEYS, 0) for _ in parts])

    @staticmethod
    def _mixture_state(consumed: int, cursors: list[dict[str, int]]) -> dict[str, int]:
        state = {"sequences_consumed": consumed}
        for i, cursor in enumerate(cursors):
            state.update({f"mix{i}_{k}": cursor[k] for k in STATE_KEYS})
        return state

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        if not isinstance(state_dict, Mapping) or "sequences_consumed" not in state_dict:
            raise ValueError(f"dataloader state: missing key sequences_consumed in {state_dict!r}")
        consumed = int(state_dict["sequences_consumed"])
        cursors = []
        for i, expected in enumerate(self.schedule.taken(consumed)):
            prefix = f"mix{i}_"
            cursor = _check_state({k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)})
            if cursor["sequences_consumed"] != expected:
                # Another mixture (other weights or sources) wrote this state: continuing would skip or repeat data.
                raise ValueError(f"{KEY}: the checkpoint's source {i} gave {cursor['sequences_consumed']} of the "
                                 f"first {consumed} sequences, this mixture's schedule gives {expected}: the mixture "
                                 f"changed since the checkpoint (not supported; exclude 'dataloader' from loading)")
            cursors.append(cursor)
        self._start = self._state = self._mixture_state(consumed, cursors)
        logger.info(f"{KEY}: resuming at global sequence {consumed}; {self.describe()}")

    def _cursor(self, i: int) -> dict[str, int]:
        return {k: self._state[f"mix{i}_{k}"] for k in STATE_KEYS}

    def _batches(self, start: dict[str, int]) -> Iterator[dict[str, torch.Tensor]]:
        b, g, schedule = self.local_batch_size, self.global_batch_size, self.schedule
        self._state = dict(start)
        readers = [(_PretokenizedWindows if isinstance(p, PretokenizedDataLoader) else _RawWindows)(p, self._cursor(i))
                   for i, p in enumerate(self.parts)]  # fmt: skip
        consumed = start["sequences_consumed"]
        while True:
            mine = range(consumed + self.dp_rank * b, consumed + (self.dp_rank + 1) * b)
            tokens: list[torch.Tensor] = []
            positions: list[torch.Tensor] = []
            # Every source advances past the windows the whole global step takes from it, so all ranks agree.
            for k in range(consumed, consumed + g):
                t, p = readers[schedule.source(k)].next(keep=k in mine)
                tokens += t
                positions += p
            consumed += g
            taken = schedule.taken(consumed)
            self._state = self._mixture_state(consumed, [r.cursor(n) for r, n in zip(readers, taken, strict=True)])
            yield self._collate(b * (self.seq_len + 1), tokens, positions)

    def realised(self) -> list[tuple[str, int, float]]:
        """(label, sequences, fraction of all sequences) of each source so far."""
        consumed = self._state["sequences_consumed"]
        taken = self.schedule.taken(consumed)
        return [(label, n, n / consumed if consumed else 0.0) for label, n in zip(self.labels, taken, strict=True)]

    def describe(self) -> str:
        """One line: each source's target share, sequences and tokens so far, and realised fraction."""
        window = self.seq_len + 1
        return ", ".join(f"{label} (target {share:.4g}): {n} sequences, {n * window} tokens, {frac:.4f}"
                         for (label, n, frac), share in zip(self.realised(), self.schedule.shares, strict=True))

    def mixture_metrics(self) -> dict[str, float]:
        """The realised fraction of each source, for metrics.jsonl (and TensorBoard/W&B)."""
        return {f"data/mix/{label}": round(frac, 6) for label, _, frac in self.realised()}

    def close(self) -> None:
        for part in self.parts:
            part.close()


def _is_local_or_hub(name: str) -> bool:
    """Whether dataset_path could mean it: an existing path, a glob, or an owner/name hub dataset."""
    return Path(name).expanduser().exists() or any(c in name for c in "*?[") or "/" in name


def _labels(names: list[str]) -> list[str]:
    """Short metric names: the registry name or the path's last part; a clash keeps the source's index."""
    short = [name if name in DATASETS else Path(name.rstrip("/")).name.split(":")[0].split(".")[0] or name
             for name in names]
    return [s if short.count(s) == 1 else f"{s}#{i}" for i, s in enumerate(short)]


def build_mixture_dataloader(
    *, entries: list[str], tokenizer: Any, seq_len: int, local_batch_size: int, dp_rank: int, dp_degree: int,
    num_workers: int = 0, document_masking: bool = False, source_args: Mapping[str, Any] | None = None,
    block_chars: int = DEFAULT_BLOCK_CHARS,
) -> MixtureDataLoader:
    """The training loader of `training.dataset_mixture` entries ("source:weight"); infinite mode only.

    A source is a registry name (training.dataset) or anything training.dataset_path takes; source_args are
    build_document_source's other arguments (text column, split, streaming, cache dir), shared by all sources.
    """
    mixture = parse_mixture(entries)
    parts = []
    for name, _, column in mixture:
        if name not in DATASETS and not _is_local_or_hub(name):
            raise ValueError(f"{KEY}: unknown source '{name}': not a registry dataset ({', '.join(sorted(DATASETS))})"
                             f", an existing path, a glob or an owner/name hub dataset")
        try:
            args = {**(source_args or {}), **({"text_column": column} if column else {})}
            source = build_document_source(dataset=name if name in DATASETS else "", key_prefix="training",
                                           dataset_path="" if name in DATASETS else name, **args)
            if column and isinstance(source, PretokenizedSource):
                raise ValueError(f"column={column} does not apply to a pre-tokenized folder (it holds token ids)")
            # One window at a time from each source; build_dataloader checks it (its tokenizer, its epoch size).
            parts.append(build_dataloader(source=source, tokenizer=tokenizer, seq_len=seq_len, local_batch_size=1,
                                          dp_rank=0, dp_degree=1, num_workers=num_workers, infinite=True,
                                          document_masking=document_masking, block_chars=block_chars))
        except (ValueError, OSError) as e:  # OSError: a missing file (FileNotFoundError)
            raise ValueError(f"{KEY}: source '{name}': {e}") from None
    schedule = MixtureSchedule([source.weight for source in mixture])
    loader = MixtureDataLoader(labels=_labels([source.name for source in mixture]), parts=parts, schedule=schedule,
                               local_batch_size=local_batch_size, dp_rank=dp_rank, dp_degree=dp_degree,
                               document_masking=document_masking)  # fmt: skip
    targets = ", ".join(f"{label} {share:.4g}" for label, share in zip(loader.labels, schedule.shares, strict=True))
    logger.info(f"{KEY}: {len(parts)} sources, schedule period {schedule.period} sequences: {targets}")
    return loader
