"""`llamem estimate --server` and `llamem plan --server`: vLLM and SGLang start-up accounting.

Expected figures are worked out here from the formulas of docs/serving.md (vLLM's
determine_available_memory and get_num_blocks, SGLang's profile_max_num_token), not by calling
the functions under test.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llamem.cli import main
from llamem.gpus import get_gpu
from llamem.model import load_model
from llamem.serving import ServerConfig, serving_report
from llamem.serving.shapes import kv_bytes_per_token

GiB = 2**30
# Llama-3.1-8B: 32 layers, hidden 4096, 32 heads, 8 KV heads of 128, MLP 14336, vocabulary 128256 (a
# multiple of 64: no padding), 131072 positions; bf16.
LLAMA8B_PARAMS = 2 * 128256 * 4096 + 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096) + 4096
LLAMA8B_WEIGHTS = 2 * LLAMA8B_PARAMS + 131072 * 128 * 2  # + RoPE's cos/sin cache in bf16
LLAMA8B_KV_PER_TOKEN = 2 * 32 * 8 * 128 * 2


def run(capsys, *args):
    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.fixture(scope="module")
def llama8b():
    return load_model("llama-3.1-8b")


def test_weights_count_matches_the_model(llama8b):
    assert LLAMA8B_PARAMS == llama8b.num_params == 8_030_261_248


def test_vllm_v0_blocks_by_hand(llama8b):
    """vLLM 0.6 on an RTX 3090, --max-model-len 20000 (vllm#10517 logged 1952 blocks)."""
    total = get_gpu("rtx-3090").memory_bytes
    budget = int(total * 0.9)
    batched = 20000  # v0 without chunked prefill: max(max_model_len, 2048)
    activation = batched * (3 * 4096 + 3 * 14336) * 2  # one layer's peak beats the logits of 256 rows
    non_torch = int(0.35 * GiB)
    kv = budget - LLAMA8B_WEIGHTS - activation - non_torch
    blocks = kv // (16 * LLAMA8B_KV_PER_TOKEN)
    r = serving_report(llama8b, ServerConfig(server="vllm", gpu=get_gpu("rtx-3090"), max_model_len=20000,
                                             version="v0"))
    assert (r.weights_bytes, r.activation_peak_bytes, r.non_torch_bytes) == (LLAMA8B_WEIGHTS, activation, non_torch)
    assert r.num_blocks == blocks == 1961
    assert r.kv_cache_tokens == 1961 * 16
    assert r.max_concurrency == pytest.approx(1961 * 16 / 20000)


def test_vllm_v1_sampler_and_defaults_by_hand(llama8b):
    """On an H100, `vllm serve` defaults to 8192 batched tokens and 1024 sequences; the sampler peak
    (1024 rows x vocabulary x 18 bytes, plus the batch's hidden states) exceeds one layer's peak."""
    r = serving_report(llama8b, ServerConfig(server="vllm", gpu=get_gpu("h100-80gb"), max_model_len=8192))
    sampler = 1024 * 128256 * 18 + 8192 * 4096 * 2
    assert sampler > 8192 * (3 * 4096 + 3 * 14336) * 2
    assert r.activation_peak_bytes == sampler
    kv = int(get_gpu("h100-80gb").memory_bytes * 0.9) - LLAMA8B_WEIGHTS - sampler - int(0.35 * GiB)
    assert r.num_blocks == kv // (16 * LLAMA8B_KV_PER_TOKEN)
    assert r.max_concurrency == r.num_blocks / (8192 // 16)


def test_sglang_token_pool_by_hand(llama8b):
    """rest = free_at_start x mem_fraction_static - weights; tokens = rest // cell_size."""
    free = get_gpu("h100-80gb").memory_bytes - 400 * 2**20  # the CUDA context is gone before F is read
    tokens = (int(free * 0.85) - LLAMA8B_WEIGHTS) // LLAMA8B_KV_PER_TOKEN
    r = serving_report(llama8b, ServerConfig(server="sglang", gpu=get_gpu("h100-80gb"), max_model_len=8192,
                                             mem_fraction_static=0.85))
    assert r.kv_cache_tokens == tokens and r.num_blocks is None
    assert r.settings["max-running-requests"] == 4096  # min(max(tokens / 8192 * 512, 2048), 4096)


def test_sglang_default_fraction_on_an_h100(llama8b):
    # 81106 MiB: reserved = 512 + 1.5 x 8192 + 2 x 256 + 1024 / 8 = 13440 MiB (over the 10 GiB floor)
    r = serving_report(llama8b, ServerConfig(server="sglang", gpu=get_gpu("h100-80gb"), max_model_len=8192))
    assert r.settings["mem-fraction-static"] == round((81106 - 13440) / 81106, 3) == 0.834


def test_gqa_heads_replicate_past_the_kv_heads(llama8b):
    assert kv_bytes_per_token(llama8b, 4, 2) == 2 * 32 * 2 * 128 * 2
    assert kv_bytes_per_token(llama8b, 16, 2) == 2 * 32 * 1 * 128 * 2  # 8 KV heads, 16 ranks: one each


def test_sliding_window_caps_blocks_per_request():
    spec = load_model("mistral-7b-v0.1")  # sliding_window 4096
    r = serving_report(spec, ServerConfig(server="vllm", gpu=get_gpu("a100-80gb"), max_model_len=32768))
    # a100: 2048 batched tokens by default; cdiv(min(4095 + 2048, 32768), 16) + 1 = 385 blocks a request
    assert r.max_concurrency == r.num_blocks / 385


def test_estimate_json_keys(capsys):
    code, out, _ = run(capsys, "estimate", "llama-3.1-8b", "--task", "infer", "--server", "vllm", "--gpu",
                       "h100-80gb", "--max-model-len", "8192", "--kv-cache-dtype", "fp8", "--json")
    data = json.loads(out)
    assert code == 0
    assert {"weights_bytes", "activation_peak_bytes", "non_torch_bytes", "cuda_graph_bytes", "kv_cache_bytes",
            "kv_cache_tokens", "max_concurrency"} <= data.keys()
    assert data["kv_bytes_per_token"] == LLAMA8B_KV_PER_TOKEN // 2
    assert data["command"].startswith("vllm serve meta-llama/Llama-3.1-8B --tensor-parallel-size=1")


@pytest.mark.parametrize(("args", "code", "names"), [
    (("--server", "vllm", "--mem-fraction-static", "0.8"), 2, "--gpu-memory-utilization"),
    (("--server", "sglang", "--gpu-memory-utilization", "0.8"), 2, "--mem-fraction-static"),
    (("--server", "vllm", "--max-model-len", "200000"), 1, "lower --max-model-len"),
    (("--server", "vllm", "--tp", "3"), 1, "use a --tp that divides 32"),
    (("--server", "vllm", "--quant", "nf4"), 1, "none, fp8, awq, gptq"),
    (("--max-num-seqs", "8"), 2, "add --server vllm"),
    (("--server", "vllm", "--batch", "4"), 2, "--batch"),
])
def test_bad_combinations_name_the_flag(capsys, args, code, names):
    got, _, err = run(capsys, "estimate", "llama-3.1-8b", "--task", "infer", "--gpu", "h100-80gb", *args)
    assert got == code and names in err


@pytest.mark.parametrize("server", ["vllm", "sglang"])
def test_weights_that_do_not_fit_exit_3_with_the_shortfall(capsys, server):
    code, out, _ = run(capsys, "estimate", "llama-3.1-70b", "--task", "infer", "--server", server, "--gpu",
                       "h100-80gb", "--max-model-len", "8192", "--json")
    error = json.loads(out)["error"]
    assert code == 3 and error["type"] == "DoesNotFit"
    assert "short by" in error["message"] and "raise --tp" in error["message"]


def test_sglang_starts_with_a_pool_shorter_than_the_context(llama8b):
    r = serving_report(llama8b, ServerConfig(server="sglang", gpu=get_gpu("rtx-4090")))
    assert r.kv_cache_tokens < 131072 and "rejects longer requests" in r.notes[0]


def test_plan_prints_the_launch_command(capsys):
    code, out, _ = run(capsys, "plan", "llama-3.1-8b", "--server", "vllm", "--gpu", "h100-80gb", "--concurrency",
                       "32", "--seq", "8192")
    assert code == 0
    assert ("vllm serve meta-llama/Llama-3.1-8B --tensor-parallel-size=1 --max-model-len=8192 "
            "--gpu-memory-utilization=0.9 --max-num-seqs=32 --max-num-batched-tokens=8192") in out


def test_plan_climbs_the_ladder_for_70b(capsys):
    code, out, _ = run(capsys, "plan", "llama-3.1-70b", "--server", "sglang", "--gpu", "h100-80gb",
                       "--concurrency", "32", "--seq", "8192", "--json")
    data = json.loads(out)
    assert code == 0 and data["fits"] and data["report"]["max_concurrency"] >= 32
    assert data["command"].startswith("python -m sglang.launch_server --model-path meta-llama/Llama-3.1-70B --tp=2")


def test_plan_that_cannot_fit_exits_3(capsys):
    code, _, err = run(capsys, "plan", "llama-3.1-405b", "--server", "vllm", "--gpu", "rtx-4090", "--gpus", "2",
                       "--concurrency", "8", "--seq", "32768")
    assert code == 3 and "the closest" in err


def test_serving_is_torch_free():
    out = subprocess.run([sys.executable, "-c", "import llamem.serving.plan, llamem.cli.serving, sys; "
                          "print('torch' in sys.modules)"], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("server", ["vllm", "sglang"])
def test_the_printed_reproduce_command_gives_the_plans_figures(capsys, server):
    code, out, _ = run(capsys, "plan", "llama-3.1-8b", "--server", server, "--gpu", "a100-80gb", "--concurrency", "48",
                    "--seq", "16384", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["reproduce"].startswith("llamem estimate llama-3.1-8b --task infer --server")
    code, out, _ = run(capsys, *plan["reproduce"].split()[1:], "--json")
    again = json.loads(out)
    assert code == 0
    for key in ("weights_bytes", "activation_peak_bytes", "kv_cache_bytes", "kv_cache_tokens", "max_concurrency"):
        assert again[key] == plan["report"][key], key
    assert again["command"] == plan["command"] and again["reproduce"] == plan["reproduce"]


@pytest.mark.parametrize("args, names", [
    (["--ep", "2"], "--ep"),
    (["--padding", "longest"], "--padding"),
    (["--pad-fraction", "0.2"], "--pad-fraction"),
    (["--padding-free"], "--padding-free"),
    (["--offload-activations"], "--offload-activations"),
])
def test_training_layout_flags_are_refused_not_ignored(capsys, args, names):
    code, _, err = run(capsys, "estimate", "tinyllama", "--task", "infer", "--server", "vllm", "--gpu", "h100-80gb",
                       *args)
    assert code == 2 and f"{names} does not apply with --server" in err and "drop it" in err


@pytest.mark.parametrize("gpus", ["0", "-1"])
def test_plan_with_no_gpus_names_the_flag(capsys, gpus):
    code, _, err = run(capsys, "plan", "tinyllama", "--server", "vllm", "--gpu", "h100-80gb", "--concurrency", "4",
                       "--seq", "512", "--gpus", gpus)
    assert code == 1 and f"--gpus must be at least 1, got {gpus}" in err and "internal error" not in err


def test_plan_with_zero_concurrency_says_at_least_1(capsys):
    code, _, err = run(capsys, "plan", "tinyllama", "--server", "vllm", "--gpu", "h100-80gb", "--concurrency", "0",
                       "--seq", "512")
    assert code == 1 and "--concurrency and --seq must be at least 1" in err


def test_reproduce_of_a_config_file_with_overrides_runs(capsys, tmp_path):
    import shlex

    config = tmp_path / "my config.json"
    config.write_text(json.dumps({
        "model_type": "llama", "vocab_size": 512, "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 2, "max_position_embeddings": 256}))
    code, out, _ = run(capsys, "estimate", "--config", str(config), "--override", "num_hidden_layers=1", "--task",
                       "infer", "--server", "vllm", "--gpu", "h100-80gb", "--tp", "2", "--json")
    first = json.loads(out)
    assert code == 0 and f"--config {shlex.quote(str(config))} --override num_hidden_layers=1 " in first["reproduce"]
    # the server loads the checkpoint directory that holds the config, not the file
    assert first["command"].startswith(f"vllm serve {shlex.quote(str(tmp_path))} ")
    code, out, _ = run(capsys, *shlex.split(first["reproduce"])[1:], "--json")
    again = json.loads(out)
    assert code == 0
    for key in ("weights_bytes", "kv_cache_bytes", "kv_cache_tokens", "max_concurrency", "reproduce"):
        assert again[key] == first[key], key


@pytest.mark.parametrize("args, named", [
    (["--quant", "fp8"], "--quant fp8 needs an Ampere or newer card, not t4"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype fp8 needs an Ampere or newer card, not t4"),
])
def test_fp8_on_a_turing_card_is_refused_as_the_planner_does(capsys, args, named):
    code, _, err = run(capsys, "estimate", "tinyllama", "--task", "infer", "--server", "vllm", "--gpu", "t4", *args)
    assert code == 1 and named in err


def test_a_low_gpu_memory_utilization_is_named_in_the_advice(capsys):
    code, _, err = run(capsys, "estimate", "tinyllama", "--task", "infer", "--server", "vllm", "--gpu", "t4",
                       "--gpu-memory-utilization", "0.01")
    assert code == 3 and "raise --tp or --gpu-memory-utilization, add --quant awq," in err


def test_plan_in_fp32_gives_the_figures_of_its_reproduce_command(capsys):
    code, out, _ = run(capsys, "plan", "tinyllama", "--server", "vllm", "--gpu", "h100-80gb", "--concurrency", "4",
                       "--seq", "512", "--precision", "fp32", "--json")
    plan = json.loads(out)
    assert code == 0 and plan["reproduce"].endswith(" --precision fp32")
    code, out, _ = run(capsys, *plan["reproduce"].split()[1:], "--json")
    again = json.loads(out)
    assert code == 0 and plan["report"]["weights_bytes"] == again["weights_bytes"] >= 4 * 1100048384  # fp32
    for key in ("kv_cache_bytes", "kv_cache_tokens", "max_concurrency"):
        assert again[key] == plan["report"][key], key


def test_plan_refuses_a_weight_format_it_would_not_use(capsys):
    code, _, err = run(capsys, "plan", "tinyllama", "--server", "vllm", "--gpu", "h100-80gb", "--concurrency", "4",
                       "--seq", "512", "--quant", "awq")
    assert code == 2 and "--quant does not apply with --server" in err and "chooses the weight format" in err


def test_two_refused_flags_are_named_together(capsys):
    code, _, err = run(capsys, "estimate", "tinyllama", "--task", "infer", "--server", "vllm", "--gpu", "h100-80gb",
                       "--padding-free", "--offload-activations")
    assert code == 2 and "--offload-activations, --padding-free do not apply with --server" in err and "drop them" in err


@pytest.mark.parametrize("args, named", [
    (["--gpus", "0"], "--gpus must be at least 1, got 0"),
    (["--max-model-len", "0"], "--max-model-len must be at least 1 token, got 0"),
    (["--max-model-len", "4000000"], "--max-model-len 4,000,000 is over 2,048, the model's limit"),
])
def test_estimate_server_names_the_bound_a_setting_breaks(capsys, args, named):
    code, _, err = run(capsys, "estimate", "tinyllama", "--task", "infer", "--server", "vllm", "--gpu", "h100-80gb",
                       *args)
    assert code == 1 and named in err and "replicas" not in err
