"""Storage checks before any rank starts: the run and checkpoint folders can be written and have
room for a checkpoint, the checkpoint to resume exists, and the run will not erase an earlier
run's history. Each failure is a ConfigError of one line naming what to change."""

from __future__ import annotations

import errno
import os
import shutil
import tempfile
from pathlib import Path

from tetrad.config import Config, ConfigError
from tetrad.config.checkpoints import complete
from tetrad.model.flops import parameter_count
from tetrad.train.checkpoint.recovery import first_publish_by, refuse_later, refuse_overwriting_history
from tetrad.train.checkpoint.store import CheckpointError, check_model, read_manifest, resolve

PROBE_BYTES = 1 << 20
# fp32 weights and AdamW's two moments: what a checkpoint holds per parameter, at least.
CHECKPOINT_BYTES_PER_PARAM = 12


def check_storage(cfg: Config, saves: bool = True) -> Path | None:
    """Everything a rank would otherwise find out at its first save, or at resume, with a traceback;
    the room for a checkpoint only where the run `saves` one (not `tetrad eval`'s). Returns the
    checkpoint the run will resume (None for a fresh start)."""
    run_dir = Path(cfg.run.dir)
    root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else run_dir / "checkpoints"
    key = "checkpoint.dir" if cfg.checkpoint.dir else "run.dir"
    _writable(run_dir, "run.dir")
    _writable(root, key)
    if saves:
        _room_for_a_checkpoint(root, key, parameter_count(cfg.model) * CHECKPOINT_BYTES_PER_PARAM)
    try:
        return _resume_target(cfg, root, run_dir / "metrics.jsonl")
    except CheckpointError as e:
        raise ConfigError(_one_line(str(e))) from None


def _one_line(message: str) -> str:
    """A CheckpointError's indented list (keys that differ, damaged files) as one line: the
    heading, then its items and the advice after them, separated by semicolons."""
    heading, *items = [line.strip() for line in message.splitlines() if line.strip()]
    return " ".join([heading, "; ".join(items)]) if items else heading


def _resume_target(cfg: Config, root: Path, metrics: Path) -> Path | None:
    resume = cfg.checkpoint.resume
    if resume not in ("auto", "never"):
        if not Path(resume).exists():
            raise ConfigError(f"checkpoint.resume={resume!r} does not exist; give a step_* folder or a checkpoint "
                              "root, or 'auto'")
        _same_model(cfg, resolve(resume))
        return resolve(resume)
    if resume == "never":
        refuse_later(root, 0, "checkpoint.resume='never'")
    if resume == "never" or not complete(root):
        refuse_overwriting_history(metrics, first_publish_by(cfg, metrics.parent))
        return None
    _same_model(cfg, resolve(root))
    return resolve(root)


def _same_model(cfg: Config, checkpoint: Path) -> None:
    """Refuse resuming another model's checkpoint here rather than in rank 0 at resume. A damaged
    manifest is left to resume, which sets that checkpoint aside and takes an older one."""
    try:
        manifest = read_manifest(checkpoint)
    except CheckpointError:
        return
    check_model(manifest, cfg.model, checkpoint)


def _existing_ancestor(path: Path, key: str) -> Path:
    """The deepest folder of `path` that exists; refuse a file in the way."""
    for part in [path, *path.parents]:
        if part.exists():
            if not part.is_dir():
                raise ConfigError(f"{key}={str(path)!r}: {part} is a file, not a folder; choose another {key}")
            return part
    return Path.cwd()


def _writable(path: Path, key: str) -> None:
    """Write (and remove) a small file where `path` is, or would be created."""
    folder = _existing_ancestor(path.absolute(), key)
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".tetrad-probe-") as f:
            f.write(b"\0" * PROBE_BYTES)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        why = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else e.strerror or str(e)
        raise ConfigError(f"{key}={str(path)!r} cannot be written ({folder}: {why}); choose a writable {key}, "
                          "or fix its permissions or free space") from None


def _room_for_a_checkpoint(root: Path, key: str, need: int) -> None:
    """A save writes the new checkpoint before it prunes an old one: one checkpoint's room, free."""
    free = shutil.disk_usage(_existing_ancestor(root.absolute(), key)).free
    if free < need:
        raise ConfigError(f"{key}={str(root)!r} has {free / 2**30:.2f} GiB free and a checkpoint of this model takes "
                          f"about {need / 2**30:.2f} GiB; free space or choose another {key}")
