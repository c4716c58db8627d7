"""This rank's place in the layout and the named process groups of the job, all created here.

Megatron-Core passes its process groups around as one explicit collection; this is tetrad's.
The groups are made once, in `_create_groups`, in the same order on every rank (NCCL requires
it), with one collective `timeout` for all of them. Nothing else creates process groups.

Names: one per dimension ("pp", "dp", "cp", "tp": one DeviceMesh, dist/layout.py's DIMENSIONS);
GRAD ("dp_cp"), the flattened replicated dimensions gradients are reduced over (cp ranks hold
the same weights as dp ranks); INTRA and INTER, its per-node halves for hierarchical reduction
(when it spans nodes evenly); "embed", the first and last rank of each pipeline, which both hold
the tied embedding. Each group's traffic is reported under one comm_bytes key (`reported`).
"""

from __future__ import annotations

import datetime
from functools import cached_property

import torch
import torch.distributed as dist

from tetrad import device as devices
from tetrad.dist.comm import Comm
from tetrad.dist.layout import DIMENSIONS, DIMS, GRAD, GRAD_DIMS, Layout

INTRA, INTER = f"{GRAD}_intra", f"{GRAD}_inter"


class Topology:
    """The layout, this rank's coordinates, its process groups by name and the accounted
    collectives over them (`comm`).

    With world size 1 (or no process group) every group is None and every size is 1, so the
    same model code runs as a plain single-device model.
    """

    def __init__(self, layout: Layout, device: torch.device, ranks_per_node: int = 8,
                 timeout: datetime.timedelta | None = None):
        self.layout, self.device, self.ranks_per_node, self.timeout = layout, device, ranks_per_node, timeout
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        world = dist.get_world_size() if self.distributed else 1
        if world != layout.world_size:
            raise ValueError(f"layout {layout} needs {layout.world_size} ranks, the job has {world}")
        self.coords = layout.coords(self.rank)
        self._groups: dict[str, dist.ProcessGroup | None] = {}
        self._ranks: dict[str, list[int]] = {}  # members of this rank's group of each name
        # comm_bytes key of each group: a dimension's own; the gradient group's (and its halves')
        # its first dimension's; the tied-embedding pairs' the pipeline's.
        self._reported = {d.name: d.reported_as for d in DIMENSIONS}
        self._reported.update(dict.fromkeys((GRAD, INTRA, INTER), self._reported[GRAD_DIMS[0]]), embed="pp")
        self.mesh = None
        if self.distributed:
            self._create_groups()
        self.comm = Comm(self, device)

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "Topology":
        return cls(Layout(), torch.device(device))

    # ------------------------------------------------------------------ creation (collective)
    def _create_groups(self) -> None:
        """Every group of the job; collective over all ranks, in one fixed order."""
        from torch.distributed.device_mesh import DeviceMesh
        options = _group_options(self.device.type, self.timeout)
        self.mesh = DeviceMesh(self.device.type, self.layout.grid(), mesh_dim_names=DIMS,
                               backend_override=None if options is None else ((None, options),) * len(DIMS))
        for name in DIMS:
            self._add(name, self.layout.group_of(self.rank, (name,)), self.mesh.get_group(name))
        flat = self.mesh[GRAD_DIMS]._flatten(GRAD, backend_override=None if options is None else (None, options))
        self._add(GRAD, self.layout.group_of(self.rank, GRAD_DIMS), flat.get_group())
        halves = self.layout.split_by_node(GRAD_DIMS, self.ranks_per_node)
        if halves is not None and len(self.ranks(GRAD)) > 1:
            for name, groups in zip((INTRA, INTER), halves):
                self._new_groups(name, groups)
        if self.layout.pp > 1:
            self._new_groups("embed", [[ranks[0], ranks[-1]] for ranks in self.layout.groups(("pp",))])
        # Further groups (e.g. one per pipeline link) are created here too, after these.

    def _new_groups(self, name: str, groups: list[list[int]]) -> None:
        """One process group per rank list (every rank takes part in creating each, member or
        not); this rank keeps the one it belongs to. Groups of one rank are not made."""
        for ranks in groups:
            if len(ranks) > 1:
                pg = dist.new_group(ranks, timeout=self.timeout)
                if self.rank in ranks:
                    self._add(name, ranks, pg)

    def _add(self, name: str, ranks: list[int], pg) -> None:
        self._ranks[name], self._groups[name] = list(ranks), pg

    # ------------------------------------------------------------------ lookup
    def group(self, name: str):
        """This rank's process group called `name`; None when it has one rank or this rank is in
        none (a size-1 group needs no communication)."""
        return self._groups.get(name) if self.size(name) > 1 else None

    def ranks(self, name: str) -> list[int]:
        """The global ranks of this rank's `name` group (just this rank where it has none)."""
        return self._ranks.get(name, [self.rank])

    def reported(self, name: str) -> str:
        """The comm_bytes key the traffic of group `name` counts under."""
        return self._reported.get(name, name)

    def size(self, name: str) -> int:
        return len(self.ranks(name))

    def local_rank(self, name: str) -> int:
        """This rank's index inside its `name` group."""
        return self.ranks(name).index(self.rank)

    def global_rank(self, **coords: int) -> int:
        """The rank at this rank's coordinate with some dimensions replaced, e.g. pp=stage+1."""
        return self.layout.rank_at({**self.coords, **coords})

    @cached_property
    def tp_size(self) -> int:
        return self.layout.tp

    @cached_property
    def tp_rank(self) -> int:
        return self.coords["tp"]


def _group_options(device_type: str, timeout: datetime.timedelta | None):
    """Backend options carrying `timeout` for the DeviceMesh's groups (None: torch's default)."""
    if timeout is None:
        return None
    nccl = devices.backend_for(device_type) == "nccl"
    options = dist.ProcessGroupNCCL.Options() if nccl else dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    return options
