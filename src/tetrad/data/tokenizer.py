"""Tokenizers, through HF `tokenizers`: a byte-level BPE trained on the user's text, or an
existing `tokenizer.json` (e.g. Llama 3's), the end-of-document token between documents, and
the tokens a tokenizer starts each document with (its beginning-of-text token, if it has one).

Byte-level BPE starts from the 256 byte symbols, so any text encodes (no unknown token) and
decoding gives the exact bytes back.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tetrad.config import ConfigError
from tetrad.data.blend import primary_source
from tetrad.data.chat import read_json_object
from tetrad.data.shards import TOKENIZER, is_shard_folder, read_index
from tetrad.data.sources import reads_as_bytes
from tetrad.model.sampling import SAMPLING_FIELDS

# Where a text may be cut and its parts encoded apart with the ids of the whole: a line end between
# two characters that are not whitespace, where byte-level BPE's pre-tokenizers (GPT-2's, Llama 3's,
# Qwen's) split anyway. Not at every line end: they merge runs of whitespace ("\n\n" is one Llama 3
# token, and "  \n" one pre-token only at a text's end).
LINE_CUT = re.compile(r"(?<=\S\n)(?=\S)")
PROBE = "Hello world.\nThe fox, 42 times:\n  indented\tline\r\nend.\n\nNext one\n"
GENERATION_CONFIG = "generation_config.json"  # Hugging Face's, beside an imported model's weights
EOS = "<|endoftext|>"
# End-of-document tokens of common tokenizers, tried in order when none is named.
KNOWN_EOS = (EOS, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


def train_bpe(texts: Iterator[str], vocab_size: int, progress: bool = False) -> Tokenizer:
    """A byte-level BPE of `vocab_size` tokens (EOS included) learned from `texts`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS], show_progress=progress,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    return tokenizer


def byte_tokenizer() -> Tokenizer:
    """Bytes as a tokenizer (id = byte value, no merges), what a run on raw text trained with:
    so that such a run decodes, and exports to HF, like any other."""
    # GPT-2's printable stand-ins for the 256 bytes, the alphabet byte-level BPE works in.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    chars = {b: chr(b if b in printable else next(extra)) for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def load_tokenizer(path: Path) -> Tokenizer:
    """A tokenizer.json; ValueError (one line) when it is not one."""
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises its own Exception type for a bad file
        raise ConfigError(f"{path} is not a tokenizer.json that HF tokenizers reads: {str(e).splitlines()[0]}") from None


def special_tokens(tokenizer: Tokenizer) -> dict[str, int]:
    """The tokenizer's special tokens by id order (content: id): the only ones no text encodes to
    (`tetrad data` encodes one written in a text as its characters)."""
    return {t.content: i for i, t in sorted(tokenizer.get_added_tokens_decoder().items()) if t.special}


def eos_id(tokenizer: Tokenizer, name: str = "") -> int:
    """The id of the end-of-document token: `name`, or the first of KNOWN_EOS the tokenizer has, a
    special token either way (as Megatron-LM's and torchtitan's EOS, the tokenizer's eos_token): an
    ordinary token, or an added one that is not special, also comes out of documents' own text, and
    document masking and packing would cut them there."""
    special = special_tokens(tokenizer)
    for candidate in [name] if name else KNOWN_EOS:
        if candidate in special:
            return special[candidate]
    if name:
        what = "is not a special token of the tokenizer: text encodes to it, so documents would also end inside " \
            "their text" if tokenizer.token_to_id(name) is not None else "is no token of the tokenizer"
        raise ValueError(f"--eos {name!r} {what}; name one of its special tokens{_listing(special)}")
    raise ValueError(f"the tokenizer has none of {', '.join(KNOWN_EOS)} as a special token; name its end-of-document "
                     f"token with --eos, one of its special tokens{_listing(special)}")


def _generation_config(source: Path | None) -> dict:
    """The generation_config.json beside a tokenizer.json ({} for none): an imported Hugging Face
    model's, as convert --to-tetrad keeps it (its EOS and sampling settings)."""
    path = source.with_name(GENERATION_CONFIG) if source is not None else None
    if path is None or not path.is_file():
        return {}
    return read_json_object(path, GENERATION_CONFIG)


def keep_generation_config(model_dir: Path, out: Path, config: dict | None = None) -> None:
    """What `tetrad generate` and `convert --to-hf` take from a model folder, into a
    generation_config.json in `out` (beside the tokenizer.json copied there): the model's
    eos_token_id(s) (its generation_config.json's, where transformers' generate stops, else its
    config.json's, `config` where already read; model_eos) and pad_token_id (found alike;
    model_pad: ids of this vocabulary, so they travel with its tokenizer, not with the weights)
    and its generation_config.json's sampling (do_sample, explicit, and Sampling's fields;
    model_sampling). Nothing where the folder has none of them."""
    path = model_dir / GENERATION_CONFIG
    generation = read_json_object(path, GENERATION_CONFIG) if path.is_file() else None
    if config is None:
        config = _model_config(model_dir / "config.json")
    kept = {}
    if generation is not None:
        kept = {k: generation[k] for k in SAMPLING_FIELDS if k in generation}
        kept["do_sample"] = bool(generation.get("do_sample", False))
    for key in ("eos_token_id", "pad_token_id"):
        ids = _token_ids(key, generation or {}, config)
        if ids is not None:
            kept[key] = ids
    if kept:
        (out / GENERATION_CONFIG).write_text(json.dumps(kept) + "\n")


def _model_config(path: Path) -> dict:
    """A model folder's config.json ({} for none)."""
    return read_json_object(path, "config.json") if path.is_file() else {}


def _token_ids(key: str, generation: dict, config: dict):
    """A model's `key` (eos_token_id, pad_token_id): its generation_config.json's, else its
    config.json's (None)."""
    return next((c[key] for c in (generation, config) if c.get(key) is not None), None)


def model_eos(source: Path | None) -> list[int]:
    """The eos_token_id(s) of the generation_config.json beside a tokenizer.json, else of the
    config.json beside it (a Hugging Face model folder's, as keep_generation_config reads one; where
    its generation_config.json names none, transformers 5.25's generate has no EOS at all and runs
    to its max length): an imported model's own (convert --to-tetrad writes them into
    generation_config.json), where transformers' generate stops: Llama 3.1 Instruct's three,
    DeepSeek's one, which the KNOWN_EOS search misses. [] for none."""
    config = _model_config(source.with_name("config.json")) if source is not None else {}
    ids = _token_ids("eos_token_id", _generation_config(source), config)
    ids = [ids] if isinstance(ids, int) else ids if isinstance(ids, list) else []
    return [i for i in ids if isinstance(i, int)]


def model_pad(source: Path | None) -> int | None:
    """The pad_token_id of the generation_config.json beside a tokenizer.json (an imported model's,
    kept as model_eos's ids are), which `convert --to-hf` writes back into config.json; None for none."""
    pad = _generation_config(source).get("pad_token_id")
    return pad if isinstance(pad, int) and not isinstance(pad, bool) else None


def model_sampling(source: Path | None) -> dict:
    """The sampling an imported model's generation_config.json asks for, as transformers' generate
    reads it (its defaults where a key is absent: temperature 1, top_k 50, top_p 1, no min_p, no
    repetition penalty; a null top_k none), as model/sampling.py's Sampling fields: greedy
    (temperature 0) where do_sample is false, the repetition penalty applying either way. {}
    where the model had no generation_config.json of its own (convert writes do_sample only
    from one)."""
    config = _generation_config(source)
    if "do_sample" not in config:
        return {}
    penalty = config.get("repetition_penalty")
    temperature, top_k, top_p, min_p = (config.get("temperature"), config.get("top_k", 50), config.get("top_p"),
                                        config.get("min_p"))
    try:
        settings = {} if penalty is None else {"repetition_penalty": float(penalty)}
        if not config["do_sample"]:
            return {"temperature": 0.0, **settings}
        return {"temperature": 1.0 if temperature is None else float(temperature),
                "top_k": 0 if top_k is None else int(top_k), "top_p": 1.0 if top_p is None else float(top_p),
                "min_p": 0.0 if min_p is None else float(min_p), **settings}
    except (TypeError, ValueError) as e:  # the model's file, not a bug
        raise ConfigError(f"{source.with_name(GENERATION_CONFIG)} holds a sampling setting that is not a number "
                          f"({e}); fix the file, or pass --temperature, --top-k, --top-p, --min-p and --repetition-penalty") from None


def run_eos(tokenizer: Tokenizer, source: Path | None) -> int | None:
    """The end-of-document id of a run whose tokenizer came from `source` (run_tokenizer): what
    `tetrad data --eos` recorded in the shard folder beside it (its index.json's eos_id, what
    the run learned to end documents with), else an imported model's first (model_eos), else
    the KNOWN_EOS search; None for none (bytes)."""
    if source is not None and is_shard_folder(source.parent):
        recorded = read_index(source.parent).get("eos_id")
        if isinstance(recorded, int):
            return recorded
    imported = model_eos(source)
    if imported:
        return imported[0]
    try:
        return eos_id(tokenizer)
    except ValueError:
        return None


def _listing(special: dict[str, int], most: int = 8) -> str:
    """The special tokens, for a refusal: all of a short list, the first of a long one."""
    if not special:
        return ' (it has none: add one to its tokenizer.json\'s added_tokens, with "special": true)'
    names = list(special)
    return f": {', '.join(names[:most])}" + (f", ... ({len(names)} in all)" if len(names) > most else "")


def document_prefix(tokenizer: Tokenizer) -> list[int]:
    """The ids the tokenizer's own post-processor puts before a text (Llama 3's <|begin_of_text|>,
    Llama 2's <s>; none for tetrad's BPE): each document (`tetrad data`) and each prompt (`tetrad
    generate`) starts with them, as HF's `encode` does by default and Megatron-LM's and
    torchtitan's Llama data do, so a model fine-tuned from released weights sees its own format."""
    plain = tokenizer.encode("a", add_special_tokens=False).ids
    full = tokenizer.encode("a", add_special_tokens=True).ids
    return next((full[:at] for at in range(len(full)) if full[at:at + len(plain)] == plain), [])


def cuts_at_lines(tokenizer: Tokenizer) -> bool:
    """Whether the tokenizer encodes a text cut at LINE_CUT into the ids of the whole (tetrad data
    then encodes such parts, in parallel pieces). Not so SentencePiece-style tokenizers (Llama 2's,
    Mistral's: a Metaspace pre-tokenizer or a "▁"-prepending normalizer), which mark each encoded
    text's start with "▁": each document (or .txt piece) is then encoded whole."""
    whole = tokenizer.encode(PROBE, add_special_tokens=False).ids
    parts = tokenizer.encode_batch(LINE_CUT.split(PROBE), add_special_tokens=False)
    return whole == [i for part in parts for i in part.ids]


def vocab_size(tokenizer: Tokenizer) -> int:
    return tokenizer.get_vocab_size(with_added_tokens=True)


def run_tokenizer(folder: Path, data_source: str) -> tuple[Tokenizer, Path | None]:
    """The tokenizer of a run and where it came from: the tokenizer.json beside its checkpoint
    (or HF) `folder`, else its data's (a shard folder); bytes (None) when it trained on text.
    ValueError when the run's data cannot tell (moved, or token ids without a tokenizer)."""
    data_source = primary_source(data_source)  # a blend's sources share its first's tokenizer
    for candidate in (folder / TOKENIZER, Path(data_source) / TOKENIZER):
        if candidate.is_file():
            return load_tokenizer(candidate), candidate
    path = Path(data_source)
    if reads_as_bytes(data_source):
        return byte_tokenizer(), None
    why = "is not found from here" if not path.exists() else "holds token ids but no tokenizer.json"
    raise ConfigError(f"the run's data.source={data_source!r} {why}, so its tokenizer is unknown; run from where "
                      f"it trained, or copy the run's tokenizer.json into {folder}")
