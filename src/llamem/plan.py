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

LORA_DEFAULTS = Workload(task="lora", precision="bf16")

SEARCH_FRAGMENTATION = 0.05
SEARCH_ROUNDS = 3
"""Searches per question: when the simulator rejects configurations that fitted with the margin,
the search runs again without them, so the next memory-saving options are tried."""
AC_CHOICES = (0, 4, 2, 1)
PREFILL_CHUNKS = (0, 8192, 2048, 512)
CHUNKED_LOSS_COST = 0.02
"""Chunked loss runs the head per chunk: assumed 2 % slower."""
CHUNKED_PREFILL_COST = 0.02
"""Chunked prefill runs smaller matmuls and masked attention: assumed 2 % slower."""
ORDER = ("precision", "quant", "task", "kv_dtype", "prefill_chunk", "ac_every", "loss", "optimizer", "batch",
         "layout", "seq")
TECHNIQUE_NAMES = {"precision": "precision", "quant": "weight quantization", "task": "LoRA -> QLoRA",
                   "kv_dtype": "KV-cache dtype", "prefill_chunk": "chunked prefill",
                   "ac_every": "activation checkpointing", "loss": "chunked loss",
                   "optimizer": "optimizer", "batch": "micro-batch x gradient accumulation",
                   "layout": "parallelism / sharding / offload", "seq": "sequence length"}
TRUNCATION_TIER = 2
"""Tier of the last resort: shorter sequences change what the model sees."""
REASONS = {
    "precision": "pure bf16 drops the fp32 master weights, their gradients and the autocast copies",
    "quant": "quantized weights take 1 (int8) or 0.5 (nf4/int4) bytes per parameter",
    "task": "a 4-bit base under the adapters quarters the frozen weights",
    "kv_dtype": "a smaller KV-cache dtype shrinks the cache in proportion",
    "prefill_chunk": "the prompt runs a chunk at a time against the cache: same outputs, smaller temporaries",
    "ac_every": "checkpointing keeps layer inputs only and recomputes the rest in backward",
    "loss": "the head and its fp32 loss buffers run one chunk of the sequence at a time",
    "optimizer": "smaller optimizer state (8-bit moments or a factored second moment)",
    "batch": "a smaller micro-batch shrinks activations; accumulation keeps the global batch",
    "layout": "spreading weights, gradients and optimizer state over GPUs (or to host memory)",
    "seq": "nothing else fits: shorter sequences (the model sees less context)",
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

    @property
    def tokens(self) -> int:
        """Tokens one step processes over all GPUs (data-parallel replicas each run the micro-batches)."""
        w = self.workload
        per_replica = w.batch * w.grad_accum * (w.seq + (w.new_tokens if w.task == "infer" else 0))
        return per_replica * self.layout.dp

    @property
    def seconds_per_token(self) -> float:
        """Plans are ranked by this, so that layouts with different global batches compare fairly."""
        return self.seconds / self.tokens


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
        return relative_time(self.final, self.start)

    @property
    def truncated(self) -> bool:
        return self.final.tier >= TRUNCATION_TIER


def relative_time(c: Candidate, start: Candidate) -> float:
    """Time for the same work (per token) against the starting point."""
    return c.seconds_per_token / start.seconds_per_token if start.seconds else 1.0


class Planner:
    def __init__(self, spec: ModelSpec, gpu: GPU, *, host_budget_bytes: int, teacher: ModelSpec | None = None,
                 max_tier: int = 1):
        self.spec, self.gpu, self.teacher = spec, gpu, teacher
        self.max_tier = max_tier
        self.host_budget = host_budget_bytes
        self.cache: dict[tuple, dict[str, dict[str, int]]] = {}
        self.evaluated = 0
        self.margin = SEARCH_FRAGMENTATION
        self.observed = 0.0  # fragmentation the last `best` found where the search margin fell short
        self.exact_cache: dict[tuple, int] = {}
        self.rejected: set[tuple] = set()  # (workload, layout) that fitted with the margin, not when replayed

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
        device = int(allocated * (1 + self.margin)) + non_torch_bytes(layout.num_gpus)
        seconds = step_seconds(self.spec, w, layout, self.gpu) * (1 + CHUNKED_LOSS_COST * (w.loss == "chunked")) * (
            1 + CHUNKED_PREFILL_COST * (w.prefill_step < w.seq))
        host = host_bytes(layout, local.num_params, min(layout.num_gpus, self.gpu.gpus_per_node))
        return Candidate(w, layout, allocated, device, seconds, tier, host)

    def exact_device_bytes(self, c: Candidate, runs_within: int | None = None) -> int:
        """Device bytes with fragmentation from replaying the plan's allocation schedule through the
        allocator simulator (`required_reserved_bytes`), its ratio applied to the analytic peak;
        `runs_within`: device bytes a confirmed generation plan is known to run in."""
        from llamem.allocator.replay import peak_allocated_bytes, required_reserved_bytes

        events = self._schedule(c)
        known = None
        if runs_within is not None:  # to the schedule's scale, without the non-torch part
            overhead = non_torch_bytes(c.layout.num_gpus)
            known = (runs_within - overhead) * peak_allocated_bytes(events) // max(c.allocated_bytes, 1)
        allocated, reserved = required_reserved_bytes(events, smallest_card=c.workload.task == "infer",
                                                      runs_within=known)
        return _scaled(c, allocated, reserved)

    def confirmed_bytes(self, c: Candidate) -> int:
        """`exact_device_bytes` for the search's confirmations, with one replay. Generation is asked
        whether it runs on a card of the budget (the smallest card it runs on is not larger), and
        answers its peak reserved there, or just over the card if it runs out."""
        from llamem.allocator.replay import peak_allocated_bytes, runs_on_card

        key = (c.workload, c.layout)
        if key not in self.exact_cache:
            if c.workload.task != "infer":
                self.exact_cache[key] = self.exact_device_bytes(c)
            else:
                events = self._schedule(c)
                peak = max(peak_allocated_bytes(events), 1)
                room = self.gpu.memory_bytes - non_torch_bytes(c.layout.num_gpus)
                reserved = runs_on_card(events, room * peak // max(c.allocated_bytes, 1))
                if reserved is None:  # ran out: just over the card
                    reserved = (room + 1) * peak // max(c.allocated_bytes, 1) + 1
                self.exact_cache[key] = _scaled(c, peak, reserved)
        return self.exact_cache[key]

    def _schedule(self, c: Candidate):
        from llamem.analytic.schedule import schedule

        return schedule(shard_spec(self.spec, c.layout), c.workload)

    # Search space ---------------------------------------------------------------------------
    def layouts(self, num_gpus: int, w: Workload) -> list[Layout]:
        out = []
        tps = [t for t in (1, 2, 4, 8) if t <= min(num_gpus, self.gpu.gpus_per_node) and num_gpus % t == 0]
        for tp in tps:
            for pp in [p for p in (1, 2, 4, 8, 16) if (num_gpus // tp) % p == 0 and p <= self.spec.num_layers]:
                dp = num_gpus // (tp * pp)
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
                    # Pipelines run 1F1B: GPipe has the same bubble, (p-1)/(M+p-1), and keeps all M
                    # micro-batches' activations in flight instead of min(p, M), so it never ranks
                    # above 1F1B and is not enumerated (`llamem estimate --pp-schedule gpipe` sizes it).
                    for offload in offloads:
                        if dp == 1 and sharding in ("zero2", "zero3") and offload == "none":
                            continue  # ZeRO on one GPU only helps through offload
                        layout = Layout(dp=dp, tp=tp, pp=pp, sharding=sharding, offload=offload)
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
        variants = [(c, t) for c, t in self.structural_variants(w) if t <= self.max_tier]
        for (changes, tier), layout in itertools.product(variants, self.layouts(num_gpus, w)):
            for micro, accum in self.micro_batches(w):
                # Under pipeline parallelism the accumulation steps are its micro-batches.
                local = dataclasses.replace(layout, microbatches=accum) if layout.pp > 1 else layout
                found = False
                for options, costs_time in self.memory_knobs(w):
                    try:
                        variant = dataclasses.replace(w, **changes, **options, batch=micro, grad_accum=accum)
                    except InvalidWorkload:
                        continue
                    candidate = self.evaluate(variant, local, tier)
                    yield candidate
                    if self.acceptable(candidate):
                        found = not costs_time
                        break
                # Smaller micro-batches are tried while the larger one needed checkpointing or a
                # chunked loss (they may need less of either, and accumulation costs no time), and
                # under pipeline parallelism, where more micro-batches shrink the bubble.
                if found and layout.pp == 1:
                    break

    def memory_knobs(self, w: Workload) -> list[tuple[dict, bool]]:
        """(settings, whether they cost time) that trade a little time for memory, cheapest first:
        checkpointing and the chunked loss for training, chunked prefill for generation."""
        if not w.is_training:
            chunks = [0] + [c for c in PREFILL_CHUNKS if 0 < c < w.seq]
            return [({"prefill_chunk": c}, c > 0) for c in chunks]
        ac_choices = [a for a in AC_CHOICES if a == 0 or a <= self.spec.num_layers]
        return [({"loss": loss, "ac_every": ac}, loss != "full" or ac > 0)
                for loss, ac in itertools.product(["full", "chunked"], ac_choices)]

    # The answer ------------------------------------------------------------------------------
    def best(self, w: Workload, num_gpus: int) -> tuple[Candidate | None, Candidate]:
        """The fastest configuration that fits, confirmed by the allocator simulator, and the one
        closest to fitting (for the shortfall)."""
        self.observed = 0.0
        for _round in range(SEARCH_ROUNDS):
            found, smallest, rejected = self._best_round(w, num_gpus)
            if found is not None or not rejected:
                return found, smallest
        return None, smallest

    def _best_round(self, w: Workload, num_gpus: int) -> tuple[Candidate | None, Candidate, int]:
        """(confirmed winner, closest to fitting, how many the simulator rejected this round)."""
        fitting, smallest = [], None
        for c in self.candidates(w, num_gpus):
            if smallest is None or self.excess(c) < self.excess(smallest):
                smallest = c
            if self.acceptable(c):
                fitting.append(c)
        fitting.sort(key=lambda c: (c.tier, c.seconds_per_token, c.device_bytes))
        for index, c in enumerate(fitting[:8]):  # confirm with the allocator simulator, best first
            exact = dataclasses.replace(c, device_bytes=self.confirmed_bytes(c))
            if exact.fits(self.gpu):
                return exact, smallest, index
            self.rejected.add((c.workload, c.layout))
            reserved = exact.device_bytes - non_torch_bytes(c.layout.num_gpus)
            self.observed = max(self.observed, reserved / max(c.allocated_bytes, 1) - 1)
        return None, smallest, min(len(fitting), 8)

    def acceptable(self, c: Candidate) -> bool:
        """Fits with the search margin, within the host budget, and not rejected by the simulator."""
        return c.fits(self.gpu) and c.host_bytes <= self.host_budget and (c.workload, c.layout) not in self.rejected

    def could_fit(self, w: Workload, num_gpus: int, fragmentation: float = 0.0) -> bool:
        """Whether some configuration fits with this much fragmentation (none: an upper bound), from
        the analytic search alone."""
        margin, self.margin = self.margin, fragmentation
        try:
            return any(self.acceptable(c) for c in self.candidates(w, num_gpus))
        finally:
            self.margin = margin

    def excess(self, c: Candidate) -> int:
        """Bytes over the budgets: the card's, plus the host's for offloading."""
        return max(0, c.device_bytes - self.gpu.memory_bytes) + max(0, c.host_bytes - self.host_budget)

    def start_candidate(self, w: Workload, num_gpus: int) -> Candidate:
        layout = Layout(dp=num_gpus, sharding="ddp" if num_gpus > 1 else "none")
        return self.evaluate(w, layout)

    def truncated(self, w: Workload, num_gpus: int) -> Candidate | None:
        """The last resort when nothing fits: the longest sequence that does. Generation keeps the
        last tokens of the prompt; training splits each sequence into pieces that fit and runs them
        as more accumulation steps, so a step still sees every token."""
        longest, found = self.maximize(w, num_gpus, "seq", cap=w.seq - 1)
        self.fixed_micro_batch = False
        if found is None:
            return None
        if w.is_training:
            pieces = -(-w.seq // longest)
            split = self.best(dataclasses.replace(w, seq=-(-w.seq // pieces), grad_accum=w.grad_accum * pieces),
                              num_gpus)[0]
            found = split or found
        return dataclasses.replace(found, tier=max(found.tier, TRUNCATION_TIER))

    def ladder(self, start: Candidate, final: Candidate) -> list[Step]:
        steps, current_w, current_layout = [], start.workload, start.layout
        split = split_factor(start.workload, final.workload)
        for name in ORDER:
            if name == "layout":
                target = dataclasses.replace(final.layout, microbatches=current_layout.microbatches)
                if target == current_layout:
                    continue
                current_layout = target
                change = final.layout.describe()
            elif name == "batch":
                accum = final.workload.grad_accum // split
                if (final.workload.batch, accum) == (current_w.batch, current_w.grad_accum):
                    continue
                current_w = dataclasses.replace(current_w, batch=final.workload.batch, grad_accum=accum)
                change = f"micro-batch {final.workload.batch} x {accum} accumulation steps"
            elif name == "seq":
                if final.workload.seq == current_w.seq:
                    continue
                current_w = dataclasses.replace(current_w, seq=final.workload.seq, grad_accum=final.workload.grad_accum)
                change = (f"split each sequence into {split} of {final.workload.seq} tokens" if split > 1 else
                          f"keep the last {final.workload.seq} prompt tokens" if current_w.task == "infer" else
                          f"sequences of {final.workload.seq} tokens")
            else:
                new = getattr(final.workload, name)
                if new == getattr(current_w, name) or (name == "quant" and final.workload.task != current_w.task):
                    continue  # (a switch to QLoRA brings its quantization with it)
                extra = {"quant": final.workload.quant} if name == "task" else {}
                current_w = dataclasses.replace(current_w, **{name: new}, **extra)
                change = _change(name, final.workload)
            layout = dataclasses.replace(current_layout, microbatches=current_w.grad_accum) if (
                current_layout.pp > 1) else current_layout
            c = self.evaluate(current_w, layout)
            # The simulator confirms the last step (the final plan); earlier ones use the search margin.
            device = final.device_bytes if (current_w == final.workload and layout == final.layout) else (
                c.device_bytes)
            steps.append(Step(TECHNIQUE_NAMES[name], change, device, relative_time(c, start), REASONS[name]))
        return steps

    def maximize(self, w: Workload, num_gpus: int, what: str, cap: int = 2**22) -> tuple[int, Candidate | None]:
        """Largest batch (no accumulation) or sequence for which some configuration fits,
        and that configuration. Memory grows with both, so a bisection finds the edge."""
        self.fixed_micro_batch = what == "batch"

        def at(value: int) -> Workload:
            return dataclasses.replace(w, **({"batch": value, "grad_accum": 1} if what == "batch" else {"seq": value}))

        # A context never grows past what the model was trained for (max_position_embeddings).
        limit = min(cap, self.spec.max_position_embeddings - (w.new_tokens if w.task == "infer" else 0)
                    ) if what == "seq" else cap
        # First the edge without fragmentation, from the analytic search alone: an upper bound. Then
        # the allocator simulator's answer below it: where a value does not fit, the fragmentation it
        # found gives the next guess (an analytic edge again), and a bisection settles the rest.
        confirmed: dict[int, Candidate | None] = {}

        def fits(value: int) -> bool:
            if value not in confirmed:
                confirmed[value] = self.best(at(value), num_gpus)[0]
            return confirmed[value] is not None

        guess = _largest(lambda v: self.could_fit(at(v), num_gpus), limit)
        failed, margin = None, SEARCH_FRAGMENTATION / 2
        for _step in range(4):
            if guess == 0 or fits(guess):
                break
            failed = guess
            margin = max(self.observed, 2 * margin)  # at least doubling: the guesses fall geometrically
            guess = min(_largest(lambda v: self.could_fit(at(v), num_gpus, margin), failed - 1), failed - 1)
        else:
            guess = 1 if fits(1) else 0
        if guess == 0 or not fits(guess):
            return 0, None
        value = guess if failed is None else _bisect(fits, guess, failed)
        return value, confirmed[value]


def _largest(fits, limit: int) -> int:
    """Largest value in [1, limit] for which `fits` holds (monotone), 0 if none: doubling, then bisection."""
    if not fits(1):
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


def _scaled(c: Candidate, allocated: int, reserved: int) -> int:
    """The schedule's fragmentation carried over to the candidate's analytic peak, plus the rest."""
    ratio = max(0.0, reserved / max(allocated, 1) - 1)
    return int(c.allocated_bytes * (1 + ratio)) + non_torch_bytes(c.layout.num_gpus)


def _change(name: str, w: Workload) -> str:
    if name == "ac_every":
        return f"ac {w.ac_label}"
    if name == "prefill_chunk":
        return f"prefill in chunks of {w.prefill_chunk} tokens"
    return f"{name.replace('_', ' ')} {getattr(w, name)}"


def split_factor(start: Workload, final: Workload) -> int:
    """Pieces each training sequence was split into (1: not split)."""
    if not final.is_training or final.seq >= start.seq:
        return 1
    return -(-start.seq // final.seq)


def make_plan(spec: ModelSpec, w: Workload, gpu: GPU, *, num_gpus: int = 1, host_budget_bytes: int,
              teacher: ModelSpec | None = None, maximize: str | None = None, min_gpus: bool = False,
              max_gpus: int = 1024, exact: bool = False, truncate: bool = True) -> Plan:
    """`exact`: only changes that keep the numerics (tier 0). `truncate`: when nothing fits,
    shorten the sequences as a last resort (not with `min_gpus`, where more GPUs are the answer)."""
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
        if final is None and truncate and not min_gpus and w.seq > 1:
            final = planner.truncated(w, num_gpus)
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
        if final.workload.task == "infer":
            # Confirmed on a card of the budget, where the allocator keeps what it can: the figure
            # shown is the smallest card it runs on, as `llamem estimate` gives it.
            final = dataclasses.replace(final, device_bytes=min(final.device_bytes, planner.exact_device_bytes(
                final, runs_within=final.device_bytes)))
        plan = Plan(spec, gpu, num_gpus, True, start, final, planner.ladder(start, final),
                    host_budget_bytes=host_budget_bytes, maximized=maximized)
        if plan.truncated:
            plan.notes.append(_truncation_note(w, final.workload))
    plan.notes.append(f"{planner.evaluated} configurations evaluated")
    return plan


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


def estimate_command(plan: Plan) -> str:
    """The `llamem estimate` command that reproduces the final configuration."""
    w, layout = plan.final.workload, plan.final.layout
    parts = ["llamem estimate", plan.model.name.split(" (")[0], f"--task {w.task}", f"--batch {w.batch}",
             f"--seq {w.seq}", f"--precision {w.precision}"]
    if w.task == "infer":
        parts += [f"--new-tokens {w.new_tokens}", f"--kv-dtype {w.kv_dtype}"]
        if w.prefill_chunk:
            parts.append(f"--prefill-chunk {w.prefill_chunk}")
    else:
        parts += [f"--optimizer {w.optimizer}", f"--ac {w.ac_label}"]
        if w.grad_accum > 1:
            parts.append(f"--grad-accum {w.grad_accum}")
        if w.loss != "full":
            parts.append(f"--loss {w.loss}")
    if w.quant != "none":
        parts.append(f"--quant {w.quant}")
    if w.uses_adapters and w.lora_rank != LORA_DEFAULTS.lora_rank:
        parts.append(f"--lora-rank {w.lora_rank}")
    if w.uses_adapters and w.lora_targets != LORA_DEFAULTS.lora_targets:
        parts.append("--lora-targets " + ",".join(w.lora_targets))
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
            if layout.pipeline_schedule != "1f1b":
                parts.append(f"--pp-schedule {layout.pipeline_schedule}")
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
