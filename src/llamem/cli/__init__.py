"""`llamem` command line. Commands parse and orchestrate; reporters render; only `main` exits."""

from __future__ import annotations

import functools
import json
import sys

import click

from llamem.errors import LlamemError
from llamem.model import load_model, parse_overrides
from llamem.workload import build_workload, parse_ac, parse_targets

TASKS = ["infer", "train", "lora", "qlora", "distill"]


def workload_options(command):
    """The options shared by estimate and trace (and later plan): one definition, one meaning."""
    options = [
        click.argument("model", required=False),
        click.option("--config", "config_path", type=click.Path(), help="A local LLaMA/Mistral config.json."),
        click.option("--override", "overrides", multiple=True, metavar="KEY=VALUE",
                     help="Change a config field, e.g. num_hidden_layers=8 (pruning, quick runs)."),
        click.option("--task", type=click.Choice(TASKS), default="train", show_default=True),
        click.option("--batch", type=int, help="Micro-batch size.  [default: 1]"),
        click.option("--seq", type=int, help="Tokens per sequence (prompt length for infer).  [default: 2048]"),
        click.option("--new-tokens", type=int, help="Decode steps (infer).  [default: 256]"),
        click.option("--precision", help="fp32 | bf16 | fp16 | bf16-mixed | fp16-mixed.  "
                                         "[default: bf16-mixed for train/distill, bf16 otherwise]"),
        click.option("--quant", help="none | int8 | nf4 | int4.  [default: nf4 for qlora, none otherwise]"),
        click.option("--optimizer", help="adamw | adamw8bit | sgd | adafactor.  [default: adamw]"),
        click.option("--ac", help="Activation checkpointing: none | full | every-K.  [default: none]"),
        click.option("--attn", help="sdpa | eager.  [default: sdpa]"),
        click.option("--lora-rank", type=int, help="[default: 8]"),
        click.option("--lora-targets", help="Comma-separated linears, or 'all'.  [default: q_proj,v_proj]"),
        click.option("--kv-dtype", help="bf16 | fp16 | fp32 | fp8 | int8 | int4 (infer).  "
                                        "[default: the compute dtype]"),
        click.option("--grad-accum", type=int, help="Micro-batches per optimizer step.  [default: 1]"),
        click.option("--loss", help="full | chunked (logits in 8 chunks).  [default: full]"),
        click.option("--prefill-chunk", type=int,
                     help="Prompt tokens per prefill forward (infer; transformers' prefill_chunk_size).  "
                          "[default: 0, the whole prompt]"),
        click.option("--teacher", help="Teacher model for --task distill."),
        click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text."),
    ]
    return functools.reduce(lambda cmd, option: option(cmd), reversed(options), command)


def resolve(model, config_path, overrides, task, ac, lora_targets, **options):
    """ModelSpec and Workload from the shared options, with every problem reported at once."""
    spec = load_model(model, config_path=config_path, overrides=parse_overrides(overrides))
    workload = build_workload(
        task=task, ac_every=parse_ac(ac) if ac is not None else None,
        lora_targets=parse_targets(lora_targets) if lora_targets is not None else None, **options)
    teacher = load_model(workload.teacher) if workload.teacher else None
    return spec, workload, teacher


def emit(report, as_json: bool) -> None:
    from llamem.reporters.json_report import report_to_dict
    from llamem.reporters.text import render_report

    click.echo(json.dumps(report_to_dict(report), indent=2) if as_json else render_report(report))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="llamem")
def app():
    """Plan and manage GPU memory for LLaMA-family models."""


def layout_options(command):
    options = [
        click.option("--gpus", type=int, default=1, show_default=True, help="GPUs (per-GPU memory is reported)."),
        click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel degree."),
        click.option("--pp", type=int, default=1, show_default=True, help="Pipeline-parallel degree."),
        click.option("--sharding", type=click.Choice(["none", "ddp", "zero1", "zero2", "zero3"]), default=None,
                     help="Data-parallel sharding.  [default: ddp with several GPUs]"),
        click.option("--offload", type=click.Choice(["none", "optimizer", "optimizer+params"]), default="none",
                     show_default=True, help="DeepSpeed ZeRO-Offload to host memory."),
        click.option("--pp-schedule", type=click.Choice(["1f1b", "gpipe"]), default="1f1b", show_default=True,
                     help="Pipeline schedule: micro-batches in flight on the first stage (pp, or all of them)."),
    ]
    return functools.reduce(lambda cmd, option: option(cmd), reversed(options), command)


def make_layout(spec, workload, gpus, tp, pp, sharding, offload, pp_schedule="1f1b"):
    from llamem.errors import InvalidWorkload
    from llamem.parallel import Layout, check_layout

    if min(gpus, tp, pp) < 1:
        raise InvalidWorkload(["--gpus, --tp and --pp must be at least 1"])
    if gpus % (tp * pp):
        raise InvalidWorkload([f"--gpus {gpus} is not a multiple of --tp {tp} x --pp {pp}"])
    if pp_schedule != "1f1b" and pp == 1:
        raise InvalidWorkload([f"--pp-schedule {pp_schedule} needs pipeline parallelism: add --pp N (N > 1)"])
    dp = gpus // (tp * pp)
    sharding = sharding or ("ddp" if dp > 1 else "none")
    # Under pipeline parallelism the accumulation steps are the pipeline's micro-batches.
    layout = Layout(dp=dp, tp=tp, pp=pp, sharding=sharding, offload=offload, pipeline_schedule=pp_schedule,
                    microbatches=workload.grad_accum if pp > 1 else 1)
    problems = check_layout(spec, layout)
    if problems:
        raise InvalidWorkload(problems)
    return layout


@app.command()
@workload_options
@layout_options
def estimate(as_json, gpus, tp, pp, sharding, offload, pp_schedule, **options):
    """How much memory a workload takes, and where it goes (analytic, no torch)."""
    import dataclasses

    from llamem.allocator.integrate import add_device_memory
    from llamem.analytic import estimate as run_estimate
    from llamem.analytic.schedule import schedule
    from llamem.parallel import per_gpu_phases, shard_spec

    spec, workload, teacher = resolve(**options)
    report = run_estimate(spec, workload, teacher)
    layout = make_layout(spec, workload, gpus, tp, pp, sharding, offload, pp_schedule)
    if layout.num_gpus > 1 or layout.sharding != "none":
        phases = per_gpu_phases(spec, workload, layout, teacher)
        report = dataclasses.replace(report, phases=phases, notes=report.notes + (
            f"per GPU, the busiest GPU of {layout.describe()}",))
    local = shard_spec(spec, layout)
    emit(add_device_memory(report, schedule(local, workload), exact=False, num_gpus=layout.num_gpus), as_json)


@app.command()
@workload_options
@click.option("--save-trace", type=click.Path(), help="Write every allocation and free as JSON.")
def trace(as_json, save_trace, **options):
    """The same report, exact: runs the real transformers code on fake tensors (needs torch)."""
    spec, workload, teacher = resolve(**options)
    from llamem.trace.api import run_trace

    report, events = run_trace(spec, workload, teacher, save_trace=save_trace)
    from llamem.allocator.integrate import add_device_memory

    emit(add_device_memory(report, events, exact=True), as_json)


@app.command()
@workload_options
@click.option("--gpu", "gpu_name", help="A card from `llamem gpus`.")
@click.option("--budget", help="Free memory of any card, e.g. 22GiB (instead of --gpu).")
@click.option("--gpus", type=int, default=1, show_default=True, help="GPUs available.")
@click.option("--min-gpus", is_flag=True, help="Find the fewest GPUs of this kind that fit.")
@click.option("--maximize", type=click.Choice(["batch", "seq"]), help="Also report the largest batch or sequence.")
@click.option("--host-memory", help="Host RAM usable for offload.  [default: this machine's RAM]")
@click.option("--verify", is_flag=True, help="Re-check the winning plan with `llamem trace` (needs torch).")
@click.option("--exact", is_flag=True, help="Only changes that keep the numerics: no pure bf16, 8-bit or "
              "factored optimizer state, quantized weights or KV cache.")
@click.option("--no-truncation", is_flag=True, help="Never shorten sequences (the last resort when nothing else "
              "fits); report the shortfall instead.")
@click.option("--code", "show_code", is_flag=True, help="Also print the transformers / peft code that applies the plan.")
def plan(as_json, gpu_name, budget, gpus, min_gpus, maximize, host_memory, verify, exact, no_truncation, show_code,
         **options):
    """The cheapest set of changes that fits a GPU: a ladder, and the command that reproduces it."""
    from llamem.gpus import budget_gpu, get_gpu
    from llamem.plan import does_not_fit, make_plan
    from llamem.reporters.plan_report import plan_to_dict, render_plan
    from llamem.units import parse_size

    if bool(gpu_name) == bool(budget):
        from llamem.errors import LlamemError

        raise LlamemError("name a card with --gpu NAME (see `llamem gpus`) or give a memory budget with "
                          "--budget SIZE, one of the two")
    if gpus < 1:
        from llamem.errors import LlamemError

        raise LlamemError(f"--gpus must be at least 1, got {gpus}")
    spec, workload, teacher = resolve(**options)
    gpu = get_gpu(gpu_name) if gpu_name else budget_gpu(parse_size(budget))
    host = parse_size(host_memory) if host_memory else _host_memory_bytes()
    result = make_plan(spec, workload, gpu, num_gpus=gpus, host_budget_bytes=host, teacher=teacher,
                       maximize=maximize, min_gpus=min_gpus, exact=exact, truncate=not no_truncation)
    if verify and result.fits:
        from llamem.plan_verify import verify_plan

        result.verification = verify_plan(result)
    click.echo(json.dumps(plan_to_dict(result), indent=2) if as_json else render_plan(result))
    if show_code and not as_json and result.fits:
        from llamem.snippet import plan_code

        click.echo("\ncode:\n" + plan_code(result))
    if not result.fits:
        raise does_not_fit(result)


def _host_memory_bytes() -> int:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 64 * 2**30


@app.command()
@click.option("--json", "as_json", is_flag=True)
def gpus(as_json):
    """List the GPU catalog: memory, formats, speed, bandwidth, sources."""
    from llamem.gpus import CATALOG

    if as_json:
        click.echo(json.dumps([{**g.__dict__, "usable_bytes": g.usable_bytes} for g in CATALOG.values()], indent=2))
        return
    click.echo(f"{'name':<14} {'memory':>10} {'usable':>10} {'bf16':>5} {'fp8':>4} {'bf16 TFLOP/s':>13} "
               f"{'mem TB/s':>9} {'link GB/s':>10}")
    for g in CATALOG.values():
        click.echo(f"{g.name:<14} {g.memory_bytes / 2**30:>6.1f} GiB {g.usable_bytes / 2**30:>6.1f} GiB "
                   f"{'yes' if g.bf16 else 'no':>5} {'yes' if g.fp8 else 'no':>4} {g.bf16_flops / 1e12:>13.0f} "
                   f"{g.memory_bandwidth / 1e12:>9.2f} {g.interconnect_bandwidth / 1e9:>10.0f}")


@app.command()
@click.option("--json", "as_json", is_flag=True)
def models(as_json):
    """List the built-in model presets with their parameter counts."""
    from llamem.model import preset_names

    specs = [load_model(name) for name in preset_names()]
    if as_json:
        click.echo(json.dumps([{"name": s.name, "hf_id": s.hf_id, "num_params": s.num_params,
                                "num_layers": s.num_layers, "hidden_size": s.hidden_size,
                                "num_kv_heads": s.num_kv_heads, "vocab_size": s.vocab_size,
                                "source": s.source} for s in specs], indent=2))
        return
    click.echo(f"{'name':<18} {'params':>9}  {'layers':>6} {'hidden':>6} {'heads':>5} {'kv':>3} {'vocab':>7}  hf id")
    for s in specs:
        click.echo(f"{s.name:<18} {s.num_params / 1e9:>8.2f}B  {s.num_layers:>6} {s.hidden_size:>6} "
                   f"{s.num_heads:>5} {s.num_kv_heads:>3} {s.vocab_size:>7}  {s.hf_id}")


def _register_groups() -> None:
    from llamem.cli.allocator import allocator

    app.add_command(allocator)


_register_groups()


def main(argv: list[str] | None = None) -> int:
    try:
        app.main(args=argv, prog_name="llamem", standalone_mode=False)
    except LlamemError as err:
        click.echo(f"error: {err}", err=True)
        return err.exit_code
    except click.exceptions.Exit as err:
        return err.exit_code
    except SystemExit as err:
        return int(err.code or 0)
    except click.ClickException as err:
        err.show()
        return err.exit_code
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
