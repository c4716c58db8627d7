"""A schedule is one registry entry: a toy 1F1B variant registered here, and nowhere else, is
accepted by config checks, run by the executor (pp=2 parity with one process), timed by the
simulator, ranked by the planner and drawn by the renderer."""

from __future__ import annotations

from fractions import Fraction

import re

import pytest

from conftest import assert_parity, tiny_config, train_layout
from tetrad.config import ConfigError, load_config
from tetrad.parallel.pipeline import generators
from tetrad.parallel.pipeline.registry import SCHEDULES, ScheduleSpec, build_schedule, check_config
from tetrad.parallel.pipeline.simulate import StageCosts, simulate
from tetrad.plan.cost import estimate
from tetrad.plan.hardware import load_cluster
from tetrad.plan.search import config_of, layouts
from tetrad.viz.timeline import schedule_command

TOY = "1f1b-eager"


def eager_one_f_one_b(rank: int, pp: int, m: int, vpp: int) -> list[tuple[str, int, int]]:
    """1F1B with one more warm-up forward on every rank (1F1B's warm-up for pp + 1 ranks): the
    same bubble, one more activation held."""
    return generators.one_f_one_b(rank, pp + 1, m, vpp)


@pytest.fixture
def toy(monkeypatch):
    monkeypatch.setitem(SCHEDULES, TOY, ScheduleSpec(eager_one_f_one_b))


def _pp2(**train):
    return {"parallel": {"pp": 2, "schedule": TOY}, "model": {"n_layers": 4},
            "train": {"micro_batch": 1, "global_batch": 4, **train}}


def test_config_checks_read_the_registry(toy, monkeypatch):
    check_config(load_config(overrides=_pp2()))
    with pytest.raises(ConfigError, match="schedule 'gpipe' runs one model chunk per rank; vpp=2 needs 'interleaved'"):
        check_config(load_config(overrides={"parallel": {"pp": 2, "vpp": 2, "schedule": "gpipe"}}))
    monkeypatch.delitem(SCHEDULES, TOY)
    with pytest.raises(ConfigError, match=f"parallel.schedule must be one of 'gpipe', '1f1b', 'interleaved', 'zb', "
                                          f"got '{TOY}'"):
        check_config(load_config(overrides=_pp2()))
    for typed, meant in (("1F1B", "1f1b"), ("Interleaved1F1B", "interleaved"), ("ZB", "zb")):  # torch's names, case
        with pytest.raises(ConfigError, match=re.escape(f"got '{typed}' (did you mean '{meant}'?)")):
            check_config(load_config(overrides={"parallel": {"pp": 2, "schedule": typed}}))


def test_simulator_and_renderer_take_it(toy, tmp_path, capsys):
    pp, m = 4, 8
    r = simulate(build_schedule(TOY, pp, m), StageCosts(Fraction(1), Fraction(1), Fraction(1)))
    assert r.bubble_fraction == Fraction(pp - 1, m + pp - 1)  # 1F1B's
    assert r.peak_inflight == [min(pp - rank + 1, m) for rank in range(pp)]  # one more than 1F1B's
    out = tmp_path / "toy.png"
    assert schedule_command(["--pp", "4", "--microbatches", "8", "--schedule", TOY, "--out", str(out)]) == 0
    assert f"{TOY}: pp=4" in capsys.readouterr().out and out.stat().st_size > 0


def test_planner_ranks_it(toy):
    base = load_config(overrides={"model": {"preset": "llama3-8b"}, "train": {"global_batch": 64, "dtype": "bf16"}},
                       runtime=False)
    cluster = load_cluster("dgx-h100")
    toys = [x for x in layouts(base, 8, 8) if x.schedule == TOY]
    assert toys
    eager = toys[0]
    plain = estimate(config_of(base, eager._replace(schedule="1f1b")), cluster)
    est = estimate(config_of(base, eager), cluster)
    # The extra forward in flight hides the point-to-point latency 1F1B waits on, at an activation's cost.
    assert 0 < est.step_time_s <= plain.step_time_s
    assert est.memory_by_rank[0].activations > plain.memory_by_rank[0].activations


@pytest.mark.dist
def test_executor_runs_it_as_one_process_would(toy):
    m = 4
    got = train_layout(tiny_config(**_pp2(global_batch=m)))
    ref = train_layout(tiny_config(model={"n_layers": 4}, train={"micro_batch": 1, "global_batch": m}))
    assert_parity(got, ref)
