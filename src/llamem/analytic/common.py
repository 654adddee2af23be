"""Small helpers every analytic module shares."""

from __future__ import annotations

from llamem.dtypes import DTYPE_BYTES
from llamem.workload import Workload

BLOCK_BYTES = 512
"""The CUDA caching allocator rounds every tensor up to a multiple of 512 bytes."""


def r512(num_bytes: float) -> int:
    """Bytes one tensor occupies in the allocator: rounded up to 512, at least 512 (0 stays 0)."""
    if num_bytes <= 0:
        return 0
    return int(-(-num_bytes // BLOCK_BYTES)) * BLOCK_BYTES


def tensor_bytes(numel: int, dtype: str) -> int:
    return r512(numel * DTYPE_BYTES[dtype])


def trains_base_weights(workload: Workload) -> bool:
    """Full fine-tuning (and distillation's student): every weight of the model trains, not
    adapters on a frozen base."""
    return workload.task in ("train", "distill")


def prefill_chunks(workload: Workload) -> tuple[int, int]:
    """(prompt tokens per prefill forward, tokens of the last forward): the prompt cut into
    `prefill_step`-token chunks, the remainder last (a whole chunk when it divides evenly)."""
    chunk = workload.prefill_step
    return chunk, workload.seq - (workload.seq - 1) // chunk * chunk


def add_breakdowns(*parts: dict[str, int]) -> dict[str, int]:
    """Category-wise sum of breakdowns (zero entries left out)."""
    out: dict[str, int] = {}
    get = out.get
    for part in parts:
        for key, value in part.items():
            if value:
                out[key] = get(key, 0) + value
    return out


def top_checkpointed_layer(num_layers: int, workload: Workload) -> int:
    """The highest checkpointed layer (`--ac every-K` checkpoints layers 0, K, 2K, ...)."""
    return (num_layers - 1) // workload.ac_every * workload.ac_every
