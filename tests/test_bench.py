"""`tetrad bench`: bus-bandwidth convention, the alpha-beta fit, and a profile the planner accepts."""

from __future__ import annotations

import json

import pytest
import torch

from tetrad.bench import attention_profile, attention_tflops, bench_comm, bench_gemm, comm_profile, fit_link, format_table, gemm_profile, write_profile
from tetrad.dist import autotune, bench
from tetrad.plan.cost import estimate
from tetrad.plan.links import LINK_EFFICIENCY, ring_time
from tetrad.plan.hardware import load_cluster
from tetrad.dist.layout import Layout
from tetrad.dist.topology import Topology

from conftest import run_ranks, tiny_config, train_layout


def test_bus_factor_follows_nccl_tests():
    assert bench.bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    for op in ("all_gather", "reduce_scatter", "all_to_all"):
        assert bench.bus_factor(op, 4) == pytest.approx(3 / 4)
    assert bench.bus_factor("send_recv", 8) == 1.0


def test_fit_recovers_the_planner_ring_model():
    alpha, bw = 3e-4, 1.5e9
    rows = [{"op": "all_reduce", "ranks": n, "bytes": s,
             "time_s": ring_time("all_reduce", s, n, alpha, bw * LINK_EFFICIENCY)}
            for n in (2, 4, 8) for s in (4 << 10, 1 << 20, 16 << 20)]
    link = fit_link(rows)
    assert link["alpha_s"] == pytest.approx(alpha, rel=1e-6)
    assert link["beta_gbps"] == pytest.approx(bw / 1e9, rel=1e-6)


@pytest.fixture(scope="module")
def comm_rows():
    return bench_comm(group_sizes=(2,), sizes=(4 << 10, 256 << 10))


def test_too_few_message_sizes_are_refused_before_measuring(capsys, tmp_path):
    """Two sizes fit latency and bandwidth exactly, noise included (the audit helper's run fitted
    1,250,000 GB/s): refused in one line, naming sizes that work, before any rank starts."""
    from tetrad.cli import main
    for sizes in ("4,64", "64,128,256"):
        assert main(["bench", "comm", "--ranks", "2", "--sizes-kb", sizes, "--out", str(tmp_path)]) == 2
        assert "--sizes-kb needs 3 or more sizes spanning 16x or more" in capsys.readouterr().err
    assert not (tmp_path / "hardware.json").exists()


@pytest.mark.parametrize("args,message", [
    (["comm", "--ranks", "2,x"], "argument --ranks: expected whole numbers >= 1, comma-separated, got '2,x'"),
    (["comm", "--ranks", "1"], "argument --ranks: group sizes are 2 ranks or more"),
    (["comm", "--sizes-kb", "4,64,1k"], "argument --sizes-kb: expected whole numbers >= 1, comma-separated"),
    (["gemm", "--threads", "0"], "argument --threads: expected a whole number >= 1, got '0'"),
])
def test_bad_numbers_are_refused_in_one_line(args, message, capsys, tmp_path):
    """A typo in a count is argparse's usage and one line, exit 2, before anything is measured
    (before, a ValueError's traceback, torch's set_num_threads error, or a gloo hang-up at --ranks 1)."""
    from tetrad.cli import main
    with pytest.raises(SystemExit) as exit_:
        main(["bench", *args, "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and message in err and "Traceback" not in err, err
    assert not (tmp_path / "hardware.json").exists()


def test_bench_comm_rows_are_sensible(comm_rows):
    assert {r["op"] for r in comm_rows} == set(bench.OPS)
    for r in comm_rows:
        assert r["time_s"] > 0 and r["algbw_gbps"] > 0
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * bench.bus_factor(r["op"], 2))
        assert r["busbw_gbps"] < 100  # gloo over local sockets: far below memory bandwidth
    print("\n" + format_table(comm_rows))


def test_profile_is_accepted_by_estimate(comm_rows, tmp_path):
    gemm_rows = bench_gemm(shapes=((64, 64, 64),), dtypes=("fp32",))
    write_profile(tmp_path, gemm_profile(gemm_rows), "test-machine", 4)
    path = write_profile(tmp_path, comm_profile(comm_rows), "test-machine", 4)
    profile = json.loads(path.read_text())
    assert {"peak_tflops", "links", "collectives", "gemm"} <= profile.keys()  # the second write kept the first
    cluster = load_cluster(str(tmp_path / "cluster.toml"))
    assert cluster.gpu.name == "test-machine" and cluster.world == 4
    assert cluster.gpu.peak_tflops["fp32"] == pytest.approx(gemm_rows[0]["tflops"])
    assert cluster.gpu.intra_gbps == pytest.approx(profile["links"]["intra_node"]["beta_gbps"])
    est = estimate(tiny_config(parallel={"dp": 2, "tp": 2}), cluster)
    assert 0 < est.step_time_s < 60


def _resolve(parallel: dict, grad_bytes: int):
    from tetrad.config import ParallelConfig
    topo = Topology(Layout(dp=parallel["dp"]), torch.device("cpu"), parallel["ranks_per_node"])
    return autotune.resolve(ParallelConfig(**parallel), topo, grad_bytes)


def test_auto_measures_bucket_and_hierarchical_and_every_rank_agrees(capfd):
    parallel = {"dp": 4, "ranks_per_node": 2, "grad_bucket_mb": "auto", "hierarchical": "auto"}
    chosen = run_ranks(_resolve, 4, parallel, 5 * 2**20)
    assert len({(c.grad_bucket_mb, c.hierarchical) for c in chosen}) == 1
    assert chosen[0].grad_bucket_mb in (1, 4) and chosen[0].hierarchical in (True, False)
    log = capfd.readouterr().err
    assert "grad_bucket_mb=auto -> " in log and "GB/s" in log  # the choice with its figures
    assert "flat all-reduce" in log and "intra-node reduce-scatter" in log


def test_auto_in_training_changes_no_result(capfd):
    """Bucket boundaries do not change what is summed, and two ranks on one node reduce flat."""
    base = tiny_config(parallel={"dp": 2}, train={"steps": 2, "device": "cpu"})
    auto = tiny_config(parallel={"dp": 2, "grad_bucket_mb": "auto", "hierarchical": "auto"},
                       train={"steps": 2, "device": "cpu"})
    assert train_layout(auto)[0] == train_layout(base)[0]
    log = capfd.readouterr().err
    assert "grad_bucket_mb=auto -> 1 MiB" in log  # the tiny model's gradients are under 4 MiB
    assert "hierarchical=auto -> flat (each dp x cp group of 2 ranks is inside one node" in log


def test_attention_rate_and_profile_efficiency_on_cpu():
    """The accelerator's attention measurement, run on the CPU's flash kernel with tiny shapes:
    a rate, and an efficiency that is that rate over the peak given (shape law taken out)."""
    shape = {"tokens": 128, "heads": 2, "head_dim": 16}
    assert attention_tflops("FLASH_ATTENTION", dtype=torch.float32, **shape) > 0
    part, rows = attention_profile("cpu", bf16_peak_tflops=1e-3, shape=shape)
    # the CPU has flash and no cuDNN: one efficiency, and the other backend named as not run
    assert set(part) == {"attention_efficiency"} and part["attention_efficiency"] > 0
    assert [r["backend"] for r in rows if r["tflops"] is None] == ["CUDNN_ATTENTION"]


def test_flat_collectives_go_through_the_names_every_torch_has():
    """torch 2.13 renamed all_gather_into_tensor and reduce_scatter_tensor (to *_single); a GPU
    cluster's torch may be older (the H200 of docs/gpu.md ran 2.11). Only dist/comm.py names
    either spelling, and everything else calls its aliases: `tetrad bench comm` called the 2.13
    names directly and would stop with an AttributeError there."""
    import ast
    from pathlib import Path

    import tetrad
    renamed = {"all_gather_single", "reduce_scatter_single", "all_gather_into_tensor", "reduce_scatter_tensor"}
    src = Path(tetrad.__file__).parent
    calls = [f"{path.relative_to(src)}:{node.lineno}" for path in sorted(src.rglob("*.py")) if path.name != "comm.py"
             for node in ast.walk(ast.parse(path.read_text()))
             if isinstance(node, ast.Attribute) and node.attr in renamed]
    assert calls == []
