"""`llamem` command line. Commands parse and print; the library does the work; only `main` exits.

Exit codes (`llamem.errors`): 0 ok, 1 invalid input, 2 usage error, 3 does not fit or a simulated
out-of-memory error. With `--json`, an error is printed on stdout as
`{"error": {"type": ..., "message": ..., "exit_code": ...}}`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shlex
import sys

import click

from llamem.cli.serving import (estimate_server, estimate_server_options, plan_server, plan_server_options,
                                pop_server_options)
from llamem.errors import EXIT_DOES_NOT_FIT, EXIT_INVALID_INPUT, EXIT_USAGE, LlamemError, UsageError
from llamem.model import load_model, parse_overrides
from llamem.techniques import RECORDS
from llamem.workload import ALL_TASKS, build_workload, parse_ac_fields, parse_targets


def _apply(options, command):
    return functools.reduce(lambda cmd, option: option(cmd), reversed(options), command)


def workload_options(command):
    """The options shared by estimate, trace and plan: the model, the task, and every setting's
    options from its record in `llamem.techniques`."""
    options = [
        click.argument("model", required=False),
        click.option("--config", "config_path", help="A local LLaMA/Mistral config.json."),
        click.option("--override", "overrides", multiple=True, metavar="KEY=VALUE",
                     help="Change a config field, e.g. num_hidden_layers=8 (pruning, quick runs)."),
        click.option("--task", type=click.Choice(ALL_TASKS), default="train", show_default=True),
    ]
    options += [click.option(o.flag, o.field, type=o.type, help=o.help) for r in RECORDS for o in r.options]
    options.append(click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text."))
    return _apply(options, command)


def layout_options(command):
    options = [
        click.option("--gpus", type=int, default=1, show_default=True, help="GPUs (per-GPU memory is reported)."),
        click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel degree."),
        click.option("--pp", type=int, default=1, show_default=True, help="Pipeline-parallel degree."),
        click.option("--ep", type=int, default=1, show_default=True,
                     help="Expert-parallel degree (mixtures of experts): experts per GPU = experts / ep, carved "
                     "out of the data-parallel GPUs."),
        click.option("--sharding", type=click.Choice(["none", "ddp", "zero1", "zero2", "zero3"]), default=None,
                     help="Data-parallel sharding.  [default: ddp with several GPUs]"),
        click.option("--offload", type=click.Choice(["none", "optimizer", "optimizer+params"]), default="none",
                     show_default=True, help="DeepSpeed ZeRO-Offload to host memory."),
        click.option("--pp-schedule", type=click.Choice(["1f1b", "gpipe"]), default="1f1b", show_default=True,
                     help="Pipeline schedule: micro-batches in flight on the first stage (pp, or all of them)."),
        click.option("--engine", type=click.Choice(["deepspeed", "fsdp2", "megatron"]), default="deepspeed",
                     show_default=True,
                     help="Who runs the layout, each sized as it runs: DeepSpeed, torch FSDP2 (--sharding zero3: "
                     "fully_shard per layer; plan --engine fsdp2 chooses it) or Megatron-LM (its 16-bit model, fp32 "
                     "gradient buffer and main weights; --sharding zero1 is its distributed optimizer)."),
    ]
    return _apply(options, command)


def node_options(command):
    """--nodes and --gpus-per-node (estimate and plan): the GPUs as whole nodes."""
    options = [
        click.option("--nodes", type=int, help="Nodes: the GPUs are --nodes x --gpus-per-node (then --gpus may "
                     "be left out)."),
        click.option("--gpus-per-node", type=int, help="GPUs in one node: collectives over more run on the network "
                     "between nodes; tensor parallel stays in a node.  [default: plan, the card's node; estimate, "
                     "one node]"),
    ]
    return _apply(options, command)


def node_gpus(gpus: int, nodes: int | None, gpus_per_node: int | None,
              default_per_node: int | None = None) -> tuple[int, int | None]:
    """(total GPUs, GPUs per node or None) from --gpus, --nodes and --gpus-per-node, which must agree."""
    from click.core import ParameterSource

    from llamem.cluster import resolve_gpus
    from llamem.parallel import MAX_GPUS

    given = click.get_current_context().get_parameter_source("gpus") is not ParameterSource.DEFAULT
    total, per_node = resolve_gpus(gpus=gpus, gpus_given=given, nodes=nodes, gpus_per_node=gpus_per_node,
                                   default_per_node=default_per_node)
    if total > MAX_GPUS:
        raise UsageError(f"--nodes {nodes} x --gpus-per-node {per_node} = {total:,} GPUs: at most {MAX_GPUS:,}")
    return total, per_node


def resolve(model, config_path, overrides, task, ac_every, lora_targets, **options):
    """ModelSpec, Workload and teacher from the shared options, and the arguments that name the model
    in a reproduce command."""
    uploaded = click.get_current_context().obj  # a config.json sent to `llamem serve`, checked and overridden
    spec = uploaded if uploaded is not None else load_model(model, config_path=config_path,
                                                            overrides=parse_overrides(overrides))
    workload = build_workload(
        task=task, **(parse_ac_fields(ac_every) if ac_every is not None else {}),
        lora_targets=parse_targets(lora_targets) if lora_targets is not None else None, **options)
    teacher = load_model(workload.teacher) if workload.teacher else None
    return spec, workload, teacher, model_args(model, config_path, overrides)


def model_args(model, config_path, overrides) -> tuple[str, ...]:
    """How the command line named the model: what a reproduce command must repeat."""
    args = [shlex.quote(str(model))] if model else ["--config", shlex.quote(str(config_path))]
    for item in overrides:
        args += ["--override", shlex.quote(item)]
    return tuple(args)


def echo_json(data) -> None:
    click.echo(json.dumps(data, indent=2))


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100, "terminal_width": 100})
@click.version_option(package_name="llamem")
def app():
    """Plan and manage GPU memory for LLaMA-family models."""


@app.command()
@workload_options
@layout_options
@node_options
@click.option("--html", "html_path", metavar="FILE", help="Also write the report as one self-contained HTML page.")
@estimate_server_options
def estimate(as_json, html_path, gpus, tp, pp, ep, sharding, offload, pp_schedule, engine, nodes, gpus_per_node,
             **options):
    """How much memory a workload takes, and where it goes (analytic, no torch). With --server, what a
    vLLM or SGLang launch reports at start-up."""
    from llamem.parallel import make_layout
    from llamem.reporters.json_report import report_to_dict
    from llamem.reporters.text import render_report
    from llamem.sizing import estimate_report

    if (server := pop_server_options(options))["server"]:
        return estimate_server(server, options=options, as_json=as_json, gpus=gpus, tp=tp)
    gpus, per_node = node_gpus(gpus, nodes, gpus_per_node)
    if per_node:
        from llamem.cluster import Cluster, placement_problems
        from llamem.errors import InvalidWorkload

        if problems := placement_problems(tp=tp, cluster=Cluster(gpus_per_node=per_node)):
            raise InvalidWorkload(problems)
    spec, workload, teacher, _names = resolve(**options)
    layout = make_layout(spec, workload, gpus=gpus, tp=tp, pp=pp, sharding=sharding, offload=offload,
                         pp_schedule=pp_schedule, engine=engine, ep=ep)
    report = estimate_report(spec, workload, layout, teacher)
    if html_path:
        from llamem.reporters.html import write_estimate_html

        write_estimate_html(html_path, report, spec, workload, teacher)
    click.echo(json.dumps(report_to_dict(report), indent=2) if as_json else render_report(report))


@app.command()
@workload_options
@click.option("--save-trace", help="Write every allocation and free as JSON.")
def trace(as_json, save_trace, **options):
    """The same report, exact: runs the real transformers code on fake tensors (needs torch)."""
    from llamem.files import check_writable
    from llamem.reporters.json_report import report_to_dict
    from llamem.reporters.text import render_report
    from llamem.sizing import trace_report

    spec, workload, teacher, _names = resolve(**options)
    if save_trace:
        check_writable(save_trace, "--save-trace")
    report, _events = trace_report(spec, workload, teacher, save_trace=save_trace)
    click.echo(json.dumps(report_to_dict(report), indent=2) if as_json else render_report(report))


@app.command()
@workload_options
@click.option("--gpu", "gpu_name", help="A card from `llamem gpus`.")
@click.option("--budget", help="Free memory of any card, e.g. 22GiB (instead of --gpu).")
@click.option("--gpus", type=int, default=1, show_default=True, help="GPUs available.")
@click.option("--min-gpus", is_flag=True, help="Find the fewest GPUs of this kind that fit.")
@click.option("--maximize", type=click.Choice(["batch", "seq"]), help="Also report the largest batch or sequence.")
@click.option("--host-memory", help="Host RAM usable for offload, e.g. 256GiB.  [default: this machine's RAM]")
@click.option("--verify", is_flag=True, help="Re-check the winning plan with `llamem trace` (needs torch).")
@click.option("--exact", is_flag=True, help="Only changes that keep the numerics: no pure bf16, 8-bit or "
              "factored optimizer state, quantized weights or KV cache.")
@click.option("--no-truncation", is_flag=True, help="Never shorten sequences (the last resort when nothing else "
              "fits); report the shortfall instead.")
@click.option("--code", "show_code", is_flag=True, help="Also print the transformers / peft code that applies the plan.")
@click.option("--emit", "emit_dir", metavar="DIR", help="Write a launch bundle of the plan into DIR: train.py or "
              "generate.py, launch.sh (torchrun / DeepSpeed / accelerate), configs, README. The search keeps only "
              "what the bundle runs.")
@click.option("--engine", type=click.Choice(["any", "fsdp2", "deepspeed", "accelerate", "trainer", "megatron"]),
              default="any", show_default=True, help="Only layouts this engine runs: fsdp2 (torchrun: DDP, FSDP2), "
              "deepspeed (ZeRO-1/2/3, offload), accelerate or trainer (both), megatron (TP, PP, distributed "
              "optimizer; prints Megatron-LM arguments, no bundle).")
@click.option("--html", "html_path", metavar="FILE", help="Also write the plan as one self-contained HTML page.")
@node_options
@plan_server_options
def plan(as_json, html_path, show_code, emit_dir, **choices):
    """The cheapest set of changes that fits a GPU: a ladder, and the command that reproduces it.
    With several GPUs, --batch x --grad-accum is the global batch per optimizer step. With --server,
    the cheapest vLLM or SGLang launch for --concurrency requests of --seq tokens."""
    from llamem.plan import does_not_fit
    from llamem.reporters.plan_report import plan_to_dict, render_plan

    if (server := pop_server_options(choices, ("server", "concurrency")))["server"]:
        return plan_server(server, options=choices, as_json=as_json, gpu_name=choices.pop("gpu_name"),
                           gpus=choices.pop("gpus"))
    runnable = None
    if emit_dir is not None:  # the search keeps only what the bundle runs; a bad --engine fails before it
        from llamem.bundle.emit import bundle_runs

        runnable = bundle_runs(choices["engine"])
    result = plan_result(**choices, runnable=runnable)
    emitted = None
    if emit_dir is not None:
        from llamem.bundle.emit import emit_plan

        emitted = emit_plan(result, emit_dir, engine=choices["engine"])
    if html_path:
        from llamem.reporters.html import write_plan_html

        write_plan_html(html_path, result)
    data = plan_to_dict(result) if as_json else None
    if data is not None and emitted is not None and emitted.data:
        data["bundle"] = emitted.data
    click.echo(json.dumps(data, indent=2) if as_json else render_plan(result, show_code=show_code))
    if emitted is not None:
        click.echo(emitted.line, err=as_json)
    if not result.fits:
        if as_json:  # the plan's JSON says so ("fits": false, "shortfall_bytes"): one document on stdout
            click.echo(f"error: {does_not_fit(result)}", err=True)
            return EXIT_DOES_NOT_FIT
        raise does_not_fit(result)
    return 0


def plan_result(gpu_name, budget, gpus, min_gpus, maximize, host_memory, verify, exact, no_truncation, engine, nodes,
                gpus_per_node, runnable=None, **options):
    """The Plan of `llamem plan`'s parsed options (inside its click context): what it prints, and what
    `llamem serve` answers and bundles."""
    from llamem.gpus import budget_gpu, get_gpu
    from llamem.plan import make_plan
    from llamem.units import parse_size

    if bool(gpu_name) == bool(budget):
        raise UsageError("name a card with --gpu NAME (see `llamem gpus`) or give a memory budget with "
                         "--budget SIZE (for example 22GiB), one of the two")
    from llamem.parallel import MAX_GPUS

    if not 1 <= gpus <= MAX_GPUS:
        raise LlamemError(f"--gpus must be from 1 to {MAX_GPUS:,}, got {gpus}")
    spec, workload, teacher, names = resolve(**options)
    gpu = get_gpu(gpu_name) if gpu_name else budget_gpu(parse_size(budget, "--budget"))
    if min_gpus and nodes is not None:
        raise UsageError(f"--min-gpus chooses the number of GPUs, --nodes {nodes} fixes it: drop one of the two "
                         "(--gpus-per-node alone sets the node size --min-gpus plans on)")
    gpus, per_node = node_gpus(gpus, nodes, gpus_per_node, default_per_node=gpu.gpus_per_node)
    if per_node:  # the planner, its cost model and the bundle place ranks on nodes of the card's gpus_per_node
        gpu = dataclasses.replace(gpu, gpus_per_node=per_node)
    host = parse_size(host_memory, "--host-memory") if host_memory else default_host_memory_bytes()
    result = make_plan(spec, workload, gpu, num_gpus=gpus, host_budget_bytes=host, teacher=teacher,
                       maximize_what=maximize, min_gpus=min_gpus, exact=exact, truncate=not no_truncation,
                       model_args=names, engine=engine, runnable=runnable)
    if verify and result.fits:
        from llamem.plan_verify import verify_plan

        result = verify_plan(result)
    return result


def default_host_memory_bytes() -> int:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 64 * 2**30


@app.command()
@click.option("--json", "as_json", is_flag=True)
def gpus(as_json):
    """List the GPU catalog: memory as CUDA reports it, formats, speed, bandwidth, sources."""
    from llamem.gpus import CATALOG
    from llamem.reporters.catalog import gpu_rows, render_gpus

    click.echo(json.dumps(gpu_rows(CATALOG.values()), indent=2) if as_json else render_gpus(CATALOG.values()))


@app.command()
@click.option("--json", "as_json", is_flag=True)
def models(as_json):
    """List the built-in model presets with their parameter counts."""
    from llamem.model import preset_names
    from llamem.reporters.catalog import model_rows, render_models

    specs = [load_model(name) for name in preset_names()]
    click.echo(json.dumps(model_rows(specs), indent=2) if as_json else render_models(specs))


def _register_groups() -> None:
    """The command groups and runtime commands that live in their own modules."""
    from llamem.cli.allocator import allocator
    from llamem.cli.doctor import doctor
    from llamem.cli.monitor import monitor
    from llamem.cli.runtime_reports import explain_oom, report
    from llamem.cli.serve import serve

    for command in (allocator, doctor, explain_oom, monitor, report, serve):
        app.add_command(command)


_register_groups()


def main(argv: list[str] | None = None, *, uploaded=None) -> int:
    """Run the command line; every error becomes a message and an exit code, never a traceback.
    `uploaded`: the ModelSpec of a config.json `llamem serve` received, standing for `--config`."""
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = app.main(args=argv, prog_name="llamem", standalone_mode=False, obj=uploaded)
    except LlamemError as err:
        return _fail(argv, type(err).__name__, str(err), err.exit_code)
    except click.exceptions.Exit as err:
        return err.exit_code
    except click.UsageError as err:
        hint = f"\n{err.ctx.get_usage()}\nTry '{err.ctx.command_path} --help' for help." if err.ctx else ""
        return _fail(argv, "UsageError", err.format_message(), EXIT_USAGE, hint)
    except click.ClickException as err:
        return _fail(argv, type(err).__name__, err.format_message(), EXIT_INVALID_INPUT)
    except click.exceptions.Abort:
        return _fail(argv, "Aborted", "aborted", EXIT_INVALID_INPUT)
    except BrokenPipeError:
        return 0
    except Exception as err:  # a bug: say so plainly, without a traceback (LLAMEM_DEBUG=1 shows it)
        import os

        if os.environ.get("LLAMEM_DEBUG"):
            raise
        return _fail(argv, "InternalError", f"internal error ({type(err).__name__}: {err}); this is a bug in "
                     "llamem: please report it with the command line (LLAMEM_DEBUG=1 prints the traceback)",
                     EXIT_INVALID_INPUT)
    return code if isinstance(code, int) else 0


def _fail(argv: list[str], kind: str, message: str, code: int, hint: str = "") -> int:
    if "--json" in argv:
        click.echo(json.dumps({"error": {"type": kind, "message": message, "exit_code": code}}, indent=2))
    else:
        click.echo(f"error: {message}{hint}", err=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
