"""Replay a pipeline schedule on per-action costs: timeline, step time, bubble, peak in-flight.

The planner uses this instead of bubble formulas, so any schedule it can build it can also cost.
Each rank runs its list in order, one action at a time; an action starts when the rank is free
and its inputs exist (plus `p2p` latency when they come from another rank). Costs may be ints,
floats or Fractions; the arithmetic keeps their type, so closed forms can be checked exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

from tetrad.parallel.pipeline.schedules import Action, Schedule, ScheduleError, place_of, replay



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
    return [round(x) for x in peak_held(s)]


def peak_held(s: Schedule, after_bi: float = 1.0, weights: tuple | None = None, loss: float = 0.0,
              per_set: float = 0.0) -> list[float]:
    """Per rank, the most activation memory held at once, in (mb, chunk) activation sets: a set
    is whole from its F until its B or BI; between BI and BW (zero-bubble) what the weight
    gradients still need (the linears' inputs and output gradients) weighs `after_bi` sets.
    `weights[rank][chunk]` (default 1): what one set of that chunk weighs, e.g. its layers.
    `loss`: what a micro-batch's loss waiting for its backward (the last stage's head output and
    logits, from the last stage's F until its B or BI) weighs in the same units: counted where it is held, so that a
    peak of sets that comes when no loss waits (zero-bubble's, after BI) does not take it too.
    `per_set`: what every set carries beside its layers (document masking's bias, one per
    micro-batch and chunk), from its F until its B or BI, in the same units."""
    change = {"F": 1.0, "B": -1.0, "BI": after_bi - 1.0, "BW": -after_bi}
    carried = {"F": per_set, "B": -per_set, "BI": -per_set, "BW": 0.0}
    weights = weights or [[1.0] * s.vpp] * s.pp
    last = place_of(s.stages - 1, s.pp)
    waits = {"F": loss, "B": -loss, "BI": -loss, "BW": 0.0}

    def held(r: int, a: Action) -> float:
        return change[a.kind] * weights[r][a.chunk] + carried[a.kind] + (waits[a.kind] if (r, a.chunk) == last else 0.0)
    return [max(accumulate((held(r, a) for a in actions), initial=0.0)) for r, actions in enumerate(s.actions)]


def simulate(s: Schedule, costs: StageCosts, timeline: bool = True) -> SimResult:
    """Time `s` under `costs`; raises ScheduleError if the schedule cannot run.

    `timeline=False` leaves SimResult.timeline empty: a caller that only wants the step time
    (the planner) skips building one tuple per action, about a third of the time at pp=64.
    """
    starts, ends, busy = replay(s, costs.per_stage(s.stages), costs.p2p)
    step = max(e[-1] if e else 0 for e in ends)
    bubble = 1 - sum(busy) / (s.pp * step) if step else 0  # free actions leave nothing idle
    rows = [(rank, a, start, end) for rank, actions in enumerate(s.actions)
            for a, start, end in zip(actions, starts[rank], ends[rank])] if timeline else []
    return SimResult(step_time=step, bubble_fraction=bubble,
                     peak_inflight=peak_inflight(s), busy=busy, timeline=rows)
