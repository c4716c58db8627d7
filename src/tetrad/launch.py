"""Start the ranks of a job: local processes when not under torchrun, or the environment
torchrun gives. The same `run_local` serves `tetrad train` on a laptop and the multi-process tests;
`train` is `tetrad train` from Python (the checks, then the ranks).

A rank that raises or dies ends the whole job: the others are killed and the error names the
first rank that failed, with its traceback (or the signal that killed it), or is its refusal (a
ConfigError: one line, what to change) raised here as itself. Nothing hangs:
process groups get a finite timeout and `run_local` a wall-clock deadline.

No rank outlives its launcher. SIGTERM, SIGINT or SIGHUP to the launcher (a scheduler, Ctrl-C,
a closed terminal) reaches every rank as itself, as torchrun's agent forwards a signal, so that a
rank that saves and stops on it can say which it was (Ctrl-C's SIGINT is the user's, SIGTERM a
scheduler's); the launcher waits `stop_grace_s` for them, then kills what is left. A terminal
sends SIGINT and SIGHUP to the whole process group, so a rank may get one twice, directly and
forwarded: the same stop. A rank that does not handle them (outside a training loop) ends on
each, as on SIGTERM. A launcher that dies without a word (SIGKILL, a crash) takes its ranks with
it: each rank asks Linux for SIGKILL when its parent dies (prctl PR_SET_PDEATHSIG), or, where its
parent is not the launcher (the fork server's ranks) or off Linux, watches the launcher's pid
(rank_lifetime.py). Signals are blocked while the ranks are forked, so none is lost between a
fork and the rank setting up its own handling.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import importlib
import json
import multiprocessing
import multiprocessing.connection
import os
import pickle
import signal
import tempfile
import threading
import time
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from tetrad import device as devices
from tetrad.config import Config, ConfigError, counted, validate
from tetrad.rank_lifetime import die_with_launcher


class RankFailure(RuntimeError):
    """A rank raised, died by a signal, or the job ran past its deadline."""


class Stopped(KeyboardInterrupt):
    """The launcher was asked to stop by a signal; its ranks have been stopped."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


# What a launcher forwards to its ranks, each as itself.
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def in_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def is_job_rank_zero() -> bool:
    """Whether this process is rank 0 of a torchrun job: the process group's rank once it exists,
    before that torchrun's RANK."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank() == 0
    return os.environ.get("RANK") == "0"


def speaks_for_the_job() -> bool:
    """Whether this process prints what the job says once (the closing line): every process
    outside torchrun, global rank 0 under it (1024 ranks, one line)."""
    return not in_torchrun() or is_job_rank_zero()


def says_refusal(message: str, wait_s: float = 20.0) -> bool:
    """Whether this process prints `message`, the job's refusal: every process outside torchrun;
    under it rank 0, which posts it in torchrun's agent store (and waits, 5 s at most, for the others
    to read it), and another rank only where rank 0's differs or has not come within `wait_s` (rank
    0 passed). A refusal every rank meets is one
    line, not one per rank; one that only some meet (a file missing on one node) is still said.
    Under torchrun every refusing rank also writes it to its error file (`_tell_torchrun`)."""
    if not in_torchrun():
        return True
    _tell_torchrun(message)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":  # no agent store (srun, etcd): no way to
        return True  # know what rank 0 says, and a refusal only some rank meets must not go unsaid
    key = f"tetrad/refusal/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    try:
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                              timeout=datetime.timedelta(seconds=wait_s))
        if is_job_rank_zero():  # stays until the others read it: torchrun stops them once one exits
            store.set(key, message)
            others, deadline = int(os.environ.get("WORLD_SIZE", "1")) - 1, time.monotonic() + min(wait_s, 5.0)
            while store.add(f"{key}/read", 0) < others and time.monotonic() < deadline:
                time.sleep(0.02)  # ranks that met no refusal never read it: 5 s at most
            return True
        deadline, pause = time.monotonic() + wait_s, 0.05
        while not store.check([key]):  # polled: store.wait's timeout logs two c10d warnings on stderr
            if time.monotonic() > deadline:
                return True  # no word from rank 0
            time.sleep(pause)
            pause = min(2 * pause, 1.0)  # a thousand ranks asking the agent's store, at most once a second each
        differs = store.get(key).decode() != message
        store.add(f"{key}/read", 1)
        return differs
    except (KeyError, ValueError, RuntimeError):  # no store to reach (DistError)
        return True



def _tell_torchrun(line: str) -> None:
    """Have torchrun's failure summary give this rank's refusal as its root cause: the one line, in
    the error file torch.distributed.elastic reads (`@record`'s format, less the traceback), not
    'To enable traceback see ...'. torchrun's own process still prints its ChildFailedError
    traceback: it raises one for any non-zero exit, and runs no tetrad code that could stop it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if path:
        now = str(int(time.time()))
        Path(path).write_text(json.dumps({"message": {"message": line, "extraInfo": {"timestamp": now}}}))


def for_torchrun_job(cfg: Config) -> Config:
    """`cfg` with the facts torchrun knows, checked against its job: the ranks on each node
    (LOCAL_WORLD_SIZE, which decides where hierarchical groups split, whatever the config says)
    and the world size dp*tp*pp*cp must equal (a ConfigError naming the dp that fits)."""
    if "LOCAL_WORLD_SIZE" in os.environ:
        cfg = replace(cfg, parallel=replace(cfg.parallel, ranks_per_node=int(os.environ["LOCAL_WORLD_SIZE"])))
    validate(cfg, int(os.environ["WORLD_SIZE"]))
    return cfg


def diagnose_nccl(device_type: str, trace_dir: Path) -> None:
    """NCCL reports a hang only from its own watchdog thread, which ends the process: turn on what
    says where it hung, as torchtitan does (the user's own settings win). The flight recorder keeps
    each rank's last collectives and dumps them on a timeout to trace_dir/rank_N; then
    `python -m torch.distributed.flight_recorder.fr_trace trace_dir` names the ranks that did not
    join. Async error handling 3 tears the process down without cleanup, so the launcher sees it."""
    if devices.backend_for(device_type) != "nccl":
        return
    trace_dir.mkdir(parents=True, exist_ok=True)
    for key, value in (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"), ("TORCH_NCCL_TRACE_BUFFER_SIZE", "20000"),
                       ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"), ("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", f"{trace_dir}/rank_")):
        os.environ.setdefault(key, value)


@contextlib.contextmanager
def torchrun_process_group(device_type: str, timeout_s: float = 600.0):
    """Join the process group torchrun set up (env:// rendezvous), bind LOCAL_RANK's device, and
    destroy the groups on the way out, so the backend shuts down cleanly: freed in the interpreter's
    exit (reference cycles keep them), a gloo worker taking the GIL there aborted the process."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = devices.bind_rank(device_type, local_rank)
    dist.init_process_group(devices.backend_for(device_type), timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if device.type != "cpu" else None)
    try:
        yield device
    finally:
        dist.destroy_process_group()
        gc.collect()  # the groups' threads end here (their destructors release the GIL to join them)


def run_local(fn: Callable[..., Any], world_size: int, args: tuple = (), *, device_type: str = "cpu",
              timeout_s: float | None = None, pg_timeout_s: float = 600.0, spawn: bool = False,
              stop_grace_s: float = 60.0) -> list[Any]:
    """Run `fn(*args)` on `world_size` fresh local ranks joined in one process group; return each
    rank's result (which must pickle). `fn` finds its rank through torch.distributed.

    CPU ranks are forked (90x faster to start than spawn, docs/platform.md) unless `spawn`: a forked
    rank inherits its parent's heap, whose free blocks it reuses without growing, so a measurement
    of the resident set wants a fresh heap. CPU ranks with `spawn` come from multiprocessing's fork
    server, which loads torch and the trainer once and forks each rank from that clean state: a
    spawned rank's heap, without each rank's ~6 s of CPU loading them; each rank takes this process's
    environment as it is now, but what a library read at its load (glibc's MALLOC_* variables) is
    the server's, fixed when it started. Accelerator ranks are always spawned, since a forked child
    cannot use a CUDA context. A signal to this process stops the ranks (module docstring) and
    raises `Stopped`; they get `stop_grace_s` to finish before they are killed.
    """
    method = "spawn" if device_type != "cpu" else "forkserver" if spawn else "fork"
    ctx = multiprocessing.get_context(method)
    if method == "fork":  # torch.optim's constructor loads torch._dynamo (~1.8 s of CPU): once here, not per rank
        importlib.import_module("torch._dynamo")
    elif method == "forkserver":
        ctx.set_forkserver_preload(["torch._dynamo", "tetrad.train.trainer"])
    # Accelerator ranks too: train.offload_optimizer's AdamW runs on the host, and the planner gives it
    # the rank's share of the node's memory bandwidth, which one thread (a core) cannot draw.
    threads = devices.threads_per_rank(world_size)
    with tempfile.TemporaryDirectory(prefix="tetrad-rdzv-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, name=f"tetrad-rank{rank}",
                             args=(fn, args, rank, world_size, store_path, device_type, threads, pg_timeout_s, tmp,
                                   os.getpid(), dict(os.environ)))
                 for rank in range(world_size)]
        with _stop_on_signals():
            try:
                _start(procs, threads)
                _wait(procs, timeout_s, Path(tmp))
            except Stopped as e:
                _stop(procs, e.signum, stop_grace_s)
                raise
            except BaseException:
                _kill(procs)
                raise
        return [pickle.loads((Path(tmp) / f"rank{r}.out").read_bytes()) for r in range(world_size)]


def train(cfg: Config, *, announce: Callable[[str, Path | None], None] | None = None,
          timeout_s: float | None = None, work: Callable | None = None, forward_only: bool = False,
          trace_dir: Path | None = None) -> Any:
    """Train `cfg` (from `load_config`) as `tetrad train` does: on this machine's ranks, or on this
    rank under torchrun; or, given `work`, do that with each rank's Trainer instead of `fit`, and
    return rank 0's result (`forward_only`: a Trainer without gradients or optimizer, which writes
    nothing: `tetrad eval`'s `Trainer.evaluate`). Every check runs first, here, once (under
    torchrun once per process, as `tetrad train`): a bad config or a missing file is one
    ConfigError, the text `tetrad train` prints, and no rank starts. `announce(device_type, resume)`
    is called after the checks, before the ranks start (under torchrun on rank 0 alone; resume: the
    checkpoint the run continues from, or None). `timeout_s` is run_local's deadline; `trace_dir`
    where NCCL's flight recorder dumps a hang (default RUN_DIR/nccl_trace). Returns the
    per-step records (or `work`'s result) of rank 0 (this rank's under torchrun)."""
    from tetrad.train.preflight import preflight, warn_of_host_memory  # here: run_local's other users need not load the trainer
    from tetrad.train.trainer import Trainer, train_on_this_rank
    work = work or Trainer.fit
    if in_torchrun():
        cfg = for_torchrun_job(cfg)
    device_type = devices.resolve_device_type(cfg.train.device)
    devices.configure_allocator(device_type)  # before anything starts CUDA's allocator
    resume = preflight(cfg, device_type, saves=not forward_only)
    p = cfg.parallel
    diagnose_nccl(device_type, trace_dir or Path(cfg.run.dir) / "nccl_trace")
    if device_type == "cpu" and os.environ.get("LOCAL_RANK", "0") == "0":  # once a node (torchrun's local rank 0)
        warn_of_host_memory(cfg, int(os.environ.get("LOCAL_WORLD_SIZE", p.world_size)), running=in_torchrun())
    if in_torchrun():
        if announce is not None and is_job_rank_zero():  # once in the job's log
            announce(device_type, resume)
        if dist.is_initialized():  # the caller holds the job's group (`tetrad check` trains twice in it)
            return train_on_this_rank(cfg, device_type, work, not forward_only)
        with torchrun_process_group(device_type, p.startup_timeout_s):
            return train_on_this_rank(cfg, device_type, work, not forward_only)
    if device_type != "cpu" and p.world_size > devices.local_device_count(device_type):
        raise ConfigError(f"dp*tp*pp*cp = {p.world_size} ranks but this machine has "
                          f"{counted(devices.local_device_count(device_type), device_type + ' device')}; use "
                          "torchrun across nodes, or a smaller layout")
    if announce is not None:
        announce(device_type, resume)
    return run_local(train_on_this_rank, p.world_size, (cfg, device_type, work, not forward_only),
                     device_type=device_type, timeout_s=timeout_s, pg_timeout_s=p.startup_timeout_s)[0]


@contextlib.contextmanager
def _stop_on_signals():
    """Turn SIGTERM/SIGINT/SIGHUP into `Stopped` while the ranks run (main thread only: Python
    delivers signals there), and restore the previous handlers afterwards. One the process was
    started ignoring (nohup's SIGHUP) stays ignored, here and in the ranks (`_rank_main`)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Stopped(signum)
    previous = {sig: signal.signal(sig, handler) for sig in FORWARDED if signal.getsignal(sig) is not signal.SIG_IGN}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def _start(procs, threads: int) -> None:
    """Start the ranks with the forwarded signals blocked (a rank unblocks them once it has set up
    its own handling; the launcher's pending signal is delivered when it unblocks here)."""
    old_omp = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # spawned children read it at start-up
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARDED)
    try:
        for p in procs:
            p.start()
    finally:
        os.environ.pop("OMP_NUM_THREADS") if old_omp is None else os.environ.update(OMP_NUM_THREADS=old_omp)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)


def _rank_main(fn, args, rank, world_size, store_path, device_type, threads, pg_timeout_s, tmp, launcher_pid,
               environ):
    die_with_launcher(launcher_pid)
    os.environ.clear()  # the launcher's environment now, not the fork server's when it started
    os.environ.update(environ)
    for sig in FORWARDED:  # a forked rank inherited the launcher's handlers; a training loop records them
        if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored (stopping.py)
            signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARDED)
    torch.set_num_threads(threads)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS=str(threads))
    try:
        device = devices.bind_rank(device_type, rank)
        store = dist.FileStore(store_path, world_size)
        # device_id, as torchrun_process_group: NCCL then makes each group's communicator when the group
        # is created, in one order on every rank. Made lazily instead, a communicator's first use blocks
        # the host until every member uses it, and an interleaved pipeline at pp >= 3 would hang in its first
        # step: rank 0 waits in the wrap-around link's first receive for the last rank, which waits in
        # its own first receive for the rank before it, ... and rank 1 for rank 0's first send.
        dist.init_process_group(devices.backend_for(device_type), store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s),
                                device_id=device if device.type != "cpu" else None)
        result = fn(*args)
        Path(tmp, f"rank{rank}.out").write_bytes(pickle.dumps(result))
        dist.destroy_process_group()
    except BaseException as e:
        if isinstance(e, ConfigError):  # a refusal, maybe this rank's alone (out of memory): said in one line
            Path(tmp, f"rank{rank}.refusal").write_text(str(e))  # before .err, which says the rank failed
        Path(tmp, f"rank{rank}.err").write_text(f"{time.time()!r}\n{traceback.format_exc()}")
        os._exit(1)
    os._exit(0)


def _wait(procs, timeout_s: float | None, tmp: Path) -> None:
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    alive = {p.sentinel: p for p in procs}
    while alive:
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            stuck = sorted(int(p.name.removeprefix("tetrad-rank")) for p in alive.values())
            raise RankFailure(f"job ran past its {timeout_s:.0f} s deadline; ranks {stuck} had not finished "
                              "(a hang: a collective some rank never joined?)")
        for sentinel in multiprocessing.connection.wait(list(alive), timeout=remaining):
            proc = alive.pop(sentinel)
            proc.join()
            if proc.exitcode != 0:
                time.sleep(0.5)  # let the ranks that failed first write their errors
                raise _failure(procs, tmp)


def _failure(procs, tmp: Path) -> RankFailure | ConfigError:
    """Name the rank that failed first: the earliest traceback, else a rank killed by a signal; or
    give that rank's refusal, its line alone (no traceback)."""
    errors = []
    for rank, p in enumerate(procs):
        err = tmp / f"rank{rank}.err"
        if err.exists():
            stamp, _, text = err.read_text().partition("\n")
            errors.append((float(stamp), rank, text))
    killed = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode is not None and p.exitcode < 0]
    if killed:
        rank, code = killed[0]
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        others = f"\n(other ranks then failed; first traceback, rank {min(errors)[1]}:)\n{min(errors)[2]}" \
            if errors else ""
        oom = " Linux's out-of-memory killer sends SIGKILL when the host runs out of memory: `dmesg` names it" \
            if name == "SIGKILL" else ""
        return RankFailure(f"rank {rank} died by {name} (no Python traceback: a crash or a kill).{oom}{others}")
    if errors:
        _, rank, text = min(errors)
        refused = tmp / f"rank{rank}.refusal"
        return ConfigError(refused.read_text()) if refused.exists() else RankFailure(f"rank {rank} failed:\n{text}")
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    return RankFailure(f"ranks exited with codes {bad} and left no traceback")


def _started(procs) -> list:
    return [p for p in procs if p.pid is not None]


def _kill(procs) -> None:
    """End the ranks at once: after a failure or a hang no collective can complete, so there is
    nothing for them to finish."""
    for p in _started(procs):
        if p.is_alive():
            p.kill()
    for p in _started(procs):
        p.join()


def _stop(procs, signum: int, grace_s: float) -> None:
    """Send every rank `signum`, the launcher's, give them `grace_s` to finish (a save), then kill
    the rest; a second signal to the launcher kills them at once."""
    alive = [p for p in _started(procs) if p.is_alive()]
    for p in alive:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signum)
    try:
        deadline = time.monotonic() + grace_s
        for p in alive:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
    except Stopped:
        pass
    finally:
        _kill(procs)
