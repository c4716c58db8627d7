"""ZeRO's two flat collectives over the gradient group, without a scratch buffer of the bucket's size.

gloo (the CPU backend) stages reduce_scatter_tensor through a copy of the whole input and
all_gather_into_tensor through one of the whole output: one extra bucket per collective in
flight, which is what ZeRO's sharding was meant to save; and both are slower than the in-place
alternatives (16 MiB fp32, 2-core CPU: reduce-scatter 22.7 ms against an in-place all-reduce
16.4 ms on 2 ranks, 110 against 31 ms on 4; all-gather 12.3 against one in-place broadcast per
rank 7.4 ms on 2 ranks, 38 against 15 ms on 4). On gloo, then, a bucket's gradient is all-reduced
in place and this rank's shard sliced out of it (the full gradient is freed right after, so
overwriting it costs nothing), and the parameters are gathered with one broadcast per rank of
its own shard, in place. Other backends (NCCL) run the collectives as they are. The bytes
counted (dist/comm.py) are the same either way: the whole bucket.

Under hybrid ZeRO (topology.zero_groups) both run over the shard group; the bucket lifecycle
then sums a reduced shard over its replicas (the ranks that own the same shard in the other
blocks: lifecycle.GradSync._sum_over_replicas).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tetrad.dist.comm import Pending
from tetrad.dist.layout import GRAD


def scratch_free(topo, group: str = GRAD) -> bool:
    """Whether `group`'s backend stages flat collectives through a full-size scratch (gloo): then
    they are run in place as above. A group of one rank moves nothing."""
    pg = topo.comm.groups.group(group)
    return pg is not None and dist.get_backend(pg) == "gloo"


def start_reduce(topo, full: torch.Tensor, shard_size: int, scratch_free: bool, group: str = GRAD):
    """Start summing `full` over `group`; returns (the pending collective, where this rank's shard
    of the sum will be once it is done: a view of `full` when `scratch_free`)."""
    if scratch_free:
        lo = topo.local_rank(group) * shard_size
        first, out = topo.comm.all_reduce(full, group, async_op=True), full[lo:lo + shard_size]
    else:
        out = full.new_empty(shard_size)
        first = topo.comm.reduce_scatter(out, full, group, async_op=True)
    return first, out


def start_gather(topo, flat: torch.Tensor, shard_size: int, scratch_free: bool, group: str = GRAD) -> Pending:
    """Start gathering every rank's shard of `group` into `flat`, whose own shard (this rank's
    slice) holds this rank's values already."""
    comm, rank = topo.comm, topo.local_rank(group)
    if not scratch_free:
        return comm.all_gather(flat, flat[rank * shard_size:(rank + 1) * shard_size], group, async_op=True)
    return Pending([comm.broadcast(flat[k * shard_size:(k + 1) * shard_size], k, group, async_op=True)
                    for k in range(topo.size(group))])
