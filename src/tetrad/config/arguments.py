"""argparse types the commands share: a bad number is argparse's one line and exit 2, before any
work, never a traceback or a silently wrong answer."""

from __future__ import annotations

import argparse
import math


def whole_number(text: str) -> int:
    """A whole number >= 1 (a count: --top, --gpus, --threads)."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return int(text)


def whole_numbers(text: str) -> list[int]:
    """Comma-separated whole numbers >= 1 (--ranks 2,4,8; --sizes-kb 4,64,1024)."""
    try:
        return [whole_number(x) for x in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected whole numbers >= 1, comma-separated, got {text!r}") from None


def non_negative(text: str) -> float:
    """A number >= 0 (a latency, a tolerance): a negative one would simulate time running back,
    or call every pair of runs different."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value
