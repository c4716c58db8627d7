"""Where every rank sits in the 4D grid, and the process groups that follow from it.

Layout: world = pp x dp x cp x tp with tp fastest, then cp, then dp, pp slowest (Megatron's
order), so tensor-parallel groups are consecutive ranks inside one node and pipeline stages are
the outermost dimension. `Layout` is the pure arithmetic (tested over every factorisation);
`Topology` builds the one DeviceMesh ("pp", "dp", "cp", "tp") from it and hands out groups.
Nothing else in tetrad computes ranks by hand.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

import torch
import torch.distributed as dist

from tetrad.comm.ops import Comm
from tetrad.model.tensor import DeferredWeightGrads

DIMS = ("pp", "dp", "cp", "tp")


@dataclass(frozen=True)
class Layout:
    pp: int = 1
    dp: int = 1
    cp: int = 1
    tp: int = 1

    @property
    def sizes(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.cp, self.tp)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.cp * self.tp

    def grid(self) -> torch.Tensor:
        """Rank of every coordinate: grid[pp, dp, cp, tp]; the DeviceMesh is built from this."""
        return torch.arange(self.world_size).reshape(self.sizes)

    def coords(self, rank: int) -> dict[str, int]:
        """The (pp, dp, cp, tp) coordinate of `rank`."""
        out, rest = {}, rank
        for name, size in reversed(list(zip(DIMS, self.sizes))):
            out[name] = rest % size
            rest //= size
        return {name: out[name] for name in DIMS}

    def groups(self, dims: tuple[str, ...]) -> list[list[int]]:
        """Every group spanning `dims` (the other coordinates fixed), each as a sorted rank list."""
        grid = self.grid()
        keep = [DIMS.index(d) for d in dims]
        fixed = [i for i in range(4) if i not in keep]
        perm = fixed + sorted(keep)
        flat = grid.permute(perm).reshape(-1, int(torch.tensor([self.sizes[i] for i in keep]).prod()))
        return [row.tolist() for row in flat]

    def group_of(self, rank: int, dims: tuple[str, ...]) -> list[int]:
        return next(g for g in self.groups(dims) if rank in g)


class Topology:
    """This rank's place in the layout, its process groups, and the accounted collectives.

    With world size 1 (or no process group) every group is None and every size is 1, so the
    same model code runs as a plain single-device model.
    """

    def __init__(self, layout: Layout, device: torch.device, ranks_per_node: int = 8, cp_algo: str = "ring",
                 sequence_parallel: bool = False, split_backward: bool = False):
        self.layout = layout
        self.cp_algo = cp_algo  # how attention uses the cp dimension: "ring" or "alltoall"
        # Whether tp also splits the residual stream along the sequence (model/tensor.py).
        self.sequence_parallel = sequence_parallel and layout.tp > 1
        # Zero-bubble schedules run the input- and weight-gradient halves of backward apart: linear
        # layers then route their weight gradients through `weight_grads` (model/tensor.py), which
        # the executor opens and applies (parallel/pipeline/executor.py).
        self.split_backward = split_backward
        self.weight_grads = DeferredWeightGrads()
        self.device = device
        self.ranks_per_node = ranks_per_node
        self.distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if self.distributed else 0
        world = dist.get_world_size() if self.distributed else 1
        if world != layout.world_size:
            raise ValueError(f"layout {layout} needs {layout.world_size} ranks, the job has {world}")
        self.coords = layout.coords(self.rank)
        self._groups: dict[str, dist.ProcessGroup | None] = {}
        self._sub_sizes: dict[str, int] = {}  # groups made after the mesh: per-node halves, "embed"
        self.mesh = None
        if self.distributed:
            from torch.distributed.device_mesh import DeviceMesh
            self.mesh = DeviceMesh(device.type, layout.grid(), mesh_dim_names=DIMS)
            for name in DIMS:
                self._groups[name] = self.mesh.get_group(name)
            # Gradients are reduced over dp x cp: CP ranks hold the same weights.
            self._groups["dp_cp"] = self.mesh["dp", "cp"]._flatten("dp_cp").get_group()
        self.comm = Comm(self)

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "Topology":
        return cls(Layout(), torch.device(device))

    def group(self, name: str):
        """The process group for "pp", "dp", "cp", "tp", "dp_cp" (or one made later: the per-node
        halves of dp_cp, "embed"); None when it has one rank or this rank is not in one."""
        return self._groups.get(name) if self.size(name) > 1 else None

    def size(self, name: str) -> int:
        if name == "dp_cp":
            return self.layout.dp * self.layout.cp
        if name in DIMS:
            return getattr(self.layout, name)
        return self._sub_sizes.get(name, 1)

    def local_rank(self, name: str) -> int:
        """This rank's index inside its `name` group."""
        if name == "dp_cp":
            return self.coords["dp"] * self.layout.cp + self.coords["cp"]
        return self.coords[name]

    def global_rank(self, **coords: int) -> int:
        """The rank at this rank's coordinate with some dimensions replaced, e.g. pp=stage+1."""
        c = {**self.coords, **coords}
        return int(self.layout.grid()[c["pp"], c["dp"], c["cp"], c["tp"]])

    def split_by_node(self) -> None:
        """Create (once; collective over the whole job) the "dp_cp_intra" groups (dp x cp ranks on
        one node, node = rank // ranks_per_node) and "dp_cp_inter" (the same position on every
        node), for hierarchical gradient reduction."""
        if "dp_cp_intra" in self._sub_sizes:
            return
        for group in self.layout.groups(("dp", "cp")):
            nodes: dict[int, list[int]] = {}
            for r in group:
                nodes.setdefault(r // self.ranks_per_node, []).append(r)
            intra = list(nodes.values())
            if len({len(g) for g in intra}) != 1:
                raise ValueError(f"dp x cp group {group} is spread unevenly over nodes of {self.ranks_per_node}")
            inter = [list(ranks) for ranks in zip(*intra)]
            for name, subgroups in (("dp_cp_intra", intra), ("dp_cp_inter", inter)):
                for ranks in subgroups:
                    pg = dist.new_group(ranks) if self.distributed else None
                    if self.rank in ranks:
                        self._groups[name] = pg
                        self._sub_sizes[name] = len(ranks)

    def make_embedding_group(self) -> None:
        """Create (collective over the whole job) the "embed" groups: the first and the last rank
        of each pipeline, which both hold the tied embedding weight (its head copy on the last)."""
        for ranks in self.layout.groups(("pp",)):
            pair = [ranks[0], ranks[-1]]
            pg = dist.new_group(pair) if self.distributed else None
            if self.rank in pair:
                self._groups["embed"] = pg
                self._sub_sizes["embed"] = len(pair)

    @cached_property
    def tp_size(self) -> int:
        return self.layout.tp

    @cached_property
    def tp_rank(self) -> int:
        return self.coords["tp"]

    @property
    def is_first_stage(self) -> bool:
        return self.coords["pp"] == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords["pp"] == self.layout.pp - 1


def factorisations(world: int) -> list[Layout]:
    """Every (pp, dp, cp, tp) with product `world`."""
    divs = [d for d in range(1, world + 1) if world % d == 0]
    return [Layout(pp, dp, cp, tp) for pp, dp, cp in itertools.product(divs, repeat=3)
            if world % (pp * dp * cp) == 0 for tp in [world // (pp * dp * cp)]]
