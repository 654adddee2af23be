"""KV cache: 2 (K and V) * layers * batch * kv_heads * head_dim * cached tokens * bytes.

GQA-sized (kv_heads, never the full hidden size); a sliding-window model keeps at most
`sliding_window` tokens per layer. Quantized caches (int8/int4, KIVI-style as transformers'
QuantizedCache) add one scale and zero-point (fp32... stored in the compute dtype) per group
of 64 and keep the last 128 tokens in full precision.
"""

from __future__ import annotations

from llamem.analytic.common import r512
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec

QUANT_GROUP = 64
RESIDUAL_TOKENS = 128


def cached_tokens(spec: ModelSpec, tokens: int) -> int:
    return min(tokens, spec.sliding_window) if spec.sliding_window else tokens


def kv_layer_tensor_bytes(spec: ModelSpec, batch: int, tokens: int, kv_dtype: str) -> int:
    """One K (or V) tensor of one layer."""
    kept = cached_tokens(spec, tokens)
    numel = batch * spec.kv_dim * kept
    if kv_dtype in ("int8", "int4"):
        full = min(kept, RESIDUAL_TOKENS)
        quantized = (kept - full) * batch * spec.kv_dim
        scales = 2 * 2 * -(-quantized // QUANT_GROUP)
        return r512(quantized * DTYPE_BYTES[kv_dtype]) + r512(scales) + r512(2 * full * batch * spec.kv_dim)
    return r512(numel * DTYPE_BYTES[kv_dtype])


def kv_cache_bytes(spec: ModelSpec, batch: int, tokens: int, kv_dtype: str = "bf16") -> int:
    return 2 * spec.num_layers * kv_layer_tensor_bytes(spec, batch, tokens, kv_dtype)
