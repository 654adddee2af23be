"""Llama 4 in the analytic engine (`analytic/llama4.py`, `llama4_moments.py`): held to the trace engine on
narrow 4-layer models cut from the presets (every per-layer term scales, so the narrow ones check each term);
the full-size rows are `benchmarks/accuracy.py:llama4_rows`."""

from __future__ import annotations

import warnings

import pytest

from llamem.analytic import estimate
from llamem.errors import InvalidWorkload
from llamem.model import load_model
from llamem.workload import build_workload

# Scout's layer 3 is NoPE (global, temperature-tuned), layers 0-2 chunked RoPE with L2 q/k norms; Maverick's
# layers 1 and 3 are mixtures of experts, 0 and 2 dense, and it has no q/k norms.
NARROW = dict(num_hidden_layers=4, hidden_size=256, intermediate_size=256, intermediate_size_mlp=512,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024, num_local_experts=4)


def narrow(name: str, **extra):
    return load_model(name, overrides={**NARROW, **extra})


@pytest.mark.parametrize("name, extra, options", [
    # sequences past a 64-token chunk: materialised masks, GQA repeated in the chunked layers
    ("llama-4-scout-17b-16e", {"attention_chunk_size": 64},
     dict(task="train", precision="bf16", optimizer="sgd", batch=2, seq=128)),
    ("llama-4-maverick-17b-128e", {}, dict(task="lora", precision="bf16", optimizer="adamw", batch=2, seq=256)),
    ("llama-4-maverick-17b-128e", {}, dict(task="infer", precision="bf16", batch=2, seq=128, new_tokens=4)),
])
def test_analytic_equals_the_trace(name, extra, options):
    from llamem.trace.compare import compare

    result = compare(narrow(name, **extra), build_workload(**options))
    assert result.analytic_peak_bytes == result.traced_peak_bytes
    assert result.ok, result.category_errors


@pytest.mark.parametrize("options", [
    # the window fills during decoding: the chunked layers' caches stop at the chunk, the global one grows
    dict(task="infer", precision="bf16", batch=2, seq=24, new_tokens=12),
    # a chunked prefill past the chunk: windowed and global caches, batch-wide chunked masks
    dict(task="infer", precision="bf16", batch=2, seq=100, new_tokens=3, prefill_chunk=40),
])
def test_generation_past_the_chunk_equals_the_trace_in_every_phase(options):
    from llamem.trace.run import trace

    spec, workload = narrow("llama-4-scout-17b-16e", attention_chunk_size=32), build_workload(**options)
    analytic, traced = estimate(spec, workload), trace(spec, workload)
    assert analytic.peak_allocated_bytes == traced.peak_allocated_bytes
    assert analytic.phases["prefill"] == traced.phases["prefill"]
    assert analytic.phases["decode"]["kv_cache"] == traced.phases["decode"]["kv_cache"]


def test_a_prompt_past_the_chunk_stays_whole_until_the_first_decode_step():
    scout = load_model("llama-4-scout-17b-16e")
    report = estimate(scout, build_workload(task="infer", precision="bf16", batch=1, seq=16384, new_tokens=8))
    token_bytes = 8 * 128 * 2  # one layer's K (or V) per token: 8 kv heads of 128, bf16
    # every layer's K and V hold the 16,384-token prompt while layer 0 (chunked) makes its 8,192-token ones
    assert report.phases["decode"]["kv_cache"] == token_bytes * (2 * 48 * 16384 + 2 * 8192)


@pytest.mark.parametrize("name", ["llama-4-scout-17b-16e", "llama-4-maverick-17b-128e"])
def test_param_count_matches_transformers(name):
    torch = pytest.importorskip("torch")
    from llamem.trace.build import hf_config, hf_model_class
    from llamem.workload import Workload

    spec = load_model(name, overrides={"num_hidden_layers": 4})
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        model = hf_model_class(spec)(hf_config(spec, Workload()))
    assert spec.num_params == sum(p.numel() for p in model.parameters())


def test_presets_are_sized():
    scout = load_model("llama-4-scout-17b-16e")
    report = estimate(scout, build_workload(task="lora", precision="bf16", optimizer="adamw", batch=1, seq=1024))
    assert report.peak_allocated_bytes > scout.num_params * 2  # bf16 weights and every expert's activations


@pytest.mark.parametrize("options, message", [
    (dict(task="lora", precision="bf16-mixed", optimizer="adamw"), "use --precision bf16"),
    (dict(task="lora", precision="bf16", optimizer="adamw", lora_targets=("q_proj", "gate_proj")),
     "adapt attention"),
    (dict(task="train", precision="bf16", optimizer="sgd", attn="eager"), "use --attn sdpa"),
])
def test_what_is_not_sized_is_refused_by_name(options, message):
    with pytest.raises(InvalidWorkload, match=message) as err:
        estimate(load_model("llama-4-scout-17b-16e"), build_workload(**options))
    assert "`llamem trace meta-llama/Llama-4-Scout-17B-16E ...`" in str(err.value)
