"""A training step's allocations in the order transformers' Llama code and autograd make them.

Forward, op by op through each decoder layer (the order traced on transformers 5.x): what
autograd saves is kept, the rest is freed where the code frees it; three modes: pure
precision (bf16/fp16/fp32), bf16 autocast with fp32 weights, and LoRA/QLoRA on a frozen
base. Backward is coarser: per layer, the input gradients and temporaries of the MLP and
attention backward, the weight gradients in reverse order, and the layer's saved tensors
freed section by section. Used only to replay through the allocator simulator.
"""

from __future__ import annotations

from llamem.analytic import activations as act
from llamem.analytic.common import r512
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import Workload


class LayerTape:
    """Allocations of one layer; `keep` ones survive until the layer's backward."""

    def __init__(self, events, no_grad: bool = False):
        self.ev = events
        self.kept: dict[str, list[int]] = {"norm1": [], "attn": [], "norm2": [], "mlp": [], "copies": []}
        self.section = "norm1"
        self.no_grad = no_grad
        """Inside a checkpoint nothing is saved: what autograd would keep dies with its block."""
        self.pending: list[int] = []

    def new(self, size: int, keep: bool = False) -> int | None:
        if size <= 0:
            return None
        tensor = self.ev.alloc([r512(size)])[0]
        if keep:
            (self.pending if self.no_grad else self.kept[self.section]).append(tensor)
        return tensor

    def keep(self, tensor: int | None) -> None:
        if tensor is None:
            return
        target = self.pending if self.no_grad else self.kept[self.section]
        if tensor not in target:
            target.append(tensor)

    def flush(self) -> None:
        """End of a block under no_grad: free what would have been saved."""
        if self.no_grad:
            self.ev.free(self.pending)
            self.pending = []

    def drop(self, *tensors: int | None) -> None:
        kept = {t for ids in self.kept.values() for t in ids}
        self.ev.free([t for t in tensors if t is not None and t not in kept])


def _norm(tape: LayerTape, T: int, h: int, e: int, mixed: bool, input_rg: bool, weight_trains: bool,
          out_keep: bool) -> int:
    upcast = tape.new(4 * T * h, keep=input_rg) if (e < 4 and not mixed) else None
    power = tape.new(4 * T * h)
    mean = tape.new(4 * T)
    tape.drop(power)
    plus_eps = tape.new(4 * T)
    rsqrt = tape.new(4 * T, keep=input_rg)
    tape.drop(plus_eps)
    normed = tape.new(4 * T * h, keep=weight_trains and (mixed or e == 4))
    tape.drop(rsqrt, upcast)
    cast = tape.new(e * T * h, keep=weight_trains) if (e < 4 and not mixed) else None
    out = tape.new((4 if mixed else e) * T * h, keep=out_keep)
    tape.drop(cast, normed, mean)
    return out


def _rope(tape: LayerTape, size: int, half: int, keep: bool) -> int:
    first = tape.new(size)
    neg = tape.new(half)
    cat = tape.new(2 * half)
    tape.drop(neg)
    second = tape.new(size)
    tape.drop(cat)
    out = tape.new(size, keep=keep)
    tape.drop(first, second)
    return out


def forward_layer(tape: LayerTape, spec: ModelSpec, w: Workload, index: int, stream_end: list[int]) -> int:
    """One decoder layer's forward; returns the output (h2). Cache copies that live until the
    end of forward (not saved) go to `stream_end`. Without a cache (checkpointing), SDPA gets
    the materialised mask: K and V repeated to every head and the mask in the compute dtype."""
    T, b, s = w.batch * w.seq, w.batch, w.seq
    h, q, kv, I = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
    e, mixed = act.compute_bytes(w), w.mixed
    flags = act.layer_flags(w, index)
    targets, rank = flags.targets, w.lora_rank
    train_all = flags.train_all
    lse = 4 * b * spec.num_heads * s
    shapes = spec.layer_linear_shapes()

    def linear(name: str, keep_input_cast: bool = False) -> int:
        fan_in, fan_out = shapes[name]
        if mixed:
            copy = tape.ev.alloc([r512(2 * fan_in * fan_out)])[0]
            (tape.pending if tape.no_grad else tape.kept["copies"]).append(copy)
            tape.new(2 * T * fan_in, keep=True)  # the input's bf16 cast, saved by the matmul
            return tape.new(2 * T * fan_out)
        dequant = tape.new(2 * fan_in * fan_out) if w.quant != "none" else None
        base = tape.new(e * T * fan_out)
        tape.drop(dequant)
        if name not in targets:
            return base
        if e < 4:
            tape.new(4 * T * fan_in, keep=True)  # the input cast to the fp32 adapter
        tape.new(4 * T * rank, keep=True)  # lora_A's output, saved by lora_B
        lora_b = tape.new(4 * T * fan_out)
        scaled = tape.new(4 * T * fan_out)
        tape.drop(lora_b)
        summed = tape.new(4 * T * fan_out)
        tape.drop(scaled, base)
        result = tape.new(e * T * fan_out)
        tape.drop(summed)
        return result

    ae = 2 if mixed else e
    tape.section = "norm1"
    y = _norm(tape, T, h, e, mixed, flags.input_requires_grad, train_all, out_keep=train_all and not mixed)
    tape.section = "attn"
    attn_rg = flags.input_requires_grad or bool(targets & {"q_proj", "k_proj", "v_proj"})
    q_out, k_out, v_out = linear("q_proj"), linear("k_proj"), linear("v_proj")
    rope_bytes = 4 if mixed else e
    q_rot = _rope(tape, rope_bytes * T * q, ae * T * q // 2, keep=False)
    k_rot = _rope(tape, rope_bytes * T * kv, ae * T * kv // 2, keep=False)
    tape.drop(q_out, k_out)
    if w.ac_every:
        repeated = q if spec.gqa_groups > 1 else kv
        cache_k = tape.new(rope_bytes * T * repeated, keep=attn_rg and not mixed)
        cache_v = tape.new(ae * T * repeated, keep=attn_rg)
        tape.new(ae * b * s * s, keep=attn_rg)  # the mask in the compute dtype, kept by SDPA
    else:
        cache_k = tape.new(rope_bytes * T * kv, keep=attn_rg and not mixed)
        cache_v = tape.new(ae * T * kv, keep=attn_rg)
        if mixed:
            stream_end.append(cache_k)
    if mixed and w.ac_every:
        tape.drop(cache_k)
    tape.drop(k_rot, v_out)
    if mixed:
        tape.new(2 * T * kv, keep=True)
        q_cast = tape.new(2 * T * q, keep=True)
    else:
        if attn_rg:
            tape.keep(q_rot)
        q_cast = None
    tape.new(ae * T * q, keep=attn_rg)  # the attention output, kept by SDPA
    tape.new(lse, keep=attn_rg)
    o = linear("o_proj")
    tape.drop(q_rot, y, q_cast if not mixed else None, cache_v if not attn_rg else None)
    tape.flush()
    h1 = tape.new((4 if mixed else e) * T * h, keep=(mixed or e == 4) and not tape.no_grad)
    tape.drop(o)
    tape.section = "norm2"
    y2 = _norm(tape, T, h, e, mixed, True, train_all, out_keep=train_all and not mixed)
    tape.section = "mlp"
    gate = linear("gate_proj")
    tape.keep(gate)
    tape.new(ae * T * I, keep=True)  # silu(gate), kept by the product
    up = linear("up_proj")
    tape.keep(up)
    product = tape.new(ae * T * I, keep=train_all)
    down = linear("down_proj")
    tape.drop(product, y2)
    tape.flush()
    h2 = tape.new((4 if mixed else e) * T * h, keep=(mixed or e == 4) and not tape.no_grad)
    tape.drop(down, h1)
    return h2


def backward_layer(tape: LayerTape, spec: ModelSpec, w: Workload, grads: list[int],
                   attention_grads: list[int], mlp_grads: list[int]) -> None:
    """Input gradients and temporaries of the MLP and attention backward, the weight gradients
    (compute-dtype result, then the fp32 gradient under autocast), saved tensors freed."""
    T = w.batch * w.seq
    h, q, kv, I = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
    ae = 2 if w.mixed else act.compute_bytes(w)
    ev = tape.ev
    grad_out = ev.alloc([r512((4 if w.mixed else ae) * T * h)])
    g_product = ev.alloc([r512(ae * T * I)])
    grads += _weight_grads(ev, w, mlp_grads[-1:])  # down_proj
    g_act, g_up = ev.alloc([r512(ae * T * I)] * 2)
    ev.free(g_product)
    grads += _weight_grads(ev, w, mlp_grads[-2:-1])  # up_proj
    g_gate = ev.alloc([r512(ae * T * I)])[0]
    ev.free([g_act])
    grads += _weight_grads(ev, w, mlp_grads[:-2])  # gate_proj (and the norm)
    g_inputs = ev.alloc([r512(ae * T * h)] * 2)
    ev.free([g_up, g_gate] + tape.kept["mlp"])
    ev.free(ev.alloc([r512(4 * T * h)] * 2) + g_inputs + tape.kept["norm2"])  # RMSNorm backward in fp32
    g_attn_out = ev.alloc([r512(ae * T * q)])
    grads += _weight_grads(ev, w, attention_grads[-1:])  # o_proj
    g_q, g_k, g_v = ev.alloc([r512(ae * T * q), r512(ae * T * kv), r512(ae * T * kv)])
    ev.free(g_attn_out)
    grads += _weight_grads(ev, w, attention_grads[:-1])
    g_inputs = ev.alloc([r512(ae * T * h)] * 3)
    ev.free([g_q, g_k, g_v] + tape.kept["attn"])
    ev.free(ev.alloc([r512(4 * T * h)] * 2) + g_inputs + tape.kept["norm1"] + tape.kept["copies"] + grad_out)


def _weight_grads(ev, w: Workload, sizes: list[int]) -> list[int]:
    out = []
    for size in sizes:
        if not size:
            continue
        if w.mixed:  # bf16 matmul result, then the fp32 gradient
            temp = ev.alloc([r512(size // 2)])
            out += ev.alloc([size])
            ev.free(temp)
        else:
            out += ev.alloc([size])
    return out


def layer_grad_sizes(spec: ModelSpec, w: Workload) -> tuple[list[int], list[int]]:
    """One layer's trainable tensors: (attention side, MLP side), in forward order."""
    shapes = spec.layer_linear_shapes()
    attention_names, mlp_names = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
    if w.uses_adapters:
        def adapters(names):
            out = []
            for name in names:
                if name in w.lora_targets:
                    fan_in, fan_out = shapes[name]
                    out += [r512(4 * w.lora_rank * fan_in), r512(4 * w.lora_rank * fan_out)]
            return out
        return adapters(attention_names), adapters(mlp_names)
    wb = DTYPE_BYTES[w.weight_dtype]
    norm = r512(wb * spec.hidden_size)
    return ([norm] + [r512(wb * shapes[n][0] * shapes[n][1]) for n in attention_names],
            [norm] + [r512(wb * shapes[n][0] * shapes[n][1]) for n in mlp_names])
