"""The sums that complete a reduced gradient beyond the gradient group (Megatron-Core's
finalize_model_grads): the tied embedding over its two pipeline stages, and, under sequence
parallelism, the tp-replicated parameters over tp.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from tetrad.model.sharding import spec_of


def sum_tied(reduced: torch.Tensor, comm) -> None:
    """The embedding tied across pipeline stages: the embedding's and the head's gradient, the
    sum of both, on both stages (the "embed" group: first and last stage)."""
    comm.all_reduce(reduced, "embed")


def sum_sequence_parallel(slices: list[tuple[torch.Tensor, nn.Parameter]], comm) -> None:
    """Under SP each tp rank's gradient of a tp-replicated parameter (norms) covers its own tokens
    only: sum those over tp, in one collective. `slices` are (gradient, its parameter); bucket
    layouts match across tp, so the slices line up."""
    views = [g for g, p in slices if spec_of(p)[2] == 1]
    if not views:
        return
    flat = torch.cat([v.reshape(-1) for v in views])
    comm.all_reduce(flat, "tp")
    for v, part in zip(views, flat.split([v.numel() for v in views])):
        v.copy_(part.view_as(v))
