"""What the gradient codecs (dist/codecs.py) send, in numbers alone: int8's block of elements
sharing one scale, PowerSGD's rank and the matrix it sees a bucket as, and whether a codec sums
each element apart from the others. Free of torch, so that the planner (plan/comm_bytes.py,
plan/buckets.py) counts a codec's bytes without loading it."""

from __future__ import annotations

import math

INT8_BLOCK = 256  # elements sharing one scale
POWERSGD_RANK = 4


def sums_elementwise(name: str, group_size: int) -> bool:
    """Whether codec `name` over a group of `group_size` ranks gives each element's sum from that
    element's values alone. int8's block scales and PowerSGD's low rank mix a bucket's elements, so
    tp ranks, whose buckets differ, get different sums of a tp-replicated parameter's identical
    gradients (GradReducer.reduce averages them again over tp). A group of one sends nothing."""
    return name in ("none", "bf16") or group_size == 1


def powersgd_shape(n: int, rank: int = POWERSGD_RANK) -> tuple[int, int]:
    """(rows, cols) of the matrix PowerSGD sees a bucket of n values as: the factorisation of n
    nearest a square below it, or, where that would not compress (a prime n gives [n, 1], and P
    alone would send `rank` times the bucket), a near-square one, zero-padded, of `rank` rows at
    least: P's orthonormal basis (its QR) has min(rows, rank) columns, and Q must keep `rank` (a
    bucket of under 13 values, e.g. latent attention's 8-wide latent norm alone, crashed the codec)."""
    cols = max(1, math.isqrt(n))
    while n % cols:
        cols -= 1
    if (n // cols + cols) * rank < n:
        return n // cols, cols
    cols = math.isqrt(n - 1) + 1 if n > 1 else 1  # ceil(sqrt(n))
    return max(-(-n // cols), rank), cols
