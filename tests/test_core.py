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


@pytest.mark.parametrize("options", [
    dict(task="train"), dict(task="train", precision="bf16", ac="x"), dict(task="lora"),
    dict(task="qlora", optimizer="adamw8bit"), dict(task="infer", new_tokens=64),
    dict(task="distill", teacher="llama-3.1-70b"), dict(task="train", grad_accum=4, optimizer="sgd"),
])
def test_breakdown_adds_up_to_the_peak(options):
    options = dict(options)
    ac = options.pop("ac", None)
    w = build_workload(**options, ac_every=2 if ac else None)
    report = estimate(load_model("llama-3.1-8b"), w)
    assert sum(report.breakdown.values()) == report.peak_allocated_bytes
    assert report.peak_allocated_bytes == max(report.phase_peaks.values())
    assert all(isinstance(v, int) and v >= 0 for v in report.breakdown.values())


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
    code, out, _ = run_cli(capsys, "estimate", "llama-2-7b", "--json")
    assert code == 0
    data = json.loads(out)
    assert data["model"]["num_params"] == 6738415616
    for key in ("peak_allocated_bytes", "peak_phase", "breakdown", "phases", "model"):
        assert key in data
    assert sum(data["breakdown"].values()) == data["peak_allocated_bytes"]


def test_cli_lora_breakdown(capsys):
    code, out, _ = run_cli(capsys, "estimate", "llama-3.1-8b", "--task", "lora", "--batch", "2", "--seq", "4096",
                           "--json")
    data = json.loads(out)
    assert code == 0
    assert {"weights", "weights/adapters", "gradients", "activations", "logits"} <= set(data["breakdown"]) | {
        "gradients"}
    assert data["workload"]["lora_targets"] == ["q_proj", "v_proj"]


@pytest.mark.parametrize("args, code, fragment", [
    (["estimate", "llama-9b"], 1, "Did you mean"),
    (["estimate", "llama-2-7b", "--task", "train", "--quant", "nf4"], 1, "use --task qlora"),
    (["estimate", "llama-2-7b", "--ac", "sometimes"], 1, "write none, full, or every-K"),
    (["estimate", "llama-2-7b", "--override", "layers=2"], 1, "not a field llamem reads"),
    (["estimate", "llama-2-7b", "--task", "fly"], 2, "Invalid value"),
    (["estimate"], 1, "name a model"),
])
def test_cli_errors(capsys, args, code, fragment):
    got, _out, err = run_cli(capsys, *args)
    assert got == code
    assert fragment in err
    assert "Traceback" not in err


def test_models_json(capsys):
    code, out, _ = run_cli(capsys, "models", "--json")
    names = {m["name"]: m for m in json.loads(out)}
    assert code == 0 and len(names) == 22
    assert names["llama-2-7b"]["num_params"] == 6738415616


def test_estimate_reports_device_memory(capsys):
    code, out, _ = run_cli(capsys, "estimate", "llama-3.1-8b", "--task", "lora", "--json")
    data = json.loads(out)
    assert code == 0
    assert data["peak_reserved_bytes"] >= data["peak_allocated_bytes"]
    assert data["device_bytes"] == data["peak_reserved_bytes"] + data["non_torch_bytes"]
    assert data["device_bytes"] >= data["peak_reserved_bytes"]
