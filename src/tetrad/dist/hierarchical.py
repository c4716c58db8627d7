"""Hierarchical all-reduce over dp x cp: reduce-scatter inside the node, all-reduce of the shard
between nodes, all-gather inside the node. Each rank sends only 1/k of the bucket over the slow
inter-node links (k = dp x cp ranks per node); the result is the same sum, in another order.
"""

from __future__ import annotations

import torch

from tetrad.dist.topology import INTER, INTRA


class HierarchicalPending:
    """The intra-node reduce-scatter runs non-blocking; wait() finishes the other two phases."""

    def __init__(self, comm, flat: torch.Tensor, shard: torch.Tensor, first):
        self._comm, self._flat, self._shard, self._first = comm, flat, shard, first

    def wait(self) -> None:
        self._first.wait()
        self._comm.all_reduce(self._shard, INTER)
        self._comm.all_gather(self._flat, self._shard, INTRA)


def all_reduce(flat: torch.Tensor, topo) -> HierarchicalPending:
    """Start the hierarchical SUM of `flat` (its length divisible by the intra-node group size)
    over the topology's per-node halves of dp x cp."""
    shard = flat.new_empty(flat.numel() // topo.size(INTRA))
    first = topo.comm.reduce_scatter(shard, flat, INTRA, async_op=True)
    return HierarchicalPending(topo.comm, flat, shard, first)
