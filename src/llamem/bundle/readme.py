"""README.md of a bundle: the plan's figures, then how to launch it on one node, several, and CPU."""

from __future__ import annotations

from llamem.bundle.launch import Processes
from llamem.bundle.layouts import describe
from llamem.engine_precision import precision_note
from llamem.expert_parallel_engines import EXPERT_PARALLEL_ENGINES
from llamem.parallel import fsdp2_problems, per_gpu_phases, with_engine
from llamem.plan import Plan
from llamem.reporters.plan_report import render_plan
from llamem.teacher_placement import placement, placement_note
from llamem.units import format_bytes, format_gib

STRATEGY_TEXT = {
    "single": "one process on one GPU, no wrapper",
    "ddp": "torch DistributedDataParallel, one replica per GPU",
    "fsdp2": "FSDP2: `fully_shard` on the embedding, every decoder layer, the head, then the root (ZeRO-3)",
    "deepspeed": "DeepSpeed ZeRO from ds_config.json",
    "tp": "tensor parallel: torch's `parallelize_module` with Megatron-style splits of attention and MLP, the "
          "embedding and head split over the vocabulary, the loss computed on the shards (`loss_parallel`)",
    "pp": "pipeline parallel: `torch.distributed.pipelining`, one stage per process, the accumulation steps as "
          "the pipeline's micro-batches",
    "tp+pp": "tensor parallel inside pipeline stages, as torchtitan runs them: a (\"pp\", \"tp\") device mesh, "
             "each stage's layers split Megatron-style over consecutive ranks (one node's GPUs), the embedding and "
             "head over the vocabulary, the loss computed on the head's shards (`loss_parallel`); the stages run by "
             "`torch.distributed.pipelining` over the mesh's \"pp\" groups, the accumulation steps as the "
             "pipeline's micro-batches",
}
AGREEMENT = {
    "single": "llamem sizes one GPU as `llamem trace` runs it: on CPU a tiny Llama's peak was the estimate's to the "
              "byte.",
    "ddp": "llamem sizes DDP as it runs (torch autocast, DDP's gradient buckets): on 2 CPU ranks of a tiny Llama "
           "each rank's peak was the estimate's within 0.1 %.",
    "fsdp2": "llamem sizes ZeRO-3 with DeepSpeed's accounting, which FSDP2 does not follow: it keeps no 16-bit "
             "gradient partition, but gathers each unit's 16-bit weights and gradients and reduce-scatters the "
             "gradients in fp32 (about 10 bytes per parameter of the unit at work, where the estimate allows 4 per "
             "parameter of the largest layer). On 2 CPU ranks of a tiny Llama the peak was 18 % below the estimate, "
             "and 4.5 % above it with 2 accumulation steps.",
    "fsdp2-sized": "llamem sizes FSDP2 as it runs with `--engine fsdp2`: the shards (fp32 under bf16-mixed: the "
                   "master weights) with the optimizer's state on them, the sharded gradients (fp32 under bf16-mixed), "
                   "the unit at work gathered in bf16 with its gradients, the next unit's all-gather and the last "
                   "reduce-scatter input. One rank of a tiny Llama, run on CPU under torch's "
                   "fake process group (collectives that allocate nothing, as NCCL's work in FSDP2's own buffers), "
                   "peaked 0.7 to 1.4 % below it, with 2 accumulation steps and in pure bf16 too. Over gloo a rank "
                   "can hold one reduce-scatter input more (4 bytes per parameter of a layer): gloo reduce-scatters "
                   "a copy of its input, which NCCL does not; there the tiny Llama's ranks peaked from 1 % below to "
                   "8 % above the estimate.",
    "deepspeed": "llamem follows DeepSpeed's accounting: on 2 CPU ranks of a tiny Llama ZeRO-2's peak was the "
                 "estimate's within 0.3 %, ZeRO-1 held what ZeRO-2 holds (6 % below the estimate, which keeps "
                 "ZeRO-1's 16-bit gradients whole) and ZeRO-3 was 8 % above it. On CPU offloaded state stays in the "
                 "same process: the CPU figures of an offloading plan count host and device together.",
    "tp": "llamem sizes tensor parallelism Megatron-style (heads, KV heads, MLP width and vocabulary split, norms "
          "and the residual stream whole), as this bundle runs it, with the whole-vocabulary embedding gradient "
          "DTensor computes on every rank. On 2 CPU ranks of a tiny Llama each rank held exactly its shards once "
          "wrapped and peaked within 1 % of the estimate, in the optimizer step.",
    "pp": "llamem sizes each stage as it runs and reports the busiest: its share of the layers (ceil or "
          "floor of L/p), the embedding on the first stage, the final norm, head and loss on the last, "
          "min(p - s, M) micro-batches in flight on stage s under 1F1B (every one under GPipe), each with its "
          "own autocast weight copies, one receive buffer per micro-batch for the input (every stage but the "
          "first) and for the output's gradient (every stage but the last), and the last stage's outputs and "
          "losses kept until the next step. On 2 CPU stages of a tiny Llama with 2 micro-batches each stage "
          "held exactly its layers and peaked within 0.2 % of its own figure over two steps.",
    "tp+pp": "llamem sizes each pipeline stage as the pipeline bundle's (its layers, the embedding on the first, the "
             "final norm, head and loss on the last, its micro-batches in flight and receive buffers), each on its "
             "tensor-parallel shard, and reports the busiest. On 4 CPU ranks of a tiny Llama (tp 2 x pp 2, 4 layers, "
             "2 micro-batches) each rank held exactly its stage's shards once wrapped; the first stage peaked 0.7 % "
             "above its figure, the last 0.08 % above it, in the loss's backward: llamem sizes the loss as torch's "
             "`loss_parallel` runs it, three fp32 tokens x vocabulary/tp tensors beside the saved log-softmax in its "
             "fused backward (the CPU run counts them inside DTensor's handlers, as a GPU holds them).",
}
"""How a rank's measured peak compares with the plan's allocated figure, per strategy (measured on CPU);
"fsdp2-sized": with the figure of `--engine fsdp2`, for the FSDP2 bundles that accounting sizes."""
FILE_TEXT = {
    "train.py": "the training loop: the plan's settings (`PLAN`), the model as `llamem plan --code` loads it, "
                "the strategy, random token ids",
    "generate.py": "generation: the plan's settings (`PLAN`), the model and `generate` options as `llamem plan "
                   "--code` writes them, the placement on the GPUs, random prompts",
    "launch.sh": "starts one process per GPU",
    "slurm.sbatch": "runs launch.sh on every node of a Slurm job (`sbatch slurm.sbatch`)",
    "config.json": "the model's config, which `--random-init` builds it from",
    "teacher_config.json": "the distillation teacher's config, which `--random-init` builds it from",
    "ds_config.json": "DeepSpeed's config: ZeRO stage, offload, precision, batch, clipping, optimizer",
    "accelerate.yaml": "accelerate's config (`accelerate launch --config_file accelerate.yaml`)",
    "README.md": "this file",
}


def readme(plan: Plan, *, strategy: str, launcher: str, processes: Processes, unsupported: str | None,
           files: list[str]) -> str:
    final = plan.final
    lines = [f"# {plan.model.name}: {describe(final.layout, strategy)} on {plan.num_gpus} x {plan.gpu.name}", "",
             "A launch bundle written by `llamem plan --emit`.", ""]
    if unsupported:
        lines += [f"**This bundle does not run the plan: {unsupported}.** `launch.sh` prints this and exits 1.", ""]
    lines += ["## The plan", "", "```text", render_plan(plan), "```", "",
              f"Per GPU: **{format_gib(final.device_bytes)}** of device memory ({final.device_bytes:,} bytes; "
              f"{final.allocated_bytes:,} bytes allocated by PyTorch at the peak), the figures of", "",
              f"    {plan.command}", ""]
    texts = {**FILE_TEXT, **({"launch.sh": "starts generate.py: one process for all the GPUs"} if launcher == "python"
                             else {})}
    lines += ["## Files", "", *(f"- `{name}`: {texts[name]}" for name in files), ""]
    if unsupported:
        pass
    elif plan.final.workload.is_training:
        lines += _launch_section(plan, strategy, launcher, processes) + _run_section(plan, strategy)
        lines += expert_parallel_section(plan) if plan.final.layout.ep > 1 else []
        lines += distill_section(plan) if plan.final.workload.task == "distill" else []
    else:
        lines += generation_section(plan, strategy, processes)
    return "\n".join(lines)


def _launch_section(plan: Plan, strategy: str, launcher: str, processes: Processes) -> list[str]:
    figure, command, agreement = plan.final.allocated_bytes, plan.command, strategy
    fsdp2 = fsdp2_allocated_bytes(plan) if strategy == "fsdp2" else None
    if fsdp2 is not None:
        # A plan made with --engine fsdp2 says so already; one made with `any` is re-sized here.
        sized = plan.command if "--engine fsdp2" in plan.command else f"{plan.command} --engine fsdp2"
        figure, command, agreement = fsdp2, sized, "fsdp2-sized"
    several = ("NNODES=2 NODE_RANK=0 MASTER_ADDR=<node 0's address> MASTER_PORT=29500 bash launch.sh   "
               "# on node 0; NODE_RANK=1 on node 1, ...")
    lines = ["## Launch", "", f"With {launcher} ({STRATEGY_TEXT[strategy]}), {processes.per_node} process"
             f"{'es' if processes.per_node > 1 else ''} per node, one per GPU.", "",
             f"One node{' (the plan needs ' + str(processes.nodes) + ': set NNODES)' if processes.nodes > 1 else ''}:",
             "", "    bash launch.sh                     # loads the checkpoint; --max-steps K (default 20)", "",
             f"Several nodes of {processes.per_node} GPUs each, the same command on every node:", "",
             f"    {several}", ""]
    if launcher == "deepspeed":
        lines += ["Across nodes the DeepSpeed launcher also needs `HOSTFILE`: a file with one line per node, "
                  f"`hostname slots={processes.per_node}`.", ""]
    lines += _slurm_lines(launcher, processes)
    if plan.final.layout.offload != "none":
        lines += ["With optimizer offload DeepSpeed steps the optimizer on the host with its CPU Adam, a C++ op it "
                  "compiles on first use (a compiler and ninja are needed; `DS_BUILD_CPU_ADAM=1 pip install "
                  "deepspeed` builds it ahead). Host memory for offload, as planned: "
                  f"{format_bytes(plan.final.host_bytes)} per node.", ""]
    lines += ["On CPU, without a GPU (a rehearsal of the same processes):", "",
              "    bash launch.sh --cpu --random-init --max-steps 2", "",
              f"starts {processes.num_gpus} CPU processes with the gloo backend. Each counts its memory with "
              "llamem's CpuMemoryTracker, as the GPU of its rank would hold it, and prints "
              "`rank R step S loss=L peak_bytes=N` per step and `rank R peak_bytes=N` at the end; "
              f"compare with `peak_allocated_bytes` of `{command} --json` ({figure:,}). "
              "The CPU run has no caching allocator: the device figure above adds its fragmentation and CUDA's "
              "context.", "", AGREEMENT[agreement], ""]
    if launcher == "accelerate":
        lines += ["accelerate shards nothing on CPU (it falls back to MULTI_CPU data parallel), so `--cpu` runs "
                  f"the same layout with {strategy} directly, under torchrun.", ""]
    return lines


def expert_parallel_section(plan: Plan) -> list[str]:
    """Which engine runs the plan's expert parallelism, which do not, and how its figure was checked."""
    ep = plan.final.layout.ep
    return ["## Expert parallelism", "", f"Each GPU holds {plan.model.num_experts // ep} of the "
            f"{plan.model.num_experts} experts of every MoE layer (expert parallel {ep}). {EXPERT_PARALLEL_ENGINES}",
            "", "llamem sizes the run as train.py holds it (`llamem.expert_parallel_engines`): DDP's buckets keep "
            "the dense gradients only, the optimizer steps the experts and the dense weights as two groups, and the "
            "dispatch keeps the received and re-ordered rows of each MoE layer for backward, with balanced routing "
            "(the busiest rank of an unbalanced batch holds more). On 2 CPU ranks of a tiny Mixtral (4 experts, "
            "2 per rank) each rank held exactly its 2 experts and the dense replica once wrapped and peaked 0.7 % "
            "below the estimate, in the optimizer step; with 8 x 128 tokens a step, where the activations "
            "dominate, the two ranks peaked 1.6 % above and below it, as the router sent them more or fewer "
            "tokens.", ""]


def _slurm_lines(launcher: str, processes: Processes) -> list[str]:
    hostfile = " and writes the DeepSpeed `HOSTFILE` from the job's nodes" if launcher == "deepspeed" else ""
    return [f"On Slurm, from this folder: `sbatch slurm.sbatch` asks for {processes.nodes} node"
            f"{'s' if processes.nodes > 1 else ''} of {processes.per_node} GPU{'s' if processes.per_node > 1 else ''} "
            "and runs `launch.sh` once on each (`srun`, one task per node). It sets NNODES from SLURM_NNODES, "
            "MASTER_ADDR to the first host of `scontrol show hostnames`, NODE_RANK from SLURM_NODEID"
            f"{hostfile}; arguments after `slurm.sbatch` go to train.py.", ""]


def fsdp2_allocated_bytes(plan: Plan) -> int | None:
    """The per-GPU peak of the plan's configuration as FSDP2 runs it (`llamem estimate --engine fsdp2`),
    or None where that accounting sizes nothing (the planner sizes ZeRO-3 as DeepSpeed runs it)."""
    w, layout = plan.final.workload, plan.final.layout
    if fsdp2_problems(w, tp=layout.tp, pp=layout.pp, sharding=layout.sharding, offload=layout.offload):
        return None
    # A distillation's teacher is loaded by its name (`per_gpu_phases`).
    return max(sum(b.values()) for b in per_gpu_phases(plan.model, w, with_engine(layout, "fsdp2")).values())


def _run_section(plan: Plan, strategy: str) -> list[str]:
    w = plan.final.workload
    # A ZeRO-3 layout the bundle runs with fully_shard holds FSDP2's precision, whoever sized it.
    runs = with_engine(plan.final.layout, "fsdp2") if strategy == "fsdp2" else plan.final.layout
    weight_bytes = plan.model.num_params * (4 if w.weight_dtype == "fp32" else 2)
    return ["## What train.py runs", "",
            f"- {w.batch} sequence{'s' if w.batch > 1 else ''} of {w.seq} random token ids per micro-batch, "
            f"{w.grad_accum} micro-batch{'es' if w.grad_accum > 1 else ''} per optimizer step on each of "
            f"{plan.final.layout.dp} data-parallel replica{'s' if plan.final.layout.dp > 1 else ''}: put your data "
            "loader in `train_step`.",
            f"- {w.precision}, {w.optimizer}, activation checkpointing {w.ac_label}, {w.loss} loss, gradient "
            "clipping at 1.0.",
            f"- {_sentence(precision_note(w, runs))}",
            f"- Every process loads the whole checkpoint into host memory before it is moved or sharded: about "
            f"{format_bytes(weight_bytes)} of host memory per process.",
            "- With llamem installed each rank also writes llamem's MemoryMonitor log, `memory-rank{R}.jsonl` "
            "(`--memory-log`).",
            "- `--cpu --memory-trace DIR` writes each rank's allocations and frees to `DIR/rank{R}.json`; "
            "`llamem allocator replay DIR/rank{R}.json` replays them through the caching-allocator simulator: "
            "that rank's reserved memory from its own schedule.",
            ""]


def distill_section(plan: Plan) -> list[str]:
    """Where the teacher is, what train.py computes with it, and what a CPU rehearsal cannot build."""
    w, layout = plan.final.workload, plan.final.layout
    sharded = placement(w, layout.sharding) == "sharded" and layout.dp > 1
    how = ("`place_teacher` wraps its embedding, each decoder layer, the final norm with the head, then the root, "
           "whatever wraps the student; each rank keeps a bf16 shard of every weight" if sharded else
           "Each rank holds it beside the student, outside its wrapper (no gradients, no optimizer state)")
    lines = ["## Distillation", "",
             f"- Teacher: {placement_note(w, layout)}. {_sentence(how)}",
             "- Each micro-batch runs the teacher's forward under `torch.no_grad()` on the student's ids, then the "
             "student's; the loss is `(1 - alpha) * CE + alpha * T**2 * KL(teacher || student)`, the forward KL at "
             "temperature T on fp32 upcasts of both logits (`PLAN['teacher']`: alpha 0.5, T 1.0; another T holds "
             "the same memory).",
             f"- Per GPU, as planned: {format_bytes(plan.final.allocated_bytes)} allocated at the peak "
             f"({plan.final.allocated_bytes:,} bytes), {format_gib(plan.final.device_bytes)} of device memory, the "
             "teacher included."]
    if w.teacher_quant != "none":
        lines.append(f"- The {w.teacher_quant} teacher is quantized by bitsandbytes while its checkpoint loads, on a "
                     "GPU: `--cpu --random-init` cannot build it (train.py refuses). Rehearse on CPU with a bundle "
                     "emitted with `--teacher-quant none`.")
    else:
        lines.append("- A quantized teacher (`--teacher-quant`) could not run on CPU: bitsandbytes quantizes while "
                     "loading a checkpoint, on a GPU. This plan's teacher is bf16, so `--cpu --random-init` builds it "
                     "from `teacher_config.json`.")
    return lines + ["- `--teacher-model ID_OR_PATH` loads another teacher checkpoint (same vocabulary).", ""]


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:] + "."


GENERATION_TEXT = {
    "single": "one process on one GPU",
    "replicas": "one process per GPU (torchrun), each generating its share of the prompts with a whole copy of "
                "the model",
    "device_map": "one process (`python generate.py`) that places the decoder layers on the GPUs in runs, as "
                  "transformers' `device_map` does",
    "tp": "tensor parallel under torchrun (torch's `parallelize_module`: attention and MLP split Megatron-style, "
          "the embedding and the head over the vocabulary, the last token's logits gathered for sampling)",
}
THROUGHPUT_TEXT = {
    "single": "",
    "replicas": "Each GPU generates on its own: throughput grows with the GPUs, each needing the whole model.",
    "device_map": "The GPUs work one after another: each token passes GPU 0, then GPU 1, and so on, so one GPU is "
                  "busy at a time and a token takes as long as on one GPU that held the whole model (plus the "
                  "hand-offs). The split buys memory, not speed; tensor parallelism (`--tp`) makes every GPU work on "
                  "every token, where the heads divide.",
    "tp": "Every GPU works on every token (each reads its share of the weights and KV cache per decoded token), at "
          "the cost of two all-reduces per layer per token: faster than a device_map's GPUs, which work one after "
          "another. transformers' `tp_plan=\"auto\"` runs the same splits for attention and MLP but keeps the "
          "embedding whole on every GPU (vocabulary x hidden size more per GPU than llamem sizes); this bundle "
          "splits it as sized.",
}


def generation_section(plan: Plan, strategy: str, processes: Processes) -> list[str]:
    """Launch, placement, throughput and the CPU rehearsal of a generation bundle."""
    w = plan.final.workload
    lines = ["## Launch", "", f"{GENERATION_TEXT[strategy][0].upper()}{GENERATION_TEXT[strategy][1:]}.", "",
             "    bash launch.sh                     # loads the checkpoint and generates from random prompts", ""]
    if strategy == "device_map":
        lines += ["Placement (`PLAN['device_map']` in generate.py): " + _placement(plan.model.num_layers,
                                                                               plan.final.layout.pp), ""]
    elif processes.nodes > 1:
        lines += [f"The plan needs {processes.nodes} nodes: NNODES, NODE_RANK, MASTER_ADDR and MASTER_PORT as in "
                  "`launch.sh`'s header, or `sbatch slurm.sbatch`.", ""]
    lines += [THROUGHPUT_TEXT[strategy], ""] if THROUGHPUT_TEXT[strategy] else []
    lines += ["On CPU, without a GPU (a rehearsal of the same processes):", "",
              "    bash launch.sh --cpu --random-init", "",
              f"generates {w.new_tokens} tokens after {w.batch} random prompt{'s' if w.batch > 1 else ''} of {w.seq} "
              "tokens and prints `rank R step S new_tokens=N last=T peak_bytes=B` (llamem's CpuMemoryTracker) and "
              "the run's `rank R peak_bytes=B`; compare with `peak_allocated_bytes` of "
              f"`{plan.command} --json` ({plan.final.allocated_bytes:,}).", "", GENERATION_AGREEMENT[strategy], ""]
    return lines


def _placement(num_layers: int, gpus: int) -> str:
    per = -(-num_layers // gpus)
    parts = []
    for gpu in range(gpus):
        first, last = gpu * per, min((gpu + 1) * per, num_layers) - 1
        run = f"layer {first}" if first == last else f"layers {first}-{last}"
        held = (["the embedding"] if gpu == 0 else []) + ([run] if first <= last else [])
        held += ["the final norm and the head"] if gpu == gpus - 1 else []
        parts.append(f"GPU {gpu}: {', '.join(held)}")
    return "; ".join(parts) + "."


GENERATION_AGREEMENT = {
    "single": "llamem sizes one GPU's generation as `llamem trace` runs it.",
    "replicas": "Each replica is one GPU's generation at its share of the batch.",
    "device_map": "llamem sizes the busiest GPU of a layer split as holding ceil(L/p) layers with their KV cache "
                  "and both the embedding and the head (an upper bound: the first GPU has no head, the last no "
                  "embedding). The CPU rehearsal holds every GPU of the map in one process and prints each GPU's "
                  "weights; its peak is one GPU's generation (`llamem estimate` without `--gpus`): for a tiny Llama "
                  "0.9 % above it.",
    "tp": "llamem sizes tensor-parallel generation with the heads, KV heads, MLP width and vocabulary split, as this "
          "bundle runs it: on 2 CPU ranks of a tiny Llama each rank peaked 1.8 % above the estimate.",
}
