"""The loss on the head's vocabulary shards as torch's `loss_parallel` runs it: the launch bundles' loss
under torch's tensor parallel (TP alone, and the last stage of tp x pp), the head's output a DTensor split over
the vocabulary (`ColwiseParallel(output_layouts=Shard(-1))`).

Inside `loss_parallel()` cross-entropy's ops go to DTensor's own handlers (torch 2.13,
`torch/distributed/tensor/parallel/loss.py`), which run these local ops on a rank's T x V/tp shard (V here is
the rank's share, `llamem.parallel.tensor_shard`):

- forward, `_log_softmax`: the fp32 input x (the bundle's `.float()` upcast, or the fp32 logits themselves;
  the 16-bit logits die at the upcast unless the pipeline stage keeps its output), `shifted = x - x_max`,
  `exp(shifted)` (freed once summed), then `result = shifted - log(sumexp)` beside `shifted`: three fp32
  T x V/tp at once, and three fp32 T-vectors (the all-reduced max and sum, the log). `_nll_loss_forward` adds
  T-vectors only. transformers' `ForCausalLMLoss` holds two (upcast and log_softmax output,
  `llamem.analytic.logits`).
- backward, `_nll_loss_and_log_softmax_backward` (nll_loss's and log_softmax's backward fused;
  `_log_softmax_backward_handler` only hands the gradient on): beside the saved log_softmax output,
  `grad_input = zeros_like(x)`, then `(grad_input + exp(x)) * grad_output`: `exp(x)` and the sum are alive
  together, then the sum and the product: three fp32 T x V/tp at once, where transformers' native backward
  holds two (nll_loss's and log_softmax's gradients); and T-vectors: the target made safe, the shard's mask
  (bool) and masked target, `grad_update` (fp32), the `arange`, the masked grad_output (fp32).

A TorchDispatchMode (`CpuMemoryTracker`) does not see these: it is off while an op it dispatched runs, and
DTensor runs the handlers inside the op's dispatch. It sees each handler's result only (one T x V/tp each), so a
CPU run of the bundles shows the loss one fp32 T x V/tp below transformers' and two below what torch holds;
`tests/test_tp_loss.py` traces the handlers' own ops on 2 gloo ranks and holds this module to them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llamem.allocator.replay import AllocEvent
from llamem.analytic import llama4
from llamem.analytic.activations import training_activations
from llamem.analytic.attention_paths import packed_shape
from llamem.analytic.common import r512
from llamem.analytic.logits import LogitsBytes, training_logits
from llamem.analytic.schedule import Events
from llamem.analytic.weights import autocast_copies_in_backward_bytes
from llamem.model import ModelSpec
from llamem.workload import Workload

if TYPE_CHECKING:
    from llamem.parallel import Layout

SCALAR_BYTES = 512
"""One scalar tensor: the loss, nll_loss's total weight, the loss's gradient (`ones_like`)."""


def loss_parallel_logits(local: ModelSpec, w: Workload, *, output_kept: bool = False) -> LogitsBytes:
    """The head's and the loss's buffers of a training step under `loss_parallel` (see the module), for the
    rank's share `local` (vocabulary V/tp). `output_kept`: the 16-bit logits stay alive through the loss (a
    pipeline stage keeps its output). The head's saved input is transformers' (`training_logits`).

    forward:  head input + kept + 3 x 4 T V + 3 fp32 T + labels, in log_softmax (the upcast's moment before it,
              the 16-bit logits beside their upcast, is smaller)
    backward: head input + 4 T V (saved) + 3 x 4 T V + the handler's T-vectors + labels + 3 scalars,
    with labels the flattened int64 copy nll_loss keeps (and on a pipeline stage its padded target). The
    16-bit logits are not counted in backward: transformers' model output is gone by then, and a pipeline
    stage's kept outputs are its own (`llamem.pipeline_stages`)."""
    tokens = w.batch * w.seq
    TV = tokens * local.vocab_size
    e_logits = 4 if w.compute_dtype == "fp32" else 2
    fp32_tv, fp32_t, int64_t = r512(4 * TV), r512(4 * tokens), r512(8 * tokens)
    head_input = training_logits(local, w).saved - fp32_tv  # transformers' saved: head input + log_softmax
    kept = r512(e_logits * TV) if output_kept and e_logits < 4 else 0
    # the flattened labels nll_loss keeps; a pipeline's padded target lives through the step
    labels = int64_t + (r512(8 * w.batch * (w.seq + 1)) if output_kept else 0)
    log_softmax = kept + 3 * fp32_tv + 3 * fp32_t + labels
    handler = 3 * int64_t + r512(tokens) + 2 * fp32_t
    backward = 4 * fp32_tv + handler + labels + 3 * SCALAR_BYTES
    return LogitsBytes(forward_peak=head_input + log_softmax, saved=head_input + fp32_tv,
                       backward_peak=head_input + backward)


def runs_loss_parallel(w: Workload, layout: Layout) -> bool:
    """Whether a rank's loss is torch's `loss_parallel` as the bundles run it: torch's tensor parallel (not
    Megatron-LM's own vocabulary-parallel cross-entropy, nor ZeRO beside it), the whole model trained with the
    loss in one piece, eagerly (no Liger, compile, activation offload or step in backward)."""
    return (layout.tp > 1 and layout.engine == "deepspeed" and layout.sharding in ("none", "ddp") and w.task == "train"
            and not w.uses_adapters and w.loss == "full" and not (w.liger or w.compile or w.offload_activations
                                                                  or w.optimizer_in_backward))


def size_loss_parallel(phases: dict[str, dict[str, int]], local: ModelSpec, w: Workload, *,
                       output_kept: bool = False) -> None:
    """Size the loss's moments of a rank's phases (the analytic engine's, sized with transformers' loss) as
    `loss_parallel` runs it, in place. The forward phase is the loss's forward moment (it holds "logits");
    the loss backward is the backward phase when it holds "logits", else it is rebuilt from the forward
    moment (`loss_backward_moment`) and the worse of the two is kept."""
    if "forward" not in phases or "logits" not in phases["forward"]:
        return  # no loss on this rank's share (or a moment of its own was worse: left as sized)
    packed = packed_shape(w)
    ours = loss_parallel_logits(local, packed, output_kept=output_kept)
    forward = phases["forward"]
    backward = phases["backward"] if "logits" in phases["backward"] else loss_backward_moment(forward, local, packed)
    phases["forward"] = {**forward, "logits": ours.forward_peak}
    loss_backward = {**backward, "logits": ours.backward_peak}
    if sum(loss_backward.values()) > sum(phases["backward"].values()):
        phases["backward"] = loss_backward


def loss_backward_moment(forward: dict[str, int], local: ModelSpec, w: Workload) -> dict[str, int]:
    """The analytic engine's loss backward moment from its forward moment: the same persistent state, the
    autocast copies and activations that survive into backward, transformers' loss backward."""
    copies = forward.get("weights/autocast_copies", 0)
    in_backward = (llama4.autocast_copies_in_backward_bytes if llama4.is_llama4(local)
                   else autocast_copies_in_backward_bytes)
    moment = {**forward, "weights/autocast_copies": in_backward(local, w, copies),
              "activations": training_activations(local, w).backward,
              "logits": training_logits(local, w).backward_peak}
    return {key: value for key, value in moment.items() if value}


class LossParallelEvents:
    """A tensor-parallel rank's schedule (`llamem.analytic.schedule_ranks`, kind "tp") with the loss as
    `loss_parallel` runs it in the TP bundle: the single-GPU schedule replays transformers' loss
    (`llamem.analytic.schedule`), and this rewrites its events where they differ, in the handlers' order.

    - forward (`forward_done`, at the end of the loss): the 16-bit logits die at their upcast; then the int64
      labels nll_loss keeps, `_log_softmax`'s all-reduced max, `shifted`, `exp` (freed once summed), the
      all-reduced sum, its log, the result (the log_softmax output the schedule made) and `shifted` freed with the
      T-vectors; the loss and its total weight; the upcast freed at the end.
    - backward (`gradient`, in place of the schedule's nll_loss and log_softmax gradients): the loss's gradient
      and the fused handler's T-vectors, `grad_input`, `exp(x)` and the sum, then `exp(x)` freed and the product
      made; the sum, the T-vectors, the labels and the scalars go as the handler returns. The schedule frees
      `grad_input` with the log_softmax output, and the product once its 16-bit cast exists, as torch does."""

    def __init__(self, local: ModelSpec, w: Workload) -> None:
        self.tokens, self.tokens_vocab = w.batch * w.seq, w.batch * w.seq * local.vocab_size
        self.upcast = w.compute_dtype != "fp32"  # the 16-bit logits have an fp32 upcast
        self.pending = 0
        """The schedule's loss gradients still to be replaced: 2 after the forward, then 1."""
        self.held: list[int] = []
        self.exp_and_sum: list[int] = []

    def forward_done(self, ev: Events) -> None:
        """Rebuild the schedule's last loss events (logits, upcast, log_softmax output; then the upcast and the
        logits freed) in loss_parallel's order, keeping their ids."""
        events = ev.events
        made = [i for i, event in enumerate(events) if event.action == "alloc"][-(3 if self.upcast else 2):]
        ids, sizes = [events[i].addr for i in made], [events[i].size for i in made]
        del events[made[0]:]
        events.append(AllocEvent("alloc", ids[0], sizes[0]))
        if self.upcast:  # the bundle's `.float()`: the 16-bit logits die with it
            events += [AllocEvent("alloc", ids[1], sizes[1]), AllocEvent("free", ids[0], 0)]
        fp32_tv, fp32_t = r512(4 * self.tokens_vocab), r512(4 * self.tokens)
        labels = ev.alloc([r512(8 * self.tokens)])
        maximum, shifted, exp, total = ev.alloc([fp32_t, fp32_tv, fp32_tv, fp32_t])
        ev.free([exp])
        log = ev.alloc([fp32_t])
        events.append(AllocEvent("alloc", ids[-1], sizes[-1]))
        ev.free([shifted, maximum, total, *log])
        self.held = labels + ev.alloc([SCALAR_BYTES, SCALAR_BYTES])  # the loss, its total weight
        ev.free([ids[-2]])  # the fp32 input, at the loss's return
        self.pending = 2

    def gradient(self, ev: Events, sizes: list[int]) -> list[int]:
        """The schedule's nll_loss gradient (`pending` 2) or log_softmax's (1), as the fused handler makes them."""
        step, self.pending = self.pending, 0
        fp32_tv, fp32_t, int64_t = r512(4 * self.tokens_vocab), r512(4 * self.tokens), r512(8 * self.tokens)
        if step == 2:  # the loss's gradient, the safe and masked targets, the mask, grad_update, arange, grad_output
            self.held += ev.alloc([SCALAR_BYTES, int64_t, r512(self.tokens), int64_t, fp32_t, int64_t, fp32_t])
            grad_input = ev.alloc(sizes)
            self.exp_and_sum = ev.alloc([fp32_tv, fp32_tv])
            self.pending = 1
            return grad_input
        ev.free(self.exp_and_sum[:1])
        product = ev.alloc(sizes)
        ev.free(self.exp_and_sum[1:] + self.held)
        return product
