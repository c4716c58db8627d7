"""Start the ranks of a job: local processes when not under torchrun, or the environment
torchrun gives. The same `run_local` serves `tetrad train` on a laptop and the multi-process tests.

A rank that raises or dies ends the whole job: the others are terminated and the error names
the first rank that failed, with its traceback (or the signal that killed it). Nothing hangs:
process groups get a finite timeout and `run_local` a wall-clock deadline.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import pickle
import signal
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from tetrad import device as devices


class RankFailure(RuntimeError):
    """A rank raised, died by a signal, or the job ran past its deadline."""


def in_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def torchrun_world_size() -> int | None:
    return int(os.environ["WORLD_SIZE"]) if in_torchrun() else None


def init_from_torchrun(device_type: str, timeout_s: float = 600.0) -> torch.device:
    """Join the process group torchrun set up (env:// rendezvous) and bind LOCAL_RANK's device."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = devices.bind_rank(device_type, local_rank)
    dist.init_process_group(devices.backend_for(device_type), timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if device.type != "cpu" else None)
    return device


def run_local(fn: Callable[..., Any], world_size: int, args: tuple = (), *, device_type: str = "cpu",
              timeout_s: float | None = None, pg_timeout_s: float = 600.0, spawn: bool = False) -> list[Any]:
    """Run `fn(*args)` on `world_size` fresh local ranks joined in one process group; return each
    rank's result (which must pickle). `fn` finds its rank through torch.distributed.

    CPU ranks are forked (90x faster to start than spawn, PLATFORM.md) unless `spawn`: a forked
    rank inherits its parent's heap, whose free blocks it reuses without growing, so a measurement
    of the resident set wants spawned ranks. Accelerator ranks are always spawned, since a forked
    child cannot use a CUDA context.
    """
    method = "spawn" if spawn or device_type != "cpu" else "fork"
    threads = devices.threads_per_rank(world_size) if device_type == "cpu" else 1
    ctx = multiprocessing.get_context(method)
    with tempfile.TemporaryDirectory(prefix="tetrad-rdzv-") as tmp:
        store_path = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_rank_main, name=f"tetrad-rank{rank}",
                             args=(fn, args, rank, world_size, store_path, device_type, threads, pg_timeout_s, tmp))
                 for rank in range(world_size)]
        old_omp = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(threads)  # spawned children read it at start-up
        try:
            for p in procs:
                p.start()
        finally:
            os.environ.pop("OMP_NUM_THREADS") if old_omp is None else os.environ.update(OMP_NUM_THREADS=old_omp)
        try:
            _wait(procs, timeout_s, Path(tmp))
        except BaseException:
            _terminate(procs)
            raise
        return [pickle.loads((Path(tmp) / f"rank{r}.out").read_bytes()) for r in range(world_size)]


def _rank_main(fn, args, rank, world_size, store_path, device_type, threads, pg_timeout_s, tmp):
    torch.set_num_threads(threads)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles Ctrl-C and ends the ranks
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), OMP_NUM_THREADS=str(threads))
    try:
        devices.bind_rank(device_type, rank)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(devices.backend_for(device_type), store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        result = fn(*args)
        Path(tmp, f"rank{rank}.out").write_bytes(pickle.dumps(result))
        dist.destroy_process_group()
    except BaseException:
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
                raise RankFailure(_describe_failure(procs, tmp))


def _describe_failure(procs, tmp: Path) -> str:
    """Name the rank that failed first: the earliest traceback, else a rank killed by a signal."""
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
        return f"rank {rank} died by {name} (no Python traceback: a crash or a kill){others}"
    if errors:
        _, rank, text = min(errors)
        return f"rank {rank} failed:\n{text}"
    bad = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
    return f"ranks exited with codes {bad} and left no traceback"


def _terminate(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + 5
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()
