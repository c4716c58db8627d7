"""Every source a run reads tokens from, as one `TokenStream`.

`data.source` is a built-in corpus name, a text file or a folder of `.txt` files (tokens are
bytes, vocabulary 256), a token file (`.bin`: raw uint16, the nanoGPT/Megatron convention;
`.npy`: uint16/uint32/int32/int64), or a shard folder from `tetrad data` (its index.json); or a
blend of such sources with weights, written as Megatron-LM writes `--data-path`:
"0.7 data/web 0.3 data/code".
The built-in corpus ships inside the package (the texts of common free-software licences,
whose verbatim copying is permitted), so the default run needs no download and reads the same
bytes on every machine. Token files and shards are memory-mapped: a rank reads only the
windows it samples.
"""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import numpy as np

from tetrad.data.blend import blend_parts
from tetrad.data.shards import is_shard_folder, open_shards

CORPORA = {"licenses": Path(__file__).parent / "corpus" / "licenses.txt"}
NPY_DTYPES = (np.uint16, np.uint32, np.int32, np.int64)


class TokenStream:
    """1-D token ids held as consecutive pieces (one array, or one memory map per shard)."""

    def __init__(self, pieces: list[np.ndarray]):
        self.pieces = [p for p in pieces if len(p)]
        self.offsets = np.cumsum([0] + [len(p) for p in self.pieces])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64, read across piece boundaries."""
        out, end = [], start + length
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        for i in range(first, len(self.pieces)):
            lo, hi = max(start, int(self.offsets[i])), min(end, int(self.offsets[i + 1]))
            if lo >= hi:
                break
            out.append(np.asarray(self.pieces[i][lo - self.offsets[i]:hi - self.offsets[i]], dtype=np.int64))
        return np.concatenate(out)

    def windows(self, starts: list[int], length: int) -> np.ndarray:
        """Tokens [s, s + length) for each of `starts`, [len(starts), length] int64. One piece
        (every source but a shard folder) is read in one gather: a loop of `window`s costs a
        tiny model's step more than its rows are worth."""
        if len(self.pieces) == 1:
            return np.asarray(self.pieces[0][np.add.outer(starts, np.arange(length))], dtype=np.int64)
        return np.stack([self.window(s, length) for s in starts])

    def split(self, at: int) -> tuple["TokenStream", "TokenStream"]:
        """Tokens [0, at) and [at, len)."""
        head, tail = [], []
        for piece, lo in zip(self.pieces, self.offsets[:-1].tolist()):
            cut = min(max(at - lo, 0), len(piece))
            head.append(piece[:cut])
            tail.append(piece[cut:])
        return TokenStream(head), TokenStream(tail)


def text_files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*.txt") if p.is_file())


def reads_as_bytes(source: str) -> bool:
    """Whether `load_tokens` reads `source` as bytes (a built-in corpus, text files), not as ids."""
    path = Path(source)
    return source in CORPORA or (path.exists() and not is_shard_folder(path) and path.suffix not in (".bin", ".npy"))


def load_tokens(source: str) -> TokenStream:
    """The tokens of `source` (see the module docstring); errors are one line (data/checks.py
    checks them all before any rank starts)."""
    if source in CORPORA:
        return TokenStream([np.frombuffer(CORPORA[source].read_bytes(), dtype=np.uint8)])
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"data.source={source!r} is neither a built-in corpus ({', '.join(CORPORA)}) "
                                "nor an existing file or folder")
    if is_shard_folder(path):
        return TokenStream(open_shards(path))
    if path.is_dir():
        files = text_files(path)
        if not files:
            raise FileNotFoundError(f"data.source folder {path} holds no .txt files (nor a {path}/index.json "
                                    "from `tetrad data`)")
        return TokenStream([np.frombuffer(b"\n".join(p.read_bytes() for p in files), dtype=np.uint8)])
    if path.suffix == ".bin":
        return TokenStream([np.memmap(path, dtype=np.uint16, mode="r")])
    if path.suffix == ".npy":
        return TokenStream([np.load(path, mmap_mode="r", allow_pickle=False)])
    return TokenStream([np.frombuffer(path.read_bytes(), dtype=np.uint8)])  # any other file: its bytes


def load_blend(source: str, val_source: str = "", val_fraction: float = 0.0
               ) -> tuple[list[tuple[Fraction, TokenStream]], list[tuple[Fraction, TokenStream]] | None]:
    """(training sources, held-out validation sources or None), each as (weight, tokens):
    `val_source` read whole (a blend too), or the last `val_fraction` of every source of
    `source` set apart, at the same weights (training never sees it)."""
    train = [(w, load_tokens(part)) for w, part in blend_parts(source)]
    if val_source:
        return train, [(w, load_tokens(part)) for w, part in blend_parts(val_source)]
    if val_fraction > 0:
        splits = [(w, tokens.split(len(tokens) - int(len(tokens) * val_fraction))) for w, tokens in train]
        return [(w, head) for w, (head, _) in splits], [(w, tail) for w, (_, tail) in splits]
    return train, None
