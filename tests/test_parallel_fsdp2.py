"""ZeRO-3 as torch FSDP2 runs it: `llamem estimate --sharding zero3 --engine fsdp2`.

The accounting (`llamem.parallel.fsdp2_phases`) term by term on a tiny Llama, by hand; then the
launch bundle's FSDP2 ranks (train.py, 2 planned GPUs, 2 optimizer steps) against the estimate:

- one rank under torch's fake process group, whose collectives allocate nothing and move no data,
  as NCCL works in FSDP2's own buffers: what a GPU of the run holds. Within 2 % of the estimate.
- the 2 gloo ranks of `launch.sh --cpu`: gloo reduce-scatters a clone of its input
  (`ProcessGroupGloo::reduce_scatter_tensor_coalesced` all-reduces `input.clone()`), which a rank
  holds at its reduce-scatter and at times until gloo's worker lets go of it. Those ranks peak from
  2 % below the estimate to one reduce-scatter input (4 bytes per parameter of a layer) above it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import re
import subprocess
import sys

import pytest

from llamem.cli import main
from llamem.errors import InvalidWorkload
from llamem.model import load_model
from llamem.parallel import (Fsdp2Layout, Layout, fsdp2_phases, fsdp2_unit, fsdp2_units, make_layout, per_gpu_phases,
                             with_engine)
from llamem.workload import build_workload

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
"""test_bundle_runs.py's tiny Llama: 139,584 parameters, 36,992 per decoder layer, 32,768 in the
embedding and in lm_head, 64 in the final norm."""
WORKLOAD = {"batch": 2, "seq": 16, "precision": "bf16-mixed", "optimizer": "adamw"}
CASES = {"bf16-mixed": {}, "grad-accum 2": {"batch": 1, "grad_accum": 2}, "pure bf16": {"precision": "bf16", "optimizer": "adamw-fused"}}
"""The bundle runs held to the estimate: the layouts of the measurement table in docs/memory-model.md."""
FLAGS = {"batch": "--batch", "seq": "--seq", "grad_accum": "--grad-accum", "precision": "--precision",
         "optimizer": "--optimizer"}

# Hand-derived terms of TINY on 2 ranks, bf16-mixed (fp32 storage and reduce, bf16 parameters); every
# tensor rounded up to 512 bytes. A layer: q, o 64 x 64; k, v 32 x 64; gate, up 128 x 64; down 64 x 128;
# two norms of 64 (36,992 parameters).
LAYER_SHARDS = 8192 + 4096 + 4096 + 8192 + 3 * 16384 + 2 * 512  # 4 bytes x half of each: 74,752
LAYER_GATHERED = 8192 + 4096 + 4096 + 8192 + 3 * 16384 + 2 * 512  # 2 bytes x all of each: 74,752
LAYER_BUFFER = 74240  # one flat all-gather output: 2 x 36,992 = 73,984 bytes, rounded
LAYER_RS_INPUT = 4 * 36992  # 147,968: fp32, all of the layer
LAYER_GRAD_SHARD = 74240  # fp32, half of the layer: 73,984 bytes, rounded
EMBEDDING_SHARDS = HEAD_SHARDS = 4 * 512 * 64 // 2  # 65,536 each; the final norm's shard: 512 more
SHARDS = EMBEDDING_SHARDS + HEAD_SHARDS + 512 + 2 * LAYER_SHARDS  # 281,088
STEPS = 512 * (1 + 2 + 2 * 9)  # AdamW's step counter per parameter tensor
GRADS = 65536 + 66048 + 2 * LAYER_GRAD_SHARD  # sharded gradients: embedding, head (4 x 32,832 / 2, rounded), layers
ROPE_BUFFERS = 1024  # inv_freq and original_inv_freq
INPUTS = 512
HEAD_GATHERED = 65536 + 512  # lm_head and the final norm in bf16; its flat all-gather output is as large
EMBEDDING_BUFFER = 65536
ROPE, LAYER_SAVED = 1024, 79360  # activations (the single-GPU engine's for bf16): cos and sin; one layer's saved set
ACTIVATIONS_FORWARD, LOGITS_FORWARD = 176640, 165888


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return path


@pytest.fixture(scope="module")
def spec(config_path):
    return load_model(None, config_path=str(config_path))


def _phases(spec, world: int = 2, **fields) -> dict[str, dict[str, int]]:
    w = build_workload("train", **{**WORKLOAD, **fields})
    return fsdp2_phases(spec, w, make_layout(spec, w, gpus=world, sharding="zero3", engine="fsdp2"))


# The accounting, by hand -------------------------------------------------------------------------
def test_a_decoder_layer_unit_holds_its_terms(spec):
    w = build_workload("train", **WORKLOAD)
    layer = [(fan_out, fan_in) for fan_in, fan_out in spec.layer_linear_shapes().values()] + [(64, 1), (64, 1)]
    unit = fsdp2_unit(layer, w, 2)
    assert (unit.shards_bytes, unit.gathered_bytes, unit.grads_bytes, unit.buffer_bytes) == (
        LAYER_SHARDS, LAYER_GATHERED, LAYER_GATHERED, LAYER_BUFFER)
    assert (unit.rs_input_bytes, unit.grad_shard_bytes, unit.last_grad_bytes, unit.tensors) == (
        LAYER_RS_INPUT, LAYER_GRAD_SHARD, 512, 9)  # the last parameter: post_attention_layernorm's weight
    # A row count that does not divide: padded to 3 equal shards of 2 rows (FSDP2 pads chunk 0's size).
    odd = fsdp2_unit([(5, 128)], w, 3)
    assert (odd.shards_bytes, odd.gathered_bytes, odd.grads_bytes, odd.rs_input_bytes) == (
        1024, 1536, 1536, 4 * 6 * 128)


def test_units_come_in_backward_order_with_their_activations(spec):
    units, root = fsdp2_units(spec, build_workload("train", **WORKLOAD), 2)
    assert root is None and len(units) == 4  # head, layer 1, layer 0, embedding
    head, top, bottom, embedding = units
    assert (head.shards_bytes, head.last_grad_bytes, head.grad_shard_bytes) == (512 + HEAD_SHARDS, 65536, 66048)
    assert top.saved_bytes == bottom.saved_bytes == top.kept_bytes == LAYER_SAVED
    assert head.saved_bytes == 12800 + 4096  # the final norm's saved tensors and the output lm_head keeps
    assert (embedding.shards_bytes, embedding.buffer_bytes, embedding.saved_bytes) == (EMBEDDING_SHARDS,
                                                                                       EMBEDDING_BUFFER, 0)


def test_load_and_optimizer_hold_the_shards_and_their_state(spec):
    phases = _phases(spec)
    assert phases["load"] == {"weights": SHARDS + ROPE_BUFFERS}
    # AdamW's moments on the fp32 shards, every sharded gradient, foreach AdamW's sqrt of each shard.
    assert phases["optimizer"] == {"weights": SHARDS + ROPE_BUFFERS, "optimizer/exp_avg": SHARDS,
                                   "optimizer/exp_avg_sq": SHARDS, "optimizer/step": STEPS,
                                   "gradients": GRADS, "temporaries": SHARDS}
    assert sum(phases["optimizer"].values()) == 1416192  # measured on a CPU rank: 1,416,704 (+ the mesh's 512)


def test_forward_holds_the_head_gathered_twice_at_the_loss(spec):
    """The head's unit, gathered, and its all-gather output, which the root frees after its forward."""
    base = {"weights": SHARDS + ROPE_BUFFERS, "optimizer/exp_avg": SHARDS, "optimizer/exp_avg_sq": SHARDS,
            "optimizer/step": STEPS, "inputs": INPUTS}
    expected = {**base, "weights/gathered": 2 * HEAD_GATHERED, "activations": ACTIVATIONS_FORWARD,
                "logits": LOGITS_FORWARD}
    assert _phases(spec)["forward"] == expected
    # With accumulation the first micro-batch's sharded gradients are there too.
    accumulated = _phases(spec, grad_accum=2)["forward"]
    assert accumulated == {**expected, "gradients": GRADS}


def test_backward_peaks_with_the_bottom_layer_at_work(spec):
    """Layer 0 at work: gathered, with its gradients and the embedding's prefetched all-gather output,
    the head's and layer 1's sharded gradients, layer 1's reduce-scatter input, its own saved set."""
    backward = _phases(spec)["backward"]
    assert backward == {"weights": SHARDS + ROPE_BUFFERS, "optimizer/exp_avg": SHARDS, "optimizer/exp_avg_sq": SHARDS,
                        "optimizer/step": STEPS, "inputs": INPUTS,
                        "gradients": 66048 + LAYER_GRAD_SHARD, "gradients/reduce_scatter": LAYER_RS_INPUT,
                        "activations": ROPE + LAYER_SAVED, "weights/gathered": LAYER_GATHERED + EMBEDDING_BUFFER,
                        "gradients/unsharded": LAYER_GATHERED}
    assert sum(backward.values()) == 1439232  # measured (fake process group): 1,419,776


def test_accumulation_keeps_every_sharded_gradient_through_backward(spec):
    """Layer 1 at work now: all sharded gradients of the first micro-batch, the head's reduce-scatter
    input (4 x 32,832 bytes, rounded), both layers' saved sets, layer 0 prefetched."""
    backward = _phases(spec, batch=1, grad_accum=2)["backward"]
    assert {k: backward[k] for k in ("gradients", "gradients/reduce_scatter", "weights/gathered",
                                     "gradients/unsharded", "activations")} == {
        "gradients": GRADS, "gradients/reduce_scatter": 131584, "weights/gathered": LAYER_GATHERED + LAYER_BUFFER,
        "gradients/unsharded": LAYER_GATHERED, "activations": ROPE + 2 * 40448}  # batch 1: half the saved sets
    assert sum(backward.values()) == 1572864  # measured (fake process group): 1,561,088


def test_pure_bf16_keeps_no_fp32_copy(spec):
    """Storage, reduce and parameters all bf16: half the shards, the state and the sharded gradients."""
    phases = _phases(spec, precision="bf16")
    shards = 32768 + 32768 + 512 + 2 * (4096 + 2048 + 2048 + 4096 + 3 * 8192 + 2 * 512)
    assert phases["load"] == {"weights": shards + ROPE_BUFFERS} and shards == 141824
    assert phases["optimizer"]["gradients"] == 32768 + 33280 + 2 * 37376  # 2 x half of each unit, rounded
    assert sum(phases["forward"].values()) == 912384  # measured: 912,896 (+ the mesh's 512)


def test_tied_embeddings_stay_gathered_in_the_root(config_path, tmp_path):
    """The root's unit (embedding = head, final norm) is gathered from the first forward on; at the loss
    the top layer's all-gather output is the one the root frees after its forward."""
    path = tmp_path / "tied.json"
    path.write_text(json.dumps({**TINY, "tie_word_embeddings": True}))
    tied = load_model(None, config_path=str(path))
    units, root = fsdp2_units(tied, build_workload("train", **WORKLOAD), 2)
    assert len(units) == 2 and root.gathered_bytes == HEAD_GATHERED
    phases = _phases(tied)
    assert phases["forward"]["weights/gathered"] == HEAD_GATHERED + LAYER_BUFFER
    assert sum(phases["backward"].values()) == 1242624  # measured (fake process group): 1,248,256


def test_sgd_keeps_a_momentum_and_no_step_temporaries(spec):
    optimizer = _phases(spec, optimizer="sgd")["optimizer"]
    assert optimizer == {"weights": SHARDS + ROPE_BUFFERS, "optimizer/momentum_buffer": SHARDS, "gradients": GRADS}


# Layouts and the command line --------------------------------------------------------------------
def test_the_engine_is_a_layout_attribute_that_keeps_the_fields(spec):
    w = build_workload("train", **WORKLOAD)
    deepspeed = make_layout(spec, w, gpus=2, sharding="zero3")
    fsdp2 = make_layout(spec, w, gpus=2, sharding="zero3", engine="fsdp2")
    assert (type(deepspeed), deepspeed.engine, deepspeed.describe()) == (Layout, "deepspeed", "zero3 x2")
    assert (type(fsdp2), fsdp2.engine, fsdp2.describe()) == (Fsdp2Layout, "fsdp2", "fsdp2 x2")
    assert dataclasses.asdict(fsdp2) == dataclasses.asdict(deepspeed)  # plans as JSON keep their layout dict
    assert fsdp2 != deepspeed
    assert with_engine(fsdp2, "deepspeed") == deepspeed and with_engine(deepspeed, "fsdp2") == fsdp2
    assert dataclasses.replace(fsdp2, dp=4).engine == "fsdp2"
    assert per_gpu_phases(spec, w, fsdp2) == fsdp2_phases(spec, w, fsdp2)


def test_fsdp2_refuses_what_it_does_not_size(spec):
    w = build_workload("lora", batch=2, seq=16, optimizer="adafactor")
    with pytest.raises(InvalidWorkload) as err:
        make_layout(spec, w, gpus=4, tp=2, sharding="zero2", offload="optimizer", engine="fsdp2")
    assert err.value.problems == [
        "--engine fsdp2 sizes ZeRO-3 as torch FSDP2 runs it: add --sharding zero3, or drop --engine fsdp2 (ZeRO-1/2 "
        "and DDP are sized as DeepSpeed and torch run them)",
        "--engine fsdp2 sizes data parallelism alone: drop --tp and --pp, or drop --engine fsdp2",
        "--engine fsdp2 sizes no offload: drop --offload, or drop --engine fsdp2 (DeepSpeed's ZeRO-Offload)",
        "--engine fsdp2 sizes full fine-tuning (--task train) for now: drop --engine fsdp2 for --task lora",
        "--engine fsdp2 sizes foreach and fused AdamW and SGD on the shards: use --optimizer adamw-fused, adamw or "
        "sgd, or drop --engine fsdp2 for adafactor"]
    with pytest.raises(InvalidWorkload, match="--engine horovod: choose one of deepspeed, fsdp2, megatron"):
        make_layout(spec, build_workload("train"), gpus=2, sharding="zero3", engine="horovod")
    with pytest.raises(InvalidWorkload, match="--engine megatron sizes data parallel"):
        make_layout(spec, build_workload("train"), gpus=2, sharding="zero3", engine="megatron")


def _cli(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


def test_estimate_engine_option(config_path):
    args = ["estimate", "--config", str(config_path), "--batch", "2", "--seq", "16", "--precision", "bf16-mixed",
            "--optimizer", "adamw", "--gpus", "2"]
    assert _cli(*args, "--sharding", "zero3", "--engine", "deepspeed") == _cli(*args, "--sharding", "zero3")
    code, out = _cli(*args, "--sharding", "zero3", "--engine", "fsdp2", "--json")
    report = json.loads(out)
    assert (code, report["layout"], report["peak_allocated_bytes"], report["peak_phase"]) == (
        0, "fsdp2 x2", 1439232, "backward")
    code, out = _cli(*args, "--engine", "fsdp2", "--json")  # DDP by default on 2 GPUs
    assert code == 1 and json.loads(out)["error"]["message"] == (
        "invalid workload:\n  - --engine fsdp2 sizes ZeRO-3 as torch FSDP2 runs it: add --sharding zero3, or drop "
        "--engine fsdp2 (ZeRO-1/2 and DDP are sized as DeepSpeed and torch run them)")


def test_fsdp2_bundle_readme_compares_with_the_fsdp2_estimate(spec, config_path, tmp_path):
    from llamem.bundle import emit_bundle, layout_plan
    from llamem.gpus import get_gpu

    w = build_workload("train", **WORKLOAD)
    plan = layout_plan(spec, w, make_layout(spec, w, gpus=2, sharding="zero3"), get_gpu("h100"),
                       model_args=("--config", str(config_path)))
    emit_bundle(plan, tmp_path)
    readme = (tmp_path / "README.md").read_text()
    assert f"compare with `peak_allocated_bytes` of `{plan.command} --engine fsdp2 --json` (1,439,232)" in readme
    assert "llamem sizes FSDP2 as it runs with `--engine fsdp2`" in readme


# The bundle's ranks ------------------------------------------------------------------------------
FAKE_RANK = """
import runpy, sys
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

real = dist.init_process_group
dist.init_process_group = lambda *args, **kwargs: real("fake", store=FakeStore(), rank=0, world_size=2)
for script in sys.argv[1:]:
    sys.argv = [script, "--cpu", "--random-init", "--max-steps", "2"]
    print("bundle", script, flush=True)
    runpy.run_path(script, run_name="__main__")
"""
"""Rank 0 of 2 of each bundle's train.py, one after the other, with torch's fake process group."""
PEAK = re.compile(r"^rank (\d+) peak_bytes=(\d+)$")


def _start(config_path, tmp_path_factory, fields: dict):
    """The 2-GPU zero3 bundle of TINY (which the bundle runs with FSDP2), emitted and its gloo run started (the
    session's: test_bundle_runs.py's FSDP2 bundle is the bf16-mixed case)."""
    from bundle_runner import start_run

    from llamem.bundle import layout_plan
    from llamem.gpus import get_gpu

    spec = load_model(None, config_path=str(config_path))  # its name, the path, is in train.py
    w = build_workload("train", **{**WORKLOAD, **fields})
    plan = layout_plan(spec, w, make_layout(spec, w, gpus=2, sharding="zero3"), get_gpu("h100"),
                       model_args=("--config", str(config_path)))
    return start_run(tmp_path_factory, plan, timeout_s=300)


def _estimate(config_path, fields: dict) -> int:
    """`llamem estimate --sharding zero3 --engine fsdp2`'s peak for the case."""
    args = [item for key, value in {**WORKLOAD, **fields}.items() for item in (FLAGS[key], str(value))]
    code, out = _cli("estimate", "--config", str(config_path), *args, "--gpus", "2", "--sharding", "zero3",
                     "--engine", "fsdp2", "--json")
    assert code == 0
    return json.loads(out)["peak_allocated_bytes"]


@pytest.fixture(scope="module")
def runs(config_path, tmp_path_factory):
    """Per case: the estimate, the fake-process-group rank's peak and the two gloo ranks' peaks. The
    gloo runs and the fake ranks run side by side."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from bundle_runner import tiny_config_path

    tiny = tiny_config_path(tmp_path_factory)  # TINY at the path of the other bundle tests' runs
    gloo = {case: _start(tiny, tmp_path_factory, fields) for case, fields in CASES.items()}
    estimates = {case: _estimate(config_path, fields) for case, fields in CASES.items()}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    scripts = [str(pending.folder / "train.py") for pending in gloo.values()]
    fake = subprocess.run([sys.executable, "-c", FAKE_RANK, *scripts], capture_output=True, text=True,
                          cwd=tmp_path_factory.mktemp("fsdp2-fake"), timeout=300,
                          env={**env, "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert fake.returncode == 0, fake.stdout[-2000:] + fake.stderr[-4000:]
    fake_peaks = [int(m[2]) for line in fake.stdout.splitlines() if (m := PEAK.match(line))]
    results = {}
    for (case, pending), fake_peak in zip(gloo.items(), fake_peaks, strict=True):
        stdout = pending.result().stdout
        ranks = sorted(int(m[2]) for line in stdout.splitlines() if (m := PEAK.match(line)))
        assert len(ranks) == 2, stdout
        results[case] = {"estimate": estimates[case], "fake": fake_peak, "gloo": ranks}
    print(json.dumps(results, indent=1))
    return results


@pytest.mark.parametrize("case", CASES)
def test_a_rank_peaks_at_the_fsdp2_estimate(runs, case):
    """Measured (fake process group) against estimated: bf16-mixed 1,419,776 / 1,439,232 (-1.4 %), 2
    accumulation steps of batch 1 1,561,088 / 1,572,864 (-0.7 %), pure bf16 with fused AdamW 912,896 / 920,576 (-0.8 %)."""
    result = runs[case]
    assert abs(result["fake"] - result["estimate"]) <= 0.02 * result["estimate"], result


@pytest.mark.parametrize("case", CASES)
def test_gloo_ranks_peak_within_one_reduce_scatter_input_of_it(runs, case):
    """gloo adds its clone of a reduce-scatter input, the largest a layer's: 4 bytes per parameter in
    fp32, 2 in pure bf16. Measured: bf16-mixed 1,490,432 to 1,551,360 against 1,439,232 (+3.6 to
    +7.8 %), 2 accumulation steps 1,690,624 against 1,572,864 (+7.5 %), pure bf16 912,896 to 945,152
    against 920,576 (-0.8 to +2.7 %)."""
    result = runs[case]
    clone = LAYER_RS_INPUT if case != "pure bf16" else 74240  # 2 x 36,992 bytes, rounded
    for peak in result["gloo"]:
        assert -0.02 * result["estimate"] <= peak - result["estimate"] <= clone + 0.02 * result["estimate"], result
