"""PYTORCH_ALLOC_CONF from Python: checked with llamem's own parser, set while torch can still read
it, and refused with the fix once it cannot (or applied through torch's runtime hook where torch
rereads a setting).

When torch 2.13 reads the settings (c10/core/AllocatorConfig.cpp, c10/cuda/CUDAAllocatorConfig.h,
c10/cuda/CUDACachingAllocator.cpp):

- The caching allocator parses them once, on first use, from PYTORCH_CUDA_ALLOC_CONF, else
  PYTORCH_HIP_ALLOC_CONF, else PYTORCH_ALLOC_CONF: the old CUDA name wins when both are set. Older
  releases read only the CUDA name, 2.8 to 2.11 warn that it is deprecated, and 2.9.1 ignored
  expandable_segments under the new name (pytorch#183387). The same value under both names is
  read alike by every version.
- `backend` is read earlier, when torch's CUDA library loads at `import torch`: changed after the
  import, the first CUDA call fails with "Allocator backend parsed at runtime != allocator backend
  parsed at load time".
- The variables are read once, by whatever reads a setting first (CUDA's start, or anything else):
  later changes to them do nothing, silently. `torch._C._accelerator_setAllocatorSettings` (the
  deprecated `torch.cuda.memory._set_allocator_settings` before 2.9) parses a new string into the
  settings instead; torch's own tests call it before CUDA starts. Once CUDA has started, only
  RUNTIME_KEYS still matter: the native allocator reads them on every allocation. The hook parses
  the whole string and resets max_split_size_mb, roundup_power2_divisions and
  garbage_collection_threshold when they are absent, so the full merged string is passed.
"""

from __future__ import annotations

import difflib
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

from llamem.allocator.config import AllocatorConfig, AllocatorConfigError, parse_alloc_conf
from llamem.errors import LlamemError, MissingDependency, UsageError

ENV_NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
"""Both are written, with the same value."""
READ_ORDER = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""The first one set is what torch 2.13 reads (AcceleratorAllocatorConfig::instance)."""

RUNTIME_KEYS = frozenset({
    "max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb", "roundup_power2_divisions",
    "garbage_collection_threshold", "expandable_segments", "release_lock_on_cudamalloc", "release_lock_on_hipmalloc"})
"""Read by the native allocator on each allocation (round_size, get_allocation_size, get_free_block,
should_split, alloc_block): changed at runtime, they apply to the next allocation. New expandable or
large segments follow the new values; segments already reserved stay as they are."""
STARTUP_KEYS = frozenset({
    "backend", "per_process_memory_fraction", "graph_capture_record_stream_reuse", "throw_on_cudamalloc_oom",
    "pinned_use_background_threads", "pinned_max_round_threshold", "pinned_max_cached_size",
    "pinned_use_cuda_host_register", "pinned_use_hip_host_register", "pinned_num_register_threads"})
"""Read when the allocator (or the pinned host allocator) starts, or not checked to be read later:
after CUDA has started, llamem refuses to change them rather than guess."""
KNOWN_KEYS = RUNTIME_KEYS | STARTUP_KEYS
NATIVE_ONLY_KEYS = ("max_split_size_mb", "max_non_split_rounding_mb", "large_segment_size_mb",
                    "roundup_power2_divisions", "garbage_collection_threshold", "expandable_segments")
"""What backend:cudaMallocAsync ignores (torch warns once; llamem refuses the combination)."""

_HINTS = {
    "max_split_size_mb": "a whole number of MiB, 20 or more, e.g. max_split_size_mb:128",
    "max_non_split_rounding_mb": "a whole number of MiB, 20 or more, e.g. max_non_split_rounding_mb:256",
    "large_segment_size_mb": "a whole number of MiB, e.g. large_segment_size_mb:40",
    "roundup_power2_divisions": "a power of two, e.g. roundup_power2_divisions:4, or one per size in MiB, "
                                "e.g. roundup_power2_divisions:[256:1,512:2,>:4]",
    "garbage_collection_threshold": "a number between 0 and 1, e.g. garbage_collection_threshold:0.8",
    "expandable_segments": "True or False, e.g. expandable_segments:True",
    "backend": "native or cudaMallocAsync, e.g. backend:native",
    "per_process_memory_fraction": "a number from 0 to 1, e.g. per_process_memory_fraction:0.9",
}


class AllocatorAlreadyStarted(LlamemError):
    """CUDA has started: the allocator has read its settings, and a change would be silently ignored."""


@dataclass(frozen=True, kw_only=True)
class AllocatorSetup:
    """What configure_allocator did."""

    settings: str
    """The allocator settings now in PYTORCH_ALLOC_CONF and PYTORCH_CUDA_ALLOC_CONF ("" : none)."""
    previous: str | None = None
    """The settings torch would have read before the call (None: no variable was set)."""
    applied_now: tuple[str, ...] = ()
    """Keys also handed to torch's allocator settings (torch was imported): the changed ones."""
    notes: tuple[str, ...] = ()
    rmm: bool = False
    """PyTorch's allocator was replaced by RMM's."""


# Reading and writing the settings string --------------------------------------------------------
def split_settings(text: str | None, label: str = "allocator settings") -> dict[str, str]:
    """'expandable_segments:True,roundup_power2_divisions:[256:1,>:4]' -> {key: value}, in order.
    Spaces are dropped, as torch's tokenizer drops them."""
    pairs: dict[str, str] = {}
    for part in _top_level_parts((text or "").replace(" ", "")):
        key, colon, value = part.partition(":")
        if not colon or not key or not value:
            raise AllocatorConfigError(f"{label}: {part!r} is not key:value; write e.g. expandable_segments:True, "
                                       "several separated by commas")
        pairs[key] = value
    return pairs


def _top_level_parts(text: str) -> list[str]:
    """Split on the commas outside brackets (a list value holds commas of its own)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return [p for p in parts if p]


def join_settings(pairs: dict[str, str]) -> str:
    return ",".join(f"{key}:{value}" for key, value in pairs.items())


def format_value(key: str, value) -> str:
    """A keyword value as torch spells it: True/False, numbers, or a roundup list from a dict."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return value.strip()
    if key == "roundup_power2_divisions" and isinstance(value, dict):
        return "[" + ",".join(f"{k}:{v}" for k, v in value.items()) + "]"
    hint = _HINTS.get(key, "a string, a number or True/False")
    raise AllocatorConfigError(f"allocator setting {key}={value!r}: give {hint}")


def requested_settings(conf: str | None, settings: dict) -> dict[str, str | None]:
    """The string's settings, then the keywords' (a keyword wins over the string; None removes a key)."""
    if conf is not None and not isinstance(conf, str):
        raise AllocatorConfigError(f"configure_allocator takes a settings string such as "
                                   f"'expandable_segments:True', or keywords; got {type(conf).__name__} {conf!r}")
    requested: dict[str, str | None] = dict(split_settings(conf, "configure_allocator's settings string"))
    for key, value in settings.items():
        requested[key] = None if value is None else format_value(key, value)
    return requested


def merge_settings(current: str | None, requested: dict[str, str | None]) -> str:
    """The current settings with the requested ones put in place (changed keys keep their position)."""
    merged = split_settings(current, "the current allocator settings")
    for key, value in requested.items():
        if value is None:
            merged.pop(key, None)
        else:
            merged[key] = value
    return join_settings(merged)


def settings_in_environment(environ=None) -> tuple[str | None, list[str]]:
    """(what torch 2.13 reads from the environment, notes on what else is set)."""
    environ = os.environ if environ is None else environ
    found = [(name, environ[name]) for name in READ_ORDER if name in environ]
    if not found:
        return None, []
    name, value = found[0]
    notes = [f"{other} ({other_value!r}) differs from {name} ({value!r}): torch 2.13 reads {name}, so its value "
             "was kept" for other, other_value in found[1:] if other_value != value]
    return value, notes


# Checking ---------------------------------------------------------------------------------------
def check_settings(text: str) -> AllocatorConfig:
    """llamem's parser on each setting, then on the whole: the first problem, with the fix."""
    pairs = split_settings(text)
    for key, value in pairs.items():
        if key not in KNOWN_KEYS:
            near = difflib.get_close_matches(key, sorted(KNOWN_KEYS), n=3)
            hint = f"did you mean {' or '.join(near)}? " if near else ""
            raise AllocatorConfigError(f"unknown allocator setting {key!r}: {hint}torch refuses unknown keys; the "
                                       f"keys are {', '.join(sorted(KNOWN_KEYS))}")
        try:
            parse_alloc_conf(f"{key}:{value}")
        except AllocatorConfigError as err:
            fix = _HINTS.get(key, "see the PYTORCH_ALLOC_CONF notes in PyTorch's CUDA semantics docs")
            raise AllocatorConfigError(f"allocator setting {key}:{value} is refused ({str(err).strip()}): "
                                       f"give {fix}") from None
    config = parse_alloc_conf(text)
    ignored = [key for key in NATIVE_ONLY_KEYS if key in pairs]
    if config.backend != "native" and ignored:
        raise AllocatorConfigError(f"backend:{config.backend} ignores {', '.join(ignored)} (they configure the native "
                                   f"caching allocator) in {text!r}: drop them, or drop backend:{config.backend}")
    return config


# Deciding ---------------------------------------------------------------------------------------
def decide(requested: dict[str, str | None], current: str | None, *,
           is_initialized: Callable[[], bool] | None, loaded_backend: str | None = None) -> AllocatorSetup:
    """What to do, without doing it. `current`: the settings torch reads (or, once CUDA has started,
    runs with); `is_initialized`: torch.cuda.is_initialized, None when torch is not imported;
    `loaded_backend`: the backend torch chose at import (None where it has no CUDA)."""
    merged = merge_settings(current, requested)
    check_settings(merged)
    before, after = split_settings(current), split_settings(merged)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    if is_initialized is None:
        return AllocatorSetup(settings=merged, previous=current, notes=(
            "torch is not imported yet: it reads these settings when CUDA starts",))
    _check_backend(after.get("backend", "native"), changed, loaded_backend)
    if not is_initialized():
        notes = ("CUDA has not started: torch's allocator takes these settings when it starts; they are handed "
                 "to torch too, as it reads the variables only once and something may have read them already",)
        return AllocatorSetup(settings=merged, previous=current, applied_now=tuple(changed),
                              notes=notes if changed else ())
    late = [k for k in changed if k not in RUNTIME_KEYS]
    if late:
        raise AllocatorAlreadyStarted(_too_late_message(late, after, before))
    notes = [f"CUDA had started: {', '.join(changed)} handed to the running allocator, which reads "
             f"{'it' if len(changed) == 1 else 'them'} on every allocation"] if changed else []
    if "expandable_segments" in changed:
        notes.append("expandable_segments applies to memory reserved from now on; segments already reserved stay "
                     "as they are until torch.cuda.empty_cache() returns them")
    return AllocatorSetup(settings=merged, previous=current, applied_now=tuple(changed), notes=tuple(notes))


def _check_backend(backend: str, changed: list[str], loaded_backend: str | None) -> None:
    if "backend" in changed and loaded_backend is not None and backend != loaded_backend:
        raise AllocatorAlreadyStarted(
            f"backend:{backend} cannot be set once torch is imported: torch chose the {loaded_backend} allocator "
            f"when it loaded, and its first CUDA call would fail (\"Allocator backend parsed at runtime != allocator "
            f"backend parsed at load time\"). Set PYTORCH_ALLOC_CONF=backend:{backend} in the environment before "
            "Python starts, or call configure_allocator before `import torch`")


def _too_late_message(late: list[str], after: dict[str, str], before: dict[str, str]) -> str:
    shown = ", ".join(f"{k}:{after[k]}" if k in after else f"removing {k}:{before[k]}" for k in late)
    merged = join_settings(after)
    fix = (f"Set it before the first CUDA call: call configure_allocator(...) at the top of the script, before "
           f"any tensor or model goes to the GPU, or start Python with PYTORCH_ALLOC_CONF={merged!r} in the "
           "environment.")
    if "per_process_memory_fraction" in late:
        fix += " At runtime, torch.cuda.set_per_process_memory_fraction(fraction) sets the fraction."
    return (f"CUDA has already started in this process and its allocator has read its settings: {shown} would be "
            f"silently ignored. {fix} (Only {', '.join(sorted(RUNTIME_KEYS))} can change at runtime.)")


def check_rmm(*, rmm_installed: bool, cuda_available: bool, is_initialized: Callable[[], bool]) -> None:
    """Whether PyTorch can switch to RMM's allocator now; the fix when it cannot."""
    if not rmm_installed:
        raise MissingDependency("rmm=True needs RAPIDS Memory Manager: pip install rmm-cu12 (CUDA 12) or rmm-cu13 "
                                "(CUDA 13)")
    if not cuda_available:
        raise LlamemError("rmm=True needs a CUDA device, and torch sees none: RMM allocates GPU memory only")
    if is_initialized():
        raise AllocatorAlreadyStarted(
            "rmm=True must come before the first CUDA call: torch cannot change its allocator once it has been "
            "used (change_current_allocator refuses). Call configure_allocator(rmm=True) at the top of the script")


# Doing ------------------------------------------------------------------------------------------
def configure_allocator(conf: str | None = None, *, rmm: bool = False, **settings) -> AllocatorSetup:
    """Set PyTorch's CUDA allocator settings, e.g. `configure_allocator(expandable_segments=True)` or
    `configure_allocator("expandable_segments:True,max_split_size_mb:128")`.

    Merged with what PYTORCH_CUDA_ALLOC_CONF / PYTORCH_ALLOC_CONF hold (a keyword set to None removes a
    key), checked with llamem's parser (torch's errors, and the fix), then written under both names.
    torch is not imported if it was not. Once CUDA has started, only RUNTIME_KEYS can change: they are
    handed to the running allocator; any other change raises AllocatorAlreadyStarted.

    `rmm=True`: switch PyTorch to RAPIDS Memory Manager's allocator instead (before any CUDA call).
    `llamem allocator replay` simulates PyTorch's own caching allocator: its figures do not apply to RMM."""
    requested = requested_settings(conf, settings)
    if rmm:
        return _use_rmm(requested)
    torch = sys.modules.get("torch")  # None also when a test blocked it
    environment_value, notes = settings_in_environment()
    started = torch is not None and torch.cuda.is_initialized()
    current = _running_settings(torch) if started else environment_value
    setup = decide(requested, current, is_initialized=None if torch is None else torch.cuda.is_initialized,
                   loaded_backend=_loaded_backend(torch))
    if setup.applied_now:
        _apply_running(torch, setup.settings, required=started)
    _write_environment(setup.settings)
    return AllocatorSetup(settings=setup.settings, previous=setup.previous, applied_now=setup.applied_now,
                          notes=(*notes, *setup.notes))


def _write_environment(settings: str) -> None:
    for name in ENV_NAMES:
        if settings:
            os.environ[name] = settings
        else:
            os.environ.pop(name, None)


def _running_settings(torch) -> str | None:
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    return getter() if getter is not None else settings_in_environment()[0]


def _loaded_backend(torch) -> str | None:
    if torch is None or not hasattr(torch._C, "_cuda_getAllocatorBackend"):
        return None  # a build without CUDA: no backend to clash with
    return torch.cuda.get_allocator_backend()


def _apply_running(torch, settings: str, required: bool = True) -> None:
    """Hand the settings to torch. Before CUDA starts the variables suffice where the hook is missing
    (CPU builds before 2.9); after, a missing hook is an error."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None and hasattr(torch._C, "_cuda_cudaCachingAllocator_set_allocator_settings"):
        setter = torch._C._cuda_cudaCachingAllocator_set_allocator_settings  # torch before 2.9
    if setter is None:
        if required:
            raise AllocatorAlreadyStarted(f"this torch ({torch.__version__}) cannot change allocator settings once "
                                          "CUDA has started: set them before the first CUDA call")
        return
    try:
        setter(settings)
    except (RuntimeError, ValueError, IndexError) as err:  # TORCH_CHECK / TORCH_CHECK_VALUE / std::out_of_range
        raise AllocatorConfigError(f"torch refused the allocator settings {settings!r}: {err}") from None


def _use_rmm(requested: dict) -> AllocatorSetup:
    if requested:
        raise UsageError("rmm=True replaces PyTorch's caching allocator, which the other settings configure: "
                         "pass either allocator settings or rmm=True")
    import importlib.util

    try:
        import torch
    except ImportError as err:
        raise MissingDependency("rmm=True needs torch with CUDA: pip install 'llamem[torch]'") from err
    check_rmm(rmm_installed=importlib.util.find_spec("rmm") is not None, cuda_available=torch.cuda.is_available(),
              is_initialized=torch.cuda.is_initialized)
    from rmm.allocators.torch import rmm_torch_allocator

    if rmm_torch_allocator is None:
        raise MissingDependency("this rmm build has no PyTorch allocator (rmm.allocators.torch.rmm_torch_allocator "
                                "is None): install the rmm wheel that matches your CUDA version")
    torch.cuda.memory.change_current_allocator(rmm_torch_allocator)
    return AllocatorSetup(settings="", rmm=True, notes=(
        "PyTorch now allocates through RMM's current device resource (set one with "
        "rmm.mr.set_current_device_resource, e.g. a PoolMemoryResource, as RMM's default calls cudaMalloc "
        "each time)",
        "torch.cuda.memory_stats() is not kept under a pluggable allocator: read rmm.statistics instead",
        "llamem's allocator simulator models PyTorch's caching allocator only: `llamem allocator replay` "
        "figures do not describe RMM"))
