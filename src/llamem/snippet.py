"""The code that applies a plan with transformers, peft and (for several GPUs) DeepSpeed, or Megatron-LM's launch.

Text only (the core stays torch-free): the plan's final configuration as the `from_pretrained`,
peft, `TrainingArguments` or `generate` settings a Hugging Face user writes. Each setting's part
comes from its record in `llamem.techniques`; this module puts the parts in order and adds what
belongs to the whole plan (shortened sequences, DeepSpeed, the launch line). What those
libraries cannot express (the chunked loss, tensor or pipeline parallelism) is said in a comment
instead of being faked.
"""

from __future__ import annotations

from llamem.model import HF_CLASSES
from llamem.plan import Plan, split_factor
from llamem.techniques import Code, workload_code


def plan_code(plan: Plan, model_id: str | None = None) -> str:
    """Python that loads the model and runs the plan's final configuration (under `--engine megatron`, the
    Megatron-LM launch line instead)."""
    if plan.megatron_args:
        return _megatron_launch(plan)
    w = plan.final.workload
    code = workload_code(w)
    _add_truncation(plan, code)
    deepspeed = _deepspeed(plan)
    if deepspeed:
        code.training_args.append(f"deepspeed={deepspeed}")
        code.packages.append("deepspeed")
    code.training_args += _fsdp2(plan)
    model_id = model_id or plan.model.hf_id or plan.model.name
    lines = [f"# pip install {' '.join(code.packages)}", "import torch",
             "from transformers import " + ", ".join(["AutoModelForCausalLM", "AutoTokenizer", *code.imports])]
    if w.uses_adapters:
        lines.append("from peft import LoraConfig, get_peft_model" +
                     (", prepare_model_for_kbit_training" if w.task == "qlora" else ""))
    lines += ["", f'MODEL = "{model_id}"', "tokenizer = AutoTokenizer.from_pretrained(MODEL)", *code.tokenizer]
    load = code.before_load + [f"model = AutoModelForCausalLM.from_pretrained(MODEL, {', '.join(code.load_options)})"]
    if not w.is_training:
        return "\n".join(lines + load + _generation_lines(w, code)) + "\n"
    arguments = "args = TrainingArguments(" + ", ".join(['output_dir="out"', *_ordered(code.training_args)]) + ")"
    if deepspeed and plan.final.layout.sharding == "zero3":
        lines += ["# TrainingArguments first: with ZeRO-3 set, from_pretrained loads each weight into its shard.",
                  arguments] + load + code.after_load + code.comments
    else:
        lines += load + code.after_load + code.comments + [arguments]
    return "\n".join(lines + _launch_lines(plan)) + "\n"


def _ordered(arguments: list[str]) -> list[str]:
    """Batch and accumulation first, as people write TrainingArguments."""
    first = [a for a in arguments if a.startswith(("per_device_train_batch_size", "gradient_accumulation_steps"))]
    return first + [a for a in arguments if a not in first]


def _add_truncation(plan: Plan, code: Code) -> None:
    if not plan.truncated:
        return
    w = plan.final.workload
    if w.task == "infer":
        code.tokenizer += ["# Nothing fits the whole prompt: keep its last tokens.", 'tokenizer.truncation_side = "left"',
                           f"TOKENIZE = dict(truncation=True, max_length={w.seq})"]
        code.tokenize_options = ", **TOKENIZE"
        return
    pieces = split_factor(plan.start.workload, w)
    code.tokenizer += [f"# Nothing fits {plan.start.workload.seq}-token sequences: split each into {pieces} pieces "
                       f"of at most {w.seq} tokens", "# (the accumulation steps below keep every token in a step).",
                       f"MAX_LENGTH = {w.seq}"]


def _fsdp2(plan: Plan) -> list[str]:
    """The Trainer's FSDP2 settings for a layout sized as FSDP2 runs it: `fully_shard` per decoder layer
    (transformers' `fsdp_config`, version 2), bf16 or fp16 compute from the precision's own argument."""
    layout = plan.final.layout
    if layout.engine != "fsdp2" or layout.sharding != "zero3":
        return []
    decoder = HF_CLASSES[plan.model.model_type][2]
    return ["fsdp=True", 'fsdp_config={"version": 2, "reshard_after_forward": True, '
            f'"transformer_layer_cls_to_wrap": ["{decoder}"]}}']


def _deepspeed(plan: Plan) -> str:
    layout = plan.final.layout
    if layout.sharding not in ("zero1", "zero2", "zero3") or layout.engine == "fsdp2":
        return ""
    zero = [f'"stage": {layout.sharding[-1]}']
    if layout.offload != "none":
        zero.append('"offload_optimizer": {"device": "cpu"}')
    if layout.offload == "optimizer+params":
        zero.append('"offload_param": {"device": "cpu"}')
    precision = plan.final.workload.precision
    dtype = '"bf16": {"enabled": True}, ' if precision.startswith("bf16") else (
        '"fp16": {"enabled": True}, ' if precision.startswith("fp16") else "")
    return ("{" + dtype + '"zero_optimization": {' + ", ".join(zero) + "}, "
            '"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto"}')


def _nodes(plan: Plan) -> tuple[int, int]:
    """(nodes, processes per node) of the plan's GPUs."""
    per_node = min(plan.final.layout.num_gpus, plan.gpu.gpus_per_node)
    return -(-plan.final.layout.num_gpus // per_node), per_node


def _megatron_launch(plan: Plan) -> str:
    """Megatron-LM's launch of the plan: its arguments, the model's architecture left to the user."""
    nodes, per_node = _nodes(plan)
    lines = ["# Megatron-LM runs this plan: from a Megatron-LM checkout, add your model's architecture, tokenizer and",
             "# data arguments (its examples/llama show them for Llama); several nodes also need --node-rank and",
             "# --master-addr.",
             f"torchrun --nnodes {nodes} --nproc-per-node {per_node} pretrain_gpt.py \\"]
    lines += [f"    {argument} \\" for argument in plan.megatron_args[:-1]] + [f"    {plan.megatron_args[-1]}"]
    return "\n".join(lines) + "\n"


def _launch_lines(plan: Plan) -> list[str]:
    layout = plan.final.layout
    lines = []
    if layout.num_gpus > 1:
        nodes, per_node = _nodes(plan)
        wrapper = ("FSDP2 with the fsdp_config above" if layout.engine == "fsdp2" else
                   f"DeepSpeed ZeRO-{layout.sharding[-1]} above" if layout.sharding.startswith("zero") else "DDP")
        if layout.tp > 1 or layout.pp > 1:
            wrapper = "a model-parallel layout, below"
        lines.append(f"# Launch on {layout.num_gpus} GPUs: torchrun --nnodes {nodes} --nproc_per_node {per_node} "
                     f"(one process per GPU; {wrapper}).")
    if layout.tp > 1 or layout.pp > 1:
        lines += _model_parallel_lines(plan)
    return lines


def _model_parallel_lines(plan: Plan) -> list[str]:
    """Tensor or pipeline parallelism: what the Trainer cannot run as sized, and what runs it."""
    from llamem.bundle.emit import bundle_runs  # text only, as this module

    layout, w = plan.final.layout, plan.final.workload
    parts = [f"tensor parallel x{layout.tp}"] if layout.tp > 1 else []
    if layout.pp > 1:
        parts.append(f"pipeline parallel x{layout.pp} ({layout.pipeline_schedule}, {layout.microbatches} "
                     "micro-batches)")
    lines = [f"# {' and '.join(parts).capitalize()}: this Trainer code does not run the layout as sized (the Trainer "
             "splits no layers between", "# pipeline stages, and transformers' tp_plan keeps the embedding and the "
             "logits whole on every GPU)."]
    if bundle_runs("any")(plan.model, w, layout):
        lines.append("# Add --emit DIR to this plan command: it writes a torchrun bundle that runs it (DTensor's tensor "
                     "parallel, torch.distributed.pipelining).")
    else:
        lines.append("# Megatron-LM runs it (--engine megatron prints its arguments), or plan with --engine trainer for "
                     "a layout this code runs.")
    return lines


def _generation_lines(w, code: Code) -> list[str]:
    return ["tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token",
            'tokenizer.padding_side = "left"  # generation continues every prompt from its end',
            f"prompts = [...]  # {w.batch} prompt(s) of up to {w.seq} tokens",
            f'inputs = tokenizer(prompts, return_tensors="pt", padding=True{code.tokenize_options})',
            f"outputs = model.generate(**inputs, {', '.join(code.generate_options)})"]
