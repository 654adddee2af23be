"""torchtitan's per-op selective activation checkpointing policy, for the trace engine.

Ported from torchtitan `torchtitan/distributed/activation_checkpoint.py` (`SelectiveAC`,
commit b5bcd76c, 2026-08-21): inside a checkpointed block the outputs of the compute-intensive
ops are saved (MUST_SAVE) and everything else is recomputed in backward (PREFER_RECOMPUTE),
except that every second matmul (`aten.mm` / `aten.linear`, counted per block and per pass) is
recomputed too. The save list is torch's partitioner default
(`get_default_op_list().compute_intensive_ops`: mm, bmm, addmm, the SDPA kernels, ...) plus
torchtitan's additions (the other SDPA kernels, `aten.max`, `aten.linear`, `aten.topk`, flex
attention). torchtitan wraps blocks with `early_stop=False`; so does the trace.

Left out, as they never fire on a dense Llama on one device: the forced recompute of MoE router
matmuls (`force_recompute_mm_shapes_by_fqns`), saving CUDA-to-CPU copies, the communication ops.
On CPU SDPA runs `_scaled_dot_product_flash_attention_for_cpu`, which takes the place of the
CUDA flash / efficient kernels in the list (the outputs have the same sizes).
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

TORCHTITAN_COMMIT = "b5bcd76c66d0acb1a08b176d9639425bc55e0b2a"


def save_ops() -> set:
    """The ops whose outputs a selectively checkpointed block keeps."""
    from torch._functorch.partitioners import get_default_op_list

    aten = torch.ops.aten
    ops = {op.default for op in get_default_op_list().compute_intensive_ops}
    ops |= {aten._scaled_dot_product_cudnn_attention.default, aten._scaled_dot_product_attention_math.default,
            aten._scaled_dot_product_fused_attention_overrideable.default, aten.max.default, aten.linear.default,
            aten.topk.default, torch._higher_order_ops.flex_attention,
            aten._scaled_dot_product_flash_attention_for_cpu.default}
    return ops


def _policy(saved: set):
    """One block's policy for one checkpoint call: its matmul counters start at zero."""
    mm_ops = (torch.ops.aten.mm.default, torch.ops.aten.linear.default)
    counts = {"forward": 0, "recompute": 0}

    def policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
        if func in mm_ops:
            key = "recompute" if ctx.is_recompute else "forward"
            counts[key] += 1
            if counts[key] % 2 == 0:  # torchtitan: every second matmul is recomputed
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if func in saved else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def checkpoint_kwargs() -> dict:
    """`torch.utils.checkpoint.checkpoint` keyword arguments for one selectively checkpointed block."""
    saved = save_ops()
    return {"use_reentrant": False, "early_stop": False,
            "context_fn": lambda: create_selective_checkpoint_contexts(_policy(saved))}
