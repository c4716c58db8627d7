"""The launcher and test harness: results come back, and a failing rank ends the job with its
traceback, or its signal, instead of a hang."""

import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import as_a_shell_starts
from tetrad.device import threads_per_rank
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


def test_threads_per_rank_share_the_cores_unless_the_user_set_them(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = os.cpu_count() or 1
    assert threads_per_rank(1) == cores and threads_per_rank(4 * cores) == 1
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # e.g. a machine shared with other jobs
    assert threads_per_rank(1) == 1
    assert [r[1] for r in run_local(_sum_of_ranks, 1, timeout_s=60)] == [1]
    monkeypatch.setenv("OMP_NUM_THREADS", "")  # unset in effect
    assert threads_per_rank(1) == cores


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


# A launcher in its own process, as `tetrad train` is: ranks record their pid and which signal
# reached them, then wait to be stopped.
LAUNCHER = """
import os, signal, sys, time
from pathlib import Path
import torch.distributed as dist
from tetrad.launch import Stopped, run_local

def rank(folder):
    def on_term(signum, frame):
        Path(folder, f"term{dist.get_rank()}").write_text(signal.Signals(signum).name)
        os._exit(0)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_term)
    dist.barrier()
    Path(folder, f"pid{dist.get_rank()}").write_text(str(os.getpid()))
    time.sleep(120)

if __name__ == "__main__":  # spawned ranks (the fork server's) load this file as a module
    try:
        run_local(rank, 3, (sys.argv[1],), timeout_s=200, stop_grace_s=20, spawn=sys.argv[2] == "spawn")
    except Stopped as e:
        sys.exit(128 + e.signum)
"""


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its reaper does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _start_launcher(tmp_path, start: str = "fork"):
    import subprocess
    import sys
    script = tmp_path / "launcher.py"
    script.write_text(LAUNCHER)
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), start], preexec_fn=as_a_shell_starts())
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("pid*"))) < 3:
        assert time.monotonic() < deadline and proc.poll() is None, "the ranks did not start"
        time.sleep(0.1)
    time.sleep(0.2)  # the files are written; let the pids settle into sleep
    return proc, [int((tmp_path / f"pid{r}").read_text()) for r in range(3)]


def _wait_gone(pids, within_s: float) -> list[int]:
    deadline = time.monotonic() + within_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("sig,start", [(signal.SIGTERM, "fork"), (signal.SIGINT, "fork"), (signal.SIGHUP, "fork"),
                                       (signal.SIGTERM, "spawn")])
def test_signal_to_launcher_reaches_every_rank_as_itself(tmp_path, sig, start):
    """As torchrun's agent forwards it: a rank's stop line can then say Ctrl-C (SIGINT) from a
    scheduler's SIGTERM (before: every signal reached the ranks as SIGTERM). Spawned CPU ranks
    come from a fork server, whose children the launcher signals as its own."""
    proc, pids = _start_launcher(tmp_path, start)
    proc.send_signal(sig)
    assert proc.wait(timeout=30) == 128 + sig
    assert {p.name: p.read_text() for p in tmp_path.glob("term*")} == dict.fromkeys(("term0", "term1", "term2"),
                                                                                    sig.name)
    assert _wait_gone(pids, 5) == []


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_killed_launcher_takes_its_ranks(tmp_path, start):
    """A fork server's ranks too: the server exits with the launcher, and their parent-death signal
    fires then."""
    proc, pids = _start_launcher(tmp_path, start)
    proc.kill()
    proc.wait(timeout=10)
    assert _wait_gone(pids, 10) == []  # Linux's parent-death signal, not the 120 s sleep
    assert list(tmp_path.glob("term*")) == []  # killed, not asked


def _records_pid_then_rank_1_dies(folder):
    Path(folder, f"pid{dist.get_rank()}").write_text(str(os.getpid()))
    dist.barrier()
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def test_killed_rank_ends_the_job_promptly_without_orphans(tmp_path):
    start = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 died by SIGKILL .*out-of-memory killer sends SIGKILL"):
        run_local(_records_pid_then_rank_1_dies, 3, (str(tmp_path),), timeout_s=60, pg_timeout_s=20)
    assert time.monotonic() - start < 20
    assert _wait_gone([int(p.read_text()) for p in tmp_path.glob("pid*")], 1) == []


def test_a_config_error_under_torchrun_is_said_once(tmp_path):
    """Every rank refuses a bad config and exits non-zero without a traceback, but one line says
    why (global rank 0's), not one per rank; torchrun's failure summary gives that line as the
    root cause (the error file torch's @record writes; before: 'To enable traceback see ...')."""
    import re
    import subprocess
    import sys
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m", "tetrad", "train",
         "--parallel.tp=3", f"--run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode != 0
    line = "tetrad: config error: tp=3 does not divide n_heads=4; use tp in [1, 2]"
    assert len(re.findall(f"^{re.escape(line)}$", out.stderr, re.MULTILINE)) == 1, out.stderr
    # torchrun's summary: rank 0 exited 2, rank 1 too (or torchrun stopped it first: rank 0 did not wait)
    assert "exitcode  : 2" in out.stderr and out.stderr.count("exitcode  : ") == 2, out.stderr
    root_cause = out.stderr.partition("Root Cause (first observed failure):")[2]
    assert f"traceback : {line}\n" in root_cause and "To enable traceback" not in out.stderr, out.stderr
    assert "tetrad/" not in out.stderr  # no rank's traceback (torchrun's own names no tetrad file)


_CRASHES = """
import sys
from tetrad.cli import COMMANDS, main

def crash(argv):
    raise RuntimeError("a bug, not the user's mistake")
COMMANDS["crash"] = crash  # a command that fails as a bug in tetrad would
sys.exit(main(["crash"]))
"""


def test_a_crash_under_torchrun_keeps_its_traceback_in_torchruns_summary(tmp_path):
    """A rank that crashes prints its traceback, and torchrun's summary gives it as the root
    cause too (before: 'To enable traceback see ...', the traceback only in the rank's output)."""
    import subprocess
    import sys
    script = tmp_path / "crash.py"
    script.write_text(_CRASHES)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
                          str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode != 0
    rank_output, _, root_cause = out.stderr.partition("Root Cause (first observed failure):")
    assert "RuntimeError: a bug, not the user's mistake" in rank_output  # the rank's own traceback
    assert "traceback : Traceback (most recent call last):" in root_cause, out.stderr
    assert 'in crash\n      raise RuntimeError("a bug, not the user\'s mistake")' in root_cause, out.stderr


_RANKS_OWN_REFUSAL = """
import os
import sys
from tetrad.cli import main
tp = {"0": "3", "1": "5"}[os.environ["RANK"]]  # as a file missing on one node: a refusal of its own
sys.exit(main(["train", f"--parallel.tp={tp}", *sys.argv[1:]]))
"""


def test_a_refusal_rank_0_does_not_share_is_said_by_its_rank(tmp_path):
    """Rank 0 says the job's refusal alone only where the others' is the same (torchrun's store
    carries rank 0's to them): a rank that refuses otherwise says its own."""
    import subprocess
    import sys
    script = tmp_path / "per_rank.py"
    script.write_text(_RANKS_OWN_REFUSAL)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
         f"--run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode != 0
    for tp in (3, 5):  # a line of its own each (torchrun's summary quotes them after "traceback : ")
        assert out.stderr.count(f"\ntetrad: config error: tp={tp} does not divide n_heads=4; use tp in [1, 2]\n") \
            + out.stderr.startswith(f"tetrad: config error: tp={tp} ") == 1, out.stderr
    assert "tetrad/" not in out.stderr


_REFUSAL_OF_RANK_1 = """
import sys
from tetrad.launch import says_refusal
print(says_refusal(sys.argv[1], wait_s=1.0))
"""


def test_a_refusal_rank_0_never_posts_is_said_alone_after_the_wait(tmp_path):
    """Rank 0 passed (a file missing on rank 1's node only): rank 1 waits for rank 0's word in
    torchrun's agent store, then says its own refusal, and nothing else: no c10d lines on stderr
    (store.wait's timeout logged two 'waitForInput ... likely a timeout' warnings before it).
    Where rank 0 posted the same refusal rank 1 stays quiet; a different one, rank 1 says its own."""
    import subprocess
    import sys
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = {**os.environ, "TORCHELASTIC_RUN_ID": "t", "RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
           "MASTER_PORT": str(store.port), "TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_RESTART_COUNT": "0"}
    script = tmp_path / "rank1.py"
    script.write_text(_REFUSAL_OF_RANK_1)

    def rank_1(message, agent_store=True):
        run_env = env if agent_store else {k: v for k, v in env.items() if k != "TORCHELASTIC_USE_AGENT_STORE"}
        out = subprocess.run([sys.executable, str(script), message], capture_output=True, text=True, timeout=60,
                             env=run_env)
        return out.stdout, out.stderr
    assert rank_1("tp=3") == ("True\n", "")
    store.set("tetrad/refusal/0", "tp=3")
    assert rank_1("tp=3") == ("False\n", "") and rank_1("tp=5") == ("True\n", "")
    # No agent store (srun's ranks, etcd rendezvous): nothing says what rank 0 refused, so every rank speaks
    assert rank_1("tp=3", agent_store=False) == ("True\n", "")


_LIBRARY_USER = """
import sys
from tetrad import launch
from tetrad.config import ConfigError, load_config
cfg = load_config(overrides=sys.argv[1:])  # as a library user builds it: no world size, no node size
try:
    launch.train(cfg)
except ConfigError as e:
    print("config error:", e)
    sys.exit(3)
"""


def test_launch_train_under_torchrun_checks_the_job(tmp_path):
    """launch.train (not only `tetrad train`) takes torchrun's world size: a layout of the wrong
    size is a ConfigError naming the dp that fits, before any rank trains. (A layout that fits
    trains, its ranks_per_node torchrun's: tests/test_torchrun.py, through the same launch.train.)"""
    import subprocess
    import sys
    script = tmp_path / "user.py"
    script.write_text(_LIBRARY_USER)
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script),
         "--parallel.dp=1", "--parallel.ranks_per_node=8", "--train.steps=1", "--train.global_batch=4",
         "--train.micro_batch=2", "--model.n_layers=1", "--model.d_model=32", "--model.ffn_hidden=64",
         "--model.seq_len=16", f"--run.dir={run_dir}"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode != 0
    assert "dp*tp*pp*cp = 1*1*1*1 = 1 but the job has 2 ranks; set parallel.dp=2" in out.stdout
    assert not (run_dir / "metrics.jsonl").exists()


_GROUPS_GONE = """
import os
import torch
from tetrad import launch
from tetrad.dist.layout import Layout
from tetrad.dist.topology import Topology
def threads():
    return len(os.listdir("/proc/self/task"))
torch.ones(2).sum()
before = threads()
with launch.torchrun_process_group("cpu"):
    topo = Topology(Layout(tp=2), torch.device("cpu"))
    topo.comm.all_reduce(torch.ones(3), "tp")
    during = threads()
    topo.close()
del topo
print(before, during, threads())
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_torchruns_groups_and_their_threads_end_with_the_process_group(tmp_path):
    """torchrun_process_group leaves no gloo worker thread behind: the groups end on the way out,
    not in the interpreter's exit, where a worker still releasing its last collective's tensors
    takes the GIL and aborts the process ('terminate called without an active exception': `tetrad
    generate` under torchrun failed 1 run in 6). Before, reference cycles (DeviceMesh's, the
    Topology's) kept every group and its threads until then."""
    import subprocess
    import sys
    script = tmp_path / "groups.py"
    script.write_text(_GROUPS_GONE)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    for line in out.stdout.splitlines():
        before, during, after = map(int, line.split())
        assert during > before and after == before, line
    assert len(out.stdout.splitlines()) == 2


_SHORT_OF_MEMORY = """
import sys
from tetrad import device
from tetrad.cli import main
device.host_memory_gib = lambda: ({free}, {base})  # (GiB the host has free, this process's resident GiB)
sys.exit(main(sys.argv[1:]))
"""


def _torchrun_with_host_memory(tmp_path, free: float, base: float) -> str:
    """stderr of a 2-rank CPU run under torchrun on a host that says it has `free` GiB, each process `base`."""
    import subprocess
    import sys
    script = tmp_path / "short.py"
    script.write_text(_SHORT_OF_MEMORY.format(free=free, base=base))
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script), "train",
         "--parallel.dp=2", "--train.steps=1", "--train.global_batch=4", "--train.micro_batch=2",
         "--model.n_layers=1", "--model.d_model=32", "--model.ffn_hidden=64", "--model.seq_len=16",
         f"--run.dir={tmp_path / 'run'}"],
        capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stderr


def test_cpu_ranks_under_torchrun_are_warned_of_the_hosts_memory_once_a_node(tmp_path):
    """torchrun's CPU ranks get the host-memory warning `tetrad train`'s own launcher gives, once a
    node (local rank 0, counting LOCAL_WORLD_SIZE ranks), and the run goes on: a warning, not a
    refusal (before: nothing under torchrun)."""
    err = _torchrun_with_host_memory(tmp_path, 0.001, 0.25)  # 1 MiB free: any run is predicted not to fit
    assert err.count("tetrad: warning: the planner predicts ") == 1, err
    assert "GiB for this run's 2 CPU rank(s), above the 0.0 GiB this host has free" in err, err


def test_torchruns_ranks_are_not_counted_twice_against_the_hosts_memory(tmp_path):
    """Under torchrun the node's ranks already run, torch loaded: what they hold is already gone
    from the host's free memory, so the warning counts the planner's peaks alone (before: a process
    each again, which warned of 2 x 0.5 GiB more than was missing; the tiny model's peaks are
    about 0.12 GiB)."""
    assert "tetrad: warning" not in _torchrun_with_host_memory(tmp_path, 0.5, 0.5)
