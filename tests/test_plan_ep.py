"""The planner under expert parallelism (parallel.ep, docs/design.md "Expert parallelism"): a rank
holds E/ep experts, their buckets apart and sharded over dp*cp/ep, the "ep" all-to-all bytes under
balanced routing, their time on the EP group's link, the search over ep, hybrid ZeRO under ep, the runtime's refusals,
the JSON contract. Pure Python, no ranks (the runtime comparisons: tests/test_plan_runtime.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tetrad.cli import main
from tetrad.config import load_config
from tetrad.dist.layout import GRAD_DIMS, Layout
from tetrad.config.sections import ParallelConfig
from tetrad.parallel.bucketing import padded_size
from tetrad.plan.buckets import rank_buckets
from tetrad.plan.comm_bytes import comm_bytes_per_step
from tetrad.plan.cost import OPTIMIZER_BYTES_PER_PARAM, estimate
from tetrad.plan.hardware import cluster_of, load_cluster
from tetrad.plan.links import all_to_all_time, expert_grad_stride, expert_shard_stride, group_link, ring_time
from tetrad.plan.layer import layer_cost
from tetrad.plan.memory import rank_model_states, rank_params
from tetrad.plan.moe import expert_shard, expert_shard_ranks
from tetrad.plan.search import Layout as Candidate, _zero_stages, layouts, plan
from tetrad.plan.stacks import STACKS

MIXTRAL = {"preset": "mixtral-8x7b", "seq_len": 4096}
# A fine-grained MoE (8.6B parameters, 1.6B active): 64 experts of 1408, top 4.
FINE = {"preset": "tiny", "n_layers": 16, "d_model": 2048, "n_heads": 16, "n_kv_heads": 4, "ffn_hidden": 5632,
        "vocab_size": 32000, "seq_len": 2048, "n_experts": 64, "experts_per_token": 4, "expert_ffn_hidden": 1408}
EXPERT_ELEMENTS = 8 * 14336 * 4096 * 3  # one Mixtral layer's experts (w1, w3, w2), tp 1


def _cfg(model: dict, parallel: dict, train: dict | None = None):
    return load_config(overrides={"model": model, "parallel": parallel,
                                  "train": {"dtype": "bf16", "global_batch": 64, "micro_batch": 1, **(train or {})}},
                       runtime=False)


def _mixtral(ep: int, zero: int, **train):
    """Mixtral on 64 H100s, tp 2 pp 4 dp 8: 8 layers a stage, each stage's experts split over ep."""
    return _cfg(MIXTRAL, {"tp": 2, "pp": 4, "dp": 8, "ep": ep, "zero": zero, "sequence_parallel": True}, train)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_expert_states_fall_with_ep_as_sharded(zero):
    """Weights: the rank's E/ep experts (ZeRO-3: their shard over dp/ep ranks, the same 1/dp share
    of all experts at every ep). Gradients: E/ep experts' whole (ZeRO 0/1), or their shard
    over dp/ep ranks (ZeRO 2/3: the same 1/dp share of all experts at every ep). Optimizer (ZeRO 1-3):
    the experts' shard over dp/ep ranks of E/ep experts, 1/dp of them at every ep; ZeRO-0 E/ep of
    them. Activations kept for backward are those without ep (balanced routing); the transient
    expert gradients of one layer fall to E/ep."""
    cluster = load_cluster("h100x64")
    base = estimate(_mixtral(1, zero), cluster).memory_by_rank[0]
    experts = 8 * EXPERT_ELEMENTS / 2  # a pipeline rank's 8 layers, tp 2
    for ep in (2, 4, 8):
        got = estimate(_mixtral(ep, zero), cluster).memory_by_rank[0]
        gone = experts * (1 - 1 / ep)
        assert got.weights == pytest.approx(base.weights - (0 if zero == 3 else 2 * gone), rel=1e-6), ep
        grads = base.grads if zero >= 2 else base.grads - 4 * gone
        assert got.grads == pytest.approx(grads, rel=1e-6), ep
        optimizer = base.optimizer - (12 * gone if zero == 0 else 0)
        assert got.optimizer == pytest.approx(optimizer, rel=1e-6), ep
        assert got.activations - got.transient == base.activations - base.transient, ep
        assert base.transient - got.transient == pytest.approx(2 * EXPERT_ELEMENTS / 2 * (1 - 1 / ep)), ep


def test_experts_have_buckets_of_their_own_over_their_group():
    """ep 2 of dp 4 x cp 2: after the dense buckets, the experts' (the rank's 2 of 4 experts), each
    padded for and sharded over dp*cp/ep = 4 ranks; at ep 1 none apart."""
    model = {"preset": "tiny", "n_experts": 4, "experts_per_token": 2, "expert_ffn_hidden": 96}
    parallel = {"dp": 4, "cp": 2, "grad_bucket_mb": 0.01, "zero": 1}
    one, two = (rank_buckets(_cfg(model, {**parallel, "ep": ep}))[0] for ep in (1, 2))
    assert not any(b.expert for b in one.buckets) and one.expert_padded == one.expert_size == 0
    flags = [b.expert for b in two.buckets]
    assert flags == sorted(flags) and any(flags)  # dense first, then the experts'
    m = _cfg(model, parallel).model
    local = m.n_layers * 2 * 96 * m.d_model * 3  # the rank's 2 of 4 experts
    assert two.expert_size == sum(b.size for b in two.buckets if b.expert) == local
    assert all(b.padded % 4 == 0 and b.shard == b.padded // 4 for b in two.buckets if b.expert)
    assert all(b.padded % 8 == 0 and b.shard == b.padded // 8 for b in two.buckets if not b.expert)
    assert sum(b.size for b in two.buckets if not b.expert) == sum(b.size for b in one.buckets) - 2 * local


def test_under_zero3_each_blocks_experts_are_a_bucket_gathered_with_it():
    """ZeRO-3 at ep 2 of dp 4: after the blocks' and the rest's buckets, one of each block's two
    experts, a block bucket (gathered for each use), padded for and sharded over dp/ep = 2 ranks;
    the dense blocks' buckets hold what they held less the experts."""
    model = {"preset": "tiny", "n_experts": 4, "experts_per_token": 2, "expert_ffn_hidden": 96}
    parallel = {"dp": 4, "zero": 3}
    one, two = (rank_buckets(_cfg(model, {**parallel, "ep": ep}))[0] for ep in (1, 2))
    m = _cfg(model, parallel).model
    experts = [b for b in two.buckets if b.expert]
    assert [b.expert for b in two.buckets] == [False] * (m.n_layers + 1) + [True] * m.n_layers
    assert all(b.block and b.size == 2 * 96 * m.d_model * 3 and b.shard == b.padded // 2 for b in experts)
    assert [b.size for b in two.buckets[:m.n_layers]] == [b.size - 4 * 96 * m.d_model * 3 for b in one.buckets[:m.n_layers]]
    assert two.blocks == sum(b.padded for b in two.buckets if b.block)


@pytest.mark.parametrize("recompute,again", [("none", 0), ("selective", 0), ("full", 1), ("selective-op", 1)])
@pytest.mark.parametrize("parallel", [{"dp": 4, "ep": 2}, {"dp": 2, "ep": 2, "tp": 2, "sequence_parallel": True},
                                      {"dp": 4, "ep": 4, "cp": 2}, {"dp": 2, "ep": 2, "pp": 2}])
def test_ep_bytes_are_the_spec_formula(parallel, recompute, again):
    """Per MoE layer and micro-batch: forward E*8 + n*k*d*b + recv*d*b, backward n*k*d*b + recv*d*b,
    recompute the forward's again (full and per-op: they rerun the MoE layer), recv = n*k."""
    model = {"preset": "tiny", "n_layers": 4, "n_experts": 8, "experts_per_token": 2, "seq_len": 64}
    cfg = _cfg(model, parallel, {"recompute": recompute, "global_batch": 16, "micro_batch": 2})
    m, p = cfg.model, cfg.parallel
    n, b = 2 * 64 // p.cp, 2
    forward = 8 * 8 + 2 * n * 2 * m.d_model * b
    backward = 2 * n * 2 * m.d_model * b
    layers, micro = 4 // p.pp, 16 // (2 * p.dp)
    assert comm_bytes_per_step(cfg)["ep"] == micro * layers * (forward * (1 + again) + backward)
    assert comm_bytes_per_step(_cfg(model, {**parallel, "ep": 1}))["ep"] == 0
    assert comm_bytes_per_step(_cfg({"preset": "tiny"}, {"dp": 2}))["ep"] == 0


def test_dp_bytes_carry_the_experts_over_their_group_only():
    """ZeRO-0: the experts' gradients all-reduced over dp/ep ranks, their 1/ep share of the
    experts: ep 2 sends half of them; ep = dp leaves one rank in the group, which sends nothing."""
    model = {"preset": "tiny", "n_layers": 4, "n_experts": 4, "experts_per_token": 2, "expert_ffn_hidden": 256}
    base = _cfg(model, {"dp": 4, "ep": 1})
    experts = 4 * 4 * 256 * base.model.d_model * 3
    dp = {ep: comm_bytes_per_step(_cfg(model, {"dp": 4, "ep": ep}))["dp"] for ep in (1, 2, 4)}
    assert dp[2] == pytest.approx(dp[1] - 4 * experts / 2, rel=1e-3)
    assert dp[4] == pytest.approx(dp[1] - 4 * experts, rel=1e-3)


def test_all_to_alls_cost_on_the_ep_groups_link():
    """Exposed forward (counts, dispatch, combine) and backward (the two token all-to-alls; again
    the forward's under full recompute), on NVLink while the EP group fits a node (ep x cp x tp <=
    8) and across nodes beyond it (links.all_to_all_time): tp 2 or cp 2 put ep 8 over two nodes."""
    cluster = load_cluster("h100x64")
    stack = STACKS["tetrad"]
    for tp, cp, recompute in ((1, 1, "none"), (2, 1, "none"), (1, 2, "none"), (2, 1, "full")):
        parallel = {"tp": tp, "cp": cp, "dp": 8, "ep": 8, "sequence_parallel": tp > 1}
        cfg = _cfg(MIXTRAL, parallel, {"recompute": recompute})
        rows = 4096 // cp * 2 * 4096 * 2
        one = all_to_all_time(rows, 8, cluster, tp * cp)
        forward = all_to_all_time(8 * 8, 8, cluster, tp * cp) + 2 * one
        want = forward * (2 if recompute == "full" else 1) + 2 * one
        assert layer_cost(cfg, cluster, stack).ep_comm == pytest.approx(want), (tp, cp, recompute)
        inside = ring_time("all_to_all", rows, 8, *group_link(cluster, 1, 8))
        assert (one > 2 * inside) == (tp * cp == 2)  # across nodes: half the rows through one NIC
        cfg1 = _cfg(MIXTRAL, {**parallel, "ep": 1}, {"recompute": recompute})
        assert layer_cost(cfg1, cluster, stack).ep_comm == 0
    est = estimate(_mixtral(4, 1), cluster)
    assert est.breakdown["ep_comm"] > 0 and estimate(_mixtral(1, 1), cluster).breakdown["ep_comm"] == 0


@pytest.mark.parametrize("per_node", [2, 4, 8, 16])
def test_expert_group_link_is_the_runtimes_group(per_node):
    """The strided group expert_grad_stride stands for has the expert gradient group's members per
    node and nodes (ranks tp fastest, then cp, dp: dist/layout.py), over every factorisation."""
    for tp, cp, dp, ep in ((t, c, d, e) for t in (1, 2, 4) for c in (1, 2, 4) for d in (2, 4, 8, 16)
                           for e in (1, 2, 4, 8, 16) if d % e == 0):
        layout = Layout(pp=1, dp=dp, cp=cp, tp=tp)
        group = [r for r in layout.group_of(0, GRAD_DIMS) if layout.coords(r)["dp"] % ep == 0]
        nodes = {r // per_node for r in group}
        stride, n = expert_grad_stride(per_node, tp, cp, dp, ep), len(group)
        case = (tp, cp, dp, ep)
        assert (stride * n <= per_node) == (len(nodes) == 1), case
        if len(nodes) > 1:
            members = max(sum(r // per_node == k for r in group) for k in nodes)
            assert min(n, per_node // stride) == members and -(-n * stride // per_node) == len(nodes), case


# Hybrid ZeRO under ep: dp 12, blocks of 6 (2 replicas), ep 2: the experts' buckets over 3 ranks of
# each block, which their 2 x 97 x 128 elements a tensor (ZeRO-3: two a block) do not divide, so
# padded; the dense ones over the block's 6.
HYBRID_MODEL = {"preset": "tiny", "n_layers": 2, "n_experts": 4, "experts_per_token": 2, "expert_ffn_hidden": 97,
                "mlp": "gelu", "vocab_size": 257}


def _hybrid(model: dict, parallel: dict, zero_shard: int, train: dict | None = None):
    return _cfg(model, {**parallel, "zero_shard": zero_shard}, train)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hybrid_zero_shards_the_experts_over_their_share_of_the_block(zero):
    """The same buckets as without hybrid ZeRO, the dense ones padded for and sharded over the
    block's 6 ranks, the experts' over its 3 = zero_shard/ep (EXPERT_SHARD); model states per rank
    a shard of each (ZeRO-3 weights, ZeRO 2/3 gradients), moments over the parameters in the shard
    the rank owns: the dense ones' by its place in the block, the experts' by its place in its
    expert gradient group modulo 3."""
    parallel, train = {"dp": 12, "ep": 2, "zero": zero, "grad_bucket_mb": 0.01}, {"global_batch": 48}
    cfg = _hybrid(HYBRID_MODEL, parallel, 6, train)
    flat, hybrid = rank_buckets(_cfg(HYBRID_MODEL, parallel, train))[0], rank_buckets(cfg)[0]
    assert [(b.size, b.expert) for b in hybrid.buckets] == [(b.size, b.expert) for b in flat.buckets]
    for b in hybrid.buckets:
        ranks = 3 if b.expert else 6
        assert b.padded == padded_size(b.size, ranks, 1) and b.shard == b.padded // ranks, b
    assert any(b.padded > b.size for b in hybrid.buckets if b.expert)  # the padding for 3 shows
    for place in range(6):  # dp rank `place` of the first block: its expert gradient group's place dp // 2
        weights, grads, optimizer = rank_model_states(cfg, place)[0]
        shards = [(b, place // 2 if b.expert else place) for b in hybrid.buckets]
        assert grads == 4 * sum(b.shard if zero >= 2 else b.padded for b, _ in shards), place
        assert weights == 2 * sum(b.shard if zero == 3 else b.padded for b, _ in shards), place
        owned = sum(max(0, min(b.size, (k + 1) * b.shard) - k * b.shard) for b, k in shards)
        assert optimizer == 8 * owned + 4 * sum(b.shard for b, _ in shards), place


@pytest.mark.parametrize("zero", [1, 2, 3])
@pytest.mark.parametrize("dp,zero_shard", [(12, 6), (4, 2)])
def test_hybrid_zero_bytes_reduce_the_experts_as_dense_buckets(zero, dp, zero_shard):
    """Each bucket over its own shard group (dense: the block; experts: zero_shard/ep ranks of it,
    one at dp 4 zero_shard 2): a reduce-scatter (every micro-batch at ZeRO 2/3, once at ZeRO-1) and
    its shard's all-reduce over the dp/zero_shard replicas once a step (ZeRO 2/3: the fp32 sum;
    ZeRO-1 in the wire dtype, bf16 here), then ZeRO 1/2's all-gather of the updated shards, ZeRO-3's
    of each block's buckets for forward and backward every micro-batch. A group of one rank sends
    nothing: at dp 4 the experts' buckets go whole over the replicas and are never gathered."""
    parallel = {"dp": dp, "ep": 2, "zero": zero, "grad_codec": "bf16", "grad_bucket_mb": 0.01}
    cfg = _hybrid(HYBRID_MODEL, parallel, zero_shard, {"global_batch": 4 * dp, "micro_batch": 2})
    micro, want = 2, 24 + 4  # the step's sums (MoE: 7 fp32)
    for b in rank_buckets(cfg)[0].buckets:
        ranks = zero_shard // 2 if b.expert else zero_shard
        wire = b.padded * 2 * (micro if zero >= 2 else 1)
        summed = b.padded // ranks * (4 if zero >= 2 else 2)
        gathers = b.padded * 2 * (2 * micro if b.block else 1)
        want += summed + (wire + gathers if ranks > 1 else 0)
    assert comm_bytes_per_step(cfg)["dp"] == want


@pytest.mark.parametrize("per_node", [2, 4, 8, 16])
def test_expert_shard_groups_are_the_runtimes(per_node):
    """Under hybrid ZeRO (zero_shard a multiple of ep x cp) the runtime's EXPERT_SHARD groups
    (Layout.expert_shards) have expert_shard_ranks members, each inside a dense shard block, where a
    member's place is moe.expert_shard of its place in the block; rank 0's has the members per node
    and nodes of expert_shard_stride's strided group; its replicas are as many as the blocks and as
    far apart as the dense replicas (tp x zero_shard)."""
    for tp, cp, dp, ep in ((t, c, d, e) for t in (1, 2) for c in (1, 2) for d in (2, 4, 8, 16) for e in (2, 4, 8)
                           if d % e == 0):
        for block in (b for b in range(ep * cp, dp * cp, ep * cp) if dp * cp % b == 0):
            p = ParallelConfig(dp=dp, cp=cp, tp=tp, ep=ep, zero=1, zero_shard=block)
            layout, size, case = Layout(pp=1, dp=dp, cp=cp, tp=tp, ep=ep), expert_shard_ranks(p), (tp, cp, dp, ep, block)
            chunks = layout.expert_shards(block)
            blocks, replica_groups = layout.split_in_blocks(GRAD_DIMS, block)
            for chunk in chunks:
                dense = next(b for b in blocks if chunk[0] in b)
                assert len(chunk) == size == block // ep and set(chunk) <= set(dense), case
                assert [expert_shard(p, dense.index(r)) for r in chunk] == list(range(size)), case
            chunk = next(c for c in chunks if 0 in c)
            nodes, stride = {r // per_node for r in chunk}, expert_shard_stride(per_node, p)
            assert (stride * size <= per_node) == (len(nodes) == 1), case
            if len(nodes) > 1:
                members = max(sum(r // per_node == k for r in chunk) for k in nodes)
                assert min(size, per_node // stride) == members and -(-size * stride // per_node) == len(nodes), case
            replicas = next(g for g in replica_groups if 0 in g)
            assert len(replicas) == dp * cp // block
            assert all(b - a == tp * block for a, b in zip(replicas, replicas[1:])), case


def test_hybrid_zero_updates_the_experts_shard_of_the_block():
    """The optimizer step's parameters on a rank: the dense ones over the block, its E/ep experts
    over zero_shard/ep ranks (Mixtral, dp 16 ep 8 in blocks of 8 dp ranks: each block holds every
    expert once, a rank updates its experts whole)."""
    cluster = load_cluster("h100x64")
    cfg = _hybrid(MIXTRAL, {"pp": 4, "dp": 16, "ep": 8, "zero": 1}, 8, {"global_batch": 256})
    shards = [(params - b.expert_size) / 8 + b.expert_size for params, b in zip(rank_params(cfg), rank_buckets(cfg))]
    opt = max(shards) * OPTIMIZER_BYTES_PER_PARAM / cluster.gpu.hbm_bytes_per_s
    assert estimate(cfg, cluster).breakdown["optimizer"] == pytest.approx(opt)


def test_search_tries_every_ep_that_divides_dp_and_the_experts():
    base = _cfg(MIXTRAL, {}, {"global_batch": 256})
    found = list(layouts(base, 64, 8))
    pairs = {(x.dp, x.ep) for x in found}
    for dp in {x.dp for x in found}:
        assert {ep for d, ep in pairs if d == dp} == {e for e in (1, 2, 4, 8) if dp % e == 0}, dp
    assert {x.ep for x in layouts(_cfg({"preset": "tiny"}, {}), 8, 8)} == {1}  # dense
    for codec in ("bf16", "int8", "powersgd"):  # each group's codec compresses its own buckets
        coded = _cfg(MIXTRAL, {"grad_codec": codec}, {"global_batch": 256})
        assert {x.ep for x in layouts(coded, 64, 8)} == {1, 2, 4, 8}, codec


def test_search_tries_hybrid_zero_where_ep_takes_the_block():
    """Hybrid ZeRO over one node's dp x cp ranks (8 / tp) is tried with ep where that block holds
    whole EP groups over cp (ep x cp divides it), never where it splits one; ZeRO-3 at every ep."""
    base = _cfg(MIXTRAL, {}, {"global_batch": 256})
    cluster = load_cluster("h100x64")
    hybrid = {(1, 1): {1, 2, 4, 8}, (2, 1): {1, 2, 4}, (1, 2): {1, 2, 4}}  # (tp, cp): the ep it is tried with
    for (tp, cp), eps in hybrid.items():
        node, dp = 8 // tp, 32 // (tp * cp)
        for ep in (1, 2, 4, 8):
            layout = Candidate(tp, 2, cp, dp, ep, "ring", 1, "1f1b", 1, "full")
            tried = {(c.parallel.zero, c.parallel.zero_shard)
                     for c, _, _ in _zero_stages(base, layout, cluster, STACKS["tetrad"], 1e9, False, False)}
            flat = {(0, 0), (1, 0), (2, 0), (3, 0)}
            assert tried == flat | ({(1, node), (2, node), (3, node)} if ep in eps else set()), (tp, cp, ep)


def test_plan_proposes_hybrid_zero_with_ep():
    """Mixtral on 64 H100s: among the layouts `plan` ranks, some shard over one node's ranks with
    ep > 1, and `estimate` takes them as ranked."""
    cluster = load_cluster("h100x64")
    ranked = plan(_cfg(MIXTRAL, {}, {"global_batch": 256}), cluster, top=200).ranked
    hybrid = [e for e in ranked if e.cfg.parallel.ep > 1 and e.cfg.parallel.zero_shard]
    assert hybrid, {(e.cfg.parallel.ep, e.cfg.parallel.zero, e.cfg.parallel.zero_shard) for e in ranked}
    assert estimate(hybrid[0].cfg, cluster).step_time_s == pytest.approx(hybrid[0].step_time_s)


def test_plan_spreads_experts_where_they_dominate_memory():
    """The fine-grained MoE on one 8-GPU node of 80 GB: the experts' states are most of the memory,
    and the plan spreads them over ep ranks; the same layout with every expert on each rank is
    slower or does not fit, and holds more (under ZeRO-3 its states are as sharded, but a
    gathered layer holds every expert); at ZeRO-1 more than twice the weights and gradients."""
    base = _cfg(FINE, {}, {"global_batch": 32})
    cluster = cluster_of("H100-SXM", 8)
    best = plan(base, cluster, top=1).ranked[0]
    assert best.fits and best.cfg.parallel.ep > 1, best.cfg.parallel

    def at(cfg, **parallel):
        return estimate(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel)), cluster)
    alone = at(best.cfg, ep=1)
    assert not alone.fits or alone.step_time_s > best.step_time_s
    assert alone.memory.total > best.memory.total
    spread, alone = at(best.cfg, zero=1), at(best.cfg, zero=1, ep=1)
    assert alone.memory.weights + alone.memory.grads > 2 * (spread.memory.weights + spread.memory.grads)


@pytest.mark.parametrize("setting,fix", [("--parallel.zero_shard=1", "zero_shard in [2, 0]")])
def test_estimate_refuses_what_ep_refuses(setting, fix, capsys):
    """In one line naming the fix: a hybrid ZeRO block that splits an EP group (one that holds
    whole ones runs)."""
    argv = ["estimate", "--cluster", "dgx-h100", "--model.preset=tiny", "--model.n_experts=4", "--parallel.dp=4",
            "--parallel.ep=2", "--parallel.zero=1", setting]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "ep" in err and fix in err and len(err.strip().splitlines()) == 1, err
    assert main(argv[:-1]) == 0 and capsys.readouterr()
    assert main(argv[:-1] + ["--parallel.zero_shard=2"]) == 0 and capsys.readouterr()


def test_json_and_text_carry_ep(tmp_path, capsys):
    argv = ["estimate", "--cluster", "dgx-h100", "--model.preset=tiny", "--model.n_experts=4", "--parallel.dp=4",
            "--parallel.ep=2"]
    assert main(argv + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parallel"]["ep"] == 2 and set(out["comm_bytes"]) == {"tp", "cp", "pp", "dp", "ep"}
    assert out["comm_bytes"]["ep"] > 0 and out["time_s"]["ep_comm"] > 0
    assert sum(out["time_s"].values()) == pytest.approx(out["step_time_s"])
    assert main(argv) == 0 and " dp=4 ep=2 zero=0 " in capsys.readouterr().out
    assert main(argv[:-1] + ["--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["parallel"]["ep"] == 1 and out["comm_bytes"]["ep"] == 0 and out["time_s"]["ep_comm"] == 0
    written = tmp_path / "best.toml"
    fine = [f"--model.{k}={v}" for k, v in FINE.items() if k != "preset"]
    code = main(["plan", "--model", "tiny", "--cluster", "dgx-h100", "--global-batch", "32", "--top", "3", "--json",
                 "--write", str(written), f"--run.dir={tmp_path / 'run'}", *fine])
    ranked = json.loads(capsys.readouterr().out)
    assert code == 0 and all("ep" in r["parallel"] and "ep" in r["comm_bytes"] for r in ranked)
    cfg = load_config(str(written), runtime=False)
    assert cfg.parallel.ep == ranked[0]["parallel"]["ep"] > 1
