"""KV cache: 2 (K and V) * layers * batch * kv_heads * head_dim * cached tokens * bytes.

GQA-sized (kv_heads, never the full hidden size). A sliding-window model caches the last
`sliding_window - 1` tokens per layer, as a view into the concatenation of those and the newest
ones: the storage holds them all (transformers' DynamicSlidingWindowLayer), so a whole prompt
prefilled at once stays in memory until the first decode step replaces it. Quantized caches
(int8/int4, KIVI-style as transformers' QuantizedCache) add one scale and zero-point (stored
in the compute dtype) per group of 64 and keep the last 128 tokens in full precision.
"""

from __future__ import annotations

from llamem.analytic.common import r512
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec

QUANT_GROUP = 64
RESIDUAL_TOKENS = 128


def stored_tokens(spec: ModelSpec, end: int, new: int = 1) -> int:
    """Tokens one layer's K (or V) storage holds after a forward of `new` tokens ending at prompt
    position `end` (a decode step: new = 1)."""
    if not spec.sliding_window or end <= new:
        return end
    return min(end - new, spec.sliding_window - 1) + new


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
