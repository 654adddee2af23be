"""One DeepSpeed ZeRO-1 or ZeRO-2 rank's own allocation schedule, for its reserved memory (`llamem.device`).

DeepSpeed 0.19.8 under bf16 or fp16 with the launch bundle's ds_config.json (`llamem.bundle.deepspeed`: the stage,
`reduce_bucket_size` = h x h, contiguous gradients and overlap_comm off by default, DeepSpeed's Adam named in the
file), `deepspeed/runtime/engine.py` and `runtime/zero/stage_1_and_2.py`:

- Wrap: the engine casts the parameters to the 16-bit dtype on the host and moves the module (parameters one tensor
  each, RoPE's fp32 buffers kept as they are). `DeepSpeedZeroOptimizer` flattens every parameter into one flat
  16-bit buffer (`flatten_dense_tensors_aligned`: the total padded to 2 x N elements), the parameters becoming
  views of it (their own tensors freed), then makes this rank's fp32 master partition (a 16-bit clone of the
  partition cast to fp32, the clone freed) and, in `initialize_optimizer_states`, a zero fp32 gradient freed at once.
- Backward (no autocast: the activations are the compute dtype's): the first gradient hook of a step makes the
  contiguous-gradients bucket (reduce_bucket_size elements of the 16-bit dtype, `setup_buckets`), freed at the end
  of backward; each gradient is copied into the bucket (or, past the bucket's size, reduced in place) and its own
  tensor freed; the first reduction that reaches a parameter of this rank's partition makes `grads_in_partition`
  (every parameter that overlaps the partition, whole, in the 16-bit dtype), which the step frees. ZeRO-1
  (partition_gradients off, overlap_comm off) makes the bucket at the first hook too, but keeps every gradient
  until the end of backward, where `reduce_gradients` reduces them parameter by parameter in module order.
- Accumulation (gradient_accumulation_steps > 1; the engine divides the loss, `step()` acts at the boundary only):
  ZeRO-2 reduces in every backward, and its epilogue keeps the first micro-batch's `grads_in_partition` to the
  step (`all_grad_tensors`: views of it), lets go of `grads_in_partition` and the bucket, and frees the 16-bit
  gradients; a later micro-batch's first hook makes a new bucket, its reduction a new `grads_in_partition`, which
  its epilogue adds into the first's and frees after the bucket. ZeRO-1 reduces at the boundary only: the bucket
  its first micro-batch's first hook made lives until the boundary's reduction, and so does every gradient
  (autograd adds a later micro-batch's into `param.grad` and frees it at once).
- Step: the gradient norm takes each partition piece's fp64 copy (`get_norm_dtype`) and its norm, one at a time;
  the partition's gradients are concatenated (16-bit) and cast to an fp32 flat gradient (the concatenation freed,
  then `grads_in_partition`); the optimizer steps the fp32 partition (its state made in the first step), the fp32
  gradient is freed, and the 16-bit partition is copied back and all-gathered in place in the flat buffer.

The schedule acts at the points the single-GPU schedule (`llamem.analytic.schedule`) marks, at a unit's
granularity: a unit's gradients are freed at the end of its backward, where DeepSpeed frees each as its hook runs.
Each of the single-GPU schedule's steps is one micro-batch here; a step runs the first micro-batch and the last
(a micro-batch between them allocates and frees as the last does).
Left out, as smaller than a 512-byte block each and freed at once: the loss scaler's scalars, the overflow check's,
the gradient norm's combination, and the all-reduce of the parameter that straddles two partitions (one bucket's
concatenation, freed at once).

CUDA only (`backend="nccl"`, what `llamem estimate` sizes): the parameters arrive already in the 16-bit dtype, and
DeepSpeed's FusedAdam steps the partition without temporaries (its step count an int). CPU only (`backend="gloo"`,
the launch bundle's `--cpu` run): llamem's tracker counts the fp32 parameters the model was built with, each freed
as its 16-bit copy is made, and torch's AdamW (`torch_adam`) steps the one fp32 tensor with its for-loop kernel
(`exp_avg_sq.sqrt()` and its quotient, then freed; its step a 0-d tensor).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Literal

from llamem.allocator.replay import AllocEvent
from llamem.analytic.common import r512
from llamem.analytic.schedule import Events, LiveEvents, optimizer_state_tensors, training_steps
from llamem.analytic.weights import rope_buffer_bytes, trainable_tensor_sizes
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.parallel import Layout
from llamem.workload import Workload, with_changes

Backend = Literal["nccl", "gloo"]
NCCL_START_ALIGNMENT_FACTOR = 2
"""stage_1_and_2.py: the flat buffer is padded to a multiple of 2 x N elements (4-byte alignment in 16 bits)."""
NORM_BYTES = 8
"""`get_norm_dtype`: the gradient norm accumulates in fp64 on devices that have it (CUDA and CPU)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ZeroPartition:
    """One rank's share of the flat 16-bit buffer, in elements."""

    param_numels: tuple[int, ...]
    """Every trainable parameter in module order (the order DeepSpeed flattens them in)."""
    flat_numel: int
    """The flat buffer: the parameters, padded to a multiple of 2 x N."""
    partition_numel: int
    """This rank's slice of it (flat / N)."""
    pieces: tuple[int, ...]
    """The parts of parameters inside the partition, in order (the gradient norm's pieces)."""
    whole_numels: tuple[int, ...]
    """Every parameter that overlaps the partition, whole (`grads_in_partition`)."""
    owned_units: frozenset
    """The units ("embed", layer indices, "head") with a parameter in the partition."""
    padding_numel: int
    """The last rank's zero padding, concatenated to its gradients (`flatten_dense_tensors_aligned`)."""


def unit_param_numels(spec: ModelSpec) -> list[tuple[int | str, int]]:
    """(unit, elements) of each trainable parameter in module order: the embedding, each layer's projections then
    its two norms (`named_parameters`), the final norm and the head (with the head's unit)."""
    h = spec.hidden_size
    layer = [fan_in * fan_out for fan_in, fan_out in spec.layer_linear_shapes().values()] + [h, h]
    out: list[tuple[int | str, int]] = [("embed", spec.embedding_params)]
    out += [(index, numel) for index in range(spec.num_layers) for numel in layer]
    return out + [("head", h), ("head", spec.lm_head_params)]


def zero_partition(spec: ModelSpec, world: int, rank: int) -> ZeroPartition:
    """`rank`'s partition of the flat buffer (`DeepSpeedZeroOptimizer.get_data_parallel_partitions`)."""
    params = unit_param_numels(spec)
    total = sum(numel for _unit, numel in params)
    alignment = NCCL_START_ALIGNMENT_FACTOR * world
    flat = -(-total // alignment) * alignment
    size = flat // world
    start, stop = rank * size, (rank + 1) * size
    pieces, whole, units, offset = [], [], set(), 0
    for unit, numel in params:
        inside = min(offset + numel, stop) - max(offset, start)
        if inside > 0:
            pieces.append(inside)
            whole.append(numel)
            units.add(unit)
        offset += numel
    return ZeroPartition(param_numels=tuple(n for _u, n in params), flat_numel=flat, partition_numel=size,
                         pieces=tuple(pieces), whole_numels=tuple(whole), owned_units=frozenset(units),
                         padding_numel=flat - total if rank == world - 1 else 0)


class ZeroEvents(LiveEvents):
    """A ZeRO-1 or ZeRO-2 rank: the contiguous-gradients bucket, the partition's gradients, the fp32 step (see
    the module). The single-GPU schedule's steps are its micro-batches: `micro_batches` of them make a step."""

    def __init__(self, part: ZeroPartition, w: Workload, bucket_numel: int, stage: int, backend: Backend) -> None:
        super().__init__()
        self.part, self.w, self.stage, self.backend = part, w, stage, backend
        self.half = DTYPE_BYTES[w.compute_dtype]
        self.bucket_bytes = r512(self.half * bucket_numel)
        self.micro_batches, self.micro = micro_batches_per_step(w), 0
        self.unit_grads: dict[int | str, list[int]] = {}
        self.accumulated: dict[int | str, list[int]] = {}
        """ZeRO-1: the 16-bit gradients of the step's first micro-batch, which the later ones accumulate into."""
        self.held: set[int] = set()
        """Those of them the single-GPU schedule frees at the end of the micro-batch (its `zero_grad`): kept."""
        self.bucket: list[int] = []
        self.in_partition: list[int] = []
        self.incoming: list[int] = []
        """ZeRO-2, a later micro-batch: its own `grads_in_partition`, added into the first's."""
        self.reached_partition = False
        """Whether this micro-batch's reduction has reached the partition."""
        self.state_made = False

    def free(self, ids: list[int]) -> None:
        super().free([i for i in ids if i not in self.held])

    def mark(self, point: str, unit: int | str | None = None, grads: list[int] | None = None) -> None:
        if point == "backward_done":
            seen = {g for ids in self.unit_grads.values() for g in ids}
            self.unit_grads[unit] = [g for g in grads or [] if g not in seen]
            if self.unit_grads[unit] and not self.bucket:  # the first hook (ZeRO-1: of the step)
                self.bucket = self.alloc([self.bucket_bytes])
            if self.stage == 2:
                self.reduce(self.unit_grads[unit], unit)
            else:
                self.zero1_backward_done(unit)
            if unit == "embed" and (self.stage == 2 or self.boundary()):
                self.free(self.bucket + self.incoming)
                self.bucket, self.incoming = [], []
        elif point == "zero_grad":
            self.micro_batch_done()

    def boundary(self) -> bool:
        """Whether this micro-batch is the step's last (`is_gradient_accumulation_boundary`)."""
        return self.micro == self.micro_batches - 1

    def zero1_backward_done(self, unit: int | str) -> None:
        """ZeRO-1 (partition_gradients and overlap_comm off) reduces at the boundary only, at the end of backward,
        parameter by parameter in module order; a later micro-batch's gradients are added into the first's (autograd
        accumulates into `param.grad`), each freed at once."""
        if self.micro == 0:
            self.accumulated[unit] = self.unit_grads[unit]
            if not self.boundary():
                self.held.update(self.unit_grads[unit])
        else:
            self.free(self.unit_grads[unit])
        if unit == "embed" and self.boundary():
            self.held.clear()
            for each in ("embed", *sorted(u for u in self.accumulated if isinstance(u, int)), "head"):
                self.reduce(self.accumulated[each], each)
            self.accumulated.clear()

    def reduce(self, grads: list[int], unit: int | str) -> None:
        """A unit's gradients reduced: `grads_in_partition` made at the first that reaches the partition (in each
        micro-batch: a later one's is added into the first's and freed at the end of its backward), each gradient
        freed once copied there or into the bucket."""
        if unit in self.part.owned_units and not self.reached_partition:
            self.reached_partition = True
            made = self.alloc([r512(self.half * sum(self.part.whole_numels))])
            if self.in_partition:
                self.incoming = made
            else:
                self.in_partition = made
        self.free(grads)

    def micro_batch_done(self) -> None:
        """The end of a micro-batch (`zero_grad` in the single-GPU schedule): the step at the boundary."""
        if self.boundary():
            self.step()
            self.micro = 0
        else:
            self.micro += 1
        self.unit_grads.clear()
        self.reached_partition = False

    def step(self) -> None:
        """The norm's fp64 pieces, the fp32 flat gradient, the optimizer on the fp32 partition (see the module)."""
        part, fp32 = self.part, r512(4 * self.part.partition_numel)
        norms = []
        for numel in part.pieces:  # each piece's fp64 copy and its norm
            copy = self.alloc([r512(NORM_BYTES * numel)])
            norms += self.alloc([512])
            self.free(copy)
        self.free(norms)
        padding = self.alloc([r512(self.half * part.padding_numel)]) if part.padding_numel else []
        flat = self.alloc([r512(self.half * part.partition_numel)])
        self.free(padding)
        grad = self.alloc([fp32])
        self.free(flat + self.in_partition)
        self.in_partition = []
        if not self.state_made:
            self.alloc(self.state_tensors(fp32))
            self.state_made = True
        if self.backend == "gloo" and self.w.optimizer != "sgd":  # torch AdamW's for-loop kernel
            root, denom = self.alloc([fp32, fp32])
            self.free([root, denom])
        self.free(grad)

    def state_tensors(self, fp32: int) -> list[int]:
        """The optimizer's state on the fp32 partition: FusedAdam's without a step tensor on CUDA."""
        state = optimizer_state_tensors(self.w, [self.part.partition_numel], [fp32])
        return state[1:] if self.backend == "nccl" and state[:1] == [512] else state


def cast_parameters(ev: Events, spec: ModelSpec, numels: list[int], half_bytes: int, backend: Backend) -> list[int]:
    """The DeepSpeed engine's cast and move of every parameter (in module order) to the 16-bit dtype: their ids.
    RoPE's fp32 buffers move as they are."""
    sizes = [r512(half_bytes * numel) for numel in numels]
    rope = [rope_buffer_bytes(spec) // 2] * 2
    if backend == "gloo":  # the fp32 model as the tracker counts it, then each parameter's 16-bit copy
        originals = ev.alloc([r512(4 * numel) for numel in numels] + rope)[:len(sizes)]
        params = []
        for size, original in zip(sizes, originals):
            params += ev.alloc([size])
            ev.free([original])
        return params
    # Moved already cast, module by module: RoPE's buffers after the final norm, before the head.
    params = ev.alloc(sizes[:-1] + rope + sizes[-1:])
    return params[:-3] + params[-1:]


def wrap(ev: Events, spec: ModelSpec, w: Workload, part: ZeroPartition, backend: Backend) -> None:
    """The engine's cast and move, the flat buffer, the fp32 master partition (see the module)."""
    half = DTYPE_BYTES[w.compute_dtype]
    params = cast_parameters(ev, spec, part.param_numels, half, backend)
    padding = part.flat_numel - sum(part.param_numels)
    pad = ev.alloc([r512(half * padding)]) if padding else []
    ev.alloc([r512(half * part.flat_numel)])
    ev.free(pad + params)
    clone = ev.alloc([r512(half * part.partition_numel)])
    ev.alloc([r512(4 * part.partition_numel)])  # the fp32 master partition
    ev.free(clone)
    ev.free(ev.alloc([r512(4 * part.partition_numel)]))  # initialize_optimizer_states' zero gradient


def zero_schedule(spec: ModelSpec, w: Workload, world: int, bucket_numel: int, *, stage: int, rank: int = 0,
                  backend: Backend = "nccl") -> list[AllocEvent]:
    """Rank `rank` of `world` under ZeRO-`stage` (1 or 2) with a reduce bucket of `bucket_numel` elements: two
    training steps, each of `micro_batches_per_step` micro-batches."""
    part = zero_partition(spec, world, rank)
    ev = ZeroEvents(part, w, bucket_numel, stage, backend)
    wrap(ev, spec, w, part, backend)
    compute = with_changes(w, precision=w.compute_dtype)
    grads = trainable_tensor_sizes(spec, compute)  # [embedding, layers..., final norm, lm_head]
    for _pair in range(ev.micro_batches):  # the single-GPU schedule's two steps are two micro-batches here
        training_steps(spec, compute, ev, grads[-2:], grads[:1], [], [])
    return ev.events


def micro_batches_per_step(w: Workload) -> int:
    """The micro-batches a step of the schedule runs: the first and the last (the boundary). A micro-batch between
    them allocates and frees as the last does, short of the step."""
    return min(w.grad_accum, 2)


def zero_rank_schedule(spec: ModelSpec, w: Workload, layout: Layout, backend: Backend = "nccl") -> list[AllocEvent]:
    """The busiest rank of a zero1 / zero2 `layout` (the most `grads_in_partition`: parameters straddling its
    partition's edges count whole) with the emitted ds_config.json's reduce_bucket_size."""
    return zero_schedule(spec, w, layout.dp, reduce_bucket_numel(spec, w, layout), stage=int(layout.sharding[-1]),
                         rank=busiest_rank(spec, layout.dp), backend=backend)


@lru_cache(maxsize=64)
def busiest_rank(spec: ModelSpec, world: int) -> int:
    """The rank with the largest `grads_in_partition` (the first of them), the same for every probe of a plan."""
    return max(range(world), key=lambda rank: sum(zero_partition(spec, world, rank).whole_numels))


def reduce_bucket_numel(spec: ModelSpec, w: Workload, layout: Layout) -> int:
    """The emitted ds_config.json's reduce_bucket_size (`llamem.bundle.deepspeed`)."""
    from llamem.bundle.deepspeed import ds_config

    return ds_config(w, layout, spec.hidden_size)["zero_optimization"]["reduce_bucket_size"]
