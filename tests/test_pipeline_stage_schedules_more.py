"""Pipeline stage schedules (`llamem.analytic.schedule_pipeline`) past one GPU per stage and past stored activations,
each against the launch bundle's CPU run of it:

- tensor parallel inside the stages: the tp x pp bundle's 4-rank run (tests/test_bundle_2d.py's, the same plan and
  files, so one session runs it once) against each rank's stage schedule (`llamem.analytic.schedule_pipeline_tp`:
  the rank's shards with tensor parallel's all-reduced copies, DTensor's whole-vocabulary embedding gradient, the
  last stage's loss under `loss_parallel`);
- activation checkpointing (`--ac full`) and pure bf16 in the 2-stage bundle, a run each.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bundle_runner import start_run, tiny_config_path  # noqa: E402
from test_bundle_2d import config_path, grid_plan  # noqa: E402

from llamem.allocator.replay import load_events, smallest_card  # noqa: E402
from llamem.analytic.schedule_ranks import rank_schedule, rank_schedule_kind, schedule_layout  # noqa: E402
from llamem.bundle import layout_plan  # noqa: E402
from llamem.cli import main  # noqa: E402
from llamem.gpus import get_gpu  # noqa: E402
from llamem.model import load_model  # noqa: E402
from llamem.parallel import make_layout, pipeline_stage_phases, shard_spec  # noqa: E402
from llamem.workload import build_workload  # noqa: E402

__all__ = ["config_path", "grid_plan"]  # the fixtures

MiB = 2**20
SENDS_HELD_LATE_BYTES = 4 * 2 * 16 * 64
"""Gloo may hold a pipeline send a little late on a loaded machine: one micro-batch's fp32 hidden states."""


def _two_stage_plan(tmp_path_factory, precision: str, ac_every: int):
    """The tiny Llama's 2 layers on 2 stages, 2 micro-batches (1F1B), 256 tokens a row: the activations, not the
    optimizer's state, make each stage's peak."""
    config_path = tiny_config_path(tmp_path_factory)
    spec = load_model(None, config_path=str(config_path))
    w = build_workload("train", batch=2, seq=256, grad_accum=2, precision=precision, optimizer="adamw",
                       ac_every=ac_every)
    layout = make_layout(spec, w, gpus=2, pp=2)
    return layout_plan(spec, w, layout, get_gpu("h100"), model_args=("--config", str(config_path)))


@pytest.fixture(scope="module")
def checkpointed_plan(tmp_path_factory):
    """Every layer checkpointed, under bf16 autocast."""
    return _two_stage_plan(tmp_path_factory, "bf16-mixed", 1)


@pytest.fixture(scope="module")
def pure_plan(tmp_path_factory):
    """Pure bf16 (no autocast), without checkpointing."""
    return _two_stage_plan(tmp_path_factory, "bf16", 0)


@pytest.fixture(scope="module")
def started(grid_plan, checkpointed_plan, pure_plan, tmp_path_factory):
    """The runs, started side by side."""
    return {"grid": start_run(tmp_path_factory, grid_plan, timeout_s=300),
            "checkpointed": start_run(tmp_path_factory, checkpointed_plan, timeout_s=300),
            "pure": start_run(tmp_path_factory, pure_plan, timeout_s=300)}


@pytest.fixture(scope="module")
def traces(started):
    """Each run's folder of event streams (rank0.json, ...), by name."""
    folders = {}
    for name, pending in started.items():
        run = pending.result()
        assert "rank 1 trace " in run.stdout, run.stdout
        folders[name] = run.traces
    return folders


def _two_stage_figures(plan, traces) -> tuple[list, list]:
    """Each stage's schedule and recorded events on the smallest card: (peak allocated, reserved)."""
    spec, w, layout = plan.model, plan.final.workload, plan.final.layout
    assert rank_schedule_kind(spec, w, layout) == "pipeline"
    local, named = shard_spec(spec, layout), schedule_layout(spec, w, layout)
    schedules = [smallest_card(rank_schedule(local, w, named, stage=stage)) for stage in (0, 1)]
    return schedules, [smallest_card(load_events(traces / f"rank{stage}.json")) for stage in (0, 1)]


def _stage_schedules(grid_plan) -> list[tuple[int, int]]:
    """Each stage's own schedule on the smallest card: (peak allocated, reserved)."""
    spec, w, layout = grid_plan.model, grid_plan.final.workload, grid_plan.final.layout
    local, named = shard_spec(spec, layout), schedule_layout(spec, w, layout)
    return [smallest_card(rank_schedule(local, w, named, stage=stage)) for stage in (0, 1)]


def test_a_tensor_parallel_pipeline_has_its_own_stage_schedules(grid_plan):
    spec, w, layout = grid_plan.model, grid_plan.final.workload, grid_plan.final.layout
    assert rank_schedule_kind(spec, w, layout) == "pipeline"
    named = schedule_layout(spec, w, layout)
    assert (named.tp, named.pp, named.microbatches) == (2, 2, 2)  # the split names the schedule


def test_each_rank_replays_its_stages_schedule(grid_plan, traces):
    """Every rank's recorded events and its stage's schedule reserve one 2 MiB segment and peak at the same bytes:
    stage 0 at DTensor's whole-vocabulary embedding gradient in the second step's last backward (131,072 bytes
    where its shard is 65,536), stage 1 in the last micro-batch's loss backward under `loss_parallel`. A rank may
    peak one held send above (gloo under load: `SENDS_HELD_LATE_BYTES`, seen once on rank 1)."""
    schedules = _stage_schedules(grid_plan)
    assert schedules == [(1_209_344, 2 * MiB), (1_346_048, 2 * MiB)]
    for rank in range(4):
        traced_allocated, traced_reserved = smallest_card(load_events(traces["grid"] / f"rank{rank}.json"))
        allocated, reserved = schedules[rank // 2]
        assert traced_reserved == reserved, rank
        assert 0 <= traced_allocated - allocated <= SENDS_HELD_LATE_BYTES, (rank, traced_allocated, allocated)


def test_the_stage_schedules_hold_the_estimates_figures(grid_plan):
    """The estimate's allocated figure per stage (`pipeline_stage_phases`, tests/test_bundle_2d.py): the last stage's
    1,024 bytes (0.08 %) under its schedule's peak, the first stage's 8,704 bytes (0.7 %) under it (the whole-
    vocabulary embedding gradient beside what the second micro-batch's backward holds)."""
    spec, w, layout = grid_plan.model, grid_plan.final.workload, grid_plan.final.layout
    estimates = [max(sum(b.values()) for b in pipeline_stage_phases(spec, w, layout, stage).values())
                 for stage in (0, 1)]
    assert [own - estimate for (own, _reserved), estimate in zip(_stage_schedules(grid_plan), estimates)] == [
        8_704, 1_024]


def test_the_estimate_says_the_device_figure_comes_from_the_stages_schedules(config_path, capsys):
    capsys.readouterr()
    assert main(["estimate", "--config", str(config_path), "--batch", "2", "--seq", "16", "--grad-accum", "2",
                 "--precision", "bf16-mixed", "--optimizer", "adamw", "--gpus", "4", "--tp", "2", "--pp", "2",
                 "--json"]) == 0
    notes = " ".join(json.loads(capsys.readouterr().out)["notes"])
    assert "each pipeline stage's own allocation schedule" in notes
    assert "replayed as one device" not in notes


def test_checkpointed_stages_replay_their_own_schedules(checkpointed_plan, traces):
    """`--ac full` on 2 stages: nothing saved in forward but each checkpoint's input (and the positions, cos and
    sin), autocast's weight casts until the stage's forward returns, each layer recomputed in its backward. Each
    stage's recorded events and its schedule reserve the same and peak at the same bytes: the first stage in the
    second micro-batch's backward, the last in its last loss backward."""
    schedules, traced = _two_stage_figures(checkpointed_plan, traces["checkpointed"])
    assert schedules == traced == [(3_515_904, 4 * MiB), (6_163_456, 8 * MiB)]


def test_pure_bf16_stages_replay_their_own_schedules(pure_plan, traces):
    """Pure bf16 on 2 stages: the hidden states, the sends, cos and sin (cast as RoPE returns) in bf16, no layer
    saving the stream it reads (the first stage's embedding output dropped as its forward returns), the head's
    matmul keeping the final norm's output, the loss on the logits' fp32 upcast. Each stage's recorded events and
    its schedule reserve the same and peak at the same bytes."""
    schedules, traced = _two_stage_figures(pure_plan, traces["pure"])
    assert schedules == traced == [(3_524_096, 4 * MiB), (6_517_760, 8 * MiB)]


def test_stage_schedules_cover_what_a_run_holds(checkpointed_plan):
    """Every layer checkpointed in full under autocast, and pure bf16 without checkpointing, on one GPU per stage:
    what the 2-stage runs show. Every K-th layer counts the model's layers (not a stage's), selective
    checkpointing is not run by the bundle, and checkpointed, pure bf16 or pure fp32 tensor-parallel stages and
    pure precision under checkpointing have no run here: those replay the first stage's share as one GPU."""
    from llamem.workload import with_changes

    spec, w, layout = checkpointed_plan.model, checkpointed_plan.final.workload, checkpointed_plan.final.layout
    grid = make_layout(spec, w, gpus=4, tp=2, pp=2)
    cases = {"full": w, "every-2": with_changes(w, ac_every=2), "selective": with_changes(w, ac_mode="selective"),
             "bf16": with_changes(w, precision="bf16", ac_every=0), "bf16 full": with_changes(w, precision="bf16"),
             "fp32": with_changes(w, precision="fp32", ac_every=0)}
    kinds = {name: rank_schedule_kind(spec, changed, layout) for name, changed in cases.items()}
    assert kinds == {"full": "pipeline", "every-2": None, "selective": None, "bf16": "pipeline", "bf16 full": None,
                     "fp32": None}
    on_grid = {name: rank_schedule_kind(spec, changed, grid) for name, changed in cases.items()}
    assert on_grid == dict.fromkeys(cases, None)
    assert rank_schedule_kind(spec, with_changes(w, ac_every=0), grid) == "pipeline"
