"""ds_config.json for a ZeRO layout (deepspeed 0.19.8's schema, `deepspeed/runtime/config.py`).

The batch is the replica's: `train_micro_batch_size_per_gpu` x `gradient_accumulation_steps`;
DeepSpeed derives `train_batch_size` from them and the world size, so the same file runs on any
number of nodes. The optimizer is named in the file, so DeepSpeed builds it: its fused Adam on
GPUs, and with optimizer offload its CPU Adam (`DeepSpeedCPUAdam`, engine.py
`get_optimizer_configuration`: "AdamW" with `zero_use_cpu_optimizer`), which steps the fp32
partition on the host. A client (torch) optimizer is refused with offload
(`zero_force_ds_cpu_optimizer`), so train.py never passes one.
"""

from __future__ import annotations

from llamem.parallel import Layout
from llamem.workload import Workload

LEARNING_RATE = 1e-4
MAX_GRAD_NORM = 1.0
ADAMW_PARAMS = {"lr": LEARNING_RATE, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}
"""torch.optim.AdamW's defaults, so that DeepSpeed's Adam steps as train.py's torch AdamW does."""
OPTIMIZERS = {
    # torch's foreach, fused and for-loop AdamW differ in their temporaries only: DeepSpeed steps its own Adam.
    **{name: {"type": "AdamW", "params": ADAMW_PARAMS} for name in ("adamw", "adamw-foreach", "adamw-fused",
                                                                     "adamw-loop")},
    # Names DeepSpeed does not know are looked up in torch.optim (engine.py `_configure_basic_optimizer`).
    "sgd": {"type": "SGD", "params": {"lr": LEARNING_RATE, "momentum": 0.9}},
    "adafactor": {"type": "Adafactor", "params": {"lr": LEARNING_RATE}},
}
"""The plan's optimizers DeepSpeed can build from its config; 8-bit AdamW (bitsandbytes) it cannot."""


def ds_config(w: Workload, layout: Layout, hidden_size: int) -> dict:
    """The config of a zero1 / zero2 / zero3 layout, with its offload."""
    assert layout.sharding in ("zero1", "zero2", "zero3"), layout
    config = {"train_micro_batch_size_per_gpu": w.batch, "gradient_accumulation_steps": w.grad_accum,
              "gradient_clipping": w.max_grad_norm, **_precision(w), "optimizer": OPTIMIZERS[w.optimizer],
              "zero_optimization": _zero(layout, hidden_size), "steps_per_print": 100}
    if OPTIMIZERS[w.optimizer]["type"] != "AdamW":
        config["zero_allow_untested_optimizer"] = True  # DeepSpeed tests ZeRO with Adam-family optimizers
    return config


def _precision(w: Workload) -> dict:
    """DeepSpeed keeps fp32 master weights and optimizer state under bf16 and fp16 alike: the ZeRO
    accounting of `llamem.parallel` (2 bytes of weights and gradients, 16 of master and state)."""
    if w.compute_dtype == "bf16":
        return {"bf16": {"enabled": True}}
    if w.compute_dtype == "fp16":
        return {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16}}  # dynamic loss scaling
    return {}


def _zero(layout: Layout, hidden_size: int) -> dict:
    """The stage and offload, and buckets sized to the model as the Hugging Face integration's "auto" does
    (transformers/integrations/deepspeed.py): DeepSpeed's default bucket of 5e8 elements is a 1 GB
    buffer in 16-bit on every GPU (ZeRO-1/2 with contiguous gradients), which no estimate counts."""
    zero: dict = {"stage": int(layout.sharding[-1]), "reduce_bucket_size": hidden_size * hidden_size}
    if layout.sharding == "zero3":
        zero["stage3_prefetch_bucket_size"] = int(0.9 * hidden_size * hidden_size)
        zero["stage3_param_persistence_threshold"] = 10 * hidden_size
    if layout.offload != "none":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if layout.offload == "optimizer+params":
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    return zero
