"""`llamem plan --verify`: re-check the winning plan with the trace engine (single-GPU plans).

With `--maximize`, the trace engine also settles the edge: starting from the analytic answer
N, it checks N and N+1 and moves until N fits and N+1 does not (a few traces at most).
"""

from __future__ import annotations

import dataclasses

from llamem.errors import MissingDependency
from llamem.plan import Plan

MAX_PROBES = 16


def verify_plan(plan: Plan) -> dict:
    if plan.final.layout.num_gpus > 1 or plan.final.layout.sharding != "none":
        return {"verified": False, "reason": "the trace engine runs one GPU; multi-GPU layouts are analytic only"}
    try:
        import torch  # noqa: F401
    except ImportError as err:  # pragma: no cover - torch missing
        raise MissingDependency("--verify needs torch: pip install 'llamem[torch]'") from err
    if not plan.maximized or not plan.maximized["value"]:
        return {"verified": True, **_check(plan, plan.final.workload)}
    return _settle_edge(plan)


def _with_value(workload, what: str, value: int):
    return dataclasses.replace(workload, **({"batch": value, "grad_accum": 1} if what == "batch" else {"seq": value}))


def _settle_edge(plan: Plan) -> dict:
    """Gallop from the analytic answer (steps 1, 2, 4, ...) until the trace disagrees, then bisect."""
    what, analytic_value = plan.maximized["what"], plan.maximized["value"]
    results: dict[int, dict] = {}

    limit = (plan.model.max_position_embeddings - (plan.final.workload.new_tokens if plan.final.workload.task == "infer"
                                                   else 0) if what == "seq" else 2**22)

    def fits(value: int) -> bool:
        if value > limit:
            return False
        if value not in results:
            results[value] = _check(plan, _with_value(plan.final.workload, what, value))
        return results[value]["fits"]

    if fits(analytic_value):
        low, step = analytic_value, 1
        while len(results) < MAX_PROBES and fits(low + step):
            low, step = low + step, step * 2
        high = low + step
    else:
        high, step = analytic_value, 1
        while len(results) < MAX_PROBES and high - step >= 1 and not fits(high - step):
            high, step = high - step, step * 2
        low = max(high - step, 0)
    while high - low > 1 and len(results) < MAX_PROBES:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    settled = high - 1 == low and low in results and results[low]["fits"] and (high not in results or not
                                                                               results[high]["fits"])
    plan.maximized.update(value=low, analytic_value=analytic_value, settled=settled)
    plan.final = dataclasses.replace(plan.final, workload=_with_value(plan.final.workload, what, max(low, 1)))
    here = results.get(low) or _check(plan, plan.final.workload)
    above = results.get(low + 1)
    return {"verified": True, **here, "one_more": above, "traces": len(results), "settled": settled}


def traced_fits(spec, workload, memory_bytes: int):
    """(fits, report) from tracing the workload on one GPU: it fits if its device bytes do, or for
    generation (whose figure is the smallest card it runs on) if its allocations replay without an
    out-of-memory error on a card of `memory_bytes`."""
    from llamem.allocator.integrate import add_device_memory
    from llamem.allocator.replay import runs_on_card
    from llamem.trace.api import run_trace

    report, events = run_trace(spec, workload)
    report = add_device_memory(report, events, exact=True, num_gpus=1)
    if workload.task == "infer":
        return runs_on_card(events, memory_bytes - report.non_torch_bytes) is not None, report
    return report.device_bytes <= memory_bytes, report


def _check(plan: Plan, workload) -> dict:
    fits, report = traced_fits(plan.model, workload, plan.gpu.memory_bytes)
    return {"batch": workload.batch, "seq": workload.seq, "trace_peak_allocated_bytes": report.peak_allocated_bytes,
            "trace_peak_device_bytes": report.device_bytes, "fits": fits}
