"""`tetrad` command line: data, train, check, torchrun, generate, estimate, plan, schedule, bench, report, compare, convert."""

from __future__ import annotations

import functools
import os
import signal
import sys
import textwrap
from pathlib import Path

from tetrad.config import Config, ConfigError, counted, idle_settings, load_config, split_config_args
from tetrad.config.wording import did_you_mean

USAGE = """usage: tetrad COMMAND [ARGS]

commands:
  data TEXT... --out DIR [--vocab-size N | --tokenizer F]   BPE tokenizer + token shards for data.source
  train [CONFIG] [--section.key=value ...]   train (spawns local ranks, or runs under torchrun)
  check [CONFIG] [--section.key=value ...]   train a few steps in the layout and in data parallel: do they agree?
  torchrun [TORCHRUN OPTIONS] -m tetrad train ...   torchrun, checking the config before any worker starts
  estimate CONFIG --cluster C [--json]        the cost model for one layout
  plan --model M --cluster C --global-batch N rank every legal layout by predicted step time
  generate CHECKPOINT --prompt TEXT          sample text (KV cache, the run's tokenizer) on a device, or over --tp ranks
  generate RUN --chat [--system TEXT]        answer in the run's chat template: --prompt, or a conversation on stdin
  eval WEIGHTS [CONFIG] [--section.key=value ...]   validation loss of a checkpoint, run or HF model on held-out data
  convert SRC --to-hf OUT | --to-tetrad CKPT  tetrad checkpoint <-> HF safetensors (Llama, Mistral, Qwen2/3, Phi-3, Gemma, Mixtral, Qwen-MoE, GLM-4.5, DeepSeek-V2/V3)
  bench [comm|gemm] [--out DIR]               measure matmul and collective rates; write a hardware profile
  schedule --pp P --microbatches M --schedule S [--vpp V] [--out x.png]   simulate and draw a pipeline schedule
  report RUN_DIR [--cluster C]                loss, step-time breakdown, comm bytes, timelines as HTML + PNGs
  compare RUN_A RUN_B [--out x.png]           do two layouts of one training agree? (first step to rounding)
"""


def train_command(argv: list[str]) -> int:
    from tetrad.train.inputs import model_keys

    if {"-h", "--help"} & set(argv):
        print("usage: tetrad train [CONFIG] [--section.key=value ...]\n"
              "Without CONFIG the defaults apply: the tiny preset on the built-in corpus, one process.\n"
              + _config_keys())
        return 0
    path, overrides = split_config_args(argv)
    cfg = load_config(path, overrides, model_from_inputs=model_keys)
    from tetrad import launch  # after the config's checks: a refusal there needs no torch (start-up time)
    history = launch.train(cfg, announce=functools.partial(_announce, cfg))
    if history and launch.speaks_for_the_job():
        evaluated = [r for r in history if "val_loss" in r]
        val = f", val_loss {evaluated[-1]['val_loss']:.4f} at step {evaluated[-1]['step']}" if evaluated else ""
        try:
            print(f"tetrad: loss {history[0]['loss']:.4f} at step {history[0]['step']} -> {history[-1]['loss']:.4f} "
                  f"at step {history[-1]['step']}{val}; metrics in {cfg.run.dir}/metrics.jsonl", flush=True)
        except BrokenPipeError:  # `| head`: the run stopped on it and saved (train/stopping.py)
            if not launch.in_torchrun():
                raise  # main's SIGPIPE status
            _drop_stdout()  # torchrun counts any other status than 0 as a failed worker: it restarts the job
    return 1 if history and history[-1].get("diverged") else 0  # a job scheduler sees the stop


def _config_keys() -> str:
    """Every config key with its default, by section: what --help owes a user who would otherwise
    read sections.py to learn that the tensor-parallel size is parallel.tp."""
    lines = ["", textwrap.fill("Keys (in a CONFIG's [section] table, or --section.key=value; values are TOML "
                               "literals), with their defaults; src/tetrad/config/sections.py says what each does:",
                               width=100)]
    for table in Config().to_toml().strip().split("\n\n"):
        header, *keys = table.splitlines()
        lines.append(textwrap.fill(f"{header} " + ", ".join(k.replace(" = ", "=", 1) for k in keys), width=100,
                                   initial_indent="  ", subsequent_indent="      ", break_on_hyphens=False))
    return "\n".join(lines)


def _announce(cfg: Config, device_type: str, resume: Path | None) -> None:
    """What `tetrad train` says once every check passed, before the ranks start."""
    from tetrad.train.batches import describe as describe_data
    p, m = cfg.parallel, cfg.model
    model = m.preset  # under init_from the weights decide the shape, whatever the preset says
    if cfg.checkpoint.init_from:
        model = (f"the {m.n_layers}-layer, d_model {m.d_model} model "
                 f"{'fine-tuned from' if resume else 'of'} {cfg.checkpoint.init_from}")
    print(f"tetrad: training {model} with dp={p.dp}{f' (ep={p.ep})' if p.ep > 1 else ''} tp={p.tp} pp={p.pp} cp={p.cp} "
          f"({counted(p.world_size, 'rank')} on {device_type}), {counted(cfg.train.steps, 'step')}, "
          f"run dir {cfg.run.dir}", flush=True)
    print(describe_data(cfg, resume), flush=True)
    if cfg.train.warmup > cfg.train.steps:
        print(f"tetrad: note: train.warmup={cfg.train.warmup} > train.steps={cfg.train.steps}: the learning rate "
              f"never reaches train.lr={cfg.train.lr:g}", flush=True)
    for note in idle_settings(cfg):
        print(f"tetrad: note: {note}", flush=True)


def check_command(argv: list[str]) -> int:
    from tetrad.check import check_command as run
    return run(argv)


def estimate_command(argv: list[str]) -> int:
    """The model the data and `checkpoint.init_from` decide, as `tetrad train`'s."""
    from tetrad.plan.cli import estimate_command as run
    from tetrad.train.inputs import model_keys
    return run(argv, model_from_inputs=model_keys)


def plan_command(argv: list[str]) -> int:
    from tetrad.plan.cli import plan_command as run
    from tetrad.train.inputs import model_keys
    return run(argv, model_from_inputs=model_keys)


def convert_command(argv: list[str]) -> int:
    from tetrad.train.convert import convert_command as run
    return run(argv)


def data_command(argv: list[str]) -> int:
    from tetrad.data.prepare import data_command as run
    return run(argv)


def generate_command(argv: list[str]) -> int:
    """Ctrl-C (while torch loads, the model reads or a chat waits for a line) ends it as a shell's
    command ends: a newline, so the prompt starts on its own line, and status 130."""
    try:
        from tetrad.sample import generate_command as run
        return run(argv)
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 128 + signal.SIGINT


def bench_command(argv: list[str]) -> int:
    from tetrad.bench import bench_command as run
    return run(argv)


def schedule_command(argv: list[str]) -> int:
    from tetrad.viz.timeline import schedule_command as run
    return run(argv)


def report_command(argv: list[str]) -> int:
    from tetrad.viz.report import report_command as run
    return run(argv)


def eval_command(argv: list[str]) -> int:
    from tetrad.evaluate import eval_command as run
    return run(argv)


def torchrun_command(argv: list[str]) -> int:
    from tetrad.torchrun import torchrun_command as run
    return run(argv)


def compare_command(argv: list[str]) -> int:
    from tetrad.viz.compare import compare_command as run
    return run(argv)


COMMANDS = {"data": data_command, "train": train_command, "check": check_command, "schedule": schedule_command, "estimate": estimate_command, "plan": plan_command, "convert": convert_command,
            "generate": generate_command, "eval": eval_command, "torchrun": torchrun_command,
            "bench": bench_command, "report": report_command, "compare": compare_command}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0
    if argv[0] not in COMMANDS:
        print(f"tetrad: unknown command {argv[0]!r}{did_you_mean(argv[0], COMMANDS)}\n\n{USAGE}", file=sys.stderr)
        return 2
    try:
        return _run(argv)
    except Exception as e:  # a crash: its traceback, here and (under torchrun) in torchrun's summary
        if "TORCHELASTIC_ERROR_FILE" in os.environ:
            from torch.distributed.elastic.multiprocessing.errors import get_error_handler
            get_error_handler().record_exception(e)  # what torch's @record writes
        raise


def _run(argv: list[str]) -> int:
    """The command, each way it ends for the user: its status, a one-line refusal (exit 2), a stop."""
    try:
        code = COMMANDS[argv[0]](argv[1:])
        sys.stdout.flush()  # here, not at exit: a reader gone by then is a traceback out of reach
        return code
    except BrokenPipeError:  # stdout's reader left (`| head`): end quietly, as Unix tools do
        _drop_stdout()
        return 128 + signal.SIGPIPE
    except ConfigError as e:
        if _says_refusal(f"tetrad: config error: {e}"):  # every rank that refuses exits 2; one says why
            print(f"tetrad: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # no import here: Ctrl-C may have come while torch was half imported
        signum = getattr(e, "signum", signal.SIGINT)  # launch.Stopped's, or Ctrl-C's
        print(f"tetrad: stopped by {signal.Signals(signum).name}; every rank was stopped", file=sys.stderr)
        return 128 + signum
    except RuntimeError as e:
        from tetrad.launch import RankFailure
        if isinstance(e, RankFailure):
            print(f"tetrad: {e}", file=sys.stderr)
            return 1
        raise


def _drop_stdout() -> None:
    """Point stdout, whose reader left, at /dev/null: nothing is left to flush at exit."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _says_refusal(message: str) -> bool:
    """launch.says_refusal, without loading torch where no torchrun rank can be."""
    if "RANK" not in os.environ:
        return True
    from tetrad import launch
    return launch.says_refusal(message)


if __name__ == "__main__":
    sys.exit(main())
