"""LlamemCallback in a real transformers Trainer (tiny Llama, CPU), and `llamem monitor` attaching
it to an unmodified training script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llamem.runtime import CpuMemoryTracker, LlamemCallback  # noqa: E402

TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2)
PHASES = {"forward", "backward", "optimizer"}
TRAIN_SCRIPT = """
import sys, torch, transformers
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{tiny!r}))
rows = [{{"input_ids": ids, "labels": ids}} for ids in torch.randint(0, 512, (8, 32))]
args = transformers.TrainingArguments(output_dir=sys.argv[1], use_cpu=True, max_steps=2, per_device_train_batch_size=2,
                                      report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True)
transformers.Trainer(model=model, args=args, train_dataset=rows).train()
"""


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _trainer(tmp_path: Path, callback: LlamemCallback, *, max_steps: int = 3, grad_accum: int = 1):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY))
    rows = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, TINY["vocab_size"], (8, 32))]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, max_steps=max_steps,
                                          per_device_train_batch_size=2, gradient_accumulation_steps=grad_accum,
                                          report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True)
    return transformers.Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback])


def test_trainer_steps_are_logged_with_their_phases(tmp_path):
    log = tmp_path / "run.jsonl"
    with CpuMemoryTracker() as tracker:
        callback = LlamemCallback(log_path=log, tracker=tracker)
        trainer = _trainer(tmp_path, callback)
        with callback.guard():
            trainer.train()
    lines = _lines(log)
    steps = [line for line in lines if line["type"] == "step"]
    [workload] = [line for line in lines if line["type"] == "workload"]
    assert lines[0]["type"] == "header" and lines[0]["source"] == "cpu-tracker"
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert all(set(s["phases"]) == PHASES and (s["batch"], s["seq"]) == (2, 32) for s in steps)
    # The Trainer trains in fp32 here (no bf16=True): no autocast seen. Its default optimizer is
    # adamw_torch_fused, which the log names as the one thing llamem does not size exactly.
    assert workload["workload"]["precision"] == "fp32" and workload["workload"]["optimizer"] == "adamw"
    assert (workload["workload"]["batch"], workload["workload"]["seq"]) == (2, 32)
    assert workload["unknown"] == ["optimizer: fused AdamW (llamem sizes the foreach step: its optimizer phase errs high)"]
    assert set(workload["predicted"]) == {"load", *PHASES}
    # Steps 2 and 3 are alike: the optimizer state exists from step 1 on.
    assert steps[1]["peak_allocated_bytes"] == steps[2]["peak_allocated_bytes"] > steps[0]["peak_allocated_bytes"]
    assert callback.monitor.records == steps
    assert callback.monitor._hooks == []  # closed when training ended


def test_the_trainers_gradient_accumulation_is_sized_without_a_note(tmp_path):
    log = tmp_path / "run.jsonl"
    with CpuMemoryTracker() as tracker:
        callback = LlamemCallback(log_path=log, tracker=tracker)
        _trainer(tmp_path, callback, max_steps=2, grad_accum=2).train()
    lines = _lines(log)
    # The Trainer's gradient_accumulation_steps is given to the monitor, and its count agrees: one workload line.
    assert [line["type"] for line in lines] == ["header", "workload", "step", "step"]
    assert lines[1]["workload"]["grad_accum"] == 2 and "--grad-accum 2" in lines[1]["command"]
    assert not [note for note in lines[1]["unknown"] if note.startswith("grad_accum")]


def _monitor(tmp_path: Path, *options: str, command: list[str] | None = None, env: dict | None = None):
    script = tmp_path / "train.py"
    script.write_text(TRAIN_SCRIPT.format(tiny=TINY))
    command = command or [sys.executable, str(script), str(tmp_path / "out")]
    return subprocess.run([sys.executable, "-m", "llamem", "monitor", *options, "--", *command],
                          capture_output=True, text=True, cwd=tmp_path, env=env)


def test_llamem_monitor_attaches_to_an_unmodified_script(tmp_path):
    run = _monitor(tmp_path, "--log", "memory.jsonl")
    assert run.returncode == 0, run.stderr[-3000:]
    lines = _lines(tmp_path / "memory.jsonl")
    assert [line["type"] for line in lines] == ["header", "workload", "step", "step"]
    assert [line["step"] for line in lines[2:]] == [1, 2]
    assert lines[0]["source"] == "cpu-tracker"  # a CPU run is measured by the tracker
    assert (tmp_path / "memory.config.json").is_file()
    assert "llamem monitor: 2 steps (cpu-tracker), batch 2 x 32 tokens" in run.stderr
    assert "predicted by: llamem estimate --config" in run.stderr


def test_cpu_capacity_provokes_an_oom_that_is_dumped(tmp_path):
    run = _monitor(tmp_path, "--log", "memory.jsonl", "--oom-dir", "oom", "--cpu-capacity", "1MiB")
    assert run.returncode == 1  # the script's own exit code: it died of the error
    assert "torch.OutOfMemoryError: CUDA out of memory" in run.stderr
    lines = _lines(tmp_path / "memory.jsonl")
    assert lines[0]["capacity_bytes"] == 2**20
    oom = lines[-1]
    assert (oom["type"], oom["step"], oom["phase"]) == ("oom", 1, "forward")
    assert oom["dump_dir"] == str(tmp_path / "oom")
    saved = json.loads((tmp_path / "oom" / "oom.json").read_text())
    assert (saved["step"], saved["phase"], saved["capacity_bytes"]) == (1, "forward", 2**20)


def test_exit_code_and_an_existing_sitecustomize_go_through(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("open(__file__ + '.ran', 'w').close()\n")
    env = {**os.environ, "PYTHONPATH": str(site)}
    run = _monitor(tmp_path, command=[sys.executable, "-c", "import sys; sys.exit(7)"], env=env)
    assert run.returncode == 7
    assert (site / "sitecustomize.py.ran").exists()
    assert "no transformers Trainer trained" in run.stderr


def test_monitor_needs_a_command(tmp_path):
    run = subprocess.run([sys.executable, "-m", "llamem", "monitor"], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 2
    assert "give the command to run after `--`" in run.stderr
