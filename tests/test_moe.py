"""Mixtures of experts in the analytic engine (router, grouped_mm dispatch, experts), exact against the trace
on tiny Mixtral and Qwen3-MoE configs; expert parallelism in the per-GPU sizing and the cost model."""

import pytest

from llamem.analytic import estimate
from llamem.analytic.weights import model_weight_bytes
from llamem.errors import InvalidWorkload
from llamem.expert_parallel import active_params, expert_params
from llamem.model import load_model, spec_from_config
from llamem.parallel import ExpertParallelLayout, Layout, check_layout, per_gpu_phases
from llamem.workload import build_workload

BASE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096}
MIXTRAL = spec_from_config(dict(BASE, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2),
                           name="mixtral")
# Layer 0 dense (mlp_only_layers), layer 1 a mixture of 8 experts, top-2, renormalised.
QWEN3_MOE = spec_from_config(dict(BASE, model_type="qwen3_moe", head_dim=16, num_experts=8, num_experts_per_tok=2,
                                  moe_intermediate_size=32, mlp_only_layers=[0], norm_topk_prob=True), name="qwen3_moe")


@pytest.mark.parametrize("spec, options", [
    (MIXTRAL, dict(task="train", precision="bf16", optimizer="sgd", batch=2, seq=64)),  # peaks in an MoE backward
    (MIXTRAL, dict(task="lora", precision="bf16", optimizer="adamw", ac_every=1, batch=1, seq=128)),
    (QWEN3_MOE, dict(task="train", precision="bf16", optimizer="adamw", batch=1, seq=128)),
])
def test_analytic_equals_the_trace_for_mixtures_of_experts(spec, options):
    pytest.importorskip("transformers")
    from llamem.trace.compare import compare

    result = compare(spec, build_workload(**options))
    assert result.analytic_peak_bytes == result.traced_peak_bytes and result.worst_category[1] == 0


def test_generation_of_a_mixture_of_experts_within_a_tenth_of_a_percent():
    # The prefill's experts exact; at this toy width the prompt's int64 position ids (1 KiB), which the dense
    # prefill does not count, are a visible share.
    pytest.importorskip("transformers")
    from llamem.trace.compare import compare

    result = compare(MIXTRAL, build_workload(task="infer", precision="bf16", batch=2, seq=128, new_tokens=2))
    assert result.traced_peak_bytes - result.analytic_peak_bytes == 1024 and result.ok


def test_what_the_analytic_engine_refuses_for_experts_names_the_fix():
    with pytest.raises(InvalidWorkload, match="fused 3-D parameters") as err:
        estimate(MIXTRAL, build_workload(task="lora", precision="bf16", lora_targets=("q_proj", "up_proj")))
    assert "adapt attention" in str(err.value)
    with pytest.raises(InvalidWorkload, match="grouped_mm, which takes bf16 only: use --precision bf16"):
        estimate(MIXTRAL, build_workload(task="train", precision="bf16-mixed", optimizer="adamw"))
    with pytest.raises(InvalidWorkload, match="`llamem trace meta-llama/Llama-4-Scout-17B-16E ...`"):
        estimate(load_model("llama-4-scout-17b-16e"), build_workload(task="infer", precision="bf16", attn="eager"))


def test_expert_parallel_divides_the_experts_and_only_them():
    spec = load_model("mixtral-8x7b")
    assert expert_params(spec) == 32 * 8 * 3 * 14336 * 4096
    assert active_params(spec) == spec.num_params - 32 * 6 * 3 * 14336 * 4096  # 2 of 8 experts per token
    infer = build_workload(task="infer", precision="bf16", batch=1, seq=512, new_tokens=2)
    replicas = per_gpu_phases(spec, infer, Layout(dp=8, sharding="ddp"))["load"]["weights"]
    split = per_gpu_phases(spec, infer, ExpertParallelLayout(dp=8, sharding="ddp", ep=8))["load"]["weights"]
    assert replicas == model_weight_bytes(spec, "bf16")[0]
    assert replicas - split == 32 * 2 * 7 * 3 * 14336 * 4096  # 7 of 8 experts' bf16 gate_up and down gone
    train = build_workload(task="train", precision="bf16", optimizer="adamw", batch=1, seq=512)
    zero1 = per_gpu_phases(spec, train, ExpertParallelLayout(dp=8, sharding="zero1", ep=4))["optimizer"]
    plain = per_gpu_phases(spec, train, Layout(dp=8, sharding="zero1"))["optimizer"]
    saved = 2 * expert_params(spec) * 3 // 4
    assert (plain["weights"] - zero1["weights"], plain["gradients"] - zero1["gradients"]) == (saved, saved)
    assert plain["optimizer"] == zero1["optimizer"]  # ZeRO already shards the fp32 states over every rank


def test_expert_parallel_layouts_are_checked():
    layout = ExpertParallelLayout(dp=4, sharding="ddp", ep=4)
    assert layout.describe() == "ddp x4, ep x4" and Layout(dp=4).ep == 1
    assert "has no experts" in check_layout(load_model("llama-3.1-8b"), layout)[0]
    problems = check_layout(load_model("mixtral-8x7b"), ExpertParallelLayout(dp=6, sharding="zero3", ep=3))
    assert len(problems) == 2 and "does not divide" in problems[0] and "ZeRO-3" in problems[1]


def test_bundles_run_expert_parallelism_over_ddp_only():
    from llamem.bundle.emit import bundle_runs

    spec, w = load_model("mixtral-8x7b"), build_workload(task="train", precision="bf16", optimizer="adamw")
    runs = bundle_runs("any")
    assert runs(spec, w, Layout(dp=8, sharding="zero2"))
    assert not runs(spec, w, ExpertParallelLayout(dp=8, sharding="zero2", ep=8))  # DeepSpeed's AutoEP: not sized
    assert runs(spec, w, ExpertParallelLayout(dp=8, sharding="ddp", ep=8))  # transformers' EP plan beside DDP
