"""ModelSpec: the shape of a LLaMA-family model, from a preset, a config.json or a name.

Parameter counts are exact: a test holds them to `sum(p.numel())` of the transformers
model built from the same config. Config files and `--override` values go through one
table of rules, `FIELDS`, taken from how transformers 5 declares and builds the config
class of each model type (`LlamaConfig`, `MistralConfig`, `Qwen2Config`, `Qwen3Config`,
`MixtralConfig`, `Qwen3MoeConfig`, `Llama4TextConfig`: their `@strict` field types,
`validate_architecture`, and the shapes their attention and MLP modules derive): what
transformers refuses, or cannot build, llamem refuses.
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

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "llama4_text")
MOE_MODEL_TYPES = ("mixtral", "qwen3_moe", "llama4_text")
HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM", "LlamaDecoderLayer"),
              "mistral": ("MistralConfig", "MistralForCausalLM", "MistralDecoderLayer"),
              "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "Qwen2DecoderLayer"),
              "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "Qwen3DecoderLayer"),
              "mixtral": ("MixtralConfig", "MixtralForCausalLM", "MixtralDecoderLayer"),
              "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "Qwen3MoeDecoderLayer"),
              "llama4_text": ("Llama4TextConfig", "Llama4ForCausalLM", "Llama4TextDecoderLayer")}
"""transformers' config, causal-LM and decoder-layer class names of each model type llamem sizes (the
trace builds with them; bundles and `--code` wrap decoder layers by name)."""

# The transformers class that reads each model type: named in errors, since its rules are the ones applied.
_CONFIG_CLASS = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                 "qwen3": "Qwen3Config", "mixtral": "MixtralConfig", "qwen3_moe": "Qwen3MoeConfig",
                 "llama4_text": "Llama4TextConfig"}

# torch sizes and element counts are int64: a larger dimension cannot be built.
_INT64_MAX = 2**63 - 1
MAX_LAYERS = 1024
"""Layers are sized one by one in places (allocation schedules, per-tensor rounding): at most 1,024."""

# A config.json is a few KiB; anything this large is a weights file passed by mistake.
_MAX_CONFIG_BYTES = 16 * 2**20

Kind = Literal["int", "float", "number", "bool", "int_list"]


@dataclass(frozen=True, kw_only=True, slots=True)
class FieldRule:
    """How one config.json field llamem reads must look; the same rule checks `--override` values."""

    kind: Kind
    """int: a JSON integer, at least 1 (transformers' @strict type check refuses floats, even 2048.0,
    and booleans); float: a JSON float (it refuses the integer 1 where it declares `float`);
    number: an integer or a float; bool: JSON true or false, never a string (bool("false") is True);
    int_list: a JSON list of whole numbers of at least 0 (layer indices, or Llama 4's 0/1 flags)."""
    required: bool = False
    """llamem refuses a config without it, where transformers would fill in Llama-2-7B's value."""
    null_ok_for: tuple[str, ...] = ()
    """Model types whose config class accepts null: num_key_value_heads and head_dim then take their
    derived default; sliding_window null means full attention. MistralConfig declares
    num_key_value_heads `int`, so it refuses null there although LlamaConfig accepts it."""
    read_by: tuple[str, ...] = SUPPORTED_MODEL_TYPES
    """Model types whose transformers model uses the field; the others ignore it."""
    ignored_why: dict[str, str] = field(default_factory=dict)
    """Why a model type outside `read_by` ignores the field, and what to use instead, where more can be
    said than that its config class does not read it."""
    maximum: int = 2**63 - 1
    """The largest value llamem sizes (an int64 for sizes; layers are counted one by one)."""


_NO_SLIDING = "llama has no sliding window (LlamaForCausalLM attends to every token); use a mistral config"
_NO_BIAS = "mistral has no biases (MistralForCausalLM builds every Linear with bias=False); use a llama config"
_QWEN2_BIAS = ("qwen2 fixes its biases (Qwen2Attention builds q/k/v_proj with bias=True and o_proj without): "
               "there is nothing to set")
_QWEN = ("qwen2", "qwen3", "qwen3_moe")
_ALL = SUPPORTED_MODEL_TYPES

# Every field llamem reads, by its Hugging Face name. Config files and --override both go through it.
FIELDS: dict[str, FieldRule] = {
    "hidden_size": FieldRule(kind="int", required=True),
    "intermediate_size": FieldRule(kind="int", required=True),
    "num_hidden_layers": FieldRule(kind="int", required=True, maximum=MAX_LAYERS),
    "num_attention_heads": FieldRule(kind="int", required=True),
    "num_key_value_heads": FieldRule(kind="int", null_ok_for=("llama", "qwen2", "qwen3")),
    # Qwen2Config and Qwen3MoeConfig do not declare head_dim, but their attention reads it when present.
    "head_dim": FieldRule(kind="int", null_ok_for=("llama", "mistral", "mixtral")),
    "vocab_size": FieldRule(kind="int", required=True),
    "max_position_embeddings": FieldRule(kind="int"),
    "tie_word_embeddings": FieldRule(kind="bool"),
    "sliding_window": FieldRule(kind="int", null_ok_for=("mistral", "mixtral") + _QWEN,
                                read_by=("mistral", "mixtral") + _QWEN, ignored_why={"llama": _NO_SLIDING}),
    "use_sliding_window": FieldRule(kind="bool", read_by=_QWEN),
    "attention_bias": FieldRule(kind="bool", read_by=("llama", "qwen3", "qwen3_moe", "llama4_text"),
                                ignored_why={"mistral": _NO_BIAS, "qwen2": _QWEN2_BIAS}),
    "mlp_bias": FieldRule(kind="bool", read_by=("llama",), ignored_why={"mistral": _NO_BIAS}),
    # Mixture of experts: the expert count has two names; Qwen3-MoE sizes experts apart from its dense MLP.
    "num_local_experts": FieldRule(kind="int", read_by=("mixtral", "llama4_text")),
    "num_experts": FieldRule(kind="int", read_by=("qwen3_moe",)),
    "num_experts_per_tok": FieldRule(kind="int", read_by=MOE_MODEL_TYPES),
    "moe_intermediate_size": FieldRule(kind="int", read_by=("qwen3_moe",)),
    "decoder_sparse_step": FieldRule(kind="int", read_by=("qwen3_moe",)),
    "mlp_only_layers": FieldRule(kind="int_list", null_ok_for=("qwen3_moe",), read_by=("qwen3_moe",)),
    "intermediate_size_mlp": FieldRule(kind="int", read_by=("llama4_text",)),
    "interleave_moe_layer_step": FieldRule(kind="int", read_by=("llama4_text",)),
    "moe_layers": FieldRule(kind="int_list", null_ok_for=("llama4_text",), read_by=("llama4_text",)),
    # Llama 4: RoPE layers attend in chunks and L2-normalise q and k; every no_rope_layer_interval-th is global.
    "use_qk_norm": FieldRule(kind="bool", read_by=("llama4_text",)),
    "attention_chunk_size": FieldRule(kind="int", null_ok_for=("llama4_text",), read_by=("llama4_text",)),
    "no_rope_layers": FieldRule(kind="int_list", null_ok_for=("llama4_text",), read_by=("llama4_text",)),
    "no_rope_layer_interval": FieldRule(kind="int", read_by=("llama4_text",)),
    # Not memory, but `trace` builds the model from them: a string here fails inside RoPE or RMSNorm.
    "rms_norm_eps": FieldRule(kind="float"),
    "rope_theta": FieldRule(kind="number"),
}

# What transformers 5 fills in when a field is absent: the class defaults of each configuration_*.py
# (a test compares them). num_key_value_heads (llama) and head_dim (llama, mistral, mixtral, qwen2,
# qwen3_moe) are derived instead: num_attention_heads, and hidden_size // num_attention_heads.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"max_position_embeddings": 2048, "tie_word_embeddings": False, "attention_bias": False,
              "mlp_bias": False},
    "mistral": {"num_key_value_heads": 8, "max_position_embeddings": 131072, "tie_word_embeddings": False,
                "sliding_window": 4096},
    "qwen2": {"num_key_value_heads": 32, "max_position_embeddings": 32768, "tie_word_embeddings": False,
              "use_sliding_window": False, "sliding_window": 4096},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "max_position_embeddings": 32768,
              "tie_word_embeddings": False, "attention_bias": False, "use_sliding_window": False,
              "sliding_window": 4096},
    "mixtral": {"num_key_value_heads": 8, "max_position_embeddings": 131072, "tie_word_embeddings": False,
                "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_key_value_heads": 4, "max_position_embeddings": 32768, "tie_word_embeddings": False,
                  "attention_bias": False, "use_sliding_window": False, "sliding_window": 4096,
                  "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "decoder_sparse_step": 1, "mlp_only_layers": None},
    "llama4_text": {"num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 131072,
                    "tie_word_embeddings": False, "attention_bias": False, "num_local_experts": 16,
                    "num_experts_per_tok": 1, "intermediate_size_mlp": 16384, "interleave_moe_layer_step": 1,
                    "moe_layers": None, "use_qk_norm": True, "attention_chunk_size": 8192,
                    "no_rope_layers": None, "no_rope_layer_interval": 4},
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
    """A bias on q, k, v and o_proj (LlamaConfig / Qwen3Config attention_bias)."""
    mlp_bias: bool = False
    qkv_bias: bool = False
    """A bias on q, k and v_proj only, o_proj without: Qwen2 always builds its attention so."""
    qk_norm: Literal["none", "rms", "l2"] = "none"
    """Queries and keys normalised per head before RoPE: rms is Qwen3's q_norm / k_norm (RMSNorm weights
    of head_dim each), l2 Llama 4's Llama4TextL2Norm (no weights, on its RoPE layers)."""
    num_experts: int = 0
    """Routed experts of each mixture-of-experts layer; 0 for a dense model."""
    experts_per_token: int = 0
    """Experts each token is routed to (num_experts_per_tok): 2 for Mixtral, 8 for Qwen3-MoE, 1 for Llama 4."""
    moe_intermediate_size: int = 0
    """Hidden width of one routed expert's gated MLP (its gate_up_proj holds 2x this many rows)."""
    shared_expert_intermediate_size: int = 0
    """Llama 4's shared expert, a gated MLP every token goes through beside the routed ones; 0 if none."""
    moe_layers: tuple[int, ...] = ()
    """Indices of the layers whose MLP is a mixture of experts; the others use the dense
    `intermediate_size` MLP (Llama 4 Maverick interleaves them, Qwen3-MoE's mlp_only_layers)."""
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
        if self.moe_layers and not 0 < self.experts_per_token <= self.num_experts:
            problems.append(f"num_experts_per_tok ({self.experts_per_token}) must be between 1 and the number "
                            f"of experts ({self.num_experts})")
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
    def is_moe(self) -> bool:
        return bool(self.moe_layers)

    def layer_params(self, index: int) -> list[tuple[str, int]]:
        """(name, element count) of every parameter of decoder layer `index`, named as transformers names it
        under the layer; routed experts are fused 3-D parameters (MixtralExperts, Llama4TextExperts). The two
        RMSNorm weights come first, then attention and MLP in named_parameters() order: the order the
        allocator schedules have always used for a layer's tensors."""
        return list(_layer_params(self, index in self.moe_layers))

    def layer_kinds(self) -> list[tuple[bool, int]]:
        """(mixture of experts?, how many layers) for each kind of layer the model has."""
        return _layer_kinds(self)

    @property
    def params_per_layer(self) -> int:
        """Parameters of one decoder layer (of the largest, where mixture-of-experts and dense layers alternate)."""
        return max(_layer_total(self, moe) for moe, _count in _layer_kinds(self))

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
        return _num_params(self)

    def kv_bytes_per_token(self, bytes_per_element: float = 2) -> int:
        """K and V for every layer: 2 * layers * kv_heads * head_dim * bytes (GQA-sized, never hidden_size)."""
        return int(2 * self.num_layers * self.kv_dim * bytes_per_element)


@lru_cache(maxsize=1024)
def _linear_shapes(spec: ModelSpec) -> dict[str, tuple[int, int]]:
    return spec._compute_linear_shapes()


def _layer_kinds(spec: ModelSpec) -> list[tuple[bool, int]]:
    """(mixture of experts?, how many layers) for each kind of layer the model has."""
    moe = len(spec.moe_layers)
    return [(kind, count) for kind, count in ((False, spec.num_layers - moe), (True, moe)) if count]


@lru_cache(maxsize=1024)
def _layer_total(spec: ModelSpec, moe: bool) -> int:
    return sum(n for _name, n in _layer_params(spec, moe))


@lru_cache(maxsize=1024)
def _num_params(spec: ModelSpec) -> int:
    layers = sum(count * _layer_total(spec, moe) for moe, count in _layer_kinds(spec))
    return spec.embedding_params + layers + spec.hidden_size + spec.lm_head_params


@lru_cache(maxsize=1024)
def _layer_params(spec: ModelSpec, moe: bool) -> tuple[tuple[str, int], ...]:
    """One layer's parameters: the two RMSNorm weights, attention (with its biases and q/k norms), the MLP
    or the mixture of experts (router, fused experts, shared expert)."""
    h, shapes = spec.hidden_size, spec.layer_linear_shapes()
    out = [("input_layernorm.weight", h), ("post_attention_layernorm.weight", h)]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        fan_in, fan_out = shapes[name]
        out.append((f"self_attn.{name}.weight", fan_in * fan_out))
        if spec.attention_bias or (spec.qkv_bias and name != "o_proj"):
            out.append((f"self_attn.{name}.bias", fan_out))
    if spec.qk_norm == "rms":
        out += [("self_attn.q_norm.weight", spec.head_dim), ("self_attn.k_norm.weight", spec.head_dim)]
    block = "feed_forward" if spec.model_type == "llama4_text" else "mlp"  # Llama4TextDecoderLayer's name
    out += _moe_params(spec, block) if moe else _mlp_params(block, h, spec.intermediate_size, spec.mlp_bias)
    return tuple(out)


def _mlp_params(prefix: str, h: int, i: int, bias: bool) -> list[tuple[str, int]]:
    out = []
    for name, fan_out in (("gate_proj", i), ("up_proj", i), ("down_proj", h)):
        out.append((f"{prefix}.{name}.weight", h * i))
        if bias:
            out.append((f"{prefix}.{name}.bias", fan_out))
    return out


def _moe_params(spec: ModelSpec, block: str) -> list[tuple[str, int]]:
    """Router (experts x hidden, no bias), fused experts (gate and up stacked: experts x 2I x hidden; down:
    experts x hidden x I), Llama 4's shared expert. Mixtral and Qwen3-MoE name the router gate, Llama 4 router."""
    h, e, i = spec.hidden_size, spec.num_experts, spec.moe_intermediate_size
    router = "router" if spec.model_type == "llama4_text" else "gate"
    out = [(f"{block}.{router}.weight", e * h), (f"{block}.experts.gate_up_proj", e * 2 * i * h),
           (f"{block}.experts.down_proj", e * h * i)]
    if spec.shared_expert_intermediate_size:
        out += _mlp_params(f"{block}.shared_expert", h, spec.shared_expert_intermediate_size, False)
    return out


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


def lookup_preset(name: str) -> str | None:
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
    if kind == "int_list":
        if not re.fullmatch(r"\[?\s*([0-9]+\s*(,\s*[0-9]+\s*)*)?\]?", text):
            raise ValueError("expected layer numbers such as [0,2,4]")
        return [int(v) for v in re.findall(r"[0-9]+", text)]
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
    if rule.kind == "int_list":
        return _int_list_problem(key, value)
    return _number_problem(key, value, rule)


def _int_list_problem(key: str, value: Any) -> str | None:
    good = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_LAYERS
                                           for v in value)
    if good:
        return None
    return (f"{key}={_show(value)}: must be a JSON list of layer numbers (whole numbers from 0), "
            f"not {_json_type(value)}: write it like [0, 2, 4]")


def _null_problem(key: str, rule: FieldRule, model_type: str) -> str:
    default = _DEFAULTS[model_type].get(key)
    fix = f"remove the field for the default ({_show(default)})" if default is not None else ""
    kind = {"int": "a positive whole number", "bool": "true or false", "int_list": "a list of layer numbers"}.get(
        rule.kind, "a number")
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
        raise ConfigError(f'{name}: no model_type field: add "model_type": "llama" (or {", ".join(SUPPORTED_MODEL_TYPES[1:])}) '
                          "if this is a LLaMA-family config")
    archs = config.get("architectures")
    archs = ", ".join(map(str, archs)) if isinstance(archs, list) and archs else "no architectures field"
    raise ConfigError(f"{name}: model_type {_show(model_type)} ({_show(archs, 80)}) is not a LLaMA-family "
                      f"architecture; llamem supports model_type {', '.join(SUPPORTED_MODEL_TYPES)}")


def _field_problems(config: dict[str, Any], overrides: dict[str, Any], model_type: str) -> list[str]:
    """Every field problem at once, each saying whether it came from an --override or the file."""
    problems, missing = [], []
    for key, value in overrides.items():
        if key not in FIELDS:
            problems.append(_unknown_field(key))
        elif model_type not in FIELDS[key].read_by:
            problems.append(f"--override {key}={_show(value)}: {_ignored_why(key, model_type)}")
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
    derived_head_dim = config.get("head_dim") is None and "head_dim" not in _DEFAULTS[model_type]
    if hidden % heads and (model_type == "llama" or derived_head_dim):
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
    moe = _moe_values(v, model_type)
    biggest = max(v["vocab_size"] * hidden, hidden * _dense_intermediate(v, model_type), hidden * heads * head_dim,
                  2 * hidden * moe["num_experts"] * moe["moe_intermediate_size"])
    if biggest > _INT64_MAX:
        problems.append("a weight matrix would hold more than 2**63 - 1 elements, the most torch can index: "
                        "check hidden_size, intermediate_size, vocab_size, head_dim and the expert sizes")
    if v.get("use_sliding_window"):
        problems.append("use_sliding_window=true: llamem does not model Qwen's sliding window on the layers from "
                        "max_window_layers on; write false (every layer attends to every token: an upper bound)")
    return problems


def _dense_intermediate(v: dict[str, Any], model_type: str) -> int:
    """The dense MLP's width: Llama 4 sizes its dense layers apart (intermediate_size_mlp), its experts by
    intermediate_size."""
    return v["intermediate_size_mlp"] if model_type == "llama4_text" else v["intermediate_size"]


def _moe_values(v: dict[str, Any], model_type: str) -> dict[str, Any]:
    """The ModelSpec fields of a mixture of experts, as each transformers model reads its config
    (MixtralSparseMoeBlock, Qwen3MoeDecoderLayer, Llama4TextDecoderLayer); zeros for a dense model."""
    layers = range(v["num_hidden_layers"])
    if model_type == "mixtral":
        return dict(num_experts=v["num_local_experts"], experts_per_token=v["num_experts_per_tok"],
                    moe_intermediate_size=v["intermediate_size"], shared_expert_intermediate_size=0,
                    moe_layers=tuple(layers))
    if model_type == "qwen3_moe":
        dense = set(v["mlp_only_layers"] or ())
        step = v["decoder_sparse_step"]
        return dict(num_experts=v["num_experts"], experts_per_token=v["num_experts_per_tok"],
                    moe_intermediate_size=v["moe_intermediate_size"], shared_expert_intermediate_size=0,
                    moe_layers=tuple(i for i in layers if i not in dense and (i + 1) % step == 0))
    if model_type == "llama4_text":
        step = v["interleave_moe_layer_step"]
        chosen = v["moe_layers"] if v["moe_layers"] is not None else range(step - 1, len(layers), step)
        return dict(num_experts=v["num_local_experts"], experts_per_token=v["num_experts_per_tok"],
                    moe_intermediate_size=v["intermediate_size"],
                    shared_expert_intermediate_size=v["intermediate_size"],
                    moe_layers=tuple(i for i in layers if i in set(chosen)))
    return dict(num_experts=0, experts_per_token=0, moe_intermediate_size=0, shared_expert_intermediate_size=0,
                moe_layers=())


def _notes(config: dict[str, Any], model_type: str) -> list[str]:
    """Fields of the file that change memory in ways llamem does not model, or that the model ignores.

    Harmless, so not noted: rope_scaling / rope_parameters (a few small buffers), attention_dropout
    (no stored mask with sdpa), pretraining_tp (unused by transformers 5), torch_dtype (the workload
    chooses the dtype), use_cache and the token ids."""
    notes = [f"{key}={_show(config[key])} is ignored: {_ignored_why(key, model_type)}"
             for key, rule in FIELDS.items()
             if model_type not in rule.read_by and config.get(key) not in (None, False)]
    quant = config.get("quantization_config")
    if quant is not None:
        method = quant.get("quant_method") if isinstance(quant, dict) else None
        notes.append(f"quantization_config (quant_method {_show(method)}): this checkpoint stores pre-quantized "
                     "weights, but llamem sizes weights from --precision and --quant, not from the file: "
                     "pass the --quant (int8, nf4 or int4) closest to it")
    return notes


def _ignored_why(key: str, model_type: str) -> str:
    why = FIELDS[key].ignored_why.get(model_type)
    return why or f"{_CONFIG_CLASS[model_type]} does not read it ({model_type} models are built without it)"


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
    config, outer_notes = _text_config(config)
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
        name=name, hidden_size=values["hidden_size"], intermediate_size=_dense_intermediate(values, model_type),
        num_layers=values["num_hidden_layers"], num_heads=values["num_attention_heads"],
        num_kv_heads=values["num_key_value_heads"], head_dim=values["head_dim"], vocab_size=values["vocab_size"],
        max_position_embeddings=values["max_position_embeddings"],
        tie_word_embeddings=values["tie_word_embeddings"],
        # Qwen configs carry a sliding_window that only use_sliding_window (refused above) turns on.
        sliding_window=None if model_type in _QWEN else values.get("sliding_window"),
        attention_bias=values.get("attention_bias", False), mlp_bias=values.get("mlp_bias", False),
        qkv_bias=model_type == "qwen2", qk_norm=_qk_norm(values, model_type), **_moe_values(values, model_type),
        model_type=model_type, hf_id=hf_id, source=source, config=merged,
        notes=tuple(outer_notes + _notes(config, model_type)),
    )


def _qk_norm(values: dict[str, Any], model_type: str) -> str:
    if model_type in ("qwen3", "qwen3_moe"):
        return "rms"  # Qwen3Attention: q_norm and k_norm, RMSNorm weights of head_dim each
    if model_type == "llama4_text" and values["use_qk_norm"]:
        return "l2"  # Llama4TextL2Norm on the RoPE layers: no weights
    return "none"


def _text_config(config: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Llama 4's hub config.json (model_type llama4) nests the language model under text_config: size
    that, and say the vision encoder is left out."""
    text = config.get("text_config")
    if config.get("model_type") != "llama4" or not isinstance(text, dict):
        return config, []
    text = {"model_type": "llama4_text", **text}
    note = ("the vision encoder and projector (Llama4ForConditionalGeneration) are not counted: llamem sizes "
            "the text model (Llama4ForCausalLM)")
    return text, [note]


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

    A name is tried as, in order: a `.json` path or a directory holding a config.json (read, and
    labelled by its path); a preset, by any of its spellings; a hub id whose config.json is in the
    local Hugging Face cache (read from there, never downloaded)."""
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
    key = lookup_preset(name)
    if key is None:
        return _load_cached(name, overrides)
    hf_id, source, config = PRESETS[key]
    return spec_from_config(config, name=key, hf_id=hf_id, source=source, overrides=overrides)


def _load_cached(name: str, overrides: dict[str, Any] | None) -> ModelSpec:
    from llamem.resolve import cached_config

    found = None if _looks_like_path(name) else cached_config(name)
    if found is None:
        raise UnknownModel(name, near_matches(name), looked=_where_looked(name))
    hf_id, path = found
    return spec_from_config(read_config(path), name=hf_id, hf_id=hf_id, source=str(path), overrides=overrides)


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
        return looked + f", and the local path {name} ({state})"
    from llamem.resolve import hub_cache_dir

    cache = hub_cache_dir()
    state = "" if _is_dir(cache) else ", which does not exist"
    return looked + f"; the Hugging Face cache {cache}{state} (set HF_HUB_CACHE or HF_HOME to look elsewhere)"
