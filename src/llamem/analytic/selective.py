"""Selective activation checkpointing: what torchtitan's per-op policy keeps of a checkpointed layer.

`--ac selective` (every layer) and `--ac selective-every-K` (layers 0, K, 2K, ...; the others are
not checkpointed and keep their whole saved set) wrap each checkpointed decoder layer in
`torch.utils.checkpoint.checkpoint(..., use_reentrant=False, early_stop=False,
context_fn=create_selective_checkpoint_contexts(policy))` with torchtitan's `SelectiveAC` policy
(`torchtitan/distributed/activation_checkpoint.py`, commit b5bcd76c, 2026-08-21):

- the outputs of the compute-intensive ops are kept (torch's partitioner list: mm, bmm, addmm, the
  SDPA kernels; torchtitan adds aten.linear, aten.max, topk, the other SDPA kernels); every other
  op is recomputed in backward;
- every second matmul of a layer (its 2nd, 4th, ... `mm` in forward order) is recomputed as well.

In a Llama layer the matmuls run q, k, v, o, gate, up, down; a LoRA-adapted linear adds its
adapter's two (base, lora_A, lora_B), which shifts which ones fall on an even count; a biased
projection (Qwen2's q, k, v) runs `addmm`, kept and not counted. So a checkpointed layer keeps,
besides its input: the odd-numbered matmul outputs (full fine-tuning: q, v, gate and down), SDPA's output and fp32 logsumexp (eager attention: both batched matmuls,
the scores b heads s^2 and the output). The policy's cache keeps these whether autograd needs
them or not, until the layer's backward recomputes it (then they are handed back, not copied:
the layer's backward moment is that of full checkpointing).

Recompute FLOPs (the cost model): the even-numbered matmuls, the elementwise ops (not counted,
as elsewhere in `llamem.cost`), no attention.

Source: torch 2.13 `torch/utils/checkpoint.py` (`_CachingTorchDispatchMode` stores every
MUST_SAVE output), held to the trace engine by tests/test_selective_ac.py.
"""

from __future__ import annotations

from llamem.analytic.common import r512
from llamem.dtypes import DTYPE_BYTES
from llamem.model import ModelSpec
from llamem.workload import Workload

LINEAR_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections in the order a Llama layer's forward runs them."""


def layer_matmuls(spec: ModelSpec, w: Workload) -> list[tuple[str, int, int]]:
    """(name, fan_in, fan_out) of a layer's matmuls in forward order, adapters included."""
    shapes = spec.layer_linear_shapes()
    adapted = set(w.lora_targets) if w.uses_adapters else set()
    out = []
    for name in LINEAR_ORDER:
        fan_in, fan_out = shapes[name]
        out.append((name, fan_in, fan_out))
        if name in adapted:
            out += [(f"{name}.lora_A", fan_in, w.lora_rank), (f"{name}.lora_B", w.lora_rank, fan_out)]
    return out


def _has_bias(spec: ModelSpec, w: Workload, name: str) -> bool:
    """A biased projection runs as `addmm` (kept, and not counted among the matmuls whose every
    second one is recomputed); quantized ones (bitsandbytes' own matmul) and adapters run `mm`."""
    if w.quant != "none" or ".lora_" in name:
        return False
    if name in ("gate_proj", "up_proj", "down_proj"):
        return spec.mlp_bias
    return spec.attention_bias or (spec.qkv_bias and name != "o_proj")


def _policy_split(spec: ModelSpec, w: Workload) -> tuple[list[tuple[str, int, int]], list[tuple[str, int, int]]]:
    """(kept, recomputed) matmuls: every `addmm`, and of the plain `mm`s the 1st, 3rd, 5th, ... are
    kept; the 2nd, 4th, ... recomputed."""
    kept, recomputed, count = [], [], 0
    for matmul in layer_matmuls(spec, w):
        if _has_bias(spec, w, matmul[0]):
            kept.append(matmul)
            continue
        count += 1
        (recomputed if count % 2 == 0 else kept).append(matmul)
    return kept, recomputed


def saved_matmuls(spec: ModelSpec, w: Workload) -> list[tuple[str, int, int]]:
    """The matmuls whose outputs the policy keeps, in forward order."""
    return _policy_split(spec, w)[0]


def recomputed_matmuls(spec: ModelSpec, w: Workload) -> list[tuple[str, int, int]]:
    """The matmuls the policy recomputes in backward: the 2nd, 4th, 6th, ... plain `mm`."""
    return _policy_split(spec, w)[1]


def _matmul_out_bytes(w: Workload, name: str) -> int:
    """Output element size of one matmul: bf16 under autocast; adapters compute in fp32 (peft
    keeps them in fp32 and casts the input); the base in the compute dtype."""
    if w.mixed:
        return 2
    return 4 if ".lora_" in name else int(DTYPE_BYTES[w.compute_dtype])


def attention_kept_sizes(spec: ModelSpec, w: Workload) -> list[int]:
    """SDPA's output (T q) and fp32 logsumexp (b heads s); eager attention's two batched matmuls
    (the scores b heads s^2 and the output T q), in the attention dtype."""
    b, s = w.batch, w.seq
    ae = 2 if w.mixed else int(DTYPE_BYTES[w.compute_dtype])
    if w.attn == "sdpa":
        return [r512(ae * b * s * spec.q_dim), r512(4 * b * spec.num_heads * s)]
    return [r512(ae * b * spec.num_heads * s * s), r512(ae * b * s * spec.q_dim)]


def selective_kept_sizes(spec: ModelSpec, w: Workload) -> list[int]:
    """The tensors one selectively checkpointed layer keeps beyond its input, in the order its forward
    makes them (none unless `--ac selective*`)."""
    if not w.selective_ac:
        return []
    T = w.batch * w.seq
    matmuls = [r512(_matmul_out_bytes(w, name) * T * fan_out) for name, _fan_in, fan_out in saved_matmuls(spec, w)]
    attention = attention_kept_sizes(spec, w)
    # q, k, v (and their adapters) run before attention, o and the MLP after it.
    before = sum(1 for name, _, _ in saved_matmuls(spec, w) if name.split(".")[0] in ("q_proj", "k_proj", "v_proj"))
    return matmuls[:before] + attention + matmuls[before:]


def kept_matmul_outputs(spec: ModelSpec, w: Workload) -> list[tuple[str, int]]:
    """(name, bytes) of each matmul output the policy keeps, in forward order."""
    T = w.batch * w.seq
    return [(name, r512(_matmul_out_bytes(w, name) * T * fan_out)) for name, _fan_in, fan_out in saved_matmuls(spec, w)]


def kept_outputs_of(spec: ModelSpec, w: Workload, names) -> int:
    """What the policy keeps of the matmuls `names` (0 unless `--ac selective*`)."""
    if not w.selective_ac:
        return 0
    return sum(size for name, size in kept_matmul_outputs(spec, w) if name in names)


def selective_kept_bytes(spec: ModelSpec, w: Workload) -> int:
    """What one selectively checkpointed layer keeps beyond its input (0 unless `--ac selective*`)."""
    return sum(selective_kept_sizes(spec, w))


def recompute_params_per_layer(spec: ModelSpec, w: Workload) -> int:
    """Weights whose matmuls a checkpointed layer runs again in backward: all of them under full
    checkpointing, the policy's even-numbered ones under selective checkpointing."""
    matmuls = recomputed_matmuls(spec, w) if w.selective_ac else layer_matmuls(spec, w)
    return sum(fan_in * fan_out for _name, fan_in, fan_out in matmuls)
