"""Workload: what is run on the model. Frozen, validated before any work, errors name the fix.

Defaults are what a typical transformers + peft user gets (`task_defaults`, read off transformers 5.24):

- `train`, `distill`: `AutoModelForCausalLM.from_pretrained(name)` + `Trainer(TrainingArguments())`:
  bf16 weights with no autocast (`bf16`), torch's fused AdamW (`adamw-fused`), clipping at 1.0.
- `lora`: base weights in bf16, peft defaults r=8 on q_proj and v_proj, adapters kept in fp32
  (peft's `autocast_adapter_dtype=True`); the Trainer's fused AdamW and clipping.
- `qlora`: like lora, base weights NF4 (bitsandbytes, blocksize 64, double quantization off).
- `infer`: bf16 weights, SDPA, a bf16 KV cache, 256 new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal, get_args

from llamem.errors import InvalidWorkload

Task = Literal["infer", "train", "lora", "qlora", "distill"]
Precision = Literal["fp32", "bf16", "fp16", "bf16-mixed", "fp16-mixed"]
Quant = Literal["none", "int8", "nf4", "int4"]
Optimizer = Literal["adamw", "adamw-fused", "adamw-foreach", "adamw-loop", "adamw8bit", "sgd", "adafactor"]
Attention = Literal["sdpa", "eager", "flash_attention_2"]
Padding = Literal["none", "longest"]
KVDType = Literal["bf16", "fp16", "fp32", "fp8", "int8", "int4"]
Loss = Literal["full", "chunked"]
ACMode = Literal["full", "selective"]
TeacherPlacement = Literal["auto", "replicated", "sharded"]

ALL_TASKS = ("infer", "train", "lora", "qlora", "distill")
TRAINING_TASKS = ("train", "lora", "qlora", "distill")
ADAPTER_TASKS = ("lora", "qlora")
LORA_TARGETS_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LORA_TARGETS_DEFAULT = ("q_proj", "v_proj")
LORA_EXPERTS = "experts"
"""The --lora-targets name of a mixture of experts' fused 3-D expert weights (gate_up_proj, down_proj), which peft
adapts through `target_parameters` (`llamem.analytic.moe_lora`)."""
MAX_BATCH = 2**16
"""Batch and accumulation steps up to 65,536; sequence and generated tokens up to 2**22 (4M); LoRA rank
and checkpointing interval up to 65,536. Beyond these no real run goes, and the sizes of the largest
tensors would leave what the allocator can address."""
MAX_TOKENS = 2**22
MAX_RANK = 2**16
MAX_PREFILL_CHUNKS = 512
"""A prompt is sized in at most 512 prefill chunks. Each chunk is a forward over every weight, so
smaller chunks only slow generation down (at 512 chunks the weights are read 512 times before the
first token); and the allocation schedule llamem replays grows with the number of chunks."""
LOSS_CHUNKS = 8
"""Chunks of the sequence in `--loss chunked` (torchtune's CEWithChunkedOutputLoss uses 8)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    """A fully resolved workload: no field is left to a default at estimate time."""

    task: Task = "train"
    """infer: prefill + decode with a KV cache; train: full fine-tune; lora/qlora: adapters on a frozen
    (quantized) base; distill: frozen teacher forward + student training."""
    batch: int = 1
    """Micro-batch size: sequences per forward pass."""
    seq: int = 2048
    """Tokens per sequence (the prompt length for infer)."""
    new_tokens: int = 0
    """Decode steps after the prompt (infer only)."""
    precision: Precision = "bf16-mixed"
    """fp32 | bf16 | fp16 (pure: weights and compute in that dtype) | bf16-mixed | fp16-mixed
    (fp32 master weights, autocast compute)."""
    quant: Quant = "none"
    """Weight quantization of the frozen base: int8 (LLM.int8), nf4 (QLoRA), int4 (int4 weight-only)."""
    optimizer: Optimizer = "adamw"
    """torch AdamW's step as foreach (`adamw`, the same as `adamw-foreach`: one parameter-sized
    temporary per tensor, all at once), fused (`adamw-fused`: none) or for-loop (`adamw-loop`: two per
    tensor, one tensor at a time); adamw8bit (bitsandbytes), sgd (momentum 0.9), adafactor (torch)."""
    max_grad_norm: float = 1.0
    """Gradient clipping before the step (`clip_grad_norm_`, foreach on a GPU): the per-tensor norms,
    their stack and the total norm, then the gradients scaled in place; 0: no clipping."""
    optimizer_in_backward: bool = False
    """torchtune's optimizer step in backward: one optimizer per parameter, stepped by a
    post-accumulate-grad hook as soon as its gradient is ready, the gradient freed at once."""
    liger: bool = False
    """Liger-Kernel's fused linear cross-entropy: the head and the loss run in chunks of tokens and make
    the input's and the head's gradients in forward; the full logits never exist."""
    offload_activations: bool = False
    """transformers' `activation_checkpointing_enable(offload=True)`: each checkpointed layer's input, the
    one tensor a checkpoint saves, is held in pinned host memory (`torch.autograd.graph.save_on_cpu`) and
    copied back in the layer's backward (`llamem.analytic.offload`); needs `--ac full`."""
    ac_every: int = 0
    """Activation checkpointing: 0 none, 1 every layer (full), K every K-th layer."""
    ac_mode: ACMode = "full"
    """What a checkpointed layer keeps: full, its input only (everything recomputed in backward);
    selective, also the outputs of torchtitan's per-op save list (matmuls, attention), every
    second matmul recomputed (`llamem.analytic.selective`)."""
    attn: Attention = "sdpa"
    """transformers' attention: sdpa, eager, or flash_attention_2 (the flash-attn package's kernels: dense
    without padding, varlen after unpadding q, k and v with a padding mask or packed sequences)."""
    padding: Padding = "none"
    """How a batch's rows of unequal length are made one tensor: none (every row `seq` tokens, no mask) or
    longest (padded to the longest row, `seq`, with an `attention_mask`: the masks transformers builds
    from it, `llamem.trace.padding`, `llamem.analytic.attention_paths`). Sized as a batch that holds
    padding, even at batch 1 (where transformers skips the mask when no position is padding)."""
    pad_fraction: float = 0.0
    """With --padding longest: the share of the padded batch's `batch x seq` positions that are padding
    (0: every row as long as the longest, the largest unpadded tensors). Only flash_attention_2's
    unpadded tensors depend on it; the masks and every other tensor have the padded shape."""
    padding_free: bool = False
    """transformers' DataCollatorWithFlattening: the `batch` sequences of `seq` tokens packed into one row
    of `batch x seq` tokens, `position_ids` restarting at each sequence, no attention mask."""
    lora_rank: int = 8
    lora_targets: tuple[str, ...] = LORA_TARGETS_DEFAULT
    """The adapted linears of each layer (LORA_TARGETS_ALL), and on a mixture of experts `experts`: its fused
    expert weights, through peft's target_parameters."""
    kv_dtype: KVDType = "bf16"
    grad_accum: int = 1
    """Micro-batches per optimizer step: from the second one on, gradients live through forward."""
    loss: Loss = "full"
    compile: bool = False
    """`torch.compile` of the model's forward (training): AOT autograd's partitioner decides what
    backward keeps (matmul and attention outputs saved, cheap pointwise chains recomputed) and
    inductor fuses pointwise chains (`llamem.trace.compiled`, `llamem.analytic.compiled`)."""
    prefill_chunk: int = 0
    """Prompt tokens per prefill forward (infer only; 0: the whole prompt at once). transformers'
    `GenerationConfig.prefill_chunk_size`: the same outputs, smaller prefill temporaries."""
    teacher: str | None = None
    """Teacher model (distill only): a preset name or Hugging Face id."""
    teacher_quant: Quant = "none"
    """The frozen teacher's weight quantization (distill only): int8, nf4 or int4 weights as for the base."""
    teacher_placement: TeacherPlacement = "auto"
    """Where the frozen teacher lives on several GPUs (distill only, `llamem.teacher_placement`): replicated
    (whole on every data-parallel rank), sharded (FSDP2 `fully_shard` on its own, gathered a layer at a time in
    its forward), or auto (what the student's layout implies: sharded under ZeRO-3, else replicated)."""
    _mixed: bool = field(default=False, init=False, repr=False, compare=False)
    _compute: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.optimizer == "adamw-foreach":  # one workload, one spelling: `adamw` is the foreach step
            object.__setattr__(self, "optimizer", "adamw")
        problems = _value_problems(self)
        if problems:
            raise InvalidWorkload(problems)
        # Derived once: the engines ask for these many times per estimate.
        object.__setattr__(self, "_mixed", self.precision.endswith("-mixed"))
        object.__setattr__(self, "_compute", self.precision.removesuffix("-mixed"))

    # Derived facts the engines share.
    @property
    def is_training(self) -> bool:
        return self.task in TRAINING_TASKS

    @property
    def uses_adapters(self) -> bool:
        return self.task in ADAPTER_TASKS

    @property
    def mixed(self) -> bool:
        return self._mixed

    @property
    def weight_dtype(self) -> str:
        """dtype the (non-quantized) weights are stored in."""
        return "fp32" if self.mixed or self.precision == "fp32" else self.precision

    @property
    def compute_dtype(self) -> str:
        return self._compute

    @property
    def prefill_step(self) -> int:
        """Prompt tokens per prefill forward: the chunk, or the whole prompt."""
        return min(self.prefill_chunk or self.seq, self.seq)

    @property
    def ac_label(self) -> str:
        return ac_label(self.ac_every, self.ac_mode)

    @property
    def selective_ac(self) -> bool:
        """Checkpointed layers keep torchtitan's per-op save list (`--ac selective[-every-K]`)."""
        return self.ac_mode == "selective" and self.ac_every > 0


def ac_label(ac_every: int, ac_mode: str = "full") -> str:
    """(0, *) -> 'none', (1, full) -> 'full', (K, full) -> 'every-K', (1, selective) -> 'selective',
    (K, selective) -> 'selective-every-K': the spelling `--ac` takes."""
    if ac_mode == "selective" and ac_every:
        return "selective" if ac_every == 1 else f"selective-every-{ac_every}"
    return {0: "none", 1: "full"}.get(ac_every, f"every-{ac_every}")


_CHOICES: dict[int, tuple] = {}


def _check_choice(problems: list[str], flag: str, value, literal) -> None:
    # The planner builds hundreds of thousands of workloads per search: each Literal's values are read
    # once, and looked up by identity (hashing a typing.Literal costs more than the whole check).
    choices = _CHOICES.get(id(literal))
    if choices is None:
        choices = _CHOICES[id(literal)] = get_args(literal)
    if value not in choices:
        problems.append(f"{flag} {value!r} is not one of: {', '.join(map(str, choices))}")


def _value_problems(w: Workload) -> list[str]:
    problems: list[str] = []
    _check_choice(problems, "--task", w.task, Task)
    _check_choice(problems, "--precision", w.precision, Precision)
    _check_choice(problems, "--quant", w.quant, Quant)
    _check_choice(problems, "--teacher-quant", w.teacher_quant, Quant)
    _check_choice(problems, "--teacher-placement", w.teacher_placement, TeacherPlacement)
    _check_choice(problems, "--optimizer", w.optimizer, Optimizer)
    _check_choice(problems, "--attn", w.attn, Attention)
    _check_choice(problems, "--padding", w.padding, Padding)
    _check_choice(problems, "--kv-dtype", w.kv_dtype, KVDType)
    _check_choice(problems, "--loss", w.loss, Loss)
    _check_choice(problems, "--ac mode", w.ac_mode, ACMode)
    if w.ac_mode == "selective" and w.ac_every == 0:
        problems.append("selective checkpointing needs layers to checkpoint: --ac selective or selective-every-K")
    for flag, value, low, high in (("--batch", w.batch, 1, MAX_BATCH), ("--seq", w.seq, 1, MAX_TOKENS),
                                   ("--new-tokens", w.new_tokens, 0, MAX_TOKENS),
                                   ("--grad-accum", w.grad_accum, 1, MAX_BATCH), ("--lora-rank", w.lora_rank, 1, MAX_RANK),
                                   ("--ac every-K", w.ac_every, 0, MAX_RANK),
                                   ("--prefill-chunk", w.prefill_chunk, 0, MAX_TOKENS)):
        if not isinstance(value, int) or isinstance(value, bool) or not low <= value <= high:
            problems.append(f"{flag} must be an integer from {low} to {high:,}, got {value!r}")
    bad_targets = [t for t in w.lora_targets if t not in LORA_TARGETS_ALL + (LORA_EXPERTS,)]
    if bad_targets or not w.lora_targets:
        problems.append(f"--lora-targets {','.join(w.lora_targets)!r}: choose from {','.join(LORA_TARGETS_ALL)} "
                        f"(or 'all'), and {LORA_EXPERTS} for a mixture of experts' fused expert weights")
    repeated = sorted({t for t in w.lora_targets if w.lora_targets.count(t) > 1})
    if repeated:
        problems.append(f"--lora-targets names {', '.join(repeated)} more than once: list each linear once")
    if w.task == "train" and w.quant != "none":
        problems.append(f"full fine-tuning cannot update {w.quant} weights: use --task qlora, or --quant none")
    if w.task == "lora" and w.quant != "none":
        problems.append(f"LoRA on {w.quant} weights is QLoRA: use --task qlora")
    if w.task == "qlora" and w.quant == "none":
        problems.append("qlora needs a quantized base: --quant nf4 (default), int4 or int8")
    problems += _teacher_problems(w)
    if w.task != "infer" and w.prefill_chunk:
        problems.append("--prefill-chunk only applies to --task infer")
    if w.prefill_chunk > 0 and -(-w.seq // w.prefill_chunk) > MAX_PREFILL_CHUNKS:
        smallest = -(-w.seq // MAX_PREFILL_CHUNKS)
        problems.append(f"--prefill-chunk {w.prefill_chunk} splits the {w.seq}-token prompt into "
                        f"{-(-w.seq // w.prefill_chunk)} forwards, each reading every weight; llamem sizes at most "
                        f"{MAX_PREFILL_CHUNKS}: use --prefill-chunk {smallest} or more (512 to 8192 is usual)")
    problems += _optimizer_and_loss_problems(w)
    problems += _compile_problems(w)
    if w.padding != "none" or w.padding_free or w.pad_fraction or w.attn == "flash_attention_2":
        problems += _attention_problems(w)
    problems += _offload_problems(w)
    if w.task == "infer" and w.precision.endswith("-mixed"):
        problems.append(f"inference has no master weights: use --precision {w.precision.removesuffix('-mixed')}")
    if w.task == "qlora" and w.precision.endswith("-mixed"):
        problems.append("QLoRA keeps a quantized base: use --precision bf16 (adapters stay in fp32)")
    return problems


def _teacher_problems(w: Workload) -> list[str]:
    problems = []
    if w.task == "distill" and not w.teacher:
        problems.append("distill needs a teacher: add --teacher MODEL (for example --teacher llama-3.1-70b)")
    if w.task != "distill" and w.teacher:
        problems.append("--teacher only applies to --task distill")
    if w.task != "distill" and w.teacher_quant != "none":
        problems.append("--teacher-quant only applies to --task distill")
    if w.task != "distill" and w.teacher_placement != "auto":
        problems.append("--teacher-placement only applies to --task distill")
    if w.teacher_placement == "sharded" and w.teacher_quant != "none":
        problems.append(f"--teacher-placement sharded shards bf16 weights with fully_shard, not bitsandbytes' "
                        f"{w.teacher_quant} ones: drop --teacher-quant, or use --teacher-placement replicated")
    return problems


AC_SPELLINGS = ("none, full, or every-K (for example every-2); or selective, or selective-every-K (torchtitan's "
                "per-op policy on every layer or on every K-th)")


def _optimizer_and_loss_problems(w: Workload) -> list[str]:
    """Clipping, the optimizer step in backward and Liger's loss, and what they cannot be combined with."""
    problems = []
    norm = w.max_grad_norm
    if isinstance(norm, bool) or not isinstance(norm, (int, float)) or not 0 <= norm < float("inf"):
        problems.append(f"--max-grad-norm must be a number of 0 or more (0: no clipping), got {norm!r}")
    elif w.optimizer_in_backward and norm > 0:
        problems.append("--optimizer-in-backward cannot clip gradients (the total norm needs every gradient at "
                        "once, and each is freed as soon as its parameter is stepped): add --max-grad-norm 0")
    if w.optimizer_in_backward and w.grad_accum > 1:
        problems.append(f"--optimizer-in-backward steps each parameter as soon as its gradient is ready, so "
                        f"gradients cannot accumulate over micro-batches: drop --grad-accum {w.grad_accum} (a larger "
                        "--batch instead), or drop --optimizer-in-backward")
    if w.liger and w.loss != "full":
        problems.append(f"--liger replaces the loss with Liger's fused linear cross-entropy: drop --loss {w.loss}")
    if w.liger and w.task == "distill":
        problems.append("--liger never makes the student's logits, which distillation's KL term needs: drop --liger "
                        "for --task distill")
    return problems


def _attention_problems(w: Workload) -> list[str]:
    """Padded and packed batches and flash_attention_2: what they are sized with (training only)."""
    problems = []
    fraction = w.pad_fraction
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction < 1:
        problems.append(f"--pad-fraction must be a number from 0 to below 1, got {fraction!r}")
    elif fraction and w.padding != "longest":
        problems.append("--pad-fraction only applies to --padding longest")
    if w.padding == "longest" and w.padding_free:
        problems.append("--padding-free packs the sequences into one row without padding: drop --padding longest")
    if w.padding_free and isinstance(w.batch, int) and isinstance(w.seq, int) and w.batch * w.seq > MAX_TOKENS:
        problems.append(f"--padding-free packs --batch x --seq = {w.batch * w.seq:,} tokens into one row; llamem sizes "
                        f"rows up to {MAX_TOKENS:,}: lower --batch or --seq")
    if w.attn == "flash_attention_2" and w.precision.removesuffix("-mixed") == "fp32":
        problems.append("flash_attention_2 runs in bf16 or fp16 only: use --precision bf16-mixed, bf16 or fp16, "
                        "or --attn sdpa")
    for flag, on in (("--padding longest", w.padding == "longest"), ("--padding-free", w.padding_free),
                     ("--attn flash_attention_2", w.attn == "flash_attention_2")):
        if on and w.task == "infer":
            problems.append(f"{flag} is sized for training only: drop it for --task infer")
        if on and w.task == "distill":
            problems.append(f"{flag} is not sized for distillation yet: drop it for --task distill")
        if on and w.compile and flag != "--attn flash_attention_2":  # named by _compile_problems
            problems.append(f"--compile with {flag} is not sized yet: drop one of the two")
    return problems


def _compile_problems(w: Workload) -> list[str]:
    """`--compile` is sized for training only, and not yet with the combinations it was not traced with."""
    if not w.compile:
        return []
    if not isinstance(w.compile, bool):
        return [f"--compile is on or off, got {w.compile!r}"]
    problems = []
    if w.task == "infer":
        problems.append("--compile is sized for training only: drop --compile for --task infer")
    if w.liger:  # the trace emulates Liger in plain torch ops, which the partitioner and inductor would see into
        problems.append("--compile with --liger is not sized: Liger's Triton kernels are opaque to inductor, and "
                        "compiling llamem's emulation of them would size another program; drop one of the two")
    if w.task == "distill":
        problems.append("--compile is not sized for distillation yet: drop --compile for --task distill")
    if w.attn != "sdpa":
        problems.append(f"--compile is sized with SDPA attention: drop --attn {w.attn}")
    return problems


def _offload_problems(w: Workload) -> list[str]:
    """Offloading moves what the checkpoints save: transformers offloads only inside checkpointed layers
    (torchtune refuses offloading without checkpointing), and llamem sizes it with every layer checkpointed."""
    if not w.offload_activations:
        return []
    if not isinstance(w.offload_activations, bool):
        return [f"--offload-activations is on or off, got {w.offload_activations!r}"]
    if w.ac_every == 0:
        return ["--offload-activations moves the checkpointed layers' inputs to host memory: add --ac full"]
    if w.ac_every != 1 or w.ac_mode != "full":
        return [f"--offload-activations is sized with every layer checkpointed: use --ac full instead of "
                f"--ac {w.ac_label}, or drop --offload-activations"]
    if w.compile:
        return ["--compile with --offload-activations is not sized yet: drop one of the two"]
    return []


def parse_ac(text: str) -> int:
    """'none' -> 0, 'full' -> 1, 'every-2' -> 2 (the layers checkpointed; `parse_ac_fields` adds the mode)."""
    return parse_ac_fields(text)["ac_every"]


def parse_ac_fields(text: str) -> dict:
    """The Workload fields of an `--ac` value: 'none' -> ac_every 0, 'full' -> 1, 'every-2' -> 2;
    'selective' -> 1 and 'selective-every-2' -> 2, with ac_mode 'selective' (only then given, so a
    setting refused for a task is named once)."""
    text = str(text).strip().lower()
    mode, rest = ("selective", text.removeprefix("selective-")) if text.startswith("selective-") else ("full", text)
    if text == "selective":
        mode, every = "selective", 1
    elif rest.startswith("every-") and rest[6:].isdigit() and int(rest[6:]) >= 1:
        every = int(rest[6:])
    elif mode == "full" and text in ("none", "off", "0", "full", "on", "1"):
        every = int(text in ("full", "on", "1"))
    else:
        raise InvalidWorkload([f"--ac {text!r}: write {AC_SPELLINGS}"])
    return {"ac_every": every, "ac_mode": mode} if mode == "selective" else {"ac_every": every}


def parse_targets(text: str | None) -> tuple[str, ...]:
    if text is None:
        return LORA_TARGETS_DEFAULT
    if text.strip().lower() == "all":
        return LORA_TARGETS_ALL
    return tuple(t.strip() for t in text.split(",") if t.strip())


FIELD_TASKS: dict[str, tuple[str, ...]] = {
    "task": ALL_TASKS, "batch": ALL_TASKS, "seq": ALL_TASKS, "precision": ALL_TASKS, "quant": ALL_TASKS,
    "attn": ALL_TASKS,
    "new_tokens": ("infer",), "kv_dtype": ("infer",), "prefill_chunk": ("infer",),
    "optimizer": TRAINING_TASKS, "ac_every": TRAINING_TASKS, "ac_mode": TRAINING_TASKS, "grad_accum": TRAINING_TASKS,
    "loss": TRAINING_TASKS, "max_grad_norm": TRAINING_TASKS, "optimizer_in_backward": TRAINING_TASKS,
    "liger": TRAINING_TASKS, "compile": TRAINING_TASKS, "offload_activations": TRAINING_TASKS,
    "padding": TRAINING_TASKS, "pad_fraction": TRAINING_TASKS, "padding_free": TRAINING_TASKS,
    "lora_rank": ADAPTER_TASKS, "lora_targets": ADAPTER_TASKS,
    "teacher": ("distill",), "teacher_quant": ("distill",), "teacher_placement": ("distill",),
}
"""The tasks each Workload field applies to: a setting given for another task is refused, not ignored."""
_FLAGS = {"ac_every": "--ac", "ac_mode": "--ac"}


FLAG_FIELDS = ("optimizer_in_backward", "liger", "compile", "offload_activations", "padding_free")
"""Workload fields set by an on/off flag."""


TRAINER_DEFAULTS = dict(precision="bf16", optimizer="adamw-fused", max_grad_norm=1.0)
"""What `AutoModelForCausalLM.from_pretrained(name)` + `Trainer(model, TrainingArguments())` train with in
transformers 5.24 (checked in its source):
- `from_pretrained`'s `dtype` defaults to "auto" (`modeling_utils.py`: `if dtype is None: dtype = "auto"`),
  which takes the checkpoint's `config.json` dtype: bfloat16 for the Llama, Mistral and Qwen checkpoints
  (e.g. meta-llama/Llama-3.1-8B's `"torch_dtype": "bfloat16"`), so the weights, and torch AdamW's
  moments with them, are bf16, with no fp32 master copy;
- `TrainingArguments.bf16` and `fp16` default to False: no autocast (pure bf16, not `bf16-mixed`);
- `TrainingArguments.optim` defaults to "adamw_torch_fused" on torch >= 2.8 (`training_args.py`:
  `default_optim`), torch's fused AdamW step (`adamw-fused`, no step temporaries);
- `TrainingArguments.max_grad_norm` defaults to 1.0: `clip_grad_norm_` before every step.
The same for LoRA and QLoRA (peft keeps its adapters in fp32 under a bf16 base)."""


def task_defaults(task: str) -> dict:
    if task == "infer":
        return dict(precision="bf16", new_tokens=256)
    if task == "qlora":
        return dict(TRAINER_DEFAULTS, quant="nf4")
    return dict(TRAINER_DEFAULTS)  # train, distill, lora


def build_workload(task: str = "train", **given) -> Workload:
    """Workload from user options; None means 'the task's default'. Settings that the task
    would silently ignore are refused, all at once."""
    # An on/off flag left off (`--no-liger`) asks for nothing, whichever the task.
    given = {k: v for k, v in given.items() if v is not None and not (v is False and k in FLAG_FIELDS)}
    problems = []
    for key, tasks in FIELD_TASKS.items():
        if key in given and task not in tasks and key not in ("teacher", "teacher_quant", "teacher_placement"):
            flag = _FLAGS.get(key, "--" + key.replace("_", "-"))
            problems.append(f"{flag} only applies to --task {' / '.join(tasks)}, not {task}")
    if problems:
        raise InvalidWorkload(list(dict.fromkeys(problems)))  # --ac sets two fields: named once
    options = {**task_defaults(task), **given}
    if options.get("optimizer_in_backward") and "max_grad_norm" not in given:
        options["max_grad_norm"] = 0.0  # torchtune's optimizer in backward does not clip
    if "kv_dtype" not in options and task == "infer":
        precision = options["precision"]
        options["kv_dtype"] = "fp32" if precision == "fp32" else precision.removesuffix("-mixed")
    return Workload(task=task, **options)


def with_changes(workload: Workload, **changes) -> Workload:
    return replace(workload, **changes)
