"""The 4D rank layout: pure properties over every factorisation, and the DeviceMesh agreeing."""

import pytest
import torch.distributed as dist

from conftest import run_ranks
from tetrad.topology import DIMS, Layout, Topology, factorisations

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
        assert int(layout.grid()[c["pp"], c["dp"], c["cp"], c["tp"]]) == r
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
    layout = Layout(pp=2, dp=2, cp=1, tp=2)
    import torch
    topo = Topology(layout, torch.device("cpu"))
    return {name: sorted(dist.get_process_group_ranks(topo._groups[name])) for name in (*DIMS, "dp_cp")}


@pytest.mark.dist
def test_device_mesh_groups_match_layout():
    layout = Layout(pp=2, dp=2, cp=1, tp=2)
    results = run_ranks(_mesh_groups, 8)
    for rank, groups in enumerate(results):
        for name in DIMS:
            assert groups[name] == layout.group_of(rank, (name,)), (rank, name)
        assert groups["dp_cp"] == layout.group_of(rank, ("dp", "cp"))
