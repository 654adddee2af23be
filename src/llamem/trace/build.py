"""Build the transformers model for a ModelSpec + Workload the way a user would, on fake tensors.

The model and its peft adapters are built on the meta device, then materialised with
`to_empty` inside FakeTensorMode, so no weight is ever read and no byte is really allocated.
(Applying peft or `.to()` to fake parameters fails: "_apply(): Couldn't swap Linear.weight".)
"""

from __future__ import annotations

import torch
from torch import nn

from llamem.model import ModelSpec
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
    from transformers import LlamaConfig, MistralConfig

    fields = {k: v for k, v in spec.config.items() if k not in ("torch_dtype", "dtype", "architectures")}
    cls = MistralConfig if spec.model_type == "mistral" else LlamaConfig
    config = cls(**fields)
    config._attn_implementation = workload.attn
    return config


def build_meta_model(spec: ModelSpec, workload: Workload, *, dtype: torch.dtype | None = None):
    """The model as a user would have it just before training or generation, on meta."""
    from transformers import LlamaForCausalLM, MistralForCausalLM

    cls = MistralForCausalLM if spec.model_type == "mistral" else LlamaForCausalLM
    with torch.device("meta"):
        model = cls(hf_config(spec, workload))
    model.to(dtype or TORCH_DTYPES[workload.weight_dtype])
    if workload.quant != "none":
        _quantize_linears(model, workload)
    if workload.uses_adapters:
        model = _add_lora(model, workload)
    if workload.ac_every:
        model.activation_checkpointing_enable(every_n_layers=workload.ac_every)
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
    config = LoraConfig(r=workload.lora_rank, lora_alpha=2 * workload.lora_rank,
                        target_modules=list(workload.lora_targets), lora_dropout=0.0)
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
