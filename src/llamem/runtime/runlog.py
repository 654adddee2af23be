"""The memory monitor's JSONL log (`llamem.runtime.monitor`), read with every field checked and
summarized: per phase, the measured peak against llamem's prediction. `llamem report` prints it."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from llamem.errors import LlamemError
from llamem.runtime.checked import MAX_COUNT, DumpError, checked_dict, checked_int, checked_str, shown
from llamem.units import MAX_SIZE_BYTES

MAX_LISTED_PROBLEMS = 20
_RECORD_TYPES = ("header", "workload", "step", "leak", "oom")
_STEP_BYTES = ("peak_allocated_bytes", "peak_reserved_bytes", "allocated_bytes", "reserved_bytes", "nvml_used_bytes",
               "non_torch_bytes")
_PHASE_BYTES = ("peak_allocated_bytes", "peak_reserved_bytes", "end_allocated_bytes", "end_reserved_bytes")


@dataclass(frozen=True, kw_only=True)
class RunLog:
    """The records of a monitor log, each checked, in file order; the lines that could not be read."""

    path: str
    header: dict | None
    records: tuple[dict, ...]
    """workload, step, leak and oom records; each step carries `_workload`, the index in `workloads`
    of the workload line in effect (None before the first)."""
    workloads: tuple[dict, ...]
    problems: tuple[str, ...]

    def of_type(self, kind: str) -> list[dict]:
        return [r for r in self.records if r["type"] == kind]


def read_log(path) -> RunLog:
    path = Path(path)
    if not path.is_file():
        what = "is a folder" if path.is_dir() else "does not exist"
        raise DumpError(f"{path} {what}: give the JSONL log the memory monitor wrote")
    header, records, workloads, problems = None, [], [], []
    try:
        with path.open("rb") as handle:
            lines = list(enumerate(handle, 1))
    except OSError as err:
        raise DumpError(f"{path}: cannot be read ({err.strerror or err})") from None
    for number, raw in lines:
        if not raw.strip():
            continue
        try:
            record = _log_record(raw, f"line {number}")
        except DumpError as err:
            cut = number == len(lines) and not raw.endswith(b"\n")
            problems.append(f"line {number}: cut off (the run ended while writing it); ignored" if cut else str(err))
            continue
        if record["type"] == "header":
            header = header or record
        elif record["type"] == "workload":
            workloads.append(record)
        else:
            records.append({**record, "_workload": len(workloads) - 1 if workloads else None})
    if header is None and not records and not workloads:
        raise DumpError(f"{path}: no readable record in {len(lines)} lines; expected the JSONL log of "
                        "llamem's memory monitor (first line: a header record)" +
                        (f" ({problems[0]})" if problems else ""))
    return RunLog(path=str(path), header=header, records=tuple(records), workloads=tuple(workloads),
                  problems=tuple(problems))


def _log_record(raw: bytes, where: str) -> dict:
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError) as err:
        raise DumpError(f"{where}: not JSON ({err})") from None
    record = checked_dict(record, f"{where}: the record")
    kind = record.get("type")
    if kind not in _RECORD_TYPES:
        raise DumpError(f"{where}: unknown record type {shown(kind)}; expected one of {', '.join(_RECORD_TYPES)}")
    return {"header": _header_record, "workload": _workload_record, "step": _step_record, "leak": _leak_record,
            "oom": _oom_record}[kind](record, f"{where} ({kind})")


def _step_number(record: dict, where: str) -> int:
    return checked_int(record.get("step"), f"{where}: 'step'", maximum=MAX_COUNT, what="a step number")


def _header_record(record: dict, where: str) -> dict:
    return {"type": "header", "source": checked_str(record.get("source"), f"{where}: 'source'", optional=True),
            "device": checked_str(record.get("device"), f"{where}: 'device'", optional=True),
            "capacity_bytes": checked_int(record.get("capacity_bytes"), f"{where}: 'capacity_bytes'", optional=True),
            "started": checked_str(record.get("started"), f"{where}: 'started'", optional=True)}


def _workload_record(record: dict, where: str) -> dict:
    predicted = checked_dict(record.get("predicted") or {}, f"{where}: 'predicted'")
    unknown = record.get("unknown") or []
    if not isinstance(unknown, list) or not all(isinstance(u, str) for u in unknown):
        raise DumpError(f"{where}: 'unknown' must be a list of strings, got {shown(unknown)}")
    return {"type": "workload", "step": _step_number(record, where),
            "model": checked_str(record.get("model"), f"{where}: 'model'", optional=True),
            "workload": checked_dict(record.get("workload"), f"{where}: 'workload'", optional=True),
            "command": checked_str(record.get("command") or "", f"{where}: 'command'"),
            "config_path": checked_str(record.get("config_path"), f"{where}: 'config_path'", optional=True),
            "unknown": unknown, "problem": checked_str(record.get("problem"), f"{where}: 'problem'", optional=True),
            "predicted": {checked_str(k, f"{where}: a phase name"): checked_int(v, f"{where}: 'predicted'.{k}")
                          for k, v in predicted.items()}}


def _step_record(record: dict, where: str) -> dict:
    time_s = record.get("time_s")
    if isinstance(time_s, bool) or not isinstance(time_s, (int, float)) or not math.isfinite(time_s) or time_s < 0:
        raise DumpError(f"{where}: 'time_s' must be a number of seconds, 0 or more, got {shown(time_s)}")
    phases = {}
    for name, figures in checked_dict(record.get("phases") or {}, f"{where}: 'phases'").items():
        figures = checked_dict(figures, f"{where}: 'phases'.{name}")
        phases[name] = {k: checked_int(figures.get(k), f"{where}: 'phases'.{name}.{k}", optional=True)
                        for k in _PHASE_BYTES}
    out = {"type": "step", "step": _step_number(record, where), "time_s": float(time_s), "phases": phases}
    out |= {k: checked_int(record.get(k), f"{where}: {k!r}", optional=True) for k in _STEP_BYTES}
    out |= {k: checked_int(record.get(k), f"{where}: {k!r}", optional=True, maximum=MAX_COUNT, what="a count")
            for k in ("num_alloc_retries", "num_ooms", "batch", "seq")}
    breakdown = checked_dict(record.get("breakdown"), f"{where}: 'breakdown'", optional=True)
    out["breakdown"] = None if breakdown is None else {
        checked_str(k, f"{where}: a category"): checked_int(v, f"{where}: 'breakdown'.{k}")
        for k, v in breakdown.items()}
    return out


def _leak_record(record: dict, where: str) -> dict:
    def signed(key: str) -> int:
        value = record.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or abs(value) > MAX_SIZE_BYTES:
            raise DumpError(f"{where}: {key!r} must be a byte count (an integer), got {shown(value)}")
        return value

    sources = []
    for n, item in enumerate(record.get("sources") or []):
        item = checked_dict(item, f"{where}: sources[{n}]")
        stack = item.get("stack") or []
        sources.append({"bytes": checked_int(item.get("bytes"), f"{where}: sources[{n}].bytes"),
                        "count": checked_int(item.get("count", 0), f"{where}: sources[{n}].count",
                                             maximum=MAX_COUNT, what="a count"),
                        "category": checked_str(item.get("category") or "", f"{where}: sources[{n}].category"),
                        "stack": [str(frame) for frame in stack] if isinstance(stack, list) else []})
    return {"type": "leak", "step": _step_number(record, where),
            "steps": checked_int(record.get("steps"), f"{where}: 'steps'", maximum=MAX_COUNT, what="a count"),
            "growth_bytes_per_step": signed("growth_bytes_per_step"), "live_growth_bytes": signed("live_growth_bytes"),
            "sources": sources}


def _oom_record(record: dict, where: str) -> dict:
    return {"type": "oom", "step": _step_number(record, where),
            "phase": checked_str(record.get("phase"), f"{where}: 'phase'", optional=True),
            "message": checked_str(record.get("message") or "", f"{where}: 'message'"),
            "dump_dir": checked_str(record.get("dump_dir"), f"{where}: 'dump_dir'", optional=True)}


@dataclass(frozen=True, kw_only=True)
class PhasePeak:
    phase: str
    measured_bytes: int
    """The largest peak allocated of this phase over the steps of one workload."""
    at_step: int
    predicted_bytes: int | None

    @property
    def ratio(self) -> float | None:
        return self.measured_bytes / self.predicted_bytes if self.predicted_bytes else None


@dataclass(frozen=True, kw_only=True)
class WorkloadSteps:
    """The steps run under one workload line (the batch shape changes start a new one)."""

    workload: dict | None
    num_steps: int
    first_step: int | None
    last_step: int | None
    peaks: tuple[PhasePeak, ...]


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    log: RunLog
    runs: tuple[WorkloadSteps, ...]
    num_steps: int
    duration_s: float
    peak_allocated_bytes: int | None
    peak_step: int | None
    peak_reserved_bytes: int | None
    nvml_used_bytes: int | None
    non_torch_bytes: int | None
    num_alloc_retries: int
    num_ooms: int
    breakdown: dict[str, int] | None
    breakdown_label: str
    """'measured at step N', 'predicted by llamem estimate', or why there is none."""
    command: str


def _largest(values) -> int | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def summarize_log(log: RunLog) -> RunSummary:
    steps = log.of_type("step")
    peak = max(steps, key=lambda s: s["peak_allocated_bytes"] or 0, default=None)
    breakdown, label = _peak_breakdown(log, peak)
    ooms = max(len(log.of_type("oom")), _largest(s["num_ooms"] for s in steps) or 0)
    return RunSummary(
        log=log, runs=_workload_steps(log), num_steps=len(steps),
        duration_s=max((s["time_s"] for s in steps), default=0.0),
        peak_allocated_bytes=None if peak is None else peak["peak_allocated_bytes"],
        peak_step=None if peak is None else peak["step"],
        peak_reserved_bytes=_largest(s["peak_reserved_bytes"] for s in steps),
        nvml_used_bytes=_largest(s["nvml_used_bytes"] for s in steps),
        non_torch_bytes=_largest(s["non_torch_bytes"] for s in steps),
        num_alloc_retries=_largest(s["num_alloc_retries"] for s in steps) or 0, num_ooms=ooms,
        breakdown=breakdown, breakdown_label=label,
        command=next((w["command"] for w in reversed(log.workloads) if w["command"]), ""))


def _workload_steps(log: RunLog) -> tuple[WorkloadSteps, ...]:
    groups: dict[int | None, list[dict]] = {}
    for record in log.of_type("step"):
        groups.setdefault(record["_workload"], []).append(record)
    runs = []
    for index in [None, *range(len(log.workloads))]:
        steps = groups.get(index, [])
        if index is None and not steps:
            continue
        workload = None if index is None else log.workloads[index]
        runs.append(WorkloadSteps(workload=workload, num_steps=len(steps),
                                  first_step=steps[0]["step"] if steps else None,
                                  last_step=steps[-1]["step"] if steps else None,
                                  peaks=_phase_peaks(steps, (workload or {}).get("predicted", {}))))
    return tuple(runs)


def _phase_peaks(steps: list[dict], predicted: dict[str, int]) -> tuple[PhasePeak, ...]:
    best: dict[str, tuple[int, int]] = {}
    for record in steps:
        for phase, figures in record["phases"].items():
            value = figures["peak_allocated_bytes"]
            if value is not None and (phase not in best or value > best[phase][0]):
                best[phase] = (value, record["step"])
    order = [*[p for p in predicted if p in best], *[p for p in best if p not in predicted]]
    return tuple(PhasePeak(phase=p, measured_bytes=best[p][0], at_step=best[p][1], predicted_bytes=predicted.get(p))
                 for p in order)


def _peak_breakdown(log: RunLog, peak: dict | None) -> tuple[dict[str, int] | None, str]:
    """The breakdown the log measured at its peak step; else the workload's predicted one."""
    if peak is not None and peak["breakdown"]:
        return peak["breakdown"], f"measured at step {peak['step']} (the peak)"
    index = peak["_workload"] if peak is not None else (len(log.workloads) - 1 if log.workloads else None)
    if index is None:
        return None, "no breakdown: the log has no workload line to predict one from"
    return predicted_breakdown(log.workloads[index])


def predicted_breakdown(workload_record: dict) -> tuple[dict[str, int] | None, str]:
    """`llamem estimate`'s breakdown at the peak for a workload line, or None and why."""
    from llamem.analytic import estimate
    from llamem.model import load_model
    from llamem.runtime.explain import dump_workload

    if workload_record["workload"] is None:
        return None, f"no breakdown: {workload_record['problem'] or 'the workload line holds no workload'}"
    config_path, model = workload_record["config_path"], workload_record["model"]
    try:
        if config_path and Path(config_path).is_file():
            spec = load_model(config_path=config_path)
        elif model:
            spec = load_model(model)
        else:
            return None, "no breakdown: the workload line names no model"
        report = estimate(spec, dump_workload(workload_record, "the workload line"))
    except LlamemError as err:
        return None, f"no breakdown: the model could not be sized ({err})"
    return dict(report.breakdown), f"predicted by llamem estimate (peak phase: {report.peak_phase}), not measured"


def summary_to_dict(s: RunSummary) -> dict:
    return {
        "log": s.log.path, "header": s.log.header, "num_steps": s.num_steps, "duration_s": s.duration_s,
        "peak_allocated_bytes": s.peak_allocated_bytes, "peak_step": s.peak_step,
        "peak_reserved_bytes": s.peak_reserved_bytes, "nvml_used_bytes": s.nvml_used_bytes,
        "non_torch_bytes": s.non_torch_bytes, "num_alloc_retries": s.num_alloc_retries, "num_ooms": s.num_ooms,
        "workloads": [{"workload": None if r.workload is None else {k: v for k, v in r.workload.items() if k != "type"},
                       "num_steps": r.num_steps, "first_step": r.first_step, "last_step": r.last_step,
                       "phases": [{"phase": p.phase, "measured_peak_allocated_bytes": p.measured_bytes,
                                   "at_step": p.at_step, "predicted_bytes": p.predicted_bytes,
                                   "ratio": None if p.ratio is None else round(p.ratio, 4)} for p in r.peaks]}
                      for r in s.runs],
        "leaks": [_public(r) for r in s.log.of_type("leak")], "ooms": [_public(r) for r in s.log.of_type("oom")],
        "breakdown": s.breakdown, "breakdown_label": s.breakdown_label, "command": s.command,
        "problems": list(s.log.problems),
    }


def _public(record: dict) -> dict:
    return {k: v for k, v in record.items() if not k.startswith("_")}
