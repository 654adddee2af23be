"""Pipeline-parallel stages sized one by one, as `torch.distributed.pipelining` runs them (torch 2.13,
`pipelining/stage.py` and `schedules.py`).

Stage s of p holds a balanced share of the layers (the first L mod p stages one more); the first stage also
the embedding, the last the final norm, the head and the loss; a tied embedding is held by both ends. Each
stage is the single-GPU estimate of its share, its activations times its micro-batches in flight, plus what
the pipeline itself keeps:
- in flight: 1F1B's warm-up runs min(p - s, m) forwards on stage s before its first backward
  (`Schedule1F1B`, "first stage num_stages warmups"); GPipe, and 1F1B below p micro-batches (which torch
  refuses, so it runs as GPipe), keeps all m.
- receive buffers: every stage but the first has one input buffer per micro-batch (batch x seq x hidden,
  the residual stream's dtype: fp32 under autocast), every stage but the last one buffer per micro-batch
  for its output's gradient (`_create_grad_recv_info`); both are made on the first step and kept.
- outputs: the last stage keeps each micro-batch's output (the logits, in the compute dtype) and loss
  until the next step (`output_chunks`, the schedule's `losses`), so through the optimizer step; with
  several micro-batches in flight there (GPipe), each keeps its loss's saved tensors until its backward.
Left out: on the first step torch runs the first stage's forward once more to infer the shapes it sends
(freed before the pipeline runs), and each stage's few 512-byte bookkeeping tensors.
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from llamem.analytic.common import r512, tensor_bytes
from llamem.analytic.logits import training_logits
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import Workload

STATE_PREFIXES = ("weights", "gradients", "optimizer")
"""Categories of a model's per-tensor state (besides the optimizer step's temporaries)."""


def stage_layers(num_layers: int, stages: int, stage: int) -> tuple[int, int]:
    """The layers [start, stop) of a stage: ceil(L / p) on the first L mod p stages, floor on the rest."""
    per, extra = divmod(num_layers, stages)
    start = stage * per + min(stage, extra)
    return start, start + per + (stage < extra)


@lru_cache(maxsize=4096)
def stage_spec(local: ModelSpec, num_layers: int, stages: int, stage: int) -> ModelSpec:
    """The stage's share of `local` (a tensor-parallel shard, or the model): its layers, and of the
    mixture-of-experts layers those among them, renumbered from 0. Embedding and head are still in it."""
    start, stop = stage_layers(num_layers, stages, stage)
    return dataclasses.replace(local, num_layers=stop - start,
                               moe_layers=tuple(i - start for i in local.moe_layers if start <= i < stop))


def in_flight(stage: int, stages: int, microbatches: int, schedule: str) -> int:
    """Micro-batches whose activations stage `stage` holds at once."""
    if schedule == "gpipe" or microbatches < stages:
        return microbatches
    return min(stages - stage, microbatches)


def vocab_state(phases_of, local: ModelSpec) -> dict[str, dict[str, int]]:
    """One vocabulary x hidden tensor's state per phase (weights, gradients, optimizer state, and the
    optimizer step's temporaries), after data parallelism: the untied model less the tied one.
    `phases_of(spec)` gives a spec's phases on this GPU."""
    untied, tied = phases_of(tied_as(local, False)), phases_of(tied_as(local, True))
    diff: dict[str, dict[str, int]] = {}
    for name, breakdown in untied.items():
        diff[name] = {key: value - tied[name].get(key, 0) for key, value in breakdown.items()
                      if (key.startswith(STATE_PREFIXES) or (key == "temporaries" and name == "optimizer"))
                      and key not in ("weights/autocast_copies", "weights/teacher")
                      and value > tied[name].get(key, 0)}
    return diff


@lru_cache(maxsize=4096)
def tied_as(local: ModelSpec, tied: bool) -> ModelSpec:
    return dataclasses.replace(local, tie_word_embeddings=tied)


def hidden_bytes(local: ModelSpec, w: Workload) -> int:
    """One micro-batch's hidden states as sent between stages: the residual stream, fp32 under autocast."""
    per_element = 4 if w.mixed else DTYPE_BYTES[w.compute_dtype]
    return r512(per_element * w.batch * w.seq * local.hidden_size)


def output_bytes(local: ModelSpec, w: Workload) -> int:
    """One micro-batch's output kept by the last stage: its logits (compute dtype) and its loss."""
    return tensor_bytes(w.batch * w.seq * local.vocab_size, w.compute_dtype) + r512(4)


def trim_stage(phases: dict[str, dict[str, int]], vocab: dict[str, dict[str, int]], local: ModelSpec,
               w: Workload, *, first: bool, last: bool) -> None:
    """Take out what the stage does not hold: the embedding off every stage but the first, the final norm
    and the head (its state, its autocast copy, its logits) off every stage but the last; a tied embedding
    is one tensor held by both ends."""
    removed = (not first and not last) if local.tie_word_embeddings else (not first) + (not last)
    head_copy = tensor_bytes(local.vocab_size * local.hidden_size, w.compute_dtype) if w.mixed and not last else 0
    for name, breakdown in phases.items():
        for key, value in vocab.get(name, {}).items():
            # The final norm, a hidden-size vector: the vocabulary tensor's state per row, each rounded alike.
            norm = 0 if last else r512(-(-value // local.vocab_size))
            if key in breakdown:
                breakdown[key] = max(breakdown[key] - removed * value - norm, 0)
        if head_copy and "weights/autocast_copies" in breakdown:
            breakdown["weights/autocast_copies"] = max(breakdown["weights/autocast_copies"] - head_copy, 0)
        if not last:
            breakdown.pop("logits", None)


PER_MICROBATCH = ("activations", "weights/autocast_copies")
"""What each micro-batch in flight holds for itself: its saved activations, and under autocast its own
compute-dtype copies of the Linear weights (each forward call enters autocast anew, and leaving it drops
the cache, so every micro-batch's graph keeps the copies it made)."""


def scaled(breakdown: dict[str, int], times: int, gradients: bool, loss_saved_bytes: int = 0) -> dict[str, int]:
    """`times` micro-batches in flight: each holds its own PER_MICROBATCH bytes and, besides the current
    one's loss, its loss's saved tensors (`loss_saved_bytes`, the last stage's)."""
    held = {key: value * times if key in PER_MICROBATCH else value for key, value in breakdown.items()
            if gradients or key != "gradients"}
    if loss_saved_bytes and times > 1:
        held["logits/pipeline_losses"] = (times - 1) * loss_saved_bytes
    return held


def last_stage_loss_saved_bytes(local: ModelSpec, w: Workload, last: bool) -> int:
    """What one micro-batch's loss keeps for its backward on the last stage (none on the others)."""
    return training_logits(local, w).saved if last and w.is_training else 0


def schedule_in_flight(phases: dict[str, dict[str, int]], flight: int, microbatches: int, *,
                       gradients_kept: bool, loss_saved_bytes: int = 0) -> None:
    """Forward and backward with `flight` micro-batches in flight. With more micro-batches than that, 1F1B
    runs forwards after backwards, so the step's gradients are there while `flight` are in flight. Otherwise
    (GPipe, or a stage whose warm-up runs every forward) all forwards come first: no gradients in forward
    (`zero_grad(set_to_none=True)` dropped them), and in backward either all in flight before the first
    gradient or one fewer once they exist. `gradients_kept`: sharded gradient buffers that stay allocated."""
    if flight <= 1 and microbatches <= 1:
        return
    steady = microbatches > flight or gradients_kept
    if "forward" in phases:
        phases["forward"] = scaled(phases["forward"], flight, steady, loss_saved_bytes)
    if "backward" in phases:
        backward = phases["backward"]
        options = [scaled(backward, flight, steady, loss_saved_bytes)]
        if not steady:
            options.append(scaled(backward, max(flight - 1, 1), True, loss_saved_bytes))
        phases["backward"] = max(options, key=lambda b: sum(b.values()))


def add_pipeline_buffers(phases: dict[str, dict[str, int]], local: ModelSpec, w: Workload, *, first: bool,
                         last: bool, microbatches: int, flight: int) -> None:
    """The receive buffers and kept outputs (see the module). In forward the in-flight micro-batches' input
    buffers are their first layer's saved inputs, and the current output is the estimate's own logits, so
    forward adds only the others; in backward the input's gradient, sent back, takes its buffer's place."""
    buffer, output = hidden_bytes(local, w), output_bytes(local, w)
    for name in ("forward", "backward", "optimizer"):
        forward = name == "forward"
        added = {"activations/pipeline_inputs": 0 if first else buffer * (microbatches - (flight if forward else 0)),
                 "activations/pipeline_output_grads": 0 if last else buffer * microbatches,
                 "logits/pipeline_outputs": output * (microbatches - (1 if forward else 0)) if last else 0}
        if name in phases:
            phases[name].update({key: value for key, value in added.items() if value > 0})


def stage_positions(stages: int) -> list[int]:
    """The stages worth sizing: the first, the second (the first middle one, the most in flight of
    them), the last; the others hold no more than these (fewer layers, fewer in flight)."""
    return sorted({0, min(1, stages - 1), stages - 1})

