"""Replay input, checked entry by entry: every problem is a TraceFormatError that names the entry,
the field and what was expected; entries replay does not use are skipped."""

import json
import pickle

import pytest

from llamem.allocator.replay import TraceFormatError, events_from_data, load_events, load_trace
from llamem.cli import main

MiB = 2**20


def alloc(**fields):
    return {"action": "alloc", "addr": 1, "size": 1000, "stream": 0, **fields}


def snap(*entries):
    return {"device_traces": [list(entries)]}


@pytest.mark.parametrize("data, message", [
    ([alloc()], "the top level is a list; expected an object with 'device_traces'"),
    ([alloc()], "wrap them: {\"device_traces\": [[...]]}"),
    ("device_traces", "the top level is a string"),
    (42, "the top level is an integer"),
    ({}, "no 'device_traces' (keys found: none)"),
    ({"format": "llamem-trace-v9", "events": []}, "unknown format 'llamem-trace-v9'"),
    ({"device_traces": 5}, "'device_traces': expected one list of entries per device (a list), got 5 (an integer)"),
    ({"device_traces": [5]}, "device_traces[0]: expected the entries of one device (a list), got 5"),
    ({"device_traces": [[alloc(), 5]]}, "device_traces[0][1]: expected a trace entry (an object), got 5"),
    (snap(alloc(), {"addr": 1}), "device_traces[0][1]: 'action' must be a string, got None (null)"),
    (snap(alloc(action="explode")), "device_traces[0][0]: unknown action 'explode'; torch writes alloc, "),
    (snap({"action": "alloc", "addr": 1}), "device_traces[0][0] (alloc): missing 'size' (expected a non-negative "
                                           "integer (bytes))"),
    (snap(alloc(size=-1)), "(alloc): 'size' must be a non-negative integer (bytes), got -1 (an integer)"),
    (snap(alloc(size=1.5)), "'size' must be a non-negative integer (bytes), got 1.5 (a number with a fraction)"),
    (snap(alloc(size="1000")), "'size' must be a non-negative integer (bytes), got '1000' (a string)"),
    (snap(alloc(size=True)), "'size' must be a non-negative integer (bytes), got True (a boolean)"),
    (snap(alloc(addr=-5)), "'addr' must be a non-negative integer (an address), got -5"),
    (snap(alloc(addr=None)), "'addr' must be a non-negative integer (an address), got None (null)"),
    (snap({"action": "alloc", "size": 10}), "device_traces[0][0] (alloc): missing 'addr'"),
    (snap(alloc(stream="s")), "'stream' must be an integer (a stream), got 's' (a string)"),
    (snap(alloc(), {"action": "free_requested", "addr": 1}), "device_traces[0][1] (free_requested): missing 'size'"),
    (snap(alloc(), {"action": "free_completed", "addr": 1, "size": False}), "[1] (free_completed): 'size' must be"),
    (snap(alloc(), {"action": "oom", "size": 10}), "device_traces[0][1] (oom): missing 'device_free'"),
    (snap(alloc(), {"action": "segment_alloc", "addr": 1, "size": -2}), "(segment_alloc): 'size' must be"),
    ({**snap(alloc()), "segments": {}}, "'segments': expected the segments (a list), got {} (an object)"),
    ({**snap(alloc()), "segments": [{"address": 0}]}, "segments[0]: missing 'total_size'"),
    ({**snap(alloc()), "segments": [{"address": 0, "total_size": 10, "segment_type": "huge"}]},
     "segments[0]: 'segment_type' must be 'small' or 'large', got 'huge'"),
    ({**snap(alloc()), "segments": [{"address": 0, "total_size": 10, "blocks": [
        {"address": 0, "size": 10, "state": "busy"}]}]}, "segments[0].blocks[0]: 'state' must be one of"),
    ({**snap(alloc()), "segments": [{"address": 0, "total_size": 10, "blocks": [
        {"address": 0, "size": 1.0, "state": "inactive"}]}]}, "segments[0].blocks[0]: 'size' must be"),
    ({"device_traces": [[alloc()], [alloc()]]}, "holds traces of 2 devices; replay one at a time"),
    ({"format": "llamem-trace-v1", "events": {}}, "'events': expected the events (a list)"),
    ({"format": "llamem-trace-v1", "events": [{"action": "alloc", "addr": 0, "size": 8}, {"action": "malloc"}]},
     "events[1]: 'action' must be 'alloc' or 'free', got 'malloc'"),
    ({"format": "llamem-trace-v1", "events": [{"action": "alloc", "addr": 0, "size": -3}]},
     "events[0]: 'size' must be a non-negative integer (bytes), got -3"),
    ({"format": "llamem-trace-v1", "events": [{"action": "alloc", "addr": 0, "size": 8, "nbytes": True}]},
     "events[0]: 'nbytes' must be a non-negative integer (bytes), got True (a boolean)"),
    ({"format": "llamem-trace-v1", "events": [{"action": "free", "addr": 0}]}, "events[0]: missing 'size'"),
])
def test_bad_input_names_entry_field_and_expectation(data, message):
    with pytest.raises(TraceFormatError) as err:
        events_from_data(data, "t.json")
    assert str(err.value).startswith("t.json: ")
    assert message in str(err.value)


def test_actions_replay_does_not_use_are_skipped():
    entries = [
        {"action": "segment_alloc", "addr": 100, "size": 20 * MiB, "stream": 0},
        {"action": "segment_map", "addr": 500, "size": 20 * MiB, "stream": 0},
        alloc(addr=100, size=5 * MiB),
        {"action": "snapshot", "addr": 0, "size": 0, "stream": 0},
        {"action": "user_defined", "addr": 0, "size": 0, "stream": 0},  # torch 2.1-2.5 annotations
        {"action": "oom", "size": 40 * MiB, "stream": 0, "device_free": 0},
        {"action": "free_requested", "addr": 100, "size": 5 * MiB, "stream": 0},
        {"action": "free_completed", "addr": 100, "size": 5 * MiB, "stream": 0},
        {"action": "segment_unmap", "addr": 500, "size": 20 * MiB, "stream": 0},
        {"action": "segment_free", "addr": 100, "size": 20 * MiB, "stream": 0},
    ]
    events = events_from_data(snap(*entries))
    assert [(e.action, e.addr, e.entry) for e in events] == [("alloc", 100, 2), ("free", 100, 7)]


def test_free_requested_counts_when_no_free_completes():
    events = events_from_data(snap(alloc(), {"action": "free_requested", "addr": 1, "size": 1000}))
    assert [e.action for e in events] == ["alloc", "free"]


@pytest.mark.parametrize("content, message", [
    (b"", "the file is empty"),
    (b"  \n\t", "the file is empty"),
    (b"\x00\xff\xfe\x13garbage", "neither a pickled snapshot nor JSON"),
    (b"{\"device_traces\": [[", "neither a pickled snapshot nor JSON"),
    (pickle.dumps(snap(alloc()))[:-7], "not a readable pickle"),
    (pickle.dumps([alloc()]), "the top level is a list"),
    (pickle.dumps({"device_traces": [[alloc(size=-4)]]}), "device_traces[0][0] (alloc): 'size' must be"),
    (json.dumps(3).encode(), "the top level is an integer"),
])
def test_bad_files(tmp_path, content, message):
    path = tmp_path / "trace.bin"
    path.write_bytes(content)
    with pytest.raises(TraceFormatError) as err:
        load_events(path)
    assert message in str(err.value) and str(path) in str(err.value)


def test_unreadable_paths(tmp_path):
    with pytest.raises(TraceFormatError, match="no such file"):
        load_trace(tmp_path / "missing.json")
    with pytest.raises(TraceFormatError, match="cannot be read"):
        load_trace(tmp_path)


def test_pickled_tuples_and_extra_fields_are_fine(tmp_path):
    """What torch writes: tuples (segment_pool_id), frames, time_us, compile_context."""
    data = {"segments": [{"device": 0, "address": 0, "total_size": 2 * MiB, "stream": 0, "segment_type": "small",
                          "segment_pool_id": (0, 0), "allocated_size": 1024, "active_size": 1024,
                          "requested_size": 1000, "frames": [], "is_expandable": False,
                          "blocks": [{"address": 0, "size": 1024, "requested_size": 1000, "state": "active_allocated",
                                      "frames": [{"filename": "x.py", "line": 1, "name": "f"}]},
                                     {"address": 1024, "size": 2 * MiB - 1024, "requested_size": 0,
                                      "state": "inactive", "frames": []}]}],
            "device_traces": [[{**alloc(addr=0), "time_us": 5, "frames": [], "compile_context": "N/A",
                                "user_metadata": ""}]],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": ""}}
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(data))
    trace = load_trace(path)
    assert len(trace.events) == 1 and trace.start is None


def test_segments_of_other_devices_are_ignored():
    data = {**snap(alloc()), "segments": [{"device": 1, "address": 0, "total_size": 7}]}
    assert len(events_from_data(data)) == 1


def test_cli_reports_the_entry_with_exit_code_1(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps(snap(alloc(), alloc(addr=2, size=-1))))
    assert main(["allocator", "replay", str(path)]) == 1
    err = capsys.readouterr().err
    assert "device_traces[0][1] (alloc): 'size' must be a non-negative integer" in err
