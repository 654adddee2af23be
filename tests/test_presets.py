"""Tier 1: exact facts. Every preset's parameter count equals the transformers model's.

Only the checks that build a transformers model need torch; they import it themselves
(pytest.importorskip), so everything else here runs, and fails, without it.
"""

import pytest

from llamem.model import load_model, preset_names
from llamem.units import KiB


def hf_num_params(spec):
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from llamem.trace.build import hf_config
    from llamem.workload import Workload

    cls = transformers.MistralForCausalLM if spec.model_type == "mistral" else transformers.LlamaForCausalLM
    with torch.device("meta"):
        model = cls(hf_config(spec, Workload()))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", [n for n in preset_names() if n != "llama-3.1-405b"])
def test_param_count_matches_transformers(name):
    spec = load_model(name)
    assert spec.num_params == hf_num_params(spec)


def test_405b_param_count_matches_transformers_on_a_slice():
    # 126 layers on meta is slow-ish; the per-layer count is what matters, so check 2 layers.
    spec = load_model("llama-3.1-405b", overrides={"num_hidden_layers": 2})
    assert spec.num_params == hf_num_params(spec)


def test_405b_published_count():
    assert load_model("llama-3.1-405b").num_params == 405_853_388_800


def test_published_counts():
    assert load_model("llama-2-7b").num_params == 6_738_415_616
    assert load_model("llama-3.1-8b").num_params == 8_030_261_248
    assert load_model("llama-3.2-1b").num_params == 1_235_814_400  # tied head


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
    assert spec.model_type in ("llama", "mistral")
