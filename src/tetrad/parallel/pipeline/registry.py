"""Every pipeline schedule tetrad can run, one entry each: what a schedule is beyond its actions.

An entry gives the generator (generators.py) and the rules that depend on the schedule: how many
model chunks per rank it runs (vpp), the fewest micro-batches it supports, whether it splits the
backward into input- and weight-gradient halves (BI/BW), after how many rounds of pp
micro-batches it repeats itself, and whether another schedule does the same in less memory.
Config checks, the trainer, the simulator, the planner and the renderer read these entries and
never a schedule's name, so adding a schedule is one entry here (and its test). Every schedule
places global stage g = chunk * pp + rank (schedules.stage_of).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tetrad.config import Config, ConfigError
from tetrad.config.rampup import BatchRamp
from tetrad.config.wording import did_you_mean
from tetrad.parallel.pipeline import generators
from tetrad.parallel.pipeline.schedules import KINDS, Action, Schedule, ScheduleError, validate_schedule


def _one(pp: int, vpp: int) -> int:
    return 1


def _a_group_of_pp(pp: int, vpp: int) -> int:
    """Interleaving needs a full group of pp micro-batches through each chunk; with fewer, rank 0
    waits for its own micro-batches to come round from rank pp-1 on every chunk."""
    return pp


@dataclass(frozen=True)
class ScheduleSpec:
    generate: Callable[[int, int, int, int], list[generators.Step]]  # (rank, pp, m, vpp) -> its actions
    interleaved: bool = False  # runs vpp >= 2 model chunks per rank; otherwise exactly one
    min_microbatches: Callable[[int, int], int] = _one  # (pp, vpp) -> the fewest it supports
    splits_backward: bool = False  # runs BI and BW instead of B (the model defers weight gradients)
    warmup_rounds: int = 1  # past this many rounds of pp micro-batches it repeats every pp
    dominated_by: str | None = None  # a schedule with the same step time and less memory: the planner skips this

    def vpp_choices(self, candidates: tuple[int, ...]) -> tuple[int, ...]:
        """The chunks per rank this schedule runs, among `candidates` (always 1 when not interleaved)."""
        return tuple(v for v in candidates if v >= 2) if self.interleaved else (1,)

    def default_vpp(self) -> int:
        return 2 if self.interleaved else 1


SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(generators.gpipe, dominated_by="1f1b"),
    "1f1b": ScheduleSpec(generators.one_f_one_b),
    "interleaved": ScheduleSpec(generators.interleaved, interleaved=True, min_microbatches=_a_group_of_pp,
                                warmup_rounds=2),
    "zb": ScheduleSpec(generators.zb_h1, splits_backward=True),
}


def schedule_spec(name: str) -> ScheduleSpec:
    if name not in SCHEDULES:
        raise ScheduleError(f"unknown schedule {name!r}; use one of {tuple(SCHEDULES)}")
    return SCHEDULES[name]


def _vpp_problem(name: str, vpp: int) -> str | None:
    """What is wrong with running `name` with `vpp` chunks per rank, or None."""
    if schedule_spec(name).interleaved:
        return None if vpp >= 2 else f"schedule {name!r} needs vpp >= 2 model chunks per rank, got vpp={vpp}"
    if vpp == 1:
        return None
    chunked = [n for n, spec in SCHEDULES.items() if spec.interleaved]
    return (f"schedule {name!r} runs one model chunk per rank; vpp={vpp} needs "
            f"{' or '.join(map(repr, chunked))}")


def min_microbatches(name: str, pp: int, vpp: int = 1) -> int:
    """The fewest micro-batches `name` supports (ScheduleError for an unknown name or a wrong vpp)."""
    problem = _vpp_problem(name, vpp)
    if problem:
        raise ScheduleError(problem)
    return schedule_spec(name).min_microbatches(pp, vpp)


def build_schedule(name: str, pp: int, microbatches: int, vpp: int = 1) -> Schedule:
    """Generate schedule `name` for pp ranks, `microbatches` micro-batches and vpp chunks per rank."""
    if pp < 1 or microbatches < 1:
        raise ScheduleError(f"need pp >= 1 and microbatches >= 1; got pp={pp}, microbatches={microbatches}")
    need = min_microbatches(name, pp, vpp)
    if microbatches < need:
        raise ScheduleError(f"schedule {name!r} with pp={pp} needs at least {need} micro-batches, got "
                            f"{microbatches}; use more micro-batches or a smaller pp")
    make = schedule_spec(name).generate
    # One Action per distinct (kind, mb, chunk), shared by all ranks: at pp=64 creating a frozen
    # dataclass per entry would cost more than validating the whole schedule.
    pool = {(kind, mb, chunk): Action(kind, mb, chunk)
            for kind in KINDS for mb in range(microbatches) for chunk in range(vpp)}
    s = Schedule(name, pp, microbatches, vpp, [[pool[t] for t in make(r, pp, microbatches, vpp)] for r in range(pp)])
    validate_schedule(s)
    return s


def check_config(cfg: Config) -> None:
    """The schedule rules of `cfg` (ConfigError naming the fix): a known schedule, the chunks per
    rank it runs, and with pp > 1 enough micro-batches at every global batch a ramp-up runs. Run
    by every command (training: by `preflight`) and by `Trainer`: load_config cannot (config/ sits
    below this floor)."""
    p, t = cfg.parallel, cfg.train
    if p.schedule not in SCHEDULES:
        raise ConfigError(f"parallel.schedule must be one of {', '.join(map(repr, SCHEDULES))}, got {p.schedule!r}"
                          + did_you_mean(p.schedule, SCHEDULES))
    problem = _vpp_problem(p.schedule, p.vpp)
    if problem:
        raise ConfigError(f"parallel.{problem}; set parallel.vpp or parallel.schedule")
    need = SCHEDULES[p.schedule].min_microbatches(p.pp, p.vpp)
    if p.pp > 1 and cfg.microbatches < need:
        raise ConfigError(f"schedule={p.schedule!r} with pp={p.pp} needs at least {need} micro-batches per step; "
                          f"global_batch/(micro_batch*dp) = {cfg.microbatches}. "
                          f"Raise global_batch to {need * t.micro_batch * p.dp} or lower micro_batch")
    # A ramp's steps run each of its batch sizes; the fewest micro-batches is its start's.
    smallest = BatchRamp.of(t).start // (t.micro_batch * p.dp)
    if p.pp > 1 and smallest < need:
        raise ConfigError(f"schedule={p.schedule!r} with pp={p.pp} needs at least {need} micro-batches per step; "
                          f"train.batch_rampup={t.batch_rampup} starts at a global batch of {t.batch_rampup[0]}: "
                          f"{smallest} per step. Raise its start to {need * t.micro_batch * p.dp} or lower micro_batch")
