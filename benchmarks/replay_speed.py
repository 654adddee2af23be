"""Allocator simulator speed: replay the event trace of a Llama-2-7B training step.

Reports events per second (target: at least 200,000/s) and the ratio to a naive simulator
that finds the best-fit block by scanning every cached block, run on the same events.
Usage: python benchmarks/replay_speed.py [--model llama-2-7b] [--out benchmarks/results/replay_speed.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

from llamem.allocator.replay import AllocEvent, replay
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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--out", default="benchmarks/results/replay_speed.json")
    args = parser.parse_args()
    events = traced_events(args.model)
    fast, reserved = timed(events, CachingAllocatorSim, 3)
    slow, naive_reserved = timed(events, NaiveSim, 1)
    assert reserved == naive_reserved, "the two implementations disagree"
    print(f"{'simulator':<26} {'events':>8} {'seconds':>8} {'events/s':>10}")
    print(f"{'llamem (bisect)':<26} {len(events):>8} {fast:>8.3f} {len(events) / fast:>10,.0f}")
    print(f"{'naive list scan':<26} {len(events):>8} {slow:>8.3f} {len(events) / slow:>10,.0f}")
    print(f"speed-up over the naive scan: {slow / fast:.1f}x; peak reserved {reserved / 2**30:.2f} GiB (both)")
    with open(args.out, "w") as handle:
        json.dump({"model": args.model, "events": len(events), "events_per_second": len(events) / fast,
                   "naive_events_per_second": len(events) / slow, "speedup": slow / fast,
                   "peak_reserved_bytes": reserved}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
