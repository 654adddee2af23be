"""`llamem plan` with `--emit`, `--code` and `--min-gpus` as a hostile reviewer tried them: the plan
picks only configurations its bundle runs, names the real cause when the batch caps the GPUs, prints
the engine's own code, sizes LoRA where it runs, and says which memory a shortfall is of."""

from __future__ import annotations

import json

import pytest
from plan_cli import HOST_BYTES, run_cli

from llamem.bundle.emit import bundle_runs, choose, emit_plan, layout_plan, unsupported_reason
from llamem.errors import LlamemError
from llamem.gpus import budget_gpu, get_gpu
from llamem.model import load_model
from llamem.parallel import make_layout
from llamem.plan import does_not_fit, make_plan
from llamem.reporters.plan_report import plan_to_dict, render_plan
from llamem.snippet import plan_code
from llamem.units import format_bytes, format_gib
from llamem.workload import build_workload

GIB = 2**30


@pytest.fixture(scope="module")
def spec():
    return load_model("llama-3.2-1b")


# (a) the search keeps what the bundle runs ----------------------------------------------------------
def test_emit_keeps_only_configurations_the_bundle_runs(spec):
    """8 x 2048 tokens on 4 GPUs of 12 GiB: the plain search picks tensor parallelism (which no bundle
    runs yet); under --emit the search picks what the bundle runs, and it fits."""
    w = build_workload(task="train", batch=8, seq=2048, precision="bf16-mixed", optimizer="adamw")
    gpu = budget_gpu(12 * GIB)
    free = make_plan(spec, w, gpu, num_gpus=4, host_budget_bytes=HOST_BYTES)
    runs = bundle_runs("any")
    emitted = make_plan(spec, w, gpu, num_gpus=4, host_budget_bytes=HOST_BYTES, runnable=runs)
    assert not runs(spec, free.final.workload, free.final.layout)
    assert emitted.fits and runs(spec, emitted.final.workload, emitted.final.layout)
    strategy, _launcher = choose(emitted.final.layout, "any")
    assert unsupported_reason(emitted.final.workload, emitted.final.layout, strategy) is None


def test_emit_of_a_configuration_the_bundle_refuses_is_an_error_before_writing(tmp_path):
    """A QLoRA base under ZeRO-3 has no bundle: `emit_plan` says why and writes nothing."""
    spec = load_model("llama-3.2-1b")
    w = build_workload(task="qlora", batch=2, seq=512, precision="bf16", optimizer="adamw")
    plan = layout_plan(spec, w, make_layout(spec, w, gpus=2, sharding="zero3"), get_gpu("h100"))
    with pytest.raises(LlamemError, match=r"has no launch bundle: a nf4 base under zero3 is not emitted yet"):
        emit_plan(plan, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_emit_with_megatron_is_a_usage_error_before_planning(tmp_path):
    code, _out, err = run_cli(["plan", "llama-3.2-1b", "--gpu", "a100-80gb", "--gpus", "2", "--engine", "megatron",
                               "--emit", str(tmp_path / "out")])
    assert code == 2 and "--emit writes launch bundles and --engine megatron prints Megatron-LM arguments" in err
    assert not (tmp_path / "out").exists()


# (b) the batch, not the engine, caps the GPUs ------------------------------------------------------
def test_min_gpus_names_the_global_batch_as_the_cap():
    code, out, err = run_cli(["plan", "llama-3.1-8b", "--gpu", "a100-80gb", "--batch", "1", "--seq", "4096",
                              "--precision", "bf16-mixed", "--optimizer", "adamw", "--min-gpus", "--engine", "fsdp2",
                              "--exact"])
    assert code == 3
    assert ("--min-gpus stopped at 1 GPU: no layout of more GPUs that --engine fsdp2 runs divides the global batch "
            "(1 per step, --batch x --grad-accum) among its data-parallel replicas: raise --batch or --grad-accum so "
            "that more replicas share the batch, or plan with --engine any, which also splits the model") in err
    assert "1024" not in err and "try more GPUs" not in err
    assert "DOES NOT FIT" in out


def test_gpus_that_the_batch_cannot_use_name_the_batch_and_the_engine():
    code, _out, err = run_cli(["plan", "llama-3.1-8b", "--gpu", "a100-80gb", "--batch", "1", "--seq", "4096",
                               "--precision", "bf16-mixed", "--optimizer", "adamw", "--gpus", "2", "--engine", "fsdp2",
                               "--exact"])
    assert code == 3
    assert ("the global batch (1 per step) does not split evenly over 2 data-parallel replicas, so those layouts were "
            "not considered: choose a batch divisible by the replicas to use them; --engine fsdp2 splits only the "
            "batch (every GPU is a data-parallel replica): --engine any also splits the model") in err


# (c) --code prints the layout's engine -------------------------------------------------------------
def test_code_of_an_fsdp2_plan_configures_fsdp2_not_deepspeed(spec):
    w = build_workload(task="train", batch=8, seq=2048, precision="bf16-mixed", optimizer="adamw")
    plan = make_plan(spec, w, budget_gpu(12 * GIB), num_gpus=4, host_budget_bytes=HOST_BYTES, engine="fsdp2")
    assert plan.final.layout.engine == "fsdp2"
    code = plan_code(plan)
    assert "deepspeed" not in code
    assert ('fsdp=True, fsdp_config={"version": 2, "reshard_after_forward": True, "transformer_layer_cls_to_wrap": '
            '["LlamaDecoderLayer"]})') in code
    assert "(one process per GPU; FSDP2 with the fsdp_config above)." in code


def test_code_of_a_deepspeed_plan_names_its_stage(spec):
    w = build_workload(task="train", batch=8, seq=2048, precision="bf16-mixed", optimizer="adamw")
    plan = make_plan(spec, w, budget_gpu(12 * GIB), num_gpus=4, host_budget_bytes=HOST_BYTES, engine="deepspeed")
    stage = plan.final.layout.sharding[-1]
    code = plan_code(plan)
    assert f'"zero_optimization": {{"stage": {stage}' in code and "fsdp" not in code
    assert f"(one process per GPU; DeepSpeed ZeRO-{stage} above)." in code


# (d) LoRA under ZeRO-3 -----------------------------------------------------------------------------
def test_lora_under_zero3_runs_with_deepspeed_whose_accounting_sizes_it(spec):
    w = build_workload(task="lora", batch=2, seq=512, precision="bf16", optimizer="adamw")
    layout = make_layout(spec, w, gpus=2, sharding="zero3")
    assert choose(layout, "any", adapters=True) == ("deepspeed", "deepspeed")
    assert bundle_runs("any")(spec, w, layout)
    # FSDP2 over a peft model is not sized: refused with the fix, and never planned under --emit.
    strategy, _launcher = choose(layout, "torchrun", adapters=True)
    assert strategy == "fsdp2"
    assert unsupported_reason(w, layout, strategy) == (
        "LoRA under FSDP2 is not sized by llamem (its ZeRO-3 figure of a LoRA base is DeepSpeed's): emit with engine "
        "'deepspeed', or choose --gpus so the plan uses DDP")
    assert not bundle_runs("fsdp2")(spec, w, layout)


# (e) a host-memory shortfall says so ---------------------------------------------------------------
def test_host_memory_shortfall_is_named_with_its_figure():
    spec = load_model("llama-3.1-8b")
    w = build_workload(task="train", batch=1, seq=1024, precision="bf16-mixed", optimizer="adamw")
    plan = make_plan(spec, w, get_gpu("a100-40gb"), host_budget_bytes=170 * GIB, exact=True, truncate=False,
                     engine="deepspeed")
    assert not plan.fits and plan.final.layout.offload == "optimizer"
    assert plan.final.device_bytes <= plan.gpu.memory_bytes
    host_over = plan.final.host_bytes - 170 * GIB
    assert plan_to_dict(plan)["shortfall"] == {"device_bytes": 0, "host_bytes": host_over}
    assert plan.shortfall_bytes == host_over
    text = render_plan(plan)
    assert (f"DOES NOT FIT: the closest configuration needs {format_gib(plan.final.device_bytes)} per GPU (fits the "
            f"card) and {format_gib(plan.final.host_bytes)} of host memory for offload, {format_bytes(host_over)} over "
            "--host-memory (170.00 GiB)") in text
    assert 9 * GIB < host_over < 10 * GIB  # 179.49 GiB needed: DeepSpeed's 16 bytes per parameter x 1.5
    assert "over the card" not in str(does_not_fit(plan))


# (f) --json says where the bundle is ---------------------------------------------------------------
def test_plan_emit_json_has_the_bundle(tmp_path):
    folder = tmp_path / "bundle"
    code, out, _err = run_cli(["plan", "llama-3.2-1b", "--budget", "12GiB", "--gpus", "4", "--batch", "8", "--seq",
                               "2048", "--precision", "bf16-mixed", "--optimizer", "adamw", "--emit", str(folder),
                               "--json"])
    assert code == 0
    bundle = json.loads(out)["bundle"]
    assert bundle["directory"] == str(folder)
    assert bundle["files"] == sorted(p.name for p in folder.iterdir() if not p.name.startswith("."))
    assert bundle["launch"] == f"bash {folder / 'launch.sh'}"
    assert (bundle["strategy"], bundle["launcher"]) == ("tp", "torchrun")  # tensor parallel x4, one replica


def test_lora_under_an_fsdp2_engine_says_why_zero3_was_left_out(spec):
    w = build_workload(task="lora", batch=4, seq=2048, precision="bf16", optimizer="adamw")
    plan = make_plan(spec, w, budget_gpu(12 * GIB), num_gpus=2, host_budget_bytes=HOST_BYTES, engine="fsdp2")
    assert plan.final.layout.sharding in ("none", "ddp")
    assert ("FSDP2 over a LoRA model is not sized by llamem, so --engine fsdp2 planned DDP only: --engine deepspeed "
            "plans its ZeRO-3") in plan.notes
