"""The caching-allocator simulator, rule by rule, with sizes computed by hand from
c10/cuda/CUDACachingAllocator.cpp, plus properties over random traces."""

import json
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llamem.allocator import AllocatorConfigError, CachingAllocatorSim, SimulatedOOM, parse_alloc_conf
from llamem.allocator.replay import TraceFormatError, events_from_data, load_events, replay
from llamem.cli import main

KiB, MiB, GiB = 2**10, 2**20, 2**30


def sim(conf: str = "", **kwargs) -> CachingAllocatorSim:
    return CachingAllocatorSim(parse_alloc_conf(conf), **kwargs)


def stat(s: CachingAllocatorSim, key: str) -> int:
    return s.memory_stats()[key]


# Rounding and pools ----------------------------------------------------------------------
def test_tiny_request_is_512_bytes_in_a_2mib_small_segment():
    s = sim()
    block = s.malloc(1)
    assert block.size == 512 and block.pool.small
    assert s.reserved_bytes == 2 * MiB


def test_one_mib_exactly_is_small_one_more_byte_is_large():
    s = sim()
    assert s.malloc(MiB).pool.small
    big = s.malloc(MiB + 1)
    assert not big.pool.small and big.size == MiB + 512
    assert s.reserved_bytes == 2 * MiB + 20 * MiB


@pytest.mark.parametrize("request_bytes, segment", [
    (10 * MiB - 512, 20 * MiB),   # below 10 MiB: a 20 MiB segment
    (10 * MiB, 10 * MiB),         # from 10 MiB: rounded to 2 MiB
    (11 * MiB, 12 * MiB),
    (25 * MiB, 26 * MiB),
])
def test_segment_sizes(request_bytes, segment):
    s = sim()
    s.malloc(request_bytes)
    assert s.reserved_bytes == segment


def test_issue_acceptance_case():
    s = sim()
    for size in (1000, 3 * MiB, 3 * MiB, 25 * MiB):
        s.malloc(size)
    assert stat(s, "reserved_bytes.all.peak") == 50_331_648
    assert stat(s, "allocated_bytes.all.peak") == 33_555_456


# Splitting ------------------------------------------------------------------------------
def test_large_remainder_of_one_mib_is_not_split():
    s = sim()
    block = s.malloc(19 * MiB)  # 20 MiB segment, 1 MiB left: handed out whole
    assert block.size == 20 * MiB
    assert s.allocated_bytes == 20 * MiB
    assert stat(s, "inactive_split.all.current") == 0


def test_large_remainder_above_one_mib_is_split():
    s = sim()
    block = s.malloc(18 * MiB + 512 * KiB)  # a 20 MiB segment; 1.5 MiB left: split off
    assert block.size == 18 * MiB + 512 * KiB
    assert stat(s, "inactive_split_bytes.all.current") == 1536 * KiB
    assert stat(s, "inactive_split.all.current") == 1


def test_small_pool_packs_several_tensors_in_one_segment():
    s = sim()
    a, b = s.malloc(1000), s.malloc(1000)
    assert b.ptr == a.ptr + 1024
    assert stat(s, "segment.all.current") == 1


# Best fit, coalescing, segments ----------------------------------------------------------
def test_best_fit_picks_the_smallest_block_that_fits():
    s = sim()
    x, y = s.malloc(16 * MiB), s.malloc(12 * MiB)
    s.free(x)
    s.free(y)
    z = s.malloc(11 * MiB)
    assert z.ptr == y.ptr and z.size == 12 * MiB  # 1 MiB remainder: not split
    assert s.reserved_bytes == 28 * MiB


def test_free_coalesces_neighbours_and_front_address_is_reused():
    s = sim()
    a, b, _c = s.malloc(3 * MiB), s.malloc(3 * MiB), s.malloc(3 * MiB)
    s.free(a)
    s.free(b)
    d = s.malloc(6 * MiB)
    assert d.ptr == a.ptr
    assert s.reserved_bytes == 20 * MiB


def test_segments_never_merge():
    s = sim()
    a, b = s.malloc(12 * MiB), s.malloc(12 * MiB)
    s.free(a)
    s.free(b)
    s.malloc(20 * MiB)  # 24 MiB free in total, but in two segments of 12
    assert s.reserved_bytes == 44 * MiB


def test_streams_do_not_share_cached_blocks():
    s = sim()
    s.free(s.malloc(4 * MiB, stream=1))
    s.malloc(4 * MiB, stream=0)
    assert s.reserved_bytes == 40 * MiB


# empty_cache ------------------------------------------------------------------------------
def test_empty_cache_keeps_a_segment_with_a_live_block():
    s = sim()
    a, _b = s.malloc(3 * MiB), s.malloc(3 * MiB)
    s.free(a)
    s.empty_cache()
    assert s.reserved_bytes == 20 * MiB
    assert stat(s, "inactive_split_bytes.all.current") == 17 * MiB


def test_empty_cache_returns_everything_once_freed():
    s = sim()
    blocks = [s.malloc(n) for n in (1000, 3 * MiB, 30 * MiB)]
    for block in blocks:
        s.free(block)
    s.empty_cache()
    assert s.reserved_bytes == 0 and stat(s, "segment.all.current") == 0


# max_split_size_mb, max_non_split_rounding_mb ----------------------------------------------
def test_oversize_block_is_not_used_for_a_smaller_request():
    s = sim("max_split_size_mb:100")
    s.free(s.malloc(150 * MiB))
    s.malloc(50 * MiB)
    assert s.reserved_bytes == 200 * MiB
    assert stat(s, "oversize_segments.current") == 1


def test_oversize_reuse_within_the_non_split_rounding_limit():
    s = sim("max_split_size_mb:100")
    s.free(s.malloc(150 * MiB))
    reused = s.malloc(140 * MiB)  # 150 < 140 + 20: reused whole
    assert reused.size == 150 * MiB and s.reserved_bytes == 150 * MiB
    s.free(reused)
    s.malloc(120 * MiB)  # 150 >= 120 + 20: refused, new segment
    assert s.reserved_bytes == 270 * MiB


def test_max_non_split_rounding_setting_widens_reuse():
    s = sim("max_split_size_mb:100,max_non_split_rounding_mb:40")
    s.free(s.malloc(150 * MiB))
    s.malloc(120 * MiB)
    assert s.reserved_bytes == 150 * MiB


def test_release_available_cached_blocks_frees_oversize_blocks_before_giving_up():
    s = sim("max_split_size_mb:100", capacity_bytes=300 * MiB)
    s.free(s.malloc(250 * MiB))
    # 250 >= 200 + 20: not reused; 250 + 200 > 300: the cached oversize block is released
    # (release_available_cached_blocks), then cudaMalloc succeeds without a full retry.
    s.malloc(200 * MiB)
    assert s.reserved_bytes == 200 * MiB and s.num_alloc_retries == 0


# roundup_power2_divisions ----------------------------------------------------------------
def test_roundup_next_division_function():
    assert CachingAllocatorSim._roundup_power2_next_division(1200, 4) == 1280
    assert CachingAllocatorSim._roundup_power2_next_division(4096, 4) == 4096


def test_roundup_divisions_round_requests():
    s = sim("roundup_power2_divisions:4")
    assert s.malloc(5000).size == 5120  # 4096 + one quarter step
    assert sim().malloc(5000).size == 5120  # plain 512 rounding happens to agree here
    assert s.malloc(9 * MiB + 1).size == 10 * MiB  # [8, 16) MiB in steps of 2 MiB


def test_roundup_divisions_per_bucket_follow_the_code():
    s = sim("roundup_power2_divisions:[256:1,512:2,1024:4,>:8]")
    assert s.malloc(600 * MiB).size == 768 * MiB  # bucket [512, 1024) MiB: 2 divisions
    assert s.malloc(300 * MiB).size == 300 * MiB  # bucket [256, 512) MiB: 1 division


# Garbage collection, fraction, capacity, OOM ------------------------------------------------
def test_garbage_collection_needs_a_memory_fraction():
    s = sim("garbage_collection_threshold:0.5")
    for _ in range(3):
        s.free(s.malloc(20 * MiB))  # the cached 20 MiB block is reused each time
        s.malloc(30 * MiB)
    assert s.reserved_bytes == 110 * MiB  # nothing reclaimed: no fraction set


def test_garbage_collection_with_a_fraction_reclaims_old_blocks():
    s = sim("garbage_collection_threshold:0.5,per_process_memory_fraction:0.8", capacity_bytes=100 * MiB)
    s.free(s.malloc(45 * MiB))  # cached, unsplit; 45 MiB reserved > 0.5 * 80 MiB allowed
    s.malloc(50 * MiB)          # collected before cudaMalloc: no retry needed
    assert s.reserved_bytes == 50 * MiB and s.num_alloc_retries == 0


def test_free_and_retry_counts_a_retry():
    s = sim(capacity_bytes=40 * MiB)
    s.free(s.malloc(24 * MiB))
    s.malloc(26 * MiB)
    assert s.num_alloc_retries == 1 and s.reserved_bytes == 26 * MiB


def test_oom_message_has_torch_numbers():
    s = sim(capacity_bytes=30 * MiB, device_total_bytes=32 * MiB)
    s.malloc(3 * MiB)
    with pytest.raises(SimulatedOOM) as err:
        s.malloc(25 * MiB)
    message = str(err.value)
    assert message.startswith("CUDA out of memory. Tried to allocate 26.00 MiB. GPU 0 has a total capacity of "
                              "32.00 MiB of which 10.00 MiB is free.")
    assert "Of the allocated memory 3.00 MiB is allocated by PyTorch, and 17.00 MiB is reserved" in message
    assert s.num_ooms == 1 and s.num_alloc_retries == 1


def test_fraction_limits_reserved_memory():
    s = sim("per_process_memory_fraction:0.5", capacity_bytes=100 * MiB)
    with pytest.raises(SimulatedOOM, match="50.00 MiB allowed"):
        s.malloc(60 * MiB)


# Expandable segments ---------------------------------------------------------------------
def test_expandable_segments_grow_one_segment():
    s = sim("expandable_segments:True")
    for size in (1000, 3 * MiB, 3 * MiB, 25 * MiB):
        s.malloc(size)
    assert s.reserved_bytes == 2 * MiB + 40 * MiB  # two 20 MiB pages hold 31 MiB contiguously


def test_expandable_segments_unmap_on_empty_cache():
    s = sim("expandable_segments:True")
    blocks = [s.malloc(size) for size in (5 * MiB, 50 * MiB, 1000)]
    for block in blocks:
        s.free(block)
    s.empty_cache()
    assert s.reserved_bytes == 0


# Config parsing --------------------------------------------------------------------------
@pytest.mark.parametrize("text, message", [
    ("max_split_size_mb:10", "max_split_size_mb too small, must be >= 20"),
    ("garbage_collection_threshold:1.5", "set it in (0.0, 1.0)"),
    ("expandable_segments:maybe", "Expected 'True' or 'False'"),
    ("roundup_power2_divisions:3", "has to be power of 2"),
    ("roundup_power2_divisions:[300:2]", "the intervals have to be power of 2"),
    ("max_non_split_rounding_mb:5", "too small"),
    ("backend:bogus", "Unknown allocator backend"),
    ("max_split_sise_mb:100", "Unrecognized key 'max_split_sise_mb'"),
])
def test_config_errors_match_torch(text, message):
    with pytest.raises(AllocatorConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_alloc_conf(text)


@pytest.mark.parametrize("text", ["max_split_size_mb:10", "max_split_size_mb:100", "garbage_collection_threshold:1.5",
                                  "expandable_segments:maybe", "expandable_segments:True", "roundup_power2_divisions:3",
                                  "roundup_power2_divisions:[256:1,512:2,1024:4,>:8]", "max_non_split_rounding_mb:10",
                                  " max_split_size_mb : 128 , expandable_segments : False"])
def test_config_acceptance_agrees_with_torch(text):
    torch = pytest.importorskip("torch")
    try:
        torch._C._accelerator_setAllocatorSettings(text)
        torch_ok = True
    except (ValueError, RuntimeError):
        torch_ok = False
    finally:
        torch._C._accelerator_setAllocatorSettings("")
    try:
        parse_alloc_conf(text)
        ours = True
    except AllocatorConfigError:
        ours = False
    assert ours == torch_ok


# Properties over random traces -------------------------------------------------------------
sizes = st.one_of(st.integers(1, 4096), st.integers(4096, 2 * MiB), st.integers(2 * MiB, 64 * MiB))
programs = st.lists(st.tuples(st.booleans(), sizes, st.integers(0, 50)), min_size=1, max_size=120)


def _run(program, conf):
    s = sim(conf)
    live = []
    for do_alloc, size, pick in program:
        if do_alloc or not live:
            live.append(s.malloc(size))
        else:
            s.free(live.pop(pick % len(live)))
        assert s.reserved_bytes >= s.allocated_bytes
        spans = sorted((b.ptr, b.ptr + b.size) for b in live)
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:])), "live blocks overlap"
    return s, live


@settings(max_examples=60, deadline=None)
@given(programs, st.sampled_from(["", "expandable_segments:True", "max_split_size_mb:40",
                                  "roundup_power2_divisions:4"]))
def test_properties(program, conf):
    s, live = _run(program, conf)
    in_use = s.allocated_bytes
    s.empty_cache()
    if not conf.startswith("expandable"):
        # Only segments holding a live block stay reserved.
        heads = {}
        for block in live:
            head = block
            while head.prev is not None:
                head = head.prev
            heads[head.ptr] = head
        kept = 0
        for head in heads.values():
            b = head
            while b is not None:
                kept += b.size
                b = b.next
        assert s.reserved_bytes == kept
    assert s.reserved_bytes >= in_use
    for block in live:
        s.free(block)
    assert s.allocated_bytes == 0
    s.empty_cache()
    assert s.reserved_bytes == 0


# Replay, files, snapshots -------------------------------------------------------------------
def test_replay_json_and_viz(tmp_path):
    trace = {"device_traces": [[{"action": "alloc", "addr": 1, "size": 1000, "stream": 0},
                                {"action": "alloc", "addr": 2, "size": 3 * MiB, "stream": 0},
                                {"action": "free_requested", "addr": 1, "size": 1000, "stream": 0},
                                {"action": "free_completed", "addr": 1, "size": 1000, "stream": 0}]]}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    result = replay(load_events(path), record_trace=True)
    assert result.peak_reserved_bytes == 22 * MiB and result.sim.allocated_bytes == 3 * MiB
    viz = pytest.importorskip("torch.cuda._memory_viz")
    from llamem.allocator.snapshot import snapshot

    snap = snapshot(result.sim)
    assert "total_reserved: 22.0MiB" in viz.segsum(snap)
    assert "<html" in viz.trace_plot(snap).lower()


class Boom:
    def __reduce__(self):
        return (print, ("pwned",))


def test_malicious_pickle_is_refused(tmp_path, capsys):
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps(Boom()))
    with pytest.raises(TraceFormatError, match="refusing to load builtins.print"):
        load_events(path)
    code = main(["allocator", "replay", str(path)])
    out = capsys.readouterr()
    assert code == 1 and "refusing" in out.err and "pwned" not in out.out


def test_pickled_snapshot_loads(tmp_path):
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 5, "size": 10, "stream": 0, "time_us": 1, "frames": []}]]}))
    assert len(load_events(path)) == 1


def test_llamem_trace_format():
    events = events_from_data({"format": "llamem-trace-v1", "events": [
        {"action": "alloc", "addr": 0, "size": 1024, "nbytes": 1000}, {"action": "free", "addr": 0, "size": 1024}]})
    assert [e.size for e in events] == [1000, 1024]


def _exit_code(argv: list[str]) -> int:
    """The exit code `llamem` would end with (a command may end the process with sys.exit)."""
    try:
        return main(argv)
    except SystemExit as exit_:
        return exit_.code


def test_cli_replay_json_and_oom_exit(tmp_path, capsys):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"device_traces": [[{"action": "alloc", "addr": i, "size": s, "stream": 0}
                                                   for i, s in enumerate((1000, 3 * MiB, 3 * MiB, 25 * MiB))]]}))
    assert main(["allocator", "replay", str(path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "num_segments", "num_alloc_retries", "num_ooms",
                "fragmentation"):
        assert key in data
    assert data["peak_reserved_bytes"] == 50_331_648
    # A simulated OOM exits with 3 (it exited with 2, the usage-error code).
    assert _exit_code(["allocator", "replay", str(path), "--capacity", "30MiB"]) == 3
    assert "OUT OF MEMORY at event 3" in capsys.readouterr().out
    assert main(["allocator", "replay", str(path), "--config", "max_split_size_mb:5"]) == 1


def _growing_cache_events(steps: int = 40, start_mib: int = 64, grow_mib: int = 8):
    """A cache grown by concatenation: each step allocates the larger copy, then frees the old one."""
    from llamem.allocator.replay import AllocEvent

    events, old = [], None
    for step in range(steps):
        events.append(AllocEvent("alloc", step, (start_mib + grow_mib * step) * 2**20))
        if old is not None:
            events.append(AllocEvent("free", old, 0))
        old = step
    return events


def test_smallest_card_is_far_below_the_unlimited_peak_for_a_growing_cache():
    from llamem.allocator.replay import peak_allocated_bytes, replay, runs_on_card, smallest_card

    events = _growing_cache_events()
    unlimited = replay(events).peak_reserved_bytes
    allocated, smallest = smallest_card(events)
    assert allocated == peak_allocated_bytes(events) == replay(events).peak_allocated_bytes
    # Every freed block stays cached and is too small for the next one: the unlimited card keeps them all.
    assert unlimited > 10 * allocated
    # A real card frees its cache and retries: it runs within 10 % of the allocated peak.
    assert allocated <= smallest < 1.1 * allocated
    assert runs_on_card(events, smallest) is not None
    assert runs_on_card(events, allocated - 2**20) is None
    # ... and 1/128 of the peak less does not (the search's precision).
    assert runs_on_card(events, smallest - allocated // 128 - 1) is None


# One allocation larger than 64 GiB, expandable segments, the address range --------------------
@pytest.mark.parametrize("conf", ["", "expandable_segments:True"])
@pytest.mark.parametrize("capacity, device_total, completes", [
    (None, None, True),            # an unlimited card: the range grows to hold the request
    (120 * GiB, None, True),
    (80 * GiB, None, False),       # the OOM torch raises, not a crash
    (None, 80 * GiB, None),        # expandable: more than 1.125 x 80 GiB of address space; native: no limit
])
def test_replay_of_one_100_gib_allocation(conf, capacity, device_total, completes):
    from llamem.allocator.replay import AllocEvent

    result = replay([AllocEvent("alloc", 0, 100 * GiB)], parse_alloc_conf(conf), capacity_bytes=capacity,
                    device_total_bytes=device_total)
    if completes is None:
        completes = not conf
    assert result.completes == completes
    if completes:
        assert result.peak_reserved_bytes == 100 * GiB
    else:
        assert result.oom_message.startswith("CUDA out of memory. Tried to allocate 100.00 GiB.")


def test_expandable_range_is_1_125_times_the_device_in_pages():
    s = sim("expandable_segments:True", capacity_bytes=80 * GiB)
    s.malloc(30 * GiB)
    assert s.expandable[0].size == -(-(90 * GiB) // (20 * MiB)) * (20 * MiB)
    unlimited = sim("expandable_segments:True")
    unlimited.malloc(40 * GiB)
    unlimited.malloc(40 * GiB)
    assert len(unlimited.expandable) == 1  # no card fills the range of an unknown one


# Backends -----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", ["cudaMallocAsync", "hipMallocAsync"])
def test_malloc_async_backend_parses_but_is_not_simulated(backend):
    from llamem.allocator.replay import AllocEvent

    config = parse_alloc_conf(f"backend:{backend},expandable_segments:True")
    assert config.backend == backend  # torch accepts it
    with pytest.raises(AllocatorConfigError, match=f"backend:{backend} cannot be simulated: llamem models "
                                                   "PyTorch's native caching allocator"):
        CachingAllocatorSim(config)
    with pytest.raises(AllocatorConfigError, match="whose policy is not public"):
        replay([AllocEvent("alloc", 0, 10)], config)
    CachingAllocatorSim(parse_alloc_conf("backend:native"))


def test_fraction_that_is_not_a_number_is_torchs_error():
    with pytest.raises(AllocatorConfigError, match="stod: 'half' is not a number"):
        parse_alloc_conf("per_process_memory_fraction:half")


# Code shape ----------------------------------------------------------------------------------
def test_allocator_functions_are_small():
    import ast
    from pathlib import Path

    import llamem.allocator

    package = Path(llamem.allocator.__file__).parent
    long = []
    for path in package.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 50:
                long.append(f"{path.name}:{node.name}")
    assert long == []


def test_allocator_package_is_torch_free():
    import subprocess
    import sys

    code = ("import sys, llamem.allocator.replay, llamem.allocator.advice, "
            "llamem.allocator.snapshot; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
