"""Liger-Kernel's RMSNorm, SwiGLU and RoPE emulated byte for byte on fake tensors (`--liger`; its
Triton kernels run only on a GPU). What `apply_liger_kernel_to_llama` patches into a model instance
(`liger_kernel/transformers/monkey_patch.py`), each buffer as `liger_kernel/ops/*.py` allocates it:

- RMSNorm (`LigerRMSNormFunction`, casting mode llama, in place): forward makes Y in the input's
  dtype and the fp32 rstd (one per row) and saves X, W, rstd; backward writes dX into dY and makes
  an fp32 (SMs x hidden) partial weight gradient, its sum and the sum cast to the weight's dtype.
- SwiGLU (`LigerSiLUMulFunction`): forward makes the product and saves gate and up; backward writes
  their gradients into them in place.
- RoPE (`LigerRopeFunction`): rotates q and k in place (their (batch, seq, heads, dim) views are
  contiguous) and saves cos and sin; backward rotates dq and dk in place after `.contiguous()`.
  Under autocast q and k stay in the compute dtype (transformers' RoPE promotes them to fp32).

The Triton kernels themselves allocate nothing. Qwen3's q_norm and k_norm are left as transformers
builds them.
"""

from __future__ import annotations

import contextlib
import sys

import torch

LIGER_NUM_SMS = 132
"""`multi_processor_count` of the card RMSNorm's backward is sized for (an H100 SXM or H200): one fp32
row of the weight gradient per SM."""


class EmulatedLigerRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        rows = x.view(-1, x.shape[-1])
        y = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        ctx.save_for_backward(rows, weight, rstd)
        ctx.shape = x.shape
        return y.view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        rows, weight, _rstd = ctx.saved_tensors
        grad = grad.contiguous()  # ensure_contiguous; dX is written into dY
        partial = torch.empty((LIGER_NUM_SMS, rows.shape[1]), dtype=torch.float32, device=grad.device)
        return grad, partial.sum(dim=0).to(weight.dtype), None  # made whether or not the weight trains


class EmulatedLigerSiLUMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        product = torch.empty_like(gate)
        ctx.save_for_backward(gate, up)
        return product

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        grad.contiguous()
        return gate, up  # the kernel writes d gate and d up over gate and up


class EmulatedLigerRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin):
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        ctx.save_for_backward(cos, sin)
        return q.transpose(1, 2), k.transpose(1, 2)

    @staticmethod
    def backward(ctx, dq, dk):
        dq, dk = dq.transpose(1, 2).contiguous(), dk.transpose(1, 2).contiguous()
        return dq.transpose(1, 2), dk.transpose(1, 2), None, None


def _rms_norm_forward(module):
    def forward(hidden_states):
        return EmulatedLigerRMSNorm.apply(hidden_states, module.weight, module.variance_epsilon)
    return forward


def _swiglu_forward(module):
    def forward(x):
        return module.down_proj(EmulatedLigerSiLUMul.apply(module.gate_proj(x), module.up_proj(x)))
    return forward


def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    return EmulatedLigerRope.apply(q, k, cos, sin)


def patch_model(model) -> None:
    """Swap the decoder's RMSNorms and SwiGLU MLPs for Liger's, as `apply_liger_kernel_to_llama(model=...)`."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.model
    norms = [decoder.norm] + [n for layer in decoder.layers for n in (layer.input_layernorm,
                                                                      layer.post_attention_layernorm)]
    for norm in norms:
        norm.forward = _rms_norm_forward(norm)
    for layer in decoder.layers:
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")):
            mlp.forward = _swiglu_forward(mlp)


@contextlib.contextmanager
def liger_rope(model, enabled: bool):
    """Liger's RoPE in place of the modeling module's `apply_rotary_pos_emb` while the trace runs."""
    if not enabled:
        yield
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    module = sys.modules[type(base.model.layers[0].self_attn).__module__]
    original = getattr(module, "apply_rotary_pos_emb", None)
    if original is None:  # a family with its own rotary code (Llama 4's complex one): left as it is
        yield
        return
    module.apply_rotary_pos_emb = liger_rotary_pos_emb
    try:
        yield
    finally:
        module.apply_rotary_pos_emb = original
