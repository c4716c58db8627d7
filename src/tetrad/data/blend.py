"""`data.source` as a blend of weighted sources, Megatron-LM's `--data-path` syntax
("0.7 data/web 0.3 data/code"); how batches draw from a blend is train/batches.py's."""

from __future__ import annotations

from fractions import Fraction


def blend_parts(source: str) -> list[tuple[Fraction, str]]:
    """`data.source` as (weight, source) pairs, the weights summing to 1: Megatron-LM's blend
    "W1 SOURCE1 W2 SOURCE2 ..." (relative weights, any positive numbers), else one source of
    weight 1 (so a path with spaces stays one source). ValueError for a weight that is not positive."""
    words = source.split()
    if len(words) < 2 or len(words) % 2:
        return [(Fraction(1), source)]
    try:
        weights = [Fraction(w) for w in words[0::2]]
    except ValueError:
        return [(Fraction(1), source)]
    if min(weights) <= 0:
        raise ValueError(f"data.source={source!r} blends with weight {min(weights)}; every weight must be positive")
    total = sum(weights)
    return [(w / total, part) for w, part in zip(weights, words[1::2])]


def primary_source(source: str) -> str:
    """The source a run's tokenizer and vocabulary come from: the first of a blend (data/checks.py
    makes every source of a blend agree with it, and names a bad weight)."""
    try:
        return blend_parts(source)[0][1]
    except ValueError:
        return source
