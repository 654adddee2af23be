"""Serving on vLLM and SGLang: what each server's start-up log will report for a launch (weights, the
profile run's activation peak, non-torch and CUDA-graph memory, KV-cache bytes, blocks or tokens, the
maximum concurrency), and the cheapest launch settings that serve a target load.

Pure arithmetic over `ModelSpec` and `GPU`, torch-free. Each server's accounting is read from its
source at a stated commit (`llamem.serving.vllm`, `llamem.serving.sglang`); docs/serving.md compares
it with published start-up logs.
"""

from __future__ import annotations

from llamem.model import ModelSpec
from llamem.serving.config import SERVERS, ServerConfig
from llamem.serving.report import ServingReport


def serving_report(spec: ModelSpec, config: ServerConfig) -> ServingReport:
    """The start-up figures of one launch; raises DoesNotFit where the server would refuse to start."""
    from llamem.serving import sglang, vllm

    return (vllm if config.server == "vllm" else sglang).report(spec, config)


__all__ = ["SERVERS", "ServerConfig", "ServingReport", "serving_report"]
