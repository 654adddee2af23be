"""PYTORCH_CUDA_ALLOC_CONF, parsed as torch 2.13 parses it, with the same errors.

Grammar (c10/core/AllocatorConfig.h `ConfigTokenizer`): tokens split on ',', ':', '[' and
']', spaces dropped; `key:value` pairs separated by commas; list values in brackets.
Keys and checks follow `AcceleratorAllocatorConfig::parseArgs` and
`CUDAAllocatorConfig::parseArgs` (a CUDA build: unknown keys are refused).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llamem.errors import LlamemError
from llamem.units import MiB

LARGE_BUFFER = 20 * MiB  # kLargeBuffer
ROUNDUP_INTERVALS = 16
SIZE_MAX = 2**64 - 1

# Keys a CUDA build of torch 2.13 accepts; the ones this simulator acts on are parsed below.
_OTHER_KEYS = {"pinned_use_background_threads", "pinned_max_round_threshold", "pinned_max_cached_size",
               "pinned_use_cuda_host_register", "pinned_use_hip_host_register", "pinned_num_register_threads",
               "release_lock_on_cudamalloc", "release_lock_on_hipmalloc", "per_process_memory_fraction",
               "graph_capture_record_stream_reuse", "throw_on_cudamalloc_oom"}


class AllocatorConfigError(LlamemError):
    """The same complaint torch would raise for this PYTORCH_CUDA_ALLOC_CONF."""


@dataclass(frozen=True, kw_only=True)
class AllocatorConfig:
    max_split_size_bytes: int = SIZE_MAX
    """Blocks at least this large are never split (`max_split_size_mb`; default unlimited)."""
    max_non_split_rounding_bytes: int = LARGE_BUFFER
    """A request >= max_split_size may take a cached block at most this much larger."""
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    """Per power-of-two bucket from 1 MiB (index 0) to >= 32 GiB (index 15): 0 or 1 means plain
    512-byte rounding, N > 1 rounds up to the next 1/N step of the bucket."""
    garbage_collection_threshold: float = 0.0
    """In (0, 1): reclaim old cached blocks above this share of the allowed memory; only active
    with a per-process memory fraction."""
    expandable_segments: bool = False
    large_segment_bytes: int = LARGE_BUFFER
    backend: str = "native"
    per_process_memory_fraction: float | None = None
    source: str = field(default="", compare=False)

    def divisions_for(self, size: int) -> int:
        index = size.bit_length() - 1 - 20
        return self.roundup_power2_divisions[min(max(index, 0), ROUNDUP_INTERVALS - 1)]


def _tokenize(text: str) -> list[str]:
    tokens, buffer = [], []
    for ch in text:
        if ch in ",:[]":
            if buffer:
                tokens.append("".join(buffer))
                buffer = []
            tokens.append(ch)
        elif ch != " ":
            buffer.append(ch)
    if buffer:
        tokens.append("".join(buffer))
    return tokens


class _Tokens:
    def __init__(self, text: str):
        self.tokens = _tokenize(text)

    def __len__(self) -> int:
        return len(self.tokens)

    def at(self, i: int) -> str:
        if i >= len(self.tokens):
            raise AllocatorConfigError("i < config_.size() INTERNAL ASSERT FAILED: Index out of bound "
                                       "(the setting ends where a value was expected)")
        return self.tokens[i]

    def expect(self, i: int, token: str) -> None:
        got = self.at(i)
        if got != token:
            raise AllocatorConfigError(f"Expected '{token}' at index {i} in ConfigTokenizer but got '{got}'")

    def size_t(self, i: int) -> int:
        value = self.at(i)
        if not value.isdigit():
            raise AllocatorConfigError(f"stoull: {value!r} is not a number")
        if int(value) > SIZE_MAX:  # std::stoull's out_of_range, which torch lets through
            raise AllocatorConfigError(f"stoull: {value} is out of range: at most {SIZE_MAX} (2**64 - 1)")
        return int(value)

    def boolean(self, i: int) -> bool:
        value = self.at(i)
        if value not in ("True", "False"):
            raise AllocatorConfigError(f"Expected 'True' or 'False' at index {i} in ConfigTokenizer but got '{value}'")
        return value == "True"

    def skip_value(self, i: int) -> int:
        """Past `key:value` or `key:[...]`."""
        self.expect(i + 1, ":")
        i += 2
        if self.at(i) == "[":
            while self.at(i) != "]":
                i += 1
        return i


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _parse_divisions(tokens: _Tokens, i: int, divisions: list[int]) -> int:
    tokens.expect(i + 1, ":")
    i += 2
    if tokens.at(i) != "[":
        value = tokens.size_t(i)
        if not _is_pow2(value):
            raise AllocatorConfigError("For roundups, the divisions has to be power of 2 ")
        divisions[:] = [value] * ROUNDUP_INTERVALS
        return i
    first, last_index = True, 0
    i += 1
    while tokens.at(i) != "]":
        key = tokens.at(i)
        tokens.expect(i + 1, ":")
        value = tokens.size_t(i + 2)
        i += 2
        if value != 0 and not _is_pow2(value):
            raise AllocatorConfigError("For roundups, the divisions has to be power of 2 or 0 to disable roundup ")
        if key == ">":
            divisions[last_index + 1:] = [value] * (ROUNDUP_INTERVALS - last_index - 1)
        else:
            if not key.isdigit() or not _is_pow2(int(key)):
                raise AllocatorConfigError("For roundups, the intervals have to be power of 2 ")
            index = min(max(int(key).bit_length() - 1, 0), ROUNDUP_INTERVALS - 1)
            if first:
                divisions[:index] = [value] * index
                first = False
            divisions[index] = value
            last_index = index
        i += 1
        if tokens.at(i) == ",":
            i += 1
    return i


_MIB_KEYS = {"max_split_size_mb": "max_split_size_bytes", "max_non_split_rounding_mb": "max_non_split_rounding_bytes",
             "large_segment_size_mb": "large_segment_bytes"}
BACKENDS = ("native", "cudaMallocAsync", "hipMallocAsync")


def _parse_mib(tokens: _Tokens, i: int, key: str, settings: dict) -> int:
    tokens.expect(i + 1, ":")
    value = tokens.size_t(i + 2)
    minimum_mib = LARGE_BUFFER // MiB
    if key != "large_segment_size_mb" and value < minimum_mib:
        raise AllocatorConfigError(f"CachingAllocator option {key} too small, must be >= {minimum_mib}")
    settings[_MIB_KEYS[key]] = min(value, SIZE_MAX // MiB) * MiB
    return i + 2


def _parse_float(tokens: _Tokens, i: int) -> float:
    tokens.expect(i + 1, ":")
    try:
        return float(tokens.at(i + 2))
    except ValueError:
        raise AllocatorConfigError(f"stod: {tokens.at(i + 2)!r} is not a number") from None


def _parse_gc_threshold(tokens: _Tokens, i: int, settings: dict) -> int:
    value = _parse_float(tokens, i)
    if not 0 < value < 1:
        raise AllocatorConfigError("garbage_collect_threshold is invalid, set it in (0.0, 1.0)")
    settings["garbage_collection_threshold"] = value
    return i + 2


def _parse_fraction(tokens: _Tokens, i: int, settings: dict) -> int:
    value = _parse_float(tokens, i)
    if not 0 <= value <= 1:
        raise AllocatorConfigError("per_process_memory_fraction is invalid, set it in [0.0, 1.0]")
    settings["per_process_memory_fraction"] = value
    return i + 2


def _parse_expandable(tokens: _Tokens, i: int, settings: dict) -> int:
    tokens.expect(i + 1, ":")
    settings["expandable_segments"] = tokens.boolean(i + 2)
    return i + 2


def _parse_backend(tokens: _Tokens, i: int, settings: dict) -> int:
    # torch accepts cudaMallocAsync here; the simulator refuses it later (simulator.check_simulated).
    tokens.expect(i + 1, ":")
    value = tokens.at(i + 2)
    if value not in BACKENDS:
        raise AllocatorConfigError("Unknown allocator backend, options are native, cudaMallocAsync, "
                                   "and hipMallocAsync")
    settings["backend"] = value
    return i + 2


_PARSERS = {"garbage_collection_threshold": _parse_gc_threshold, "per_process_memory_fraction": _parse_fraction,
            "expandable_segments": _parse_expandable, "backend": _parse_backend}


def _parse_key(tokens: _Tokens, i: int, settings: dict, divisions: list[int]) -> int:
    """Parse the `key:value` at token i; returns the index of its last token."""
    key = tokens.at(i)
    if key in _MIB_KEYS:
        return _parse_mib(tokens, i, key, settings)
    if key == "roundup_power2_divisions":
        return _parse_divisions(tokens, i, divisions)
    if key in _PARSERS:
        return _PARSERS[key](tokens, i, settings)
    if key in _OTHER_KEYS:
        return tokens.skip_value(i)
    raise AllocatorConfigError(f"Unrecognized key '{key}' in Accelerator allocator config.")


def parse_alloc_conf(text: str | None) -> AllocatorConfig:
    """`'expandable_segments:True,max_split_size_mb:128'` -> AllocatorConfig, or torch's error."""
    if not text:
        return AllocatorConfig()
    tokens = _Tokens(text)
    settings: dict = {}
    divisions = [0] * ROUNDUP_INTERVALS
    i = 0
    while i < len(tokens):
        i = _parse_key(tokens, i, settings, divisions)
        if i + 1 < len(tokens):
            tokens.expect(i + 1, ",")
            i += 1
        i += 1
    return AllocatorConfig(roundup_power2_divisions=tuple(divisions), source=text, **settings)
