"""`llamem plan --verify`: re-check the winning plan with the trace engine (single-GPU plans).

With `--maximize`, the trace engine also settles the edge: starting from the analytic answer
N, it checks N and N+1 and moves until N fits and N+1 does not (a few traces at most). The
figure checked is the trace report's device memory (`llamem.sizing.trace_report`), the same
definition `llamem estimate` uses. The plan is not changed: a new one is returned.
"""

from __future__ import annotations

import dataclasses

from llamem.errors import MissingDependency
from llamem.plan import Plan, size_limit, with_size

MAX_PROBES = 16
"""Traces one verification may run: about 2 minutes for an 8B model on 2 cores."""


def verify_plan(plan: Plan) -> Plan:
    if plan.final.layout.num_gpus > 1 or plan.final.layout.sharding != "none":
        return dataclasses.replace(plan, verification={
            "verified": False, "reason": "the trace engine runs one GPU; multi-GPU layouts are analytic only"})
    try:
        import torch  # noqa: F401
    except ImportError as err:  # pragma: no cover - torch missing
        raise MissingDependency("--verify needs torch: pip install 'llamem[torch]'") from err
    if not plan.maximized or not plan.maximized["value"]:
        return dataclasses.replace(plan, verification={"verified": True, **_check(plan, plan.final.workload)})
    return _settle_edge(plan)


def _settle_edge(plan: Plan) -> Plan:
    """Gallop from the analytic answer (steps 1, 2, 4, ...) until the trace disagrees, then bisect."""
    what, analytic_value = plan.maximized["what"], plan.maximized["value"]
    results: dict[int, dict] = {}
    limit = size_limit(plan.model, plan.final.workload, what)

    def fits(value: int) -> bool:
        if value > limit:
            return False
        if value not in results:
            results[value] = _check(plan, with_size(plan.final.workload, what, value))
        return results[value]["fits"]

    low, high = _bracket(fits, analytic_value, results)
    while high - low > 1 and len(results) < MAX_PROBES:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    settled = high - 1 == low and low in results and results[low]["fits"] and (
        high not in results or not results[high]["fits"])
    final = dataclasses.replace(plan.final, workload=with_size(plan.final.workload, what, max(low, 1)))
    here = results.get(low) or _check(plan, final.workload)
    verification = {"verified": True, **here, "one_more": results.get(low + 1), "traces": len(results),
                    "settled": settled}
    maximized = {**plan.maximized, "value": low, "analytic_value": analytic_value, "settled": settled}
    return dataclasses.replace(plan, final=final, maximized=maximized, verification=verification)


def _bracket(fits, start: int, results: dict) -> tuple[int, int]:
    """(a value that fits, one that does not) around `start`, galloping away from it."""
    if fits(start):
        low, step = start, 1
        while len(results) < MAX_PROBES and fits(low + step):
            low, step = low + step, step * 2
        return low, low + step
    high, step = start, 1
    while len(results) < MAX_PROBES and high - step >= 1 and not fits(high - step):
        high, step = high - step, step * 2
    return max(high - step, 0), high


def traced_fits(spec, workload, memory_bytes: int):
    """(fits, report) from tracing the workload on one GPU: it fits if the trace's device figure does."""
    from llamem.sizing import trace_report

    report, _events = trace_report(spec, workload)
    return report.device_bytes <= memory_bytes, report


def _check(plan: Plan, workload) -> dict:
    fits, report = traced_fits(plan.model, workload, plan.gpu.memory_bytes)
    return {"batch": workload.batch, "seq": workload.seq, "trace_peak_allocated_bytes": report.peak_allocated_bytes,
            "trace_peak_device_bytes": report.device_bytes, "fits": fits}
