"""The launcher and test harness: results come back, and a failing rank ends the job with its
traceback, or its signal, instead of a hang."""

import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

from tetrad.launch import RankFailure, run_local

pytestmark = pytest.mark.dist


def _sum_of_ranks():
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return float(t), torch.get_num_threads()


def _raises_on_rank_1():
    if dist.get_rank() == 1:
        raise ValueError("rank one exploded")
    dist.barrier()


def _aborts_on_rank_2():
    if dist.get_rank() == 2:
        os.kill(os.getpid(), signal.SIGABRT)  # what a mismatched gloo collective does
    dist.barrier()


def _hangs_on_rank_0():
    dist.barrier()  # both ranks are fully connected before rank 1 leaves
    if dist.get_rank() == 0:
        time.sleep(60)


def test_results_from_every_rank():
    results = run_local(_sum_of_ranks, 4, timeout_s=60)
    assert [r[0] for r in results] == [6.0] * 4
    assert all(r[1] == 1 for r in results)  # 4 ranks on 2 cores: one thread each


def test_exception_names_rank_and_traceback():
    with pytest.raises(RankFailure, match=r"(?s)rank 1 failed:.*ValueError: rank one exploded"):
        run_local(_raises_on_rank_1, 4, timeout_s=60, pg_timeout_s=20)


def test_signal_death_is_reported():
    with pytest.raises(RankFailure, match="rank 2 died by SIGABRT"):
        run_local(_aborts_on_rank_2, 4, timeout_s=60, pg_timeout_s=20)


def test_hang_ends_at_deadline():
    start = time.monotonic()
    with pytest.raises(RankFailure, match=r"deadline; ranks \[0\] had not finished"):
        run_local(_hangs_on_rank_0, 2, timeout_s=10)
    assert time.monotonic() - start < 25
