"""The output head and its cross-entropy fused, a chunk of tokens at a time (`train.loss_chunk_tokens`).

Unfused, the head writes the logits of every token of a micro-batch, [tokens, vocab/tp] in the
model's dtype, the cross-entropy takes an fp32 copy and keeps its softmax for backward: at an 8k
sequence and a 128k vocabulary 2 + 4 GiB held, plus the gradient's copy in backward, the largest
activation of a large-vocabulary model. Fused (as Liger's and Cut Cross-Entropy's linear
cross-entropy, here with tensor parallelism), the logits exist for one chunk of tokens at a time:
forward keeps 14 bytes a token (its fp32 log-sum-exp, its label as this rank's int64 row, two
masks) beside the head's input, which it keeps anyway, and backward makes each chunk's logits
again (one more head GEMM) for its softmax, input and weight gradients. The loss and gradients
are the unfused ones, summed in another order.

Under tp the vocabulary is split: each rank reduces its own slice to one log-sum-exp and target
logit per token, and three all-reduces of [tokens] floats (max, sum, target: the unfused path's
three, in its order) make the whole vocabulary's, so no collective runs per chunk. The input
gradient is partial over tp and reduced (all-reduce, or under SP reduce-scatter) as a
column-parallel linear's is; the head's weight gradient goes to its GRAD_SINK where it has one,
and is made in backward (under zero-bubble in BI, as the unfused head's: `in_bi`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tetrad.model.execution import GRAD_SINK, Execution, run_eagerly
from tetrad.model.layers import IGNORED_LABEL
from tetrad.model.mappings import _reduce_scatter_sequence, gather_sequence


def chunked_head_loss(x: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, vocab_size: int, topo,
                      ex: Execution, chunk: int) -> torch.Tensor:
    """The summed token loss (fp32) of normed hidden states `x` [b, s, d] (under SP this rank's
    sequence chunk) through the head `weight` (this rank's vocabulary rows, padding beyond
    `vocab_size` included) against `labels` [b, s], `chunk` tokens of logits at a time; zero, with
    a zero gradient, at IGNORED_LABEL."""
    return run_eagerly(_ChunkedHeadLoss.apply, x, weight, labels, vocab_size, topo, ex, chunk)


def _chunk_logits(x: torch.Tensor, weight: torch.Tensor, start: int, vocab_size: int) -> torch.Tensor:
    """fp32 logits of the rows `x` over this rank's vocabulary rows (the first at `start`), made
    in the model's dtype as the unfused head's; the padding rows beyond the vocabulary at -inf
    (they never win and carry no probability)."""
    z = F.linear(x, weight).float()
    padded = start + weight.shape[0] - vocab_size
    if padded > 0:
        z[:, -padded:] = float("-inf")
    return z


def _spans(n: int, chunk: int):
    return [(i, min(i + chunk, n)) for i in range(0, n, chunk)]


class _ChunkedHeadLoss(torch.autograd.Function):

    @staticmethod
    def forward(ctx, x, weight, labels, vocab_size, topo, ex, chunk):
        ctx.topo, ctx.ex, ctx.chunk, ctx.vocab_size = topo, ex, chunk, vocab_size
        ctx.sink = getattr(weight, GRAD_SINK, None)  # saved_tensors' weight lacks it
        total = gather_sequence(x, topo) if ex.sequence_parallel else x
        flat = total.reshape(-1, total.shape[-1])
        rows = weight.shape[0]
        start = topo.tp_rank * rows
        local = labels.reshape(-1) - start
        mine = (local >= 0) & (local < rows)  # IGNORED_LABEL is negative: never this rank's
        local = local.clamp(0, rows - 1)
        lse = flat.new_empty(flat.shape[0], dtype=torch.float32)
        target = torch.empty_like(lse)
        for a, b in _spans(flat.shape[0], chunk):
            z = _chunk_logits(flat[a:b], weight, start, vocab_size)
            target[a:b] = z.gather(-1, local[a:b].unsqueeze(-1)).squeeze(-1)
            lse[a:b] = torch.logsumexp(z, dim=-1)
            del z  # before the next chunk's are made: one chunk's logits at a time
        target.masked_fill_(~mine, 0.0)
        if topo.tp_size > 1:  # log-sum-exp over the ranks' slices: max, then the sum of exp under it
            top = lse.clone()
            topo.comm.all_reduce(top, "tp", op=torch.distributed.ReduceOp.MAX)
            lse.sub_(top).exp_()
            topo.comm.all_reduce(lse, "tp")
            lse.log_().add_(top)
            topo.comm.all_reduce(target, "tp")
        counted = labels.reshape(-1) != IGNORED_LABEL
        ctx.save_for_backward(x if ex.sequence_parallel and ex.sp_regather else total, weight, lse, local,
                              mine, counted)
        return (lse - target).masked_fill_(~counted, 0.0).sum()

    @staticmethod
    def backward(ctx, grad):
        saved, weight, lse, local, mine, counted = ctx.saved_tensors
        topo, ex = ctx.topo, ctx.ex
        total = gather_sequence(saved, topo) if ex.sequence_parallel and ex.sp_regather else saved
        flat = total.reshape(-1, total.shape[-1])
        start = topo.tp_rank * weight.shape[0]
        scale = counted.to(torch.float32) * grad  # d loss / d (token loss)
        grad_flat = torch.empty_like(flat)
        grad_weight = None
        spans = _spans(flat.shape[0], ctx.chunk)
        several = len(spans) > 1
        weight_parts = []  # (logits' gradient, input rows) of the chunk the input's reduction overlaps
        for i, (a, b) in enumerate(spans):
            g = _logits_grad(flat[a:b], weight, start, ctx.vocab_size, lse[a:b], local[a:b], mine[a:b], scale[a:b])
            torch.mm(g, weight, out=grad_flat[a:b])
            if i == len(spans) - 1:
                weight_parts.append((g, flat[a:b]))
            else:
                grad_weight = _add_weight_grad(grad_weight, ctx.sink, g, flat[a:b], several)
            del g  # before the next chunk's logits are made
        grad_input = grad_flat.view_as(total)
        pending = None
        if topo.tp_size > 1:
            if ex.sequence_parallel:
                grad_input, pending = _reduce_scatter_sequence(grad_input, topo, async_op=True)
            else:
                pending = topo.comm.all_reduce(grad_input, "tp", async_op=True)
        for g, rows in weight_parts:  # behind the input gradient's reduction
            grad_weight = _add_weight_grad(grad_weight, ctx.sink, g, rows, several)
        if pending is not None:
            pending.wait()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_input, grad_weight, None, None, None, None, None


def _logits_grad(x, weight, start: int, vocab_size: int, lse, local, mine, scale) -> torch.Tensor:
    """The gradient of the token losses (times `scale`) with respect to the logits of the rows `x`,
    made again from `lse`, in the weight's dtype: the softmax less the one-hot of the labels this
    rank holds (`local` rows where `mine`). The fp32 logits die here, before the caller's GEMMs."""
    g = _chunk_logits(x, weight, start, vocab_size).sub_(lse.unsqueeze(-1)).exp_()
    g.scatter_add_(-1, local.unsqueeze(-1), -mine.unsqueeze(-1).to(g.dtype))
    return g.mul_(scale.unsqueeze(-1)).to(weight.dtype)


def _add_weight_grad(acc: torch.Tensor | None, sink, g: torch.Tensor, rows: torch.Tensor,
                     several: bool) -> torch.Tensor | None:
    """One chunk's weight gradient g^T rows: into the weight's sink (None back), or summed into
    `acc`, in fp32 across `several` chunks where the weight is 16-bit (cast back once at the end)."""
    if sink is not None:
        sink(g.t(), rows)
        return None
    part = g.t().matmul(rows)
    if acc is None:
        return part.float() if several else part
    return acc.add_(part)
