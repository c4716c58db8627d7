"""`tetrad generate CHECKPOINT --prompt ...`: sample text from a checkpoint on one process.

The checkpoint (any layout) is read as logical weights into a single-process model; decoding
runs the prompt once and then one token per step against a KV cache (llama.LayerCache), and
texts go through the run's tokenizer (data/tokenizer.py: bytes for a run on raw text). The continuation's loss is computed
by the model's training forward (summed token cross-entropy / tokens), the number a training
step reports for the same tokens.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from tokenizers import Tokenizer

from tetrad.config import ModelConfig
from tetrad.data.chat import ChatTemplate, Conversations, template_beside
from tetrad.data.tokenizer import document_prefix, eos_id, run_tokenizer
from tetrad.model.llama import Transformer
from tetrad.dist.topology import Topology
from tetrad.train.checkpoint import CheckpointError
from tetrad.train.convert import checkpoint_folder, read_weights


def single_process_model(model_cfg: ModelConfig, state: dict[str, torch.Tensor]) -> Transformer:
    model = Transformer(model_cfg, Topology.single("cpu"))
    model.load_state_dict(state)
    return model.eval()


def sample(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator) -> int:
    """One token id from `logits` [vocab]: greedy at temperature 0, else softmax(logits /
    temperature) restricted to the top_k largest (0: all) and the smallest set of mass top_p."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        logits[logits < logits.topk(top_k).values[-1]] = -float("inf")
    probs = logits.softmax(-1)
    if top_p < 1:
        ordered, order = probs.sort(descending=True)
        outside = ordered.cumsum(-1) - ordered >= top_p  # mass before a token already reaches top_p
        probs[order[outside]] = 0
    return int(torch.multinomial(probs, 1, generator=generator))


@torch.no_grad()
def generate(model: Transformer, prompt: list[int], max_new: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0, stop: frozenset[int] = frozenset()) -> tuple[list[int], list[torch.Tensor]]:
    """The new token ids (at most `max_new`, ending at a `stop` token, e.g. EOS, or at seq_len
    tokens in all) and the logits each was drawn from."""
    generator = torch.Generator().manual_seed(seed)
    cache: dict = {}
    logits = model(torch.tensor([prompt]), torch.arange(len(prompt)), cache=cache)[0, -1]
    new, drawn_from = [], []
    for position in range(len(prompt), min(len(prompt) + max_new, model.cfg.seq_len + 1)):
        token = sample(logits, temperature, top_k, top_p, generator)
        new.append(token)
        drawn_from.append(logits)
        if token in stop or position == model.cfg.seq_len:
            break
        logits = model(torch.tensor([[token]]), torch.tensor([position]), cache=cache)[0, -1]
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
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder, a checkpoint dir with `latest`, or a run dir")
    parser.add_argument("--prompt", default="", help="text to continue (default: nothing but the first token); "
                        "with --chat, the user's message")
    parser.add_argument("--chat", action="store_true", help="answer --prompt as the assistant, in the chat template "
                        "the run's data was rendered with (tetrad data --chat-key), and print the answer alone")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus: the likeliest tokens of this mass")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.temperature < 0 or args.top_k < 0 or not 0 < args.top_p <= 1:
        raise ValueError("need --max-new-tokens >= 1, --temperature >= 0, --top-k >= 0 and 0 < --top-p <= 1")
    if not args.checkpoint.exists():
        raise ValueError(f"no checkpoint at {args.checkpoint}; pass a run folder, its checkpoints/ folder, or one "
                         "of its step_N folders")
    return args


def load_generator(checkpoint: Path) -> tuple[Transformer, Tokenizer, Path | None]:
    """The checkpoint's single-process model, the run's tokenizer and where that came from (None: bytes)."""
    cfg, state = read_weights(checkpoint)
    tokenizer, source = run_tokenizer(checkpoint_folder(checkpoint), cfg.data.source)
    return single_process_model(cfg.model, state), tokenizer, source


def complete(model: Transformer, tokenizer: Tokenizer, prompt: str, max_new: int, temperature: float = 0.8,
             top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> tuple[str, list[int], list[int]]:
    """`prompt` and its sampled continuation as text (what `tetrad generate` prints), with the
    prompt's and the continuation's token ids, the tokenizer's document prefix (data/tokenizer.py)
    first. An empty prompt starts from that prefix, or from a newline when there is none."""
    prefix = document_prefix(tokenizer)
    ids = prefix + tokenizer.encode(prompt or ("" if prefix else "\n"), add_special_tokens=False).ids
    if len(ids) >= model.cfg.seq_len:
        raise ValueError(f"the prompt is {len(ids)} tokens; the model reads at most seq_len={model.cfg.seq_len}, "
                         "so use a shorter one")
    new, _ = generate(model, ids, max_new, temperature, top_k, top_p, seed, _stops(tokenizer))
    return prompt + tokenizer.decode(new, skip_special_tokens=False), ids, new


def _stops(tokenizer: Tokenizer, chat: ChatTemplate | None = None) -> frozenset[int]:
    """The tokens that end a sample: the EOS (none for bytes: generation runs to max_new tokens),
    and in a chat the template's eos_token (Llama 3's <|eot_id|> ends the assistant's turn)."""
    try:
        stops = {eos_id(tokenizer)}
    except ValueError:
        stops = set()
    turn_end = tokenizer.token_to_id(chat.eos) if chat is not None and chat.eos else None
    return frozenset(stops | ({turn_end} if turn_end is not None else set()))


def reply(model: Transformer, tokenizer: Tokenizer, chat: ChatTemplate, message: str, max_new: int,
          temperature: float = 0.8, top_k: int = 0, top_p: float = 1.0, seed: int = 0) -> tuple[str, list[int], list[int]]:
    """The assistant's sampled answer to a user's `message`, rendered with the run's chat template
    (the format its data was: data/chat.py) and its generation prompt; with the prompt's and the
    answer's ids, as `complete` gives them."""
    text = Conversations(chat, tokenizer, None).render([{"role": "user", "content": message}], True, "--prompt")
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    if len(ids) >= model.cfg.seq_len:
        raise ValueError(f"the rendered prompt is {len(ids)} tokens; the model reads at most seq_len="
                         f"{model.cfg.seq_len}, so use a shorter one")
    stops = _stops(tokenizer, chat)
    new, _ = generate(model, ids, max_new, temperature, top_k, top_p, seed, stops)
    return tokenizer.decode([t for t in new if t not in stops], skip_special_tokens=False), ids, new


def _run_template(tokenizer_source: Path | None) -> ChatTemplate:
    """The chat template beside the run's tokenizer.json; ValueError naming what to do without one."""
    chat = template_beside(tokenizer_source) if tokenizer_source is not None else None
    if chat is None:
        raise ValueError(f"--chat needs the chat template the run's data was rendered with, and none is beside its "
                         f"tokenizer ({tokenizer_source or 'bytes'}); make the data with `tetrad data --chat-key`")
    return chat


def generate_command(argv: list[str]) -> int:
    try:
        args = _arguments(argv)
        model, tokenizer, source = load_generator(args.checkpoint)
        sampling = (args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed)
        if args.chat:
            chat = _run_template(source)
            if chat.eos and tokenizer.token_to_id(chat.eos) is None:
                print(f"tetrad generate: note: the template's eos_token {chat.eos!r} is not one token of the "
                      "tokenizer; the answer runs to the EOS or --max-new-tokens", file=sys.stderr)
            text, prompt, new = reply(model, tokenizer, chat, args.prompt, *sampling)
        else:
            text, prompt, new = complete(model, tokenizer, args.prompt, *sampling)
    except (ValueError, CheckpointError) as e:
        print(f"tetrad generate: {e}", file=sys.stderr)
        return 2
    print(text)
    print(f"tetrad generate: {len(new)} tokens; their loss under the model {continuation_loss(model, prompt, new):.4f} "
          f"(tokenizer: {source or 'bytes'})", file=sys.stderr)
    return 0
