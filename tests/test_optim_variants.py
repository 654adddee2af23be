"""AdamW's three steps, clipping, the optimizer step in backward and Liger's fused linear
cross-entropy: the analytic engine against the trace engine on a tiny model, the command-line
spellings, and the combinations refused with the flag that fixes them.

Liger's kernels need Triton on a GPU: the trace engine emulates them byte for byte and says so.
"""

from __future__ import annotations

import contextlib
import io

import pytest
import torch

from llamem.analytic import estimate
from llamem.analytic.common import r512
from llamem.analytic.liger import liger_chunk_rows, next_power_of_two
from llamem.analytic.weights import trainable_numels
from llamem.cli import main
from llamem.errors import InvalidWorkload
from llamem.model import load_model
from llamem.trace.run import trace
from llamem.workload import build_workload

TINY = {"num_hidden_layers": 2}
"""The `debug` preset (hidden 256, vocabulary 1024, untied head) cut to two layers."""
TIED = {"num_hidden_layers": 2, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def spec():
    return load_model("debug", overrides=TINY)


def _both(spec, **options):
    w = build_workload(**options)
    return estimate(spec, w), trace(spec, w)


def _phase_temporaries(report, phase="optimizer") -> int:
    return report.phases[phase].get("temporaries", 0)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw-fused", "adamw-loop"])
def test_each_adamw_step_matches_the_trace_at_the_step(spec, optimizer):
    analytic, traced = _both(spec, task="train", optimizer=optimizer, batch=1, seq=64)
    assert analytic.phases["optimizer"] == traced.phases["optimizer"]
    assert analytic.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.02)


def test_step_temporaries_fused_none_foreach_all_loop_one_tensor_at_a_time(spec):
    # fp32 master weights (bf16-mixed), so each step temporary is 4 bytes per parameter
    mixed = dict(batch=1, seq=64, max_grad_norm=0.0, precision="bf16-mixed")
    w = build_workload("train", optimizer="adamw", **mixed)
    sizes = [r512(4 * n) for n in trainable_numels(spec, w)]
    foreach = _phase_temporaries(trace(spec, w))
    fused = _phase_temporaries(trace(spec, build_workload("train", optimizer="adamw-fused", **mixed)))
    loop = _phase_temporaries(trace(spec, build_workload("train", optimizer="adamw-loop", **mixed)))
    assert foreach == sum(sizes)
    assert fused == 0
    # sqrt and its division of one tensor beside the previous tensor's denom: here down_proj after up_proj
    mlp = r512(4 * spec.hidden_size * spec.intermediate_size)
    assert loop == max(2 * s + p for s, p in zip(sizes, [0] + sizes)) == 3 * mlp


def test_clipping_follows_max_grad_norm(spec):
    clipped = trace(spec, build_workload("train", optimizer="adamw-fused", batch=1, seq=64))
    unclipped = trace(spec, build_workload("train", optimizer="adamw-fused", batch=1, seq=64, max_grad_norm=0.0))
    count = len(trainable_numels(spec, build_workload("train")))
    # one 0-dim fp32 norm per gradient, their stack, the total norm
    assert _phase_temporaries(clipped) == count * 512 + r512(4 * count) + 512
    assert _phase_temporaries(unclipped) == 0
    analytic = estimate(spec, build_workload("train", optimizer="adamw-fused", batch=1, seq=64))
    assert analytic.phases["optimizer"] == clipped.phases["optimizer"]


@pytest.mark.parametrize("options", [
    dict(task="train", optimizer_in_backward=True),
    dict(task="train", precision="bf16", optimizer="adamw-loop", optimizer_in_backward=True),
    dict(task="train", optimizer="adamw-fused", optimizer_in_backward=True, ac_every=1),
    dict(task="lora", optimizer_in_backward=True),
])
def test_optimizer_in_backward_matches_the_trace(spec, options):
    analytic, traced = _both(spec, batch=1, seq=64, **options)
    assert "optimizer" not in traced.phases  # every parameter was stepped in backward
    assert analytic.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.02)
    assert any("optimizer in backward" in note for note in traced.notes)


def test_optimizer_in_backward_never_holds_every_gradient(spec):
    plain, stepped = (estimate(spec, build_workload("train", precision="bf16-mixed", optimizer="adamw", batch=1,
                                                    seq=64, **extra)) for extra in ({}, {"optimizer_in_backward": True}))
    all_gradients = plain.phases["optimizer"]["gradients"]
    assert stepped.phases["backward"]["gradients"] < all_gradients
    assert stepped.peak_allocated_bytes < plain.peak_allocated_bytes


@pytest.mark.parametrize("options", [
    dict(task="train"),
    dict(task="train", precision="bf16", batch=2),
    dict(task="lora"),
    dict(task="train", optimizer="adamw-fused", optimizer_in_backward=True),
])
def test_liger_matches_the_trace_and_says_it_is_emulated(spec, options):
    options = {"batch": 1, "seq": 128, **options}
    analytic, traced = _both(spec, liger=True, **options)
    assert analytic.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.02)
    if options["task"] == "train":  # LoRA's forward peaks in the last layer, before the (small) loss
        assert analytic.phases["forward"]["logits"] == pytest.approx(traced.phases["forward"]["logits"], rel=0.05)
    assert any("emulated byte for byte" in note for note in traced.notes)
    assert any("RMSNorm, SwiGLU and RoPE sized from its source" in note for note in analytic.notes)


def test_liger_never_makes_the_full_logits(spec):
    full, liger = (trace(spec, build_workload("train", precision="bf16-mixed", optimizer="adamw", batch=1, seq=256,
                                              liger=flag)) for flag in (False, True))
    logits_bytes = 2 * 256 * spec.vocab_size  # the bf16 logits alone
    assert full.phases["forward"]["logits"] > 4 * logits_bytes  # with their fp32 upcast and log-softmax
    assert liger.phases["forward"]["logits"] < 2 * logits_bytes  # grad_input (fp32) and two chunks


def test_liger_on_a_tied_head_matches_the_trace():
    tied = load_model("debug", overrides=TIED)
    analytic, traced = _both(tied, task="train", liger=True, batch=1, seq=128)
    assert analytic.peak_allocated_bytes == pytest.approx(traced.peak_allocated_bytes, rel=0.02)


def test_liger_chunks_as_its_source_does():
    # BT = 4096 * 4, V = 32000, H = 4096: Liger's own comment gives chunks of 2048 rows
    assert liger_chunk_rows(4096 * 4, 32000, 4096) == 2048
    assert [next_power_of_two(n) for n in (1, 2, 3, 64, 65)] == [1, 2, 4, 64, 128]


def test_in_backward_hooks_step_and_free_each_gradient_on_a_real_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    from llamem.trace.run import make_optimizer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(config)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = make_optimizer(model, build_workload("train", optimizer_in_backward=True), [])
    ids = torch.randint(0, 512, (1, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is None for p in model.parameters())
    assert all(not torch.equal(before[name], p) for name, p in model.named_parameters())
    assert len(optimizer.state) == len(list(model.parameters()))


def _cli(*argv: str) -> tuple[int, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue() + err.getvalue()


def test_adamw_foreach_is_spelt_adamw():
    assert build_workload("train", optimizer="adamw-foreach") == build_workload("train", optimizer="adamw")
    code, text = _cli("estimate", "debug", "--optimizer", "adamw-foreach", "--seq", "64")
    assert code == 0 and "· adamw ·" in text


@pytest.mark.parametrize("optimizer", ["adamw-fused", "adamw-loop", "adamw8bit", "sgd", "adafactor"])
def test_optimizer_spellings_are_accepted(optimizer):
    code, text = _cli("estimate", "debug", "--optimizer", optimizer, "--seq", "64")
    assert code == 0 and f"· {optimizer} ·" in text


def test_optimizer_in_backward_turns_clipping_off_and_reproduces():
    from llamem.techniques import workload_args

    code, text = _cli("estimate", "debug", "--optimizer-in-backward", "--liger", "--seq", "64")
    assert code == 0 and "max-grad-norm 0, optimizer in backward" in text and "liger loss" in text
    args = " ".join(workload_args(build_workload("train", optimizer_in_backward=True, liger=True)))
    assert "--max-grad-norm 0 --optimizer-in-backward" in args and "--liger" in args


@pytest.mark.parametrize(("argv", "message"), [
    (("--optimizer-in-backward", "--grad-accum", "4"), "drop --grad-accum 4"),
    (("--optimizer-in-backward", "--max-grad-norm", "1"), "add --max-grad-norm 0"),
    (("--task", "infer", "--liger"), "--liger only applies to --task train / lora / qlora / distill, not infer"),
    (("--liger", "--loss", "chunked"), "drop --loss chunked"),
    (("--task", "distill", "--teacher", "debug", "--liger"), "drop --liger"),
    (("--max-grad-norm", "-1"), "--max-grad-norm must be a number of 0 or more"),
    (("--optimizer", "adamw-turbo"), "adamw-fused"),
])
def test_refusals_exit_1_naming_the_flag(argv, message):
    code, text = _cli("estimate", "debug", *argv)
    assert code == 1
    assert message in text
    assert "Traceback" not in text


def test_refusals_are_collected_in_the_library():
    with pytest.raises(InvalidWorkload) as err:
        build_workload("train", optimizer_in_backward=True, grad_accum=2, max_grad_norm=1.0)
    assert len(err.value.problems) == 2


def test_trainer_code_for_each_option():
    from llamem.techniques import workload_code

    fused = workload_code(build_workload("train", optimizer="adamw-fused", max_grad_norm=0.5, liger=True))
    assert 'optim="adamw_torch_fused"' in fused.training_args
    assert "max_grad_norm=0.5" in fused.training_args
    assert "use_liger_kernel=True" in fused.training_args and "liger-kernel" in fused.packages
    in_backward = workload_code(build_workload("train", optimizer_in_backward=True))
    assert any("optimizer_in_bwd" in line for line in in_backward.comments)
