"""Several nodes: collectives that leave a node run at the network's rate, tensor parallel stays in
a node, `--nodes N --gpus-per-node G` give N x G GPUs, and the bundle's slurm.sbatch runs launch.sh
on every node with the rendezvous variables it reads."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
import subprocess

import pytest

from llamem.bundle import emit_bundle, layout_plan
from llamem.cli import main
from llamem.cluster import INFINIBAND_HDR_BYTES_PER_S, Cluster, placement_problems
from llamem.cost import communication_seconds, step_seconds
from llamem.gpus import get_gpu
from llamem.model import load_model
from llamem.parallel import Layout, make_layout
from llamem.units import GB
from llamem.workload import build_workload

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
H100 = get_gpu("h100-80gb")
DDP_16 = Layout(dp=16, sharding="ddp")


# Cost model ---------------------------------------------------------------------------------------
def test_a_data_parallel_all_reduce_across_two_nodes_runs_at_the_network_rate():
    spec, w = load_model("debug"), build_workload("train", batch=16, seq=128)
    grad_bytes = 2 * spec.num_params  # bf16 gradients
    ring = 2 * 15 / 16 * grad_bytes  # bytes a GPU sends (and receives) in a ring all-reduce of 16
    two_nodes = communication_seconds(spec, w, DDP_16, H100, Cluster(gpus_per_node=8))
    assert two_nodes == pytest.approx(ring / (50 * GB), rel=1e-12)
    one_node = communication_seconds(spec, w, DDP_16, H100, Cluster(gpus_per_node=16))
    assert one_node == pytest.approx(ring / (900 * GB), rel=1e-12)  # NVLink 4 (H100 SXM)
    hdr = communication_seconds(spec, w, DDP_16, H100, Cluster(gpus_per_node=8,
                                                               inter_node_bytes_per_s=INFINIBAND_HDR_BYTES_PER_S))
    assert hdr == pytest.approx(2 * two_nodes, rel=1e-12)  # 200 Gb/s HDR: half of NDR's 400 Gb/s
    # compute is the same wherever the ranks sit: the step differs by the all-reduce alone
    slower = step_seconds(spec, w, DDP_16, H100, cluster=Cluster(gpus_per_node=8))
    faster = step_seconds(spec, w, DDP_16, H100, cluster=Cluster(gpus_per_node=16))
    assert slower - faster == pytest.approx(two_nodes - one_node, rel=1e-9)


def test_the_default_cluster_is_the_cards_catalog_node_on_infiniband_ndr():
    spec, w = load_model("debug"), build_workload("train", batch=16, seq=128)
    assert step_seconds(spec, w, DDP_16, H100) == step_seconds(spec, w, DDP_16, H100, cluster=Cluster(gpus_per_node=8))


def test_data_parallel_groups_follow_megatrons_rank_order():
    # tp 4 x dp 2 fill 8 consecutive ranks: the all-reduce stays in a node of 8; pipeline stages cross nodes
    spec, w = load_model("debug"), build_workload("train", batch=16, seq=128)
    layout = Layout(dp=2, tp=4, pp=2, sharding="ddp")
    inside = communication_seconds(spec, w, layout, H100, Cluster(gpus_per_node=8))
    across = communication_seconds(spec, w, layout, H100, Cluster(gpus_per_node=4))
    grad_bytes = 2 * spec.num_params / (4 * 2)
    assert across - inside == pytest.approx(2 * 1 / 2 * grad_bytes * (1 / (50 * GB) - 1 / (900 * GB)), rel=1e-9)


def test_tensor_parallel_larger_than_a_node_is_refused():
    assert placement_problems(tp=8, cluster=Cluster(gpus_per_node=8)) == []
    (problem,) = placement_problems(tp=16, cluster=Cluster(gpus_per_node=8))
    assert problem.startswith("tensor parallel 16 does not fit in a node of 8 GPUs") and "--tp 8 or less" in problem


# Command line -------------------------------------------------------------------------------------
def _json(argv, capsys):
    code = main([*argv, "--json"])
    return code, json.loads(capsys.readouterr().out)


def test_nodes_times_gpus_per_node_is_the_gpu_count_of_estimate(capsys):
    code, report = _json(["estimate", "debug", "--nodes", "2", "--gpus-per-node", "8"], capsys)
    assert code == 0 and report["layout"] == "ddp x16"
    code, same = _json(["estimate", "debug", "--gpus", "16"], capsys)
    assert same == report
    code, agreeing = _json(["estimate", "debug", "--gpus", "16", "--nodes", "2", "--gpus-per-node", "8"], capsys)
    assert code == 0 and agreeing == report


def test_gpus_that_disagree_with_the_nodes_are_a_usage_error(capsys):
    code, out = _json(["estimate", "debug", "--gpus", "8", "--nodes", "2", "--gpus-per-node", "8"], capsys)
    assert code == 2 and out["error"]["message"] == ("--gpus 8 disagrees with --nodes 2 x --gpus-per-node 8 = 16 "
                                                     "GPUs: drop --gpus, or give --gpus 16")
    code, out = _json(["plan", "debug", "--gpu", "h100-80gb", "--gpus", "8", "--nodes", "2", "--gpus-per-node", "8"],
                      capsys)
    assert code == 2 and "drop --gpus, or give --gpus 16" in out["error"]["message"]
    code, out = _json(["estimate", "debug", "--nodes", "2"], capsys)
    assert code == 2 and out["error"]["message"] == "--nodes 2 needs the node's size: add --gpus-per-node G"


def test_estimate_refuses_tensor_parallel_across_nodes(capsys):
    code, out = _json(["estimate", "debug", "--nodes", "2", "--gpus-per-node", "4", "--tp", "8"], capsys)
    assert code == 1 and "tensor parallel 8 does not fit in a node of 4 GPUs" in out["error"]["message"]


def test_plan_spreads_over_nodes_and_keeps_tensor_parallel_in_one(capsys):
    code, plan = _json(["plan", "debug", "--gpu", "h100-80gb", "--nodes", "4", "--gpus-per-node", "2"], capsys)
    assert code == 0 and plan["num_gpus"] == 8 and plan["final"]["config"]["layout"]["tp"] <= 2
    code, plan = _json(["plan", "debug", "--gpu", "h100-80gb", "--nodes", "2"], capsys)  # the card's node: 8
    assert code == 0 and plan["num_gpus"] == 16


# slurm.sbatch -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bundle(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cluster")
    (folder / "config.json").write_text(json.dumps(TINY))
    spec = load_model(None, config_path=str(folder / "config.json"))
    w = build_workload("train", batch=4, seq=16)
    gpu = dataclasses.replace(get_gpu("h100"), gpus_per_node=2)  # 2 nodes of 2 GPUs
    plan = layout_plan(spec, w, make_layout(spec, w, gpus=4, sharding="ddp"), gpu)
    return emit_bundle(plan, folder / "bundle")


def test_the_slurm_template_asks_for_the_plans_nodes_and_runs_launch_sh_on_each(bundle):
    lines = (bundle.directory / "slurm.sbatch").read_text().splitlines()
    assert "slurm.sbatch" in bundle.files and bundle.launcher == "torchrun"
    assert [line for line in lines if line.startswith("#SBATCH")] == [
        "#SBATCH --job-name=llamem", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=2", "#SBATCH --output=slurm-%j.out"]
    assert 'export MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"' in lines
    assert lines[-1] == ("srun --kill-on-bad-exit=1 bash -c 'export NODE_RANK=\"$SLURM_NODEID\"; "
                         "exec bash launch.sh \"$@\"' launch.sh \"$@\"")
    subprocess.run(["bash", "-n", str(bundle.directory / "slurm.sbatch")], check=True)
    readme = (bundle.directory / "README.md").read_text()
    assert "`sbatch slurm.sbatch` asks for 2 nodes of 2 GPUs" in readme


def _shim(folder, name, body):
    path = folder / name
    path.write_text("#!/usr/bin/env bash\n" + body)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_the_slurm_job_starts_torchrun_on_every_node_with_its_rank(bundle, tmp_path):
    # Slurm's commands stood in by scripts: srun runs its command once per node with that node's SLURM_NODEID.
    _shim(tmp_path, "scontrol", 'echo node-a; echo node-b\n')
    _shim(tmp_path, "srun", 'while [[ "$1" == --* ]]; do shift; done\nfor id in 0 1; do SLURM_NODEID=$id "$@"; done\n')
    torchrun = _shim(tmp_path, "torchrun", 'echo "NODE_RANK=$NODE_RANK $*"\n')
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "NNODES", "NODE_RANK")}
    env.update(PATH=f"{tmp_path}:{env['PATH']}", TORCHRUN=str(torchrun), SLURM_SUBMIT_DIR=str(bundle.directory),
               SLURM_NNODES="2", SLURM_JOB_NODELIST="node-[a-b]", SLURM_JOB_ID="7")
    out = subprocess.run(["bash", str(bundle.directory / "slurm.sbatch"), "--max-steps", "2"], env=env,
                         cwd=tmp_path, capture_output=True, text=True, check=True).stdout
    assert out.splitlines() == [
        f"NODE_RANK={rank} --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint node-a:29500 "
        "train.py --max-steps 2" for rank in (0, 1)]


def test_min_gpus_and_nodes_together_are_a_usage_error():
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "llamem", "plan", "llama-3.1-8b", "--gpu", "h100-80gb", "--task",
                          "train", "--batch", "8", "--nodes", "2", "--gpus-per-node", "4", "--min-gpus"],
                         capture_output=True, text=True)
    assert run.returncode == 2
    assert "--min-gpus chooses the number of GPUs, --nodes 2 fixes it: drop one of the two" in run.stderr + run.stdout
