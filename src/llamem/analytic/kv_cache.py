"""KV cache: 2 (K and V) * layers * batch * kv_heads * head_dim * cached tokens * bytes.

GQA-sized (kv_heads, never the full hidden size). A sliding-window model caches the last
`sliding_window - 1` tokens per layer, as a view into the concatenation of those and the newest
ones: the storage holds them all (transformers' DynamicSlidingWindowLayer), so a whole prompt
prefilled at once stays in memory until the first decode step replaces it. Quantized caches
(int8/int4, KIVI-style as transformers' QuantizedCache) add one scale and zero-point (stored
in the compute dtype) per group of 64 and keep the last 128 tokens in full precision.

Also here: the cache's growth during decoding (`torch.cat` makes a layer's new K or V beside the
old one), eager attention's copies of the cache to every query head, and the cache that
transformers builds in training (`use_cache` defaults to True).
"""

from __future__ import annotations

from llamem.analytic.common import prefill_chunks, r512
from llamem.analytic.llama4 import cache_tokens, cache_window, cache_window_bytes, is_llama4, layer_cache_tokens
from llamem.analytic.llama4 import old_tensors_alive as llama4_old_tensors_alive
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import Workload

QUANT_GROUP = 64
RESIDUAL_TOKENS = 128


def stored_tokens(spec: ModelSpec, end: int, new: int = 1) -> int:
    """Tokens one layer's K (or V) storage holds after a forward of `new` tokens ending at prompt
    position `end` (a decode step: new = 1)."""
    return cache_tokens(spec.sliding_window or None, end, new)


def layer_stored_tokens(spec: ModelSpec, index: int, end: int, new: int = 1) -> int:
    """`stored_tokens` of layer `index` (Llama 4: its chunked layers' window is the chunk size, its global
    layers have none)."""
    if is_llama4(spec):
        return layer_cache_tokens(spec, end, new)[index]
    return stored_tokens(spec, end, new)


def cache_bytes_at(spec: ModelSpec, batch: int, end: int, new: int, kv_dtype: str) -> int:
    """Every layer's K and V after a forward of `new` tokens ending at `end`, each layer by its window."""
    if is_llama4(spec):
        return 2 * sum(kv_layer_tensor_bytes(spec, batch, kept, kv_dtype) for kept in layer_cache_tokens(spec, end, new))
    return kv_cache_bytes(spec, batch, stored_tokens(spec, end, new), kv_dtype)


def kv_layer_tensor_bytes(spec: ModelSpec, batch: int, kept: int, kv_dtype: str) -> int:
    """One K (or V) tensor of one layer holding `kept` tokens."""
    numel = batch * spec.kv_dim * kept
    if kv_dtype in ("int8", "int4"):
        full = min(kept, RESIDUAL_TOKENS)
        quantized = (kept - full) * batch * spec.kv_dim
        scales = 2 * 2 * -(-quantized // QUANT_GROUP)
        return r512(quantized * DTYPE_BYTES[kv_dtype]) + r512(scales) + r512(2 * full * batch * spec.kv_dim)
    return r512(numel * DTYPE_BYTES[kv_dtype])


def kv_cache_bytes(spec: ModelSpec, batch: int, kept: int, kv_dtype: str = "bf16") -> int:
    """Every layer's K and V, each holding `kept` tokens (see `stored_tokens`)."""
    return 2 * spec.num_layers * kv_layer_tensor_bytes(spec, batch, kept, kv_dtype)


def old_tensors_alive(spec: ModelSpec) -> int:
    """Old cache tensors of one layer alive while it grows: DynamicLayer replaces K before making the
    new V; DynamicSlidingWindowLayer makes both before replacing either (Llama 4's chunked layers are ones)."""
    return 2 if spec.sliding_window else llama4_old_tensors_alive(spec)


def layer_old_tensors_alive(spec: ModelSpec, index: int) -> int:
    """`old_tensors_alive` of layer `index` (Llama 4's global layers are DynamicLayers)."""
    if is_llama4(spec):
        return 2 if cache_window(spec, index) is not None else 1
    return old_tensors_alive(spec)


def repeated_kv_bytes(spec: ModelSpec, batch: int, keys: int, compute_bytes: int) -> int:
    """`repeat_kv`'s copy of one layer's K (or V) to every query head: e * batch * keys * q_dim.
    0 without grouped-query attention (no copy is made)."""
    return r512(compute_bytes * batch * keys * spec.q_dim) if spec.gqa_groups > 1 else 0


def decode_moment(spec: ModelSpec, w: Workload) -> dict[str, int]:
    """The cache, and eager attention's copies of it, at the decode's worst moment: the last step,
    or for a sliding window the first (the prompt's storage is still whole in the layers not yet
    updated). Each candidate is one moment: the first step's cache growth and its attention are
    apart, so their maxima are not added (a sliding-window model with eager attention: Mistral-7B,
    4 layers, window 256, batch 2, a 700-token prompt: traced 27,918,336 B beyond the weights,
    counted 28,084,224; adding the maxima gave 33,818,624)."""
    final = w.seq + w.new_tokens - 1
    if is_llama4(spec) and w.new_tokens > 1:
        return {"temporaries": 0, "kv_cache": _layerwise_decode_bytes(spec, w)}
    moments = [_last_step_moment(spec, w, final)]
    if spec.sliding_window:
        _chunk, last = prefill_chunks(w)
        before, after = stored_tokens(spec, w.seq, last), stored_tokens(spec, w.seq + 1)
        moments.append({"temporaries": 0, "kv_cache": _growth_bytes(spec, w, before, after)})
        if w.attn == "eager":
            moments.append(_first_layer_attention_moment(spec, w, before, after))
    return max(moments, key=lambda moment: sum(moment.values()))


def _layerwise_decode_bytes(spec: ModelSpec, w: Workload) -> int:
    """The cache at its largest in a decode step, layer by layer (Llama 4's windowed and global layers): in
    the first step (the prompt's storage still whole in the windowed layers) or the last (the global
    layers longest), while one layer grows, the layers below it updated, those above not yet."""
    _chunk, last = prefill_chunks(w)
    steps = [(w.seq + 1, last), (w.seq + w.new_tokens - 1, 1)]
    worst = 0
    for end, previous in steps:
        before = [kv_layer_tensor_bytes(spec, w.batch, kept, w.kv_dtype)
                  for kept in layer_cache_tokens(spec, end - 1, previous)]
        after = [kv_layer_tensor_bytes(spec, w.batch, kept, w.kv_dtype) for kept in layer_cache_tokens(spec, end)]
        for i in range(spec.num_layers):
            others = 2 * (sum(after[:i]) + sum(before[i + 1:]))
            worst = max(worst, others + layer_old_tensors_alive(spec, i) * before[i] + 2 * after[i])
    return worst


def _growth_bytes(spec: ModelSpec, w: Workload, before: int, after: int) -> int:
    """Every layer's cache holding `before` tokens, and one layer's new tensors (`after` tokens)
    made beside its old ones by torch.cat (see `old_tensors_alive`)."""
    return kv_cache_bytes(spec, w.batch, before, w.kv_dtype) + old_tensors_alive(spec) * (
        kv_layer_tensor_bytes(spec, w.batch, after, w.kv_dtype))


def _last_step_moment(spec: ModelSpec, w: Workload, final: int) -> dict[str, int]:
    """The last step's cache growth, with eager attention's repeat of one layer's whole cached K and
    V to every query head (GQA only; SDPA takes GQA natively without a mask). The growth's old
    tensors are gone by the time attention repeats the new ones: counting both is an upper bound
    by one layer's old K (or K and V), about 1 / (2 L) of the cache."""
    after = stored_tokens(spec, final)
    repeated = 0
    if w.attn == "eager":
        repeated = 2 * repeated_kv_bytes(spec, w.batch, after, DTYPE_BYTES[w.compute_dtype])
    return {"temporaries": repeated, "kv_cache": _growth_bytes(spec, w, stored_tokens(spec, final - 1), after)}


def _first_layer_attention_moment(spec: ModelSpec, w: Workload, before: int, after: int) -> dict[str, int]:
    """A sliding window's first decode step, in layer 0's eager attention: layer 0's cache replaced
    (`after` tokens), the others still holding the prompt's storage (`before`), layer 0's K and V
    repeated to every query head."""
    layer = kv_layer_tensor_bytes
    cache = (kv_cache_bytes(spec, w.batch, before, w.kv_dtype) - 2 * layer(spec, w.batch, before, w.kv_dtype)
             + 2 * layer(spec, w.batch, after, w.kv_dtype))
    return {"temporaries": 2 * repeated_kv_bytes(spec, w.batch, after, DTYPE_BYTES[w.compute_dtype]),
            "kv_cache": cache}


def training_cache_bytes(spec: ModelSpec, w: Workload) -> int:
    """Without checkpointing, transformers builds a DynamicCache in training too (`use_cache`
    defaults to True); it holds every layer's K and V until the output is dropped after the loss.
    Under autocast its K is an fp32 copy (4 T kv per layer) that SDPA does not keep (it keeps a
    bf16 cast), so it costs extra bytes; otherwise the cache's K and V are the very tensors
    attention saves. The chunked loss calls the decoder directly and drops its output, cache
    included, first."""
    if w.ac_every or w.loss != "full":
        return 0
    if is_llama4(spec):  # its K and V reach the cache in the compute dtype; its chunked layers add a tensor each
        return cache_window_bytes(spec)
    return spec.num_layers * r512(4 * w.batch * w.seq * spec.kv_dim) if w.mixed else 0
