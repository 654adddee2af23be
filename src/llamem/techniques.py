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

from llamem.workload import FIELD_TASKS, LORA_TARGETS_DEFAULT, Workload, ac_label

CHUNKED_LOSS_COST = 0.02
"""torchtune's chunked loss runs the head per chunk: assumed 2 % slower (no measurement yet)."""
CHUNKED_PREFILL_COST = 0.02
"""Chunked prefill runs smaller matmuls and masked attention: assumed 2 % slower (no measurement yet)."""
AC_CHOICES = (0, 4, 2, 1)
"""Checkpointing every K layers, cheapest first: none, every 4th, every 2nd, every layer."""
PREFILL_CHUNKS = (0, 8192, 2048, 512)
"""Prefill chunk sizes the planner tries; 512 is the smallest: below it the matmuls stop filling a GPU."""
TORCH_DTYPES = {"fp32": "torch.float32", "bf16": "torch.bfloat16", "fp16": "torch.float16"}
TRAINER_OPTIMIZERS = {"adamw": "adamw_torch", "adamw8bit": "adamw_bnb_8bit", "sgd": "sgd", "adafactor": "adafactor"}
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


def _lora_code(w: Workload, code: Code) -> None:
    if not w.uses_adapters:
        return
    code.packages.append("peft")
    if w.task == "qlora":
        # (its own checkpointing off: TrainingArguments enables it, every K layers if planned so)
        code.after_load.append("model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)")
    targets = ", ".join(f'"{t}"' for t in w.lora_targets)
    code.after_load.append(f'model = get_peft_model(model, LoraConfig(r={w.lora_rank}, target_modules=[{targets}], '
                           'task_type="CAUSAL_LM"))')


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
        code.training_args += ["activation_checkpointing=True",
                               'activation_checkpointing_kwargs={"use_reentrant": False' + every + "}"]


def _loss_code(w: Workload, code: Code) -> None:
    if w.loss == "chunked":
        code.comments.append("# The chunked loss (the head and cross-entropy 8 chunks of the sequence at a time) is "
                             "not a Trainer option: torchtune's CEWithChunkedOutputLoss.")


def _optimizer_code(w: Workload, code: Code) -> None:
    if w.is_training:
        code.training_args.append(f'optim="{TRAINER_OPTIMIZERS[w.optimizer]}"')
        if w.optimizer == "adamw8bit":
            code.packages.append("bitsandbytes")


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
                                "[default: bf16-mixed for train/distill, bf16 otherwise]"),),
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
                           help="Comma-separated linears, or 'all'.  [default: q_proj,v_proj]"))),
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
    Record(name="ac_every", fields=("ac_every",), args=lambda w: _flag("--ac", ac_label(w.ac_every)),
           label=lambda w: f"ac {ac_label(w.ac_every)}", code=_ac_code, title="activation checkpointing",
           reason="checkpointing keeps layer inputs only and recomputes the rest in backward",
           change=lambda w: f"ac {ac_label(w.ac_every)}",
           options=(Option(flag="--ac", field="ac_every",
                           help="Activation checkpointing: none | full | every-K.  [default: none]"),)),
    Record(name="loss", fields=("loss",), args=lambda w: _if(w.loss != "full", "--loss", w.loss),
           label=lambda w: f"{w.loss} loss" if w.loss != "full" else None, code=_loss_code, title="chunked loss",
           reason="the head and its fp32 loss buffers run one chunk of the sequence at a time",
           time_factor=lambda w: 1 + CHUNKED_LOSS_COST * (w.loss == "chunked"),
           options=(Option(flag="--loss", field="loss", help="full | chunked (logits in 8 chunks).  [default: full]"),)),
    Record(name="optimizer", fields=("optimizer",), args=lambda w: _flag("--optimizer", w.optimizer),
           label=lambda w: w.optimizer, code=_optimizer_code, title="optimizer",
           reason="smaller optimizer state (8-bit moments or a factored second moment)",
           options=(Option(flag="--optimizer", field="optimizer",
                           help="adamw | adamw8bit | sgd | adafactor.  [default: adamw]"),),
           variants=_optimizer_variants),
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
    Record(name="teacher_quant", fields=("teacher_quant",),
           args=lambda w: _if(w.teacher_quant != "none", "--teacher-quant", w.teacher_quant),
           label=lambda w: f"teacher {w.teacher_quant}" if w.teacher_quant != "none" else None,
           options=(Option(flag="--teacher-quant", field="teacher_quant",
                           help="none | int8 | nf4 | int4: the frozen teacher's weights (distill).  [default: none]"),)),
    Record(name="attn", fields=("attn",), args=lambda w: _if(w.attn != "sdpa", "--attn", w.attn),
           label=lambda w: w.attn, code=lambda w, code: code.load_options.append(f'attn_implementation="{w.attn}"'),
           options=(Option(flag="--attn", field="attn", help="sdpa | eager.  [default: sdpa]"),)),
    Record(name="seq", fields=("seq",), title="sequence length",
           reason="nothing else fits: shorter sequences (the model sees less context)"),
)
"""Every Workload field appears in exactly one record's `fields` for rendering (`qlora` and `seq`
change fields that `task`/`quant` and `shape` render); `tests/test_techniques.py` checks it."""

BY_NAME = {r.name: r for r in RECORDS}
LADDER_ORDER = ("precision", "quant", "qlora", "kv_dtype", "prefill_chunk", "ac_every", "loss", "optimizer", "batch",
                "layout", "seq")
"""The order a plan's ladder applies the techniques in (`layout` is `llamem.parallel.Layout`)."""
LAYOUT_TITLE = "parallelism / sharding / offload"
LAYOUT_REASON = "spreading weights, gradients and optimizer state over GPUs (or to host memory)"
TRUNCATION_TIER = 2
"""Tier of the last resort: shorter sequences change what the model sees."""


RENDER_ORDER = ("task", "shape", "precision", "generation", "kv_dtype", "prefill_chunk", "optimizer", "ac_every",
                "batch", "loss", "quant", "lora", "teacher", "teacher_quant", "attn")
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
                 "optimizer", "batch", "attn"):
        if w.task in BY_NAME[name].tasks:
            BY_NAME[name].code(w, code)
    code.packages = list(dict.fromkeys(p for p in code.packages if p))
    return code


def technique_variants(w: Workload, ctx: SearchContext, max_tier: int) -> list[Variant]:
    """The structural variants of a workload: the product of every technique's variants (all but
    checkpointing, loss, batch and layout, which the search treats as knobs), within `max_tier`."""
    combined = [Variant({}, 0)]
    for name in ("precision", "quant", "qlora", "kv_dtype", "optimizer"):
        record = BY_NAME[name]
        if w.task not in record.tasks:
            continue
        combined = [Variant({**a.changes, **b.changes}, max(a.tier, b.tier), a.numerics + b.numerics)
                    for a in combined for b in record.variants(w, ctx)]
    return [v for v in combined if v.tier <= max_tier]


def time_factor(w: Workload) -> float:
    """Step-time factors the cost model does not see (chunked loss, chunked prefill)."""
    factor = 1.0
    for record in RECORDS:
        if w.task in record.tasks:
            factor *= record.time_factor(w)
    return factor
