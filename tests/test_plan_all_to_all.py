"""All-to-all time (plan/links.py all_to_all_time): inside a node the ring model over NVLink;
across nodes direct sends, the node-mates' chunks over NVLink beside the other nodes' through one
NIC a GPU; and what it makes expert parallelism across nodes cost in `tetrad estimate`."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tetrad.cli import main
from tetrad.config import load_config
from tetrad.plan.hardware import cluster_of
from tetrad.plan.layer import layer_cost
from tetrad.plan.links import all_to_all_time, group_link, ring_time
from tetrad.plan.stacks import STACKS

H100 = cluster_of("H100-SXM", 64)  # 8 nodes of 8: NVLink 450 GB/s, one 50 GB/s NIC a GPU, 80% achieved
NVLINK, NIC = 450e9 * 0.8, 50e9 * 0.8
ALPHA_INTRA, ALPHA_INTER = 3e-6, 10e-6
GIB = 2**30


@pytest.mark.parametrize("n, stride", [(2, 1), (8, 1), (4, 2), (2, 4), (3, 2)])
def test_inside_a_node_it_is_the_ring_over_nvlink(n, stride):
    for nbytes in (4096, GIB):
        want = ring_time("all_to_all", nbytes, n, *group_link(H100, stride, n))
        assert all_to_all_time(nbytes, n, H100, stride) == want
    assert all_to_all_time(GIB, 8, H100, 1) == pytest.approx(7 * ALPHA_INTRA + 7 / 8 * GIB / NVLINK)


def test_across_nodes_the_off_node_share_leaves_through_one_nic():
    # ep 16 on two nodes: 7 chunks of 16 stay on the node (NVLink), 8 go through the GPU's NIC.
    latency = ALPHA_INTER + 15 * ALPHA_INTRA
    assert all_to_all_time(GIB, 16, H100, 1) == pytest.approx(latency + 8 / 16 * GIB / NIC)
    # 4 members a node (stride 2): 3 chunks on the node, 12 off it; one member a node: 15 off.
    assert all_to_all_time(GIB, 16, H100, 2) == pytest.approx(latency + 12 / 16 * GIB / NIC)
    assert all_to_all_time(GIB, 16, H100, 8) == pytest.approx(latency + 15 / 16 * GIB / NIC)
    # Ranks two nodes apart (stride 16): every other rank's chunk leaves the node.
    assert all_to_all_time(GIB, 4, H100, 16) == pytest.approx(ALPHA_INTER + 3 * ALPHA_INTRA + 3 / 4 * GIB / NIC)
    # A slow NVLink (20 GB/s) makes the on-node share the slower one: the time is the larger.
    slow = dataclasses.replace(H100, gpu=dataclasses.replace(H100.gpu, intra_gbps=20))
    assert all_to_all_time(GIB, 16, slow, 1) == pytest.approx(latency + 7 / 16 * GIB / (20e9 * 0.8))
    # The rail-ring model it replaces gave 15/16 of it over 8 NICs' worth (capped at NVLink): ~4x less.
    ring = ring_time("all_to_all", GIB, 16, *group_link(H100, 1, 16))
    assert all_to_all_time(GIB, 16, H100, 1) > 4 * ring
    assert all_to_all_time(0, 16, H100, 1) == 0.0 and all_to_all_time(GIB, 1, H100, 16) == 0.0


def test_more_chunks_off_the_node_take_longer():
    for n in (16, 64):
        times = [all_to_all_time(GIB, n, H100, stride) for stride in (1, 2, 4, 8) if stride * n > 8]
        assert times == sorted(times) and len(set(times)) == len(times), (n, times)
    # The same group size inside a node is the fastest of all.
    assert all_to_all_time(GIB, 8, H100, 1) < all_to_all_time(GIB, 8, H100, 2)


def _ep_comm(capsys, tp: int) -> float:
    """Exposed ep time a step of Mixtral 8x7B, pp 4 dp 8 ep 8 on h100x64: tp 1 keeps the EP group
    (8 ranks 1 apart) in a node, tp 2 spreads it over two (8 ranks 2 apart: 4 a node)."""
    code = main(["estimate", "--cluster", "h100x64", "--json", "--model.preset=mixtral-8x7b", "--model.seq_len=4096",
                 f"--parallel.tp={tp}", "--parallel.pp=4", "--parallel.dp=8", "--parallel.ep=8",
                 "--parallel.zero=1", f"--parallel.sequence_parallel={str(tp > 1).lower()}",
                 "--train.global_batch=256", "--train.micro_batch=1", "--train.recompute=full", "--train.dtype=bf16"])
    out = capsys.readouterr().out
    assert code in (0, 1), out
    return json.loads(out)["time_s"]["ep_comm"]


def test_estimate_charges_ep_across_nodes_at_one_nic_a_gpu(capsys):
    # The same all-to-alls a rank either way (ep_all_to_alls: tokens, not tp, set them), per layer
    # and micro-batch under full recompute twice the forward's (the int64 counts [8], two of rows)
    # and two of rows backward: rows of 4096 tokens x top-2 x 4096 x 2 bytes. Inside the node 7/8
    # of each payload over NVLink, 7 steps of latency; across, half of it through one NIC, one
    # network latency and 7 peers' (the rail ring gave 4 NICs' worth for 7/8: 2.4x, not 4.6x).
    rows, counts = 4096 * 2 * 4096 * 2, 8 * 8

    def inside(nbytes):
        return 7 * ALPHA_INTRA + 7 / 8 * nbytes / NVLINK

    def across(nbytes):
        return ALPHA_INTER + 7 * ALPHA_INTRA + 4 / 8 * nbytes / NIC

    want = (2 * across(counts) + 6 * across(rows)) / (2 * inside(counts) + 6 * inside(rows))
    assert _ep_comm(capsys, 2) / _ep_comm(capsys, 1) == pytest.approx(want)
    assert want > 4.5


def test_ulysses_cp_across_nodes_sends_half_through_one_nic():
    """All-to-all cp of llama3-8b with 32 kv heads (cp x tp must divide them): q, k, v and the
    output re-sharded each way, no recompute, each 32/tp heads x 128 of the rank's tokens in bf16.
    cp 16 (two nodes, 8 a node, 2048 tokens): 8 of 16 chunks through the NIC; cp 8 (one node, 4096
    tokens): 7 of 8 over NVLink; cp 8 tp 2 (the cp group 2 apart: two nodes, 4 a node): 4 of 8
    through the NIC."""
    def cp_comm(cp, tp=1):
        cfg = load_config(overrides={"model": {"preset": "llama3-8b", "n_kv_heads": 32, "seq_len": 32768},
                                     "parallel": {"cp": cp, "tp": tp, "cp_algo": "alltoall"},
                                     "train": {"global_batch": cp, "micro_batch": 1, "dtype": "bf16"}}, runtime=False)
        return layer_cost(cfg, H100, STACKS["tetrad"]).cp_comm

    def across(nbytes, n, members):
        return ALPHA_INTER + (n - 1) * ALPHA_INTRA + (n - members) / n * nbytes / NIC

    def inside(nbytes):
        return 7 * ALPHA_INTRA + 7 / 8 * nbytes / NVLINK

    one = 2048 * 32 * 128 * 2
    assert cp_comm(16) == pytest.approx(2 * 4 * across(one, 16, 8))
    assert cp_comm(8) == pytest.approx(2 * 4 * inside(2 * one))
    assert cp_comm(8, tp=2) == pytest.approx(2 * 4 * across(one, 8, 4))
