"""What a run prints and logs: plain lines off a terminal, the bar on one, the resume message,
the closing line after a resume, and wandb beside metrics.jsonl."""

from __future__ import annotations

import fcntl
import importlib.machinery
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import types
from pathlib import Path

import pytest

from tetrad.config import ConfigError

from conftest import tiny_config, train_layout

TINY_ARGS = ["--model.n_layers=2", "--model.d_model=64", "--model.n_heads=4", "--model.n_kv_heads=2",
             "--model.ffn_hidden=128", "--model.seq_len=32", "--train.global_batch=8", "--train.micro_batch=2",
             "--train.warmup=1", "--train.device=cpu"]
SRC = str(Path(__file__).resolve().parents[1] / "src")


def tetrad_train(run_dir: Path, *args: str, stdout=subprocess.PIPE) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "tetrad", "train", *TINY_ARGS, f"--run.dir={run_dir}", *args],
                            stdout=stdout, stderr=subprocess.STDOUT if stdout == subprocess.PIPE else stdout, env=env)


def test_plain_lines_off_a_terminal_then_a_resume_says_where_it_starts(tmp_path):
    proc = tetrad_train(tmp_path, "--train.steps=4", "--run.log_every=2", "--checkpoint.every=4",
                        "--train.eval_every=3", "--train.eval_steps=1", "--data.val_fraction=0.1")
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 0, out
    assert "\r" not in out  # no progress bar in a log file
    lines = [line for line in out.splitlines() if line.startswith("step ")]
    assert [line.split(" |")[0] for line in lines] == ["step 1/4", "step 2/4", "step 3/4", "step 4/4"]
    assert ["val_loss" in line for line in lines] == [False, False, True, True]  # evaluation steps are logged
    assert "lr " in lines[-1] and "elapsed" in lines[-1]
    assert "at step 1 ->" in out.splitlines()[-1] and ", val_loss " in out.splitlines()[-1]
    proc = tetrad_train(tmp_path, "--train.steps=6", "--run.log_every=2", "--checkpoint.every=4",  # and at the last
                        "--model.sliding_window=8")  # the same weights attend otherwise: allowed, and said
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 0, out
    assert (f"resumed from {tmp_path / 'checkpoints' / 'step_00000004'} (step 4); continuing at step 5; "
            "model.sliding_window = 0 in the checkpoint, 8 here; train.steps = 4 before, 6 here (the learning rate "
            "follows this run's schedule)") in out  # the cosine decay, over by step 4, climbs again: said
    closing = out.splitlines()[-1]
    assert " at step 5 -> " in closing and closing.split(" at step ")[-1].startswith("6;"), closing
    proc = tetrad_train(tmp_path, "--train.steps=6", "--checkpoint.every=4")  # once more: the run is finished
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 0, out
    assert out.splitlines()[-1] == (f"tetrad: {tmp_path / 'checkpoints' / 'step_00000006'} is step 6 and train.steps = "
                                    "6: nothing left to train; raise train.steps to continue this run, or use a new "
                                    "run.dir"), out


def test_progress_bar_on_a_terminal(tmp_path):
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a window's size, as a terminal has
    proc = tetrad_train(tmp_path, "--train.steps=3", "--run.log_every=1", stdout=terminal)
    os.close(terminal)
    chunks = []
    while True:
        try:
            chunk = os.read(controller, 4096)
        except OSError:  # EIO: the terminal's other end is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(controller)
    assert proc.wait(timeout=120) == 0
    out = b"".join(chunks).decode(errors="replace")
    assert "train: 100%" in out and "3/3" in out and "\rtrain:" in out  # tqdm redraws one line
    assert "step 1/3 |" not in out


class RecordingWandb(types.ModuleType):
    """The part of wandb's API that tetrad uses (init -> a run with log and finish), writing each
    call to a file, since the ranks are forked processes."""

    def __init__(self, path: Path):
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.path = path

    def _record(self, *call) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(call) + "\n")

    def init(self, project, name, dir, config):
        self._record("init", project, name, config["train"]["steps"])
        return self

    def log(self, numbers, step):
        self._record("log", step, numbers["loss"])

    def finish(self):
        self._record("finish")


def test_wandb_gets_each_step(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", RecordingWandb(tmp_path / "calls.jsonl"))
    cfg = tiny_config(train={"steps": 2, "device": "cpu"}, run={"wandb": True, "wandb_project": "p",
                                                                "dir": str(tmp_path / "run")})
    _, _, history = train_layout(cfg)
    calls = [json.loads(line) for line in (tmp_path / "calls.jsonl").read_text().splitlines()]
    assert calls == [["init", "p", "run", 2], *(["log", r["step"], r["loss"]] for r in history), ["finish"]]


def test_wandb_enabled_but_not_installed_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # what find_spec reports for a missing package
    with pytest.raises(ConfigError, match="run.wandb=true needs the optional `wandb` package"):
        tiny_config(run={"wandb": True})
