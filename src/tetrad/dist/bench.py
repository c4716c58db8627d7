"""`tetrad bench comm`: time each collective over group sizes and message sizes, report algorithm
and bus bandwidth (nccl-tests convention), and fit the alpha-beta link the planner uses.

tetrad/bench.py runs these over fresh local ranks and fits the planner's link to the rows.

Sizes follow tetrad.dist.comm's byte convention (all-reduce: the tensor; all-gather: the gathered
output; reduce-scatter and all-to-all: the input; send/recv: what a rank sends), which is also
nccl-tests' `size`. busbw = algbw x factor, so one number compares across group sizes:
2(n-1)/n for all-reduce, (n-1)/n for all-gather, reduce-scatter and all-to-all, 1 for send/recv.

The timed loops call torch.distributed directly: this measures the backend, not tetrad's
accounting around it.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from tetrad import device as devices
from tetrad.dist.comm import all_gather_single, reduce_scatter_single

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
DEFAULT_SIZES = (4 << 10, 64 << 10, 1 << 20, 16 << 20)
# Accelerator links reach their bus bandwidth only with large messages, as in nccl-tests' sweeps.
ACCELERATOR_SIZES = (64 << 10, 1 << 20, 16 << 20, 256 << 20, 1 << 30)


def bus_factor(op: str, n: int) -> float:
    return {"all_reduce": 2 * (n - 1) / n, "send_recv": 1.0}.get(op, (n - 1) / n)


def _iterations(nbytes: int) -> int:
    """Enough repetitions to average out jitter, few enough that 16 MB on 8 ranks stays short.
    Fixed by size, so every rank runs the same count."""
    return 20 if nbytes <= 64 << 10 else 10 if nbytes <= 1 << 20 else 4 if nbytes <= 64 << 20 else 2


def _collective(op: str, nbytes: int, group, dtype=torch.float32):
    """A closure that runs `op` once on a payload of `nbytes` (rounded to whole elements per rank)."""
    group = group or dist.group.WORLD
    n = dist.get_world_size(group)
    rank = dist.get_rank(group)
    elem = torch.empty((), dtype=dtype).element_size()
    count = max(n, nbytes // elem // n * n)
    device = devices.collective_device(group)
    full = torch.ones(count, dtype=dtype, device=device)
    shard = torch.ones(count // n, dtype=dtype, device=device)
    if op == "all_reduce":
        return lambda: dist.all_reduce(full, group=group)
    if op == "all_gather":
        return lambda: all_gather_single(full, shard, group=group)
    if op == "reduce_scatter":
        return lambda: reduce_scatter_single(shard, full, group=group)
    if op == "all_to_all":
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full, group=group)
    if op == "send_recv":  # a ring shift: every rank sends to the next and receives from the previous
        recv = torch.empty_like(full)
        peers = [dist.get_global_rank(group, (rank + d) % n) for d in (1, -1)]

        def shift():
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, full, peers[0], group),
                                             dist.P2POp(dist.irecv, recv, peers[1], group)]):
                w.wait()
        return shift
    raise ValueError(f"unknown collective {op!r}; known: {', '.join(OPS)}")


def time_collective(op: str, nbytes: int, group=None, iters: int | None = None) -> float:
    """Seconds per call, the slowest rank's mean over `iters` calls after one warm-up call.
    Every rank of `group` must call this with the same arguments."""
    run = _collective(op, nbytes, group)
    iters = iters or _iterations(nbytes)
    device = devices.collective_device(group)
    run()
    dist.barrier(group=group)
    devices.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        run()
    devices.synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - start) / iters], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
    return float(elapsed)


def bench_rank(ops=OPS, sizes=DEFAULT_SIZES) -> list[dict]:
    """Rows of one job (all its ranks form the group): one per (op, size)."""
    n = dist.get_world_size()
    rows = []
    for op in ops:
        for size in sizes:
            seconds = time_collective(op, size)
            algbw = size / seconds / 1e9
            rows.append({"op": op, "ranks": n, "bytes": size, "time_s": seconds,
                         "algbw_gbps": algbw, "busbw_gbps": algbw * bus_factor(op, n)})
    return rows
