"""Planner speed: candidate configurations evaluated per second (target: at least 10,000/s),
and the wall time of full plans for a 70B model over 1-64 GPUs (target: under 2 s).
Usage: python benchmarks/plan_speed.py [--out benchmarks/results/plan_speed.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from llamem import build_workload, load_model
from llamem.gpus import get_gpu
from llamem.plan import Space, candidates, make_plan

GiB = 2**30


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/plan_speed.json")
    args = parser.parse_args()
    spec, gpu = load_model("llama-2-70b"), get_gpu("h100-80gb")
    workload = build_workload(task="train", batch=4, seq=4096)

    # Candidates per second: the planner's own search over 64 GPUs, without its final checks.
    space = Space(spec=spec, gpu=gpu, host_budget_bytes=512 * GiB)
    start = time.perf_counter()
    count = sum(1 for _ in candidates(space, workload, 64))
    search = time.perf_counter() - start

    # A full plan (search, allocator-simulator checks, ladder) for every GPU count from 1 to 64.
    rows = []
    for gpus in (1, 2, 4, 8, 16, 32, 64):
        t0 = time.perf_counter()
        plan = make_plan(spec, workload, gpu, num_gpus=gpus, host_budget_bytes=512 * GiB)
        rows.append({"gpus": gpus, "fits": plan.fits, "seconds": time.perf_counter() - t0,
                     "layout": plan.final.layout.describe()})
    t0 = time.perf_counter()
    fewest = make_plan(spec, workload, gpu, host_budget_bytes=512 * GiB, min_gpus=True, max_gpus=64)
    min_gpus_seconds = time.perf_counter() - t0

    print(f"candidates evaluated: {count} in {search:.3f} s = {count / search:,.0f}/s (target >= 10,000/s)")
    print(f"{'GPUs':>5} {'fits':>5} {'seconds':>8}  layout")
    for row in rows:
        print(f"{row['gpus']:>5} {'yes' if row['fits'] else 'no':>5} {row['seconds']:>8.3f}  {row['layout']}")
    total = sum(r["seconds"] for r in rows)
    print(f"all seven plans: {total:.2f} s; --min-gpus over 1-64: {min_gpus_seconds:.2f} s "
          f"({fewest.num_gpus} GPUs) (target < 2 s)")
    with open(args.out, "w") as handle:
        json.dump({"candidates": count, "candidates_per_second": count / search, "plans": rows,
                   "all_plans_seconds": total, "min_gpus_seconds": min_gpus_seconds,
                   "min_gpus": fewest.num_gpus}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
