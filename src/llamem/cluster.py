"""Nodes: how many GPUs share a node, what links the nodes, and where each parallel group lands.

Placement follows Megatron-LM's default rank order (`megatron/core/parallel_state.py`,
`initialize_model_parallel(order="tp-cp-ep-dp-pp")`): tensor parallel ranks are adjacent, data
parallel ranks next, pipeline stages outermost. So a tensor-parallel group lives inside a node
(it talks every layer: a group larger than a node is refused), a data-parallel group spans
t·d consecutive ranks and leaves the node when t·d exceeds it, and pipeline stages, which only
pass one activation per micro-batch, are the first to cross nodes.

Across nodes each GPU is assumed to own one NIC (the DGX / HGX layout: 8 GPUs, 8 NICs): its
share of the network is one link's line rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from llamem.errors import UsageError
from llamem.units import GB

INFINIBAND_NDR_BYTES_PER_S = 50 * GB
"""400 Gb/s InfiniBand NDR (ConnectX-7), one NIC per GPU: 400/8 = 50 GB/s per GPU (DGX H100)."""
INFINIBAND_HDR_BYTES_PER_S = 25 * GB
"""200 Gb/s InfiniBand HDR (ConnectX-6), one NIC per GPU: 25 GB/s per GPU (DGX A100)."""
DEFAULT_INTER_NODE_BYTES_PER_S = INFINIBAND_NDR_BYTES_PER_S


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    gpus_per_node: int
    """GPUs in one node: groups up to this size talk over the node's own interconnect."""
    inter_node_bytes_per_s: float = DEFAULT_INTER_NODE_BYTES_PER_S
    """Bytes per second per GPU across nodes (its NIC's line rate)."""

    def __post_init__(self):
        if self.gpus_per_node < 1:
            raise UsageError(f"--gpus-per-node must be 1 or more, got {self.gpus_per_node}")
        if self.inter_node_bytes_per_s <= 0:
            raise UsageError("the inter-node bandwidth must be positive")

    def spans_nodes(self, consecutive_ranks: int) -> bool:
        """Whether a group whose ranks fill `consecutive_ranks` adjacent ranks leaves one node."""
        return consecutive_ranks > self.gpus_per_node


def placement_problems(*, tp: int, cluster: Cluster) -> list[str]:
    """Why a layout cannot be placed on these nodes (empty: it can)."""
    if tp > cluster.gpus_per_node:
        return [f"tensor parallel {tp} does not fit in a node of {cluster.gpus_per_node} GPUs (its all-reduces run "
                f"every layer, too often for the network between nodes): use --tp {cluster.gpus_per_node} or less"]
    return []


def resolve_gpus(*, gpus: int, gpus_given: bool, nodes: int | None, gpus_per_node: int | None,
                 default_per_node: int | None) -> tuple[int, int | None]:
    """(total GPUs, GPUs per node) from `--gpus`, `--nodes` and `--gpus-per-node`; None per node: all the
    GPUs in one node. `default_per_node` fills in `--gpus-per-node` for `--nodes` alone (a card's node)."""
    if nodes is None and gpus_per_node is None:
        return gpus, None
    if nodes is not None and nodes < 1:
        raise UsageError(f"--nodes must be 1 or more, got {nodes}")
    if gpus_per_node is not None and gpus_per_node < 1:
        raise UsageError(f"--gpus-per-node must be 1 or more, got {gpus_per_node}")
    if nodes is None:
        if gpus > gpus_per_node and gpus % gpus_per_node:
            raise UsageError(f"--gpus {gpus} does not fill whole nodes of --gpus-per-node {gpus_per_node}: "
                             f"give --gpus as a multiple of {gpus_per_node}")
        return gpus, gpus_per_node
    per_node = gpus_per_node or (gpus // nodes if gpus_given else default_per_node)
    if not per_node or (gpus_per_node is None and gpus_given and gpus % nodes):
        raise UsageError(f"--nodes {nodes} needs the node's size: add --gpus-per-node G")
    if gpus_given and gpus != nodes * per_node:
        raise UsageError(f"--gpus {gpus} disagrees with --nodes {nodes} x --gpus-per-node {per_node} = "
                         f"{nodes * per_node} GPUs: drop --gpus, or give --gpus {nodes * per_node}")
    return nodes * per_node, per_node
