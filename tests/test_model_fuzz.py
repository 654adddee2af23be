"""Random configs, names and --override strings: llamem returns a valid ModelSpec or raises its own errors.

And where transformers can be asked, llamem agrees with it: a config llamem accepts is one that
LlamaConfig / MistralConfig accept and build on the meta device with the same parameter count;
a config transformers refuses (or cannot build) llamem refuses too. llamem may refuse more
(0 layers, odd head_dim, a truncated head_dim): those configs build but cannot run as meant.
"""

import json
import os
import tempfile
import warnings

import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from llamem.errors import ConfigError, UnknownModel, UsageError
from llamem.model import FIELDS, ModelSpec, load_model, parse_overrides, spec_from_config

EXPECTED = (ConfigError, UsageError, UnknownModel)

# Any JSON value, and then some: what a hand-edited or wrong file may hold in a field.
junk = st.recursive(
    st.none() | st.booleans() | st.text(max_size=8) | st.floats(allow_nan=True, allow_infinity=True)
    | st.integers(-(10**30), 10**30) | st.sampled_from([0, -1, 1, 2, 4, 64, 2048, 2048.0, 2048.7, "64", "false"]),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=6,
)
model_types = st.sampled_from(["llama", "mistral"]) | junk
configs = st.fixed_dictionaries({}, optional={"model_type": model_types, **{key: junk for key in FIELDS},
                                              "quantization_config": junk, "architectures": junk})


def check(result_or_error):
    kind, value = result_or_error
    if kind == "spec":
        assert isinstance(value, ModelSpec)
        assert value.num_params > 0 and value.num_heads % value.num_kv_heads == 0
    else:
        assert isinstance(value, EXPECTED), repr(value)


def attempt(call, *args, **kwargs):
    try:
        return "spec", call(*args, **kwargs)
    except EXPECTED as err:
        return "error", err


fuzz = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@fuzz
@given(config=configs)
def test_random_config_dicts(config):
    check(attempt(spec_from_config, config, name="fuzz"))


@fuzz
@given(config=configs | junk)
def test_random_config_files(config):
    try:
        text = json.dumps(config)
    except ValueError:  # integers past json's digit limit cannot be written
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        with open(path, "w") as f:
            f.write(text)
        check(attempt(load_model, config_path=path))
        check(attempt(load_model, tmp))  # a directory named as the model


@fuzz
@given(data=st.binary(max_size=64))
def test_random_bytes_as_a_config_file(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.json")
        with open(path, "wb") as f:
            f.write(data)
        check(attempt(load_model, path))


override_values = (st.text(max_size=10) | st.sampled_from(["null", "none", "true", "False", "0", "-1", "2048.0",
                                                             "1e-5", "nan", "inf", "9" * 40, "4"])
                   | st.integers(-(10**20), 10**20).map(str) | st.floats().map(str))
override_items = st.one_of(
    st.text(max_size=20),
    st.tuples(st.sampled_from(list(FIELDS)) | st.text(max_size=6), override_values).map("=".join),
)


@fuzz
@given(items=st.lists(override_items, max_size=4), model=st.sampled_from(["debug", "mistral-7b-v0.1", "llama-3.2-1b"]))
def test_random_overrides(items, model):
    try:
        overrides = parse_overrides(items)
    except ConfigError:
        return
    assert isinstance(overrides, dict) and set(overrides) <= set(FIELDS)
    check(attempt(load_model, model, overrides=overrides))


@fuzz
@given(name=st.text(max_size=40) | st.sampled_from(["", ".", "/", "~", "x.json", "meta-llama/", "-instruct"]))
def test_random_model_names(name):
    check(attempt(load_model, name))


# Near-valid configs: small shapes with one or two fields swapped for a value transformers may refuse.
small = {"hidden_size": st.sampled_from([16, 24, 32, 48, 64]), "intermediate_size": st.sampled_from([8, 16, 32]),
         "num_hidden_layers": st.sampled_from([1, 2]), "num_attention_heads": st.sampled_from([1, 2, 3, 4, 8]),
         "num_key_value_heads": st.sampled_from([None, 1, 2, 4, 8]), "head_dim": st.sampled_from([None, 4, 6, 8, 16]),
         "vocab_size": st.sampled_from([16, 32]), "max_position_embeddings": st.sampled_from([64, 128]),
         "tie_word_embeddings": st.booleans(), "attention_bias": st.booleans(), "mlp_bias": st.booleans(),
         "sliding_window": st.sampled_from([None, 8, 4096]), "rms_norm_eps": st.sampled_from([1e-5, 1e-6]),
         "rope_theta": st.sampled_from([10000.0, 500000, 1e6])}
mutation = st.sampled_from([0, -1, -16, 2.0, 16.0, 16.5, True, False, None, "16", "true", [16], float("nan")])


@st.composite
def near_valid_configs(draw):
    config = {"model_type": draw(st.sampled_from(["llama", "mistral"]))}
    for key, values in small.items():
        if draw(st.booleans()) or FIELDS[key].required:
            config[key] = draw(values)
    for key in draw(st.lists(st.sampled_from(list(small)), max_size=2)):
        config[key] = draw(mutation)
    return config


def transformers_verdict(config):
    """The parameter count transformers builds, or None where its config class or model refuses."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    mistral = config["model_type"] == "mistral"
    cls = transformers.MistralForCausalLM if mistral else transformers.LlamaForCausalLM
    config_cls = transformers.MistralConfig if mistral else transformers.LlamaConfig
    try:
        with warnings.catch_warnings(), torch.device("meta"):
            warnings.simplefilter("ignore")
            model = cls(config_cls(**config))
    except Exception:  # noqa: BLE001 - any refusal counts: a typed error, a ZeroDivisionError, a negative size
        return None
    return sum(p.numel() for p in model.parameters())


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=near_valid_configs())
def test_llamem_agrees_with_transformers(config):
    hf_params = transformers_verdict(config)
    kind, result = attempt(spec_from_config, config, name="fuzz")
    llamem = "accepts" if kind == "spec" else "refuses"
    event(f"transformers {'refuses' if hf_params is None else 'builds'}, llamem {llamem}")
    if hf_params is None:
        assert kind == "error", f"transformers refuses {config}, llamem accepts it"
    elif kind == "spec":
        assert result.num_params == hf_params, config
    else:
        assume(False)  # stricter than transformers on purpose (see the module docstring)
