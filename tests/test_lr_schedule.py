"""Learning-rate schedules (train/optim.py lr_at): each curve's shape and endpoints."""

from __future__ import annotations

import math

import pytest

from tetrad.config import ConfigError, load_config
from tetrad.train.optim import lr_at

LR, FLOOR = 1e-2, 1e-3  # min_lr_ratio 0.1


def curve(schedule: str, steps: int = 50, warmup: int = 5, **train) -> list[float]:
    cfg = load_config(overrides={"train": {"lr": LR, "lr_schedule": schedule, "steps": steps, "warmup": warmup,
                                           "min_lr_ratio": 0.1, **train}})
    return [lr_at(s, cfg.train) for s in range(steps)]


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant", "wsd"])
def test_every_schedule_warms_up_linearly_to_the_peak(schedule):
    lrs = curve(schedule)
    assert lrs[:5] == pytest.approx([LR * (s + 1) / 5 for s in range(5)])
    assert lrs[5] == pytest.approx(LR)  # the first step after warmup is at the peak
    assert max(lrs) == pytest.approx(LR)


@pytest.mark.parametrize("schedule", ["cosine", "linear"])
def test_decays_fall_monotonically_to_the_floor_at_the_last_step(schedule):
    lrs = curve(schedule)[5:]
    assert all(a > b for a, b in zip(lrs, lrs[1:]))
    assert lrs[-1] == pytest.approx(FLOOR)


def test_cosine_is_half_way_at_mid_decay_and_linear_is_a_line():
    cos, lin = curve("cosine", steps=25, warmup=4), curve("linear", steps=25, warmup=4)
    # Decay over steps 4..24 (20 intervals): step 14 is half way.
    assert cos[14] == pytest.approx((LR + FLOOR) / 2)
    assert lin[14] == pytest.approx((LR + FLOOR) / 2)
    assert cos[9] == pytest.approx(FLOOR + 0.5 * (LR - FLOOR) * (1 + math.cos(math.pi / 4)))
    steps = [b - a for a, b in zip(lin[4:], lin[5:])]
    assert steps == pytest.approx([steps[0]] * len(steps))
    assert cos[9] > lin[9]  # cosine stays high early


def test_constant_stays_at_the_peak():
    assert curve("constant")[5:] == pytest.approx([LR] * 45)


def test_wsd_is_stable_then_decays_over_its_last_fraction():
    lrs = curve("wsd", steps=50, warmup=5, decay_fraction=0.2)  # decay over the last 10 steps
    assert lrs[5:40] == pytest.approx([LR] * 35)
    decay = lrs[40:]
    assert decay == pytest.approx([LR - (LR - FLOOR) * (i + 1) / 10 for i in range(10)])
    assert decay[-1] == pytest.approx(FLOOR)


def test_no_warmup_starts_at_the_peak():
    assert curve("cosine", warmup=0)[0] == pytest.approx(LR)


@pytest.mark.parametrize("train,message", [
    ({"lr_schedule": "step"}, "train.lr_schedule must be one of 'cosine', 'linear', 'constant', 'wsd'"),
    ({"lr_schedule": "wsd", "decay_fraction": 0.0}, "decay_fraction=0.0"),
    ({"lr_schedule": "wsd", "decay_fraction": 0.5, "warmup": 30, "steps": 50}, "leave room for warmup=30"),
    ({"min_lr_ratio": 1.5}, "min_lr_ratio"),
])
def test_invalid_schedules_name_the_fix(train, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides={"train": train})
