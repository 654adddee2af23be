"""The batch a training step feeds the model: plain, padded with an attention mask, or packed.

- plain: `input_ids` (batch, seq), the labels the same tensor;
- `--padding longest` (DataCollatorWithPadding): an int64 `attention_mask` (batch, seq) too, from which
  transformers builds its masks (`masking_utils.py`: the mask values are never read on fake tensors, so
  SDPA always gets the materialised mask a batch with padding gets);
- `--padding-free` (DataCollatorWithFlattening): one row of batch x seq tokens and int64 `position_ids`
  restarting at each of the `batch` sequences, no mask.

flash_attention_2 is the emulation of `llamem.trace.flash`, told on the config what fake values cannot
tell it: how many tokens are real, how many sequences are packed.
"""

from __future__ import annotations

import contextlib

import torch

from llamem.analytic.attention_paths import real_tokens
from llamem.model import ModelSpec
from llamem.workload import Workload


def configure(config, workload: Workload) -> None:
    """Point the config's attention at the emulated flash-attn when asked for."""
    if workload.attn != "flash_attention_2":
        return
    from llamem.trace import flash

    config._attn_implementation = flash.register()
    setattr(config, flash.REAL_TOKENS, real_tokens(workload))
    setattr(config, flash.PACKED_FLAG, workload.batch if workload.padding_free else 0)


def batch_inputs(workload: Workload, spec: ModelSpec, tracer, device: str = "cpu") -> dict:
    """The model's keyword inputs for one micro-batch, labelled as inputs."""
    tracer.category = "inputs"
    rows, cols = (1, workload.batch * workload.seq) if workload.padding_free else (workload.batch, workload.seq)
    batch = {"input_ids": torch.randint(0, spec.vocab_size, (rows, cols), device=device)}
    if workload.padding == "longest":
        mask = torch.ones((rows, cols), dtype=torch.int64, device=device)
        # real padding for a run on a device (on fake tensors the values are never read): the last rows'
        # trailing positions, at least one
        mask.view(-1)[-max(1, rows * cols - real_tokens(workload)):] = 0
        batch["attention_mask"] = mask
    if workload.padding_free:
        batch["position_ids"] = torch.arange(workload.seq, device=device).repeat(workload.batch).unsqueeze(0)
    for tensor in batch.values():
        tracer.label(tensor, "inputs")
    return batch


@contextlib.contextmanager
def real_packing_check(workload: Workload):
    """transformers looks for packed sequences in the position ids when there is no cache (checkpointing
    turns it off) and, finding none, lets SDPA run causal without a mask. On fake tensors it cannot read
    them (`is_tracing`) and always keeps the packed-sequence mask: SDPA would get a materialised mask, K
    and V repeated to every head, that a real step never builds. Answer as a real step does: packed only
    for a padding-free batch of several sequences. A compiled model keeps the mask (dynamo cannot read
    the values either)."""
    if workload.compile:
        yield
        return
    from transformers import masking_utils

    original = masking_utils.find_packed_sequence_indices
    packed = workload.padding_free and workload.batch > 1

    def find_packed_sequence_indices(position_ids):
        found = original(position_ids)
        if found is None or packed:
            return found
        (found[:, -1] == 0).all()  # the check's temporaries, as a real step makes them
        return None

    masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    try:
        yield
    finally:
        masking_utils.find_packed_sequence_indices = original
