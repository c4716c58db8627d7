"""Data parallelism: gradients summed over the dp x cp group once per optimizer step.

CP ranks hold the same weights as their DP peers, so both dimensions reduce together. The loss
each micro-batch backpropagates is already divided by the global token count, so a SUM gives
exactly the single-device gradient.
"""

from __future__ import annotations

import torch


class GradReducer:
    """Reduces the gradients of `params` over dp x cp after the last micro-batch's backward."""

    def __init__(self, params: list[torch.nn.Parameter], topo):
        self.params = params
        self.topo = topo

    def reduce(self) -> None:
        if self.topo.size("dp_cp") == 1:
            return
        pending = [self.topo.comm.all_reduce(p.grad, "dp_cp", async_op=True) for p in self.params if p.grad is not None]
        for work in pending:
            work.wait()
