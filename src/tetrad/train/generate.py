"""`tetrad generate CHECKPOINT --prompt ...`: sample text from a checkpoint on one process.

The checkpoint (any layout), or a Hugging Face model folder (the base a fine-tune starts from), is
read as logical weights into a single-process model; decoding
runs the prompt once and then one token per step against a KV cache (llama.LayerCache, which keeps
every token; a model.sliding_window masks the keys a new token no longer sees), and
texts go through the run's tokenizer (data/tokenizer.py: bytes for a run on raw text). The
continuation's loss is computed by the model's training forward (summed token cross-entropy /
tokens), the number a training step reports for the same tokens. With --chat the model answers
as the assistant in the run's chat template: one message, or a conversation read from stdin whose
turns each render the whole history and reuse the last turn's KV cache where it starts the same.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path
from typing import TextIO

import torch
from tokenizers import Tokenizer

from tetrad.config import ModelConfig, counted, load_config
from tetrad.data.chat import ChatTemplate, Conversations, template_beside
from tetrad.data.shards import TOKENIZER
from tetrad.data.tokenizer import (GENERATION_CONFIG, document_prefix, load_tokenizer, model_eos, model_sampling,
                                   run_eos)
from tetrad.model.llama import LayerCache, Transformer
from tetrad.model.sampling import SAMPLING_FIELDS, Sampling
from tetrad.dist.topology import Topology
from tetrad.train.checkpoint import CheckpointError
from tetrad.train.convert import checkpoint_folder, exported_tokenizer, logical_shapes, read_weights
from tetrad.train.hf_architectures import model_config_from_hf
from tetrad.train.init_from import HF_CONFIG, hf_config, hf_weights_problem, initial_weights, is_hf_folder


def single_process_model(model_cfg: ModelConfig, state: dict[str, torch.Tensor]) -> Transformer:
    model = Transformer(model_cfg, Topology.single("cpu"))
    model.load_state_dict(state)
    return model.eval()


class Cache:
    """The model's KV cache (llama.LayerCache by layer name) and the ids it holds, kept from one
    chat turn to the next: a turn's prompt starts with the last one's prompt and answer (the
    templates tetrad chats in are incremental: data/chat.py), so only what it adds is run."""

    def __init__(self):
        self.layers: dict[str, LayerCache] = {}
        self.ids: list[int] = []
        self.prompted = self.reused = 0  # prompt tokens in all, and those found in the cache

    def reuse(self, prompt: list[int]) -> int:
        """Keep the keys and values of the longest common start of the cached ids and `prompt`
        (not the prompt's last token, whose logits are wanted), forget the rest; how many are
        kept. The start is shorter than the cached ids where the re-rendered answer tokenizes
        differently (a BPE merge across its end, a template that trims it): those are recomputed."""
        kept = 0
        while kept < min(len(self.ids), len(prompt) - 1) and self.ids[kept] == prompt[kept]:
            kept += 1
        for layer in self.layers.values():
            layer.keep(kept)
        self.ids = self.ids[:kept]
        self.prompted, self.reused = self.prompted + len(prompt), self.reused + kept
        return kept

    def feed(self, model: Transformer, ids: list[int]) -> torch.Tensor:
        """Run `ids` after the cached ones, which they join; the logits after the last."""
        start = len(self.ids)
        logits = model(torch.tensor([ids]), torch.arange(start, start + len(ids)), cache=self.layers)[0, -1]
        self.ids = self.ids + list(ids)
        return logits


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], max_new: int, sampling: Sampling = Sampling(), seed: int = 0,
             stop: frozenset[int] = frozenset(), cache: Cache | None = None) -> tuple[list[int], list[torch.Tensor]]:
    """The new token ids (at most `max_new`, ending at a `stop` token, e.g. EOS, or at the model's
    context_length tokens in all) and the logits each was drawn from. `cache`: an earlier call's (a chat's last
    turn), reused where `prompt` starts as its ids do; it ends holding the prompt and the new ids
    but the last (never run)."""
    generator = torch.Generator().manual_seed(seed)
    cache = Cache() if cache is None else cache
    logits = cache.feed(model, prompt[cache.reuse(prompt):])
    new, drawn_from = [], []
    end = min(len(prompt) + max_new, model.cfg.context_length + 1)
    for position in range(len(prompt), end):
        token = sampling.pick(logits, prompt + new, generator)
        new.append(token)
        drawn_from.append(logits)
        if token in stop or position + 1 == end:
            break
        logits = cache.feed(model, [token])
    return new, drawn_from


@torch.no_grad()
def continuation_loss(model: Transformer, prompt: list[int], continuation: list[int]) -> float:
    """Mean cross-entropy of `continuation` after `prompt`, by the training loss (summed token
    losses over the labels): the whole sequence's sum minus the prompt's own."""
    ids = torch.tensor([prompt + continuation])

    def summed(n: int) -> float:
        return float(model(ids[:, :n - 1], torch.arange(n - 1), labels=ids[:, 1:n]))
    return (summed(ids.shape[1]) - (summed(len(prompt)) if len(prompt) > 1 else 0.0)) / len(continuation)


def _arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tetrad generate", description="Sample text from a checkpoint, on one "
                                     "process, with a KV cache and the run's tokenizer.")
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder, a checkpoint dir with `latest`, a run dir, "
                        "or a Hugging Face model folder (config.json, *.safetensors, tokenizer.json)")
    parser.add_argument("--prompt", metavar="TEXT", help="text to continue (default: nothing but the first token); with --chat, "
                        "the user's one message")
    parser.add_argument("--chat", action="store_true", help="answer as the assistant, in the chat template the run's "
                        "data was rendered with (tetrad data --chat-key), printing the answers alone: to --prompt, or "
                        "without it to each line of stdin in turn, keeping the conversation, until an empty line, "
                        "the input's end or the model's context (model.max_position_embeddings, else seq_len)")
    parser.add_argument("--system", metavar="TEXT", help="with --chat, a system message first in the conversation")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="at most this many tokens (default 200; "
                        "fewer at an EOS or the end of the model's context)")
    # Unset sampling flags take an imported model's generation_config.json (model_sampling), else Sampling's defaults.
    parser.add_argument("--temperature", type=float, help="0: greedy (default 0.8)")
    parser.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (default 0: all)")
    parser.add_argument("--top-p", type=float, help="nucleus: the likeliest tokens of this mass (default 1)")
    parser.add_argument("--min-p", type=float, help="only tokens at least this fraction as likely as the likeliest "
                        "(default 0)")
    parser.add_argument("--repetition-penalty", type=float, help="divide the logits of tokens already in the text by "
                        "this, as transformers does (default 1: none; applies to greedy decoding too)")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's random seed (default 0): the same "
                        "seed, settings and prompt give the same text")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1:
        raise ValueError("need --max-new-tokens >= 1")
    Sampling(**_sampling_flags(args))
    if args.system is not None and not args.chat:
        raise ValueError("--system is a chat's system message: pass --chat too")
    if not args.checkpoint.exists():
        raise ValueError(f"no checkpoint at {args.checkpoint}; pass a run folder, its checkpoints/ folder, or one "
                         "of its step_N folders, or a Hugging Face model folder")
    return args


def _sampling_flags(args: argparse.Namespace | None) -> dict:
    return {} if args is None else {name: getattr(args, name) for name in SAMPLING_FIELDS
                                    if getattr(args, name) is not None}


def sampling_settings(args: argparse.Namespace | None, model: dict) -> Sampling:
    """Each sampling flag given (`args`: generate's; None for none, as `tetrad report` samples),
    else what an imported model's generation_config.json asks transformers' generate for (`model`,
    model_sampling's: Llama 3.1's temperature 0.6 and top_p 0.9, Qwen2.5 Instruct's repetition
    penalty 1.05, greedy where do_sample is false), else Sampling's defaults."""
    try:
        Sampling(**model)
    except ValueError:
        raise ValueError(f"the model's {GENERATION_CONFIG} asks for sampling out of range ({model}); pass "
                         "--temperature, --top-k, --top-p, --min-p and --repetition-penalty") from None
    return Sampling(**{**model, **_sampling_flags(args)})


def run_sampling(source: Path | None) -> Sampling:
    """How `tetrad generate` samples the model whose tokenizer came from `source` where no flag
    is given (`tetrad report`'s samples): its generation_config.json's settings, else the defaults."""
    return sampling_settings(None, model_sampling(source))


def load_generator(checkpoint: Path) -> tuple[Transformer, Tokenizer, Path | None]:
    """The single-process model of a tetrad checkpoint (any layout) or of a Hugging Face model
    folder (an architecture train/hf_architectures.py maps: the model a fine-tune starts from,
    sampled without converting it), the run's or the model's tokenizer, and where that came from
    (None: bytes)."""
    if is_hf_folder(checkpoint):
        model_cfg = load_config(overrides={"model": model_config_from_hf(hf_config(checkpoint), checkpoint / HF_CONFIG)},
                                runtime=False).model
        problem = hf_weights_problem(checkpoint, model_cfg)
        if problem:
            raise ValueError(f"{checkpoint}: {problem}")
        read = initial_weights(str(checkpoint))
        state = {name: read(name) for name in logical_shapes(model_cfg)}
        tokenizer, source = (load_tokenizer(checkpoint / TOKENIZER), checkpoint / TOKENIZER) \
            if (checkpoint / TOKENIZER).is_file() else (None, None)
    else:
        cfg, state = read_weights(checkpoint)
        model_cfg, checkpoint = cfg.model, checkpoint_folder(checkpoint)
        tokenizer, source = exported_tokenizer(checkpoint, cfg.data.source)
    if tokenizer is None:
        raise ValueError(f"{checkpoint} holds weights without a tokenizer.json, so no tokenizer is known for its "
                         f"{model_cfg.vocab_size} tokens; copy the model's tokenizer.json into {checkpoint}")
    return single_process_model(model_cfg, state), tokenizer, source


def complete(model: Transformer, tokenizer: Tokenizer, prompt: str, max_new: int, sampling: Sampling = Sampling(),
             seed: int = 0, source: Path | None = None) -> tuple[str, list[int], list[int]]:
    """`prompt` and its sampled continuation as text (what `tetrad generate` prints), with the
    prompt's and the continuation's token ids, the tokenizer's document prefix (data/tokenizer.py)
    first. An empty prompt starts from that prefix, or from a newline when there is none.
    `source`: where the tokenizer came from (load_generator), which may record the EOS (_stops)."""
    prefix = document_prefix(tokenizer)
    ids = prefix + tokenizer.encode(prompt or ("" if prefix else "\n"), add_special_tokens=False).ids
    if len(ids) >= model.cfg.context_length:
        raise ValueError(f"the prompt is {len(ids)} tokens; the model reads at most {model.cfg.context_length} tokens, "
                         "so use a shorter one")
    new, _ = generate(model, ids, max_new, sampling, seed, _stops(tokenizer, None, source))
    return prompt + tokenizer.decode(new, skip_special_tokens=False), ids, new


def _stops(tokenizer: Tokenizer, chat: ChatTemplate | None = None, source: Path | None = None) -> frozenset[int]:
    """The tokens that end a sample: the run's EOS (run_eos: the one its data recorded beside the
    tokenizer's `source`; none for bytes: generation runs to max_new tokens), an imported model's
    own (model_eos, as transformers' generate stops: all of Llama 3.1 Instruct's), and in a chat the
    template's eos_token (Llama 3's <|eot_id|> ends the assistant's turn)."""
    eos = run_eos(tokenizer, source)
    stops = ({eos} if eos is not None else set()) | set(model_eos(source))
    turn_end = tokenizer.token_to_id(chat.eos) if chat is not None and chat.eos else None
    return frozenset(stops | ({turn_end} if turn_end is not None else set()))


class ContextFull(ValueError):
    """A chat's rendered conversation reaches the end of the model's context: a conversation ends there."""


def reply(model: Transformer, tokenizer: Tokenizer, chat: ChatTemplate, messages: list[dict], max_new: int,
          sampling: Sampling = Sampling(), seed: int = 0, cache: Cache | None = None, source: Path | None = None) -> tuple[str, list[int], list[int]]:
    """The assistant's sampled answer to `messages` (a conversation ending with the user's turn),
    rendered with the run's chat template (the format its data was: data/chat.py) and its
    generation prompt, without the template's end-of-turn markup the sample ends with (a plain
    template's newline: the answer is its content, and a chat prints one newline after it); with
    the prompt's and the answer's ids, as `complete` gives them. `cache`: the conversation's last
    turn's (generate); `source`: as `complete`'s."""
    conversations = Conversations(chat, tokenizer, None)
    text = conversations.render(messages, True, f"message {len(messages)}")
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if len(ids) >= model.cfg.context_length:
        raise ContextFull(f"the rendered conversation is {len(ids)} tokens and the model reads at most "
                          f"{model.cfg.context_length} tokens")
    stops = _stops(tokenizer, chat, source)
    new, _ = generate(model, ids, max_new, sampling, seed, stops, cache)
    answer = tokenizer.decode([t for t in new if t not in stops], skip_special_tokens=False)
    markup = conversations.turn_end(messages, [tokenizer.id_to_token(t) for t in stops])
    return answer.removesuffix(markup), ids, new


class Dialogue:
    """A chat with the model: the conversation so far and the KV cache of its last turn."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, chat: ChatTemplate, system: str | None = None,
                 source: Path | None = None):
        self.model, self.tokenizer, self.chat, self.cache, self.source = model, tokenizer, chat, Cache(), source
        self.messages = [] if system is None else [{"role": "system", "content": system}]
        if system is not None:  # a template without the role (Gemma's) refuses it before any turn
            Conversations(chat, tokenizer, None).render(self.messages + [{"role": "user", "content": "Hi"}], True,
                                                        "--system")

    def answer(self, message: str, max_new: int, sampling: Sampling = Sampling(),
               seed: int = 0) -> tuple[str, list[int], list[int]]:
        """`reply` to the user's next `message`; both join the conversation."""
        asked = self.messages + [{"role": "user", "content": message}]
        text, ids, new = reply(self.model, self.tokenizer, self.chat, asked, max_new, sampling, seed, self.cache,
                               self.source)
        self.messages = asked + [{"role": "assistant", "content": text}]
        return text, ids, new


def converse(dialogue: Dialogue, max_new: int, sampling: Sampling, seed: int, lines: TextIO) -> int:
    """Answer each line of `lines` as the user's next message, printing the answers, until an
    empty line, the input's end or the end of the model's context (said in a line); the number of turns. The
    prompt marker is for a terminal: piped, the output is the answers alone."""
    context = dialogue.model.cfg.context_length
    for turn in itertools.count():
        if lines.isatty():
            print("> ", end="", flush=True)
        line = lines.readline()
        if not line.strip():
            return turn
        try:
            text, ids, new = dialogue.answer(line.rstrip("\r\n"), max_new, sampling, seed + turn)
        except ContextFull as e:
            print(f"tetrad generate: {e}: the conversation ends here", file=sys.stderr)
            return turn
        print(text, flush=True)
        if len(ids) + len(new) > context:
            print(f"tetrad generate: the answer reached the end of the model's context ({context} tokens): the "
                  "conversation ends here", file=sys.stderr)
            return turn + 1


def _run_template(tokenizer_source: Path | None) -> ChatTemplate:
    """The chat template beside the run's tokenizer.json; ValueError naming what to do without one."""
    chat = template_beside(tokenizer_source) if tokenizer_source is not None else None
    if chat is None:
        raise ValueError(f"--chat needs the chat template the run's data was rendered with, and none is beside its "
                         f"tokenizer ({tokenizer_source or 'bytes'}); make the data with `tetrad data --chat-key`")
    return chat


def _dialogue(model: Transformer, tokenizer: Tokenizer, source: Path | None, system: str | None) -> Dialogue:
    """A chat in the run's template, noting where the answers cannot end at its eos_token."""
    chat = _run_template(source)
    if chat.eos and tokenizer.token_to_id(chat.eos) is None:
        print(f"tetrad generate: note: the template's eos_token {chat.eos!r} is not one token of the "
              "tokenizer; the answer runs to the EOS or --max-new-tokens", file=sys.stderr)
    return Dialogue(model, tokenizer, chat, system, source)


def generate_command(argv: list[str]) -> int:
    try:
        args = _arguments(argv)
        model, tokenizer, source = load_generator(args.checkpoint)
        asked = model_sampling(source)
        sampling = sampling_settings(args, asked)
        if asked:
            print(f"tetrad generate: {sampling.describe()}: the model's generation_config.json where no flag says "
                  "otherwise", file=sys.stderr)
        if args.chat:
            dialogue = _dialogue(model, tokenizer, source, args.system)
            if args.prompt is None:
                turns = converse(dialogue, args.max_new_tokens, sampling, args.seed, sys.stdin)
                print(f"tetrad generate: answered {counted(turns, 'message')}; the KV cache held "
                      f"{dialogue.cache.reused} of their {dialogue.cache.prompted} prompt tokens", file=sys.stderr)
                return 0
            text, prompt, new = dialogue.answer(args.prompt, args.max_new_tokens, sampling, args.seed)
        else:
            text, prompt, new = complete(model, tokenizer, args.prompt or "", args.max_new_tokens, sampling, args.seed, source)
    except (ValueError, CheckpointError) as e:
        print(f"tetrad generate: {e}", file=sys.stderr)
        return 2
    print(text)
    capped = (f"; the model's context ({model.cfg.context_length} tokens) ended it before --max-new-tokens"
              if len(prompt) + len(new) > model.cfg.context_length and len(new) < args.max_new_tokens else "")
    print(f"tetrad generate: {counted(len(new), 'token')}; their loss under the model "
          f"{continuation_loss(model, prompt, new):.4f} "
          f"(tokenizer: {source or 'bytes'}){capped}", file=sys.stderr)
    return 0
