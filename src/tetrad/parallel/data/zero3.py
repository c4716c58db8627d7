"""ZeRO-3: each rank keeps only its shard of every bucket's parameters; a transformer block is
all-gathered just before it runs and freed after.

Forward: the block is gathered (waiting for a gather already started), the next `prefetch`
blocks' gathers are started, the block runs and is freed. Backward: a block is gathered again
when its output gradient arrives (prefetching the `prefetch` blocks before it) and each of its
buckets (under expert parallelism its experts' are a bucket apart) is freed when that bucket's
gradients are in (lifecycle.py's `on_complete`); under a zero-bubble split backward the block's
once its input gradient is out, as BW needs no weights. The buckets of everything outside the blocks (the
roots: embedding, final norm, head, and an embedding tied across pipeline stages, which has a
bucket of its own) are gathered for the whole step. Full recompute runs inside
the block's forward, so these hooks never see it.

A freed bucket's parameters are not left as views of its released storage (reading one, say
`p.clone()` or `print(p)` in a callback, would read freed memory: a segfault, not an error):
their `.data` is an empty tensor of their dtype and device until the bucket is gathered again,
as FSDP swaps its parameters' data. Outside `gathered()` and a block's use a parameter reads as
empty (shape (0,)), and using it with real tensors raises a shape error; the buckets keep the
shapes (buffers.py). Saved for backward, a parameter is its Python object, whose views are back
when `_before_backward` gathers the block. Zero-bubble's BW, which runs after a block is freed,
hands its weight gradients straight to the buckets (model/execution.py's GRAD_LANDING), never
to the parameters.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from tetrad.dist.layout import GRAD
from tetrad.parallel.data import collectives
from tetrad.parallel.data.buffers import Bucket


class ParamGather:
    """Gathers and frees the flat parameter buffers `flat` (one per bucket, freed while not in use)
    from the persistent shards `shards`, each bucket over its own group (Bucket.group: hybrid
    ZeRO's shard group, or the expert gradient group, or under both its chunk inside the shard
    block: gathers never cross it). Block k's use
    gathers `block_buckets[k]` (its bucket, and under expert parallelism its experts'); `roots`
    are gathered for the whole step. `prefetch`: how many blocks ahead (behind, in backward) to
    start gathering. `group`, the dense buckets' (hybrid ZeRO's shard group), tells which backend
    runs the gathers (`scratch_free`), as in MasterWeights."""

    def __init__(self, buckets: list[Bucket], flat: list[torch.Tensor], shards: list[torch.Tensor], topo,
                 execution, block_buckets: list[list[Bucket]], roots: list[Bucket], prefetch: int = 1,
                 group: str = GRAD):
        self.buckets, self.flat, self.shards, self.topo = buckets, flat, shards, topo
        self.execution, self.roots, self.prefetch = execution, roots, prefetch
        self.block_buckets = [[bucket.index for bucket in own] for own in block_buckets]
        self.gathering: dict[int, object] = {}  # bucket index -> its all-gather in flight
        self.scratch_free = collectives.scratch_free(topo, group)  # gloo: gather by in-place broadcasts (collectives.py)
        self.views = [[p.data for p in bucket.params] for bucket in buckets]  # buffers.flatten's views
        # Each parameter's gradient accumulator, made now, while it has its shape, and kept: autograd
        # checks gradients against the shape it saw when making one, and a graph of the empty
        # parameter (a user's `p * 2` kept alive) would otherwise make it with shape (0,).
        self.accumulators = [[torch.autograd.graph.get_gradient_edge(p) for p in bucket.params] for bucket in buckets]
        self.empty = flat[0].new_empty(0)  # what a freed bucket's parameters point at
        self.shown = [True] * len(buckets)  # bucket k's parameters are views of its buffer
        for k in range(len(buckets)):  # freed since start-up (MasterWeights.add)
            self._hide(k)

    def start(self, k: int) -> None:
        """Non-blocking all-gather of bucket k's parameters (no-op if already there or on its way)."""
        flat = self.flat[k]
        if flat.untyped_storage().nbytes() == 0:
            bucket = self.buckets[k]
            flat.untyped_storage().resize_(bucket.padded * flat.element_size())
            flat[bucket.lo:bucket.hi].copy_(self.shards[k])
            self.gathering[k] = collectives.start_gather(self.topo, flat, bucket.shard_size,
                                                         self.scratch_free, bucket.group)

    def gather(self, k: int) -> None:
        self.start(k)
        if k in self.gathering:
            self.gathering.pop(k).wait()
        if not self.shown[k]:
            for p, view in zip(self.buckets[k].params, self.views[k]):
                p.data = view
            self.shown[k] = True

    def free(self, k: int) -> None:
        self.flat[k].untyped_storage().resize_(0)
        self._hide(k)

    def _hide(self, k: int) -> None:
        """Bucket k's parameters read as empty, not as views of its released storage."""
        if self.shown[k]:
            for p in self.buckets[k].params:
                p.data = self.empty
            self.shown[k] = False

    def free_all(self) -> None:
        """End of step: nothing gathered outlives it, so the next forward sees the updated shards."""
        for k in list(self.gathering):
            self.gathering.pop(k).wait()
        for k in range(len(self.buckets)):
            self.free(k)

    def on_complete(self, bucket: Bucket) -> None:
        """A block bucket's gradients are all in: its weights are done with, unless backward is
        split (its BI may still need them while an earlier BW completes the count)."""
        if all(bucket is not root for root in self.roots) and not self.execution.split_backward:
            self.free(bucket.index)

    @contextlib.contextmanager
    def gathered(self):
        """Full parameters inside the block, e.g. to export or compare them."""
        for k in range(len(self.buckets)):
            self.gather(k)
        try:
            yield
        finally:
            self.free_all()

    # ------------------------------------------------------------------ hooks
    def install(self, model: nn.Module, blocks: list[nn.Module]) -> None:
        """Gather and free around every block of `model`, and the root around the whole forward."""
        model.register_forward_pre_hook(self._before_model)
        # multi-token prediction's blocks (after the layers) run in training alone: a forward without
        # grad (validation) prefetches none of them, which it would only free at its end
        evaluated = len(getattr(model, "layers", blocks))
        for k, block in enumerate(blocks):
            block.register_forward_pre_hook(self._before_block(k, len(blocks), evaluated))
            block.register_forward_hook(self._after_block(k))

    def _before_model(self, module, args) -> None:
        for root in self.roots:
            self.gather(root.index)

    def _gather_block(self, k: int, then: range) -> None:
        """Block k's buckets gathered, and the gathers of blocks `then` started."""
        for i in self.block_buckets[k]:
            self.gather(i)
        for i in (i for j in then for i in self.block_buckets[j]):
            self.start(i)

    def _free_block(self, k: int) -> None:
        for i in self.block_buckets[k]:
            self.free(i)

    def _before_block(self, k: int, n_blocks: int, evaluated: int):
        """`evaluated`: the blocks a forward without grad runs (the first ones)."""
        def hook(module, args):
            end = n_blocks if torch.is_grad_enabled() else evaluated
            self._gather_block(k, range(k + 1, min(k + 1 + self.prefetch, end)))
            x = args[0]
            if self.execution.split_backward and torch.is_grad_enabled() and x.requires_grad:
                x.register_hook(lambda grad: self._free_block(k))
        return hook

    def _after_block(self, k: int):
        def hook(module, args, output):
            self._free_block(k)
            if output.requires_grad:
                output.register_hook(lambda grad: self._before_backward(k))
        return hook

    def _before_backward(self, k: int) -> None:
        self._gather_block(k, range(k - 1, max(k - 1 - self.prefetch, -1), -1))
