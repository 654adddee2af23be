"""The backward pass's worst moments besides the loss backward: a checkpointed layer's backward
and the end of backward.

Checkpointed layer i (`--ac full` / `every-K`: layers 0, K, 2K, ... keep only their input):
the layers below keep their checkpoint inputs (or, not checkpointed, their saved sets), layer i
has its full saved set back (recomputed; less the SwiGLU product, which down_proj's backward has
freed), the gradients of the head and of the layers above exist, and the layer's own backward
temporaries are alive: a residual-stream gradient and three MLP-sized ones. Memory is linear in
i between the ends, so the top and the bottom layers are the candidates.

End of backward: every gradient; a tied head's gradient summation (autograd adds the head's and
the embedding's gradients out of place).

Source: torch.utils.checkpoint (non-reentrant), autograd's AccumulateGrad, transformers 5.x
`modeling_llama.py`; held to the trace engine by tests/test_accuracy.py.
Left out: the exact op order inside the layer's backward (schedule_train.py replays it).
"""

from __future__ import annotations

from llamem.analytic.activations import checkpoint_mask_bytes, compute_bytes, rope_bytes, stream_bytes
from llamem.analytic.common import r512, trains_base_weights
from llamem.analytic.llama4 import extra_mask_bytes
from llamem.analytic.optimizer import layer_gradient_bytes
from llamem.analytic.selective import selective_kept_bytes
from llamem.analytic.weights import layer_autocast_copy_bytes
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import Workload


def checkpointed_backward_moments(spec: ModelSpec, w: Workload, gradient_total_bytes: int,
                                  layer_saved_bytes: int) -> list[dict[str, int]]:
    """The backward of the top and of the bottom checkpointed layer (none without checkpointing),
    beyond what persists through the step. `layer_saved_bytes`: one plain layer's saved set.
    Below layer i: ceil(i / K) checkpoint inputs (one residual-stream tensor each) and the rest
    plain layers with their saved sets and, under autocast, their weight copies."""
    if not w.ac_every:
        return []
    current = (_current_layer_bytes(spec, w, layer_saved_bytes) + rope_bytes(spec, w) + checkpoint_mask_bytes(w, spec)
               + extra_mask_bytes(spec, w))
    temporaries = _layer_backward_temporaries(spec, w)
    # What each checkpoint keeps: its input and, selective, its policy's outputs.
    checkpoint = stream_bytes(w, spec) + selective_kept_bytes(spec, w)
    per_layer_copies, current_copies = _autocast_copies(spec, w)
    moments = []
    for index in (spec.num_layers - 1, 0):
        checkpointed_below = -(-index // w.ac_every)
        plain_below = index - checkpointed_below
        moments.append({"gradients": gradients_alive(spec, w, gradient_total_bytes, index),
                        "weights/autocast_copies": plain_below * per_layer_copies + current_copies,
                        "activations": checkpointed_below * checkpoint + plain_below * layer_saved_bytes + current,
                        "temporaries": temporaries})
    return moments


def _mlp_tensor_bytes(spec: ModelSpec, w: Workload) -> int:
    """One MLP-sized activation or gradient (T x I; bf16 under autocast)."""
    return r512((2 if w.mixed else compute_bytes(w)) * w.batch * w.seq * spec.intermediate_size)


def gradients_alive(spec: ModelSpec, w: Workload, gradient_total_bytes: int, index: int) -> int:
    """Gradients alive in layer `index`'s backward: the head's and the final norm's (full
    fine-tuning), the layers' above, and the first of the layer's own (down_proj's)."""
    above = (spec.num_layers - 1 - index) * layer_gradient_bytes(spec, w, gradient_total_bytes)
    if not trains_base_weights(w):
        return above
    wb = DTYPE_BYTES[w.weight_dtype]
    head = r512(wb * spec.lm_head_params) + r512(wb * spec.hidden_size)
    own = r512(wb * spec.hidden_size * spec.intermediate_size)
    return head + above + own


def _autocast_copies(spec: ModelSpec, w: Workload) -> tuple[int, int]:
    """(a plain layer's weight copies, the current layer's) under autocast: the current layer's
    recompute made its own, less down_proj's (gone with its backward, before the worst moment)."""
    if not w.mixed:
        return 0, 0
    return layer_autocast_copy_bytes(spec), layer_autocast_copy_bytes(spec, skip=("down_proj",))


def _current_layer_bytes(spec: ModelSpec, w: Workload, layer_saved_bytes: int) -> int:
    """The current layer's recomputed saved set, less the SwiGLU product down_proj's backward has
    freed (full fine-tuning keeps it); in pure bf16/fp16 the recompute also rebuilds the residual
    mid-point h1 (a local of the recomputed forward; with an fp32 stream it is part of the saved set)."""
    current = layer_saved_bytes - (_mlp_tensor_bytes(spec, w) if trains_base_weights(w) else 0)
    recomputed_h1 = 0 if (w.mixed or compute_bytes(w) == 4) else stream_bytes(w, spec)
    return current + recomputed_h1


def _layer_backward_temporaries(spec: ModelSpec, w: Workload) -> int:
    """A residual-stream gradient and three MLP-sized ones."""
    return stream_bytes(w, spec) + 3 * _mlp_tensor_bytes(spec, w)


def tied_gradient_sum(spec: ModelSpec, w: Workload) -> dict[str, int]:
    """A tied matrix gets two gradients (head, then embedding); AccumulateGrad adds them out of
    place, so for a moment the head's, the embedding's and their sum are all alive (2 V h
    weight-dtype bytes beyond the gradients; with accumulation the earlier micro-batches'
    gradient is added to as well, one more)."""
    if not (spec.tie_word_embeddings and trains_base_weights(w)):
        return {}
    tied = r512(DTYPE_BYTES[w.weight_dtype] * spec.embedding_params)
    return {"logits": tied, "temporaries": 2 * tied if w.grad_accum > 1 else tied}
