"""The code that applies a plan with transformers, peft and (for several GPUs) DeepSpeed.

Text only (the core stays torch-free): the plan's final configuration as the `from_pretrained`,
peft, `TrainingArguments` or `generate` settings a Hugging Face user writes. What those
libraries cannot express (the chunked loss, tensor or pipeline parallelism) is said in a
comment instead of being faked.
"""

from __future__ import annotations

from llamem.plan import Plan, split_factor
from llamem.workload import Workload

TORCH_DTYPES = {"fp32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}
OPTIMIZERS = {"adamw": "adamw_torch", "adamw8bit": "adamw_bnb_8bit", "sgd": "sgd", "adafactor": "adafactor"}
# Quantized KV caches as transformers' QuantizedCache builds them (KIVI-style for the integer ones).
KV_CACHES = {"fp8": '{"backend": "fp8"}', "int8": '{"backend": "hqq", "nbits": 8}',
             "int4": '{"backend": "quanto", "nbits": 4}'}


def plan_code(plan: Plan, model_id: str | None = None) -> str:
    """Python that loads the model and runs the plan's final configuration."""
    w = plan.final.workload
    model_id = model_id or plan.model.hf_id or plan.model.name
    lines = [f"# pip install {' '.join(_packages(plan, w))}", "import torch",
             "from transformers import AutoModelForCausalLM, AutoTokenizer"]
    if w.quant != "none":
        lines[-1] += ", BitsAndBytesConfig"
    if w.is_training:
        lines[-1] += ", TrainingArguments"
    if w.uses_adapters:
        lines.append("from peft import LoraConfig, get_peft_model" +
                     (", prepare_model_for_kbit_training" if w.task == "qlora" else ""))
    lines += ["", f'MODEL = "{model_id}"', "tokenizer = AutoTokenizer.from_pretrained(MODEL)"]
    lines += _tokenizer_lines(plan, w)
    if not w.is_training:
        return "\n".join(lines + _load_lines(w) + _generation_lines(w, plan.truncated)) + "\n"
    if plan.final.layout.sharding == "zero3":
        lines += ["# TrainingArguments first: with ZeRO-3 set, from_pretrained loads each weight into its shard.",
                  _arguments_line(plan, w)] + _load_lines(w) + _adapter_lines(w)
    else:
        lines += _load_lines(w) + _adapter_lines(w) + [_arguments_line(plan, w)]
    return "\n".join(lines + _launch_lines(plan)) + "\n"


def _packages(plan: Plan, w: Workload) -> list[str]:
    packages = ["torch", "transformers"]
    if w.uses_adapters:
        packages.append("peft")
    if w.quant != "none" or w.optimizer == "adamw8bit":
        packages.append("bitsandbytes")
    if w.kv_dtype == "int4":
        packages.append("optimum-quanto")
    elif w.kv_dtype == "int8":
        packages.append("hqq")
    if w.is_training:
        packages.append("accelerate")
    if plan.final.layout.sharding.startswith("zero"):
        packages.append("deepspeed")
    return packages


def _tokenizer_lines(plan: Plan, w: Workload) -> list[str]:
    if not plan.truncated:
        return []
    if w.task == "infer":
        return ["# Nothing fits the whole prompt: keep its last tokens.",
                'tokenizer.truncation_side = "left"',
                f"TOKENIZE = dict(truncation=True, max_length={w.seq})"]
    pieces = split_factor(plan.start.workload, w)
    return [f"# Nothing fits {plan.start.workload.seq}-token sequences: split each into {pieces} pieces of at most "
            f"{w.seq} tokens", "# (the accumulation steps below keep every token in a step).", f"MAX_LENGTH = {w.seq}"]


def _load_lines(w: Workload) -> list[str]:
    weights = "fp32" if w.weight_dtype == "fp32" else w.compute_dtype
    options = [f"dtype={TORCH_DTYPES[weights]}", f'attn_implementation="{w.attn}"']
    lines = []
    if w.quant in ("nf4", "int4"):
        kind = "nf4" if w.quant == "nf4" else "fp4"
        lines.append(f'quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="{kind}", '
                     f"bnb_4bit_compute_dtype={TORCH_DTYPES[w.compute_dtype]})")
    elif w.quant == "int8":
        lines.append("quantization = BitsAndBytesConfig(load_in_8bit=True)")
    if w.quant != "none":
        options.append("quantization_config=quantization")
    lines.append(f"model = AutoModelForCausalLM.from_pretrained(MODEL, {', '.join(options)})")
    return lines


def _adapter_lines(w: Workload) -> list[str]:
    lines = []
    if w.task == "qlora":
        # (its own checkpointing off: TrainingArguments enables it, every K layers if planned so)
        lines.append("model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)")
    if w.uses_adapters:
        targets = ", ".join(f'"{t}"' for t in w.lora_targets)
        lines.append(f'model = get_peft_model(model, LoraConfig(r={w.lora_rank}, target_modules=[{targets}], '
                     'task_type="CAUSAL_LM"))')
    if w.loss == "chunked":
        lines.append("# The chunked loss (the head and cross-entropy 8 chunks of the sequence at a time) is not a "
                     "Trainer option: torchtune's CEWithChunkedOutputLoss.")
    if w.task == "distill":
        lines.append(f"# Distillation: the frozen teacher ({w.teacher}) runs its forward, without gradients, beside "
                     "the student.")
    return lines


def _arguments_line(plan: Plan, w: Workload) -> str:
    args = ['output_dir="out"', f"per_device_train_batch_size={w.batch}",
            f"gradient_accumulation_steps={w.grad_accum}", f'optim="{OPTIMIZERS[w.optimizer]}"']
    if w.precision in ("bf16-mixed", "fp16-mixed"):
        args.append(f"{w.precision[:4]}=True")
    if w.ac_every:
        every = f', "every_n_layers": {w.ac_every}' if w.ac_every > 1 else ""
        args += ["activation_checkpointing=True",
                 'activation_checkpointing_kwargs={"use_reentrant": False' + every + "}"]
    deepspeed = _deepspeed(plan)
    if deepspeed:
        args.append(f"deepspeed={deepspeed}")
    return "args = TrainingArguments(" + ", ".join(args) + ")"


def _deepspeed(plan: Plan) -> str:
    layout = plan.final.layout
    if layout.sharding not in ("zero1", "zero2", "zero3"):
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


def _launch_lines(plan: Plan) -> list[str]:
    layout = plan.final.layout
    lines = []
    if layout.num_gpus > 1:
        per_node = min(layout.num_gpus, plan.gpu.gpus_per_node)
        nodes = -(-layout.num_gpus // per_node)
        zero = " with DeepSpeed ZeRO above" if layout.sharding.startswith("zero") else ""
        lines.append(f"# Launch on {layout.num_gpus} GPUs: torchrun --nnodes {nodes} --nproc_per_node {per_node} "
                     f"(one process per GPU; DDP{zero}).")
    if layout.tp > 1 or layout.pp > 1:
        lines.append(f"# Tensor parallel x{layout.tp}, pipeline parallel x{layout.pp} ({layout.pipeline_schedule}, "
                     f"{layout.microbatches} micro-batches): the Trainer does not split layers; the memory above "
                     "assumes a Megatron-style engine (for example torchtitan).")
    return lines


def _generation_lines(w: Workload, truncated: bool) -> list[str]:
    options = [f"max_new_tokens={w.new_tokens}"]
    if w.prefill_chunk:
        options.append(f"prefill_chunk_size={w.prefill_chunk}")
    if w.kv_dtype in KV_CACHES:
        options += ['cache_implementation="quantized"', f"cache_config={KV_CACHES[w.kv_dtype]}"]
    lines = ["tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token",
             'tokenizer.padding_side = "left"  # generation continues every prompt from its end',
             f"prompts = [...]  # {w.batch} prompt(s) of up to {w.seq} tokens",
             f'inputs = tokenizer(prompts, return_tensors="pt", padding=True{", **TOKENIZE" if truncated else ""})',
             f"outputs = model.generate(**inputs, {', '.join(options)})"]
    return lines
