"""Run one rank's part of a pipeline schedule for one optimizer step.

The executor walks its rank's action list (schedules.py) in order. Before an action it receives
the values the action needs from the neighbouring ranks, after it sends what it made; the
transfers of one action go out as one batched non-blocking point-to-point operation, matched at
the other end by tag (`P2POp.tag`), and sends are never waited for before the next action runs
(the two conditions under which a schedule the validator accepts cannot hang). The receives
of the next action are posted before the current one computes, so transfers overlap compute. Each activation
is stashed from its F until its backward and freed right after; the gradient buckets of a
chunk reduce over dp × cp during that chunk's last backward of the step (data.py), once.

With pp = vpp = 1 the "schedule" is F, B per micro-batch with no transfers: the same loop is
the plain gradient-accumulation loop.

Zero-bubble halves: BI runs the backward with the linear layers' weight-gradient matmuls
queued instead of computed (model/tensor.py `_weight_grads`; the cheap gradients of norms and
embeddings are made at once), BW runs the queue and hands the results to autograd as the
weights' gradients, so BI + BW does the work of one B.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch

from tetrad.parallel.pipeline.schedules import P2POp, Schedule, Value, p2p_ops, stage_of


@dataclass
class ActionTime:
    """When one action ran on this rank, in seconds from the start of the step."""

    kind: str
    mb: int
    chunk: int
    start: float
    end: float


class PipelineExecutor:
    """Runs `schedule` on this pipeline rank for `model` (a PipelineStages)."""

    def __init__(self, model, schedule: Schedule, topo, reducer, activation_shape: tuple[int, ...],
                 activation_dtype: torch.dtype):
        self.model, self.schedule, self.topo, self.reducer = model, schedule, topo, reducer
        self.rank = topo.coords["pp"]
        self.plan = p2p_ops(schedule, self.rank)
        self.shape, self.dtype = activation_shape, activation_dtype
        # The action after which no more weight gradients of a chunk arrive this step: its
        # gradient buckets reduce during it.
        self.closing = {}
        for i, (a, _) in enumerate(self.plan):
            if a.kind in ("B", "BW"):
                self.closing[a.chunk] = i

    def _peer(self, op: P2POp) -> int:
        return self.topo.global_rank(pp=op.peer)

    def run(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor,
            loss_weight: float) -> tuple[torch.Tensor, list[ActionTime]]:
        """Forward and backward of every micro-batch ((inputs, labels), already this rank's
        sequence shard); each micro-batch's summed token loss is multiplied by `loss_weight`
        before backward. Returns this rank's summed token loss (zero off the last stage) and
        the time of each action."""
        s, m, comm = self.schedule, self.schedule.microbatches, self.topo.comm
        stages = s.stages
        loss_sum = torch.zeros((), device=self.topo.device)
        stash: dict[tuple[int, int], tuple] = {}  # (mb, chunk) -> (stage input, output[, output grad])
        sending: list[tuple] = []  # (pending send, the tensors it reads): kept alive until done
        times: list[ActionTime] = []
        origin = time.perf_counter()
        incoming = self._post_receives(0, m)
        for i, (a, ops) in enumerate(self.plan):
            pending, received = incoming
            pending.wait()
            # The next action's inputs arrive while this one computes.
            incoming = self._post_receives(i + 1, m)
            start = time.perf_counter()
            g = stage_of(self.rank, a.chunk, s.pp)
            made = None
            closing = self.reducer.last_microbatch() if self.closing.get(a.chunk) == i else contextlib.nullcontext()
            if a.kind == "F":
                inputs, labels = microbatches[a.mb]
                x = inputs if g == 0 else received[Value("act", g - 1, a.mb)].requires_grad_()
                last = g == stages - 1
                out = self.model(x, positions, labels if last else None, chunk=a.chunk)
                if last:
                    loss_sum += out.detach()
                    out = out * loss_weight
                stash[(a.mb, a.chunk)] = (x if g > 0 else None, out)
                made = None if last else out.detach()
            elif a.kind == "B":
                x, out = stash.pop((a.mb, a.chunk))
                grad = received.get(Value("grad", g + 1, a.mb))
                with closing:
                    torch.autograd.backward(out, grad)
                made = x.grad if x is not None else None
            elif a.kind == "BI":
                x, out = stash.pop((a.mb, a.chunk))
                grad = received.get(Value("grad", g + 1, a.mb))
                self.topo.deferred_weight_grads = deferred = []
                try:
                    torch.autograd.backward(out, grad)
                finally:
                    self.topo.deferred_weight_grads = None
                made = x.grad if x is not None else None
                stash[(a.mb, a.chunk)] = deferred
            else:  # BW: the weight-gradient matmuls BI queued, accumulated as autograd would
                weights, grads = [], []
                for ws, compute in stash.pop((a.mb, a.chunk)):
                    weights += ws
                    grads += compute()
                with closing:
                    torch.autograd.backward(weights, grads)
            times.append(ActionTime(a.kind, a.mb, a.chunk, start - origin, time.perf_counter() - origin))
            sends = [op for op in ops if op.op == "send"]
            if sends:
                made = made.contiguous()
                sending.append((comm.p2p([(made, self._peer(op)) for op in sends], [], "pp",
                                         send_tags=[op.tag(m) for op in sends]), made))
            sending = [entry for entry in sending if not entry[0].is_completed()]
        for pending, _ in sending:
            pending.wait()
        return loss_sum, times

    def _post_receives(self, i: int, m: int) -> tuple:
        """Start receiving what action `i` needs: (pending, value -> buffer)."""
        recvs = [op for op in self.plan[i][1] if op.op == "recv"] if i < len(self.plan) else []
        buffers = {op.value: torch.empty(self.shape, dtype=self.dtype, device=self.topo.device) for op in recvs}
        pending = self.topo.comm.p2p([], [(buffers[op.value], self._peer(op)) for op in recvs], "pp",
                                     recv_tags=[op.tag(m) for op in recvs])
        return pending, buffers
