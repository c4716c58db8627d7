"""The pipeline executors of a run's steps, one per micro-batch count. A schedule is generated for
a number of micro-batches, and a batch ramp-up (`train.batch_rampup`) changes that number as the
global batch grows. Without pipeline parallelism the "schedule" is F, B per micro-batch: plain
gradient accumulation, through the same executor."""

from __future__ import annotations

from tetrad.config import Config
from tetrad.parallel.pipeline.executor import PipelineExecutor
from tetrad.parallel.pipeline.registry import build_schedule
from tetrad.parallel.pipeline.schedules import Schedule, forward_only, link_order


def step_schedule(cfg: Config, microbatches: int) -> Schedule:
    """The training schedule of a step of `microbatches` micro-batches on each dp rank."""
    p = cfg.parallel
    return build_schedule(p.schedule if p.pp > 1 else "1f1b", p.pp, microbatches, p.vpp)


def pipeline_links(cfg: Config) -> list[tuple[int, int]]:
    """The pairs of pipeline ranks a run's schedules exchange values between, for the topology to
    create their groups once. Every micro-batch crosses every stage boundary, so the schedule of
    any micro-batch count a ramp-up runs has the final one's links."""
    return sorted(link_order(step_schedule(cfg, cfg.microbatches)))


class StepPipelines:
    """Each micro-batch count's executor, built when a step first runs that count and kept (a ramp
    runs each count for many steps); `eval`: validation's forward-only one, at train.global_batch.
    The rest of the arguments are PipelineExecutor's after the schedule."""

    def __init__(self, cfg: Config, model, *executor_args):
        self.cfg, self.model, self.args = cfg, model, executor_args
        self.executors: dict[int, PipelineExecutor] = {}
        self.eval = PipelineExecutor(model, forward_only(step_schedule(cfg, cfg.microbatches)), *executor_args)

    def __call__(self, microbatches: int) -> PipelineExecutor:
        if microbatches not in self.executors:
            schedule = step_schedule(self.cfg, microbatches)
            self.executors[microbatches] = PipelineExecutor(self.model, schedule, *self.args)
        return self.executors[microbatches]
