"""Checks of a run's data before any rank starts: every problem is one line naming the fix.

Cheap by construction: headers, dtypes, shapes and sizes are read without loading the data;
token ids are range-checked over the whole file when it is small enough to scan quickly
(memory-mapped, in chunks), else over evenly spread samples (the batches check every window
they read anyway, so a bad id past the sample still stops the run, on the rank that reads it).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tetrad.config import Config, ConfigError, counted
from tetrad.data.shards import (TOKENIZER, end_of_document, is_shard_folder, open_loss_masks, open_shards,
                                 read_index)
from tetrad.data.blend import blend_parts
from tetrad.data.packing import fewest_tokens
from tetrad.data.sources import CORPORA, NPY_DTYPES, TokenStream, load_blend, reads_as_bytes, text_files

SCAN_TOKENS = 1 << 28  # up to this many tokens the whole range is scanned (seconds)
CHUNK = 1 << 22
SAMPLES = 64  # else: this many chunks spread over the data


def check_data(cfg: Config) -> None:
    """Raise ConfigError for the first problem with `data.source` / `data.val_source` (every
    source of a blend)."""
    d, m = cfg.data, cfg.model
    for key, source in (("data.source", d.source), ("data.val_source", d.val_source)):
        if source:
            try:
                parts = blend_parts(source)
            except ValueError as e:
                raise ConfigError(str(e)) from None
            _check_one_tokenizer(key, source, parts)  # first: a second vocabulary is the blend's fault
            for _, part in parts:
                _check_source(key, part, m.vocab_size, cfg.checkpoint.init_from)
    for key in ("document_mask", "reset_positions"):
        if getattr(cfg.train, key):
            _check_document_ends(d.source, d.val_source, f"train.{key}")
    try:
        train, val = load_blend(d.source, d.val_source, d.val_fraction)
    except (OSError, ValueError) as e:
        raise ConfigError(f"data.source={d.source!r} cannot be read: {e}") from None
    sources = [("data.source", name, tokens) for (_, name), (_, tokens) in zip(blend_parts(d.source), train)]
    if val is not None:
        held_out = blend_parts(d.val_source) if d.val_source else blend_parts(d.source)
        sources += [("the validation tokens", name, tokens) for (_, name), (_, tokens) in zip(held_out, val)]
    for what, name, tokens in sources:
        if len(tokens) < fewest_tokens(tokens, m.seq_len):
            raise ConfigError(_too_few(cfg, what, name, tokens))
    for what, name, tokens in sources:
        _check_ids("data.source" if what == "data.source" else "data.val_source", tokens, m.vocab_size)


def _too_few(cfg: Config, what: str, name: str, tokens: TokenStream) -> str:
    """A source (or its held-out part) too short for one window, and what would lengthen it: a
    shorter seq_len does not, for packed examples; data.val_fraction moves tokens from training
    to validation, so the fix is a smaller one for the first and a larger one for the second."""
    d, m = cfg.data, cfg.model
    packed = tokens.loss_masks is not None
    needed = "two tokens (one example)" if packed else f"model.seq_len+2 = {m.seq_len + 2}"
    fixes = ["more data"] + ([] if packed else ["a shorter seq_len"])
    if d.val_fraction > 0 and not d.val_source:
        fixes.append(f"a {'smaller' if what == 'data.source' else 'larger'} data.val_fraction (now {d.val_fraction:g})")
    where = f" ({name})" if name != d.source else ""
    holds = "holds" if what == "data.source" else "hold"
    return f"{what}{where} {holds} {counted(len(tokens), 'token')}, fewer than {needed}; use {', or '.join(fixes)}"


def _check_document_ends(source: str, val_source: str, key: str) -> None:
    """Document masking and position reset (`key`) need the token that ends a document, one for
    training and validation."""
    try:
        eos = end_of_document(source)
        if val_source and end_of_document(val_source) != eos:
            raise ValueError(f"data.val_source ends documents with token {end_of_document(val_source)}, "
                             f"data.source with {eos}; tokenize both with one tokenizer")
    except ValueError as e:
        raise ConfigError(f"{key}: {e}; or set {key}=false") from None


def _tokenizer_of(source: str) -> str | None:
    """What a source's ids mean: its shard folder's tokenizer.json (text), "bytes", or None for
    token files, which do not say."""
    path = Path(source)
    if reads_as_bytes(source):
        return "bytes"
    if is_shard_folder(path) and (path / TOKENIZER).is_file():
        return (path / TOKENIZER).read_text()
    return None


def _check_one_tokenizer(key: str, source: str, parts: list) -> None:
    """A blend's sources must share one vocabulary: ids of two tokenizers would mean different
    text to one embedding."""
    first = parts[0][1]
    known = _tokenizer_of(first)
    for _, part in parts[1:]:
        theirs = _tokenizer_of(part)
        if known is not None and theirs is not None and theirs != known:
            kind = {first: known, part: theirs}
            said = ", ".join(f"{name!r} {'is read as bytes' if kind[name] == 'bytes' else 'has its own tokenizer'}"
                             for name in (first, part))
            tokenizer = Path(first) / TOKENIZER if known != "bytes" else Path(part) / TOKENIZER
            raise ConfigError(f"{key} blends sources in different vocabularies ({said}); tokenize every source "
                              f"with one tokenizer: `tetrad data TEXT --tokenizer {tokenizer} --out DATA`")


def _check_source(key: str, source: str, vocab_size: int, init_from: str) -> None:
    if source in CORPORA:
        return _check_bytes(key, source, vocab_size)
    path = Path(source)
    if not path.exists():
        raise ConfigError(f"{key}={source!r} is neither a built-in corpus ({', '.join(CORPORA)}) nor an existing "
                          "file or folder" + _blend_hint(source) + _prefix_hint(source))
    if is_shard_folder(path):
        return _check_shards(key, path, vocab_size, init_from)
    if path.is_dir():
        if not text_files(path):
            raise ConfigError(f"{key}={source!r} is a folder without .txt files (nor an index.json from `tetrad "
                              "data`); point it at text, or prepare the folder with `tetrad data`")
        return _check_bytes(key, source, vocab_size)
    if path.stat().st_size == 0:
        raise ConfigError(f"{key}={source!r} is an empty file")
    if path.suffix == ".bin" and path.stat().st_size % 2:
        raise ConfigError(f"{key}={source!r} has an odd size ({path.stat().st_size} bytes); a .bin holds uint16 "
                          "token ids (2 bytes each): the file is truncated or not a token file")
    if path.suffix == ".npy":
        return _check_npy(key, path)
    if path.suffix == ".bin":
        _check_megatron(key, path)
    else:
        _check_bytes(key, source, vocab_size)


# Megatron-LM's indexed dataset: the .idx beside the .bin starts with this, a version (u64) and the
# code of the tokens' dtype (u8; 8 is uint16, what vocabularies under 65,500 get, else 4, int32).
MEGATRON_INDEX = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 8: "uint16"}


def _check_megatron(key: str, path: Path) -> None:
    """A .bin is read as raw uint16, which a Megatron-LM dataset of int32 tokens (Llama 3's
    vocabulary) is not: every id would read as two, in range, and train on noise."""
    try:
        with open(path.with_suffix(".idx"), "rb") as f:
            head = f.read(18)
    except OSError:
        return
    if len(head) == 18 and head.startswith(MEGATRON_INDEX) and head[17] != 8:
        dtype = MEGATRON_DTYPES.get(head[17], f"dtype code {head[17]}")
        raise ConfigError(f"{key}={str(path)!r} is a Megatron-LM dataset of {dtype} tokens (its .idx says), and "
                          "tetrad reads a .bin as uint16; save the ids as a .npy (np.save('tokens.npy', "
                          f"np.fromfile('{path}', np.{dtype}).astype(np.uint32))) or tokenize the text with "
                          "`tetrad data`")


def _prefix_hint(source: str) -> str:
    """Megatron-LM names a dataset by its prefix, without .bin/.idx: the file tetrad would read."""
    return f"; for Megatron-LM's prefix, give the file: {source}.bin" if Path(source + ".bin").is_file() else ""


def _blend_hint(source: str) -> str:
    """Sources listed without weights (Megatron-LM also takes that form): how to write the blend."""
    words = source.split()
    if len(words) < 2 or not all(w in CORPORA or Path(w).exists() for w in words):
        return ""
    return f"; a blend gives each source a weight: {' '.join(f'1 {w}' for w in words)!r}"


def _check_bytes(key: str, source: str, vocab_size: int) -> None:
    if vocab_size < 256:
        raise ConfigError(f"{key}={source!r} is read as bytes (ids 0-255) but model.vocab_size={vocab_size}; "
                          "use model.vocab_size >= 256")


def _check_npy(key: str, path: Path) -> None:
    try:
        array = np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:  # object arrays (pickled), or a header numpy cannot read
        raise ConfigError(f"{key}={str(path)!r} is not a plain numeric .npy ({str(e).splitlines()[0]}); save token "
                          "ids with np.save(path, ids.astype(np.uint16 or np.uint32))") from None
    if array.dtype not in NPY_DTYPES or array.ndim != 1:
        raise ConfigError(f"{key}={str(path)!r} holds {array.dtype} with shape {array.shape}; token ids are a 1-D "
                          f"array of {'/'.join(np.dtype(t).name for t in NPY_DTYPES)}")


def _check_shards(key: str, path: Path, vocab_size: int, init_from: str) -> None:
    """The index and the sizes of the shards and of their loss masks (where the index says it has
    them); the tokenizer's vocabulary is the model's (a released model's may be larger: padded,
    under checkpoint.init_from)."""
    try:
        index = read_index(path)
        open_shards(path)
        open_loss_masks(path)
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None
    if index["vocab_size"] != vocab_size and not (init_from and vocab_size > index["vocab_size"]):
        raise ConfigError(f"{key}={str(path)!r} was tokenized with a {index['vocab_size']}-token vocabulary but "
                          + _vocabulary_fix(vocab_size, init_from))


def _vocabulary_fix(vocab_size: int, init_from: str) -> str:
    """Who set model.vocab_size, and the fix: under init_from the weights (a different one set here
    was refused before), else the user."""
    if not init_from:
        return (f"model.vocab_size={vocab_size}; tokenize with the model's tokenizer, or drop model.vocab_size "
                "(it follows the data)")
    as_bytes = ", or give the text itself, read as bytes" if vocab_size == 256 else ""
    return (f"the weights of checkpoint.init_from={init_from!r} have {vocab_size} (model.vocab_size follows them); "
            f"tokenize the text with their tokenizer{as_bytes}")


def _check_ids(key: str, tokens: TokenStream, vocab_size: int) -> None:
    """Every id in [0, vocab_size): all of them when that is quick, else a spread sample."""
    for piece in tokens.pieces:
        if piece.dtype == np.uint8:
            continue  # bytes: checked against the vocabulary above
        starts = range(0, len(piece), CHUNK) if len(piece) <= SCAN_TOKENS else \
            np.linspace(0, len(piece) - 1, SAMPLES, dtype=np.int64).tolist()
        for start in starts:
            chunk = np.asarray(piece[start:start + CHUNK])
            low, high = int(chunk.min()), int(chunk.max())
            if low < 0 or high >= vocab_size:
                bad = low if low < 0 else high
                raise ConfigError(f"{key} holds token id {bad}, outside [0, model.vocab_size={vocab_size}); "
                                  + ("ids must not be negative" if bad < 0 else
                                     f"use model.vocab_size > {bad} or check the data"))
