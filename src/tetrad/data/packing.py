"""Fine-tuning examples packed whole into windows. A source with a loss mask (supervised
fine-tuning shards, `tetrad data --prompt-key`) is read as packs, not as cuts of its stream.

Cutting the stream every seq_len tokens, as pre-training does, would split an example between two
windows, and its response's tail would be trained with its prompt out of sight. Instead
consecutive examples (each ends with its EOS) fill a pack of up to seq_len + 1 tokens, in order,
greedily, as torchtune packs; the rest of the pack is EOS padding whose labels the loss does not
count (under document masking each padding EOS is a document of its own, so no real token sees
it, and causal attention keeps it out of sight without). An example longer than a window keeps
its first seq_len + 1 tokens, alone in its pack (torchtune truncates likewise). The packs are
worked out once from the EOS positions, the same on every rank.
"""

from __future__ import annotations

import numpy as np

from tetrad.data.sources import TokenStream


def fewest_tokens(tokens: TokenStream, seq_len: int) -> int:
    """The fewest tokens a source needs for one training window: seq_len + 2 to cut one from a
    stream (and shift it), one example of two tokens (a label) to make a pack."""
    return 2 if tokens.loss_masks is not None else seq_len + 2


class ExamplePacks:
    """The packs of a loss-masked stream: `starts` and `lengths` in tokens, `capacity` (seq_len + 1)
    each at most; `examples` and `truncated` count what they hold."""

    def __init__(self, tokens: TokenStream, capacity: int):
        if tokens.eos is None:
            raise ValueError("a loss-masked source must name the token that ends its examples (a shard folder's eos_id)")
        self.tokens, self.capacity = tokens, capacity
        ends = [np.flatnonzero(np.asarray(piece) == tokens.eos) + 1 + lo
                for piece, lo in zip(tokens.pieces, tokens.offsets[:-1].tolist())]
        ends = np.concatenate(ends + [np.array([len(tokens)])])  # a last example cut by a split: as it is
        ends = np.unique(ends[ends > 0])
        sizes = np.diff(ends, prepend=0)
        starts, lengths, i = [], [], 0
        while i < len(ends):  # one turn a pack: the examples from i that end within capacity of its start
            start = int(ends[i - 1]) if i else 0
            fit = int(np.searchsorted(ends, start + capacity, side="right"))
            starts.append(start)
            lengths.append(int(ends[fit - 1]) - start if fit > i else capacity)  # none fits: example i, cut
            i = max(fit, i + 1)
        self.starts, self.lengths = np.array(starts, dtype=np.int64), np.array(lengths, dtype=np.int64)
        self.examples = len(ends)
        self.truncated = int((sizes > capacity).sum())

    def __len__(self) -> int:
        return len(self.starts)

    def fill(self) -> float:
        """The share of the packs' tokens that are examples' (the rest is padding)."""
        return float(self.lengths.sum()) / (len(self) * self.capacity)

    def read(self, packs: np.ndarray) -> np.ndarray:
        """These packs' tokens, [len(packs), capacity] int64, padded with EOS."""
        return self._gather(packs, self.tokens.windows, np.int64, self.tokens.eos)

    def counted(self, packs: np.ndarray) -> np.ndarray:
        """Whether the loss counts each token of `read(packs)` (the loss mask; never the padding),
        bool: the masks alone, so that Batches.loss_tokens reads no token ids."""
        return self._gather(packs, self.tokens.counted, bool, False)

    def _gather(self, packs: np.ndarray, read, dtype, padding) -> np.ndarray:
        """Rows of `read` (TokenStream.windows or .counted) at the packs' starts, `padding` past each pack's end."""
        starts, lengths = self.starts[packs], self.lengths[packs]
        out = np.full((len(packs), self.capacity), padding, dtype=dtype)
        whole = starts + self.capacity <= len(self.tokens)  # read at full width, padding set after
        if whole.any():
            out[whole] = read(starts[whole].tolist(), self.capacity)
        for row in np.flatnonzero(~whole).tolist():  # the stream ends within the window
            out[row, :lengths[row]] = read([int(starts[row])], int(lengths[row]))[0]
        out[np.arange(self.capacity) >= lengths[:, None]] = padding
        return out
