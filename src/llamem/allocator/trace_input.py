"""Replay input, read without torch and checked entry by entry.

Three inputs:
- a pickled snapshot from `torch.cuda.memory._dump_snapshot`, loaded with an unpickler that
  refuses every global (a snapshot holds only dicts, lists, tuples, strings and numbers, so
  nothing legitimate is lost, and a crafted pickle cannot run code);
- the same structure as JSON (`{"segments": [...], "device_traces": [[{"action": "alloc", ...}]]}`);
- an event trace from `llamem trace --save-trace` (`{"format": "llamem-trace-v1", "events": [...]}`).

Every problem raises TraceFormatError naming the entry, the field and what was expected.
The snapshot structure is the one `torch.cuda.memory._snapshot()` documents (torch/cuda/memory.py).
"""

from __future__ import annotations

import io
import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path

from llamem.errors import LlamemError
from llamem.units import MiB

SNAPSHOT_ACTIONS = frozenset({"alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
                              "segment_map", "segment_unmap", "snapshot", "oom"})
"""torch 2.13's trace actions (c10/core/CachingDeviceAllocator.h `parseTraceEntryAction`)."""
LEGACY_ACTIONS = frozenset({"user_defined"})
"""Written by torch 2.1-2.5 for record_function annotations; nothing to replay."""
SEGMENT_ACTIONS = frozenset({"segment_alloc", "segment_free", "segment_map", "segment_unmap"})
BLOCK_STATES = frozenset({"active_allocated", "active_pending_free", "active_awaiting_free", "inactive"})
"""`active_pending_free` is what the C++ writes; the docstring of `_snapshot` says `active_awaiting_free`."""
LLAMEM_ACTIONS = frozenset({"alloc", "free"})
_SIZE = "a non-negative integer (bytes)"
_ADDRESS = "a non-negative integer (an address)"


class TraceFormatError(LlamemError):
    """A file replay cannot read: says where, which field, and what was expected."""


@dataclass(frozen=True)
class AllocEvent:
    action: str  # "alloc" | "free"
    addr: int
    size: int
    stream: int = 0
    entry: int | None = field(default=None, compare=False)
    """Index of the device-trace entry this event comes from (None for events built in code)."""


@dataclass(frozen=True)
class Entry:
    """One device-trace entry that replay uses, its fields checked."""

    index: int
    action: str
    addr: int
    size: int
    stream: int
    device_free: int | None = None


@dataclass(frozen=True)
class BlockInfo:
    address: int
    size: int
    requested_size: int
    state: str

    @property
    def live(self) -> bool:
        return self.state != "inactive"


@dataclass(frozen=True)
class SegmentInfo:
    address: int
    total_size: int
    stream: int
    small: bool
    expandable: bool
    blocks: tuple[BlockInfo, ...]


@dataclass(frozen=True)
class ParsedSnapshot:
    label: str
    entries: tuple[Entry, ...]
    segments: tuple[SegmentInfo, ...] | None
    """The device's segments at capture time; None when the file has no 'segments'."""
    device: int = 0


class _NoGlobalsUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise TraceFormatError(f"refusing to load {module}.{name} from a pickle: a memory snapshot holds only "
                               "plain data, and this file asks to import code; it was not loaded")


MAX_TRACE_BYTES = 4 * 2**30
"""Trace files are read whole: a snapshot of a million entries is a few hundred MiB."""
_EXPECTED_FILE = ("expected a memory snapshot from torch.cuda.memory._dump_snapshot (pickle), its JSON form, "
                  "or the output of `llamem trace --save-trace`")


def read_data(path: str | Path):
    """The file's content as plain Python data (pickle or JSON), or TraceFormatError."""
    from llamem.files import read_limited

    path = Path(path)
    raw = read_limited(path, MAX_TRACE_BYTES, "allocation trace", TraceFormatError)
    if not raw.strip():
        raise TraceFormatError(f"{path}: the file is empty; {_EXPECTED_FILE}")
    if raw[:1] == b"\x80":  # pickle protocol 2 and later, as _dump_snapshot writes
        try:
            return _NoGlobalsUnpickler(io.BytesIO(raw)).load()
        except TraceFormatError:
            raise
        except Exception as err:  # a truncated or corrupt pickle fails in many ways
            raise TraceFormatError(f"{path}: not a readable pickle ({type(err).__name__}: {err}); "
                                   "the file may be truncated") from None
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as err:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise TraceFormatError(f"{path}: neither a pickled snapshot nor JSON ({err}); {_EXPECTED_FILE}") from None


def _kind(value) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number with a fraction", str: "a string",
             list: "a list", tuple: "a list", dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _shown(value) -> str:
    text = repr(value)
    return f"{text[:40]}... ({_kind(value)})" if len(text) > 40 else f"{text} ({_kind(value)})"


def _int(value, where: str, name: str, expected: str, *, minimum: int | None = 0) -> int:
    # bool is an int subclass in Python; True as a size is a mistake, not 1 byte.
    if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
        raise TraceFormatError(f"{where}: {name!r} must be {expected}, got {_shown(value)}")
    return value


def _get_int(item: dict, where: str, name: str, expected: str, *, default=None, minimum: int | None = 0) -> int:
    if name not in item:
        if default is not None:
            return default
        raise TraceFormatError(f"{where}: missing {name!r} (expected {expected})")
    return _int(item[name], where, name, expected, minimum=minimum)


def _dict(value, where: str, what: str) -> dict:
    if not isinstance(value, dict):
        raise TraceFormatError(f"{where}: expected {what} (an object), got {_shown(value)}")
    return value


def _list(value, where: str, what: str) -> list | tuple:
    if not isinstance(value, (list, tuple)):
        raise TraceFormatError(f"{where}: expected {what} (a list), got {_shown(value)}")
    return value


def top_level(data, label: str) -> dict:
    if isinstance(data, dict):
        return data
    hint = (" If it is one device's trace entries, wrap them: {\"device_traces\": [[...]]}."
            if isinstance(data, list) else "")
    raise TraceFormatError(f"{label}: the top level is {_kind(data)}; expected an object with 'device_traces' "
                           f"(a torch memory snapshot) or a llamem trace with 'format' and 'events'.{hint}")


def llamem_events(data: dict, label: str) -> list[AllocEvent]:
    """`llamem trace --save-trace` output: alloc and free, each with addr and size (nbytes: the request)."""
    events = []
    for index, item in enumerate(_list(data.get("events"), f"{label}: 'events'", "the events")):
        where = f"{label}: events[{index}]"
        item = _dict(item, where, "an event")
        action = item.get("action")
        if not isinstance(action, str) or action not in LLAMEM_ACTIONS:
            raise TraceFormatError(f"{where}: 'action' must be 'alloc' or 'free', got {_shown(action)}")
        addr = _get_int(item, where, "addr", _ADDRESS)
        size = _get_int(item, where, "size", _SIZE)
        nbytes = _get_int(item, where, "nbytes", _SIZE, default=size)
        events.append(AllocEvent(action, addr, nbytes, 0, index))
    return events


def parse_snapshot(data: dict, label: str) -> ParsedSnapshot:
    """The one device trace of a snapshot, and that device's segments."""
    if "device_traces" not in data:
        keys = ", ".join(repr(k) for k in list(data)[:6]) or "none"
        raise TraceFormatError(f"{label}: no 'device_traces' (keys found: {keys}); expected a torch memory "
                               "snapshot or a llamem trace (`llamem trace --save-trace`, format llamem-trace-v1)")
    traces = _list(data["device_traces"], f"{label}: 'device_traces'", "one list of entries per device")
    for device, trace in enumerate(traces):
        _list(trace, f"{label}: device_traces[{device}]", "the entries of one device")
    used = [device for device, trace in enumerate(traces) if trace]
    if len(used) > 1:
        raise TraceFormatError(f"{label}: holds traces of {len(used)} devices; replay one at a time")
    device = used[0] if used else 0
    entries = tuple(_entries(traces[device], f"{label}: device_traces[{device}]")) if used else ()
    segments = _segments(data["segments"], label, device) if "segments" in data else None
    return ParsedSnapshot(label, entries, segments, device)


def _entries(trace, where: str):
    for index, item in enumerate(trace):
        entry_where = f"{where}[{index}]"
        item = _dict(item, entry_where, "a trace entry")
        action = item.get("action")
        if not isinstance(action, str):
            raise TraceFormatError(f"{entry_where}: 'action' must be a string, got {_shown(action)}")
        if action in LEGACY_ACTIONS or action == "snapshot":
            continue
        if action not in SNAPSHOT_ACTIONS:
            raise TraceFormatError(f"{entry_where}: unknown action {action!r}; torch writes "
                                   f"{', '.join(sorted(SNAPSHOT_ACTIONS))}")
        entry_where = f"{entry_where} ({action})"
        stream = _get_int(item, entry_where, "stream", "an integer (a stream)", default=0, minimum=None)
        size = _get_int(item, entry_where, "size", _SIZE)
        if action == "oom":
            # torch writes the free device memory in place of the address (torch/csrc/cuda/Module.cpp)
            free = _get_int(item, entry_where, "device_free", "a non-negative integer (free bytes)")
            yield Entry(index, action, 0, size, stream, free)
        else:
            yield Entry(index, action, _get_int(item, entry_where, "addr", _ADDRESS), size, stream)


def _segments(value, label: str, device: int) -> tuple[SegmentInfo, ...]:
    segments = []
    for index, item in enumerate(_list(value, f"{label}: 'segments'", "the segments")):
        where = f"{label}: segments[{index}]"
        item = _dict(item, where, "a segment")
        if _get_int(item, where, "device", "an integer (a device index)", default=device) != device:
            continue
        total = _get_int(item, where, "total_size", _SIZE)
        kind = item.get("segment_type", "small" if total <= 2 * MiB else "large")  # kSmallBuffer
        if kind not in ("small", "large"):
            raise TraceFormatError(f"{where}: 'segment_type' must be 'small' or 'large', got {_shown(kind)}")
        expandable = item.get("is_expandable", False)
        if not isinstance(expandable, bool):
            raise TraceFormatError(f"{where}: 'is_expandable' must be true or false, got {_shown(expandable)}")
        blocks = tuple(_blocks(item.get("blocks", []), where))
        segments.append(SegmentInfo(_get_int(item, where, "address", _ADDRESS), total,
                                    _get_int(item, where, "stream", "an integer (a stream)", default=0, minimum=None),
                                    kind == "small", expandable, blocks))
    return tuple(segments)


def _blocks(value, segment_where: str):
    for index, item in enumerate(_list(value, f"{segment_where}.blocks", "the segment's blocks")):
        where = f"{segment_where}.blocks[{index}]"
        item = _dict(item, where, "a block")
        state = item.get("state")
        if not isinstance(state, str) or state not in BLOCK_STATES:
            raise TraceFormatError(f"{where}: 'state' must be one of {', '.join(sorted(BLOCK_STATES))}, "
                                   f"got {_shown(state)}")
        yield BlockInfo(_get_int(item, where, "address", _ADDRESS), _get_int(item, where, "size", _SIZE),
                        _get_int(item, where, "requested_size", _SIZE, default=0), state)
