"""`torch.cuda.empty_cache()` during a replay (`llamem allocator replay --empty-cache-every N`): hand-built
event lists whose figures are derived by hand, and the command line on a `llamem trace --save-trace` file."""

import json

import pytest

from llamem.allocator.replay import AllocEvent, empty_cache_comparison, replay
from llamem.cli import main

MiB = 2**20


def alloc(addr: int, size: int) -> AllocEvent:
    return AllocEvent("alloc", addr, size)


def free(addr: int) -> AllocEvent:
    return AllocEvent("free", addr, 0)


def run(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def test_emptying_the_cache_lowers_peak_reserved():
    # 25 MiB (>= 10 MiB) gets a segment rounded up to 2 MiB: 26 MiB. Once freed it is cached, and too
    # small for 30 MiB, which gets a 30 MiB segment: 26 + 30 = 56 MiB reserved. Emptied before the
    # second allocation, the 26 MiB segment goes back first: the peak is 30 MiB.
    events = [alloc(1, 25 * MiB), free(1), alloc(2, 30 * MiB), free(2)]
    without = replay(events)
    emptied = replay(events, empty_cache_every=1)
    assert without.peak_reserved_bytes == 56 * MiB
    assert emptied.peak_reserved_bytes == 30 * MiB
    assert emptied.num_empty_cache_calls == 1
    assert (without.sim.num_device_alloc, emptied.sim.num_device_alloc) == (2, 2)
    assert (without.sim.num_device_free, emptied.sim.num_device_free) == (0, 1)
    assert without.peak_allocated_bytes == emptied.peak_allocated_bytes == 30 * MiB


def test_emptying_the_cache_costs_cudamalloc_calls():
    # 3 MiB (1 to 10 MiB) gets a 20 MiB segment. Without emptying, the cached segment serves all three
    # allocations: one cudaMalloc. Emptied before the 2nd and 3rd, each needs a new one: three.
    events = [alloc(1, 3 * MiB), free(1), alloc(2, 3 * MiB), free(2), alloc(3, 3 * MiB), free(3)]
    without = replay(events)
    emptied = replay(events, empty_cache_every=1)
    assert (without.sim.num_device_alloc, emptied.sim.num_device_alloc) == (1, 3)
    assert without.peak_reserved_bytes == emptied.peak_reserved_bytes == 20 * MiB
    assert emptied.num_empty_cache_calls == 2
    compare = empty_cache_comparison(without, emptied)
    assert compare == {
        "every_allocations": 1, "num_calls": 2,
        "with": {"peak_reserved_bytes": 20 * MiB, "peak_allocated_bytes": 3 * MiB, "num_device_alloc": 3,
                 "num_device_free": 2, "oom_event_index": None},
        "without": {"peak_reserved_bytes": 20 * MiB, "peak_allocated_bytes": 3 * MiB, "num_device_alloc": 1,
                    "num_device_free": 0, "oom_event_index": None},
    }


def test_the_cache_is_emptied_after_every_n_allocations_and_the_frees_after_them():
    # Four 3 MiB allocations, each freed; every 2: emptied once, before the 3rd allocation.
    events = [e for i in range(4) for e in (alloc(i, 3 * MiB), free(i))]
    emptied = replay(events, empty_cache_every=2)
    assert emptied.num_empty_cache_calls == 1
    assert emptied.sim.num_device_alloc == 2  # the 1st allocation, and the 3rd after the cache was emptied
    assert replay(events, empty_cache_every=4).num_empty_cache_calls == 0


def test_a_segment_with_a_live_block_is_kept():
    # Two 3 MiB blocks share one 20 MiB segment; with one still live the segment cannot go back.
    events = [alloc(1, 3 * MiB), alloc(2, 3 * MiB), free(1), alloc(3, 3 * MiB)]
    emptied = replay(events, empty_cache_every=1)
    assert emptied.num_empty_cache_calls == 2
    assert emptied.sim.num_device_alloc == 1
    assert emptied.sim.num_device_free == 0
    assert emptied.peak_reserved_bytes == 20 * MiB


def test_a_negative_count_is_refused():
    with pytest.raises(Exception, match="empty_cache_every must be 0"):
        replay([alloc(1, 512)], empty_cache_every=-1)


@pytest.fixture(scope="module")
def saved_trace(tmp_path_factory):
    pytest.importorskip("torch")
    path = tmp_path_factory.mktemp("trace") / "debug-lora.json"
    assert run(["trace", "debug", "--task", "lora", "--optimizer", "adamw", "--batch", "2", "--seq", "256",
                "--save-trace", str(path)]) == 0
    return path


def test_cli_compares_with_and_without(saved_trace, capsys):
    capsys.readouterr()
    assert run(["allocator", "replay", str(saved_trace), "--empty-cache-every", "1", "--no-advise", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    compare = data["empty_cache"]
    # The replay without emptying is the normal one.
    assert compare["without"]["peak_reserved_bytes"] == data["peak_reserved_bytes"] == 52 * MiB
    assert compare["without"]["num_device_alloc"] == data["memory_stats"]["num_device_alloc"] == 17
    assert compare["with"]["peak_reserved_bytes"] == 50 * MiB
    assert compare["with"]["num_device_alloc"] == 75
    assert compare["every_allocations"] == 1 and compare["num_calls"] == 1274
    assert compare["with"]["peak_allocated_bytes"] == compare["without"]["peak_allocated_bytes"]


def test_cli_text_lines(saved_trace, capsys):
    capsys.readouterr()
    assert run(["allocator", "replay", str(saved_trace), "--empty-cache-every", "100", "--no-advise"]) == 0
    out = capsys.readouterr().out
    assert ("with torch.cuda.empty_cache() after every 100 allocations (12 calls): peak reserved 52.00 MiB, "
            "without 52.00 MiB (the same)") in out
    assert "  cudaMalloc calls 30, without 17 (13 more: the time emptying the cache costs" in out


def test_cli_without_the_option_adds_nothing(saved_trace, capsys):
    capsys.readouterr()
    assert run(["allocator", "replay", str(saved_trace), "--no-advise", "--json"]) == 0
    assert "empty_cache" not in json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("value, message", [
    ("0", "0 allocations: empty the cache after 1 or more allocations"),
    ("-3", "-3 allocations: empty the cache after 1 or more allocations"),
    ("1.5", "'1.5' is not a whole number"),
    ("often", "'often' is not a whole number"),
])
def test_bad_counts_are_usage_errors(tmp_path, capsys, value, message):
    trace = tmp_path / "t.json"
    trace.write_text(json.dumps({"format": "llamem-trace-v1", "events": []}))
    assert run(["allocator", "replay", str(trace), f"--empty-cache-every={value}"]) == 2
    err = capsys.readouterr().err
    assert "--empty-cache-every" in err and message in err and "Traceback" not in err
