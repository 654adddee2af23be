"""LoRA on a mixture of experts' fused 3-D expert weights, as peft 0.21 applies it (`target_parameters`).

`--lora-targets ...,experts` adapts each MoE layer's `experts.gate_up_proj` (E x 2I x h) and `experts.down_proj`
(E x h x I), the parameters of MixtralExperts and Qwen3MoeExperts. peft wraps each in a `ParamWrapper`
(tuners/lora/layer.py; the second wraps the first) with, for a parameter of E experts mapping `in` to `out`:
lora_A, a Linear(in, r E) (weight r E x in), and lora_B, a Linear(r E, out) (weight out x r E), fp32 like
every adapter. Per MoE layer that is r E (2h + 3I) trainable elements, whose gradients and optimizer state
follow as for any adapter.

Each forward, `ParamWrapper._activate_lora` parametrizes the expert weight with `_LoraFactorsProxy` (one
adapter, bf16 weights): the two factors cast to the weight's dtype (lhs E x out x r, rhs E x r x in), then
`baddbmm(W, lhs, rhs)`, a new E x out x in tensor: the adapted weight, materialised whole, once per forward
(`parametrize.cached()`). Autograd keeps, per MoE layer until its backward:
- both adapted weights (e E 2I h + e E h I, e the weights' bytes): grouped_mm saves its weight for its
  input's gradient; as large as the layer's expert weights themselves;
- the four cast factors, baddbmm's saved inputs (the trace counts them as weights/autocast_copies);
- the grouped matmuls' inputs (the gathered tokens, the SwiGLU product), as in full fine-tuning, since the
  adapted weights need gradients (`moe.py:moe_saved_bytes`).
A checkpointed layer keeps none of them: its recompute makes them again in backward.

In backward (`moe_backward.py`), down's grouped_mm makes the adapted down weight's gradient (e E h I) while
that weight is still saved: the "down" moment, the worst of a LoRA layer with adapted experts; gate_up's
makes its own (e E 2I h) once down's adapted weight is freed. baddbmm's backward turns each into the
factors' small gradients, and the full-size gradient dies.

A checkpointed layer's forward keeps nothing for backward, but while its experts run it holds what a forward
without autograd holds (`moe.py:moe_forward_stages`) and the adapted weights, built whole on first use and
cached to the experts' end: gate_up's from the gate on, down's from the down projection on, both through the
reordering, with this layer's cast factors (`expert_lora_forward_moments`).
"""

from __future__ import annotations

from llamem.analytic.common import r512
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import LORA_EXPERTS, Workload

EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")
"""The fused expert weights of MixtralExperts and Qwen3MoeExperts (and Llama 4's), adapted together."""


def adapts_experts(workload: Workload) -> bool:
    """Whether the workload's adapters include the fused expert weights."""
    return workload.uses_adapters and LORA_EXPERTS in workload.lora_targets


def lora_linear_targets(workload: Workload) -> tuple[str, ...]:
    """The adapted Linear modules: every target but the experts."""
    return tuple(t for t in workload.lora_targets if t != LORA_EXPERTS)


def peft_target_parameters(workload: Workload) -> tuple[str, ...]:
    """peft's `target_parameters` (matched as name suffixes): the experts' two fused weights, or none."""
    return tuple(f"experts.{name}" for name in EXPERT_PARAMETERS) if adapts_experts(workload) else ()


def expert_lora_problems(spec: ModelSpec, workload: Workload, analytic: bool = False) -> list[str]:
    """`experts` names a mixture of experts' fused weights: a dense model has none (both engines refuse);
    Llama 4's (`Llama4TextExperts`, every expert on every token) the analytic engine does not size adapted."""
    if not adapts_experts(workload):
        return []
    if not spec.is_moe:
        return [(f"--lora-targets {LORA_EXPERTS}: {spec.name} is a dense model, without fused expert weights; "
                 "adapt its MLP linears instead (gate_proj,up_proj,down_proj)")]
    if analytic and spec.model_type == "llama4_text":
        return [(f"--lora-targets {LORA_EXPERTS} on {spec.name}: the analytic engine sizes adapted experts for "
                 f"Mixtral and Qwen3-MoE; use `llamem trace {spec.hf_id or spec.name} ...`, which runs peft's "
                 "target_parameters on the transformers model")]
    return []


def expert_adapter_matrices(spec: ModelSpec, workload: Workload) -> list[tuple[int, int]]:
    """(columns, rows) of one MoE layer's expert adapters in peft's parameter order: gate_up's lora_A
    (r E x h) and lora_B (2I x r E), then down's (r E x I, h x r E)."""
    if not adapts_experts(workload):
        return []
    stacked, h, I = workload.lora_rank * spec.num_experts, spec.hidden_size, spec.moe_intermediate_size  # r E
    return [(h, stacked), (stacked, 2 * I), (I, stacked), (stacked, h)]


def adapted_weight_bytes(spec: ModelSpec, workload: Workload) -> tuple[int, int]:
    """(gate_up, down): bytes of one MoE layer's materialised adapted expert weights (baddbmm's outputs)."""
    e, E, h, I = int(DTYPE_BYTES[workload.weight_dtype]), spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    return r512(e * E * 2 * I * h), r512(e * E * h * I)


def factor_copy_bytes(spec: ModelSpec, workload: Workload) -> tuple[int, int]:
    """(gate_up, down): one MoE layer's adapter factors cast to the weights' dtype, kept by baddbmm."""
    e = int(DTYPE_BYTES[workload.weight_dtype])
    gate_up_a, gate_up_b, down_a, down_b = (r512(e * c * r) for c, r in expert_adapter_matrices(spec, workload))
    return gate_up_a + gate_up_b, down_a + down_b


def expert_lora_saved_bytes(spec: ModelSpec, workload: Workload) -> int:
    """What autograd keeps of one MoE layer's adapted weights: both materialised weights (the cast factors
    are counted as weight copies, `expert_copies_kept_bytes`)."""
    return sum(adapted_weight_bytes(spec, workload)) if adapts_experts(workload) else 0


def frozen_router_saved_bytes(spec: ModelSpec, workload: Workload, routing_bytes: int) -> int:
    """What one MoE block keeps when only its adapted experts need gradients (its input needs none: layer 0
    without attention adapters): no router, no gathered token index, no experts' output (the routing weights
    need no gradient); the gathered tokens and the product for the adapted weights' gradients, the gate's
    saved pair, the permuted routing weights, the inverse permutation, the offsets, and only down's adapted
    weight (gate_up's input needs no gradient, so its grouped_mm keeps no weight)."""
    S, E = workload.batch * workload.seq * spec.experts_per_token, spec.num_experts
    e, h, I = int(DTYPE_BYTES[workload.compute_dtype]), spec.hidden_size, spec.moe_intermediate_size
    dispatch = r512(8 * S) + r512(routing_bytes * S) + r512(4 * E)
    experts = r512(e * S * h) + r512(e * S * 2 * I) + 2 * r512(e * S * I)
    return dispatch + experts + adapted_weight_bytes(spec, workload)[1]


def expert_copies_kept_bytes(spec: ModelSpec, workload: Workload, layers: range | None = None) -> int:
    """The cast factors kept by the MoE layers in `layers` (all by default) that are not checkpointed."""
    if not adapts_experts(workload):
        return 0
    layers = range(spec.num_layers) if layers is None else layers
    every = workload.ac_every
    kept = [i for i in layers if i in set(spec.moe_layers) and not (every and i % every == 0)]
    return len(kept) * sum(factor_copy_bytes(spec, workload))


def expert_lora_stage_terms(spec: ModelSpec, workload: Workload, index: int, stage: str) -> dict[str, int]:
    """What adapted experts add to MoE layer `index`'s backward moment `stage` (`moe_backward.py`):
    "down", down's grouped_mm making its adapted weight's gradient, with the product and every cast factor
    still kept; "gate" and "gate_up", after down's baddbmm, which freed down's adapted weight and its factors
    and made down's adapter gradients; "gate_up" also makes its adapted weight's gradient."""
    if not adapts_experts(workload):
        return {}
    gate_up, down = adapted_weight_bytes(spec, workload)
    gate_up_copies, down_copies = factor_copy_bytes(spec, workload)
    copies = expert_copies_kept_bytes(spec, workload, range(index)) + gate_up_copies
    if stage == "down":
        product = r512(int(DTYPE_BYTES[workload.compute_dtype]) * workload.batch * workload.seq
                       * spec.experts_per_token * spec.moe_intermediate_size)
        return {"weights/autocast_copies": copies + down_copies, "activations": product, "temporaries": down}
    down_adapters = expert_adapter_matrices(spec, workload)[2:]  # fp32, made by down's baddbmm backward
    grads = 0 if workload.grad_accum > 1 else sum(r512(4 * columns * rows) for columns, rows in down_adapters)
    return {"weights/autocast_copies": copies, "activations": -down, "gradients": grads,
            "temporaries": gate_up if stage == "gate_up" else 0}


def last_checkpointed_moe_layer(spec: ModelSpec, workload: Workload) -> int | None:
    """The highest checkpointed MoE layer, where a forward with adapted experts holds the most: every layer below
    has kept its saved set, or its input when checkpointed. None without adapted experts or checkpoints."""
    if not (adapts_experts(workload) and workload.ac_every):
        return None
    checkpointed = [i for i in spec.moe_layers if i % workload.ac_every == 0]
    return max(checkpointed) if checkpointed else None


def expert_lora_forward_moments(spec: ModelSpec, workload: Workload, held_bytes: int,
                                stages: tuple[int, int, int, int]) -> list[dict[str, int]]:
    """A checkpointed MoE layer's forward with adapted experts (traced): `held_bytes`, the activations alive as
    its experts run, and `stages` (`moe_forward_stages`: routing and dispatch, gate, down, reordering). At the
    gate, gate_up's adapted weight and its cast factors; from the down projection on, both adapted weights and
    every cast factor of the layer (the adapted weights are counted as activations, as the trace does)."""
    routing, gate, down, reorder = stages
    gate_up_weight, down_weight = adapted_weight_bytes(spec, workload)
    gate_up_copies, down_copies = factor_copy_bytes(spec, workload)
    at_gate = {"weights/autocast_copies": gate_up_copies, "activations": held_bytes + routing + gate + gate_up_weight}
    after = {"weights/autocast_copies": gate_up_copies + down_copies,
             "activations": held_bytes + routing + max(down, reorder) + gate_up_weight + down_weight}
    return [at_gate, after]
