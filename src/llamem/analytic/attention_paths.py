"""The attention path a training step runs, and what it holds: padded batches, packed batches and
flash_attention_2 (`--padding longest`, `--padding-free`, `--attn flash_attention_2`).

transformers 5.x (`masking_utils.py`) gives SDPA no mask (`is_causal`) when nothing is padded, and a
materialised bool mask (batch, 1, seq, seq) when the 2-D `attention_mask` holds padding, or when
packed sequences are found from restarting position ids (only without a cache: under checkpointing);
eager attention always gets a float mask. flash_attention_2 never gets a 4-D mask: the 2-D mask
itself, from which it unpads q, k and v (`llamem.trace.flash`).

A padding-free batch is sized as one row of `batch x seq` tokens (`packed_shape`): every tensor has that
shape, and the position ids are one more input. Only flash_attention_2 sees the sequences apart.

flash-attn 2.x (`csrc/flash_attn/flash_api.cpp`): the dense forward keeps the output and an fp32
logsumexp (batch, heads, seq), the varlen one (heads, tokens); the dense forward's split-KV heuristic
(for a number of SMs, `FLASH_NUM_SMS`) adds fp32 accumulators while the kernel runs; backward makes
dq, dk, dv, an fp32 softmax_d and dq_accum (rows rounded up to 128; varlen: 128 more rows per
sequence), with GQA dk and dv for every query head before they are summed (`llamem.trace.flash`).
These backward buffers (about 11 T h bytes in bf16) stay below the same layer's MLP backward
temporaries (`backward.py`: a stream gradient and three T x I tensors), so no moment of their own is
sized; the trace holds both.
"""

from __future__ import annotations

from dataclasses import replace

from llamem.analytic.common import r512, trains_base_weights
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import Workload

FLASH_NUM_SMS = 132
"""Streaming multiprocessors the split-KV heuristic is run for: an H100 SXM or H200 (an A100 has 108).
It only matters for small batch x heads x seq, where the dense forward splits the keys."""


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def flash_head_dim_rounded(head_dim: int) -> int:
    """`round_multiple(head_size, head_size <= 128 ? 32 : 64)`."""
    return round_up(head_dim, 32 if head_dim <= 128 else 64)


def flash_num_splits(batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int,
                     num_sms: int = FLASH_NUM_SMS) -> int:
    """`set_params_splitkv` and `num_splits_heuristic` (dropout 0): split the keys when the blocks
    would not fill the SMs (counted twice: 128 threads per block), at the fewest splits within 85 %
    of the best wave efficiency."""
    block_n = 256 if head_dim <= 64 else (128 if head_dim <= 128 else 64)
    n_blocks = -(-seq_k // block_n)
    work = batch * heads * -(-seq_q // 64)
    slots = 2 * num_sms
    if work >= 0.8 * slots:
        return 1
    max_splits = min(128, slots, n_blocks)
    eligible = [s for s in range(1, max_splits + 1) if s == 1 or -(-n_blocks // s) != -(-n_blocks // (s - 1))]
    efficiency = {s: (work * s / slots) / -(-(work * s) // slots) for s in eligible}
    best = max(efficiency.values(), default=1.0)
    return next((s for s in eligible if efficiency[s] >= 0.85 * best), 1)


def packed_shape(w: Workload) -> Workload:
    """A padding-free workload as the model sees it: one row of batch x seq tokens. A single sequence is
    not packed (its position ids do not restart): without a cache SDPA gets no mask, as for a plain batch."""
    if w.padding_free and w.batch == 1 and w.attn == "sdpa" and w.ac_every:
        return replace(w, padding_free=False)
    return replace(w, batch=1, seq=w.batch * w.seq) if w.padding_free and w.batch > 1 else w


def real_tokens(w: Workload) -> int:
    """Tokens that are not padding: batch x seq less the padded share."""
    tokens = w.batch * w.seq
    return tokens - round(w.pad_fraction * tokens) if w.padding == "longest" else tokens


def uncached_mask(w: Workload) -> bool:
    """Whether a step without a cache (checkpointing turns it off) materialises the causal mask.
    transformers then looks for packed sequences in the position ids: it builds the mask when it finds
    some (a padding-free batch) or cannot read them (a compiled model), and with padding; otherwise SDPA
    runs causal without a mask, grouped-query attention natively (K and V not repeated)."""
    return w.ac_every > 0 and (w.padding_free or w.compile or w.padding == "longest")


def sdpa_masked(w: Workload) -> bool:
    """SDPA gets a materialised mask: padding, or packed sequences found without a cache (checkpointing)."""
    return w.padding == "longest" or (w.padding_free and w.ac_every > 0)


def extra_input_bytes(w: Workload) -> int:
    """The collator's inputs beyond the ids: the int64 attention mask (padded), the int64 position ids
    (packed); labels are the ids' tensor here, as everywhere in llamem."""
    if w.padding == "longest" or w.padding_free:
        return r512(8 * w.batch * w.seq)
    return 0


def flash_saved_bytes(spec: ModelSpec, w: Workload) -> int:
    """What one layer's flash attention keeps: q, k, v (with padding: their unpadded copies), the
    output and the fp32 logsumexp, the rng state; with padding also the gather indices (int64 per
    real token, kept by the index ops' backward), cu_seqlens and the zero-padded output (o_proj's
    input, when its weight trains). `w` is the shape the model sees (`packed_shape`)."""
    e = DTYPE_BYTES[w.compute_dtype]
    tokens, q, kv = real_tokens(w), spec.q_dim, spec.kv_dim
    saved = 2 * r512(e * tokens * q) + 2 * r512(e * tokens * kv) + r512(4 * spec.num_heads * tokens) + r512(16)
    if w.padding_free:  # cu_seqlens (one block below 127 sequences)
        saved += r512(8)
    if w.padding == "longest":
        saved += r512(8 * tokens) + r512(4 * (w.batch + 1))
        saved += r512(e * w.batch * w.seq * q) if trains_base_weights(w) else 0
    return saved


def attention_notes(w: Workload) -> list[str]:
    notes = []
    if w.attn == "flash_attention_2":
        notes.append(f"flash_attention_2: flash-attn's kernels run only on a GPU: emulated byte for byte from their "
                     f"source (`llamem trace`); the dense kernel's split-KV heuristic is run for {FLASH_NUM_SMS} SMs "
                     "(an H100)")
    if w.padding == "longest" and w.attn == "flash_attention_2":
        notes.append(f"padding: {real_tokens(w):,} of {w.batch * w.seq:,} tokens are not padding "
                     f"(--pad-fraction {w.pad_fraction:g}); flash_attention_2 unpads them")
    elif w.padding == "longest" and w.pad_fraction:
        notes.append(f"padding: --pad-fraction {w.pad_fraction:g} does not change these figures: {w.attn} attention "
                     f"computes every padded position of the {w.batch} x {w.seq} batch (only flash_attention_2 "
                     "unpads)")
    if w.padding_free:
        notes.append(f"padding-free: {w.batch} sequence{'s' if w.batch != 1 else ''} of {w.seq} tokens packed into one row of "
                     f"{w.batch * w.seq:,} (position ids restart at each)")
    return notes


def masked_cache_bytes(spec: ModelSpec, w: Workload) -> int:
    """Eager attention, or SDPA with a padding mask (which cannot run GQA natively), keep K and V
    repeated to every query head, flash_attention_2 with padding their unpadded copies, with packed
    sequences their contiguous copies; without checkpointing the training DynamicCache (alive until the
    output is dropped after the full loss) still holds the unrepeated V, and K in pure precision
    (under autocast its fp32 K is `training_cache_bytes`'s)."""
    # (eager attention under LoRA keeps other tensors: sized as before, without this term)
    repeated = ((w.attn == "eager" and w.task == "train") or (w.attn == "sdpa" and w.padding == "longest")
                or (w.attn == "flash_attention_2" and (w.padding == "longest" or w.padding_free)))  # copies
    if not (repeated and (spec.gqa_groups > 1 or w.attn == "flash_attention_2")):
        return 0
    if w.ac_every or w.loss != "full" or w.liger:
        return 0
    e = DTYPE_BYTES[w.compute_dtype]
    per_layer = r512(e * w.batch * w.seq * spec.kv_dim) * (1 if w.mixed else 2)
    return spec.num_layers * per_layer
