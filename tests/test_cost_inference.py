"""The cost model's inference: one request on one replica, no gradient sync, tensor parallel's
all-reduces sized by the tokens each forward processes, device_map stages one after another."""

from __future__ import annotations

import pytest

from llamem.cluster import Cluster
from llamem.cost import MFU, communication_seconds, inference_communication_seconds, step_seconds
from llamem.gpus import get_gpu
from llamem.model import load_model
from llamem.parallel import Layout
from llamem.units import GB
from llamem.workload import build_workload

H100 = get_gpu("h100-80gb")
NODE = Cluster(gpus_per_node=8)
SPEC = load_model("llama-3.1-8b")
REQUEST = build_workload("infer", batch=4, seq=1024, new_tokens=128, precision="bf16")


def _one_gpu_seconds(spec, w) -> tuple[float, float]:
    """(prefill, decode) of one request on one H100, from the formula in llamem.cost's docstring."""
    prefill = w.batch * w.seq * 2 * spec.num_params / (H100.bf16_flops * MFU)
    kv = spec.kv_bytes_per_token(2) * w.batch * (w.seq + w.new_tokens / 2)
    decode = w.new_tokens * (2 * spec.num_params + kv) / H100.memory_bandwidth
    return prefill, decode


def test_inference_replicas_exchange_no_gradients():
    replicas = Layout(dp=4, sharding="ddp")
    assert communication_seconds(SPEC, REQUEST, replicas, H100, NODE) == 0.0
    # each replica serves its own request in one GPU's time
    assert step_seconds(SPEC, REQUEST, replicas, H100, cluster=NODE) == step_seconds(SPEC, REQUEST, Layout(),
                                                                                    H100, cluster=NODE)


def test_tensor_parallel_all_reduces_the_tokens_each_forward_processes():
    # 2 all-reduces per layer, 2·(t-1)/t of the activations each: the prompt once, then one token per sequence
    # per decoded token, in bf16, over NVLink (900 GB/s)
    tokens = 4 * 1024 + 4 * 128
    moved = 32 * 2 * 2 * 3 / 4 * tokens * 4096 * 2
    tp4 = Layout(tp=4)
    assert inference_communication_seconds(SPEC, REQUEST, tp4, H100, NODE) == pytest.approx(moved / (900 * GB),
                                                                                            rel=1e-12)
    prefill, decode = _one_gpu_seconds(SPEC, REQUEST)
    expected = (prefill + decode) / 4 + moved / (900 * GB)
    assert step_seconds(SPEC, REQUEST, tp4, H100, cluster=NODE) == pytest.approx(expected, rel=1e-12)


def test_device_map_stages_take_turns():
    prefill, decode = _one_gpu_seconds(SPEC, REQUEST)
    for stages in (1, 2, 4):
        seconds = step_seconds(SPEC, REQUEST, Layout(pp=stages), H100, cluster=NODE)
        assert seconds == pytest.approx(prefill + decode, rel=1e-12)


def test_a_longer_prompt_costs_tensor_parallel_once_not_per_decoded_token():
    short, long = (build_workload("infer", batch=1, seq=s, new_tokens=256, precision="bf16") for s in (1024, 2048))
    extra = (inference_communication_seconds(SPEC, long, Layout(tp=2), H100, NODE)
             - inference_communication_seconds(SPEC, short, Layout(tp=2), H100, NODE))
    assert extra == pytest.approx(32 * 2 * 2 * 1 / 2 * 1024 * 4096 * 2 / (900 * GB), rel=1e-9)
