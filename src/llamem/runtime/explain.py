"""An OOM dump folder (written by `llamem.runtime.oom`), explained. The monitor's JSONL log is
read and summarized in `llamem.runtime.runlog`.

An OOM is explained in three parts:
- what was live at the error, by category: the CPU tracker labels each storage; a CUDA snapshot
  does not, so its blocks are classified by their allocation stacks when it has them (approximate)
  and are otherwise "unclassified";
- whether fragmentation caused it: the live bytes plus the failed request, against the memory the
  allocator could get. If they would fit a perfectly packed card the cause is fragmentation, and
  the snapshot is replayed through the allocator simulator with each PYTORCH_CUDA_ALLOC_CONF
  setting (`llamem.allocator.advice`) to find one that completes; else it is a true shortage;
- the workload read from the live objects, and `llamem plan`'s ladder for it on that card.

Everything read is checked: a missing, truncated or malformed file is a LlamemError naming the
file, the field and the fix.
"""

from __future__ import annotations

import dataclasses
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from llamem.errors import LlamemError
from llamem.runtime.checked import (MAX_COUNT, DumpError, checked_dict, checked_int, checked_str,
                                    read_json, shown)
from llamem.runtime.sources import STAT_KEYS
from llamem.units import MAX_SIZE_BYTES

LIVE_ORDER = ("weights", "gradients", "optimizer state", "activations", "logits", "KV cache", "other/temporaries",
              "unclassified")
CACHED_FREE = "cached but free"
_SOURCES = ("cuda", "cpu-tracker")


# The dump folder -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Dump:
    directory: Path
    record: dict
    """oom.json, every field checked."""
    snapshot: dict
    config_path: Path | None
    """The dump's own config.json; else the one oom.json names, if it still exists; else None."""

    def missing_config(self) -> str:
        """Why the model cannot be sized from this dump, and the fix (when config_path is None)."""
        from llamem.runtime.oom import CONFIG_FILE

        recorded = self.record["config_path"]
        gone = f" and the {recorded} it was written with no longer exists" if recorded else ""
        return (f"no config to size the model: {self.directory} holds no {CONFIG_FILE}{gone}; copy the model's "
                f"{CONFIG_FILE} into {self.directory} and run llamem explain-oom again")


def load_dump(directory) -> Dump:
    from llamem.runtime.oom import CONFIG_FILE, OOM_FILE

    directory = Path(directory)
    if not directory.is_dir():
        what = "is a file" if directory.exists() else "does not exist"
        raise DumpError(f"{directory} {what}: give the OOM dump folder (the one holding {OOM_FILE}, written by "
                        "llamem.runtime.oom_guard or the memory monitor)")
    if not (directory / OOM_FILE).is_file():
        raise DumpError(f"{directory}: no {OOM_FILE} in this folder; it is not an OOM dump (see oom_guard)")
    record = check_record(read_json(directory / OOM_FILE, "OOM record"), str(directory / OOM_FILE))
    return Dump(directory=directory, record=record, snapshot=_read_snapshot(directory),
                config_path=_config_path(directory / CONFIG_FILE, record["config_path"]))


def _config_path(own: Path, recorded: str | None) -> Path | None:
    """The folder's own config.json (a copied or moved dump carries it); else the one the dump was
    written with, where it still is."""
    if own.is_file():
        return own
    if recorded and Path(recorded).is_file():
        return Path(recorded)
    return None


def _read_snapshot(directory: Path) -> dict:
    from llamem.allocator.trace_input import read_data
    from llamem.runtime.oom import SNAPSHOT_JSON, SNAPSHOT_PICKLE

    for name in (SNAPSHOT_JSON, SNAPSHOT_PICKLE):
        if (directory / name).is_file():
            path = directory / name
            return checked_dict(read_data(path), f"{path}: the top level")
    raise DumpError(f"{directory}: no {SNAPSHOT_JSON} or {SNAPSHOT_PICKLE}; the dump is incomplete: write it again")


def check_record(record: dict, where: str) -> dict:
    """oom.json with each field of the dump contract checked (absent optional fields become None)."""
    if record.get("version") != 1:
        raise DumpError(f"{where}: 'version' must be 1, got {shown(record.get('version'))}; this llamem reads "
                        "version 1 dumps")
    out = {"version": 1, "message": checked_str(record.get("message"), f"{where}: 'message'"),
           "step": checked_int(record.get("step"), f"{where}: 'step'", maximum=MAX_COUNT, optional=True,
                               what="a step number"),
           "phase": checked_str(record.get("phase"), f"{where}: 'phase'", optional=True)}
    source = record.get("source")
    if source not in _SOURCES:
        raise DumpError(f"{where}: 'source' must be 'cuda' or 'cpu-tracker', got {shown(source)}")
    out["source"] = source
    for key in ("capacity_bytes", "requested_bytes"):
        out[key] = checked_int(record.get(key), f"{where}: {key!r}", optional=True)
    for key in ("device_name", "model", "config_path", "alloc_conf", "problem"):
        out[key] = checked_str(record.get(key), f"{where}: {key!r}", optional=True)
    out["command"] = checked_str(record.get("command") or "", f"{where}: 'command'")
    out["stats"] = _check_stats(checked_dict(record.get("stats"), f"{where}: 'stats'"), where)
    out["workload"] = checked_dict(record.get("workload"), f"{where}: 'workload'", optional=True)
    unknown = record.get("unknown") or []
    if not isinstance(unknown, list) or not all(isinstance(u, str) for u in unknown):
        raise DumpError(f"{where}: 'unknown' must be a list of strings, got {shown(unknown)}")
    out["unknown"] = unknown
    return out


def _check_stats(stats: dict, where: str) -> dict:
    counts = ("num_alloc_retries", "num_ooms")
    return {key: checked_int(stats.get(key), f"{where}: 'stats'.{key}", optional=True,
                             maximum=MAX_COUNT if key in counts else MAX_SIZE_BYTES,
                             what="a count" if key in counts else "a byte count")
            for key in STAT_KEYS}


# What was live ---------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class LiveCategory:
    name: str
    size_bytes: int
    parts: dict[str, int] = field(default_factory=dict)
    """The labels it gathers (the tracker's categories, e.g. optimizer/exp_avg), when more precise."""


@dataclass(frozen=True, kw_only=True)
class LiveMemory:
    categories: tuple[LiveCategory, ...]
    """Non-empty categories in LIVE_ORDER."""
    allocated_bytes: int
    reserved_bytes: int
    how: str
    """How the categories were found (the tracker's labels, or allocation stacks: approximate)."""

    @property
    def cached_free_bytes(self) -> int:
        return self.reserved_bytes - self.allocated_bytes


def _tracker_group(label: str) -> str:
    top = label.split("/", 1)[0]
    return {"weights": "weights", "gradients": "gradients", "optimizer": "optimizer state",
            "activations": "activations", "logits": "logits", "kv_cache": "KV cache"}.get(top, "other/temporaries")


def _grouped(labelled: list[tuple[str, str, int]]) -> tuple[LiveCategory, ...]:
    """(group, label, bytes) triples -> categories in display order, each with its labels."""
    parts: dict[str, dict[str, int]] = {}
    for group, label, size in labelled:
        parts.setdefault(group, {})
        parts[group][label] = parts[group].get(label, 0) + size
    return tuple(LiveCategory(name=g, size_bytes=sum(parts[g].values()),
                              parts=dict(sorted(parts[g].items())) if set(parts[g]) != {g} else {})
                 for g in LIVE_ORDER if g in parts)


def tracker_live(snapshot: dict, where: str) -> LiveMemory:
    """The tracker's `live` list: exact bytes per category; nothing is cached."""
    if snapshot.get("format") != "llamem-trace-v1" or not isinstance(snapshot.get("live"), list):
        raise DumpError(f"{where}: a CPU tracker dump holds a llamem-trace-v1 document with a 'live' list "
                        "(CpuMemoryTracker.snapshot()); this one has neither: write the dump again")
    labelled = []
    for n, item in enumerate(snapshot["live"]):
        item = checked_dict(item, f"{where}: live[{n}]")
        size = checked_int(item.get("size"), f"{where}: live[{n}].size")
        label = checked_str(item.get("category", "temporaries"), f"{where}: live[{n}].category")
        labelled.append((_tracker_group(label), label, size))
    allocated = sum(size for _g, _l, size in labelled)
    checked_int(allocated, f"{where}: the live total")
    return LiveMemory(categories=_grouped(labelled), allocated_bytes=allocated, reserved_bytes=allocated,
                      how="the CPU tracker's labels (exact)")


# A CUDA block's category from its allocation stack: the first rule any frame matches.
# Approximate by nature: a stack says where memory was asked for, not what holds it.
_STACK_RULES = (
    ("optimizer state", lambda file, name: "/torch/optim/" in file),
    ("KV cache", lambda file, name: file.endswith("/cache_utils.py")),
    ("logits", lambda file, name: "/transformers/loss/" in file or name in ("cross_entropy", "log_softmax")),
    ("activations", lambda file, name: file.endswith("/torch/utils/checkpoint.py")),  # recomputed in backward
    ("gradients", lambda file, name: "/torch/autograd/" in file or name in ("backward", "_engine_run_backward")),
    ("weights", lambda file, name: name in ("from_pretrained", "_load_pretrained_model", "load_state_dict",
                                            "_apply", "to_empty", "cuda")),
    ("activations", lambda file, name: name == "forward" or "/torch/nn/" in file),
)
STACK_NOTE = ("classified by allocation stack, approximately: torch/optim -> optimizer state; autograd's "
              "backward -> gradients (activation gradients that backward frees later count here too); "
              "transformers' cache_utils -> KV cache; the loss -> logits; a module's forward -> activations; "
              "model loading and .to()/.cuda() -> weights; any other stack -> other/temporaries")


def stack_category(frames) -> str:
    if not isinstance(frames, list) or not frames:
        return "unclassified"
    named = [(str(f.get("filename", "")).replace("\\", "/"), str(f.get("name", "")))
             for f in frames if isinstance(f, dict)]
    for category, rule in _STACK_RULES:
        if any(rule(file, name) for file, name in named):
            return category
    return "other/temporaries"


def cuda_live(snapshot: dict, stats: dict, where: str) -> LiveMemory:
    """Live blocks of the snapshot's segments (validated by the replay's reader), by stack."""
    from llamem.allocator.trace_input import parse_snapshot

    parsed = parse_snapshot(snapshot, where)
    if parsed.segments is None:
        allocated = stats.get("allocated_bytes") or 0
        reserved = max(allocated, stats.get("reserved_bytes") or 0)
        return LiveMemory(categories=(LiveCategory(name="unclassified", size_bytes=allocated),) if allocated else (),
                          allocated_bytes=allocated, reserved_bytes=reserved,
                          how="none: the snapshot has no segments (totals from the allocator's statistics)")
    labelled, reserved = [], 0
    for segment in snapshot.get("segments", []):
        if segment.get("device", parsed.device) != parsed.device:
            continue
        reserved += segment["total_size"]
        for block in segment.get("blocks", []):
            if block["state"] != "inactive":
                category = stack_category(block.get("frames"))
                labelled.append((category, category, block["size"]))
    allocated = sum(size for _g, _l, size in labelled)
    checked_int(reserved, f"{where}: the segments' total size")
    checked_int(allocated, f"{where}: the live blocks' total size")
    has_stacks = any(category != "unclassified" for category, _l, _s in labelled)
    how = STACK_NOTE if has_stacks else ("none: the snapshot's blocks carry no allocation stacks (record them with "
                                         "torch.cuda.memory._record_memory_history(stacks='python') before the run)")
    return LiveMemory(categories=_grouped(labelled), allocated_bytes=allocated, reserved_bytes=max(reserved, allocated),
                      how=how)


# Fragmentation or shortage ---------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Verdict:
    kind: str
    """'shortage', 'fragmentation', or 'unknown' (no capacity or no request to compare)."""
    capacity_bytes: int | None
    """What the allocator could get at the error."""
    capacity_source: str
    needed_bytes: int | None
    """Live bytes + the failed request: what a perfectly packed card must hold."""
    shortfall_bytes: int = 0
    replay: dict | None = None
    """The simulator's replay at that capacity: completes, peak_reserved_bytes, message."""
    advice: tuple[dict, ...] = ()
    advice_summary: str | None = None
    notes: tuple[str, ...] = ()


def allocator_capacity(record: dict, trace) -> tuple[int | None, str]:
    """What cudaMalloc could get: torch's own reading at the error when the trace has it, else the
    card's capacity less the memory outside PyTorch (NVML), else the card's capacity."""
    if record["source"] == "cpu-tracker":
        return record["capacity_bytes"], "the tracker's capacity"
    if trace is not None and trace.oom_capacity_bytes is not None:
        return trace.oom_capacity_bytes, "reserved + device_free at the error, from the snapshot's oom entry"
    capacity, outside = record["capacity_bytes"], record["stats"].get("non_torch_bytes")
    if capacity is None:
        return None, "unknown: oom.json has no capacity_bytes"
    if outside is not None and outside < capacity:
        return capacity - outside, "the card's capacity less the memory outside PyTorch: NVML used - reserved"
    return capacity, "the card's capacity; the CUDA context's share is not known, so it is not taken off"


def verdict(dump: Dump, live: LiveMemory, request: int | None, trace=None) -> Verdict:
    """`trace`: the CUDA snapshot as the replay reads it (`loaded_trace`); None for the tracker."""
    capacity, source = allocator_capacity(dump.record, trace)
    if capacity is None or request is None:
        why = "no capacity" if capacity is None else "no failed request size (not in the message nor the snapshot)"
        return Verdict(kind="unknown", capacity_bytes=capacity, capacity_source=source, needed_bytes=None,
                       notes=(f"cannot tell fragmentation from shortage: {why}",))
    needed = live.allocated_bytes + request
    if needed > capacity:
        base = Verdict(kind="shortage", capacity_bytes=capacity, capacity_source=source, needed_bytes=needed,
                       shortfall_bytes=needed - capacity)
    else:
        base = Verdict(kind="fragmentation", capacity_bytes=capacity, capacity_source=source, needed_bytes=needed)
    if dump.record["source"] == "cpu-tracker":
        return dataclasses.replace(base, notes=(("fragmentation did not apply: the CPU tracker counts live bytes "
                                                 "and caches nothing"),))
    return _with_replay(base, trace, request, dump.record.get("alloc_conf"))


def loaded_trace(dump: Dump):
    from llamem.allocator.window import trace_from_data

    return trace_from_data(dump.snapshot, str(dump.directory / "snapshot"))


def _with_replay(base: Verdict, trace, request: int, alloc_conf: str | None) -> Verdict:
    """Replay the snapshot, the failed request last, at the capacity; and each other setting."""
    from llamem.allocator import parse_alloc_conf
    from llamem.allocator.advice import advise, summarize
    from llamem.allocator.replay import replay_trace
    from llamem.allocator.trace_input import AllocEvent

    notes = []
    try:
        config = parse_alloc_conf(alloc_conf)
        from llamem.allocator.simulator import check_simulated

        check_simulated(config)
    except LlamemError as err:
        return dataclasses.replace(base, notes=((f"not replayed: the run's allocator settings {alloc_conf!r} "
                                                 f"cannot be simulated ({err})"),))
    if trace.failed_alloc is None:  # memory history was not recorded up to the error: add the request
        trace = dataclasses.replace(trace, failed_alloc=AllocEvent("alloc", -1, request, 0))
        notes.append("the snapshot's trace does not end with the error; the request is replayed after its last entry")
    result = replay_trace(trace, config, capacity_bytes=base.capacity_bytes)
    replay = {"completes": result.completes, "peak_reserved_bytes": result.peak_reserved_bytes,
              "message": result.oom_message, "allocator_settings": alloc_conf or "(default)",
              "events": len(trace.events)}
    if alloc_conf:  # advice compares settings from the default; the run's own is not the baseline
        note = "advice is given for runs with the default allocator settings; this run set some"
        return dataclasses.replace(base, replay=replay, notes=(*notes, note))
    found = advise(trace.replay_events(with_failed_alloc=True), result.peak_reserved_bytes,
                   capacity_bytes=base.capacity_bytes, baseline_completes=result.completes, start=result.start)
    return dataclasses.replace(base, replay=replay, advice=tuple(dataclasses.asdict(a) for a in found),
                               advice_summary=summarize(found, capacity_bytes=base.capacity_bytes,
                                                        baseline_completes=result.completes),
                               notes=tuple(notes))


def failed_request(dump: Dump, trace=None) -> tuple[int | None, str]:
    """The refused allocation: the snapshot's oom entry (exact), oom.json's figure, or the message's."""
    from llamem.runtime.oom import requested_from_message

    if trace is not None and trace.failed_alloc is not None:
        return trace.failed_alloc.size, "the snapshot's oom entry"
    if dump.record["requested_bytes"] is not None:
        exact = dump.record["source"] == "cpu-tracker"
        return dump.record["requested_bytes"], "the tracker" if exact else "the error message (2 decimals)"
    parsed = requested_from_message(dump.record["message"])
    return (None, "not found") if parsed is None else (min(parsed, MAX_SIZE_BYTES), "the error message (2 decimals)")


# The plan --------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class PlanAdvice:
    plan: object | None
    """A `llamem.plan.Plan`, or None (then `problem` says why)."""
    budget_bytes: int | None = None
    budget_note: str = ""
    command: str = ""
    """The `llamem plan` command that prints the same plan."""
    problem: str | None = None


def dump_workload(record: dict, where: str):
    """The Workload of oom.json, rebuilt and validated."""
    from llamem.workload import Workload

    fields = dict(record["workload"])
    known = {f.name for f in dataclasses.fields(Workload) if f.init}
    strange = sorted(set(fields) - known)
    if strange:
        raise DumpError(f"{where}: 'workload' has fields llamem does not know: {', '.join(strange)}")
    targets = fields.get("lora_targets")
    if targets is not None:
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
            raise DumpError(f"{where}: 'workload'.lora_targets must be a list of strings, got {shown(targets)}")
        fields["lora_targets"] = tuple(targets)
    for key in ("task", "precision", "quant", "optimizer", "attn", "kv_dtype", "loss", "teacher_quant", "teacher"):
        if key in fields:
            checked_str(fields[key], f"{where}: 'workload'.{key}", optional=key == "teacher")
    return Workload(**fields)


def _spec(dump: Dump):
    """The model from the dump's config.json; without one, from its name when llamem knows it
    (None when it does not: the plan is then left out, the rest of the explanation stands)."""
    from llamem.model import load_model

    if dump.config_path is not None:
        return load_model(config_path=dump.config_path)
    if not dump.record["model"]:
        return None
    try:
        return load_model(dump.record["model"])
    except LlamemError:
        return None


def _model_args(dump: Dump, spec) -> tuple[str, ...]:
    """The model as `llamem plan` should name it: its hub id when llamem knows it with these very
    sizes, else the dump's config.json."""
    from llamem.model import load_model

    hub_id = dump.record["model"]
    if dump.config_path is None:
        return (hub_id,)  # the spec was loaded by this name
    if hub_id and "/" in hub_id:
        try:
            known = load_model(hub_id)
        except LlamemError:
            known = None
        if known is not None and dataclasses.replace(known, name=spec.name, hf_id=spec.hf_id,
                                                     source=spec.source) == spec:
            return (hub_id,)
    return ("--config", str(dump.config_path))


def plan_budget(record: dict) -> tuple[int, str]:
    """The card the plan sizes for. On CUDA the card's capacity (what CUDA reports as its total, the
    same as `--gpu`). The tracker's capacity is what the allocator may hold, so the card is that plus
    the CUDA context llamem counts on every card (`llamem.overhead`)."""
    from llamem.overhead import non_torch_bytes
    from llamem.units import format_bytes

    capacity = record["capacity_bytes"]
    if record["source"] == "cuda":
        return capacity, "the card's capacity"
    context = non_torch_bytes(1)
    return capacity + context, (f"the tracker's capacity {format_bytes(capacity)} + the {format_bytes(context)} "
                                "CUDA context llamem counts on every card")


def size_arg(num_bytes: int) -> str:
    """A --budget value that parses back to exactly `num_bytes` (`parse_size` reads decimals
    exactly): 80GiB, 414.5MiB, else a count of bytes."""
    from decimal import Decimal

    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        value = Decimal(num_bytes) / Decimal(scale)  # exact: the scale is a power of two
        if num_bytes >= scale and -value.normalize().as_tuple().exponent <= 3:
            return f"{value.normalize():f}{unit}"
    return f"{num_bytes}B"


def plan_for(dump: Dump, host_budget_bytes: int) -> PlanAdvice:
    """`llamem plan`'s answer for the dump's workload on its card, and the command that prints it."""
    from llamem.gpus import budget_gpu
    from llamem.plan import make_plan
    from llamem.techniques import workload_args

    record = dump.record
    if record["workload"] is None:
        return PlanAdvice(plan=None, problem=record["problem"] or "the dump holds no workload")
    if record["capacity_bytes"] is None:
        return PlanAdvice(plan=None, problem="oom.json has no capacity_bytes: no card to plan for")
    workload = dump_workload(record, str(dump.directory / "oom.json"))
    spec = _spec(dump)
    if spec is None:
        return PlanAdvice(plan=None, problem=dump.missing_config())
    budget, note = plan_budget(record)
    names = _model_args(dump, spec)
    command = shlex.join(["llamem", "plan", *names, "--budget", size_arg(budget), *workload_args(workload)])
    try:
        plan = make_plan(spec, workload, budget_gpu(budget), host_budget_bytes=host_budget_bytes,
                         model_args=tuple(shlex.quote(n) for n in names))
    except LlamemError as err:  # no configuration at all (DoesNotFit without a closest one)
        return PlanAdvice(plan=None, budget_bytes=budget, budget_note=note, command=command, problem=str(err))
    return PlanAdvice(plan=plan, budget_bytes=budget, budget_note=note, command=command)


# The explanation ----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class OomExplanation:
    directory: str
    record: dict
    """oom.json as checked: message, step, phase, source, device_name, capacity, stats, workload, ..."""
    requested_bytes: int | None
    requested_from: str
    live: LiveMemory
    verdict: Verdict
    workload_labels: tuple[str, ...]
    estimate_command: str
    """oom.json's `llamem estimate` command, its --config the dump's config.json; "" when none."""
    estimate_problem: str | None = None
    """Why there is no estimate command (its config file is gone)."""
    plan: PlanAdvice
    notes: tuple[str, ...] = ()


def explain_oom(directory, *, host_budget_bytes: int) -> OomExplanation:
    dump = load_dump(directory)
    record = dump.record
    where = str(dump.directory / "snapshot")
    if record["source"] == "cpu-tracker":
        live = tracker_live(dump.snapshot, where)
    else:
        live = cuda_live(dump.snapshot, record["stats"], where)
    trace = loaded_trace(dump) if record["source"] == "cuda" else None
    request, request_from = failed_request(dump, trace)
    notes = []
    allocated = record["stats"].get("allocated_bytes")
    if allocated is not None and allocated != live.allocated_bytes:
        notes.append(f"the snapshot's live blocks total {live.allocated_bytes:,} B, the allocator's statistics "
                     f"{allocated:,} B (read at a different moment)")
    plan = plan_for(dump, host_budget_bytes)
    labels = ()
    if record["workload"] is not None:
        from llamem.techniques import workload_labels

        labels = tuple(workload_labels(dump_workload(record, str(dump.directory / "oom.json"))))
    command, command_problem = estimate_command(dump)
    return OomExplanation(directory=str(dump.directory), record=record, requested_bytes=request,
                          requested_from=request_from, live=live, verdict=verdict(dump, live, request, trace),
                          workload_labels=labels, estimate_command=command, estimate_problem=command_problem,
                          plan=plan, notes=tuple(notes))


def estimate_command(dump: Dump) -> tuple[str, str | None]:
    """oom.json's `llamem estimate` command with `--config` naming the config this dump is read
    with: a moved or copied dump's own, not the path it was written at. ("", why) when the command
    needs a config file and none is left."""
    command = dump.record["command"]
    try:
        words = shlex.split(command)
    except ValueError:  # an unbalanced quote: not a command llamem wrote
        return command, None
    if "--config" not in words[:-1]:
        return command, None
    if dump.config_path is None:
        return "", dump.missing_config()
    at = words.index("--config") + 1
    words[at] = str(dump.config_path)
    return shlex.join(words), None


def explanation_to_dict(e: OomExplanation) -> dict:
    from llamem.reporters.plan_report import plan_to_dict

    record = e.record
    return {
        "directory": e.directory,
        "error": {key: record[key] for key in ("message", "step", "phase", "source", "device_name", "capacity_bytes")},
        "requested_bytes": e.requested_bytes, "requested_from": e.requested_from,
        "live": {"categories": {c.name: {"bytes": c.size_bytes, "parts": c.parts} for c in e.live.categories},
                 "allocated_bytes": e.live.allocated_bytes, "reserved_bytes": e.live.reserved_bytes,
                 "cached_free_bytes": e.live.cached_free_bytes, "classified_by": e.live.how},
        "verdict": dataclasses.asdict(e.verdict),
        "workload": record["workload"], "unknown": record["unknown"], "estimate_command": e.estimate_command,
        "estimate_problem": e.estimate_problem,
        "plan": None if e.plan.plan is None else plan_to_dict(e.plan.plan),
        "plan_problem": e.plan.problem, "plan_budget_bytes": e.plan.budget_bytes,
        "plan_budget_note": e.plan.budget_note, "plan_command": e.plan.command,
        "notes": list(e.notes),
    }


__all__ = ["Dump", "DumpError", "LiveCategory", "LiveMemory", "OomExplanation", "PlanAdvice", "Verdict", "explain_oom",
           "explanation_to_dict", "load_dump", "stack_category"]
