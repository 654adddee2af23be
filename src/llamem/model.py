"""ModelSpec: the shape of a LLaMA-family model, from a preset or any config.json.

Parameter counts are exact: a test holds them to `sum(p.numel())` of the transformers
model built from the same config.
"""

from __future__ import annotations

import difflib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from llamem.errors import ConfigError, UnknownModel
from llamem.presets import ALIASES, PRESETS

SUPPORTED_MODEL_TYPES = ("llama", "mistral")

# Fields an --override may change, with their types. Keys are Hugging Face config names.
_OVERRIDABLE: dict[str, type] = {
    "hidden_size": int, "intermediate_size": int, "num_hidden_layers": int,
    "num_attention_heads": int, "num_key_value_heads": int, "head_dim": int,
    "vocab_size": int, "max_position_embeddings": int, "tie_word_embeddings": bool,
    "sliding_window": int, "attention_bias": bool, "mlp_bias": bool,
    "rms_norm_eps": float, "rope_theta": float,
}


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


def _lookup_preset(name: str) -> str | None:
    """Preset key for a short name, alias or Hugging Face id, case-insensitively."""
    lowered = name.lower()
    for key, (hf_id, _source, _cfg) in PRESETS.items():
        if lowered in (key.lower(), hf_id.lower()):
            return key
    for alias, key in ALIASES.items():
        if lowered == alias.lower():
            return key
    return None


def near_matches(name: str, limit: int = 5) -> list[str]:
    candidates = list(PRESETS) + [hf for hf, _s, _c in PRESETS.values()] + list(ALIASES)
    lowered = {c.lower(): c for c in candidates}
    found = difflib.get_close_matches(name.lower(), list(lowered), n=limit, cutoff=0.6)
    # Prefer the short preset names; fall back to whatever matched.
    out: list[str] = []
    for match in found:
        key = _lookup_preset(lowered[match]) or lowered[match]
        if key not in out:
            out.append(key)
    return out


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """['num_hidden_layers=2', 'tie_word_embeddings=true'] -> typed dict, with a clear error per bad item."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep:
            raise ConfigError(f"--override {item!r}: write key=value, for example num_hidden_layers=2")
        if key not in _OVERRIDABLE:
            near = difflib.get_close_matches(key, list(_OVERRIDABLE), n=3)
            hint = f" Did you mean {', '.join(near)}?" if near else ""
            raise ConfigError(f"--override: {key!r} is not a field llamem reads.{hint} "
                              f"Fields: {', '.join(_OVERRIDABLE)}")
        kind = _OVERRIDABLE[key]
        value = value.strip()
        try:
            if kind is bool:
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                out[key] = value.lower() in ("true", "1")
            elif key == "sliding_window" and value.lower() in ("none", "null"):
                out[key] = None
            else:
                out[key] = kind(value)
        except ValueError:
            raise ConfigError(f"--override {key}={value!r}: expected {kind.__name__}") from None
    return out


def spec_from_config(config: dict[str, Any], *, name: str, hf_id: str | None = None, source: str = "") -> ModelSpec:
    """Build a ModelSpec from Hugging Face config fields, refusing other architectures."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        archs = config.get("architectures") or []
        raise ConfigError(
            f"{name}: model_type {model_type!r} ({', '.join(archs) or 'no architectures field'}) is not a "
            f"LLaMA-family architecture; llamem supports model_type {' or '.join(SUPPORTED_MODEL_TYPES)}"
        )
    missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "vocab_size") if k not in config]
    if missing:
        raise ConfigError(f"{name}: config is missing {', '.join(missing)}")
    heads = int(config["num_attention_heads"])
    head_dim = config.get("head_dim") or int(config["hidden_size"]) // heads
    sliding = config.get("sliding_window") if model_type == "mistral" else None
    return ModelSpec(
        name=name,
        hidden_size=int(config["hidden_size"]),
        intermediate_size=int(config["intermediate_size"]),
        num_layers=int(config["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(config.get("num_key_value_heads") or heads),
        head_dim=int(head_dim),
        vocab_size=int(config["vocab_size"]),
        max_position_embeddings=int(config.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
        sliding_window=int(sliding) if sliding else None,
        attention_bias=bool(config.get("attention_bias", False)),
        mlp_bias=bool(config.get("mlp_bias", False)),
        model_type=model_type,
        hf_id=hf_id,
        source=source,
        config=dict(config),
    )


def read_config(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"--config {path}: not valid JSON ({err})") from None


def load_model(name: str | None = None, *, config_path: str | Path | None = None,
               overrides: dict[str, Any] | None = None) -> ModelSpec:
    """Resolve a preset name / Hugging Face id, or read a config.json; then apply overrides."""
    overrides = overrides or {}
    if config_path is not None:
        config = read_config(config_path)
        label, hf_id, source = str(name or config_path), config.get("_name_or_path"), f"{config_path}"
    else:
        if not name:
            raise ConfigError("name a model (see `llamem models`) or pass --config path/to/config.json")
        key = _lookup_preset(name)
        if key is None:
            raise UnknownModel(name, near_matches(name))
        hf_id, source, config = PRESETS[key]
        label = key
    config = {**config, **overrides}
    if overrides:
        label += " (" + ", ".join(f"{k}={v}" for k, v in overrides.items()) + ")"
    return spec_from_config(config, name=label, hf_id=hf_id, source=source)
