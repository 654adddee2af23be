"""Assemble per-phase breakdowns from the per-category formulas."""

from __future__ import annotations

from llamem.analytic import activations as act
from llamem.analytic.common import r512
from llamem.analytic.kv_cache import kv_cache_bytes, kv_layer_tensor_bytes
from llamem.analytic.logits import training_logits
from llamem.analytic.optimizer import gradient_bytes, optimizer_state_bytes, step_temporary_bytes
from llamem.analytic.weights import autocast_copy_bytes, lora_tensor_sizes, model_weight_bytes
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.report import MemoryReport
from llamem.workload import Workload


def estimate(spec: ModelSpec, workload: Workload, teacher: ModelSpec | None = None) -> MemoryReport:
    if workload.task == "distill" and teacher is None:
        from llamem.model import load_model

        teacher = load_model(workload.teacher)
    weights = _weights(spec, workload, teacher)
    if workload.is_training:
        phases = _training_phases(spec, workload, weights, teacher)
    else:
        phases = _inference_phases(spec, workload, weights)
    notes = _notes(spec, workload)
    return MemoryReport(model=spec, workload=workload, engine="analytic", phases=phases, notes=tuple(notes))


def _notes(spec: ModelSpec, workload: Workload) -> list[str]:
    notes = []
    tokens = workload.seq + (workload.new_tokens if workload.task == "infer" else 0)
    if tokens > spec.max_position_embeddings:
        notes.append(f"{tokens} tokens exceed the model's max_position_embeddings "
                     f"({spec.max_position_embeddings}): quality may degrade beyond the trained context")
    return notes


def _weights(spec: ModelSpec, workload: Workload, teacher: ModelSpec | None) -> dict[str, int]:
    quant = workload.quant
    dtype = workload.weight_dtype
    weights, scales = model_weight_bytes(spec, dtype, quant)
    out = {"weights": weights}
    if scales:
        out["weights/quant_scales"] = scales
    if workload.uses_adapters:
        out["weights/adapters"] = sum(lora_tensor_sizes(spec, workload))
    if teacher is not None:
        out["weights/teacher"] = model_weight_bytes(teacher, "bf16")[0]
    return out


def _add(*parts: dict[str, int]) -> dict[str, int]:
    out: dict[str, int] = {}
    for part in parts:
        for key, value in part.items():
            if value:
                out[key] = out.get(key, 0) + value
    return out


def _training_phases(spec: ModelSpec, w: Workload, weights: dict[str, int],
                     teacher: ModelSpec | None) -> dict[str, dict[str, int]]:
    T = w.batch * w.seq
    e = act.compute_bytes(w)
    state = optimizer_state_bytes(spec, w)
    grads = gradient_bytes(spec, w)
    copies = {"weights/autocast_copies": autocast_copy_bytes(spec, w)}
    inputs = {"inputs": r512(8 * T)}
    train_all = w.task in ("train", "distill")
    # Gradients from earlier micro-batches live through the later ones' forward and backward.
    carried = {"gradients": grads} if w.grad_accum > 1 else {}

    saved = sum(act.model_saved_bytes(spec, w).values())
    rope = 2 * r512(w.seq * spec.head_dim * (4 if w.mixed else e))
    final_norm = act._norm_saved(T, spec.hidden_size, e, w.mixed, True, train_all)
    final_out = r512((4 if w.mixed else e) * T * spec.hidden_size)
    final_out_saved = final_out if (train_all and not w.mixed) else 0
    logits = training_logits(w, spec.vocab_size, spec.hidden_size, head_trains=train_all and w.mixed,
                             teacher=teacher is not None)

    # Without checkpointing, transformers builds a DynamicCache in training too (use_cache defaults to
    # True); it holds every layer's K and V until the output is dropped after the loss. Under autocast
    # its K is an fp32 copy that SDPA does not keep (it keeps a bf16 cast), so it costs extra bytes.
    cache_extra = spec.num_layers * r512(4 * T * spec.kv_dim) if (w.mixed and not w.ac_every) else 0
    persistent = _add(weights, state, carried, inputs)
    forward = _add(persistent, copies, {"activations": saved + rope + final_norm + final_out + cache_extra,
                                        "logits": logits.forward_peak})
    backward = _add(persistent, copies, {"activations": saved + rope + final_norm + final_out_saved,
                                         "logits": logits.backward_peak})
    end_of_backward = _add(weights, state, inputs, {"gradients": grads})
    if sum(end_of_backward.values()) > sum(backward.values()):
        backward = end_of_backward
    optimizer = _add(weights, state, {"gradients": grads, "temporaries": step_temporary_bytes(spec, w)})
    return {"load": dict(weights), "forward": forward, "backward": backward, "optimizer": optimizer}


def _prefill_transient(spec: ModelSpec, w: Workload) -> int:
    """Largest set of live temporaries inside one layer during prefill (no autograd)."""
    T = w.batch * w.seq
    e = act.compute_bytes(w)
    h, I = spec.hidden_size, spec.intermediate_size
    # LlamaModel keeps `inputs_embeds` referenced through the layer loop, plus RoPE's cos and sin.
    held = r512(e * T * h) + 2 * r512(e * w.seq * spec.head_dim)
    mlp = held + 2 * r512(e * T * h) + 3 * r512(e * T * I)
    norm = held + r512(e * T * h) + 2 * r512(4 * T * h)
    attention = 0
    if w.attn == "eager":
        probs = w.batch * spec.num_heads * w.seq * w.seq
        attention = held + 2 * r512(e * T * h) + r512(4 * probs) + 2 * r512(e * probs)
    return max(mlp, norm, attention)


def _inference_phases(spec: ModelSpec, w: Workload, weights: dict[str, int]) -> dict[str, dict[str, int]]:
    inputs = {"inputs": r512(8 * w.batch * w.seq)}
    prompt_cache = kv_cache_bytes(spec, w.batch, w.seq, w.kv_dtype)
    prefill = _add(weights, inputs, {"kv_cache": prompt_cache, "temporaries": _prefill_transient(spec, w),
                                     "logits": r512(DTYPE_BYTES[w.compute_dtype] * w.batch * spec.vocab_size)})
    phases = {"load": dict(weights), "prefill": prefill}
    if w.new_tokens > 1:
        final = w.seq + w.new_tokens - 1
        # DynamicCache grows by torch.cat: the new K (or V) of one layer is allocated beside the old one.
        growth = kv_layer_tensor_bytes(spec, w.batch, final, w.kv_dtype)
        vocab = w.batch * spec.vocab_size
        phases["decode"] = _add(weights, inputs, {
            "kv_cache": kv_cache_bytes(spec, w.batch, final - 1, w.kv_dtype) + growth,
            "logits": r512(DTYPE_BYTES[w.compute_dtype] * vocab) + r512(4 * vocab)})
    return phases
