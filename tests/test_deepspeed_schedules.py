"""DeepSpeed ZeRO-1/2 ranks' own allocation schedules (`llamem.analytic.schedule_deepspeed`) against what the ranks
of the launch bundle allocate: `bash launch.sh --cpu --random-init --max-steps 2 --memory-trace DIR` runs a tiny
Llama on 2 processes (gloo, without DeepSpeed's shared-memory op) and writes each rank's event stream from llamem's
CPU tracker; the allocator simulator replays it into that rank's reserved memory.

On CPU a rank is the `backend="gloo"` schedule (the tracker counts the fp32 model before the engine's cast, torch's
AdamW steps the fp32 partition with its for-loop temporaries); what `estimate` sizes is the CUDA one
(`backend="nccl"`), which differs from it in exactly those points.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bundle_runner import config_path, start_run  # noqa: E402

from llamem.allocator.replay import load_events, peak_allocated_bytes, runs_on_card, smallest_card  # noqa: E402
from llamem.analytic.common import r512  # noqa: E402
from llamem.analytic.schedule_deepspeed import (reduce_bucket_numel, zero_partition, zero_rank_schedule,  # noqa: E402
                                                zero_schedule)
from llamem.analytic.schedule_ranks import rank_schedule_kind  # noqa: E402
from llamem.bundle import emit_bundle, layout_plan  # noqa: E402
from llamem.cli import main  # noqa: E402
from llamem.gpus import get_gpu  # noqa: E402
from llamem.model import load_model  # noqa: E402
from llamem.parallel import make_layout  # noqa: E402
from llamem.workload import build_workload  # noqa: E402

__all__ = ["config_path"]  # the fixture

FIELDS = {"batch": 2, "seq": 16, "grad_accum": 1, "precision": "bf16-mixed", "optimizer": "adamw"}
MiB = 2**20
PARAMS = 139_584
"""The tiny Llama's parameters: 2 x 512 x 64 (embedding, head) + 2 layers of 36,992 + the final norm's 64."""
PARTITION_BYTES = r512(4 * PARAMS // 2)
"""One rank's fp32 partition: 279,168 bytes, one 279,552-byte block (master weights, gradient, each Adam state)."""
LARGE = 100_000
"""Only the flat buffers are this large here: the 16-bit flat parameters, clones, partitions, fp64 norm copies."""


def _setup(config_path, sharding: str, **changes):
    spec = load_model(None, config_path=str(config_path))
    w = build_workload("train", **{**FIELDS, **changes})
    return spec, w, make_layout(spec, w, gpus=2, sharding=sharding)


def _traces(config_path, tmp_path_factory, sharding: str) -> Path:
    """The 2-GPU bundle's 2-step CPU run with --memory-trace (shared with the other tests that run this bundle,
    `bundle_runner.start_run`); the folder of rank0.json and rank1.json."""
    spec, w, layout = _setup(config_path, sharding)
    plan = layout_plan(spec, w, layout, get_gpu("h100"), model_args=("--config", str(config_path)))
    run = start_run(tmp_path_factory, plan, timeout_s=300).result()
    assert len(re.findall(r"^rank \d trace ", run.stdout, re.MULTILINE)) == 2, run.stdout
    return run.traces


@pytest.fixture(scope="module")
def zero2_traces(config_path, tmp_path_factory) -> Path:
    return _traces(config_path, tmp_path_factory, "zero2")


@pytest.fixture(scope="module")
def zero1_traces(config_path, tmp_path_factory) -> Path:
    return _traces(config_path, tmp_path_factory, "zero1")


def _cpu_schedule(config_path, stage: int, rank: int):
    spec, w, layout = _setup(config_path, f"zero{stage}")
    return zero_schedule(spec, w, 2, reduce_bucket_numel(spec, w, layout), stage=stage, rank=rank, backend="gloo")


def _large(events) -> list[int]:
    return [e.size for e in events if e.action == "alloc" and e.size >= LARGE]


def _assert_ranks_replay_their_schedules(config_path, traces: Path, stage: int) -> None:
    """Each rank reserves what its own schedule does (two 2 MiB segments: everything here is under 1 MiB), on the
    same smallest card to the search's precision, its peak the schedule's plus the scalars it leaves out."""
    for rank in (0, 1):
        schedule, events = _cpu_schedule(config_path, stage, rank), load_events(traces / f"rank{rank}.json")
        assert runs_on_card(events, None) == runs_on_card(schedule, None) == 4 * MiB
        (scheduled, scheduled_card), (traced, traced_card) = smallest_card(schedule), smallest_card(events)
        assert scheduled == peak_allocated_bytes(schedule) == 1_958_400
        assert 0 <= traced - scheduled <= 8 * 512  # measured 1,960,960: the loss scaler's and the norm's scalars
        assert abs(traced_card - scheduled_card) <= traced // 128  # measured 4,178,984 against 4,179,004
        # Every flat buffer, in order: the wrap's, the partition of gradients, the fp64 norm pieces, the step's.
        assert _large(events) == _large(schedule)


def test_zero2_ranks_replay_their_own_schedules(config_path, zero2_traces):
    _assert_ranks_replay_their_schedules(config_path, zero2_traces, 2)


@pytest.mark.skipif(not os.environ.get("LLAMEM_DEEPSPEED_RUNS"), reason="set LLAMEM_DEEPSPEED_RUNS=1: a second "
                    "DeepSpeed launch (ZeRO-2's above runs by default)")
def test_zero1_ranks_replay_their_own_schedules(config_path, zero1_traces):
    _assert_ranks_replay_their_schedules(config_path, zero1_traces, 1)


def test_partitions_follow_deepspeeds_flat_buffer(config_path):
    """The flat buffer padded to 2 x N elements, split in N; parameters straddling an edge count whole in
    `grads_in_partition`, and only their part in the gradient norm's pieces."""
    spec, _w, _layout = _setup(config_path, "zero2")
    first, last = zero_partition(spec, 2, 0), zero_partition(spec, 2, 1)
    assert (first.flat_numel, first.partition_numel) == (PARAMS, PARAMS // 2)
    # Rank 0: the embedding, layer 0 (7 projections, 2 norms) and 32 elements of layer 1's q_proj (4,096).
    assert first.pieces == (32_768, 4096, 2048, 2048, 4096, 8192, 8192, 8192, 64, 64, 32)
    assert sum(first.whole_numels) == 32_768 + 36_992 + 4096 and first.owned_units == {"embed", 0, 1}
    assert sum(last.whole_numels) == 36_992 + 64 + 32_768 and last.owned_units == {1, "head"}
    assert sum(last.pieces) == PARAMS // 2 and last.padding_numel == 0
    five = zero_partition(spec, 5, 4)
    assert (five.flat_numel, five.padding_numel) == (139_590, 6)  # padded to a multiple of 10, on the last rank


def test_the_reduce_bucket_is_the_emitted_configs(config_path):
    """reduce_bucket_size = h x h elements (the bundle's ds_config.json): one 16-bit bucket a step."""
    spec, w, layout = _setup(config_path, "zero2")
    assert reduce_bucket_numel(spec, w, layout) == 64 * 64
    odd = zero_schedule(spec, w, 2, 12_345, stage=2)
    assert [e.size for e in odd if e.action == "alloc" and e.size == r512(2 * 12_345)] == [r512(2 * 12_345)] * 2


def test_cuda_schedule_is_the_cpu_one_without_the_hosts_copies_and_adams_temporaries(config_path):
    """What the estimate sizes: the parameters arrive in bf16 (no fp32 originals), FusedAdam makes its two states
    (no step tensor) and no temporaries; the flat buffers are the same."""
    spec, w, layout = _setup(config_path, "zero2")
    cuda, cpu = zero_rank_schedule(spec, w, layout), zero_rank_schedule(spec, w, layout, backend="gloo")
    flat, clone, in_partition = r512(2 * PARAMS), r512(PARAMS), r512(2 * (32_768 + 36_992 + 4096))
    wrap = [flat, clone, PARTITION_BYTES, PARTITION_BYTES]
    norms = [262_144]  # the embedding's gradient in fp64
    step = [in_partition, *norms, clone, PARTITION_BYTES]
    assert _large(cuda) == wrap + step + [PARTITION_BYTES] * 2 + step
    originals = [4 * 512 * 64] * 2  # the fp32 embedding and head, as the tracker counts the model built on the host
    assert _large(cpu) == originals + wrap + step + [PARTITION_BYTES] * 4 + step + [PARTITION_BYTES] * 2
    assert peak_allocated_bytes(cpu) - peak_allocated_bytes(cuda) == 1_958_400 - 1_686_528
    assert smallest_card(cuda) == (1_686_528, 2 * MiB)


@pytest.mark.parametrize(("sharding", "changes", "kind"), [
    ("zero2", {}, "zero2"), ("zero1", {}, "zero1"), ("zero3", {}, None),
    ("zero2", {"precision": "fp16-mixed"}, None), ("zero2", {"grad_accum": 2}, None),
    ("zero2", {"optimizer": "adamw8bit"}, None)])
def test_rank_schedules_cover_the_bundles_bf16_zero1_and_zero2(config_path, sharding, changes, kind):
    assert rank_schedule_kind(*_setup(config_path, sharding, **changes)) == kind


def test_the_report_says_the_fragmentation_is_the_zero_ranks(config_path, capsys):
    capsys.readouterr()
    assert main(["estimate", "--config", str(config_path), "--batch", "2", "--seq", "16", "--precision",
                 "bf16-mixed", "--optimizer", "adamw", "--gpus", "2", "--sharding", "zero2", "--json"]) == 0
    notes = " ".join(json.loads(capsys.readouterr().out)["notes"])
    assert "this rank's own allocation schedule (DeepSpeed ZeRO-2's flat 16-bit buffer" in notes


@pytest.mark.parametrize(("sharding", "grad_accum", "forward_gradients"), [
    ("zero2", 1, 0), ("zero1", 1, 0), ("zero2", 2, 2 * PARAMS // 2), ("zero1", 2, 2 * PARAMS)])
def test_zero_gradients_live_from_backward_to_the_step(config_path, capsys, sharding, grad_accum, forward_gradients):
    """ZeRO-1/2 makes its gradients in backward and frees them in the step: none in forward with one micro-batch
    a step, whose second forward the ranks measure at 1,463,296 (the estimate's: 1,459,712); with accumulation
    the 16-bit gradients carry over to the next micro-batch's forward (ZeRO-2: the partition's; ZeRO-1, which
    reduces at the boundary only: all). The fp32 gradient partition lives in the step only, beside the 16-bit
    partition and its concatenation."""
    capsys.readouterr()
    assert main(["estimate", "--config", str(config_path), "--batch", "2", "--seq", "16", "--grad-accum",
                 str(grad_accum), "--precision", "bf16-mixed", "--optimizer", "adamw", "--gpus", "2", "--sharding",
                 sharding, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["phase_breakdowns"]["forward"].get("gradients", 0) == forward_gradients
    bucket = 2 * 64 * 64  # the emitted reduce_bucket_size (h x h) in bf16
    unreduced = 2 * PARAMS if sharding == "zero1" else 0
    assert report["phase_breakdowns"]["backward"]["gradients"] == unreduced + 2 * PARAMS // 2 + bucket
    assert report["phase_breakdowns"]["optimizer"]["gradients"] == 2 * (2 * PARAMS // 2) + 4 * PARAMS // 2
    if (sharding, grad_accum) == ("zero2", 1):
        assert report["phases"]["forward"] == 1_459_712


@pytest.mark.parametrize(("sharding", "estimate_peak"), [("zero2", 1_675_008), ("zero1", 1_918_400)])
def test_the_estimate_follows_the_ranks_schedule(config_path, capsys, sharding, estimate_peak):
    """The estimate's peak against the GPU rank's schedule (1,686,528 under both stages: the step, with the 16-bit
    partition, its concatenation and the fp32 gradient). ZeRO-2's is the step's within 1 % (the fp64 norm piece
    and the scalars left out); ZeRO-1's stays above it, in backward: the analytic phase keeps every 16-bit
    gradient beside the activations of its worst moment, where the run frees activations as gradients come."""
    spec, w, layout = _setup(config_path, sharding)
    schedule_peak = peak_allocated_bytes(zero_rank_schedule(spec, w, layout))
    capsys.readouterr()
    assert main(["estimate", "--config", str(config_path), "--batch", "2", "--seq", "16", "--precision", "bf16-mixed",
                 "--optimizer", "adamw", "--gpus", "2", "--sharding", sharding, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (schedule_peak, report["peak_allocated_bytes"]) == (1_686_528, estimate_peak)
    assert report["peak_phase"] == ("optimizer" if sharding == "zero2" else "backward")
