"""Everything checked before any rank of a training run starts, in one place: `tetrad train` and
`launch.train` run it once, in the process that starts the ranks, so a bad config or a missing
file is one ConfigError naming the fix instead of a traceback from a rank. The memory check needs
the rank's own GPU (the launcher never touches CUDA), so rank 0 runs it as it starts."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tetrad import device as devices
from tetrad.config import Config, validate_device
from tetrad.data.checks import check_data
from tetrad.parallel.pipeline.registry import check_config as check_pipeline
from tetrad.train.checkpoint.preflight import check_storage
from tetrad.train.init_from import check_init_from


def preflight(cfg: Config, device_type: str, saves: bool = True) -> Path | None:
    """The rules load_config cannot run (the schedule registry sits above config/), then those of
    the device `train.device` resolved to, the starting weights, the data and the storage, in that
    order (the cheap ones first; the files are read once, here); `saves`: whether the run writes a
    checkpoint (check_storage). Returns the checkpoint the run will resume, None for a fresh start."""
    check_pipeline(cfg)
    validate_device(cfg, device_type)
    check_init_from(cfg)
    check_data(cfg)
    return check_storage(cfg, saves)


def warn_of_host_memory(cfg: Config, ranks: int, running: bool = False) -> None:
    """CPU ranks share their host: before the `ranks` of this node start, or as they do (`running`:
    under torchrun, where their processes, torch loaded, already hold what the host no longer has
    free, not to be counted twice), the planner's warning where it predicts more than the host has
    free (plan/fit.py; a warning, as on GPUs, not a refusal)."""
    from tetrad.plan.fit import host_memory_warning
    memory = devices.host_memory_gib()
    if memory is not None:
        available, rank_base = memory
        warning = host_memory_warning(cfg, ranks, available, 0.0 if running else rank_base)
        if warning:
            print(warning, file=sys.stderr, flush=True)


@contextlib.contextmanager
def memory_watch(cfg: Config, device_gib: float | None):
    """Around a GPU rank's training, `device_gib` its GPU's memory (None: not a GPU; plan/fit.py):
    on rank 0, the planner's warning when its predicted peak exceeds it (a warning, not a refusal:
    the prediction errs high by design); on any rank, its view added to an out-of-memory error."""
    from tetrad.plan.fit import memory_warning, oom_note
    if device_gib is None:
        yield
        return
    warning = memory_warning(cfg, device_gib) if not dist.is_initialized() or dist.get_rank() == 0 else None
    if warning:
        print(warning, file=sys.stderr, flush=True)
    try:
        yield
    except torch.OutOfMemoryError as e:
        e.args = (f"{e.args[0] if e.args else ''}\n{oom_note(cfg, device_gib)}",)
        raise
