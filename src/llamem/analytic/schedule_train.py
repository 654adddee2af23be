"""A training step's allocations in the order transformers' Llama code and autograd make them.

Op by op through each decoder layer (the order traced on transformers 5.x and torch 2.13):
forward keeps what autograd saves, by name, and frees the rest where the code drops it;
inside a checkpoint nothing is saved, and its recomputation stops once the last saved
tensor exists, as torch's non-reentrant checkpoint does; backward frees each saved tensor
where autograd is done with it. Three modes: pure precision (bf16/fp16/fp32), bf16 autocast
with fp32 weights (its backward is the least exact part), and LoRA/QLoRA on a frozen base.
Used only to replay through the allocator simulator.
"""

from __future__ import annotations

from llamem.analytic import activations as act
from llamem.analytic.common import r512
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import Workload


class LayerTape:
    """Allocations of one layer. What autograd saves is named in `saved` and freed by the
    backward where autograd frees it; everything else dies where the code drops it."""

    def __init__(self, events, index: int, no_grad: bool = False, recompute: bool = False):
        self.ev = events
        self.index = index
        self.saved: dict[str, int] = {}
        self.no_grad = no_grad
        """Inside a checkpoint's forward nothing is saved."""
        self.recompute = recompute
        """A checkpoint's recomputation stops once the last saved tensor exists."""

    def new(self, size: int) -> int | None:
        return self.ev.alloc([r512(size)])[0] if size > 0 else None

    def save(self, name: str, tensor: int | None, when: bool = True) -> None:
        if when and tensor is not None and not self.no_grad:
            self.saved[name] = tensor

    def drop(self, *tensors: int | None) -> None:
        kept = set(self.saved.values())
        self.ev.free([t for t in dict.fromkeys(tensors) if t is not None and t not in kept])

    def release(self, *names: str) -> None:
        """Autograd is done with these; a tensor saved under another name too stays."""
        tensors = [self.saved.pop(n) for n in names if n in self.saved]
        self.drop(*tensors)

    def release_all(self) -> None:
        self.release(*list(self.saved))


def _norm(tape: LayerTape, T: int, h: int, e: int, mixed: bool, input_rg: bool, weight_trains: bool,
          out_keep: bool, prefix: str = "norm") -> int:
    """LlamaRMSNorm forward in its allocation order. Saves the fp32 upcast and rsqrt (for the
    input's gradient) and the normalised input (for the weight's); `out_keep`: the next
    matmul saves the output."""
    low = e < 4 and not mixed
    upcast = tape.new(4 * T * h) if low else None
    power = tape.new(4 * T * h)
    mean = tape.new(4 * T)
    tape.drop(power)
    plus_eps = tape.new(4 * T)
    rsqrt = tape.new(4 * T)
    tape.drop(plus_eps)
    normed = tape.new(4 * T * h)
    tape.save(f"{prefix}.upcast", upcast, input_rg)
    tape.save(f"{prefix}.rsqrt", rsqrt, input_rg)
    tape.save(f"{prefix}.normed", normed, weight_trains and not low)
    tape.drop(rsqrt, upcast)
    cast = tape.new(e * T * h) if low else None
    tape.save(f"{prefix}.cast", cast, weight_trains)
    out = tape.new((4 if mixed else e) * T * h)
    tape.save(f"{prefix}.out", out, out_keep)
    tape.drop(cast, normed, mean)
    return out


def norm_backward(tape: LayerTape, T: int, h: int, e: int, mixed: bool, weight_trains: bool, grad: int,
                  prefix: str = "norm") -> int:
    """LlamaRMSNorm's backward op by op (traced on transformers 5.x): returns the input's
    gradient. Pure bf16/fp16 upcasts the gradient, works in fp32 and casts the result back."""
    ev = tape.ev
    low = e < 4 and not mixed
    scaled = tape.new((e if low else 4) * T * h)  # grad * weight
    if weight_trains:
        ev.free([tape.new((e if low else 4) * T * h)])  # grad * normed, summed into the weight's gradient
        tape.release(f"{prefix}.cast", f"{prefix}.normed")
    ev.free([grad])
    if low:
        upcast = tape.new(4 * T * h)
        ev.free([scaled])
        scaled = upcast
    first, by_input = tape.new(4 * T * h), tape.new(4 * T * h)
    ev.free([first, scaled])
    tape.release(f"{prefix}.rsqrt")
    spread = [tape.new(4 * T * h) for _ in range(4)]
    ev.free(spread[2:0:-1])
    tape.release(f"{prefix}.upcast", f"{prefix}.input")
    ev.free(spread[:1])
    total = tape.new(4 * T * h)
    ev.free([by_input, spread[3]])
    if not low:
        return total
    out = tape.new(e * T * h)
    ev.free([total])
    return out


def _rope(tape: LayerTape, size: int, half: int) -> int:
    first = tape.new(size)
    neg = tape.new(half)
    cat = tape.new(2 * half)
    tape.drop(neg)
    second = tape.new(size)
    tape.drop(cat)
    out = tape.new(size)
    tape.drop(first, second)
    return out


def _rope_backward(tape: LayerTape, size: int, half: int, grad: int) -> int:
    """apply_rotary_pos_emb's backward: grad * sin through rotate_half's slices, grad * cos, summed."""
    by_sin = tape.new(size)
    neg = tape.new(half)
    low = tape.new(size)
    tape.ev.free([neg])
    high = tape.new(size)
    tape.ev.free([by_sin])
    rotated = tape.new(size)
    tape.ev.free([low, high])
    by_cos = tape.new(size)
    tape.ev.free([grad])
    out = tape.new(size)
    tape.ev.free([rotated, by_cos])
    return out


class _Stop(Exception):
    """A checkpoint's recomputation reached its last saved tensor."""


def forward_layer(tape: LayerTape, spec: ModelSpec, w: Workload, index: int, stream_end: list[int]) -> int | None:
    """One decoder layer's forward; returns the output (h2), or None for a recomputation that
    stopped early. Cache copies that live until the end of forward (not saved) go to
    `stream_end`. Without a cache (checkpointing), SDPA gets the materialised mask, and with
    grouped-query attention K and V repeated to every head."""
    try:
        return _forward_layer(tape, spec, w, index, stream_end)
    except _Stop:
        return None


def _forward_layer(tape: LayerTape, spec: ModelSpec, w: Workload, index: int, stream_end: list[int]) -> int:
    T, b, s = w.batch * w.seq, w.batch, w.seq
    h, q, kv, I = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
    e, mixed = act.compute_bytes(w), w.mixed
    flags = act.layer_flags(w, index)
    targets, rank = flags.targets, w.lora_rank
    train_all = flags.train_all
    shapes = spec.layer_linear_shapes()
    ae = 2 if mixed else e

    def linear(name: str, x_rg: bool = True) -> int:
        fan_in, fan_out = shapes[name]
        if mixed:
            copy = tape.new(2 * fan_in * fan_out)  # autocast's weight cast, cached for the step
            cast = tape.new(2 * T * fan_in)
            out = tape.new(2 * T * fan_out)
            tape.save(f"{name}.copy", copy, x_rg or train_all)
            tape.save(f"{name}.cast", cast, train_all)
            tape.drop(copy, cast)
            return out
        dequant = tape.new(2 * fan_in * fan_out) if w.quant != "none" else None
        base = tape.new(e * T * fan_out)
        tape.drop(dequant)
        if name not in targets:
            return base
        cast = tape.new(4 * T * fan_in) if e < 4 else None  # the input cast to the fp32 adapter
        tape.save(f"{name}.lora_in", cast)
        lora_a = tape.new(4 * T * rank)
        tape.save(f"{name}.lora_a", lora_a)
        if tape.recompute and name == "down_proj":
            raise _Stop
        lora_b = tape.new(4 * T * fan_out)
        tape.drop(lora_a)
        scaled = tape.new(4 * T * fan_out)
        tape.drop(lora_b)
        summed = tape.new(4 * T * fan_out)
        tape.drop(scaled, base)
        result = tape.new(e * T * fan_out)
        tape.drop(summed, cast)  # peft's forward holds the cast input until it returns
        return result

    y = _norm(tape, T, h, e, mixed, flags.input_requires_grad, train_all, out_keep=train_all and not mixed,
              prefix="norm1")
    attn_rg = flags.input_requires_grad or bool(targets & {"q_proj", "k_proj", "v_proj"})
    q_out, k_out, v_out = (linear(n, flags.input_requires_grad) for n in ("q_proj", "k_proj", "v_proj"))
    rope_bytes = 4 if mixed else e
    q_rot = _rope(tape, rope_bytes * T * q, ae * T * q // 2)
    k_rot = _rope(tape, rope_bytes * T * kv, ae * T * kv // 2)
    tape.drop(q_out, k_out)
    key, value, mask = k_rot, v_out, None
    if w.ac_every:
        if spec.gqa_groups > 1:  # repeat_kv: SDPA without a cache gets every head's copy
            key, value = tape.new(rope_bytes * T * q), tape.new(ae * T * q)
        if mixed:
            tape.drop(key)
        mask = tape.new(ae * b * s * s)  # the mask in the compute dtype
        tape.save("mask", mask, attn_rg)
    else:
        cache_k, cache_v = tape.new(rope_bytes * T * kv), tape.new(ae * T * kv)
        key, value = cache_k, cache_v
        if mixed:
            stream_end.append(cache_k)
    if mixed:
        key = tape.new(2 * T * kv)
        query = tape.new(2 * T * q)
    else:
        query = q_rot
    tape.save("query", query, attn_rg)
    tape.save("key", key, attn_rg)
    tape.save("value", value, attn_rg)
    attention = tape.new(ae * T * q)
    tape.drop(mask, *((key, value) if key != k_rot and not mixed else ()))
    tape.save("attention", attention, attn_rg)
    lse = tape.new(4 * b * spec.num_heads * s)
    tape.save("lse", lse, attn_rg)
    tape.save("o_proj.in", attention, train_all and not mixed)
    o = linear("o_proj")
    tape.drop(attention, lse, mask, query, q_rot, key, value, k_rot, v_out, y)
    h1 = tape.new((4 if mixed else e) * T * h)
    tape.save("h1", h1, mixed or e == 4)
    tape.drop(o)
    y2 = _norm(tape, T, h, e, mixed, True, train_all, out_keep=train_all and not mixed, prefix="norm2")
    gate = linear("gate_proj")
    tape.save("gate", gate)
    silu = tape.new(ae * T * I)
    tape.save("silu", silu)
    tape.drop(gate)
    up = linear("up_proj")
    tape.save("up", up)
    product = tape.new(ae * T * I)
    tape.save("product", product, train_all and not mixed)
    tape.drop(silu, up)
    if tape.recompute and "down_proj" not in targets:
        tape.drop(product, y2, h1)
        raise _Stop
    down = linear("down_proj")
    tape.drop(product, y2)
    h2 = tape.new((4 if mixed else e) * T * h)
    tape.save("h2", h2, mixed or e == 4)
    tape.drop(down, h1)
    return h2


def _linear_backward(tape: LayerTape, spec: ModelSpec, w: Workload, name: str, grad: int, trains: bool,
                     grads: list[int], last_use: tuple[str, ...] = (), residual: bool = False) -> int:
    """One projection's backward: the weight's gradient (if it trains), the input's gradient,
    LoRA's adapter chain when it has one. Frees `last_use` saves and the output's gradient,
    unless that is the residual stream's (`residual`), which its sum still reads."""
    fan_in, fan_out = spec.layer_linear_shapes()[name]
    T = w.batch * w.seq
    if residual and w.mixed:  # autocast: the bf16 output's gradient is a cast of the stream's
        grad = tape.new(2 * T * fan_out)
    keep = [grad] if residual and not w.mixed else []
    e, ev = act.compute_bytes(w), tape.ev
    if w.mixed:
        if trains:
            low = tape.new(2 * fan_in * fan_out)
            grads.append(tape.new(4 * fan_in * fan_out))  # the weight cast's backward: the fp32 gradient
            ev.free([low])
        g_low = tape.new(2 * T * fan_in)
        tape.release(f"{name}.cast", *last_use)
        ev.free([grad])
        g_in = tape.new(4 * T * fan_in)  # the input cast's backward
        ev.free([g_low])
        return g_in
    if trains:
        grads.append(tape.new(DTYPE_BYTES[w.weight_dtype] * fan_in * fan_out))
    if f"{name}.lora_a" not in tape.saved:
        g_in = tape.new(e * T * fan_in)
        tape.release(*last_use)
        ev.free([grad] if not keep else [])
        return g_in
    rank = w.lora_rank
    g32 = tape.new(4 * T * fan_out)  # the result cast's backward
    g_scaled = tape.new(4 * T * fan_out)
    ev.free([g32])
    grads.append(tape.new(4 * rank * fan_out))
    g_a = tape.new(4 * T * rank)
    tape.release(f"{name}.lora_a")
    ev.free([g_scaled])
    grads.append(tape.new(4 * fan_in * rank))
    g_cast = tape.new(4 * T * fan_in)
    tape.release(f"{name}.lora_in")
    ev.free([g_a])
    g_lora = tape.new(e * T * fan_in)
    ev.free([g_cast])
    g_base = tape.new(e * T * fan_in)
    tape.release(*last_use)
    ev.free([grad] if not keep else [])
    g_in = tape.new(e * T * fan_in)
    ev.free([g_lora, g_base])
    return g_in


def _sum(tape: LayerTape, size: int, *inputs: int) -> int:
    """A new tensor made from `inputs`, which die with it (a sum, or repeat_kv's reduction)."""
    out = tape.new(size)
    tape.ev.free(list(inputs))
    return out


def backward_layer(tape: LayerTape, spec: ModelSpec, w: Workload, grads: list[int], grad: int) -> int:
    """One layer's backward in autograd's order (traced on transformers 5.x): the MLP, the
    post-attention norm, attention with RoPE, the input norm, each residual's sum. Takes the
    output's gradient and returns the input's; weight gradients go to `grads`."""
    T = w.batch * w.seq
    h, q, kv, I = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
    e, mixed = act.compute_bytes(w), w.mixed
    ae = 2 if mixed else e
    stream = (4 if mixed else e) * T * h
    flags = act.layer_flags(w, tape.index)
    train_all = flags.train_all
    norm_grad = DTYPE_BYTES[w.weight_dtype] * h
    ev = tape.ev

    def linear(name: str, g: int, *last_use: str, residual: bool = False) -> int:
        return _linear_backward(tape, spec, w, name, g, train_all, grads, last_use, residual)

    g_product = linear("down_proj", grad, "product", residual=True)
    g_up, g_silu = tape.new(ae * T * I), tape.new(ae * T * I)
    tape.release("silu", "up")
    ev.free([g_product])
    g_x_up = linear("up_proj", g_up)
    g_gate = tape.new(ae * T * I)
    tape.release("gate")
    ev.free([g_silu])
    g_x_gate = linear("gate_proj", g_gate, "norm2.out")
    g_norm2_out = _sum(tape, (4 if mixed else e) * T * h, g_x_up, g_x_gate)
    g_norm2_in = norm_backward(tape, T, h, e, mixed, train_all, g_norm2_out, prefix="norm2")
    if train_all:
        grads.append(tape.new(norm_grad))
    g_h1 = _sum(tape, stream, grad, g_norm2_in)
    tape.release("h2")
    g_attention = linear("o_proj", g_h1, "o_proj.in", residual=True)
    repeated = q if (w.ac_every and spec.gqa_groups > 1) else kv
    g_q, g_k, g_v = tape.new(ae * T * q), tape.new(ae * T * repeated), tape.new(ae * T * repeated)
    tape.release("attention", "lse", "query", "key", "value", "mask")
    ev.free([g_attention])
    if repeated != kv:  # repeat_kv's backward sums the copies back to the key-value heads
        g_k = _sum(tape, ae * T * kv, g_k)
        g_v = _sum(tape, ae * T * kv, g_v)
    rope_bytes = 4 if mixed else e
    g_k = _rope_backward(tape, rope_bytes * T * kv, ae * T * kv // 2, g_k)
    g_q = _rope_backward(tape, rope_bytes * T * q, ae * T * q // 2, g_q)
    g_x = linear("v_proj", g_v)
    g_k_flat = tape.new(ae * T * kv)  # the transposed gradient made contiguous
    ev.free([g_k])
    g_x = _sum(tape, (4 if mixed else e) * T * h, g_x, linear("k_proj", g_k_flat))
    g_q_flat = tape.new(ae * T * q)
    ev.free([g_q])
    g_x = _sum(tape, (4 if mixed else e) * T * h, g_x, linear("q_proj", g_q_flat, "norm1.out"))
    g_norm1_in = norm_backward(tape, T, h, e, mixed, train_all, g_x, prefix="norm1")
    if train_all:
        grads.append(tape.new(norm_grad))
    g_in = _sum(tape, stream, g_h1, g_norm1_in)
    tape.release("h1")
    tape.release_all()
    return g_in

