"""`llamem doctor`: what this environment has, and what that changes for memory.

Versions come from package metadata (importlib.metadata): no package is imported to read its
version. torch is imported for what only it can say (its CUDA or ROCm build, the SDPA kernels),
NVML (nvidia-ml-py) for the driver and the GPUs. Every check works without torch and without a GPU,
and says what is missing instead of failing.
"""

from __future__ import annotations

import importlib.metadata
import platform
import re

from llamem.allocator.config import AllocatorConfigError
from llamem.runtime.allocator_conf import READ_ORDER, check_settings, settings_in_environment, split_settings

CHECKED_VERSIONS = {"torch": "2.13.0", "transformers": "5.24.0", "peft": "0.21.2", "accelerate": "1.15.0",
                    "deepspeed": "0.19.8"}
"""The versions llamem's analytic engine was checked against: the dev pins of the Makefile's PINS line,
which `make setup` installs and the test suite and benchmarks run on. Keep the two in step."""
PACKAGES = ("torch", "transformers", "peft", "accelerate", "bitsandbytes", "deepspeed", "torchao", "optimum-quanto",
            "hqq", "nvidia-ml-py")
KV_CACHE_BACKENDS = {"optimum-quanto": "int4", "hqq": "int8"}
"""The package behind each quantized `--kv-dtype` (transformers' QuantizedCache backends quanto and HQQ)."""


# Versions ---------------------------------------------------------------------------------------
def package_versions(names=PACKAGES) -> dict[str, str | None]:
    """{distribution: installed version, or None}."""
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def release(version: str) -> tuple[int, ...]:
    """'2.13.0+cu128' -> (2, 13, 0); '2.14.0.dev20261101' -> (2, 14, 0); 'rocm7.0' -> ()."""
    match = re.match(r"\d+(\.\d+)*", version.strip())
    return tuple(int(part) for part in match.group(0).split(".")) if match else ()


def version_mismatches(installed: dict[str, str | None], checked: dict[str, str] = CHECKED_VERSIONS) -> list[dict]:
    """The installed packages whose version is not the one llamem was checked against. A local build
    tag ('+cpu', '+cu128') is the same release; packages not installed are not mismatches."""
    found = []
    for name, want in checked.items():
        have = installed.get(name)
        if have is None or have.split("+")[0] == want:
            continue
        mine, theirs = release(have), release(want)
        relation = "newer" if mine > theirs else "older" if mine < theirs else "a different build"
        found.append({"package": name, "installed": have, "checked": want, "relation": relation})
    return found


def mismatch_note(mismatch: dict) -> str:
    name, have, want = mismatch["package"], mismatch["installed"], mismatch["checked"]
    relation = mismatch["relation"]
    than = f"is {relation} than" if relation in ("newer", "older") else "is a different build of"
    return (f"{name} {have} {than} {want}, the version llamem's analytic engine (`llamem estimate`, `llamem plan`) "
            f"was checked against: its figures follow {name} {want}. `llamem trace` runs the installed code, so its "
            f"figures follow {name} {have}")


# torch ------------------------------------------------------------------------------------------
def torch_facts() -> tuple[dict, object | None]:
    """(what torch says about itself, the module or None when it cannot be imported)."""
    try:
        import torch
    except ImportError as err:
        return {"importable": False, "error": str(err), "version": None, "cuda": None, "hip": None,
                "cuda_available": False, "num_devices": 0}, None
    available = torch.cuda.is_available()
    return {"importable": True, "error": None, "version": torch.__version__, "cuda": torch.version.cuda,
            "hip": getattr(torch.version, "hip", None), "cuda_available": available,
            "num_devices": torch.cuda.device_count() if available else 0}, torch


def expandable_segments_support(*, torch_version: str | None, cuda: str | None, hip: str | None,
                                system: str) -> tuple[bool | None, str]:
    """Whether `expandable_segments:True` takes effect. From torch's source: added in 2.1 on CUDA;
    built only where c10 loads the driver API (Linux: it is dlopen'ed; elsewhere torch warns
    "expandable_segments not supported on this platform" and ignores it); on ROCm from the release
    after pytorch#177974 (2.12) and ROCm 7.0 (CUDAAllocatorConfig.h guards ROCM_VERSION < 70000)."""
    if torch_version is None:
        return None, "torch is not importable here"
    if release(torch_version) < (2, 1):
        return False, f"torch {torch_version} predates expandable segments (torch 2.1)"
    if hip:
        if release(torch_version) < (2, 12):
            return False, f"ROCm builds of torch before 2.12 ignore it (this is {torch_version}, HIP {hip})"
        if release(hip) < (7, 0):
            return False, f"torch needs ROCm 7.0 or newer for it; this build has HIP {hip}"
        return True, f"supported (torch {torch_version}, HIP {hip}; from torch's source, not checked on an AMD GPU)"
    if cuda is None:
        return False, "this torch has no CUDA: the allocator settings only act on GPU memory"
    if system != "Linux":
        return False, f"torch builds it on Linux only; on {system} torch warns and ignores it"
    return True, f"supported (torch {torch_version}, CUDA {cuda}, Linux)"


def sdpa_facts(torch, cuda_available: bool) -> dict:
    """Which fused attention kernels SDPA can pick here: built in, switched on, and a CUDA device."""
    if torch is None:
        return {"flash": {"available": False, "built": None, "enabled": None},
                "mem_efficient": {"available": False, "enabled": None}}
    backends = torch.backends.cuda
    built = backends.is_flash_attention_available() if hasattr(backends, "is_flash_attention_available") else None
    flash_on, efficient_on = backends.flash_sdp_enabled(), backends.mem_efficient_sdp_enabled()
    return {"flash": {"available": bool(built) and flash_on and cuda_available, "built": built, "enabled": flash_on},
            "mem_efficient": {"available": efficient_on and cuda_available, "enabled": efficient_on}}


# What each feature changes for memory -------------------------------------------------------------
def _feature(available: bool | None, detail: str, **extra) -> dict:
    return {"available": available, "detail": detail, **extra}


def attention_features(sdpa: dict, cuda_available: bool) -> dict:
    """Flash and memory-efficient SDPA: whether attention materialises its batch x heads x seq^2 weights."""
    flash, efficient = sdpa["flash"], sdpa["mem_efficient"]
    fused = "SDPA keeps O(batch x heads x seq) state, not the batch x heads x seq^2 attention weights"
    if not cuda_available:
        why = ("torch is not importable here" if efficient["enabled"] is None else
               "no CUDA device visible here: run `llamem doctor` on the GPU machine")
        return {"flash_sdpa": _feature(False, why, built=flash["built"], enabled=flash["enabled"]),
                "mem_efficient_sdpa": _feature(False, why, enabled=efficient["enabled"])}
    flash_why = (fused + " (fp16/bf16, Ampere or newer)" if flash["available"] else
                 "this torch was built without it" if flash["built"] is False else
                 "switched off (torch.backends.cuda.enable_flash_sdp(False))")
    efficient_why = (fused if efficient["available"] else
                     "switched off (torch.backends.cuda.enable_mem_efficient_sdp(False))")
    if not flash["available"] and not efficient["available"]:
        efficient_why += ("; with neither fused kernel SDPA runs the math kernel, which keeps the attention weights: "
                          "`--attn sdpa` figures assume a fused kernel, size with `--attn eager` instead")
    return {"flash_sdpa": _feature(flash["available"], flash_why, built=flash["built"], enabled=flash["enabled"]),
            "mem_efficient_sdpa": _feature(efficient["available"], efficient_why, enabled=efficient["enabled"])}


def optimizer_feature(versions: dict, cuda_available: bool) -> dict:
    bnb = versions.get("bitsandbytes")
    if bnb is None:
        return _feature(False, "bitsandbytes is not installed: `pip install bitsandbytes` for `--optimizer adamw8bit` "
                               "(about 2 bytes of optimizer state per trained parameter instead of AdamW's 8)")
    if not cuda_available:
        return _feature(False, f"bitsandbytes {bnb} is installed, but torch sees no CUDA device for its 8-bit "
                               "optimizers here")
    return _feature(True, f"bitsandbytes {bnb}: `--optimizer adamw8bit` (transformers optim='adamw_bnb_8bit') keeps "
                          "about 2 bytes of optimizer state per trained parameter instead of AdamW's 8")


def kv_cache_feature(versions: dict) -> dict:
    found = {package: dtype for package, dtype in KV_CACHE_BACKENDS.items() if versions.get(package)}
    if not found:
        return _feature(False, "neither optimum-quanto nor hqq is installed: `--kv-dtype int4` needs optimum-quanto, "
                               "`--kv-dtype int8` needs hqq (transformers' QuantizedCache backends)", backends=[])
    listed = ", ".join(f"`--kv-dtype {dtype}` ({package} {versions[package]})" for package, dtype in found.items())
    bits = " or ".join(sorted(dtype.removeprefix("int") for dtype in found.values()))
    return _feature(True, f"{listed}: {bits} bits per cached value (plus scales) instead of bf16's 16",
                    backends=sorted(found))


def allocator_settings_facts(torch_version: str | None, expandable: bool | None, environ=None) -> dict:
    """The allocator settings in the environment, checked with llamem's parser, and what they do here."""
    import os

    environ = os.environ if environ is None else environ
    value, notes = settings_in_environment(environ)
    facts = {name: environ.get(name) for name in READ_ORDER}
    facts.update(read=next((name for name in READ_ORDER if name in environ), None), settings=value, valid=True,
                 problem=None)
    try:
        check_settings(value)
    except AllocatorConfigError as err:
        facts.update(valid=False, problem=str(err))
    facts["notes"] = notes + _settings_notes(value, torch_version, expandable, environ)
    return facts


def _settings_notes(value: str | None, torch_version: str | None, expandable: bool | None, environ) -> list[str]:
    if not value:
        return ["none set: torch's defaults (fixed-size segments, every cached block can be split)"]
    try:
        pairs = split_settings(value)
    except AllocatorConfigError:
        return []
    notes = []
    if pairs.get("expandable_segments") == "True" and expandable is False:
        notes.append("expandable_segments:True is set, but this torch ignores it (see expandable segments)")
    if pairs.get("backend") == "cudaMallocAsync":
        notes.append("backend:cudaMallocAsync hands pooling to the CUDA driver: `llamem allocator replay` cannot "
                     "simulate it")
    only_new_name = "PYTORCH_ALLOC_CONF" in environ and "PYTORCH_CUDA_ALLOC_CONF" not in environ
    if only_new_name and torch_version and (2, 9) <= release(torch_version) < (2, 11):
        notes.append("torch 2.9.1 ignores expandable_segments under PYTORCH_ALLOC_CONF (pytorch#183387, fine in "
                     "2.11): set PYTORCH_CUDA_ALLOC_CONF too (llamem.runtime.configure_allocator writes both)")
    return notes


# GPUs -------------------------------------------------------------------------------------------
def nvml_facts() -> dict:
    """The NVIDIA driver and each GPU's name and total memory, from NVML."""
    none = {"driver_version": None, "cuda_driver_version": None, "devices": []}
    try:
        import pynvml
    except ImportError:
        return {**none, "detail": "no NVIDIA GPU visible (nvidia-ml-py is not installed: `pip install nvidia-ml-py` "
                                  "to ask the driver)"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as err:
        return {**none, "detail": f"no NVIDIA GPU visible (NVML: {err})"}
    try:
        devices = [_nvml_device(pynvml, i) for i in range(pynvml.nvmlDeviceGetCount())]
        cuda = pynvml.nvmlSystemGetCudaDriverVersion()
        return {"driver_version": _text(pynvml.nvmlSystemGetDriverVersion()),
                "cuda_driver_version": f"{cuda // 1000}.{cuda % 1000 // 10}", "devices": devices,
                "detail": f"{len(devices)} NVIDIA GPU{'' if len(devices) == 1 else 's'}" if devices else
                          "no NVIDIA GPU visible (the driver lists none)"}
    except pynvml.NVMLError as err:
        return {**none, "detail": f"NVML answered, then failed: {err}"}
    finally:
        pynvml.nvmlShutdown()


def _nvml_device(pynvml, index: int) -> dict:
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    return {"index": index, "name": _text(pynvml.nvmlDeviceGetName(handle)),
            "total_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)}


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# All of it --------------------------------------------------------------------------------------
def diagnose(environ=None) -> dict:
    """Everything `llamem doctor` prints, as one JSON-ready dict."""
    versions = package_versions()
    torch_info, torch = torch_facts()
    cuda_available = torch_info["cuda_available"]
    supported, why = expandable_segments_support(torch_version=torch_info["version"], cuda=torch_info["cuda"],
                                                 hip=torch_info["hip"], system=platform.system())
    features = {"expandable_segments": _feature(supported, why),
                **attention_features(sdpa_facts(torch, cuda_available), cuda_available),
                "eight_bit_optimizers": optimizer_feature(versions, cuda_available),
                "quantized_kv_cache": kv_cache_feature(versions)}
    mismatches = version_mismatches(versions)
    return {"python": platform.python_version(), "platform": platform.platform(), "llamem": _llamem_version(),
            "versions": versions, "torch": torch_info, "features": features,
            "allocator_settings": allocator_settings_facts(torch_info["version"], supported, environ),
            "gpus": nvml_facts(), "checked_versions": dict(CHECKED_VERSIONS), "version_mismatches": mismatches,
            "notes": _notes(versions, torch_info, mismatches)}


def _llamem_version() -> str | None:
    try:
        return importlib.metadata.version("llamem")
    except importlib.metadata.PackageNotFoundError:
        return None


def _notes(versions: dict, torch_info: dict, mismatches: list[dict]) -> list[str]:
    notes = [mismatch_note(m) for m in mismatches]
    missing = [name for name in ("torch", "transformers") if versions.get(name) is None]
    if not torch_info["importable"]:
        notes.append(f"torch cannot be imported ({torch_info['error']}): `llamem estimate`, `plan` and `allocator "
                     "replay` work without it; `llamem trace` and llamem.runtime need it")
    elif missing:
        notes.append(f"{' and '.join(missing)} not installed: `llamem trace` needs torch and transformers "
                     "(pip install 'llamem[torch]')")
    return notes
