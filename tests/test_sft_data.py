"""Supervised fine-tuning data from `tetrad data --prompt-key`: each example is the tokenizer's
document prefix, the prompt, the response and EOS, with a loss mask beside each shard that counts
the response and its EOS only."""

import json

import numpy as np
import pytest

from conftest import tiny_config
from test_data import _with_begin_of_text
from tetrad.cli import main
from tetrad.config import ConfigError
from tetrad.data.checks import check_data
from tetrad.data.shards import mask_name, open_loss_masks, open_shards, read_index
from tetrad.data.sources import load_tokens
from tetrad.data.tokenizer import load_tokenizer, train_bpe

EXAMPLES = [{"q": "What is 2+2?", "text": "4"},
            {"q": "", "text": "An answer with no prompt,\nover two lines."},
            {"q": "Say nothing.", "text": ""},  # no response: no example
            {"q": "Name a colour.\n\n\nOne.", "text": "Blue, héllo!"}]


def expected(tokenizer, prefix, examples, eos, prompt="q", response="text"):
    """The ids and loss mask `tetrad data` must write for `examples`, in order."""
    ids, mask = [], []
    for example in examples:
        if example[response]:
            asked = tokenizer.encode(example[prompt], add_special_tokens=False).ids
            answer = tokenizer.encode(example[response], add_special_tokens=False).ids + [eos]
            ids += prefix + asked + answer
            mask += [0] * (len(prefix) + len(asked)) + [1] * len(answer)
    return ids, mask


def written(folder):
    """Every token and every loss-mask byte of a shard folder, in order."""
    return (np.concatenate(open_shards(folder)).tolist(), np.concatenate(open_loss_masks(folder)).tolist())


def _jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_jsonl_examples_are_prefix_prompt_response_eos_and_the_loss_counts_the_response(tmp_path, capsys):
    tokenizer, bos = _with_begin_of_text(train_bpe(iter([e["q"] + e["text"] for e in EXAMPLES]), 300))
    tokenizer.save(str(tmp_path / "llama-like.json"))
    data, out = _jsonl(tmp_path / "sft.jsonl", EXAMPLES), tmp_path / "sft"
    assert main(["data", str(data), "--out", str(out), "--tokenizer", str(tmp_path / "llama-like.json"),
                 "--prompt-key", "q"]) == 0
    index = read_index(out)
    ids, mask = expected(tokenizer, [bos], EXAMPLES, index["eos_id"])
    assert written(out) == (ids, mask)
    assert mask[:2] == [0, 0] and mask[-1] == 1  # <|begin_of_text|> and the prompt; the EOS counts
    assert index["loss_mask"] is True and index["documents"] == 3 and index["tokens"] == len(ids)
    assert (out / mask_name(index["shards"][0]["file"])).is_file()
    printed = capsys.readouterr().out
    # The example with an empty response is counted where it is left out (before: "3 documents", no word of it)
    assert f"3 examples (1 more with an empty response left out), {len(ids):,} tokens (of which " \
           f"{sum(mask) / len(ids):.0%} are response tokens the loss counts; vocab" in printed
    assert "train.document_mask=true" in printed
    assert load_tokens(str(out)).counted([0, 3], 5).astype(int).tolist() == [mask[0:5], mask[3:8]]


def test_parquet_examples_match_and_the_bpe_learns_from_the_prompts_too(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    rows = [{"prompt": "zyzzyva " * 20 + f"question {i}?", "response": f"answer {i}" if i % 5 else None}
            for i in range(40)]
    path = tmp_path / "sft.parquet"
    pq.write_table(pa.table({"prompt": [r["prompt"] for r in rows], "response": [r["response"] for r in rows]}),
                   path, row_group_size=8)
    out = tmp_path / "sft"
    assert main(["data", str(path), "--out", str(out), "--vocab-size", "300", "--prompt-key", "prompt",
                 "--json-key", "response"]) == 0
    tokenizer, index = load_tokenizer(out / "tokenizer.json"), read_index(out)
    kept = [r for r in rows if r["response"]]
    assert index["documents"] == len(kept) == 32  # a null response is left out, and counted:
    assert "tetrad data: 32 examples (8 more with an empty response left out), " in capsys.readouterr().out
    assert written(out) == expected(tokenizer, [], kept, index["eos_id"], "prompt", "response")
    # The word only the prompts hold was learned as one token: the sample holds prompts.
    assert len(tokenizer.encode(" zyzzyva", add_special_tokens=False).ids) == 1


def test_examples_never_straddle_shards_and_masks_read_across_them(tmp_path, capsys):
    examples = [{"q": f"question {i}: " + "why " * (i % 4), "text": f"answer {i} " + "because " * (i % 3)}
                for i in range(30)]
    out = tmp_path / "sft"
    assert main(["data", str(_jsonl(tmp_path / "sft.jsonl", examples)), "--out", str(out), "--vocab-size", "300",
                 "--prompt-key", "q", "--shard-mb", "0.0001", "--workers", "2"]) == 0
    index, tokenizer = read_index(out), load_tokenizer(out / "tokenizer.json")
    ids, mask = expected(tokenizer, [], examples, index["eos_id"])
    assert written(out) == (ids, mask) and len(index["shards"]) > 3
    for shard, shard_mask in zip(open_shards(out), open_loss_masks(out)):
        assert shard[-1] == index["eos_id"] and shard_mask[-1] == 1 and shard_mask[0] == 0  # whole examples
    stream = load_tokens(str(out))
    boundary = index["shards"][0]["tokens"]
    starts = [boundary - 3, 0, boundary + index["shards"][1]["tokens"] - 1]
    assert stream.windows(starts, 9).tolist() == [ids[s:s + 9] for s in starts]
    assert stream.counted(starts, 9).tolist() == [[bool(m) for m in mask[s:s + 9]] for s in starts]


def test_without_prompt_key_a_folder_has_no_loss_mask(tmp_path, capsys):
    out = tmp_path / "plain"
    assert main(["data", str(_jsonl(tmp_path / "plain.jsonl", EXAMPLES)), "--out", str(out), "--vocab-size",
                 "300"]) == 0
    assert read_index(out)["loss_mask"] is False and not list(out.glob("*.mask"))
    assert open_loss_masks(out) is None and load_tokens(str(out)).loss_masks is None
    printed = capsys.readouterr().out
    assert "3 documents" in printed and "the loss counts" not in printed and "document_mask" not in printed


def _refused(argv, capsys, tmp_path) -> str:
    assert main(["data", *argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.partial").exists()
    return err


def test_examples_without_a_prompt_and_text_files_are_refused_in_one_line(tmp_path, capsys):
    data = _jsonl(tmp_path / "sft.jsonl", EXAMPLES[:1] + [{"text": "no prompt"}])
    second_line = len(json.dumps(EXAMPLES[0])) + 1
    assert _refused([str(data), "--prompt-key", "q"], capsys, tmp_path) == (
        f"tetrad data: {data}: the line at byte {second_line} is not a JSON object with a 'q' string; give the "
        "prompts' key with --prompt-key")
    assert _refused([str(data), "--prompt-key", "text", "--json-key", "q"], capsys, tmp_path) == (
        f"tetrad data: {data}: the line at byte {second_line} is not a JSON object with a 'q' string; give the "
        "texts' key with --json-key")
    # Past the part checked up front, the tokenizing workers stop the same way.
    late = _jsonl(tmp_path / "late.jsonl", [{"q": "x" * 50, "text": "y" * 50}] * 1000 + [{"q": 3, "text": "z"}])
    train_bpe(iter(["some text to learn from"]), 300).save(str(tmp_path / "bpe.json"))
    assert "late.jsonl: the line at byte " in _refused([str(late), "--prompt-key", "q", "--tokenizer",
                                                         str(tmp_path / "bpe.json")], capsys, tmp_path)

    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "notes.txt").write_text("a text file\n")
    for inputs in ([str(data), str(tmp_path / "text")], [str(tmp_path / "text" / "notes.txt")]):
        assert _refused([*inputs, "--prompt-key", "q"], capsys, tmp_path) == (
            f"tetrad data: {tmp_path / 'text' / 'notes.txt'} is a text file, which has no prompt (1 among the "
            "inputs); --prompt-key reads .jsonl and .parquet files only")
    assert "both name 'text'" in _refused([str(data), "--prompt-key", "text"], capsys, tmp_path)


def test_parquet_examples_without_a_prompt_are_refused_in_one_line(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "sft.parquet"
    pq.write_table(pa.table({"prompt": ["a", "b", None, "d"], "text": ["1", "2", "3", "4"]}), path, row_group_size=2)
    assert _refused([str(path), "--prompt-key", "question"], capsys, tmp_path) == (
        f"tetrad data: {path} has no string column 'question' (its columns: prompt, text); give the prompts' "
        "column with --prompt-key")
    assert _refused([str(path), "--prompt-key", "prompt"], capsys, tmp_path) == (
        f"tetrad data: {path}: row 2 has a null 'prompt'; give the prompts' column with --prompt-key")


def test_missing_or_short_loss_masks_are_refused_before_any_rank_starts(tmp_path, capsys):
    examples = [{"q": f"question {i}?", "text": f"answer {i}, " * 3} for i in range(20)]
    out = tmp_path / "sft"
    assert main(["data", str(_jsonl(tmp_path / "sft.jsonl", examples)), "--out", str(out), "--vocab-size", "300",
                 "--prompt-key", "q", "--shard-mb", "0.0004"]) == 0
    index = read_index(out)
    assert len(index["shards"]) > 1
    check_data(tiny_config(data={"source": str(out)}, model={"vocab_size": index["vocab_size"]}))
    capsys.readouterr()
    second = out / mask_name(index["shards"][1]["file"])
    second.write_bytes(second.read_bytes()[:-1])
    with pytest.raises(ConfigError, match="shard_00001.mask: missing or not"):
        check_data(tiny_config(data={"source": str(out)}, model={"vocab_size": index["vocab_size"]}))
    second.unlink()
    assert main(["train", f"--data.source={out}", f"--run.dir={tmp_path / 'run'}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"tetrad: config error: data.source: {second}: missing or not {index['shards'][1]['tokens']} "
                   "uint8 values as index.json says; rebuild the folder with `tetrad data`")
    assert not (tmp_path / "run").exists()


def test_an_eos_written_in_an_example_is_text_not_its_end(tmp_path):
    """A prompt or response quoting the EOS token ("<|endoftext|>") keeps it as characters: the
    example ends only at the EOS tetrad appends, so packing and document masking see it whole."""
    from tetrad.data.packing import ExamplePacks
    tokenizer = train_bpe(iter([e["q"] + e["text"] for e in EXAMPLES]), 300)
    tokenizer.save(str(tmp_path / "bpe.json"))
    quoting = [{"q": "What ends a document?", "text": "The token <|endoftext|> does."},
               {"q": "Say <|endoftext|> twice.", "text": "<|endoftext|><|endoftext|>"}]
    out = tmp_path / "sft"
    assert main(["data", str(_jsonl(tmp_path / "sft.jsonl", quoting)), "--out", str(out), "--tokenizer",
                 str(tmp_path / "bpe.json"), "--prompt-key", "q"]) == 0
    ids, mask = written(out)
    eos = read_index(out)["eos_id"]
    assert [i for i, t in enumerate(ids) if t == eos] == [ids.index(eos), len(ids) - 1]  # one EOS per example
    assert ExamplePacks(load_tokens(str(out)), capacity=len(ids)).examples == 2
    assert tokenizer.decode(ids[ids.index(eos) + 1:-1], skip_special_tokens=False) == \
        "Say <|endoftext|> twice.<|endoftext|><|endoftext|>"


def test_a_run_on_packed_examples_says_they_attend_to_each_other_without_document_masking(tmp_path, capsys):
    """Several examples packed in a window attend to each other unless train.document_mask is set:
    the run's data line says so, as `tetrad data` does."""
    from tetrad.train.batches import describe
    data, out = _jsonl(tmp_path / "sft.jsonl", EXAMPLES * 20), tmp_path / "sft"
    assert main(["data", str(data), "--out", str(out), "--vocab-size", "300", "--prompt-key", "q"]) == 0
    vocab = read_index(out)["vocab_size"]
    for document_mask, said in ((False, True), (True, False)):
        line = describe(tiny_config(data={"source": str(out)}, model={"vocab_size": vocab},
                                    train={"document_mask": document_mask}))
        assert ("they attend to each other: set train.document_mask=true" in line) == said, line


def test_inputs_that_hold_no_document_are_refused_in_one_line(tmp_path, capsys):
    """Blank lines and empty texts, examples whose responses are all empty, conversations none of
    which has an assistant turn: every one is left out, and a folder of no shards, which a run
    would refuse with "rebuild it with `tetrad data`", is not written."""
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n" + json.dumps({"text": ""}) + "\n  \n")
    assert _refused([str(blank), "--vocab-size", "300"], capsys, tmp_path) == (
        "tetrad data: every text is empty (blank lines, and empty or null texts under --json-key 'text', are no "
        "documents)")
    unanswered = _jsonl(tmp_path / "sft.jsonl", [{"q": "a question", "text": ""}])
    assert _refused([str(unanswered), "--vocab-size", "300", "--prompt-key", "q"], capsys, tmp_path) == (
        "tetrad data: every example's response under --json-key 'text' is empty (such examples are left out)")
    tokenizer = tmp_path / "tokenizer.json"
    train_bpe(iter(["some text"]), 300).save(str(tokenizer))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{% for m in messages %}"
                                                                "{{ m['content'] }}{% endfor %}"}))
    system_only = _jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "system", "content": "Be brief."}]}])
    assert _refused([str(system_only), "--tokenizer", str(tokenizer), "--chat-key", "messages"], capsys, tmp_path) == (
        "tetrad data: no conversation under --chat-key 'messages' has an assistant turn (those without are left "
        "out); check the key and the messages' roles")
