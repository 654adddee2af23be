"""A mixture-of-experts layer's backward: its two worst moments, in the experts' gate and gate_up.

Walking back through MoE layer j (`integrations/moe.py:grouped_mm_experts_forward` in reverse), with
T tokens, S = T * k token-expert pairs, e the compute dtype's bytes:
- the gate's backward (silu and the product): down's grouped_mm has made the product's gradient
  (e S I) and, in full fine-tuning, the down_proj experts' gradient (E x h x I); the product's two
  gradients (e S I each) are being made; the experts' output, the permuted routing weights, the inverse
  permutation and (full fine-tuning) the product have been used and freed;
- gate_up's backward: the gradient of its output (the gate and up halves concatenated, e S 2I) and
  of the gathered tokens (e S h) it is making; in full fine-tuning its own experts' gradient
  (E x 2I x h, the largest tensor of the step) now exists; gate_up's output and silu(gate) are freed.
In both the residual stream's gradient (e T h) and the routing weights' (S, their dtype) are alive,
with the head's and the layers' above gradients and below j the checkpoint inputs and plain layers'
saved sets. Memory moves linearly with j between the ends (a layer's gradients in, its activations
out), so the top and the bottom MoE layers are the candidates, as for a checkpointed dense layer
(`backward.py`). LoRA, whose experts have no gradient, peaks in the gate; full fine-tuning in gate_up.
LoRA on the experts (`moe_lora.py`) adds a third moment before the gate, down's grouped_mm making its
adapted weight's gradient while that weight is still saved, and the adapted weights to the other two.
"""

from __future__ import annotations

from llamem.analytic.activations import (checkpoint_mask_bytes, compute_bytes, is_checkpointed, layer_saved_bytes,
                                         rope_bytes, stream_bytes)
from llamem.analytic.backward import gradients_alive
from llamem.analytic.common import add_breakdowns, r512, trains_base_weights
from llamem.analytic.moe import moe_consumed_bytes, routing_weight_bytes
from llamem.analytic.moe_lora import adapts_experts, expert_lora_stage_terms
from llamem.analytic.selective import selective_kept_bytes
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import Workload


def moe_backward_moments(spec: ModelSpec, w: Workload, gradient_total_bytes: int) -> list[dict[str, int]]:
    """The gate's and gate_up's backward in the top and the bottom mixture-of-experts layer, beyond what
    persists through the step."""
    if not spec.is_moe or w.compile:
        return []
    T, S, e = w.batch * w.seq, w.batch * w.seq * spec.experts_per_token, compute_bytes(w)
    h, I = spec.hidden_size, spec.moe_intermediate_size
    shared = r512(e * T * h) + r512(routing_weight_bytes(spec, w) * S)
    stages = [("gate", False, 3 * r512(e * S * I)), ("gate_up", True, r512(e * S * 2 * I) + r512(e * S * h))]
    if adapts_experts(w):  # down's grouped_mm, making its adapted weight's gradient (`moe_lora.py`)
        stages.insert(0, ("down", False, r512(e * S * h) + r512(e * S * I)))
    moments = []
    for index in sorted({spec.moe_layers[-1], spec.moe_layers[0]}, reverse=True):
        for stage, at_gate_up, temporaries in stages:
            moment = {"gradients": _gradients(spec, w, gradient_total_bytes, index, at_gate_up),
                      "activations": _activations_at(spec, w, index, at_gate_up), "temporaries": shared + temporaries}
            moments.append(add_breakdowns(moment, expert_lora_stage_terms(spec, w, index, stage)))
    return moments


def _gradients(spec: ModelSpec, w: Workload, gradient_total_bytes: int, index: int, at_gate_up: bool) -> int:
    """The head's and the layers' above (`gradients_alive`), with the layer's own expert gradients made so
    far in place of a dense down_proj's; with accumulation every gradient already persists."""
    if w.grad_accum > 1:
        return 0
    alive = gradients_alive(spec, w, gradient_total_bytes, index)
    if not trains_base_weights(w):
        return alive
    wb, h, I, E = DTYPE_BYTES[w.weight_dtype], spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    experts = r512(wb * E * h * I) + (r512(wb * E * 2 * I * h) if at_gate_up else 0)
    return alive - r512(wb * h * spec.intermediate_size) + experts


def _activations_at(spec: ModelSpec, w: Workload, index: int, at_gate_up: bool) -> int:
    """Layer `index`'s saved set (recomputed when checkpointed: then with the residual mid-point it
    rebuilds in pure bf16/fp16) less what its experts' backward has freed, the layers' below, the
    model-level tensors."""
    current = sum(layer_saved_bytes(spec, w, index, moe=True).values()) - moe_consumed_bytes(spec, w, at_gate_up)
    if is_checkpointed(w, index) and not (w.mixed or compute_bytes(w) == 4):
        current += stream_bytes(w, spec)
    return current + _below(spec, w, index) + rope_bytes(spec, w) + checkpoint_mask_bytes(w, spec)


def _below(spec: ModelSpec, w: Workload, index: int) -> int:
    """What the layers under `index` keep: a checkpoint's input (and selective policy outputs), or a
    plain layer's saved set (layer 0's own; layers 1.. by kind)."""
    checkpointed = -(-index // w.ac_every) if w.ac_every else 0
    total = checkpointed * (stream_bytes(w, spec) + selective_kept_bytes(spec, w))
    plain = [i for i in range(index) if not is_checkpointed(w, i)]
    if plain and plain[0] == 0:
        total += sum(layer_saved_bytes(spec, w, 0).values())
    moe_layers = set(spec.moe_layers)
    moe = sum(1 for i in plain if i > 0 and i in moe_layers)
    dense = sum(1 for i in plain if i > 0) - moe
    for is_moe, count in ((True, moe), (False, dense)):
        if count:
            total += count * sum(layer_saved_bytes(spec, w, 1, moe=is_moe).values())
    return total
