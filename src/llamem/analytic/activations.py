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
- Activation checkpointing keeps only a checkpointed layer's input (selective checkpointing also
  its policy's matmul and attention outputs, `selective.py`); its full set comes back during its
  backward (one layer at a time; `backward.py`).
- Model-level tensors alive through the step: RoPE's cos and sin, the final norm's saved
  tensors and its output; with checkpointing the position ids and, where a step without a cache
  materialises it (`attention_paths.uncached_mask`, a sliding window), the causal mask. A plain
  batch gets none: transformers finds no packed sequences and SDPA runs causal.

Liger's kernels (`--liger`: RMSNorm keeps X and rstd, SwiGLU gate and up, RoPE in place) and
flash_attention_2 (`attention_paths.py`) are sized where they change a part. Not included:
torch.compile fusions (`compiled.py`), dropout.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from llamem.analytic.attention_paths import flash_saved_bytes, masked_cache_bytes, sdpa_masked, uncached_mask
from llamem.analytic.common import r512, top_checkpointed_layer, trains_base_weights
from llamem.analytic.kv_cache import training_cache_bytes
from llamem.analytic import llama4
from llamem.analytic.moe import moe_input_readers, moe_saved_bytes
from llamem.analytic.selective import kept_outputs_of, selective_kept_bytes
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


def norm_saved_bytes(T: int, h: int, e: int, mixed: bool, input_rg: bool, weight_trains: bool) -> int:
    """RMSNorm's own saved tensors (not its output, not its input when that is the fp32 stream):
    rsqrt 4T and, in pure bf16/fp16, the fp32 upcast 4Th (for the input's gradient); the
    normalised input (for the weight's)."""
    saved = 0
    if input_rg:
        saved += r512(4 * T)  # rsqrt
        if e < 4 and not mixed:
            saved += r512(4 * T * h)  # fp32 upcast of the input
    if weight_trains:
        saved += r512((4 if mixed else e) * T * h)  # normalised input, kept by weight * x
    return saved


def liger_norm_saved_bytes(T: int, h: int, e: int, mixed: bool, input_rg: bool, weight_trains: bool) -> int:
    """Liger's RMSNorm keeps its input X (the residual stream, counted with it) and the fp32 rstd (4T)."""
    return r512(4 * T) if (input_rg or weight_trains) else 0


def _consumer_saved(T: int, fan_in: int, e: int, mixed: bool, flags: LayerFlags, names: tuple[str, ...],
                    rank: int) -> int:
    """What the linears reading one tensor keep of it: full fine-tuning one input (autocast one
    bf16 cast per linear); LoRA per adapted linear its fp32 input cast and lora_A's output."""
    saved = 0
    if flags.train_all:
        # bf16 autocast casts the input once per linear; pure precision shares one tensor.
        saved += len(names) * r512(2 * T * fan_in) if mixed else r512(e * T * fan_in)
    else:
        adapted = [n for n in names if n in flags.targets]
        if adapted and mixed:  # each lora_A keeps its own bf16 cast of the fp32 norm output
            saved += len(adapted) * _mixed_adapted_input_saved(T, fan_in, rank)
        elif adapted:
            saved += len(adapted) * r512(4 * T * fan_in) if e < 4 else r512(4 * T * fan_in)
            saved += len(adapted) * r512(4 * T * rank)
    return saved


def _attention_needs_grad(flags: LayerFlags) -> bool:
    """Attention keeps its inputs when the layer input needs a gradient or q/k/v are adapted."""
    return flags.input_requires_grad or bool(flags.targets & {"q_proj", "k_proj", "v_proj"})


def layer_saved_bytes(spec: ModelSpec, workload: Workload, layer_index: int,
                      moe: bool | None = None) -> dict[str, int]:
    """Saved tensors of one (not checkpointed) layer, by part; `moe` (default: whether layer
    `layer_index` is one) sizes its MLP as a mixture of experts (`moe.py`)."""
    T = workload.batch * workload.seq
    h, e, mixed = spec.hidden_size, compute_bytes(workload), workload.mixed
    flags = layer_flags(workload, layer_index)
    attn_rg = _attention_needs_grad(flags)
    h1_rg = attn_rg or "o_proj" in flags.targets  # the residual mid-point needs a gradient
    moe = layer_index in spec.moe_layers if moe is None else moe
    norm = liger_norm_saved_bytes if workload.liger else norm_saved_bytes
    return {"norm": (norm(T, h, e, mixed, flags.input_requires_grad, flags.train_all)
                     + norm(T, h, e, mixed, h1_rg, flags.train_all)),
            "lora": _linear_inputs_saved(spec, workload, flags, moe),
            "attention": _layer_attention_saved(spec, workload, layer_index, flags),
            "mlp": (_moe_block_saved(spec, workload, flags.train_all, h1_rg) if moe
                    else _mlp_saved(spec, workload, flags, h1_rg)),
            "residual": _residual_saved(spec, workload, h1_rg)}


def _layer_attention_saved(spec: ModelSpec, workload: Workload, index: int, flags: LayerFlags) -> int:
    """Attention's saved tensors and the q/k norms' (Llama 4's attention: `llama4.py`)."""
    if llama4.is_llama4(spec):
        if not _attention_needs_grad(flags):
            return 0
        q_rg, k_rg = (flags.input_requires_grad or proj in flags.targets for proj in ("q_proj", "k_proj"))
        return llama4.attention_saved_bytes(spec, workload, index, q_rg, k_rg)
    return (_attention_saved(spec, workload) if _attention_needs_grad(flags) else 0) + qk_norm_saved(
        spec, workload, flags)


def _moe_block_saved(spec: ModelSpec, workload: Workload, trains: bool, needs_grad: bool) -> int:
    if llama4.is_llama4(spec):
        return llama4.moe_saved_bytes(spec, workload, trains, needs_grad)
    return moe_saved_bytes(spec, workload, trains, needs_grad)


def _linear_inputs_saved(spec: ModelSpec, workload: Workload, flags: LayerFlags, moe: bool = False) -> int:
    """The inputs the attention and MLP linears keep (the norms' outputs), and an adapted
    o_proj's fp32 cast of the attention output and its lora_A output (the output itself is
    SDPA's, already counted)."""
    T, h, rank = workload.batch * workload.seq, spec.hidden_size, workload.lora_rank
    e, mixed = compute_bytes(workload), workload.mixed
    saved = _consumer_saved(T, h, e, mixed, flags, ("q_proj", "k_proj", "v_proj"), rank)
    if "o_proj" in flags.targets and not flags.train_all:
        # peft's fp32 cast of a 16-bit input; an fp32 input is attention's output itself, which lora_A alone
        # keeps where attention saves nothing (layer 0 with q, k and v frozen)
        own_cast = e < 4 or not _attention_needs_grad(flags)
        saved += (_mixed_adapted_input_saved(T, spec.q_dim, rank) if mixed
                  else (r512(4 * T * spec.q_dim) if own_cast else 0) + r512(4 * T * rank))
    readers = moe_input_readers(spec) if moe else ("gate_proj", "up_proj")
    return saved + _consumer_saved(T, h, e, mixed, flags, readers, rank)


def _attention_saved(spec: ModelSpec, workload: Workload) -> int:
    """Attention's saved tensors; `ae` is the dtype of the attention inputs (bf16 under autocast)."""
    if workload.attn == "sdpa":
        return _sdpa_saved(spec, workload)
    if workload.attn == "flash_attention_2":
        return flash_saved_bytes(spec, workload)
    return _eager_attention_saved(spec, workload)


def _sdpa_saved(spec: ModelSpec, workload: Workload) -> int:
    """q and the output (ae T q each), k and v (ae T kv each), the fp32 logsumexp 4 b heads s.
    When transformers passes a materialised mask (`uncached_mask`, padding, a sliding window), SDPA
    cannot run GQA natively: K and V are repeated to every query head, and SDPA keeps the mask
    converted to the compute dtype (ae b s^2)."""
    b, s = workload.batch, workload.seq
    T, q = b * s, spec.q_dim
    ae = 2 if workload.mixed else compute_bytes(workload)
    masked = uncached_mask(workload) or sliding_masks(spec, workload) or sdpa_masked(workload)
    k_dim = q if (masked and spec.gqa_groups > 1) else spec.kv_dim
    saved = r512(ae * T * q) + 2 * r512(ae * T * k_dim) + r512(ae * T * q) + r512(4 * b * spec.num_heads * s)
    return saved + (r512(ae * b * s * s) if masked else 0)


def sliding_masks(spec: ModelSpec, workload: Workload) -> bool:
    """A sliding window shorter than the sequence needs a materialised mask (Mistral's
    create_sliding_window_causal_mask): SDPA then cannot run causal, as under checkpointing."""
    return spec.sliding_window is not None and workload.seq > spec.sliding_window


def qk_norm_saved(spec: ModelSpec, workload: Workload, flags: LayerFlags) -> int:
    """Qwen3's q_norm and k_norm (RMSNorm over each head's head_dim, on q_proj's and k_proj's outputs,
    `modeling_qwen3.py`): like any RMSNorm, rsqrt (4 T heads) and, their input being a linear's output
    in the compute dtype, its fp32 upcast (4 T q, below fp32); the normalised input for the weight's
    gradient when it trains. Each only where its projection's output needs a gradient."""
    if spec.qk_norm != "rms":
        return 0
    T, e, mixed = workload.batch * workload.seq, compute_bytes(workload), workload.mixed
    saved = 0
    for proj, heads in (("q_proj", spec.num_heads), ("k_proj", spec.num_kv_heads)):
        if not (flags.input_requires_grad or flags.train_all or proj in flags.targets):
            continue
        dim = heads * spec.head_dim
        saved += r512(4 * T * heads) + (r512(4 * T * dim) if (e < 4 or mixed) else 0)
        saved += r512((2 if mixed else e) * T * dim) if flags.train_all else 0
    return saved


def _eager_attention_saved(spec: ModelSpec, workload: Workload) -> int:
    """q, k and v repeated to q width (ae T q each), the output, the fp32 softmax 4 b heads s^2 and,
    below fp32, its compute-dtype copy."""
    b, s = workload.batch, workload.seq
    T, q = b * s, spec.q_dim
    e, mixed = compute_bytes(workload), workload.mixed
    ae = 2 if mixed else e
    probs = b * spec.num_heads * s * s
    saved = r512(ae * T * q) + 2 * r512(ae * T * q) + r512(4 * probs) + r512(ae * T * q)
    return saved + (r512(ae * probs) if (mixed or e < 4) else 0)


def _mlp_saved(spec: ModelSpec, workload: Workload, flags: LayerFlags, h1_rg: bool) -> int:
    """SwiGLU: gate (kept by silu), silu(gate) (by the product, for up's gradient), up (for silu's),
    the product (by down_proj, when its weight trains; an adapted down_proj keeps its fp32 cast
    and lora_A's output instead). ae T I each."""
    T, I = workload.batch * workload.seq, spec.intermediate_size
    e, t = compute_bytes(workload), flags.targets
    unit = r512((2 if workload.mixed else e) * T * I)
    gate_rg = h1_rg or "gate_proj" in t
    up_rg = h1_rg or "up_proj" in t
    mlp = (2 * unit if gate_rg else 0) + (unit if up_rg else 0)
    if workload.liger:  # LigerSiLUMulFunction keeps gate and up only
        mlp = 2 * unit if (gate_rg or up_rg) else 0
    if flags.train_all:
        mlp += unit
    elif "down_proj" in t:
        mlp += adapted_down_proj_saved_bytes(spec, workload)
    return mlp


def adapted_down_proj_saved_bytes(spec: ModelSpec, workload: Workload) -> int:
    """What an adapted down_proj keeps in place of the product: its cast for lora_A (fp32 over fp32 adapters,
    bf16 under autocast; the product itself in fp32) and lora_A's output."""
    T, I, rank = workload.batch * workload.seq, spec.intermediate_size, workload.lora_rank
    if workload.mixed:
        return _mixed_adapted_input_saved(T, I, rank)
    return r512(4 * T * I) + r512(4 * T * rank)


def _mixed_adapted_input_saved(T: int, fan_in: int, rank: int) -> int:
    """An adapted linear under autocast over fp32 adapters: lora_A casts its input (peft's fp32 cast
    where the input is bf16) to bf16 and keeps that copy; its output is bf16 (traced)."""
    return r512(2 * T * fan_in) + r512(2 * T * rank)


def _residual_saved(spec: ModelSpec, workload: Workload, h1_rg: bool) -> int:
    """The fp32 residual stream (mixed or fp32 compute) is kept by the next RMSNorm's pow/mul:
    this layer's mid-point h1 (4Th, when it needs a gradient) and its output h2 (4Th)."""
    if not (workload.mixed or compute_bytes(workload) == 4 or workload.liger):
        return 0  # (Liger's RMSNorm keeps its input X in any dtype)
    stream = stream_bytes(workload, spec)
    return (stream if h1_rg else 0) + stream


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
    kinds = [(first, plain_first), (rest, plain_rest)]
    if spec.is_moe and spec.num_layers > 1:  # layers 1.. as mixture-of-experts and dense layers each
        plain_moe = sum(1 for i in spec.moe_layers if i > 0 and not is_checkpointed(workload, i))
        kinds[1:] = [(layer_saved_bytes(spec, workload, 1, moe=True), plain_moe),
                     (layer_saved_bytes(spec, workload, 1, moe=False), plain_rest - plain_moe)]
    if llama4.is_llama4(spec):
        kinds[1:] = _llama4_plain_kinds(spec, workload)
    for saved, count in kinds:
        if count > 0:
            for part, value in saved.items():
                totals[part] += count * value
    stream = stream_bytes(workload, spec)
    # the norms keep the stream itself: fp32 (autocast, fp32 compute) or Liger's RMSNorm (its input X)
    fp32_stream = workload.mixed or compute_bytes(workload) == 4 or workload.liger
    if num_checkpointed:
        if fp32_stream and K > 1:
            # Only layer 0's input is the checkpoint's own; later checkpointed layers' inputs are the
            # previous plain layer's output, already counted; their outputs are kept by the next norm
            # (the last layer's by the final norm).
            totals["checkpoints"] += stream
            totals["residual"] += stream * num_checkpointed
        else:
            totals["checkpoints"] += stream * num_checkpointed
            # An fp32 stream: the last layer's output is kept by the final norm (the others are the
            # next checkpoints' inputs).
            totals["residual"] += stream if fp32_stream else 0
        # Selective checkpointing: each checkpointed layer also keeps its policy's saved outputs.
        totals["checkpoints"] += num_checkpointed * selective_kept_bytes(spec, workload)
    # The embedding output is layer 0's input: kept by its norm under fp32 compute.
    if fp32_stream and not K and layer_flags(workload, 0).input_requires_grad:
        totals["residual"] += stream
    return totals


def _llama4_plain_kinds(spec: ModelSpec, workload: Workload) -> list[tuple[dict[str, int], int]]:
    """Llama 4's plain layers 1.. grouped by kind (`llama4.layer_kind`), each kind's saved set sized once."""
    groups: dict[tuple[bool, bool], list[int]] = {}
    for index in range(1, spec.num_layers):
        if not is_checkpointed(workload, index):
            groups.setdefault(llama4.layer_kind(spec, index), []).append(index)
    return [(layer_saved_bytes(spec, workload, indices[0]), len(indices)) for indices in groups.values()]


def largest_layer_saved_bytes(spec: ModelSpec, workload: Workload) -> int:
    """The largest saved set of a layer from 1 on (of each kind of layer a mixture of experts has)."""
    if llama4.is_llama4(spec):
        first = {}
        for index in range(min(1, spec.num_layers - 1), spec.num_layers):
            first.setdefault(llama4.layer_kind(spec, index), index)
        return max(sum(layer_saved_bytes(spec, workload, i).values()) for i in first.values())
    if spec.is_moe:
        return max(sum(layer_saved_bytes(spec, workload, 1, moe=moe).values()) for moe, _n in spec.layer_kinds())
    return sum(layer_saved_bytes(spec, workload, 1).values())


def checkpointed_layer_held_bytes(spec: ModelSpec, workload: Workload, index: int) -> int:
    """Activations alive in checkpointed layer `index`'s forward at its MLP: the saved sets of the layers
    below (a checkpointed layer's input only), this layer's input, its attention's residual sum and the
    norm's output, RoPE's cos and sin and the checkpoints' mask."""
    stream = stream_bytes(workload, spec)
    held = 0
    for below in range(index):
        if is_checkpointed(workload, below):
            held += stream + selective_kept_bytes(spec, workload)
        else:
            held += sum(layer_saved_bytes(spec, workload, below).values())
    return held + 3 * stream + rope_bytes(spec, workload) + checkpoint_mask_bytes(workload, spec)


def rope_bytes(spec: ModelSpec, workload: Workload) -> int:
    """RoPE's cos and sin (seq x head_dim each; fp32 under autocast), alive through the step (Llama 4: its
    complex `freqs_cis`)."""
    if llama4.is_llama4(spec):
        return llama4.rope_bytes(spec, workload)
    return 2 * r512(workload.seq * spec.head_dim * (4 if workload.mixed else compute_bytes(workload)))


def checkpoint_mask_bytes(workload: Workload, spec: ModelSpec | None = None) -> int:
    """The checkpoints keep their layers' inputs until their backward: the position ids (8 s) and, when
    checkpointing (no cache) materialises it (`uncached_mask`), the bool causal mask (b, 1, s, s); else
    a sliding window shorter than the sequence (with `spec`) its bool mask, one for the whole batch."""
    if not workload.ac_every:
        return 0
    positions = 0 if workload.padding_free else r512(8 * workload.seq)  # packed ones are an input, counted there
    if workload.attn == "flash_attention_2":  # no 4-D mask
        return positions
    if uncached_mask(workload):
        return r512(workload.batch * workload.seq * workload.seq) + positions
    sliding = spec is not None and sliding_masks(spec, workload)
    return positions + (r512(workload.seq * workload.seq) if sliding else 0)


def _final_norm_saved_bytes(spec: ModelSpec, workload: Workload) -> int:
    """The final RMSNorm's saved tensors (its input always needs a gradient)."""
    norm = liger_norm_saved_bytes if workload.liger else norm_saved_bytes
    return norm(workload.batch * workload.seq, spec.hidden_size, compute_bytes(workload),
                workload.mixed, True, trains_base_weights(workload))


def _final_output_kept_bytes(spec: ModelSpec, workload: Workload) -> int:
    """The final norm's output, kept by lm_head for its weight's gradient in pure precision (under
    autocast the head keeps a bf16 cast, counted with the logits; the chunked loss past one sequence
    keeps each chunk's contiguous copy, counted there too)."""
    if workload.loss == "chunked" and workload.batch > 1:
        return 0
    return stream_bytes(workload, spec) if (trains_base_weights(workload) and not workload.mixed) else 0


@dataclass(frozen=True, slots=True)
class TrainingActivations:
    """Activation bytes at a training step's moments."""

    forward: int
    """At the loss: every layer's saved set, the model-level tensors, the final norm's output (held
    by the model's output; distillation's peak comes after the model has returned), the cache."""
    backward: int
    """At the loss backward: the same, less the cache and the output unless lm_head kept it."""
    layer: int
    """One plain layer's saved set (layer 1 on): what a checkpointed layer has back in its backward."""


def training_activations(spec: ModelSpec, workload: Workload, distill: bool = False) -> TrainingActivations:
    layers = (layer_saved_bytes(spec, workload, 0), layer_saved_bytes(spec, workload, 1))
    saved = (sum(model_saved_bytes(spec, workload, layers).values()) + rope_bytes(spec, workload)
             + _final_norm_saved_bytes(spec, workload) + checkpoint_mask_bytes(workload, spec)
             + llama4.extra_mask_bytes(spec, workload))
    kept_output = _final_output_kept_bytes(spec, workload)
    output = kept_output if distill else stream_bytes(workload, spec)
    # a checkpointed layer's backward has the largest kind's saved set back
    layer = largest_layer_saved_bytes(spec, workload)
    # Liger's RoPE leaves K in the compute dtype: the cache holds the very K attention keeps
    cache = ((0 if workload.liger else training_cache_bytes(spec, workload)) + masked_cache_bytes(spec, workload)
             + cache_only_kv_bytes(spec, workload))
    return TrainingActivations(forward=saved + output + cache,
                               backward=saved + kept_output, layer=layer)


def cache_only_kv_bytes(spec: ModelSpec, workload: Workload) -> int:
    """The training DynamicCache's K and V where attention saves neither: layer 0 under adapters that leave
    q, k and v alone (its input needs no gradient), whose K and V the cache alone holds until the loss.
    Elsewhere they are attention's saved tensors (under autocast without Liger the cache's K is an fp32
    copy of its own, `training_cache_bytes`)."""
    if (workload.ac_every or workload.loss != "full" or llama4.is_llama4(spec)
            or _attention_needs_grad(layer_flags(workload, 0))):
        return 0
    T, e = workload.batch * workload.seq, compute_bytes(workload)
    key_counted = workload.mixed and not workload.liger
    return (0 if key_counted else r512(e * T * spec.kv_dim)) + r512(e * T * spec.kv_dim)


def checkpointed_mlp_forward_bytes(spec: ModelSpec, workload: Workload) -> int:
    """Activations at the top checkpointed layer's MLP in forward, where no saved set is kept yet: what
    `checkpointed_layer_held_bytes` holds and three MLP-sized tensors (Liger: gate, up and their product;
    transformers: silu(gate), up and the product). Without full logits (Liger) this is the forward's worst
    moment on most shapes."""
    top = top_checkpointed_layer(spec.num_layers, workload)
    T, I = workload.batch * workload.seq, spec.intermediate_size
    mlp = r512((2 if workload.mixed else compute_bytes(workload)) * T * I)
    # selective: what the policy kept of this layer so far beyond those three (down_proj's outputs come
    # later; an unadapted gate_proj's or up_proj's output is gate or up itself)
    adapted = set(workload.lora_targets) if workload.uses_adapters else set()
    not_yet = {"down_proj", "down_proj.lora_A", "down_proj.lora_B", *({"gate_proj", "up_proj"} - adapted)}
    kept = selective_kept_bytes(spec, workload) - kept_outputs_of(spec, workload, not_yet)
    return checkpointed_layer_held_bytes(spec, workload, top) + 3 * mlp + kept
