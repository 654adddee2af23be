"""MemoryMonitor: memory per training step and per phase, beside llamem's prediction, written as
a crash-safe JSONL log; leaks and out-of-memory errors reported where they happen.

How the phases are found (no change to the training code):
- forward: a forward pre-hook on the model (it also reads the batch shape) until backward starts;
- backward: from a pre-hook on the autograd node of the model's output (the loss when the model
  computes it, else the logits) to the end of that backward pass (a callback queued on the
  autograd engine, as FSDP does for its post-backward work);
- optimizer: from the end of the last backward of the step to `step()`: gradient clipping, the
  optimizer's step and `zero_grad`, as `llamem trace` counts them. A forward that comes first
  instead (gradient accumulation) makes that stretch a gap between micro-batches, counted in the
  step's peak only. The optimizer's step pre-hook starts the phase when no backward was seen.
- inference (no backward seen yet, gradients off, as in `generate`): the step's first forward is
  the prefill and sets the prompt length; a later forward of one token, or on a filled KV cache,
  is a decode step: phases prefill and decode.

What a whole step shows is read at its end: the tokens a generation made (its decode forwards +
1, the prefill making the first) and the forward passes with gradients per optimizer step (the
micro-batches of gradient accumulation, when `grad_accum` is not given). The workload line is
written again when they change what llamem should size.

Each phase starts with a fresh peak on the memory source (`reset_peak()`), so its peak is its
own; the step's peak is the largest of all, gaps included. Autocast is read in a pre-hook on the
input embeddings, inside any forward wrapper that enters it (accelerate's mixed precision).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from llamem.errors import LlamemError
from llamem.runtime.leaks import LeakDetector, LeakWarning, StepMark, cuda_sources, tracker_sources

LOG_VERSION = 1
PHASES = ("forward", "backward", "optimizer")
INFER_PHASES = ("prefill", "decode")
DEFAULT_LEAK_WINDOW = 5
CUDA_HISTORY_ENTRIES = 100_000
"""Allocation events CUDA keeps for the leak report (a ring buffer, about 2 µs per event)."""
_AFTER_BACKWARD = "after backward"
"""The stretch after a backward: the optimizer phase if `step()` or the optimizer comes next."""
_STEP_KEYS = ("peak_allocated_bytes", "peak_reserved_bytes", "allocated_bytes", "reserved_bytes",
              "nvml_used_bytes", "non_torch_bytes", "num_alloc_retries", "num_ooms")
_AUTOCAST_DTYPES = {"torch.bfloat16": "bf16", "torch.float16": "fp16"}


class MemoryMonitor:
    """Context manager around a training loop; call `step()` after each optimizer step (or, when
    generating, after each `generate()` call).

    `tracker` (a CpuMemoryTracker the loop runs in) measures a CPU run; without it the current
    CUDA device (or `device`) is read. `log_path` gets one JSON line per step, flushed and
    fsync'd as written, and `<log name>.config.json`, the model's config that the logged
    `llamem estimate --config ...` command reads. `leak_window` steps of growth give one
    `LeakWarning` (None: no leak check). On an out-of-memory error in the monitored region,
    `oom_dir` gets a dump (`llamem.runtime.oom`), then the error goes on. `grad_accum`: the
    micro-batches per optimizer step; None counts them (the forward passes with gradients between
    two `step()` calls); a count that differs from the one given is noted in the workload line.
    """

    def __init__(self, model, optimizer=None, log_path=None, *, tracker=None, device: int | None = None,
                 leak_window: int | None = DEFAULT_LEAK_WINDOW, oom_dir=None, task: str | None = None,
                 grad_accum: int | None = None, append: bool = False) -> None:
        _check_settings(leak_window, grad_accum)
        self.model = model
        self.optimizer = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps one
        self.tracker = tracker
        self.source = _source(tracker, device)
        self.log_path = _log_path(log_path)
        self.config_path = self.log_path.with_name(self.log_path.stem + ".config.json") if self.log_path else None
        self.oom_dir = Path(oom_dir) if oom_dir is not None else None
        self.task, self.grad_accum, self.append = task, grad_accum, append
        self.records: list[dict] = []
        """The step lines, as dicts."""
        self.inferred = None
        """The latest `Inferred` workload (llamem.runtime.infer), once a forward has been seen."""
        self.workload_record: dict | None = None
        self.step_number = 1
        self._leaks = LeakDetector(leak_window) if leak_window else None
        self._log = None
        self._hooks: list = []
        self._history_started = False
        self._started = 0.0
        self._saw_backward = False
        self._tracker_labels: tuple[str, str] | None = None
        self._workload_key: tuple | None = None
        self._shape: tuple | None = None
        self._input_names: tuple[str, ...] = ()
        self._unread_input = False
        """A forward was seen whose batch shape could not be read (no input_ids or inputs_embeds)."""
        self._autocast: str | None = None
        self._new_tokens: int | None = None
        self._micro_batches_seen = 0
        """The most forward passes with gradients seen in one step."""
        self._reset_step()

    # Context ------------------------------------------------------------------------------
    def __enter__(self) -> MemoryMonitor:
        return self.open()

    def __exit__(self, kind, error, traceback) -> bool:
        import torch

        try:
            if kind is not None and issubclass(kind, torch.OutOfMemoryError):
                self.record_oom(error)
        finally:
            del error, traceback  # no frame of the failed step may outlive this call
            self.close()
        return False

    def open(self) -> MemoryMonitor:
        self._started = time.monotonic()
        if self.log_path is not None:
            self._log = open(self.log_path, "a" if self.append else "w")
        if self.tracker is not None:  # a model or optimizer built before the tracker was entered
            self._tracker_labels = (self.tracker.phase, self.tracker.category)
            self.tracker.track(self.model, *([self.optimizer] if self.optimizer is not None else []))
        self._start_cuda_history()
        self._install_hooks()
        self._write(self._header())
        self.source.reset_peak()
        return self

    def close(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._tracker_labels is not None:
            self.tracker.phase, self.tracker.category = self._tracker_labels
            self._tracker_labels = None
        self._stop_cuda_history()
        if self._log is not None:
            self._log.close()
            self._log = None

    # Steps --------------------------------------------------------------------------------
    def step(self, step: int | None = None) -> dict:
        """End the step (after `optimizer.zero_grad()`): write its line, check for a leak.
        `step` renumbers it (the Trainer's global step); steps count from 1."""
        if step is not None:
            self.step_number = step
        self._boundary(None, step_end=True)
        self._settle_workload()
        stats = self.source.stats()
        record = {"type": "step", "step": self.step_number, "time_s": round(time.monotonic() - self._started, 6),
                  "batch": self._shape[0] if self._shape else None, "seq": self._shape[1] if self._shape else None,
                  "phases": self._phases, **{key: stats.get(key) for key in _STEP_KEYS},
                  "peak_allocated_bytes": self._step_peak[0], "peak_reserved_bytes": self._step_peak[1]}
        self.records.append(record)
        self._write(record)
        if self._leaks is not None:
            self._check_leak(record)
        self.step_number += 1
        self._reset_step()
        return record

    def _reset_step(self) -> None:
        self._phase: str | None = None
        self._phases: dict[str, dict] = {}
        self._step_peak = [0, 0]
        self._in_forward = False
        self._generation = _Generation()
        self._train_forwards = 0

    def _boundary(self, next_phase: str | None, *, step_end: bool = False) -> None:
        """Close the running phase with its peak and end figures, start `next_phase` with a fresh peak."""
        stats = self.source.stats()
        peak = (stats["peak_allocated_bytes"], stats["peak_reserved_bytes"])
        self._step_peak = [max(self._step_peak[0], peak[0]), max(self._step_peak[1], peak[1])]
        phase = "optimizer" if self._phase == _AFTER_BACKWARD and step_end else self._phase
        if phase in PHASES or phase in INFER_PHASES:
            _merge_phase(self._phases, phase, peak, (stats["allocated_bytes"], stats["reserved_bytes"]))
        self._phase = next_phase
        if self.tracker is not None:  # what the tracker's new allocations are: its snapshots and OOM dumps say so
            known = next_phase in PHASES or next_phase in INFER_PHASES
            self.tracker.phase = next_phase if known else "between steps"
            # Work without gradients makes temporaries, as `llamem trace` labels it; the KV cache is relabelled.
            self.tracker.category = "activations" if next_phase == "forward" else "temporaries"
        self.source.reset_peak()

    # Hooks --------------------------------------------------------------------------------
    def _install_hooks(self) -> None:
        model = self.model
        self._input_names = _positional_names(model)
        self._hooks.append(model.register_forward_pre_hook(self._on_forward, with_kwargs=True))
        self._hooks.append(model.register_forward_hook(self._on_forward_end, with_kwargs=True))
        embeddings = _input_embeddings(model)
        self._embeddings_hooked = embeddings is not None
        if embeddings is not None:
            self._hooks.append(embeddings.register_forward_pre_hook(self._on_embeddings))
        if self.optimizer is not None and hasattr(self.optimizer, "register_step_pre_hook"):
            self._hooks.append(self.optimizer.register_step_pre_hook(self._on_optimizer_step))

    def _on_forward(self, module, args, kwargs) -> None:
        import torch

        if self._saw_backward and not torch.is_grad_enabled():
            return  # an evaluation forward inside training: not a phase of the step
        shape = _batch_shape(self._input_names, args, kwargs)
        self._unread_input = self._unread_input or shape is None
        if self._generating():
            phase = self._generation.see(shape, _cache_filled(kwargs))
            self._boundary(phase)
            if self._generation.forwards == 1:
                self._shape = shape or self._shape
        else:
            self._drop_generation()
            self._boundary("forward")
            self._shape = shape or self._shape
            if torch.is_grad_enabled():  # a micro-batch (an evaluation under no_grad told to be training is not)
                self._train_forwards += 1
        self._in_forward = True
        if not self._embeddings_hooked:
            self._see_workload(module)

    def _generating(self) -> bool:
        """Inference: told so, or a forward without gradients before any backward (generate())."""
        import torch

        if self.task is not None:
            return self.task == "infer"
        return not self._saw_backward and not torch.is_grad_enabled()

    def _drop_generation(self) -> None:
        """A forward with gradients in a step that had forwards without: those were an evaluation."""
        if self._generation.forwards:
            for phase in INFER_PHASES:
                self._phases.pop(phase, None)
            self._generation = _Generation()

    def _on_embeddings(self, module, args) -> None:
        if self._in_forward:
            self._see_workload(module)

    def _on_forward_end(self, module, args, kwargs, output) -> None:
        if not self._in_forward:
            return
        self._in_forward = False
        if self._generation.forwards and self.tracker is not None:
            _label_cache(self.tracker, kwargs, output)
        root = root_tensor(output)
        if root is not None and root.grad_fn is not None:
            root.grad_fn.register_prehook(self._on_backward_start)

    def _on_backward_start(self, grad_outputs) -> None:
        from torch.autograd import Variable

        self._saw_backward = True
        self._boundary("backward")
        Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        self._boundary(_AFTER_BACKWARD)

    def _on_optimizer_step(self, optimizer, args, kwargs) -> None:
        if self._phase == _AFTER_BACKWARD:
            self._phase = "optimizer"  # clipping since the backward ended belongs to it too
        elif self._phase != "optimizer":
            self._boundary("optimizer")

    # The workload and its prediction ------------------------------------------------------
    def _see_workload(self, module) -> None:
        """Autocast, read inside the forward; a training step's workload line is written as soon as
        its batch shape is seen, a generation's at the step's end (its tokens are counted then)."""
        self._autocast = _autocast_dtype(module)
        if not self._generation.forwards:
            self._new_tokens = None
            self._refresh_workload()

    def _settle_workload(self) -> None:
        """At the step's end: what only a whole step shows (the tokens a generation made, the
        micro-batches of an optimizer step) goes into the workload line."""
        generation = self._generation
        if generation.forwards:
            self._shape = (generation.batch, generation.seq) if generation.batch else self._shape
            self._new_tokens = generation.new_tokens
        elif self._train_forwards:
            self._micro_batches_seen = max(self._micro_batches_seen, self._train_forwards)
        else:
            return
        self._refresh_workload()

    def _grad_accum(self) -> tuple[int, str | None]:
        """The micro-batches per optimizer step to size, and a note when the run disagrees with them."""
        seen = self._micro_batches_seen
        if self.grad_accum is None:
            return max(seen, 1), None
        if seen and seen != self.grad_accum:
            return self.grad_accum, (f"grad_accum: {self.grad_accum} given, but {seen} forward passes with "
                                     f"gradients were seen per optimizer step (the prediction uses {self.grad_accum})")
        return self.grad_accum, None

    def _refresh_workload(self) -> None:
        """Write the workload line when what llamem should size is first known, or changes."""
        key = (self._shape, self._autocast, self.model.training, self._new_tokens, self._grad_accum())
        if self.workload_record is not None and self._workload_key == key:
            return
        self._workload_key = key
        self.inferred = self._infer()
        self.workload_record = self._workload_line(self.inferred)
        self._write(self.workload_record)

    def _infer(self):
        import dataclasses

        from llamem.runtime.infer import infer_workload

        batch, seq = self._shape if self._shape else (None, None)
        grad_accum, note = self._grad_accum()
        inferred = infer_workload(self.model, optimizer=self.optimizer, batch=batch, seq=seq, task=self.task,
                                  autocast_dtype=self._autocast, grad_accum=grad_accum, new_tokens=self._new_tokens)
        return dataclasses.replace(inferred, unknown=(*inferred.unknown, note)) if note else inferred

    def _workload_line(self, inferred) -> dict:
        from llamem.reporters.json_report import workload_dict

        config_path = None
        if self.config_path is not None and inferred.spec is not None:
            if self.workload_record is None:  # once: the model is the same at every batch shape
                inferred.write_config(self.config_path)
            config_path = str(self.config_path.resolve())
        return {"type": "workload", "step": self.step_number,
                "model": inferred.spec.name if inferred.spec else type(self.model).__name__,
                "workload": workload_dict(inferred.workload) if inferred.workload else None,
                "command": inferred.command(config_path), "config_path": config_path,
                "unknown": list(inferred.unknown), "problem": inferred.problem,
                "predicted": inferred.predicted_phase_bytes()}

    # Leaks --------------------------------------------------------------------------------
    def _check_leak(self, record: dict) -> None:
        import warnings

        mark = StepMark(record["step"], record["allocated_bytes"], self._shape, self._position())
        found = self._leaks.observe(mark)
        if found is None:
            return
        leak = self._leak_report(*found)
        self._write(leak.record())
        warnings.warn(leak.message(), LeakWarning, stacklevel=3)

    def _position(self) -> int:
        """Where the source's history stands: allocations after it were made later."""
        if self.tracker is not None:
            return max((a.record_id for a in self.tracker.live.values()), default=-1) + 1
        return time.time_ns() // 1000  # the clock of CUDA's trace entries (time_us)

    def _leak_report(self, first: StepMark, last: StepMark):
        from llamem.runtime.leaks import Leak

        if self.tracker is not None:
            hint = None if self.tracker.record_stacks else \
                "Creation stacks were not recorded: run in CpuMemoryTracker(record_stacks=True) to see them."
            return Leak(first, last, tracker_sources(self.tracker, first.position), hint)
        if not self._history_started:
            return Leak(first, last, [], "Allocation stacks were not recorded: CUDA memory history was off.")
        return Leak(first, last, cuda_sources(self.source.snapshot(), first.position, self.source.device))

    # CUDA memory history (allocation stacks for the leak report and the OOM snapshot) ------
    def _start_cuda_history(self) -> None:
        if self.tracker is not None or (self._leaks is None and self.oom_dir is None):
            return
        import torch

        torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                 max_entries=CUDA_HISTORY_ENTRIES)
        self._history_started = True

    def _stop_cuda_history(self) -> None:
        if self._history_started:
            import torch

            torch.cuda.memory._record_memory_history(enabled=None)
            self._history_started = False

    # Out of memory ------------------------------------------------------------------------
    def record_oom(self, error: BaseException):
        """Dump the memory state of an out-of-memory error (when `oom_dir` is set) and log it.
        The caller re-raises it: this never swallows the error."""
        phase = "optimizer" if self._phase == _AFTER_BACKWARD else (self._phase or "between steps")
        message = str(error)
        del error  # only the message is kept: the traceback's frames hold the step's tensors
        dump_dir = self._dump(message, phase) if self.oom_dir is not None else None
        self._write({"type": "oom", "step": self.step_number, "phase": phase, "message": message,
                     "dump_dir": str(dump_dir) if dump_dir is not None else None})
        return dump_dir

    def _dump(self, message: str, phase: str):
        import warnings

        from llamem.runtime.oom import relabel, write_oom_dump

        if self.tracker is not None:  # gradients and optimizer state get their categories back
            relabel(self.tracker, self.model, self.optimizer)
        try:
            return write_oom_dump(self.oom_dir, source=self.source, inferred=self.inferred or self._infer(),
                                  error=message, step=self.step_number, phase=phase,
                                  device_name=self._device_name())
        except (OSError, LlamemError) as err:
            # The run's own error matters more than its dump: say why there is none and let it go on.
            warnings.warn(f"the OOM dump could not be written to {self.oom_dir}: {err}", RuntimeWarning, stacklevel=3)
            return None

    # The log ------------------------------------------------------------------------------
    def _header(self) -> dict:
        return {"type": "header", "version": LOG_VERSION, "source": self.source.kind, "device": self._device_name(),
                "capacity_bytes": self.source.stats()["capacity_bytes"],
                "started": datetime.now(UTC).isoformat(timespec="seconds"), "pid": os.getpid()}

    def _device_name(self) -> str:
        if self.tracker is not None:
            return "cpu (CpuMemoryTracker)"
        import torch

        return torch.cuda.get_device_name(self.source.device)

    def _write(self, record: dict) -> None:
        """One line, on disk before the run goes on: a crash or a kill loses no finished step."""
        if self._log is None:
            return
        self._log.write(json.dumps(record, default=str) + "\n")
        self._log.flush()
        os.fsync(self._log.fileno())

    def summary(self) -> str:
        """Measured (the last step: the steady state) vs predicted bytes per phase."""
        return render_summary(self.records, self.workload_record, self.source.kind, unread_input=self._unread_input)


NO_STEP = ("llamem monitor: no step recorded: call monitor.step() after each optimizer step (after each "
           "generate() call when generating), or train with LlamemCallback in a transformers Trainer")


def render_summary(steps: list[dict], workload: dict | None, source: str, *, unread_input: bool = False) -> str:
    """The summary of a monitored run, from its step lines and its last workload line.
    `unread_input`: a forward was seen whose batch shape could not be read."""
    from llamem.units import display_unit, format_in

    if not steps:
        return NO_STEP
    last = steps[-1]
    predicted = (workload or {}).get("predicted") or {}
    names = [p for p in (*PHASES, *INFER_PHASES) if p in predicted or p in last["phases"]] or list(PHASES)
    rows = [(phase, last["phases"].get(phase, {}).get("peak_allocated_bytes"), predicted.get(phase))
            for phase in names]
    rows.append(("step", last["peak_allocated_bytes"], max(predicted.values()) if predicted else None))
    unit = display_unit(max([m or 0 for _, m, _ in rows] + [p or 0 for _, _, p in rows]))
    shape = _shape_text(last, unread_input)
    lines = [f"llamem monitor: {len(steps)} steps ({source}), {shape}; peak allocated at step {last['step']}",
             f"{'phase':<10} {'measured':>12} {'predicted':>12} {'ratio':>6}"]
    for name, measured, expected in rows:
        ratio = f"{measured / expected:.2f}" if measured is not None and expected else "-"
        lines.append(f"{name:<10} {_cell(measured, unit, format_in):>12} {_cell(expected, unit, format_in):>12} "
                     f"{ratio:>6}")
    if workload and workload.get("command"):
        lines.append(f"predicted by: {workload['command']}")
    for item in (workload or {}).get("unknown", []):
        lines.append(f"not read from the run: {item}")
    if workload and workload.get("problem"):
        lines.append(f"no prediction: {workload['problem']}")
    return "\n".join(lines)


def _shape_text(step: dict, unread_input: bool) -> str:
    if step.get("batch"):
        return f"batch {step['batch']} x {step['seq']} tokens"
    if unread_input:
        return "batch shape unknown (the model's input is neither input_ids nor inputs_embeds)"
    return "batch shape not seen"


def _cell(num_bytes: int | None, unit, format_in) -> str:
    return "-" if num_bytes is None else format_in(num_bytes, unit)


# Helpers ----------------------------------------------------------------------------------
def _check_settings(leak_window: int | None, grad_accum: int | None) -> None:
    problems = []
    if leak_window is not None and (not isinstance(leak_window, int) or leak_window < 2):
        problems.append(f"leak_window must be 2 steps or more (or None for no leak check), got {leak_window!r}")
    if grad_accum is not None and (not isinstance(grad_accum, int) or grad_accum < 1):
        problems.append(f"grad_accum must be 1 or more (or None to count it), got {grad_accum!r}")
    if problems:
        raise LlamemError("; ".join(problems))


def _source(tracker, device: int | None):
    from llamem.runtime.sources import memory_source

    try:
        return memory_source(tracker, device)
    except RuntimeError as err:  # no CUDA and no tracker: the message names the fix
        raise LlamemError(str(err)) from None


def _log_path(log_path) -> Path | None:
    if log_path is None:
        return None
    from llamem.files import check_writable

    return check_writable(log_path, "log_path")


def _merge_phase(phases: dict, phase: str, peak: tuple[int, int], end: tuple[int, int]) -> None:
    """Micro-batches of one step: the phase's peak is their largest, its end the last one's."""
    old = phases.get(phase)
    phases[phase] = {"peak_allocated_bytes": max(peak[0], old["peak_allocated_bytes"]) if old else peak[0],
                     "peak_reserved_bytes": max(peak[1], old["peak_reserved_bytes"]) if old else peak[1],
                     "end_allocated_bytes": end[0], "end_reserved_bytes": end[1]}


def _input_embeddings(model):
    get = getattr(model, "get_input_embeddings", None)
    try:
        return get() if get is not None else None
    except (NotImplementedError, AttributeError):
        return None


def _positional_names(model) -> tuple[str, ...]:
    """The names of the model's positional forward arguments: which one is input_ids."""
    import inspect

    try:
        parameters = inspect.signature(model.forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    return tuple(p.name for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD))


def _batch_shape(names: tuple[str, ...], args, kwargs) -> tuple[int, int] | None:
    """(batch, seq) of input_ids, or of inputs_embeds (its first two dimensions); None when the
    model gets neither (another input's shape says nothing of tokens)."""
    inputs = {**dict(zip(names, args)), **kwargs}
    for name in ("input_ids", "inputs_embeds"):
        shape = getattr(inputs.get(name), "shape", None)
        if shape is not None and len(shape) >= 2:
            return int(shape[0]), int(shape[1])
    return None


def _cache_filled(kwargs) -> bool:
    """Whether a forward continues a sequence: its KV cache (`cache`, `past_key_values`) holds
    tokens, or its `cache_position` starts past 0."""
    position = kwargs.get("cache_position")
    if position is not None and position.numel() and int(position.reshape(-1)[0]) > 0:
        return True
    cache = kwargs.get("cache")
    if cache is None:
        cache = kwargs.get("past_key_values")
    if cache is None:
        return False
    if hasattr(cache, "get_seq_length"):
        return cache.get_seq_length() > 0
    return len(cache) > 0  # the legacy tuple of (keys, values) per layer


def _label_cache(tracker, kwargs, output) -> None:
    """The KV cache's tensors are kv_cache, as `llamem trace` labels them."""
    import torch

    cache = next((c for c in (kwargs.get("cache"), kwargs.get("past_key_values"),
                              getattr(output, "past_key_values", None)) if c is not None), None)
    for layer in getattr(cache, "layers", ()):
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                tracker.label(tensor, "kv_cache")


@dataclass(slots=True)
class _Generation:
    """The inference forwards of one step, as `generate` makes them: a prefill (the prompt, in
    chunks when prefill_chunk_size is set), then a decode forward per new token after the first."""

    forwards: int = 0
    batch: int | None = None
    seq: int | None = None
    """The longest prompt of the step."""
    new_tokens: int = 0
    """The most tokens one generation made: its decode forwards + 1 (the prefill makes the first)."""
    prompt: int = 0
    decodes: int = 0

    def see(self, shape: tuple[int, int] | None, cached: bool) -> str:
        """The phase of a forward ("prefill" or "decode"), counted."""
        tokens = shape[1] if shape else None
        self.forwards += 1
        if self.forwards == 1 or (tokens != 1 and not cached):  # a prompt: the step's first, or a new one
            self.prompt, self.decodes = tokens or 0, 0
            self.batch = max(self.batch or 0, shape[0]) if shape else self.batch
            phase = "prefill"
        elif tokens not in (None, 1) and self.decodes == 0:  # the prompt's next chunk
            self.prompt += tokens
            phase = "prefill"
        else:  # one token, or more on a filled cache (assisted decoding's check)
            self.decodes += 1
            phase = "decode"
        self.seq = max(self.seq or 0, self.prompt) or None
        self.new_tokens = max(self.new_tokens, self.decodes + 1)
        return phase


def _autocast_dtype(module) -> str:
    """"bf16" / "fp16" when the forward runs under autocast on the model's device type, else "fp32"."""
    import torch

    device_type = next((p.device.type for p in module.parameters()), "cpu")
    if device_type not in ("cpu", "cuda") or not torch.is_autocast_enabled(device_type):
        return "fp32"
    return _AUTOCAST_DTYPES.get(str(torch.get_autocast_dtype(device_type)), "fp32")


def root_tensor(output):
    """Where backward starts in the model: its loss when it computes one, else its first output."""
    import torch

    if isinstance(output, torch.Tensor):
        return output
    loss = getattr(output, "loss", None) if not isinstance(output, (tuple, list)) else None
    if isinstance(loss, torch.Tensor):
        return loss
    values = output.values() if hasattr(output, "values") else output if isinstance(output, (tuple, list)) else ()
    return next((v for v in values if isinstance(v, torch.Tensor) and v.grad_fn is not None), None)

