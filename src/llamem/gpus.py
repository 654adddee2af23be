"""GPU catalog: device memory as CUDA reports it, 16-bit formats, compute and bandwidth, each entry cited.

`memory_bytes` is the device total that PyTorch sees: `torch.cuda.get_device_properties(i).total_memory`,
which is CUDA's `totalGlobalMem` (deviceQuery's "Total amount of global memory", the total of
`cudaMemGetInfo`; HIP's `totalGlobalMem` on AMD). Every entry cites a page where that number was
read off a real card; the few with no reading found keep the marketed capacity and say so in `source`.

Why not the datasheet: a "16 GB" T4 gives PyTorch about 14.7 GiB. ECC, on by default on data-center
cards, takes its share, and drivers from the R5xx series on also hold back a few hundred MiB for
themselves. nvidia-smi's "Total" counts that held-back memory while CUDA does not (an H100 SXM under
R565: nvidia-smi -q shows Total 81559 MiB, Reserved 454 MiB; deviceQuery reports 81106 MiB). So readings
from CUDA, PyTorch or deviceQuery are preferred, under recent drivers with ECC in its default state, and
nvidia-smi's figure is used only where it is the only reading (it equals CUDA's total on R4xx drivers).
The same card reads differently across drivers, by up to about 0.6 GiB; each comment gives what was seen.

`usable_bytes` subtracts the non-torch overhead (`llamem.overhead`). FLOP/s are dense (no sparsity)
16-bit tensor-core figures with fp32 accumulation; bandwidths are in bytes per second.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Literal

from llamem.errors import LlamemError
from llamem.overhead import non_torch_bytes
from llamem.units import GB, GiB, MiB

HalfPrecision = Literal["bf16", "fp16"]


@dataclass(frozen=True, kw_only=True)
class GPU:
    name: str
    """Short catalog name, the one `--gpu` takes: 'h100-80gb'."""
    vendor_name: str
    """The device name the driver reports (`torch.cuda.get_device_name()`): 'NVIDIA H100 80GB HBM3'."""
    memory_bytes: int
    """Device total as CUDA (ROCm on AMD) reports it: `torch.cuda.get_device_properties().total_memory`."""
    memory_sold_gb: float
    """The capacity as marketed (GB as the vendor writes it)."""
    bf16: bool
    """Whether the tensor cores run bf16. Turing (T4) and Volta (V100) run fp16 only."""
    fp8: bool
    bf16_flops: float
    """Peak dense 16-bit tensor FLOP/s: bf16 where the card has it, else fp16 (T4, V100), so always the
    rate of `half_precision`."""
    memory_bandwidth: float
    """HBM/GDDR bytes per second."""
    interconnect_bandwidth: float
    """GPU-to-GPU bytes per second per GPU within a node (NVLink / Infinity Fabric, else PCIe)."""
    pcie_bandwidth: float
    """Host link bytes per second (offload traffic)."""
    gpus_per_node: int = 8
    source: str = ""
    """Where `memory_bytes` was read (URL and what it shows), or 'marketed figure, not a reading'."""

    @property
    def usable_bytes(self) -> int:
        return self.memory_bytes - non_torch_bytes(1)

    @property
    def half_precision(self) -> HalfPrecision:
        """The 16-bit dtype this card runs at tensor-core speed: 'bf16', or 'fp16' where bf16 is missing."""
        return "bf16" if self.bf16 else "fp16"


PCIE3, PCIE4, PCIE5 = 16 * GB, 32 * GB, 64 * GB
"""A x16 host link's bytes per second in each direction, rounded: 8, 16 and 32 GT/s per lane with 128b/130b
encoding give 15.75, 31.5 and 63 GB/s (PCI-SIG's PCIe 3.0, 4.0 and 5.0 base specifications; NVIDIA's
datasheets list 32 GB/s for the A100's PCIe 4.0 and 64 GB/s for the H100's PCIe 5.0). `pcie_bandwidth`
is what offloading (`cost._offload`, `cost.activation_offload_seconds`) moves pinned host memory at."""

_THAMADA = "https://github.com/thamada/nvidia-smi/blob/"  # deviceQuery / nvidia-smi captures from real machines

CATALOG: dict[str, GPU] = {g.name: g for g in [
    # deviceQuery, driver R560 (CUDA 12.6), ECC not available. Older drivers gave PyTorch 24268 MiB
    # (transformers' DeepSpeed docs print total_memory=24268MB).
    GPU(name="rtx-3090", vendor_name="NVIDIA GeForce RTX 3090", memory_bytes=24154 * MiB, memory_sold_gb=24,
        bf16=True, fp8=False, bf16_flops=71e12, memory_bandwidth=936 * GB, interconnect_bandwidth=PCIE4,
        pcie_bandwidth=PCIE4, gpus_per_node=4,
        source=_THAMADA + "b09ef139265ffc7e3c78006346981de8e4d70499/gls/RTX3090_deviceQuery.py "
               "(deviceQuery: 24154 MBytes, R560); flops: NVIDIA Ampere GA102 whitepaper, Table 9"),
    # deviceQuery, driver R550 (CUDA 12.4). nvidia-smi shows 24564 MiB, and PyTorch under older drivers
    # 24563 MiB; R550 and later hold back about 350 MiB more.
    GPU(name="rtx-4090", vendor_name="NVIDIA GeForce RTX 4090", memory_bytes=24210 * MiB, memory_sold_gb=24,
        bf16=True, fp8=True, bf16_flops=165.2e12, memory_bandwidth=1008 * GB, interconnect_bandwidth=PCIE4,
        pcie_bandwidth=PCIE4, gpus_per_node=4,
        source=_THAMADA + "b09ef139265ffc7e3c78006346981de8e4d70499/gls/RTX4090_deviceQuery.py "
               "(deviceQuery: 24210 MBytes, R550); flops: NVIDIA Ada Lovelace whitepaper, Appendix A"),
    # deviceQuery, driver R570 (CUDA 12.8); another R570 machine read 32117 MiB.
    GPU(name="rtx-5090", vendor_name="NVIDIA GeForce RTX 5090", memory_bytes=32120 * MiB, memory_sold_gb=32,
        bf16=True, fp8=True, bf16_flops=209.5e12, memory_bandwidth=1792 * GB, interconnect_bandwidth=PCIE5,
        pcie_bandwidth=PCIE5, gpus_per_node=4,
        source="https://github.com/NVIDIA/nccl/issues/1637 (deviceQuery: 32120 MBytes, R570); "
               "flops: NVIDIA RTX Blackwell GPU architecture whitepaper"),
    # PyTorch's total_memory, as printed under a benchmark table.
    GPU(name="a6000", vendor_name="NVIDIA RTX A6000", memory_bytes=48676 * MiB, memory_sold_gb=48, bf16=True,
        fp8=False, bf16_flops=154.8e12, memory_bandwidth=768 * GB, interconnect_bandwidth=112.5 * GB,
        pcie_bandwidth=PCIE4,
        source="https://github.com/pytorch/ao/blob/2a18357813a661f9db05459e15af7a4ea0488997/torchao/prototype/hqq/"
               "README.md (torch: total_memory=48676MB); flops: NVIDIA RTX A6000 datasheet"),
    # deviceQuery, driver R550, ECC off (the workstation default).
    GPU(name="rtx-6000-ada", vendor_name="NVIDIA RTX 6000 Ada Generation", memory_bytes=48640 * MiB,
        memory_sold_gb=48, bf16=True, fp8=True, bf16_flops=364.2e12, memory_bandwidth=960 * GB,
        interconnect_bandwidth=PCIE4, pcie_bandwidth=PCIE4,
        source=_THAMADA + "b09ef139265ffc7e3c78006346981de8e4d70499/gls/RTX6000Ada_x8_deviceQuery.py "
               "(deviceQuery: 48640 MBytes, R550, ECC off); flops: NVIDIA RTX 6000 Ada datasheet"),
    # deviceQuery, driver R550, ECC on. nvidia-smi shows 23034 MiB.
    GPU(name="l4", vendor_name="NVIDIA L4", memory_bytes=22478 * MiB, memory_sold_gb=24, bf16=True, fp8=True,
        bf16_flops=121e12, memory_bandwidth=300 * GB, interconnect_bandwidth=PCIE4, pcie_bandwidth=PCIE4,
        source=_THAMADA + "b09ef139265ffc7e3c78006346981de8e4d70499/gls/L4_deviceQuery.py "
               "(deviceQuery: 22478 MBytes, R550, ECC on); flops: NVIDIA L4 datasheet"),
    # deviceQuery, driver R550, ECC on. nvidia-smi shows 46068 MiB.
    GPU(name="l40s", vendor_name="NVIDIA L40S", memory_bytes=45589 * MiB, memory_sold_gb=48, bf16=True,
        fp8=True, bf16_flops=362.05e12, memory_bandwidth=864 * GB, interconnect_bandwidth=PCIE4,
        pcie_bandwidth=PCIE4,
        source=_THAMADA + "c768aedc1e0bf705fc91b08e8d9403bf53760365/nvsim/L40S_deviceQuery.py "
               "(deviceQuery: 45589 MBytes, R550, ECC on); flops: NVIDIA L40S datasheet"),
    # No reading found. The L40S carries the same 48 GB GDDR6 and reads 45589 MiB; expect about that.
    GPU(name="l40", vendor_name="NVIDIA L40", memory_bytes=48 * GiB, memory_sold_gb=48, bf16=True, fp8=True,
        bf16_flops=181.05e12, memory_bandwidth=864 * GB, interconnect_bandwidth=PCIE4, pcie_bandwidth=PCIE4,
        source="marketed figure, not a reading: https://www.nvidia.com/en-us/data-center/l40/ (48 GB "
               "GDDR6; 362.1 TFLOP/s bf16 with sparsity)"),
    # deviceQuery on Colab, driver R550, ECC on. Under R535 and earlier PyTorch printed
    # total_memory=15102MB (14.75 GiB); nvidia-smi shows 15360 MiB; ECC off would give about 16 GiB.
    GPU(name="t4", vendor_name="Tesla T4", memory_bytes=15095 * MiB, memory_sold_gb=16, bf16=False, fp8=False,
        bf16_flops=65e12, memory_bandwidth=320 * GB, interconnect_bandwidth=PCIE3, pcie_bandwidth=PCIE3,
        source="https://github.com/sylvia-ymlin/cuda-kernels-from-scratch/blob/"
               "c28c34a06f9d9ecfc12491e39920f5f2218847ad/README.md (Colab deviceQuery: 15095 MBytes, R550); "
               "flops: NVIDIA T4 datasheet, fp16 (Turing has no bf16)"),
    # nvidia-smi under R470, where it equals CUDA's total. R535 and later hold back about 215 MiB more
    # (the A10, same 24 GB GA102 board, reads 22515 MiB under R535).
    GPU(name="a10g", vendor_name="NVIDIA A10G", memory_bytes=22731 * MiB, memory_sold_gb=24, bf16=True,
        fp8=False, bf16_flops=70e12, memory_bandwidth=600 * GB, interconnect_bandwidth=PCIE4,
        pcie_bandwidth=PCIE4,
        source="https://github.com/bottlerocket-os/bottlerocket-core-kit/pull/122 (nvidia-smi: 22731MiB, R470); "
               "flops: AWS EC2 G5 documentation (NVIDIA publishes no A10G datasheet; 70 TFLOP/s is the "
               "figure AWS quotes, below the A10's 125)"),
    # deviceQuery, driver R535: 23609475072 bytes (22515.75 MiB, rounded down). nvidia-smi shows 23028 MiB.
    GPU(name="a10", vendor_name="NVIDIA A10", memory_bytes=22515 * MiB, memory_sold_gb=24, bf16=True,
        fp8=False, bf16_flops=125e12, memory_bandwidth=600 * GB, interconnect_bandwidth=PCIE4,
        pcie_bandwidth=PCIE4,
        source="https://github.com/aalanwyr/face2cuda/blob/9ad81566c5da19bc4950596a37d3820a595b280a/step2cuda/"
               "README.md (23609475072 bytes, R535); flops: NVIDIA A10 datasheet (250 with sparsity)"),
    # deviceQuery, driver R535: 42298834944 bytes (40339.19 MiB, rounded down). Older drivers gave
    # 40536 MiB (Paddle's get_device_properties docs); nvidia-smi under R5xx shows 40960 MiB.
    GPU(name="a100-40gb", vendor_name="NVIDIA A100-SXM4-40GB", memory_bytes=40339 * MiB, memory_sold_gb=40,
        bf16=True, fp8=False, bf16_flops=312e12, memory_bandwidth=1555 * GB, interconnect_bandwidth=600 * GB,
        pcie_bandwidth=PCIE4,
        source="https://github.com/bottlerocket-os/bottlerocket/pull/3873 (deviceQuery: 40339 MBytes, R535); "
               "flops: NVIDIA A100 datasheet"),
    # deviceQuery, driver R555. PyTorch under R545 gave 81049 MiB (the PCIe card below), under R4xx 81251
    # MiB; nvidia-smi under R5xx shows 81920 MiB.
    GPU(name="a100-80gb", vendor_name="NVIDIA A100-SXM4-80GB", memory_bytes=81158 * MiB, memory_sold_gb=80,
        bf16=True, fp8=False, bf16_flops=312e12, memory_bandwidth=2039 * GB, interconnect_bandwidth=600 * GB,
        pcie_bandwidth=PCIE4,
        source=_THAMADA + "b09ef139265ffc7e3c78006346981de8e4d70499/gls/A100SXMx4_deviceQuery.py "
               "(deviceQuery: 81158 MBytes, R555, ECC on); flops: NVIDIA A100 datasheet"),
    # mixbench's cudaGetDeviceProperties, driver R545, ECC on. Slower HBM2e than the SXM4 part; an NVLink
    # bridge joins pairs only, so PCIe is the link assumed.
    GPU(name="a100-80gb-pcie", vendor_name="NVIDIA A100 80GB PCIe", memory_bytes=81049 * MiB, memory_sold_gb=80,
        bf16=True, fp8=False, bf16_flops=312e12, memory_bandwidth=1935 * GB, interconnect_bandwidth=PCIE4,
        pcie_bandwidth=PCIE4,
        source="https://github.com/ekondis/mixbench/issues/47 (Total global mem: 81049 MB, R545, ECC on); "
               "flops: NVIDIA A100 datasheet (PCIe)"),
    # deviceQuery, driver R565, ECC on; the same machine's nvidia-smi -q: Total 81559 MiB, Reserved 454 MiB.
    # PyTorch under R525-R570 printed 81082-81090 MiB.
    GPU(name="h100-80gb", vendor_name="NVIDIA H100 80GB HBM3", memory_bytes=81106 * MiB, memory_sold_gb=80,
        bf16=True, fp8=True, bf16_flops=989e12, memory_bandwidth=3350 * GB, interconnect_bandwidth=900 * GB,
        pcie_bandwidth=PCIE5,
        source=_THAMADA + "03fbe6e68c0bb4c28b72d5da786a9712a33cf408/nvsim/H100SXMx8_deviceQuery.py "
               "(deviceQuery: 81106 MBytes, R565, ECC on); flops: NVIDIA H100 datasheet (SXM5)"),
    # No citable reading found; PyTorch has been seen printing total_memory=81008MB for this card, which
    # should replace the marketed figure once a page shows it. NVLink bridges join pairs only: PCIe assumed.
    GPU(name="h100-pcie", vendor_name="NVIDIA H100 PCIe", memory_bytes=80 * GiB, memory_sold_gb=80, bf16=True,
        fp8=True, bf16_flops=756e12, memory_bandwidth=2000 * GB, interconnect_bandwidth=PCIE5,
        pcie_bandwidth=PCIE5,
        source="marketed figure, not a reading: https://www.nvidia.com/en-us/data-center/h100/ (H100 PCIe, "
               "80 GB HBM2e; 1513 TFLOP/s bf16 with sparsity)"),
    # deviceQuery, driver R550, ECC on. NVLink bridges join pairs only, so PCIe is the link assumed.
    GPU(name="h100-nvl", vendor_name="NVIDIA H100 NVL", memory_bytes=95235 * MiB, memory_sold_gb=94, bf16=True,
        fp8=True, bf16_flops=835.5e12, memory_bandwidth=3900 * GB, interconnect_bandwidth=PCIE5,
        pcie_bandwidth=PCIE5,
        source=_THAMADA + "b09ef139265ffc7e3c78006346981de8e4d70499/gls/H100NVLx2_deviceQuery.py "
               "(deviceQuery: 95235 MBytes, R550, ECC on); flops: NVIDIA H100 datasheet (H100 NVL, 1671 "
               "with sparsity)"),
    # nvidia-smi's total, the only citable reading: it includes driver-reserved memory, so PyTorch sees
    # about 615 MiB less (total_memory=143156MB under recent drivers), which should replace this once a
    # page shows it.
    GPU(name="h200", vendor_name="NVIDIA H200", memory_bytes=143771 * MiB, memory_sold_gb=141, bf16=True,
        fp8=True, bf16_flops=989e12, memory_bandwidth=4800 * GB, interconnect_bandwidth=900 * GB,
        pcie_bandwidth=PCIE5,
        source="https://thundergolfer.com/blog/nvidia-gpu-memory-capacity (nvidia-smi: 143,771 MiB); "
               "flops: NVIDIA H200 datasheet (SXM)"),
    # cudaGetDeviceProperties printed to two decimals, 178.35 GiB (182630.4 MiB, rounded down), ECC on.
    # nvidia-smi under R580 shows 183359 MiB.
    GPU(name="b200", vendor_name="NVIDIA B200", memory_bytes=182630 * MiB, memory_sold_gb=180, bf16=True,
        fp8=True, bf16_flops=2250e12, memory_bandwidth=8000 * GB, interconnect_bandwidth=1800 * GB,
        pcie_bandwidth=PCIE5,
        source="https://github.com/pytorch/ao/pull/4002 (Total Global Memory: 178.35 GB, i.e. GiB, ECC on); "
               "flops: NVIDIA DGX B200 datasheet (dense bf16 2.25 PFLOP/s per GPU)"),
    # hipDeviceProp totalGlobalMem (what PyTorch on ROCm reports), 4 x MI300X.
    GPU(name="mi300x", vendor_name="AMD Instinct MI300X", memory_bytes=196592 * MiB, memory_sold_gb=192,
        bf16=True, fp8=True, bf16_flops=1307.4e12, memory_bandwidth=5300 * GB,
        interconnect_bandwidth=896 * GB / 7, pcie_bandwidth=PCIE5,
        source=_THAMADA + "a296cf1dff865bac1d5fd7ba38789570cab4a8da/nvsim/MI300X_x4_deviceQuery.py "
               "(hipDeviceProp: 196592 MB); flops: AMD Instinct MI300X datasheet (896 GB/s Infinity "
               "Fabric over 7 peers)"),
    # PyTorch's total_memory (fastai show_install) and nvidia-smi agree, driver R390, ECC on.
    # Newer drivers were not seen; expect up to a few hundred MiB less.
    GPU(name="v100-16gb", vendor_name="Tesla V100-SXM2-16GB", memory_bytes=16160 * MiB, memory_sold_gb=16,
        bf16=False, fp8=False, bf16_flops=125e12, memory_bandwidth=900 * GB, interconnect_bandwidth=300 * GB,
        pcie_bandwidth=PCIE3,
        source="https://pastebin.com/mTM0hHsr (torch: Total Memory 16160MB; nvidia-smi 16160MiB; R390); "
               "flops: NVIDIA V100 datasheet, SXM2 fp16 tensor (Volta has no bf16)"),
    # nvidia-smi under R440, where it equals CUDA's total (deviceQuery elsewhere: 34089730048 bytes).
    GPU(name="v100-32gb", vendor_name="Tesla V100-SXM2-32GB", memory_bytes=32510 * MiB, memory_sold_gb=32,
        bf16=False, fp8=False, bf16_flops=125e12, memory_bandwidth=900 * GB, interconnect_bandwidth=300 * GB,
        pcie_bandwidth=PCIE3,
        source="https://gist.github.com/lovesegfault/c0dc1ce096bdccf9efde304d024a4d2e (nvidia-smi: 32510MiB, "
               "R440); flops: NVIDIA V100 datasheet, SXM2 fp16 tensor (Volta has no bf16)"),
]}

# Short and common spellings. A bare family name means its largest variant (a100 -> a100-80gb).
ALIASES = {"4090": "rtx-4090", "3090": "rtx-3090", "5090": "rtx-5090", "a100": "a100-80gb", "h100": "h100-80gb",
           "v100": "v100-32gb", "a100-80g": "a100-80gb", "a100-40g": "a100-40gb", "a100-sxm": "a100-80gb",
           "a100-pcie": "a100-80gb-pcie", "a100-pcie-80gb": "a100-80gb-pcie", "rtx-a6000": "a6000",
           "6000-ada": "rtx-6000-ada", "h100-sxm": "h100-80gb", "h100-sxm5": "h100-80gb",
           "h100-80gb-sxm": "h100-80gb", "h100-80gb-pcie": "h100-pcie", "h200-sxm": "h200",
           "h200-141gb": "h200", "mi300": "mi300x", "v100-sxm2-16gb": "v100-16gb", "v100-sxm2-32gb": "v100-32gb",
           "v100-16g": "v100-16gb", "v100-32g": "v100-32gb"}

_VENDOR_WORDS = ("nvidia", "geforce", "tesla", "amd", "instinct")


class UnknownGPU(LlamemError):
    pass


def normalise(name: str) -> str:
    """'NVIDIA GeForce RTX 4090' -> 'rtx-4090': lowercase, leading vendor words dropped, runs of spaces
    and underscores turned into one dash."""
    words = name.strip().lower().replace("_", " ").split()
    while words and words[0] in _VENDOR_WORDS:
        words = words[1:]
    return "-".join(words)


def _build_index() -> dict[str, str]:
    """Every accepted spelling, normalised, to its card name: names, aliases, the driver's device names,
    and each of these without dashes ('rtx4090')."""
    index: dict[str, str] = {}
    spellings = [(name, name) for name in CATALOG]
    spellings += [(normalise(gpu.vendor_name), name) for name, gpu in CATALOG.items()]
    spellings += list(ALIASES.items())
    for key, name in spellings:
        for form in (key, key.replace("-", "")):
            known = index.setdefault(form, name)
            assert known == name, f"{form!r} names both {known} and {name}"
    return index


_INDEX = _build_index()


def near_matches(name: str, limit: int = 4) -> list[str]:
    """Card names that look like `name`, best first, each once."""
    close = difflib.get_close_matches(normalise(name), list(_INDEX), n=4 * limit, cutoff=0.5)
    return list(dict.fromkeys(_INDEX[key] for key in close))[:limit]


def get_gpu(name: str) -> GPU:
    """A catalog card by short name ('h100'), alias ('a100 80gb', 'rtx4090') or driver device name
    ('NVIDIA A100-SXM4-80GB', 'Tesla T4')."""
    key = normalise(name)
    for form in (key, key.replace("-", "")):
        if form in _INDEX:
            return CATALOG[_INDEX[form]]
    near = near_matches(name)
    hint = f" Did you mean: {', '.join(near)}?" if near else ""
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
