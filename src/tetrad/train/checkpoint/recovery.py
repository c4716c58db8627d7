"""Which checkpoint a run resumes from, decided the same way on every rank (the protocol's states
are in the package docstring), and the run folder's history kept consistent with it.

`choose` is collective: rank 0 lists the folders, every rank takes part in each integrity check
(each hashes its share), so every rank reaches the same answer; rank 0 alone renames and speaks.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch.distributed as dist

from tetrad.config import ConfigError, counted, read_toml
from tetrad.config.checkpoints import complete, published, step_of
from tetrad.train.checkpoint.store import (SET_ASIDE, CheckpointError, NotShownEverywhere, check_model,
                                           read_latest, replace_text, resolve, verify)


def say(message: str) -> None:
    """A line on the console (stdout: the progress bar owns stderr)."""
    print(f"tetrad: checkpoint: {message}", flush=True)


def broadcast(obj, world: int):
    """Rank 0's `obj` on every rank."""
    if world == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def newest_good(root: Path, model_cfg, rank: int, world: int) -> tuple[Path | None, dict | None]:
    """The newest published checkpoint under `root` that passes its integrity check, with its
    manifest; newer ones that fail are set aside as step_N.bad and named on the console. Refuses
    another model's checkpoint, and a root whose every checkpoint is damaged. One that rank 0
    reads whole and another rank does not see yet stops the run with nothing set aside: resuming
    an older one would throw the newer one's progress away for a file system's delay."""
    names = broadcast([p.name for p in published(root)] if rank == 0 else None, world)
    bad: list[tuple[Path, str]] = []
    chosen = manifest = None
    for name in names:
        try:
            manifest = verify(root / name, rank, world)
        except NotShownEverywhere as e:
            raise CheckpointError(f"{root / name}: {e}\nnothing was set aside; start the run again once every node "
                                  "shows it (or check that checkpoint.dir is on a file system every node shares)") from None
        except CheckpointError as e:
            bad.append((root / name, str(e)))
            continue
        chosen = root / name
        check_model(manifest, model_cfg, chosen)
        break
    if rank == 0:
        _report(root, chosen, bad)
    if world > 1:
        dist.barrier()
    if bad and chosen is None:
        raise CheckpointError(f"every checkpoint in {root} failed its integrity check (set aside as *{SET_ASIDE}, "
                              "reasons above); to start afresh use a new checkpoint.dir and run.dir")
    return chosen, manifest


def _report(root: Path, chosen: Path | None, bad: list[tuple[Path, str]]) -> None:
    """Set the damaged checkpoints aside and say what was chosen, and why, when it is not plain."""
    for path, reason in bad:
        aside = _free_aside_name(path)
        os.rename(path, aside)
        fallback = f"resuming from {chosen.name}" if chosen else "no intact checkpoint left"
        say(f"{path.name} is damaged and was set aside as {aside.name}; {fallback}. {reason}")
    latest, problem = read_latest(root)
    if problem:
        say(problem)
    elif chosen is not None and latest != chosen.name and not bad:
        say(f"{root}/latest names {latest or 'nothing'}; resuming from {chosen.name}, the newest complete checkpoint")


def _free_aside_name(path: Path) -> Path:
    """step_N.bad, or step_N.bad2, ... where a damaged step_N was set aside before (a rename onto
    that non-empty folder would fail and stop the resume)."""
    aside, n = path.with_name(path.name + SET_ASIDE), 1
    while aside.exists():
        n += 1
        aside = path.with_name(f"{path.name}{SET_ASIDE}{n}")
    return aside


def explicit(path: str, root: Path, model_cfg, rank: int, world: int) -> tuple[Path, dict]:
    """`checkpoint.resume = PATH`: that checkpoint, verified, or an error naming what is wrong.
    Refused when `root` holds a later checkpoint: this run would save beside an earlier run's."""
    chosen = resolve(path)
    manifest = verify(chosen, rank, world)
    check_model(manifest, model_cfg, chosen)
    refuse_later(root, manifest["step"], f"checkpoint.resume={path!r}")
    return chosen, manifest


def refuse_later(root: Path, step: int, why: str) -> None:
    """Refuse a run that starts at `step` in a root holding a complete checkpoint after it."""
    later = [p for p in complete(root) if step_of(p) > step]
    if later:
        raise CheckpointError(f"{root} already holds {later[0].name} from an earlier run, later than the step "
                              f"{step} this run starts from ({why}); use a new checkpoint.dir (or run.dir), or "
                              "checkpoint.resume='auto' to continue it")


def history_steps(metrics: Path) -> list[int]:
    """The steps `metrics.jsonl` records (none when it is absent)."""
    if not metrics.exists():
        return []
    steps = []
    for line in metrics.read_text(errors="replace").splitlines():
        try:
            steps.append(int(json.loads(line)["step"]))
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line from a kill
    return steps


def first_publish_by(cfg, run_dir: Path) -> int:
    """The step by which the run that wrote RUN_DIR's metrics (its config.toml there) has published
    its first checkpoint (0: none this run resumes): `checkpoint.every`, or, written in the
    background, up to `every` steps after it (the write is published at a later step's end, at the
    latest at the next save). That run's, not this one's: a run that saved no checkpoints has no
    history of its own to restart over, whatever this run's `every`."""
    recorded = run_dir / "config.toml"
    try:
        saved = read_toml(recorded).get("checkpoint", {}) if recorded.is_file() else {}
    except ConfigError:
        saved = {}  # unreadable: no run's record
    every = saved.get("every", 0) if cfg.checkpoint.resume == "auto" else 0
    return every * (2 if saved.get("async_save") else 1)


def refuse_overwriting_history(metrics: Path, own_until: int) -> None:
    """A run that starts at step 0 must not erase an earlier run's metrics. History that ends by
    `own_until` (first_publish_by) is the run's own, killed before its first checkpoint was
    published: restarting from 0 is then a resume from step 0."""
    steps = history_steps(metrics)
    if steps and not (own_until and max(steps) <= own_until):
        raise CheckpointError(f"{metrics} holds {counted(len(steps), 'step')} of an earlier run and this run starts "
                              f"afresh (no checkpoint to resume); use a new run.dir, or move {metrics} away")


def cut_history(metrics: Path, step: int) -> None:
    """Drop the metrics lines after `step`, the step a resume restarts from, and nothing else."""
    if not metrics.exists():
        return
    kept = []
    for line in metrics.read_text(errors="replace").splitlines():
        try:
            if int(json.loads(line)["step"]) <= step:
                kept.append(line)
        except (ValueError, KeyError, TypeError):
            continue  # a torn last line from a kill
    replace_text(metrics, "".join(line + "\n" for line in kept))


# [train] keys that set the learning rate of each step: a resume continues at its step on this
# run's schedule, which Megatron-LM refuses to change unless told (--override-opt_param-scheduler).
SCHEDULE_KEYS = ("steps", "lr", "lr_schedule", "warmup", "min_lr_ratio", "decay_fraction")


def schedule_changes(saved_config: Path, train_cfg) -> list[str]:
    """How this run's learning-rate schedule differs from the one in the config.toml the resumed
    run wrote (none where there is none): allowed, as extending a run needs, and said."""
    try:
        saved = read_toml(saved_config).get("train", {})
    except ConfigError:
        return []
    here = {key: getattr(train_cfg, key) for key in SCHEDULE_KEYS}
    changed = [f"train.{k} = {saved[k]!r} before, {here[k]!r} here" for k in SCHEDULE_KEYS
               if saved.get(k, here[k]) != here[k]]
    return [", ".join(changed) + " (the learning rate follows this run's schedule)"] if changed else []
