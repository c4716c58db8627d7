"""Link physics of the time model (plan/links.py): which algorithm a data-parallel reduction takes,
what a collective beside compute costs."""

import dataclasses
import math

import pytest

from tetrad.config import load_config
from tetrad.plan.cost import estimate
from tetrad.plan.hardware import cluster_of
from tetrad.plan.links import COLLECTIVE_CTAS, group_link, overlap_slowdown, reduction_time, ring_time

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


def test_a_collective_beside_compute_slows_it_by_the_multiprocessors_it_holds():
    gpu = CLUSTER.gpu
    share = COLLECTIVE_CTAS / gpu.sms  # 24 of an H100's 132
    assert overlap_slowdown(1.0, 2.0, gpu) == pytest.approx(share * 1.0)  # while the collective runs
    assert overlap_slowdown(3.0, 2.0, gpu) == pytest.approx(share * 2.0)  # beside all of the compute
    assert overlap_slowdown(1.0, 2.0, cluster_of("CPU", 2).gpu) == 0.0  # no multiprocessors to share


def test_zero3_without_model_parallelism_loses_throughput_with_the_group():
    # The same work per GPU: each layer's gathers and reduce-scatters take longer as the ring grows
    # (its latency), and the compute they run beside slows for longer.
    cfg = load_config(overrides={"model": {"preset": "llama3-8b", "seq_len": 2048},
                                 "train": {"micro_batch": 2, "global_batch": 2 * 512, "dtype": "bf16"}}, runtime=False)
    rates = []
    for n in (8, 128, 512):
        c = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=n, zero=3),
                                train=dataclasses.replace(cfg.train, global_batch=2 * n))
        rates.append(estimate(c, cluster_of("H100-SXM", n), "fsdp").tokens_per_s / n)
    assert rates[0] > rates[1] > rates[2], rates
