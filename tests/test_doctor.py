"""`llamem doctor`: its JSON for this environment (versions as package metadata says), the checks fed
made-up environments (version mismatches, expandable segments, features, allocator settings), and a
run without torch."""

import importlib.metadata
import json
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from llamem.cli import main
from llamem.runtime.doctor import (CHECKED_VERSIONS, PACKAGES, allocator_settings_facts,
                                   expandable_segments_support, kv_cache_feature, mismatch_note, optimizer_feature,
                                   release, version_mismatches)

ROOT = Path(__file__).resolve().parent.parent
TOP_KEYS = {"python", "platform", "llamem", "versions", "torch", "features", "allocator_settings", "gpus",
            "checked_versions", "version_mismatches", "notes"}
FEATURES = {"expandable_segments", "flash_sdpa", "mem_efficient_sdpa", "eight_bit_optimizers", "quantized_kv_cache"}


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def doctor_json(capsys) -> dict:
    capsys.readouterr()
    assert main(["doctor", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_json_for_this_environment(capsys):
    data = doctor_json(capsys)
    assert set(data) == TOP_KEYS
    assert data["python"] == platform.python_version()
    assert data["versions"] == {name: installed(name) for name in PACKAGES}
    assert data["checked_versions"] == CHECKED_VERSIONS
    assert data["version_mismatches"] == version_mismatches(data["versions"])
    assert set(data["features"]) == FEATURES
    assert all(set(f) >= {"available", "detail"} for f in data["features"].values())
    assert set(data["gpus"]) == {"driver_version", "cuda_driver_version", "devices", "detail"}
    if not data["gpus"]["devices"]:
        assert data["gpus"]["detail"].startswith("no NVIDIA GPU visible")


def test_torch_facts_for_this_environment(capsys):
    torch = pytest.importorskip("torch")
    facts = doctor_json(capsys)["torch"]
    assert facts == {"importable": True, "error": None, "version": torch.__version__, "cuda": torch.version.cuda,
                     "hip": torch.version.hip, "cuda_available": torch.cuda.is_available(),
                     "num_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0}


def test_allocator_settings_from_the_environment(capsys, monkeypatch):
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_HIP_ALLOC_CONF", raising=False)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:10")
    facts = doctor_json(capsys)["allocator_settings"]
    assert facts["read"] == "PYTORCH_CUDA_ALLOC_CONF" and facts["settings"] == "max_split_size_mb:10"
    assert facts["valid"] is False and "max_split_size_mb:10 is refused" in facts["problem"]


def test_text_output(capsys):
    capsys.readouterr()
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    for heading in ("packages (installed, checked against)", "memory features", "allocator settings:", "GPUs: "):
        assert heading in out
    assert re.search(r"^  transformers +\S+ +5\.24\.0$", out, re.M)


def test_checked_versions_are_the_makefile_pins():
    pins = re.search(r"^PINS := (.*)$", (ROOT / "Makefile").read_text(), re.M).group(1)
    pinned = dict(pin.split("==") for pin in pins.split())
    assert {name: pinned[name] for name in CHECKED_VERSIONS} == CHECKED_VERSIONS


# Made-up environments ---------------------------------------------------------------------------
def test_mismatches():
    versions = {"torch": "2.12.1+cu124", "transformers": "5.24.0", "peft": None, "accelerate": "1.16.0",
                "deepspeed": "0.19.8rc1", "bitsandbytes": "0.50.2"}
    assert version_mismatches(versions) == [
        {"package": "torch", "installed": "2.12.1+cu124", "checked": "2.13.0", "relation": "older"},
        {"package": "accelerate", "installed": "1.16.0", "checked": "1.15.0", "relation": "newer"},
        {"package": "deepspeed", "installed": "0.19.8rc1", "checked": "0.19.8", "relation": "a different build"},
    ]
    assert version_mismatches({"torch": "2.13.0+cpu", "transformers": "5.24.0"}) == []
    assert version_mismatches({"torch": "2.14.0"}, checked={"torch": "2.14.0"}) == []


def test_mismatch_note():
    note = mismatch_note({"package": "transformers", "installed": "5.30.0", "checked": "5.24.0", "relation": "newer"})
    assert note == ("transformers 5.30.0 is newer than 5.24.0, the version llamem's analytic engine (`llamem "
                    "estimate`, `llamem plan`) was checked against: its figures follow transformers 5.24.0. "
                    "`llamem trace` runs the installed code, so its figures follow transformers 5.30.0")


def test_release():
    assert release("2.13.0+cu128") == (2, 13, 0)
    assert release("2.14.0.dev20261101") == (2, 14, 0)
    assert release("7.0.51831-a3e329ad8") == (7, 0, 51831)
    assert release("rocm") == ()


@pytest.mark.parametrize("torch_version, cuda, hip, system, supported", [
    (None, None, None, "Linux", None),
    ("2.0.1", "11.8", None, "Linux", False),
    ("2.1.0", "12.1", None, "Linux", True),
    ("2.13.0", "12.8", None, "Linux", True),
    ("2.13.0", "12.8", None, "Windows", False),
    ("2.13.0+cpu", None, None, "Linux", False),
    ("2.11.0", None, "7.0.51831", "Linux", False),
    ("2.13.0", None, "6.4.43482", "Linux", False),
    ("2.13.0", None, "7.0.51831", "Linux", True),
])
def test_expandable_segments_support(torch_version, cuda, hip, system, supported):
    assert expandable_segments_support(torch_version=torch_version, cuda=cuda, hip=hip, system=system)[0] is supported


def test_optimizer_and_kv_cache_features():
    assert optimizer_feature({"bitsandbytes": None}, True)["available"] is False
    assert optimizer_feature({"bitsandbytes": "0.50.2"}, False)["available"] is False
    on = optimizer_feature({"bitsandbytes": "0.50.2"}, True)
    assert on["available"] and "`--optimizer adamw8bit`" in on["detail"]
    assert kv_cache_feature({})["backends"] == []
    both = kv_cache_feature({"optimum-quanto": "0.2.7", "hqq": "0.2.8"})
    assert both["available"] and both["backends"] == ["hqq", "optimum-quanto"]
    assert both["detail"] == ("`--kv-dtype int4` (optimum-quanto 0.2.7), `--kv-dtype int8` (hqq 0.2.8): 4 or 8 bits "
                              "per cached value (plus scales) instead of bf16's 16")


def test_allocator_settings_facts():
    unset = allocator_settings_facts("2.13.0", True, {})
    assert unset["settings"] is None and unset["valid"] and unset["read"] is None
    facts = allocator_settings_facts("2.13.0", False, {"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert facts["read"] == "PYTORCH_ALLOC_CONF" and facts["valid"]
    assert facts["notes"] == ["expandable_segments:True is set, but this torch ignores it (see expandable segments)"]
    old = allocator_settings_facts("2.9.1+cu128", True, {"PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert "pytorch#183387" in old["notes"][0]
    both = allocator_settings_facts("2.9.1", True, {"PYTORCH_ALLOC_CONF": "expandable_segments:True",
                                                    "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert both["notes"] == []
    unknown = allocator_settings_facts("2.13.0", True, {"PYTORCH_CUDA_ALLOC_CONF": "expandible_segments:True"})
    assert not unknown["valid"] and "did you mean expandable_segments?" in unknown["problem"]


# Without torch ----------------------------------------------------------------------------------
RUN_WITHOUT_TORCH = """
import json, sys
sys.modules["torch"] = None
from llamem.cli import main
code = main(sys.argv[1:])
print("torch module:", sys.modules.get("torch"))
sys.exit(code)
"""


def run_without_torch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", RUN_WITHOUT_TORCH, "doctor", *args], capture_output=True, text=True,
                          timeout=120)


def test_without_torch_json():
    out = run_without_torch("--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout.rsplit("torch module:", 1)[0])
    assert data["torch"]["importable"] is False and data["torch"]["version"] is None
    assert data["features"]["expandable_segments"] == {"available": None, "detail": "torch is not importable here"}
    assert data["features"]["flash_sdpa"]["detail"] == "torch is not importable here"
    assert any(note.startswith("torch cannot be imported") for note in data["notes"])
    assert data["versions"]["transformers"] == installed("transformers")  # still read from metadata


def test_without_torch_text():
    out = run_without_torch()
    assert out.returncode == 0, out.stderr
    assert "torch: missing (import of torch halted" in out.stdout
    assert "torch module: None" in out.stdout  # nothing imported it behind the guard
