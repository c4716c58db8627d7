"""Replay a pipeline schedule on per-action costs: timeline, step time, bubble, peak in-flight.

The planner uses this instead of bubble formulas, so any schedule it can build it can also cost.
Each rank runs its list in order, one action at a time; an action starts when the rank is free
and its inputs exist (plus `p2p` latency when they come from another rank). Costs may be ints,
floats or Fractions; the arithmetic keeps their type, so closed forms can be checked exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

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


class HeldTerms(NamedTuple):
    """A schedule's actions as arrays [rank, action] (ranks padded with no-ops): what each adds to
    the activations held, for peak_held's arithmetic in numpy (the planner calls it thousands of
    times per search). `sets`: +1 for F, -1 for B and BI (the set's whole-until-backward part),
    0 for BW; `after_bi`: +1 for BI and -1 for BW (the remainder BI leaves until BW); `chunk`: the
    action's local chunk; `last`: whether it runs on the last global stage, where the loss waits."""

    sets: np.ndarray
    after_bi: np.ndarray
    chunk: np.ndarray
    last: np.ndarray


SETS = {"F": 1.0, "B": -1.0, "BI": -1.0, "BW": 0.0}
AFTER_BI = {"F": 0.0, "B": 0.0, "BI": 1.0, "BW": -1.0}


def held_terms(s: Schedule) -> HeldTerms:
    width = max(map(len, s.actions), default=0)
    last = place_of(s.stages - 1, s.pp)

    def table(value) -> np.ndarray:
        rows = [[value(r, a) for a in actions] + [0] * (width - len(actions)) for r, actions in enumerate(s.actions)]
        return np.array(rows, dtype=np.float64).reshape(len(s.actions), width)
    return HeldTerms(table(lambda r, a: SETS[a.kind]), table(lambda r, a: AFTER_BI[a.kind]),
                     table(lambda r, a: a.chunk).astype(np.intp), table(lambda r, a: (r, a.chunk) == last))


def peak_held(s: Schedule, after_bi: float = 1.0, weights: tuple | None = None, loss: float = 0.0,
              per_set: float = 0.0, terms: HeldTerms | None = None, bi_end: float = 0.0) -> list[float]:
    """Per rank, the most activation memory held at once, in (mb, chunk) activation sets: a set
    is whole from its F until its B or BI; between BI and BW (zero-bubble) what the weight
    gradients still need (the linears' inputs and output gradients) weighs `after_bi` sets.
    `weights[rank][chunk]` (default 1): what one set of that chunk weighs, e.g. its layers.
    `loss`: what a micro-batch's loss waiting for its backward (the last stage's head output and
    logits, from the last stage's F until its B or BI) weighs in the same units: counted where it is held, so that a
    peak of sets that comes when no loss waits (zero-bubble's, after BI) does not take it too.
    `per_set`: what every set carries beside its layers (document masking's bias, one per
    micro-batch and chunk), from its F until its B or BI, in the same units. `terms`: held_terms(s),
    where the caller keeps it. `bi_end`: what a BI still holds of its set as it ends, beside the
    remainder it has made (the chunk's first layer's input, freed by that layer's last backward
    op), in the same units."""
    t = terms or held_terms(s)
    weight = np.asarray(weights or [[1.0] * s.vpp] * s.pp, dtype=np.float64)
    w = np.take_along_axis(weight, t.chunk, axis=1)
    held = (t.sets + t.after_bi * after_bi) * w + t.sets * per_set + t.sets * t.last * loss
    return (np.cumsum(held, axis=1) + (t.after_bi > 0) * bi_end).max(axis=1, initial=0.0).tolist()


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
