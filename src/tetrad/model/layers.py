"""Tensor-parallel layers (Megatron-style): column-, row- and vocab-parallel linears and
embedding, dropout on the residual stream, and vocab-parallel cross-entropy; and the norms, which
every tp rank holds whole. With tp = 1 each is a plain linear or embedding. Their communication is
model/mappings.py's.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tetrad.config import ModelConfig
from tetrad.model.execution import Execution, run_eagerly
from tetrad.model.mappings import column_parallel_linear, column_parallel_linears, linear, reduce_tp_output
from tetrad.model.sharding import new_param

IGNORED_LABEL = -100  # a label the loss leaves out (torch's cross_entropy default ignore_index)


# ----------------------------------------------------------------------------- modules

class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T (+ b_local), W and the bias split by output rows; the output stays
    split over tp. The bias (Qwen2's q, k and v projections) starts at zero."""

    def __init__(self, in_features: int, out_features: int, topo, ex: Execution, *, std: float = 0.02,
                 pad_to: int | None = None, grad_in_bi: bool = False, bias: bool = False):
        super().__init__()
        self.topo, self.ex = topo, ex
        self.grad_in_bi = grad_in_bi  # a split backward makes its weight gradient in BI, not BW
        self.weight = new_param((out_features, in_features), shard_dim=0, parts=topo.tp_size,
                                index=topo.tp_rank, pad_to=pad_to, std=std)
        self.bias = new_param((out_features,), shard_dim=0, parts=topo.tp_size, index=topo.tp_rank,
                              pad_to=pad_to, init="zeros") if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_bias(column_parallel_linear(x, self.weight, self.topo, self.ex, self.grad_in_bi))

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        """y + the bias, where there is one (a fused input collective gives the product alone)."""
        return y if self.bias is None else y + self.bias


class Norm(nn.Module):
    """RMSNorm, LayerNorm (with bias) or Gemma's RMSNorm (fp32, times 1 + weight: its weight an
    offset, zero at init) over the last dimension (d_model, or `width`); replicated over tp.
    `per_head`: qk-norm's, over each head, its gradient split over tp (ParamSpec). `eps`: its own
    epsilon (model.norm_eps where None)."""

    def __init__(self, cfg: ModelConfig, width: int | None = None, per_head: bool = False, eps: float | None = None):
        super().__init__()
        width = width or cfg.d_model
        self.kind, self.eps = cfg.norm, cfg.norm_eps if eps is None else eps
        init = "zeros" if cfg.norm == "gemma_rmsnorm" else "ones"
        self.weight = new_param((width,), init=init, grad_split_over_tp=per_head)
        self.bias = new_param((width,), init="zeros", grad_split_over_tp=per_head) if cfg.norm == "layernorm" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "rmsnorm":
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        if self.kind == "gemma_rmsnorm":  # HF's Gemma3RMSNorm: (x * w) rounded once, not x rounded, then * w
            return (F.rms_norm(x.float(), (x.shape[-1],), None, self.eps) * (1.0 + self.weight.float())).type_as(x)
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class RowParallelLinear(nn.Module):
    """y = sum over tp of x_local W_local^T, W split by input columns; the output is complete
    (under SP: complete for this rank's sequence chunk)."""

    def __init__(self, in_features: int, out_features: int, topo, ex: Execution, *, std: float = 0.02):
        super().__init__()
        self.topo, self.ex = topo, ex
        self.weight = new_param((out_features, in_features), shard_dim=1, parts=topo.tp_size,
                                index=topo.tp_rank, std=std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_tp_output(linear(x, self.weight, self.ex), self.topo, self.ex)


class ReplicatedLinear(nn.Module):
    """y = x W^T, W [out, in] whole on every tp rank, no communication (latent attention's down
    projections); its gradient, where each tp rank's covers part of the tokens (SP), is summed over
    tp as the norms' are (parallel/data/finalize.py). Its weight gradient goes through `linear`,
    as the parallel linears' do (sinks, zero-bubble's BW)."""

    def __init__(self, in_features: int, out_features: int, ex: Execution):
        super().__init__()
        self.ex = ex
        self.weight = new_param((out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.ex)


class MLP(nn.Module):
    """SwiGLU (w2(silu(w1 x) * w3 x)), GeGLU (Gemma's: gelu's tanh form for silu) or GELU
    (w2(gelu(w1 x))); column then row parallel. `width`: its hidden width (ffn_hidden where
    None; an MoE layer's shared expert has its own, model/moe.py)."""

    def __init__(self, cfg, topo, ex: Execution, out_std: float, width: int | None = None):
        super().__init__()
        width = width or cfg.ffn_hidden
        self.kind = cfg.mlp
        self.w1 = ColumnParallelLinear(cfg.d_model, width, topo, ex)
        self.w3 = ColumnParallelLinear(cfg.d_model, width, topo, ex) if cfg.gated_mlp else None
        self.w2 = RowParallelLinear(width, cfg.d_model, topo, ex, std=out_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            gate, up = column_parallel_linears(x, [self.w1.weight, self.w3.weight], self.w1.topo, self.w1.ex)
            return self.w2(activation(self.kind, gate) * up)
        return self.w2(activation(self.kind, self.w1(x)))

    def partial(self, total: torch.Tensor) -> torch.Tensor:
        """This tp rank's partial output from `total`, the whole local sequence (mappings.tp_input's),
        with no collective: the caller sums it with others before its one reduce_tp_output."""
        ex = self.w1.ex
        hidden = activation(self.kind, linear(total, self.w1.weight, ex))
        if self.w3 is not None:
            hidden = hidden * linear(total, self.w3.weight, ex)
        return linear(hidden, self.w2.weight, ex)


def activation(kind: str, a: torch.Tensor) -> torch.Tensor:
    """The MLP's nonlinearity (model.mlp): silu for swiglu, gelu's tanh form for geglu and gelu."""
    return F.silu(a) if kind == "swiglu" else F.gelu(a, approximate="tanh")


class VocabParallelEmbedding(nn.Module):
    """Rows of the (padded) vocabulary split over tp; each rank looks up the tokens it owns and
    the partial lookups are summed (under SP: reduce-scattered to this rank's sequence chunk)."""

    def __init__(self, vocab_size: int, dim: int, topo, ex: Execution, *, std: float = 0.02):
        super().__init__()
        self.topo, self.ex = topo, ex
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
        return reduce_tp_output(out, self.topo, self.ex)


class ResidualDropout(nn.Module):
    """Dropout on the residual stream, consistent with how tp holds it.

    Under SP (or tp = 1) each rank drops elements of its own tokens with its own generator (the
    trainer seeds every rank differently), as one device would with independent draws. Without
    SP the stream is replicated over tp and every tp rank must drop the same elements, or the
    replicas (and the replicated norm weights) drift apart: the mask then comes from a generator
    seeded the same on every tp rank, from a seed tp rank 0 draws at construction and broadcasts,
    and the step (DropoutSeeds). Masks are not a function of the token's position, so they differ
    from a single-process run's: dropout > 0 is reproducible per layout, not bitwise equal across
    layouts.
    """

    def __init__(self, p: float, topo, ex: Execution):
        super().__init__()
        self.p = p
        self.generator, self.seed = None, 0
        if topo.tp_size > 1 and not ex.sequence_parallel:
            seed = torch.randint(2**62, (1,), device=topo.device)  # explicit device: models are built on meta
            topo.comm.broadcast(seed, 0, "tp")
            self.seed = int(seed)
            self.generator = torch.Generator(device=topo.device).manual_seed(self.seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        if self.generator is None:
            return F.dropout(x, self.p)
        # Never compiled: torch.compile would draw the mask from its own generator.
        return run_eagerly(self._shared_mask_dropout, x)

    def _shared_mask_dropout(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.rand(x.shape, generator=self.generator, device=x.device) >= self.p
        return x * keep / (1 - self.p)


class DropoutSeeds:
    """The tp-shared generators of a model's ResidualDropout modules, seeded at each step from
    (the module's seed, the step): a resume continues with the masks of its step in any layout,
    bitwise in the same one, with no checkpoint state. A generator's state is per rank, so a
    checkpoint's could not follow a layout change, and one started again from its seed repeated
    the masks of the run's first steps."""

    GOLDEN = 0x9E3779B97F4A7C15  # 2^64 / the golden ratio: steps' seeds far apart

    def __init__(self, model: nn.Module):
        self.modules = [m for m in model.modules() if isinstance(m, ResidualDropout) and m.generator is not None]

    def at_step(self, step: int) -> None:
        for m in self.modules:
            m.generator.manual_seed((m.seed + self.GOLDEN * (step + 1)) % 2**63)


# ----------------------------------------------------------------------------- loss

class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split by vocabulary: max, sum-exp and the target logit are
    reduced over tp, so the full logits never exist on one rank."""

    @staticmethod
    def forward(ctx, logits, labels, vocab_size, topo):
        rows = logits.shape[-1]
        start = topo.tp_rank * rows
        # One fp32 working copy, then everything in place on it (as Megatron does): the logits,
        # shifted by their max, their exponentials, finally the probabilities kept for backward.
        # The logits are the largest activation of a step; each extra copy would cost as much.
        x = logits.float() if logits.dtype != torch.float32 else logits.clone()
        # Padding rows beyond the true vocabulary never win and carry no probability.
        valid = torch.arange(start, start + rows, device=logits.device) < vocab_size
        x.masked_fill_(~valid, float("-inf"))
        local_max = x.max(dim=-1).values
        topo.comm.all_reduce(local_max, "tp", op=torch.distributed.ReduceOp.MAX)
        x.sub_(local_max.unsqueeze(-1))
        local = labels - start
        mine = (local >= 0) & (local < rows)
        target = torch.gather(x, -1, local.clamp(0, rows - 1).unsqueeze(-1)).squeeze(-1)
        target = target.masked_fill(~mine, 0.0)
        sum_exp = x.exp_().sum(dim=-1)
        topo.comm.all_reduce(sum_exp, "tp")
        topo.comm.all_reduce(target, "tp")
        loss = sum_exp.log() - target
        ctx.save_for_backward(x.div_(sum_exp.unsqueeze(-1)), local.clamp(0, rows - 1), mine)
        return loss

    @staticmethod
    def backward(ctx, grad):
        probs, local, mine = ctx.saved_tensors
        grad_logits = probs
        grad_logits.scatter_add_(-1, local.unsqueeze(-1), -mine.unsqueeze(-1).to(probs.dtype))
        return grad_logits * grad.unsqueeze(-1), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, vocab_size: int, topo) -> torch.Tensor:
    """Per-token loss, fp32, from this rank's slice of the (padded) vocabulary; zero, with a zero
    gradient, at IGNORED_LABEL (a prompt token under supervised fine-tuning)."""
    if topo.tp_size == 1:
        return F.cross_entropy(logits[..., :vocab_size].float().flatten(0, -2), labels.flatten(),
                               ignore_index=IGNORED_LABEL, reduction="none").view(labels.shape)
    return _VocabParallelCrossEntropy.apply(logits, labels, vocab_size, topo).masked_fill(labels == IGNORED_LABEL, 0.0)
