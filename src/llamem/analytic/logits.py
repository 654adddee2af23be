"""Logits and loss buffers: often the single largest transient of a training step.

Hugging Face's `ForCausalLMLoss` upcasts the logits to fp32 (`logits.float()`), and
cross-entropy is log_softmax + nll_loss, log_softmax keeping its fp32 output for backward.
With T tokens and V the vocabulary, at the end of the forward pass:
  logits (e T V, held by the model output) + fp32 upcast (4 T V, unless already fp32)
  + log_softmax output (4 T V, saved).
In backward, nll_loss's gradient (4TV) and log_softmax's (4TV) sit beside the saved output.
Chunked loss (torchtune's CEWithChunkedOutputLoss, 8 chunks) upcasts one chunk at a time but
still keeps every chunk's log_softmax output; past one sequence each chunk of the head's input and
of the labels is a copy (the chunks are strided). Liger's fused linear cross-entropy (`--liger`,
`llamem.analytic.liger`) never makes the full logits: a chunk of rows at a time, its gradients
made in forward. Generation computes the logits of the last token only.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamem.analytic.common import r512, trains_base_weights
from llamem.analytic.liger import liger_bytes, liger_norm_backward_bytes
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import LOSS_CHUNKS, Workload


FINAL_NORM_BACKWARD_TENSORS = 5
"""fp32 T x h tensors alive at once in the final RMSNorm's backward (traced: pow, mul, div, mul)."""


@dataclass(frozen=True, slots=True)
class LogitsBytes:
    forward_peak: int
    """Head + loss buffers at the forward pass's worst moment."""
    saved: int
    """What stays for backward."""
    backward_peak: int
    """Head + loss buffers at the worst moment of the loss backward."""
    forward_gradient: int = 0
    """A head gradient made in forward (Liger's grad_weight), alive from then on (gradients)."""
    forward_weight_casts: int = 0
    """Autocast copies of the head's weight beyond the cached one at the forward's worst moment."""
    backward_temporaries: int = 0
    """Temporaries at the loss backward's worst moment beyond the loss's own (Liger: the final
    norm's backward, which is then the worst)."""


def training_logits(spec: ModelSpec, workload: Workload, distill: bool = False) -> LogitsBytes:
    """The head's and the loss's buffers of a training step (`distill`: a forward KL against a
    teacher's logits)."""
    if workload.liger:
        return _liger_loss(spec, workload)
    head_input = _head_input_bytes(spec, workload)
    if workload.loss == "chunked":
        return _chunked_loss(spec, workload, head_input)
    if distill:
        return _distillation_loss(spec, workload, head_input)
    return _full_loss(spec, workload, head_input)


def _logits_bytes_per_element(workload: Workload) -> int:
    """The head's output dtype: fp32 under fp32 compute, else 2 bytes (bf16/fp16, autocast too)."""
    return 4 if workload.compute_dtype == "fp32" else 2


def _head_input_bytes(spec: ModelSpec, workload: Workload) -> int:
    """lm_head keeps its input only when its weight trains. Counted here under autocast only (a
    bf16 cast of the fp32 final-norm output); in pure precision the input is the final norm's
    output, counted with the activations."""
    if not (trains_base_weights(workload) and workload.mixed):
        return 0
    return r512(2 * workload.batch * workload.seq * spec.hidden_size)


def _labels_bytes(workload: Workload) -> int:
    """ForCausalLMLoss pads and shifts the labels (two int64 copies); nll_loss adds its scalars."""
    T = workload.batch * workload.seq
    return _padded_labels_bytes(workload) + r512(8 * T) + 2 * 512


def _full_loss(spec: ModelSpec, workload: Workload, head_input: int) -> LogitsBytes:
    """forward: logits e T V + fp32 upcast 4 T V + log_softmax 4 T V + labels; backward: the saved
    log_softmax beside nll_loss's and log_softmax's gradients (4 T V each) and two scalars."""
    TV = workload.batch * workload.seq * spec.vocab_size
    e_logits = _logits_bytes_per_element(workload)
    upcast = r512(4 * TV) if e_logits < 4 else 0
    lsm = r512(4 * TV)
    forward_peak = head_input + r512(e_logits * TV) + upcast + lsm + _labels_bytes(workload)
    return LogitsBytes(forward_peak, head_input + lsm, head_input + lsm + 2 * r512(4 * TV) + 2 * 512)


def _distillation_loss(spec: ModelSpec, workload: Workload, head_input: int) -> LogitsBytes:
    """Student and teacher (bf16) logits; log_softmax of the CE and of both KL inputs (their fp32
    upcasts die at once); the KL's elementwise terms (t - s, exp(t), their product). Backward
    keeps the CE's and the student's log_softmax and exp(t)."""
    TV = workload.batch * workload.seq * spec.vocab_size
    e_logits = _logits_bytes_per_element(workload)
    lsm = r512(4 * TV)
    forward_peak = (head_input + r512(e_logits * TV) + r512(2 * TV) + 3 * lsm + 3 * r512(4 * TV)
                    + _labels_bytes(workload))
    saved = head_input + 3 * lsm
    return LogitsBytes(forward_peak, saved, saved + r512(4 * TV) + 2 * 512)


def _liger_loss(spec: ModelSpec, workload: Workload) -> LogitsBytes:
    """Liger's fused linear cross-entropy (`llamem.analytic.liger`): grad_input kept from forward to
    backward, grad_weight (the head's gradient) too; in backward it hands them on and the final
    RMSNorm's backward follows, Liger's own (`liger_norm_backward_bytes`: dX written into dY, an fp32
    partial weight gradient per SM)."""
    liger = liger_bytes(spec, workload)
    norm_backward = liger_norm_backward_bytes(spec, workload)
    # A tied head's grad_weight is never the gradient itself: autograd sums it with the embedding's.
    held = liger.gradient if spec.tie_word_embeddings else 0
    return LogitsBytes(forward_peak=liger.kept + liger.forward_extra + held, saved=liger.kept + held,
                       backward_peak=2 * 512 + held, forward_gradient=liger.gradient - held,
                       forward_weight_casts=liger.forward_weight_casts, backward_temporaries=norm_backward)


def _chunked_loss(spec: ModelSpec, workload: Workload, head_input: int) -> LogitsBytes:
    """torchtune's CEWithChunkedOutputLoss: every chunk's log_softmax (4 T V in all) is kept; one
    chunk's logits and fp32 upcast are alive at a time (ceil(s / 8) * b * V elements)."""
    vocab = spec.vocab_size
    e_logits = _logits_bytes_per_element(workload)
    lsm = r512(4 * workload.batch * workload.seq * vocab)
    chunk = -(-workload.seq // LOSS_CHUNKS) * workload.batch * vocab
    if not workload.mixed:
        return LogitsBytes(_pure_chunked_forward_peak(spec, workload, lsm, chunk), lsm,
                           _pure_chunked_backward_peak(spec, workload))
    # as without autocast: the padded labels (copied per chunk past one sequence), nll_loss's totals, the sum
    labels = _padded_labels_bytes(workload) + LOSS_CHUNKS * 512
    forward_peak = (head_input + lsm + r512(e_logits * chunk) + r512(4 * chunk) + labels
                    + (LOSS_CHUNKS - 1) * _chunk_copy_bytes(spec, workload)[1])
    if trains_base_weights(workload):
        backward_peak = (head_input + lsm + r512(4 * chunk) + r512(e_logits * chunk)
                         + _chunked_head_gradient_bytes(spec, workload))
    else:  # a frozen head (LoRA): as without autocast (its per-chunk casts are weights/autocast_copies)
        backward_peak = _pure_chunked_backward_peak(spec, workload)
    return LogitsBytes(forward_peak, head_input + lsm, backward_peak)


def _padded_labels_bytes(workload: Workload) -> int:
    """The labels padded by one position (int64) before they are shifted."""
    return r512(8 * workload.batch * (workload.seq + 1))


def _pure_chunked_forward_peak(spec: ModelSpec, workload: Workload, lsm: int, chunk: int) -> int:
    """The chunked loss's forward without autocast (traced). In 16-bit precision the worst moment is
    the last chunk's upcast: the previous chunk's fp32 logits are still referenced (a chunk's
    log_softmax output in size) beside the new head output and its upcast, the labels padded, each
    earlier chunk's nll_loss weight total and the running sum. In fp32 the upcast is the head output
    itself: the end of the loss, every log_softmax output and the last chunk's logits, three more
    scalars (the last nll_loss's output and weight total, the sum). Past one sequence, the chunks'
    copies (`_chunk_copy_bytes`)."""
    C, labels = LOSS_CHUNKS, _padded_labels_bytes(workload)
    hidden_copy, labels_copy = _chunk_copy_bytes(spec, workload)
    if workload.compute_dtype == "fp32":
        return lsm + r512(4 * chunk) + labels + (C + 3) * 512 + C * (hidden_copy + labels_copy)
    e_logits = _logits_bytes_per_element(workload)
    return (lsm + r512(e_logits * chunk) + r512(4 * chunk) + labels + C * 512
            + C * hidden_copy + (C - 1) * labels_copy)


def _chunk_copy_bytes(spec: ModelSpec, workload: Workload) -> tuple[int, int]:
    """(hidden, labels): what one chunk keeps of its contiguous copies when the batch has more than one
    sequence (a chunk of the sequence dimension is then strided): the head's input, kept for its weight's
    gradient when the head trains, and the int64 labels, kept by nll_loss."""
    if workload.batch == 1:
        return 0, 0
    tokens = -(-workload.seq // LOSS_CHUNKS) * workload.batch
    hidden = r512(_logits_bytes_per_element(workload) * tokens * spec.hidden_size)
    return (hidden if trains_base_weights(workload) else 0), r512(8 * tokens)


def _pure_chunked_backward_peak(spec: ModelSpec, workload: Workload) -> int:
    """The chunked loss's backward without autocast, or with it under a frozen head, chunk by chunk
    (traced): chunk j's nll_loss and log_softmax gradients beside the log_softmax outputs not yet
    consumed, then its head weight gradient summed out of place with the running sum (three head-sized
    tensors at once from the second chunk on), while split's backward keeps every chunk's gradient of
    the hidden states until the last. A frozen head (LoRA) makes no weight gradient. Chunks not yet
    reached keep their copies (`_chunk_copy_bytes`; chunk j's labels die with its nll_loss backward, its
    input with the head's). The worst of these moments."""
    C, e = LOSS_CHUNKS, _logits_bytes_per_element(workload)
    tokens = -(-workload.seq // C) * workload.batch
    chunk_lsm, cast = r512(4 * tokens * spec.vocab_size), r512(e * tokens * spec.vocab_size)
    head = r512(e * spec.vocab_size * spec.hidden_size) if trains_base_weights(workload) else 0
    hidden = r512(e * tokens * spec.hidden_size)
    hidden_copy, labels_copy = _chunk_copy_bytes(spec, workload)
    # the padded labels outlive the forward only through views, when the chunks need no copies
    labels = 0 if labels_copy else _padded_labels_bytes(workload)
    moments = []
    for j in range(1, C + 1):
        held = (C - j + 3) * 512 + labels + (C - j) * labels_copy + (C - j + 1) * hidden_copy
        running = head if j > 1 else 0
        moments.append((C - j + 1) * chunk_lsm + 2 * chunk_lsm + running + (j - 1) * hidden + held)
        if j == 1:
            moments.append((C - 1) * chunk_lsm + head + hidden + cast + held)
        else:
            moments.append((C - j) * chunk_lsm + 3 * head + j * hidden + held - hidden_copy)
    return max(moments)


def _chunked_head_gradient_bytes(spec: ModelSpec, workload: Workload) -> int:
    """Each chunk's backward adds its share of the head's weight gradient out of place: the
    running sum (weight dtype) and the new part (compute dtype) are alive together."""
    if not trains_base_weights(workload):
        return 0
    head_numel = spec.vocab_size * spec.hidden_size
    return (r512(DTYPE_BYTES[workload.weight_dtype] * head_numel)
            + r512(DTYPE_BYTES[workload.compute_dtype] * head_numel))


def decode_logits_bytes(spec: ModelSpec, workload: Workload) -> int:
    """One decode step's logits (one token per sequence, compute dtype) and their fp32 upcast."""
    vocab = workload.batch * spec.vocab_size
    return r512(DTYPE_BYTES[workload.compute_dtype] * vocab) + r512(4 * vocab)
