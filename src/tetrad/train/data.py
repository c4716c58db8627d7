"""Tokens and batches.

The built-in corpus ships inside the package (the texts of common free-software licences,
whose verbatim copying is permitted), so the default run needs no download and reads the same
bytes on every machine; tokens are bytes (vocabulary 256). For real use, `data.source` names a
token file: `.bin` (raw uint16, the nanoGPT/Megatron convention) or `.npy` (uint16/uint32),
memory-mapped.

Batches are a pure function of (seed, step): the global batch of a step is the same whatever
the layout, each DP rank takes its contiguous slice, and resuming needs only the step number.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

CORPORA = {"licenses": Path(__file__).parent / "corpus" / "licenses.txt"}


def load_tokens(source: str) -> np.ndarray:
    """A 1-D array of token ids (memory-mapped for token files)."""
    if source in CORPORA:
        return np.frombuffer(CORPORA[source].read_bytes(), dtype=np.uint8)
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"data.source={source!r} is neither a built-in corpus ({', '.join(CORPORA)}) "
                                "nor an existing file or folder")
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt"))
        if not files:
            raise FileNotFoundError(f"data.source folder {path} holds no .txt files")
        return np.frombuffer(b"\n".join(p.read_bytes() for p in files), dtype=np.uint8)
    if path.suffix == ".bin":
        return np.memmap(path, dtype=np.uint16, mode="r")
    if path.suffix == ".npy":
        tokens = np.load(path, mmap_mode="r")
        if tokens.ndim != 1 or tokens.dtype not in (np.uint16, np.uint32, np.int32, np.int64):
            raise ValueError(f"{path}: expected a 1-D array of uint16/uint32 token ids, got {tokens.dtype} "
                             f"with shape {tokens.shape}")
        return tokens
    return np.frombuffer(path.read_bytes(), dtype=np.uint8)  # any other file: its bytes are the tokens


@dataclass
class Batches:
    tokens: np.ndarray
    seq_len: int
    global_batch: int
    seed: int
    vocab_size: int

    def __post_init__(self):
        if len(self.tokens) < self.seq_len + 2:
            raise ValueError(f"the data has {len(self.tokens)} tokens, fewer than seq_len+1 = {self.seq_len + 1}")

    def global_batch_at(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, labels), each [global_batch, seq_len] int64: windows at random offsets."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, len(self.tokens) - self.seq_len - 1, (self.global_batch,), generator=gen)
        rows = np.stack([np.asarray(self.tokens[s:s + self.seq_len + 1], dtype=np.int64) for s in starts.tolist()])
        rows = torch.from_numpy(rows)
        if int(rows.max()) >= self.vocab_size:
            raise ValueError(f"token id {int(rows.max())} in the data is >= model.vocab_size={self.vocab_size}; "
                             "raise model.vocab_size or check data.source")
        return rows[:, :-1], rows[:, 1:]

    def microbatches(self, step: int, dp_rank: int, dp: int, micro_batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This DP rank's slice of the step's global batch, cut into micro-batches."""
        inputs, labels = self.global_batch_at(step)
        per_rank = self.global_batch // dp
        inputs = inputs[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        labels = labels[dp_rank * per_rank:(dp_rank + 1) * per_rank]
        return list(zip(inputs.split(micro_batch), labels.split(micro_batch)))
