"""`tetrad generate --prompts FILE`: many prompts, decoded a batch at a time, each row's text the
one that prompt decoded alone gives (train/generate.py's `generate`), token for token.

A batch runs one forward a step against one KV cache, its prompts left-padded to the longest:
each row's tokens fill the cache's last columns, its positions start at 0 at its first real
token (RoPE, learned positions), and the pads' columns are hidden from its queries
(kv_cache.padded_visibility). Each row draws with its own CPU generator seeded with --seed, so a
prompt's text is what `--prompt` with that seed gives, whatever its batch-mates. A row that stops
(its EOS, --max-new-tokens, the model's context) leaves the batch: the cache keeps the other
rows alone (a copy of theirs), and the next forwards run without it. What padding costs: a
batch's prompt pass runs every row at the longest prompt's length, and each step attends over
the pads' columns too (hidden, still multiplied); prompts are batched by length (sorted, the
output in input order) to keep the pads few.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from tetrad.config import ConfigError, counted
from tetrad.data.chat import ChatTemplate, Conversations
from tetrad.model.kv_cache import LayerCache
from tetrad.model.llama import Transformer
from tetrad.model.sampling import Sampling
from tetrad.train.generate import ContextFull, chat_answer, chat_ids, prompt_ids
from tetrad.train.inference import agreed_tokens, full_logits


@dataclass(frozen=True)
class Prompt:
    """One prompt of the file: its line (from 1), the object its output extends (the JSONL
    line's, else {"prompt": the line}), the chat messages it renders (None: a plain prompt) and
    its token ids."""
    line: int
    record: dict
    messages: tuple[dict, ...] | None
    ids: tuple[int, ...]


def read_prompts(file: str) -> list[tuple[int, dict]]:
    """The prompts of `file` ("-": stdin), each line's number and object: JSONL where the first
    non-blank line is a JSON object (every line then one with a string "prompt"), else one prompt
    a line, the line as it is (without its newline). Blank lines are skipped, and a UTF-8 byte order
    mark (what some Windows tools write first) is no part of the text."""
    try:
        text = sys.stdin.read() if file == "-" else Path(file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"--prompts {file}: {e}; pass a UTF-8 text file, one prompt a line") from None
    text = text.removeprefix("\ufeff")
    lines = [(n, line.removesuffix("\r")) for n, line in enumerate(text.split("\n"), 1) if line.strip()]
    if not lines:
        raise ConfigError(f"--prompts {file} holds no prompt; write one prompt a line, or a JSON object with a "
                          "\"prompt\" a line")
    if _json_object(lines[0][1]) is None:
        return [(n, {"prompt": line}) for n, line in lines]
    records = [(n, _json_object(line)) for n, line in lines]
    for n, record in records:
        if record is None or not isinstance(record.get("prompt"), str):
            raise ConfigError(f"--prompts {file} line {n}: the first line is a JSON object, so every line must be "
                              "one with a string \"prompt\"; fix the line, or make the file plain text")
    return records


def _json_object(line: str) -> dict | None:
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def tokenized(file: str, tokenizer: Tokenizer, context: int, chat: ChatTemplate | None = None,
              system: str | None = None) -> tuple[Prompt, ...]:
    """The prompts of `file` with their ids (`complete`'s, or in a `chat` the turn that asks for
    an answer to the line, the user's message, after the `system` one), refused in one line,
    naming the line, where one fills the model's `context`."""
    conversations = Conversations(chat, tokenizer, None) if chat is not None else None
    prompts = []
    for n, record in read_prompts(file):
        messages = None
        try:
            if conversations is None:
                ids = prompt_ids(tokenizer, record["prompt"], context)
            else:
                messages = ([{"role": "system", "content": system}] if system is not None else []) + \
                           [{"role": "user", "content": record["prompt"]}]
                ids = chat_ids(conversations, messages, context)
        except ContextFull as e:
            raise ConfigError(f"--prompts {file} line {n}: {e}; shorten it or leave it out") from None
        prompts.append(Prompt(n, record, None if messages is None else tuple(messages), tuple(ids)))
    return tuple(prompts)


@torch.no_grad()
def generate_batch(model: Transformer, prompts: list[list[int]], max_new: int, sampling: Sampling = Sampling(),
                   seed: int = 0, stop: frozenset[int] = frozenset()) -> list[tuple[list[int], str]]:
    """Each prompt's new ids, as `generate` gives them for it alone, and why they end: "eos" (a
    `stop` token, kept), "length" (`max_new`) or "context" (the model's context_length tokens in
    all). One forward a step for the rows still running; under tp every rank feeds tp rank 0's
    tokens (inference.agreed_tokens)."""
    device, context = model.topo.device, model.cfg.context_length
    longest = max(map(len, prompts))
    ends = [min(len(p) + max_new, context + 1) for p in prompts]
    cache = {name: LayerCache(block.attn.window) for name, block in model.layers.items()}
    for layer in cache.values():  # the longest prompt, then the most new tokens a row may draw but its last
        layer.reserve(longest + max(end - len(p) for p, end in zip(prompts, ends)) - 1)
    generators = [torch.Generator().manual_seed(seed) for _ in prompts]
    news: list[list[int]] = [[] for _ in prompts]
    stops: list[str | None] = [None] * len(prompts)
    pads = torch.tensor([longest - len(p) for p in prompts], device=device)
    ids = [[0] * (longest - len(p)) + list(p) for p in prompts]  # a pad: any token, hidden
    positions = (torch.arange(longest, device=device) - pads[:, None]).clamp(min=0)
    live = list(range(len(prompts)))  # the rows still running, in the cache's order
    while True:
        logits = full_logits(model, model(torch.tensor(ids, device=device), positions, cache=cache, tail=1)[:, -1])
        drawn = [sampling.pick(logits[j], list(prompts[i]) + news[i], generators[i]) for j, i in enumerate(live)]
        for i, token in zip(live, agreed_tokens(drawn, model.topo)):
            news[i].append(token)
            if token in stop:
                stops[i] = "eos"
            elif len(prompts[i]) + len(news[i]) == ends[i]:
                stops[i] = "length" if len(news[i]) == max_new else "context"
        kept = [j for j, i in enumerate(live) if stops[i] is None]
        if not kept:
            return list(zip(news, stops))
        if len(kept) < len(live):
            rows = torch.tensor(kept, device=device)
            for layer in cache.values():
                layer.select(rows)
            live = [live[j] for j in kept]
        ids = [[news[i][-1]] for i in live]
        positions = torch.tensor([[len(prompts[i]) + len(news[i]) - 1] for i in live], device=device)


def decode_prompts(model: Transformer, tokenizer: Tokenizer, prompts: tuple[Prompt, ...], batch_size: int,
                   max_new: int, sampling: Sampling, seed: int, stop: frozenset[int], chat: ChatTemplate | None = None,
                   says_progress: bool = False) -> list[dict]:
    """Each prompt's output object, in input order: its record with "line", "completion" (the
    new text; in a `chat` the answer alone, as `--chat --prompt` prints it), "new_tokens" and
    "stop" (generate_batch's). Batches of `batch_size` prompts of like length, each said on stderr
    as it ends where `says_progress` (tp rank 0)."""
    conversations = Conversations(chat, tokenizer, None) if chat is not None else None
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids))
    outputs: list[dict] = [{}] * len(prompts)
    for start in range(0, len(order), batch_size):
        batch = order[start:start + batch_size]
        rows = generate_batch(model, [list(prompts[i].ids) for i in batch], max_new, sampling, seed, stop)
        for i, (new, why) in zip(batch, rows):
            prompt = prompts[i]
            text = tokenizer.decode(new, skip_special_tokens=False) if prompt.messages is None else \
                chat_answer(conversations, list(prompt.messages), new, stop)
            outputs[i] = {**prompt.record, "line": prompt.line, "completion": text, "new_tokens": len(new),
                          "stop": why}
        if says_progress:
            print(f"tetrad generate: {start + len(batch)} of {len(prompts)} prompts", file=sys.stderr, flush=True)
    return outputs


def write_outputs(outputs: list[dict], file: Path | None, where: str) -> None:
    """`outputs` one JSON object a line, to `file` or else stdout; then a line on stderr saying
    how many, and `where` they were decoded."""
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in outputs)
    if file is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        file.write_text(text, encoding="utf-8")
    tokens = sum(output["new_tokens"] for output in outputs)
    print(f"tetrad generate: {counted(len(outputs), 'prompt')}, {counted(tokens, 'new token')} ({where})",
          file=sys.stderr)
