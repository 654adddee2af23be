"""Megatron-LM as `--engine megatron` sizes it: its model states per parameter, in the precision it runs.

Megatron-LM keeps fp32 main weights whenever it trains in 16 bits (`--bf16` / `--fp16`: its model is cast to
16 bits, `Float16Module`, and its optimizer holds fp32 copies) and, under `--bf16`, accumulates and all-reduces
the gradients in fp32 (`accumulate_allreduce_grads_in_fp32`, which `--bf16` turns on): the contiguous gradient
buffer (`main_grad`) of its DistributedDataParallel, allocated when the model is wrapped and kept for the run.
Bytes per parameter, from its distributed optimizer's documentation (docs/user-guide/features/dist_optimizer.md)
and its own estimator (`megatron/training/theoretical_memory_usage.py`, which assumes the bf16 row):

    precision    weights  gradients  optimizer              total   --use-distributed-optimizer
    bf16-mixed   2        4          12 (main 4, Adam 8)    18      6 + 12/d
    fp16-mixed   2        2          16 (main 4 + grad 4)   20      4 + 16/d
    fp32         4        4          8  (Adam)              16      8 + 8/d

The distributed optimizer divides the optimizer column over the d data-parallel ranks; the weights and the
gradient buffer stay whole. SGD keeps a momentum buffer (4 bytes, `--sgd-momentum` 0.9) instead of Adam's 8.
Activations are those of the 16-bit model (`llamem.engine_precision`).
"""

from __future__ import annotations

from llamem.workload import Workload

MEGATRON_PRECISIONS = ("fp32", "bf16-mixed", "fp16-mixed")
MEGATRON_OPTIMIZERS = ("adamw", "sgd")
STATE_BYTES = {"bf16": (2, 4, 4), "fp16": (2, 2, 8), "fp32": (4, 4, 0)}
"""By compute dtype (the same for `--precision bf16-mixed` and the 16-bit workload its activations are sized
with): (weights, gradients, optimizer besides Adam's or SGD's state) bytes per parameter: the fp32 main weights
and, under fp16, the fp32 main gradients live in the optimizer."""
OPTIMIZER_STATE_BYTES = {"adamw": 8, "sgd": 4}


def megatron_problems(w: Workload) -> list[str]:
    """What Megatron-LM's arguments cannot express of a workload, each with the setting to change."""
    problems = []
    if w.task != "train":
        problems.append(f"--engine megatron sizes full training (--task train), not --task {w.task}")
    if w.optimizer not in MEGATRON_OPTIMIZERS:
        problems.append(f"Megatron-LM runs adam and sgd, not {w.optimizer}: use --optimizer adamw or sgd")
    if w.precision not in MEGATRON_PRECISIONS:
        problems.append(f"Megatron-LM keeps fp32 main weights: --precision {', '.join(MEGATRON_PRECISIONS)}")
    if w.quant != "none" or w.loss != "full":
        problems.append("Megatron-LM has no quantized base or chunked loss argument: drop --quant and --loss")
    return problems


def megatron_state_bytes(w: Workload, trainable: int, dp: int, distributed: bool) -> dict[str, int]:
    """Weights, gradient buffer and optimizer state of `trainable` parameters on one GPU (see the module);
    `distributed`: `--use-distributed-optimizer` over `dp` ranks."""
    weights, gradients, main = STATE_BYTES[w.compute_dtype]
    optimizer = (main + OPTIMIZER_STATE_BYTES[w.optimizer]) * trainable
    return {"weights": weights * trainable, "gradients": gradients * trainable,
            "optimizer": optimizer // dp if distributed else optimizer}
