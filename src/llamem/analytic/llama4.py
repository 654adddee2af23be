"""Llama 4's text model (`llama4_text`): what transformers 5.24 allocates where it differs from a Llama layer.

`models/llama4/modeling_llama4.py`, with T = batch * seq tokens, h hidden, q = heads * head_dim,
kv = kv_heads * head_dim, E routed experts of width I, e the compute dtype's bytes (ae: bf16 under autocast):

- Attention. Layer i uses RoPE when `no_rope_layers[i]` (by default every `no_rope_layer_interval`-th layer is
  a NoPE layer). RoPE multiplies q and k, upcast and viewed as complex numbers, by `freqs_cis` (complex64,
  seq x head_dim / 2: the model's only RoPE tensor, alive through the step) and casts back: the product's
  backward needs only `freqs_cis`, so nothing of q or k is kept there. With `use_qk_norm` the RoPE layers
  L2-normalise q and k afterwards (`Llama4TextL2Norm`, no weight): each keeps its fp32 upcast (4 T q, 4 T kv)
  and rsqrt (4 T heads). NoPE layers with `attn_temperature_tuning` scale q by an fp32 (seq) vector, kept
  for q's gradient. q, k and v reach SDPA in the compute dtype (bf16 under autocast: RoPE and the norm cast
  back with `type_as`), which keeps them, its output and the fp32 logsumexp, as for Llama.
- Masks. RoPE layers attend in chunks of `attention_chunk_size` (`layer_types` chunked_attention), the NoPE
  layers globally. A chunked layer whose keys fit one chunk gets no mask (SDPA runs causal, GQA native); a
  longer one gets a materialised bool mask (batch, 1, seq, seq), so K and V are repeated to every query
  head and SDPA keeps the mask in the compute dtype. Checkpointing (no cache) materialises every mask.
- Mixture of experts (`Llama4TextMoe`). The router keeps its top-k indices (8 T k) and the fp32 sigmoid of
  the scattered scores (4 T E). Every expert sees every token: the block input is repeated E times
  (`repeat`, E T h in the input's dtype: fp32 under autocast) and multiplied by each expert's score column
  (a contiguous copy, ae E T); the product feeds two batched matmuls (`Llama4TextExperts`, torch.bmm), which
  keep gate_up's output (ae E T 2I; silu and up hold views of it), silu(gate) (ae E T I) and, when the
  experts train, their inputs (the weighted tokens, ae E T h, and the product, ae E T I). The shared expert
  is a gated MLP of width I, sized like Llama's MLP. Memory is sized by E T, never by the routing.
- Caches. transformers builds a DynamicCache whose chunked layers are `DynamicSlidingWindowLayer`s with
  the chunk size W as their window (each holding a one-element int64 tensor), the NoPE layers `DynamicLayer`s.
  A chunked layer keeps its last W - 1 tokens as a view into their concatenation with the newest ones, so a
  prompt prefilled at once stays whole in its storage until the first decode step, which makes that layer's
  new K and V (W tokens) beside the old ones before replacing either (`cache_tokens`).
- Generation masks. A chunked layer's bool mask (batch, 1, queries, keys) is batch-wide (it offsets each row
  by its left padding) and materialised once its keys reach W, or in any prefill chunk after the first; the
  global layers' (1, 1, queries, keys) only from the second prefill chunk on. A decode step's chunked mask
  has one query and SDPA folds GQA into it (no repeated K and V).

Held to the trace engine by `benchmarks/accuracy.py:llama4_rows` and tests/test_llama4_analytic.py. Refused by
name (`problems`), as no row holds them: adapters under autocast, bf16-mixed with accumulation, eager attention.
Left out of generation past W: a chunked layer's masked SDPA in prefill (its K and V repeated to every head);
the last layer's mixture of experts outweighs it while seq < num_experts x hidden_size.
"""

from __future__ import annotations

from llamem.analytic.attention_paths import uncached_mask
from llamem.analytic.common import r512
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import Workload

WINDOW_TENSOR_BYTES = 512
"""`DynamicSlidingWindowLayer._sliding_window_tensor`: one int64, one 512-byte block."""


def is_llama4(spec: ModelSpec) -> bool:
    return spec.model_type == "llama4_text"


def uses_rope(spec: ModelSpec, index: int) -> bool:
    """`Llama4TextConfig.no_rope_layers[index]` (1: RoPE), derived as transformers derives it when absent."""
    flags = spec.config.get("no_rope_layers")
    if flags:
        return bool(flags[index])
    return (index + 1) % spec.config.get("no_rope_layer_interval", 4) != 0


def chunk_size(spec: ModelSpec) -> int | None:
    return spec.config.get("attention_chunk_size", 8192)


def is_chunked(spec: ModelSpec, index: int) -> bool:
    """A chunked_attention layer (`layer_types`; by default a RoPE layer, when the config sets a chunk size)."""
    types = spec.config.get("layer_types")
    if types:
        return types[index] == "chunked_attention"
    return uses_rope(spec, index) and chunk_size(spec) is not None


def temperature_tuned(spec: ModelSpec, index: int) -> bool:
    return not uses_rope(spec, index) and bool(spec.config.get("attn_temperature_tuning", True))


def layer_kind(spec: ModelSpec, index: int) -> tuple[bool, bool]:
    """(mixture of experts?, RoPE?): layers of one kind keep the same tensors (from layer 1 on)."""
    return index in spec.moe_layers, uses_rope(spec, index)


def masked(spec: ModelSpec, w: Workload, index: int) -> bool:
    """Whether SDPA gets a materialised mask in layer `index`: under checkpointing (no cache) when it
    materialises the mask (`uncached_mask`), or a chunked layer whose sequence is longer than a chunk."""
    size = chunk_size(spec)
    return uncached_mask(w) or (is_chunked(spec, index) and size is not None and w.seq > size)


def extra_mask_bytes(spec: ModelSpec, w: Workload) -> int:
    """Checkpointing materialises one bool mask (batch, 1, seq, seq) per layer type, chunked and global: the
    second beyond the one `activations.checkpoint_mask_bytes` counts."""
    if not (is_llama4(spec) and uncached_mask(w)) or w.attn == "flash_attention_2":
        return 0
    types = {is_chunked(spec, i) for i in range(spec.num_layers)}
    return (len(types) - 1) * r512(w.batch * w.seq * w.seq)


def attention_saved_bytes(spec: ModelSpec, w: Workload, index: int, q_rg: bool, k_rg: bool) -> int:
    """One layer's attention tensors kept for backward when its input needs a gradient (see the module
    docstring): SDPA's q, k, v (repeated to q width when masked under GQA), output, logsumexp and mask,
    the L2 norms' upcasts and rsqrt, a NoPE layer's temperature scales."""
    b, s = w.batch, w.seq
    T, q, ae = b * s, spec.q_dim, _attention_bytes(w)
    k_dim = q if (masked(spec, w, index) and spec.gqa_groups > 1) else spec.kv_dim
    saved = 2 * r512(ae * T * q) + 2 * r512(ae * T * k_dim) + r512(4 * b * spec.num_heads * s)
    if masked(spec, w, index):
        saved += r512(ae * b * s * s)
    if spec.qk_norm == "l2" and uses_rope(spec, index):
        saved += (r512(4 * T * q) + r512(4 * T * spec.num_heads)) if q_rg else 0
        saved += (r512(4 * T * spec.kv_dim) + r512(4 * T * spec.num_kv_heads)) if k_rg else 0
    if temperature_tuned(spec, index) and q_rg:
        saved += r512(4 * s)
    return saved


def _attention_bytes(w: Workload) -> int:
    """The dtype q, k and v reach SDPA in: bf16 under autocast (RoPE and the norm cast back to q_proj's)."""
    return 2 if w.mixed else int(DTYPE_BYTES[w.compute_dtype])


def moe_saved_bytes(spec: ModelSpec, w: Workload, trains: bool, needs_grad: bool) -> int:
    """What autograd keeps of one Llama4TextMoe block beyond its input (read by the router and the shared
    expert's Linears): router, the repeated and weighted tokens, the experts' batched matmuls, the shared
    expert's gated MLP."""
    if not (trains or needs_grad):
        return 0
    T, k, E, I, h = w.batch * w.seq, spec.experts_per_token, spec.num_experts, spec.moe_intermediate_size, \
        spec.hidden_size
    ae, stream = _attention_bytes(w), (4 if w.mixed else int(DTYPE_BYTES[w.compute_dtype]))
    router = r512(8 * T * k) + r512(4 * T * E)
    dispatch = r512(stream * E * T * h) + (r512(ae * E * T) if needs_grad else 0)
    experts = r512(ae * E * T * 2 * I) + r512(ae * E * T * I)
    if trains:
        experts += r512(ae * E * T * h) + r512(ae * E * T * I)
    unit = r512(ae * T * spec.shared_expert_intermediate_size)
    shared = (3 if needs_grad else 0) * unit + (unit if trains else 0)
    return router + dispatch + experts + shared


def rope_bytes(spec: ModelSpec, w: Workload) -> int:
    """`freqs_cis`: complex64 (8 bytes) for seq x head_dim / 2 positions, in any precision."""
    return r512(8 * w.seq * (spec.head_dim // 2))


def cache_window_bytes(spec: ModelSpec) -> int:
    """The chunked layers' `_sliding_window_tensor`s of a DynamicCache."""
    if not is_llama4(spec):
        return 0
    return WINDOW_TENSOR_BYTES * sum(1 for i in range(spec.num_layers) if is_chunked(spec, i))


def layer_autocast_copy_bytes(spec: ModelSpec, index: int) -> int:
    """bf16 copies autocast caches of layer `index`'s weights: its Linears (attention; a dense MLP, or the
    router and the shared expert) and its fused experts, which torch.bmm casts too."""
    shapes = spec.layer_linear_shapes()
    attention = sum(r512(2 * i * o) for name, (i, o) in shapes.items() if name in ("q_proj", "k_proj", "v_proj",
                                                                                   "o_proj"))
    h, I, E = spec.hidden_size, spec.moe_intermediate_size, spec.num_experts
    if index not in spec.moe_layers:
        return attention + sum(r512(2 * i * o) for name, (i, o) in shapes.items() if name.endswith("_proj")
                               and name not in ("q_proj", "k_proj", "v_proj", "o_proj"))
    shared = 3 * r512(2 * h * spec.shared_expert_intermediate_size)
    return attention + r512(2 * E * h) + r512(2 * E * h * 2 * I) + r512(2 * E * I * h) + shared


def autocast_copy_bytes(spec: ModelSpec, w: Workload) -> int:
    """Under autocast, the copies kept to backward: every layer's (`layer_autocast_copy_bytes`) and the head's.
    With adapters the frozen weights' copies are not cached but saved where their input needs a gradient,
    which layer 0's q, k and v projections' does not (without checkpointing); the adapters' own are cached."""
    if not w.mixed:
        return 0
    copies = sum(layer_autocast_copy_bytes(spec, i) for i in range(spec.num_layers)) + r512(
        2 * spec.vocab_size * spec.hidden_size)
    if not w.uses_adapters:
        return copies
    shapes, rank = spec.layer_linear_shapes(), w.lora_rank
    adapters = sum(r512(2 * rank * shapes[t][0]) + r512(2 * rank * shapes[t][1]) for t in w.lora_targets)
    return copies + spec.num_layers * adapters - (0 if w.ac_every else _layer0_frozen_uncached_bytes(spec, w))


def _layer0_frozen_uncached_bytes(spec: ModelSpec, w: Workload) -> int:
    """Layer 0's frozen copies autograd does not keep: its input needs no gradient, so q, k and v's are not,
    nor o_proj's and the MLP's unless an adapter in front makes their input need one."""
    shapes = spec.layer_linear_shapes()
    attn_rg = any(t in w.lora_targets for t in ("q_proj", "k_proj", "v_proj"))
    dropped = sum(r512(2 * shapes[t][0] * shapes[t][1]) for t in ("q_proj", "k_proj", "v_proj"))
    if not attn_rg:
        dropped += r512(2 * shapes["o_proj"][0] * shapes["o_proj"][1])
        if "o_proj" not in w.lora_targets:
            dropped = layer_autocast_copy_bytes(spec, 0)
    return dropped


def autocast_copies_in_backward_bytes(spec: ModelSpec, w: Workload, forward_copy_bytes: int) -> int:
    """The forward's copies less the checkpointed layers' (their recompute casts again)."""
    if not (w.mixed and w.ac_every):
        return forward_copy_bytes
    return forward_copy_bytes - sum(layer_autocast_copy_bytes(spec, i) for i in range(0, spec.num_layers, w.ac_every))


def moe_prefill_bytes(spec: ModelSpec, w: Workload, tokens: int) -> int:
    """A Llama4TextMoe block's forward without autograd, at its experts' product (`tokens` = batch x chunk),
    beyond the model's held tensors: the position ids, the attention output, the residual mid-point, the
    block input, the router logits and scores, the weighted tokens, gate_up's output, silu(gate), the product."""
    T, E, h, I = tokens, spec.num_experts, spec.hidden_size, spec.moe_intermediate_size
    e = int(DTYPE_BYTES[w.compute_dtype])
    return (r512(8 * tokens // w.batch) + 3 * r512(e * T * h) + 2 * r512(e * T * E) + r512(e * E * T * h)
            + r512(e * E * T * 2 * I) + 2 * r512(e * E * T * I))


def cache_window(spec: ModelSpec, index: int) -> int | None:
    """Layer `index`'s cache window: the chunk size for a chunked layer (a DynamicSlidingWindowLayer), else none."""
    return chunk_size(spec) if is_chunked(spec, index) else None


def cache_tokens(window: int | None, end: int, new: int = 1) -> int:
    """Tokens a layer's K (or V) storage holds after a forward of `new` tokens ending at position `end`: a
    window keeps its last window - 1 as a view into their concatenation with the new ones."""
    if window is None or end <= new:
        return end
    return min(end - new, window - 1) + new


def layer_cache_tokens(spec: ModelSpec, end: int, new: int = 1) -> list[int]:
    """`cache_tokens` of every layer."""
    return [cache_tokens(cache_window(spec, i), end, new) for i in range(spec.num_layers)]


def prefill_mask_bytes(spec: ModelSpec, w: Workload, chunk: int, end: int) -> int:
    """The masks held through the layer loop while a prefill forward of `chunk` tokens ends at `end` (see the
    module docstring): the chunked layers' batch-wide one, the global layers' broadcast one."""
    chunked = [is_chunked(spec, i) for i in range(spec.num_layers)]
    first, size = end == chunk, chunk_size(spec)
    total = 0
    if any(chunked) and size is not None:
        keys = cache_tokens(size, end, chunk)
        total += r512(w.batch * chunk * keys) if (not first or keys >= size) else 0
    if not all(chunked) and not first:
        total += r512(chunk * end)
    return total


def old_tensors_alive(spec: ModelSpec) -> int:
    """A chunked layer's cache (DynamicSlidingWindowLayer) makes its new K and V before replacing either."""
    return 2 if is_llama4(spec) and any(is_chunked(spec, i) for i in range(spec.num_layers)) else 1


def problems(spec: ModelSpec, w: Workload, role: str = "model") -> list[str]:
    """Llama 4 workloads whose terms no accuracy row holds to the trace, each naming the fix."""
    fix = f"use `llamem trace {spec.hf_id or spec.name} ...` with the same options"
    found = []
    mlp_targets = [t for t in w.lora_targets if t in ("gate_proj", "up_proj", "down_proj")]
    if w.uses_adapters and mlp_targets:
        found.append(f"--lora-targets {','.join(mlp_targets)} on {spec.name} ({role}) adapts its shared experts' and "
                     f"dense layers' Linears, which the analytic engine does not size: adapt attention "
                     f"(q_proj,k_proj,v_proj,o_proj), or {fix}")
    if w.uses_adapters and w.mixed:
        found.append(f"adapters under --precision bf16-mixed on {spec.name} are not sized by the analytic engine: "
                     f"use --precision bf16, or {fix}")
    if w.mixed and w.grad_accum > 1:
        found.append(f"--grad-accum {w.grad_accum} under --precision bf16-mixed on {spec.name} is not sized by the "
                     f"analytic engine: use --precision bf16, or {fix}")
    if w.attn == "eager":
        found.append(f"--attn eager on {spec.name}: the analytic engine sizes its SDPA attention; use --attn sdpa, "
                     f"or {fix}")
    return found
