"""accelerate.yaml: `accelerate launch --config_file accelerate.yaml train.py` (accelerate 1.15).

The keys are those `accelerate config` writes (accelerate/commands/config/config_args.py
`ClusterConfig`; `fsdp_config` keys are `accelerate launch --fsdp_*` options). A DeepSpeed layout
points at ds_config.json and sets nothing that file owns: accelerate refuses a config that sets
mixed precision, accumulation, clipping, the ZeRO stage or offload beside a DeepSpeed config file
(`DeepSpeedPlugin._deepspeed_config_checks`).
"""

from __future__ import annotations

import json

from llamem.model import HF_CLASSES
from llamem.parallel import Layout
from llamem.workload import Workload



def accelerate_config(w: Workload, layout: Layout, strategy: str, *, nodes: int, model_type: str) -> dict:
    config = {"compute_environment": "LOCAL_MACHINE", "debug": False, "distributed_type": _distributed_type(strategy),
              "machine_rank": 0, "main_training_function": "main", "num_machines": nodes,
              "num_processes": layout.num_gpus, "rdzv_backend": "static", "same_network": True, "use_cpu": False}
    if strategy == "deepspeed":
        config["deepspeed_config"] = {"deepspeed_config_file": "ds_config.json", "zero3_init_flag": False,
                                      "deepspeed_multinode_launcher": "standard"}
        return config
    config["mixed_precision"] = w.compute_dtype if w.mixed else "no"
    if strategy == "fsdp2":
        config["fsdp_config"] = {
            "fsdp_version": 2, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": HF_CLASSES[model_type][2], "fsdp_reshard_after_forward": True,
            "fsdp_offload_params": False, "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            # train.py loads the model on every process and applies the plan's checkpointing itself.
            "fsdp_cpu_ram_efficient_loading": False, "fsdp_activation_checkpointing": False}
    return config


def _distributed_type(strategy: str) -> str:
    return {"single": "NO", "ddp": "MULTI_GPU", "fsdp2": "FSDP", "deepspeed": "DEEPSPEED"}[strategy]


def to_yaml(data: dict, indent: int = 0) -> str:
    """YAML for a nested dict of scalars (JSON scalars are YAML scalars), keys in the given order."""
    lines = []
    for key, value in data.items():
        if isinstance(value, dict):
            lines.append(f"{' ' * indent}{key}:")
            lines.append(to_yaml(value, indent + 2).rstrip("\n"))
        else:
            lines.append(f"{' ' * indent}{key}: {json.dumps(value)}")
    return "\n".join(lines) + "\n"
