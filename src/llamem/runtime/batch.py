"""The largest batch that fits: predicted by the memory model, confirmed by real steps.

accelerate's `find_executable_batch_size` starts at a guess and multiplies by 0.9 after every
OOM (30 tries from 8192 in the research runs); Lightning's power mode doubles and keeps the last
power of two that fits, which can leave half the card unused. Here the analytic engine predicts
the edge for the model's own workload (`infer_workload`), real steps at that batch confirm it,
and an OOM steps down by the measured overshoot over the per-sample memory, never by halving.

What is held against the card:
- under a `CpuMemoryTracker`: the allocated peak. The tracker counts every live storage (512-byte
  rounding) and nothing else, no allocator cache and no CUDA context, so the allocated peak is
  exactly what it compares with its capacity. The analytic engine predicts it to the byte for a
  plain training step (the trace engine's step: forward with labels, backward, clip, optimizer).
- on CUDA: the device figure (`llamem.device`): allocated + the caching allocator's fragmentation
  + the CUDA context, because the card must hold all three. Probes measure peak reserved + the
  non-torch bytes (NVML's, else the overhead model's). `margin` keeps 3 % of the card free by
  default for what neither sees (other processes, allocator spikes); 0 on the tracker.

A probe is one batch size tried. For training it runs `step` twice: the first step of a run
creates the optimizer state, the second is the steady state every later step repeats (one step
would miss the optimizer state and pass a batch that fails at step 2). Nothing leaks between
probes: the finder clears the state of the optimizer given as `optimizer=` (the one `step`
uses) and the model's gradients after every probe, so state created by one probe is never
counted twice. Probes train the model on their batches, as accelerate's do: run the finder
before training. Recovery from an OOM runs outside the `except` block: the exception's traceback
keeps the failed step's frames, and their tensors, alive (pytorch/pytorch#18853).

The prediction assumes the step drops the model's output before backward, as the Trainer does
(`model(**batch).loss.backward()`). The other idiom, `out = model(**batch); out.loss.backward()`
(transformers' no_trainer examples), keeps `out` alive until the next step's forward has
returned: its logits (batch x seq x vocab in the compute dtype: 4 bytes under fp32, 2 under
bf16/fp16 or autocast, whose fp32 upcast lives inside the loss only), its DynamicCache (every
layer's K and V; none under activation checkpointing) and the loss. `keeps_outputs=True` adds
them to every phase (`held_output_bytes`). Measured on a tiny Llama (vocab 512, hidden 64, 2
layers) under a CpuMemoryTracker, batch 7 x 128 tokens, fp32 AdamW: the step's peak grows from
15,753,728 B to 17,588,736 B (+11.6 %, exactly the logits' 1,835,008 B), the forward phase by
2,294,272 B (the previous step's logits, K and V and loss) and the optimizer phase by 2,293,760 B.
In backward the prediction is an upper bound: the cache's K and V are counted again although
attention saved them anyway (458,752 B, 2.6 %, above the measured backward peak there; under
bf16 autocast V's bytes alone, since attention saves a bf16 copy of K, not the cache's fp32 K).
A later moment of backward, with some saved tensors freed but the cache still held, stays below
that bound.
"""

from __future__ import annotations

import functools
import gc
import math
from dataclasses import dataclass

from llamem.errors import DoesNotFit, LlamemError
from llamem.model import ModelSpec
from llamem.units import MAX_SIZE_BYTES, format_bytes
from llamem.workload import MAX_BATCH, Workload, with_changes

DEFAULT_CUDA_MARGIN = 0.03
"""Fraction of a real card kept free beyond the device figure (Lightning's binsearch keeps 5 %
below an edge found by probes alone; the prediction here already counts fragmentation and the
CUDA context)."""
MAX_PROBES = 12
"""Batch sizes one search may try: a prediction within a few per cent needs one or two."""
STEP_UPS = 1
"""Tries above a confirmed fit when the measured headroom says one more sample might fit."""
BLIND_STEP_UPS = 4
"""Without a prediction: doublings from batch 1 until two fits give a per-sample figure."""
_OOM_TEXTS = (" out of memory.", "DefaultCPUAllocator: can't allocate memory", "MPS backend out of memory")
"""What accelerate's `should_reduce_batch_size` recognises (torch.OutOfMemoryError is a RuntimeError)."""
_STATED_BY = {"autocast": "autocast_dtype=", "optimizer: none given": "optimizer="}
"""The argument that states what `infer_workload` could not read, by the start of its note."""


class InvalidArgument(LlamemError, ValueError):
    """An argument of the batch finder or of token-budget batching that cannot be used (a
    ValueError too, as torch's samplers raise): the message names the argument and the fix."""


@dataclass(frozen=True, slots=True)
class Probe:
    batch: int
    fit: bool
    """The probe's steps ran without an OOM and their peak stayed within the budget."""
    peak_bytes: int | None
    """The probe's peak in the compared figure. After an OOM: what was held when the failing
    allocation was asked for, plus that allocation (a lower bound of what the step needs).
    None without a memory source."""


@dataclass(frozen=True, slots=True)
class BatchSizeResult:
    batch_size: int
    """The largest batch confirmed by real steps."""
    probes: tuple[Probe, ...]
    predicted_batch: int | None
    """The analytic engine's largest batch for the budget (None when it cannot size the model)."""
    per_sample_bytes: int | None
    """predicted(b + 1) - predicted(b) at the found batch, allocated bytes."""
    budget_bytes: int
    """The card's bytes less the margin: what the figure is held against."""
    figure: str
    """"allocated" (tracker, or a CPU without one) or "device" (CUDA): see the module."""
    grad_accum: int | None = None
    """With `global_batch`: the accumulation steps that keep it."""
    micro_batch: int | None = None
    """With `global_batch`: ceil(global_batch / grad_accum), at most `batch_size`."""
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Predictor:
    """The analytic peak of the workload at any batch, in the figure compared with the card, plus
    what was already live before the first probe beyond the model's weights (`offset_bytes`)."""

    spec: ModelSpec
    workload: Workload
    figure: str
    offset_bytes: int = 0
    keeps_outputs: bool = False
    """The step keeps the model's output alive (`out = model(**batch)`): see the module."""

    def allocated_bytes(self, batch: int, *, previous_tokens: int | None = None, **changes) -> int:
        """The peak at `batch` (and `changes`, e.g. seq=). With `keeps_outputs` the output of the
        step before, of `previous_tokens` tokens (default: this batch's), is alive in forward."""
        from llamem.analytic import estimate

        w = with_changes(self.workload, batch=batch, **changes)
        report = estimate(self.spec, w)
        if not self.keeps_outputs:
            return report.peak_allocated_bytes + self.offset_bytes
        tokens = w.batch * w.seq
        held = held_output_bytes(self.spec, w, tokens)
        before = held_output_bytes(self.spec, w, tokens if previous_tokens is None else previous_tokens)
        peaks = [peak + (before if phase == "forward" else held)
                 for phase, peak in report.phase_peaks.items() if phase != "load"]
        return max(peaks) + self.offset_bytes

    def peak_bytes(self, batch: int, **changes) -> int:
        allocated = self.allocated_bytes(batch, **changes)
        if self.figure == "allocated":
            return allocated
        from llamem.device import device_memory

        w = with_changes(self.workload, batch=batch, **changes)
        return device_memory(self.spec, w, allocated).device_bytes

    def per_sample_bytes(self, batch: int, **changes) -> int:
        return self.allocated_bytes(batch + 1, **changes) - self.allocated_bytes(batch, **changes)

    def largest(self, budget_bytes: int, limit: int, **changes) -> int:
        """Largest batch in [1, limit] whose predicted peak fits, 0 if none. The device figure is
        slower (an allocator replay) and never below the allocated one, so the allocated edge
        bounds its search."""
        top = largest_true(lambda b: self.allocated_bytes(b, **changes) <= budget_bytes, limit)
        if self.figure == "allocated" or top == 0:
            return top
        return largest_true(lambda b: self.peak_bytes(b, **changes) <= budget_bytes, top)


def held_output_bytes(spec: ModelSpec, workload: Workload, tokens: int) -> int:
    """What a kept `CausalLMOutputWithPast` of `tokens` tokens holds: the logits (compute dtype),
    the DynamicCache transformers builds in training without checkpointing (per layer: K, an
    fp32 copy under autocast, and V in the compute dtype) and the loss (one 512-byte block).
    Measured to the byte on a tiny Llama under a CpuMemoryTracker (tests/test_runtime_batch.py)."""
    from llamem.analytic.common import r512

    element_bytes = 4 if workload.compute_dtype == "fp32" else 2
    logits = r512(element_bytes * tokens * spec.vocab_size)
    key_bytes = 4 if workload.mixed else element_bytes  # RoPE's fp32 cos/sin promote K under autocast
    cache = 0 if workload.ac_every else spec.num_layers * (r512(key_bytes * tokens * spec.kv_dim)
                                                           + r512(element_bytes * tokens * spec.kv_dim))
    return logits + cache + 512


def largest_true(holds, limit: int) -> int:
    """Largest value in [1, limit] for which the monotone `holds` is true, 0 if none: doubling,
    then bisection."""
    if limit < 1 or not holds(1):
        return 0
    low = 1
    while low < limit:
        high = min(2 * low, limit)
        if not holds(high):
            while high - low > 1:
                mid = (low + high) // 2
                low, high = (mid, high) if holds(mid) else (low, mid)
            return low
        low = high
    return low


@dataclass
class Card:
    """The memory source seen as one figure: the tracker's allocated bytes, or CUDA's reserved
    bytes plus what lives outside torch. Without a source (a plain CPU) nothing is measured."""

    source: object | None
    figure: str
    capacity_bytes: int
    budget_bytes: int
    non_torch_bytes: int = 0

    def _figure(self, stats: dict, key: str) -> int:
        if self.figure == "allocated":
            return stats["peak_allocated_bytes" if key == "peak" else "allocated_bytes"]
        non_torch = stats["non_torch_bytes"] if stats["non_torch_bytes"] is not None else self.non_torch_bytes
        return stats["peak_reserved_bytes" if key == "peak" else "reserved_bytes"] + non_torch

    def peak_bytes(self) -> int | None:
        return None if self.source is None else self._figure(self.source.stats(), "peak")

    def now_bytes(self) -> int | None:
        return None if self.source is None else self._figure(self.source.stats(), "now")

    def allocated_bytes(self) -> int | None:
        return None if self.source is None else self.source.stats()["allocated_bytes"]

    def recover(self) -> None:
        """After a probe, outside any `except`: collect what the failed step's frames held, give
        cached blocks back, and start the next probe's peak from what is live now."""
        gc.collect()
        if self.source is not None:
            self.source.empty_cache()
            self.source.reset_peak()


@dataclass(frozen=True, slots=True)
class Policy:
    steps_per_probe: int
    step_ups: int
    max_probes: int
    blind_step_ups: int = BLIND_STEP_UPS
    within_budget: bool = True
    """A probe fits only if its peak stays within the budget (False: if it ran at all)."""
    settle: bool = True
    """After a fit, keep probing towards the edge (False: the first completed run ends the search)."""


def find_batch_size(step, *, model, seq: int, task: str = "train", device_bytes: int | None = None,
                    optimizer=None, tracker=None, max_batch: int | None = None, global_batch: int | None = None,
                    margin: float | None = None, autocast_dtype: str | None = None,
                    steps_per_probe: int | None = None, max_probes: int = MAX_PROBES,
                    keeps_outputs: bool = False) -> BatchSizeResult:
    """The largest batch at which `step(batch)` runs: predicted, then confirmed with real steps.

    `step(batch)` runs one full step (forward, backward, optimizer) at that batch and the longest
    sequence `seq`, with `optimizer` if one is given (its state is cleared after every probe).
    `autocast_dtype` ("bf16", "fp16", or "fp32" for none) says how fp32 weights are run.
    The prediction assumes the step drops the model's output before backward
    (`model(**batch).loss.backward()`, as the Trainer does); pass `keeps_outputs=True` when it
    keeps it (`out = model(**batch); out.loss.backward()`): its logits and cache are added.
    """
    _check_arguments(seq=seq, max_batch=max_batch, global_batch=global_batch, margin=margin,
                     steps_per_probe=steps_per_probe, max_probes=max_probes, device_bytes=device_bytes,
                     task=task, keeps_outputs=keeps_outputs)
    training = task != "infer"
    policy = Policy(steps_per_probe or (2 if training else 1), STEP_UPS, max_probes)
    card, predictor, inferred, notes = _prepare(model, seq, task, device_bytes, optimizer, tracker, margin,
                                                autocast_dtype, keeps_outputs)
    run = functools.partial(_probe, step, card, policy, model, optimizer, tracker)
    searched = _search(run, card, predictor, policy, max_batch or MAX_BATCH, notes)
    if searched.found == 0:
        raise _does_not_fit(card, inferred, searched.probes, keeps_outputs)
    accum, micro = _accumulation(global_batch, searched.found, predictor, card.budget_bytes, notes)
    return _result(searched, card, notes, accum, micro)


def _result(searched: Searched, card: Card, notes: list[str], accum=None, micro=None) -> BatchSizeResult:
    return BatchSizeResult(batch_size=searched.found, probes=searched.probes, predicted_batch=searched.predicted,
                           per_sample_bytes=searched.per_sample_bytes, budget_bytes=card.budget_bytes,
                           figure=card.figure, grad_accum=accum, micro_batch=micro, notes=tuple(notes))


def _check_arguments(*, seq, margin, device_bytes, task, keeps_outputs, **counts) -> None:
    """Every problem at once, each with its fix. `counts`: positive integers, or None."""
    problems = [f"{name} must be a positive integer, got {value!r}" for name, value in {"seq": seq, **counts}.items()
                if not is_count(value) and (value is not None or name == "seq")]
    problems += card_problems(device_bytes, margin) + output_problems(keeps_outputs, task)
    if problems:
        raise InvalidArgument("; ".join(problems))


def is_count(value) -> bool:
    # bool is an int subclass: seq=True is a mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def card_problems(device_bytes, margin) -> list[str]:
    """What is wrong with a card size and a margin (empty when both can be used)."""
    problems = []
    if device_bytes is not None and (not is_count(device_bytes) or device_bytes > MAX_SIZE_BYTES):
        problems.append(f"device_bytes must be from 1 B to 1 PiB (llamem.units.MAX_SIZE_BYTES), got {device_bytes!r}: "
                        "pass the card's memory in bytes, e.g. llamem.units.parse_size('24GiB')")
    if margin is not None and (isinstance(margin, bool) or not isinstance(margin, (int, float))
                               or not 0 <= margin < 1):
        problems.append(f"margin is the fraction of the card kept free: from 0 to below 1 (0.03 keeps 3 %), "
                        f"got {margin!r}")
    return problems


def output_problems(keeps_outputs, task: str) -> list[str]:
    if not isinstance(keeps_outputs, bool):
        return [f"keeps_outputs must be True or False, got {keeps_outputs!r}"]
    if keeps_outputs and task == "infer":
        return [("keeps_outputs describes a training step that keeps the model's output through backward: "
                 "drop it for task='infer'")]
    return []


def _prepare(model, seq, task, device_bytes, optimizer, tracker, margin, autocast_dtype, keeps_outputs=False):
    """The card, the workload's predictor, and notes on both. The optimizer's state and the
    model's gradients are cleared first, so what is live is what every probe starts from."""
    from llamem.runtime.infer import infer_workload

    card, notes = _card(device_bytes, tracker, margin)
    inferred = infer_workload(model, optimizer=optimizer, batch=1, seq=seq, task=task, autocast_dtype=autocast_dtype)
    notes += [f"workload: {u}" for u in inferred.unknown if not u.startswith(("batch", "seq"))]
    _clear_state(model, optimizer)
    card.recover()
    if inferred.workload is None:
        notes.append(f"no prediction ({inferred.problem}): doubling from batch 1, then extrapolating")
        return card, None, inferred, notes
    predictor = Predictor(inferred.spec, inferred.workload, card.figure, keeps_outputs=keeps_outputs)
    if keeps_outputs:
        notes.append("the step keeps the model's output through backward: its logits, cache and loss are counted")
    live = card.allocated_bytes()
    if live is not None:
        # What is live beyond the weights the estimate counts: other tensors on the card, or (negative)
        # weights the tracker does not see because the model was not given to `track()`.
        loaded = inferred.predicted_phase_bytes()["load"]
        predictor = Predictor(inferred.spec, inferred.workload, card.figure, live - loaded, keeps_outputs)
        if abs(live - loaded) > card.budget_bytes // 100:
            notes.append(f"live before the first probe: {format_bytes(live)}, the model's weights "
                         f"{format_bytes(loaded)}: the difference is counted in the prediction")
    return card, predictor, inferred, notes


def _card(device_bytes, tracker, margin) -> tuple[Card, list[str]]:
    import torch

    from llamem.overhead import non_torch_bytes
    from llamem.runtime.sources import CudaSource, TrackerSource

    if tracker is not None:
        source, figure = TrackerSource(tracker), "allocated"
        capacity = device_bytes or tracker.capacity_bytes
    elif torch.cuda.is_available():
        source, figure = CudaSource(torch.cuda.current_device()), "device"
        capacity = device_bytes or torch.cuda.get_device_properties(source.device).total_memory
    else:
        source, figure, capacity = None, "allocated", device_bytes
    if not capacity:
        raise InvalidArgument("no card size: pass device_bytes= (e.g. llamem.units.parse_size('24GiB')), or a "
                              "CpuMemoryTracker with a capacity_bytes")
    if margin is None:
        margin = DEFAULT_CUDA_MARGIN if figure == "device" else 0.0
    budget = int(capacity * (1 - margin))
    why = ("the tracker counts live storages only, with no cache and no CUDA context" if tracker is not None else
           "the card holds the allocator's cache and the CUDA context too" if figure == "device" else
           "no memory source, so probes are not measured")
    notes = [(f"budget {format_bytes(budget)} = {format_bytes(capacity)} less a {margin:.0%} margin, held against "
              f"the {figure} peak: {why}")]
    return Card(source, figure, capacity, budget, non_torch_bytes() if figure == "device" else 0), notes


def _clear_state(model, optimizer) -> None:
    """Drop what one probe created that the next would otherwise start with."""
    if optimizer is not None:
        getattr(optimizer, "optimizer", optimizer).state.clear()  # accelerate's wrapper holds the real one
    for param in model.parameters():
        param.grad = None


def is_oom(error: BaseException) -> bool:
    """Out of memory on CUDA, the CPU allocator, MPS, or a CpuMemoryTracker (accelerate's rule)."""
    import torch

    if isinstance(error, torch.OutOfMemoryError):
        return True
    return isinstance(error, RuntimeError) and len(error.args) == 1 and \
        any(text in str(error.args[0]) for text in _OOM_TEXTS)


def _requested_bytes(error: BaseException, tracker) -> int:
    """The allocation that failed: the tracker knows it; CUDA's message says it."""
    if tracker is not None and "CpuMemoryTracker" in str(error):
        return tracker.oom_requested_bytes
    return requested_bytes(str(error)) or 0


def requested_bytes(message: str) -> int | None:
    """The request a PyTorch OOM message names ("Tried to allocate 512 bytes", "... 2.00 MiB"),
    to the message's two decimals, or None (one parser: the OOM dump's)."""
    from llamem.runtime.oom import requested_from_message

    return requested_from_message(message)


def _probe(step, card: Card, policy: Policy, model, optimizer, tracker, batch: int) -> tuple[Probe, object]:
    """Run `policy.steps_per_probe` steps at `batch`; returns the probe and the last step's value."""
    needed = value = None
    failed = False
    try:
        for _ in range(policy.steps_per_probe):
            value = step(batch)
    except Exception as error:  # only OOMs are kept; anything else propagates
        if not is_oom(error):
            raise
        failed = True  # numbers only: the exception and its frames must die with this block
        now = card.now_bytes()
        needed = None if now is None else max(now + _requested_bytes(error, tracker), card.peak_bytes())
    peak = needed if failed else card.peak_bytes()
    _clear_state(model, optimizer)
    card.recover()
    fit = not failed and (not policy.within_budget or peak is None or peak <= card.budget_bytes)
    return Probe(batch, fit, peak), value


@dataclass(frozen=True, slots=True)
class Searched:
    found: int
    probes: tuple[Probe, ...]
    predicted: int | None
    per_sample_bytes: int | None
    value: object = None
    """What the step returned at the largest fit (the decorated function's result)."""


def _search(run, card: Card, predictor: Predictor | None, policy: Policy, limit: int, notes: list[str]) -> Searched:
    """Probe from the prediction: down by overshoot / per-sample after an OOM (the step at least
    doubling while OOMs follow each other), up by the measured headroom after a fit, then
    bisection below the ceiling the OOMs set (`_ceiling`)."""
    predicted = None if predictor is None else predictor.largest(card.budget_bytes, MAX_BATCH)
    if predicted is not None and predicted > limit:
        notes.append(f"predicted batch {predicted} capped at max_batch={limit}")
    batch = max(1, min(predicted, limit)) if predicted is not None else 1
    ups = policy.step_ups if predictor is not None else policy.blind_step_ups
    probes: list[Probe] = []
    values: dict[int, object] = {}
    down = 0
    while batch and len(probes) < policy.max_probes:
        probe, values[batch] = run(batch)
        probes.append(probe)
        if probe.fit and not policy.settle:
            break
        fit_max = max((p.batch for p in probes if p.fit), default=0)
        ceiling = _ceiling(probes, card.budget_bytes, limit)
        if probe.fit:
            up = _step_up(probe, _per_sample(probes, predictor, batch), card.budget_bytes, ceiling) if ups else None
            if up is not None:
                ups -= 1
            batch = up or _bisect(fit_max, ceiling, limit)
        else:
            after_oom = len(probes) > 1 and not probes[-2].fit
            down = _step_down(probe, _per_sample(probes, predictor, batch), card.budget_bytes, down, after_oom)
            batch = min(max(fit_max + 1, batch - down), ceiling) if ceiling > fit_max else 0
    fit_max = max((p.batch for p in probes if p.fit), default=0)
    per_sample = None if predictor is None else predictor.per_sample_bytes(max(fit_max, 1))
    return Searched(fit_max, tuple(probes), predicted, per_sample, values.get(fit_max))


def _ceiling(probes: list[Probe], budget_bytes: int, limit: int) -> int:
    """The largest batch that might still fit: below every OOM, and, memory being affine in the
    batch at a fixed sequence, not past where the line from the largest fit through an OOM's
    lower bound crosses the budget (a lower bound gives a slope that is too small: the ceiling
    stays safe to probe below, never above the truth)."""
    fits = [p for p in probes if p.fit]
    ceiling = min([limit] + [p.batch - 1 for p in probes if not p.fit])
    if not fits:
        return ceiling
    top = max(fits, key=lambda p: p.batch)
    for p in probes:
        if not p.fit and p.batch > top.batch and None not in (p.peak_bytes, top.peak_bytes) \
                and p.peak_bytes > top.peak_bytes:
            slope = (p.peak_bytes - top.peak_bytes) / (p.batch - top.batch)
            ceiling = min(ceiling, top.batch + int((budget_bytes - top.peak_bytes) // slope))
    return max(ceiling, top.batch)


def _per_sample(probes: list[Probe], predictor: Predictor | None, batch: int) -> int | None:
    """Measured from the two largest fits when there are two, else the prediction's."""
    fits = sorted((p for p in probes if p.fit and p.peak_bytes is not None), key=lambda p: p.batch)
    if len(fits) >= 2:
        return max(1, (fits[-1].peak_bytes - fits[-2].peak_bytes) // (fits[-1].batch - fits[-2].batch))
    return None if predictor is None else max(1, predictor.per_sample_bytes(batch))


def _step_up(probe: Probe, per_sample: int | None, budget_bytes: int, ceiling: int) -> int | None:
    """The batch the measured headroom says might still fit, if above this one; without a
    per-sample figure yet, double."""
    if per_sample is None:
        up = probe.batch
    elif probe.peak_bytes is None:
        return None
    else:
        up = (budget_bytes - probe.peak_bytes) // per_sample
    candidate = min(probe.batch + up, ceiling)
    return candidate if candidate > probe.batch else None


def _step_down(probe: Probe, per_sample: int | None, budget_bytes: int, last_down: int, after_oom: bool) -> int:
    """ceil(overshoot / per-sample), at least 1. The overshoot of an OOM is a lower bound (the
    step stopped at the first allocation that did not fit), so after two OOMs in a row the step
    at least doubles: a walk of 1-sample steps would take as many probes as accelerate's."""
    if probe.peak_bytes is not None and per_sample:
        down = math.ceil(max(probe.peak_bytes - budget_bytes, 1) / per_sample)
    else:
        down = 1
    return max(down, 2 * last_down) if after_oom else down


def _bisect(fit_max: int, ceiling: int, limit: int) -> int:
    """The middle of (largest fit, ceiling], 0 when that is empty or when nothing failed (the
    prediction's edge stands: probing above it would only confirm an OOM)."""
    if ceiling >= limit or ceiling <= fit_max:
        return 0
    return (fit_max + ceiling + 1) // 2


def _accumulation(global_batch, batch: int, predictor, budget_bytes: int, notes: list[str]):
    """Accumulation steps that keep `global_batch` with micro-batches of at most `batch`. From the
    second micro-batch on the gradients stay allocated through forward, which the probes (one
    micro-batch per step) do not see: the prediction adds them, and accumulation grows until the
    micro-batch fits with them."""
    if global_batch is None:
        return None, None
    accum = math.ceil(global_batch / batch)
    while accum > 1 and predictor is not None and accum < global_batch and \
            predictor.peak_bytes(math.ceil(global_batch / accum), grad_accum=accum) > budget_bytes:
        accum += 1
    micro = math.ceil(global_batch / accum)
    if micro * accum != global_batch:
        notes.append(f"global batch {global_batch} is not a multiple of {accum} micro-batches: {accum} x {micro} = "
                     f"{micro * accum} (choose a global batch divisible by the accumulation to keep it exactly)")
    return accum, micro


def _does_not_fit(card: Card, inferred, probes: tuple[Probe, ...], keeps_outputs: bool = False) -> DoesNotFit:
    last = probes[-1] if probes else None
    shortfall = 0 if last is None or last.peak_bytes is None else max(0, last.peak_bytes - card.budget_bytes)
    if all(p.batch != 1 for p in probes):
        tried = ", ".join(str(p.batch) for p in probes)
        return DoesNotFit(f"no batch fit in max_probes={len(probes)} (tried {tried}): "
                          "raise max_probes, or give max_batch near the edge", shortfall_bytes=shortfall)
    return DoesNotFit(f"batch 1 does not fit in {format_bytes(card.budget_bytes)} ({card.figure} peak): shorten the "
                      f"sequence, checkpoint activations, or use LoRA.{sizing_hint(inferred, keeps_outputs)}",
                      shortfall_bytes=shortfall)


def sizing_hint(inferred, keeps_outputs: bool = False) -> str:
    """How to size the workload with `llamem estimate`, runnable as printed, and what was assumed
    in place of what could not be read (empty without a workload). Nothing is written: a model
    without a hub id needs its config written first, which the hint says how to do."""
    if inferred.workload is None:
        return ""
    if inferred.spec.hf_id:
        hint = f" `{inferred.command()}` sizes this workload"
    else:
        hint = (" To size it, write the model's config with `llamem.runtime.infer_workload(model)"
                f".write_config('config.json')` and run `{inferred.command('config.json')}`")
    hint += "; `llamem plan` with the same options finds what fits."
    if keeps_outputs:
        hint += " Neither counts the model output the step keeps through backward."
    assumed = [u for u in inferred.unknown if not u.startswith(("batch", "seq"))]
    if assumed:
        stated = sorted({arg for u in assumed for key, arg in _STATED_BY.items() if u.startswith(key)})
        hint += f" Assumed, not read from the model: {'; '.join(assumed)}."
        hint += f" Pass {' and '.join(stated)} if the step runs otherwise." if stated else ""
    return hint


def auto_batch_size(*, model, seq: int, task: str = "train", device_bytes: int | None = None, optimizer=None,
                    tracker=None, max_batch: int | None = None, margin: float | None = None,
                    autocast_dtype: str | None = None, max_probes: int = MAX_PROBES, keeps_outputs: bool = False):
    """Decorator in the manner of accelerate's `find_executable_batch_size`: `train(batch_size,
    *args)` is called at the predicted batch, and after an OOM again at the batch the overshoot
    says, until it completes. It returns what `train` returns; `train.result` is the search.
    `keeps_outputs`: as `find_batch_size`."""
    _check_arguments(seq=seq, max_batch=max_batch, max_probes=max_probes, margin=margin, device_bytes=device_bytes,
                     task=task, keeps_outputs=keeps_outputs)

    def decorate(function):
        @functools.wraps(function)
        def wrapper(*args, **kwargs):
            # The whole run is the probe: one call, no steps up once it completes, and no budget check
            # after the fact (a run that completed is not run again).
            policy = Policy(steps_per_probe=1, step_ups=0, max_probes=max_probes, blind_step_ups=0,
                            within_budget=False, settle=False)
            card, predictor, inferred, notes = _prepare(model, seq, task, device_bytes, optimizer, tracker,
                                                        margin, autocast_dtype, keeps_outputs)
            run = functools.partial(_probe, lambda b: function(b, *args, **kwargs), card, policy, model, None,
                                    tracker)
            searched = _search(run, card, predictor, policy, max_batch or MAX_BATCH, notes)
            if searched.found == 0:
                raise _does_not_fit(card, inferred, searched.probes, keeps_outputs)
            wrapper.result = _result(searched, card, notes)
            return searched.value

        wrapper.result = None
        return wrapper

    return decorate
