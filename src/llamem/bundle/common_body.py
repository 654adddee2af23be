"""What a bundle's train.py and generate.py share: their common options, the refusals before any work,
the one-write lines, llamem's tracker for a CPU rank and the tensor-parallel plan.
`llamem.bundle.script` writes this text into each script after its imports (the scripts stay
standalone files); `train_body.py` and `generate_body.py` import these names from here, and the
import is dropped as they are written out.
"""

from __future__ import annotations

import argparse
import sys


def common_parser(plan: dict, description: str, cpu_help: str, *, max_steps: int,
                  max_steps_help: str) -> argparse.ArgumentParser:
    """--cpu, --random-init, --max-steps and --model; the caller adds its own."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--cpu", action="store_true", help=cpu_help)
    parser.add_argument("--random-init", action="store_true",
                        help="Build the model from the bundle's config.json with random weights (no download).")
    parser.add_argument("--max-steps", type=int, default=max_steps, help=max_steps_help)
    parser.add_argument("--model", default=plan["model_id"], help="Checkpoint to load (a Hugging Face id or a "
                        "local directory).")
    return parser


def parse_checked(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    args = parser.parse_args(argv)
    if args.max_steps < 1:
        parser.error("--max-steps must be at least 1")
    return args


def refuse(plan: dict, args: argparse.Namespace, *, quantized: bool = False) -> None:
    """Exit 1 with the reasons, before any work, when this bundle cannot run the plan as asked.
    `quantized`: the script builds a quantized base (bitsandbytes), which needs a checkpoint and a GPU."""
    problems = [plan["unsupported"]] if plan["unsupported"] else []
    if args.random_init and quantized:
        problems.append("--random-init cannot build a quantized base: bitsandbytes quantizes while loading a "
                        "checkpoint; drop --random-init")
    if not args.random_init and not args.model:
        problems.append("the plan names no checkpoint (its model came from a config file): pass --model ID_OR_PATH, "
                        "or --random-init to build it from config.json")
    if args.cpu and quantized:
        problems.append("a quantized base needs bitsandbytes' GPU kernels: run without --cpu")
    if problems:
        print("error: " + "; ".join(problems), file=sys.stderr)
        sys.exit(1)


def say(line: str) -> None:
    """One write per line: the ranks share the launcher's stdout, and a line written whole is not split."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def make_tracker(args: argparse.Namespace, *, history: bool = False):
    """llamem's tracker for this rank on CPU (None on a GPU, or without llamem); `history`: it keeps every
    allocation and free, for a trace of the rank."""
    if not args.cpu:
        return None
    try:
        from llamem.bundle.ranks import RankTracker
    except ImportError:
        print("note: llamem is not installed: the CPU run prints no memory figures", file=sys.stderr)
        return None
    return RankTracker(history=history)


def tensor_parallel_plan(num_layers: int, head) -> dict:
    """torchtitan's Llama plan without sequence parallelism: q, k, v, gate and up split by columns (heads and
    MLP width), o and down by rows (one all-reduce each), the embedding over the vocabulary; `head`, the
    lm_head's style, is the caller's (training keeps its logits sharded for a vocabulary-parallel loss,
    generation gathers them so that every rank samples the same token)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    layout = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()), "lm_head": head}
    for index in range(num_layers):
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            layout[f"model.layers.{index}.{name}"] = ColwiseParallel()
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            layout[f"model.layers.{index}.{name}"] = RowwiseParallel()
    return layout
