"""The publish protocol's states (train/checkpoint docstring) and the damage a disk or a person can
do, each resumed or refused by name, in one process: resume = "auto" takes the newest intact
checkpoint, sets a damaged one aside as step_N.bad and says so, and the resumed losses equal an
uninterrupted run's bitwise. Also the storage checks made before any rank starts."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemWriter

from conftest import run_ranks, tiny_config
from tetrad.config import ConfigError
from tetrad.train.checkpoint import CheckpointError, publish
from tetrad.train.checkpoint.preflight import check_storage
from tetrad.train.checkpoint.store import verify
from tetrad.train.trainer import Trainer

STEPS = 4


def _config(run_dir: Path, **sections):
    base = {"train": {"steps": STEPS}, "checkpoint": {"every": 2}, "run": {"dir": str(run_dir)}}
    return tiny_config(**{name: {**base.get(name, {}), **sections.get(name, {})} for name in {*base, *sections}})


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run of 4 steps with checkpoints at steps 2 and 4."""
    run_dir = tmp_path_factory.mktemp("finished")
    Trainer(_config(run_dir), torch.device("cpu")).fit()
    return run_dir


@pytest.fixture()
def run(finished, tmp_path):
    """A copy of the finished run to damage."""
    run_dir = tmp_path / "run"
    shutil.copytree(finished, run_dir)
    return run_dir


def _damage(ckpt: Path, how: str) -> None:
    shard, manifest = ckpt / "__0_0.distcp", ckpt / "tetrad.json"
    if how == "truncated shard":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif how == "flipped byte":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0x10
        shard.write_bytes(bytes(data))
    elif how == "missing shard":
        shard.unlink()
    elif how == "missing metadata":
        (ckpt / ".metadata").unlink()
    elif how == "garbled metadata":
        (ckpt / ".metadata").write_bytes(b"\x80\x04garbage")
    elif how == "missing manifest":
        manifest.unlink()
    elif how == "garbled manifest":
        manifest.write_bytes(b'{"format": 1, "st\xff')
    elif how == "manifest without files":
        data = json.loads(manifest.read_text())
        del data["files"]
        manifest.write_text(json.dumps(data))


DAMAGE = ["truncated shard", "flipped byte", "missing shard", "missing metadata", "garbled metadata",
          "missing manifest", "garbled manifest", "manifest without files"]
REASONS = {"truncated shard": "bytes, .* when written", "flipped byte": "SHA-256 differs", "missing shard": "missing",
           "missing metadata": "missing", "garbled metadata": "SHA-256 differs|bytes",
           "missing manifest": "tetrad.json cannot be read", "garbled manifest": "tetrad.json cannot be read",
           "manifest without files": "lacks or garbles files"}


@pytest.mark.parametrize("how", DAMAGE)
def test_damaged_newest_checkpoint_is_set_aside_and_the_previous_resumed(run, finished, how, capsys):
    root = run / "checkpoints"
    _damage(root / "step_00000004", how)
    history = Trainer(_config(run), torch.device("cpu")).fit()
    out = capsys.readouterr().out
    assert "step_00000004 is damaged and was set aside as step_00000004.bad; resuming from step_00000002" in out
    assert pytest.importorskip("re").search(REASONS[how], out), out
    assert [r["step"] for r in history] == [3, 4]
    assert _losses(run) == _losses(finished)  # bitwise: the same run, resumed from step 2
    assert (root / "step_00000004.bad").is_dir() and verify(root / "step_00000004")["step"] == 4


def test_a_step_damaged_again_is_set_aside_beside_the_first(run, finished, capsys):
    """step_4 was damaged and set aside once, trained again, and damaged again: the second copy is
    set aside too (not an OSError renaming onto the first's folder) and step 2 resumed."""
    root = run / "checkpoints"
    shutil.copytree(root / "step_00000004", root / "step_00000004.bad")
    _damage(root / "step_00000004", "missing shard")
    history = Trainer(_config(run), torch.device("cpu")).fit()
    assert "step_00000004 is damaged and was set aside as step_00000004.bad2" in capsys.readouterr().out
    assert [r["step"] for r in history] == [3, 4] and _losses(run) == _losses(finished)
    assert (root / "step_00000004.bad").is_dir() and (root / "step_00000004.bad2").is_dir()


def test_every_checkpoint_damaged_is_refused(run):
    root = run / "checkpoints"
    for step in (2, 4):
        _damage(root / f"step_{step:08d}", "flipped byte")
    with pytest.raises(CheckpointError, match="every checkpoint in .* failed its integrity check"):
        Trainer(_config(run), torch.device("cpu")).fit()


def test_another_models_checkpoint_is_refused_by_name(run):
    with pytest.raises(CheckpointError, match=r"written for a different model:\n  model\.d_model = 64 in the "
                                              r"checkpoint, 32 here"):
        Trainer(_config(run, model={"d_model": 32, "ffn_hidden": 64}), torch.device("cpu")).fit()


@pytest.mark.parametrize("pointer", [None, b"step_00000002\n", b"\x89PNG\r\n\x1a\n\x00\xff", b"../../etc"])
def test_latest_is_a_hint_the_newest_complete_checkpoint_is_resumed(run, finished, pointer, capsys):
    """A kill between the rename and the pointer leaves `latest` naming the previous step (or
    nothing, on the first save); a person or a disk can leave anything there."""
    latest = run / "checkpoints" / "latest"
    latest.unlink()
    if pointer is not None:
        latest.write_bytes(pointer)
    cfg = _config(run, train={"steps": STEPS + 1})
    history = Trainer(cfg, torch.device("cpu")).fit()
    assert history[0]["step"] == 5  # from step 4
    assert "step_00000004" in capsys.readouterr().out  # the choice, or the pointer's problem, said
    assert latest.read_text() == "step_00000005\n"  # rewritten by the next save


def test_partial_leftovers_never_block(run, finished):
    """Killed while writing shards, or before the rename: a .partial (even one holding a manifest,
    or a stray file of that name) is ignored by resume and replaced by the next save."""
    root = run / "checkpoints"
    shutil.rmtree(root / "step_00000004")
    shutil.copytree(root / "step_00000002", root / "step_00000004.partial")  # complete but not renamed
    (root / "latest").write_text("step_00000002\n")
    history = Trainer(_config(run), torch.device("cpu")).fit()
    assert [r["step"] for r in history] == [3, 4]
    assert _losses(run) == _losses(finished)
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_00000002", "step_00000004"]


def test_publishing_a_step_twice_replaces_it(tmp_path):
    """The publish window of issue 19: a step_N already there no longer fails the rename."""
    cfg = tiny_config()
    final = tmp_path / "step_00000003"
    for content in (b"first", b"second"):
        tmp = tmp_path / "step_00000003.partial"
        tmp.mkdir()
        (tmp / "data").write_bytes(content)
        publish(tmp, final, cfg, 3, {}, optimizer=True, layout={})
    assert (final / "data").read_bytes() == b"second" and not (tmp_path / "step_00000003.partial").exists()


@pytest.mark.parametrize("every", [0, 5])
def test_a_fresh_run_never_erases_an_earlier_runs_history(tmp_path, every):
    """every 5: the new run's first checkpoint would come after the 2 steps there, but they are not
    its own history killed before that checkpoint: the run that wrote them saved none."""
    run_dir = tmp_path / "run"
    Trainer(tiny_config(train={"steps": 2}, run={"dir": str(run_dir)}), torch.device("cpu")).fit()  # no checkpoints
    cfg = tiny_config(train={"steps": 2}, checkpoint={"every": every}, run={"dir": str(run_dir)})
    before = (run_dir / "metrics.jsonl").read_text()
    message = r"metrics\.jsonl holds 2 steps of an earlier run and this run starts afresh .* use a new run\.dir"
    with pytest.raises(ConfigError, match=message):
        check_storage(cfg)  # before spawn
    with pytest.raises(CheckpointError, match=message):
        Trainer(cfg, torch.device("cpu")).fit()  # and in the ranks
    assert (run_dir / "metrics.jsonl").read_text() == before


def test_a_run_killed_before_its_first_checkpoint_starts_again_over_its_own_history(tmp_path):
    cfg = tiny_config(train={"steps": 4}, checkpoint={"every": 3}, run={"dir": str(tmp_path)})
    trainer = Trainer(cfg, torch.device("cpu"))
    original = trainer.train_step

    def killed_at_step_3(step):
        if step == 2:
            raise InterruptedError("killed")
        return original(step)
    trainer.train_step = killed_at_step_3
    with pytest.raises(InterruptedError):
        trainer.fit()
    assert len(_losses(tmp_path)) == 2
    assert check_storage(cfg) is None  # a fresh start, not refused
    assert [r["step"] for r in Trainer(cfg, torch.device("cpu")).fit()] == [1, 2, 3, 4]
    assert len(_losses(tmp_path)) == 4


@pytest.mark.parametrize("resume", ["auto", "explicit"])
def test_resuming_another_models_checkpoint_is_refused_before_spawn(tmp_path, resume):
    """The same run.dir with a changed model shape: one line naming the keys and the fix, before
    any rank starts (it was rank 0's traceback at resume)."""
    saved = tiny_config(train={"steps": 1}, checkpoint={"every": 1}, run={"dir": str(tmp_path)})
    Trainer(saved, torch.device("cpu")).fit()
    target = {"resume": str(tmp_path / "checkpoints" / "step_00000001")} if resume == "explicit" else {}
    changed = tiny_config(model={"n_layers": saved.model.n_layers + 1}, checkpoint={"every": 1, **target},
                          run={"dir": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"written for a different model: model\.n_layers = \d+ in the checkpoint, "
                                          r"\d+ here; set those keys back .* or train this model in a new run\.dir"):
        check_storage(changed)
    check_storage(saved)  # the same model resumes


def test_failed_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    """A full disk at the second save (injected into DCP's file writer): one clear error, the first
    checkpoint intact and still `latest`."""
    cfg = tiny_config(train={"steps": 2}, checkpoint={"every": 1}, run={"dir": str(tmp_path)})
    original = FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if "step_00000002" in str(self.path):
            raise OSError(28, os.strerror(28))
        return original(self, plan, planner)
    monkeypatch.setattr(FileSystemWriter, "write_data", write_data)
    with pytest.raises(CheckpointError, match=r"saving step 2 to .*step_00000002\.partial failed \(.*No space left on "
                                              r"device.*\); the earlier checkpoints \['step_00000001'\] are untouched"):
        Trainer(cfg, torch.device("cpu")).fit()
    root = tmp_path / "checkpoints"
    assert verify(root / "step_00000001")["step"] == 1 and (root / "latest").read_text() == "step_00000001\n"


@pytest.mark.parametrize("sections,message", [
    (lambda d: {"run": {"dir": str(d / "file" / "run")}}, r"run\.dir=.*: .*file is a file, not a folder"),
    (lambda d: {"checkpoint": {"dir": str(d / "file")}}, r"checkpoint\.dir=.*file is a file, not a folder"),
    (lambda d: {"checkpoint": {"dir": "/sys/tetrad-checkpoints"}}, r"checkpoint\.dir='/sys/tetrad-checkpoints' cannot "
                                                                   r"be written \(/sys: Permission denied\)"),
    (lambda d: {"model": {"preset": "llama3-405b", "n_layers": 126}},  # 405e9 parameters: terabytes per checkpoint
     r"run\.dir=.* GiB free and a checkpoint of this model takes about \d+\.\d+ GiB"),
    (lambda d: {"checkpoint": {"resume": str(d / "nowhere")}}, r"checkpoint\.resume=.*nowhere' does not exist"),
    (lambda d: {"checkpoint": {"resume": str(d)}}, r"is not a tetrad checkpoint"),
])
def test_storage_problems_are_found_before_spawn(tmp_path, sections, message):
    (tmp_path / "file").write_text("")
    overrides = sections(tmp_path)
    overrides.setdefault("run", {}).setdefault("dir", str(tmp_path / "run"))
    cfg = tiny_config(**overrides) if "preset" not in overrides.get("model", {}) else _big(overrides)
    with pytest.raises(ConfigError, match=message):
        check_storage(cfg)


def _big(overrides):
    from tetrad.config import load_config
    return load_config(overrides=overrides, runtime=False)


def _verify_own_view(paths: list[Path]):
    """Verify the checkpoint as this rank's file system shows it (`paths[rank]`)."""
    import torch.distributed as dist
    rank = dist.get_rank()
    try:
        return "ok", verify(paths[rank], rank, len(paths))["step"]
    except CheckpointError as e:
        return "refused", str(e)


def _choose_in_own_view(roots: list[Path]):
    """newest_good on the checkpoint root as this rank's file system shows it (`roots[rank]`)."""
    import torch.distributed as dist
    from tetrad.train.checkpoint.recovery import newest_good
    rank = dist.get_rank()
    try:
        chosen, _ = newest_good(roots[rank], _config(roots[rank].parent).model, rank, len(roots))
        return "resumed", chosen.name
    except CheckpointError as e:
        return "stopped", str(e)


def test_a_checkpoint_another_node_does_not_show_yet_stops_the_run_and_stays(finished, tmp_path):
    """The newest checkpoint is whole where rank 0 reads it and not yet shown on rank 1's node:
    resuming the older one would set the newer aside as damaged and lose its steps. The run stops
    on every rank, naming the lag, and the newer checkpoint stays where it is."""
    views = [tmp_path / f"rank{r}" / "checkpoints" for r in range(2)]
    for view in views:
        shutil.copytree(finished / "checkpoints", view)
    (views[1] / "step_00000004" / "tetrad.json").unlink()
    results = run_ranks(_choose_in_own_view, 2, views)
    assert [status for status, _ in results] == ["stopped", "stopped"], results
    assert all("not shown on every node" in message and "nothing was set aside" in message for _, message in results)
    assert (views[0] / "step_00000004").is_dir() and not list(views[0].glob("*.bad*"))


def test_a_manifest_one_rank_cannot_read_is_refused_on_every_rank(finished, tmp_path):
    """Rank 1's file system shows a garbled tetrad.json where rank 0's shows the good one (a shared
    file system that has not caught up on every node): every rank refuses the checkpoint, naming
    the rank, rather than rank 1 going on without a manifest."""
    good = finished / "checkpoints" / "step_00000004"
    seen_by_rank1 = tmp_path / "step_00000004"
    shutil.copytree(good, seen_by_rank1)
    (seen_by_rank1 / "tetrad.json").write_text("{")
    results = run_ranks(_verify_own_view, 2, [good, seen_by_rank1])
    assert [status for status, _ in results] == ["refused", "refused"], results
    # (Each rank names its own path here: the test gives the two views two folders.)
    assert all("ranks [1] cannot read" in message and "JSONDecodeError" in message for _, message in results), results
