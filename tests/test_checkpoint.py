"""Checkpoints: exact resume after a kill, resharding across layouts, atomic saves, integrity."""

import hashlib
import importlib.util
import json
import os
import pickle
import random
import signal
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from conftest import run_ranks, tiny_config, train_layout
from tetrad.launch import RankFailure
from tetrad.train.checkpoint import CheckpointError, Checkpointer, resolve
from tetrad.train.trainer import Trainer

pytestmark = pytest.mark.dist

STEPS = 6
PIPELINE_READY = importlib.util.find_spec("tetrad.parallel.pipeline.executor") is not None


def metrics_losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def _train_until_killed(cfg, rank: int, step: int):
    """Train, but SIGKILL `rank` when it reaches `step` (patched in this forked rank only)."""
    original = Trainer.train_step

    def train_step(self, s):
        if s == step and self.topo.rank == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, s)

    Trainer.train_step = train_step
    Trainer(cfg, torch.device("cpu")).fit()


def _train_crashing_in_save(cfg, rank: int, step: int):
    """Train, but SIGKILL `rank` in the middle of writing checkpoint `step`."""
    original = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if f"step_{step:08d}" in str(self.path) and torch.distributed.get_rank() == rank:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(self, plan, planner)

    FileSystemWriter.write_data = write_data
    Trainer(cfg, torch.device("cpu")).fit()


@pytest.fixture(scope="module")
def dp2_reference():
    """An uninterrupted dp=2 run (checkpointing every step: saving must not change the numbers)."""
    cfg = tiny_config(parallel={"dp": 2}, train={"steps": STEPS}, checkpoint={"every": 1})
    losses, _, _ = train_layout(cfg)
    return losses


def test_killed_rank_resumes_bitwise(dp2_reference):
    step = random.Random(9).randint(1, STEPS - 1)  # seeded: a random but reproducible step
    cfg = tiny_config(parallel={"dp": 2}, train={"steps": STEPS}, checkpoint={"every": 2})
    with pytest.raises(RankFailure, match="rank 1 died by SIGKILL"):
        run_ranks(_train_until_killed, 2, cfg, 1, step)
    resumed, _, history = train_layout(cfg)  # checkpoint.resume = "auto"
    assert history[0]["step"] == step // 2 * 2 + 1  # continued from the last checkpoint, not from 0
    # Same arithmetic in the same order from bitwise-restored state: exact equality, not closeness.
    assert metrics_losses(cfg.run.dir) == dp2_reference
    assert resumed == dp2_reference[step // 2 * 2:]


def test_crash_during_save_keeps_previous_checkpoint(dp2_reference):
    cfg = tiny_config(parallel={"dp": 2}, train={"steps": STEPS}, checkpoint={"every": 1, "keep": 2})
    root = Path(cfg.run.dir) / "checkpoints"
    with pytest.raises(RankFailure, match="rank 1 died by SIGKILL"):
        run_ranks(_train_crashing_in_save, 2, cfg, 1, 3)
    assert (root / "latest").read_text().strip() == "step_00000002"
    assert not (root / "step_00000003").exists() and (root / "step_00000003.partial").exists()
    with pytest.raises(CheckpointError, match="interrupted save"):
        resolve(root / "step_00000003.partial")
    train_layout(cfg)  # resumes from step 2
    assert metrics_losses(cfg.run.dir) == dp2_reference
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000005", "step_00000006"]  # keep = 2


RESHARD_CASES = [
    ({"dp": 2, "tp": 2}, {}),
    ({"dp": 2, "tp": 2}, {"dp": 4}),
    ({"dp": 2, "tp": 2}, {"cp": 2, "dp": 2}),
    pytest.param({"dp": 2, "tp": 2, "pp": 2}, {}, marks=pytest.mark.skipif(
        not PIPELINE_READY, reason="needs the pipeline executor (parallel.pp > 1)")),
    pytest.param({"dp": 2, "tp": 2, "pp": 2}, {"dp": 4, "pp": 2}, marks=pytest.mark.skipif(
        not PIPELINE_READY, reason="needs the pipeline executor (parallel.pp > 1)")),
]


@pytest.mark.parametrize("source,target", RESHARD_CASES)
def test_reshard_and_continue(source, target):
    # vocab 251 is padded to 252 under tp=2: the checkpoint must hold the unpadded logical tensors.
    model = {"vocab_size": 251}
    src = tiny_config(parallel=source, model=model, train={"steps": STEPS}, checkpoint={"every": 3})
    ref_losses, ref_state, _ = train_layout(src)
    saved = Path(src.run.dir) / "checkpoints"

    # Loading the final checkpoint under the target layout gives the saved parameters bitwise.
    tgt = tiny_config(parallel=target, model=model, train={"steps": STEPS},
                      checkpoint={"resume": str(saved / "step_00000006")})
    _, loaded, _ = train_layout(tgt)
    assert loaded.keys() == ref_state.keys()
    assert all(torch.equal(loaded[k], ref_state[k]) for k in ref_state)

    # Continuing from step 3 under the target layout follows the uninterrupted run. fp32; the only
    # difference is the order of the tp / dp sums (~1e-7 relative per step, as in test_dp).
    tgt = tiny_config(parallel=target, model=model, train={"steps": STEPS},
                      checkpoint={"resume": str(saved / "step_00000003")})
    losses, state, _ = train_layout(tgt)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[3:]), rtol=1e-5, atol=1e-6)
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-4, atol=1e-5, msg=name)


# ------------------------------------------------------------------------------ integrity (one process)
@pytest.fixture()
def saved_checkpoint():
    """A 2-step single-process run checkpointed at step 2, trained in this process (no ranks)."""
    cfg = tiny_config(train={"steps": 2}, checkpoint={"every": 2})
    Trainer(cfg, torch.device("cpu")).fit()
    return cfg, Path(cfg.run.dir) / "checkpoints" / "step_00000002"


def assert_refused(cfg, path, message):
    """Loading `path` raises CheckpointError matching `message` and leaves the model untouched."""
    trainer = Trainer(cfg, torch.device("cpu"))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    params = dict(trainer.model.named_parameters())
    with pytest.raises(CheckpointError, match=message):
        Checkpointer(cfg, trainer.topo, path.parent).load(path, params, trainer.optimizer)
    assert all(torch.equal(before[k], v) for k, v in trainer.model.state_dict().items())


def _hashes(path):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in path.iterdir()}


@pytest.mark.parametrize("damage,message", [
    ("truncate", r"__0_0\.distcp: \d+ bytes, \d+ when written \(truncated\?\)"),
    ("flip", r"__0_0\.distcp: SHA-256 differs .* \(corrupt\)"),
    ("manifest", r"tetrad\.json cannot be read"),
])
def test_damaged_checkpoint_is_refused(saved_checkpoint, damage, message):
    cfg, path = saved_checkpoint
    shard = path / "__0_0.distcp"
    data = shard.read_bytes()
    if damage == "truncate":
        shard.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        shard.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    else:
        (path / "tetrad.json").write_text('{"format": 1, "st')
    hashes = _hashes(path)
    assert_refused(cfg, path, message)
    assert _hashes(path) == hashes  # nothing was rewritten


def test_wrong_model_shape_is_refused(saved_checkpoint):
    cfg, path = saved_checkpoint
    other = tiny_config(model={"d_model": 32, "ffn_hidden": 64})
    assert_refused(other, path, r"tetrad\.json was written for a different model:\n"
                                r"  model\.d_model = 64 in the checkpoint, 32 here\n"
                                r"  model\.ffn_hidden = 128 in the checkpoint, 64 here")


def test_metadata_pickle_cannot_run_code(saved_checkpoint):
    """Even with a matching manifest (an attacker can rewrite it), .metadata admits no foreign class."""
    cfg, path = saved_checkpoint

    class Evil:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    (path / ".metadata").write_bytes(pickle.dumps(Evil()))
    manifest = json.loads((path / "tetrad.json").read_text())
    data = (path / ".metadata").read_bytes()
    manifest["files"][".metadata"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "tetrad.json").write_text(json.dumps(manifest))
    assert_refused(cfg, path, r"\.metadata cannot be read: .*system is not allowed")
