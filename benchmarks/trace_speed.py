"""Trace engine cost on a real-size workload, against torch's MemTracker on the same one.

Llama-2-7B full fine-tune step (batch 1, sequence 2048, bf16-mixed, AdamW): wall time and the
tracer's own peak resident memory (targets: under 60 s, under 4 GiB), and the same step under
torch.distributed._tools.mem_tracker.MemTracker, as a ratio. Each runs in its own process so
resident memory is its own.
Usage: python benchmarks/trace_speed.py [--model llama-2-7b] [--out benchmarks/results/trace_speed.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

CHILD_LLAMEM = """
import json, resource, sys, time, warnings
warnings.filterwarnings("ignore")
from llamem import build_workload, load_model
from llamem.trace.run import trace
start = time.perf_counter()
report = trace(load_model(sys.argv[1]), build_workload(task="train", batch=1, seq=2048))
print(json.dumps({"seconds": time.perf_counter() - start, "peak_bytes": report.peak_allocated_bytes,
                  "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""

CHILD_MEMTRACKER = """
import json, resource, sys, time, warnings
warnings.filterwarnings("ignore")
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from llamem import build_workload, load_model
from llamem.trace.build import build_meta_model
spec, workload = load_model(sys.argv[1]), build_workload(task="train", batch=1, seq=2048)
start = time.perf_counter()
model = build_meta_model(spec, workload)
with FakeTensorMode(allow_non_fake_inputs=True):
    model = model.to_empty(device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    tracker = MemTracker()
    tracker.track_external(model, opt)
    with tracker:
        for _ in range(2):
            ids = torch.randint(0, spec.vocab_size, (1, 2048))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
            tracker.reset_mod_stats()  # MemTracker refuses a second iteration otherwise
peak = sum(tracker.get_tracker_snapshot("peak")[torch.device("cpu")].values())
print(json.dumps({"seconds": time.perf_counter() - start, "peak_bytes": peak,
                  "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def run(code: str, model: str) -> dict:
    out = subprocess.run([sys.executable, "-c", code, model], capture_output=True, text=True)
    if out.returncode != 0:
        return {"error": out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}"}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama-2-7b")
    parser.add_argument("--out", default="benchmarks/results/trace_speed.json")
    args = parser.parse_args()
    ours = run(CHILD_LLAMEM, args.model)
    theirs = run(CHILD_MEMTRACKER, args.model)
    print(f"{'engine':<28} {'wall s':>8} {'max RSS GiB':>12} {'traced peak GiB':>16}")
    for name, result in (("llamem trace", ours), ("torch MemTracker", theirs)):
        if "error" in result:
            print(f"{name:<28} failed: {result['error']}")
        else:
            print(f"{name:<28} {result['seconds']:>8.1f} {result['max_rss_bytes'] / 2**30:>12.2f} "
                  f"{result['peak_bytes'] / 2**30:>16.2f}")
    if "error" not in ours and "error" not in theirs:
        print(f"wall-time ratio llamem / MemTracker: {ours['seconds'] / theirs['seconds']:.2f}")
    with open(args.out, "w") as handle:
        json.dump({"model": args.model, "llamem": ours, "memtracker": theirs}, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
