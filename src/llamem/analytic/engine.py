"""Assemble per-phase breakdowns from the per-category formulas.

Each formula lives in the module named after its quantity (weights, optimizer and gradients,
activations, logits, kv_cache, prefill, backward); this module only adds them up per phase and
caches what depends on the parameters alone.
"""

from __future__ import annotations

from llamem.analytic import llama4
from llamem.analytic.activations import (checkpointed_layer_held_bytes, checkpointed_mlp_forward_bytes,
                                         is_checkpointed, stream_bytes, training_activations)
from llamem.analytic.attention_paths import attention_notes, extra_input_bytes, packed_shape
from llamem.analytic.backward import checkpointed_backward_moments, tied_gradient_sum
from llamem.analytic.common import add_breakdowns, r512, trains_base_weights
from llamem.analytic.compiled import compiled_training_moments
from llamem.analytic.in_backward import (compiled_in_backward_moments, end_of_backward_moments, head_gradient_moments,
                                         layer_gradient_in_backward)
from llamem.analytic.kv_cache import decode_moment
from llamem.analytic.liger import liger_top_layer_backward, liger_top_layer_forward, liger_uncached_copy_bytes
from llamem.analytic.llama4_moments import moe_backward_moments as llama4_moe_backward_moments
from llamem.analytic.llama4_moments import moe_forward_moment as llama4_moe_forward_moment
from llamem.analytic.logits import decode_logits_bytes, training_logits
from llamem.analytic.moe import check_moe, moe_forward_stages
from llamem.analytic.moe_backward import moe_backward_moments
from llamem.analytic.moe_lora import adapts_experts, expert_lora_forward_moments, last_checkpointed_moe_layer
from llamem.analytic.offload import (host_phase_bytes, offload_note, offloaded_activations, offloaded_layer_moments,
                                     offloaded_mlp_forward_bytes)
from llamem.analytic.optimizer import gradient_bytes, optimizer_phase_temporary_bytes, optimizer_state_bytes
from llamem.analytic.prefill import prefill_moment
from llamem.analytic.weights import (autocast_copies_in_backward_bytes, autocast_copy_bytes, checkpointed_mlp_copies,
                                     frozen_base_copies, weight_breakdown)
from llamem.model import ModelSpec
from llamem.report import MemoryReport
from llamem.workload import Workload


def estimate(spec: ModelSpec, workload: Workload, teacher: ModelSpec | None = None) -> MemoryReport:
    if workload.task == "distill" and teacher is None:
        from llamem.model import load_model

        teacher = load_model(workload.teacher)
    check_teacher(spec, teacher)
    check_moe(spec, workload)
    if teacher is not None:
        check_moe(teacher, workload, "teacher")
    weights = _weights(spec, workload, teacher)
    if workload.is_training:  # a padding-free batch is one row of batch x seq tokens
        phases = _training_phases(spec, packed_shape(workload), weights, teacher)
    else:
        phases = _inference_phases(spec, workload, weights)
    notes = _notes(spec, workload) + attention_notes(workload)
    extra = {}
    if workload.offload_activations:
        extra["host_bytes"] = host_phase_bytes(spec, workload)
        notes.append(offload_note(extra["host_bytes"], "save_on_cpu around each checkpoint"))
    return MemoryReport(model=spec, workload=workload, engine="analytic", phases=phases, notes=tuple(notes),
                        extra=extra)


def check_teacher(spec: ModelSpec, teacher: ModelSpec | None) -> None:
    if teacher is not None and teacher.vocab_size != spec.vocab_size:
        from llamem.errors import InvalidWorkload

        raise InvalidWorkload([(f"distillation compares logits token by token: the teacher's vocabulary "
                                f"({teacher.name}: {teacher.vocab_size}) must equal the student's "
                                f"({spec.name}: {spec.vocab_size}); pick a teacher of the same family")])


def _notes(spec: ModelSpec, workload: Workload) -> list[str]:
    notes = []
    tokens = workload.seq + (workload.new_tokens if workload.task == "infer" else 0)
    if tokens > spec.max_position_embeddings:
        notes.append(f"{tokens} tokens exceed the model's max_position_embeddings "
                     f"({spec.max_position_embeddings}): quality may degrade beyond the trained context")
    if workload.liger and workload.is_training:
        notes.append("liger: Liger-Kernel's fused linear cross-entropy, RMSNorm, SwiGLU and RoPE sized from its source "
                     "(they run only on a GPU; the trace engine emulates them byte for byte)")
    if workload.compile:
        notes.append("compile: what AOT autograd's partitioner saves and inductor's fused kernels hold, derived from "
                     "compiled traces (`llamem trace --compile`); compilation's own time and memory are not counted")
    return notes



def _worst(*moments: dict[str, int]) -> dict[str, int]:
    """The moment with the largest total (the first of equals)."""
    return max(moments, key=lambda moment: sum(moment.values()))


def _input_ids_bytes(w: Workload) -> int:
    """The int64 ids, and a padded batch's attention mask or a packed one's position ids."""
    return r512(8 * w.batch * w.seq) + extra_input_bytes(w)


def _training_phases(spec: ModelSpec, w: Workload, weights: dict[str, int],
                     teacher: ModelSpec | None) -> dict[str, dict[str, int]]:
    """Steady state (step 2 on): the optimizer state exists, gradients were set to None. With
    accumulation, gradients of earlier micro-batches live through forward and backward."""
    state, grads, copies = _static_training_bytes(spec, w)
    activations = training_activations(spec, w, distill=teacher is not None)
    if w.offload_activations:  # the checkpoints' inputs in host memory (`offload.py`)
        activations = offloaded_activations(spec, w, activations)
    logits = training_logits(spec, w, distill=teacher is not None)
    inputs = {"inputs": _input_ids_bytes(w)}
    persistent = add_breakdowns(weights, state, {"gradients": grads if w.grad_accum > 1 else 0}, inputs)
    forward_copies, copies_in_backward = _phase_copies(spec, w, copies)
    forward = add_breakdowns(persistent, {"weights/autocast_copies": forward_copies + logits.forward_weight_casts,
                                "activations": activations.forward, "logits": logits.forward_peak,
                                "gradients": logits.forward_gradient})
    forward = _worst(forward, *_layer_forward_moments(spec, w, persistent, activations.forward, forward_copies),
                     *_expert_lora_forward(spec, w, persistent, copies))
    loss_backward = add_breakdowns(persistent, {"weights/autocast_copies": copies_in_backward,
                                      "activations": activations.backward, "logits": logits.backward_peak,
                                      "gradients": logits.forward_gradient,
                                      "temporaries": logits.backward_temporaries})
    layer_backward = [add_breakdowns(persistent, moment)
                      for moment in checkpointed_backward_moments(spec, w, grads, activations.layer)
                      + _moe_backward_moments(spec, w, grads)]
    # Liger's RMSNorm: a plain top layer's backward is worse than the loss's
    if w.liger and not is_checkpointed(w, spec.num_layers - 1):
        layer_backward.append(add_breakdowns(persistent, {"weights/autocast_copies": copies_in_backward},
                                             liger_top_layer_backward(spec, w, activations.backward,
                                                                      stream_bytes(w, spec))))
    if w.offload_activations:
        layer_backward = offloaded_layer_moments(spec, w, layer_backward)
    compiled_end: dict[str, int] = {}
    if w.compile:  # what the compiled graph saves and holds instead (`compiled.py`)
        forward, loss_backward, layer_backward, compiled_end = compiled_training_moments(
            spec, w, persistent, copies, grads, logits.forward_peak)
    if w.optimizer_in_backward:
        if w.compile:  # the compiled backward returns every gradient at once (`in_backward.py`)
            backward = compiled_in_backward_moments(spec, w, persistent, grads, compiled_end, layer_backward, copies)
        else:
            backward = _in_backward_moments(spec, w, persistent, layer_backward, activations.backward,
                                            copies_in_backward)
        # Every parameter was stepped in backward: what the step leaves is all that is alive.
        return {"load": dict(weights), "forward": forward, "backward": _worst(loss_backward, *backward),
                "optimizer": add_breakdowns(weights, state)}
    end_of_backward = add_breakdowns(weights, state, inputs, {"gradients": grads},
                           compiled_end if w.compile else tied_gradient_sum(spec, w))
    optimizer = add_breakdowns(weights, state, {"gradients": grads,
                                      "temporaries": optimizer_phase_temporary_bytes(spec, w, grads)})
    return {"load": dict(weights), "forward": forward,
            "backward": _worst(loss_backward, *layer_backward, end_of_backward), "optimizer": optimizer}


def _phase_copies(spec: ModelSpec, w: Workload, copies: int) -> tuple[int, int]:
    """Autocast's weight copies alive in forward and in backward: LoRA over fp32 weights caches no cast of
    a frozen weight (`weights.frozen_base_copies`), nor does Liger's loss of the head; Llama 4's own."""
    frozen_copies = frozen_base_copies(spec, w, copies)
    uncached = liger_uncached_copy_bytes(spec, w)
    if frozen_copies:
        forward, backward = frozen_copies[0] - uncached, frozen_copies[1] - uncached
    else:
        forward, backward = copies, autocast_copies_in_backward_bytes(spec, w, copies) - uncached
    if llama4.is_llama4(spec):
        backward = llama4.autocast_copies_in_backward_bytes(spec, w, copies)
    return forward, backward


def _layer_forward_moments(spec: ModelSpec, w: Workload, persistent: dict[str, int], forward_activation_bytes: int,
                           forward_copies: int) -> list[dict[str, int]]:
    """The forward's moments inside a layer: the top checkpointed layer's MLP, an adapted Liger model's top
    layer, Llama 4's experts' block (`llama4_moments.py`)."""
    moments = []
    if w.ac_every and not spec.is_moe:
        mlp_copies = checkpointed_mlp_copies(spec, w) if trains_base_weights(w) else forward_copies
        held = checkpointed_mlp_forward_bytes(spec, w)
        if w.offload_activations:
            held = offloaded_mlp_forward_bytes(spec, w, held)
        moments.append(add_breakdowns(persistent, {"weights/autocast_copies": mlp_copies, "activations": held}))
    if w.liger and w.uses_adapters:
        moments.append(add_breakdowns(persistent, {"weights/autocast_copies": forward_copies},
                                      liger_top_layer_forward(spec, w, forward_activation_bytes)))
    if llama4.is_llama4(spec):
        moments.append(add_breakdowns(persistent, llama4_moe_forward_moment(spec, w)))
    return moments


def _expert_lora_forward(spec: ModelSpec, w: Workload, persistent: dict[str, int],
                         copies: int) -> list[dict[str, int]]:
    """The forward's moments in the highest checkpointed MoE layer with adapted experts (none without; nor
    with offloaded activations)."""
    index = last_checkpointed_moe_layer(spec, w)
    if index is None or w.offload_activations:
        return []
    held = checkpointed_layer_held_bytes(spec, w, index)
    stages = moe_forward_stages(spec, w, w.batch * w.seq)
    return [add_breakdowns(persistent, {"weights/autocast_copies": copies}, moment)
            for moment in expert_lora_forward_moments(spec, w, held, stages)]


def _moe_backward_moments(spec: ModelSpec, w: Workload, grads: int) -> list[dict[str, int]]:
    """Mixture-of-experts layers' backward moments (Llama 4's blocks apart: `llama4_moments.py`)."""
    return (llama4_moe_backward_moments if llama4.is_llama4(spec) else moe_backward_moments)(spec, w, grads)


def _in_backward_moments(spec: ModelSpec, w: Workload, persistent: dict[str, int], layer_backward: list[dict],
                         saved_activation_bytes: int, copies_in_backward_bytes: int) -> list[dict[str, int]]:
    """Backward's moments when each parameter is stepped as its gradient is ready (`in_backward.py`):
    a checkpointed layer holds its own gradient and step, not those of the layers above."""
    gradient, step = layer_gradient_in_backward(spec, w)
    layers = [{**moment, "gradients": gradient, "temporaries": moment.get("temporaries", 0) + step}
              for moment in layer_backward]
    head = head_gradient_moments(spec, w, saved_activation_bytes, copies_in_backward_bytes)
    end = end_of_backward_moments(spec, w, tied_gradient_sum(spec, w))
    return layers + [add_breakdowns(persistent, moment) for moment in head + end]


def _inference_phases(spec: ModelSpec, w: Workload, weights: dict[str, int]) -> dict[str, dict[str, int]]:
    # generate() builds the cache first: Llama 4's chunked layers each hold a window tensor from then on
    inputs = {"inputs": _input_ids_bytes(w) + llama4.cache_window_bytes(spec)}
    phases = {"load": dict(weights), "prefill": add_breakdowns(weights, inputs, prefill_moment(spec, w))}
    if w.new_tokens > 1:
        phases["decode"] = add_breakdowns(weights, inputs, decode_moment(spec, w), {"logits": decode_logits_bytes(spec, w)})
    return phases


_STATIC_CACHE: dict[tuple, tuple] = {}


def _static_key(spec: ModelSpec, w: Workload, teacher: ModelSpec | None = None) -> tuple:
    """The workload fields that per-parameter quantities depend on (not batch, not sequence)."""
    return (spec, teacher, w.task, w.precision, w.quant, w.optimizer, w.lora_rank, w.lora_targets, w.teacher_quant)


def _weights(spec: ModelSpec, workload: Workload, teacher: ModelSpec | None) -> dict[str, int]:
    key = ("weights",) + _static_key(spec, workload, teacher)
    if key not in _STATIC_CACHE:
        _STATIC_CACHE[key] = weight_breakdown(spec, workload, teacher)
    return dict(_STATIC_CACHE[key])


def _static_training_bytes(spec: ModelSpec, w: Workload) -> tuple[dict[str, int], int, int]:
    """Optimizer state, gradients and autocast copies depend on the parameters only: cached,
    because sweeps (planner, batch finder) vary the shape and keep the model."""
    # adapted experts' cast factors are kept by the layers that are not checkpointed
    key = ("train", w.ac_every if adapts_experts(w) else 0, w.loss, w.liger) + _static_key(spec, w)
    if key not in _STATIC_CACHE:
        copies = llama4.autocast_copy_bytes(spec, w) if llama4.is_llama4(spec) else autocast_copy_bytes(spec, w)
        _STATIC_CACHE[key] = (optimizer_state_bytes(spec, w), gradient_bytes(spec, w), copies)
    return _STATIC_CACHE[key]
