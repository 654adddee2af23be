"""The reports `llamem estimate` and `llamem trace` print: per GPU, with the device memory.

Library users get here what the command line prints: `estimate_report` for the analytic engine
on any layout, `trace_report` for the trace engine on one GPU. Both take the device figure from
`llamem.device`, so the same configuration gives the same `device_bytes` in `estimate`, `plan`
and (where the traced peak equals the analytic one) `trace`.
"""

from __future__ import annotations

import dataclasses

from llamem.analytic import estimate
from llamem.analytic.schedule_ranks import rank_schedule_kind
from llamem.device import device_memory, fragmented_stage
from llamem.engine_precision import precision_note, runs_as
from llamem.model import ModelSpec
from llamem.parallel import Layout, per_gpu_phases, shard_spec
from llamem.report import MemoryReport
from llamem.workload import Workload


def estimate_report(spec: ModelSpec, w: Workload, layout: Layout | None = None, teacher: ModelSpec | None = None,
                    *, details: bool = True) -> MemoryReport:
    """The analytic report for the busiest GPU of `layout` (one GPU by default), with its device memory.
    `details`: also the exact shape's own smallest card and the unlimited card's reserved memory."""
    layout = layout or Layout()
    report = estimate(spec, w, teacher)
    notes = list(report.notes)
    sized = runs_as(w, layout)  # the engine's own precision (llamem.engine_precision)
    if layout.num_gpus > 1 or layout.sharding != "none":
        report = dataclasses.replace(report, phases=per_gpu_phases(spec, sized, layout, teacher))
        notes.append(f"per GPU, the busiest GPU of {layout.describe()}")
        if layout.pp > 1 and sized.is_training and layout.engine != "fsdp2":
            notes.append(pipeline_stage_note(spec, sized, layout, teacher))
    if sized is not w:
        notes.append(precision_note(w, layout))
    local = shard_spec(spec, layout)
    single = layout.num_gpus == 1 and layout.sharding == "none"
    device = device_memory(local, sized, report.peak_allocated_bytes, num_gpus=layout.num_gpus,
                           exact_shape=details, unlimited=details and single, layout=layout)
    notes += device_notes(device, w, single, rank_kind=rank_schedule_kind(local, sized, layout),
                          stage=fragmented_stage(local, sized, layout))
    if details and single:
        notes += allocator_advice(local, w, device)
    return dataclasses.replace(report, device=device, notes=tuple(notes), layout=layout.describe())


def pipeline_stage_note(spec: ModelSpec, w: Workload, layout: Layout, teacher: ModelSpec | None) -> str:
    """Which pipeline stage the figures are (`parallel.pipeline_phases`: each stage sized as it is)."""
    from llamem.parallel import pipeline_phases

    stage = pipeline_phases(spec, w, layout, teacher)[0]
    return (f"pipeline: these are the figures of stage {stage} (of stages 0-{layout.pp - 1}), the busiest; stage 0 "
            f"holds the embedding, stage {layout.pp - 1} the head and the loss, each stage its micro-batches in flight")


def pipeline_schedule_note(stage: int | None) -> str:
    """Whose schedule a pipeline's fragmentation comes from (`llamem.device.stage_fragmentation`)."""
    return (f"the fragmentation comes from each pipeline stage's own allocation schedule (its micro-batches in "
            f"torch.distributed.pipelining's 1F1B or GPipe order, its receive buffers and kept outputs); the device "
            f"figure is stage {stage}'s reserved memory, the most of the stages; no allocator advice for parallel "
            "layouts")


ADVISE_ABOVE = 0.05
"""Look for a better allocator setting when fragmentation exceeds 5 % of the allocated peak."""


def allocator_advice(spec: ModelSpec, w: Workload, device) -> list[str]:
    """When this shape fragments the allocator noticeably: the settings under which its schedule
    still completes on a card with half that fragmentation, best first (`llamem.allocator.advice`)."""
    from llamem.allocator.advice import advise
    from llamem.device import probe_events
    from llamem.units import format_gib

    events, allocated = probe_events(spec, w)
    exact = device.exact_shape_device_bytes - device.non_torch_bytes - device.peak_allocated_bytes
    if exact <= ADVISE_ABOVE * device.peak_allocated_bytes:
        return []
    capacity = allocated + exact // 2
    found = [a for a in advise(events, allocated + exact, capacity_bytes=capacity) if a.completes]
    if not found:
        return [f"allocator: no PYTORCH_CUDA_ALLOC_CONF setting runs this schedule with half its fragmentation "
                f"({format_gib(exact // 2)})"]
    top = found[0]
    return [f"allocator: with PYTORCH_CUDA_ALLOC_CONF={top.setting} this shape's schedule runs on a card with half "
            f"its fragmentation (peak reserved {format_gib(top.peak_reserved_bytes - allocated)} above allocated, "
            f"instead of {format_gib(exact)})"]


def trace_report(spec: ModelSpec, w: Workload, teacher: ModelSpec | None = None,
                 save_trace: str | None = None) -> tuple[MemoryReport, list]:
    """The trace engine's report with the same device figure, and its allocation events. The traced
    events' own smallest card is `device.exact_shape_device_bytes`: the replay of the real order."""
    from llamem.allocator.replay import runs_on_card, smallest_card
    from llamem.trace.api import run_trace

    report, events = run_trace(spec, w, teacher, save_trace=save_trace)
    device = device_memory(spec, w, report.peak_allocated_bytes)
    allocated, reserved = smallest_card(events)
    device = dataclasses.replace(
        device, exact_shape_device_bytes=report.peak_allocated_bytes + max(reserved - allocated, 0)
        + device.non_torch_bytes,
        unlimited_card_reserved_bytes=report.peak_allocated_bytes + max(runs_on_card(events, None) - allocated, 0))
    notes = list(report.notes) + device_notes(device, w, True, traced=True)
    return dataclasses.replace(report, device=device, notes=tuple(notes)), events


def device_notes(device, w: Workload, single_gpu: bool, traced: bool = False,
                 rank_kind: str | None = None, stage: int | None = None) -> list[str]:
    """`rank_kind`: the engine whose rank schedule gave the fragmentation ("ddp", "fsdp2", "tp", "zero1",
    "zero2", "zero3"), None for the single-GPU schedule (`llamem.analytic.schedule_ranks.rank_schedule_kind`); for
    "pipeline", `stage` is the stage whose reserved memory the device figure is (`llamem.device.fragmented_stage`)."""
    from llamem.units import format_gib

    notes = [f"device memory = peak allocated + {format_gib(device.fragmentation_bytes)} allocator fragmentation "
             "(the largest the allocator simulator finds for this configuration at this shape or smaller, on the "
             "smallest card each runs on) + non-torch"]
    exact = device.exact_shape_device_bytes
    if exact is not None and exact > device.device_bytes:
        what = "the traced allocations of this exact shape replay" if traced else "this exact shape's schedule replays"
        notes.append(f"{what} only on {format_gib(exact)}: the block sizes of this shape fragment the allocator more than "
                     "smaller shapes; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True avoids most of it")
    if rank_kind == "pipeline":
        notes.append(pipeline_schedule_note(stage))
    elif rank_kind:
        what = {"ddp": "DDP's broadcast and gradient buckets", "fsdp2": "FSDP2's per-unit all-gathers, reshards and reduce-scatters",
                "tp": "tensor parallel's all-reduced outputs and input gradients, the whole-vocabulary embedding "
                      "gradient",
                **{zero: f"DeepSpeed ZeRO-{zero[-1]}'s flat 16-bit buffer, fp32 partition, reduce bucket and "
                          "gradient partition" for zero in ("zero1", "zero2")},
                "zero3": "DeepSpeed ZeRO-3's gathered parameters, prefetches and reduce bucket, flat 16-bit and fp32 "
                         "partitions"}[rank_kind]
        notes.append(f"the fragmentation comes from this rank's own allocation schedule ({what}; NCCL's buffers are "
                     "outside PyTorch's allocator, counted in non-torch); no allocator advice for parallel layouts")
    elif not single_gpu:
        notes.append("the fragmentation comes from this GPU's share of the model replayed as one device (the "
                     "single-GPU schedule: ranks have their own only under DDP, FSDP2's ZeRO-3 and tensor parallel, "
                     "DeepSpeed's ZeRO-1/2/3 in bf16, and pipeline stages of a dense Llama at up to two micro-batches "
                     "per stage, for full training, and under DDP for LoRA), with whole model states where ZeRO shards "
                     "them "
                     "and without ZeRO's buckets or a pipeline's micro-batches in flight: it errs on the large side "
                     "for ZeRO layouts; no allocator advice for parallel layouts")
    return notes
