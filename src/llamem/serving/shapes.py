"""What one GPU of a tensor-parallel server holds: weights, KV bytes per token, profile-run activations.

Both servers shard a LLaMA-family model the same way (SGLang reuses vLLM's parallel layers):
column/row-parallel linears split by the TP degree, the vocabulary split across ranks
(`VocabParallelEmbedding`, padded to a multiple of 64 first), norms replicated, and the K/V
projections replicated when the TP degree exceeds the KV heads (each rank then keeps one KV head).
"""

from __future__ import annotations

from fractions import Fraction

from llamem.model import ModelSpec

VOCAB_PADDING = 64
"""vLLM's DEFAULT_VOCAB_PADDING_SIZE: the embedding and lm_head rows are padded to a multiple of it."""

WEIGHT_BYTES_PER_PARAM = {
    "fp8": Fraction(1),
    # 4-bit with group size 128: a 16-bit scale and a packed 4-bit zero point per 128 weights.
    "awq": Fraction(1, 2) + Fraction(5, 2 * 128),
    "gptq": Fraction(1, 2) + Fraction(5, 2 * 128),
}
"""Bytes per linear-layer weight under each --quant (none: the model dtype). Embeddings, lm_head and
norms stay in the model dtype under every scheme; per-channel or per-block fp8 scales are left out
(under 0.01% of the weights)."""


def kv_heads_per_gpu(spec: ModelSpec, tp: int) -> int:
    """KV heads one rank keeps: num_kv_heads / tp, or 1 when the heads are replicated (tp > kv heads)."""
    return max(1, spec.num_kv_heads // tp)


def kv_bytes_per_token(spec: ModelSpec, tp: int, element_bytes: int) -> int:
    """K and V of one token on one rank, every layer: 2 * layers * kv_heads_per_gpu * head_dim * bytes
    (vLLM's AttentionSpec.page_size_bytes per token; SGLang's cell_size in profile_max_num_token)."""
    return 2 * spec.num_layers * kv_heads_per_gpu(spec, tp) * spec.head_dim * element_bytes


def _padded_vocab_rows(spec: ModelSpec, tp: int) -> int:
    padded = -(-spec.vocab_size // VOCAB_PADDING) * VOCAB_PADDING
    return -(-padded // tp)


def _norm_params(spec: ModelSpec) -> int:
    qk_norm = 2 * spec.head_dim * spec.num_layers if spec.qk_norm == "rms" else 0
    return spec.hidden_size * (2 * spec.num_layers + 1) + qk_norm


def weight_bytes(spec: ModelSpec, *, tp: int, quant: str, dtype_bytes: int) -> int:
    """Weights on one rank, as vLLM's "Model loading took X GiB" counts them.

    linear weights / tp at the --quant width, K/V projections at kv_heads_per_gpu / num_kv_heads,
    embedding and untied lm_head rows / tp (vocabulary padded to 64), norms replicated, plus RoPE's
    cos/sin cache (max_position_embeddings x head_dim in the model dtype), which both servers allocate
    with the model."""
    kv_proj = 2 * spec.num_layers * spec.hidden_size * spec.kv_dim
    vocab_tables = 1 if spec.tie_word_embeddings else 2
    linear = spec.num_params - _norm_params(spec) - kv_proj - vocab_tables * spec.embedding_params
    width = WEIGHT_BYTES_PER_PARAM.get(quant, Fraction(dtype_bytes))
    kv_share = Fraction(kv_heads_per_gpu(spec, tp), spec.num_kv_heads)
    quantized = Fraction(linear, tp) * width + kv_proj * kv_share * width
    vocab = vocab_tables * _padded_vocab_rows(spec, tp) * spec.hidden_size * dtype_bytes
    rope = spec.max_position_embeddings * spec.head_dim * dtype_bytes
    return int(quantized) + vocab + _norm_params(spec) * dtype_bytes + rope


def activation_bytes_per_token(spec: ModelSpec, *, tp: int, dtype_bytes: int) -> int:
    """Live activation bytes per batched token at the peak of one decoder layer in a no-grad forward.

    3 * hidden (residual, normed input, layer output) + the widest block on this rank: a dense MLP's
    gate_up output and SiLU-and-mul output (3 * intermediate / tp), a fused-MoE layer's per-expert caches
    (top_k * (3 * moe_intermediate / tp + hidden)) plus a shared expert, or attention's q/k/v and output
    (2 * (q_dim + kv_dim) / tp). Checked against vLLM 0.6's profile peaks (benchmarks/serving_logs.py)."""
    h = spec.hidden_size
    widths = [2 * (spec.q_dim + spec.kv_dim) // tp]
    for moe, _count in spec.layer_kinds():
        if not moe:
            widths.append(3 * spec.intermediate_size // tp)
            continue
        expert = spec.experts_per_token * (3 * spec.moe_intermediate_size // tp + h)
        widths.append(expert + 3 * spec.shared_expert_intermediate_size // tp)
    return (3 * h + max(widths)) * dtype_bytes


GRAPH_BYTES_PER_LAYER = 128 * 1024
"""Modelled, not read from a log: device memory one captured decode graph keeps per decoder layer
(kernel parameters and the graph's private allocations). Both servers capture graphs after the KV
cache is allocated, so this only decides whether the headroom left outside the budget suffices."""


def cuda_graph_bytes(spec: ModelSpec, *, tp: int, dtype_bytes: int, sizes: list[int]) -> int:
    """Graphs captured for every batch size in `sizes`: a fixed cost per graph and layer, plus the
    shared memory pool sized by the largest batch's activations (the pool is reused across graphs)."""
    if not sizes:
        return 0
    largest = max(sizes) * activation_bytes_per_token(spec, tp=tp, dtype_bytes=dtype_bytes)
    return len(sizes) * spec.num_layers * GRAPH_BYTES_PER_LAYER + largest
