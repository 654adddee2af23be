"""A training step's allocations in the order transformers' Llama code and autograd make them.

Op by op through each decoder layer (the order traced on transformers 5.x and torch 2.13):
forward keeps what autograd saves, by name, and frees the rest where the code drops it;
inside a checkpoint nothing is saved, and its recomputation stops once the last saved
tensor exists, as torch's non-reentrant checkpoint does; a recomputed tensor dies as soon as the
backward node that reads it has read it (an RMSNorm's normalised input before its weight's gradient
is summed), and the checkpoint's frame, with the layer's input, in the input norm's backward;
backward frees each saved tensor where autograd is done with it. Three modes: pure precision
(bf16/fp16/fp32), bf16 autocast with fp32 weights (casts only of fp32 inputs; each linear's backward
makes the bf16 gradients, lets go of what it saved, then runs the input cast's backward and the weight
cast's), and LoRA/QLoRA on a frozen base.
Used only to replay through the allocator simulator.
"""

from __future__ import annotations

from llamem.analytic import activations as act
from llamem.analytic.attention_paths import uncached_mask
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
        self.forward_end: list[int] = []
        """What lives until the end of the model's forward (autocast's weight casts inside a checkpoint)."""
        self.grad_cast: int | None = None
        """Autocast: down_proj's bf16 cast of the stream's gradient, made before a checkpoint's recomputation."""
        self.frame: list[int] = []
        """A recomputation: what its checkpoint's frame keeps (the layer's input, the checkpoint's other
        arguments), let go of where the recomputed input norm's backward lets go of that input."""

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

    def release_frame(self) -> None:
        self.ev.free(self.frame)
        self.frame = []

    def release_all(self) -> None:
        self.release(*list(self.saved))


def norm_forward(tape: LayerTape, T: int, h: int, e: int, mixed: bool, input_rg: bool, weight_trains: bool,
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


def hand_stream_to_norm(tape: LayerTape, prefix: str, previous: LayerTape | None, stream: int) -> None:
    """Autocast without checkpointing: the norm that reads the fp32 stream (the previous layer's output or the
    embedding's) is what saves it, and its backward lets it go; the layer that made it no longer keeps it."""
    tape.saved[f"{prefix}.input"] = stream
    if previous is not None:
        previous.saved.pop("h2", None)


def norm_backward(tape: LayerTape, T: int, h: int, e: int, mixed: bool, weight_trains: bool, grad: int,
                  prefix: str = "norm", *, residual: int | None = None,
                  weight_grad: tuple[int, list[int]] | None = None) -> int:
    """LlamaRMSNorm's backward op by op (traced on transformers 5.x): returns the input's
    gradient. Pure bf16/fp16 upcasts the gradient, works in fp32 and casts the result back.
    `residual`: the stream's gradient, which autograd sums the input's into as each part of it comes (an
    fp32 input's: autocast). `weight_grad`: (bytes, gradients) to make the weight's where autograd sums it."""
    ev = tape.ev
    low = e < 4 and not mixed
    scaled = tape.new((e if low else 4) * T * h)  # grad * weight
    if weight_trains:
        by_normed = tape.new((e if low else 4) * T * h)  # grad * normed, summed into the weight's gradient
        if tape.recompute:  # a checkpoint's recomputed tensor dies once the node has read it, not with the node
            tape.release(f"{prefix}.cast", f"{prefix}.normed")
        if weight_grad is not None:
            weight_grad[1].append(tape.new(weight_grad[0]))
        ev.free([by_normed])
        tape.release(f"{prefix}.cast", f"{prefix}.normed")
    ev.free([grad])
    if low:
        upcast = tape.new(4 * T * h)
        ev.free([scaled])
        scaled = upcast
    first, by_input = tape.new(4 * T * h), tape.new(4 * T * h)
    ev.free([first, scaled])
    if residual is not None:  # the stream's gradient plus the input's first part
        summed = tape.new(4 * T * h)
        ev.free([residual, by_input])
        by_input = summed
    tape.release(f"{prefix}.rsqrt")
    spread = [tape.new(4 * T * h) for _ in range(4)]
    ev.free(spread[2:0:-1])
    tape.release(f"{prefix}.upcast", f"{prefix}.input")
    ev.free(spread[:1])
    if prefix == "norm1":  # a checkpoint's frame dies with the last of its recomputed tensors
        tape.release_frame()
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


def _autocast_rope_backward(tape: LayerTape, size: int, grad: int) -> int:
    """apply_rotary_pos_emb's backward under autocast, from the fp32 gradient (`size` bytes) of its fp32 output:
    each product's gradient cast back to the bf16 projection's dtype, rotate_half's backward in bf16, the sum."""
    ev, low_size = tape.ev, size // 2
    by_sin = tape.new(size)
    sin_cast = tape.new(low_size)
    ev.free([by_sin])
    neg = tape.new(low_size // 2)
    low = tape.new(low_size)
    ev.free([neg])
    high = tape.new(low_size)
    ev.free([sin_cast])
    rotated = tape.new(low_size)
    ev.free([low, high])
    by_cos = tape.new(size)
    cos_cast = tape.new(low_size)
    ev.free([by_cos, grad])
    out = tape.new(low_size)
    ev.free([rotated, cos_cast])
    return out


class _Stop(Exception):
    """A checkpoint's recomputation reached its last saved tensor."""


def forward_layer(tape: LayerTape, spec: ModelSpec, w: Workload, index: int, stream_end: list[int]) -> int | None:
    """One decoder layer's forward; returns the output (h2), or None for a recomputation that
    stopped early. Cache copies that live until the end of forward (not saved) go to
    `stream_end`. Without a cache (checkpointing), SDPA runs causal on K and V as RoPE and v_proj made
    them or, when the mask is materialised (`uncached_mask`), gets it, and with grouped-query attention
    K and V repeated to every head."""
    tape.forward_end = stream_end
    try:
        return _forward_layer(tape, spec, w, index, stream_end)
    except _Stop:
        return None


def _forward_layer(tape: LayerTape, spec: ModelSpec, w: Workload, index: int, stream_end: list[int]) -> int:
    flags = act.layer_flags(w, index)
    T, e = w.batch * w.seq, act.compute_bytes(w)
    y = norm_forward(tape, T, spec.hidden_size, e, w.mixed, flags.input_requires_grad, flags.train_all,
                     out_keep=flags.train_all and not w.mixed, prefix="norm1")
    h1 = _attention_forward(tape, spec, w, flags, y, stream_end)
    return _mlp_forward(tape, spec, w, flags, h1)


def _linear(tape: LayerTape, spec: ModelSpec, w: Workload, flags: act.LayerFlags, name: str,
            x_rg: bool = True) -> int:
    """One projection's forward, whose output the events are told of (a tensor-parallel rank all-reduces
    a row-parallel one)."""
    out = _linear_forward(tape, spec, w, flags, name, x_rg)
    tape.ev.projection(name, out)
    return out


def _linear_forward(tape: LayerTape, spec: ModelSpec, w: Workload, flags: act.LayerFlags, name: str,
                    x_rg: bool) -> int:
    """Autocast's casts, or a (dequantized) base matmul and, when the linear is adapted, LoRA's chain.
    `x_rg`: the input needs a gradient."""
    fan_in, fan_out = spec.layer_linear_shapes()[name]
    T = w.batch * w.seq
    if w.mixed:
        return _autocast_linear(tape, name, T, (fan_in, fan_out), x_rg or flags.train_all, flags.train_all)
    dequant = tape.new(2 * fan_in * fan_out) if w.quant != "none" else None
    base = tape.new(act.compute_bytes(w) * T * fan_out)
    tape.drop(dequant)
    if name not in flags.targets:
        return base
    return _lora_linear(tape, w, name, fan_in, fan_out, base)


BF16_INPUT_LINEARS = ("o_proj", "down_proj")
"""Under autocast these read a bf16 tensor (attention's output, SwiGLU's product), which autocast does not
cast again; the others read the fp32 RMSNorm output."""


def _autocast_linear(tape: LayerTape, name: str, T: int, shape: tuple[int, int], copy_kept: bool,
                     trains: bool) -> int:
    """bf16 autocast: the weight's cast (cached for the step; autograd keeps it for the input's
    gradient), the input's cast where the input is fp32 (kept for the weight's), the bf16 output."""
    fan_in, fan_out = shape
    copy = tape.new(2 * fan_in * fan_out)
    cast = tape.new(2 * T * fan_in) if name not in BF16_INPUT_LINEARS else None
    out = tape.new(2 * T * fan_out)
    tape.save(f"{name}.copy", copy, copy_kept)
    tape.save(f"{name}.cast", cast, trains)
    if tape.no_grad:  # inside a checkpoint: autocast's cache keeps the weight's cast until the forward ends
        tape.forward_end.append(copy)
        copy = None
    tape.drop(copy, cast)
    return out


def _lora_linear(tape: LayerTape, w: Workload, name: str, fan_in: int, fan_out: int, base: int) -> int:
    """peft's LoRA forward on a frozen base output: the input cast to the fp32 adapter, lora_A,
    lora_B, the scaling, the sum with the base output and the cast back."""
    T, e, rank = w.batch * w.seq, act.compute_bytes(w), w.lora_rank
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


def _attention_forward(tape: LayerTape, spec: ModelSpec, w: Workload, flags: act.LayerFlags, y: int,
                       stream_end: list[int]) -> int:
    """Self-attention from the input norm's output `y` to the residual mid-point h1."""
    T, q, kv = w.batch * w.seq, spec.q_dim, spec.kv_dim
    attn_rg = flags.input_requires_grad or bool(flags.targets & {"q_proj", "k_proj", "v_proj"})
    q_out, k_out, v_out = (_linear(tape, spec, w, flags, n, flags.input_requires_grad)
                           for n in ("q_proj", "k_proj", "v_proj"))
    q_rot, k_rot = _rope_qk(tape, spec, w, q_out, k_out)
    key, value, mask = _attention_keys(tape, spec, w, attn_rg, k_rot, v_out, stream_end)
    if w.mixed and not w.ac_every:  # autocast: the cache's copies are made, RoPE's K and v_proj's V die
        tape.drop(k_rot, v_out)
        k_rot = v_out = None
    query = q_rot
    if w.mixed:  # SDPA's bf16 casts of the fp32 RoPE outputs
        key = tape.new(2 * T * kv)
        query = tape.new(2 * T * q)
    attention, lse = _sdpa(tape, spec, w, attn_rg, (query, key, value, mask), k_rot)
    if w.mixed and (tape.no_grad or not attn_rg):  # nothing keeps the casts or the logsumexp: they die with SDPA
        tape.drop(lse, query, key)
        lse = query = key = None
    tape.save("o_proj.in", attention, flags.train_all)
    o = _linear(tape, spec, w, flags, "o_proj")
    tape.drop(attention, lse, mask, query, q_rot, key, value, k_rot, v_out, y)
    h1 = tape.new((4 if w.mixed else act.compute_bytes(w)) * T * spec.hidden_size)
    # An fp32 stream (autocast, fp32 compute): the post-attention norm saves h1 itself; its backward lets go of it.
    tape.save("norm2.input", h1, w.mixed or act.compute_bytes(w) == 4)
    tape.drop(o)
    return h1


def _rope_qk(tape: LayerTape, spec: ModelSpec, w: Workload, q_out: int, k_out: int) -> tuple[int, int]:
    """RoPE on q and k (fp32 under autocast: cos and sin are fp32); the projections die."""
    T, ae = w.batch * w.seq, 2 if w.mixed else act.compute_bytes(w)
    rope_bytes = 4 if w.mixed else act.compute_bytes(w)
    q_rot = _rope(tape, rope_bytes * T * spec.q_dim, ae * T * spec.q_dim // 2)
    k_rot = _rope(tape, rope_bytes * T * spec.kv_dim, ae * T * spec.kv_dim // 2)
    tape.drop(q_out, k_out)
    return q_rot, k_rot


def _attention_keys(tape: LayerTape, spec: ModelSpec, w: Workload, attn_rg: bool, k_rot: int, v_out: int,
                    stream_end: list[int]) -> tuple[int, int, int | None]:
    """(key, value, mask) as SDPA gets them. With the cache: its K and V (an fp32 K under autocast,
    alive until the end of forward). Without (checkpointing): RoPE's K and v_proj's V, no mask or, when
    the mask is materialised (`uncached_mask`), it in the compute dtype and, with grouped-query
    attention, K and V repeated to every head."""
    T, q, kv = w.batch * w.seq, spec.q_dim, spec.kv_dim
    ae = 2 if w.mixed else act.compute_bytes(w)
    rope_bytes = 4 if w.mixed else act.compute_bytes(w)
    if not w.ac_every:
        cache_k, cache_v = tape.new(rope_bytes * T * kv), tape.new(ae * T * kv)
        if w.mixed:
            stream_end.append(cache_k)
        return cache_k, cache_v, None
    if not uncached_mask(w):
        return k_rot, v_out, None
    key, value = k_rot, v_out
    if spec.gqa_groups > 1:  # repeat_kv: SDPA without a cache gets every head's copy
        key, value = tape.new(rope_bytes * T * q), tape.new(ae * T * q)
    if w.mixed:
        tape.drop(key)
    mask = tape.new(ae * w.batch * w.seq * w.seq)  # the mask in the compute dtype
    tape.save("mask", mask, attn_rg)
    return key, value, mask


def _sdpa(tape: LayerTape, spec: ModelSpec, w: Workload, attn_rg: bool,
          inputs: tuple[int, int, int, int | None], k_rot: int) -> tuple[int, int]:
    """SDPA keeps its inputs, the output and the fp32 logsumexp; repeated K/V and the mask of
    pure precision die with the call."""
    query, key, value, mask = inputs
    tape.save("query", query, attn_rg)
    tape.save("key", key, attn_rg)
    tape.save("value", value, attn_rg)
    attention = tape.new((2 if w.mixed else act.compute_bytes(w)) * w.batch * w.seq * spec.q_dim)
    tape.drop(mask, *((key, value) if key != k_rot and not w.mixed else ()))
    tape.save("attention", attention, attn_rg)
    lse = tape.new(4 * w.batch * spec.num_heads * w.seq)
    tape.save("lse", lse, attn_rg)
    return attention, lse


def _mlp_forward(tape: LayerTape, spec: ModelSpec, w: Workload, flags: act.LayerFlags, h1: int) -> int:
    """The post-attention norm and SwiGLU MLP, from h1 to the layer output h2. A recomputation
    stops after the product unless down_proj is adapted (its LoRA chain saves more)."""
    T, h = w.batch * w.seq, spec.hidden_size
    e, mixed = act.compute_bytes(w), w.mixed
    y2 = norm_forward(tape, T, h, e, mixed, True, flags.train_all, out_keep=flags.train_all and not mixed,
                      prefix="norm2")
    product = _swiglu(tape, spec, w, flags)
    if tape.recompute and "down_proj" not in flags.targets:
        if mixed:  # down_proj's weight cast is the last tensor it saves
            fan_in, fan_out = spec.layer_linear_shapes()["down_proj"]
            tape.save("down_proj.copy", tape.new(2 * fan_in * fan_out))
        tape.drop(product, y2, h1)
        raise _Stop
    down = _linear(tape, spec, w, flags, "down_proj")
    tape.drop(product, y2)
    h2 = tape.new((4 if mixed else e) * T * h)
    tape.save("h2", h2, mixed or e == 4)
    tape.drop(down, h1)
    return h2


def _swiglu(tape: LayerTape, spec: ModelSpec, w: Workload, flags: act.LayerFlags) -> int:
    """gate, silu(gate), up and their product, each saved where its backward needs it."""
    ae_TI = (2 if w.mixed else act.compute_bytes(w)) * w.batch * w.seq * spec.intermediate_size
    gate = _linear(tape, spec, w, flags, "gate_proj")
    tape.save("gate", gate)
    silu = tape.new(ae_TI)
    tape.save("silu", silu)
    tape.drop(gate)
    up = _linear(tape, spec, w, flags, "up_proj")
    tape.save("up", up)
    product = tape.new(ae_TI)
    tape.save("product", product, flags.train_all)
    tape.drop(silu, up)
    return product


def _linear_backward(tape: LayerTape, spec: ModelSpec, w: Workload, name: str, grad: int, trains: bool,
                     grads: list[int], last_use: tuple[str, ...] = (), residual: bool = False,
                     sum_with: int | None = None) -> int:
    """One projection's backward, whose input gradient the events are told of (a tensor-parallel rank
    all-reduces a column-parallel one) and then summed with `sum_with` (another projection's gradient of
    the same input). Under autocast the weight cast's backward comes after that sum, as autograd runs it."""
    low_weight_grad: list[int] = []
    g_in = _linear_grads(tape, spec, w, name, grad, trains, grads, last_use, residual, low_weight_grad)
    tape.ev.projection(name, g_in, backward=True)
    if sum_with is not None:
        g_in = _sum(tape, _stream_numel_bytes(spec, w), sum_with, g_in)
    if low_weight_grad:  # the weight cast's backward: the fp32 gradient
        fan_in, fan_out = spec.layer_linear_shapes()[name]
        grads.append(tape.new(4 * fan_in * fan_out))
        tape.ev.free(low_weight_grad)
    return g_in


def _linear_grads(tape: LayerTape, spec: ModelSpec, w: Workload, name: str, grad: int, trains: bool,
                  grads: list[int], last_use: tuple[str, ...], residual: bool, low_weight_grad: list[int]) -> int:
    """The weight's gradient (if it trains), the input's gradient, LoRA's adapter chain when it has one.
    Frees `last_use` saves and the output's gradient, unless that is the residual stream's (`residual`),
    which its sum still reads. Under autocast the bf16 weight gradient goes to `low_weight_grad`."""
    fan_in, fan_out = spec.layer_linear_shapes()[name]
    T = w.batch * w.seq
    if w.mixed:
        if residual:  # autocast: the bf16 output's gradient is a cast of the stream's (made before a recomputation)
            grad, tape.grad_cast = tape.grad_cast or tape.new(2 * T * fan_out), None
        low_weight_grad += [tape.new(2 * fan_in * fan_out)] if trains else []
        return _autocast_input_grad(tape, name, T, fan_in, grad, last_use)
    e = act.compute_bytes(w)
    if trains:
        grads.append(tape.new(DTYPE_BYTES[w.weight_dtype] * fan_in * fan_out))
    if f"{name}.lora_a" not in tape.saved:
        g_in = tape.new(e * T * fan_in)
        _done_with(tape, grad, last_use, residual)
        return g_in
    g_lora = _lora_backward(tape, w, name, fan_in, fan_out, grads)
    g_base = tape.new(e * T * fan_in)
    _done_with(tape, grad, last_use, residual)
    g_in = tape.new(e * T * fan_in)  # the base's and the adapter's input gradients summed
    tape.ev.free([g_lora, g_base])
    return g_in


def _done_with(tape: LayerTape, grad: int, last_use: tuple[str, ...], residual: bool) -> None:
    """Autograd is done with the `last_use` saves and the output's gradient, unless that is the
    residual stream's, which its sum still reads."""
    tape.release(*last_use)
    tape.ev.free([grad] if not residual else [])


def _autocast_input_grad(tape: LayerTape, name: str, T: int, fan_in: int, grad: int,
                         last_use: tuple[str, ...]) -> int:
    """bf16 autocast, after the bf16 weight gradient: the input's gradient in bf16; autograd then lets go
    of the output's gradient, the weight's cast and the input's, and runs the input cast's backward (fp32)
    where there is one (a bf16 input's gradient stays bf16)."""
    g_low = tape.new(2 * T * fan_in)
    tape.ev.free([grad])
    tape.release(f"{name}.copy", f"{name}.cast", *last_use)
    if name in BF16_INPUT_LINEARS:
        return g_low
    g_in = tape.new(4 * T * fan_in)
    tape.ev.free([g_low])
    return g_in


def _lora_backward(tape: LayerTape, w: Workload, name: str, fan_in: int, fan_out: int, grads: list[int]) -> int:
    """peft's adapter chain backward: the result cast's and the scaling's gradients (fp32), lora_B's
    weight gradient, lora_A's output gradient, lora_A's weight gradient, the input cast's gradient,
    cast back to the compute dtype (returned)."""
    T, e, rank, ev = w.batch * w.seq, act.compute_bytes(w), w.lora_rank, tape.ev
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
    return g_lora


def _sum(tape: LayerTape, size: int, *inputs: int) -> int:
    """A new tensor made from `inputs`, which die with it (a sum, or repeat_kv's reduction)."""
    out = tape.new(size)
    tape.ev.free(list(inputs))
    return out


def backward_layer(tape: LayerTape, spec: ModelSpec, w: Workload, grads: list[int], grad: int) -> int:
    """One layer's backward in autograd's order (traced on transformers 5.x): the MLP, the
    post-attention norm, attention with RoPE, the input norm, each residual's sum. Takes the
    output's gradient and returns the input's; weight gradients go to `grads`."""
    g_h1 = _mlp_backward(tape, spec, w, grads, grad)
    g_in = _attention_backward(tape, spec, w, grads, g_h1)
    tape.release_all()
    return g_in


def _stream_numel_bytes(spec: ModelSpec, w: Workload) -> int:
    """Bytes of one residual-stream tensor (or its gradient): fp32 under autocast."""
    return (4 if w.mixed else act.compute_bytes(w)) * w.batch * w.seq * spec.hidden_size


def _mlp_backward(tape: LayerTape, spec: ModelSpec, w: Workload, grads: list[int], grad: int) -> int:
    """down_proj, SwiGLU, up and gate, the post-attention norm; returns the gradient of the
    residual mid-point h1 (the output's gradient plus the norm input's)."""
    train_all = act.layer_flags(w, tape.index).train_all
    ae_TI = (2 if w.mixed else act.compute_bytes(w)) * w.batch * w.seq * spec.intermediate_size
    g_product = _linear_backward(tape, spec, w, "down_proj", grad, train_all, grads, ("product",), residual=True)
    g_up, g_silu = tape.new(ae_TI), tape.new(ae_TI)
    tape.release("silu", "up")
    tape.ev.free([g_product])
    g_x_up = _linear_backward(tape, spec, w, "up_proj", g_up, train_all, grads)
    g_gate = tape.new(ae_TI)
    tape.release("gate")
    tape.ev.free([g_silu])
    g_norm2_out = _linear_backward(tape, spec, w, "gate_proj", g_gate, train_all, grads, ("norm2.out",),
                                   sum_with=g_x_up)
    g_h1 = _layer_norm_backward(tape, spec, w, grads, g_norm2_out, "norm2", grad)
    tape.release("h2")
    return g_h1


def _layer_norm_backward(tape: LayerTape, spec: ModelSpec, w: Workload, grads: list[int], grad: int,
                         prefix: str, residual: int) -> int:
    """A decoder layer's RMSNorm backward and its weight's gradient (when it trains), summed into the
    stream's gradient `residual`: under autocast as autograd sums it, otherwise after."""
    train_all = act.layer_flags(w, tape.index).train_all
    weight_bytes = DTYPE_BYTES[w.weight_dtype] * spec.hidden_size
    if w.mixed:
        return norm_backward(tape, w.batch * w.seq, spec.hidden_size, 4, True, train_all, grad, prefix=prefix,
                             residual=residual, weight_grad=(weight_bytes, grads) if train_all else None)
    g_in = norm_backward(tape, w.batch * w.seq, spec.hidden_size, act.compute_bytes(w), False, train_all,
                         grad, prefix=prefix)
    if train_all:
        grads.append(tape.new(weight_bytes))
    return _sum(tape, _stream_numel_bytes(spec, w), residual, g_in)


def _attention_backward(tape: LayerTape, spec: ModelSpec, w: Workload, grads: list[int], g_h1: int) -> int:
    """o_proj, SDPA, RoPE, the q/k/v projections and the input norm; returns the layer input's
    gradient (h1's plus the norm input's)."""
    train_all = act.layer_flags(w, tape.index).train_all
    T, q, kv = w.batch * w.seq, spec.q_dim, spec.kv_dim
    ae, rope_bytes = (2, 4) if w.mixed else (act.compute_bytes(w),) * 2
    g_attention = _linear_backward(tape, spec, w, "o_proj", g_h1, train_all, grads, ("o_proj.in",), residual=True)
    g_q, g_k, g_v = _sdpa_backward(tape, spec, w, g_attention)
    if w.mixed:  # SDPA read bf16 casts of the fp32 RoPE outputs: the casts' backward, then RoPE's
        g_q, g_k = _sum(tape, 4 * T * q, g_q), _sum(tape, 4 * T * kv, g_k)
        g_k, g_q = _autocast_rope_backward(tape, 4 * T * kv, g_k), _autocast_rope_backward(tape, 4 * T * q, g_q)
    else:
        g_k = _rope_backward(tape, rope_bytes * T * kv, ae * T * kv // 2, g_k)
        g_q = _rope_backward(tape, rope_bytes * T * q, ae * T * q // 2, g_q)
    g_x = _linear_backward(tape, spec, w, "v_proj", g_v, train_all, grads)
    g_k_flat = tape.new(ae * T * kv)  # the transposed gradient made contiguous
    tape.ev.free([g_k])
    g_x = _linear_backward(tape, spec, w, "k_proj", g_k_flat, train_all, grads, sum_with=g_x)
    g_q_flat = tape.new(ae * T * q)
    tape.ev.free([g_q])
    g_x = _linear_backward(tape, spec, w, "q_proj", g_q_flat, train_all, grads, ("norm1.out",), sum_with=g_x)
    return _layer_norm_backward(tape, spec, w, grads, g_x, "norm1", g_h1)


def _sdpa_backward(tape: LayerTape, spec: ModelSpec, w: Workload, g_attention: int) -> tuple[int, int, int]:
    """SDPA's gradients of q, k and v; autograd then frees what attention saved. Repeated K and V
    (a materialised mask without a cache, grouped-query attention) are summed back to the key-value heads."""
    T, q, kv = w.batch * w.seq, spec.q_dim, spec.kv_dim
    ae = 2 if w.mixed else act.compute_bytes(w)
    repeated = q if (uncached_mask(w) and spec.gqa_groups > 1) else kv
    g_q, g_k, g_v = tape.new(ae * T * q), tape.new(ae * T * repeated), tape.new(ae * T * repeated)
    tape.release("attention", "lse", "query", "key", "value", "mask")
    tape.ev.free([g_attention])
    if repeated != kv:  # repeat_kv's backward sums the copies back to the key-value heads
        g_k = _sum(tape, ae * T * kv, g_k)
        g_v = _sum(tape, ae * T * kv, g_v)
    return g_q, g_k, g_v
