"""Config files and --override values: one table of rules, transformers' own, with errors that name the fix."""

import json
import subprocess
import sys

import pytest

from llamem.errors import EXIT_USAGE, ConfigError, UnknownModel, UsageError
from llamem.model import FIELDS, _DEFAULTS, load_model, parse_overrides, read_config, spec_from_config

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
MISTRAL = dict(LLAMA, model_type="mistral")


def refused(config, *fragments, **kwargs):
    with pytest.raises(ConfigError) as err:
        spec_from_config(config, name="cfg.json", **kwargs)
    for fragment in fragments:
        assert fragment in str(err.value), str(err.value)
    return str(err.value)


@pytest.mark.parametrize("field, value, fragments", [
    # The bug report's cases: each used to pass, truncate or fall back silently.
    ("hidden_size", 64.7, ["hidden_size=64.7", "whole number", "not a float"]),
    ("hidden_size", 64.0, ["hidden_size=64.0", "write 64"]),  # transformers refuses 64.0 too
    ("num_key_value_heads", 0, ["num_key_value_heads=0", "0 does not mean the default", "write null"]),
    ("head_dim", 0, ["head_dim=0", "0 does not mean the default"]),
    ("hidden_size", -64, ["hidden_size=-64", "at least 1"]),
    ("tie_word_embeddings", "false", ['tie_word_embeddings="false"', "write false without quotes"]),
    ("attention_bias", 1, ["attention_bias=1", "JSON boolean", "not an integer"]),
    ("mlp_bias", None, ["mlp_bias=null", "remove the field for the default (false)"]),
    ("hidden_size", None, ["hidden_size=null", "give a positive whole number"]),
    ("hidden_size", "64", ['hidden_size="64"', "write 64 without quotes"]),
    ("hidden_size", True, ["hidden_size=true", "not a boolean"]),
    ("vocab_size", [100], ["vocab_size=[100]", "not a list"]),
    ("intermediate_size", 2**63, ["larger than 2**63 - 1"]),
    ("num_hidden_layers", 1025, ["at most 1,024"]),
    ("rms_norm_eps", 1, ["rms_norm_eps=1", "refuses an integer"]),
    ("rms_norm_eps", "1e-5", ['rms_norm_eps="1e-5"', "without quotes"]),
    ("rope_theta", float("nan"), ["rope_theta=NaN", "finite number above 0"]),
    ("rope_theta", 0, ["rope_theta=0", "above 0"]),
])
def test_bad_field_values_are_refused_with_the_value_and_the_fix(field, value, fragments):
    message = refused(dict(LLAMA, **{field: value}), *fragments)
    assert message.startswith("cfg.json: ")


def test_hidden_size_must_split_into_heads():
    # LlamaConfig.validate_architecture refuses it even with head_dim set ...
    refused(dict(LLAMA, hidden_size=66), "hidden_size=66 is not a multiple of num_attention_heads=4")
    refused(dict(LLAMA, hidden_size=66, head_dim=16), "LlamaConfig refuses it, even with head_dim set")
    # ... MistralConfig only derives head_dim by truncating division: refused without head_dim, fine with it.
    refused(dict(MISTRAL, hidden_size=66), "truncated", "set head_dim")
    assert spec_from_config(dict(MISTRAL, hidden_size=66, head_dim=16), name="m").head_dim == 16


def test_gqa_groups_and_rope_pairs():
    refused(dict(LLAMA, num_key_value_heads=3), "num_attention_heads=4 is not a multiple of num_key_value_heads=3",
            "use a divisor of 4 (1, 2, 4)")
    refused(dict(LLAMA, head_dim=7), "head_dim=7 is odd")


def test_null_means_the_default_where_transformers_says_so():
    spec = spec_from_config(dict(LLAMA, num_key_value_heads=None, head_dim=None), name="cfg")
    assert (spec.num_kv_heads, spec.head_dim) == (4, 16)
    # MistralConfig declares num_key_value_heads `int`: its @strict check refuses null.
    refused(dict(MISTRAL, num_key_value_heads=None), "MistralConfig does not accept null",
            "remove the field for the default (8)")
    assert spec_from_config(dict(MISTRAL, sliding_window=None), name="m").sliding_window is None
    refused(dict(MISTRAL, sliding_window=0), "sliding_window=0", "write null")


def test_absent_fields_take_transformers_defaults_per_model_type():
    llama = spec_from_config({k: v for k, v in LLAMA.items() if k != "num_key_value_heads"}, name="l")
    assert (llama.num_kv_heads, llama.max_position_embeddings, llama.sliding_window) == (4, 2048, None)
    mistral = dict(MISTRAL, num_attention_heads=8, hidden_size=128)
    del mistral["num_key_value_heads"]
    spec = spec_from_config(mistral, name="m")
    assert (spec.num_kv_heads, spec.max_position_embeddings, spec.sliding_window) == (8, 131072, 4096)
    # Mistral's default of 8 KV heads cannot serve 4 query heads: say where the 8 came from.
    refused({k: v for k, v in MISTRAL.items() if k != "num_key_value_heads"}, "MistralConfig's default when absent")


def test_defaults_table_matches_transformers():
    transformers = pytest.importorskip("transformers")
    required = {k: LLAMA[k] for k, rule in FIELDS.items() if rule.required}
    from llamem.model import HF_CLASSES

    for model_type, (cls_name, _model, _layer) in HF_CLASSES.items():
        cls = getattr(transformers, cls_name)
        for key, value in _DEFAULTS[model_type].items():
            # The class default before __post_init__ (which derives moe_layers, turns sliding_window off...).
            assert cls.__dataclass_fields__[key].default == value, (model_type, key)


def test_every_problem_is_reported_at_once():
    message = refused(dict(LLAMA, hidden_size=-1, vocab_size=True, mlp_bias=1), "3 problems")
    assert all(f in message for f in ("hidden_size=-1", "vocab_size=true", "mlp_bias=1"))
    refused({"model_type": "llama", "hidden_size": 64}, "missing intermediate_size, num_hidden_layers")


def test_model_types():
    refused(dict(LLAMA, model_type="gpt2", architectures=["GPT2LMHeadModel"]), "not a LLaMA-family", "GPT2LMHeadModel")
    refused({k: v for k, v in LLAMA.items() if k != "model_type"}, 'add "model_type": "llama"')
    refused(dict(LLAMA, model_type=["llama"]), "not a LLaMA-family")
    with pytest.raises(ConfigError, match="not a list"):
        spec_from_config([LLAMA], name="cfg")


def test_overrides_are_typed_and_checked_by_the_same_rules():
    assert parse_overrides(["num_hidden_layers=2", "tie_word_embeddings=false", "head_dim=null",
                            "rms_norm_eps=1", "rope_theta=500000"]) == {
        "num_hidden_layers": 2, "tie_word_embeddings": False, "head_dim": None,
        "rms_norm_eps": 1.0, "rope_theta": 500000}
    for item, fragment in [("hidden_size=2048.7", "whole number"), ("tie_word_embeddings=maybe", "true or false"),
                           ("hidden_size", "write key=value"), ("rope_theta=fast", "expected a number"),
                           ("hiden_size=2", "Did you mean hidden_size"), ("hidden_size=" + "9" * 5000, "too large")]:
        with pytest.raises(ConfigError, match=fragment):
            parse_overrides([item])
    with pytest.raises(ConfigError, match="given twice"):
        parse_overrides(["hidden_size=64", "hidden_size=128"])
    with pytest.raises(ConfigError, match="--override num_key_value_heads=0: must be at least 1"):
        load_model("debug", overrides=parse_overrides(["num_key_value_heads=0"]))
    with pytest.raises(ConfigError, match="--override hidden_size=\"256\""):
        load_model("debug", overrides={"hidden_size": "256"})
    assert load_model("llama-3.2-1b", overrides={"head_dim": None}).head_dim == 64


def test_overrides_the_model_type_ignores_are_refused():
    with pytest.raises(ConfigError, match="llama has no sliding window.*use a mistral config"):
        load_model("llama-3.1-8b", overrides=parse_overrides(["sliding_window=100"]))
    with pytest.raises(ConfigError, match="mistral has no biases"):
        load_model("mistral-7b-v0.1", overrides={"attention_bias": True})
    assert load_model("mistral-7b-v0.1", overrides={"sliding_window": None}).sliding_window is None
    assert load_model("mistral-7b-v0.1", overrides={"sliding_window": 100}).sliding_window == 100


def test_notes_for_fields_llamem_does_not_model():
    quantized = spec_from_config(dict(LLAMA, quantization_config={"quant_method": "gptq", "bits": 4}), name="q")
    assert len(quantized.notes) == 1 and "pre-quantized" in quantized.notes[0] and "--quant" in quantized.notes[0]
    llama = spec_from_config(dict(LLAMA, sliding_window=100), name="l")
    assert llama.sliding_window is None and "llama has no sliding window" in llama.notes[0]
    mistral = spec_from_config(dict(MISTRAL, attention_bias=True, mlp_bias=True), name="m")
    assert not mistral.attention_bias and len(mistral.notes) == 2
    harmless = spec_from_config(dict(LLAMA, rope_scaling={"rope_type": "llama3", "factor": 8.0},
                                     attention_dropout=0.0, pretraining_tp=1, sliding_window=None), name="h")
    assert harmless.notes == ()
    # Notes describe the file; they do not make two specs differ.
    assert quantized == spec_from_config(LLAMA, name="q") and hash(quantized) == hash(spec_from_config(LLAMA, name="q"))


def write(path, config):
    path.write_text(json.dumps(config))
    return path


def test_config_files_that_are_not_configs(tmp_path):
    with pytest.raises(ConfigError, match="holds a list, not a JSON object"):
        read_config(write(tmp_path / "list.json", [LLAMA]))
    binary = tmp_path / "model.safetensors"
    binary.write_bytes(b"\x80\x81\xfe\xff" * 64)
    with pytest.raises(ConfigError, match="not a text file"):
        read_config(binary)
    (tmp_path / "bad.json").write_text("{'model_type': 'llama'}")
    with pytest.raises(ConfigError, match="not valid JSON"):
        read_config(tmp_path / "bad.json")
    with pytest.raises(ConfigError, match="no config.json in this directory"):
        read_config(tmp_path)
    nan = write(tmp_path / "nan.json", dict(LLAMA, rms_norm_eps=float("nan")))
    with pytest.raises(ConfigError, match="rms_norm_eps=NaN"):
        load_model(config_path=nan)


def test_a_name_and_a_config_are_refused_together(tmp_path):
    config = write(tmp_path / "mistral.json", MISTRAL)
    with pytest.raises(UsageError, match="give a model name or --config, not both"):
        load_model("llama-3.1-8b", config_path=config)
    assert UsageError.exit_code == EXIT_USAGE


def test_a_name_that_is_a_path_is_read_and_labelled_by_it(tmp_path, monkeypatch):
    write(tmp_path / "config.json", MISTRAL)
    spec = load_model(str(tmp_path))
    assert (spec.name, spec.model_type, spec.source) == (str(tmp_path), "mistral", str(tmp_path / "config.json"))
    assert load_model(str(tmp_path / "config.json")).name == str(tmp_path / "config.json")
    with pytest.raises(ConfigError, match="no such file"):
        load_model(str(tmp_path / "missing.json"))
    # A directory without config.json is no config: the name is looked up, and the error says where.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "debug").mkdir()
    (tmp_path / "weights").mkdir()
    assert load_model("debug").name == "debug"
    with pytest.raises(UnknownModel, match=r"local path weights \(a directory without config.json\)"):
        load_model("weights")
    with pytest.raises(UnknownModel, match=r"local path ./nowhere/model \(not found\)"):
        load_model("./nowhere/model")


def test_cli_exit_codes_for_these_errors(tmp_path):
    config = write(tmp_path / "config.json", dict(LLAMA, hidden_size=64.7))
    cases = [(["estimate", str(config)], 1, "hidden_size=64.7"),
             (["estimate", "llama-3.1-8b", "--config", str(config)], EXIT_USAGE, "not both"),
             (["estimate", "llama-3.1-8b", "--override", "sliding_window=100"], 1, "no sliding window")]
    for args, code, fragment in cases:
        out = subprocess.run([sys.executable, "-m", "llamem", *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == code and fragment in out.stdout + out.stderr, (args, out.stdout, out.stderr)


def test_class_names_exist_in_transformers():
    """Bundles and `--code` name each family's classes: every name is one transformers has."""
    import importlib

    transformers = pytest.importorskip("transformers")
    from llamem.model import HF_CLASSES

    for model_type, (config, causal_lm, layer) in HF_CLASSES.items():
        assert hasattr(transformers, config) and hasattr(transformers, causal_lm), model_type
        module = importlib.import_module(getattr(transformers, causal_lm).__module__)
        assert hasattr(module, layer), (model_type, layer)
