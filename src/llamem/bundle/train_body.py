"""The body of a launch bundle's train.py: `llamem.bundle` writes the plan's settings (`PLAN`) and
its model-loading code (`load_model`) above this text and `main(PLAN, load_model)` below it.

One process per planned GPU, started by torchrun, the DeepSpeed launcher or accelerate. Each
runs the plan's configuration on random token ids for `--max-steps` optimizer steps and prints
its loss and peak memory per step. `--cpu` runs the same processes on CPU with the gloo backend,
each counted by llamem's CpuMemoryTracker as if it were a GPU (when llamem is installed).

The strategies, as `llamem.parallel` sizes them:
- single: one GPU, no wrapper;
- ddp: torch DistributedDataParallel, autocast for mixed precision;
  with `PLAN["ep"]` > 1, the experts split first by transformers' expert-parallel plan (E / ep per rank,
  an all-to-all dispatch), DDP over the dense parts only (`llamem.expert_parallel_engines`);
- fsdp2: `fully_shard` on the embedding, each decoder layer, the head, then the root (ZeRO-3), with a
  MixedPrecisionPolicy;
- deepspeed: ZeRO-1/2/3 with optional CPU offload, from ds_config.json;
- tp: tensor parallel with torch's `parallelize_module` (Megatron-style column/row splits of attention and
  MLP, vocabulary-parallel embedding and head, the loss computed on the vocabulary shards);
- pp: pipeline stages with `torch.distributed.pipelining` (1F1B, or GPipe below as many micro-batches as
  stages), one stage per process, the accumulation steps as the pipeline's micro-batches;
- tp+pp: both, as torchtitan runs them: a ("pp", "tp") device mesh, tensor parallel over consecutive ranks
  inside each pipeline stage (the tp plan on the stage's layers, the head's logits sharded over the vocabulary
  into the pipeline's loss under `loss_parallel`), the stages on the "pp" sub-groups.

Distillation (`PLAN["teacher"]`): `load_teacher`, written above this text, builds the frozen teacher; it is
placed as planned (whole on every rank, or sharded with FSDP2's `fully_shard` on its own) beside the
wrapped student, and runs its forward under `torch.no_grad()` before the student's on the same ids. The
loss is (1 - alpha) CE + alpha T^2 KL(teacher || student), the KL at temperature T on fp32 upcasts.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from llamem.bundle.common_body import (common_parser, make_tracker, parse_checked, refuse, say,
                                       tensor_parallel_plan)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_args(plan: dict, argv: list[str] | None = None) -> argparse.Namespace:
    parser = common_parser(plan, f"Train {plan['model_name']} as planned by llamem ({plan['layout_description']}) on "
                           "random token ids.", "Run every planned GPU as a CPU process (gloo backend); each "
                           "process's memory is counted by llamem's CpuMemoryTracker.", max_steps=plan["max_steps"],
                           max_steps_help="Optimizer steps to run.")
    parser.add_argument("--memory-log", default="memory-rank{rank}.jsonl",
                        help="llamem's MemoryMonitor log per rank ({rank} is replaced), when llamem is installed.")
    parser.add_argument("--memory-trace", default=None, metavar="DIR",
                        help="With --cpu: write each rank's allocations and frees to DIR/rank{rank}.json "
                        "(llamem-trace-v1: `llamem allocator replay` gives that rank's reserved memory).")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    if plan.get("teacher"):
        parser.add_argument("--teacher-model", default=plan["teacher"]["model_id"],
                            help="The teacher's checkpoint (a Hugging Face id or a local directory).")
    args = parse_checked(parser, argv)
    if args.memory_trace is not None and not args.cpu:
        parser.error("--memory-trace records llamem's CPU tracker: add --cpu (on a GPU, "
                     "torch.cuda.memory._record_memory_history records a rank)")
    return args


# Processes -----------------------------------------------------------------------------------------
def setup_distributed(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    """(rank, world size, device) from the launcher's environment; gloo on CPU, NCCL on GPUs."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.cpu:
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    if world > 1 or "RANK" in os.environ:
        dist.init_process_group("gloo" if args.cpu else "nccl")
    return rank, world, device


def make_monitor(model, optimizer, tracker, args: argparse.Namespace, rank: int):
    """llamem's MemoryMonitor (one JSONL log per rank), or nothing when llamem has none."""
    try:
        from llamem.runtime import MemoryMonitor
    except ImportError:
        return contextlib.nullcontext(None)
    return MemoryMonitor(model, optimizer, log_path=args.memory_log.format(rank=rank), tracker=tracker)


class Meter:
    """Peak bytes on this rank per window: the tracker's on CPU, CUDA's on a GPU."""

    def __init__(self, tracker, device: torch.device) -> None:
        self.tracker, self.device = tracker, device
        self.run_peak_bytes = 0

    @property
    def measured(self) -> bool:
        """Whether this rank has figures (not on CPU without llamem)."""
        return self.tracker is not None or self.device.type == "cuda"

    def live_bytes(self) -> int:
        return self.tracker.live_bytes if self.tracker is not None else torch.cuda.memory_allocated(self.device)

    def take(self, record: dict | None = None) -> int | None:
        if self.tracker is not None:
            peak = self.tracker.take_high_water()
        elif self.device.type != "cuda":
            return None
        else:
            # A monitor resets CUDA's peak at each phase boundary: its step line has the step's peak.
            peak = record["peak_allocated_bytes"] if record else torch.cuda.max_memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        self.run_peak_bytes = max(self.run_peak_bytes, peak)
        return peak


# The model -----------------------------------------------------------------------------------------
def decoder_layers(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model.layers


def shifted_labels(ids: torch.Tensor) -> torch.Tensor:
    """Each position's next token (-100, ignored, after the last), as transformers' causal LM loss shifts them."""
    return torch.nn.functional.pad(ids, (0, 1), value=-100)[..., 1:]


class CausalLMLoss(torch.nn.Module):
    """The model and its loss as one module, so that the wrappers (DDP, FSDP2, DeepSpeed) see every
    call the loss makes, the chunked loss's calls into the decoder and the head included."""

    def __init__(self, model, loss_chunks: int, distill: tuple[float, float] | None = None) -> None:
        super().__init__()
        self.model = model
        self.loss_chunks = loss_chunks
        self.vocab_parallel = False
        """Tensor parallel: the head's output is sharded over the vocabulary (a DTensor)."""
        self.distill = distill
        """Distillation: (alpha, temperature) of the loss against the teacher's logits."""

    def vocab_parallel_loss(self, ids: torch.Tensor) -> torch.Tensor:
        """The loss on the head's vocabulary shards (torch's `loss_parallel`): no rank holds whole logits."""
        from torch.distributed.tensor.parallel import loss_parallel

        hidden = self.model.model(input_ids=ids).last_hidden_state
        logits = self.model.lm_head(hidden).float()
        with loss_parallel():
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1), shifted_labels(ids).flatten(),
                                                     ignore_index=-100)

    def distillation_loss(self, ids: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
        """(1 - alpha) CE + alpha T^2 KL(teacher || student): the forward KL at temperature T, each side's
        log_softmax made from its fp32 upcast in turn (one upcast alive at a time), as llamem sizes it."""
        alpha, temperature = self.distill
        out = self.model(input_ids=ids, labels=ids)
        ce = (1 - alpha) * out.loss
        log_p = torch.nn.functional.log_softmax(scaled(out.logits.float(), temperature), dim=-1)
        log_q = torch.nn.functional.log_softmax(scaled(teacher_logits.float(), temperature), dim=-1)
        kl = torch.nn.functional.kl_div(log_p, log_q, log_target=True, reduction="batchmean")
        return ce + alpha * temperature**2 * kl

    def forward(self, ids: torch.Tensor, teacher_logits: torch.Tensor | None = None) -> torch.Tensor:
        if teacher_logits is not None:
            return self.distillation_loss(ids, teacher_logits)
        if self.vocab_parallel:
            return self.vocab_parallel_loss(ids)
        if not self.loss_chunks:
            return self.model(input_ids=ids, labels=ids).loss
        # torchtune's CEWithChunkedOutputLoss: the head and its fp32 upcast run one chunk at a time.
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        hidden = base.model(input_ids=ids).last_hidden_state
        labels = shifted_labels(ids)
        total = 0.0
        for h_chunk, y_chunk in zip(hidden.chunk(self.loss_chunks, dim=1), labels.chunk(self.loss_chunks, dim=1)):
            logits = base.lm_head(h_chunk).float()
            total = total + torch.nn.functional.cross_entropy(logits.flatten(0, 1), y_chunk.flatten(), reduction="sum")
        return total / ids.numel()


def scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return logits if temperature == 1 else logits / temperature


def build_model(plan: dict, load_model, args: argparse.Namespace) -> CausalLMLoss:
    torch.manual_seed(0)  # every rank builds the same random weights
    model = load_model(args.random_init, args.model)
    if plan["ac_every"]:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                              every_n_layers=plan["ac_every"])
    model.train()
    if plan.get("ep", 1) > 1:
        shard_experts(model, plan["ep"], "cpu" if args.cpu else "cuda")
    teacher = plan.get("teacher")
    distill = (teacher["alpha"], teacher["temperature"]) if teacher else None
    return CausalLMLoss(model, plan["loss_chunks"] if plan["loss"] == "chunked" else 0, distill)


def build_teacher(load_teacher, args: argparse.Namespace):
    """The frozen teacher in host memory, the same random weights on every rank under --random-init."""
    torch.manual_seed(1)
    return load_teacher(args.random_init, args.teacher_model).eval().requires_grad_(False)


def refuse_teacher(plan: dict, args: argparse.Namespace) -> None:
    """Exit 1 with the reasons, before any work, where the teacher cannot be built as planned."""
    teacher = plan.get("teacher")
    problems = []
    if teacher and teacher["quantized"] and (args.cpu or args.random_init):
        problems.append("a quantized teacher needs bitsandbytes' GPU kernels and a checkpoint (it quantizes while "
                        "loading): drop --cpu and --random-init, or emit the plan with --teacher-quant none")
    if teacher and not args.random_init and not args.teacher_model:
        problems.append("the plan names no teacher checkpoint (its teacher came from a config file): pass "
                        "--teacher-model ID_OR_PATH, or --random-init to build it from teacher_config.json")
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        sys.exit(1)


def place_teacher(plan: dict, teacher, device: torch.device, world: int, tracker):
    """The teacher where the plan puts it: whole on this rank (replicated), or sharded with FSDP2's
    `fully_shard` on its own, whatever wraps the student: the embedding, each decoder layer, the final norm
    with the head, then the root, so that its forward gathers one unit at a time (in bf16, as it is stored)."""
    if plan["teacher"]["placement"] != "sharded":
        if tracker is not None:  # on CPU `.to()` keeps the loaded weights: count them as moved
            tracker.track(teacher, category="weights/teacher")
        return teacher.to(device)
    from torch.distributed.device_mesh import init_device_mesh

    shard_units(teacher, teacher.model.layers, teacher, init_device_mesh(device.type, (world,)))
    if tracker is not None:
        tracker.track(list(teacher.buffers()), category="weights/teacher")  # fully_shard moves buffers whole
    return teacher


def make_optimizer(plan: dict, params):
    name, lr = plan["optimizer"], plan["lr"]
    if name in ("adamw", "adamw-foreach", "adamw-fused", "adamw-loop"):
        kind = {"adamw-fused": {"fused": True}, "adamw-loop": {"foreach": False}}.get(name, {"foreach": True})
        return torch.optim.AdamW(params, lr=lr, **kind)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=True)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=lr, foreach=True)
    import bitsandbytes

    return bitsandbytes.optim.AdamW8bit(params, lr=lr)


# Strategies ----------------------------------------------------------------------------------------
class Run:
    """One strategy's forward, backward and optimizer step around the wrapped module."""

    def __init__(self, plan: dict, module, optimizer, device: torch.device) -> None:
        self.plan, self.module, self.optimizer, self.device = plan, module, optimizer, device
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.scaler = torch.amp.GradScaler(device.type) if plan["precision"] == "fp16-mixed" else None
        self.teacher = None
        """Distillation: the frozen teacher, placed (`place_teacher`)."""

    def teacher_logits(self, ids: torch.Tensor) -> torch.Tensor | None:
        """The teacher's logits for the student's ids, without gradients (None without a teacher)."""
        if self.teacher is None:
            return None
        with torch.no_grad():
            logits = self.teacher(input_ids=ids, use_cache=False).logits
        if hasattr(self.teacher, "reshard"):
            self.teacher.reshard()  # FSDP2 keeps a root's own parameters gathered after its forward
        return logits

    def autocast(self):
        if self.plan["mixed"]:
            return torch.autocast(self.device.type, dtype=DTYPES[self.plan["compute_dtype"]])
        return contextlib.nullcontext()

    def sync(self, last: bool):
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        loss = loss / self.plan["grad_accum"]
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self) -> None:
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        if self.plan["max_grad_norm"]:
            torch.nn.utils.clip_grad_norm_(self.params, self.plan["max_grad_norm"], foreach=True)
        if self.scaler:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


class DdpRun(Run):
    def sync(self, last: bool):
        # Gradients are all-reduced once per optimizer step, on its last micro-batch.
        return contextlib.nullcontext() if last else self.module.no_sync()


class Fsdp2Run(Run):
    def autocast(self):
        return contextlib.nullcontext()  # the MixedPrecisionPolicy casts the gathered parameters


class DeepSpeedRun(Run):
    """The engine scales the loss by the accumulation steps, clips, and steps at the boundary."""

    def autocast(self):
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.module.backward(loss)
        self.module.step()

    def step(self) -> None:
        pass


class AccelerateRun(Run):
    def __init__(self, plan, module, optimizer, device, accelerator) -> None:
        super().__init__(plan, module, optimizer, device)
        self.accelerator = accelerator

    def autocast(self):
        return contextlib.nullcontext()  # prepare() wrapped the forward in accelerate's autocast

    def sync(self, last: bool):
        return self.accelerator.accumulate(self.module)

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(loss)

    def step(self) -> None:
        if self.plan["max_grad_norm"]:
            self.accelerator.clip_grad_norm_(self.params, self.plan["max_grad_norm"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def wrap(plan: dict, module: CausalLMLoss, device: torch.device, world: int, tracker, args) -> Run:
    strategy = plan["strategy"]
    if plan.get("ep", 1) > 1:
        return wrap_expert_parallel(plan, module, device, world, tracker)
    if plan["launcher"] == "accelerate" and not args.cpu:
        return wrap_accelerate(plan, module, device)
    if strategy == "tp":
        return wrap_tensor_parallel(plan, module, device, world, tracker)
    if strategy == "pp":
        return wrap_pipeline(plan, module, device, world, tracker)
    if strategy == "tp+pp":
        return wrap_tensor_pipeline(plan, module, device, tracker)
    if strategy == "fsdp2":
        run = wrap_fsdp2(plan, module, device, world)
        if tracker is not None:
            tracker.track(list(module.buffers()), category="weights")  # fully_shard moves buffers to the GPU whole
        return run
    if tracker is not None:
        # On a GPU the loaded weights are moved to it; on CPU `.to()` keeps them: count them as moved.
        tracker.track(module)
    module = module.to(device)
    if strategy == "deepspeed":
        return wrap_deepspeed(plan, module, device, args)
    params = [p for p in module.parameters() if p.requires_grad]
    if strategy == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(module, device_ids=[device.index] if device.index is not None
                                                        else None)
        return DdpRun(plan, ddp, make_optimizer(plan, params), device)
    return Run(plan, module, make_optimizer(plan, params), device)


def shard_experts(model, ep: int, device_type: str) -> None:
    """Each rank keeps E / ep experts of every MoE layer: transformers' expert-parallel plan (`grouped_gemm` on
    the fused expert weights, `ep_dispatch_experts`: an all-to-all brings each expert its tokens). Applied before
    the tracker starts, as loading is: every rank cuts its experts from the same whole weights, which then go."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    world = dist.get_world_size()
    mesh = init_device_mesh(device_type, (world // ep, ep, 1), mesh_dim_names=("replicate", "ep", "tp"))
    names = {name for name, _ in model.named_modules()} | {name for name, _ in model.named_parameters()}
    layers = range(model.config.num_hidden_layers)
    # Parameters first (each rule for every layer), then the dispatch, which reads the local expert count.
    rules = {rule.replace("*", str(i)): style for rule, style in model.ep_plan.items() for i in layers}
    apply_expert_parallelism(model, mesh["ep"], mesh["tp"], {k: v for k, v in rules.items() if k in names})
    model.replicate_group = mesh["replicate"].get_group() if world > ep else None
    gc.collect()  # the whole expert weights the shards were cut from


class ExpertParallelRun(DdpRun):
    """DDP replicas of the dense parts; the experts' gradients (DTensor shards, which DDP ignores) already sum the
    tokens of the expert-parallel group: summed over the replicas too and divided by the ranks, they are the
    mean DDP takes of the rest."""

    def __init__(self, plan, module, optimizer, device, groups, world, replicate_group) -> None:
        super().__init__(plan, module, optimizer, device)
        self.groups, self.world, self.replicate_group = groups, world, replicate_group

    def step(self) -> None:
        for param in self.groups[0]:
            if param.grad is not None:
                local = param.grad.to_local()
                if self.replicate_group is not None:
                    dist.all_reduce(local, group=self.replicate_group)
                local.div_(self.world)
        if self.plan["max_grad_norm"]:
            clip_(self.groups, self.plan["max_grad_norm"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def wrap_expert_parallel(plan: dict, module: CausalLMLoss, device: torch.device, world: int, tracker) -> Run:
    if tracker is not None:
        tracker.track(module)  # the experts' local shards and the dense replicas, as loaded
    module = module.to(device)
    experts = [name for name, param in module.named_parameters() if hasattr(param, "to_local")]
    torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, experts)
    ddp = torch.nn.parallel.DistributedDataParallel(module, device_ids=[device.index] if device.index is not None
                                                    else None)
    groups = split_params([p for p in module.parameters() if p.requires_grad])  # the experts first
    optimizer = make_optimizer(plan, [{"params": group} for group in groups])
    return ExpertParallelRun(plan, ddp, optimizer, device, groups, world, module.model.replicate_group)


def shard_units(base, layers, root, mesh, *, policy=None, keep_head_gathered: bool = False) -> None:
    """FSDP2 units as torchtitan wraps a Llama (parallelize_llama): the embedding, each decoder layer, the final
    norm with the head, then the root. Left in the root, the embedding and head (the largest tensors) would
    stay gathered through the whole step; a tied weight cannot sit in two units, so tied ones stay there."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = policy or MixedPrecisionPolicy()  # the default policy: no casts
    separate = not base.config.tie_word_embeddings
    if separate:
        fully_shard(base.model.embed_tokens, mesh=mesh, mp_policy=policy)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    if separate:
        fully_shard([base.model.norm, base.lm_head], mesh=mesh, mp_policy=policy,
                    reshard_after_forward=not keep_head_gathered)
    fully_shard(root, mesh=mesh, mp_policy=policy)
    gc.collect()  # the unsharded weights sit in reference cycles until a collection


def wrap_fsdp2(plan: dict, module: CausalLMLoss, device: torch.device, world: int) -> Run:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mesh = init_device_mesh(device.type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[plan["compute_dtype"]], reduce_dtype=torch.float32) if (
        plan["mixed"]) else MixedPrecisionPolicy()
    base = module.model.get_base_model() if hasattr(module.model, "get_base_model") else module.model
    # the head's unit stays gathered from the end of forward into backward, which starts there
    shard_units(base, decoder_layers(module.model), module, mesh, policy=policy, keep_head_gathered=True)
    params = [p for p in module.parameters() if p.requires_grad]
    return Fsdp2Run(plan, module, make_optimizer(plan, params), device)


def wrap_deepspeed(plan: dict, module: CausalLMLoss, device: torch.device, args) -> Run:
    import deepspeed

    config = json.loads((Path(__file__).resolve().parent / "ds_config.json").read_text())
    if args.cpu:
        # DeepSpeed's fused Adam needs CUDA and its CPU Adam a C++ build; torch's AdamW keeps the same state.
        # (Other optimizers come from torch.optim, which takes no such argument.)
        if config["optimizer"]["type"] in ("Adam", "AdamW"):
            config["optimizer"]["params"]["torch_adam"] = True
        # Its CPU communication backend builds a shared-memory collective (deepspeed_shm_comm, a C++ op,
        # minutes on a fresh machine) unless the op is marked incompatible; then gloo alone carries it.
        import deepspeed.ops

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo" if args.cpu else "nccl")
    params = [p for p in module.parameters() if p.requires_grad]
    engine, optimizer, _, _ = deepspeed.initialize(model=module, model_parameters=params, config=config)
    return DeepSpeedRun(plan, engine, optimizer, device)


def wrap_accelerate(plan: dict, module: CausalLMLoss, device: torch.device) -> Run:
    from accelerate import Accelerator
    from accelerate.utils import DistributedType, DummyOptim

    accelerator = Accelerator(gradient_accumulation_steps=plan["grad_accum"], **accelerate_plugins(plan))
    params = [p for p in module.parameters() if p.requires_grad]
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        optimizer = DummyOptim(params, lr=plan["lr"])  # ds_config.json names the optimizer
    else:
        optimizer = make_optimizer(plan, params)
    module, optimizer = accelerator.prepare(module, optimizer)
    return AccelerateRun(plan, module, optimizer, accelerator.device, accelerator)


def accelerate_plugins(plan: dict) -> dict:
    """accelerate's FSDP2 under `mixed_precision: bf16` would build MixedPrecisionPolicy(param_dtype=bf16,
    reduce_dtype=bf16) (accelerate 1.15 `FullyShardedDataParallelPlugin.set_mixed_precision`); the plan's
    policy reduces the gradients in fp32, as train.py's own fully_shard does and llamem sizes. A policy
    given here is kept: accelerate sets its own only where none is."""
    if plan["strategy"] != "fsdp2" or not plan["mixed"]:
        return {}
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy

    policy = MixedPrecisionPolicy(param_dtype=DTYPES[plan["compute_dtype"]], reduce_dtype=torch.float32)
    return {"fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=2, mixed_precision_policy=policy)}


# Tensor and pipeline parallel ---------------------------------------------------------------------
def split_params(params) -> list[list]:
    """Parameters as DTensors and as plain tensors, apart: torch's foreach kernels take one kind at a time."""
    from torch.distributed.tensor import DTensor

    sharded = [p for p in params if isinstance(p, DTensor)]
    plain = [p for p in params if not isinstance(p, DTensor)]
    return [group for group in (sharded, plain) if group]


def clip_(groups: list[list], max_norm: float, process_group=None) -> None:
    """Gradient clipping by the norm over every rank's gradients: a DTensor's norm covers its shards; with
    `process_group` (pipeline stages) the stages' squared norms are summed."""
    squares = []
    for group in groups:
        norm = torch.nn.utils.get_total_norm([p.grad for p in group if p.grad is not None], foreach=True)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        squares.append(norm.float() ** 2)
    total = torch.stack(squares).sum()
    if process_group is not None:
        dist.all_reduce(total, group=process_group)
    coefficient = min(1.0, max_norm / (float(total.sqrt()) + 1e-6))
    for group in groups:
        torch._foreach_mul_([p.grad for p in group if p.grad is not None], coefficient)


class TensorParallelRun(Run):
    def __init__(self, plan, module, optimizer, device, groups) -> None:
        super().__init__(plan, module, optimizer, device)
        self.groups = groups

    def backward(self, loss: torch.Tensor) -> None:
        from torch.distributed.tensor.parallel import loss_parallel

        with loss_parallel():  # the loss's backward runs on the vocabulary shards too
            (loss / self.plan["grad_accum"]).backward()

    def step(self) -> None:
        if self.plan["max_grad_norm"]:
            clip_(self.groups, self.plan["max_grad_norm"])
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def vocab_parallel_head():
    """The lm_head's style in training: split over the vocabulary, its logits kept sharded for `loss_parallel`."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)


def shard_tensor_parallel(model, mesh, layout: dict) -> None:
    """Every rank loaded the same weights (one seed, one checkpoint): each keeps its piece, one parameter at a
    time on the GPU (src_data_rank=None: no scatter from rank 0), never the whole model."""
    from torch.distributed.tensor.parallel import parallelize_module

    parallelize_module(model, mesh, layout, src_data_rank=None)
    gc.collect()  # the whole weights the shards were cut from


def track_unsharded(tracker, module) -> None:
    """On CPU the replicated norms and the buffers stay the loaded tensors (`.to()` keeps them): count them as
    moved to the GPU; the shards were made under the tracker."""
    if tracker is not None:
        tracker.track([p for p in module.parameters() if not hasattr(p, "to_local")], list(module.buffers()),
                      category="weights")


def wrap_tensor_parallel(plan: dict, module: CausalLMLoss, device: torch.device, world: int, tracker) -> Run:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (world,))
    shard_tensor_parallel(module.model, mesh, tensor_parallel_plan(module.model.config.num_hidden_layers,
                                                                   vocab_parallel_head()))
    module.to(device)  # the rest moves whole
    module.vocab_parallel = True
    groups = split_params([p for p in module.parameters() if p.requires_grad])
    track_unsharded(tracker, module)
    optimizer = make_optimizer(plan, [{"params": group} for group in groups])
    return TensorParallelRun(plan, module, optimizer, device, groups)


class PipelineStageModule(torch.nn.Module):
    """One pipeline stage of a Llama: the embedding on the first, a run of decoder layers, the final norm
    and the head on the last; RoPE's cos and sin computed on each."""

    def __init__(self, model, start: int, stop: int, *, first: bool, last: bool, plan: dict) -> None:
        super().__init__()
        base = model.model
        self.embed_tokens = base.embed_tokens if first else None
        self.layers = torch.nn.ModuleList(base.layers[start:stop])
        self.rotary_emb = base.rotary_emb
        self.norm = base.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.mixed, self.compute_dtype = plan["mixed"], DTYPES[plan["compute_dtype"]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        autocast = torch.autocast(hidden.device.type, dtype=self.compute_dtype) if self.mixed else (
            contextlib.nullcontext())
        with autocast:
            cos_sin = self.rotary_emb(hidden, positions)
            for layer in self.layers:
                hidden = layer(hidden, attention_mask=None, position_ids=positions, position_embeddings=cos_sin)
            return hidden if self.lm_head is None else self.lm_head(self.norm(hidden))


def stage_bounds(num_layers: int, stages: int, stage: int) -> tuple[int, int]:
    """The layers of a stage: ceil(L / p) each, the last stage the rest (llamem sizes the busiest)."""
    per = -(-num_layers // stages)
    return min(stage * per, num_layers), min((stage + 1) * per, num_layers)


class PipelineRun(Run):
    """A step is one schedule run over all the micro-batches (the accumulation steps). Under tensor parallel inside
    the stages (`wrap_tensor_pipeline`): `groups` the DTensor and plain parameters apart (`split_params`),
    `stage_group` the process group of this rank's pipeline (its stages), and the schedule runs under
    `loss_parallel`, the last stage's logits being sharded over the vocabulary."""

    def __init__(self, plan, module, optimizer, device, schedule, stage: int, stages: int, *, groups=None,
                 stage_group=None) -> None:
        super().__init__(plan, module, optimizer, device)
        self.schedule, self.stage, self.stages = schedule, stage, stages
        self.vocab_parallel = groups is not None
        self.groups = groups or [self.params]
        self.stage_group = stage_group if stage_group is not None else dist.group.WORLD

    def loss_context(self):
        if not self.vocab_parallel:
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    def pipeline_step(self, generator: torch.Generator) -> float:
        plan = self.plan
        ids = torch.randint(0, plan["vocab_size"], (plan["micro_batch"] * plan["grad_accum"], plan["seq"]),
                            generator=generator).to(self.device)
        losses: list = []
        with self.loss_context():
            if self.stage == 0:
                self.schedule.step(ids)
            elif self.stage == self.stages - 1:
                self.schedule.step(target=shifted_labels(ids), losses=losses)
            else:
                self.schedule.step()
        losses = [loss.full_tensor() if hasattr(loss, "full_tensor") else loss for loss in losses]
        mean = torch.stack([loss.detach().float() for loss in losses]).mean() if losses else torch.zeros(())
        dist.broadcast(mean, src=dist.get_world_size() - 1)  # every rank prints the last stage's loss
        if plan["max_grad_norm"]:  # each stage's squared norm once (its tensor-parallel ranks agree on it)
            clip_(self.groups, plan["max_grad_norm"], process_group=self.stage_group)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float(mean)


def stage_of(plan: dict, model, stage: int, stages: int) -> PipelineStageModule:
    """Stage `stage` of `stages`: its layers (`stage_bounds`), the embedding on the first, norm and head on the last."""
    start, stop = stage_bounds(plan["num_layers"], stages, stage)
    return PipelineStageModule(model, start, stop, first=stage == 0, last=stage == stages - 1, plan=plan)


def pipeline_schedule(plan: dict, pipeline_stage, stages: int):
    """1F1B, which needs as many micro-batches as stages; below that GPipe keeps the same ones in flight."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=-100)

    one_f_one_b = plan["pipeline_schedule"] == "1f1b" and plan["grad_accum"] >= stages
    return (Schedule1F1B if one_f_one_b else ScheduleGPipe)(pipeline_stage, n_microbatches=plan["grad_accum"],
                                                           loss_fn=loss_fn)


def wrap_pipeline(plan: dict, module: CausalLMLoss, device: torch.device, world: int, tracker) -> Run:
    from torch.distributed.pipelining import PipelineStage

    stage = dist.get_rank()
    stage_module = stage_of(plan, module.model, stage, world)
    del module
    gc.collect()
    if tracker is not None:  # on a GPU the stage's weights are moved to it; on CPU `.to()` keeps them
        tracker.track(stage_module)
    stage_module.to(device)
    pipeline_stage = PipelineStage(stage_module, stage_index=stage, num_stages=world, device=device)
    optimizer = make_optimizer(plan, [p for p in stage_module.parameters() if p.requires_grad])
    return PipelineRun(plan, stage_module, optimizer, device, pipeline_schedule(plan, pipeline_stage, world), stage,
                       world)


def stage_tensor_parallel_plan(num_layers: int, start: int, stop: int, *, first: bool, last: bool) -> dict:
    """`tensor_parallel_plan` for one stage's modules: its layers, the embedding on the first stage, the
    vocabulary-parallel head on the last."""
    layers = tuple(f"model.layers.{index}." for index in range(start, stop))
    held = {"model.embed_tokens": first, "lm_head": last}
    return {name: style for name, style in tensor_parallel_plan(num_layers, vocab_parallel_head()).items()
            if held.get(name, name.startswith(layers))}


def wrap_tensor_pipeline(plan: dict, module: CausalLMLoss, device: torch.device, tracker) -> Run:
    """torchtitan's 2-D layout: a ("pp", "tp") mesh, tensor parallel over consecutive ranks (a node's GPUs, as
    llamem places them) inside each stage, the stages over the rest. Each rank shards its stage's layers (and
    the embedding or the head), then builds its stage as `wrap_pipeline` does, on the pipeline's sub-group."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage

    stages = plan["pp"]
    mesh = init_device_mesh(device.type, (stages, plan["tp"]), mesh_dim_names=("pp", "tp"))
    stage = mesh.get_local_rank("pp")
    start, stop = stage_bounds(plan["num_layers"], stages, stage)
    shard_tensor_parallel(module.model, mesh["tp"], stage_tensor_parallel_plan(
        plan["num_layers"], start, stop, first=stage == 0, last=stage == stages - 1))
    stage_module = stage_of(plan, module.model, stage, stages)
    track_unsharded(tracker, stage_module)
    stage_module.to(device)
    stage_group = mesh["pp"].get_group()
    pipeline_stage = PipelineStage(stage_module, stage_index=stage, num_stages=stages, device=device,
                                   group=stage_group)
    groups = split_params([p for p in stage_module.parameters() if p.requires_grad])
    optimizer = make_optimizer(plan, [{"params": group} for group in groups])
    return PipelineRun(plan, stage_module, optimizer, device, pipeline_schedule(plan, pipeline_stage, stages), stage,
                       stages, groups=groups, stage_group=stage_group)


# The loop ------------------------------------------------------------------------------------------
def train_step(run: Run, plan: dict, generator: torch.Generator) -> float:
    """One optimizer step over the plan's micro-batches; the mean loss."""
    if isinstance(run, PipelineRun):
        return run.pipeline_step(generator)
    accum, total = plan["grad_accum"], 0.0
    for micro in range(accum):
        ids = torch.randint(0, plan["vocab_size"], (plan["micro_batch"], plan["seq"]), generator=generator)
        ids = ids.to(run.device)
        with run.sync(micro == accum - 1):
            with run.autocast():
                teacher_logits = run.teacher_logits(ids)
                loss = run.module(ids) if teacher_logits is None else run.module(ids, teacher_logits)
                del teacher_logits  # the KL keeps what it needs of it
            run.backward(loss)
        value = loss.detach()
        total += float(value.full_tensor() if hasattr(value, "full_tensor") else value) / accum
        del loss, ids
    run.step()
    return total


def hf_model(run: Run):
    module = run.module
    for attribute in ("module", "_orig_mod"):  # DDP, DeepSpeed and accelerate keep the wrapped module here
        module = getattr(module, attribute, module)
    return getattr(module, "model", module)  # a pipeline stage is its own model


def write_trace(tracker, folder: Path, rank: int) -> None:
    """This rank's allocation events, as the tracker saw them, for the allocator simulator."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}.json"
    tracker.write_snapshot(path)
    say(f"rank {rank} trace {path}")


def main(plan: dict, load_model, argv: list[str] | None = None, load_teacher=None) -> None:
    args = parse_args(plan, argv)
    refuse(plan, args, quantized=plan["quantized"])
    refuse_teacher(plan, args)
    rank, world, device = setup_distributed(args)
    if rank == 0:
        say(f"llamem bundle: {plan['model_name']}, {plan['layout_description']}, {world} process"
            f"{'es' if world > 1 else ''} on {'CPU (gloo)' if args.cpu else 'GPUs'}; planned per GPU: "
            f"peak_allocated_bytes={plan['peak_allocated_bytes']} device_bytes={plan['device_bytes']}")
        if args.cpu and plan["launcher"] == "accelerate":
            say("note: accelerate shards nothing on CPU (it falls back to MULTI_CPU data parallel): this CPU run "
                f"applies the same layout with {plan['strategy']} directly")
    model = build_model(plan, load_model, args)  # in host memory: a GPU holds it only once wrapped
    teacher = build_teacher(load_teacher, args) if plan.get("teacher") else None
    tracker = make_tracker(args, history=args.memory_trace is not None)
    meter = Meter(tracker, device)
    with tracker if tracker is not None else contextlib.nullcontext():
        run = wrap(plan, model, device, world, tracker, args)
        del model
        if teacher is not None:
            run.teacher = place_teacher(plan, teacher, run.device, world, tracker)
            del teacher
        if tracker is not None:
            say(f"rank {rank} wrapped peak_bytes={meter.take()} live_bytes={tracker.live_bytes}")
        # Tensor-parallel ranks and pipeline stages of one replica take the same batch.
        generator = torch.Generator().manual_seed(1000 + rank // (plan["tp"] * plan["pp"]))
        optimizer = getattr(run.optimizer, "optimizer", run.optimizer)
        with make_monitor(hf_model(run), getattr(run.module, "basic_optimizer", optimizer), tracker, args,
                          rank) as monitor:
            for step in range(1, args.max_steps + 1):
                loss = train_step(run, plan, generator)
                record = monitor.step() if monitor is not None else None
                peak = meter.take(record)
                figures = f" peak_bytes={peak} live_bytes={meter.live_bytes()}" if meter.measured else ""
                say(f"rank {rank} step {step} loss={loss:.4f}{figures}")
    if meter.measured:
        say(f"rank {rank} peak_bytes={meter.run_peak_bytes}")
    if tracker is not None and args.memory_trace is not None:
        write_trace(tracker, Path(args.memory_trace), rank)
    if dist.is_initialized():
        dist.destroy_process_group()
