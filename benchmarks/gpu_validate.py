"""Tier 3: estimates and traces against a real GPU.

One command on a CUDA machine: builds each model of the matrix with random weights, runs the
workload (the same code path as `llamem trace`), reads max_memory_allocated,
max_memory_reserved and NVML used memory, and writes
benchmarks/results/<date>-<gpu>.json with estimate, trace and measurement side by side.
Then the runtime checks (`runtime_checks`, about 4 minutes at most): the memory monitor on a real
training loop (measured against predicted, per phase), the batch finder under a card limited with
`set_per_process_memory_fraction`, and one OOM provoked, dumped and explained.
Designed to finish within 8 minutes on one H100-class GPU. Without CUDA it says so and exits 0.

Usage: python benchmarks/gpu_validate.py [--quick] [--out-dir benchmarks/results]
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import time
import warnings

warnings.filterwarnings("ignore")

MATRIX = [
    ("llama-3.2-1b", dict(task="train", batch=4, seq=1024)),
    ("llama-3.2-1b", dict(task="lora", batch=4, seq=2048)),
    ("llama-3.2-3b", dict(task="train", precision="bf16", batch=2, seq=1024)),
    ("llama-3.2-3b", dict(task="lora", batch=4, seq=2048)),
    ("llama-3.1-8b", dict(task="infer", batch=1, seq=2048, new_tokens=16)),
    ("llama-3.1-8b", dict(task="infer", batch=4, seq=8192, new_tokens=16)),
    ("llama-3.1-8b", dict(task="infer", batch=1, seq=32768, new_tokens=8)),
    ("llama-3.1-8b", dict(task="lora", ac_every=1, batch=2, seq=4096)),
    ("llama-3.1-8b", dict(task="lora", batch=1, seq=2048)),
]


def allocator_replay_check(torch) -> dict:
    """Record a real allocation history on one stream, replay it through the simulator, and
    compare peak reserved memory and segment counts (target: exact for the native allocator)."""
    from llamem.allocator.replay import replay_trace, trace_from_data

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    generator = torch.Generator(device="cpu").manual_seed(0)
    live = []
    for step in range(3000):  # a mix of small, medium and large tensors, freed at random
        size = int(torch.randint(1, 64 * 2**20, (1,), generator=generator)) >> int(
            torch.randint(0, 12, (1,), generator=generator))
        live.append(torch.empty(max(size, 1), dtype=torch.uint8, device="cuda"))
        if len(live) > 40:
            live.pop(int(torch.randint(0, len(live), (1,), generator=generator)))
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    stats = torch.cuda.memory_stats()
    result = replay_trace(trace_from_data(snapshot))
    del live
    torch.cuda.empty_cache()
    return {"real_peak_reserved_bytes": stats["reserved_bytes.all.peak"],
            "simulated_peak_reserved_bytes": result.peak_reserved_bytes,
            "real_segments_peak": stats["segment.all.peak"],
            "simulated_segments_peak": result.sim.memory_stats()["segment.all.peak"],
            "real_peak_allocated_bytes": stats["allocated_bytes.all.peak"],
            "simulated_peak_allocated_bytes": result.peak_allocated_bytes}


RUNTIME_MODEL = "llama-3.2-1b"
RUNTIME_SEQ = 1024
FINDER_CARD_BYTES = 24 * 2**30
"""The batch finder's card: a 24 GiB limit (an RTX 4090) carved out of the big card."""
OOM_CARD_BYTES = 8 * 2**30


def _tiny_loop(torch, model, optimizer, batch: int, steps: int, monitor=None) -> None:
    """The training step `llamem trace` models: bf16 autocast over fp32 weights, AdamW, clipping."""
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (batch, RUNTIME_SEQ), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        del loss, ids
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if monitor is not None:
            monitor.step()


def _fresh_model(torch):
    from transformers import LlamaForCausalLM

    from llamem import build_workload, load_model
    from llamem.trace.build import hf_config

    torch.cuda.empty_cache()
    config = hf_config(load_model(RUNTIME_MODEL), build_workload("train"))
    model = LlamaForCausalLM(config).cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=1e-5, foreach=True)


def _limit_card(torch, card_bytes: int | None) -> None:
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(1.0 if card_bytes is None else card_bytes / total)


def monitor_check(torch, out_dir: str) -> dict:
    from llamem.runtime import MemoryMonitor

    model, optimizer = _fresh_model(torch)
    log = f"{out_dir}/gpu-monitor.jsonl"
    with MemoryMonitor(model, optimizer, log) as monitor:
        _tiny_loop(torch, model, optimizer, batch=4, steps=3, monitor=monitor)
    summary = monitor.summary()
    print(summary, flush=True)
    steady = monitor.records[-1]
    del model, optimizer
    return {"log": log, "summary": summary, "steady_step": steady,
            "predicted": monitor.workload_record.get("predicted") if monitor.workload_record else None}


def finder_check(torch) -> dict:
    from llamem.runtime import find_batch_size

    model, optimizer = _fresh_model(torch)
    _limit_card(torch, FINDER_CARD_BYTES)
    try:
        found = find_batch_size(lambda batch: _tiny_loop(torch, model, optimizer, batch, steps=1), model=model,
                                seq=RUNTIME_SEQ, optimizer=optimizer, device_bytes=FINDER_CARD_BYTES,
                                autocast_dtype="bf16")
    finally:
        _limit_card(torch, None)
    result = {"batch_size": found.batch_size, "predicted_batch": found.predicted_batch,
              "probes": [[p.batch, p.fit] for p in found.probes], "notes": list(found.notes)}
    print(f"batch finder on a {FINDER_CARD_BYTES / 2**30:.0f} GiB limit: {json.dumps(result)}", flush=True)
    return result


def oom_check(torch, out_dir: str) -> dict:
    """Provoke an OOM on an 8 GiB limit, dump it, explain it."""
    from llamem.reporters.runtime_report import render_explanation
    from llamem.runtime import oom_guard
    from llamem.runtime.explain import explain_oom

    model, optimizer = _fresh_model(torch)
    directory = f"{out_dir}/gpu-oom"
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=200_000)
    _limit_card(torch, OOM_CARD_BYTES)
    failed = False
    try:
        with oom_guard(directory, model, optimizer, batch=16, seq=RUNTIME_SEQ, autocast_dtype="bf16"):
            _tiny_loop(torch, model, optimizer, batch=16, steps=1)
    except torch.OutOfMemoryError:
        failed = True
    # Recovery outside the except block: its traceback held the failed step's tensors.
    _limit_card(torch, None)
    torch.cuda.memory._record_memory_history(enabled=None)
    del model, optimizer
    torch.cuda.empty_cache()
    if not failed:
        return {"error": "no OOM at batch 16 on the 8 GiB limit"}
    text = render_explanation(explain_oom(directory, host_budget_bytes=64 * 2**30))
    print(text, flush=True)
    return {"dump": directory, "explanation": text}


def runtime_checks(torch, out_dir: str) -> dict:
    out: dict = {}
    for name, check in (("monitor", lambda: monitor_check(torch, out_dir)), ("batch_finder", lambda: finder_check(torch)),
                        ("explained_oom", lambda: oom_check(torch, out_dir))):
        start = time.perf_counter()
        try:
            out[name] = check()
        except Exception as err:  # one failed check must not lose the others' results
            out[name] = {"error": f"{type(err).__name__}: {err}"}
            print(f"{name}: {out[name]['error']}", flush=True)
        out[name]["seconds"] = time.perf_counter() - start
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="first three rows only")
    parser.add_argument("--out-dir", default="benchmarks/results")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        print("gpu_validate needs torch with CUDA; torch is not installed. Nothing to do.")
        return 0
    if not torch.cuda.is_available():
        print("gpu_validate needs a CUDA device; none is visible here. Nothing to do.")
        return 0
    from llamem import build_workload, load_model
    from llamem.measure import measure
    from llamem.sizing import estimate_report
    from llamem.trace.run import trace

    gpu = torch.cuda.get_device_name(0)
    rows = []
    for model, options in MATRIX[:3] if args.quick else MATRIX:
        spec, workload = load_model(model), build_workload(**options)
        start = time.perf_counter()
        est = estimate_report(spec, workload, details=False)
        traced = trace(spec, workload)
        try:
            measured = measure(spec, workload)
        except torch.OutOfMemoryError as err:
            measured = {"error": str(err).splitlines()[0]}
            torch.cuda.empty_cache()
        row = {"model": model, "options": options, "estimate_peak_allocated_bytes": est.peak_allocated_bytes,
               "estimate_peak_reserved_bytes": est.peak_reserved_bytes, "estimate_device_bytes": est.device_bytes,
               "estimate_phases": est.phase_peaks, "trace_peak_allocated_bytes": traced.peak_allocated_bytes,
               "trace_phases": traced.phase_peaks, "measured": measured, "seconds": time.perf_counter() - start}
        rows.append(row)
        got = measured.get("peak_allocated_bytes")
        print(f"{model:<14} {json.dumps(options):<62} est {est.peak_allocated_bytes / 2**30:7.2f} "
              f"trace {traced.peak_allocated_bytes / 2**30:7.2f} "
              f"measured {got / 2**30 if got else float('nan'):7.2f} GiB "
              f"reserved {measured.get('peak_reserved_bytes', 0) / 2**30:7.2f} GiB", flush=True)
    replay_check = allocator_replay_check(torch)
    print(f"allocator replay: {json.dumps(replay_check)}")
    runtime = runtime_checks(torch, args.out_dir)
    slug = re.sub(r"[^a-z0-9]+", "-", gpu.lower()).strip("-")
    path = f"{args.out_dir}/{datetime.date.today().isoformat()}-{slug}.json"
    with open(path, "w") as handle:
        json.dump({"gpu": gpu, "torch": torch.__version__, "rows": rows, "allocator_replay": replay_check,
                   "runtime": runtime},
                  handle, indent=1)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
