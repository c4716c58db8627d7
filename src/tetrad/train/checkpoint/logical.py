"""The logical <-> local mapping: which boxes of each logical (unsharded, unpadded) tensor this
rank holds, as views of its own parameters or ZeRO shard slices, wrapped for DCP.

A rank holds whole local parameters, or under ZeRO only its dp x cp shard's contiguous slice of
each flattened parameter; a tp shard sits at its offset in the logical tensor (an ep rank's
experts at theirs along dim 0) and vocabulary padding is cut off. `_logical` turns the boxes into a DTensor DCP can read and write by offset.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._shards_wrapper import LocalShardsWrapper

from tetrad.model.sharding import spec_of
from tetrad.parallel.data import ShardedAdamW, zero_pieces
from tetrad.train.checkpoint.store import CheckpointError


@dataclasses.dataclass
class Piece:
    """Elements [start, end) of a local parameter of `shape`, flattened: `values` holds them (the
    parameter itself, or the ZeRO shard's slice of it) and the optimizer keeps their state under
    `values`."""

    name: str
    param: nn.Parameter
    shape: tuple[int, ...]
    start: int
    end: int
    values: torch.Tensor


def pieces(params: dict[str, nn.Parameter], optimizer) -> list[Piece]:
    """What this rank holds and updates: whole local parameters, or under ZeRO its shard's slices."""
    if isinstance(optimizer, ShardedAdamW):
        names = {id(p): name for name, p in params.items()}
        return [Piece(names[id(p)], p, tuple(shape), start, end, values)
                for p, shape, start, end, values in zero_pieces(optimizer)]
    return [Piece(name, p, tuple(p.shape), 0, p.numel(), p) for name, p in params.items()]


def _flat_boxes(shape: tuple[int, ...], start: int, end: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Elements [start, end) of a row-major tensor of `shape` as (offsets, sizes) boxes, each of
    them contiguous in memory (leading ones, then a run, then whole trailing dimensions)."""
    if start >= end:
        return []
    if len(shape) <= 1:
        return [((start,), (end - start,))] if shape else [((), ())]
    inner = math.prod(shape[1:])
    first, last = start // inner, (end - 1) // inner
    if first == last:
        return [((first, *o), (1, *s)) for o, s in _flat_boxes(shape[1:], start - first * inner, end - first * inner)]
    head = (first + 1) * inner if start % inner else start  # a partial first row, then whole rows
    whole_end = end // inner
    out = _flat_boxes(shape, start, head) if head > start else []
    if whole_end > head // inner:
        out.append(((head // inner, *[0] * (len(shape) - 1)), (whole_end - head // inner, *shape[1:])))
    return out + _flat_boxes(shape, whole_end * inner, end)


def chunks(piece: Piece, flat: torch.Tensor) -> list[tuple[tuple[int, ...], torch.Tensor]]:
    """(offsets in the logical tensor, view of `flat`) for every box of `piece`, whose elements
    `flat` holds: a tp shard's boxes move to its place, vocabulary padding is cut off."""
    spec, index, _ = spec_of(piece.param)
    shape = piece.shape
    strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
    out = []
    for offsets, sizes in _flat_boxes(shape, piece.start, piece.end):
        at = sum(o * s for o, s in zip(offsets, strides)) - piece.start
        box = flat[at:at + math.prod(sizes)].view(sizes)
        offsets = list(offsets)
        offsets[0] += spec.ep_block[0] * shape[0] if spec.expert_split else 0  # this ep rank's experts
        if spec.shard_dim is not None:
            dim = spec.shard_dim
            offsets[dim] += index * shape[dim]
            keep = min(sizes[dim], spec.full_shape[dim] - offsets[dim])
            if keep <= 0:
                continue
            box = box.narrow(dim, 0, keep)
        out.append((tuple(offsets), box))
    return out


def mesh_on(mesh: DeviceMesh, device_type: str) -> DeviceMesh:
    """The same ranks and dimensions as `mesh`, on `device_type`. State kept on another device than
    the mesh's (optimizer state offloaded to the host beside an accelerator mesh) is wrapped on it,
    so that DCP writes and fills the caller's own buffers: on the accelerator mesh, DTensor would
    copy them to the device and a load would fill the copies. No process group is made: DCP's
    coordination runs on the default group, and the wrapped tensors need none."""
    return DeviceMesh(device_type, mesh.mesh, mesh_dim_names=mesh.mesh_dim_names, _init_backend=False)


class _Boxes(LocalShardsWrapper):
    """torch's LocalShardsWrapper for boxes of any rank. DTensor.from_local views the wrapper as its
    own shape, which torch's takes for several 1-D or 2-D boxes only: a 3-D tensor's ZeRO shard (an
    MoE layer's expert weights and their moments) can be several boxes on a rank. That view is
    each box as it is, as torch's own gives for 1-D and 2-D boxes."""

    @staticmethod
    def handle_view(args, kwargs) -> LocalShardsWrapper:
        wrapper, shape = args[0], args[1]
        boxes = wrapper.local_shards()
        if len(boxes) > 1 and boxes[0].ndim > 2 and list(shape) == list(wrapper.shape):
            return _Boxes([torch.ops.aten.view.default(b, b.shape, **kwargs) for b in boxes], wrapper.local_offsets())
        return LocalShardsWrapper.handle_view(args, kwargs)


def logical(chunks: list[tuple[tuple[int, ...], torch.Tensor]], full_shape: tuple[int, ...], mesh) -> torch.Tensor:
    """The logical tensor of which this rank holds `chunks`, as DCP saves and loads it: a DTensor
    of the chunks (any boxes; DCP reads and writes them by offset), or the tensor in one process."""
    if mesh is None:
        (offsets, tensor), = chunks
        if tuple(tensor.shape) != tuple(full_shape):
            raise CheckpointError(f"one process holds {tuple(tensor.shape)} of a {full_shape} tensor")
        return tensor
    wrapper = _Boxes([t for _, t in chunks], [o for o, _ in chunks])
    stride = [math.prod(full_shape[d + 1:]) for d in range(len(full_shape))]
    return DTensor.from_local(wrapper, mesh, [Replicate()] * mesh.ndim, run_check=False,
                              shape=torch.Size(full_shape), stride=tuple(stride))


def check_optimizer_covered(optimizer, mine: list[Piece]) -> None:
    """Refuse to save an optimizer whose state is keyed by tensors we do not know (it would be lost)."""
    known = {id(p.values) for p in mine}
    if any(id(key) not in known for key in optimizer.state):
        raise CheckpointError(f"{type(optimizer).__name__} keeps state for tensors that are not parameters or "
                              "ZeRO shard slices of them; teach checkpoint.pieces() where its state lives")


