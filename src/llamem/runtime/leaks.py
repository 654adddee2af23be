"""Leak detection: memory allocated at the same point of every step (its end, after the optimizer)
should stay flat once the optimizer state exists; growth at each of `window` consecutive steps is
a leak, reported once, with where the tensors still alive were created.

Where they were created comes from the CpuMemoryTracker's creation stacks on CPU
(`record_stacks=True`), and on CUDA from the allocation stacks that
`torch.cuda.memory._record_memory_history` puts in `torch.cuda.memory._snapshot()`.
Typical causes: a list of losses kept as tensors (`losses.append(loss)` keeps each step's loss
alive: use `loss.item()` or `loss.detach()`), a growing cache, a tensor stored on `self`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from llamem.units import format_bytes

MAX_SOURCES = 10
"""Groups of creation stacks a leak report keeps: the most repeated, then the largest."""
MESSAGE_SOURCES = 3
_LIBRARY_FRAMES = ("/torch/", "/transformers/", "/accelerate/", "/llamem/runtime/", "/contextlib.py", "/threading.py")
"""Frames that say how an allocation happened, not where the caller asked for it."""


class LeakWarning(UserWarning):
    """Memory allocated at the end of a step grew at each of several consecutive steps."""


@dataclass(frozen=True, slots=True)
class StepMark:
    """What is known at the end of one step."""

    step: int
    allocated_bytes: int
    shape: tuple | None
    position: int
    """Where the memory source's history stood: the tracker's next record id, or CUDA's time in µs."""


@dataclass(frozen=True)
class Leak:
    first: StepMark
    last: StepMark
    sources: list[dict] = field(default_factory=list)
    """{"bytes", "count", "category", "stack"} per creation stack, most repeated first."""
    stacks_hint: str | None = None
    """Why no creation stacks are known, and how to get them."""

    @property
    def steps(self) -> int:
        return self.last.step - self.first.step + 1

    @property
    def live_growth_bytes(self) -> int:
        return self.last.allocated_bytes - self.first.allocated_bytes

    @property
    def growth_bytes_per_step(self) -> int:
        return self.live_growth_bytes // max(1, self.steps - 1)

    def record(self) -> dict:
        """The `leak` line of the monitor's log."""
        return {"type": "leak", "step": self.last.step, "steps": self.steps,
                "growth_bytes_per_step": self.growth_bytes_per_step, "live_growth_bytes": self.live_growth_bytes,
                "sources": self.sources}

    def message(self) -> str:
        lines = [(f"memory allocated at the end of a step grew at each of {self.steps} steps "
                  f"(steps {self.first.step}-{self.last.step}): +{format_bytes(self.growth_bytes_per_step)} per step, "
                  f"+{format_bytes(self.live_growth_bytes)} in all.")]
        if self.sources:
            lines.append(f"Tensors created since step {self.first.step} and still alive:")
            for source in self.sources[:MESSAGE_SOURCES]:
                lines.append(f"  {format_bytes(source['bytes'])} in {source['count']} tensor(s) ({source['category']}), "
                             "created at:")
                lines += [f"    {frame}" for frame in reversed(source["stack"])] or ["    (no stack)"]
            # The stack is the tensor's birth, not what keeps it: say so, or the forward's line reads as the bug.
            lines.append("Each stack is where the tensors were created; what keeps them alive is a reference your "
                         "code holds (a list, a dict, an attribute).")
        if self.stacks_hint:
            lines.append(self.stacks_hint)
        lines.append("Keep numbers, not tensors, across steps: loss.item() or loss.detach(), not loss.")
        return "\n".join(lines)


class LeakDetector:
    """Growth of the end-of-step allocated bytes at each of `window` consecutive steps of one batch
    shape, reported once. A new batch shape restarts the count: the batch alive at the end of a
    step differs in size from one shape to the next, which is not a leak."""

    def __init__(self, window: int) -> None:
        self.window = window
        self.reported = False
        self._streak: deque[StepMark] = deque(maxlen=window)

    def observe(self, mark: StepMark) -> tuple[StepMark, StepMark] | None:
        """The first and last step of a leak the first time `window` growing steps are seen."""
        last = self._streak[-1] if self._streak else None
        if last is None or mark.shape != last.shape or mark.allocated_bytes <= last.allocated_bytes:
            self._streak.clear()
        self._streak.append(mark)
        if self.reported or len(self._streak) < self.window:
            return None
        self.reported = True
        return self._streak[0], self._streak[-1]


def tracker_sources(tracker, since_record_id: int) -> list[dict]:
    """The tracker's allocations created at or after `since_record_id` and still alive, grouped by
    category and creation stack."""
    groups: dict[tuple, dict] = {}
    for allocation in tracker.live_allocations():
        if allocation.record_id >= since_record_id:
            _add(groups, allocation.category, allocation.stack, allocation.size_bytes)
    return _ranked(groups)


def cuda_sources(snapshot: dict, since_us: int, device: int) -> list[dict]:
    """Blocks allocated at or after `since_us` (trace time, µs since the epoch) and not freed since,
    grouped by their Python allocation stack (torch.cuda.memory._record_memory_history)."""
    alive: dict[int, dict] = {}
    traces = snapshot.get("device_traces") or []
    for entry in traces[device] if device < len(traces) else []:
        if entry.get("action") == "alloc" and entry.get("time_us", 0) >= since_us:
            alive[entry["addr"]] = entry
        elif entry.get("action") in ("free_requested", "free_completed"):
            alive.pop(entry.get("addr"), None)
    groups: dict[tuple, dict] = {}
    for entry in alive.values():
        frames = [f"{f.get('filename')}:{f.get('line')} in {f.get('name')}" for f in entry.get("frames", [])]
        # CUDA lists the innermost frame first; the tracker's stacks end with it.
        _add(groups, "cuda", tuple(_user_frames(reversed(frames))), entry.get("size", 0))
    return _ranked(groups)


def _user_frames(frames) -> list[str]:
    return [frame for frame in frames if not any(part in frame for part in _LIBRARY_FRAMES)][-6:]


def _add(groups: dict, category: str, stack: tuple[str, ...], size_bytes: int) -> None:
    group = groups.setdefault((category, stack), {"bytes": 0, "count": 0, "category": category,
                                                  "stack": list(stack)})
    group["bytes"] += size_bytes
    group["count"] += 1


def _ranked(groups: dict) -> list[dict]:
    # A leak adds one tensor per step: the most repeated stack is the likeliest culprit (the batch of
    # the last step is alive too, once).
    return sorted(groups.values(), key=lambda g: (-g["count"], -g["bytes"]))[:MAX_SOURCES]
