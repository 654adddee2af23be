"""Logits and loss buffers: often the single largest transient of a training step.

Hugging Face's `ForCausalLMLoss` upcasts the logits to fp32 (`logits.float()`), and
cross-entropy is log_softmax + nll_loss, log_softmax keeping its fp32 output for backward.
With T tokens and V the vocabulary, at the end of the forward pass:
  logits (e T V, held by the model output) + fp32 upcast (4 T V, unless already fp32)
  + log_softmax output (4 T V, saved).
In backward, nll_loss's gradient (4TV) and log_softmax's (4TV) sit beside the saved output.
Chunked loss (torchtune's CEWithChunkedOutputLoss, 8 chunks) upcasts one chunk at a time but
still keeps every chunk's log_softmax output.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamem.analytic.common import r512
from llamem.workload import LOSS_CHUNKS, Workload


@dataclass(frozen=True, slots=True)
class LogitsBytes:
    forward_peak: int
    """Head + loss buffers at the forward pass's worst moment."""
    saved: int
    """What stays for backward."""
    backward_peak: int
    """Head + loss buffers at the worst moment of the loss backward."""


def training_logits(workload: Workload, vocab_size: int, hidden_size: int, head_trains: bool,
                    teacher: bool = False, head_grad_bytes: int = 0) -> LogitsBytes:
    T = workload.batch * workload.seq
    TV = T * vocab_size
    # ForCausalLMLoss pads and shifts the labels (two int64 copies); nll_loss adds its scalars.
    labels = r512(8 * workload.batch * (workload.seq + 1)) + r512(8 * T) + 2 * 512
    e_logits = 4 if workload.compute_dtype == "fp32" else 2
    upcast = r512(4 * TV) if e_logits < 4 else 0
    lsm = r512(4 * TV)
    # lm_head keeps its input only when its weight trains; under autocast that input is a bf16 cast.
    head_input = r512((2 if workload.mixed else e_logits) * T * hidden_size) if head_trains else 0
    if workload.loss == "chunked":
        chunk = -(-workload.seq // LOSS_CHUNKS) * workload.batch * vocab_size
        # In pure precision the previous chunk's head output is still referenced while the next
        # chunk's is made (seen in traces; under autocast the cast chain releases it earlier).
        held = 1 if workload.mixed else 2
        forward_peak = (head_input + lsm + held * r512(e_logits * chunk)
                        + (r512(4 * chunk) if e_logits < 4 else 0))
        # Each chunk's backward adds its share of the head's weight gradient out of place: the
        # running sum (weight dtype) and the new part (compute dtype) are alive together.
        return LogitsBytes(forward_peak, head_input + lsm,
                           head_input + lsm + r512(4 * chunk) + r512(e_logits * chunk) + head_grad_bytes)
    if teacher:
        # Student and teacher logits; log_softmax of the CE and of both KL inputs (their fp32
        # upcasts die at once); the KL's elementwise terms (t - s, exp(t), their product).
        # Backward keeps the CE's and the student's log_softmax and exp(t).
        forward_peak = head_input + r512(e_logits * TV) + r512(2 * TV) + 3 * lsm + 3 * r512(4 * TV) + labels
        saved = head_input + 3 * lsm
        return LogitsBytes(forward_peak, saved, saved + r512(4 * TV) + 2 * 512)
    forward_peak = head_input + r512(e_logits * TV) + upcast + lsm + labels
    return LogitsBytes(forward_peak, head_input + lsm, head_input + lsm + 2 * r512(4 * TV) + 2 * 512)
