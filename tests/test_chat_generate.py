"""`tetrad generate --chat` as a conversation: each turn renders the whole history (a system
message first) with the run's chat template, as transformers' apply_chat_template does (the
oracle for the ids); the KV cache kept from turn to turn changes no answer; the conversation ends
cleanly at an empty line, the input's end or the model's seq_len."""

import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_chat_data import BOS, CONVERSATIONS, TEMPLATE, _chat_data, _chat_tokenizer, _ids
from test_generate import random_model
from conftest import as_a_shell_starts
from tetrad.cli import main
from tetrad.data.chat import template_beside
from tetrad.train.generate import Dialogue, continuation_loss, converse, load_generator, reply
from tetrad.model.sampling import GREEDY

SRC = str(Path(__file__).resolve().parents[1] / "src")
SYSTEM = "You answer briefly."
QUESTIONS = ["Name a colour.", "And another?", "What is 2+2?"]


def _oracle(tokenizer_file, messages) -> list[int]:
    """transformers' ids for `messages` and the generation prompt: what the model is to read."""
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_file), chat_template=TEMPLATE, bos_token=BOS)
    return _ids(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))


def _random_dialogue(tmp_path, seq_len=256, system=SYSTEM):
    """A Dialogue in TEMPLATE with an untrained model of the chat tokenizer's vocabulary."""
    tokenizer, _ = _chat_tokenizer(tmp_path)
    model = random_model(vocab_size=tokenizer.get_vocab_size(), seq_len=seq_len)
    return Dialogue(model, tokenizer, template_beside(tmp_path / "tokenizer.json"), system)


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    """A run trained two steps on chat data (seq_len 128) and its data folder, which holds the template."""
    folder = tmp_path_factory.mktemp("chat")
    _chat_tokenizer(folder)
    out = _chat_data(folder, [{"messages": c} for c in CONVERSATIONS] * 20)
    run = folder / "run"
    assert main(["train", f"--data.source={out}", "--train.steps=2", "--model.seq_len=128", "--train.global_batch=2",
                 "--train.micro_batch=1", "--checkpoint.every=2", f"--run.dir={run}"]) == 0
    return run, out


def test_each_turn_reads_the_whole_history_as_transformers_renders_it_and_the_cache_changes_no_answer(tmp_path):
    """Greedy answers: every turn's prompt is apply_chat_template's ids of the system message,
    the earlier turns (answers included) and the new message; the turns after the first reuse
    the cache, and answer what a fresh decoding of the same history answers, even when the
    history departs from the cache inside an answer (here: edited)."""
    dialogue = _random_dialogue(tmp_path)
    tokenizer = dialogue.tokenizer
    for question in QUESTIONS:
        history = dialogue.messages + [{"role": "user", "content": question}]
        reused = dialogue.cache.reused
        text, ids, new = dialogue.answer(question, 6, GREEDY)
        assert ids == _oracle(tmp_path / "tokenizer.json", history)
        assert (text, ids, new) == reply(dialogue.model, tokenizer, dialogue.chat, history, 6, GREEDY)
        assert dialogue.messages == history + [{"role": "assistant", "content": text}]
        assert dialogue.cache.ids == ids + new[:-1]
        assert (dialogue.cache.reused - reused > 0) == (question != QUESTIONS[0])
    rendered = tokenizer.decode(ids, skip_special_tokens=False)
    first_answer = dialogue.messages[2]["content"].strip()
    assert first_answer and first_answer in rendered and SYSTEM in rendered and QUESTIONS[0] in rendered
    dialogue.messages[2]["content"] = "Blue."
    history = dialogue.messages + [{"role": "user", "content": "Why?"}]
    reused, first_prompt = dialogue.cache.reused, len(_oracle(tmp_path / "tokenizer.json", dialogue.messages[:2]))
    assert dialogue.answer("Why?", 6, GREEDY) == reply(dialogue.model, tokenizer, dialogue.chat, history, 6,
                                                             GREEDY)
    assert first_prompt <= dialogue.cache.reused - reused < first_prompt + 6  # it departs inside the first answer


def test_the_conversation_ends_at_the_models_seq_len_in_one_line(tmp_path, capsys):
    """No failure at the context's end: a message whose rendering fills seq_len, or an answer
    that runs into it, ends the conversation with a line saying so."""
    dialogue = _random_dialogue(tmp_path, seq_len=64)
    lines = io.StringIO("\n".join(QUESTIONS * 3) + "\n")
    turns = converse(dialogue, 3, GREEDY, 0, lines)
    out, err = capsys.readouterr()
    assert 0 < turns < len(QUESTIONS) and out.count("\n") == turns
    assert err.startswith("tetrad generate: the rendered conversation is ") and err.endswith(
        "tokens and the model reads at most 64 tokens: the conversation ends here\n")
    dialogue = _random_dialogue(tmp_path, seq_len=64)
    assert converse(dialogue, 200, GREEDY, 0, io.StringIO("\n".join(QUESTIONS) + "\n")) == 1
    assert capsys.readouterr().err == "tetrad generate: the answer reached the end of the model's context (64 " \
                                      "tokens): the conversation ends here\n"


def test_generate_chat_without_a_prompt_converses_over_stdin(chat_run, monkeypatch, capsys):
    """Each line of stdin is the user's next message and each answer a line of stdout (no prompt
    marker when piped): the answers to the whole history, system message first; the input's end
    exits 0."""
    run, data = chat_run
    monkeypatch.setattr("sys.stdin", io.StringIO("\n".join(QUESTIONS[:2]) + "\n"))
    assert main(["generate", str(run), "--chat", "--system", SYSTEM, "--temperature", "0",
                 "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    model, tokenizer, source = load_generator(run)
    history, answers, prompted = [{"role": "system", "content": SYSTEM}], [], 0
    for question in QUESTIONS[:2]:
        history.append({"role": "user", "content": question})
        text, ids, _ = reply(model, tokenizer, template_beside(source), history, 6, GREEDY)
        assert ids == _oracle(data / "tokenizer.json", history)
        history.append({"role": "assistant", "content": text})
        answers.append(text)
        prompted += len(ids)
    assert out == "".join(a + "\n" for a in answers)
    held = re.fullmatch(rf"tetrad generate: answered 2 messages; the KV cache held (\d+) of their {prompted} prompt "
                        r"tokens\n", err)
    assert held and int(held[1]) > 0  # the second turn read the whole history, the first turn's from the cache


# A plain template, its end-of-turn markup a newline (no special token ends a turn).
PLAIN = ("{% for message in messages %}{{ message['role'] + ': ' + message['content'] | trim + '\\n' }}{% endfor %}"
         "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")


def test_a_template_whose_turn_ends_with_a_newline_prints_one_newline_a_turn(tmp_path, monkeypatch, capsys):
    """The model answers as it learned from such data, its content then the markup (a newline)
    then the EOS: piped, stdout holds each answer and one newline (before: a blank line after
    each), and the history holds the content, which the template renders with its newline again."""
    import tetrad.train.generate as module
    tokenizer, _ = _chat_tokenizer(tmp_path, template=PLAIN)
    model = random_model(vocab_size=tokenizer.get_vocab_size(), seq_len=256)
    dialogue = Dialogue(model, tokenizer, template_beside(tmp_path / "tokenizer.json"))
    said = tokenizer.encode("Blue.\n", add_special_tokens=False).ids + [tokenizer.token_to_id("<|eot_id|>")]
    monkeypatch.setattr(module, "generate", lambda *args: (said, []))
    assert converse(dialogue, 8, GREEDY, 0, io.StringIO("\n".join(QUESTIONS[:2]) + "\n")) == 2
    assert capsys.readouterr().out == "Blue.\nBlue.\n"
    assert [m["content"] for m in dialogue.messages if m["role"] == "assistant"] == ["Blue.", "Blue."]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_an_empty_line_ends_the_conversation_and_a_terminal_gets_a_prompt_marker(chat_run, monkeypatch, capsys):
    run, _ = chat_run
    stdin = _Terminal(f"{QUESTIONS[0]}\n\n{QUESTIONS[1]}\n")
    monkeypatch.setattr("sys.stdin", stdin)
    assert main(["generate", str(run), "--chat", "--temperature", "0", "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    model, tokenizer, source = load_generator(run)
    answer = reply(model, tokenizer, template_beside(source), [{"role": "user", "content": QUESTIONS[0]}], 6,
                   GREEDY)[0]
    assert out == f"> {answer}\n> " and "answered 1 message;" in err
    assert stdin.read() == f"{QUESTIONS[1]}\n"  # not read: the conversation ended before it


def test_one_message_with_a_system_message_first(chat_run, capsys):
    """--prompt with --system: one turn, the system message rendered first (the loss line is
    that of the answer after the prompt that holds it)."""
    run, _ = chat_run
    assert main(["generate", str(run), "--chat", "--system", SYSTEM, "--prompt", QUESTIONS[0], "--temperature", "0",
                 "--max-new-tokens", "6"]) == 0
    out, err = capsys.readouterr()
    model, tokenizer, source = load_generator(run)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    text, ids, new = reply(model, tokenizer, template_beside(source), messages, 6, GREEDY)
    assert out == text + "\n"
    assert f"tetrad generate: {len(new)} tokens; their loss under the model {continuation_loss(model, ids, new):.4f}" in err


def test_a_system_message_the_template_refuses_is_refused_in_one_line(chat_run, monkeypatch, capsys):
    """Gemma's template has no system role: --system is refused before any turn, in one line;
    and --system without --chat is refused too."""
    run, data = chat_run
    config = data / "tokenizer_config.json"
    kept = config.read_text()
    no_system = ("{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
                 "{% endif %}" + TEMPLATE)
    config.write_text(json.dumps({**json.loads(kept), "chat_template": no_system}))
    try:
        stdin = io.StringIO(f"{QUESTIONS[0]}\n")
        monkeypatch.setattr("sys.stdin", stdin)
        for prompt in (["--prompt", QUESTIONS[0]], []):
            assert main(["generate", str(run), "--chat", "--system", SYSTEM, *prompt]) == 2
            out, err = capsys.readouterr()
            assert out == "" and err == ("tetrad generate: --system: the chat template refuses the conversation: "
                                         "System role not supported\n")
        assert stdin.read() == f"{QUESTIONS[0]}\n"
        assert main(["generate", str(run), "--chat", "--prompt", QUESTIONS[0], "--max-new-tokens", "2"]) == 0
        capsys.readouterr()
    finally:
        config.write_text(kept)
    assert main(["generate", str(run), "--system", SYSTEM, "--prompt", "hi"]) == 2
    assert capsys.readouterr().err == "tetrad generate: --system is a chat's system message: pass --chat too\n"


def test_a_template_eos_the_tokenizer_lacks_is_noted_once(chat_run, capsys):
    """A template whose eos_token is no single token of the tokenizer cannot end an answer by it:
    one note says the answer runs to the EOS or --max-new-tokens, and it still answers."""
    run, data = chat_run
    config = data / "tokenizer_config.json"
    kept = config.read_text()
    config.write_text(json.dumps({**json.loads(kept), "eos_token": "<|no such token|>"}))
    try:
        assert main(["generate", str(run), "--chat", "--prompt", QUESTIONS[0], "--max-new-tokens", "2"]) == 0
    finally:
        config.write_text(kept)
    out, err = capsys.readouterr()
    note = "tetrad generate: note: the template's eos_token '<|no such token|>' is not one token of the tokenizer"
    assert out and err.count(note) == 1, err


def test_a_continuation_the_context_ends_says_so(chat_run, capsys):
    """--max-new-tokens beyond what seq_len leaves: the continuation stops at the context, and
    the summary line says the context ended it (it used to stop silently)."""
    run, _ = chat_run
    assert main(["generate", str(run), "--prompt", "Hi", "--max-new-tokens", "100000", "--top-k", "1"]) == 0
    err = capsys.readouterr().err
    assert "the model's context (128 tokens) ended it before --max-new-tokens" in err, err
    assert main(["generate", str(run), "--prompt", "Hi", "--max-new-tokens", "3"]) == 0
    assert "ended it" not in capsys.readouterr().err


def _generate_chat(run, code: str = "") -> subprocess.Popen:
    """`tetrad generate RUN --chat` in its own process, as a user runs it, stdin and stdout piped;
    `code` runs first in that process (before tetrad's command line)."""
    script = f"import sys; {code}\nfrom tetrad.cli import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.Popen([sys.executable, "-c", script, "generate", str(run), "--chat", "--temperature", "0",
                             "--max-new-tokens", "6"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=as_a_shell_starts(),
                            env={**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"})


def test_ctrl_c_while_the_chat_waits_for_a_line_ends_it_quietly(chat_run):
    """Ctrl-C at the next message's prompt ends the conversation as a shell's command ends: a
    newline, status 130, no traceback (it printed the training's `stopped by SIGINT; every rank
    was stopped`; with torch half imported, a traceback)."""
    proc = _generate_chat(chat_run[0])
    proc.stdin.write(f"{QUESTIONS[0]}\n")
    proc.stdin.flush()
    answer = proc.stdout.readline()  # the first turn answered: the chat now waits for the next line
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert answer.strip() and out == "" and (proc.returncode, err) == (128 + signal.SIGINT, "\n")


# A real SIGINT, sent from inside the model's third forward: the first answer's second token.
INTERRUPT_IN_DECODING = """
import os, signal, torch
forwards = []
def interrupt(module, args):
    if type(module).__name__ == "Transformer":
        forwards.append(module)
    if len(forwards) == 3 and type(module).__name__ == "Transformer":
        os.kill(os.getpid(), signal.SIGINT)
torch.nn.modules.module.register_module_forward_pre_hook(interrupt)
"""


# A real SIGINT, sent while torch is half imported (as the command starts).
INTERRUPT_IN_IMPORT = """
import os, signal, importlib.abc
class Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "torch.functional":
            os.kill(os.getpid(), signal.SIGINT)
sys.meta_path.insert(0, Interrupt())
"""


@pytest.mark.parametrize("code", [INTERRUPT_IN_DECODING, INTERRUPT_IN_IMPORT], ids=["decoding", "torch-import"])
def test_ctrl_c_while_the_model_answers_or_loads_ends_the_chat_quietly(chat_run, code):
    """In torch's import the handler's own import of tetrad.launch failed on the half-imported
    torch: a traceback, and the process killed by the signal."""
    proc = _generate_chat(chat_run[0], code)
    out, err = proc.communicate(f"{QUESTIONS[0]}\n{QUESTIONS[1]}\n", timeout=60)
    assert (proc.returncode, out, err) == (128 + signal.SIGINT, "", "\n")


def test_a_hugging_face_folder_chats_in_its_own_template(tmp_path, capsys):
    """`tetrad generate HF_DIR --chat`: an instruct model's folder as it stands answers in the
    chat template of its tokenizer_config.json (the message rendered as transformers renders it),
    stopping at the template's eos_token, with no conversion and no data folder."""
    transformers = pytest.importorskip("transformers")
    hf = tmp_path / "hf"
    hf.mkdir()
    tokenizer, _ = _chat_tokenizer(hf)
    config = transformers.LlamaConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                      max_position_embeddings=128)
    transformers.LlamaForCausalLM(config).save_pretrained(hf, safe_serialization=True)
    model, run_tokenizer, source = load_generator(hf)
    message = [{"role": "user", "content": QUESTIONS[0]}]
    text, ids, new = reply(model, run_tokenizer, template_beside(source), message, 6, GREEDY, source=source)
    assert ids == _oracle(hf / "tokenizer.json", message)
    capsys.readouterr()
    assert main(["generate", str(hf), "--chat", "--prompt", QUESTIONS[0], "--temperature", "0",
                 "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == text + "\n"
