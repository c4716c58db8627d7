"""Document masking's inputs to attention (train.document_mask): a query sees only earlier keys
of its own document. A micro-batch carries each token's document id over the whole window, [b, S]
(`Documents`, from train/batches.py), the same on every rank and pipeline stage, so no rank needs
another's."""

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
    blocks, model/attention.py)."""
    ids: torch.Tensor
    host: np.ndarray

    @classmethod
    def of_windows(cls, inputs: torch.Tensor, eos: int, device: torch.device) -> "Documents":
        """The documents of host-side windows `inputs` [b, S] that `eos` ends."""
        ids = document_ids(inputs, eos)
        return cls(ids.to(device), ids.numpy())


def document_visibility(docs_q: torch.Tensor, docs_k: torch.Tensor, causal: bool) -> torch.Tensor:
    """[b, 1, sq, sk] bool: query i may see key j, both of one document (ids [b, sq] and [b, sk])
    and, if `causal`, j not after i (rows and columns both in position order)."""
    visible = docs_q[:, None, :, None] == docs_k[:, None, None, :]
    if causal:
        visible = visible & torch.ones(visible.shape[-2:], dtype=torch.bool, device=visible.device).tril()
    return visible


def window_bias(ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The window's causal document-masking bias for the paths that attend over the whole window
    at once (one cp rank, all-to-all): [b, 1, S, S] in the activations' `dtype`, 0 where a query
    may see a key, -inf elsewhere: what SDPA would convert a boolean mask to, and keep. Built once
    per micro-batch and model chunk where no layer recomputes its attention (model/llama.py),
    every layer's attention keeps a reference to that one tensor, not a copy each: a b x S^2
    tensor per layer (4 GiB at Llama 3 8B's 32 layers, seq 8192, tp 8) becomes one per micro-batch
    in flight. Under recompute each layer builds it from the ids inside the recomputed region
    instead, which keeps none past its forward."""
    return additive_bias(document_visibility(ids, ids, causal=True), dtype)


def additive_bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility as the additive bias attention kernels take: 0 where a query sees a
    key, -inf elsewhere, in `dtype`."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))
