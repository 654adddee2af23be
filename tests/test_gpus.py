"""The GPU catalog: cited device totals as CUDA reports them, the 16-bit dtype per card, name lookup."""

import re

import pytest

from llamem.gpus import CATALOG, UnknownGPU, budget_gpu, get_gpu, near_matches, normalise
from llamem.overhead import non_torch_bytes
from llamem.units import GiB, MiB

URL = re.compile(r"https?://\S+")


@pytest.mark.parametrize("name", list(CATALOG))
def test_every_card_cites_a_url_and_holds_whole_mib(name):
    gpu = CATALOG[name]
    assert URL.search(gpu.source), gpu.source
    assert gpu.memory_bytes % MiB == 0
    assert gpu.memory_bytes > gpu.usable_bytes > 0


@pytest.mark.parametrize("name", list(CATALOG))
def test_readings_sit_below_the_marketed_capacity(name):
    """What CUDA reports is the physical memory less ECC and driver reserve; only the entries that keep
    the marketed figure may reach it, and they say so."""
    gpu = CATALOG[name]
    marketed = gpu.memory_bytes == round(gpu.memory_sold_gb * GiB)
    assert marketed == gpu.source.startswith("marketed figure, not a reading")
    assert gpu.memory_bytes <= gpu.memory_sold_gb * GiB


def test_t4_is_what_pytorch_reports_not_its_16_gb():
    t4 = get_gpu("t4")
    assert t4.memory_bytes == 15095 * MiB
    assert t4.memory_bytes < 15.5 * GiB
    assert get_gpu("h100").memory_bytes == 81106 * MiB


@pytest.mark.parametrize("name", list(CATALOG))
def test_half_precision_follows_bf16_support(name):
    gpu = CATALOG[name]
    assert gpu.half_precision == ("bf16" if gpu.bf16 else "fp16")


def test_cards_without_bf16_run_fp16():
    assert [n for n, g in CATALOG.items() if g.half_precision == "fp16"] == ["t4", "v100-16gb", "v100-32gb"]


@pytest.mark.parametrize(("spelling", "name"), [
    ("NVIDIA A100-SXM4-80GB", "a100-80gb"),
    ("Tesla T4", "t4"),
    ("H100 80GB HBM3", "h100-80gb"),
    ("NVIDIA H100 80GB HBM3", "h100-80gb"),
    ("h100", "h100-80gb"),
    ("H100-SXM", "h100-80gb"),
    ("a100 80gb", "a100-80gb"),
    ("rtx4090", "rtx-4090"),
    ("RTX_4090", "rtx-4090"),
    ("NVIDIA GeForce RTX 4090", "rtx-4090"),
    ("4090", "rtx-4090"),
    ("NVIDIA A100 80GB PCIe", "a100-80gb-pcie"),
    ("Tesla V100-SXM2-16GB", "v100-16gb"),
    ("v100", "v100-32gb"),
    ("AMD Instinct MI300X", "mi300x"),
    ("NVIDIA RTX 6000 Ada Generation", "rtx-6000-ada"),
    ("  L40S ", "l40s"),
    ("l40", "l40"),
])
def test_aliases_and_vendor_names(spelling, name):
    assert get_gpu(spelling).name == name


@pytest.mark.parametrize("name", list(CATALOG))
def test_every_card_answers_to_its_name_and_device_name(name):
    gpu = CATALOG[name]
    assert get_gpu(name) is gpu
    assert get_gpu(gpu.vendor_name) is gpu
    assert get_gpu(name.upper().replace("-", " ")) is gpu


def test_normalise():
    assert normalise("NVIDIA GeForce RTX 4090") == "rtx-4090"
    assert normalise(" Tesla  T4 ") == "t4"
    assert normalise("a100_80gb") == "a100-80gb"


@pytest.mark.parametrize("typo", ["a100-80", "a10x", "a1000", "rtx-4900", "h10"])
def test_near_matches_name_each_card_once(typo):
    with pytest.raises(UnknownGPU) as raised:
        get_gpu(typo)
    suggested = re.search(r"Did you mean: (.*)\?", str(raised.value)).group(1).split(", ")
    assert suggested == near_matches(typo)
    assert len(suggested) == len(set(suggested)) > 0
    assert all(s in CATALOG for s in suggested)


def test_unknown_gpu_names_the_fix():
    with pytest.raises(UnknownGPU, match="rtx-4090"):
        get_gpu("rtx-4900")
    with pytest.raises(UnknownGPU, match=r"llamem gpus.*--budget"):
        get_gpu("zzz")


def test_budget_gpu():
    gpu = budget_gpu(22 * GiB)
    assert gpu.name == "budget-22.0GiB"
    assert gpu.memory_bytes == 22 * GiB
    assert gpu.usable_bytes == 22 * GiB - non_torch_bytes(1)
    assert gpu.half_precision == "bf16"
    assert gpu.bf16_flops == CATALOG["h100-80gb"].bf16_flops
