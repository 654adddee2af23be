"""A CPU stand-in for a GPU: counts the live tensor storages of a real computation, and with a
capacity raises `torch.OutOfMemoryError` as the CUDA caching allocator would.

The counting rule is the trace engine's (llamem/trace/tracer.py): every storage an ATen op
creates is an allocation, rounded up to 512 bytes, freed when the storage dies. So the peak of
a real CPU training step under this tracker equals `llamem trace` of the same workload, and
every runtime feature (monitor, OOM explainer, batch finder, token budgets) runs its real code
path on a CPU with real tiny models.

Tensors that exist before the tracker is entered (a model built outside it, a DataLoader's
batches) are not seen until `track()` is given them. A dispatch mode is active in the thread
that enters it: tensors other threads create (a DataLoader's worker threads, a user's own) are
not counted either. Autograd's backward on CPU runs in the calling thread, so training is seen.
"""

from __future__ import annotations

import json
import traceback
import weakref
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from llamem.errors import LlamemError
from llamem.trace.tracer import COPY_OPS, rounded

TRACE_FORMAT = "llamem-trace-v1"
"""What `allocator replay` reads (llamem/allocator/trace_input.py)."""
DEFAULT_STACK_DEPTH = 6
_SKIPPED_FRAMES = ("/torch/", "/llamem/runtime/tracker.py", "/transformers/", "/contextlib.py")


class InvalidCapacity(LlamemError, ValueError):
    """A tracker capacity that is not a positive number of bytes."""


@dataclass(slots=True)
class Allocation:
    record_id: int
    size_bytes: int
    nbytes: int
    category: str
    phase: str
    op: str
    stack: tuple[str, ...] = ()


class CpuMemoryTracker(TorchDispatchMode):
    """Context manager: `live_bytes`, `peak_bytes`, and an OOM beyond `capacity_bytes`.

    `record_stacks=True` keeps where each storage was created (the user's frames, not torch's),
    which the leak report and the OOM explainer print. `history=False` drops the event list
    (a long run then holds only its live allocations).
    """

    def __init__(self, capacity_bytes: int | None = None, *, record_stacks: bool = False,
                 stack_depth: int = DEFAULT_STACK_DEPTH, history: bool = True) -> None:
        super().__init__()
        if capacity_bytes is not None and (isinstance(capacity_bytes, bool) or not isinstance(capacity_bytes, int)
                                           or capacity_bytes <= 0):
            raise InvalidCapacity(f"capacity_bytes must be a positive integer number of bytes (e.g. 8 * 2**30, or "
                                  f"llamem.units.parse_size('8GiB')), got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes
        self.record_stacks = record_stacks
        self.stack_depth = stack_depth
        self.history = history
        self.live: dict[int, Allocation] = {}  # id(storage) -> its allocation
        self.events: list[tuple[str, int, int, str, str]] = []  # action, record id, bytes, phase, category
        self.current_bytes = 0
        self.peak_bytes = 0
        self.num_ooms = 0
        self.category = "temporaries"
        self.phase = "run"
        self.stack: list[str] = []  # categories to return to when a module's forward ends (trace hooks)
        self.weight_record_ids: set[int] = set()
        self._next_id = 0

    # What callers read ------------------------------------------------------------------
    @property
    def live_bytes(self) -> int:
        return self.current_bytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes

    def live_allocations(self) -> list[Allocation]:
        return sorted(self.live.values(), key=lambda a: a.record_id)

    def live_by_category(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for allocation in self.live.values():
            out[allocation.category] = out.get(allocation.category, 0) + allocation.size_bytes
        return out

    # Counting -------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        category = self.category
        if func in COPY_OPS and args and isinstance(args[0], torch.Tensor):
            source = self.live.get(id(args[0].untyped_storage()))
            if source is not None and source.record_id in self.weight_record_ids:
                category = "weights/autocast_copies"
        new = self._new_storages(out)
        requested = sum(rounded(storage.nbytes()) for storage in new)
        if self.capacity_bytes is not None and self.current_bytes + requested > self.capacity_bytes:
            # Nothing of the op's output may outlive the error: the traceback's frames hold `out`.
            del out, new
            self._raise_oom(requested)
        for storage in new:
            self._add(storage, category, func.__name__)
        return out

    def _new_storages(self, out) -> list:
        seen: dict[int, object] = {}
        for tensor in tree_flatten(out)[0]:
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                storage = tensor.untyped_storage()
                key = id(storage)
                if key not in self.live and key not in seen and storage.nbytes() > 0:
                    seen[key] = storage
        return list(seen.values())

    def _add(self, storage, category: str, op: str) -> Allocation:
        key = id(storage)
        allocation = Allocation(self._next_id, rounded(storage.nbytes()), storage.nbytes(), category, self.phase, op,
                                self._stack() if self.record_stacks else ())
        self._next_id += 1
        self.live[key] = allocation
        self.current_bytes += allocation.size_bytes
        self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        self._event("alloc", allocation)
        weakref.finalize(storage, self._free, key, allocation)
        return allocation

    def _free(self, key: int, allocation: Allocation) -> None:
        if self.live.get(key) is allocation:
            del self.live[key]
        self.current_bytes -= allocation.size_bytes
        self._event("free", allocation)

    def _event(self, action: str, allocation: Allocation) -> None:
        if self.history:
            self.events.append((action, allocation.record_id, allocation.size_bytes, self.phase, allocation.category))

    def _stack(self) -> tuple[str, ...]:
        frames = [f for f in traceback.extract_stack()[:-3] if not any(s in f.filename for s in _SKIPPED_FRAMES)]
        return tuple(f"{f.filename}:{f.lineno} in {f.name}" for f in frames[-self.stack_depth:])

    def _raise_oom(self, requested_bytes: int) -> None:
        # Sizes as c10's format_size writes them ("512 bytes", "2.00 MiB"): parsers of torch's message read these too.
        from llamem.allocator.simulator import format_size

        self.num_ooms += 1
        self.oom_requested_bytes = requested_bytes
        free = max(0, self.capacity_bytes - self.current_bytes)
        raise torch.OutOfMemoryError(
            f"CUDA out of memory. Tried to allocate {format_size(requested_bytes)}. GPU 0 has a total capacity of "
            f"{format_size(self.capacity_bytes)} of which {format_size(free)} is free. Of the allocated memory "
            f"{format_size(self.current_bytes)} is allocated by PyTorch, and {format_size(0)} is reserved by "
            "PyTorch but unallocated. (Raised by llamem's CpuMemoryTracker at its capacity: a CPU stand-in for a GPU.)")

    # Tensors from outside -------------------------------------------------------------
    def track(self, *objects, category: str | None = None) -> None:
        """Count tensors created outside the tracker: modules (parameters, buffers, gradients),
        optimizers (their state), tensors, or lists of them. Already counted ones are relabelled."""
        for obj in objects:
            for tensor, label in _tensors_of(obj):
                self.label(tensor, category or label)

    def label(self, tensor: torch.Tensor, category: str) -> None:
        if tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        if storage.nbytes() == 0:
            return
        allocation = self.live.get(id(storage)) or self._add(storage, category, "tracked")
        allocation.category = category
        if category.startswith("weights") and category != "weights/autocast_copies":
            self.weight_record_ids.add(allocation.record_id)

    # Snapshots ------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """A llamem-trace-v1 document `llamem allocator replay` reads: the whole event history, or
        (with history=False) the live allocations in creation order."""
        if self.history:
            events = [{"action": a, "addr": rid, "size": size, "phase": phase, "category": cat}
                      for a, rid, size, phase, cat in self.events]
        else:
            events = [{"action": "alloc", "addr": a.record_id, "size": a.size_bytes, "phase": a.phase,
                       "category": a.category} for a in self.live_allocations()]
        return {"format": TRACE_FORMAT, "source": "CpuMemoryTracker", "capacity_bytes": self.capacity_bytes,
                "live_bytes": self.current_bytes, "peak_bytes": self.peak_bytes, "events": events,
                "live": [_allocation_dict(a) for a in self.live_allocations()]}

    def write_snapshot(self, path) -> None:
        with open(path, "w") as handle:
            json.dump(self.snapshot(), handle)


def _allocation_dict(allocation: Allocation) -> dict:
    return {"addr": allocation.record_id, "size": allocation.size_bytes, "category": allocation.category,
            "phase": allocation.phase, "op": allocation.op, "stack": list(allocation.stack)}


def _tensors_of(obj):
    """(tensor, category) pairs of a module, an optimizer, a tensor, or an iterable of them."""
    if isinstance(obj, torch.Tensor):
        yield obj, "tracked"
    elif isinstance(obj, torch.nn.Module):
        for name, param in obj.named_parameters():
            yield param, "weights/adapters" if "lora_" in name else "weights"
            if param.grad is not None:
                yield param.grad, "gradients"
        for _name, buffer in obj.named_buffers():
            yield buffer, "weights"
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    yield value, f"optimizer/{key}"
    elif isinstance(obj, (list, tuple, set)):
        for item in obj:
            yield from _tensors_of(item)
    else:
        raise TypeError(f"track() takes modules, optimizers and tensors, not {type(obj).__name__}")
