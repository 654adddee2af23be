"""MemoryMonitor on real tiny Llama training loops under a CpuMemoryTracker: per-phase peaks equal
`llamem trace` of the same workload, the prediction's command reproduces it, a kept loss is one
leak warning naming its line, the log survives SIGKILL, an OOM is dumped and goes on."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llamem.errors import LlamemError  # noqa: E402
from llamem.runtime import CpuMemoryTracker, MemoryMonitor  # noqa: E402
from llamem.runtime.leaks import LeakWarning  # noqa: E402
from llamem.trace.run import trace  # noqa: E402
from llamem.workload import build_workload  # noqa: E402

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
BATCH, SEQ = 2, 32
PHASES = ["forward", "backward", "optimizer"]


def _model_and_optimizer():
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)


def _train(model, optimizer, monitor, steps: int, *, grad_accum: int = 1, keep: list | None = None,
           as_number: bool = False) -> None:
    """The loop `llamem trace` runs for `train`: fp32 weights, bf16 autocast, AdamW foreach, clipping.
    `keep` gets each step's loss: the tensor, or `loss.item()` with `as_number`."""
    for _ in range(steps):
        for _micro in range(grad_accum):
            ids = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss / grad_accum  # the leaked loss
            loss.backward()
            if keep is not None:
                keep.append(loss.item() if as_number else loss)  # a tensor: its storage outlives the step
            del loss, ids
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        monitor.step()


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _line_of(marker: str) -> int:
    source = Path(__file__).read_text().splitlines()
    return next(number for number, line in enumerate(source, 1) if marker in line and "_line_of" not in line)


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_phase_peaks_equal_the_trace(tmp_path, grad_accum):
    model, optimizer = _model_and_optimizer()
    with CpuMemoryTracker() as tracker, MemoryMonitor(model, optimizer, tmp_path / "run.jsonl", tracker=tracker,
                                                      grad_accum=grad_accum) as monitor:
        _train(model, optimizer, monitor, 3, grad_accum=grad_accum)
    expected = build_workload("train", batch=BATCH, seq=SEQ, precision="bf16-mixed", optimizer="adamw", attn="sdpa",
                              grad_accum=grad_accum)
    assert monitor.inferred.workload == expected
    assert monitor.inferred.unknown == ()
    traced = trace(monitor.inferred.spec, expected)
    steady = monitor.records[1]  # step 2: the optimizer state exists since step 1
    assert steady["step"] == 2
    # The tracker counts what the trace counts, and the hooks cut the step where the trace does.
    assert abs(steady["peak_allocated_bytes"] - traced.peak_allocated_bytes) <= 0.01 * traced.peak_allocated_bytes
    assert steady["peak_allocated_bytes"] == traced.peak_allocated_bytes
    assert {p: steady["phases"][p]["peak_allocated_bytes"] for p in PHASES} == \
        {p: traced.phase_peaks[p] for p in PHASES}
    assert [r["step"] for r in monitor.records] == [1, 2, 3]
    assert monitor.records[2]["peak_allocated_bytes"] == steady["peak_allocated_bytes"]


def test_log_lines_and_the_command_that_reproduces_the_prediction(tmp_path, capsys):
    from llamem.cli import main

    model, optimizer = _model_and_optimizer()
    log = tmp_path / "run.jsonl"
    with CpuMemoryTracker() as tracker, MemoryMonitor(model, optimizer, log, tracker=tracker) as monitor:
        _train(model, optimizer, monitor, 2)
    lines = _lines(log)
    assert [line["type"] for line in lines] == ["header", "workload", "step", "step"]
    header, workload, step = lines[0], lines[1], lines[3]
    assert header["source"] == "cpu-tracker" and header["version"] == 1 and header["pid"] == os.getpid()
    assert header["capacity_bytes"] is None
    assert step == monitor.records[1]
    assert (step["batch"], step["seq"]) == (BATCH, SEQ)
    assert set(step["phases"]) == set(PHASES)
    assert step["allocated_bytes"] == step["phases"]["optimizer"]["end_allocated_bytes"] == tracker.live_bytes
    assert step["peak_allocated_bytes"] == max(p["peak_allocated_bytes"] for p in step["phases"].values())
    config_path = tmp_path / "run.config.json"
    assert workload["config_path"] == str(config_path) and config_path.is_file()
    assert workload["command"].startswith(f"llamem estimate --config {config_path} --task train --batch 2 --seq 32 ")
    assert main([*shlex.split(workload["command"])[1:], "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["phases"] == workload["predicted"]
    summary = monitor.summary().splitlines()
    assert summary[0] == "llamem monitor: 2 steps (cpu-tracker), batch 2 x 32 tokens; peak allocated at step 2"
    for row, phase in zip(summary[2:5], PHASES):
        ratio = step["phases"][phase]["peak_allocated_bytes"] / workload["predicted"][phase]
        assert row.split()[0] == phase and row.split()[-1] == f"{ratio:.2f}"
    assert summary[-1] == f"predicted by: {workload['command']}"


def test_a_kept_loss_is_one_leak_warning_naming_its_line(tmp_path):
    model, optimizer = _model_and_optimizer()
    log, kept = tmp_path / "run.jsonl", []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CpuMemoryTracker(record_stacks=True) as tracker, \
                MemoryMonitor(model, optimizer, log, tracker=tracker, leak_window=5) as monitor:
            _train(model, optimizer, monitor, 6, keep=kept)
    leaks = [w for w in caught if issubclass(w.category, LeakWarning)]
    assert len(leaks) == 1
    where = f"{__file__}:{_line_of('# the leaked loss')} in _train"
    assert where in str(leaks[0].message)
    # The line is where the tensor was made (the loss), not the append that keeps it: the text says which.
    assert f"(activations), created at:\n    {where}" in str(leaks[0].message)
    assert "where the tensors were created; what keeps them alive is a reference" in str(leaks[0].message)
    assert "+512 B per step" in str(leaks[0].message)
    [leak] = [line for line in _lines(log) if line["type"] == "leak"]
    assert (leak["step"], leak["steps"], leak["growth_bytes_per_step"], leak["live_growth_bytes"]) == (5, 5, 512, 2048)
    # The losses of steps 2-5 are alive; the most repeated stack comes first.
    assert leak["sources"][0]["count"] == 4 and leak["sources"][0]["bytes"] == 2048
    assert leak["sources"][0]["stack"][-1] == where


def test_loss_item_is_no_leak(tmp_path):
    model, optimizer = _model_and_optimizer()
    log, kept = tmp_path / "run.jsonl", []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CpuMemoryTracker() as tracker, \
                MemoryMonitor(model, optimizer, log, tracker=tracker, leak_window=5) as monitor:
            _train(model, optimizer, monitor, 6, keep=kept, as_number=True)
    assert not [w for w in caught if issubclass(w.category, LeakWarning)]
    assert "leak" not in {line["type"] for line in _lines(log)}
    assert len({r["allocated_bytes"] for r in monitor.records}) == 1  # flat once the optimizer state exists


def _generate(model, prompt: torch.Tensor, new_tokens: int) -> None:
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # past_key_values= is deprecated for cache=; both are read
        model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                       past_key_values=transformers.DynamicCache(config=model.config))


def test_generate_is_one_prefill_and_decode_steps(tmp_path):
    model, _ = _model_and_optimizer()
    model.eval()
    log = tmp_path / "gen.jsonl"
    with CpuMemoryTracker() as tracker, MemoryMonitor(model, None, log, tracker=tracker) as monitor:
        for _ in range(2):
            _generate(model, torch.randint(0, TINY["vocab_size"], (2, 16)), 8)
            monitor.step()
    lines = _lines(log)
    # One workload line: the decode forwards (one token each) neither rewrite it nor change its seq.
    assert [line["type"] for line in lines] == ["header", "workload", "step", "step"]
    workload, step = lines[1], lines[3]
    assert workload["workload"]["task"] == "infer"
    assert (workload["workload"]["batch"], workload["workload"]["seq"], workload["workload"]["new_tokens"]) == (2, 16, 8)
    assert "--seq 16 --precision fp32 --new-tokens 8" in workload["command"]
    assert workload["unknown"] == []
    assert set(workload["predicted"]) == {"load", "prefill", "decode"}
    assert (step["batch"], step["seq"]) == (2, 16)
    assert set(step["phases"]) == {"prefill", "decode"}
    traced = trace(monitor.inferred.spec, monitor.inferred.workload).phase_peaks
    for phase in ("prefill", "decode"):  # generate() keeps a few small tensors more than the trace's loop
        measured = step["phases"][phase]["peak_allocated_bytes"]
        assert 0 <= measured - traced[phase] <= 0.02 * traced[phase]
    assert step["peak_allocated_bytes"] == step["phases"]["prefill"]["peak_allocated_bytes"]
    assert tracker.live_by_category() == {"weights": step["allocated_bytes"]}  # the cache died with generate()
    summary = monitor.summary().splitlines()
    assert summary[0] == "llamem monitor: 2 steps (cpu-tracker), batch 2 x 16 tokens; peak allocated at step 2"
    assert [row.split()[0] for row in summary[2:]] == ["prefill", "decode", "step", "predicted"]


def test_undeclared_gradient_accumulation_is_counted(tmp_path):
    model, optimizer = _model_and_optimizer()
    log = tmp_path / "run.jsonl"
    with CpuMemoryTracker() as tracker, MemoryMonitor(model, optimizer, log, tracker=tracker) as monitor:
        _train(model, optimizer, monitor, 2, grad_accum=4)
    lines = _lines(log)
    # The first forward sizes one micro-batch; the end of step 1 has counted 4 and says so, before its step line.
    assert [line["type"] for line in lines] == ["header", "workload", "workload", "step", "step"]
    assert [line["workload"]["grad_accum"] for line in lines[1:3]] == [1, 4]
    expected = build_workload("train", batch=BATCH, seq=SEQ, precision="bf16-mixed", optimizer="adamw", attn="sdpa",
                              grad_accum=4)
    assert monitor.inferred.workload == expected and lines[2]["unknown"] == []
    assert lines[2]["command"].endswith("--grad-accum 4")
    traced = trace(monitor.inferred.spec, expected)
    steady = monitor.records[1]
    assert {p: steady["phases"][p]["peak_allocated_bytes"] for p in PHASES} == \
        {p: traced.phase_peaks[p] for p in PHASES}
    assert lines[2]["predicted"] == {p: traced.phase_peaks[p] for p in ["load", *PHASES]}


def test_a_given_grad_accum_is_kept_and_what_was_seen_is_noted(tmp_path):
    model, optimizer = _model_and_optimizer()
    log = tmp_path / "run.jsonl"
    with CpuMemoryTracker() as tracker, \
            MemoryMonitor(model, optimizer, log, tracker=tracker, grad_accum=2) as monitor:
        _train(model, optimizer, monitor, 1, grad_accum=4)
    workloads = [line for line in _lines(log) if line["type"] == "workload"]
    assert [w["workload"]["grad_accum"] for w in workloads] == [2, 2]
    note = ("grad_accum: 2 given, but 4 forward passes with gradients were seen per optimizer step "
            "(the prediction uses 2)")
    assert workloads[0]["unknown"] == [] and workloads[1]["unknown"] == [note]
    assert monitor.inferred.unknown == (note,)
    assert f"not read from the run: {note}" in monitor.summary().splitlines()


def test_steps_without_step_calls_name_the_fix(tmp_path):
    model, optimizer = _model_and_optimizer()
    with CpuMemoryTracker() as tracker, MemoryMonitor(model, optimizer, tmp_path / "run.jsonl", tracker=tracker) \
            as monitor:
        for _ in range(2):
            ids = torch.randint(0, TINY["vocab_size"], (BATCH, SEQ))
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    assert monitor.summary() == ("llamem monitor: no step recorded: call monitor.step() after each optimizer step "
                                 "(after each generate() call when generating), or train with LlamemCallback in a "
                                 "transformers Trainer")


def test_a_plain_module_has_no_token_shape(tmp_path):
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(64, 64)

        def forward(self, x):
            return self.linear(x).sum()

    model = Plain()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with CpuMemoryTracker() as tracker, MemoryMonitor(model, optimizer, tmp_path / "run.jsonl", tracker=tracker) \
            as monitor:
        for _ in range(2):
            model(torch.randn(8, 64)).backward()
            optimizer.step()
            optimizer.zero_grad()
            monitor.step()
    assert [(r["batch"], r["seq"]) for r in monitor.records] == [(None, None), (None, None)]
    summary = monitor.summary().splitlines()
    assert summary[0] == ("llamem monitor: 2 steps (cpu-tracker), batch shape unknown (the model's input is neither "
                          "input_ids nor inputs_embeds); peak allocated at step 2")
    assert summary[-1].startswith("no prediction: Plain has no transformers config")


def test_positional_input_ids_and_inputs_embeds_give_the_shape(tmp_path):
    model, optimizer = _model_and_optimizer()
    with CpuMemoryTracker() as tracker, MemoryMonitor(model, optimizer, tmp_path / "run.jsonl", tracker=tracker) \
            as monitor:
        ids = torch.randint(0, TINY["vocab_size"], (3, 8))
        model(ids, labels=ids).loss.backward()  # input_ids, positional
        monitor.step()
        embeds = model.get_input_embeddings()(torch.randint(0, TINY["vocab_size"], (2, 5))).detach()
        model(inputs_embeds=embeds).logits.sum().backward()
        monitor.step()
    assert [(r["batch"], r["seq"]) for r in monitor.records] == [(3, 8), (2, 5)]


CRASH_SCRIPT = """
import sys, torch, transformers
from llamem.runtime import CpuMemoryTracker, MemoryMonitor
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{tiny!r}))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
with CpuMemoryTracker() as tracker, MemoryMonitor(model, optimizer, sys.argv[1], tracker=tracker) as monitor:
    while True:
        ids = torch.randint(0, 512, (2, 32))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        monitor.step()
"""


def test_the_log_survives_sigkill(tmp_path):
    script, log = tmp_path / "train.py", tmp_path / "run.jsonl"
    script.write_text(CRASH_SCRIPT.format(tiny=TINY))
    child = subprocess.Popen([sys.executable, str(script), str(log)], stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300  # a guard against a hung child, not a speed requirement
        while not (log.exists() and log.read_text().count('"type": "step"') >= 3):
            assert child.poll() is None, child.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "no 3 step lines"
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    assert child.returncode == -signal.SIGKILL
    text = log.read_text()
    complete = text.splitlines()[:-1] if not text.endswith("\n") else text.splitlines()
    records = [json.loads(line) for line in complete]  # every complete line parses
    steps = [r["step"] for r in records if r["type"] == "step"]
    assert records[0]["type"] == "header" and len(steps) >= 3
    assert steps == list(range(1, len(steps) + 1))


def test_an_oom_is_dumped_logged_and_raised(tmp_path):
    model, optimizer = _model_and_optimizer()
    weights_bytes = sum((p.numel() * 4 + 511) // 512 * 512 for p in [*model.parameters(), *model.buffers()])
    log, dump = tmp_path / "run.jsonl", tmp_path / "oom"
    with CpuMemoryTracker(weights_bytes + 256 * 1024) as tracker:
        with pytest.raises(torch.OutOfMemoryError, match="^CUDA out of memory"):
            with MemoryMonitor(model, optimizer, log, tracker=tracker, oom_dir=dump) as monitor:
                _train(model, optimizer, monitor, 1)
    oom = _lines(log)[-1]
    assert oom == {"type": "oom", "step": 1, "phase": "forward", "message": oom["message"], "dump_dir": str(dump)}
    assert oom["message"].startswith("CUDA out of memory. Tried to allocate")
    saved = json.loads((dump / "oom.json").read_text())
    assert (saved["step"], saved["phase"], saved["source"]) == (1, "forward", "cpu-tracker")
    assert saved["workload"]["batch"] == BATCH and saved["workload"]["seq"] == SEQ
    assert (dump / "config.json").is_file() and (dump / "snapshot.json").is_file()


def test_the_monitor_keeps_no_reference_to_the_error(tmp_path):
    model, optimizer = _model_and_optimizer()
    weights_bytes = sum((p.numel() * 4 + 511) // 512 * 512 for p in [*model.parameters(), *model.buffers()])
    with CpuMemoryTracker(weights_bytes + 256 * 1024) as tracker:
        try:
            with MemoryMonitor(model, optimizer, tmp_path / "run.jsonl", tracker=tracker, oom_dir=tmp_path / "oom") \
                    as monitor:
                _train(model, optimizer, monitor, 1)
        except torch.OutOfMemoryError:
            pass
        # The error is gone: only the weights are alive (no activation held by a stored traceback).
        assert tracker.live_bytes == weights_bytes


def test_bad_settings_name_the_fix():
    model, optimizer = _model_and_optimizer()
    if not torch.cuda.is_available():
        with pytest.raises(LlamemError, match=r"CpuMemoryTracker\(\)"):
            MemoryMonitor(model, optimizer)
    with CpuMemoryTracker() as tracker:
        with pytest.raises(LlamemError, match="leak_window must be 2 steps or more"):
            MemoryMonitor(model, optimizer, tracker=tracker, leak_window=1)
        with pytest.raises(LlamemError, match=r"grad_accum must be 1 or more \(or None to count it\), got 0"):
            MemoryMonitor(model, optimizer, tracker=tracker, grad_accum=0)
