"""Allocator simulator speed, two parts.

1. Full replay (statistics, `replay`): the event trace of a Llama-2-7B training step, events per
   second (target: at least 200,000/s) and the ratio to a naive simulator that finds the best-fit
   block by scanning every cached block, run on the same events.
2. Smallest-card searches (`SmallestCardSearch`, what `llamem estimate` and `llamem plan` spend
   their time in): each row's searches run twice on the same schedules, once with the fast card
   replays (`llamem.allocator.lean.CardReplays`) and once with the reference, a whole
   `LeanAllocatorSim` replay per card (`SimulatedReplays`, the implementation before it); the two
   must give the same device figures (target: at least 2x faster).

Usage: python benchmarks/replay_speed.py [--model llama-2-7b] [--skip-trace]
           [--out benchmarks/results/replay_speed.json]  (the table also goes to replay_speed.txt)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings
from pathlib import Path

from llamem.allocator.lean import SimulatedReplays, simulated_peak
from llamem.allocator.replay import AllocEvent, SmallestCardSearch, replay, runs_on_card
from llamem.allocator.simulator import CachingAllocatorSim, Pool

warnings.filterwarnings("ignore")


class NaivePool(Pool):
    """The same pool semantics with a plain list scanned end to end for each request."""

    __slots__ = ()

    def insert(self, block):
        self.keys.append((block.stream, block.size, block.ptr))
        self.blocks[self.keys[-1]] = block
        block.gc_base = self.free_calls

    def remove(self, block):
        key = (block.stream, block.size, block.ptr)
        self.keys.remove(key)
        del self.blocks[key]

    def lower_bound(self, stream, size):
        best, best_index = None, len(self.keys)
        for index, key in enumerate(self.keys):
            if key[0] == stream and key[1] >= size and (best is None or key < best):
                best, best_index = key, index
        return best_index


class NaiveSim(CachingAllocatorSim):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.small, self.large = NaivePool(True), NaivePool(False)


def traced_events(model: str) -> list[AllocEvent]:
    from llamem import build_workload, load_model
    from llamem.trace.run import trace

    report = trace(load_model(model), build_workload(task="train", batch=1, seq=2048))
    tracer = report.extra["events"]
    return [AllocEvent(e.action, e.record_id, tracer.records[e.record_id].nbytes) for e in tracer.events]


def timed(events, sim_class, repeats: int) -> tuple[float, int]:
    import llamem.allocator.replay as replay_module

    original = replay_module.CachingAllocatorSim
    replay_module.CachingAllocatorSim = sim_class
    try:
        best, reserved = float("inf"), 0
        for _ in range(repeats):
            start = time.perf_counter()
            result = replay(events)
            best = min(best, time.perf_counter() - start)
            reserved = result.peak_reserved_bytes
        return best, reserved
    finally:
        replay_module.CachingAllocatorSim = original


def full_replay_part(model: str, lines: list[str]) -> dict:
    events = traced_events(model)
    fast, reserved = timed(events, CachingAllocatorSim, 3)
    slow, naive_reserved = timed(events, NaiveSim, 1)
    assert reserved == naive_reserved, "the two implementations disagree"
    lines += [f"{'simulator':<26} {'events':>8} {'seconds':>8} {'events/s':>10}",
              f"{'llamem (bisect)':<26} {len(events):>8} {fast:>8.3f} {len(events) / fast:>10,.0f}",
              f"{'naive list scan':<26} {len(events):>8} {slow:>8.3f} {len(events) / slow:>10,.0f}",
              f"speed-up over the naive scan: {slow / fast:.1f}x; peak reserved {reserved / 2**30:.2f} GiB (both)"]
    return {"model": model, "events": len(events), "events_per_second": len(events) / fast,
            "naive_events_per_second": len(events) / slow, "speedup": slow / fast, "peak_reserved_bytes": reserved}


# Smallest-card searches ----------------------------------------------------------------------
def search_rows() -> list[tuple[str, dict, dict, int]]:
    """(label, workload fields, layout options, micro-batches per pipeline stage replayed)."""
    train = {"task": "train", "precision": "bf16-mixed", "optimizer": "adamw", "batch": 1, "seq": 4096,
             "grad_accum": 8}
    return [("llama-3.1-8b train, 1 GPU", train, {}, 1),
            ("llama-3.1-8b train, pp 2", train, {"gpus": 2, "pp": 2}, 1),
            ("llama-3.1-8b train, pp 2, 8 micro-batches", train, {"gpus": 2, "pp": 2}, 8),
            ("llama-2-70b lora, 1 GPU", {"task": "lora", "precision": "bf16", "optimizer": "adamw", "batch": 1,
                                        "seq": 4096}, {}, 1)]


def clear_search_caches(events_too: bool) -> None:
    from llamem import device

    for cached in (device._envelope, device._search, device._unlimited_fragmentation):
        cached.cache_clear()
    if events_too:
        device.probe_events.cache_clear()


def with_replays(replays, run):
    """`run()` with every smallest-card search answering through `replays`, from cold search caches."""
    original = SmallestCardSearch.replays
    SmallestCardSearch.replays = replays
    clear_search_caches(events_too=False)
    try:
        start = time.perf_counter()
        out = run()
        return time.perf_counter() - start, out
    finally:
        SmallestCardSearch.replays = original


def estimate_run(model: str, fields: dict, layout_options: dict, microbatches: int):
    from llamem import build_workload, load_model
    from llamem.analytic import schedule_pipeline
    from llamem.parallel import make_layout
    from llamem.sizing import estimate_report

    spec, w = load_model(model), build_workload(**fields)
    layout = make_layout(spec, w, **layout_options) if layout_options else None

    def run():
        previous = schedule_pipeline.MICROBATCHES_PER_STAGE
        schedule_pipeline.MICROBATCHES_PER_STAGE = microbatches  # the stages replayed at this many
        try:
            return dataclasses.astuple(estimate_report(spec, w, layout, details=True).device)
        finally:
            schedule_pipeline.MICROBATCHES_PER_STAGE = previous
    return run


def plan_run():
    from llamem import build_workload, load_model
    from llamem.gpus import get_gpu
    from llamem.plan import make_plan
    from llamem.reporters.plan_report import render_plan

    spec, gpu = load_model("llama-2-70b"), get_gpu("h100-80gb")
    w = build_workload(task="train", batch=4, seq=4096)
    return lambda: render_plan(make_plan(spec, w, gpu, num_gpus=8, host_budget_bytes=512 * 2**30))


def search_part(lines: list[str]) -> list[dict]:
    rows = []
    lines += ["", f"{'smallest-card searches of':<44} {'reference s':>11} {'fast s':>8} {'speed-up':>8}"]
    cases = [(label, estimate_run(model_of(label), fields, layout, mb)) for label, fields, layout, mb in search_rows()]
    cases.append(("llama-2-70b train plan, 8 x H100 (whole plan)", plan_run()))
    for label, run in cases:
        clear_search_caches(events_too=True)
        run()  # builds and keeps the schedules: both timings below are of the searches alone
        reference, expected = with_replays(SimulatedReplays, run)
        fast, got = with_replays(SmallestCardSearch.replays, run)
        assert got == expected, f"{label}: the fast replays disagree with the reference"
        rows.append({"case": label, "reference_seconds": reference, "fast_seconds": fast,
                     "speedup": reference / fast})
        lines.append(f"{label:<44} {reference:>11.2f} {fast:>8.2f} {reference / fast:>7.1f}x")
    return rows


def model_of(label: str) -> str:
    return label.split()[0]


def single_replay_part(lines: list[str]) -> dict:
    """One whole replay on a card without limit (no resuming): the per-event speed alone."""
    from llamem import build_workload, load_model
    from llamem.device import probe_events

    events = probe_events(load_model("llama-3.1-8b"), build_workload(**search_rows()[0][1]))[0]
    timings = {}
    for name, replay_once in (("reference", simulated_peak), ("fast", runs_on_card)):
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            peak = replay_once(events, None)
            best = min(best, time.perf_counter() - start)
        timings[name] = (best, peak)
    assert timings["fast"][1] == timings["reference"][1]
    ratio = timings["reference"][0] / timings["fast"][0]
    lines.append(f"{'one unlimited replay, ' + format(len(events), ',') + ' events':<44} "
                 f"{timings['reference'][0]:>11.3f} {timings['fast'][0]:>8.3f} {ratio:>7.1f}x")
    return {"events": len(events), "reference_seconds": timings["reference"][0], "fast_seconds": timings["fast"][0],
            "speedup": ratio}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--skip-trace", action="store_true", help="only the smallest-card searches (no torch)")
    parser.add_argument("--out", default="benchmarks/results/replay_speed.json")
    args = parser.parse_args()
    lines: list[str] = []
    out = {} if args.skip_trace else full_replay_part(args.model, lines)
    out["searches"] = search_part(lines)
    out["single_replay"] = single_replay_part(lines)
    text = "\n".join(lines) + "\n"
    print(text, end="")
    with open(args.out, "w") as handle:
        json.dump(out, handle, indent=1)
    Path(args.out).with_suffix(".txt").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
