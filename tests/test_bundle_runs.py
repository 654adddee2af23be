"""Launch bundles run: `bash launch.sh --cpu --random-init --max-steps 2` starts the 2 planned
processes of a tiny Llama on CPU (gloo), each counted as its GPU by llamem's tracker, and their
peaks are held to `llamem estimate --gpus 2 --sharding ddp|zero3 --json`.

DDP is what `llamem.parallel` models (torch autocast, DDP's gradient buckets): its ranks peak at
the estimate within about a kilobyte (0.03 %). ZeRO-3 is sized with DeepSpeed's accounting while
the bundle runs it with FSDP2 (`torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py`), which
holds the model states differently: no 16-bit gradient partition (2P/N bytes), gradients only from
the moment their reduce-scatter returns, but for the unit at work its gathered 16-bit weights, their
16-bit gradients and the fp32 copy of those the reduce-scatter takes (2 + 2 + 4 bytes per parameter
of the unit, where the estimate allows 4 per parameter of the largest layer). Here that puts
FSDP2's peak 15 to 18 % below the estimate; what is exact is what each rank keeps: its fp32 shard,
and after a step the shard and two AdamW moments.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bundle_runner import PendingRun, config_path, start_run  # noqa: E402

from llamem.allocator.replay import peak_allocated_bytes  # noqa: E402
from llamem.analytic.schedule_deepspeed import zero_rank_schedule  # noqa: E402
from llamem.bundle import layout_plan  # noqa: E402
from llamem.cli import main  # noqa: E402
from llamem.gpus import get_gpu  # noqa: E402
from llamem.model import load_model  # noqa: E402
from llamem.parallel import make_layout  # noqa: E402
from llamem.trace.tracer import rounded  # noqa: E402
from llamem.workload import build_workload  # noqa: E402

__all__ = ["config_path"]  # the fixture

WORKLOAD = ["--batch", "2", "--seq", "16", "--precision", "bf16-mixed", "--optimizer", "adamw"]
FIELDS = {"batch": 2, "seq": 16, "precision": "bf16-mixed", "optimizer": "adamw"}
SMALL_TENSOR_BYTES = 512
"""The tracker's smallest allocation, and what FSDP2's rank keeps besides its shards: RoPE's two
inverse-frequency buffers (`inv_freq`, `original_inv_freq`) and the device mesh's rank list."""


def _estimate(config_path, sharding: str, capsys, grad_accum: int = 1) -> int:
    capsys.readouterr()  # what earlier imports printed
    assert main(["estimate", "--config", str(config_path), *WORKLOAD, "--grad-accum", str(grad_accum), "--gpus", "2",
                 "--sharding", sharding, "--json"]) == 0
    return json.loads(capsys.readouterr().out)["peak_allocated_bytes"]


def _start(config_path, sharding: str, tmp_path_factory, timeout_s: int = 180, grad_accum: int = 1) -> PendingRun:
    """The 2-GPU bundle's run on CPU (this session's: 2 steps, each rank's trace), started."""
    spec = load_model(None, config_path=str(config_path))
    w = build_workload("train", **FIELDS, grad_accum=grad_accum)
    plan = layout_plan(spec, w, make_layout(spec, w, gpus=2, sharding=sharding), get_gpu("h100"),
                       model_args=("--config", str(config_path)))
    return start_run(tmp_path_factory, plan, timeout_s=timeout_s)


@pytest.fixture(scope="module")
def started(config_path, tmp_path_factory) -> dict[str, PendingRun]:
    """The DDP and ZeRO-3 runs, started together: they run side by side. Per rank, `.result().ranks()` has
    (wrapped, step 1, step 2) as (peak, live), and the run peak."""
    return {sharding: _start(config_path, sharding, tmp_path_factory) for sharding in ("ddp", "zero3")}


def _fp32_shard_bytes(world: int) -> int:
    """One rank's fp32 FSDP2 shards: each parameter split along dim 0, padded, one storage each."""
    h, v, inter, heads, kv = 64, 512, 128, 4, 2
    head_dim = h // heads
    layer = [(h, 1), (h, 1), (heads * head_dim, h), (kv * head_dim, h), (kv * head_dim, h), (h, heads * head_dim),
             (inter, h), (inter, h), (h, inter)]
    shapes = [(v, h), (v, h), (h, 1)] + layer * 2
    return sum(rounded(-(-rows // world) * cols * 4) for rows, cols in shapes)


def test_rank_tracker_follows_storage_resizes_and_keeps_its_high_water():
    """FSDP2 frees and re-allocates its gathered weights with storage.resize_, which no dispatch mode sees."""
    import torch

    from llamem.bundle.ranks import RankTracker

    assert "resize_" not in vars(torch.UntypedStorage)  # torch's own, inherited from StorageBase
    with RankTracker() as tracker:
        x = torch.zeros(1024)  # 4 KiB
        storage = x.untyped_storage()
        storage.resize_(0)
        assert tracker.live_bytes == 0
        storage.resize_(8192)
        assert (tracker.live_bytes, tracker.peak_bytes) == (8192, 8192)
        tracker.reset_peak()  # as a monitor does at each phase
        storage.resize_(0)
        assert tracker.take_high_water() == 8192 and tracker.take_high_water() == 0
        del x, storage
        assert tracker.live_bytes == 0
    assert "resize_" not in vars(torch.UntypedStorage) and tracker.run_peak_bytes == 8192
    y = torch.zeros(4)
    y.untyped_storage().resize_(0)  # outside the tracker: resize_ is torch's own again
    assert tracker.live_bytes == 0


@pytest.fixture(scope="module")
def ddp_run(started) -> tuple[dict, Path]:
    """The DDP bundle's 2-rank CPU run, each rank's allocations written with --memory-trace."""
    run = started["ddp"].result()
    print(run.stdout)
    return run.ranks(), run.traces


def test_ddp_bundle_ranks_peak_at_the_estimate(config_path, ddp_run, capsys):
    estimate = _estimate(config_path, "ddp", capsys)
    ranks, _traces = ddp_run
    for rank in (0, 1):
        # Weights, DDP's buckets, AdamW's state and the step's activations, from the first step on.
        assert abs(ranks[rank]["peak"] - estimate) <= 0.02 * estimate  # measured: 3,368,448 against 3,369,472
        assert ranks[rank]["windows"][1][1] == ranks[rank]["windows"][2][1]  # nothing grows from step to step


def test_each_ranks_trace_replays_within_the_estimates_reserved_memory(config_path, ddp_run):
    """`train.py --memory-trace DIR` writes what the rank's tracker saw; the allocator simulator replays it into
    that rank's own reserved memory, which the estimate's device figure (from a DDP rank's own schedule,
    `llamem.analytic.schedule_ranks`; tests/test_rank_schedules.py checks it closely) covers."""
    from llamem.allocator.replay import load_events, runs_on_card, smallest_card
    from llamem.sizing import estimate_report

    ranks, traces = ddp_run
    spec = load_model(None, config_path=str(config_path))
    w = build_workload("train", **FIELDS)
    device = estimate_report(spec, w, make_layout(spec, w, gpus=2, sharding="ddp"), details=False).device
    for rank in (0, 1):
        events = load_events(traces / f"rank{rank}.json")
        allocated, reserved = smallest_card(events)
        assert allocated == ranks[rank]["peak"]  # the trace is the rank's own event stream
        # Every tensor of this tiny model is under 1 MiB: the allocator serves them from 2 MiB segments.
        assert reserved == runs_on_card(events, None) == 2 * 2**21  # measured: 4,194,304 on both ranks
        assert reserved <= device.peak_reserved_bytes  # the headline figure: the worst of its probes


def test_fsdp2_bundle_ranks_hold_their_shards(config_path, started, capsys):
    estimate = _estimate(config_path, "zero3", capsys)
    run = started["zero3"].result()
    print(run.stdout)
    ranks = run.ranks()
    shards = _fp32_shard_bytes(2)
    steps = 2 * 9 + 3  # AdamW's step counter per parameter tensor
    for rank in (0, 1):
        (_, wrapped_live), (_, first_live), (_, second_live) = ranks[rank]["windows"]
        assert wrapped_live == shards + 3 * SMALL_TENSOR_BYTES  # its fp32 shard, nothing gathered
        # After a step: the shard and AdamW's two moments of it; gradients freed by zero_grad(set_to_none=True).
        assert first_live == second_live == 3 * shards + (steps + 3) * SMALL_TENSOR_BYTES
        # Below DeepSpeed's ZeRO-3 accounting here (see the docstring): measured 1,490,432 against 1,825,088, at
        # times up to 1,551,360, as gloo's worker thread lets go of a collective's buffers sooner or later.
        assert 0.75 * estimate < ranks[rank]["peak"] < estimate


def test_deepspeed_zero2_bundle_ranks_peak_at_the_estimate(config_path, tmp_path_factory, capsys):
    pytest.importorskip("deepspeed")
    # Two micro-batches a step: the launch tests/test_deepspeed_schedules.py checks the rank's schedule against.
    estimate = _estimate(config_path, "zero2", capsys, grad_accum=2)
    run = _start(config_path, "zero2", tmp_path_factory, timeout_s=600, grad_accum=2).result()
    print(run.stdout)
    ranks = run.ranks()
    # The ranks hold the same tensors; with two micro-batches a step gloo's worker thread lets go of a 512-byte
    # scalar sooner on one rank or the other (1,961,472 and 1,961,984 seen in runs of the same bundle).
    assert abs(ranks[0]["peak"] - ranks[1]["peak"]) <= 512
    # The estimate is a GPU's: the parameters arrive in bf16 and DeepSpeed's FusedAdam steps the flat partition.
    # On CPU the tracker also counts the fp32 model built on the host (freed as each bf16 copy is made) and
    # torch's AdamW steps with two partition-sized temporaries: 271,872 bytes more at the peak, by the rank's
    # own schedules (`schedule_deepspeed`, gloo against nccl). Measured 1,961,472 (or 512 bytes more); the estimate
    # 1,675,008.
    spec = load_model(None, config_path=str(config_path))
    w = build_workload("train", **FIELDS, grad_accum=2)
    layout = make_layout(spec, w, gpus=2, sharding="zero2")
    cpu_only = (peak_allocated_bytes(zero_rank_schedule(spec, w, layout, backend="gloo"))
                - peak_allocated_bytes(zero_rank_schedule(spec, w, layout)))
    assert cpu_only == 271_872
    assert abs(ranks[0]["peak"] - (estimate + cpu_only)) <= 0.02 * ranks[0]["peak"]
