"""How a mixture-of-experts router's logits pick and weigh a token's k experts (docs/design.md
"Mixture of experts"): Mixtral's and the Qwens' softmax top-k, DeepSeek-V3's (GLM-4.5's)
sigmoid scores, group-limited choice and routed scaling factor, as transformers'
DeepseekV3TopkRouter computes them, and DeepSeek-V2's softmax group-limited choice
(group_limited_greedy), as its DeepseekV2TopkRouter does.

logits = x W^T: softmax's in the activations' dtype, cast to fp32 after (as ever); sigmoid's in
fp32 from the input and weight as they are (`router_logits`: transformers' F.linear(h.float(),
W.float())), so in bf16 a token's picks are transformers' where W holds the same values: a bf16
checkpoint's. tetrad's W is the model dtype's (bf16 training keeps fp32 masters in the optimizer
alone), where transformers keeps the gate fp32 (_keep_in_fp32_modules_strict): a W with bits below
bf16's (a fine-tune's masters, an fp32 checkpoint's) routes on its bf16 rounding here, not exactly
as transformers' fp32 gate would.
scores = softmax(logits) or sigmoid(logits) (model.router_score), in fp32. The k experts are the
k largest of scores + expert_bias (DeepSeek-V3's auxiliary-loss-free bias picks but weighs
nothing; no gradient through the choice). With model.expert_groups = G > 1 the experts are G
equal groups in index order, and a token picks among the expert_groups_per_token groups of the
highest group score, the sum of the group's model.expert_group_score_top = n largest scores +
bias: n = 2 DeepSeek-V3's (torchtitan's), n = 1 DeepSeek-V2's (its group's best expert), n =
k / expert_groups_per_token Megatron-Core's. The weights are the picked scores, over their sum +
1e-20 where normalize_expert_weights (DeepSeek-V3's denominator; a softmax's top-k sum is at
least 1/E, to which 1e-20 adds nothing in fp32), times model.expert_weight_scale (DeepSeek's
routed_scaling_factor).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# DeepSeek-V3's (and Megatron-Core's, torchtitan's) guard on a sum of sigmoid scores
EPS = 1e-20


class _Fp32Linear(torch.autograd.Function):
    """x W^T in fp32 from x and W in their own dtypes; keeps them as they are (no fp32 copy of x
    for backward: it casts there) and gives their gradients back in their dtypes."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return F.linear(x.float(), weight.float())

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
        grad_w = grad.t().matmul(x.float()).to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_x, grad_w


def router_logits(x: torch.Tensor, weight: torch.Tensor, score: str) -> torch.Tensor:
    """The router's logits [n, E]: softmax's F.linear in x's dtype; sigmoid's in fp32 (`_Fp32Linear`)."""
    return F.linear(x, weight) if score == "softmax" else _Fp32Linear.apply(x, weight)


def router_scores(logits: torch.Tensor, score: str) -> torch.Tensor:
    """The router's scores [n, E] in fp32: softmax or sigmoid of its logits."""
    logits = logits.float()
    return torch.softmax(logits, dim=-1) if score == "softmax" else torch.sigmoid(logits)


def pick_experts(scores: torch.Tensor, bias: torch.Tensor, k: int, groups: int = 1, kept: int = 1,
                 group_top: int = 2) -> torch.Tensor:
    """Each token's k experts [n, k]: the k largest of scores + bias among the `kept` of `groups`
    groups with the largest sums of their `group_top` best (all of them at groups = 1). A zero bias
    and one group pick as scores.topk does, bit for bit: scores + 0 is scores."""
    choice = scores.detach() + bias
    if groups > 1:
        n, e = choice.shape
        grouped = choice.view(n, groups, e // groups)
        best = grouped.topk(group_top, dim=-1)[0].sum(dim=-1)  # [n, groups]
        dropped = torch.ones_like(best, dtype=torch.bool).scatter_(1, best.topk(kept, dim=-1)[1], False)
        choice = grouped.masked_fill(dropped.unsqueeze(-1), float("-inf")).view(n, e)
    return choice.topk(k, dim=-1)[1]


def expert_weights(scores: torch.Tensor, chosen: torch.Tensor, normalize: bool, scale: float) -> torch.Tensor:
    """The chosen experts' weights [n, k], fp32: their scores (not the bias), over their sum where
    `normalize`, times `scale`."""
    weights = scores.gather(-1, chosen)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + EPS)
    return weights if scale == 1 else weights * scale


def balance_probs(scores: torch.Tensor, score: str) -> torch.Tensor:
    """Each token's distribution over the experts that the load-balancing loss averages: the
    softmax itself; sigmoid scores over their sum (+ EPS), as Megatron-Core and torchtitan take them."""
    return scores if score == "softmax" else scores / (scores.sum(dim=-1, keepdim=True) + EPS)
