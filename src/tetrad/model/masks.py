"""Which keys each query sees: always the causal ones; within a sliding window (model.sliding_window:
a query at position i sees keys j with i - window < j <= i, HF Mistral's `sliding_window_overlay`
on its causal mask); within its own document (train.document_mask; model/documents.py). The masks
AND together. Every position here is a token's true position in the sequence, whatever the cp
layout holds it.

Two consumers: the paths that attend over the whole sequence at once (one cp rank, all-to-all),
which hand SDPA an additive bias (`sequence_bias`), and the ring, which decides on the host from
positions and document ids which blocks of which ranks' chunks it computes, masked or not
(`ring_blocks`), and builds each masked block's visibility on the device (`block_visibility`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tetrad.dist.sequence import shard_sequence
from tetrad.model.flops import hides_keys
from tetrad.model.documents import Documents


def visibility(pos_q: torch.Tensor, pos_k: torch.Tensor, window: int = 0, ids_q: torch.Tensor | None = None,
               ids_k: torch.Tensor | None = None) -> torch.Tensor:
    """[1 or b, 1, sq, sk] bool: the query at position pos_q[i] sees the key at pos_k[j]: causal,
    within `window` (0: no window) and, given document ids ([b, sq] and [b, sk]), of one document."""
    delta = pos_q[:, None] - pos_k[None, :]
    visible = delta >= 0
    if window:
        visible = visible & (delta < window)
    visible = visible[None, None]
    if ids_q is not None:
        visible = visible & (ids_q[:, None, :, None] == ids_k[:, None, None, :])
    return visible


def sequence_bias(docs: Documents | None, window: int, length: int, dtype: torch.dtype,
                  device: torch.device) -> torch.Tensor | None:
    """The mask for the paths that attend over the whole sequence of `length` at once (one cp rank,
    all-to-all) as the additive bias SDPA takes, in the activations' `dtype`: [b, 1, S, S] with
    documents, [1, 1, S, S] with a window alone, None where causality alone masks (SDPA's
    is_causal then). A boolean mask SDPA would convert, and keep a copy of, per layer: so a model
    chunk whose layers do not recompute attention builds this once per micro-batch and every
    layer keeps a reference to the one tensor (4 GiB at Llama 3 8B's 32 layers, seq 8192, tp 8,
    with documents, becomes one per micro-batch in flight: model/llama.py). Under recompute each
    layer builds it inside the recomputed region instead, which keeps none past its forward."""
    if docs is None and not hides_keys(window, length):
        return None
    positions = torch.arange(length, device=device)
    ids = docs.ids if docs is not None else None
    return additive_bias(visibility(positions, positions, window, ids, ids), dtype)


def additive_bias(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A boolean visibility as the additive bias attention kernels take: 0 where a query sees a
    key, -inf elsewhere, in `dtype`."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


# ----------------------------------------------------------------------------- the ring's blocks

NONE, SOME, ALL = 0, 1, 2  # how many of a pair of chunks' causal (query, key) pairs are visible


@dataclass(frozen=True)
class RingBlock:
    """What one ring step computes of my query rows against the source rank's key columns: the
    rows and columns (each a slice over the two chunks a rank holds: both, the first or the
    second), whether the block is the causal square (my own block) and whether it needs a mask
    beyond that (`masked`: a window or documents hide some of its pairs)."""
    src: int
    rows: slice
    cols: slice
    causal: bool
    masked: bool


@dataclass(frozen=True)
class RingMasks:
    """The ring's masking: a sliding window (0: none) and the window's documents (None: none),
    and the blocks every step computes (`ring_blocks`, None for a skipped one)."""
    window: int
    docs: Documents | None
    blocks: tuple


def ring_blocks(cp: int, rank: int, chunk: int, window: int, host_ids: np.ndarray | None) -> tuple:
    """Each ring step's `RingBlock` for cp rank `rank`, whose two chunks of `chunk` tokens are
    (rank, 2cp-1-rank) in the load-balanced layout, as the source's are (src, 2cp-1-src); step s
    takes rank - s's K/V. Decided on the host, from positions and the window's document ids
    (`host_ids`, [b, S], or None), so that no layer waits on the device: each pair of a row chunk
    and a column chunk is seen not at all, in part or wholly (`_pair_seen`); the block keeps the
    row and column chunks with any pair seen (None: no pair, the step is skipped, forward and
    backward; the K/V and dK/dV still travel) and is unmasked only where each kept pair is seen
    exactly as causality alone sees it (the causal square at step 0, wholly elsewhere)."""
    blocks = []
    for step in range(cp):
        src = (rank - step) % cp
        mine, theirs = (rank, 2 * cp - 1 - rank), (src, 2 * cp - 1 - src)
        seen = [[_pair_seen(a, b, chunk, window, host_ids) for b in theirs] for a in mine]
        rows = [i for i in range(2) if any(seen[i])]
        cols = [j for j in range(2) if any(seen[i][j] for i in range(2))]
        if not rows:
            blocks.append(None)
            continue
        causal = step == 0
        masked = any(seen[i][j] != (ALL if mine[i] >= theirs[j] else NONE) for i in rows for j in cols)
        blocks.append(RingBlock(src, _halves(rows, chunk), _halves(cols, chunk), causal, masked))
    return tuple(blocks)


def _halves(chunks: list[int], chunk: int) -> slice:
    return slice(None) if len(chunks) == 2 else slice(None, chunk) if chunks == [0] else slice(chunk, None)


def _pair_seen(a: int, b: int, chunk: int, window: int, host_ids: np.ndarray | None) -> int:
    """How many of the causal pairs of query chunk `a` and key chunk `b` (chunk indices of the
    sequence) are visible: NONE, SOME or ALL. Keys of an earlier chunk all come before the
    queries, and ids never decrease along a row, so the pair is seen at all exactly when its
    nearest pair (b's last key, a's first query) is within the window and, in some sequence, of
    one document; wholly when its farthest pair is within the window (documents: never counted
    whole). On the diagonal (a == b) every query sees itself, and the window hides a pair when
    it is shorter than the chunk."""
    if b > a:
        return NONE
    near, far = max((a - b - 1) * chunk + 1, 0), (a - b + 1) * chunk - 1  # the least and most q - k
    if window and near >= window:
        return NONE
    if host_ids is not None and a > b and not (host_ids[:, (b + 1) * chunk - 1] == host_ids[:, a * chunk]).any():
        return NONE
    return ALL if host_ids is None and (not window or far < window) else SOME


def block_visibility(masks: RingMasks, block: RingBlock, cp: int, rank: int, chunk: int,
                     device: torch.device) -> torch.Tensor | None:
    """A masked block's visibility [1 or b, 1, rows, cols] on the device, from the positions (and
    ids) of my chunks and the source's; None for a block causality alone masks."""
    if not block.masked:
        return None
    positions = torch.arange(2 * cp * chunk, device=device)
    pos_q = shard_sequence(positions, cp, rank)[block.rows]
    pos_k = shard_sequence(positions, cp, block.src)[block.cols]
    ids_q = ids_k = None
    if masks.docs is not None:
        ids_q = shard_sequence(masks.docs.ids, cp, rank)[:, block.rows]
        ids_k = shard_sequence(masks.docs.ids, cp, block.src)[:, block.cols]
    return visibility(pos_q, pos_k, masks.window, ids_q, ids_k)
