"""Replay a pipeline schedule on per-action costs: timeline, step time, bubble, peak in-flight.

The planner uses this instead of bubble formulas, so any schedule it can build it can also cost.
Each rank runs its list in order, one action at a time; an action starts when the rank is free
and its inputs exist (plus `p2p` latency when they come from another rank). Costs may be ints,
floats or Fractions; the arithmetic keeps their type, so closed forms can be checked exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

from tetrad.parallel.pipeline.schedules import (Action, Schedule, ScheduleError, execution_order, makes,
                                                needs, stage_of)


@dataclass
class StageCosts:
    """Seconds per micro-batch per chunk: a scalar for every stage, or one entry per global stage.

    A full backward B costs backward_input + backward_weight; zero-bubble schedules run them apart.
    """

    forward: float | list[float]
    backward_input: float | list[float]
    backward_weight: float | list[float]
    p2p: float = 0  # latency of one activation/gradient transfer between ranks

    def per_stage(self, stages: int) -> dict[str, list[float]]:
        """The costs of F, B, BI and BW at each of `stages` global stages."""
        out = {}
        for kind, value in (("F", self.forward), ("BI", self.backward_input), ("BW", self.backward_weight)):
            values = list(value) if isinstance(value, (list, tuple)) else [value] * stages
            if len(values) != stages:
                raise ScheduleError(f"{len(values)} {kind} costs given for {stages} pipeline stages")
            out[kind] = values
        out["B"] = [bi + bw for bi, bw in zip(out["BI"], out["BW"])]
        return out


@dataclass
class SimResult:
    step_time: float
    bubble_fraction: float  # 1 - sum(busy) / (pp * step_time): the share of rank-time spent idle
    peak_inflight: list[int]  # per rank: (mb, chunk) activations alive at once, from F until B or BW
    busy: list[float]  # per rank: seconds spent computing
    timeline: list[tuple[int, Action, float, float]]  # (rank, action, start, end)


def peak_inflight(s: Schedule) -> list[int]:
    """Per rank, the most (mb, chunk) activations held at once: each lives from its F until its B
    or BW (weight gradients still need the stored inputs). Depends on the order only, not costs."""
    peaks = []
    for actions in s.actions:
        alive = peak = 0
        for a in actions:
            alive += 1 if a.kind == "F" else -1 if a.kind in ("B", "BW") else 0
            peak = max(peak, alive)
        peaks.append(peak)
    return peaks


def simulate(s: Schedule, costs: StageCosts) -> SimResult:
    """Time `s` under `costs`; raises ScheduleError if the schedule cannot run."""
    cost = costs.per_stage(s.stages)
    ready: dict = {}  # value -> (producing rank, time it exists)
    free = [0] * s.pp
    busy = [0] * s.pp
    timeline = []
    for rank, a in execution_order(s):
        start = free[rank]
        for v in needs(s, rank, a):
            src, t = ready[v]
            start = max(start, t + costs.p2p if src != rank else t)
        duration = cost[a.kind][stage_of(rank, a.chunk, s.pp)]
        end = start + duration
        made = makes(s, rank, a)
        if made is not None:
            ready[made] = (rank, end)
        free[rank] = end
        busy[rank] += duration
        timeline.append((rank, a, start, end))
    step = max(free)
    bubble = 1 - sum(busy) / (s.pp * step) if step else 0  # free actions leave nothing idle
    return SimResult(step_time=step, bubble_fraction=bubble,
                     peak_inflight=peak_inflight(s), busy=busy, timeline=timeline)
