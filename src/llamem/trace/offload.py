"""`--offload-activations` on fake tensors: transformers' `activation_checkpointing_enable(offload=True)`.

transformers wraps each checkpointed layer's `torch.utils.checkpoint.checkpoint` call in
`torch.autograd.graph.save_on_cpu(pin_memory=True)` (`modeling_utils._activation_checkpointing_enable`).
Inside the checkpoint its own saved-tensors hook replaces every saved tensor by a holder, so the
offloading hook sees one tensor per layer: the layer's input, saved by the checkpoint's frame
(`_CheckpointFrame.save_inputs`) to recompute from. `save_on_cpu` copies it into a pinned host tensor
(`torch.empty(..., pin_memory=True).copy_(tensor, non_blocking=True)`); the device tensor dies when
the forward drops it, and backward's unpack makes a device copy (`tensor.to(device)`) for the
recomputation.

On the trace's fake CPU tensors `save_on_cpu` would copy nothing back (its `.to("cpu")` of a CPU
tensor is the tensor itself), so `HostOffload` does the same steps with the tracer told which copy
is host memory (`StorageTracer.host`) and the unpack making the device copy a GPU run makes.
"""

from __future__ import annotations

import functools

import torch


class HostOffload(torch.autograd.graph.saved_tensors_hooks):
    """save_on_cpu(pin_memory=True) as it runs on a GPU: the saved tensor copied to a host tensor in
    forward, copied back to a new device tensor in backward."""

    def __init__(self, tracer) -> None:
        def pack(tensor: torch.Tensor) -> torch.Tensor:
            tracer.host = True
            try:
                packed = torch.empty(tensor.size(), dtype=tensor.dtype, layout=tensor.layout)
                packed.copy_(tensor)
            finally:
                tracer.host = False
            return packed

        def unpack(packed: torch.Tensor) -> torch.Tensor:
            device_copy = packed.clone()
            tracer.label(device_copy, "activations")
            return device_copy

        super().__init__(pack, unpack)


def _offloaded(checkpoint_func, tracer):
    """transformers' `checkpoint_func`: the checkpoint run under the offloading hook."""

    @functools.wraps(checkpoint_func)
    def run(function, *args, **kwargs):
        with HostOffload(tracer):
            return checkpoint_func(function, *args, **kwargs)

    return run


def install_offload(model, tracer) -> int:
    """Wrap every checkpointed layer's checkpoint function, as `offload=True` does; returns how many."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    wrapped = 0
    for module in model.modules():
        func = getattr(module, "_gradient_checkpointing_func", None)
        if isinstance(module, GradientCheckpointingLayer) and func is not None and module.gradient_checkpointing:
            module._gradient_checkpointing_func = _offloaded(func, tracer)
            wrapped += 1
    return wrapped
