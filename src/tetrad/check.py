"""`tetrad check [CONFIG]`: does this layout compute the same training as plain data parallelism,
on this machine or cluster, with this model, data and precision?

tetrad's test suite holds every layout to one process on tiny models on CPUs; a user's layout
runs other kernels, another backend and other shapes. The check trains a few steps of the user's
config twice from the same seed, as `tetrad train` would: once in its own layout, once in the
simplest layout over the same ranks (data parallelism with ZeRO-3, every layer recomputed, the
head's loss in chunks, so it holds the fewest bytes a rank can; every rank runs every expert:
ep = 1; a layout with the loss unfused is so checked against the fused one too), then judges the two
runs as `tetrad compare` does (step 1's loss and gradient norm to the precision's rounding, later
steps' drift). Neither run keeps
a checkpoint or validates, and both run `train.global_batch` from the first step (a batch ramp-up
runs the same arithmetic on fewer samples); both write their metrics under RUN_DIR/check/.

A model too large for the reference can be checked shallower (`--model.n_layers=...`, both runs):
no layout's arithmetic depends on the depth.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import shutil
from dataclasses import replace
from pathlib import Path

from tetrad.config import Config, ConfigError, counted, load_config, split_config_args, validate
from tetrad.config.arguments import non_negative
from tetrad.plan.search import PLANNED_LOSS_CHUNK

CHECK_STEPS = 4


def check_runs(cfg: Config, steps: int, world_size: int | None) -> tuple[Config, Config]:
    """(the user's layout, the data-parallel reference), each a short run of `cfg` under
    RUN_DIR/check/. `world_size` is torchrun's job size (the reference must use every rank), None
    when tetrad starts the ranks itself (the reference then uses as many as divide the batch)."""
    p, t = cfg.parallel, cfg.train
    if p.grad_codec != "none":
        raise ConfigError(f"parallel.grad_codec={p.grad_codec!r} changes the gradients by design, so the layouts "
                          "cannot agree to rounding: check with --parallel.grad_codec=none")
    ranks = world_size or p.world_size
    dp = math.gcd(ranks, t.global_batch)  # the most ranks that split the batch evenly
    if world_size is not None and dp != world_size:
        raise ConfigError(f"the reference trains data-parallel over the job's {world_size} ranks, which needs "
                          f"train.global_batch ({t.global_batch}) to be a multiple of {world_size}")
    root = Path(cfg.run.dir) / "check"
    short = dict(steps=steps, eval_every=0, profile="", batch_rampup=[])  # a ramp's batches are the final one's
    checkpoint = replace(cfg.checkpoint, dir="", every=0, resume="never", async_save=False)
    run = replace(cfg.run, tensorboard=False, wandb=False)
    layout = replace(cfg, train=replace(t, **short), checkpoint=checkpoint, run=replace(run, dir=str(root / "layout")))
    reference = replace(
        layout, run=replace(run, dir=str(root / "reference")),
        train=replace(layout.train, recompute="full", micro_batch=math.gcd(t.micro_batch, t.global_batch // dp),
                      loss_chunk_tokens=t.loss_chunk_tokens or PLANNED_LOSS_CHUNK),
        parallel=replace(p, dp=dp, tp=1, pp=1, cp=1, ep=1, vpp=1, schedule="1f1b", stage_layers=[],
                         zero=3 if dp > 1 else 0, zero_shard=0, sequence_parallel=False, sp_regather=False,
                         hierarchical=False))
    validate(reference, world_size)
    return layout, reference


def check_command(argv: list[str]) -> int:
    from tetrad.train.inputs import model_keys

    ap = argparse.ArgumentParser(prog="tetrad check", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--steps", type=int, default=CHECK_STEPS, help="steps of each run (step 1 is judged to rounding)")
    ap.add_argument("--drift", type=non_negative, default=0.05, help="largest relative loss difference at a later step")
    args, rest = ap.parse_known_args(argv)
    if args.steps < 1:
        raise ConfigError(f"--steps={args.steps}: give at least 1")
    path, overrides = split_config_args(rest)
    cfg = load_config(path, overrides, model_from_inputs=model_keys)
    # after the config's checks: a refusal there needs no torch (start-up time)
    from tetrad import device as devices, launch
    from tetrad.train.metrics import layout_label
    from tetrad.viz.compare import compare
    torchrun = launch.in_torchrun()
    layout, reference = check_runs(cfg, args.steps, int(os.environ["WORLD_SIZE"]) if torchrun else None)
    first = not torchrun or os.environ["RANK"] == "0"
    if first:
        shutil.rmtree(Path(cfg.run.dir) / "check", ignore_errors=True)
    # Under torchrun both runs share one process group: a second rendezvous would meet the first's keys.
    # Joining it starts CUDA, so the allocator is configured first (launch.train's call would come too late).
    device_type = devices.resolve_device_type(cfg.train.device)
    devices.configure_allocator(device_type)
    joined = launch.torchrun_process_group(device_type, cfg.parallel.startup_timeout_s) if torchrun else contextlib.nullcontext()
    with joined:
        for name, run in (("the layout", layout), ("the reference", reference)):
            if first:
                print(f"tetrad check: {name}, {layout_label(run.parallel)}, {counted(args.steps, 'step')} in "
                      f"{run.run.dir}", flush=True)
            launch.train(run)
    if not first:
        return 0
    lines, agree = compare(Path(layout.run.dir), Path(reference.run.dir), args.drift)
    print("\n".join(lines))
    print(f"tetrad check: {layout_label(layout.parallel)} {'agrees with' if agree else 'DISAGREES with'} "
          f"{layout_label(reference.parallel)}")
    return 0 if agree else 1
