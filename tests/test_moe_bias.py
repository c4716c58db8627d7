"""DeepSeek-V3's auxiliary-loss-free load balancing (model.router_bias_update_rate; docs/design.md
"Mixture of experts"): every layout moves the expert biases one process moves (the counts taken
once per micro-batch under full recompute and zero-bubble's split backward too, summed exactly),
with its losses and weights; rate 0 picks as before, bit for bit, and adds no byte; checkpoints
keep the biases across layouts, `tetrad eval` and `generate` route with them, an HF folder starts
without, an export of moved biases is refused; the planner counts the counts' all-reduce; the
config's refusals and aliases."""

import json
from functools import lru_cache, partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from conftest import TINY, assert_parity, rank_histories, tiny_config, train_layout
from nccl_collectives import NcclTrainer
from nccl_semantics import NcclSemantics
from tetrad.cli import main
from tetrad.config import ConfigError, load_config
from tetrad.config.aliases import places_of
from tetrad.config.validation import idle_settings
from tetrad.dist.layout import GRAD
from tetrad.dist.topology import Topology
from tetrad.model.execution import Execution
from tetrad.model.layers import activation
from tetrad.model.moe import MoE
from tetrad.evaluate import eval_config
from tetrad.model.moe import expert_biases, set_expert_biases
from tetrad.model.routing import pick_experts
from tetrad.plan.comm_bytes import comm_bytes_per_step
from tetrad.train.checkpoint.store import read_extras
from tetrad.train.expert_bias import ExpertBias
from tetrad.train.generate import load_generator
from tetrad.train.inputs import model_keys
from tetrad.train.trainer import Trainer

RATE = 0.01
MOE = {"n_experts": 4, "experts_per_token": 2, "router_aux_loss": 0.0, "router_bias_update_rate": RATE}
# Validation at steps 3 and 5, a checkpoint at step 3 (and 5).
EVAL = {"data": {"val_fraction": 0.1}, "checkpoint": {"every": 3}}
BIASES = ("layers.0.mlp.expert_bias", "layers.1.mlp.expert_bias")
# The weights' bound, test_ep.py's (WEIGHTS_ATOL): an expert's weight gradient is summed in another
# grouping, and an element whose gradient is below Adam's eps moves by a share of lr for a rounding
# of it. The counts and biases, exact integers and their signs, are compared exactly.
WEIGHTS_ATOL = 1e-4
COUNTS = ("layers.0.mlp.counts", "layers.1.mlp.counts")


def _config(parallel: dict, train: dict | None = None, rate: float = RATE, **sections):
    return tiny_config(parallel=parallel, model={**MOE, "router_bias_update_rate": rate},
                       train={"eval_every": 3, **(train or {})}, **{**EVAL, **sections})


class _WithBiases:
    """full_state with each MoE layer's expert bias ("layers.i.mlp.expert_bias") and the expert
    counts each step's update read ("layers.i.mlp.counts", [steps, E]: summed over the job)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.counted, reduce = [], self.expert_bias.reduce

        def reduce_and_keep():
            reduce()
            if self.expert_bias.counts is not None:  # rate 0: none
                self.counted.append(self.expert_bias.counts.clone())
        self.expert_bias.reduce = reduce_and_keep

    def full_state(self):
        for name, bias in expert_biases(self.model).items():  # every rank holding the layer alike
            for group in (GRAD, "tp"):
                held = [torch.empty_like(bias) for _ in range(self.topo.size(group))]
                if len(held) > 1:
                    dist.all_gather(held, bias, group=self.topo.group(group))
                    assert all(torch.equal(h, bias) for h in held), (name, group, held)
        biases = {f"{name}.expert_bias": b.detach().cpu().clone() for name, b in expert_biases(self.model).items()}
        counts = zip(expert_biases(self.model), torch.stack(self.counted, dim=1)) if self.counted else ()
        return {**super().full_state(), **biases, **{f"{name}.counts": c for name, c in counts}}  # c: [steps, E]


class _Trainer(_WithBiases, Trainer):
    pass


class _NcclTrainer(_WithBiases, NcclTrainer):
    pass


@lru_cache(maxsize=None)
def _trained(parallel: tuple = (), train: tuple = (), rate: float = RATE):
    """(train_layout's result with the biases, its run's step-3 checkpoint), once per layout."""
    cfg = _config(dict(parallel), dict(train), rate)
    return train_layout(cfg, trainer_class=_Trainer), Path(cfg.run.dir) / "checkpoints" / "step_00000003"


def _max_loads(history) -> list[float]:
    return [r["moe_max_load"] for r in history]


def _assert_one_process_s(got):
    """Losses, norms and weights as assert_parity; the counts (each micro-batch's once: every
    token's k a step), biases and max loads exactly one process's, the biases moved and the run
    another than without them."""
    (ref, _), (unbiased, _) = _trained(), _trained(rate=0.0)
    assert_parity(got, ref, atol=WEIGHTS_ATOL)
    assignments = TINY["train"]["global_batch"] * TINY["model"]["seq_len"] * MOE["experts_per_token"]
    for name in COUNTS:
        assert torch.equal(got[1][name], ref[1][name]), (name, got[1][name], ref[1][name])
        assert got[1][name].sum(dim=-1).tolist() == [assignments] * TINY["train"]["steps"]
    for name in BIASES:
        assert torch.equal(got[1][name], ref[1][name]), (name, got[1][name], ref[1][name])
        assert ref[1][name].abs().min() > 0 and not unbiased[1][name].any()
    assert _max_loads(got[2]) == _max_loads(ref[2])
    assert all(1 <= load <= MOE["n_experts"] / MOE["experts_per_token"] for load in _max_loads(ref[2]))
    assert ref[0][0] == unbiased[0][0] and ref[0][1:] != unbiased[0][1:]  # the first step picks alike


LAYOUTS = {  # name -> (parallel, train)
    "dp2-zero3": ({"dp": 2, "zero": 3}, {}),  # the biases are no ZeRO-3 parameter: whole on every rank
    "dp2-ep2": ({"dp": 2, "ep": 2}, {}),
    "tp2-sp": ({"tp": 2, "sequence_parallel": True}, {}),
    "pp2-1f1b": ({"pp": 2}, {}),
    "cp2-full-recompute": ({"cp": 2}, {"recompute": "full"}),  # backward meets each micro-batch once
    "pp2-zb": ({"pp": 2, "schedule": "zb"}, {}),  # and BI once, BW none
    "dp4-ep2-hybrid": ({"dp": 4, "ep": 2, "zero": 2, "zero_shard": 2}, {}),
}


@pytest.mark.dist
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_moves_the_biases_one_process_moves(name):
    parallel, train = LAYOUTS[name]
    got, _ = _trained(tuple(parallel.items()), tuple(train.items()))
    _assert_one_process_s(got)


@pytest.mark.dist
def test_under_nccl_semantics_moves_the_biases_one_process_moves():
    """Under NCCL's timing of collectives (tests/nccl_collectives.py), dp2 ep2 ZeRO-2: the counts'
    all-reduce after the expert buckets' reduce-scatters."""
    cfg = _config({"dp": 2, "ep": 2, "zero": 2})
    got = train_layout(cfg, transport=partial(NcclSemantics, timeout_s=20), trainer_class=_NcclTrainer)
    got[2][-1].pop("posted")
    _assert_one_process_s(got)


@pytest.mark.parametrize("k", [1, 2])
def test_a_zero_bias_picks_as_topk_bit_for_bit(k):
    """Rate 0 (the bias stays zero) routes as before the bias: the same experts and, gathered from
    the probabilities as MoE._routed does, the same weights and router gradient as probs.topk's,
    bit for bit; a bias picks otherwise."""
    logits = torch.randn(64, 4, generator=torch.Generator().manual_seed(k), requires_grad=True)
    probs = torch.softmax(logits, dim=-1)
    chosen = pick_experts(probs, torch.zeros(4), k)
    weights = probs.gather(-1, chosen)
    ref_weights, ref_chosen = probs.topk(k, dim=-1)
    assert torch.equal(chosen, ref_chosen) and torch.equal(weights, ref_weights)
    grad = torch.randn(64, k, generator=torch.Generator().manual_seed(7))
    got_grad, = torch.autograd.grad(weights, logits, grad, retain_graph=True)
    ref_grad, = torch.autograd.grad(ref_weights, logits, grad)
    assert torch.equal(got_grad, ref_grad)
    chosen = pick_experts(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]), k)
    assert (chosen[:, 0] == 0).all() and (ref_chosen[:, 0] != 0).any()


@pytest.mark.parametrize("normalize", [True, False])
def test_the_bias_picks_and_the_probabilities_weigh(normalize):
    """An MoE layer with a bias that changes the picks (expert 3 always first): its output is each
    token's picked experts' outputs weighed by their softmax probabilities (renormalised or not),
    none of the bias; a zero bias picks the probabilities' top k."""
    cfg = load_config(overrides={"model": {"d_model": 16, "n_heads": 2, "n_kv_heads": 2, "ffn_hidden": 32, **MOE,
                                           "normalize_expert_weights": normalize}}).model
    moe, gen = MoE(cfg, Topology.single(), Execution(), 0.02), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(12, 16, generator=gen)
    probs = torch.softmax(x @ moe.router.weight.t(), dim=-1)
    w1, w3, w2 = moe.experts.w1, moe.experts.w3, moe.experts.w2

    def expert(e, row):
        return (activation(moe.experts.kind, w1[e] @ row) * (w3[e] @ row)) @ w2[e].t()
    for bias, first in ((torch.tensor([0.0, 0.0, 0.0, 10.0]), 3), (torch.zeros(4), None)):
        moe.expert_bias.copy_(bias)
        with torch.no_grad():
            y, _, got_probs, chosen, _ = moe._routed(x)
        picked = (probs + bias).topk(2, dim=-1)[1]
        assert torch.equal(chosen.view(-1, 2), picked) and torch.allclose(got_probs, probs)
        assert (picked[:, 0] == first).all() if first is not None else torch.equal(picked, probs.topk(2, dim=-1)[1])
        weights = probs.gather(-1, picked)
        weights = weights / weights.sum(dim=-1, keepdim=True) if normalize else weights
        want = torch.stack([sum(weights[t, j] * expert(picked[t, j], x[t]) for j in range(2)) for t in range(12)])
        torch.testing.assert_close(y, want, rtol=1e-4, atol=1e-4)  # outputs up to ~150 (weights of std 1): fp32 sums in another order


def test_a_rate_that_picks_nothing_is_noted():
    notes = idle_settings(load_config(overrides={"model": {"d_model": 64, "n_heads": 4, "n_kv_heads": 4,
                                                           "ffn_hidden": 128, **MOE, "experts_per_token": 4}}))
    assert any("router_bias_update_rate=0.01 moves a bias that picks nothing" in n for n in notes)


@pytest.mark.dist
@pytest.mark.parametrize("parallel,added", [
    ({"dp": 2, "pp": 2}, {"tp": 0, "cp": 0, "pp": 2 * 4, "dp": 1 * 4 * 8 + 2 * 4, "ep": 0}),
    ({"tp": 2, "pp": 2}, {"tp": 2 * 4, "cp": 0, "pp": 2 * 4, "dp": 0, "ep": 0})])  # no dp x cp group: no counts sent
def test_the_planner_counts_the_counts_all_reduce_and_rate_0_adds_no_byte(parallel, added):
    """Rank 0's bytes are the planner's, and moving biases adds one stage's MoE layer's int64
    counts [1, E] to "dp" and a float per stage to the step's sums (dp, tp and pp); rate 0 none."""
    got = {}
    for rate in (RATE, 0.0):
        cfg = _config(parallel, {"steps": 2, "eval_every": 0}, rate, checkpoint={"every": 0})
        first = next(h for c, h in rank_histories(cfg) if not any(c.values()))
        assert all(r["comm_bytes"] == comm_bytes_per_step(cfg) for r in first), (first[0]["comm_bytes"], rate)
        assert ("moe_max_load" in first[0]) == (rate > 0)
        got[rate] = first[0]["comm_bytes"]
    assert {g: got[RATE][g] - got[0.0][g] for g in got[0.0]} == added


@pytest.mark.dist
@pytest.mark.parametrize("saved,resumed", [({"dp": 2, "ep": 2}, {"pp": 2, "tp": 2}), ({"pp": 2}, {"dp": 2, "ep": 2})],
                         ids=["dp2-ep2-to-pp2-tp2", "pp2-to-dp2-ep2"])
def test_a_checkpoint_resumes_at_another_layout_with_its_biases(saved, resumed):
    """A step-3 checkpoint continues one process's losses, biases and weights at another layout:
    each pipeline stage restores its own layers' biases, and a checkpoint saved by stages holds
    every layer's."""
    (ref_losses, ref_state, _), _ = _trained()
    _, step3 = _trained(tuple(saved.items()))
    stored = read_extras(step3, ExpertBias.NAME)
    assert sorted(stored) == ["layers.0.mlp", "layers.1.mlp"] and all(b.any() for b in stored.values())
    losses, state, _ = train_layout(_config(resumed, checkpoint={"resume": str(step3)}), trainer_class=_Trainer)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[3:]), rtol=1e-5, atol=1e-6)
    for name in BIASES:
        assert torch.equal(state[name], ref_state[name]), name
    for name in COUNTS:
        assert torch.equal(state[name], ref_state[name][3:]), name
    for name in set(ref_state) - set(COUNTS):
        torch.testing.assert_close(state[name], ref_state[name], rtol=1e-4, atol=WEIGHTS_ATOL, msg=name)


@pytest.mark.dist
def test_an_async_save_keeps_the_biases_of_its_step():
    """checkpoint.async_save copies the biases with the rest before the next step moves them: its
    step-3 checkpoint resumed by one process continues one process's losses and biases."""
    (ref_losses, ref_state, _), _ = _trained()
    saved = _config({"dp": 2}, checkpoint={"every": 3, "async_save": True})
    train_layout(saved, trainer_class=_Trainer)
    step3 = Path(saved.run.dir) / "checkpoints" / "step_00000003"
    losses, state, _ = train_layout(_config({}, checkpoint={"resume": str(step3)}), trainer_class=_Trainer)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses[3:]), rtol=1e-5, atol=1e-6)
    for name in BIASES:
        assert torch.equal(state[name], ref_state[name]), name


@pytest.mark.dist
def test_interleaved_stages_move_the_biases_one_process_moves():
    """pp2 vpp2 (four layers, one a chunk): a rank's two chunks' layers each counted once a
    micro-batch and reduced in the stage's one all-reduce."""
    model = {**MOE, "n_layers": 4}
    got = train_layout(tiny_config(parallel={"pp": 2, "vpp": 2, "schedule": "interleaved"}, model=model),
                       trainer_class=_Trainer)
    ref = train_layout(tiny_config(model=model), trainer_class=_Trainer)
    assert_parity(got, ref, atol=WEIGHTS_ATOL)
    for layer in range(4):
        for kind in ("counts", "expert_bias"):
            name = f"layers.{layer}.mlp.{kind}"
            assert torch.equal(got[1][name], ref[1][name]), name
        assert ref[1][f"layers.{layer}.mlp.expert_bias"].any()


@pytest.mark.dist
def test_eval_and_generate_route_with_the_stored_biases(tmp_path, capsys):
    """`tetrad eval` of the step-3 checkpoint gives the val_loss training logged there (after the
    step's bias update); with the biases zeroed it gives another. `tetrad generate`'s model holds them."""
    (_, _, history), step3 = _trained()
    logged = history[2]["val_loss"]
    assert main(["eval", str(step3), "--json"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["val_loss"] == pytest.approx(logged, rel=1e-6)
    trainer = Trainer(eval_config(None, [], step3, str(tmp_path / "eval")), torch.device("cpu"), trains=False)
    try:
        assert trainer.evaluate()["val_loss"] == pytest.approx(logged, rel=1e-6)
        set_expert_biases(trainer.model, {})
        assert trainer.evaluate()["val_loss"] != pytest.approx(logged, rel=1e-5)
    finally:
        trainer.topo.close()
    model = load_generator(step3)[0]
    stored = read_extras(step3, ExpertBias.NAME)
    assert expert_biases(model).keys() == stored.keys()
    assert all(torch.equal(expert_biases(model)[name], stored[name]) for name in stored)


@pytest.mark.dist
def test_an_export_of_moved_biases_is_refused_before_writing(tmp_path, capsys):
    """One line, and no folder written; a run whose biases never moved (rate 0) exports."""
    _, step3 = _trained()
    capsys.readouterr()
    assert main(["convert", str(step3), "--to-hf", str(tmp_path / "hf")]) != 0
    said = capsys.readouterr().err.strip()
    assert "\n" not in said and not (tmp_path / "hf").exists()
    assert "holds expert biases moved from zero" in said and "the export would route otherwise" in said, said
    _, unbiased = _trained(rate=0.0)
    assert main(["convert", str(unbiased), "--to-hf", str(tmp_path / "hf0")]) == 0


def test_an_hf_folder_starts_at_zero_bias(tmp_path):
    """init_from an HF Mixtral folder: the biases start at zero, then move."""
    pytest.importorskip("transformers")
    from test_moe_hf import write_hf_moe
    write_hf_moe(tmp_path / "hf", "mixtral")
    cfg = load_config(overrides={"model": {"router_bias_update_rate": RATE, "seq_len": 32},
                                 "train": {**TINY["train"], "steps": 2}, "run": {"dir": str(tmp_path / "run")},
                                 "checkpoint": {"init_from": str(tmp_path / "hf")}}, model_from_inputs=model_keys)
    trainer = Trainer(cfg, torch.device("cpu"))
    try:
        assert len(expert_biases(trainer.model)) == 2
        assert not any(b.any() for b in expert_biases(trainer.model).values())
        trainer.fit()
        assert all(b.any() for b in expert_biases(trainer.model).values())
    finally:
        trainer.topo.close()


def test_the_rate_is_refused_on_a_dense_model_and_out_of_range():
    with pytest.raises(ConfigError, match=r"model.router_bias_update_rate shapes mixture-of-experts layers.*"
                                          r"unset it, or set model.n_experts") as dense:
        tiny_config(model={"router_bias_update_rate": RATE})
    assert "\n" not in str(dense.value)
    with pytest.raises(ConfigError, match=r"model.router_bias_update_rate=-0.01 is out of range"):
        tiny_config(model={**MOE, "router_bias_update_rate": -0.01})


@pytest.mark.parametrize("theirs", ["moe_router_bias_update_rate", "load_balance_coeff"])
def test_megatron_s_and_torchtitan_s_names_point_at_the_rate(theirs):
    """torchtitan's load_balance_coeff is its expert-bias update rate, not an auxiliary loss's coefficient."""
    assert places_of(theirs) == ["model.router_bias_update_rate"]
    with pytest.raises(ConfigError, match=r"did you mean 'model.router_bias_update_rate'"):
        tiny_config(model={**MOE, theirs: RATE})
