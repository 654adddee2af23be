"""`--compile`: what a training step under `torch.compile` keeps, as AOT autograd's partitioner
(the one inductor uses) decides it, and what inductor's fused kernels still materialise.

Derived from compiled traces (`llamem trace --compile`, `llamem.trace.compiled`) of the debug
model, TinyLlama, Llama-3.2-1B, Llama-2-7B and Llama-3.1-8B (two layers) at several shapes, with T = batch * seq tokens, h hidden,
q = heads * head_dim, kv = kv_heads * head_dim, I the MLP width, V the vocabulary, e' the bytes
of the compute dtype (bf16 under autocast) and s' those of the residual stream (fp32 under
autocast). What the forward graph saves, per decoder layer:

- each RMSNorm its rsqrt (4T) only: the normalised output is recomputed in backward;
- one copy of each norm's output in the compute dtype for the linears that read it (e'Th each;
  eager autocast casts it once per linear), where their weights train; LoRA one fp32 cast of
  the input per adapted group (4 T fan_in) and lora_A's output per adapter (4 T r);
- attention q, k, v (after RoPE), its output and logsumexp, as in eager;
- the matmul outputs gate and up (e'TI each) and, where down_proj trains, their product (e'TI);
  SiLU's output is recomputed;
- the residual stream at the attention's output and at the layer's output (s'Th each; layer 0
  under autocast keeps o_proj's bf16 output instead of the first).

Model level: the embedding output (full fine-tuning), the final norm's rsqrt, the head's input
cast, the bf16 logits, the shifted labels and the loss's two per-token statistics (max and
log-sum-exp); the fp32 upcast and log_softmax are fused into the loss kernels and never exist.
The compiled graph's outputs that need no gradient still get one in backward: AOT autograd
materialises zeros for the logits and the cache tensors the model returns. The loss backward
then makes nll_loss's fp32 gradient (4TV, a scatter: not fused). At the end of backward the
embedding's gradient is accumulated in fp32 (index_put into a V x h fp32 buffer) and, for bf16
weights, cast down.

With checkpointing, a checkpointed layer keeps its input only (its weight copies are recomputed),
the materialised mask is kept by every one of them, and a layer's backward has most of its saved
set back (`checkpointed_layer_moments`). The chunked loss compiles the decoder only: the head and
the loss run per chunk outside it (`chunked_loss_backward_bytes`). Under selective checkpointing a
checkpointed layer keeps the policy's outputs that backward reads (`selective_layer_saved_bytes`)
and the decoder's backward moments are its attention recompute and its MLP's weight gradients
(`selective_layer_moments`), traced on Llama-3.2-1B, TinyLlama and Llama-3.1-8B.
Left out: inductor's own buffer reuse inside a kernel (a fused chain is one buffer), graph breaks
other than the one checkpointing causes. Sized for Llama, Mistral, Qwen2 (its q/k/v biases are added
inside addmm: nothing more is saved) and Qwen3 (q_norm and k_norm keep their inputs and rsqrt per head);
the mixture-of-experts types (Mixtral, Qwen3-MoE, Llama 4) are refused: their router, top-k and
grouped expert matmuls were not traced compiled, and their token counts per expert are data-dependent.
"""

from __future__ import annotations

from llamem.analytic import activations as act
from llamem.analytic.common import add_breakdowns, r512, trains_base_weights
from llamem.analytic.selective import attention_kept_sizes, kept_matmul_outputs
from llamem.analytic.weights import adapter_dtype, layer_autocast_copy_bytes
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import LOSS_CHUNKS, Workload

COMPILED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""The model types whose compiled graphs were traced to derive these terms."""
INPUT_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))
"""The linears that read one tensor: a LoRA group shares one fp32 cast of it."""


def _sizes(spec: ModelSpec, w: Workload) -> tuple[int, int, int]:
    """(T, e', s'): tokens, the activations' dtype bytes, the residual stream's."""
    e = act.compute_bytes(w)
    return w.batch * w.seq, (2 if w.mixed else e), (4 if w.mixed else e)


def _lora_saved(spec: ModelSpec, w: Workload) -> int:
    """Per adapted group one fp32 cast of its input, per adapter lora_A's output (4 T r)."""
    T = w.batch * w.seq
    fan_in = {name: shape[0] for name, shape in spec.layer_linear_shapes().items()}
    saved = 0
    for group in INPUT_GROUPS:
        adapted = [name for name in group if name in w.lora_targets]
        if adapted:
            saved += r512(4 * T * fan_in[adapted[0]]) + len(adapted) * r512(4 * T * w.lora_rank)
    return saved


def layer_saved_bytes(spec: ModelSpec, w: Workload, index: int) -> int:
    """What the compiled forward saves of one layer that is not checkpointed."""
    T, ea, es = _sizes(spec, w)
    h, q, kv, inter = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
    full = trains_base_weights(w)
    input_rg = full or index > 0 or w.ac_every > 0
    saved = (2 if input_rg else 1) * r512(4 * T)  # the norms' rsqrt
    saved += 2 * r512(ea * T * q) + 2 * r512(ea * T * kv) + r512(4 * w.batch * spec.num_heads * w.seq)
    saved += 2 * r512(ea * T * inter)  # gate and up
    if spec.qk_norm == "rms":  # Qwen3's q_norm and k_norm: their inputs (q and k before the norm) and rsqrt per head
        saved += r512(ea * T * q) + r512(ea * T * kv) + r512(4 * T * spec.num_heads) + r512(4 * T * spec.num_kv_heads)
    if full:
        saved += 2 * r512(ea * T * h) + r512(ea * T * inter)  # the norms' outputs, the product
    else:
        saved += _lora_saved(spec, w)
    first_mid = r512(2 * T * h) if (w.mixed and index == 0) else r512(es * T * h)
    return saved + first_mid + r512(es * T * h)


def _checkpointed(w: Workload, index: int) -> bool:
    return w.ac_every > 0 and index % w.ac_every == 0


def selective_layer_saved_bytes(spec: ModelSpec, w: Workload, index: int) -> int:
    """What the compiled forward saves of a selectively checkpointed layer beyond its input (traced):
    SDPA's output and logsumexp, and of the policy's kept matmul outputs those backward reads (the
    partitioner drops the rest): all but down_proj's, which is saved only where the layer's output
    is rebuilt from it in backward (the top layer, or one with a plain layer above it)."""
    top = index == spec.num_layers - 1 or not _checkpointed(w, index + 1)
    matmuls = sum(size for name, size in kept_matmul_outputs(spec, w)
                  if top or not name.startswith("down_proj"))
    return matmuls + sum(attention_kept_sizes(spec, w))


def _checkpoint_extra_bytes(spec: ModelSpec, w: Workload) -> int:
    """Full checkpointing: every checkpoint keeps the materialised mask (compute dtype, b s s).
    Selective (traced): each checkpointed layer's selective saved set and one int64 b x s tensor
    (the positions' cumsum); the mask is rebuilt in backward. A plain layer beside them runs SDPA
    on k and v repeated to the query heads' width (`repeat_kv`), and saves those (e'Tq each, not e'T kv)."""
    if not w.ac_every:
        return 0
    T, ea, _es = _sizes(spec, w)
    if not w.selective_ac:
        return r512(ea * w.batch * w.seq * w.seq)
    layers = [i for i in range(spec.num_layers) if _checkpointed(w, i)]
    repeated = 2 * (r512(ea * T * spec.q_dim) - r512(ea * T * spec.kv_dim)) * (spec.num_layers - len(layers))
    return sum(selective_layer_saved_bytes(spec, w, i) for i in layers) + r512(8 * w.batch * w.seq) + repeated


def saved_activation_bytes(spec: ModelSpec, w: Workload) -> int:
    """Every layer's saved set (a checkpointed layer's input, and what `_checkpoint_extra_bytes`
    adds), the embedding output and the final norm's rsqrt."""
    T, _ea, es = _sizes(spec, w)
    plain = [i for i in range(spec.num_layers) if not _checkpointed(w, i)]
    first = layer_saved_bytes(spec, w, 0) if 0 in plain else 0
    rest = layer_saved_bytes(spec, w, 1) * len([i for i in plain if i > 0])
    checkpoints = (spec.num_layers - len(plain)) * r512(es * T * spec.hidden_size)
    # The embedding output is layer 0's input: a checkpoint's own when layer 0 is checkpointed.
    embedding = r512(es * T * spec.hidden_size) if (trains_base_weights(w) and 0 in plain) else 0
    return first + rest + checkpoints + embedding + r512(4 * T) + _checkpoint_extra_bytes(spec, w)


def _first_norm_output(spec: ModelSpec, w: Workload) -> int:
    """LoRA without checkpointing: layer 0's input norm output (e'Th; its input needs no gradient)
    is alive at the end of forward and freed before the loss backward (traced)."""
    T, ea, _es = _sizes(spec, w)
    return 0 if (trains_base_weights(w) or w.ac_every) else r512(ea * T * spec.hidden_size)


def decoder_output_bytes(spec: ModelSpec, w: Workload) -> int:
    """With checkpointing, dynamo breaks the graph at the embedding's hook (its output is made to
    need a gradient), so the decoder and the head are separate graphs: the final norm's output
    passes between them, alive until the head's forward has run."""
    T, _ea, es = _sizes(spec, w)
    return r512(es * T * spec.hidden_size) if w.ac_every else 0


def copies_kept_bytes(spec: ModelSpec, w: Workload, copies: int) -> int:
    """Autocast's weight copies the compiled forward keeps: a checkpointed layer recomputes its own."""
    if not w.mixed:
        return copies
    checkpointed = spec.num_layers - len([i for i in range(spec.num_layers) if not _checkpointed(w, i)])
    return copies - checkpointed * layer_autocast_copy_bytes(spec)


def _cache_outputs(spec: ModelSpec, w: Workload) -> tuple[int, int]:
    """(bytes the returned cache adds beyond the saved k and v, bytes of the zeros backward gets
    for it). Without checkpointing the model returns every layer's K and V; under autocast its K
    is an fp32 copy of what attention saves in bf16. Only an output that needs a gradient gets
    zeros: with LoRA, layer 0's K or V does not unless its projection is adapted."""
    if w.ac_every:
        return 0, 0
    T, ea, _es = _sizes(spec, w)
    k_bytes, v_bytes = r512((4 if w.mixed else ea) * T * spec.kv_dim), r512(ea * T * spec.kv_dim)
    extra = spec.num_layers * k_bytes if w.mixed else 0
    zeros = spec.num_layers * (k_bytes + v_bytes)
    if not trains_base_weights(w):
        zeros -= (k_bytes if "k_proj" not in w.lora_targets else 0) + (v_bytes if "v_proj" not in w.lora_targets else 0)
    return extra, zeros


def _head_input_bytes(spec: ModelSpec, w: Workload) -> int:
    """What the head keeps of its input when its weight trains (e'Th): under autocast its own
    bf16 cast (the head's: logits), in pure precision the final norm's output (activations)."""
    T, ea, _es = _sizes(spec, w)
    return r512(ea * T * spec.hidden_size) if trains_base_weights(w) else 0


def _logits_saved(spec: ModelSpec, w: Workload) -> int:
    """The head's input cast (autocast), the bf16 logits, the shifted labels, the loss's max and
    log-sum-exp per token."""
    T = w.batch * w.seq
    head_input = _head_input_bytes(spec, w) if w.mixed else 0
    labels = r512(8 * w.batch * (w.seq + 1))
    return head_input + r512(2 * T * spec.vocab_size) + labels + 2 * r512(4 * T) + 3 * 512


def loss_moments(spec: ModelSpec, w: Workload) -> tuple[dict[str, int], dict[str, int]]:
    """(end of forward, the loss backward's worst moment) of the full loss, beyond what persists:
    activations and logits. Backward: zeros for the logits and the cache, then nll_loss's fp32
    gradient (4 T V)."""
    T = w.batch * w.seq
    # In pure precision the head keeps its input; under selective checkpointing that is the decoder's
    # output, which passes between the two graphs (`decoder_output_bytes`), not another tensor.
    saved = saved_activation_bytes(spec, w) + (0 if (w.mixed or w.selective_ac) else _head_input_bytes(spec, w))
    cache_extra, cache_zeros = _cache_outputs(spec, w)
    logits = _logits_saved(spec, w)
    forward = {"activations": saved + cache_extra + decoder_output_bytes(spec, w) + _first_norm_output(spec, w),
               "logits": logits}
    zeros = r512(2 * T * spec.vocab_size) + cache_zeros
    backward = {"activations": saved, "logits": logits + zeros + r512(4 * T * spec.vocab_size) + r512(8 * T)}
    return forward, backward


def chunked_loss_backward_bytes(spec: ModelSpec, w: Workload) -> int:
    """The chunked loss's worst backward moment with a trained head (traced, bf16-mixed and bf16),
    the larger of two: the second chunk's head gradient added to the first's, the two parts and
    their sum alive (3 e'Vh), while the six chunks not yet back-propagated keep their log_softmax
    (4 c V), their input in the compute dtype (e'ch) and labels, beside the current chunk's input
    gradient (e'ch, and s'ch); or the second chunk's own backward (below). c = ceil(seq / 8) * batch. With a frozen head (LoRA): the first
    chunk's backward, every chunk's log_softmax beside nll_loss's and log_softmax's gradients
    (4 c V each) and the padded labels."""
    _T, ea, es = _sizes(spec, w)
    c = -(-w.seq // LOSS_CHUNKS) * w.batch
    if not trains_base_weights(w):
        return (LOSS_CHUNKS + 2) * r512(4 * c * spec.vocab_size) + r512(8 * w.batch * (w.seq + 1)) + 3 * 512
    lsm, cast, labels = r512(4 * c * spec.vocab_size), r512(ea * c * spec.hidden_size), r512(8 * c) + 512
    head = r512(ea * spec.vocab_size * spec.hidden_size)
    accumulate = (LOSS_CHUNKS - 2) * (lsm + cast + labels) + 3 * head + cast + r512(es * c * spec.hidden_size)
    # The second chunk's own backward: seven log_softmax outputs and inputs, its nll_loss and
    # log_softmax gradients, the first chunk's head gradient and input gradient.
    second = ((LOSS_CHUNKS - 1) * (lsm + cast) + (LOSS_CHUNKS - 2) * labels + 2 * lsm + head
              + r512(es * c * spec.hidden_size))
    return max(accumulate, second)


def chunked_decoder_bytes(spec: ModelSpec, w: Workload) -> int:
    """The chunked loss calls the compiled decoder: its saved set and its output (s'Th)."""
    T, _ea, es = _sizes(spec, w)
    return saved_activation_bytes(spec, w) + r512(es * T * spec.hidden_size)


def embedding_backward_bytes(spec: ModelSpec, w: Workload) -> int:
    """The embedding's gradient is accumulated in an fp32 V x h buffer: with bf16/fp16 weights a
    temporary beside the gradient it is cast into; with fp32 weights the buffer is the gradient,
    and a tied head's gradient is added to it out of place inside the graph (one more V x h; the
    eager step's second copy, `backward.tied_gradient_sum`, does not occur)."""
    if not trains_base_weights(w):
        return 0
    if DTYPE_BYTES[w.weight_dtype] == 4 and not spec.tie_word_embeddings:
        return 0
    return r512(4 * spec.embedding_params)



def compiled_training_moments(spec: ModelSpec, w: Workload, persistent: dict[str, int], copies: int, grads: int,
                              chunked_forward_logits: int) -> tuple[dict, dict, list[dict], dict[str, int]]:
    """Under `--compile`: (end of forward, the loss backward, the checkpointed layers' backward, what
    the end of backward holds beyond the gradients). `chunked_forward_logits`: the chunked loss's
    forward buffers (`logits.training_logits`), which run outside the compiled graph as in eager."""
    if spec.model_type not in COMPILED_MODEL_TYPES:
        from llamem.errors import InvalidWorkload

        raise InvalidWorkload([f"--compile is sized for dense Llama, Mistral and Qwen models, not {spec.model_type}: "
                               f"drop --compile, or size it with `llamem trace --compile`"])
    with_copies = add_breakdowns(persistent, {"weights/autocast_copies": copies_kept_bytes(spec, w, copies)})
    if w.loss == "chunked":
        forward = add_breakdowns(with_copies, {"activations": chunked_decoder_bytes(spec, w), "logits": chunked_forward_logits})
        loss_backward = add_breakdowns(with_copies, {"activations": saved_activation_bytes(spec, w),
                                           "logits": chunked_loss_backward_bytes(spec, w)})
    else:
        forward, loss_backward = (add_breakdowns(with_copies, moment) for moment in loss_moments(spec, w))
    moments = (selective_layer_moments if w.selective_ac else checkpointed_layer_moments)(spec, w, grads)
    layers = [add_breakdowns(persistent, moment) for moment in moments]
    return forward, loss_backward, layers, end_of_backward_extra(spec, w)


def end_of_backward_extra(spec: ModelSpec, w: Workload) -> dict[str, int]:
    """Beyond the gradients at the end of backward. One graph: the embedding's fp32 buffer (and a
    tied head's sum inside the graph, `embedding_backward_bytes`). With checkpointing the embedding
    is a graph of its own (the graph break): with fp32 weights a tied head's gradient is added out
    of place by autograd as in eager (`backward.tied_gradient_sum`); with bf16 weights the fp32
    buffer and the embedding gradient cast from it (a tied head's: beside the head's) are alive.
    A tied head's gradient is then the head graph's output, not yet summed with the embedding's:
    it is counted under logits (where it was made, as `backward.tied_gradient_sum` counts the head's
    half in eager), not under gradients, which hold it only once the sum replaces it. The chunked
    loss runs the head outside the compiled decoder: its gradient meets the embedding's as with
    checkpointing."""
    if not (w.ac_every or w.loss == "chunked"):
        return {"temporaries": embedding_backward_bytes(spec, w)}
    from llamem.analytic.backward import tied_gradient_sum

    if DTYPE_BYTES[w.weight_dtype] == 4:
        return tied_gradient_sum(spec, w)
    if not (spec.tie_word_embeddings and trains_base_weights(w)):
        return {"temporaries": embedding_backward_bytes(spec, w)}
    tied = r512(DTYPE_BYTES[w.weight_dtype] * spec.embedding_params)
    return {"temporaries": embedding_backward_bytes(spec, w) + tied, "logits": tied, "gradients": -tied}


def checkpointed_layer_moments(spec: ModelSpec, w: Workload, grads: int) -> list[dict[str, int]]:
    """The backward of the top and the bottom checkpointed layer. The backward graph recomputes the
    layer's forward inside itself and frees each recomputed tensor at its last use: at the worst
    moment (traced: down_proj's and SwiGLU's backward) the layer holds its input and its saved set
    less two MLP-sized tensors and the two residual-stream ones; its temporaries are two MLP-sized
    gradients and attention's output. Below: checkpoint inputs, plain layers' saved sets and,
    under autocast, their weight copies; every checkpoint keeps the mask; gradients as in eager."""
    from llamem.analytic.backward import gradients_alive

    if not w.ac_every:
        return []
    T, ea, es = _sizes(spec, w)
    mlp, stream = r512(ea * T * spec.intermediate_size), r512(es * T * spec.hidden_size)
    saved = layer_saved_bytes(spec, w, 1)
    mask = r512(ea * w.batch * w.seq * w.seq)
    copies = layer_autocast_copy_bytes(spec) if w.mixed else 0
    moments = []
    for index in (spec.num_layers - 1, 0):
        checkpointed_below = len([i for i in range(index) if _checkpointed(w, i)])
        plain_below = index - checkpointed_below
        current = saved - 2 * mlp - stream  # (its own checkpoint input is still alive: one stream back)
        moments.append({"gradients": gradients_alive(spec, w, grads, index),
                        "weights/autocast_copies": plain_below * copies,
                        "activations": checkpointed_below * stream + plain_below * saved + current + mask,
                        "temporaries": 2 * mlp + r512(ea * T * spec.q_dim)})
    return moments


def _held_below_bytes(spec: ModelSpec, w: Workload, index: int) -> int:
    """Selective checkpointing: what the layers below `index` still hold in its backward, and its
    own input: checkpoint inputs, selective saved sets, plain layers' saved sets."""
    T, ea, es = _sizes(spec, w)
    repeated = 2 * (r512(ea * T * spec.q_dim) - r512(ea * T * spec.kv_dim))
    held = 0
    for j in range(index + 1):
        if _checkpointed(w, j):
            held += r512(es * T * spec.hidden_size) + (selective_layer_saved_bytes(spec, w, j) if j < index else 0)
        else:
            held += layer_saved_bytes(spec, w, j) + repeated
    return held


def _own_gradient_bytes(spec: ModelSpec, w: Workload, names: tuple[str, ...]) -> int:
    """Gradients of the named linears of one layer (adapters' under LoRA), in their storage dtype."""
    shapes = spec.layer_linear_shapes()
    if not trains_base_weights(w):
        ab, r = DTYPE_BYTES[adapter_dtype(w)], w.lora_rank
        return sum(r512(ab * r * shapes[n][0]) + r512(ab * r * shapes[n][1]) for n in names if n in w.lora_targets)
    return sum(r512(DTYPE_BYTES[w.weight_dtype] * shapes[n][0] * shapes[n][1]) for n in names)


def _head_gradients(spec: ModelSpec, w: Workload) -> dict[str, int]:
    """The head's and the final norm's gradients through the decoder's backward: a tied head's is
    the head graph's output, counted under logits (beside the loss gradient's seed, 512 bytes)."""
    if not trains_base_weights(w):
        return {"logits": 512}
    wb = DTYPE_BYTES[w.weight_dtype]
    head = r512(wb * spec.vocab_size * spec.hidden_size)
    tied = spec.tie_word_embeddings
    return {"logits": 512 + (head if tied else 0), "gradients": r512(wb * spec.hidden_size) + (0 if tied else head)}


def _selective_attention_moment(spec: ModelSpec, w: Workload, grads: int, index: int) -> dict[str, int]:
    """A selectively checkpointed layer's attention backward (traced): the mask rebuilt (e' b s^2), q
    and k, v repeated to the query heads' width and SDPA's three input gradients, with the output's
    gradient (e'Tq each: four activations and four temporaries under autocast, three and five in pure
    precision, four and five with LoRA);
    its MLP's, o_proj's and post-attention norm's gradients are made, the layers' above too."""
    from llamem.analytic.optimizer import layer_gradient_bytes

    T, ea, es = _sizes(spec, w)
    wide = r512(ea * T * spec.q_dim)
    # Pure-precision LoRA: frozen norms need not keep the layer's input (layer 0's, the embedding
    # output, stays), and one more wide tensor is held.
    lora_pure = not (w.mixed or trains_base_weights(w))
    held = 4 if (w.mixed or lora_pure) else 3
    freed_input = r512(es * T * spec.hidden_size) if (lora_pure and index > 0) else 0
    own = _own_gradient_bytes(spec, w, ("o_proj", "gate_proj", "up_proj", "down_proj"))
    own += r512(DTYPE_BYTES[w.weight_dtype] * spec.hidden_size) if trains_base_weights(w) else 0
    head = _head_gradients(spec, w)
    above = (spec.num_layers - 1 - index) * layer_gradient_bytes(spec, w, grads)
    plain_below = len([j for j in range(index) if not _checkpointed(w, j)])
    copies = plain_below * layer_autocast_copy_bytes(spec) + r512(2 * spec.kv_dim * spec.hidden_size) if w.mixed else 0
    activations = (_held_below_bytes(spec, w, index) + sum(attention_kept_sizes(spec, w))
                   + r512(ea * w.batch * w.seq * w.seq) + held * wide + 512 - freed_input)
    return {"gradients": head.get("gradients", 0) + above + own, "logits": head["logits"],
            "weights/autocast_copies": copies, "activations": activations, "temporaries": (4 if w.mixed else 5) * wide}


def _selective_mlp_moment(spec: ModelSpec, w: Workload, grads: int) -> dict[str, int]:
    """The top layer's MLP backward (traced), the final norm's rsqrt gone. LoRA: its recompute holds
    the saved set's place, with two MLP-sized gradients (pure precision also the incoming one,
    e'Th) and, under autocast, the bf16 copies of an MLP weight and of a q-sized one. Full
    fine-tuning: the last MLP weight gradient made, its gate and down outputs consumed; under
    autocast the bf16 gradient beside its fp32 cast (the three MLP gradients fp32), in pure
    precision an MLP-sized gradient and two e'Th ones."""
    T, ea, _es = _sizes(spec, w)
    h, inter = spec.hidden_size, spec.intermediate_size
    head = _head_gradients(spec, w)
    copies = r512(2 * spec.q_dim * h) if w.mixed else 0
    activations = saved_activation_bytes(spec, w) - r512(4 * T)
    if not trains_base_weights(w):
        return {"logits": head["logits"], "weights/autocast_copies": copies + (r512(2 * inter * h) if w.mixed else 0),
                "activations": activations,
                "temporaries": 2 * r512(ea * T * inter) + (0 if w.mixed else r512(ea * T * h))}
    own = _own_gradient_bytes(spec, w, ("gate_proj", "up_proj", "down_proj"))
    activations -= r512(ea * T * inter) + (r512(ea * T * h) if w.mixed else 0)
    temporaries = r512(2 * inter * h) if w.mixed else r512(ea * T * inter) + 2 * r512(ea * T * h)
    return {"gradients": head["gradients"] + own, "logits": head["logits"], "weights/autocast_copies": copies,
            "activations": activations, "temporaries": temporaries}


def selective_layer_moments(spec: ModelSpec, w: Workload, grads: int) -> list[dict[str, int]]:
    """The decoder backward's moments under compiled selective checkpointing: the top layer's MLP
    (where it is checkpointed), the top and the bottom checkpointed layer's attention."""
    layers = [i for i in range(spec.num_layers) if _checkpointed(w, i)]
    top = [_selective_mlp_moment(spec, w, grads)] if layers[-1] == spec.num_layers - 1 else []
    return top + [_selective_attention_moment(spec, w, grads, i) for i in sorted({layers[-1], layers[0]}, reverse=True)]
