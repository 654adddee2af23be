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

from llamem.analytic import estimate  # noqa: E402
from llamem.errors import DoesNotFit, LlamemError  # noqa: E402
from llamem.runtime import CpuMemoryTracker, auto_batch_size, find_batch_size, infer_workload  # noqa: E402
from llamem.runtime.batch import (  # noqa: E402
    InvalidArgument,
    Probe,
    _requested_bytes,
    held_output_bytes,
    is_oom,
    requested_bytes,
)

MiB = 2**20
SEQ, VOCAB, CAPACITY = 128, 512, 40 * MiB
EDGE = 20
"""The largest batch of two fp32 AdamW steps at 128 tokens within 40 MiB (real steps: 20 run, 21 do
not). 64 MiB (edge 32, predicted 39) gave the same search at 1.6 times the batches."""
SMALL_CAPACITY, SMALL_EDGE = 16 * MiB, 7
"""The same within 16 MiB: where llamem is told how the step runs, the search is the same at a
smaller batch (less time); the wrong prediction keeps 40 MiB, where it errs by several samples,
not one."""


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


def _kept_step(model, optimizer, kept: dict):
    """transformers' no_trainer loop: `out = model(**batch); out.loss.backward()`, `out` alive
    until the next step's forward has returned."""
    def step(batch: int) -> None:
        ids = torch.randint(0, VOCAB, (batch, SEQ))
        kept["out"] = model(input_ids=ids, labels=ids)
        kept["out"].loss.backward()
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


def _setup(capacity_bytes: int):
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    with CpuMemoryTracker(capacity_bytes, history=False) as tracker:
        tracker.track(model)
        yield model, optimizer, tracker


@pytest.fixture(scope="module", autouse=True)
def _settled_heap():
    """Every probe, and `_runs`, ends in a full collection (so that a failed step's frames free their
    tensors), and a full collection walks every object of the process: seconds each after a long run
    of other test modules. What those left is collected once and frozen, so the collections here walk
    only what this module creates, which is all that a probe can leave behind."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture()
def setup():
    yield from _setup(CAPACITY)


@pytest.fixture()
def small_setup():
    yield from _setup(SMALL_CAPACITY)


def test_the_prediction_is_the_edge_in_one_probe(small_setup):
    """The global batch changes no probe, only the accumulation it is split into."""
    model, optimizer, tracker = small_setup
    step = _step(model, optimizer)
    result = find_batch_size(step, model=model, seq=SEQ, optimizer=optimizer, tracker=tracker, autocast_dtype="fp32",
                             global_batch=24)
    assert (result.batch_size, result.predicted_batch) == (SMALL_EDGE, SMALL_EDGE)
    assert (result.grad_accum, result.micro_batch) == (4, 6)
    assert result.probes == (Probe(SMALL_EDGE, True, 15_753_728),)
    assert result.figure == "allocated" and result.budget_bytes == SMALL_CAPACITY
    assert result.per_sample_bytes == 2_006_528
    assert _runs(step, SMALL_EDGE, steps=3)
    optimizer.state.clear()
    assert not _runs(step, SMALL_EDGE + 1)


def test_a_wrong_prediction_steps_down_by_the_overshoot(setup):
    """Not told that the step runs in fp32, llamem assumes bf16 autocast (the Trainer's bf16=True)
    and predicts 24; the OOMs' measured overshoot brings it to the edge in two more probes, and
    the line from the fit through the second OOM shows that 21 cannot fit."""
    model, optimizer, tracker = setup
    step = _step(model, optimizer)
    before = tracker.live_bytes
    result = find_batch_size(step, model=model, seq=SEQ, optimizer=optimizer, tracker=tracker)
    assert result.predicted_batch == 24
    assert [(p.batch, p.fit) for p in result.probes] == [(24, False), (23, False), (EDGE, True)]
    assert result.batch_size == EDGE
    assert any("autocast" in note for note in result.notes)
    gc.collect()
    assert tracker.live_bytes == before  # nothing of a probe is left, the failed probes' frames included
    assert not optimizer.state and all(p.grad is None for p in model.parameters())
    assert _runs(step, EDGE)


def test_running_out_of_probes_says_so(setup):
    model, optimizer, tracker = setup
    with pytest.raises(DoesNotFit, match=r"no batch fit in max_probes=2 \(tried 24, 23\): raise max_probes"):
        find_batch_size(_step(model, optimizer), model=model, seq=SEQ, optimizer=optimizer, tracker=tracker,
                        max_probes=2)


def test_max_batch_caps_the_search(small_setup):
    model, optimizer, tracker = small_setup
    result = find_batch_size(_step(model, optimizer), model=model, seq=SEQ, optimizer=optimizer, tracker=tracker,
                             autocast_dtype="fp32", max_batch=4)
    assert result.batch_size == 4 and len(result.probes) == 1
    assert "capped at max_batch=4" in " ".join(result.notes)


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
    assert calls == [24, 23, EDGE]  # the first completed run ends the search
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


@pytest.mark.parametrize("device_bytes", [-5, 0, 10**30, 2**50 + 1, True, 1.5e9])
def test_a_card_size_outside_1_byte_to_1_pib_is_refused(device_bytes):
    model = _model()
    fix = (r"device_bytes must be from 1 B to 1 PiB \(llamem.units.MAX_SIZE_BYTES\), got .*: pass the card's memory "
           r"in bytes, e.g. llamem.units.parse_size\('24GiB'\)")
    with pytest.raises(InvalidArgument, match=fix):
        find_batch_size(lambda batch: None, model=model, seq=SEQ, device_bytes=device_bytes)
    with pytest.raises(InvalidArgument, match=fix):
        auto_batch_size(model=model, seq=SEQ, device_bytes=device_bytes)


def test_every_bad_argument_is_named_at_once():
    model = _model()
    with pytest.raises(InvalidArgument) as caught:
        find_batch_size(lambda batch: None, model=model, seq=True, device_bytes=2**30, margin=1.0, max_batch=0,
                        global_batch=2.5, keeps_outputs="yes")
    message = str(caught.value)
    margin = "margin is the fraction of the card kept free: from 0 to below 1 (0.03 keeps 3 %), got 1.0"
    for part in ("seq must be a positive integer, got True", "max_batch must be a positive integer, got 0",
                 "global_batch must be a positive integer, got 2.5", margin,
                 "keeps_outputs must be True or False, got 'yes'"):
        assert part in message
    assert isinstance(caught.value, ValueError)  # as torch's own argument errors
    for margin in (-0.01, True, "0.1"):
        with pytest.raises(InvalidArgument, match="margin is the fraction"):
            find_batch_size(lambda batch: None, model=model, seq=SEQ, device_bytes=2**30, margin=margin)
    for seq in (0, -1, None, 1.5):
        with pytest.raises(InvalidArgument, match=f"seq must be a positive integer, got {seq!r}"):
            find_batch_size(lambda batch: None, model=model, seq=seq, device_bytes=2**30)
    with pytest.raises(InvalidArgument, match="keeps_outputs describes a training step.*drop it for task='infer'"):
        find_batch_size(lambda batch: None, model=model, seq=SEQ, device_bytes=2**30, task="infer",
                        keeps_outputs=True)


def test_does_not_fit_gives_a_runnable_command_and_what_was_assumed():
    """No hub id: the message says how to write the config the command reads (it writes no file)
    and that the precision in the command is the assumed one."""
    model = _model()
    with CpuMemoryTracker(2 * MiB) as tracker:
        tracker.track(model)
        with pytest.raises(DoesNotFit) as caught:
            find_batch_size(_step(model, torch.optim.AdamW(model.parameters(), foreach=True)), model=model, seq=SEQ,
                            tracker=tracker)
    message = str(caught.value)
    assert ("To size it, write the model's config with `llamem.runtime.infer_workload(model)"
            ".write_config('config.json')` and run `llamem estimate --config config.json --task train --batch 1 "
            "--seq 128 --precision bf16-mixed --optimizer adamw --ac none`; `llamem plan` with the same options "
            "finds what fits.") in message
    assert "Assumed, not read from the model: autocast: not seen yet" in message
    assert "optimizer: none given (AdamW assumed)" in message
    assert message.endswith("Pass autocast_dtype= and optimizer= if the step runs otherwise.")


def test_does_not_fit_names_the_hub_id_when_the_model_has_one():
    model = _model()
    model.config._name_or_path = "example-org/tiny-llama"
    optimizer = torch.optim.AdamW(model.parameters(), foreach=True)
    with CpuMemoryTracker(2 * MiB) as tracker:
        tracker.track(model)
        with pytest.raises(DoesNotFit) as caught:
            find_batch_size(_step(model, optimizer), model=model, seq=SEQ, optimizer=optimizer, tracker=tracker,
                            autocast_dtype="fp32", keeps_outputs=True)
    message = str(caught.value)
    assert ("`llamem estimate example-org/tiny-llama --task train --batch 1 --seq 128 --precision fp32 --optimizer "
            "adamw --ac none` sizes this workload; `llamem plan` with the same options finds what fits. Neither "
            "counts the model output the step keeps through backward.") in message
    assert "Assumed" not in message and "write_config" not in message


@pytest.mark.parametrize(("autocast", "held", "phases"), [
    # fp32: logits 7 x 128 x 512 x 4 = 1,835,008 B; K and V 2 layers x 2 x 896 x 32 x 4 = 458,752 B; the loss 512 B.
    ("fp32", 2_294_272, {"forward": 16_227_840, "backward": 17_588_736, "optimizer": 5_104_128}),
    # bf16 autocast: bf16 logits 917,504 B; per layer an fp32 K (114,688 B) and a bf16 V (57,344 B); the loss.
    ("bf16", 1_262_080, {"forward": 14_376_448, "backward": 14_705_152, "optimizer": 4_071_936}),
])
def test_a_kept_output_holds_its_logits_cache_and_loss(autocast, held, phases):
    """The no_trainer loop at batch 7 x 128: the previous step's output is alive through the next
    forward, this step's through backward and the optimizer step. Forward and optimizer grow by
    exactly `held_output_bytes`; backward by the logits (and the fp32 K copies under autocast),
    which the prediction bounds."""
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    w = infer_workload(model, optimizer=optimizer, batch=7, seq=SEQ, autocast_dtype=autocast).workload
    predicted = estimate(infer_workload(model).spec, w).phase_peaks
    assert held_output_bytes(infer_workload(model).spec, w, 7 * SEQ) == held
    measured = dict.fromkeys(phases, 0)
    kept = {}
    with CpuMemoryTracker(history=False) as tracker:
        tracker.track(model)
        for _ in range(3):
            ids = torch.randint(0, VOCAB, (7, SEQ))
            tracker.reset_peak()
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast == "bf16"):
                kept["out"] = model(input_ids=ids, labels=ids)
            del ids  # the estimate counts the inputs in forward only
            measured["forward"] = max(measured["forward"], tracker.peak_bytes)
            tracker.reset_peak()
            kept["out"].loss.backward()
            measured["backward"] = max(measured["backward"], tracker.peak_bytes)
            tracker.reset_peak()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            measured["optimizer"] = max(measured["optimizer"], tracker.peak_bytes)
    assert measured == phases
    assert measured["forward"] == predicted["forward"] + held
    assert measured["optimizer"] == predicted["optimizer"] + held
    assert predicted["backward"] < measured["backward"] <= predicted["backward"] + held
    if autocast == "fp32":  # the peak of the step: +11.6 %, the logits exactly
        assert measured["backward"] - predicted["backward"] == 7 * SEQ * VOCAB * 4


def test_keeps_outputs_finds_the_edge_of_the_loop_that_keeps_them(small_setup):
    """The Trainer-idiom edge (7) OOMs when the output is kept; with keeps_outputs the prediction
    is the kept loop's own edge, confirmed in one probe."""
    model, optimizer, tracker = small_setup
    kept = {}
    step = _kept_step(model, optimizer, kept)
    result = find_batch_size(step, model=model, seq=SEQ, optimizer=optimizer, tracker=tracker, autocast_dtype="fp32",
                             keeps_outputs=True)
    assert (result.batch_size, result.predicted_batch) == (6, 6)
    assert result.probes == (Probe(6, True, 15_320_064),)
    assert "the step keeps the model's output through backward" in " ".join(result.notes)
    for batch, fits in ((6, True), (SMALL_EDGE, False)):  # the kept edge + 1 is the Trainer-idiom edge
        kept.clear()
        optimizer.state.clear()
        model.zero_grad(set_to_none=True)
        assert _runs(step, batch, steps=3) == fits


def test_requested_bytes_reads_c10_sizes():
    """c10's format_size: "N bytes" up to 1 KiB, then two decimals and KiB / MiB / GiB."""
    assert requested_bytes("CUDA out of memory. Tried to allocate 512 bytes. GPU 0 has a total capacity") == 512
    assert requested_bytes("Tried to allocate 1023 bytes") == 1023
    assert requested_bytes("Tried to allocate 2.00 MiB (GPU 0; 23.65 GiB total capacity)") == 2 * MiB
    assert requested_bytes("Tried to allocate 20.50 KiB") == 20_992
    assert requested_bytes("Tried to allocate 1.50 GiB") == 3 * 2**29
    assert requested_bytes("CUDA error: an illegal memory access") is None
    error = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 512 bytes. GPU 0 has 80 GiB")
    assert _requested_bytes(error, None) == 512


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
    # Doubling and bisection with real steps within SMOKE's 4 MiB, as `run_scenario(SMOKE)` ran them:
    # 1, 2, 4 and 8 fit, 16 does not; then 12 does not, 10 does, 11 does not.
    assert (row["true_max"], row["bisection_probes"]) == (10, 8)
    assert row["true_max"] * 0.97 <= found["batch"] <= row["true_max"]
    assert found["further_steps_ok"] and found["leaked_bytes"] == 0
    assert found["probes"] == 1
