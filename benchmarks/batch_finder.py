"""Batch-size finders on real tiny Llama models under a CpuMemoryTracker with a capacity.

Three finders, each run on the same model and tracker in the same process:
- llamem: `llamem.runtime.find_batch_size`, the analytic prediction confirmed by real steps;
- accelerate: `accelerate.utils.find_executable_batch_size`, started at 512 (its default is 128,
  below the edge of some scenarios here; a user who does not know the edge starts high), which
  multiplies the batch by 0.9 after each OOM. It recognises the tracker's OOM: `should_reduce_batch_size`
  looks for " out of memory." in a one-argument RuntimeError, and torch.OutOfMemoryError("CUDA out
  of memory. ...") is one;
- power: Lightning's "power" mode, written here: double from 2 until an OOM, keep the last fit.

Every probe runs two training steps with a fresh optimizer state (the first step creates the
state, the second is the steady state), so all three look at the same memory. The true maximum
is found by doubling and bisection with the same real steps. After each finder, 5 further steps
at its batch (a fresh optimizer, as a training run starts) check that it does not OOM, and the
tracker's live bytes before and after the finder show whether it left anything behind.

Usage: python benchmarks/batch_finder.py [--out benchmarks/results/batch_finder.json] [--only NAME]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import warnings
from dataclasses import asdict, dataclass

import torch

warnings.filterwarnings("ignore")

MiB = 2**20
ACCELERATE_START = 512
POWER_START = 2
FURTHER_STEPS = 5
GOAL_PROBE_RATIO = 5.0
GOAL_WITHIN = 0.03


@dataclass(frozen=True)
class Scenario:
    name: str
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    seq: int
    capacity_bytes: int
    task: str = "train"
    """train (full fine-tune) or lora (peft r=8 on q_proj, v_proj, base weights in bf16)."""
    autocast: str = "fp32"
    """fp32 (no autocast) or bf16 (torch.autocast on fp32 weights); LoRA runs its bf16 base as is."""
    checkpointing: bool = False
    tell_autocast: bool = True
    """Whether llamem is told how the step runs; when not, it assumes bf16-mixed for fp32 weights."""


SCENARIOS = (
    Scenario("train-2L-h64-v512-s128", 2, 64, 128, 512, 128, 64 * MiB),
    Scenario("train-bf16-2L-h64-v1024-s128", 2, 64, 128, 1024, 128, 56 * MiB, autocast="bf16"),
    Scenario("train-2L-h64-v8192-s64", 2, 64, 128, 8192, 64, 200 * MiB),
    Scenario("lora-4L-h128-v2048-s256", 4, 128, 256, 2048, 256, 160 * MiB, task="lora"),
    Scenario("train-ckpt-4L-h64-v512-s256", 4, 64, 128, 512, 256, 48 * MiB, checkpointing=True),
    Scenario("train-autocast-not-given", 2, 64, 128, 512, 128, 64 * MiB, tell_autocast=False),
)
SMOKE = Scenario("smoke-1L-h32-v256-s64", 1, 32, 64, 256, 64, 4 * MiB)
"""The one scenario tests/test_runtime_batch.py runs: seconds, not minutes. Its true maximum is 10
(doubling to 16, bisection down to 10: 8 probes); 8 MiB gave 22 in 10 probes at twice the batches."""


def build_model(s: Scenario):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=s.vocab, hidden_size=s.hidden, intermediate_size=s.intermediate,
                         num_hidden_layers=s.layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max(2048, s.seq))
    model = LlamaForCausalLM(config)
    if s.checkpointing:
        model.gradient_checkpointing_enable()
    if s.task == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model.to(torch.bfloat16), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    model.train()
    return model


def make_optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)


def train_step(model, optimizer, s: Scenario, batch: int) -> None:
    trainable = [p for p in model.parameters() if p.requires_grad]
    ids = torch.randint(0, s.vocab, (batch, s.seq))
    autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.autocast == "bf16")
    with autocast:
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    del loss, ids
    torch.nn.utils.clip_grad_norm_(trainable, 1.0, foreach=True)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def fresh_steps(model, s: Scenario, batch: int, steps: int = 2) -> None:
    """What accelerate's and the power search's functions run: a new optimizer, `steps` steps."""
    model.zero_grad(set_to_none=True)
    optimizer = make_optimizer(model)
    for _ in range(steps):
        train_step(model, optimizer, s, batch)


def runs(model, s: Scenario, batch: int, steps: int = 2) -> bool:
    """Whether `steps` fresh steps at `batch` run; recovery outside the except block."""
    from llamem.runtime.batch import is_oom

    failed = False
    try:
        fresh_steps(model, s, batch, steps)
    except RuntimeError as error:
        if not is_oom(error):
            raise
        failed = True
    model.zero_grad(set_to_none=True)
    gc.collect()
    return not failed


def true_maximum(model, s: Scenario) -> tuple[int, int]:
    """Doubling from 1, then bisection, with real steps: (largest batch that runs, probes)."""
    probes, low, high = 1, 0, 1
    while runs(model, s, high):
        low, high, probes = high, 2 * high, probes + 1
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if runs(model, s, mid) else (low, mid)
        probes += 1
    return low, probes


def llamem_finder(model, s: Scenario, tracker) -> tuple[int, list[int], dict]:
    from llamem.runtime.batch import find_batch_size

    optimizer = make_optimizer(model)
    result = find_batch_size(lambda b: train_step(model, optimizer, s, b), model=model, seq=s.seq,
                             task=s.task, optimizer=optimizer, tracker=tracker,
                             autocast_dtype=s.autocast if s.tell_autocast and s.task == "train" else None)
    measured = next(p.peak_bytes for p in result.probes if p.fit and p.batch == result.batch_size)
    estimated = _estimated_peak(model, optimizer, s, result.batch_size)
    return result.batch_size, [p.batch for p in result.probes], {
        "predicted_batch": result.predicted_batch, "per_sample_bytes": result.per_sample_bytes,
        "probe_fits": [p.fit for p in result.probes], "measured_peak_bytes": measured,
        "estimated_peak_bytes": estimated, "estimate_error": estimated / measured - 1, "notes": list(result.notes)}


def _estimated_peak(model, optimizer, s: Scenario, batch: int) -> int:
    """The analytic peak of what the step really runs (autocast as it is, told or not)."""
    from llamem.analytic import estimate
    from llamem.runtime import infer_workload
    from llamem.workload import with_changes

    inferred = infer_workload(model, optimizer=optimizer, batch=batch, seq=s.seq, task=s.task,
                              autocast_dtype=s.autocast if s.task == "train" else None)
    return estimate(inferred.spec, with_changes(inferred.workload, batch=batch)).peak_allocated_bytes


def accelerate_finder(model, s: Scenario, tracker) -> tuple[int, list[int], dict]:
    from accelerate.utils import find_executable_batch_size

    tried: list[int] = []

    @find_executable_batch_size(starting_batch_size=ACCELERATE_START)
    def train(batch_size):
        tried.append(batch_size)
        fresh_steps(model, s, batch_size)
        return batch_size

    found = train()
    model.zero_grad(set_to_none=True)
    return found, tried, {"starting_batch_size": ACCELERATE_START}


def power_finder(model, s: Scenario, tracker) -> tuple[int, list[int], dict]:
    """Lightning's power mode: double from POWER_START until an OOM, keep the last fit."""
    tried: list[int] = []
    batch, last_fit = POWER_START, 0
    while True:
        tried.append(batch)
        if not runs(model, s, batch):
            break
        last_fit, batch = batch, 2 * batch
    if last_fit == 0:  # even the start failed: halve down to 1, as Lightning does
        while batch > 1 and not runs(model, s, batch := batch // 2):
            tried.append(batch)
        last_fit = batch
    return last_fit, tried, {"init_val": POWER_START}


FINDERS = {"llamem": llamem_finder, "accelerate": accelerate_finder, "power": power_finder}


def run_finder(name: str, model, s: Scenario, tracker, true_max: int) -> dict:
    gc.collect()
    live_before = tracker.live_bytes
    start = time.perf_counter()
    found, tried, extra = FINDERS[name](model, s, tracker)
    seconds = time.perf_counter() - start
    gc.collect()
    leaked = tracker.live_bytes - live_before
    further_ok = runs(model, s, found, steps=FURTHER_STEPS)
    return {"batch": found, "probes": len(tried), "tried": tried, "seconds": seconds,
            "of_true_max": found / true_max, "within_goal": true_max * (1 - GOAL_WITHIN) <= found <= true_max,
            "further_steps_ok": further_ok, "leaked_bytes": leaked, **extra}


def run_scenario(s: Scenario, finders=tuple(FINDERS)) -> dict:
    from llamem.runtime import CpuMemoryTracker

    model = build_model(s)
    with CpuMemoryTracker(s.capacity_bytes, history=False) as tracker:
        tracker.track(model)
        true_max, bisection_probes = true_maximum(model, s)
        results = {name: run_finder(name, model, s, tracker, true_max) for name in finders}
    if "accelerate" in results:
        for row in results.values():
            row["time_vs_accelerate"] = row["seconds"] / results["accelerate"]["seconds"]
            row["probes_vs_accelerate"] = results["accelerate"]["probes"] / row["probes"]
    return {"scenario": asdict(s), "true_max": true_max, "bisection_probes": bisection_probes, "finders": results}


def table(rows: list[dict]) -> str:
    head = (f"{'scenario':<30} {'max':>4} | {'llamem':>18} | {'accelerate@512':>15} | {'power':>15} | "
            f"{'probes':>6} {'time':>5} | {'5 steps after':>13}")
    sub = (f"{'':<30} {'':>4} | {'pred   b  probes  s':>18} | {'b  probes  s':>15} | {'b  probes  s':>15} | "
           f"{'acc/ll':>6} {'ll/acc':>5} | {'ll/acc/pow':>13}")
    lines = [head, sub, "-" * len(head)]
    for row in rows:
        f = row["finders"]
        ll = f"{f['llamem']['predicted_batch']:>4} " + _cell(f["llamem"])
        ok = "/".join("ok" if f[n]["further_steps_ok"] else "OOM" for n in FINDERS)
        lines.append(f"{row['scenario']['name']:<30} {row['true_max']:>4} | {ll:>18} | {_cell(f['accelerate']):>15} | "
                     f"{_cell(f['power']):>15} | {f['llamem']['probes_vs_accelerate']:>5.1f}x "
                     f"{f['llamem']['time_vs_accelerate']:>5.2f} | {ok:>13}")
    lines += ["", "estimate at llamem's batch vs the measured peak of its probe (two steps, the tracker's count):"]
    lines += [f"  {row['scenario']['name']:<30} {row['finders']['llamem']['estimate_error']:+.2%}" for row in rows]
    return "\n".join(lines)


def _cell(found: dict) -> str:
    return f"{found['batch']:>3} {found['probes']:>3} {found['seconds']:>5.1f}"


def summary(rows: list[dict]) -> str:
    ll = [r["finders"]["llamem"] for r in rows]
    probes = min(r["probes_vs_accelerate"] for r in ll)
    within = sum(r["within_goal"] for r in ll)
    safe = sum(r["further_steps_ok"] for r in ll)
    exact = sum(r["batch"] == row["true_max"] for r, row in zip(ll, rows))
    return (f"llamem: at least {probes:.1f}x fewer probes than accelerate (goal {GOAL_PROBE_RATIO:.0f}x); "
            f"{within} of {len(rows)} within {GOAL_WITHIN:.0%} of the true maximum ({exact} exact); "
            f"{safe} of {len(rows)} ran {FURTHER_STEPS} further steps without OOM")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="benchmarks/results/batch_finder.json")
    parser.add_argument("--only", default=None, help="run the one scenario of this name")
    args = parser.parse_args()
    chosen = [s for s in SCENARIOS if args.only in (None, s.name)]
    start = time.perf_counter()
    rows = [run_scenario(s) for s in chosen]
    text = "\n".join([table(rows), "", summary(rows), f"total {time.perf_counter() - start:.0f} s"])
    print(text)
    with open(args.out, "w") as handle:
        json.dump({"scenarios": rows, "summary": summary(rows)}, handle, indent=1)
    with open(args.out.removesuffix(".json") + ".txt", "w") as handle:
        handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
