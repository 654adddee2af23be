"""Per-GPU memory for parallel layouts: data parallel (DDP, ZeRO-1/2/3 = FSDP full shard),
tensor parallel, pipeline parallel, and CPU offload.

Model states follow DeepSpeed's own accounting (P trainable parameters, N data-parallel
ranks; `deepspeed/runtime/zero/stage_1_and_2.py` and `stage3.py` estimators, held to them in
tests): with bf16 mixed precision
- DDP (torch AMP): fp32 weights 4P, fp32 gradients 4P plus DDP's gradient buckets 4P, AdamW
  8P, bf16 autocast copies 2P;
- ZeRO-1: bf16 weights 2P and gradients 2P, fp32 gradient partition, master weights and
  AdamW state 16P/N;
- ZeRO-2: 2P + 18P/N (2 bf16 grads + 4 fp32 grads + 4 fp32 master + 8 AdamW, sharded);
- ZeRO-3 / FSDP: 18P/N + 4 x the largest layer (gathered bf16 weights and gradients);
- optimizer offload: ZeRO-1 and ZeRO-2 keep 2P (DeepSpeed's stage-1/2 estimator: one formula
  for both stages), ZeRO-3 keeps 4 x largest layer + 2P/N; parameter offload (ZeRO-3) keeps
  4 x largest layer. The host holds, per node, what DeepSpeed's estimators say (x1.5 buffers,
  its additional_buffer_factor): ZeRO-1/2 max(4N, 16) P, ZeRO-3 16 P (18 P with parameters).
Frozen weights (LoRA/QLoRA, inference, a distillation teacher) are replicated, or sharded by
ZeRO-3; tensor and pipeline parallelism split a teacher like the student.

Tensor parallel t divides heads, KV heads, the MLP width and the vocabulary by t
(Megatron-style column/row splits, vocabulary-parallel loss); norms and the residual stream
are replicated. Pipeline parallel p gives a stage ceil(L/p) layers; the first stage keeps
the activations of p micro-batches in flight with 1F1B, of all M with GPipe.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from llamem.analytic import estimate
from llamem.errors import InvalidWorkload
from llamem.model import ModelSpec
from llamem.workload import Workload

Sharding = Literal["none", "ddp", "zero1", "zero2", "zero3"]
Offload = Literal["none", "optimizer", "optimizer+params"]
HOST_BUFFER_FACTOR = 1.5
MAX_GPUS = 2**17
"""The largest layout sized: beyond the biggest clusters built (about 100,000 GPUs)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    sharding: Sharding = "none"
    offload: Offload = "none"
    pipeline_schedule: Literal["1f1b", "gpipe"] = "1f1b"
    microbatches: int = 1
    """Micro-batches per step flowing through the pipeline (= gradient accumulation under PP)."""

    @property
    def num_gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def describe(self) -> str:
        parts = []
        if self.dp > 1 or self.sharding not in ("none", "ddp"):
            parts.append(f"{self.sharding} x{self.dp}" if self.sharding != "none" else f"dp x{self.dp}")
        elif self.dp > 1:
            parts.append(f"ddp x{self.dp}")
        if self.tp > 1:
            parts.append(f"tp x{self.tp}")
        if self.pp > 1:
            parts.append(f"pp x{self.pp} ({self.pipeline_schedule}, {self.microbatches} micro-batch"
                         f"{'es' if self.microbatches > 1 else ''})")
        if self.offload != "none":
            parts.append(f"offload {self.offload}")
        return ", ".join(parts) or "1 GPU"


_SHARD_CACHE: dict[tuple, ModelSpec] = {}


def shard_spec(spec: ModelSpec, layout: Layout) -> ModelSpec:
    """The part of the model one GPU holds under tensor and pipeline parallelism."""
    if layout.tp == 1 and layout.pp == 1:
        return spec
    key = (spec, layout.tp, layout.pp)
    if key not in _SHARD_CACHE:
        _SHARD_CACHE[key] = _shard_spec(spec, layout)
    return _SHARD_CACHE[key]


def _shard_spec(spec: ModelSpec, layout: Layout) -> ModelSpec:
    t = layout.tp
    return dataclasses.replace(
        spec, num_heads=spec.num_heads // t, num_kv_heads=max(spec.num_kv_heads // t, 1),
        intermediate_size=-(-spec.intermediate_size // t), vocab_size=-(-spec.vocab_size // t),
        num_layers=-(-spec.num_layers // layout.pp), name=spec.name)


def check_layout(spec: ModelSpec, layout: Layout) -> list[str]:
    problems = []
    if spec.num_heads % layout.tp or (spec.num_kv_heads % layout.tp and layout.tp % spec.num_kv_heads):
        problems.append(f"tensor parallel {layout.tp} does not divide {spec.num_heads} heads / "
                        f"{spec.num_kv_heads} KV heads")
    if layout.pp > spec.num_layers:
        problems.append(f"pipeline parallel {layout.pp} exceeds {spec.num_layers} layers")
    if layout.offload == "optimizer+params" and layout.sharding != "zero3":
        problems.append("parameter offload needs ZeRO-3 / FSDP: use --sharding zero3")
    if layout.offload != "none" and layout.sharding not in ("zero2", "zero3", "zero1"):
        problems.append("optimizer offload needs ZeRO (DeepSpeed ZeRO-Offload): add --sharding zero1, zero2 or zero3")
    return problems


def make_layout(spec: ModelSpec, w: Workload, *, gpus: int = 1, tp: int = 1, pp: int = 1, sharding: str | None = None,
                offload: str = "none", pp_schedule: str = "1f1b") -> Layout:
    """The layout of `llamem estimate --gpus/--tp/--pp/--sharding/--offload`, checked; every problem is
    reported at once, each with the flag to change."""
    if min(gpus, tp, pp) < 1 or max(gpus, tp, pp) > MAX_GPUS:
        raise InvalidWorkload([f"--gpus, --tp and --pp must be from 1 to {MAX_GPUS:,}"])
    problems = []
    if gpus % (tp * pp):
        problems.append(f"--gpus {gpus} is not a multiple of --tp {tp} x --pp {pp}")
    if pp_schedule != "1f1b" and pp == 1:
        problems.append(f"--pp-schedule {pp_schedule} needs pipeline parallelism: add --pp N (N > 1)")
    if sharding in ("zero1", "zero2") and not w.is_training:
        problems.append(f"--sharding {sharding} shards gradients and optimizer state, which generation does not "
                        "have: use --sharding zero3 (frozen weights sharded), ddp (replicas) or none")
    if problems:
        raise InvalidWorkload(problems)
    dp = gpus // (tp * pp)
    sharding = sharding or ("ddp" if dp > 1 else "none")
    # Under pipeline parallelism the accumulation steps are the pipeline's micro-batches.
    layout = Layout(dp=dp, tp=tp, pp=pp, sharding=sharding, offload=offload, pipeline_schedule=pp_schedule,
                    microbatches=w.grad_accum if pp > 1 else 1)
    problems = check_layout(spec, layout)
    if problems:
        raise InvalidWorkload(problems)
    return layout


def fsdp_shard_bytes(spec: ModelSpec, bytes_per_element: int, world: int) -> int:
    """One rank's share of the weights under FSDP2 `fully_shard`: every parameter is split along
    dim 0 into `world` equal pieces, the last padded (torch/distributed/fsdp/_fully_shard/_fsdp_param.py)."""
    h = spec.hidden_size
    shapes = [(spec.vocab_size, h)] + ([(spec.vocab_size, h)] if spec.lm_head_params else []) + [(h, 1)]
    per_layer = [(h, 1), (h, 1)] + [(fan_out, fan_in) for fan_in, fan_out in spec.layer_linear_shapes().values()]
    shapes += per_layer * spec.num_layers
    return sum(-(-rows // world) * cols * bytes_per_element for rows, cols in shapes)


def largest_layer_params(spec: ModelSpec) -> int:
    return max(spec.params_per_layer, spec.embedding_params)


def model_state_bytes(spec: ModelSpec, w: Workload, layout: Layout, trainable: int) -> dict[str, int]:
    """Weights, gradients and optimizer state per GPU for a sharded mixed-precision run
    (DeepSpeed's accounting), with `trainable` parameters on this GPU before data parallelism."""
    n, P = layout.dp, trainable
    largest = 4 * largest_layer_params(spec)
    if layout.sharding in ("zero1", "zero2") and layout.offload == "optimizer":
        return {"weights": 2 * P}
    if layout.sharding == "zero1":
        return {"weights": 2 * P, "gradients": 2 * P, "optimizer": 16 * P // n}
    if layout.sharding == "zero2":
        return {"weights": 2 * P, "gradients": 2 * P // n + 4 * P // n, "optimizer": 12 * P // n}
    if layout.offload == "optimizer+params":
        return {"weights": largest}
    if layout.offload == "optimizer":
        return {"weights": largest + 2 * P // n}
    return {"weights": largest + 4 * P // n, "gradients": 2 * P // n + 4 * P // n, "optimizer": 8 * P // n}


def host_bytes(layout: Layout, trainable: int, gpus_on_host: int) -> int:
    """CPU memory that offloading needs on one host: DeepSpeed's estimators
    (`estimate_zero2_model_states_mem_needs`, `estimate_zero3_model_states_mem_needs` with zero_init),
    as each GPU's share of its node's figure, with their additional_buffer_factor of 1.5."""
    if layout.offload == "none":
        return 0
    if layout.sharding in ("zero1", "zero2"):
        per_gpu = max(4 * layout.dp, 16) * trainable / layout.dp
    else:
        per_gpu = (18 if layout.offload == "optimizer+params" else 16) * trainable / layout.dp
    return int(per_gpu * gpus_on_host * HOST_BUFFER_FACTOR)


def per_gpu_phases(spec: ModelSpec, w: Workload, layout: Layout,
                   teacher: ModelSpec | None = None) -> dict[str, dict[str, int]]:
    """Phase breakdowns for the busiest GPU of the layout. A teacher is split by tensor and pipeline
    parallelism like the student (its vocabulary is checked before either is split)."""
    check_teacher(spec, teacher)
    local = shard_spec(spec, layout)
    local_teacher = shard_spec(teacher, layout) if teacher is not None else None
    return apply_data_parallel(local_phases(local, w, layout, local_teacher), local, w, layout, local_teacher)


def check_teacher(spec: ModelSpec, teacher: ModelSpec | None) -> None:
    from llamem.analytic.engine import check_teacher as check

    check(spec, teacher)


def local_phases(local: ModelSpec, w: Workload, layout: Layout,
                 teacher: ModelSpec | None = None) -> dict[str, dict[str, int]]:
    """One GPU's share under tensor and pipeline parallelism, before data-parallel sharding."""
    phases = {name: dict(b) for name, b in estimate(local, w, teacher).phases.items()}
    if layout.pp > 1:
        in_flight = min(layout.pp, layout.microbatches) if layout.pipeline_schedule == "1f1b" else layout.microbatches
        for name in ("forward", "backward"):
            if name in phases:
                phases[name]["activations"] = phases[name].get("activations", 0) * max(in_flight, 1)
    return phases


def apply_data_parallel(phases: dict[str, dict[str, int]], local: ModelSpec, w: Workload,
                        layout: Layout, teacher: ModelSpec | None = None) -> dict[str, dict[str, int]]:
    """Replace model states by their data-parallel (ZeRO / DDP) form; returns new dicts."""
    phases = {name: dict(b) for name, b in phases.items()}
    if layout.sharding == "zero3" and teacher is not None:
        # ZeRO-3 shards the frozen teacher like any other module: a shard plus its gathered largest layer.
        for breakdown in phases.values():
            if "weights/teacher" in breakdown:
                breakdown["weights/teacher"] = (breakdown["weights/teacher"] // layout.dp
                                                + 2 * 2 * largest_layer_params(teacher))
    if w.is_training and layout.sharding in ("zero1", "zero2", "zero3") and w.task in ("train", "distill"):
        states = model_state_bytes(local, w, layout, local.num_params)
        for name, breakdown in phases.items():
            kept = {k: v for k, v in breakdown.items()
                    if not k.startswith(("weights", "gradients", "optimizer")) or k == "weights/teacher"}
            if name == "optimizer":
                # DeepSpeed steps a flat fp32 partition with a fused Adam (or on the host when
                # offloading): no per-parameter temporaries on the GPU.
                kept.pop("temporaries", None)
            phases[name] = {**kept, **{k: v for k, v in states.items() if v}}
    elif layout.sharding == "zero3":
        # Frozen weights (LoRA base, inference) sharded: a shard plus the gathered largest layer.
        for breakdown in phases.values():
            if "weights" in breakdown:
                breakdown["weights"] = breakdown["weights"] // layout.dp + 2 * 2 * largest_layer_params(local)
    elif layout.sharding == "ddp" and w.is_training:
        # DDP's gradient buckets hold a copy of every gradient (gradient_as_bucket_view=False),
        # allocated when the model is wrapped and kept for the whole run.
        buckets = phases["optimizer"].get("gradients", 0)
        for name in ("forward", "backward", "optimizer"):
            phases[name]["gradients/ddp_buckets"] = buckets
    return phases
