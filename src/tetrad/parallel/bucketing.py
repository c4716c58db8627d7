"""The gradient bucket layout rule, over any description of a rank's parameters: what the runtime
lays out (parallel/data/buffers.py, over the model's parameters) and what the planner counts
(plan/buckets.py, over the config's), from one definition. Outside parallel/data, whose package
imports the whole reducer: `tetrad plan` would pay almost a second for those imports.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def bucket_contents(chunks: list[list[T]], numel: Callable[[T], int], bucket_bytes: float, blocks: int = 0,
                    block: Callable[[T], int | None] | None = None, tied: T | None = None) -> list[list[T]]:
    """Each bucket's items in layout order. `chunks`: each pipeline chunk's items in the model's order, `tied`
    left out. Without `block`: buckets in backward order (the last chunk's last item first), of
    at most `bucket_bytes` of fp32 gradient each (`split_runs`), never across two chunks. ZeRO-3
    (`block(item)`: the index of the transformer block, of `blocks`, that holds it, or None): one
    bucket per block, in index order, then one of the rest. The tied embedding's comes last."""
    if block is None:
        out = [run for chunk in chunks[::-1] for run in split_runs(chunk[::-1], numel, bucket_bytes)]
    else:
        out, rest = [[] for _ in range(blocks)], []
        for item in (item for chunk in chunks for item in chunk):
            k = block(item)
            (rest if k is None else out[k]).append(item)
        out += [rest] if rest else []
    return out + [[tied]] if tied is not None else out


def split_runs(items: list[T], numel: Callable[[T], int], limit_bytes: float) -> list[list[T]]:
    """Consecutive runs of items, each at most limit_bytes of fp32 gradient (or one item)."""
    out, run, size = [], [], 0
    for item in items:
        n = numel(item)
        if run and size + 4 * n > limit_bytes:
            out.append(run)
            run, size = [], 0
        run.append(item)
        size += 4 * n
    return out + [run] if run else out


def padded_size(size: int, n: int, align: int) -> int:
    """A bucket of `size` elements padded so that n equal shards, each a multiple of `align`
    elements, cover it."""
    return math.ceil(size / (n * align)) * n * align
