"""Stopping on a signal, on a closed stdout, or on divergence. Signals: SLURM preemption and
`scancel` send SIGTERM, Ctrl-C sends SIGINT.

A handler only records the signal; every step sums each rank's `flags` over the whole job, in
the one all-reduce of the step's numbers (the trainer's, after the gradient reduction), so
every rank reads the same `agreed` signal, stops after the same step, saves a checkpoint there
and returns normally. The step in flight finishes first; a signal that comes after its
all-reduce is read in the next step's, which finishes too. No step is lost.

`tetrad train`'s own launcher forwards each signal to its ranks as itself, as torchrun's agent
does, so the stop line says which it was: Ctrl-C's SIGINT, the user's, or a scheduler's SIGTERM. A
signal a rank ignores stays ignored.

A closed stdout (`tetrad train ... | head`: the reader left) stops the run as SIGTERM does, under
SIGPIPE's name (rank 0's log finds it, `stdout_closed`): it rides on the same all-reduce, so the
step in flight finishes and is saved, rather than rank 0 failing on its next line and the job
losing the steps since its last checkpoint.

Divergence: a step whose job-wide gradient norm is not finite, with no loss scale left to lower,
is not applied and ends the run on every rank (the trainer's `fit`), as Megatron-LM stops on a
NaN gradient; `divergence_note` is what rank 0 says.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path

from tetrad.train.checkpoint import CheckpointError, resolve

SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
STOPS = SIGNALS + (signal.SIGPIPE,)  # what a step's flags carry: the signals, and a closed stdout


class StopSignals:
    """Context manager: while inside, SIGTERM/SIGINT/SIGHUP set `received` instead of ending the
    process; the previous handlers come back on exit."""

    def __init__(self):
        self.received = 0  # the signal number, 0 for none
        self.closed = False  # rank 0's stdout lost its reader (kept from before the run's first step)
        self.previous: dict = {}

    def __enter__(self) -> "StopSignals":
        self.received = 0
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

    def stdout_closed(self) -> None:
        self.closed = True

    def flags(self) -> list[float]:
        """This rank's signal and closed stdout, one count per STOPS entry: summed over the job,
        `agreed` reads them."""
        return [float(self.received == sig) for sig in SIGNALS] + [float(self.closed)]

    @staticmethod
    def agreed(counts: list[float]) -> int:
        """The signal of the job's summed `flags` (0: none): the highest-numbered one any rank
        received (SIGTERM over SIGPIPE, a closed stdout, over SIGINT over SIGHUP), the same on
        every rank."""
        return max((int(sig) for sig, n in zip(STOPS, counts) if n), default=0)


def stop_name(signum: int) -> str:
    """What a stop's line calls `agreed`'s signal: Ctrl-C by name, the user's own interrupt."""
    why = {signal.SIGPIPE: " (stdout's reader left)", signal.SIGINT: " (Ctrl-C)"}.get(signum, "")
    return signal.Signals(signum).name + why


def divergence_note(record: dict, checkpoint_root: Path, loss_scaled: bool) -> str:
    """The line a diverged run stops with: its step, and the checkpoint the same command resumes."""
    try:
        again = f"it resumes from {resolve(checkpoint_root)}"
    except CheckpointError:
        again = "no checkpoint was saved yet: it starts afresh"
    return (f"tetrad: step {record['step']}: the gradient norm is {record['grad_norm']} (loss {record['loss']:.4g})"
            f"{' at the smallest fp16 loss scale' if loss_scaled else ''}; the step was not applied and the run "
            f"stops. Run it again with a lower train.lr or a longer train.warmup ({again})")
