"""Link primitives of the time model: how long one collective takes on a group of ranks.

Alpha-beta per link class: NVLink inside a node, the network across nodes, each at
LINK_EFFICIENCY of its bandwidth (what large NCCL ring collectives achieve), over ring volumes of
the payload tetrad.comm counts; an all-to-all across nodes by its direct sends (`all_to_all_time`).
"""

from __future__ import annotations

import math

from tetrad.config.sections import shard_ranks
from tetrad.plan.hardware import GPU, Cluster

LINK_EFFICIENCY = 0.8  # achieved share of a link's bandwidth by large ring collectives (NCCL bus bandwidth)
# Thread blocks a NCCL collective kernel holds, one streaming multiprocessor each, for as long as it
# runs: an FSDP-style all-gather beside a GEMM on an H100 launches 24 (Nsight Systems trace in
# "Compute-Communication Overlap Causes Severe GEMM Performance Degradation because of Tail
# Effect", forums.developer.nvidia.com/t/337991, 2025).
COLLECTIVE_CTAS = 24


def overlap_slowdown(comm: float, compute: float, gpu: GPU) -> float:
    """Seconds `compute` seconds of kernels take longer beside a collective running for `comm`
    seconds: its kernels hold their share of the GPU's multiprocessors while they run."""
    share = min(1.0, COLLECTIVE_CTAS / gpu.sms) if gpu.sms else 0.0
    return share * min(comm, compute)


def ring_time(op: str, nbytes: float, n: int, alpha: float, bw: float) -> float:
    """Ring-algorithm time of a collective whose counted payload is `nbytes` (tetrad.comm's
    convention), over `n` ranks with per-step latency `alpha` and bandwidth `bw` bytes/s."""
    if n <= 1 or nbytes == 0:
        return 0.0
    factor = {"all_reduce": 2 * (n - 1) / n, "all_gather": (n - 1) / n, "reduce_scatter": (n - 1) / n,
              "all_to_all": (n - 1) / n, "p2p": 1.0}[op]
    steps = {"all_reduce": 2 * (n - 1), "p2p": 1}.get(op, n - 1)
    return steps * alpha + factor * nbytes / bw


def group_link(cluster: Cluster, stride: int, size: int) -> tuple[float, float]:
    """(alpha seconds, bytes/s) of a group of `size` ranks `stride` apart in the global rank order.

    Inside one node it runs over NVLink. Across nodes NCCL builds one ring per network rail, so
    k members per node push k NICs' worth: the bandwidth is min(NVLink, k x NIC) per GPU.
    """
    g, per_node = cluster.gpu, cluster.gpus_per_node
    if stride * size <= per_node:
        return g.intra_alpha_s, g.intra_gbps * 1e9 * LINK_EFFICIENCY
    members = max(1, min(size, per_node // stride))
    return g.inter_alpha_s, min(g.intra_gbps, members * g.inter_gbps) * 1e9 * LINK_EFFICIENCY


def all_to_all_time(nbytes: float, n: int, cluster: Cluster, stride: int) -> float:
    """An all-to-all of `nbytes` (tetrad.comm's count: the input, the rank's own chunk included)
    over `n` ranks `stride` apart.

    Inside one node: the ring model over NVLink, (n-1)/n of the payload and n-1 latencies. Across
    nodes every rank sends 1/n of its payload straight to each other rank, not round a rail ring:
    the chunks for its k-1 node-mates (k = the group's members per node) go over NVLink while the
    n-k chunks for other nodes leave through the network, together, and a node's k GPUs have k
    NICs between them, so per GPU one NIC's bandwidth (`GPU.inter_gbps`), however NCCL's PXN routes
    a chunk to its rail (NVIDIA, "Doubling all2all performance with NCCL 2.12", 2022). The time is
    the slower of the two shares, max((k-1)/n x nbytes / NVLink, (n-k)/n x nbytes / NIC). DeepEP
    measured its internode dispatch and combine at 43-58 GB/s per H800 with one 400 Gb/s CX7 NIC
    (~50 GB/s) each, ep 16 to 64, against 153-158 GB/s over NVLink at ep 8 (github.com/deepseek-ai/
    DeepEP, docs/legacy.md, "Normal kernels"): one NIC's bandwidth, at about LINK_EFFICIENCY.
    Latency: NCCL posts the n-1 sends at once, so one network latency plus n-1 per-peer setups at
    the NVLink step's latency (alpha inter + (n-1) alpha intra).
    """
    g, per_node = cluster.gpu, cluster.gpus_per_node
    if n <= 1 or nbytes == 0:
        return 0.0
    if stride * n <= per_node:
        return ring_time("all_to_all", nbytes, n, g.intra_alpha_s, g.intra_gbps * 1e9 * LINK_EFFICIENCY)
    members = max(1, per_node // stride)  # on a node (the group spans nodes: n x stride > per_node)
    on_node = (members - 1) / n * nbytes / (g.intra_gbps * 1e9 * LINK_EFFICIENCY)
    off_node = (n - members) / n * nbytes / (g.inter_gbps * 1e9 * LINK_EFFICIENCY)
    return g.inter_alpha_s + (n - 1) * g.intra_alpha_s + max(on_node, off_node)


def expert_grad_stride(per_node: int, tp: int, cp: int, dp: int, ep: int) -> int:
    """The stride of the evenly strided group `group_link` and `reduction_time` cost like the expert
    gradient group (ep > 1: the dp·cp/ep ranks with the same dp coordinate modulo ep, over every cp;
    ranks tp fastest, then cp, then dp): its cp ranks are neighbours tp apart and its dp ranks ep
    blocks of cp·tp apart, so on each node it has as many members, and spans as many nodes. At ep = 1
    it is the dp x cp group itself (stride tp)."""
    span = tp * cp * (dp if dp > ep else 1)
    if span <= per_node:
        return tp
    members = max(per_node // (tp * ep), min(cp, per_node // tp), 1)
    return per_node // members


def expert_shard_stride(per_node: int, parallel) -> int:
    """`expert_grad_stride` of the group the experts' buckets are sharded over (moe.expert_shard_ranks):
    the expert gradient group, or under hybrid ZeRO its share of a block of zero_shard dp x cp
    ranks, as the expert gradient group of the block's zero_shard/cp dp ranks."""
    return expert_grad_stride(per_node, parallel.tp, parallel.cp, shard_ranks(parallel) // parallel.cp, parallel.ep)


def reduction_time(op: str, nbytes: float, n: int, cluster: Cluster, stride: int) -> float:
    """A data-parallel reduction (`op`: all_reduce or reduce_scatter) of `nbytes` over `n` ranks
    `stride` apart.

    An all-reduce across nodes takes NCCL's ring or its double binary tree, whichever is faster
    (NCCL's own choice; Jeaugey, "Massively scale your deep learning training with NCCL 2.4",
    NVIDIA 2019): the tree's latency grows with log2(nodes), the ring's with n, which at
    thousands of ranks decides all but the largest messages. Reduce-scatter has only the ring.
    """
    alpha, bw = group_link(cluster, stride, n)
    ring = ring_time(op, nbytes, n, alpha, bw)
    nodes = math.ceil(n * stride / cluster.gpus_per_node)
    if op == "all_reduce" and nodes > 1:
        per_node = max(1, n // nodes)
        g = cluster.gpu
        tree = 2 * (math.ceil(math.log2(nodes)) * g.inter_alpha_s + (per_node - 1) * g.intra_alpha_s)
        return min(ring, tree + 2 * nbytes / bw)
    return ring


def hybrid_reduction_time(nbytes: float, shard: int, stride: int, replicas: int, replica_stride: int,
                          cluster: Cluster, summed: float | None = None) -> float:
    """Hybrid ZeRO's reduction of `nbytes` of gradient sharded over `shard` ranks `stride` apart
    (parallel.zero_shard's block, or the experts' share of it): a reduce-scatter inside the block
    (one node's links where the block fits one), then an all-reduce of its 1/shard over the
    `replicas`, `replica_stride` apart (the block's span: across nodes), of `summed` bytes for the
    whole gradient (ZeRO 2/3: the accumulated fp32 shard, whatever the codec sent inside the
    block; else `nbytes`)."""
    summed = nbytes if summed is None else summed
    across = reduction_time("all_reduce", summed / shard, replicas, cluster, replica_stride) if replicas > 1 else 0.0
    return reduction_time("reduce_scatter", nbytes, shard, cluster, stride) + across
