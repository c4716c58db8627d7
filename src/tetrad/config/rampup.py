"""Global batch-size ramp-up: `train.batch_rampup = [start, increment, samples]`, Megatron-LM's
`--rampup-batch-size` (GPT-3's and Llama 3's staged batch sizes). A step's global batch is a
function of the samples the steps before it read, as Megatron-LM's calculator computes it from
consumed_samples: a checkpoint keeps that count (train/batches.py `DataPosition`), so a resume
continues the ramp exactly, whatever the layout or the step it stopped at.

The rule: with n = (global_batch - start) / increment increments, a step that starts after c
samples runs start + increment * min(n, floor(c * n / samples)) samples. Megatron-LM writes
floor(c / (samples / n)) in floating point, which is the same number except where the float
quotient of an exact boundary rounds down (samples=18, n=14, c=9: 6 increments there, 7 here);
tetrad keeps the exact one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BatchRamp:
    """The global batch of every step of a run; a ramp of no increments is a constant batch."""

    final: int  # train.global_batch
    start: int
    increment: int = 1
    samples: int = 1

    @classmethod
    def of(cls, train) -> "BatchRamp":
        """The ramp `train` (a TrainConfig) asks for (validated by config/validation.py)."""
        if not train.batch_rampup:
            return cls(train.global_batch, train.global_batch)
        start, increment, samples = train.batch_rampup
        return cls(train.global_batch, start, increment, samples)

    @property
    def increments(self) -> int:
        return (self.final - self.start) // self.increment

    def size_at(self, consumed: int) -> int:
        """The global batch of a step that starts after `consumed` samples."""
        if not self.increments:
            return self.final
        done = min(self.increments, consumed * self.increments // self.samples)
        return self.start + done * self.increment

    def indivisible(self, rows: int) -> int | None:
        """The smallest global batch of the ramp that `rows` (micro_batch * dp) does not divide, or
        None. Its batches are start + k * increment, so start's and the next one's decide."""
        firsts = (self.start, self.start + self.increment) if self.increments else (self.final,)
        return next((b for b in firsts if b % rows), None)

    def _stretch(self, consumed: int) -> tuple[int, int | None]:
        """(the global batch after `consumed` samples, how many steps it lasts; None: for good)."""
        size = self.size_at(consumed)
        if size == self.final:
            return size, None
        # The least count c at which the next increment applies: c * n // samples > those done.
        boundary = -(-((size - self.start) // self.increment + 1) * self.samples // self.increments)
        return size, -(-(boundary - consumed) // size)

    def stages(self, steps: int, consumed: int = 0) -> list[tuple[int, int]]:
        """(global batch, steps) of each stretch of equal batches among `steps` steps that start
        after `consumed` samples: one loop turn per increment, not per step, for long runs."""
        out = []
        while steps > 0:
            size, lasts = self._stretch(consumed)
            run = steps if lasts is None else min(steps, lasts)
            out.append((size, run))
            consumed, steps = consumed + run * size, steps - run
        return out

    def steps_for(self, samples: int) -> int:
        """The fewest steps from the run's start that read at least `samples` samples."""
        steps = consumed = 0
        while consumed < samples:
            size, lasts = self._stretch(consumed)
            run = -(-(samples - consumed) // size)
            run = run if lasts is None else min(run, lasts)
            consumed, steps = consumed + run * size, steps + run
        return steps

    def advance(self, consumed: int, steps: int) -> int:
        """The samples read after `steps` more steps from `consumed`."""
        return consumed + sum(size * run for size, run in self.stages(steps, consumed))
