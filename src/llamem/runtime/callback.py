"""LlamemCallback: the MemoryMonitor in a transformers Trainer.

    trainer = Trainer(..., callbacks=[LlamemCallback(log_path="memory.jsonl", oom_dir="oom")])
    with callback.guard():       # optional: the OOM dump (a callback never sees the Trainer's errors)
        trainer.train()

`llamem monitor -- python train.py` adds it to every Trainer of an unmodified script.
"""

from __future__ import annotations

import contextlib

from transformers import TrainerCallback

from llamem.runtime.monitor import DEFAULT_LEAK_WINDOW, MemoryMonitor


class LlamemCallback(TrainerCallback):
    """Opens a MemoryMonitor on the Trainer's model and optimizer when training begins, ends a
    monitored step at each optimizer step, closes it when training ends. `tracker`: the
    CpuMemoryTracker a CPU run trains in (None: the CUDA device). `append`: continue the log
    instead of starting it anew (a later `train()` call always continues it)."""

    def __init__(self, log_path=None, tracker=None, oom_dir=None, *, leak_window: int | None = DEFAULT_LEAK_WINDOW,
                 task: str | None = None, append: bool = False) -> None:
        self.log_path, self.tracker, self.oom_dir = log_path, tracker, oom_dir
        self.leak_window, self.task = leak_window, task
        self.monitor: MemoryMonitor | None = None
        self._runs = 1 if append else 0

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self.close()
        # auto_find_batch_size begins again after an OOM: the same log goes on.
        self.monitor = MemoryMonitor(model, optimizer, self.log_path, tracker=self.tracker, oom_dir=self.oom_dir,
                                     leak_window=self.leak_window, task=self.task,
                                     grad_accum=args.gradient_accumulation_steps, append=self._runs > 0)
        self.monitor.step_number = state.global_step + 1
        self.monitor.open()
        self._runs += 1

    def on_step_end(self, args, state, control, **kwargs):
        if self.monitor is not None:
            self.monitor.step(state.global_step)

    def on_train_end(self, args, state, control, **kwargs):
        self.close()

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()

    @contextlib.contextmanager
    def guard(self):
        """Around `trainer.train()`: an out-of-memory error is logged (and dumped to `oom_dir`)
        before it goes on, and the monitor is closed however training ends."""
        import torch

        try:
            yield self
        except torch.OutOfMemoryError as error:
            if self.monitor is not None:
                self.monitor.record_oom(error)
            raise
        finally:
            self.close()
