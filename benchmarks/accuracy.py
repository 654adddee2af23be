"""Accuracy harness: the analytic engine against the trace engine over a matrix of workloads.

Prints one row per workload (peak error, worst category) and writes JSON.
Usage: python benchmarks/accuracy.py [--out benchmarks/results/accuracy.json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings

from llamem.model import load_model
from llamem.trace.compare import compare
from llamem.workload import build_workload

warnings.filterwarnings("ignore")

# Reduced layer counts keep traces quick; every per-layer term is exact, so nothing is lost.
MODELS = {
    "debug": {},
    "tinyllama-1.1b": {"num_hidden_layers": 2},
    "llama-3.2-1b": {"num_hidden_layers": 2},
    "llama-2-7b": {"num_hidden_layers": 2},
    "llama-3.1-8b": {"num_hidden_layers": 2},
}


def matrix() -> list[tuple[str, dict]]:
    rows: list[tuple[str, dict]] = []
    for model in MODELS:
        rows += [
            (model, dict(task="train", batch=1, seq=512)),
            (model, dict(task="train", precision="bf16", batch=2, seq=1024)),
            (model, dict(task="lora", batch=2, seq=2048)),
            (model, dict(task="qlora", batch=1, seq=1024)),
            (model, dict(task="infer", batch=2, seq=1024, new_tokens=4)),
        ]
    for model in ("debug", "tinyllama-1.1b", "llama-3.2-1b"):
        rows += [
            (model, dict(task="train", precision="fp32", batch=1, seq=256)),
            (model, dict(task="train", precision="fp16", batch=1, seq=512)),
            (model, dict(task="train", optimizer="sgd", batch=1, seq=512)),
            (model, dict(task="train", optimizer="adafactor", batch=1, seq=512)),
            (model, dict(task="train", optimizer="adamw8bit", batch=1, seq=512)),
            (model, dict(task="train", attn="eager", batch=1, seq=256)),
            (model, dict(task="train", precision="bf16", attn="eager", batch=2, seq=128)),
            (model, dict(task="train", precision="bf16", ac_every=1, batch=2, seq=512)),
            (model, dict(task="train", ac_every=1, batch=1, seq=1024)),
            (model, dict(task="lora", ac_every=1, batch=1, seq=1024)),
            (model, dict(task="train", grad_accum=2, batch=1, seq=256)),
            (model, dict(task="train", loss="chunked", batch=1, seq=1024)),
            (model, dict(task="lora", lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                    "down_proj"), lora_rank=16, batch=1, seq=512)),
            (model, dict(task="qlora", quant="int8", batch=1, seq=512)),
            (model, dict(task="infer", batch=1, seq=4096, new_tokens=2)),
            (model, dict(task="infer", precision="fp16", batch=4, seq=256, new_tokens=8)),
            (model, dict(task="infer", batch=2, seq=1024, new_tokens=4, prefill_chunk=256)),
            (model, dict(task="infer", attn="eager", batch=1, seq=1000, new_tokens=3, prefill_chunk=300)),
        ]
    rows += [("debug", dict(task="distill", teacher="debug", batch=1, seq=256)),
             ("llama-3.2-1b", dict(task="distill", teacher="llama-3.2-3b", batch=1, seq=256))]
    rows += selective_rows()
    rows += every_k_rows()
    rows += liger_checkpointing_rows()
    rows += partial_lora_rows()
    rows += family_rows()
    rows += moe_rows()
    rows += llama4_rows()
    rows += moe_lora_rows()
    rows += optimizer_rows()
    rows += compile_rows()
    rows += padding_rows()
    rows += offload_rows()
    rows += chunked_loss_rows()
    rows += lora_chunked_rows()
    return rows


def chunked_loss_rows() -> list[tuple[str, dict]]:
    """The chunked loss without autocast (`analytic/logits.py`): fp32 (the head output is its own upcast);
    16-bit with a frozen head, past one sequence (each chunk copied, the forward the peak); 16-bit with a
    trained head, tied (the embedding's backward the peak) and untied."""
    sgd, adamw = dict(optimizer="sgd", loss="chunked"), dict(optimizer="adamw", loss="chunked")
    return [("debug", dict(task="train", precision="fp32", **sgd, batch=1, seq=1024)),
            ("debug", dict(task="lora", precision="bf16", **adamw, batch=2, seq=512)),
            ("tinyllama-1.1b", dict(task="train", precision="bf16", **sgd, batch=1, seq=256)),
            ("llama-3.2-1b", dict(task="lora", precision="fp16", **adamw, batch=1, seq=256))]


def lora_chunked_rows() -> list[tuple[str, dict]]:
    """LoRA under autocast over fp32 weights with the chunked loss (`analytic/logits.py`, `weights.py`): the
    frozen head cast again for each chunk; past one sequence (debug, the CI subset); tied, the loss's
    backward the peak; checkpointed, only the head's casts and the adapters' outliving the layers."""
    lora = dict(task="lora", precision="bf16-mixed", optimizer="adamw", loss="chunked")
    return [("debug", dict(lora, batch=2, seq=256)),
            ("llama-3.2-1b", dict(lora, batch=1, seq=1024)),
            ("llama-3.1-8b", dict(lora, batch=1, seq=2048, ac_every=1))]


def padding_rows() -> list[tuple[str, dict]]:
    """Padded batches (`--padding longest`: SDPA's and eager's materialised masks, flash_attention_2's
    unpadded copies), packed ones (`--padding-free`) and flash_attention_2 (emulated flash-attn), with and
    without checkpointing, full fine-tuning and LoRA, and Liger's kernels with them. The first three rows
    join the CI subset."""
    rows = [("debug", dict(task="train", precision="bf16", batch=2, seq=256, padding="longest")),
            ("debug", dict(task="train", precision="bf16", batch=2, seq=256, attn="flash_attention_2",
                           padding="longest", pad_fraction=0.25)),
            ("debug", dict(task="train", precision="bf16", batch=2, seq=256, attn="flash_attention_2",
                           padding_free=True))]
    rows += [(m, dict(task=t, **o)) for m, t, o in (
        ("tinyllama-1.1b", "train", dict(batch=2, seq=1024, padding="longest")),
        ("tinyllama-1.1b", "train", dict(batch=2, seq=1024, padding="longest", ac_every=1)),
        ("tinyllama-1.1b", "train", dict(precision="bf16", batch=2, seq=1024, attn="eager", padding="longest")),
        ("tinyllama-1.1b", "train", dict(batch=2, seq=1024, attn="flash_attention_2")),
        ("tinyllama-1.1b", "train", dict(precision="bf16", batch=4, seq=1024, attn="flash_attention_2",
                                         padding="longest", pad_fraction=0.3)),
        ("tinyllama-1.1b", "train", dict(batch=4, seq=512, attn="flash_attention_2", padding_free=True)),
        ("tinyllama-1.1b", "train", dict(batch=4, seq=512, padding_free=True, ac_every=1)),
        ("tinyllama-1.1b", "lora", dict(batch=4, seq=1024, padding="longest")),
        ("tinyllama-1.1b", "lora", dict(batch=4, seq=1024, attn="flash_attention_2", padding="longest",
                                        pad_fraction=0.4, ac_every=1)),
        ("llama-3.2-1b", "train", dict(precision="bf16", batch=2, seq=1024, padding="longest")),
        ("llama-3.2-1b", "train", dict(batch=2, seq=2048, attn="flash_attention_2", ac_every=1)),
        ("llama-3.2-1b", "train", dict(precision="bf16", batch=8, seq=256, attn="flash_attention_2",
                                       padding_free=True, ac_every=1)),
        ("llama-3.2-1b", "lora", dict(batch=2, seq=2048, attn="flash_attention_2", padding="longest",
                                      pad_fraction=0.5)),
        ("llama-3.2-1b", "qlora", dict(batch=2, seq=1024, attn="flash_attention_2", padding_free=True)),
        # Liger's RMSNorm, SwiGLU and RoPE with the other attention paths
        ("tinyllama-1.1b", "train", dict(batch=2, seq=1024, liger=True, attn="flash_attention_2", padding="longest",
                                         pad_fraction=0.2)),
        ("tinyllama-1.1b", "qlora", dict(batch=2, seq=1024, liger=True)),
        ("llama-3.2-1b", "lora", dict(batch=4, seq=512, liger=True, attn="flash_attention_2", padding_free=True)),
        # SGD keeps no state: these peak where the activations are
        ("tinyllama-1.1b", "train", dict(precision="bf16", optimizer="sgd", batch=2, seq=2048, attn="flash_attention_2",
                                         padding="longest", pad_fraction=0.25, ac_every=1)),
        ("llama-3.2-1b", "train", dict(precision="bf16", optimizer="sgd", batch=2, seq=2048, liger=True,
                                       padding="longest")),
        ("llama-3.2-1b", "train", dict(precision="bf16", optimizer="sgd", batch=4, seq=1024, padding_free=True,
                                       attn="flash_attention_2")),
    )]
    # explicit optimizer and clipping: the train defaults follow transformers' Trainer
    return [(m, {"optimizer": "adamw", "max_grad_norm": 1.0, **o}) for m, o in rows]


def compile_rows() -> list[tuple[str, dict]]:
    """`--compile` (AOT autograd's partitioner, inductor's fusion: `llamem.trace.compiled`) over
    bf16-mixed and pure bf16 training, LoRA and QLoRA, with and without checkpointing and the
    chunked loss. The two debug rows join the CI subset."""
    rows = [("debug", dict(task="train", batch=1, seq=512)), ("debug", dict(task="lora", batch=2, seq=256))]
    # Shapes large enough that the peak falls in forward or backward, not in the optimizer step.
    rows += [(m, dict(task=t, **o)) for m, t, o in (
        ("tinyllama-1.1b", "train", dict(batch=2, seq=2048)),
        ("tinyllama-1.1b", "train", dict(precision="bf16", batch=2, seq=2048)),
        ("tinyllama-1.1b", "lora", dict(batch=2, seq=1024)),
        ("tinyllama-1.1b", "qlora", dict(batch=1, seq=1024)),
        ("tinyllama-1.1b", "train", dict(ac_every=1, batch=2, seq=4096)),
        ("tinyllama-1.1b", "train", dict(loss="chunked", batch=2, seq=4096)),
        ("llama-3.2-1b", "train", dict(batch=1, seq=2048)),
        ("llama-3.2-1b", "train", dict(precision="bf16", batch=1, seq=2048)),
        ("llama-3.2-1b", "lora", dict(batch=1, seq=1024)),
        ("llama-3.2-1b", "qlora", dict(batch=1, seq=1024)),
        ("llama-3.2-1b", "lora", dict(ac_every=1, batch=1, seq=1024)),
        ("llama-3.2-1b", "train", dict(ac_every=2, batch=1, seq=2048)),
        ("llama-3.2-1b", "train", dict(precision="bf16", ac_every=1, batch=1, seq=2048)),
        ("llama-3.2-1b", "train", dict(precision="bf16", loss="chunked", batch=2, seq=2048)),
        ("llama-3.2-1b", "qlora", dict(loss="chunked", batch=1, seq=1024)),
        ("llama-2-7b", "train", dict(precision="bf16", batch=2, seq=4096)),
        ("llama-2-7b", "lora", dict(batch=1, seq=1024)),
        ("llama-2-7b", "qlora", dict(ac_every=1, batch=1, seq=1024)),
        ("llama-3.1-8b", "train", dict(batch=2, seq=4096)),
        ("llama-3.1-8b", "train", dict(precision="bf16", ac_every=1, batch=2, seq=4096)),
        ("llama-3.1-8b", "lora", dict(loss="chunked", batch=1, seq=1024)),
        ("llama-3.1-8b", "qlora", dict(batch=1, seq=1024)),
        # Qwen2's q/k/v biases (fused into addmm: nothing more saved) and Qwen3's q_norm / k_norm.
        ("qwen2.5-7b", "train", dict(precision="bf16", optimizer="sgd", batch=2, seq=2048)),
        ("qwen2.5-7b", "lora", dict(batch=2, seq=1024)),
        ("qwen3-8b", "train", dict(precision="bf16", optimizer="sgd", batch=2, seq=2048)),
        ("qwen3-8b", "lora", dict(batch=2, seq=1024)),
    )]
    return [(model, {**options, "compile": True}) for model, options in rows + compile_combo_rows()]


def compile_combo_rows() -> list[tuple[str, dict]]:
    """`--compile` with the optimizer step in backward: the whole model's graph (untied and tied heads),
    the head's own graph under checkpointing, the chunked loss, adapters. Then with selective
    checkpointing (torchtitan's per-op policy), every layer and every second one."""
    return _compile_in_backward_rows() + compile_selective_rows()


def compile_selective_rows() -> list[tuple[str, dict]]:
    """`--compile` with `--ac selective` / `selective-every-2`: train and LoRA, bf16-mixed and bf16."""
    every = {1: dict(ac_every=1, ac_mode="selective"), 2: dict(ac_every=2, ac_mode="selective")}
    return [(m, dict(task=t, precision=p, optimizer="adamw", **every[k], batch=1, seq=s)) for m, t, p, k, s in (
        ("llama-3.2-1b", "train", "bf16-mixed", 1, 1024),
        ("llama-3.2-1b", "train", "bf16", 2, 1024),
        ("tinyllama-1.1b", "train", "bf16-mixed", 1, 1024),
        ("tinyllama-1.1b", "lora", "bf16-mixed", 1, 1024),
        ("tinyllama-1.1b", "lora", "bf16", 2, 1024),
        ("llama-3.1-8b", "lora", "bf16-mixed", 1, 1024),
        ("llama-3.1-8b", "train", "bf16", 1, 512),
    )]


def _compile_in_backward_rows() -> list[tuple[str, dict]]:
    in_backward = dict(optimizer="adamw", optimizer_in_backward=True)
    return [(m, dict(task=t, **o, **in_backward)) for m, t, o in (
        ("tinyllama-1.1b", "train", dict(precision="bf16", batch=1, seq=1024)),
        ("tinyllama-1.1b", "train", dict(precision="bf16-mixed", ac_every=1, batch=1, seq=1024)),
        ("llama-3.2-1b", "train", dict(precision="bf16", ac_every=1, batch=1, seq=1024)),
        ("llama-3.2-1b", "train", dict(precision="bf16-mixed", loss="chunked", batch=1, seq=1024)),
        ("llama-2-7b", "train", dict(precision="bf16-mixed", batch=1, seq=512)),
        ("llama-3.1-8b", "lora", dict(precision="bf16", batch=1, seq=1024)),
    )]


def optimizer_rows() -> list[tuple[str, dict]]:
    """AdamW's three steps, clipping, the optimizer step in backward and Liger's fused linear
    cross-entropy (emulated in the trace: it needs Triton on a GPU), on an untied and a tied head."""
    rows: list[tuple[str, dict]] = [("debug", dict(task="train", optimizer="adamw-fused", batch=1, seq=256)),
                                    ("debug", dict(task="train", liger=True, optimizer_in_backward=True, batch=1,
                                                   seq=256))]
    for model in ("tinyllama-1.1b", "llama-3.2-1b"):
        rows += [
            (model, dict(task="train", optimizer="adamw-fused", batch=1, seq=256)),
            (model, dict(task="train", precision="bf16", optimizer="adamw-loop", batch=1, seq=256)),
            (model, dict(task="train", optimizer="sgd", max_grad_norm=0.0, batch=1, seq=256)),
            (model, dict(task="train", optimizer_in_backward=True, batch=1, seq=256)),
            (model, dict(task="train", precision="bf16", optimizer="adamw-loop", optimizer_in_backward=True,
                         batch=1, seq=256)),
            (model, dict(task="train", optimizer="adamw-fused", ac_every=1, optimizer_in_backward=True, batch=1,
                         seq=512)),
            (model, dict(task="train", liger=True, batch=1, seq=1024)),
            (model, dict(task="train", precision="bf16", liger=True, batch=2, seq=512)),
            (model, dict(task="lora", liger=True, batch=1, seq=1024)),
            (model, dict(task="train", liger=True, optimizer="adamw-fused", optimizer_in_backward=True, batch=1,
                         seq=512)),
        ]
    rows.append(("llama-3.1-8b", dict(task="lora", optimizer="adamw-fused", liger=True, batch=1, seq=1024)))
    return rows


# The LLaMA-family kin the analytic engine sizes: 2 layers each, as above. Mistral 7B's window is cut to
# 256 tokens so that sequences of 1024 run past it (training masks, the decode cache keeps 255 + 1).
FAMILY_MODELS = {
    "qwen2.5-7b": {"num_hidden_layers": 2},
    "qwen3-8b": {"num_hidden_layers": 2},
    "mistral-7b-v0.1": {"num_hidden_layers": 2, "sliding_window": 256},
    "mistral-nemo-12b": {"num_hidden_layers": 2},
    "deepseek-r1-distill-llama-8b": {"num_hidden_layers": 2},
}


def family_rows() -> list[tuple[str, dict]]:
    """Qwen2 (q/k/v biases), Qwen3 (q/k RMSNorms, head_dim 128 apart from hidden / heads), Mistral's sliding
    window in training and in the KV cache, Mistral-NeMo's decoupled head_dim, a DeepSeek-R1 distill."""
    rows = []
    for model in ("qwen2.5-7b", "qwen3-8b", "mistral-7b-v0.1", "mistral-nemo-12b"):
        rows += [
            (model, dict(task="train", batch=1, seq=1024)),
            (model, dict(task="train", precision="bf16", batch=2, seq=512)),
            (model, dict(task="lora", batch=2, seq=1024)),
            (model, dict(task="qlora", batch=1, seq=1024)),
            # SGD keeps no state, so these peak in backward, where the saved activations are.
            (model, dict(task="train", precision="bf16", optimizer="sgd", batch=2, seq=2048)),
            (model, dict(task="train", precision="bf16", optimizer="sgd", ac_every=1, batch=4, seq=2048)),
            (model, dict(task="infer", batch=2, seq=1024, new_tokens=4)),
        ]
    rows += [("mistral-7b-v0.1", dict(task="infer", batch=1, seq=1000, new_tokens=3, prefill_chunk=300)),
             ("mistral-7b-v0.1", dict(task="train", attn="eager", batch=1, seq=512)),
             ("qwen3-8b", dict(task="train", attn="eager", batch=1, seq=512)),
             ("qwen3-8b", dict(task="train", optimizer="adafactor", batch=1, seq=512)),  # norm and bias vectors
             ("deepseek-r1-distill-llama-8b", dict(task="lora", batch=1, seq=2048))]
    return rows


# Mixtures of experts, 2 layers each (every per-layer term is exact); a Qwen3-MoE whose layer 0 is dense
# (mlp_only_layers) mixes both kinds of layer. Experts run grouped_mm, which takes bf16 weights only.
MOE_MODELS = {
    "mixtral-8x7b": {"num_hidden_layers": 2},
    "mixtral-8x22b": {"num_hidden_layers": 2},
    "qwen3-30b-a3b": {"num_hidden_layers": 2},
    "qwen3-30b-a3b-dense-first": {"num_hidden_layers": 2, "mlp_only_layers": [0]},
}


def moe_rows() -> list[tuple[str, dict]]:
    """Mixtral (top-2 of 8, fp32 routing weights) and Qwen3-MoE (top-8 of 128): router, grouped_mm dispatch
    and experts in training (full, LoRA on attention, checkpointed) and generation. Memory does not depend on
    the routing (`analytic/moe.py`), so the trace's random route compares like with like."""
    rows = []
    for model in ("mixtral-8x7b", "qwen3-30b-a3b"):
        rows += [
            (model, dict(task="train", precision="bf16", optimizer="adamw", batch=1, seq=1024)),
            # SGD keeps no state, so these peak in backward, where the saved activations are.
            (model, dict(task="train", precision="bf16", optimizer="sgd", batch=2, seq=2048)),
            (model, dict(task="train", precision="bf16", optimizer="sgd", ac_every=1, batch=4, seq=2048)),
            (model, dict(task="train", precision="bf16", optimizer="adamw", grad_accum=2, batch=1, seq=512)),
            (model, dict(task="lora", precision="bf16", optimizer="adamw", batch=2, seq=1024)),
            (model, dict(task="lora", precision="bf16", optimizer="adamw", ac_every=1, batch=1, seq=2048)),
            (model, dict(task="lora", precision="bf16", optimizer="adamw", lora_rank=16,
                         lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), batch=1, seq=512)),
            (model, dict(task="infer", precision="bf16", batch=2, seq=1024, new_tokens=4)),
            (model, dict(task="infer", precision="bf16", batch=1, seq=1000, new_tokens=3, prefill_chunk=300)),
        ]
    rows += [("mixtral-8x22b", dict(task="train", precision="bf16", optimizer="sgd", batch=1, seq=2048)),
             ("mixtral-8x22b", dict(task="infer", precision="bf16", batch=1, seq=2048, new_tokens=4)),
             ("mixtral-8x7b", dict(task="train", precision="bf16", optimizer="sgd", attn="eager", batch=1, seq=512)),
             ("qwen3-30b-a3b-dense-first", dict(task="train", precision="bf16", optimizer="sgd", batch=2, seq=1024)),
             ("qwen3-30b-a3b-dense-first", dict(task="lora", precision="bf16", optimizer="adamw", batch=2, seq=1024)),
             ("qwen3-30b-a3b-dense-first", dict(task="infer", precision="bf16", batch=2, seq=1024, new_tokens=4))]
    return rows


def moe_lora_rows() -> list[tuple[str, dict]]:
    """LoRA on the fused 3-D experts (peft's target_parameters, `analytic/moe_lora.py`): each forward
    materialises the adapted expert weights, which autograd keeps to backward; with and without
    checkpointing, with attention adapters and alone (layer 0's input then needs no gradient), and a
    Qwen3-MoE whose dense layer 0 has no experts to adapt."""
    experts = ("q_proj", "v_proj", "experts")
    lora = dict(task="lora", precision="bf16", optimizer="adamw")
    return [("mixtral-8x7b", dict(**lora, lora_targets=experts, batch=1, seq=1024)),
            ("mixtral-8x7b", dict(**lora, lora_targets=experts, ac_every=1, batch=2, seq=1024)),
            ("mixtral-8x7b", dict(**lora, lora_targets=("experts",), batch=1, seq=512)),
            ("qwen3-30b-a3b", dict(**lora, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj", "experts"),
                                   lora_rank=16, batch=2, seq=1024)),
            ("qwen3-30b-a3b", dict(**lora, lora_targets=experts, ac_every=1, batch=1, seq=2048)),
            ("qwen3-30b-a3b-dense-first", dict(**lora, lora_targets=experts, batch=2, seq=512))]


# Llama 4, 4 layers each: Scout's layer 3 and Maverick's are NoPE (global attention, temperature tuning), the others
# chunked RoPE layers with L2 q/k norms (Scout); Maverick's layers 1 and 3 are mixtures of 128 experts, 0 and 2
# dense. The -chunk256 variant cuts the chunk so that training sequences run past it (materialised masks).
LLAMA4_MODELS = {
    "llama-4-scout-17b-16e": {"num_hidden_layers": 4},
    "llama-4-maverick-17b-128e": {"num_hidden_layers": 4},
    "llama-4-scout-17b-16e-chunk256": {"num_hidden_layers": 4, "attention_chunk_size": 256},
}


def llama4_rows() -> list[tuple[str, dict]]:
    """Llama 4 (`analytic/llama4.py`): every expert sees every token, so its blocks' E x T tensors make the
    forward's and the backward's worst moments inside them (`llama4_moments.py`); full and LoRA training, in
    bf16 and bf16-mixed, checkpointed, accumulated, with the chunked loss, and generation, also past the
    attention chunk (256 tokens on the -chunk256 variant): the chunked layers' windowed caches and masks."""
    scout, maverick, chunk256 = "llama-4-scout-17b-16e", "llama-4-maverick-17b-128e", "llama-4-scout-17b-16e-chunk256"
    return [
        (scout, dict(task="train", precision="bf16", optimizer="sgd", batch=1, seq=1024)),
        (scout, dict(task="train", precision="bf16-mixed", optimizer="sgd", batch=1, seq=1024)),
        (scout, dict(task="lora", precision="bf16", optimizer="adamw", batch=1, seq=2048)),
        (scout, dict(task="lora", precision="bf16", optimizer="adamw", ac_every=1, batch=1, seq=4096)),
        (scout, dict(task="lora", precision="bf16", optimizer="adamw", lora_rank=16,
                     lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"), batch=1, seq=1024)),
        (scout, dict(task="train", precision="bf16-mixed", optimizer="adamw", loss="chunked", batch=1, seq=1024)),
        (scout, dict(task="infer", precision="bf16", batch=2, seq=1024, new_tokens=4)),
        ("llama-4-scout-17b-16e-chunk256", dict(task="lora", precision="bf16", optimizer="adamw", batch=1, seq=1024)),
        (maverick, dict(task="lora", precision="bf16", optimizer="adamw", batch=1, seq=1024)),
        (maverick, dict(task="train", precision="bf16", optimizer="sgd", ac_every=1, batch=1, seq=1024)),
        (maverick, dict(task="train", precision="bf16-mixed", optimizer="sgd", batch=1, seq=1024)),
        (maverick, dict(task="train", precision="bf16", optimizer="adamw", grad_accum=2, batch=1, seq=512)),
        (maverick, dict(task="infer", precision="bf16", batch=1, seq=1000, new_tokens=3, prefill_chunk=300)),
        (chunk256, dict(task="infer", precision="bf16", batch=1, seq=240, new_tokens=20)),
        (chunk256, dict(task="infer", precision="bf16", batch=2, seq=600, new_tokens=4)),
        (chunk256, dict(task="infer", precision="bf16", batch=1, seq=700, new_tokens=3, prefill_chunk=300)),
    ]


def selective_rows() -> list[tuple[str, dict]]:
    """Selective activation checkpointing (torchtitan's per-op policy) on every layer and on every 2nd
    (with 2 layers: layer 0 selective, layer 1 whole), at shapes where activations make the backward
    the peak (the rows that peak in the optimizer step check the other phases by category). The two
    debug rows join the CI subset."""
    every_layer, every_2 = dict(ac_every=1, ac_mode="selective"), dict(ac_every=2, ac_mode="selective")
    return [
        ("debug", dict(task="train", precision="bf16", batch=2, seq=1024, **every_layer)),
        ("debug", dict(task="lora", batch=2, seq=1024, **every_2)),
        ("tinyllama-1.1b", dict(task="train", batch=2, seq=4096, **every_layer)),
        ("tinyllama-1.1b", dict(task="train", precision="bf16", batch=2, seq=1024, **every_2)),
        ("llama-3.2-1b", dict(task="train", batch=1, seq=2048, **every_layer)),
        ("llama-3.2-1b", dict(task="lora", batch=2, seq=2048, **every_layer)),
        ("llama-3.2-1b", dict(task="qlora", batch=1, seq=2048, **every_2)),
        ("llama-2-7b", dict(task="train", precision="bf16", batch=2, seq=4096, **every_layer)),
        ("llama-2-7b", dict(task="qlora", batch=1, seq=2048, **every_layer)),
        ("llama-3.1-8b", dict(task="train", precision="bf16", batch=2, seq=4096, **every_2)),
        ("llama-3.1-8b", dict(task="lora", batch=1, seq=2048, **every_layer)),
        ("llama-3.1-8b", dict(task="train", precision="bf16", loss="chunked", batch=1, seq=2048, **every_layer)),
    ]


def every_k_rows() -> list[tuple[str, dict]]:
    """Activation checkpointing every K layers (transformers' `every_n_layers`: layers 0, K, 2K, ...),
    full checkpoints: without a cache SDPA runs causal, no mask, grouped-query attention natively
    (`attention_paths.uncached_mask`). The two debug rows (4 layers: a plain layer after each
    checkpointed one under every-2) join the CI subset; the 2-layer presets have layer 0 checkpointed,
    layer 1 plain."""
    return [
        ("debug", dict(task="train", precision="bf16", optimizer="adamw", batch=2, seq=512, ac_every=2)),
        ("debug", dict(task="train", precision="bf16-mixed", optimizer="adamw", batch=1, seq=1024, ac_every=3)),
        ("tinyllama-1.1b", dict(task="lora", precision="bf16", optimizer="adamw", batch=2, seq=512, ac_every=2)),
        ("tinyllama-1.1b", dict(task="train", precision="bf16", optimizer="adamw", batch=2, seq=2048, ac_every=2)),
        ("llama-3.2-1b", dict(task="train", precision="bf16-mixed", optimizer="adamw", batch=1, seq=2048,
                              ac_every=2)),
        ("llama-3.1-8b", dict(task="lora", precision="bf16", optimizer="adamw", batch=1, seq=4096, ac_every=2)),
        ("llama-2-7b", dict(task="qlora", precision="bf16", optimizer="adamw", batch=1, seq=2048, ac_every=2)),
        # a sliding window (256) shorter than the sequence: its mask, one for the batch, kept by the checkpoint
        ("mistral-7b-v0.1", dict(task="train", precision="bf16", optimizer="adamw", batch=2, seq=1024, ac_every=2)),
    ]


def liger_checkpointing_rows() -> list[tuple[str, dict]]:
    """Liger's kernels under checkpointing (`backward.liger_layer_backward`): its SwiGLU backward works in
    place, so a checkpointed layer's worst moment is down_proj's backward or, with adapters, the recompute
    it starts (an adapted MLP linear's LoRA output at its worst); the forward's is the top checkpointed
    layer's MLP (selective: with what the policy kept of it so far). The four debug rows join the CI subset."""
    every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    return [
        ("debug", dict(task="train", precision="bf16", optimizer="adafactor", batch=16, seq=512, ac_every=1,
                       liger=True)),
        ("debug", dict(task="lora", precision="bf16-mixed", optimizer="adamw", batch=4, seq=512, ac_every=1,
                       liger=True, lora_targets=every)),
        ("debug", dict(task="qlora", precision="bf16", optimizer="adamw", batch=4, seq=512, ac_every=2, liger=True)),
        # offloaded: Liger's RMSNorm keeps the layer's reloaded input through its backward
        ("debug", dict(task="train", precision="bf16", optimizer="adafactor", batch=8, seq=1024, ac_every=1,
                       liger=True, offload_activations=True)),
        ("tinyllama-1.1b", dict(task="lora", precision="bf16-mixed", optimizer="adamw", batch=2, seq=1024,
                                liger=True)),
        ("tinyllama-1.1b", dict(task="train", precision="bf16-mixed", optimizer="adamw", batch=2, seq=1024,
                                ac_every=1, liger=True)),
        ("llama-3.2-1b", dict(task="lora", precision="bf16", optimizer="adamw", batch=2, seq=2048, ac_every=1,
                              liger=True)),
        ("llama-3.2-1b", dict(task="qlora", precision="bf16", optimizer="adamw", batch=2, seq=1024, ac_every=1,
                              liger=True, lora_targets=every)),
        ("llama-3.1-8b", dict(task="train", precision="bf16", optimizer="sgd", batch=1, seq=2048, ac_every=1,
                              liger=True)),
        ("llama-3.1-8b", dict(task="lora", precision="bf16-mixed", optimizer="adamw", batch=1, seq=2048,
                              ac_every=2, liger=True, lora_targets=every)),
        # no checkpointing, autocast, every linear adapted: the forward peaks at the top layer's down_proj LoRA
        ("llama-3.2-1b", dict(task="lora", precision="bf16-mixed", optimizer="adamw", batch=2, seq=1024, liger=True,
                              lora_targets=every)),
        # selective: the policy's kept outputs of down_proj wait in its cache until the recompute reaches them
        ("tinyllama-1.1b", dict(task="lora", precision="bf16", optimizer="adamw-fused", batch=8, seq=1024, ac_every=1,
                                ac_mode="selective", liger=True)),
        ("llama-3.2-1b", dict(task="lora", precision="bf16-mixed", optimizer="adamw", batch=2, seq=1024, ac_every=1,
                              ac_mode="selective", liger=True, lora_targets=every)),
    ]


def partial_lora_rows() -> list[tuple[str, dict]]:
    """Adapters on some linears only, without checkpointing: a frozen layer 0 whose q, k and v are not adapted
    saves no attention, so the training cache alone holds its K and V (`activations.cache_only_kv_bytes`), and
    an fp32 o_proj's lora_A alone its input; under Liger an adapted down_proj's LoRA chain is the top layer's
    worst backward moment (`liger.lora_chain_moment`), and a frozen head's chunks keep no hidden cast. The three
    debug rows join the CI subset."""
    mlp = ("gate_proj", "up_proj", "down_proj")
    return [
        ("debug", dict(task="lora", precision="bf16-mixed", optimizer="adamw", batch=4, seq=512, liger=True,
                       lora_targets=("down_proj",))),
        ("debug", dict(task="lora", precision="fp32", optimizer="adamw", batch=2, seq=256, liger=True,
                       lora_targets=("down_proj",))),
        ("debug", dict(task="lora", precision="fp32", optimizer="adamw", batch=2, seq=256, lora_targets=("o_proj",))),
        ("tinyllama-1.1b", dict(task="lora", precision="bf16-mixed", optimizer="adamw", batch=2, seq=1024,
                                lora_targets=mlp)),
        ("tinyllama-1.1b", dict(task="lora", precision="bf16-mixed", optimizer="adamw", batch=2, seq=1024, liger=True,
                                lora_targets=("q_proj",))),
        ("llama-3.2-1b", dict(task="lora", precision="bf16", optimizer="adamw", batch=2, seq=1024, liger=True,
                              lora_targets=("down_proj",))),
    ]


def offload_rows() -> list[tuple[str, dict]]:
    """Activation offloading (transformers' `offload=True`: each checkpointed layer's input in pinned host
    memory) with every layer checkpointed, in each precision, full fine-tuning and adapters; SGD keeps no
    state, so most peak in backward, where the reloaded inputs are. The two debug rows join the CI subset."""
    offload = dict(ac_every=1, offload_activations=True)
    return [
        ("debug", dict(task="train", precision="bf16", optimizer="sgd", batch=2, seq=512, **offload)),
        ("debug", dict(task="lora", precision="bf16", optimizer="adamw-fused", batch=2, seq=1024, **offload)),
        ("tinyllama-1.1b", dict(task="train", precision="bf16", optimizer="sgd", batch=4, seq=4096, **offload)),
        ("tinyllama-1.1b", dict(task="train", precision="bf16-mixed", optimizer="sgd", batch=2, seq=4096,
                                **offload)),
        ("llama-3.2-1b", dict(task="train", precision="bf16", optimizer="sgd", batch=2, seq=4096, **offload)),
        ("llama-3.2-1b", dict(task="lora", precision="bf16", optimizer="adamw-fused", batch=4, seq=4096,
                              **offload)),
        ("llama-3.2-1b", dict(task="qlora", precision="bf16", optimizer="adamw-fused", batch=2, seq=4096,
                              **offload)),
        ("llama-2-7b", dict(task="train", precision="bf16", optimizer="sgd", batch=2, seq=4096, **offload)),
        ("llama-3.1-8b", dict(task="lora", precision="bf16", optimizer="adamw-fused", batch=2, seq=4096,
                              **offload)),
        ("llama-3.1-8b", dict(task="train", precision="bf16", optimizer="sgd", liger=True, batch=2, seq=4096,
                              **offload)),
        ("tinyllama-1.1b", dict(task="train", precision="bf16", optimizer="adamw-fused", optimizer_in_backward=True,
                                max_grad_norm=0.0, batch=4, seq=4096, **offload)),
    ]


ROW_DEFAULTS = {"train": dict(precision="bf16-mixed", optimizer="adamw"),
                "distill": dict(precision="bf16-mixed", optimizer="adamw"),
                "lora": dict(optimizer="adamw"), "qlora": dict(optimizer="adamw")}
"""The settings the rows were written against where they name none: llamem's defaults before they
followed the Trainer's (`llamem.workload.TRAINER_DEFAULTS`), so each row keeps measuring what it did."""


def row_workload(options: dict):
    """A row's workload: its options over `ROW_DEFAULTS`."""
    return build_workload(**{**ROW_DEFAULTS.get(options.get("task", "train"), {}), **options})


def quick_matrix() -> list[tuple[str, dict]]:
    """The CI subset: one of each task and precision on small shapes."""
    return [(m, o) for m, o in matrix() if m == "debug"]


def run(rows: list[tuple[str, dict]]) -> list[dict]:
    results = []
    for model, options in rows:
        spec = _reduced_model(model)
        workload = row_workload(options)
        start = time.perf_counter()
        result = compare(spec, workload)
        category, error = result.worst_category
        results.append({
            "model": spec.name, "options": {k: list(v) if isinstance(v, tuple) else v for k, v in options.items()},
            "analytic_peak_bytes": result.analytic_peak_bytes, "traced_peak_bytes": result.traced_peak_bytes,
            "traced_peak_phase": result.traced_phase, "peak_error": result.peak_error,
            "worst_category": category, "worst_category_error": error, "ok": result.ok,
            "seconds": time.perf_counter() - start,
        })
    return results


def _reduced_model(model: str):
    """The preset with the row's reduced size (a MOE_MODELS key may name a variant of its preset)."""
    if model in MODELS:
        return load_model(model, overrides=MODELS[model])
    if model in FAMILY_MODELS:
        return load_model(model, overrides=FAMILY_MODELS[model])
    if model in LLAMA4_MODELS:
        return load_model(model.removesuffix("-chunk256"), overrides=LLAMA4_MODELS[model])
    return load_model(model.removesuffix("-dense-first"), overrides=MOE_MODELS[model])


def print_table(results: list[dict]) -> None:
    print(f"{'model':<38} {'workload':<58} {'trace GiB':>9} {'peak err':>8}  {'worst category':<26} ok")
    for r in results:
        options = " ".join(f"{k}={v if not isinstance(v, list) else ','.join(v)}" for k, v in r["options"].items())
        print(f"{r['model'][:38]:<38} {options[:58]:<58} {r['traced_peak_bytes'] / 2**30:>9.3f} "
              f"{100 * r['peak_error']:>+7.2f}%  {r['worst_category'][:16]:<16} {100 * r['worst_category_error']:>+7.2f}% "
              f"{'yes' if r['ok'] else 'NO'}")
    passed = sum(r["ok"] for r in results)
    print(f"{passed} passed, {len(results) - passed} failed")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/accuracy.json")
    parser.add_argument("--quick", action="store_true", help="only the CI subset")
    args = parser.parse_args()
    results = run(quick_matrix() if args.quick else matrix())
    print_table(results)
    with open(args.out, "w") as handle:
        json.dump(results, handle, indent=1)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
