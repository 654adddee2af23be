"""What a server's start-up log reports, as one object for text, JSON and the planner."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True, kw_only=True, slots=True)
class ServingReport:
    """One rank of one replica at start-up; `kv_cache_tokens` and `max_concurrency` are per replica."""

    server: str
    version: str
    model: str
    gpu: str
    tp: int
    replicas: int
    settings: dict[str, Any]
    """The resolved launch flags (flag name without dashes -> value)."""
    total_bytes: int
    """The card's memory as CUDA reports it."""
    budget_bytes: int
    """vLLM: total x gpu_memory_utilization. SGLang: free memory at start x mem_fraction_static."""
    weights_bytes: int
    activation_peak_bytes: int
    """vLLM: the torch peak increase of the profile run (inside the budget). SGLang: the prefill peak
    of one --chunked-prefill-size chunk (outside mem_fraction_static, in the reserve)."""
    non_torch_bytes: int
    """Memory outside PyTorch's allocator that the server counts against the budget (vLLM), or that is
    gone before SGLang measures free memory (CUDA context, NCCL)."""
    cuda_graph_bytes: int
    """Modelled, outside the budget in both servers (see docs/serving.md)."""
    kv_cache_bytes: int
    kv_bytes_per_token: int
    block_size: int
    num_blocks: int | None
    """vLLM's "# GPU blocks"; None for SGLang's token pool."""
    kv_cache_tokens: int
    max_concurrency: float
    """Requests of max_model_len tokens the KV cache holds at once (vLLM's "Maximum concurrency" line;
    for SGLang the same ratio, which it does not print)."""
    headroom_bytes: int
    """What is left outside the budget for CUDA graphs and the rest (negative: the launch may OOM)."""
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"max_concurrency": round(self.max_concurrency, 2)}
