"""Stopping on a signal: SLURM preemption and `scancel` send SIGTERM, Ctrl-C sends SIGINT.

A handler only records the signal; the training loop asks, between steps, whether any rank has
one (`agreed`: a MAX over the whole job), so every rank stops after the same step, saves a
checkpoint there and returns normally. At most the step in flight when the signal came is
lost, and it is not even lost: it finishes first.

Under `tetrad train`'s own launcher the ranks get SIGTERM only (the launcher forwards SIGINT and
SIGHUP as SIGTERM and has its ranks ignore them); under torchrun or srun a rank may get any of
them directly. A signal a rank ignores stays ignored.
"""

from __future__ import annotations

import signal
import threading

import torch

from tetrad.dist.layout import GRAD, WEIGHT_SPLIT_DIMS

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


class StopSignals:
    """Context manager: while inside, SIGTERM/SIGINT/SIGHUP set `received` instead of ending the
    process; the previous handlers come back on exit."""

    def __init__(self):
        self.received = 0  # the signal number, 0 for none
        self.previous: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():  # Python delivers signals there only
            for sig in SIGNALS:
                if signal.getsignal(sig) is not signal.SIG_IGN:
                    self.previous[sig] = signal.signal(sig, self._record)
        return self

    def _record(self, signum, frame) -> None:
        self.received = self.received or signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def agreed(self, topo) -> int:
        """The signal any rank of the job has received (0: none); every rank gets the same answer.
        A collective: every rank calls it after every step."""
        flag = torch.tensor(float(self.received), device=topo.device)
        for group in (GRAD, *WEIGHT_SPLIT_DIMS):  # together, the whole job
            topo.comm.all_reduce(flag, group, op=torch.distributed.ReduceOp.MAX)
        return int(flag)
