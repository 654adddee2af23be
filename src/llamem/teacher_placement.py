"""Where a distillation teacher lives on the GPUs of a layout, and what each placement costs a GPU.

The teacher is frozen: bf16 weights (or bitsandbytes ones with `--teacher-quant`), a forward under
`torch.no_grad()` per micro-batch, no gradients and no optimizer state. Tensor and pipeline parallelism
split it like the student (`llamem.parallel.shard_spec`); over the data-parallel ranks it is
- replicated: every rank holds the whole teacher (as quantized);
- sharded: the teacher wrapped with FSDP2 `fully_shard` on its own (the embedding, each decoder layer,
  the final norm with the head, the root), even beside a student under DDP or ZeRO-1/2: each rank keeps
  a bf16 shard of every parameter (dim 0 padded to N equal pieces, `fsdp_shard_bytes`) and gathers one
  unit at a time in the teacher's forward. At a unit's work a rank holds its all-gather output and its
  unsharded parameters (both c U, torch's `_fsdp_collectives.py` / `_fsdp_param.py`, as
  `llamem.parallel.fsdp2_phases` derives), and the previous unit's output until this one's copy-out;
  with the teacher's hidden state and, at the head, its logits. The student's own peak comes later (the
  teacher's unit is resharded after its forward), so the gathered units add a moment, not a term.
- auto (`--teacher-placement` left out): what the student's layout implies, as llamem sized it before
  the placement was a choice: sharded under ZeRO-3 with DeepSpeed's accounting (a 1/N share plus the
  gathered largest layer in bf16 weights and gradients, 4 bytes per parameter, held throughout), or
  FSDP2's under `--engine fsdp2`; replicated otherwise.
"""

from __future__ import annotations

from llamem.analytic.common import add_breakdowns, r512
from llamem.analytic.weights import model_weight_bytes, rope_buffer_bytes
from llamem.model import ModelSpec
from llamem.workload import Workload

TEACHER_WORKLOAD = Workload(task="infer", precision="bf16")
"""How FSDP2 holds the teacher: bf16 storage, bf16 gathered parameters (no MixedPrecisionPolicy)."""
MOMENT_KEYS = ("weights/autocast_copies", "weights/gathered", "activations", "logits", "temporaries",
               "gradients/unsharded")
"""The student's terms of a forward moment that do not exist yet while the teacher runs (it runs first)."""


def placement(w: Workload, sharding: str) -> str:
    """The placement a workload asks for, or (auto) the one its layout's sharding implies."""
    if w.teacher_placement != "auto":
        return w.teacher_placement
    return "sharded" if sharding == "zero3" else "replicated"


def placement_problems(w: Workload, dp: int) -> list[str]:
    """What a layout of `dp` data-parallel replicas cannot do with the teacher, each with the fix."""
    if w.teacher_placement == "sharded" and dp == 1:
        return ["--teacher-placement sharded splits the teacher over data-parallel GPUs, and this layout has one "
                "replica: add --gpus N (more than --tp x --pp), or drop --teacher-placement"]
    return []


def whole_teacher_bytes(teacher: ModelSpec, w: Workload) -> int:
    """The replicated teacher: every weight in bf16 (or quantized, with its scales), RoPE's buffers (FSDP2's
    accounting counts it in one term, `weights/teacher`; the single-GPU engine puts the scales apart)."""
    weights, scales = model_weight_bytes(teacher, "bf16", w.teacher_quant)
    return weights + scales


def teacher_units(teacher: ModelSpec, world: int) -> list:
    """The sharded teacher's FSDP2 units (`llamem.parallel.Fsdp2Unit`), in bf16 over `world` ranks."""
    from llamem.parallel import fsdp2_unit, fsdp2_unit_shapes

    return [fsdp2_unit(shapes, TEACHER_WORKLOAD, world) for shapes in fsdp2_unit_shapes(teacher)]


def sharded_teacher_bytes(teacher: ModelSpec, world: int) -> int:
    """A rank's shards of the teacher (one bf16 tensor per parameter) and RoPE's buffers, kept whole."""
    return sum(u.shards_bytes for u in teacher_units(teacher, world)) + rope_buffer_bytes(teacher)


def teacher_forward_moment(teacher: ModelSpec, w: Workload, world: int, forward: dict[str, int]) -> dict[str, int]:
    """The busiest moment of the sharded teacher's forward: the student's state of the `forward` moment
    (its activations, logits and casts not made yet) and, at one unit's copy-out, that unit gathered (its
    all-gather output and unsharded parameters) beside the previous unit's output, with the teacher's hidden
    states (a layer's input and output) or, at the head, its logits. A tied embedding's root unit is gathered
    first and stays so through the forward (`_fsdp_state.py`), until train.py reshards it."""
    units = teacher_units(teacher, world)
    tied = teacher.tie_word_embeddings
    order = [units[-1], *units[:-1]] if tied else units  # forward order: the root's embedding first
    root = order[0].gathered_bytes if tied else 0
    tokens = w.batch * w.seq
    hidden = 2 * r512(2 * tokens * teacher.hidden_size)
    logits = r512(2 * tokens * teacher.vocab_size)
    moments = []
    for index, unit in enumerate(order):
        previous = order[index - 1].buffer_bytes if index else 0
        head = index == len(order) - 1 and not tied
        moments.append({"weights/teacher_gathered": unit.gathered_bytes + unit.buffer_bytes + previous
                        + (root if index else 0), "activations": hidden, "logits": logits if head else 0})
    if tied:  # the head is the root's embedding, gathered since the start
        moments.append({"weights/teacher_gathered": root + order[-1].buffer_bytes, "activations": hidden,
                        "logits": logits})
    state = {k: v for k, v in forward.items() if k not in MOMENT_KEYS}
    return add_breakdowns(state, max(moments, key=lambda m: sum(m.values())))


def place_teacher(phases: dict[str, dict[str, int]], teacher: ModelSpec, w: Workload, layout) -> None:
    """Set `weights/teacher` in every phase as the placement holds it on one GPU of `layout` (after tensor and
    pipeline parallelism: `teacher` is this GPU's part) and add the sharded teacher's forward moment; in place."""
    where = placement(w, layout.sharding)
    if where == "replicated" or layout.dp == 1:
        return  # the single-GPU engine's whole teacher
    if w.teacher_placement == "auto" and layout.engine == "deepspeed":
        # DeepSpeed's ZeRO-3 shards the frozen teacher like any other module: a share and its gathered largest layer.
        from llamem.parallel import largest_layer_params

        for breakdown in phases.values():
            if "weights/teacher" in breakdown:
                breakdown["weights/teacher"] = (breakdown["weights/teacher"] // layout.dp
                                                + 2 * 2 * largest_layer_params(teacher))
        return
    shards = sharded_teacher_bytes(teacher, layout.dp)
    for breakdown in phases.values():
        breakdown["weights/teacher"] = shards
    moment = teacher_forward_moment(teacher, w, layout.dp, phases["forward"])
    if sum(moment.values()) > sum(phases["forward"].values()):
        phases["forward"] = moment


def placement_note(w: Workload, layout) -> str | None:
    """Where a distillation's teacher is on the GPUs of `layout`, in a line for a report (None: no teacher)."""
    if w.task != "distill":
        return None
    quant = f" ({w.teacher_quant})" if w.teacher_quant != "none" else ""
    if placement(w, layout.sharding) == "replicated" or layout.dp == 1:
        return f"{w.teacher}{quant} replicated: whole on every data-parallel GPU" + (
            " (split by tensor / pipeline parallelism like the student)" if layout.tp * layout.pp > 1 else "")
    if w.teacher_placement == "auto" and layout.engine == "deepspeed":
        return (f"{w.teacher}{quant} sharded over {layout.dp} GPUs by ZeRO-3 (a 1/{layout.dp} share and the gathered "
                "largest layer)")
    return f"{w.teacher} sharded over {layout.dp} GPUs with FSDP2 fully_shard on its own, gathered a layer at a time"


TEACHER_QUANTS = ("int8", "nf4")
"""The quantized teachers the planner tries: LLM.int8 (closest to bf16), then NF4."""


def teacher_options(w: Workload, dp: int) -> list[tuple[dict, int]]:
    """(changes, tier) the planner tries for a distillation teacher where nothing fits with it as asked, least
    change first: sharded over the data-parallel GPUs (the same numerics), then quantized (tier 1: the
    teacher's logits change a little) and replicated, as bitsandbytes' weights are placed."""
    if w.task != "distill":
        return []
    options = []
    if dp > 1 and w.teacher_placement != "sharded" and w.teacher_quant == "none":
        options.append(({"teacher_placement": "sharded"}, 0))
    if w.teacher_quant == "none":
        keep = {} if w.teacher_placement == "auto" else {"teacher_placement": "replicated"}
        options += [({"teacher_quant": quant, **keep}, 1) for quant in TEACHER_QUANTS]
    return options


def teacher_saving_bytes(teacher: ModelSpec, w: Workload, changes: dict, dp: int) -> int:
    """The most an option of `teacher_options` can save a GPU holding `teacher` (its part of it): the
    replicated teacher's bytes less what it keeps instead, its shards or its quantized weights."""
    whole = whole_teacher_bytes(teacher, w)
    if changes.get("teacher_placement") == "sharded":
        return whole - sharded_teacher_bytes(teacher, dp)
    quantized = Workload(task="distill", teacher="teacher", teacher_quant=changes.get("teacher_quant", "none"))
    return whole - whole_teacher_bytes(teacher, quantized)


def teacher_workload(w: Workload) -> Workload:
    """How the teacher is loaded: like a bf16 generation model, quantized as `--teacher-quant` says."""
    return Workload(task="infer", precision="bf16", attn=w.attn, quant=w.teacher_quant)
