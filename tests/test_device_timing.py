"""The step breakdown and the measured pipeline timeline read the device's clock: under a
transport whose `wait()` returns before the transfer ends (tests/late_completion.py, what NCCL
does on a GPU), the device's waits for its neighbours show as bubble and as gaps between
actions, not as compute, optimizer time or nothing."""

from __future__ import annotations

import pytest
import torch

from conftest import run_ranks, tiny_config
from late_completion import LateCompletion
from tetrad.train.metrics import PARTS

pytestmark = pytest.mark.dist

LATENCY_S = 0.2


def _steps_with_late_completion(cfg):
    from tetrad.train.trainer import Trainer
    trainer = Trainer(cfg, torch.device("cpu"))
    link = LateCompletion(LATENCY_S)
    trainer.topo.comm.transport = trainer.topo.comm.clock = link
    steps = []
    for step in range(cfg.train.steps):
        before = dict(link.stalled)
        record = trainer.train_step(step)
        stalled = {kind: link.stalled[kind] - before[kind] for kind in before}
        steps.append((record, stalled, trainer.pipeline.timeline()))
    return steps


def test_breakdown_and_timeline_follow_the_device_clock():
    cfg = tiny_config(parallel={"pp": 2}, train={"micro_batch": 1, "global_batch": 4, "steps": 2})
    for rank, steps in enumerate(run_ranks(_steps_with_late_completion, 2, cfg)):
        for record, stalled, timeline in steps:
            assert stalled["recv"] >= 2 * LATENCY_S, (rank, stalled)  # one wait per micro-batch at least
            # Every stall was inside a wait on a pipeline neighbour: bubble, not compute or optimizer.
            assert record["bubble_s"] >= sum(stalled.values()), (rank, record, stalled)
            assert sum(record[k] for k in PARTS) == pytest.approx(record["step_time_s"], rel=1e-9), record
            # The stalls for received values come before the actions that use them.
            idle = timeline[0].start + sum(b.start - a.end for a, b in zip(timeline, timeline[1:]))
            assert idle >= stalled["recv"], (rank, idle, stalled)
