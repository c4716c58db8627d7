"""The learning-rate schedules (AdamW itself and clipping: parallel/data/optimizer.py)."""

from __future__ import annotations

import math

from tetrad.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of 0-based `step` under `lr_schedule`: a linear warmup to lr over
    `warmup` steps, then
    - cosine / linear: decay from lr (first step after warmup) to lr * min_lr_ratio (last step);
    - constant: lr;
    - wsd (warmup-stable-decay): lr until the last `decay_fraction` of the steps, then a linear
      decay reaching lr * min_lr_ratio at the last step (its first decay step is already below lr).
    """
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    floor = cfg.lr * cfg.min_lr_ratio
    last = cfg.steps - 1
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if cfg.lr_schedule == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * cfg.steps))
        progress = (step - (cfg.steps - decay_steps) + 1) / decay_steps
    else:
        progress = (step - cfg.warmup) / max(1, last - cfg.warmup)
    progress = min(1.0, max(0.0, progress))
    if cfg.lr_schedule == "cosine":
        return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))
    return floor + (cfg.lr - floor) * (1 - progress)
