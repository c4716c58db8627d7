"""Which tokens a cp rank holds. The sequence is cut into 2·cp chunks and cp rank i keeps chunks i
and 2cp−1−i: under a causal mask an early chunk attends to little and a late one to much, so
pairing them gives every rank the same attention work. Tokens, labels and positions are sharded
alike, so RoPE, learned positions and the loss all see each token's true position."""

from __future__ import annotations

import torch


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = -1) -> torch.Tensor:
    """cp rank `rank`'s two chunks of `x` along `dim`, concatenated (x itself when cp == 1)."""
    if cp == 1:
        return x
    parts = x.chunk(2 * cp, dim)
    return torch.cat([parts[rank], parts[2 * cp - 1 - rank]], dim)


def load_balanced_order(seq_len: int, cp: int, device=None) -> torch.Tensor:
    """True position of each token when the ranks' shards are laid end to end in rank order
    (the sequence an all-to-all gathers)."""
    positions = torch.arange(seq_len, device=device)
    return torch.cat([shard_sequence(positions, cp, r) for r in range(cp)])
