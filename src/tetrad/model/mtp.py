"""Multi-token prediction (model.mtp_layers = D > 0; DeepSeek-V3 sec. 2.2): D sequential modules
after the main layers, on the last pipeline stage. Depth k (1..D) at position i reads h^{k-1}_i (h^0:
the main model's output, the last layer's after the final norm, as Megatron-Core, vLLM and SGLang feed
it: the Hub's DeepSeek-V3 and GLM-4.5 depths were trained on it) and the embedding of the token k
ahead, t_{i+k}:

    h^k = block_k(eh_proj([enorm_k(embed(t_{i+k})), hnorm_k(h^{k-1}_i)]))   (the embedding first)
    Loss_k = sum over counted i of CE(head(norm_k(h^k_i)), t_{i+k+1})

with the model's own embedding and head, and the main layers' RoPE and document mask. The depths'
losses are not the model's output: the step's loss and val_loss stay the main LM loss. Their
gradient is injected in backward (as RouterLoss's): each Loss_k gets grad_scale * mtp_loss_weight /
(D * loss_tokens) (MTPLoss.grad_scale, the trainer's), so the objective is
main / N + mtp_loss_weight / D * sum_k Loss_k / N, N the step's global loss_tokens, in every layout.

The targets (`pack_targets`) are made from the whole window before context-parallel sharding: the
labels, then per depth the input tokens and labels rolled left by k, stacked on dim 1 ([b, 1 + 2D,
s]), so sharding the last dim shards them all alike and the last stage, which has no input tokens
of its own under pp > 1, gets them with the labels. A depth's last k positions have no target, nor,
under document masking, a position whose target's input token is in another document.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

from tetrad.config import ModelConfig
from tetrad.model.execution import Execution, MTPLoss
from tetrad.model.layers import IGNORED_LABEL, Norm, ReplicatedLinear


class MTPDepth(nn.Module):
    """One depth: its norms, the [embedding, hidden] projection and its transformer `block` (layer
    index n_layers + k, llama.Block's). eh_proj is replicated over tp as latent attention's down
    projections are (its gradient summed over tp under SP)."""

    def __init__(self, cfg: ModelConfig, ex: Execution, block: nn.Module):
        super().__init__()
        self.enorm, self.hnorm = Norm(cfg), Norm(cfg)
        self.eh_proj = ReplicatedLinear(2 * cfg.d_model, cfg.d_model, ex)
        self.block = block
        self.norm = Norm(cfg)

    def forward(self, h: torch.Tensor, e: torch.Tensor, rope, docs) -> torch.Tensor:
        return self.block(self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], dim=-1)), rope, docs=docs)


class MultiTokenPrediction(nn.ModuleList):
    """The D depths (`mtp.<k>`, k 0-based)."""

    def losses(self, h: torch.Tensor, ahead: list[tuple[torch.Tensor, torch.Tensor]], embed: Callable,
               token_loss: Callable, ropes: dict, docs: dict, state: MTPLoss) -> list[torch.Tensor]:
        """Each depth's summed token loss from h (the main model's normed output) and `ahead` (per depth,
        the input tokens and targets: `unpack_targets`); `embed(tokens)` and `token_loss(h, labels)`
        are the model's; `ropes` and `docs` by Block.local_rope and window, as the main layers take
        them. Records each depth's loss and counted targets (this rank's) in `state`."""
        sums = []
        for depth, (tokens, targets) in zip(self, ahead):
            block = depth.block
            h = depth(h, embed(tokens), ropes.get(block.local_rope), docs[block.attn.window])
            sums.append(token_loss(depth.norm(h), targets))
        counts = torch.stack([(targets != IGNORED_LABEL).sum() for _, targets in ahead]).to(sums[0])
        state.add(torch.stack([torch.stack(sums).detach(), counts]))
        return sums


class _InjectGradient(torch.autograd.Function):
    """The main loss passes through; each depth's summed loss gets `scale` as its gradient."""

    @staticmethod
    def forward(ctx, main, scale, *sums):
        ctx.scale, ctx.depths = scale, len(sums)
        return main.view_as(main)

    @staticmethod
    def backward(ctx, grad):
        return (grad, None, *[grad.new_full((), ctx.scale)] * ctx.depths)


def with_mtp_gradient(main: torch.Tensor, sums: list[torch.Tensor], state: MTPLoss) -> torch.Tensor:
    """`main`, through which backward also reaches the depths' losses at `state.grad_scale`."""
    return _InjectGradient.apply(main, state.grad_scale, *sums)


def pack_targets(inputs: torch.Tensor, labels: torch.Tensor, depths: int,
                 documents: torch.Tensor | None = None) -> torch.Tensor:
    """[b, 1 + 2D, s] int64 of whole windows (before cp sharding): the labels, then for each depth
    k the input tokens k ahead (`inputs` rolled left by k; 0 where past the window) and its
    targets (`labels` rolled left by k; IGNORED_LABEL past the window and, given each token's
    document id `documents` [b, s], where position i + k is in another document than i)."""
    channels = [labels.long()]
    for k in range(1, depths + 1):
        tokens, targets = inputs.long().roll(-k, -1), labels.long().roll(-k, -1)
        tokens[..., -k:] = 0
        targets[..., -k:] = IGNORED_LABEL
        if documents is not None:
            targets.masked_fill_(documents != documents.roll(-k, -1), IGNORED_LABEL)
        channels += [tokens, targets]
    return torch.stack(channels, dim=1)


def unpack_targets(labels: torch.Tensor) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """`pack_targets`' (a shard of it): the labels, and each depth's (input tokens, targets)."""
    ahead = labels[:, 1:]
    return labels[:, 0], [(ahead[:, 2 * k], ahead[:, 2 * k + 1]) for k in range(ahead.shape[1] // 2)]


def step_sums(state: MTPLoss, depths: int, like: torch.Tensor, counted: bool) -> torch.Tensor:
    """[2D]: this rank's depths' summed losses then counted targets since the last take, for the
    step's all-reduce; zeros where not `counted` (tp ranks but 0, as the loss) or where none ran
    (off the last stage)."""
    seen = state.take()
    if seen is None or not counted:
        return like.new_zeros(2 * depths)
    return seen.to(like).reshape(-1)


def mean_losses(sums: list[float]) -> list[float]:
    """metrics' mtp_loss: each depth's mean token loss, from `step_sums` summed over the job."""
    depths = len(sums) // 2
    return [loss / max(count, 1.0) for loss, count in zip(sums[:depths], sums[depths:])]
