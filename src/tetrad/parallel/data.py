"""Data parallelism over the dp x cp group: bucketed, overlapped gradient reduction and ZeRO 0-3.

CP ranks hold the same weights as their DP peers, so both dimensions reduce (and shard) together.
Each micro-batch's loss is already divided by the global token count, so a SUM of the gradients
gives exactly the single-device gradient.

Gradients land in flat fp32 buckets (in backward order, `grad_bucket_mb` each) from a
post-accumulate-grad hook; on the last micro-batch a bucket's collective starts, non-blocking,
the moment its last gradient arrives. Every bucket is padded to a multiple of N = |dp x cp| and
rank i owns the i-th 1/N of it:

- ZeRO-0 all-reduces the bucket; plain AdamW on the full gradients.
- ZeRO-1 all-reduces too, but AdamW runs only on this rank's shard; updated shards are then
  all-gathered into the flat parameter buffer the model's parameters are views of.
- ZeRO-2 reduce-scatters every micro-batch's bucket into this rank's shard (summing the shards
  over micro-batches, as DeepSpeed and FSDP do) and frees the full bucket once reduced: one
  bucket reduces while the next fills, so at most two full buckets exist at a time and the
  gradients are 1/N at the peak too (under a zero-bubble split backward, the gradients BI makes,
  the norms', wait apart in fp32 until BW's start the bucket). The price is one
  reduce-scatter per micro-batch, and a sum grouped by micro-batch: equal to ZeRO-0's to fp32
  rounding, and bit-equal with one micro-batch per rank.
- ZeRO-3 keeps only the parameter shard; one bucket per block of `model.layers` (plus one for the
  rest, gathered for the whole step). A block is all-gathered just before its forward (the next
  block's gather is started meanwhile), freed after it, gathered again when its output gradient
  arrives (prefetching the block before it), and freed when its gradients are in (under a
  zero-bubble split backward: when its input gradient is out, BW needs no weights). Gradients as
  under ZeRO-2.

The clipping norm is computed from each rank's shard of every bucket in all stages, so ZeRO 0 and
1 do the same arithmetic and give bit-identical results (ZeRO-2 too with one micro-batch).

Mixed precision (bf16/fp16, the Megatron/DeepSpeed recipe): the flat parameter buffers hold the
model dtype, so the forward, the backward and ZeRO's all-gathers run in it, while gradients
still accumulate and reduce in the fp32 buckets and AdamW steps on fp32 master weights of the
part of each bucket this rank updates (its shard, or the whole bucket under ZeRO-0), copied into
the low-precision buffer after each step. The masters start from the fp32 initial weights. With
`offload` the masters and AdamW's state live in CPU memory: each step moves this rank's fp32
gradient shard there and the updated parameters back, through pinned host memory on
accelerators, with copies queued without blocking and one wait before the CPU AdamW reads. fp32 without offload needs no masters:
AdamW updates the parameter storage itself (and ZeRO-0 keeps plain AdamW on the parameters).
"""

from __future__ import annotations

import contextlib
import math
import zlib
from collections.abc import Callable

import torch
import torch.nn as nn

from tetrad import device as devices
from tetrad.config import DEFAULT_BUCKET_MB
from tetrad.dist import autotune, hierarchical
from tetrad.dist.codecs import INT8_BLOCK, make_codec
from tetrad.dist.layout import GRAD, GRAD_DIMS
from tetrad.model.execution import Execution
from tetrad.model.sharding import spec_of
from tetrad.train.optim import adamw, build_optimizer, clip_gradients



class Bucket:
    """A run of parameters laid out in one flat buffer, padded so N equal shards cover it."""

    def __init__(self, params: list[nn.Parameter], n: int, rank: int, align: int):
        self.params = params
        self.offsets, size = [], 0
        for p in params:
            self.offsets.append(size)
            size += p.numel()
        self.size = size
        self.padded = math.ceil(size / (n * align)) * n * align
        self.shard_size = self.padded // n
        self.lo, self.hi = rank * self.shard_size, (rank + 1) * self.shard_size
        self.grad: torch.Tensor | None = None  # full fp32 gradient while it exists
        self.grad_shard: torch.Tensor | None = None  # this rank's reduced shard
        self.pending = None  # the gradient collective in flight
        self.incoming: torch.Tensor | None = None  # ZeRO >= 2: where that reduce-scatter lands
        self.parked: dict[int, torch.Tensor] = {}  # ZeRO >= 2 under zero-bubble: BI's gradients, by param
        self.from_bi: set[int] = set()  # ... and the params whose gradients BI makes
        self.gathering = None  # ZeRO-3: the parameter all-gather in flight
        self.seen = 0  # gradients arrived in this backward
        self.reduced = False  # `grad` holds last step's reduced gradient (p.grad may still view it)
        self.index = 0  # its place in the reducer's list, set by the reducer

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        p = self.params[i]
        return flat[self.offsets[i]:self.offsets[i] + p.numel()].view(p.shape)

    def pieces(self, lo: int | None = None, hi: int | None = None) -> list[tuple[int, int, int]]:
        """(param index, start, end) in bucket coordinates of each parameter's part of [lo, hi),
        by default this rank's shard."""
        lo, hi = (self.lo, self.hi) if lo is None else (lo, hi)
        out = []
        for i, (off, p) in enumerate(zip(self.offsets, self.params)):
            a, b = max(off, lo), min(off + p.numel(), hi)
            if a < b:
                out.append((i, a, b))
        return out


class ShardedAdamW:
    """AdamW on the fp32 master of the part of every bucket this rank updates (`owned_range`: its
    1/N shard under ZeRO >= 1, the whole bucket under ZeRO-0 with masters). Pieces are cut at
    parameter boundaries so each keeps its parameter's weight decay; AdamW is elementwise, so this
    is the same arithmetic as the unsharded optimizer. `slots` are (bucket, master piece, start,
    end), start and end relative to the bucket's `owned_range` start."""

    def __init__(self, reducer: "GradReducer", train_cfg):
        self.reducer = reducer
        self.slots = []
        decay, no_decay = [], []
        for bucket, master in zip(reducer.buckets, reducer.masters):
            lo, hi = reducer.owned_range(bucket)
            for i, a, b in bucket.pieces(lo, hi):
                piece = master[a - lo:b - lo]
                self.slots.append((bucket, piece, a - lo, b - lo))
                (decay if bucket.params[i].ndim >= 2 else no_decay).append(piece)
        self.inner = adamw(decay, no_decay, train_cfg)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def step(self) -> None:
        grads = {}  # bucket id -> its owned gradient, on the masters' device (offload: the CPU)
        for bucket, piece, a, b in self.slots:
            if id(bucket) not in grads:
                grads[id(bucket)] = self.reducer.master_grad(bucket)
            piece.grad = grads[id(bucket)][a:b]
        if self.reducer.offload:  # the copies to the host were queued without waiting: wait once
            devices.synchronize(self.reducer.topo.device)
        self.inner.step()
        self.reducer.after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, piece, _, _ in self.slots:
            piece.grad = None
        self.reducer.zero_grad()


class GradReducer:
    """Owns the flat gradient (and, under ZeRO, parameter) buffers of `params` and their reduction
    over dp x cp. `model` is needed for ZeRO-3 (its blocks get the gather hooks). `dtype` is the
    model's (parameter and compute) dtype; the parameters are cast to it here, after their fp32
    values seeded the master weights. `offload` keeps masters and optimizer state on the CPU.
    `init` (ZeRO-3 start-up): the parameters come without memory and `init(name, param)` gives
    one's initial value; each rank builds its shard from it, one parameter at a time."""

    def __init__(self, params: list[nn.Parameter], topo, parallel=None, model: nn.Module | None = None, *,
                 dtype: torch.dtype = torch.float32, offload: bool = False,
                 init: Callable[[str, nn.Parameter], torch.Tensor] | None = None):
        self.params, self.topo, self._init = params, topo, init
        # How the model runs: zero-bubble's split backward, sequence parallelism (model/execution.py).
        self.execution = getattr(model, "execution", None) or Execution()
        self._names = {id(p): name for name, p in model.named_parameters()} if model is not None else {}
        self.dtype, self.offload = dtype, offload
        self.zero = parallel.zero if parallel else 0
        # Separate fp32 masters: the optimizer cannot update the parameters' own storage.
        self.separate_masters = dtype != torch.float32 or offload
        self.n, self.rank = topo.size(GRAD), topo.local_rank(GRAD)
        codec = parallel.grad_codec if parallel else "none"
        self.codec = make_codec(codec, self.n)
        if parallel:  # "auto" bucket size and hierarchical: measured now (dist/autotune.py)
            parallel = autotune.resolve(parallel, topo, 4 * sum(p.numel() for p in params))
        self.hierarchical = bool(parallel and parallel.hierarchical is True and self.n > 1)
        align = INT8_BLOCK if codec == "int8" else 1
        if self.hierarchical and topo.layout.split_by_node(GRAD_DIMS, topo.ranks_per_node) is None:
            raise ValueError(f"hierarchical reduction needs the dp x cp groups spread evenly over nodes of "
                             f"{topo.ranks_per_node} ranks")
        self._sync = False
        self._in_flight: list[Bucket] = []  # ZeRO >= 2: reduce-scatters started, oldest first
        self._root = None
        self._tied, self._tied_copy = None, False
        mb = parallel.grad_bucket_mb if parallel else DEFAULT_BUCKET_MB  # "auto" was resolved above
        if self.zero == 3:
            units = [list(block.parameters()) for block in model.layers.values()]
            in_blocks = {id(p) for unit in units for p in unit}
            root = [p for p in params if id(p) not in in_blocks]
            self.buckets = [Bucket(u, self.n, self.rank, align) for u in units + [root] if u]
            self._blocks = list(model.layers.values())
            self._root = self.buckets[-1] if root else None
        else:
            # A bucket never spans two pipeline chunks: their backwards run at different times.
            # An embedding tied across stages gets a bucket of its own, laid out alike on both.
            tied = model.tied_weight() if hasattr(model, "tied_weight") else None
            wanted = {id(p) for p in params if p is not tied}
            chunks = model.chunk_parameters() if hasattr(model, "chunk_parameters") else [params]
            self.buckets = [Bucket(u, self.n, self.rank, align) for chunk in chunks[::-1]
                            for u in _split([p for p in chunk[::-1] if id(p) in wanted], mb * 2**20)]
            if tied is not None:
                self.buckets.append(Bucket([tied], self.n, self.rank, align))
                self._tied = self.buckets[-1]
                self._tied_copy = model.holds_tied_copy
        for k, bucket in enumerate(self.buckets):
            bucket.index = k
            for i, p in enumerate(bucket.params):
                p.register_post_accumulate_grad_hook(self._hook(bucket, i))
        self.flat: list[torch.Tensor] = []  # flat parameter buffer (model dtype) of each bucket
        self.shards: list[torch.Tensor] = []  # ZeRO-3: the persistent parameter shard of each bucket
        self.masters: list[torch.Tensor] = []  # fp32 weights the optimizer updates, per bucket
        self._host_grads: dict[int, torch.Tensor] = {}  # offload: each bucket's owned gradient on the host
        if self.zero >= 1 or self.separate_masters:
            self._flatten_params()
        if self.zero == 3:
            self._install_block_hooks(model)

    # ------------------------------------------------------------------ parameters under ZeRO
    @torch.no_grad()
    def _flatten_params(self) -> None:
        """Make every parameter a view of its bucket's flat buffer (in the model dtype), take the
        fp32 masters from the initial values; ZeRO-3 keeps only the shard (and, given `init`,
        never holds more of the bucket than one parameter's initial value)."""
        for bucket in self.buckets:
            lo, hi = self.owned_range(bucket)
            if self._init is not None:
                owned = self._initial_shard(bucket, lo, hi)
                flat = torch.empty(bucket.padded, dtype=self.dtype, device=self.topo.device)
            else:
                full = torch.zeros(bucket.padded, dtype=torch.float32, device=self.topo.device)
                for i, p in enumerate(bucket.params):
                    bucket.view(full, i).copy_(p)
                flat = full.to(self.dtype)  # the same tensor in fp32
                owned = full[lo:hi]
            for i, p in enumerate(bucket.params):
                p.data = bucket.view(flat, i)
            self.flat.append(flat)
            if self.separate_masters:
                self.masters.append(devices.host_buffer(owned).copy_(owned) if self.offload else owned.clone())
            if self.zero == 3:
                self.shards.append(owned.to(self.dtype, copy=True))
                flat.untyped_storage().resize_(0)
            if not self.separate_masters:
                self.masters.append(self._owned_params(len(self.flat) - 1))

    def _initial_shard(self, bucket: Bucket, lo: int, hi: int) -> torch.Tensor:
        """[lo, hi) of the bucket in fp32 from its parameters' initial values (padding zero)."""
        owned = torch.zeros(hi - lo, dtype=torch.float32, device=self.topo.device)
        for i, a, b in bucket.pieces(lo, hi):
            p, start = bucket.params[i], bucket.offsets[i]
            owned[a - lo:b - lo] = self._init(self._names[id(p)], p).reshape(-1)[a - start:b - start]
        return owned

    def owned_range(self, bucket: Bucket) -> tuple[int, int]:
        """The part of the bucket (bucket coordinates) this rank's optimizer updates."""
        return (0, bucket.padded) if self.zero == 0 else (bucket.lo, bucket.hi)

    def _owned_params(self, k: int) -> torch.Tensor:
        """Bucket k's parameters in the owned range, in the model dtype: what the masters update."""
        if self.zero == 3:
            return self.shards[k]
        lo, hi = self.owned_range(self.buckets[k])
        return self.flat[k][lo:hi]

    def owned_grad(self, bucket: Bucket) -> torch.Tensor:
        """The reduced fp32 gradient of the owned range."""
        return bucket.grad if self.zero == 0 else bucket.grad_shard

    def master_grad(self, bucket: Bucket) -> torch.Tensor:
        """The owned gradient where the masters are: with offload, a copy into a host buffer of
        the bucket's (pinned on accelerators), queued without waiting: synchronize before reading."""
        grad = self.owned_grad(bucket)
        if not self.offload:
            return grad
        if bucket.index not in self._host_grads:
            self._host_grads[bucket.index] = devices.host_buffer(grad)
        return self._host_grads[bucket.index].copy_(grad, non_blocking=True)

    def _start_gather(self, k: int):
        """Non-blocking all-gather of bucket k's parameters (no-op if already there or on its way)."""
        bucket, flat = self.buckets[k], self.flat[k]
        if flat.untyped_storage().nbytes() == 0:
            flat.untyped_storage().resize_(bucket.padded * flat.element_size())
            bucket.gathering = self.topo.comm.all_gather(flat, self.shards[k], GRAD, async_op=True)

    def _gather(self, k: int) -> None:
        self._start_gather(k)
        if self.buckets[k].gathering is not None:
            self.buckets[k].gathering.wait()
            self.buckets[k].gathering = None

    def _free(self, k: int) -> None:
        self.flat[k].untyped_storage().resize_(0)

    def _install_block_hooks(self, model: nn.Module) -> None:
        last = len(self._blocks) - 1

        def before_model(module, args):
            if self._root is not None:
                self._gather(len(self.buckets) - 1)

        def before(k):
            def hook(module, args):
                self._gather(k)
                if k < last:
                    self._start_gather(k + 1)
                # Split backward (zero-bubble): the weight gradients come later (BW) and need only
                # the layer's inputs and output gradients, so the block is done with its weights
                # once its input gradient (BI) is out.
                x = args[0]
                if self.execution.split_backward and torch.is_grad_enabled() and x.requires_grad:
                    x.register_hook(lambda grad: self._free(k))
            return hook

        def after(k):
            def hook(module, args, output):
                self._free(k)  # (recompute runs inside Block.forward: these hooks see it never)
                if output.requires_grad:
                    output.register_hook(lambda grad: self._before_backward(k))
            return hook

        model.register_forward_pre_hook(before_model)
        for k, block in enumerate(self._blocks):
            block.register_forward_pre_hook(before(k))
            block.register_forward_hook(after(k))

    def _before_backward(self, k: int) -> None:
        self._gather(k)
        if k > 0:
            self._start_gather(k - 1)

    @contextlib.contextmanager
    def gathered(self):
        """Full parameters inside the block (ZeRO-3), e.g. to export or compare them."""
        if self.zero == 3:
            for k in range(len(self.buckets)):
                self._gather(k)
        try:
            yield
        finally:
            if self.zero == 3:
                for k in range(len(self.buckets)):
                    self._free(k)

    # ------------------------------------------------------------------ gradients
    @contextlib.contextmanager
    def last_microbatch(self):
        """Backward inside this block is the accumulation's last: buckets reduce as they fill.
        Outside it gradients only accumulate (reduce() still reduces whatever did not start)."""
        self._sync = True
        try:
            yield
        finally:
            self._sync = False

    def _hook(self, bucket: Bucket, i: int):
        def hook(p: nn.Parameter) -> None:
            if p.grad is None:  # a deferred weight gradient (zero-bubble BI): it arrives in BW
                return
            if bucket.pending is not None and self.zero >= 2:  # last micro-batch's, still in flight
                self._finish(bucket)
            in_bi = self.execution.weight_grads.collecting_now
            if self.zero >= 2 and self.execution.split_backward:
                # Zero-bubble: BI makes the gradients that are not deferred (the norms'), BW the
                # linears'. BI's wait apart (fp32) until BW starts the bucket, and the bucket is
                # complete when BW has delivered all of its linears' (a later micro-batch's BI may
                # come first: it joins this reduction), so no bucket is held full from BI to BW.
                if in_bi:
                    bucket.from_bi.add(i)
                else:
                    bucket.seen += 1
                complete = bucket.seen == len(bucket.params) - len(bucket.from_bi)
            else:
                bucket.seen += 1
                complete = bucket.seen == len(bucket.params)
            if in_bi and self.zero >= 2 and bucket.grad is None:
                if i in bucket.parked:
                    bucket.parked[i].add_(p.grad)
                else:
                    bucket.parked[i] = p.grad.float()
            else:
                self._materialise(bucket, p.device)
                bucket.view(bucket.grad, i).add_(p.grad)  # fp32 accumulation, whatever the model dtype
            p.grad = None
            if complete:
                bucket.seen = 0
                self._materialise(bucket, p.device)
                # A block's weights are done with once its gradients are in, unless backward is
                # split (zero-bubble): its BI may still need them while an earlier BW completes the count.
                if self.zero == 3 and bucket is not self._root and not self.execution.split_backward:
                    self._free(bucket.index)
                if self._sync or self.zero >= 2:
                    self._launch(bucket)
        return hook

    def _materialise(self, bucket: Bucket, device: torch.device) -> None:
        """Make the bucket's full gradient if it has none (the first gradient of an accumulation)
        and add the parked gradients into it."""
        if bucket.grad is None or bucket.reduced:
            bucket.grad = torch.zeros(bucket.padded, dtype=torch.float32, device=device)
            bucket.reduced = False
        for j, grad in bucket.parked.items():
            bucket.view(bucket.grad, j).add_(grad)
        bucket.parked.clear()

    def _launch(self, bucket: Bucket) -> None:
        comm = self.topo.comm
        if self.zero >= 2:
            bucket.incoming = bucket.grad.new_empty(bucket.shard_size)
            bucket.pending = comm.reduce_scatter(bucket.incoming, bucket.grad, GRAD, async_op=True)
            self._in_flight.append(bucket)
            while len(self._in_flight) > 1:  # double buffering: one reducing while the next fills
                self._finish(self._in_flight[0])
        elif self.hierarchical:
            bucket.pending = hierarchical.all_reduce(bucket.grad, self.topo)
        else:
            bucket.pending = self.codec.all_reduce(bucket.grad, comm, GRAD, bucket.index)

    def _finish(self, bucket: Bucket) -> None:
        """ZeRO >= 2: wait for the bucket's reduce-scatter, add the result to its shard, free the
        full gradient."""
        bucket.pending.wait()
        if bucket.grad_shard is None:
            bucket.grad_shard = bucket.incoming
        else:
            bucket.grad_shard.add_(bucket.incoming)
        bucket.pending = bucket.incoming = bucket.grad = None
        self._in_flight.remove(bucket)

    def reduce(self) -> None:
        """Finish every bucket's reduction (starting those that have not started) and expose the
        result: `p.grad` views (ZeRO-0) or each bucket's reduced shard (ZeRO >= 1)."""
        for bucket in self.buckets:
            if bucket.parked:
                self._materialise(bucket, self.topo.device)
            if bucket.pending is None and bucket.grad is not None:
                self._launch(bucket)
        while self._in_flight:
            self._finish(self._in_flight[0])
        for bucket in self.buckets:
            if bucket.pending is not None:
                bucket.pending.wait()
                bucket.pending = None
            bucket.seen = 0
            reduced = bucket.grad_shard if self.zero >= 2 else bucket.grad
            if reduced is None:
                continue
            if bucket is self._tied:  # the embedding's and the head's gradient, on both stages
                self.topo.comm.all_reduce(reduced, "embed")
            if self.zero < 2:
                bucket.reduced = True
                bucket.grad_shard = bucket.grad[bucket.lo:bucket.hi]
                if not self.flat:  # plain AdamW on the (fp32) parameters
                    for i, p in enumerate(bucket.params):
                        p.grad = bucket.view(bucket.grad, i)
        self._sum_sequence_parallel()
        if self.zero == 3:  # nothing gathered outlives the step: the next forward sees the updated shards
            for bucket in self.buckets:
                if bucket.gathering is not None:
                    bucket.gathering.wait()
                    bucket.gathering = None
                self._free(bucket.index)

    def _sum_sequence_parallel(self) -> None:
        """Under SP each tp rank's gradient of a tp-replicated parameter (norms) covers its own
        tokens only: sum those over tp. Bucket layouts match across tp, so the shards line up."""
        if not self.execution.sequence_parallel:
            return
        if self.zero == 0:  # the optimizer reads the whole bucket
            views = [b.view(b.grad, i) for b in self.buckets if b.grad is not None
                     for i, p in enumerate(b.params) if spec_of(p)[2] == 1]
        else:
            views = [g for g, p in self.shard_pieces() if spec_of(p)[2] == 1]
        if views:
            flat = torch.cat([v.reshape(-1) for v in views])
            self.topo.comm.all_reduce(flat, "tp")
            for v, part in zip(views, flat.split([v.numel() for v in views])):
                v.copy_(part.view_as(v))

    def shard_pieces(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """(gradient slice, its parameter) for this rank's shard of every reduced bucket."""
        return [(b.grad_shard[lo - b.lo:hi - b.lo], b.params[i])
                for b in self.buckets if b.grad_shard is not None for i, lo, hi in b.pieces()]

    def clip(self, max_norm: float, loss_scale: float = 1.0) -> float:
        """Divide the gradients by the loss scale and clip them by the true global norm (shards
        summed over dp x cp, tp and pp); returns that norm, unscaled. It is the same number on
        every rank, non-finite on all of them when any rank's gradient overflowed."""
        scaled = [self.owned_grad(b) for b in self.buckets if self.owned_grad(b) is not None]
        # The tied embedding's head copy holds the same gradient as the embedding: count it once.
        pieces = [(g, p) for g, p in self.shard_pieces() if not (self._tied_copy and p is self._tied.params[0])]
        return clip_gradients(pieces, max_norm, self.topo, scaled, dp_sharded=True, loss_scale=loss_scale)

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.grad = bucket.grad_shard = None
            bucket.parked.clear()
        for p in self.params:
            p.grad = None

    # ------------------------------------------------------------------ optimizer
    def build_optimizer(self, train_cfg):
        """Plain AdamW on the parameters (fp32 ZeRO-0) or AdamW on the fp32 masters."""
        if not self.flat:
            return build_optimizer(self.params, train_cfg)
        return ShardedAdamW(self, train_cfg)

    @torch.no_grad()
    def after_step(self) -> None:
        """Copy separate masters into the parameters, then (ZeRO-1/2) all-gather the updated
        shards into the full parameters, in the model dtype (ZeRO-3 gathers lazily)."""
        if self.separate_masters:
            for k, master in enumerate(self.masters):  # from pinned host memory when offloaded: asynchronous
                self._owned_params(k).copy_(master, non_blocking=True)
        if self.zero in (0, 3):
            return
        pending = [self.topo.comm.all_gather(f, f[b.lo:b.hi], GRAD, async_op=True)
                   for b, f in zip(self.buckets, self.flat)]
        for work in pending:
            work.wait()

    # ------------------------------------------------------------------ checkpoint
    def _signature(self, bucket: Bucket) -> torch.Tensor:
        """What a bucket's codec state belongs to: its parameters (by name, in order) and size."""
        names = "\n".join(self._names.get(id(p), "?") for p in bucket.params)
        return torch.tensor([zlib.crc32(names.encode()), bucket.padded], dtype=torch.int64)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's codec state (error feedback, PowerSGD's Q) by bucket, with each bucket's
        signature."""
        state = self.codec.state_dict()
        keys = {int(name.split(".")[1]) for name in state}
        return {**state, **{f"signature.{k}": self._signature(self.buckets[k]) for k in keys}}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Restore codec state for the buckets that hold the saved parameters at the saved size;
        others (buckets laid out differently since) start afresh, as in a new run."""
        same = {k for k in range(len(self.buckets))
                if torch.equal(state.get(f"signature.{k}", torch.zeros(0)), self._signature(self.buckets[k]))}
        self.codec.load_state_dict({name: t.to(self.topo.device) for name, t in state.items()
                                    if not name.startswith("signature.") and int(name.split(".")[1]) in same})

    # ------------------------------------------------------------------ accounting
    def model_state_bytes(self, optimizer) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer state this rank holds now, counted from the
        tensors' storages (each storage once)."""
        seen: set[int] = set()

        def count(tensors) -> int:
            total = 0
            for t in tensors:
                if t is None:
                    continue
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    total += storage.nbytes()
            return total
        state = optimizer.state.values()
        # fp32 masters count as optimizer state (the ZeRO paper's K = 12 bytes per parameter).
        masters = self.masters if self.separate_masters else []
        return {"params": count(list(self.params) + self.shards),
                "grads": count([p.grad for p in self.params] + [b.grad for b in self.buckets]
                               + [b.grad_shard for b in self.buckets]),
                "optimizer": count([v for s in state for v in s.values() if torch.is_tensor(v) and v.ndim] + masters)}


def _split(params: list[nn.Parameter], limit_bytes: float) -> list[list[nn.Parameter]]:
    """Consecutive runs of params, each at most limit_bytes of fp32 gradient (or one parameter)."""
    out, run, size = [], [], 0
    for p in params:
        if run and size + 4 * p.numel() > limit_bytes:
            out.append(run)
            run, size = [], 0
        run.append(p)
        size += 4 * p.numel()
    return out + [run] if run else out


# ---------------------------------------------------------------------- checkpoint export / import
# train/checkpoint.py stores the optimizer's state in the logical parameter space; these two say
# where that state lives in a ShardedAdamW, so the checkpoint never depends on the bucket layout.
def zero_pieces(optimizer: ShardedAdamW) -> list[tuple[nn.Parameter, int, int, torch.Tensor]]:
    """(parameter, start, end, piece) for every slot: `piece` holds the weights AdamW updates for
    the parameter's flattened local elements [start, end), and AdamW keys their state by it."""
    out = []
    for bucket, piece, a, b in optimizer.slots:
        at = optimizer.reducer.owned_range(bucket)[0] + a  # bucket coordinates
        i = max(j for j, off in enumerate(bucket.offsets) if off <= at)
        start = at - bucket.offsets[i]
        out.append((bucket.params[i], start, start + (b - a), piece))
    return out


def zero_loaded(optimizer: ShardedAdamW) -> None:
    """The pieces were overwritten (a checkpoint was loaded): make the parameters agree with them."""
    optimizer.reducer.after_step()
