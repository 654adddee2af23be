"""`llamem monitor -- python train.py`: the monitor in an unmodified transformers Trainer script.

The command runs the script with this folder first on PYTHONPATH. Its `sitecustomize.py`
(which Python's `site` imports at start-up) wraps `transformers.trainer`'s loader; once that
module is imported, `patch_trainer` makes every Trainer add a `LlamemCallback` configured from
the environment below, and run `train()` in the monitor's guard (the OOM dump) and, on a CPU or
with a capacity, inside a CpuMemoryTracker. A process of a distributed run with RANK > 0 writes
`<log>.rank<N>.jsonl` and `<oom dir>/rank<N>`.

Torch-free: the command line imports this module for `child_environment`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import sys
from pathlib import Path

ENV_LOG = "LLAMEM_MONITOR_LOG"
ENV_OOM_DIR = "LLAMEM_MONITOR_OOM_DIR"
ENV_CPU_CAPACITY = "LLAMEM_MONITOR_CPU_CAPACITY"
"""Bytes: the run trains inside a CpuMemoryTracker of this capacity (OOMs provoked on a CPU)."""
FOLDER = str(Path(__file__).resolve().parent)
"""What PYTHONPATH gets first: the folder of the sitecustomize.py that attaches the monitor."""
_CALLBACKS_MADE = itertools.count()


def child_environment(environ, log_path, oom_dir=None, cpu_capacity_bytes: int | None = None) -> dict[str, str]:
    """`environ` with the monitor's settings and this folder first on PYTHONPATH."""
    env = dict(environ)
    env[ENV_LOG] = str(Path(log_path).resolve())
    for name, value in ((ENV_OOM_DIR, oom_dir and str(Path(oom_dir).resolve())),
                        (ENV_CPU_CAPACITY, cpu_capacity_bytes and str(cpu_capacity_bytes))):
        if value:
            env[name] = value
        else:
            env.pop(name, None)
    env["PYTHONPATH"] = os.pathsep.join([FOLDER, *filter(None, [env.get("PYTHONPATH")])])
    return env


def patch_trainer(trainer_class) -> None:
    """Every `trainer_class` (and subclass) gets a LlamemCallback; `train()` runs monitored."""
    if getattr(trainer_class, "_llamem_patched", False):
        return
    init, train = trainer_class.__init__, trainer_class.train

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if _callback_of(self) is None:
            self.add_callback(callback_from_environment())

    @functools.wraps(train)
    def monitored_train(self, *args, **kwargs):
        callback = _callback_of(self)
        if callback is None:
            return train(self, *args, **kwargs)
        with _tracked(self, callback), callback.guard():
            result = train(self, *args, **kwargs)
        print(callback.monitor.summary(), file=sys.stderr)
        return result

    trainer_class.__init__, trainer_class.train = __init__, monitored_train
    trainer_class._llamem_patched = True


def callback_from_environment():
    from llamem.runtime.callback import LlamemCallback

    rank = int(os.environ.get("RANK", "0") or 0)
    log_path = Path(os.environ[ENV_LOG])
    oom_dir = os.environ.get(ENV_OOM_DIR)
    if rank > 0:  # one log per process: lines of several writers would interleave
        log_path = log_path.with_name(f"{log_path.stem}.rank{rank}{log_path.suffix}")
        oom_dir = oom_dir and str(Path(oom_dir) / f"rank{rank}")
    # A script's second Trainer continues the log its first one wrote.
    return LlamemCallback(log_path=log_path, oom_dir=oom_dir, append=next(_CALLBACKS_MADE) > 0)


def _callback_of(trainer):
    from llamem.runtime.callback import LlamemCallback

    return next((c for c in trainer.callback_handler.callbacks if isinstance(c, LlamemCallback)), None)


@contextlib.contextmanager
def _tracked(trainer, callback):
    """A CPU run, or one given a capacity, trains inside a CpuMemoryTracker: what it counts is the
    run's memory (the creation stacks name a leak's and an OOM's sources)."""
    capacity = int(os.environ[ENV_CPU_CAPACITY]) if os.environ.get(ENV_CPU_CAPACITY) else None
    if callback.tracker is not None or (capacity is None and trainer.args.device.type != "cpu"):
        yield
        return
    from llamem.runtime.tracker import CpuMemoryTracker

    # history=False: a long run keeps only its live allocations, not every event since the start.
    with CpuMemoryTracker(capacity, record_stacks=True, history=False) as tracker:
        callback.tracker = tracker
        try:
            yield
        finally:
            callback.tracker = None
