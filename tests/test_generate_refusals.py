"""`tetrad generate`'s refusals: the user's errors during generation (a prompt longer than the
context, a message the chat template refuses, stdin that is not UTF-8) are one line and exit 2;
a ValueError from anywhere else in generation is a bug, and keeps its traceback, on one process
and on any rank of --tp 2 (which then ends every rank, not hangs)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest

from test_generate_placement import _write_hf
from tetrad.cli import main

pytestmark = pytest.mark.dist

# The plain template, refusing one message as a Hub template refuses roles that do not alternate.
REFUSING = ("{% for m in messages %}{% if m.content == 'refuse me' %}{{ raise_exception('no such message') }}"
            "{% endif %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant: "
            "{% endif %}")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    """A tiny Llama folder (context 256 tokens) whose chat template refuses the message 'refuse me'."""
    folder = tmp_path_factory.mktemp("refusals") / "hf"
    _write_hf(folder)
    config = folder / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "chat_template": REFUSING}))
    return folder


def _bug(*args, **kwargs):
    raise ValueError("an internal bug")


@pytest.mark.parametrize("flags, line", [
    (["--prompt", "the " * 300], "the prompt is "),
    (["--chat", "--prompt", "the " * 300], "the rendered conversation is "),
    (["--chat", "--prompt", "refuse me"], "message 1: the chat template refuses the conversation: no such message"),
    (["--chat"], "stdin is not utf-8 text (byte 0xff: invalid start byte); convert the input to utf-8 first, e.g. "
                 "`iconv -f latin1 -t utf-8 FILE | tetrad generate ...`")])
def test_a_users_error_during_generation_is_one_line(hf, monkeypatch, capsys, flags, line):
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"\xff\n"), encoding="utf-8"))
    assert main(["generate", str(hf), "--max-new-tokens", "2", *flags]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"tetrad generate: {line}") and err.count("\n") == 1, err


@pytest.mark.parametrize("flags", [["--prompt", "the"], ["--chat", "--prompt", "hi"], ["--chat"]])
def test_a_valueerror_inside_generation_is_a_bug_not_a_refusal(hf, monkeypatch, flags):
    """Before: every ValueError on the way was turned into the one-line refusal, exit 2."""
    monkeypatch.setattr("tetrad.train.generate.full_logits", _bug)  # the decoding's every step
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    with pytest.raises(ValueError, match="an internal bug"):
        main(["generate", str(hf), "--max-new-tokens", "2", *flags])


def test_a_bug_on_one_tp_rank_ends_every_rank_with_its_traceback(hf, tmp_path):
    """Rank 1 raises a ValueError (a bug) while rank 0 waits in a collective, as NCCL's would:
    every rank ends at once, and the command exits 1 with rank 1's traceback (before: exit 2 and
    the bug's message as the user's refusal)."""
    script = ("import datetime, os, sys, torch.distributed as dist, tetrad.sample as sample\n"
              "def buggy(*args, **kwargs):\n"
              "    if os.environ['RANK'] == '1':\n"
              "        raise ValueError('an internal bug on rank 1')\n"
              f"    dist.FileStore({str(tmp_path / 'never')!r}, 1).wait(['never'], datetime.timedelta(seconds=600))\n"
              "sample.complete = buggy\n"
              "from tetrad.cli import main\n"
              "sys.exit(main(sys.argv[1:]))\n")
    argv = ["generate", str(hf), "--prompt", "the", "--tp", "2"]
    try:
        out = subprocess.run([sys.executable, "-c", script, *argv], capture_output=True, text=True, timeout=60,
                             env={**os.environ, "TMPDIR": str(tmp_path)})
    except subprocess.TimeoutExpired:
        pytest.fail("rank 0 still waited in its collective 60 s after rank 1 raised")
    assert out.returncode == 1 and out.stdout == "", out.stderr
    assert out.stderr.startswith("tetrad: rank 1 failed:\nTraceback") and \
        "ValueError: an internal bug on rank 1" in out.stderr, out.stderr


def _spoiled(hf, tmp_path, name: str, text: str):
    """A copy of the HF folder whose file `name` holds `text` (a user's broken file)."""
    import shutil
    folder = tmp_path / "spoiled"
    shutil.copytree(hf, folder)
    (folder / name).write_text(text)
    return folder


@pytest.mark.parametrize("name, text, flags, line", [
    ("config.json", "{not json", [], "is not a readable config.json"),
    ("tokenizer.json", "{}", [], "is not a tokenizer.json that HF tokenizers reads"),
    ("generation_config.json", '{"do_sample": true, "temperature": "hot"}', [], "holds a sampling setting"),
    ("generation_config.json", "[1]", [], "is not a generation_config.json"),
    ("tokenizer_config.json", "{not json", ["--chat"], "is not a readable tokenizer_config.json"),
    ("tokenizer_config.json", '{"chat_template": "{% if %}"}', ["--chat"], "the chat template is not valid Jinja"),
    ("config.json", "{}", ["--prompt", "\udcff"], "--prompt holds bytes that are not UTF-8")])
def test_a_users_broken_file_or_flag_before_generation_is_one_line(hf, tmp_path, capsys, name, text, flags, line):
    """The checks before any rank starts raise ConfigError themselves (generate_command no longer
    turns every ValueError into a refusal): each user mistake is still one line and exit 2."""
    folder = hf if "--prompt" in flags else _spoiled(hf, tmp_path, name, text)
    assert main(["generate", str(folder), "--max-new-tokens", "2", *(flags or ["--prompt", "hi"])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("tetrad generate: ") and line in err and err.count("\n") == 1, err


def test_a_valueerror_from_a_bug_in_the_checks_keeps_its_traceback(hf, monkeypatch):
    """Before: generate_command turned every ValueError of the checks (_job) into a refusal."""
    monkeypatch.setattr("tetrad.sample.model_sampling", _bug)
    with pytest.raises(ValueError, match="an internal bug"):
        main(["generate", str(hf), "--max-new-tokens", "2", "--prompt", "hi"])
