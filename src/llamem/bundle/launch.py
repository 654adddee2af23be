"""launch.sh: one process per planned GPU, with torchrun, the DeepSpeed launcher or accelerate.

Every launcher reads the same variables: NNODES (nodes, default the plan's), NODE_RANK, MASTER_ADDR
and MASTER_PORT. `--cpu` starts all the planned processes on this machine with torchrun (train.py or
generate.py then uses gloo); the other arguments go to the script as they are. A device_map generation
bundle is one process (`python generate.py`), which drives every GPU of its node.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Processes:
    num_gpus: int
    per_node: int
    nodes: int


def launch_script(*, launcher: str, processes: Processes, title: str, unsupported: str | None,
                  script: str = "train.py") -> str:
    """`launcher` torchrun, deepspeed or accelerate, or python: one process that drives every GPU (a
    generation bundle's device_map); `script` the Python file it starts."""
    lines = ["#!/usr/bin/env bash", f"# {title}", "# Usage: bash launch.sh [--cpu] [--random-init] [--max-steps K] "
             f"(README.md; python {script} --help)",
             "#   several nodes: NNODES=N NODE_RANK=<this node, 0..N-1> MASTER_ADDR=<node 0's address> "
             "MASTER_PORT=29500 bash launch.sh",
             f"#   --cpu: the {processes.num_gpus} processes on this machine's CPU (gloo), each counted by llamem",
             "set -euo pipefail", 'cd "$(dirname "$0")"']
    if unsupported:
        return "\n".join(lines + [f"echo {shlex.quote('error: ' + unsupported)} >&2", "exit 1"]) + "\n"
    if launcher == "python":  # one process, on GPUs and on CPU alike
        return "\n".join(lines + [f'exec "${{PYTHON:-python}}" {script} "$@"']) + "\n"
    lines += _cpu_lines(processes, script) + [f"NNODES=${{NNODES:-{processes.nodes}}}"]
    lines += {"torchrun": _torchrun, "deepspeed": _deepspeed, "accelerate": _accelerate}[launcher](processes, script)
    return "\n".join(lines) + "\n"


def _torchrun_command(nnodes: str, per_node: int, endpoint: str, script: str) -> str:
    return (f'exec "${{TORCHRUN:-torchrun}}" --nnodes {nnodes} --nproc-per-node {per_node} --rdzv-backend c10d '
            f'--rdzv-endpoint {endpoint} {script} "$@"')


def _cpu_lines(processes: Processes, script: str) -> list[str]:
    return ['for arg in "$@"; do',
            '  if [ "$arg" = "--cpu" ]; then',
            "    " + _torchrun_command("1", processes.num_gpus, 'localhost:"${MASTER_PORT:-29500}"', script),
            "  fi",
            "done"]


def _torchrun(processes: Processes, script: str) -> list[str]:
    return [_torchrun_command('"$NNODES"', processes.per_node, '"${MASTER_ADDR:-localhost}:${MASTER_PORT:-29500}"',
                              script)]


def _deepspeed(processes: Processes, script: str) -> list[str]:
    # Across nodes the DeepSpeed launcher needs a hostfile; --no_ssh starts this node's processes only.
    return ['if [ "$NNODES" -gt 1 ]; then',
            '  exec deepspeed --hostfile "${HOSTFILE:?set HOSTFILE to a DeepSpeed hostfile: one line per node, '
            f'hostname slots={processes.per_node}}}" --no_ssh --node_rank "${{NODE_RANK:?set NODE_RANK}}" '
            f'--num_nodes "$NNODES" --num_gpus {processes.per_node} --master_addr "${{MASTER_ADDR:?set MASTER_ADDR}}" '
            f'--master_port "${{MASTER_PORT:-29500}}" {script} "$@"',
            "fi",
            f'exec deepspeed --num_gpus {processes.per_node} --master_port "${{MASTER_PORT:-29500}}" {script} "$@"']


def _accelerate(processes: Processes, script: str) -> list[str]:
    return [f'exec accelerate launch --config_file accelerate.yaml --num_machines "$NNODES" '
            f'--num_processes $(({processes.per_node} * NNODES)) --machine_rank "${{NODE_RANK:-0}}" '
            '--main_process_ip "${MASTER_ADDR:-localhost}" --main_process_port "${MASTER_PORT:-29500}" '
            f'{script} "$@"']
