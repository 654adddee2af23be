"""A DeepSpeed ZeRO-3 rank's own allocation schedule (`llamem.analytic.schedule_zero3`) against what the ranks of the
launch bundle allocate: `bash launch.sh --cpu --random-init --max-steps 2 --memory-trace DIR` of the bundle emitted
with engine "deepspeed" runs a tiny Llama on 2 processes (gloo) and writes each rank's event stream from llamem's CPU
tracker; the allocator simulator replays it into that rank's reserved memory.

The bundle's own ds_config.json exercises what the schedule follows, on the tiny Llama (h = 64): the projections
(2,048 to 32,768 elements) lie above the persistence threshold (10 x h = 640 elements) and are partitioned, the
norms (64) below it stay gathered once the trace is complete; the prefetch bucket (0.9 x h x h = 3,686 elements) is
smaller than most parameters, so each fetch prefetches one or two (k_proj and v_proj, 2,048 each, in one flat
all-gather); the reduce bucket (h x h = 4,096 elements) takes some gradients and not others. The reuse distance
(1e9 elements, DeepSpeed's default) keeps every parameter gathered from forward to backward here: a smaller one is
pinned below without a run.

A second run, started beside it, accumulates two micro-batches a step with every layer checkpointed.

On CPU a rank is the `backend="gloo"` schedule (the fp32 model before the cast, gloo's copy of each reduce-scatter
input, torch's AdamW's temporaries); what `estimate` sizes is the CUDA one (`backend="nccl"`).
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("deepspeed")

from bundle_runner import RUN_ARGS, Launch, PendingRun, config_path  # noqa: E402

from llamem.allocator.replay import load_events, peak_allocated_bytes, runs_on_card, smallest_card  # noqa: E402
from llamem.analytic.common import r512  # noqa: E402
from llamem.analytic.schedule_ranks import rank_schedule, rank_schedule_kind  # noqa: E402
from llamem.analytic.schedule_zero3 import (GATHER_STREAM, REDUCE_STREAM, zero3_config,  # noqa: E402
                                            zero3_rank_schedule, zero3_schedule)
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
"""The tiny Llama's parameters; a rank's flat partition is half of them (every parameter's slice, N divides all)."""
FP32_PARTITION = r512(4 * PARAMS // 2)
"""279,552 bytes: the fp32 master partition, its cast, the zero gradient, the fp32 gradient, each Adam state."""
HALF_PARTITION = r512(PARAMS)
"""139,776 bytes: the flat bf16 partition, the flat gradient partition, the step's concatenation."""
LARGE = 16_384


def _setup(config_path, **changes):
    spec = load_model(None, config_path=str(config_path))
    w = build_workload("train", **{**FIELDS, **changes})
    return spec, w, make_layout(spec, w, gpus=2, sharding="zero3")


def _start(config_path, tmp_path_factory, **changes) -> PendingRun:
    """The DeepSpeed ZeRO-3 bundle's 2-step CPU run with each rank's trace, started (`start_run` emits under engine
    "any", which runs ZeRO-3 with FSDP2: this one is emitted for DeepSpeed)."""
    spec, w, layout = _setup(config_path, **changes)
    plan = layout_plan(spec, w, layout, get_gpu("h100"), model_args=("--config", str(config_path)))
    folder = tmp_path_factory.mktemp("zero3") / "bundle"
    bundle = emit_bundle(plan, folder, engine="deepspeed")
    assert (bundle.strategy, bundle.unsupported) == ("deepspeed", None)
    traces = folder.parent / "traces"
    return PendingRun(folder, Launch(folder, [*RUN_ARGS, "--memory-trace", str(traces)], 300), traces)


ACCUMULATED = {"grad_accum": 2, "ac_every": 1}
"""The second run: two micro-batches a step (4 in the run), every layer checkpointed."""


@pytest.fixture(scope="module")
def zero3_runs(config_path, tmp_path_factory) -> dict[str, PendingRun]:
    """One micro-batch a step, and `ACCUMULATED`, started side by side."""
    return {"plain": _start(config_path, tmp_path_factory), "accumulated": _start(config_path, tmp_path_factory,
                                                                                   **ACCUMULATED)}


def _traces(pending: PendingRun) -> Path:
    run = pending.result()
    assert len(re.findall(r"^rank \d trace ", run.stdout, re.MULTILINE)) == 2, run.stdout
    return run.traces


@pytest.fixture(scope="module")
def zero3_traces(zero3_runs) -> Path:
    return _traces(zero3_runs["plain"])


@pytest.fixture(scope="module")
def accumulated_traces(zero3_runs) -> Path:
    return _traces(zero3_runs["accumulated"])


def _large(events, at_least: int = LARGE) -> list[int]:
    return [e.size for e in events if e.action == "alloc" and e.size >= at_least]


def test_ranks_replay_their_own_schedule(config_path, zero3_traces):
    """Each rank reserves what the schedule does (two 2 MiB segments), on the same smallest card to the search's
    precision; its peak (the second step's fp32 gradient beside AdamW's temporaries) is the schedule's plus the
    scalars it leaves out; every allocation of 16 KiB or more comes in the same order (the gathers of the
    embedding and the head, the flat buffers), and those of 8 KiB or more in the same number (the projections'
    gathers and gradients, in an order of their own within a layer)."""
    spec, w, layout = _setup(config_path)
    schedule = zero3_rank_schedule(spec, w, layout, backend="gloo")
    assert _replays(zero3_traces, schedule) == (1_967_104, 1_970_176)  # the norm's, the clip's and AdamW's scalars
    assert (len(_large(schedule)), len(_large(schedule, 8192))) == (137, 344)


def _replays(traces: Path, schedule) -> tuple[int, int]:
    """Each rank's reserved memory, smallest card and allocations against the schedule's: (the schedule's peak, the
    ranks' peak)."""
    scheduled, scheduled_card = smallest_card(schedule)
    assert scheduled == peak_allocated_bytes(schedule)
    peaks = set()
    for rank in (0, 1):  # every rank allocates alike: each parameter's slice has ceil(numel / N) elements
        events = load_events(traces / f"rank{rank}.json")
        assert runs_on_card(events, None) == runs_on_card(schedule, None) == 4 * MiB
        traced, traced_card = smallest_card(events)
        assert 0 <= traced - scheduled <= 8 * 512
        assert abs(traced_card - scheduled_card) <= traced // 128
        assert _large(events) == _large(schedule)
        assert sorted(_large(events, 8192)) == sorted(_large(schedule, 8192))
        assert sorted(_large(events, 4096)) == sorted(_large(schedule, 4096))
        peaks.add(traced)
    (peak,) = peaks
    return scheduled, peak


def test_accumulating_checkpointed_ranks_replay_their_own_schedule(config_path, accumulated_traces):
    """Two micro-batches a step, every layer checkpointed: the second micro-batch records nothing and gathers along
    the trace the first recorded, the persistent norms still gathered; the gradients reduce-scatter into the flat
    gradient partition in place (added to the first micro-batch's). Each layer's recompute runs in down_proj's
    backward: recording, it gathers the layer's parameters once more (down_proj's is gathered already), and it stops
    inside down_proj with its output made. The peak is the step's, as with one micro-batch. Each alone measured the
    same way (accumulation: 200 allocations of 16 KiB or more, 587 of 8 KiB; checkpointing: 141 and 392)."""
    spec, w, layout = _setup(config_path, **ACCUMULATED)
    schedule = zero3_rank_schedule(spec, w, layout, backend="gloo")
    assert _replays(accumulated_traces, schedule) == (1_967_104, 1_970_688)  # one scalar more: 7 blocks
    assert (len(_large(schedule)), len(_large(schedule, 8192))) == (204, 675)
    four = build_workload("train", **{**FIELDS, **ACCUMULATED, "grad_accum": 4})
    assert schedule == zero3_rank_schedule(spec, four, layout, backend="gloo")  # a middle micro-batch: as the last


def test_the_recompute_gathers_again_while_recording(config_path):
    """Recording, each of a checkpointed layer's 8 parameters but down_proj's is gathered a third time, in the
    recompute (16 more than the 42 of forward and backward); with the trace complete the recompute finds them kept
    since forward, and the gathers are those without checkpointing."""
    spec, w, layout = _setup(config_path)
    _spec, checkpointed, _layout = _setup(config_path, ac_every=1)
    gathers = [[e.size for e in zero3_rank_schedule(spec, workload, layout) if e.action == "alloc"
                and e.stream == GATHER_STREAM] for workload in (w, checkpointed)]
    layer = [512, 8192, 4096, 4096, 8192, 512, 16_384, 16_384]  # the recompute's, in forward order
    assert len(gathers[1]) == len(gathers[0]) + 16 == 42 + 16 + 18
    assert gathers[1][58:] == gathers[0][42:]
    assert gathers[1][23:32] == [16_384, *layer]  # layer 1's backward: down_proj's, then the recompute's


def test_the_run_against_the_estimate(config_path, zero3_traces, capsys):
    """The run's peak against the estimate's plus what only the CPU run allocates (the gloo schedule's peak less the
    nccl one's: the fp32 model on the host, gloo's copies, AdamW's temporaries): 0.5 % below."""
    spec, w, layout = _setup(config_path)
    cpu_only = (peak_allocated_bytes(zero3_rank_schedule(spec, w, layout, backend="gloo"))
                - peak_allocated_bytes(zero3_rank_schedule(spec, w, layout)))
    capsys.readouterr()
    assert main(["estimate", "--config", str(config_path), "--batch", "2", "--seq", "16", "--precision",
                 "bf16-mixed", "--optimizer", "adamw", "--gpus", "2", "--sharding", "zero3", "--engine", "deepspeed",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    run = max(peak_allocated_bytes(load_events(zero3_traces / f"rank{rank}.json")) for rank in (0, 1))
    assert (report["peak_allocated_bytes"], cpu_only, run) == (1_779_008, 181_248, 1_970_176)
    assert "this rank's own allocation schedule (DeepSpeed ZeRO-3's gathered parameters" in " ".join(report["notes"])


def test_cuda_schedule_pinned(config_path):
    """What the estimate sizes: bf16 parameters moved in, no gloo copies, FusedAdam's two states and no
    temporaries; the gathers in the all-gather stream, the bucket's concatenations in the reduce stream, apart
    from the default stream's blocks (three segments)."""
    spec, w, layout = _setup(config_path)
    cuda = rank_schedule(spec, w, layout)
    assert cuda == zero3_rank_schedule(spec, w, layout)
    assert (peak_allocated_bytes(cuda), runs_on_card(cuda, None)) == (1_785_856, 6 * MiB)
    wrap = [HALF_PARTITION] + [FP32_PARTITION] * 3 + [HALF_PARTITION]
    step = [131_072, 131_072, HALF_PARTITION, FP32_PARTITION]  # the fp64 copies of the embedding's and head's slices
    default = [e.size for e in cuda if e.action == "alloc" and e.stream == 0 and e.size >= 100_000]
    assert default == wrap + step + [FP32_PARTITION] * 2 + step
    gathered = [e.size for e in cuda if e.action == "alloc" and e.stream == GATHER_STREAM]
    # Recording, every parameter is gathered in its forward and again in its backward (21 of them). With the
    # trace complete, as the run traced it: the root's, the model's and the embedding's fetches prefetch the
    # embedding, q_proj, k_proj with v_proj (one flat buffer) and o_proj; then each layer's MLP and the next
    # layer's attention, k_proj's and v_proj's concatenations made at k_proj's fetch; the head; nothing in
    # backward (the reuse distance keeps all).
    layer = [8192, 8192, 8192, 16_384, 16_384, 16_384]
    assert len(gathered) == 2 * 21 + 18
    assert gathered[42:] == [65_536, *layer, 8192, 8192, 4096, 4096, *layer[2:], 65_536, 4096, 4096]
    concatenated = [e.size for e in cuda if e.action == "alloc" and e.stream == REDUCE_STREAM]
    assert concatenated and all(size >= 4096 for size in concatenated)


def test_the_reuse_distance_decides_what_backward_gathers_again(config_path):
    """With DeepSpeed's 1e9 elements every parameter of the tiny Llama stays gathered from the second forward to
    its backward. With none (`stage3_max_reuse_distance: 0`), a post-forward hook lets go of a parameter unless a
    prefetch already passed its later use in the trace (`__params_to_release`): the second step gathers the
    embedding again in backward, and layer 1's q_proj, k_proj with v_proj (one flat buffer) and o_proj. The
    bundle run with that setting measured the same: its allocations of 16 KiB or more in the schedule's order,
    those of 4 KiB or more the same 552, the same 4 MiB reserved."""
    spec, w, layout = _setup(config_path)
    config = zero3_config(spec, w, layout)
    assert (config.bucket_numel, config.prefetch_numel, config.persistence_numel) == (4096, 3686, 640)
    kept = zero3_schedule(spec, w, config)
    released = zero3_schedule(spec, w, dataclasses.replace(config, max_reuse_numel=0))
    second = [[e.size for e in events if e.action == "alloc" and e.stream == GATHER_STREAM][42:]
              for events in (kept, released)]
    layer = [8192, 8192, 8192, 16_384, 16_384, 16_384]
    forward = [65_536, *layer, 8192, 8192, 4096, 4096, *layer[2:], 65_536]
    assert second == [forward + [4096, 4096], forward + [8192, 8192, 8192, 65_536] + [4096] * 4]
    assert peak_allocated_bytes(released) == peak_allocated_bytes(kept)  # the step's, either way
    gloo = zero3_schedule(spec, w, dataclasses.replace(config, max_reuse_numel=0), backend="gloo")
    assert (len(_large(gloo)), len(_large(gloo, 4096)), runs_on_card(gloo, None)) == (138, 552, 4 * MiB)


@pytest.mark.parametrize(("changes", "engine", "kind"), [
    ({}, "deepspeed", "zero3"), ({}, "fsdp2", "fsdp2"), ({"grad_accum": 2}, "deepspeed", "zero3"),
    ({"precision": "fp16-mixed"}, "deepspeed", None), ({"ac_every": 1}, "deepspeed", "zero3"),
    ({"ac_every": 2}, "deepspeed", None), ({"ac_every": 1, "ac_mode": "selective"}, "deepspeed", None),
    ({"optimizer": "sgd"}, "deepspeed", None), ({"loss": "chunked"}, "deepspeed", None)])
def test_rank_schedules_cover_the_bundles_bf16_zero3(config_path, changes, engine, kind):
    spec, w, _layout = _setup(config_path, **changes)
    assert rank_schedule_kind(spec, w, make_layout(spec, w, gpus=2, sharding="zero3", engine=engine)) == kind
