"""DeepSeek's routing (model/routing.py: model.router_score, expert_weight_scale, expert_groups,
expert_groups_per_token, expert_group_score_top): the picks and weights are transformers'
DeepseekV3TopkRouter's, and DeepseekV2TopkRouter's group_limited_greedy ones, a group's score is
the sum of its best two (or its best), a layer weighs its experts by them (the shared expert
unscaled), the router's gradient follows the weights but at top-1 renormalised, the
load-balancing loss takes the sigmoid's scores normalised per token; the idle setting and the
Megatron-LM, torchtitan and Hugging Face names (tests/test_moe.py: the layouts, the refusals)."""

import pytest
import torch
import torch.nn.functional as F

from conftest import tiny_config
from tetrad.config import idle_settings, load_config
from tetrad.config.aliases import places_of
from tetrad.dist.topology import Topology
from tetrad.model.execution import Execution
from tetrad.model.layers import activation
from tetrad.model.moe import MoE
from tetrad.model.routing import expert_weights, pick_experts, router_logits, router_scores

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter  # noqa: E402
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter  # noqa: E402

DEEPSEEK = {"router_score": "sigmoid", "expert_groups": 4, "expert_groups_per_token": 2, "expert_weight_scale": 2.5}


def _router(k: int, groups: int, kept: int, normalize: bool, scale: float, seed: int) -> DeepseekV3TopkRouter:
    """transformers' router over 8 experts of width 16, its weight and its e_score_correction_bias random."""
    cfg = transformers.DeepseekV3Config(hidden_size=16, n_routed_experts=8, num_experts_per_tok=k, n_group=groups,
                                        topk_group=kept, norm_topk_prob=normalize, routed_scaling_factor=scale)
    router, gen = DeepseekV3TopkRouter(cfg), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
        router.e_score_correction_bias.copy_(0.1 * torch.randn(8, generator=gen))
    return router


@pytest.mark.parametrize("k,groups,kept,normalize,scale", [(3, 4, 2, True, 2.5), (2, 2, 1, False, 1.0),
                                                           (1, 1, 1, False, 16.0), (4, 1, 1, True, 1.0)])
def test_the_picks_and_weights_are_transformers_deepseek_v3s(k, groups, kept, normalize, scale):
    router = _router(k, groups, kept, normalize, scale, seed=k + groups)
    x = torch.randn(256, 16, generator=torch.Generator().manual_seed(1))
    _, ref_weights, ref_chosen = router(x)
    scores = router_scores(router_logits(x, router.weight, "sigmoid"), "sigmoid")
    chosen = pick_experts(scores, router.e_score_correction_bias, k, groups, kept)
    weights = expert_weights(scores, chosen, normalize, scale)
    ref_chosen, order = ref_chosen.sort(dim=-1)  # transformers' top-k is unsorted
    chosen, mine = chosen.sort(dim=-1)
    assert torch.equal(chosen, ref_chosen)
    torch.testing.assert_close(weights.gather(-1, mine), ref_weights.gather(-1, order), rtol=1e-6, atol=0)
    if groups > 1:  # the groups limited the picks: without them some token picks otherwise
        assert not torch.equal(pick_experts(scores, router.e_score_correction_bias, k).sort(dim=-1)[0], chosen)


@pytest.mark.parametrize("experts,k,groups,kept,scale", [(8, 3, 4, 2, 2.0), (16, 4, 8, 3, 1.0)])
def test_the_picks_and_weights_are_transformers_deepseek_v2s_group_limited_greedy(experts, k, groups, kept, scale):
    """Softmax scores, groups scored by their best expert (expert_group_score_top=1), the weights the
    picked scores times the scale, not renormalised; the groups by their best two pick otherwise."""
    cfg = transformers.DeepseekV2Config(hidden_size=16, num_attention_heads=4, n_routed_experts=experts,
                                        num_experts_per_tok=k, n_group=groups, topk_group=kept,
                                        topk_method="group_limited_greedy", routed_scaling_factor=scale)
    router, gen = DeepseekV2TopkRouter(cfg), torch.Generator().manual_seed(experts)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=gen))
    x = torch.randn(256, 16, generator=gen)
    _, ref_weights, ref_chosen = router(x)
    scores = router_scores(router_logits(x, router.weight, "softmax"), "softmax")
    chosen = pick_experts(scores, torch.zeros(experts), k, groups, kept, group_top=1)
    weights = expert_weights(scores, chosen, False, scale)
    ref_chosen, order = ref_chosen.sort(dim=-1)  # transformers' top-k is unsorted
    chosen, mine = chosen.sort(dim=-1)
    assert torch.equal(chosen, ref_chosen)
    torch.testing.assert_close(weights.gather(-1, mine), ref_weights.gather(-1, order), rtol=1e-6, atol=0)
    for other in (pick_experts(scores, torch.zeros(experts), k), pick_experts(scores, torch.zeros(experts), k, groups, kept)):
        assert not torch.equal(other.sort(dim=-1)[0], chosen)


def test_a_bf16_sigmoid_router_picks_from_fp32_logits_as_transformers_does():
    """bf16 input and weight: the sigmoid's logits are transformers' F.linear(h.float(), W.float()),
    with its picks (logits in bf16 pick otherwise for some tokens), and backward gives what autograd
    gives through that reference, in bf16; softmax's logits stay F.linear's in bf16."""
    gen = torch.Generator().manual_seed(3)
    x, w = torch.randn(4096, 64, generator=gen).bfloat16(), torch.randn(16, 64, generator=gen).bfloat16()
    bias = 0.1 * torch.randn(16, generator=gen)
    ours, theirs = [(x.clone().requires_grad_(), w.clone().requires_grad_()) for _ in range(2)]
    scores = router_scores(router_logits(*ours, "sigmoid"), "sigmoid")
    ref = torch.sigmoid(F.linear(theirs[0].float(), theirs[1].float()))
    picks = pick_experts(scores, bias, 4, 4, 2)
    assert torch.equal(picks, pick_experts(ref, bias, 4, 4, 2))
    assert not torch.equal(picks, pick_experts(router_scores(F.linear(x, w), "sigmoid"), bias, 4, 4, 2))
    dy = torch.randn(4096, 16, generator=gen)
    (scores * dy).sum().backward()
    (ref * dy).sum().backward()
    for mine, want in zip(ours, theirs):
        assert mine.grad.dtype == torch.bfloat16 and torch.equal(mine.grad, want.grad)
    assert torch.equal(router_logits(x, w, "softmax"), F.linear(x, w))


def test_a_groups_score_is_the_sum_of_its_best_two_or_its_best():
    """Expert 0 is the best, but its group's two sum to less than the other group's: top-1 within
    one group of two picks expert 2, where a group's maximum (expert_group_score_top=1) picks expert 0."""
    scores = torch.tensor([[0.5, 0.0, 0.35, 0.3]])
    assert pick_experts(scores, torch.zeros(4), 1, groups=2, kept=1).tolist() == [[2]]
    assert pick_experts(scores, torch.zeros(4), 1, groups=2, kept=1, group_top=1).tolist() == [[0]]
    assert pick_experts(scores, torch.tensor([0.0, 0.2, 0.0, 0.0]), 1, groups=2, kept=1).tolist() == [[0]]


def _layer(**model) -> MoE:
    cfg = load_config(overrides={"model": {"d_model": 16, "n_heads": 2, "n_kv_heads": 2, "ffn_hidden": 32,
                                           "n_experts": 8, "experts_per_token": 3, **model}}).model
    moe, gen = MoE(cfg, Topology.single(), Execution(), 0.02), torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return moe


def test_a_layer_weighs_its_experts_by_the_deepseek_weights_and_adds_the_shared_expert_unscaled():
    moe = _layer(**DEEPSEEK, shared_expert_ffn_hidden=16)
    moe.expert_bias.copy_(0.1 * torch.randn(8, generator=torch.Generator().manual_seed(2)))
    x = torch.randn(1, 12, 16, generator=torch.Generator().manual_seed(1))
    scores = torch.sigmoid(x[0] @ moe.router.weight.t())
    chosen = pick_experts(scores, moe.expert_bias, 3, 4, 2)
    weights = scores.gather(-1, chosen)
    weights = 2.5 * weights / weights.sum(dim=-1, keepdim=True)
    w1, w3, w2 = moe.experts.w1, moe.experts.w3, moe.experts.w2
    s1, s3, s2 = moe.shared.w1.weight, moe.shared.w3.weight, moe.shared.w2.weight

    def mlp(a, b, c, row):
        return c @ (activation("swiglu", a @ row) * (b @ row))
    with torch.no_grad():
        want = torch.stack([sum(weights[t, j] * mlp(w1[e], w3[e], w2[e], x[0, t]) for j, e in enumerate(chosen[t]))
                            + mlp(s1, s3, s2, x[0, t]) for t in range(12)])
        torch.testing.assert_close(moe(x)[0], want, rtol=1e-4, atol=1e-3)  # outputs of ~1e3 (weights of std 1)


@pytest.mark.parametrize("k,normalize,reached", [(1, True, False), (1, False, True), (2, True, True)])
def test_the_router_learns_through_the_sigmoid_weights_but_at_top1_renormalised(k, normalize, reached):
    """Without the load-balancing loss's gradient (scale 0) the router's is the weights': exactly
    zero at top-1 renormalised (w / w = 1, the output as it is, the router kept in the graph as
    softmax's is), nonzero elsewhere, the top-1 unnormalised sigmoid score included."""
    moe = _layer(router_score="sigmoid", experts_per_token=k, normalize_expert_weights=normalize,
                 expert_weight_scale=2.0)
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    moe(x).square().sum().backward()
    grad = moe.router.weight.grad
    assert grad is not None and bool(grad.any()) == reached


def test_the_balancing_loss_takes_the_sigmoid_scores_normalised_per_token():
    """Its value is E * sum_e f_e P_e over each sequence, P_e the mean of s_e / sum s (Megatron-Core's
    and torchtitan's form), f_e the picked experts' share."""
    moe = _layer(router_score="sigmoid", expert_groups=2, expert_groups_per_token=1)
    moe.ex.router_loss.grad_scale = 1.0
    x = torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(1))
    (moe(x) * 0).sum().backward()
    scores = torch.sigmoid(x @ moe.router.weight.t())
    probs = scores / scores.sum(dim=-1, keepdim=True)
    expected = 0
    for s in range(2):
        chosen = pick_experts(scores[s], moe.expert_bias, 3, 2, 1)
        f = torch.bincount(chosen.flatten(), minlength=8).float() / (8 * 3)
        expected = expected + 8 * (f * probs[s].mean(dim=0)).sum()
    torch.testing.assert_close(moe.ex.router_loss.take(), expected.detach())


def test_groups_that_every_token_keeps_are_noted():
    notes = idle_settings(tiny_config(model={"n_experts": 8, "expert_groups": 4, "expert_groups_per_token": 4}))
    assert any("model.expert_groups=4 limits nothing" in n for n in notes)


@pytest.mark.parametrize("theirs,ours", [
    ("moe_router_score_function", "router_score"), ("score_func", "router_score"), ("scoring_func", "router_score"),
    ("moe_router_topk_scaling_factor", "expert_weight_scale"), ("route_scale", "expert_weight_scale"),
    ("routed_scaling_factor", "expert_weight_scale"), ("moe_router_num_groups", "expert_groups"),
    ("num_expert_groups", "expert_groups"), ("n_group", "expert_groups"),
    ("moe_router_group_topk", "expert_groups_per_token"), ("num_limited_groups", "expert_groups_per_token"),
    ("topk_group", "expert_groups_per_token"), ("route_norm", "normalize_expert_weights")])
def test_megatron_s_torchtitan_s_and_hf_s_names_point_at_ours(theirs, ours):
    assert places_of(theirs) == [f"model.{ours}"]
