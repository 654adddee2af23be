"""Plans as text (a ladder) and JSON, from the same Plan object."""

from __future__ import annotations

import dataclasses

from llamem.plan import Plan, estimate_command
from llamem.snippet import plan_code
from llamem.units import GiB


def _config(c) -> dict:
    w = {f.name: getattr(c.workload, f.name) for f in dataclasses.fields(c.workload) if not f.name.startswith("_")}
    w["lora_targets"] = list(c.workload.lora_targets)
    return {"workload": w, "layout": dataclasses.asdict(c.layout), "layout_description": c.layout.describe()}


def plan_to_dict(plan: Plan) -> dict:
    out = {
        "model": {"name": plan.model.name, "num_params": plan.model.num_params},
        "gpu": {"name": plan.gpu.name, "memory_bytes": plan.gpu.memory_bytes, "usable_bytes": plan.gpu.usable_bytes},
        "num_gpus": plan.num_gpus,
        "fits": plan.fits,
        "start": {"config": _config(plan.start), "peak_device_bytes": plan.start.device_bytes},
        "steps": [dataclasses.asdict(s) for s in plan.steps],
        "final": {"config": _config(plan.final), "peak_device_bytes": plan.final.device_bytes,
                  "peak_allocated_bytes": plan.final.allocated_bytes,
                  "relative_step_time": round(plan.relative_step_time, 4), "host_bytes": plan.final.host_bytes,
                  "command": estimate_command(plan)},
        "notes": plan.notes,
    }
    if plan.fits:
        out["final"]["code"] = plan_code(plan)
    else:
        out["shortfall_bytes"] = plan.shortfall_bytes
    if plan.truncated:
        out["truncated"] = {"requested_seq": plan.start.workload.seq, "seq": plan.final.workload.seq}
    if plan.maximized:
        out["maximized"] = plan.maximized
    if plan.verification:
        out["verification"] = plan.verification
    return out


def render_plan(plan: Plan) -> str:
    gib = lambda b: f"{b / GiB:.2f} GiB"  # noqa: E731
    card = f"{plan.num_gpus} x {plan.gpu.name}" if plan.num_gpus > 1 else plan.gpu.name
    lines = [f"{plan.model.name} on {card} ({gib(plan.gpu.memory_bytes)} each)",
             f"start: {gib(plan.start.device_bytes)} per GPU"
             + ("  (fits as is)" if plan.fits and not plan.steps else "")]
    for i, step in enumerate(plan.steps, 1):
        lines.append(f"  {i}. {step.technique:<36} {step.change:<34} -> {gib(step.peak_device_bytes):>11}  "
                     f"x{step.relative_step_time:.2f} time   ({step.reason})")
    if plan.fits:
        headroom = plan.gpu.memory_bytes - plan.final.device_bytes
        lines.append(f"fits: {gib(plan.final.device_bytes)} of {gib(plan.gpu.memory_bytes)} "
                     f"({gib(headroom)} headroom), step time x{plan.relative_step_time:.2f} of the start")
    else:
        lines.append(f"DOES NOT FIT: the closest configuration needs {gib(plan.final.device_bytes)} per GPU and "
                     f"is {gib(plan.shortfall_bytes)} over budget")
    if plan.final.host_bytes:
        lines.append(f"host memory needed for offload: {gib(plan.final.host_bytes)} "
                     f"(budget {gib(plan.host_budget_bytes)})")
    if plan.maximized:
        lines.append(f"largest {plan.maximized['what']} that fits: {plan.maximized['value']}")
    if plan.verification:
        lines.append(f"verified with llamem trace: {plan.verification}")
    lines.append(f"reproduce: {estimate_command(plan)}")
    for note in plan.notes:
        lines.append(f"note: {note}")
    return "\n".join(lines)
