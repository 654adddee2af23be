"""Snapshots whose trace starts late (the ring buffer of `_record_memory_history(max_entries=N)`
wrapped): the state at the first entry is rebuilt from the segments, and a trace that ends with
torch's `oom` entry is replayed within the capacity it implies, running out at that entry.

The snapshots come from the simulator itself, in the structure of torch.cuda.memory._snapshot():
a program runs through a recording simulator, is exported, and keeps only its last N entries."""

import json
import pickle

import pytest

from llamem.allocator import CachingAllocatorSim, SimulatedOOM, parse_alloc_conf
from llamem.allocator.replay import load_trace, replay, replay_trace, trace_from_data
from llamem.allocator.snapshot import snapshot
from llamem.cli import main

MiB = 2**20
CAPACITY = 1200 * MiB
WINDOWS = (40, 75, 120, 160)


def _program() -> list[tuple[str, int, int]]:
    """Weights and buffers (some freed early), training steps whose activations grow, then one
    allocation more than the card can hold. Deterministic; sizes in bytes."""
    ops, live, next_id = [], [], 0

    def alloc(size):
        nonlocal next_id
        ops.append(("alloc", next_id, size))
        live.append(next_id)
        next_id += 1
        return next_id - 1

    for n in range(24):  # weights, some small, some large, and scratch buffers freed at once
        alloc((3 + 5 * (n % 7)) * MiB + 4096 * n)
        if n % 4 == 3:
            ops.append(("free", live.pop(-2), 0))
    for step in range(6):
        acts = [alloc((6 + step + 3 * k) * MiB + 1000 * k) for k in range(5)]
        acts += [alloc(200 * 1024 + 512 * k) for k in range(3)]
        for act in reversed(acts):
            ops.append(("free", act, 0))
            live.remove(act)
    alloc(900 * MiB)  # does not fit
    return ops


def _record(ops, capacity=CAPACITY, conf="") -> CachingAllocatorSim:
    sim = CachingAllocatorSim(parse_alloc_conf(conf), capacity_bytes=capacity, record_trace=True)
    blocks = {}
    for action, key, size in ops:
        if action == "alloc":
            try:
                blocks[key] = sim.malloc(size)
            except SimulatedOOM:
                break
        else:
            sim.free(blocks.pop(key))
    return sim


def _wrapped(snap: dict, keep: int) -> dict:
    out = dict(snap)
    out["device_traces"] = [snap["device_traces"][0][-keep:]]
    return out


def _write(tmp_path, data: dict, kind: str):
    path = tmp_path / f"snap.{kind}"
    if kind == "json":
        path.write_text(json.dumps(data))
    else:
        path.write_bytes(pickle.dumps(data))
    return path


@pytest.fixture(scope="module")
def recorded() -> dict:
    sim = _record(_program())
    assert sim.num_ooms == 1
    snap = snapshot(sim)
    assert snap["device_traces"][0][-1]["action"] == "oom"
    return snap


@pytest.mark.parametrize("kind", ["json", "pickle"])
@pytest.mark.parametrize("keep", WINDOWS)
def test_wrapped_snapshot_runs_out_at_the_oom_entry_with_the_full_peaks(recorded, tmp_path, kind, keep):
    full = replay_trace(load_trace(_write(tmp_path, recorded, kind)))
    assert full.capacity_bytes == CAPACITY and full.capacity_inferred
    assert full.oom_entry_index == len(recorded["device_traces"][0]) - 1

    trace = load_trace(_write(tmp_path, _wrapped(recorded, keep), kind))
    assert trace.start is not None and trace.oom_capacity_bytes == CAPACITY
    result = replay_trace(trace)
    assert result.oom_entry_index == keep - 1  # the oom entry is the last one kept
    assert result.oom_event_index == result.num_events - 1
    assert (result.peak_reserved_bytes, result.peak_allocated_bytes) == (full.peak_reserved_bytes,
                                                                          full.peak_allocated_bytes)
    assert result.oom_message == full.oom_message
    assert any("rebuilt from the snapshot's segments" in w for w in result.warnings)
    assert any("capacity inferred from the out-of-memory error" in w for w in result.warnings)


def test_the_window_alone_misses_the_memory_before_it(recorded):
    """What replay did before: only the window's events; the OOM is not reproduced."""
    events = trace_from_data(_wrapped(recorded, 75)).events
    alone = replay(events, capacity_bytes=CAPACITY)
    assert alone.completes
    assert any("never allocated in this trace" in w for w in alone.warnings)


def test_full_trace_needs_no_start_state(recorded):
    trace = trace_from_data(recorded)
    assert trace.start is None and not trace.notes
    assert trace.failed_alloc is not None and trace.failed_alloc.size == 900 * MiB


def test_start_state_is_the_state_at_the_first_kept_entry(recorded):
    """Cut where an operation ends: the rebuilt state equals the simulator's own state there."""
    entries = recorded["device_traces"][0]
    ops = _program()
    done, cut = 0, None
    for index, entry in enumerate(entries):
        if entry["action"] in ("alloc", "free_completed"):
            done += 1
            if done == 40:
                cut = index + 1
                break
    expected = snapshot(_record(ops[:40]))["segments"]
    start = trace_from_data(_wrapped(recorded, len(entries) - cut)).start
    rebuilt = snapshot(replay([], start=start).sim)["segments"]
    assert rebuilt == expected


def test_wrapped_trace_without_an_oom_ends_in_the_recorded_state(recorded):
    ops = _program()[:-1]
    sim = _record(ops)
    snap = snapshot(sim)
    result = replay_trace(trace_from_data(_wrapped(snap, 60)))
    assert result.completes and result.capacity_bytes is None
    assert result.sim.allocated_bytes == sim.allocated_bytes
    assert result.sim.reserved_bytes == sim.reserved_bytes
    assert not any("never allocated" in w for w in result.warnings)


def test_capacity_given_overrides_the_inferred_one(recorded):
    result = replay_trace(trace_from_data(_wrapped(recorded, 75)), capacity_bytes=4 * CAPACITY)
    assert result.completes and not result.capacity_inferred
    assert any("torch ran out of memory at entry 74; the simulation does not" in w for w in result.warnings)


def test_expandable_segments_blocks_are_allocated_first():
    conf = "expandable_segments:True"
    snap = snapshot(_record(_program(), conf=conf))
    trace = trace_from_data(_wrapped(snap, 75))
    assert trace.start.segments == () and len(trace.start.loose) > 0
    assert any("expandable segments" in note for note in trace.notes)
    result = replay_trace(trace, parse_alloc_conf(conf))
    assert not result.completes  # 900 MiB cannot fit next to what was live


def test_oom_without_segments_infers_the_capacity_from_segment_entries(recorded):
    data = {"device_traces": recorded["device_traces"]}  # no 'segments': the running total of segment entries
    trace = trace_from_data(data)
    assert trace.oom_capacity_bytes == CAPACITY
    assert replay_trace(trace).oom_entry_index == len(data["device_traces"][0]) - 1


def test_oom_with_nothing_to_infer_from_says_so():
    entries = [{"action": "alloc", "addr": 0, "size": 10 * MiB, "stream": 0},
               {"action": "oom", "size": 20 * MiB, "stream": 0, "device_free": MiB}]
    result = replay_trace(trace_from_data({"device_traces": [entries]}))
    assert result.completes and result.num_events == 1  # the refused allocation is not replayed
    assert any("pass --capacity to reproduce it" in w for w in result.warnings)
    with_capacity = replay_trace(trace_from_data({"device_traces": [entries]}), capacity_bytes=25 * MiB)
    assert with_capacity.oom_entry_index == 1


def test_hand_built_wrapped_json_without_segments():
    entries = [{"action": "free_requested", "addr": 7, "size": 30 * MiB, "stream": 0},
               {"action": "alloc", "addr": 8, "size": 12 * MiB, "stream": 0}]
    trace = trace_from_data({"device_traces": [entries]})
    assert [b.address for b in trace.start.loose] == [7]
    result = replay_trace(trace)
    assert result.peak_allocated_bytes == 30 * MiB  # the window alone would say 12 MiB
    assert result.warnings[0].startswith("the trace starts after") and "the file has no segments" in result.warnings[0]
    assert [e.action for e in trace.events] == ["free", "alloc"]


def test_cli_reproduces_the_oom_of_a_wrapped_pickle(recorded, tmp_path, capsys):
    path = _write(tmp_path, _wrapped(recorded, 75), "pickle")
    try:
        code = main(["allocator", "replay", str(path), "--json"])
    except SystemExit as exit_:
        code = exit_.code
    data = json.loads(capsys.readouterr().out)
    assert code == 3
    assert data["oom"]["entry_index"] == 74 and data["capacity_inferred"] and data["capacity_bytes"] == CAPACITY
    assert data["start_state"]["segments"] > 0
    assert any("rebuilt from the snapshot's segments" in w for w in data["warnings"])
    assert data["advice_summary"] and all(a["completes"] for a in data["advice"])


def test_every_replay_of_a_wrapped_trace_starts_from_one_layout(recorded):
    """Sizes known only from frees are settled once, under the settings replayed first."""
    trace = trace_from_data(_wrapped(recorded, 120))
    assert any(b.size == 0 for s in trace.start.segments for b in s.blocks)
    result = replay_trace(trace)
    assert all(b.size > 0 for s in result.start.segments for b in s.blocks)
    other = replay([], parse_alloc_conf("max_split_size_mb:64"), start=result.start)
    same = replay([], start=result.start)
    assert snapshot(other.sim)["segments"] == snapshot(same.sim)["segments"]
