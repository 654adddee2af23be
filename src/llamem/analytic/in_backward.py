"""The optimizer step in backward (`--optimizer-in-backward`, torchtune's `optimizer_in_bwd`).

torchtune builds one optimizer per parameter and registers a post-accumulate-grad hook that
steps it and sets the gradient to None (`training.register_optim_in_bwd_hooks`): each gradient
lives from its AccumulateGrad to the end of its own step, whose temporaries are those of one
tensor (`optimizer.one_tensor_step_bytes`); there is no optimizer phase and no clipping.

The moments that can then be the worst of backward, beyond the loss's and a checkpointed layer's
(whose gradients shrink to the layer's own, stepped at once):
- the untied head's gradient (full fine-tuning): in pure precision it is made inside the head's
  matmul backward, beside the logits' gradient (e T V) and the hidden states' (e T h); under
  autocast the matmul makes a bf16 gradient, freed once its cast's backward made the fp32 one,
  after the head's weight copy was released; then the head's step, the activations all saved,
  the hidden states' gradient (the head's input in pure precision released);
- the embedding's gradient at the end of backward, and its step (a tied head's two gradients are
  summed first, out of place, as without the hook).
Traced on transformers 5.x and torch 2.13 (tests/test_optim_variants.py).

Under `--compile` no hook fires inside the compiled graph: its backward hands out every gradient it
makes when it returns, so backward's moments are the compiled ones (`analytic.compiled`, gradients
as without the hook) and then the first step with every gradient alive (`compiled_in_backward_moments`).
"""

from __future__ import annotations

from llamem.analytic.common import add_breakdowns, r512, trains_base_weights
from llamem.analytic.compiled import copies_kept_bytes, decoder_output_bytes, saved_activation_bytes
from llamem.analytic.liger import liger_bytes
from llamem.analytic.optimizer import one_tensor_step_bytes, param_dtype
from llamem.analytic.weights import trainable_numels
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import Workload

LOSS_SCALARS = 2 * 512
"""The loss and its gradient (0-dim tensors), alive through the head's backward."""


def head_gradient_moments(spec: ModelSpec, w: Workload, saved_activation_bytes: int,
                          copies_in_backward_bytes: int) -> list[dict[str, int]]:
    """The untied head's gradient being made, and its step (beyond what persists through the step)."""
    if w.liger and trains_base_weights(w):
        return [_liger_head_step(spec, w, saved_activation_bytes, copies_in_backward_bytes)]
    if not (trains_base_weights(w) and spec.lm_head_params):
        return []
    T, h, V = w.batch * w.seq, spec.hidden_size, spec.vocab_size
    head = r512(DTYPE_BYTES[w.weight_dtype] * V * h)
    step = one_tensor_step_bytes(w, head)
    if w.mixed:
        copies = copies_in_backward_bytes - r512(2 * V * h)  # the head's weight copy released
        hidden_grad = r512(4 * T * h) + LOSS_SCALARS  # the input cast's backward: fp32
        made = {"logits": r512(2 * V * h) + hidden_grad, "activations": saved_activation_bytes}
        stepped = {"logits": hidden_grad, "activations": saved_activation_bytes}
    else:
        e = DTYPE_BYTES[w.compute_dtype]
        copies = 0
        hidden_grad = r512(e * T * h) + LOSS_SCALARS
        made = {"logits": r512(e * T * V) + hidden_grad, "activations": saved_activation_bytes}
        # the head's saved input (the final norm's output) is released with its backward
        stepped = {"logits": hidden_grad, "activations": saved_activation_bytes - r512(e * T * h)}
    common = {"weights/autocast_copies": copies, "gradients": head}
    return [{**common, **made}, {**common, **stepped, "temporaries": step}]


def _liger_head_step(spec: ModelSpec, w: Workload, saved_activation_bytes: int,
                     copies_in_backward_bytes: int) -> dict[str, int]:
    """Liger made the head's gradient in forward; backward hands it on first and the head is
    stepped at once, beside Liger's grad_input (a tied head waits for the embedding's part)."""
    if spec.tie_word_embeddings:
        return {}
    liger = liger_bytes(spec, w)
    return {"activations": saved_activation_bytes, "weights/autocast_copies": copies_in_backward_bytes,
            "logits": liger.kept + LOSS_SCALARS, "gradients": liger.gradient,
            "temporaries": one_tensor_step_bytes(w, liger.gradient)}


def end_of_backward_moments(spec: ModelSpec, w: Workload, tied_sum: dict[str, int]) -> list[dict[str, int]]:
    """The embedding's gradient (a tied head's summed with it first) and its step; adapters are
    stepped one by one, each too small to matter."""
    if not trains_base_weights(w):
        return []
    embedding = r512(DTYPE_BYTES[w.weight_dtype] * spec.embedding_params)
    # The sum comes first: of two equal moments the trace names the earlier.
    moments = [{"gradients": embedding, **tied_sum}] if tied_sum else []
    return moments + [{"gradients": embedding, "temporaries": one_tensor_step_bytes(w, embedding)}]


def layer_gradient_in_backward(spec: ModelSpec, w: Workload) -> tuple[int, int]:
    """(gradient, step temporaries) alive in a checkpointed layer's backward: its first weight
    gradient (down_proj's), stepped at once; adapters' are negligible."""
    if not trains_base_weights(w):
        return 0, 0
    own = r512(DTYPE_BYTES[w.weight_dtype] * spec.hidden_size * spec.intermediate_size)
    return own, one_tensor_step_bytes(w, own)


def compiled_in_backward_moments(spec: ModelSpec, w: Workload, persistent: dict[str, int], grads: int,
                                 end_extra: dict[str, int], layer_backward: list[dict[str, int]],
                                 copies: int) -> list[dict[str, int]]:
    """Backward's moments under `--compile` beyond the loss's (`layer_backward`: the compiled ones).
    No hook fires inside a compiled graph: its backward returns every gradient it made together, and
    the hooks then step them one by one, the first (traced, torch 2.13: the largest, the embedding's or
    the head's) beside all the others. Without checkpointing the whole model is one graph: the end of
    backward as without the hook (`compiled.end_of_backward_extra`), then that first step. With
    checkpointing the head is a graph of its own (`compiled.decoder_output_bytes`): an untied head's
    gradient is stepped as soon as that graph returns, beside the decoder's saved set, the plain layers'
    weight copies and the hidden states' gradient (s'Th), and is gone from every later moment."""
    head = _separate_head_bytes(spec, w)
    rest = grads - head
    layers = [{**moment, "gradients": moment.get("gradients", 0) - head} for moment in layer_backward]
    moments = [add_breakdowns({"gradients": rest}, end_extra),
               {"gradients": rest, "temporaries": one_tensor_step_bytes(w, _largest_tensor_bytes(spec, w))}]
    if head:
        head_copy = r512(2 * spec.lm_head_params) if w.mixed else 0  # released with the head's backward
        moments.append({"weights/autocast_copies": copies_kept_bytes(spec, w, copies) - head_copy,
                        "activations": saved_activation_bytes(spec, w),
                        "logits": decoder_output_bytes(spec, w),  # its gradient
                        "gradients": head, "temporaries": one_tensor_step_bytes(w, head)})
    return layers + [add_breakdowns(persistent, moment) for moment in moments]


def _separate_head_bytes(spec: ModelSpec, w: Workload) -> int:
    """An untied trained head's gradient where the head is a compiled graph of its own (checkpointing)."""
    if not (w.ac_every and trains_base_weights(w) and spec.lm_head_params) or spec.tie_word_embeddings:
        return 0
    return r512(DTYPE_BYTES[w.weight_dtype] * spec.lm_head_params)


def _largest_tensor_bytes(spec: ModelSpec, w: Workload) -> int:
    """The largest trainable tensor (the embedding's: a stepped head's twin)."""
    return r512(DTYPE_BYTES[param_dtype(spec, w)] * max(trainable_numels(spec, w)))
