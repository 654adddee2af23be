"""The planner, the GPU catalog, and per-GPU memory of parallel layouts."""

import dataclasses
import json

import pytest

from llamem import build_workload, load_model
from llamem.cli import main
from llamem.gpus import CATALOG, UnknownGPU, get_gpu
from llamem.parallel import Layout, fsdp_shard_bytes, largest_layer_params, model_state_bytes

GiB = 2**30


def run(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_catalog_has_the_cards_people_ask_about():
    for name in ("rtx-3090", "rtx-4090", "rtx-5090", "a6000", "rtx-6000-ada", "l4", "l40s", "t4", "a10g",
                 "a100-40gb", "a100-80gb", "h100-80gb", "h200", "b200", "mi300x"):
        gpu = CATALOG[name]
        assert gpu.source and gpu.memory_bytes > gpu.usable_bytes > 0
    assert not CATALOG["t4"].bf16 and CATALOG["h100-80gb"].fp8


def test_unknown_gpu_names_near_matches():
    with pytest.raises(UnknownGPU, match="rtx-4090"):
        get_gpu("rtx-4900")


def test_lora_8b_fits_a_4090(capsys):
    code, out, _ = run(capsys, "plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--task", "lora", "--seq", "2048",
                       "--json")
    data = json.loads(out)
    gpu = CATALOG["rtx-4090"]
    assert code == 0 and data["fits"]
    assert data["final"]["peak_device_bytes"] <= gpu.memory_bytes
    assert data["final"]["peak_device_bytes"] - 400 * 2**20 <= gpu.usable_bytes
    assert all({"technique", "peak_device_bytes"} <= set(step) for step in data["steps"])
    assert data["final"]["command"].startswith("llamem estimate llama-3.1-8b --task lora")
    assert data["final"]["relative_step_time"] >= 1.0


def test_plan_command_reproduces_the_final_memory(capsys):
    _, out, _ = run(capsys, "plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--task", "lora", "--seq", "2048", "--json")
    plan = json.loads(out)
    args = plan["final"]["command"].split()[1:] + ["--json"]
    code, out, _ = run(capsys, *args)
    again = json.loads(out)
    assert code == 0
    assert again["peak_allocated_bytes"] == plan["final"]["peak_allocated_bytes"]
    assert again["device_bytes"] == plan["final"]["peak_device_bytes"]
    for step in plan["steps"]:  # every figure of the ladder is its command's
        code, out, _ = run(capsys, *step["command"].split()[1:], "--json")
        assert code == 0 and json.loads(out)["device_bytes"] == step["peak_device_bytes"]


def test_70b_full_training_does_not_fit_one_4090(capsys):
    code, out, err = run(capsys, "plan", "llama-2-70b", "--gpu", "rtx-4090", "--task", "train", "--json",
                         "--host-memory", "256GiB")
    data = json.loads(out)
    assert code == 3 and not data["fits"]
    assert data["shortfall_bytes"] > 0
    assert "nothing fits" in err and "--min-gpus" in err


def test_70b_full_training_fits_64_4090s_sharded(capsys):
    code, out, _ = run(capsys, "plan", "llama-2-70b", "--gpu", "rtx-4090", "--task", "train", "--gpus", "64",
                       "--json", "--host-memory", "256GiB")
    data = json.loads(out)
    assert code == 0 and data["fits"] and data["num_gpus"] == 64
    layout = data["final"]["config"]["layout"]
    assert layout["dp"] * layout["tp"] * layout["pp"] == 64 and (layout["tp"] > 1 or layout["pp"] > 1 or
                                                                  layout["sharding"].startswith("zero"))
    assert data["final"]["peak_device_bytes"] <= CATALOG["rtx-4090"].memory_bytes


def test_min_gpus_finds_the_fewest(capsys):
    code, out, _ = run(capsys, "plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--task", "train", "--min-gpus",
                       "--json")
    data = json.loads(out)
    assert code == 0 and data["fits"]
    fewer = data["num_gpus"] // 2
    if fewer:
        code, _, _ = run(capsys, "plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--task", "train", "--gpus",
                         str(fewer), "--json")
        assert code == 3


def test_budget_stands_for_any_card(capsys):
    code, out, _ = run(capsys, "plan", "llama-3.2-1b", "--budget", "22GiB", "--task", "infer", "--json")
    assert code == 0 and json.loads(out)["gpu"]["memory_bytes"] == 22 * GiB
    code, _, err = run(capsys, "plan", "llama-3.2-1b", "--task", "infer")
    assert code == 2 and "--budget" in err


def test_maximize_batch_is_the_edge(capsys):
    code, out, _ = run(capsys, "plan", "llama-3.2-1b", "--gpu", "l4", "--task", "lora", "--seq", "1024",
                       "--maximize", "batch", "--json")
    data = json.loads(out)
    value = data["maximized"]["value"]
    assert code == 0 and value >= 1
    # one more does not fit with any configuration the planner knows (no accumulation allowed)
    from llamem.plan import Space, best

    space = Space(spec=load_model("llama-3.2-1b"), gpu=get_gpu("l4"), host_budget_bytes=24 * GiB)
    assert best(space, build_workload(task="lora", seq=1024, batch=value), 1, fixed_micro_batch=True).best
    assert best(space, build_workload(task="lora", seq=1024, batch=value + 1), 1, fixed_micro_batch=True).best is None


# Per-GPU memory held to DeepSpeed's and FSDP2's own numbers --------------------------------
@pytest.mark.parametrize("gpus", [8, 64])
def test_zero_model_states_match_deepspeed_estimators(gpus):
    zero12 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    zero3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    spec = load_model("llama-2-7b")
    w = build_workload(task="train")
    P = spec.num_params
    ours2 = sum(model_state_bytes(spec, w, Layout(dp=gpus, sharding="zero2"), P).values())
    _cpu, theirs2 = zero12.estimate_zero2_model_states_mem_needs(P, num_gpus_per_node=gpus, cpu_offload=False)
    assert abs(ours2 - theirs2) <= 16
    largest = largest_layer_params(spec)
    ours3 = sum(model_state_bytes(spec, w, Layout(dp=gpus, sharding="zero3"), P).values())
    _cpu, theirs3, _ = zero3.estimate_zero3_model_states_mem_needs(P, largest, num_gpus_per_node=gpus,
                                                                    cpu_offload=False, cpu_offload_params=False)
    assert abs(ours3 - theirs3) <= 16
    offload = sum(model_state_bytes(spec, w, Layout(dp=gpus, sharding="zero3", offload="optimizer"), P).values())
    _cpu, theirs_off, _ = zero3.estimate_zero3_model_states_mem_needs(P, largest, num_gpus_per_node=gpus,
                                                                       cpu_offload=True, cpu_offload_params=False)
    assert abs(offload - theirs_off) <= 16


@pytest.mark.parametrize("world", [2, 8, 24])
def test_fsdp2_shard_sizes_match_a_fake_process_group(world):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from llamem.trace.build import hf_config
    from llamem.workload import Workload

    spec = load_model("tinyllama-1.1b", overrides={"num_hidden_layers": 2})
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(hf_config(spec, Workload())).to(torch.bfloat16)
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    finally:
        dist.destroy_process_group()
    assert local == fsdp_shard_bytes(spec, 2, world)


def test_multi_gpu_plan_command_reproduces_per_gpu_memory(capsys):
    code, out, _ = run(capsys, "plan", "llama-2-70b", "--gpu", "rtx-4090", "--task", "train", "--gpus", "64",
                       "--json", "--host-memory", "256GiB")
    plan = json.loads(out)
    assert "--gpus 64" in plan["final"]["command"]
    code, out, _ = run(capsys, *plan["final"]["command"].split()[1:], "--json")
    again = json.loads(out)
    assert code == 0
    assert again["peak_allocated_bytes"] == plan["final"]["peak_allocated_bytes"]


@pytest.mark.parametrize("args, fragment", [
    (["estimate", "llama-3.1-8b", "--gpus", "3", "--tp", "2"], "not a multiple"),
    (["estimate", "llama-3.1-8b", "--offload", "optimizer"], "--sharding zero1, zero2 or zero3"),
    (["plan", "llama-3.1-8b", "--gpu", "h100", "--gpus", "0"], "from 1 to"),
    (["estimate", "llama-3.1-8b", "--gpus", "8", "--tp", "3", "--pp", "1"], "not a multiple"),
    (["estimate", "llama-3.1-8b", "--pp-schedule", "gpipe"], "--pp N"),
])
def test_layout_errors_name_the_fix(capsys, args, fragment):
    code, _, err = run(capsys, *args)
    assert code == 1 and fragment in err and "Traceback" not in err


def test_long_prompt_uses_chunked_prefill_before_changing_numerics(capsys):
    # 128k tokens of Llama-3.1-8B on an 80 GB card: the whole-prompt prefill's MLP temporaries
    # do not fit, chunked prefill (same outputs) does, so no quantization is needed.
    code, out, _ = run(capsys, "plan", "llama-3.1-8b", "--gpu", "a100-80gb", "--task", "infer", "--batch", "4",
                       "--seq", "65536", "--new-tokens", "16", "--json")
    data = json.loads(out)
    final = data["final"]["config"]["workload"]
    assert code == 0 and data["fits"]
    assert final["prefill_chunk"] > 0 and final["quant"] == "none" and final["kv_dtype"] == "bf16"
    assert [s["technique"] for s in data["steps"]] == ["chunked prefill"]
    assert f"--prefill-chunk {final['prefill_chunk']}" in data["final"]["command"]
    code, out, _ = run(capsys, *data["final"]["command"].split()[1:], "--json")
    assert json.loads(out)["peak_allocated_bytes"] == data["final"]["peak_allocated_bytes"]


def test_truncation_is_the_last_resort(capsys):
    args = ("plan", "llama-3.1-8b", "--gpu", "rtx-4090", "--task", "infer", "--seq", "131000", "--new-tokens", "16",
            "--exact", "--json")
    code, out, _ = run(capsys, *args)
    data = json.loads(out)
    kept = data["final"]["config"]["workload"]["seq"]
    assert code == 0 and data["fits"] and data["truncated"] == {"requested_seq": 131000, "seq": kept}
    assert 1 < kept < 131000 and data["steps"][-1]["technique"] == "sequence length"
    assert any("truncation_side='left'" in note for note in data["notes"])
    # The next token more does not fit with the same configuration.
    more = build_workload(**{k: v for k, v in data["final"]["config"]["workload"].items()
                             if k in ("task", "batch", "new_tokens", "precision", "kv_dtype", "prefill_chunk")},
                          seq=kept + 1)
    from llamem.plan import Space, best

    space = Space(spec=load_model("llama-3.1-8b"), gpu=get_gpu("rtx-4090"), host_budget_bytes=0, max_tier=0)
    found = best(space, more, 1).best
    assert found is None or found.workload.prefill_chunk != more.prefill_chunk
    code, _, err = run(capsys, *args, "--no-truncation")
    assert code == 3 and "GiB over" in err


def test_training_splits_sequences_instead_of_dropping_tokens(capsys):
    """LoRA on Llama-3.2-1B at 32768 tokens in 3.5 GiB: QLoRA, checkpointing and Liger's loss are not
    enough, so each sequence is split (into 3 of 10923 tokens; 4 GiB takes 2 of 16384). Llama-3.1-8B at 65536
    tokens on an RTX 4090 splits too (into 2), but the fragmentation replays of its 32 long layers take more
    than twice as long."""
    code, out, _ = run(capsys, "plan", "llama-3.2-1b", "--budget", "3.5GiB", "--task", "lora", "--seq", "32768",
                       "--json")
    data = json.loads(out)
    final = data["final"]["config"]["workload"]
    pieces = -(-32768 // final["seq"])
    assert code == 0 and data["fits"] and final["seq"] < 32768 and pieces > 2
    assert final["batch"] * final["grad_accum"] == pieces  # every token still trained on in a step
    assert data["steps"][-1]["change"] == f"split each sequence into {pieces} of {final['seq']} tokens"


def test_pipeline_micro_batches_are_the_accumulation_steps():
    from llamem.plan import Space, candidates

    space = Space(spec=load_model("llama-2-70b"), gpu=get_gpu("h100-80gb"), host_budget_bytes=0)
    workload = build_workload(task="train", batch=8, seq=4096, grad_accum=4)
    piped = [c for c in candidates(space, workload, 16) if c.layout.pp > 1]
    assert piped and all(c.layout.microbatches == c.workload.grad_accum for c in piped)
    # The global batch is kept: 32 sequences per step, shared by the data-parallel replicas.
    assert all(c.workload.batch * c.workload.grad_accum * c.layout.dp == 32 for c in piped)
    # More micro-batches shrink the bubble: 32 micro-batches of 1 beat 4 of 8, per token.
    by_micro = {(dataclasses.replace(c.layout, microbatches=1), c.workload.batch): c for c in piped
                if not c.workload.ac_every and c.workload.loss == "full"}
    layout = next(layout for layout, batch in by_micro if batch == 1 and (layout, 8) in by_micro)
    assert by_micro[(layout, 1)].seconds_per_token < by_micro[(layout, 8)].seconds_per_token


def test_the_bubble_stretches_a_pipelines_compute():
    """(p - 1) / (M + p - 1) of a pipeline's step is idle: the compute takes (M + p - 1) / M times the ideal. With
    one GPU per stage (no data or tensor parallel, so no collectives in the figure), 16 stages and 4 micro-batches
    take 19 / 4 of the ideal (as good as unlimited micro-batches) and 2 stages 5 / 4."""
    from llamem.cost import step_seconds

    spec, gpu = load_model("llama-2-70b"), get_gpu("h100-80gb")
    workload = build_workload(task="train", batch=1, seq=4096, grad_accum=4, precision="bf16", optimizer="adamw")
    ideal = {p: step_seconds(spec, workload, Layout(pp=p, microbatches=1_000_000), gpu) for p in (2, 16)}
    for p, stretch in ((16, 19 / 4), (2, 5 / 4)):
        seconds = step_seconds(spec, workload, Layout(pp=p, microbatches=4), gpu)
        assert seconds / ideal[p] == pytest.approx(stretch, rel=1e-4)


def test_the_ladder_names_the_pipelines_micro_batches(capsys):
    """The layout step shows the layout it sizes: a pipeline's micro-batches are the accumulation steps."""
    assert main(["plan", "llama-2-70b", "--gpu", "h100-80gb", "--gpus", "16", "--task", "train", "--batch", "4",
                 "--seq", "4096", "--precision", "bf16-mixed", "--optimizer", "adamw", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    layout_step = next(step for step in plan["steps"] if "parallelism" in step["technique"])
    assert layout_step["change"] == "tp x8, pp x2 (1f1b, 4 micro-batches)"
    assert "--tp 8 --pp 2" in layout_step["command"] and "--grad-accum 4" in layout_step["command"]


def test_gpipe_keeps_every_micro_batch_in_flight(capsys):
    from llamem.model import load_model
    from llamem.parallel import make_layout, pipeline_stage_phases
    from llamem.workload import build_workload

    spec = load_model("llama-2-7b")
    w = build_workload("train", precision="bf16-mixed", optimizer="adamw", grad_accum=16, ac_every=1)
    one, g = (pipeline_stage_phases(spec, w, make_layout(spec, w, gpus=4, pp=4, pp_schedule=schedule), 0)
              for schedule in ("1f1b", "gpipe"))
    # The first stage: 1F1B keeps min(p, M) = 4 micro-batches' activations, GPipe all 16.
    assert g["forward"]["activations"] == 4 * one["forward"]["activations"] > 0
    common = ("estimate", "llama-2-7b", "--task", "train", "--gpus", "4", "--pp", "4", "--grad-accum", "16",
              "--ac", "full", "--json")
    _, one_f_one_b, _ = run(capsys, *common)
    _, gpipe, _ = run(capsys, *common, "--pp-schedule", "gpipe")
    assert json.loads(gpipe)["peak_allocated_bytes"] > json.loads(one_f_one_b)["peak_allocated_bytes"]


def test_ladder_keeps_the_global_batch_before_the_layout_changes(tmp_path):
    """The micro-batch step comes before the layout step: on 2 data-parallel replicas, the final
    single replica's 4 accumulation steps are 2 per replica (the global batch stays 4), and no
    sequence-length step appears to undo a doubled batch when the sequence never changed."""
    import json

    from llamem.gpus import budget_gpu
    from llamem.model import load_model
    from llamem.plan import make_plan
    from llamem.workload import build_workload

    path = tmp_path / "tiny.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                                "vocab_size": 512, "max_position_embeddings": 2048}))
    plan = make_plan(load_model(config_path=path), build_workload("train", batch=4, seq=512),
                     budget_gpu(450 * 2**20), num_gpus=2, host_budget_bytes=2**40)
    assert (plan.start.layout.dp, plan.final.layout.dp, plan.final.workload.grad_accum) == (2, 1, 4)
    assert plan.final.workload.seq == 512
    assert [s.technique for s in plan.steps][-1] == "parallelism / sharding / offload"
    [batch_step] = [s for s in plan.steps if s.technique.startswith("micro-batch")]
    assert batch_step.change == "micro-batch 1 x 2 accumulation steps"
