"""`--compile` with the optimizer step in backward and with selective checkpointing (sized) and with
Liger (refused, with its reason): the analytic figure held to the compiled trace, the planner's offer, the CLI."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from accuracy import compile_combo_rows, matrix, row_workload  # noqa: E402

from llamem.analytic import estimate  # noqa: E402
from llamem.cli import main  # noqa: E402
from llamem.errors import InvalidWorkload  # noqa: E402
from llamem.gpus import get_gpu  # noqa: E402
from llamem.model import load_model  # noqa: E402
from llamem.plan import Space  # noqa: E402
from llamem.techniques import BY_NAME  # noqa: E402
from llamem.trace.compare import compare  # noqa: E402
from llamem.workload import build_workload  # noqa: E402

TINY = {"num_hidden_layers": 2}
IN_BACKWARD = dict(task="train", optimizer="adamw", optimizer_in_backward=True, compile=True)
SCALARS = 2 * 512
"""The loss and its gradient (0-dim, one 512-byte block each), which the analytic step moment leaves out."""


@pytest.fixture(scope="module")
def spec():
    return load_model("debug", overrides=TINY)


def test_in_backward_is_held_to_the_compiled_trace(spec):
    """The compiled backward returns every gradient at once: the first step runs beside all of them
    (bf16-mixed, fp32 gradients: the embedding's fp32 step temporary on top of every gradient)."""
    result = compare(spec, build_workload(**IN_BACKWARD, precision="bf16-mixed", batch=1, seq=64))
    assert result.traced_phase == "backward"
    assert 0 <= result.traced_peak_bytes - result.analytic_peak_bytes <= SCALARS
    assert abs(result.worst_category[1]) <= 0.05


def test_checkpointed_in_backward_steps_the_separate_head_first(spec):
    """With checkpointing the head is a graph of its own: its gradient is stepped before the decoder's
    backward runs, so the end of backward holds every gradient but the head's."""
    result = compare(spec, build_workload(**IN_BACKWARD, precision="bf16", ac_every=1, batch=1, seq=64))
    assert result.traced_phase == "backward"
    assert 0 <= result.traced_peak_bytes - result.analytic_peak_bytes <= SCALARS


def test_in_backward_under_compile_is_not_eager_in_backward(spec):
    """The analytic figure of the compiled step does not take eager's saved set (the issue's workload:
    debug, pure bf16, 2 x 1024, traced at 102.12 MiB with four layers)."""
    debug = load_model("debug")
    shape = dict(precision="bf16", batch=2, seq=1024)
    compiled = estimate(debug, build_workload(**IN_BACKWARD, **shape))
    plain = estimate(debug, build_workload(**{**IN_BACKWARD, "optimizer_in_backward": False}, **shape))
    assert compiled.peak_allocated_bytes == 107_098_112  # traced: 102.12 MiB (+0.01 %)
    # No gradient is alive at the loss's backward, the worst moment of both.
    assert compiled.phases["backward"] == {k: v for k, v in plain.phases["backward"].items() if k != "gradients"}
    # Every parameter was stepped in backward: no optimizer phase of its own, no gradient left.
    assert "gradients" not in compiled.phases["optimizer"] and "temporaries" not in compiled.phases["optimizer"]


def test_combo_rows_join_the_accuracy_matrix():
    """The full-size rows (benchmarks/accuracy.py, 2-layer models) that the traces here stand for."""
    rows = [(model, {**options, "compile": True}) for model, options in compile_combo_rows()]
    assert len(rows) == 13 and all(row in matrix() for row in rows)
    assert len([o for _m, o in rows if row_workload(o).optimizer_in_backward]) == 6
    assert len([o for _m, o in rows if row_workload(o).selective_ac]) == 7


def test_selective_checkpointing_is_held_to_the_compiled_trace(spec):
    """Compiled with torchtitan's per-op policy on every second layer: the forward's saved set (the
    selective layer's input, SDPA's output and logsumexp, q, v, gate and, below a plain layer,
    down_proj's output; the plain layer's k and v repeated to full width) to the byte, and the peak."""
    w = build_workload(task="train", precision="bf16-mixed", optimizer="adamw", ac_every=2, ac_mode="selective",
                       compile=True, batch=1, seq=64)
    from llamem.trace.run import trace

    traced, analytic = trace(spec, w), estimate(spec, w)
    assert analytic.phases["forward"] == traced.phases["forward"]
    assert analytic.peak_allocated_bytes == traced.peak_allocated_bytes


def test_compile_with_liger_is_refused_with_its_reason():
    with pytest.raises(InvalidWorkload, match="opaque to inductor"):
        build_workload(task="train", precision="bf16", optimizer="adamw", liger=True, compile=True)


def test_planner_offers_compile_to_an_in_backward_workload(spec):
    w = build_workload(task="train", precision="bf16", optimizer="adamw", optimizer_in_backward=True, batch=1, seq=512)
    space = Space(spec=spec, gpu=get_gpu("h100-80gb"), host_budget_bytes=0)
    offered = [v.changes for v in BY_NAME["compile"].variants(w, space.context)]
    assert offered == [{}, {"compile": True}]


def test_cli_estimates_compile_with_in_backward(capsys):
    code = main(["estimate", "debug", "--task", "train", "--precision", "bf16", "--optimizer", "adamw",
                 "--batch", "2", "--seq", "1024", "--compile", "--optimizer-in-backward"])
    assert code == 0
    assert "compile" in capsys.readouterr().out
