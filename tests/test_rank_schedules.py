"""Each rank's own allocation schedule (`llamem.analytic.schedule_ranks`) against what the ranks of the launch
bundle allocate: `bash launch.sh --cpu --random-init --max-steps 2 --memory-trace DIR` runs a tiny Llama on 2
processes (gloo) and writes each rank's event stream from llamem's CPU tracker; the allocator simulator replays
it into that rank's reserved memory.

The schedules are built from the same sizes as `llamem estimate --gpus 2`'s allocated figure: DDP's with its
broadcast copy and flat gradient buckets, FSDP2's unit by unit (all-gathers, reshards, reduce-scatters). On CPU
the FSDP2 rank is the `backend="gloo"` schedule (one stream, gloo's copy of each reduce-scatter input); what
`estimate` sizes is the CUDA one (`backend="nccl"`), which differs from it in exactly those two points.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bundle_runner import config_path, start_run  # noqa: E402

from llamem.allocator.replay import load_events, peak_allocated_bytes, runs_on_card, smallest_card  # noqa: E402
from llamem.analytic.schedule import schedule  # noqa: E402
from llamem.analytic.schedule_ranks import (ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM, ddp_bucket_bytes,  # noqa: E402
                                            fsdp2_unit_sizes, rank_schedule, rank_schedule_kind)
from llamem.bundle import layout_plan  # noqa: E402
from llamem.cli import main  # noqa: E402
from llamem.gpus import get_gpu  # noqa: E402
from llamem.model import load_model  # noqa: E402
from llamem.parallel import make_layout, shard_spec  # noqa: E402
from llamem.sizing import estimate_report  # noqa: E402
from llamem.workload import build_workload, with_changes  # noqa: E402

__all__ = ["config_path"]  # the fixture

FIELDS = {"batch": 2, "seq": 16, "precision": "bf16-mixed", "optimizer": "adamw"}
MiB = 2**20


def _setup(config_path, sharding: str | None, engine: str = "deepspeed", tp: int = 1):
    spec = load_model(None, config_path=str(config_path))
    w = build_workload("train", **FIELDS)
    return spec, w, make_layout(spec, w, gpus=2, tp=tp, sharding=sharding, engine=engine)


@pytest.fixture(scope="module")
def started(config_path, tmp_path_factory) -> dict:
    """The 2-GPU bundles' runs (this session's: 2 steps on CPU with --memory-trace), started together."""
    # The ZeRO-3 bundle runs FSDP2 whichever engine sizes it (the plan's figures it prints differ, not what it
    # runs): the bundle of the default engine is test_bundle_runs.py's, one run for both.
    out = {}
    for name, sharding, tp in (("ddp", "ddp", 1), ("fsdp2", "zero3", 1), ("tp", None, 2)):
        spec, w, layout = _setup(config_path, sharding, "deepspeed", tp)
        plan = layout_plan(spec, w, layout, get_gpu("h100"), model_args=("--config", str(config_path)))
        out[name] = start_run(tmp_path_factory, plan)
    return out


def _traces(started: dict, name: str) -> Path:
    """The folder of the run's rank0.json and rank1.json."""
    run = started[name].result()
    assert len(re.findall(r"^rank \d trace ", run.stdout, re.MULTILINE)) == 2, run.stdout
    return run.traces


@pytest.fixture(scope="module")
def ddp_traces(started) -> Path:
    return _traces(started, "ddp")


@pytest.fixture(scope="module")
def fsdp2_traces(started) -> Path:
    return _traces(started, "fsdp2")


@pytest.fixture(scope="module")
def tp_traces(started) -> Path:
    return _traces(started, "tp")


def _reserved_figure(spec, w, layout) -> tuple[int, int]:
    """The estimate's (peak allocated, reserved) for this exact shape, per rank (without non-torch memory)."""
    device = estimate_report(spec, w, layout).device
    return device.peak_allocated_bytes, device.exact_shape_device_bytes - device.non_torch_bytes


def test_ddp_ranks_reserve_what_the_estimate_says(config_path, ddp_traces):
    spec, w, layout = _setup(config_path, "ddp")
    schedule = rank_schedule(spec, w, layout)
    allocated, reserved = _reserved_figure(spec, w, layout)
    # The schedule's peak was 3,383,808 until its autocast linears followed autograd's order (no input casts of
    # o_proj and down_proj, the weight cast's backward after the input's): 1,536 bytes under the ranks' now.
    assert smallest_card(schedule) == (3_367_424, 4 * MiB)
    # reserved: allocated + the schedule's 826,880 above it (810,496 before: 4,179,968; the ranks reserve 4 MiB)
    assert (allocated, reserved) == (3_369_472, 4_196_352)
    # Two 2 MiB segments (every tensor here is under 1 MiB): the estimate 0.3 % below; the ranks peak at 3,368,960.
    assert _replayed_ranks(ddp_traces, schedule, allocated, reserved) == [4 * MiB] * 2


def _replayed_ranks(traces: Path, schedule, allocated: int, reserved: int) -> list[int]:
    """Each rank's replayed reserved memory, its reserved and peak allocated held to 2 % of the estimate's (and its
    peak to the schedule's)."""
    out = []
    for rank in (0, 1):
        traced_allocated, traced_reserved = smallest_card(load_events(traces / f"rank{rank}.json"))
        assert abs(reserved - traced_reserved) <= 0.02 * traced_reserved
        assert abs(allocated - traced_allocated) <= 0.02 * traced_allocated
        assert abs(peak_allocated_bytes(schedule) - traced_allocated) <= 0.02 * traced_allocated
        out.append(traced_reserved)
    return out


def test_ddp_schedule_broadcasts_and_buckets_as_the_rank_does(config_path, ddp_traces):
    """The wrap's broadcast copy and first bucket, the bucket rebuilt before the second step: every allocation of
    at least 256 KiB, in order, is the same in the schedule and in each rank's trace."""
    spec, w, layout = _setup(config_path, "ddp")
    flat = 558_592  # every parameter in fp32, in one flat tensor: 139,648 x 4 bytes
    assert [e.size for e in rank_schedule(spec, w, layout) if e.action == "alloc" and e.size >= 2**18] == [flat] * 3
    for rank in (0, 1):
        events = load_events(ddp_traces / f"rank{rank}.json")
        assert [e.size for e in events if e.action == "alloc" and e.size >= 2**18] == [flat] * 3


def test_ddp_buckets_close_at_torchs_limits():
    """compute_bucket_assignment_by_size: a bucket closes once it reaches its limit (1 MiB for the first)."""
    half = MiB // 2
    assert ddp_bucket_bytes([half] * 5, [MiB, 25 * MiB]) == [MiB, 3 * half]
    assert ddp_bucket_bytes([3 * half, 20 * MiB, 10 * MiB, 30 * MiB], [MiB, 25 * MiB]) == [3 * half, 30 * MiB,
                                                                                           30 * MiB]
    assert ddp_bucket_bytes([100, 100], [2**63]) == [512]  # one flat bucket before the first step


def test_fsdp2_ranks_replay_the_gloo_schedule(config_path, fsdp2_traces):
    """The CPU run's own schedule: the same reserved memory, the same peak within gloo's timing."""
    spec, w, layout = _setup(config_path, "zero3", "fsdp2")
    schedule = rank_schedule(spec, w, layout, backend="gloo")
    peak = peak_allocated_bytes(schedule)
    layer = fsdp2_unit_sizes(spec, w, 2)[0]
    late = layer.copy_in_bytes + layer.output_bytes  # gloo's copy kept past the next unit's all-gather
    assert smallest_card(schedule) == (1_491_456, 2 * MiB)
    for rank in (0, 1):
        events = load_events(fsdp2_traces / f"rank{rank}.json")
        traced_allocated, traced_reserved = smallest_card(events)
        assert traced_reserved == 2 * MiB
        # measured 1,490,432 and, when gloo's worker thread lets go of its copy late, 1,537,024 to 1,551,360
        assert 0.98 * peak <= traced_allocated <= peak + late


def test_fsdp2_schedule_gathers_and_reduces_as_the_rank_does(config_path, fsdp2_traces):
    """Every all-gather input and output and every reduce-scatter input, output and gloo copy, in order: the sizes
    only these buffers have here (the layers', the head's), in the schedule and in each rank's trace."""
    spec, w, layout = _setup(config_path, "zero3", "fsdp2")
    units = fsdp2_unit_sizes(spec, w, 2)
    distinct = {size for unit in (units[0], units["head"]) for size in
                (unit.copy_in_bytes, unit.output_bytes, unit.rs_input_bytes, unit.rs_output_bytes)}
    assert distinct == {37_376, 74_240, 147_968, 33_280, 66_048, 131_584}
    expected = [e.size for e in rank_schedule(spec, w, layout, backend="gloo") if e.action == "alloc"
                and e.size in distinct]
    # Per step: the head's and the layers' all-gathers in forward (2 buffers each) and the layers' in backward,
    # their reduce-scatters' input, output and gloo copy (the embedding's sizes are shared with other tensors).
    assert len(expected) == 2 * (3 * 2 + 2 * 2 + 3 * 3)
    for rank in (0, 1):
        events = load_events(fsdp2_traces / f"rank{rank}.json")
        assert [e.size for e in events if e.action == "alloc" and e.size in distinct] == expected


def test_fsdp2_cuda_schedule_is_the_cpu_one_on_fsdp2s_streams(config_path):
    """What the estimate sizes differs from the CPU run's schedule in the documented CUDA-only points: the
    all-gather buffers on FSDP2's copy-in stream, the reduce-scatter output on its stream, no gloo copy."""
    spec, w, layout = _setup(config_path, "zero3", "fsdp2")
    cuda, cpu = rank_schedule(spec, w, layout), rank_schedule(spec, w, layout, backend="gloo")
    rs_inputs = {unit.rs_input_bytes for unit in fsdp2_unit_sizes(spec, w, 2).values()}
    copies = {e.addr for e, after in itertools.pairwise(cpu) if e.action == "alloc" and after.action == "free"
              and after.addr == e.addr and e.size in rs_inputs}
    assert len(copies) == 8  # a reduce-scatter per unit a step: head, 2 layers, embedding
    assert _shape([e for e in cpu if e.addr not in copies]) == _shape(cuda)
    streams = {e.stream for e in cuda if e.action == "alloc"}
    assert streams == {0, ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM} and {e.stream for e in cpu} == {0}
    allocated, reserved = _reserved_figure(spec, w, layout)
    cuda_allocated, cuda_reserved = smallest_card(cuda)
    assert cuda_allocated == 1_420_288 and abs(allocated - cuda_allocated) <= 0.02 * allocated  # 1,439,232
    # Three streams, each with its own 2 MiB small-pool segment: what a GPU reserves and the CPU run cannot show.
    assert runs_on_card(cuda, None) == 3 * 2 * MiB
    assert reserved == allocated + cuda_reserved - cuda_allocated


def _shape(events) -> list[tuple[str, int]]:
    sizes = {e.addr: e.size for e in events if e.action == "alloc"}
    return [(e.action, sizes[e.addr]) for e in events]


def test_tensor_parallel_ranks_reserve_what_the_estimate_says(config_path, tp_traces):
    """The rank's share with the functional all-reduce's copies and DTensor's whole-vocabulary embedding gradient."""
    spec, w, layout = _setup(config_path, None, tp=2)
    schedule = rank_schedule(shard_spec(spec, layout), w, layout)
    allocated, reserved = _reserved_figure(spec, w, layout)
    assert smallest_card(schedule) == (1_481_728, 2 * MiB)
    # reserved: allocated + the schedule's 615,424 above it (598,016 before: 2,081,792; the ranks reserve 2 MiB)
    assert (allocated, reserved) == (1_482_752, 2_098_176)
    # One 2 MiB segment: the estimate 0.7 % below; the ranks peak at 1,481,216, the schedule 512 bytes above (it was
    # 1,498,112 while the single-GPU schedule of the share kept each step's fp32 embedding output under autocast,
    # which layer 0's input norm now lets go of in its backward, as the ranks do).
    assert _replayed_ranks(tp_traces, schedule, allocated, reserved) == [2 * MiB] * 2


def test_tensor_parallel_schedule_adds_the_collectives_copies(config_path, tp_traces):
    """Per step: an all-reduced copy of each layer's 2 row-parallel outputs and 5 column-parallel input gradients,
    of the embedding's output and the head's input gradient, and the whole embedding gradient (V x h x 4 bytes);
    `loss_parallel`'s tensors beyond transformers' loss (`llamem.analytic.loss_parallel.LossParallelEvents`): in
    forward the labels, `shifted`, `exp`, 3 T-vectors and 2 scalars, in backward `exp(x)`, their sum, the loss's
    gradient and 6 T-vectors."""
    spec, w, layout = _setup(config_path, None, tp=2)
    local = shard_spec(spec, layout)
    own, single = rank_schedule(local, w, layout), schedule(local, w)
    loss_parallel = (1 + 2 + 3 + 2) + (2 + 1 + 6)
    assert sum(e.action == "alloc" for e in own) - sum(e.action == "alloc" for e in single) == 2 * (2 * 7 + 3
                                                                                                   + loss_parallel)
    whole = 512 * 64 * 4
    assert [e.size for e in single if e.size >= whole] == []
    assert [e.size for e in own if e.action == "alloc" and e.size >= whole] == [whole] * 2
    for rank in (0, 1):  # the wrap's whole embedding and head (cut into shards), then one gradient a step
        events = load_events(tp_traces / f"rank{rank}.json")
        assert [e.size for e in events if e.action == "alloc" and e.size >= whole] == [whole] * 4


@pytest.mark.parametrize(("flags", "own"), [(["--sharding", "ddp"], "DDP's broadcast and gradient buckets"),
                                            (["--sharding", "zero3", "--engine", "fsdp2"], "FSDP2's per-unit"),
                                            (["--tp", "2"], "tensor parallel's all-reduced"),
                                            (["--sharding", "zero3"], "DeepSpeed ZeRO-3's gathered"),
                                            (["--sharding", "zero3", "--grad-accum", "2"], "DeepSpeed ZeRO-3's gathered"),
                                            (["--sharding", "zero3", "--ac", "selective"], None)])
def test_the_report_says_whose_schedule_its_reserved_memory_comes_from(config_path, capsys, flags, own):
    capsys.readouterr()
    assert main(["estimate", "--config", str(config_path), "--batch", "2", "--seq", "16", "--precision",
                 "bf16-mixed", "--optimizer", "adamw", "--gpus", "2", *flags, "--json"]) == 0
    notes = " ".join(json.loads(capsys.readouterr().out)["notes"])
    if own:
        assert f"this rank's own allocation schedule ({own}" in notes
    else:
        assert "the single-GPU schedule: ranks have their own only under DDP, FSDP2's ZeRO-3 and tensor" in notes


def test_layouts_without_a_rank_schedule_replay_the_single_gpu_one(config_path):
    spec, w, _ = _setup(config_path, "ddp")
    kinds = {flags: rank_schedule_kind(spec, w, make_layout(spec, w, gpus=2, **dict(flags)))
             for flags in [(("sharding", "ddp"),), (("sharding", "zero3"), ("engine", "fsdp2")),
                           (("sharding", "zero2"),), (("sharding", "zero3"),), (("tp", 2),), (("pp", 2),)]}
    assert list(kinds.values()) == ["ddp", "fsdp2", "zero2", "zero3", "tp", "pipeline"]
    # Up to two micro-batches per stage each stage replays its own schedule; past that it would cost more than
    # twice the whole model's one-GPU one (`schedule_pipeline.MICROBATCHES_PER_STAGE`): the first stage's share
    # replays as one GPU.
    kinds = {}
    for accum in (2, 4, 5):
        accumulated = with_changes(w, grad_accum=accum)
        layout = make_layout(spec, accumulated, gpus=2, pp=2)
        assert layout.microbatches == accum
        kinds[accum] = rank_schedule_kind(spec, accumulated, layout)
    assert kinds == {2: "pipeline", 4: "pipeline", 5: None}
    lora = build_workload("lora", **FIELDS)  # DDP's buckets on the adapters: tests/test_ddp_lora_schedule.py
    assert rank_schedule_kind(spec, lora, make_layout(spec, lora, gpus=2)) == "ddp"
