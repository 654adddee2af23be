"""Assemble per-phase breakdowns from the per-category formulas.

Each formula lives in the module named after its quantity (weights, optimizer and gradients,
activations, logits, kv_cache, prefill, backward); this module only adds them up per phase and
caches what depends on the parameters alone.
"""

from __future__ import annotations

from llamem.analytic.activations import training_activations
from llamem.analytic.backward import checkpointed_backward_moments, tied_gradient_sum
from llamem.analytic.common import r512
from llamem.analytic.kv_cache import decode_moment
from llamem.analytic.logits import decode_logits_bytes, training_logits
from llamem.analytic.optimizer import gradient_bytes, optimizer_state_bytes, step_temporary_bytes
from llamem.analytic.prefill import prefill_moment
from llamem.analytic.weights import autocast_copies_in_backward_bytes, autocast_copy_bytes, weight_breakdown
from llamem.model import ModelSpec
from llamem.report import MemoryReport
from llamem.workload import Workload


def estimate(spec: ModelSpec, workload: Workload, teacher: ModelSpec | None = None) -> MemoryReport:
    if workload.task == "distill" and teacher is None:
        from llamem.model import load_model

        teacher = load_model(workload.teacher)
    check_teacher(spec, teacher)
    weights = _weights(spec, workload, teacher)
    if workload.is_training:
        phases = _training_phases(spec, workload, weights, teacher)
    else:
        phases = _inference_phases(spec, workload, weights)
    notes = _notes(spec, workload)
    return MemoryReport(model=spec, workload=workload, engine="analytic", phases=phases, notes=tuple(notes))


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
    return notes


def _add(*parts: dict[str, int]) -> dict[str, int]:
    """Category-wise sum of breakdowns (zero entries left out)."""
    out: dict[str, int] = {}
    get = out.get
    for part in parts:
        for key, value in part.items():
            if value:
                out[key] = get(key, 0) + value
    return out


def _worst(*moments: dict[str, int]) -> dict[str, int]:
    """The moment with the largest total (the first of equals)."""
    return max(moments, key=lambda moment: sum(moment.values()))


def _input_ids_bytes(w: Workload) -> int:
    return r512(8 * w.batch * w.seq)


def _training_phases(spec: ModelSpec, w: Workload, weights: dict[str, int],
                     teacher: ModelSpec | None) -> dict[str, dict[str, int]]:
    """Steady state (step 2 on): the optimizer state exists, gradients were set to None. With
    accumulation, gradients of earlier micro-batches live through forward and backward."""
    state, grads, copies = _static_training_bytes(spec, w)
    activations = training_activations(spec, w, distill=teacher is not None)
    logits = training_logits(spec, w, distill=teacher is not None)
    inputs = {"inputs": _input_ids_bytes(w)}
    persistent = _add(weights, state, {"gradients": grads if w.grad_accum > 1 else 0}, inputs)
    forward = _add(persistent, {"weights/autocast_copies": copies, "activations": activations.forward,
                                "logits": logits.forward_peak})
    loss_backward = _add(persistent, {"weights/autocast_copies": autocast_copies_in_backward_bytes(spec, w, copies),
                                      "activations": activations.backward, "logits": logits.backward_peak})
    layer_backward = [_add(persistent, moment)
                      for moment in checkpointed_backward_moments(spec, w, grads, activations.layer)]
    end_of_backward = _add(weights, state, inputs, {"gradients": grads}, tied_gradient_sum(spec, w))
    optimizer = _add(weights, state, {"gradients": grads, "temporaries": step_temporary_bytes(w, grads)})
    return {"load": dict(weights), "forward": forward,
            "backward": _worst(loss_backward, *layer_backward, end_of_backward), "optimizer": optimizer}


def _inference_phases(spec: ModelSpec, w: Workload, weights: dict[str, int]) -> dict[str, dict[str, int]]:
    inputs = {"inputs": _input_ids_bytes(w)}
    phases = {"load": dict(weights), "prefill": _add(weights, inputs, prefill_moment(spec, w))}
    if w.new_tokens > 1:
        phases["decode"] = _add(weights, inputs, decode_moment(spec, w), {"logits": decode_logits_bytes(spec, w)})
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
    key = ("train",) + _static_key(spec, w)
    if key not in _STATIC_CACHE:
        _STATIC_CACHE[key] = (optimizer_state_bytes(spec, w), gradient_bytes(spec, w), autocast_copy_bytes(spec, w))
    return _STATIC_CACHE[key]
