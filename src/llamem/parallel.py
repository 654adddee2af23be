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
Frozen weights (LoRA/QLoRA, inference) are replicated, or sharded by ZeRO-3; a distillation
teacher is placed as `llamem.teacher_placement` says (replicated, or sharded with FSDP2 on its own,
or as the layout implies); tensor and pipeline parallelism split a teacher like the student.

With `engine="fsdp2"` (`Fsdp2Layout`) ZeRO-3 is sized as torch FSDP2 runs it (`fully_shard` per
decoder layer, the embedding, the final norm with the head, the root): `fsdp2_phases`, whose
docstring derives each term from torch's source.

Tensor parallel t divides heads, KV heads, the MLP width and the vocabulary by t
(Megatron-style column/row splits, vocabulary-parallel loss); norms and the residual stream
are replicated. Under torch's tensor parallel (not Megatron-LM's) the loss on the vocabulary shards is
sized as `loss_parallel` runs it (`llamem.analytic.loss_parallel`), on TP alone and the last pipeline stage. Pipeline parallel training sizes every stage as it runs (`llamem.pipeline_stages`: its
layers, the embedding on the first, the head and loss on the last, min(p - s, M) micro-batches in flight
on stage s with 1F1B, all M with GPipe, the receive buffers and kept outputs) and reports the busiest;
a generation's layer split is sized as ceil(L/p) layers with the embedding and the head both.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar, Literal

from llamem.analytic import estimate
from llamem.analytic.activations import (checkpoint_mask_bytes, is_checkpointed, layer_saved_bytes, rope_bytes,
                                         stream_bytes, training_activations)
from llamem.analytic.common import add_breakdowns, r512, trains_base_weights
from llamem.analytic.logits import training_logits
from llamem.analytic.loss_parallel import runs_loss_parallel, size_loss_parallel
from llamem.analytic.weights import rope_buffer_bytes
from llamem.dtypes import DTYPE_BYTES
from llamem.errors import InvalidWorkload
from llamem.megatron import megatron_problems, megatron_state_bytes
from llamem.expert_parallel import expert_parallel_phases, expert_parallel_problems
from llamem.expert_parallel_engines import transformers_ep_phases
from llamem.model import ModelSpec, load_model
from llamem.pipeline_stages import (add_pipeline_buffers, in_flight, last_stage_loss_saved_bytes, schedule_in_flight,
                                    stage_positions, stage_spec, trim_stage, vocab_state)
from llamem.teacher_placement import place_teacher, placement_problems, whole_teacher_bytes
from llamem.workload import Workload, with_changes

Sharding = Literal["none", "ddp", "zero1", "zero2", "zero3"]
Offload = Literal["none", "optimizer", "optimizer+params"]
Engine = Literal["deepspeed", "fsdp2", "megatron"]
ENGINES = ("deepspeed", "fsdp2", "megatron")
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
    engine: ClassVar[Engine] = "deepspeed"
    """Who runs ZeRO-3, which decides how it is sized: DeepSpeed's accounting here, torch FSDP2 in
    `Fsdp2Layout` (`with_engine`). A class attribute, so that layouts as dicts (plan JSON) keep
    their fields."""
    ep: ClassVar[int] = 1
    """Expert parallel degree: 1, except in `ExpertParallelLayout` (a class attribute here, so that dense
    layouts as dicts keep their fields)."""

    @property
    def num_gpus(self) -> int:
        return self.dp * self.tp * self.pp

    def describe(self) -> str:
        parts = []
        if self.dp > 1 or self.sharding not in ("none", "ddp"):
            name = "fsdp2" if self.engine == "fsdp2" else self.sharding
            name = "distributed-optimizer" if self.engine == "megatron" and name == "zero1" else name
            parts.append(f"{name} x{self.dp}" if self.sharding != "none" else f"dp x{self.dp}")
        elif self.dp > 1:
            parts.append(f"ddp x{self.dp}")
        if self.tp > 1:
            parts.append(f"tp x{self.tp}")
        if self.pp > 1:
            parts.append(f"pp x{self.pp} ({self.pipeline_schedule}, {self.microbatches} micro-batch"
                         f"{'es' if self.microbatches > 1 else ''})")
        if self.ep > 1:
            parts.append(f"ep x{self.ep}")
        if self.offload != "none":
            parts.append(f"offload {self.offload}")
        return ", ".join(parts) or "1 GPU"


@dataclass(frozen=True, kw_only=True, slots=True)
class Fsdp2Layout(Layout):
    """ZeRO-3 as torch FSDP2 runs it (`fully_shard`), sized by `fsdp2_phases`."""

    engine: ClassVar[Engine] = "fsdp2"


@dataclass(frozen=True, kw_only=True, slots=True)
class MegatronLayout(Layout):
    """Data, tensor and pipeline parallelism as Megatron-LM runs them (`llamem.megatron`): its 16-bit model, fp32
    gradient buffer and main weights; ZeRO-1 is its distributed optimizer."""

    engine: ClassVar[Engine] = "megatron"


@dataclass(frozen=True, kw_only=True, slots=True)
class ExpertParallelLayout(Layout):
    """A layout whose data-parallel ranks also split every mixture-of-experts layer's experts
    (`llamem.expert_parallel`)."""

    ep: int = 1
    """Expert parallel degree: each group of `ep` data-parallel ranks holds the experts once, E / ep per GPU."""


def expert_parallel(layout: Layout, ep: int) -> Layout:
    """The same layout with its data-parallel ranks in expert-parallel groups of `ep`."""
    fields = {f.name: getattr(layout, f.name) for f in dataclasses.fields(layout) if f.name != "ep"}
    return ExpertParallelLayout(**fields, ep=ep) if ep > 1 else Layout(**fields)


def expert_parallel_variants(spec: ModelSpec, layout: Layout) -> list[Layout]:
    """The planner's expert-parallel option for a layout of a mixture of experts: the largest degree that
    divides both its data-parallel ranks and the experts (it saves the most memory; the all-to-all's share
    (ep-1)/ep barely grows with it). None for a dense model or a layout it does not apply to."""
    if not spec.is_moe or layout.dp == 1:
        return []
    ep = math.gcd(layout.dp, spec.num_experts)
    variant = expert_parallel(layout, ep) if ep > 1 else None
    return [variant] if variant is not None and not check_layout(spec, variant) else []


def with_engine(layout: Layout, engine: str) -> Layout:
    """The same layout run by `engine` (`ENGINES`). Expert parallelism is sized one way."""
    if layout.ep > 1:
        return layout
    cls = {"fsdp2": Fsdp2Layout, "megatron": MegatronLayout}.get(engine, Layout)
    return cls(**{f.name: getattr(layout, f.name) for f in dataclasses.fields(layout)})


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
    """The first pipeline stage's share (ceil(L / p) layers, the most of any stage) of a tensor shard; it
    still counts the embedding and the head, which `pipeline_phases` places on the end stages."""
    return stage_spec(tensor_shard(spec, layout.tp), spec.num_layers, layout.pp, 0)


@lru_cache(maxsize=4096)
def tensor_shard(spec: ModelSpec, t: int) -> ModelSpec:
    """One tensor-parallel rank's part of every layer. Experts split their width like the MLP (transformers'
    tp_plan: packed_colwise gate_up, rowwise down)."""
    if t == 1:
        return spec
    return dataclasses.replace(
        spec, num_heads=spec.num_heads // t, num_kv_heads=max(spec.num_kv_heads // t, 1),
        intermediate_size=-(-spec.intermediate_size // t), vocab_size=-(-spec.vocab_size // t),
        moe_intermediate_size=-(-spec.moe_intermediate_size // t),
        shared_expert_intermediate_size=-(-spec.shared_expert_intermediate_size // t), name=spec.name)


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
    return problems + expert_parallel_problems(spec, layout)


IN_BACKWARD_ONE_GPU = ("--optimizer-in-backward is sized on one GPU without sharding or offload (DDP and ZeRO "
                       "reduce whole gradients in buckets before any step): drop --gpus, --sharding and --offload, "
                       "or drop --optimizer-in-backward")


def make_layout(spec: ModelSpec, w: Workload, *, gpus: int = 1, tp: int = 1, pp: int = 1, sharding: str | None = None,
                offload: str = "none", pp_schedule: str = "1f1b", engine: str = "deepspeed", ep: int = 1) -> Layout:
    """The layout of `llamem estimate --gpus/--tp/--pp/--sharding/--offload/--engine/--ep`, checked; every
    problem is reported at once, each with the flag to change."""
    if min(gpus, tp, pp) < 1 or max(gpus, tp, pp) > MAX_GPUS:
        raise InvalidWorkload([f"--gpus, --tp and --pp must be from 1 to {MAX_GPUS:,}"])
    problems = [] if 1 <= ep <= MAX_GPUS else [f"--ep must be from 1 to {MAX_GPUS:,}"]
    if gpus % (tp * pp):
        problems.append(f"--gpus {gpus} is not a multiple of --tp {tp} x --pp {pp}")
    if pp_schedule != "1f1b" and pp == 1:
        problems.append(f"--pp-schedule {pp_schedule} needs pipeline parallelism: add --pp N (N > 1)")
    if sharding in ("zero1", "zero2") and not w.is_training:
        problems.append(f"--sharding {sharding} shards gradients and optimizer state, which generation does not "
                        "have: use --sharding zero3 (frozen weights sharded), ddp (replicas) or none")
    if engine not in ENGINES:
        problems.append(f"--engine {engine}: choose one of {', '.join(ENGINES)}")
    elif engine == "fsdp2":
        problems += fsdp2_problems(w, tp=tp, pp=pp, sharding=sharding, offload=offload)
    elif engine == "megatron":
        problems += megatron_layout_problems(w, sharding=sharding, offload=offload, ep=ep)
    if w.optimizer_in_backward and (gpus > 1 or sharding not in (None, "none") or offload != "none"):
        problems.append(IN_BACKWARD_ONE_GPU)
    if problems:
        raise InvalidWorkload(problems)
    dp = gpus // (tp * pp)
    sharding = sharding or ("ddp" if dp > 1 else "none")
    # Under pipeline parallelism the accumulation steps are the pipeline's micro-batches.
    layout = Layout(dp=dp, tp=tp, pp=pp, sharding=sharding, offload=offload, pipeline_schedule=pp_schedule,
                    microbatches=w.grad_accum if pp > 1 else 1)
    if ep != 1:
        layout = expert_parallel(layout, ep)
    problems = check_layout(spec, layout) + placement_problems(w, dp)
    problems += (["--ep with --engine fsdp2: expert parallelism is sized with DeepSpeed's accounting; drop "
                  "--engine fsdp2"] if ep != 1 and engine == "fsdp2" else [])
    if problems:
        raise InvalidWorkload(problems)
    return with_engine(layout, engine) if engine != "deepspeed" else layout


def megatron_layout_problems(w: Workload, *, sharding: str | None, offload: str, ep: int) -> list[str]:
    """What `--engine megatron` cannot size, each with the flag to change."""
    problems = megatron_problems(w)
    if sharding not in (None, "none", "ddp", "zero1") or offload != "none":
        problems.append("--engine megatron sizes data parallel (--sharding ddp) and its distributed optimizer "
                        "(--sharding zero1), without offload: change --sharding / drop --offload, or drop --engine "
                        "megatron")
    if ep != 1:
        problems.append("--engine megatron does not size expert parallelism: drop --ep, or drop --engine megatron")
    return problems


def fsdp2_problems(w: Workload, *, tp: int, pp: int, sharding: str | None, offload: str) -> list[str]:
    """What `--engine fsdp2` cannot size (yet), each with the flag to change."""
    problems = []
    if sharding != "zero3":
        problems.append("--engine fsdp2 sizes ZeRO-3 as torch FSDP2 runs it: add --sharding zero3, or drop "
                        "--engine fsdp2 (ZeRO-1/2 and DDP are sized as DeepSpeed and torch run them)")
    if tp > 1 or pp > 1:
        problems.append("--engine fsdp2 sizes data parallelism alone: drop --tp and --pp, or drop --engine fsdp2")
    if offload != "none":
        problems.append("--engine fsdp2 sizes no offload: drop --offload, or drop --engine fsdp2 (DeepSpeed's "
                        "ZeRO-Offload)")
    if w.task not in ("train", "distill"):
        # (distillation is full fine-tuning of the student, beside its frozen teacher)
        problems.append(f"--engine fsdp2 sizes full fine-tuning (--task train) for now: drop --engine fsdp2 for "
                        f"--task {w.task}")
    if w.optimizer not in ("adamw", "adamw-fused", "sgd"):
        problems.append(f"--engine fsdp2 sizes foreach and fused AdamW and SGD on the shards: use --optimizer "
                        f"adamw-fused, adamw or sgd, or drop --engine fsdp2 for {w.optimizer}")
    return problems


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
    parallelism like the student (its vocabulary is checked before either is split); a distillation's
    teacher not given is loaded by its name, as the analytic engine does."""
    if teacher is None and w.task == "distill":
        teacher = load_model(w.teacher)
    check_teacher(spec, teacher)
    if layout.engine == "fsdp2":
        return fsdp2_phases(spec, w, layout, teacher)
    if layout.pp > 1 and w.is_training:
        return pipeline_phases(spec, w, layout, teacher)[1]
    local = shard_spec(spec, layout)
    local_teacher = shard_spec(teacher, layout) if teacher is not None else None
    phases = apply_data_parallel(local_phases(local, w, layout, local_teacher), local, w, layout, local_teacher)
    if runs_loss_parallel(w, layout):  # the loss on the vocabulary shards, as torch's `loss_parallel` runs it
        size_loss_parallel(phases, local, w)
    add_whole_embedding_gradient(phases, spec, w, layout)
    return transformers_ep_phases(expert_parallel_phases(phases, local, w, layout), phases, local, w, layout)


def add_whole_embedding_gradient(phases: dict[str, dict[str, int]], spec: ModelSpec, w: Workload,
                                 layout: Layout) -> None:
    """torch's tensor parallel splits the embedding over the vocabulary, but DTensor has no vocabulary-split
    strategy for its backward (torch 2.13 `embedding_dense_backward_strategy`): every rank computes the
    whole V x h gradient, and its shard is a view of it, alive from the embedding's backward (the end of
    backward) to `zero_grad` (through every micro-batch under accumulation). Measured on 2 CPU ranks of
    the tensor-parallel bundle: the rank's peak in the optimizer step, 4.5 % above the estimate without it; on
    a pipeline, the first stage's (the tp x pp bundle's first stage peaks in the first micro-batch's backward
    with it, 1.5 % above the estimate without it)."""
    if layout.tp == 1 or not trains_base_weights(w) or spec.tie_word_embeddings \
            or layout.sharding not in ("none", "ddp") or layout.engine == "megatron":  # its own embedding
        return
    grad_bytes = DTYPE_BYTES[w.weight_dtype]
    shard = r512(grad_bytes * -(-spec.vocab_size // layout.tp) * spec.hidden_size)
    extra = r512(grad_bytes * spec.vocab_size * spec.hidden_size) - shard
    for name in ("forward", "backward", "optimizer") if w.grad_accum > 1 else ("optimizer",):
        if name in phases:
            phases[name]["gradients"] = phases[name].get("gradients", 0) + extra


def check_teacher(spec: ModelSpec, teacher: ModelSpec | None) -> None:
    from llamem.analytic.engine import check_teacher as check

    check(spec, teacher)


def local_phases(local: ModelSpec, w: Workload, layout: Layout,
                 teacher: ModelSpec | None = None) -> dict[str, dict[str, int]]:
    """One GPU's share under tensor parallelism, before data-parallel sharding (a pipeline stage's
    micro-batches in flight are added by `pipeline_stage_phases`)."""
    return {name: dict(b) for name, b in _estimate_phases(local, w, teacher)}


@lru_cache(maxsize=1024)
def _estimate_phases(local: ModelSpec, w: Workload, teacher: ModelSpec | None) -> tuple:
    """The analytic phases, kept: a pipeline's stages and its tied / untied variants share most of them."""
    return tuple((name, tuple(b.items())) for name, b in estimate(local, w, teacher).phases.items())


def pipeline_phases(spec: ModelSpec, w: Workload, layout: Layout,
                    teacher: ModelSpec | None = None) -> tuple[int, dict[str, dict[str, int]]]:
    """The busiest pipeline stage and its phases (of the stages that can be the busiest: `stage_positions`)."""
    vocab = _vocab_state(spec, w, layout, teacher)  # the same for every stage: sized once
    sized = [(stage, pipeline_stage_phases(spec, w, layout, stage, teacher, vocab))
             for stage in stage_positions(layout.pp)]
    return max(sized, key=lambda item: max(sum(b.values()) for b in item[1].values()))


def _vocab_state(spec: ModelSpec, w: Workload, layout: Layout,
                 teacher: ModelSpec | None) -> dict[str, dict[str, int]]:
    """One vocabulary x hidden tensor's state per phase on this layout's GPUs (`vocab_state`)."""
    local_teacher = shard_spec(teacher, layout) if teacher is not None else None
    first = stage_spec(tensor_shard(spec, layout.tp), spec.num_layers, layout.pp, 0)
    return vocab_state(lambda local: apply_data_parallel(local_phases(local, w, layout, local_teacher), local, w,
                                                         layout, local_teacher), first)


def pipeline_stage_phases(spec: ModelSpec, w: Workload, layout: Layout, stage: int,
                          teacher: ModelSpec | None = None,
                          vocab: dict[str, dict[str, int]] | None = None) -> dict[str, dict[str, int]]:
    """Pipeline stage `stage` sized as it is (`llamem.pipeline_stages`): its layers, the embedding on the
    first, the head and the loss on the last, its micro-batches in flight, its receive buffers and kept
    outputs. A teacher is held as the first stage's share of it on every stage. `vocab`: `_vocab_state`."""
    whole, num_layers, stages = tensor_shard(spec, layout.tp), spec.num_layers, layout.pp
    local_teacher = shard_spec(teacher, layout) if teacher is not None else None

    def on_gpu(local: ModelSpec) -> dict[str, dict[str, int]]:
        return apply_data_parallel(local_phases(local, w, layout, local_teacher), local, w, layout, local_teacher)

    vocab = vocab if vocab is not None else _vocab_state(spec, w, layout, teacher)
    local = stage_spec(whole, num_layers, stages, stage)
    phases, first, last = on_gpu(local), stage == 0, stage == stages - 1
    if last and runs_loss_parallel(w, layout):  # the stage keeps its output, the logits, through the loss
        size_loss_parallel(phases, local, w, output_kept=True)
    trim_stage(phases, vocab, local, w, first=first, last=last)
    flight = in_flight(stage, stages, layout.microbatches, layout.pipeline_schedule)
    if w.is_training:
        if first:  # with the step's gradients, which the micro-batches in flight may not have yet
            add_whole_embedding_gradient(phases, spec, w, layout)
        schedule_in_flight(phases, flight, layout.microbatches,
                           gradients_kept=layout.sharding != "none" or layout.engine == "megatron",
                           loss_saved_bytes=last_stage_loss_saved_bytes(local, w, last))
        add_pipeline_buffers(phases, local, w, first=first, last=last, microbatches=layout.microbatches,
                             flight=flight)
    return transformers_ep_phases(expert_parallel_phases(phases, local, w, layout), phases, local, w, layout)


def apply_data_parallel(phases: dict[str, dict[str, int]], local: ModelSpec, w: Workload,
                        layout: Layout, teacher: ModelSpec | None = None) -> dict[str, dict[str, int]]:
    """Replace model states by their data-parallel (ZeRO / DDP) form; returns new dicts."""
    phases = {name: dict(b) for name, b in phases.items()}
    if layout.engine == "megatron" and w.is_training:
        megatron_phases(phases, local, w, layout)
    elif w.is_training and layout.sharding in ("zero1", "zero2", "zero3") and w.task in ("train", "distill"):
        states = model_state_bytes(local, w, layout, local.num_params)
        for name, breakdown in phases.items():
            kept = {k: v for k, v in breakdown.items()
                    if not k.startswith(("weights", "gradients", "optimizer")) or k == "weights/teacher"}
            if name == "optimizer":
                # DeepSpeed steps a flat fp32 partition with a fused Adam (or on the host when
                # offloading): no per-parameter temporaries on the GPU.
                kept.pop("temporaries", None)
            phases[name] = {**kept, **{k: v for k, v in zero_phase_states(states, name, local, w, layout).items() if v}}
            if name == "backward" and zero1_reduces_at_the_end(w, layout):
                phases[name] = zero1_backward(phases[name], breakdown.get("gradients", 0), local, w)
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
    if teacher is not None:
        place_teacher(phases, teacher, w, layout)
    return phases


def zero_phase_states(states: dict[str, int], phase: str, local: ModelSpec, w: Workload,
                      layout: Layout) -> dict[str, int]:
    """A phase's model states under DeepSpeed ZeRO-1/2 without offload (stage_1_and_2.py, as
    `llamem.analytic.schedule_deepspeed` replays it; the large allocations of the 2-rank CPU bundle's trace
    in the same sizes and order). Gradients live from backward to the step: with one micro-batch a step and
    no pipeline, none at load or in forward (the ZeRO-2 distillation bundle, which peaks in forward with its
    teacher's logits, was 7 % below an estimate that kept them). Backward holds the 16-bit gradients (all of
    them to its end under ZeRO-1, each unit's until reduced under ZeRO-2), the partition's 16-bit
    `grads_in_partition` and the reduce bucket (the emitted reduce_bucket_size, h x h elements); the fp32
    gradient partition exists in the step only, beside `grads_in_partition` and its 16-bit concatenation,
    which it is cast from. On llama-3.1-8b, ZeRO-2 on 2 GPUs, 2 x 1024 tokens: the peak moves from backward
    (97.52 GiB, with the fp32 partition) to the step (89.75 GiB; the rank's schedule peaks at 89.78 GiB)."""
    if layout.sharding not in ("zero1", "zero2") or layout.offload != "none" or layout.pp > 1:
        return states
    P, n, half = local.num_params, layout.dp, DTYPE_BYTES[w.compute_dtype]
    partition = half * P // n
    unreduced = half * P if layout.sharding == "zero1" else 0
    if phase == "load" or (phase == "forward" and w.grad_accum == 1):
        kept = {}
    elif phase in ("forward", "backward") and w.grad_accum > 1:  # a later micro-batch's
        kept = {"gradients": accumulated_zero_gradients(phase, local, w, layout)}
    elif phase == "backward":
        kept = {"gradients": unreduced + partition + reduce_bucket_bytes(local, w)}
    else:
        kept = {"gradients": 2 * partition + 4 * P // n}
    fp32_gradients = 4 * P // n if layout.sharding == "zero1" else 0  # ZeRO-1's accounting has it with the state
    others = {k: v for k, v in states.items() if k != "gradients"}
    return {**others, **kept, "optimizer": states["optimizer"] - fp32_gradients}


def reduce_bucket_bytes(local: ModelSpec, w: Workload) -> int:
    """DeepSpeed's contiguous-gradients reduce bucket: the emitted reduce_bucket_size (h x h elements), 16-bit."""
    return DTYPE_BYTES[w.compute_dtype] * local.hidden_size ** 2


def accumulated_zero_gradients(phase: str, local: ModelSpec, w: Workload, layout: Layout) -> int:
    """The 16-bit gradients of a later micro-batch's forward or backward (at the worst moment of its activations)
    under ZeRO-1/2 with accumulation (deepspeed 0.19.8 stage_1_and_2.py, contiguous gradients, overlap_comm off; as
    `llamem.analytic.schedule_deepspeed` replays it and the 2-rank CPU bundle's trace has it). ZeRO-1 reduces at
    the boundary only: every gradient of the first micro-batch (`param.grad`, which autograd accumulates into) and
    the reduce bucket its first hook made live through the later ones, and the boundary's reduction makes
    `grads_in_partition` at the end of backward beside them (`zero1_backward` keeps the larger moment). ZeRO-2
    reduces in every backward: the first micro-batch's `grads_in_partition` lives to the step (the later ones are
    added into it); a later backward makes its bucket at its first hook and its own `grads_in_partition` once its
    reduction reaches the partition, past the loss, freed at its end: below the step's (the first's, its
    concatenation and the fp32 gradient)."""
    P, n, half = local.num_params, layout.dp, DTYPE_BYTES[w.compute_dtype]
    partition, bucket = half * P // n, reduce_bucket_bytes(local, w)
    if layout.sharding == "zero1":
        return half * P + bucket + (partition if phase == "backward" else 0)
    return partition + (bucket if phase == "backward" else 0)


def megatron_phases(phases: dict[str, dict[str, int]], local: ModelSpec, w: Workload, layout: Layout) -> None:
    """Megatron-LM's model states (`llamem.megatron`) in place of the single GPU's: its gradient buffer and the
    optimizer's main weights exist from the wrap on and Adam's moments from the first step on, so every phase
    holds them but load, which holds the 16-bit weights as the single GPU holds its own. Its fused Adam steps
    the main weights without temporaries."""
    states = megatron_state_bytes(w, local.num_params, layout.dp, distributed=layout.sharding == "zero1")
    for name, breakdown in phases.items():
        kept = {k: v for k, v in breakdown.items() if not k.startswith(("weights", "gradients", "optimizer"))
                and not (name == "optimizer" and k == "temporaries")}
        phases[name] = {**kept, **(states if name != "load" else {"weights": states["weights"]})}


def zero1_reduces_at_the_end(w: Workload, layout: Layout) -> bool:
    """ZeRO-1 without offload or pipeline: every 16-bit gradient is kept from its hook to the end of the step's
    last backward, where `reduce_gradients` makes the partition and reduces into it."""
    return (layout.sharding == "zero1" and layout.offload == "none" and layout.pp == 1
            and w.task in ("train", "distill"))


def zero1_backward(end: dict[str, int], alive_bytes: int, local: ModelSpec, w: Workload) -> dict[str, int]:
    """ZeRO-1's backward phase: the larger of its two worst moments, not their sum. `end`: the boundary's end
    of backward as `zero_phase_states` has it (every 16-bit gradient, the bucket, the partition the reduction
    makes) beside the worst moment's activations, which are gone by then: only the inputs and a teacher's weights
    stay. The other, the worst moment itself, without the partition: with one micro-batch a step the gradients
    alive then (`alive_bytes`, in the weights' dtype; single-GPU's), 16-bit, and, once one exists, the bucket
    the first gradient hook made; with accumulation every gradient and the bucket, which the first micro-batch
    left. On llama-3.1-8b, 2 GPUs, 2 x 1024 tokens: backward 82.30 GiB (was 97.55), below the step's 89.75 (the
    rank's schedule peaks at 89.78 GiB, in the step)."""
    half, weight = DTYPE_BYTES[w.compute_dtype], DTYPE_BYTES[w.weight_dtype]
    alive = half * local.num_params if w.grad_accum > 1 else alive_bytes * half // weight
    during = {**end, "gradients": alive + reduce_bucket_bytes(local, w) if alive else 0}
    after = {k: v for k, v in end.items() if k in ("inputs", "weights/teacher")
             or (k.startswith(("weights", "gradients", "optimizer")) and k != "weights/autocast_copies")}
    chosen = max(during, after, key=lambda b: sum(b.values()))
    return {k: v for k, v in chosen.items() if v}


# FSDP2 ----------------------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True, slots=True)
class Fsdp2Unit:
    """One `fully_shard` unit on one rank, each tensor rounded to 512 bytes as the allocator does."""

    shards_bytes: int
    """Its parameters' shards in the storage dtype (one tensor each)."""
    gathered_bytes: int
    """Its unsharded parameters in the param dtype (one tensor each, padded to N shards)."""
    grads_bytes: int
    """Their unsharded gradients, as autograd makes them (param dtype, one tensor each)."""
    last_grad_bytes: int
    """Its last parameter's unsharded gradient, alive through its reduce-scatter."""
    buffer_bytes: int
    """The flat all-gather output (param dtype)."""
    rs_input_bytes: int
    """The flat reduce-scatter input (reduce dtype)."""
    grad_shard_bytes: int
    """The reduce-scatter output, which its sharded gradients are views of (reduce dtype)."""
    tensors: int
    saved_bytes: int = 0
    """Activations of this unit alive at its backward (a checkpointed layer's recomputed set)."""
    kept_bytes: int = 0
    """Activations it keeps from its forward until its backward (a checkpointed layer: its input)."""


def fsdp2_unit(shapes: list[tuple[int, int]], w: Workload, world: int, saved_bytes: int = 0,
               kept_bytes: int = 0) -> Fsdp2Unit:
    """A unit of parameters of (rows, columns) shapes, in FSDP2's parameter order."""
    param, storage = DTYPE_BYTES[w.compute_dtype], DTYPE_BYTES[w.weight_dtype]
    reduce = 4 if w.mixed else storage  # MixedPrecisionPolicy(reduce_dtype=fp32); without one, the gradients'
    numels = [rows * cols for rows, cols in shapes]
    padded = [-(-rows // world) * world * cols for rows, cols in shapes]  # dim 0 padded to N equal shards
    return Fsdp2Unit(shards_bytes=sum(r512(storage * n // world) for n in padded),
                     gathered_bytes=sum(r512(param * n) for n in padded),
                     grads_bytes=sum(r512(param * n) for n in numels), last_grad_bytes=r512(param * numels[-1]),
                     buffer_bytes=r512(param * sum(padded)), rs_input_bytes=r512(reduce * sum(padded)),
                     grad_shard_bytes=r512(reduce * sum(padded) // world), tensors=len(shapes),
                     saved_bytes=saved_bytes, kept_bytes=kept_bytes)


def fsdp2_units(spec: ModelSpec, w: Workload, world: int) -> tuple[list[Fsdp2Unit], Fsdp2Unit | None]:
    """The bundle's units in backward order (the head, the layers from the top, the embedding) and the
    root's own unit when the embedding is tied to the head (gathered from the first forward to the end of
    backward), else None. A layer is saved at its backward (recomputed when checkpointed)."""
    h, compute = spec.hidden_size, with_changes(w, precision=w.compute_dtype)
    layer = fsdp2_layer_shapes(spec)
    layers = []
    for index in reversed(range(spec.num_layers)):
        saved = sum(layer_saved_bytes(spec, compute, index).values())
        kept = stream_bytes(compute, spec) if is_checkpointed(compute, index) else saved
        layers.append(fsdp2_unit(layer, w, world, saved, kept))
    embedding = [(spec.vocab_size, h)]
    if spec.tie_word_embeddings:
        return layers, fsdp2_unit(embedding + [(h, 1)], w, world)
    head_saved = _head_saved_bytes(spec, compute, layers)
    head = fsdp2_unit([(h, 1), (spec.vocab_size, h)], w, world, head_saved, head_saved)
    return [head, *layers, fsdp2_unit(embedding, w, world)], None


def fsdp2_layer_shapes(spec: ModelSpec) -> list[tuple[int, int]]:
    """(rows, columns) of a decoder layer's parameters in FSDP2's order: the projections, then the two norms."""
    h = spec.hidden_size
    return [(fan_out, fan_in) for fan_in, fan_out in spec.layer_linear_shapes().values()] + [(h, 1), (h, 1)]


def fsdp2_unit_shapes(spec: ModelSpec) -> list[list[tuple[int, int]]]:
    """Each unit's parameter shapes in forward order: the embedding, the layers, the final norm with the
    head; a tied embedding stays with the final norm in the root's unit."""
    h, embedding = spec.hidden_size, [(spec.vocab_size, spec.hidden_size)]
    layers = [fsdp2_layer_shapes(spec)] * spec.num_layers
    if spec.tie_word_embeddings:
        return [*layers, embedding + [(h, 1)]]
    return [embedding, *layers, [(h, 1), (spec.vocab_size, h)]]


def _head_saved_bytes(spec: ModelSpec, compute: Workload, layers: list[Fsdp2Unit]) -> int:
    """The final norm's saved tensors and the output lm_head keeps: the backward activations less the
    layers' and the model-level tensors."""
    return training_activations(spec, compute).backward - _model_level_bytes(spec, compute) - sum(
        u.kept_bytes for u in layers)


def _model_level_bytes(spec: ModelSpec, compute: Workload) -> int:
    """RoPE's cos and sin and, with checkpointing, the causal mask: alive through backward."""
    return rope_bytes(spec, compute) + checkpoint_mask_bytes(compute, spec)


def fsdp2_phases(spec: ModelSpec, w: Workload, layout: Layout,
                 teacher: ModelSpec | None = None) -> dict[str, dict[str, int]]:
    """One rank's phases of full fine-tuning under torch FSDP2 as the launch bundle wraps the model
    (`fully_shard` on the embedding, each decoder layer, [final norm, lm_head] and the root;
    `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` for bf16-mixed).

    Terms from torch 2.13's torch/distributed/fsdp/_fully_shard/, per rank of N, for a unit of U
    parameters (each padded along dim 0 to N equal shards), with c, s, r the bytes of the param
    dtype (bf16), the storage dtype (fp32 under bf16-mixed, bf16 in pure bf16) and the reduce dtype
    (fp32 under bf16-mixed, else s):
    - weights: the shards, s U / N (`_fsdp_param.py:305-316`: each rank stores the padded chunk);
      they are the master weights, there is no other copy. Buffers whole.
    - optimizer: AdamW's moments on the shards in s and a step per parameter (SGD: a momentum).
    - gradients: r U / N per unit, the reduce-scatter output (`_fsdp_collectives.py:612`), whose views
      become the sharded gradients (:704, :754; no cast when r = s, :696): each from its unit's
      reduce-scatter in the first backward until `zero_grad`; with accumulation later micro-batches
      add theirs into them (:749), so all of them live through forward and backward.
    - weights/gathered: a unit's all-gather output, c U (`_fsdp_collectives.py:351`), and its
      unsharded parameters copied out of it, c U (:463, `alloc_storage`, `_fsdp_param.py:1066`). In
      forward the output lives until the next unit's copy-out (`_fsdp_param_group.py:483`, :432) or
      the root's post-forward (`_fsdp_state.py:342`): at the loss the head's unit counts twice. In
      backward it is freed after the copy-out (:487) and each unit's pre-backward all-gathers the
      next (:795-830): a unit at work holds its parameters, its gradients (c U, autograd's) and the
      next unit's all-gather output, or at its copy-out its own output and no gradient yet.
    - gradients/reduce_scatter: the input, r U (`_fsdp_collectives.py:597`), kept after the collective
      until the next unit's post-backward (`_fsdp_param_group.py:718`, dropped at :655). At its reduce
      a unit is resharded (`_fsdp_param_group.py:637`) and its gradients released
      (`_fsdp_collectives.py:606`) except the last, which the loop variable of :580 holds (lm_head's
      for the head).
    - activations, logits, inputs: the single-GPU engine's for the compute dtype (the policy casts the
      weights, nothing autocasts); a unit at work also holds all of its saved set with all of its
      gradients (an upper bound of the trade within its backward), the units below theirs.
    Tied embeddings stay in the root's unit, gathered from the first forward to the end of backward
    (`_fsdp_state.py:205-207`), with the tied gradient summed out of place, reduced last.
    Left out: the shard's copy-in in the param dtype (c U / N, `_fsdp_collectives.py:419`, freed when
    the all-gather is issued), the activation gradient between units, the collectives' own buffers
    (NCCL's are outside PyTorch's allocator; gloo on CPU clones a reduce-scatter input).
    Distillation: the teacher where `llamem.teacher_placement` puts it; its logits and KL at the loss.
    """
    units, root = fsdp2_units(spec, w, layout.dp)
    every = units + ([root] if root else [])
    shards = sum(u.shards_bytes for u in every)
    grads = sum(u.grad_shard_bytes for u in every)
    teacher_bytes = {"weights/teacher": whole_teacher_bytes(teacher, w)} if teacher is not None else {}
    loaded = {"weights": shards + rope_buffer_bytes(spec)} | teacher_bytes
    state = {**loaded, **_fsdp2_optimizer_state(w, every)}
    base = {**state, "inputs": r512(8 * w.batch * w.seq)}
    accumulated, compute = (grads if w.grad_accum > 1 else 0), with_changes(w, precision=w.compute_dtype)
    forward, loss_backward = _fsdp2_loss_moments(spec, compute, units, root, {**base, "gradients": accumulated},
                                                 distill=teacher is not None)
    moments = [loss_backward, *_fsdp2_unit_moments(units, root, base, accumulated, _model_level_bytes(spec, compute))]
    if root:
        moments += _fsdp2_root_moments(spec, w, root, base, moments[-1])
    # foreach AdamW's sqrt, one per shard; the fused step works in place
    temporaries = shards if w.optimizer == "adamw" else 0
    phases = {"load": loaded, "forward": forward, "backward": max(moments, key=lambda m: sum(m.values())),
              "optimizer": add_breakdowns(state, {"gradients": grads, "temporaries": temporaries})}
    if teacher is not None:
        place_teacher(phases, teacher, w, layout)
    return phases


def _fsdp2_loss_moments(spec: ModelSpec, compute: Workload, units: list[Fsdp2Unit], root: Fsdp2Unit | None,
                        base: dict[str, int], distill: bool = False) -> tuple[dict[str, int], dict[str, int]]:
    """The forward and the loss backward at the loss: the head's unit gathered (or the root's) with the
    last all-gather output, which the root's post-forward frees; in backward the root's pre-backward
    (at the loss) prefetches the top layer, while the head's comes with its output's gradient, after
    the loss backward."""
    activations, logits = training_activations(spec, compute, distill), training_logits(spec, compute, distill)
    first = root or units[0]
    forward = add_breakdowns(base, {"weights/gathered": first.gathered_bytes + units[0].buffer_bytes,
                          "activations": activations.forward, "logits": logits.forward_peak})
    loss_backward = add_breakdowns(base, {"weights/gathered": first.gathered_bytes + (units[0].buffer_bytes if root else 0),
                                "activations": activations.backward, "logits": logits.backward_peak})
    return forward, loss_backward


def _fsdp2_optimizer_state(w: Workload, units: list[Fsdp2Unit]) -> dict[str, int]:
    shards = sum(u.shards_bytes for u in units)
    if w.optimizer == "sgd":
        return {"optimizer/momentum_buffer": shards}
    return {"optimizer/exp_avg": shards, "optimizer/exp_avg_sq": shards,
            "optimizer/step": 512 * sum(u.tensors for u in units)}


def _fsdp2_unit_moments(units: list[Fsdp2Unit], root: Fsdp2Unit | None, base: dict[str, int], accumulated: int,
                        model_level_bytes: int) -> list[dict[str, int]]:
    """Each unit's copy-out, work and reduce in backward order (fsdp2_phases), and at the end the
    sharded gradients and the reduce-scatter input then alive (the last moment's)."""
    held = {"weights/gathered": root.gathered_bytes, "gradients/unsharded": root.grads_bytes} if root else {}
    done, rs_held = accumulated, 0
    below = model_level_bytes + sum(u.kept_bytes for u in units)
    moments = []
    for index, u in enumerate(units):
        prefetched = units[index + 1].buffer_bytes if index + 1 < len(units) else 0
        below -= u.kept_bytes
        before = add_breakdowns(base, held, {"gradients": done, "gradients/reduce_scatter": rs_held,
                                   "activations": below + u.saved_bytes})
        if index or root:  # the untied head stays gathered from forward: no copy-out
            moments.append(add_breakdowns(before, {"weights/gathered": u.gathered_bytes + u.buffer_bytes}))
        moments.append(add_breakdowns(before, {"weights/gathered": u.gathered_bytes + prefetched,
                                     "gradients/unsharded": u.grads_bytes}))
        moments.append(add_breakdowns(base, held, {"gradients": done + u.grad_shard_bytes, "activations": below,
                                         "gradients/reduce_scatter": u.rs_input_bytes,
                                         "gradients/unsharded": u.last_grad_bytes, "weights/gathered": prefetched}))
        done += 0 if accumulated else u.grad_shard_bytes
        rs_held = u.rs_input_bytes
    moments.append(add_breakdowns(base, {"gradients": done, "gradients/reduce_scatter": rs_held}))
    return moments


def _fsdp2_root_moments(spec: ModelSpec, w: Workload, root: Fsdp2Unit, base: dict[str, int],
                        after_layers: dict[str, int]) -> list[dict[str, int]]:
    """Tied embeddings: the embedding's backward adds its gradient to the head's out of place (three
    V x h gradients for a moment), then the root reduces, its parameters resharded."""
    tied = r512(DTYPE_BYTES[w.compute_dtype] * spec.vocab_size * spec.hidden_size)
    summing = add_breakdowns(after_layers, {"weights/gathered": root.gathered_bytes,
                                  "gradients/unsharded": root.grads_bytes + 2 * tied})
    reduce = add_breakdowns(base, {"gradients": after_layers.get("gradients", 0) + root.grad_shard_bytes,
                         "gradients/reduce_scatter": root.rs_input_bytes,
                         "gradients/unsharded": root.last_grad_bytes})
    return [summing, reduce]


