"""Expert parallelism (parallel.ep, docs/design.md "Expert parallelism"): the EP and expert
gradient groups over every factorisation; every layout trains an MoE model as one process does
(losses, gradient norms, the logical weights gathered over ep); checkpoints reshard the experts
over ep; the "ep" bytes are the spec's formula; a hybrid ZeRO block that splits an EP group is
refused (tests/test_ep_codecs.py: the lossy codecs and hierarchical reduction with ep)."""

import dataclasses
import json
from functools import lru_cache, partial
from pathlib import Path

import pytest
import torch

from conftest import assert_parity, first_step_gradients, grad_norms, rank_histories, tiny_config, train_layout
from layout_draws import parity_atol
from nccl_collectives import NcclTrainer
from nccl_semantics import NcclSemantics
from tetrad.cli import main
from tetrad.config import ConfigError, load_config
from tetrad.dist.layout import GRAD_DIMS, Layout, factorisations
from tetrad.plan.comm_bytes import comm_bytes_per_step
from tetrad.train.trainer import Trainer

MOE = {"n_experts": 4, "experts_per_token": 2, "router_aux_loss": 1.0}
# Every run also evaluates at its last step (forward only: the dispatch without autograd).
EVAL = {"data": {"val_fraction": 0.1}, "checkpoint": {"every": 3}}


def _config(parallel: dict, train: dict | None = None, **sections):
    return tiny_config(parallel=parallel, model=MOE, train={"eval_every": 5, **(train or {})}, **{**EVAL, **sections})


def _step3(cfg) -> Path:
    return Path(cfg.run.dir) / "checkpoints" / "step_00000003"


@lru_cache(maxsize=None)
def _trained(parallel: tuple, train: tuple):
    """(train_layout's result, its step-3 checkpoint), once per layout."""
    cfg = _config(dict(parallel), dict(train))
    return train_layout(cfg), _step3(cfg)


# The weights' bound: tp's (tests/layout_draws.py parity_atol) at least. Each expert's weight
# gradient is summed in another grouping (one GEMM over the rows of every rank of the EP group),
# and an element whose gradient is below Adam's eps (1e-8) moves by a visible share of lr for a
# rounding of it: dp2 ep2's w1[0, 97, 12] ends 1.4e-5 from one process's (of 32768 elements, the
# one past 1e-5), while the first step's gradients agree to fp32 rounding
# (test_first_step_gradients_are_one_process_s).
WEIGHTS_ATOL = 1e-4


def _assert_matches_one_process(got, parallel: dict):
    ref, _ = _trained((), ())
    assert_parity(got, ref, atol=max(WEIGHTS_ATOL, parity_atol({"tp": 1, "cp": 1, **parallel})))
    for key in ("moe_aux_loss", "val_loss"):
        values, ref_values = ([r[key] for r in result[2] if key in r] for result in (got, ref))
        assert len(values) == len(ref_values) > 0, key
        torch.testing.assert_close(torch.tensor(values), torch.tensor(ref_values), rtol=1e-5, atol=0, msg=key)


@pytest.mark.parametrize("world", [4, 8, 16])
def test_expert_groups_partition_the_gradient_groups(world):
    """EP groups: ep consecutive dp ranks at one (pp, cp, tp); EXPERT_GRAD: one ep rank's ranks over
    every block and cp. Each partitions the world; EXPERT_GRAD groups partition each GRAD group, and
    every EP group meets every EXPERT_GRAD group of its GRAD group exactly once."""
    for base in factorisations(world):
        for ep in (e for e in range(2, base.dp + 1) if base.dp % e == 0):
            layout = dataclasses.replace(base, ep=ep)
            ep_groups, expert_grad = layout.expert_groups()
            for groups, size in ((ep_groups, ep), (expert_grad, base.dp * base.cp // ep)):
                assert sorted(r for g in groups for r in g) == list(range(world))
                assert all(len(g) == size for g in groups)
            for g in ep_groups:
                coords = [layout.coords(r) for r in g]
                assert [c["dp"] % ep for c in coords] == list(range(ep))
                assert len({(c["pp"], c["cp"], c["tp"], c["dp"] // ep) for c in coords}) == 1
            for g in expert_grad:
                assert len({(c["pp"], c["tp"], c["dp"] % ep) for c in map(layout.coords, g)}) == 1
                grad = layout.group_of(g[0], GRAD_DIMS)
                assert set(g) <= set(grad)
                assert all(len(set(e) & set(g)) == 1 for e in ep_groups if set(e) <= set(grad))


@pytest.mark.parametrize("world", [8, 16])
def test_expert_shards_cut_each_expert_group_inside_the_shard_blocks(world):
    """Hybrid ZeRO with ep (zero_shard a multiple of ep x cp): EXPERT_SHARD chunks partition each
    EXPERT_GRAD group into zero_shard/ep ranks of one shard block, and the ranks at one position of
    every chunk are a dense REPLICA group, over which the experts' shards are then summed too (the
    norm's "replica 0 counts" holds for both alike)."""
    for base in factorisations(world):
        n = base.dp * base.cp
        for ep in (e for e in range(2, base.dp + 1) if base.dp % e == 0):
            for shard in (s for s in range(ep * base.cp, n, ep * base.cp) if n % s == 0):
                layout = dataclasses.replace(base, ep=ep)
                dense_shard, dense_replica = layout.split_in_blocks(GRAD_DIMS, shard)
                chunks = layout.expert_shards(shard)
                assert sorted(r for g in chunks for r in g) == list(range(world))
                assert {len(g) for g in chunks} == {shard // ep}
                expert_grad = layout.expert_groups()[1]
                assert all(any(set(c) <= set(g) for g in expert_grad) for c in chunks)
                assert all(any(set(c) <= set(b) for b in dense_shard) for c in chunks)
                replicas = [g[i::shard // ep] for g in expert_grad for i in range(shard // ep)]
                assert sorted(replicas) == sorted(dense_replica)


def test_ep1_has_no_groups_of_its_own():
    ep_groups, expert_grad = Layout(dp=4, cp=2).expert_groups()
    assert all(len(g) == 1 for g in ep_groups)
    assert expert_grad == Layout(dp=4, cp=2).groups(GRAD_DIMS)


LAYOUTS = {  # name -> (parallel, train)
    "dp2-ep2": ({"dp": 2, "ep": 2}, {}),
    "dp4-ep2-zero1": ({"dp": 4, "ep": 2, "zero": 1}, {}),
    "dp2-ep2-tp2-sp-zero2": ({"dp": 2, "ep": 2, "tp": 2, "sequence_parallel": True, "zero": 2}, {}),
    "dp2-ep2-pp2-1f1b": ({"dp": 2, "ep": 2, "pp": 2}, {}),
    "dp2-ep2-cp2-selective": ({"dp": 2, "ep": 2, "cp": 2}, {"recompute": "selective-op"}),
    # ZeRO-3: each block's experts a bucket gathered over the expert gradient group (of two
    # ranks; of one at dp2 ep2, whose gathers move nothing) beside the block's over dp x cp
    "dp4-ep2-zero3": ({"dp": 4, "ep": 2, "zero": 3}, {}),
    "dp2-ep2-pp2-zb-zero3": ({"dp": 2, "ep": 2, "pp": 2, "schedule": "zb", "zero": 3}, {}),
    "dp2-ep2-cp2-zero3-full": ({"dp": 2, "ep": 2, "cp": 2, "zero": 3}, {"recompute": "full"}),
    # hybrid ZeRO: the experts shard over zero_shard/ep ranks of their group (one here: every rank
    # holds its experts whole, summed over the replicas alone) and are summed over the replicas
    "dp4-ep2-zero1-hybrid": ({"dp": 4, "ep": 2, "zero": 1, "zero_shard": 2}, {}),
    "dp4-ep2-zero3-hybrid": ({"dp": 4, "ep": 2, "zero": 3, "zero_shard": 2}, {}),
    # ... over two ranks (8 ranks: the fewest where the experts' chunk has two): two dp ranks, or
    # one dp rank's two cp ranks
    "dp8-ep2-zero2-hybrid4": ({"dp": 8, "ep": 2, "zero": 2, "zero_shard": 4}, {"micro_batch": 1}),
    "dp4-ep2-cp2-zero3-hybrid4": ({"dp": 4, "ep": 2, "cp": 2, "zero": 3, "zero_shard": 4}, {"recompute": "full"}),
}


@pytest.mark.dist
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_single_process(name):
    """Losses, gradient norms, the load-balancing loss, the validation loss and the logical weights
    (the experts gathered over ep) after 5 steps are one process's."""
    parallel, train = LAYOUTS[name]
    got, _ = _trained(tuple(parallel.items()), tuple(train.items()))
    _assert_matches_one_process(got, parallel)


@pytest.mark.dist
def test_first_step_gradients_are_one_process_s():
    """The reduced logical gradients of the first step (fp32 ZeRO-0; experts gathered over ep) are
    one process's to fp32 rounding: the expert gradients summed over the ranks holding the same
    experts (dp4 ep2: EXPERT_GRAD of two), the dense ones over dp."""
    got = first_step_gradients(_config({"dp": 4, "ep": 2}))
    ref = first_step_gradients(_config({}))
    assert got.keys() == ref.keys()
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-8, msg=name)


@pytest.mark.dist
@pytest.mark.parametrize("zero,shard", [(2, 0), (3, 0), (2, 2)], ids=["zero2", "zero3", "zero2-hybrid"])
def test_under_nccl_semantics_matches_single_process(zero, shard):
    """Under NCCL's timing of collectives (tests/nccl_collectives.py): ZeRO-2's reduce-scatters of
    the expert buckets over their own group beside the dense ones (ZeRO-3: and each block's two
    gathers, the next block's prefetched, forward and backward; hybrid ZeRO: and both groups' sums
    over their replicas, started during the last backward), and the dispatch's all-to-alls again
    inside backward (full recompute)."""
    parallel = {"dp": 4, "ep": 2, "zero": zero, "zero_shard": shard}
    got = train_layout(_config(parallel, {"recompute": "full"}), transport=partial(NcclSemantics, timeout_s=20),
                       trainer_class=NcclTrainer)
    got[2][-1].pop("posted")
    _assert_matches_one_process(got, parallel)


@pytest.mark.dist
def test_tetrad_eval_at_ep2_gives_one_process_s_validation_loss(capsys):
    """`tetrad eval` (a forward-only build: no gradient buffers, no optimizer) of one process's
    first-step checkpoint at dp2 ep2 gives the validation loss it gives in one process. (From step
    3 on, lr 1e-2 has the tiny model route every token of a layer to the same two experts: a
    dispatch that mixed up rows of equal counts would go unseen there.)"""
    cfg = _config({}, {"steps": 1}, checkpoint={"every": 1})
    train_layout(cfg)
    step1 = str(Path(cfg.run.dir) / "checkpoints" / "step_00000001")
    losses = []
    for layout in ([], ["--parallel.dp=2", "--parallel.ep=2"]):
        capsys.readouterr()
        assert main(["eval", step1, *layout, "--json"]) == 0
        losses.append(json.loads(capsys.readouterr().out.strip().splitlines()[-1])["val_loss"])
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)



class _UniformRouter(Trainer):
    """Every router weight zero: uniform probabilities, whose top-k ties pick experts 2 and 3 for
    every token on the first step, so ep rank 0 of an EP group of two receives no row at all."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name.endswith("router.weight"):
                    p.zero_()


@pytest.mark.dist
def test_a_rank_that_receives_no_token_still_takes_part():
    """A rank whose experts get no row runs its (empty) experts, both all-to-alls each way and
    its expert buckets' reduction like the others (else its EP group hangs), and the steps are
    one process's: the same first-step loss and gradient norms."""
    train = {"steps": 2, "micro_batch": 4}
    got = train_layout(_config({"dp": 2, "ep": 2}, train), trainer_class=_UniformRouter)
    ref = train_layout(_config({}, train), trainer_class=_UniformRouter)
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(ref[0]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_norms(got[2]), grad_norms(ref[2]), rtol=1e-5, atol=0)

@pytest.mark.dist
def test_bf16_tracks_one_process_in_bf16():
    """bf16 (the all-to-alls carry bf16 rows; fp32 expert buckets and masters) at dp2 ep2 ZeRO-1
    tracks one bf16 process within tests/test_precision.py's bounds."""
    bf16 = (("dtype", "bf16"),)
    (losses, _, history), _ = _trained((("dp", 2), ("ep", 2), ("zero", 1)), bf16)
    (ref_losses, _, ref_history), _ = _trained((), bf16)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=5e-3)
    torch.testing.assert_close(grad_norms(history)[0], grad_norms(ref_history)[0], rtol=2e-3, atol=0)
    assert ref_losses[-1] < ref_losses[0]


@pytest.mark.dist
@pytest.mark.parametrize("zero,nccl,shard", [(1, False, 0), (3, False, 0), (2, True, 0), (1, False, 2)],
                         ids=["zero1", "zero3", "zero2-nccl", "zero1-hybrid"])
def test_a_bf16_codec_tracks_the_uncompressed_run(zero, nccl, shard):
    """grad_codec='bf16' at dp4 ep2: the experts' buckets too are summed in bf16, over their group
    of two (tests/test_codecs.py's bound on the losses), and send the planner's bytes, fewer than
    uncompressed; ZeRO-2's bf16 reduce-scatters of both groups' buckets also under NCCL's timing of
    collectives (tests/nccl_collectives.py); under hybrid ZeRO-1 the shards' sums over their
    replicas in bf16 too (the experts' chunk is one rank: the replicas' sum is all they send)."""
    parallel = {"dp": 4, "ep": 2, "zero": zero, "zero_shard": shard}
    if nccl:
        losses, _, history = train_layout(_config({**parallel, "grad_codec": "bf16"}),
                                          transport=partial(NcclSemantics, timeout_s=20), trainer_class=NcclTrainer)
        history[-1].pop("posted")
    else:
        (losses, _, history), _ = _trained(tuple({**parallel, "grad_codec": "bf16"}.items()), ())
    (ref_losses, _, ref_history), _ = _trained(tuple(parallel.items()), ())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=0, atol=0.02)
    torch.testing.assert_close(grad_norms(history)[0], grad_norms(ref_history)[0], rtol=1e-2, atol=0)
    cfg = _config({**parallel, "grad_codec": "bf16"})
    assert [r["comm_bytes"]["dp"] for r in history] == [comm_bytes_per_step(cfg)["dp"]] * len(history)
    assert history[0]["comm_bytes"]["dp"] < ref_history[0]["comm_bytes"]["dp"]


@pytest.mark.dist
@pytest.mark.parametrize("saved,resumed", [({"dp": 2, "ep": 2}, {"dp": 2}), ((), {"dp": 2, "ep": 2, "zero": 1}),
                                           ({"dp": 4, "ep": 2, "zero": 3}, {"dp": 2}),
                                           ((), {"dp": 4, "ep": 2, "zero": 3}),
                                           ({"dp": 4, "ep": 2, "zero": 3, "zero_shard": 2}, {"dp": 2}),
                                           ((), {"dp": 4, "ep": 2, "zero": 1, "zero_shard": 2})],
                         ids=["ep2-to-ep1", "ep1-to-ep2", "ep2-zero3-to-ep1", "ep1-to-ep2-zero3",
                              "ep2-hybrid-zero3-to-ep1", "ep1-to-ep2-hybrid-zero1"])
def test_a_checkpoint_resumes_at_another_ep(saved, resumed):
    """The step-3 checkpoint of a run at ep2 resumes at ep1, and one process's at ep2 (ZeRO-1: the
    optimizer state sharded over the expert group; ZeRO-3: the weights too; hybrid ZeRO: each
    replica of a shard saves and loads the same piece), continuing one process's losses."""
    (ref_losses, ref_state, _), _ = _trained((), ())
    _, step3 = _trained(tuple(dict(saved).items()), ())
    losses, state, _ = train_layout(_config(resumed, checkpoint={"resume": str(step3)}))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[3:]), rtol=1e-5, atol=1e-6)
    for name in ref_state:
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-4, atol=WEIGHTS_ATOL, msg=name)


@pytest.mark.dist
def test_ep_bytes_over_an_ep_group_are_the_formula():
    """Summed over an EP group, each step's "ep" bytes are per MoE layer and micro-batch: forward
    E*8 + n*k*d*b + recv*d*b, backward n*k*d*b + recv*d*b, the forward again under full recompute,
    with sum(recv) = sum(n*k) whatever the routing; and 0 without expert parallelism."""
    cfg = _config({"dp": 2, "ep": 2}, {"steps": 2, "recompute": "full", "eval_every": 0})
    m, t = cfg.model, cfg.train
    n, micro_batches = t.micro_batch * m.seq_len, t.global_batch // (t.micro_batch * cfg.parallel.dp)
    rows = n * m.experts_per_token * m.d_model * 4  # fp32 activations
    per_rank = m.n_layers * micro_batches * (2 * (m.n_experts * 8 + 2 * rows) + 2 * rows)
    histories = rank_histories(cfg)
    for step in range(t.steps):
        assert sum(history[step]["comm_bytes"]["ep"] for _, history in histories) == 2 * per_rank
    (_, _, one_process), _ = _trained((), ())
    assert {r["comm_bytes"]["ep"] for r in one_process} == {0}


@pytest.mark.parametrize("parallel,message", [
    ({"ep": 4, "zero": 1, "zero_shard": 2}, r"zero_shard=2 must be a multiple of ep\*cp = 4 .*; use zero_shard in \[0\]"),
    ({"ep": 2, "cp": 2, "zero": 3, "zero_shard": 2}, r"multiple of ep\*cp = 4 .*; use zero_shard in \[4, 0\]"),
    # a multiple that does not divide dp*cp: named here, not by the general rule's list (1, 2, 3, 6)
    ({"dp": 6, "ep": 2, "zero": 1, "zero_shard": 4}, r"multiple of ep\*cp = 2 dividing dp\*cp = 6 .*; use zero_shard in \[2, 0\]"),
])
def test_a_hybrid_block_that_splits_an_ep_group_is_refused_in_one_line(parallel, message):
    with pytest.raises(ConfigError, match=message) as refused:
        load_config(overrides={"model": {"d_model": 64, "n_heads": 4, "n_kv_heads": 4, "ffn_hidden": 128, **MOE},
                               "parallel": {"dp": 4, **parallel}})
    assert "\n" not in str(refused.value)
