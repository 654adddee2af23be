"""`llamem report LOG.jsonl`: the monitor's log summarized as text, PNG and one self-contained
HTML page, from logs written by hand: exact figures, a last line cut off by a crash, bad lines
reported by number, and hostile files."""

from __future__ import annotations

import json
import re

import pytest

from llamem.analytic import estimate
from llamem.cli import main
from llamem.model import load_model
from llamem.reporters.json_report import workload_dict
from llamem.techniques import workload_args
from llamem.units import MiB
from llamem.workload import build_workload

TINY_CONFIG = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "max_position_embeddings": 2048}
PREDICTED = {"load": 560640, "forward": 14713344, "backward": 15220736, "optimizer": 2809856}
# Measured peaks per step: (forward, backward, optimizer); step 2 is the run's peak.
MEASURED = {0: (13583360, 14090752, 1690112), 1: (14713344, 15220736, 2809856),
            2: (14713344, 15220736 + MiB, 2809856), 3: (14713344, 15220736, 2809856)}
OOM_MESSAGE = ("CUDA out of memory. Tried to allocate 2.00 MiB. GPU 0 has a total capacity of 16.00 MiB. See "
               "documentation for Memory Management (https://pytorch.org/docs/stable/notes/cuda.html)")


def _step(step: int, phases: tuple[int, int, int], **extra) -> dict:
    names = ("forward", "backward", "optimizer")
    return {"type": "step", "step": step, "time_s": 1.5 * (step + 1), "batch": 8, "seq": 128,
            "phases": {n: {"peak_allocated_bytes": p, "peak_reserved_bytes": p, "end_allocated_bytes": 2 * MiB,
                           "end_reserved_bytes": 2 * MiB} for n, p in zip(names, phases)},
            "peak_allocated_bytes": max(phases), "peak_reserved_bytes": max(phases), "allocated_bytes": 2 * MiB,
            "reserved_bytes": 2 * MiB, "nvml_used_bytes": None, "non_torch_bytes": None, "num_alloc_retries": 0,
            "num_ooms": 0, **extra}


def _workload_line(tmp_path, step: int = 0, batch: int = 8, predicted: dict | None = None) -> dict:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(TINY_CONFIG))
    w = build_workload("train", batch=batch, seq=128)
    return {"type": "workload", "step": step, "model": "llama", "workload": workload_dict(w),
            "command": "llamem estimate " + " ".join(["--config", str(config), *workload_args(w)]),
            "config_path": str(config), "unknown": [], "problem": None, "predicted": predicted or PREDICTED}


def _header() -> dict:
    return {"type": "header", "version": 1, "source": "cpu-tracker", "device": "CpuMemoryTracker",
            "capacity_bytes": 16 * MiB, "started": "2026-12-01T10:00:00", "pid": 4242}


def _write_log(tmp_path, records: list, tail: str = "") -> str:
    path = tmp_path / "run.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records) + tail)
    return str(path)


def _full_log(tmp_path, **step_extra) -> str:
    records = [_header(), _workload_line(tmp_path)]
    records += [_step(s, MEASURED[s], **(step_extra if s == 2 else {})) for s in MEASURED]
    records.append({"type": "leak", "step": 3, "steps": 3, "growth_bytes_per_step": MiB, "live_growth_bytes": 3 * MiB,
                    "sources": [{"bytes": 3 * MiB, "count": 3, "category": "activations",
                                 "stack": ["train.py:10 in main", "train.py:55 in step"]}]})
    records.append({"type": "oom", "step": 4, "phase": "backward", "message": OOM_MESSAGE, "dump_dir": "/runs/oom-4"})
    return _write_log(tmp_path, records, tail='{"type": "step", "step": 5, "ti')


def _run(args, capsys):
    code = main(args)
    out = capsys.readouterr()
    return code, out.out, out.err


def test_text_summary_figures(tmp_path, capsys):
    code, text, err = _run(["report", _full_log(tmp_path)], capsys)
    assert code == 0, err
    lines = text.splitlines()
    assert "run: cpu-tracker on CpuMemoryTracker (capacity 16.00 MiB), started 2026-12-01T10:00:00" in lines
    assert "steps: 4 logged in 6.0 s" in lines
    assert "peak allocated: 15.52 MiB (16,269,312 B) at step 2" in lines
    assert "peak reserved: 15.52 MiB (16,269,312 B)" in lines
    assert "OOMs: 1" in lines and "leaks reported: 1" in lines
    table = lines[lines.index(next(l for l in lines if l.startswith("steps 0-3 (4 logged): llama: train"))) + 1:][:4]
    assert table[0].split() == ["phase", "measured", "peak", "at", "step", "predicted", "measured/predicted"]
    assert table[1].split() == ["forward", "14.03", "MiB", "1", "14.03", "MiB", "1.00"]
    assert table[2].split() == ["backward", "15.52", "MiB", "2", "14.52", "MiB", f"{(15220736 + MiB) / 15220736:.2f}"]
    assert table[3].split() == ["optimizer", "2.68", "MiB", "1", "2.68", "MiB", "1.00"]
    assert "  step 3, over 3 steps: 1.00 MiB more per step (live 3.00 MiB more)" in lines
    assert "    3.00 MiB in 3 allocations (activations) at train.py:55 in step" in lines
    assert "    explain it: llamem explain-oom /runs/oom-4" in lines
    assert any(l.startswith("reproduce: llamem estimate --config ") for l in lines)
    assert "  line 9: cut off (the run ended while writing it); ignored" in lines


def test_json_summary(tmp_path, capsys):
    code, out, _err = _run(["report", _full_log(tmp_path), "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert (data["num_steps"], data["peak_allocated_bytes"], data["peak_step"], data["num_ooms"]) == (
        4, 15220736 + MiB, 2, 1)
    phases = {p["phase"]: p for p in data["workloads"][0]["phases"]}
    assert phases["backward"]["measured_peak_allocated_bytes"] == 15220736 + MiB
    assert phases["backward"]["predicted_bytes"] == 15220736
    assert phases["backward"]["ratio"] == round((15220736 + MiB) / 15220736, 4)
    assert data["problems"] == ["line 9: cut off (the run ended while writing it); ignored"]


def test_breakdown_predicted_when_the_log_has_none(tmp_path, capsys):
    code, out, _err = _run(["report", _full_log(tmp_path), "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    expected = estimate(load_model(config_path=tmp_path / "config.json"),
                        build_workload("train", batch=8, seq=128)).breakdown
    assert data["breakdown"] == expected
    assert data["breakdown_label"].startswith("predicted by llamem estimate")


def test_breakdown_measured_when_the_log_has_it(tmp_path, capsys):
    measured = {"weights": 560640, "activations": 12 * MiB}
    code, out, _err = _run(["report", _full_log(tmp_path, breakdown=measured), "--json"], capsys)
    assert code == 0
    data = json.loads(out)
    assert data["breakdown"] == measured and data["breakdown_label"] == "measured at step 2 (the peak)"


def test_bad_lines_are_reported_by_number(tmp_path, capsys):
    records = [_header(), _workload_line(tmp_path), _step(0, MEASURED[0]), "not json at all",
               {**_step(1, MEASURED[1]), "step": "one"}, {"type": "mystery"},
               {**_step(2, MEASURED[2]), "peak_allocated_bytes": 10**40}, [1, 2], _step(3, MEASURED[3])]
    code, text, _err = _run(["report", _write_log(tmp_path, records)], capsys)
    assert code == 0
    assert "steps: 2 logged" in text
    assert "lines skipped (5):" in text
    assert "  line 4: not JSON (" in text
    assert "  line 5 (step): 'step' must be a step number from 0 to" in text
    assert "  line 6: unknown record type 'mystery' (a string)" in text
    assert "  line 7 (step): 'peak_allocated_bytes' must be a byte count from 0 to 1,125,899,906,842,624" in text
    assert "  line 8: the record must be an object, got [1, 2] (a list)" in text


def test_workload_changes_split_the_steps(tmp_path, capsys):
    small = {"load": 560640, "forward": 8317440, "backward": 8570880, "optimizer": 2809856}
    records = [_header(), _workload_line(tmp_path), _step(0, MEASURED[0]), _step(1, MEASURED[1]),
               _workload_line(tmp_path, step=2, batch=4, predicted=small), _step(2, (8317440, 8570880, 8570880))]
    code, out, _err = _run(["report", _write_log(tmp_path, records), "--json"], capsys)
    assert code == 0
    runs = json.loads(out)["workloads"]
    assert [(r["first_step"], r["last_step"], r["workload"]["workload"]["batch"]) for r in runs] == [
        (0, 1, 8), (2, 2, 4)]
    assert runs[1]["phases"][1] == {"phase": "backward", "measured_peak_allocated_bytes": 8570880, "at_step": 2,
                                    "predicted_bytes": 8570880, "ratio": 1.0}


def test_png_is_a_valid_image(tmp_path, capsys):
    import matplotlib.image

    png = tmp_path / "run.png"
    code, _out, err = _run(["report", _full_log(tmp_path), "--png", str(png)], capsys)
    assert code == 0, err
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png)
    assert image.shape[:2] == (480, 1300) and image.std() > 0  # drawn, not blank


def test_png_of_a_single_step_without_a_workload(tmp_path, capsys):
    import matplotlib.image

    png = tmp_path / "one.png"
    code, text, _err = _run(["report", _write_log(tmp_path, [_step(0, MEASURED[0])]), "--png", str(png)], capsys)
    assert code == 0
    assert "no breakdown: the log has no workload line to predict one from" in text
    assert matplotlib.image.imread(png).shape[:2] == (480, 1300)


def test_html_is_self_contained_with_the_summary(tmp_path, capsys):
    page = tmp_path / "run.html"
    code, _out, err = _run(["report", _full_log(tmp_path), "--html", str(page)], capsys)
    assert code == 0, err
    html = page.read_text()
    assert html.startswith("<!DOCTYPE html>")
    assert not re.search(r"""(?:src|href)\s*=\s*["']?\s*(?:https?:)?//""", html, re.IGNORECASE)
    assert "<script" not in html and "<link" not in html
    assert html.count('src="data:image/png;base64,') == 1
    row = "<td>backward</td><td>15.52 MiB</td><td>2</td><td>14.52 MiB</td><td>1.07</td>"
    for figure in ("15.52 MiB (16,269,312 B) at step 2", row, "llamem explain-oom /runs/oom-4",
                   "line 9: cut off (the run ended while writing it); ignored"):
        assert figure in html, figure


@pytest.mark.parametrize("case, content, expected", [
    ("empty", "", "no readable record in 0 lines"),
    ("garbage", "hello\nworld\n", "no readable record in 2 lines"),
    ("only a cut line", '{"type": "hea', "no readable record in 1 lines"),
])
def test_unreadable_logs_exit_1(case, content, expected, tmp_path, capsys):
    path = tmp_path / "run.jsonl"
    path.write_text(content)
    code, _out, err = _run(["report", str(path)], capsys)
    assert code == 1 and expected in err and "Traceback" not in err


def test_missing_log_and_bad_outputs_exit_1(tmp_path, capsys):
    code, _out, err = _run(["report", str(tmp_path / "none.jsonl")], capsys)
    assert code == 1 and "does not exist" in err
    code, _out, err = _run(["report", str(tmp_path)], capsys)
    assert code == 1 and "is a folder" in err
    log = _full_log(tmp_path)
    code, _out, err = _run(["report", log, "--png", str(tmp_path / "no" / "such" / "x.png")], capsys)
    assert code == 1 and "--png" in err and "does not exist" in err
    code, out, _err = _run(["report", log, "--html", str(tmp_path), "--json"], capsys)
    assert code == 1 and "is a folder" in json.loads(out)["error"]["message"]


def test_report_needs_no_torch(tmp_path):
    import subprocess
    import sys

    log = _full_log(tmp_path)
    code = "import sys, llamem.cli; llamem.cli.main(['report', sys.argv[1], '--json']); print('torch' in sys.modules)"
    run = subprocess.run([sys.executable, "-c", code, log], capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "False"
