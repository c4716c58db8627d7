"""Where the gradients (and, under ZeRO, the weights) live: flat buckets.

A bucket is a run of parameters laid out end to end in one flat buffer, padded so that N equal
shards cover it (N = the gradient group's size); rank i owns the i-th shard. Buckets follow the
backward order, so each fills at one time; one never spans two pipeline chunks (their backwards
run at different times); an embedding tied across pipeline stages gets a bucket of its own, laid
out alike on both stages. Under ZeRO-3 there is one bucket per transformer block, plus one for
the rest, as the block is the unit that is gathered. Under expert parallelism the experts' weights
(ParamSpec.expert_split) get buckets of their own, after the dense ones, laid out by the same rule
(under ZeRO-3 one per block, gathered with the block's) and sharded over the expert gradient group
(under hybrid ZeRO, over its chunk inside the shard block; docs/design.md "Expert parallelism"). The rule itself is parallel/bucketing.py's, which the
planner follows too (plan/buckets.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from tetrad.dist.layout import GRAD
from tetrad.model.sharding import spec_of
from tetrad.parallel.bucketing import bucket_contents, padded_size


class Bucket:
    """A run of parameters laid out in one flat buffer, padded so N equal shards cover it. The
    gradient fields are the bucket lifecycle's (lifecycle.py). `shapes`: the parameters' shapes
    as laid out, read instead of the parameters' own (ZeRO-3 empties those while freed, zero3.py).
    `group`: the one it is reduced (and sharded) over, of n ranks, rank `rank` among them."""

    def __init__(self, params: list[nn.Parameter], n: int, rank: int, align: int, index: int, group: str = GRAD):
        self.params, self.index, self.group = params, index, group
        self.shapes = [p.shape for p in params]
        self.offsets, self.numels, size = [], [p.numel() for p in params], 0
        for numel in self.numels:
            self.offsets.append(size)
            size += numel
        self.size = size
        self.padded = padded_size(size, n, align)
        self.shard_size = self.padded // n
        self.lo, self.hi = rank * self.shard_size, (rank + 1) * self.shard_size
        self.state = "empty"  # lifecycle.py: empty -> filling -> reducing -> reduced
        self.grad: torch.Tensor | None = None  # full fp32 gradient while it exists
        self.grad_shard: torch.Tensor | None = None  # this rank's reduced shard
        self.pending = None  # the gradient collective in flight
        self.incoming: torch.Tensor | None = None  # ZeRO >= 2, hybrid ZeRO-1: where this rank's reduced shard lands
        self.closing = False  # ZeRO >= 2, hybrid ZeRO-1: the reduction in flight is the step's last for this bucket
        self.parked: dict[int, torch.Tensor] = {}  # ZeRO >= 2 under zero-bubble: BI's gradients, by param
        self.from_bw = 0  # ... and how many of its params' gradients BW makes (lifecycle.py)
        self.seen = 0  # gradients arrived in this backward

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter i's part of a flat buffer laid out as this bucket, in its shape."""
        return flat[self.offsets[i]:self.offsets[i] + self.numels[i]].view(self.shapes[i])

    def slices(self, lo: int | None = None, hi: int | None = None) -> list[tuple[int, int, int]]:
        """(param index, start, end) in bucket coordinates of each parameter's part of [lo, hi),
        by default this rank's shard."""
        lo, hi = (self.lo, self.hi) if lo is None else (lo, hi)
        out = []
        for i, (off, numel) in enumerate(zip(self.offsets, self.numels)):
            a, b = max(off, lo), min(off + numel, hi)
            if a < b:
                out.append((i, a, b))
        return out


@dataclass
class BucketLayout:
    buckets: list[Bucket]
    blocks: list[nn.Module]  # ZeRO-3: the blocks whose buckets come first, in order
    block_buckets: list[list[Bucket]]  # ZeRO-3: each block's buckets, gathered for its use (ep: its experts' too)
    roots: list[Bucket]  # ZeRO-3: the buckets gathered for the whole step (all outside the blocks)
    tied: Bucket | None  # the embedding tied across pipeline stages
    tied_copy: bool  # ... and this rank's is the head's copy


def lay_out(params: list[nn.Parameter], model: nn.Module | None, zero: int, n: int, rank: int, align: int,
            bucket_bytes: float, group: str = GRAD, experts: tuple[str, int, int] | None = None) -> BucketLayout:
    """The buckets of `params` for ZeRO stage `zero` over `group`, a gradient group of n ranks, by
    `bucket_contents`' rule. An embedding tied across pipeline stages gets a bucket of its own on
    both stages, so that the two copies' gradient shards line up for their sum (finalize.sum_tied).
    `experts` (expert parallelism: the expert gradient group, its size and this rank's place in
    it): the experts' weights are laid out apart, by the same rule, after the rest (ZeRO-3: a
    bucket of each block's experts, in `block_buckets` beside the block's own)."""
    tied = model.tied_weight() if hasattr(model, "tied_weight") else None
    apart = {id(p) for p in params if spec_of(p)[0].expert_split} if experts else set()
    wanted = {id(p) for p in params if p is not tied and id(p) not in apart}
    blocks, block = [], None
    if zero == 3:
        # multi-token prediction's blocks last: the last stage runs them after its layers
        blocks = [*model.layers.values(), *(depth.block for depth in getattr(model, "mtp", None) or ())]
        block_of = {id(p): k for k, b in enumerate(blocks) for p in b.parameters()}
        block = block_of.get
        chunks = [[p for p in params if id(p) in wanted]]
    else:
        chunks = model.chunk_parameters() if hasattr(model, "chunk_parameters") else [params]
        chunks = [[p for p in chunk if id(p) in wanted] for chunk in chunks]
    contents = bucket_contents(chunks, lambda p: p.numel(), bucket_bytes, len(blocks),
                               None if block is None else lambda p: block(id(p)), tied)
    buckets = [Bucket(unit, n, rank, align, k, group) for k, unit in enumerate(contents)]
    roots = buckets[len(blocks):] if zero == 3 else []
    tied_bucket = buckets[-1] if tied is not None else None
    block_buckets = [[bucket] for bucket in buckets[:len(blocks)]]
    if apart:
        name, size, at = experts
        if zero == 3:  # each block's experts a bucket of their own, gathered with the block's
            units = [unit for unit in bucket_contents([[p for p in params if id(p) in apart]], lambda p: p.numel(),
                                                      bucket_bytes, len(blocks), lambda p: block(id(p))) if unit]
        else:  # chunks as above
            units = bucket_contents([[p for p in chunk if id(p) in apart] for chunk in model.chunk_parameters()],
                                    lambda p: p.numel(), bucket_bytes)
        for unit in units:
            buckets.append(Bucket(unit, size, at, align, len(buckets), name))
            if zero == 3:
                block_buckets[block(id(unit[0]))].append(buckets[-1])
    return BucketLayout(buckets, blocks, block_buckets, roots, tied_bucket, tied is not None and model.holds_tied_copy)


def flatten(buckets: list[Bucket], dtype: torch.dtype, device: torch.device, owned_range, initial=None):
    """Make every parameter a view of its bucket's flat buffer in `dtype`, one bucket at a time;
    yields, per bucket, (that buffer, the fp32 values of its `owned_range`: what master weights
    and ZeRO-3's shard start from). Lazily, so only one bucket's fp32 copy exists at a time. With
    `initial(bucket, lo, hi)` (ZeRO-3 start-up: the parameters have no memory yet) the owned
    values come from it and the buffer starts empty."""
    for bucket in buckets:
        lo, hi = owned_range(bucket)
        with torch.no_grad():
            if initial is not None:
                owned = initial(bucket, lo, hi)
                flat = torch.empty(bucket.padded, dtype=dtype, device=device)
            else:
                full = torch.zeros(bucket.padded, dtype=torch.float32, device=device)
                for i, p in enumerate(bucket.params):
                    bucket.view(full, i).copy_(p)
                flat = full.to(dtype)  # the same tensor in fp32
                owned = full[lo:hi]
            for i, p in enumerate(bucket.params):
                p.data = bucket.view(flat, i)
        yield flat, owned


def initial_shard(bucket: Bucket, lo: int, hi: int, init, names: dict[int, str], device) -> torch.Tensor:
    """[lo, hi) of the bucket in fp32 from its parameters' initial values, `init(name, param)`,
    one parameter at a time (padding zero)."""
    owned = torch.zeros(hi - lo, dtype=torch.float32, device=device)
    for i, a, b in bucket.slices(lo, hi):
        p, start = bucket.params[i], bucket.offsets[i]
        owned[a - lo:b - lo] = init(names[id(p)], p).reshape(-1)[a - start:b - start]
    return owned
