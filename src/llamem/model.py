"""ModelSpec: the shape of a LLaMA-family model, from a preset, a config.json or a name.

Parameter counts are exact: a test holds them to `sum(p.numel())` of the transformers
model built from the same config. Config files and `--override` values go through one
table of rules, `FIELDS`, taken from how transformers 5 declares and builds `LlamaConfig`
and `MistralConfig` (their `@strict` field types, `validate_architecture`, and the
shapes `LlamaAttention` derives): what transformers refuses, or cannot build, llamem refuses.
"""

from __future__ import annotations

import difflib
import json
import math
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from llamem.errors import ConfigError, UnknownModel, UsageError
from llamem.presets import ALIASES, PRESETS, SAME_SHAPE_FINETUNES

SUPPORTED_MODEL_TYPES = ("llama", "mistral")

# The transformers class that reads each model type: named in errors, since its rules are the ones applied.
_CONFIG_CLASS = {"llama": "LlamaConfig", "mistral": "MistralConfig"}

# torch sizes and element counts are int64: a larger dimension cannot be built.
_INT64_MAX = 2**63 - 1
MAX_LAYERS = 1024
"""Layers are sized one by one in places (allocation schedules, per-tensor rounding): at most 1,024."""

# A config.json is a few KiB; anything this large is a weights file passed by mistake.
_MAX_CONFIG_BYTES = 16 * 2**20

Kind = Literal["int", "float", "number", "bool"]


@dataclass(frozen=True, kw_only=True, slots=True)
class FieldRule:
    """How one config.json field llamem reads must look; the same rule checks `--override` values."""

    kind: Kind
    """int: a JSON integer, at least 1 (transformers' @strict type check refuses floats, even 2048.0,
    and booleans); float: a JSON float (it refuses the integer 1 where it declares `float`);
    number: an integer or a float; bool: JSON true or false, never a string (bool("false") is True)."""
    required: bool = False
    """llamem refuses a config without it, where transformers would fill in Llama-2-7B's value."""
    null_ok_for: tuple[str, ...] = ()
    """Model types whose config class accepts null: num_key_value_heads and head_dim then take their
    derived default; sliding_window null means full attention. MistralConfig declares
    num_key_value_heads `int`, so it refuses null there although LlamaConfig accepts it."""
    read_by: tuple[str, ...] = SUPPORTED_MODEL_TYPES
    """Model types whose transformers model uses the field; the others ignore it."""
    ignored_why: str = ""
    """Why a model type outside `read_by` ignores the field, and what to use instead."""
    maximum: int = 2**63 - 1
    """The largest value llamem sizes (an int64 for sizes; layers are counted one by one)."""


_NO_SLIDING = "llama has no sliding window (LlamaForCausalLM attends to every token); use a mistral config"
_NO_BIAS = "mistral has no biases (MistralForCausalLM builds every Linear with bias=False); use a llama config"

# Every field llamem reads, by its Hugging Face name. Config files and --override both go through it.
FIELDS: dict[str, FieldRule] = {
    "hidden_size": FieldRule(kind="int", required=True),
    "intermediate_size": FieldRule(kind="int", required=True),
    "num_hidden_layers": FieldRule(kind="int", required=True, maximum=MAX_LAYERS),
    "num_attention_heads": FieldRule(kind="int", required=True),
    "num_key_value_heads": FieldRule(kind="int", null_ok_for=("llama",)),
    "head_dim": FieldRule(kind="int", null_ok_for=SUPPORTED_MODEL_TYPES),
    "vocab_size": FieldRule(kind="int", required=True),
    "max_position_embeddings": FieldRule(kind="int"),
    "tie_word_embeddings": FieldRule(kind="bool"),
    "sliding_window": FieldRule(kind="int", null_ok_for=("mistral",), read_by=("mistral",),
                                ignored_why=_NO_SLIDING),
    "attention_bias": FieldRule(kind="bool", read_by=("llama",), ignored_why=_NO_BIAS),
    "mlp_bias": FieldRule(kind="bool", read_by=("llama",), ignored_why=_NO_BIAS),
    # Not memory, but `trace` builds the model from them: a string here fails inside RoPE or RMSNorm.
    "rms_norm_eps": FieldRule(kind="float"),
    "rope_theta": FieldRule(kind="number"),
}

# What transformers 5 fills in when a field is absent: the class defaults of configuration_llama.py and
# configuration_mistral.py (a test compares them). num_key_value_heads (llama) and head_dim are derived
# instead: num_attention_heads, and hidden_size // num_attention_heads.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "tie_word_embeddings": False, "attention_bias": False,
              "mlp_bias": False},
    "mistral": {"num_key_value_heads": 8, "max_position_embeddings": 131072, "tie_word_embeddings": False,
                "sliding_window": 4096},
}

# What null or an absent field means where transformers derives the value; 0 is a common mistake for it.
_DERIVED = {"num_key_value_heads": "num_attention_heads KV heads (no GQA)",
            "head_dim": "hidden_size // num_attention_heads"}


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelSpec:
    """Everything about a model that decides its memory."""

    name: str
    """Preset name, Hugging Face id, or the config.json path it was read from."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    """Key/value heads: fewer than `num_heads` under grouped-query attention (GQA)."""
    head_dim: int
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    sliding_window: int | None = None
    """Mistral-style sliding-window attention: the KV cache keeps at most this many tokens."""
    attention_bias: bool = False
    mlp_bias: bool = False
    model_type: str = "llama"
    hf_id: str | None = None
    source: str = ""
    """Where the numbers come from (a config.json)."""
    config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False, repr=False)
    """The Hugging Face config fields, after overrides: what `trace` builds the model from."""
    notes: tuple[str, ...] = field(default=(), compare=False, hash=False)
    """Fields of the config.json that llamem does not model (a pre-quantized checkpoint, a field the
    model type ignores), one sentence each, for reports to print."""

    def __post_init__(self) -> None:
        problems = []
        for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                     "head_dim", "vocab_size"):
            if getattr(self, name) <= 0:
                problems.append(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_kv_heads > 0 and self.num_heads % self.num_kv_heads:
            problems.append(f"num_attention_heads ({self.num_heads}) must be a multiple of "
                            f"num_key_value_heads ({self.num_kv_heads})")
        if problems:
            raise ConfigError(f"model {self.name!r}: " + "; ".join(problems))

    # Dimensions derived once, used everywhere.
    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def gqa_groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    def layer_linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in_features, out_features) of every nn.Linear in one decoder layer (do not mutate)."""
        return _linear_shapes(self)

    def _compute_linear_shapes(self) -> dict[str, tuple[int, int]]:
        h, q, kv, i = self.hidden_size, self.q_dim, self.kv_dim, self.intermediate_size
        return {
            "q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h),
        }

    @property
    def params_per_layer(self) -> int:
        """Linear weights (+ biases if any) and the two RMSNorm weights of one decoder layer."""
        return _params_per_layer(self)

    def _count_params_per_layer(self) -> int:
        total = 2 * self.hidden_size
        for name, (fan_in, fan_out) in self.layer_linear_shapes().items():
            total += fan_in * fan_out
            has_bias = self.mlp_bias if name.endswith(("gate_proj", "up_proj", "down_proj")) else self.attention_bias
            total += fan_out if has_bias else 0
        return total

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def lm_head_params(self) -> int:
        """0 when tied: the head reuses the embedding matrix."""
        return 0 if self.tie_word_embeddings else self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Embedding + layers + final norm + untied lm_head, as `sum(p.numel())` counts them."""
        return (self.embedding_params + self.num_layers * self.params_per_layer
                + self.hidden_size + self.lm_head_params)

    def kv_bytes_per_token(self, bytes_per_element: float = 2) -> int:
        """K and V for every layer: 2 * layers * kv_heads * head_dim * bytes (GQA-sized, never hidden_size)."""
        return int(2 * self.num_layers * self.kv_dim * bytes_per_element)


@lru_cache(maxsize=1024)
def _linear_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    return spec._compute_linear_shapes()


@lru_cache(maxsize=1024)
def _params_per_layer(spec: ModelSpec) -> int:
    return spec._count_params_per_layer()


def preset_names() -> list[str]:
    return list(PRESETS)


# Words that name a chat / instruct fine-tune of a preset, not a different shape.
_VARIANT_WORDS = frozenset({"instruct", "chat"})


@lru_cache(maxsize=1)
def _preset_orgs() -> frozenset[str]:
    """Hugging Face organisations of the presets: their prefix may be left out ('Llama-3.1-8B')."""
    return frozenset(hf_id.lower().partition("/")[0] for hf_id, _source, _cfg in PRESETS.values())


def _normalise(name: str) -> str:
    """One spelling per model, so that variants need no table: lowercase, '_' and ' ' as '-', no preset
    organisation prefix, no '-hf' (the format, not the model), 'Meta-Llama-3' as 'llama-3', 'llama2' as 'llama-2'."""
    text = name.strip().lower().replace("_", "-").replace(" ", "-")
    org, slash, rest = text.rpartition("/")
    if slash and org in _preset_orgs():
        text = rest
    words = [w for w in text.split("-") if w and w != "hf"]
    if len(words) > 1 and words[0] == "meta" and words[1].startswith("llama"):
        words = words[1:]
    return re.sub(r"^llama(?=\d)", "llama-", "-".join(words))


def _without_variant(spelling: str) -> str:
    return "-".join(w for w in spelling.split("-") if w not in _VARIANT_WORDS)


@lru_cache(maxsize=1)
def _spellings() -> dict[str, str]:
    """Normalised preset key, Hugging Face id and alias -> preset key."""
    out = {}
    for key, (hf_id, _source, _cfg) in PRESETS.items():
        out[_normalise(key)] = key
        out[_normalise(hf_id)] = key
    for alias, key in ALIASES.items():
        out.setdefault(_normalise(alias), key)
    return out


def _lookup_preset(name: str) -> str | None:
    """Preset key for a short name, Hugging Face id or alias, in any of their common spellings.

    '-Instruct' / '-chat' fine-tunes resolve to their base preset only where presets.py records
    that the fine-tune's config.json has the same shapes (SAME_SHAPE_FINETUNES)."""
    spelling = _normalise(name)
    if spelling in _spellings():
        return _spellings()[spelling]
    base = _spellings().get(_without_variant(spelling))
    return base if base in SAME_SHAPE_FINETUNES else None


def near_matches(name: str, limit: int = 5) -> list[str]:
    """Preset keys whose spellings are close to `name`, best first, each once."""
    spellings = _spellings()
    spelling = _normalise(name)
    targets = set([spelling, _without_variant(spelling), spelling.rpartition("/")[2]])

    def score(candidate: str) -> float:
        # Names often add a suffix to a preset's ('-Instrct', '-GPTQ'): also compare the same-length prefix.
        return max(difflib.SequenceMatcher(None, text, candidate).ratio()
                   for target in targets for text in (target, target[:len(candidate)]))

    scored = sorted(((score(s), s) for s in spellings), key=lambda pair: -pair[0])
    # Several spellings map to one preset: deduplicate after mapping, keeping the best rank.
    keys = dict.fromkeys(spellings[s] for value, s in scored if value >= 0.6)
    return list(keys)[:limit]


_NULL_WORDS = ("null", "none")
_TRUE_WORDS, _FALSE_WORDS = ("true", "1"), ("false", "0")


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """['num_hidden_layers=2', 'head_dim=null'] -> {'num_hidden_layers': 2, 'head_dim': None}.

    Only the spelling is checked here; ranges, and whether the model type reads the field, are
    checked by `spec_from_config` with the same rules as a config.json."""
    out: dict[str, Any] = {}
    problems = []
    for item in items:
        key, sep, text = item.partition("=")
        key, text = key.strip(), text.strip()
        if not sep or not key:
            problems.append(f"--override {item!r}: write key=value, for example num_hidden_layers=2")
        elif key not in FIELDS:
            problems.append(_unknown_field(key))
        else:
            try:
                value = _parse_value(key, text)
            except ValueError as err:
                problems.append(f"--override {key}={text}: {err}")
                continue
            if key in out and out[key] != value:
                problems.append(f"--override {key} is given twice ({_show(out[key])} and {_show(value)}): keep one")
            out[key] = value
    if problems:
        raise ConfigError(_problem_text(None, problems))
    return out


def _unknown_field(key: str) -> str:
    near = difflib.get_close_matches(key, list(FIELDS), n=3)
    hint = f" Did you mean {', '.join(near)}?" if near else ""
    return f"--override: {key!r} is not a field llamem reads.{hint} Fields: {', '.join(FIELDS)}"


def _parse_value(key: str, text: str) -> Any:
    """The typed value of one --override, as the same field would read in a config.json."""
    kind = FIELDS[key].kind
    lowered = text.lower()
    if lowered in _NULL_WORDS:
        return None  # whether null is allowed depends on the model type: spec_from_config decides
    if kind == "bool":
        if lowered not in _TRUE_WORDS + _FALSE_WORDS:
            raise ValueError("expected true or false")
        return lowered in _TRUE_WORDS
    if kind != "float" and re.fullmatch(r"[+-]?[0-9]+", text):
        try:
            return int(text)  # the range is checked with the config rules
        except ValueError:  # over Python's 4300-digit limit for int(str)
            raise ValueError("too large: torch sizes are 64-bit integers") from None
    if kind == "int":
        raise ValueError("expected a whole number, such as 4096")
    try:
        return float(text)
    except ValueError:
        raise ValueError("expected a number, such as 1e-05") from None


def _show(value: Any, limit: int = 40) -> str:
    """A value as it would be written in config.json (null, true, "2048"), cut short if long."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = f"<{type(value).__name__}>"
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _json_type(value: Any) -> str:
    """'a string', 'an integer': the JSON type of a value, for messages."""
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "a list",
             dict: "an object"}
    return "null" if value is None else names.get(type(value), f"a {type(value).__name__}")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _value_problem(key: str, value: Any, model_type: str) -> str | None:
    """What is wrong with one field's value, with the fix; None when transformers builds with it."""
    rule = FIELDS[key]
    if value is None:
        return None if model_type in rule.null_ok_for else _null_problem(key, rule, model_type)
    if rule.kind == "bool":
        if isinstance(value, bool):
            return None
        words = isinstance(value, str) and value.strip().lower() in ("true", "false")
        fix = f"write {value.strip().lower()} without quotes" if words else "write true or false"
        return (f"{key}={_show(value)}: must be a JSON boolean, not {_json_type(value)} "
                f"({_CONFIG_CLASS[model_type]} refuses it): {fix}")
    if rule.kind == "int":
        return _int_problem(key, value, rule)
    return _number_problem(key, value, rule)


def _null_problem(key: str, rule: FieldRule, model_type: str) -> str:
    default = _DEFAULTS[model_type].get(key)
    fix = f"remove the field for the default ({_show(default)})" if default is not None else ""
    kind = "a positive whole number" if rule.kind == "int" else "true or false" if rule.kind == "bool" else "a number"
    fix = f"{fix}, or give {kind}" if fix else f"give {kind}"
    return f"{key}=null: {_CONFIG_CLASS[model_type]} does not accept null here: {fix}"


def _int_problem(key: str, value: Any, rule: FieldRule) -> str | None:
    shown = f"{key}={_show(value)}"
    if not _is_number(value) or isinstance(value, float):
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            fix = f"write {int(value)} (transformers refuses floats here, even whole ones)"
        elif isinstance(value, str) and re.fullmatch(r"[0-9]+", value.strip()):
            fix = f"write {value.strip()} without quotes"
        else:
            fix = "give a positive whole number"
        return f"{shown}: must be a whole number, not {_json_type(value)}: {fix}"
    if value < 1:
        return f"{shown}: must be at least 1{_zero_hint(key)}"
    if value > rule.maximum:
        if rule.maximum < _INT64_MAX:
            return f"{shown}: llamem sizes at most {rule.maximum:,} (the largest LLaMA-family models have under 200)"
        return f"{shown}: larger than 2**63 - 1, the largest size torch can hold: give the real size"
    return None


def _zero_hint(key: str) -> str:
    if key == "sliding_window":
        return "; for attention over every token write null"
    if key in _DERIVED:
        return f" (0 does not mean the default: for {_DERIVED[key]}, write null or remove the field)"
    return ""


def _number_problem(key: str, value: Any, rule: FieldRule) -> str | None:
    shown = f"{key}={_show(value)}"
    if not _is_number(value):
        return f"{shown}: must be a number, not {_json_type(value)}: write it without quotes, such as 1e-05"
    if rule.kind == "float" and isinstance(value, int):
        return f"{shown}: transformers declares it a float and refuses an integer: write it with a decimal point"
    if (isinstance(value, float) and not math.isfinite(value)) or value <= 0:
        return f"{shown}: must be a finite number above 0"
    return None


def _model_type(config: dict[str, Any], name: str) -> str:
    model_type = config.get("model_type")
    if model_type in SUPPORTED_MODEL_TYPES:
        return model_type
    if model_type is None:
        raise ConfigError(f'{name}: no model_type field: add "model_type": "llama" (or "mistral") '
                          "if this is a LLaMA-family config")
    archs = config.get("architectures")
    archs = ", ".join(map(str, archs)) if isinstance(archs, list) and archs else "no architectures field"
    raise ConfigError(f"{name}: model_type {_show(model_type)} ({_show(archs, 80)}) is not a LLaMA-family "
                      f"architecture; llamem supports model_type {' or '.join(SUPPORTED_MODEL_TYPES)}")


def _field_problems(config: dict[str, Any], overrides: dict[str, Any], model_type: str) -> list[str]:
    """Every field problem at once, each saying whether it came from an --override or the file."""
    problems, missing = [], []
    for key, value in overrides.items():
        if key not in FIELDS:
            problems.append(_unknown_field(key))
        elif model_type not in FIELDS[key].read_by:
            problems.append(f"--override {key}={_show(value)}: {FIELDS[key].ignored_why}")
    for key, rule in FIELDS.items():
        if model_type not in rule.read_by:
            continue  # the file's own value is only a note: transformers ignores it too
        if key not in config:
            missing += [key] if rule.required else []
            continue
        problem = _value_problem(key, config[key], model_type)
        if problem:
            problems.append(f"--override {problem}" if key in overrides else problem)
    if missing:
        problems.append(f"missing {', '.join(missing)}: a {model_type} config.json needs them "
                        "(transformers would silently fill in its 7B model's values)")
    return problems


def _resolve(config: dict[str, Any], model_type: str) -> dict[str, Any]:
    """Field values after transformers' defaults (valid fields only)."""
    values = {**_DEFAULTS[model_type],
              **{k: config[k] for k in FIELDS if k in config and model_type in FIELDS[k].read_by}}
    if values.get("num_key_value_heads") is None:
        values["num_key_value_heads"] = values["num_attention_heads"]
    if values.get("head_dim") is None:
        values["head_dim"] = values["hidden_size"] // values["num_attention_heads"]
    return values


def _shape_problems(v: dict[str, Any], config: dict[str, Any], model_type: str) -> list[str]:
    """Combinations transformers refuses (LlamaConfig.validate_architecture) or cannot build or run."""
    problems = []
    hidden, heads, kv, head_dim = v["hidden_size"], v["num_attention_heads"], v["num_key_value_heads"], v["head_dim"]
    if hidden % heads and (model_type == "llama" or config.get("head_dim") is None):
        why, fix = ((f"{_CONFIG_CLASS[model_type]} refuses it, even with head_dim set", "change one of them")
                    if model_type == "llama" else
                    ("head_dim would be hidden_size // num_attention_heads, truncated", "set head_dim"))
        problems.append(f"hidden_size={hidden} is not a multiple of num_attention_heads={heads} ({why}): {fix}")
    if heads % kv:
        given = "" if "num_key_value_heads" in config else f", {_CONFIG_CLASS[model_type]}'s default when absent"
        divisors = f" ({', '.join(str(d) for d in range(1, heads + 1) if heads % d == 0)})" if heads <= 256 else ""
        problems.append(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}{given} "
                        "(grouped-query attention shares each KV head among num_attention_heads // "
                        f"num_key_value_heads query heads): use a divisor of {heads}{divisors}")
    if head_dim % 2:
        problems.append(f"head_dim={head_dim} is odd: rotary position embeddings rotate pairs of dimensions; "
                        "use an even head_dim")
    biggest = max(v["vocab_size"] * hidden, hidden * v["intermediate_size"], hidden * heads * head_dim)
    if biggest > _INT64_MAX:
        problems.append("a weight matrix would hold more than 2**63 - 1 elements, the most torch can index: "
                        "check hidden_size, intermediate_size, vocab_size and head_dim")
    return problems


def _notes(config: dict[str, Any], model_type: str) -> list[str]:
    """Fields of the file that change memory in ways llamem does not model, or that the model ignores.

    Harmless, so not noted: rope_scaling / rope_parameters (a few small buffers), attention_dropout
    (no stored mask with sdpa), pretraining_tp (unused by transformers 5), torch_dtype (the workload
    chooses the dtype), use_cache and the token ids."""
    notes = [f"{key}={_show(config[key])} is ignored: {rule.ignored_why}"
             for key, rule in FIELDS.items()
             if model_type not in rule.read_by and config.get(key) not in (None, False)]
    quant = config.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        notes.append(f"quantization_config (quant_method {_show(method)}): this checkpoint stores pre-quantized "
                     "weights, but llamem sizes weights from --precision and --quant, not from the file: "
                     "pass the --quant (int8, nf4 or int4) closest to it")
    return notes


def _problem_text(subject: str | None, problems: list[str]) -> str:
    """One problem on one line; several as a list, all at once."""
    if len(problems) == 1:
        return f"{subject}: {problems[0]}" if subject else problems[0]
    head = f"{subject}: {len(problems)} problems" if subject else f"{len(problems)} problems"
    return head + ":\n" + "\n".join(f"  - {p}" for p in problems)


def spec_from_config(config: dict[str, Any], *, name: str, hf_id: str | None = None, source: str = "",
                     overrides: dict[str, Any] | None = None) -> ModelSpec:
    """Build a ModelSpec from Hugging Face config fields and --override values, checked with `FIELDS`.

    Every problem is reported at once, each naming the field, its value and the fix."""
    if not isinstance(config, dict):
        raise ConfigError(f"{name}: a config is a JSON object of fields, not {_json_type(config)}")
    model_type = _model_type(config, name)
    overrides = dict(overrides or {})
    merged = {**config, **overrides}
    problems = _field_problems(merged, overrides, model_type)
    values = {} if problems else _resolve(merged, model_type)
    problems = problems or _shape_problems(values, merged, model_type)
    if problems:
        raise ConfigError(_problem_text(name, problems))
    if overrides:
        name += " (" + ", ".join(f"{k}={_show(v)}" for k, v in overrides.items()) + ")"
    return ModelSpec(
        name=name, hidden_size=values["hidden_size"], intermediate_size=values["intermediate_size"],
        num_layers=values["num_hidden_layers"], num_heads=values["num_attention_heads"],
        num_kv_heads=values["num_key_value_heads"], head_dim=values["head_dim"], vocab_size=values["vocab_size"],
        max_position_embeddings=values["max_position_embeddings"],
        tie_word_embeddings=values["tie_word_embeddings"], sliding_window=values.get("sliding_window"),
        attention_bias=values.get("attention_bias", False), mlp_bias=values.get("mlp_bias", False),
        model_type=model_type, hf_id=hf_id, source=source, config=merged,
        notes=tuple(_notes(config, model_type)),
    )


def read_config(path: str | Path) -> dict[str, Any]:
    """The JSON object of a config.json, or of the config.json inside a directory."""
    path = _config_file(_expand(Path(path)))
    from llamem.files import read_limited

    raw = read_limited(path, _MAX_CONFIG_BYTES, "config.json (a weights file?): pass the model's config.json",
                       ConfigError)
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file (a weights file?): pass the model's config.json") from None
    try:
        config = json.loads(text)
    except (ValueError, RecursionError) as err:
        raise ConfigError(f"{path}: not valid JSON ({err}): pass the model's config.json") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: holds {_json_type(config)}, not a JSON object: a config.json is "
                          "one {...} object of fields such as hidden_size")
    return config


def _config_file(path: Path) -> Path:
    if _is_dir(path):
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path}: no config.json in this directory: pass the model's config.json")
        return path / "config.json"
    return path


def _expand(path: Path) -> Path:
    """`~` and `~user` expanded, or the path as given where there is no such home directory."""
    try:
        return path.expanduser()
    except RuntimeError:
        return path


def _is_dir(path: Path) -> bool:
    try:
        return path.is_dir()
    except OSError:  # a name too long to be a path, for example
        return False


def load_model(name: str | None = None, *, config_path: str | Path | None = None,
               overrides: dict[str, Any] | None = None) -> ModelSpec:
    """A preset name, Hugging Face id or config.json path, or `--config`; then `overrides` on top.

    A name that is a `.json` path, or a directory holding a config.json, is read as that file and
    labelled by its path."""
    if name is not None and config_path is not None:
        raise UsageError(f"give a model name or --config, not both (got {name!r} and --config {config_path}): "
                         "drop the name to read the config file, or --config to use the preset")
    if config_path is None and not name:
        raise ConfigError("name a model (see `llamem models`), give a config.json path, "
                          "or pass --config path/to/config.json")
    path = Path(config_path) if config_path is not None else _name_as_path(name)
    if path is not None:
        config = read_config(path)
        hf_id = config.get("_name_or_path")
        return spec_from_config(config, name=str(config_path or name), overrides=overrides,
                                hf_id=hf_id if isinstance(hf_id, str) and hf_id else None,
                                source=str(_config_file(_expand(path))))
    key = _lookup_preset(name)
    if key is None:
        raise UnknownModel(name, near_matches(name), looked=_where_looked(name))
    hf_id, source, config = PRESETS[key]
    return spec_from_config(config, name=key, hf_id=hf_id, source=source, overrides=overrides)


def _name_as_path(name: str) -> Path | None:
    """The config file a model name stands for: a `.json` path, or a directory holding config.json."""
    path = _expand(Path(name))
    if name.endswith(".json"):
        return path  # read_config says so if it is missing
    if _is_dir(path) and (path / "config.json").is_file():
        return path
    return None


def _looks_like_path(name: str) -> bool:
    # Hugging Face ids contain '/', so only these shapes say "a local path" before anything exists.
    return name.startswith(("/", "./", "../", "~", ".\\")) or "\\" in name or _is_dir(Path(name))


def _where_looked(name: str) -> str:
    looked = "presets and aliases, in any case, with or without the organisation prefix, -hf, -chat or -Instruct"
    if _looks_like_path(name):
        state = "a directory without config.json" if _is_dir(_expand(Path(name))) else "not found"
        looked += f", and the local path {name} ({state})"
    return looked
