"""Relative step time: a roofline-style cost model to rank plans that fit.

Per step on the busiest GPU:
- compute: training 6·N·tokens (forward 2N, backward 4N; LoRA/QLoRA skip the frozen
  weights' gradients: 4N) plus attention 12·L·h·s per token (forward, backward); full
  activation checkpointing recomputes the forward (+2N, +1/3), every-K a 1/K share of it;
  selective checkpointing only the matmuls its policy does not keep (`recompute_flops_per_token`);
  divided by the cards' dense bf16 FLOP/s at 40 % utilisation (a typical MFU for LLaMA
  training with transformers); QLoRA's dequantization adds 25 % to the base matmuls, int8
  inference 15 %;
- inference, the time of one request on one replica (data-parallel replicas serve their own
  requests side by side and exchange nothing): prefill like a forward; decode is memory-bound:
  weights (in their stored dtype or quantized format) plus the KV cache (in its dtype) read once
  per new token at the card's memory bandwidth. Tensor parallel t divides both over t GPUs;
  pipeline stages (a device_map) pass the one batch along, one stage busy at a time, so they
  divide neither. Tensor parallel all-reduces two activations per layer (after attention and
  after the MLP, forward only) of the tokens each forward processes: the prompt once in prefill
  (in chunks or not: the same tokens), then one token per sequence per decoded token;
- training communication: data parallel all-reduce (DDP, ZeRO-1/2) moves 2·(n-1)/n of the gradients
  (bf16; for LoRA only the adapters' fp32 gradients),
  ZeRO-3/FSDP adds two all-gathers of the bf16 weights; tensor parallel moves four
  activations per layer (2·(t-1)/t each); a group inside a node runs at the node's interconnect
  (NVLink, else PCIe), a group that spans nodes at the network's rate per GPU (`Cluster`; by
  default the card's catalog node, `gpus_per_node`, linked by 400 Gb/s InfiniBand NDR, 50 GB/s per
  GPU). Ranks are placed as Megatron-LM places them (`llamem.cluster`): tensor parallel inside a
  node, data parallel next (a group of t·d consecutive ranks), pipeline stages across nodes; no
  overlap with compute is assumed;
- mixtures of experts: a token multiplies by its k routed experts' weights only (`active_params`);
  expert parallelism adds per MoE layer two all-to-alls of the token-expert pairs per forward (four per
  training step), (ep-1)/ep of them leaving each GPU, and all-reduces the experts' gradients over the
  n/ep ranks that hold the same experts;
- pipeline bubble: (p-1)/(m+p-1) of the step idle, so compute stretched by (m+p-1)/m;
- offload: gradients to and weights from the host over PCIe each step, and the CPU AdamW
  update at 10 GB/s of optimizer state; activation offloading, each layer's input to the host
  and back over PCIe per micro-batch, not overlapped (`activation_offload_seconds`).
Left out: kernel efficiency differences between shapes, overlap of communication and
compute, stragglers, data loading; for inference the collectives' launch latency (decode's
all-reduces are small, so latency rather than bandwidth bounds them), the vocabulary gather of
the logits and the activations a device_map moves between stages. The figure ranks plans; it is not a wall-clock promise.
"""

from __future__ import annotations

from llamem.analytic.offload import offloaded_tensor_nbytes
from llamem.analytic.selective import recompute_params_per_layer
from llamem.analytic.weights import lora_tensor_sizes
from llamem.cluster import INFINIBAND_NDR_BYTES_PER_S, Cluster
from llamem.dtypes import DTYPE_BYTES
from llamem.expert_parallel import active_params, all_to_all_bytes, expert_params
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
    N = active_params(spec)
    backward = 2 if w.uses_adapters else 4
    flops = tokens * ((2 + backward) * N + 12 * spec.num_layers * spec.hidden_size * w.seq)
    if w.ac_every:
        flops += tokens * recompute_flops_per_token(spec, w)
    if w.task == "qlora":
        flops *= 1 + QLORA_DEQUANT_COST
    compute = flops / (gpu.bf16_flops * MFU * layout.num_gpus)
    if layout.pp > 1:
        # The step takes M + p - 1 micro-batch slots of which each stage computes in M: the bubble, (p - 1) /
        # (M + p - 1) of the step, stretches the ideal compute by (M + p - 1) / M (16 stages, 4 micro-batches:
        # x4.75, not the x1.79 of adding the bubble's fraction).
        m = max(layout.microbatches, 1)
        compute *= (m + layout.pp - 1) / m
    return (compute + communication_seconds(spec, w, layout, gpu, cluster) + _offload(spec, w, layout, gpu)
            + activation_offload_seconds(spec, w, layout, gpu))


def activation_offload_seconds(spec: ModelSpec, w: Workload, layout: Layout, gpu: GPU) -> float:
    """`--offload-activations`: each checkpointed layer's input crosses the host link twice per
    micro-batch (to pinned memory in forward, back in backward) at the card's PCIe rate; transformers
    runs both copies on the compute stream (`activation_checkpointing_enable`'s docstring), so nothing
    overlaps them. A pipeline stage moves its own layers' inputs."""
    if not w.offload_activations:
        return 0.0
    layers = spec.num_layers / layout.pp
    moved = 2 * layers * offloaded_tensor_nbytes(w, spec.hidden_size) * w.grad_accum
    return moved / gpu.pcie_bandwidth


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
    all-reduces of one step; pipeline sends are left out (one activation per micro-batch).
    Inference: `inference_communication_seconds`."""
    if not w.is_training:
        return inference_communication_seconds(spec, w, layout, gpu, cluster)
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
    return seconds + _expert_parallel_seconds(spec, w, layout, gpu, cluster)


def _expert_parallel_seconds(spec: ModelSpec, w: Workload, layout: Layout, gpu: GPU, cluster: Cluster) -> float:
    """Expert parallelism's all-to-alls (`llamem.expert_parallel`): forward and backward each dispatch and
    combine every micro-batch's token-expert pairs, inside a group of ep consecutive ranks; the experts'
    gradients are all-reduced over the n / ep ranks that hold the same experts instead of all n, a saving
    subtracted from the data-parallel term above (full fine-tuning)."""
    ep = layout.ep
    if ep == 1:
        return 0.0
    moved = 2 * all_to_all_bytes(spec, w, ep, w.batch * w.seq) * w.grad_accum / layout.pp
    seconds = moved / group_bandwidth(gpu, cluster, ep * layout.tp)
    if not w.uses_adapters:
        n, m = layout.dp, layout.dp // ep
        experts = 2 * expert_params(spec) / layout.pp
        seconds += (2 * (m - 1) / m * experts / ep - 2 * (n - 1) / n * experts) / group_bandwidth(
            gpu, cluster, n * layout.tp)
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
    """One replica's request: its tensor-parallel GPUs share the work, its stages take turns."""
    t = layout.tp
    prefill = w.batch * w.seq * 2 * active_params(spec) / (gpu.bf16_flops * MFU * t)
    weight_dtype = w.quant if w.quant != "none" else w.weight_dtype
    # Expert parallelism leaves 1/ep of the experts on each GPU: what its decode reads.
    resident = spec.num_params - expert_params(spec) * (layout.ep - 1) / layout.ep
    weight_bytes = resident * DTYPE_BYTES[weight_dtype]
    kv = spec.kv_bytes_per_token(DTYPE_BYTES[w.kv_dtype]) * w.batch * (w.seq + w.new_tokens / 2)
    decode = w.new_tokens * (weight_bytes + kv) / (gpu.memory_bandwidth * t)
    if w.quant != "none":
        decode *= 1 + QUANTIZED_DECODE_COST
    return prefill + decode + inference_communication_seconds(spec, w, layout, gpu, cluster)


def inference_communication_seconds(spec: ModelSpec, w: Workload, layout: Layout, gpu: GPU,
                                    cluster: Cluster) -> float:
    """Tensor parallel's all-reduces of one request: two per layer per forward (attention's and the MLP's
    row-parallel outputs; Megatron-LM, Shoeybi et al. 2019, section 3), each moving 2·(t-1)/t of
    tokens x hidden activations in the compute dtype. Prefill's forwards hold batch x seq tokens in
    all, decode's batch x new_tokens. Every layer of the model runs once per forward, whichever stage
    holds it. Data parallel replicas exchange nothing."""
    t = layout.tp
    ep_seconds = all_to_all_bytes(spec, w, layout.ep, w.batch * (w.seq + w.new_tokens)) / group_bandwidth(
        gpu, cluster, layout.ep)
    if t == 1:
        return ep_seconds
    tokens = w.batch * (w.seq + w.new_tokens)
    activation_bytes = tokens * spec.hidden_size * DTYPE_BYTES[w.compute_dtype]
    moved = spec.num_layers * 2 * 2 * (t - 1) / t * activation_bytes
    return moved / group_bandwidth(gpu, cluster, t) + ep_seconds
