"""Link physics of the time model (plan/links.py): which algorithm a data-parallel reduction takes."""

import math

import pytest

from tetrad.plan.hardware import cluster_of
from tetrad.plan.links import group_link, reduction_time, ring_time

CLUSTER = cluster_of("H100-SXM", 16384)


def test_all_reduce_over_thousands_of_nodes_takes_the_tree():
    n, stride, nbytes = 2048, 8, 2**20  # one rank per node, a 1 MiB bucket
    alpha, bw = group_link(CLUSTER, stride, n)
    ring = ring_time("all_reduce", nbytes, n, alpha, bw)
    tree = 2 * math.ceil(math.log2(2048)) * CLUSTER.gpu.inter_alpha_s + 2 * nbytes / bw
    assert reduction_time("all_reduce", nbytes, n, CLUSTER, stride) == pytest.approx(tree)
    assert tree < ring / 50  # the ring's 2(n-1) latencies dominate
    # Reduce-scatter has no tree: its latency still grows with the group.
    assert reduction_time("reduce_scatter", nbytes, n, CLUSTER, stride) == ring_time("reduce_scatter", nbytes, n, alpha, bw)


def test_large_all_reduce_over_two_nodes_keeps_the_ring():
    n, nbytes = 16, 2**30  # two nodes, 1 GiB: bandwidth-bound, where the ring moves 2(n-1)/n of it
    alpha, bw = group_link(CLUSTER, 1, n)
    assert reduction_time("all_reduce", nbytes, n, CLUSTER, 1) == ring_time("all_reduce", nbytes, n, alpha, bw)
