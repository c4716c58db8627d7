"""The sums that complete a reduced gradient beyond the gradient group (Megatron-Core's
finalize_model_grads): the tied embedding over its two pipeline stages, and the tp-replicated
parameters over tp (under sequence parallelism, after a codec that mixes elements, and always
for qk-norm's weights, whose gradient each tp rank makes from its own heads).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tetrad.model.sharding import spec_of


def sum_tied(reduced: torch.Tensor, comm) -> None:
    """The embedding tied across pipeline stages: the embedding's and the head's gradient, the
    sum of both, on both stages (the "embed" group: first and last stage)."""
    comm.all_reduce(reduced, "embed")


def reduce_replicated(slices: list[tuple[torch.Tensor, nn.Parameter]], comm, average_over: int = 1) -> None:
    """The gradients of the tp-replicated parameters (norms) over tp, in one collective: summed
    under SP, where each tp rank's covers its own tokens only; averaged (`average_over` = tp)
    after a codec that mixes a bucket's elements, which leaves each tp rank another
    approximation of the same gradient: the replicas would drift apart, and a checkpoint keeps
    one of them. `slices` are (gradient, its parameter); bucket layouts match across tp, so the
    slices line up."""
    views = [g for g, p in slices if spec_of(p)[2] == 1]
    if not views:
        return
    flat = torch.cat([v.reshape(-1) for v in views])
    comm.all_reduce(flat, "tp")
    if average_over > 1:
        flat /= average_over
    for v, part in zip(views, flat.split([v.numel() for v in views])):
        v.copy_(part.view_as(v))


def split_over_tp(slices: list[tuple[torch.Tensor, nn.Parameter]], split: bool) -> list:
    """The (gradient, parameter) slices whose parameter's gradient each tp rank makes from its
    own heads (`split`: qk-norm's weights, ParamSpec.grad_split_over_tp), or the others."""
    return [(g, p) for g, p in slices if spec_of(p)[0].grad_split_over_tp == split]
