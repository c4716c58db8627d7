"""Training settings for the config `tetrad plan --write` writes, sized to the model where the user
set none: the built-in defaults are the tiny demo model's (lr 3e-3, 200 steps, a small corpus),
which would be wrong for a 70B model. Each value says where it comes from.
"""

from __future__ import annotations

import dataclasses
import math

from tetrad.config import Config
from tetrad.config.rampup import BatchRamp
from tetrad.model import flops

# Brown et al. 2020 (GPT-3), Table 2.1: (parameters, learning rate), interpolated in log-log and
# held at the ends.
GPT3_LEARNING_RATES = ((125e6, 6.0e-4), (350e6, 3.0e-4), (760e6, 2.5e-4), (1.3e9, 2.0e-4), (2.7e9, 1.6e-4),
                       (6.7e9, 1.2e-4), (13e9, 1.0e-4), (175e9, 0.6e-4))
TOKENS_PER_PARAMETER = 20  # compute-optimal training (Hoffmann et al. 2022, "Chinchilla")
WARMUP_TOKENS = 375e6  # GPT-3's linear warm-up
DATA_PLACEHOLDER = "data/tokens"  # where the user's token shards go; the built-in corpus is a demo
CHECKPOINT_MINUTES = 30  # between checkpoints: what a failure costs at most (the default of 0 saves none)


def learning_rate(parameters: float) -> float:
    """GPT-3's learning rate for a model of `parameters` parameters."""
    points = GPT3_LEARNING_RATES
    if parameters <= points[0][0]:
        return points[0][1]
    for (n0, lr0), (n1, lr1) in zip(points, points[1:]):
        if parameters <= n1:
            w = math.log(parameters / n0) / math.log(n1 / n0)
            return math.exp(math.log(lr0) + w * math.log(lr1 / lr0))
    return points[-1][1]


def _steps_for(cfg: Config, tokens: float) -> int:
    """The fewest steps (at least one) that read `tokens` tokens: a batch ramp-up's smaller steps
    read fewer each, so GPT-3's warm-up in tokens spans more of them, as Megatron-LM's in samples."""
    return max(1, BatchRamp.of(cfg.train).steps_for(math.ceil(tokens / cfg.model.seq_len)))


def sized_training(cfg: Config, user_keys: set[str], step_time_s: float) -> tuple[Config, list[str]]:
    """`cfg` with lr, steps, warm-up, data source and checkpoint interval sized to its model (and
    its predicted `step_time_s`), except the keys in `user_keys` ("section.key"); and one line per
    value set, saying why."""
    params = flops.parameter_count(cfg.model)
    tokens_per_step = cfg.train.global_batch * cfg.model.seq_len
    steps = _steps_for(cfg, TOKENS_PER_PARAMETER * params)
    ramped = " after train.batch_rampup's smaller ones" if cfg.train.batch_rampup else ""
    chosen = {
        "train.lr": (float(f"{learning_rate(params):.2g}"),
                     f"GPT-3's learning rate for {params / 1e9:.3g}B parameters (Brown et al. 2020, Table 2.1)"),
        "train.steps": (steps, f"{TOKENS_PER_PARAMETER} tokens per parameter (Hoffmann et al. 2022) at "
                               f"{tokens_per_step:,} tokens per step{ramped}"),
        "train.warmup": (min(steps, _steps_for(cfg, WARMUP_TOKENS)), "GPT-3's warm-up of 375M tokens"),
        "data.source": (DATA_PLACEHOLDER, "set it to your token shards or text (the built-in corpus is a demo)"),
        "checkpoint.every": (min(steps, max(1, round(CHECKPOINT_MINUTES * 60 / step_time_s))),
                             f"about every {CHECKPOINT_MINUTES} minutes at the predicted step time: a failure "
                             "loses at most that much"),
    }
    notes, sections = [], {}
    for key, (value, why) in chosen.items():
        if key in user_keys:
            continue
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
        notes.append(f"{key} = {value!r}: {why}")
    for section, values in sections.items():
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **values)})
    return cfg, notes
