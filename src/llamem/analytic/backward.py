"""The backward pass's worst moments besides the loss backward: a checkpointed layer's backward
and the end of backward.

Checkpointed layer i (`--ac full` / `every-K`: layers 0, K, 2K, ... keep only their input):
the layers below keep their checkpoint inputs (or, not checkpointed, their saved sets), layer i
has its full saved set back (recomputed; less the SwiGLU product, which down_proj's backward has
freed), the gradients of the head and of the layers above exist, and the layer's own backward
temporaries are alive: a residual-stream gradient and three MLP-sized ones. Memory is linear in
i between the ends, so the top and the bottom layers are the candidates. Under Liger's kernels the layer's
worst moment is its own (`liger_layer_backward`), taken at the top checkpointed layer.

End of backward: every gradient; a tied head's gradient summation (autograd adds the head's and
the embedding's gradients out of place).

Source: torch.utils.checkpoint (non-reentrant), autograd's AccumulateGrad, transformers 5.x
`modeling_llama.py`; held to the trace engine by tests/test_accuracy.py.
Left out: the exact op order inside the layer's backward (schedule_train.py replays it).
"""

from __future__ import annotations

from dataclasses import dataclass

from llamem.analytic.activations import (adapted_down_proj_saved_bytes, checkpoint_mask_bytes, compute_bytes, rope_bytes,
                                         stream_bytes)
from llamem.analytic.common import r512, top_checkpointed_layer, trains_base_weights
from llamem.analytic.llama4 import extra_mask_bytes
from llamem.analytic.optimizer import layer_gradient_bytes
from llamem.analytic.selective import kept_outputs_of, selective_kept_bytes
from llamem.analytic.weights import layer_adapter_cast_bytes, layer_autocast_copy_bytes
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import Workload


def checkpointed_backward_moments(spec: ModelSpec, w: Workload, gradient_total_bytes: int,
                                  layer_saved_bytes: int) -> list[dict[str, int]]:
    """The backward of the top and of the bottom checkpointed layer (none without checkpointing),
    beyond what persists through the step. `layer_saved_bytes`: one plain layer's saved set.
    Below layer i: ceil(i / K) checkpoint inputs (one residual-stream tensor each) and the rest
    plain layers with their saved sets and, under autocast, their weight copies."""
    if not w.ac_every:
        return []
    liger = liger_layer_backward(spec, w, layer_saved_bytes) if w.liger else None
    current = ((liger.current if liger else _current_layer_bytes(spec, w, layer_saved_bytes)) + rope_bytes(spec, w)
               + checkpoint_mask_bytes(w, spec) + extra_mask_bytes(spec, w))
    temporaries = liger.temporaries if liger else _layer_backward_temporaries(spec, w)
    # What each checkpoint keeps: its input and, selective, its policy's outputs.
    checkpoint = stream_bytes(w, spec) + selective_kept_bytes(spec, w)
    per_layer_copies, current_copies = _autocast_copies(spec, w, liger is not None)
    moments = []
    # Liger's plain top layer (every-K) has its own moment (`liger.liger_top_layer_backward`)
    top = top_checkpointed_layer(spec.num_layers, w) if liger else spec.num_layers - 1
    for index in (top, 0):
        checkpointed_below = -(-index // w.ac_every)
        plain_below = index - checkpointed_below
        gradients = gradients_alive(spec, w, gradient_total_bytes, index) - (liger.unmade_gradient if liger else 0)
        moment = {"gradients": gradients, "weights/autocast_copies": plain_below * per_layer_copies + current_copies,
                  "activations": checkpointed_below * checkpoint + plain_below * layer_saved_bytes + current,
                  "temporaries": temporaries}
        if liger and index == spec.num_layers - 1:  # the stream gradient is still Liger's grad_input
            moment.update(temporaries=temporaries - stream_bytes(w, spec), logits=stream_bytes(w, spec))
        moments.append(moment)
    return moments


DOWN_PROJ_MATMULS = ("down_proj", "down_proj.lora_A", "down_proj.lora_B")


@dataclass(frozen=True, slots=True)
class LigerLayerBackward:
    """A checkpointed layer's worst backward moment under Liger's kernels (`liger_layer_backward`)."""
    current: int
    """The current layer's activations: its recomputed saved set and what the moment adds to it."""
    temporaries: int
    """The stream gradient and what the moment makes."""
    unmade_gradient: int
    """Of the gradients `gradients_alive` counts, the one not yet made at the moment (down_proj's)."""


def liger_layer_backward(spec: ModelSpec, w: Workload, layer_saved_bytes: int) -> LigerLayerBackward:
    """Liger's SwiGLU writes its backward into gate and up in place, so a checkpointed layer's worst moment
    is down_proj's backward, where the recompute has the whole saved set back (Liger's RMSNorm keeps its input,
    h1 among it). Full fine-tuning: down_proj keeps the SwiGLU product and makes its weight gradient, then
    the product's gradient (T x I); under autocast the weight gradient is still its bf16 product (the fp32 one
    comes after), beside the stream gradient's bf16 cast and down_proj's bf16 weight copy. Adapters: a plain
    frozen down_proj keeps nothing, so the recompute, started by its backward, makes the product again
    (T x I, alive until it ends); a quantized one (bitsandbytes keeps its state on ctx) makes the product's
    gradient first and the recompute comes after, both alive; the recompute's locals, the MLP's input among
    them, are alive with it. Measured on the trace engine
    (tests/test_accuracy.py, the Liger rows with checkpointing)."""
    mlp, stream = _mlp_tensor_bytes(spec, w), stream_bytes(w, spec)
    if trains_base_weights(w):
        own = r512(DTYPE_BYTES[w.weight_dtype] * spec.hidden_size * spec.intermediate_size)
        if not w.mixed:
            return LigerLayerBackward(layer_saved_bytes, stream + mlp, 0)
        casts = r512(2 * spec.hidden_size * spec.intermediate_size) + r512(2 * w.batch * w.seq * spec.hidden_size)
        return LigerLayerBackward(layer_saved_bytes, stream + mlp + casts, own)
    # the recompute's locals at that point: the MLP's input (the norm's output, kept by no frozen linear),
    # the product unless an adapted down_proj keeps it, and, selective, down_proj's outputs the policy kept,
    # handed back when the recompute reaches them
    cached = kept_outputs_of(spec, w, DOWN_PROJ_MATMULS)
    current = layer_saved_bytes + stream + (0 if "down_proj" in w.lora_targets else mlp) + cached
    adapted = set(w.lora_targets)
    if {"gate_proj", "up_proj"} & adapted:
        current = max(current, _adapted_gate_up_moment(spec, w, layer_saved_bytes) + cached)
    if "down_proj" in adapted:
        current = max(current, _adapted_down_proj_moment(spec, w, layer_saved_bytes))
    return LigerLayerBackward(current, stream + _adapter_backward_temporaries(spec, w), 0)


def _adapter_backward_temporaries(spec: ModelSpec, w: Workload) -> int:
    """Made before the recompute, beside the stream gradient: a quantized down_proj's product gradient (it
    needs no saved tensor), under autocast the stream gradient's bf16 cast, and an adapted down_proj's
    LoRA gradient (its cast and scaled copy: the adapters' dtype, bf16 under autocast)."""
    Th = w.batch * w.seq * spec.hidden_size
    down = "down_proj" in w.lora_targets
    made = _mlp_tensor_bytes(spec, w) if (w.quant != "none" and not down) else 0
    if w.mixed:
        made += r512(2 * Th)
    elif down:
        made += r512(compute_bytes(w) * Th)
    return made + (r512((2 if w.mixed else 4) * Th) if down else 0)


def _adapted_gate_up_moment(spec: ModelSpec, w: Workload, layer_saved_bytes: int) -> int:
    """The recompute at the last adapted one of gate_proj and up_proj, at its LoRA: its base output (standing
    for its result, kept later; quantized: and peft's clone of it), lora_B's output and its scaled copy (fp32
    over fp32 adapters, bf16 under autocast) and the MLP's input; up, if that is later, and what an adapted
    down_proj keeps are not made yet."""
    T, I = w.batch * w.seq, spec.intermediate_size
    mlp = _mlp_tensor_bytes(spec, w)
    lora_output = r512((2 if w.mixed else 4) * T * I)
    later = (adapted_down_proj_saved_bytes(spec, w) if "down_proj" in w.lora_targets else 0) + (
        0 if "up_proj" in w.lora_targets else mlp)
    clone = mlp if w.quant != "none" else 0
    return layer_saved_bytes - later + stream_bytes(w, spec) + 2 * lora_output + clone


def _adapted_down_proj_moment(spec: ModelSpec, w: Workload, layer_saved_bytes: int) -> int:
    """The recompute at an adapted down_proj's LoRA: the MLP's input, the product, its base output and,
    under autocast, peft's fp32 cast of the product (lora_A keeps its bf16 cast); selective, also its
    adapter's kept outputs and the scaled one."""
    T, I, h = w.batch * w.seq, spec.intermediate_size, spec.hidden_size
    base_output = r512((2 if w.mixed else compute_bytes(w)) * T * h)
    fp32_cast = r512(4 * T * I) if w.mixed else 0
    moment = layer_saved_bytes + stream_bytes(w, spec) + _mlp_tensor_bytes(spec, w) + fp32_cast + base_output
    if w.selective_ac:  # no early stop: the recompute runs on to lora_B (its output kept) and the scaling
        kept = kept_outputs_of(spec, w, DOWN_PROJ_MATMULS[1:])
        moment += kept + r512((2 if w.mixed else 4) * T * h)
    return moment


def _mlp_tensor_bytes(spec: ModelSpec, w: Workload) -> int:
    """One MLP-sized activation or gradient (T x I; bf16 under autocast)."""
    return r512((2 if w.mixed else compute_bytes(w)) * w.batch * w.seq * spec.intermediate_size)


def gradients_alive(spec: ModelSpec, w: Workload, gradient_total_bytes: int, index: int) -> int:
    """Gradients alive in layer `index`'s backward: the head's and the final norm's (full
    fine-tuning), the layers' above, and the first of the layer's own (down_proj's)."""
    above = (spec.num_layers - 1 - index) * layer_gradient_bytes(spec, w, gradient_total_bytes)
    if not trains_base_weights(w):
        return above
    wb = DTYPE_BYTES[w.weight_dtype]
    head = r512(wb * spec.lm_head_params) + r512(wb * spec.hidden_size)
    own = r512(wb * spec.hidden_size * spec.intermediate_size)
    return head + above + own


def _autocast_copies(spec: ModelSpec, w: Workload, in_down_proj: bool = False) -> tuple[int, int]:
    """(a plain layer's weight copies, the current layer's) under autocast: the current layer's
    recompute made its own, less down_proj's (gone with its backward, before the worst moment,
    unless the moment is in down_proj's backward: `in_down_proj`)."""
    if not w.mixed:
        return 0, 0
    if in_down_proj:  # Liger: the recompute's saved casts, its adapters' among them
        adapters = layer_adapter_cast_bytes(spec, w) if w.uses_adapters else 0
        return layer_autocast_copy_bytes(spec), layer_autocast_copy_bytes(spec) + adapters
    return layer_autocast_copy_bytes(spec), layer_autocast_copy_bytes(spec, skip=("down_proj",))


def _current_layer_bytes(spec: ModelSpec, w: Workload, layer_saved_bytes: int) -> int:
    """The current layer's recomputed saved set, less the SwiGLU product down_proj's backward has
    freed (full fine-tuning keeps it); in pure bf16/fp16 the recompute also rebuilds the residual
    mid-point h1 (a local of the recomputed forward; with an fp32 stream it is part of the saved set)."""
    current = layer_saved_bytes - (_mlp_tensor_bytes(spec, w) if trains_base_weights(w) else 0)
    recomputed_h1 = 0 if (w.mixed or compute_bytes(w) == 4) else stream_bytes(w, spec)
    return current + recomputed_h1


def _layer_backward_temporaries(spec: ModelSpec, w: Workload) -> int:
    """A residual-stream gradient and three MLP-sized ones."""
    return stream_bytes(w, spec) + 3 * _mlp_tensor_bytes(spec, w)


def tied_gradient_sum(spec: ModelSpec, w: Workload) -> dict[str, int]:
    """A tied matrix gets two gradients (head, then embedding); AccumulateGrad adds them out of
    place, so for a moment the head's, the embedding's and their sum are all alive (2 V h
    weight-dtype bytes beyond the gradients; with accumulation the earlier micro-batches'
    gradient is added to as well, one more)."""
    if not (spec.tie_word_embeddings and trains_base_weights(w)):
        return {}
    tied = r512(DTYPE_BYTES[w.weight_dtype] * spec.embedding_params)
    return {"logits": tied, "temporaries": 2 * tied if w.grad_accum > 1 else tied}
