"""The batch finder on real tiny Llama models under a CpuMemoryTracker: the predicted batch is
the real edge, an OOM steps down by the measured overshoot, nothing of one probe leaks into the
next, and the benchmark's scenario finds the bisection maximum."""

from __future__ import annotations

import gc
import importlib.util
import pathlib
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llamem.errors import DoesNotFit, LlamemError  # noqa: E402
from llamem.runtime import CpuMemoryTracker, auto_batch_size, find_batch_size  # noqa: E402
from llamem.runtime.batch import Probe, is_oom  # noqa: E402

MiB = 2**20
SEQ, VOCAB, CAPACITY = 128, 512, 64 * MiB
EDGE = 32
"""The largest batch of two fp32 AdamW steps at 128 tokens within 64 MiB (bisection with real steps)."""


def _model():
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    return transformers.LlamaForCausalLM(config)


def _step(model, optimizer):
    def step(batch: int) -> None:
        ids = torch.randint(0, VOCAB, (batch, SEQ))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        del loss, ids
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _runs(step, batch: int, steps: int = 2) -> bool:
    failed = False
    try:
        for _ in range(steps):
            step(batch)
    except torch.OutOfMemoryError:
        failed = True
    gc.collect()
    return not failed


@pytest.fixture()
def setup():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    with CpuMemoryTracker(CAPACITY, history=False) as tracker:
        tracker.track(model)
        yield model, optimizer, tracker


def test_the_prediction_is_the_edge_in_one_probe(setup):
    model, optimizer, tracker = setup
    step = _step(model, optimizer)
    result = find_batch_size(step, model=model, seq=SEQ, optimizer=optimizer, tracker=tracker, autocast_dtype="fp32")
    assert (result.batch_size, result.predicted_batch) == (EDGE, EDGE)
    assert result.probes == (Probe(EDGE, True, 65_916_928),)
    assert result.figure == "allocated" and result.budget_bytes == CAPACITY
    assert result.per_sample_bytes == 2_006_528
    assert _runs(step, EDGE, steps=3)
    optimizer.state.clear()
    assert not _runs(step, EDGE + 1)


def test_nothing_of_a_probe_is_left_behind(setup):
    model, optimizer, tracker = setup
    before = tracker.live_bytes
    find_batch_size(_step(model, optimizer), model=model, seq=SEQ, optimizer=optimizer, tracker=tracker)
    gc.collect()
    assert tracker.live_bytes == before
    assert not optimizer.state and all(p.grad is None for p in model.parameters())


def test_a_wrong_prediction_steps_down_by_the_overshoot(setup):
    """Not told that the step runs in fp32, llamem assumes bf16 autocast (the Trainer's bf16=True)
    and predicts 39; the OOMs' measured overshoot brings it to the edge in two more probes, and
    the line from the fit through the second OOM shows that 33 cannot fit."""
    model, optimizer, tracker = setup
    step = _step(model, optimizer)
    before = tracker.live_bytes
    result = find_batch_size(step, model=model, seq=SEQ, optimizer=optimizer, tracker=tracker)
    assert result.predicted_batch == 39
    assert [(p.batch, p.fit) for p in result.probes] == [(39, False), (38, False), (EDGE, True)]
    assert result.batch_size == EDGE
    assert any("autocast" in note for note in result.notes)
    gc.collect()
    assert tracker.live_bytes == before  # the failed probes' frames were released
    assert _runs(step, EDGE)


def test_running_out_of_probes_says_so(setup):
    model, optimizer, tracker = setup
    with pytest.raises(DoesNotFit, match=r"no batch fit in max_probes=2 \(tried 39, 38\): raise max_probes"):
        find_batch_size(_step(model, optimizer), model=model, seq=SEQ, optimizer=optimizer, tracker=tracker,
                        max_probes=2)


def test_global_batch_gives_the_accumulation(setup):
    model, optimizer, tracker = setup
    result = find_batch_size(_step(model, optimizer), model=model, seq=SEQ, optimizer=optimizer, tracker=tracker,
                             autocast_dtype="fp32", global_batch=100)
    assert (result.batch_size, result.grad_accum, result.micro_batch) == (EDGE, 4, 25)


def test_max_batch_caps_the_search(setup):
    model, optimizer, tracker = setup
    result = find_batch_size(_step(model, optimizer), model=model, seq=SEQ, optimizer=optimizer, tracker=tracker,
                             autocast_dtype="fp32", max_batch=20)
    assert result.batch_size == 20 and len(result.probes) == 1
    assert "capped at max_batch=20" in " ".join(result.notes)


def test_the_decorator_reruns_after_an_oom_only(setup):
    model, optimizer, tracker = setup
    calls = []

    @auto_batch_size(model=model, seq=SEQ, optimizer=optimizer, tracker=tracker)
    def train(batch_size, steps):
        calls.append(batch_size)
        step = _step(model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True))
        for _ in range(steps):
            step(batch_size)
        return f"trained at {batch_size}"

    assert train(2) == f"trained at {EDGE}"
    assert calls == [39, 38, EDGE]  # the first completed run ends the search
    assert train.result.batch_size == EDGE


def test_batch_one_that_does_not_fit_is_a_clear_error():
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    with CpuMemoryTracker(2 * MiB) as tracker:
        tracker.track(model)
        with pytest.raises(DoesNotFit, match="batch 1 does not fit in 2.00 MiB") as caught:
            find_batch_size(_step(model, optimizer), model=model, seq=SEQ, optimizer=optimizer, tracker=tracker,
                            autocast_dtype="fp32")
    assert caught.value.shortfall_bytes > 0


def test_without_a_prediction_doubling_then_extrapolation():
    """A model llamem cannot size: batch 1 and 2 give the per-sample memory, the line gives the edge."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)

    def step(batch: int) -> None:
        model(torch.randn(batch, SEQ, 64)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    with CpuMemoryTracker(4 * MiB, history=False) as tracker:
        tracker.track(model)
        result = find_batch_size(step, model=model, seq=SEQ, optimizer=optimizer, tracker=tracker)
        assert _runs(step, result.batch_size) and not _runs(step, result.batch_size + 1)
    assert result.predicted_batch is None and "no prediction" in " ".join(result.notes)
    assert [(p.batch, p.fit) for p in result.probes] == [(1, True), (2, True), (8, True)]


def test_bad_arguments_name_the_fix(setup):
    model, optimizer, tracker = setup
    with pytest.raises(LlamemError, match="seq must be a positive integer.*margin is the fraction"):
        find_batch_size(_step(model, optimizer), model=model, seq=0, tracker=tracker, margin=1.5)
    with pytest.raises(LlamemError, match="no card size"):
        find_batch_size(_step(model, optimizer), model=model, seq=SEQ)


def test_oom_recognition():
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB"))
    assert is_oom(RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory"))
    assert not is_oom(RuntimeError("shape mismatch"))
    assert not is_oom(ValueError(" out of memory."))


def _benchmark():
    path = pathlib.Path(__file__).parent.parent / "benchmarks" / "batch_finder.py"
    spec = importlib.util.spec_from_file_location("batch_finder_benchmark", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_benchmark_scenario_finds_the_bisection_maximum():
    bench = _benchmark()
    row = bench.run_scenario(bench.SMOKE, finders=("llamem",))
    found = row["finders"]["llamem"]
    assert row["true_max"] == 22
    assert row["true_max"] * 0.97 <= found["batch"] <= row["true_max"]
    assert found["further_steps_ok"] and found["leaked_bytes"] == 0
    assert found["probes"] == 1
