"""Entry point of `llamem trace`: checks the dependencies, runs, writes the event trace."""

from __future__ import annotations

import json

from llamem.errors import LlamemError, MissingDependency
from llamem.model import ModelSpec
from llamem.report import MemoryReport
from llamem.workload import Workload


def run_trace(spec: ModelSpec, workload: Workload, teacher: ModelSpec | None = None,
              save_trace: str | None = None) -> tuple[MemoryReport, list]:
    """The report, and the allocation events (for the allocator simulator)."""
    from llamem.trace.limits import check_traceable

    check_traceable(workload)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        if workload.uses_adapters:
            import peft  # noqa: F401
    except ImportError as err:
        raise MissingDependency(f"llamem trace needs {err.name}: pip install 'llamem[torch]'") from None
    from llamem.trace.run import trace

    report = trace(spec, workload, teacher)
    tracer = report.extra.pop("events")
    if save_trace:
        try:
            with open(save_trace, "w") as handle:
                json.dump({"format": "llamem-trace-v1", "model": spec.name, "events": tracer.trace_events()}, handle)
        except OSError as err:
            raise LlamemError(f"--save-trace {save_trace}: cannot be written ({err.strerror or err})") from None
    from llamem.allocator.replay import AllocEvent

    events = [AllocEvent(e.action, e.record_id, tracer.records[e.record_id].nbytes) for e in tracer.events]
    return report, events
