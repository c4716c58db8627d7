"""Chaos: SIGKILL a rank at a random moment of a run, in three layouts (data parallel with ZeRO-3,
pipeline, context parallel), including inside a save, between its rename and the `latest`
pointer, and between ranks finishing their shards; `resume = "auto"` then continues and every
loss equals an uninterrupted run's bitwise. A stalled rank ends the job naming it.

Each case draws its step and rank from a seed printed in the test's output and in every failure
message: rerun one with TETRAD_CHAOS_SEED=<seed> pytest tests/test_chaos.py -k <case>.
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import FileSystemWriter

from conftest import run_ranks, tiny_config, train_layout
from tetrad.launch import RankFailure
from tetrad.train.checkpoint import checkpointer
from tetrad.train.trainer import Trainer

pytestmark = pytest.mark.dist

STEPS, EVERY = 6, 2
# "async_save": checkpoints written in the background (train/checkpoint/background.py).
LAYOUTS = {"dp2-zero3": {"dp": 2, "zero": 3}, "pp2": {"pp": 2}, "cp2": {"cp": 2}, "dp2-async": {"dp": 2, "async_save": True}}


def _config(layout: dict, run_dir: Path):
    parallel = {k: v for k, v in layout.items() if k != "async_save"}
    return tiny_config(parallel=parallel, train={"steps": STEPS, "micro_batch": 1}, run={"dir": str(run_dir)},
                       checkpoint={"every": EVERY, "async_save": layout.get("async_save", False)})


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Each layout's uninterrupted losses, trained once."""
    cache = {}

    def losses(name: str) -> list[float]:
        if name not in cache:
            cache[name] = train_layout(_config(LAYOUTS[name], tmp_path_factory.mktemp(name)))[0]
        return cache[name]
    return losses


def _seed() -> int:
    seed = int(os.environ.get("TETRAD_CHAOS_SEED", random.randrange(2**31)))
    print(f"chaos seed {seed}")
    return seed


def _killer(where: str, step: int, rank: int):
    """Patch, in this forked rank only, the place where `rank` kills itself at checkpoint `step`
    (where = "step": when training reaches `step`)."""
    me = dist.get_rank()

    def die():
        if me == rank:
            os.kill(os.getpid(), signal.SIGKILL)
    name = f"step_{step:08d}"
    if where == "step":
        original_step = Trainer.train_step
        Trainer.train_step = lambda self, s: (die() if s == step else None) or original_step(self, s)
    elif where == "inside save":  # while writing its shards
        original_write = FileSystemWriter.write_data
        FileSystemWriter.write_data = lambda self, plan, planner: (
            (die() if name in str(self.path) else None) or original_write(self, plan, planner))
    elif where == "between shards":  # its shards written, before hashing: the other ranks finish theirs
        original_digest = checkpointer.digest_files
        checkpointer.digest_files = lambda folder, r, w, *hashed: (
            (die() if name in str(folder) else None) or original_digest(folder, r, w, *hashed))
    elif where == "between renames":  # step_N renamed from .partial, `latest` not yet moved
        original_replace = checkpointer.replace_text
        checkpointer.replace_text = lambda path, text: (
            (die() if path.name == "latest" and name in text else None) or original_replace(path, text))


def _train_until_killed(cfg, where: str, step: int, rank: int):
    _killer(where, step, rank)
    Trainer(cfg, torch.device("cpu")).fit()


# (layout, where the kill lands): every layout has a kill during training and one inside the
# checkpoint protocol. The rank killed inside the protocol is rank 0 between renames (only rank 0
# renames), any rank elsewhere.
CASES = [("dp2-zero3", "step"), ("dp2-zero3", "inside save"), ("pp2", "step"), ("pp2", "between renames"),
         ("cp2", "step"), ("cp2", "between shards"),
         # In the background write's thread; and at its publish, a later step's end. (A kill at a
         # step may come before or after the newest write is published: not drawn here.)
         ("dp2-async", "inside save"), ("dp2-async", "between shards")]


@pytest.mark.parametrize("name,where", CASES)
def test_sigkill_anywhere_resumes_bitwise(name, where, reference, tmp_path):
    rng = random.Random(seed := _seed())
    cfg = _config(LAYOUTS[name], tmp_path)
    world = cfg.parallel.world_size
    if where == "step":
        step, rank = rng.randint(1, STEPS - 1), rng.randrange(world)
        restart = step // EVERY * EVERY
    else:
        step, rank = rng.choice(range(EVERY, STEPS, EVERY)), 0 if where == "between renames" else rng.randrange(world)
        restart = step if where == "between renames" else step - EVERY
    what = f"{name}: rank {rank} killed {where} at step {step} (chaos seed {seed})"
    with pytest.raises(RankFailure, match=f"rank {rank} died by SIGKILL"):
        run_ranks(_train_until_killed, world, cfg, where, step, rank)
    resumed, _, history = train_layout(cfg)  # checkpoint.resume = "auto"
    assert history[0]["step"] == restart + 1, what
    assert _losses(tmp_path) == reference(name), what  # the whole history, bitwise
    assert resumed == reference(name)[restart:], what
