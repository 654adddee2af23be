"""`llamem allocator replay`: output paths checked before the replay, exit code 3 for a simulated
out-of-memory error, sizes with units, and JSON keys kept."""

import json
import os

import pytest

from llamem.allocator.replay import load_trace, replay_trace
from llamem.cli import main

MiB = 2**20
TODAY_KEYS = {"num_events", "events_replayed", "peak_allocated_bytes", "peak_reserved_bytes", "num_segments",
              "num_segments_at_end", "num_alloc_retries", "num_ooms", "oom", "fragmentation", "allocator_settings",
              "memory_stats", "warnings", "advice"}


def run(argv: list[str]) -> int:
    """The exit code `llamem` would end with (a command may end the process with sys.exit)."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


@pytest.fixture
def trace_file(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"device_traces": [[{"action": "alloc", "addr": i, "size": s, "stream": 0}
                                                   for i, s in enumerate((1000, 3 * MiB, 3 * MiB, 25 * MiB))]]}))
    return path


@pytest.mark.parametrize("where, message", [
    ("folder", "is a folder; give a file name in it"),
    ("missing/out.pickle", "does not exist; create it first"),
    ("a_file/out.pickle", "is not a folder"),
])
def test_snapshot_out_is_checked_before_the_trace_is_read(tmp_path, capsys, where, message):
    (tmp_path / "folder").mkdir()
    (tmp_path / "a_file").write_text("x")
    target = tmp_path / where
    # The trace does not exist: the output path must be refused first.
    assert run(["allocator", "replay", str(tmp_path / "nothing.json"), "--snapshot-out", str(target)]) == 1
    err = capsys.readouterr().err
    assert f"--snapshot-out {target}: " in err and message in err and "no such file" not in err


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() == 0, reason="root may write anywhere")
def test_snapshot_out_in_a_read_only_folder(tmp_path, trace_file, capsys):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        assert run(["allocator", "replay", str(trace_file), "--snapshot-out", str(folder / "s.pickle")]) == 1
    finally:
        folder.chmod(0o700)
    assert "cannot be written by this user" in capsys.readouterr().err


def test_snapshot_out_round_trips(tmp_path, trace_file):
    out = tmp_path / "s.pickle"
    assert run(["allocator", "replay", str(trace_file), "--snapshot-out", str(out)]) == 0
    again = replay_trace(load_trace(out))
    assert again.peak_allocated_bytes > 0  # the exported state loads as a snapshot


def test_oom_exits_3_with_one_json_document(trace_file, capsys):
    assert run(["allocator", "replay", str(trace_file), "--capacity", "30MiB", "--json"]) == 3
    data = json.loads(capsys.readouterr().out)  # one document: the report
    assert data["oom"]["event_index"] == 3 and data["oom"]["entry_index"] == 3
    assert data["capacity_bytes"] == 30 * MiB and not data["capacity_inferred"]


def test_json_keys_are_a_superset(trace_file, capsys):
    assert run(["allocator", "replay", str(trace_file), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert TODAY_KEYS <= set(data)
    assert {"advice_summary", "capacity_bytes", "capacity_inferred", "start_state"} <= set(data)


@pytest.mark.parametrize("argv, message", [
    (["--capacity", "24"], "--capacity '24' has no unit"),
    (["--device-total", "80"], "--device-total '80' has no unit"),
    (["--capacity", "lots"], "cannot read --capacity 'lots'"),
    (["--capacity", "90GiB", "--device-total", "80GiB"], "--capacity 90GiB (90.00 GiB) is more than --device-total"),
])
def test_sizes_need_units(trace_file, capsys, argv, message):
    assert run(["allocator", "replay", str(trace_file), *argv]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("backend", ["cudaMallocAsync", "hipMallocAsync"])
def test_malloc_async_backend_is_refused_before_reading(tmp_path, capsys, backend):
    assert run(["allocator", "replay", str(tmp_path / "nothing.json"), "--config", f"backend:{backend}"]) == 1
    err = capsys.readouterr().err
    assert f"backend:{backend} cannot be simulated" in err and "policy is not public" in err
    assert f"Drop backend:{backend}" in err and "backend:native" in err
