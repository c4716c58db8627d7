"""How the model runs on its topology: the training run's execution choices, owned by the model.

The topology says where a rank sits and which groups it talks over; these say what the layers do
with that: how attention uses the cp dimension, whether tp also splits the residual stream along
the sequence, and whether backward is split into its input- and weight-gradient halves
(zero-bubble schedules). Every layer of one model reads the same `Execution`.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Callable

import torch


# Gradient accumulation fusion (Megatron's `gradient_accumulation_fusion`): the data-parallel
# side may give a linear's weight a callable attribute of this name, `sink(a, b)`, which writes
# or adds the product a @ b (the weight gradient dy^T x) straight into the weight's fp32 gradient
# buffer; autograd then gets None for the weight (no separate dW tensor, no copy or add of it into
# the buffer) and still runs the weight's post-accumulate hooks (in zero-bubble's BW, outside
# autograd, its GRAD_LANDING does what they do).
GRAD_SINK = "grad_sink"


# Zero-bubble's BW hands each weight gradient over outside autograd: the data-parallel side gives
# every weight whose gradient a split backward defers a callable attribute of this name,
# `land(grad)`, which takes the gradient of one backward (None where the weight's sink wrote it)
# into its bucket and counts its arrival, as autograd's accumulator and the weight's
# post-accumulate hook (the reducer's) do for a gradient made inside autograd.
GRAD_LANDING = "grad_landing"


def deliver(sink: Callable | None, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """The weight gradient a @ b for autograd, or None where the weight's sink took it. Layers
    take the sink from the weight in forward: the weight that `saved_tensors` gives back in
    backward is a new tensor object (under saved-tensor hooks), without the attribute."""
    if sink is None:
        return a.matmul(b)
    sink(a, b)
    return None


def landing(weight: torch.Tensor) -> Callable | None:
    """Where BW puts `weight`'s gradient (taken in forward, as the sink): its GRAD_LANDING, or,
    without one (no reducer), `weight.grad`, accumulated as autograd does; None for a frozen weight."""
    if not weight.requires_grad:
        return None
    return getattr(weight, GRAD_LANDING, None) or functools.partial(_accumulate, weight)


def _accumulate(weight: torch.Tensor, grad: torch.Tensor) -> None:
    if weight.grad is None:
        weight.grad = grad
    else:
        weight.grad += grad


class DeferredWeightGrads:
    """Zero-bubble's split backward (one per model, in its Execution): while `collecting()` is
    open, linear layers queue their weight-gradient matmuls instead of computing them, and the
    backward yields input gradients only (BI); `apply(queue)` later computes the queued matmuls
    and lands them (BW), so BI + BW does one backward's work."""

    def __init__(self, hold: Callable[[torch.Tensor], object] | None = None):
        self._queue: list | None = None
        # An activation meter's (train/memory.py): the queued inputs and output gradients live
        # outside autograd until BW, and `hold(t)` keeps one counted while its handle lives.
        self.hold = hold

    @contextlib.contextmanager
    def collecting(self):
        """Queue the weight gradients made inside; yields the queue for `apply`."""
        self._queue = queue = []
        try:
            yield queue
        finally:
            self._queue = None

    @property
    def collecting_now(self) -> bool:
        """Inside `collecting()`: a backward now is BI."""
        return self._queue is not None

    @staticmethod
    def apply(queue: list) -> None:
        # Layer by layer, in BI's order, each weight gradient lands (`landing`: the reducer's
        # bucket, which may start reducing) before the next layer's are computed, so a chunk's
        # gradients never all exist at once. No autograd: a backward call per layer to hand them
        # over cost ~0.1 ms each, 3 of BW's 17 ms a micro-batch in bench_pp's zb row.
        with torch.no_grad():
            for i, (lands, compute, _) in enumerate(queue):
                for land, grad in zip(lands, compute()):
                    if land is not None:
                        land(grad)
                queue[i] = None  # its inputs and output gradients go now, not after the whole BW

    def grads(self, lands: tuple, grads: tuple, x: torch.Tensor, sinks: tuple, in_bi: bool = False) -> list:
        """dW_i = dy_i^T x for each output gradient dy_i: now, for autograd to accumulate (None
        where the weight's sink, `sinks[i]`, took it), or queued while collecting (None for now)
        for BW to hand to `lands[i]` (each weight's `landing`, taken in forward).
        `in_bi`: now even while collecting (the head's: its dy is the vocabulary-sized logits'
        gradient, which a queue would keep alive until BW)."""
        def compute():
            flat = x.reshape(-1, x.shape[-1])
            return [deliver(sink, g.reshape(-1, g.shape[-1]).t(), flat) for sink, g in zip(sinks, grads)]
        if self._queue is None or in_bi:
            return compute()
        held = [self.hold(t) for t in (x, *grads)] if self.hold else []
        self._queue.append((lands, compute, held))
        return [None] * len(grads)


def run_eagerly(fn: Callable, *args):
    """`fn(*args)`, never traced by torch.compile: for the autograd Functions that communicate
    (tp's f/g, cp's ring and all-to-all: their collectives go through tetrad's Comm, which counts
    and times them), zero-bubble's linear (its backward queues work for later) and dropout's
    tp-shared mask (torch.compile draws from its own generator). Inside a compiled block each
    call is a clean graph break: the regions between (norms, projections, RoPE, attention,
    SwiGLU, residuals) are compiled graphs. Outside torch.compile, a plain call: the
    torch.compiler.disable wrapper cost ~60 us a call with the caches cold after a GEMM (0.5 ms
    of a 25 ms F per micro-batch in bench_pp's 1f1b row, where torch's F runs F.linear)."""
    return _run_eagerly_untraced(fn, *args) if torch.compiler.is_compiling() else fn(*args)


# torch's own lazy form of torch.compiler.disable (it loads torch._dynamo at the first compiled
# call): the decorator itself would load it here, 2.6 s of every process's start, compiled or not.
@torch._disable_dynamo
def _run_eagerly_untraced(fn: Callable, *args):
    return fn(*args)


class InjectedLoss:
    """A loss no layer returns, whose gradient is injected in backward: `grad_scale`, set by the
    trainer each step, and `seen`, the detached sums recorded since the last `take()`."""

    def __init__(self):
        self.grad_scale = 0.0
        self.seen: torch.Tensor | None = None

    def add(self, aux: torch.Tensor) -> None:
        self.seen = aux if self.seen is None else self.seen + aux

    def take(self) -> torch.Tensor | None:
        seen, self.seen = self.seen, None
        return seen


class RouterLoss(InjectedLoss):
    """The mixture-of-experts load-balancing loss of one model's steps (model/moe.py). No layer
    returns it: each injects its gradient in backward (Megatron-Core's MoEAuxLossAutoScaler), so
    it joins the training loss on every pipeline stage, none of which but the last has a loss.
    `grad_scale`: what the trainer scales a layer's summed per-sequence loss by for backward,
    router_aux_loss / (MoE layers x the global batch's sequences), times fp16's loss scale, set each
    step; `seen`: those sums as backward met them (once per micro-batch and layer, recompute or
    not; evaluation, without backward, adds none) until `take()`."""


class MTPLoss(InjectedLoss):
    """Multi-token prediction's depth losses (model/mtp.py), joined to the training objective in
    backward, not to the returned loss. `grad_scale`: the gradient of a depth's summed token loss,
    mtp_loss_weight / (mtp_layers x the step's loss_tokens), times fp16's loss scale, set each step;
    `seen`: [2, depths], the summed losses and counted targets of the training forwards (this
    rank's shard) until `take()`."""


@dataclass
class Execution:
    """cp_algo: "ring" or "alltoall" (model/attention.py). sequence_parallel: tp also splits
    the residual stream along the sequence (model/mappings.py; only meaningful with tp > 1);
    sp_regather: its column-parallel linears gather their input again in backward instead of
    keeping it gathered.
    split_backward: linear layers route their weight gradients through `weight_grads`, which
    the pipeline executor opens (BI) and applies (BW). router_loss: mixture-of-experts layers'
    load-balancing loss (RouterLoss); mtp_loss: multi-token prediction's (MTPLoss). loss_chunk: the
    head and its cross-entropy run fused, this many tokens at a time (model/chunked_loss.py; 0:
    the head's logits of a whole micro-batch at once). op_recompute:
    blocks run under per-op recompute (`selective-op`, set by llama.set_execution), which may keep
    a row linear's output: tp's all-reduce of it then runs into a copy (mappings._ReduceFromTP)."""

    cp_algo: str = "ring"
    sequence_parallel: bool = False
    sp_regather: bool = False
    loss_chunk: int = 0
    split_backward: bool = False
    op_recompute: bool = False
    weight_grads: DeferredWeightGrads = field(default_factory=DeferredWeightGrads)
    router_loss: RouterLoss = field(default_factory=RouterLoss)
    mtp_loss: MTPLoss = field(default_factory=MTPLoss)
