"""Pipeline stages past one micro-batch per stage: the 2-stage launch bundle with 4 micro-batches (1F1B: each stage
runs a steady state of a backward and a forward in turn) against each stage's own allocation schedule
(`llamem.analytic.schedule_pipeline`) and the estimate's allocated figure for that stage (`pipeline_stage_phases`),
to the tolerance of the 2-micro-batch run's tests (tests/test_bundle_pipeline.py): the same reserved memory, the
allocated peak within 2 %."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bundle_runner import _plan, config_path, start_run  # noqa: E402

from llamem.allocator.replay import load_events, smallest_card  # noqa: E402
from llamem.analytic.schedule_pipeline import StagePlace, action_order, send_releases  # noqa: E402
from llamem.analytic.schedule_ranks import rank_schedule, rank_schedule_kind  # noqa: E402
from llamem.parallel import pipeline_stage_phases, shard_spec  # noqa: E402

__all__ = ["config_path"]  # the fixture

MiB = 2**20


@pytest.fixture(scope="module")
def four_microbatches(config_path, tmp_path_factory):
    """The 2-stage plan with 4 micro-batches (grad_accum 4), its ranks' run peaks and the folder of their event
    streams (rank0.json, rank1.json)."""
    plan = _plan(config_path, pp=2, grad_accum=4)
    run = start_run(tmp_path_factory, plan).result()
    assert len(re.findall(r"^rank \d trace ", run.stdout, re.MULTILINE)) == 2, run.stdout
    return plan, {rank: figures["peak"] for rank, figures in run.ranks().items()}, run.traces


def _order(place: StagePlace) -> str:
    return " ".join(f"{action}{index}" for action, index in action_order(place))


def test_sent_tensors_live_while_the_schedule_names_them():
    """Schedule1F1B (torch 2.13): a stage's output lives until its backward, the warm-up's last fired send (output
    p - s - 2) until the steady state's last backward, the last output until the step's end; a sent gradient until
    the next backward (`bwd_sends` replaced) or the step's end. GPipe keeps every send's work until the end."""
    first, last = (StagePlace(stage=stage, stages=2, microbatches=4, schedule="1f1b") for stage in (0, 1))
    assert (_order(first), _order(last)) == ("F0 F1 B0 F2 B1 F3 B2 B3", "F0 B0 F1 B1 F2 B2 F3 B3")
    assert send_releases(first) == {("B", 1): [("output", 1)], ("B", 2): [("output", 0), ("output", 2)],
                                    ("B", 3): [("output", 3)]}
    assert send_releases(last) == {("B", 1): [("grad", 0)], ("B", 2): [("grad", 1)],
                                   ("B", 3): [("grad", 2), ("grad", 3)]}
    gpipe = StagePlace(stage=0, stages=2, microbatches=4, schedule="gpipe")
    assert send_releases(gpipe) == {("B", 3): [("output", index) for index in range(4)]}


def test_each_stage_replays_its_own_schedule(four_microbatches):
    """Each stage's schedule reserves what its recorded events reserve (one 2 MiB segment each) and peaks at the
    run's bytes: the last stage in the second step's last loss backward (the third micro-batch's sent gradient
    still alive). The first stage's was 20,480 bytes higher (1,587,712) while the autocast layer schedule cast
    down_proj's weight gradient to fp32 before the matmul's saved tensors went; it follows autograd's order now."""
    plan, peaks, traces = four_microbatches
    spec, w, layout = plan.model, plan.final.workload, plan.final.layout
    assert (layout.microbatches, layout.pipeline_schedule) == (4, "1f1b")
    assert rank_schedule_kind(spec, w, layout) == "pipeline"  # 2 micro-batches per stage: replayed
    local = shard_spec(spec, layout)
    schedules = [smallest_card(rank_schedule(local, w, layout, stage=stage)) for stage in (0, 1)]
    assert schedules == [(1_567_232, 2 * MiB), (1_755_136, 2 * MiB)]
    traced = [smallest_card(load_events(traces / f"rank{stage}.json")) for stage in (0, 1)]
    assert traced == [(1_567_232, 2 * MiB), (1_755_136, 2 * MiB)]
    for stage, (allocated, reserved) in enumerate(schedules):
        traced_allocated, traced_reserved = traced[stage]
        assert traced_allocated == peaks[stage]
        assert traced_reserved == reserved
        assert abs(allocated - traced_allocated) <= 0.02 * traced_allocated, (stage, allocated, traced_allocated)


def test_each_stage_peaks_at_its_estimate(four_microbatches):
    """The estimate's allocated figure per stage (`llamem.parallel.pipeline_stage_phases`): the first stage's at
    the run's peak, the last stage's 2,048 bytes (0.1 %) under it."""
    plan, peaks, _traces = four_microbatches
    spec, w, layout = plan.model, plan.final.workload, plan.final.layout
    stages = [max(sum(b.values()) for b in pipeline_stage_phases(spec, w, layout, stage).values()) for stage in (0, 1)]
    assert stages == [1_567_232, 1_753_088]
    assert peaks == {0: 1_567_232, 1: 1_755_136}
    for stage, estimate in enumerate(stages):
        assert abs(peaks[stage] - estimate) <= 0.02 * estimate, (stage, peaks[stage], estimate)
