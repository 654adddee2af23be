"""A synthetic allocation schedule for an analytic estimate, to replay through the allocator
simulator (the trace engine replays its real event trace instead).

Tensor by tensor, in the order transformers' Llama code makes them: generation op by op
through each layer (matches the traced replay's reserved memory), training forward op by op
with what autograd saves kept (`schedule_train.py`), a coarser backward, the loss in
`ForCausalLMLoss` order, the optimizer's state created in the first step. Two training steps
are replayed so that the second sees the cache the first left. Fragmentation from it is an
estimate, and the report says so.
"""

from __future__ import annotations

from llamem.allocator.replay import AllocEvent
from llamem.analytic import activations as act
from llamem.analytic.common import r512
from llamem.analytic.kv_cache import kv_layer_tensor_bytes
from llamem.analytic.optimizer import BNB_BLOCK, BNB_MIN_8BIT_SIZE, has_step_temporaries
from llamem.analytic.weights import linear_weight_bytes, trainable_numels, trainable_tensor_sizes
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import LOSS_CHUNKS, Workload

MAX_DECODE_STEPS = 32


class _Events:
    def __init__(self) -> None:
        self.events: list[AllocEvent] = []
        self.next_id = 0

    def alloc(self, sizes: list[int]) -> list[int]:
        ids = []
        for size in sizes:
            if size > 0:
                self.events.append(AllocEvent("alloc", self.next_id, size))
                ids.append(self.next_id)
                self.next_id += 1
        return ids

    def free(self, ids: list[int]) -> None:
        self.events.extend(AllocEvent("free", i, 0) for i in ids)


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


def training_schedule(spec: ModelSpec, w: Workload) -> list[AllocEvent]:
    ev = _Events()
    ev.alloc(weight_tensor_sizes(spec, w))
    grad_sizes = trainable_tensor_sizes(spec, w)
    if w.uses_adapters:
        ev.alloc(grad_sizes)  # the adapters themselves
        head, tail = [], []
    else:  # [embedding, layer 0 .. L-1, final norm, lm_head]: the layers' own come from the tapes
        head_count = 2 if spec.lm_head_params else 1
        head, tail = grad_sizes[-head_count:], grad_sizes[:1]
    state_sizes = optimizer_state_tensors(w, trainable_numels(spec, w), param_bytes=grad_sizes)
    return _op_level_training(spec, w, ev, head, tail, grad_sizes, state_sizes)


def _optimizer_step(ev: _Events, w: Workload, grads: list[int], grad_sizes: list[int], new_state: list[int]) -> None:
    """The step: state created on the first one (into the holes backward left), foreach
    temporaries, then zero_grad(set_to_none=True) frees the gradients."""
    ev.alloc(new_state)
    temporaries = ev.alloc(grad_sizes) if has_step_temporaries(w) else []
    ev.free(temporaries + grads)


def _loss(ev: _Events, spec: ModelSpec, w: Workload, unit_h: int) -> None:
    """ForCausalLMLoss forward and backward, in order (chunked: torchtune's chunks)."""
    T = w.batch * w.seq
    TV = T * spec.vocab_size
    ae = 2 if w.mixed else act.compute_bytes(w)
    if w.loss == "chunked":  # one chunk's logits at a time; every chunk's log-softmax kept
        log_softmax = []
        for _chunk in range(LOSS_CHUNKS):
            logits = ev.alloc([r512(ae * TV // LOSS_CHUNKS), r512(4 * TV // LOSS_CHUNKS)])
            log_softmax += ev.alloc([r512(4 * TV // LOSS_CHUNKS)])
            ev.free(logits)
        for chunk_lsm in reversed(log_softmax):
            ev.free(ev.alloc([r512(4 * TV // LOSS_CHUNKS), r512(ae * TV // LOSS_CHUNKS)]) + [chunk_lsm])
        return
    e_logits = 4 if w.compute_dtype == "fp32" else 2
    # Autocast casts the head's weight and input just before the logits: small tensors that
    # land in (and split) whatever large cached block is free.
    head_casts = ev.alloc([r512(2 * spec.vocab_size * spec.hidden_size), unit_h]) if w.mixed else []
    logits = ev.alloc([r512(e_logits * TV)])
    upcast = ev.alloc([r512(4 * TV)]) if e_logits < 4 else []
    log_softmax = ev.alloc([r512(4 * TV)])
    ev.free(upcast)
    ev.free(logits)  # the model output is dropped once the loss is read
    nll_grad = ev.alloc([r512(4 * TV)])
    softmax_grad = ev.alloc([r512(4 * TV)])
    ev.free(nll_grad + log_softmax)
    logits_grad = ev.alloc([r512(e_logits * TV)]) if e_logits < 4 else []
    ev.free(softmax_grad)
    ev.free(ev.alloc([unit_h]) + logits_grad + head_casts)  # the head's input gradient


def _op_level_training(spec: ModelSpec, w: Workload, ev: _Events, head: list[int], tail: list[int],
                       grad_sizes: list[int], state_sizes: list[int]) -> list[AllocEvent]:
    from llamem.analytic.schedule_train import LayerTape, _norm, backward_layer, forward_layer, layer_grad_sizes

    T = w.batch * w.seq
    e = act.compute_bytes(w)
    stream = r512((4 if w.mixed else e) * T * spec.hidden_size)
    attention_grads, mlp_grads = layer_grad_sizes(spec, w)
    fp32_stream = w.mixed or e == 4
    train_all = w.task in ("train", "distill")
    for step in range(2):
        ev.alloc([r512(8 * T)])  # input ids
        embeds = ev.alloc([stream])[0]
        if w.ac_every:
            ev.alloc([r512(w.batch * w.seq * w.seq), r512(8 * w.seq)])  # bool causal mask, positions
        x, tapes, stream_end, inputs = embeds, [], [], []
        for index in range(spec.num_layers):
            checkpointed = act.is_checkpointed(w, index)
            tape = LayerTape(ev, no_grad=checkpointed)
            output = forward_layer(tape, spec, w, index, stream_end)
            if checkpointed:
                # Nothing is saved inside a checkpoint: its tensors die in forward; the input stays.
                tape.flush()
                ev.free([t for ids in tape.kept.values() for t in ids])
                tape = None
                inputs.append(x)
            else:
                inputs.append(None)
                if x != embeds and not fp32_stream and not (index and act.is_checkpointed(w, index - 1)):
                    ev.free([x])  # the layer loop's reference to the previous output
            tapes.append(tape)
            x = output
        final = LayerTape(ev)
        _norm(final, T, spec.hidden_size, e, w.mixed, True, train_all, out_keep=train_all and not w.mixed)
        _loss(ev, spec, w, r512((2 if w.mixed else e) * T * spec.hidden_size))
        ev.free(stream_end + ([] if fp32_stream or w.ac_every else [x]))
        grads = ev.alloc(head)
        ev.free(final.kept["norm1"])
        for index in reversed(range(spec.num_layers)):
            tape = tapes[index]
            if tape is None:  # recompute the checkpointed layer, then its backward
                tape = LayerTape(ev)
                ev.free([forward_layer(tape, spec, w, index, [])])
            backward_layer(tape, spec, w, grads, attention_grads, mlp_grads)
            if inputs[index] is not None and inputs[index] != embeds:
                ev.free([inputs[index]])
        ev.free([embeds] if (w.ac_every or not fp32_stream) else [])
        _optimizer_step(ev, w, grads + ev.alloc(tail), grad_sizes, state_sizes if step == 0 else [])
    return ev.events


def optimizer_state_tensors(w: Workload, numels: list[int], param_bytes: list[int]) -> list[int]:
    """The optimizer's state tensors in the order it creates them: parameter by parameter."""
    out: list[int] = []
    for numel, size in zip(numels, param_bytes):
        if w.optimizer == "adamw":
            out += [512, size, size]  # step, exp_avg, exp_avg_sq
        elif w.optimizer == "sgd":
            out.append(size)
        elif w.optimizer == "adafactor":
            out += [512, r512(size // max(numel, 1) * int(numel ** 0.5) * 2)]  # row and column vectors, roughly
        elif numel >= BNB_MIN_8BIT_SIZE:
            blocks = r512(4 * -(-numel // BNB_BLOCK))
            out += [512, r512(numel), r512(numel), blocks, blocks]
        else:
            out += [512, r512(4 * numel), r512(4 * numel)]
    return out


def _norm_ops(ev: _Events, T: int, h: int, e: int) -> int:
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


def _rope_ops(ev: _Events, size: int) -> int:
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
    """Generation without autograd, op by op through each decoder layer as transformers runs it."""
    T = w.batch * w.seq
    e = act.compute_bytes(w)
    h, q, kv, I = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
    ev = _Events()
    ev.alloc(weight_tensor_sizes(spec, w))
    ev.alloc([r512(8 * T)])  # input ids
    embeds = ev.alloc([r512(e * T * h)])[0]
    ev.alloc([r512(e * w.seq * spec.head_dim)] * 2)  # RoPE cos, sin
    cache = []
    x = embeds
    for _layer in range(spec.num_layers):
        y = _norm_ops(ev, T, h, e)
        q_proj, k_proj, v_proj = ev.alloc([r512(e * T * q), r512(e * T * kv), r512(e * T * kv)])
        q_rot = _rope_ops(ev, r512(e * T * q))
        k_rot = _rope_ops(ev, r512(e * T * kv))
        ev.free([q_proj, k_proj])
        layer_cache = ev.alloc([kv_layer_tensor_bytes(spec, w.batch, w.seq, w.kv_dtype)] * 2)
        ev.free([k_rot, v_proj])
        attn = ev.alloc([r512(e * T * q)])
        ev.free(ev.alloc([r512(4 * w.batch * spec.num_heads * w.seq)]))  # logsumexp
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
        cache.append(layer_cache)
    steps = min(max(w.new_tokens - 1, 0), MAX_DECODE_STEPS)
    start = w.seq + max(w.new_tokens - 1, 0) - steps
    for step in range(steps):
        for layer in range(spec.num_layers):
            grown = ev.alloc([kv_layer_tensor_bytes(spec, w.batch, start + step + 1, w.kv_dtype)] * 2)
            ev.free(cache[layer])
            cache[layer] = grown
        ev.free(ev.alloc([r512(4 * w.batch * spec.vocab_size)]))
    return ev.events


def schedule(spec: ModelSpec, w: Workload) -> list[AllocEvent]:
    return training_schedule(spec, w) if w.is_training else inference_schedule(spec, w)
