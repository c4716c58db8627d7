"""Batches: which token windows each rank trains (and validates) on at each step.

Batches are a pure function of (seed, step): the global batch of a step is the same whatever
the layout, and resuming needs only the step number. Every rank draws the step's window starts
(a few integers) but reads only the rows of its own dp share, so data loading does not grow
with dp. The tokens come from data/sources.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tetrad.data.sources import TokenStream, load_splits


@dataclass
class Batches:
    tokens: TokenStream
    seq_len: int
    global_batch: int
    seed: int
    vocab_size: int

    def __post_init__(self):
        if len(self.tokens) < self.seq_len + 2:
            raise ValueError(f"the data has {len(self.tokens)} tokens, fewer than seq_len+2 = {self.seq_len + 2}")

    def rows(self, step: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows [lo, hi) of the step's global batch: (inputs, labels), each [hi - lo, seq_len]
        int64, windows at random offsets (drawn for the whole batch, read for these rows)."""
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + step) % 2**63)  # any seed in [0, 2**63)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.global_batch,), generator=gen)
        rows = torch.from_numpy(self.tokens.windows(starts[lo:hi].tolist(), self.seq_len + 1))
        low, high = (int(v) for v in torch.aminmax(rows))
        if low < 0 or high >= self.vocab_size:
            raise ValueError(f"token id {low if low < 0 else high} in the data is outside [0, model.vocab_size="
                             f"{self.vocab_size}); check data.source or model.vocab_size")
        return rows[:, :-1], rows[:, 1:]

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows(step, 0, self.global_batch)

    def microbatches(self, step: int, dp_rank: int, dp: int, micro_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This DP rank's contiguous share of the step's global batch, cut into micro-batches."""
        per_rank = self.global_batch // dp
        inputs, labels = self.rows(step, dp_rank * per_rank, (dp_rank + 1) * per_rank)
        return list(zip(inputs.split(micro_batch), labels.split(micro_batch)))


def split_batches(cfg) -> tuple[Batches, Batches | None]:
    """The training batches and, when `data.val_source` or `data.val_fraction` sets some tokens
    apart, the validation batches (same shapes; batch i of an evaluation is `microbatches(i, ...)`,
    so every evaluation sees the same held-out windows)."""
    d, m, t = cfg.data, cfg.model, cfg.train
    train, val = load_splits(d.source, d.val_source, d.val_fraction)
    return (Batches(train, m.seq_len, t.global_batch, t.seed, m.vocab_size),
            None if val is None else Batches(val, m.seq_len, t.global_batch, t.seed + 1, m.vocab_size))
