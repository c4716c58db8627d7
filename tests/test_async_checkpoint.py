"""checkpoint.async_save: training goes on while a checkpoint is written; what is written is the
state of its step, bitwise the synchronous save's; it is published only once every rank's write
is done; a failed write is one CheckpointError on every rank, the earlier checkpoints untouched.

Slow and failing storage are test doubles of DCP's FileSystemWriter (a subclass that sleeps, or
raises, before writing), installed inside each rank."""

import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from conftest import run_ranks, tiny_config, train_layout
from test_checkpoint import read_logical
from tetrad.launch import RankFailure
from tetrad.train.checkpoint import background
from tetrad.train.trainer import Trainer

pytestmark = pytest.mark.dist

LAYOUT = {"dp": 2, "zero": 1}


def _config(run_dir: Path, async_save: bool, layout: dict = LAYOUT, **checkpoint):
    return tiny_config(parallel=layout, train={"steps": 4, "micro_batch": 1},
                       checkpoint={"every": 2, "async_save": async_save, **checkpoint}, run={"dir": str(run_dir)})


class SlowWriter(FileSystemWriter):
    """Storage that takes a second before it writes a rank's files."""

    def write_data(self, plan, planner):
        time.sleep(1.0)
        return super().write_data(plan, planner)


class FullOnRank1(FileSystemWriter):
    """Storage that is full for rank 1."""

    def write_data(self, plan, planner):
        if dist.get_rank() == 1:
            raise OSError(28, "No space left on device")
        return super().write_data(plan, planner)


def _train_timed(cfg, writer):
    """Train with `writer` as the storage; (losses, when each step ended)."""
    background.FileSystemWriter = writer  # this rank's process only
    trainer = Trainer(cfg, torch.device("cpu"))
    ended, step = [], trainer.train_step

    def timed(i):
        record = step(i)
        ended.append(time.time())
        return record
    trainer.train_step = timed
    return [r["loss"] for r in trainer.fit()], ended


def test_training_goes_on_while_the_checkpoint_is_written_and_it_holds_its_step(tmp_path):
    sync_losses, _, _ = train_layout(_config(tmp_path / "sync", False))
    (losses, ended), _ = run_ranks(_train_timed, 2, _config(tmp_path / "async", True), SlowWriter)
    assert losses == sync_losses  # saving in the background changes nothing of the run
    step2 = tmp_path / "async" / "checkpoints" / "step_00000002"
    # Step 3 ran while step 2's files were being written: the checkpoint was published after it.
    assert (step2 / "tetrad.json").stat().st_mtime > ended[2]
    # What was written is step 2's state, though steps 3 and 4 changed the tensors meanwhile.
    written, synced = read_logical(step2), read_logical(tmp_path / "sync" / "checkpoints" / "step_00000002")
    assert written.keys() == synced.keys()
    assert all(torch.equal(written[k], synced[k]) for k in synced)
    assert (tmp_path / "async" / "checkpoints" / "latest").read_text() == "step_00000004\n"


# Per-rank state (the codec's error feedback), ZeRO-3's shards, and tp x pp's boxes.
@pytest.mark.parametrize("layout", [{"dp": 2, "grad_codec": "int8"}, {"dp": 2, "zero": 3}, {"tp": 2, "pp": 2}],
                         ids=["dp2-int8", "dp2-zero3", "tp2-pp2"])
def test_a_background_checkpoint_resumes_bitwise(tmp_path, layout):
    losses, _, _ = train_layout(_config(tmp_path / "a", True, layout))
    saved = tmp_path / "a" / "checkpoints" / "step_00000002"
    resumed, _, history = train_layout(_config(tmp_path / "b", True, layout, resume=str(saved)))
    assert history[0]["step"] == 3 and resumed == losses[2:]


def test_a_failed_background_write_stops_every_rank_and_keeps_the_earlier_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(RankFailure) as failure:
        run_ranks(_train_timed, 2, _config(run_dir, True), FullOnRank1)
    message = str(failure.value)
    assert "saving step 2" in message and "rank 1: " in message and "No space left on device" in message, message
    root = run_dir / "checkpoints"
    assert not (root / "step_00000002").exists() and not (root / "latest").exists()
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()][:2] == [1, 2]


def test_a_background_checkpoint_in_one_process_without_torch_distributed(tmp_path):
    cfg = _config(tmp_path / "a", True, layout={})
    losses = [r["loss"] for r in Trainer(cfg, torch.device("cpu")).fit()]
    saved = tmp_path / "a" / "checkpoints" / "step_00000002"
    resumed = Trainer(_config(tmp_path / "b", True, layout={}, resume=str(saved)), torch.device("cpu")).fit()
    assert [r["loss"] for r in resumed] == losses[2:]
