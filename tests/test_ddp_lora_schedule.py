"""LoRA under DDP: a rank's own allocation schedule (`llamem.analytic.schedule_ranks.ddp_schedule`) against what the
launch bundle's 2 ranks allocate training a tiny Llama's adapters (`bash launch.sh --cpu --random-init --max-steps 2
--memory-trace DIR`, gloo), each rank's event stream replayed through the allocator simulator.

The run is pure bf16 (LoRA's default precision): DDP broadcasts the frozen bf16 base and the fp32 adapters (peft
upcasts them) with RoPE's fp32 buffers in two flat copies, both in flight, and its one gradient bucket holds the
adapters only, in fp32. DDP sizes the same on CUDA and on CPU (its all-reduce works in place in the buckets), so the
gloo schedule is the one `llamem estimate --gpus 2` replays.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from bundle_runner import config_path, start_run  # noqa: E402

from llamem.allocator.replay import load_events, peak_allocated_bytes, smallest_card  # noqa: E402
from llamem.analytic.schedule import schedule  # noqa: E402
from llamem.analytic.schedule_ranks import rank_schedule, rank_schedule_kind  # noqa: E402
from llamem.bundle import layout_plan  # noqa: E402
from llamem.gpus import get_gpu  # noqa: E402
from llamem.model import load_model  # noqa: E402
from llamem.parallel import make_layout  # noqa: E402
from llamem.sizing import estimate_report  # noqa: E402
from llamem.workload import build_workload  # noqa: E402

__all__ = ["config_path"]  # the fixture

FIELDS = {"batch": 2, "seq": 16, "precision": "bf16", "optimizer": "adamw", "ac_every": 0, "loss": "full"}
MiB = 2**20
ADAPTERS_BYTES = 14_336
"""q_proj's and v_proj's A and B at r=8 in 2 layers, fp32: (8 x 64 + 64 x 8 + 8 x 64 + 32 x 8) x 2 x 4 bytes."""
DDP_ALLOCATIONS = [279_552, 14_848, ADAPTERS_BYTES, ADAPTERS_BYTES]
"""The wrap's flat copies (the bf16 base, 139,584 x 2 bytes; the fp32 adapters and RoPE's 2 x 8 fp32 values), its
bucket, and the bucket rebuilt before the second step."""


def _setup(config_path, task: str = "lora", **changes):
    spec = load_model(None, config_path=str(config_path))
    w = build_workload(task, **{**FIELDS, **changes})
    return spec, w, make_layout(spec, w, gpus=2, sharding="ddp")


@pytest.fixture(scope="module")
def traces(config_path, tmp_path_factory) -> Path:
    """The folder of the 2-rank run's rank0.json and rank1.json."""
    spec, w, layout = _setup(config_path)
    plan = layout_plan(spec, w, layout, get_gpu("h100"), model_args=("--config", str(config_path)))
    run = start_run(tmp_path_factory, plan).result()
    assert len(re.findall(r"^rank \d trace ", run.stdout, re.MULTILINE)) == 2, run.stdout
    return run.traces


def test_lora_under_ddp_gets_a_rank_schedule(config_path):
    spec, w, layout = _setup(config_path)
    assert rank_schedule_kind(spec, w, layout) == "ddp"
    assert rank_schedule(spec, w, layout, backend="gloo") == rank_schedule(spec, w, layout, backend="nccl")
    # QLoRA's bitsandbytes base does not run on CPU, so its schedule is not proven: the single-GPU one replays.
    spec, qlora, _layout = _setup(config_path, "qlora", quant="nf4")
    assert rank_schedule_kind(spec, qlora, make_layout(spec, qlora, gpus=2, sharding="ddp")) is None
    assert rank_schedule_kind(spec, w, make_layout(spec, w, gpus=2, sharding="zero3")) is None  # DeepSpeed's


def _ddp_allocations(events: list[dict]) -> list[int]:
    """A rank's allocations by DDP: the flat copies and buckets, made outside forward and backward (the optimizer's
    foreach temporaries there are under 4 KiB here)."""
    return [e["size"] for e in events if e["action"] == "alloc" and e["category"] == "temporaries"
            and e["phase"] not in ("forward", "backward") and e["size"] >= 4096]


def test_ranks_broadcast_and_bucket_as_the_schedule_does(config_path, traces):
    """Every allocation of 4 KiB or more that DDP adds, in order: the same in the schedule and in each rank."""
    spec, w, layout = _setup(config_path)
    ddp = [e.size for e in rank_schedule(spec, w, layout) if e.action == "alloc"]
    added = Counter(ddp) - Counter(e.size for e in schedule(spec, w) if e.action == "alloc")
    assert [size for size in ddp if added[size] and size >= 4096] == DDP_ALLOCATIONS
    for rank in (0, 1):
        events = json.loads((traces / f"rank{rank}.json").read_text())["events"]
        assert _ddp_allocations(events) == DDP_ALLOCATIONS


def test_ranks_peak_and_reserve_what_the_schedule_says(config_path, traces):
    """The same reserved memory; the schedule's peak 512 bytes above the ranks', the single-GPU LoRA schedule's own
    excess at this shape (the bundle's 1-GPU run peaks at 675,328 bytes, its schedule at 675,840). DDP adds its
    bucket to the step's peak, in the schedule as in the run (the 1-GPU run's peak + 14,336 = the ranks')."""
    spec, w, layout = _setup(config_path)
    events = rank_schedule(spec, w, layout, backend="gloo")
    assert peak_allocated_bytes(events) - peak_allocated_bytes(schedule(spec, w)) == ADAPTERS_BYTES
    assert smallest_card(events) == (690_176, 2 * MiB)
    for rank in (0, 1):
        assert smallest_card(load_events(traces / f"rank{rank}.json")) == (689_664, 2 * MiB)


def test_estimate_reserves_the_lora_ranks_own_schedule():
    """`llamem estimate llama-3.1-8b --task lora --batch 4 --seq 2048 --precision bf16-mixed --optimizer adamw
    --gpus 2 --sharding ddp` (CUDA, NCCL): the fragmentation of the rank's own schedule, 15 MiB above the
    single-GPU schedule's (105,200,879,616 bytes before DDP's broadcasts and bucket were replayed)."""
    spec = load_model("llama-3.1-8b")
    w = build_workload("lora", batch=4, seq=2048, precision="bf16-mixed", optimizer="adamw", ac_every=0, loss="full")
    layout = make_layout(spec, w, gpus=2, sharding="ddp")
    report = estimate_report(spec, w, layout)
    assert rank_schedule_kind(spec, w, layout) == "ddp"
    assert (report.device.peak_allocated_bytes, report.device.device_bytes) == (100_597_778_432, 105_216_608_256)
    assert any("DDP's broadcast and gradient buckets" in note for note in report.notes)
