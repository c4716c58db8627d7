"""Collectives with NCCL's timing of memory, for CPU tests (docs/design.md, "NCCL rules").

On gloo a non-blocking collective's background thread copies the input early and often writes
the result before the caller waits, so a missing or late `wait()`, or an input changed while
the collective runs, passes on gloo. On NCCL the collective runs on its communicator's stream,
reading the input and writing the output at some time the compute stream does not see until it
waits: such a program reads stale memory or sends changed values. `NcclCollectives` stands
where torch.distributed's collectives stand for tetrad's comm layer (`Comm.collectives`) and
makes that time the latest one, every time:

- a non-blocking collective runs the real gloo collective at its post, on private copies (so
  every rank issues its collectives on a group in the same order, as NCCL requires, and the
  host never blocks at a post), and fills what it will write with poison (NaN; the lowest
  integer, the highest for unsigned types): the output, and the input of an in-place
  all-reduce, reduce-scatter or non-root broadcast. An in-place all-gather's own chunk and a
  broadcast's root keep their values, as NCCL leaves them;
- it completes (the result written into the output, `is_completed()` True) only at its own
  `wait()`;
- there its input and output must hold what they held after the post (the poison included),
  untouched by any in-place op, and their storage must be where it was: else it raises naming
  the op and the group ("input modified while in flight", "output written while in flight",
  "... freed while in flight").
Blocking calls (async_op=False) run as torch.distributed runs them.

Why a program that is wrong on NCCL cannot pass here:
- NCCL may read the input and write the output anywhere between the post and the moment the
  compute stream waits for the collective. A read of the output before then may see anything:
  here it sees poison, which turns a loss or a parameter into NaN (a sentinel for integers).
  A write to the input or output before then may or may not be seen by NCCL: here it is an
  error at the wait, whatever NCCL would have done.
- The compute stream waits for a collective at its `wait()` or, on NCCL, also at the wait of
  a later collective on the same process group (one communicator, one stream, in issue order).
  Here only its own wait completes it: stricter than NCCL, and what torch.distributed's API
  promises (a program that counted on the later wait would break when that collective moved
  to another group). tetrad waits for each of its collectives itself: its layouts pass with
  or without the later waits counted.
- The caching allocator may reuse the memory of a tensor freed while in flight only when the
  program frees it itself (ProcessGroupNCCL keeps a collective's tensors alive until its wait):
  a storage released or moved by hand (ZeRO-3's `resize_(0)`) is caught.
- An in-place all-gather (the input at the output's own chunk) and a root's broadcast buffer
  are only read by NCCL: reading them in flight is right, so they are not poisoned.
- An in-place op is seen by torch's version counter, which all views of one base share: a
  write to another slice of the input's or output's base counts too, which NCCL would not
  mind (stricter; tetrad's layouts make none).
Left out: the collectives tetrad makes outside `Comm` (autotune's and the checkpoint's,
blocking, on their own groups); point-to-point, which tests/nccl_semantics.py models (the two
are installed side by side); and the values' own arithmetic (NCCL's reduction order differs
from gloo's only in rounding).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tetrad.dist.comm import TorchCollectives
from tetrad.train.trainer import Trainer


def poison(t: torch.Tensor) -> None:
    """What a collective's output holds before it completes."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        info = torch.iinfo(t.dtype)
        t.fill_(info.min if info.min < 0 else info.max)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


@dataclass
class _Watched:
    """A tensor the collective reads or writes, as the post left it."""

    role: str  # "input" or "output"
    tensor: torch.Tensor
    bits: torch.Tensor = field(init=False)
    where: tuple[int, int] = field(init=False)
    version: int = field(init=False)

    def __post_init__(self):
        self.bits, self.where, self.version = _bits(self.tensor).clone(), self._where(), self.tensor._version

    def _where(self) -> tuple[int, int]:
        t = self.tensor
        return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()

    def problem(self) -> str | None:
        if self._where() != self.where:
            return f"{self.role} freed while in flight"
        # Bits alone miss arithmetic on poison (NaN + x is NaN): an in-place op on the tensor
        # or on any view of its base counts too.
        if self.tensor._version != self.version or not torch.equal(_bits(self.tensor), self.bits):
            return f"{self.role} modified while in flight" if self.role == "input" else \
                f"{self.role} written while in flight"
        return None


class Flight:
    """A posted collective; what its post returns (Comm's Pending waits on it)."""

    def __init__(self, label: str, work, result: torch.Tensor, output: torch.Tensor, watched):
        self.label, self.work, self.result, self.output, self.watched = label, work, result, output, watched
        self.done = False

    def wait(self, timeout=None) -> bool:
        """Complete: check what the post left, then write the result."""
        if self.done:
            return True
        self.done = True
        self.work.wait()
        for w in self.watched:
            if (problem := w.problem()) is not None:
                raise RuntimeError(f"NCCL-semantics collectives, rank {dist.get_rank()}: {self.label}: {problem} "
                                   "(NCCL reads the input and writes the output on its own stream until the wait)")
        self.output.copy_(self.result)
        return True

    def is_completed(self) -> bool:
        return self.done


class NcclCollectives:
    """The collectives (see the module); counts the non-blocking ones posted, by op (`posted`)."""

    def __init__(self):
        self.posted: Counter = Counter()

    def _post(self, op: str, group: str, work, result, output, inputs, kept=()) -> Flight:
        """Poison `output`, give back the parts NCCL leaves as they are (`kept`: (view, values)),
        and watch the inputs and the output from here."""
        poison(output)
        for view, values in kept:
            view.copy_(values)
        watched = [_Watched("input", t) for t in inputs if t is not output] + [_Watched("output", output)]
        if any(t is output for t in inputs):
            watched[-1].role = "input"  # in place: the tensor is the input the program must leave alone
        self.posted[op] += 1
        return Flight(f"{op} on group {group!r}", work, result, output, watched)

    def all_reduce(self, tensor, op, pg, async_op: bool, group: str):
        if not async_op:
            return TorchCollectives.all_reduce(tensor, op, pg, False, group)
        private = tensor.clone()
        work = TorchCollectives.all_reduce(private, op, pg, True, group)
        return self._post("all_reduce", group, work, private, tensor, [tensor])

    def all_gather(self, output, tensor, pg, async_op: bool, group: str):
        if not async_op:
            return TorchCollectives.all_gather(output, tensor, pg, False, group)
        mine, result = tensor.clone(), torch.empty_like(output)
        work = TorchCollectives.all_gather(result, mine, pg, True, group)
        # In place (the input is the output's own chunk), that chunk keeps its values.
        return self._post("all_gather", group, work, result, output, [tensor], kept=[(tensor, mine)])

    def reduce_scatter(self, output, tensor, op, pg, async_op: bool, group: str):
        if not async_op:
            return TorchCollectives.reduce_scatter(output, tensor, op, pg, False, group)
        result = torch.empty_like(output)
        work = TorchCollectives.reduce_scatter(result, tensor.clone(), op, pg, True, group)
        return self._post("reduce_scatter", group, work, result, output, [tensor])

    def all_to_all(self, output, tensor, pg, async_op: bool, group: str, output_splits=None, input_splits=None):
        if not async_op:
            return TorchCollectives.all_to_all(output, tensor, pg, False, group, output_splits, input_splits)
        result = torch.empty_like(output)
        work = TorchCollectives.all_to_all(result, tensor.clone(), pg, True, group, output_splits, input_splits)
        return self._post("all_to_all", group, work, result, output, [tensor])

    def broadcast(self, tensor, src: int, pg, async_op: bool, group: str):
        if not async_op:
            return TorchCollectives.broadcast(tensor, src, pg, False, group)
        private = tensor.clone()
        work = TorchCollectives.broadcast(private, src, pg, True, group)
        kept = [(tensor, private.clone())] if dist.get_rank() == src else []  # the root's buffer is only read
        return self._post("broadcast", group, work, private, tensor, [tensor], kept=kept)


def zero_collectives_as_on_nccl(trainer: Trainer) -> None:
    """ZeRO's collectives as NCCL runs them (a reduce-scatter into a new shard, an all-gather in
    place), not gloo's in-place substitutes (parallel/data/collectives.py)."""
    for part in (trainer.grads.sync, trainer.grads.weights, trainer.grads.zero3):
        if part is not None:
            part.scratch_free = False


class NcclTrainer(Trainer):
    """A Trainer whose collectives run under the double, ZeRO's as NCCL runs them. Its last
    step's record lists the non-blocking collectives the double saw ("posted")."""

    def __init__(self, cfg, device):
        super().__init__(cfg, device)
        zero_collectives_as_on_nccl(self)
        self.topo.comm.collectives = NcclCollectives()

    def fit(self):
        history = super().fit()
        history[-1]["posted"] = set(self.topo.comm.collectives.posted)
        return history
