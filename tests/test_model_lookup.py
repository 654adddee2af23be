"""Names people type resolve to presets by one normalising rule plus a short alias table."""

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
