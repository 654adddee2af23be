"""The OOM dump and `llamem explain-oom`: a real tiny Llama training step that runs out of memory
under a CpuMemoryTracker, caught by oom_guard, explained end to end (categories with the
tracker's exact bytes, a true shortage, a plan that fits the capacity, checked by running it);
a CUDA-format snapshot whose free blocks could hold the request if packed (fragmentation, and
the allocator setting that completes); hostile dump folders (exit 1, a message, no traceback)."""

from __future__ import annotations

import gc
import json
import pickle
import re
import shlex
import shutil
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llamem.cli import main  # noqa: E402
from llamem.errors import LlamemError  # noqa: E402
from llamem.overhead import non_torch_bytes  # noqa: E402
from llamem.runtime import CpuMemoryTracker, TrackerSource, oom_guard, write_oom_dump  # noqa: E402
from llamem.runtime.explain import STAT_KEYS, stack_category  # noqa: E402
from llamem.runtime.oom import requested_from_message  # noqa: E402
from llamem.runtime.sources import STAT_KEYS as SOURCE_STAT_KEYS  # noqa: E402
from llamem.trace.run import label_by_module  # noqa: E402
from llamem.units import MiB  # noqa: E402

TINY = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2)
BATCH, SEQ = 8, 128
CAPACITY = 14 * MiB + MiB // 2
"""Below a step's peak with the optimizer state (14.52 MiB, in backward), above the first step's
(13.44 MiB, before the state exists)."""
GROUPS = {"weights": "weights", "gradients": "gradients", "optimizer": "optimizer state",
          "activations": "activations", "logits": "logits", "kv_cache": "KV cache"}


def _run(args: list[str], capsys) -> tuple[int, str, str]:
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


class _NoTracker:
    phase = category = ""


def _step(model, optimizer, tracker, batch: int, seq: int, grad_accum: int = 1) -> None:
    """A bf16-autocast training step as a user writes it, with the tracker's phase labels."""
    tracker = tracker or _NoTracker()
    for _ in range(grad_accum):
        tracker.phase, tracker.category = "forward", "activations"
        ids = torch.randint(0, TINY.vocab_size, (batch, seq))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss / grad_accum
        tracker.phase, tracker.category = "backward", "logits"
        loss.backward()
        del loss, ids
    tracker.phase, tracker.category = "optimizer", "temporaries"
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _tiny_model():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(TINY)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)  # the step llamem sizes


@pytest.fixture(scope="module")
def tracker_oom(tmp_path_factory):
    """A first step run before tracking (it makes the optimizer state), then a step under a
    capacity it cannot meet. What the tracker held at the error is read inside the step (its
    frames still alive), before the guard's dump. The guard installs the category hooks."""
    warnings.filterwarnings("ignore")
    directory = tmp_path_factory.mktemp("oom") / "dump"
    model, optimizer = _tiny_model()
    _step(model, optimizer, None, BATCH, SEQ)
    tracker = CpuMemoryTracker(CAPACITY)
    seen: dict = {}
    with tracker:
        tracker.track(model, optimizer)
        seen["between_steps"] = tracker.live_bytes
        guard = oom_guard(directory, model, optimizer, tracker=tracker, batch=BATCH, seq=SEQ, autocast_dtype="bf16",
                          step=1)
        try:
            with guard:
                try:
                    _step(model, optimizer, tracker, BATCH, SEQ)
                except torch.OutOfMemoryError:
                    seen["allocations"] = list(tracker.live.values())
                    seen["live_bytes"] = tracker.live_bytes
                    raise
        except torch.OutOfMemoryError:
            seen["raised"] = True  # handled here, outside the except block the dump was written in
        gc.collect()
        seen["after_error"] = tracker.live_bytes
    seen["path"] = guard.path
    seen["requested_bytes"] = tracker.oom_requested_bytes
    return directory, seen


def test_guard_writes_the_dump_and_reraises(tracker_oom):
    directory, seen = tracker_oom
    assert seen["raised"] and seen["path"] == directory
    assert sorted(p.name for p in directory.iterdir()) == ["config.json", "oom.json", "snapshot.json"]
    record = json.loads((directory / "oom.json").read_text())
    assert {"version", "message", "step", "phase", "source", "capacity_bytes", "device_name", "stats", "model",
            "workload", "command", "unknown", "config_path"} <= set(record)
    assert (record["version"], record["step"], record["phase"], record["source"]) == (1, 1, "backward", "cpu-tracker")
    assert record["capacity_bytes"] == CAPACITY and record["requested_bytes"] == seen["requested_bytes"] == 2 * MiB
    assert record["stats"]["allocated_bytes"] == seen["live_bytes"]
    assert record["workload"]["batch"] == BATCH and record["unknown"] == []
    assert record["config_path"] == str((directory / "config.json").resolve())
    assert json.loads((directory / "config.json").read_text())["hidden_size"] == 64


def test_guard_keeps_no_tensor_of_the_failed_step_alive(tracker_oom):
    _directory, seen = tracker_oom
    # After the error is handled, what is live is what lived between steps: weights and optimizer state.
    assert seen["after_error"] == seen["between_steps"]
    assert seen["after_error"] < seen["live_bytes"]


def _expected_groups(allocations) -> dict[str, int]:
    out: dict[str, int] = {}
    for allocation in allocations:
        group = GROUPS.get(allocation.category.split("/")[0], "other/temporaries")
        out[group] = out.get(group, 0) + allocation.size_bytes
    return out


def test_explain_names_the_tracker_bytes_and_a_shortage(tracker_oom, capsys):
    directory, seen = tracker_oom
    code, out, err = _run(["explain-oom", str(directory), "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    expected = _expected_groups(seen["allocations"])
    assert {name: c["bytes"] for name, c in data["live"]["categories"].items()} == expected
    assert set(expected) == {"weights", "optimizer state", "activations", "logits"}
    assert data["live"]["allocated_bytes"] == seen["live_bytes"] == sum(expected.values())
    assert data["live"]["cached_free_bytes"] == 0
    assert data["requested_bytes"] == 2 * MiB and data["requested_from"] == "the tracker"
    verdict = data["verdict"]
    assert verdict["kind"] == "shortage" and verdict["capacity_bytes"] == CAPACITY
    assert verdict["shortfall_bytes"] == seen["live_bytes"] + 2 * MiB - CAPACITY
    code, text, _err = _run(["explain-oom", str(directory)], capsys)
    assert code == 0
    for name, size in expected.items():
        assert any(line.strip().startswith(name + " ") and f" {size:,} " in line for line in text.splitlines()), name
    assert "a true shortage of" in text and f"({verdict['shortfall_bytes']:,} B)" in text
    assert "fragmentation did not apply" in text
    assert "optimizer/exp_avg" in text and "weights/autocast_copies" in text


def test_explain_plans_a_workload_that_fits_the_capacity(tracker_oom, capsys):
    directory, _seen = tracker_oom
    code, out, _err = _run(["explain-oom", str(directory), "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    plan = data["plan"]
    budget = CAPACITY + non_torch_bytes(1)
    assert data["plan_budget_bytes"] == budget and plan["fits"]
    assert plan["final"]["peak_device_bytes"] <= budget
    assert plan["final"]["peak_device_bytes"] - non_torch_bytes(1) <= CAPACITY
    final = plan["final"]["config"]["workload"]
    assert (final["batch"], final["grad_accum"], final["ac_every"]) == (4, 2, 0)
    command = shlex.split(data["plan_command"])
    assert command[:4] == ["llamem", "plan", "--config", str(directory / "config.json")]
    assert command[4:6] == ["--budget", "414.5MiB"]
    code, copied, _err = _run([*command[1:], "--json"], capsys)
    assert code == 0 and json.loads(copied)["final"] == plan["final"]


def test_the_planned_workload_runs_under_the_same_capacity(tracker_oom):
    """The plan's micro-batch 4 x 2 accumulation steps, run for real under the capacity that failed."""
    model, optimizer = _tiny_model()
    tracker = CpuMemoryTracker(CAPACITY)
    label_by_module(model, tracker)
    _step(model, optimizer, None, 4, SEQ, grad_accum=2)
    with tracker:
        tracker.track(model, optimizer)
        _step(model, optimizer, tracker, 4, SEQ, grad_accum=2)
    assert tracker.num_ooms == 0 and tracker.peak_bytes <= CAPACITY


def test_explain_text_prints_the_plan_and_the_command(tracker_oom, capsys):
    directory, _seen = tracker_oom
    code, text, _err = _run(["explain-oom", str(directory)], capsys)
    assert code == 0
    assert "workload read from the live objects: train, batch 8 x seq 128, bf16-mixed, adamw" in text
    assert "micro-batch 4 x 2 accumulation steps" in text and "fits:" in text
    assert f"copy: llamem plan --config {directory / 'config.json'} --budget 414.5MiB --task train --batch 8" in text


def test_write_oom_dump_without_a_model(tmp_path):
    with CpuMemoryTracker(4096) as tracker:
        kept = torch.zeros(512)  # 2 KiB
        try:
            torch.zeros(1024)
        except torch.OutOfMemoryError as error:
            path = write_oom_dump(tmp_path / "d", source=TrackerSource(tracker), inferred=None, error=error, step=3)
    del kept
    record = json.loads((path / "oom.json").read_text())
    assert (record["workload"], record["config_path"], record["requested_bytes"]) == (None, None, 4096)
    assert not (path / "config.json").exists()


def test_explain_without_a_workload_says_so(tmp_path, capsys):
    with CpuMemoryTracker(4096) as tracker:
        kept = torch.zeros(512)
        try:
            torch.zeros(1024)
        except torch.OutOfMemoryError as error:
            write_oom_dump(tmp_path, source=TrackerSource(tracker), inferred=None, error=error)
    del kept
    code, text, _err = _run(["explain-oom", str(tmp_path)], capsys)
    assert code == 0
    assert "temporaries" in text and "2,048" in text
    assert "a true shortage of 2.00 KiB (2,048 B)" in text
    assert "plan: none (no model was given to read the workload from)" in text


def test_stat_keys_match_the_sources():
    assert STAT_KEYS == SOURCE_STAT_KEYS


# A CUDA-format snapshot -------------------------------------------------------------------------
S0, S1 = 0x7F0000000000, 0x7F0000200000
OPTIM = [{"filename": "/env/lib/python3.11/site-packages/torch/optim/adamw.py", "line": 100, "name": "_init_group"},
         {"filename": "train.py", "line": 40, "name": "main"}]
FORWARD = [{"filename": "/env/site-packages/transformers/models/llama/modeling_llama.py", "line": 200,
            "name": "forward"}]
BACKWARD = [{"filename": "/env/site-packages/torch/autograd/graph.py", "line": 800, "name": "_engine_run_backward"},
            {"filename": "/env/site-packages/torch/_tensor.py", "line": 600, "name": "backward"}]
KIB = 1024


def _cuda_snapshot(*, frames: bool = True, trace: bool = True, request: int = 100 * MiB) -> dict:
    """A 100 MiB block freed, then split by an 8 MiB optimizer state; a small segment of three
    blocks; then 100 MiB refused with 48 MiB free on the device: 9.25 MiB live + 100 MiB fits the
    150 MiB cudaMalloc could get, but the cached 92 MiB is one block too small."""
    f = (lambda stack: stack) if frames else (lambda stack: [])
    entries = [{"action": "segment_alloc", "addr": S1, "size": 100 * MiB, "stream": 0},
               {"action": "alloc", "addr": S1, "size": 100 * MiB, "stream": 0},
               {"action": "free_requested", "addr": S1, "size": 100 * MiB, "stream": 0},
               {"action": "free_completed", "addr": S1, "size": 100 * MiB, "stream": 0},
               {"action": "alloc", "addr": S1, "size": 8 * MiB, "stream": 0, "frames": f(OPTIM)},
               {"action": "segment_alloc", "addr": S0, "size": 2 * MiB, "stream": 0},
               {"action": "alloc", "addr": S0, "size": 512 * KIB, "stream": 0},
               {"action": "alloc", "addr": S0 + 512 * KIB, "size": 256 * KIB, "stream": 0},
               {"action": "alloc", "addr": S0 + 768 * KIB, "size": 512 * KIB, "stream": 0},
               {"action": "oom", "addr": 48 * MiB, "size": request, "stream": 0, "device_free": 48 * MiB}]
    small = [(S0, 512 * KIB, "active_allocated", f(FORWARD)), (S0 + 512 * KIB, 256 * KIB, "active_allocated",
                                                               f(BACKWARD)),
             (S0 + 768 * KIB, 512 * KIB, "active_allocated", []), (S0 + 1280 * KIB, 768 * KIB, "inactive", [])]
    large = [(S1, 8 * MiB, "active_allocated", f(OPTIM)), (S1 + 8 * MiB, 92 * MiB, "inactive", [])]

    def segment(address, total, kind, blocks):
        return {"device": 0, "address": address, "total_size": total, "stream": 0, "segment_type": kind,
                "is_expandable": False, "frames": [],
                "blocks": [{"address": a, "size": s, "requested_size": s if state != "inactive" else 0,
                            "state": state, "frames": fr} for a, s, state, fr in blocks]}

    return {"segments": [segment(S0, 2 * MiB, "small", small), segment(S1, 100 * MiB, "large", large)],
            "device_traces": [entries if trace else []]}


def _cuda_record(request: int = 100 * MiB) -> dict:
    stats = dict.fromkeys(STAT_KEYS)
    stats |= {"allocated_bytes": 9 * MiB + 256 * KIB, "reserved_bytes": 102 * MiB, "num_ooms": 1,
              "nvml_used_bytes": 102 * MiB + 512 * KIB, "non_torch_bytes": 512 * KIB,
              "capacity_bytes": 150 * MiB + 512 * KIB}
    message = (f"CUDA out of memory. Tried to allocate {request / MiB:.2f} MiB. GPU 0 has a total capacity of "
               "150.50 MiB of which 48.00 MiB is free. See documentation for Memory Management "
               "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
    return {"version": 1, "message": message, "step": 7, "phase": "forward", "source": "cuda",
            "capacity_bytes": 150 * MiB + 512 * KIB, "device_name": "NVIDIA H100 80GB HBM3", "stats": stats,
            "model": None, "workload": None, "command": "", "unknown": [], "config_path": None}


def _write_cuda_dump(directory, snapshot: dict, record: dict | None = None):
    directory.mkdir(exist_ok=True)
    (directory / "snapshot.json").write_text(json.dumps(snapshot))
    (directory / "oom.json").write_text(json.dumps(record or _cuda_record()))
    return directory


def test_cuda_snapshot_is_explained_as_fragmentation(tmp_path, capsys):
    directory = _write_cuda_dump(tmp_path / "cuda", _cuda_snapshot())
    code, out, err = _run(["explain-oom", str(directory), "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert {name: c["bytes"] for name, c in data["live"]["categories"].items()} == {
        "gradients": 256 * KIB, "optimizer state": 8 * MiB, "activations": 512 * KIB, "unclassified": 512 * KIB}
    assert (data["live"]["allocated_bytes"], data["live"]["reserved_bytes"]) == (9 * MiB + 256 * KIB, 102 * MiB)
    assert data["live"]["cached_free_bytes"] == 92 * MiB + 768 * KIB
    assert (data["requested_bytes"], data["requested_from"]) == (100 * MiB, "the snapshot's oom entry")
    verdict = data["verdict"]
    assert verdict["kind"] == "fragmentation"
    assert (verdict["capacity_bytes"], verdict["needed_bytes"]) == (150 * MiB, 109 * MiB + 256 * KIB)
    assert verdict["replay"]["completes"] is False  # the simulator runs out where torch did
    assert [a["setting"] for a in verdict["advice"]] == ["expandable_segments:True", "max_split_size_mb:64"]
    assert all(a["completes"] and a["peak_reserved_bytes"] <= 150 * MiB for a in verdict["advice"])
    code, text, _err = _run(["explain-oom", str(directory)], capsys)
    assert code == 0
    assert "verdict: fragmentation" in text and "approximately" in text
    assert "allocator advice: best: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True completes" in text
    assert "cached but free        92.75 MiB" in text


def test_cuda_snapshot_without_stacks_is_not_split(tmp_path, capsys):
    directory = _write_cuda_dump(tmp_path / "cuda", _cuda_snapshot(frames=False))
    code, out, _err = _run(["explain-oom", str(directory), "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert {name: c["bytes"] for name, c in data["live"]["categories"].items()} == {"unclassified": 9 * MiB + 256 * KIB}
    assert data["live"]["classified_by"].startswith("none: the snapshot's blocks carry no allocation stacks")
    code, text, _err = _run(["explain-oom", str(directory)], capsys)
    assert code == 0
    assert "no split into categories is made" in text


def test_cuda_snapshot_without_history_replays_the_request(tmp_path, capsys):
    """No trace entries: the state comes from the segments, the request from the message, and the
    capacity from the card less NVML's memory outside PyTorch."""
    directory = _write_cuda_dump(tmp_path / "cuda", _cuda_snapshot(trace=False))
    code, out, _err = _run(["explain-oom", str(directory), "--json"], capsys)
    assert code == 0
    verdict = json.loads(out)["verdict"]
    assert json.loads(out)["requested_from"] == "the error message (2 decimals)"
    assert (verdict["kind"], verdict["capacity_bytes"]) == ("fragmentation", 150 * MiB)
    assert verdict["replay"]["completes"] is False and verdict["advice"]


def test_cuda_true_shortage(tmp_path, capsys):
    directory = _write_cuda_dump(tmp_path / "cuda", _cuda_snapshot(request=148 * MiB), _cuda_record(148 * MiB))
    code, out, _err = _run(["explain-oom", str(directory), "--json"], capsys)
    assert code == 0
    verdict = json.loads(out)["verdict"]
    assert verdict["kind"] == "shortage"
    assert verdict["shortfall_bytes"] == 9 * MiB + 256 * KIB + 148 * MiB - 150 * MiB


def test_cuda_snapshot_that_json_cannot_hold_is_pickled(tmp_path, capsys):
    class Source:  # a memory source as the monitor's would be for a CUDA device (duck-typed)
        kind = "cuda"

        def stats(self):
            return _cuda_record()["stats"]

        def snapshot(self):
            data = _cuda_snapshot()
            data["device_traces"][0][0]["user_metadata"] = b"\x00"  # bytes: no JSON form
            return data

    path = write_oom_dump(tmp_path / "d", source=Source(), inferred=None, error=_cuda_record()["message"],
                          device_name="NVIDIA H100 80GB HBM3")
    assert sorted(p.name for p in path.iterdir()) == ["oom.json", "snapshot.pickle"]
    assert pickle.loads((path / "snapshot.pickle").read_bytes())["segments"][1]["total_size"] == 100 * MiB
    code, out, _err = _run(["explain-oom", str(path), "--json"], capsys)
    assert code == 0 and json.loads(out)["verdict"]["kind"] == "fragmentation"


def test_stack_rules():
    assert stack_category([]) == "unclassified"
    assert stack_category(OPTIM) == "optimizer state"
    assert stack_category(BACKWARD + FORWARD) == "gradients"
    assert stack_category(FORWARD) == "activations"
    assert stack_category([{"filename": "C:\\env\\transformers\\cache_utils.py", "name": "update"}]) == "KV cache"
    assert stack_category([{"filename": "x/transformers/loss/loss_utils.py", "name": "ForCausalLMLoss"}]) == "logits"
    assert stack_category([{"filename": "train.py", "name": "main"}]) == "other/temporaries"


# Hostile dump folders ---------------------------------------------------------------------------
def _good_tracker_dump(directory):
    with CpuMemoryTracker(4096) as tracker:
        kept = torch.zeros(512)
        try:
            torch.zeros(1024)
        except torch.OutOfMemoryError as error:
            write_oom_dump(directory, source=TrackerSource(tracker), inferred=None, error=error)
    del kept
    return directory


def _edit(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


BAD_RECORDS = {
    "version 2": (lambda r: r.update(version=2), "'version' must be 1"),
    "capacity as text": (lambda r: r.update(capacity_bytes="12GiB"), "'capacity_bytes' must be a byte count"),
    "capacity huge": (lambda r: r.update(capacity_bytes=10**30), "'capacity_bytes' must be a byte count"),
    "negative step": (lambda r: r.update(step=-1), "'step' must be a step number"),
    "boolean request": (lambda r: r.update(requested_bytes=True), "'requested_bytes' must be a byte count"),
    "stats a list": (lambda r: r.update(stats=[1, 2]), "'stats' must be an object"),
    "stat huge": (lambda r: r["stats"].update(allocated_bytes=2**70), "'stats'.allocated_bytes must be"),
    "unknown source": (lambda r: r.update(source="tpu"), "'source' must be 'cuda' or 'cpu-tracker'"),
    "message missing": (lambda r: r.pop("message"), "'message' must be a string"),
    "unknown not a list": (lambda r: r.update(unknown="x"), "'unknown' must be a list of strings"),
    "workload strange": (lambda r: r.update(workload={"batch": 1, "flavour": 2}), "fields llamem does not know"),
    "workload bad batch": (lambda r: r.update(workload={"task": "train", "batch": "8"}), "--batch must be an integer"),
}


@pytest.mark.parametrize("case", sorted(BAD_RECORDS))
def test_malformed_oom_json_exits_1_with_a_message(case, tmp_path, capsys):
    directory = _good_tracker_dump(tmp_path / "d")
    change, expected = BAD_RECORDS[case]
    _edit(directory / "oom.json", change)
    if case.startswith("workload"):
        _edit(directory / "oom.json", lambda r: r.update(capacity_bytes=4096))
    code, _out, err = _run(["explain-oom", str(directory)], capsys)
    assert code == 1 and err.startswith("error: ") and expected in err, err
    assert "Traceback" not in err and "internal error" not in err


BAD_FOLDERS = {
    "missing": (lambda d: None, "does not exist"),
    "a file": (lambda d: d.write_text("x"), "is a file"),
    "empty": (lambda d: d.mkdir(), "no oom.json in this folder"),
    "empty oom.json": (lambda d: (d.mkdir(), (d / "oom.json").write_text("")), "not valid JSON"),
    "truncated oom.json": (lambda d: (_good_tracker_dump(d), (d / "oom.json").write_text(
        (d / "oom.json").read_text()[:40])), "not valid JSON"),
    "oom.json a list": (lambda d: (d.mkdir(), (d / "oom.json").write_text("[1]")), "must be an object"),
    "no snapshot": (lambda d: (_good_tracker_dump(d), (d / "snapshot.json").unlink()), "no snapshot.json"),
    "truncated snapshot": (lambda d: (_good_tracker_dump(d), (d / "snapshot.json").write_text(
        (d / "snapshot.json").read_text()[:30])), "neither a pickled snapshot nor JSON"),
    "garbage pickle": (lambda d: (_good_tracker_dump(d), (d / "snapshot.json").unlink(),
                                  (d / "snapshot.pickle").write_bytes(b"\x80\x04garbage")), "not a readable pickle"),
    "tracker snapshot without live": (lambda d: (_good_tracker_dump(d), _edit(d / "snapshot.json",
                                                                                lambda s: s.pop("live"))),
                                      "'live' list"),
    "live size text": (lambda d: (_good_tracker_dump(d), _edit(d / "snapshot.json",
                                                               lambda s: s["live"][0].update(size="2KiB"))),
                       "live[0].size must be a byte count"),
    "cuda snapshot bad block": (lambda d: _write_cuda_dump(d, {**_cuda_snapshot(), "segments": [{"address": 1}]}),
                                "missing 'total_size'"),
    "cuda segment huge": (lambda d: _write_cuda_dump(d, {**_cuda_snapshot(), "segments": [
        {"address": 0, "total_size": 10**30, "blocks": []}]}), "the segments' total size must be a byte count"),
}


@pytest.mark.parametrize("case", sorted(BAD_FOLDERS))
def test_hostile_dump_folders_exit_1(case, tmp_path, capsys):
    directory = tmp_path / "d"
    make, expected = BAD_FOLDERS[case]
    make(directory)
    code, out, err = _run(["explain-oom", str(directory)], capsys)
    assert code == 1 and expected in err, err
    assert "Traceback" not in err and "internal error" not in err
    code, out, _err = _run(["explain-oom", str(directory), "--json"], capsys)
    assert code == 1 and json.loads(out)["error"]["exit_code"] == 1


def test_reading_a_dump_needs_no_torch(tmp_path):
    directory = _write_cuda_dump(tmp_path / "cuda", _cuda_snapshot())
    code = ("import sys, llamem.cli; llamem.cli.main(['explain-oom', sys.argv[1], '--json']); "
            "print('torch' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code, str(directory)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "False"


def test_guard_passes_other_errors_through(tmp_path):
    model, optimizer = _tiny_model()
    with CpuMemoryTracker() as tracker, pytest.raises(ValueError, match="not memory"), \
            oom_guard(tmp_path / "d", model, optimizer, tracker=tracker) as guard:
        raise ValueError("not memory")
    assert guard.path is None and not (tmp_path / "d").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the guard reads the GPU")
def test_guard_without_a_tracker_or_cuda_fails_before_the_step(tmp_path):
    model, optimizer = _tiny_model()
    fix = "no CUDA device: on a CPU, run inside `with CpuMemoryTracker() as tracker:` and pass tracker=tracker"
    with pytest.raises(LlamemError, match="^" + re.escape("oom_guard: " + fix)), \
            oom_guard(tmp_path / "d", model, optimizer):
        pass
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())


# A forward OOM under the guard alone, labelled by the guard's hooks ------------------------------
FORWARD_CAPACITY = 10 * MiB
"""Above the live bytes where the head starts making logits (7.94 MiB at batch 8 x 128), below the
forward's peak (12.95 MiB): the error is raised in the head, after the decoder's activations."""


@pytest.fixture(scope="module")
def forward_oom(tmp_path_factory):
    """An autocast step as a user writes it, no labels set by hand: the guard's hooks set them."""
    directory = tmp_path_factory.mktemp("oom") / "forward"
    model, optimizer = _tiny_model()
    seen: dict = {}
    with CpuMemoryTracker(FORWARD_CAPACITY) as tracker:
        tracker.track(model)
        seen["labels"] = (tracker.phase, tracker.category)
        guard = oom_guard(directory, model, optimizer, tracker=tracker, batch=BATCH, seq=SEQ, autocast_dtype="bf16")
        try:
            with guard:
                seen["hooked"] = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
                ids = torch.randint(0, TINY.vocab_size, (BATCH, SEQ))
                try:
                    with torch.autocast("cpu", dtype=torch.bfloat16):
                        model(input_ids=ids, labels=ids).loss.backward()
                except torch.OutOfMemoryError:
                    seen["by_category"] = tracker.live_by_category()
                    raise
        except torch.OutOfMemoryError:
            seen["raised"] = True
        seen["after"] = (tracker.phase, tracker.category, list(tracker.stack))
    seen["hooks_left"] = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    return directory, seen


def test_guard_labels_activations_and_logits_of_a_forward_oom(forward_oom, capsys):
    directory, seen = forward_oom
    assert seen["raised"]
    record = json.loads((directory / "oom.json").read_text())
    assert record["phase"] == "forward"
    code, out, err = _run(["explain-oom", str(directory), "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    categories = {name: c["bytes"] for name, c in data["live"]["categories"].items()}
    assert categories["activations"] > 0 and categories["logits"] > 0
    assert categories == _expected_groups(
        [type("A", (), {"category": c, "size_bytes": b}) for c, b in seen["by_category"].items()])
    assert categories["activations"] + categories["logits"] > 0.85 * data["live"]["allocated_bytes"]
    code, text, _err = _run(["explain-oom", str(directory)], capsys)
    assert code == 0 and text.startswith("out of memory at phase forward on ")
    assert any(line.strip().startswith("logits ") for line in text.splitlines())


def test_guard_removes_its_hooks_and_restores_the_labels(forward_oom):
    _directory, seen = forward_oom
    assert seen["hooked"] > 0 and seen["hooks_left"] == 0
    assert seen["after"] == (*seen["labels"], [])


def test_guard_records_the_backward_phase_without_labels_set_by_hand(tmp_path):
    """Capacity between the forward's peak (12.95 MiB) and the backward's (13.44 MiB, no optimizer
    state yet): the hook on the loss's autograd node names the phase."""
    model, optimizer = _tiny_model()
    with CpuMemoryTracker(13 * MiB + MiB // 4) as tracker:
        tracker.track(model)
        ids = torch.randint(0, TINY.vocab_size, (BATCH, SEQ))
        with pytest.raises(torch.OutOfMemoryError), oom_guard(tmp_path / "d", model, optimizer, tracker=tracker,
                                                               batch=BATCH, seq=SEQ, autocast_dtype="bf16"):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
    assert json.loads((tmp_path / "d" / "oom.json").read_text())["phase"] == "backward"



def test_guard_labels_each_phase_of_a_step(tmp_path):
    """No error: the phases the tracker's allocations were made in, as the hooks set them."""
    model, optimizer = _tiny_model()
    with CpuMemoryTracker() as tracker:
        tracker.track(model)
        with oom_guard(tmp_path / "d", model, optimizer, tracker=tracker) as guard:
            ids = torch.randint(0, TINY.vocab_size, (2, 16))
            model(input_ids=ids, labels=ids).loss.backward()
            after_backward = guard.phase
            optimizer.step()
            optimizer.zero_grad()
    allocated = {(phase, category) for action, _id, _size, phase, category in tracker.events if action == "alloc"}
    assert after_backward == "optimizer"
    assert {("forward", "activations"), ("forward", "logits"), ("backward", "logits"), ("backward", "temporaries"),
            ("optimizer", "temporaries")} <= allocated
    assert {phase for phase, _category in allocated} == {"run", "forward", "backward", "optimizer"}
    assert not (tmp_path / "d").exists()


# Moved, copied and config-less dumps --------------------------------------------------------------
def _guarded_dump(directory):
    """A real dump of the tiny model's workload: a 16 MiB request refused under the guard."""
    model, optimizer = _tiny_model()
    with CpuMemoryTracker(CAPACITY) as tracker:
        kept = torch.zeros(1024)
        with pytest.raises(torch.OutOfMemoryError), oom_guard(directory, model, optimizer, tracker=tracker,
                                                               batch=BATCH, seq=SEQ, autocast_dtype="bf16"):
            torch.zeros(4 * MiB)
    del kept
    return directory


def _commands(text: str) -> list[list[str]]:
    return [shlex.split(line.split(": ", 1)[1]) for line in text.splitlines()
            if line.strip().startswith(("estimate:", "reproduce:", "copy:"))]


def test_a_moved_dump_prints_commands_with_its_own_config(tmp_path, capsys):
    original = _guarded_dump(tmp_path / "dump")
    moved = tmp_path / "moved"
    shutil.copytree(original, moved)
    original.rename(tmp_path / "x")
    code, text, err = _run(["explain-oom", str(moved)], capsys)
    assert code == 0, err
    commands = _commands(text)
    assert [c[:2] for c in commands] == [["llamem", "estimate"], ["llamem", "estimate"], ["llamem", "plan"]]
    for command in commands:
        assert command[command.index("--config") + 1] == str(moved / "config.json")
    code, out, _err = _run(["explain-oom", str(moved), "--json"], capsys)
    data = json.loads(out)
    assert shlex.split(data["estimate_command"])[2:4] == ["--config", str(moved / "config.json")]
    assert shlex.split(data["plan_command"])[2:4] == ["--config", str(moved / "config.json")]
    assert code == 0 and data["estimate_problem"] is None


def test_a_dump_without_config_json_uses_the_recorded_one(tmp_path, capsys):
    directory = _guarded_dump(tmp_path / "dump")
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    (copy / "config.json").unlink()
    code, out, err = _run(["explain-oom", str(copy), "--json"], capsys)
    assert code == 0, err
    data = json.loads(out)
    assert data["plan"]["fits"] and data["plan_problem"] is None
    recorded = str((directory / "config.json").resolve())
    assert shlex.split(data["plan_command"])[2:4] == ["--config", recorded]
    assert shlex.split(data["estimate_command"])[2:4] == ["--config", recorded]


def test_a_dump_with_no_config_left_explains_all_but_the_plan(tmp_path, capsys):
    directory = _guarded_dump(tmp_path / "dump")
    (directory / "config.json").unlink()
    code, text, err = _run(["explain-oom", str(directory)], capsys)
    assert code == 0, err
    assert "live at the error:" in text and "verdict: a true shortage of" in text
    assert "workload read from the live objects: train, batch 8 x seq 128, bf16-mixed, adamw" in text
    why = (f"no config to size the model: {directory} holds no config.json and the "
           f"{(directory / 'config.json').resolve()} it was written with no longer exists; copy the model's "
           f"config.json into {directory} and run llamem explain-oom again")
    assert f"plan: none ({why})" in text.splitlines()
    assert f"  estimate: omitted ({why})" in text.splitlines()
    assert "copy:" not in text and "llamem estimate" not in text
    code, out, _err = _run(["explain-oom", str(directory), "--json"], capsys)
    data = json.loads(out)
    assert code == 0 and data["plan"] is None and data["plan_problem"] == why
    assert (data["estimate_command"], data["estimate_problem"]) == ("", why)


# Sizes in the OOM message, as c10's format_size writes them -----------------------------------------
def test_tracker_message_sizes_read_as_torch_writes_them():
    with CpuMemoryTracker(1024) as tracker:
        kept = torch.zeros(100)  # 400 B, counted as 512
        with pytest.raises(torch.OutOfMemoryError) as error:
            torch.zeros(200)  # 800 B, counted as 1024
        assert str(error.value).startswith(
            "CUDA out of memory. Tried to allocate 1024 bytes. GPU 0 has a total capacity of 1024 bytes of which "
            "512 bytes is free. Of the allocated memory 512 bytes is allocated by PyTorch, and 0 bytes is reserved "
            "by PyTorch but unallocated. (Raised by llamem's CpuMemoryTracker")
        assert requested_from_message(str(error.value)) == tracker.oom_requested_bytes == 1024
    del kept
    with CpuMemoryTracker(3 * MiB) as tracker, pytest.raises(torch.OutOfMemoryError) as error:
        torch.zeros(1025 // 4 * 4)
        torch.zeros(MiB)  # 4 MiB
    assert str(error.value).startswith("CUDA out of memory. Tried to allocate 4.00 MiB. GPU 0 has a total capacity "
                                       "of 3.00 MiB of which 3.00 MiB is free.")


@pytest.mark.parametrize(("message", "expected"), [
    ("CUDA out of memory. Tried to allocate 512 bytes. GPU 0", 512),
    ("CUDA out of memory. Tried to allocate 1024 bytes.", 1024),
    ("CUDA out of memory. Tried to allocate 1.50 KiB. GPU 0", 1536),
    ("CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0", 20 * MiB),
    ("CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0", 5 * 2**29),
    ("CUDA out of memory. Tried to allocate 512 B. GPU 0", 512),
    ("CUDA out of memory. GPU 0 has a total capacity of 80.00 GiB", None),
])
def test_requested_from_message(message, expected):
    assert requested_from_message(message) == expected
