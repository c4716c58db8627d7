"""`tetrad generate CHECKPOINT --prompt ...`: where the decoding (train/generate.py) runs.

`--tp 1` (the default): in this process, the model on `--device` in `--dtype`; a conversation on
stdin too. `--tp N`: N ranks, each holding its tensor-parallel shard of the model and its heads'
share of the KV cache (train/inference.py), started here by launch.run_local (CPU ranks over
gloo, or one per local accelerator) or, under torchrun, this process one of them (`torchrun
--nproc-per-node N -m tetrad generate ... --tp N`). Every check runs first, in the process that
starts the ranks (under torchrun in each, one line said for the job): a bad flag, checkpoint,
chat template or tp is one line and no rank starts. Rank 0's text and loss are printed, by this
process from run_local's results, or under torchrun by global rank 0. A conversation on stdin
runs here or on run_local's ranks, which have no stdin (multiprocessing closes it): a thread of
this process reads it and queues each line for tp rank 0, which shares it with the other ranks
and prints the answers. Under torchrun, where only some processes would have a stdin, it is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import multiprocessing
import os
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from tetrad import device as devices
from tetrad import launch
from tetrad.config import Config, ConfigError, counted, validate
from tetrad.data.chat import ChatTemplate
from tetrad.data.tokenizer import model_sampling
from tetrad.dist.layout import Layout
from tetrad.dist.topology import Topology
from tetrad.model.llama import Transformer
from tetrad.model.sampling import Sampling
from tetrad.train.checkpoint import CheckpointError
from tetrad.train.batched import Prompt, decode_prompts, tokenized, write_outputs
from tetrad.train.generate import (Dialogue, Weights, sampling_flags, chat_template, complete, continuation_loss,
                                   converse, found_weights, sampling_settings, stop_tokens)
from tetrad.train.inference import inference_model


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tetrad generate", description="Sample text from a checkpoint with a KV "
                                     "cache and the run's tokenizer: on one device, or split over --tp ranks.")
    parser.add_argument("checkpoint", type=Path, help="a checkpoint folder, a checkpoint dir with `latest`, a run dir, "
                        "or a Hugging Face model folder (config.json, *.safetensors, tokenizer.json)")
    parser.add_argument("--prompt", metavar="TEXT", help="text to continue (default: nothing but the first token); "
                        "with --chat, the user's one message")
    parser.add_argument("--chat", action="store_true", help="answer as the assistant, in the chat template the run's "
                        "data was rendered with (tetrad data --chat-key), printing the answers alone: to --prompt, or "
                        "without it to each line of stdin in turn, keeping the conversation, until an empty line, "
                        "the input's end or the model's context (model.max_position_embeddings, else seq_len); "
                        "a conversation on stdin runs without torchrun")
    parser.add_argument("--prompts", metavar="FILE", help="decode each line of FILE ('-': stdin) as a --prompt (or "
                        "JSONL: objects with a \"prompt\"), --batch-size at a time, to --output as JSONL (README)")
    parser.add_argument("--output", type=Path, metavar="OUT", help="with --prompts, the JSONL file (default: stdout)")
    parser.add_argument("--batch-size", type=int, default=8, help="with --prompts, prompts decoded at once (default 8)")
    parser.add_argument("--system", metavar="TEXT", help="with --chat, a system message first in the conversation")
    parser.add_argument("--max-new-tokens", type=int, default=200, help="at most this many tokens (default 200; "
                        "fewer at an EOS or the end of the model's context); the KV cache is allocated for the "
                        "prompt and these at the start")
    # Unset sampling flags take an imported model's generation_config.json (model_sampling), else Sampling's defaults.
    parser.add_argument("--temperature", type=float, help="0: greedy (default 0.8)")
    parser.add_argument("--top-k", type=int, help="sample among the k likeliest tokens (default 0: all)")
    parser.add_argument("--top-p", type=float, help="nucleus: the likeliest tokens of this mass (default 1)")
    parser.add_argument("--min-p", type=float, help="only tokens at least this fraction as likely as the likeliest "
                        "(default 0)")
    parser.add_argument("--repetition-penalty", type=float, help="divide the logits of tokens already in the text by "
                        "this, as transformers does (default 1: none; applies to greedy decoding too)")
    parser.add_argument("--seed", type=int, default=0, help="the sampler's random seed (default 0): the same "
                        "seed, settings, prompt and device give the same text (drawn by a CPU generator)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, ... or auto (default): the accelerator torch "
                        "finds, else cpu, as train.device")
    parser.add_argument("--dtype", help="fp32, bf16 or fp16 for the weights, the KV cache and the compute (default: "
                        "fp32 on cpu, where bf16 matmuls are often slower; bf16 on an accelerator: half the memory "
                        "and of the bytes each token reads, with fp32's range; fp16 on a GPU without bf16 matmuls, "
                        "before Ampere)")
    parser.add_argument("--tp", type=int, help="tensor-parallel ranks, each holding 1/tp of the heads, the MLP, the "
                        "vocabulary and the KV cache (default 1; under torchrun its world size)")
    return parser


def _arguments(argv: list[str]) -> argparse.Namespace:
    args = _parser().parse_args(argv)
    if args.max_new_tokens < 1:
        raise ConfigError("need --max-new-tokens >= 1")
    try:
        Sampling(**sampling_flags(args))
    except ValueError as e:  # model/sampling.py's range check of the flags
        raise ConfigError(str(e)) from None
    for flag, text in (("--prompt", args.prompt), ("--system", args.system)):
        if text is not None and not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # bytes the locale could not decode (surrogateescape): no tokenizer takes them
                raise ConfigError(f"{flag} holds bytes that are not UTF-8 text; pass it in UTF-8") from None
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size}: need --batch-size >= 1")
    if args.prompts is not None and args.prompt is not None:
        raise ConfigError("--prompts reads the prompts from its file; drop --prompt (or add it to the file)")
    if args.output is not None and (args.prompts is None or not args.output.parent.is_dir() or args.output.is_dir()):
        raise ConfigError(f"--output {args.output}: pass it with --prompts, a file in a folder that exists")
    if args.system is not None and not args.chat:
        raise ConfigError("--system is a chat's system message: pass --chat too")
    if not args.checkpoint.exists():
        raise ConfigError(f"no checkpoint at {args.checkpoint}; pass a run folder, its checkpoints/ folder, or one "
                          "of its step_N folders, or a Hugging Face model folder")
    return args


def chosen_dtype(device_type: str, flag: str | None, bf16_problem: str | None) -> tuple[str, str | None]:
    """The dtype --dtype names (`flag`), else the default: fp32 on the CPU, bf16 on an accelerator
    that multiplies it, else fp16 (a GPU before Ampere: `bf16_problem` says why), with a note
    saying so (None: none). An explicit --dtype bf16 there is refused by the caller's check."""
    if flag is not None or device_type == "cpu":
        return flag or "fp32", None
    if bf16_problem:
        return "fp16", (f"tetrad generate: note: fp16, as this {device_type} device cannot multiply bf16 matrices "
                        f"({bf16_problem}); --dtype fp32 for fp32's range")
    return "bf16", None


def _placement(args: argparse.Namespace) -> tuple[str, str, int]:
    """The device type, dtype name and tp the flags ask for, checked against this machine and job."""
    if ":" in args.device:
        raise ConfigError(f"--device {args.device}: pass the device type alone (--device "
                          f"{args.device.partition(':')[0]}), and pick the GPU with CUDA_VISIBLE_DEVICES; under --tp "
                          "rank i takes local device i")
    device_type = devices.resolve_device_type(args.device, "--device")
    devices.configure_allocator(device_type)  # before anything starts CUDA's allocator: the KV cache grows each token
    bf16_problem = devices.dtype_problem(device_type, devices.DTYPES["bf16"]) \
        if args.dtype is None and device_type != "cpu" else None
    dtype, note = chosen_dtype(device_type, args.dtype, bf16_problem)
    if note and launch.speaks_for_the_job():
        print(note, file=sys.stderr)
    if dtype not in devices.DTYPES:
        raise ConfigError(f"--dtype {dtype!r} is not one of {', '.join(devices.DTYPES)}; pass one of them")
    problem = devices.dtype_problem(device_type, devices.DTYPES[dtype])
    if problem:
        other = "fp16 (or fp32)" if dtype == "bf16" and device_type != "cpu" else "fp32"  # a GPU before Ampere
        raise ConfigError(f"--dtype {dtype}: this {device_type} device cannot multiply {dtype} matrices ({problem}); "
                          f"pass --dtype {other}")
    world = int(os.environ["WORLD_SIZE"]) if launch.in_torchrun() else None
    tp = args.tp if args.tp is not None else world or 1
    if tp < 1:
        raise ConfigError(f"--tp {tp}: need --tp >= 1")
    if world is not None and tp != world:
        raise ConfigError(f"--tp {tp} but torchrun started {counted(world, 'process', 'processes')}; pass --tp {world}, "
                          f"or start {counted(tp, 'process', 'processes')}")
    if world is None and device_type != "cpu" and tp > devices.local_device_count(device_type):
        have = counted(devices.local_device_count(device_type), f"{device_type} device")
        raise ConfigError(f"--tp {tp} but this machine has {have}; use torchrun across nodes, or a smaller --tp")
    if world is not None and args.prompts == "-":
        raise ConfigError("--prompts - reads stdin, which only some of torchrun's processes have; pass a file")
    if world is not None and args.chat and args.prompt is None and args.prompts is None:  # some have no stdin
        raise ConfigError(f"a conversation on stdin runs without torchrun (tetrad generate --tp {tp} starts its ranks "
                          f"itself); pass --prompt for one message under torchrun, or run it without torchrun to "
                          "converse")
    return device_type, dtype, tp


def _check_tp(weights: Weights, tp: int) -> None:
    """`tetrad train`'s rule for parallel.tp (it divides the heads, the KV heads and the MLP)."""
    try:
        validate(dataclasses.replace(Config(), model=weights.model,
                                     parallel=dataclasses.replace(Config().parallel, tp=tp)), runtime=False)
    except ConfigError as e:
        raise ConfigError(f"--tp: {e}".replace("use tp in", "use --tp in")) from None


@dataclasses.dataclass(frozen=True)
class Job:
    """One `tetrad generate` sample, checked: what each rank needs (it pickles, for spawned ranks)."""
    weights: Weights
    device_type: str
    dtype: str
    tp: int
    sampling: Sampling
    chat: ChatTemplate | None  # --chat's template, else None
    args: argparse.Namespace
    prompts: tuple[Prompt, ...] | None = None  # --prompts' (batched.tokenized), else None


def sample_on_this_rank(job: Job) -> tuple[str, list[int], list[int], float]:
    """This rank's part of one sample (tp ranks in a process group, or this process alone): the
    text, the prompt's and the new ids and their loss, the same on every rank. A user error (a
    prompt longer than the model's context, a message the chat template refuses; the device out of
    memory, maybe on this rank alone) is raised as a ConfigError, its line, on which run_local ends
    every rank at once, as torchrun does; anything else (a bug) as itself, with its traceback."""
    def sample(model: Transformer) -> tuple[str, list[int], list[int], float]:
        args, weights = job.args, job.weights
        if job.chat is not None:
            dialogue = Dialogue(model, weights.tokenizer, job.chat, args.system, weights.source)
            text, prompt, new = dialogue.answer(args.prompt, args.max_new_tokens, job.sampling, args.seed)
        else:
            text, prompt, new = complete(model, weights.tokenizer, args.prompt or "", args.max_new_tokens,
                                         job.sampling, args.seed, weights.source)
        return text, prompt, new, continuation_loss(model, prompt, new)
    return _decoded_on_this_rank(job, sample)


def prompts_on_this_rank(job: Job) -> list[dict]:
    """This rank's part of --prompts: each prompt's output object (batched.decode_prompts), the
    same on every rank, tp rank 0 saying the progress; errors as sample_on_this_rank's."""
    def decode(model: Transformer) -> list[dict]:
        tokenizer, args = job.weights.tokenizer, job.args
        return decode_prompts(model, tokenizer, job.prompts, args.batch_size, args.max_new_tokens, job.sampling,
                              args.seed, stop_tokens(tokenizer, job.chat, job.weights.source), job.chat,
                              says_progress=model.topo.tp_rank == 0)
    return _decoded_on_this_rank(job, decode)


def _decoded_on_this_rank(job: Job, decode: Callable[[Transformer], Any]) -> Any:
    """`decode` of the job's model on this rank (its tp rank's part), a device out of memory the
    ConfigError naming what to change."""
    device = devices.bind_rank(job.device_type, int(os.environ.get("LOCAL_RANK", "0")))
    topo = Topology(Layout(tp=job.tp), device)
    try:  # a refusal is raised, not returned: the other ranks may be waiting in a collective for this one
        model = _filled(job, topo)
        try:
            return decode(model)
        except torch.OutOfMemoryError as e:
            raise ConfigError(out_of_memory(job, "decoding", e)) from None
    finally:
        topo.close()


def _filled(job: Job, topo: Topology) -> Transformer:
    """The job's model on this rank, or a ConfigError naming what to change where it does not fit."""
    try:
        return inference_model(job.weights.model, job.weights.reader(), topo, devices.DTYPES[job.dtype], job.weights.biases())
    except torch.OutOfMemoryError as e:
        raise ConfigError(out_of_memory(job, "filling the model", e)) from None


def out_of_memory(job: Job, stage: str, error: torch.OutOfMemoryError) -> str:
    """One line for an allocation the device refused during `stage`: what torch tried to allocate,
    and the flags that need less (each GPU of --tp N holds 1/N of the weights and KV cache)."""
    tried = re.search(r"Tried to allocate [\d.]+ \w+", str(error))
    tp = _larger_tp(job)
    fixes = [f"--tp {tp} to split the model and its KV cache over {tp} GPUs"] if tp else []
    if job.dtype == "fp32":
        fixes.append("--dtype bf16 for half the memory")
    if stage == "decoding":
        fixes.append("a shorter --max-new-tokens or prompt (the KV cache is allocated for both)")
    fix = f"pass {', or '.join(fixes)}" if fixes else ("no larger --tp fits the model's heads or this machine's "
                                                        "devices: free memory on the device, or use one with more")
    return (f"{job.device_type} out of memory while {stage}" + (f" (t{tried[0][1:]})" if tried else "") +
            f" at {job.dtype}, tp {job.tp}; {fix}")


def _larger_tp(job: Job) -> int | None:
    """The smallest tp above the job's that its model takes (`_check_tp`) and, outside torchrun
    (which may start more nodes), this machine has devices for: a --tp the OOM line suggests must
    run, not be refused by the next command. None: there is none."""
    most = job.weights.model.n_heads
    if not launch.in_torchrun() and job.device_type != "cpu":
        most = min(most, devices.local_device_count(job.device_type))
    for tp in range(job.tp + 1, most + 1):
        try:
            _check_tp(job.weights, tp)
        except ConfigError:
            continue
        return tp
    return None


def _job(argv: list[str]) -> Job:
    """Every check, before any weight is read or rank starts: the flags, the checkpoint, the tp its
    model takes, the sampling and the chat template."""
    args = _arguments(argv)
    device_type, dtype, tp = _placement(args)
    weights = found_weights(args.checkpoint)
    _check_tp(weights, tp)
    asked = model_sampling(weights.source)
    sampling = sampling_settings(args, asked)
    if asked and launch.speaks_for_the_job():
        print(f"tetrad generate: {sampling.describe()}: the model's generation_config.json where no flag says "
              "otherwise", file=sys.stderr)
    chat, note = chat_template(weights.tokenizer, weights.source, args.system) if args.chat else (None, None)
    if note and launch.speaks_for_the_job():  # once, not once per torchrun process
        print(note, file=sys.stderr)
    prompts = None if args.prompts is None else tokenized(args.prompts, weights.tokenizer,
                                                          weights.model.context_length, chat, args.system)
    return Job(weights, device_type, dtype, tp, sampling, chat, args, prompts)


class _Queued:
    """The lines the launching process reads from its stdin, on tp rank 0 of run_local's ranks
    (which have no stdin): `readline` as a file's, "" at the input's end, raising what reading
    stdin raised there (bytes that are not UTF-8), as stdin's own readline would."""

    def __init__(self, queue, tty: bool):
        self.queue, self.tty = queue, tty

    def readline(self) -> str:
        line = self.queue.get()
        if isinstance(line, Exception):
            raise line
        return line

    def isatty(self) -> bool:
        return self.tty


def converse_on_this_rank(job: Job, queue=None, tty: bool = False) -> tuple[int, int, int]:
    """This rank's part of a conversation (tp ranks in a process group, or this process alone, which
    reads stdin itself): tp rank 0 reads the user's lines (stdin, or `queue`: _fed's), shares each
    with the other ranks (inference.agreed_line) and prints the answers. The turns answered and the
    KV cache's reused and prompted tokens; a user error is raised as a ConfigError, as
    sample_on_this_rank's (stdin's bytes that are not UTF-8 too)."""
    def converse_here(model: Transformer) -> tuple[int, int, int]:
        dialogue = Dialogue(model, job.weights.tokenizer, job.chat, job.args.system, job.weights.source)
        lines = None if model.topo.tp_rank else sys.stdin if queue is None else _Queued(queue, tty)
        turns = converse(dialogue, job.args.max_new_tokens, job.sampling, job.args.seed, lines)
        return turns, dialogue.cache.reused, dialogue.cache.prompted
    return _decoded_on_this_rank(job, converse_here)


def _fed(queue, lines) -> None:
    """Put each line of `lines` (this process's stdin) on `queue` for tp rank 0, then "" at its end,
    or what reading it raised: a thread that just died would leave rank 0 waiting for a line."""
    try:
        for line in iter(lines.readline, ""):
            queue.put(line)
    except Exception as e:  # passed on: raised on rank 0 (_Queued), as reading stdin there would
        queue.put(e)
        return
    queue.put("")


def _conversation(job: Job) -> int:
    """--chat without --prompt: a conversation over stdin, in this process, or on run_local's tp
    ranks, to whose rank 0 a thread here passes the lines of stdin."""
    if job.tp == 1:
        result = converse_on_this_rank(job)
    else:
        queue = multiprocessing.get_context("spawn").SimpleQueue()  # passes to forked and spawned ranks alike
        # Read through a file of its own: a forked rank first closes its copy of sys.stdin, which waits
        # for the buffer's lock, held (in the copy, forever) by this thread blocked reading the terminal.
        lines = open(os.dup(sys.stdin.fileno()), encoding=sys.stdin.encoding, errors=sys.stdin.errors, newline="\n")
        threading.Thread(target=_fed, args=(queue, lines), daemon=True).start()
        result = launch.run_local(converse_on_this_rank, job.tp, (job, queue, sys.stdin.isatty()),
                                  device_type=job.device_type)[0]
    turns, reused, prompted = result
    print(f"tetrad generate: answered {counted(turns, 'message')}; the KV cache held {reused} of their {prompted} "
          "prompt tokens", file=sys.stderr)
    return 0


def _on_ranks(job: Job, on_this_rank: Callable[[Job], Any]) -> Any:
    """Rank 0's result of `on_this_rank` (sample_on_this_rank, prompts_on_this_rank): here, on this
    machine's tp ranks, or on this torchrun rank."""
    if job.tp == 1 and not launch.in_torchrun():
        return on_this_rank(job)
    if launch.in_torchrun():
        with launch.torchrun_process_group(job.device_type):
            return on_this_rank(job)
    return launch.run_local(on_this_rank, job.tp, (job,), device_type=job.device_type)[0]


def _refused(error: Exception) -> int:
    """Say the job's refusal once (launch.says_refusal): exit 2."""
    if launch.says_refusal(f"tetrad generate: {error}"):
        print(f"tetrad generate: {error}", file=sys.stderr)
    return 2


def generate_command(argv: list[str]) -> int:
    """The sample or conversation; a refusal (a ConfigError or CheckpointError, in the checks or
    on a rank) is one line and exit 2; anything else, a ValueError too, is a bug: its traceback."""
    try:
        job = _job(argv)
        if job.prompts is not None:
            outputs = _on_ranks(job, prompts_on_this_rank)
        elif job.chat is not None and job.args.prompt is None:
            return _conversation(job)
        else:
            result = _on_ranks(job, sample_on_this_rank)
    except (CheckpointError, ConfigError) as e:
        return _refused(e)
    if not launch.speaks_for_the_job():
        return 0
    where = f"{job.device_type}, {job.dtype}" + (f", tp {job.tp}" if job.tp > 1 else "")
    if job.prompts is not None:
        write_outputs(outputs, job.args.output, where)
        return 0
    text, prompt, new, loss = result
    context, args = job.weights.model.context_length, job.args
    print(text)
    capped = (f"; the model's context ({context} tokens) ended it before --max-new-tokens"
              if len(prompt) + len(new) > context and len(new) < args.max_new_tokens else "")
    print(f"tetrad generate: {counted(len(new), 'token')}; their loss under the model {loss:.4f} "
          f"(tokenizer: {job.weights.source or 'bytes'}; {where}){capped}", file=sys.stderr)
    return 0
