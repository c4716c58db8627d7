"""The mixture-of-experts MLP (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-MoE's and DeepSeek-V3's
layers): a router and `n_experts` experts of the model's `mlp` kind; each token goes to its
`experts_per_token` (k) experts, dropless (no capacity, no token dropped), picked and weighed from
the router's fp32 scores (softmax or sigmoid) as model/routing.py says: top-k of scores +
expert_bias (DeepSeek-V3's auxiliary-loss-free balancing, a buffer that train/expert_bias.py moves
from the counts each training micro-batch hands over in backward), optionally within the best
groups of experts, weighed by the scores alone (renormalised: normalize_expert_weights; scaled:
expert_weight_scale); a zero bias and one group pick as top-k of the scores.
Optionally a shared expert (shared_expert_ffn_hidden: a dense MLP every token goes through, its
output added to the routed experts'), scaled per token by sigmoid(x w_g) (shared_expert_gate,
Qwen2-MoE's).

Tensor parallelism splits every expert as the dense MLP is split: w1 and w3 [E, H, d] by their
rows (dim 1, column-parallel), w2 [E, d, H] by its columns (dim 2, row-parallel), so each tp rank
computes every expert on its slice of H and the partial outputs are summed (g: all-reduce, or
reduce-scatter under SP). The router's weight is replicated: each rank routes the whole (local)
sequence (`tp_input`: the residual stream, all-gathered under SP) identically. Its gradient is a
per-rank partial (the routing weights' gradient comes from each rank's partial expert outputs), so
it is summed over tp (ParamSpec.grad_split_over_tp, as qk-norm's); the load-balancing loss, which
every tp rank computes whole, injects 1/tp of its gradient on each, and f's all-reduce sums the
router's input gradient with the experts'. The shared expert is split as the dense MLP is and runs
on the same tp_input'd sequence (layers.MLP.partial); its partial output joins the experts' before
the one reduce_tp_output, so it costs no collective of its own; its gate's weight is replicated,
its gradient summed over tp as the router's. Neither is split over ep: dense parameters.

Expert parallelism (parallel.ep, docs/design.md "Expert parallelism"): ep rank r of an EP group
(ep consecutive dp ranks) holds experts [r E/ep, (r+1) E/ep) whole (ParamSpec.ep_block), still
split over tp. Each rank routes its own tokens, sends each assignment row to the rank holding its
expert (an all-to-all of the per-expert counts, then one of the rows, uneven), runs its experts on
the rows it received and sends the outputs back the same way (mappings.all_to_all, differentiable:
backward reverses both). The expert gradients are summed over the ranks holding the same experts
(EXPERT_GRAD), by expert buckets of their own (parallel/data/buffers.py).

Cost of this cut: one Python loop over the experts with the tokens sorted by expert, so E small
GEMMs each way, and one host read per layer and micro-batch (the experts' token counts: torch's
slices and the all-to-all's splits need them on the host), which stalls an accelerator's queue
there; grouped GEMM kernels are not here. Under torch.compile (train.compile) the routing runs
eagerly between the block's compiled regions, as tp's and cp's collectives do (MoE.forward). The
experts' weight gradients come from autograd in one backward (under zero-bubble's split
backward, in BI; no gradient accumulation fusion).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tetrad.config import ModelConfig
from tetrad.model.execution import Execution, RouterLoss, run_eagerly
from tetrad.dist.layout import EP
from tetrad.model.layers import MLP, activation
from tetrad.model.mappings import all_to_all, reduce_tp_output, tp_input
from tetrad.model.routing import balance_probs, expert_weights, pick_experts, router_logits, router_scores
from tetrad.model.sharding import new_param


class Router(nn.Module):
    """logits = x W^T, W [outputs, d_model], replicated over tp, its gradient summed over tp: the
    router's (an output per expert), and the shared expert's gate (one)."""

    def __init__(self, cfg: ModelConfig, outputs: int):
        super().__init__()
        self.weight = new_param((outputs, cfg.d_model), grad_split_over_tp=True)


class Experts(nn.Module):
    """This ep rank's experts' weights as one 3-D tensor each (no biases), split over tp like the
    dense MLP's."""

    def __init__(self, cfg: ModelConfig, topo, out_std: float):
        super().__init__()
        e, h, d, tp, rank = cfg.n_experts, cfg.expert_hidden, cfg.d_model, topo.tp_size, topo.tp_rank
        # A stand-in topology without expert parallelism (the planner's meta-device models) holds them all.
        block = (topo.ep_rank, topo.ep_size) if getattr(topo, "ep_size", 1) > 1 else (0, 1)
        self.kind = cfg.mlp
        self.w1 = new_param((e, h, d), shard_dim=1, parts=tp, index=rank, ep_block=block)
        self.w3 = new_param((e, h, d), shard_dim=1, parts=tp, index=rank, ep_block=block) if cfg.gated_mlp else None
        self.w2 = new_param((e, d, h), shard_dim=2, parts=tp, index=rank, std=out_std, ep_block=block)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [n, d]: the tokens sorted by expert, `counts[e]` of them for expert e; this rank's
        partial outputs [n, d]."""
        return _ExpertsFunction.apply(x, counts, self.kind, self.w1, self.w3, self.w2)


def _act_backward(kind: str, grad: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
    if kind == "swiglu":
        return torch.ops.aten.silu_backward(grad, a)
    return torch.ops.aten.gelu_backward(grad, a, approximate="tanh")


def _spans(counts: list[int]):
    """(expert, first row, end row) of each expert that got tokens."""
    start = 0
    for e, n in enumerate(counts):
        if n:
            yield e, start, start + n
        start += n


class _ExpertsFunction(torch.autograd.Function):
    """Each expert's MLP on its rows. One Function, so that the weight gradients are one [E, ...]
    tensor each, filled expert by expert: indexing a Parameter per expert under autograd would
    make a whole-sized zero gradient per expert and sum them (E times the weights' bytes)."""

    @staticmethod
    def forward(ctx, x, counts, kind, w1, w3, w2):
        ctx.counts, ctx.kind = counts, kind
        hidden = w1.shape[1]
        up = x.new_empty((x.shape[0], hidden))
        gate = x.new_empty((x.shape[0], hidden)) if w3 is not None else None
        out = x.new_empty((x.shape[0], w2.shape[1]))
        for e, lo, hi in _spans(counts):
            xe = x[lo:hi]
            up[lo:hi] = xe @ w1[e].t()
            h = activation(kind, up[lo:hi])
            if w3 is not None:
                gate[lo:hi] = xe @ w3[e].t()
                h = h * gate[lo:hi]
            out[lo:hi] = h @ w2[e].t()
        ctx.save_for_backward(x, up, gate, w1, w3, w2)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, up, gate, w1, w3, w2 = ctx.saved_tensors
        grad_x = torch.zeros_like(x)
        g1, g2 = torch.zeros_like(w1), torch.zeros_like(w2)
        g3 = torch.zeros_like(w3) if w3 is not None else None
        for e, lo, hi in _spans(ctx.counts):
            xe, gy, a = x[lo:hi], grad[lo:hi], up[lo:hi]
            act = activation(ctx.kind, a)
            h = act * gate[lo:hi] if w3 is not None else act
            g2[e] = gy.t() @ h
            gh = gy @ w2[e]
            if w3 is not None:
                gb = gh * act
                g3[e] = gb.t() @ xe
                grad_x[lo:hi] = gb @ w3[e]
                gh = gh * gate[lo:hi]
            ga = _act_backward(ctx.kind, gh, a)
            g1[e] = ga.t() @ xe
            grad_x[lo:hi] += ga @ w1[e]
        return grad_x, None, None, g1, g3, g2


class _RouterLossGradient(torch.autograd.Function):
    """Passes `y` through; in backward gives `aux` (this rank's part of a layer's summed
    per-sequence load-balancing loss) the gradient `router_loss.grad_scale / tp` and tells
    `router_loss` the value (RouterLoss: model/execution.py), and `moe` the micro-batch's expert
    counts where it takes them (MoE.add_counts): backward meets each micro-batch once, under any
    recompute or split backward, and evaluation runs none."""

    @staticmethod
    def forward(ctx, y, aux, router_loss: RouterLoss, tp: int, moe: "MoE", counts: torch.Tensor | None):
        ctx.router_loss, ctx.tp, ctx.aux, ctx.moe, ctx.counts = router_loss, tp, aux.detach(), moe, counts
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        ctx.router_loss.add(ctx.aux)
        if ctx.counts is not None:
            ctx.moe.add_counts(ctx.counts)
        return grad, ctx.aux.new_full((), ctx.router_loss.grad_scale / ctx.tp), None, None, None, None


class MoE(nn.Module):
    """The MoE MLP of a block (Block picks it where ModelConfig.moe_layer)."""

    def __init__(self, cfg: ModelConfig, topo, ex: Execution, out_std: float):
        super().__init__()
        self.topo, self.ex = topo, ex
        self.k, self.aux_coefficient = cfg.experts_per_token, cfg.router_aux_loss
        self.normalize, self.weighs = cfg.normalize_expert_weights, cfg.weighs_experts
        self.score, self.scale = cfg.router_score, cfg.expert_weight_scale
        self.groups, self.kept_groups = cfg.expert_groups, cfg.expert_groups_per_token
        self.group_top = cfg.expert_group_score_top
        self.router = Router(cfg, cfg.n_experts)
        self.experts = Experts(cfg, topo, out_std)
        width = cfg.shared_expert_ffn_hidden
        self.shared = MLP(cfg, topo, ex, out_std, width) if width else None
        self.shared_gate = Router(cfg, 1) if cfg.shared_expert_gate else None
        self.routing = False  # inside `_routed` (per-op recompute keeps its matmuls' outputs: llama.py)
        # DeepSeek-V3's expert bias: added to the scores to pick the top k, not to weigh them;
        # state, not a trained parameter (train/expert_bias.py moves it; checkpoints keep it). fp32.
        self.register_buffer("expert_bias", torch.zeros(cfg.n_experts))
        self.moves_bias = cfg.router_bias_update_rate > 0  # backward then hands the counts over
        self.step_counts: torch.Tensor | None = None  # this step's, summed over its micro-batches

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The routing (router, top-k, dispatch, experts, combine; the shared expert's gate) and the
        load-balancing loss run eagerly under torch.compile (`run_eagerly`): the experts' token
        counts change every call, and the loss's gradient reaches RouterLoss from backward; the
        shared expert is compiled. Per-op recompute (llama.py) keeps every matmul output of the
        routing (`routing`) outside its count: their number changes with the token counts."""
        total = tp_input(x, self.topo, self.ex)  # [b, s, d]: the whole local sequence
        b, s, d = total.shape
        y, gate, scores, chosen, counts = run_eagerly(self._routed, total.reshape(b * s, d))
        y = y.view(b, s, d)
        if self.shared is not None:  # its partial output (every tp rank computes the gate whole)
            shared = self.shared.partial(total)
            y = y + (shared if gate is None else shared * gate.view(b, s, 1))
        if torch.is_grad_enabled():
            y = run_eagerly(self._with_balance_loss, y, scores.view(b, s, -1), chosen.view(b, s * self.k), counts)
        return reduce_tp_output(y, self.topo, self.ex)

    def add_counts(self, counts: torch.Tensor) -> None:
        """Add a training micro-batch's expert counts [E] (int64) to the step's."""
        self.step_counts = counts if self.step_counts is None else self.step_counts + counts

    def take_counts(self) -> torch.Tensor:
        """The step's expert counts [E] (zeros where no micro-batch ran backward), and a fresh start."""
        counts, self.step_counts = self.step_counts, None
        return torch.zeros_like(self.expert_bias, dtype=torch.int64) if counts is None else counts

    def _routed(self, flat: torch.Tensor):
        """(the routed experts' weighted sum for each token of `flat` [n, d], the shared expert's
        gate sigmoid(x w_g) [n, 1] or None, the router's fp32 scores [n, E], each token's
        chosen experts [n*k]: token t's at t*k..t*k+k-1, the experts' counts [E], int64). The rows
        are sorted by expert, each expert runs on its own (over the EP group where it spreads
        them), and the outputs go back to token order to be summed: not by index_add into the
        tokens, whose backward would keep its [n*k, d] source (for its shape alone), a second
        copy of the experts' outputs."""
        self.routing = True
        try:
            scores = router_scores(router_logits(flat, self.router.weight, self.score), self.score)
            chosen = pick_experts(scores, self.expert_bias, self.k, self.groups, self.kept_groups, self.group_top)
            # top-1's w / w = 1: no gradient to the router through it (the quotient's, zero in exact
            # arithmetic, was rounding noise, which AdamW turns into steps of the router that differ by layout)
            weights = expert_weights(scores, chosen, self.normalize, self.scale) if self.weighs else None
            chosen = chosen.reshape(-1)
            order = chosen.argsort(stable=True)
            counts = torch.bincount(chosen, minlength=scores.shape[-1])
            rows = order // self.k  # the token of each assignment, in expert order
            if self.topo.size(EP) > 1:
                out = self._over_ep(flat[rows], counts)
            else:
                out = self.experts(flat[rows], counts.tolist())
            by_token = out[order.argsort()].view(-1, self.k, out.shape[-1])  # [n, k, d]
            if weights is None:  # the one weight w / w = 1, times the scale
                y = by_token[:, 0] if self.scale == 1 else by_token[:, 0] * self.scale
            else:
                y = (by_token * weights.to(flat.dtype).unsqueeze(-1)).sum(dim=1)
            gate = None if self.shared_gate is None else torch.sigmoid(F.linear(flat, self.shared_gate.weight))
            return y, gate, scores, chosen, counts
        finally:
            self.routing = False

    def _with_balance_loss(self, y: torch.Tensor, scores: torch.Tensor, chosen: torch.Tensor,
                           counts: torch.Tensor) -> torch.Tensor:
        """`y`, through the Function that gives the load-balancing loss its gradient in backward
        (and hands the expert counts over there, where the bias moves: moves_bias).
        Top-1 with normalized weights reaches the router through that loss alone: there it stays
        in the graph at coefficient 0 too, so that the router gets its gradient (zeros) in every
        backward, as the gradient buckets count on (parallel/data/lifecycle.py)."""
        aux = self._balance_loss(balance_probs(scores, self.score), chosen)
        attached = self.aux_coefficient or not self.weighs
        return _RouterLossGradient.apply(y, aux if attached else aux.detach(), self.ex.router_loss, self.topo.tp_size,
                                         self, counts if self.moves_bias else None)

    def _over_ep(self, routed: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The experts' outputs for `routed` [n*k, d] (the assignment rows in expert order,
        `counts` [E] per expert) when the experts are spread over the EP group: the counts
        exchanged (each rank learns how many rows of each of its experts every rank sends), the
        rows dispatched to their experts' ranks, run there expert-major, and combined back."""
        topo, ep = self.topo, self.topo.size(EP)
        local = counts.numel() // ep
        incoming = torch.empty_like(counts)  # [ep * local]: from each rank, its counts of my experts
        topo.comm.all_to_all(incoming, counts, EP)
        mine, theirs = torch.stack([counts, incoming]).view(2, ep, local).tolist()  # the layer's host read
        sent, received = [sum(c) for c in mine], [sum(c) for c in theirs]
        x = all_to_all(routed, sent, received, topo, EP)  # source-major, then expert
        expert = torch.arange(local, device=x.device).repeat(ep).repeat_interleave(incoming, output_size=x.shape[0])
        order = expert.argsort(stable=True)  # expert-major, sources in rank order within each
        y = self.experts(x[order], [sum(c[j] for c in theirs) for j in range(local)])
        return all_to_all(y[order.argsort()], received, sent, topo, EP)

    def _balance_loss(self, probs: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """This rank's part of the micro-batch's summed per-sequence loss E * sum_e f_e * P_e (f_e:
        the share of the sequence's T*k assignments expert e got; P_e: the mean of its probability,
        routing.balance_probs', over the sequence's T tokens). Under cp a sequence is split over the
        cp ranks: its counts are summed over them, and each rank adds E / (k T^2) * sum_e count_e *
        (its own sum of probs[e]), the sum over ranks being the sequence's loss, gradient included."""
        b, s, n_experts = probs.shape
        counts = torch.zeros((b, n_experts), dtype=probs.dtype, device=probs.device)
        counts.scatter_add_(1, chosen, torch.ones_like(chosen, dtype=probs.dtype))
        cp = self.topo.size("cp")
        if cp > 1:
            self.topo.comm.all_reduce(counts, "cp")
        tokens = s * cp
        return (counts * probs.sum(dim=1)).sum() * (n_experts / (self.k * tokens * tokens))


def expert_biases(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each MoE layer's expert_bias by the layer's name (`layers.3.mlp`: the same in every layout)."""
    return {name: m.expert_bias for name, m in model.named_modules() if isinstance(m, MoE)}


@torch.no_grad()
def set_expert_biases(model: nn.Module, stored: dict[str, torch.Tensor]) -> None:
    """Each MoE layer's expert_bias: `stored`'s (by layer name) where it holds the layer's, else zero
    (a fresh model, an HF folder's, a checkpoint saved before biases); fp32 on the layer's device
    whatever the weights' dtype, in fresh memory (a build on the meta device left none)."""
    for name, m in model.named_modules():
        if isinstance(m, MoE):
            device = m.router.weight.device
            value = stored.get(name)
            m.expert_bias = torch.zeros(m.expert_bias.shape, device=device) if value is None else \
                value.to(device, torch.float32, copy=True)
