"""The step breakdown adds up, comm_bytes match the planner, and profiling changes nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from tetrad.plan.cost import comm_bytes_per_step

from conftest import tiny_config, train_layout

LAYOUT = {"dp": 2, "tp": 2}


@pytest.fixture(scope="module")
def run():
    cfg = tiny_config(parallel=LAYOUT, train={"steps": 4, "device": "cpu"})
    return cfg, train_layout(cfg)


def test_breakdown_adds_up_to_step_time(run):
    _, (_, _, history) = run
    for r in history:
        parts = r["compute_s"] + r["exposed_comm_s"] + r["bubble_s"]
        assert parts == pytest.approx(r["step_time_s"], rel=0.05)
        assert r["compute_s"] > 0 and r["exposed_comm_s"] >= 0
        assert sum(r["exposed_comm_s_by_group"].values()) == pytest.approx(r["exposed_comm_s"], rel=1e-6)


@pytest.mark.parametrize("group", ["dp", "cp", "pp"])
def test_comm_bytes_match_planner(run, group):
    cfg, (_, _, history) = run
    assert all(r["comm_bytes"][group] == comm_bytes_per_step(cfg)[group] for r in history)


def test_tp_comm_bytes_match_planner(run):
    cfg, (_, _, history) = run
    assert history[0]["comm_bytes"]["tp"] == comm_bytes_per_step(cfg)["tp"]


def test_profiling_writes_traces_and_changes_nothing(run):
    cfg, (losses, _, _) = run
    profiled = tiny_config(parallel=LAYOUT, train={"steps": 4, "device": "cpu", "profile": "2-3"})
    assert train_layout(profiled)[0] == losses
    traces = sorted(p.name for p in (Path(profiled.run.dir) / "traces").iterdir())
    assert traces == [f"rank{r}.json" for r in range(4)]
    text = (Path(profiled.run.dir) / "traces" / "rank0.json").read_text()
    assert all(name in text for name in ("forward_backward", "grad_reduce", "optimizer", "gloo:all_reduce"))
