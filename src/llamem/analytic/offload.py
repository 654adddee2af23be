"""Activation offloading (`--offload-activations`): checkpointed layers' inputs in pinned host memory.

transformers' `activation_checkpointing_enable(offload=True)` runs each checkpointed layer under
`torch.autograd.graph.save_on_cpu(pin_memory=True)`; inside the checkpoint the checkpoint's own hook
takes every saved tensor, so what reaches host memory is each layer's input (one residual-stream
tensor, saved by the checkpoint to recompute from; `llamem.trace.offload` traces it). torchtune's
`OffloadActivations` offloads the same tensors when checkpointing is on (its recipes refuse
offloading without checkpointing), so one sizing covers both.

Host memory: torch's pinned CachingHostAllocator rounds each block up to a power of two; L blocks of
one residual-stream tensor each at the end of forward, freed layer by layer in backward.
"""

from __future__ import annotations

from dataclasses import replace

from llamem.analytic.activations import TrainingActivations, stream_bytes
from llamem.analytic.common import top_checkpointed_layer
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.units import format_bytes
from llamem.workload import Workload


def host_block_bytes(nbytes: int) -> int:
    """Pinned host bytes one tensor takes: the next power of two (torch's CachingHostAllocator)."""
    if nbytes <= 0:
        return 0
    return 1 << (int(nbytes) - 1).bit_length()


def offloaded_tensor_nbytes(w: Workload, hidden_size: int) -> int:
    """One checkpointed layer's input: the residual stream (fp32 under autocast, else the compute dtype)."""
    element = 4 if w.mixed else DTYPE_BYTES[w.compute_dtype]
    return int(element * w.batch * w.seq * hidden_size)


def offload_note(host_bytes: dict[str, int], how: str) -> str:
    """The report's host figure: pinned host memory at its most (the end of forward)."""
    return (f"offload: checkpointed layers' inputs held in pinned host memory ({how}): host peak "
            f"{format_bytes(max(host_bytes.values(), default=0))}, not counted in the device figures")


def host_phase_bytes(spec: ModelSpec, w: Workload) -> dict[str, int]:
    """Pinned host bytes at their most in each training phase: every layer's input from the end of
    the first layer's forward to the start of backward (freed layer by layer after it); nothing at load
    or in the optimizer step."""
    blocks = spec.num_layers * host_block_bytes(offloaded_tensor_nbytes(w, spec.hidden_size))
    return {"load": 0, "forward": blocks, "backward": blocks, "optimizer": 0}


def offloaded_activations(spec: ModelSpec, w: Workload, activations: TrainingActivations) -> TrainingActivations:
    """At the loss and through the head's backward the checkpoint inputs are on the host: their device
    copies died as the forward moved on (layer 0's, the embedding output, once the decoder returns),
    except layer 0's input under adapters (`_inputs_kept_on_device`)."""
    moved = (spec.num_layers - _inputs_kept_on_device(w)) * stream_bytes(w, spec)
    return replace(activations, forward=activations.forward - moved, backward=activations.backward - moved)


def offloaded_layer_moments(spec: ModelSpec, w: Workload, moments: list[dict[str, int]]) -> list[dict[str, int]]:
    """`backward.checkpointed_backward_moments` (the top layer's, then the bottom one's), which count the
    inputs of layer i and of the i layers below on the device, with those inputs where offloading puts
    them: below, on the host (bar `_inputs_kept_on_device`); the layer's own, its unpacked device copy,
    which an fp32 residual stream keeps through the layer's backward (the recomputed RMSNorm saves its
    input) and pure bf16/fp16 frees with the recomputation (nothing recomputed saves it). Traced:
    tests/test_offload.py."""
    stream = stream_bytes(w, spec)
    input_saved = w.mixed or w.compute_dtype == "fp32" or w.liger  # Liger's RMSNorm keeps its input too
    kept = _inputs_kept_on_device(w) + int(input_saved) - 1
    out = []
    for moment, index in zip(moments, (spec.num_layers - 1, 0)):
        out.append({**moment, "activations": moment.get("activations", 0) + (kept - index) * stream})
    return out


def offloaded_mlp_forward_bytes(spec: ModelSpec, w: Workload, held_bytes: int) -> int:
    """`activations.checkpointed_mlp_forward_bytes` with the inputs of the layers below on the host, but
    layer 0's: the embedding's output lives on until the decoder returns."""
    top = top_checkpointed_layer(spec.num_layers, w)
    return held_bytes - max(top - 1, 0) * stream_bytes(w, spec)


def _inputs_kept_on_device(w: Workload) -> int:
    """Layer inputs whose device copy outlives offloading: with a frozen embedding (LoRA, QLoRA)
    `enable_input_require_grads` makes its output a leaf that requires a gradient, and the AccumulateGrad
    node autograd makes for it holds the tensor until backward ends; a trained embedding's output is no
    leaf and dies."""
    return 1 if w.uses_adapters else 0


def host_peak_bytes(spec: ModelSpec, w: Workload) -> int:
    """Pinned host bytes one GPU's offloading holds at its most (0 without offloading)."""
    return max(host_phase_bytes(spec, w).values()) if w.offload_activations else 0


def largest_saving_bytes(spec: ModelSpec, w: Workload) -> int:
    """An upper bound of what offloading takes off the device peak: every layer's input."""
    return spec.num_layers * stream_bytes(w, spec)
