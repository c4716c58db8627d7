"""`launch.train`, `tetrad train` from Python: every check runs before any rank starts
(train/preflight.py), so a library user gets the CLI's one line as a ConfigError instead of a
rank's traceback; a good config trains."""

import json

import pytest
import torch

from tetrad import launch
from tetrad.cli import main
from tetrad.config import ConfigError, load_config

# CLI arguments of configs refused before any rank starts, one per check preflight runs.
REFUSED = {
    "schedule": ["--model.n_layers=4", "--parallel.pp=2", "--parallel.vpp=2", "--parallel.schedule=interleaved",
                 "--train.global_batch=4", "--train.micro_batch=4"],
    "offload_on_cpu": ["--train.device=cpu", "--train.offload_optimizer=true"],
    "missing_init_from": ["--parallel.dp=2", "--checkpoint.init_from={tmp}/nothing"],
    "init_from_not_a_checkpoint": ["--parallel.dp=2", "--checkpoint.init_from={tmp}/empty"],
    "missing_data": ["--parallel.dp=2", "--data.source={tmp}/nothing.bin"],
    "earlier_history": ["--parallel.dp=2", "--run.dir={tmp}/earlier"],
    "missing_cuda": pytest.param(["--train.device=cuda"], marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="this machine has a cuda device")),
}


def _no_rank(*args, **kwargs):
    raise AssertionError("a rank started")


@pytest.mark.parametrize("argv", REFUSED.values(), ids=REFUSED.keys())
def test_the_library_refuses_before_any_rank_with_the_cli_line(argv, tmp_path, capsys, monkeypatch):
    (tmp_path / "empty").mkdir()
    (tmp_path / "earlier").mkdir()
    (tmp_path / "earlier" / "metrics.jsonl").write_text("".join(json.dumps({"step": s}) + "\n" for s in (1, 2, 3)))
    argv = [f"--run.dir={tmp_path / 'run'}", "--train.steps=2"] + [a.format(tmp=tmp_path) for a in argv]
    monkeypatch.setattr(launch, "run_local", _no_rank)
    assert main(["train", *argv]) == 2
    cli = capsys.readouterr().err
    with pytest.raises(ConfigError) as library:
        launch.train(load_config(overrides=argv))
    assert cli == f"tetrad: config error: {library.value}\n"
    assert not (tmp_path / "run").exists()


def test_a_good_config_trains_after_the_announcement(tmp_path):
    cfg = load_config(overrides={"train": {"steps": 1, "device": "cpu"}, "run": {"dir": str(tmp_path / "run")}})
    announced = []
    history = launch.train(cfg, announce=lambda device_type, resume: announced.append((device_type, resume)),
                           timeout_s=120)
    assert announced == [("cpu", None)]
    assert [r["step"] for r in history] == [1]
