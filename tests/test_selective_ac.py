"""Selective activation checkpointing (`--ac selective`, `--ac selective-every-K`): torchtitan's
per-op policy, traced with `create_selective_checkpoint_contexts` and sized analytically."""

import pytest

from llamem.analytic import estimate
from llamem.analytic.selective import layer_matmuls, saved_matmuls, selective_kept_bytes
from llamem.cli import main
from llamem.cost import recompute_flops_per_token
from llamem.errors import InvalidWorkload
from llamem.model import load_model
from llamem.techniques import workload_args, workload_code
from llamem.workload import build_workload, parse_ac_fields

SPELLINGS = ["none", "full", "every-2", "every-3", "selective", "selective-every-2", "selective-every-4"]


@pytest.mark.parametrize("text", SPELLINGS)
def test_ac_spellings_round_trip(text):
    w = build_workload(task="train", **parse_ac_fields(text))
    assert w.ac_label == text
    assert workload_args(w)[workload_args(w).index("--ac") + 1] == text


def test_selective_fields():
    assert parse_ac_fields("selective") == {"ac_every": 1, "ac_mode": "selective"}
    assert parse_ac_fields("Selective-Every-3") == {"ac_every": 3, "ac_mode": "selective"}
    assert parse_ac_fields("every-3") == {"ac_every": 3}
    with pytest.raises(InvalidWorkload, match="needs layers to checkpoint"):
        build_workload(task="train", ac_every=0, ac_mode="selective")


@pytest.mark.parametrize("text", ["selective-2", "selective-full", "selective-none", "selective-every-0", "partial"])
def test_bad_spellings_exit_1_naming_the_valid_ones(capsys, text):
    assert main(["estimate", "debug", "--ac", text]) == 1
    err = capsys.readouterr().err
    assert "write none, full, or every-K" in err and "or selective, or selective-every-K" in err
    assert "Traceback" not in err


def test_selective_is_refused_for_inference_once(capsys):
    assert main(["estimate", "debug", "--task", "infer", "--ac", "selective"]) == 1
    assert capsys.readouterr().err.count("--ac only applies to") == 1


def test_the_policy_keeps_every_other_matmul_and_attention():
    spec = load_model("debug")  # h 256, q 256, kv 128, I 688, 4 heads
    w = build_workload(task="train", precision="bf16", batch=2, seq=1024, ac_every=1, ac_mode="selective")
    assert [name for name, _, _ in saved_matmuls(spec, w)] == ["q_proj", "v_proj", "gate_proj", "down_proj"]
    # q, v, gate, down, SDPA's output (bf16) and logsumexp (fp32), per token
    assert selective_kept_bytes(spec, w) == 2048 * (2 * (256 + 128 + 688 + 256 + 256) + 4 * 4)
    lora = build_workload(task="lora", lora_targets=("q_proj", "v_proj"), ac_every=1, ac_mode="selective")
    names = [name for name, _, _ in layer_matmuls(spec, lora)]
    assert names[:4] == ["q_proj", "q_proj.lora_A", "q_proj.lora_B", "k_proj"]
    assert [name for name, _, _ in saved_matmuls(spec, lora)] == [
        "q_proj", "q_proj.lora_B", "v_proj", "v_proj.lora_B", "gate_proj", "down_proj"]


def test_biased_projections_are_kept_and_not_counted():
    # Qwen2's q, k and v carry a bias: they run addmm (on the save list, outside the matmul count).
    spec = load_model("qwen2.5-7b")
    w = build_workload(task="train", ac_every=1, ac_mode="selective")
    assert [name for name, _, _ in saved_matmuls(spec, w)] == ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"]


def test_recompute_flops_follow_the_policy():
    spec = load_model("llama-3.2-3b")
    full = build_workload(task="train", ac_every=1)
    selective = build_workload(task="train", ac_every=1, ac_mode="selective")
    every_2 = build_workload(task="train", ac_every=2, ac_mode="selective")
    shapes = spec.layer_linear_shapes()
    recomputed = sum(a * b for a, b in (shapes["k_proj"], shapes["o_proj"], shapes["up_proj"]))
    assert recompute_flops_per_token(spec, selective) == 2 * recomputed * spec.num_layers
    assert recompute_flops_per_token(spec, every_2) == 2 * recomputed * spec.num_layers // 2
    assert recompute_flops_per_token(spec, selective) < 0.35 * recompute_flops_per_token(spec, full)


@pytest.mark.parametrize("task", ["train", "lora"])
def test_selective_lies_between_none_and_full(task):
    spec = load_model("debug")
    peaks = [estimate(spec, build_workload(task=task, batch=4, seq=1024, **parse_ac_fields(text))).peak_allocated_bytes
             for text in ("none", "selective", "full")]
    assert peaks[0] > peaks[1] > peaks[2]


TRACED = [
    dict(task="train", precision="bf16", batch=2, seq=512, ac_every=1),
    dict(task="train", batch=1, seq=512, ac_every=2),
    dict(task="lora", batch=1, seq=512, ac_every=1),
    dict(task="qlora", batch=1, seq=512, ac_every=1),
]


@pytest.mark.parametrize("options", TRACED, ids=lambda o: f"{o['task']}-{o.get('precision', 'default')}-{o['ac_every']}")
def test_trace_and_analytic_agree(options):
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    from llamem.trace.run import trace

    spec = load_model("debug")
    w = build_workload(**options, ac_mode="selective")
    traced, analytic = trace(spec, w), estimate(spec, w)
    assert abs(analytic.peak_allocated_bytes / traced.peak_allocated_bytes - 1) <= 0.02


def test_the_planner_chooses_selective_when_it_is_enough():
    from llamem.gpus import budget_gpu
    from llamem.plan import make_plan
    from llamem.units import GiB

    # Without torch.compile (not sized with selective checkpointing; with it the planner compiles instead).
    # 0.57 GiB: selective-every-2 does not fit (up to 0.6 it does), full checkpointing is not needed (0.55).
    plan = make_plan(load_model("debug"), build_workload(task="lora", batch=8, seq=4096), budget_gpu(int(0.57 * GiB)),
                     host_budget_bytes=0, runnable=lambda spec, w, layout: not w.compile)
    assert plan.fits and plan.final.workload.ac_label == "selective"
    assert "--ac selective" in plan.command


def test_code_applies_the_policy():
    code = workload_code(build_workload(task="train", ac_every=2, ac_mode="selective"))
    assert any('"context_fn": selective_ac_context' in a and '"every_n_layers": 2' in a for a in code.training_args)
    assert "def selective_ac_context():" in code.after_load


def test_the_written_policy_runs_and_keeps_the_gradients():
    torch = pytest.importorskip("torch")
    from transformers import LlamaConfig, LlamaForCausalLM

    from llamem.techniques import SELECTIVE_AC_CODE

    namespace = {"torch": torch}
    exec("\n".join(SELECTIVE_AC_CODE), namespace)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    plain = LlamaForCausalLM(config)
    checkpointed = LlamaForCausalLM(config)
    checkpointed.load_state_dict(plain.state_dict())
    checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs={
        "use_reentrant": False, "early_stop": False, "context_fn": namespace["selective_ac_context"]})
    ids = torch.randint(0, 512, (2, 32))
    for model in (plain, checkpointed):
        model.train()
        model(input_ids=ids, labels=ids).loss.backward()
    grads = [m.model.layers[0].mlp.up_proj.weight.grad for m in (plain, checkpointed)]
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
