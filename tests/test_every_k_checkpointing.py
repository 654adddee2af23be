"""Activation checkpointing every K layers (`--ac every-K`, full at K=1) as transformers runs it:
`activation_checkpointing_enable(every_n_layers=K)` checkpoints layers 0, K, 2K, ...; without a cache
transformers finds no packed sequences in the position ids, so SDPA runs causal with no materialised
mask and grouped-query attention natively. A real step under the CPU tracker, `llamem trace` and
`llamem estimate` agree to the byte."""

from __future__ import annotations

import json
import warnings

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llamem.cli import main  # noqa: E402
from llamem.runtime import CpuMemoryTracker  # noqa: E402

# 4 layers: under every-2 a plain layer follows each checkpointed one; GQA (4 heads, 2 key-value heads).
CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
          "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
          "max_position_embeddings": 2048, "rms_norm_eps": 1e-05, "tie_word_embeddings": False}
BATCH, SEQ = 1, 256
WORKLOAD = ["--task", "train", "--batch", str(BATCH), "--seq", str(SEQ), "--precision", "bf16",
            "--optimizer", "adamw", "--max-grad-norm", "1.0", "--grad-accum", "1", "--attn", "sdpa"]


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("every_k") / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


def real_step_peak(every: int) -> int:
    """The second step's peak (the first made the optimizer state) of the real transformers model."""
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    fields = {k: v for k, v in CONFIG.items() if k not in ("architectures", "model_type")}
    config = transformers.LlamaConfig(**fields, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                          every_n_layers=every)
    model.train()
    with CpuMemoryTracker() as tracker:
        tracker.track(model)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        for _ in range(2):  # a pure-bf16 step as the Trainer runs it: full loss, clipping, foreach AdamW
            tracker.reset_peak()
            tracker.phase = "forward"
            ids = torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ))
            loss = model(input_ids=ids, labels=ids).loss
            tracker.phase = "backward"
            loss.backward()
            del loss, ids
            tracker.phase = "optimizer"
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return tracker.peak_bytes


def cli_peak(capsys, command: str, config_path, every: int) -> int:
    assert main([command, "--config", str(config_path), *WORKLOAD, "--ac", f"every-{every}", "--json"]) == 0
    return json.loads(capsys.readouterr().out)["peak_allocated_bytes"]


@pytest.mark.parametrize("every", [1, 2, 3])
def test_trace_and_estimate_equal_the_real_step(capsys, config_path, every):
    real = real_step_peak(every)
    assert cli_peak(capsys, "trace", config_path, every) == real
    assert cli_peak(capsys, "estimate", config_path, every) == real

