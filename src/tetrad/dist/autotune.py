"""`parallel.grad_bucket_mb = "auto"` and `parallel.hierarchical = "auto"`: choose them from a short
measurement of the gradient group at start-up (AutoCCL's idea: tune communication on the job's
own links rather than from defaults), and say what was measured.

`resolve` is collective over the whole job: every rank calls it, with the same config, before it
builds its gradient reducer (the trainer does). Every rank ends with the same choice (bucket layouts must match
across tp, and one answer is easier to read in the log).
"""

from __future__ import annotations

import sys
from dataclasses import replace

import torch
import torch.distributed as dist

from tetrad import device as devices
from tetrad.config import DEFAULT_BUCKET_MB
from tetrad.config.sections import hierarchical_blocker
from tetrad.dist.bench import bus_factor, time_collective
from tetrad.dist.layout import GRAD, GRAD_DIMS
from tetrad.dist.topology import INTER, INTRA

# The [parallel] keys "auto" leaves to this measurement.
AUTO_KEYS = ("grad_bucket_mb", "hierarchical")
BUCKET_CANDIDATES_MB = (1, 4, 16, 25, 64)
SATURATION = 0.8  # a bucket this close to the best measured bus bandwidth is large enough


def resolve(parallel, topo, grad_bytes: int):
    """`parallel` with "auto" replaced by measured choices for this job's dp x cp group, whose
    fp32 gradients on this rank take `grad_bytes`; logged on rank 0 with the figures."""
    if parallel.grad_bucket_mb != "auto" and parallel.hierarchical != "auto":
        return parallel
    flat = topo.group(GRAD)
    # Pipeline stages hold different gradients, but every rank must time the same bucket sizes.
    total = torch.tensor([float(grad_bytes)], dtype=torch.float64, device=devices.collective_device())
    dist.all_reduce(total, op=dist.ReduceOp.MAX)
    grad_bytes = int(total)
    notes = []
    bucket_mb = parallel.grad_bucket_mb
    if bucket_mb == "auto":
        if flat is None:
            bucket_mb, note = DEFAULT_BUCKET_MB, f"no dp x cp reduction to tune (one rank per group): {DEFAULT_BUCKET_MB:g} MiB"
        else:
            bucket_mb, busbw = choose_bucket_mb(flat, grad_bytes)
            figures = ", ".join(f"{mb:g} MiB {gbps:.2f} GB/s" for mb, gbps in busbw.items())
            note = (f"{bucket_mb:g} MiB, the smallest within {SATURATION:.0%} of the best all-reduce bus bandwidth "
                    f"over dp x cp = {topo.size(GRAD)} ranks ({figures})")
        notes.append(f"parallel.grad_bucket_mb=auto -> {note}")
    hierarchical = parallel.hierarchical
    if hierarchical == "auto":
        hierarchical, note = _choose_hierarchical(parallel, topo, int(bucket_mb * 2**20))
        notes.append(f"parallel.hierarchical=auto -> {note}")
    if topo.rank == 0:
        for line in notes:
            print(f"tetrad: {line}", file=sys.stderr)
    return replace(parallel, grad_bucket_mb=bucket_mb, hierarchical=hierarchical)


def reuse(parallel, saved: dict, source: str, rank: int):
    """`parallel` with "auto" replaced by `saved`, what it resolved to in the run that wrote
    checkpoint `source` (a resume in its layout: the same buckets, not measured again); logged on
    rank 0 as `resolve` logs a measurement."""
    shown = {"grad_bucket_mb": lambda mb: f"{mb:g} MiB", "hierarchical": lambda h: "hierarchical" if h else "flat"}
    if rank == 0:
        for key, value in saved.items():
            print(f"tetrad: parallel.{key}=auto -> {shown[key](value)}, as chosen by the run that saved {source} "
                  "(resumed in its layout: not measured again)", file=sys.stderr)
    return replace(parallel, **saved)


def choose_bucket_mb(group, grad_bytes: int | None = None, candidates_mb=BUCKET_CANDIDATES_MB) -> tuple[float, dict]:
    """The smallest bucket whose all-reduce on `group` reaches SATURATION of the best measured bus
    bandwidth: smaller buckets start sooner and leave less exposed after backward, below saturation
    each one pays too much latency. Buckets larger than the gradients are not tried. The slowest
    group of the job decides (collective over the whole job). Returns (MiB, {MiB: busbw GB/s})."""
    n = dist.get_world_size(group)
    sizes = [mb for mb in candidates_mb if grad_bytes is None or mb * 2**20 <= grad_bytes] or [candidates_mb[0]]
    seconds = torch.tensor([time_collective("all_reduce", int(mb * 2**20), group, iters=3) for mb in sizes],
                           dtype=torch.float64, device=devices.collective_device())
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    busbw = {mb: mb * 2**20 / s / 1e9 * bus_factor("all_reduce", n) for mb, s in zip(sizes, seconds.tolist())}
    best = max(busbw.values())
    return float(next(mb for mb in sizes if busbw[mb] >= SATURATION * best)), busbw


def _choose_hierarchical(parallel, topo, nbytes: int) -> tuple[bool, str]:
    """Flat or hierarchical reduction, and why. Only measured where hierarchical is possible
    (ZeRO 0/1 without a codec, the dp x cp group spread evenly over more than one node)."""
    n, per_node = topo.size(GRAD), parallel.ranks_per_node
    if n == 1:
        return False, "flat (no dp x cp reduction)"
    blocker = hierarchical_blocker(parallel)
    if blocker:
        return False, f"flat ({blocker})"
    halves = topo.layout.split_by_node(GRAD_DIMS, per_node)
    if halves is None:
        return False, f"flat (the dp x cp groups do not split evenly over nodes of ranks_per_node={per_node})"
    if all(len(inter) == 1 for inter in halves[1]):
        return False, f"flat (each dp x cp group of {n} ranks is inside one node of ranks_per_node={per_node})"
    flat_s, hier_s = choose_hierarchical(topo.group(GRAD), topo.group(INTRA), topo.group(INTER), nbytes)
    choice = hier_s < flat_s
    return choice, (f"{'hierarchical' if choice else 'flat'} (one {nbytes / 2**20:g} MiB bucket: flat all-reduce "
                    f"{1e3 * flat_s:.2f} ms, intra-node reduce-scatter + inter-node all-reduce + intra-node "
                    f"all-gather {1e3 * hier_s:.2f} ms)")


def choose_hierarchical(flat_group, intra_group, inter_group, nbytes: int) -> tuple[float, float]:
    """Seconds of one bucket's flat all-reduce and of its hierarchical reduction (intra-node
    reduce-scatter, inter-node all-reduce of the shard, intra-node all-gather), the slowest rank
    of the job's (collective over the whole job). A sub-group of one rank costs nothing."""
    def timed(op, size, group):
        return 0.0 if group is None else time_collective(op, size, group, iters=3)
    intra_n = dist.get_world_size(intra_group) if intra_group is not None else 1
    times = torch.tensor([timed("all_reduce", nbytes, flat_group),
                          timed("reduce_scatter", nbytes, intra_group) + timed("all_reduce", nbytes // intra_n, inter_group)
                          + timed("all_gather", nbytes, intra_group)], dtype=torch.float64,
                         device=devices.collective_device())
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return times[0].item(), times[1].item()
