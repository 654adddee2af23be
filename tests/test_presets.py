"""Tier 1: exact facts. Every preset's parameter count equals the transformers model's.

Only the checks that build a transformers model need torch; they import it themselves
(pytest.importorskip), so everything else here runs, and fails, without it.
"""

import pytest

from llamem.model import SUPPORTED_MODEL_TYPES, load_model, preset_names
from llamem.units import KiB


def hf_model(spec):
    pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from llamem.trace.build import hf_config, hf_model_class
    from llamem.workload import Workload

    with torch.device("meta"):
        return hf_model_class(spec)(hf_config(spec, Workload()))


# Built whole on meta, except where 100+ layers of experts make that slow: there the per-layer counts
# are what matter, checked on a slice that keeps every kind of layer (Maverick alternates dense and MoE).
SLICED = {"llama-3.1-405b": 2, "llama-4-maverick-17b-128e": 2, "mixtral-8x22b": 2, "llama-4-scout-17b-16e": 2,
          "qwen3-30b-a3b": 2}


@pytest.mark.parametrize("name", preset_names())
def test_param_count_matches_transformers(name):
    overrides = {"num_hidden_layers": SLICED[name]} if name in SLICED else {}
    spec = load_model(name, overrides=overrides)
    model = hf_model(spec)
    assert spec.num_params == sum(p.numel() for p in model.parameters())
    # Each layer's inventory names every parameter transformers builds, with its size.
    for index, layer in enumerate(model.model.layers):
        assert dict(spec.layer_params(index)) == {n: p.numel() for n, p in layer.named_parameters()}


def test_405b_published_count():
    assert load_model("llama-3.1-405b").num_params == 405_853_388_800


def test_published_counts():
    assert load_model("llama-2-7b").num_params == 6_738_415_616
    assert load_model("llama-3.1-8b").num_params == 8_030_261_248
    assert load_model("llama-3.2-1b").num_params == 1_235_814_400  # tied head
    assert load_model("mixtral-8x7b").num_params == 46_702_792_704
    assert load_model("qwen2.5-7b").num_params == 7_615_616_512
    assert load_model("qwen3-8b").num_params == 8_190_735_360
    assert load_model("qwen3-30b-a3b").num_params == 30_532_122_624
    assert load_model("llama-4-scout-17b-16e").num_params == 107_769_861_120  # text model: 109B with vision


@pytest.mark.parametrize("name, kib_per_token", [
    ("llama-2-7b", 512),      # 2 * 32 layers * 4096 * 2 B: no GQA
    ("llama-3.1-8b", 128),    # 8 KV heads of 128: a quarter
    ("llama-2-70b", 320),
    ("llama-3.2-1b", 32),
    ("tinyllama-1.1b", 22),
    ("mistral-7b-v0.1", 128),
])
def test_kv_bytes_per_token(name, kib_per_token):
    assert load_model(name).kv_bytes_per_token(2) == kib_per_token * KiB


def test_lookup_by_hf_id_alias_and_case():
    assert load_model("meta-llama/Llama-2-7b-hf").name == "llama-2-7b"
    assert load_model("Llama-3.1-8B").name == "llama-3.1-8b"
    assert load_model("meta-llama/Llama-3.1-8B-Instruct").name == "llama-3.1-8b"


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_passes_the_config_rules_and_cites_its_source(name):
    spec = load_model(name)
    assert spec.source and spec.hf_id and spec.notes == ()
    assert spec.model_type in SUPPORTED_MODEL_TYPES
