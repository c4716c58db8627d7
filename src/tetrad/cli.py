"""`tetrad` command line: data, train, generate, estimate, plan, schedule, bench, report, convert."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

from tetrad.config import ConfigError, check_override, load_config, validate_device

USAGE = """usage: tetrad COMMAND [ARGS]

commands:
  data TEXT... --out DIR [--vocab-size N | --tokenizer F]   BPE tokenizer + token shards for data.source
  train [CONFIG] [--section.key=value ...]   train (spawns local ranks, or runs under torchrun)
  estimate CONFIG --cluster C [--json]        the cost model for one layout
  plan --model M --cluster C --global-batch N rank every legal layout by predicted step time
  generate CHECKPOINT --prompt TEXT          sample text (KV cache, the run's tokenizer) on one process
  convert SRC --to-hf OUT | --to-tetrad CKPT  tetrad checkpoint <-> HF safetensors (LlamaForCausalLM)
  bench [comm|gemm] [--out DIR]               measure matmul and collective rates; write a hardware profile
  schedule --pp P --microbatches M --schedule S [--vpp V] [--out x.png]   simulate and draw a pipeline schedule
  report RUN_DIR [--cluster C]                loss, step-time breakdown, comm bytes, timelines as HTML + PNGs
"""


def _split_config_args(argv: list[str]) -> tuple[str | None, list[str]]:
    """CONFIG is the one argument that is not a --section.key=value override."""
    for i, arg in enumerate(argv):
        if arg.startswith("-"):
            check_override(arg, argv[i + 1] if i + 1 < len(argv) else None)
    paths = [a for a in argv if not a.startswith("-")]
    if len(paths) > 1:
        raise ConfigError(f"expected at most one CONFIG file, got {paths}")
    return (paths[0] if paths else None), [a for a in argv if a.startswith("-")]


def train_command(argv: list[str]) -> int:
    from tetrad import device as devices
    from tetrad import launch
    from tetrad.data.checks import check_data
    from tetrad.parallel.pipeline.registry import check_config as check_pipeline
    from tetrad.train.batches import describe as describe_data
    from tetrad.train.checkpoint.preflight import check_storage
    from tetrad.train.init_from import check_init_from, model_keys
    from tetrad.train.trainer import train_on_this_rank

    if {"-h", "--help"} & set(argv):
        print("usage: tetrad train [CONFIG] [--section.key=value ...]\n"
              "Without CONFIG the defaults apply: the tiny preset on the built-in corpus, one process.")
        return 0
    path, overrides = _split_config_args(argv)
    cfg = load_config(path, overrides + launch.torchrun_overrides(), world_size=launch.torchrun_world_size(),
                      model_from_inputs=model_keys)
    device_type = devices.resolve_device_type(cfg.train.device)
    devices.configure_allocator(device_type)  # before anything starts CUDA's allocator
    check_pipeline(cfg)
    validate_device(cfg, device_type)
    check_init_from(cfg)
    check_data(cfg)
    resuming = check_storage(cfg)
    p = cfg.parallel
    launch.diagnose_nccl(device_type, Path(cfg.run.dir) / "nccl_trace")
    if launch.in_torchrun():
        with launch.torchrun_process_group(device_type, p.startup_timeout_s):
            train_on_this_rank(cfg, device_type)
        return 0
    if device_type != "cpu" and p.world_size > devices.local_device_count(device_type):
        raise ConfigError(f"dp*tp*pp*cp = {p.world_size} ranks but this machine has "
                          f"{devices.local_device_count(device_type)} {device_type} devices; use torchrun across "
                          "nodes, or a smaller layout")
    m = cfg.model  # under init_from the weights decide the shape, whatever the preset says
    model = m.preset
    if cfg.checkpoint.init_from:
        model = (f"the {m.n_layers}-layer, d_model {m.d_model} model "
                 f"{'fine-tuned from' if resuming else 'of'} {cfg.checkpoint.init_from}")
    print(f"tetrad: training {model} with dp={p.dp} tp={p.tp} pp={p.pp} cp={p.cp} "
          f"({p.world_size} rank{'s' if p.world_size > 1 else ''} on {device_type}), "
          f"{cfg.train.steps} steps, run dir {cfg.run.dir}", flush=True)
    print(describe_data(cfg), flush=True)
    if cfg.train.warmup > cfg.train.steps:
        print(f"tetrad: note: train.warmup={cfg.train.warmup} > train.steps={cfg.train.steps}: the learning rate "
              f"never reaches train.lr={cfg.train.lr:g}", flush=True)
    history = launch.run_local(train_on_this_rank, p.world_size, (cfg, device_type), device_type=device_type,
                               pg_timeout_s=p.startup_timeout_s)[0]
    if history:
        evaluated = [r for r in history if "val_loss" in r]
        val = f", val_loss {evaluated[-1]['val_loss']:.4f} at step {evaluated[-1]['step']}" if evaluated else ""
        print(f"tetrad: loss {history[0]['loss']:.4f} at step {history[0]['step']} -> {history[-1]['loss']:.4f} at step "
              f"{history[-1]['step']}{val}; metrics in {cfg.run.dir}/metrics.jsonl")
    return 1 if history and history[-1].get("diverged") else 0  # a job scheduler sees the stop


def estimate_command(argv: list[str]) -> int:
    from tetrad.plan.cli import estimate_command as run
    return run(argv)


def plan_command(argv: list[str]) -> int:
    from tetrad.plan.cli import plan_command as run
    return run(argv)


def convert_command(argv: list[str]) -> int:
    from tetrad.train.convert import convert_command as run
    return run(argv)


def data_command(argv: list[str]) -> int:
    from tetrad.data.prepare import data_command as run
    return run(argv)


def generate_command(argv: list[str]) -> int:
    from tetrad.train.generate import generate_command as run
    return run(argv)


def bench_command(argv: list[str]) -> int:
    from tetrad.bench import bench_command as run
    return run(argv)


def schedule_command(argv: list[str]) -> int:
    from tetrad.viz.timeline import schedule_command as run
    return run(argv)


def report_command(argv: list[str]) -> int:
    from tetrad.viz.report import report_command as run
    return run(argv)


COMMANDS = {"data": data_command, "train": train_command, "schedule": schedule_command, "estimate": estimate_command, "plan": plan_command, "convert": convert_command,
            "generate": generate_command,
            "bench": bench_command, "report": report_command}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(USAGE, file=sys.stderr if argv and argv[0] not in ("-h", "--help") else sys.stdout)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except ConfigError as e:
        print(f"tetrad: config error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:
        from tetrad.launch import Stopped
        signum = e.signum if isinstance(e, Stopped) else 2
        print(f"tetrad: stopped by {signal.Signals(signum).name}; every rank was stopped", file=sys.stderr)
        return 128 + signum
    except RuntimeError as e:
        from tetrad.launch import RankFailure
        if isinstance(e, RankFailure):
            print(f"tetrad: {e}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
