"""Multi-turn chat data (`tetrad data --chat-key`): conversations rendered with the model's own
chat template, the loss counting what the assistant says and nothing else.

A record is a list of messages, {"role": ..., "content": ...} each (UltraChat's, OpenHermes's and
Tulu's "messages"). The template is Hugging Face's (tokenizer_config.json's "chat_template", a
Jinja2 text), rendered as transformers renders it, so that the ids are those of the model's own
`apply_chat_template` and a fine-tuned model sees its own format. Assistant turn i is what the
template adds to messages[:i] rendered with the generation prompt when message i is appended (the
prefix technique of SFT libraries): its content and the end-of-turn markup after it (Llama 3's
<|eot_id|>), not the assistant header the generation prompt renders, which the model is given at
inference. The text is tokenized whole, as apply_chat_template tokenizes it (cutting it into
pieces would change the ids of tokenizers that mark each text's start, such as SentencePiece's
"▁"), and a token counts when it holds characters of an assistant turn.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import jinja2
import numpy as np
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tetrad.config import ConfigError

MESSAGES = "list of {role, content} strings"
CONFIG = "tokenizer_config.json"  # Hugging Face's, beside tokenizer.json
JINJA = "chat_template.jinja"  # where newer Hugging Face models keep the template instead


def is_conversation(value) -> bool:
    """`value` is a list of messages, each with a string role and a string content."""
    return isinstance(value, list) and all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value)


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template's text and the strings it renders as bos_token and eos_token."""
    text: str
    bos: str = ""
    eos: str = ""


def _token(value) -> str:
    """A special token of tokenizer_config.json: a string, or an AddedToken's {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


def read_json_object(path: Path, what: str = "tokenizer_config.json") -> dict:
    """A Hugging Face side file (`what`: tokenizer_config.json, generation_config.json), refused
    with its path where it is not a readable JSON object."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} is not a readable {what} ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path} is not a {what} (a JSON object)")
    return config


def _configured_template(config: dict, path: Path) -> str | None:
    """tokenizer_config.json's "chat_template": a string, or a list of {name, template} (the "default")."""
    found = config.get("chat_template")
    if isinstance(found, list):
        named = {t.get("name"): t.get("template") for t in found if isinstance(t, dict)}
        if "default" not in named:
            raise ConfigError(f"{path} names chat templates {', '.join(map(str, named))} but no \"default\"; "
                              "pass the one to use as a .jinja file with --chat-template")
        found = named["default"]
    return found if isinstance(found, str) else None


def load_template(template: Path | None, tokenizer: Path) -> ChatTemplate:
    """The template of `template` (a tokenizer_config.json, or a raw Jinja file), else the one
    beside the tokenizer (its tokenizer_config.json's, else its chat_template.jinja); bos_token
    and eos_token come from the tokenizer_config.json. Compiled here, so that a broken template
    is refused before any work."""
    beside = tokenizer.with_name(CONFIG)
    config = read_json_object(beside) if beside.is_file() else {}
    if template is not None and template.suffix == ".json":
        config = read_json_object(template)
        text = _configured_template(config, template)
    elif template is not None:
        try:
            text = template.read_text()
        except OSError as e:
            raise ConfigError(f"--chat-template {template} cannot be read ({e.strerror})") from None
    else:
        text = _configured_template(config, beside)
        if text is None and tokenizer.with_name(JINJA).is_file():
            text = tokenizer.with_name(JINJA).read_text()
    if text is None:
        where = template if template is not None else f"{beside} (or {JINJA} beside {tokenizer})"
        raise ConfigError(f"no chat template in {where}; pass --chat-template with the model's {CONFIG} "
                          "or a .jinja file")
    chat = ChatTemplate(text, _token(config.get("bos_token")), _token(config.get("eos_token")))
    compile_template(chat)
    return chat


def save_template(chat: ChatTemplate, folder: Path) -> None:
    """Keep the template beside a shard folder's tokenizer.json, in a tokenizer_config.json of
    its own keys: a run on the folder then chats in its format (`tetrad generate --chat`), and
    the Hugging Face export carries it (train/convert.py)."""
    config = {"chat_template": chat.text, "bos_token": chat.bos, "eos_token": chat.eos}
    (folder / CONFIG).write_text(json.dumps(config, indent=1, ensure_ascii=False) + "\n")


def template_beside(tokenizer: Path) -> ChatTemplate | None:
    """The chat template kept beside a tokenizer.json (save_template's, or a Hugging Face
    model's), or None where there is none (a base model's tokenizer_config.json has no chat_template)."""
    config = tokenizer.with_name(CONFIG)
    if not (tokenizer.with_name(JINJA).is_file() or (config.is_file() and "chat_template" in read_json_object(config))):
        return None
    return load_template(None, tokenizer)


def _raise_exception(message: str):
    """The templates' way to refuse a conversation (e.g. roles that do not alternate)."""
    raise ConfigError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """transformers' tojson: plain JSON (Jinja's own escapes HTML characters)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(chat: ChatTemplate):
    """The template compiled in a sandbox as transformers compiles it (a template is code from the
    Hub); ValueError (one line) when it is not Jinja. No strftime_now: the shards do not depend on
    the day they are made (Llama 3.2's template then writes its own default date)."""
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    try:
        return environment.from_string(chat.text)
    except jinja2.TemplateError as e:
        raise ConfigError(f"the chat template is not valid Jinja: {str(e).splitlines()[0]}") from None


class Conversations:
    """Renders and tokenizes conversations (one per worker process: the template compiles once)."""

    def __init__(self, chat: ChatTemplate, tokenizer, eos: int | None):
        self.chat, self.tokenizer, self.eos = chat, tokenizer, eos
        self.template = compile_template(chat)

    def render(self, messages: list[dict], generation_prompt: bool, where: str) -> str:
        try:
            # tools and documents as transformers passes them without any: a template testing
            # `tools is not none` renders no tool block.
            return self.template.render(messages=messages, add_generation_prompt=generation_prompt,
                                        bos_token=self.chat.bos, eos_token=self.chat.eos, tools=None, documents=None)
        except (jinja2.TemplateError, ValueError, TypeError) as e:  # the template's own errors too
            raise ConfigError(f"{where}: the chat template refuses the conversation: "  # the user's to change
                              f"{(str(e).splitlines() or [type(e).__name__])[0]}") from None

    def turn_end(self, messages: list[dict], stops: list[str]) -> str:
        """What the template renders after an assistant's answer to `messages` (the end-of-turn
        markup: a newline in plain templates, Llama 2's " </s>"), up to the first of the `stops`
        (texts that end a sample, never in an answer: Llama 3's <|eot_id|>): the end of a sampled
        answer that is markup, not content."""
        answer = "tetrad-answer"  # no whitespace: a template that trims the content keeps it whole
        text = self.render(messages + [{"role": "assistant", "content": answer}], False, "the answer")
        after = text[text.rfind(answer) + len(answer):]
        return after[:min((after.find(stop) for stop in stops if stop in after), default=len(after))]

    def assistant_turns(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered conversation and where each assistant turn is in it, [start, end) in
        characters; ValueError when the template renders a turn differently once the
        conversation goes on (then no span of the whole text is that turn)."""
        text = self.render(messages, False, where)
        turns = []
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                prompt, answered = self.render(messages[:i], True, where), self.render(messages[:i + 1], False, where)
                if not (answered.startswith(prompt) and text.startswith(answered)):
                    raise ConfigError(f"{where}: the chat template is not incremental: the conversation up to message "
                                      f"{i} does not render as the start of the rest, so its assistant turns cannot be "
                                      "found in the text (does it drop earlier turns' reasoning?)")
                turns.append((len(prompt), len(answered)))
        return text, turns

    def encode(self, messages: list[dict], where: str) -> tuple[list[int], np.ndarray] | None:
        """The conversation's ids and loss mask (1 on each token that holds characters of an
        assistant turn), then EOS unless the text ends with it: counted when the conversation
        ends with the assistant's turn, as the end of its answer (--prompt-key's EOS counts too),
        not after a user's turn. None without an assistant turn: nothing to learn. ValueError when
        the EOS comes earlier: training would cut the conversation there (packing.py)."""
        text, turns = self.assistant_turns(messages, where)
        if not turns:
            return None
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        ids, offsets = encoding.ids, np.array(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), dtype=np.uint8)
        for start, end in turns:
            mask |= (offsets[:, 0] < end) & (offsets[:, 1] > start)
        if self.eos in ids[:-1]:
            raise ConfigError(f"{where}: the conversation holds the folder's EOS {self.tokenizer.id_to_token(self.eos)!r} "
                              "before its end (the template renders it inside, as Llama 2's after each answer); training "
                              "packs and masks examples at each EOS, so it would be cut there: pass another --eos")
        if not ids or ids[-1] != self.eos:
            ids, mask = ids + [self.eos], np.append(mask, np.uint8(turns[-1][1] == len(text)))
        return ids, mask
