"""Mixture-of-experts layers: what transformers 5.24 allocates around its experts.

Mixtral and Qwen3-MoE (`MixtralSparseMoeBlock`, `Qwen3MoeSparseMoeBlock`) route each of the T = batch * seq
tokens to k of E experts, and their fused experts (`@use_experts_implementation`) run
`integrations/moe.py:grouped_mm_experts_forward`: transformers picks "grouped_mm" by default
(`get_correct_experts_implementation`) on CPU (torch > 2.10) and CUDA (sm80+) alike, and on both
`torch.nn.functional.grouped_mm` runs, so the same tensors exist on either device. With S = T * k
token-expert pairs, E experts of width I, h hidden and e the compute dtype's bytes, autograd keeps per layer:

- the router: its fp32 softmax (4 T E), top-k indices (8 T k); Mixtral (and Qwen3-MoE with
  `norm_topk_prob`) renormalise the top-k weights in place, keeping the original (4 T k) and the sum (4 T);
- the dispatch: the sort permutation, its token index (perm // k) and the inverse permutation
  (8 S each), the permuted routing weights (S, fp32 for Mixtral, whose router never casts back; e for
  Qwen3-MoE), the offsets (4 E, int32);
- the experts: gate_up's output (e S 2I, kept whole by silu and the product through their chunk views),
  silu(gate) (e S I), the experts' output (e S h, for the routing weights' gradient); when the expert
  weights train, also the gathered tokens (e S h) and the product (e S I), the grouped matmuls' inputs
  for their weights' gradients.

Every one of these is sized by S, never by how many tokens each expert receives: grouped_mm runs one
kernel over the sorted pairs, so the memory does not depend on the routing (the per-expert loop
`eager` path would, and is not what transformers runs). The trace's random routing therefore
gives the same bytes as any other route, and the accuracy rows compare like with like.

Llama 4 (`llama4_text`) is sized apart (`llama4.py`, `llama4_moments.py`): its MoE block is not this grouped_mm
path but `Llama4TextMoe`, where every expert sees every token (the input repeated E times, two torch.bmm over
the E experts, sigmoid router scores, a shared expert beside them), so its tensors are E T wide and its worst
moments lie inside the blocks; its attention (RoPE as complex fp32 products, L2 q/k norms, chunked masks,
temperature tuning on the NoPE layers) differs too. What no accuracy row holds is refused by name there.

`output_router_logits` (default False in every config class) would keep every layer's router logits
for the auxiliary loss: not modelled, so refused. LoRA on the fused 3-D experts is `--lora-targets experts`
(peft's `target_parameters`, `moe_lora.py`); attention targets are sized as for a dense model.
"""

from __future__ import annotations

from llamem.analytic.common import r512, trains_base_weights
from llamem.analytic.llama4 import problems as llama4_problems
from llamem.analytic.moe_lora import (adapts_experts, expert_lora_problems, expert_lora_saved_bytes,
                                      frozen_router_saved_bytes)
from llamem.dtypes import DTYPE_BYTES
from llamem.errors import InvalidWorkload
from llamem.model import ModelSpec
from llamem.workload import Workload, with_changes

_MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")


def check_moe(spec: ModelSpec, workload: Workload, role: str = "model") -> None:
    """Refuse what the analytic engine does not size for a mixture of experts, naming the fix."""
    problems = moe_problems(spec, workload, role)
    if problems:
        raise InvalidWorkload(problems)


def moe_problems(spec: ModelSpec, workload: Workload, role: str = "model") -> list[str]:
    """What the analytic engine does not size for this mixture of experts (none for a dense model); the
    planner leaves such settings out of its search."""
    if not spec.is_moe or (adapts_experts(workload) and spec.model_type == "llama4_text"):
        return expert_lora_problems(spec, workload, analytic=True)
    problems = transformers_moe_problems(spec, workload)
    if spec.model_type == "llama4_text":  # its own terms (`llama4.py`) and what they are not held to the trace for
        problems += llama4_problems(spec, workload, role)
    if spec.config.get("output_router_logits"):
        problems.append(f"{spec.name} ({role}) sets output_router_logits: every layer's router logits kept for "
                        "the auxiliary loss are not modelled; use `llamem trace`, or set it false")
    mlp_targets = [t for t in workload.lora_targets if t in _MLP_TARGETS]
    if workload.uses_adapters and mlp_targets and spec.model_type != "llama4_text":
        problems.append(f"--lora-targets {','.join(mlp_targets)}: {spec.name}'s experts are fused 3-D parameters, "
                        "not Linear modules: adapt them with --lora-targets experts (peft's target_parameters), "
                        "and adapt attention with q_proj,k_proj,v_proj,o_proj")
    for flag, on in _unverified_settings(workload):
        if on:
            problems.append(f"{flag} with a mixture of experts is not modelled by the analytic engine: "
                            f"use `llamem trace` or drop {flag}")
    return problems


def _unverified_settings(w: Workload) -> tuple[tuple[str, bool], ...]:
    """Settings whose combination with experts no accuracy row holds to the trace yet."""
    return (("--compile", w.compile), ("--liger", w.liger), ("--offload-activations", w.offload_activations),
            (f"--ac {w.ac_mode}", w.ac_every > 0 and w.ac_mode != "full"),
            ("--optimizer-in-backward", w.optimizer_in_backward), (f"--padding {w.padding}", w.padding != "none"),
            ("--padding-free", w.padding_free), (f"--attn {w.attn}", w.attn not in ("sdpa", "eager")),
            ("--task distill", w.task == "distill"))


def transformers_moe_problems(spec: ModelSpec, workload: Workload) -> list[str]:
    """Workloads a mixture of experts cannot run as transformers builds it (both engines refuse them). Its
    fused experts (MixtralExperts, Qwen3MoeExperts) run torch's grouped_mm by default, which takes bf16 only
    (torch.nn.functional.grouped_mm); bitsandbytes quantizes nn.Linear modules, not fused 3-D experts."""
    if not spec.is_moe:
        return expert_lora_problems(spec, workload)
    problems = []
    if workload.weight_dtype != "bf16" and spec.model_type != "llama4_text":
        problems.append(f"{spec.model_type} runs its experts with torch's grouped_mm, which takes bf16 only: "
                        f"use --precision bf16 (the weights are {workload.weight_dtype})")
    if workload.quant != "none":
        problems.append("quantized mixture-of-experts weights are not modelled (bitsandbytes quantizes Linear "
                        "modules, not fused experts): use --quant none")
    return problems


def _normalises_top_k(spec: ModelSpec) -> bool:
    """Mixtral always divides the top-k weights by their sum; Qwen3-MoE when its config says so."""
    return spec.model_type == "mixtral" or bool(spec.config.get("norm_topk_prob", False))


def moe_saved_bytes(spec: ModelSpec, workload: Workload, trains: bool, needs_grad: bool) -> int:
    """What autograd keeps of one mixture-of-experts block (router, dispatch, experts; not its input,
    which the router's Linear keeps like any MLP input). `trains`: the block's weights train (adapted
    experts add their adapted weights, `moe_lora.py`); `needs_grad`: its input needs a gradient."""
    if adapts_experts(workload) and not (trains or needs_grad):
        return frozen_router_saved_bytes(spec, workload, routing_weight_bytes(spec, workload))
    trains = trains or adapts_experts(workload)
    if not (trains or needs_grad):
        return 0
    T, k, E, I, h = workload.batch * workload.seq, spec.experts_per_token, spec.num_experts, \
        spec.moe_intermediate_size, spec.hidden_size
    S, e = T * k, int(DTYPE_BYTES[workload.compute_dtype])
    router = r512(4 * T * E) + r512(8 * T * k)
    if _normalises_top_k(spec):
        router += r512(4 * T * k) + r512(4 * T)
    dispatch = 3 * r512(8 * S) + r512(routing_weight_bytes(spec, workload) * S) + r512(4 * E)
    experts = r512(e * S * 2 * I) + r512(e * S * I) + r512(e * S * h)
    if trains:
        experts += r512(e * S * h) + r512(e * S * I)
    return router + dispatch + experts + expert_lora_saved_bytes(spec, workload)


def routing_weight_bytes(spec: ModelSpec, workload: Workload) -> int:
    """Bytes of one routing weight: Mixtral's stay fp32 (its router never casts back, so the weighted expert
    outputs promote to fp32 too); Qwen3-MoE casts them to the compute dtype."""
    return 4 if spec.model_type == "mixtral" else int(DTYPE_BYTES[workload.compute_dtype])


def moe_consumed_bytes(spec: ModelSpec, workload: Workload, at_gate_up: bool) -> int:
    """What a block's saved set has lost in its backward (`moe_backward.py`): by the gate's (silu and
    product) backward the experts' output, the permuted routing weights, the inverse permutation and the
    product (when the experts train, down's grouped_mm kept it); by gate_up's also gate_up's output and
    silu(gate)."""
    S, e = workload.batch * workload.seq * spec.experts_per_token, int(DTYPE_BYTES[workload.compute_dtype])
    I = spec.moe_intermediate_size
    product = r512(e * S * I) if (trains_base_weights(workload) or adapts_experts(workload)) else 0
    consumed = r512(e * S * spec.hidden_size) + r512(routing_weight_bytes(spec, workload) * S) + r512(8 * S) + product
    return consumed + (r512(e * S * 2 * I) + r512(e * S * I) if at_gate_up else 0)


def moe_input_readers(spec: ModelSpec) -> tuple[str, ...]:
    """The Linear modules that read a mixture-of-experts block's input: the router, never a LoRA target (Llama 4's
    router and its shared expert's gate and up projections)."""
    return ("router", "gate_proj", "up_proj") if spec.model_type == "llama4_text" else ("gate",)


def moe_forward_temporaries(spec: ModelSpec, workload: Workload, tokens: int) -> int:
    """The largest set of a mixture-of-experts block's own tensors alive at once in a forward without
    autograd (prefill), beyond its input: for grouped_mm, the routing (router logits, top-k weights and indices) and
    the dispatch the experts function keeps in locals to its end (sorted expert ids, permutation, gathered
    tokens, permuted weights, histc's float input, counts, offsets), then the worst of: the gate (gate_up's
    output, silu(gate), the product), the down projection (the product and its output), the reordering
    (the output, its weighted copy and the reordered one, the inverse permutation)."""
    held, gate, down, reorder = moe_forward_stages(spec, workload, tokens)
    return held + max(gate, down, reorder)


def moe_forward_stages(spec: ModelSpec, workload: Workload, tokens: int) -> tuple[int, int, int, int]:
    """`moe_forward_temporaries`' parts: (routing and dispatch, held throughout; the gate; the down
    projection; the reordering)."""
    T, k, E, I, h = tokens, spec.experts_per_token, spec.num_experts, spec.moe_intermediate_size, spec.hidden_size
    S, e = T * k, int(DTYPE_BYTES[workload.compute_dtype])
    w = routing_weight_bytes(spec, workload)
    routing = r512(e * T * E) + r512(w * T * k) + r512(8 * T * k)  # the block binds the router logits to `_`
    dispatch = 2 * r512(8 * S) + r512(e * S * h) + r512(w * S) + r512(4 * S) + 2 * r512(4 * E)
    gate = r512(e * S * 2 * I) + 2 * r512(e * S * I)
    down = r512(e * S * I) + r512(e * S * h)
    reorder = r512(e * S * h) + 2 * r512(w * S * h) + r512(8 * S)
    return routing + dispatch, gate, down, reorder


def moe_allows(spec: ModelSpec, workload: Workload, changes: dict) -> bool:
    """Whether the analytic engine sizes `workload` with `changes` for this model (always for a dense one):
    the planner's filter of the techniques and knobs it tries."""
    if not spec.is_moe:
        return True
    return not moe_problems(spec, with_changes(workload, **changes))
