"""Bytes per element of every dtype llamem reasons about.

A table, not `torch.finfo`: the core must not import torch.
"""

from __future__ import annotations

from typing import Literal

DType = Literal["fp32", "bf16", "fp16", "fp8", "int8", "uint8", "int4", "nf4", "int64", "bool"]

DTYPE_BYTES: dict[str, float] = {
    "fp32": 4,
    "bf16": 2,
    "fp16": 2,
    "fp8": 1,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "int64": 8,
    # 4-bit formats pack two values per byte.
    "int4": 0.5,
    "nf4": 0.5,
}

# Names accepted from config.json `torch_dtype` / `dtype` fields.
HF_DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def dtype_bytes(dtype: str) -> float:
    return DTYPE_BYTES[dtype]
