"""Tier 2: the analytic engine held to the trace engine (the CI subset of benchmarks/accuracy.py).

Same tolerances as the full harness: peak within 2 %, every category above 1 % of the peak
within 5 %, so the two engines can never drift apart silently.
"""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from accuracy import MODELS, quick_matrix, row_workload  # noqa: E402

from llamem.analytic import estimate  # noqa: E402
from llamem.cli import main  # noqa: E402
from llamem.model import load_model  # noqa: E402
from llamem.trace.compare import compare  # noqa: E402
from llamem.trace.run import trace  # noqa: E402
from llamem.workload import build_workload  # noqa: E402


@pytest.mark.parametrize("model, options", quick_matrix(), ids=lambda x: x if isinstance(x, str) else
                         "-".join(f"{k}={v}" for k, v in x.items() if not isinstance(v, tuple)))
def test_analytic_matches_trace(model, options):
    result = compare(load_model(model, overrides=MODELS[model]), row_workload(options))
    category, error = result.worst_category
    assert abs(result.peak_error) <= 0.02, f"peak off by {100 * result.peak_error:+.2f}%"
    assert abs(error) <= 0.05, f"{category} off by {100 * error:+.2f}%"


# A sliding window shorter than the prompt (Mistral's DynamicSlidingWindowLayer keeps a view into
# the whole concatenation) and chunked prefill, with and without it.
LONG_CONTEXT = [
    ("debug", {}, dict(batch=2, seq=512, new_tokens=4, prefill_chunk=128)),
    ("llama-3.2-1b", {"num_hidden_layers": 2}, dict(batch=1, seq=2000, new_tokens=3, prefill_chunk=300)),
    ("mistral-7b", {"num_hidden_layers": 2, "sliding_window": 256}, dict(batch=1, seq=700, new_tokens=3)),
    # The row above at a quarter of the window, prompt, chunk and decode: a chunk below the window,
    # a prompt past it, more new tokens than the window holds (a quarter of the decode steps to trace).
    ("mistral-7b", {"num_hidden_layers": 2, "sliding_window": 64},
     dict(batch=2, seq=175, new_tokens=75, prefill_chunk=50)),
]


@pytest.mark.parametrize("model, overrides, options", LONG_CONTEXT, ids=lambda x: str(x))
def test_long_context_prefill_and_cache_are_exact(model, overrides, options):
    spec = load_model(model, overrides=overrides)
    workload = build_workload(task="infer", **options)
    analytic, traced = estimate(spec, workload), trace(spec, workload)
    assert analytic.phases["prefill"]["kv_cache"] == traced.phases["prefill"]["kv_cache"]
    # (the decode's peak moment may fall a few KiB of cache apart)
    assert abs(analytic.phases["decode"]["kv_cache"] / traced.phases["decode"]["kv_cache"] - 1) <= 0.005
    prefill = sum(analytic.phases["prefill"].values()), sum(traced.phases["prefill"].values())
    assert abs(prefill[0] / prefill[1] - 1) <= 0.001


def cli_json(capsys, *args):
    assert main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


# Two layers of the larger presets (layer 0 and a later one): the CLI path is the point here, the
# depth is held to the trace by the quick matrix and the long-context rows.
@pytest.mark.parametrize("args", [
    ("debug", "--task", "train"),
    ("tinyllama-1.1b", "--override", "num_hidden_layers=2", "--task", "lora", "--batch", "1", "--seq", "1024"),
    ("llama-3.2-1b", "--override", "num_hidden_layers=2", "--task", "infer", "--batch", "2", "--seq", "4096",
     "--new-tokens", "2"),
])
def test_trace_and_estimate_agree_through_the_cli(capsys, args):
    estimated = cli_json(capsys, "estimate", *args, "--json")
    traced = cli_json(capsys, "trace", *args, "--json")
    assert set(estimated) == set(traced)
    assert traced["engine"] == "trace" and estimated["engine"] == "analytic"
    assert abs(estimated["peak_allocated_bytes"] / traced["peak_allocated_bytes"] - 1) <= 0.02
    # One meaning of device memory: both engines add the same fragmentation allowance and overhead to
    # their own peak, so where the peaks agree to the byte, so do the device figures.
    assert estimated["device_bytes"] - estimated["peak_allocated_bytes"] == (
        traced["device_bytes"] - traced["peak_allocated_bytes"])


def test_save_trace_writes_every_event(tmp_path, capsys):
    out = tmp_path / "trace.json"
    assert main(["trace", "debug", "--task", "infer", "--seq", "64", "--new-tokens", "3",
                 "--save-trace", str(out)]) == 0
    data = json.loads(out.read_text())
    events = data["events"]
    assert data["format"] == "llamem-trace-v1"
    assert {e["action"] for e in events} == {"alloc", "free"}
    live = {}
    for event in events:  # every free matches an earlier alloc of the same size
        if event["action"] == "alloc":
            live[event["addr"]] = event["size"]
        else:
            assert live.pop(event["addr"]) == event["size"]
    assert all(e["size"] % 512 == 0 for e in events)
