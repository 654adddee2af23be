"""The analytic engine's synthetic allocation schedule against the trace engine's real one.

Both are replayed through the same caching-allocator simulator. Where the schedule follows
transformers' and autograd's order op by op (LoRA and QLoRA, full-precision bf16 training
with checkpointing and the chunked loss, bf16 autocast training with or without checkpointing) the peak
reserved memory is the same to the byte; the other modes are bounded (documented in
docs/memory-model.md). Autocast with checkpointing is exact once the schedule keeps what torch keeps:
the rotary tables the checkpoints hold (each frame dies in its recomputed input norm's backward, the
first layer's with the embedding output, positions and tables), h1 saved by the post-attention norm, and
a recomputed tensor freed as soon as its backward node has read it."""

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("peft")

from llamem import build_workload, load_model  # noqa: E402
from llamem.allocator.replay import replay  # noqa: E402
from llamem.analytic.schedule import schedule  # noqa: E402
from llamem.trace.api import run_trace  # noqa: E402

EXACT = [
    dict(task="train", precision="bf16", ac_every=1, loss="chunked", optimizer="adafactor", batch=4, seq=256),
    dict(task="lora", ac_every=1, loss="full", batch=1, seq=512),
    dict(task="lora", ac_every=0, loss="full", batch=4, seq=256),
    dict(task="qlora", ac_every=1, loss="chunked", batch=1, seq=512),
    dict(task="train", precision="bf16-mixed", optimizer="adamw", ac_every=0, loss="full", batch=4, seq=256),
    dict(task="train", precision="bf16-mixed", optimizer="adamw", ac_every=1, loss="full", batch=4, seq=256),
    dict(task="train", precision="bf16-mixed", optimizer="adamw", ac_every=1, loss="full", batch=2, seq=512),
]
INFERENCE_EXACT = [
    ("debug", {}, dict(batch=2, seq=512, new_tokens=4)),
    ("debug", {}, dict(batch=1, seq=1000, new_tokens=4, prefill_chunk=300)),
    ("mistral-7b", {"num_hidden_layers": 2, "sliding_window": 256}, dict(batch=1, seq=700, new_tokens=4)),
]
BOUNDED = [
    dict(task="train", precision="bf16", optimizer="adamw", ac_every=0, loss="full", batch=4, seq=256),
    dict(task="train", precision="bf16", optimizer="adamw-fused", ac_every=0, loss="full", batch=4, seq=256),
    dict(task="train", precision="bf16", optimizer="adamw-loop", ac_every=0, loss="full", batch=4, seq=256),
]


def _reserved(options, model="debug", overrides=None):
    spec = load_model(model, overrides=overrides)
    workload = build_workload(**options)
    _, events = run_trace(spec, workload)
    return replay(events).peak_reserved_bytes, replay(schedule(spec, workload)).peak_reserved_bytes


@pytest.mark.parametrize("options", EXACT, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_op_exact_modes_reserve_what_the_trace_reserves(options):
    traced, scheduled = _reserved(options)
    assert scheduled == traced


@pytest.mark.parametrize("options", BOUNDED, ids=lambda o: "-".join(str(v) for v in o.values()))
def test_other_modes_within_seven_percent(options):
    traced, scheduled = _reserved(options)
    assert abs(scheduled / traced - 1) <= 0.07


@pytest.mark.parametrize("model, overrides, options", INFERENCE_EXACT, ids=str)
def test_generation_reserves_what_the_trace_reserves(model, overrides, options):
    traced, scheduled = _reserved(dict(task="infer", **options), model, overrides)
    assert scheduled == traced
