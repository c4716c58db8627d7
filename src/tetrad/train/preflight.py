"""Everything checked before any rank of a training run starts, in one place: `tetrad train` and
`launch.train` run it once, in the process that starts the ranks, so a bad config or a missing
file is one ConfigError naming the fix instead of a traceback from a rank. The memory check needs
the rank's own GPU (the launcher never touches CUDA), so rank 0 runs it as it starts."""

from __future__ import annotations

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


def preflight(cfg: Config, device_type: str) -> Path | None:
    """The rules load_config cannot run (the schedule registry sits above config/), then those of
    the device `train.device` resolved to, the starting weights, the data and the storage, in that
    order (the cheap ones first; the files are read once, here). Returns the checkpoint the run will
    resume, None for a fresh start."""
    check_pipeline(cfg)
    validate_device(cfg, device_type)
    check_init_from(cfg)
    check_data(cfg)
    return check_storage(cfg)


def warn_if_over_memory(cfg: Config, device: torch.device) -> None:
    """On rank 0 of a GPU job, the planner's warning (plan/fit.py) when its predicted peak exceeds
    this GPU's memory. A warning, not a refusal: the prediction errs high by design."""
    from tetrad.plan.fit import memory_warning
    props = devices.accelerator_properties(device)
    if props is None or (dist.is_initialized() and dist.get_rank() != 0):
        return
    warning = memory_warning(cfg, props.total_memory / 2**30)
    if warning:
        print(warning, file=sys.stderr, flush=True)
