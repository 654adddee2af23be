"""Distillation's teacher placement (`llamem.teacher_placement`): sized by `llamem estimate
--teacher-placement`, chosen by the planner where nothing fits without it, and run by the launch bundle.

The bundles run on 2 CPU ranks (gloo) with test_bundle_runs.py's tiny Llama as the student and a wider
tiny teacher of the same vocabulary (hidden 128, MLP 256, 2 layers: 361,472 parameters). Each rank's peak
(llamem's CPU tracker) is held to `llamem estimate --gpus 2` of the same workload and placement:
- DDP with the teacher replicated peaks in the optimizer step, as the single-GPU engine plus DDP's buckets;
- FSDP2 (`--engine fsdp2`) with the teacher sharded by its own `fully_shard` peaks in the teacher's
  forward, at a teacher layer's copy-out: its all-gather output and unsharded parameters beside the
  previous layer's output (measured 2,191,872 against 2,188,288; a tied teacher, whose root stays
  gathered through the forward, 2,257,920 against 2,254,336).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bundle_runner import TINY, Launch  # noqa: E402

from llamem.bundle import emit_bundle, layout_plan  # noqa: E402
from llamem.cli import main  # noqa: E402
from llamem.errors import InvalidWorkload  # noqa: E402
from llamem.gpus import get_gpu  # noqa: E402
from llamem.model import load_model  # noqa: E402
from llamem.parallel import make_layout, per_gpu_phases  # noqa: E402
from llamem.plan import make_plan  # noqa: E402
from llamem.reporters.plan_report import render_plan  # noqa: E402
from llamem.workload import build_workload  # noqa: E402

TEACHER = {**TINY, "hidden_size": 128, "intermediate_size": 256}
DEEP_TEACHER = {**TINY, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 16}
"""A teacher of 16 layers, 19.4 MB in bf16, that the planner's budget below cannot hold whole."""
FIELDS = {"batch": 2, "seq": 16, "precision": "bf16-mixed", "optimizer": "adamw"}
ARGS = ["--task", "distill", "--batch", "2", "--seq", "16", "--precision", "bf16-mixed", "--optimizer", "adamw"]
PEAK = re.compile(r"^rank (\d+) peak_bytes=(\d+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict:
    folder = tmp_path_factory.mktemp("distill")
    out = {}
    for name, config in (("student", TINY), ("teacher", TEACHER), ("deep_teacher", DEEP_TEACHER)):
        out[name] = folder / f"{name}.json"
        out[name].write_text(json.dumps(config))
    out["folder"] = folder
    return out


def _workload(paths, placement: str, teacher: str = "teacher"):
    return build_workload("distill", **FIELDS, teacher=str(paths[teacher]), teacher_placement=placement)


def _estimate(paths, capsys, *layout: str) -> dict:
    capsys.readouterr()
    assert main(["estimate", "--config", str(paths["student"]), *ARGS, "--teacher", str(paths["teacher"]),
                 "--gpus", "2", *layout, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _start(paths, placement: str, sharding: str, engine: str, steps: int) -> tuple[Launch, Path]:
    """Emit the 2-GPU distillation bundle and start its run on CPU; the run and the bundle's folder."""
    spec = load_model(None, config_path=str(paths["student"]))
    w = _workload(paths, placement)
    plan = layout_plan(spec, w, make_layout(spec, w, gpus=2, sharding=sharding, engine=engine), get_gpu("h100"),
                       model_args=("--config", str(paths["student"])))
    folder = paths["folder"] / f"{sharding}-{placement}"
    bundle = emit_bundle(plan, folder)
    assert bundle.unsupported is None and "teacher_config.json" in bundle.files
    return Launch(folder, ["--cpu", "--random-init", "--max-steps", str(steps)]), folder


def _result(started: tuple[Launch, Path]) -> tuple[list[int], str]:
    """Each rank's run peak and README.md, once the run has ended."""
    launch, folder = started
    stdout = launch.stdout()
    peaks = {int(rank): int(peak) for rank, peak in PEAK.findall(stdout)}
    assert sorted(peaks) == [0, 1], stdout
    return [peaks[0], peaks[1]], (folder / "README.md").read_text()


def _run(paths, placement: str, sharding: str, engine: str, steps: int) -> tuple[list[int], str]:
    """Emit the 2-GPU distillation bundle and run it on CPU; each rank's run peak and README.md."""
    return _result(_start(paths, placement, sharding, engine, steps))


@pytest.fixture(scope="module")
def started(paths) -> dict[str, tuple[Launch, Path]]:
    """The DDP run with the teacher replicated (1 step) and the FSDP2 run with it sharded (2 steps: from the second
    on, AdamW's state), started together: they run side by side."""
    return {"replicated": _start(paths, "replicated", "ddp", "deepspeed", steps=1),
            "sharded": _start(paths, "sharded", "zero3", "fsdp2", steps=2)}


def test_ddp_bundle_with_a_replicated_teacher_peaks_at_the_estimate(paths, started, capsys):
    estimate = _estimate(paths, capsys, "--sharding", "ddp", "--teacher-placement", "replicated")
    assert estimate["breakdown"]["weights/teacher"] == 855552  # bf16, each tensor rounded, RoPE's two buffers
    assert estimate["peak_allocated_bytes"] == 4225024
    peaks, readme = _result(started["replicated"])
    for peak in peaks:
        assert abs(peak - estimate["peak_allocated_bytes"]) <= 0.02 * estimate["peak_allocated_bytes"]  # 4,224,512
    assert "## Distillation" in readme and "replicated: whole on every data-parallel GPU" in readme
    assert "(1 - alpha) * CE + alpha * T**2 * KL(teacher || student)" in readme
    assert "4,225,024 bytes" in readme and "--cpu --random-init` builds it" in readme


def test_fsdp2_bundle_with_a_sharded_teacher_peaks_at_the_estimate(paths, started, capsys):
    estimate = _estimate(paths, capsys, "--sharding", "zero3", "--engine", "fsdp2", "--teacher-placement", "sharded")
    forward = estimate["phase_breakdowns"]["forward"]
    assert (estimate["peak_phase"], forward["weights/teacher"], forward["weights/teacher_gathered"]) == (
        "forward", 429568, 886784)  # the teacher's bf16 shards; a layer gathered twice, the last output once
    peaks, readme = _result(started["sharded"])
    for peak in peaks:
        assert abs(peak - estimate["peak_allocated_bytes"]) <= 0.02 * estimate["peak_allocated_bytes"]  # 2,191,872
    assert "sharded over 2 GPUs with FSDP2 fully_shard on its own" in readme


def test_auto_placement_keeps_the_figures_of_the_layout():
    """Left out, the placement is what the layout implies: the figures llamem gave before it was a choice."""
    spec = load_model("llama-3.1-8b")
    w = build_workload("distill", batch=1, seq=2048, precision="bf16-mixed", optimizer="adamw",
                       teacher="llama-3.1-70b")
    figures = {}
    for sharding in ("ddp", "zero3"):
        for placement in ("auto", "replicated", "sharded"):
            placed = dataclasses.replace(w, teacher_placement=placement)
            phases = per_gpu_phases(spec, placed, make_layout(spec, placed, gpus=8, sharding=sharding))
            figures[sharding, placement] = phases["optimizer"]["weights/teacher"]
    assert figures["ddp", "auto"] == figures["ddp", "replicated"] == figures["zero3", "replicated"] == 141107414016
    assert figures["zero3", "auto"] == 21841119360  # DeepSpeed's ZeRO-3: 1/8 and the gathered largest layer
    assert figures["ddp", "sharded"] == figures["zero3", "sharded"] == 17638427648  # FSDP2's 1/8 shards


def test_placement_refusals_name_the_fix(paths):
    spec = load_model(None, config_path=str(paths["student"]))
    with pytest.raises(InvalidWorkload, match="add --gpus N"):
        make_layout(spec, _workload(paths, "sharded"), gpus=1)
    with pytest.raises(InvalidWorkload, match="drop --teacher-quant, or use --teacher-placement replicated"):
        build_workload("distill", **FIELDS, teacher=str(paths["teacher"]), teacher_placement="sharded",
                       teacher_quant="nf4")
    with pytest.raises(InvalidWorkload, match="--teacher-placement only applies to --task distill"):
        build_workload("train", **FIELDS, teacher_placement="sharded")
    from llamem.trace.limits import check_traceable  # the trace runs one GPU: a sharded teacher is refused

    with pytest.raises(InvalidWorkload, match="llamem trace runs one GPU"):
        check_traceable(_workload(paths, "sharded"))


def test_the_planner_shards_the_teacher_where_replicated_does_not_fit(paths):
    """With the teacher asked replicated, no layout FSDP2 runs fits a card between the two placements' figures
    (973,777,408 bytes sharded under DDP, 981,020,672 replicated); the planner shards the teacher, a step of its
    ladder, and says where the teacher is."""
    spec = load_model(None, config_path=str(paths["student"]))
    w = _workload(paths, "replicated", teacher="deep_teacher")
    gpu = dataclasses.replace(get_gpu("h100"), memory_bytes=976_000_000)
    plan = make_plan(spec, w, gpu, num_gpus=2, host_budget_bytes=2**40, teacher=load_model(str(paths["deep_teacher"])),
                     exact=True, engine="fsdp2")
    assert plan.fits and plan.start.device_bytes > gpu.memory_bytes
    assert (plan.final.workload.teacher_placement, plan.final.layout.describe()) == ("sharded", "ddp x2")
    assert plan.final.device_bytes == 973761024  # micro-batch 1 on each of the 2 replicas
    assert [step.technique for step in plan.steps] == ["teacher placement"]
    text = render_plan(plan)
    assert "teacher: " + str(paths["deep_teacher"]) + " sharded over 2 GPUs with FSDP2 fully_shard" in text
    assert "--teacher-placement sharded --gpus 2 --sharding ddp" in plan.command


def test_teacher_options_are_tried_only_where_nothing_fits_without(paths):
    """On a card that holds the replicated teacher the search is the one without teacher choices."""
    spec = load_model(None, config_path=str(paths["student"]))
    w = _workload(paths, "replicated", teacher="deep_teacher")
    gpu = dataclasses.replace(get_gpu("h100"), memory_bytes=990_000_000)
    plan = make_plan(spec, w, gpu, num_gpus=2, host_budget_bytes=2**40, teacher=load_model(str(paths["deep_teacher"])),
                     exact=True, engine="fsdp2")
    assert plan.fits and plan.final.workload.teacher_placement == "replicated"
    assert plan.notes[-1] == "2 configurations evaluated"  # 18 where the teacher is sharded (above)


def test_deepspeed_bundles_keep_a_replicated_teacher_outside_the_engine(paths):
    spec = load_model(None, config_path=str(paths["student"]))
    for placement, refused in (("replicated", False), ("sharded", True)):
        w = _workload(paths, placement)
        plan = layout_plan(spec, w, make_layout(spec, w, gpus=2, sharding="zero2"), get_gpu("h100"),
                           model_args=("--config", str(paths["student"])))
        bundle = emit_bundle(plan, paths["folder"] / f"zero2-{placement}")
        assert bundle.strategy == "deepspeed" and (bundle.unsupported is not None) == refused
        if not refused:
            script = (bundle.directory / "train.py").read_text()
            assert "'placement': 'replicated'" in script and "load_teacher=load_teacher" in script


@pytest.mark.skipif(not os.environ.get("LLAMEM_DEEPSPEED_RUNS"), reason="set LLAMEM_DEEPSPEED_RUNS=1: one more "
                    "DeepSpeed launch (tests/test_deepspeed_schedules.py runs ZeRO-2's by default)")
def test_deepspeed_zero2_bundle_runs_with_a_replicated_teacher(paths, capsys):
    """The teacher outside DeepSpeed's engine, whole on each rank. ZeRO-2 makes its gradients in backward and frees
    them in the step, so the forward, where the teacher's logits are, holds none (`parallel.zero_phase_states`):
    measured 2,613,760 in the second step's forward against the estimate's 2,610,176 (with the gradients counted
    there, the estimate was 7 % above the run). The ranks peak in the step at 2,816,512: the estimate's step,
    2,530,560, plus what only a CPU rank holds there (271,872: torch's AdamW temporaries and the host's fp32
    originals, by the student's own gloo and nccl schedules, tests/test_bundle_runs.py)."""
    pytest.importorskip("deepspeed")
    estimate = _estimate(paths, capsys, "--sharding", "zero2")
    assert estimate["phases"]["forward"] == 2_610_176 and "gradients" not in estimate["phase_breakdowns"][
        "forward"]
    peaks, _readme = _run(paths, "auto", "zero2", "deepspeed", steps=2)
    step = estimate["phases"]["optimizer"] + 271_872
    assert all(abs(peak - step) <= 0.02 * step for peak in peaks), (peaks, step)
