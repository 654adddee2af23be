"""Weights, LoRA adapters and quantization scales, tensor by tensor.

Every parameter is its own allocation, so each is rounded to 512 bytes separately,
exactly as the caching allocator (and the trace) counts it.

Quantized linears (decoder layers only; the embedding, norms and lm_head stay in the
compute dtype, as bitsandbytes' `load_in_4bit/8bit` leaves them):
- int8 (LLM.int8): 1 byte per weight + one fp32 scale per output row.
- nf4 / int4 (bitsandbytes 4-bit): 0.5 byte per weight + one fp32 absmax per block of 64
  (double quantization off).
"""

from __future__ import annotations

from functools import lru_cache

from llamem.analytic.common import r512, tensor_bytes, top_checkpointed_layer, trains_base_weights
from llamem.analytic.moe_lora import expert_adapter_matrices, expert_copies_kept_bytes, lora_linear_targets
from llamem.model import ModelSpec
from llamem.workload import LOSS_CHUNKS, Workload

NF4_BLOCK = 64


def linear_weight_bytes(fan_in: int, fan_out: int, dtype: str, quant: str) -> tuple[int, int]:
    """(weight bytes, scale bytes) of one linear layer's weight."""
    numel = fan_in * fan_out
    if quant == "none":
        return tensor_bytes(numel, dtype), 0
    if quant == "int8":
        return r512(numel), r512(4 * fan_out)
    return r512((numel + 1) // 2), r512(4 * -(-numel // NF4_BLOCK))


def layer_weight_bytes(spec: ModelSpec, dtype: str, quant: str = "none", moe: bool = False) -> tuple[int, int]:
    """(weights, quantization scales) of one decoder layer, dense or mixture of experts: every parameter
    of `ModelSpec.layer_params` (linears, biases, RMSNorm and q/k-norm weights, router, fused experts) in
    `dtype`, the dense layer's 7 linear weights quantized where `quant` says."""
    shapes = spec.layer_linear_shapes()
    weights = scales = 0
    for name, numel in _layer_tensors(spec, moe):
        proj = name.split(".")[-2]
        if quant != "none" and not moe and name.endswith(".weight") and proj in shapes:
            w, s = linear_weight_bytes(*shapes[proj], dtype, quant)
        else:
            w, s = tensor_bytes(numel, dtype), 0
        weights, scales = weights + w, scales + s
    return weights, scales


def _layer_tensors(spec: ModelSpec, moe: bool) -> list[tuple[str, int]]:
    """(name, element count) of a mixture-of-experts layer's parameters, or of a dense layer's."""
    dense = [i for i in range(spec.num_layers) if i not in spec.moe_layers][:1]
    index = spec.moe_layers[0] if moe else (dense[0] if dense else 0)
    return spec.layer_params(index)


def rope_buffer_bytes(spec: ModelSpec) -> int:
    """inv_freq and original_inv_freq: head_dim/2 fp32 values each."""
    return 2 * tensor_bytes(spec.head_dim // 2, "fp32")


def model_weight_bytes(spec: ModelSpec, dtype: str, quant: str = "none") -> tuple[int, int]:
    """(weights, quantization scales) of the whole model; a tied head adds nothing."""
    layers = scales = 0
    for moe, count in spec.layer_kinds():
        per_layer, per_layer_scales = layer_weight_bytes(spec, dtype, quant, moe)
        layers, scales = layers + count * per_layer, scales + count * per_layer_scales
    embedding = tensor_bytes(spec.embedding_params, dtype)
    head = tensor_bytes(spec.lm_head_params, dtype) if spec.lm_head_params else 0
    final_norm = tensor_bytes(spec.hidden_size, dtype)
    return layers + embedding + head + final_norm + rope_buffer_bytes(spec), scales


def weight_breakdown(spec: ModelSpec, workload: Workload, teacher: ModelSpec | None = None) -> dict[str, int]:
    """Everything loaded before the first step: the model's weights in their storage dtype, the
    quantization scales, the LoRA adapters, a distillation teacher's weights (bf16 or quantized, frozen)."""
    weights, scales = model_weight_bytes(spec, workload.weight_dtype, workload.quant)
    out = {"weights": weights}
    if scales:
        out["weights/quant_scales"] = scales
    if workload.uses_adapters:
        out["weights/adapters"] = sum(lora_tensor_sizes(spec, workload))
    if teacher is not None:
        # The frozen teacher in bf16, or quantized like a base model (`--teacher-quant`), its scales
        # with the other quantization scales.
        teacher_weights, teacher_scales = model_weight_bytes(teacher, "bf16", workload.teacher_quant)
        out["weights/teacher"] = teacher_weights
        if teacher_scales:
            out["weights/quant_scales"] = out.get("weights/quant_scales", 0) + teacher_scales
    return out


def lora_shapes(spec: ModelSpec, workload: Workload) -> list[tuple[int, int]]:
    """(fan_in, fan_out) of every adapted linear in one layer."""
    shapes = spec.layer_linear_shapes()
    return [shapes[name] for name in lora_linear_targets(workload)]


def lora_matrices(spec: ModelSpec, workload: Workload) -> list[tuple[int, int]]:
    """(columns, rows) of every LoRA tensor in the model, layer by layer: each adapted linear's A (r x in)
    and B (out x r), then in a mixture-of-experts layer its experts' adapters (`moe_lora.py`)."""
    rank = workload.lora_rank
    linears = [m for fan_in, fan_out in lora_shapes(spec, workload) for m in ((fan_in, rank), (rank, fan_out))]
    experts, moe_layers = expert_adapter_matrices(spec, workload), set(spec.moe_layers)
    return [m for index in range(spec.num_layers) for m in linears + (experts if index in moe_layers else [])]


def lora_tensor_sizes(spec: ModelSpec, workload: Workload) -> list[int]:
    """Bytes of every LoRA tensor in the model (fp32 as peft keeps them)."""
    dtype = adapter_dtype(workload)
    return [tensor_bytes(columns * rows, dtype) for columns, rows in lora_matrices(spec, workload)]


def adapter_dtype(workload: Workload) -> str:
    """peft's autocast_adapter_dtype=True upcasts bf16/fp16 adapters to fp32."""
    return "fp32"


def trainable_tensor_sizes(spec: ModelSpec, workload: Workload) -> list[int]:
    """Bytes of every trainable tensor, in its storage dtype: what gradients and optimizer state mirror."""
    if workload.uses_adapters:
        return lora_tensor_sizes(spec, workload)
    dtype = workload.weight_dtype
    return [tensor_bytes(numel, dtype) for numel in trainable_numels(spec, workload)]


def trainable_numels(spec: ModelSpec, workload: Workload) -> list[int]:
    """Element counts of the trainable tensors (same order as trainable_tensor_sizes)."""
    if workload.uses_adapters:
        return [columns * rows for columns, rows in lora_matrices(spec, workload)]
    # Embedding, each layer's own (in ModelSpec.layer_params order), final norm, head.
    kinds = {moe: [numel for _name, numel in _layer_tensors(spec, moe)] for moe, _count in spec.layer_kinds()}
    moe_layers = set(spec.moe_layers)
    numels = [spec.embedding_params]
    for index in range(spec.num_layers):
        numels += kinds[index in moe_layers]
    numels.append(spec.hidden_size)
    if spec.lm_head_params:
        numels.append(spec.lm_head_params)
    return numels


@lru_cache(maxsize=256)
def layer_autocast_copy_bytes(spec: ModelSpec, skip: tuple[str, ...] = ()) -> int:
    """bf16 copies autocast makes of one layer's Linear weights (less those in `skip`); cached, as
    the backward's moments ask for it per candidate layer."""
    return sum(tensor_bytes(i * o, "bf16") for name, (i, o) in spec.layer_linear_shapes().items()
               if name not in skip)


def autocast_copy_bytes(spec: ModelSpec, workload: Workload) -> int:
    """Mixed precision: autocast caches a compute-dtype copy of every Linear weight (not the
    embedding or norms) for the whole forward, and autograd keeps it until backward is done."""
    if not workload.mixed:  # adapted experts' factors, cast to the bf16 weights' dtype (`moe_lora.py`)
        return expert_copies_kept_bytes(spec, workload)
    head = tensor_bytes(spec.vocab_size * spec.hidden_size, "bf16")
    return spec.num_layers * layer_autocast_copy_bytes(spec) + head * _head_casts(workload)


def _head_casts(workload: Workload) -> int:
    """Autocast caches the casts of weights that require a gradient only: a frozen head (LoRA) under the
    chunked loss is cast again for each chunk, and each chunk's matmul saves its copy for backward."""
    chunked = workload.loss == "chunked" and not workload.liger
    return LOSS_CHUNKS if chunked and not trains_base_weights(workload) else 1


def autocast_copies_in_backward_bytes(spec: ModelSpec, workload: Workload, forward_copy_bytes: int) -> int:
    """Autocast's cache dies with the autocast context; only copies autograd saved survive into
    backward, and a checkpointed layer saves none (its recompute casts again): the forward's
    copies less one layer's for each of the ceil(L / K) checkpointed layers."""
    if not (workload.mixed and workload.ac_every):
        return forward_copy_bytes
    checkpointed = -(-spec.num_layers // workload.ac_every)
    return forward_copy_bytes - checkpointed * layer_autocast_copy_bytes(spec)


_LAYER_STAGES = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
"""A layer's linears in the order they run: each reads what the stage before produced."""


def frozen_base_copies(spec: ModelSpec, workload: Workload, copies: int) -> tuple[int, int] | None:
    """(forward, backward) autocast copies of LoRA over fp32 base weights (None for any other case).
    Autocast caches only casts of weights requiring a gradient: a frozen base weight's cast lives only
    where its matmul saves it (a plain layer whose input at that linear needs a gradient; never in a
    checkpointed layer), while every adapter's cast stays cached until the forward ends, and in backward
    only the adapters of plain layers keep theirs (lora_A's only where its input needs a gradient)."""
    if not (workload.mixed and workload.task == "lora" and workload.quant == "none") \
            or workload.compile or spec.is_moe:
        return None
    layer, L, K = layer_autocast_copy_bytes(spec), spec.num_layers, workload.ac_every
    head = copies - L * layer
    a_casts, b_casts = _adapter_casts(spec, workload, ()), _adapter_casts(spec, workload, (), lora_b=True)
    if K:  # layer 0 is checkpointed
        plain = L - -(-L // K)
        base, saved_adapters = plain * layer, plain * (a_casts + b_casts)
    else:
        skip = _layer0_unsaved(workload)
        base = L * layer - (layer - layer_autocast_copy_bytes(spec, skip))
        saved_adapters = L * b_casts + (L - 1) * a_casts + _adapter_casts(spec, workload, skip)
    return head + base + L * (a_casts + b_casts), head + base + saved_adapters


def _layer0_unsaved(workload: Workload) -> tuple[str, ...]:
    """Layer 0's linears whose input needs no gradient (the embedding is frozen): those up to the
    first stage with an adapted linear."""
    skip: tuple[str, ...] = ()
    for stage in _LAYER_STAGES:
        skip += stage
        if set(stage) & set(workload.lora_targets):
            break
    return skip


def checkpointed_mlp_copies(spec: ModelSpec, workload: Workload) -> int:
    """Autocast's cached copies at the top checkpointed layer's MLP in forward (full fine-tuning): every layer's
    up to it, less its down_proj's; the head's is not made yet."""
    if not workload.mixed:
        return 0
    top = top_checkpointed_layer(spec.num_layers, workload)
    return (top + 1) * layer_autocast_copy_bytes(spec) - layer_autocast_copy_bytes(spec, skip=tuple(
        name for name in spec.layer_linear_shapes() if name != "down_proj"))


def layer_adapter_cast_bytes(spec: ModelSpec, workload: Workload) -> int:
    """bf16 casts of one layer's adapters, lora_A's and lora_B's."""
    return _adapter_casts(spec, workload, ()) + _adapter_casts(spec, workload, (), lora_b=True)


def _adapter_casts(spec: ModelSpec, workload: Workload, skip: tuple[str, ...], lora_b: bool = False) -> int:
    """bf16 casts of one layer's lora_A weights (lora_B's with `lora_b`), less those of linears in `skip`."""
    shapes, rank = spec.layer_linear_shapes(), workload.lora_rank
    return sum(tensor_bytes(rank * (shapes[name][1] if lora_b else shapes[name][0]), "bf16")
               for name in lora_linear_targets(workload) if name not in skip)
