"""Liger-Kernel's fused linear cross-entropy, tensor by tensor (`--liger`).

`LigerFusedLinearCrossEntropyFunction` (liger_kernel/ops/fused_linear_cross_entropy.py) never
makes the full logits: it splits the T = b s tokens into chunks of c rows, c the power of two
at or above T / ceil(V / h), and for each chunk makes the chunk's logits (c x V, the compute
dtype), lets its Triton kernel write the loss and the logits' gradient into them in place, and
multiplies them back at once: into `grad_input` (T x h, the hidden states' dtype, kept for
backward) and, when the head trains, into `grad_weight` (V x h, the weight's dtype, kept for
backward, then the head's gradient). Its backward only returns the two.

In forward, beyond those two and `loss_1d` (fp32, T) and the target mask (bool, T):
- a chunk's logits live until the next chunk's have been made (a local reassigned), so two
  chunks of logits are alive at each chunk's first matmul;
- under autocast the matmul casts the chunk of hidden states and the head's weight, a view
  (`weight.t()`) that autocast does not cache: a bf16 copy of the weight per chunk, freed at
  once; the second matmul (`grad_logits @ weight`) casts the weight itself, cached until the
  autocast region ends; the weight gradient is accumulated in place in fp32 (`addmm` with
  `out_dtype`, Ampere and later), after a bf16 cast of the chunk of hidden states, a local
  that lives until the next chunk's;
- in pure bf16/fp16 the weight gradient's part is `mm(...).float()`: a V x h product in the
  compute dtype and its fp32 copy, alive together; in fp32 the product only.
Liger's other kernels (`llamem.trace.liger_kernels`) change the layers: its RMSNorm keeps its input X
and an fp32 rstd (no fp32 upcast), its SwiGLU keeps gate and up only, its RoPE rotates q and k in
place (no fp32 copies under autocast, so the training cache's K is attention's own); sized in
`activations.py`, with the moments they move below (the top layer's backward, and for adapters the top
layer's forward).
"""

from __future__ import annotations

from dataclasses import dataclass

from llamem.analytic.activations import adapted_down_proj_saved_bytes
from llamem.analytic.common import r512, trains_base_weights
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import Workload


def next_power_of_two(n: int) -> int:
    """triton.next_power_of_2: the smallest power of two at or above n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def liger_chunk_rows(tokens: int, vocab: int, hidden: int) -> int:
    """Rows per chunk: `next_power_of_2(cdiv(BT, cdiv(V, H)))`, so a chunk's logits are about as
    large as the hidden states."""
    return next_power_of_two(-(-tokens // -(-vocab // hidden)))


@dataclass(frozen=True, slots=True)
class LigerBytes:
    kept: int
    """grad_input: made at the start of the loss, handed to the final norm's backward."""
    gradient: int
    """grad_weight (the head trains): made at the start of the loss, the head's gradient from then on."""
    forward_extra: int
    """Beyond `kept`, at the forward's worst moment (logits category)."""
    forward_weight_casts: int
    """Autocast's bf16 copies of the head's weight at that moment (weights/autocast_copies):
    the per-chunk copy of the weight's view; the cached copy is counted with the other copies."""


def liger_bytes(spec: ModelSpec, w: Workload) -> LigerBytes:
    """Liger's buffers for a training step (see the module docstring)."""
    T, h, V = w.batch * w.seq, spec.hidden_size, spec.vocab_size
    e = DTYPE_BYTES[w.compute_dtype]
    hidden_bytes = 4 if w.mixed else e  # the final norm's output: fp32 under autocast
    head_trains = trains_base_weights(w)
    rows = min(liger_chunk_rows(T, V, h), T)
    grad_weight = r512(DTYPE_BYTES[w.weight_dtype] * V * h) if head_trains else 0
    kept = r512(hidden_bytes * T * h)
    fixed = r512(4 * T) + r512(T) + _labels_bytes(w)
    logits = r512(e * rows * V)
    if w.mixed:
        # first matmul of a chunk: the previous chunk's logits, this chunk's hidden cast, the weight view's
        # copy and the new logits; with the head training also the previous chunk's hidden cast (the weight
        # gradient's, a local), which a frozen head never makes (the matmul's own cast dies at once)
        first = 2 * logits + (2 if head_trains else 1) * r512(2 * rows * h)
        return LigerBytes(kept, grad_weight, fixed + first, r512(2 * V * h))
    first = 2 * logits
    weight_part = (r512(e * V * h) + (r512(4 * V * h) if e < 4 else 0)) if head_trains else 0
    return LigerBytes(kept, grad_weight, fixed + max(first, logits + weight_part), 0)


def liger_uncached_copy_bytes(spec: ModelSpec, w: Workload) -> int:
    """Under autocast Liger saves no copy of the head's weight for backward: autocast's cached copy
    dies with the autocast region, where the plain head's matmul keeps it until its backward."""
    return r512(2 * spec.vocab_size * spec.hidden_size) if (w.liger and w.mixed) else 0


def _labels_bytes(w: Workload) -> int:
    """LigerForCausalLMLoss pads the labels and makes the shifted copy contiguous (int64 each)."""
    return r512(8 * w.batch * (w.seq + 1)) + r512(8 * w.batch * w.seq)


def liger_top_layer_backward(spec: ModelSpec, w: Workload, saved_activation_bytes: int,
                             stream_bytes: int) -> dict[str, int]:
    """With Liger's RMSNorm the final norm's backward makes almost nothing (dX is written into dY): the
    worst moment of a plain step's backward moves to the top layer's down_proj backward. Alive beyond
    what persists: the saved activations less the final norm's (the top layer's output, its rstd and,
    in pure precision, its output the plain head would keep), the stream gradient (Liger's grad_input,
    handed on), the gradient of the SwiGLU product (T x I) and, when the base trains, the head's and the
    final norm's gradients and down_proj's: under autocast still its bf16 product (the fp32 gradient
    comes after). Under autocast also the stream gradient's bf16 cast, whether down_proj trains or not."""
    liger = liger_bytes(spec, w)
    T, h, I = w.batch * w.seq, spec.hidden_size, spec.intermediate_size
    wb, e = DTYPE_BYTES[w.weight_dtype], DTYPE_BYTES[w.compute_dtype]
    held = liger.gradient if spec.tie_word_embeddings else 0
    trains = trains_base_weights(w)
    gradients, temporaries = liger.gradient - held, r512(e * T * I)
    if w.quant != "none":  # down_proj's dequantized weight, for its input's gradient
        temporaries += r512(e * h * I)
    freed = stream_bytes + r512(4 * T) + (stream_bytes if trains and not w.mixed else 0)
    if w.quant == "none" and "down_proj" in w.lora_targets and not trains:
        temporaries, lora_freed = lora_chain_moment(spec, w)
        freed += lora_freed
    elif w.mixed:  # the stream gradient's bf16 cast, which down_proj's matmuls read, frozen or not
        temporaries += r512(2 * T * h)
    if trains:
        gradients += r512(wb * h)
        if w.mixed:
            temporaries += r512(2 * h * I)
        else:
            gradients += r512(wb * h * I)
    return {"activations": saved_activation_bytes - freed, "logits": liger.kept + held,
            "gradients": gradients, "temporaries": temporaries}


def lora_chain_moment(spec: ModelSpec, w: Workload) -> tuple[int, int]:
    """(temporaries, saved bytes let go) at an adapted down_proj's worst backward moment, lora_A's input
    gradient (fp32 T x I: peft runs lora_A on its fp32 cast of the product), which its LoRA chain makes before
    the frozen base's matmul. Under autocast lora_A's bf16 input cast and its output are let go by then, and
    the gradient is being cast to bf16 for the product's, beside the stream gradient's bf16 cast. In pure
    precision lora_A still holds its fp32 input, and lora_B's input gradient (fp32 T x r) and the base output's
    gradient in the compute dtype are alive."""
    T, h, I, rank = w.batch * w.seq, spec.hidden_size, spec.intermediate_size, w.lora_rank
    gradient = r512(4 * T * I)
    if DTYPE_BYTES[w.compute_dtype] == 4:  # no casts: lora_A keeps the product itself, let go with its gradient
        # made; the worst is the sum of the chain's and the base's input gradients, three fp32 T x I
        return 3 * gradient, adapted_down_proj_saved_bytes(spec, w)
    if w.mixed:
        return r512(2 * T * h) + gradient + r512(2 * T * I), adapted_down_proj_saved_bytes(spec, w)
    return r512(DTYPE_BYTES[w.compute_dtype] * T * h) + r512(4 * T * rank) + gradient, 0


LIGER_NUM_SMS = 132
"""SMs of the card Liger's RMSNorm backward is sized for (an H100 SXM or H200): one fp32 row each."""


def liger_norm_backward_bytes(spec: ModelSpec, w: Workload) -> int:
    """`rms_norm_backward`: the fp32 partial weight gradient (SMs x h), its sum over SMs (fp32 h) and
    that sum cast to the weight's dtype (made whether or not the weight trains)."""
    h, wb = spec.hidden_size, DTYPE_BYTES[w.weight_dtype]
    return r512(4 * LIGER_NUM_SMS * h) + r512(4 * h) + (r512(wb * h) if wb != 4 else 0)


def liger_top_layer_forward(spec: ModelSpec, w: Workload, forward_activation_bytes: int) -> dict[str, int]:
    """Adapters under Liger: the frozen head makes the fused loss cheap (no weight gradient), so the
    forward's worst moment can be the top layer's down_proj: every saved tensor, plus the SwiGLU
    product (down_proj's input, never kept itself by a frozen or adapted down_proj), down_proj's output,
    with a quantized base its dequantized weight, and with an adapted down_proj lora_B's output and its
    scaled copy (fp32; bf16 under autocast, with peft's fp32 cast of the product alive)."""
    T, h, I, e = w.batch * w.seq, spec.hidden_size, spec.intermediate_size, DTYPE_BYTES[w.compute_dtype]
    adapted_fp32 = e == 4 and "down_proj" in w.lora_targets  # the product is lora_A's saved input itself
    extra = (0 if adapted_fp32 else r512(e * T * I)) + r512(e * T * h)
    if w.quant != "none":
        extra += r512(e * h * I)
    if "down_proj" in w.lora_targets:  # under autocast lora_B's output is bf16, beside peft's fp32 cast of the product
        extra += 2 * r512((2 if w.mixed else 4) * T * h) + (r512(4 * T * I) if w.mixed else 0)
    return {"activations": forward_activation_bytes + extra}
