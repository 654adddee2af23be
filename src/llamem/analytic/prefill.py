"""Prefill: the prompt's forward without autograd, whole or in chunks (`generate`'s
`prefill_chunk_size`).

The worst moment is inside the last layer, before the head runs (its logits are one token).
Held through the layer loop: `inputs_embeds`, the current layer's input, RoPE's cos and sin.
Inside a layer the candidates are the MLP (silu(gate), up and their product, 3 e T I), the
RMSNorm (its fp32 upcast and normalised copy) and eager attention (the scores, their fp32
upcast and softmax, K and V repeated to every query head). A chunk after the first attends
through an explicit (chunk x keys) bool mask, so SDPA gets repeated K and V and an additive
mask; the previous chunk's last-token logits are still referenced; the cache grows by
`torch.cat`. Worst chunk: the first, the last, or the last full-size one.

Source: transformers 5.x `modeling_llama.py`, `generation/utils.py`; held to the trace engine
to the byte for SDPA, within 0.3 % for eager attention (tests/test_accuracy.py).
Left out: fused kernels, `torch.compile`, padded batches.
"""

from __future__ import annotations

from llamem.analytic import llama4
from llamem.analytic.activations import compute_bytes
from llamem.analytic.common import prefill_chunks, r512
from llamem.analytic.moe import moe_forward_temporaries
from llamem.analytic.kv_cache import (cache_bytes_at, kv_cache_bytes, kv_layer_tensor_bytes, layer_old_tensors_alive,
                                      layer_stored_tokens, repeated_kv_bytes)
from llamem.model import ModelSpec
from llamem.workload import Workload


def prefill_moment(spec: ModelSpec, w: Workload) -> dict[str, int]:
    """The prefill's worst moment: the KV cache, the temporaries and a previous chunk's logits."""
    chunk, last = prefill_chunks(w)
    candidates = _first_chunk_moments(spec, w, chunk)
    if chunk < w.seq:
        candidates += _chunk_moments(spec, w, last, w.seq)
    if w.seq - last > chunk:
        candidates += _chunk_moments(spec, w, chunk, w.seq - last)
    return max(candidates, key=lambda moment: sum(moment.values()))


def _first_chunk_moments(spec: ModelSpec, w: Workload, chunk: int) -> list[dict[str, int]]:
    """The first chunk attends with a plain causal mask, unless the sliding window is shorter than
    the chunk: then the mask is explicit, with what comes with it."""
    if spec.sliding_window and chunk > spec.sliding_window:
        return _chunk_moments(spec, w, chunk, chunk, first=True)
    held_mask = llama4.prefill_mask_bytes(spec, w, chunk, chunk) if llama4.is_llama4(spec) else 0
    return [{"kv_cache": kv_cache_bytes(spec, w.batch, chunk, w.kv_dtype),
             "temporaries": _layer_temporaries(spec, w, chunk, chunk) + held_mask}]


def masked_sdpa_sizes(spec: ModelSpec, workload: Workload, queries: int, keys: int) -> list[int]:
    """Temporaries of one layer's SDPA call with an explicit mask (a prefill chunk after the first):
    transformers repeats K and V to every query head (SDPA takes GQA natively only without a mask),
    and SDPA turns the bool mask into an additive one of the batch's full size (e b queries keys)."""
    e = compute_bytes(workload)
    repeats = [repeated_kv_bytes(spec, workload.batch, keys, e)] * 2 if spec.gqa_groups > 1 else []
    return repeats + [r512(e * workload.batch * queries * keys)]


def _held(spec: ModelSpec, w: Workload, chunk: int) -> int:
    """LlamaModel keeps `inputs_embeds` referenced through the layer loop, plus RoPE's cos and sin;
    from layer 1 on, the loop variable also keeps the current layer's input."""
    e = compute_bytes(w)
    return r512(e * w.batch * chunk * spec.hidden_size) * (2 if spec.num_layers > 1 else 1) + 2 * r512(
        e * chunk * spec.head_dim)


def _layer_temporaries(spec: ModelSpec, w: Workload, chunk: int, keys: int) -> int:
    """Largest set of live temporaries inside one layer while `chunk` prompt tokens run against
    `keys` keys: in the MLP (the norm output and a projection, e T h each; silu(gate), up and their
    product, e T I each), in the RMSNorm (its output, e T h; fp32 upcast and normalised copy,
    4 T h each), or in eager attention."""
    T = w.batch * chunk
    e = compute_bytes(w)
    h, I = spec.hidden_size, spec.intermediate_size
    held = _held(spec, w, chunk)
    if llama4.is_llama4(spec) and spec.moe_layers:  # its E-wide blocks outweigh a dense last layer (an upper
        mlp = held + llama4.moe_prefill_bytes(spec, w, T)  # bound by the caches of the layers above the last one)
    elif spec.num_layers - 1 in spec.moe_layers:  # the last layer, where the cache is whole, is a mixture of experts
        mlp = held + 2 * r512(e * T * h) + moe_forward_temporaries(spec, w, T)
    else:
        mlp = held + 2 * r512(e * T * h) + 3 * r512(e * T * I)
    norm = held + r512(e * T * h) + 2 * r512(4 * T * h)
    attention = held + _eager_attention_temporaries(spec, w, chunk, keys) if w.attn == "eager" else 0
    return max(mlp, norm, attention)


def _eager_attention_temporaries(spec: ModelSpec, w: Workload, chunk: int, keys: int) -> int:
    """Eager attention: the (b, 1, chunk, keys) additive mask for the whole model; per layer the
    norm output, q, K and V repeated to all heads (GQA), the scores (compute dtype), their fp32
    upcast (below fp32) and the fp32 softmax."""
    T, e, q = w.batch * chunk, compute_bytes(w), spec.q_dim
    probs = w.batch * spec.num_heads * chunk * keys
    mask = r512(e * w.batch * chunk * keys)
    repeats = 2 * repeated_kv_bytes(spec, w.batch, keys, e)
    upcast = r512(4 * probs) if e < 4 else 0  # softmax(dtype=float32) on non-fp32 scores
    return mask + r512(e * T * spec.hidden_size) + r512(e * T * q) + repeats + r512(e * probs) + upcast + r512(
        4 * probs)


def _chunk_moments(spec: ModelSpec, w: Workload, chunk: int, end: int, first: bool = False) -> list[dict[str, int]]:
    """Candidate worst moments of a prefill chunk with an attention mask, ending at prompt position
    `end`: inside a layer, while the last layer's cache grows (not in the first chunk: nothing to
    grow), and in SDPA with its repeated K/V and additive mask."""
    keys = layer_stored_tokens(spec, spec.num_layers - 1, end, chunk)  # the last layer's concatenation with the chunk
    cache = cache_bytes_at(spec, w.batch, end, chunk, w.kv_dtype)
    # generate() still holds the previous chunk's last-token logits.
    shared = {} if first else {"logits": r512(compute_bytes(w) * w.batch * spec.vocab_size)}
    mask = llama4.prefill_mask_bytes(spec, w, chunk, end) if llama4.is_llama4(spec) else _chunk_mask_bytes(chunk, keys)
    moments = [{**shared, "kv_cache": cache, "temporaries": _layer_temporaries(spec, w, chunk, keys) + mask}]
    if not first:
        moments.append({**shared, **_cache_growth_moment(spec, w, chunk, end, cache, mask)})
    if w.attn == "sdpa":
        moments.append({**shared, "kv_cache": cache, "temporaries": _masked_sdpa_temporaries(spec, w, chunk, keys)
                        + mask})
    return moments


def _chunk_mask_bytes(chunk: int, keys: int) -> int:
    """An explicit (chunk x keys) bool mask, broadcast over the batch, and the chunk's cache
    positions (int64)."""
    return r512(chunk * keys) + r512(8 * chunk)


def _cache_growth_moment(spec: ModelSpec, w: Workload, chunk: int, end: int, cache: int,
                         mask: int) -> dict[str, int]:
    """The cache grows by torch.cat: in the last layer, the old V (DynamicLayer; a sliding-window
    layer also the old K) is still alive beside the new one, with the chunk's projections."""
    T, e = w.batch * chunk, compute_bytes(w)
    projections = 2 * r512(e * T * spec.hidden_size) + r512(e * T * spec.q_dim)
    last = spec.num_layers - 1
    old = kv_layer_tensor_bytes(spec, w.batch, layer_stored_tokens(spec, last, end - chunk, chunk), w.kv_dtype)
    return {"kv_cache": cache + layer_old_tensors_alive(spec, last) * old,
            "temporaries": _held(spec, w, chunk) + projections + mask}


def _masked_sdpa_temporaries(spec: ModelSpec, w: Workload, chunk: int, keys: int) -> int:
    """Inside SDPA with a mask: the norm output and a projection (e T h each), the repeated K/V and
    additive mask, the output (e T q) and the fp32 logsumexp (4 b heads chunk)."""
    T, e = w.batch * chunk, compute_bytes(w)
    output = r512(e * T * spec.q_dim) + r512(4 * w.batch * spec.num_heads * chunk)
    return (_held(spec, w, chunk) + 2 * r512(e * T * spec.hidden_size) + sum(masked_sdpa_sizes(spec, w, chunk, keys))
            + output)
