"""A refusal one rank meets alone (a ConfigError: its device out of memory, another process on its
GPU) ends every rank at once, as that one line, although the others wait in a collective that on
NCCL would wait for it until the group's timeout (gloo's fail as soon as its connection closes, so
the waiting rank here waits as NCCL's would: on something only the launcher's kill ends)."""

import datetime
import time

import pytest
import torch.distributed as dist

from tetrad.config import ConfigError
from tetrad.launch import RankFailure, run_local

pytestmark = pytest.mark.dist

LINE = "cuda out of memory while decoding at bf16, tp 2; pass --tp 4 to split the model over 4 GPUs"


def _refuses_while_rank_0_waits(never: str):
    dist.barrier()  # both ranks are in the job before rank 1 refuses
    if dist.get_rank() == 1:
        raise ConfigError(LINE)
    # As an NCCL collective waits for a rank that never joins: until the group's timeout, whatever
    # became of that rank (a key nobody sets, in a store of this rank's own).
    dist.FileStore(never, 1).wait(["never"], datetime.timedelta(seconds=600))


def _crashes_on_rank_1():
    if dist.get_rank() == 1:
        raise RuntimeError("a bug")
    dist.barrier()


def test_one_ranks_refusal_ends_every_rank_at_once_as_its_line(tmp_path):
    """The refusing rank exits non-zero, the launcher kills the waiting one and raises the line as
    a ConfigError (what `tetrad` prints alone, exit 2), not a RankFailure with a traceback."""
    start = time.monotonic()
    with pytest.raises(ConfigError) as refused:
        run_local(_refuses_while_rank_0_waits, 2, (str(tmp_path / "never"),), timeout_s=60)
    assert str(refused.value) == LINE and time.monotonic() - start < 20


def test_a_crash_is_still_a_rank_failure_with_its_traceback():
    with pytest.raises(RankFailure, match=r"(?s)rank 1 failed:.*RuntimeError: a bug"):
        run_local(_crashes_on_rank_1, 2, timeout_s=60)
