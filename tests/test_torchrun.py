"""`tetrad torchrun`: torchrun itself, with `tetrad train`'s checks before any worker starts (a
config mistake is not restarted --max-restarts times) and a failure said in one line."""

import json
import os
import signal
import subprocess
import sys

import pytest

from tetrad.cli import main
from test_launch import _CRASHES  # a command that fails as a bug in tetrad would

pytestmark = pytest.mark.dist


def _torchrun(tmp_path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tetrad", "torchrun", "--standalone", "--nproc-per-node=2", *argv],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})


def test_a_config_mistake_is_refused_before_any_worker_starts(tmp_path):
    """A layout that does not fill the job (dp=1 on 2 ranks) is one line and exit 2, from the
    launching process: no worker starts, so --max-restarts=3 does not start the job 4 times to
    refuse it again (under torchrun every attempt refuses, each a ChildFailedError report, for
    torchrun restarts on any non-zero exit and lets no worker say 'do not restart')."""
    out = _torchrun(tmp_path, "--max-restarts=3", "-m", "tetrad", "train", "--parallel.dp=1",
                    f"--run.dir={tmp_path / 'run'}")
    assert out.returncode == 2, out.stderr
    assert out.stderr == "tetrad: config error: dp*tp*pp*cp = 1*1*1*1 = 1 but the job has 2 ranks; set parallel.dp=2\n"
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_console_script_without_python_is_checked_too(tmp_path, capsys):
    """`--no-python tetrad train` (torchrun running the `tetrad` console script, by name or path) is
    `-m tetrad train`, checked before any worker starts (before: only `-m tetrad` was, and the
    workers met the mistake, --max-restarts times). In this process: the check is the launching
    process's own, and the test above runs that process whole."""
    for script in ("tetrad", "/an/env/bin/tetrad"):
        assert main(["torchrun", "--standalone", "--nproc-per-node=2", "--max-restarts=3", "--no-python", script,
                     "train", "--parallel.dp=1", f"--run.dir={tmp_path / 'run'}"]) == 2
        assert capsys.readouterr().err == \
            "tetrad: config error: dp*tp*pp*cp = 1*1*1*1 = 1 but the job has 2 ranks; set parallel.dp=2\n"


def test_a_job_that_passes_the_checks_trains_as_under_torchrun(tmp_path):
    """The checks before the spawn leave the run as torchrun's workers find it (no folder, file or
    resume decision of their own): the ranks train, take ranks_per_node from torchrun's
    LOCAL_WORLD_SIZE (not the config's 8), and rank 0 alone says what `tetrad train` says of the run
    (layout, data, the closing line)."""
    run = tmp_path / "run"
    out = _torchrun(tmp_path, "-m", "tetrad", "train", "--parallel.dp=2", "--parallel.ranks_per_node=8",
                    "--train.steps=1", "--train.global_batch=4", "--train.micro_batch=2", "--model.n_layers=1",
                    "--model.d_model=32", "--model.ffn_hidden=64", "--model.seq_len=16", f"--run.dir={run}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ranks_per_node = 2" in (run / "config.toml").read_text()
    for line in ("tetrad: training tiny with dp=2 tp=1 pp=1 cp=1 (2 ranks on cpu), 1 step,",  # not "1 steps"
                 "tetrad: data: ", f"at step 1; metrics in {run}/metrics.jsonl"):
        assert out.stdout.count(line) == 1, (line, out.stdout)


def test_a_failed_job_ends_in_one_line_naming_its_first_failure(tmp_path):
    """A rank's crash (after the checks: a bug) is restarted as torchrun restarts it, its traceback
    printed by the rank; the job then ends with one line naming the first rank that failed and its
    exception, not torchrun's ChildFailedError traceback of the launching process."""
    script = tmp_path / "crash.py"
    script.write_text(_CRASHES)
    out = _torchrun(tmp_path, "--max-restarts=1", str(script))
    assert out.returncode == 1
    assert "RuntimeError: a bug, not the user's mistake\n" in out.stderr  # the rank's own traceback
    last = out.stderr.splitlines()[-1]
    assert last.startswith("tetrad torchrun: rank ") and last.endswith(
        " exited with code 1, the first to fail; the job was stopped: RuntimeError: a bug, not the user's mistake"), last
    assert "ChildFailedError" not in out.stderr and "torch/distributed/run.py" not in out.stderr, out.stderr


def test_a_refusal_only_a_rank_meets_is_its_line(tmp_path):
    """A refusal the launching process cannot see first (here `tetrad eval`, which it does not
    check) is each rank's line, said once by rank 0, and the closing line gives it as the cause."""
    out = _torchrun(tmp_path, "-m", "tetrad", "eval", str(tmp_path / "missing"))
    assert out.returncode == 2
    refusal = f"tetrad: config error: {tmp_path / 'missing'} does not exist; name a tetrad checkpoint"
    lines = out.stderr.splitlines()
    assert sum(line.startswith(refusal) for line in lines) == 1, out.stderr
    assert lines[-1].startswith("tetrad torchrun: rank ") and f"the job was stopped: {refusal}" in lines[-1], lines[-1]


def _failure(tmp_path, rank: int, exitcode: int, refusal_at: int | None):
    """torchrun's record of a rank that ended with `exitcode`, having written tetrad's refusal to its
    error file at `refusal_at` (seconds; None: no error file)."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure
    error_file = tmp_path / f"error{rank}.json"
    if refusal_at is not None:
        error_file.write_text(json.dumps({"message": {"message": "tetrad: config error: refused",
                                                      "extraInfo": {"timestamp": str(refusal_at)}}}))
    return ProcessFailure(local_rank=rank, pid=1000 + rank, exitcode=exitcode, error_file=str(error_file))


def test_a_rank_the_agent_stopped_is_not_the_first_failure(tmp_path):
    """Every rank of a refusal writes it to its error file; rank 1 wrote first, rank 0 then refused
    and exited, and torchrun's agent stopped rank 1 with SIGTERM: the job's cause is rank 0's
    refusal, not rank 1's signal (torchrun's own first failure is rank 1's, the earlier file)."""
    from tetrad.torchrun import first_failure
    failures = {0: _failure(tmp_path, 0, 2, 1001), 1: _failure(tmp_path, 1, -signal.SIGTERM, 1000)}
    assert first_failure(failures) == (0, failures[0])
    alone = {1: _failure(tmp_path, 1, -signal.SIGTERM, None)}  # a SIGTERM with no other failure is the cause
    assert first_failure(alone) == (1, alone[1])
    killed = {0: _failure(tmp_path, 0, 1, 1002), 1: _failure(tmp_path, 1, -signal.SIGKILL, 1000)}
    assert first_failure(killed) == (1, killed[1])  # another signal (the OOM killer's) is the rank's own failure


def test_a_signal_to_it_stops_the_ranks_and_is_its_exit_status(tmp_path):
    """SLURM's SIGTERM to `tetrad torchrun` (its agent) reaches the ranks as torchrun forwards it:
    they stop after the step in flight and save, and the command ends with one line and 128 + 15
    (torchrun's own: a SignalException traceback and exit 1)."""
    import signal
    import time
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "tetrad", "torchrun", "--standalone", "--nproc-per-node=2", "-m", "tetrad", "train",
         "--parallel.dp=2", "--train.steps=100000", "--train.global_batch=4", "--train.micro_batch=2",
         "--model.n_layers=1", "--model.d_model=32", "--model.ffn_hidden=64", "--model.seq_len=16", f"--run.dir={run}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp_path)})
    deadline = time.monotonic() + 90
    while not ((run / "metrics.jsonl").exists() and (run / "metrics.jsonl").read_text()) and proc.poll() is None:
        assert time.monotonic() < deadline, "no step within 90 s"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    assert err.splitlines()[-1] == "tetrad torchrun: stopped by SIGTERM, forwarded to this node's ranks", err[-2000:]
    assert list((run / "checkpoints").glob("step_*")), err[-2000:]  # the ranks saved where they stopped
