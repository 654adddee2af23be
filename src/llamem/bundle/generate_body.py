"""The body of a generation bundle's generate.py: `llamem.bundle` writes the plan's settings (`PLAN`), its
model-loading code (`load_model`) and its `generate` options (`GENERATE_OPTIONS`) above this text and
`main(PLAN, load_model)` below it.

The strategies, as `llamem.parallel` sizes them:
- single: one GPU; replicas: one process per GPU (torchrun), each generating its share of the prompts;
- device_map: one process, the decoder layers split over the GPUs in runs of ceil(L/p) (the embedding on
  the first, the final norm and the head on the last): what `device_map="auto"` does, with the plan's
  split. The GPUs work one after another: each token passes them in turn, so one is busy at a time;
- tp: tensor parallel under torchrun (torch's `parallelize_module`: attention and MLP split Megatron-style,
  the embedding and the head over the vocabulary, the last token's logits gathered for sampling). Every
  GPU works on every token.

`--cpu` runs the same processes on CPU (gloo), each counted by llamem's CpuMemoryTracker when llamem is
installed; a device_map run prints the weights each GPU of the map would hold.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
from pathlib import Path  # noqa: F401  (load_model, above main, reads config.json with it)

import torch
import torch.distributed as dist

from llamem.bundle.common_body import (common_parser, make_tracker, parse_checked, refuse, say,
                                       tensor_parallel_plan)


def parse_args(plan: dict, argv: list[str] | None = None) -> argparse.Namespace:
    parser = common_parser(plan, f"Generate with {plan['model_name']} as planned by llamem "
                           f"({plan['layout_description']}) from random prompts.", "Run the planned processes on "
                           "CPU (gloo backend); each process's memory is counted by llamem's CpuMemoryTracker.",
                           max_steps=1, max_steps_help="Generation rounds (each the plan's batch).")
    return parse_checked(parser, argv)


def setup(args: argparse.Namespace) -> tuple[int, int, torch.device]:
    """(rank, world size, device); gloo on CPU, NCCL on GPUs (a device_map run is one process)."""
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cpu") if args.cpu else torch.device("cuda", local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        dist.init_process_group("gloo" if args.cpu else "nccl")
    return rank, world, device


def place(plan: dict, model, device: torch.device, world: int, tracker):
    """The model on its GPU(s) as the plan places it."""
    if plan["strategy"] == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

        # Every rank loaded the same weights: each keeps its piece (no scatter from rank 0), one parameter at a
        # time on the GPU, never the whole model; then the norms and buffers move.
        head = ColwiseParallel(output_layouts=Replicate())  # the logits gathered: every rank samples the same token
        parallelize_module(model, init_device_mesh(device.type, (world,)),
                           tensor_parallel_plan(model.config.num_hidden_layers, head), src_data_rank=None)
        model.to(device)
        gc.collect()  # the whole weights the shards were cut from
        if tracker is not None:  # the replicated norms and the buffers: count them as moved
            tracker.track([p for p in model.parameters() if not hasattr(p, "to_local")], list(model.buffers()),
                          category="weights")
        return model
    if tracker is not None:  # on a GPU the loaded weights are moved to it; on CPU they stay: count them
        tracker.track(model)
    if plan["strategy"] == "device_map" and device.type == "cuda":
        from accelerate import dispatch_model

        return dispatch_model(model, device_map=plan["device_map"])
    return model.to(device)


def device_map_weights(plan: dict, model) -> dict[int, int]:
    """Bytes of parameters and buffers each GPU of the plan's device map holds."""
    held: dict[int, int] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        owner = max((prefix for prefix in plan["device_map"] if name.startswith(prefix + ".")), key=len)
        gpu = plan["device_map"][owner]
        held[gpu] = held.get(gpu, 0) + tensor.numel() * tensor.element_size()
    return held


def prompts(plan: dict, rank: int, world: int, device: torch.device) -> torch.Tensor:
    """Random token ids: the replica's share of the batch (tensor-parallel ranks share one)."""
    replica = rank if plan["strategy"] == "replicas" else 0
    generator = torch.Generator().manual_seed(1000 + replica)
    ids = torch.randint(0, plan["vocab_size"], (plan["batch"], plan["seq"]), generator=generator)
    return ids.to(device)  # a device_map's first GPU (cuda:0) holds the embedding


def main(plan: dict, load_model, argv: list[str] | None = None) -> None:
    args = parse_args(plan, argv)
    refuse(plan, args)
    rank, world, device = setup(args)
    if rank == 0:
        say(f"llamem bundle: {plan['model_name']}, {plan['layout_description']}, {world} process"
            f"{'es' if world > 1 else ''} on {'CPU' if args.cpu else 'GPUs'}; planned per GPU: "
            f"peak_allocated_bytes={plan['peak_allocated_bytes']} device_bytes={plan['device_bytes']}")
    torch.manual_seed(0)  # every rank builds the same random weights
    model = load_model(args.random_init, args.model).eval()
    tracker = make_tracker(args)
    # no_grad, as generate's own: under inference_mode a tensor-parallel rank's memory grew with every round
    # (torch 2.13 on CPU, gloo), which no GPU run shows.
    with tracker if tracker is not None else contextlib.nullcontext(), torch.no_grad():
        model = place(plan, model, device, world, tracker)
        if plan["strategy"] == "device_map" and rank == 0:
            say("device_map weights_bytes " + " ".join(f"gpu{gpu}={size}" for gpu, size in
                                                        sorted(device_map_weights(plan, model).items())))
        for step in range(1, args.max_steps + 1):
            ids = prompts(plan, rank, world, device)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 pad_token_id=0, min_new_tokens=plan["new_tokens"], **GENERATE_OPTIONS)  # noqa: F821
            figures = f" peak_bytes={tracker.take_high_water()}" if tracker is not None else ""
            say(f"rank {rank} step {step} new_tokens={out.shape[1] - ids.shape[1]} "
                f"last={out[0, -1].item()}{figures}")
    if tracker is not None:
        say(f"rank {rank} peak_bytes={tracker.run_peak_bytes}")
    if dist.is_initialized():
        dist.destroy_process_group()
