"""The settings of one server launch, checked against the model and the card before any arithmetic.

`ServerConfig` holds what the user gave (None: the server's own default); `resolve` fills the defaults
each server applies at the version modelled (`llamem.serving.vllm`, `llamem.serving.sglang`) and returns
a `Resolved` with every number concrete. Problems are collected and raised once, each naming the flag
to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from llamem.errors import InvalidWorkload, UsageError
from llamem.gpus import GPU
from llamem.model import ModelSpec

Server = Literal["vllm", "sglang"]
SERVERS = ("vllm", "sglang")
SERVER_QUANTS = ("none", "fp8", "awq", "gptq")
KV_CACHE_DTYPES = ("auto", "fp8")
VERSIONS = {"vllm": ("v1", "v0"), "sglang": ("0.5", "0.4")}
"""Accounting eras modelled, newest first (the default): see docs/serving.md for what differs."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerConfig:
    """One `vllm serve` / `python -m sglang.launch_server` launch, as the user gave it."""

    server: Server
    gpu: GPU
    tp: int = 1
    """Tensor-parallel degree (--tensor-parallel-size / --tp)."""
    gpus: int | None = None
    """GPUs in all: gpus / tp data-parallel replicas, each sized alike. None: one replica."""
    max_model_len: int | None = None
    """--max-model-len / --context-length. None: the model's max_position_embeddings."""
    gpu_memory_utilization: float | None = None
    """vLLM only. None: 0.9."""
    mem_fraction_static: float | None = None
    """SGLang only. None: the server's default rule for this card and TP degree."""
    max_num_seqs: int | None = None
    """vLLM --max-num-seqs / SGLang --max-running-requests. None: the server's default."""
    max_num_batched_tokens: int | None = None
    """vLLM --max-num-batched-tokens / SGLang --chunked-prefill-size. None: the server's default."""
    kv_cache_dtype: Literal["auto", "fp8"] = "auto"
    quant: Literal["none", "fp8", "awq", "gptq"] = "none"
    dtype_bytes: int = 2
    """Bytes of the model dtype (bf16 / fp16)."""
    version: str | None = None
    """Accounting era (VERSIONS); None: the newest modelled."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Resolved:
    """A ServerConfig with every server default filled in."""

    config: ServerConfig
    version: str
    max_model_len: int
    memory_fraction: float
    """gpu_memory_utilization (vLLM) or mem_fraction_static (SGLang)."""
    max_num_seqs: int
    max_num_batched_tokens: int
    cuda_graph_max_batch: int
    kv_element_bytes: int


def config_problems(spec: ModelSpec, config: ServerConfig) -> list[str]:
    """Every reason this launch cannot start, each naming the flag to change."""
    problems = _flag_problems(config)
    tp = config.tp
    if tp < 1:
        problems.append(f"--tp must be at least 1, got {tp}")
        return problems
    if spec.num_heads % tp:
        problems.append(f"--tp {tp} does not divide the {spec.num_heads} attention heads of {spec.name}: "
                        f"use a --tp that divides {spec.num_heads}")
    if spec.num_kv_heads % tp and tp % spec.num_kv_heads:
        problems.append(f"--tp {tp} and the {spec.num_kv_heads} KV heads of {spec.name}: one must divide the "
                        "other (the servers shard or replicate whole KV heads); use a --tp that divides "
                        f"{spec.num_kv_heads} or a multiple of it")
    if config.gpus is not None and config.gpus < 1:
        problems.append(f"--gpus must be at least 1, got {config.gpus}")
    elif config.gpus is not None and (config.gpus < tp or config.gpus % tp):
        problems.append(f"--gpus {config.gpus} is not a whole number of --tp {tp} replicas: use a multiple of {tp}")
    limit = spec.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len < 1:
        problems.append(f"--max-model-len must be at least 1 token, got {config.max_model_len}")
    elif config.max_model_len is not None and config.max_model_len > limit:
        problems.append(f"--max-model-len {config.max_model_len:,} is over {limit:,}, the model's limit "
                        f"(max_position_embeddings of {spec.name}): lower --max-model-len")
    return problems


def _flag_problems(config: ServerConfig) -> list[str]:
    problems = []
    vllm = config.server == "vllm"
    if vllm and config.mem_fraction_static is not None:
        problems.append("--mem-fraction-static is SGLang's setting: for vLLM use --gpu-memory-utilization")
    if not vllm and config.gpu_memory_utilization is not None:
        problems.append("--gpu-memory-utilization is vLLM's setting: for SGLang use --mem-fraction-static")
    for flag, value in (("--gpu-memory-utilization", config.gpu_memory_utilization),
                        ("--mem-fraction-static", config.mem_fraction_static)):
        if value is not None and not 0 < value <= 1:
            problems.append(f"{flag} {value} must be a fraction of the card, above 0 and at most 1")
    for flag, value in (("--max-num-seqs", config.max_num_seqs),
                        ("--max-num-batched-tokens", config.max_num_batched_tokens)):
        if value is not None and value < 1:
            problems.append(f"{flag} must be at least 1, got {value}")
    if config.quant not in SERVER_QUANTS:
        problems.append(f"--quant {config.quant} is not a server weight format: use one of "
                        f"{', '.join(SERVER_QUANTS)} with --server")
    if config.kv_cache_dtype not in KV_CACHE_DTYPES:
        problems.append(f"--kv-cache-dtype {config.kv_cache_dtype}: use auto or fp8")
    # the planner's rule too: fp8 weights (vLLM's minimum capability 8.0, Marlin) and fp8 KV caches need Ampere+
    fp8 = [flag for flag, value in (("--quant", config.quant), ("--kv-cache-dtype", config.kv_cache_dtype))
           if value == "fp8"]
    if fp8 and not config.gpu.bf16:
        problems.append(f"{' and '.join(f'{flag} fp8' for flag in fp8)} need{'' if len(fp8) > 1 else 's'} an Ampere or newer card, not "
                        f"{config.gpu.name}: use --quant awq or gptq and --kv-cache-dtype auto, or another --gpu")
    if config.version is not None and config.version not in VERSIONS[config.server]:
        problems.append(f"--server-version {config.version} is not modelled for {config.server}: use one of "
                        f"{', '.join(VERSIONS[config.server])}")
    return problems


def check_config(spec: ModelSpec, config: ServerConfig) -> None:
    """Raise every problem at once: a flag of the other server is a usage error (exit 2), the rest
    invalid input (exit 1)."""
    problems = config_problems(spec, config)
    if any("'s setting" in p for p in problems):
        raise UsageError("; ".join(problems))
    if problems:
        raise InvalidWorkload(problems)
