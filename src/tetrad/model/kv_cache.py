"""Decoding's KV cache: each layer's keys and values of the tokens so far (`LayerCache`), and the
attention of the newest tokens over them (`cached_attention`); model/llama.py's Attention runs them
when given a cache (train/generate.py decodes with one per layer). A batch of prompts of different
lengths (train/batched.py) is left-padded: each row's tokens fill the cache's last columns, and
`padded_visibility` hides the pads' columns from its queries."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tetrad.model.attention import local_attention
from tetrad.model.flops import hides_keys
from tetrad.model.masks import visibility


class LayerCache:
    """One layer's keys and values of the tokens decoded so far, in buffers [b, kv_heads, capacity,
    head_dim] written in place: a token costs its own write, not a copy of the cache (a
    concatenation's O(t) per token, and a fresh allocation each step). `reserve` sizes them for a
    generation at once (a chat's next turn: its own, not twice the last's); beyond that they grow
    geometrically.

    A sliding-window layer (`window` > 0: Mistral's, Gemma's local layers) holds only what its
    queries can still see: when its buffer is full it moves the last window - 1 tokens, and a
    quarter window more that a chat's next turn may go back over (`can_keep`), to the front and
    writes on after them, so however long the generation it holds at most two windows (more
    only while a longer prompt runs at once). Gemma 3's 5 local layers in 6 with a 1024-token
    window: a 32k-token conversation's cache ~5x smaller. Moving ~1.25 windows once every ~0.75
    window costs under two tokens' writes a token."""

    def __init__(self, window: int = 0):
        self.window = window
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.length = self.reserved = 0  # tokens so far (positions 0 to length - 1); tokens to allocate for
        self.start = 0  # the position the buffers' first column holds (a window's layer forgets those before)

    def reserve(self, tokens: int) -> None:
        """Allocate for `tokens` in all at the next token that does not fit (a generation's prompt
        and new tokens, known before its first step); a window's layer for two windows at most."""
        self.reserved = max(self.reserved, tokens)

    def keys_with(self, new: int) -> int:
        """How many keys `extend` with `new` tokens returns: every token's, or a window's layer's
        last window - 1 before the new ones and the new ones (all any of their queries sees)."""
        return (min(self.length, self.window - 1) if self.window else self.length) + new

    def extend(self, k: torch.Tensor, v: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new tokens' k, v ([b, s, kv_heads, head_dim]); the keys and values of the
        `keys_with(s)` last tokens, [b, kv_heads, tokens, head_dim] views of the buffers. `v` None:
        keys alone, returned as both (latent attention's latents, model/latent_attention.py)."""
        self._make_room(k, k.shape[1], v is not None)
        at, end = self.length - self.start, self.length + k.shape[1] - self.start  # buffer columns
        self.k[:, :, at:end] = k.transpose(1, 2)
        if v is not None:
            self.v[:, :, at:end] = v.transpose(1, 2)
        first = end - self.keys_with(k.shape[1])
        self.length += k.shape[1]
        values = self.k if self.v is None else self.v
        return self.k[:, :, first:end], values[:, :, first:end]

    def _make_room(self, like: torch.Tensor, new: int, values: bool = True) -> None:
        """Buffers that hold the tokens kept and `new` more: where they do not, a window's layer
        forgets what no query from here on sees (but the quarter window to go back over), and
        buffers of the size below hold the rest at their front (the same ones where that fits)."""
        capacity, end = 0 if self.k is None else self.k.shape[2], self.length + new
        if end - self.start <= capacity:
            return
        start = max(self.start, self.length - (self.window - 1) - self.window // 4) if self.window else 0
        if self.window:  # two windows, less where the reservation needs less (no move at all)
            size = max(end - start, min(2 * self.window, max(self.reserved - start, 2 * capacity)))
        else:  # a reservation that holds them is allocated as it is (a chat's next turn)
            size = self.reserved if self.reserved >= end else max(end, 2 * capacity)
        kept, first = self.length - start, start - self.start  # tokens kept, and their first column
        if size == capacity:  # they move to the buffers' front; cloned, as the two may overlap
            for buffer in self._buffers():
                buffer[:, :, :kept] = buffer[:, :, first:first + kept].clone()
        else:
            b, _, kv_heads, head_dim = like.shape
            new = [like.new_empty(b, kv_heads, size, head_dim) for _ in range(2 if values else 1)]
            for old, buffer in zip(self._buffers(), new):
                buffer[:, :, :kept] = old[:, :, first:first + kept]
            self.k, self.v = new[0], new[1] if values else None
        self.start = start

    def select(self, rows: torch.Tensor) -> None:
        """Keep the batch rows `rows` alone (a batch whose other rows finished): a copy of theirs,
        after which the finished rows cost no more compute."""
        self.k, self.v = (None if t is None else t[rows] for t in (self.k, self.v))

    def _buffers(self) -> list[torch.Tensor]:
        """The buffers held: keys and values, or keys alone (`extend`)."""
        return [t for t in (self.k, self.v) if t is not None]

    def can_keep(self, tokens: int) -> bool:
        """Whether `keep(tokens)` leaves every key the next token sees: a window's layer has
        forgotten the tokens before `start`."""
        return tokens >= self.length or self.start <= max(0, tokens - (self.window - 1))

    def keep(self, tokens: int) -> None:
        """Forget all but the first `tokens`: a chat's next turn that reads the same up to there
        (train/generate.py); each token's keys and values depend on the tokens before it only.
        `tokens` 0 always, others where `can_keep`."""
        self.length = min(self.length, tokens)
        self.start = min(self.start, self.length)


def padded_visibility(positions: torch.Tensor, keys: int, window: int = 0) -> torch.Tensor:
    """[b, 1, s, keys] bool: which of the cache's `keys` columns each of a left-padded batch's newest
    s tokens sees. positions [b, s]: each row's true positions, its last column its newest token,
    which takes the cache's last column, so that column c of row i holds position
    positions[i, -1] - (keys - 1 - c), a pad where that is negative. Causal and within the sliding
    `window` (0: none) by those positions, as one row alone sees its own tokens; a pad's query,
    which sees no key, sees them all instead (SDPA gives a query without keys NaN; a pad's output
    is never read, and its keys are hidden)."""
    held = positions[:, -1:] - (keys - 1) + torch.arange(keys, device=positions.device)  # [b, keys]
    delta = positions[:, :, None] - held[:, None, :]
    visible = (held[:, None, :] >= 0) & (delta >= 0)
    if window:
        visible &= delta < window
    return (visible | ~visible.any(-1, keepdim=True))[:, None]


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int = 0,
                     visible: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the newest q.shape[1] tokens over all k.shape[2] cached ones
    (decoding: no sequence or context parallelism; under tp this rank's heads), within the sliding
    `window` (0: none). A prompt with nothing cached before it is the training forward's attention
    (flash kernels where the device has them); the rest `folded_attention`. A new token alone needs
    no mask: it sees every cached key, or the window's last ones, which it attends over alone.
    `visible`: a left-padded batch's mask (padded_visibility: the window is in it).
    q: [b, s, heads, d]; k, v: [b, kv_heads, t, d or dv]; returns [b, s, heads, d or dv]."""
    s, t = q.shape[1], k.shape[2]
    if visible is not None:
        return folded_attention(q, k, v, visible)
    if s == t:
        return local_attention(q, k.transpose(1, 2), v.transpose(1, 2), window=window)
    if s == 1:
        k, v = (x[:, :, -window:] if hides_keys(window, t) else x for x in (k, v))
        return folded_attention(q, k, v)
    # a chat turn's new tokens after its cached start
    return folded_attention(q, k, v, visibility(torch.arange(t - s, t, device=q.device),
                                                torch.arange(t, device=q.device), window))


FOLDED_ROWS = 1024  # query rows per attention call that takes a mask (folded_attention)


def folded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     visible: torch.Tensor | None = None) -> torch.Tensor:
    """Attention with each key head's query heads folded into its query rows (position-major: row
    i * groups + j is position i's j-th head of the group), so every call has as many key heads
    as query heads and no kernel copies the cache per query head. SDPA's grouped-query calls do:
    on CUDA only flash and the math kernel take them, flash no head dim above 256, so latent
    attention's 576-wide single key head (kv_lora_rank + rope, model/latent_attention.py) or a
    mask would fall to the math kernel, which repeats keys and values per head in fp32. Folded,
    one key head of 576 runs the memory-efficient kernel on CUDA (any multiple of 8 wide) and
    the flash kernel on CPU, both tiled over the keys. `visible` [b or 1, 1, s, t] (bool) is each
    position's, repeated over its rows; with more than one position the calls take FOLDED_ROWS
    rows at a time, so that repetition holds at most FOLDED_ROWS x t.
    q: [b, s, heads, d]; k, v: [b, kv_heads, t, d or dv]; returns [b, s, heads, d or dv]."""
    b, s, heads, d = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    rows = q.view(b, s, kv_heads, groups, d).transpose(1, 2).reshape(b, kv_heads, s * groups, d)
    step = s if visible is None or s == 1 else max(1, FOLDED_ROWS // groups)  # positions per call
    out = []
    for i in range(0, s, step):
        mask = None if visible is None else _repeat_rows(visible[:, :, i:i + step], groups)
        out.append(F.scaled_dot_product_attention(rows[:, :, i * groups:(i + step) * groups], k, v, attn_mask=mask))
    out = torch.cat(out, dim=2) if len(out) > 1 else out[0]
    return out.reshape(b, kv_heads, s, groups, -1).transpose(1, 2).reshape(b, s, heads, -1)


def _repeat_rows(visible: torch.Tensor, groups: int) -> torch.Tensor:
    """[b, 1, s, t] -> [b, 1, s * groups, t]: each position's row once per head of its group; a
    single position's stays one row, which SDPA broadcasts over the group (no copy)."""
    b, _, s, t = visible.shape
    return visible if s == 1 else visible[:, :, :, None].expand(b, 1, s, groups, t).reshape(b, 1, s * groups, t)
