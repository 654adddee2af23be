"""The loss on vocabulary shards (torch's `loss_parallel`, the tensor-parallel bundles' loss) holds what
`llamem.analytic.loss_parallel` says: traced on 2 gloo ranks, the head split over the vocabulary as the
bundles split it, with the handlers' own ops counted.

DTensor runs `loss_parallel`'s handlers inside the op's dispatch, where a TorchDispatchMode is off: a plain
tracker sees each handler's result only. The bundles' tracker (`llamem.bundle.ranks.RankTracker`) counts the ops
of torch's local functions too (`_log_softmax`, `_nll_loss_and_log_softmax_backward`: it enters itself again
around each, as their caller would see them on a GPU); the trace here takes the peak in forward and in the
loss's backward.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from bundle_runner import TINY, free_port, tiny_config_path  # noqa: E402

from llamem.analytic.common import r512  # noqa: E402
from llamem.analytic.logits import training_logits  # noqa: E402
from llamem.analytic.loss_parallel import loss_parallel_logits, runs_loss_parallel  # noqa: E402
from llamem.model import ModelSpec, load_model  # noqa: E402
from llamem.parallel import Layout, MegatronLayout, make_layout, per_gpu_phases, tensor_shard  # noqa: E402
from llamem.workload import build_workload  # noqa: E402

BATCH, SEQ, H, V = 2, 16, TINY["hidden_size"], TINY["vocab_size"]
CASES = [("bf16-mixed", False), ("bf16-mixed", True), ("fp32", False)]
"""(precision, whether the 16-bit logits stay alive through the loss, as a pipeline stage keeps its output)."""

SCRIPT = r'''
import gc, json, os, sys
import torch, torch.distributed as dist
import torch.multiprocessing as mp

B, S, H, V = {batch}, {seq}, {hidden}, {vocab}
CASES = {cases}


def traced_loss(tracker, precision, kept):
    """Bytes above the start: the forward's peak, and the backward's up to the loss's fused backward."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, loss_parallel, parallelize_module

    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (2,))
    head = torch.nn.Linear(H, V, bias=False)
    vocab_split = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)  # the bundles' head
    parallelize_module(head, mesh, vocab_split, src_data_rank=None)
    mixed = precision == "bf16-mixed"
    tracker.track(head)  # its shard, made before: the transpose the matmul reads is a view of it
    gc.collect()  # the last case's graph (a reference cycle through DTensor) must not die inside this one
    with tracker:
        hidden = torch.randn(B, S, H, requires_grad=True)  # the final norm's output, counted with the activations
        ids = torch.randint(0, V, (B, S))
        start = tracker.live_bytes
        tracker.reset_peak()
        target = torch.nn.functional.pad(ids, (0, 1), value=-100) if kept else None  # a pipeline's, kept
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            output = head(hidden)
        logits = output.float()
        if not kept:  # as the bundle's TP loss: the 16-bit logits die at the upcast, the padded labels at the copy
            del output
        labels = (target if kept else torch.nn.functional.pad(ids, (0, 1), value=-100))[..., 1:].flatten()
        with loss_parallel():
            loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels, ignore_index=-100)
        del logits, labels
        forward = tracker.peak_bytes - start
        tracker.reset_peak()
        with loss_parallel():
            loss.backward()
        return forward, tracker.loss_backward_peak - start


def run(rank, port, out):
    os.environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    from torch.distributed.tensor.parallel import loss as torch_loss
    from llamem.bundle.ranks import RankTracker

    tracker = RankTracker()  # it counts the handlers' own ops, as the bundles' CPU runs do
    fused = torch_loss._nll_loss_and_log_softmax_backward

    def marked_backward(*args):
        result = fused(*args)
        tracker.loss_backward_peak = tracker.peak_bytes  # the loss's backward ends here
        return result

    torch_loss._nll_loss_and_log_softmax_backward = marked_backward  # the tracker wraps it as it enters
    torch.manual_seed(0)
    figures = [traced_loss(tracker, precision, kept) for precision, kept in CASES]
    if rank == 0:
        with open(out, "w") as f:
            json.dump(figures, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(int(sys.argv[1]), sys.argv[2]), nprocs=2)
'''


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> list[tuple[int, int]]:
    """Per case: (forward peak, loss backward peak) above what was alive before the head, on rank 0."""
    folder = tmp_path_factory.mktemp("tp_loss")
    script, out = folder / "trace_loss.py", folder / "figures.json"
    script.write_text(SCRIPT.format(batch=BATCH, seq=SEQ, hidden=H, vocab=V, cases=CASES))
    run = subprocess.run([sys.executable, str(script), str(free_port()), str(out)], capture_output=True, text=True,
                         timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert run.returncode == 0, run.stderr[-4000:]
    return [tuple(figures) for figures in json.loads(out.read_text())]


@pytest.fixture(scope="module")
def local(tmp_path_factory) -> ModelSpec:
    """A rank's share of the tiny Llama under tensor parallel 2: vocabulary 256."""
    return tensor_shard(load_model(None, config_path=str(tiny_config_path(tmp_path_factory))), 2)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_loss_holds_what_torchs_handlers_allocate(traced, local, case):
    precision, kept = CASES[case]
    w = build_workload("train", batch=BATCH, seq=SEQ, precision=precision, optimizer="adamw")
    sized = loss_parallel_logits(local, w, output_kept=kept)
    tokens_vocab = BATCH * SEQ * local.vocab_size
    # Beside the loss's own buffers: autocast's copy of the head's shard (llamem's weights/autocast_copies), and in
    # backward the 16-bit logits a pipeline stage keeps (its kept outputs, `llamem.pipeline_stages`).
    weight_copy = r512(2 * local.vocab_size * H) if precision == "bf16-mixed" else 0
    output = r512(2 * tokens_vocab) if kept and precision == "bf16-mixed" else 0
    assert traced[case] == (sized.forward_peak + weight_copy, sized.backward_peak + weight_copy + output)


def test_torch_holds_one_fp32_logits_more_than_transformers_loss_in_backward(local):
    """transformers' backward: the saved log_softmax beside two gradients; torch's fused one: beside three."""
    w = build_workload("train", batch=BATCH, seq=SEQ, precision="bf16-mixed", optimizer="adamw")
    tokens = BATCH * SEQ
    ours, theirs = loss_parallel_logits(local, w), training_logits(local, w)
    t_vectors = 4 * r512(8 * tokens) + r512(tokens) + 2 * r512(4 * tokens) + 3 * 512 - 2 * 512
    assert ours.backward_peak - theirs.backward_peak == r512(4 * tokens * local.vocab_size) + t_vectors == 36_864
    assert ours.saved == theirs.saved


def test_only_torchs_tensor_parallel_runs_loss_parallel():
    w = build_workload("train", batch=BATCH, seq=SEQ, precision="bf16-mixed", optimizer="adamw")
    lora = build_workload("lora", batch=BATCH, seq=SEQ, precision="bf16-mixed", optimizer="adamw")
    chunked = build_workload("train", batch=BATCH, seq=SEQ, precision="bf16-mixed", optimizer="adamw", loss="chunked")
    assert runs_loss_parallel(w, Layout(tp=2)) and runs_loss_parallel(w, Layout(tp=2, pp=2))
    assert not runs_loss_parallel(w, Layout(dp=2))  # no vocabulary split
    assert not runs_loss_parallel(w, MegatronLayout(tp=2))  # Megatron-LM's own vocabulary-parallel loss
    assert not runs_loss_parallel(w, Layout(dp=2, tp=2, sharding="zero1"))  # ZeRO beside: not torch's TP
    assert not runs_loss_parallel(lora, Layout(tp=2)) and not runs_loss_parallel(chunked, Layout(tp=2))


def test_a_tensor_parallel_rank_sizes_the_loss_as_loss_parallel():
    """A 70B model on 8 GPUs of tensor parallel: its backward is the loss's, torch's fused backward."""
    spec = load_model("llama-2-70b")
    w = build_workload("train", batch=1, seq=4096, precision="bf16-mixed", optimizer="adamw")
    local = tensor_shard(spec, 8)
    phases = per_gpu_phases(spec, w, make_layout(spec, w, gpus=8, tp=8))
    assert phases["backward"]["logits"] == loss_parallel_logits(local, w).backward_peak
    assert phases["forward"]["logits"] == loss_parallel_logits(local, w).forward_peak


def test_the_loss_backward_is_rebuilt_from_the_forward_as_the_engine_sizes_it():
    """Where another moment is the backward's worst, the loss's is rebuilt from the forward moment: it is the
    engine's own where the loss backward is the worst (with checkpointing: fewer autocast copies survive)."""
    from llamem.analytic import estimate
    from llamem.analytic.loss_parallel import loss_backward_moment
    from llamem.model import load_model

    local = tensor_shard(load_model("llama-3.1-8b"), 4)
    for ac in (0, 1):
        w = build_workload("train", batch=4, seq=4096, precision="bf16-mixed", optimizer="adamw", ac_every=ac)
        phases = estimate(local, w).phases
        assert "logits" in phases["backward"]
        assert loss_backward_moment(phases["forward"], local, w) == phases["backward"]


def test_the_tensor_parallel_schedule_replays_the_loss_as_sized(local):
    """The rank schedule's events (`schedule_ranks.TpEvents` with `LossParallelEvents`) for the calls the single-GPU
    schedule makes for transformers' loss under autocast (the head's saved input, the logits, their upcast, the
    log_softmax output; then nll_loss's and log_softmax's gradients and the 16-bit one): its peaks are the sized
    forward and loss backward, and it frees what it makes."""
    from llamem.analytic.loss_parallel import LossParallelEvents
    from llamem.analytic.schedule_ranks import TpEvents

    w = build_workload("train", batch=BATCH, seq=SEQ, precision="bf16-mixed", optimizer="adamw")
    sized, tv = loss_parallel_logits(local, w), BATCH * SEQ * local.vocab_size
    ev = TpEvents([], 1, 0, LossParallelEvents(local, w))
    head_input = ev.alloc([r512(2 * BATCH * SEQ * H)])
    logits, upcast, log_softmax = ev.alloc([r512(2 * tv), r512(4 * tv), r512(4 * tv)])
    ev.free([upcast])
    ev.free([logits])
    ev.mark("forward_done", "model")
    forward_events = len(ev.events)
    nll_grad, softmax_grad = ev.alloc([r512(4 * tv)]) + ev.alloc([r512(4 * tv)])
    ev.free([nll_grad, log_softmax])
    logits_grad = ev.alloc([r512(2 * tv)])
    ev.free([softmax_grad])
    ev.free(logits_grad + head_input)
    sizes, live = {}, [0]
    for event in ev.events:
        if event.action == "alloc":
            sizes[event.addr] = event.size
        live.append(live[-1] + (event.size if event.action == "alloc" else -sizes.pop(event.addr)))
    assert max(live[:forward_events + 1]) == sized.forward_peak
    assert max(live[forward_events + 1:]) == sized.backward_peak
    assert live[-1] == 0 and not sizes
