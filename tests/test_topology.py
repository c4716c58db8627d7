"""The 4D rank layout: pure properties over every factorisation, and the DeviceMesh agreeing."""

import pytest
import torch.distributed as dist

from conftest import run_ranks
from tetrad.dist.layout import DIMS, Layout, factorisations
from tetrad.dist.topology import INTER, INTRA, Topology

ALL_LAYOUTS = [layout for world in range(1, 65) for layout in factorisations(world)]


def test_factorisations_are_complete():
    assert len(factorisations(8)) == 20  # 2^3 over 4 dimensions: C(3+3, 3) = 20 ordered choices
    assert all(layout.world_size == 12 for layout in factorisations(12))


@pytest.mark.parametrize("layout", ALL_LAYOUTS, ids=str)
def test_layout_properties(layout):
    world = layout.world_size
    coords = [layout.coords(r) for r in range(world)]
    # every rank has exactly one coordinate and every coordinate one rank
    assert len({tuple(c.values()) for c in coords}) == world
    for r, c in enumerate(coords):
        assert layout.grid()[c["pp"]][c["dp"]][c["cp"]][c["tp"]] == r
        assert layout.rank_at(c) == r
    for dims in [("tp",), ("cp",), ("dp",), ("pp",), ("dp", "cp")]:
        groups = layout.groups(dims)
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(world)), f"{dims} groups do not partition the world"
        size = 1
        for d in dims:
            size *= getattr(layout, d)
        assert all(len(g) == size for g in groups)
        for g in groups:  # members differ only in the group's own dimensions
            fixed = [d for d in DIMS if d not in dims]
            assert len({tuple(layout.coords(r)[d] for d in fixed) for r in g}) == 1
    for g in layout.groups(("tp",)):  # TP groups are consecutive ranks (inside one node)
        assert g == list(range(g[0], g[0] + layout.tp))


def _mesh_groups():
    import datetime

    import torch
    topo = Topology(Layout(pp=2, dp=2, cp=1, tp=2), torch.device("cpu"), ranks_per_node=2,
                    timeout=datetime.timedelta(seconds=7))
    groups = {name: topo.group(name) for name in (*DIMS, "dp_cp", INTER, "embed")}  # cp: one rank, None
    timeouts = {pg._get_backend(torch.device("cpu")).options._timeout.total_seconds() for pg in groups.values() if pg}
    ranks = {name: sorted(dist.get_process_group_ranks(pg)) if pg else topo.ranks(name) for name, pg in groups.items()}
    return ranks, topo.size(INTRA), timeouts


@pytest.mark.dist
def test_device_mesh_groups_match_layout():
    """Every named group has the layout's ranks and the topology's one timeout. With 2 ranks per
    node each dp group ([0, 2], ...) has one rank per node: its inter-node half is the whole
    group and its intra-node half a single rank (no group)."""
    layout = Layout(pp=2, dp=2, cp=1, tp=2)
    results = run_ranks(_mesh_groups, 8)
    for rank, (groups, intra_size, timeouts) in enumerate(results):
        for name in DIMS:
            assert groups[name] == layout.group_of(rank, (name,)), (rank, name)
        assert groups["dp_cp"] == groups[INTER] == layout.group_of(rank, ("dp", "cp"))
        assert intra_size == 1
        assert groups["embed"] == layout.group_of(rank, ("pp",))  # first and last stage: pp = 2
        assert timeouts == {7.0}


def _closed_groups():
    import torch
    from torch.distributed.distributed_c10d import _world  # torch keeps no public count of live groups
    live = len(_world.pg_map)
    topo = Topology(Layout(pp=2, dp=2, cp=1, tp=2), torch.device("cpu"), ranks_per_node=2)
    groups = {name: topo.group(name) for name in (*DIMS, "dp_cp", INTER, "embed")}
    made = len(_world.pg_map) - live
    # Every rank's groups are up before any is torn down, as after a run's last step: gloo's
    # connectFullMesh on a slow rank fails with 'Connection closed by peer' when a fast one
    # destroys a group it was still meeting (seen once in a loaded full suite).
    dist.barrier()
    topo.close()
    closed = {name: _refused(pg) for name, pg in groups.items() if pg is not None}
    second = Topology(Layout(dp=8), torch.device("cpu"))  # its dp group is the job's own
    dist.barrier()
    second.close()
    world = torch.ones(1)
    dist.all_reduce(world)  # the job's own group outlives the topology
    return made, len(_world.pg_map) - live, closed, world.item()


def _refused(pg) -> bool:
    try:
        dist.get_process_group_ranks(pg)
    except (ValueError, KeyError, RuntimeError):
        return True
    return False


@pytest.mark.dist
def test_close_destroys_every_group_it_made():
    """`tetrad check` under torchrun trains twice in one job: the first run's groups (on NCCL,
    communicators holding device memory) must be gone before the second starts."""
    for made, left, closed, world in run_ranks(_closed_groups, 8):
        assert made > 5 and left == 0 and all(closed.values()) and world == 8.0, (made, left, closed)


def test_split_by_node():
    layout = Layout(dp=4, tp=2)  # dp groups: [0, 2, 4, 6] and [1, 3, 5, 7]
    assert layout.split_by_node(("dp", "cp"), 4) == ([[0, 2], [4, 6], [1, 3], [5, 7]],
                                                     [[0, 4], [2, 6], [1, 5], [3, 7]])
    assert layout.split_by_node(("dp", "cp"), 8) == ([[0, 2, 4, 6], [1, 3, 5, 7]],
                                                     [[0], [2], [4], [6], [1], [3], [5], [7]])
    assert layout.split_by_node(("dp", "cp"), 6) is None  # nodes {0..5}, {6, 7}: 3 + 1 ranks
