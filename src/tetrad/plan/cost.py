"""The estimate of one layout: step time and its breakdown, memory per rank, MFU and HFU.

Per-stage costs from the layer's (layer.py) and the embedding's and head's (on the last stage
also the multi-token prediction modules': `_mtp_end_costs` and their layers); the pipeline's time,
bubble and in-flight activations from the schedule simulator (pipeline.py); data-parallel
gradient reduction and weight gathering over the links (links.py), exposed where neither the
last backward nor the pipeline's idle tail hides them; the optimizer as bytes / HBM bandwidth, or
under optimizer offload its copies over the host link and AdamW over the host's memory bandwidth;
memory from memory.py, the device's and the host's. Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from tetrad.config import Config
from tetrad.config.sections import bucket_bytes, shard_ranks, zero_shard
from tetrad.model import flops
from tetrad.parallel.pipeline.split import layer_split, rank_chunk_layers, rank_stages
from tetrad.plan.hardware import GPU, Cluster, HardwareError, offload_unknown
from tetrad.plan.ends import end_costs
from tetrad.plan.layer import LayerCost, gemm_efficiency, layer_cost
from tetrad.plan.links import (LINK_EFFICIENCY, expert_shard_stride, group_link, hybrid_reduction_time,
                               overlap_slowdown, reduction_time, ring_time)
from tetrad.plan.memory import (
    GIB,
    GPU_RESERVED_GIB,
    HostMemory,
    Memory,
    activation_bytes,
    as_run,
    host_memory_by_rank,
    memory_by_rank,
    rank_params,
    state_bytes_per_param,
)
from tetrad.plan.buckets import RankBuckets, rank_buckets
from tetrad.plan.comm_bytes import comm_bytes_per_step, gradient_reduce_bytes
from tetrad.plan.moe import expert_shard_ranks
from tetrad.plan.pipeline import pipeline
from tetrad.plan.stacks import Stack, load_stack

OPTIMIZER_BYTES_PER_PARAM = 36  # Adam + clipping: read/write weights, master, moments; read grads twice
# Optimizer offload (parallel/data/optimizer.py), per updated parameter, one step after another:
# the fp32 gradient down and the fp32 masters up over the host link (the cast to the model dtype
# runs on the device: torch's non-blocking copy_ converts after the transfer), at LINK_EFFICIENCY of
# the link's datasheet rate (assumed, as for NCCL's links; not measured); torch's fused CPU AdamW,
# reading weight, gradient and both moments and writing three: 28 bytes over the host's DRAM,
# which the node's ranks share. It streams like a triad (bench/bench_cpu_adam.py, 2-core CPU
# machine: 0.80-0.85 of a triad's bytes per second on one thread, 0.97-1.15 on two), and a triad
# commonly reaches 70-80% of the DDR wire rate: 0.7 of the node's rated bandwidth (assumed; no GPU
# host measured). The device still reads the gradient twice for the norm and clipping.
OFFLOAD_COPY_BYTES = 8
HOST_ADAM_BYTES = 28
HOST_ADAM_EFFICIENCY = 0.7
OFFLOAD_DEVICE_BYTES = 8


@dataclass
class Estimate:
    cfg: Config
    step_time_s: float
    tokens_per_s: float
    model_tflops_per_gpu: float
    mfu: float
    hfu: float
    bubble_fraction: float
    memory: Memory  # the rank with the largest total
    memory_by_rank: list  # per pipeline rank
    hbm_gib: float
    usable_gib: float
    breakdown: dict = field(default_factory=dict)  # seconds per step on the busiest rank; sums to the step
    host_memory: HostMemory = field(default_factory=HostMemory)  # the rank with the largest total
    ranks_per_node: int = 1
    node_ram_gib: float | None = None  # the cluster's RAM per node, where known

    @property
    def peak_memory_gib(self) -> float:
        return self.memory.total / GIB

    @property
    def node_host_memory_gib(self) -> float:
        """Host memory of a node's ranks, at most: ranks_per_node of the worst rank."""
        return self.ranks_per_node * self.host_memory.total / GIB

    @property
    def host_fits(self) -> bool | None:
        """Whether a node's ranks fit its RAM; None where the cluster does not say how much it has."""
        return None if self.node_ram_gib is None else self.node_host_memory_gib <= self.node_ram_gib

    @property
    def fits(self) -> bool:
        return self.peak_memory_gib <= self.usable_gib and self.host_fits is not False

    def to_json(self) -> dict:
        m, p, t = self.cfg.model, self.cfg.parallel, self.cfg.train
        b = self.breakdown
        exposed = sum(v for k, v in b.items() if k.endswith("_comm"))
        return {"step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s,
                "model_tflops_per_gpu": self.model_tflops_per_gpu, "mfu": self.mfu, "hfu": self.hfu,
                "bubble_fraction": self.bubble_fraction, "peak_memory_gib": self.peak_memory_gib,
                "memory_gib": self.memory.gib(), "fits": self.fits, "gpu_memory_gib": self.hbm_gib,
                "usable_memory_gib": self.usable_gib,
                "memory_gib_by_pp_rank": [m.total / GIB for m in self.memory_by_rank],
                "compute_s": b["compute"] + b["recompute"], "exposed_comm_s": exposed, "bubble_s": b["pipeline_bubble"],
                "time_s": dict(b), "parallel": dict(vars(p)), "comm_bytes": comm_bytes_per_step(self.cfg),
                "params": flops.parameter_count(m), "active_params": flops.parameter_count(m, active=True),
                "host_memory_gib": self.host_memory.gib(), "peak_host_memory_gib": self.host_memory.total / GIB,
                "node_host_memory_gib": self.node_host_memory_gib, "node_ram_gib": self.node_ram_gib,
                "host_fits": self.host_fits,
                "train": {"micro_batch": t.micro_batch, "global_batch": t.global_batch, "recompute": t.recompute,
                          "dtype": t.dtype, "offload_optimizer": t.offload_optimizer,
                          "loss_chunk_tokens": t.loss_chunk_tokens}}


def mfu_peak(gpu: GPU, dtype: str, tf32: bool) -> float:
    """The peak MFU is measured against: fp32's (TF32's where train.tf32 puts fp32 matmuls on
    its tensor cores) for fp32 training, else the 16-bit dense peak (fp8 runs too, as Llama 3
    and torchtitan report them)."""
    return gpu.matmul_peak("fp32" if dtype == "fp32" else "bf16", tf32)


def estimate(cfg: Config, cluster: Cluster, stack: str | Stack = "tetrad") -> Estimate:
    """Predict one layout on `cluster` under software `stack` (stacks.py; default tetrad itself)."""
    asked = cfg
    cfg, stack, layers, embed, head, st, pipe, (dp_exposed, opt, host_copies) = _step(cfg, cluster, stack, True)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    gpu, micro = cluster.gpu, cfg.microbatches
    step = pipe + dp_exposed + opt + host_copies
    bubble = 1.0 - micro * sum(st.busy) / (p.pp * pipe)  # share of rank-time not computing

    memory = memory_by_rank(cfg, stack, gpu.is_cpu)
    busiest = max(range(p.pp), key=lambda r: st.busy[r])
    held = list(flops.kind_counts(m, rank_chunk_layers(cfg)[busiest]).items())
    held += list(flops.mtp_kind_counts(m).items()) if busiest == p.pp - 1 else []
    per_step = {k: micro * sum(n * getattr(layers[kind], k) for kind, n in held)
                for k in ("compute", "recompute", "tp_comm", "cp_comm", "ep_comm", "zero3_comm")}
    ends = (sum(embed) if busiest == 0 else 0.0) + (sum(head) if busiest == p.pp - 1 else 0.0)
    breakdown = {**per_step, "compute": per_step["compute"] + micro * ends,
                 "pipeline_bubble": pipe - micro * st.busy[busiest], "dp_comm": dp_exposed, "optimizer": opt}
    if t.offload_optimizer:
        breakdown["host_copies"] = host_copies

    global_tokens = t.global_batch * m.seq_len
    per_gpu = global_tokens / step / p.world_size  # tokens per second per GPU
    peak = mfu_peak(gpu, t.dtype, t.tf32)
    model_flops = flops.model_flops_per_token(m)
    hw_flops = flops.hardware_flops_per_token(m, t.recompute, loss_chunked=t.loss_chunk_tokens > 0)
    host = max(host_memory_by_rank(cfg), key=lambda x: x.total)
    return Estimate(asked, step, global_tokens / step, model_flops * per_gpu / 1e12, model_flops * per_gpu / peak,
                    hw_flops * per_gpu / peak, bubble, max(memory, key=lambda x: x.total), memory, gpu.hbm_gib,
                    gpu.hbm_gib - (0.0 if gpu.is_cpu else GPU_RESERVED_GIB), breakdown, host,
                    cluster.gpus_per_node, cluster.host_memory_gib)


def step_time_bound(cfg: Config, cluster: Cluster, stack: str | Stack = "tetrad") -> float:
    """A lower bound of `estimate`'s step time, without simulating the pipeline or counting memory:
    the pipeline's critical path and no data-parallel exposure (the search prunes with it)."""
    *_, pipe, (dp_exposed, opt, host_copies) = _step(cfg, cluster, stack, False)
    return pipe + dp_exposed + opt + host_copies


class _Step(NamedTuple):
    """A step's parts (`_step`): the config and stack as run, the costs of a layer of each kind,
    of the embedding and the head, of each stage; the pipeline's seconds, then (exposed
    data-parallel communication, optimizer, offload's host copies)."""
    cfg: Config
    stack: Stack
    layers: dict
    embed: tuple
    head: tuple
    st: _StageCosts
    pipe: float
    rest: tuple[float, float, float]


def _step(cfg: Config, cluster: Cluster, stack: str | Stack, simulate: bool) -> _Step:
    """`estimate`'s step, the pipeline simulated or (not `simulate`) bounded by its critical path."""
    if cfg.train.offload_optimizer and offload_unknown(cluster):
        raise HardwareError(offload_unknown(cluster))
    stack = as_run(cfg, load_stack(stack) if isinstance(stack, str) else stack, cluster.gpu.is_cpu)
    if stack.zero3_held_under_pp and cfg.parallel.zero == 3 and cfg.parallel.pp > 1:
        cfg = replace(cfg, parallel=replace(cfg.parallel, zero=1))
    layers = layer_costs(cfg, cluster, stack)
    embed, head = end_costs(cfg, cluster)
    if stack.head_weight_grad_in_bi:
        head = (head[0], head[1] + head[2], 0.0)
    head = tuple(a + b for a, b in zip(head, _mtp_end_costs(cfg, cluster, embed, head)))
    st = _stage_costs(cfg, cluster, stack, layers, embed, head)
    pipe, tail = _pipeline_time(cfg, st, simulate)
    return _Step(cfg, stack, layers, embed, head, st, pipe, _data_parallel_time(cfg, cluster, stack, st, tail))


@dataclass
class _StageCosts:
    """Seconds per micro-batch of each global stage's F, BI (recompute included) and BW as the
    simulator runs them, the transfer latency it adds between ranks, and per pipeline rank its
    stages, its compute (`busy`) and what it runs (`work`: busy plus transfers it blocks on)."""
    f: list[float]
    bi: list[float]
    bw: list[float]
    p2p: float
    held_by: list[list[int]]
    busy: list[float]
    work: list[float]


def layer_costs(cfg: Config, cluster: Cluster, stack: Stack) -> dict[bool, LayerCost]:
    """Each kind of layer's costs (layer.layer_cost), keyed by ModelConfig.moe_layer: an MoE
    model's MoE and dense layers (model.dense_layers) differ; a dense model's are all False. The
    multi-token prediction modules' layers (model.mtp_layers) are of these kinds."""
    m = cfg.model
    kinds = {**flops.kind_counts(m), **flops.mtp_kind_counts(m)}
    return {k: layer_cost(replace(cfg, model=flops.layer_model(m, k)), cluster, stack) for k in kinds}


def _mtp_end_costs(cfg: Config, cluster: Cluster, embed: tuple, head: tuple) -> tuple[float, ...]:
    """(forward, backward_input, backward_weight) seconds per micro-batch of the multi-token
    prediction modules beside their layers, from the embedding's and the head's as the stack runs
    them: each depth an embedding lookup, a head and an eh_proj matmul each way (replicated over
    tp, on the rank's own tokens: under SP its chunk). Nothing without them."""
    m, p, t = cfg.model, cfg.parallel, cfg.train
    rows = t.micro_batch * m.seq_len // p.cp // (p.tp if p.sequence_parallel else 1)
    peak = cluster.gpu.matmul_peak(t.dtype, t.tf32)
    proj = 2 * rows * flops.eh_proj_params(m) / (peak * gemm_efficiency(cluster.gpu, rows, m.d_model, 2 * m.d_model))
    return tuple(m.mtp_layers * (a + b + proj) for a, b in zip(embed, head))


def _stage_costs(cfg: Config, cluster: Cluster, stack: Stack, layers: dict[bool, LayerCost], embed: tuple,
                 head: tuple) -> _StageCosts:
    """Each stage's layers at their kind's cost (`layer_costs`), the embedding on the first and the
    head on the last. A transfer between neighbouring stages is a latency the schedule can hide, or,
    where the stack blocks on it, part of the sending action (and so of the bubble)."""
    p, m = cfg.parallel, cfg.model
    stages = [[(n, layers[kind]) for kind, n in flops.kind_counts(m, [split]).items()] for split in layer_split(cfg)]
    stages[-1] += [(n, layers[kind]) for kind, n in flops.mtp_kind_counts(m).items()]  # after the head
    f = [sum(n * c.forward for n, c in stage) for stage in stages]
    bi = [sum(n * (c.backward_input + c.recompute) for n, c in stage) for stage in stages]
    bw = [sum(n * c.backward_weight for n, c in stage) for stage in stages]
    for costs, k in ((f, 0), (bi, 1), (bw, 2)):
        costs[0] += embed[k]
        costs[-1] += head[k]
    held_by = [rank_stages(p.pp, p.vpp, r) for r in range(p.pp)]
    busy = [sum(f[g] + bi[g] + bw[g] for g in held) for held in held_by]
    tokens = cfg.train.micro_batch * cfg.model.seq_len // p.cp
    p2p = _p2p_time(cfg, cluster, stack, tokens, activation_bytes(cfg.train.dtype))
    if stack.pp_blocking_p2p and p.pp > 1:
        f = [x + (p2p if s < len(f) - 1 else 0.0) for s, x in enumerate(f)]
        bi = [x + (p2p if s > 0 else 0.0) for s, x in enumerate(bi)]
        p2p = 0.0
    work = [sum(f[g] + bi[g] + bw[g] for g in held) for held in held_by]
    return _StageCosts(f, bi, bw, p2p, held_by, busy, work)


def _pipeline_time(cfg: Config, st: _StageCosts, simulate: bool) -> tuple[float, list[float]]:
    """(seconds of the forward-backward of all micro-batches, each rank's idle tail after its
    last action) from the schedule simulator, or without it a lower bound: rank r waits r
    stage-forwards for its first input and its last gradient has r stages to go."""
    p, micro = cfg.parallel, cfg.microbatches
    if p.pp == 1:
        return micro * st.work[0], [0.0]
    if simulate:
        return pipeline(p.schedule, p.pp, micro, p.vpp, st.f, st.bi, st.bw, st.p2p)
    hops = min(st.f) + min(st.bi)
    return max(r * hops + micro * st.work[r] for r in range(p.pp)), [math.inf] * p.pp


def _optimizer_time(cfg: Config, cluster: Cluster, shard: float) -> tuple[float, float]:
    """(optimizer step, copies between device and host) in seconds for a rank updating `shard`
    parameters: AdamW through HBM, or under offload the device's reads of the gradient and AdamW
    on the host, whose memory the node's ranks share, and the copies over the GPU's host link."""
    gpu = cluster.gpu
    if not cfg.train.offload_optimizer:
        return shard * OPTIMIZER_BYTES_PER_PARAM / gpu.hbm_bytes_per_s, 0.0
    host_adam = shard * HOST_ADAM_BYTES * cluster.gpus_per_node / (gpu.host_memory_gbps * 1e9 * HOST_ADAM_EFFICIENCY)
    copies = shard * OFFLOAD_COPY_BYTES / (gpu.host_link_gbps * 1e9 * LINK_EFFICIENCY)
    return shard * OFFLOAD_DEVICE_BYTES / gpu.hbm_bytes_per_s + host_adam, copies


def _data_parallel_time(cfg: Config, cluster: Cluster, stack: Stack, st: _StageCosts,
                        tail: list[float]) -> tuple[float, float, float]:
    """(exposed data-parallel communication, optimizer step, offload's host copies) in seconds,
    over dp x cp, the worst pipeline rank's: the gradient reduction overlaps the last
    micro-batch's backward (all but the last bucket) and the rank's idle tail of the pipeline;
    ZeRO-1/2 then all-gather the updated weights (under the next step's first forward where the
    stack overlaps it)."""
    p, micro = cfg.parallel, cfg.microbatches
    exposed, opt, copies, gather = 0.0, 0.0, 0.0, 0.0
    n, sharded = p.dp * p.cp, shard_ranks(p)  # hybrid ZeRO: gathers inside blocks of `sharded`
    alpha, link = group_link(cluster, p.tp, sharded)
    n_e = expert_shard_ranks(p) or 1  # ep: the experts' buckets over their own group, after the rest
    stride_e = expert_shard_stride(cluster.gpus_per_node, p)
    for r, (params, buckets) in enumerate(zip(rank_params(cfg), rank_buckets(cfg))):
        experts = buckets.expert_size  # their parameters, 0 at ep = 1
        shard = (params - experts) / (sharded if p.zero >= 1 else 1) + experts / (n_e if p.zero >= 1 else 1)
        rank_opt, rank_copies = _optimizer_time(cfg, cluster, shard)
        opt, copies = max(opt, rank_opt), max(copies, rank_copies)
        if n == 1:
            continue
        each, grads = _reduction_time(cfg, cluster, stack, buckets)
        earlier = 0.0  # ZeRO >= 2 reduce-scatters every micro-batch, hidden behind the next one's work
        if stack.dp_overlap:  # (and slowing the work it runs beside)
            window = sum(st.bi[g] + st.bw[g] for g in st.held_by[r])
            if p.zero >= 2:
                work = window + sum(st.f[g] for g in st.held_by[r])
                earlier = (micro - 1) * (max(0.0, each - work) + overlap_slowdown(each, work, cluster.gpu))
            last_bucket = grads * min(1.0, bucket_bytes(cfg.parallel) / (params * stack.grad_reduce_bytes))
            grads = max(last_bucket, grads - window) + overlap_slowdown(grads, window, cluster.gpu)
        elif p.zero >= 2:
            earlier = (micro - 1) * each
        exposed = max(exposed, earlier + max(0.0, grads - tail[r]))  # the idle tail hides only the last
        if p.zero in (1, 2):  # updated 16-bit (fp32) weights all-gathered after the optimizer step
            w = state_bytes_per_param(cfg.train.dtype)[0]
            weights = params * w
            weights_gather = (ring_time("all_gather", (params - experts) * w, sharded, alpha, link)
                              + ring_time("all_gather", experts * w, n_e, *group_link(cluster, stride_e, n_e)))
            if stack.param_gather_overlap:  # or under the next step's first forward, bucket by bucket
                first_bucket = weights_gather * min(1.0, bucket_bytes(cfg.parallel) / weights)
                forward = sum(st.f[g] for g in st.held_by[r])
                weights_gather = (max(first_bucket, weights_gather - forward)
                                  + overlap_slowdown(weights_gather, forward, cluster.gpu))
            gather = max(gather, weights_gather)
    return max(0.0, exposed) + gather, opt, copies


def _reduction_time(cfg: Config, cluster: Cluster, stack: Stack, buckets: RankBuckets) -> tuple[float, float]:
    """(seconds of one gradient reduction, of the step's last) of a pipeline rank's `buckets`: the
    dense ones over dp x cp, the experts' (ep) over their own group after them (moe.expert_shard_ranks,
    links.expert_shard_stride). Hybrid ZeRO: each reduction a reduce-scatter inside the block
    (the experts' share of it); the last adds the replicas' all-reduce, each bucket's started as
    that ends (GradSync._sum_over_replicas): under the last backward as the rest is."""
    p = cfg.parallel
    n, sharded = p.dp * p.cp, shard_ranks(p)
    n_e, stride_e = expert_shard_ranks(p) or 1, expert_shard_stride(cluster.gpus_per_node, p)
    grad_bytes, expert_bytes = gradient_reduce_bytes(cfg, buckets, stack.grad_reduce_bytes)
    if not zero_shard(p):
        scatter = p.zero >= 2 or (p.zero == 1 and stack.zero1_reduce_scatter)
        op = "reduce_scatter" if scatter else "all_reduce"
        each = reduction_time(op, grad_bytes, n, cluster, p.tp) + reduction_time(op, expert_bytes, n_e, cluster, stride_e)
        return each, each
    each = (reduction_time("reduce_scatter", grad_bytes, sharded, cluster, p.tp)
            + reduction_time("reduce_scatter", expert_bytes, n_e, cluster, stride_e))
    # ZeRO 2/3 sum the step's accumulated shard over the replicas, uncoded
    summed = [x * stack.grad_reduce_bytes if p.zero >= 2 else None
              for x in (buckets.padded - buckets.expert_padded, buckets.expert_padded)]
    replicas, apart = n // sharded, p.tp * sharded  # the experts' as many, as far apart
    return each, (hybrid_reduction_time(grad_bytes, sharded, p.tp, replicas, apart, cluster, summed[0])
                  + hybrid_reduction_time(expert_bytes, n_e, stride_e, replicas, apart, cluster, summed[1]))


def _p2p_time(cfg: Config, cluster: Cluster, stack: Stack, tokens: int, e: int) -> float:
    """One activation (or gradient) transfer between neighbouring pipeline ranks."""
    p = cfg.parallel
    if p.pp == 1:
        return 0.0
    stride = p.tp * p.cp * p.dp
    alpha, bw = group_link(cluster, stride, 2)
    full = tokens * cfg.model.d_model * e
    if p.tp > 1 and (p.sequence_parallel or stack.pp_scatter_gather):
        t_alpha, t_bw = group_link(cluster, 1, p.tp)
        regather = 0.0 if p.sequence_parallel else ring_time("all_gather", full, p.tp, t_alpha, t_bw)
        return ring_time("p2p", full / p.tp, 2, alpha, bw) + regather
    return ring_time("p2p", full, 2, alpha, bw)
