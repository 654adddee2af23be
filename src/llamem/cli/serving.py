"""`llamem estimate --server` and `llamem plan --server`: the options, the hand-over, and the rendering.

`estimate` and `plan` declare these options and pass every parsed option here first; with --server set
the whole command runs here (`llamem.serving` does the arithmetic), otherwise the options are removed
and the command goes on as before.
"""

from __future__ import annotations

import json

import click

from llamem.errors import EXIT_DOES_NOT_FIT, UsageError
from llamem.units import format_gib

SERVER_ONLY = ("server_gpu", "max_model_len", "gpu_memory_utilization", "mem_fraction_static", "max_num_seqs",
               "max_num_batched_tokens", "kv_cache_dtype", "server_version")
_SERVER_HELP = "Size a vLLM or SGLang server launch as its start-up log reports it (with --task infer)."
_VERSION_HELP = "Accounting era: vllm v1 (0.8+) or v0; sglang 0.5 (0.5.4+) or 0.4.  [default: the newest]"


def _apply(options, command):
    for option in reversed(options):
        command = option(command)
    return command


def estimate_server_options(command):
    """The server options of `llamem estimate`."""
    return _apply([
        click.option("--server", type=click.Choice(["vllm", "sglang"]), help=_SERVER_HELP),
        click.option("--gpu", "server_gpu", metavar="NAME", help="With --server: a card from `llamem gpus`."),
        click.option("--max-model-len", type=int, help="With --server: tokens per request (SGLang's "
                     "--context-length).  [default: the model's max_position_embeddings]"),
        click.option("--gpu-memory-utilization", type=float, help="vLLM: fraction of the card.  [default: 0.9]"),
        click.option("--mem-fraction-static", type=float, help="SGLang: fraction of free memory for weights and "
                     "KV cache.  [default: SGLang's rule for the card]"),
        click.option("--max-num-seqs", type=int, help="With --server: concurrent requests (SGLang's "
                     "--max-running-requests).  [default: the server's]"),
        click.option("--max-num-batched-tokens", type=int, help="With --server: tokens per forward, the "
                     "chunked-prefill size (SGLang's --chunked-prefill-size).  [default: the server's]"),
        click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), help="With --server: the KV cache "
                     "dtype.  [default: auto, the model dtype]"),
        click.option("--server-version", help=_VERSION_HELP),
    ], command)


def plan_server_options(command):
    """The server options of `llamem plan` (--gpu, --gpus and --seq are plan's own)."""
    return _apply([
        click.option("--server", type=click.Choice(["vllm", "sglang"]), help="Plan a vLLM or SGLang launch: "
                     "TP degree, weight and KV formats, batching limits (needs --gpu and --concurrency)."),
        click.option("--concurrency", type=int, help="With --server: concurrent requests of --seq tokens to serve."),
    ], command)


def pop_server_options(options: dict, names=("server",) + SERVER_ONLY) -> dict:
    """Take the server options out of a command's options; without --server any of them is an error."""
    taken = {name: options.pop(name, None) for name in names}
    given = [f"--{n.removeprefix('server_').replace('_', '-')}" for n in names[1:] if taken[n] is not None]
    if not taken["server"] and given:
        raise UsageError(f"{', '.join(given)} only apply to a server launch: add --server vllm or --server sglang")
    return taken


_INFER_ONLY = {"batch": "--batch", "seq": "--seq (use --max-model-len)", "new_tokens": "--new-tokens",
               "lora_rank": "--lora-rank", "lora_targets": "--lora-targets", "kv_dtype": "--kv-dtype (use "
               "--kv-cache-dtype)", "prefill_chunk": "--prefill-chunk (use --max-num-batched-tokens)",
               "ac_every": "--ac", "loss": "--loss", "liger": "--liger", "compile": "--compile",
               "optimizer": "--optimizer", "max_grad_norm": "--max-grad-norm",
               "optimizer_in_backward": "--optimizer-in-backward", "grad_accum": "--grad-accum",
               "teacher": "--teacher", "teacher_quant": "--teacher-quant", "attn": "--attn",
               "offload_activations": "--offload-activations", "padding": "--padding",
               "pad_fraction": "--pad-fraction", "padding_free": "--padding-free"}


def _model_and_dtype(options: dict, allowed: tuple[str, ...] = ()):
    """The ModelSpec and dtype bytes of a server command; workload flags that a server does not take
    are refused by name."""
    from click.core import ParameterSource

    from llamem.model import load_model, parse_overrides

    ctx = click.get_current_context()
    if options.get("task") not in (None, "infer") and ctx.get_parameter_source("task") is not ParameterSource.DEFAULT:
        raise UsageError(f"--server sizes inference: use --task infer, not --task {options['task']}")
    extra = [flag for name, flag in _INFER_ONLY.items()
             if name not in allowed and ctx.get_parameter_source(name) not in (None, ParameterSource.DEFAULT)]
    if extra:
        raise UsageError(f"{', '.join(extra)} {_do_not_apply(extra)} with --server: {_drop(extra)}")
    precision = options.get("precision") or "bf16"
    if precision not in ("bf16", "fp16", "fp32"):
        raise UsageError(f"--precision {precision}: a server runs bf16, fp16 or fp32 weights")
    uploaded = ctx.obj
    spec = uploaded if uploaded is not None else load_model(
        options.get("model"), config_path=options.get("config_path"),
        overrides=parse_overrides(options.get("overrides") or ()))
    return spec, 4 if precision == "fp32" else 2


_NOT_FOR_SERVERS = {
    "estimate": ("pp", "ep", "sharding", "offload", "pp_schedule", "engine", "nodes", "gpus_per_node", "html_path"),
    "plan": ("budget", "min_gpus", "maximize", "host_memory", "verify", "exact", "no_truncation", "engine", "nodes",
             "gpus_per_node", "html_path", "show_code", "emit_dir", "quant"),
}


def _refuse_flags(command: str) -> None:
    """Options of the command that a server launch does not take: named, never silently ignored."""
    from click.core import ParameterSource

    ctx = click.get_current_context()
    given = [p.opts[0] for p in ctx.command.params if p.name in _NOT_FOR_SERVERS[command]
             and ctx.get_parameter_source(p.name) not in (None, ParameterSource.DEFAULT)]
    if given:
        chooses = "; plan --server chooses the weight format itself" if command == "plan" else ""
        raise UsageError(f"{', '.join(given)} {_do_not_apply(given)} with --server (a server shards by --tp and "
                         f"replicates by --gpus{chooses}): {_drop(given)}")


def _do_not_apply(flags: list[str]) -> str:
    return "does not apply" if len(flags) == 1 else "do not apply"


def _drop(flags: list[str]) -> str:
    return "drop it" if len(flags) == 1 else "drop them"


def estimate_server(server: dict, *, options: dict, as_json: bool, gpus: int, tp: int) -> int:
    """`llamem estimate --server`: one launch's start-up figures, text or JSON."""
    from click.core import ParameterSource

    from llamem.gpus import get_gpu
    from llamem.serving import ServerConfig, serving_report
    from llamem.serving.plan import launch_command

    _refuse_flags("estimate")
    if not server["server_gpu"]:
        raise UsageError("--server needs the card: add --gpu NAME (see `llamem gpus`)")
    spec, dtype_bytes = _model_and_dtype(options)
    gpus_given = click.get_current_context().get_parameter_source("gpus") is not ParameterSource.DEFAULT
    config = ServerConfig(
        server=server["server"], gpu=get_gpu(server["server_gpu"]), tp=tp, gpus=gpus if gpus_given else None,
        max_model_len=server["max_model_len"], gpu_memory_utilization=server["gpu_memory_utilization"],
        mem_fraction_static=server["mem_fraction_static"], max_num_seqs=server["max_num_seqs"],
        max_num_batched_tokens=server["max_num_batched_tokens"], kv_cache_dtype=server["kv_cache_dtype"] or "auto",
        quant=options.get("quant") or "none", dtype_bytes=dtype_bytes, version=server["server_version"])
    report = serving_report(spec, config)
    command = launch_command(spec, report)
    reproduce = _reproduce(options, report)
    click.echo(json.dumps(report.to_dict() | {"command": command, "reproduce": reproduce}, indent=2) if as_json
               else render_report(report, command, reproduce))
    return 0


def _reproduce(options: dict, report) -> str:
    """The `llamem estimate --server` command that gives a report's figures."""
    import shlex

    from llamem.serving.plan import estimate_command

    model = (shlex.quote(options["model"]) if options.get("model")
             else f"--config {shlex.quote(str(options.get('config_path')))}")
    model += "".join(f" --override {shlex.quote(item)}" for item in options.get("overrides") or ())
    precision = options.get("precision")
    return estimate_command(model, report) + (f" --precision {precision}" if precision not in (None, "bf16") else "")


def plan_server(server: dict, *, options: dict, as_json: bool, gpu_name: str | None, gpus: int) -> int:
    """`llamem plan --server`: the cheapest launch for --concurrency requests of --seq tokens."""
    from click.core import ParameterSource

    from llamem.gpus import get_gpu
    from llamem.serving.plan import plan_does_not_fit, plan_serving

    _refuse_flags("plan")
    if not gpu_name or server["concurrency"] is None or options.get("seq") is None:
        raise UsageError("plan --server needs --gpu NAME, --concurrency C and --seq L (tokens per request)")
    spec, dtype_bytes = _model_and_dtype(options, allowed=("seq",))
    gpu = get_gpu(gpu_name)
    given = click.get_current_context().get_parameter_source("gpus") is not ParameterSource.DEFAULT
    plan = plan_serving(spec, server=server["server"], gpu=gpu, concurrency=server["concurrency"],
                        seq=options["seq"], max_gpus=gpus if given else gpu.gpus_per_node, dtype_bytes=dtype_bytes)
    if as_json:
        data = {"fits": plan.fits, "concurrency": plan.concurrency, "seq": plan.seq, "tried": plan.tried,
                "command": plan.command, "reproduce": _reproduce(options, plan.report),
                "report": plan.report.to_dict()}
        click.echo(json.dumps(data, indent=2))
    else:
        click.echo(render_plan(plan, _reproduce(options, plan.report)))
    if not plan.fits:
        if as_json:
            click.echo(f"error: {plan_does_not_fit(plan)}", err=True)
            return EXIT_DOES_NOT_FIT
        raise plan_does_not_fit(plan)
    return 0


def render_report(r, command: str, reproduce: str) -> str:
    """The start-up figures, in the order the server logs them."""
    name = "vLLM" if r.server == "vllm" else "SGLang"
    fraction = r.settings.get("gpu-memory-utilization", r.settings.get("mem-fraction-static"))
    of_what = "the card" if r.server == "vllm" else "free memory at start"
    replicas = f", {r.replicas} replicas" if r.replicas > 1 else ""
    pool = (f"{r.num_blocks:,} blocks x {r.block_size} = {r.kv_cache_tokens:,} tokens" if r.num_blocks is not None
            else f"{r.kv_cache_tokens:,} tokens (max_total_num_tokens)")
    where = "in the budget" if r.server == "vllm" else "in the reserve"
    lines = [
        f"{name} ({r.version} accounting) · {r.model} on {r.gpu}, --tp {r.tp}{replicas}; per GPU:",
        f"  budget             {format_gib(r.budget_bytes):>11}  {fraction} of {of_what}",
        f"  weights            {format_gib(r.weights_bytes):>11}",
        f"  activation peak    {format_gib(r.activation_peak_bytes):>11}  {where}",
        f"  non-torch          {format_gib(r.non_torch_bytes):>11}",
        f"  KV cache           {format_gib(r.kv_cache_bytes):>11}  {pool}, {r.kv_bytes_per_token:,} B per token",
        f"  CUDA graphs        {format_gib(r.cuda_graph_bytes):>11}  modelled, outside the budget; headroom left "
        f"{format_gib(r.headroom_bytes)}",
        f"  Maximum concurrency for {r.settings.get('max-model-len', r.settings.get('context-length')):,} tokens "
        f"per request: {r.max_concurrency:.2f}x" + (f" per replica, {r.replicas} replicas" if r.replicas > 1 else ""),
    ]
    lines += [f"  note: {note}" for note in r.notes]
    return "\n".join(lines + ["", command, f"reproduce: {reproduce}"])


def render_plan(plan, reproduce: str) -> str:
    r = plan.report
    head = (f"{'Fits' if plan.fits else 'Does not fit'}: {plan.concurrency} concurrent requests of {plan.seq:,} "
            f"tokens, {r.server} on {r.tp} x {r.gpu} (weights {_formats(r.settings['quantization'])}, KV cache "
            f"{r.settings['kv-cache-dtype']}); launches tried in cost order: {plan.tried}")
    return head + "\n\n" + render_report(r, plan.command, reproduce)


def _formats(quant: str) -> str:
    return "as in the checkpoint" if quant == "none" else quant
