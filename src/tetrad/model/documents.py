"""Document masking's inputs to attention (train.document_mask): a query sees only earlier keys
of its own document. A micro-batch carries each token's document id over the whole window, [b, S]
(`Documents`, from train/batches.py), the same on every rank and pipeline stage, so no rank needs
another's. model/masks.py turns them into masks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


def document_ids(inputs: torch.Tensor, eos: int) -> torch.Tensor:
    """Each token's document within its window ([b, s] -> [b, s]): how many EOS tokens come
    before it, so an EOS belongs to the document it ends and the token after it starts the next.
    Ids never decrease along a row."""
    ends = (inputs == eos).long()
    return ends.cumsum(1) - ends


def document_positions(inputs: torch.Tensor, eos: int) -> torch.Tensor:
    """Each token's offset within its document ([b, s] -> [b, s]; train.reset_positions, as
    Megatron-LM's --reset-position-ids): the token after an EOS is at 0, the window's first too."""
    at = torch.arange(inputs.shape[1], device=inputs.device).expand(inputs.shape)
    starts = torch.zeros_like(inputs, dtype=torch.bool)
    starts[:, 1:] = inputs[:, :-1] == eos
    return at - torch.where(starts, at, 0).cummax(1).values


@dataclass(frozen=True)
class Documents:
    """A micro-batch's document ids over the whole window, [b, S]: on the device for the masks
    (`ids`) and on the host (`host`, the same ids) for the decisions that depend on their values,
    which read from the device would stall the host once per layer on GPUs (the ring's skipped
    blocks, model/masks.py)."""
    ids: torch.Tensor
    host: np.ndarray

    @classmethod
    def of_windows(cls, inputs: torch.Tensor, eos: int, device: torch.device) -> "Documents":
        """The documents of host-side windows `inputs` [b, S] that `eos` ends."""
        ids = document_ids(inputs, eos)
        return cls(ids.to(device), ids.numpy())
