"""Plans as text (a ladder) and JSON, from the same Plan object."""

from __future__ import annotations

import dataclasses

from llamem.plan import Plan, shortfall_text, shortfalls
from llamem.reporters.json_report import workload_dict
from llamem.snippet import plan_code
from llamem.teacher_placement import placement_note
from llamem.units import display_unit, format_in


def _config(c) -> dict:
    return {"workload": workload_dict(c.workload), "layout": dataclasses.asdict(c.layout),
            "layout_description": c.layout.describe()}


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
                  "command": plan.command},
        "notes": list(plan.notes),
    }
    if plan.fits:
        out["final"]["code"] = plan_code(plan)
    else:
        out["shortfall_bytes"] = plan.shortfall_bytes
        out["shortfall"] = shortfalls(plan)
    if plan.truncated:
        out["truncated"] = {"requested_seq": plan.start.workload.seq, "seq": plan.final.workload.seq}
    if plan.maximized:
        out["maximized"] = plan.maximized
    if plan.verification:
        out["verification"] = plan.verification
    if plan.engine != "any":
        out["engine"] = plan.engine
    if plan.megatron_args:
        out["final"]["megatron_args"] = list(plan.megatron_args)
    if plan.final.workload.task == "distill":
        out["final"]["teacher"] = placement_note(plan.final.workload, plan.final.layout)
    return out


def render_plan(plan: Plan, show_code: bool = False) -> str:
    unit = display_unit(plan.gpu.memory_bytes)
    format_gib = lambda b: format_in(b, unit)  # noqa: E731
    card = f"{plan.num_gpus} x {plan.gpu.name}" if plan.num_gpus > 1 else plan.gpu.name
    lines = [f"{plan.model.name} on {card} ({format_gib(plan.gpu.memory_bytes)} each)",
             f"start: {format_gib(plan.start.device_bytes)} per GPU"
             + ("  (fits as is)" if plan.fits and not plan.steps else "")]
    for i, step in enumerate(plan.steps, 1):
        lines.append(f"  {i}. {step.technique:<36} {step.change:<34} -> {format_gib(step.peak_device_bytes):>11}  "
                     f"x{step.relative_step_time:.2f} time   ({step.reason})")
    if plan.fits:
        headroom = plan.gpu.memory_bytes - plan.final.device_bytes
        lines.append(f"fits: {format_gib(plan.final.device_bytes)} of {format_gib(plan.gpu.memory_bytes)} "
                     f"({format_gib(headroom)} headroom), step time x{plan.relative_step_time:.2f} of the start")
    else:
        lines.append(f"DOES NOT FIT: the closest configuration {shortfall_text(plan)}")
    teacher = placement_note(plan.final.workload, plan.final.layout)
    lines += [f"teacher: {teacher}"] if teacher else []
    if plan.final.host_bytes:
        lines.append(f"host memory needed for offload: {format_gib(plan.final.host_bytes)} "
                     f"(budget {format_gib(plan.host_budget_bytes)})")
    if plan.maximized:
        lines.append(f"largest {plan.maximized['what']} that fits: {plan.maximized['value']}")
    lines += _verification_lines(plan.verification, format_gib)
    lines.append(f"reproduce: {plan.command}")
    if plan.megatron_args:
        lines.append(f"megatron-lm: {' '.join(plan.megatron_args)}")
    lines += [f"note: {note}" for note in plan.notes]
    if show_code and plan.fits:
        lines += ["", "code:", plan_code(plan).rstrip("\n")]
    return "\n".join(lines)


def _verification_lines(verification: dict | None, format_gib) -> list[str]:
    if not verification:
        return []
    if not verification.get("verified"):
        return [f"verify: not verified: {verification['reason']}"]
    fits = "fits" if verification["fits"] else "DOES NOT FIT"
    lines = [f"verify: llamem trace at batch {verification['batch']} x seq {verification['seq']}: peak allocated "
             f"{format_gib(verification['trace_peak_allocated_bytes'])}, device "
             f"{format_gib(verification['trace_peak_device_bytes'])}: {fits}"]
    above = verification.get("one_more")
    if above:
        lines.append(f"verify: one more ({above['batch']} x {above['seq']}): device "
                     f"{format_gib(above['trace_peak_device_bytes'])}: {'fits' if above['fits'] else 'does not fit'}"
                     f" ({verification['traces']} traces)")
    return lines
