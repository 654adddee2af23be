"""Relative step time: a roofline-style cost model to rank plans that fit.

Per step on the busiest GPU:
- compute: training 6·N·tokens (forward 2N, backward 4N; LoRA/QLoRA skip the frozen
  weights' gradients: 4N) plus attention 12·L·h·s per token (forward, backward); full
  activation checkpointing recomputes the forward (+2N, +1/3), every-K a 1/K share of it;
  selective checkpointing only the matmuls its policy does not keep (`recompute_flops_per_token`);
  divided by the cards' dense bf16 FLOP/s at 40 % utilisation (a typical MFU for LLaMA
  training with transformers); QLoRA's dequantization adds 25 % to the base matmuls, int8
  inference 15 %;
- inference: prefill like a forward; decode is memory-bound: weights (in their stored dtype or
  quantized format) plus the KV cache (in its dtype) read once per new token at the card's
  memory bandwidth;
- communication: data parallel all-reduce (DDP, ZeRO-1/2) moves 2·(n-1)/n of the gradients
  (bf16; for LoRA only the adapters' fp32 gradients),
  ZeRO-3/FSDP adds two all-gathers of the bf16 weights; tensor parallel moves four
  activations per layer (2·(t-1)/t each); a group inside a node runs at the node's interconnect
  (NVLink, else PCIe), a group that spans nodes at the network's rate per GPU (`Cluster`; by
  default the card's catalog node, `gpus_per_node`, linked by 400 Gb/s InfiniBand NDR, 50 GB/s per
  GPU). Ranks are placed as Megatron-LM places them (`llamem.cluster`): tensor parallel inside a
  node, data parallel next (a group of t·d consecutive ranks), pipeline stages across nodes; no
  overlap with compute is assumed;
- pipeline bubble (p-1)/(m+p-1) on compute;
- offload: gradients to and weights from the host over PCIe each step, and the CPU AdamW
  update at 10 GB/s of optimizer state.
Left out: kernel efficiency differences between shapes, overlap of communication and
compute, stragglers, data loading. The figure ranks plans; it is not a wall-clock promise.
"""

from __future__ import annotations

from llamem.analytic.selective import recompute_params_per_layer
from llamem.analytic.weights import lora_tensor_sizes
from llamem.cluster import INFINIBAND_NDR_BYTES_PER_S, Cluster
from llamem.dtypes import DTYPE_BYTES
from llamem.gpus import GPU
from llamem.model import ModelSpec
from llamem.parallel import Layout
from llamem.units import GB
from llamem.workload import Workload

MFU = 0.40
"""Model FLOP utilisation of LLaMA training with transformers: a typical figure, not a measurement."""
INTER_NODE_BANDWIDTH = INFINIBAND_NDR_BYTES_PER_S
"""Bytes per second per GPU across nodes unless a `Cluster` says otherwise: 400 Gb/s InfiniBand NDR."""
CPU_ADAM_BYTES_PER_S = 10 * GB
"""DeepSpeed's CPU Adam: optimizer state streamed at about 10 GB/s."""
QLORA_DEQUANT_COST = 0.25
"""QLoRA dequantizes every base weight for each matmul: assumed 25 % more compute."""
QUANTIZED_DECODE_COST = 0.15
"""Quantized weights dequantize during decode: assumed 15 % slower than their bytes alone."""


def default_cluster(gpu: GPU) -> Cluster:
    """Nodes of the card's catalog size (`gpu.gpus_per_node`) on InfiniBand NDR."""
    return Cluster(gpus_per_node=gpu.gpus_per_node, inter_node_bytes_per_s=INTER_NODE_BANDWIDTH)


def step_seconds(spec: ModelSpec, w: Workload, layout: Layout, gpu: GPU, *, cluster: Cluster | None = None) -> float:
    """Relative seconds per optimizer step (training) or per request (inference) on `cluster`'s nodes
    (default: `default_cluster(gpu)`)."""
    cluster = cluster or default_cluster(gpu)
    if not w.is_training:
        return _inference_seconds(spec, w, layout, gpu, cluster)
    # Under pipeline parallelism the accumulation steps are the pipeline's micro-batches.
    tokens = w.batch * w.seq * w.grad_accum * layout.dp
    N = spec.num_params
    backward = 2 if w.uses_adapters else 4
    flops = tokens * ((2 + backward) * N + 12 * spec.num_layers * spec.hidden_size * w.seq)
    if w.ac_every:
        flops += tokens * recompute_flops_per_token(spec, w)
    if w.task == "qlora":
        flops *= 1 + QLORA_DEQUANT_COST
    compute = flops / (gpu.bf16_flops * MFU * layout.num_gpus)
    if layout.pp > 1:
        m = max(layout.microbatches, 1)
        compute *= 1 + (layout.pp - 1) / (m + layout.pp - 1)
    return compute + communication_seconds(spec, w, layout, gpu, cluster) + _offload(spec, w, layout, gpu)


def recompute_flops_per_token(spec: ModelSpec, w: Workload) -> float:
    """Forward FLOPs run again in backward, per token: full checkpointing every K-th layer reruns
    1/K of the forward (2 N / K, as before); selective checkpointing reruns only the matmuls its
    policy does not keep (`llamem.analytic.selective`: k, o and up of a full fine-tune, about 37 %
    of a layer's weights), 2 FLOPs per weight, on the ceil(L / K) checkpointed layers. Attention and
    the elementwise ops are not counted (SDPA's output is kept; elementwise ops are memory-bound)."""
    if not w.ac_every:
        return 0.0
    if not w.selective_ac:
        return 2 * spec.num_params / w.ac_every
    checkpointed = -(-spec.num_layers // w.ac_every)
    return 2 * recompute_params_per_layer(spec, w) * checkpointed


def group_bandwidth(gpu: GPU, cluster: Cluster, consecutive_ranks: int) -> float:
    """Bytes per second per GPU of a collective whose group fills `consecutive_ranks` adjacent ranks: the
    slowest link it crosses (ring and tree all-reduces run at it)."""
    return cluster.inter_node_bytes_per_s if cluster.spans_nodes(consecutive_ranks) else gpu.interconnect_bandwidth


def communication_seconds(spec: ModelSpec, w: Workload, layout: Layout, gpu: GPU, cluster: Cluster) -> float:
    """Data-parallel gradient all-reduce (and ZeRO-3's all-gathers) plus tensor-parallel activation
    all-reduces of one step; pipeline sends are left out (one activation per micro-batch)."""
    seconds = 0.0
    n, t = layout.dp, layout.tp
    trainable = spec.num_params / (t * layout.pp)
    if n > 1:
        bw = group_bandwidth(gpu, cluster, n * t)  # t·n consecutive ranks: Megatron's tp-dp-pp order
        # LoRA all-reduces only the adapters' gradients (fp32, as peft keeps them).
        grad_bytes = sum(lora_tensor_sizes(spec, w)) / (t * layout.pp) if w.uses_adapters else 2 * trainable
        seconds += 2 * (n - 1) / n * grad_bytes / bw
        if layout.sharding == "zero3":
            seconds += 2 * (n - 1) / n * 2 * spec.num_params / (t * layout.pp) / bw
    if t > 1:
        activation = w.batch * w.seq * spec.hidden_size * 2
        per_layer = 4 * 2 * (t - 1) / t * activation
        seconds += spec.num_layers / layout.pp * per_layer * w.grad_accum / group_bandwidth(gpu, cluster, t)
    return seconds


def _offload(spec: ModelSpec, w: Workload, layout: Layout, gpu: GPU) -> float:
    if layout.offload == "none":
        return 0.0
    local = spec.num_params / (layout.tp * layout.pp * layout.dp)
    traffic = 2 * local + 2 * local  # bf16 gradients out, bf16 weights back
    if layout.offload == "optimizer+params":
        traffic += 2 * 2 * spec.num_params / (layout.tp * layout.pp)  # weights streamed in forward and backward
    return traffic / gpu.pcie_bandwidth + 16 * local / CPU_ADAM_BYTES_PER_S


def _inference_seconds(spec: ModelSpec, w: Workload, layout: Layout, gpu: GPU, cluster: Cluster) -> float:
    prefill = w.batch * w.seq * 2 * spec.num_params / (gpu.bf16_flops * MFU * layout.num_gpus)
    weight_dtype = w.quant if w.quant != "none" else w.weight_dtype
    weight_bytes = spec.num_params * DTYPE_BYTES[weight_dtype]
    kv = spec.kv_bytes_per_token(DTYPE_BYTES[w.kv_dtype]) * w.batch * (w.seq + w.new_tokens / 2)
    decode = w.new_tokens * (weight_bytes + kv) / (gpu.memory_bandwidth * layout.num_gpus)
    if w.quant != "none":
        decode *= 1 + QUANTIZED_DECODE_COST
    return prefill + decode + communication_seconds(spec, w, layout, gpu, cluster) * w.new_tokens
