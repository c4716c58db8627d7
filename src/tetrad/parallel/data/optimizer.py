"""The optimizer side of data parallelism: AdamW, master weights, the sharded update, clipping.

Each rank updates the part of every bucket it owns (`owned_range`: its 1/N shard under ZeRO >= 1,
the whole bucket under ZeRO-0) and ZeRO-1/2 all-gather the updated shards into the full
parameters afterwards (ZeRO-3 gathers lazily, zero3.py).

Mixed precision (bf16/fp16, the Megatron/DeepSpeed recipe): the flat parameter buffers hold the
model dtype, while AdamW steps on fp32 master weights of the owned range, copied into the
low-precision buffer after each step; the masters start from the fp32 initial weights. With
`offload` the masters and AdamW's state live in CPU memory: each step moves this rank's fp32
gradient shard there and the updated parameters back, through pinned host memory on
accelerators, with copies queued without blocking and one wait before the CPU AdamW reads. fp32
without offload needs no masters:
AdamW updates the parameter storage itself (and ZeRO-0 keeps plain AdamW on the parameters).

The clipping norm is computed from each rank's shard of every bucket in all stages, so ZeRO 0
and 1 do the same arithmetic and give bit-identical results (ZeRO-2 too with one micro-batch).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tetrad import device as devices
from tetrad.config import TrainConfig
from tetrad.device import FUSED_OPTIMIZER_DEVICES
from tetrad.dist.layout import GRAD
from tetrad.model.sharding import spec_of
from tetrad.parallel.data import collectives
from tetrad.parallel.data.buffers import Bucket


def adamw(decay: list[torch.Tensor], no_decay: list[torch.Tensor], cfg: TrainConfig) -> torch.optim.AdamW:
    """tetrad's AdamW (betas and epsilon from `cfg`), weight decay on `decay` only."""
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # torch's fused kernel (one per step, not a loop over tensors) wherever it exists, the CPU included.
    fused = all(p.device.type in FUSED_OPTIMIZER_DEVICES for p in decay + no_decay)
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_eps, fused=fused)


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW on whole parameters; weight decay on matrices only (not on norms, biases), as
    Megatron and nanoGPT do."""
    return adamw([p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2], cfg)


def owned_grad(bucket: Bucket, zero: int) -> torch.Tensor | None:
    """The reduced fp32 gradient of the range of `bucket` this rank's optimizer updates."""
    return bucket.grad if zero == 0 else bucket.grad_shard


class MasterWeights:
    """The weights each bucket's optimizer updates: fp32 masters of the owned range (`separate`:
    a low-precision model or offload), or the parameters' own storage there. Each bucket's owned
    shards are gathered over its own group (Bucket.group); `group`, the dense buckets' (hybrid
    ZeRO's shard group), tells which backend runs them (`scratch_free`)."""

    def __init__(self, buckets: list[Bucket], topo, zero: int, dtype: torch.dtype, separate: bool, offload: bool,
                 group: str = GRAD):
        self.buckets, self.topo, self.zero, self.dtype = buckets, topo, zero, dtype
        self.separate, self.offload = separate, offload
        self.flat: list[torch.Tensor] = []  # flat parameter buffer (model dtype) of each bucket
        self.shards: list[torch.Tensor] = []  # ZeRO-3: the persistent parameter shard of each bucket
        self.masters: list[torch.Tensor] = []  # what the optimizer updates, per bucket
        self._host_grads: dict[int, torch.Tensor] = {}  # offload: each bucket's owned gradient on the host
        self.scratch_free = collectives.scratch_free(topo, group)  # gloo: gather by in-place broadcasts (collectives.py)

    def add(self, flat: torch.Tensor, owned: torch.Tensor) -> None:
        """The next bucket's flat buffer and the fp32 values of its owned range (buffers.flatten):
        keep the master (in pinned host memory under offload on accelerators) and, under ZeRO-3,
        the shard, freeing the rest of the buffer."""
        self.flat.append(flat)
        if self.separate:
            self.masters.append(devices.host_buffer(owned).copy_(owned) if self.offload else owned.clone())
        if self.zero == 3:
            self.shards.append(owned.to(self.dtype, copy=True))
            flat.untyped_storage().resize_(0)
        if not self.separate:
            self.masters.append(self.owned_params(len(self.flat) - 1))

    def owned_range(self, bucket: Bucket) -> tuple[int, int]:
        """The part of the bucket (bucket coordinates) this rank's optimizer updates."""
        return (0, bucket.padded) if self.zero == 0 else (bucket.lo, bucket.hi)

    def owned_params(self, k: int) -> torch.Tensor:
        """Bucket k's parameters in the owned range, in the model dtype: what the masters update."""
        if self.zero == 3:
            return self.shards[k]
        lo, hi = self.owned_range(self.buckets[k])
        return self.flat[k][lo:hi]


    def master_grad(self, bucket: Bucket) -> torch.Tensor:
        """The owned gradient where the masters are: with offload, a copy into a host buffer of
        the bucket's (pinned on accelerators), queued without waiting: synchronize before reading."""
        grad = owned_grad(bucket, self.zero)
        if not self.offload:
            return grad
        if bucket.index not in self._host_grads:
            self._host_grads[bucket.index] = devices.host_buffer(grad)
        return self._host_grads[bucket.index].copy_(grad, non_blocking=True)

    @torch.no_grad()
    def after_step(self) -> None:
        """Copy separate masters into the parameters, then (ZeRO-1/2) all-gather the updated
        shards into the full parameters, in the model dtype (ZeRO-3 gathers lazily)."""
        if self.separate:
            for k, master in enumerate(self.masters):  # from pinned host memory when offloaded: asynchronous
                self.owned_params(k).copy_(master, non_blocking=True)
        if self.zero in (0, 3):
            return
        pending = [collectives.start_gather(self.topo, f, b.shard_size, self.scratch_free, b.group)
                   for b, f in zip(self.buckets, self.flat)]
        for work in pending:
            work.wait()


class ShardedAdamW:
    """AdamW on the masters of the owned range of every bucket. Pieces are cut at parameter
    boundaries so each keeps its parameter's weight decay; AdamW is elementwise, so this is the
    same arithmetic as the unsharded optimizer. `slots` are (bucket, master piece, start, end),
    start and end relative to the bucket's `owned_range` start. `clear` drops the gradients."""

    def __init__(self, weights: MasterWeights, train_cfg, clear):
        self.weights, self.clear = weights, clear
        self.slots = []
        decay, no_decay = [], []
        for bucket, master in zip(weights.buckets, weights.masters):
            lo, hi = weights.owned_range(bucket)
            for i, a, b in bucket.slices(lo, hi):
                piece = master[a - lo:b - lo]
                self.slots.append((bucket, piece, a - lo, b - lo))
                (decay if len(bucket.shapes[i]) >= 2 else no_decay).append(piece)
        self.inner = adamw(decay, no_decay, train_cfg)
        self.param_groups = self.inner.param_groups
        self.state = self.inner.state

    def step(self) -> None:
        grads = {}  # bucket id -> its owned gradient, on the masters' device (offload: the CPU)
        for bucket, piece, a, b in self.slots:
            if id(bucket) not in grads:
                grads[id(bucket)] = self.weights.master_grad(bucket)
            piece.grad = grads[id(bucket)][a:b]
        if self.weights.offload:  # the copies to the host were queued without waiting: wait once
            devices.synchronize(self.weights.topo.device)
        self.inner.step()
        self.weights.after_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for _, piece, _, _ in self.slots:
            piece.grad = None
        self.clear()


# ---------------------------------------------------------------------- clipping
def norm_ranges(buckets: list[Bucket], topo, skip: nn.Parameter | None = None) -> list[tuple[int, int, int]]:
    """(bucket index, start, end), in shard coordinates, of the gradient this rank counts in the
    global norm, fixed by the layout: each rank's shard of every bucket (disjoint across the
    gradient group); shards of a tp-split parameter add over tp; a replicated parameter counts on
    tp rank 0 only; pipeline stages hold different parameters; `skip` (the tied embedding's head
    copy, the embedding's gradient again) not at all. One range per parameter: fp32 norms of whole
    buckets at once lose the single-device norm's precision (rtol 1e-5 in the parity tests)."""
    out: list[tuple[int, int, int]] = []
    for k, bucket in enumerate(buckets):
        for i, a, b in bucket.slices():
            p = bucket.params[i]
            if p is skip or (spec_of(p)[2] == 1 and topo.tp_rank != 0):
                continue
            out.append((k, a - bucket.lo, b - bucket.lo))
    return out


def local_norm_sq(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """This rank's share of the squared global gradient norm: summed over the gradient group, tp
    and pp (the trainer does it in one all-reduce with the step's other numbers) it is the squared
    norm one device would compute. `grads`: the `norm_ranges` of the reduced shards; one fused
    norm kernel over them."""
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    return torch.stack(torch._foreach_norm(grads, 2, dtype=torch.float32)).square().sum()


def clip_gradients(grads: list[torch.Tensor], norm: float, max_norm: float, loss_scale: float = 1.0) -> None:
    """Scale `grads` (what the optimizer will read) so that `norm`, their global norm (unscaled),
    becomes at most max_norm (0 disables). Gradients of a loss multiplied by `loss_scale` (fp16)
    are divided by it in the same pass."""
    factor = (min(1.0, max_norm / (norm + 1e-6)) if max_norm > 0 else 1.0) / loss_scale
    if factor != 1.0:
        torch._foreach_mul_(grads, factor)


# ---------------------------------------------------------------------- checkpoint export / import
# train/checkpoint.py stores the optimizer's state in the logical parameter space; these two say
# where that state lives in a ShardedAdamW, so the checkpoint never depends on the bucket layout.
def zero_pieces(optimizer: ShardedAdamW) -> list[tuple[nn.Parameter, torch.Size, int, int, torch.Tensor]]:
    """(parameter, its local shape, start, end, piece) for every slot: `piece` holds the weights
    AdamW updates for the parameter's flattened local elements [start, end), and AdamW keys
    their state by it. The shape is the bucket's (a freed ZeRO-3 parameter reads as empty)."""
    out = []
    for bucket, piece, a, b in optimizer.slots:
        at = optimizer.weights.owned_range(bucket)[0] + a  # bucket coordinates
        i = max(j for j, off in enumerate(bucket.offsets) if off <= at)
        start = at - bucket.offsets[i]
        out.append((bucket.params[i], bucket.shapes[i], start, start + (b - a), piece))
    return out


def zero_loaded(optimizer: ShardedAdamW) -> None:
    """The pieces were overwritten (a checkpoint was loaded): make the parameters agree with them."""
    optimizer.weights.after_step()
