"""Where the time goes, on real 8-rank runs: the step breakdown adds up, comm_bytes match the
planner, MFU/HFU follow the planner's convention, and profiling changes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tetrad.plan.comm_bytes import comm_bytes_per_step
from tetrad.plan.cost import estimate
from tetrad.plan.hardware import load_cluster
from tetrad.train.metrics import CONTRACT_FIELDS, PARTS, FlopRate, layout_label

from conftest import tiny_config, train_layout

# A 4D layout without cp, and one with cp (and full recompute, so HFU differs from MFU).
LAYOUTS = {"dp2-tp2-pp2": ({"dp": 2, "tp": 2, "pp": 2}, {}),
           "cp2-tp2-pp2": ({"cp": 2, "tp": 2, "pp": 2}, {"recompute": "full"})}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def run(request):
    parallel, train = LAYOUTS[request.param]
    cfg = tiny_config(parallel=parallel, train={"steps": 4, "device": "cpu", **train})
    return cfg, train_layout(cfg)


def test_breakdown_adds_up_to_step_time(run):
    """The parts tile the step (metrics.StepClock: each from the previous one's end), so they add
    up to the step time exactly, however loaded the machine: no glue between phases goes untimed."""
    _, (_, _, history) = run
    for r in history:
        assert set(CONTRACT_FIELDS) <= r.keys() and set(r["comm_bytes"]) == {"tp", "cp", "pp", "dp", "ep"}
        assert sum(r[k] for k in PARTS) == pytest.approx(r["step_time_s"], rel=1e-9), r
        assert all(r[k] >= 0 for k in PARTS) and r["compute_s"] > 0 and r["bubble_s"] > 0
        groups = r["exposed_comm_s_by_group"]
        assert groups["pp"] == r["bubble_s"]
        assert sum(v for g, v in groups.items() if g != "pp") == pytest.approx(r["exposed_comm_s"], rel=1e-9)


def test_throughput_memory_and_layout_fields(run):
    """The other per-step numbers a user reads: throughput from the global batch and the step
    time, an MFU that is a fraction, the counted memory parts, the layout it ran in."""
    cfg, (_, _, history) = run
    tokens = cfg.train.global_batch * cfg.model.seq_len
    for r in history:
        assert r["tokens_per_s"] == pytest.approx(tokens / r["step_time_s"], rel=1e-9)
        assert 0 < r["mfu"] < 1 and 0 < r["hfu"] < 1
        assert set(r["memory_bytes"]) == {"peak", "params", "grads", "optimizer", "activations"}
        assert all(r["memory_bytes"][k] > 0 for k in ("params", "grads", "optimizer", "activations"))
        assert r["peak_memory_gib"] == r["memory_bytes"]["peak"] / 2**30
        assert r["layout"] == layout_label(cfg.parallel) and r["skipped"] is False


@pytest.mark.parametrize("group", ["tp", "cp", "pp", "dp"])
def test_comm_bytes_match_planner(run, group):
    cfg, (_, _, history) = run
    assert all(r["comm_bytes"][group] == comm_bytes_per_step(cfg)[group] for r in history)


def test_mfu_and_hfu_use_the_planners_flops_and_peak(run):
    """MFU x step time is FLOPs / peak: the same number for the run and for `tetrad estimate` on
    the built-in cpu cluster whatever the two step times are."""
    cfg, (_, _, history) = run
    est = estimate(cfg, load_cluster("cpu"))
    for r in history:
        assert r["mfu"] * r["step_time_s"] == pytest.approx(est.mfu * est.step_time_s, rel=1e-9)
        assert r["hfu"] * r["step_time_s"] == pytest.approx(est.hfu * est.step_time_s, rel=1e-9)
    assert (history[0]["hfu"] > history[0]["mfu"]) == (cfg.train.recompute != "none")


def test_profiling_writes_traces_annotated_by_group_and_changes_nothing(run):
    cfg, (losses, _, _) = run
    profiled = tiny_config(parallel=vars(cfg.parallel), train={**vars(cfg.train), "profile": "2-3"})
    assert train_layout(profiled)[0] == losses
    traces = Path(profiled.run.dir) / "traces"
    assert sorted(p.name for p in traces.iterdir()) == [f"rank{r}.json" for r in range(8)]
    names = {e["name"] for e in json.loads((traces / "rank0.json").read_text())["traceEvents"]}
    assert {"forward_backward", "grad_reduce", "optimizer", "gloo:all_reduce"} <= names
    # Collectives carry their group: rank 0 is on the first stage (it sends, and waits to receive,
    # on the group of the pipeline link between ranks 0 and 1).
    groups = {"tp:all_reduce", "pp:0-1:send_recv", "pp:0-1:send_recv wait", "dp_cp:all_reduce"}
    assert groups <= names, groups - names


def test_a_cpu_ranks_mfu_is_over_the_cores_its_threads_compute_on():
    """The CPU profile's peak is one core's: a rank computing on two threads (one rank on a 2-core
    machine) has twice that peak, and half the MFU (before: 85-96% for the tiny model there)."""

    cfg = tiny_config()
    before = torch.get_num_threads()
    try:
        rates = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            rates.append(FlopRate(cfg, torch.device("cpu"))(1.0, cfg.train.global_batch)["mfu"])
    finally:
        torch.set_num_threads(before)
    assert rates[1] == pytest.approx(rates[0] / 2)
