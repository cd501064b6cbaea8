"""Live tensor memory over time, seen from inside FakeTensorMode.

The tracker sits in the fake-tensor mode itself, the bottom of the dispatch stack, so it sees every op on a
fake tensor, including those DTensor runs internally (redistributions inside an op, loss parallel's
reductions) that a mode stacked above DTensor would miss. Every storage an op returns (or writes into) is
recorded with the op counter at which it appeared and at which
it died (its Python storage object was collected), so the peak and everything alive at the peak are known
after the run. Subclass outputs (DTensor) are unwrapped to their local tensors. Storages that change size in
place (FSDP frees and re-allocates its gathered parameters with `storage.resize_`, which does not go through
the dispatcher) are re-measured whenever an op touches them and before every collective or buffer allocation.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

_RESYNC_BEFORE = {"all_gather_into_tensor", "_allgather_base", "reduce_scatter_tensor", "_reduce_scatter_base",
                  "allgather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "split_with_sizes_copy",
                  "_chunk_cat", "empty", "empty_strided"}


_COLLECTIVE_OPS = {"all_gather_into_tensor", "_allgather_base", "reduce_scatter_tensor", "_reduce_scatter_base",
                   "allgather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "allreduce_", "all_reduce",
                   "allgather_", "reduce_scatter_", "broadcast_", "all_to_all_single"}


@dataclass
class Record:
    serial: int
    nbytes: int
    born: int
    phase: str
    op: str
    died: int | None = None


@dataclass
class _Slot:
    ref: weakref.ref
    record: Record


@dataclass
class Peak:
    bytes: int = 0
    time: int = 0
    phase: str = ""


@dataclass
class Timeline:
    records: list[Record] = field(default_factory=list)
    peaks: dict[str, Peak] = field(default_factory=dict)
    """highest live bytes in each phase ("forward (step 1, micro-batch 1/2)", "optimizer (step 1)", ...)"""

    @property
    def peak(self) -> Peak:
        return max(self.peaks.values(), key=lambda p: p.bytes, default=Peak())

    def alive_at(self, t: int) -> list[Record]:
        return [r for r in self.records if r.born <= t and (r.died is None or r.died > t)]


def local_tensors(t: torch.Tensor) -> list[torch.Tensor]:
    if isinstance(t, DTensor):
        return local_tensors(t._local_tensor)
    if is_traceable_wrapper_subclass(t):
        try:
            names, _ = t.__tensor_flatten__()
        except RuntimeError:  # torchao 0.18's float8 weight truth-tests its scale here, which a fake tensor refuses
            names = [name for name, value in vars(t).items() if isinstance(value, torch.Tensor)]
        out = []
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                out += local_tensors(inner)
        return out
    return [t]


class MemoryTracker:
    """Bookkeeping of live storages; `phase` labels what the caller is doing. Fed by TrackingFakeTensorMode."""

    def __init__(self) -> None:
        self.enabled = False
        self.timeline = Timeline()
        self.phase = "setup"
        self._now = 0
        self._ops = 0
        self._live_bytes = 0
        self._slots: dict[int, _Slot] = {}

    # ---- bookkeeping ----------------------------------------------------------------------------
    def _new_record(self, storage: torch.UntypedStorage, op: str) -> Record:
        # The clock ticks on every allocation and free, so "alive at the peak" is exact: nothing freed later in
        # the same op is mistaken for gone, nothing allocated later is mistaken for alive.
        self._now += 1
        record = Record(len(self.timeline.records), storage.nbytes(), self._now, self.phase, op)
        self.timeline.records.append(record)
        self._live_bytes += record.nbytes
        return record

    def _end(self, record: Record) -> None:
        self._now += 1
        record.died = self._now
        self._live_bytes -= record.nbytes

    def track(self, t: torch.Tensor, op: str = "existing") -> None:
        """Register a tensor's storage (or re-measure it if it changed size since)."""
        for local in local_tensors(t):
            storage = local.untyped_storage()
            key = id(storage)
            slot = self._slots.get(key)
            if slot is not None and slot.ref() is storage:
                if op in _COLLECTIVE_OPS:
                    slot.record.op = op  # a buffer filled by a collective (FSDP's all-gather / reduce-scatter)
                if storage.nbytes() != slot.record.nbytes:  # resized in place: old size ends, new size starts
                    self._end(slot.record)
                    slot.record = self._new_record(storage, op)
                continue
            record = self._new_record(storage, op)
            self._slots[key] = _Slot(weakref.ref(storage, self._on_collected(key, record)), record)
        self._update_peak()

    def _on_collected(self, key: int, record: Record):
        def callback(_ref) -> None:
            slot = self._slots.get(key)
            if slot is not None and slot.record is record:
                del self._slots[key]
            if slot is not None and slot.record.died is None:
                self._end(slot.record)
        return callback

    def resync(self) -> None:
        """Re-measure every live storage (catches `resize_` done outside the dispatcher)."""
        for key, slot in list(self._slots.items()):
            storage = slot.ref()
            if storage is None:
                continue
            if storage.nbytes() != slot.record.nbytes:
                self._end(slot.record)
                slot.record = self._new_record(storage, "resize")
                self._slots[key] = slot
        self._update_peak()

    def _update_peak(self) -> None:
        peak = self.timeline.peaks.setdefault(self.phase, Peak())
        if self._live_bytes > peak.bytes:
            peak.bytes, peak.time, peak.phase = self._live_bytes, self._now, self.phase

    @property
    def live_bytes(self) -> int:
        return self._live_bytes

    # ---- fed by the mode ---------------------------------------------------------------------------
    def on_op(self, func, args, kwargs, out) -> None:
        self._ops += 1
        name = str(func.overloadpacket.__name__)
        if name in _RESYNC_BEFORE or self._ops % 256 == 0:
            # FSDP frees gathered parameters with storage.resize_(0) in its hooks, outside the dispatcher; its
            # next collective is where that memory gets reused, so count the frees there.
            self.resync()
        # Outputs, plus arguments the op wrote into (out= and in-place ops may hit a freshly resized storage).
        candidates, _ = tree_flatten(out)
        if func._schema.is_mutable:
            candidates += tree_flatten((args, kwargs))[0]
        for t in candidates:
            if isinstance(t, torch.Tensor):
                self.track(t, name)

    def __enter__(self):
        self.enabled = True
        return self

    def __exit__(self, *exc):
        self.resync()
        self.enabled = False
        return False

    def set_phase(self, phase: str) -> None:
        self.resync()
        self.phase = phase


class TrackingFakeTensorMode(FakeTensorMode):
    """FakeTensorMode that reports every op's outputs to a MemoryTracker while the tracker is enabled."""

    def __init__(self, tracker: MemoryTracker, **kwargs) -> None:
        super().__init__(**kwargs)
        self.tracker = tracker
        self._depth = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        # Ops dispatched while another op is being faked are that op's decomposition, run once and then served
        # from the fake-tensor cache: a real kernel has no such intermediates. Count top-level ops only.
        self._depth += 1
        try:
            out = super().__torch_dispatch__(func, types, args, kwargs or {})
        finally:
            self._depth -= 1
        if self.tracker.enabled and self._depth == 0:
            self.tracker.on_op(func, args, kwargs or {}, out)
        return out


@contextmanager
def untracked_dtensor_metadata(tracker: MemoryTracker):
    """Hide DTensor's shape propagation from the tracker.

    To learn an op's output shape, DTensor runs the op on *global*-shape fake tensors under the active fake mode
    (ours). Those tensors exist in no real run; counted, they inflated a TP estimate by 12%.
    """
    try:
        from torch.distributed.tensor._sharding_prop import ShardingPropagator
    except ImportError:
        yield
        return
    original = getattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", None)
    if original is None:
        yield
        return

    def propagate(self, *args, **kwargs):
        was = tracker.enabled
        tracker.enabled = False
        try:
            return original(self, *args, **kwargs)
        finally:
            tracker.enabled = was

    ShardingPropagator._propagate_tensor_meta_non_cached = propagate
    try:
        yield
    finally:
        ShardingPropagator._propagate_tensor_meta_non_cached = original
