"""`emit_bundle`: a plan's final configuration as a folder that runs it.

The layout decides the strategy (`llamem.parallel` sizes each one as these engines run it):
one GPU runs unwrapped; DDP runs torch DistributedDataParallel; ZeRO-3 without offload runs
FSDP2 `fully_shard` (its full shard is ZeRO-3); ZeRO-1/2 and every offload run DeepSpeed, whose
accounting `llamem.parallel` follows. `engine` picks the launcher: torchrun, the DeepSpeed
launcher, or accelerate (which drives DDP, FSDP2 or DeepSpeed itself).

What the bundle cannot run (tensor or pipeline parallelism, generation, distillation, sharded
quantized bases, 8-bit AdamW on shards) is still written, with the reason in README.md and a
launch.sh that prints it and exits 1: never a script that runs something else.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
from dataclasses import dataclass
from pathlib import Path

from llamem.bundle.accelerate import accelerate_config, to_yaml
from llamem.bundle.deepspeed import LEARNING_RATE, MAX_GRAD_NORM, OPTIMIZERS, ds_config
from llamem.bundle.launch import Processes, launch_script
from llamem.bundle.readme import readme
from llamem.bundle.script import train_script
from llamem.bundle.slurm import slurm_script
from llamem.errors import LlamemError, UsageError
from llamem.gpus import GPU
from llamem.model import ModelSpec
from llamem.parallel import Layout
from llamem.plan import Plan, Space, command, confirm, evaluate
from llamem.workload import LOSS_CHUNKS, Workload

ENGINES = ("any", "torchrun", "deepspeed", "accelerate")
MAX_STEPS = 20
"""Optimizer steps train.py runs unless told `--max-steps`."""
_ZERO = ("zero1", "zero2", "zero3")
BUNDLE_FILES = frozenset({"train.py", "launch.sh", "config.json", "ds_config.json", "accelerate.yaml", "README.md"})


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
    strategy, launcher = choose(layout, engine)
    unsupported = unsupported_reason(w, layout, strategy)
    processes = _processes(plan)
    settings = train_settings(plan, strategy, launcher, unsupported, model_id)
    title = f"{plan.model.name}: {layout.describe()} on {plan.num_gpus} x {plan.gpu.name}, planned by llamem"
    files = {"train.py": train_script(w, settings, title),
             "launch.sh": launch_script(launcher=launcher, processes=processes, title=title, unsupported=unsupported),
             "slurm.sbatch": slurm_script(launcher=launcher, processes=processes, title=title),
             "config.json": json.dumps(hf_config_dict(plan.model), indent=2) + "\n"}
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


def emit_for_cli(plan: Plan, directory: str | os.PathLike, engine: str = "any") -> str:
    """`llamem plan --emit DIR`: the bundle of a plan that fits, and the line that says what was written.
    `engine` is the plan's `--engine` (`PLAN_ENGINES`); Megatron-LM gets arguments, not a bundle."""
    if not plan.fits:
        return f"no bundle written to {directory}: the plan does not fit"
    if engine == "megatron":
        return (f"no bundle written to {directory}: llamem emits Megatron-LM arguments only (above), "
                "not a launch bundle")
    bundle = emit_bundle(plan, directory, engine=PLAN_ENGINES[engine])
    line = f"bundle: {shown_path(bundle.directory)}/ ({', '.join(bundle.files)}); "
    if bundle.unsupported:
        return line + f"launch.sh refuses to run it: {bundle.unsupported}"
    return line + f"bash {shown_path(bundle.directory / 'launch.sh')} (--cpu --random-init --max-steps 2 rehearses it on CPU)"


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


def choose(layout: Layout, engine: str) -> tuple[str, str]:
    """(strategy, launcher) for a layout and the engine asked for."""
    needs_deepspeed = layout.sharding in ("zero1", "zero2") or layout.offload != "none"
    native = {"none": "single", "ddp": "ddp", "zero3": "fsdp2"}.get(layout.sharding, "deepspeed")
    if engine == "torchrun" and needs_deepspeed:
        raise LlamemError(f"the plan's layout ({layout.describe()}) runs with DeepSpeed: FSDP2 has no ZeRO-1/2 and "
                          "its CPU offload moves parameters too; emit with engine 'deepspeed' or 'accelerate'")
    if engine == "deepspeed" and layout.sharding not in _ZERO:
        raise LlamemError(f"the plan's layout ({layout.describe()}) has no ZeRO stage for DeepSpeed to run: emit with "
                          "engine 'torchrun' or 'accelerate'")
    strategy = "deepspeed" if needs_deepspeed or engine == "deepspeed" else native
    launcher = {"any": "deepspeed" if strategy == "deepspeed" else "torchrun"}.get(engine, engine)
    return strategy, launcher


def unsupported_reason(w: Workload, layout: Layout, strategy: str) -> str | None:
    """Why the bundle cannot run this configuration as planned, or None."""
    if layout.tp > 1:
        return "tensor parallel bundles are not emitted yet: choose --gpus so the plan uses data parallel / ZeRO"
    if layout.pp > 1:
        return "pipeline parallel bundles are not emitted yet: choose --gpus so the plan uses data parallel / ZeRO"
    if not w.is_training:
        return "bundles run training plans: generation needs no launcher (use the code of `llamem plan --code`)"
    if w.task == "distill":
        return "distillation bundles are not emitted yet: train.py has no teacher forward"
    if w.quant != "none" and layout.sharding in _ZERO:
        return (f"a {w.quant} base under {layout.sharding} is not emitted yet (bitsandbytes weights in ZeRO / FSDP "
                "shards): choose --gpus so the plan uses DDP, or one GPU")
    if strategy == "deepspeed" and w.optimizer not in OPTIMIZERS:
        return f"DeepSpeed cannot build {w.optimizer} from its config: plan with --exact, or without ZeRO"
    if strategy == "fsdp2" and w.optimizer in ("adamw8bit", "adafactor"):
        # torch's Adafactor fails on DTensor gradients ("in-place operations that require placement changes").
        return f"{w.optimizer} on FSDP2 shards (DTensors) is not emitted yet: plan with --exact, or with DDP"
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
            "unsupported": unsupported, "task": w.task, "micro_batch": w.batch, "grad_accum": w.grad_accum,
            "seq": w.seq, "vocab_size": plan.model.vocab_size, "precision": w.precision, "mixed": w.mixed,
            "compute_dtype": w.compute_dtype, "quantized": w.quant != "none", "optimizer": w.optimizer,
            "lr": LEARNING_RATE, "max_grad_norm": MAX_GRAD_NORM, "ac_every": w.ac_every, "loss": w.loss,
            "loss_chunks": LOSS_CHUNKS, "max_steps": MAX_STEPS, "peak_allocated_bytes": plan.final.allocated_bytes,
            "device_bytes": plan.final.device_bytes, "command": plan.command}


def hf_config_dict(spec: ModelSpec) -> dict:
    """The model's config.json, which `--random-init` builds the model from."""
    config = {k: v for k, v in spec.config.items() if k not in ("torch_dtype", "dtype")}
    architecture = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}[spec.model_type]
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
