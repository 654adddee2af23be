"""Build the transformers model for a ModelSpec + Workload the way a user would, on fake tensors.

The model and its peft adapters are built on the meta device, then materialised with
`to_empty` inside FakeTensorMode, so no weight is ever read and no byte is really allocated.
(Applying peft or `.to()` to fake parameters fails: "_apply(): Couldn't swap Linear.weight".)
"""

from __future__ import annotations

import torch
from torch import nn

from llamem.model import HF_CLASSES, ModelSpec
from llamem.trace.padding import configure
from llamem.workload import Workload

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# bitsandbytes' 4-bit blocksize and its fp32 absmax per block (double quantization off);
# LLM.int8 keeps one fp32 scale per output row.
NF4_BLOCK = 64


class EmulatedQuantLinear(nn.Module):
    """Stands in for bitsandbytes' Linear4bit / Linear8bitLt, which cannot run on fake tensors.

    It holds exactly the bytes bitsandbytes holds (packed weight + scales) and, like its
    matmul, dequantizes the whole weight to the compute dtype for each forward and again
    for the backward, keeping nothing for backward but the packed weight.
    """

    def __init__(self, base: nn.Linear, quant: str, compute_dtype: torch.dtype):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.compute_dtype = compute_dtype
        numel = base.in_features * base.out_features
        if quant == "int8":
            self.register_buffer("qweight", torch.empty(numel, dtype=torch.int8, device="meta"))
            self.register_buffer("scales", torch.empty(base.out_features, dtype=torch.float32, device="meta"))
        else:  # nf4 / int4: two values per byte, one fp32 absmax per block of 64
            self.register_buffer("qweight", torch.empty((numel + 1) // 2, dtype=torch.uint8, device="meta"))
            self.register_buffer("scales", torch.empty(-(-numel // NF4_BLOCK), dtype=torch.float32, device="meta"))
        self.bias = base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _DequantMatmul.apply(x, self.qweight, self.out_features, self.in_features, self.compute_dtype)


class _DequantMatmul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, qweight, out_features, in_features, dtype):
        ctx.shape, ctx.dtype, ctx.qweight = (out_features, in_features), dtype, qweight
        weight = torch.empty((out_features, in_features), dtype=dtype, device=x.device)  # dequantized copy
        return x.to(dtype) @ weight.t()

    @staticmethod
    def backward(ctx, grad):
        weight = torch.empty(ctx.shape, dtype=ctx.dtype, device=grad.device)
        return grad @ weight, None, None, None, None


def hf_config(spec: ModelSpec, workload: Workload):
    import transformers

    fields = {k: v for k, v in spec.config.items() if k not in ("torch_dtype", "dtype", "architectures", "model_type")}
    config = getattr(transformers, HF_CLASSES[spec.model_type][0])(**fields)
    config._attn_implementation = workload.attn
    configure(config, workload)  # flash_attention_2: the emulated kernels (`llamem.trace.flash`)
    return config


def hf_model_class(spec: ModelSpec):
    import transformers

    return getattr(transformers, HF_CLASSES[spec.model_type][1])


def check_moe_workload(spec: ModelSpec, workload: Workload) -> None:
    """Workloads a mixture of experts cannot run as transformers builds it (`analytic/moe.py`)."""
    from llamem.analytic.moe import transformers_moe_problems
    from llamem.errors import InvalidWorkload

    problems = transformers_moe_problems(spec, workload)
    if problems:
        raise InvalidWorkload(problems)


def build_meta_model(spec: ModelSpec, workload: Workload, *, dtype: torch.dtype | None = None):
    """The model as a user would have it just before training or generation, on meta."""
    check_moe_workload(spec, workload)
    cls = hf_model_class(spec)
    with torch.device("meta"):
        model = cls(hf_config(spec, workload))
    model.to(dtype or TORCH_DTYPES[workload.weight_dtype])
    if workload.quant != "none":
        _quantize_linears(model, workload)
    if workload.uses_adapters:
        model = _add_lora(model, workload)
    if workload.ac_every:
        kwargs = None
        if workload.selective_ac:
            from llamem.trace.selective import checkpoint_kwargs

            kwargs = checkpoint_kwargs()
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs, every_n_layers=workload.ac_every)
    model.train(workload.is_training)
    return model


def _quantize_linears(model: nn.Module, workload: Workload) -> None:
    """Replace every decoder-layer Linear, as bitsandbytes' `load_in_4bit/8bit` does (lm_head stays)."""
    compute = TORCH_DTYPES[workload.compute_dtype]
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, EmulatedQuantLinear(child, workload.quant, compute))


def _add_lora(model: nn.Module, workload: Workload):
    from peft import LoraConfig, get_peft_model

    if workload.quant != "none":
        # peft only wraps the Linear types it knows; wrap our stand-in as a plain custom module.
        return _add_lora_on_emulated(model, workload)
    from llamem.analytic.moe_lora import lora_linear_targets, peft_target_parameters

    # The fused 3-D experts are parameters, not Linear modules: peft adapts them through target_parameters.
    config = LoraConfig(r=workload.lora_rank, lora_alpha=2 * workload.lora_rank,
                        target_modules=list(lora_linear_targets(workload)),
                        target_parameters=list(peft_target_parameters(workload)) or None, lora_dropout=0.0)
    return get_peft_model(model, config)


class LoraOnQuant(nn.Module):
    """peft's LoRA forward around a quantized base: fp32 adapters, input cast to fp32."""

    def __init__(self, base: EmulatedQuantLinear, rank: int):
        super().__init__()
        self.base_layer = base
        self.lora_A = nn.Linear(base.in_features, rank, bias=False, device="meta", dtype=torch.float32)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False, device="meta", dtype=torch.float32)
        self.scaling = 2.0

    def forward(self, x):
        result = self.base_layer(x)
        dtype = result.dtype
        lora = self.lora_B(self.lora_A(x.to(self.lora_A.weight.dtype))) * self.scaling
        return (result + lora).to(dtype)


def _add_lora_on_emulated(model: nn.Module, workload: Workload):
    for param in model.parameters():
        param.requires_grad_(False)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if name in workload.lora_targets:
                    setattr(parent, name, LoraOnQuant(child, workload.lora_rank))
    return model


def materialise(model, device: str):
    """`to_empty` on `device`, allocating a tied head once (as from_pretrained does): the head
    shares the embedding's storage, so it is detached first and tied back after."""
    tied = getattr(model.config, "tie_word_embeddings", False)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if tied:
        base.lm_head._parameters.pop("weight")
    model = model.to_empty(device=device)
    if tied:
        base.lm_head.weight = base.model.embed_tokens.weight
    return model


LIGER_IGNORE_INDEX = -100


class EmulatedLigerLinearCrossEntropy(torch.autograd.Function):
    """Liger-Kernel's `LigerFusedLinearCrossEntropyFunction` (ops/fused_linear_cross_entropy.py),
    which needs Triton on a GPU: the same buffers and matmuls in the same order, with the same
    locals (a chunk's logits live until the next chunk's exist). Its Triton kernel, which writes
    the loss and the logits' gradient into the logits in place, allocates nothing and is left out;
    so is the host sync of `.item()`. Mean reduction, no bias, as transformers' Llama calls it."""

    @staticmethod
    def forward(ctx, x, weight, target):
        from llamem.analytic.liger import liger_chunk_rows

        tokens, vocab = x.shape[0], weight.shape[0]
        chunk_size = liger_chunk_rows(tokens, vocab, x.shape[1])
        grad_input = torch.zeros_like(x)
        grad_weight = torch.zeros_like(weight) if weight.requires_grad else None
        loss_1d = torch.zeros(tokens, dtype=torch.float32, device=x.device)
        target_mask = target != LIGER_IGNORE_INDEX
        target_mask.sum()  # Liger reads it with .item(): the scalar dies at once
        for start in range(0, tokens, chunk_size):
            input_chunk_view = x[start:start + chunk_size]
            logits_chunk = input_chunk_view @ weight.t()  # autocast casts the view anew each chunk
            grad_input[start:start + chunk_size] = logits_chunk @ weight  # the weight's cast is cached
            if grad_weight is not None:  # Liger's local: the cast lives until the next chunk's
                input_chunk = _liger_weight_gradient(grad_weight, logits_chunk, input_chunk_view)  # noqa: F841
        loss = torch.sum(loss_1d)
        ctx.save_for_backward(grad_input, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        torch.ones((), device=grad_output.device)  # `torch.equal(grad_output, torch.tensor(1.0))`
        grad_input, grad_weight = ctx.saved_tensors  # scaled in place by grad_output when it is not 1
        return grad_input, grad_weight, None


def _liger_weight_gradient(grad_weight, logits_chunk, input_chunk):
    """`grad_weight += logits.t() @ input`: on Ampere and later an fp32 weight gradient (autocast) is
    accumulated in place by `addmm(..., out_dtype=float32)` after a cast of the input chunk; otherwise
    `mm(...).float()` makes the product and its fp32 copy. Returns the local Liger keeps."""
    if grad_weight.dtype == torch.float32 and logits_chunk.dtype in (torch.float16, torch.bfloat16):
        return input_chunk.to(logits_chunk.dtype)  # the addmm itself writes into grad_weight
    grad_weight += torch.mm(logits_chunk.t(), input_chunk).float()
    return input_chunk


def liger_loss(hidden, weight, labels):
    """Liger's `LigerForCausalLMLoss`: the labels padded and shifted (a contiguous copy), the hidden
    states flattened, then the fused linear cross-entropy."""
    padded = torch.nn.functional.pad(labels, (0, 1), value=LIGER_IGNORE_INDEX)
    shift_labels = padded[..., 1:].contiguous()
    return EmulatedLigerLinearCrossEntropy.apply(hidden.view(-1, hidden.shape[-1]), weight, shift_labels.view(-1))
