"""One pipeline stage's own allocation schedule, for its reserved memory (`llamem.device`).

What the launch bundle runs with `torch.distributed.pipelining` (torch 2.13, `pipelining/stage.py` and
`schedules.py`): each process holds one stage (its layers, the embedding on the first, the final norm and
the head on the last) and runs every step's micro-batches in the schedule's order. 1F1B runs min(p - s, M)
forwards on stage s, then one backward and one forward in turn, then the remaining backwards; GPipe (and
1F1B below p micro-batches, which the bundle runs as GPipe) all forwards, then all backwards. Per micro-
batch, op by op, the single-GPU schedule's decoder layers (`schedule_train.forward_layer`, `backward_layer`)
without the KV cache the stage's layers are called without (SDPA gets V itself and keeps it) and without
autocast casts of o_proj's and down_proj's inputs (bf16 already: their matmuls keep them), plus:

- the stage's own RoPE cos and sin per micro-batch (kept by every layer's RoPE until the first layer's
  backward) and its positions (dropped when the stage's forward returns);
- the first stage's embedding output, alive until its micro-batch's backward is done; every other stage's
  input is its receive buffer (`_setup_forward_recv_info`: one per micro-batch, made on the first step
  and kept), whose gradient (the one sent back) the backward takes off the buffer (`stage_backward` sets
  `.grad` to None) into the send's ops and work (`send_releases`);
- a stage's output stays in `fwd_cache` until its micro-batch's backward and in its send's ops and work
  until the schedule lets go of them (`send_releases`); the output's gradient arrives in a kept buffer (one
  per micro-batch, `_create_grad_recv_info`);
- the last stage: the final norm, the head under autocast (the weight's cast per micro-batch), the logits
  kept in `output_chunks` until the next step (and concatenated once the step is done: what `step()`
  returns), and the bundle's loss (`cross_entropy` of the fp32 upcast,
  the labels' copy, the log-softmax), whose backward runs at once;
- gradient accumulation over the micro-batches: the first backward's weight gradients become `.grad`,
  each later one's are added in place and freed at once (AccumulateGrad);
- then the optimizer step (its state made on the first step, foreach temporaries, `zero_grad`).

On the first step torch infers the stages' tensor shapes by running each stage once (DYNAMIC metadata
inference): a forward of one micro-batch (a non-first stage's input an empty tensor), the receive buffers,
on the last stage the loss, and a backward to the stage's input (`autograd.grad`: no weight gradients;
it is replayed as a micro-batch's backward whose weight gradients are freed as they are made), on the first
stage only the ones of its output's gradient; everything but the buffers is freed before the pipeline runs.

Left out: the pipeline's and the step's 512-byte bookkeeping tensors (pickled shape metadata, the losses'
mean, gradient clipping's norms). On the 2-stage CPU run of the launch bundle each stage's schedule reserves
what the stage's recorded events reserve and peaks where they peak: with 2 micro-batches at the same bytes (the
first stage one such 512-byte tensor lower; tests/test_bundle_pipeline.py); with 4 (1F1B's steady state) both
stages at the same bytes (tests/test_pipeline_many_microbatches.py). Built for AdamW (foreach or fused) or SGD and
untied embeddings (`pipeline_schedulable` says which layouts), under bf16/fp16 autocast, with or without every
layer checkpointed, or in pure bf16:

- checkpointed (non-reentrant): nothing saved in forward but each checkpoint's input (its layer's), the
  positions, cos and sin; autocast's weight casts kept until the stage's forward returns; in backward each layer
  recomputed up to its last saved tensor, as `schedule._backward_layers` does;
- pure bf16: the stream, the sends and cos and sin (cast as RoPE returns) in bf16; SDPA keeps RoPE's K and
  v_proj's V; no layer saves the stream it reads, so each layer's input dies after it (the first stage's
  embedding output as the stage's forward returns); the head's matmul keeps the final norm's output.

Each held to a 2-stage run (tests/test_pipeline_stage_schedules_more.py: the same reserved memory and peak).
Tensor parallel inside the stages (the bundle's "tp+pp"): the same schedule on a rank's shards with its
collectives and `loss_parallel` (`llamem.analytic.schedule_pipeline_tp`; its events' hooks here:
`StageEvents.loss_forward`, `loss_backward`, `embedding_backward`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llamem.allocator.replay import AllocEvent
from llamem.analytic.common import r512
from llamem.analytic.optimizer import has_step_temporaries
from llamem.analytic.schedule import Events, optimizer_state_tensors, weight_tensor_sizes
from llamem.analytic.schedule_train import LayerTape, backward_layer, forward_layer, norm_backward, norm_forward
from llamem.analytic.weights import rope_buffer_bytes, trainable_numels, trainable_tensor_sizes
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.pipeline_stages import hidden_bytes
from llamem.workload import Workload


@dataclass(frozen=True, kw_only=True, slots=True)
class StagePlace:
    """Where a stage sits in the pipeline and how the schedule runs it."""

    stage: int
    stages: int
    microbatches: int
    schedule: str
    """"1f1b" or "gpipe" (as planned; 1F1B below `stages` micro-batches runs as GPipe)."""

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1


def action_order(place: StagePlace) -> list[tuple[str, int]]:
    """The stage's ("F" | "B", micro-batch) actions in the schedule's order (`Schedule1F1B._step_microbatches`:
    warm-up forwards, then a backward and a forward in turn, then the remaining backwards)."""
    M = place.microbatches
    if place.schedule == "gpipe" or M < place.stages:
        return [("F", i) for i in range(M)] + [("B", i) for i in range(M)]
    warmup = min(M, place.stages - place.stage)
    order = [("F", i) for i in range(warmup)]
    for backward in range(M):
        order.append(("B", backward))
        if warmup + backward < M:
            order.append(("F", warmup + backward))
    return order


class StageEvents(Events):
    """A stage's events: frees of kept buffers are dropped (autograd is done with them, the stage is not), and
    the last V projection is remembered (SDPA keeps it where the single-GPU schedule's cache copy was)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)  # a tensor-parallel rank's events come next (`TpStageEvents`)
        self.kept: set[int] = set()
        self.v_out: int | None = None

    def free(self, ids: list[int]) -> None:
        super().free([i for i in ids if i not in self.kept])

    def keep(self, sizes: list[int]) -> list[int]:
        ids = self.alloc(sizes)
        self.kept.update(ids)
        return ids

    def projection(self, name: str, tensor: int, backward: bool = False) -> None:
        if name == "v_proj" and not backward:
            self.v_out = tensor

    held_bytes = (512,)
    """The stage's own small tensors, made at the wrap (PipelineStage's)."""

    def embedding_backward(self, grad: int, stage_input: int | None, shard_bytes: int) -> list[int]:
        """The first stage's embedding gradient from the first layer's input gradient `grad`; that gradient and
        the embedding output (`stage_input`, None if let go of in forward) are let go of after it."""
        made = self.alloc([shard_bytes])
        self.free([grad] + ([stage_input] if stage_input is not None else []))
        return made

    def loss_forward(self, T: int, V: int) -> dict[str, int]:
        """The loss on the logits' fp32 upcast (T x V; freed as the loss returns): the labels' copy, the log-
        softmax, the loss and its total weight, which its backward (`loss_backward`) takes."""
        upcast, labels, log_softmax = self.alloc([r512(4 * T * V), r512(8 * T), r512(4 * T * V)])
        loss, total_weight = self.alloc([512, 512])
        self.free([upcast])
        return {"labels": labels, "log_softmax": log_softmax, "loss": loss, "total_weight": total_weight}

    def loss_backward(self, saved: dict[str, int], T: int, V: int) -> int:
        """nll_loss's and log_softmax's backward; returns the upcast's gradient (fp32 T x V)."""
        nll_grad = self.alloc([r512(4 * T * V)])
        self.free([saved["labels"], saved["total_weight"]])
        softmax_grad = self.alloc([r512(4 * T * V)])
        self.free(nll_grad + [saved["log_softmax"]])
        return softmax_grad[0]


@dataclass(kw_only=True, slots=True)
class MicroBatch:
    """What one micro-batch's forward left for its backward."""

    stage_input: int | None
    """The receive buffer, or the first stage's embedding output (None once let go of: in pure precision nothing
    saves it, and the stage's forward drops it as it returns)."""
    tapes: list[LayerTape | None]
    """Each layer's saved tensors (None: checkpointed, recomputed in backward)."""
    rope: list[int]
    """cos and sin (and under checkpointing the positions, which the checkpoints keep too)."""
    inputs: list[int] = field(default_factory=list)
    """The checkpointed layers' inputs past the stage's own (each checkpoint keeps its input)."""
    output: int | None = None
    """A non-last stage's output, kept in `fwd_cache`."""
    head: dict[str, int] = field(default_factory=dict)
    """The last stage's head and loss tensors its backward needs."""
    final: LayerTape | None = None


def layer_without_cache(ev: StageEvents, spec: ModelSpec, w: Workload, index: int) -> tuple[LayerTape, int]:
    """A decoder layer's forward as a stage calls it (no past_key_values) and as autocast runs it: the single-
    GPU layer less its cache copies of K and V (SDPA keeps V itself)."""
    start, stream_end = len(ev.events), []
    tape = LayerTape(ev, index)
    output = forward_layer(tape, spec, w, index, stream_end)
    # The cache's K copy (fp32 under autocast, where SDPA gets its bf16 cast: RoPE's K's in a stage) and V's copy,
    # made right after it; in pure precision SDPA gets and keeps the copies: RoPE's K (made just before) in a stage.
    cache_k = stream_end[0] if w.mixed else tape.saved["key"]
    made = [e.addr for e in ev.events[start:] if e.action == "alloc"]
    kept = {cache_k + 1: ev.v_out} | ({} if w.mixed else {cache_k: made[made.index(cache_k) - 1]})
    gone, alive = {cache_k, cache_k + 1}, set(kept.values())
    ev.events[start:] = [e for e in ev.events[start:]
                         if e.addr not in gone and not (e.action == "free" and e.addr in alive)]
    tape.saved = {name: kept.get(tensor, tensor) for name, tensor in tape.saved.items()}
    return tape, output


def rope_tables(ev: Events, spec: ModelSpec, w: Workload) -> tuple[list[int], list[int]]:
    """LlamaRotaryEmbedding on the positions (fp32, cast to the hidden states' dtype as it returns: 16-bit in pure
    precision): (positions, [cos, sin])."""
    seq, hd = w.seq, spec.head_dim
    positions = ev.alloc([r512(8 * seq)])
    position_floats = ev.alloc([r512(4 * seq)])
    freqs = ev.alloc([r512(4 * seq * hd // 2)])
    ev.free(position_floats)
    emb, cos_raw = ev.alloc([r512(4 * seq * hd)] * 2)
    cos = ev.alloc([r512(4 * seq * hd)])
    ev.free([cos_raw])
    sin_raw = ev.alloc([r512(4 * seq * hd)])
    sin = ev.alloc([r512(4 * seq * hd)])
    ev.free(sin_raw + freqs + [emb])
    if w.mixed:
        return positions, cos + sin
    casts = ev.alloc([r512(DTYPE_BYTES[w.compute_dtype] * seq * hd)] * 2)
    ev.free(cos + sin)
    return positions, casts


def forward_microbatch(ev: StageEvents, spec: ModelSpec, w: Workload, place: StagePlace, stage_input: int | None
                       ) -> MicroBatch:
    """The stage's forward of one micro-batch (`PipelineStageModule.forward`) and, on the last stage, the
    loss; `stage_input`: the receive buffer (None on the first stage: the embedding's output)."""
    if stage_input is None:
        stage_input = ev.alloc([hidden_bytes(spec, w)])[0]
        ev.projection("embed", stage_input)
    positions, rope = rope_tables(ev, spec, w)
    mb = MicroBatch(stage_input=stage_input, tapes=[], rope=rope + positions * bool(w.ac_every))
    x, autocast_cache = stage_input, []
    for index in range(spec.num_layers):
        if w.ac_every:  # the checkpoint keeps the layer's input; autocast's cache the weights' casts
            tape, output = None, forward_layer(LayerTape(ev, index, no_grad=True), spec, w, index, autocast_cache)
            mb.inputs += [x] if index else []
        else:
            tape, output = layer_without_cache(ev, spec, w, index)
            ev.free([x] if index and not w.mixed else [])  # pure precision: no layer saves the stream it reads
        mb.tapes.append(tape)
        x = output
    if place.last:
        head_forward(ev, spec, w, mb, x, autocast_cache)
    else:
        # held by fwd_cache, not by autograd (a checkpointed last layer saves nothing)
        mb.output = mb.tapes[-1].saved.pop("h2", x) if mb.tapes and mb.tapes[-1] else x
        ev.free(autocast_cache)  # the stage's autocast exits
    if place.first and not (w.mixed or w.ac_every):
        ev.free([mb.stage_input])
        mb.stage_input = None
    ev.free([] if w.ac_every else positions)
    return mb


def recompute_layer(ev: StageEvents, spec: ModelSpec, w: Workload, index: int) -> LayerTape:
    """A checkpointed layer's recomputation in backward, up to its last saved tensor (`schedule._backward_layers`
    does the same for one GPU): under autocast the output gradient's cast for down_proj is made first."""
    tape = LayerTape(ev, index, recompute=True)
    if w.mixed:
        tape.grad_cast = ev.alloc([r512(2 * w.batch * w.seq * spec.hidden_size)])[0]
    output = forward_layer(tape, spec, w, index, [])
    ev.free([output] if output is not None else [])
    return tape


def head_forward(ev: StageEvents, spec: ModelSpec, w: Workload, mb: MicroBatch, x: int,
                 autocast_cache: list[int]) -> None:
    """The final norm on the last layer's output `x`, the head (under autocast: the weight's and the input's casts;
    its exit drops `autocast_cache`; in pure precision the matmul keeps the norm's output), and the loss forward:
    `cross_entropy(logits.float(), labels)`."""
    T, h, V, e = w.batch * w.seq, spec.hidden_size, spec.vocab_size, DTYPE_BYTES[w.compute_dtype]
    mb.final = LayerTape(ev, spec.num_layers)
    hidden = norm_forward(mb.final, T, h, e, w.mixed, True, True, out_keep=not w.mixed)
    if mb.tapes and mb.tapes[-1] is None:  # a checkpointed last layer: the norm is what saves its output
        mb.final.saved["norm.input"] = x
    elif mb.tapes and not w.mixed:  # pure precision: the norm saves its own upcast; the output is let go of
        ev.free([x])
    casts = ev.alloc([r512(2 * V * h), r512(2 * T * h)]) if w.mixed else [None, None]
    logits = ev.alloc([r512(e * T * V)])[0]
    ev.free(([hidden] if w.mixed else []) + autocast_cache)
    mb.head = {"copy": casts[0], "cast": casts[1], "logits": logits, **ev.loss_forward(T, V)}


def head_backward(ev: StageEvents, spec: ModelSpec, w: Workload, mb: MicroBatch, grads: list[int]) -> int:
    """The loss's backward, the head's (under autocast bf16 matmuls, then fp32 casts of both gradients) and the
    final norm's; returns the last layer's output gradient."""
    T, h, V, e = w.batch * w.seq, spec.hidden_size, spec.vocab_size, DTYPE_BYTES[w.compute_dtype]
    saved = mb.head
    saved["ones"] = ev.alloc([512])[0]  # the loss's gradient
    upcast_grad = ev.loss_backward(saved, T, V)
    logits_grad = ev.alloc([r512(e * T * V)])
    ev.free([upcast_grad])
    weight_grad, input_grad = ev.alloc([r512(e * V * h), r512(e * T * h)])
    ev.free(logits_grad + [tensor for tensor in (saved["copy"], saved["cast"]) if tensor is not None])
    mb.final.release("norm.out")
    if w.mixed:
        grad = ev.alloc([r512(4 * T * h)])[0]
        ev.free([input_grad])
        grads += ev.alloc([r512(DTYPE_BYTES[w.weight_dtype] * V * h)])
        ev.free([weight_grad])
    else:
        grad = input_grad
        grads.append(weight_grad)
    ev.projection("lm_head", grad, backward=True)
    grad = norm_backward(mb.final, T, h, e, w.mixed, True, grad)
    grads += ev.alloc([r512(DTYPE_BYTES[w.weight_dtype] * h)])
    mb.final.release_all()
    return grad


def backward_microbatch(ev: StageEvents, spec: ModelSpec, w: Workload, place: StagePlace, mb: MicroBatch,
                        grad_buffer: int | None, accumulate: bool) -> tuple[int | None, list[int]]:
    """One micro-batch's backward through the stage (on the first stage the embedding's too). Returns a
    non-first stage's input gradient (the one sent back) and the weight gradients made; the stage's output
    (`mb.output`) is the caller's to free. `accumulate`: the step's gradients exist: these are added to them
    in place and freed at once."""
    start, grads = len(ev.events), []
    grad = head_backward(ev, spec, w, mb, grads) if place.last else grad_buffer
    for index in reversed(range(spec.num_layers)):
        tape = mb.tapes[index] or recompute_layer(ev, spec, w, index)
        grad = backward_layer(tape, spec, w, grads, grad)
        ev.free(mb.inputs[index - 1:index] if index and mb.inputs else [])  # its checkpoint lets go of the input
        if index == 0:
            ev.free(mb.rope)  # the first layer's RoPE backward is the last use of cos and sin
    if place.first:
        shard_bytes = r512(DTYPE_BYTES[w.weight_dtype] * spec.embedding_params)
        grads += ev.embedding_backward(grad, mb.stage_input, shard_bytes)
        grad = None
    ev.free([mb.head["ones"]] if place.last else [])  # the loss's gradient dies with autograd's backward
    if accumulate:
        free_at_once(ev, start, grads)
    return grad, grads


def free_at_once(ev: Events, start: int, ids: list[int]) -> None:
    """Each of `ids`, made since event `start`, freed right after it is made."""
    wanted = set(ids)
    tail = []
    for event in ev.events[start:]:
        tail.append(event)
        if event.action == "alloc" and event.addr in wanted:
            tail.append(AllocEvent("free", event.addr, 0))
    ev.events[start:] = tail


@dataclass(kw_only=True, slots=True)
class Buffers:
    """The stage's kept receive buffers, one per micro-batch (made on the first step)."""

    inputs: list[int] = field(default_factory=list)
    output_grads: list[int] = field(default_factory=list)


def infer_shapes(ev: StageEvents, spec: ModelSpec, w: Workload, place: StagePlace) -> Buffers:
    """The first step's metadata inference (see the module) and the receive buffers it sizes."""
    buffers = Buffers()
    empty = [] if place.first else ev.alloc([hidden_bytes(spec, w)])
    mb = forward_microbatch(ev, spec, w, place, empty[0] if empty else None)
    if not place.first:
        buffers.inputs = ev.keep([hidden_bytes(spec, w)] * place.microbatches)
    if place.first and not place.last:
        ev.free(ev.alloc([hidden_bytes(spec, w)]))  # the ones of the output's gradient; no backward to ids
        for tape in reversed(mb.tapes):
            if tape is not None:
                tape.release_all()
        ev.free(mb.rope + mb.inputs + [tensor for tensor in (mb.stage_input, mb.output) if tensor is not None])
    else:
        ones = [] if place.last else ev.alloc([hidden_bytes(spec, w)])
        sent, _grads = backward_microbatch(ev, spec, w, place, mb, ones[0] if ones else None, accumulate=True)
        # The ones (a middle stage's output gradient) died in the backward; the rest is dropped now.
        ev.free([sent] + empty + [mb.head.get(name) for name in ("logits", "loss") if mb.head]
                + ([mb.output] if mb.output is not None else []))
    if not place.last:
        buffers.output_grads = ev.keep([hidden_bytes(spec, w)] * place.microbatches)
    return buffers


def send_releases(place: StagePlace) -> dict[tuple[str, int], list[tuple[str, int]]]:
    """After which action the stage lets go of each micro-batch's output ("output", a non-last stage's, sent
    forward) and of its input's gradient ("grad", a non-first stage's, sent back): a sent tensor lives while
    the schedule's ops or work name it (a gloo work holds its tensor, as the CPU run shows; a NCCL work is
    taken to as well), an output also until its backward (`fwd_cache`). `Schedule1F1B._step_microbatches`
    replaces `fwd_sends` at the next forward and `bwd_sends` after the next backward; the warm-up's last fired
    `send_work` (output p - s - 2) lives until the steady state ends; what is named last lives until the step's
    micro-batches are done. GPipe keeps every send's work until then (`fwd_sends_to_wait`, `bwd_sends_to_wait`)."""
    order = action_order(place)
    M, end = place.microbatches, order[-1]
    gpipe = place.schedule == "gpipe" or M < place.stages
    warmup = min(M, place.stages - place.stage)
    releases: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for index in range(M):
        if not place.last:
            if gpipe or index == M - 1:
                sent = end
            elif index == warmup - 2:  # the warm-up's last fired `send_work`, replaced once the steady state ends
                sent = ("B", M - warmup)
            else:  # `fwd_sends` replaced at the next forward, before this micro-batch's backward
                sent = ("B", index)
            releases.setdefault(max(("B", index), sent, key=order.index), []).append(("output", index))
        if not place.first:
            releases.setdefault(end if gpipe or index == M - 1 else ("B", index + 1), []).append(("grad", index))
    return releases


def run_schedule(ev: StageEvents, spec: ModelSpec, w: Workload, place: StagePlace,
                 buffers: Buffers) -> tuple[list[int], list[int], list[int]]:
    """One schedule step over the micro-batches. Returns what the stage keeps until the next step (the last
    stage's logits), the step's gradients, and the losses."""
    forwards: dict[int, MicroBatch] = {}
    sent: dict[tuple[str, int], int] = {}
    releases = send_releases(place)
    grads: list[int] = []
    kept: list[int] = []
    losses: list[int] = []
    for action, index in action_order(place):
        if action == "F":
            forwards[index] = forward_microbatch(ev, spec, w, place,
                                                 None if place.first else buffers.inputs[index])
            if not place.last:
                sent["output", index] = forwards[index].output
        else:
            mb = forwards.pop(index)
            grad_buffer = None if place.last else buffers.output_grads[index]
            grad, made = backward_microbatch(ev, spec, w, place, mb, grad_buffer, accumulate=bool(grads))
            grads = grads or made
            if grad is not None:
                sent["grad", index] = grad
            if place.last:
                kept.append(mb.head["logits"])
                losses.append(mb.head["loss"])
        ev.free([sent.pop(tensor) for tensor in releases.get((action, index), [])])
    return kept, grads, losses


def stage_slice(items: list[int], place: StagePlace) -> list[int]:
    """A whole-model list [embedding, layers..., final norm, head] cut to what the stage holds."""
    return items[:1] * place.first + items[1:-2] + items[-2:] * place.last


def stage_schedule(spec: ModelSpec, w: Workload, place: StagePlace, ev: StageEvents | None = None
                   ) -> list[AllocEvent]:
    """Two training steps of one stage (see the module): `spec` is the stage's share (its layers; embedding
    and head are taken as `place` says); `ev`: a tensor-parallel rank's events (`TpStageEvents`)."""
    ev = ev or StageEvents()
    ev.alloc(stage_slice(weight_tensor_sizes(spec, w), place) + [rope_buffer_bytes(spec) // 2] * 2
             + list(ev.held_bytes))
    grad_sizes = stage_slice(trainable_tensor_sizes(spec, w), place)
    state = optimizer_state_tensors(w, stage_slice(trainable_numels(spec, w), place), grad_sizes)
    tokens = place.microbatches * w.batch * w.seq
    kept: list[int] = []
    buffers = None
    for step in range(2):
        ids = ev.alloc([r512(8 * tokens)] + ([r512(8 * (tokens + place.microbatches * w.batch))] if place.last
                                              else []))
        buffers = buffers or infer_shapes(ev, spec, w, place)
        ev.free(kept)  # clear_runtime_states: the last step's outputs
        kept, grads, losses = run_schedule(ev, spec, w, place, buffers)
        if place.last:  # `step()` returns the micro-batches' logits concatenated (`merge_chunks`); dropped
            ev.free(ev.alloc([r512(2 * place.microbatches * w.batch * w.seq * spec.vocab_size)]))
        ev.alloc(state if step == 0 else [])
        temporaries = ev.alloc(grad_sizes) if has_step_temporaries(w) else []
        ev.free(temporaries + grads)
        ev.free(losses + ids)
    return ev.events


PIPELINE_OPTIMIZERS = ("adamw", "adamw-fused", "sgd")
MICROBATCHES_PER_STAGE = 2
"""Stage schedules are replayed up to this many micro-batches per stage (M <= 2p); beyond, the first stage's
share replays as one GPU, which errs on the large side. A stage's replay grows with its layers x micro-batches
(ceil(L / p) x M layer passes a step, each probe and each sized stage searched on the smallest card): at 2 per
stage that is about twice the whole model's one-GPU schedule. Measured on 2 CPU cores shared with other work
(`estimate_report` from a fresh process, the figures of `llamem estimate MODEL --task train --batch 1 --seq 4096
--grad-accum M --precision bf16-mixed --optimizer adamw --gpus P --pp P`; the lower end when the cores were
quiet, the CLI adds about 0.4 s):

    llama-3.1-8b, pp 2    M=2: 1.2-1.9 s   M=4: 2.8-4.5 s   M=8: 4.2-5.6 s   M=16: 7.7-9.5 s   one GPU: 0.65 s
    llama-2-70b,  pp 8    M=8: 3.2-3.5 s   M=16: 7.7-8.4 s  M=32: 15.3 s                      one GPU: 3.9 s
    the one-GPU replay of the first stage's share instead: 0.2-0.4 s at any M

so 4 per stage would cost 15 s for a 70B; 2 keeps an estimate within about twice its one-GPU time. What the
fallback costs in accuracy (peak reserved): 8B pp 2, M=4 108.51 GiB against the stage schedules' 107.56, M=8
108.76 against 107.84, M=16 109.78 against 109.11; 70B pp 8, M=16 428.07 against 416.03. `llamem plan` never
replays a stage schedule in `benchmarks/plan_speed.py` (its pipeline layouts are tp x8, pp and pure bf16:
`stage_step_held` takes pure bf16 on one GPU per stage only), nor in the 8B autocast plans tried on 2-8 GPUs
(none confirms a pipeline layout), so the planner's speed does not depend on this limit."""


def pipeline_schedulable(spec: ModelSpec, w: Workload, layout) -> bool:
    """Whether a stage of `layout` has its own schedule here: what the pipeline bundle runs (a dense Llama with
    untied embeddings, one stage per GPU or per tensor-parallel group, the whole loss) and the layer schedule
    covers (SDPA, no biases, no padding, compile, fused kernels or offload; precision and checkpointing as
    `stage_step_held` says)."""
    plain_model = (spec.model_type == "llama" and not spec.tie_word_embeddings and not spec.is_moe
                   and not spec.sliding_window and spec.qk_norm == "none"
                   and not (spec.attention_bias or spec.mlp_bias or spec.qkv_bias))
    plain_layout = layout.dp == 1 and layout.ep == 1 and layout.sharding == "none" and layout.offload == "none"
    plain_step = (w.task == "train" and w.quant == "none" and w.optimizer in PIPELINE_OPTIMIZERS
                  and not (w.optimizer_in_backward or w.liger or w.offload_activations or w.compile
                           or w.padding_free)
                  and w.attn == "sdpa" and w.padding == "none" and w.loss == "full")
    return plain_model and plain_layout and plain_step and stage_step_held(w, layout) and pipeline_affordable(layout)


def stage_step_held(w: Workload, layout) -> bool:
    """Whether a run holds the stage schedule to the workload's precision and checkpointing: bf16 or fp16
    autocast without checkpointing, or with every layer's in full (what the bundle applies, `every_n_layers`
    counting the model's layers where a stage counts its own) on one GPU per stage; pure bf16 without it on one
    GPU per stage (tests/test_pipeline_stage_schedules_more.py holds both to 2-stage runs)."""
    one_gpu_per_stage = layout.tp == 1
    if w.ac_every:
        return w.mixed and w.ac_every == 1 and not w.selective_ac and one_gpu_per_stage
    return w.mixed or (w.precision == "bf16" and one_gpu_per_stage)


def pipeline_affordable(layout) -> bool:
    """Whether the stage schedules are replayed at this many micro-batches (`MICROBATCHES_PER_STAGE`)."""
    return layout.microbatches <= MICROBATCHES_PER_STAGE * layout.pp


def pipeline_stage_schedule(spec: ModelSpec, w: Workload, layout, stage: int) -> list[AllocEvent]:
    """Stage `stage` of `layout` (`spec`: the first stage's share, ceil(L / p) layers, which every stage is
    given: a stage with one layer fewer holds less of the same; under tensor parallel a rank's shard of it,
    `llamem.analytic.schedule_pipeline_tp`)."""
    place = StagePlace(stage=stage, stages=layout.pp, microbatches=layout.microbatches,
                       schedule=layout.pipeline_schedule)
    if layout.tp == 1:
        return stage_schedule(spec, w, place)
    from llamem.analytic.schedule_pipeline_tp import tp_stage_events  # it builds on this module

    return stage_schedule(spec, w, place, tp_stage_events(spec, w, layout))
