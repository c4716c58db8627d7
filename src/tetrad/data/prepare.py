"""`tetrad data`: a folder (or files) of text -> a shard folder a run trains on (shards.py).

Each `.txt` file is one document, each line of a `.jsonl` file one, each row of a `.parquet`
file one (documents.py: the text under `--json-key`). A
BPE tokenizer is trained on a sample of the text (or an existing tokenizer.json is taken), then
worker processes tokenize the files in pieces of a few MB, cut at line ends, while this process
writes the pieces in order into shards, an EOS token after each document, starting a new shard
only between documents.

With `--prompt-key` each line or row is a supervised fine-tuning example instead: prompt and
response are tokenized apart (as torchtune tokenizes each message) and written one after the
other, with a loss mask beside each shard that counts the response and its EOS only, so that the
model learns to answer (and to stop) without being trained to write prompts.

With `--chat-key` each line or row is a conversation, rendered with the model's chat template
(chat.py), the loss mask counting the assistant's turns only.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from tetrad.config import counted
from tetrad.data.chat import ChatTemplate, Conversations, load_template, save_template
from tetrad.data.documents import (Piece, check_documents, input_files, piece_records, pieces, sample_texts,
                                    text_bytes)
from tetrad.data.shards import TOKENIZER, dtype_for, mask_name, shard_name, write_index
from tetrad.data.tokenizer import (EOS, LINE_CUT, cuts_at_lines, document_prefix, eos_id, keep_generation_config,
                                   load_tokenizer, train_bpe, vocab_size)


class _Encoder:
    """A worker's tokenizer (built once per process from its JSON), its chat template's renderer
    for conversations, and the piece encoder."""

    def __init__(self, tokenizer_json: str, eos: int, dtype: str, keys: tuple[str, ...], chat: ChatTemplate | None):
        from tokenizers import Tokenizer
        self.tokenizer, self.eos, self.dtype = Tokenizer.from_str(tokenizer_json), eos, np.dtype(dtype)
        self.keys, self.prefix, self.cut = keys, document_prefix(self.tokenizer), cuts_at_lines(self.tokenizer)
        self.chat = None if chat is None else Conversations(chat, self.tokenizer, eos)
        # A document, prompt or response is text: "<|endoftext|>" written in it is characters, not
        # the EOS that would end it there (packing and document masking cut at each EOS), nor is
        # Llama 3's "<|start_header_id|>" a control token (as nanoGPT's encode_ordinary and
        # torchtitan read text). A chat template's markup is the model's own: parsed.
        self.tokenizer.encode_special_tokens = chat is None

    def __call__(self, piece: Piece) -> tuple[list, int]:
        """The piece's documents (ids, or ids and loss mask), and how many examples or
        conversations it leaves out (an empty response; no assistant turn), which the summary counts."""
        if self.chat is not None:
            return self.conversations(piece)
        return self.examples(piece) if len(self.keys) > 1 else (self.documents(piece), 0)

    def documents(self, piece: Piece) -> list[np.ndarray]:
        """A .txt piece's ids (the tokenizer's document prefix before the file's first, EOS after
        its last), or each of another piece's documents' ids, prefix and EOS around them: the ids of
        the tokenizer's encode of each document whole."""
        texts = [text for (text,) in piece_records(piece, self.keys)]
        # Cut at the line ends where the tokenizer's pre-tokenizer splits anyway (LINE_CUT), where
        # it gives the whole's ids: one encode of megabytes takes twice as long. A SentencePiece-style
        # tokenizer encodes each piece whole: a .txt file over PIECE_BYTES gets a "▁" at each of
        # its pieces' starts (one token in a million, where a piece a file would hold gigabytes).
        lines = [LINE_CUT.split(text) if self.cut else [text] for text in texts]
        encoded = iter(self.tokenizer.encode_batch_fast([line for text in lines for line in text],
                                                        add_special_tokens=False))
        whole = piece.whole_documents
        starts, ends = whole or piece.start == 0, whole or piece.last
        return [np.array((self.prefix if starts else []) + [i for _ in text for i in next(encoded).ids]
                         + ([self.eos] if ends else []), dtype=self.dtype) for text in lines]

    def examples(self, piece: Piece) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
        """Each fine-tuning example's ids, prefix + prompt + response + EOS, and its loss mask: 1
        on the response and the EOS; and how many were left out for an empty (or null) response.
        Each text is encoded whole: examples are short, and the ids are then exactly the
        tokenizer's encode of each."""
        records = piece_records(piece, self.keys, empty=True)
        encoded = self.tokenizer.encode_batch_fast([text for record in records if record is not None
                                                    for text in record], add_special_tokens=False)
        out = []
        for prompt, response in zip(encoded[::2], encoded[1::2]):
            ids = np.array(self.prefix + prompt.ids + response.ids + [self.eos], dtype=self.dtype)
            mask = np.zeros(len(ids), dtype=np.uint8)
            mask[len(self.prefix) + len(prompt.ids):] = 1
            out.append((ids, mask))
        return out, records.count(None)

    def conversations(self, piece: Piece) -> tuple[list[tuple[np.ndarray, np.ndarray]], int]:
        """Each conversation's ids and loss mask (chat.py), without the document prefix: templates
        render their own (Llama 3's {{ bos_token }}); and how many were left out for having no
        assistant turn (an empty or null list of messages included)."""
        out, left_out = [], 0
        for record in piece_records(piece, self.keys, chat=True, empty=True):
            encoded = None if record is None else self.chat.encode(record[1], f"{piece.path}: {record[0]}")
            if encoded is None:
                left_out += 1
            else:
                out.append((np.array(encoded[0], dtype=self.dtype), encoded[1]))
        return out, left_out


def _start_worker(*args) -> None:
    global _ENCODER  # one per worker process, set once by the pool's initializer
    _ENCODER = _Encoder(*args)


def _encode(piece: Piece) -> np.ndarray:
    return _ENCODER(piece)


@contextlib.contextmanager
def _forked_pool(workers: int, encoder_args: tuple):
    """Worker processes, forked (a spawned worker would re-import the command line, torch
    included, for seconds each). Each encodes one piece at a time on one thread: tokenizers'
    own threads are off in the forked workers, said beforehand so that it does not warn."""
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    before = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with context.Pool(workers, _start_worker, encoder_args) as pool:
            yield pool
    finally:
        if before is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = before


class ShardWriter:
    """Writes documents in order into shards of about `shard_tokens` tokens (a document is never
    cut); `masked`: each document comes with its loss mask, written beside its shard (mask_name).
    `counted`: how many tokens the loss counts (all of them, unmasked)."""

    def __init__(self, folder: Path, shard_tokens: int, masked: bool = False):
        self.folder, self.shard_tokens, self.masked = folder, shard_tokens, masked
        self.shards: list[dict] = []
        self.files: list = []  # the shard's, and its mask's
        self.counted = 0

    def add_document(self, parts: list[np.ndarray], mask: np.ndarray | None = None) -> None:
        n = sum(len(p) for p in parts)
        if not self.files or (self.shards[-1]["tokens"] and self.shards[-1]["tokens"] + n > self.shard_tokens):
            self._next_shard()
        for part in parts:
            self.files[0].write(part.tobytes())
        if self.masked:
            self.files[1].write(mask.tobytes())
        self.counted += int(np.count_nonzero(mask)) if self.masked else n
        self.shards[-1]["tokens"] += n
        self.shards[-1]["documents"] += 1

    def _next_shard(self) -> None:
        self.close()
        self.shards.append({"file": shard_name(len(self.shards)), "tokens": 0, "documents": 0})
        names = [self.shards[-1]["file"]] + ([mask_name(self.shards[-1]["file"])] if self.masked else [])
        self.files = [(self.folder / name).open("wb") for name in names]

    def close(self) -> list[dict]:
        for file in self.files:
            file.close()
        return self.shards


def tokenize(files: list[Path], tokenizer, eos: int, out: Path, shard_mb: float, workers: int,
             keys: tuple[str, ...], chat: ChatTemplate | None = None) -> tuple[dict, int, int]:
    """Tokenize `files` into shards in `out` with `workers` processes, the records under `keys`
    (a prompt's key before the text's: fine-tuning examples, masked; with `chat`, conversations
    rendered with it, masked); returns the index, how many tokens the loss counts, and how many
    examples or conversations were left out (_Encoder)."""
    size = vocab_size(tokenizer)
    dtype = dtype_for(size)
    writer = ShardWriter(out, max(1, int(shard_mb * 2**20) // dtype.itemsize), masked=len(keys) > 1 or chat is not None)
    work = [p for f in files for p in pieces(f)]
    with _forked_pool(workers, (tokenizer.to_str(), eos, dtype.str, keys, chat)) as pool, \
            tqdm(total=sum(p.nbytes for p in work), unit="B", unit_scale=True, desc="tokenizing",
                 disable=None) as bar:
        document: list[np.ndarray] = []  # a .txt file's pieces so far
        left_out = 0
        for piece, (encoded, dropped) in zip(work, pool.imap(_encode, work)):
            bar.update(piece.nbytes)
            left_out += dropped
            if piece.whole_documents:
                for result in encoded:  # ids, or (ids, loss mask) for fine-tuning examples
                    ids, mask = result if writer.masked else (result, None)
                    writer.add_document([ids], mask)
                continue
            document += encoded
            if piece.last:
                writer.add_document(document)
                document = []
    return write_index(out, writer.close(), size, eos, loss_mask=writer.masked), writer.counted, left_out


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tetrad data", description="Train a byte-level BPE tokenizer on text "
                                     "(or take a tokenizer.json) and tokenize the text into memory-mapped shards "
                                     "that `data.source` reads. Each .txt file is one document, each line of a "
                                     ".jsonl file one, each row of a .parquet file one; with --prompt-key each "
                                     "line or row is a fine-tuning example (prompt, response) instead, with "
                                     "--chat-key a conversation.")
    parser.add_argument("inputs", nargs="+", type=Path, help="text, JSON Lines or parquet files, or folders of "
                                                             ".txt, .jsonl and .parquet files")
    parser.add_argument("--json-key", default="text", help="the key of each .jsonl line's text, or the "
                        ".parquet column of texts (default: text); with --prompt-key, of the responses")
    examples = parser.add_mutually_exclusive_group()
    examples.add_argument("--prompt-key", help="supervised fine-tuning data: the key (or column) of each example's "
                          "prompt, written before its response under --json-key; the loss counts only the "
                          "response's tokens and its EOS (a loss mask beside each shard). .jsonl and .parquet only")
    examples.add_argument("--chat-key", help="chat fine-tuning data: the key (or list<struct<role, content>> "
                          "column) of each conversation's messages, rendered with the model's chat template; the "
                          "loss counts only the assistant's turns. Needs --tokenizer. .jsonl and .parquet only")
    parser.add_argument("--chat-template", type=Path, help="with --chat-key: a tokenizer_config.json (its "
                        "chat_template) or a .jinja file (default: the tokenizer_config.json beside --tokenizer)")
    parser.add_argument("--out", type=Path, required=True, help="the shard folder to write (new or empty)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--vocab-size", type=int, default=8192, help="BPE vocabulary to train (default 8192)")
    source.add_argument("--tokenizer", type=Path, help="an existing tokenizer.json (or a model folder holding one) "
                        "instead of training one")
    parser.add_argument("--eos", default="", help="end-of-document token (default: the tokenizer's usual one)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="tokenizing processes")
    parser.add_argument("--shard-mb", type=float, default=256.0, help="shard size in MB (default 256)")
    parser.add_argument("--sample-mb", type=float, default=256.0,
                        help="MB of text the BPE merges are learned from (default 256)")
    args = parser.parse_args(argv)
    if args.out.exists() and (not args.out.is_dir() or any(args.out.iterdir())):
        raise ValueError(f"--out {args.out} exists and is not an empty folder; choose a new one")
    if args.tokenizer is not None and args.tokenizer.is_dir():  # a Hugging Face model's folder: its tokenizer.json
        if not (args.tokenizer / TOKENIZER).is_file():
            raise ValueError(f"--tokenizer {args.tokenizer} is a folder without a {TOKENIZER}; pass the tokenizer.json")
        args.tokenizer = args.tokenizer / TOKENIZER
    if args.tokenizer is None and not 257 <= args.vocab_size <= 2**32:
        raise ValueError(f"--vocab-size={args.vocab_size} must be in [257, 2^32] (256 bytes + EOS at least)")
    if args.tokenizer is None and args.eos not in ("", EOS):
        raise ValueError(f"--eos {args.eos!r} is for a --tokenizer; the BPE tetrad data trains ends documents "
                         f"with its special token {EOS} (leave --eos out)")
    if args.workers < 1 or args.shard_mb <= 0 or args.sample_mb <= 0:
        raise ValueError("--workers must be >= 1, --shard-mb and --sample-mb > 0")
    if args.prompt_key == args.json_key:
        raise ValueError(f"--prompt-key and --json-key both name {args.json_key!r}; the prompt and the response "
                         "are two keys of each example")
    if args.chat_key is not None and args.tokenizer is None:
        raise ValueError("--chat-key needs --tokenizer: the model's tokenizer.json, which its chat template is for")
    if args.chat_template is not None and args.chat_key is None:
        raise ValueError("--chat-template is for conversations; name their key with --chat-key")
    args.keys = (args.chat_key,) if args.chat_key is not None else \
        (args.json_key,) if args.prompt_key is None else (args.prompt_key, args.json_key)
    return args


def data_command(argv: list[str]) -> int:
    try:
        args = _arguments(argv)
        files, left_out, repeats = input_files(args.inputs)
        legacy = check_documents(files, args.keys, chat=args.chat_key is not None)
        tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer is not None else None
        if tokenizer is not None:
            eos_id(tokenizer, args.eos)  # refused before any work
        args.chat = load_template(args.chat_template, args.tokenizer) if args.chat_key is not None else None
    except ValueError as e:
        print(f"tetrad data: {e}", file=sys.stderr)
        return 2
    if left_out:
        print(f"tetrad data: {counted(len(left_out), 'file')} in the input folders left out (not .txt, .jsonl or "
              f".parquet), e.g. {left_out[0]}; name them as inputs to include them", flush=True)
    if legacy:
        print(f"tetrad data: {counted(len(legacy), 'input file')} not in UTF-8, e.g. {legacy[0]}: bytes that are not "
              "UTF-8 read as U+FFFD ('\ufffd'); convert them first to keep their characters (iconv -f cp1252 -t utf-8)", flush=True)
    if repeats:
        print(f"tetrad data: {counted(len(repeats), 'input file')} named before (twice, or through a link), read "
              f"once, e.g. {repeats[0]}", flush=True)
    # Written beside the final folder and renamed when complete: a crash leaves no half folder.
    partial = args.out.with_name(args.out.name + ".partial")
    try:
        (index, loss_tokens, dropped), (started, trained, done) = _write_shards(args, files, tokenizer, partial)
    except ValueError as e:  # a .jsonl line or .parquet file past the part checked up front that is not a document
        shutil.rmtree(partial, ignore_errors=True)
        print(f"tetrad data: {e}", file=sys.stderr)
        return 2
    if args.out.exists():
        args.out.rmdir()  # checked empty above
    partial.rename(args.out)
    total = text_bytes(files)
    counted_as = "response" if args.chat is None else "assistant"
    masked = f"of which {loss_tokens / max(index['tokens'], 1):.0%} are {counted_as} tokens the loss counts; " \
        if index["loss_mask"] else ""
    print(f"tetrad data: {_documents(args, index['documents'], dropped)}, {counted(index['tokens'], 'token')} "
          f"({masked}vocab {index['vocab_size']}, {index['dtype']}) in {counted(len(index['shards']), 'shard')} at "
          f"{args.out}; tokenized {total / 1e6:.1f} MB in {done - trained:.1f} s = "
          f"{total / 1e6 / (done - trained):.1f} MB/s with {counted(args.workers, 'process', 'processes')}"
          + (f"; tokenizer trained in {trained - started:.1f} s" if args.tokenizer is None else ""))
    print(f"tetrad data: train on it with --data.source={args.out} (model.vocab_size follows: {index['vocab_size']})"
          + ("; with train.document_mask=true packed examples do not attend to each other"
             if index["loss_mask"] else ""))
    return 0


def _write_shards(args: argparse.Namespace, files: list[Path], tokenizer, partial: Path) -> tuple[tuple, tuple]:
    """Train the tokenizer (unless given), then write it and the shards into `partial`; the index
    and the count of tokens the loss counts (tokenize's), and the times (start, tokenizer trained,
    shards written)."""
    started = time.perf_counter()
    if tokenizer is None:
        total, sample = text_bytes(files), int(args.sample_mb * 2**20)
        learned = f"the {total / 1e6:.1f} MB of text" if total <= sample else \
            f"{args.sample_mb:g} MB of the {total / 1e6:.1f} MB of text (--sample-mb)"
        print(f"tetrad data: training a {args.vocab_size}-token BPE on {learned}", flush=True)
        tokenizer = train_bpe(sample_texts(files, sample, args.keys), args.vocab_size, progress=sys.stderr.isatty())
    trained = time.perf_counter()
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    tokenizer.save(str(partial / TOKENIZER))
    if args.tokenizer is not None:  # a model's: its EOS ids and sampling, for a run fine-tuned on this data
        keep_generation_config(args.tokenizer.parent, partial)
    if args.chat is not None:
        save_template(args.chat, partial)
    written = tokenize(files, tokenizer, eos_id(tokenizer, args.eos), partial, args.shard_mb, args.workers,
                       args.keys, args.chat)
    if not written[0]["documents"]:  # a folder of no shards, which a run could not read
        raise ValueError(_nothing_found(args))
    return written, (started, trained, time.perf_counter())


def _documents(args: argparse.Namespace, written: int, dropped: int) -> str:
    """What the summary calls the documents written, and those left out (as the other drops, a
    file or a line the command did not read, are said): fine-tuning examples without a response,
    conversations without an assistant turn."""
    noun, why = ("conversation", "without an assistant turn") if args.chat is not None else \
        ("example", "with an empty response") if args.prompt_key is not None else ("document", "")
    return counted(written, noun) + (f" ({dropped:,} more {why} left out)" if dropped else "")


def _nothing_found(args: argparse.Namespace) -> str:
    """Why the inputs gave no document, and which key to check."""
    if args.chat is not None:
        return (f"no conversation under --chat-key {args.chat_key!r} has an assistant turn (those without are left "
                "out); check the key and the messages' roles")
    if args.prompt_key is not None:
        return f"every example's response under --json-key {args.json_key!r} is empty (such examples are left out)"
    return f"every text is empty (blank lines, and empty or null texts under --json-key {args.json_key!r}, are no documents)"
