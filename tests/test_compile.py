"""`--compile`: the compiled training step traced on fake tensors (AOT autograd's partitioner, inductor's
fusion) and its analytic terms, held to each other; compile refused where it is not sized."""

import gc
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from llamem.analytic import estimate  # noqa: E402
from llamem.cli import main  # noqa: E402
from llamem.errors import InvalidWorkload  # noqa: E402
from llamem.model import load_model  # noqa: E402
from llamem.trace.compare import compare  # noqa: E402
from llamem.trace.run import trace  # noqa: E402
from llamem.workload import build_workload  # noqa: E402

TINY = {"num_hidden_layers": 2}
"""The debug preset cut to two layers: layer 0 and a later one differ, both are kept."""


@pytest.fixture(scope="module")
def spec():
    return load_model("debug", overrides=TINY)


@pytest.fixture(scope="module", autouse=True)
def _settled_heap():
    """A compiled trace runs two full collections (at its start and after compiling), each walking
    every object of the process: seconds after a long run of other test modules. What those left is
    collected once and frozen, so the collections here walk what this module's traces create, the
    compiled call's cycles among them (with the collection after compiling left out, the figures of
    the last test still change)."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


def test_compiled_trace_keeps_what_the_partitioner_saves(spec):
    """The partitioner saves matmul outputs and recomputes the pointwise chains (norms, SiLU, the
    fp32 upcast of the logits): the compiled step keeps less at the end of forward than eager.
    The analytic peak of the compiled bf16-mixed step is held to this trace (as `compare` does)."""
    mixed = dict(task="train", precision="bf16-mixed", optimizer="adamw", batch=1, seq=512)
    eager = trace(spec, build_workload(**mixed))
    compiled = trace(spec, build_workload(**mixed, compile=True))
    peak_error = estimate(spec, compiled.workload).peak_allocated_bytes / compiled.peak_allocated_bytes - 1
    assert abs(peak_error) <= 0.02, f"peak off by {100 * peak_error:+.2f}%"
    assert compiled.workload.compile and not eager.workload.compile
    assert compiled.phases["forward"]["activations"] < 0.75 * eager.phases["forward"]["activations"]
    assert compiled.phases["forward"]["logits"] < eager.phases["forward"]["logits"]
    assert compiled.peak_allocated_bytes < eager.peak_allocated_bytes
    # What persists is the same program's: weights, optimizer state, the autocast copies the graph saves.
    for category in ("weights", "optimizer/exp_avg", "weights/autocast_copies"):
        assert compiled.phases["forward"][category] == eager.phases["forward"][category]
    assert any("partitioner" in note for note in compiled.notes)


# bf16-mixed (batch 1 x 512) is held to its compiled trace in the partitioner test above.
@pytest.mark.parametrize("options", [
    dict(task="train", precision="bf16", batch=2, seq=256),
    dict(task="lora", batch=2, seq=256),
], ids=["bf16", "lora"])
def test_analytic_matches_the_compiled_trace(spec, options):
    result = compare(spec, build_workload(**options, compile=True))
    assert abs(result.peak_error) <= 0.02, f"peak off by {100 * result.peak_error:+.2f}%"


def test_analytic_compile_saves_less_than_eager(spec):
    mixed = dict(task="train", precision="bf16-mixed", optimizer="adamw", batch=1, seq=4096)
    eager = estimate(spec, build_workload(**mixed))
    compiled = estimate(spec, build_workload(**mixed, compile=True))
    assert compiled.phases["forward"]["activations"] < eager.phases["forward"]["activations"]
    assert compiled.peak_allocated_bytes < eager.peak_allocated_bytes


def test_compile_is_refused_for_inference():
    with pytest.raises(InvalidWorkload, match="--compile"):
        build_workload(task="infer", compile=True)


def test_cli_refuses_compile_for_inference(capsys):
    assert main(["estimate", "debug", "--task", "infer", "--compile"]) == 1
    assert "--compile" in capsys.readouterr().err


def test_cli_estimate_and_trace_take_compile(capsys):
    assert main(["estimate", "debug", "--task", "train", "--compile", "--json"]) == 0
    compiled = json.loads(capsys.readouterr().out)
    assert main(["estimate", "debug", "--task", "train", "--json"]) == 0
    eager = json.loads(capsys.readouterr().out)
    assert compiled["peak_allocated_bytes"] < eager["peak_allocated_bytes"]
    assert main(["trace", "debug", "--task", "lora", "--seq", "128", "--override", "num_hidden_layers=1",
                 "--compile", "--json"]) == 0
    traced = json.loads(capsys.readouterr().out)
    assert traced["engine"] == "trace" and traced["peak_allocated_bytes"] > 0


def test_compiled_trace_does_not_depend_on_what_ran_before():
    """Compiling pins the compiled call's output in reference cycles (dynamo's traced exceptions); a
    cycle moved to Python's oldest generation outlives the next step unless the trace collects it.
    Thresholds that promote at once and never run a full collection stand for a long process (one
    that has run many traces): the same workload, traced again there after another, gives the same
    figures, in this process (no fresh one). One layer is enough (without the collection after
    compiling, its figures change too) and compiles in two thirds of the time of two."""
    spec = load_model("debug", overrides={"num_hidden_layers": 1})
    first = build_workload(task="train", precision="bf16", optimizer="adamw", batch=1, seq=128, compile=True)
    other = build_workload(task="lora", precision="bf16-mixed", optimizer="adamw", batch=1, seq=128, compile=True)
    before = trace(spec, first).phases
    trace(spec, other)
    thresholds = gc.get_threshold()
    gc.set_threshold(100, 1, 10**9)
    try:
        again = trace(spec, first).phases
    finally:
        gc.set_threshold(*thresholds)
    assert again == before


def test_tied_head_gradient_is_logits_at_the_embedding_backward():
    """Checkpointed, pure bf16, tied head: at the embedding graph's backward (the peak) the tied weight's
    gradient is still the head graph's output, counted under logits (as the trace counts it)."""
    tied = load_model("llama-3.2-1b", overrides=TINY)
    workload = build_workload(task="train", precision="bf16", optimizer="adamw", ac_every=1, batch=1, seq=2048,
                              compile=True)
    backward = estimate(tied, workload).phases["backward"]
    assert backward["logits"] == 2 * tied.vocab_size * tied.hidden_size == 525336576
    assert backward["gradients"] == 243290112
