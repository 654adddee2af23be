"""How fast the analytic engine is: workloads per second in-process, and one `llamem estimate` call.

Targets: at least 20,000 workloads/s; one CLI call under 0.5 s.
Usage: python benchmarks/analytic_speed.py [--out benchmarks/results/analytic_speed.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import subprocess
import sys
import time
from pathlib import Path

from llamem import build_workload, estimate, load_model


def workloads():
    """A varied stream: 5 tasks x 4 batches x 4 sequence lengths x 2 checkpointing modes."""
    out = []
    for task, batch, seq, ac in itertools.product(["train", "lora", "qlora", "infer", "distill"], [1, 2, 4, 8],
                                                  [512, 1024, 2048, 4096], [0, 1]):
        options = dict(task=task, batch=batch, seq=seq)
        if task == "distill":
            options["teacher"] = "llama-3.1-70b"
        if task != "infer":
            options["ac_every"] = ac
        out.append(build_workload(**options))
    return out


def in_process_rate(seconds: float = 2.0) -> tuple[float, int]:
    spec = load_model("llama-3.1-8b")
    teacher = load_model("llama-3.1-70b")
    stream = workloads()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for workload in stream:
            estimate(spec, workload, teacher if workload.task == "distill" else None)
        count += len(stream)
    return count / (time.perf_counter() - start), count


def cli_wall_time(repeats: int = 5) -> float:
    exe = Path(sys.executable).with_name("llamem")
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run([str(exe), "estimate", "llama-3.1-8b", "--task", "lora", "--json"], check=True,
                       capture_output=True)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/analytic_speed.json")
    args = parser.parse_args()
    rate, count = in_process_rate()
    wall = cli_wall_time()
    print(f"{'measure':<40} {'value':>12} {'target':>10}")
    print(f"{'analytic workloads per second':<40} {rate:>12,.0f} {'>= 20,000':>10}")
    print(f"{'llamem estimate wall time (best of 5)':<40} {wall:>11.3f}s {'< 0.5 s':>10}")
    with open(args.out, "w") as handle:
        json.dump({"workloads_per_second": rate, "workloads_evaluated": count, "cli_wall_seconds": wall}, handle,
                  indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
