"""`tetrad eval WEIGHTS [CONFIG] [--section.key=value ...]`: the validation loss of a model's
weights on held-out data, in any layout, computed as training's validation computes it
(Megatron-LM's --skip-train): a base model's loss before a fine-tune, a checkpoint's on another
corpus, a run's on its own validation set after it ended.

WEIGHTS is what checkpoint.init_from takes: a tetrad checkpoint, a run folder (its newest
checkpoint) or a Hugging Face model folder. The config is CONFIG, else the one the checkpoint was
trained with (its config.toml), else the defaults; flags override it. The evaluation set is the
data's held-out part (data.val_source, or the last data.val_fraction of data.source) or, where
the config holds none out, the whole of data.source; at most train.eval_steps global batches.
Nothing is written: no checkpoint, no metrics. On NCCL, the flight recorder's dumps of a hang
go to a TMPDIR/tetrad-eval-nccl-* folder of its own (`trace_dir`), which outlives the command, and
a failure of the ranks it starts names it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import tempfile
from dataclasses import replace
from pathlib import Path

from tetrad.config import Config, ConfigError, counted, load_config, split_config_args, validate


def trained_config(weights: Path) -> Path | None:
    """The config.toml a tetrad checkpoint was saved with (a run folder's newest checkpoint's);
    None for a Hugging Face folder, or a checkpoint without one."""
    from tetrad.train.checkpoint.store import CheckpointError
    from tetrad.train.convert import checkpoint_folder
    from tetrad.train.init_from import is_hf_folder
    if not weights.exists():
        raise ConfigError(f"{weights} does not exist; name a tetrad checkpoint or run folder, or an HF model folder")
    if is_hf_folder(weights):
        return None
    try:
        saved = checkpoint_folder(weights) / "config.toml"
    except CheckpointError as e:
        raise ConfigError(str(e)) from None
    return saved if saved.is_file() else None


def eval_config(config: str | None, overrides: list[str], weights: Path, run_dir: str) -> Config:
    """The config an evaluation runs: CONFIG's (else the training run's) with the user's flags,
    starting from `weights` and writing nothing outside `run_dir`; the whole data.source is the
    evaluation set where nothing is held out."""
    from tetrad.train.inputs import model_keys
    own = [f"--checkpoint.init_from={weights}", "--checkpoint.resume=never", "--checkpoint.every=0",
           "--checkpoint.dir=", "--checkpoint.async_save=false", f"--run.dir={run_dir}", "--run.tensorboard=false",
           "--run.wandb=false", "--train.eval_every=0", "--train.profile="]
    taken = sorted({_key(o) for o in overrides} & {_key(o) for o in own})
    if taken:  # else the flag would be dropped without a word
        raise ConfigError(f"tetrad eval sets {', '.join(taken)} itself (it starts from WEIGHTS and writes nothing); "
                          f"remove --{taken[0]}" + (" and name the weights as WEIGHTS" if "checkpoint.init_from" in taken
                                                    else ""))
    cfg = load_config(config or trained_config(weights), [*overrides, *own], model_from_inputs=model_keys)
    if not cfg.data.val_source and not cfg.data.val_fraction:
        cfg = replace(cfg, data=replace(cfg.data, val_source=cfg.data.source))
        validate(cfg)
    return cfg


def trace_dir() -> Path:
    """Where NCCL's flight recorder dumps an evaluation's hang: not its run folder, a temporary one
    deleted as the command ends, but a folder that outlives it and no other evaluation shares (else
    a failure would name an earlier one's dumps): a fresh one for the ranks this command starts;
    under torchrun one for the job's ranks on this node, named by its run id ("none" unless given,
    or a job id several evaluations reuse) and its agent, their parent."""
    from tetrad.launch import in_torchrun
    if not in_torchrun():
        return Path(tempfile.mkdtemp(prefix="tetrad-eval-nccl-"))
    job = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}-{os.getppid()}"
    return Path(tempfile.gettempdir()) / f"tetrad-eval-nccl-{job}"


@contextlib.contextmanager
def kept_traces(traces: Path):
    """Around an evaluation: a rank's failure names the dumps in `traces` (where there are any) and
    how to read them; the folder is removed where it holds none, except under torchrun, where a
    rank still running may yet dump into it."""
    from tetrad.launch import RankFailure, in_torchrun
    try:
        yield traces
    except RankFailure as e:
        if traces.is_dir() and any(traces.iterdir()):
            raise RankFailure(f"{e}\nNCCL's flight-recorder dumps are in {traces}: read them with "
                              f"`python -m torch.distributed.flight_recorder.fr_trace {traces}`") from None
        raise
    finally:
        with contextlib.suppress(OSError):  # absent (no NCCL), or holding dumps
            if not in_torchrun():
                traces.rmdir()


def _key(override: str) -> str:
    """The dotted key of `--section.key=value`."""
    return override.lstrip("-").partition("=")[0]


def eval_command(argv: list[str]) -> int:
    from tetrad import launch
    from tetrad.train.trainer import Trainer

    ap = argparse.ArgumentParser(prog="tetrad eval", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("weights", type=Path, help="a tetrad checkpoint, a run folder, or a Hugging Face model folder")
    ap.add_argument("--json", action="store_true", help="print one JSON object: val_loss, perplexity, by source")
    args, rest = ap.parse_known_args(argv)
    path, overrides = split_config_args(rest)
    with tempfile.TemporaryDirectory(prefix="tetrad-eval-") as run_dir, kept_traces(trace_dir()) as traces:
        try:
            cfg = eval_config(path, overrides, args.weights, run_dir)
            result = launch.train(cfg, work=Trainer.evaluate, forward_only=True, trace_dir=traces)
        except ConfigError as e:  # the checks name checkpoint.init_from, which eval set itself from WEIGHTS
            raise ConfigError(str(e).replace(f"checkpoint.init_from={str(args.weights)!r}",
                                             f"{str(args.weights)!r} (WEIGHTS)")) from None
    if not launch.speaks_for_the_job():
        return 0
    result["perplexity"] = math.exp(result["val_loss"]) if result["val_loss"] < 709 else math.inf  # exp's overflow
    if args.json:
        print(json.dumps(result))
        return 0
    d = cfg.data
    held_out = f"the last {d.val_fraction:g} of {d.source}" if d.val_fraction else d.val_source
    by_source = "".join(f"; {name}: {loss:.4f}" for name, loss in result.get("val_loss_by_source", {}).items())
    print(f"tetrad eval: val_loss {result['val_loss']:.4f} (perplexity {result['perplexity']:.2f}) of {args.weights} "
          f"on {held_out}, at most {counted(cfg.train.eval_steps, 'batch', 'batches')} of {cfg.train.global_batch} x "
          f"{cfg.model.seq_len} tokens{by_source}")
    return 0
