"""vLLM's start-up memory accounting, read from its source (V1 engine).

Read at vllm-project/vllm commit 35d5cda123ec (vllm/v1/worker/gpu_worker.py,
vllm/utils/mem_utils.py) and bbf906a88ba1 (vllm/v1/core/kv_cache_utils.py):

1. `Worker.determine_available_memory` runs `profile_run()` (one forward of
   max_num_batched_tokens dummy tokens, then the sampler on max_num_seqs rows) inside
   `memory_profiling`, and takes
       kv_cache_bytes = total x gpu_memory_utilization
                        - (weights + torch peak increase + non-torch increase).
2. `get_kv_cache_config` -> `get_num_blocks`: num_blocks = kv_cache_bytes // page_size // num_layers,
   page_size = block_size (16) x num_kv_heads_per_rank x head_size x 2 (K, V) x dtype bytes; the log's
   "GPU KV cache size" is num_blocks x block_size tokens.
3. `get_max_concurrency_for_kv_cache_config`: num_blocks / blocks one request of max_model_len needs,
   cdiv(max_model_len, block_size) for full attention; a sliding-window layer needs
   cdiv(min(window - 1 + max_num_batched_tokens, max_model_len), block_size) + 1.
4. CUDA graphs are captured after the KV cache exists (`compile_or_warm_up_model`): their memory comes
   out of the (1 - gpu_memory_utilization) headroom, not out of the KV cache.

Version differences that move the numbers (the `version` setting):
- v1 (0.8 and later, the default): chunked prefill always; defaults max_num_batched_tokens 8192 and
  max_num_seqs 1024 for `vllm serve` on cards of 70 GiB or more other than A100, else 2048 and 256
  (`EngineArgs.get_batch_defaults`); the profile run includes the sampler on max_num_seqs rows.
- v0 (the legacy engine, up to 0.10): no chunked prefill unless max_model_len > 32K, so the profile run
  batches max(max_model_len, 2048) tokens and the activation peak grows with --max-model-len (then
  512-token chunks above 32K); max_num_seqs 256; no sampler term.
- From commit 35d5cda on, the baseline snapshot is taken after NCCL and the CUDA context exist, so
  those leave the non-torch term (the KV cache grows by them); the figures here follow the earlier
  behaviour that the published logs show (non-torch 0.33-0.35 GiB).
"""

from __future__ import annotations

from llamem.errors import DoesNotFit, InvalidWorkload
from llamem.model import ModelSpec
from llamem.serving.config import Resolved, ServerConfig, check_config
from llamem.serving.report import ServingReport
from llamem.serving.shapes import activation_bytes_per_token, cuda_graph_bytes, kv_bytes_per_token, weight_bytes
from llamem.units import GiB, format_gib

BLOCK_SIZE = 16
DEFAULT_UTILIZATION = 0.9
NON_TORCH_BYTES = int(0.35 * GiB)
"""Modelled constant: the non-torch memory vLLM 0.6-0.9 logs on one card (0.35 GiB in vllm#10517, an
RTX 3090; 0.33 GiB in vllm#14452, two RTX 5090s): CUDA context and library workspaces."""
SAMPLER_BYTES_PER_LOGIT = {"v1": 18, "v0": 2}
"""Modelled: bytes per (row, vocabulary entry) at the sampler's peak in the profile run. v1's dummy
sampler keeps the bf16 logits, their fp32 copy, the temperature-scaled logits, the probabilities and the
exponential noise of random sampling (2 + 4 x 4); v0's profile keeps the logits only."""


def resolve(spec: ModelSpec, config: ServerConfig) -> Resolved:
    """The launch with vLLM's defaults filled in; every problem raised at once."""
    check_config(spec, config)
    version = config.version or "v1"
    max_model_len = config.max_model_len or spec.max_position_embeddings
    default_seqs, default_batched = _batch_defaults(config, version, max_model_len)
    seqs = config.max_num_seqs or default_seqs
    batched = config.max_num_batched_tokens or default_batched
    problems = []
    if version == "v1" and batched < seqs:
        problems.append(f"--max-num-batched-tokens {batched} is below --max-num-seqs {seqs}, which vLLM refuses: "
                        "raise --max-num-batched-tokens or lower --max-num-seqs")
    if version == "v0" and max_model_len <= 32768 and batched < max_model_len:
        problems.append(f"--max-num-batched-tokens {batched} is below --max-model-len {max_model_len}: the v0 "
                        "engine without chunked prefill refuses it; raise --max-num-batched-tokens")
    if problems:
        raise InvalidWorkload(problems)
    return Resolved(config=config, version=version, max_model_len=max_model_len,
                    memory_fraction=config.gpu_memory_utilization or DEFAULT_UTILIZATION,
                    max_num_seqs=seqs, max_num_batched_tokens=batched,
                    cuda_graph_max_batch=min(seqs, 512 if version == "v1" else 256),
                    kv_element_bytes=1 if config.kv_cache_dtype == "fp8" else config.dtype_bytes)


def _batch_defaults(config: ServerConfig, version: str, max_model_len: int) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens) that `vllm serve` picks when not given."""
    if version == "v0":
        return 256, (max(max_model_len, 2048) if max_model_len <= 32768 else 512)
    gpu = config.gpu
    if gpu.memory_bytes >= 70 * GiB and "a100" not in gpu.name:
        return 1024, 8192
    return 256, 2048


def profile_activation_bytes(spec: ModelSpec, r: Resolved) -> int:
    """Torch peak increase of `profile_run`: the larger of one decoder layer's peak over the batched
    tokens and the sampler over min(max_num_seqs, batched) rows (while the batch's hidden states live)."""
    c = r.config
    tokens = r.max_num_batched_tokens
    layer = tokens * activation_bytes_per_token(spec, tp=c.tp, dtype_bytes=c.dtype_bytes)
    rows = min(r.max_num_seqs, tokens)
    sampler = rows * spec.vocab_size * SAMPLER_BYTES_PER_LOGIT[r.version]
    return max(layer, sampler + tokens * spec.hidden_size * c.dtype_bytes)


def capture_sizes(r: Resolved) -> list[int]:
    """Batch sizes vLLM captures decode graphs for: 1, 2, 4, then every 8 up to the cap."""
    return [s for s in [1, 2, 4, *range(8, 513, 8)] if s <= r.cuda_graph_max_batch]


def blocks_per_request(spec: ModelSpec, r: Resolved) -> int:
    """Blocks one request of max_model_len tokens holds at most (`max_memory_usage_bytes` / page)."""
    length = r.max_model_len
    if spec.sliding_window and r.version == "v1":
        window = min(spec.sliding_window - 1 + r.max_num_batched_tokens, length)
        return -(-window // BLOCK_SIZE) + 1
    return -(-length // BLOCK_SIZE)


def report(spec: ModelSpec, config: ServerConfig) -> ServingReport:
    """What `vllm serve` logs at start-up for this launch, per rank; DoesNotFit where it would refuse."""
    r = resolve(spec, config)
    c = r.config
    total = c.gpu.memory_bytes
    budget = int(total * r.memory_fraction)
    weights = weight_bytes(spec, tp=c.tp, quant=c.quant, dtype_bytes=c.dtype_bytes)
    activation = profile_activation_bytes(spec, r)
    per_token = kv_bytes_per_token(spec, c.tp, r.kv_element_bytes)
    kv_bytes = budget - weights - activation - NON_TORCH_BYTES
    per_request = blocks_per_request(spec, r)
    num_blocks = max(kv_bytes, 0) // (BLOCK_SIZE * per_token)
    if num_blocks < per_request:
        raise _does_not_fit(spec, r, budget, kv_bytes, per_request * BLOCK_SIZE * per_token, num_blocks)
    graphs = cuda_graph_bytes(spec, tp=c.tp, dtype_bytes=c.dtype_bytes, sizes=capture_sizes(r))
    concurrency = (num_blocks / per_request if r.version == "v1"
                   else num_blocks * BLOCK_SIZE / r.max_model_len)
    headroom = total - budget - graphs
    notes = () if headroom >= 0 else (
        f"CUDA graphs ({format_gib(graphs)}, modelled) may not fit the {format_gib(total - budget)} left outside "
        "--gpu-memory-utilization: lower it, lower --max-num-seqs, or add --enforce-eager",)
    return ServingReport(
        server="vllm", version=r.version, model=spec.name, gpu=c.gpu.name, tp=c.tp,
        replicas=(c.gpus or c.tp) // c.tp, settings=settings(r), total_bytes=total, budget_bytes=budget,
        weights_bytes=weights, activation_peak_bytes=activation, non_torch_bytes=NON_TORCH_BYTES,
        cuda_graph_bytes=graphs, kv_cache_bytes=num_blocks * BLOCK_SIZE * per_token, kv_bytes_per_token=per_token,
        block_size=BLOCK_SIZE, num_blocks=num_blocks, kv_cache_tokens=num_blocks * BLOCK_SIZE,
        max_concurrency=concurrency, headroom_bytes=headroom, notes=notes)


def settings(r: Resolved) -> dict:
    c = r.config
    return {"tensor-parallel-size": c.tp, "max-model-len": r.max_model_len,
            "gpu-memory-utilization": r.memory_fraction, "max-num-seqs": r.max_num_seqs,
            "max-num-batched-tokens": r.max_num_batched_tokens, "kv-cache-dtype": c.kv_cache_dtype,
            "quantization": c.quant}


def _does_not_fit(spec: ModelSpec, r: Resolved, budget: int, kv_bytes: int, one_request_bytes: int,
                  num_blocks: int) -> DoesNotFit:
    c = r.config
    shortfall = one_request_bytes - kv_bytes
    where = (f"vLLM on {c.gpu.name} (--tp {c.tp}): the budget is {format_gib(budget)} (--gpu-memory-utilization "
             f"{r.memory_fraction} of {format_gib(c.gpu.memory_bytes)})")
    need = f"one request of --max-model-len {r.max_model_len:,} needs {format_gib(one_request_bytes)} of KV cache"
    if kv_bytes <= 0:
        used = budget - kv_bytes
        what = (f"{where}; weights, the profile run and non-torch memory take {format_gib(used)} of it and {need}: "
                f"short by {format_gib(shortfall)}")
        quant = "fp8 or awq" if c.gpu.bf16 else "awq"  # no fp8 before Ampere (`config_problems`)
        hint = (f"raise --tp or --gpu-memory-utilization, add --quant {quant}, lower --max-num-batched-tokens, or "
                "use a larger card")
    else:
        what = f"{where}; the KV cache gets {format_gib(kv_bytes)} and {need}: short by {format_gib(shortfall)}"
        fp8 = ", add --kv-cache-dtype fp8" if c.kv_cache_dtype != "fp8" and c.gpu.bf16 else ""
        hint = (f"lower --max-model-len to at most {num_blocks * BLOCK_SIZE:,}{fp8}, or raise "
                "--gpu-memory-utilization or --tp")
    return DoesNotFit(f"{what}; {hint}", shortfall_bytes=shortfall)
