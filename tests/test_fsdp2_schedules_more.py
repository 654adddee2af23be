"""FSDP2 ranks under gradient accumulation and with tied embeddings (`llamem.analytic.schedule_ranks.fsdp2_schedule`)
against what the launch bundle's 2 gloo ranks allocate (`launch.sh --cpu --random-init --max-steps 2 --memory-trace
DIR`, each rank's events from llamem's CPU tracker, replayed by the allocator simulator):

- "tied": TINY with tied embeddings, 2 accumulation steps of batch 2. The root's own unit (the embedding, which is
  the head's weight, and the final norm) is gathered from each forward to the end of its backward; the root's
  pre-backward prefetches the top layer; the tied weight's two gradients are summed out of place and reduced last.
- "untied": TINY, 2 accumulation steps of batch 1: the run of test_parallel_fsdp2.py's "grad-accum 2" case (the
  same bundle, one run a session).

Every micro-batch's backward reduce-scatters (the bundle never turns gradient sync off): the first into the sharded
gradients, the later ones into outputs added to them and let go. `estimate` sizes the CUDA rank (`backend="nccl"`),
which differs from the CPU one in gloo's copy of each reduce-scatter input and in FSDP2's streams.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bundle_runner import TINY, start_run, tiny_config_path  # noqa: E402

from llamem.allocator.replay import load_events, peak_allocated_bytes, runs_on_card, smallest_card  # noqa: E402
from llamem.analytic.schedule_ranks import (ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM, fsdp2_unit_sizes,  # noqa: E402
                                            rank_schedule, rank_schedule_kind)
from llamem.bundle import layout_plan  # noqa: E402
from llamem.cli import main  # noqa: E402
from llamem.gpus import get_gpu  # noqa: E402
from llamem.model import load_model  # noqa: E402
from llamem.parallel import make_layout  # noqa: E402
from llamem.sizing import estimate_report  # noqa: E402
from llamem.workload import build_workload, with_changes  # noqa: E402

FIELDS = {"seq": 16, "precision": "bf16-mixed", "optimizer": "adamw"}
CASES = {"tied": (True, {"batch": 2, "grad_accum": 2}), "untied": (False, {"batch": 1, "grad_accum": 2})}
MiB = 2**20
BIG = 100_000
"""Allocations compared one by one: the reduce-scatter inputs and gloo's copies of them here."""


def _config_path(tmp_path_factory, tied: bool) -> Path:
    """TINY's config.json at the session's path (untied: the other bundle tests' one, so the run is shared)."""
    if not tied:
        return tiny_config_path(tmp_path_factory)
    path = tmp_path_factory.getbasetemp() / "tiny-llama-tied" / "config.json"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({**TINY, "tie_word_embeddings": True}))
    return path


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict:
    """Per case: the model, the workload, the FSDP2 layout and the bundle's run (started together)."""
    out = {}
    for name, (tied, fields) in CASES.items():
        path = _config_path(tmp_path_factory, tied)
        spec = load_model(None, config_path=str(path))
        w = build_workload("train", **{"batch": 2, **FIELDS, **fields})
        # The zero3 bundle runs FSDP2 whichever engine sizes it: the default engine's is the other tests' bundle.
        plan = layout_plan(spec, w, make_layout(spec, w, gpus=2, sharding="zero3"), get_gpu("h100"),
                           model_args=("--config", str(path)))
        layout = make_layout(spec, w, gpus=2, sharding="zero3", engine="fsdp2")
        out[name] = (spec, w, layout, start_run(tmp_path_factory, plan, timeout_s=300))
    return out


def _traces(cases: dict, name: str) -> Path:
    run = cases[name][3].result()
    assert run.stdout.count(" trace ") == 2, run.stdout
    return run.traces


def _step_allocations(path: Path) -> list[int]:
    """A rank's allocations of at least BIG bytes after the wrap (whose whole weights the schedule starts without)."""
    events = json.loads(path.read_text())["events"]
    return [e["size"] for e in events if e["action"] == "alloc" and e["phase"] != "run" and e["size"] >= BIG]


@pytest.mark.parametrize(("name", "count", "sizes"), [("tied", 24, {147_968, 131_584}),
                                                      ("untied", 32, {147_968, 131_584, 131_072})])
def test_ranks_reduce_scatter_as_the_schedule_does(cases, name, count, sizes):
    """Per micro-batch (4: 2 steps of 2) each unit's reduce-scatter input and gloo's copy of it: the layers'
    (147,968: 4 bytes x 36,992), the root's (embedding and final norm) or the head's (131,584), the untied
    embedding's (131,072), in the same order in the schedule and in each rank's trace."""
    spec, w, layout, _run = cases[name]
    expected = [e.size for e in rank_schedule(spec, w, layout, backend="gloo") if e.action == "alloc" and e.size >= BIG]
    assert len(expected) == count and set(expected) == sizes
    for rank in (0, 1):
        assert _step_allocations(_traces(cases, name) / f"rank{rank}.json") == expected


@pytest.mark.parametrize(("name", "schedule_allocated"), [("tied", 1_537_536), ("untied", 1_689_600)])
def test_ranks_reserve_what_the_gloo_schedule_does(cases, name, schedule_allocated):
    """The same smallest card (one 2 MiB segment), the same peak within gloo's timing. Measured on both ranks:
    tied 1,537,024 (-0.03 %), untied 1,691,136 (+0.09 %)."""
    spec, w, layout, _run = cases[name]
    schedule = rank_schedule(spec, w, layout, backend="gloo")
    assert smallest_card(schedule) == (schedule_allocated, 2 * MiB)
    layer = fsdp2_unit_sizes(spec, w, 2)[0]
    late = layer.copy_in_bytes + layer.output_bytes  # gloo's copy let go of after the next unit's all-gather
    for rank in (0, 1):
        traced_allocated, traced_reserved = smallest_card(load_events(_traces(cases, name) / f"rank{rank}.json"))
        assert traced_reserved == 2 * MiB
        assert 0.98 * schedule_allocated <= traced_allocated <= schedule_allocated + late


@pytest.mark.parametrize(("name", "estimated", "cuda_allocated"), [("tied", 1_388_544, 1_389_568),
                                                                   ("untied", 1_572_864, 1_559_552)])
def test_the_estimate_is_the_cuda_ranks_peak(cases, name, estimated, cuda_allocated):
    """`estimate --engine fsdp2` (`parallel.fsdp2_phases`) against the CUDA schedule: tied -0.07 %, untied +0.9 %
    (a rank under torch's fake process group, whose collectives allocate nothing, peaks at 1,389,056 and
    1,561,600). The gloo ranks hold gloo's copy of a reduce-scatter input on top (up to 147,968 bytes)."""
    spec, w, layout, _run = cases[name]
    cuda, cpu = rank_schedule(spec, w, layout), rank_schedule(spec, w, layout, backend="gloo")
    device = estimate_report(spec, w, layout).device
    assert (device.peak_allocated_bytes, peak_allocated_bytes(cuda)) == (estimated, cuda_allocated)
    assert abs(estimated - cuda_allocated) <= 0.02 * cuda_allocated
    rs_inputs = {unit.rs_input_bytes for unit in fsdp2_unit_sizes(spec, w, 2).values()}
    copies = {e.addr for e, after in itertools.pairwise(cpu) if e.action == "alloc" and after.action == "free"
              and after.addr == e.addr and e.size in rs_inputs}
    assert _shape([e for e in cpu if e.addr not in copies]) == _shape(cuda)
    assert {e.stream for e in cuda if e.action == "alloc"} == {0, ALL_GATHER_STREAM, REDUCE_SCATTER_STREAM}
    assert runs_on_card(cuda, None) == 3 * 2 * MiB  # a small-pool segment per stream
    allocated, reserved = smallest_card(cuda)
    assert device.exact_shape_device_bytes - device.non_torch_bytes == estimated + reserved - allocated
    clone = max(rs_inputs)
    for rank in (0, 1):
        peak = peak_allocated_bytes(load_events(_traces(cases, name) / f"rank{rank}.json"))
        assert -0.02 * estimated <= peak - estimated <= clone + 0.02 * estimated


def _shape(events) -> list[tuple[str, int]]:
    sizes = {e.addr: e.size for e in events if e.action == "alloc"}
    return [(e.action, sizes[e.addr]) for e in events]


def test_later_micro_batches_repeat_the_second(cases, monkeypatch):
    """Past two micro-batches a step allocates as its second does, so the schedule replays two: replaying all
    four of a 4-step accumulation gives the same peak, the same smallest card and the same reserved memory."""
    import llamem.analytic.schedule_ranks as schedule_ranks
    from llamem.allocator.replay import SmallestCardSearch, peak_allocated_bytes, runs_on_card

    spec, w, layout, _run = cases["tied"]
    four = with_changes(w, grad_accum=4)
    four_layout = make_layout(spec, four, gpus=2, sharding="zero3", engine="fsdp2")
    capped = rank_schedule(spec, four, four_layout)
    monkeypatch.setattr(schedule_ranks, "FSDP2_MICROBATCHES", 4)
    whole = rank_schedule(spec, four, four_layout)
    assert len(whole) > len(capped)

    def figures(events):
        search = SmallestCardSearch(events)
        search.finish()
        return peak_allocated_bytes(events), search.high, runs_on_card(events, None)

    assert figures(whole) == figures(capped)
    one = with_changes(w, grad_accum=1)
    single = rank_schedule(spec, one, make_layout(spec, one, gpus=2, sharding="zero3", engine="fsdp2"))
    assert len(single) < len(rank_schedule(spec, w, layout))


def test_tied_and_accumulating_ranks_have_their_own_schedule(cases):
    spec, w, layout, _run = cases["tied"]
    assert rank_schedule_kind(spec, w, layout) == "fsdp2"
    chunked = with_changes(w, loss="chunked")
    assert rank_schedule_kind(spec, chunked, make_layout(spec, chunked, gpus=2, sharding="zero3",
                                                         engine="fsdp2")) is None


def test_the_report_names_the_fsdp2_schedule(tmp_path_factory, capsys):
    path = _config_path(tmp_path_factory, tied=True)
    capsys.readouterr()
    assert main(["estimate", "--config", str(path), "--batch", "2", "--seq", "16", "--grad-accum", "2",
                 "--precision", "bf16-mixed", "--optimizer", "adamw", "--gpus", "2", "--sharding", "zero3",
                 "--engine", "fsdp2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["peak_allocated_bytes"] == 1_388_544
    assert "this rank's own allocation schedule (FSDP2's per-unit" in " ".join(report["notes"])
