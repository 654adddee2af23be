"""CpuMemoryTracker: the trace engine's counting rule on real CPU tensors, an OOM at capacity,
snapshots that `allocator replay` reads; the workload read from a live model."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llamem.model import load_model  # noqa: E402
from llamem.runtime import CpuMemoryTracker, TrackerSource, infer_workload  # noqa: E402
from llamem.trace.build import hf_config  # noqa: E402
from llamem.trace.run import trace  # noqa: E402
from llamem.workload import build_workload  # noqa: E402

TINY = {"num_hidden_layers": 2, "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
        "num_key_value_heads": 2, "vocab_size": 4096, "head_dim": 32}
BATCH, SEQ = 2, 128


@pytest.fixture(scope="module")
def spec():
    return load_model("llama-3.2-1b", overrides=TINY)


def _user_step(model, optimizer, vocab_size: int, batch: int = BATCH, seq: int = SEQ) -> None:
    """A plain bf16-autocast training step as a user writes it (what `llamem trace` runs for `train`)."""
    ids = torch.randint(0, vocab_size, (batch, seq))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    del loss, ids
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _traced_step_peak(spec) -> int:
    warnings.filterwarnings("ignore")
    # What `_user_step` runs: fp32 weights under bf16 autocast, foreach AdamW, clipping.
    report = trace(spec, build_workload("train", precision="bf16-mixed", optimizer="adamw", batch=BATCH, seq=SEQ))
    return max(report.phase_total_bytes(p) for p in ("forward", "backward", "optimizer"))


def test_training_step_peak_equals_the_trace(spec):
    torch.manual_seed(0)
    tracker = CpuMemoryTracker()
    with tracker:
        model = transformers.LlamaForCausalLM(hf_config(spec, build_workload("train", precision="bf16-mixed")))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        _user_step(model, optimizer, spec.vocab_size)  # the first step creates the optimizer state
        tracker.reset_peak()
        _user_step(model, optimizer, spec.vocab_size)
    traced = _traced_step_peak(spec)
    assert abs(tracker.peak_bytes - traced) <= 0.01 * traced
    # Same counting rule, same code: byte for byte here.
    assert tracker.peak_bytes == traced


def test_model_built_outside_is_counted_once_tracked(spec):
    model = transformers.LlamaForCausalLM(hf_config(spec, build_workload("train")))
    tensors = [*model.parameters(), *model.buffers()]  # the buffers: RoPE's inverse frequencies
    weights = sum((t.numel() * t.element_size() + 511) // 512 * 512 for t in tensors)
    with CpuMemoryTracker() as tracker:
        assert tracker.live_bytes == 0
        tracker.track(model)
        tracker.track(model)  # counted once
        assert tracker.live_bytes == weights
        assert tracker.live_by_category() == {"weights": weights}


def test_capacity_raises_torch_oom_and_frees_the_output():
    with CpuMemoryTracker(capacity_bytes=10 * 1024) as tracker:
        small = torch.zeros(1024)  # 4 KiB
        with pytest.raises(torch.OutOfMemoryError, match=r"^CUDA out of memory\. Tried to allocate 8.00 KiB"):
            torch.zeros(2048)
        assert tracker.live_bytes == 4096  # the refused tensor is gone
        assert tracker.num_ooms == 1
        del small
        assert tracker.live_bytes == 0
        torch.zeros(2048)  # fits once the first one is freed
    assert tracker.peak_bytes == 8192


def test_views_and_in_place_ops_allocate_nothing():
    with CpuMemoryTracker() as tracker:
        x = torch.ones(256, 256)
        before = tracker.live_bytes
        x.view(-1).mul_(2)
        x.t().add_(1)
        assert tracker.live_bytes == before == 256 * 256 * 4


def test_snapshot_replays_through_the_allocator(tmp_path):
    with CpuMemoryTracker(record_stacks=True) as tracker:
        a = torch.zeros(3 * 1024 * 1024)  # 12 MiB
        b = torch.zeros(1000)
        del a
        c = torch.ones(5 * 1024 * 1024)  # noqa: F841  (kept alive for the snapshot)
    path = tmp_path / "trace.json"
    tracker.write_snapshot(path)
    data = json.loads(path.read_text())
    assert [e["action"] for e in data["events"]] == ["alloc", "alloc", "free", "alloc"]
    assert [entry["size"] for entry in data["live"]] == [4096, 20 * 1024 * 1024]
    assert any("test_runtime_tracker.py" in frame for frame in data["live"][0]["stack"])
    run = subprocess.run([sys.executable, "-m", "llamem", "allocator", "replay", str(path), "--json"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["peak_allocated_bytes"] == 4096 + 20 * 1024 * 1024
    del b


def test_tracker_source_reads_like_a_gpu():
    with CpuMemoryTracker(capacity_bytes=2**20) as tracker:
        x = torch.zeros(1000)  # noqa: F841
        stats = TrackerSource(tracker).stats()
    assert stats["allocated_bytes"] == stats["reserved_bytes"] == 4096
    assert stats["capacity_bytes"] == 2**20 and stats["non_torch_bytes"] is None


def test_infer_reads_the_workload_of_a_live_model(spec, tmp_path):
    from peft import LoraConfig, get_peft_model

    model = transformers.LlamaForCausalLM(hf_config(spec, build_workload("train")))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, foreach=True)
    model.activation_checkpointing_enable()
    inferred = infer_workload(model, optimizer=optimizer, batch=4, seq=256, autocast_dtype="bf16")
    w = inferred.workload
    assert (w.task, w.batch, w.seq, w.precision, w.optimizer, w.ac_every) == ("train", 4, 256, "bf16-mixed", "sgd", 1)
    assert inferred.unknown == ()
    inferred.write_config(tmp_path / "config.json")
    command = inferred.command(str(tmp_path / "config.json"))
    run = subprocess.run([sys.executable, "-m", "llamem", *command.split()[1:], "--json"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["phases"] == inferred.predicted_phase_bytes()

    lora = get_peft_model(model.to(torch.bfloat16), LoraConfig(r=4, target_modules=["q_proj", "o_proj"]))
    w = infer_workload(lora, batch=1, seq=64).workload
    assert (w.task, w.lora_rank, w.lora_targets, w.precision) == ("lora", 4, ("q_proj", "o_proj"), "bf16")


def test_infer_says_what_it_could_not_read(spec):
    model = transformers.LlamaForCausalLM(hf_config(spec, build_workload("train")))
    inferred = infer_workload(model, optimizer=torch.optim.RMSprop(model.parameters()))
    joined = " | ".join(inferred.unknown)
    assert "RMSprop" in joined and "autocast" in joined and "batch" in joined and "seq" in joined


def test_import_llamem_runtime_stays_torch_free():
    code = ("import sys; sys.modules['torch'] = None; import llamem.runtime; "
            "print(sorted(llamem.runtime.__all__)[:1])")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("every", [1, 2, 3])
def test_infer_reads_checkpointing_every_k_layers(spec, every):
    model = transformers.LlamaForCausalLM(hf_config(spec, build_workload("train")).__class__(
        **{**hf_config(spec, build_workload("train")).to_dict(), "num_hidden_layers": 6}))
    model.activation_checkpointing_enable(every_n_layers=every)
    assert infer_workload(model, batch=1, seq=16, autocast_dtype="bf16").workload.ac_every == every


def test_infer_reads_the_precision_of_an_fp32_lora_model(spec):
    from peft import LoraConfig, get_peft_model

    model = transformers.LlamaForCausalLM(hf_config(spec, build_workload("train")))
    lora = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert infer_workload(lora, batch=1, seq=64, autocast_dtype="fp32").workload.precision == "fp32"
    assert infer_workload(lora, batch=1, seq=64, autocast_dtype="bf16").workload.precision == "bf16-mixed"


def test_infer_names_the_optimizer_steps_it_does_not_size(spec):
    model = transformers.LlamaForCausalLM(hf_config(spec, build_workload("train")))
    params = list(model.parameters())
    notes = {kind: infer_workload(model, optimizer=torch.optim.AdamW(params, **options), batch=1, seq=8,
                                  autocast_dtype="bf16").unknown
             for kind, options in (("loop", {}), ("foreach", {"foreach": True}), ("fused", {"fused": True}))}
    assert notes["foreach"] == ()
    assert notes["loop"] == ("optimizer: for-loop AdamW (torch's default for CPU tensors; llamem sizes the foreach "
                             "step CUDA tensors get: its optimizer phase errs high)",)
    assert notes["fused"] == ("optimizer: fused AdamW (llamem sizes the foreach step: its optimizer phase errs high)",)
    generation = infer_workload(model.eval(), batch=1, seq=8, task="infer")
    assert generation.unknown == ("new_tokens: not seen (llamem's default of 256 used)",)


@pytest.mark.parametrize("capacity", [0, -1, 1.5e6, True, "8GiB"])
def test_a_capacity_is_a_positive_integer(capacity):
    from llamem.errors import LlamemError

    with pytest.raises(LlamemError, match="capacity_bytes must be a positive integer number of bytes"):
        CpuMemoryTracker(capacity)


def test_allocator_settings_beyond_size_t_are_refused_with_the_limit():
    from llamem.allocator.config import AllocatorConfigError
    from llamem.runtime import configure_allocator

    with pytest.raises(AllocatorConfigError, match=r"out of range: at most 18446744073709551615"):
        configure_allocator(max_split_size_mb=2**70)
    with pytest.raises(AllocatorConfigError, match="takes a settings string"):
        configure_allocator(42)


def test_every_runtime_export_resolves():
    import llamem.runtime

    for name in llamem.runtime.__all__:
        assert getattr(llamem.runtime, name) is not None, name
