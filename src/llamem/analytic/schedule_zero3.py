"""One DeepSpeed ZeRO-3 rank's own allocation schedule, for its reserved memory (`llamem.device`).

DeepSpeed 0.19.8 under bf16 with the launch bundle's ds_config.json (`llamem.bundle.deepspeed`: stage 3,
`reduce_bucket_size` = h x h, `stage3_prefetch_bucket_size` = 0.9 x h x h, `stage3_param_persistence_threshold`
= 10 x h; DeepSpeed's defaults for the rest: contiguous gradients, overlap_comm, 1e9 elements of
`stage3_max_live_parameters` and of `stage3_max_reuse_distance`), `deepspeed/runtime/zero/`:

- Wrap (`engine.py`, `partition_parameters.py` `Init(module=...)`, `stage3.py`, `parameter_offload.py`): the engine
  casts each parameter to bf16; each is then partitioned (its 1/N slice, ceil(numel / N) elements, made before the
  whole one is freed); the optimizer defragments the slices into one flat bf16 buffer (the slices freed), makes the
  fp32 master partition (a cast, cloned, the cast freed), initialize_optimizer_states' zero fp32 gradient (freed at
  once), the contiguous-gradients bucket (reduce_bucket_size elements) and the flat bf16 gradient partition
  (`grad_partitions_flat_buffer`); `create_reduce_and_remove_grad_hooks` gathers each parameter and frees it.
  Parameters of at most the persistence threshold's elements are persistent (`mark_persistent_parameters`).
- Gathers (`partitioned_param_coordinator.py`): every module's pre-forward and pre-backward hook (containers too,
  in the trace the first fwd+bwd records) gathers the module's own parameters (one buffer of ceil(numel / N) x N
  elements; several at once: one flat buffer, each parameter then a `torch.cat` of its slices and the flat buffer
  freed once the last of them is waited for). Recording (the first fwd+bwd) the post hooks free every parameter of
  the module. With the trace complete each fetch also prefetches the next parameters of the trace that are not
  gathered, up to the prefetch bucket's elements (and the max live parameters), and a post hook keeps a parameter
  whose next use is within max_reuse_distance elements of the trace, and the persistent ones: with DeepSpeed's
  default of 1e9 a parameter gathered in forward waits for its backward unless 1e9 elements of other modules'
  parameters come between. The end of each backward (`release_backward_leftovers`) frees what is gathered but not
  persistent (the embedding, whose post-backward hook never runs: its input needs no gradient); the optimizer's
  step frees the persistent ones too (`partition_all_parameters`) and gathers them again after it (`_post_step`),
  each in its own buffer.
- Gradients (`stage3.py` `reduce_independent_p_g_buckets_and_remove_grads`): in hook order each bf16 gradient
  that fits in what is left of the bucket is copied into it and freed; a larger one is kept. A gradient that does
  not fit flushes a bucket that holds any: `reduce_scatter_coalesced` concatenates the bucket's gradients (each
  padded to a multiple of N) unless it holds one whose elements N divides, reduce-scatters that in place into the
  flat gradient partition, and frees the concatenation and the kept gradient. The end of backward flushes the rest.
- Accumulation (gradient_accumulation_steps > 1; the engine divides the loss, its `step()` after every micro-batch
  steps the optimizer at the boundary only): each micro-batch reduce-scatters its gradients as above, the first
  copying into the flat gradient partition and a later one adding into it in place (`partition_grads`), so
  accumulation allocates nothing of its own. The trace records in the first micro-batch's fwd+bwd and is complete
  from the second on (`reset_step` at every forward); the persistent parameters stay gathered from one micro-batch
  to the next.
- Checkpointing (every layer, transformers' non-reentrant checkpoint as the bundle enables it): a layer's
  backward starts with down_proj's pre-backward hook, whose backward unpacks a saved tensor and so recomputes the
  layer: its modules' pre- and post-forward hooks run again (recording, they gather and let go of each parameter
  once more; with the trace complete they find them kept since forward), up to down_proj's pre-forward hook, where
  the recompute stops (DeepSpeed's linear saves its tensors after making its output, which is dropped); down_proj's
  post-backward hook then lets go of it. The recorded trace holds the recompute's modules.
- Step: the gradient norm takes each parameter's partition in fp64 (`get_grad_norm_direct`), one at a time, its
  norm kept to the end; the partition's gradients are concatenated (bf16) and cast to an fp32 flat gradient (the
  concatenation freed), the optimizer steps the fp32 partition (its state made in the first step), and the fp32
  gradient is freed.

The schedule acts at the points the single-GPU schedule (`llamem.analytic.schedule`) marks, over the module trace
DeepSpeed records for the bundle's model (`module_trace`): a projection's gather comes at its mark (after its output
in forward, after its gradients in backward, where its weight's gradient is hooked); a norm's between the marks
around it (its gradient's tensor freed at the end of its unit's backward); the final norm's and the head's at the
head's forward mark, the head's (recording) let go there, and in backward kept to the end of the final norm's.
Each of the single-GPU schedule's steps is one micro-batch here; a step runs the first micro-batch and the last (a
micro-batch between them allocates and frees as the last does, short of the step). The first fwd+bwd records the
trace, the next runs with it complete. On the launch bundle's 2-rank CPU run of a tiny Llama
(`tests/test_deepspeed_zero3_schedule.py`) the ranks reserve what the schedule does, their peak 6 blocks of 512
bytes above it (the scalars; 7 with two micro-batches a step), every allocation of 16 KiB or more in the same
order and those of 4 KiB or more in the same number, with DeepSpeed's reuse distance and with none, one micro-batch
a step and two, with every layer checkpointed and without. Left out, as smaller than a 512-byte block each and
freed at once (or, the optimizer's flag, one block for the run): the loss scaler's and the norm's scalars, the
loss's division by the accumulation steps, the overflow checks, the barriers' tensors, the trace's rank checks, the
padding of parameters N does not divide (in the reduce-scatter's concatenation).

CUDA only (`backend="nccl"`, what `llamem estimate` sizes): the parameters arrive in bf16; the gathers are made in
the coordinator's all-gather stream and the bucket's concatenation in the reduce-and-partition stream (overlap_comm,
on by default under ZeRO-3), which the caching allocator keeps apart from the default stream's blocks; DeepSpeed's
FusedAdam steps without temporaries. CPU only (`backend="gloo"`, the launch bundle's `--cpu` run): llamem's tracker
counts the fp32 model before the cast, gloo's reduce-scatter copies its whole input (freed at once), and torch's
AdamW steps the fp32 partition with its for-loop temporaries.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Literal

from llamem.allocator.replay import AllocEvent
from llamem.analytic import activations as act
from llamem.analytic.common import r512
from llamem.analytic.schedule import LiveEvents, optimizer_state_tensors, training_steps
from llamem.analytic.schedule_deepspeed import NORM_BYTES, cast_parameters, micro_batches_per_step, unit_param_numels
from llamem.analytic.weights import trainable_tensor_sizes
from llamem.model import ModelSpec
from llamem.parallel import Layout
from llamem.workload import Workload, with_changes

Backend = Literal["nccl", "gloo"]
GATHER_STREAM = 1
"""The coordinator's all-gather stream on CUDA: the gathered parameters are allocated there."""
REDUCE_STREAM = 2
"""The reduce-and-partition stream on CUDA: the bucket's concatenation is allocated there."""
DEFAULT_LIMIT_NUMEL = 10**9
"""DeepSpeed's stage3_max_live_parameters and stage3_max_reuse_distance (ds_config.json leaves them)."""
LAYER_MODULES = ("input_layernorm", "self_attn", "q_proj", "k_proj", "v_proj", "o_proj", "post_attention_layernorm",
                 "mlp", "gate_proj", "act_fn", "up_proj", "down_proj")
"""A decoder layer's modules in forward order (after the layer itself)."""
LAYER_BACKWARD = ("mlp", "down_proj", "up_proj", "act_fn", "gate_proj", "post_attention_layernorm", "self_attn",
                  "o_proj", "v_proj", "k_proj", "q_proj", "input_layernorm")
"""The order of their pre-backward hooks, as DeepSpeed's trace records it."""
LAYER_PARAMS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "input_layernorm",
                "post_attention_layernorm")
"""A layer's parameters in `named_parameters` order (`schedule_deepspeed.unit_param_numels`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Zero3Config:
    """What ds_config.json sets for stage 3, in elements."""

    world: int
    """The data-parallel ranks the parameters are partitioned over."""
    bucket_numel: int
    """reduce_bucket_size: the contiguous-gradients bucket."""
    prefetch_numel: int
    """stage3_prefetch_bucket_size: what one fetch prefetches at most."""
    persistence_numel: int
    """stage3_param_persistence_threshold: parameters this small stay gathered."""
    max_live_numel: int = DEFAULT_LIMIT_NUMEL
    """stage3_max_live_parameters: prefetching stops there."""
    max_reuse_numel: int = DEFAULT_LIMIT_NUMEL
    """stage3_max_reuse_distance: a parameter reused within this many elements of the trace is kept."""


def zero3_config(spec: ModelSpec, w: Workload, layout: Layout) -> Zero3Config:
    """The emitted ds_config.json's (`llamem.bundle.deepspeed`)."""
    from llamem.bundle.deepspeed import ds_config

    zero = ds_config(w, layout, spec.hidden_size)["zero_optimization"]
    return Zero3Config(world=layout.dp, bucket_numel=zero["reduce_bucket_size"],
                       prefetch_numel=zero["stage3_prefetch_bucket_size"],
                       persistence_numel=zero["stage3_param_persistence_threshold"])


def module_trace(num_layers: int, checkpointed: frozenset[int] = frozenset()) -> list[tuple]:
    """DeepSpeed's recorded trace of one fwd+bwd of the bundle's model (`CausalLMLoss` around
    `LlamaForCausalLM`): each module as (name, layer or None), forward then backward. A `checkpointed` layer's
    recompute runs its modules' forward hooks after down_proj's pre-backward one, up to down_proj's pre-forward
    hook (the recompute stops there, at its last saved tensor, before the post-forward hook)."""
    forward = [("root", None), ("model", None), ("model.model", None), ("embed", None), ("rotary", None)]
    for index in range(num_layers):
        forward += [("layer", index)] + [(name, index) for name in LAYER_MODULES]
    forward += [("norm", None), ("lm_head", None)]
    backward = [("root", None), ("model", None), ("lm_head", None), ("model.model", None), ("norm", None)]
    for index in reversed(range(num_layers)):
        order = LAYER_BACKWARD[:2] + LAYER_MODULES + LAYER_BACKWARD[2:] if index in checkpointed else LAYER_BACKWARD
        backward += [("layer", index)] + [(name, index) for name in order]
    return forward + backward + [("embed", None)]


def module_params(num_layers: int) -> dict[tuple, int]:
    """Each parameter's module -> its index in `unit_param_numels` order."""
    out: dict[tuple, int] = {("embed", None): 0}
    for index in range(num_layers):
        out.update({(name, index): 1 + 9 * index + k for k, name in enumerate(LAYER_PARAMS)})
    out[("norm", None)] = 1 + 9 * num_layers
    out[("lm_head", None)] = 2 + 9 * num_layers
    return out


@dataclass(eq=False)
class Handle:
    """One all-gather of several parameters: its flat buffer, until the last of them is waited for."""

    flat: list[int]
    params: list[int]
    waiting: set[int]
    done: bool = False


class Coordinator:
    """`PartitionedParameterCoordinator` over the module trace: which parameters are gathered, when (see the
    module). Allocates and frees through `ev`, the gathers in `stream`."""

    def __init__(self, ev: LiveEvents, numels: list[int], config: Zero3Config, stream: int,
                 checkpointed: frozenset[int] = frozenset()) -> None:
        self.ev, self.numels, self.config, self.stream = ev, numels, config, stream
        self.trace = module_trace((len(numels) - 3) // 9, checkpointed)
        self.owned = module_params((len(numels) - 3) // 9)
        self.persistent = {p for p, numel in enumerate(numels) if numel <= config.persistence_numel}
        self.held: dict[int, int] = {}
        """Gathered parameters: each one's tensor."""
        self.inflight: dict[int, Handle] = {}
        self.complete, self.cursor, self.pending = False, 0, None
        self.queue: deque[tuple[int, int]] = deque()
        self.fetched_for: dict[int, int] = {}
        self.available_numel = 0

    def params(self, index: int) -> list[int]:
        own = self.owned.get(self.trace[index])
        return [] if own is None else [own]

    def gathered_bytes(self, param: int) -> int:
        world = self.config.world
        return r512(2 * -(-self.numels[param] // world) * world)

    def start(self, complete: bool) -> None:
        """`reset_step` at the start of a forward: in-flight gathers finished and let go, the queue refilled."""
        for param in list(self.inflight):
            self.wait(param)
            self.release_param(param)
        self.complete, self.cursor, self.pending, self.available_numel = complete, 0, None, 0
        self.queue = deque((p, index) for index in range(len(self.trace)) for p in self.params(index))
        self.fetched_for = {}

    def gather(self, params: list[int]) -> None:
        """One all-gather call (`all_gather_coalesced`): a buffer each, or one flat buffer for several."""
        params = [p for p in params if p not in self.held and p not in self.inflight]
        self.available_numel += sum(self.numels[p] for p in params)
        if len(params) == 1:
            self.held[params[0]] = self.ev.alloc([self.gathered_bytes(params[0])], self.stream)[0]
        elif params:
            world = self.config.world
            flat = self.ev.alloc([r512(2 * world * sum(-(-self.numels[p] // world) for p in params))], self.stream)
            handle = Handle(flat, params, set(params))
            self.inflight.update({p: handle for p in params})

    def wait(self, param: int) -> None:
        """The handle's wait: each parameter a `torch.cat` of its slices; the flat buffer goes with the last."""
        handle = self.inflight.pop(param)
        if not handle.done:
            for p in handle.params:
                self.held[p] = self.ev.alloc([r512(2 * self.numels[p])], self.stream)[0]
            handle.done = True
        handle.waiting.discard(param)
        if not handle.waiting:
            self.ev.free(handle.flat)

    def release_param(self, param: int) -> None:
        if param in self.held:
            self.ev.free([self.held.pop(param)])
            self.available_numel -= self.numels[param]

    def fetch(self, index: int) -> None:
        """A module's pre-forward or pre-backward hook: its parameters gathered and waited for, then (with the
        trace complete) the queue moved past them and the next parameters prefetched."""
        params = self.params(index)
        self.gather(params)
        for param in params:
            if param in self.inflight:
                self.wait(param)
        if self.complete:
            self.skip_fetched(params, index)
            self.gather(self.prefetch())

    def skip_fetched(self, params: list[int], index: int) -> None:
        """The module's own parameters taken off the front of the queue, unless a prefetch took them already."""
        left = [p for p in params if self.fetched_for.get(p, -1) < index]
        for _ in left:
            if self.queue:
                param, used_at = self.queue.popleft()
                self.fetched_for[param] = used_at

    def prefetch(self) -> list[int]:
        """The next parameters of the queue that are not gathered, up to the prefetch bucket's elements."""
        limit = min(self.config.max_live_numel - self.available_numel, self.config.prefetch_numel)
        chosen, numel = [], 0
        while self.queue and numel < limit:
            param, used_at = self.queue.popleft()
            self.fetched_for[param] = max(self.fetched_for.get(param, -1), used_at)
            if param not in self.held and param not in self.inflight and param not in chosen:
                chosen.append(param)
                numel += self.numels[param]
        return chosen

    def release(self, index: int) -> None:
        """A module's post hook: recording, every parameter of it; with the trace complete, those neither
        persistent, nor prefetched for a later use, nor used again within max_reuse_distance (`__params_to_release`)."""
        params = self.params(index)
        if self.complete:
            kept = self.persistent | {p for p in params if self.fetched_for.get(p, -1) > index + 1}
            params = [p for p in params if p not in kept and not self.reused_soon(p, index + 1)]
        for param in params:
            self.release_param(param)

    def reused_soon(self, param: int, start: int) -> bool:
        traversed = 0
        for index in range(start, len(self.trace)):
            if traversed >= self.config.max_reuse_numel:
                return False
            for p in self.params(index):
                if p == param:
                    return True
                traversed += self.numels[p]
        return False

    def advance(self, module: tuple) -> None:
        """Run the hooks up to and including `module`'s pre hook: each module's post hook comes before the next
        one's pre hook (a container's, without parameters, frees nothing)."""
        while self.cursor < len(self.trace):
            self.release_pending()
            self.fetch(self.cursor)
            self.pending = self.cursor
            self.cursor += 1
            if self.trace[self.pending] == module:
                return
        raise AssertionError(f"{module} is not in the rest of the trace")

    def enter(self, module: tuple) -> None:
        """`advance` to a module whose post hook comes later than the next pre hook: a checkpointed layer's
        down_proj, whose backward runs the layer's recompute (its post-backward hook lets go of it after)."""
        self.advance(module)
        self.pending = None

    def release_pending(self) -> None:
        if self.pending is not None:
            self.release(self.pending)
            self.pending = None

    def release_all(self, persistent: bool = True) -> None:
        """Every gathered parameter, in parameter order: the optimizer step's `partition_all_parameters`; at the end
        of each backward (`release_backward_leftovers`) those not persistent, whose post hook never ran."""
        for param in sorted(set(self.held) | set(self.inflight)):
            if param in self.inflight:
                self.wait(param)
            if persistent or param not in self.persistent:
                self.release_param(param)
        self.pending = None

    def gather_persistent(self) -> None:
        """`_post_step`: the persistent parameters, each in its own buffer (on the default stream)."""
        for param in sorted(self.persistent):
            self.held[param] = self.ev.alloc([self.gathered_bytes(param)])[0]


@dataclass(eq=False)
class Grad:
    """One parameter's bf16 gradient as its hook sees it; a norm's tensor id is known only at the end of its
    unit's backward (the single-GPU schedule makes it amid the unit's ops)."""

    numel: int
    id: int | None = None
    free_pending: bool = False


@dataclass
class GradBucket:
    """The contiguous-gradients bucket (`ipg_buckets`): what it holds, and which gradients it could not take."""

    grads: list[Grad] = field(default_factory=list)
    kept: list[Grad] = field(default_factory=list)
    numel: int = 0


class Zero3Events(LiveEvents):
    """A ZeRO-3 rank: the coordinator's gathers, the bucket's reductions, the fp32 step (see the module)."""

    def __init__(self, numels: list[int], w: Workload, config: Zero3Config, backend: Backend) -> None:
        super().__init__()
        self.numels, self.w, self.config, self.backend = numels, w, config, backend
        on_cuda = backend == "nccl"
        self.checkpointed = frozenset(i for i in range((len(numels) - 3) // 9) if act.is_checkpointed(w, i))
        self.coordinator = Coordinator(self, numels, config, GATHER_STREAM if on_cuda else 0, self.checkpointed)
        self.reduce_stream = REDUCE_STREAM if on_cuda else 0
        self.bucket = GradBucket()
        self.unit: int | None = None
        self.seen: set[int] = set()
        self.hooked: set[int] = set()
        self.unknown: list[Grad] = []
        """This unit's norm gradients, hooked before the schedule names their tensors."""
        self.state_made = False
        self.recomputing = False
        self.micro_batches, self.micro, self.forwards = micro_batches_per_step(w), 0, 0

    def param(self, name: str, unit: int | None = None) -> int:
        return self.coordinator.owned[(name, unit)]

    def mark(self, point: str, unit: int | str | None = None, grads: list[int] | None = None) -> None:
        c = self.coordinator
        if point == "step":  # each of the single-GPU schedule's steps is a micro-batch: the first records the trace
            c.start(complete=self.forwards > 0)
            self.forwards += 1
        elif point == "forward":
            self.unit = unit if isinstance(unit, int) else None
            # The final norm's and the head's gathers come before the norm's ops, and recording the head's is let go
            # at once (DeepSpeed frees it once the logits are made: the loss's fp32 tensors come after).
            c.advance(("embed", None) if unit == "embed" else ("lm_head", None) if unit == "head"
                      else ("input_layernorm", unit))
            if unit == "head":
                c.release_pending()
        elif point == "backward" and unit != "head":  # the head's gather lives to its gradient (backward_done)
            self.unit = unit if isinstance(unit, int) else None
            if unit in self.checkpointed:  # its recompute (the projections' forward marks) runs in down_proj's backward
                c.enter(("down_proj", unit))
                c.advance(("input_layernorm", unit))
                self.recomputing = True
            else:
                c.advance(("embed", None) if unit == "embed" else ("mlp", unit))
        elif point == "backward_done":
            self.backward_done(unit, grads or [])
        elif point == "zero_grad":
            self.micro_batch_done()

    def projection(self, name: str, tensor: int, backward: bool = False) -> None:
        c = self.coordinator
        if name == "embed":
            c.release_pending()
        elif name == "lm_head":  # backward: the root's, the wrapped model's and the head's pre-backward hooks
            c.advance(("lm_head", None))
        elif backward:
            self.recomputing = False
            self.projection_backward(name, tensor)
        else:
            c.advance((name, self.unit))
            c.release_pending()
            if name == "o_proj":
                c.advance(("post_attention_layernorm", self.unit))
            elif name == "up_proj" and self.recomputing:
                self.recompute_stop()

    def recompute_stop(self) -> None:
        """The recompute's end: DeepSpeed's linear (`LinearFunctionForZeroStage3`) saves its tensors after its
        output is made, so the recompute stops inside down_proj (after its pre-forward hook, before its post-forward
        one) with its output made and dropped (made here, before the product, where the run makes it after)."""
        self.free(self.alloc([r512(2 * self.w.batch * self.w.seq * self.numels[-2])]))

    def projection_backward(self, name: str, grad_input: int) -> None:
        """A projection's backward: its gather (unless kept since forward), then its weight's gradient hooked (made
        just before the input's gradient); the post-attention norm's backward comes between gate_proj's and
        o_proj's, the input norm's after q_proj's."""
        c = self.coordinator
        if name == "o_proj":
            c.release_pending()
            self.hook(Grad(self.numels[self.param("post_attention_layernorm", self.unit)]))
        c.advance((name, self.unit))
        c.release_pending()
        self.hooked.add(grad_input - 1)
        self.hook(Grad(self.numels[self.param(name, self.unit)], grad_input - 1))
        if name in ("gate_proj", "q_proj"):
            c.advance(("post_attention_layernorm" if name == "gate_proj" else "input_layernorm", self.unit))

    def backward_done(self, unit: int | str | None, grads: list[int]) -> None:
        """The end of a unit's backward: its norms' gradients named; the embedding's ends backward (the bucket
        flushed, every gathered parameter freed)."""
        new = [g for g in grads if g not in self.seen]
        self.seen.update(new)
        c = self.coordinator
        if unit == "head":  # [final norm, lm_head]: the head's hook runs first
            c.advance(("norm", None))
            c.release_pending()
            self.hook(Grad(self.numels[-1], new[1]))
            self.hook(Grad(self.numels[-2], new[0]))
        elif unit == "embed":
            self.hook(Grad(self.numels[0], new[0]))
            self.flush()
            c.release_all(persistent=False)
        else:
            c.release_pending()
            self.hook(Grad(self.numels[self.param("input_layernorm", unit)]))
            for grad, named in zip(self.unknown, [g for g in new if g not in self.hooked]):
                grad.id = named
                if grad.free_pending:
                    self.free([named])
            self.unknown.clear()

    def micro_batch_done(self) -> None:
        """The engine's step after each micro-batch: at the boundary every parameter let go, the optimizer's step,
        the persistent parameters gathered again; before it nothing (the gathered persistent ones stay)."""
        if self.micro == self.micro_batches - 1:
            self.coordinator.release_all()
            self.step()
            self.coordinator.gather_persistent()
            self.micro = 0
        else:
            self.micro += 1

    def hook(self, grad: Grad) -> None:
        """`reduce_independent_p_g_buckets_and_remove_grads`: a full bucket flushed first; the gradient copied
        into the bucket (and freed) when it fits, else kept to the flush."""
        if grad.id is None:
            self.unknown.append(grad)
        bucket, size = self.bucket, self.config.bucket_numel
        if bucket.numel and bucket.numel + grad.numel > size:
            self.flush()
            bucket = self.bucket
        if bucket.numel + grad.numel <= size:
            self.free_grad(grad)
        else:
            bucket.kept.append(grad)
        bucket.grads.append(grad)
        bucket.numel += grad.numel

    def flush(self) -> None:
        """`__reduce_and_partition_ipg_grads`: `reduce_scatter_coalesced` (a concatenation unless one gradient
        that N divides), gloo's copy of its input, the kept gradients freed."""
        grads, world = self.bucket.grads, self.config.world
        if not grads:
            return
        single = len(grads) == 1 and grads[0].numel % world == 0
        flat_numel = grads[0].numel if single else world * sum(-(-g.numel // world) for g in grads)
        flat = [] if single else self.alloc([r512(2 * flat_numel)], self.reduce_stream)
        if self.backend == "gloo":
            self.free(self.alloc([r512(2 * flat_numel)]))
        self.free(flat)
        for grad in self.bucket.kept:
            self.free_grad(grad)
        self.bucket = GradBucket()

    def free_grad(self, grad: Grad) -> None:
        if grad.id is None:
            grad.free_pending = True
        else:
            self.free([grad.id])

    def step(self) -> None:
        """The fp64 norm pieces, the fp32 flat gradient, the optimizer on the fp32 partition (see the module)."""
        numels = partition_numels(self.numels, self.config.world)
        fp32 = r512(4 * sum(numels))
        norms = []
        for numel in numels:  # each partition's fp64 copy and its norm
            copy = self.alloc([r512(NORM_BYTES * numel)])
            norms += self.alloc([512])
            self.free(copy)
        self.free(norms)
        flat = self.alloc([r512(2 * sum(numels))])
        grad = self.alloc([fp32])
        self.free(flat)
        if not self.state_made:
            self.alloc(self.state_tensors(sum(numels), fp32))
            self.state_made = True
        if self.backend == "gloo" and self.w.optimizer != "sgd":  # torch AdamW's for-loop kernel
            self.free(self.alloc([fp32, fp32]))
        self.free(grad)

    def state_tensors(self, numel: int, fp32: int) -> list[int]:
        """The optimizer's state on the fp32 partition: FusedAdam's without a step tensor on CUDA."""
        state = optimizer_state_tensors(self.w, [numel], [fp32])
        return state[1:] if self.backend == "nccl" and state[:1] == [512] else state


def partition_numels(numels: list[int], world: int) -> list[int]:
    """Each parameter's slice on a rank: ceil(numel / N) elements (the last rank's zero-padded)."""
    return [-(-numel // world) for numel in numels]


def wrap(ev: Zero3Events, spec: ModelSpec, backend: Backend) -> None:
    """The engine's cast, `Init`'s partitioning, the optimizer's flat buffers, the hooks' gathers (see the module)."""
    numels, config = ev.numels, ev.config
    params = cast_parameters(ev, spec, numels, 2, backend)
    slices = []
    for param, numel in zip(params, partition_numels(numels, config.world)):
        slices += ev.alloc([r512(2 * numel)])
        ev.free([param])
    ev.alloc([512])  # the optimizer's inf_or_nan_tracker, alive for the run
    total = sum(partition_numels(numels, config.world))
    ev.alloc([r512(2 * total)])  # the flat bf16 partition
    ev.free(slices)
    cast = ev.alloc([r512(4 * total)])
    ev.alloc([r512(4 * total)])  # the fp32 master partition
    ev.free(cast)
    ev.free(ev.alloc([r512(4 * total)]))  # initialize_optimizer_states' zero gradient
    ev.alloc([r512(2 * config.bucket_numel), r512(2 * total)])  # the bucket, the flat gradient partition
    for param in range(len(numels)):
        ev.free(ev.alloc([ev.coordinator.gathered_bytes(param)]))


def zero3_schedule(spec: ModelSpec, w: Workload, config: Zero3Config, backend: Backend = "nccl") -> list[AllocEvent]:
    """A rank of `config.world` under ZeRO-3 (every rank allocates alike): two training steps, each of
    `micro_batches_per_step` micro-batches, the first micro-batch recording the trace, the rest prefetching along it."""
    numels = [numel for _unit, numel in unit_param_numels(spec)]
    assert len(numels) == 3 + 9 * spec.num_layers, "a layer of 7 projections and 2 norms, without biases"
    ev = Zero3Events(numels, w, config, backend)
    wrap(ev, spec, backend)
    compute = with_changes(w, precision=w.compute_dtype)
    grads = trainable_tensor_sizes(spec, compute)  # [embedding, layers..., final norm, lm_head]
    for _pair in range(ev.micro_batches):  # the single-GPU schedule's two steps are two micro-batches here
        training_steps(spec, compute, ev, grads[-2:], grads[:1], [], [])
    return ev.events


def zero3_rank_schedule(spec: ModelSpec, w: Workload, layout: Layout, backend: Backend = "nccl") -> list[AllocEvent]:
    """A rank of a DeepSpeed zero3 `layout` with the emitted ds_config.json."""
    return zero3_schedule(spec, w, zero3_config(spec, w, layout), backend)


def zero3_schedulable(spec: ModelSpec, w: Workload) -> bool:
    """What the schedule follows (`schedule_ranks.rank_schedule_kind` adds the layout's gates): bf16, a Llama's
    dense layers of 7 projections and 2 norms without biases, untied embeddings, the whole loss, no checkpointing or
    every layer's (not selective: a run of each shows the schedule), DeepSpeed's AdamW."""
    return (not spec.tie_word_embeddings and not spec.is_moe and len(spec.layer_params(0)) == 9
            and w.loss != "chunked" and w.compute_dtype == "bf16" and w.ac_every <= 1 and not w.selective_ac
            and w.optimizer in ("adamw", "adamw-fused", "adamw-loop"))
