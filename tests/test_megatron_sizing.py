"""`--engine megatron`: Megatron-LM's model states as its distributed optimizer's documentation and its own
estimator count them (`llamem.megatron`), 16-bit activations, and bad combinations refused with the fix."""

from __future__ import annotations

import json

import pytest

from llamem import build_workload, load_model
from llamem.cli import main
from llamem.parallel import Layout, per_gpu_phases, shard_spec, with_engine

STATES = ("weights", "gradients", "optimizer")


@pytest.mark.parametrize(("precision", "whole", "sharded"), [
    ("bf16-mixed", 18, (6, 12)), ("fp16-mixed", 20, (4, 16)), ("fp32", 16, (8, 8))])
@pytest.mark.parametrize("distributed", [False, True])
def test_model_states_are_megatrons_bytes_per_parameter(precision, whole, sharded, distributed):
    """docs/user-guide/features/dist_optimizer.md's table: bytes per parameter without the distributed
    optimizer, and (kept, sharded over d) with it; `theoretical_memory_usage.py` uses the bf16 row."""
    spec = load_model("llama-3.1-8b")
    w = build_workload(task="train", batch=1, seq=1024, precision=precision, optimizer="adamw")
    layout = with_engine(Layout(dp=4, tp=2, sharding="zero1" if distributed else "ddp"), "megatron")
    P = shard_spec(spec, layout).num_params
    phases = per_gpu_phases(spec, w, layout)
    expected = sharded[0] * P + sharded[1] * P // 4 if distributed else whole * P
    for name in ("forward", "backward", "optimizer"):
        assert sum(phases[name].get(k, 0) for k in STATES) == expected, name
    assert phases["optimizer"].get("temporaries", 0) == 0  # a fused Adam over the main weights


def _report(capsys, *args: str) -> dict:
    capsys.readouterr()
    assert main(["estimate", "llama-3.1-8b", "--task", "train", "--batch", "1", "--seq", "2048", "--optimizer",
                 "adamw", "--gpus", "8", "--tp", "2", *args, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_megatron_runs_a_16_bit_model(capsys):
    """--bf16 casts the model (Float16Module): activations as DeepSpeed's bf16 mode has them, below autocast's
    fp32 residual stream; the note says which precision the figure assumes."""
    megatron = _report(capsys, "--precision", "bf16-mixed", "--sharding", "zero1", "--engine", "megatron")
    deepspeed = _report(capsys, "--precision", "bf16-mixed", "--sharding", "zero1")
    autocast = _report(capsys, "--precision", "bf16-mixed", "--sharding", "ddp")
    activations = {name: r["phase_breakdowns"]["forward"]["activations"]
                   for name, r in (("megatron", megatron), ("deepspeed", deepspeed), ("autocast", autocast))}
    assert activations["megatron"] == activations["deepspeed"] < activations["autocast"]
    assert any("Megatron-LM's --bf16 runs bf16-mixed" in note and "distributed optimizer" in note
               for note in megatron["notes"])
    # The fp32 gradient buffer, 4 bytes a parameter from the wrap on (ZeRO-1 makes bf16 ones in backward).
    P = shard_spec(load_model("llama-3.1-8b"), Layout(dp=4, tp=2)).num_params
    assert megatron["phase_breakdowns"]["forward"]["gradients"] == 4 * P
    assert "gradients" not in deepspeed["phase_breakdowns"]["forward"]


@pytest.mark.parametrize(("args", "fragment"), [
    (["--sharding", "zero3"], "--sharding zero1"),
    (["--sharding", "zero1", "--offload", "optimizer"], "drop --offload"),
    (["--precision", "bf16", "--sharding", "zero1"], "--precision fp32, bf16-mixed, fp16-mixed"),
])
def test_what_megatron_does_not_run_is_refused_with_the_fix(capsys, args, fragment):
    capsys.readouterr()
    assert main(["estimate", "llama-3.1-8b", "--task", "train", "--batch", "1", "--seq", "2048", "--optimizer",
                 "adamw", "--gpus", "4", *args, "--engine", "megatron"]) == 1
    assert fragment in capsys.readouterr().err


def test_the_plans_code_is_megatrons_launch(capsys):
    """`plan --engine megatron --code` prints the launch of Megatron-LM's own script with the plan's arguments,
    not a Trainer it would not run."""
    capsys.readouterr()
    assert main(["plan", "llama-3.2-1b", "--budget", "12GiB", "--gpus", "4", "--task", "train", "--batch", "8",
                 "--seq", "2048", "--precision", "bf16-mixed", "--optimizer", "adamw", "--engine", "megatron",
                 "--json", "--code"]) == 0
    plan = json.loads(capsys.readouterr().out)
    code = plan["final"]["code"]
    assert "torchrun --nnodes 1 --nproc-per-node 4 pretrain_gpt.py" in code and "TrainingArguments" not in code
    assert all(f"    {argument}" in code for argument in plan["final"]["megatron_args"])
