"""`llamem plan --verify`: re-check the winning plan with the trace engine (single-GPU plans)."""

from __future__ import annotations

import dataclasses

from llamem.errors import MissingDependency
from llamem.plan import Plan


def verify_plan(plan: Plan) -> dict:
    if plan.final.layout.num_gpus > 1 or plan.final.layout.sharding != "none":
        return {"verified": False, "reason": "the trace engine runs one GPU; multi-GPU layouts are analytic only"}
    try:
        import torch  # noqa: F401
    except ImportError as err:  # pragma: no cover - torch missing
        raise MissingDependency("--verify needs torch: pip install 'llamem[torch]'") from err
    workload = plan.final.workload
    result = {"verified": True, **_check(plan, workload)}
    if plan.maximized and plan.maximized["value"]:
        key, value = plan.maximized["what"], plan.maximized["value"]
        one_more = dataclasses.replace(workload, **({"batch": value + 1} if key == "batch" else {"seq": value + 1}))
        result["one_more"] = _check(plan, one_more)
    return result


def _check(plan: Plan, workload) -> dict:
    from llamem.allocator.integrate import add_device_memory
    from llamem.trace.api import run_trace

    report, events = run_trace(plan.model, workload)
    report = add_device_memory(report, events, exact=True, num_gpus=1)
    return {"batch": workload.batch, "seq": workload.seq, "trace_peak_allocated_bytes": report.peak_allocated_bytes,
            "trace_peak_device_bytes": report.device_bytes, "fits": report.device_bytes <= plan.gpu.memory_bytes}
