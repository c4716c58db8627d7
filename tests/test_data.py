"""Data sources and batches: windows across shards, each rank's share of the global batch,
the held-out validation split."""

import json
from fractions import Fraction

import numpy as np
import pytest
import torch

from conftest import tiny_config
from tetrad.cli import main
from tetrad.config import load_config
from tetrad.data.checks import check_data
from tetrad.data.documents import json_documents, parquet_documents, pieces, read_piece
from tetrad.data.shards import dtype_for, model_keys, open_shards, read_index
from tetrad.data.blend import blend_parts
from tetrad.data.sources import CORPORA, TokenStream, load_tokens
from tetrad.data.tokenizer import document_prefix, load_tokenizer, train_bpe
from tetrad.train import batches as batches_module
from tetrad.train.batches import Batches, blend_counts, describe, permute, route, split_batches


def test_windows_and_splits_read_across_pieces():
    stream = TokenStream([np.arange(5), np.arange(5, 12), np.arange(12, 13), np.arange(13, 20)])
    for start in range(20):
        for length in range(1, 21 - start):
            assert np.array_equal(stream.window(start, length), np.arange(start, start + length))
    for at in (0, 5, 12, 19, 20):
        head, tail = stream.split(at)
        assert len(head) == at and len(tail) == 20 - at
        if at < 20:
            assert np.array_equal(tail.window(0, 20 - at), np.arange(at, 20))


def test_windows_gather_the_same_rows_from_one_piece_or_many():
    starts = [0, 3, 11, 12, 13]
    whole = np.arange(20, dtype=np.uint16)
    for stream in (TokenStream([whole]), TokenStream([whole[:5], whole[5:12], whole[12:13], whole[13:]])):
        rows = stream.windows(starts, 7)
        assert rows.dtype == np.int64
        assert np.array_equal(rows, np.stack([np.arange(s, s + 7) for s in starts]))


def test_each_dp_rank_reads_only_its_share_of_the_same_global_batch():
    batches = Batches([(1, TokenStream([np.arange(1000) % 256]))], seq_len=16, global_batch=8, seed=3, vocab_size=256)
    inputs, labels = batches.global_batch_at(7)
    assert torch.equal(inputs[:, 1:], labels[:, :-1])
    for dp in (1, 2, 4):
        shares = [batches.microbatches(7, r, dp, micro_batch=2) for r in range(dp)]
        assert torch.equal(torch.cat([x for share in shares for x, _ in share]), inputs)
        assert torch.equal(torch.cat([y for share in shares for _, y in share]), labels)


def test_an_epoch_reads_every_window_once_then_reshuffles_at_another_offset():
    batches = Batches([(1, TokenStream([np.arange(2000) % 256]))], seq_len=16, global_batch=8, seed=3, vocab_size=256)
    windows = batches.windows[0]
    n = windows.per_epoch
    epochs = [windows.starts(np.arange(e * n, (e + 1) * n)) for e in range(6)]
    for starts in epochs:
        offset = int(starts.min())
        assert offset < 16 and starts.max() + 17 <= 2000
        assert sorted(starts.tolist()) == [offset + 16 * k for k in range(n)]  # each window once
        assert starts.tolist() != sorted(starts.tolist())  # shuffled
    assert len({tuple(s.tolist()) for s in epochs}) == 6 and len({int(s.min()) for s in epochs}) > 1
    # A step's rows are those windows, however many epochs came before; another seed, another order.
    inputs, labels = batches.global_batch_at(40)
    starts = windows.starts(np.arange(320, 328))
    assert torch.equal(inputs, torch.from_numpy(np.stack([np.arange(s, s + 16) % 256 for s in starts])))
    assert torch.equal(labels[:, -1], torch.from_numpy((starts + 16) % 256))
    other = Batches([(1, TokenStream([np.arange(2000) % 256]))], seq_len=16, global_batch=8, seed=4, vocab_size=256)
    assert not np.array_equal(other.windows[0].starts(np.arange(n)), epochs[0])


def test_the_shuffle_is_a_permutation_for_any_size_and_key(monkeypatch):
    for n in (1, 2, 3, 4, 5, 8, 9, 100, 1024, 1025, 4099):
        for key in (0, 7, 2**63 - 1):
            assert sorted(permute(np.arange(n, dtype=np.uint64), n, key).tolist()) == list(range(n))
    # An epoch's order kept whole (small data) and worked out per sample (large data) agree.
    def starts():
        windows = Batches([(1, TokenStream([np.arange(2000) % 256]))], 16, 8, 5, 256).windows[0]
        return windows.starts(np.arange(0, 600, 7))
    kept = starts()
    monkeypatch.setattr(batches_module, "ORDER_CACHED", 0)
    assert np.array_equal(starts(), kept)


def test_validation_reads_the_held_out_windows_in_order_and_no_more_than_they_hold():
    val = Batches([(1, TokenStream([np.arange(1000) % 256]))], seq_len=16, global_batch=8, seed=0, vocab_size=256,
                  shuffle=False)
    assert val.windows[0].per_epoch == 999 // 16
    assert val.windows[0].starts(np.arange(999 // 16)).tolist() == [16 * k for k in range(999 // 16)]
    assert val.eval_batches(4) == 4 and val.eval_batches(1000) == (999 // 16) // 8
    tiny = Batches([(1, TokenStream([np.arange(40) % 256]))], seq_len=16, global_batch=8, seed=0, vocab_size=256,
                   shuffle=False)
    assert tiny.eval_batches(5) == 1  # two windows: one batch, its rows wrapping round
    line = describe(tiny_config(train={"eval_every": 5, "eval_steps": 1000}, data={"val_fraction": 0.05}))
    assert "epochs" in line and "held-out windows" in line and "train.eval_steps=1000 asks for more" in line



def test_the_run_line_names_a_blend_source_that_gets_no_sample():
    # 5 steps x 8 samples: a source at a millionth of the weight gets none of the 40.
    line = describe(tiny_config(data={"source": f"0.000001 licenses 0.999999 {CORPORA['licenses']}"}))
    assert "0.0001% licenses" in line and line.count("no sample in this run: raise its weight") == 1
    line = describe(tiny_config(data={"source": f"3 licenses 1 {CORPORA['licenses']}"}))
    assert "75% licenses" in line and "25% " in line and "no sample" not in line

def test_blend_parses_megatron_data_path_and_keeps_a_path_with_spaces_whole():
    assert blend_parts("0.7 data/web 0.3 data/code") == [(Fraction(7, 10), "data/web"), (Fraction(3, 10), "data/code")]
    assert blend_parts("3 a 1 b") == [(Fraction(3, 4), "a"), (Fraction(1, 4), "b")]
    for single in ("licenses", "my notes/a b.txt", "1e-3"):
        assert blend_parts(single) == [(1, single)]
    with pytest.raises(ValueError, match="weight 0; every weight must be positive"):
        blend_parts("0 a 1 b")


def test_a_blend_draws_each_source_at_its_weight_and_numbers_its_samples_consecutively():
    for weights in ([Fraction(3, 4), Fraction(1, 4)], [Fraction(5, 10), Fraction(3, 10), Fraction(2, 10)],
                    [Fraction(1, 7)] * 7):
        source, index = route(np.arange(2000), weights)
        for total in (1, 7, 100, 999, 2000):
            counts = blend_counts(total, weights)
            assert counts == [int((source[:total] == i).sum()) for i in range(len(weights))]
            assert all(abs(c - w * total) < 2 for c, w in zip(counts, weights))  # within a sample or so
        for i in range(len(weights)):  # each source's samples are 0, 1, 2, ... in the run's order
            assert index[source == i].tolist() == list(range(int((source == i).sum())))
    # Batches: ids < 100 come from the first source, >= 100 from the second, 6 of every 8 rows first.
    first, second = TokenStream([np.arange(2000) % 100]), TokenStream([100 + np.arange(3000) % 100])
    batches = Batches([(Fraction(3, 4), first), (Fraction(1, 4), second)], seq_len=16, global_batch=8, seed=0,
                      vocab_size=256)
    for step in range(20):
        inputs, _ = batches.global_batch_at(step)
        from_first = (inputs < 100).all(dim=1)
        assert int(from_first.sum()) == 6 and bool(((inputs >= 100).all(dim=1) | from_first).all())
    n = batches.windows[0].per_epoch  # the first source's epoch: every window once
    starts = batches.windows[0].starts(np.arange(n))
    assert len(set(starts.tolist())) == n
    assert batches.epochs(100) == [600 / n, 200 / batches.windows[1].per_epoch]


def test_val_fraction_holds_out_the_tail_and_training_never_reads_it():
    cfg = tiny_config(data={"val_fraction": 0.1})
    train, val = split_batches(cfg)
    whole = load_tokens("licenses")
    n_train, n_val = len(train.windows[0].tokens), len(val.windows[0].tokens)
    assert n_val == int(len(whole) * 0.1) and n_train + n_val == len(whole)
    assert np.array_equal(val.windows[0].tokens.window(0, n_val), whole.window(n_train, n_val))
    assert not torch.equal(val.global_batch_at(0)[0], train.global_batch_at(0)[0])
    assert split_batches(tiny_config())[1] is None
    # A blend holds out the tail of every source, and validates on them at the blend's weights.
    train, val = split_batches(tiny_config(data={"source": f"3 licenses 1 {CORPORA['licenses']}",
                                                 "val_fraction": 0.1}))
    assert [len(w.tokens) for w in train.windows] == [n_train, n_train]
    assert [len(w.tokens) for w in val.windows] == [n_val, n_val] and val.weights == [Fraction(3, 4), Fraction(1, 4)]


def write_docs(folder, n=3):
    folder.mkdir()
    texts = [f"document {i}: " + " ".join(f"word{j % 17} héllo" for j in range(40 * (i + 1))) + "\n\n end\n"
             for i in range(n)]
    for i, text in enumerate(texts):
        (folder / f"doc{i}.txt").write_text(text)
    return texts


def test_files_a_folder_holds_besides_txt_are_named_as_left_out(tmp_path, capsys):
    """A folder of mixed text (.txt and .md) is not tokenized in part without a word."""
    write_docs(tmp_path / "text", n=1)
    (tmp_path / "text" / "notes.md").write_text("# notes\n")
    (tmp_path / "text" / ".DS_Store").write_bytes(b"\0")  # hidden: not the user's text
    assert main(["data", str(tmp_path / "text"), "--out", str(tmp_path / "shards"), "--vocab-size", "300"]) == 0
    out = capsys.readouterr().out
    assert "tetrad data: training a 300-token BPE on the 0.0 MB of text\n" in out  # all of it: under --sample-mb
    assert (f"1 file in the input folders left out (not .txt, .jsonl or .parquet), e.g. "
            f"{tmp_path / 'text' / 'notes.md'}") in out  # one file (before: "1 file(s) ... are")
    assert "tetrad data: 1 document, " in out  # not "1 documents"
    assert main(["data", str(tmp_path / "text"), str(tmp_path / "text" / "notes.md"), "--out", str(tmp_path / "both"),
                 "--vocab-size", "300"]) == 0
    out = capsys.readouterr().out
    assert "left out" not in out and "2 documents" in out


def test_tetrad_data_writes_shards_that_decode_to_the_documents(tmp_path, capsys):
    texts = write_docs(tmp_path / "text")
    out = tmp_path / "shards"
    assert main(["data", str(tmp_path / "text"), "--out", str(out), "--vocab-size", "300", "--workers", "2",
                 "--shard-mb", "0.001"]) == 0
    assert "3 documents" in capsys.readouterr().out
    index, tokenizer = read_index(out), load_tokenizer(out / "tokenizer.json")
    # Training stops early when this little text has no pair left to merge.
    assert (index["documents"], index["dtype"]) == (3, "uint16")
    assert 256 < index["vocab_size"] == tokenizer.get_vocab_size() <= 300
    assert len(index["shards"]) > 1  # tiny shards: one per document
    stream = load_tokens(str(out))
    ids = stream.window(0, len(stream)).tolist()
    assert len(ids) == index["tokens"] and ids.count(index["eos_id"]) == 3
    for shard in open_shards(out):
        assert shard[-1] == index["eos_id"]  # a document never straddles two shards
    ends = [i for i, t in enumerate(ids) if t == index["eos_id"]]
    docs = [ids[a + 1:b] for a, b in zip([-1] + ends, ends)]
    assert [tokenizer.decode(d) for d in docs] == texts

    cfg = load_config(overrides=[f"data.source={out}"], model_from_inputs=model_keys)
    assert cfg.model.vocab_size == index["vocab_size"]  # follows the tokenizer
    check_data(cfg)
    assert main(["train", f"--data.source={out}", "--model.vocab_size=512", f"--run.dir={tmp_path / 'run'}"]) == 2
    assert f"{index['vocab_size']}-token vocabulary but model.vocab_size=512" in capsys.readouterr().err
    # A released model's vocabulary may be padded past its tokenizer's: larger is accepted under init_from.
    check_data(tiny_config(data={"source": str(out)}, model={"vocab_size": 512}, checkpoint={"init_from": "hf"}))

    again = tmp_path / "again"  # an existing tokenizer.json gives the same tokens
    assert main(["data", str(tmp_path / "text"), "--out", str(again), "--tokenizer", str(out / "tokenizer.json")]) == 0
    assert np.array_equal(load_tokens(str(again)).window(0, len(stream)), np.array(ids))

    # A blend of shard folders in one vocabulary trains (the vocabulary follows the first); a blend
    # with text read as bytes is refused before any rank starts.
    blend = f"1 {out} 1 {again}"
    assert load_config(overrides=[f"data.source={blend}"], model_from_inputs=model_keys).model.vocab_size == \
        index["vocab_size"]
    assert main(["train", f"--data.source={blend}", "--train.steps=2", "--model.seq_len=32",
                 f"--run.dir={tmp_path / 'blend'}"]) == 0
    assert f"from 50% {out} (" in capsys.readouterr().out
    assert main(["train", f"--data.source=1 {out} 1 licenses", f"--run.dir={tmp_path / 'mixed'}"]) == 2
    assert "blends sources in different vocabularies" in capsys.readouterr().err
    # Two tokenizers of different sizes: the blend is named, not model.vocab_size (which the first set).
    other = tmp_path / "other"
    assert main(["data", str(tmp_path / "text"), "--out", str(other), "--vocab-size", "260"]) == 0
    assert read_index(other)["vocab_size"] != index["vocab_size"]
    assert main(["train", f"--data.source=1 {out} 1 {other}", f"--run.dir={tmp_path / 'two'}"]) == 2
    err = capsys.readouterr().err
    assert "blends sources in different vocabularies" in err and "model.vocab_size" not in err, err


def test_tetrad_data_refuses_bad_inputs_in_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    cases = [[str(tmp_path / "missing"), "--out", str(tmp_path / "o")],
             [str(tmp_path / "empty"), "--out", str(tmp_path / "o")],
             [str(tmp_path / "empty"), "--out", str(tmp_path / "o"), "--vocab-size", "100"]]
    for argv in cases:
        assert main(["data", *argv]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("tetrad data: ") and "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
    assert dtype_for(2**16) == np.uint16 and dtype_for(2**16 + 1) == np.uint32


def test_a_file_is_cut_into_pieces_at_line_ends_that_cover_it(tmp_path):
    path = tmp_path / "big.txt"
    path.write_bytes(b"".join(b"line %d " % i + b"x" * (i % 13) + b"\n" for i in range(200)) + b"no newline at end")
    cut = pieces(path, piece_bytes=100)
    data = path.read_bytes()
    assert len(cut) > 10 and cut[0].start == 0 and cut[-1].end == len(data) and cut[-1].last
    assert all(a.end == b.start and not a.last for a, b in zip(cut, cut[1:]))
    assert all(data[p.end - 1:p.end] == b"\n" for p in cut[:-1])


def test_tetrad_data_reads_json_lines_one_document_a_line(tmp_path, capsys):
    """A .jsonl file (datasets' export, Megatron-LM's input) holds a document per line, its text
    under --json-key; blank lines and empty texts are no documents; .txt files beside it are one each."""
    docs = ["first document\nover two lines", "", "zweites Dokument: ünïcødé", 'a "quoted" {brace} text']
    folder = tmp_path / "mixed"
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps({"id": i, "content": d}) + "\n" + ("\n" if i == 1 else "")
                                            for i, d in enumerate(docs)))
    (folder / "b.txt").write_text("a text file\n")
    out = tmp_path / "shards"
    assert main(["data", str(folder), "--out", str(out), "--vocab-size", "300", "--json-key", "content",
                 "--workers", "2", "--shard-mb", "0.0001"]) == 0
    assert "4 documents" in capsys.readouterr().out
    index, tokenizer = read_index(out), load_tokenizer(out / "tokenizer.json")
    ids = load_tokens(str(out)).window(0, index["tokens"]).tolist()
    ends = [i for i, t in enumerate(ids) if t == index["eos_id"]]
    assert [tokenizer.decode(ids[a + 1:b]) for a, b in zip([-1] + ends, ends)] == \
        [d for d in docs if d] + ["a text file\n"]
    for shard in open_shards(out):
        assert shard[-1] == index["eos_id"]  # a document never straddles two shards

    # Cut into small pieces at line ends, the lines still read as the same documents.
    cut = pieces(folder / "a.jsonl", piece_bytes=40)
    assert len(cut) > 2 and all(p.whole_documents for p in cut)
    assert [d for p in cut for (d,) in json_documents(p, ("content",))] == [d for d in docs if d]


def test_tetrad_data_refuses_json_lines_without_the_key_before_any_work(tmp_path, capsys):
    (tmp_path / "docs.jsonl").write_text(json.dumps({"content": "x"}) + "\n")
    assert main(["data", str(tmp_path / "docs.jsonl"), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"tetrad data: {tmp_path / 'docs.jsonl'}: the line at byte 0 is not a JSON object with a 'text' "
                   "string; give the texts' key with --json-key")
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()
    # A bad line past the part checked up front stops the tokenizer's training, or (a tokenizer
    # given) the tokenizing workers, the same way.
    good = json.dumps({"text": "y" * 100}) + "\n"
    (tmp_path / "late.jsonl").write_text(good * 1000 + "not json\n")
    train_bpe(iter(["some text to learn from"]), 300).save(str(tmp_path / "bpe.json"))
    for tokenizer in (["--vocab-size", "300"], ["--tokenizer", str(tmp_path / "bpe.json")]):
        assert main(["data", str(tmp_path / "late.jsonl"), "--out", str(tmp_path / "o"), *tokenizer]) == 2
        assert f"late.jsonl: the line at byte {len(good) * 1000} is not valid JSON (Expecting value: line 1 column 1 " \
            "(char 0)); a .jsonl file holds one JSON object a line" in capsys.readouterr().err
        assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()


def test_tetrad_data_reads_parquet_one_document_a_row(tmp_path, capsys):
    """A .parquet file (as HF datasets such as FineWeb are published) holds a document per row, its
    text in the --json-key column; nulls and empty texts are no documents; pieces are runs of row
    groups, and every row group is read once, in order."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    docs = [f"document {i}: " + "word " * (i % 7) + "\nsecond line" for i in range(60)] + ["", None, "last one"]
    path = tmp_path / "train-00000.parquet"
    pq.write_table(pa.table({"id": list(range(len(docs))), "text": docs}), path, row_group_size=8)
    cut = pieces(path, piece_bytes=600)
    assert len(cut) > 2 and cut[0].start == 0 and cut[-1].last and cut[-1].end == pq.ParquetFile(path).num_row_groups
    assert all(a.end == b.start and not a.last and a.whole_documents for a, b in zip(cut, cut[1:]))
    kept = [d for d in docs if d]
    assert [d for p in cut for (d,) in parquet_documents(p, ("text",))] == kept
    out = tmp_path / "shards"
    assert main(["data", str(path), "--out", str(out), "--vocab-size", "300", "--workers", "2"]) == 0
    assert f"{len(kept)} documents" in capsys.readouterr().out
    index, tokenizer = read_index(out), load_tokenizer(out / "tokenizer.json")
    ids = load_tokens(str(out)).window(0, index["tokens"]).tolist()
    ends = [i for i, t in enumerate(ids) if t == index["eos_id"]]
    assert [tokenizer.decode(ids[a + 1:b]) for a, b in zip([-1] + ends, ends)] == kept

    # A column that is not there (or not text) is refused before any work, naming the columns.
    assert main(["data", str(path), "--out", str(tmp_path / "o"), "--json-key", "id"]) == 2
    assert capsys.readouterr().err.strip() == (f"tetrad data: {path} has no string column 'id' (its columns: id, "
                                               "text); give the texts' column with --json-key")
    (tmp_path / "bad.parquet").write_text("not parquet")
    assert main(["data", str(tmp_path / "bad.parquet"), "--out", str(tmp_path / "o")]) == 2
    assert "bad.parquet is not a readable parquet file" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def _with_begin_of_text(tokenizer):
    """`tokenizer` with Llama 3's post-processor: <|begin_of_text|> before every encoded text."""
    from tokenizers import processors
    tokenizer.add_special_tokens(["<|begin_of_text|>"])
    bos = tokenizer.token_to_id("<|begin_of_text|>")
    tokenizer.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                             special_tokens=[("<|begin_of_text|>", bos)])
    return tokenizer, bos


def test_documents_start_with_the_tokenizers_own_prefix(tmp_path, capsys):
    """A tokenizer whose post-processor starts texts with a token (Llama 3's <|begin_of_text|>)
    starts every document with it, as HF's encode does; tetrad's own BPE adds none."""
    texts = write_docs(tmp_path / "text")
    (tmp_path / "more.jsonl").write_text(json.dumps({"text": "a json document"}) + "\n")
    plain = train_bpe(iter(texts), 300)
    assert document_prefix(plain) == []
    tokenizer, bos = _with_begin_of_text(plain)
    assert document_prefix(tokenizer) == [bos]
    tokenizer.save(str(tmp_path / "llama-like.json"))
    out = tmp_path / "shards"
    assert main(["data", str(tmp_path / "text"), str(tmp_path / "more.jsonl"), "--out", str(out),
                 "--tokenizer", str(tmp_path / "llama-like.json"), "--shard-mb", "0.001"]) == 0
    index = read_index(out)
    ids = load_tokens(str(out)).window(0, index["tokens"]).tolist()
    ends = [i for i, t in enumerate(ids) if t == index["eos_id"]]
    docs = [ids[a + 1:b] for a, b in zip([-1] + ends, ends)]
    assert [d[0] for d in docs] == [bos] * 4 and ids.count(bos) == 4
    assert [tokenizer.decode(d[1:]) for d in docs] == texts + ["a json document"]


def test_the_epochs_line_of_a_resume_under_another_global_batch_counts_the_samples_read(tmp_path, capsys):
    """`tetrad train`'s data line on a resume under another train.global_batch: the samples the
    checkpoint says were read (4 steps x 8), then the steps left at the new batch (4 x 16), 96 in
    all, as the resumed run reads them (test_checkpoint's next unread sample). It counted 8 steps
    x 16 = 128 from step 0, as if the new batch had read the first steps too."""
    (tmp_path / "text.txt").write_text("".join(f"line {i} of a small corpus.\n" for i in range(100)))
    common = [f"--data.source={tmp_path / 'text.txt'}", "--model.seq_len=32", "--model.n_layers=1",
              "--model.d_model=32", "--model.n_heads=2", "--model.n_kv_heads=1", "--model.ffn_hidden=64",
              "--train.micro_batch=8", f"--run.dir={tmp_path / 'run'}"]
    assert main(["train", *common, "--train.steps=4", "--train.global_batch=8", "--checkpoint.every=4"]) == 0
    first = capsys.readouterr().out
    per_epoch = int(first.split("tetrad: data: ")[1].split(" windows")[0].replace(",", ""))
    assert f"; 4 steps x 8 = {32 / per_epoch:.2f} epochs" in first
    assert main(["train", *common, "--train.steps=8", "--train.global_batch=16"]) == 0
    resumed = capsys.readouterr().out
    assert (f"tetrad: data: {per_epoch:,} windows of 32 tokens an epoch; 32 samples read by step 4, then 4 steps "
            f"x 16 = {96 / per_epoch:.2f} epochs\n") in resumed, resumed


def test_json_lines_end_at_newlines_only_and_errors_name_the_byte_offset(tmp_path):
    """JSON writes U+2028, U+0085 and the like unescaped inside strings (json.dumps with
    ensure_ascii=False, as CJK datasets are exported): a line is one document up to its "\\n", and
    an error names the line's offset in the file's bytes, invalid UTF-8 before it included."""
    texts = ["para one\u2028para two", "next\x85line", "form\u2029feed \u000b", "plain"]
    data = tmp_path / "docs.jsonl"
    data.write_bytes(b"".join(json.dumps({"text": t}, ensure_ascii=False).encode() + b"\n" for t in texts))
    assert [d for p in pieces(data) for (d,) in json_documents(p, ("text",))] == texts
    bad = b'{"text": "caf\xe9"}\n'  # Latin-1, not UTF-8: read (replaced), and counted as the file's bytes
    data.write_bytes(bad + b"not json\n")
    with pytest.raises(ValueError, match=f"the line at byte {len(bad)} is not valid JSON"):
        json_documents(pieces(data)[0], ("text",))


def test_hidden_files_in_a_folder_are_not_documents(tmp_path, capsys):
    """Jupyter's .ipynb_checkpoints copies, macOS's ._ resource forks (binary) and other hidden
    files under a folder are not the user's text: neither `tetrad data` nor a run on the folder
    (read as bytes) reads them."""
    texts = write_docs(tmp_path / "text", n=1)
    (tmp_path / "text" / ".ipynb_checkpoints").mkdir()
    (tmp_path / "text" / ".ipynb_checkpoints" / "doc0-checkpoint.txt").write_text("an older copy\n")
    (tmp_path / "text" / "._doc0.txt").write_bytes(b"\0\5\26\7\0\2\0\0Mac OS X")
    (tmp_path / "text" / ".notes.jsonl").write_text(json.dumps({"text": "hidden"}) + "\n")
    assert main(["data", str(tmp_path / "text"), "--out", str(tmp_path / "shards"), "--vocab-size", "300"]) == 0
    assert "tetrad data: 1 document, " in capsys.readouterr().out
    stream, tokenizer = load_tokens(str(tmp_path / "shards")), load_tokenizer(tmp_path / "shards" / "tokenizer.json")
    assert tokenizer.decode(stream.window(0, len(stream)).tolist()) == texts[0]
    assert bytes(load_tokens(str(tmp_path / "text")).window(0, 10**6).astype(np.uint8)) == texts[0].encode()


def test_compressed_or_utf16_inputs_are_refused_not_tokenized_as_noise(tmp_path, capsys):
    """A dataset's data.jsonl.gz (or .zst, .xz, .bz2, .zip), or a Windows UTF-16 text, named as an
    input is not UTF-8 text: read as text it was tokenized as noise, without a word."""
    import bz2
    import gzip
    import lzma
    line = json.dumps({"text": "a document"}) + "\n"
    (tmp_path / "data.jsonl.gz").write_bytes(gzip.compress(line.encode()))
    (tmp_path / "data.jsonl.xz").write_bytes(lzma.compress(line.encode()))
    (tmp_path / "data.jsonl.bz2").write_bytes(bz2.compress(line.encode()))
    (tmp_path / "notes.txt").write_text("notes\n", encoding="utf-16")
    cases = {"data.jsonl.gz": "gzip-compressed; decompress it first (gunzip -k)",
             "data.jsonl.xz": "xz-compressed; decompress it first (xz -dk)",
             "data.jsonl.bz2": "bzip2-compressed; decompress it first (bunzip2 -k)",
             "notes.txt": "UTF-16 text; save it as UTF-8"}
    for name, what in cases.items():
        assert main(["data", str(tmp_path / name), "--out", str(tmp_path / "o"), "--vocab-size", "300"]) == 2
        assert capsys.readouterr().err == f"tetrad data: {tmp_path / name} is {what}\n"
        assert not (tmp_path / "o").exists()


def test_a_files_name_decides_its_format_before_its_first_bytes(tmp_path, capsys):
    """A .txt file is text even when it starts with parquet's magic "PAR1" (a heading, say); a
    parquet file under a name that says nothing (rows.dat) is refused with the fix, a text there
    that only starts with "PAR1" is read."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    (tmp_path / "notes.txt").write_text("PAR1 results: the fox wins\n")
    (tmp_path / "notes").write_text("PAR1 results, again\n")
    pq.write_table(pa.table({"text": ["a document"]}), tmp_path / "rows.dat")
    for name in ("notes.txt", "notes"):
        shards = tmp_path / f"{name}_shards"
        assert main(["data", str(tmp_path / name), "--out", str(shards), "--vocab-size", "300"]) == 0
        ids = load_tokens(str(shards)).window(0, 10**6).tolist()
        assert load_tokenizer(shards / "tokenizer.json").decode(ids) == (tmp_path / name).read_text(), name
    capsys.readouterr()
    assert main(["data", str(tmp_path / "rows.dat"), "--out", str(tmp_path / "o"), "--vocab-size", "300"]) == 2
    assert capsys.readouterr().err == f"tetrad data: {tmp_path / 'rows.dat'} is a parquet file; name it .parquet\n"


def test_a_null_text_in_json_lines_is_left_out_as_in_parquet(tmp_path):
    """datasets' to_json writes a missing text as null: such a line is no document (a parquet
    row's null text is left out alike), where a line without the key is still refused."""
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in [{"text": "a"}, {"text": None}, {"text": "b"}]))
    assert json_documents(pieces(data)[0], ("text",)) == [("a",), ("b",)]
    examples = [{"q": "x", "text": None}, {"q": "y", "text": "z"}]
    data.write_text("".join(json.dumps(r) + "\n" for r in examples))
    assert json_documents(pieces(data)[0], ("q", "text")) == [("y", "z")]
    data.write_text(json.dumps({"text": "a"}) + "\n" + json.dumps({"other": "b"}) + "\n")
    with pytest.raises(ValueError, match="the line at byte 14 is not a JSON object with a 'text' string"):
        json_documents(pieces(data)[0], ("text",))


def _metaspace_tokenizer(texts):
    """A SentencePiece-style tokenizer as HF converts Llama 2's and Mistral's: a Metaspace
    pre-tokenizer that marks the start of each encoded text with "▁"."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"]))
    return tokenizer


def test_documents_are_the_tokenizers_encode_of_each_whole_text(tmp_path):
    """Blank lines, indentation, trailing spaces and CRLF line ends: each document's ids are the
    tokenizer's encode of the whole text (what the model meets at inference), not of its lines
    apart, which split "\\n\\n" and "  \\n" into other tokens, and under a SentencePiece-style
    tokenizer put a "▁" (a space) before every line."""
    texts = ["Title\n\n  indented line  \nnext.\r\nend\n\n\n", "one\ntwo\n three\t\n\nfour", "single"]
    (tmp_path / "a.txt").write_text(texts[0], newline="")
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[1:]))
    inputs = [str(tmp_path / "a.txt"), str(tmp_path / "docs.jsonl")]
    bpe = train_bpe(iter(texts * 20), 300)
    for name, tokenizer, eos in (("bpe", bpe, "<|endoftext|>"), ("metaspace", _metaspace_tokenizer(texts * 20), "</s>")):
        tokenizer.save(str(tmp_path / f"{name}.json"))
        out = tmp_path / name
        assert main(["data", *inputs, "--out", str(out), "--tokenizer", str(tmp_path / f"{name}.json"), "--eos", eos,
                     "--workers", "1"]) == 0
        eos_id = tokenizer.token_to_id(eos)
        expected = [i for t in texts for i in tokenizer.encode(t, add_special_tokens=False).ids + [eos_id]]
        assert load_tokens(str(out)).window(0, 10**6).tolist() == expected, name


def test_a_text_file_is_cut_into_pieces_where_its_parts_encode_as_the_whole(tmp_path):
    """A piece ends at a line end between two printable characters where there is one (runs of
    blank lines and trailing spaces tokenize as one), else at any line end."""
    path = tmp_path / "text.txt"
    path.write_bytes(b"x" * 100 + b"\n\n  \n" + b"y\nz" + b"\n" * 50 + b"end")  # 161 bytes
    assert [(p.start, p.end) for p in pieces(path, piece_bytes=90)] == [(0, 107), (107, 161)]  # after "y\n"
    path.write_bytes(b"x" * 100 + b"\n\n" + b"z" * 100)  # no such line end: at the first one
    assert [(p.start, p.end) for p in pieces(path, piece_bytes=90)] == [(0, 101), (101, 202)]


def test_parquet_texts_in_any_arrow_string_layout_are_read(tmp_path):
    """A dictionary-encoded string column (pandas' categories, low-cardinality columns of Spark
    and polars) or a large string one holds texts as a plain one does."""
    pa, pq = pytest.importorskip("pyarrow"), pytest.importorskip("pyarrow.parquet")
    texts = ["first", "second", "first"]
    for name, column in (("dictionary", pa.array(texts).dictionary_encode()),
                         ("large", pa.array(texts, type=pa.large_string()))):
        path = tmp_path / f"{name}.parquet"
        pq.write_table(pa.table({"text": column}), path)
        assert [d for p in pieces(path) for (d,) in parquet_documents(p, ("text",))] == texts, name


def test_a_file_named_twice_or_linked_is_read_once(tmp_path, capsys):
    """A file given twice, or a link beside it in a folder ("latest.txt"), would be tokenized
    twice: trained on twice, or trained on in one copy and held out for validation in the other."""
    texts = write_docs(tmp_path / "text", n=2)
    (tmp_path / "text" / "latest.txt").symlink_to(tmp_path / "text" / "doc1.txt")
    doc0 = tmp_path / "text" / "doc0.txt"
    assert main(["data", str(tmp_path / "text"), str(doc0), "--out", str(tmp_path / "shards"), "--vocab-size", "300"]) == 0
    out = capsys.readouterr().out
    assert ("tetrad data: 2 input files named before (twice, or through a link), read once, "
            f"e.g. {tmp_path / 'text' / 'latest.txt'}\n") in out
    assert "2 documents" in out
    stream, tokenizer = load_tokens(str(tmp_path / "shards")), load_tokenizer(tmp_path / "shards" / "tokenizer.json")
    assert tokenizer.decode(stream.window(0, len(stream)).tolist()) == "".join(texts)


def test_a_linked_text_file_in_a_source_folder_is_read_once(tmp_path):
    """data.source as a folder of .txt files read as bytes: a link beside its file is the same text."""
    (tmp_path / "v3.txt").write_text("the only text\n")
    (tmp_path / "latest.txt").symlink_to(tmp_path / "v3.txt")
    stream = load_tokens(str(tmp_path))
    assert bytes(stream.window(0, len(stream)).astype(np.uint8)) == b"the only text\n"


def test_a_file_that_is_not_utf8_is_named(tmp_path, capsys):
    """Latin-1 or cp1252 text reads its accented letters as U+FFFD: tokenized, but said, with the fix."""
    (tmp_path / "old.txt").write_bytes("café naïve\n".encode("latin-1"))
    (tmp_path / "new.txt").write_text("漢字 😀 café\n" * 30_000)  # UTF-8, a character across the 64 KB checked
    assert main(["data", str(tmp_path / "new.txt"), str(tmp_path / "old.txt"), "--out", str(tmp_path / "o"),
                 "--vocab-size", "300"]) == 0
    out = capsys.readouterr().out
    assert (f"tetrad data: 1 input file not in UTF-8, e.g. {tmp_path / 'old.txt'}: bytes that are not UTF-8 "
            "read as U+FFFD ('\ufffd'); convert them first to keep their characters (iconv -f cp1252 -t utf-8)\n") in out


def test_the_checks_before_any_work_read_the_start_of_a_large_file_only(tmp_path, monkeypatch):
    """check_documents reads each .jsonl file's first piece, and the tokenizer's sample its
    --sample-mb: not a 64 KB read at every piece's end all through a file of gigabytes."""
    from pathlib import Path
    from tetrad.data.documents import check_documents, sample_texts
    path = tmp_path / "big.jsonl"
    path.write_text((json.dumps({"text": "word " * 100}) + "\n") * 16_000)  # 8 MB
    read, opened = [], Path.open

    def counting_open(self, *args, **kwargs):
        file = opened(self, *args, **kwargs)
        reader = file.read
        file.read = lambda *a: read.append(len(data := reader(*a))) or data
        return file
    monkeypatch.setattr(Path, "open", counting_open)
    check_documents([path], ("text",))
    assert 0 < sum(read) <= 1 << 18
    read.clear()
    assert sum(len(text) for text in sample_texts([path], 1 << 20, ("text",))) < 2 << 20
    assert sum(read) <= 1 << 18


def test_a_utf8_byte_order_mark_is_no_part_of_the_text(tmp_path):
    """Notepad and PowerShell 5 start UTF-8 files with a byte order mark: a .jsonl file so written
    was refused (json.loads takes no BOM), and a .txt document began with an invisible U+FEFF."""
    bom = "\ufeff".encode()
    (tmp_path / "a.jsonl").write_bytes(bom + b'{"text": "one"}\n{"text": "two"}\nnot json\n')
    with pytest.raises(ValueError, match=f"the line at byte {len(bom) + 32} is not valid JSON"):
        json_documents(pieces(tmp_path / "a.jsonl")[0], ("text",))
    (tmp_path / "a.jsonl").write_bytes(bom + b'{"text": "one"}\n{"text": "two"}\n')
    assert json_documents(pieces(tmp_path / "a.jsonl")[0], ("text",)) == [("one",), ("two",)]
    (tmp_path / "a.txt").write_bytes(bom + "héllo\n".encode())
    assert [read_piece(p) for p in pieces(tmp_path / "a.txt", piece_bytes=2)] == ["héllo\n"]


def test_an_eos_written_in_a_document_is_text_not_its_end(tmp_path):
    """A document quoting a special token ("<|endoftext|>" in code or a discussion of models)
    keeps it as characters: a .txt file or a .jsonl line is one document, ended only by the EOS
    tetrad appends, so document masking does not cut it there."""
    quoting = ["Models end text with <|endoftext|> here.\nMore.", "<|endoftext|><|endoftext|>"]
    (tmp_path / "a.txt").write_text(quoting[0])
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": quoting[1]}) + "\n")
    train_bpe(iter(quoting), 300).save(str(tmp_path / "bpe.json"))
    out = tmp_path / "shards"
    assert main(["data", str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl"), "--out", str(out), "--tokenizer",
                 str(tmp_path / "bpe.json")]) == 0
    ids, eos = load_tokens(str(out)).window(0, 10**6).tolist(), read_index(out)["eos_id"]
    ends = [i for i, t in enumerate(ids) if t == eos]
    assert len(ends) == 2 and ends[-1] == len(ids) - 1
    tokenizer = load_tokenizer(out / "tokenizer.json")
    assert [tokenizer.decode(d, skip_special_tokens=False) for d in (ids[:ends[0]], ids[ends[0] + 1:-1])] == quoting


def test_an_eos_that_text_encodes_to_is_refused(tmp_path, capsys):
    """--eos must name a special token: an ordinary one (or an added one that is not special) comes
    out of documents' own text too, where packing and document masking would cut them. The refusal
    lists the special tokens; a special one is taken."""
    from tokenizers import AddedToken
    text = tmp_path / "a.txt"
    text.write_text("the fox and the dog\n")
    tokenizer = train_bpe(iter(["the fox and the dog"] * 20), 300)
    tokenizer.add_tokens([AddedToken("<sep>", special=False)])
    tokenizer.save(str(tmp_path / "tok.json"))
    args = [str(text), "--tokenizer", str(tmp_path / "tok.json"), "--workers", "1", "--eos"]
    for eos in ("Ġthe", "<sep>", "<none>"):
        assert main(["data", *args, eos, "--out", str(tmp_path / "out")]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.endswith("; name one of its special tokens: <|endoftext|>\n"), err
        assert ("is no token" in err) == (eos == "<none>") and not (tmp_path / "out").exists()
    assert main(["data", *args, "<|endoftext|>", "--out", str(tmp_path / "out")]) == 0
    assert main(["data", str(text), "--eos", "</s>", "--out", str(tmp_path / "bpe")]) == 2
    assert "the BPE tetrad data trains ends documents with its special token <|endoftext|>" in capsys.readouterr().err
