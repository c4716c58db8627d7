"""Checkpoints written while training goes on (`checkpoint.async_save`, Megatron-LM's
--async-save, torchtitan's async mode).

The rank's state is copied into CPU memory while the step waits (the only cost on the step), then
DCP's `async_save` writes it from a thread, and another hashes the rank's share of the files. The
publish protocol (package docstring) is unchanged: the folder stays `.partial` until every rank's
files are written and hashed, then rank 0 publishes. The ranks agree that every write is done at the end of a step (`done`, one
all-reduce of two numbers while a write is pending), so a kill during the write leaves the
previous checkpoint the newest published one. One write is in flight at a time: a save due
before the last is published waits for it.

DCP coordinates the ranks' writes with collectives from its thread, so they run on a gloo group
of their own; the all-reduce that asks whether every rank is done runs on another, from the main
thread, and never meets them.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager

from tetrad.train.checkpoint.store import digest_share


@dataclass
class Write:
    """A checkpoint being written: its step, its `.partial` folder, and the future of the write
    then of this rank's share of the hashes (store.digest_share), whose result is that share."""

    step: int
    tmp: Path
    future: Future


class BackgroundWrites:
    """This rank's checkpoint writes in flight (at most one); every method is collective."""

    def __init__(self, rank: int, world: int, distributed: bool):
        self.rank, self.world = rank, world
        self.writing_group = dist.new_group(backend="gloo") if distributed else None
        self.asking_group = dist.new_group(backend="gloo") if distributed else None
        self.hashing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tetrad-checkpoint-hash")
        self.pending: Write | None = None

    def start(self, step: int, tmp: Path, state: dict) -> None:
        """Write `state`, copies in CPU memory that training cannot change, into `tmp` from a
        thread, then hash this rank's share of the files from another."""
        written = dcp.async_save(state, storage_writer=FileSystemWriter(tmp), process_group=self.writing_group,
                                 no_dist=self.writing_group is None, async_stager=_AlreadyStaged())
        self.pending = Write(step, tmp, self.hashing.submit(self._hash_when_written, written, tmp))

    def _hash_when_written(self, written: Future, tmp: Path) -> dict:
        """DCP's write ends with a collective over every rank's (its metadata file is written by
        then): when this rank's is done, every file is, and its share can be hashed."""
        written.result()
        return digest_share(tmp, self.rank, self.world)

    def done(self, wait: bool) -> tuple[Write | None, str | None]:
        """(the pending write, None) once every rank's has finished, (None, None) while some rank's
        is still writing; `wait`: until they have. A write that failed on any rank: (the write,
        "rank R: the error") on every rank."""
        if self.pending is None:
            return None, None
        if wait:
            self.pending.future.exception()  # blocks until the thread is done
        finished = self.pending.future.done()
        error = self.pending.future.exception() if finished else None
        flags = torch.tensor([float(not finished), float(error is not None)])
        if self.asking_group is not None:
            dist.all_reduce(flags, group=self.asking_group)
        if flags[0] > 0:
            return None, None
        write, self.pending = self.pending, None
        if flags[1] == 0:
            return write, None
        mine = None if error is None else cause(error) if isinstance(error, CheckpointException) else \
            f"rank {dist.get_rank() if self.asking_group is not None else 0}: {cause(error)}"  # DCP's names its ranks
        reasons = [mine]
        if self.asking_group is not None:
            reasons = [None] * dist.get_world_size()
            dist.all_gather_object(reasons, mine, group=self.asking_group)
        return write, next(why for why in reasons if why is not None)


class _AlreadyStaged(AsyncStager):
    """The state comes staged (Checkpointer._saved_state with copy=True): DCP's own stager copies
    tensor by tensor and cannot copy a rank's logical tensors, DTensors of several boxes."""

    _synchronize_after_execute = False

    def stage(self, state_dict):
        return state_dict


def cause(error: BaseException) -> str:
    """The cause in a few words: DCP's CheckpointException carries each failed rank's exception."""
    if isinstance(error, CheckpointException):
        return "; ".join(f"rank {rank}: {cause(exc)}" for rank, (exc, _) in sorted(error.failures.items()))
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"
