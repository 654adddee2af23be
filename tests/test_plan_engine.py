"""`llamem plan --engine`: the search keeps the layouts the chosen engine runs, sizes FSDP2 as FSDP2
runs it (the reproduce command says `--engine fsdp2` and gives the same figure), emits that engine's
bundle, and for Megatron-LM prints its arguments."""

from __future__ import annotations

import json
import shlex

import pytest
from plan_cli import HOST_BYTES, run_cli

from llamem.bundle.emit import bundle_runs, emit_for_cli
from llamem.errors import UsageError
from llamem.gpus import budget_gpu
from llamem.model import load_model
from llamem.parallel import Layout
from llamem.plan import Candidate, make_plan, megatron_args
from llamem.reporters.plan_report import plan_to_dict, render_plan
from llamem.workload import build_workload


TRAIN_8x2048 = build_workload(task="train", batch=8, seq=2048, precision="bf16-mixed", optimizer="adamw")
TRAIN_FULL_AC = build_workload(task="train", ac_every=1, precision="bf16-mixed", optimizer="adamw")


@pytest.fixture(scope="module")
def plans():
    """llama-3.2-1b, 8 x 2048 tokens per step, on 4 GPUs of 12 GiB: it needs sharding or model parallelism."""
    spec = load_model("llama-3.2-1b")
    w = TRAIN_8x2048
    gpu = budget_gpu(12 * 2**30)
    return {engine: make_plan(spec, w, gpu, num_gpus=4, host_budget_bytes=HOST_BYTES, model_args=("llama-3.2-1b",),
                              engine=engine)
            for engine in ("any", "fsdp2", "deepspeed", "accelerate", "trainer", "megatron")}


def runs_fsdp2(layout: Layout) -> bool:
    """torchrun's bundle: one GPU, DDP, or ZeRO-3 sized as FSDP2 runs it; no TP, PP or offload."""
    if (layout.tp, layout.pp, layout.offload) != (1, 1, "none"):
        return False
    return layout.sharding in ("none", "ddp") or (layout.sharding == "zero3" and layout.engine == "fsdp2")


def runs_deepspeed(layout: Layout) -> bool:
    in_zero = layout.sharding in ("zero1", "zero2", "zero3")
    return (layout.tp, layout.pp, layout.engine) == (1, 1, "deepspeed") and in_zero


def runs_accelerate(layout: Layout) -> bool:
    """accelerate's bundle runs ZeRO-3 without offload as FSDP2: DeepSpeed's ZeRO-3 only with offload."""
    deepspeed = runs_deepspeed(layout) and (layout.sharding != "zero3" or layout.offload != "none")
    return runs_fsdp2(layout) or deepspeed


def runs_megatron(layout: Layout) -> bool:
    """Sized as Megatron-LM runs it (`llamem.megatron`): data parallel or its distributed optimizer."""
    return layout.engine == "megatron" and layout.offload == "none" and layout.sharding in ("none", "ddp", "zero1")


ALLOWED = {"fsdp2": runs_fsdp2, "deepspeed": runs_deepspeed, "accelerate": runs_accelerate,
           "trainer": runs_accelerate, "megatron": runs_megatron}


@pytest.mark.parametrize("engine", sorted(ALLOWED))
def test_each_engine_plans_only_the_layouts_it_runs(plans, engine):
    plan = plans[engine]
    assert plan.fits and plan.engine == engine
    assert ALLOWED[engine](plan.final.layout), plan.final.layout
    assert plan.final.device_bytes <= plan.gpu.memory_bytes


def test_the_case_chooses_different_layouts_per_engine(plans):
    """The case is one where the engines differ: otherwise the test above would prove little."""
    layouts = {engine: plans[engine].final.layout for engine in ("any", "fsdp2", "deepspeed", "megatron")}
    # ZeRO's bf16 activations (the engines' own precision, llamem.engine_precision) let tensor parallel 2 run
    # ZeRO-2 beside it
    assert (layouts["any"].tp, layouts["any"].sharding) == (2, "zero2")
    assert (layouts["fsdp2"].dp, layouts["fsdp2"].sharding, layouts["fsdp2"].engine) == (4, "zero3", "fsdp2")
    # ZeRO-1/2 sized phase by phase as DeepSpeed allocates (`parallel.zero_phase_states`; ZeRO-1's backward the
    # larger of its two moments, `parallel.zero1_backward`) fits 12 GiB with selective checkpointing: ZeRO-1, the
    # first of the two that fits (11.65 GiB; ZeRO-3 when every phase held the 16-bit and the fp32 gradients)
    assert layouts["deepspeed"].sharding == "zero1" and layouts["deepspeed"].dp == 4
    assert layouts["deepspeed"].engine != "fsdp2"  # sized as DeepSpeed runs it, not as FSDP2
    assert (layouts["megatron"].tp, layouts["megatron"].sharding) == (2, "zero1")  # the distributed optimizer


def test_fsdp2_reproduce_command_gives_the_same_figure(plans):
    plan = plans["fsdp2"]
    assert plan.command.endswith("--sharding zero3 --engine fsdp2")
    argv = shlex.split(plan.command)[1:] + ["--json"]
    code, out, _err = run_cli(argv)
    assert code == 0
    report = json.loads(out)
    assert report["device_bytes"] == plan.final.device_bytes
    assert plan.steps[-1].command == plan.command and plan.steps[-1].peak_device_bytes == plan.final.device_bytes


def test_megatron_reproduce_command_gives_the_same_figure(plans):
    """The plan's figure is Megatron-LM's own model states: the command names the engine that sizes them."""
    plan = plans["megatron"]
    assert plan.command.endswith("--sharding zero1 --engine megatron")
    code, out, _err = run_cli(shlex.split(plan.command)[1:] + ["--json"])
    assert code == 0 and json.loads(out)["device_bytes"] == plan.final.device_bytes
    assert any("Megatron-LM's --bf16" in note for note in json.loads(out)["notes"])


def test_every_ladder_command_reproduces_its_figure(plans):
    for step in plans["accelerate"].steps:
        code, out, _err = run_cli(shlex.split(step.command)[1:] + ["--json"])
        assert code == 0 and json.loads(out)["device_bytes"] == step.peak_device_bytes, step.command


def test_megatron_arguments_follow_the_layout(plans):
    plan = plans["megatron"]
    w, layout = plan.final.workload, plan.final.layout
    args = " ".join(plan.megatron_args)
    assert f"--tensor-model-parallel-size {layout.tp} --pipeline-model-parallel-size {layout.pp}" in args
    assert f"--micro-batch-size {w.batch} --global-batch-size 8 --seq-length 2048 --bf16" in args
    assert ("--use-distributed-optimizer" in args) == (layout.sharding == "zero1")
    assert ("--recompute" in args) == (w.ac_every > 0)
    assert f"megatron-lm: {args}" in render_plan(plan)
    assert "emits Megatron-LM arguments only" in render_plan(plan)
    data = plan_to_dict(plan)
    assert data["final"]["megatron_args"] == list(plan.megatron_args) and data["engine"] == "megatron"


def test_megatron_arguments_of_checkpointing_and_the_distributed_optimizer(plans):
    spec = plans["megatron"].model
    w = build_workload(task="train", batch=2, seq=1024, grad_accum=3, ac_every=4, precision="fp16-mixed")
    layout = Layout(dp=2, tp=2, pp=2, sharding="zero1", microbatches=3)
    c = Candidate(workload=w, layout=layout, allocated_bytes=0, device_bytes=0, seconds=1.0, tier=0)
    # 16 layers over 2 stages: 8 per stage, one in four checkpointed.
    assert megatron_args(spec, c) == (
        "--tensor-model-parallel-size 2", "--pipeline-model-parallel-size 2",
        "--recompute-granularity full --recompute-method block --recompute-num-layers 2",
        "--use-distributed-optimizer", "--micro-batch-size 2", "--global-batch-size 12", "--seq-length 1024", "--fp16")
    full = Candidate(workload=TRAIN_FULL_AC, layout=Layout(), allocated_bytes=0,
                     device_bytes=0, seconds=1.0, tier=0)
    full_args = megatron_args(spec, full)
    assert "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1" in full_args


def test_any_keeps_the_json_without_engine_fields(plans):
    data = plan_to_dict(plans["any"])
    assert "engine" not in data and "megatron_args" not in data["final"]
    assert "--engine" not in plans["any"].command


@pytest.mark.parametrize(("engine", "strategy", "launcher"), [
    ("fsdp2", "fsdp2", "torchrun"), ("deepspeed", "deepspeed", "deepspeed"), ("accelerate", "fsdp2", "accelerate")])
def test_emit_writes_the_engines_bundle(tmp_path, engine, strategy, launcher):
    """As `llamem plan --emit --engine E` plans it: only configurations E's bundle runs."""
    spec, gpu = load_model("llama-3.2-1b"), budget_gpu(12 * 2**30)
    plan = make_plan(spec, TRAIN_8x2048, gpu, num_gpus=4,
                     host_budget_bytes=HOST_BYTES, engine=engine, runnable=bundle_runs(engine))
    line = emit_for_cli(plan, tmp_path, engine=engine)
    assert line.startswith(f"bundle: {tmp_path}/")
    settings = (tmp_path / "train.py").read_text()
    assert f"'strategy': '{strategy}'," in settings and f"'launcher': '{launcher}'," in settings
    assert ((tmp_path / "ds_config.json").exists()) == (strategy == "deepspeed")


def test_megatron_writes_no_bundle(plans, tmp_path):
    with pytest.raises(UsageError, match="--engine megatron prints Megatron-LM arguments only"):
        emit_for_cli(plans["megatron"], tmp_path / "out", engine="megatron")
    assert not (tmp_path / "out").exists()


def test_a_bad_engine_is_a_usage_error_naming_the_choices():
    code, _out, err = run_cli(["plan", "llama-3.2-1b", "--gpu", "a100-80gb", "--engine", "horovod"])
    assert code == 2
    assert "'horovod' is not one of 'any', 'fsdp2', 'deepspeed', 'accelerate', 'trainer', 'megatron'" in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--task", "infer", "--engine", "deepspeed"], "--engine deepspeed plans ZeRO training"),
    (["--task", "lora", "--engine", "megatron"],
     "--engine megatron plans full training (--task train), not --task lora"),
])
def test_engines_that_cannot_plan_the_task_say_so(argv, message):
    code, _out, err = run_cli(["plan", "llama-3.2-1b", "--gpu", "a100-80gb", "--gpus", "2", *argv])
    assert code == 2 and message in err


def test_maximize_batch_steps_by_the_replicas_when_every_layout_replicates():
    """Under DeepSpeed (no tensor or pipeline parallel) 4 GPUs are 4 replicas: the largest global batch
    is a multiple of 4, each replica running a quarter of it: at 1024 tokens on 8 GiB cards, 240 (60 per
    replica, ZeRO-3 with offload, Liger's kernels and offloaded checkpoints; 204 under ZeRO-1 before a
    checkpointed layer's backward under Liger was sized as it runs, `backward.liger_layer_backward`)."""
    spec = load_model("llama-3.2-1b")
    w = build_workload(task="train", batch=8, seq=1024, precision="bf16-mixed", optimizer="adamw")
    plan = make_plan(spec, w, budget_gpu(8 * 2**30), num_gpus=4,
                     host_budget_bytes=HOST_BYTES, engine="deepspeed", maximize_what="batch")
    assert plan.fits and plan.maximized == {"what": "batch", "value": 240}
    assert plan.final.layout.dp == 4 and plan.final.workload.batch == 60 and plan.final.workload.grad_accum == 1
