"""A dispatch-mode storage tracer: every tensor storage an ATen op creates is an allocation,
and the storage's death (weakref finalizer) is its free.

Sizes are rounded to 512 bytes, the CUDA caching allocator's minimum block, so the traced
peak is comparable with `torch.cuda.max_memory_allocated()`. Each allocation is labelled
with a category (from the module running, the phase, or an explicit `label` call later,
e.g. for gradients and optimizer state) and with the phase it was made in.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

BLOCK_BYTES = 512


def rounded(nbytes: int) -> int:
    return max(BLOCK_BYTES, (nbytes + BLOCK_BYTES - 1) // BLOCK_BYTES * BLOCK_BYTES)


@dataclass(slots=True)
class Record:
    size_bytes: int
    nbytes: int
    category: str
    phase: str
    module: str


@dataclass(slots=True)
class Event:
    action: str  # "alloc" | "free"
    record_id: int
    phase: str


COPY_OPS = {torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype, torch.ops.aten.clone.default}


class StorageTracer(TorchDispatchMode):
    """Counts storages created under it. Set `category`, `phase` and `module` from outside."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[Record] = []
        self.events: list[Event] = []
        self.live: dict[int, int] = {}  # id(storage) -> record id
        self.current_bytes = 0
        self.peak_bytes = 0
        self.category = "temporaries"
        self.phase = "load"
        self.module = ""
        self.weight_record_ids: set[int] = set()
        self.stack: list[str] = []  # categories to return to when a module's forward ends
        self.host = False
        """Set while offloading copies a tensor to pinned host memory: counted apart from the device."""
        self.host_live: set[int] = set()
        self.host_live_bytes = 0
        self.host_levels: list[tuple[int, str, int]] = []  # (device events before it, phase, host bytes after)

    # Allocation bookkeeping -------------------------------------------------------------
    def _track(self, tensor: torch.Tensor, category: str, op: str = "") -> None:
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.live or key in self.host_live or storage.nbytes() == 0:
            return
        if self.host:
            self._track_host(storage, key)
            return
        record_id = len(self.records)
        self.records.append(Record(rounded(storage.nbytes()), storage.nbytes(), category, self.phase, op or self.module))
        self.live[key] = record_id
        self.events.append(Event("alloc", record_id, self.phase))
        self.current_bytes += self.records[record_id].size_bytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        weakref.finalize(storage, self._free, key, record_id)

    def _free(self, key: int, record_id: int) -> None:
        if self.live.get(key) == record_id:
            del self.live[key]
        self.current_bytes -= self.records[record_id].size_bytes
        self.events.append(Event("free", record_id, self.phase))

    def _track_host(self, storage, key: int) -> None:
        """A pinned host block: torch's CachingHostAllocator rounds each to a power of two."""
        from llamem.analytic.offload import host_block_bytes

        size = host_block_bytes(storage.nbytes())
        self.host_live.add(key)
        self._host_change(size)
        weakref.finalize(storage, self._free_host, key, size)

    def _free_host(self, key: int, size: int) -> None:
        self.host_live.discard(key)
        self._host_change(-size)

    def _host_change(self, size: int) -> None:
        self.host_live_bytes += size
        self.host_levels.append((len(self.events), self.phase, self.host_live_bytes))

    def host_phase_peaks(self, phases: list[str]) -> dict[str, int]:
        """For each phase, the most pinned host memory alive while it ran (host blocks made or freed in it,
        and what was left from before while its device events happened)."""
        peaks = {phase: 0 for phase in phases}
        for _before, phase, level in self.host_levels:
            if phase in peaks:
                peaks[phase] = max(peaks[phase], level)
        level, position, levels = 0, 0, self.host_levels
        for index, event in enumerate(self.events):
            while position < len(levels) and levels[position][0] <= index:
                level = levels[position][2]
                position += 1
            if event.phase in peaks:
                peaks[event.phase] = max(peaks[event.phase], level)
        return peaks

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        category = self.category
        # Autocast's casts of a weight are weight copies, whichever module asks for them.
        if func in COPY_OPS and args and isinstance(args[0], torch.Tensor):
            source = self.live.get(id(args[0].untyped_storage()))
            if source is not None and source in self.weight_record_ids:
                category = "weights/autocast_copies"
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor):
                self._track(tensor, category, func.__name__)
        return out

    # Labels ----------------------------------------------------------------------------
    def record_of(self, tensor: torch.Tensor) -> Record | None:
        record_id = self.live.get(id(tensor.untyped_storage()))
        return None if record_id is None else self.records[record_id]

    def label(self, tensor: torch.Tensor, category: str) -> None:
        """Give a live tensor's storage a category; start tracking it if it came from outside."""
        key = id(tensor.untyped_storage())
        if key not in self.live:
            self._track(tensor, category)
        record_id = self.live.get(key)
        if record_id is not None:
            self.records[record_id].category = category
            if category.startswith("weights") and category != "weights/autocast_copies":
                self.weight_record_ids.add(record_id)

    # Results ---------------------------------------------------------------------------
    def phase_peaks(self, phases: list[str]) -> dict[str, dict[str, int]]:
        """For each phase, the category breakdown at the moment its live bytes were highest."""
        best: dict[str, tuple[int, int]] = {}  # phase -> (bytes, event index)
        current = 0
        for index, event in enumerate(self.events):
            size = self.records[event.record_id].size_bytes
            current += size if event.action == "alloc" else -size
            if event.phase in phases and current > best.get(event.phase, (-1, 0))[0]:
                best[event.phase] = (current, index)
        # A phase with no events still has the memory left from before it.
        targets = {index: phase for phase, (_b, index) in best.items()}
        out: dict[str, dict[str, int]] = {}
        live: set[int] = set()
        for index, event in enumerate(self.events):
            if event.action == "alloc":
                live.add(event.record_id)
            else:
                live.discard(event.record_id)
            if index in targets:
                breakdown: dict[str, int] = {}
                for record_id in live:
                    record = self.records[record_id]
                    breakdown[record.category] = breakdown.get(record.category, 0) + record.size_bytes
                out[targets[index]] = breakdown
        return {phase: out[phase] for phase in phases if phase in out}

    def trace_events(self) -> list[dict]:
        """The event trace, one dict per allocation and free (what --save-trace writes)."""
        return [
            {"action": event.action, "addr": event.record_id, "size": self.records[event.record_id].size_bytes,
             "nbytes": self.records[event.record_id].nbytes,
             "phase": event.phase, "category": self.records[event.record_id].category,
             "module": self.records[event.record_id].module}
            for event in self.events
        ]
