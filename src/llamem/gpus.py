"""GPU catalog: memory, formats, compute and bandwidth, each entry citing its datasheet.

`memory_bytes` is the memory CUDA reports as the device total where that is known
(`torch.cuda.get_device_properties().total_memory`, nvidia-smi's "Total"), else the
marketed capacity in GiB (GDDR boards carry power-of-two chips). `usable_bytes` subtracts
the non-torch overhead (`llamem.overhead`). FLOP/s are dense (no sparsity) bf16 tensor-core
figures with fp32 accumulation; bandwidths in bytes per second.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from llamem.errors import LlamemError
from llamem.overhead import non_torch_bytes

GiB = 2**30
MiB = 2**20
TB = 10**12
GB = 10**9


@dataclass(frozen=True, kw_only=True)
class GPU:
    name: str
    vendor_name: str
    memory_bytes: int
    """What CUDA/ROCm reports as the device's total memory."""
    memory_sold_gb: float
    """The capacity as marketed (GB as the vendor writes it)."""
    bf16: bool
    fp8: bool
    bf16_flops: float
    """Peak dense bf16 (fp16 where bf16 is missing) tensor FLOP/s."""
    memory_bandwidth: float
    """HBM/GDDR bytes per second."""
    interconnect_bandwidth: float
    """GPU-to-GPU bytes per second per GPU within a node (NVLink / Infinity Fabric, else PCIe)."""
    pcie_bandwidth: float
    """Host link bytes per second (offload traffic)."""
    gpus_per_node: int = 8
    source: str = ""

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - non_torch_bytes(1)


PCIE3, PCIE4, PCIE5 = 16 * GB, 32 * GB, 64 * GB

CATALOG: dict[str, GPU] = {g.name: g for g in [
    GPU(name="rtx-3090", vendor_name="NVIDIA GeForce RTX 3090", memory_bytes=24 * GiB, memory_sold_gb=24, bf16=True,
        fp8=False, bf16_flops=71e12, memory_bandwidth=936 * GB, interconnect_bandwidth=PCIE4, pcie_bandwidth=PCIE4,
        gpus_per_node=4, source="NVIDIA Ampere GA102 whitepaper, Table 9 (RTX 3090)"),
    GPU(name="rtx-4090", vendor_name="NVIDIA GeForce RTX 4090", memory_bytes=24564 * MiB, memory_sold_gb=24, bf16=True,
        fp8=True, bf16_flops=165.2e12, memory_bandwidth=1008 * GB, interconnect_bandwidth=PCIE4, pcie_bandwidth=PCIE4,
        gpus_per_node=4, source="NVIDIA Ada Lovelace architecture whitepaper, Appendix A (RTX 4090)"),
    GPU(name="rtx-5090", vendor_name="NVIDIA GeForce RTX 5090", memory_bytes=32 * GiB, memory_sold_gb=32, bf16=True,
        fp8=True, bf16_flops=209.5e12, memory_bandwidth=1792 * GB, interconnect_bandwidth=PCIE5, pcie_bandwidth=PCIE5,
        gpus_per_node=4, source="NVIDIA RTX Blackwell GPU architecture whitepaper (RTX 5090)"),
    GPU(name="a6000", vendor_name="NVIDIA RTX A6000", memory_bytes=48 * GiB, memory_sold_gb=48, bf16=True, fp8=False,
        bf16_flops=154.8e12, memory_bandwidth=768 * GB, interconnect_bandwidth=112.5 * GB, pcie_bandwidth=PCIE4,
        source="NVIDIA RTX A6000 datasheet"),
    GPU(name="rtx-6000-ada", vendor_name="NVIDIA RTX 6000 Ada Generation", memory_bytes=48 * GiB, memory_sold_gb=48,
        bf16=True, fp8=True, bf16_flops=364.2e12, memory_bandwidth=960 * GB, interconnect_bandwidth=PCIE4,
        pcie_bandwidth=PCIE4, source="NVIDIA RTX 6000 Ada Generation datasheet"),
    GPU(name="l4", vendor_name="NVIDIA L4", memory_bytes=24 * GiB, memory_sold_gb=24, bf16=True, fp8=True,
        bf16_flops=121e12, memory_bandwidth=300 * GB, interconnect_bandwidth=PCIE4, pcie_bandwidth=PCIE4,
        source="NVIDIA L4 Tensor Core GPU datasheet"),
    GPU(name="l40s", vendor_name="NVIDIA L40S", memory_bytes=48 * GiB, memory_sold_gb=48, bf16=True, fp8=True,
        bf16_flops=362.05e12, memory_bandwidth=864 * GB, interconnect_bandwidth=PCIE4, pcie_bandwidth=PCIE4,
        source="NVIDIA L40S datasheet"),
    GPU(name="t4", vendor_name="NVIDIA Tesla T4", memory_bytes=16 * GiB, memory_sold_gb=16, bf16=False, fp8=False,
        bf16_flops=65e12, memory_bandwidth=320 * GB, interconnect_bandwidth=PCIE3, pcie_bandwidth=PCIE3,
        source="NVIDIA T4 Tensor Core GPU datasheet (fp16 figure: Turing has no bf16)"),
    GPU(name="a10g", vendor_name="NVIDIA A10G", memory_bytes=24 * GiB, memory_sold_gb=24, bf16=True, fp8=False,
        bf16_flops=70e12, memory_bandwidth=600 * GB, interconnect_bandwidth=PCIE4, pcie_bandwidth=PCIE4,
        source="AWS EC2 G5 instance documentation (NVIDIA publishes no A10G datasheet; 70 TFLOP/s is the figure "
               "AWS quotes, below the A10's 125)"),
    GPU(name="a100-40gb", vendor_name="NVIDIA A100-SXM4-40GB", memory_bytes=40 * GiB, memory_sold_gb=40, bf16=True,
        fp8=False, bf16_flops=312e12, memory_bandwidth=1555 * GB, interconnect_bandwidth=600 * GB,
        pcie_bandwidth=PCIE4, source="NVIDIA A100 Tensor Core GPU datasheet"),
    GPU(name="a100-80gb", vendor_name="NVIDIA A100-SXM4-80GB", memory_bytes=80 * GiB, memory_sold_gb=80, bf16=True,
        fp8=False, bf16_flops=312e12, memory_bandwidth=2039 * GB, interconnect_bandwidth=600 * GB,
        pcie_bandwidth=PCIE4, source="NVIDIA A100 Tensor Core GPU datasheet"),
    GPU(name="h100-80gb", vendor_name="NVIDIA H100 80GB HBM3 (SXM)", memory_bytes=81559 * MiB, memory_sold_gb=80,
        bf16=True, fp8=True, bf16_flops=989e12, memory_bandwidth=3350 * GB, interconnect_bandwidth=900 * GB,
        pcie_bandwidth=PCIE5, source="NVIDIA H100 Tensor Core GPU datasheet (SXM5)"),
    GPU(name="h200", vendor_name="NVIDIA H200 (SXM)", memory_bytes=143771 * MiB, memory_sold_gb=141, bf16=True,
        fp8=True, bf16_flops=989e12, memory_bandwidth=4800 * GB, interconnect_bandwidth=900 * GB,
        pcie_bandwidth=PCIE5, source="NVIDIA H200 Tensor Core GPU datasheet (SXM)"),
    GPU(name="b200", vendor_name="NVIDIA B200", memory_bytes=180 * GB, memory_sold_gb=180, bf16=True, fp8=True,
        bf16_flops=2250e12, memory_bandwidth=8000 * GB, interconnect_bandwidth=1800 * GB, pcie_bandwidth=PCIE5,
        source="NVIDIA DGX B200 datasheet (1,440 GB over 8 GPUs; dense bf16 2.25 PFLOP/s per GPU)"),
    GPU(name="mi300x", vendor_name="AMD Instinct MI300X", memory_bytes=192 * GiB, memory_sold_gb=192, bf16=True,
        fp8=True, bf16_flops=1307.4e12, memory_bandwidth=5300 * GB, interconnect_bandwidth=896 * GB / 7,
        pcie_bandwidth=PCIE5, source="AMD Instinct MI300X datasheet (896 GB/s Infinity Fabric over 7 peers)"),
]}

ALIASES = {"4090": "rtx-4090", "3090": "rtx-3090", "5090": "rtx-5090", "a100": "a100-80gb", "h100": "h100-80gb",
           "a100-80g": "a100-80gb", "a100-40g": "a100-40gb", "rtx-a6000": "a6000", "l40": "l40s",
           "h100-sxm": "h100-80gb", "6000-ada": "rtx-6000-ada"}


class UnknownGPU(LlamemError):
    pass


def get_gpu(name: str) -> GPU:
    key = name.lower().strip()
    key = ALIASES.get(key, key)
    if key in CATALOG:
        return CATALOG[key]
    near = difflib.get_close_matches(key, list(CATALOG) + list(ALIASES), n=4, cutoff=0.5)
    hint = f" Did you mean: {', '.join(ALIASES.get(n, n) for n in near)}?" if near else ""
    raise UnknownGPU(f"unknown GPU {name!r}.{hint} Run `llamem gpus` for the list, or give a memory budget with "
                     "--budget 22GiB.")


def budget_gpu(budget_bytes: int) -> GPU:
    """Any card with `budget_bytes` of free device memory (the CUDA context must fit in it too);
    speeds are an H100's, since only relative step times are compared."""
    ref = CATALOG["h100-80gb"]
    return GPU(name=f"budget-{budget_bytes / GiB:.1f}GiB", vendor_name="any card", memory_bytes=budget_bytes,
               memory_sold_gb=budget_bytes / GB, bf16=True, fp8=True, bf16_flops=ref.bf16_flops,
               memory_bandwidth=ref.memory_bandwidth, interconnect_bandwidth=ref.interconnect_bandwidth,
               pcie_bandwidth=ref.pcie_bandwidth, source="--budget")
