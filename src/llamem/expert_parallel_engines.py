"""Expert parallelism as the launch bundles run it: transformers 5.24's expert-parallel plan under torch DDP.

`llamem.expert_parallel` sizes the layout as Megatron-LM and DeepSpeed-MoE hold it. With replicas (`--sharding
ddp`) and full fine-tuning, the bundle runs it with transformers' own expert-parallel styles
(`transformers/distributed/expert_parallel.py`): `grouped_gemm` keeps E / ep experts of every fused
gate_up / down tensor on a rank (a DTensor sharded on the expert dimension over the ep group), and
`ep_dispatch_experts` replaces the experts' forward by `AllToAllEP`, which sends each (token, expert) pair to the
rank owning the expert with an all-to-all and brings the outputs back with another. The dense parts stay DDP
replicas; DDP ignores the experts, whose gradients already sum the group's tokens. That run holds, per rank,
beside what `expert_parallel_phases` counts:
- DDP's gradient buckets: the dense gradients only (the generic figure keeps the experts' share in them);
- the mirrors of the weights (gradients, optimizer state): exactly the replicas' less the experts' other shards,
  tensor by tensor, not in proportion to all the weights;
- the optimizer step's temporaries: the experts (DTensors) and the dense weights are two parameter groups (torch's
  foreach kernels take one tensor kind at a time), stepped one after the other: the larger group's, not all;
- per MoE layer, what the dispatch keeps for backward beyond the single-GPU experts' forward
  (`dispatch_saved_bytes`), with balanced routing (each rank receives the S = T k pairs it sends); its
  transients (the all-to-all's send and receive rows) are not counted;
- the loss's backward as a backward moment of its own (`loss_backward`): with fewer gradients it can be the worst.
On 2 gloo ranks (bf16, AdamW or SGD) a tiny Mixtral's ranks peaked within 0.7 % of this figure with 2 x 16 tokens
and 1.6 % either side of it with 8 x 128 (the router sends one rank more pairs than the other); a tiny Qwen3-MoE
(8 experts, 4 per rank) within 0.2 %.
ZeRO-1/2 with expert parallelism keeps DeepSpeed's accounting and is not emitted (`EXPERT_PARALLEL_ENGINES`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llamem.analytic.activations import is_checkpointed, training_activations
from llamem.analytic.common import r512, tensor_bytes, trains_base_weights
from llamem.analytic.logits import training_logits
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import Workload

if TYPE_CHECKING:
    from llamem.parallel import Layout

EXPERT_PARALLEL_ENGINES = (
    "Expert parallelism is emitted for replicas (--sharding ddp) and full fine-tuning (--task train) of Mixtral and "
    "Qwen3-MoE: train.py shards the experts with transformers 5.24's expert-parallel plan (`grouped_gemm` styles on "
    "the fused expert weights, `ep_dispatch_experts` with its all-to-all dispatch) and wraps the dense parts in "
    "torch DDP. ZeRO-1/2 with expert parallelism is not emitted: DeepSpeed 0.19.8's AutoEP runs it, but its "
    "dispatch (grouped GEMMs, Triton or C++ kernels) is not sized by llamem. transformers' DistributedConfig(ep_size=N) itself carves the experts out "
    "of FSDP2 (or tensor-parallel) ranks only, a layout llamem does not size with expert parallelism; accelerate "
    "1.15 and torch have no expert dimension.")
"""Which engines the bundles run expert parallelism with, and why the others are not emitted."""

EP_MODEL_TYPES = ("mixtral", "qwen3_moe")
"""The model types whose transformers config carries the expert-parallel plan (`base_model_ep_plan`) the bundle
applies: fused 3-D experts run by grouped_mm. Llama 4's experts run every token and have no `grouped_gemm` rule."""


def runs_transformers_ep(w: Workload, layout: Layout) -> bool:
    """Whether the layout is sized as the bundle runs it (module docstring): replicas, full fine-tuning."""
    return layout.ep > 1 and layout.sharding == "ddp" and w.task == "train" and trains_base_weights(w)


def transformers_ep_phases(ep_phases: dict[str, dict[str, int]], replicated: dict[str, dict[str, int]],
                           local: ModelSpec, w: Workload, layout: Layout) -> dict[str, dict[str, int]]:
    """`ep_phases` (`expert_parallel_phases` of `replicated`, the replicas' phases) as transformers' expert
    parallelism under DDP holds them (module docstring); other layouts are returned unchanged."""
    if not runs_transformers_ep(w, layout):
        return ep_phases
    layers, E = len(local.moe_layers), local.num_experts
    experts_bytes = layers * experts_tensor_bytes(local, E, w)
    local_experts_bytes = layers * experts_tensor_bytes(local, E // layout.ep, w)
    freed = experts_bytes - local_experts_bytes
    dense = replicated["optimizer"].get("gradients", 0) - experts_bytes
    # A checkpointed layer keeps only its input: its dispatch is recomputed in backward, one layer at a time.
    kept = sum(1 for index in local.moe_layers if not is_checkpointed(w, index))
    dispatch = kept * dispatch_saved_bytes(local, w, w.batch * w.seq)
    out = {}
    for name, breakdown in ep_phases.items():
        b, before = dict(breakdown), replicated.get(name, {})
        for key in ("gradients", "optimizer/exp_avg", "optimizer/exp_avg_sq", "optimizer/momentum_buffer"):
            if key in b and key in before:
                b[key] = before[key] - freed
        if "gradients/ddp_buckets" in b:
            b["gradients/ddp_buckets"] = dense
        if name == "optimizer" and "temporaries" in before:
            b["temporaries"] = before["temporaries"] * max(dense, local_experts_bytes) // (dense + experts_bytes)
        if name in ("forward", "backward") and "activations" in b:
            b["activations"] += dispatch
        out[name] = b
    if "backward" in out and not (w.compile or w.liger or w.optimizer_in_backward or w.offload_activations):
        out["backward"] = max(out["backward"], loss_backward(out["forward"], local, w), key=lambda b: sum(b.values()))
    return out


def loss_backward(forward: dict[str, int], spec: ModelSpec, w: Workload) -> dict[str, int]:
    """The loss's backward (`analytic.engine`: every saved activation, the logits' gradients) after `forward`.
    The replicas' worst backward moment may be a later one, a layer's with the gradients above it; with 1/ep of
    the experts' gradients the loss's can become the worst, so it is sized here again."""
    activations, logits = training_activations(spec, w), training_logits(spec, w)
    b = dict(forward)
    b["activations"] = b.get("activations", 0) + activations.backward - activations.forward
    b["logits"] = b.get("logits", 0) + logits.backward_peak - logits.forward_peak
    if logits.backward_temporaries:
        b["temporaries"] = b.get("temporaries", 0) + logits.backward_temporaries
    return b


def experts_tensor_bytes(spec: ModelSpec, experts: int, w: Workload) -> int:
    """One MoE layer's fused gate_up and down tensors holding `experts` experts, in the weight dtype."""
    h, I = spec.hidden_size, spec.moe_intermediate_size
    return tensor_bytes(experts * 2 * I * h, w.weight_dtype) + tensor_bytes(experts * h * I, w.weight_dtype)


def dispatch_saved_bytes(spec: ModelSpec, w: Workload, tokens: int) -> int:
    """What one MoE layer keeps for backward under `AllToAllEP`, beyond the single-GPU grouped_mm experts, for
    `tokens` tokens (S = tokens x k pairs sent, as many received with balanced routing). The experts gather and keep
    their rows as on one GPU, and the outputs put back in (token, slot) order, which the routing-weight product
    keeps, take the place of the experts' own output, which that product keeps on one GPU (here the experts run
    with unit weights that need no gradient). What remains: the dispatch's gather index `order // k` (8 S), the
    experts' sentinel mask (1 byte per pair) and their unit weights (S, compute dtype). One block traced alone also
    kept the received rows (S h) after its forward; whole models did not (2 gloo ranks of a tiny Mixtral, 2 x 16 to
    8 x 128 tokens: the two ranks' peaks lie either side of this figure, up to 1.6 % away as routing favours one)."""
    S, c = tokens * spec.experts_per_token, DTYPE_BYTES[w.compute_dtype]
    return r512(8 * S) + r512(S) + r512(c * S)
