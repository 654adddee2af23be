"""Measure engine: the same workload on a real CUDA device, read from the allocator and NVML.

Runs exactly the code path of the trace engine (same model build, same training and
generation loops) with real random weights, and records per phase the allocator's peak
allocated and reserved bytes, and the device memory NVML sees in use.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llamem.errors import MissingDependency
from llamem.model import ModelSpec
from llamem.workload import Workload


@dataclass
class PhaseMeter:
    """Stands where the trace engine's tracer stands; reads CUDA peaks at each phase change."""

    torch: object
    peaks: dict[str, dict[str, int]] = field(default_factory=dict)
    category: str = ""
    stack: list = field(default_factory=list)
    _phase: str = "load"

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        if value != self._phase:
            self.close_phase()
        self._phase = value

    def close_phase(self) -> None:
        cuda = self.torch.cuda
        cuda.synchronize()
        allocated, reserved = cuda.max_memory_allocated(), cuda.max_memory_reserved()
        current = self.peaks.setdefault(self._phase, {"peak_allocated_bytes": 0, "peak_reserved_bytes": 0})
        current["peak_allocated_bytes"] = max(current["peak_allocated_bytes"], allocated)
        current["peak_reserved_bytes"] = max(current["peak_reserved_bytes"], reserved)
        cuda.reset_peak_memory_stats()

    def label(self, tensor, category: str) -> None:
        pass


def nvml_used_bytes(device_index: int = 0) -> int | None:
    """What nvidia-smi shows in use on the device (all processes), or None without nvidia-ml-py."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    except pynvml.NVMLError:
        return None


def measure(spec: ModelSpec, workload: Workload) -> dict:
    """Run the workload on cuda:0 and return per-phase peaks plus whole-run figures."""
    try:
        import torch
    except ImportError as err:
        raise MissingDependency("measuring needs torch with CUDA: pip install 'llamem[torch]'") from err
    if not torch.cuda.is_available():
        raise MissingDependency("measuring needs a CUDA device; none is visible")
    from llamem.trace import run as runner
    from llamem.trace.build import build_meta_model, materialise

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    baseline_nvml = nvml_used_bytes()
    meter = PhaseMeter(torch)
    model = materialise(build_meta_model(spec, workload), "cuda")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02)
    if workload.is_training:
        optimizer = runner.make_optimizer(model, workload, [])
        runner.train_steps(model, None, optimizer, workload, spec, meter, device="cuda")
    else:
        runner.generate_steps(model, workload, spec, meter, device="cuda")
    meter.close_phase()
    nvml_peak = nvml_used_bytes()
    result = {
        "phases": meter.peaks,
        "peak_allocated_bytes": max(p["peak_allocated_bytes"] for p in meter.peaks.values()),
        "peak_reserved_bytes": max(p["peak_reserved_bytes"] for p in meter.peaks.values()),
        "nvml_used_bytes": nvml_peak,
        "nvml_baseline_bytes": baseline_nvml,
    }
    del model
    torch.cuda.empty_cache()
    return result
