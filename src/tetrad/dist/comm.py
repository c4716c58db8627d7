"""Every collective tetrad issues goes through `Comm`, which counts calls, bytes and time per
(op, group). The step report shows these counts and the planner predicts the same numbers.

Byte convention (per rank, the op's logical payload): all_reduce the tensor; all_gather the
gathered output; reduce_scatter the unscattered input; all_to_all the input; point-to-point the
bytes this rank sends (receives are not counted, so a transfer is counted once). Time is the
time the rank's device spent inside a blocking call, or inside `wait()` of a non-blocking one:
the part of the communication that was not hidden behind compute. It is read between two marks
of the device's clock (device.py: host time on CPU, stream events on accelerators, where the
host only enqueues), after the step has synchronised.

A group of one rank is a no-op and is not counted, so model code is the same at every size.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

from tetrad import device as devices
from tetrad.dist import watchdog


class Groups(Protocol):
    """What Comm needs of the named groups (dist/topology.py's Topology provides it)."""

    def group(self, name: str) -> dist.ProcessGroup | None:
        """The process group called `name`; None when it has one rank (nothing to send)."""

    def reported(self, name: str) -> str:
        """The key its traffic is counted under (docs/design.md: comm_bytes by tp, cp, pp, dp)."""


@dataclass
class OpStats:
    calls: int = 0
    bytes: int = 0


class Pending:
    """A non-blocking collective; `wait()` charges the time spent blocked to its group (`blocked`)
    and turns a timeout into an error naming the op, group and missing ranks (`watch`, see
    watchdog.py)."""

    def __init__(self, works, blocked=None, watch=None, name: str = ""):
        self._works = works if isinstance(works, list) else [works]
        self._name = f"{name} wait"
        self._blocked = blocked
        self._watch = watch

    def wait(self) -> None:
        with self._blocked() if self._blocked else contextlib.nullcontext():
            for work in self._works:
                if work is not None:
                    with self._watch() if self._watch else contextlib.nullcontext(), _annotated(self._name):
                        work.wait()

    def is_completed(self) -> bool:
        """Whether every part has finished, without waiting."""
        return all(work is None or work.is_completed() for work in self._works)


DONE = Pending([], None)


class Comm:
    """Accounted collectives over named groups, which `groups` looks up (it knows nothing of the
    layout: dist/topology.py creates the groups and hands itself in as the lookup)."""

    def __init__(self, groups: Groups, device: torch.device):
        self.groups, self.device = groups, device
        self.stats: dict[tuple[str, str], OpStats] = defaultdict(OpStats)
        # Where time is read (device.py), and this step's time blocked: (reported group, start, end) marks.
        self.clock = devices.clock(device)
        self.spans: list[tuple] = []
        self.calls: dict[str, int] = defaultdict(int)  # collectives per group, never reset: equal on all members
        # What posts point-to-point and returns its works: torch.distributed, or a transport that
        # models another backend's semantics on CPU (tests/nccl_semantics.py).
        self.transport = dist
        # What runs the collectives: torch.distributed's, or a double that models another
        # backend's semantics on CPU (tests/nccl_collectives.py).
        self.collectives = TorchCollectives()

    @contextlib.contextmanager
    def _watch(self, op: str, group: str, call: int | None):
        """Re-raise a timeout inside the block as a CollectiveTimeout naming who did not arrive."""
        try:
            yield
        except RuntimeError as e:
            if not watchdog.is_timeout(e):
                raise
            pg = self.groups.group(group)
            timeout = pg._get_backend(self.device).options._timeout.total_seconds()
            raise watchdog.explain(op, group, call, pg, e, timeout) from None

    # ------------------------------------------------------------------ accounting
    def _count(self, op: str, group: str, nbytes: int) -> None:
        entry = self.stats[(op, self.groups.reported(group))]
        entry.calls += 1
        entry.bytes += nbytes

    @contextlib.contextmanager
    def _blocked(self, group: str):
        """Charge the time inside the block to `group`."""
        start = self.clock.mark()
        try:
            yield
        finally:
            self.spans.append((self.groups.reported(group), start, self.clock.mark()))

    def _run(self, op: str, group: str, nbytes: int, fn, async_op: bool):
        self._count(op, group, nbytes)
        self.calls[group] += 1
        call = self.calls[group]
        with self._blocked(group), self._watch(op, group, call), _annotated(f"{group}:{op}"):
            work = fn()
        return Pending(work, lambda: self._blocked(group), lambda: self._watch(op, group, call),
                       f"{group}:{op}") if async_op else DONE

    def bytes_by_group(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for (_, group), s in self.stats.items():
            out[group] += s.bytes
        return dict(out)

    def seconds_by_group(self, spans: list[tuple] | None = None) -> dict[str, float]:
        """Time blocked per group, over this step's spans or the given slice of them; on an
        accelerator only once the step has synchronised."""
        out: dict[str, float] = defaultdict(float)
        for group, start, end in self.spans if spans is None else spans:
            out[group] += self.clock.seconds(start, end)
        return dict(out)

    def reset(self) -> None:
        self.stats.clear()
        self.spans.clear()

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, group: str, op=dist.ReduceOp.SUM, async_op: bool = False):
        pg = self.groups.group(group)
        if pg is None:
            return DONE
        return self._run("all_reduce", group, _nbytes(tensor),
                         lambda: self.collectives.all_reduce(tensor, op, pg, async_op, group), async_op)

    def all_gather(self, output: torch.Tensor, tensor: torch.Tensor, group: str, async_op: bool = False):
        """Concatenate every rank's `tensor` along dim 0 into `output`."""
        pg = self.groups.group(group)
        if pg is None:
            output.copy_(tensor)
            return DONE
        return self._run("all_gather", group, _nbytes(output),
                         lambda: self.collectives.all_gather(output, tensor, pg, async_op, group),
                         async_op)

    def reduce_scatter(self, output: torch.Tensor, tensor: torch.Tensor, group: str,
                       op=dist.ReduceOp.SUM, async_op: bool = False):
        """Sum `tensor` over the group and keep this rank's dim-0 slice in `output`."""
        pg = self.groups.group(group)
        if pg is None:
            output.copy_(tensor)
            return DONE
        return self._run("reduce_scatter", group, _nbytes(tensor),
                         lambda: self.collectives.reduce_scatter(output, tensor, op, pg, async_op, group),
                         async_op)

    def all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, group: str, async_op: bool = False,
                   output_splits: list[int] | None = None, input_splits: list[int] | None = None):
        """Dim-0 splits of `tensor` to each rank of the group, received into `output`: equal ones,
        or `input_splits[r]` rows to rank r and `output_splits[r]` rows from it (uneven: the
        experts' tokens, model/moe.py)."""
        pg = self.groups.group(group)
        if pg is None:
            output.copy_(tensor)
            return DONE
        return self._run("all_to_all", group, _nbytes(tensor),
                         lambda: self.collectives.all_to_all(output, tensor, pg, async_op, group, output_splits,
                                                             input_splits), async_op)

    def broadcast(self, tensor: torch.Tensor, src_local: int, group: str, async_op: bool = False):
        """Broadcast from the group's local rank `src_local`."""
        pg = self.groups.group(group)
        if pg is None:
            return DONE
        src = dist.get_global_rank(pg, src_local)
        return self._run("broadcast", group, _nbytes(tensor),
                         lambda: self.collectives.broadcast(tensor, src, pg, async_op, group), async_op)

    def p2p(self, sends: list[tuple[torch.Tensor, int]], recvs: list[tuple[torch.Tensor, int]],
            group: str, send_tags: list[int] | None = None, recv_tags: list[int] | None = None) -> Pending:
        """Start sends and receives (tensor, global peer rank) together as one batched, non-blocking
        operation; only the sent bytes are counted. Tags (default 0) match a send to its receive
        when a link carries several transfers at once (the pipeline executor)."""
        pg = self.groups.group(group)
        send_tags, recv_tags = send_tags or [0] * len(sends), recv_tags or [0] * len(recvs)
        ops = [dist.P2POp(dist.isend, t, peer, pg, tag) for (t, peer), tag in zip(sends, send_tags)]
        ops += [dist.P2POp(dist.irecv, t, peer, pg, tag) for (t, peer), tag in zip(recvs, recv_tags)]
        if not ops:
            return DONE
        self._count("send_recv", group, sum(_nbytes(t) for t, _ in sends))
        with self._blocked(group), _annotated(f"{group}:send_recv"):
            works = self.transport.batch_isend_irecv(ops)
        # Point-to-point involves only some ranks of the group: no common call number.
        return Pending(works, lambda: self._blocked(group), lambda: self._watch("send_recv", group, None),
                       f"{group}:send_recv")


class TorchCollectives:
    """Comm's collectives as torch.distributed runs them (`Comm.collectives`); `pg` the process
    group, `group` its name in tetrad (unused here: for a double's messages)."""

    @staticmethod
    def all_reduce(tensor, op, pg, async_op: bool, group: str):
        return dist.all_reduce(tensor, op=op, group=pg, async_op=async_op)

    @staticmethod
    def all_gather(output, tensor, pg, async_op: bool, group: str):
        return all_gather_single(output, tensor, group=pg, async_op=async_op)

    @staticmethod
    def reduce_scatter(output, tensor, op, pg, async_op: bool, group: str):
        return reduce_scatter_single(output, tensor, op=op, group=pg, async_op=async_op)

    @staticmethod
    def all_to_all(output, tensor, pg, async_op: bool, group: str, output_splits=None, input_splits=None):
        return dist.all_to_all_single(output, tensor, output_splits, input_splits, group=pg, async_op=async_op)

    @staticmethod
    def broadcast(tensor, src: int, pg, async_op: bool, group: str):
        """`src`: the global rank."""
        return dist.broadcast(tensor, src=src, group=pg, async_op=async_op)


def _annotated(name: str):
    """A torch.profiler range named "group:op" (e.g. "dp_cp:all_reduce", "tp:all_reduce wait"), so a
    trace shows which group each gloo/nccl call belongs to. Only while a profiler records: the
    range costs ~7 us even when nothing records, against ~0.1 us for the check."""
    return torch.profiler.record_function(name) if torch.autograd.profiler._is_profiler_enabled \
        else contextlib.nullcontext()


# torch 2.13 renamed the flat-tensor collectives (the old names warn); clusters may bring an older
# torch (the H200 of docs/gpu.md ran 2.11, which has only the old names). Call them through these.
all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
