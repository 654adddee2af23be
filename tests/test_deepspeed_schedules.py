"""DeepSpeed ZeRO-1/2 ranks' own allocation schedules (`llamem.analytic.schedule_deepspeed`) against what the ranks
of the launch bundle allocate: `bash launch.sh --cpu --random-init --max-steps 2 --memory-trace DIR` runs a tiny
Llama on 2 processes (gloo, without DeepSpeed's shared-memory op) and writes each rank's event stream from llamem's
CPU tracker; the allocator simulator replays it into that rank's reserved memory. The run by default is ZeRO-2 with
2 micro-batches a step (ds_config.json's gradient_accumulation_steps); LLAMEM_DEEPSPEED_RUNS=1 adds ZeRO-1 with 2
and ZeRO-1 and ZeRO-2 with one (the schedule of one micro-batch is pinned below without a run too).

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

from bundle_runner import PendingRun, config_path, start_run  # noqa: E402

from llamem.allocator.replay import load_events, peak_allocated_bytes, runs_on_card, smallest_card  # noqa: E402
from llamem.analytic.common import r512  # noqa: E402
from llamem.analytic.schedule_deepspeed import (reduce_bucket_numel, zero_partition, zero_rank_schedule,  # noqa: E402
                                                zero_schedule)
from llamem.analytic.schedule_ranks import rank_schedule_kind  # noqa: E402
from llamem.bundle import layout_plan  # noqa: E402
from llamem.cli import main  # noqa: E402
from llamem.gpus import get_gpu  # noqa: E402
from llamem.model import load_model  # noqa: E402
from llamem.parallel import make_layout  # noqa: E402
from llamem.workload import build_workload  # noqa: E402

__all__ = ["config_path"]  # the fixture

FIELDS = {"batch": 2, "seq": 16, "grad_accum": 1, "precision": "bf16-mixed", "optimizer": "adamw"}
ACCUM = 2
"""The default run's micro-batches a step."""
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


def _start(config_path, tmp_path_factory, sharding: str, grad_accum: int) -> PendingRun:
    """The 2-GPU bundle's 2-step CPU run with --memory-trace, started (shared with the other tests that run this
    bundle, `bundle_runner.start_run`)."""
    spec, w, layout = _setup(config_path, sharding, grad_accum=grad_accum)
    plan = layout_plan(spec, w, layout, get_gpu("h100"), model_args=("--config", str(config_path)))
    return start_run(tmp_path_factory, plan, timeout_s=300)


def _traces(started: PendingRun) -> Path:
    """The folder of the run's rank0.json and rank1.json."""
    run = started.result()
    assert len(re.findall(r"^rank \d trace ", run.stdout, re.MULTILINE)) == 2, run.stdout
    return run.traces


@pytest.fixture(scope="module")
def zero2_traces(config_path, tmp_path_factory) -> Path:
    return _traces(_start(config_path, tmp_path_factory, "zero2", ACCUM))


MORE_RUNS = [("zero1", ACCUM), ("zero1", 1), ("zero2", 1)]


@pytest.fixture(scope="module")
def more_runs(config_path, tmp_path_factory) -> dict[tuple[str, int], PendingRun]:
    """The runs LLAMEM_DEEPSPEED_RUNS=1 adds, started together: they run side by side."""
    return {run: _start(config_path, tmp_path_factory, *run) for run in MORE_RUNS}


def _cpu_schedule(config_path, stage: int, rank: int, grad_accum: int):
    spec, w, layout = _setup(config_path, f"zero{stage}", grad_accum=grad_accum)
    return zero_schedule(spec, w, 2, reduce_bucket_numel(spec, w, layout), stage=stage, rank=rank, backend="gloo")


def _large(events) -> list[int]:
    return [e.size for e in events if e.action == "alloc" and e.size >= LARGE]


def _assert_ranks_replay_their_schedules(config_path, traces: Path, stage: int, grad_accum: int) -> None:
    """Each rank reserves what its own schedule does (two 2 MiB segments: everything here is under 1 MiB), on the
    same smallest card to the search's precision, its peak the schedule's plus the scalars it leaves out."""
    for rank in (0, 1):
        schedule = _cpu_schedule(config_path, stage, rank, grad_accum)
        events = load_events(traces / f"rank{rank}.json")
        assert runs_on_card(events, None) == runs_on_card(schedule, None) == 4 * MiB
        (scheduled, scheduled_card), (traced, traced_card) = smallest_card(schedule), smallest_card(events)
        assert scheduled == peak_allocated_bytes(schedule) == 1_958_400  # the step's, with or without accumulation
        # Measured 1,960,960 (one micro-batch) and 1,961,472 (two): the loss scaler's and the norm's scalars.
        assert 0 <= traced - scheduled <= 8 * 512
        assert abs(traced_card - scheduled_card) <= traced // 128  # measured 4,178,980 to 4,178,984 against 4,179,004
        # Every flat buffer, in order: the wrap's, each micro-batch's partition of gradients (ZeRO-2) or the
        # boundary's (ZeRO-1), the fp64 norm pieces, the step's.
        assert _large(events) == _large(schedule)


def _run_peak_against_the_estimate(config_path, traces: Path, sharding: str, grad_accum: int, capsys) -> float:
    """The run's peak against the estimate's plus what only the CPU run allocates (the fp32 model on the host,
    torch AdamW's temporaries: the gloo schedule's peak less the nccl one's), as a fraction of the run's."""
    spec, w, layout = _setup(config_path, sharding, grad_accum=grad_accum)
    cpu_only = (peak_allocated_bytes(zero_rank_schedule(spec, w, layout, backend="gloo"))
                - peak_allocated_bytes(zero_rank_schedule(spec, w, layout)))
    capsys.readouterr()
    assert main(["estimate", "--config", str(config_path), "--batch", "2", "--seq", "16", "--grad-accum",
                 str(grad_accum), "--precision", "bf16-mixed", "--optimizer", "adamw", "--gpus", "2", "--sharding",
                 sharding, "--json"]) == 0
    estimate = json.loads(capsys.readouterr().out)["peak_allocated_bytes"]
    run = max(peak_allocated_bytes(load_events(traces / f"rank{rank}.json")) for rank in (0, 1))
    return (estimate + cpu_only - run) / run


def test_zero2_ranks_replay_their_own_schedules_with_accumulation(config_path, zero2_traces, capsys):
    _assert_ranks_replay_their_schedules(config_path, zero2_traces, 2, ACCUM)
    # Measured 1,961,472 against 1,675,008 + 271,872: the peak is the step's, as with one micro-batch a step.
    assert -0.01 <= _run_peak_against_the_estimate(config_path, zero2_traces, "zero2", ACCUM, capsys) <= 0


@pytest.mark.skipif(not os.environ.get("LLAMEM_DEEPSPEED_RUNS"), reason="set LLAMEM_DEEPSPEED_RUNS=1: more "
                    "DeepSpeed launches (ZeRO-2's with accumulation runs by default)")
@pytest.mark.parametrize(("sharding", "grad_accum"), MORE_RUNS)
def test_more_ranks_replay_their_own_schedules(config_path, more_runs, capsys, sharding, grad_accum):
    traces = _traces(more_runs[sharding, grad_accum])
    _assert_ranks_replay_their_schedules(config_path, traces, int(sharding[-1]), grad_accum)
    if (sharding, grad_accum) == ("zero1", ACCUM):
        # ZeRO-1's estimate stays above (`parallel.accumulated_zero_gradients` counts the boundary's partition with
        # the activations' worst): measured 1,961,472 against 1,918,400 + 173,056.
        assert 0 <= _run_peak_against_the_estimate(config_path, traces, sharding, grad_accum, capsys) <= 0.07


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


def test_accumulation_keeps_the_first_micro_batchs_gradients_to_the_step(config_path):
    """Two micro-batches a step. ZeRO-2 reduces in each backward: the first's `grads_in_partition` lives to the
    step, the second makes its own (added into the first's, freed at the end of its backward). ZeRO-1 keeps the
    16-bit gradients in `param.grad` to the boundary, whose reduction makes the one `grads_in_partition` of the
    step. A micro-batch between the first and the last allocates as the last does: the schedule runs those two."""
    spec, w, layout = _setup(config_path, "zero2", grad_accum=2)
    flat, clone, in_partition = r512(2 * PARAMS), r512(PARAMS), r512(2 * (32_768 + 36_992 + 4096))
    wrap, norms = [flat, clone, PARTITION_BYTES, PARTITION_BYTES], [262_144]
    step = [*norms, clone, PARTITION_BYTES]
    zero2 = zero_rank_schedule(spec, w, layout)
    assert _large(zero2) == wrap + [in_partition] * 2 + step + [PARTITION_BYTES] * 2 + [in_partition] * 2 + step
    assert zero2 == zero_rank_schedule(spec, *_setup(config_path, "zero2", grad_accum=8)[1:])
    zero1 = zero_rank_schedule(*_setup(config_path, "zero1", grad_accum=2))
    assert _large(zero1) == wrap + [in_partition] + step + [PARTITION_BYTES] * 2 + [in_partition] + step


@pytest.mark.parametrize(("sharding", "changes", "kind"), [
    ("zero2", {}, "zero2"), ("zero1", {}, "zero1"), ("zero3", {}, "zero3"),
    ("zero2", {"precision": "fp16-mixed"}, None), ("zero2", {"grad_accum": 2}, "zero2"),
    ("zero1", {"grad_accum": 4}, "zero1"), ("zero2", {"optimizer": "adamw8bit"}, None)])
def test_rank_schedules_cover_the_bundles_bf16_zero1_and_zero2(config_path, sharding, changes, kind):
    assert rank_schedule_kind(*_setup(config_path, sharding, **changes)) == kind


def test_the_report_says_the_fragmentation_is_the_zero_ranks(config_path, capsys):
    capsys.readouterr()
    assert main(["estimate", "--config", str(config_path), "--batch", "2", "--seq", "16", "--precision",
                 "bf16-mixed", "--optimizer", "adamw", "--gpus", "2", "--sharding", "zero2", "--json"]) == 0
    notes = " ".join(json.loads(capsys.readouterr().out)["notes"])
    assert "this rank's own allocation schedule (DeepSpeed ZeRO-2's flat 16-bit buffer" in notes


@pytest.mark.parametrize(("sharding", "grad_accum", "forward_gradients"), [
    ("zero2", 1, 0), ("zero1", 1, 0), ("zero2", 2, 2 * PARAMS // 2), ("zero1", 2, 2 * PARAMS + 2 * 64 * 64)])
def test_zero_gradients_live_from_backward_to_the_step(config_path, capsys, sharding, grad_accum, forward_gradients):
    """ZeRO-1/2 makes its gradients in backward and frees them in the step: none in forward with one micro-batch
    a step, whose second forward the ranks measure at 1,463,296 (the estimate's: 1,459,712); with accumulation
    the 16-bit gradients carry over to the next micro-batch's forward (ZeRO-2: the partition's; ZeRO-1, which
    reduces at the boundary only: all, with the reduce bucket its first hook made). A later backward counts the
    same as the first: under ZeRO-2 the first's partition and the bucket at the activations' worst (its own
    partition comes past the loss). The fp32 gradient partition lives in the step only, beside the 16-bit
    partition and its concatenation."""
    capsys.readouterr()
    assert main(["estimate", "--config", str(config_path), "--batch", "2", "--seq", "16", "--grad-accum",
                 str(grad_accum), "--precision", "bf16-mixed", "--optimizer", "adamw", "--gpus", "2", "--sharding",
                 sharding, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["phase_breakdowns"]["forward"].get("gradients", 0) == forward_gradients
    bucket = 2 * 64 * 64  # the emitted reduce_bucket_size (h x h) in bf16
    unreduced = 2 * PARAMS if sharding == "zero1" else 0
    # ZeRO-1's backward is its larger moment (`parallel.zero1_backward`): with one micro-batch the end of backward
    # (every gradient and the partition, no activations), with two the second's loss beside every gradient.
    partition = 0 if (sharding, grad_accum) == ("zero1", 2) else 2 * PARAMS // 2
    assert report["phase_breakdowns"]["backward"]["gradients"] == unreduced + partition + bucket
    assert report["phase_breakdowns"]["optimizer"]["gradients"] == 2 * (2 * PARAMS // 2) + 4 * PARAMS // 2
    if (sharding, grad_accum) == ("zero2", 1):
        assert report["phases"]["forward"] == 1_459_712


@pytest.mark.parametrize(("sharding", "estimate_peak"), [("zero2", 1_675_008), ("zero1", 1_675_008)])
def test_the_estimate_follows_the_ranks_schedule(config_path, capsys, sharding, estimate_peak):
    """The estimate's peak against the GPU rank's schedule (1,686,528 under both stages: the step, with the 16-bit
    partition, its concatenation and the fp32 gradient): the step's within 1 % (the fp64 norm piece and the
    scalars left out). ZeRO-1's backward is the larger of its two moments, not their sum (it was 1,918,400, in
    backward): the single GPU's worst one, with the gradients alive then, and the end of backward, with every
    16-bit gradient and the partition but no activations."""
    spec, w, layout = _setup(config_path, sharding)
    schedule_peak = peak_allocated_bytes(zero_rank_schedule(spec, w, layout))
    capsys.readouterr()
    assert main(["estimate", "--config", str(config_path), "--batch", "2", "--seq", "16", "--precision", "bf16-mixed",
                 "--optimizer", "adamw", "--gpus", "2", "--sharding", sharding, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (schedule_peak, report["peak_allocated_bytes"]) == (1_686_528, estimate_peak)
    assert report["peak_phase"] == "optimizer"


@pytest.mark.parametrize(("sharding", "schedule_peak", "estimate_peak", "peak_phase"), [
    ("zero2", 1_686_528, 1_675_008, "optimizer"), ("zero1", 1_785_344, 1_778_816, "backward")])
def test_the_estimate_follows_the_ranks_schedule_with_accumulation(config_path, capsys, sharding, schedule_peak,
                                                                   estimate_peak, peak_phase):
    """Two micro-batches a step, against the GPU rank's schedule. ZeRO-2's peak stays the step's (0.7 % below it, as
    with one micro-batch). ZeRO-1's second micro-batch runs its loss beside every 16-bit gradient of the first and
    the bucket: the schedule's peak, 1,785,344; the estimate's backward is 0.4 % below it (`parallel.zero1_backward`:
    that moment, without the partition the boundary's reduction makes once the activations are gone; it was
    1,918,400, 7.5 % above, with both)."""
    spec, w, layout = _setup(config_path, sharding, grad_accum=ACCUM)
    capsys.readouterr()
    assert main(["estimate", "--config", str(config_path), "--batch", "2", "--seq", "16", "--grad-accum", str(ACCUM),
                 "--precision", "bf16-mixed", "--optimizer", "adamw", "--gpus", "2", "--sharding", sharding,
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert peak_allocated_bytes(zero_rank_schedule(spec, w, layout)) == schedule_peak
    assert (report["peak_allocated_bytes"], report["peak_phase"]) == (estimate_peak, peak_phase)


@pytest.fixture(scope="module")
def sgd_traces(config_path, tmp_path_factory) -> Path:
    """ZeRO-2 with SGD (torch.optim's, which DeepSpeed builds by name): one micro-batch a step."""
    spec, w, layout = _setup(config_path, "zero2", optimizer="sgd")
    plan = layout_plan(spec, w, layout, get_gpu("h100"), model_args=("--config", str(config_path)))
    return _traces(start_run(tmp_path_factory, plan, timeout_s=300))


def test_sgd_under_zero2_runs_and_replays_its_schedule(config_path, sgd_traces):
    """The CPU run names torch's AdamW for DeepSpeed's Adam only (torch.optim.SGD takes no `torch_adam`); each rank
    reserves what its own schedule does (one 2 MiB segment), its peak the schedule's plus the scalars it leaves out
    (measured 1,410,048 and 1,401,856 against 1,406,976 and 1,398,784: 3,072 bytes each)."""
    spec, w, layout = _setup(config_path, "zero2", optimizer="sgd")
    for rank in (0, 1):
        schedule = zero_schedule(spec, w, 2, reduce_bucket_numel(spec, w, layout), stage=2, rank=rank, backend="gloo")
        events = load_events(sgd_traces / f"rank{rank}.json")
        assert runs_on_card(events, None) == runs_on_card(schedule, None)
        traced, scheduled = peak_allocated_bytes(events), peak_allocated_bytes(schedule)
        assert 0 <= traced - scheduled <= 8 * 512, (traced, scheduled)
        assert _large(events) == _large(schedule)
