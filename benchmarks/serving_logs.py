"""`llamem estimate --server` against published vLLM / SGLang start-up logs.

Each row is a start-up log quoted in a public issue or pull request: model, card, server version,
settings, and the KV-cache figure the server printed (vLLM's "# GPU blocks" / "GPU KV cache size",
SGLang's "KV Cache is allocated. #tokens"). The prediction comes from `llamem.serving` at the version
era of the log; the error is (predicted - reported) / reported, in KV-cache tokens.
Usage: python benchmarks/serving_logs.py [--out benchmarks/results/serving_logs.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from llamem.errors import DoesNotFit
from llamem.gpus import get_gpu
from llamem.model import load_model, spec_from_config
from llamem.serving import ServerConfig, serving_report

# Qwen/Qwen3-235B-A22B(-FP8) config.json (no preset: llamem's presets stop at Qwen3-30B-A3B).
QWEN3_235B = {"model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
              "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64,
              "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "num_experts": 128,
              "num_experts_per_tok": 8, "max_position_embeddings": 40960, "tie_word_embeddings": False,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "rms_norm_eps": 1e-6, "rope_theta": 1000000.0}

V10517 = "https://github.com/vllm-project/vllm/issues/10517"
V2031 = "https://github.com/vllm-project/vllm/pull/2031"
V21348 = "https://github.com/vllm-project/vllm/issues/21348"
FIELDS = ("source", "what", "model", "gpu", "server", "version", "server_release", "settings", "reported_tokens")
LOGS = [dict(zip(FIELDS, row, strict=True)) for row in (
    (V10517, "comment 2024-12-02, 1952 blocks", "llama-3.1-8b", "rtx-3090", "vllm", "v0", "0.6.4",
     {"max_model_len": 20000}, 1952 * 16),
    (V10517, "comment 2024-12-02, refused at 29k", "llama-3.1-8b", "rtx-3090", "vllm", "v0", "0.6.4",
     {"max_model_len": 29000}, 23648),
    (V2031, "Llama2-7B TP1, main before the PR, 7449 blocks", "llama-2-7b", "a100-80gb", "vllm", "v0", "0.2.3",
     {}, 7449 * 16),
    (V2031, "Llama2-70B TP4, main before the PR, 31615 blocks", "llama-2-70b", "a100-80gb", "vllm", "v0", "0.2.3",
     {"tp": 4}, 31615 * 16),
    (V2031, "Llama2-7B TP1, 7351 blocks", "llama-2-7b", "a100-80gb", "vllm", "v0", "0.2.4", {}, 7351 * 16),
    (V2031, "Llama2-70B TP4, 20865 blocks", "llama-2-70b", "a100-80gb", "vllm", "v0", "0.2.4", {"tp": 4}, 20865 * 16),
    (V21348, "vLLM side", "qwen3-235b-a22b-fp8", "h100-80gb", "vllm", "v1", "0.9.x (July 2025)",
     {"tp": 4, "quant": "fp8"}, 178880),
    (V21348, "SGLang side", "qwen3-235b-a22b-fp8", "h100-80gb", "sglang", "0.4", "0.4.9 (July 2025)",
     {"tp": 4, "quant": "fp8", "mem_fraction_static": 0.93}, 367404),
)]


def _spec(name: str):
    if name == "qwen3-235b-a22b-fp8":
        return spec_from_config(QWEN3_235B, name="Qwen/Qwen3-235B-A22B-FP8")
    return load_model(name)


def predict(row: dict) -> dict:
    spec = _spec(row["model"])
    config = ServerConfig(server=row["server"], gpu=get_gpu(row["gpu"]), version=row["version"], **row["settings"])
    try:
        tokens = serving_report(spec, config).kv_cache_tokens
    except DoesNotFit:  # vLLM refused this launch too, after logging the KV tokens
        tokens = _tokens_from_refusal(spec, config)
    error = (tokens - row["reported_tokens"]) / row["reported_tokens"]
    return row | {"predicted_tokens": tokens, "error": round(error, 4)}


def _tokens_from_refusal(spec, config) -> int:
    """KV tokens of a launch vLLM refuses (one request does not fit): the same arithmetic at a length that
    fits, since the KV budget does not depend on max_model_len once max_num_batched_tokens is fixed."""
    from llamem.serving import vllm

    r = vllm.resolve(spec, config)
    fixed = ServerConfig(**{f: getattr(config, f) for f in config.__slots__} | {
        "max_model_len": 1, "max_num_batched_tokens": r.max_num_batched_tokens})
    return serving_report(spec, fixed).kv_cache_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="benchmarks/results/serving_logs.json")
    args = parser.parse_args(argv)
    rows = [predict(row) for row in LOGS]
    print(f"{'model':<22}{'gpu':<11}{'server':<16}{'reported':>10}{'predicted':>11}{'error':>9}  source")
    for r in rows:
        print(f"{r['model']:<22}{r['gpu']:<11}{r['server'] + ' ' + r['server_release'].split()[0]:<16}"
              f"{r['reported_tokens']:>10,}{r['predicted_tokens']:>11,}{r['error']:>+9.1%}  {r['source']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
