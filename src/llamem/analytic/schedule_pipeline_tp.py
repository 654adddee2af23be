"""A tensor-parallel rank's pipeline stage: the launch bundle's "tp+pp" (torchtitan's 2-D layout).

Each rank runs its stage's schedule (`llamem.analytic.schedule_pipeline`) on its tensor-parallel shards
(`llamem.parallel.shard_spec`), with tensor parallel's collectives as a TP rank runs them
(`schedule_ranks.TpEvents`): the functional all-reduce's new tensor in place of each row-parallel output (o_proj,
down_proj, the vocabulary-split embedding) and each column-parallel input gradient (q, k, v, gate, up, the head),
and DTensor's embedding gradient for the whole vocabulary on the first stage. The pipeline sends and receives the
replicated hidden states, whole on every rank of the stage.

The last stage's loss is torch's `loss_parallel` on the head's vocabulary shards (the bundle runs the schedule
under it), the handlers' tensors as `llamem.analytic.loss_parallel` lists them: forward, beside the fp32 upcast,
the labels' copy, the all-reduced max, `shifted`, `exp` (freed once summed), the sum and its log, then the result
(the saved log-softmax); backward, the fused handler's T-vectors, `grad_input = zeros_like(x)`, `exp(x)` and the
sum, then the product (the upcast's gradient).

On the bundle's 4-rank CPU run (tp 2 x pp 2, 2 micro-batches) each rank's recorded events reserve what its stage's
schedule reserves and peak at the same bytes (tests/test_pipeline_stage_schedules_more.py).
"""

from __future__ import annotations

from llamem.analytic.common import r512
from llamem.analytic.loss_parallel import SCALAR_BYTES
from llamem.analytic.schedule_pipeline import StageEvents
from llamem.analytic.schedule_ranks import TpEvents
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import Workload


class TpStageEvents(StageEvents, TpEvents):
    """A stage's events on a tensor-parallel rank (see the module)."""

    held_bytes = (512, 512)
    """PipelineStage's small tensor and the device mesh's rank list."""

    def __init__(self, whole_embedding_bytes: int) -> None:
        """`whole_embedding_bytes`: the whole vocabulary's embedding gradient."""
        super().__init__([], 1, whole_embedding_bytes)

    def projection(self, name: str, tensor: int, backward: bool = False) -> None:
        StageEvents.projection(self, name, tensor, backward)
        TpEvents.projection(self, name, tensor, backward)

    def embedding_backward(self, grad: int, stage_input: int | None, shard_bytes: int) -> list[int]:
        """The embedding output is let go of first (the first layer's input norm was its last user); DTensor's
        backward takes a copy of the incoming gradient and makes the whole vocabulary's gradient from it."""
        self.free([stage_input] if stage_input is not None else [])
        copy = self.alloc([self.sizes[grad]])
        self.free([grad])
        made = self.alloc([self.whole_embedding_bytes])
        self.free(copy)
        return made

    def loss_forward(self, T: int, V: int) -> dict[str, int]:
        """`_log_softmax`'s handler on the upcast (T x V/tp), then nll_loss's."""
        fp32_tv, fp32_t = r512(4 * T * V), r512(4 * T)
        upcast, labels, maximum, shifted, exp = self.alloc([fp32_tv, r512(8 * T), fp32_t, fp32_tv, fp32_tv])
        self.free([exp])
        total, log, log_softmax = self.alloc([fp32_t, fp32_t, fp32_tv])
        self.free([shifted, maximum, total, log])
        loss, total_weight = self.alloc([SCALAR_BYTES, SCALAR_BYTES])
        self.free([upcast])
        return {"labels": labels, "log_softmax": log_softmax, "loss": loss, "total_weight": total_weight}

    def loss_backward(self, saved: dict[str, int], T: int, V: int) -> int:
        """`_nll_loss_and_log_softmax_backward`: its T-vectors (the safe and masked targets, the mask,
        `grad_update`, the `arange`, the masked grad_output), `grad_input`, `exp(x)` and the sum, the product."""
        fp32_tv, fp32_t, int64_t = r512(4 * T * V), r512(4 * T), r512(8 * T)
        held = self.alloc([int64_t, r512(T), int64_t, fp32_t, int64_t, fp32_t])
        grad_input, exp, total = self.alloc([fp32_tv] * 3)
        self.free([exp])
        product = self.alloc([fp32_tv])[0]
        self.free([total, grad_input, *held])
        self.free([saved["labels"], saved["total_weight"], saved["log_softmax"]])
        return product


def tp_stage_events(spec: ModelSpec, w: Workload, layout) -> TpStageEvents:
    """A stage's events on a rank of `layout`'s tensor-parallel groups (`spec`: the rank's shard, vocabulary
    V/tp; DTensor's embedding gradient is the whole vocabulary's, V rounded up to a multiple of tp)."""
    whole = r512(DTYPE_BYTES[w.weight_dtype] * spec.vocab_size * layout.tp * spec.hidden_size)
    return TpStageEvents(whole)
