"""Emit a tiny Llama's 2-GPU bundle and run it on CPU (gloo): shared by the bundle tests that launch one
(test_bundle_runs.py, test_bundle_parallel.py, test_bundle_pipeline.py, test_bundle_generate.py)."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from llamem.bundle import emit_bundle, layout_plan
from llamem.gpus import get_gpu
from llamem.model import load_model
from llamem.parallel import make_layout
from llamem.trace.tracer import rounded
from llamem.workload import build_workload

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
H, V, INTER, HEAD_DIM, KV = 64, 512, 128, 16, 2
NORM_BYTES = rounded(H * 4)
ROPE_BUFFERS_BYTES = 2 * 512
"""RoPE's `inv_freq` and `original_inv_freq`, one 512-byte block each."""
LINE = re.compile(r"^rank (\d+) (wrapped|step \d+ loss=(\S+)) peak_bytes=(\d+) live_bytes=(\d+)$")


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "config.json"
    path.write_text(json.dumps(TINY))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def _plan(config_path, *, tp: int = 1, pp: int = 1, grad_accum: int = 1):
    spec = load_model(None, config_path=str(config_path))
    w = build_workload("train", batch=2, seq=16, grad_accum=grad_accum, precision="bf16-mixed", optimizer="adamw")
    layout = make_layout(spec, w, gpus=2, tp=tp, pp=pp)
    return layout_plan(spec, w, layout, get_gpu("h100"), model_args=("--config", str(config_path)))


def _run(plan, folder: Path) -> dict[int, dict]:
    """Per rank: the wrapped live bytes, the step's loss, the run's peak."""
    bundle = emit_bundle(plan, folder)
    assert bundle.unsupported is None
    stdout = launch(folder, ["--cpu", "--random-init", "--max-steps", "1"])
    ranks: dict[int, dict] = {0: {}, 1: {}}
    for line in stdout.splitlines():
        if match := LINE.match(line):
            key = "wrapped" if match[2] == "wrapped" else "step"
            ranks[int(match[1])][key] = int(match[5])
            if match[3]:
                ranks[int(match[1])]["loss"] = match[3]
        elif match := re.match(r"^rank (\d+) peak_bytes=(\d+)$", line):
            ranks[int(match[1])]["peak"] = int(match[2])
    assert all(len(r) == 4 for r in ranks.values()), stdout
    return ranks


def _layer_shapes() -> list[tuple[int, int]]:
    """(out, in) of a decoder layer's projections: q, k, v, o, gate, up, down."""
    return [(H, H), (KV * HEAD_DIM, H), (KV * HEAD_DIM, H), (H, H), (INTER, H), (INTER, H), (H, INTER)]


def launch(folder: Path, args: list[str], timeout_s: int = 180) -> str:
    """Run a bundle's launch.sh with `args`; its stdout (the run must succeed)."""
    env = {**os.environ, "MASTER_PORT": str(free_port()), "TORCHRUN": str(Path(sys.executable).with_name("torchrun")),
           "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    run = subprocess.run(["bash", str(folder / "launch.sh"), *args], capture_output=True, text=True, timeout=timeout_s,
                         env=env, check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return run.stdout
