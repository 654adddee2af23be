"""One record per setting and per memory technique: the single place a technique is described.

A `Record` owns one group of `Workload` fields and says, for that group: its command-line
options, the tasks it applies to (from `llamem.workload.FIELD_TASKS`), how it renders as the
arguments of a reproduce command, as a label in a report's header, as a change in a plan's
ladder, and as transformers / peft code. Technique records (those the planner searches) also
carry their tier (0 keeps the numerics, 1 changes them, 2 is the last resort of shorter
sequences), the extra step time the cost model does not see, the reason shown in the ladder,
and the variants the planner tries.

The planner's ladder, `llamem estimate`'s reproduce command, the report header and the code
snippet are all derived from `RECORDS`; adding a technique means adding its record here, its
Workload field (`llamem/workload.py`), its formula (`llamem/analytic/`) and its tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from llamem.analytic.moe_lora import lora_linear_targets, peft_target_parameters
from llamem.workload import FIELD_TASKS, LORA_TARGETS_DEFAULT, Workload

CHUNKED_LOSS_COST = 0.02
"""torchtune's chunked loss runs the head per chunk: assumed 2 % slower (no measurement yet)."""
CHUNKED_PREFILL_COST = 0.02
"""Chunked prefill runs smaller matmuls and masked attention: assumed 2 % slower (no measurement yet)."""
COMPILE_TIME_FACTOR = 0.85
"""An assumption, not a measurement: a compiled training step takes 0.85 of the eager step's time (15 %
faster, from inductor's fused pointwise kernels). torchtitan's and torchtune's published Llama runs
report throughput gains of this order with `torch.compile`; the real gain depends on the model, the
shape and the card, and the first steps' compilation time is not counted."""
AC_CHOICES = ((0, "full"), (4, "selective"), (2, "selective"), (4, "full"), (1, "selective"), (2, "full"),
              (1, "full"))
"""(every K layers, mode) the planner tries, least recompute first (`ac_settings`)."""
PREFILL_CHUNKS = (0, 8192, 2048, 512)
"""Prefill chunk sizes the planner tries; 512 is the smallest: below it the matmuls stop filling a GPU."""
TORCH_DTYPES = {"fp32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}
TRAINER_OPTIMIZERS = {"adamw": "adamw_torch", "adamw-fused": "adamw_torch_fused", "adamw-loop": "adamw_torch",
                      "adamw8bit": "adamw_bnb_8bit", "sgd": "sgd", "adafactor": "adafactor"}
"""The Trainer's `optim` for each `--optimizer` (its adamw_torch runs torch's foreach step on a GPU; the
for-loop step is not a Trainer choice: the snippet says how to pass one)."""
LIGER_LOSS_COST = 0.0
"""An assumption, not a measurement: Liger's fused linear cross-entropy is taken as fast as the plain
head and loss (Liger reports it faster; llamem has not timed it)."""
OPTIMIZER_IN_BACKWARD_COST = 0.02
"""An assumption, not a measurement: stepping one parameter at a time inside backward (a small
kernel launch per tensor, no multi-tensor batching) is taken as 2 % slower per step."""
TEACHER_GATHER_COST = 0.02
"""An assumption, not a measurement: a sharded teacher's weights are all-gathered a layer at a time in each
of its forwards (FSDP2 prefetches the next layer while one computes), taken as 2 % of the step's time."""
KV_CACHE_CONFIGS = {"fp8": '{"backend": "fp8"}', "int8": '{"backend": "hqq", "nbits": 8}',
                    "int4": '{"backend": "quanto", "nbits": 4}'}
"""Quantized KV caches as transformers' QuantizedCache builds them (KIVI-style for the integer ones)."""


@dataclass
class Code:
    """The parts of a transformers / peft script that records fill in; `llamem.snippet` assembles them."""

    packages: list[str] = field(default_factory=lambda: ["torch", "transformers"])
    imports: list[str] = field(default_factory=list)
    load_options: list[str] = field(default_factory=list)
    before_load: list[str] = field(default_factory=list)
    after_load: list[str] = field(default_factory=list)
    tokenizer: list[str] = field(default_factory=list)
    training_args: list[str] = field(default_factory=list)
    generate_options: list[str] = field(default_factory=list)
    comments: list[str] = field(default_factory=list)
    tokenize_options: str = ""


@dataclass(frozen=True)
class Variant:
    """One value the planner tries for a technique, its tier, and how many numerics-changing
    techniques it holds (a combination counts each of its parts)."""

    changes: dict
    tier: int
    numerics: int = -1

    def __post_init__(self) -> None:
        if self.numerics < 0:
            object.__setattr__(self, "numerics", int(self.tier >= 1 and bool(self.changes)))


@dataclass(frozen=True)
class SearchContext:
    """What the variants of a technique may depend on besides the workload."""

    bf16: bool = True
    fp8: bool = True
    num_layers: int = 1
    compile_sized: bool = True
    """Whether the analytic engine sizes `--compile` for this model type (`analytic.compiled`)."""


@dataclass(frozen=True, kw_only=True)
class Option:
    """A command-line option that sets one Workload field."""

    flag: str
    field: str
    help: str
    type: type = str


@dataclass(frozen=True, kw_only=True)
class Record:
    name: str
    fields: tuple[str, ...]
    options: tuple[Option, ...] = ()
    args: Callable[[Workload], list[str]] = lambda w: []
    label: Callable[[Workload], str | None] = lambda w: None
    code: Callable[[Workload, Code], None] = lambda w, code: None
    # Techniques the planner searches (title set):
    title: str = ""
    reason: str = ""
    change: Callable[[Workload], str] | None = None
    variants: Callable[[Workload, SearchContext], list[Variant]] = lambda w, ctx: []
    time_factor: Callable[[Workload], float] = lambda w: 1.0
    why: Callable[[Workload, Workload], str] | None = None
    """The reason for one particular change, where `reason` is not specific enough."""

    @property
    def tasks(self) -> tuple[str, ...]:
        return FIELD_TASKS[self.fields[0]]

    @property
    def is_technique(self) -> bool:
        return bool(self.title)

    def explain(self, before: Workload, after: Workload) -> str:
        return self.why(before, after) if self.why is not None else self.reason

    def describe_change(self, w: Workload) -> str:
        if self.change is not None:
            return self.change(w)
        return " ".join(f"{f.replace('_', ' ')} {getattr(w, f)}" for f in self.fields)


# Rendering helpers ----------------------------------------------------------------------------
def _flag(flag: str, value) -> list[str]:
    return [flag, str(value)]


def _if(condition: bool, *parts: str) -> list[str]:
    return list(parts) if condition else []


def _precision_code(w: Workload, code: Code) -> None:
    weights = "fp32" if w.weight_dtype == "fp32" else w.compute_dtype
    code.load_options.append(f"dtype={TORCH_DTYPES[weights]}")
    if w.mixed:
        code.training_args.append(f"{w.compute_dtype}=True")


def _precision_variants(w: Workload, ctx: SearchContext) -> list[Variant]:
    half = "bf16" if ctx.bf16 else "fp16"
    if not ctx.bf16 and w.compute_dtype == "bf16":
        # The card cannot compute in bf16: fp16 is not a choice but the card's 16-bit format.
        forced = w.precision.replace("bf16", "fp16")
        out = [Variant({"precision": forced}, 0)]
        return out + ([Variant({"precision": "fp16"}, 1)] if w.mixed and w.task in ("train", "distill") else [])
    out = [Variant({}, 0)]
    if w.mixed and w.task in ("train", "distill"):
        out.append(Variant({"precision": half}, 1))
    return out


def _quant_code(w: Workload, code: Code) -> None:
    if w.quant == "none":
        return
    code.imports.append("BitsAndBytesConfig")
    code.packages.append("bitsandbytes")
    if w.quant in ("nf4", "int4"):
        kind = "nf4" if w.quant == "nf4" else "fp4"
        code.before_load.append(f'quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="{kind}", '
                                f"bnb_4bit_compute_dtype={TORCH_DTYPES[w.compute_dtype]})")
    else:
        code.before_load.append("quantization = BitsAndBytesConfig(load_in_8bit=True)")
    code.load_options.append("quantization_config=quantization")


def _quant_variants(w: Workload, ctx: SearchContext) -> list[Variant]:
    if w.task == "infer":
        return [Variant({}, 0)] + [Variant({"quant": q}, 1) for q in ("int8", "nf4") if q != w.quant]
    if w.task == "qlora" and w.quant == "int8":
        return [Variant({}, 0), Variant({"quant": "nf4"}, 0)]
    return [Variant({}, 0)]


def _task_code(w: Workload, code: Code) -> None:
    if w.is_training:
        code.imports.append("TrainingArguments")
        code.packages.append("accelerate")
    if w.task == "distill":
        code.comments.append(f"# Distillation: the frozen teacher ({w.teacher}) runs its forward, without gradients, "
                             "beside the student.")
        if w.teacher_placement == "sharded":
            code.comments.append("# The teacher is sharded on its own: fully_shard(layer) for each of its decoder "
                                 "layers, then fully_shard(teacher) (torch.distributed.fsdp).")


def _lora_code(w: Workload, code: Code) -> None:
    if not w.uses_adapters:
        return
    code.packages.append("peft")
    if w.task == "qlora":
        # (its own checkpointing off: TrainingArguments enables it, every K layers if planned so)
        code.after_load.append("model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)")
    targets = ", ".join(f'"{t}"' for t in lora_linear_targets(w))
    # A mixture of experts' fused 3-D experts are parameters, which peft adapts through target_parameters.
    parameters = ", ".join(f'"{p}"' for p in peft_target_parameters(w))
    extra = f", target_parameters=[{parameters}]" if parameters else ""
    code.after_load.append(f'model = get_peft_model(model, LoraConfig(r={w.lora_rank}, target_modules=[{targets}]'
                           f'{extra}, task_type="CAUSAL_LM"))')


def _kv_code(w: Workload, code: Code) -> None:
    if w.kv_dtype in KV_CACHE_CONFIGS:
        code.generate_options += ['cache_implementation="quantized"', f"cache_config={KV_CACHE_CONFIGS[w.kv_dtype]}"]
        code.packages.append({"int4": "optimum-quanto", "int8": "hqq"}.get(w.kv_dtype, ""))


def _kv_variants(w: Workload, ctx: SearchContext) -> list[Variant]:
    if w.task != "infer":
        return [Variant({}, 0)]
    out = [Variant({}, 0)]
    if not ctx.bf16 and w.kv_dtype == "bf16":
        out = [Variant({"kv_dtype": "fp16"}, 0)]
    smaller = (["fp8"] if ctx.fp8 else []) + ["int8", "int4"]
    return out + [Variant({"kv_dtype": k}, 1) for k in smaller if k != w.kv_dtype]


def _ac_code(w: Workload, code: Code) -> None:
    if w.ac_every:
        every = f', "every_n_layers": {w.ac_every}' if w.ac_every > 1 else ""
        selective = ', "early_stop": False, "context_fn": selective_ac_context' if w.selective_ac else ""
        offload = ', "offload": True' if w.offload_activations else ""
        code.training_args += ["activation_checkpointing=True",
                               'activation_checkpointing_kwargs={"use_reentrant": False' + selective + every
                               + offload + "}"]
    if w.selective_ac:
        code.after_load += SELECTIVE_AC_CODE


SELECTIVE_AC_CODE = [
    "# torchtitan's SelectiveAC policy (torchtitan/distributed/activation_checkpoint.py): keep the outputs of",
    "# matmuls and attention, recompute the rest and every second matmul of each checkpointed layer.",
    "from torch._functorch.partitioners import get_default_op_list",
    "from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts",
    "SAVE_OPS = {op.default for op in get_default_op_list().compute_intensive_ops} | {",
    "    torch.ops.aten._scaled_dot_product_attention_math.default, torch.ops.aten.linear.default}",
    "def selective_ac_context():",
    "    counts = {False: 0, True: 0}",
    "    def policy(ctx, func, *args, **kwargs):",
    "        if func in (torch.ops.aten.mm.default, torch.ops.aten.linear.default):",
    "            counts[ctx.is_recompute] += 1",
    "            if counts[ctx.is_recompute] % 2 == 0:",
    "                return CheckpointPolicy.PREFER_RECOMPUTE",
    "        return CheckpointPolicy.MUST_SAVE if func in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE",
    "    return create_selective_checkpoint_contexts(policy)",
]
"""The policy as a script writes it (`llamem.trace.selective` is the traced version)."""


def ac_settings(num_layers: int) -> list[dict]:
    """The checkpointing settings the planner tries on a model of `num_layers` layers, least recompute
    first: none, selective on every 4th and 2nd layer, full on every 4th, selective on every layer,
    full on every 2nd, full on every layer. Selective recomputes about a third of a layer's matmul
    FLOPs (its 2nd, 4th and 6th matmuls: k, o and up), full all of them."""
    return [{"ac_every": every, "ac_mode": mode} for every, mode in AC_CHOICES if every <= num_layers]


def _compile_code(w: Workload, code: Code) -> None:
    if w.compile:
        code.training_args.append("torch_compile=True")
        code.comments.append("# Without the Trainer: model = torch.compile(model) (the chunked loss: compile the "
                             "decoder, model.model).")


def _compile_variants(w: Workload, ctx: SearchContext) -> list[Variant]:
    """Tried where `--compile` is sized (`workload._compile_problems`), as tier 1: inductor's fused
    kernels round differently from eager (not bit-identical), so `--exact` leaves it out, and, being
    assumed faster (`COMPILE_TIME_FACTOR`), a tier-0 compile would join every plan, needed or not.
    It enters a plan when no exact change fits, before the precision- and state-changing ones."""
    if w.compile or w.task not in ("train", "lora", "qlora") or w.attn != "sdpa" or not ctx.compile_sized:
        return [Variant({}, 0)]
    if w.liger:
        return [Variant({}, 0)]
    return [Variant({}, 0), Variant({"compile": True}, 1)]


def _loss_code(w: Workload, code: Code) -> None:
    if w.loss == "chunked":
        code.comments.append("# The chunked loss (the head and cross-entropy 8 chunks of the sequence at a time) is "
                             "not a Trainer option: torchtune's CEWithChunkedOutputLoss.")


def _optimizer_code(w: Workload, code: Code) -> None:
    if w.is_training:
        code.training_args.append(f'optim="{TRAINER_OPTIMIZERS[w.optimizer]}"')
        if w.optimizer == "adamw8bit":
            code.packages.append("bitsandbytes")
        if w.optimizer == "adamw-loop":
            code.comments.append("# AdamW's for-loop step is not a Trainer choice (adamw_torch is foreach on a GPU): pass "
                                 "Trainer(optimizers=(torch.optim.AdamW(model.parameters(), foreach=False), None)).")


def _clipping_code(w: Workload, code: Code) -> None:
    if w.is_training and w.max_grad_norm != 1.0:
        code.training_args.append(f"max_grad_norm={w.max_grad_norm:g}")


def _liger_code(w: Workload, code: Code) -> None:
    if w.liger:
        code.packages.append("liger-kernel")
        code.training_args.append("use_liger_kernel=True")  # Liger's defaults: RoPE, RMSNorm, SwiGLU, fused loss


def _in_backward_code(w: Workload, code: Code) -> None:
    _clipping_code(w, code)
    if w.optimizer_in_backward:
        code.comments.append("# The optimizer step in backward is not a Trainer option: torchtune's "
                             "`optimizer_in_bwd: True` (one optimizer per parameter, stepped by "
                             "param.register_post_accumulate_grad_hook; no clipping, no accumulation).")


def _in_backward_variants(w: Workload, ctx: SearchContext) -> list[Variant]:
    """Stepping in backward drops clipping, so it changes the numerics (tier 1); it needs every
    micro-batch stepped on its own (no accumulation). Offered for full fine-tuning only, where the
    gradients are as large as the weights (torchtune's full fine-tuning recipes offer it; adapters'
    gradients are too small to be worth a search twice as long)."""
    if w.optimizer_in_backward or w.grad_accum > 1 or w.task != "train":
        return [Variant({}, 0)]
    return [Variant({}, 0), Variant({"optimizer_in_backward": True, "max_grad_norm": 0.0}, 1)]


def _optimizer_variants(w: Workload, ctx: SearchContext) -> list[Variant]:
    if w.task not in ("train", "distill"):
        return [Variant({}, 0)]
    return [Variant({}, 0)] + [Variant({"optimizer": o}, 1) for o in ("adamw8bit", "adafactor") if o != w.optimizer]


def _batch_code(w: Workload, code: Code) -> None:
    if w.is_training:
        code.training_args += [f"per_device_train_batch_size={w.batch}", f"gradient_accumulation_steps={w.grad_accum}"]


def _generation_code(w: Workload, code: Code) -> None:
    if not w.is_training:
        code.generate_options.insert(0, f"max_new_tokens={w.new_tokens}")


def _prefill_code(w: Workload, code: Code) -> None:
    if w.prefill_chunk:
        code.generate_options.append(f"prefill_chunk_size={w.prefill_chunk}")


def _padding_args(w: Workload) -> list[str]:
    return (_if(w.padding != "none", "--padding", w.padding) + _if(bool(w.pad_fraction), "--pad-fraction",
                                                                   f"{w.pad_fraction:g}")
            + _if(w.padding_free, "--padding-free"))


def _padding_label(w: Workload) -> str | None:
    if w.padding_free:
        return "padding-free"
    return f"padded ({w.pad_fraction:g} padding)" if w.padding != "none" else None


def _padding_code(w: Workload, code: Code) -> None:
    if w.padding_free:
        code.comments.append("# data_collator=DataCollatorWithFlattening(): the batch packed into one row, "
                             "position_ids restarting per sequence")
    elif w.padding != "none":
        code.comments.append('# data_collator=DataCollatorWithPadding(tokenizer, padding="longest"): an attention_mask')


# The records, in the documented order a plan applies them ---------------------------------------
RECORDS: tuple[Record, ...] = (
    Record(name="task", fields=("task",), args=lambda w: _flag("--task", w.task), label=lambda w: w.task,
           code=_task_code),
    Record(name="shape", fields=("batch", "seq"), args=lambda w: _flag("--batch", w.batch) + _flag("--seq", w.seq),
           label=lambda w: f"batch {w.batch} x seq {w.seq}",
           options=(Option(flag="--batch", field="batch", type=int, help="Micro-batch size per GPU.  [default: 1]"),
                    Option(flag="--seq", field="seq", type=int,
                           help="Tokens per sequence (prompt length for infer).  [default: 2048]"))),
    Record(name="precision", fields=("precision",), args=lambda w: _flag("--precision", w.precision),
           label=lambda w: w.precision, code=_precision_code, title="precision",
           reason="pure bf16 drops the fp32 master weights, their gradients and the autocast copies",
           why=lambda before, after: (
               "the card has no bf16: it computes in fp16 (mixed precision adds a loss scaler)"
               if before.compute_dtype == "bf16" and after.compute_dtype == "fp16" and after.mixed == before.mixed
               else f"pure {after.compute_dtype} drops the fp32 master weights, their gradients and the autocast "
                    "copies"),
           options=(Option(flag="--precision", field="precision",
                           help="fp32 | bf16 | fp16 | bf16-mixed | fp16-mixed.  "
                                "[default: bf16, the dtype from_pretrained loads these checkpoints in; the Trainer "
                                "adds no autocast]"),),
           variants=_precision_variants),
    Record(name="generation", fields=("new_tokens",), args=lambda w: _flag("--new-tokens", w.new_tokens),
           label=lambda w: f"{w.new_tokens} new tokens", code=_generation_code,
           options=(Option(flag="--new-tokens", field="new_tokens", type=int, help="Decode steps (infer).  "
                           "[default: 256]"),)),
    Record(name="quant", fields=("quant",), args=lambda w: _if(w.quant != "none", "--quant", w.quant),
           label=lambda w: w.quant if w.quant != "none" else None, code=_quant_code,
           title="weight quantization", reason="quantized weights take 1 (int8) or 0.5 (nf4/int4) bytes per parameter",
           options=(Option(flag="--quant", field="quant",
                           help="none | int8 | nf4 | int4.  [default: nf4 for qlora, none otherwise]"),),
           variants=_quant_variants),
    Record(name="qlora", fields=("task",), code=_lora_code, title="LoRA -> QLoRA",
           reason="a 4-bit base under the adapters quarters the frozen weights",
           change=lambda w: f"task {w.task}",
           variants=lambda w, ctx: [Variant({}, 0)] + (
               [Variant({"task": "qlora", "quant": "nf4"}, 1)] if w.task == "lora" else [])),
    Record(name="lora", fields=("lora_rank", "lora_targets"),
           args=lambda w: (_if(w.lora_rank != 8, "--lora-rank", str(w.lora_rank)) + _if(
               w.lora_targets != LORA_TARGETS_DEFAULT, "--lora-targets", ",".join(w.lora_targets))),
           label=lambda w: f"LoRA r={w.lora_rank} on {','.join(w.lora_targets)}" if w.uses_adapters else None,
           options=(Option(flag="--lora-rank", field="lora_rank", type=int, help="[default: 8]"),
                    Option(flag="--lora-targets", field="lora_targets",
                           help="Comma-separated linears, or 'all'; 'experts' adds a mixture of experts' fused "
                           "expert weights.  [default: q_proj,v_proj]"))),
    Record(name="kv_dtype", fields=("kv_dtype",), args=lambda w: _flag("--kv-dtype", w.kv_dtype),
           label=lambda w: f"kv {w.kv_dtype}", code=_kv_code, title="KV-cache dtype",
           reason="a smaller KV-cache dtype shrinks the cache in proportion",
           why=lambda before, after: ("the card has no bf16: the cache is kept in fp16" if after.kv_dtype == "fp16"
                                      else "a smaller KV-cache dtype shrinks the cache in proportion"),
           options=(Option(flag="--kv-dtype", field="kv_dtype", help="bf16 | fp16 | fp32 | fp8 | int8 | int4 (infer).  "
                           "[default: the compute dtype]"),),
           variants=_kv_variants),
    Record(name="prefill_chunk", fields=("prefill_chunk",),
           args=lambda w: _if(bool(w.prefill_chunk), "--prefill-chunk", str(w.prefill_chunk)),
           label=lambda w: f"prefill chunks of {w.prefill_chunk}" if w.prefill_step < w.seq else None,
           code=_prefill_code, title="chunked prefill",
           reason="the prompt runs a chunk at a time against the cache: same outputs, smaller temporaries",
           change=lambda w: f"prefill in chunks of {w.prefill_chunk} tokens",
           time_factor=lambda w: 1 + CHUNKED_PREFILL_COST * (w.prefill_step < w.seq),
           options=(Option(flag="--prefill-chunk", field="prefill_chunk", type=int,
                           help="Prompt tokens per prefill forward (infer; transformers' prefill_chunk_size).  "
                                "[default: 0, the whole prompt]"),)),
    Record(name="ac_every", fields=("ac_every", "ac_mode"), args=lambda w: _flag("--ac", w.ac_label),
           label=lambda w: f"ac {w.ac_label}", code=_ac_code, title="activation checkpointing",
           reason="checkpointing keeps layer inputs only and recomputes the rest in backward",
           why=lambda before, after: (
               "selective checkpointing keeps each layer's matmul and attention outputs and recomputes the rest"
               if after.selective_ac else "checkpointing keeps layer inputs only and recomputes the rest in backward"),
           change=lambda w: f"ac {w.ac_label}",
           options=(Option(flag="--ac", field="ac_every",
                           help="Activation checkpointing: none | full | every-K | selective | selective-every-K. "
                                "full: every layer keeps only its input; every-K: every K-th layer does, the others "
                                "are not checkpointed; selective: every layer keeps also its matmul and attention "
                                "outputs (torchtitan's per-op policy, every second matmul recomputed); "
                                "selective-every-K: that policy on every K-th layer, the others not checkpointed.  "
                                "[default: none]"),)),
    # Offloading keeps the numerics (tier 0: the same tensors, copied to the host and back); its cost is the
    # PCIe time `cost.activation_offload_seconds` adds. The planner tries it as a memory knob on top of full
    # checkpointing, only where nothing without it fits (`plan.offloaded_candidates`).
    Record(name="offload_activations", fields=("offload_activations",),
           args=lambda w: _if(w.offload_activations, "--offload-activations"),
           label=lambda w: "activations offloaded" if w.offload_activations else None,
           title="activation offloading",
           reason="each checkpointed layer's input waits in pinned host memory and is copied back in its backward",
           change=lambda w: "offload the checkpointed layers' inputs to host memory",
           options=(Option(flag="--offload-activations/--no-offload-activations", field="offload_activations",
                           type=bool, help="Hold each checkpointed layer's input in pinned host memory "
                                           "(activation_checkpointing_kwargs offload=True; needs --ac full).  "
                                           "[default: off]"),)),
    Record(name="loss", fields=("loss",), args=lambda w: _if(w.loss != "full", "--loss", w.loss),
           label=lambda w: f"{w.loss} loss" if w.loss != "full" else None, code=_loss_code, title="chunked loss",
           reason="the head and its fp32 loss buffers run one chunk of the sequence at a time",
           time_factor=lambda w: 1 + CHUNKED_LOSS_COST * (w.loss == "chunked"),
           options=(Option(flag="--loss", field="loss", help="full | chunked (logits in 8 chunks).  [default: full]"),)),
    Record(name="liger", fields=("liger",), args=lambda w: _if(w.liger, "--liger"),
           label=lambda w: "liger loss" if w.liger else None, code=_liger_code,
           title="Liger fused linear cross-entropy",
           reason="the head and the loss run a chunk of tokens at a time with their gradients made in forward: "
                  "the full logits never exist",
           change=lambda w: "Liger's fused linear cross-entropy",
           time_factor=lambda w: 1 + LIGER_LOSS_COST * w.liger,
           options=(Option(flag="--liger/--no-liger", field="liger", type=bool,
                           help="Liger-Kernel (the Trainer's use_liger_kernel): fused linear cross-entropy, RMSNorm, "
                                "SwiGLU and RoPE.  [default: off]"),)),
    Record(name="compile", fields=("compile",), args=lambda w: _if(w.compile, "--compile"),
           label=lambda w: "compiled" if w.compile else None, code=_compile_code, title="torch.compile",
           reason="the compiled graph saves matmul and attention outputs and recomputes cheap pointwise chains; "
                  "inductor fuses their temporaries",
           change=lambda w: "torch.compile the model",
           variants=_compile_variants,
           time_factor=lambda w: COMPILE_TIME_FACTOR if w.compile else 1.0,
           options=(Option(flag="--compile/--no-compile", field="compile", type=bool,
                           help="torch.compile the model (training): what AOT autograd's partitioner saves, "
                                "inductor's fused temporaries.  [default: off]"),)),
    Record(name="optimizer", fields=("optimizer",), args=lambda w: _flag("--optimizer", w.optimizer),
           label=lambda w: w.optimizer, code=_optimizer_code, title="optimizer",
           reason="smaller optimizer state (8-bit moments or a factored second moment)",
           options=(Option(flag="--optimizer", field="optimizer",
                           help="adamw (= adamw-foreach) | adamw-fused | adamw-foreach | adamw-loop | adamw8bit | sgd "
                                "| adafactor: torch AdamW's step fused (no temporaries), foreach (one per tensor, all "
                                "at once) or for-loop (one tensor at a time).  [default: adamw-fused, the "
                                "Trainer's adamw_torch_fused]"),),
           variants=_optimizer_variants),
    # Clipping and the step in backward are one record: stepping in backward cannot clip, so a plan
    # that turns it on turns clipping off in the same step of its ladder.
    Record(name="optimizer_in_backward", fields=("optimizer_in_backward", "max_grad_norm"),
           args=lambda w: (_if(w.max_grad_norm != 1.0, "--max-grad-norm", f"{w.max_grad_norm:g}")
                           + _if(w.optimizer_in_backward, "--optimizer-in-backward")),
           label=lambda w: ", ".join(part for part in (
               f"max-grad-norm {w.max_grad_norm:g}" if w.max_grad_norm != 1.0 else "",
               "optimizer in backward" if w.optimizer_in_backward else "") if part) or None,
           code=_in_backward_code,
           title="optimizer step in backward",
           reason="each parameter is stepped as soon as its gradient is ready and the gradient freed: the gradients "
                  "never all exist (no clipping)",
           change=lambda w: "step the optimizer in backward (no clipping)",
           variants=_in_backward_variants,
           time_factor=lambda w: 1 + OPTIMIZER_IN_BACKWARD_COST * w.optimizer_in_backward,
           options=(Option(flag="--max-grad-norm", field="max_grad_norm", type=float,
                           help="Clip gradients to this total norm before the step (its per-tensor norms); 0: no "
                                "clipping.  [default: 1.0, the Trainer's; 0 with --optimizer-in-backward]"),
                    Option(flag="--optimizer-in-backward/--no-optimizer-in-backward", field="optimizer_in_backward",
                           type=bool, help="torchtune's optimizer step in backward: one optimizer per parameter, "
                                           "stepped as its gradient is ready (needs --grad-accum 1).  [default: off]"))),
    Record(name="batch", fields=("grad_accum",), args=lambda w: _if(w.grad_accum > 1, "--grad-accum", str(w.grad_accum)),
           label=lambda w: f"grad-accum {w.grad_accum}" if w.grad_accum > 1 else None, code=_batch_code,
           title="micro-batch x gradient accumulation",
           reason="a smaller micro-batch shrinks activations; accumulation keeps the global batch",
           change=lambda w: f"micro-batch {w.batch} x {w.grad_accum} accumulation steps",
           options=(Option(flag="--grad-accum", field="grad_accum", type=int,
                           help="Micro-batches per optimizer step.  [default: 1]"),)),
    Record(name="teacher", fields=("teacher",), args=lambda w: _if(bool(w.teacher), "--teacher", str(w.teacher)),
           label=lambda w: f"teacher {w.teacher}" if w.teacher else None,
           options=(Option(flag="--teacher", field="teacher", help="Teacher model for --task distill."),)),
    # The planner tries both teacher records only where nothing fits without them (`plan.teacher_candidates`).
    Record(name="teacher_quant", fields=("teacher_quant",),
           args=lambda w: _if(w.teacher_quant != "none", "--teacher-quant", w.teacher_quant),
           label=lambda w: f"teacher {w.teacher_quant}" if w.teacher_quant != "none" else None,
           title="teacher quantization", reason="the frozen teacher's weights in 8 or 4 bits (bitsandbytes)",
           change=lambda w: f"teacher weights {w.teacher_quant}",
           options=(Option(flag="--teacher-quant", field="teacher_quant",
                           help="none | int8 | nf4 | int4: the frozen teacher's weights (distill).  [default: none]"),)),
    Record(name="teacher_placement", fields=("teacher_placement",),
           args=lambda w: _if(w.teacher_placement != "auto", "--teacher-placement", w.teacher_placement),
           label=lambda w: f"teacher {w.teacher_placement}" if w.teacher_placement != "auto" else None,
           title="teacher placement",
           reason="the frozen teacher sharded over the data-parallel GPUs with FSDP2, gathered a layer at a time in "
                  "its forward",
           change=lambda w: f"teacher {w.teacher_placement}",
           time_factor=lambda w: 1 + TEACHER_GATHER_COST * (w.teacher_placement == "sharded"),
           options=(Option(flag="--teacher-placement", field="teacher_placement",
                           help="auto | replicated | sharded: where the frozen teacher lives on several GPUs "
                                "(distill): whole on every GPU, or sharded with FSDP2 fully_shard on its own.  "
                                "[default: auto, sharded under ZeRO-3, else replicated]"),)),
    Record(name="attn", fields=("attn",), args=lambda w: _if(w.attn != "sdpa", "--attn", w.attn),
           label=lambda w: w.attn, code=lambda w, code: code.load_options.append(f'attn_implementation="{w.attn}"'),
           options=(Option(flag="--attn", field="attn", help="sdpa | eager | flash_attention_2 (flash-attn's "
                                                              "kernels, emulated in trace; bf16/fp16 training).  "
                                                              "[default: sdpa]"),)),
    Record(name="padding", fields=("padding", "pad_fraction", "padding_free"), args=_padding_args,
           label=_padding_label, code=_padding_code,
           options=(Option(flag="--padding", field="padding",
                           help="none | longest: each batch padded to its longest row with an attention_mask (the "
                                "masks transformers builds from it).  [default: none]"),
                    Option(flag="--pad-fraction", field="pad_fraction", type=float,
                           help="With --padding longest: the share of positions that are padding (what "
                                "flash_attention_2 unpads).  [default: 0]"),
                    Option(flag="--padding-free/--no-padding-free", field="padding_free", type=bool,
                           help="DataCollatorWithFlattening: the batch's sequences packed into one row, position "
                                "ids restarting, no mask.  [default: off]"))),
    Record(name="seq", fields=("seq",), title="sequence length",
           reason="nothing else fits: shorter sequences (the model sees less context)"),
)
"""Every Workload field appears in exactly one record's `fields` for rendering (`qlora` and `seq`
change fields that `task`/`quant` and `shape` render); `tests/test_techniques.py` checks it."""

BY_NAME = {r.name: r for r in RECORDS}
_TIME_FACTORS = tuple((record.tasks, record.time_factor) for record in RECORDS
                      if record.time_factor is not Record.time_factor)
"""(tasks, factor) of the records that change the step time: the planner asks for every candidate."""
LADDER_ORDER = ("precision", "quant", "qlora", "kv_dtype", "prefill_chunk", "ac_every", "offload_activations", "loss", "liger", "compile",
                "optimizer", "optimizer_in_backward", "batch", "teacher_quant", "layout", "teacher_placement", "seq")
"""The order a plan's ladder applies the techniques in (`layout` is `llamem.parallel.Layout`)."""
LAYOUT_TITLE = "parallelism / sharding / offload"
LAYOUT_REASON = "spreading weights, gradients and optimizer state over GPUs (or to host memory)"
TRUNCATION_TIER = 2
"""Tier of the last resort: shorter sequences change what the model sees."""


RENDER_ORDER = ("task", "shape", "precision", "generation", "kv_dtype", "prefill_chunk", "optimizer",
                "optimizer_in_backward", "ac_every", "offload_activations", "batch", "loss", "liger", "compile", "quant", "lora", "teacher", "teacher_quant", "teacher_placement", "attn", "padding")
"""The order settings appear in a reproduce command and in a report's header."""


def workload_args(w: Workload) -> list[str]:
    """The arguments of `llamem estimate` that rebuild this workload (every field, defaults included
    where a task's default could differ)."""
    out: list[str] = []
    for name in RENDER_ORDER:
        record = BY_NAME[name]
        if w.task in record.tasks:
            out += record.args(w)
    return out


def workload_labels(w: Workload) -> list[str]:
    """The header of a report: task, shape, precision, then each applicable setting's label."""
    labels = [BY_NAME[name].label(w) for name in RENDER_ORDER if w.task in BY_NAME[name].tasks]
    return [label for label in labels if label]


def workload_code(w: Workload) -> Code:
    code = Code()
    for name in ("task", "precision", "generation", "quant", "qlora", "kv_dtype", "prefill_chunk", "ac_every", "loss",
                 "compile", "optimizer", "optimizer_in_backward", "liger", "batch", "attn", "padding"):
        if w.task in BY_NAME[name].tasks:
            BY_NAME[name].code(w, code)
    code.packages = list(dict.fromkeys(p for p in code.packages if p))
    return code


def technique_variants(w: Workload, ctx: SearchContext, max_tier: int) -> list[Variant]:
    """The structural variants of a workload: the product of every technique's variants (all but
    checkpointing, the loss (Liger's included), batch and layout, which the search treats as knobs), within `max_tier`."""
    combined = [Variant({}, 0)]
    for name in ("precision", "quant", "qlora", "kv_dtype", "optimizer", "compile", "optimizer_in_backward"):
        record = BY_NAME[name]
        if w.task not in record.tasks:
            continue
        combined = [Variant({**a.changes, **b.changes}, max(a.tier, b.tier), a.numerics + b.numerics)
                    for a in combined for b in record.variants(w, ctx)]
    # Both at once only where the workload asks for one of them: trying every pair would lengthen every
    # search, for a pair whose saving over compile alone is the gradients (`analytic.in_backward`).
    return [v for v in combined if v.tier <= max_tier
            and not (v.changes.get("compile") and v.changes.get("optimizer_in_backward"))]


def time_factor(w: Workload) -> float:
    """Step-time factors the cost model does not see (chunked loss, chunked prefill, compile, ...)."""
    factor = 1.0
    for tasks, record_factor in _TIME_FACTORS:
        if w.task in tasks:
            factor *= record_factor(w)
    return factor
