"""The cheapest launch that serves C concurrent requests of L tokens on one card type.

Cost order: fewest GPUs (TP degree) first; then the fewest numerics changes: as served, then an fp8
KV cache, fp8 weights, both, 4-bit AWQ weights, AWQ with an fp8 KV cache; then the largest
max_num_batched_tokens (chunked-prefill size) that still fits, for prefill throughput. Every launch
sets max_num_seqs (SGLang: max_running_requests) to C and max_model_len to L, so the profile run and
the sampler are sized for the load and not for the server's defaults.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass

from llamem.errors import DoesNotFit, LlamemError
from llamem.gpus import GPU
from llamem.model import ModelSpec
from llamem.serving import serving_report
from llamem.serving.config import ServerConfig
from llamem.serving.report import ServingReport

LADDER = (("none", "auto"), ("none", "fp8"), ("fp8", "auto"), ("fp8", "fp8"), ("awq", "auto"), ("awq", "fp8"))
"""(weights, KV cache) in the order tried: each step changes the numerics more than the one before."""
BATCHED_TOKENS = (8192, 4096, 2048, 1024, 512)


@dataclass(frozen=True, kw_only=True, slots=True)
class ServingPlan:
    fits: bool
    concurrency: int
    seq: int
    report: ServingReport
    """The chosen launch, or the closest one when nothing fits."""
    tried: int
    max_gpus: int
    command: str


def tp_degrees(spec: ModelSpec, max_gpus: int) -> list[int]:
    """TP degrees both servers accept for this model, up to max_gpus: divisors of the attention heads
    that divide or are multiples of the KV heads."""
    return [tp for tp in range(1, max_gpus + 1)
            if not spec.num_heads % tp and (not spec.num_kv_heads % tp or not tp % spec.num_kv_heads)]


def candidates(spec: ModelSpec, server: str, gpu: GPU, concurrency: int, seq: int, max_gpus: int,
               dtype_bytes: int = 2):
    """Launches in cost order. vLLM refuses max_num_batched_tokens below max_num_seqs, so its chunk sizes
    start at the concurrency."""
    quant_ok = gpu.bf16  # fp8 weights (Marlin) and fp8 KV caches need Ampere or newer
    floor = concurrency if server == "vllm" else 1
    chunks = sorted({max(batched, floor) for batched in BATCHED_TOKENS}, reverse=True)
    for tp in tp_degrees(spec, max_gpus):
        for quant, kv in LADDER:
            if not quant_ok and "fp8" in (quant, kv):
                continue
            for batched in chunks:
                yield ServerConfig(server=server, gpu=gpu, tp=tp, max_model_len=seq, max_num_seqs=concurrency,
                                   max_num_batched_tokens=batched, kv_cache_dtype=kv, quant=quant,
                                   dtype_bytes=dtype_bytes)


def plan_serving(spec: ModelSpec, *, server: str, gpu: GPU, concurrency: int, seq: int,
                 max_gpus: int, dtype_bytes: int = 2) -> ServingPlan:
    """The first launch in cost order whose KV cache holds `concurrency` requests of `seq` tokens; when
    none does, the one that comes closest (fits=False)."""
    if concurrency < 1 or seq < 1:
        raise LlamemError("--concurrency and --seq must be at least 1")
    if max_gpus < 1:
        raise LlamemError(f"--gpus must be at least 1, got {max_gpus}")
    if seq > spec.max_position_embeddings:
        raise LlamemError(f"--seq {seq:,} is over the model's limit of {spec.max_position_embeddings:,} tokens "
                          f"(max_position_embeddings of {spec.name}): lower --seq")
    best, closest, tried = None, None, 0
    for config in candidates(spec, server, gpu, concurrency, seq, max_gpus, dtype_bytes):
        tried += 1
        try:
            report = serving_report(spec, config)
        except DoesNotFit as err:
            if closest is None or err.shortfall_bytes < closest.shortfall_bytes:
                closest = err
            continue
        if report.max_concurrency >= concurrency and report.headroom_bytes >= 0:
            return ServingPlan(fits=True, concurrency=concurrency, seq=seq, report=report, tried=tried,
                               max_gpus=max_gpus, command=launch_command(spec, report))
        if best is None or report.max_concurrency > best.max_concurrency:
            best = report
    if best is None:
        raise DoesNotFit(f"no {server} launch of {spec.name} on up to {max_gpus} x {gpu.name} holds even one request "
                         f"of {seq:,} tokens; the closest: {closest}", shortfall_bytes=closest.shortfall_bytes)
    return ServingPlan(fits=False, concurrency=concurrency, seq=seq, report=best, tried=tried, max_gpus=max_gpus,
                       command=launch_command(spec, best))


def plan_does_not_fit(plan: ServingPlan) -> DoesNotFit:
    r = plan.report
    return DoesNotFit(
        f"no {r.server} launch on up to {plan.max_gpus} x {r.gpu} holds {plan.concurrency} requests of "
        f"{plan.seq:,} tokens; the closest, {_describe(r)}, holds {r.max_concurrency:.2f}: lower --concurrency "
        "or --seq, or allow more GPUs (--gpus)", best_plan=plan,
        shortfall_bytes=int((plan.concurrency - r.max_concurrency) * plan.seq * r.kv_bytes_per_token))


def _describe(r: ServingReport) -> str:
    return (f"--tp {r.tp}, weights {r.settings['quantization']}, KV {r.settings['kv-cache-dtype']}")


_DEFAULT_FLAGS = (("kv-cache-dtype", "auto"), ("quantization", "none"))

# Each server's setting -> the `llamem estimate --server` flag that sets it.
_ESTIMATE_FLAGS = {"tensor-parallel-size": "--tp", "tp": "--tp", "max-model-len": "--max-model-len",
                   "context-length": "--max-model-len", "gpu-memory-utilization": "--gpu-memory-utilization",
                   "mem-fraction-static": "--mem-fraction-static", "max-num-seqs": "--max-num-seqs",
                   "max-running-requests": "--max-num-seqs", "max-num-batched-tokens": "--max-num-batched-tokens",
                   "chunked-prefill-size": "--max-num-batched-tokens", "kv-cache-dtype": "--kv-cache-dtype",
                   "quantization": "--quant"}


def estimate_command(model: str, r: ServingReport) -> str:
    """The `llamem estimate --server` command that gives these figures, every setting spelled out. `model`
    is shell-ready already (a quoted name, or `--config PATH` and `--override` words)."""
    args = ["--task", "infer", "--server", r.server, "--gpu", r.gpu, "--server-version", r.version]
    if r.replicas > 1:
        args += ["--gpus", str(r.replicas * r.tp)]
    for key, value in r.settings.items():
        if key in _ESTIMATE_FLAGS:
            args += [_ESTIMATE_FLAGS[key], str(value)]
    return " ".join(["llamem", "estimate", model] + [shlex.quote(a) for a in args])


def launch_command(spec: ModelSpec, r: ServingReport) -> str:
    """The `vllm serve` / `python -m sglang.launch_server` line that applies the settings."""
    model = spec.hf_id or _checkpoint_dir(spec)
    quant = r.settings["quantization"]
    if quant in ("awq", "gptq"):
        model = f"<{quant.upper()} checkpoint of {model}>"
    if r.server == "vllm":
        args = ["vllm", "serve", model] + [f"--{k}={v}" for k, v in r.settings.items() if (k, v) not in _DEFAULT_FLAGS]
    else:
        shown = {k: v for k, v in r.settings.items() if k != "cuda-graph-max-bs"}
        if shown["kv-cache-dtype"] == "fp8":
            shown["kv-cache-dtype"] = "fp8_e4m3"
        args = ["python", "-m", "sglang.launch_server", "--model-path", model] + [
            f"--{k}={v}" for k, v in shown.items() if (k, v) not in _DEFAULT_FLAGS]
    return " ".join(shlex.quote(a) for a in args)


def _checkpoint_dir(spec: ModelSpec) -> str:
    """A server loads a checkpoint directory, not a config file: a config.json read from disk stands for the
    directory that holds it (with its weights)."""
    from pathlib import Path

    read_from_disk = spec.source.endswith(".json") and "://" not in spec.source
    return str(Path(spec.source).parent) if read_from_disk else spec.name
