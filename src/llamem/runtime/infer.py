"""The llamem workload of a live model: what `llamem estimate` should size for it.

Read from the objects themselves: the model's config (ModelSpec), the peft config (task, rank,
targets), quantized layers (bitsandbytes 4-bit / 8-bit), the parameters' dtype and autocast
(precision), gradient checkpointing, the attention implementation, the optimizer's class, and
the batch shape. What cannot be read is listed in `unknown` and the llamem default is used in
its place; the report says so instead of guessing silently.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from llamem.errors import LlamemError
from llamem.model import ModelSpec, spec_from_config
from llamem.workload import LORA_EXPERTS, LORA_TARGETS_ALL, Workload, build_workload

_OPTIMIZERS = {"AdamW": "adamw", "Adam": "adamw", "SGD": "sgd", "Adafactor": "adafactor",
               "AdamW8bit": "adamw8bit", "PagedAdamW8bit": "adamw8bit", "Adam8bit": "adamw8bit"}
_DTYPES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}


@dataclass(frozen=True)
class Inferred:
    spec: ModelSpec | None
    workload: Workload | None
    unknown: tuple[str, ...] = ()
    """What could not be read from the objects (llamem's default stands in for each)."""
    problem: str | None = None
    """Why no workload could be built at all (e.g. a model type llamem does not size)."""

    def command(self, config_path: str | None = None) -> str:
        """The `llamem estimate` command that sizes this workload: with `--config config_path`
        (the model's own config, written by `write_config`), else by its hub id."""
        if self.spec is None or self.workload is None:
            return ""
        from llamem.techniques import workload_args

        if config_path is None and self.spec.hf_id is None:
            config_path = "config.json"  # the model has no hub id: its config must be written out
        model = ["--config", config_path] if config_path else [self.spec.hf_id]
        return "llamem estimate " + shlex.join([*model, *workload_args(self.workload)])

    def write_config(self, path) -> None:
        """The model's config.json, as `llamem estimate --config` reads it."""
        import json

        with open(path, "w") as handle:
            json.dump(self.spec.config, handle, indent=1, sort_keys=True, default=str)

    def predicted_phase_bytes(self) -> dict[str, int]:
        """`llamem estimate`'s peak allocated bytes per phase (empty when no workload)."""
        if self.spec is None or self.workload is None:
            return {}
        from llamem.analytic import estimate

        return estimate(self.spec, self.workload).phase_peaks


def infer_workload(model, *, optimizer=None, batch: int | None = None, seq: int | None = None,
                   task: str | None = None, autocast_dtype: str | None = None, grad_accum: int = 1,
                   new_tokens: int | None = None) -> Inferred:
    """The workload of `model` run with `optimizer` on batches of `batch` x `seq` tokens.
    `autocast_dtype` ("bf16" / "fp16") when the forward runs under autocast; None when not known."""
    unknown: list[str] = []
    base = _base_model(model)
    try:
        spec = _spec_of(base)
    except LlamemError as err:
        return Inferred(None, None, (), str(err))
    fields = _adapter_fields(model, base)
    task = task or _task_of(model, base, fields)
    fields |= _precision_fields(base, task, autocast_dtype, unknown)
    if task != "infer":
        fields["optimizer"] = _optimizer_of(optimizer, unknown)
        fields["ac_every"] = _ac_every(base, unknown)
        fields["grad_accum"] = grad_accum
    else:
        if new_tokens is None:
            unknown.append("new_tokens: not seen (llamem's default of 256 used)")
        fields["new_tokens"] = new_tokens
    fields["attn"] = _attention_of(base, unknown)
    for name, value in (("batch", batch), ("seq", seq)):
        if value is None:
            unknown.append(f"{name}: not seen yet (llamem's default used)")
        fields[name] = value
    try:
        workload = build_workload(task, **fields)
    except LlamemError as err:
        return Inferred(spec, None, tuple(unknown), str(err))
    return Inferred(spec, workload, tuple(unknown))


def _base_model(model):
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _spec_of(base) -> ModelSpec:
    config = getattr(base, "config", None)
    if config is None or not hasattr(config, "to_dict"):
        raise LlamemError(f"{type(base).__name__} has no transformers config: llamem sizes transformers "
                          "LLaMA-family models (give the workload to llamem.estimate yourself)")
    data = config.to_dict()
    name = getattr(config, "_name_or_path", "") or data.get("model_type", "model")
    return spec_from_config(data, name=name, hf_id=name if "/" in name else None, source="the model's config")


def _adapter_fields(model, base) -> dict:
    peft_config = getattr(model, "peft_config", None)
    if not peft_config:
        return {}
    config = next(iter(peft_config.values()))
    targets = config.target_modules or ()
    if isinstance(targets, str):  # "all-linear" or a regex: the projections it matches
        targets = LORA_TARGETS_ALL
    named = tuple(t for t in LORA_TARGETS_ALL if t in set(targets))
    # peft's target_parameters on the fused 3-D experts (experts.gate_up_proj, experts.down_proj)
    experts = any("experts" in str(p) for p in (getattr(config, "target_parameters", None) or ()))
    return {"lora_rank": int(config.r), "lora_targets": named + ((LORA_EXPERTS,) if experts else ())}


def _task_of(model, base, fields: dict) -> str:
    quant = _quant_of(base)
    if fields:
        return "qlora" if quant == "nf4" else "lora"
    trains = base.training and any(p.requires_grad for p in base.parameters())
    return "train" if trains else "infer"


def _quant_of(base) -> str:
    if getattr(base, "is_loaded_in_4bit", False):
        return "nf4"
    if getattr(base, "is_loaded_in_8bit", False):
        return "int8"
    return "none"


def _precision_fields(base, task: str, autocast_dtype: str | None, unknown: list[str]) -> dict:
    weight = _DTYPES.get(str(_first_float_dtype(base)), "fp32")
    fields: dict = {}
    if task == "lora" and _quant_of(base) == "int8":
        fields["quant"] = "int8"
    if weight == "fp32" and task != "infer":
        if autocast_dtype is None:
            unknown.append("autocast: not seen yet (fp32 weights read as bf16-mixed, the Trainer's bf16=True)")
            autocast_dtype = "bf16"
        fields["precision"] = f"{autocast_dtype}-mixed" if autocast_dtype in ("bf16", "fp16") else "fp32"
    else:
        fields["precision"] = weight
    return fields


def _first_float_dtype(base):
    for param in base.parameters():
        if param.is_floating_point():
            return param.dtype
    return None


def _optimizer_of(optimizer, unknown: list[str]) -> str:
    if optimizer is None:
        unknown.append("optimizer: none given (AdamW assumed)")
        return "adamw"
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps one
    name = type(inner).__name__
    if name not in _OPTIMIZERS:
        unknown.append(f"optimizer: {name} is not one llamem sizes (AdamW assumed)")
    elif any(group.get("fused") for group in getattr(inner, "param_groups", ())):
        # The Trainer's default optim="adamw_torch_fused": one kernel, no foreach temporaries.
        unknown.append(f"optimizer: fused {name} (llamem sizes the foreach step: its optimizer phase errs high)")
    elif name in ("AdamW", "Adam", "SGD") and not _foreach(inner):
        unknown.append(f"optimizer: for-loop {name} (torch's default for CPU tensors; llamem sizes the foreach "
                       "step CUDA tensors get: its optimizer phase errs high)")
    return _OPTIMIZERS.get(name, "adamw")


def _attention_of(base, unknown: list[str]) -> str:
    implementation = getattr(base.config, "_attn_implementation", None) or "sdpa"
    if implementation not in ("sdpa", "eager"):
        unknown.append(f"attention: {implementation} is not one llamem sizes (sdpa used)")
        return "sdpa"
    return implementation



def _ac_every(base, unknown: list[str]) -> int:
    """0 without checkpointing, K when every K-th decoder layer is checkpointed (transformers'
    `activation_checkpointing_enable(every_n_layers=K)` flags layers 0, K, 2K, ...)."""
    layers = getattr(getattr(base, "model", None), "layers", None)
    if layers is None:
        unknown.append("checkpointing: no decoder layers found (none assumed)")
        return 0
    flags = [bool(getattr(layer, "gradient_checkpointing", False)) for layer in layers]
    if not any(flags):
        return 0
    every = flags.index(True, 1) if flags.count(True) > 1 else len(flags)
    if flags == [i % every == 0 for i in range(len(flags))]:
        return every
    unknown.append("checkpointing: an irregular set of layers is checkpointed (every layer assumed)")
    return 1


def _foreach(optimizer) -> bool:
    """Whether torch's optimizer runs the foreach step: asked for, or by default on CUDA tensors
    (torch.optim.optimizer._default_to_fused_or_foreach)."""
    groups = getattr(optimizer, "param_groups", ())
    wanted = {group.get("foreach") for group in groups}
    if wanted == {True}:
        return True
    if False in wanted:
        return False
    return any(p.is_cuda for group in groups for p in group["params"])
