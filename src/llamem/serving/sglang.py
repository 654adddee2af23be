"""SGLang's start-up memory accounting, read from its source.

Read at sgl-project/sglang commit 01cc04e2b5b0 (python/sglang/srt/model_executor/model_runner.py,
`profile_max_num_token`, unchanged in substance in later versions' model_runner_kv_cache_mixin.py) and
the stored python/sglang/srt/server_args.py (`_handle_gpu_memory_settings`, from PR #10975, 0.5.4+):

1. `init_torch_distributed` measures the free memory F once the CUDA context and NCCL exist.
2. After the weights load, `profile_max_num_token` takes
       rest = free_now - F x (1 - mem_fraction_static) = F x mem_fraction_static - weights
   and max_total_num_tokens = rest // cell_size, cell_size = kv_heads_per_rank x head_dim x layers x 2
   x dtype bytes: a token pool (page size 1), no blocks, no profile run.
3. Activations (one --chunked-prefill-size chunk), CUDA graphs (batch sizes up to cuda_graph_max_bs)
   and the request pools live in the reserve F x (1 - mem_fraction_static); nothing checks that they
   fit at start-up, which is why a too-large fraction fails later, under load.
4. max_running_requests defaults to min(max(max_total_num_tokens / context_len x 512, 2048), 4096).

Version differences (the `version` setting):
- 0.5 (0.5.4 and later, the default): mem_fraction_static = (gpu_mem - reserved) / gpu_mem, rounded to
  3 places, gpu_mem in MiB, reserved = 512 + 1.5 x max(chunked_prefill_size, 2048) + 2 x
  cuda_graph_max_bs + 1024 x tp / 8 MiB, at least 10 GiB on cards over 60 GiB; chunked_prefill_size and
  cuda_graph_max_bs by card size (2048/8 under 20 GiB, 2048/24 or 80 under 35 GiB, 4096/32 or 160 under
  60 GiB, 8192/256 or 512 under 160 GiB, else 16384/512; the larger batch from tp 4 on).
- 0.4 (0.3 to 0.5.3): mem_fraction_static by TP degree alone, 0.88 / 0.87 (tp 2) / 0.85 (tp 4) /
  0.81 (tp 8) / 0.79 (tp 16); chunked_prefill_size 2048 under 25,000 MiB, else 8192; cuda_graph_max_bs
  160.
"""

from __future__ import annotations

from llamem.errors import DoesNotFit
from llamem.model import ModelSpec
from llamem.overhead import non_torch_bytes
from llamem.serving.config import Resolved, ServerConfig, check_config
from llamem.serving.report import ServingReport
from llamem.serving.shapes import activation_bytes_per_token, cuda_graph_bytes, kv_bytes_per_token, weight_bytes
from llamem.units import MiB, format_gib

_BUCKETS = (  # (card below this many MiB, chunked_prefill_size, cuda_graph_max_bs below tp 4, from tp 4)
    (20 * 1024, 2048, 8, 8), (35 * 1024, 2048, 24, 80), (60 * 1024, 4096, 32, 160),
    (90 * 1024, 8192, 256, 512), (160 * 1024, 8192, 256, 512), (None, 16384, 512, 512))
_TP_FRACTIONS = ((16, 0.79), (8, 0.81), (4, 0.85), (2, 0.87), (1, 0.88))


def _defaults_05(gpu_mib: float, tp: int, chunk: int | None) -> tuple[float, int, int]:
    """(mem_fraction_static, chunked_prefill_size, cuda_graph_max_bs) as server_args.py 0.5.4+ sets them."""
    _limit, bucket_chunk, small_bs, large_bs = next(b for b in _BUCKETS if b[0] is None or gpu_mib < b[0])
    chunk = chunk or bucket_chunk
    graph_bs = small_bs if tp < 4 else large_bs
    reserved = 512 + max(chunk, 2048) * 1.5 + graph_bs * 2 + tp / 8 * 1024
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    return round((gpu_mib - reserved) / gpu_mib, 3), chunk, graph_bs


def _defaults_04(gpu_mib: float, tp: int, chunk: int | None) -> tuple[float, int, int]:
    fraction = next(f for at_least, f in _TP_FRACTIONS if tp >= at_least)
    return fraction, chunk or (2048 if gpu_mib < 25000 else 8192), 160


def resolve(spec: ModelSpec, config: ServerConfig) -> Resolved:
    check_config(spec, config)
    version = config.version or "0.5"
    rule = _defaults_05 if version == "0.5" else _defaults_04
    fraction, chunk, graph_bs = rule(config.gpu.memory_bytes / MiB, config.tp, config.max_num_batched_tokens)
    return Resolved(config=config, version=version,
                    max_model_len=config.max_model_len or spec.max_position_embeddings,
                    memory_fraction=config.mem_fraction_static or fraction,
                    max_num_seqs=config.max_num_seqs or 0, max_num_batched_tokens=chunk,
                    cuda_graph_max_batch=min(graph_bs, config.max_num_seqs or graph_bs),
                    kv_element_bytes=1 if config.kv_cache_dtype == "fp8" else config.dtype_bytes)


def capture_sizes(r: Resolved) -> list[int]:
    """`_generate_cuda_graph_batch_sizes` without speculative decoding."""
    sizes = [1, 2, 4, 8, 12, *range(16, 257, 8), *range(272, 512, 16), *range(512, r.cuda_graph_max_batch + 1, 32)]
    return [s for s in sizes if s <= r.cuda_graph_max_batch]


def report(spec: ModelSpec, config: ServerConfig) -> ServingReport:
    """What `sglang.launch_server` logs at start-up ("KV Cache is allocated. #tokens: N"), per rank."""
    r = resolve(spec, config)
    c = r.config
    total = c.gpu.memory_bytes
    outside = non_torch_bytes(num_gpus=c.tp)  # CUDA context, and NCCL with tp > 1, before F is measured
    free_at_start = total - outside
    budget = int(free_at_start * r.memory_fraction)
    weights = weight_bytes(spec, tp=c.tp, quant=c.quant, dtype_bytes=c.dtype_bytes)
    per_token = kv_bytes_per_token(spec, c.tp, r.kv_element_bytes)
    tokens = max(budget - weights, 0) // per_token
    if tokens <= 0:  # "Not enough memory. Please try to increase --mem-fraction-static."
        raise _does_not_fit(r, budget, weights, per_token)
    activation = r.max_num_batched_tokens * activation_bytes_per_token(spec, tp=c.tp, dtype_bytes=c.dtype_bytes)
    graphs = cuda_graph_bytes(spec, tp=c.tp, dtype_bytes=c.dtype_bytes, sizes=capture_sizes(r))
    headroom = free_at_start - budget - activation - graphs
    running = r.max_num_seqs or min(max(int(tokens / r.max_model_len * 512), 2048), 4096)
    notes = [] if tokens >= r.max_model_len else [
        f"the pool holds {tokens:,} tokens, fewer than --context-length {r.max_model_len:,}: SGLang starts but "
        f"rejects longer requests; lower --max-model-len or raise --mem-fraction-static"]
    notes += [] if headroom >= 0 else [
        f"the reserve outside --mem-fraction-static ({format_gib(free_at_start - budget)}) is smaller than a "
        f"{r.max_num_batched_tokens}-token prefill chunk plus CUDA graphs ({format_gib(activation + graphs)}, "
        "modelled): expect an out-of-memory error under load; lower --mem-fraction-static or "
        "--chunked-prefill-size"]
    return ServingReport(
        server="sglang", version=r.version, model=spec.name, gpu=c.gpu.name, tp=c.tp,
        replicas=(c.gpus or c.tp) // c.tp, settings=settings(r, running), total_bytes=total, budget_bytes=budget,
        weights_bytes=weights, activation_peak_bytes=activation, non_torch_bytes=outside, cuda_graph_bytes=graphs,
        kv_cache_bytes=tokens * per_token, kv_bytes_per_token=per_token, block_size=1, num_blocks=None,
        kv_cache_tokens=tokens, max_concurrency=tokens / r.max_model_len, headroom_bytes=headroom,
        notes=tuple(notes))


def settings(r: Resolved, running: int) -> dict:
    c = r.config
    return {"tp": c.tp, "context-length": r.max_model_len, "mem-fraction-static": r.memory_fraction,
            "max-running-requests": running, "chunked-prefill-size": r.max_num_batched_tokens,
            "cuda-graph-max-bs": r.cuda_graph_max_batch, "kv-cache-dtype": c.kv_cache_dtype,
            "quantization": c.quant}


def _does_not_fit(r: Resolved, budget: int, weights: int, per_token: int) -> DoesNotFit:
    c = r.config
    need = weights + r.max_model_len * per_token
    return DoesNotFit(
        f"SGLang on {c.gpu.name} (--tp {c.tp}): --mem-fraction-static {r.memory_fraction} of the free memory gives "
        f"{format_gib(budget)}, the weights alone take {format_gib(weights)}, leaving no KV cache (SGLang stops with "
        f"\"Not enough memory\"); with one request of --max-model-len {r.max_model_len:,} it is short by "
        f"{format_gib(need - budget)}: raise --tp or --mem-fraction-static, add --quant "
        f"{'fp8 or awq' if c.gpu.bf16 else 'awq'}, or use a "
        "larger card", shortfall_bytes=need - budget)
