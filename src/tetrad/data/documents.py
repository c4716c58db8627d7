"""Where `tetrad data` finds documents in its input files, and how it cuts the files into pieces
its workers tokenize in parallel.

A `.txt` file is one document, cut at line ends. Each line of a `.jsonl` file (JSON Lines, as
datasets are exported and Megatron-LM's preprocess_data.py reads them) is one, its text under the
key `--json-key` names. Each row of a `.parquet` file (as Hugging Face datasets such as FineWeb
are published) is one, its text in the column of that name; a piece is a run of row groups, read
one column at a time with pyarrow (an optional dependency: `pip install pyarrow`).

A line or row is read as a record: the strings under its keys, the text's last. Supervised
fine-tuning examples (`--prompt-key`) are records of two, (prompt, response), kept apart so that
the loss can count the response alone; a text file has no prompt, so only .jsonl and .parquet
files hold them. A chat record (`--chat-key`, chat.py) is (where, messages): the messages under
the key (a list<struct<role, content>> column in parquet), and where the line or row is, which
an error in rendering it names (that happens later, in a worker).
"""

from __future__ import annotations

import codecs
import itertools
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tetrad.config import counted
from tetrad.data.chat import MESSAGES, is_conversation
from tetrad.data.sources import visible_files

PIECE_BYTES = 4 << 20
DOCUMENT_SUFFIXES = (".txt", ".jsonl", ".parquet")  # a document per file; per line; per row
WHOLE_DOCUMENTS = (".jsonl", ".parquet")  # any other file named as an input is text, one document


@dataclass(frozen=True)
class Piece:
    """Part of one file: bytes [start, end) of a .txt or .jsonl file, or row groups [start, end)
    of a .parquet file; `last`: the file ends here (a .txt document: EOS follows); `nbytes`: the
    text's size, for progress and the tokenizer's sample."""
    path: str
    start: int
    end: int
    last: bool
    nbytes: int

    @property
    def suffix(self) -> str:
        return Path(self.path).suffix

    @property
    def whole_documents(self) -> bool:
        """Each text the piece yields is a document (not so a part of a .txt file)."""
        return self.suffix in WHOLE_DOCUMENTS


def input_files(inputs: list[Path]) -> tuple[list[Path], list[Path], list[Path]]:
    """The documents' files: each input file, and every document file under each input folder
    (hidden ones aside: sources.visible_files), each file once; the other files under those
    folders, left out; and the repeats left out (a file named twice, or a link to one named
    before): the command names both. A repeat would be tokenized twice, and with
    data.val_fraction a copy could be trained on while the other is held out for validation."""
    files, left_out = [], []
    for path in inputs:
        if not path.exists():
            raise ValueError(f"{path} does not exist")
        inside = visible_files(path) if path.is_dir() else []
        found = [f for f in inside if f.suffix in DOCUMENT_SUFFIXES] if path.is_dir() else [path]
        if not found:
            raise ValueError(f"{path} holds no {', '.join(DOCUMENT_SUFFIXES)} files")
        files += found
        left_out += [f for f in inside if f.suffix not in DOCUMENT_SUFFIXES]
    if not any(f.stat().st_size for f in files):
        raise ValueError(f"every input file is empty ({counted(len(files), 'file')})")
    once, repeats, named = [], [], set()
    for f in files:
        (repeats if f.resolve() in named else once).append(f)
        named.add(f.resolve())
    return once, [f for f in left_out if f.resolve() not in named], repeats


def pieces(path: Path, piece_bytes: int = PIECE_BYTES) -> list[Piece]:
    """`path` cut into pieces of about `piece_bytes`: at line ends, or between row groups."""
    return list(iter_pieces(path, piece_bytes))


def iter_pieces(path: Path, piece_bytes: int = PIECE_BYTES) -> Iterator[Piece]:
    """`pieces`, found as they are taken: the first few of a file of gigabytes without a read of
    64 KB at every piece's end all through it. A line end between two printable ASCII characters
    is taken where there is one (tokenizer.LINE_CUT: a text's pieces then encode as the whole
    does), else any."""
    if path.suffix == ".parquet":
        yield from _parquet_pieces(path, piece_bytes)
        return
    size, start = path.stat().st_size, 0
    with path.open("rb") as f:
        while start < size:
            f.seek(min(start + piece_bytes, size))
            ahead = f.read(1 << 16) if start + piece_bytes < size else b""
            found = re.search(rb"[\x21-\x7e]\n(?=[\x21-\x7e])", ahead)
            newline = found.end() - 1 if found else ahead.find(b"\n")
            end = size if newline < 0 else min(start + piece_bytes + newline + 1, size)
            yield Piece(str(path), start, end, end == size, end - start)
            start = end


def _parquet_file(path: Path):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(f"{path}: reading .parquet needs pyarrow: pip install pyarrow") from None
    try:
        return pq.ParquetFile(path)
    except Exception as e:  # pyarrow's ArrowInvalid and OSError alike: not a parquet file
        raise ValueError(f"{path} is not a readable parquet file ({e})") from None


def _parquet_pieces(path: Path, piece_bytes: int) -> list[Piece]:
    meta = _parquet_file(path).metadata
    sizes = [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]
    out, start = [], 0
    while start < len(sizes):
        end, nbytes = start + 1, sizes[start]
        while end < len(sizes) and nbytes + sizes[end] <= piece_bytes:
            nbytes, end = nbytes + sizes[end], end + 1
        out.append(Piece(str(path), start, end, end == len(sizes), nbytes))
        start = end
    return out


def text_bytes(files: list[Path]) -> int:
    """The input's size as text: a parquet file's uncompressed row groups, other files' sizes."""
    return sum(sum(p.nbytes for p in _parquet_pieces(f, PIECE_BYTES)) if f.suffix == ".parquet" else f.stat().st_size
               for f in files)


def _piece_bytes(piece: Piece) -> tuple[bytes, int]:
    """The piece's bytes and where they start in the file: after the UTF-8 byte order mark that
    Windows tools (Notepad, PowerShell 5's Out-File) put first, which is no character of the text
    (and which json.loads refuses)."""
    with open(piece.path, "rb") as f:
        f.seek(piece.start)
        data = f.read(piece.end - piece.start)
    bom = len(codecs.BOM_UTF8) if piece.start == 0 and data.startswith(codecs.BOM_UTF8) else 0
    return data[bom:], piece.start + bom


def read_piece(piece: Piece) -> str:
    return _piece_bytes(piece)[0].decode("utf-8", errors="replace")


def _flag(keys: tuple[str, ...], key: str, where: str, chat: bool = False) -> str:
    """How an error names the option that sets `key`: the text's is --json-key, a prompt's
    --prompt-key, the conversations' --chat-key."""
    if chat:
        return f"give the conversations' {where} with --chat-key"
    return f"give the texts' {where} with --json-key" if key == keys[-1] else \
        f"give the prompts' {where} with --prompt-key"


def _fits(value, chat: bool) -> bool:
    return is_conversation(value) if chat else isinstance(value, str)


def _json_record(line: str, keys: tuple[str, ...], where: str) -> tuple | None:
    """The values under `keys` of a line's JSON object (None where it has none), or None where its
    text is null (datasets' to_json writes a missing text so; a parquet row's null text is left out
    alike); a ValueError naming `where` when the line is not JSON at all (no key would help)."""
    try:
        found = json.loads(line)
    except ValueError as e:
        raise ValueError(f"{where} is not valid JSON ({e}); a .jsonl file holds one JSON object a line") from None
    if not isinstance(found, dict):
        return (None,) * len(keys)
    return None if keys[-1] in found and found[keys[-1]] is None else tuple(found.get(key) for key in keys)


def json_documents(piece: Piece, keys: tuple[str, ...], chat: bool = False, empty: bool = False) -> list:
    """The records of a .jsonl piece's lines (blank lines, empty and null texts skipped; with
    `empty`, such a text's line is a None, for the caller to count); a ValueError naming the file
    and the line's byte offset when a line is not an object with a string (with `chat`, a list of
    messages) under each of `keys`."""
    records, (data, offset) = [], _piece_bytes(piece)
    # Lines end at b"\n" only: str.splitlines would also cut at U+2028, U+0085 and the like, which
    # JSON writes unescaped inside strings (json.dumps(ensure_ascii=False)).
    for raw in data.split(b"\n"):
        line = raw.decode("utf-8", errors="replace")
        record = _json_record(line, keys, f"{piece.path}: the line at byte {offset}") if line.strip() else None
        if record is not None:
            wrong = next((key for key, value in zip(keys, record) if not _fits(value, chat)), None)
            if wrong is not None:
                raise ValueError(f"{piece.path}: the line at byte {offset} is not a JSON object with a {wrong!r} "
                                 f"{MESSAGES if chat else 'string'}; {_flag(keys, wrong, 'key', chat)}")
        if record is not None and record[-1]:
            records.append((f"the line at byte {offset}", *record) if chat else record)
        elif empty and line.strip():
            records.append(None)
        offset += len(raw) + 1
    return records


def _column_fits(type_, chat: bool) -> bool:
    """A column of lists (conversations), or of strings in any of arrow's layouts: plain, large,
    view, or dictionary-encoded (pandas' categories, Spark's and polars' low-cardinality columns)."""
    import pyarrow as pa
    if chat:
        return pa.types.is_list(type_) or pa.types.is_large_list(type_)
    if pa.types.is_dictionary(type_):
        type_ = type_.value_type
    return pa.types.is_string(type_) or pa.types.is_large_string(type_) or pa.types.is_string_view(type_)


def parquet_documents(piece: Piece, keys: tuple[str, ...], chat: bool = False, empty: bool = False) -> list:
    """The records of a .parquet piece's rows (null and empty texts skipped; with `empty`, such a
    row is a None, as json_documents' lines); a ValueError naming
    the file and its columns when no string (with `chat`, list) column is called one of `keys`,
    or the row whose prompt is null or whose messages are not a list of {role, content} strings."""
    parquet = _parquet_file(Path(piece.path))
    schema = parquet.schema_arrow
    for key in keys:
        field = schema.field(key) if key in schema.names else None
        if field is None or not _column_fits(field.type, chat):
            raise ValueError(f"{piece.path} has no {'list' if chat else 'string'} column {key!r} (its columns: "
                             f"{', '.join(schema.names)}); {_flag(keys, key, 'column', chat)}")
    table = parquet.read_row_groups(range(piece.start, piece.end), columns=list(keys))
    columns = [table.column(key).to_pylist() for key in keys]
    first = sum(parquet.metadata.row_group(i).num_rows for i in range(piece.start))
    if chat:
        wrong = next((i for i, value in enumerate(columns[0]) if not (value is None or is_conversation(value))), None)
        if wrong is not None:  # a null row is left out, as a null text is
            raise ValueError(f"{piece.path}: row {first + wrong} is not a {MESSAGES}; "
                             f"{_flag(keys, keys[0], 'column', chat)}")
        return [(f"row {first + i}", value) if value else None for i, value in enumerate(columns[0])
                if value or empty]
    for key, column in zip(keys[:-1], columns):
        if None in column:
            raise ValueError(f"{piece.path}: row {first + column.index(None)} has a null {key!r}; "
                             f"{_flag(keys, key, 'column')}")
    return [record if record[-1] else None for record in zip(*columns) if record[-1] or empty]


def piece_records(piece: Piece, keys: tuple[str, ...], chat: bool = False, empty: bool = False) -> list:
    """A .txt piece's text as it is (part of one document), or the records of another piece
    (with `empty`, a None for each left out for an empty or null text: json_documents')."""
    if piece.suffix == ".parquet":
        return parquet_documents(piece, keys, chat, empty)
    return json_documents(piece, keys, chat, empty) if piece.suffix == ".jsonl" else [(read_piece(piece),)]


def sample_texts(files: list[Path], budget_bytes: int, keys: tuple[str, ...]) -> Iterator[str]:
    """Text to learn the BPE merges from: the first `budget_bytes`, spread over the files in order
    (prompts too: the tokenizer encodes them as well)."""
    for path in files:
        for piece in iter_pieces(path, 1 << 20):
            if budget_bytes <= 0:
                return
            budget_bytes -= piece.nbytes
            for record in piece_records(piece, keys):
                yield from record


# How files that are not text start: read as UTF-8 text they would be tokenized as noise. None of
# them starts a text (not valid UTF-8, or control characters), whatever the file's name.
NOT_TEXT = ((b"\x1f\x8b", "gzip-compressed; decompress it first (gunzip -k)"),
            (b"\x28\xb5\x2f\xfd", "zstd-compressed; decompress it first (zstd -d)"),
            (b"\xfd7zXZ\x00", "xz-compressed; decompress it first (xz -dk)"),
            (b"PK\x03\x04", "a zip archive; extract it first (unzip)"),
            (b"\xff\xfe", "UTF-16 text; save it as UTF-8"), (b"\xfe\xff", "UTF-16 text; save it as UTF-8"))
PARQUET = b"PAR1"  # a parquet file's first and last bytes; a text may start with it too


def _is_utf8(path: Path) -> bool:
    """Whether a file read as text or JSON Lines starts as UTF-8 (its first 64 KB); ValueError
    (one line) when it starts as a compressed or binary one does (NOT_TEXT), or as bzip2's header,
    or, unless its name says text (.txt), is a parquet file (PAR1 at both ends)."""
    with path.open("rb") as f:
        head = f.read(1 << 16)
        size = f.seek(0, 2)
        f.seek(max(size - len(PARQUET), 0))
        tail = f.read()
    what = next((what for magic, what in NOT_TEXT if head.startswith(magic)), None)
    if head[:3] == b"BZh" and head[4:10] == b"1AY&SY":
        what = "bzip2-compressed; decompress it first (bunzip2 -k)"
    if path.suffix != ".txt" and size >= 12 and head.startswith(PARQUET) and tail == PARQUET:  # and a footer
        what = "a parquet file; name it .parquet"
    if what is not None:
        raise ValueError(f"{path} is {what}")
    try:
        codecs.getincrementaldecoder("utf-8")().decode(head)  # a character cut at 64 KB waits
    except UnicodeDecodeError:
        return False
    return True


def check_documents(files: list[Path], keys: tuple[str, ...], chat: bool = False) -> list[Path]:
    """Each .jsonl and .parquet file's first piece reads (the rest is checked as it is tokenized),
    and no other file is compressed (_is_utf8): a wrong --json-key, --prompt-key or --chat-key
    is refused before a tokenizer is trained, and so is a text file among fine-tuning examples or
    conversations. Returns the files whose start is not UTF-8 (Latin-1, cp1252): their bytes that
    are not are read as U+FFFD, which the command says."""
    legacy = [path for path in files if path.suffix != ".parquet" and not _is_utf8(path)]
    text = [path for path in files if path.suffix not in WHOLE_DOCUMENTS]
    if (len(keys) > 1 or chat) and text:
        held, flag = ("no conversations", "--chat-key") if chat else ("no prompt", "--prompt-key")
        raise ValueError(f"{text[0]} is a text file, which has {held} ({len(text)} among the inputs); "
                         f"{flag} reads .jsonl and .parquet files only")
    for path in files:
        if path.suffix in WHOLE_DOCUMENTS and path.stat().st_size:
            for piece in itertools.islice(iter_pieces(path, 1 << 16), 1):  # none: a parquet file of no rows
                piece_records(piece, keys, chat)
    return legacy
