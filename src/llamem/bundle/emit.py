"""`emit_bundle`: a plan's final configuration as a folder that runs it.

The layout decides the strategy (`llamem.parallel` sizes each one as these engines run it):
one GPU runs unwrapped; DDP runs torch DistributedDataParallel; ZeRO-3 without offload runs
FSDP2 `fully_shard` (its full shard is ZeRO-3), except under a LoRA base, whose ZeRO-3 figure is
DeepSpeed's; ZeRO-1/2 and every offload run DeepSpeed, whose accounting `llamem.parallel` follows.
Tensor parallel (one replica) runs torch's `parallelize_module`, pipeline parallel (one replica)
`torch.distributed.pipelining`, both together (one replica) a ("pp", "tp") device mesh with tensor parallel
inside each stage, as torchtitan does; all under torchrun. `engine` picks the launcher: torchrun, the
DeepSpeed launcher, or accelerate (which drives DDP, FSDP2 or DeepSpeed itself). Generation plans get
generate.py: one GPU, replicas, a device_map (one process; the plan's pipeline stages) or tensor
parallel.

A distillation's train.py also builds the frozen teacher (teacher_config.json under `--random-init`) and
places it as planned (`llamem.teacher_placement`): whole on every rank, or sharded with FSDP2 on its own.

What the bundle cannot run (tensor or pipeline parallelism with data parallelism, generation with
both together, distillation under model parallelism or beside DeepSpeed with a sharded teacher,
sharded quantized bases, 8-bit AdamW on shards, settings train.py does not apply) is still written
by `emit_bundle`, with the reason in README.md and a launch.sh that prints it and exits 1: never a
script that runs something else. `llamem plan --emit` never gets there: its search keeps
only what `bundle_runs` accepts, and `emit_plan` refuses the rest before writing.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from llamem.bundle.accelerate import accelerate_config, to_yaml
from llamem.bundle.deepspeed import LEARNING_RATE, OPTIMIZERS, ds_config
from llamem.bundle.launch import Processes, launch_script
from llamem.bundle.layouts import describe, device_map
from llamem.bundle.readme import readme
from llamem.bundle.script import generate_script, train_script
from llamem.bundle.slurm import slurm_script
from llamem.errors import LlamemError, UsageError
from llamem.expert_parallel_engines import EP_MODEL_TYPES, EXPERT_PARALLEL_ENGINES, runs_transformers_ep
from llamem.gpus import GPU
from llamem.model import HF_CLASSES, ModelSpec, load_model
from llamem.parallel import Layout
from llamem.plan import Plan, Space, command, confirm, evaluate
from llamem.teacher_placement import placement
from llamem.workload import LOSS_CHUNKS, Workload

ENGINES = ("any", "torchrun", "deepspeed", "accelerate")
MAX_STEPS = 20
"""Optimizer steps train.py runs unless told `--max-steps`."""
_ZERO = ("zero1", "zero2", "zero3")
BUNDLE_FILES = frozenset({"train.py", "generate.py", "launch.sh", "config.json", "teacher_config.json", "ds_config.json",
                          "accelerate.yaml", "README.md"})
DISTILL_ALPHA = 0.5
"""The KL term's weight in train.py's distillation loss, (1 - alpha) CE + alpha T^2 KL, as llamem traces it."""
DISTILL_TEMPERATURE = 1.0
"""The KL's temperature T in train.py (PLAN["teacher"]["temperature"]; any other T holds the same memory: each
scaled logit copy replaces its upcast)."""


@dataclass(frozen=True, kw_only=True)
class Bundle:
    directory: Path
    strategy: str
    """single | ddp | fsdp2 | deepspeed: what train.py wraps the model with."""
    launcher: str
    """torchrun | deepspeed | accelerate: what launch.sh starts."""
    files: tuple[str, ...]
    unsupported: str | None = None
    """Why launch.sh refuses to run this plan (None: it runs it)."""


def emit_bundle(plan: Plan, directory: str | os.PathLike, *, engine: str = "any",
                model_id: str | None = None) -> Bundle:
    """Write the bundle of `plan.final` into `directory` (created if needed; its files replaced).
    `model_id` is the checkpoint train.py loads (default: the model's Hugging Face id)."""
    if engine not in ENGINES:
        raise LlamemError(f"engine {engine!r} is not one of: {', '.join(ENGINES)}")
    folder = _folder(directory)
    w, layout = plan.final.workload, plan.final.layout
    strategy, launcher = choose(layout, engine, adapters=w.uses_adapters, generation=not w.is_training)
    unsupported = unsupported_reason(w, layout, strategy, plan.model)
    processes = _processes(plan)
    title = f"{plan.model.name}: {describe(layout, strategy)} on {plan.num_gpus} x {plan.gpu.name}, planned by llamem"
    if w.is_training:
        script = "train.py"
        files = {script: train_script(w, train_settings(plan, strategy, launcher, unsupported, model_id), title)}
    else:
        script = "generate.py"
        files = {script: generate_script(w, generate_settings(plan, strategy, launcher, unsupported, model_id), title)}
    files |= {"launch.sh": launch_script(launcher=launcher, processes=processes, title=title, unsupported=unsupported,
                                         script=script),
             "slurm.sbatch": slurm_script(launcher=launcher, processes=processes, title=title),
             "config.json": json.dumps(hf_config_dict(plan.model), indent=2) + "\n"}
    if w.task == "distill":
        files["teacher_config.json"] = json.dumps(hf_config_dict(load_model(w.teacher)), indent=2) + "\n"
    if strategy == "deepspeed" and not unsupported:
        files["ds_config.json"] = json.dumps(ds_config(w, layout, plan.model.hidden_size), indent=2) + "\n"
    if launcher == "accelerate" and not unsupported:
        files["accelerate.yaml"] = to_yaml(accelerate_config(w, layout, strategy, nodes=processes.nodes,
                                                             model_type=plan.model.model_type))
    files["README.md"] = readme(plan, strategy=strategy, launcher=launcher, processes=processes,
                                unsupported=unsupported, files=sorted(files))
    for name in BUNDLE_FILES.difference(files):
        (folder / name).unlink(missing_ok=True)  # an earlier bundle's config would mislead the reader
    for name, text in files.items():
        (folder / name).write_text(text)
    (folder / "launch.sh").chmod(0o755)
    return Bundle(directory=folder, strategy=strategy, launcher=launcher, files=tuple(sorted(files)),
                  unsupported=unsupported)


PLAN_ENGINES = {"any": "any", "fsdp2": "torchrun", "deepspeed": "deepspeed", "accelerate": "accelerate",
                "trainer": "accelerate"}
"""`llamem plan --engine` -> the bundle's engine. The Trainer runs on accelerate: its bundle is accelerate's."""


def bundle_runs(engine: str = "any") -> Callable[[ModelSpec, Workload, Layout], bool]:
    """The search's filter under `llamem plan --emit --engine ENGINE`: whether the bundle written for a
    configuration runs it (`make_plan(runnable=...)`), so that the plan never picks one it refuses."""
    if engine == "megatron":
        raise UsageError("--emit writes launch bundles and --engine megatron prints Megatron-LM arguments only: "
                         "drop --emit, or choose another --engine")
    bundle_engine = PLAN_ENGINES[engine]

    def runs(spec: ModelSpec, w: Workload, layout: Layout) -> bool:
        try:
            strategy, _launcher = choose(layout, bundle_engine, adapters=w.uses_adapters,
                                         generation=not w.is_training)
        except LlamemError:
            return False
        return unsupported_reason(w, layout, strategy, spec) is None

    return runs


@dataclass(frozen=True, kw_only=True)
class Emitted:
    """What `llamem plan --emit DIR` wrote: the line it prints, and the `bundle` entry of its JSON."""

    line: str
    data: dict | None
    """directory, files, strategy, launcher and the launch command; None where nothing was written."""


def emit_plan(plan: Plan, directory: str | os.PathLike, engine: str = "any") -> Emitted:
    """`llamem plan --emit DIR`: the bundle of a plan that fits. `engine` is the plan's `--engine`
    (`PLAN_ENGINES`). A configuration the bundle would refuse is an error before anything is written
    (the CLI's search, filtered by `bundle_runs`, picks none)."""
    if not plan.fits:
        return Emitted(line=f"no bundle written to {shown_path(directory)}: the plan does not fit", data=None)
    bundle_runs(engine)  # Megatron-LM gets arguments, not a bundle
    layout = plan.final.layout
    strategy, _launcher = choose(layout, PLAN_ENGINES[engine], adapters=plan.final.workload.uses_adapters,
                                generation=not plan.final.workload.is_training)
    reason = unsupported_reason(plan.final.workload, layout, strategy, plan.model)
    if reason:
        raise LlamemError(f"no bundle written to {shown_path(directory)}: the plan's configuration "
                          f"({layout.describe()}) has no launch bundle: {reason}")
    bundle = emit_bundle(plan, directory, engine=PLAN_ENGINES[engine])
    launch = f"bash {shown_path(bundle.directory / 'launch.sh')}"
    data = {"directory": str(bundle.directory), "files": list(bundle.files), "strategy": bundle.strategy,
            "launcher": bundle.launcher, "launch": launch, "rehearsal": f"{launch} --cpu --random-init --max-steps 2"}
    line = (f"bundle: {shown_path(bundle.directory)}/ ({', '.join(bundle.files)}); {launch} (--cpu --random-init "
            "--max-steps 2 rehearses it on CPU)")
    return Emitted(line=line, data=data)


def emit_for_cli(plan: Plan, directory: str | os.PathLike, engine: str = "any") -> str:
    """`emit_plan`'s line."""
    return emit_plan(plan, directory, engine).line


MARKER = ".llamem-bundle"
"""Written in every bundle folder: a folder holding it may be written again; any other non-empty
folder is refused, so `--emit` never overwrites files it did not write (or fills `/`)."""


def _folder(directory: str | os.PathLike) -> Path:
    if not str(directory):
        raise UsageError("--emit needs a folder name, e.g. --emit bundle")
    folder = Path(directory)
    if "\0" in str(folder):
        raise LlamemError(f"--emit {str(folder)!r}: a path cannot hold a NUL character")
    try:
        return _usable_folder(folder)
    except OSError as err:  # a name too long for the file system, a loop of links, ...
        raise LlamemError(f"--emit {shown_path(folder)}: {err.strerror or err}; choose another folder") from None


def _usable_folder(folder: Path) -> Path:
    if folder.exists() and not folder.is_dir():
        raise LlamemError(f"--emit {shown_path(folder)}: is a file; give a folder (it is created if needed)")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / MARKER).exists():
        raise LlamemError(f"--emit {shown_path(folder)}: the folder holds files llamem did not write; give a new or "
                          "empty folder (a folder an earlier --emit wrote may be written again)")
    folder.mkdir(parents=True, exist_ok=True)
    if not os.access(folder, os.W_OK | os.X_OK):
        raise LlamemError(f"--emit {shown_path(folder)}: cannot write in it as this user; choose another folder")
    (folder / MARKER).write_text("written by llamem plan --emit; llamem may replace the files of this folder\n")
    return folder


def shown_path(path) -> str:
    """A path as a shell reads it back: quoted, and escaped where it holds control characters."""
    text = str(path)
    return shlex.quote(text) if text.isprintable() else ascii(text)


def choose(layout: Layout, engine: str, *, adapters: bool = False, generation: bool = False) -> tuple[str, str]:
    """(strategy, launcher) for a layout and the engine asked for; `adapters`: the model trains LoRA adapters;
    `generation`: the plan generates (generate.py: torchrun, or one python process for a device_map)."""
    if generation:
        if layout.tp > 1 and layout.pp > 1:
            return "tp+pp", "torchrun"
        if layout.pp > 1:
            return "device_map", "python"
        return ("tp" if layout.tp > 1 else "replicas" if layout.dp > 1 else "single"), "torchrun"
    if layout.tp > 1 or layout.pp > 1:
        if engine not in ("any", "torchrun"):
            raise LlamemError(f"the plan's layout ({layout.describe()}) runs with torchrun (torch's tensor parallel "
                              "and pipelining): emit with engine 'torchrun' or 'any'")
        return ("tp" if layout.pp == 1 else "pp" if layout.tp == 1 else "tp+pp"), "torchrun"
    needs_deepspeed = layout.sharding in ("zero1", "zero2") or layout.offload != "none"
    native = {"none": "single", "ddp": "ddp", "zero3": "fsdp2"}.get(layout.sharding, "deepspeed")
    if native == "fsdp2" and layout.engine == "deepspeed" and engine == "any" and adapters:
        native = "deepspeed"  # ZeRO-3 of a LoRA base is sized by DeepSpeed's accounting: run it there
    if engine == "torchrun" and needs_deepspeed:
        raise LlamemError(f"the plan's layout ({layout.describe()}) runs with DeepSpeed: FSDP2 has no ZeRO-1/2 and "
                          "its CPU offload moves parameters too; emit with engine 'deepspeed' or 'accelerate'")
    if engine == "deepspeed" and layout.sharding not in _ZERO:
        raise LlamemError(f"the plan's layout ({layout.describe()}) has no ZeRO stage for DeepSpeed to run: emit with "
                          "engine 'torchrun' or 'accelerate'")
    strategy = "deepspeed" if needs_deepspeed or engine == "deepspeed" else native
    launcher = {"any": "deepspeed" if strategy == "deepspeed" else "torchrun"}.get(engine, engine)
    return strategy, launcher


def unsupported_reason(w: Workload, layout: Layout, strategy: str, spec: ModelSpec | None = None) -> str | None:
    """Why the bundle cannot run this configuration as planned, or None."""
    if layout.ep > 1 and (reason := expert_parallel_reason(w, layout, strategy, spec)):
        return reason
    unrun = unrun_settings(w)
    if unrun:
        return f"train.py does not apply {unrun}: plan without it"
    if not w.is_training:
        return generation_reason(w, layout, strategy, spec)
    if strategy in ("tp", "pp", "tp+pp"):
        return model_parallel_reason(w, layout, strategy, spec)
    if w.task == "distill" and strategy == "deepspeed" and placement(w, layout.sharding) == "sharded":
        return ("a sharded teacher beside DeepSpeed's engine is not emitted (train.py keeps the teacher outside the "
                "engine): plan with --teacher-placement replicated, or with FSDP2 (--engine fsdp2)")
    if w.quant != "none" and layout.sharding in _ZERO:
        return (f"a {w.quant} base under {layout.sharding} is not emitted yet (bitsandbytes weights in ZeRO / FSDP "
                "shards): choose --gpus so the plan uses DDP, or one GPU")
    if strategy == "deepspeed" and w.optimizer not in OPTIMIZERS:
        return f"DeepSpeed cannot build {w.optimizer} from its config: plan with --exact, or without ZeRO"
    if strategy == "fsdp2" and w.uses_adapters:
        return ("LoRA under FSDP2 is not sized by llamem (its ZeRO-3 figure of a LoRA base is DeepSpeed's): emit with "
                "engine 'deepspeed', or choose --gpus so the plan uses DDP")
    if strategy == "fsdp2" and w.optimizer in ("adamw8bit", "adafactor"):
        # torch's Adafactor fails on DTensor gradients ("in-place operations that require placement changes");
        # torch's fused AdamW steps FSDP2 and tensor-parallel shards (checked on 2 gloo ranks, torch 2.13).
        return f"{w.optimizer} on FSDP2 shards (DTensors) is not emitted yet: plan with --exact, or with DDP"
    return None


def expert_parallel_reason(w: Workload, layout: Layout, strategy: str, spec: ModelSpec | None) -> str | None:
    """What the expert-parallel bundle does not run (`llamem.expert_parallel_engines`), each with the change to
    make; None for the replicas of a Mixtral or Qwen3-MoE trained whole, with AdamW or SGD, unquantized."""
    instead = "plan without --ep (the layouts the bundles run are searched with --emit)"
    if strategy != "ddp" or not runs_transformers_ep(w, layout):
        return (f"expert parallelism under {layout.sharding} with --task {w.task} is not emitted. "
                f"{EXPERT_PARALLEL_ENGINES} Use --sharding ddp and --task train, or {instead}")
    if spec is not None and spec.model_type not in EP_MODEL_TYPES:
        return (f"{spec.model_type} has no expert-parallel plan in transformers 5.24 that train.py applies (it does "
                f"for {' and '.join(EP_MODEL_TYPES)}): {instead}")
    if w.quant != "none" or w.optimizer not in ("adamw", "adamw-foreach", "adamw-fused", "adamw-loop", "sgd"):
        return f"expert-parallel bundles run AdamW or SGD on unquantized weights (here {w.optimizer}): {instead}"
    if w.loss != "full" or w.ac_every:
        return ("expert-parallel bundles compute the loss in one piece, without activation checkpointing (the "
                f"dispatch's recomputation is not sized): {instead}")
    return None


def unrun_settings(w: Workload) -> str:
    """The workload's settings train.py does not apply (its figures would not be the plan's), or ""."""
    settings = {"torch.compile (--compile)": w.compile, "Liger's fused loss (--liger)": w.liger,
                "the optimizer step in backward": w.optimizer_in_backward,
                f"{w.ac_mode} activation checkpointing": w.ac_every and w.ac_mode != "full",
                "activation offloading (--offload-activations)": w.offload_activations,
                "padded batches (--padding longest)": w.padding != "none",
                "packed rows (--padding-free)": w.padding_free,
                f"attention {w.attn} (--attn)": w.attn != "sdpa"}
    return ", ".join(name for name, used in settings.items() if used)


DEVICE_MAP_GPUS = 8
"""A device_map is one process driving its node's GPUs: at most 8 (a DGX node)."""


def generation_reason(w: Workload, layout: Layout, strategy: str, spec: ModelSpec | None) -> str | None:
    """What the generation bundles do not run (yet), each with the change to make."""
    instead = "choose --gpus so the plan uses one of device_map (layers split), tensor parallel or replicas"
    if strategy == "tp+pp" or (strategy in ("tp", "device_map") and layout.dp > 1):
        return f"generation bundles split the model one way per replica, not {layout.describe()}: {instead}"
    if w.quant != "none":
        return (f"a {w.quant} base is not emitted in generation bundles yet (bitsandbytes places it while loading): "
                "plan with --exact, or use the code of `llamem plan --code`")
    if strategy == "tp" and spec is not None and spec.num_kv_heads % layout.tp:
        return (f"tensor parallel {layout.tp} over {spec.num_kv_heads} KV heads replicates them, which the bundle "
                f"does not: {instead}")
    if strategy == "device_map" and layout.pp > DEVICE_MAP_GPUS:
        return f"a device_map is one process on one node, at most {DEVICE_MAP_GPUS} GPUs: {instead}"
    if w.kv_dtype in ("fp8", "int8", "int4"):
        return f"a {w.kv_dtype} KV cache is not emitted yet (it needs a quantized cache backend): {instead}"
    return None


MODEL_PARALLEL = {"tp": "tensor parallel", "pp": "pipeline parallel", "tp+pp": "tensor and pipeline parallel"}


def model_parallel_reason(w: Workload, layout: Layout, strategy: str, spec: ModelSpec | None) -> str | None:
    """What the tensor- and pipeline-parallel bundles do not run (yet), each with the change to make."""
    name, instead = MODEL_PARALLEL[strategy], "choose --gpus so the plan uses data parallel / ZeRO"
    if layout.dp > 1 or layout.sharding not in ("none", "ddp") or layout.offload != "none":
        return f"{name} bundles run one replica, without data parallel, ZeRO or offload: {instead}"
    if not w.is_training or w.task != "train":
        return f"{name} bundles train the whole model (--task train), not --task {w.task}: {instead}"
    if w.quant != "none" or w.optimizer not in ("adamw", "adamw-foreach", "adamw-fused", "adamw-loop", "sgd") or (
            w.precision == "fp16-mixed"):
        return (f"{name} bundles run AdamW or SGD in fp32, bf16-mixed or bf16, unquantized (here: {w.optimizer}, "
                f"{w.precision}{', ' + w.quant if w.quant != 'none' else ''}): {instead}")
    if w.loss != "full":
        return f"{name} bundles compute the loss in one piece, not chunked: {instead}"
    if strategy in ("tp", "tp+pp") and spec is not None and spec.num_kv_heads % layout.tp:
        return (f"tensor parallel {layout.tp} over {spec.num_kv_heads} KV heads replicates them, which the bundle "
                f"does not: {instead}, or a degree dividing {spec.num_kv_heads}")
    return None


def _processes(plan: Plan) -> Processes:
    num_gpus = plan.final.layout.num_gpus
    per_node = min(num_gpus, plan.gpu.gpus_per_node)
    return Processes(num_gpus=num_gpus, per_node=per_node, nodes=-(-num_gpus // per_node))


def train_settings(plan: Plan, strategy: str, launcher: str, unsupported: str | None, model_id: str | None) -> dict:
    """What train.py needs of the plan (its PLAN dict)."""
    w, layout = plan.final.workload, plan.final.layout
    return {"model_name": plan.model.name, "model_id": model_id or plan.model.hf_id, "strategy": strategy,
            "launcher": launcher, "layout_description": layout.describe(), "num_gpus": layout.num_gpus,
            "tp": layout.tp, "pp": layout.pp, "ep": layout.ep, "pipeline_schedule": layout.pipeline_schedule,
            "num_layers": plan.model.num_layers,
            "unsupported": unsupported, "task": w.task, "micro_batch": w.batch, "grad_accum": w.grad_accum,
            "seq": w.seq, "vocab_size": plan.model.vocab_size, "precision": w.precision, "mixed": w.mixed,
            "compute_dtype": w.compute_dtype, "quantized": w.quant != "none", "optimizer": w.optimizer,
            "lr": LEARNING_RATE, "max_grad_norm": w.max_grad_norm, "ac_every": w.ac_every, "loss": w.loss,
            "loss_chunks": LOSS_CHUNKS, "max_steps": MAX_STEPS, "peak_allocated_bytes": plan.final.allocated_bytes,
            "device_bytes": plan.final.device_bytes, "command": plan.command,
            **({"teacher": teacher_settings(w, layout)} if w.task == "distill" else {})}


def teacher_settings(w: Workload, layout: Layout) -> dict:
    """What train.py needs of a distillation's teacher (PLAN["teacher"])."""
    return {"name": w.teacher, "model_id": load_model(w.teacher).hf_id, "placement": placement(w, layout.sharding),
            "quantized": w.teacher_quant != "none", "alpha": DISTILL_ALPHA, "temperature": DISTILL_TEMPERATURE}


def generate_settings(plan: Plan, strategy: str, launcher: str, unsupported: str | None,
                      model_id: str | None) -> dict:
    """What generate.py needs of the plan (its PLAN dict)."""
    w, layout = plan.final.workload, plan.final.layout
    return {"model_name": plan.model.name, "model_id": model_id or plan.model.hf_id, "strategy": strategy,
            "launcher": launcher, "layout_description": describe(layout, strategy), "num_gpus": layout.num_gpus,
            "unsupported": unsupported, "batch": w.batch, "seq": w.seq, "new_tokens": w.new_tokens,
            "vocab_size": plan.model.vocab_size,
            "device_map": device_map(plan.model.num_layers, layout.pp) if strategy == "device_map" else None,
            "peak_allocated_bytes": plan.final.allocated_bytes, "device_bytes": plan.final.device_bytes,
            "command": plan.command}


def hf_config_dict(spec: ModelSpec) -> dict:
    """The model's config.json, which `--random-init` builds the model from."""
    config = {k: v for k, v in spec.config.items() if k not in ("torch_dtype", "dtype")}
    architecture = HF_CLASSES[spec.model_type][1]
    config.setdefault("architectures", [architecture])
    return config


def layout_plan(spec: ModelSpec, w: Workload, layout: Layout, gpu: GPU, *, model_args: tuple[str, ...] = ()) -> Plan:
    """A plan that runs exactly this configuration (what `llamem estimate` sizes), for a bundle of a
    layout chosen by hand rather than by the planner."""
    space = Space(spec=spec, gpu=gpu, host_budget_bytes=2**62, model_args=model_args)
    if layout.pp > 1:
        layout = dataclasses.replace(layout, microbatches=w.grad_accum)
    candidate = confirm(space, evaluate(space, w, layout))
    return Plan(model=spec, gpu=gpu, num_gpus=layout.num_gpus, fits=candidate.device_bytes <= gpu.memory_bytes,
                start=candidate, final=candidate, steps=(), command=command(space, w, layout),
                host_budget_bytes=space.host_budget_bytes)
