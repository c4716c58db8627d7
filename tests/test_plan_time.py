"""The planner's time: the FLOP convention, the pipeline simulator's extrapolation and 1F1B bubble,
a breakdown with no negative part, the bytes each group moves, and the ring per-op recompute
replays."""

from __future__ import annotations

import dataclasses

import pytest

from tetrad.config import load_config
from tetrad.model import flops
from tetrad.plan.comm_bytes import comm_bytes_per_step
from tetrad.plan.cost import estimate
from tetrad.plan.hardware import load_cluster
from tetrad.plan.layer import layer_cost
from tetrad.plan.memory import rank_params
from tetrad.plan.pipeline import _simulate, pipeline
from tetrad.plan.search import config_of, layouts
from tetrad.plan.stacks import load_stack


def _cfg(**sections):
    return load_config(overrides=sections, runtime=False)


def test_flop_convention_matches_narayanan_eq3_with_full_recompute():
    m = _cfg(model={"preset": "gpt3-175b"}).model
    batch = 1536
    ours = flops.hardware_flops_per_token(m, "full") * batch * m.seq_len
    eq3 = flops.narayanan_eq3_flops(batch, m.seq_len, m.n_layers, m.d_model, m.vocab_size)
    assert ours == pytest.approx(eq3, rel=1e-9)
    assert flops.model_flops_per_token(m) < ours / batch / m.seq_len  # MFU's numerator has no recompute


def test_long_pipelines_are_extrapolated_exactly_from_the_simulator():
    # Costs on the simulation's grid (hundredths of the slowest forward), so rounding moves nothing.
    f, bi, bw = [0.77, 0.85, 0.69, 1.0], [0.92, 0.77, 0.85, 1.08], [0.62, 0.69, 0.77, 0.85]
    for schedule, vpp in (("1f1b", 1), ("zb", 1), ("interleaved", 2)):
        stages = 4 * vpp
        costs = (f * vpp)[:stages], (bi * vpp)[:stages], (bw * vpp)[:stages]
        for m in (29, 40):
            direct, _ = _simulate(schedule, 4, m, vpp, *(tuple(costs_) for costs_ in costs), 0.01)
            extended, _ = pipeline(schedule, 4, m, vpp, *([1.3 * x for x in c] for c in costs), 0.013)
            assert extended == pytest.approx(direct * 1.3, rel=1e-9), (schedule, m)


def test_balanced_1f1b_bubble_is_the_ideal_at_many_micro_batches():
    """With equal stages and negligible transfers the 1F1B bubble is (p-1)/(m+p-1) (Narayanan et
    al. 2021, sec. 2.2.1), for the simulator and for `estimate` (a small vocabulary, so the head
    barely unbalances the last stage; transfers over NVLink): no per-micro-batch charge."""
    for p in (4, 8):
        for m in (4 * p, 8 * p, 16 * p + 3):
            ideal = (p - 1) / (m + p - 1)
            step, _ = pipeline("1f1b", p, m, 1, [1.0] * p, [1.1] * p, [0.9] * p, 1e-4)
            assert 1 - 3 * m / step == pytest.approx(ideal, rel=0.02), (p, m)
    model = {"preset": "tiny", "n_layers": 32, "d_model": 4096, "n_heads": 32, "n_kv_heads": 32, "ffn_hidden": 16384,
             "seq_len": 2048, "vocab_size": 256}
    for m in (32, 64):
        cfg = _cfg(model=model, parallel={"pp": 8, "schedule": "1f1b"},
                   train={"global_batch": m, "micro_batch": 1, "dtype": "bf16"})
        est = estimate(cfg, load_cluster("dgx-a100"), stack="compiled")
        assert est.bubble_fraction == pytest.approx(7 / (m + 7), rel=0.10), m


def test_no_breakdown_part_is_negative_over_a_sweep_of_layouts():
    """The simulator runs rounded costs; the breakdown (the busiest rank's exact work and the
    idle time the simulation finds) must still have no negative part, and sum to the step."""
    checked = 0
    for preset, cluster, batch, dtype in [("llama3-8b", "dgx-h100", 32, "bf16"), ("llama3-70b", "h100x64", 64, "bf16"),
                                          ("tiny-gpt", "dgx-a100", 16, "fp32")]:
        base = _cfg(model={"preset": preset}, train={"global_batch": batch, "dtype": dtype})
        hardware = load_cluster(cluster)
        found = [x for x in layouts(base, hardware.world, hardware.gpus_per_node) if x.pp > 1]
        for layout in found[::max(1, len(found) // 120)]:
            est = estimate(config_of(base, layout), hardware)
            parts = est.breakdown
            assert min(parts.values()) >= 0, (layout, {k: v for k, v in parts.items() if v < 0})
            assert sum(parts.values()) == pytest.approx(est.step_time_s, rel=1e-9)
            assert 0 <= est.bubble_fraction < 1
            checked += 1
    assert checked > 300


def test_comm_bytes_follow_tetrad_comm_convention():
    cfg = _cfg(model={"preset": "tiny"}, parallel={"dp": 2, "tp": 2, "pp": 2},
               train={"global_batch": 8, "micro_batch": 2, "dtype": "fp32"})
    m, micro = cfg.model, cfg.microbatches
    hidden = 2 * m.seq_len * m.d_model * 4  # micro-batch x seq x d_model, fp32
    got = comm_bytes_per_step(cfg)
    layers = 2  # of 4, on pipeline rank 0
    sums = 6 * 4  # the step's fp32 sums (norm, loss, stop flags) on every group
    assert got["tp"] == micro * (layers * 4 * hidden + hidden) + sums  # 2 all-reduces fwd + 2 bwd per layer; embedding
    assert got["pp"] == micro * hidden + sums  # activations sent on
    assert got["dp"] == int(rank_params(cfg)[0] * 4) + sums  # one all-reduce of fp32 gradients
    assert got["cp"] == 0
    ring = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, tp=1, pp=1, dp=1, cp=2))
    kv = 2 * m.seq_len // 2 * m.n_kv_heads * m.head_dim * 2  # k and v of this rank's tokens, micro-batch 2
    assert comm_bytes_per_step(ring)["cp"] == ring.microbatches * m.n_layers * (kv * 4 + kv * 4 + 2 * kv * 4)


def test_per_op_recompute_replays_the_ring():
    """selective-op keeps the ring's result and replays it (model/replay.py RingReplay): its
    exposed cp time is no recompute's, its recompute has no ring merges (what the all-to-all's,
    which merges nothing, has), and the ring's K/V is sent once forward. The all-to-alls it repeats."""
    cluster, stack = load_cluster("dgx-h100"), load_stack("tetrad")

    def cost(algo, recompute):
        cfg = _cfg(model={"preset": "llama3-8b", "seq_len": 2048}, parallel={"cp": 4, "cp_algo": algo},
                   train={"global_batch": 8, "micro_batch": 1, "dtype": "bf16", "recompute": recompute})
        return layer_cost(cfg, cluster, stack), comm_bytes_per_step(cfg)["cp"]

    (op, op_bytes), (none, none_bytes), (full, full_bytes) = (cost("ring", r) for r in ("selective-op", "none", "full"))
    assert op.cp_comm == none.cp_comm < full.cp_comm
    assert op_bytes == none_bytes < full_bytes
    assert op.recompute == pytest.approx(cost("alltoall", "selective-op")[0].recompute, rel=1e-12)
    assert cost("alltoall", "selective-op")[0].cp_comm == cost("alltoall", "full")[0].cp_comm
