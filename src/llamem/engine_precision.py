"""Precision as the engine that runs a layout runs it: which tensors are 16-bit, which fp32.

`--precision bf16-mixed` (fp16-mixed alike) names a recipe: 16-bit matmuls, fp32 master weights and
optimizer state. Engines hold it in different places:
- torch autocast over fp32 weights (one GPU, DDP; the Trainer's `bf16=True` and accelerate's
  `mixed_precision: bf16` without DeepSpeed): the module's weights are fp32, autocast casts them per
  matmul, and everything autocast does not touch stays fp32, above all the residual stream between
  layers, so every checkpointed layer input is fp32 (`llamem.analytic.activations.stream_bytes`).
  This is how `llamem.analytic` sizes bf16-mixed.
- DeepSpeed's `bf16` / `fp16` mode (every ZeRO layout llamem sizes with DeepSpeed's accounting, also
  when accelerate or the Trainer drive DeepSpeed: their precision flag turns it on): the module's
  parameters are 16-bit (deepspeed 0.19.8 `runtime/engine.py` `_configure_distributed_model` casts
  them, `_cast_module_mixed_precision`; buffers such as RoPE's `inv_freq` stay fp32), so the
  activations are 16-bit throughout; the fp32 master
  weights, the fp32 gradient partition and the Adam moments live inside the ZeRO optimizer
  (`zero/stage_1_and_2.py`, `zero/stage3.py`), which `llamem.parallel.model_state_bytes` counts.
  Sized here as the 16-bit run's activations with those model states (`runs_as`).
- torch FSDP2 with `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`: sharded fp32
  parameters, gathered and cast to bf16 per unit: 16-bit activations as well; `llamem.parallel.
  fsdp2_phases` sizes that already.
ZeRO beside tensor or pipeline parallelism (torchtitan's FSDP2) holds 16-bit parameters too, and is sized
the same way.
- Megatron-LM's `--bf16` / `--fp16` (`--engine megatron`, with or without its distributed optimizer):
  a 16-bit model (`Float16Module`), an fp32 gradient buffer under bf16, fp32 main weights in the
  optimizer (`llamem.megatron` counts them): 16-bit activations.
"""

from __future__ import annotations

from llamem.parallel import Layout
from llamem.workload import Workload, with_changes

ZERO_STAGES = ("zero1", "zero2", "zero3")


def deepspeed_16bit_mode(w: Workload, layout: Layout) -> bool:
    """Whether DeepSpeed runs this layout in its bf16 / fp16 mode where llamem would size autocast: a ZeRO
    stage under DeepSpeed (not FSDP2), full training or distillation (whose model states ZeRO holds) with
    a mixed precision."""
    return (layout.sharding in ZERO_STAGES and layout.engine == "deepspeed" and w.mixed
            and w.task in ("train", "distill"))


def sixteen_bit_module(w: Workload, layout: Layout) -> bool:
    """Whether the engine casts the module itself to 16 bits where llamem would size autocast: DeepSpeed's
    bf16 / fp16 mode, or Megatron-LM's `--bf16` / `--fp16`."""
    return deepspeed_16bit_mode(w, layout) or (layout.engine == "megatron" and w.mixed and w.task == "train")


def runs_as(w: Workload, layout: Layout) -> Workload:
    """The workload whose activations the engine computes: the 16-bit one where the engine casts the module
    (`sixteen_bit_module`; the model states are that engine's accounting whatever the precision), else `w`."""
    return with_changes(w, precision=w.compute_dtype) if sixteen_bit_module(w, layout) else w


def precision_note(w: Workload, layout: Layout) -> str:
    """Which precision a per-GPU figure assumes, in the words of the engine that runs it."""
    if layout.engine == "megatron" and w.mixed:
        optimizer = ("sharded by its distributed optimizer" if layout.sharding == "zero1" else
                     "whole on every GPU (no --use-distributed-optimizer)")
        gradients = "an fp32 gradient buffer" if w.compute_dtype == "bf16" else f"{w.compute_dtype} gradients"
        return (f"precision as Megatron-LM's --{w.compute_dtype} runs {w.precision}: {w.compute_dtype} weights and "
                f"activations, {gradients}, fp32 main weights and optimizer state {optimizer}")
    if deepspeed_16bit_mode(w, layout) and layout.tp == layout.pp == 1:
        return (f"precision as DeepSpeed's {w.compute_dtype} mode runs {w.precision}: {w.compute_dtype} weights, "
                f"gradients and activations, fp32 master weights and optimizer state inside the ZeRO optimizer")
    if deepspeed_16bit_mode(w, layout):
        return (f"precision as the engines that shard optimizer state beside tensor or pipeline parallelism run "
                f"{w.precision} (FSDP2 as torchtitan runs it; --engine megatron sizes Megatron-LM's own states): "
                f"{w.compute_dtype} weights and activations, fp32 master weights and optimizer state sharded")
    if layout.engine == "fsdp2" and layout.sharding == "zero3" and w.mixed:
        return (f"precision as FSDP2's MixedPrecisionPolicy(param_dtype={w.compute_dtype}, reduce_dtype=fp32) runs "
                f"{w.precision}: fp32 shards, {w.compute_dtype} gathered weights and activations")
    if w.mixed:
        return (f"precision as torch autocast runs {w.precision}: fp32 weights, {w.compute_dtype} matmuls, the "
                "residual stream (and every checkpointed layer input) in fp32")
    return f"precision {w.precision} throughout"
