"""Expert parallelism: each of `ep` data-parallel ranks holds 1/ep of every mixture-of-experts layer's experts.

The layout (`ExpertParallelLayout`) carves expert-parallel groups out of the data-parallel ranks, as
Megatron-LM, DeepSpeed-MoE and transformers' `DistributedConfig(ep_size=...)` do: the dense parts
(attention, norms, router, embedding, head) are replicated or sharded as the rest of the layout says,
and a GPU holds E / ep experts of each MoE layer. Its tokens reach the experts that own them by an
all-to-all, and the experts' outputs come back by another (forward; backward the same again).

Per GPU, with P_e the expert parameters and P_d the rest:
- replicas (no ZeRO, DDP): the experts' weights, and in full fine-tuning their gradients and optimizer
  state (which mirror the weights tensor by tensor), are divided by ep;
- ZeRO-1/2 (DeepSpeed's accounting, `parallel.model_state_bytes`): the 2-byte weights (and ZeRO-1's
  gradients) keep 2 (P_d + P_e / ep); what ZeRO already shards over all n ranks (the fp32 states, ZeRO-2's
  gradients) is unchanged: the experts' share is sharded over the n / ep ranks holding the same experts;
- activations: unchanged, with balanced routing: a GPU's experts receive, from the ep ranks of its group,
  on average the T * k token-expert pairs a single GPU routes (the per-pair tensors of `analytic/moe.py`).
  Imbalance adds to the busiest rank; the all-to-all's send and receive buffers are not counted.
ZeRO-3 / FSDP already divide the experts over all n ranks, so expert parallelism saves them nothing here
and is not offered with them (DeepSpeed-MoE refuses ZeRO-3 too); neither is it with tensor parallelism.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llamem.analytic.common import tensor_bytes, trains_base_weights
from llamem.analytic.weights import model_weight_bytes
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import Workload

if TYPE_CHECKING:
    from llamem.parallel import Layout

_MIRRORS = ("gradients", "gradients/ddp_buckets", "optimizer/exp_avg", "optimizer/exp_avg_sq",
            "optimizer/momentum_buffer", "optimizer/state1", "optimizer/state2")
"""Categories that hold one tensor per trainable weight, the weight's size (bf16 experts: bf16 states)."""


def expert_params(spec: ModelSpec) -> int:
    """Routed experts' parameters (gate_up and down of every MoE layer): what expert parallelism divides."""
    return len(spec.moe_layers) * spec.num_experts * 3 * spec.moe_intermediate_size * spec.hidden_size


def active_params(spec: ModelSpec) -> int:
    """Parameters one token's forward multiplies by: k of E experts (Mixtral's and Qwen3-MoE's grouped_mm
    runs only the routed pairs); Llama 4's transformers code runs every expert on every token."""
    if spec.model_type == "llama4_text":
        return spec.num_params
    idle = spec.num_experts - spec.experts_per_token
    return spec.num_params - len(spec.moe_layers) * idle * 3 * spec.moe_intermediate_size * spec.hidden_size


def expert_parallel_problems(spec: ModelSpec, layout: Layout) -> list[str]:
    """What an expert-parallel degree needs, each with the change to make."""
    ep = layout.ep
    if ep == 1:
        return []
    if not spec.is_moe:
        return [f"expert parallel {ep}: {spec.name} has no experts (a dense model): drop --ep"]
    problems = []
    if spec.model_type == "llama4_text":  # every expert sees every token: its E-wide activations are not divided
        problems.append(f"expert parallel {ep}: {spec.name}'s transformers code runs every expert on every token, "
                        "and its expert-wide activations are not sized per expert group: drop --ep")
    if spec.num_experts % ep:
        problems.append(f"expert parallel {ep} does not divide {spec.name}'s {spec.num_experts} experts: choose a "
                        "divisor of it")
    if layout.dp % ep:
        problems.append(f"expert parallel {ep} must divide the {layout.dp} data-parallel ranks it is carved from: "
                        "change --gpus or --ep")
    if layout.sharding == "zero3" or layout.offload != "none" or layout.tp > 1:
        problems.append("expert parallelism is sized with replicas or ZeRO-1/2, without offload or tensor "
                        "parallelism (ZeRO-3 already divides the experts over every rank): use --sharding ddp, "
                        "zero1 or zero2 and drop --offload and --tp")
    return problems


def expert_parallel_phases(phases: dict[str, dict[str, int]], local: ModelSpec, w: Workload,
                           layout: Layout) -> dict[str, dict[str, int]]:
    """`phases` with 1/ep of the experts on this GPU (module docstring)."""
    ep = layout.ep
    if ep == 1:
        return phases
    E = local.num_experts
    freed = len(local.moe_layers) * (_experts_bytes(local, E, w) - _experts_bytes(local, E // ep, w))
    zero = layout.sharding in ("zero1", "zero2") and trains_base_weights(w)
    if zero:  # DeepSpeed's 2-byte weights (and ZeRO-1's gradients) per parameter
        freed = 2 * expert_params(local) * (ep - 1) // ep
    total = model_weight_bytes(local, w.weight_dtype, w.quant)[0]
    out = {}
    for name, breakdown in phases.items():
        b = dict(breakdown)
        b["weights"] = b.get("weights", 0) - freed
        if zero and layout.sharding == "zero1" and "gradients" in b:
            b["gradients"] -= freed
        elif not zero and trains_base_weights(w):
            mirrors = _MIRRORS + (("temporaries",) if name == "optimizer" else ())
            for key in mirrors:
                if key in b:
                    b[key] -= b[key] * freed // total
        out[name] = b
    return out


def _experts_bytes(spec: ModelSpec, experts: int, w: Workload) -> int:
    """One MoE layer's fused gate_up and down tensors holding `experts` experts, in the weight dtype."""
    h, I = spec.hidden_size, spec.moe_intermediate_size
    return tensor_bytes(experts * 2 * I * h, w.weight_dtype) + tensor_bytes(experts * h * I, w.weight_dtype)


def all_to_all_bytes(spec: ModelSpec, w: Workload, ep: int, tokens: int) -> float:
    """Bytes one GPU sends through its group's all-to-alls for `tokens` tokens passing forward once: per MoE
    layer a dispatch and a combine of tokens x k x hidden activations in the compute dtype, (ep-1)/ep of
    them leaving the GPU."""
    if ep == 1:
        return 0.0
    pairs = tokens * spec.experts_per_token * spec.hidden_size * DTYPE_BYTES[w.compute_dtype]
    return len(spec.moe_layers) * 2 * (ep - 1) / ep * pairs
