"""How the commands say a count (one rule, so that no line says "1 steps"), and the sizes a refusal
offers instead."""

from __future__ import annotations

import math


def counted(n: int, noun: str, plural: str = "") -> str:
    """`n` and its noun, singular for one: '1 step', '2 steps', '1,124 windows'; `plural` where an
    added s is wrong ('processes')."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"


def divisors(n: int) -> list[int]:
    """n's divisors in order: what a refusal offers where a size must divide n."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
