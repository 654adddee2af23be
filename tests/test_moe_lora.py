"""LoRA on a mixture of experts' fused 3-D experts (`--lora-targets experts`, peft's target_parameters):
the adapter count equals peft's, the analytic engine equals the trace, a dense model is refused by both."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from accuracy import MOE_MODELS, moe_lora_rows, row_workload  # noqa: E402

from llamem.analytic import estimate  # noqa: E402
from llamem.analytic.weights import trainable_numels  # noqa: E402
from llamem.cli import main  # noqa: E402
from llamem.errors import InvalidWorkload  # noqa: E402
from llamem.model import load_model  # noqa: E402
from llamem.techniques import workload_code  # noqa: E402
from llamem.trace.build import build_meta_model  # noqa: E402
from llamem.trace.compare import compare  # noqa: E402
from llamem.workload import build_workload  # noqa: E402

EXPERTS = ("q_proj", "v_proj", "experts")


def lora(**fields):
    return build_workload(**{"task": "lora", "precision": "bf16", "optimizer": "adamw", "lora_targets": EXPERTS,
                             "batch": 1, "seq": 128, **fields})


@pytest.fixture(scope="module")
def mixtral():
    return load_model("mixtral-8x7b", overrides=MOE_MODELS["mixtral-8x7b"])


@pytest.fixture(scope="module")
def qwen3_dense_first():
    return load_model("qwen3-30b-a3b", overrides=MOE_MODELS["qwen3-30b-a3b-dense-first"])


@pytest.mark.parametrize("targets, rank", [(EXPERTS, 8), (("experts",), 16)])
def test_adapter_count_equals_peft(mixtral, qwen3_dense_first, targets, rank):
    for spec in (mixtral, qwen3_dense_first):
        w = lora(lora_targets=targets, lora_rank=rank)
        model = build_meta_model(spec, w)
        assert sum(trainable_numels(spec, w)) == sum(p.numel() for p in model.parameters() if p.requires_grad)
    # Mixtral: per layer r E (2h + 3I) for the experts, r (h + q) + r (h + kv) for q_proj and v_proj
    assert sum(trainable_numels(mixtral, lora())) == 2 * (8 * 8 * (2 * 4096 + 3 * 14336) + 8 * 8192 + 8 * 5120)


def test_adapted_experts_keep_their_materialised_weights(mixtral):
    """Each forward materialises both adapted expert weights (bf16, E x 2I x h and E x h x I) and autograd
    keeps them: the activations grow by exactly that, per MoE layer, over attention-only LoRA."""
    attention = estimate(mixtral, lora(lora_targets=("q_proj", "v_proj"))).phases["forward"]["activations"]
    experts = estimate(mixtral, lora()).phases["forward"]["activations"]
    token_tensors = 2 * (2 * 128 * 2 * 4096 + 2 * 128 * 2 * 14336)  # the grouped matmuls' inputs, kept too
    assert experts - attention == 2 * 2 * 8 * 3 * 14336 * 4096 + token_tensors


@pytest.mark.parametrize("model, options", [moe_lora_rows()[2], moe_lora_rows()[4]],
                         ids=["mixtral-experts-only", "qwen3-ac-full"])
def test_analytic_matches_trace(model, options):
    spec = load_model(model.removesuffix("-dense-first"), overrides=MOE_MODELS[model])
    result = compare(spec, row_workload({**options, "seq": 256}))
    category, error = result.worst_category
    assert result.traced_phase == "backward"
    assert abs(result.traced_peak_bytes - result.analytic_peak_bytes) <= 1024  # the loss's scalar
    assert abs(error) <= 0.05, f"{category} off by {100 * error:+.2f}%"


def test_a_checkpointed_layer_holds_both_adapted_weights_in_forward(mixtral):
    """Under full checkpointing nothing is kept, but the last layer's experts build both adapted weights whole
    and hold them to their end: the forward phase equals the trace's to the byte (it was 2.5 GiB short)."""
    from llamem.trace.run import trace

    w = lora(ac_every=1, seq=512)
    traced, analytic = trace(mixtral, w).phases["forward"], estimate(mixtral, w).phases["forward"]
    assert analytic == traced
    adapted_weights = 2 * 8 * 3 * 14336 * 4096  # bf16 E x 2I x h and E x h x I
    assert analytic["activations"] > adapted_weights


def test_kept_cast_factors_follow_the_checkpointing(mixtral):
    """A plain MoE layer keeps its cast factors, a checkpointed one does not, whatever was estimated before."""
    factors = 2 * (4096 * 64 + 64 * 28672 + 14336 * 64 + 64 * 4096)  # one layer's, bf16
    estimate(mixtral, lora(ac_every=1))
    every_other = estimate(mixtral, lora(ac_every=2)).phases["forward"]
    assert every_other["weights/autocast_copies"] == factors


def test_dense_models_are_refused_by_name(capsys):
    dense = load_model("debug")
    with pytest.raises(InvalidWorkload, match="debug is a dense model, without fused expert weights"):
        estimate(dense, lora())
    with pytest.raises(InvalidWorkload, match="adapt its MLP linears instead"):
        build_meta_model(dense, lora())
    assert main(["trace", "debug", "--task", "lora", "--precision", "bf16", "--optimizer", "adamw",
                 "--lora-targets", "experts", "--batch", "1", "--seq", "8"]) == 1
    assert "--lora-targets experts: debug is a dense model" in capsys.readouterr().err


def test_llama4_experts_are_left_to_the_trace():
    with pytest.raises(InvalidWorkload, match="use `llamem trace meta-llama/Llama-4-Scout-17B-16E ...`"):
        estimate(load_model("llama-4-scout-17b-16e"), lora())


def test_unknown_targets_list_experts_and_moe_linears_point_to_it(mixtral, capsys):
    assert main(["estimate", "mixtral-8x7b", "--task", "lora", "--precision", "bf16", "--optimizer", "adamw",
                 "--lora-targets", "q_proj,expert"]) == 1
    assert "and experts for a mixture of experts' fused expert weights" in capsys.readouterr().err
    with pytest.raises(InvalidWorkload, match="adapt them with --lora-targets experts"):
        estimate(mixtral, lora(lora_targets=("gate_proj",)))


def test_the_code_passes_the_experts_as_target_parameters():
    assert workload_code(lora(lora_targets=("experts",))).after_load == [(
        'model = get_peft_model(model, LoraConfig(r=8, target_modules=[], target_parameters=["experts.gate_up_proj", '
        '"experts.down_proj"], task_type="CAUSAL_LM"))')]


def test_infer_workload_reads_expert_adapters_back():
    """A peft model adapted through target_parameters gives back `experts` among its targets."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import MixtralConfig, MixtralForCausalLM

    from llamem.runtime.infer import infer_workload

    config = MixtralConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    model = get_peft_model(MixtralForCausalLM(config).to(torch.bfloat16), LoraConfig(
        r=4, target_modules=["q_proj"], target_parameters=["experts.gate_up_proj", "experts.down_proj"]))
    inferred = infer_workload(model, batch=1, seq=16)
    assert inferred.workload.lora_targets == ("q_proj", "experts") and inferred.workload.lora_rank == 4
