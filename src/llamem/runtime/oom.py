"""The OOM dump: what was in memory when `torch.OutOfMemoryError` was raised, written to a folder
that `llamem explain-oom DIR` reads.

The folder holds:
- `oom.json`: the error message, step and phase, the memory source's statistics, the card's
  capacity, and the workload read from the live objects (`llamem.runtime.infer`);
- `config.json`: the model's config, so `llamem estimate/plan --config` can size it;
- `snapshot.json`: the tracker's llamem-trace-v1 document (with its `live` list), or on CUDA
  `torch.cuda.memory._snapshot()` as JSON (`snapshot.pickle` when JSON cannot hold it).

The dump is written while the exception unwinds, when the frames of its traceback still hold
the step's tensors: that is the memory at the error. Nothing here keeps the exception (or its
traceback, which would keep those tensors alive) once the dump is written (pytorch/pytorch#18853:
"do error recovery outside of the catch block").
"""

from __future__ import annotations

import json
import os
import pickle
import re
import warnings
from pathlib import Path

from llamem.errors import LlamemError
from llamem.units import GiB, KiB, MiB, TiB

DUMP_VERSION = 1
OOM_FILE = "oom.json"
CONFIG_FILE = "config.json"
SNAPSHOT_JSON = "snapshot.json"
SNAPSHOT_PICKLE = "snapshot.pickle"
_TORCH_UNITS = {"bytes": 1, "B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB}
_TRIED = re.compile(r"Tried to allocate ([0-9]+(?:\.[0-9]+)?) (bytes|B|KiB|MiB|GiB|TiB)\b")
_HOOK_DICTS = ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks", "_forward_hooks_with_kwargs",
               "_forward_hooks_always_called")
"""Where an nn.Module keeps its forward hooks, by the hook's key (torch/nn/modules/module.py)."""


def requested_from_message(message: str) -> int | None:
    """The request an OOM message names ("Tried to allocate 20.00 MiB", "... 512 bytes"), to the
    message's two decimals (c10's format_size), or None. "512 B" is read too: the CPU tracker
    wrote sizes so before it used c10's format."""
    match = _TRIED.search(message)
    if match is None:
        return None
    return round(float(match.group(1)) * _TORCH_UNITS[match.group(2)])


def write_oom_dump(directory, *, source, inferred, error, step: int | None = None, phase: str | None = None,
                   device_name: str | None = None) -> Path:
    """Write oom.json, config.json and the snapshot into `directory` (created if needed); return it.

    `source` is a TrackerSource or CudaSource, `inferred` an `Inferred` (or None when the model is
    not known), `error` the exception or its message. Only the message is kept."""
    directory = Path(directory)
    message = str(error)
    del error  # the traceback's frames hold the step's tensors: no reference leaves this function
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise LlamemError(f"cannot create the OOM dump folder {directory}: {err.strerror or err}; "
                          "choose a writable folder") from None
    stats = source.stats()
    config_path = _write_config(directory, inferred)
    _write_snapshot(directory, source.snapshot())
    record = {"version": DUMP_VERSION, "message": message, "step": step,
              "phase": phase if phase is not None else _tracker_phase(source),
              "source": source.kind, "capacity_bytes": stats.get("capacity_bytes"),
              "device_name": device_name or _device_name(source), "stats": stats,
              "requested_bytes": _requested_bytes(source, message), "alloc_conf": _alloc_conf(),
              **_workload_fields(inferred, config_path)}
    _write_json_atomically(directory / OOM_FILE, record, indent=1)
    return directory


def _alloc_conf() -> str | None:
    """The allocator settings the process runs with: the explainer replays the snapshot with them.
    torch 2.13 reads PYTORCH_CUDA_ALLOC_CONF first and PYTORCH_ALLOC_CONF only when it is unset
    (CUDAAllocatorConfig.h)."""
    return os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")


def _tracker_phase(source) -> str | None:
    tracker = getattr(source, "tracker", None)
    return None if tracker is None else tracker.phase


def _requested_bytes(source, message: str) -> int | None:
    """The tracker knows the exact request; CUDA's is in the message (and in the snapshot's trace)."""
    tracker = getattr(source, "tracker", None)
    exact = getattr(tracker, "oom_requested_bytes", None)
    return exact if exact is not None else requested_from_message(message)


def _device_name(source) -> str:
    if source.kind != "cuda":
        return "CpuMemoryTracker (a CPU stand-in for a GPU)"
    import torch

    return torch.cuda.get_device_name(source.device)


def _workload_fields(inferred, config_path: Path | None) -> dict:
    if inferred is None:
        return {"model": None, "workload": None, "command": "", "unknown": [], "config_path": None,
                "problem": "no model was given to read the workload from"}
    from llamem.reporters.json_report import workload_dict

    spec, workload = inferred.spec, inferred.workload
    path = None if config_path is None else str(config_path)
    return {"model": None if spec is None else (spec.hf_id or spec.name),
            "workload": None if workload is None else workload_dict(workload),
            "command": inferred.command(path), "unknown": list(inferred.unknown), "config_path": path,
            "problem": inferred.problem}


def _write_config(directory: Path, inferred) -> Path | None:
    if inferred is None or inferred.spec is None:
        return None
    path = directory / CONFIG_FILE
    _write_json_atomically(path, inferred.spec.config, indent=1, sort_keys=True, default=str)
    return path.resolve()


def _write_snapshot(directory: Path, snapshot: dict) -> None:
    """JSON when it can hold the snapshot; else the pickle `_dump_snapshot` would write."""
    try:
        _write_json_atomically(directory / SNAPSHOT_JSON, snapshot)
        return
    except (TypeError, ValueError):  # a value JSON has no form for
        pass
    temporary = directory / (SNAPSHOT_PICKLE + ".part")
    with open(temporary, "wb") as handle:
        pickle.dump(snapshot, handle)
    os.replace(temporary, directory / SNAPSHOT_PICKLE)


def _write_json_atomically(path: Path, data, **options) -> None:
    """A crash or a full disk leaves the old file or none, never half of one."""
    temporary = path.with_name(path.name + ".part")
    try:
        with open(temporary, "w") as handle:
            json.dump(data, handle, **options)
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


class OomGuard:
    """`with oom_guard(DIR, model, optimizer, tracker=tracker, batch=8, seq=2048):` around a step:
    on `torch.OutOfMemoryError` the dump is written to DIR and the error goes on (re-raised).
    `guard.path` is the folder once written. Neither the exception nor its traceback is kept.

    While the guard is entered, hooks on the model and optimizer follow the step's phase
    (forward, backward, optimizer), as the memory monitor does, and the dump records the phase
    the error was raised in. With a tracker they also label its new allocations: the trace
    engine's module hooks tell activations from logits, and the phase says the rest. The hooks
    are removed and the tracker's labels restored on exit."""

    def __init__(self, directory, model, optimizer=None, tracker=None, batch: int | None = None,
                 seq: int | None = None, *, device: int | None = None, step: int | None = None,
                 task: str | None = None, autocast_dtype: str | None = None, grad_accum: int = 1) -> None:
        self.directory = Path(directory)
        if self.directory.exists() and not self.directory.is_dir():
            raise LlamemError(f"oom_guard: {self.directory} is a file; give a folder for the OOM dump")
        self.model, self.optimizer, self.tracker = model, optimizer, tracker
        self.device, self.step = device, step
        self.workload_options = {"batch": batch, "seq": seq, "task": task, "autocast_dtype": autocast_dtype,
                                 "grad_accum": grad_accum}
        self.path: Path | None = None
        self.phase: str | None = None
        """The phase the hooks last saw: forward, backward or optimizer (None before the first forward)."""
        self._source = None
        self._hooks: list = []
        self._active = False
        self._labelled_by_modules = False
        self._saved_labels: tuple[str, str, int] | None = None

    def __enter__(self) -> OomGuard:
        from llamem.runtime.sources import memory_source

        # Resolved before the step runs: a guard that could not write its dump fails now, not at the OOM.
        try:
            self._source = memory_source(tracker=self.tracker, device=self.device)
        except RuntimeError as err:  # no CUDA and no tracker: the message names the fix
            raise LlamemError(f"oom_guard: {err}") from None
        if self.tracker is not None:
            self._saved_labels = (self.tracker.phase, self.tracker.category, len(self.tracker.stack))
            category_hooks = install_category_hooks(self.model, self.tracker)
            self._labelled_by_modules = bool(category_hooks)
            self._hooks += category_hooks
        self._hooks += self._phase_hooks()
        self._active = True
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        import torch

        try:
            if exc_type is None or not issubclass(exc_type, torch.OutOfMemoryError):
                return False
            message = str(exc)
            del exc, tb  # this frame must not keep the step's tensors alive
            try:
                self.path = self.dump(message)
            except Exception as err:  # noqa: BLE001
                # The user's OOM matters more than its dump: say why there is none and let the error go on.
                warnings.warn(f"the OOM dump could not be written to {self.directory}: {err}", RuntimeWarning,
                              stacklevel=2)
            return False
        finally:
            self._close()

    def _close(self) -> None:
        self._active = False
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        if self._saved_labels is not None:
            # An error inside a module leaves the category hooks' stack part-way: cut it back too.
            self.tracker.phase, self.tracker.category, depth = self._saved_labels
            del self.tracker.stack[depth:]
            self._saved_labels = None

    def dump(self, message: str) -> Path:
        from llamem.runtime.infer import infer_workload

        if self.tracker is not None:
            relabel(self.tracker, self.model, self.optimizer)
        inferred = infer_workload(self.model, optimizer=self.optimizer, **self.workload_options)
        return write_oom_dump(self.directory, source=self._source, inferred=inferred, error=message,
                              step=self.step, phase=self.phase)

    # The step's phases, found by the monitor's hooks (llamem.runtime.monitor) --------------------
    def _phase_hooks(self) -> list:
        hooks = [self.model.register_forward_pre_hook(self._on_forward),
                 self.model.register_forward_hook(self._on_forward_end)]
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)  # accelerate's wrapper holds one
        if optimizer is not None and hasattr(optimizer, "register_step_pre_hook"):
            hooks.append(optimizer.register_step_pre_hook(lambda *_: self._enter_phase("optimizer")))
        return hooks

    def _on_forward(self, module, args) -> None:
        self._enter_phase("forward")

    def _on_forward_end(self, module, args, output) -> None:
        from llamem.runtime.monitor import root_tensor

        root = root_tensor(output)
        if root is not None and root.grad_fn is not None:
            root.grad_fn.register_prehook(self._on_backward_start)

    def _on_backward_start(self, grad_outputs) -> None:
        from torch.autograd import Variable

        self._enter_phase("backward")
        # Clipping, the optimizer's step and zero_grad follow a backward: the trace engine counts them so.
        Variable._execution_engine.queue_callback(lambda: self._enter_phase("optimizer"))

    def _enter_phase(self, phase: str) -> None:
        if not self._active:
            return  # the guard has exited: a graph kept past it must not relabel the tracker
        self.phase = phase
        if self.tracker is None:
            return
        self.tracker.phase = phase
        if phase == "forward":
            self.tracker.category = "activations"
        elif phase == "optimizer" or not self._labelled_by_modules:
            self.tracker.category = "temporaries"
        # A backward under the module hooks keeps their "logits" until the head's gradients are
        # done (the final norm's gradient hook then says temporaries), as `llamem trace` counts it.


def oom_guard(directory, model, optimizer=None, tracker=None, batch: int | None = None, seq: int | None = None,
              **options) -> OomGuard:
    """A context manager that writes the OOM dump of `model` (and `optimizer`) to `directory` on
    `torch.OutOfMemoryError` and re-raises it. Options: device, step, task, autocast_dtype
    ("bf16" / "fp16" when the forward runs under autocast, "fp32" when it does not), grad_accum."""
    return OomGuard(directory, model, optimizer, tracker, batch, seq, **options)


def relabel(tracker, model, optimizer=None) -> None:
    """Give the tracker's live storages of the model and optimizer their categories (weights,
    gradients, optimizer/<state>), counting nothing new: a gradient made in backward was labelled
    with whatever category was current then. Storages the tracker never counted stay uncounted,
    so the dump's bytes are the ones the error was raised on."""
    for tensor, category in _labelled_tensors(model, optimizer):
        if tensor.is_meta:
            continue
        allocation = tracker.live.get(id(tensor.untyped_storage()))
        if allocation is not None:
            allocation.category = category


def _labelled_tensors(model, optimizer):
    for name, param in model.named_parameters():
        yield param, "weights/adapters" if "lora_" in name else "weights"
        if param.grad is not None:
            yield param.grad, "gradients"
    if optimizer is not None:
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps one
        for state in inner.state.values():
            for key, value in state.items():
                if hasattr(value, "untyped_storage"):
                    yield value, f"optimizer/{key}"


def install_category_hooks(model, tracker) -> list:
    """The trace engine's module hooks (`llamem.trace.run.label_by_module`: the decoder's
    modules make activations, the head makes logits) on `model` for `tracker`, with handles that
    remove them; none when the model is not a decoder with layers, embed_tokens and norm."""
    from llamem.trace.run import label_by_module

    modules = list(model.modules())
    before = [_hook_keys(module) for module in modules]
    try:
        label_by_module(model, tracker)
        installed = True
    except (AttributeError, TypeError):  # another architecture: the phases label its allocations
        installed = False
    # That function keeps no handles: its hooks are the keys that were not there before.
    handles = [_ModuleHook(module, key) for module, old in zip(modules, before) for key in _hook_keys(module) - old]
    if installed:
        return handles
    for handle in handles:
        handle.remove()
    return []


def _hook_keys(module) -> set[int]:
    return set(module._forward_pre_hooks) | set(module._forward_hooks)


class _ModuleHook:
    """A forward hook of `module` found by its key, removed as its RemovableHandle would remove it."""

    def __init__(self, module, key: int) -> None:
        self.module, self.key = module, key

    def remove(self) -> None:
        for name in _HOOK_DICTS:
            getattr(self.module, name, {}).pop(self.key, None)
