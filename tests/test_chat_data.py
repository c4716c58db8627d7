"""Chat fine-tuning data from `tetrad data --chat-key`: conversations rendered with the model's
chat template (transformers' apply_chat_template is the oracle for the ids), the loss mask
counting each assistant turn's tokens only."""

import json

import pytest

from test_data import _with_begin_of_text
from test_sft_data import _jsonl, _refused, written
from tetrad.cli import main
from tetrad.data.shards import read_index
from tetrad.data.tokenizer import train_bpe
from tetrad.model.sampling import GREEDY

# Llama 3's structure (a header per message, <|eot_id|> after each, BOS rendered by the template),
# written here: a role it does not know is refused through raise_exception.
TEMPLATE = ("{{ bos_token }}{% for message in messages %}"
            "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
            "{{ raise_exception('no role ' + message['role'] + ' in this template') }}{% endif %}"
            "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim "
            "+ '<|eot_id|>' }}{% endfor %}"
            "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
SPECIAL = ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
BOS = "<|begin_of_text|>"

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4"}],
    [{"role": "system", "content": "You answer briefly.\n\nAlways."},
     {"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue, héllo!"},
     {"role": "user", "content": "  And another?"}, {"role": "assistant", "content": "Red.\nOr green. "}],
    [{"role": "system", "content": "Nobody answers here."}, {"role": "user", "content": "Hello?"}],  # left out
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
     {"role": "user", "content": "Bye"}],  # ends with the user's turn
]


def _chat_tokenizer(tmp_path, template=TEMPLATE, eos_token="<|eot_id|>", texts=()):
    """A BPE (learned from the conversations and `texts`) with Llama 3's special tokens saved as
    tmp_path/tokenizer.json, the template in the tokenizer_config.json beside it; the tokenizer
    and the config's path."""
    texts = [m["content"] for c in CONVERSATIONS for m in c] * 4 + list(texts)
    tokenizer, _ = _with_begin_of_text(train_bpe(iter(texts), 300))
    tokenizer.add_special_tokens(SPECIAL)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    config = tmp_path / "tokenizer_config.json"
    config.write_text(json.dumps({"chat_template": template, "bos_token": {"content": BOS}, "eos_token": eos_token}))
    return tokenizer, config


def _oracle(tmp_path, conversation, template=TEMPLATE):
    """transformers' ids for the conversation: what a model fine-tuned with HF tooling sees."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), chat_template=template,
                                              bos_token=BOS, eos_token="<|eot_id|>")
    return _ids(hf.apply_chat_template(conversation, tokenize=True))


def _ids(encoded) -> list[int]:
    """apply_chat_template's ids: a list, or (in newer transformers) an encoding that holds them."""
    return list(encoded["input_ids"] if "input_ids" in encoded else encoded)


def _runs(values, flags):
    """The runs of `values` where `flags` is 1, in order."""
    runs, current = [], []
    for value, flag in zip(values, flags):
        if flag:
            current.append(value)
        elif current:
            runs, current = runs + [current], []
    return runs + ([current] if current else [])


def _chat_data(tmp_path, records, *flags, out="out"):
    data, out = _jsonl(tmp_path / "chat.jsonl", records), tmp_path / out
    assert main(["data", str(data), "--out", str(out), "--tokenizer", str(tmp_path / "tokenizer.json"),
                 "--chat-key", "messages", *flags]) == 0
    return out


def test_conversations_are_the_templates_ids_and_the_loss_counts_each_assistant_turn(tmp_path, capsys):
    tokenizer, _ = _chat_tokenizer(tmp_path)
    out = _chat_data(tmp_path, [{"messages": c} for c in CONVERSATIONS])
    index = read_index(out)
    ids, mask = written(out)
    eos = index["eos_id"]
    assert eos == tokenizer.token_to_id("<|endoftext|>")
    kept = [c for c in CONVERSATIONS if any(m["role"] == "assistant" for m in c)]
    assert index["loss_mask"] is True and index["documents"] == len(kept) == 3
    # The ids are the model's own template's, each conversation then ended by the folder's EOS.
    assert ids == [i for c in kept for i in _oracle(tmp_path, c) + [eos]]
    # One BOS a conversation (the template's; no document prefix before it), every end of turn one id.
    assert ids.count(tokenizer.token_to_id(BOS)) == 3 and ids[0] == tokenizer.token_to_id(BOS)
    assert ids.count(tokenizer.token_to_id("<|eot_id|>")) == sum(len(c) for c in kept)
    # The loss counts each assistant turn's content and its <|eot_id|>, nothing else; the EOS counts
    # after an assistant's turn (the end of its answer), not after a user's.
    answers = []
    for conversation in kept:
        answers += [m["content"].strip() + "<|eot_id|>" for m in conversation if m["role"] == "assistant"]
        answers[-1] += "<|endoftext|>" if conversation[-1]["role"] == "assistant" else ""
    assert answers[0] == "4<|eot_id|><|endoftext|>" and answers[-1] == "Hello.<|eot_id|>"
    assert [tokenizer.decode(run, skip_special_tokens=False) for run in _runs(ids, mask)] == answers
    assert mask[-1] == 0 and ids[-1] == eos
    printed = capsys.readouterr().out
    assert f"3 conversations (1 more without an assistant turn left out), {len(ids):,} tokens (of which " \
           f"{sum(mask) / len(ids):.0%} are assistant tokens the loss counts; vocab" in printed


def test_no_eos_is_added_where_the_template_ends_with_it(tmp_path):
    """With --eos <|eot_id|> the template's last end of turn ends the document: no second one (a
    conversation of one turn: with more, that EOS inside it is refused, as below)."""
    tokenizer, _ = _chat_tokenizer(tmp_path)
    answer = [{"role": "assistant", "content": "4"}]
    out = _chat_data(tmp_path, [{"messages": answer}], "--eos", "<|eot_id|>")
    ids, mask = written(out)
    assert ids == _oracle(tmp_path, answer) and ids[-1] == read_index(out)["eos_id"]
    assert [tokenizer.decode(run, skip_special_tokens=False) for run in _runs(ids, mask)] == ["4<|eot_id|>"]


def test_parquet_conversations_are_a_list_of_structs_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    tokenizer, _ = _chat_tokenizer(tmp_path)
    rows = [CONVERSATIONS[0], None, CONVERSATIONS[1], []]  # a null and an empty row are left out
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.table({"id": list(range(4)), "messages": rows}), path, row_group_size=2)
    assert pa.types.is_struct(pq.read_schema(path).field("messages").type.value_type)
    out = tmp_path / "out"
    assert main(["data", str(path), "--out", str(out), "--tokenizer", str(tmp_path / "tokenizer.json"),
                 "--chat-key", "messages"]) == 0
    ids, mask = written(out)
    eos = read_index(out)["eos_id"]
    assert ids == _oracle(tmp_path, rows[0]) + [eos] + _oracle(tmp_path, rows[2]) + [eos]
    assert len(_runs(ids, mask)) == 3 and read_index(out)["documents"] == 2


def test_parquet_rows_that_are_not_conversations_are_refused_in_one_line(tmp_path, capsys):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    _chat_tokenizer(tmp_path)
    path = tmp_path / "chat.parquet"
    flags = [str(path), "--tokenizer", str(tmp_path / "tokenizer.json"), "--chat-key", "messages"]
    pq.write_table(pa.table({"messages": [CONVERSATIONS[0], [{"role": "user", "content": None}]]}), path)
    assert _refused(flags, capsys, tmp_path) == (
        f"tetrad data: {path}: row 1 is not a list of {{role, content}} strings; give the conversations' column "
        "with --chat-key")
    pq.write_table(pa.table({"messages": ["a string"]}), path)
    assert _refused(flags, capsys, tmp_path) == (
        f"tetrad data: {path} has no list column 'messages' (its columns: messages); give the conversations' "
        "column with --chat-key")


def test_the_template_comes_from_a_config_a_jinja_file_or_beside_the_tokenizer(tmp_path):
    _, config = _chat_tokenizer(tmp_path)
    expected = written(_chat_data(tmp_path, [{"messages": CONVERSATIONS[0]}]))
    ids = _oracle(tmp_path, CONVERSATIONS[0]) + [read_index(tmp_path / "out")["eos_id"]]
    assert expected == (ids, [0] * (len(ids) - 3) + [1] * 3)  # ...<|end_header_id|>\n\n | 4 <|eot_id|> EOS
    (tmp_path / "elsewhere").mkdir()
    listed = tmp_path / "elsewhere" / "tokenizer_config.json"  # HF's named form
    listed.write_text(json.dumps({"chat_template": [{"name": "tool_use", "template": "x"},
                                                    {"name": "default", "template": TEMPLATE}], "bos_token": BOS}))
    raw = tmp_path / "elsewhere" / "llama.jinja"  # bos_token from the config beside the tokenizer
    raw.write_text(TEMPLATE)
    for i, flag in enumerate((listed, raw)):
        assert written(_chat_data(tmp_path, [{"messages": CONVERSATIONS[0]}], "--chat-template", str(flag),
                                  out=f"out{i}")) == expected
    # Newer Hugging Face models keep the template in chat_template.jinja beside tokenizer_config.json.
    config.write_text(json.dumps({"bos_token": BOS}))
    (tmp_path / "chat_template.jinja").write_text(TEMPLATE)
    assert written(_chat_data(tmp_path, [{"messages": CONVERSATIONS[0]}], out="beside")) == expected


def test_chat_data_errors_are_one_line(tmp_path, capsys):
    _, config = _chat_tokenizer(tmp_path)
    tokenizer = str(tmp_path / "tokenizer.json")
    good = {"messages": CONVERSATIONS[0]}
    data = _jsonl(tmp_path / "chat.jsonl", [good, {"messages": [{"role": "tool", "content": "42"}]}])
    second = len(json.dumps(good)) + 1
    assert _refused([str(data), "--tokenizer", tokenizer, "--chat-key", "messages"], capsys, tmp_path) == (
        f"tetrad data: {data}: the line at byte {second}: the chat template refuses the conversation: no role tool "
        "in this template")
    bad = _jsonl(tmp_path / "bad.jsonl", [good, {"messages": [{"role": "user", "content": 3}]}])
    assert _refused([str(bad), "--tokenizer", tokenizer, "--chat-key", "messages"], capsys, tmp_path) == (
        f"tetrad data: {bad}: the line at byte {second} is not a JSON object with a 'messages' list of {{role, "
        "content} strings; give the conversations' key with --chat-key")
    dropping = tmp_path / "last_two.jinja"  # renders the last two messages only: turns cannot be found
    dropping.write_text(TEMPLATE.replace("in messages %}", "in messages[-2:] %}"))
    conversation = _jsonl(tmp_path / "long.jsonl", [{"messages": CONVERSATIONS[1]}])
    assert "long.jsonl: the line at byte 0: the chat template is not incremental" in _refused(
        [str(conversation), "--tokenizer", tokenizer, "--chat-key", "messages", "--chat-template", str(dropping)],
        capsys, tmp_path)
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    assert "the chat template is not valid Jinja" in _refused(
        [str(data), "--tokenizer", tokenizer, "--chat-key", "messages", "--chat-template",
         str(tmp_path / "broken.jinja")], capsys, tmp_path)
    (tmp_path / "notes.txt").write_text("text\n")
    assert _refused([str(tmp_path / "notes.txt"), "--tokenizer", tokenizer, "--chat-key", "messages"], capsys,
                    tmp_path) == (f"tetrad data: {tmp_path / 'notes.txt'} is a text file, which has no conversations "
                                  "(1 among the inputs); --chat-key reads .jsonl and .parquet files only")
    assert _refused([str(data), "--chat-key", "messages"], capsys, tmp_path) == (
        "tetrad data: --chat-key needs --tokenizer: the model's tokenizer.json, which its chat template is for")
    assert "--chat-template is for conversations" in _refused(
        [str(data), "--tokenizer", tokenizer, "--chat-template", str(config)], capsys, tmp_path)
    config.unlink()
    assert _refused([str(data), "--tokenizer", tokenizer, "--chat-key", "messages"], capsys, tmp_path) == (
        f"tetrad data: no chat template in {config} (or chat_template.jinja beside {tokenizer}); pass "
        "--chat-template with the model's tokenizer_config.json or a .jinja file")
    with pytest.raises(SystemExit):
        main(["data", str(data), "--out", str(tmp_path / "o"), "--tokenizer", tokenizer, "--chat-key", "messages",
              "--prompt-key", "q"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_token_across_a_turns_edge_counts_and_the_ids_stay_the_templates(tmp_path):
    """A plain-text template whose generation prompt ends with a space: BPE encodes the space with
    the answer's first word (" Hello"), so the text is tokenized whole (pieces would give ":", " ",
    "Hello", not apply_chat_template's ids) and that token counts: it holds the answer's start."""
    plain = ("{% for message in messages %}{{ message['role'] | capitalize }}: {{ message['content'] }}\n{% endfor %}"
             "{% if add_generation_prompt %}Assistant: {% endif %}")
    tokenizer, _ = _chat_tokenizer(tmp_path, template=plain, texts=["Assistant: Hello"] * 50)
    assert len(tokenizer.encode(" Hello", add_special_tokens=False).ids) == 1
    conversation = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"}]
    ids, mask = written(_chat_data(tmp_path, [{"messages": conversation}]))
    assert ids == _oracle(tmp_path, conversation, plain) + [tokenizer.token_to_id("<|endoftext|>")]
    assert [tokenizer.decode(run, skip_special_tokens=False) for run in _runs(ids, mask)] == [" Hello\n<|endoftext|>"]


def test_a_run_on_chat_data_answers_in_its_template_and_exports_it(tmp_path, capsys):
    """The loop after chat fine-tuning: the data folder keeps the template, so `tetrad generate
    --chat` renders the user's message as the data was rendered (transformers' ids with the
    generation prompt) and stops at the template's end of turn; the Hugging Face export carries
    the template, so transformers' apply_chat_template gives the same ids there."""
    transformers = pytest.importorskip("transformers")
    from tetrad.data.chat import template_beside
    from tetrad.train.generate import stop_tokens
    tokenizer, _ = _chat_tokenizer(tmp_path)
    out = _chat_data(tmp_path, [{"messages": c} for c in CONVERSATIONS] * 10)
    assert template_beside(out / "tokenizer.json").text == TEMPLATE
    run, hf = tmp_path / "run", tmp_path / "hf"
    assert main(["train", f"--data.source={out}", "--train.steps=2", "--model.seq_len=32", "--train.global_batch=2",
                 "--train.micro_batch=1", "--checkpoint.every=2", f"--run.dir={run}"]) == 0
    capsys.readouterr()
    assert main(["generate", str(run), "--chat", "--prompt", "Name a colour.", "--max-new-tokens", "4"]) == 0
    message = [{"role": "user", "content": "Name a colour."}]
    hf_ids = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), chat_template=TEMPLATE,
                                                  bos_token=BOS).apply_chat_template(message, add_generation_prompt=True)
    from tetrad.train.generate import load_generator, reply
    model, run_tokenizer, source = load_generator(run)
    _, ids, new = reply(model, run_tokenizer, template_beside(source), message, 4, GREEDY)
    assert ids == _ids(hf_ids)
    eot = tokenizer.token_to_id("<|eot_id|>")
    assert eot in stop_tokens(run_tokenizer, template_beside(source)) and eot not in new[:-1]
    assert main(["convert", str(run), "--to-hf", str(hf)]) == 0
    exported = transformers.AutoTokenizer.from_pretrained(hf)
    assert _ids(exported.apply_chat_template(message, add_generation_prompt=True, tokenize=True)) == ids


def test_a_base_models_tokenizer_config_has_no_template(tmp_path):
    """convert --to-tetrad keeps a base model's tokenizer_config.json (no chat_template): no template, not an error."""
    from tetrad.data.chat import template_beside
    _chat_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": BOS, "eos_token": "<|eot_id|>"}))
    assert template_beside(tmp_path / "tokenizer.json") is None


def test_an_eos_inside_a_conversation_is_refused(tmp_path, capsys):
    """Llama 2's template ends each answer with eos_token: with that --eos, training would cut the
    conversation into turns (packing, document masking), so tetrad data refuses it, naming the line."""
    template = ("{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] + ' [/INST]' }}"
                "{% else %}{{ ' ' + m['content'] + ' ' + eos_token }}{% endif %}{% endfor %}")
    _chat_tokenizer(tmp_path, template=template, eos_token="<|eot_id|>")
    data = _jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[1][1:]}])
    assert main(["data", str(data), "--out", str(tmp_path / "out"), "--tokenizer", str(tmp_path / "tokenizer.json"),
                 "--chat-key", "messages", "--eos", "<|eot_id|>"]) != 0
    assert "line at byte 0: the conversation holds the folder's EOS '<|eot_id|>' before its end" in capsys.readouterr().err


def test_the_export_renders_the_templates_bos_token_where_the_tokenizer_adds_none(tmp_path):
    """A template's {{ bos_token }} is the data's own in the exported tokenizer_config.json, even for
    a tokenizer whose post-processor adds no BOS (no document prefix to name it by)."""
    transformers = pytest.importorskip("transformers")
    from tetrad.data.chat import ChatTemplate, Conversations
    from tetrad.train.convert import write_hf_tokenizer
    tokenizer = train_bpe(iter(["user assistant hi hello"] * 20), 300)
    tokenizer.add_special_tokens(["<s>"])
    chat = ChatTemplate("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}",
                        bos="<s>")
    write_hf_tokenizer(tokenizer, tmp_path, 64, chat)
    exported = transformers.AutoTokenizer.from_pretrained(tmp_path)
    conversation = CONVERSATIONS[0]
    assert exported.apply_chat_template(conversation, tokenize=False) == \
        Conversations(chat, tokenizer, None).render(conversation, False, "here")


def test_a_template_without_tools_renders_as_transformers_renders_it(tmp_path):
    """transformers passes tools=None and documents=None when there are none: a template that
    tests `tools is not none` renders no tool block here either."""
    template = "{% if tools is not none %}[TOOLS]{% endif %}" + TEMPLATE
    tokenizer, _ = _chat_tokenizer(tmp_path, template=template)
    out = _chat_data(tmp_path, [{"messages": CONVERSATIONS[0]}])
    ids = written(out)[0]
    assert ids == _oracle(tmp_path, CONVERSATIONS[0], template=template) + [read_index(out)["eos_id"]]
    assert "[TOOLS]" not in tokenizer.decode(ids, skip_special_tokens=False)


def test_the_tokenizer_may_be_named_by_its_models_folder(tmp_path, capsys):
    """--tokenizer names a Hugging Face model's folder as readily as its tokenizer.json (the
    template beside it comes too); a folder without one is refused in one line."""
    _chat_tokenizer(tmp_path)
    data = _jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATIONS[0]}])
    by_file = _chat_data(tmp_path, [{"messages": CONVERSATIONS[0]}], out="by_file")
    assert main(["data", str(data), "--out", str(tmp_path / "by_folder"), "--tokenizer", str(tmp_path),
                 "--chat-key", "messages"]) == 0
    assert written(tmp_path / "by_folder") == written(by_file)
    (tmp_path / "empty").mkdir()
    assert _refused([str(data), "--tokenizer", str(tmp_path / "empty")], capsys, tmp_path) == (
        f"tetrad data: --tokenizer {tmp_path / 'empty'} is a folder without a tokenizer.json; pass the tokenizer.json")
