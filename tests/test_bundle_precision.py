"""Precision as each engine runs it: a ZeRO layout under DeepSpeed runs bf16-mixed as DeepSpeed's bf16 mode
(bf16 weights and activations, fp32 master weights and moments in the optimizer) and is sized so; DDP keeps
torch autocast's fp32 residual stream; FSDP2's MixedPrecisionPolicy is sized by its own accounting; the
bundle's config and README say which one runs."""

from __future__ import annotations

import json

import pytest

from llamem.bundle import emit_bundle, layout_plan
from llamem.engine_precision import precision_note, runs_as
from llamem.gpus import get_gpu
from llamem.model import load_model
from llamem.parallel import make_layout, per_gpu_phases
from llamem.sizing import estimate_report
from llamem.workload import build_workload, with_changes

SPEC = load_model("debug")
MIXED = build_workload("train", batch=2, seq=256, precision="bf16-mixed", optimizer="adamw", ac_every=1)


def test_zero2_under_deepspeed_is_sized_as_its_bf16_mode():
    layout = make_layout(SPEC, MIXED, gpus=2, sharding="zero2")
    phases = estimate_report(SPEC, MIXED, layout, details=False).phases
    P, n = SPEC.num_params, 2
    # DeepSpeed's: bf16 weights; in the step the bf16 gradient partition, its concatenation and the fp32 gradient
    # cast from it (`parallel.zero_phase_states`); fp32 master weights + moments
    assert phases["optimizer"] == {"weights": 2 * P, "gradients": 2 * (2 * P // n) + 4 * P // n,
                                   "optimizer": 12 * P // n}
    # activations, logits and temporaries are the bf16 run's: the module holds bf16 weights, nothing autocasts
    bf16 = per_gpu_phases(SPEC, with_changes(MIXED, precision="bf16"), layout)
    assert phases == bf16
    autocast = per_gpu_phases(SPEC, MIXED, layout)
    # autocast's residual stream is fp32: each of the 4 checkpointed layer inputs (2 x 256 tokens x 256) is
    # twice its bf16 size, and more besides
    assert autocast["forward"]["activations"] - phases["forward"]["activations"] >= 4 * 2 * 512 * 256


def test_ddp_and_fsdp2_keep_their_own_precision():
    ddp = make_layout(SPEC, MIXED, gpus=2, sharding="ddp")
    assert runs_as(MIXED, ddp) is MIXED
    assert estimate_report(SPEC, MIXED, ddp, details=False).phases == per_gpu_phases(SPEC, MIXED, ddp)
    assert precision_note(MIXED, ddp) == ("precision as torch autocast runs bf16-mixed: fp32 weights, bf16 matmuls, "
                                          "the residual stream (and every checkpointed layer input) in fp32")
    fsdp2 = make_layout(SPEC, MIXED, gpus=2, sharding="zero3", engine="fsdp2")
    assert runs_as(MIXED, fsdp2) is MIXED  # fsdp2_phases computes in the policy's param dtype itself
    assert precision_note(MIXED, fsdp2) == ("precision as FSDP2's MixedPrecisionPolicy(param_dtype=bf16, "
                                            "reduce_dtype=fp32) runs bf16-mixed: fp32 shards, bf16 gathered weights "
                                            "and activations")
    lora = build_workload("lora", batch=2, seq=256, precision="bf16-mixed", optimizer="adamw")
    assert runs_as(lora, make_layout(SPEC, lora, gpus=2, sharding="zero2")) is lora  # ZeRO holds adapters only


def test_estimate_says_which_precision_its_figure_assumes():
    layout = make_layout(SPEC, MIXED, gpus=2, sharding="zero3")
    notes = estimate_report(SPEC, MIXED, layout, details=False).notes
    assert ("precision as DeepSpeed's bf16 mode runs bf16-mixed: bf16 weights, gradients and activations, fp32 "
            "master weights and optimizer state inside the ZeRO optimizer") in notes


@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_the_bundle_runs_the_precision_its_figure_assumes(tmp_path, sharding):
    w = with_changes(MIXED, ac_every=0)
    layout = make_layout(SPEC, w, gpus=2, sharding=sharding)
    plan = layout_plan(SPEC, w, layout, get_gpu("h100"))
    bundle = emit_bundle(plan, tmp_path)
    readme = (tmp_path / "README.md").read_text()
    if bundle.strategy == "deepspeed":
        config = json.loads((tmp_path / "ds_config.json").read_text())
        assert config["bf16"] == {"enabled": True} and "fp16" not in config
        assert ("- Precision as DeepSpeed's bf16 mode runs bf16-mixed: bf16 weights, gradients and activations, "
                "fp32 master weights and optimizer state inside the ZeRO optimizer.") in readme
    else:  # ZeRO-3 of a full fine-tune runs with fully_shard and a MixedPrecisionPolicy
        assert bundle.strategy == "fsdp2"
        assert "- Precision as FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) runs" in readme


def test_accelerates_fsdp2_reduces_in_fp32_as_the_plan_sizes():
    torch = pytest.importorskip("torch")
    pytest.importorskip("accelerate")
    from llamem.bundle.train_body import accelerate_plugins

    plugin = accelerate_plugins({"strategy": "fsdp2", "mixed": True, "compute_dtype": "bf16"})["fsdp_plugin"]
    plugin.set_mixed_precision("bf16")  # what AcceleratorState does with the YAML's mixed_precision
    policy = plugin.mixed_precision_policy
    assert (policy.param_dtype, policy.reduce_dtype, plugin.fsdp_version) == (torch.bfloat16, torch.float32, 2)
    assert accelerate_plugins({"strategy": "ddp", "mixed": True, "compute_dtype": "bf16"}) == {}
