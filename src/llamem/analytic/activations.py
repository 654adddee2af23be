"""Saved activations of one decoder layer in Hugging Face transformers' Llama code.

What autograd keeps for backward, op by op (`modeling_llama.py`, transformers 5.x), with
T = batch * seq tokens, h hidden, q = heads * head_dim, kv = kv_heads * head_dim, I the MLP
width, e the compute dtype's bytes:

- RMSNorm upcasts to fp32: with e < 4 it keeps the fp32 copy (4Th, saved by pow and mul),
  rsqrt (4T) and, when its weight trains, the normalised input cast back (eTh); its output
  (eTh) is kept by the linears that read it when their weights train.
- Attention keeps RoPE'd q (eTq), k and v (eTkv each: GQA-sized, SDPA runs with enable_gqa),
  the output (eTq) and, for SDPA, the fp32 logsumexp (4 * batch * heads * seq). Eager
  attention instead repeats k and v to q size and keeps the fp32 softmax (4 * b*heads*s^2)
  plus its compute-dtype copy (e * b*heads*s^2).
- SwiGLU keeps gate, silu(gate), up and their product: 4 eTI (the product only when
  down_proj trains).
- Under autocast (bf16-mixed) the residual stream is fp32 and kept (4Th per tensor), each
  linear keeps its own bf16 cast of its input, and RoPE promotes q, k to fp32 (SDPA then
  keeps bf16 casts).
- LoRA: frozen linears keep nothing; each adapted linear keeps its input cast to fp32
  (4 T fan_in) and lora_A's output (4 T r). Layer 0 keeps nothing of its input norm (the
  embedding output needs no gradient) unless checkpointing forces input gradients.
- Activation checkpointing keeps only a checkpointed layer's input; its full set comes
  back during its backward (one layer at a time).

Not included: torch.compile fusions, fused kernels (Liger, flash-attn package), dropout.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from llamem.analytic.common import r512
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import Workload


@dataclass(frozen=True, slots=True)
class LayerFlags:
    """Which tensors of a layer need gradients, which decides what autograd keeps."""

    input_requires_grad: bool
    train_all: bool
    targets: frozenset[str]


def compute_bytes(workload: Workload) -> int:
    return int(DTYPE_BYTES[workload.compute_dtype])


def masked_sdpa_sizes(spec: ModelSpec, workload: Workload, queries: int, keys: int) -> list[int]:
    """Temporaries of one layer's SDPA call with an explicit mask (a prefill chunk after the first):
    transformers repeats K and V to every query head (SDPA takes GQA natively only without a mask),
    and SDPA turns the bool mask into an additive one of the batch's full size."""
    e = compute_bytes(workload)
    repeats = [r512(e * workload.batch * keys * spec.q_dim)] * 2 if spec.gqa_groups > 1 else []
    return repeats + [r512(e * workload.batch * queries * keys)]


def layer_flags(workload: Workload, layer_index: int) -> LayerFlags:
    return _layer_flags(workload.task, workload.lora_targets, workload.ac_every > 0, layer_index > 0)


@lru_cache(maxsize=256)
def _layer_flags(task: str, lora_targets: tuple[str, ...], checkpointing: bool, not_first: bool) -> LayerFlags:
    train_all = task in ("train", "distill")
    # The embedding is frozen in LoRA: its output needs no gradient unless checkpointing
    # (enable_input_require_grads) asks for one.
    input_rg = train_all or not_first or checkpointing
    targets = frozenset(lora_targets) if task in ("lora", "qlora") else frozenset()
    return LayerFlags(input_rg, train_all, targets)


def _norm_saved(T: int, h: int, e: int, mixed: bool, input_rg: bool, weight_trains: bool) -> int:
    """RMSNorm's own saved tensors (not its output, not its input when that is the fp32 stream)."""
    saved = 0
    if input_rg:
        saved += r512(4 * T)  # rsqrt
        if e < 4 and not mixed:
            saved += r512(4 * T * h)  # fp32 upcast of the input
    if weight_trains:
        saved += r512((4 if mixed else e) * T * h)  # normalised input, kept by weight * x
    return saved


def _consumer_saved(T: int, fan_in: int, e: int, mixed: bool, flags: LayerFlags, names: tuple[str, ...],
                    rank: int, fp32_output_saved: bool = False) -> int:
    """What the linears reading one tensor keep of it."""
    saved = 0
    if flags.train_all:
        # bf16 autocast casts the input once per linear; pure precision shares one tensor.
        saved += len(names) * r512(2 * T * fan_in) if mixed else r512(e * T * fan_in)
    else:
        adapted = [n for n in names if n in flags.targets]
        if adapted:
            saved += len(adapted) * r512(4 * T * fan_in) if e < 4 else r512(4 * T * fan_in)
            saved += len(adapted) * r512(4 * T * rank)
    return saved


def layer_saved_bytes(spec: ModelSpec, workload: Workload, layer_index: int) -> dict[str, int]:
    """Saved tensors of one (not checkpointed) layer, by part."""
    T = workload.batch * workload.seq
    b, s = workload.batch, workload.seq
    h, q, kv, I = spec.hidden_size, spec.q_dim, spec.kv_dim, spec.intermediate_size
    e, mixed = compute_bytes(workload), workload.mixed
    flags = layer_flags(workload, layer_index)
    t = flags.targets
    rank = workload.lora_rank
    ae = 2 if mixed else e  # dtype of the attention inputs and linear outputs
    out: dict[str, int] = {}

    out["norm"] = _norm_saved(T, h, e, mixed, flags.input_requires_grad, flags.train_all)
    out["lora"] = _consumer_saved(T, h, e, mixed, flags, ("q_proj", "k_proj", "v_proj"), rank)

    attn_rg = flags.input_requires_grad or bool(t & {"q_proj", "k_proj", "v_proj"})
    attention = 0
    # Without a KV cache (checkpointing turns it off) transformers passes a materialised causal
    # mask, so SDPA cannot run GQA natively: K and V are repeated to every query head, and SDPA
    # keeps the mask converted to the compute dtype.
    masked = workload.ac_every > 0
    k_dim = q if (masked and spec.gqa_groups > 1) else kv
    if attn_rg:
        if workload.attn == "sdpa":
            attention += r512(ae * T * q) + 2 * r512(ae * T * k_dim) + r512(ae * T * q) + r512(4 * b * spec.num_heads * s)
            attention += r512(ae * b * s * s) if masked else 0
        else:
            probs = b * spec.num_heads * s * s
            attention += r512(ae * T * q) + 2 * r512(ae * T * q) + r512(4 * probs) + r512(ae * T * q)
            attention += r512(ae * probs) if (mixed or e < 4) else 0
    out["attention"] = attention
    # o_proj reads the attention output, already kept above (SDPA's output); an adapted o_proj
    # also keeps its fp32 cast and lora_A's output.
    if "o_proj" in t and not flags.train_all:
        out["lora"] += (r512(4 * T * q) if e < 4 else 0) + r512(4 * T * rank)

    h1_rg = attn_rg or "o_proj" in t
    out["norm"] += _norm_saved(T, h, e, mixed, h1_rg, flags.train_all)
    out["lora"] += _consumer_saved(T, h, e, mixed, flags, ("gate_proj", "up_proj"), rank)

    gate_rg = h1_rg or "gate_proj" in t
    up_rg = h1_rg or "up_proj" in t
    unit = r512(ae * T * I)
    mlp = 0
    if gate_rg:
        mlp += unit  # gate, kept by silu
    if up_rg:
        mlp += unit  # silu(gate), kept by the product for up's gradient
    if gate_rg:
        mlp += unit  # up, kept by the product for silu's gradient
    if flags.train_all:
        mlp += unit  # product, kept by down_proj for its weight gradient
    elif "down_proj" in t:
        mlp += (r512(4 * T * I) if e < 4 else r512(e * T * I)) + r512(4 * T * rank)
    out["mlp"] = mlp

    # The fp32 residual stream (mixed or fp32 compute) is kept by the next RMSNorm's pow/mul:
    # this layer's mid-point h1 and its output h2.
    stream = 0
    if mixed or e == 4:
        stream += r512(4 * T * h) if h1_rg else 0
        stream += r512(4 * T * h)
    out["residual"] = stream
    return out


def is_checkpointed(workload: Workload, layer_index: int) -> bool:
    return workload.ac_every > 0 and layer_index % workload.ac_every == 0


def stream_bytes(workload: Workload, spec: ModelSpec) -> int:
    """One residual-stream tensor: fp32 under autocast, else the compute dtype."""
    T = workload.batch * workload.seq
    return r512((4 if workload.mixed else compute_bytes(workload)) * T * spec.hidden_size)


def model_saved_bytes(spec: ModelSpec, workload: Workload,
                      layers: tuple[dict[str, int], dict[str, int]] | None = None) -> dict[str, int]:
    """Saved activations of all layers plus the embedding output, at the end of forward.

    Layers 1..L-1 are identical, so they are counted, not looped over. With every-K
    checkpointing, layers 0, K, 2K, ... keep only their input."""
    L, K = spec.num_layers, workload.ac_every
    num_checkpointed = -(-L // K) if K else 0
    plain_first = 0 if K else 1  # layer 0 runs without checkpointing only when nothing is checkpointed
    plain_rest = L - num_checkpointed - plain_first
    totals = {"norm": 0, "lora": 0, "attention": 0, "mlp": 0, "residual": 0, "checkpoints": 0}
    first, rest = layers or (layer_saved_bytes(spec, workload, 0), layer_saved_bytes(spec, workload, 1))
    for saved, count in ((first, plain_first), (rest, plain_rest)):
        if count > 0:
            for part, value in saved.items():
                totals[part] += count * value
    stream = stream_bytes(workload, spec)
    fp32_stream = workload.mixed or compute_bytes(workload) == 4
    if num_checkpointed:
        if fp32_stream and K > 1:
            # Only layer 0's input is the checkpoint's own; later checkpointed layers' inputs are the
            # previous plain layer's output, already counted; their outputs are kept by the next norm.
            totals["checkpoints"] += stream
            totals["residual"] += stream * (num_checkpointed - (1 if (L - 1) % K == 0 else 0))
        else:
            totals["checkpoints"] += stream * num_checkpointed
    # The embedding output is layer 0's input: kept by its norm under fp32 compute.
    if fp32_stream and not K and layer_flags(workload, 0).input_requires_grad:
        totals["residual"] += stream
    return totals
