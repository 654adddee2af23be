"""Optimizer state and the optimizer step's temporaries, tensor by tensor.

- AdamW (torch): exp_avg and exp_avg_sq in the parameter's dtype, a 1-element fp32 `step` per
  parameter. Its step's temporaries depend on the implementation (torch/optim/adam.py):
  foreach (`_multi_tensor_adam`, torch's default on CUDA): `_foreach_sqrt(exp_avg_sq)` makes one
  temporary per tensor, as large as all parameters of a dtype group, all alive at once;
  fused (`_fused_adam`, `torch._fused_adamw_`): none, the kernel updates in place;
  for-loop (`_single_tensor_adam`): per tensor `exp_avg_sq.sqrt()` and its division by the bias
  correction (two tensors of its size), the division kept as `denom` until the next tensor's has
  been made: at worst the previous tensor's denom and twice the current one.
- SGD (momentum 0.9): one momentum buffer per parameter, no temporary.
- Adafactor (torch): factored second moment: a row and a column vector per matrix, the full
  tensor for vectors; the update materialises row x column: one parameter-sized temporary.
- AdamW8bit (bitsandbytes, blockwise): two uint8 moments plus one fp32 absmax per block of
  256 for tensors of at least 4096 elements, fp32 moments below; its kernel is fused.

Clipping (`clip_grad_norm_`, foreach on CUDA; torch/nn/utils/clip_grad.py) before the step: one
0-dim norm per gradient (a 512-byte block each), their `stack` (in the gradients' dtype) and the
total norm alive together, then the gradients are scaled in place (`_foreach_mul_`) by a clamped
scalar coefficient. The optimizer step in backward (torchtune) makes one optimizer per parameter:
each step's temporaries are those of one tensor, and there is no clipping.
"""

from __future__ import annotations

from llamem.analytic.common import r512, trains_base_weights
from llamem.analytic.weights import lora_matrices, trainable_numels
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import Workload

BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256
ADAMW_STEPS = {"adamw": "foreach", "adamw-fused": "fused", "adamw-loop": "loop"}
"""`--optimizer` spellings of torch AdamW and the step implementation each names (`adamw-foreach`
is spelt `adamw`)."""


def param_dtype(spec: ModelSpec, workload: Workload) -> str:
    return "fp32" if workload.uses_adapters else workload.weight_dtype


def optimizer_state_bytes(spec: ModelSpec, workload: Workload) -> dict[str, int]:
    numels = trainable_numels(spec, workload)
    dtype_bytes = DTYPE_BYTES[param_dtype(spec, workload)]
    count = len(numels)
    if workload.optimizer in ADAMW_STEPS:
        moment = sum(r512(n * dtype_bytes) for n in numels)
        return {"optimizer/exp_avg": moment, "optimizer/exp_avg_sq": moment, "optimizer/step": count * 512}
    if workload.optimizer == "sgd":
        return {"optimizer/momentum_buffer": sum(r512(n * dtype_bytes) for n in numels)}
    if workload.optimizer == "adafactor":
        return _adafactor_state(spec, workload, dtype_bytes)
    big = [n for n in numels if n >= BNB_MIN_8BIT_SIZE]
    small = [n for n in numels if n < BNB_MIN_8BIT_SIZE]
    moment = sum(r512(n) for n in big) + sum(r512(4 * n) for n in small)
    absmax = sum(r512(4 * -(-n // BNB_BLOCK)) for n in big)
    return {"optimizer/state1": moment, "optimizer/state2": moment,
            "optimizer/absmax1": absmax, "optimizer/absmax2": absmax, "optimizer/step": count * 512}


def _adafactor_state(spec: ModelSpec, workload: Workload, dtype_bytes: float) -> dict[str, int]:
    row = col = variance = 0
    for fan_in, fan_out in _trainable_shapes(spec, workload):
        if fan_in == 1:
            variance += r512(fan_out * dtype_bytes)
        else:
            row += r512(fan_out * dtype_bytes)
            col += r512(fan_in * dtype_bytes)
    count = len(trainable_numels(spec, workload))
    return {"optimizer/row_var": row, "optimizer/col_var": col, "optimizer/variance": variance,
            "optimizer/step": count * 512}


def adafactor_state_tensors(spec: ModelSpec, workload: Workload) -> list[int]:
    """torch Adafactor's state in creation order: per tensor the step, then the row and column
    variances of a matrix or the full variance of a vector."""
    dtype_bytes = DTYPE_BYTES[param_dtype(spec, workload)]
    out = []
    for fan_in, fan_out in _trainable_shapes(spec, workload):
        shape = [fan_out] if fan_in == 1 else [fan_out, fan_in]
        out += [512] + [r512(n * dtype_bytes) for n in shape]
    return out


def _trainable_shapes(spec: ModelSpec, workload: Workload) -> list[tuple[int, int]]:
    """(columns, rows) of each trainable tensor; vectors are (1, n)."""
    if workload.uses_adapters:
        return lora_matrices(spec, workload)
    h = spec.hidden_size
    # Every tensor of a layer (biases and Qwen3's q/k norms too), in ModelSpec.layer_params order: a linear's
    # weight as its (fan_in, fan_out), the rest vectors.
    linears = spec.layer_linear_shapes()
    layer = [linears[name.split(".")[-2]] if name.endswith("_proj.weight") else (1, numel)
             for name, numel in spec.layer_params(1 if spec.num_layers > 1 else 0)]
    shapes = [(h, spec.vocab_size)] + layer * spec.num_layers + [(1, h)]
    if spec.lm_head_params:
        shapes.append((h, spec.vocab_size))
    return shapes


def gradient_bytes(spec: ModelSpec, workload: Workload) -> int:
    dtype_bytes = DTYPE_BYTES[param_dtype(spec, workload)]
    return sum(r512(n * dtype_bytes) for n in trainable_numels(spec, workload))


def has_step_temporaries(workload: Workload) -> bool:
    """Whether optimizer.step() makes a parameter-sized temporary per tensor, all at once (foreach
    AdamW's sqrt, Adafactor's row x column); SGD, fused AdamW and bitsandbytes' fused kernels do
    not, and for-loop AdamW makes them one tensor at a time (`step_temporary_bytes`)."""
    return workload.optimizer in ("adamw", "adafactor")


def step_temporary_bytes(spec: ModelSpec, workload: Workload, gradient_total_bytes: int) -> int:
    """The step's temporaries at its worst moment: one per trainable tensor, as large as its
    gradient, all alive at once (foreach AdamW's sqrt, Adafactor's row x column); for-loop AdamW,
    the previous tensor's denom and two of the current one; none for fused AdamW, SGD and
    bitsandbytes."""
    if has_step_temporaries(workload):
        return gradient_total_bytes
    if workload.optimizer == "adamw-loop":
        sizes = _tensor_bytes(spec, workload)
        return max(2 * size + previous for size, previous in zip(sizes, [0] + sizes))
    return 0


def one_tensor_step_bytes(workload: Workload, size_bytes: int) -> int:
    """The temporaries of one tensor's step (the optimizer in backward steps one at a time): its
    foreach sqrt or Adafactor update (1x), for-loop AdamW's sqrt and denom (2x), none otherwise."""
    if has_step_temporaries(workload):
        return size_bytes
    return 2 * size_bytes if workload.optimizer == "adamw-loop" else 0


def clip_temporary_bytes(spec: ModelSpec, workload: Workload) -> int:
    """`clip_grad_norm_`'s worst moment: a 0-dim norm per gradient, their stack and the total norm;
    0 without clipping (`--max-grad-norm 0`, and the optimizer step in backward, which cannot)."""
    if workload.max_grad_norm <= 0 or workload.optimizer_in_backward:
        return 0
    count = len(trainable_numels(spec, workload))
    return count * 512 + r512(DTYPE_BYTES[param_dtype(spec, workload)] * count) + 512


def optimizer_phase_temporary_bytes(spec: ModelSpec, workload: Workload, gradient_total_bytes: int) -> int:
    """The optimizer phase's temporaries: clipping's, then the step's (they are never alive together)."""
    return max(clip_temporary_bytes(spec, workload), step_temporary_bytes(spec, workload, gradient_total_bytes))


def _tensor_bytes(spec: ModelSpec, workload: Workload) -> list[int]:
    """Each trainable tensor's bytes in the parameters' dtype, in the order the optimizer steps them."""
    dtype_bytes = DTYPE_BYTES[param_dtype(spec, workload)]
    return [r512(n * dtype_bytes) for n in trainable_numels(spec, workload)]


def non_layer_gradient_bytes(spec: ModelSpec, workload: Workload) -> int:
    """Full fine-tuning's gradients outside the decoder layers: the head's (untied), the
    embedding's and the final norm's, in the weight dtype."""
    dtype_bytes = DTYPE_BYTES[workload.weight_dtype]
    head = r512(dtype_bytes * spec.lm_head_params) if spec.lm_head_params else 0
    return head + r512(dtype_bytes * spec.embedding_params) + r512(dtype_bytes * spec.hidden_size)


def layer_gradient_bytes(spec: ModelSpec, workload: Workload, gradient_total_bytes: int) -> int:
    """One decoder layer's gradients: all of them less those outside the layers, over L (LoRA's
    adapters all sit in the layers)."""
    if not trains_base_weights(workload):
        return gradient_total_bytes // spec.num_layers
    return (gradient_total_bytes - non_layer_gradient_bytes(spec, workload)) // spec.num_layers
