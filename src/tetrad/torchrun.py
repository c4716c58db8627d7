"""`tetrad torchrun ...`: torchrun itself (torch.distributed.run, in this process, every option as
torchrun takes it: replace `torchrun` with `tetrad torchrun`), with two things torchrun cannot do.

- `-m tetrad train ...` (or `--no-python tetrad train ...`) is checked here before any worker
  starts, as each rank would check it (the config, the world size nnodes x nproc-per-node where
  nnodes is not a range, the device, the data and the storage): a mistake is one line and exit 2, and `--max-restarts N` does not start
  the job N + 1 times to meet it again. torchrun restarts the workers after any non-zero exit while
  restarts remain, and its elastic agent gives a worker no way to say "do not restart"
  (torch/distributed/elastic/agent/server/api.py, `_invoke_run`); only exit 0, which tells the
  scheduler the job succeeded, ends it. So only the launching process can refuse without restarts.
- A failed job ends with one line naming the first rank that failed and why (its refusal, its
  exception or its signal), not torchrun's ChildFailedError traceback of this process; the
  ranks' own output (the refusal said once, a crash's traceback) comes before it, as under torchrun.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import replace


def torchrun_command(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run
    parser = get_args_parser()
    parser.prog = "tetrad torchrun"  # not __main__.py in its usage and errors
    args = parser.parse_args(argv)
    if _runs_tetrad(args) and args.training_script_args[:1] == ["train"]:
        _check_before_spawn(args, args.training_script_args[1:])
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = first_failure(e.failures)
        print(f"tetrad torchrun: {_root_cause(rank, failure)}", file=sys.stderr)
        return failure.exitcode if failure.exitcode > 0 else 128 - failure.exitcode
    except SignalException as e:  # torchrun's agent stopped its workers on this signal
        print(f"tetrad torchrun: stopped by {signal.Signals(e.sigval).name}, forwarded to this node's ranks", file=sys.stderr)
        return 128 + e.sigval
    return 0


def _runs_tetrad(args) -> bool:
    """Whether the workers run tetrad's command line: `-m tetrad`, or `--no-python tetrad` (the
    console script, by name or path)."""
    if args.module:
        return args.training_script == "tetrad"
    return args.no_python and os.path.basename(args.training_script) == "tetrad"


def _check_before_spawn(args, train_args: list[str]) -> None:
    """What every rank of `tetrad train train_args` checks first (launch.train), against the job
    torchrun is about to start: a ConfigError here, and no worker starts."""
    from torch.distributed.run import determine_local_world_size, parse_min_max_nnodes

    from tetrad import device as devices
    from tetrad.config import load_config, split_config_args, validate
    from tetrad.train.inputs import model_keys
    from tetrad.train.preflight import preflight
    if {"-h", "--help"} & set(train_args):
        return
    path, overrides = split_config_args(train_args)
    cfg = load_config(path, overrides, model_from_inputs=model_keys)
    per_node = determine_local_world_size(args.nproc_per_node)
    cfg = replace(cfg, parallel=replace(cfg.parallel, ranks_per_node=per_node))  # LOCAL_WORLD_SIZE, as a rank's
    min_nodes, max_nodes = parse_min_max_nnodes(args.nnodes)
    if min_nodes == max_nodes:  # an elastic range: the world size is known at the rendezvous alone
        validate(cfg, min_nodes * per_node)
    preflight(cfg, devices.resolve_device_type(cfg.train.device))


def first_failure(failures: dict) -> tuple:
    """(rank, ProcessFailure) of the rank that failed first, torchrun's choice (the earliest
    timestamp: the error file's, else when the agent saw the exit, to the second), leaving aside
    the ranks that ended on SIGTERM while another failed otherwise: the agent stops a failed job's
    other ranks with it, and a rank stopped that way has its error file's time, which can be the
    earlier one (every rank of a refusal writes it; seen under load: 'rank 1 died by SIGTERM' where
    rank 0 refused and exited with 2)."""
    own = {rank: f for rank, f in failures.items() if f.exitcode != -signal.SIGTERM}
    return min((own or failures).items(), key=lambda item: (item[1].timestamp, item[0]))


def _root_cause(rank: int, failure) -> str:
    """One line for torchrun's first failure (a ProcessFailure): what the rank wrote to its error
    file (tetrad's refusal line, or `@record`'s "Type: message"), else its signal or exit code."""
    if failure.exitcode < 0:
        return f"rank {rank} (pid {failure.pid}) died by {failure.signal_name()}; the job was stopped"
    message = failure.message.get("message", "") if isinstance(failure.message, dict) else failure.message
    lines = str(message).strip().splitlines() if failure.error_file != "<N/A>" else []  # none: torch's filler text
    why = f": {lines[0]}" if lines else " (it wrote no error file: its output above says why)"
    return f"rank {rank} exited with code {failure.exitcode}, the first to fail; the job was stopped{why}"
