"""Run a workload on fake tensors under the storage tracer and return a MemoryReport.

Training runs two optimizer steps (the first creates the optimizer state; phases are
recorded on the second, the steady state). Inference runs a prefill and the decode steps
with the transformers DynamicCache, as `generate` does.
"""

from __future__ import annotations

import contextlib
import gc
import math
import warnings

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from llamem.analytic.attention_paths import attention_notes
from llamem.model import ModelSpec
from llamem.report import MemoryReport
from llamem.trace.build import TORCH_DTYPES, build_meta_model, materialise
from llamem.trace.liger_kernels import LIGER_NUM_SMS, liger_rope, patch_model
from llamem.trace.padding import batch_inputs, real_packing_check
from llamem.trace.tracer import StorageTracer
from llamem.workload import LOSS_CHUNKS, Workload

TRAIN_PHASES = ["load", "forward", "backward", "optimizer"]
INFER_PHASES = ["load", "prefill", "decode"]
TRACED_MICRO_BATCHES = 2
"""Accumulation steps traced per optimizer step: the second and every later one are alike."""
BNB_MIN_8BIT_SIZE = 4096
BNB_BLOCK = 256


def trace(spec: ModelSpec, workload: Workload, teacher: ModelSpec | None = None) -> MemoryReport:
    warnings.filterwarnings("ignore")
    # Start every trace from a collected heap: garbage an earlier trace left in cycles is not counted here.
    gc.collect()
    notes: list[str] = []
    if workload.task == "distill" and teacher is None:
        from llamem.model import load_model

        teacher = load_model(workload.teacher)
    from llamem.analytic.engine import check_teacher

    check_teacher(spec, teacher)
    model = build_meta_model(spec, workload)
    teacher_model = build_meta_model(teacher, _teacher_workload(workload), dtype=torch.bfloat16) if teacher else None
    tracer = _compiled().CompiledTracer() if workload.compile else StorageTracer()
    if workload.liger:  # Liger's RMSNorm and SwiGLU (its loss and RoPE are swapped in where they run)
        patch_model(model)
    with (FakeTensorMode(allow_non_fake_inputs=True), tracer, _recompute_labels(tracer),
          liger_rope(model, workload.liger), real_packing_check(workload)):
        model = _materialise(model, tracer, "weights")
        if teacher_model is not None:
            teacher_model = _materialise(teacher_model, tracer, "weights/teacher").eval()
            label_by_module(teacher_model, tracer)
        if workload.compile:  # module hooks do not fire inside a compiled graph: its nodes are labelled
            _compiled().compile_model(model, workload, tracer)
        else:
            label_by_module(model, tracer)
        if workload.offload_activations:
            from llamem.trace.offload import install_offload

            install_offload(model, tracer)
        if workload.is_training:
            optimizer = make_optimizer(model, workload, notes, tracer)
            train_steps(model, teacher_model, optimizer, workload, spec, tracer)
            phases = TRAIN_PHASES
        else:
            generate_steps(model, workload, spec, tracer)
            phases = INFER_PHASES
    if workload.compile:
        notes += _compiled().compile_notes(tracer)
    if workload.liger:
        notes.append("liger: Liger-Kernel's fused linear cross-entropy, RMSNorm, SwiGLU and RoPE emulated byte for "
                     f"byte (its Triton kernels cannot run on a CPU); RMSNorm's backward sized for {LIGER_NUM_SMS} SMs")
    notes += attention_notes(workload)
    if workload.quant != "none":
        notes.append(f"{workload.quant} layers emulated with bitsandbytes' exact byte counts "
                     "(bitsandbytes cannot run on fake tensors)")
    if workload.task == "infer" and workload.kv_dtype != workload.compute_dtype:
        notes.append(f"KV cache traced in {workload.compute_dtype}: a {workload.kv_dtype} cache (QuantizedCache) needs "
                     "optimum-quanto or hqq; the analytic engine counts it")
    extra = {"events": tracer, "num_events": len(tracer.events)}
    if workload.offload_activations:
        from llamem.analytic.offload import offload_note

        extra["host_bytes"] = tracer.host_phase_peaks(phases)
        notes.append(offload_note(extra["host_bytes"], "traced with save_on_cpu's copies"))
    return MemoryReport(model=spec, workload=workload, engine="trace", phases=tracer.phase_peaks(phases),
                        notes=tuple(notes), extra=extra)


def _compiled():
    """`--compile`'s module (imports dynamo and AOT autograd: only when asked for)."""
    from llamem.trace import compiled

    return compiled


@contextlib.contextmanager
def _recompute_labels(tracer: StorageTracer):
    """Checkpointing's recompute makes activations, even when it stops early (torch raises inside
    the layer's forward to stop, so module hooks cannot tell when it ends; its context can)."""
    import torch.utils.checkpoint as checkpoint

    original = checkpoint._recomputation_hook

    class LabelledRecomputation(original):
        def __enter__(self):
            self._saved = (tracer.category, len(tracer.stack))
            tracer.category = "activations"
            return super().__enter__()

        def __exit__(self, *exc):
            tracer.category, depth = self._saved
            del tracer.stack[depth:]
            return super().__exit__(*exc)

    checkpoint._recomputation_hook = LabelledRecomputation
    try:
        yield
    finally:
        checkpoint._recomputation_hook = original


def _teacher_workload(workload: Workload) -> Workload:
    """The teacher is built like a bf16 generation model, quantized as `--teacher-quant` says."""
    return Workload(task="infer", precision="bf16", attn=workload.attn, quant=workload.teacher_quant)


def _materialise(model, tracer: StorageTracer, category: str):
    tracer.phase, tracer.category = "load", category
    model = materialise(model, "cpu")
    for name, param in model.named_parameters():
        tracer.label(param, "weights/adapters" if "lora_" in name else category)
    for name, buffer in model.named_buffers():
        tracer.label(buffer, "weights/quant_scales" if name.endswith("scales") else category)
    return model


def _decoder(model):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.model


def label_by_module(model, tracer: StorageTracer) -> None:
    """Label allocations by where they happen: decoder modules make activations, the head makes logits."""
    decoder = _decoder(model)
    stack = tracer.stack

    def enter(module, args):
        stack.append(tracer.category)
        tracer.category = "activations" if torch.is_grad_enabled() else "temporaries"

    def leave(module, args, output):
        tracer.category = stack.pop()

    # Checkpointing wraps a layer's forward, not __call__: hook the submodules so a recompute is seen too.
    for layer in decoder.layers:
        mlp = layer.feed_forward if hasattr(layer, "feed_forward") else layer.mlp  # Llama 4 names it feed_forward
        for sub in (layer, layer.self_attn, mlp, layer.input_layernorm, layer.post_attention_layernorm):
            sub.register_forward_pre_hook(enter)
            sub.register_forward_hook(leave)
    def after_embedding(module, args, output):
        # The decoder's own work (RoPE, masks) until the first layer counts as the layers' do.
        stack.pop()
        tracer.category = "activations" if torch.is_grad_enabled() else "temporaries"

    decoder.embed_tokens.register_forward_pre_hook(enter)
    decoder.embed_tokens.register_forward_hook(after_embedding)

    def after_final_norm(module, args, output):
        tracer.category = "logits"
        if output.requires_grad:
            # Backward reaches the decoder once the head's gradients are done: from here on, temporaries.
            output.register_hook(lambda grad: setattr(tracer, "category", "temporaries"))

    decoder.norm.register_forward_pre_hook(lambda m, a: setattr(
        tracer, "category", "activations" if torch.is_grad_enabled() else "temporaries"))
    decoder.norm.register_forward_hook(after_final_norm)


class Emulated8bitAdamW(torch.optim.Optimizer):
    """bitsandbytes AdamW8bit's state, byte for byte: uint8 moments with one fp32 absmax per block
    of 256 for tensors of at least 4096 elements, fp32 moments below. Its fused kernel updates in place."""

    def __init__(self, params, lr=1e-4):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float32)
                    if param.numel() >= BNB_MIN_8BIT_SIZE:
                        blocks = math.ceil(param.numel() / BNB_BLOCK)
                        state["state1"] = torch.zeros_like(param, dtype=torch.uint8)
                        state["state2"] = torch.zeros_like(param, dtype=torch.uint8)
                        state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=param.device)
                        state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=param.device)
                    else:
                        state["state1"] = torch.zeros_like(param, dtype=torch.float32)
                        state["state2"] = torch.zeros_like(param, dtype=torch.float32)
                param.add_(param.grad, alpha=-group["lr"])


class EmulatedAdafactor(torch.optim.Optimizer):
    """torch.optim.Adafactor's state and its step's temporaries, without its `.item()` calls
    (data-dependent, impossible on fake tensors): row and column second moments per matrix,
    a full one per vector, and one update tensor per parameter, all alive together (foreach)."""

    def __init__(self, params, lr=1e-2):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        for param in params:
            state = self.state[param]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                if param.dim() > 1:
                    state["row_var"] = param.new_zeros(param.shape[:-1]).unsqueeze(-1)
                    state["col_var"] = param.new_zeros(param.shape[:-2] + param.shape[-1:]).unsqueeze(-2)
                else:
                    state["variance"] = torch.zeros_like(param)
        for multidim in (True, False):
            group = [p for p in params if (p.dim() > 1) == multidim]
            if not group:  # LoRA trains matrices only: no vectors
                continue
            updates = [self.state[p]["row_var"] @ self.state[p]["col_var"] if multidim
                       else self.state[p]["variance"].clone() for p in group]
            torch._foreach_mul_(updates, [p.grad for p in group])
            torch._foreach_add_(group, updates)
            del updates


ADAMW_STEPS = {"adamw": {"foreach": True}, "adamw-fused": {"fused": True}, "adamw-loop": {"foreach": False}}
"""torch AdamW's three implementations of the step, as `--optimizer` names them."""


class InBackwardOptimizer:
    """torchtune's optimizer in backward (`training.register_optim_in_bwd_hooks`): one optimizer per
    parameter, stepped and zeroed by the parameter's post-accumulate-grad hook, so each gradient is
    freed as soon as its parameter is updated; `step` and `zero_grad` have nothing left to do."""

    def __init__(self, params, make_one, tracer=None):
        self.optimizers = {param: make_one([param]) for param in params}
        self.tracer = tracer
        for param in params:
            param.register_post_accumulate_grad_hook(self._step)

    def _step(self, param) -> None:
        tracer = self.tracer
        if tracer is not None:
            tracer.label(param.grad, "gradients")
            saved, tracer.category = tracer.category, "temporaries"
        optimizer = self.optimizers[param]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if tracer is not None:
            label_optimizer_state(optimizer, tracer)
            tracer.category = saved

    @property
    def state(self) -> dict:
        return {param: state for optimizer in self.optimizers.values() for param, state in optimizer.state.items()}

    def step(self) -> None:
        """Every parameter was stepped in backward."""

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Every gradient was freed in backward."""


def make_optimizer(model, workload: Workload, notes: list[str], tracer=None):
    params = [p for p in model.parameters() if p.requires_grad]
    make_one = _optimizer_factory(workload, notes)
    if workload.optimizer_in_backward:
        notes.append("optimizer in backward: one optimizer per parameter, stepped as its gradient is ready")
        return InBackwardOptimizer(params, make_one, tracer)
    return make_one(params)


def _optimizer_factory(workload: Workload, notes: list[str]):
    if workload.optimizer in ADAMW_STEPS:
        return lambda params: torch.optim.AdamW(params, lr=1e-4, **ADAMW_STEPS[workload.optimizer])
    if workload.optimizer == "sgd":
        return lambda params: torch.optim.SGD(params, lr=1e-4, momentum=0.9, foreach=True)
    if workload.optimizer == "adafactor":
        notes.append("adafactor: torch.optim.Adafactor's state and step temporaries emulated "
                     "(its step reads tensor values, impossible on fake tensors)")
        return EmulatedAdafactor
    notes.append("adamw8bit: bitsandbytes' state emulated byte for byte (its kernels cannot run on fake tensors)")
    return Emulated8bitAdamW


def label_optimizer_state(optimizer, tracer) -> None:
    for state in optimizer.state.values():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tracer.label(value, f"optimizer/{key}")


def _autocast(workload: Workload, device: str = "cpu"):
    if workload.mixed:
        return torch.autocast(device, dtype=TORCH_DTYPES[workload.compute_dtype])
    return contextlib.nullcontext()


def _inputs(workload: Workload, spec: ModelSpec, tracer: StorageTracer, device: str = "cpu"):
    tracer.category = "inputs"
    ids = torch.randint(0, spec.vocab_size, (workload.batch, workload.seq), device=device)
    tracer.label(ids, "inputs")
    return ids


def _loss(model, teacher, batch: dict, workload: Workload):
    ids = batch["input_ids"]
    if workload.liger:
        return _liger_loss(model, batch)
    if workload.loss == "chunked":
        return _chunked_loss(model, batch)
    if teacher is None:
        return model(**batch, labels=ids).loss
    with torch.no_grad():
        teacher_logits = teacher(**batch).logits
    out = model(**batch, labels=ids)
    return 0.5 * out.loss + 0.5 * _kl(out.logits, teacher_logits)


def _kl(student_logits, teacher_logits):
    """Forward KL on fp32 upcasts, as distillation recipes compute it."""
    student = torch.nn.functional.log_softmax(student_logits.float(), dim=-1)
    teacher = torch.nn.functional.log_softmax(teacher_logits.float(), dim=-1)
    return torch.nn.functional.kl_div(student, teacher, log_target=True, reduction="batchmean")


def _liger_loss(model, batch: dict):
    """Liger's `lce_forward` in training: the decoder's hidden states go to the fused linear
    cross-entropy with the head's weight; no logits are returned."""
    from llamem.trace.build import liger_loss

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    hidden = base.model(**batch).last_hidden_state
    return liger_loss(hidden, base.lm_head.weight, batch["input_ids"])


def _chunked_loss(model, batch: dict):
    """torchtune's CEWithChunkedOutputLoss: the head runs per chunk, each chunk upcast on its own."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    ids = batch["input_ids"]
    hidden = base.model(**batch).last_hidden_state
    labels = torch.nn.functional.pad(ids, (0, 1), value=-100)[..., 1:]
    total = 0.0
    for h_chunk, y_chunk in zip(hidden.chunk(LOSS_CHUNKS, dim=1), labels.chunk(LOSS_CHUNKS, dim=1)):
        logits = base.lm_head(h_chunk).float()
        total = total + torch.nn.functional.cross_entropy(logits.flatten(0, 1), y_chunk.flatten(), reduction="sum")
    return total / ids.numel()


def train_steps(model, teacher, optimizer, workload: Workload, spec: ModelSpec, tracer: StorageTracer,
           device: str = "cpu") -> None:
    trainable = [p for p in model.parameters() if p.requires_grad]
    for step in range(2):
        # From the second micro-batch on every one is alike (earlier gradients exist, new ones are added
        # in place), so two stand for any number of accumulation steps.
        for _micro in range(min(workload.grad_accum, TRACED_MICRO_BATCHES)):
            tracer.phase = "forward" if step else "warmup"
            batch = batch_inputs(workload, spec, tracer, device)
            tracer.category = "activations"
            with _autocast(workload, device):
                loss = _loss(model, teacher, batch, workload) / workload.grad_accum
            tracer.phase, tracer.category = ("backward" if step else "warmup"), "logits"
            loss.backward()
            del loss, batch
            for param in trainable:
                if param.grad is not None:
                    tracer.label(param.grad, "gradients")
        tracer.phase, tracer.category = ("optimizer" if step else "warmup"), "temporaries"
        if workload.max_grad_norm > 0:  # as the Trainer clips: foreach on a GPU
            torch.nn.utils.clip_grad_norm_(trainable, workload.max_grad_norm, foreach=True)
        optimizer.step()
        label_optimizer_state(optimizer, tracer)
        optimizer.zero_grad(set_to_none=True)
        if workload.compile and not step:  # the step that compiled: free what compiling pinned
            _compiled().release_compile_cycles()


def generate_steps(model, workload: Workload, spec: ModelSpec, tracer: StorageTracer, device: str = "cpu") -> None:
    from transformers import DynamicCache

    model.eval()
    with torch.no_grad():
        tracer.phase = "prefill"
        ids = _inputs(workload, spec, tracer, device)
        cache = DynamicCache(config=model.config)
        tracer.category = "temporaries"
        # generate()'s _prefill: the prompt in chunks when prefill_chunk_size is set, the previous
        # chunk's output alive until the next one returns.
        chunk = workload.prefill_step
        for start in range(0, workload.seq, chunk):
            out = model(input_ids=ids[:, start:start + chunk], cache=cache, use_cache=True, logits_to_keep=1)
            _label_cache(cache, tracer)
        for _ in range(max(workload.new_tokens - 1, 0)):
            # generate(): an fp32 copy of the last logits, then the next token.
            next_ids = out.logits[:, -1, :].to(copy=True, dtype=torch.float32).argmax(-1, keepdim=True)
            del out
            tracer.phase, tracer.category = "decode", "temporaries"
            out = model(input_ids=next_ids, cache=cache, use_cache=True, logits_to_keep=1)
            _label_cache(cache, tracer)
        del out


def _label_cache(cache, tracer: StorageTracer) -> None:
    for layer in cache.layers:
        for tensor in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if isinstance(tensor, torch.Tensor):
                tracer.label(tensor, "kv_cache")
