"""The planner: the cheapest set of changes that makes a workload fit a GPU budget.

It enumerates configurations (precision, quantization, LoRA -> QLoRA, activation
checkpointing, chunked loss, optimizer, micro-batch x gradient accumulation at the same
global batch, KV-cache dtype, and for several GPUs data/tensor/pipeline parallel layouts,
ZeRO stages and CPU offload within the host's memory), keeps those whose busiest GPU fits,
and ranks them: first by how faithful they stay to the request (tier 0 computes the same
thing; tier 1 changes numerics: pure bf16 without fp32 master weights, 8-bit or factored
optimizer states, quantized weights or KV cache), then by estimated step time
(`llamem.cost`). The answer is a ladder from the user's starting point, one technique per
step in the documented order, each with its memory, its time cost and its reason.

Memory is the analytic engine's (per GPU, `llamem.parallel`), plus allocator fragmentation
and the non-torch overhead: during the search a 5 % fragmentation margin, for the answer
the allocator simulator replaying the plan's allocation schedule.
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

from llamem.cost import step_seconds
from llamem.errors import DoesNotFit, InvalidWorkload
from llamem.gpus import GPU
from llamem.model import ModelSpec
from llamem.overhead import non_torch_bytes
from llamem.parallel import Layout, apply_data_parallel, check_layout, host_bytes, local_phases, shard_spec
from llamem.workload import Workload

SEARCH_FRAGMENTATION = 0.05
AC_CHOICES = (0, 4, 2, 1)
CHUNKED_LOSS_COST = 0.02
"""Chunked loss runs the head per chunk: assumed 2 % slower."""
ORDER = ("precision", "quant", "task", "kv_dtype", "ac_every", "loss", "optimizer", "batch", "layout")
TECHNIQUE_NAMES = {"precision": "precision", "quant": "weight quantization", "task": "LoRA -> QLoRA",
                   "kv_dtype": "KV-cache dtype", "ac_every": "activation checkpointing", "loss": "chunked loss",
                   "optimizer": "optimizer", "batch": "micro-batch x gradient accumulation",
                   "layout": "parallelism / sharding / offload"}
REASONS = {
    "precision": "pure bf16 drops the fp32 master weights, their gradients and the autocast copies",
    "quant": "quantized weights take 1 (int8) or 0.5 (nf4/int4) bytes per parameter",
    "task": "a 4-bit base under the adapters quarters the frozen weights",
    "kv_dtype": "a smaller KV-cache dtype shrinks the cache in proportion",
    "ac_every": "checkpointing keeps layer inputs only and recomputes the rest in backward",
    "loss": "the head and its fp32 loss buffers run one chunk of the sequence at a time",
    "optimizer": "smaller optimizer state (8-bit moments or a factored second moment)",
    "batch": "a smaller micro-batch shrinks activations; accumulation keeps the global batch",
    "layout": "spreading weights, gradients and optimizer state over GPUs (or to host memory)",
}


@dataclass(frozen=True)
class Candidate:
    workload: Workload
    layout: Layout
    allocated_bytes: int
    device_bytes: int
    seconds: float
    tier: int
    host_bytes: int = 0

    def fits(self, gpu: GPU) -> bool:
        return self.device_bytes <= gpu.memory_bytes


@dataclass(frozen=True)
class Step:
    technique: str
    change: str
    peak_device_bytes: int
    relative_step_time: float
    reason: str


@dataclass
class Plan:
    model: ModelSpec
    gpu: GPU
    num_gpus: int
    fits: bool
    start: Candidate
    final: Candidate
    steps: list[Step]
    shortfall_bytes: int = 0
    maximized: dict | None = None
    verification: dict | None = None
    host_budget_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def relative_step_time(self) -> float:
        return self.final.seconds / self.start.seconds if self.start.seconds else 1.0


class Planner:
    def __init__(self, spec: ModelSpec, gpu: GPU, *, host_budget_bytes: int, teacher: ModelSpec | None = None,
                 max_tier: int = 1):
        self.spec, self.gpu, self.teacher = spec, gpu, teacher
        self.max_tier = max_tier
        self.host_budget = host_budget_bytes
        self.cache: dict[tuple, dict[str, dict[str, int]]] = {}
        self.evaluated = 0

    # Memory and time of one configuration -------------------------------------------------
    def evaluate(self, w: Workload, layout: Layout, tier: int = 0) -> Candidate:
        self.evaluated += 1
        local = shard_spec(self.spec, layout)
        key = (w, layout.tp, layout.pp, layout.microbatches, layout.pipeline_schedule)
        base = self.cache.get(key)
        if base is None:
            base = local_phases(local, w, layout, self.teacher)
            self.cache[key] = base
        phases = apply_data_parallel(base, local, w, layout) if layout.sharding != "none" else base
        allocated = max(sum(b.values()) for b in phases.values())
        device = int(allocated * (1 + SEARCH_FRAGMENTATION)) + non_torch_bytes(layout.num_gpus)
        seconds = step_seconds(self.spec, w, layout, self.gpu) * (1 + CHUNKED_LOSS_COST * (w.loss == "chunked"))
        host = host_bytes(layout, local.num_params, min(layout.num_gpus, self.gpu.gpus_per_node))
        return Candidate(w, layout, allocated, device, seconds, tier, host)

    def exact_device_bytes(self, c: Candidate) -> int:
        """Device bytes with fragmentation from replaying the plan's allocation schedule."""
        from llamem.allocator.replay import replay
        from llamem.analytic.schedule import schedule

        local = shard_spec(self.spec, c.layout)
        result = replay(schedule(local, c.workload))
        ratio = max(0.0, result.peak_reserved_bytes / max(result.peak_allocated_bytes, 1) - 1)
        return int(c.allocated_bytes * (1 + ratio)) + non_torch_bytes(c.layout.num_gpus)

    # Search space ---------------------------------------------------------------------------
    def layouts(self, num_gpus: int, w: Workload) -> list[Layout]:
        out = []
        tps = [t for t in (1, 2, 4, 8) if t <= min(num_gpus, self.gpu.gpus_per_node) and num_gpus % t == 0]
        for tp in tps:
            for pp in [p for p in (1, 2, 4, 8, 16) if (num_gpus // tp) % p == 0 and p <= self.spec.num_layers]:
                dp = num_gpus // (tp * pp)
                micro = max(w.grad_accum, pp) if pp > 1 else 1
                if not w.is_training:
                    shardings = ["none"] if dp == 1 else ["ddp"]
                else:
                    shardings = (["none", "zero2", "zero3"] if dp == 1 else ["ddp", "zero1", "zero2", "zero3"])
                for sharding in shardings:
                    offloads = ["none"]
                    if w.is_training and sharding in ("zero2", "zero3"):
                        offloads.append("optimizer")
                    if w.is_training and sharding == "zero3":
                        offloads.append("optimizer+params")
                    for offload in offloads:
                        if dp == 1 and sharding in ("zero2", "zero3") and offload == "none":
                            continue  # ZeRO on one GPU only helps through offload
                        layout = Layout(dp=dp, tp=tp, pp=pp, sharding=sharding, offload=offload, microbatches=micro)
                        if not check_layout(self.spec, layout):
                            out.append(layout)
        return out

    def structural_variants(self, w: Workload) -> list[tuple[dict, int]]:
        """(changes, tier) for everything except checkpointing, loss, batch and layout."""
        variants: list[tuple[dict, int]] = [({}, 0)]
        if w.task in ("train", "distill"):
            pure = "bf16" if self.gpu.bf16 else "fp16"
            precisions = [({}, 0)] + ([({"precision": pure}, 1)] if w.mixed else [])
            optimizers = [({}, 0)] + [({"optimizer": o}, 1) for o in ("adamw8bit", "adafactor") if o != w.optimizer]
            variants = [({**p, **o}, max(tp, to)) for (p, tp), (o, to) in itertools.product(precisions, optimizers)]
        elif w.task == "lora":
            variants = [({}, 0), ({"task": "qlora", "quant": "nf4"}, 1)]
        elif w.task == "qlora":
            variants = [({}, 0)] + ([({"quant": "nf4"}, 0)] if w.quant == "int8" else [])
        elif w.task == "infer":
            quants = [({}, 0)] + [({"quant": q}, 1) for q in ("int8", "nf4") if q != w.quant]
            kvs = [({}, 0)] + [({"kv_dtype": k}, 1) for k in (["fp8"] if self.gpu.fp8 else []) + ["int8", "int4"]
                                if k != w.kv_dtype]
            variants = [({**q, **k}, max(tq, tk)) for (q, tq), (k, tk) in itertools.product(quants, kvs)]
        return variants

    fixed_micro_batch = False

    def micro_batches(self, w: Workload) -> list[tuple[int, int]]:
        """(micro-batch, accumulation) pairs keeping batch x grad_accum, largest micro-batch first."""
        if not w.is_training or self.fixed_micro_batch:
            return [(w.batch, w.grad_accum)]
        total = w.batch * w.grad_accum
        return [(m, total // m) for m in range(w.batch, 0, -1) if total % m == 0]

    def candidates(self, w: Workload, num_gpus: int):
        """The fastest fitting configuration per structural choice (checkpointing and chunked loss
        only as far as needed), plus the smallest that does not fit, for the shortfall."""
        ac_choices = [a for a in AC_CHOICES if a == 0 or a <= self.spec.num_layers] if w.is_training else [0]
        losses = ["full", "chunked"] if w.is_training else ["full"]
        variants = [(c, t) for c, t in self.structural_variants(w) if t <= self.max_tier]
        for (changes, tier), layout in itertools.product(variants, self.layouts(num_gpus, w)):
            for micro, accum in self.micro_batches(w):
                # Smaller micro-batches are tried while the larger one needed checkpointing or a
                # chunked loss: they may need less of either, and accumulation costs no time.
                found = False
                for loss, ac in itertools.product(losses, ac_choices):
                    options = dict(changes, ac_every=ac, loss=loss, batch=micro, grad_accum=accum)
                    if not w.is_training:
                        options = dict(changes)
                    try:
                        variant = dataclasses.replace(w, **options)
                    except InvalidWorkload:
                        continue
                    candidate = self.evaluate(variant, layout, tier)
                    yield candidate
                    if candidate.fits(self.gpu) and candidate.host_bytes <= self.host_budget:
                        found = not variant.ac_every and variant.loss == "full"
                        break
                if found:
                    break

    # The answer ------------------------------------------------------------------------------
    def best(self, w: Workload, num_gpus: int) -> tuple[Candidate | None, Candidate]:
        fitting, smallest = [], None
        for c in self.candidates(w, num_gpus):
            if smallest is None or self.excess(c) < self.excess(smallest):
                smallest = c
            if c.fits(self.gpu) and c.host_bytes <= self.host_budget:
                fitting.append(c)
        fitting.sort(key=lambda c: (c.tier, c.seconds, c.device_bytes))
        for c in fitting[:8]:  # confirm with the allocator simulator, best first
            exact = dataclasses.replace(c, device_bytes=self.exact_device_bytes(c))
            if exact.fits(self.gpu):
                return exact, smallest
        return None, smallest

    def excess(self, c: Candidate) -> int:
        """Bytes over the budgets: the card's, plus the host's for offloading."""
        return max(0, c.device_bytes - self.gpu.memory_bytes) + max(0, c.host_bytes - self.host_budget)

    def start_candidate(self, w: Workload, num_gpus: int) -> Candidate:
        layout = Layout(dp=num_gpus, sharding="ddp" if num_gpus > 1 else "none")
        return self.evaluate(w, layout)

    def ladder(self, start: Candidate, final: Candidate) -> list[Step]:
        steps, current_w, current_layout = [], start.workload, start.layout
        for name in ORDER:
            if name == "layout":
                if final.layout == current_layout:
                    continue
                current_layout = final.layout
                change = final.layout.describe()
            elif name == "batch":
                if (final.workload.batch, final.workload.grad_accum) == (current_w.batch, current_w.grad_accum):
                    continue
                current_w = dataclasses.replace(current_w, batch=final.workload.batch,
                                                grad_accum=final.workload.grad_accum)
                change = f"micro-batch {final.workload.batch} x {final.workload.grad_accum} accumulation steps"
            else:
                new = getattr(final.workload, name)
                if new == getattr(current_w, name) or (name == "quant" and final.workload.task != current_w.task):
                    continue  # (a switch to QLoRA brings its quantization with it)
                extra = {"quant": final.workload.quant} if name == "task" else {}
                current_w = dataclasses.replace(current_w, **{name: new}, **extra)
                change = f"{name.replace('_every', '')} {final.workload.ac_label if name == 'ac_every' else new}"
            c = self.evaluate(current_w, current_layout)
            # The simulator confirms the last step (the final plan); earlier ones use the search margin.
            device = final.device_bytes if (current_w == final.workload and current_layout == final.layout) else (
                c.device_bytes)
            steps.append(Step(TECHNIQUE_NAMES[name], change, device,
                              c.seconds / start.seconds if start.seconds else 1.0, REASONS[name]))
        return steps

    def maximize(self, w: Workload, num_gpus: int, what: str) -> tuple[int, Candidate | None]:
        """Largest batch (no accumulation) or sequence for which some configuration fits,
        and that configuration. Memory grows with both, so a bisection finds the edge."""
        self.fixed_micro_batch = what == "batch"

        def best_at(value: int) -> Candidate | None:
            changes = {"batch": value, "grad_accum": 1} if what == "batch" else {"seq": value}
            return self.best(dataclasses.replace(w, **changes), num_gpus)[0]

        # A context never grows past what the model was trained for (max_position_embeddings).
        limit = self.spec.max_position_embeddings - (w.new_tokens if w.task == "infer" else 0) if what == "seq" else 2**22
        low = 1
        best_low = best_at(low)
        if best_low is None:
            return 0, None
        high = 2
        best_high = best_at(min(high, limit)) if high <= limit else None
        while best_high is not None and high < limit:
            low, best_low = high, best_high
            high = min(high * 2, limit)
            best_high = best_at(high)
        if best_high is not None:  # fits at the limit itself
            return high, best_high
        while high - low > 1:
            mid = (low + high) // 2
            found = best_at(mid)
            if found is not None:
                low, best_low = mid, found
            else:
                high = mid
        return low, best_low


def make_plan(spec: ModelSpec, w: Workload, gpu: GPU, *, num_gpus: int = 1, host_budget_bytes: int,
              teacher: ModelSpec | None = None, maximize: str | None = None, min_gpus: bool = False,
              max_gpus: int = 1024, exact: bool = False) -> Plan:
    """`exact`: only changes that keep the numerics (tier 0)."""
    planner = Planner(spec, gpu, host_budget_bytes=host_budget_bytes, teacher=teacher, max_tier=0 if exact else 1)
    maximized = None
    final = smallest = None
    if maximize:
        # The requested size need not fit: the question is how large it can be.
        value, final = planner.maximize(w, num_gpus, maximize)
        maximized = {"what": maximize, "value": value}
        if final is None:
            planner.fixed_micro_batch = False
            _, smallest = planner.best(dataclasses.replace(
                w, **({"batch": 1, "grad_accum": 1} if maximize == "batch" else {"seq": 1})), num_gpus)
    else:
        counts = [n for n in (2**k for k in range(11)) if n <= max_gpus] if min_gpus else [num_gpus]
        for count in counts:
            final, smallest = planner.best(w, count)
            num_gpus = count
            if final is not None:
                break
    reference = final.workload if final is not None else (smallest.workload if smallest else w)
    start_w = dataclasses.replace(w, **{f: getattr(reference, f) for f in ("batch", "seq")},
                                  grad_accum=reference.grad_accum if maximize != "batch" else 1) if maximize else w
    start = planner.start_candidate(start_w, num_gpus)
    start = dataclasses.replace(start, device_bytes=planner.exact_device_bytes(start))
    if final is None:
        best = dataclasses.replace(smallest, device_bytes=planner.exact_device_bytes(smallest))
        plan = Plan(spec, gpu, num_gpus, False, start, best, planner.ladder(start, best),
                    shortfall_bytes=planner.excess(best), host_budget_bytes=host_budget_bytes, maximized=maximized)
        if best.host_bytes > host_budget_bytes:
            plan.notes.append(f"the closest plan offloads to host memory and needs {best.host_bytes / 2**30:.1f} GiB "
                              f"of it (budget {host_budget_bytes / 2**30:.1f} GiB, set with --host-memory)")
    else:
        plan = Plan(spec, gpu, num_gpus, True, start, final, planner.ladder(start, final),
                    host_budget_bytes=host_budget_bytes, maximized=maximized)
    plan.notes.append(f"{planner.evaluated} configurations evaluated")
    return plan


def estimate_command(plan: Plan) -> str:
    """The `llamem estimate` command that reproduces the final configuration."""
    w, layout = plan.final.workload, plan.final.layout
    parts = ["llamem estimate", plan.model.name.split(" (")[0], f"--task {w.task}", f"--batch {w.batch}",
             f"--seq {w.seq}", f"--precision {w.precision}"]
    if w.task == "infer":
        parts += [f"--new-tokens {w.new_tokens}", f"--kv-dtype {w.kv_dtype}"]
    else:
        parts += [f"--optimizer {w.optimizer}", f"--ac {w.ac_label}"]
        if w.grad_accum > 1:
            parts.append(f"--grad-accum {w.grad_accum}")
        if w.loss != "full":
            parts.append(f"--loss {w.loss}")
    if w.quant != "none":
        parts.append(f"--quant {w.quant}")
    if w.teacher:
        parts.append(f"--teacher {w.teacher}")
    if w.attn != "sdpa":
        parts.append(f"--attn {w.attn}")
    if layout.num_gpus > 1 or layout.sharding != "none":
        parts.append(f"--gpus {layout.num_gpus}")
        if layout.tp > 1:
            parts.append(f"--tp {layout.tp}")
        if layout.pp > 1:
            parts.append(f"--pp {layout.pp}")
        if layout.sharding not in ("none", "ddp"):
            parts.append(f"--sharding {layout.sharding}")
        if layout.offload != "none":
            parts.append(f"--offload {layout.offload}")
    return " ".join(parts)


def does_not_fit(plan: Plan) -> DoesNotFit:
    where = "the card" if plan.final.device_bytes > plan.gpu.memory_bytes else "host memory for offload"
    return DoesNotFit(f"nothing fits {plan.num_gpus} x {plan.gpu.name}: the closest configuration needs "
                      f"{plan.final.device_bytes / 2**30:.2f} GiB per GPU and is {plan.shortfall_bytes / 2**30:.2f} "
                      f"GiB over ({where}); try more GPUs (--gpus N or --min-gpus), a larger card, more "
                      "--host-memory, or a smaller batch or sequence", best_plan=plan,
                      shortfall_bytes=plan.shortfall_bytes)


__all__ = ["make_plan", "Plan", "Planner", "Candidate", "Step", "estimate_command", "does_not_fit"]
