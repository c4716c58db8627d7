"""The attention core: softmax(q k^T / sqrt(d)) v with a causal mask, on this rank's heads.

Goes through `scaled_dot_product_attention`, so fused and flash kernels are used where the
device has them. Context-parallel variants (ring, all-to-all) plug in here.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def local_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention over a whole sequence held by this rank.

    q: [b, s, heads, d]; k, v: [b, s, kv_heads, d] (grouped-query when kv_heads < heads).
    Returns [b, s, heads, d].
    """
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return out.transpose(1, 2)
