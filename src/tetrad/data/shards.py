"""Shard folders, as `tetrad data` writes them and runs read them.

    FOLDER/index.json        {"format", "dtype", "vocab_size", "eos_id", "documents", "tokens",
                              "loss_mask", "shards": [{"file", "tokens", "documents"}, ...]}
    FOLDER/shard_00000.bin   raw token ids (uint16 when the vocabulary fits, else uint32):
                             documents one after the other, each followed by the EOS token;
                             a document never straddles two shards
    FOLDER/shard_00000.mask  only where index.json says "loss_mask": true (supervised fine-tuning
                             data): one uint8 per token of the shard, 1 where the loss counts the
                             token as a label (a response's tokens and its EOS), 0 where it does
                             not (a prompt's tokens, the tokenizer's document prefix)
    FOLDER/tokenizer.json    the HF `tokenizers` tokenizer that made them

Shards are memory-mapped when read, so a run touches only the windows it samples.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tetrad.data.blend import blend_parts, primary_source

INDEX = "index.json"
TOKENIZER = "tokenizer.json"
FORMAT = 1


def dtype_for(vocab_size: int) -> np.dtype:
    """The smallest unsigned type that holds every id of the vocabulary."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def shard_name(i: int) -> str:
    return f"shard_{i:05d}.bin"


def mask_name(shard_file: str) -> str:
    """The loss-mask file beside a shard: shard_00000.bin -> shard_00000.mask."""
    return str(Path(shard_file).with_suffix(".mask"))


def is_shard_folder(path: Path) -> bool:
    return path.is_dir() and (path / INDEX).is_file()


def write_index(folder: Path, shards: list[dict], vocab_size: int, eos_id: int, loss_mask: bool = False) -> dict:
    """`loss_mask`: every shard has its mask file beside it (mask_name)."""
    index = {"format": FORMAT, "dtype": dtype_for(vocab_size).name, "vocab_size": vocab_size, "eos_id": eos_id,
             "documents": sum(s["documents"] for s in shards), "tokens": sum(s["tokens"] for s in shards),
             "loss_mask": loss_mask, "shards": shards}
    (folder / INDEX).write_text(json.dumps(index, indent=1) + "\n")
    return index


def read_index(folder: Path) -> dict:
    """The folder's index; ValueError (one line) when it is not one `tetrad data` wrote."""
    try:
        index = json.loads((folder / INDEX).read_text())
        shards, dtype = index["shards"], np.dtype(index["dtype"])
        int(index["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{folder / INDEX} is not a tetrad shard index ({e}); rebuild it with `tetrad data`") from None
    if dtype not in (np.uint16, np.uint32) or not isinstance(shards, list) or not shards:
        raise ValueError(f"{folder / INDEX} names dtype {dtype} and {len(shards)} shards; rebuild it with `tetrad data`")
    return index


def end_of_document(source: str) -> int:
    """The id of the token that ends each document of `source` (every source of a blend): where
    document masking (train.document_mask) cuts a window. ValueError naming the fix where a source
    does not say (text read as bytes and token files have no EOS) or two sources disagree."""
    found = set()
    for _, part in blend_parts(source):
        eos = read_index(Path(part)).get("eos_id") if is_shard_folder(Path(part)) else None
        if not isinstance(eos, int):
            raise ValueError(f"{part!r} does not say which token ends a document (a shard folder's index.json "
                             "does); tokenize the text with `tetrad data TEXT --out DATA` and train on DATA")
        found.add(eos)
    if len(found) > 1:
        raise ValueError(f"the sources end documents with different tokens ({sorted(found)}); tokenize every "
                         "source with one tokenizer")
    return found.pop()


def open_shards(folder: Path) -> list[np.ndarray]:
    """Every shard of the folder, memory-mapped, in order; sizes checked against the index."""
    index = read_index(folder)
    return [_mapped(folder / shard["file"], shard["tokens"], np.dtype(index["dtype"])) for shard in index["shards"]]


def open_loss_masks(folder: Path) -> list[np.ndarray] | None:
    """Each shard's loss mask (uint8, memory-mapped), in order; None for a folder without them."""
    index = read_index(folder)
    if not index.get("loss_mask"):
        return None
    return [_mapped(folder / mask_name(shard["file"]), shard["tokens"], np.dtype(np.uint8)) for shard in index["shards"]]


def _mapped(path: Path, count: int, dtype: np.dtype) -> np.ndarray:
    if not path.is_file() or path.stat().st_size != count * dtype.itemsize:
        raise ValueError(f"{path}: missing or not {count} {dtype.name} values as {INDEX} says; "
                         "rebuild the folder with `tetrad data`")
    return np.memmap(path, dtype=dtype, mode="r")


def model_keys(raw: dict) -> dict:
    """[model] keys a raw config's data decides: a shard folder's vocabulary is the model's (the
    first source's, for a blend)."""
    source = raw.get("data", {}).get("source")
    if not isinstance(source, str) or not is_shard_folder(Path(primary_source(source))):
        return {}
    try:
        return {"vocab_size": read_index(Path(primary_source(source)))["vocab_size"]}
    except ValueError:
        return {}  # data/checks.py names the problem
