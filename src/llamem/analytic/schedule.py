"""A synthetic allocation schedule for an analytic estimate, to replay through the allocator
simulator (the trace engine replays its real event trace instead).

Tensor by tensor, in the order transformers' Llama code makes them: generation op by op
through each layer (matches the traced replay's reserved memory); training op by op through
forward, a checkpoint's recomputation (which stops at its last saved tensor) and autograd's
backward (`schedule_train.py`), the loss in `ForCausalLMLoss` or torchtune's chunked order,
the optimizer's state created in the first step. Two training steps are replayed so that the
second sees the cache the first left. For LoRA, QLoRA, bf16 training with checkpointing and
bf16 autocast training with or without it, it reserves what the traced replay reserves
(tests/test_schedule.py); other modes are within a few per cent. Fragmentation from it is an
estimate, and the report says so.
"""

from __future__ import annotations

from llamem.allocator.replay import AllocEvent
from llamem.analytic import activations as act
from llamem.analytic.attention_paths import uncached_mask
from llamem.analytic.common import r512, trains_base_weights
from llamem.analytic.kv_cache import kv_layer_tensor_bytes, stored_tokens
from llamem.analytic.optimizer import BNB_BLOCK, BNB_MIN_8BIT_SIZE, adafactor_state_tensors, has_step_temporaries
from llamem.analytic.prefill import masked_sdpa_sizes
from llamem.analytic.schedule_train import (LayerTape, backward_layer, forward_layer, hand_stream_to_norm,
                                            norm_backward, norm_forward)
from llamem.analytic.selective import selective_kept_sizes
from llamem.analytic.weights import linear_weight_bytes, trainable_numels, trainable_tensor_sizes
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import LOSS_CHUNKS, Workload

MAX_DECODE_STEPS = 32
MAX_PREFILL_LAYER_PASSES = 256
"""A long chunked prefill replays layer passes op by op up to this many (chunks x layers): its
first chunk and as many of its last ones as fit; in between, only
what grows from chunk to chunk (the cache, the masks, the repeated keys and values), which is
what fragments the allocator's cache, while the fixed-size temporaries reuse their blocks."""


class Events:
    """The allocation events of a schedule, numbered as they are made."""

    def __init__(self) -> None:
        self.events: list[AllocEvent] = []
        self.next_id = 0

    def alloc(self, sizes: list[int], stream: int = 0) -> list[int]:
        """`stream`: the CUDA stream that allocates (the allocator caches blocks per stream)."""
        ids = []
        for size in sizes:
            if size > 0:
                self.events.append(AllocEvent("alloc", self.next_id, size, stream))
                ids.append(self.next_id)
                self.next_id += 1
        return ids

    def free(self, ids: list[int]) -> None:
        self.events.extend(AllocEvent("free", i, 0) for i in ids)

    def mark(self, point: str, unit: int | str | None = None, grads: list[int] | None = None) -> None:
        """A point of the step where a data-parallel rank's engine allocates or frees (unit: a layer's
        index, "embed" or "head"; grads: the gradients made so far): nothing on one device, a rank's
        buckets, gathers and reduce-scatters in `llamem.analytic.schedule_ranks`."""

    def projection(self, name: str, tensor: int, backward: bool = False) -> None:
        """A projection (a layer's q_proj .. down_proj, "embed", "lm_head") made `tensor`: its output in
        forward, its input's gradient in backward (`backward`). Nothing on one device; a tensor-parallel
        rank all-reduces some of them into new tensors (`llamem.analytic.schedule_ranks`)."""


class LiveEvents(Events):
    """Events that know which tensors are alive: a free of one an engine already let go of (a gradient its hook
    or reduce-scatter released) is dropped when the single-GPU step frees the rest."""

    def __init__(self) -> None:
        super().__init__()
        self.live: set[int] = set()

    def alloc(self, sizes: list[int], stream: int = 0) -> list[int]:
        ids = super().alloc(sizes, stream)
        self.live.update(ids)
        return ids

    def free(self, ids: list[int]) -> None:
        ids = [i for i in ids if i in self.live]
        self.live.difference_update(ids)
        super().free(ids)


def weight_tensor_sizes(spec: ModelSpec, w: Workload) -> list[int]:
    dtype = w.weight_dtype
    sizes = [r512(DTYPE_BYTES[dtype] * spec.embedding_params)]
    layer = [r512(DTYPE_BYTES[dtype] * spec.hidden_size)] * 2
    for fan_in, fan_out in spec.layer_linear_shapes().values():
        weight, scales = linear_weight_bytes(fan_in, fan_out, dtype, w.quant)
        layer += [weight, scales]
    sizes += layer * spec.num_layers + [r512(DTYPE_BYTES[dtype] * spec.hidden_size)]
    if spec.lm_head_params:
        sizes.append(r512(DTYPE_BYTES[dtype] * spec.lm_head_params))
    return [s for s in sizes if s]


def training_schedule(spec: ModelSpec, w: Workload, ev: Events | None = None) -> list[AllocEvent]:
    """`ev`: a data-parallel rank's events (`llamem.analytic.schedule_ranks`), which act at the marks."""
    ev = ev or Events()
    ev.alloc(weight_tensor_sizes(spec, w))
    ev.mark("wrap")
    grad_sizes = trainable_tensor_sizes(spec, w)
    if w.uses_adapters:
        ev.alloc(grad_sizes)  # the adapters themselves
        head, tail = [], []
    else:  # [embedding, layer 0 .. L-1, final norm, lm_head]: the layers' own come from the tapes
        head_count = 2 if spec.lm_head_params else 1
        head, tail = grad_sizes[-head_count:], grad_sizes[:1]
    state_sizes = (adafactor_state_tensors(spec, w) if w.optimizer == "adafactor"
                   else optimizer_state_tensors(w, trainable_numels(spec, w), param_bytes=grad_sizes))
    return training_steps(spec, w, ev, head, tail, grad_sizes, state_sizes)


def _optimizer_step(ev: Events, w: Workload, grads: list[int], grad_sizes: list[int], new_state: list[int]) -> None:
    """The step: state created on the first one (into the holes backward left), foreach
    temporaries, then zero_grad(set_to_none=True) frees the gradients."""
    ev.alloc(new_state)
    temporaries = ev.alloc(grad_sizes) if has_step_temporaries(w) else []
    if w.optimizer == "adamw-loop":
        _loop_step(ev, grad_sizes)
    ev.free(temporaries + grads)
    ev.mark("zero_grad")


def _loop_step(ev: Events, grad_sizes: list[int]) -> None:
    """For-loop AdamW, tensor by tensor: `exp_avg_sq.sqrt()`, then `denom` (the sqrt divided), the
    sqrt dropped at the end of the expression, the previous tensor's denom when the name is rebound."""
    previous: list = []
    for size in grad_sizes:
        root, denom = ev.alloc([size]), ev.alloc([size])
        ev.free(root + previous)
        previous = denom
    ev.free(previous)


def _loss(ev: Events, spec: ModelSpec, w: Workload, unit_h: int, hidden: int | None,
          head_trains: bool, stream_end: list[int]) -> tuple[list[int], list[int]]:
    """ForCausalLMLoss forward and backward, in order (chunked: torchtune's chunks). Returns
    the head's weight gradient when the loss makes it (chunked, autocast; otherwise the caller does),
    and the gradient of the hidden states. `stream_end`: what the model's output holds (autocast's
    fp32 cache keys), dropped with the logits."""
    if w.loss == "chunked":
        return _chunked_loss(ev, spec, w, hidden, head_trains)
    if w.mixed:
        return _autocast_full_loss(ev, spec, w, hidden, head_trains, stream_end)
    ev.free([hidden] if hidden is not None else [])
    T = w.batch * w.seq
    TV = T * spec.vocab_size
    e_logits = 4 if w.compute_dtype == "fp32" else 2
    # Autocast casts the head's weight and input just before the logits: small tensors that
    # land in (and split) whatever large cached block is free.
    head_casts = ev.alloc([r512(2 * spec.vocab_size * spec.hidden_size), unit_h]) if w.mixed else []
    logits = ev.alloc([r512(e_logits * TV)])
    upcast = ev.alloc([r512(4 * TV)]) if e_logits < 4 else []
    log_softmax = ev.alloc([r512(4 * TV)])
    ev.free(upcast)
    ev.free(logits)  # the model output is dropped once the loss is read
    ev.mark("forward_done", "model")
    nll_grad = ev.alloc([r512(4 * TV)])
    softmax_grad = ev.alloc([r512(4 * TV)])
    ev.free(nll_grad + log_softmax)
    logits_grad = ev.alloc([r512(e_logits * TV)]) if e_logits < 4 else []
    ev.free(softmax_grad)
    hidden_grad = ev.alloc([unit_h])  # the head's input gradient
    ev.free(logits_grad + head_casts)
    ev.projection("lm_head", hidden_grad[0], backward=True)
    return [], hidden_grad


def _autocast_full_loss(ev: Events, spec: ModelSpec, w: Workload, hidden: int | None, head_trains: bool,
                        stream_end: list[int]) -> tuple[list[int], list[int]]:
    """ForCausalLMLoss under bf16 autocast (traced on transformers 5.x): the head's casts, bf16 logits,
    their fp32 upcast and log-softmax; the hidden states and the model's output die after the loss. Backward:
    the head's bf16 weight and input gradients, then the input cast's backward and the weight cast's (fp32)."""
    T, h, V = w.batch * w.seq, spec.hidden_size, spec.vocab_size
    casts = ev.alloc([r512(2 * V * h), r512(2 * T * h)])  # the weight's and the input's
    logits = ev.alloc([r512(2 * T * V)])
    upcast = ev.alloc([r512(4 * T * V)])
    log_softmax = ev.alloc([r512(4 * T * V)])
    ev.free(upcast + logits)
    ev.mark("forward_done", "model")  # (a rank's loss rebuilds the events from the logits on)
    ev.free(([hidden] if hidden is not None else []) + stream_end)
    del stream_end[:]  # freed here, not again by the caller
    nll_grad = ev.alloc([r512(4 * T * V)])
    softmax_grad = ev.alloc([r512(4 * T * V)])
    ev.free(nll_grad + log_softmax)
    logits_grad = ev.alloc([r512(2 * T * V)])
    ev.free(softmax_grad)
    low_weight_grad = ev.alloc([r512(2 * V * h)]) if head_trains else []
    low_hidden_grad = ev.alloc([r512(2 * T * h)])
    ev.free(logits_grad + casts)
    hidden_grad = ev.alloc([r512(4 * T * h)])  # the input cast's backward
    ev.free(low_hidden_grad)
    ev.projection("lm_head", hidden_grad[0], backward=True)
    head_grad = ev.alloc([r512(4 * V * h)]) if head_trains else []  # the weight cast's backward
    ev.free(low_weight_grad)
    return head_grad, hidden_grad


def chunk_lengths(length: int, chunks: int) -> list[int]:
    """torch.chunk's pieces: ceil(length / chunks) each, the last one shorter, possibly fewer pieces."""
    size = -(-length // chunks)
    return [min(size, length - start) for start in range(0, length, size)]


def _chunked_loss(ev: Events, spec: ModelSpec, w: Workload, hidden: int | None,
                  head_trains: bool) -> tuple[list[int], list[int]]:
    """torchtune's CEWithChunkedOutputLoss op by op (traced on transformers 5.x): per chunk the
    head's logits, their fp32 upcast (alive until the next chunk's), the saved log-softmax;
    backward chunk by chunk in reverse, the head's weight gradient summed out of place, the
    input gradients concatenated. With batch 1 the chunks are views (no copies of the hidden
    states or labels); under autocast the hidden chunk is cast instead of copied."""
    b, h, V = w.batch, spec.hidden_size, spec.vocab_size
    le = 2 if w.mixed else act.compute_bytes(w)  # the logits' dtype
    pieces = [b * n for n in chunk_lengths(w.seq, LOSS_CHUNKS)]
    copies = w.mixed or b > 1
    weight_cast = ev.alloc([r512(2 * V * h)]) if w.mixed else []
    padded = ev.alloc([r512(8 * b * (w.seq + 1))])  # the shifted labels
    saved, last_upcast = _chunked_loss_forward(ev, spec, w, pieces, copies)
    ev.free(([hidden] if copies and hidden is not None else []) + (padded if b > 1 else []) + last_upcast)
    accumulated, input_grads = [], []
    for index in reversed(range(len(pieces))):
        weight_grad, input_grad = _chunk_backward(ev, spec, w, pieces[index], saved[index], head_trains,
                                                  weight_cast if index == 0 else [])
        accumulated = _accumulate(ev, le * V * h, accumulated, weight_grad)
        if w.mixed:  # the cast's backward: the input gradient in fp32
            fp32 = ev.alloc([r512(4 * pieces[index] * h)])
            ev.free(input_grad)
            input_grad = fp32
        input_grads += input_grad
    if w.mixed and accumulated:  # the weight cast's backward: the fp32 gradient
        grad = ev.alloc([r512(4 * V * h)])
        ev.free(accumulated)
        accumulated = grad
    if len(pieces) > 1:  # torch.cat of the chunks' input gradients
        chunk_grads, input_grads = input_grads, ev.alloc([r512((4 if w.mixed else le) * b * w.seq * h)])
        ev.free(chunk_grads)
    ev.free(([hidden] if not copies and hidden is not None else []) + (padded if b == 1 else []))
    return accumulated, input_grads


def _chunked_loss_forward(ev: Events, spec: ModelSpec, w: Workload, pieces: list[int],
                          copies: bool) -> tuple[list[tuple], list[int]]:
    """Per chunk (of `pieces` tokens): the hidden chunk's copy or cast, the logits, their fp32
    upcast (the previous chunk's dies), the labels' copy (batch > 1), the log-softmax. Returns
    each chunk's (input, labels, log-softmax), None where nothing was made, and the last upcast."""
    h, V = spec.hidden_size, spec.vocab_size
    le = 2 if w.mixed else act.compute_bytes(w)
    saved, upcast = [], []
    for t in pieces:
        chunk_input = ev.alloc([r512(le * t * h)])[0] if copies else None
        logits = ev.alloc([r512(le * t * V)])
        previous, upcast = upcast, (ev.alloc([r512(4 * t * V)]) if le < 4 else logits)
        ev.free((logits if le < 4 else []) + previous)
        labels = ev.alloc([r512(8 * t)])[0] if w.batch > 1 else None
        saved.append((chunk_input, labels, ev.alloc([r512(4 * t * V)])[0]))
    return saved, upcast


def _chunk_backward(ev: Events, spec: ModelSpec, w: Workload, t: int, saved: list, head_trains: bool,
                    weight_cast: list[int]) -> tuple[list[int], list[int]]:
    """One chunk's loss backward (`t` tokens): nll_loss's and log_softmax's gradients, the upcast's
    backward, the head's weight gradient (if it trains) and input gradient.
    `saved`: the chunk's input copy, labels and log-softmax."""
    h, V = spec.hidden_size, spec.vocab_size
    le = 2 if w.mixed else act.compute_bytes(w)
    chunk_input, chunk_labels, chunk_log_softmax = saved
    nll_grad = ev.alloc([r512(4 * t * V)])
    ev.free([chunk_labels] if chunk_labels is not None else [])
    softmax_grad = ev.alloc([r512(4 * t * V)])
    ev.free(nll_grad + [chunk_log_softmax])
    down = []
    if le < 4:  # the upcast's backward
        down = ev.alloc([r512(le * t * V)])
        ev.free(softmax_grad)
    weight_grad = ev.alloc([r512(le * V * h)]) if head_trains else []
    input_grad = ev.alloc([r512(le * t * h)])
    ev.free(down if down else softmax_grad)
    ev.free(weight_cast + ([chunk_input] if chunk_input is not None else []))
    return weight_grad, input_grad


def _accumulate(ev: Events, size: int, accumulated: list[int], weight_grad: list[int]) -> list[int]:
    """The head's weight gradient summed out of place over the chunks."""
    if weight_grad and accumulated:
        summed = ev.alloc([r512(size)])
        ev.free(accumulated + weight_grad)
        return summed
    return accumulated or weight_grad


def _causal_mask(ev: Events, size: int) -> list[int]:
    """The bool (b, 1, s, s) mask transformers materialises when SDPA gets no cache: causal,
    then padding, each step a new tensor."""
    causal, combined = ev.alloc([size, size])
    ev.free([causal])
    padding, mask = ev.alloc([size, size])
    ev.free([padding, combined])
    return [mask]


def training_steps(spec: ModelSpec, w: Workload, ev: Events, head: list[int], tail: list[int],
                       grad_sizes: list[int], state_sizes: list[int]) -> list[AllocEvent]:
    """Two steps (the second sees the cache the first left): forward, loss, backward, the
    embedding's gradient, the optimizer step (its state made in the first)."""
    for step in range(2):
        ev.mark("step", step)
        ids, embeds, held = _step_inputs(ev, spec, w)
        kept: dict[int, list[int]] = {}  # selective checkpointing: what each checkpointed layer's policy keeps
        x, tapes, stream_end, inputs = _forward_layers(ev, spec, w, embeds, kept)
        grads, grad, tied_grad = _head_and_loss(ev, spec, w, x, embeds, tapes, stream_end, head)
        grad = _backward_layers(ev, spec, w, tapes, inputs, grads, grad, kept, held)
        ev.mark("backward", "embed")
        tail_grads = ev.alloc(tail)  # the embedding's backward
        ev.mark("backward_done", "embed", tail_grads)
        ev.free([grad] + tied_grad)  # a tied head's two gradients are summed out of place
        ev.free([embeds] if not (w.ac_every or _fp32_stream(w)) else [])  # else layer 0's frame or norm freed it
        ev.free(ids)
        _optimizer_step(ev, w, grads + tail_grads, grad_sizes, state_sizes if step == 0 else [])
    return ev.events


def _stream_bytes(spec: ModelSpec, w: Workload) -> int:
    """One residual-stream tensor: fp32 under autocast, else the compute dtype."""
    return r512((4 if w.mixed else act.compute_bytes(w)) * w.batch * w.seq * spec.hidden_size)


def _fp32_stream(w: Workload) -> bool:
    """The residual stream is fp32 (autocast or fp32 compute): the next norm saves it."""
    return w.mixed or act.compute_bytes(w) == 4


def _step_inputs(ev: Events, spec: ModelSpec, w: Workload) -> tuple[list[int], int, list[int]]:
    """Input ids, the embedding output; with checkpointing (no cache) the positions, the causal mask when it
    is materialised (`uncached_mask`) and the rotary tables, which every checkpoint keeps as its arguments.
    Returns (the ids, which die at the end of the step, the embedding output, what the checkpoints keep:
    the first layer's recomputation lets go of it with the embedding output)."""
    ids = ev.alloc([r512(8 * w.batch * w.seq)])
    ev.mark("forward", "embed")
    embeds = ev.alloc([_stream_bytes(spec, w)])[0]
    ev.projection("embed", embeds)
    ev.mark("forward_done", "embed")
    held = _causal_mask(ev, r512(w.batch * w.seq * w.seq)) if uncached_mask(w) else []
    if w.ac_every:
        held += ev.alloc([r512(8 * w.seq)])  # positions
        held += _rotary_tables(ev, spec, w)
    return ids, embeds, held


def _rotary_tables(ev: Events, spec: ModelSpec, w: Workload) -> list[int]:
    """LlamaRotaryEmbedding's cos and sin for the step (traced on transformers 5.x), computed in fp32:
    the positions as float, the inverse frequencies' fp32 copy (the buffer has the weights' dtype), their
    product, its concatenation with itself, cos and sin each times the attention scaling, then both cast
    to the hidden states' dtype (nothing under autocast: the stream is fp32). Returns (cos, sin)."""
    half, full = r512(4 * w.seq * spec.head_dim // 2), r512(4 * w.seq * spec.head_dim)
    made = ev.alloc([r512(4 * w.seq)])
    if w.weight_dtype != "fp32":
        made += ev.alloc([r512(4 * spec.head_dim // 2)])
    freqs = ev.alloc([half])
    ev.free(made)
    emb = ev.alloc([full])
    tables = []
    for _ in ("cos", "sin"):
        unscaled = ev.alloc([full])
        tables += ev.alloc([full])
        ev.free(unscaled)
    stream_bytes = 4 if w.mixed else act.compute_bytes(w)
    if stream_bytes < 4:
        fp32_tables, tables = tables, ev.alloc([r512(stream_bytes * w.seq * spec.head_dim)] * 2)
        ev.free(fp32_tables)
    ev.free(freqs + emb)
    return tables


def _forward_layers(ev: Events, spec: ModelSpec, w: Workload, embeds: int, kept: dict[int, list[int]]
                    ) -> tuple[int, list[LayerTape | None], list[int], list[int | None]]:
    """Every decoder layer's forward. Returns the last output, each layer's tape (None when
    checkpointed: nothing saved), the cache copies alive until the end of forward, and each
    checkpointed layer's input (kept by its checkpoint). Selective checkpointing's kept outputs go
    to `kept` (made after the layer's forward: the sizes are exact, their places in it are not)."""
    x, tapes, stream_end, inputs = embeds, [], [], []
    for index in range(spec.num_layers):
        checkpointed = act.is_checkpointed(w, index)
        ev.mark("forward", index)
        tape = LayerTape(ev, index, no_grad=checkpointed)
        output = forward_layer(tape, spec, w, index, stream_end)
        if w.mixed and not w.ac_every:
            hand_stream_to_norm(tape, "norm1", tapes[-1] if tapes else None, x)
        ev.mark("forward_done", index)
        if checkpointed:  # nothing saved; the checkpoint keeps the layer's input
            tape = None
            inputs.append(x)
            if w.selective_ac:
                kept[index] = ev.alloc(selective_kept_sizes(spec, w))
        else:
            inputs.append(None)
            if x != embeds and not _fp32_stream(w) and not (index and act.is_checkpointed(w, index - 1)):
                ev.free([x])  # the layer loop's reference to the previous output
        tapes.append(tape)
        x = output
    return x, tapes, stream_end, inputs


def _head_and_loss(ev: Events, spec: ModelSpec, w: Workload, x: int, embeds: int, tapes: list[LayerTape | None],
                   stream_end: list[int], head: list[int]) -> tuple[list[int], int, list[int]]:
    """The final norm, the head and the loss, forward and backward, and the final norm's backward.
    Returns the gradients made so far (the head's), the last layer's output gradient, and a tied
    head's gradient (summed with the embedding's at the end)."""
    T, h, e = w.batch * w.seq, spec.hidden_size, act.compute_bytes(w)
    train_all = trains_base_weights(w)
    ev.mark("forward", "head")
    final = LayerTape(ev, spec.num_layers)
    hidden = norm_forward(final, T, h, e, w.mixed, True, train_all,
                          out_keep=train_all and not w.mixed and w.loss != "chunked")
    if _fp32_stream(w) and spec.num_layers and tapes[-1] is None:
        final.saved["norm.input"] = x  # the fp32 stream itself is what the norm saves
    elif w.mixed and spec.num_layers and not w.ac_every:
        hand_stream_to_norm(final, "norm", tapes[-1], x)
    elif x != embeds and not _fp32_stream(w):
        ev.free([x])  # the model's reference to the last layer's output is replaced
    head_grad, hidden_grad = _loss(ev, spec, w, r512((2 if w.mixed else e) * T * h),
                                   None if "norm.out" in final.saved else hidden, train_all, stream_end)
    ev.mark("backward", "head")
    ev.free(stream_end)
    final.release("norm.out")
    tied_grad = head_grad if head_grad and not spec.lm_head_params else []
    grads = list(head_grad) if spec.lm_head_params else []
    if w.mixed and w.loss != "chunked":  # autocast: the norm's weight gradient is made amid its backward
        grad = norm_backward(final, T, h, e, True, train_all, hidden_grad[0],
                             weight_grad=(head[0], grads) if train_all else None)
    else:
        grads = grads + ev.alloc(head[:1] if head_grad else head)
        grad = norm_backward(final, T, h, e, w.mixed, train_all, hidden_grad[0])
    final.release_all()
    ev.mark("backward_done", "head", grads)
    return grads, grad, tied_grad


def _backward_layers(ev: Events, spec: ModelSpec, w: Workload, tapes: list[LayerTape | None],
                     inputs: list[int | None], grads: list[int], grad: int,
                     kept: dict[int, list[int]], held: list[int]) -> int:
    """Every layer's backward, top down; a checkpointed layer is recomputed first (up to its last
    saved tensor; selective checkpointing's kept outputs are handed to the recompute, freed here
    and made again by it). Its checkpoint's frame keeps its input (and, the first layer's, `held`: what
    every checkpoint keeps) until the recomputed input norm's backward lets go of it. Returns the
    embedding output's gradient."""
    for index in reversed(range(spec.num_layers)):
        ev.mark("backward", index)
        tape = tapes[index]
        if tape is None:  # recompute the checkpointed layer (up to its last saved tensor)
            ev.free(kept.pop(index, []))
            tape = LayerTape(ev, index, recompute=True)
            tape.frame = [inputs[index]] + (held if index == 0 else [])  # the last frame to die: theirs too
            if w.mixed:  # autograd casts the output's gradient for down_proj before the checkpoint recomputes
                tape.grad_cast = ev.alloc([r512(2 * w.batch * w.seq * spec.hidden_size)])[0]
            output = forward_layer(tape, spec, w, index, [])
            ev.free([output] if output is not None else [])
        grad = backward_layer(tape, spec, w, grads, grad)
        ev.mark("backward_done", index, grads)
    return grad


def optimizer_state_tensors(w: Workload, numels: list[int], param_bytes: list[int]) -> list[int]:
    """The optimizer's state tensors in the order it creates them: parameter by parameter."""
    out: list[int] = []
    for numel, size in zip(numels, param_bytes):
        if w.optimizer in ("adamw", "adamw-fused", "adamw-loop"):
            out += [512, size, size]  # step, exp_avg, exp_avg_sq
        elif w.optimizer == "sgd":
            out.append(size)
        elif numel >= BNB_MIN_8BIT_SIZE:
            blocks = r512(4 * -(-numel // BNB_BLOCK))
            out += [512, r512(numel), r512(numel), blocks, blocks]
        else:
            out += [512, r512(4 * numel), r512(4 * numel)]
    return out


def _norm_ops(ev: Events, T: int, h: int, e: int) -> int:
    """LlamaRMSNorm without autograd, in its allocation order (traced on transformers 5.x):
    fp32 upcast, pow, mean, + eps, rsqrt, scale, cast back, times the weight."""
    upcast = ev.alloc([r512(4 * T * h)]) if e < 4 else []
    power = ev.alloc([r512(4 * T * h)])
    mean = ev.alloc([r512(4 * T)])
    ev.free(power)
    plus_eps = ev.alloc([r512(4 * T)])
    rsqrt = ev.alloc([r512(4 * T)])
    ev.free(plus_eps)
    normed = ev.alloc([r512(4 * T * h)])
    ev.free(rsqrt + upcast)
    cast = ev.alloc([r512(e * T * h)]) if e < 4 else []
    out = ev.alloc([r512(e * T * h)])
    ev.free(cast + normed + mean)
    return out[0]


def _rope_ops(ev: Events, size: int) -> int:
    """q * cos + rotate_half(q) * sin, as apply_rotary_pos_emb computes it."""
    first = ev.alloc([size])
    neg = ev.alloc([r512(size // 2)])
    cat = ev.alloc([size])
    ev.free(neg)
    second = ev.alloc([size])
    ev.free(cat)
    out = ev.alloc([size])
    ev.free(first + second)
    return out[0]


def inference_schedule(spec: ModelSpec, w: Workload) -> list[AllocEvent]:
    """Generation without autograd, op by op through each decoder layer as transformers runs it:
    the prompt whole or in chunks (`generate`'s prefill_chunk_size), then the decode steps."""
    ev = Events()
    ev.alloc(weight_tensor_sizes(spec, w))
    ev.alloc([r512(8 * w.batch * w.seq)])  # input ids
    cache: list[list[int]] = [[] for _ in range(spec.num_layers)]
    chunk = w.prefill_step
    logits: list[int] = []
    starts = list(range(0, w.seq, chunk))
    in_full = set(starts[:1] + starts[-max(MAX_PREFILL_LAYER_PASSES // spec.num_layers, 2) + 1:])
    for start in starts:
        new = min(chunk, w.seq - start)
        masked = start > 0 or bool(spec.sliding_window and new > spec.sliding_window)
        if start in in_full:
            _prefill_forward(ev, spec, w, cache, new, start + new, masked)
        else:
            _prefill_growth(ev, spec, w, cache, new, start + new)
        # The chunk's last-token logits; generate() drops the previous chunk's once this one returns.
        fresh = ev.alloc([r512(act.compute_bytes(w) * w.batch * spec.vocab_size)])
        ev.free(logits)
        logits = fresh
    ev.free(logits)
    steps = min(max(w.new_tokens - 1, 0), MAX_DECODE_STEPS)
    first = w.seq + max(w.new_tokens - 1, 0) - steps
    if spec.sliding_window and steps and first > w.seq:
        first = w.seq  # a sliding window's worst step is the first: the prompt's storage is still whole
    for step in range(steps):
        end = first + step + 1
        for layer in range(spec.num_layers):
            _grow_cache(ev, spec, w, cache, layer, stored_tokens(spec, end))
        ev.free(ev.alloc([r512(4 * w.batch * spec.vocab_size)]))
    return ev.events


def _grow_cache(ev: Events, spec: ModelSpec, w: Workload, cache: list[list[int]], layer: int, kept: int) -> None:
    """DynamicLayer concatenates and replaces K, then V; a sliding-window layer makes both first."""
    size = kv_layer_tensor_bytes(spec, w.batch, kept, w.kv_dtype)
    old = cache[layer]
    if spec.sliding_window or not old:
        cache[layer] = ev.alloc([size] * 2)
        ev.free(old)
        return
    keys = ev.alloc([size])
    ev.free(old[:1])
    values = ev.alloc([size])
    ev.free(old[1:])
    cache[layer] = keys + values


def _mask_ops(ev: Events, spec: ModelSpec, size: int) -> list[int]:
    """The (chunk x keys) bool mask; a sliding window's is the AND of the causal and the window
    conditions, each built in two steps."""
    if not spec.sliding_window:
        return ev.alloc([size])
    first, second = ev.alloc([size] * 2)
    ev.free([first])
    third, mask = ev.alloc([size] * 2)
    ev.free([third, second])
    return [mask]


def _prefill_growth(ev: Events, spec: ModelSpec, w: Workload, cache: list[list[int]], new: int, end: int) -> None:
    """What of a middle prefill chunk grows with the prompt so far: mask, cache, repeated K/V."""
    keys = stored_tokens(spec, end, new)
    mask = _mask_ops(ev, spec, r512(new * keys))
    for layer in range(spec.num_layers):
        _grow_cache(ev, spec, w, cache, layer, keys)
        if w.attn == "sdpa":
            ev.free(ev.alloc(masked_sdpa_sizes(spec, w, new, keys)))
    ev.free(mask)


def _prefill_forward(ev: Events, spec: ModelSpec, w: Workload, cache: list[list[int]], new: int, end: int,
                     masked: bool) -> None:
    """One prefill forward of `new` prompt tokens ending at position `end`."""
    T = w.batch * new
    e = act.compute_bytes(w)
    h, q, kv, I = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
    keys = stored_tokens(spec, end, new)
    positions = ev.alloc([r512(8 * new)]) if masked else []
    embeds = ev.alloc([r512(e * T * h)])[0]
    rope = ev.alloc([r512(e * new * spec.head_dim)] * 2)  # cos, sin
    mask = _mask_ops(ev, spec, r512(new * keys)) if masked else []
    x = embeds
    for layer in range(spec.num_layers):
        y = _norm_ops(ev, T, h, e)
        q_proj, k_proj, v_proj = ev.alloc([r512(e * T * q), r512(e * T * kv), r512(e * T * kv)])
        q_rot = _rope_ops(ev, r512(e * T * q))
        k_rot = _rope_ops(ev, r512(e * T * kv))
        ev.free([q_proj, k_proj])
        _grow_cache(ev, spec, w, cache, layer, keys)
        ev.free([k_rot, v_proj])
        extra = ev.alloc(masked_sdpa_sizes(spec, w, new, keys)) if masked and w.attn == "sdpa" else []
        attn = ev.alloc([r512(e * T * q)])
        ev.free(ev.alloc([r512(4 * w.batch * spec.num_heads * new)]))  # logsumexp
        ev.free(extra)
        out = ev.alloc([r512(e * T * h)])
        ev.free(attn + [q_rot, y])
        h1 = ev.alloc([r512(e * T * h)])[0]
        ev.free(out)
        y2 = _norm_ops(ev, T, h, e)
        gate = ev.alloc([r512(e * T * I)])
        act_out = ev.alloc([r512(e * T * I)])
        ev.free(gate)
        up = ev.alloc([r512(e * T * I)])
        product = ev.alloc([r512(e * T * I)])
        ev.free(act_out + up)
        down = ev.alloc([r512(e * T * h)])
        ev.free(product + [y2])
        h2 = ev.alloc([r512(e * T * h)])[0]
        ev.free(down + [h1] + ([x] if x != embeds else []))
        x = h2
    ev.free([x, embeds] + rope + mask + positions)


def schedule(spec: ModelSpec, w: Workload) -> list[AllocEvent]:
    return training_schedule(spec, w) if w.is_training else inference_schedule(spec, w)
