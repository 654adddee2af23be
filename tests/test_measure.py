"""The measure engine's loops run on real tensors (CPU here, CUDA on a GPU machine)."""

import types

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from llamem import build_workload, load_model  # noqa: E402
from llamem.measure import PhaseMeter, measure  # noqa: E402
from llamem.trace import run as runner  # noqa: E402
from llamem.trace.build import build_meta_model  # noqa: E402
from llamem.errors import MissingDependency  # noqa: E402


class FakeCuda:
    """Stands for torch.cuda: reports a peak that grows by 1 MiB per read."""

    def __init__(self):
        self.reads = 0

    def synchronize(self):
        pass

    def max_memory_allocated(self):
        self.reads += 1
        return self.reads * 2**20

    def max_memory_reserved(self):
        return self.reads * 2**21

    def reset_peak_memory_stats(self):
        pass


@pytest.mark.parametrize("options", [dict(task="train", batch=1, seq=32), dict(task="infer", seq=16, new_tokens=3)])
def test_loops_run_on_real_tensors_and_meter_records_each_phase(options):
    spec, workload = load_model("debug", overrides={"num_hidden_layers": 2}), build_workload(**options)
    meter = PhaseMeter(types.SimpleNamespace(cuda=FakeCuda()))
    model = build_meta_model(spec, workload).to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    if workload.is_training:
        runner.train_steps(model, None, runner.make_optimizer(model, workload, []), workload, spec, meter)
    else:
        runner.generate_steps(model, workload, spec, meter)
    meter.close_phase()
    # The fake's peak grows by 1 MiB per read and the meter reads once per phase change, in the order
    # the loops enter the phases: each phase holds the reading taken when it closed.
    order = ["load", "warmup", "forward", "backward", "optimizer"] if workload.is_training else [
        "load", "prefill", "decode"]
    assert {p: v["peak_allocated_bytes"] for p, v in meter.peaks.items()} == {
        phase: (i + 1) * 2**20 for i, phase in enumerate(order)}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_measure_without_cuda_says_so():
    with pytest.raises(MissingDependency, match="CUDA"):
        measure(load_model("debug"), build_workload())
