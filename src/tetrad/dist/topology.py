"""This rank's place in the layout and the named process groups of the job, all created here.

Megatron-Core passes its process groups around as one explicit collection; this is tetrad's.
The groups are made once, in `_create_groups`, in the same order on every rank (NCCL requires
it), with one collective `timeout` for all of them, and destroyed by `close` when the run ends.
Nothing else creates process groups but the checkpointer's two gloo groups for background writes
(train/checkpoint/background.py).

Names: one per dimension ("pp", "dp", "cp", "tp": one DeviceMesh, dist/layout.py's DIMENSIONS);
GRAD ("dp_cp"), the flattened replicated dimensions gradients are reduced over (cp ranks hold
the same weights as dp ranks); INTRA and INTER, its per-node halves for hierarchical reduction
(when it spans nodes evenly); SHARD and REPLICA, hybrid ZeRO's consecutive blocks of
`zero_shard` ranks of it and the ranks at one position in every block (`zero_groups`); under
expert parallelism (layout.ep > 1) EP ("ep"), the blocks of ep dp ranks an MoE layer's all-to-alls
run over, EXPERT_GRAD ("edp_cp"), the ranks holding the same experts, whose gradients are summed
over it (dist/layout.py `expert_groups`), and under hybrid ZeRO its chunks inside the shard blocks,
EXPERT_SHARD (`expert_shards`; their replicas are REPLICA's); "embed", the first and last rank of each pipeline, which both hold
the tied embedding; "pp:a-b" (`link_name`), the ranks at pipeline positions a and b of each
pipeline, one per link the schedule sends over (parallel/pipeline/executor.py: on NCCL a link
needs a communicator of its own). Each group's traffic is reported under one comm_bytes key
(`reported`). Each group's backend options carry the timeout and, on NCCL, the group's
communicator settings (parallel.comm_options; a link takes "pp"'s); gloo has none, and says so.
"""

from __future__ import annotations

import datetime
import sys
from functools import cached_property

import torch
import torch.distributed as dist

from tetrad import device as devices
from tetrad.dist.comm import Comm
from tetrad.dist.layout import DIMENSIONS, DIMS, EP, EXPERT_GRAD, GRAD, GRAD_DIMS, Layout

INTRA, INTER = f"{GRAD}_intra", f"{GRAD}_inter"
SHARD, REPLICA = f"{GRAD}_shard", f"{GRAD}_replica"
EXPERT_SHARD = f"{EXPERT_GRAD}_shard"


class Topology:
    """The layout, this rank's coordinates, its process groups by name and the accounted
    collectives over them (`comm`).

    With world size 1 (or no process group) every group is None and every size is 1, so the
    same model code runs as a plain single-device model.
    """

    def __init__(self, layout: Layout, device: torch.device, ranks_per_node: int = 8,
                 timeout: datetime.timedelta | None = None, pipeline_links: list[tuple[int, int]] = (),
                 comm_options: dict[str, dict] | None = None, zero_shard: int = 0):
        self.layout, self.device, self.ranks_per_node, self.timeout = layout, device, ranks_per_node, timeout
        self.pipeline_links, self.comm_options = list(pipeline_links), comm_options or {}
        self.zero_shard = zero_shard  # hybrid ZeRO's shard size (config/sections.py zero_shard), or 0
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
        self._reported.update(dict.fromkeys((GRAD, INTRA, INTER, SHARD, REPLICA, EXPERT_GRAD, EXPERT_SHARD),
                                             self._reported[GRAD_DIMS[0]]),
                              embed="pp", **{EP: EP})
        self._reported.update(dict.fromkeys((link_name(a, b) for a, b in self.pipeline_links), "pp"))
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
        per_dim = tuple((None, self._options(name)) for name in DIMS)
        self.mesh = DeviceMesh(self.device.type, torch.tensor(self.layout.grid()), mesh_dim_names=DIMS,
                               backend_override=None if all(o is None for _, o in per_dim) else per_dim)
        for name in DIMS:
            self._add(name, self.layout.group_of(self.rank, (name,)), self.mesh.get_group(name))
        options = self._options(GRAD)
        flat = self.mesh[GRAD_DIMS]._flatten(GRAD, backend_override=None if options is None else (None, options))
        self._add(GRAD, self.layout.group_of(self.rank, GRAD_DIMS), flat.get_group())
        halves = self.layout.split_by_node(GRAD_DIMS, self.ranks_per_node)
        if halves is not None and len(self.ranks(GRAD)) > 1:
            for name, groups in zip((INTRA, INTER), halves):
                self._new_groups(name, groups)
        if self.zero_shard:
            for name, groups in zip((SHARD, REPLICA), self.layout.split_in_blocks(GRAD_DIMS, self.zero_shard)):
                self._new_groups(name, groups)
        if self.layout.ep > 1:
            for name, groups in zip((EP, EXPERT_GRAD), self.layout.expert_groups()):
                self._new_groups(name, groups)
            if self.zero_shard:
                self._new_groups(EXPERT_SHARD, self.layout.expert_shards(self.zero_shard))
        if self.layout.pp > 1:
            self._new_groups("embed", [[ranks[0], ranks[-1]] for ranks in self.layout.groups(("pp",))])
        for a, b in self.pipeline_links:
            self._new_groups(link_name(a, b), [[ranks[a], ranks[b]] for ranks in self.layout.groups(("pp",))])
        if self.comm_options and self.rank == 0 and devices.backend_for(self.device.type) != "nccl":
            print(f"tetrad: parallel.comm_options for {', '.join(self.comm_options)} ignored: they are NCCL "
                  f"communicator settings and this job runs on {devices.backend_for(self.device.type)}",
                  file=sys.stderr)

    def _new_groups(self, name: str, groups: list[list[int]]) -> None:
        """One process group per rank list (every rank takes part in creating each, member or
        not); this rank keeps the one it belongs to. Groups of one rank are not made."""
        for ranks in groups:
            if len(ranks) > 1:
                pg = dist.new_group(ranks, timeout=self.timeout, pg_options=self._options(name))
                if self.rank in ranks:
                    self._add(name, ranks, pg)

    def _options(self, name: str):
        """Group `name`'s backend options: the timeout, and its communicator settings on NCCL."""
        return _group_options(self.device.type, self.timeout, self.comm_options.get(name.partition(":")[0], {}))

    def _add(self, name: str, ranks: list[int], pg) -> None:
        self._ranks[name], self._groups[name] = list(ranks), pg

    def close(self) -> None:
        """Destroy this rank's groups, never the job's own (DeviceMesh reuses it for a dimension
        that spans every rank): a process that trains again in the same job (`tetrad check` under
        torchrun) would otherwise keep each communicator of the first run, on NCCL with its device
        buffers, through the second."""
        groups = {id(pg): pg for pg in self._groups.values() if pg is not None and pg != dist.group.WORLD}
        for pg in groups.values():
            dist.destroy_process_group(pg)
        self._groups.clear()
        self.mesh = None

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

    def zero_groups(self, experts: bool = False) -> tuple[str, str | None]:
        """(the group ZeRO shards over, the group its shards are replicated over): (GRAD, None), or
        hybrid ZeRO's (SHARD, REPLICA). With `experts`, the expert parameters' under expert
        parallelism: (EXPERT_GRAD, None), or hybrid ZeRO's (EXPERT_SHARD, REPLICA): a block holds whole
        EP groups, so the experts' shards are replicated over the dense ones' replicas; without ep
        the experts are dense parameters like any other."""
        if experts and self.layout.ep > 1:
            return (EXPERT_SHARD, REPLICA) if self.zero_shard else (EXPERT_GRAD, None)
        return (SHARD, REPLICA) if self.zero_shard else (GRAD, None)

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

    @cached_property
    def ep_size(self) -> int:
        return self.layout.ep

    @cached_property
    def ep_rank(self) -> int:
        """This rank's block of every MoE layer's experts (its place in its EP group)."""
        return self.coords["dp"] % self.layout.ep


def link_name(a: int, b: int) -> str:
    """The group of the pipeline link between pipeline positions a and b."""
    return f"pp:{min(a, b)}-{max(a, b)}"


def _group_options(device_type: str, timeout: datetime.timedelta | None, settings: dict):
    """Backend options carrying `timeout` and, on NCCL, the communicator `settings` (config/sections.py
    COMM_OPTIONS, as Megatron-Core sets them); None where both are torch's defaults."""
    nccl = devices.backend_for(device_type) == "nccl"
    if timeout is None and not (nccl and settings):
        return None
    if nccl:
        options = dist.ProcessGroupNCCL.Options(is_high_priority_stream=settings.get("high_priority_stream", False))
        for key in ("cga_cluster_size", "min_ctas", "max_ctas"):
            if key in settings:
                setattr(options.config, key, settings[key])
    else:
        options = dist.ProcessGroupGloo._Options()
    if timeout is not None:
        options._timeout = timeout
    return options
