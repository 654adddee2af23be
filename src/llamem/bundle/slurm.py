"""slurm.sbatch: the bundle on Slurm nodes. One task per node runs launch.sh, which starts that
node's processes, with the rendezvous variables launch.sh reads taken from the job: NNODES from
SLURM_NNODES, MASTER_ADDR the first host of the job's node list (`scontrol show hostnames`),
NODE_RANK from SLURM_NODEID (set per task, so inside srun's command).
"""

from __future__ import annotations

from llamem.bundle.launch import Processes

MASTER_PORT = 29500


def slurm_script(*, launcher: str, processes: Processes, title: str) -> str:
    """An sbatch script for `processes.nodes` nodes of `processes.per_node` GPUs; `sbatch slurm.sbatch`
    from the bundle's folder (extra arguments go to train.py)."""
    lines = ["#!/usr/bin/env bash", f"# {title}",
             "# Usage: sbatch slurm.sbatch [train.py arguments]   (from this folder: it runs launch.sh on every node)",
             # sbatch reads #SBATCH lines only above the first command.
             "#SBATCH --job-name=llamem", f"#SBATCH --nodes={processes.nodes}", "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --gpus-per-node={processes.per_node}", "#SBATCH --output=slurm-%j.out",
             "set -euo pipefail",
             # sbatch runs a copy of this file from its spool folder: the bundle is where it was submitted.
             'cd "${SLURM_SUBMIT_DIR:?submit with sbatch from the bundle folder}"',
             'export NNODES="$SLURM_NNODES"',
             'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"',
             f'export MASTER_PORT="${{MASTER_PORT:-{MASTER_PORT}}}"']
    if launcher == "deepspeed":
        lines += ['export HOSTFILE="hostfile-$SLURM_JOB_ID"',
                  f'scontrol show hostnames "$SLURM_JOB_NODELIST" | sed "s/$/ slots={processes.per_node}/" '
                  '> "$HOSTFILE"']
    lines += ["srun --kill-on-bad-exit=1 bash -c 'export NODE_RANK=\"$SLURM_NODEID\"; exec bash launch.sh \"$@\"' "
              'launch.sh "$@"']
    return "\n".join(lines) + "\n"
