"""Masked attention as flash-attention's variable-length kernel (torch.nn.attention.varlen, the
THD layout Megatron-LM runs packed documents through): the micro-batch's rows packed end to end,
[b, s, heads, d] -> [b·s, heads, d], attended within segments that `cu_seqlens` cuts: every row
and, under document masking, every document of it. Causal within each segment, and a sliding
window as flash-attention's `window_size` (left, right): the query at i sees the keys
i - left ... i + right of its segment, so tetrad's window W (i - W < j <= i, model/masks.py) is
(W - 1, 0). Flash computes the tiles a segment's band touches: no S x S bias, no whole square.

Chosen on CUDA in 16-bit where flash takes the head dim (attention.choose_kernel); the kernel is
a field of the `Packing`, so the CPU suite runs the packing with a reference kernel in its place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tetrad import device as devices
from tetrad.model.documents import Documents
from tetrad.model.flops import hides_keys


# flash_api.cpp launches its kernels on a grid (query blocks, segments, heads), and CUDA caps a
# grid's second dimension at 65535.
MAX_SEGMENTS = 65535


def flash_varlen(*args, **kwargs) -> torch.Tensor:
    """torch.nn.attention.varlen's varlen_attn, imported at its first call: its module loads
    torch._dynamo, 1.5 s of every process's start here, where most runs never take this path."""
    from torch.nn.attention.varlen import varlen_attn
    return varlen_attn(*args, **kwargs)


@dataclass(frozen=True)
class Packing:
    """What the varlen kernel attends within, for one micro-batch (built on the host once and
    shared by a model chunk's layers, as the bias of the masked path): the segments' bounds
    (`cu_seqlens`, int32 [segments + 1], on the device), the longest segment (`longest`, a host
    int: the kernel sizes its grid by it), the window in flash's (left, right), and the kernel."""
    cu_seqlens: torch.Tensor
    longest: int
    window: tuple[int, int]
    kernel: Callable = flash_varlen


def segment_bounds(host_ids: np.ndarray | None, rows: int, length: int) -> tuple[np.ndarray, int]:
    """(cu_seqlens, the longest segment) of `rows` rows of `length` tokens packed end to end, cut
    at each row's start and, given the document ids on the host ([rows, length]; ids never
    decrease along a row), at each document's: from host values only, no read of the device."""
    if host_ids is None:
        starts = np.arange(rows) * length
    else:
        new = np.ones(host_ids.shape, dtype=bool)
        new[:, 1:] = host_ids[:, 1:] != host_ids[:, :-1]
        starts = np.flatnonzero(new)
    if len(starts) > MAX_SEGMENTS:
        raise ValueError(f"a micro-batch of {len(starts)} documents: flash's varlen kernel launches a grid row per "
                         f"document, at most {MAX_SEGMENTS} (CUDA's limit). The data has documents of a token or two "
                         "(runs of end-of-document tokens?): clean them out, or lower train.micro_batch")
    bounds = np.append(starts, rows * length).astype(np.int32)
    return bounds, int(np.diff(bounds).max())


def flash_window(window: int, length: int) -> tuple[int, int]:
    """tetrad's sliding window (0: none) as flash-attention's causal (left, right): (W - 1, 0)
    keeps the keys i - W < j <= i; (-1, 0) is causal alone."""
    return (window - 1, 0) if hides_keys(window, length) else (-1, 0)


def sequence_packing(docs: Documents | None, window: int, rows: int, length: int, device: torch.device,
                     kernel: Callable = flash_varlen) -> Packing:
    """The `Packing` of a micro-batch of `rows` whole sequences of `length` tokens, its documents
    from the host ids, the bounds copied to `device` without the host waiting."""
    bounds, longest = segment_bounds(docs.host if docs is not None else None, rows, length)
    cu_seqlens = devices.host_to_device(torch.from_numpy(bounds), device)
    return Packing(cu_seqlens, longest, flash_window(window, length), kernel)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing) -> torch.Tensor:
    """Causal attention within `packing`'s segments and window. q: [b, s, heads, d]; k, v: [b, s,
    kv_heads, d] (grouped-query heads as they are: flash takes them); returns [b, s, heads, d]."""
    b, s = q.shape[:2]
    q, k, v = (t.reshape(b * s, *t.shape[2:]) for t in (q, k, v))
    bounds, longest = packing.cu_seqlens, packing.longest
    out = packing.kernel(q, k, v, bounds, bounds, longest, longest, window_size=packing.window,
                         enable_gqa=k.shape[1] != q.shape[1])
    return out.view(b, s, *out.shape[1:])
