"""Tensor-parallel layers (Megatron-style). With tp = 1 each is a plain linear or embedding.

Column-parallel linears split the output features over the tp group and row-parallel linears
the input features, so an attention or MLP block needs one all-reduce forward and one backward.
The communication lives in the small autograd Functions at the top (the f/g pair).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tetrad.model.sharding import new_param


class _CopyToTP(torch.autograd.Function):
    """f: identity forward, all-reduce of the input gradient backward."""

    @staticmethod
    def forward(ctx, x, topo):
        ctx.topo = topo
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        ctx.topo.comm.all_reduce(grad, "tp")
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, topo):
        x = x.contiguous()
        topo.comm.all_reduce(x, "tp")
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, topo) -> torch.Tensor:
    return _CopyToTP.apply(x, topo) if topo.tp_size > 1 else x


def reduce_from_tp(x: torch.Tensor, topo) -> torch.Tensor:
    return _ReduceFromTP.apply(x, topo) if topo.tp_size > 1 else x


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, topo) -> torch.Tensor:
    """x W_local^T for a weight split by output rows (also the tied head: the embedding's weight)."""
    return F.linear(copy_to_tp(x, topo), weight)


class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T, W split by output rows; the output stays split over tp."""

    def __init__(self, in_features: int, out_features: int, topo, *, std: float = 0.02, pad_to: int | None = None):
        super().__init__()
        self.topo = topo
        self.weight = new_param((out_features, in_features), shard_dim=0, parts=topo.tp_size,
                                index=topo.tp_rank, pad_to=pad_to, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return column_parallel_linear(x, self.weight, self.topo)


class RowParallelLinear(nn.Module):
    """y = sum over tp of x_local W_local^T, W split by input columns; the output is complete."""

    def __init__(self, in_features: int, out_features: int, topo, *, std: float = 0.02):
        super().__init__()
        self.topo = topo
        self.weight = new_param((out_features, in_features), shard_dim=1, parts=topo.tp_size,
                                index=topo.tp_rank, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_tp(F.linear(x, self.weight), self.topo)


class VocabParallelEmbedding(nn.Module):
    """Rows of the (padded) vocabulary split over tp; each rank looks up the tokens it owns."""

    def __init__(self, vocab_size: int, dim: int, topo, *, std: float = 0.02):
        super().__init__()
        self.topo = topo
        self.weight = new_param((vocab_size, dim), shard_dim=0, parts=topo.tp_size, index=topo.tp_rank,
                                pad_to=topo.tp_size, std=std)
        self.rows = self.weight.shape[0]
        self.start = topo.tp_rank * self.rows

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if self.topo.tp_size == 1:
            return F.embedding(tokens, self.weight)
        local = tokens - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.topo)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary: max, sum-exp and the target logit are
    reduced over tp, so the full logits never exist on one rank."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_size, topo):
        rows = logits.shape[-1]
        start = topo.tp_rank * rows
        logits = logits.float()
        # Padding rows beyond the true vocabulary never win and carry no probability.
        valid = torch.arange(start, start + rows, device=logits.device) < vocab_size
        logits = logits.masked_fill(~valid, float("-inf"))
        local_max = logits.max(dim=-1).values
        topo.comm.all_reduce(local_max, "tp", op=torch.distributed.ReduceOp.MAX)
        shifted = logits - local_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        local = labels - start
        mine = (local >= 0) & (local < rows)
        target = torch.gather(shifted, -1, local.clamp(0, rows - 1).unsqueeze(-1)).squeeze(-1)
        target = target.masked_fill(~mine, 0.0)
        topo.comm.all_reduce(sum_exp, "tp")
        topo.comm.all_reduce(target, "tp")
        loss = sum_exp.log() - target
        ctx.save_for_backward(exp.div_(sum_exp.unsqueeze(-1)), local.clamp(0, rows - 1), mine)
        return loss

    @staticmethod
    def backward(ctx, grad):
        probs, local, mine = ctx.saved_tensors
        grad_logits = probs
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -mine.unsqueeze(-1).to(probs.dtype))
        return grad_logits * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, topo) -> torch.Tensor:
    """Per-token loss, fp32, from this rank's slice of the (padded) vocabulary."""
    if topo.tp_size == 1:
        return F.cross_entropy(logits[..., :vocab_size].float().flatten(0, -2), labels.flatten(),
                               reduction="none").view(labels.shape)
    return _VocabParallelCrossEntropy.apply(logits, labels, vocab_size, topo)
