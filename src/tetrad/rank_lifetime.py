"""A local rank's tie to its launcher (launch.run_local): no rank outlives the process that started it."""

from __future__ import annotations

import ctypes
import os
import select
import signal
import sys
import threading
import time


def die_with_launcher(launcher_pid: int) -> None:
    """Have this rank killed when its launcher dies, however it dies: by Linux's parent-death signal
    where the launcher is its parent (a forked or spawned rank), else from a thread that waits for
    the launcher's exit (a fork server's rank, whose parent outlives the launcher while its ranks
    hold the server's pipe open; any rank off Linux)."""
    if sys.platform.startswith("linux") and os.getppid() == launcher_pid:
        pr_set_pdeathsig = 1
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != launcher_pid:  # it died before we asked
            os.kill(os.getpid(), signal.SIGKILL)
        return
    threading.Thread(target=_kill_self_after, args=(launcher_pid,), name="tetrad-launcher-watch", daemon=True).start()


def _kill_self_after(pid: int) -> None:
    """SIGKILL this process once `pid` has exited (at once if it has)."""
    try:
        pidfd = os.pidfd_open(pid)  # Linux 5.3: readable when the process exits
        select.select([pidfd], [], [])
    except ProcessLookupError:
        pass
    except (AttributeError, OSError):  # no pidfd here: poll
        while _alive(pid):
            time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
