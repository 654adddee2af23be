"""`llamem monitor -- python train.py ARGS`: a training script's memory, step by step, beside
llamem's prediction, without changing the script."""

from __future__ import annotations

import os
import subprocess

import click

from llamem.errors import LlamemError, UsageError

DEFAULT_LOG = "llamem-monitor.jsonl"


@click.command(context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--log", "log_path", default=DEFAULT_LOG, show_default=True,
              help="The JSONL log: one line per step, on disk as soon as the step ends.")
@click.option("--oom-dir", help="Where an out-of-memory error writes its dump (read by `llamem explain-oom`).")
@click.option("--cpu-capacity", help="Train inside a CPU tracker of this many bytes (e.g. 64MiB): "
              "out-of-memory errors on a CPU, as a GPU of that size would raise them.")
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def monitor(log_path, oom_dir, cpu_capacity, command):
    """Run COMMAND with llamem's memory monitor in every transformers Trainer it creates.

    \b
      llamem monitor --log memory.jsonl -- python train.py --lr 1e-4

    Each optimizer step writes the peak and end-of-phase memory of forward, backward and the
    optimizer step; the workload read from the run writes llamem's prediction and the
    `llamem estimate` command that reproduces it. A CPU run is measured by a CpuMemoryTracker.
    Exits with COMMAND's exit code."""
    from llamem.files import check_writable
    from llamem.runtime.autoattach import child_environment

    if not command:
        raise UsageError("give the command to run after `--`, for example: llamem monitor -- python train.py")
    check_writable(log_path, "--log")
    if oom_dir and os.path.exists(oom_dir) and not os.path.isdir(oom_dir):
        raise LlamemError(f"--oom-dir {oom_dir}: is a file; give a folder (it is created when needed)")
    capacity_bytes = _capacity(cpu_capacity)
    if os.path.isfile(log_path):
        os.remove(log_path)  # the run writes it anew: a summary must not come from an older run
    code = _run(list(command), child_environment(os.environ, log_path, oom_dir, capacity_bytes))
    _print_where(log_path)
    return code


def _capacity(text: str | None) -> int | None:
    if text is None:
        return None
    from llamem.units import parse_size

    return parse_size(text, "--cpu-capacity")


def _run(command: list[str], env: dict[str, str]) -> int:
    """The child's exit code; 128 + N when a signal N ended it, as a shell reports it."""
    try:
        process = subprocess.Popen(command, env=env)
    except OSError as err:
        raise LlamemError(f"cannot run {command[0]!r}: {err.strerror or err}; check the command after `--`") from None
    while True:
        try:
            code = process.wait()
            break
        except KeyboardInterrupt:  # Ctrl-C reached the child too: let it end its own way, then report
            continue
    return code if code >= 0 else 128 - code



def _print_where(log_path: str) -> None:
    if os.path.isfile(log_path):
        click.echo(f"llamem monitor: log in {log_path} (`llamem report {log_path}` reads it)", err=True)
    else:
        click.echo(f"llamem monitor: no transformers Trainer trained, {log_path} was not written", err=True)
