"""One data-parallel rank's own allocation schedule, for its reserved memory (`llamem.device`).

The single-GPU schedule (`llamem.analytic.schedule`) walks a training step op by op and marks the
points where a data-parallel engine acts (`Events.mark`). A rank's events act there:

- DDP (`torch/nn/parallel/distributed.py`, torch 2.13, the launch bundle's defaults): at wrap time
  `_sync_module_states` broadcasts every parameter (frozen ones too) and then the buffers (RoPE's) through
  `broadcast_coalesced`'s flat copies (torch/csrc/distributed/c10d/comm.cpp: one bucket per dtype closing once it
  reaches 250 MiB, in order of their first tensor, at most two copies in flight), and before each forward the
  buffers again (forward_sync_buffers); then the reducer allocates its gradient buckets, one flat
  tensor per bucket (gradient_as_bucket_view=False: autograd's gradients are copied into them and back).
  The first buckets hold every parameter in one (`compute_bucket_size_limits`: no bucketing before the
  first step unless find_unused_parameters); at the second step's forward the reducer rebuilds them in
  the order the gradients became ready (about reverse parameter order), a bucket closing once it reaches
  1 MiB for the first (`_DEFAULT_FIRST_BUCKET_BYTES`) and 25 MiB (bucket_cap_mb) for the others, the
  old ones freed first. The all-reduce works in place.
  LoRA (peft's adapters, made before the wrap): the buckets hold the parameters that require a gradient, the
  adapters (fp32, as peft keeps them).
- FSDP2 ZeRO-3 (`fully_shard` on the embedding, each decoder layer and [final norm, lm_head], with
  `MixedPrecisionPolicy(param_dtype=compute dtype, reduce_dtype=fp32)` under a mixed precision; torch
  2.13 `_fully_shard/_fsdp_param_group.py`, `_fsdp_collectives.py`): the rank holds its padded fp32
  shards (one tensor per parameter) and the optimizer state on them; the step's activations are the
  compute dtype's (no autocast). Per unit in forward: the all-gather's flat input (the shards cast to
  the param dtype, freed once the collective is issued) and flat output, then the unsharded parameters
  copied out of it (one tensor each), the previous unit's output freed at that copy-out; after the
  unit's forward its parameters are freed (resharded), except the head's (reshard_after_forward=False),
  whose output the root's post-forward frees. In backward each unit's pre-backward copies its
  parameters out of the prefetched output, frees it and all-gathers the next unit's; its post-backward
  reshards, frees the previous reduce-scatter input, makes its own (fp32, flat), releases its unsharded
  gradients but the last (the loop variable holds it) and makes the reduce-scatter output, whose views
  are the sharded gradients until `zero_grad`.
  Tied embeddings: the embedding (the head's weight) and the final norm stay in the root's own unit, gathered
  from the root's pre-forward to the end of backward (no reshard after the root's forward); the root's
  pre-backward, at the loss, prefetches the top layer; autograd keeps the head's share of the tied gradient
  until the embedding's backward adds its own out of place, and the root reduces last.
  Accumulation: every micro-batch's backward reduce-scatters (the bundle never turns gradient sync off): the
  first into the sharded gradients, each later one into an output added to them (`_fsdp_collectives.py`
  `foreach_reduce`) and let go; the optimizer steps after the last. Past the second, a micro-batch allocates
  as the second does: the schedule replays two a step (`FSDP2_MICROBATCHES`).

CUDA only (`backend="nccl"`, what `llamem estimate` sizes): FSDP2 allocates an all-gather's input and
output in its all-gather copy-in stream and the reduce-scatter output in its reduce-scatter stream
(`_fsdp_collectives.py` `foreach_all_gather`, `foreach_reduce`; `get_all_gather_streams` in
`_fsdp_param_group.py`), and the caching allocator caches blocks per stream, so those buffers never
share a segment with the default stream's tensors: the schedule allocates them on streams 1 and 2.
NCCL's own buffers are outside PyTorch's allocator (`llamem.overhead`'s non-torch bytes count them);
DDP's all-reduce works in place in its buckets.
CPU only (`backend="gloo"`, the schedule of the launch bundle's `--cpu` run): one stream, and gloo
reduces a copy of each reduce-scatter input, which its worker thread lets go of before the next unit's
all-gather or, in some runs, just after it (then up to one unit's all-gather above the schedule's peak).

- Tensor parallel (`parallelize_module` with torchtitan's plan, the launch bundle's; `spec` is the rank's
  share, `llamem.parallel.shard_spec`): the single-GPU schedule of the share, where the functional
  all-reduce (`_functional_collectives.all_reduce`, a new tensor; the partial one freed at once) replaces
  each row-parallel output in forward (o_proj, down_proj, the vocabulary-split embedding) and each
  column-parallel input's gradient in backward (q, k, v, gate, up, lm_head: each reduced on its own, by
  `DTensor.from_local`'s backward, before they are summed); DTensor computes the embedding's gradient for
  the whole vocabulary (no vocabulary-sharded strategy for `embedding_dense_backward`), alive until
  `zero_grad` (V rounded up to a multiple of tp); the loss on the vocabulary shards as torch's `loss_parallel`
  runs it (`llamem.analytic.loss_parallel.LossParallelEvents`). With data-parallel replicas, DDP's buckets on
  the shards too (not run by the bundle, which emits no 2-D meshes).

- DeepSpeed ZeRO-1 and ZeRO-2 (the launch bundle's ds_config.json, bf16): `llamem.analytic.schedule_deepspeed`.
- DeepSpeed ZeRO-3 (the same, bf16, any accumulation, no checkpointing or every layer's): the coordinator's gathers,
  prefetches and kept parameters, the reduce bucket, the fp32 step (`llamem.analytic.schedule_zero3`).

- Pipeline parallel (`torch.distributed.pipelining`, one stage per GPU, the launch bundle's): each stage's
  own schedule, its micro-batches in 1F1B or GPipe order (`llamem.analytic.schedule_pipeline`).

Other layouts (pipeline stages beyond what `schedule_pipeline.pipeline_schedulable` covers, expert
parallelism, offload, adapters (but LoRA of a dense model under DDP), distillation,
Megatron-LM; tensor parallel with tied embeddings,
experts or the chunked loss; under FSDP2 experts and the chunked loss; under ZeRO-1/2 also tied embeddings,
experts, the chunked loss, fp16 and fp32; under DeepSpeed's ZeRO-3 also gradient accumulation, activation
checkpointing, biases or q/k norms, and optimizers other than AdamW) replay the single-GPU schedule of the GPU's share
(`rank_schedule_kind` says which; the report's notes say so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llamem.allocator.replay import AllocEvent
from llamem.analytic.common import r512
from llamem.analytic.loss_parallel import LossParallelEvents, runs_loss_parallel
from llamem.analytic.moe_lora import lora_linear_targets
from llamem.analytic.optimizer import has_step_temporaries
from llamem.analytic.schedule import (Events, LiveEvents, optimizer_state_tensors, training_schedule,
                                     training_steps)
from llamem.analytic.schedule_deepspeed import zero_rank_schedule
from llamem.analytic.schedule_pipeline import pipeline_schedulable, pipeline_stage_schedule
from llamem.analytic.schedule_zero3 import zero3_rank_schedule, zero3_schedulable
from llamem.analytic.weights import adapter_dtype, rope_buffer_bytes, trainable_numels, trainable_tensor_sizes
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.parallel import Layout, fsdp2_layer_shapes
from llamem.workload import Workload, with_changes

Backend = Literal["nccl", "gloo"]
"""Where the rank runs: on CUDA with NCCL (FSDP2's buffers on its own streams, NCCL's outside PyTorch's
allocator), or on CPU with gloo (one stream, gloo's copy of each reduce-scatter input)."""
ALL_GATHER_STREAM = 1
"""FSDP2's all-gather copy-in stream: the all-gather's input and output are allocated there."""
REDUCE_SCATTER_STREAM = 2
"""FSDP2's reduce-scatter stream: the reduce-scatter output (the sharded gradients) is allocated there."""
DDP_FIRST_BUCKET_BYTES = 1 << 20
"""torch.distributed._DEFAULT_FIRST_BUCKET_BYTES: the first rebuilt bucket's limit."""
DDP_BUCKET_BYTES = 25 << 20
"""DistributedDataParallel's bucket_cap_mb=25."""
BROADCAST_BUFFER_BYTES = 250 << 20
"""DistributedDataParallel's broadcast_bucket_size: the limit of `_sync_module_states`' flat copies."""


def rank_schedule_kind(spec: ModelSpec, w: Workload, layout: Layout) -> str | None:
    """"ddp", "fsdp2", "tp", "zero1" or "zero2" (`llamem.analytic.schedule_deepspeed`), "zero3"
    (`llamem.analytic.schedule_zero3`) or "pipeline" where a rank's own schedule is built, None where the GPU's
    share replays the single-GPU schedule."""
    if layout.engine == "megatron":  # Megatron-LM's own buffers and kernels: the GPU's share replays
        return None
    if layout.pp > 1:  # one stage per GPU: its own schedule (`llamem.analytic.schedule_pipeline`)
        return "pipeline" if pipeline_schedulable(spec, w, layout) else None
    if layout.num_gpus == 1 or layout.ep != 1 or layout.offload != "none" or w.task not in ("train", "lora"):
        return None
    if w.uses_adapters:  # LoRA on a dense model under DDP, what the bundle runs (QLoRA's base needs a GPU to run)
        plain = layout.tp == 1 and layout.sharding == "ddp" and not spec.is_moe and w.quant == "none"
        return "ddp" if plain else None
    if layout.tp > 1:  # what the tensor-parallel bundle runs: untied embeddings, dense layers, the whole loss
        plain = not spec.tie_word_embeddings and not spec.is_moe and w.loss != "chunked"
        return "tp" if plain and layout.sharding in ("none", "ddp") else None
    if layout.sharding == "ddp":
        return "ddp"
    if (layout.sharding == "zero3" and layout.engine == "fsdp2" and not spec.is_moe and w.loss != "chunked"
            and w.optimizer in ("adamw", "adamw-fused", "sgd")):
        return "fsdp2"
    if (layout.sharding in ("zero1", "zero2") and layout.engine == "deepspeed" and not spec.tie_word_embeddings
            and not spec.is_moe and w.loss != "chunked" and w.compute_dtype == "bf16"
            and w.optimizer in ("adamw", "adamw-fused", "adamw-loop", "sgd")):
        return layout.sharding
    if layout.sharding == "zero3" and layout.engine == "deepspeed" and zero3_schedulable(spec, w):
        return "zero3"
    return None


def schedule_layout(spec: ModelSpec, w: Workload, layout: Layout) -> Layout | None:
    """The layout that names this rank's schedule (None: the single-GPU one). A DDP rank's schedule does not
    depend on the number of ranks, so all DDP layouts name one, and a plan's probes are shared; a tensor-
    parallel rank's depends on the split (its `spec` is the share) and on whether it has replicas."""
    kind = rank_schedule_kind(spec, w, layout)
    if kind == "pipeline":  # a stage's schedule: its place, the micro-batches and their order, its TP split
        return Layout(pp=layout.pp, tp=layout.tp, pipeline_schedule=layout.pipeline_schedule,
                      microbatches=layout.microbatches)
    if kind == "tp":  # the same for any number of replicas beyond one
        return Layout(dp=min(layout.dp, 2), tp=layout.tp, sharding=layout.sharding)
    return Layout(dp=2, sharding="ddp") if kind == "ddp" else layout if kind else None


def rank_schedule(spec: ModelSpec, w: Workload, layout: Layout, backend: Backend = "nccl",
                  stage: int | None = None) -> list[AllocEvent]:
    """The allocation schedule of one rank of `layout` (see the module); `rank_schedule_kind` must name it.
    `stage`: which pipeline stage (pipeline layouts only)."""
    kind = rank_schedule_kind(spec, w, layout)
    if kind == "pipeline":
        assert stage is not None, "a pipeline layout's schedule is a stage's: name the stage"
        return pipeline_stage_schedule(spec, w, layout, stage)
    if kind == "ddp":
        return ddp_schedule(spec, w)
    if kind == "tp":
        return tp_schedule(spec, w, layout)
    if kind in ("zero1", "zero2"):
        return zero_rank_schedule(spec, w, layout, backend=backend)
    if kind == "zero3":
        return zero3_rank_schedule(spec, w, layout, backend=backend)
    assert kind == "fsdp2", f"no rank schedule for {layout.describe()}"
    return fsdp2_schedule(spec, w, layout.dp, backend)


# DDP ------------------------------------------------------------------------------------------------
def ddp_bucket_bytes(grad_bytes: list[int], limits: list[int]) -> list[int]:
    """Flat buckets of gradients of `grad_bytes` (in the order they are bucketed), a bucket closing once
    it reaches its limit (the last limit repeats), as `compute_bucket_assignment_by_size` does."""
    buckets, size, index = [], 0, 0
    for nbytes in grad_bytes:
        size += nbytes
        if size >= limits[index]:
            buckets.append(r512(size))
            size, index = 0, min(index + 1, len(limits) - 1)
    return buckets + ([r512(size)] if size else [])


ModuleStates = tuple[list[tuple[int, str]], list[tuple[int, str]]]
"""A module's (parameters, buffers), each tensor as (bytes, dtype), in the order DDP lists them."""


def broadcast_buckets(states: list[tuple[int, str]]) -> list[int]:
    """`broadcast_coalesced`' flat copies of `states` ((bytes, dtype) in order): `compute_bucket_assignment_by_size`
    with one limit, a bucket per dtype closing once it reaches 250 MiB, the buckets in order of their first tensor."""
    open_buckets: dict[str, tuple[int, int]] = {}  # dtype: (first tensor's index, bytes so far)
    closed = []
    for index, (nbytes, dtype) in enumerate(states):
        first, size = open_buckets.pop(dtype, (index, 0))
        if size + nbytes >= BROADCAST_BUFFER_BYTES:
            closed.append((first, size + nbytes))
        else:
            open_buckets[dtype] = (first, size + nbytes)
    return [r512(size) for _first, size in sorted(closed + list(open_buckets.values()))]


def ddp_module_states(spec: ModelSpec, w: Workload) -> ModuleStates:
    """(parameters, buffers) as `_sync_module_states` broadcasts them, (bytes, dtype) in `named_parameters()` order:
    every parameter, frozen ones too: the embedding, each layer's own (an adapted projection's weight followed by
    its LoRA A and B, in the adapters' dtype; the layer's norms last, as decoder layers register them), the final
    norm, an untied head; the buffers: RoPE's inv_freq and original_inv_freq in fp32."""
    storage, adapters = DTYPE_BYTES[w.weight_dtype], adapter_dtype(w)
    shapes, targets = spec.layer_linear_shapes(), set(lora_linear_targets(w)) if w.uses_adapters else set()
    states = [(storage * spec.embedding_params, w.weight_dtype)]
    for index in range(spec.num_layers):
        params = sorted(spec.layer_params(index), key=lambda param: param[0].count(".") == 1)
        projections = [name.split(".")[-2] for name, _numel in params]
        for position, (_name, numel) in enumerate(params):
            states.append((storage * numel, w.weight_dtype))
            proj = projections[position]
            if proj in targets and proj not in projections[position + 1:]:  # after its weight and bias
                fan_in, fan_out = shapes[proj]
                states += [(DTYPE_BYTES[adapters] * w.lora_rank * n, adapters) for n in (fan_in, fan_out)]
    states += [(storage * n, w.weight_dtype) for n in (spec.hidden_size, spec.lm_head_params) if n]
    return states, [(DTYPE_BYTES["fp32"] * (spec.head_dim // 2), "fp32")] * 2


class DdpEvents(Events):
    """A DDP rank: the wrap's broadcast copies and first bucket, the buffers' broadcast at each forward, the
    buckets rebuilt at the second step's forward."""

    def __init__(self, param_bytes: list[int], states: ModuleStates, *, after_adapters: bool = False) -> None:
        """`param_bytes`: what the buckets hold, the trainable parameters in order; `states`: the parameters and
        buffers the wrap broadcasts (`ddp_module_states`);
        `after_adapters`: the wrap waits for the schedule's next allocation, the adapters, which peft made
        before DDP wrapped the model."""
        super().__init__()
        self.param_bytes, self.states = param_bytes, states
        self.buckets: list[int] = []
        self.after_adapters, self.wrap_pending = after_adapters, False

    def alloc(self, sizes: list[int], stream: int = 0) -> list[int]:
        ids = super().alloc(sizes, stream)
        if self.wrap_pending:
            self.wrap_pending = False
            self.wrap()
        return ids

    def broadcast(self, states: list[tuple[int, str]]) -> None:
        """`broadcast_coalesced` (torch/csrc/distributed/c10d/comm.cpp): at most two flat copies in flight."""
        in_flight: list[int] = []
        for chunk in broadcast_buckets(states):
            if len(in_flight) == 2:
                self.free([in_flight.pop(0)])
            in_flight += self.alloc([chunk])
        self.free(in_flight)

    def wrap(self) -> None:
        self.broadcast(self.states[0] + self.states[1])
        self.buckets = self.alloc(ddp_bucket_bytes(self.param_bytes, [2**63]))

    def mark(self, point: str, unit: int | str | None = None, grads: list[int] | None = None) -> None:
        if point == "wrap" and self.after_adapters:
            self.wrap_pending = True
        elif point == "wrap":
            self.wrap()
        elif point == "step":
            if unit == 1:
                self.free(self.buckets)
                ready = list(reversed(self.param_bytes))
                self.buckets = self.alloc(ddp_bucket_bytes(ready, [DDP_FIRST_BUCKET_BYTES, DDP_BUCKET_BYTES]))
            self.broadcast(self.states[1])  # forward_sync_buffers: rank 0's buffers before each forward


def ddp_schedule(spec: ModelSpec, w: Workload) -> list[AllocEvent]:
    """The single-GPU training schedule with DDP's broadcasts and buckets. The buckets hold the parameters that
    require a gradient: every parameter (fp32 under autocast), or the LoRA adapters (fp32, as peft keeps them)."""
    element = DTYPE_BYTES[adapter_dtype(w) if w.uses_adapters else w.weight_dtype]
    grads = [element * n for n in trainable_numels(spec, w)]
    return training_schedule(spec, w, DdpEvents(grads, ddp_module_states(spec, w), after_adapters=w.uses_adapters))


# Tensor parallel ------------------------------------------------------------------------------------
ROW_PARALLEL = frozenset({"o_proj", "down_proj", "embed"})
"""Projections whose partial outputs a tensor-parallel rank all-reduces in forward."""
COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "lm_head"})
"""Projections whose input gradients (partial sums) a tensor-parallel rank all-reduces in backward."""


class TpEvents(DdpEvents):
    """A tensor-parallel rank (with DDP's buckets when it has data-parallel replicas too): the all-reduced
    copies of row-parallel outputs and column-parallel input gradients, the whole-vocabulary embedding
    gradient. A tensor replaced by a copy is freed where the schedule frees the original."""

    def __init__(self, param_bytes: list[int], replicas: int, whole_embedding_bytes: int,
                 loss: LossParallelEvents | None = None, states: ModuleStates = ([], [])) -> None:
        """`states`: what DDP's wrap broadcasts when the rank has replicas (`ddp_module_states` of the share)."""
        super().__init__(param_bytes, states)
        self.replicas, self.whole_embedding_bytes = replicas, whole_embedding_bytes
        self.sizes: dict[int, int] = {}
        self.replaced: dict[int, int] = {}
        self.loss = loss
        """The loss as torch's `loss_parallel` runs it (None: transformers' loss, as the schedule replays it)."""

    def alloc(self, sizes: list[int], stream: int = 0) -> list[int]:
        if self.loss is not None and self.loss.pending:  # the loss's gradients: loss_parallel's fused backward
            return self.loss.gradient(self, sizes)
        ids = super().alloc(sizes, stream)
        self.sizes.update(zip(ids, (size for size in sizes if size > 0)))
        return ids

    def free(self, ids: list[int]) -> None:
        super().free([self.replaced.pop(i, i) for i in ids])

    def replace(self, tensor: int, size: int) -> None:
        """A new tensor of `size` takes `tensor`'s place; `tensor` is freed at once."""
        self.replaced[tensor] = self.alloc([size])[0]
        super().free([tensor])

    def projection(self, name: str, tensor: int, backward: bool = False) -> None:
        # The functional all-reduce writes a new tensor; the partial one dies with the redistribute.
        if name in (COLUMN_PARALLEL if backward else ROW_PARALLEL):
            self.replace(tensor, self.sizes[tensor])

    def mark(self, point: str, unit: int | str | None = None, grads: list[int] | None = None) -> None:
        if point == "forward_done" and unit == "model" and self.loss is not None:
            self.loss.forward_done(self)
        elif point == "backward_done" and unit == "embed" and grads and self.whole_embedding_bytes:
            # DTensor's embedding backward runs replicated: the whole V x h gradient, the shard a view of it.
            self.replace(grads[0], self.whole_embedding_bytes)
        elif self.replicas > 1:
            super().mark(point, unit, grads)


def tp_schedule(spec: ModelSpec, w: Workload, layout: Layout) -> list[AllocEvent]:
    """The single-GPU schedule of the rank's share (`spec`: `llamem.parallel.shard_spec`) with the
    collectives' copies, the whole embedding gradient (`parallel.add_whole_embedding_gradient`'s) and the loss
    as torch's `loss_parallel` runs it (`llamem.analytic.loss_parallel`)."""
    element = DTYPE_BYTES[w.weight_dtype]
    whole = r512(element * spec.vocab_size * layout.tp * spec.hidden_size) if not spec.tie_word_embeddings else 0
    loss = LossParallelEvents(spec, w) if runs_loss_parallel(w, layout) else None
    states = ddp_module_states(spec, w) if layout.dp > 1 else ([], [])
    ev = TpEvents([element * n for n in trainable_numels(spec, w)], layout.dp, whole, loss, states)
    return training_schedule(spec, w, ev)


# FSDP2 ----------------------------------------------------------------------------------------------
FSDP2_MICROBATCHES = 2
"""Micro-batches a step replays with accumulation: past the second, each repeats the second's allocations (the
sharded gradients are there; each reduce-scatter output is added into them and let go), so more would only
lengthen the schedule."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Fsdp2Sizes:
    """One `fully_shard` unit's tensors on one rank of N (each rounded to 512 bytes as the allocator does)."""

    shards_bytes: tuple[int, ...]
    """Each parameter's padded shard in the storage dtype."""
    gathered_bytes: tuple[int, ...]
    """Each unsharded parameter in the param dtype (dim 0 padded to N shards)."""
    copy_in_bytes: int
    """The all-gather's flat input: the shards cast to the param dtype."""
    output_bytes: int
    """The all-gather's flat output."""
    rs_input_bytes: int
    """The reduce-scatter's flat input, in the reduce dtype."""
    rs_output_bytes: int
    """The reduce-scatter's output: the unit's sharded gradients."""


def fsdp2_sizes(shapes: list[tuple[int, int]], w: Workload, world: int) -> Fsdp2Sizes:
    """A unit of parameters of (rows, columns) shapes in module order; the same terms as
    `llamem.parallel.fsdp2_unit`, tensor by tensor."""
    param, storage = DTYPE_BYTES[w.compute_dtype], DTYPE_BYTES[w.weight_dtype]
    reduce = 4 if w.mixed else storage
    padded = [-(-rows // world) * world * cols for rows, cols in shapes]
    total = sum(padded)
    return Fsdp2Sizes(shards_bytes=tuple(r512(storage * n // world) for n in padded),
                      gathered_bytes=tuple(r512(param * n) for n in padded), copy_in_bytes=r512(param * total // world),
                      output_bytes=r512(param * total), rs_input_bytes=r512(reduce * total),
                      rs_output_bytes=r512(reduce * total // world))


def fsdp2_unit_sizes(spec: ModelSpec, w: Workload, world: int) -> dict[int | str, Fsdp2Sizes]:
    """The bundle's units in the order it shards them: "embed", each layer by index, "head" (final norm and
    lm_head); with tied embeddings each layer, then the root's own unit "embed" (the embedding, which is the
    head's weight, and the final norm), and no "head"."""
    h, embedding = spec.hidden_size, [(spec.vocab_size, spec.hidden_size)]
    layer = fsdp2_sizes(fsdp2_layer_shapes(spec), w, world)
    layers: dict[int | str, Fsdp2Sizes] = dict.fromkeys(range(spec.num_layers), layer)
    if spec.tie_word_embeddings:
        return {**layers, "embed": fsdp2_sizes([*embedding, (h, 1)], w, world)}
    return {"embed": fsdp2_sizes(embedding, w, world), **layers, "head": fsdp2_sizes([(h, 1), *embedding], w, world)}


def fsdp2_parameter_shards(spec: ModelSpec, units: dict[int | str, Fsdp2Sizes]) -> list[int]:
    """Each parameter's shard in module order, the optimizer's: the embedding, each layer's, the final norm and
    (untied) lm_head."""
    layers = [size for index in range(spec.num_layers) for size in units[index].shards_bytes]
    embed = list(units["embed"].shards_bytes)
    if "head" in units:
        return [*embed, *layers, *units["head"].shards_bytes]
    return [embed[0], *layers, *embed[1:]]


class Fsdp2Events(LiveEvents):
    """An FSDP2 rank: its units' all-gathers, reshards and reduce-scatters at the schedule's marks. The optimizer
    steps after a step's last micro-batch only: its state (made at the first step) and its foreach temporaries
    are made here, at that micro-batch's zero_grad mark."""

    def __init__(self, units: dict[int | str, Fsdp2Sizes], backend: Backend, *, microbatches: int = 1,
                 state: tuple[int, ...] = (), temporaries: tuple[int, ...] = (), tied_grad_bytes: int = 0) -> None:
        """`microbatches`: a step's; `state`: the optimizer's tensors, made at the first step; `temporaries`: its
        foreach temporaries; `tied_grad_bytes`: a tied weight's unsharded gradient."""
        super().__init__()
        self.units, self.backend = units, backend
        self.tied = "head" not in units
        self.held = "embed" if self.tied else "head"
        """The unit gathered from its forward into its backward: the root's own, or the head (no reshard)."""
        layers = sorted((u for u in units if isinstance(u, int)), reverse=True)
        self.backward_order = [*([] if self.tied else ["head"]), *layers, "embed"]
        self.microbatches, self.made = microbatches, 0
        self.state, self.temporaries, self.tied_grad_bytes = list(state), list(temporaries), tied_grad_bytes
        self.gathered: dict[int | str, list[int]] = {}
        self.outputs: dict[int | str, list[int]] = {}
        self.last_output: list[int] = []
        self.rs_input: list[int] = []
        self.grad_shards: dict[int | str, list[int]] = {}
        self.root_grads: list[int] = []
        """Tied: the root's unsharded gradients made before its reduce (the head's weight, the final norm's)."""

    def mark(self, point: str, unit: int | str | None = None, grads: list[int] | None = None) -> None:
        if point == "step":
            self.made += 1
        elif point.startswith("forward"):
            self.forward_mark(point, unit)
        elif point == "backward" and unit in self.units:
            self.pre_backward(unit)
        elif point == "backward_done":
            self.post_backward(unit, grads or [])
        elif point == "zero_grad":
            self.optimizer_step()

    def forward_mark(self, point: str, unit: int | str | None) -> None:
        if point == "forward" and unit in self.units:
            self.all_gather(unit)
            self.copy_out(unit)
            self.free(self.last_output)
            self.last_output = self.outputs.pop(unit)
        elif point == "forward_done" and unit == "model":  # the root's post-forward, after the loss
            self.free(self.last_output)
            self.last_output = []
            if self.backward_order[0] != self.held:  # tied: the root's pre-backward, at the loss's, prefetches
                self.all_gather(self.backward_order[0])  # the top layer
        elif point == "forward_done" and unit in self.units and unit != self.held:
            self.free(self.gathered.pop(unit))

    def projection(self, name: str, tensor: int, backward: bool = False) -> None:
        if self.tied and backward and name == "lm_head":  # the head's share of the tied weight's gradient
            self.root_grads += self.alloc([self.tied_grad_bytes])

    def stream(self, stream: int) -> int:
        """FSDP2's own stream on CUDA; the one stream on CPU."""
        return stream if self.backend == "nccl" else 0

    def all_gather(self, unit: int | str) -> None:
        sizes, stream = self.units[unit], self.stream(ALL_GATHER_STREAM)
        copy_in = self.alloc([sizes.copy_in_bytes], stream)
        self.outputs[unit] = self.alloc([sizes.output_bytes], stream)
        self.free(copy_in)

    def copy_out(self, unit: int | str) -> None:
        self.gathered[unit] = self.alloc(list(self.units[unit].gathered_bytes))

    def pre_backward(self, unit: int | str) -> None:
        """The held unit is still gathered; any other copies its parameters out of the prefetched output. Then
        the next unit's all-gather is issued."""
        if unit != self.held:
            self.copy_out(unit)
            self.free(self.outputs.pop(unit))
        following = self.backward_order[self.backward_order.index(unit) + 1:][:1]
        if following and following[0] != self.held:
            self.all_gather(following[0])

    def post_backward(self, unit: int | str | None, grads: list[int]) -> None:
        """A unit's gradients made: reduced. Tied, the root's wait for the embedding's backward, which adds its
        gradient to the head's out of place; the root's gradients are the tied weight's, then the final norm's."""
        if not self.tied:
            self.reduce_scatter(unit, grads)
        elif unit == "head":
            self.root_grads += grads
        elif unit != "embed":
            self.reduce_scatter(unit, [g for g in grads if g not in self.root_grads])
        else:
            summed = self.alloc([self.tied_grad_bytes])
            self.free(self.root_grads[:1] + grads)
            self.reduce_scatter(unit, summed + self.root_grads[1:])
            self.root_grads = []

    def reduce_scatter(self, unit: int | str, grads: list[int]) -> None:
        """Resharded, the previous input freed, the unit's own made; its gradients released but the last (the
        loop variable holds it). A later micro-batch's output is added into the sharded gradients and let go."""
        sizes = self.units[unit]
        self.free(self.gathered.pop(unit) + self.rs_input)  # resharded first (`post_backward`)
        self.rs_input = self.alloc([sizes.rs_input_bytes])
        self.free(grads[:-1])
        output = self.alloc([sizes.rs_output_bytes], self.stream(REDUCE_SCATTER_STREAM))
        if self.backend == "gloo":  # gloo reduces a copy of the input
            self.free(self.alloc([sizes.rs_input_bytes]))
        self.free(grads[-1:])
        if unit in self.grad_shards:
            self.free(output)
        else:
            self.grad_shards[unit] = output
        if unit == "embed":  # the last unit: the root's post-backward lets go of its input
            self.free(self.rs_input)
            self.rs_input = []

    def optimizer_step(self) -> None:
        """After a step's last micro-batch: the state (first step), the temporaries, then zero_grad."""
        if self.made % self.microbatches:
            return
        self.alloc(self.state)
        self.state = []
        self.free(self.alloc(self.temporaries))
        self.free([tensor for shards in self.grad_shards.values() for tensor in shards])
        self.grad_shards = {}


def fsdp2_schedule(spec: ModelSpec, w: Workload, world: int, backend: Backend = "nccl") -> list[AllocEvent]:
    """One FSDP2 rank's two optimizer steps, each of its micro-batches (up to `FSDP2_MICROBATCHES`) reduce-
    scattering (see the module): its fp32 shards and RoPE's buffers, the compute dtype's activations, the
    optimizer on the shards."""
    units = fsdp2_unit_sizes(spec, w, world)
    compute = with_changes(w, precision=w.compute_dtype)
    unsharded = trainable_tensor_sizes(spec, compute)  # [embedding, layers..., final norm(, lm_head)]
    shards = fsdp2_parameter_shards(spec, units)
    numels = [size // DTYPE_BYTES[w.weight_dtype] for size in shards]
    ev = Fsdp2Events(units, backend, microbatches=min(w.grad_accum, FSDP2_MICROBATCHES),
                     state=tuple(optimizer_state_tensors(w, numels, shards)),
                     temporaries=tuple(shards) if has_step_temporaries(compute) else (), tied_grad_bytes=unsharded[0])
    ev.alloc([size for unit in units.values() for size in unit.shards_bytes] + [rope_buffer_bytes(spec) // 2] * 2)
    head = unsharded[-1:] if spec.tie_word_embeddings else unsharded[-2:]
    for _ in range(ev.microbatches):  # two passes a call: two steps, or with accumulation one step's micro-batches
        training_steps(spec, compute, ev, head, unsharded[:1], [], [])
    return ev.events
