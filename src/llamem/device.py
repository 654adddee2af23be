"""Device memory: the one figure that says whether a workload fits a card.

    device_bytes = peak_allocated_bytes + fragmentation_bytes + non_torch_bytes

- `peak_allocated_bytes` comes from the engine (analytic formulas, or the trace's real tensors).
- `fragmentation_bytes` is what PyTorch's caching allocator holds beyond the live tensors on the
  smallest card the workload runs on. It is found by replaying the configuration's allocation
  schedule (`llamem.analytic.schedule`) through the allocator simulator, which, like PyTorch,
  frees its cached blocks and retries before it raises an out-of-memory error; the smallest
  capacity that replays without one, minus the schedule's peak allocated bytes, is the
  fragmentation of that shape.
- `non_torch_bytes`: the CUDA context and, with several GPUs, NCCL (`llamem.overhead`).

On several GPUs the schedule is the rank's own where `llamem.analytic.schedule_ranks` builds one (DDP's
buckets, FSDP2's per-unit all-gathers, reshards and reduce-scatters, tensor parallel's all-reduced copies);
other layouts replay the single-GPU schedule of the GPU's share of the model (`rank_layout` tells which).
A pipeline's stages each have their own (`llamem.analytic.schedule_pipeline`): the first, the second and the
last are probed (`pipeline_stages.stage_positions`), and the allowance is the worst stage's reserved memory
beyond the busiest stage's allocated peak (`stage_fragmentation` names the stage).

Monotone by construction. The smallest card of one exact shape is not monotone in batch or
sequence length: how freed blocks line up with later requests changes from shape to shape (the
simulator finds 8B full fine-tuning at batch 3 needing 9 GiB more than at batch 4, and traces
of the real code agree in kind). A figure that falls when the batch grows is not one a user can
plan with, so the fragmentation term is the largest fragmentation of the same configuration over
a fixed lattice of probe shapes at or below the workload's own size. Growing the batch or the
sequence only adds probes, never removes one, so the maximum cannot fall; the analytic peak
never falls either (`tests/test_analytic_monotone.py`).

The lattice: almost every tensor of a step grows with batch x seq (activations, logits, the KV
cache, and with chunked prefill even the masks and repeated keys: batch x chunk x prompt), so the
probes are one row at batch 1 whose token counts double from 512: 512, 1024, 2048, ... up to
batch x seq. A workload of 2^k tokens at batch 1 is itself a probe; between two probes the figure
carries the smaller one's fragmentation, at most 2x smaller in size.
Shapes under 512 tokens take the 512-token probe. Eager attention keeps batch x heads x seq^2
probabilities, which a batch-1 probe of the same tokens would blow up, and a chunked prefill's
schedule grows with its number of chunks, so both are probed on a grid: batch {1, 2, 4, ...} up to
the batch x the same sequence steps up to the sequence. (Checkpointing's
boolean mask, batch x seq^2 bytes, is small beside the layer inputs it comes with.)

The exact shape's own smallest card is reported beside it (`exact_shape_device_bytes`) when
asked for, so a shape that fragments more than its neighbours is visible, not hidden.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from llamem.model import ModelSpec
from llamem.overhead import non_torch_bytes
from llamem.workload import Workload

if TYPE_CHECKING:  # llamem.parallel imports the engine, whose report imports this module
    from llamem.parallel import Layout

MIN_PROBE_SEQ = 512
"""The smallest probe: shorter shapes are probed at 512 tokens, which fragments at least as much
(larger tensors of the same kinds) and keeps the lattice short."""
PROBE_STEPS_PER_OCTAVE = 1
"""Probe token counts double from one to the next: each probe costs at least one replay of a
whole schedule (0.1 s for an 8B training step, more for larger models), and a finer lattice
doubled the time of a plan while moving figures by well under 1 % of the peak."""
PROBE_CACHE_SIZE = 4096
SEARCH_CACHE_SIZE = 512
"""Probe searches kept: a search not yet finished holds its schedule's events."""
EVENTS_CACHE_SIZE = 64
"""Probe schedules kept in memory: a plan touches a few dozen (a 70B schedule is ~50,000 events,
about 5 MB), and rebuilding one costs as much as replaying it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceMemory:
    """What a card must hold for a workload, per GPU."""

    peak_allocated_bytes: int
    fragmentation_bytes: int
    """Reserved beyond allocated on the smallest card: the monotone allowance described above."""
    non_torch_bytes: int
    exact_shape_device_bytes: int | None = None
    """The smallest card on which this exact shape's schedule replays, plus non-torch (if computed)."""
    unlimited_card_reserved_bytes: int | None = None
    """What `torch.cuda.max_memory_reserved()` would show on a card without limit (if computed)."""

    @property
    def peak_reserved_bytes(self) -> int:
        return self.peak_allocated_bytes + self.fragmentation_bytes

    @property
    def device_bytes(self) -> int:
        return self.peak_reserved_bytes + self.non_torch_bytes


def shape_sensitive(w: Workload) -> bool:
    """Whether batch and sequence are probed separately: eager attention's probabilities grow with
    seq^2 rather than batch x seq, and a chunked prefill's work with the number of chunks, which a
    batch-1 probe of the same tokens would multiply by the batch."""
    return w.attn == "eager" or w.prefill_chunk > 0


def lattice(top: int) -> list[int]:
    """Probe lengths from MIN_PROBE_SEQ up to `top` (at least the first), in steps of 2 ** (1 / steps per octave)."""
    out, k = [MIN_PROBE_SEQ], 1
    while round(MIN_PROBE_SEQ * 2 ** (k / PROBE_STEPS_PER_OCTAVE)) <= top:
        out.append(round(MIN_PROBE_SEQ * 2 ** (k / PROBE_STEPS_PER_OCTAVE)))
        k += 1
    return out


def probe_shapes(w: Workload) -> list[tuple[int, int]]:
    """The (batch, seq) probes at or below the workload's size, smallest first (by tokens)."""
    if shape_sensitive(w):
        batches = [1 << k for k in range(w.batch.bit_length())]
        shapes = [(b, s) for b in batches for s in lattice(w.seq)]
    else:
        shapes = [(1, s) for s in lattice(w.batch * w.seq)]
    return sorted(shapes, key=lambda shape: (shape[0] * shape[1], shape))


def rank_layout(spec: ModelSpec, w: Workload, layout: Layout | None) -> Layout | None:
    """The layout naming the schedule a rank of `layout` replays (`llamem.analytic.schedule_ranks.
    schedule_layout`: DDP, FSDP2's ZeRO-3, tensor parallel), or None: the single-GPU schedule (one GPU, or a
    layout without a rank schedule yet)."""
    from llamem.analytic.schedule_ranks import schedule_layout

    return schedule_layout(spec, w, layout) if layout is not None else None


def schedule_stages(spec: ModelSpec, w: Workload, layout: Layout | None) -> tuple[Layout | None, tuple]:
    """The layout naming a rank's schedule (`rank_layout`) and the pipeline stages whose schedules are probed
    ((None,) off a pipeline)."""
    from llamem.pipeline_stages import stage_positions

    named = rank_layout(spec, w, layout)
    return named, (tuple(stage_positions(named.pp)) if named is not None and named.pp > 1 else (None,))


def stage_fragmentation(spec: ModelSpec, w: Workload, layout: Layout | None = None) -> tuple[int, int | None]:
    """The monotone allowance and the pipeline stage it comes from (None off a pipeline)."""
    canonical = dataclasses.replace(w, batch=1, seq=MIN_PROBE_SEQ)
    named, stages = schedule_stages(spec, w, layout)
    return _envelope(spec, canonical, tuple(probe_shapes(w)), named, stages)


def fragmentation_bytes(spec: ModelSpec, w: Workload, layout: Layout | None = None) -> int:
    """The monotone fragmentation allowance of this configuration at this shape (see the module)."""
    return stage_fragmentation(spec, w, layout)[0]


def fragmented_stage(spec: ModelSpec, w: Workload, layout: Layout | None) -> int | None:
    """The pipeline stage whose reserved memory the device figure is (None off a pipeline)."""
    return stage_fragmentation(spec, w, layout)[1]


@lru_cache(maxsize=PROBE_CACHE_SIZE)
def _envelope(spec: ModelSpec, canonical: Workload, shapes: tuple[tuple[int, int], ...], layout: Layout | None,
              stages: tuple[int | None, ...]) -> tuple[int, int | None]:
    """The largest fragmentation over the probes and, on a pipeline, its stages: a stage's reserved memory
    beyond the busiest stage's allocated peak at the same probe (so the busiest stage's allocated figure plus
    it is the worst stage's reserved one), and that stage (`(None,)` off a pipeline: the one schedule). The
    largest probe is searched to the end first, then each smaller one only as far as needed to know whether
    it stays within the largest found so far. The searches are the same whoever drives them
    (`SmallestCardSearch`), so this is the exact maximum of the probes' own figures."""
    found, worst = None, stages[0]
    for batch, seq in reversed(shapes):
        probe = dataclasses.replace(canonical, batch=batch, seq=seq)
        searches = [(stage, _search(spec, probe, layout, stage)) for stage in stages]
        busiest = max(search.allocated for _stage, search in searches)
        for stage, search in searches:
            if found is None or not search.settle_within(busiest + found):
                search.finish()
                if found is None or search.high - busiest > found:
                    found, worst = search.high - busiest, stage
    return max(found, 0), worst


@lru_cache(maxsize=SEARCH_CACHE_SIZE)
def _search(spec: ModelSpec, w: Workload, layout: Layout | None = None, stage: int | None = None):
    """One probe's smallest-card search, kept (part-done or done) for every later question."""
    from llamem.allocator.replay import SmallestCardSearch

    return SmallestCardSearch(probe_events(spec, w, layout, stage)[0])


@lru_cache(maxsize=EVENTS_CACHE_SIZE)
def probe_events(spec: ModelSpec, w: Workload, layout: Layout | None = None,
                 stage: int | None = None) -> tuple[list, int]:
    """A probe's allocation schedule (a rank's own under `layout`, see `rank_layout`; a pipeline's stage
    `stage`) and its peak allocated bytes (kept for the probes in use)."""
    from llamem.allocator.replay import peak_allocated_bytes
    from llamem.analytic.schedule import schedule
    from llamem.analytic.schedule_ranks import rank_schedule

    events = rank_schedule(spec, w, layout, stage=stage) if layout is not None else schedule(spec, w)
    return events, peak_allocated_bytes(events)


def probe_fragmentation(spec: ModelSpec, w: Workload, layout: Layout | None = None) -> int:
    """Reserved minus allocated on the smallest card this exact shape's schedule replays on (a pipeline's
    worst stage's reserved minus its busiest stage's allocated)."""
    named, stages = schedule_stages(spec, w, layout)
    searches = [_search(spec, w, named, stage) for stage in stages]
    for search in searches:
        search.finish()
    return max(max(search.high for search in searches) - max(search.allocated for search in searches), 0)


def exact_shape_reserved_bytes(spec: ModelSpec, w: Workload, peak_allocated_bytes: int,
                               layout: Layout | None = None) -> int:
    """This exact shape's own fragmentation added to the engine's peak allocated bytes."""
    return peak_allocated_bytes + probe_fragmentation(spec, w, layout)


def unlimited_card_reserved_bytes(spec: ModelSpec, w: Workload, peak_allocated_bytes: int) -> int:
    return peak_allocated_bytes + _unlimited_fragmentation(spec, w)


@lru_cache(maxsize=PROBE_CACHE_SIZE)
def _unlimited_fragmentation(spec: ModelSpec, w: Workload) -> int:
    """Reserved beyond allocated on a card without limit: one whole replay (0.1 s for an 8B step),
    kept because a page or a plan asks again for the same workload."""
    from llamem.allocator.replay import runs_on_card

    events, allocated = probe_events(spec, w)
    return max(runs_on_card(events, None) - allocated, 0)


def device_memory(spec: ModelSpec, w: Workload, peak_allocated_bytes: int, *, num_gpus: int = 1,
                  exact_shape: bool = False, unlimited: bool = False, layout: Layout | None = None) -> DeviceMemory:
    """`spec` is the part of the model one GPU holds (`llamem.parallel.shard_spec`); the allowance
    comes from the schedule of one rank of `layout` where `rank_layout` builds one, else from that
    GPU's single-device schedule, which keeps whole model states where ZeRO would shard them and
    has none of the engine's buffers, so it errs on the large side for sharded layouts."""
    overhead = non_torch_bytes(num_gpus)
    exact = exact_shape_reserved_bytes(spec, w, peak_allocated_bytes, layout) + overhead if exact_shape else None
    return DeviceMemory(peak_allocated_bytes=peak_allocated_bytes,
                        fragmentation_bytes=fragmentation_bytes(spec, w, layout),
                        non_torch_bytes=overhead, exact_shape_device_bytes=exact,
                        unlimited_card_reserved_bytes=(unlimited_card_reserved_bytes(spec, w, peak_allocated_bytes)
                                                       if unlimited else None))
