"""A collective that does not complete ends the run with the op, the group and the missing ranks."""

import time

import pytest
import torch

from tetrad import launch
from tetrad.dist.layout import Layout
from tetrad.dist.topology import Topology

pytestmark = pytest.mark.dist


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
