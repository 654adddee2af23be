"""Llama 4's worst training moments inside its mixture-of-experts blocks (`llama4.py` sizes what they keep).

Every expert sees every token, so a block's own tensors (E T h, E T I wide) outgrow the logits:
- forward, in the top such layer, at its experts' second batched matmul (checkpointed: at the product, with
  the checkpoints' inputs and the block's locals only): every layer's saved set below, the
  layer's own so far (not yet its shared expert's), and the block's locals: the layer input and the residual
  mid-point (pure precision; the fp32 stream is saved anyway), the attention output, the block input (unless
  the router's Linear keeps it), the router logits and scores, the weighted tokens and the product (unless
  the matmuls keep them; under autocast the fp32 weighted tokens beside their bf16 cast), the matmul's output;
- backward, in the top and the bottom such layer (memory is linear between them): the product's backward
  (the gate stage: its input's gradient and the two it makes, E T I each, with gate_up's output and silu(gate)
  still kept) and gate_up's (its output's gradient, E T 2I, and the weighted tokens', E T h; in full
  fine-tuning its experts' gradient, the largest tensor of the step). The shared expert ran last, so its
  backward is done and its weights' gradients made; two residual-stream gradients are alive.

Source: `modeling_llama4.py` (Llama4TextMoe, Llama4TextExperts), autograd's order (the highest sequence
number first); held to the trace engine by `benchmarks/accuracy.py:llama4_rows`.
Left out: under checkpointing, the start of the top layer's backward, while its recompute's locals are still
alive; at the presets' widths the expert stages above are larger (the rows hold to 0.01 %), but at toy widths
(hidden 256, 4 experts) that moment is the peak, up to 7 % above these.
"""

from __future__ import annotations

from llamem.analytic import llama4
from llamem.analytic.activations import (checkpoint_mask_bytes, compute_bytes, is_checkpointed, layer_flags,
                                         layer_saved_bytes, rope_bytes, stream_bytes)
from llamem.analytic.common import r512, trains_base_weights
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import Workload


def moe_forward_moment(spec: ModelSpec, w: Workload) -> dict[str, int]:
    """Activations and autocast's copies at the top mixture-of-experts layer's experts: its down matmul, or
    when checkpointed (its forward keeps nothing) its product."""
    j = spec.moe_layers[-1]
    T, E, h, I = w.batch * w.seq, spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    ae, se, trains = _attention_dtype_bytes(w), _stream_dtype_bytes(w), trains_base_weights(w)
    if is_checkpointed(w, j):  # the recompute's copies are not cached: the plain layers' below and its own
        copies = sum(llama4.layer_autocast_copy_bytes(spec, i) for i in range(j + 1) if not is_checkpointed(w, i))
        return {"activations": _checkpointed_forward_bytes(spec, w, j),
                "weights/autocast_copies": copies if w.mixed else 0}
    pure = not (w.mixed or compute_bytes(w) == 4)
    # the model's `inputs_embeds` (kept by layer 0's norm under an fp32 stream) and the layer's input and
    # residual mid-point (the stream, kept by the norms, when fp32), the position ids
    held = 3 * r512(compute_bytes(w) * T * h) if pure else 0
    locals_ = (r512(ae * E * T * h) + 2 * r512(ae * T * E) + r512(ae * T * h)
               + (r512(se * E * T * h) if (w.mixed or not trains) else 0)
               + (0 if trains else r512(ae * E * T * I))
               + (0 if (trains and not w.mixed) else r512(se * T * h)) + held + r512(8 * w.seq))
    own = sum(layer_saved_bytes(spec, w, j).values()) - _shared_expert_saved(spec, w, j)
    if not pure:  # the layer's output, which the residual part counts, is not made yet
        own -= stream_bytes(w, spec)
    cache = llama4.cache_window_bytes(spec)
    return {"activations": _below(spec, w, j) + own + locals_ + _model_level(spec, w) + cache,
            "weights/autocast_copies": _forward_copies(spec, w, j)}


def _forward_copies(spec: ModelSpec, w: Workload, j: int) -> int:
    """Autocast's copies made by layer `j`'s experts: every layer's up to it, less its shared expert's (the
    head's comes later)."""
    if not w.mixed:
        return 0
    shared = 3 * r512(2 * spec.hidden_size * spec.shared_expert_intermediate_size)
    return sum(llama4.layer_autocast_copy_bytes(spec, i) for i in range(j + 1)) - shared


def _checkpointed_forward_bytes(spec: ModelSpec, w: Workload, j: int) -> int:
    """A checkpointed layer's forward keeps nothing: at the product of its experts, the checkpoints' inputs
    (its own too), the model-level tensors and the block's locals (the attention output, the residual
    mid-point, the block input, the router logits and scores, the weighted tokens, gate_up's output,
    silu(gate) and the product)."""
    T, E, h, I = w.batch * w.seq, spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    ae, se = _attention_dtype_bytes(w), _stream_dtype_bytes(w)
    locals_ = (r512(ae * T * h) + 2 * r512(se * T * h) + 2 * r512(ae * T * E) + r512(se * E * T * h)
               + r512(ae * E * T * 2 * I) + 2 * r512(ae * E * T * I))
    return _below(spec, w, j) + stream_bytes(w, spec) + _model_level(spec, w) + locals_


def moe_backward_moments(spec: ModelSpec, w: Workload, gradient_total_bytes: int) -> list[dict[str, int]]:
    """The gate stage's and gate_up's backward in the top and the bottom mixture-of-experts layer, beyond
    what persists through the step."""
    moments = []
    for index in sorted({spec.moe_layers[-1], spec.moe_layers[0]}, reverse=True):
        for at_gate_up, temporaries, consumed, copies_done in _stages(spec, w):
            moments.append({"gradients": _gradients(spec, w, gradient_total_bytes, index, at_gate_up),
                            "activations": _activations_at(spec, w, index, at_gate_up) - consumed,
                            "weights/autocast_copies": _copies_at(spec, w, index) - copies_done,
                            "temporaries": temporaries})
    return moments


def _stages(spec: ModelSpec, w: Workload) -> list[tuple[bool, int, int, int]]:
    """(at gate_up?, temporaries, more activations freed, more copies freed) of the two stages. Under
    autocast in full fine-tuning gate_up's worst is after its matmul's backward: its bf16 weight gradient is
    cast to the fp32 parameter's, beside the fp32 gradient of the weighted tokens; the matmul's saved cast
    of its input and weight are gone."""
    T, E, h, I = w.batch * w.seq, spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    ae = _attention_dtype_bytes(w)
    residual = 2 * r512(_stream_dtype_bytes(w) * T * h)
    gate = (False, residual + 3 * r512(ae * E * T * I), 0, 0)
    # with accumulation the experts' new gradient exists beside the one it is added to
    added = r512(DTYPE_BYTES[w.weight_dtype] * E * h * 2 * I) if (w.grad_accum > 1 and trains_base_weights(w)) else 0
    if w.mixed and trains_base_weights(w):
        cast = r512(2 * E * h * 2 * I)
        return [gate, (True, residual + cast + r512(4 * E * T * h) + added, r512(2 * E * T * h), cast)]
    return [gate, (True, residual + r512(ae * E * T * 2 * I) + r512(ae * E * T * h) + added, 0, 0)]


def _attention_dtype_bytes(w: Workload) -> int:
    return 2 if w.mixed else compute_bytes(w)


def _stream_dtype_bytes(w: Workload) -> int:
    return 4 if w.mixed else compute_bytes(w)


def _shared_expert_saved(spec: ModelSpec, w: Workload, index: int) -> int:
    """What the shared expert keeps (made after the routed experts): its gated MLP's tensors and, under
    autocast in full fine-tuning, its gate and up projections' casts of the block input."""
    flags = layer_flags(w, index)
    needs_grad = flags.input_requires_grad or bool(flags.targets)
    if not (needs_grad or flags.train_all):
        return 0
    T = w.batch * w.seq
    unit = r512(_attention_dtype_bytes(w) * T * spec.shared_expert_intermediate_size)
    casts = 2 * r512(2 * T * spec.hidden_size) if (w.mixed and flags.train_all) else 0
    return 3 * unit + (unit if flags.train_all else 0) + casts


def _gradients(spec: ModelSpec, w: Workload, gradient_total_bytes: int, index: int, at_gate_up: bool) -> int:
    """The head's and final norm's and the layers' above; of the layer's own, its shared expert's and its
    experts' down (at gate_up also gate_up's). With accumulation every gradient already persists."""
    if w.grad_accum > 1:
        return 0
    if not trains_base_weights(w):
        return (spec.num_layers - 1 - index) * (gradient_total_bytes // spec.num_layers)
    wb, h, I, E = DTYPE_BYTES[w.weight_dtype], spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    head = r512(wb * spec.lm_head_params) + r512(wb * h)
    above = sum(r512(wb * numel) for i in range(index + 1, spec.num_layers) for _n, numel in spec.layer_params(i))
    own = 3 * r512(wb * h * spec.shared_expert_intermediate_size) + r512(wb * E * I * h)
    return head + above + own + (r512(wb * E * h * 2 * I) if at_gate_up else 0)


def _copies_at(spec: ModelSpec, w: Workload, index: int) -> int:
    """Autocast's copies still saved in layer `index`'s expert backward: the plain layers' below, and its
    own less the shared expert's and the experts' down (their backward is done)."""
    if not w.mixed:
        return 0
    below = sum(llama4.layer_autocast_copy_bytes(spec, i) for i in range(index) if not is_checkpointed(w, i))
    h, I, E = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    done = 3 * r512(2 * h * spec.shared_expert_intermediate_size) + r512(2 * E * I * h)
    return below + llama4.layer_autocast_copy_bytes(spec, index) - done


def _activations_at(spec: ModelSpec, w: Workload, index: int, at_gate_up: bool) -> int:
    """Layer `index`'s saved set (recomputed when checkpointed: then with the residual mid-point it
    rebuilds in pure precision) less what its backward has freed, the layers' below, the model-level
    tensors."""
    T, E, I = w.batch * w.seq, spec.num_experts, spec.moe_intermediate_size
    ae = _attention_dtype_bytes(w)
    consumed = _shared_expert_saved(spec, w, index) + (r512(ae * E * T * I) if trains_base_weights(w) else 0)
    if at_gate_up:
        consumed += r512(ae * E * T * 2 * I) + r512(ae * E * T * I)
    current = sum(layer_saved_bytes(spec, w, index).values()) - consumed
    if is_checkpointed(w, index) and not (w.mixed or compute_bytes(w) == 4):
        current += stream_bytes(w, spec)
    return current + _below(spec, w, index) + _model_level(spec, w)


def _below(spec: ModelSpec, w: Workload, index: int) -> int:
    """What the layers under `index` keep: a checkpoint's input, or a plain layer's saved set; under an
    fp32 stream without checkpointing, also the embedding output (layer 0's norm keeps it)."""
    total = 0
    for i in range(index):
        total += stream_bytes(w, spec) if is_checkpointed(w, i) else sum(layer_saved_bytes(spec, w, i).values())
    if (w.mixed or compute_bytes(w) == 4) and not w.ac_every and layer_flags(w, 0).input_requires_grad:
        total += stream_bytes(w, spec)
    return total


def _model_level(spec: ModelSpec, w: Workload) -> int:
    """RoPE's freqs_cis, checkpointing's masks and position ids."""
    return rope_bytes(spec, w) + checkpoint_mask_bytes(w, spec) + llama4.extra_mask_bytes(spec, w)
