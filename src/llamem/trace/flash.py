"""flash_attention_2 emulated byte for byte on fake tensors (the flash-attn package runs only on a GPU).

transformers' path (`integrations/flash_attention.py`, `modeling_flash_attention_utils.py`, 5.x):
q, k, v transposed to (batch, seq, heads, head_dim) views, cast to the autocast dtype when RoPE left
them in fp32, then
- a padding mask: `_upad_input` gathers the real tokens of k, q and v (`_index_first_axis`: a reshape,
  a copy where the view is not contiguous, then an index copy), the varlen kernel runs, and `_pad_input`
  scatters its output into a zeroed padded tensor;
- packed sequences (`DataCollatorWithFlattening`'s restarting position ids): q, k, v made contiguous and
  flattened, cu_seqlens from the position ids, the varlen kernel;
- otherwise the dense kernel.

The kernels (flash-attn 2.x `flash_attn_interface.py`, `csrc/flash_attn/flash_api.cpp`) are stand-in
autograd functions allocating what they allocate: forward the output and the fp32 logsumexp (dense:
batch x heads x seq; varlen: heads x tokens), the rng state, and in the dense kernel the split-KV
accumulators when its heuristic splits; they save q, k, v, the output and the logsumexp. Backward
allocates dq, dk, dv, the fp32 softmax_d and dq_accum (rows rounded up to 128, head_dim to 32 or 64),
and with GQA dk and dv expanded to every query head before they are summed.
"""

from __future__ import annotations

import torch

from llamem.analytic.attention_paths import flash_head_dim_rounded, flash_num_splits, round_up

ATTENTION_NAME = "llamem_emulated_fa2"
"""The name the emulation is registered under in transformers' attention and mask interfaces (a name
with `flash_attention` in it would make transformers look for the flash-attn package)."""
PACKED_FLAG = "_llamem_packed_sequences"
"""The number of packed sequences, set on the config of a padding-free workload: transformers reads the
position ids' values to find them, which fake tensors do not have."""
REAL_TOKENS = "_llamem_real_tokens"
"""The unpadded token count, set on the config of a padded workload (`nonzero` of the mask's values)."""
_registered = False


def register() -> str:
    """Register the emulated kernels with transformers (once) and return the attention name."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(ATTENTION_NAME, flash_attention_forward)
        AttentionMaskInterface.register(ATTENTION_NAME, flash_attention_mask)
        _registered = True
    return ATTENTION_NAME


def flash_attention_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None,
                         attention_mask=None, **kwargs):
    """transformers' `flash_attention_mask`: the 2-D mask itself when it holds padding. Its
    `attention_mask.all()` reads values; a padded workload has padding by definition."""
    return None if attention_mask is None else attention_mask[:, -kv_length:]


def _target_dtype(query: torch.Tensor, module) -> torch.dtype | None:
    """`get_target_dtype`: fp32 inputs go to the autocast dtype, else to the linears' weight dtype."""
    if query.dtype != torch.float32:
        return None
    if torch.is_autocast_enabled(query.device.type):
        return torch.get_autocast_dtype(query.device.type)
    return next(m for m in module.modules() if isinstance(m, torch.nn.Linear)).weight.dtype


def flash_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                            sliding_window=None, softcap=None, is_causal=None, **kwargs):
    seq_len = query.shape[2]
    query, key, value = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    target = _target_dtype(query, module)
    if target is not None:  # fa_peft_integration_check
        query, key, value = query.to(target), key.to(target), value.to(target)
    batch = query.size(0)
    if attention_mask is not None:
        return _unpadded(query, key, value, attention_mask, batch, seq_len, module), None
    sequences = getattr(module.config, PACKED_FLAG, 0)
    if sequences:
        return _packed(query, key, value, kwargs["position_ids"], batch, sequences), None
    return EmulatedFlashAttn.apply(query, key, value), None


def _index_first_axis(tensor, indices):
    return tensor.reshape(-1, *tensor.shape[2:])[indices]


def _unpadded(query, key, value, attention_mask, batch, seq_len, module):
    """`_upad_input`, the varlen kernel, `_pad_input`. The real tokens' count comes from the workload
    (`nonzero` on fake values has no size)."""
    real = getattr(module.config, REAL_TOKENS)
    attention_mask.sum(dim=-1, dtype=torch.int32)  # seqlens_in_batch, then .max().item()
    indices = torch.empty(real, dtype=torch.int64, device=query.device)  # nonzero(mask.flatten())
    cu_seqlens = torch.nn.functional.pad(torch.empty(batch, dtype=torch.int32, device=query.device), (1, 0))
    key, value = _index_first_axis(key, indices), _index_first_axis(value, indices)
    query = _index_first_axis(query, indices)
    out = EmulatedFlashAttnVarlen.apply(query, key, value, cu_seqlens, batch)
    padded = torch.zeros((batch * seq_len, *out.shape[1:]), device=out.device, dtype=out.dtype)
    padded[indices] = out
    return padded.view(batch, seq_len, *out.shape[1:])


def _packed(query, key, value, position_ids, batch, sequences):
    """`_is_packed_sequence` (its temporaries), then `_prepare_from_posids`: contiguous copies of q, k
    and v flattened, cu_seqlens from the position ids' restarts, the varlen kernel."""
    tokens = position_ids.shape[1]
    (torch.arange(tokens, device=query.device) + position_ids.min() - position_ids).abs().sum()
    query, key, value = (t.contiguous().view(-1, t.size(-2), t.size(-1)) for t in (query, key, value))
    flat = position_ids.reshape(-1)
    is_start = flat == flat.min()  # then .nonzero(): one index per sequence
    starts = torch.empty(sequences, dtype=torch.int64, device=query.device)
    del is_start
    cu_seqlens = torch.cat((starts.to(torch.int32), torch.tensor([tokens], dtype=torch.int32, device=query.device)))
    cu_seqlens.diff().max()
    out = EmulatedFlashAttnVarlen.apply(query, key, value, cu_seqlens, sequences)
    return out.view(batch, -1, *out.shape[-2:])


class EmulatedFlashAttn(torch.autograd.Function):
    """`flash_attn_func` (FlashAttnFunc, mha_fwd / mha_bwd), causal, no dropout, head_dim a multiple of 8."""

    @staticmethod
    def forward(ctx, q, k, v):
        batch, seq, heads, head_dim = q.shape
        splits = flash_num_splits(batch, heads, seq, seq, head_dim)
        out = torch.empty_like(q)
        lse = torch.empty((batch, heads, seq), dtype=torch.float32, device=q.device)
        if splits > 1:  # split-KV accumulators, alive during the kernel only
            rounded = flash_head_dim_rounded(head_dim)
            torch.empty((splits, batch, heads, seq), dtype=torch.float32, device=q.device)
            torch.empty((splits, batch, heads, seq, rounded), dtype=torch.float32, device=q.device)
        rng = torch.empty(2, dtype=torch.int64, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, rng)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors[:3]  # (then the output, the logsumexp and the rng state)
        batch, seq, heads, head_dim = q.shape
        dout = dout.contiguous() if dout.stride(-1) != 1 else dout
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        rows = round_up(seq, 128)
        softmax_d = torch.empty((batch, heads, rows), dtype=torch.float32, device=q.device)  # noqa: F841
        dq_accum = torch.empty((batch, rows, heads, flash_head_dim_rounded(head_dim)),  # noqa: F841
                               dtype=torch.float32, device=q.device)
        if k.shape[2] != heads:  # GQA: dk, dv for every query head, then summed into dk, dv
            expanded = [torch.empty((batch, k.shape[1], heads, head_dim), dtype=q.dtype, device=q.device)  # noqa: F841
                        for _ in range(2)]
        return dq, dk, dv


class EmulatedFlashAttnVarlen(torch.autograd.Function):
    """`flash_attn_varlen_func` (FlashAttnVarlenFunc, mha_varlen_fwd / mha_varlen_bwd) over
    `sequences` sequences of `tokens` tokens in all."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, sequences):
        tokens, heads, _head_dim = q.shape
        out = torch.empty_like(q)
        lse = torch.empty((heads, tokens), dtype=torch.float32, device=q.device)
        rng = torch.empty(2, dtype=torch.int64, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, rng)
        ctx.sequences = sequences
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v = ctx.saved_tensors[:3]
        tokens, heads, head_dim = q.shape
        dout = dout.contiguous() if dout.stride(-1) != 1 else dout
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        rows = tokens + 128 * ctx.sequences
        softmax_d = torch.empty((heads, rows), dtype=torch.float32, device=q.device)  # noqa: F841
        dq_accum = torch.empty((rows, heads, flash_head_dim_rounded(head_dim)),  # noqa: F841
                               dtype=torch.float32, device=q.device)
        if k.shape[1] != heads:
            expanded = [torch.empty((k.shape[0], heads, head_dim), dtype=q.dtype, device=q.device)  # noqa: F841
                        for _ in range(2)]
        return dq, dk, dv, None, None


