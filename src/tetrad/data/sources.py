"""Every source a run reads tokens from, as one `TokenStream`.

`data.source` is a built-in corpus name, a text file or a folder of `.txt` files (tokens are
bytes, vocabulary 256), a token file (`.bin`: raw uint16, the nanoGPT convention, and
Megatron-LM's where its .idx says uint16 (data/checks.py refuses its int32 ones);
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
from tetrad.data.shards import is_shard_folder, open_loss_masks, open_shards, read_index

CORPORA = {"licenses": Path(__file__).parent / "corpus" / "licenses.txt"}
NPY_DTYPES = (np.uint16, np.uint32, np.int32, np.int64)


class TokenStream:
    """1-D token ids held as consecutive pieces (one array, or one memory map per shard), with each
    piece's loss mask beside it where the source has one (supervised fine-tuning shards: 1 where
    the loss counts the token as a label; shards.py), else `loss_masks` is None; `eos`: the
    token that ends a document, where the source names one (a shard folder)."""

    def __init__(self, pieces: list[np.ndarray], loss_masks: list[np.ndarray] | None = None, eos: int | None = None):
        self.eos = eos  # the token that ends each document (a shard folder's), or None
        kept = [i for i, p in enumerate(pieces) if len(p)]
        self.pieces = [pieces[i] for i in kept]
        self.loss_masks = None if loss_masks is None else [loss_masks[i] for i in kept]
        self.offsets = np.cumsum([0] + [len(p) for p in self.pieces])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def window(self, start: int, length: int) -> np.ndarray:
        """Tokens [start, start + length) as int64, read across piece boundaries."""
        return self._window(self.pieces, start, length).astype(np.int64)

    def _window(self, arrays: list[np.ndarray], start: int, length: int) -> np.ndarray:
        out, end = [], start + length
        first = int(np.searchsorted(self.offsets, start, side="right")) - 1
        for i in range(first, len(arrays)):
            lo, hi = max(start, int(self.offsets[i])), min(end, int(self.offsets[i + 1]))
            if lo >= hi:
                break
            out.append(np.asarray(arrays[i][lo - self.offsets[i]:hi - self.offsets[i]]))
        return np.concatenate(out)

    def windows(self, starts: list[int], length: int) -> np.ndarray:
        """Tokens [s, s + length) for each of `starts`, [len(starts), length] int64. One piece
        (every source but a shard folder) is read in one gather: a loop of `window`s costs a
        tiny model's step more than its rows are worth."""
        return self._windows(self.pieces, starts, length).astype(np.int64, copy=False)

    def counted(self, starts: list[int], length: int) -> np.ndarray:
        """Whether the loss counts each token of `windows(starts, length)` as a label, bool of the
        same shape: the loss masks', or every token where the source has none."""
        if self.loss_masks is None:
            return np.ones((len(starts), length), dtype=bool)
        return self._windows(self.loss_masks, starts, length).astype(bool)

    def _windows(self, arrays: list[np.ndarray], starts: list[int], length: int) -> np.ndarray:
        """Rows of `arrays` (the pieces or their masks): those inside one piece in one gather per
        piece (a loop over rows costs ms a step for a whole global batch of masks), the few that
        cross a piece's end one by one."""
        starts = np.asarray(starts, dtype=np.int64)
        piece = np.searchsorted(self.offsets, starts, side="right") - 1
        inside = starts + length <= self.offsets[piece + 1]
        out = np.empty((len(starts), length), dtype=arrays[0].dtype)
        for i in np.unique(piece[inside]).tolist():
            rows = np.flatnonzero(inside & (piece == i))
            out[rows] = np.lib.stride_tricks.sliding_window_view(arrays[i], length)[starts[rows] - self.offsets[i]]
        for row in np.flatnonzero(~inside).tolist():
            out[row] = self._window(arrays, int(starts[row]), length)
        return out

    def held_out(self, fraction: float) -> tuple["TokenStream", "TokenStream"]:
        """The stream without its last `fraction`, and that part (data.val_fraction). Fine-tuning
        examples (a loss mask) are not cut: the split moves back to the start of the example it
        falls in, so that no held-out response is scored without its prompt, and a long last
        example is held out rather than leaving nothing held out."""
        at = len(self) - int(len(self) * fraction)
        if self.loss_masks is not None and self.eos is not None and at < len(self):
            at = self._example_start(at)
        return self.split(at)

    def _example_start(self, at: int, chunk: int = 1 << 16) -> int:
        """The start of the example that holds position `at`: just after the last EOS before it (0: none)."""
        for end in range(at, 0, -chunk):
            lo = max(end - chunk, 0)
            found = np.flatnonzero(self.window(lo, end - lo) == self.eos)
            if len(found):
                return lo + int(found[-1]) + 1
        return 0

    def split(self, at: int) -> tuple["TokenStream", "TokenStream"]:
        """Tokens [0, at) and [at, len)."""
        cuts = [min(max(at - lo, 0), len(piece)) for piece, lo in zip(self.pieces, self.offsets[:-1].tolist())]

        def part(arrays, head):
            return None if arrays is None else [a[:c] if head else a[c:] for a, c in zip(arrays, cuts)]
        return (TokenStream(part(self.pieces, True), part(self.loss_masks, True), self.eos),
                TokenStream(part(self.pieces, False), part(self.loss_masks, False), self.eos))


def visible_files(folder: Path) -> list[Path]:
    """The files under `folder`, sorted, hidden ones aside (a name, or a folder on the way, that
    starts with "."): .git, Jupyter's .ipynb_checkpoints copies and macOS's ._ resource forks are
    not the user's text."""
    return sorted(f for f in folder.rglob("*")
                  if f.is_file() and not any(part.startswith(".") for part in f.relative_to(folder).parts))


def text_files(folder: Path) -> list[Path]:
    """The .txt files under `folder`, each once: a link beside its file (latest.txt -> v3.txt) would
    be trained on twice, or with data.val_fraction trained on and held out (as tetrad data's inputs)."""
    seen: set[Path] = set()
    out = []
    for p in visible_files(folder):
        if p.suffix == ".txt" and p.resolve() not in seen:
            seen.add(p.resolve())
            out.append(p)
    return out


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
        return TokenStream(open_shards(path), open_loss_masks(path), read_index(path)["eos_id"])
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
        splits = [(w, tokens.held_out(val_fraction)) for w, tokens in train]
        return [(w, head) for w, (head, _) in splits], [(w, tail) for w, (_, tail) in splits]
    return train, None
