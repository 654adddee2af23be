"""Padded and packed batches and flash_attention_2: validation, the emulated kernels' buffers, and the
analytic engine held to the trace (tiny shapes; the sweep is `benchmarks/accuracy.py:padding_rows`)."""

import functools

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from llamem.analytic import estimate  # noqa: E402
from llamem.analytic.attention_paths import flash_num_splits, packed_shape, real_tokens  # noqa: E402
from llamem.cli import main  # noqa: E402
from llamem.errors import InvalidWorkload  # noqa: E402
from llamem.model import load_model  # noqa: E402
from llamem.trace.run import trace  # noqa: E402
from llamem.workload import build_workload  # noqa: E402

BASE = dict(precision="bf16", optimizer="adamw", max_grad_norm=1.0, batch=2, seq=64)


SPEC = load_model("debug", overrides=dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=512))


@pytest.fixture(scope="module")
def spec():
    return SPEC


@functools.lru_cache(maxsize=None)
def traced(workload):
    """Each workload traced once per module (several tests read the same trace)."""
    return trace(SPEC, workload)


@pytest.mark.parametrize("options, message", [
    (dict(attn="flash_attention_2", precision="fp32"), "flash_attention_2 runs in bf16 or fp16 only"),
    (dict(padding="longest", padding_free=True), "drop --padding longest"),
    (dict(pad_fraction=0.2), "--pad-fraction only applies to --padding longest"),
    (dict(padding="longest", pad_fraction=1.0), "--pad-fraction must be a number from 0 to below 1"),
    (dict(padding_free=True, batch=4096, seq=2048), "lower --batch or --seq"),
    (dict(padding="longest", compile=True), "--compile with --padding longest is not sized yet"),
])
def test_invalid_combinations_name_the_flag(options, message):
    with pytest.raises(InvalidWorkload, match=message.replace("-", "\\-").replace(".", "\\.")):
        build_workload("train", **{**BASE, **options})


def test_padding_is_refused_for_inference_and_distillation():
    with pytest.raises(InvalidWorkload, match="--padding only applies to --task"):
        build_workload("infer", padding="longest", batch=2)
    with pytest.raises(InvalidWorkload, match="flash_attention_2 is sized for training only"):
        build_workload("infer", attn="flash_attention_2", batch=2)
    with pytest.raises(InvalidWorkload, match="not sized for distillation yet"):
        build_workload("distill", teacher="debug", padding="longest", batch=2)


def test_shapes_the_model_sees():
    packed = packed_shape(build_workload("train", **BASE, padding_free=True))
    assert (packed.batch, packed.seq) == (1, 128)
    assert real_tokens(build_workload("train", **BASE, padding="longest", pad_fraction=0.25)) == 96
    # flash-attn's split-KV heuristic: a small batch x heads x blocks splits, a large one does not
    assert flash_num_splits(1, 4, 128, 2048, 128) > 1 and flash_num_splits(1, 4, 128, 128, 64) == 1
    assert flash_num_splits(8, 32, 2048, 2048, 128) == 1


@pytest.mark.parametrize("options", [
    dict(padding="longest"),
    dict(attn="flash_attention_2"),
    dict(attn="flash_attention_2", padding="longest", pad_fraction=0.5),
    dict(attn="flash_attention_2", padding_free=True, ac_every=1),
    dict(padding_free=True, ac_every=1, precision="bf16-mixed"),
], ids=str)
def test_analytic_matches_trace_exactly(spec, options):
    workload = build_workload("train", **{**BASE, **options})
    analytic, result = estimate(spec, workload), traced(workload)
    assert analytic.peak_allocated_bytes == pytest.approx(result.peak_allocated_bytes, rel=2e-4)
    assert abs(analytic.phases["forward"]["activations"] - result.phases["forward"]["activations"]) <= 4096


def test_padding_materialises_the_mask_and_flash_attention_unpads(spec):
    plain = traced(build_workload("train", **BASE))
    padded = traced(build_workload("train", **BASE, padding="longest"))
    # the int64 mask, and per layer SDPA's compute-dtype mask and K, V repeated to every head
    layers, b, s = spec.num_layers, BASE["batch"], BASE["seq"]
    mask = 2 * b * s * s
    kv_growth = 2 * 2 * b * s * (spec.q_dim - spec.kv_dim)
    cache_v = 2 * b * s * spec.kv_dim * 2
    assert padded.phases["forward"]["inputs"] - plain.phases["forward"]["inputs"] == 8 * b * s
    assert padded.phases["forward"]["activations"] - plain.phases["forward"]["activations"] == layers * (
        mask + kv_growth + cache_v)
    flash = traced(build_workload("train", **BASE, attn="flash_attention_2", padding="longest", pad_fraction=0.5))
    assert any("emulated byte for byte" in note for note in flash.notes)
    assert any("64 of 128 tokens" in note for note in flash.notes)


def test_cli_takes_the_new_options(capsys):
    code = main(["estimate", "debug", "--task", "train", "--precision", "bf16", "--optimizer", "adamw", "--batch", "2",
                 "--seq", "128", "--attn", "flash_attention_2", "--padding", "longest", "--pad-fraction", "0.25"])
    out = capsys.readouterr().out
    assert code == 0
    assert "flash_attention_2 · padded (0.25 padding)" in out
    assert main(["estimate", "debug", "--task", "train", "--precision", "fp32", "--attn", "flash_attention_2"]) == 1
    assert main(["estimate", "debug", "--task", "lora", "--precision", "bf16", "--batch", "4", "--seq", "64",
                 "--padding-free"]) == 0
    assert "padding-free" in capsys.readouterr().out


def test_pad_fraction_under_sdpa_says_it_changes_nothing(capsys):
    args = ["estimate", "debug", "--task", "train", "--precision", "bf16", "--optimizer", "adamw", "--batch", "2",
            "--seq", "128", "--padding", "longest"]
    assert main([*args, "--json"]) == 0
    plain = json.loads(capsys.readouterr().out)
    assert main([*args, "--pad-fraction", "0.25", "--json"]) == 0
    padded = json.loads(capsys.readouterr().out)
    assert padded["peak_allocated_bytes"] == plain["peak_allocated_bytes"]
    assert any("--pad-fraction 0.25 does not change these figures: sdpa attention" in n for n in padded["notes"])
    assert main(["estimate", "debug", "--task", "lora", "--precision", "bf16", "--batch", "1", "--seq", "64",
                 "--padding-free"]) == 0
    assert "1 sequence of 64 tokens" in capsys.readouterr().out


@pytest.mark.parametrize("task, options", [
    ("train", dict(precision="bf16-mixed")),
    ("train", dict(precision="bf16")),
    ("lora", dict(precision="bf16")),
], ids=str)
def test_liger_kernels_match_the_trace(spec, task, options):
    workload = build_workload(task, **{**BASE, **options, "liger": True})
    analytic, result = estimate(spec, workload), traced(workload)
    assert analytic.peak_allocated_bytes == result.peak_allocated_bytes
    assert analytic.phases["forward"] == result.phases["forward"]
    assert any("RMSNorm, SwiGLU and RoPE emulated byte for byte" in note for note in result.notes)
    assert not any("not sized" in note for note in analytic.notes)


def test_liger_kernels_allocate_what_their_source_allocates():
    """Liger's RMSNorm: Y and the fp32 rstd in forward; in backward dX written into dY and an fp32
    (SMs x h) partial weight gradient, its sum and the sum's cast. SwiGLU: the product only."""
    import torch

    from llamem.trace.liger_kernels import LIGER_NUM_SMS, EmulatedLigerRMSNorm, EmulatedLigerSiLUMul
    from llamem.trace.tracer import StorageTracer

    rows, hidden = 64, 256
    with StorageTracer() as tracer:
        x = torch.randn(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
        weight = torch.ones(hidden, dtype=torch.bfloat16, requires_grad=True)
        grad = torch.ones(rows, hidden, dtype=torch.bfloat16)
        before = len(tracer.records)
        y = EmulatedLigerRMSNorm.apply(x, weight, 1e-6)
        forward = [record.nbytes for record in tracer.records[before:]]
        before = len(tracer.records)
        y.backward(grad)
        backward = [record.nbytes for record in tracer.records[before:]]
    assert forward == [2 * rows * hidden, 4 * rows]
    assert backward[:3] == [4 * LIGER_NUM_SMS * hidden, 4 * hidden, 2 * hidden]  # then x.grad
    with StorageTracer() as tracer:
        gate, up = (torch.randn(rows, hidden, requires_grad=True) for _ in range(2))
        before = len(tracer.records)
        EmulatedLigerSiLUMul.apply(gate, up)
    assert [r.nbytes for r in tracer.records[before:]] == [4 * rows * hidden]
