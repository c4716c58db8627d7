"""The communication of tensor parallelism (Megatron-style), as small autograd Functions: the
f/g pair and, under sequence parallelism, their all-gather / reduce-scatter forms.

Column-parallel linears split the output features over the tp group and row-parallel linears
the input features (model/layers.py), so an attention or MLP block needs one collective forward
and one backward.

Without sequence parallelism (SP) the residual stream [b, s, h] is replicated over tp: a column
linear's input gradient is all-reduced in backward (f) and a row linear's output is all-reduced
in forward (g). With SP (`Execution.sequence_parallel`, model/execution.py) the residual stream
is split along the sequence, [b, s/tp, h], so norms and dropout work on 1/tp of the tokens and
their activations take 1/tp of the memory: a column linear all-gathers its input along the
sequence (its backward reduce-scatters the input gradient) and a row linear reduce-scatters its
output (its backward all-gathers the gradient). Each all-reduce becomes an all-gather plus a
reduce-scatter of the same logical size, so the traffic is unchanged.

Every collective goes through `topo.comm`, so it is counted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tetrad.model.execution import GRAD_SINK, Execution, landing, run_eagerly


# ----------------------------------------------------------------------------- sequence layout
# `Comm` gathers and scatters along dim 0; the sequence is dim 1 of [b, s, h]. These two helpers
# move the tp-many sequence chunks to and from dim 0 with one copy.

def _chunks_first(x: torch.Tensor, tp: int) -> torch.Tensor:
    """[b, s, *rest] -> [tp * b, s / tp, *rest]: chunk i of the sequence in rows i*b..(i+1)*b."""
    b, s = x.shape[:2]
    if s % tp:
        raise ValueError(f"sequence parallelism needs the local sequence length {s} divisible by tp={tp}")
    return x.reshape(b, tp, s // tp, *x.shape[2:]).transpose(0, 1).reshape(tp * b, s // tp, *x.shape[2:])


def _chunks_back(x: torch.Tensor, tp: int) -> torch.Tensor:
    """Inverse of `_chunks_first`: [tp * b, s / tp, *rest] -> [b, s, *rest]."""
    b, sl = x.shape[0] // tp, x.shape[1]
    return x.reshape(tp, b, sl, *x.shape[2:]).transpose(0, 1).reshape(b, tp * sl, *x.shape[2:])


def _all_gather_sequence(x: torch.Tensor, topo, async_op: bool = False):
    """Every rank's sequence chunk, concatenated: [b, s/tp, h] -> ([tp*b, s/tp, h] buffer, pending)."""
    out = x.new_empty((topo.tp_size * x.shape[0], *x.shape[1:]))
    return out, topo.comm.all_gather(out, x.contiguous(), "tp", async_op=async_op)


def _reduce_scatter_sequence(x: torch.Tensor, topo, async_op: bool = False):
    """Sum over tp, keep this rank's sequence chunk: [b, s, h] -> ([b, s/tp, h], pending)."""
    chunks = _chunks_first(x, topo.tp_size)
    out = x.new_empty((x.shape[0], *chunks.shape[1:]))
    return out, topo.comm.reduce_scatter(out, chunks, "tp", async_op=async_op)


def gather_sequence(x: torch.Tensor, topo) -> torch.Tensor:
    out, _ = _all_gather_sequence(x, topo)
    return _chunks_back(out, topo.tp_size)


def scatter_sequence(x: torch.Tensor, topo) -> torch.Tensor:
    out, _ = _reduce_scatter_sequence(x, topo)
    return out


def sequence_shard(t: torch.Tensor, topo, ex: Execution, dim: int = 0) -> torch.Tensor:
    """This rank's slice of a replicated per-token tensor (e.g. positions) under SP, no
    communication; the tensor itself when SP is off."""
    if not (ex.sequence_parallel and topo.tp_size > 1):
        return t
    return t.chunk(topo.tp_size, dim=dim)[topo.tp_rank]


# ----------------------------------------------------------------------------- autograd Functions

class _ReduceFromTP(torch.autograd.Function):
    """g: all-reduce forward, identity backward (a row linear's partial sums, no SP). In place, but
    into a copy under per-op recompute (`into_copy`): it may keep the partial sums (the row linear's
    output, llama.py) and hand that very tensor back to its recompute, which reduces it again where
    the layer's recompute runs past this reduction (a sandwich norm after it); reduced in place, it
    was summed twice (Gemma-style blocks at tp2 0.05 off one process's loss in 4 steps)."""

    @staticmethod
    def forward(ctx, x, topo, into_copy):
        x = x.clone(memory_format=torch.contiguous_format) if into_copy else x.contiguous()
        topo.comm.all_reduce(x, "tp")
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    """g under SP: reduce-scatter along the sequence forward, all-gather of the gradient backward."""

    @staticmethod
    def forward(ctx, x, topo):
        ctx.topo = topo
        return scatter_sequence(x, topo)

    @staticmethod
    def backward(ctx, grad):
        return gather_sequence(grad, ctx.topo), None


class _CopyToTP(torch.autograd.Function):
    """f alone: identity forward, all-reduce of the gradient backward (an input every tp rank reads
    whole, whose gradient each rank makes in part)."""

    @staticmethod
    def forward(ctx, x, topo):
        ctx.topo = topo
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        ctx.topo.comm.all_reduce(grad, "tp")
        return grad, None


class _GatherFromSequence(torch.autograd.Function):
    """f under SP alone: all-gather along the sequence forward, reduce-scatter of the gradient backward."""

    @staticmethod
    def forward(ctx, x, topo):
        ctx.topo = topo
        return gather_sequence(x, topo)

    @staticmethod
    def backward(ctx, grad):
        return scatter_sequence(grad, ctx.topo), None


class _Linear(torch.autograd.Function):
    """y = x W^T whose weight gradient dy^T x goes through `weight_grads` (model/execution.py's
    DeferredWeightGrads): computed now, or queued for a zero-bubble schedule's BW, and in both
    cases written by the weight's `sink` where it has one (GRAD_SINK: gradient accumulation
    fusion; autograd gets None for it); a queued one BW hands to `land` (model/execution.py's
    `landing`). Used instead of F.linear only then: a Python autograd Function costs ~22 us per
    linear per step on CPU."""

    @staticmethod
    def forward(ctx, x, weight, weight_grads, sink, land, in_bi):
        ctx.weight_grads, ctx.sink, ctx.land, ctx.in_bi = weight_grads, sink, land, in_bi
        ctx.save_for_backward(x, weight)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_weight, = ctx.weight_grads.grads((ctx.land,), (grad,), x, (ctx.sink,), ctx.in_bi)
        return grad.matmul(weight), grad_weight, None, None, None, None


def linear(x: torch.Tensor, weight: torch.Tensor, ex: Execution, in_bi: bool = False) -> torch.Tensor:
    """x W^T with no communication: F.linear, or `_Linear` when backward is split or the weight's
    gradient goes to a sink (never inside torch.compile: a custom Function there would break its
    graph; a compiled region keeps F.linear)."""
    if ex.split_backward:
        return run_eagerly(_Linear.apply, x, weight, ex.weight_grads, getattr(weight, GRAD_SINK, None),
                           landing(weight), in_bi)
    sink = None if torch.compiler.is_compiling() else getattr(weight, GRAD_SINK, None)
    if sink is not None:
        return _Linear.apply(x, weight, ex.weight_grads, sink, None, in_bi)
    return F.linear(x, weight)


class _ColumnParallelMatmul(torch.autograd.Function):
    """y_i = X W_i^T for column-parallel weights W_i that read the same input (q/k/v, or the two
    SwiGLU gates), so they share one input collective each way.

    Forward: X is the input itself (replicated) or, under SP, its all-gather along the sequence.
    Backward (Megatron's overlap): dX = sum_i dy_i W_i is computed first and its all-reduce (or,
    under SP, reduce-scatter) is started non-blocking; the weight gradients dW_i = dy_i^T X, which
    need no communication, are computed while it is in flight, and only then is it waited for.
    Under SP the gathered X is kept for backward (as torch's SequenceParallel does), or with
    `Execution.sp_regather` only this rank's chunk is, and backward gathers X again (Megatron-LM,
    Korthikanti et al.): started first, behind the dX GEMMs. That trades (tp-1)/tp of b*s*h
    activation memory per column-parallel input for one more all-gather in backward.
    """

    @staticmethod
    def forward(ctx, x, topo, ex, in_bi, *weights):
        ctx.topo, ctx.ex, ctx.in_bi = topo, ex, in_bi
        ctx.sinks = tuple(getattr(w, GRAD_SINK, None) for w in weights)  # saved_tensors' weights lack it
        ctx.lands = tuple(landing(w) if ex.split_backward else None for w in weights)  # for BW
        total = gather_sequence(x, topo) if ex.sequence_parallel else x
        ctx.save_for_backward(x if ex.sequence_parallel and ex.sp_regather else total, *weights)
        return tuple(F.linear(total, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        saved, *weights = ctx.saved_tensors
        topo, ex = ctx.topo, ctx.ex
        regather = ex.sequence_parallel and ex.sp_regather
        if regather:
            gathered, gathering = _all_gather_sequence(saved, topo, async_op=True)
        grad_input = grads[0].matmul(weights[0])
        for g, w in zip(grads[1:], weights[1:]):
            grad_input.add_(g.matmul(w))
        total = saved
        if regather:
            gathering.wait()
            total = _chunks_back(gathered, topo.tp_size)
        if ex.sequence_parallel:
            grad_input, pending = _reduce_scatter_sequence(grad_input, topo, async_op=True)
        else:
            pending = topo.comm.all_reduce(grad_input, "tp", async_op=True)
        grad_weights = ex.weight_grads.grads(ctx.lands, grads, total, ctx.sinks, ctx.in_bi)
        pending.wait()
        return (grad_input, None, None, None, *grad_weights)


# ----------------------------------------------------------------------------- functional forms

def column_parallel_linears(x: torch.Tensor, weights: list[torch.Tensor], topo, ex: Execution,
                            in_bi: bool = False) -> tuple[torch.Tensor, ...]:
    """x W_i^T for each weight split by output rows, sharing the input collective (see
    `_ColumnParallelMatmul`). x is [b, s, h], or [b, s/tp, h] under SP; outputs cover the whole
    (local) sequence and this rank's output features."""
    if topo.tp_size == 1 and not _sinks_a_group(weights):
        return tuple([linear(x, w, ex, in_bi) for w in weights])  # a list: torch.compile breaks cleanly in it
    return run_eagerly(_ColumnParallelMatmul.apply, x, topo, ex, in_bi, *weights)


def _sinks_a_group(weights: list[torch.Tensor]) -> bool:
    """Whether weights that share their input go through `_ColumnParallelMatmul` at tp = 1: where
    one of them has a GRAD_SINK, and so would take a Python autograd Function of its own anyway
    (`linear`). One Function for the group costs less than one per sunk weight plus autograd's sum
    of the input gradients: each Function's host code runs after its GEMM, with the caches cold
    (~45 us a call on a 2-core CPU; q/k/v and the SwiGLU gates at d_model 256: 0.3-0.5 ms of a
    40 ms backward per micro-batch)."""
    return len(weights) > 1 and not torch.compiler.is_compiling() and \
        any(getattr(w, GRAD_SINK, None) is not None for w in weights)


def column_parallel_linear(x: torch.Tensor, weight: torch.Tensor, topo, ex: Execution, in_bi: bool = False) -> torch.Tensor:
    """x W_local^T for a weight split by output rows (also the tied head: the embedding's weight);
    `in_bi`: a split backward makes its weight gradient in BI (DeferredWeightGrads.grads)."""
    return column_parallel_linears(x, [weight], topo, ex, in_bi)[0]


def reduce_tp_output(x: torch.Tensor, topo, ex: Execution) -> torch.Tensor:
    """Complete a tp-partial activation [b, s, h]: all-reduce it, or under SP reduce-scatter it to
    this rank's sequence chunk [b, s/tp, h]."""
    if topo.tp_size == 1:
        return x
    if ex.sequence_parallel:
        return run_eagerly(_ReduceScatterToSequence.apply, x, topo)
    return run_eagerly(_ReduceFromTP.apply, x, topo, ex.op_recompute)


def tp_input(x: torch.Tensor, topo, ex: Execution) -> torch.Tensor:
    """The whole (local) sequence every tp rank reads, from the residual stream [b, s, h] (under SP
    [b, s/tp, h]: all-gathered); in backward the tp ranks' partial gradients are summed (f). For
    layers whose input feeds more than linears (model/moe.py's router and experts)."""
    if topo.tp_size == 1:
        return x
    return run_eagerly(_GatherFromSequence.apply if ex.sequence_parallel else _CopyToTP.apply, x, topo)


# ----------------------------------------------------------------------------- expert parallelism

class _AllToAll(torch.autograd.Function):
    """Rows [n, ...] to the ranks of `group`, `sent[r]` of them to rank r, `received[r]` coming
    from it; backward sends the gradient the reverse way (received and sent swapped)."""

    @staticmethod
    def forward(ctx, x, sent, received, topo, group):
        ctx.sent, ctx.received, ctx.topo, ctx.group = sent, received, topo, group
        return _exchange(x, sent, received, topo, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.received, ctx.sent, ctx.topo, ctx.group), None, None, None, None


def _exchange(x: torch.Tensor, sent: list[int], received: list[int], topo, group: str) -> torch.Tensor:
    out = x.new_empty((sum(received), *x.shape[1:]))
    topo.comm.all_to_all(out, x.contiguous(), group, output_splits=received, input_splits=sent)
    return out


def all_to_all(x: torch.Tensor, sent: list[int], received: list[int], topo, group: str) -> torch.Tensor:
    """Rows of x (grouped by destination, `sent[r]` to rank r of `group`) exchanged over `group`:
    the rows every rank sent this one, `received[r]` from rank r, in rank order. Differentiable
    (MoE's dispatch and combine over "ep", model/moe.py)."""
    return _AllToAll.apply(x, sent, received, topo, group)
