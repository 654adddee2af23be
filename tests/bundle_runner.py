"""Emit a tiny Llama's 2-GPU bundle and run it on CPU (gloo): shared by the bundle tests that launch one
(test_bundle_runs.py, test_bundle_parallel.py, test_bundle_pipeline.py, test_bundle_generate.py, ...).

Each launch starts torchrun and 2 ranks that import torch and transformers, several seconds before the
first step: `start_run` runs each distinct training bundle once per session (`RUN_ARGS`: two steps and
each rank's trace, what every test of it reads), and the tests of the same bundle read that run. `Launch`
starts a launch.sh in the background, so that a module starts its runs together and they overlap (one
rank's start-up or exit beside another run's work).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
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
RUN_PEAK = re.compile(r"^rank (\d+) peak_bytes=(\d+)$")
RUN_ARGS = ["--cpu", "--random-init", "--max-steps", "2"]
"""What each session run of a training bundle does, with `--memory-trace DIR`: the first step's lines are those of
a 1-step run; the second step has the optimizer's state."""


def tiny_config_path(tmp_path_factory) -> Path:
    """TINY's config.json, at one path for the whole session: bundles of one plan emitted by different test
    modules are then the same files, and `start_run` runs them once."""
    path = tmp_path_factory.getbasetemp() / "tiny-llama" / "config.json"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps(TINY))
    return path


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    return tiny_config_path(tmp_path_factory)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        return sock.getsockname()[1]


def _plan(config_path, *, tp: int = 1, pp: int = 1, grad_accum: int = 1):
    spec = load_model(None, config_path=str(config_path))
    w = build_workload("train", batch=2, seq=16, grad_accum=grad_accum, precision="bf16-mixed", optimizer="adamw")
    layout = make_layout(spec, w, gpus=2, tp=tp, pp=pp)
    return layout_plan(spec, w, layout, get_gpu("h100"), model_args=("--config", str(config_path)))


def _run(plan, tmp_path_factory) -> dict[int, dict]:
    """Per rank: the wrapped live bytes, the first step's loss and the peak of a 1-step run (wrap and step 1)."""
    ranks = start_run(tmp_path_factory, plan).result().ranks()
    return {rank: {"wrapped": figures["windows"][0][1], "step": figures["windows"][1][1],
                   "loss": figures["losses"][0], "peak": max(peak for peak, _live in figures["windows"][:2])}
            for rank, figures in ranks.items()}


def _layer_shapes() -> list[tuple[int, int]]:
    """(out, in) of a decoder layer's projections: q, k, v, o, gate, up, down."""
    return [(H, H), (KV * HEAD_DIM, H), (KV * HEAD_DIM, H), (H, H), (INTER, H), (INTER, H), (H, INTER)]


def _launch_env() -> dict[str, str]:
    return {**os.environ, "MASTER_PORT": str(free_port()), "TORCHRUN": str(Path(sys.executable).with_name("torchrun")),
            "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}


def launch(folder: Path, args: list[str], timeout_s: int = 180) -> str:
    """Run a bundle's launch.sh with `args`; its stdout (the run must succeed)."""
    run = subprocess.run(["bash", str(folder / "launch.sh"), *args], capture_output=True, text=True, timeout=timeout_s,
                         env=_launch_env(), check=False)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    return run.stdout


class Launch:
    """A bundle's launch.sh started in the background (its own process group, ended at exit if nobody waited for
    it): start several, then wait for each; they run side by side."""

    def __init__(self, folder: Path, args: list[str], timeout_s: int = 180) -> None:
        self.folder, self.args, self.timeout_s = folder, args, timeout_s
        self.out, self.err = folder / "launch.stdout", folder / "launch.stderr"
        self.retried = False
        self._start()

    def _start(self) -> None:
        self.deadline = time.monotonic() + self.timeout_s
        with self.out.open("w") as out, self.err.open("w") as err:
            self.process = subprocess.Popen(["bash", str(self.folder / "launch.sh"), *self.args], stdout=out,
                                            stderr=err, env=_launch_env(), start_new_session=True)
        _RUNNING.append(self.process)

    def _wait(self) -> None:
        try:
            self.process.wait(timeout=max(1.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _end(self.process)

    def stdout(self) -> str:
        """The run's stdout once it has ended; it must succeed within its time."""
        self._wait()
        if self.process.returncode != 0 and not self.retried and _lost_rendezvous(self.out, self.err):
            # Runs side by side each take a free port for torchrun's store, which another torchrun (picking its
            # workers' port) can take before it binds it: then it meets the other run's store. Once more, anew.
            self.retried = True
            self._start()
            self._wait()
        stdout = self.out.read_text()
        assert self.process.returncode == 0, (f"exit {self.process.returncode} (ended after {self.timeout_s} s if -9)\n"
                                              + stdout[-2000:] + self.err.read_text()[-4000:])
        return stdout


def _lost_rendezvous(out: Path, err: Path) -> bool:
    """Whether torchrun failed at its rendezvous or its store's port, before any rank started."""
    stderr = err.read_text()
    return not out.read_text().strip() and ("RendezvousConnectionError" in stderr or "EADDRINUSE" in stderr)


_RUNNING: list[subprocess.Popen] = []
_LAUNCHES: dict[str, tuple[Launch, Path]] = {}
"""This session's training runs by what they run (`_run_key`): the launch and its traces' folder."""


def _end(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


@atexit.register
def _end_all() -> None:
    for process in _RUNNING:
        _end(process)


def _run_key(folder: Path) -> str:
    """The emitted bundle's files, names and contents: one plan emits the same files from any test module
    (`config_path` is one path per session)."""
    digest = hashlib.sha256()
    for path in sorted(path for path in folder.rglob("*") if path.is_file()):
        digest.update(f"{path.relative_to(folder)}\0".encode() + path.read_bytes() + b"\0")
    return digest.hexdigest()


@dataclass(frozen=True)
class BundleRun:
    """A bundle as the test emitted it (`folder`), and the session's run of those scripts."""

    folder: Path
    stdout: str
    traces: Path
    """rank0.json and rank1.json: each rank's allocations and frees (--memory-trace)."""

    def ranks(self) -> dict[int, dict]:
        """Per rank: its windows in order (wrapped, step 1, step 2) as (peak, live), its 2 losses, its run peak."""
        ranks: dict[int, dict] = {0: {"windows": [], "losses": []}, 1: {"windows": [], "losses": []}}
        for line in self.stdout.splitlines():
            if match := LINE.match(line):
                ranks[int(match[1])]["windows"].append((int(match[4]), int(match[5])))
                if match[3]:
                    ranks[int(match[1])]["losses"].append(match[3])
            elif match := RUN_PEAK.match(line):
                ranks[int(match[1])]["peak"] = int(match[2])
        assert all(len(r["windows"]) == 3 and len(r["losses"]) == 2 and "peak" in r for r in ranks.values()), \
            self.stdout
        return ranks


@dataclass(frozen=True)
class PendingRun:
    folder: Path
    started: Launch
    traces: Path

    def result(self) -> BundleRun:
        return BundleRun(self.folder, self.started.stdout(), self.traces)


def start_run(tmp_path_factory, plan, timeout_s: int = 180) -> PendingRun:
    """Emit the plan's bundle and start its run (RUN_ARGS, each rank's trace), unless this session has started one
    of the same files already; `.result()` waits for it. Start several, then wait: they run side by side."""
    folder = tmp_path_factory.mktemp("run") / "bundle"
    bundle = emit_bundle(plan, folder)
    assert bundle.unsupported is None, bundle.unsupported
    key = _run_key(folder)
    if key not in _LAUNCHES:
        traces = folder.parent / "traces"
        _LAUNCHES[key] = Launch(folder, [*RUN_ARGS, "--memory-trace", str(traces)], timeout_s), traces
    return PendingRun(folder, *_LAUNCHES[key])
