"""A point-to-point transport with NCCL's ordering, for CPU tests (docs/design.md, "NCCL rules").

gloo runs every send and receive on its own and matches them by tag, so an ordering that hangs
or serialises NCCL passes on gloo. `NcclSemantics` stands where torch.distributed's point-to-point
calls stand for tetrad's comm layer (`Comm.transport`: `batch_isend_irecv`, and the `wait()` /
`is_completed()` of the works it returns) and runs them the way ProcessGroupNCCL does:

- one in-order queue per communicator, executed by one worker thread (a communicator's stream):
  an item starts only once the item before it has completed;
- a `batch_isend_irecv` call is one item on its group's single communicator (the group's own,
  as ProcessGroupNCCL picks for coalesced point-to-point), its ops running together
  (ncclGroupStart/End) and completing together; a plain `isend`/`irecv` is one item on a
  communicator of its own per peer pair;
- tags are ignored: the k-th send from A to B on a communicator meets the k-th receive from A
  at B on that communicator, whatever their tags (a mismatch shows as wrong values or sizes);
- a send completes only once its receiver's item runs (rendezvous), and a receive once the data
  is in;
- the host posts without blocking, and `wait()` blocks the host until the item has completed.

Why a schedule that would hang on NCCL cannot pass here: every ordering edge NCCL has, this
model has too, and the edges it adds only make it stricter. (Serialisation shows only as time,
which the tests do not assert.)
- The host thread is the compute stream: its actions run in program order, as the kernels do.
- NCCL makes an op posted to a communicator wait for the compute stream up to its posting;
  here the host posts an op only after the work before it has run: the same edge.
- `work.wait()` on NCCL makes the compute stream wait for the work; everything the host does
  afterwards is either compute (on that stream) or a post (which waits for that stream), so
  all of it depends on the work in both models. Blocking the host there adds no edge the
  stream dependency does not imply; it only removes the host's run-ahead, which changes when
  work is enqueued, never what waits on what.
- A communicator's stream runs its items in issue order: the worker does the same.
- A send that fits NCCL's connection buffer (a few MiB) may complete before its receiver
  runs; a larger one may not. The rendezvous here is the second case at every size: an edge
  NCCL has only for large messages, so a superset, and tetrad must be right at every size.
Left out: collectives do not go through the queues (tetrad posts a group's collectives after
its point-to-point has been waited for, and a pipeline link carries no collectives; their own
timing of memory is tests/nccl_collectives.py's, installed beside this one); and a
communicator's lazy initialisation, which blocks the host at a communicator's first use until
every member uses it (both launch paths, tetrad's own and torchrun's, bind `device_id`, so NCCL
makes communicators when the groups are created).

Data moves over one dedicated gloo group, with a pair of tags per communicator (data, and
the receiver's ready signal that makes a send a rendezvous), so that gloo's per-(peer, tag)
order is the communicator's order. A worker that waits longer than `timeout_s` fails its item
and every item behind it, naming what its queue was blocked on: a deadlock fails the test
rather than hanging it.
"""

from __future__ import annotations

import datetime
import queue
import threading
import zlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class _Op:
    send: bool
    tensor: torch.Tensor
    peer: int  # global rank


@dataclass
class _Item:
    """One queue item: ops that run together and complete together."""

    ops: list[_Op]
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def __str__(self) -> str:
        return ", ".join(f"{'send to' if op.send else 'recv from'} rank {op.peer} {tuple(op.tensor.shape)}"
                         for op in self.ops)


class Work:
    """What a post returns: `wait()` blocks the host until the item completed (see the module)."""

    def __init__(self, item: _Item, comm: "_Communicator"):
        self._item, self._comm = item, comm

    def wait(self, timeout=None) -> bool:
        self._item.done.wait()
        if self._item.error is not None:
            raise RuntimeError(f"NCCL-semantics transport, rank {dist.get_rank()}: {self._item} on "
                               f"communicator {self._comm.key} failed: {self._item.error}")
        return True

    def is_completed(self) -> bool:
        return self._item.done.is_set()


class _Communicator:
    """One communicator: a queue and the worker thread that runs its items strictly in order."""

    def __init__(self, key: str, wire, timeout_s: float):
        self.key, self.wire, self.timeout = key, wire, datetime.timedelta(seconds=timeout_s)
        base = zlib.crc32(key.encode()) & 0x3FFFFFFF
        self.data_tag, self.ready_tag = 2 * base, 2 * base + 1
        self.items: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._work, name=f"nccl-semantics {key}", daemon=True)
        self.thread.start()

    def post(self, ops: list[_Op]) -> Work:
        item = _Item(ops)
        self.items.put(item)
        return Work(item, self)

    def _work(self) -> None:
        failure = None
        while (item := self.items.get()) is not None:
            if failure is None:
                try:
                    self._run(item)
                except RuntimeError:  # gloo's timeout: this queue is stuck on `item`
                    failure = RuntimeError(f"its queue was blocked for {self.timeout.total_seconds():.0f} s "
                                           f"on [{item}]: a deadlock under NCCL's ordering")
            item.error = failure
            item.done.set()

    def _run(self, item: _Item) -> None:
        """Run the item's ops together; a send waits for its receiver's ready signal first."""
        waits, sends = [], []
        for op in item.ops:
            signal = torch.zeros(1)
            if op.send:
                sends.append((op, signal, dist.irecv(signal, op.peer, group=self.wire, tag=self.ready_tag)))
            else:
                waits.append(dist.isend(signal, op.peer, group=self.wire, tag=self.ready_tag))
                waits.append(dist.irecv(op.tensor, op.peer, group=self.wire, tag=self.data_tag))
        for op, _, ready in sends:
            ready.wait(self.timeout)
            waits.append(dist.isend(op.tensor, op.peer, group=self.wire, tag=self.data_tag))
        for work in waits:
            work.wait(self.timeout)

    def close(self) -> None:
        self.items.put(None)
        self.thread.join()


class NcclSemantics:
    """The transport (see the module). Create it on every rank at the same point: it makes its
    dedicated gloo group there, a collective over the whole job."""

    def __init__(self, timeout_s: float = 20.0):
        self.timeout_s = timeout_s
        self.wire = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        self.communicators: dict[str, _Communicator] = {}
        self.tags: dict[int, str] = {}

    def _communicator(self, group, pair: tuple[int, int] | None) -> _Communicator:
        group = group or dist.group.WORLD
        key = group.group_name if pair is None else f"{group.group_name}:{pair[0]}-{pair[1]}"
        if key not in self.communicators:
            comm = _Communicator(key, self.wire, self.timeout_s)
            if self.tags.setdefault(comm.data_tag, key) != key:
                raise ValueError(f"communicators {key} and {self.tags[comm.data_tag]} share a tag")
            self.communicators[key] = comm
        return self.communicators[key]

    def batch_isend_irecv(self, p2p_ops: list[dist.P2POp]) -> list[Work]:
        """One item on the group's communicator; tags ignored."""
        group = p2p_ops[0].group
        ops = [_Op(op.op is dist.isend, op.tensor, op.peer) for op in p2p_ops]
        return [self._communicator(group, None).post(ops)]

    def isend(self, tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> Work:
        """One item on the communicator of this rank and `dst`; the tag is ignored."""
        pair = tuple(sorted((dist.get_rank(), dst)))
        return self._communicator(group, pair).post([_Op(True, tensor, dst)])

    def irecv(self, tensor: torch.Tensor, src: int, group=None, tag: int = 0) -> Work:
        pair = tuple(sorted((dist.get_rank(), src)))
        return self._communicator(group, pair).post([_Op(False, tensor, src)])

    def close(self) -> None:
        for comm in self.communicators.values():
            comm.close()
