"""Everything checked before any rank of a training run starts, in one place: `tetrad train` and
`launch.train` run it once, in the process that starts the ranks, so a bad config or a missing
file is one ConfigError naming the fix instead of a traceback from a rank."""

from __future__ import annotations

from pathlib import Path

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
