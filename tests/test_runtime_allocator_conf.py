"""configure_allocator: the settings written under both names, merged with what is set, checked with
llamem's parser (the key and the fix in every error), and the decision once CUDA has started (tested
through `decide` with an injected `is_initialized`: CUDA cannot start on a CPU)."""

import os
import subprocess
import sys

import pytest

from llamem.allocator.config import AllocatorConfigError, parse_alloc_conf
from llamem.errors import LlamemError, MissingDependency, UsageError
from llamem.runtime.allocator_conf import (KNOWN_KEYS, RUNTIME_KEYS, STARTUP_KEYS, AllocatorAlreadyStarted,
                                           check_rmm, configure_allocator, decide, merge_settings,
                                           requested_settings, settings_in_environment, split_settings)

try:  # imported (where installed) so that configure_allocator takes the same path in every test order
    import torch
except ImportError:
    torch = None

NAMES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_HIP_ALLOC_CONF")


@pytest.fixture
def env(monkeypatch):
    """No allocator variable set; torch's own settings put back afterwards (configure_allocator hands
    them to an imported torch)."""
    for name in NAMES:
        monkeypatch.delenv(name, raising=False)
    before = torch._C._accelerator_getAllocatorSettings() if torch is not None else None
    yield monkeypatch
    if torch is not None:
        torch._C._accelerator_setAllocatorSettings(before)


def both() -> tuple[str | None, str | None]:
    return os.environ.get("PYTORCH_ALLOC_CONF"), os.environ.get("PYTORCH_CUDA_ALLOC_CONF")


# Writing and merging -----------------------------------------------------------------------------
def test_sets_both_names(env):
    setup = configure_allocator(expandable_segments=True)
    assert both() == ("expandable_segments:True", "expandable_segments:True")
    assert setup.settings == "expandable_segments:True" and setup.previous is None
    assert setup.applied_now == (("expandable_segments",) if torch is not None else ())


@pytest.mark.skipif(torch is None, reason="needs torch")
def test_handed_to_an_imported_torch_before_cuda_starts(env):
    # torch reads the variables only once: an imported torch gets the string through its hook too.
    env.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    configure_allocator(expandable_segments=True)
    assert torch._C._accelerator_getAllocatorSettings() == "max_split_size_mb:128,expandable_segments:True"


def test_a_string_and_keywords(env):
    configure_allocator("max_split_size_mb:128, expandable_segments:False", expandable_segments=True,
                        garbage_collection_threshold=0.8, roundup_power2_divisions={256: 1, 512: 2, ">": 4})
    assert both()[0] == ("max_split_size_mb:128,expandable_segments:True,garbage_collection_threshold:0.8,"
                         "roundup_power2_divisions:[256:1,512:2,>:4]")
    assert both()[0] == both()[1]


def test_merged_with_the_value_torch_reads(env):
    env.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:False")
    setup = configure_allocator(expandable_segments=True)
    assert setup.previous == "max_split_size_mb:128,expandable_segments:False"
    assert both() == ("max_split_size_mb:128,expandable_segments:True",) * 2


def test_the_cuda_name_wins_when_both_differ(env):
    # torch 2.13 reads PYTORCH_CUDA_ALLOC_CONF first (AcceleratorAllocatorConfig::instance).
    env.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")
    env.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:256")
    setup = configure_allocator(roundup_power2_divisions=4)
    assert both() == ("max_split_size_mb:256,roundup_power2_divisions:4",) * 2
    assert any("PYTORCH_ALLOC_CONF ('max_split_size_mb:64') differs from PYTORCH_CUDA_ALLOC_CONF" in n
               for n in setup.notes)


def test_only_the_new_name_set(env):
    env.setenv("PYTORCH_ALLOC_CONF", "max_split_size_mb:64")
    configure_allocator(expandable_segments=True)
    assert both() == ("max_split_size_mb:64,expandable_segments:True",) * 2


def test_none_removes_a_key_and_the_last_one_unsets(env):
    env.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128,expandable_segments:True")
    configure_allocator(max_split_size_mb=None)
    assert both() == ("expandable_segments:True",) * 2
    configure_allocator(expandable_segments=None)
    assert both() == (None, None)


def test_split_keeps_list_values_whole():
    assert split_settings(" roundup_power2_divisions:[256:1, >:4],expandable_segments:True") == {
        "roundup_power2_divisions": "[256:1,>:4]", "expandable_segments": "True"}
    assert merge_settings("a:1,b:2", {"a": "3", "c": "4", "b": None}) == "a:3,c:4"
    assert requested_settings("max_split_size_mb:64", {"max_split_size_mb": 128}) == {"max_split_size_mb": "128"}


def test_does_not_import_torch():
    code = ("import os, sys\nfrom llamem.runtime import configure_allocator\n"
            "configure_allocator(expandable_segments=True)\n"
            "print('torch' in sys.modules, os.environ['PYTORCH_ALLOC_CONF'], os.environ['PYTORCH_CUDA_ALLOC_CONF'])")
    environ = {k: v for k, v in os.environ.items() if k not in NAMES}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=environ, timeout=60)
    assert out.stdout.split() == ["False", "expandable_segments:True", "expandable_segments:True"], out.stderr


# Checking ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("settings, message", [
    ({"expandable_segment": True}, "unknown allocator setting 'expandable_segment': did you mean expandable_segments?"),
    ({"max_split_size_mb": 10}, "max_split_size_mb:10 is refused (CachingAllocator option max_split_size_mb too "
                                "small, must be >= 20): give a whole number of MiB, 20 or more"),
    ({"max_split_size_mb": True}, "max_split_size_mb:True is refused"),
    ({"garbage_collection_threshold": 1.5}, "garbage_collection_threshold:1.5 is refused (garbage_collect_threshold "
                                            "is invalid, set it in (0.0, 1.0)): give a number between 0 and 1"),
    ({"roundup_power2_divisions": 3}, "roundup_power2_divisions:3 is refused (For roundups, the divisions has to be "
                                      "power of 2): give a power of two"),
    ({"expandable_segments": "maybe"}, "expandable_segments:maybe is refused"),
    ({"backend": "cudaMalloc"}, "backend:cudaMalloc is refused (Unknown allocator backend"),
    ({"backend": "cudaMallocAsync", "expandable_segments": True},
     "backend:cudaMallocAsync ignores max_split_size_mb, expandable_segments (they configure the native caching "
     "allocator) in 'max_split_size_mb:128,backend:cudaMallocAsync,expandable_segments:True'"),
    ({"roundup_power2_divisions": [4]}, "roundup_power2_divisions=[4]: give a power of two"),
])
def test_bad_settings_name_the_key_and_the_fix(env, settings, message):
    env.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    with pytest.raises(AllocatorConfigError) as caught:
        configure_allocator(**settings)
    assert message in str(caught.value)
    assert both() == (None, "max_split_size_mb:128")  # nothing written


def test_a_malformed_string(env):
    with pytest.raises(AllocatorConfigError, match="'expandable_segments' is not key:value"):
        configure_allocator("expandable_segments")


def test_every_known_key_is_one_llamem_parses():
    values = {"backend": "native", "per_process_memory_fraction": "0.5", "roundup_power2_divisions": "4",
              "garbage_collection_threshold": "0.5", "pinned_num_register_threads": "4"}
    assert not RUNTIME_KEYS & STARTUP_KEYS
    for key in KNOWN_KEYS:
        value = values.get(key, "128" if key.endswith("_mb") else "True")
        parse_alloc_conf(f"{key}:{value}")


# Deciding, before and after CUDA starts ---------------------------------------------------------
def test_torch_not_imported():
    setup = decide({"expandable_segments": "True"}, None, is_initialized=None)
    assert setup.settings == "expandable_segments:True" and setup.applied_now == ()
    assert setup.notes == ("torch is not imported yet: it reads these settings when CUDA starts",)


def test_before_cuda_starts_the_environment_is_enough():
    setup = decide({"backend": "native", "max_split_size_mb": "128"}, None, is_initialized=lambda: False,
                   loaded_backend="native")
    # Every key counts before CUDA starts: all are handed to torch as well as written.
    assert setup.settings == "backend:native,max_split_size_mb:128"
    assert setup.applied_now == ("backend", "max_split_size_mb")


def test_after_cuda_starts_runtime_keys_go_to_the_running_allocator():
    setup = decide({"expandable_segments": "True"}, "max_split_size_mb:128", is_initialized=lambda: True)
    # The whole string: torch resets max_split_size_mb when a new string leaves it out.
    assert setup.settings == "max_split_size_mb:128,expandable_segments:True"
    assert setup.applied_now == ("expandable_segments",)
    assert "handed to the running allocator" in setup.notes[0]
    assert "segments already reserved stay as they are until torch.cuda.empty_cache()" in setup.notes[1]


def test_after_cuda_starts_removing_a_runtime_key_is_applied():
    setup = decide({"max_split_size_mb": None}, "max_split_size_mb:128,expandable_segments:True",
                   is_initialized=lambda: True)
    assert setup.settings == "expandable_segments:True" and setup.applied_now == ("max_split_size_mb",)


def test_after_cuda_starts_an_unchanged_setting_is_no_change():
    setup = decide({"backend": "native"}, "backend:native", is_initialized=lambda: True, loaded_backend="native")
    assert setup.applied_now == () and setup.notes == ()


@pytest.mark.parametrize("requested, shown", [
    ({"per_process_memory_fraction": "0.5"}, "per_process_memory_fraction:0.5"),
    ({"pinned_use_background_threads": "True", "expandable_segments": "True"}, "pinned_use_background_threads:True"),
])
def test_after_cuda_starts_other_keys_are_refused(requested, shown):
    with pytest.raises(AllocatorAlreadyStarted) as caught:
        decide(requested, None, is_initialized=lambda: True)
    message = str(caught.value)
    assert f"{shown} would be silently ignored" in message
    assert "before the first CUDA call" in message and "at the top of the script" in message
    assert "PYTORCH_ALLOC_CONF=" in message and "in the environment" in message
    assert "expandable_segments:True would" not in message  # a runtime key is not blamed
    if "per_process_memory_fraction" in requested:
        assert "torch.cuda.set_per_process_memory_fraction(fraction)" in message


def test_the_backend_is_fixed_at_import():
    with pytest.raises(AllocatorAlreadyStarted, match="backend:cudaMallocAsync cannot be set once torch is imported"):
        decide({"backend": "cudaMallocAsync"}, None, is_initialized=lambda: False, loaded_backend="native")
    # A build without CUDA has no backend to clash with.
    assert decide({"backend": "cudaMallocAsync"}, None, is_initialized=lambda: False).settings == \
        "backend:cudaMallocAsync"


def test_torch_takes_the_string_at_runtime():
    """The runtime hook exists under the name used, and takes (and checks) the whole string."""
    pytest.importorskip("torch")
    from llamem.runtime.allocator_conf import _apply_running

    before = torch._C._accelerator_getAllocatorSettings()
    try:
        _apply_running(torch, "max_split_size_mb:128,expandable_segments:True")
        assert torch._C._accelerator_getAllocatorSettings() == "max_split_size_mb:128,expandable_segments:True"
        with pytest.raises(AllocatorConfigError, match="torch refused the allocator settings 'max_split_size_mb:10'"):
            _apply_running(torch, "max_split_size_mb:10")
    finally:
        torch._C._accelerator_setAllocatorSettings(before)


def test_settings_in_environment_order():
    assert settings_in_environment({}) == (None, [])
    value, notes = settings_in_environment({"PYTORCH_ALLOC_CONF": "a:1", "PYTORCH_HIP_ALLOC_CONF": "a:1"})
    assert (value, notes) == ("a:1", [])


# RMM --------------------------------------------------------------------------------------------
def test_rmm_checks():
    with pytest.raises(MissingDependency, match="pip install rmm-cu12"):
        check_rmm(rmm_installed=False, cuda_available=True, is_initialized=lambda: False)
    with pytest.raises(LlamemError, match="needs a CUDA device"):
        check_rmm(rmm_installed=True, cuda_available=False, is_initialized=lambda: False)
    with pytest.raises(AllocatorAlreadyStarted, match="before the first CUDA call"):
        check_rmm(rmm_installed=True, cuda_available=True, is_initialized=lambda: True)
    check_rmm(rmm_installed=True, cuda_available=True, is_initialized=lambda: False)


def test_rmm_and_settings_exclude_each_other():
    with pytest.raises(UsageError, match="either allocator settings or rmm=True"):
        configure_allocator(rmm=True, expandable_segments=True)


def test_rmm_here_says_what_is_missing():
    pytest.importorskip("torch")
    import importlib.util

    if importlib.util.find_spec("rmm") is not None and torch.cuda.is_available():
        pytest.skip("RMM and CUDA are here")
    with pytest.raises(LlamemError, match="rmm=True needs"):
        configure_allocator(rmm=True)
