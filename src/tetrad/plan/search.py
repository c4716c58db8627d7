"""`tetrad plan`: every legal layout of a model on a cluster, ranked by predicted step time.

Enumerates (tp, pp, cp, dp, ep, cp_algo, micro_batch, recompute, schedule, vpp, zero, zero_shard) under
config.validate's rules (mirrored here as a cheap pre-filter; validate has the last word), and,
for a ZeRO stage that fits on the GPU only with them, the head's loss fused in chunks
(train.loss_chunk_tokens: one more head GEMM) and optimizer offload (both only add time).
Sequence parallelism is on whenever tp > 1 (it only saves memory); schedules come from the
registry, less those another one dominates (GPipe: 1F1B has its time with less memory).

Branch and bound keeps it fast. Each layout gets a lower bound on its step time: the larger of
the busiest pipeline rank's work and the simulated schedule with every stage as cheap as the
least-loaded one (a schedule's time never drops when an action gets slower), from layer costs
shared by every layout with the same tp, cp, micro-batch and recompute, with no data-parallel
time. Layouts are taken in bound order; those that fit in memory get the full estimate, and the
walk stops when the next bound is slower than the `top`-th estimate, so the ranking is exactly
what estimating every layout would give.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from dataclasses import dataclass, field
from typing import NamedTuple

from tetrad.config import Config, validate
from tetrad.config.rampup import BatchRamp
from tetrad.config.wording import divisors
from tetrad.parallel.pipeline.registry import SCHEDULES, check_config
from tetrad.parallel.pipeline.split import rank_layers, stage_layers
from tetrad.plan.cost import Estimate, estimate, layer_costs, step_time_bound
from tetrad.plan.hardware import Cluster, offload_unknown
from tetrad.plan.memory import GIB, GPU_RESERVED_GIB, held_by_rank, host_memory_by_rank, memory_by_rank
from tetrad.config.sections import expert_parallel_blocker
from tetrad.plan.stacks import Stack, load_stack

MICRO_BATCHES = (1, 2, 4, 8, 16)
VIRTUAL_STAGES = (2, 3, 4, 6, 8)
RECOMPUTE = ("none", "selective", "selective-op", "full")
# train.loss_chunk_tokens where a layout fits only with the head's loss chunked: at a 128k
# vocabulary a chunk's fp32 logits are 1 GiB, a GEMM of 2048 rows still large enough to run at
# its GPU's full rate, and the micro-batch's logits (16 GiB at 32k tokens) never exist.
PLANNED_LOSS_CHUNK = 2048


class Layout(NamedTuple):
    tp: int
    pp: int
    cp: int
    dp: int
    ep: int  # expert parallelism: a divisor of dp and of the experts (1 for a dense model)
    cp_algo: str
    micro_batch: int
    schedule: str
    vpp: int
    recompute: str


@dataclass
class Plan:
    ranked: list  # Estimates that fit, fastest first (or, if none fits, the closest to fitting)
    considered: int  # legal layouts (ZeRO stages not counted)
    estimated: int  # full estimates made
    rejected: list = field(default_factory=list)  # estimates of the fastest-bounded layouts that do not fit
    # (peak memory GiB, seconds, exact) of every candidate the search looked at: exact step times
    # where it estimated fully, lower bounds elsewhere (the picture `tetrad plan --plot` draws).
    points: list = field(default_factory=list)


def layouts(base: Config, world: int, per_node: int):
    """Every legal layout of `base`'s model and global batch on `world` ranks (ZeRO aside); with
    `parallel.stage_layers` set, only those with its number of pipeline stages; with a batch
    ramp-up, only those that run each of its global batches (whole micro-batches over dp, enough
    for the schedule at its start)."""
    m, ramp = base.model, BatchRamp.of(base.train)
    fixed = len(base.parallel.stage_layers)
    heads = math.gcd(m.n_heads, m.n_kv_heads)
    for tp in divisors(min(world, per_node)):
        if heads % tp or m.ffn_hidden % tp or m.expert_hidden % tp:
            continue
        for pp in divisors(world // tp):
            if pp > m.n_layers:
                continue
            for cp in divisors(world // (tp * pp)):
                if cp > 1 and m.seq_len % (2 * cp) or (m.seq_len // cp) % tp:  # load balance; SP's split
                    continue
                dp = world // (tp * pp * cp)
                algos = ("ring", "alltoall") if cp > 1 and heads % (tp * cp) == 0 else ("ring",)
                for ep, algo, mb in itertools.product(_expert_parallel(base, dp), algos, MICRO_BATCHES):
                    if ramp.indivisible(mb * dp) is not None:
                        continue
                    for schedule, vpp in _schedules(pp, ramp.start // (mb * dp), m.n_layers, fixed):
                        for recompute in RECOMPUTE:
                            yield Layout(tp, pp, cp, dp, ep, algo, mb, schedule, vpp, recompute)


def _expert_parallel(base: Config, dp: int) -> list[int]:
    """The ep degrees worth trying at `dp`: the divisors of dp that divide the experts (MoE models;
    a hybrid ZeRO block is checked per stage, `_zero_stages`); else 1."""
    return [ep for ep in divisors(dp) if base.model.n_experts % ep == 0] if base.model.n_experts else [1]


def _schedules(pp: int, micro: int, layers: int, stages: int):
    """(schedule, vpp) pairs worth ranking for steps of at least `micro` micro-batches: every
    registered schedule that another does not dominate (same time, less memory), with each number
    of chunks per rank it runs (giving `stages` pipeline stages, when that is fixed)."""
    if pp == 1:
        if stages <= 1:
            yield "1f1b", 1
        return
    for name, spec in SCHEDULES.items():
        if spec.dominated_by in SCHEDULES:
            continue
        for vpp in spec.vpp_choices(VIRTUAL_STAGES):
            if layers >= pp * vpp and micro >= spec.min_microbatches(pp, vpp) and stages in (0, pp * vpp):
                yield name, vpp


def config_of(base: Config, layout: Layout, zero: int = 0, zero_shard: int = 0) -> Config:
    """`base` with `layout`, ZeRO stage `zero` and hybrid ZeRO's block `zero_shard` (validated)."""
    par = dataclasses.replace(base.parallel, tp=layout.tp, pp=layout.pp, cp=layout.cp, dp=layout.dp, ep=layout.ep,
                              cp_algo=layout.cp_algo, vpp=layout.vpp, schedule=layout.schedule, zero=zero,
                              zero_shard=zero_shard, sequence_parallel=layout.tp > 1)
    train = dataclasses.replace(base.train, micro_batch=layout.micro_batch, recompute=layout.recompute)
    cfg = dataclasses.replace(base, parallel=par, train=train)
    validate(cfg, layout.tp * layout.pp * layout.cp * layout.dp, runtime=False, ranges=False)  # base's were checked
    check_config(cfg)
    return cfg


def plan(base: Config, cluster: Cluster, top: int = 10, stack: str | Stack = "tetrad", offload: bool = True,
         chunk_loss: bool = True) -> Plan:
    """The `top` fastest layouts of `base`'s model and global batch that fit in memory on
    `cluster`, best first; if none fits, the `top` closest to fitting, so the user sees why.
    `offload`: also with optimizer offload where only that fits (base's own setting otherwise);
    `chunk_loss`: also with the head's loss chunked (PLANNED_LOSS_CHUNK) where only that fits."""
    stack = load_stack(stack) if isinstance(stack, str) else stack
    chunk_loss = chunk_loss and stack.name.startswith("tetrad")  # tetrad's fused loss, not another stack's
    usable = cluster.gpu.hbm_gib - (0.0 if cluster.gpu.is_cpu else GPU_RESERVED_GIB)
    bound = _LayoutBound(base, cluster, stack)
    # Heap entries (lower bound, tie-break, layout or config): a Layout bounded by its layer
    # costs, then each of its ZeRO stages that fits, bounded by cost.step_time_bound.
    queue = [(bound(x), i, x) for i, x in enumerate(layouts(base, cluster.world, cluster.gpus_per_node))]
    heapq.heapify(queue)
    considered, tie = len(queue), len(queue)
    ranked: list[Estimate] = []
    rejected: list[tuple[float, Config]] = []
    estimated = 0
    points = []
    while queue:
        lower, _, item = heapq.heappop(queue)
        if len(ranked) >= top and lower > ranked[top - 1].step_time_s:
            break
        if isinstance(item, Config):
            ranked.append(estimate(item, cluster, stack))
            estimated += 1
            points.append((ranked[-1].peak_memory_gib, ranked[-1].step_time_s, True))
            ranked.sort(key=lambda e: e.step_time_s)
            del ranked[top:]
            continue
        for cfg, peak, last in _zero_stages(base, item, cluster, stack, usable, offload, chunk_loss):
            if peak <= usable and _host_fits(cfg, cluster):
                tie += 1
                rough = step_time_bound(cfg, cluster, stack)
                heapq.heappush(queue, (rough, tie, cfg))
                points.append((peak, rough, False))
                continue
            points.append((peak, lower, False))
            if last:
                rejected.append((peak, cfg))
    if not ranked:  # nothing fits: the closest to fitting, with their breakdowns
        closest = heapq.nsmallest(top, rejected, key=lambda x: x[0])
        return Plan([estimate(c, cluster, stack) for _, c in closest], considered, estimated, points=points)
    return Plan(ranked, considered, estimated, [estimate(c, cluster, stack) for _, c in rejected[:3]], points)


class _LayoutBound:
    """A lower bound on a layout's step time from layer costs shared by every layout with the
    same tp, cp, ep, micro-batch and recompute: the busiest pipeline rank's work after the hops its
    first and last micro-batch must wait for, every layer at the cheaper kind's cost where layers
    differ (model.dense_layers). No data-parallel time."""

    def __init__(self, base: Config, cluster: Cluster, stack: Stack):
        self.base, self.cluster, self.stack = base, cluster, stack
        self.layer_costs: dict = {}
        self.rank_layers: dict = {}  # (pp, vpp) -> (layers per rank, fewest layers of a stage)

    def __call__(self, layout: Layout) -> float:
        base = self.base
        micro = base.train.global_batch // (layout.micro_batch * layout.dp)
        key = (layout.tp, layout.cp, layout.ep, layout.cp_algo, layout.micro_batch, layout.recompute, micro > 1)
        if key not in self.layer_costs:
            kinds = layer_costs(config_of(base, layout), self.cluster, self.stack).values()
            self.layer_costs[key] = (min(c.forward + c.backward_input + c.recompute + c.backward_weight for c in kinds),
                                     min(c.forward + c.backward_input + c.recompute for c in kinds))
        per_layer, hop = self.layer_costs[key]
        shape = (layout.pp, layout.vpp)
        if shape not in self.rank_layers:
            split = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, pp=layout.pp, vpp=layout.vpp))
            self.rank_layers[shape] = rank_layers(split), min(stage_layers(split))
        layers, least = self.rank_layers[shape]
        # Rank r starts only after micro-batch 0 crossed r stages forward, and its last gradient
        # still has r stages to cross backward: a critical path any schedule must respect.
        hops = least * hop
        return max(r * hops + micro * per_layer * n for r, n in enumerate(layers))


def _zero_stages(base: Config, layout: Layout, cluster: Cluster, stack: Stack, usable: float, offload: bool,
                 chunk_loss: bool):
    """(config, peak GiB per GPU, whether it is the last) of each ZeRO stage `layout` can run,
    ZeRO 1-3 also hybrid (sharded over the dp x cp ranks of one node, where dp x cp spans several
    and, under ep, expert parallelism takes that block), each followed, where it exceeds `usable`
    GiB, by those of the same that would fit with the head's loss chunked (where `chunk_loss` and
    `base` does not chunk already), with optimizer offload (where `offload`, the cluster can cost
    it and `base` does not offload already), or, where neither alone fits, with both."""
    n = layout.dp * layout.cp
    zeros = (0, 1, 2, 3) if n > 1 else (0,)
    node = cluster.gpus_per_node // layout.tp if cluster.gpus_per_node % layout.tp == 0 else 0  # tp innermost
    composes = base.parallel.grad_codec in ("none", "bf16") and base.parallel.hierarchical is not True
    hybrid = dataclasses.replace(base.parallel, dp=layout.dp, cp=layout.cp, ep=layout.ep, zero=1, zero_shard=node)
    composes = composes and expert_parallel_blocker(hybrid) is None  # ep: a block of whole EP groups over cp
    blocks = (0, node) if composes and 1 < node < n and n % node == 0 else (0,)
    offload = offload and not base.train.offload_optimizer and offload_unknown(cluster) is None
    chunk_loss = chunk_loss and not base.train.loss_chunk_tokens
    candidates, held = [], {}  # held: the layout's, whatever its ZeRO, unchunked and chunked
    for zero, shard in ((z, b) for z in zeros for b in blocks if z or not b):
        cfg = config_of(base, layout, zero, shard)
        peak, offloaded = _peaks(cfg, stack, cluster, held)
        candidates.append((cfg, peak))
        if peak <= usable:
            continue
        chunked = _with_train(cfg, loss_chunk_tokens=PLANNED_LOSS_CHUNK) if chunk_loss else None
        chunked_peak, chunked_offloaded = _peaks(chunked, stack, cluster, held) if chunked else (math.inf, math.inf)
        if chunked_peak <= usable:
            candidates.append((chunked, chunked_peak))
        if offload and offloaded <= usable:
            candidates.append((_with_train(cfg, offload_optimizer=True), offloaded))
        elif offload and chunked_peak > usable >= chunked_offloaded:
            candidates.append((_with_train(chunked, offload_optimizer=True), chunked_offloaded))
    for i, (cfg, peak) in enumerate(candidates):
        yield cfg, peak, i == len(candidates) - 1


def _peaks(cfg: Config, stack: Stack, cluster: Cluster, held: dict) -> tuple[float, float]:
    """`cfg`'s peak GiB per GPU, and its peak with the optimizer's states offloaded (offload moves
    only those); `held` keeps each loss_chunk_tokens' Held (the same for every ZeRO stage)."""
    key = cfg.train.loss_chunk_tokens
    held[key] = held.get(key) or held_by_rank(cfg, stack, cluster.gpu.is_cpu)
    memory = memory_by_rank(cfg, stack, cluster.gpu.is_cpu, held[key])
    return max(x.total for x in memory) / GIB, max(x.total - x.optimizer for x in memory) / GIB


def _with_train(cfg: Config, **train) -> Config:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, **train))


def _host_fits(cfg: Config, cluster: Cluster) -> bool:
    """Whether a node's ranks fit its RAM (Estimate.host_fits), or the cluster does not say."""
    if cluster.host_memory_gib is None:
        return True
    return cluster.gpus_per_node * max(h.total for h in host_memory_by_rank(cfg)) / GIB <= cluster.host_memory_gib
