"""How the commands say a count: one rule, so that no line says "1 steps"."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str = "") -> str:
    """`n` and its noun, singular for one: '1 step', '2 steps', '1,124 windows'; `plural` where an
    added s is wrong ('processes')."""
    return f"{n:,} {noun if n == 1 else plural or noun + 's'}"
