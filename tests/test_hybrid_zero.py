"""Hybrid ZeRO (parallel.zero_shard, FSDP2's HSDP): ZeRO 1-3 sharded over blocks of dp x cp and
replicated across them train as one process does, hold 1/zero_shard of the states, count the
planner's bytes, resume to and from plain layouts, and refuse what does not compose."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from conftest import assert_parity, model_state_after_reduce, run_ranks, tiny_config, train_layout
from test_checkpoint import _load_and_save, read_logical
from tetrad.config import ConfigError, load_config
from tetrad.config.validation import idle_settings
from tetrad.dist.topology import Topology
from tetrad.plan.comm_bytes import comm_bytes_per_step
from tetrad.plan.cost import estimate
from tetrad.plan.hardware import load_cluster
from tetrad.plan.stacks import load_stack
from tetrad.plan.text import layout_label as plan_label
from tetrad.train.checkpoint import Checkpointer
from tetrad.train.metrics import layout_label
from tetrad.train.trainer import Trainer

pytestmark = pytest.mark.dist

ACCUM = {"micro_batch": 1}  # dp=4: 2 micro-batches a rank, so ZeRO-2/3 sum shards over micro-batches
RUNS: dict = {}


def run(**parallel):
    key = tuple(sorted(parallel.items()))
    if key not in RUNS:
        RUNS[key] = train_layout(tiny_config(parallel={"ranks_per_node": 2, **parallel}, train=ACCUM))
    return RUNS[key]


@pytest.fixture(scope="module")
def reference():
    return run()


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_hybrid_matches_single_process(reference, zero):
    assert_parity(run(dp=4, zero=zero, zero_shard=2), reference)


@pytest.mark.parametrize("layout", [{"dp": 2, "cp": 2, "zero": 3}, {"dp": 2, "pp": 2, "zero": 2},
                                    {"dp": 2, "pp": 2, "zero": 3, "schedule": "zb"}])
def test_hybrid_composes_with_cp_and_pp(reference, layout):
    # cp: the ring's summation order moves AdamW's near-zero-gradient entries as in test_cp (atol
    # 2e-4 there); dp2 x cp2 ZeRO-3 differs from one process by 1.3e-5 with or without zero_shard.
    # zero_shard=1 under pp: every rank holds whole buckets, summed over its replicas only (once a
    # step; under zero-bubble the embedding's bucket ends its step in BI, before the closing BW).
    shard = 2 if layout.get("cp", 1) > 1 else 1
    assert_parity(run(**layout, zero_shard=shard), reference, atol=2e-4 if "cp" in layout else 1e-5)


def _replica_sums_before_the_end_of_backward(cfg):
    """After the step's backward, before GradReducer.reduce: the buckets whose sums over the
    replicas have started, those whose reduce-scatter is still in flight, and every bucket."""
    trainer = Trainer(cfg, torch.device("cpu"))
    micro = trainer.batches.microbatches(0, trainer.topo.coords["dp"], cfg.parallel.dp, cfg.train.micro_batch)
    trainer.forward_backward(micro, trainer.batches.loss_tokens(0))
    sync = trainer.grads.sync
    seen = sorted(sync.replica_sums), [b.index for b in sync.in_flight], [b.index for b in sync.buckets]
    trainer.grads.reduce()
    return seen


@pytest.mark.parametrize("zero", [1, 2])
def test_replica_sums_start_during_the_last_backward(zero):
    """Each bucket's all-reduce over the replicas starts as its last reduce-scatter of the step ends
    (when the next bucket's starts: lifecycle.GradSync.finish), not at the end of backward, so it
    overlaps the rest of the backward: every bucket's but the last one's, whose reduce-scatter is
    still in flight. ZeRO-1 once started none before the end of backward (finish_all)."""
    cfg = tiny_config(parallel={"dp": 4, "zero": zero, "zero_shard": 2, "grad_bucket_mb": 0.02}, train=ACCUM)
    for started, in_flight, buckets in run_ranks(_replica_sums_before_the_end_of_backward, 4, cfg):
        assert len(buckets) >= 3 and len(started) == len(buckets) - 1, (started, buckets)
        assert started == sorted(set(buckets) - set(in_flight)), (started, in_flight, buckets)


def _groups(cfg):
    trainer = Trainer(cfg, torch.device("cpu"))
    shard, replica = trainer.topo.zero_groups()
    return trainer.topo.ranks(shard), trainer.topo.ranks(replica), trainer.grads.buckets[0].shard_size, \
        trainer.grads.buckets[0].padded


def test_shards_are_consecutive_blocks_and_replicas_span_them():
    cfg = tiny_config(parallel={"dp": 4, "zero": 2, "zero_shard": 2, "ranks_per_node": 2}, train=ACCUM)
    out = run_ranks(_groups, 4, cfg)
    assert [o[0] for o in out] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [o[1] for o in out] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert all(o[2] * 2 == o[3] for o in out)  # each rank holds half of a bucket, not a quarter


@pytest.mark.parametrize("parallel,message", [
    ({"dp": 4, "zero": 2, "zero_shard": 3}, "parallel.zero_shard=3 must divide dp*cp = 4 (each ZeRO shard set is a "
     "block of that many dp x cp ranks); use zero_shard in [1, 2, 4], or 0"),
    ({"dp": 2, "cp": 2, "zero": 1, "zero_shard": 8}, "use zero_shard in [1, 2, 4]"),
    ({"dp": 4, "zero": 1, "zero_shard": 2, "grad_codec": "int8"}, "zero_shard=2 reduce-scatters within shard groups "
     "instead. Use grad_codec='bf16' or 'none', or zero_shard=0"),
    ({"dp": 4, "zero": 1, "zero_shard": 2, "grad_codec": "powersgd"}, "grad_codec='powersgd' compresses"),
    ({"dp": 4, "zero": 1, "zero_shard": 2, "hierarchical": True, "ranks_per_node": 2},
     "set hierarchical=false (zero_shard=2 reduces within its blocks) or zero_shard=0"),
    ({"dp": 4, "zero_shard": -1}, "parallel.zero_shard"),
])
def test_refusals_name_the_fix(parallel, message):
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"parallel": parallel})
    assert message in str(err.value) and "\n" not in str(err.value)


def test_idle_settings_are_noted():
    assert any("zero_shard=2 does nothing at zero=0" in n
               for n in idle_settings(load_config(overrides={"parallel": {"dp": 4, "zero_shard": 2}})))
    assert any("zero_shard=4 = dp*cp shards over all of them" in n
               for n in idle_settings(load_config(overrides={"parallel": {"dp": 4, "zero": 3, "zero_shard": 4}})))
    assert not idle_settings(load_config(overrides={"parallel": {"dp": 4, "zero": 3, "zero_shard": 2}}))


# ------------------------------------------------------------------------------ planner
# (parallel, train, model): each ZeRO stage, both codecs that compose, cp, and blocks of one rank
# (whole buckets, summed over replicas only) beside tp's replicated gradients and a tied embedding.
COUNTED = [({"dp": 4, "zero": 1, "zero_shard": 2}, {}, {}),
           ({"dp": 4, "zero": 1, "zero_shard": 2, "grad_codec": "bf16"}, {}, {}),
           ({"dp": 4, "zero": 2, "zero_shard": 2}, {"micro_batch": 1, "global_batch": 8}, {}),
           ({"dp": 4, "zero": 3, "zero_shard": 2, "grad_codec": "bf16"}, {}, {}),
           ({"dp": 2, "cp": 2, "zero": 3, "zero_shard": 2}, {}, {}),
           ({"dp": 2, "tp": 2, "sequence_parallel": True, "zero": 1, "zero_shard": 1}, {}, {}),
           ({"dp": 2, "pp": 2, "zero": 2, "zero_shard": 1}, {"micro_batch": 1}, {"tie_embeddings": True})]


@pytest.mark.parametrize("parallel,train,model", COUNTED, ids=lambda d: "-".join(f"{k}{v}" for k, v in d.items()))
def test_comm_bytes_equal_the_planners(parallel, train, model):
    cfg = tiny_config(parallel=parallel, train={"steps": 2, "device": "cpu", **train}, model=model)
    _, _, history = train_layout(cfg)
    assert all(r["comm_bytes"] == comm_bytes_per_step(cfg) for r in history), (history[-1]["comm_bytes"],
                                                                             comm_bytes_per_step(cfg))


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_model_state_memory_is_the_planners(zero):
    """Each rank holds 1/zero_shard of the sharded states, not 1/(dp*cp): the planner's weights,
    gradients and optimizer state, to the buckets' padding (under 1%)."""
    cfg = tiny_config(parallel={"dp": 4, "zero": zero, "zero_shard": 2}, train={**ACCUM, "dtype": "bf16"})
    want = estimate(cfg, load_cluster("cpu")).memory_by_rank[0]
    for held, _ in run_ranks(model_state_after_reduce, 4, cfg):
        for kind, planned in (("params", want.weights), ("grads", want.grads), ("optimizer", want.optimizer)):
            assert held[kind] == pytest.approx(planned, rel=0.01), (kind, held, want)


def test_the_planner_keeps_zero3_inside_a_node_and_its_memory_per_block():
    """Llama 3 8B on 128 nodes of 8 H100s, dp 1024 ZeRO-3: sharded within each node, every layer's
    gathers run on NVLink and its reduce-scatter's ring spans 8 ranks, not 1024 (whose per-step
    latency dominates at this scale), and only a 1/8 shard crosses the network: the model puts
    ZeRO-3's exposed layer communication at 0.025 s against 0.268 s, the step at 0.853 s against
    1.053 s. (On 8 nodes, dp 64, it finds flat ZeRO-3 faster, 3.42 s against 3.59 s: a flat ring
    there uses all 8 of a node's NICs per collective, a replica group one.) The sharded states
    are 1/8, not 1/1024."""
    def plan(**parallel):
        cfg = load_config(overrides={"model": {"preset": "llama3-8b"}, "parallel": {"dp": 1024, "zero": 3, **parallel},
                                     "train": {"global_batch": 1024, "micro_batch": 1, "dtype": "bf16"}}, runtime=False)
        return estimate(cfg, load_cluster("h100x1024"))
    flat, hybrid = plan(), plan(zero_shard=8)
    assert hybrid.breakdown["zero3_comm"] < 0.5 * flat.breakdown["zero3_comm"], (hybrid.breakdown, flat.breakdown)
    assert hybrid.step_time_s < flat.step_time_s
    for kind in ("weights", "grads", "optimizer"):
        assert getattr(hybrid.memory, kind) == pytest.approx(128 * getattr(flat.memory, kind))


def test_the_planners_zero3_layers_see_only_their_blocks_collectives():
    """Each layer of a hybrid ZeRO-3 step gathers and reduce-scatters inside its block every
    micro-batch, as a plain ZeRO-3 layout of the block's ranks does; the shards' sum across the
    replicas runs once a step (lifecycle.GradSync._sum_over_replicas), timed with the step's
    gradient reduction, not beside each micro-batch's layers."""
    def zero3_comm(dp, **parallel):
        cfg = load_config(overrides={"model": {"preset": "llama3-8b"}, "parallel": {"dp": dp, "zero": 3, **parallel},
                                     "train": {"global_batch": 4 * dp, "micro_batch": 1, "dtype": "bf16"}},
                          runtime=False)
        return estimate(cfg, load_cluster("h100x1024")).breakdown["zero3_comm"]
    assert zero3_comm(64, zero_shard=8) == pytest.approx(zero3_comm(8))


def test_the_planner_times_zero2s_replica_sum_in_fp32_whatever_the_codec():
    """Under ZeRO 2/3 the replicas sum the step's accumulated fp32 shard (GradSync._sum_over_replicas),
    whatever grad_codec sends inside the block (bf16 there): the time a hybrid layout adds to its
    block's, the replicas' all-reduce, is the same with and without the codec."""
    def dp_comm(dp, codec, **parallel):
        cfg = load_config(overrides={"model": {"preset": "llama3-8b"},
                                     "parallel": {"dp": dp, "zero": 2, "grad_codec": codec, **parallel},
                                     "train": {"global_batch": dp, "micro_batch": 1, "dtype": "bf16"}}, runtime=False)
        stack = replace(load_stack("tetrad"), dp_overlap=False)  # the reduction whole, not behind backward
        return estimate(cfg, load_cluster("h100x1024"), stack).breakdown["dp_comm"]
    across = {codec: dp_comm(64, codec, zero_shard=8) - dp_comm(8, codec) for codec in ("none", "bf16")}
    assert across["bf16"] == pytest.approx(across["none"]), across


def test_the_planner_hides_zero1s_replica_sums_behind_backward_as_zero2s():
    """Hybrid ZeRO 1 and 2 both start a bucket's all-reduce over the replicas as its last
    reduce-scatter of the step ends (GradSync._sum_over_replicas; the runtime's side:
    test_replica_sums_start_during_the_last_backward). With one micro-batch a rank the two reduce
    the same bytes at the same times, and the last backward hides the replicas' part as well as
    the block's: Llama 3 8B, dp64 zero_shard=8, it hides 0.208 s of the reduction against the
    0.064 s of dp8's reduce-scatter (when ZeRO-1's replica sums ran after backward: 0.064 s)."""
    def dp_comm(dp, zero, overlap=True, **parallel):
        cfg = load_config(overrides={"model": {"preset": "llama3-8b"}, "parallel": {"dp": dp, "zero": zero, **parallel},
                                     "train": {"global_batch": dp, "micro_batch": 1, "dtype": "bf16"}}, runtime=False)
        stack = replace(load_stack("tetrad"), zero1_reduce_scatter=True, dp_overlap=overlap)  # dp8's as the block's
        return estimate(cfg, load_cluster("h100x1024"), stack).breakdown["dp_comm"]

    def hidden(dp, **parallel):  # the dp time overlapping backward takes off
        return dp_comm(dp, 1, False, **parallel) - dp_comm(dp, 1, **parallel)
    assert dp_comm(64, 1, zero_shard=8) == pytest.approx(dp_comm(64, 2, zero_shard=8))
    assert hidden(64, zero_shard=8) > 2 * hidden(8), (hidden(64, zero_shard=8), hidden(8))


# ------------------------------------------------------------------------------ checkpoints
# test_checkpoint's RESHARD_CASES resume hybrid checkpoints in plain layouts and plain ones in hybrid.
MODEL, TRAIN = {"vocab_size": 251}, {"steps": 6, "micro_batch": 1}


def _stored_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.distcp"))


@pytest.mark.parametrize("source,target", [({"dp": 4, "zero": 3, "zero_shard": 2}, {"dp": 2, "zero": 2}),
                                           ({"dp": 4, "zero": 1}, {"dp": 4, "zero": 2, "zero_shard": 2})])
def test_hybrid_state_survives_resharding_bitwise_and_is_stored_once(source, target, tmp_path):
    """Load under the other layout, save again: every stored tensor, the optimizer state included,
    is bitwise the one saved; and the replicas' identical shards were written once (twice would
    store 2x the logical bytes): every checkpoint here stores 1.12-1.16x them, the rest per-rank
    RNG states and DCP's headers per chunk: plain dp4 ZeRO-1 1.16x, hybrid dp4 ZeRO-3 1.14x."""
    src = tiny_config(parallel=source, model=MODEL, train={**TRAIN, "steps": 2}, checkpoint={"every": 2})
    train_layout(src)
    saved = Path(src.run.dir) / "checkpoints" / "step_00000002"
    tgt = tiny_config(parallel=target, model=MODEL, train={**TRAIN, "steps": 2})
    run_ranks(_load_and_save, tgt.parallel.world_size, tgt, saved, tmp_path)
    resaved = tmp_path / "step_00000002"
    before, after = read_logical(saved), read_logical(resaved)
    assert sorted(before) == sorted(after)
    assert {k.rsplit(".", 1)[1] for k in before if k.startswith("optim.")} == {"step", "exp_avg", "exp_avg_sq"}
    assert [k for k in before if not torch.equal(before[k], after[k])] == []
    logical_bytes = sum(t.numel() * t.element_size() for t in before.values())
    for path in (saved, resaved):
        assert logical_bytes <= _stored_bytes(path) < 1.25 * logical_bytes, (path, _stored_bytes(path), logical_bytes)


def test_a_save_from_before_zero_shard_is_in_the_same_layout(tmp_path):
    """A manifest without a [parallel] key added since (zero_shard) was saved with its default:
    resuming it in its layout keeps its per-rank state and what "auto" measured."""
    cfg = tiny_config()
    ckpt = Checkpointer(cfg, Topology.single(), tmp_path)
    layout = ckpt._layout()
    assert ckpt._same_layout({"layout": {k: v for k, v in layout.items() if k != "zero_shard"}})


def test_an_idle_zero_shard_is_the_layout_without_it(tmp_path):
    """zero_shard = dp x cp (or at ZeRO 0) does nothing: a save with it resumes as the same layout
    as one without it, keeping per-rank state (a codec's error feedback, "auto"'s measurements)."""
    ckpt = Checkpointer(tiny_config(parallel={"dp": 4, "zero": 1}), Topology.single(), tmp_path)
    layout = ckpt._layout()
    assert ckpt._same_layout({"layout": {**layout, "zero_shard": 4}})
    assert ckpt._same_layout({"layout": {**layout, "zero": 0, "zero_shard": 2}}) is False  # ZeRO differs
    assert not ckpt._same_layout({"layout": {**layout, "zero_shard": 2}})  # a hybrid layout is another


def test_labels_name_the_blocks():
    """metrics.jsonl's `layout` and the planner's rows tell a hybrid layout from a plain one."""
    cfg = load_config(overrides={"parallel": {"dp": 4, "zero": 3, "zero_shard": 2}}, runtime=False)
    assert layout_label(cfg.parallel) == "dp4 tp1 pp1 cp1 zero3 shard2"
    assert " zero=3 zero_shard=2 " in plan_label(estimate(cfg, load_cluster("cpu")))
    plain = load_config(overrides={"parallel": {"dp": 4, "zero": 3, "zero_shard": 4}}, runtime=False)
    assert layout_label(plain.parallel) == "dp4 tp1 pp1 cp1 zero3"


@pytest.mark.parametrize("key,answer", [
    ("data_parallel_shard_degree", "(did you mean 'parallel.dp' or 'parallel.zero_shard'?)"),
    ("data-parallel-replicate-degree", "(did you mean 'parallel.dp'?)"),
    ("num_distributed_optimizer_instances", "(did you mean 'parallel.zero_shard'?)")])
def test_torchtitan_and_megatron_names_point_to_ours(key, answer):
    """torchtitan's shard degree is all of dp, or with a replicate degree hybrid ZeRO's block."""
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"parallel": {key: 2}})
    assert answer in str(err.value)
