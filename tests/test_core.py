"""The torch-free core, the report's self-checks, and every bad-input path."""

import json
import subprocess
import sys

import pytest

from llamem import InvalidWorkload, UnknownModel, build_workload, estimate, load_model
from llamem.cli import main
from llamem.errors import ConfigError
from llamem.units import GiB, parse_size


def test_core_is_torch_free():
    code = ("import llamem, llamem.cli, llamem.analytic, llamem.plan, llamem.allocator, llamem.allocator.replay, "
            "llamem.analytic.schedule, sys; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_adamw_state_of_a_7b_full_fine_tune():
    report = estimate(load_model("llama-2-7b"), build_workload(task="train", precision="bf16-mixed", optimizer="adamw",
                                                                 seq=16))
    optimizer = report.phases["optimizer"]
    # fp32 master weights under bf16 autocast: both moments are 6,738,415,616 params x 4 bytes (every
    # tensor a multiple of 512 B); one 1-element fp32 `step` per tensor, each rounded to 512 B: the
    # embedding, 32 layers x (2 norms + 7 linears), the final norm and the head are 291 tensors.
    assert optimizer["optimizer/exp_avg"] == optimizer["optimizer/exp_avg_sq"] == 6_738_415_616 * 4
    assert optimizer["optimizer/step"] == 291 * 512
    # The fp32 gradients mirror the weights.
    assert optimizer["gradients"] == 6_738_415_616 * 4


def test_lora_adapters_of_an_8b():
    report = estimate(load_model("llama-3.1-8b"), build_workload(task="lora"))
    # r=8 on q_proj (4096 -> 4096) and v_proj (4096 -> 1024), fp32 as peft keeps them:
    # A is 8 x 4096 for both, B is 4096 x 8 and 1024 x 8; 32 layers.
    per_layer = 4 * (8 * 4096 + 4096 * 8 + 8 * 4096 + 1024 * 8)
    assert report.phases["load"]["weights/adapters"] == 32 * per_layer == 13_631_488


def test_kv_cache_of_an_8b_prompt():
    report = estimate(load_model("llama-3.1-8b"), build_workload(task="infer", seq=1024, new_tokens=1))
    # K and V, 32 layers, 1024 tokens, 8 KV heads x 128 dims, bf16 (GQA-sized, never hidden_size).
    assert report.phases["prefill"]["kv_cache"] == 2 * 32 * 1024 * 8 * 128 * 2 == 134_217_728


def test_weights_of_a_bf16_7b():
    report = estimate(load_model("llama-2-7b"), build_workload(task="infer", seq=1, new_tokens=1))
    # 6,738,415,616 params * 2 bytes (every tensor is already a multiple of 512 B) + RoPE's two fp32 buffers.
    assert report.phases["load"]["weights"] == 6_738_415_616 * 2 + 2 * 512


def test_unknown_model_lists_near_matches():
    with pytest.raises(UnknownModel) as err:
        load_model("llama-3.1-8")
    assert "llama-3.1-8b" in err.value.near


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(task="train", quant="nf4"), "use --task qlora"),
    (dict(task="lora", quant="int8"), "use --task qlora"),
    (dict(task="distill"), "--teacher"),
    (dict(task="train", teacher="llama-2-7b"), "only applies to --task distill"),
    (dict(task="infer", precision="bf16-mixed"), "use --precision bf16"),
    (dict(task="infer", optimizer="sgd"), "--optimizer only applies"),
    (dict(task="train", new_tokens=3), "--new-tokens only applies"),
    (dict(task="lora", prefill_chunk=512), "--prefill-chunk only applies"),
    (dict(task="infer", prefill_chunk=-1), "--prefill-chunk must be"),
    (dict(task="train", batch=0), "--batch must be"),
    (dict(task="train", precision="fp8"), "--precision 'fp8' is not one of"),
    (dict(task="lora", lora_targets=("qproj",)), "--lora-targets"),
])
def test_bad_workloads_name_the_fix(kwargs, fragment):
    with pytest.raises(InvalidWorkload) as err:
        build_workload(**kwargs)
    assert fragment in str(err.value)


def test_all_problems_are_reported_at_once():
    with pytest.raises(InvalidWorkload) as err:
        build_workload(task="train", batch=0, seq=0)
    assert len(err.value.problems) == 2


def test_overrides(tmp_path):
    spec = load_model("llama-2-7b", overrides={"num_hidden_layers": 2})
    assert spec.num_layers == 2
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        from llamem.model import parse_overrides
        parse_overrides(["num_hiden_layers=2"])


def test_config_json(tmp_path):
    good = tmp_path / "config.json"
    good.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
                                "num_hidden_layers": 2, "num_attention_heads": 4, "vocab_size": 100}))
    assert load_model(config_path=good).num_layers == 2
    bad = tmp_path / "gpt2.json"
    bad.write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match="not a LLaMA-family architecture"):
        load_model(config_path=bad)
    with pytest.raises(ConfigError, match="no such file"):
        load_model(config_path=tmp_path / "missing.json")


def test_parse_size():
    assert parse_size("22GiB") == 22 * GiB
    assert parse_size("80GB") == 80 * 10**9
    with pytest.raises(Exception, match="cannot read size"):
        parse_size("lots")


def run_cli(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_json_keys(capsys):
    code, out, _ = run_cli(capsys, "estimate", "llama-2-7b", "--precision", "bf16-mixed", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["model"]["num_params"] == 6738415616
    for key in ("peak_allocated_bytes", "peak_phase", "breakdown", "phases", "model", "device_bytes"):
        assert key in data
    # fp32 master weights (bf16-mixed) and RoPE's two fp32 buffers of 64 values, 512 B each.
    assert data["breakdown"]["weights"] == 6738415616 * 4 + 2 * 512


def test_cli_lora_breakdown(capsys):
    code, out, _ = run_cli(capsys, "estimate", "llama-3.1-8b", "--task", "lora", "--batch", "2", "--seq", "4096",
                           "--json")
    data = json.loads(out)
    assert code == 0
    # At the backward peak of the second step: the frozen base, the adapters and their AdamW state (made in
    # the first step), saved activations and the loss's buffers; no gradient yet (the peak is where the
    # loss's backward starts, before any adapter's gradient exists).
    assert set(data["breakdown"]) == {"weights", "weights/adapters", "optimizer/exp_avg", "optimizer/exp_avg_sq",
                                      "optimizer/step", "activations", "logits", "inputs"}
    assert data["peak_phase"] == "backward"
    assert data["workload"]["lora_targets"] == ["q_proj", "v_proj"]


@pytest.mark.parametrize("args, code, fragment", [
    (["estimate", "llama-9b"], 1, "Did you mean"),
    (["estimate", "llama-2-7b", "--task", "train", "--quant", "nf4"], 1, "use --task qlora"),
    (["estimate", "llama-2-7b", "--ac", "sometimes"], 1, "write none, full, or every-K"),
    (["estimate", "llama-2-7b", "--override", "layers=2"], 1, "not a field llamem reads"),
    (["estimate", "llama-2-7b", "--task", "fly"], 2, "Invalid value"),
    (["estimate"], 1, "name a model"),
    (["estimate", "llama-2-7b", "--batch", "x"], 2, "is not a valid integer"),
    (["plan", "llama-2-7b", "--budget", "22"], 1, "has no unit"),
    (["estimate", "llama-2-7b", "--lora-targets", "q_proj,q_proj", "--task", "lora"], 1, "more than once"),
])
def test_cli_errors(capsys, args, code, fragment):
    got, _out, err = run_cli(capsys, *args)
    assert got == code
    assert fragment in err
    assert "Traceback" not in err


def test_models_json(capsys):
    code, out, _ = run_cli(capsys, "models", "--json")
    names = {m["name"]: m for m in json.loads(out)}
    from llamem.model import preset_names

    assert code == 0 and set(names) == set(preset_names()) and len(names) == 34
    assert names["llama-2-7b"]["num_params"] == 6738415616


def test_estimate_reports_device_memory(capsys):
    code, out, _ = run_cli(capsys, "estimate", "llama-3.1-8b", "--task", "lora", "--json")
    data = json.loads(out)
    assert code == 0
    # One CUDA context (llamem.overhead: 400 MiB with lazy module loading), one GPU.
    assert data["non_torch_bytes"] == 400 * 2**20
    # The fragmentation allowance is what the allocator simulator finds on the probes (tests/test_device.py);
    # here only that the JSON carries its parts under their names.
    assert data["fragmentation_bytes"] > 0
