"""A collective that does not complete ends the run with the op, the group and the missing ranks."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tetrad import launch
from tetrad.dist import watchdog
from tetrad.dist.layout import Layout
from tetrad.dist.topology import Topology

pytestmark = pytest.mark.dist
SRC = str(Path(__file__).resolve().parents[1] / "src")


def _one_rank_hangs(async_op: bool):
    topo = Topology(Layout(dp=3), torch.device("cpu"))
    topo.comm.all_reduce(torch.ones(4), "dp")  # call 1 completes
    if topo.rank == 2:
        time.sleep(30)  # hung in "compute": never joins call 2
    topo.comm.all_reduce(torch.ones(4), "dp", async_op=async_op).wait()


@pytest.mark.parametrize("async_op", [False, True])
def test_timeout_names_op_group_and_missing_ranks(async_op):
    start = time.monotonic()
    with pytest.raises(launch.RankFailure) as failure:
        launch.run_local(_one_rank_hangs, 3, (async_op,), timeout_s=60, pg_timeout_s=2)
    message = str(failure.value)
    assert "CollectiveTimeout: all_reduce on group dp (ranks [0, 1, 2], call 2 on that group) did not complete: " \
           "ranks [2] did not arrive" in message
    assert "rank 2 posted nothing" in message
    assert time.monotonic() - start < 20  # two timeouts and the start-up, not the 30 s hang


def _timeouts_of_every_group():
    topo = Topology(Layout(dp=2, tp=2), torch.device("cpu"))
    watchdog.set_timeouts(7.0, world_too=False)
    groups = list(torch.distributed.distributed_c10d._world.pg_map)
    cpu = torch.device("cpu")
    return {topo.group(name) is not None for name in ("dp", "tp", "dp_cp")}, sorted(
        g._get_backend(cpu).options._timeout.total_seconds() for g in groups if g is not torch.distributed.group.WORLD)


def test_the_collective_timeout_reaches_every_group():
    """The mesh groups got torch's default 1800 s, whatever the launcher set (issue 19)."""
    for made, timeouts in launch.run_local(_timeouts_of_every_group, 4, timeout_s=60, pg_timeout_s=30):
        assert made == {True} and len(timeouts) >= 4 and set(timeouts) == {7.0}


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return sorted(int(c) for c in f.read().split())  # forked one after another: rank order


def test_a_stopped_rank_ends_the_job_naming_it(tmp_path):
    """SIGSTOP one rank of dp2 x tp2 mid-training (what issue 19 saw hang for 25 minutes): the job
    ends within the collective timeout and a minute, the message names the stopped rank and the
    step, and no rank is left."""
    run_dir, stopped = tmp_path / "run", 2
    args = ["--parallel.dp=2", "--parallel.tp=2", "--train.steps=100000", "--train.device=cpu",
            "--parallel.collective_timeout_s=5", "--parallel.startup_timeout_s=60", f"--run.dir={run_dir}",
            "--model.n_layers=2", "--model.d_model=64", "--model.ffn_hidden=128", "--model.seq_len=32",
            "--train.global_batch=4", "--train.micro_batch=2"]
    proc = subprocess.Popen([sys.executable, "-m", "tetrad", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": SRC})
    deadline = time.monotonic() + 120
    metrics = run_dir / "metrics.jsonl"
    while (not metrics.exists() or len(metrics.read_text().splitlines()) < 3) and time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.1)
    ranks = _children(proc.pid)
    assert len(ranks) == 4
    os.kill(ranks[stopped], signal.SIGSTOP)
    start = time.monotonic()
    out = proc.communicate(timeout=300)[0]
    assert time.monotonic() - start < 5 * 60 and proc.returncode == 1, out
    assert re.search(rf"CollectiveTimeout: at step \d+: \w+ on group \w+ .* did not complete: ranks \[{stopped}\] "
                     rf"did not arrive\n  rank {stopped} posted nothing", out), out
    assert not any(os.path.exists(f"/proc/{r}") and open(f"/proc/{r}/stat").read().split(")")[1].split()[0] != "Z"
                   for r in ranks)
