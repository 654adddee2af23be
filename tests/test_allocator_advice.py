"""Allocator advice: each candidate replayed within the capacity; only settings that complete
(with a capacity) or save enough (without one) are advised, lowest peak reserved first, and the
report says when none helps."""

import json

import pytest

from llamem.allocator import parse_alloc_conf
from llamem.allocator.advice import GC_NOTE, WORTH_REPORTING, Advice, advise, candidates, summarize
from llamem.allocator.replay import AllocEvent, replay
from llamem.cli import main

MiB = 2**20


def fragmenting_events(pairs: int = 20, big_mib: int = 60) -> list[AllocEvent]:
    """Pairs of 8 MiB tensors share 20 MiB segments; every second one is freed, so each segment
    keeps 12 MiB it cannot return; then a 60 MiB tensor needs a new segment."""
    events = [AllocEvent("alloc", i, 8 * MiB) for i in range(2 * pairs)]
    events += [AllocEvent("free", i, 8 * MiB) for i in range(1, 2 * pairs, 2)]
    return events + [AllocEvent("alloc", 1000, big_mib * MiB)]


def test_candidates_cover_the_ranges():
    settings = [s for s, _ in candidates(capacity_bytes=None)]
    assert settings[0] == "expandable_segments:True"
    assert [f"max_split_size_mb:{m}" for m in (64, 128, 256, 512, 1024)] == settings[1:6]
    assert {"roundup_power2_divisions:4", "roundup_power2_divisions:8",
            "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]"} <= set(settings)
    assert not any("garbage_collection" in s for s in settings)  # never runs without a fraction of a card
    with_capacity = dict(candidates(capacity_bytes=MiB))
    gc = [s for s in with_capacity if s.startswith("garbage_collection_threshold")]
    assert gc == ["garbage_collection_threshold:0.6,per_process_memory_fraction:1.0",
                  "garbage_collection_threshold:0.8,per_process_memory_fraction:1.0"]
    assert all(with_capacity[s] == GC_NOTE for s in gc) and "per_process_memory_fraction:1.0" in GC_NOTE
    for setting in with_capacity:
        parse_alloc_conf(setting)  # each one is a setting torch accepts


def test_with_a_capacity_only_settings_that_complete_are_advised():
    events = fragmenting_events()
    capacity = 380 * MiB
    baseline = replay(events, capacity_bytes=capacity)
    assert not baseline.completes
    # roundup_power2_divisions:4 still runs out here: it must not be advised (it used to rank first).
    assert not replay(events, parse_alloc_conf("roundup_power2_divisions:4"), capacity_bytes=capacity).completes
    found = advise(events, baseline.peak_reserved_bytes, capacity_bytes=capacity, baseline_completes=False)
    assert [a.setting for a in found] == ["expandable_segments:True"]
    assert found[0] == Advice("expandable_segments:True", 380 * MiB, 0, True, 0)
    assert summarize(found, capacity_bytes=capacity, baseline_completes=False) == (
        "best: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True completes within 0.37 GiB")


def test_none_completes_says_so():
    events = fragmenting_events()
    found = advise(events, 300 * MiB, capacity_bytes=300 * MiB, baseline_completes=False)
    assert found == []
    assert summarize(found, capacity_bytes=300 * MiB, baseline_completes=False) == (
        "no allocator setting completes within 0.29 GiB")


def test_without_a_capacity_ranked_by_peak_reserved_and_each_saves_enough():
    events = fragmenting_events()
    baseline = replay(events).peak_reserved_bytes
    found = advise(events, baseline)
    assert found, "expandable segments pack the 8 MiB tensors"
    assert [a.peak_reserved_bytes for a in found] == sorted(a.peak_reserved_bytes for a in found)
    assert all(a.completes and a.saved_bytes >= WORTH_REPORTING * baseline for a in found)
    assert found[0].setting == "expandable_segments:True"


def test_without_a_capacity_nothing_helps_a_single_tensor():
    events = [AllocEvent("alloc", 0, 64 * MiB)]
    assert advise(events, replay(events).peak_reserved_bytes) == []
    assert summarize([], capacity_bytes=None) == "no allocator setting lowers the peak reserved memory by 2% or more"


def test_garbage_collection_candidate_runs_in_the_simulator():
    """The simulator acts on the threshold once a fraction is set: old cached blocks go before cudaMalloc."""
    events = [AllocEvent("alloc", 0, 55 * MiB), AllocEvent("free", 0, 0), AllocEvent("alloc", 1, 60 * MiB)]
    setting = "garbage_collection_threshold:0.6,per_process_memory_fraction:1.0"
    plain = replay(events, capacity_bytes=80 * MiB)
    collected = replay(events, parse_alloc_conf(setting), capacity_bytes=80 * MiB)
    assert plain.sim.num_alloc_retries == 1 and collected.sim.num_alloc_retries == 0
    threshold_only = replay(events, parse_alloc_conf("garbage_collection_threshold:0.6"), capacity_bytes=80 * MiB)
    assert threshold_only.sim.num_alloc_retries == 1  # without a fraction torch does not collect


def test_advice_without_a_capacity_lists_completing_settings():
    events = fragmenting_events()
    found = advise(events, replay(events).peak_reserved_bytes)
    assert all(isinstance(a, Advice) and a.ooms == 0 for a in found)


@pytest.fixture
def fragmenting_file(tmp_path):
    entries = []
    for event in fragmenting_events():
        action = "alloc" if event.action == "alloc" else "free_requested"
        entries.append({"action": action, "addr": event.addr, "size": event.size, "stream": 0})
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"device_traces": [entries]}))
    return path


def _exit_code(argv: list[str]) -> int:
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def test_cli_none_helps_is_said_in_text_and_json(fragmenting_file, capsys):
    assert _exit_code(["allocator", "replay", str(fragmenting_file), "--capacity", "300MiB"]) == 3
    assert "advice: no allocator setting completes within 0.29 GiB" in capsys.readouterr().out
    assert _exit_code(["allocator", "replay", str(fragmenting_file), "--capacity", "300MiB", "--json"]) == 3
    data = json.loads(capsys.readouterr().out)
    assert data["advice"] == [] and data["advice_summary"] == "no allocator setting completes within 0.29 GiB"


def test_cli_advice_within_a_capacity(fragmenting_file, capsys):
    assert _exit_code(["allocator", "replay", str(fragmenting_file), "--capacity", "380MiB", "--json"]) == 3
    data = json.loads(capsys.readouterr().out)
    assert [a["setting"] for a in data["advice"]] == ["expandable_segments:True"]
    assert data["advice"][0] == {"setting": "expandable_segments:True", "peak_reserved_bytes": 380 * MiB,
                                 "saved_bytes": 0, "completes": True, "ooms": 0, "note": ""}
    assert _exit_code(["allocator", "replay", str(fragmenting_file), "--capacity", "380MiB"]) == 3
    assert ("advice: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True completes within 0.37 GiB: peak reserved "
            "380.00 MiB") in capsys.readouterr().out
