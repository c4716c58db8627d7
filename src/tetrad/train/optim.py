"""AdamW, the learning-rate schedules, and gradient clipping by the true global norm."""

from __future__ import annotations

import math

import torch

from tetrad.config import TrainConfig
from tetrad.device import FUSED_OPTIMIZER_DEVICES
from tetrad.dist.layout import GRAD, WEIGHT_SPLIT_DIMS
from tetrad.model.sharding import spec_of


def adamw(decay: list[torch.Tensor], no_decay: list[torch.Tensor], cfg: TrainConfig) -> torch.optim.AdamW:
    """tetrad's AdamW (betas 0.9, 0.95, as Megatron and Llama use), weight decay on `decay` only."""
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # torch's fused kernel (one per step, not a loop over tensors) wherever it exists, the CPU included.
    fused = all(p.device.type in FUSED_OPTIMIZER_DEVICES for p in decay + no_decay)
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8,
                             fused=fused)


def build_optimizer(params: list[torch.nn.Parameter], cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW on whole parameters; weight decay on matrices only (not on norms, biases), as
    Megatron and nanoGPT do."""
    return adamw([p for p in params if p.ndim >= 2], [p for p in params if p.ndim < 2], cfg)


def lr_at(step: int, cfg: TrainConfig) -> float:
    """The learning rate of 0-based `step` under `lr_schedule`: a linear warmup to lr over
    `warmup` steps, then
    - cosine / linear: decay from lr (first step after warmup) to lr * min_lr_ratio (last step);
    - constant: lr;
    - wsd (warmup-stable-decay): lr until the last `decay_fraction` of the steps, then a linear
      decay reaching lr * min_lr_ratio at the last step (its first decay step is already below lr).
    """
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    floor = cfg.lr * cfg.min_lr_ratio
    last = cfg.steps - 1
    if cfg.lr_schedule == "constant":
        return cfg.lr
    if cfg.lr_schedule == "wsd":
        decay_steps = max(1, round(cfg.decay_fraction * cfg.steps))
        progress = (step - (cfg.steps - decay_steps) + 1) / decay_steps
    else:
        progress = (step - cfg.warmup) / max(1, last - cfg.warmup)
    progress = min(1.0, max(0.0, progress))
    if cfg.lr_schedule == "cosine":
        return floor + 0.5 * (cfg.lr - floor) * (1 + math.cos(math.pi * progress))
    return floor + (cfg.lr - floor) * (1 - progress)


def global_grad_norm(pieces: list[tuple[torch.Tensor, torch.nn.Parameter]], topo,
                     dp_sharded: bool = False) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, as one device would compute it.

    `pieces` are (gradient tensor, the parameter it belongs to): whole gradients, or this rank's
    slices of them when `dp_sharded` (ZeRO: each dp x cp rank holds a disjoint part, summed over
    dp x cp). Shards of a tp-split parameter are summed over tp; a replicated parameter is
    counted on tp rank 0 only; pipeline stages hold different parameters, so their sums add over pp.
    """
    sq = torch.zeros((), dtype=torch.float32, device=topo.device)
    for grad, p in pieces:
        _, _, parts = spec_of(p)
        if parts > 1 or topo.tp_rank == 0:
            sq += grad.detach().float().pow(2).sum()
    for group in ((GRAD,) if dp_sharded else ()) + WEIGHT_SPLIT_DIMS:
        topo.comm.all_reduce(sq, group)
    return sq.sqrt()


def clip_gradients(pieces: list[tuple[torch.Tensor, torch.nn.Parameter]], max_norm: float, topo,
                   grads: list[torch.Tensor], dp_sharded: bool = False, loss_scale: float = 1.0) -> float:
    """Scale `grads` (what the optimizer will read) so the global norm of `pieces` is at most
    max_norm (0 disables); returns the norm. Gradients of a loss multiplied by `loss_scale` (fp16)
    are divided by it in the same pass, and the norm returned is the unscaled one."""
    norm = global_grad_norm(pieces, topo, dp_sharded) / loss_scale
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0) / loss_scale
        torch._foreach_mul_(grads, scale)
    elif loss_scale != 1.0:
        torch._foreach_mul_(grads, 1.0 / loss_scale)
    return float(norm)
