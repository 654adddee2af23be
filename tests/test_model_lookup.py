"""Names people type resolve to presets by one normalising rule plus a short alias table."""

import json

import pytest

from llamem.errors import UnknownModel
from llamem.model import _normalise, load_model, near_matches, preset_names
from llamem.presets import ALIASES, PRESETS, SAME_SHAPE_FINETUNES


@pytest.mark.parametrize("name, key", [
    ("meta-llama/Llama-3.1-8B-Instruct", "llama-3.1-8b"),
    ("Llama-3.1-8B-Instruct", "llama-3.1-8b"),            # no organisation: unknown before
    ("llama-3.1-8b-instruct", "llama-3.1-8b"),
    ("META-LLAMA/LLAMA-3.1-8B", "llama-3.1-8b"),
    ("meta-llama/Meta-Llama-3.1-8B-Instruct", "llama-3.1-8b"),
    ("Meta-Llama-3-8B", "llama-3-8b"),
    ("Llama-3-8B", "llama-3-8b"),
    ("meta-llama/Meta-Llama-3-70B-Instruct", "llama-3-70b"),
    ("Llama-2-7b-chat-hf", "llama-2-7b"),
    ("meta-llama/Llama-2-13b-chat", "llama-2-13b"),
    ("Llama-2-70b-hf", "llama-2-70b"),
    ("llama2-7b", "llama-2-7b"),
    ("llama3.1_8b", "llama-3.1-8b"),
    ("Llama-3.2-1B-Instruct", "llama-3.2-1b"),
    ("Llama-3.3-70B", "llama-3.3-70b"),
    ("mistralai/Mistral-7B-Instruct-v0.1", "mistral-7b-v0.1"),
    ("codellama/CodeLlama-34b-hf", "codellama-34b"),
    ("CodeLlama-7b", "codellama-7b"),
    ("huggyllama/llama-30b", "llama-33b"),
    ("llama-30b", "llama-33b"),
    ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", "tinyllama-1.1b"),
    ("  Debug ", "debug"),
])
def test_common_spellings_resolve(name, key):
    assert load_model(name).name == key


# Every spelling the alias table held before the normalising rule replaced most of it.
FORMER_ALIASES = {
    "llama-30b": "llama-33b", "llama-3.3-70b-instruct": "llama-3.3-70b", "mistral-7b": "mistral-7b-v0.1",
    "tinyllama": "tinyllama-1.1b", "TinyLlama/TinyLlama-1.1B-Chat-v1.0": "tinyllama-1.1b",
    "meta-llama/Llama-2-7b-chat-hf": "llama-2-7b", "meta-llama/Llama-2-13b-chat-hf": "llama-2-13b",
    "meta-llama/Llama-2-70b-chat-hf": "llama-2-70b", "meta-llama/Meta-Llama-3-8B-Instruct": "llama-3-8b",
    "meta-llama/Meta-Llama-3-70B-Instruct": "llama-3-70b", "meta-llama/Llama-3.1-8B-Instruct": "llama-3.1-8b",
    "meta-llama/Meta-Llama-3.1-8B": "llama-3.1-8b", "meta-llama/Llama-3.1-70B-Instruct": "llama-3.1-70b",
    "meta-llama/Llama-3.1-405B-Instruct": "llama-3.1-405b", "meta-llama/Llama-3.2-1B-Instruct": "llama-3.2-1b",
    "meta-llama/Llama-3.2-3B-Instruct": "llama-3.2-3b", "mistralai/Mistral-7B-Instruct-v0.1": "mistral-7b-v0.1",
}


@pytest.mark.parametrize("name", FORMER_ALIASES)
def test_former_aliases_still_resolve(name):
    assert load_model(name).name == FORMER_ALIASES[name]


def test_spellings_are_unambiguous():
    owner = {}
    for key, (hf_id, _source, _config) in PRESETS.items():
        for spelling in (_normalise(key), _normalise(hf_id)):
            assert owner.setdefault(spelling, key) == key, spelling
    for alias, key in ALIASES.items():
        assert key in PRESETS and owner.setdefault(_normalise(alias), key) == key, alias
    assert set(SAME_SHAPE_FINETUNES) <= set(PRESETS)


@pytest.mark.parametrize("name, near", [
    # Another model under a similar name: never resolved, but the closest preset is offered.
    ("Mistral-7B-Instruct-v0.2", "mistral-7b-v0.1"),
    ("codellama/CodeLlama-7b-Instruct-hf", "codellama-7b"),
    ("NousResearch/Llama-2-7b-hf", "llama-2-7b"),
    ("llama-3.1-8", "llama-3.1-8b"),
    ("Llama-3.1-8B-Instrct", "llama-3.1-8b"),
])
def test_unknown_names_offer_near_matches_once_each(name, near):
    with pytest.raises(UnknownModel) as err:
        load_model(name)
    assert err.value.near[0] == near
    assert len(err.value.near) == len(set(err.value.near)) and set(err.value.near) <= set(preset_names())
    assert "Looked in: presets and aliases" in str(err.value)


def test_near_matches_deduplicate_after_mapping_aliases():
    # 'llama-3.1-8b' is reachable as its key, its Hugging Face id and its 'Meta-Llama-3.1' spelling.
    found = near_matches("meta-llama/Llama-3.1-8B-Instruction")
    assert found.count("llama-3.1-8b") == 1 and found[0] == "llama-3.1-8b"


@pytest.mark.parametrize("name, key", [
    ("Qwen/Qwen2.5-7B-Instruct", "qwen2.5-7b"),
    ("qwen2.5-72b-instruct", "qwen2.5-72b"),
    ("QWEN/QWEN3-8B", "qwen3-8b"),
    ("Qwen3-30B-A3B", "qwen3-30b-a3b"),
    ("mistralai/Mixtral-8x7B-Instruct-v0.1", "mixtral-8x7b"),
    ("Mixtral-8x22B-v0.1", "mixtral-8x22b"),
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", "llama-4-scout-17b-16e"),
    ("Llama-4-Maverick-17B-128E", "llama-4-maverick-17b-128e"),
    ("mistralai/Mistral-Nemo-Instruct-2407", "mistral-nemo-12b"),
    ("Mistral-Nemo-Base-2407", "mistral-nemo-12b"),
    ("deepseek-ai/DeepSeek-R1-Distill-Llama-70B", "deepseek-r1-distill-llama-70b"),
])
def test_family_hub_ids_and_variants_resolve(name, key):
    assert load_model(name).name == key


def fake_cache(root, repo, config, commit="0123abcd"):
    """A Hugging Face hub cache as huggingface_hub lays it out: refs/main names the snapshot."""
    folder = root / ("models--" + repo.replace("/", "--"))
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(config))
    return snapshot / "config.json"


QWEN2 = {"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
         "use_sliding_window": False, "sliding_window": 4096}


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (tmp_path / "hub").mkdir()
    return tmp_path / "hub"


def test_a_hub_id_in_the_local_cache_is_read_from_there(hub_cache):
    path = fake_cache(hub_cache, "SomeLab/Tiny-Qwen-v1", QWEN2)
    for name in ("SomeLab/Tiny-Qwen-v1", "somelab/tiny-qwen-v1", "Tiny-Qwen-v1"):
        spec = load_model(name)
        assert (spec.name, spec.hf_id, spec.source) == ("SomeLab/Tiny-Qwen-v1", "SomeLab/Tiny-Qwen-v1", str(path))
        assert spec.model_type == "qwen2" and spec.qkv_bias and spec.sliding_window is None
    # A llama of the same shape (139,584) plus the q/k/v biases, 64 + 32 + 32 per layer.
    assert spec.num_params == 139_584 + 2 * 128 == 139_840
    assert load_model("SomeLab/Tiny-Qwen-v1", overrides={"num_hidden_layers": 1}).num_layers == 1


def test_a_bare_name_two_organisations_share_is_not_guessed(hub_cache):
    fake_cache(hub_cache, "LabA/Tiny", QWEN2)
    fake_cache(hub_cache, "LabB/Tiny", QWEN2)
    assert load_model("LabB/Tiny").name == "LabB/Tiny"
    with pytest.raises(UnknownModel):
        load_model("Tiny")


def test_llama4_hub_config_sizes_its_text_model(hub_cache):
    text = {"model_type": "llama4_text", "hidden_size": 64, "intermediate_size": 32, "intermediate_size_mlp": 128,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
            "vocab_size": 512, "num_local_experts": 4, "interleave_moe_layer_step": 2}
    fake_cache(hub_cache, "meta-llama/Llama-4-Tiny", {"model_type": "llama4", "text_config": text,
                                                      "vision_config": {"hidden_size": 32}})
    spec = load_model("meta-llama/Llama-4-Tiny")
    assert spec.model_type == "llama4_text" and spec.moe_layers == (1,) and spec.shared_expert_intermediate_size == 32
    assert "vision encoder" in spec.notes[0]


def test_a_name_found_nowhere_says_where_it_looked(hub_cache):
    with pytest.raises(UnknownModel) as err:
        load_model("Qwen/Qwen2.5-7B-Instrukt")
    assert err.value.near[0] == "qwen2.5-7b"
    assert f"the Hugging Face cache {hub_cache}" in str(err.value) and "HF_HUB_CACHE" in str(err.value)


def test_an_absent_cache_is_named_as_absent(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "nowhere"))
    with pytest.raises(UnknownModel, match="nowhere, which does not exist"):
        load_model("SomeLab/Tiny-Qwen-v1")


def test_a_directory_or_config_json_of_a_new_family_is_read(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(dict(QWEN2, model_type="qwen3", head_dim=16)))
    for name in (str(tmp_path), str(tmp_path / "config.json")):
        spec = load_model(name)
        assert spec.model_type == "qwen3" and spec.qk_norm == "rms" and spec.name == name
