"""The pipeline's time and held activations, from the schedule simulator, cached for the search.

A simulation is keyed by (schedule, pp, micro-batches, vpp, normalised per-stage costs), so
layouts with the same pipeline shape share it; a long schedule is simulated past its warm-up at
two lengths in the same phase and extended linearly (it repeats every pp micro-batches).
"""

from __future__ import annotations

from functools import lru_cache

from tetrad.parallel.pipeline.registry import build_schedule, schedule_spec
from tetrad.parallel.pipeline.schedules import replay
from tetrad.parallel.pipeline.simulate import StageCosts, held_terms, peak_held
from tetrad.parallel.pipeline.split import rank_stages


@lru_cache(maxsize=256)
def _schedule(schedule: str, pp: int, m: int, vpp: int):
    return build_schedule(schedule, pp, m, vpp)  # built (and validated) once per shape


def _held(schedule: str, pp: int, m: int, vpp: int, *weighing, bi_end: float = 0.0) -> list[float]:
    """simulate.peak_held of one schedule shape (`weighing`: its after_bi, weights, loss and
    per_set; `bi_end`), the shape's arrays built once."""
    return peak_held(_schedule(schedule, pp, m, vpp), *weighing, terms=_terms(schedule, pp, m, vpp), bi_end=bi_end)


@lru_cache(maxsize=256)
def _terms(schedule: str, pp: int, m: int, vpp: int):
    return held_terms(_schedule(schedule, pp, m, vpp))


def _steady(schedule: str, pp: int, m: int) -> int:
    """The fewest micro-batches past `schedule`'s warm-up in the same phase as m: from there on it
    repeats every pp micro-batches, so what it costs or holds grows linearly (registry.py)."""
    return schedule_spec(schedule).warmup_rounds * pp + m % pp


@lru_cache(maxsize=65536)
def _simulate(schedule: str, pp: int, m: int, vpp: int, f: tuple, bi: tuple, bw: tuple, p2p: float):
    """(step time, per-rank idle time after its last action) of one simulated schedule: the
    simulator's replay without the timeline it would build for a picture."""
    s = _schedule(schedule, pp, m, vpp)
    _, ends, _ = replay(s, StageCosts(list(f), list(bi), list(bw), p2p).per_stage(s.stages), p2p)
    last = [e[-1] if e else 0.0 for e in ends]
    step = max(last)
    return step, tuple(step - x for x in last)


@lru_cache(maxsize=65536)
def inflight(schedule: str, pp: int, m: int, vpp: int, after_bi: float = 1.0,
             chunk_layers: tuple | None = None, loss: float = 0.0, per_set: float = 0.0,
             bi_end: float = 0.0) -> tuple[float, ...]:
    """Peak (micro-batch, chunk) activation sets alive per rank, from the schedule's order
    (zero-bubble's BI-to-BW remainders weighing `after_bi` sets: memory.after_bi_weight); with
    `chunk_layers` (split.chunk_layers) each set weighs its chunk's layers: the peak in layers'
    sets, right for chunks of unequal size; with `loss`, the last stage's waiting losses too, each
    weighing that many sets, with `per_set` what every set carries beside its layers and with
    `bi_end` what a BI holds of its set as it ends (simulate.peak_held). Past the warm-up the peak grows by the same
    amount every pp micro-batches (nothing for 1F1B, pp for GPipe), so a long schedule is read at
    two steady lengths and extended."""
    m0 = _steady(schedule, pp, m)
    if m <= m0 + pp:
        return tuple(_held(schedule, pp, m, vpp, after_bi, chunk_layers, loss, per_set, bi_end=bi_end))
    h0, h1 = (_held(schedule, pp, n, vpp, after_bi, chunk_layers, loss, per_set, bi_end=bi_end) for n in (m0, m0 + pp))
    return tuple(a + (m - m0) / pp * (b - a) for a, b in zip(h0, h1))


def pipeline(schedule: str, pp: int, m: int, vpp: int, f: list, bi: list, bw: list, p2p: float):
    """(step time, per-rank idle tail) from the schedule simulator.

    Costs are normalised to the slowest stage's forward and rounded to 1% of it, so similar
    layouts share a simulation. Past its warm-up (registry.py: one round of pp micro-batches, two
    when interleaved) a schedule is nearly periodic in pp micro-batches, so a long one is simulated
    at m0 and m0 + pp (in the same phase) and extended linearly, each further round costing what
    the last one did, and never less than the most loaded rank's work for it (uneven stages can
    take a few more rounds to settle). That keeps a search over thousands of micro-batches fast.
    Rounding moves each rank's work a little, so the time returned is the most loaded rank's exact
    work plus the idle time the simulation finds for it: never less than any rank's work, so the
    bubble it leaves is never negative.
    """
    unit = max(f) or 1.0
    norm = lambda xs: tuple(round(x / unit, 2) for x in xs)  # noqa: E731
    nf, nbi, nbw, np2p = norm(f), norm(bi), norm(bw), round(p2p / unit, 3)
    held = [rank_stages(pp, vpp, r) for r in range(pp)]
    exact = [sum(f[g] + bi[g] + bw[g] for g in stages) for stages in held]
    k = max(range(pp), key=exact.__getitem__)
    rounded = sum(nf[g] + nbi[g] + nbw[g] for g in held[k])  # in units, per micro-batch
    m0 = _steady(schedule, pp, m)
    if m <= m0 + pp:
        t, tail = _simulate(schedule, pp, m, vpp, nf, nbi, nbw, np2p)
    else:
        t0, _ = _simulate(schedule, pp, m0, vpp, nf, nbi, nbw, np2p)
        t1, tail = _simulate(schedule, pp, m0 + pp, vpp, nf, nbi, nbw, np2p)
        busiest = max(sum(nf[g] + nbi[g] + nbw[g] for g in stages) for stages in held)
        t = t1 + (m - m0 - pp) * max(t1 - t0, pp * busiest) / pp
    return t * unit + m * (exact[k] - rounded * unit), [x * unit for x in tail]
