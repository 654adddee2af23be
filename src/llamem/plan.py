"""The planner: the cheapest set of changes that makes a workload fit a GPU budget.

It enumerates configurations (the techniques of `llamem.techniques`: precision, quantization,
LoRA -> QLoRA, KV-cache dtype, chunked prefill, activation checkpointing, chunked loss,
optimizer, micro-batch x gradient accumulation at the same global batch, and for several GPUs
data/tensor/pipeline parallel layouts, ZeRO stages and CPU offload within the host's memory),
keeps those whose busiest GPU fits, and ranks them: first by how faithful they stay to the
request (tier 0 computes the same thing; tier 1 changes numerics), then by estimated time per
token (`llamem.cost`), then by how few numerics-changing techniques they use, then by memory.
The answer is a ladder from the user's starting point, one technique per step in the
documented order, each with its memory, its time cost and its reason.

During the search memory is the analytic peak per GPU (`llamem.parallel`) with a 5 % allowance
for fragmentation; the best configurations are then confirmed with the device figure of
`llamem.device` (the allocator simulator), the same figure `llamem estimate` prints for the
reproduce command. The search keeps no state between calls: every function takes what it
needs and returns what it found.

The global batch is what was asked: `--batch B --grad-accum A` on the given GPUs is B x A
samples per optimizer step. Data-parallel replicas split it, each running micro-batches of its
share with accumulation; a degree that does not divide it is not used (a note says so).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

from llamem.analytic.offload import host_peak_bytes, largest_saving_bytes
from llamem.analytic.moe import moe_allows, moe_problems
from llamem.cost import step_seconds
from llamem.device import device_memory
from llamem.engine_precision import runs_as
from llamem.errors import DoesNotFit, InvalidWorkload, UsageError
from llamem.gpus import GPU
from llamem.model import ModelSpec
from llamem.overhead import non_torch_bytes
from llamem.megatron import megatron_problems
from llamem.parallel import (IN_BACKWARD_ONE_GPU, Layout, check_layout, expert_parallel_variants, fsdp2_problems,
                             host_bytes, per_gpu_phases, shard_spec, with_engine)
from llamem.techniques import (BY_NAME, LADDER_ORDER, LAYOUT_REASON, LAYOUT_TITLE, PREFILL_CHUNKS,
                               TRUNCATION_TIER, SearchContext, Variant, ac_settings, technique_variants,
                               time_factor, workload_args)
from llamem.teacher_placement import placement_problems, teacher_options, teacher_saving_bytes
from llamem.units import format_bytes, format_gib
from llamem.workload import Workload

SEARCH_FRAGMENTATION = 0.05
"""The search's allowance for allocator fragmentation: the analytic peak x 1.05. Typical for the
allocator simulator's figures (`benchmarks/plan_accuracy.py`); each winner is confirmed exactly."""
SEARCH_ROUNDS = 24
"""Exact confirmations per question. Each round confirms the best configuration that fits with the
allowance; when the exact figure rejects it, the search runs again without it, so that the same
structure's next memory-saving setting (more checkpointing, a smaller prefill chunk) competes
with the others before anything ranked below is accepted."""
CLOSEST_CONFIRMED = 2
"""When nothing fits: the configurations closest to fitting whose exact figure is computed."""
GPU_COUNTS = tuple(2**k for k in range(11))
"""`--min-gpus` tries 1, 2, 4, ... 1024 GPUs."""
TENSOR_PARALLEL = (1, 2, 4, 8)
"""Tensor-parallel degrees: within a node, where the collectives stay on NVLink."""
PIPELINE_PARALLEL = (1, 2, 4, 8, 16)
EDGE_GUESSES = 4
"""`--maximize`: analytic guesses of the edge, each below the last that failed, before bisecting."""
ENGINES = ("any", "fsdp2", "deepspeed", "accelerate", "trainer", "megatron")
"""`--engine`: who runs the plan. The search keeps the layouts that engine runs as `llamem plan --emit`
writes them (`llamem.bundle.emit.choose`): fsdp2 (torchrun) runs one GPU, DDP and ZeRO-3 as FSDP2,
sized by FSDP2's own accounting; deepspeed runs ZeRO-1/2/3 with or without offload; accelerate and
the Trainer drive both; megatron (Megatron-LM) runs tensor and pipeline parallelism with its
distributed optimizer (ZeRO-1) or none, as arguments only, sized as it runs (`llamem.megatron`)."""


@dataclass(frozen=True, kw_only=True)
class Candidate:
    workload: Workload
    """Per data-parallel replica: its micro-batch and accumulation steps."""
    layout: Layout
    allocated_bytes: int
    device_bytes: int
    seconds: float
    tier: int
    numerics: int = 0
    """How many numerics-changing techniques it uses."""
    host_bytes: int = 0
    confirmed: bool = False
    """Whether `device_bytes` is the exact figure (else the search's allowance)."""

    def fits(self, gpu: GPU, host_budget_bytes: int) -> bool:
        return self.device_bytes <= gpu.memory_bytes and self.host_bytes <= host_budget_bytes

    @property
    def tokens(self) -> int:
        """Tokens one step processes over all GPUs."""
        w = self.workload
        per_replica = w.batch * w.grad_accum * (w.seq + (w.new_tokens if w.task == "infer" else 0))
        return per_replica * self.layout.dp

    @property
    def seconds_per_token(self) -> float:
        return self.seconds / self.tokens

    @property
    def rank(self) -> tuple:
        # On a tie in time, a plan without a new dependency (Liger's kernels) comes first.
        return self.tier, self.seconds_per_token, self.numerics, self.workload.liger, self.device_bytes


@dataclass(frozen=True, kw_only=True)
class Step:
    technique: str
    change: str
    peak_device_bytes: int
    relative_step_time: float
    reason: str
    command: str
    """The `llamem estimate` command that gives this step's figure."""


@dataclass(frozen=True, kw_only=True)
class Space:
    """What one plan searches over: fixed for the whole search."""

    spec: ModelSpec
    gpu: GPU
    host_budget_bytes: int
    teacher: ModelSpec | None = None
    max_tier: int = 1
    model_args: tuple[str, ...] = ()
    """How `llamem estimate` names this model (a preset, or --config PATH, and --override items)."""
    engine: str = "any"
    """Who runs the plan (`ENGINES`)."""
    runnable: Callable[[ModelSpec, Workload, Layout], bool] | None = None
    """With `llamem plan --emit`: only the configurations its launch bundle runs
    (`llamem.bundle.emit.bundle_runs`); None keeps every configuration."""
    teacher_choices: bool = False
    """Whether the search may shard or quantize a distillation teacher (`teacher_candidates`): only in a second
    search, where nothing fits with the teacher as asked (`best`)."""
    evaluated: dict = dataclasses.field(default_factory=dict, init=False, compare=False, repr=False)
    """Each configuration's `evaluate`, kept for the whole search: its rounds and bisection steps
    meet the same configurations again."""

    @property
    def context(self) -> SearchContext:
        from llamem.analytic.compiled import COMPILED_MODEL_TYPES

        return SearchContext(bf16=self.gpu.bf16, fp8=self.gpu.fp8, num_layers=self.spec.num_layers,
                             compile_sized=self.spec.model_type in COMPILED_MODEL_TYPES)


@dataclass(frozen=True, kw_only=True)
class Found:
    """What one search found: the confirmed winner, the closest configuration, and its effort."""

    best: Candidate | None
    closest: Candidate | None
    evaluated: int


@dataclass(frozen=True, kw_only=True)
class Plan:
    model: ModelSpec
    gpu: GPU
    num_gpus: int
    fits: bool
    start: Candidate
    final: Candidate
    steps: tuple[Step, ...]
    command: str
    shortfall_bytes: int = 0
    maximized: dict | None = None
    verification: dict | None = None
    host_budget_bytes: int = 0
    notes: tuple[str, ...] = ()
    engine: str = "any"
    megatron_args: tuple[str, ...] = ()
    """With `engine="megatron"`: the Megatron-LM arguments of the final configuration."""
    advice: str | None = None
    """What to change when nothing fits, where more GPUs are not the answer (None: the usual advice)."""

    @property
    def relative_step_time(self) -> float:
        return relative_time(self.final, self.start)

    @property
    def truncated(self) -> bool:
        return self.final.tier >= TRUNCATION_TIER


def relative_time(c: Candidate, start: Candidate) -> float:
    """Time for the same work (per token) against the starting point."""
    return c.seconds_per_token / start.seconds_per_token if start.seconds else 1.0


# Memory and time of one configuration -----------------------------------------------------------
def evaluate(space: Space, w: Workload, layout: Layout, tier: int = 0, numerics: int = 0,
             margin: float = SEARCH_FRAGMENTATION) -> Candidate:
    allocated = _allocated_bytes(space.spec, w, layout, space.teacher)
    device = int(allocated * (1 + margin)) + non_torch_bytes(layout.num_gpus)
    seconds = step_seconds(space.spec, w, layout, space.gpu) * time_factor(w)
    local = shard_spec(space.spec, layout)
    node_gpus = min(layout.num_gpus, space.gpu.gpus_per_node)
    # ZeRO's offloaded state, and each GPU's offloaded activations (pinned blocks of its layers' inputs)
    host = host_bytes(layout, local.num_params, node_gpus) + host_peak_bytes(local, w) * node_gpus
    return Candidate(workload=w, layout=layout, allocated_bytes=allocated, device_bytes=device, seconds=seconds,
                     tier=tier, numerics=numerics, host_bytes=host)


@lru_cache(maxsize=65536)
def _allocated_bytes(spec: ModelSpec, w: Workload, layout: Layout, teacher: ModelSpec | None) -> int:
    # Sized in the precision the layout's engine runs (`llamem.engine_precision`), as `llamem estimate` does.
    return max(sum(b.values()) for b in per_gpu_phases(spec, runs_as(w, layout), layout, teacher).values())


def confirm(space: Space, c: Candidate) -> Candidate:
    """The candidate with its exact device figure: `llamem estimate`'s for the same configuration."""
    if c.confirmed:
        return c
    local = shard_spec(space.spec, c.layout)
    device = device_memory(local, runs_as(c.workload, c.layout), c.allocated_bytes,
                           num_gpus=c.layout.num_gpus, layout=c.layout).device_bytes
    return dataclasses.replace(c, device_bytes=device, confirmed=True)


def command(space: Space, w: Workload, layout: Layout) -> str:
    """The `llamem estimate` command that reproduces a configuration, figure for figure."""
    parts = ["llamem estimate", *(space.model_args or (space.spec.name,)), *workload_args(w)]
    return " ".join(parts + layout_args(layout))


def layout_args(layout: Layout) -> list[str]:
    if layout.num_gpus == 1 and layout.sharding == "none":
        return []
    parts = [f"--gpus {layout.num_gpus}"]
    parts += [f"--tp {layout.tp}"] if layout.tp > 1 else []
    if layout.pp > 1:
        parts.append(f"--pp {layout.pp}")
        parts += [f"--pp-schedule {layout.pipeline_schedule}"] if layout.pipeline_schedule != "1f1b" else []
    parts.append(f"--sharding {layout.sharding}")
    parts += [f"--offload {layout.offload}"] if layout.offload != "none" else []
    parts += [f"--engine {layout.engine}"] if layout.engine != "deepspeed" else []
    parts += [f"--ep {layout.ep}"] if layout.ep > 1 else []
    return parts


# Search space -----------------------------------------------------------------------------------
def layouts(space: Space, num_gpus: int, w: Workload) -> list[Layout]:
    out = []
    tps = [t for t in TENSOR_PARALLEL if t <= min(num_gpus, space.gpu.gpus_per_node) and num_gpus % t == 0]
    for tp, pp in itertools.product(tps, PIPELINE_PARALLEL):
        if (num_gpus // tp) % pp or pp > space.spec.num_layers:
            continue
        dp = num_gpus // (tp * pp)
        for sharding, offload in _shardings(w, dp):
            if space.engine == "deepspeed" and sharding == "none" and w.is_training:
                sharding = "zero1"  # one GPU under DeepSpeed: ZeRO-1 of one replica holds what it holds alone
            layout = Layout(dp=dp, tp=tp, pp=pp, sharding=sharding, offload=offload)
            if runs_on(space.engine, layout) and not check_layout(space.spec, layout):
                out.append(layout)
                # A mixture of experts may also split its experts ("any" only: the bundle runs it with DDP replicas,
                # `llamem.expert_parallel_engines`).
                out += expert_parallel_variants(space.spec, layout) if space.engine == "any" else []
    return out


def runs_on(engine: str, layout: Layout) -> bool:
    """Whether `engine` runs this layout as the bundle emits it (what no workload setting changes)."""
    data_parallel = layout.tp == 1 and layout.pp == 1
    fsdp2 = data_parallel and layout.offload == "none" and layout.sharding in ("none", "ddp", "zero3")
    deepspeed = data_parallel and layout.sharding in ("zero1", "zero2", "zero3")
    return {"any": True, "fsdp2": fsdp2, "deepspeed": deepspeed, "accelerate": fsdp2 or deepspeed,
            "trainer": fsdp2 or deepspeed,
            "megatron": layout.offload == "none" and layout.sharding in ("none", "ddp", "zero1")}[engine]


def engine_layout(engine: str, layout: Layout, w: Workload) -> Layout | None:
    """The layout as `engine` runs this workload, sized by its accounting, or None where it does not.
    ZeRO-3 without offload is FSDP2 under torchrun and accelerate (the Trainer's too), sized by FSDP2's
    own accounting where it covers the workload (`fsdp2_problems`); elsewhere it is not planned."""
    if engine in ("fsdp2", "accelerate", "trainer") and layout.sharding == "zero3" and layout.offload == "none":
        problems = fsdp2_problems(w, tp=layout.tp, pp=layout.pp, sharding=layout.sharding, offload=layout.offload)
        return None if problems else with_engine(layout, "fsdp2")
    if engine == "megatron":
        return None if megatron_problems(w) else with_engine(layout, "megatron")
    return layout


def _shardings(w: Workload, dp: int) -> list[tuple[str, str]]:
    """(sharding, offload) pairs. Pipelines run 1F1B: GPipe has the same bubble, (p-1)/(M+p-1), and
    keeps all M micro-batches' activations in flight instead of min(p, M), so it never ranks above
    1F1B and is not enumerated (`llamem estimate --pp-schedule gpipe` sizes it)."""
    if not w.is_training:
        return [("none" if dp == 1 else "ddp", "none")]
    pairs = [("none" if dp == 1 else "ddp", "none")]
    for stage in ("zero1", "zero2", "zero3"):
        if dp > 1 or stage != "zero1":
            # ZeRO on one GPU only helps through offload.
            pairs += [(stage, "none")] if dp > 1 else []
            pairs.append((stage, "optimizer"))
    return pairs + [("zero3", "optimizer+params")]


def replica_shares(w: Workload, dp: int, fixed_micro_batch: bool) -> list[tuple[int, int]]:
    """(micro-batch, accumulation) pairs for one of `dp` replicas sharing the global batch, largest
    micro-batch first; none if `dp` does not divide it."""
    if not w.is_training:
        return [(w.batch, w.grad_accum)] if dp == 1 else ([(w.batch // dp, 1)] if w.batch % dp == 0 else [])
    total = w.batch * w.grad_accum
    if total % dp:
        return []
    share = total // dp
    if fixed_micro_batch:
        return [(share, 1)]
    return [(m, share // m) for m in divisors(share) if m <= w.batch]


def divisors(n: int) -> list[int]:
    """The divisors of n, largest first (in O(sqrt n): a batch can be 65,536)."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]), reverse=True)


def memory_knobs(space: Space, w: Workload, changes: dict | None = None) -> list[tuple[dict, bool]]:
    """(settings, whether they cost time) that trade a little time for memory, cheapest first:
    checkpointing and the chunked loss for training, chunked prefill for generation."""
    if not w.is_training:
        chunks = [0] + [c for c in PREFILL_CHUNKS if 0 < c < w.seq]
        return [({"prefill_chunk": c}, c > 0) for c in chunks]
    # Megatron-LM recomputes whole layers (its "selective" recomputes attention only, another policy).
    compiled = (changes or {}).get("compile", w.compile)
    full_only = space.engine == "megatron"
    settings = [a for a in ac_settings(space.spec.num_layers) if not full_only or a["ac_mode"] == "full"]
    losses = [loss for loss in loss_settings(w) if not (compiled and loss.get("liger"))]
    knobs = [({**loss, **ac}, loss != {"loss": "full"} or ac["ac_every"] > 0)
             for loss, ac in itertools.product(losses, settings)]
    if space.spec.is_moe:  # what the analytic engine sizes for experts
        knobs = [k for k in knobs if moe_allows(space.spec, w, {**(changes or {}), **k[0]})]
    return knobs


def loss_settings(w: Workload) -> list[dict]:
    """How the head and loss run, least change first: whole, Liger's fused linear cross-entropy (the
    logits never exist; not for distillation, whose KL term needs them), or torchtune's chunked loss.
    A knob rather than a structural variant: it halves the search, and like the chunked loss it is
    tried only as far as needed."""
    if w.liger:
        return [{"loss": "full"}]
    liger = [{"loss": "full", "liger": True}] if w.task != "distill" else []
    return [{"loss": "full"}] + liger + [{"loss": "chunked"}]


def candidates(space: Space, w: Workload, num_gpus: int, *, margin: float = SEARCH_FRAGMENTATION,
               fixed_micro_batch: bool = False, rejected: frozenset = frozenset()):
    """The fastest acceptable configuration per structural choice (checkpointing and chunked loss
    only as far as needed), and on the way everything tried, for the closest one."""
    variants = [v for v in technique_variants(w, space.context, space.max_tier)
                if moe_allows(space.spec, w, v.changes)]  # what the analytic engine sizes for experts
    for variant, layout in itertools.product(variants,
                                             layouts(space, num_gpus, w)):
        knobs = memory_knobs(space, w, variant.changes)
        for micro, accum in replica_shares(w, layout.dp, fixed_micro_batch):
            # Under pipeline parallelism the accumulation steps are its micro-batches.
            local = dataclasses.replace(layout, microbatches=accum) if layout.pp > 1 else layout
            if variant.changes.get("optimizer_in_backward") and (accum > 1 or not single_device(local)):
                continue  # no accumulation, one GPU (`llamem.parallel.IN_BACKWARD_ONE_GPU`): refused if built
            shape = dict(variant.changes, batch=micro, grad_accum=accum)
            found = yield from _knob_candidates(space, w, shape, local, knobs, variant, margin, rejected)
            # Smaller micro-batches are tried while the larger one needed checkpointing or a chunked
            # loss (they may need less of either, and accumulation costs no time), and under pipeline
            # parallelism, where more micro-batches shrink the bubble.
            if found and layout.pp == 1:
                break


def _knob_candidates(space: Space, w: Workload, shape: dict, layout: Layout, knobs: list[tuple[dict, bool]],
                     variant, margin: float, rejected: frozenset):
    """One structural choice at one micro-batch under each memory knob, cheapest first, up to the
    first that is acceptable; returns whether that one costs no time. The leanest knobs go first
    (`leanest_knobs`): when none of them fits, none of the others can, and the other knobs are not
    built (most of a search's configurations do not fit: this gate saves most of its time)."""
    tried: dict[int, Candidate | None] = {}

    def at(i: int) -> Candidate | None:
        if i not in tried:
            tried[i] = _knob_candidate(space, w, shape, layout, knobs[i][0], variant, margin)
        return tried[i]

    lean = [c for c in map(at, leanest_knobs(knobs)) if c is not None]
    if lean and not any(acceptable(space, c, rejected) for c in lean):
        yield from lean
        yield from offloaded_candidates(space, w, shape, layout, lean, variant, margin, rejected)
        if not space.teacher_choices or "teacher_placement" in shape or "teacher_quant" in shape:
            return False
        gap = min(c.device_bytes for c in lean) - space.gpu.memory_bytes
        return (yield from teacher_candidates(space, w, shape, layout, knobs, variant, margin, rejected, gap))
    for i, (_options, costs_time) in enumerate(knobs):
        c = at(i)
        if c is None:
            continue
        yield c
        if acceptable(space, c, rejected):
            return not costs_time
    return False


def offloaded_candidates(space: Space, w: Workload, shape: dict, layout: Layout, lean: list[Candidate], variant,
                         margin: float, rejected: frozenset):
    """Activation offloading on top of full checkpointing: tried only where no lean knob fits (it adds PCIe
    time to every step), and only where its largest saving, every layer's input, could close the gap."""
    for c in lean:
        cw = c.workload
        if cw.ac_every != 1 or cw.ac_mode != "full" or cw.offload_activations:
            continue
        saving = largest_saving_bytes(shard_spec(space.spec, c.layout), cw) * (1 + margin)
        if c.device_bytes - saving > space.gpu.memory_bytes:
            continue
        options = {"loss": cw.loss, "liger": cw.liger, "ac_every": 1, "ac_mode": "full", "offload_activations": True}
        if not moe_allows(space.spec, cw, options):
            continue
        found = _knob_candidate(space, w, shape, layout, options, variant, margin)
        if found is not None:
            yield found
            if acceptable(space, found, rejected):
                return


def teacher_candidates(space: Space, w: Workload, shape: dict, layout: Layout, knobs: list[tuple[dict, bool]],
                       variant, margin: float, rejected: frozenset, gap_bytes: int):
    """A distillation's teacher sharded over the data-parallel GPUs, then quantized (`teacher_options`): tried
    only where no lean knob fits with the teacher as asked and the option's largest saving could close the
    gap (`gap_bytes`, the leanest knob's excess), each with the knobs again, up to the first option with an
    acceptable configuration; returns what `_knob_candidates` returns for it."""
    for changes, tier in teacher_options(w, layout.dp):
        teacher = shard_spec(space.teacher, layout) if space.teacher is not None else None
        if teacher is None or teacher_saving_bytes(teacher, w, changes, layout.dp) * (1 + margin) < gap_bytes:
            continue
        placed = Variant({**variant.changes, **changes}, max(variant.tier, tier), variant.numerics + (tier > 0))
        seen: list[Candidate] = []
        found = yield from _recorded(_knob_candidates(space, w, {**shape, **changes}, layout, knobs, placed, margin,
                                                      rejected), seen)
        if any(acceptable(space, c, rejected) for c in seen):
            return found
    return False


def _recorded(candidates, seen: list):
    """`candidates` passed on, each also kept in `seen`; returns what the generator returns."""
    while True:
        try:
            c = next(candidates)
        except StopIteration as stop:
            return stop.value
        seen.append(c)
        yield c


@lru_cache(maxsize=65536)
def reshaped(w: Workload, changes: tuple[tuple[str, object], ...]) -> Workload | None:
    """`w` with `changes`, or None where they make it invalid. Kept: a search builds the same few
    thousand workloads again in each of its rounds, and checking one costs more than sizing it."""
    try:
        return dataclasses.replace(w, **dict(changes))
    except InvalidWorkload:
        return None


def leanest_knobs(knobs: list[tuple[dict, bool]]) -> list[int]:
    """Indexes of the knobs that bound the others from below: for training, no checkpointing and full
    checkpointing of every layer under each loss (full checkpointing is the leanest, except on a model
    of a layer or two, where its recompute can outweigh what it saves: then none is), for generation
    no chunking and the smallest prefill chunk."""
    if "prefill_chunk" in knobs[0][0]:
        return sorted({0, len(knobs) - 1})
    return [i for i, (options, _) in enumerate(knobs)
            if options["ac_every"] in (0, 1) and options["ac_mode"] == "full"]


def _knob_candidate(space: Space, w: Workload, shape: dict, layout: Layout, options: dict, variant,
                    margin: float) -> Candidate | None:
    """The configuration under one memory knob, or None where it is invalid or not run as emitted."""
    shaped = reshaped(w, tuple({**shape, **options}.items()))
    if shaped is None:
        return None
    run = engine_layout(space.engine, layout, shaped)
    if shaped.optimizer_in_backward and not single_device(layout):
        return None  # the user's own --optimizer-in-backward on a layout of several GPUs
    if run is None or (space.runnable is not None and not space.runnable(space.spec, shaped, run)):
        return None
    if shaped.teacher_placement == "sharded" and placement_problems(shaped, layout.dp):
        return None  # a teacher asked sharded, on a layout of one replica (tensor or pipeline parallel alone)
    key = (shaped, run, variant.tier, variant.numerics, margin)
    if key not in space.evaluated:
        space.evaluated[key] = evaluate(space, shaped, run, variant.tier, variant.numerics, margin)
    return space.evaluated[key]


def single_device(layout: Layout) -> bool:
    return layout.dp * layout.tp * layout.pp == 1 and layout.sharding == "none" and layout.offload == "none"


def acceptable(space: Space, c: Candidate, rejected: frozenset = frozenset()) -> bool:
    """Fits the card (with the allowance or exactly) and the host budget, and was not rejected exactly."""
    return c.fits(space.gpu, space.host_budget_bytes) and (c.workload, c.layout) not in rejected


def excess(space: Space, c: Candidate) -> int:
    """Bytes over the budgets: the card's, plus the host's for offloading."""
    return max(0, c.device_bytes - space.gpu.memory_bytes) + max(0, c.host_bytes - space.host_budget_bytes)


# The answer -------------------------------------------------------------------------------------
def best(space: Space, w: Workload, num_gpus: int, *, fixed_micro_batch: bool = False,
         closest: bool = True) -> Found:
    """The best configuration that fits, confirmed exactly, or (`closest`) the one closest to fitting."""
    rejected: frozenset = frozenset()
    evaluated = 0
    first_round: list[Candidate] = []
    for _round in range(SEARCH_ROUNDS):
        tried = list(candidates(space, w, num_gpus, fixed_micro_batch=fixed_micro_batch, rejected=rejected))
        evaluated += len(tried)
        first_round = first_round or tried
        fitting = [c for c in tried if acceptable(space, c, rejected)]
        if not fitting:
            break
        top = min(fitting, key=lambda c: c.rank)
        exact = confirm(space, top)
        if acceptable(space, exact):
            return Found(best=exact, closest=None, evaluated=evaluated)
        rejected |= {(top.workload, top.layout)}
    if space.teacher is not None and not space.teacher_choices and w.task == "distill":
        # Nothing fits with the teacher as asked: search again, sharding or quantizing it where that could help.
        found = best(dataclasses.replace(space, teacher_choices=True), w, num_gpus,
                     fixed_micro_batch=fixed_micro_batch, closest=closest)
        return dataclasses.replace(found, evaluated=found.evaluated + evaluated)
    return Found(best=None, closest=_closest(space, first_round) if closest else None, evaluated=evaluated)


def _closest(space: Space, tried: list[Candidate]) -> Candidate | None:
    """The configuration that misses by the least, by its exact figure among the nearest few."""
    if not tried:
        return None
    nearest = sorted(tried, key=lambda c: (excess(space, c), c.rank))[:CLOSEST_CONFIRMED]
    return min((confirm(space, c) for c in nearest), key=lambda c: (excess(space, c), c.rank))


def could_fit(space: Space, w: Workload, num_gpus: int, margin: float, fixed_micro_batch: bool) -> bool:
    """Whether some configuration fits with this fragmentation allowance, from the analytic search alone."""
    return any(acceptable(space, c) for c in candidates(space, w, num_gpus, margin=margin,
                                                         fixed_micro_batch=fixed_micro_batch))


def with_size(w: Workload, what: str, value: int) -> Workload:
    """The workload at another batch (no accumulation) or sequence length."""
    return dataclasses.replace(w, **({"batch": value, "grad_accum": 1} if what == "batch" else {"seq": value}))


def size_limit(spec: ModelSpec, w: Workload, what: str, cap: int = 2**22) -> int:
    """A context never grows past what the model was trained for (max_position_embeddings)."""
    if what != "seq":
        return cap
    return min(cap, spec.max_position_embeddings - (w.new_tokens if w.task == "infer" else 0))


def maximize(space: Space, w: Workload, num_gpus: int, what: str, cap: int = 2**22) -> tuple[int, Found]:
    """Largest batch (no accumulation) or sequence for which some configuration fits, and that
    configuration. The device figure grows with both (`llamem.device`), so a bisection finds the edge:
    first the analytic edge without fragmentation (an upper bound), then guesses with a growing
    allowance below each that failed, then bisection between the last that fits and the first that
    does not."""
    fixed = what == "batch"
    results: dict[int, Found] = {}
    step = batch_step(space, w, num_gpus) if fixed else 1

    def fits(value: int) -> bool:
        if value not in results:
            sized = _sized(w, what, value * step)
            results[value] = Found(best=None, closest=None, evaluated=0) if sized is None else best(
                space, sized, num_gpus, fixed_micro_batch=fixed, closest=False)
        return results[value].best is not None

    def might_fit(value: int, margin: float) -> bool:
        sized = _sized(w, what, value * step)
        return sized is not None and could_fit(space, sized, num_gpus, margin, fixed)

    limit = size_limit(space.spec, w, what, cap) // step
    guess = _largest(lambda v: might_fit(v, 0.0), limit)
    failed, margin = None, SEARCH_FRAGMENTATION / 2
    for _attempt in range(EDGE_GUESSES):
        if guess == 0 or fits(guess):
            break
        failed, margin = guess, 2 * margin
        guess = min(_largest(lambda v: might_fit(v, margin), failed - 1), failed - 1)
    else:
        guess = 1 if fits(1) else 0
    evaluated = sum(f.evaluated for f in results.values())
    if guess == 0 or not fits(guess):
        return 0, Found(best=None, closest=None, evaluated=evaluated)
    value = guess if failed is None else _bisect(fits, guess, failed)
    evaluated = sum(f.evaluated for f in results.values())
    return value * step, dataclasses.replace(results[value], evaluated=evaluated)


def batch_step(space: Space, w: Workload, num_gpus: int) -> int:
    """The global batches `--maximize batch` tries are multiples of this: 1, or under an engine whose
    every layout replicates the model (no tensor or pipeline parallel), the fewest data-parallel
    replicas, which a batch must divide."""
    if space.engine == "any":
        return 1
    return min((layout.dp for layout in layouts(space, num_gpus, w)), default=1)


def _sized(w: Workload, what: str, value: int) -> Workload | None:
    """`with_size`, or None where the size makes the workload invalid (too many prefill chunks)."""
    try:
        return with_size(w, what, value)
    except InvalidWorkload:
        return None


def _largest(fits, limit: int) -> int:
    """Largest value in [1, limit] for which `fits` holds (monotone), 0 if none: doubling, then bisection."""
    if limit < 1 or not fits(1):
        return 0
    low = 1
    while low < limit:
        high = min(low * 2, limit)
        if not fits(high):
            return _bisect(fits, low, high)
        low = high
    return low


def _bisect(fits, low: int, high: int) -> int:
    """Largest value in [low, high) that fits, given that low fits and high does not."""
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low


def shortened(space: Space, w: Workload, num_gpus: int) -> tuple[Candidate | None, int]:
    """The last resort when nothing fits: the longest sequence that does. Generation keeps the last
    tokens of the prompt; training splits each sequence into pieces that fit and runs them as more
    accumulation steps, so a step still sees every token."""
    longest, found = maximize(space, w, num_gpus, "seq", cap=w.seq - 1)
    evaluated = found.evaluated
    if found.best is None:
        return None, evaluated
    chosen = found.best
    if w.is_training:
        pieces = -(-w.seq // longest)
        split = best(space, dataclasses.replace(w, seq=-(-w.seq // pieces), grad_accum=w.grad_accum * pieces),
                     num_gpus)
        evaluated += split.evaluated
        chosen = split.best or chosen
    return dataclasses.replace(chosen, tier=max(chosen.tier, TRUNCATION_TIER)), evaluated


def split_factor(start: Workload, final: Workload) -> int:
    """Pieces each training sequence was split into (1: not split)."""
    if not final.is_training or final.seq >= start.seq:
        return 1
    return -(-start.seq // final.seq)


# The ladder -------------------------------------------------------------------------------------
def ladder(space: Space, start: Candidate, final: Candidate) -> tuple[Step, ...]:
    """One step per technique, in the documented order, each confirmed exactly: every figure is
    what its `command` gives."""
    steps = []
    current_w, current_layout = start.workload, start.layout
    split = split_factor(start.workload, final.workload)
    for name in LADDER_ORDER:
        if name == "layout":
            moved = _layout_step(current_w, current_layout, final.layout)
        else:
            moved = _record_step(name, current_w, current_layout, final.workload, split, final.layout.dp)
        if moved is None:
            continue
        current_w, current_layout, title, change, reason = moved
        layout = dataclasses.replace(current_layout, microbatches=current_w.grad_accum) if (
            current_layout.pp > 1) else current_layout
        layout = _sizable(current_w, layout)
        c = final if (current_w, layout) == (final.workload, final.layout) else confirm(
            space, evaluate(space, current_w, layout))
        steps.append(Step(technique=title, change=change, peak_device_bytes=c.device_bytes,
                          relative_step_time=relative_time(c, start), reason=reason,
                          command=command(space, current_w, layout)))
    return tuple(steps)


def _sizable(w: Workload, layout: Layout) -> Layout:
    """An FSDP2-sized layout on a step of the ladder that FSDP2's accounting does not cover (its
    optimizer or task still the start's) is sized as DeepSpeed runs it, as `llamem estimate` would."""
    if layout.engine == "fsdp2" and fsdp2_problems(w, tp=layout.tp, pp=layout.pp, sharding=layout.sharding,
                                                   offload=layout.offload):
        return with_engine(layout, "deepspeed")
    return layout


def _record_step(name: str, current: Workload, layout: Layout, final: Workload, split: int, final_dp: int):
    """(new workload, layout, title, change, reason) when the technique `name` differs between the two."""
    record = BY_NAME[name]
    if name == "batch":
        target = {"batch": final.batch, "grad_accum": _accumulation(final, split, final_dp, layout.dp)}
    elif name == "seq":
        target = {"seq": final.seq, "grad_accum": final.grad_accum}
    elif name == "qlora":
        target = {"task": final.task, "quant": final.quant}
    else:
        target = {f: getattr(final, f) for f in record.fields}
        if name == "quant" and final.task != current.task:
            return None  # a switch to QLoRA brings its quantization with it
    if all(getattr(current, f) == v for f, v in target.items()):
        return None
    new = dataclasses.replace(current, **target)
    change = _seq_change(current, final, split) if name == "seq" else record.describe_change(new)
    return new, layout, record.title, change, record.explain(current, new)


def _seq_change(current: Workload, final: Workload, split: int) -> str:
    if split > 1:
        return f"split each sequence into {split} of {final.seq} tokens"
    if current.task == "infer":
        return f"keep the last {final.seq} prompt tokens"
    return f"sequences of {final.seq} tokens"


def _accumulation(final: Workload, split: int, final_dp: int, dp: int) -> int:
    """The final micro-batch's accumulation steps on the current replicas: the global batch kept
    while the layout (applied later in the ladder) still has `dp` replicas, not the final `final_dp`."""
    total = final.grad_accum // split * final_dp
    return total // dp if total % dp == 0 else final.grad_accum // split


def _layout_step(current: Workload, layout: Layout, target: Layout):
    """The layout change, with the replicas' share of the global batch kept."""
    target = dataclasses.replace(target, microbatches=layout.microbatches)
    if target == layout:
        return None
    total = current.batch * current.grad_accum * layout.dp
    if current.is_training and total % target.dp == 0:
        share = total // target.dp
        micro = next(m for m in divisors(share) if m <= current.batch)
        current = dataclasses.replace(current, batch=micro, grad_accum=share // micro)
    elif not current.is_training and current.batch * layout.dp % target.dp == 0:
        current = dataclasses.replace(current, batch=current.batch * layout.dp // target.dp)
    # A pipeline's micro-batches are the accumulation steps (`ladder` sizes it so): say so in the step's change.
    shown = dataclasses.replace(target, microbatches=current.grad_accum) if target.pp > 1 else target
    return current, target, LAYOUT_TITLE, shown.describe(), LAYOUT_REASON


# The plan ---------------------------------------------------------------------------------------
def make_plan(spec: ModelSpec, w: Workload, gpu: GPU, *, num_gpus: int = 1, host_budget_bytes: int,
              teacher: ModelSpec | None = None, maximize_what: str | None = None, min_gpus: bool = False,
              max_gpus: int = 1024, exact: bool = False, truncate: bool = True,
              model_args: tuple[str, ...] = (), engine: str = "any",
              runnable: Callable[[ModelSpec, Workload, Layout], bool] | None = None) -> Plan:
    """`exact`: only changes that keep the numerics (tier 0). `truncate`: when nothing fits, shorten
    the sequences as a last resort (not with `min_gpus`, where more GPUs are the answer). `engine`:
    only the layouts that engine runs (`ENGINES`). `runnable`: only the configurations it accepts
    (`Space.runnable`)."""
    check_engine(engine, w)
    if not min_gpus and num_gpus == 1 and placement_problems(w, 1):
        raise InvalidWorkload(placement_problems(w, 1))
    if w.attn == "flash_attention_2" and not gpu.bf16:  # the bf16 flag marks Ampere and newer
        raise InvalidWorkload([f"--attn flash_attention_2: flash-attn 2 has kernels for Ampere or newer only, not "
                               f"{gpu.name}: use --attn sdpa, or another --gpu"])
    space = Space(spec=spec, gpu=gpu, host_budget_bytes=host_budget_bytes, teacher=teacher,
                  max_tier=0 if exact else 1, model_args=model_args, engine=engine, runnable=runnable)
    maximized, capped = None, False
    if maximize_what:
        value, found = maximize(space, w, num_gpus, maximize_what)
        maximized = {"what": maximize_what, "value": value}
        if found.best is None:  # the requested size need not fit: the question is how large it can be
            found = best(space, with_size(w, maximize_what, 1), num_gpus, fixed_micro_batch=maximize_what == "batch")
            found = dataclasses.replace(found, best=None)
    else:
        found, num_gpus, capped = _search_counts(space, w, num_gpus, max_gpus if min_gpus else None)
        if found.best is None and truncate and not min_gpus and w.seq > 1:
            chosen, evaluated = shortened(space, w, num_gpus)
            found = Found(best=chosen, closest=found.closest, evaluated=found.evaluated + evaluated)
    plan = _assemble(space, w, num_gpus, found, maximized)
    return _capped(space, w, plan) if capped else plan


def check_engine(engine: str, w: Workload) -> None:
    if engine not in ENGINES:
        raise UsageError(f"--engine {engine}: choose one of {', '.join(ENGINES)}")
    if engine == "deepspeed" and not w.is_training:
        raise UsageError("--engine deepspeed plans ZeRO training; generation has no ZeRO stage to plan: use "
                         "--engine fsdp2 or any")
    if engine == "megatron" and w.task != "train":
        raise UsageError(f"--engine megatron plans full training (--task train), not --task {w.task}: use "
                         "--engine any, fsdp2, deepspeed, accelerate or trainer")


def _search_counts(space: Space, w: Workload, num_gpus: int, max_gpus: int | None) -> tuple[Found, int, bool]:
    """The search on the given GPUs, or with `max_gpus`, on 1, 2, 4, ... until one fits, and whether
    that search was capped: nothing fits, and beyond the count returned (the largest with a
    configuration to show) no layout takes the workload at all, whatever the GPUs hold."""
    counts = [n for n in GPU_COUNTS if n <= max_gpus] if max_gpus else [num_gpus]
    evaluated, reachable = 0, None
    for count in counts:
        found = best(space, w, count)
        evaluated += found.evaluated
        if found.best is not None:
            break
        if found.closest is not None:
            reachable = (found, count)
    capped = found.best is None and found.closest is None and reachable is not None and count != reachable[1]
    if capped:
        found, count = reachable
    return dataclasses.replace(found, evaluated=evaluated), count, capped


def _assemble(space: Space, w: Workload, num_gpus: int, found: Found, maximized: dict | None) -> Plan:
    final = found.best or found.closest
    if final is None:
        _refuse_fixed_settings(space, w, num_gpus)
        raise DoesNotFit(f"no configuration of {space.spec.name} can run on {num_gpus} x {space.gpu.name}: "
                         f"{_no_layout_reason(space, w, num_gpus)}")
    start = _start(space, w, num_gpus, final, maximized)
    notes = _batch_notes(space, w, num_gpus)
    if found.best is None and final.host_bytes > space.host_budget_bytes:
        notes.append(f"the closest plan offloads to host memory and needs {format_gib(final.host_bytes)} of it "
                     f"(budget {format_gib(space.host_budget_bytes)}, set with --host-memory)")
    if found.best is not None and final.tier >= TRUNCATION_TIER:
        notes.append(_truncation_note(w, final.workload))
    notes += _engine_notes(space.engine) + _fsdp2_adapter_notes(space, w, num_gpus)
    if found.best is not None:
        notes += _generation_notes(space, final)
    if space.runnable is not None and found.best is None:
        notes.append("with --emit the search keeps only the configurations its launch bundle runs: without --emit "
                     "others may fit")
    notes.append(f"{found.evaluated} configurations evaluated")
    return Plan(model=space.spec, gpu=space.gpu, num_gpus=num_gpus, fits=found.best is not None, start=start,
                final=final, steps=ladder(space, start, final), command=command(space, final.workload, final.layout),
                shortfall_bytes=0 if found.best else excess(space, final), maximized=maximized,
                host_budget_bytes=space.host_budget_bytes, notes=tuple(notes), engine=space.engine,
                megatron_args=megatron_args(space.spec, final) if space.engine == "megatron" else ())


def _fsdp2_adapter_notes(space: Space, w: Workload, num_gpus: int) -> list[str]:
    """LoRA on several GPUs under an engine that runs ZeRO-3 as FSDP2: FSDP2 over a peft model is not sized
    (`fsdp2_problems`), so those layouts were left out; say so rather than leave them out silently."""
    if num_gpus == 1 or not w.uses_adapters or space.engine not in ("fsdp2", "accelerate", "trainer"):
        return []
    others = "DDP" if space.engine == "fsdp2" else "DDP and DeepSpeed's ZeRO-1/2 and offload"
    task = {"lora": "LoRA", "qlora": "QLoRA"}.get(w.task, w.task)
    return [f"FSDP2 over a {task} model is not sized by llamem, so --engine {space.engine} planned {others} "
            "only: --engine deepspeed plans its ZeRO-3"]


def _generation_notes(space: Space, final: Candidate) -> list[str]:
    """Generation on several GPUs as one replica: the model split by layers (transformers' device_map, the
    GPUs one after another) against tensor parallel (tp_plan, every GPU on every token), each sized per GPU
    and timed, whichever the plan chose."""
    w, n = final.workload, final.layout.num_gpus
    if w.is_training or n == 1 or final.layout.dp > 1:
        return []
    options = {f"device_map (layers split over {n} GPUs, one busy at a time)": Layout(pp=n),
               f"tensor parallel x{n} (tp_plan, every GPU on every token)": Layout(tp=n)}
    sized = {}
    for name, layout in options.items():
        problems = check_layout(space.spec, layout) + (
            [f"tensor parallel stays in a node of {space.gpu.gpus_per_node} GPUs"] if n > space.gpu.gpus_per_node
            and layout.tp > 1 else [])
        sized[name] = problems[0] if problems else confirm(space, evaluate(space, w, layout))
    reference = next(iter(sized.values()))
    parts = []
    for name, c in sized.items():
        if isinstance(c, str):
            parts.append(f"{name}: not possible ({c})")
            continue
        timing = (f", x{c.seconds / reference.seconds:.2f} the time" if isinstance(reference, Candidate)
                  and c is not reference else "")
        fits = "" if c.fits(space.gpu, space.host_budget_bytes) else ", does not fit"
        parts.append(f"{name}: {format_gib(c.device_bytes)} per GPU{timing}{fits}")
    return ["generation on several GPUs, " + "; ".join(parts)]


DATA_PARALLEL_ENGINES = ("fsdp2", "deepspeed", "accelerate", "trainer")
"""Engines whose every layout replicates the model: each GPU is a data-parallel replica."""


def _refuse_fixed_settings(space: Space, w: Workload, num_gpus: int) -> None:
    """Where no configuration was tried: a setting of the workload that the search never drops and that rules
    out every layout, named as `estimate` names it (exit 1), rather than blamed on the heads and layers."""
    problems = list(moe_problems(space.spec, w))
    if w.optimizer_in_backward and num_gpus > 1:
        problems.append(IN_BACKWARD_ONE_GPU)
    if space.runnable is not None:
        from llamem.bundle.emit import unrun_settings  # the bundle owns what its train.py applies

        if unrun := unrun_settings(w):
            problems.append(f"--emit writes a train.py that does not apply {unrun}: drop --emit, or plan without it")
    if problems:
        raise InvalidWorkload(problems)


def _no_layout_reason(space: Space, w: Workload, num_gpus: int) -> str:
    """Why no configuration at all was tried on `num_gpus` GPUs, with the setting to change."""
    batch = " ".join(_batch_notes(space, w, num_gpus))
    if batch and space.engine in DATA_PARALLEL_ENGINES:
        return (f"{batch}; --engine {space.engine} splits only the batch (every GPU is a data-parallel replica): "
                "--engine any also splits the model (tensor and pipeline parallelism)")
    if batch:
        return batch
    if space.engine == "any":
        return (f"no layout of {num_gpus} GPUs suits the model's {space.spec.num_heads} heads and "
                f"{space.spec.num_layers} layers: try another --gpus")
    return (f"no layout of {num_gpus} GPUs that --engine {space.engine} runs suits this workload: try another "
            "--engine or --gpus")


def _capped(space: Space, w: Workload, plan: Plan) -> Plan:
    """A `--min-gpus` plan that nothing fits, where beyond `plan.num_gpus` GPUs no layout takes the global
    batch: the batch, not the GPUs, is the limit, and the advice says so."""
    total = w.batch * w.grad_accum if w.is_training else w.batch
    engine = f" that --engine {space.engine} runs" if space.engine != "any" else ""
    cause = (f"--min-gpus stopped at {plan.num_gpus} GPU{'s' if plan.num_gpus > 1 else ''}: no layout of more "
             f"GPUs{engine} divides the global batch ({total} per step, --batch x --grad-accum) among its "
             "data-parallel replicas")
    advice = "raise --batch or --grad-accum so that more replicas share the batch"
    if space.engine in DATA_PARALLEL_ENGINES:
        advice += f", or plan with --engine any, which also splits the model (--engine {space.engine} only the batch)"
    notes = plan.notes[:-1] + (cause,) + plan.notes[-1:]
    return dataclasses.replace(plan, notes=notes, advice=f"{cause}: {advice}")


def _engine_notes(engine: str) -> list[str]:
    if engine == "megatron":
        return ["llamem sizes Megatron-LM's model states as it holds them (16-bit weights, fp32 gradient buffer "
                "and main weights, llamem.megatron) and its activations as transformers' Llama layers make them in "
                "16 bits (Megatron's fused kernels and sequence parallelism may keep less); it emits Megatron-LM "
                "arguments only (no launch bundle): pass them to pretrain_gpt.py with your model's architecture "
                "arguments"]
    if engine in ("accelerate", "trainer"):
        return [f"{engine} runs ZeRO-3 without offload as FSDP2 (sized by FSDP2's accounting) and ZeRO-1/2 and "
                "offload with DeepSpeed"]
    return []


def megatron_args(spec: ModelSpec, c: Candidate) -> tuple[str, ...]:
    """Megatron-LM's arguments for a configuration: its parallelism, batch, sequence, precision and
    recomputation. llamem's every-K checkpointing keeps one layer in K as a checkpoint and the rest
    whole: Megatron's block method with that many layers per stage keeps the same activations
    (uniform groups of K would recompute every layer)."""
    w, layout = c.workload, c.layout
    args = [f"--tensor-model-parallel-size {layout.tp}", f"--pipeline-model-parallel-size {layout.pp}"]
    if w.ac_every == 1:
        args.append("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1")
    elif w.ac_every > 1:
        checkpointed = -(-shard_spec(spec, layout).num_layers // w.ac_every)
        args.append(f"--recompute-granularity full --recompute-method block --recompute-num-layers {checkpointed}")
    args += ["--use-distributed-optimizer"] if layout.sharding == "zero1" else []
    args += [f"--micro-batch-size {w.batch}", f"--global-batch-size {w.batch * w.grad_accum * layout.dp}",
             f"--seq-length {w.seq}"]
    args += {"bf16-mixed": ["--bf16"], "fp16-mixed": ["--fp16"]}.get(w.precision, [])
    return tuple(args)


def _start(space: Space, w: Workload, num_gpus: int, reference: Candidate, maximized: dict | None) -> Candidate:
    """The request as asked, on the given GPUs with plain data parallelism (at the size found when
    maximizing)."""
    if maximized:
        # The size found, as a global batch: the reference runs its share on each of its replicas.
        size = reference.workload.batch * reference.workload.grad_accum * reference.layout.dp
        w = dataclasses.replace(w, seq=reference.workload.seq, **(
            {"batch": size, "grad_accum": 1} if maximized["what"] == "batch" else {}))
    shares = replica_shares(w, num_gpus, fixed_micro_batch=False)
    dp = num_gpus if shares else 1
    micro, accum = shares[0] if shares else (w.batch, w.grad_accum)
    start = dataclasses.replace(w, batch=micro, grad_accum=accum)
    return confirm(space, evaluate(space, start, Layout(dp=dp, sharding="ddp" if dp > 1 else "none")))


def _batch_notes(space: Space, w: Workload, num_gpus: int) -> list[str]:
    total = w.batch * w.grad_accum if w.is_training else w.batch
    degrees = sorted({layout.dp for layout in layouts(space, num_gpus, w) if total % layout.dp})
    if not degrees:
        return []
    return [f"the global batch ({total} per step) does not split evenly over {', '.join(map(str, degrees))} "
            "data-parallel replicas, so those layouts were not considered: choose a batch divisible by the "
            "replicas to use them"]


def _truncation_note(w: Workload, final: Workload) -> str:
    if w.task == "infer":
        how = (f"only the last {final.seq} of the {w.seq} prompt tokens are kept (tokenize with "
               f"truncation_side='left', max_length={final.seq})")
    else:
        pieces = split_factor(w, final)
        how = (f"each {w.seq}-token sequence is split into {pieces} of at most {final.seq} tokens, run as "
               f"{pieces}x the accumulation steps: every token is still trained on, with shorter context")
    return (f"nothing fits at {w.seq} tokens, so the plan shortens the sequences: {how}; "
            "use --no-truncation to get the shortfall instead")


def shortfalls(plan: Plan) -> dict[str, int]:
    """What the closest configuration lacks: `device_bytes` on each GPU, `host_bytes` of host memory for
    offload (over --host-memory); their sum is `plan.shortfall_bytes`."""
    return {"device_bytes": max(0, plan.final.device_bytes - plan.gpu.memory_bytes),
            "host_bytes": max(0, plan.final.host_bytes - plan.host_budget_bytes)}


def shortfall_text(plan: Plan) -> str:
    """The closest configuration's needs and what each is over, e.g. "needs 31.13 GiB per GPU (fits the
    card) and 179.49 GiB of host memory for offload, 9.49 GiB over --host-memory (170.00 GiB)"."""
    short = shortfalls(plan)
    device = (f"{format_bytes(short['device_bytes'])} over the card" if short["device_bytes"] else "fits the card")
    text = f"needs {format_gib(plan.final.device_bytes)} per GPU ({device})"
    if short["host_bytes"]:
        text += (f" and {format_gib(plan.final.host_bytes)} of host memory for offload, "
                 f"{format_bytes(short['host_bytes'])} over --host-memory ({format_gib(plan.host_budget_bytes)})")
    return text


def does_not_fit(plan: Plan) -> DoesNotFit:
    advice = plan.advice or ("try more GPUs (--gpus N or --min-gpus), a larger card, more --host-memory, or a "
                             "smaller batch or sequence")
    return DoesNotFit(f"nothing fits {plan.num_gpus} x {plan.gpu.name}: the closest configuration "
                      f"{shortfall_text(plan)}; {advice}", best_plan=plan, shortfall_bytes=plan.shortfall_bytes)


__all__ = ["ENGINES", "make_plan", "Plan", "Candidate", "Step", "Space", "Found", "best", "maximize", "confirm",
           "evaluate", "command", "does_not_fit", "shortfalls", "shortfall_text", "split_factor", "megatron_args"]
