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
Only the fused linear cross-entropy is sized; Liger's RMSNorm, SwiGLU and RoPE kernels are not.
"""

from __future__ import annotations

from dataclasses import dataclass

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
        # first matmul of a chunk: the previous chunk's logits and hidden cast, this chunk's hidden
        # cast, the weight view's copy and the new logits
        first = 2 * logits + 2 * r512(2 * rows * h)
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
