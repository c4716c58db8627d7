"""A signal stops a run after the step in flight, with a checkpoint there, on every rank alike;
the resumed run continues as if never stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from tetrad.train.checkpoint import step_dir
from tetrad.train.trainer import Trainer

from conftest import TINY, as_a_shell_starts, run_ranks, tiny_config, train_layout

SRC = str(Path(__file__).resolve().parents[1] / "src")
STEPS = 16


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def tetrad_train(run_dir: Path, *extra: str, session: bool = False, nohup: bool = False) -> subprocess.Popen:
    """`tetrad train` of the TINY config on dp=2, as a user runs it; `session`: in a process group
    of its own, as a terminal's foreground job (Ctrl-C reaches the whole group); `nohup`: started
    with SIGHUP ignored, as `nohup` starts it."""
    args = [f"--{section}.{key}={value}" for section, values in TINY.items() for key, value in values.items()]
    args += [f"--train.steps={STEPS}", "--train.device=cpu", "--parallel.dp=2", f"--run.dir={run_dir}", *extra]
    return subprocess.Popen([sys.executable, "-m", "tetrad", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"},
                            start_new_session=session,
                            preexec_fn=as_a_shell_starts((signal.SIGHUP,) if nohup else ()))


def _after_two_steps(proc: subprocess.Popen, run_dir: Path) -> None:
    deadline = time.monotonic() + 120
    while len(metrics(run_dir)) < 2 and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.02)


@lru_cache(maxsize=None)
def uninterrupted_losses(steps: int) -> tuple:
    """The losses of the runs below left to finish: one reference for each step count."""
    return tuple(train_layout(tiny_config(parallel={"dp": 2}, train={"steps": steps, "device": "cpu"}))[0])


# With a checkpoint written in the background every step, the stop publishes the one of its step.
@pytest.mark.parametrize("saving", [(), ("--checkpoint.every=1", "--checkpoint.async_save=true")],
                         ids=["no-checkpoints", "async-every-step"])
def test_sigterm_saves_and_the_resumed_run_matches_an_uninterrupted_one(tmp_path, saving):
    proc = tetrad_train(tmp_path, *saving)
    _after_two_steps(proc, tmp_path)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 128 + signal.SIGTERM, out
    reached = len(metrics(tmp_path))
    assert 2 <= reached < STEPS, out
    assert f"stopping on SIGTERM after step {reached} of {STEPS}; saved {step_dir(tmp_path / 'checkpoints', reached)}" in out
    assert "Traceback" not in out

    proc = tetrad_train(tmp_path, *saving)
    out = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 0, out
    assert f"(step {reached}); continuing at step {reached + 1}" in out
    combined = [r["loss"] for r in metrics(tmp_path)]

    assert tuple(combined) == uninterrupted_losses(STEPS)  # bitwise: a same-layout resume is exact


def test_ctrl_c_stops_saves_and_says_the_user_interrupted(tmp_path):
    """Ctrl-C: SIGINT to the terminal's foreground process group, the launcher and its ranks
    alike. The ranks finish the step in flight, save it, and the stop line says it was Ctrl-C
    (before: SIGTERM, which the launcher forwarded in its place); the launcher exits 130."""
    proc = tetrad_train(tmp_path, session=True)
    _after_two_steps(proc, tmp_path)
    os.killpg(proc.pid, signal.SIGINT)
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 128 + signal.SIGINT, out
    reached = len(metrics(tmp_path))
    assert 2 <= reached < STEPS, out
    assert (f"tetrad: stopping on SIGINT (Ctrl-C) after step {reached} of {STEPS}; "
            f"saved {step_dir(tmp_path / 'checkpoints', reached)}") in out
    assert "tetrad: stopped by SIGINT; every rank was stopped" in out and "Traceback" not in out


def test_a_run_started_under_nohup_ignores_the_hangup(tmp_path):
    """`nohup tetrad train ... &`, then the terminal closes: the shell sends SIGHUP to the job's
    process group, the launcher and its ranks alike, and the run, started ignoring it, goes on to
    its last step (before: the launcher and the ranks put their own handling in its place, and
    the run stopped on SIGHUP, exit 129)."""
    proc = tetrad_train(tmp_path, session=True, nohup=True)
    _after_two_steps(proc, tmp_path)
    os.killpg(proc.pid, signal.SIGHUP)
    out = proc.communicate(timeout=120)[0].decode()
    assert proc.returncode == 0 and len(metrics(tmp_path)) == STEPS, out


def _train_until_rank1_is_signalled(cfg):
    """Rank 1 alone gets SIGTERM once rank 0 has logged a step."""
    trainer = Trainer(cfg, torch.device("cpu"))
    if trainer.topo.rank == 1:
        def send():
            while not metrics(Path(cfg.run.dir)):
                time.sleep(0.01)
            os.kill(os.getpid(), signal.SIGTERM)
        threading.Thread(target=send, daemon=True).start()
    return len(trainer.fit())


def test_every_rank_stops_after_the_same_step():
    cfg = tiny_config(parallel={"dp": 2}, train={"steps": STEPS, "device": "cpu"})
    done = run_ranks(_train_until_rank1_is_signalled, 2, cfg)
    assert done[0] == done[1] < STEPS
    assert step_dir(Path(cfg.run.dir) / "checkpoints", done[0]).is_dir()


def test_a_closed_stdout_stops_the_run_as_sigterm_does(tmp_path):
    """`tetrad train ... | head`: the reader leaves after the first step's line; the run stops as
    on SIGTERM (the step in flight finishes, every rank saves it) and exits with SIGPIPE's status,
    saying so on stderr; the same command resumes exactly. It ended in rank 0's BrokenPipeError
    traceback, status 1, with no checkpoint: every step since the last one lost."""
    steps = 40  # a margin: the pipe closes within a step or two of the first line
    args = [f"--{section}.{key}={value}" for section, values in TINY.items() for key, value in values.items()]
    args += [f"--train.steps={steps}", "--train.device=cpu", "--parallel.dp=2", "--run.log_every=1",
             f"--run.dir={tmp_path}"]
    proc = subprocess.Popen([sys.executable, "-m", "tetrad", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"})
    while not proc.stdout.readline().startswith("step 1/"):
        assert proc.poll() is None, proc.stderr.read()
    proc.stdout.close()  # as `head` exits
    err = proc.communicate(timeout=120)[1]
    reached = len(metrics(tmp_path))
    assert proc.returncode == 128 + signal.SIGPIPE and 1 < reached < steps, err
    assert err == (f"tetrad: stopping on SIGPIPE (stdout's reader left) after step {reached} of {steps}; saved "
                   f"{step_dir(tmp_path / 'checkpoints', reached)}. Run the same command again to resume.\n")

    again = subprocess.run([sys.executable, "-m", "tetrad", "train", *args], capture_output=True, text=True,
                           timeout=300, env={**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"})
    assert again.returncode == 0 and f"(step {reached}); continuing at step {reached + 1}" in again.stdout, again.stderr
    assert tuple(r["loss"] for r in metrics(tmp_path)) == uninterrupted_losses(steps)


def test_a_closed_stdout_under_torchrun_ends_the_job_without_a_restart(tmp_path):
    """`torchrun ... -m tetrad train | head`: the ranks stop and save as above, and rank 0 exits 0,
    not 141, which torchrun counts as a failed worker: it restarted the job (--max-restarts), whose
    rank 0 failed again on its first line, then reported the job failed (ChildFailedError, 1)."""
    steps = 40
    args = [f"--{section}.{key}={value}" for section, values in TINY.items() for key, value in values.items()]
    args += [f"--train.steps={steps}", "--train.device=cpu", "--parallel.dp=2", "--run.log_every=1",
             f"--run.dir={tmp_path / 'run'}"]
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                             "--max-restarts=1", "-m", "tetrad", "train", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": SRC,
                                                                    "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp_path)})
    while not proc.stdout.readline().startswith("step 1/"):
        assert proc.poll() is None, proc.stderr.read()
    proc.stdout.close()
    err = proc.communicate(timeout=120)[1]
    reached = len(metrics(tmp_path / "run"))
    assert proc.returncode == 0 and 1 < reached < steps, err
    assert "restart" not in err and "FAILED" not in err, err
    assert err.count(f"tetrad: stopping on SIGPIPE (stdout's reader left) after step {reached} of {steps}; saved "
                     f"{step_dir(tmp_path / 'run' / 'checkpoints', reached)}.") == 1, err
