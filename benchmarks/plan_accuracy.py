"""The planner's largest batch / context against the truth found with the trace engine.

For each scenario the planner answers `--maximize batch|seq` on a memory budget (analytic
engine + allocator simulator). The truth: with the configuration the planner chose, a
bisection over the same quantity where each probe is a full `llamem trace` (exact tensor
bytes, the real allocation order replayed through the allocator simulator, plus the
non-torch overhead). Targets: the planner reaches at least 97 % of the true maximum, and its
answer never exceeds the budget when traced.
Usage: python benchmarks/plan_accuracy.py [--out benchmarks/results/plan_accuracy.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import warnings

from llamem import build_workload, load_model
from llamem.gpus import budget_gpu
from llamem.plan import make_plan
from llamem.plan_verify import traced_fits, verify_plan

warnings.filterwarnings("ignore")
GiB = 2**30
L2 = {"num_hidden_layers": 2}

SCENARIOS = [
    ("debug", {}, dict(task="train", seq=512), "batch", 1.0),
    ("debug", {}, dict(task="lora", batch=2), "seq", 0.5),
    ("tinyllama-1.1b", L2, dict(task="lora", seq=1024), "batch", 4),
    ("tinyllama-1.1b", L2, dict(task="train", seq=512), "batch", 8),
    ("tinyllama-1.1b", L2, dict(task="train", batch=1), "seq", 6),
    ("llama-3.2-1b", L2, dict(task="lora", seq=2048), "batch", 10),
    ("llama-3.2-1b", L2, dict(task="infer", seq=4096, new_tokens=4), "batch", 4),
    ("llama-3.2-1b", L2, dict(task="infer", batch=4, new_tokens=4), "seq", 4),
    ("llama-2-7b", L2, dict(task="train", seq=1024), "batch", 24),
    ("llama-3.1-8b", L2, dict(task="lora", batch=1), "seq", 12),
    ("llama-3.1-8b", L2, dict(task="qlora", seq=2048), "batch", 8),
]


def true_maximum(spec, workload, what: str, start: int, budget: int) -> tuple[int, int]:
    """Bisection with the trace engine: the largest value whose traced device bytes fit (a
    context no longer than the model's max_position_embeddings, as the planner answers)."""
    limit = (spec.max_position_embeddings - (workload.new_tokens if workload.task == "infer" else 0)
             if what == "seq" else 2**22)

    def fits(value: int) -> bool:
        if value > limit:
            return False
        changes = {"batch": value, "grad_accum": 1} if what == "batch" else {"seq": value}
        return traced_fits(spec, dataclasses.replace(workload, **changes), budget)[0]

    probes = 1
    if fits(start):
        low, high = start, start * 2
        while fits(high):
            low, high, probes = high, high * 2, probes + 1
        probes += 1
    else:
        low, high = start // 2, start
        while low > 0 and not fits(low):
            low, high, probes = low // 2, low, probes + 1
        probes += 1
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
        probes += 1
    return low, probes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/plan_accuracy.json")
    args = parser.parse_args()
    rows = []
    print(f"{'model':<38} {'workload':<34} {'max':<5} {'budget':>7} {'planner':>8} {'trace':>7} {'ratio':>6} "
          f"{'in budget':>9} {'--verify':>9}")
    for name, overrides, options, what, budget_gib in SCENARIOS:
        spec = load_model(name, overrides=overrides)
        budget = int(budget_gib * GiB)
        start = time.perf_counter()
        # The trace engine has no quantized KV cache: inference plans keep the numerics, so the
        # truth is traced with the same cache.
        plan = make_plan(spec, build_workload(**options), budget_gpu(budget), host_budget_bytes=0, maximize_what=what,
                         exact=options["task"] == "infer")
        answer = plan.maximized["value"] if plan.maximized else 0
        workload = plan.final.workload
        truth, probes = true_maximum(spec, workload, what, max(answer, 1), budget)
        in_budget = answer == 0 or answer <= truth
        verified = None
        if plan.fits:  # what `llamem plan --verify` answers: the trace engine settles the edge
            verified = verify_plan(plan).maximized["value"]
        ratio = answer / truth if truth else 0.0
        row = {"model": spec.name, "options": options, "maximize": what, "budget_bytes": budget,
               "planner": answer, "trace": truth, "ratio": ratio, "in_budget": in_budget, "verified": verified,
               "config": {k: getattr(workload, k) for k in ("task", "precision", "quant", "optimizer", "ac_every",
                                                            "loss", "kv_dtype", "prefill_chunk")},
               "trace_probes": probes, "seconds": time.perf_counter() - start}
        rows.append(row)
        print(f"{spec.name[:38]:<38} {json.dumps(options)[:34]:<34} {what:<5} {budget_gib:>5.1f}Gi {answer:>8} "
              f"{truth:>7} {ratio:>6.3f} {'yes' if in_budget else 'NO':>9} {verified!s:>9}", flush=True)
    good = sum(r["ratio"] >= 0.97 and r["in_budget"] for r in rows)
    exact = sum(r["verified"] == r["trace"] for r in rows)
    print(f"analytic planner: {good} of {len(rows)} within [97 %, 100 %] of the traced maximum")
    print(f"with --verify: {exact} of {len(rows)} equal to the traced maximum")
    with open(args.out, "w") as handle:
        json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
