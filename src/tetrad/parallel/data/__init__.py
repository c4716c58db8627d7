"""Data parallelism over the gradient group (dp x cp): bucketed, overlapped gradient reduction
and ZeRO 0-3, split along Megatron-Core's seams:

- buffers.py: the bucket layout (flat buffers, shards) and the parameters as views of them;
- lifecycle.py: a bucket's gradient through a step, a small state machine (start and finish of
  its reduction);
- zero3.py: ZeRO-3's gather, free and prefetch of the parameters, block by block;
- finalize.py: the sums beyond the gradient group (tied embedding, SP's tp-replicated grads);
- optimizer.py: AdamW, master weights, the sharded update and clipping;
- codec_state.py: the gradient codec's state in a checkpoint.

CP ranks hold the same weights as their DP peers, so both dimensions reduce (and shard)
together. Under expert parallelism the experts' weights are held by fewer of them (EXPERT_GRAD):
their buckets are reduced and sharded over that group instead, each bucket over its own `group`
(under hybrid ZeRO its chunk inside each shard block, EXPERT_SHARD, the shards then summed over
the same REPLICA groups as the dense ones'). Each micro-batch's loss is already divided by the global batch's count of labels the
loss counts (every token's without a loss mask), so a SUM of the gradients gives exactly the
single-device gradient.

ZeRO-0 all-reduces each bucket; plain AdamW on the full gradients. ZeRO-1 all-reduces too, but
AdamW runs only on this rank's shard; updated shards are then all-gathered into the flat
parameter buffer the model's parameters are views of. ZeRO-2 reduce-scatters every
micro-batch's bucket into this rank's shard and frees the full bucket once reduced (a sum grouped
by micro-batch: equal to ZeRO-0's to fp32 rounding, bit-equal with one micro-batch per rank).
ZeRO-3 keeps only the parameter shard and gathers each block for its use; gradients as ZeRO-2.

Hybrid ZeRO (parallel.zero_shard, FSDP2's HSDP): ZeRO 1-3 shard over blocks of the gradient
group (topology's SHARD groups) and each block holds a replica of every shard: the buckets are
laid out over the block, the reduce-scatter runs inside it and the shard is then all-reduced over
the replicas (REPLICA), ZeRO-3 gathers inside it, and the gradient norm counts one replica only.

`GradReducer` puts these together for the trainer; "auto" bucket size and hierarchical
reduction are measured before it is built (dist/autotune.py), not by it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn as nn

from tetrad.config.sections import bucket_bytes
from tetrad.dist.codec_shapes import INT8_BLOCK, sums_elementwise
from tetrad.dist.codecs import make_codec
from tetrad.dist.layout import EXPERT_GRAD, GRAD, GRAD_DIMS
from tetrad.model.execution import Execution
from tetrad.model.layers import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from tetrad.parallel.data.buffers import Bucket, flatten, initial_shard, lay_out
from tetrad.parallel.data.codec_state import codec_state_dict, load_codec_state
from tetrad.parallel.data.finalize import reduce_replicated, split_over_tp, sum_tied
from tetrad.parallel.data.lifecycle import GradSync
from tetrad.parallel.data.optimizer import (MasterWeights, ShardedAdamW, build_optimizer, clip_gradients, local_norm_sq,
                                            norm_ranges, owned_grad, zero_loaded, zero_pieces)
from tetrad.parallel.data.zero3 import ParamGather

__all__ = ["GradReducer", "ShardedAdamW", "zero_loaded", "zero_pieces"]

# Gradient accumulation fusion (model/execution.py's GRAD_SINK) only for linear weights of at
# least this many elements. Routing a linear through a Python autograd Function (mappings.py's
# _Linear) costs a fixed ~22 us of host time per forward and backward, against F.linear; what
# it saves (the dW tensor and its copy or add into the bucket) grows with the weight, ~0.6 ns per
# element in a Trainer step: break-even near 35k elements (measured on a 2-core CPU; figures in the
# commit that set this). Smaller weights, a tiny model's, would pay the Function for little or nothing.
SINK_MIN_NUMEL = 1 << 16


class GradReducer:
    """The flat gradient (and, under ZeRO, parameter) buffers of `params` and their reduction over
    the gradient group. `parallel` (resolved: no "auto") gives ZeRO stage, codec, bucket size and
    hierarchical reduction. `model` is needed for its execution flags, chunks and tied embedding,
    and under ZeRO-3 for its blocks (which get the gather hooks, prefetching `prefetch` blocks).
    `dtype` is the model's (parameter and compute) dtype: the parameters are cast to it here,
    after their fp32 values seeded the master weights; `offload` keeps masters and optimizer
    state on the CPU. `init` (ZeRO-3 start-up): the parameters come without memory and
    `init(name, param)` gives one's initial value; each rank builds its shard from it, one
    parameter at a time. Without `trains` (forward only: `tetrad eval`) only the weights are kept,
    in `dtype` and laid out as in training (ZeRO-3 shards them), with no masters, gradient
    buffers or optimizer: what a forward needs of the memory a step does."""

    def __init__(self, params: list[nn.Parameter], topo, parallel=None, model: nn.Module | None = None, *,
                 dtype: torch.dtype = torch.float32, offload: bool = False,
                 init: Callable[[str, nn.Parameter], torch.Tensor] | None = None, prefetch: int = 1,
                 trains: bool = True):
        self.params, self.topo = params, topo
        self.execution = getattr(model, "execution", None) or Execution()
        self._names = {id(p): name for name, p in model.named_parameters()} if model is not None else {}
        self.zero = parallel.zero if parallel else 0
        shard, replica = topo.zero_groups()  # the topology's hybrid block is the config's: none at ZeRO-0
        experts = topo.zero_groups(experts=True)[0]
        n = topo.size(GRAD)
        codec = self.codec_name = parallel.grad_codec if parallel else "none"
        self.codec = make_codec(codec, n)
        hierarchical = bool(parallel and parallel.hierarchical is True and n > 1)
        if hierarchical and topo.layout.split_by_node(GRAD_DIMS, topo.ranks_per_node) is None:
            raise ValueError(f"hierarchical reduction needs the dp x cp groups spread evenly over nodes of "
                             f"{topo.ranks_per_node} ranks")
        layout = lay_out(params, model, self.zero, topo.size(shard), topo.local_rank(shard),
                         INT8_BLOCK if codec == "int8" else 1, bucket_bytes(parallel), shard,
                         (experts, topo.size(experts), topo.local_rank(experts)) if experts != shard else None)
        self.buckets, self.blocks, self._tied = layout.buckets, layout.blocks, layout.tied
        # Replicas of a shard hold the same reduced gradient: one of them counts it in the norm.
        self._norm_ranges = norm_ranges(self.buckets, topo, layout.tied.params[0] if layout.tied_copy else None) \
            if replica is None or topo.local_rank(replica) == 0 else []
        # Parameters become views of flat buffers under ZeRO, or behind separate fp32 masters.
        separate = trains and (dtype != torch.float32 or offload)
        self.weights = None
        if self.zero >= 1 or separate or dtype != torch.float32:  # frozen: the cast alone
            self.weights = MasterWeights(self.buckets, topo, self.zero, dtype, separate, offload, shard)
            initial = None if init is None else \
                (lambda bucket, lo, hi: initial_shard(bucket, lo, hi, init, self._names, topo.device))
            for flat, owned in flatten(self.buckets, dtype, topo.device, self.weights.owned_range, initial):
                self.weights.add(flat, owned)
        self.flat = self.weights.flat if self.weights else []
        self.masters = self.weights.masters if self.weights else []
        self.zero3 = None
        if self.zero == 3:
            self.zero3 = ParamGather(self.buckets, self.flat, self.weights.shards, topo, self.execution,
                                     layout.block_buckets, layout.roots, prefetch, shard)
            self.zero3.install(model, layout.blocks)
        linears = [m for m in model.modules()
                   if isinstance(m, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear))] if model is not None else []
        # The dense buckets' codec is sized by the gradient group (under hybrid ZeRO too: its scatter
        # dtype also sets the replicas' sum); the experts' buckets reduce over their own group, with
        # a codec sized by all who hold the same experts (none where that is one rank, which sends
        # nothing) and state of its own (int8's residuals, PowerSGD's Q: codec_state.py).
        codecs = {shard: self.codec}
        if experts != shard:
            codecs[experts] = make_codec(codec, topo.size(EXPERT_GRAD))
        self.sync = GradSync(self.buckets, topo, self.execution, self.zero, codecs, hierarchical,
                             on_complete=self.zero3.on_complete if self.zero3 else None,
                             linear_weights=frozenset(id(m.weight) for m in linears if m.weight.numel() >= SINK_MIN_NUMEL),
                             # every linear's but the head's, made in BI (ColumnParallelLinear.grad_in_bi)
                             deferred_weights=frozenset(id(m.weight) for m in linears
                                                        if not getattr(m, "grad_in_bi", False)),
                             shard=shard, replicas=dict.fromkeys((shard, experts), replica) if replica else {},
                             trains=trains)

    def last_microbatch(self):
        """Backward inside this block is the accumulation's last: buckets reduce as they fill."""
        return self.sync.last_microbatch()

    def gathered(self):
        """Full parameters inside the block (ZeRO-3), e.g. to export or compare them; outside it
        a ZeRO-3 parameter reads as an empty tensor (zero3.py)."""
        return self.zero3.gathered() if self.zero3 else contextlib.nullcontext()

    def release_gathered(self) -> None:
        """Free what ZeRO-3 gathered outside a training step: a forward-only pass (evaluation)
        keeps the root gathered, as a step's forward does until its `reduce`."""
        if self.zero3:
            self.zero3.free_all()

    def owned_grad(self, bucket: Bucket) -> torch.Tensor | None:
        return owned_grad(bucket, self.zero)

    # ------------------------------------------------------------------ end of backward
    def reduce(self) -> None:
        """Finish every bucket's reduction (starting those that have not started), complete the
        sums beyond the gradient group and expose the result: `p.grad` views (fp32 ZeRO-0) or each
        bucket's reduced shard (ZeRO >= 1)."""
        self.sync.finish_all()
        for bucket in self.buckets:
            reduced = bucket.grad_shard if self.zero >= 2 else bucket.grad
            if reduced is None:
                continue
            if bucket is self._tied:  # the embedding's elements, not the bucket's padding
                start = bucket.lo if self.zero >= 2 else 0
                sum_tied(reduced[:max(0, bucket.size - start)], self.topo.comm)
            if self.zero < 2:
                bucket.grad_shard = bucket.grad[bucket.lo:bucket.hi]
                if not self.flat and not self.sync.in_place:  # plain AdamW on the (fp32) parameters
                    for i, p in enumerate(bucket.params):
                        p.grad = bucket.view(bucket.grad, i)
        tp = self.topo.size("tp")
        if self.execution.sequence_parallel:
            reduce_replicated(self._replicated_slices(), self.topo.comm)
        elif tp > 1:
            slices = self._replicated_slices()
            reduce_replicated(split_over_tp(slices, True), self.topo.comm)  # qk-norm: each rank's heads
            if not sums_elementwise(self.codec_name, self.topo.size(GRAD)):  # the tp replicas' sums differ
                reduce_replicated(split_over_tp(slices, False), self.topo.comm, average_over=tp)
        if self.zero3:
            self.zero3.free_all()

    def _replicated_slices(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        if self.zero == 0:  # the optimizer reads the whole bucket
            return [(b.view(b.grad, i), p) for b in self.buckets if b.grad is not None for i, p in enumerate(b.params)]
        return self.shard_slices()

    def shard_slices(self) -> list[tuple[torch.Tensor, nn.Parameter]]:
        """(gradient slice, its parameter) for this rank's shard of every reduced bucket."""
        return [(b.grad_shard[lo - b.lo:hi - b.lo], b.params[i])
                for b in self.buckets if b.grad_shard is not None for i, lo, hi in b.slices()]

    def norm_sq(self) -> torch.Tensor:
        """This rank's share of the squared global gradient norm (of the loss as scaled):
        optimizer.local_norm_sq, summed over the job by the caller."""
        shards = [b.grad_shard for b in self.buckets]
        return local_norm_sq([shards[k][a:b] for k, a, b in self._norm_ranges if shards[k] is not None],
                             self.topo.device)

    def clip(self, norm: float, max_norm: float, loss_scale: float = 1.0) -> None:
        """Divide the gradients by the loss scale and clip them by `norm`, the true global norm
        (unscaled), which every rank must pass alike."""
        clip_gradients([g for g in (self.owned_grad(b) for b in self.buckets) if g is not None], norm, max_norm,
                       loss_scale)

    def close(self) -> None:
        """The end of the run: the parameters' hooks come off (GradSync.close), so that the buckets,
        shards and parameters are freed with the trainer rather than never."""
        self.sync.close()

    def zero_grad(self) -> None:
        self.sync.clear()  # every p.grad None (in place: the next backward overwrites the buckets)

    def build_optimizer(self, train_cfg):
        """Plain AdamW on the parameters (fp32 ZeRO-0) or AdamW on the owned ranges' masters."""
        if self.weights is None:
            return build_optimizer(self.params, train_cfg)
        return ShardedAdamW(self.weights, train_cfg, clear=self.zero_grad)

    # ------------------------------------------------------------------ checkpoint, accounting
    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's codec state (error feedback, PowerSGD's Q) by bucket (codec_state.py)."""
        return codec_state_dict(self.sync.codecs, self.buckets, self._names)

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        load_codec_state(self.sync.codecs, self.buckets, self._names, state, self.topo.device)

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
        state = optimizer.state.values() if optimizer else []
        shards = self.weights.shards if self.weights else []
        masters = self.masters if self.weights and self.weights.separate else []
        # fp32 masters count as optimizer state (the ZeRO paper's K = 12 bytes per parameter).
        return {"params": count(list(self.params) + shards),
                "grads": count([p.grad for p in self.params] + [b.grad for b in self.buckets]
                               + [b.grad_shard for b in self.buckets]),
                "optimizer": count([v for s in state for v in s.values() if torch.is_tensor(v) and v.ndim]
                                   + masters)}
