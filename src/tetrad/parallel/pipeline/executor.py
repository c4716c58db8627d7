"""Run one rank's part of a pipeline schedule for one optimizer step.

The executor walks its rank's action list (schedules.py) in order. Before an action it takes
the values the action needs from the neighbouring ranks; after it, it sends what it made. Sends
are never waited for before the next action runs, and each link's transfers are posted in
`link_order`, the same order at both ends, as NCCL needs (it matches point-to-point by order,
not tag; gloo matches the tags the executor also sets): the two conditions under which a
schedule the validator accepts cannot hang. Receives are posted as early as that order allows,
so transfers overlap compute. Each activation is stashed from its F until its backward and
freed right after; the gradient buckets of a chunk reduce over dp × cp during that chunk's last
backward of the step (data.py), once.

Each link (pair of pipeline ranks, interleaving's wrap-around from the last rank to the first
included) has a process group of its own (dist/topology.py `link_name`, made with the others
from `pipeline_links`), so a communicator of its own. NCCL runs a communicator's operations in
posting order on one stream: on one shared pipeline group, a receive posted early from one
neighbour blocks every later transfer to the other, and interleaved schedules deadlock
(tests/test_nccl_semantics.py). On its own communicator, a link's queue holds only that link's
transfers, in the order both ends agree on.

With pp = vpp = 1 the "schedule" is F, B per micro-batch with no transfers: the same loop is
the plain gradient-accumulation loop.

Zero-bubble halves: BI runs the backward with the linear layers' weight-gradient matmuls
queued instead of computed (model/execution.py `DeferredWeightGrads`; the cheap gradients of norms and
embeddings are made at once, and the head's, whose queue entry would keep the vocabulary-sized
logits' gradient alive until BW), BW runs the queue outside autograd and lands each result in
the reducer's bucket (model/execution.py's GRAD_LANDING), so BI + BW does the work of one B.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from tetrad.dist.topology import link_name
from tetrad.parallel.pipeline.schedules import P2POp, Schedule, Value, link_order, p2p_ops, stage_of


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
        # Each neighbour's transfers, sends and receives, in the order both ends post them.
        ops = {(op.value, op.op): op for _, action_ops in self.plan for op in action_ops}
        self.links = {}
        for (a, b), values in link_order(schedule).items():
            if self.rank in (a, b):
                peer = b if self.rank == a else a
                self.links[peer] = [ops.get((v, "send")) or ops[(v, "recv")] for v in values]
                if topo.size(link_name(a, b)) != 2:
                    raise ValueError(f"the topology has no group for pipeline link {link_name(a, b)}: create it "
                                     "with Topology(..., pipeline_links=sorted(link_order(schedule)))")
        self.shape, self.dtype = activation_shape, activation_dtype
        # The action after which no more weight gradients of a chunk arrive this step: its
        # gradient buckets reduce during it.
        self.closing = {}
        for i, (a, _) in enumerate(self.plan):
            if a.kind in ("B", "BW"):
                self.closing[a.chunk] = i
        self.marks: list = []  # the last run's clock marks: its start, then each action's start and end

    def run(self, microbatches: list[tuple], loss_weight: float) -> torch.Tensor:
        """Forward and backward of every micro-batch ((inputs, labels), already this rank's
        sequence shard, the whole window's document ids or None: every stage masks with them,
        and the shard's positions); each micro-batch's summed token loss is multiplied by
        `loss_weight` before backward. Returns this rank's summed token loss (zero off the last stage)."""
        s = self.schedule
        stages = s.stages
        loss_sum = torch.zeros((), device=self.topo.device)
        stash: dict[tuple[int, int], tuple] = {}  # (mb, chunk) -> (stage input, output), or BI's queue
        links = _Transfers(self)
        clock = self.topo.comm.clock
        self.marks = [clock.mark()]
        for i, (a, ops) in enumerate(self.plan):
            received = {op.value: links.receive(op) for op in ops if op.op == "recv"}
            self.marks.append(clock.mark())
            g = stage_of(self.rank, a.chunk, s.pp)
            made = None
            closing = self.reducer.last_microbatch() if self.closing.get(a.chunk) == i else contextlib.nullcontext()
            if a.kind == "F":
                inputs, labels, docs, positions = microbatches[a.mb]
                x = inputs if g == 0 else received[Value("act", g - 1, a.mb)].requires_grad_()
                last = g == stages - 1
                out = self.model(x, positions, labels if last else None, chunk=a.chunk, docs=docs)
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
                stash[(a.mb, a.chunk)] = self._input_gradients(out, received.get(Value("grad", g + 1, a.mb)))
                made = x.grad if x is not None else None
            else:  # BW: the weight-gradient matmuls BI queued
                with closing:
                    self.model.execution.weight_grads.apply(stash.pop((a.mb, a.chunk)))
            self.marks.append(clock.mark())
            for op in ops:
                if op.op == "send":
                    links.send(op, made.contiguous())
        links.finish()
        return loss_sum

    def timeline(self) -> list[ActionTime]:
        """When each action of the last run computed, on the device's clock (after its waits for
        received values); read after the step has synchronised."""
        clock, (origin, *marks) = self.topo.comm.clock, self.marks
        return [ActionTime(a.kind, a.mb, a.chunk, clock.seconds(origin, start), clock.seconds(origin, end))
                for (a, _), start, end in zip(self.plan, marks[::2], marks[1::2])]


    def _input_gradients(self, out: torch.Tensor, grad: torch.Tensor | None) -> list:
        """BI: the backward of `out` without the weight gradients; returns their queue for BW.
        (A function of its own, so that no local name keeps a queue, and the layer inputs and
        output gradients it holds, alive after its BW.)"""
        with self.model.execution.weight_grads.collecting() as queue:
            torch.autograd.backward(out, grad)
        return queue


class _Transfers:
    """One step's point-to-point transfers of a pipeline rank, posted link by link in
    `link_order` (the order the other end posts them in too), each as soon as it can be: a
    receive at once (so the value arrives while earlier actions compute), a send once its value
    is made. Waiting for a received value therefore never waits on a transfer not yet posted."""

    def __init__(self, executor: PipelineExecutor):
        self.ex = executor
        self.m = executor.schedule.microbatches
        self.queues = executor.links  # peer pipeline rank -> [P2POp] in link order
        self.next = dict.fromkeys(self.queues, 0)
        self.made: dict[Value, torch.Tensor] = {}  # sends whose value exists, not yet posted
        self.inbox: dict[Value, tuple] = {}  # posted receives: value -> (buffer, pending)
        self.sending: list[tuple] = []  # (pending send, its tensor): kept alive until done
        for peer in self.queues:
            self._post(peer)

    def _post(self, peer: int) -> None:
        """Post this link's transfers in order, as far as their values allow."""
        queue, comm, rank = self.queues[peer], self.ex.topo.comm, self.ex.topo.global_rank(pp=peer)
        link = link_name(self.ex.rank, peer)
        while self.next[peer] < len(queue):
            op = queue[self.next[peer]]
            if op.op == "send":
                if op.value not in self.made:
                    return
                tensor = self.made.pop(op.value)
                self.sending.append((comm.p2p([(tensor, rank)], [], link, send_tags=[op.tag(self.m)]), tensor))
            else:
                buffer = torch.empty(self.ex.shape, dtype=self.ex.dtype, device=self.ex.topo.device)
                self.inbox[op.value] = buffer, comm.p2p([], [(buffer, rank)], link, recv_tags=[op.tag(self.m)])
            self.next[peer] += 1
        self.sending = [entry for entry in self.sending if not entry[0].is_completed()]

    def receive(self, op: P2POp) -> torch.Tensor:
        """The value `op` receives, once it has arrived (the wait is charged to "pp")."""
        buffer, pending = self.inbox.pop(op.value)
        pending.wait()
        return buffer

    def send(self, op: P2POp, tensor: torch.Tensor) -> None:
        self.made[op.value] = tensor
        self._post(op.peer)

    def finish(self) -> None:
        for peer in self.queues:
            self._post(peer)
        assert not self.made and not self.inbox, "a transfer of the schedule was never posted or used"
        for pending, _ in self.sending:
            pending.wait()
