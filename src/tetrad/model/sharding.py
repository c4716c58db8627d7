"""The logical (unsharded) parameter space, and how each local parameter maps into it.

Every parameter carries a `ParamSpec`: its logical shape, which dimension (if any) is split over
which group, the padding that makes that dimension divisible, which block of its dim 0 it holds
under expert parallelism (an MoE layer's experts: whole ones per ep rank, as well as their tp
split), and how it is initialised. From
that one record follow: layout-independent initialisation (the same seed gives the same logical
weights at any dp/tp/pp/cp/ep), gathering the full tensor for parity tests and HF export, and
slicing a full tensor into any layout's shard (checkpoint resharding).
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

from tetrad.dist.layout import EP

_SPEC_ATTR = "_tetrad_spec"


@dataclass(frozen=True)
class ParamSpec:
    full_shape: tuple[int, ...]  # logical shape, without padding
    shard_dim: int | None = None  # None: replicated over the group
    group: str = "tp"
    padded_size: int | None = None  # size of shard_dim once padded to a multiple of the group size
    init: str = "normal"  # "normal" (std below), "ones" or "zeros"
    std: float = 0.02
    # Replicated over tp, but each tp rank's gradient covers only its own heads (qk-norm's
    # weights): summed over tp even without sequence parallelism (parallel/data/finalize.py).
    grad_split_over_tp: bool = False
    # (this rank's block, blocks) of dim 0 split into equal contiguous blocks over "ep": an MoE
    # layer's experts under expert parallelism; (0, 1): whole.
    ep_block: tuple[int, int] = (0, 1)

    @property
    def expert_split(self) -> bool:
        """Split over "ep": its gradient is summed over the expert gradient group, not GRAD."""
        return self.ep_block[1] > 1


def new_param(full_shape: tuple[int, ...], *, shard_dim: int | None = None, parts: int = 1, index: int = 0,
              pad_to: int | None = None, init: str = "normal", std: float = 0.02, group: str = "tp",
              grad_split_over_tp: bool = False, ep_block: tuple[int, int] = (0, 1)) -> nn.Parameter:
    """An uninitialised local parameter holding shard `index` of `parts` of a logical tensor.

    `pad_to` rounds the sharded dimension up (vocabulary padding); the pad rows are zero and are
    not part of the logical tensor. `ep_block`: ParamSpec's. Values are filled later by
    `init_parameters`.
    """
    padded = None
    local = list(full_shape)
    local[0] //= ep_block[1]
    if shard_dim is not None:
        size = full_shape[shard_dim]
        padded = math.ceil(size / (pad_to or parts)) * (pad_to or parts)
        if padded % parts:
            raise ValueError(f"padded size {padded} of dim {shard_dim} does not split into {parts} parts")
        local[shard_dim] = padded // parts
    param = nn.Parameter(torch.empty(local))
    set_spec(param, ParamSpec(tuple(full_shape), shard_dim, group, padded, init, std, grad_split_over_tp,
                                       tuple(ep_block)), index, parts)
    return param


def set_spec(param: torch.Tensor, spec: ParamSpec, index: int = 0, parts: int = 1) -> None:
    setattr(param, _SPEC_ATTR, (spec, index, parts))


def spec_of(param: torch.Tensor) -> tuple[ParamSpec, int, int]:
    """(spec, shard index, number of shards); a parameter without a spec is replicated."""
    found = getattr(param, _SPEC_ATTR, None)
    return found if found is not None else (ParamSpec(tuple(param.shape)), 0, 1)


def local_part(name: str, param: torch.Tensor, stored) -> torch.Tensor:
    """This rank's shard of parameter `name` (`param`: its local tensor, storage or not) from
    `stored`: the logical tensor, or a handle to it with its `shape`, of which `stored[box]` reads
    that part alone (init_from.stored_weights'). The vocabulary's padding rows are zero."""
    spec, index, _ = spec_of(param)
    if tuple(stored.shape) != tuple(spec.full_shape):
        raise ValueError(f"the starting weights' {name} is {tuple(stored.shape)}, the model's {spec.full_shape}")
    box = [slice(0, size) for size in spec.full_shape]
    block, blocks = spec.ep_block
    if blocks > 1:  # this ep rank's experts
        size = spec.full_shape[0] // blocks
        box[0] = slice(block * size, (block + 1) * size)
    if spec.shard_dim is None:
        return stored[tuple(box)]
    dim, local = spec.shard_dim, param.shape[spec.shard_dim]
    start = min(index * local, spec.full_shape[dim])
    box[dim] = slice(start, min(start + local, spec.full_shape[dim]))
    part = stored[tuple(box)]
    if part.shape[dim] < local:  # the padded vocabulary's last rows
        pad = list(part.shape)
        pad[dim] = local - part.shape[dim]
        part = torch.cat([part, part.new_zeros(pad)], dim=dim)
    return part


def unpad(full_padded: torch.Tensor, spec: ParamSpec) -> torch.Tensor:
    """Drop the padding of a gathered tensor, giving the logical tensor."""
    if spec.shard_dim is None:
        return full_padded
    return full_padded.narrow(spec.shard_dim, 0, spec.full_shape[spec.shard_dim])


def logical_init(name: str, spec: ParamSpec, seed: int) -> torch.Tensor:
    """The logical tensor a parameter starts from: a function of (seed, name) alone, so every
    layout builds the same model."""
    if spec.init == "ones":
        return torch.ones(spec.full_shape)
    if spec.init == "zeros":
        return torch.zeros(spec.full_shape)
    gen = torch.Generator().manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63))
    return torch.randn(spec.full_shape, generator=gen) * spec.std


@torch.no_grad()
def init_parameters(model: nn.Module, seed: int, weights: Callable[[str], torch.Tensor | None] | None = None) -> None:
    """Fill every local parameter with its shard of the logical initial tensor (or of
    `weights(name)`, weights a run starts from, read by that shard alone), one parameter at a time,
    so a model too large for one device is never materialised whole, nor read whole by a rank."""
    for name, param in model.named_parameters():
        param.copy_(initial_value(name, param, seed, weights))


def initial_value(name: str, param: torch.Tensor, seed: int,
                  weights: Callable[[str], torch.Tensor | None] | None = None) -> torch.Tensor:
    """This rank's (tp) shard of parameter `name`'s logical initial tensor, or of `weights(name)`
    (weights a run starts from: a tensor, or a handle of which that shard alone is read; None where
    they lack it and it starts at the logical init: init_from.initial_weights), on the CPU."""
    spec = spec_of(param)[0]
    stored = None if weights is None else weights(name)
    return local_part(name, param, logical_init(name, spec, seed) if stored is None else stored)


@torch.no_grad()
def gather_full(param: torch.Tensor, topo) -> torch.Tensor:
    """The logical tensor of a (possibly tp- and ep-sharded) parameter, on every rank of its groups."""
    spec, _, parts = spec_of(param)
    full = param.detach()
    if parts > 1:
        local = full.movedim(spec.shard_dim, 0).contiguous()
        out = local.new_empty((parts * local.shape[0], *local.shape[1:]))
        topo.comm.all_gather(out, local, spec.group)
        full = out.movedim(0, spec.shard_dim)
    full = unpad(full, spec)
    if spec.expert_split:
        out = full.new_empty((spec.full_shape[0], *full.shape[1:]))
        topo.comm.all_gather(out, full.contiguous(), EP)
        full = out
    return full


def full_state_dict(model: nn.Module, topo) -> dict[str, torch.Tensor]:
    """Logical name -> logical tensor for every parameter this rank's model chunk holds."""
    return {name: gather_full(p, topo).cpu().clone() for name, p in model.named_parameters()}
