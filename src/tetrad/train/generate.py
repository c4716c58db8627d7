"""`tetrad generate`'s decoding (the command, and where it runs: tetrad/sample.py).

The checkpoint (any layout), or a Hugging Face model folder (the base a fine-tune starts from),
is found and checked (`found_weights`) before any weight is read, then read one logical tensor at
a time into a model on a device in a dtype, whole or a tensor-parallel rank's shard
(train/inference.py). Decoding runs the prompt once and then one token per step against a KV
cache (kv_cache.LayerCache: buffers allocated once for the prompt and the new tokens, written in
place; a sliding-window layer's holding two windows at most, a global layer's every token; under
tp each rank holds its heads'), on the model's device, and texts go through the run's tokenizer
(data/tokenizer.py: bytes for a run on raw text). The prompt's pass computes the logits of its
last position alone, the one sampled from. The continuation's loss is computed by the model's
training forward (summed token cross-entropy / tokens, the head run on the continuation's
positions alone), the number a training step reports for the same tokens. With --chat the model answers
as the assistant in the run's chat template: one message, or a conversation read from stdin whose
turns each render the whole history and reuse the last turn's KV cache where it starts the same.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import torch
from tokenizers import Tokenizer

from tetrad.config import ConfigError, ModelConfig, load_config
from tetrad.data.chat import ChatTemplate, Conversations, template_beside
from tetrad.data.shards import TOKENIZER
from tetrad.data.tokenizer import (GENERATION_CONFIG, document_prefix, load_tokenizer, model_eos, model_sampling,
                                   run_eos)
from tetrad.model.kv_cache import LayerCache
from tetrad.model.llama import Transformer
from tetrad.model.sampling import SAMPLING_FIELDS, Sampling
from tetrad.dist.topology import Topology
from tetrad.train.convert import StoredWeights, exported_tokenizer, logical_shapes
from tetrad.train.hf_architectures import model_config_from_hf
from tetrad.train.inference import agreed_line, agreed_token, full_logits, inference_model
from tetrad.train.init_from import (HF_CONFIG, CheckpointPart, SafetensorsPart, hf_config, hf_weights_problem,
                                    is_hf_folder, stored_expert_biases, stored_weights)


def single_process_model(model_cfg: ModelConfig, weights: Mapping[str, torch.Tensor] | Callable[[str], torch.Tensor],
                         device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
                         biases: dict[str, torch.Tensor] | None = None) -> Transformer:
    """The whole model on one `device` in `dtype`, from a state dict of every logical parameter (no
    more) or a reader of one at a time (stored_weights': `tetrad generate`), and its MoE layers'
    expert biases (inference_model's `biases`)."""
    if isinstance(weights, Mapping):
        extra = sorted(set(weights) - set(logical_shapes(model_cfg)))
        if extra:
            raise ValueError(f"the state holds {extra[0]}, which the model has no parameter for")
        weights = weights.__getitem__
    return inference_model(model_cfg, weights, Topology.single(device), dtype, biases)


class Cache:
    """The model's KV cache (kv_cache.LayerCache by layer name) and the ids it holds, kept from one
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
        if not all(layer.can_keep(kept) for layer in self.layers.values()):
            kept = 0  # a window's layer forgot keys the next token sees: the conversation runs again
        for layer in self.layers.values():
            layer.keep(kept)
        self.ids = self.ids[:kept]
        self.prompted, self.reused = self.prompted + len(prompt), self.reused + kept
        return kept

    def reserve(self, model: Transformer, tokens: int) -> None:
        """Allocate each layer's keys and values for `tokens` in all (a generation's prompt and new
        tokens) at its next step, rather than as the cache grows (kv_cache.LayerCache)."""
        for name, block in model.layers.items():
            self.layers.setdefault(name, LayerCache(block.attn.window)).reserve(tokens)

    def feed(self, model: Transformer, ids: list[int]) -> torch.Tensor:
        """Run `ids` after the cached ones, which they join; the logits after the last (the head
        runs on that position alone)."""
        start, device = len(self.ids), model.topo.device
        logits = model(torch.tensor([ids], device=device), torch.arange(start, start + len(ids), device=device),
                       cache=self.layers, tail=1)[0, -1]
        self.ids = self.ids + list(ids)
        return full_logits(model, logits)


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], max_new: int, sampling: Sampling = Sampling(), seed: int = 0,
             stop: frozenset[int] = frozenset(), cache: Cache | None = None,
             keep_logits: bool = False) -> tuple[list[int], list[torch.Tensor]]:
    """The new token ids (at most `max_new`, ending at a `stop` token, e.g. EOS, or at the model's
    context_length tokens in all) and, with `keep_logits`, the logits each was drawn from (the whole
    vocabulary's, fp32, on the model's device: 4 GiB for 8k tokens of a 128k vocabulary, so kept
    only where asked; else []). `cache`: an earlier call's (a chat's last
    turn), reused where `prompt` starts as its ids do; it ends holding the prompt and the new ids
    but the last (never run). The draws use a CPU generator seeded with `seed` (Sampling.pick), so a
    seed gives the same text on a device wherever the logits are the same; under tp every rank
    feeds tp rank 0's token (inference.agreed_token)."""
    generator = torch.Generator().manual_seed(seed)
    cache = Cache() if cache is None else cache
    end = min(len(prompt) + max_new, model.cfg.context_length + 1)
    kept = cache.reuse(prompt)
    cache.reserve(model, end - 1)  # the last token drawn is never run
    logits = cache.feed(model, prompt[kept:])
    new, drawn_from = [], []
    for position in range(len(prompt), end):
        token = agreed_token(sampling.pick(logits, prompt + new, generator), model.topo)
        new.append(token)
        if keep_logits:
            drawn_from.append(logits)
        if token in stop or position + 1 == end:
            break
        logits = cache.feed(model, [token])
    return new, drawn_from


@torch.no_grad()
def continuation_loss(model: Transformer, prompt: list[int], continuation: list[int]) -> float:
    """Mean cross-entropy of `continuation` (at least one token) after `prompt` (as many), by the
    training loss (summed token losses over the labels), the head run on the positions that predict
    the continuation alone. Computed on the model's device (fp32 cross-entropy of its logits), the
    same on every tp rank."""
    device, n = model.topo.device, len(prompt) + len(continuation)
    ids = torch.tensor([prompt + continuation], device=device)
    summed = model(ids[:, :-1], torch.arange(n - 1, device=device), labels=ids[:, len(prompt):], tail=len(continuation))
    return float(summed) / len(continuation)


def sampling_flags(args: argparse.Namespace | None) -> dict:
    """The sampling flags given (`args`: generate's), by Sampling's field names."""
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
        raise ConfigError(f"the model's {GENERATION_CONFIG} asks for sampling out of range ({model}); pass "
                          "--temperature, --top-k, --top-p, --min-p and --repetition-penalty") from None
    return Sampling(**{**model, **sampling_flags(args)})


def run_sampling(source: Path | None) -> Sampling:
    """How `tetrad generate` samples the model whose tokenizer came from `source` where no flag
    is given (`tetrad report`'s samples): its generation_config.json's settings, else the defaults."""
    return sampling_settings(None, model_sampling(source))


@dataclass(frozen=True)
class Weights:
    """What `tetrad generate` samples, found and checked before any weight is read (so before any
    rank starts): the checkpoint or HF folder, its model, the run's or the model's tokenizer and
    where that came from (None: bytes)."""
    path: Path
    model: ModelConfig
    tokenizer: Tokenizer
    source: Path | None

    def reader(self) -> Callable[[str], SafetensorsPart | CheckpointPart]:
        """name -> a handle to its logical tensor, read when asked by the part a rank keeps."""
        return stored_weights(self.path)

    def biases(self) -> dict[str, torch.Tensor]:
        """Its MoE layers' expert biases (a checkpoint's; none for an HF folder), which route its tokens."""
        return stored_expert_biases(self.path)


def found_weights(checkpoint: Path) -> Weights:
    """The Weights of a tetrad checkpoint (any layout; its files' checksums and shapes checked) or
    of a Hugging Face model folder (an architecture train/hf_architectures.py maps: the model a
    fine-tune starts from, sampled without converting it)."""
    if is_hf_folder(checkpoint):
        hf = hf_config(checkpoint)
        try:  # hf_architectures' refusals are still ValueErrors (being converted elsewhere): the user's config.json
            # as a run's below: the Hub's DeepSeek-V3's and GLM-4.5's depths (or none where config.json
            # names them and transformers saved none) go unread
            hf_model = {**model_config_from_hf(hf, checkpoint / HF_CONFIG), "mtp_layers": 0}
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(str(e)) from None
        model_cfg = load_config(overrides={"model": hf_model}, runtime=False).model
        problem = hf_weights_problem(checkpoint, model_cfg)
        if problem:
            raise ConfigError(f"{checkpoint}: {problem}")
        tokenizer, source = (load_tokenizer(checkpoint / TOKENIZER), checkpoint / TOKENIZER) \
            if (checkpoint / TOKENIZER).is_file() else (None, None)
    else:
        stored = StoredWeights(checkpoint)
        # generation computes no multi-token-prediction depth: its weights (a run's mtp.*) go unread
        model_cfg, checkpoint = dataclasses.replace(stored.cfg.model, mtp_layers=0), stored.path
        tokenizer, source = exported_tokenizer(checkpoint, stored.cfg.data.source)
    if tokenizer is None:
        raise ConfigError(f"{checkpoint} holds weights without a tokenizer.json, so no tokenizer is known for its "
                          f"{model_cfg.vocab_size} tokens; copy the model's tokenizer.json into {checkpoint}")
    return Weights(checkpoint, model_cfg, tokenizer, source)


def load_generator(checkpoint: Path, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32) -> tuple[Transformer, Tokenizer, Path | None]:
    """The whole model of `checkpoint` (found_weights') on `device` in `dtype`, its tokenizer, and
    where that came from (None: bytes)."""
    found = found_weights(checkpoint)
    model = single_process_model(found.model, found.reader(), device, dtype, found.biases())
    return model, found.tokenizer, found.source


def complete(model: Transformer, tokenizer: Tokenizer, prompt: str, max_new: int, sampling: Sampling = Sampling(),
             seed: int = 0, source: Path | None = None) -> tuple[str, list[int], list[int]]:
    """`prompt` and its sampled continuation as text (what `tetrad generate` prints), with the
    prompt's and the continuation's token ids, the tokenizer's document prefix (data/tokenizer.py)
    first. An empty prompt starts from that prefix, or from a newline when there is none.
    `source`: where the tokenizer came from (load_generator), which may record the EOS (stop_tokens)."""
    ids = prompt_ids(tokenizer, prompt, model.cfg.context_length)
    new, _ = generate(model, ids, max_new, sampling, seed, stop_tokens(tokenizer, None, source))
    return prompt + tokenizer.decode(new, skip_special_tokens=False), ids, new


def prompt_ids(tokenizer: Tokenizer, prompt: str, context: int) -> list[int]:
    """`complete`'s ids of `prompt`, refused (ContextFull) where they fill the model's `context`."""
    prefix = document_prefix(tokenizer)
    ids = prefix + tokenizer.encode(prompt or ("" if prefix else "\n"), add_special_tokens=False).ids
    if len(ids) >= context:
        raise ContextFull(f"the prompt is {len(ids)} tokens; the model reads at most {context} tokens, so use a "
                          "shorter one")
    return ids


def stop_tokens(tokenizer: Tokenizer, chat: ChatTemplate | None = None, source: Path | None = None) -> frozenset[int]:
    """The tokens that end a sample: the run's EOS (run_eos: the one its data recorded beside the
    tokenizer's `source`; none for bytes: generation runs to max_new tokens), an imported model's
    own (model_eos, as transformers' generate stops: all of Llama 3.1 Instruct's), and in a chat the
    template's eos_token (Llama 3's <|eot_id|> ends the assistant's turn)."""
    eos = run_eos(tokenizer, source)
    stops = ({eos} if eos is not None else set()) | set(model_eos(source))
    turn_end = tokenizer.token_to_id(chat.eos) if chat is not None and chat.eos else None
    return frozenset(stops | ({turn_end} if turn_end is not None else set()))


class ContextFull(ConfigError):
    """A prompt, or a chat's rendered conversation, reaches the end of the model's context: the
    user's to shorten (a refusal, one line), and where a conversation ends."""


def reply(model: Transformer, tokenizer: Tokenizer, chat: ChatTemplate, messages: list[dict], max_new: int,
          sampling: Sampling = Sampling(), seed: int = 0, cache: Cache | None = None, source: Path | None = None) -> tuple[str, list[int], list[int]]:
    """The assistant's sampled answer to `messages` (a conversation ending with the user's turn),
    rendered with the run's chat template (the format its data was: data/chat.py) and its
    generation prompt, without the template's end-of-turn markup the sample ends with (a plain
    template's newline: the answer is its content, and a chat prints one newline after it); with
    the prompt's and the answer's ids, as `complete` gives them. `cache`: the conversation's last
    turn's (generate); `source`: as `complete`'s."""
    conversations = Conversations(chat, tokenizer, None)
    ids = chat_ids(conversations, messages, model.cfg.context_length)
    stops = stop_tokens(tokenizer, chat, source)
    new, _ = generate(model, ids, max_new, sampling, seed, stops, cache)
    return chat_answer(conversations, messages, new, stops), ids, new


def chat_ids(conversations: Conversations, messages: list[dict], context: int) -> list[int]:
    """`reply`'s prompt: `messages` rendered with the generation prompt, refused (ContextFull)
    where it fills the model's `context`."""
    text = conversations.render(messages, True, f"message {len(messages)}")
    ids = conversations.tokenizer.encode(text, add_special_tokens=False).ids
    if len(ids) >= context:
        raise ContextFull(f"the rendered conversation is {len(ids)} tokens and the model reads at most {context} "
                          "tokens")
    return ids


def chat_answer(conversations: Conversations, messages: list[dict], new: list[int], stops: frozenset[int]) -> str:
    """`reply`'s answer: the `new` ids after `messages` as text, without the stop tokens and the
    template's end-of-turn markup."""
    tokenizer = conversations.tokenizer
    answer = tokenizer.decode([t for t in new if t not in stops], skip_special_tokens=False)
    markup = conversations.turn_end(messages, [tokenizer.id_to_token(t) for t in stops])
    return answer.removesuffix(markup)


class Dialogue:
    """A chat with the model: the conversation so far and the KV cache of its last turn."""

    def __init__(self, model: Transformer, tokenizer: Tokenizer, chat: ChatTemplate, system: str | None = None,
                 source: Path | None = None):
        self.model, self.tokenizer, self.chat, self.cache, self.source = model, tokenizer, chat, Cache(), source
        self.messages = [] if system is None else [{"role": "system", "content": system}]

    def answer(self, message: str, max_new: int, sampling: Sampling = Sampling(),
               seed: int = 0) -> tuple[str, list[int], list[int]]:
        """`reply` to the user's next `message`; both join the conversation."""
        asked = self.messages + [{"role": "user", "content": message}]
        text, ids, new = reply(self.model, self.tokenizer, self.chat, asked, max_new, sampling, seed, self.cache,
                               self.source)
        self.messages = asked + [{"role": "assistant", "content": text}]
        return text, ids, new


def converse(dialogue: Dialogue, max_new: int, sampling: Sampling, seed: int, lines: TextIO | None) -> int:
    """Answer each line of `lines` as the user's next message, printing the answers, until an
    empty line, the input's end or the end of the model's context (said in a line); the number of turns. The
    prompt marker is for a terminal: piped, the output is the answers alone. Under tp, tp rank 0
    reads `lines` and speaks; the other ranks (`lines` None) take its lines (inference.agreed_line)."""
    context, topo = dialogue.model.cfg.context_length, dialogue.model.topo
    speaks = lines is not None
    for turn in itertools.count():
        if speaks and lines.isatty():
            print("> ", end="", flush=True)
        line = agreed_line(_user_line(lines) if speaks else None, topo)
        if not line.strip():
            return turn
        try:
            text, ids, new = dialogue.answer(line.rstrip("\r\n"), max_new, sampling, seed + turn)
        except ContextFull as e:
            if speaks:
                print(f"tetrad generate: {e}: the conversation ends here", file=sys.stderr)
            return turn
        if speaks:
            print(text, flush=True)
        if len(ids) + len(new) > context:
            if speaks:
                print(f"tetrad generate: the answer reached the end of the model's context ({context} tokens): the "
                      "conversation ends here", file=sys.stderr)
            return turn + 1


def _user_line(lines: TextIO) -> str:
    """The user's next line; bytes that are not UTF-8 (stdin's encoding) are the user's to fix: a
    refusal (ConfigError), not a crash, though UnicodeDecodeError is a ValueError like a bug's."""
    try:
        return lines.readline()
    except UnicodeDecodeError as e:
        raise ConfigError(f"stdin is not {e.encoding} text (byte 0x{e.object[e.start]:02x}: {e.reason}); convert "
                          f"the input to {e.encoding} first, e.g. `iconv -f latin1 -t {e.encoding} FILE | tetrad "
                          "generate ...` (after -f, the encoding it is in)") from None


def chat_template(tokenizer: Tokenizer, source: Path | None, system: str | None) -> tuple[ChatTemplate, str | None]:
    """The chat template beside the run's tokenizer.json (`source`), checked before any weight is
    read: a ConfigError naming what to do without one, or where it refuses the `system` message (a
    template without the role, Gemma's); and a note where the answers cannot end at its eos_token
    (None: none), for the caller to say once."""
    chat = template_beside(source) if source is not None else None
    if chat is None:
        raise ConfigError(f"--chat needs the chat template the run's data was rendered with, and none is beside its "
                          f"tokenizer ({source or 'bytes'}); make the data with `tetrad data --chat-key`")
    if system is not None:
        Conversations(chat, tokenizer, None).render([{"role": "system", "content": system},
                                                     {"role": "user", "content": "Hi"}], True, "--system")
    if chat.eos and tokenizer.token_to_id(chat.eos) is None:
        return chat, (f"tetrad generate: note: the template's eos_token {chat.eos!r} is not one token of the "
                      "tokenizer; the answer runs to the EOS or --max-new-tokens")
    return chat, None
