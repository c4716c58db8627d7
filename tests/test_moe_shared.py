"""Qwen2-MoE's and DeepSeek-MoE's layers (model/moe.py): a shared expert beside the routed ones,
its sigmoid gate, dense layers among the MoE ones, top-k weights left unnormalised. One model
with all four trains under tp2 (with SP and without), dp2 ep2 and pp2 as one process does (the shared expert
split over tp like the dense MLP, dense over ep; the gate's gradient summed over tp; a pipeline
stage without an MoE layer); a layer's output is the formula's; the metric and the load-balancing
gradient average over the MoE layers alone; checkpoints tell the shapes apart."""

import dataclasses
from functools import lru_cache
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_parity, tiny_config, train_layout
from layout_draws import parity_atol
from tetrad.dist.topology import Topology
from tetrad.model.layers import MLP
from tetrad.model.llama import Transformer
from tetrad.model.sharding import init_parameters, spec_of
from tetrad.train.checkpoint import CheckpointError
from tetrad.train.checkpoint.store import check_model
from tetrad.train.trainer import Trainer

# layer 0 dense, layer 1 MoE with a gated shared expert; coefficient 1: a wrong aux gradient shows
SHARED = {"n_experts": 4, "experts_per_token": 2, "shared_expert_ffn_hidden": 32, "shared_expert_gate": True,
          "dense_layers": [0], "normalize_expert_weights": False, "router_aux_loss": 1.0}
# tp2 without SP: there alone a replicated weight's gradient is not summed over tp unless it says so (the gate's)
LAYOUTS = {"tp2": {"tp": 2}, "tp2-sp": {"tp": 2, "sequence_parallel": True}, "dp2-ep2": {"dp": 2, "ep": 2},
           "pp2": {"pp": 2}}


@lru_cache(maxsize=None)
def _one_process():
    return train_layout(tiny_config(model=SHARED))


@pytest.mark.dist
@pytest.mark.parametrize("name", LAYOUTS)
def test_layout_matches_single_process(name):
    parallel = LAYOUTS[name]
    got, ref = train_layout(tiny_config(model=SHARED, parallel=parallel)), _one_process()
    assert_parity(got, ref, atol=parity_atol({"tp": 1, "cp": 1, **parallel}))
    aux, ref_aux = ([r["moe_aux_loss"] for r in result[2]] for result in (got, ref))
    torch.testing.assert_close(torch.tensor(aux), torch.tensor(ref_aux), rtol=1e-5, atol=0)


@pytest.mark.dist
def test_the_load_balancing_metric_is_the_mean_over_the_moe_layers():
    """Near its balanced value 1 at initialisation: divided by both layers, the one dense, it
    would read about 1/2."""
    _, _, history = _one_process()
    assert 0.9 < history[0]["moe_aux_loss"] < 1.5


def test_the_load_balancing_gradient_is_scaled_by_the_moe_layers():
    """The coefficient over (MoE layers x the global batch's sequences): one MoE layer of two."""
    trainer = Trainer(tiny_config(model=SHARED), torch.device("cpu"))
    micro = trainer.batches.microbatches(0, 0, 1, trainer.cfg.train.micro_batch)
    trainer.forward_backward(micro, trainer.batches.loss_tokens(0))
    sequences = len(micro) * trainer.cfg.train.micro_batch
    assert trainer.model.execution.router_loss.grad_scale == pytest.approx(1.0 / sequences)


def _net(**model):
    cfg = tiny_config(model={**SHARED, **model})
    net = Transformer(cfg.model, Topology.single())
    init_parameters(net, seed=3)
    return net


def test_the_layers_are_the_dense_mlp_and_the_moe_with_their_parameters():
    """Layer 0 (dense_layers) has the dense model's MLP and names; layer 1's shared expert and gate
    are dense parameters (never split over ep), the gate's gradient summed over tp as the router's."""
    net = _net()
    assert type(net.layers["0"].mlp) is MLP and net.layers["0"].mlp.w1.weight.shape == (128, 64)
    moe = net.layers["1"].mlp
    assert moe.shared.w1.weight.shape == (32, 64) and moe.shared.w2.weight.shape == (64, 32)
    assert spec_of(moe.shared.w1.weight)[0].shard_dim == 0 and spec_of(moe.shared.w2.weight)[0].shard_dim == 1
    gate = spec_of(moe.shared_gate.weight)[0]
    assert gate.full_shape == (1, 64) and gate.grad_split_over_tp and gate.shard_dim is None
    assert not any(spec_of(p)[0].expert_split for p in moe.shared.parameters())


def test_the_output_is_the_chosen_experts_by_their_probabilities_plus_the_gated_shared_expert():
    """normalize_expert_weights=false: each of a token's top-2 experts weighted by its softmax
    probability itself (the two sum to less than one); plus sigmoid(x w_g) times the shared SwiGLU."""
    moe = _net().layers["1"].mlp
    x = torch.randn(1, 5, 64, generator=torch.Generator().manual_seed(1))
    silu = F.silu
    with torch.no_grad():
        y = moe(x)[0]
        probs = torch.softmax(x[0] @ moe.router.weight.t(), dim=-1)
        weights, chosen = probs.topk(2, dim=-1)
        assert (weights.sum(-1) < 0.99).all()
        w1, w3, w2 = moe.experts.w1, moe.experts.w3, moe.experts.w2
        s1, s3, s2 = moe.shared.w1.weight, moe.shared.w3.weight, moe.shared.w2.weight
        for t in range(5):
            xt = x[0, t]
            routed = sum(weights[t, j] * (w2[e] @ (silu(w1[e] @ xt) * (w3[e] @ xt))) for j, e in enumerate(chosen[t].tolist()))
            shared = torch.sigmoid(moe.shared_gate.weight @ xt) * (s2 @ (silu(s1 @ xt) * (s3 @ xt)))
            torch.testing.assert_close(y[t], routed + shared, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("key,value", [("shared_expert_ffn_hidden", 64), ("shared_expert_gate", False),
                                       ("dense_layers", [1])])
def test_a_checkpoint_of_another_moe_shape_is_refused_by_name(key, value):
    saved = {"model": dataclasses.asdict(tiny_config(model=SHARED).model)}
    with pytest.raises(CheckpointError, match=rf"model\.{key} = "):
        check_model(saved, tiny_config(model={**SHARED, key: value}).model, Path("ckpt"))
