"""Activation offloading (`--offload-activations`, transformers' `activation_checkpointing_enable(offload=True)`):
each checkpointed layer's input in pinned host memory. The analytic engine against the trace engine,
device and host bytes apart, on a tiny model; the combinations refused; the PCIe time; the snippet;
the hook on a real model (the gradients do not change).
"""

from __future__ import annotations

import gc

import pytest
import torch

from llamem.analytic import estimate
from llamem.analytic.offload import host_block_bytes
from llamem.cli import main
from llamem.cost import activation_offload_seconds, step_seconds
from llamem.errors import InvalidWorkload
from llamem.gpus import get_gpu
from llamem.model import load_model
from llamem.parallel import Layout
from llamem.trace.run import trace
from llamem.workload import build_workload

OFFLOAD = dict(ac_every=1, offload_activations=True, optimizer="adamw-fused", batch=2, seq=256)


CASES = {"bf16": dict(task="train", precision="bf16"), "mixed": dict(task="train", precision="bf16-mixed"),
         "lora": dict(task="lora", precision="bf16")}


@pytest.fixture(scope="module")
def spec():
    return load_model("debug", overrides={"num_hidden_layers": 2})


@pytest.fixture(scope="module", autouse=True)
def _settled_heap():
    """Every trace starts with a full collection, which walks every object of the process: seconds
    after a long run of other test modules. What those left is collected once and frozen, so the
    collections here walk only what this module's traces create."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="module")
def reports(spec):
    """(analytic, trace) of each case offloaded, and of bf16 without offloading."""
    out = {}
    for name, options in CASES.items():
        w = build_workload(**options, **OFFLOAD)
        out[name] = estimate(spec, w), trace(spec, w)
    w = build_workload(**CASES["bf16"], **{**OFFLOAD, "offload_activations": False})
    out["bf16 kept"] = estimate(spec, w), trace(spec, w)
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_analytic_matches_the_trace_on_the_device_and_the_host(reports, case):
    analytic, traced = reports[case]
    assert analytic.peak_phase == traced.peak_phase == "backward"
    # The loss and its gradient (two 0-dim tensors, 1 KiB) are left out at this moment, with or without offloading.
    assert abs(analytic.peak_allocated_bytes - traced.peak_allocated_bytes) <= 1024
    assert analytic.phases["backward"]["activations"] == traced.phases["backward"]["activations"]
    # Two layers, each input (batch 2 x 256 tokens x hidden 256; fp32 under autocast) in a power-of-two block.
    stream = (4 if case == "mixed" else 2) * 2 * 256 * 256
    host = {"load": 0, "forward": 2 * stream, "backward": 2 * stream, "optimizer": 0}
    assert analytic.extra["host_bytes"] == traced.extra["host_bytes"] == host
    assert any("host peak" in note for note in analytic.notes + traced.notes)


def test_offloading_frees_the_checkpoint_inputs_at_the_loss(reports):
    (analytic_on, traced_on), (analytic_off, traced_off) = reports["bf16"], reports["bf16 kept"]
    saved = traced_off.phases["forward"]["activations"] - traced_on.phases["forward"]["activations"]
    assert saved == 2 * (2 * 2 * 256 * 256)  # both layers' inputs
    assert analytic_off.phases["forward"]["activations"] - analytic_on.phases["forward"]["activations"] == saved
    # In backward the bottom layer's own input is back on the device: the peak drops by less.
    assert 0 < traced_off.peak_allocated_bytes - traced_on.peak_allocated_bytes < saved


def test_host_blocks_are_powers_of_two():
    assert [host_block_bytes(n) for n in (0, 1, 512, 513, 3 * 2**20)] == [0, 1, 512, 1024, 4 * 2**20]


@pytest.mark.parametrize(("options", "message"), [
    (dict(), "add --ac full"),
    (dict(ac_every=2), "use --ac full instead of --ac every-2"),
    (dict(ac_every=1, ac_mode="selective"), "instead of --ac selective"),
    (dict(ac_every=1, compile=True), "--compile with --offload-activations is not sized yet"),
])
def test_refusals_name_the_fix(options, message):
    with pytest.raises(InvalidWorkload) as err:
        build_workload("train", offload_activations=True, **options)
    assert any(message in problem for problem in err.value.problems)


def test_refused_for_inference():
    with pytest.raises(InvalidWorkload) as err:
        build_workload("infer", offload_activations=True)
    assert "--offload-activations only applies to --task train / lora / qlora / distill" in err.value.problems[0]


def test_pcie_time_is_two_copies_of_every_layer_input():
    spec = load_model("llama-3.1-8b")
    gpu = get_gpu("h100-80gb")
    on = build_workload("train", precision="bf16", optimizer="adamw-fused", ac_every=1, offload_activations=True,
                        batch=2, seq=4096, grad_accum=4)
    off = build_workload("train", precision="bf16", optimizer="adamw-fused", ac_every=1, batch=2, seq=4096,
                         grad_accum=4)
    moved = 2 * 32 * (2 * 2 * 4096 * 4096) * 4  # in and out, 32 layers, bf16 inputs, 4 micro-batches
    assert activation_offload_seconds(spec, on, Layout(), gpu) == pytest.approx(moved / gpu.pcie_bandwidth)
    assert step_seconds(spec, on, Layout(), gpu) - step_seconds(spec, off, Layout(), gpu) == pytest.approx(
        moved / gpu.pcie_bandwidth)


ESTIMATE = ["estimate", "debug", "--precision", "bf16", "--optimizer", "adamw-fused", "--seq", "64"]


def test_cli_flag_label_and_refusal(capsys):
    assert main([*ESTIMATE, "--ac", "full", "--offload-activations"]) == 0
    text = capsys.readouterr().out
    assert "ac full · activations offloaded" in text and "host peak" in text
    assert main([*ESTIMATE, "--offload-activations"]) == 1
    captured = capsys.readouterr()
    assert "add --ac full" in captured.out + captured.err and "Traceback" not in captured.out + captured.err


def test_trainer_code_and_reproduce_command():
    from llamem.techniques import workload_args, workload_code

    w = build_workload("train", precision="bf16", optimizer="adamw-fused", ac_every=1, offload_activations=True)
    assert 'activation_checkpointing_kwargs={"use_reentrant": False, "offload": True}' in workload_code(w).training_args
    args = workload_args(w)
    assert args[args.index("--ac"):args.index("--ac") + 3] == ["--ac", "full", "--offload-activations"]


class _Recorder:
    """What the offloading hook tells the tracer, on a real model: which copies are host memory."""

    def __init__(self) -> None:
        self.host = False
        self.unpacked = 0

    def label(self, tensor, category) -> None:
        self.unpacked += 1


def test_the_hook_offloads_each_layer_input_and_keeps_the_gradients():
    from transformers import LlamaConfig, LlamaForCausalLM

    from llamem.trace.offload import install_offload

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 512, (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    recorder = _Recorder()
    assert install_offload(model, recorder) == 2
    model(input_ids=ids, labels=ids).loss.backward()
    assert recorder.unpacked == 2  # one device copy per layer, made in its backward
    assert all(torch.allclose(p.grad, expected[name]) for name, p in model.named_parameters())
