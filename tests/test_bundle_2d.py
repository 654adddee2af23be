"""The tensor- and pipeline-parallel launch bundle ("tp+pp", torchtitan's 2-D layout) runs: `bash launch.sh --cpu
--random-init --max-steps 2` starts tp 2 x pp 2 = 4 CPU ranks of a 4-layer tiny Llama on gloo (torch 2.13 runs
DTensor's tensor parallel inside `torch.distributed.pipelining` stages there). Ranks 0 and 1 are stage 0 (the
embedding and layers 0-1, each split over the pair), ranks 2 and 3 stage 1 (layers 2-3, the final norm and the
vocabulary-split head, the loss on its shards under `loss_parallel`).

What is exact is what each rank holds once wrapped: its stage's tensor-parallel shards. The peaks are held to
`llamem estimate --gpus 4 --tp 2 --pp 2 --grad-accum 2` (the busiest stage, the last) and to
`llamem.parallel.pipeline_stage_phases` for the first; the two gaps the estimate has are named where they are
asserted. The run is the session's (`bundle_runner.start_run`): one launch of 4 ranks for every test here.
"""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from bundle_runner import (  # noqa: E402
    LINE,
    NORM_BYTES,
    ROPE_BUFFERS_BYTES,
    RUN_PEAK,
    TINY,
    H,
    V,
    _layer_shapes,
    start_run,
)

from llamem.bundle import emit_bundle, layout_plan  # noqa: E402
from llamem.bundle.emit import bundle_runs, choose, unsupported_reason  # noqa: E402
from llamem.cli import main  # noqa: E402
from llamem.gpus import get_gpu  # noqa: E402
from llamem.model import load_model  # noqa: E402
from llamem.parallel import make_layout, pipeline_stage_phases  # noqa: E402
from llamem.trace.tracer import rounded  # noqa: E402
from llamem.workload import build_workload  # noqa: E402

RANKS, TOKENS = 4, 2 * 16
WORKLOAD = {"batch": 2, "seq": 16, "grad_accum": 2, "precision": "bf16-mixed", "optimizer": "adamw"}


@pytest.fixture(scope="module")
def config_path(tmp_path_factory):
    """The tiny Llama with 4 layers: 2 per stage."""
    path = tmp_path_factory.getbasetemp() / "tiny-llama-4-layers" / "config.json"
    if not path.exists():
        path.parent.mkdir(exist_ok=True)
        path.write_text(json.dumps({**TINY, "num_hidden_layers": 4}))
    return path


@pytest.fixture(scope="module")
def grid_plan(config_path):
    spec = load_model(None, config_path=str(config_path))
    w = build_workload("train", **WORKLOAD)
    layout = make_layout(spec, w, gpus=RANKS, tp=2, pp=2)
    return layout_plan(spec, w, layout, get_gpu("h100"), model_args=("--config", str(config_path)))


def rank_figures(stdout: str) -> dict[int, dict]:
    """Per rank: its windows (wrapped, step 1, step 2) as (peak, live), its losses and its run's peak."""
    ranks: dict[int, dict] = {rank: {"windows": [], "losses": []} for rank in range(RANKS)}
    for line in stdout.splitlines():
        if match := LINE.match(line):
            ranks[int(match[1])]["windows"].append((int(match[4]), int(match[5])))
            if match[3]:
                ranks[int(match[1])]["losses"].append(float(match[3]))
        elif match := RUN_PEAK.match(line):
            ranks[int(match[1])]["peak"] = int(match[2])
    assert all(len(r["windows"]) == 3 and len(r["losses"]) == 2 and "peak" in r for r in ranks.values()), stdout
    return ranks


@pytest.fixture(scope="module")
def grid_run(grid_plan, tmp_path_factory):
    return rank_figures(start_run(tmp_path_factory, grid_plan, timeout_s=300).result().stdout)


def _peak(phases: dict[str, dict[str, int]]) -> int:
    return max(sum(b.values()) for b in phases.values())


def test_the_bundle_is_written_for_tp_and_pp_together(grid_plan, tmp_path):
    bundle = emit_bundle(grid_plan, tmp_path / "bundle")
    assert (bundle.strategy, bundle.launcher, bundle.unsupported) == ("tp+pp", "torchrun", None)
    assert grid_plan.final.layout.microbatches == 2  # 1F1B: as many micro-batches as stages
    assert "--nproc-per-node 4" in (bundle.directory / "launch.sh").read_text()
    assert "tensor parallel inside pipeline stages" in (bundle.directory / "README.md").read_text()
    train = (bundle.directory / "train.py").read_text()
    assert "'strategy': 'tp+pp'" in train and "'tp': 2" in train and "'pp': 2" in train


def test_the_search_under_emit_keeps_tp_and_pp_for_one_replica_only():
    """What the planner picks for a 70B model on 16 GPUs is emitted; with data parallel beside it, or for
    generation, it is still refused."""
    spec = load_model("llama-2-70b")
    w = build_workload("train", batch=1, seq=4096, grad_accum=4, precision="bf16", optimizer="adamw")
    runs = bundle_runs("any")
    assert runs(spec, w, make_layout(spec, w, gpus=16, tp=8, pp=2))
    assert not runs(spec, w, make_layout(spec, w, gpus=32, tp=8, pp=2))  # two replicas
    infer = build_workload("infer", batch=1, seq=4096, new_tokens=16, precision="bf16")
    layout = make_layout(spec, infer, gpus=16, tp=8, pp=2)
    strategy, _launcher = choose(layout, "any", generation=True)
    assert "not tp x8, pp x2" in unsupported_reason(infer, layout, strategy, spec)


def test_each_stage_shards_only_its_own_modules():
    from llamem.bundle.train_body import stage_tensor_parallel_plan

    first = stage_tensor_parallel_plan(4, 0, 2, first=True, last=False)
    last = stage_tensor_parallel_plan(4, 2, 4, first=False, last=True)
    assert "model.embed_tokens" in first and "lm_head" not in first
    assert "lm_head" in last and "model.embed_tokens" not in last
    assert {name.split(".")[2] for name in first if name.startswith("model.layers.")} == {"0", "1"}
    assert {name.split(".")[2] for name in last if name.startswith("model.layers.")} == {"2", "3"}
    assert len(first) == len(last) == 1 + 2 * 7  # 7 projections a layer


def test_each_rank_holds_its_stages_tensor_parallel_shards(grid_plan, grid_run):
    colwise = [(o // 2, i) for o, i in _layer_shapes()[:3] + _layer_shapes()[4:6]]
    rowwise = [(o, i // 2) for o, i in (_layer_shapes()[3], _layer_shapes()[6])]
    layers = 2 * (sum(rounded(o * i * 4) for o, i in colwise + rowwise) + 2 * NORM_BYTES)  # 2 layers a stage
    vocab_shard = rounded(V // 2 * H * 4)  # the embedding or the head, split over the vocabulary
    mesh_and_stage_bytes = 2 * 512  # the device mesh's rank list, PipelineStage's own small tensor
    held = {0: vocab_shard + layers, 1: layers + NORM_BYTES + vocab_shard}
    for rank, figures in grid_run.items():
        assert figures["windows"][0][1] == held[rank // 2] + ROPE_BUFFERS_BYTES + mesh_and_stage_bytes, rank
    # The stage's share as the estimate loads it: the same shards, RoPE's buffers on every stage.
    spec, w, layout = grid_plan.model, grid_plan.final.workload, grid_plan.final.layout
    loaded = {stage: pipeline_stage_phases(spec, w, layout, stage)["load"]["weights"] for stage in (0, 1)}
    assert loaded == {stage: held[stage] + ROPE_BUFFERS_BYTES for stage in (0, 1)} == {0: 216_064, 1: 216_576}


def test_the_loss_is_finite_and_the_same_on_every_rank(grid_run):
    losses = {tuple(figures["losses"]) for figures in grid_run.values()}
    assert len(losses) == 1  # the last stage's loss, broadcast
    for loss in losses.pop():
        assert math.isfinite(loss) and abs(loss - math.log(V)) < 0.5  # random weights: about ln V


def test_each_rank_peaks_near_its_stages_estimate(grid_plan, grid_run, config_path, capsys):
    spec, w, layout = grid_plan.model, grid_plan.final.workload, grid_plan.final.layout
    stages = [_peak(pipeline_stage_phases(spec, w, layout, stage)) for stage in (0, 1)]
    assert stages == [1_200_640, 1_345_024]
    capsys.readouterr()
    assert main(["estimate", "--config", str(config_path), "--batch", "2", "--seq", "16", "--grad-accum", "2",
                 "--precision", "bf16-mixed", "--optimizer", "adamw", "--gpus", "4", "--tp", "2", "--pp", "2",
                 "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["peak_allocated_bytes"] == stages[1] == grid_plan.final.allocated_bytes
    # A stage's tensor-parallel ranks hold the same, but gloo may hold the pipeline's sends late on either rank
    # under load: up to both micro-batches' fp32 hidden states (8,192 bytes; measured once, rank 1 over rank 0).
    in_flight_sends = rounded(4 * TOKENS * H)
    pairs = [[grid_run[rank]["peak"] for rank in (2 * stage, 2 * stage + 1)] for stage in (0, 1)]
    assert all(max(pair) - min(pair) <= in_flight_sends for pair in pairs), pairs
    peaks = {0: min(pairs[0]), 2: min(pairs[1])}
    # Stage 0 peaks in the second micro-batch's backward, the first's gradients made, with DTensor's whole-
    # vocabulary embedding gradient (V x h fp32, 65,536 bytes more than its shard; `add_whole_embedding_gradient`
    # on a pipeline's first stage): measured 1,209,344, 0.7 % above the estimate (1.5 % when it was left out).
    assert rounded(V * H * 4) - rounded(V // 2 * H * 4) == 65_536
    assert abs(peaks[0] - stages[0]) <= 0.01 * stages[0], (peaks[0], stages[0])
    # Stage 1 peaks in the last micro-batch's loss backward, torch's `loss_parallel` (`llamem.analytic.loss_parallel`,
    # held to torch's handlers op by op in test_tp_loss.py): the saved log_softmax beside three fp32 tokens x V/tp
    # tensors (zeros_like, exp and their sum, then the product) and the handler's T-vectors, which the bundle's
    # tracker sees (`RankTracker` enters itself again inside DTensor's handlers): measured 1,346,048, 0.08 % above the
    # estimate (1,280,512, 4.8 % below, while the tracker saw the handlers' results only).
    assert abs(peaks[2] - stages[1]) <= 0.01 * stages[1], (peaks[2], stages[1])
