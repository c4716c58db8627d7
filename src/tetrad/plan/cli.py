"""`tetrad estimate` and `tetrad plan`: the cost model for one layout, and the ranking of all.

Exit codes: 0 the layout (the plan's winner) fits; 1 it does not fit in memory (the estimate is
still printed, with its per-part breakdown); 2 bad input (unknown GPU, cluster or config key, or
a global batch no layout of the model on those GPUs can split), or a --write whose run folder
holds an earlier run's checkpoints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from pathlib import Path
from typing import Callable

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from tetrad.config import Config, ConfigError, load_config
from tetrad.config.arguments import whole_number
from tetrad.config.checkpoints import complete
from tetrad.parallel.pipeline.registry import check_config
from tetrad.plan.cost import Estimate, estimate
from tetrad.plan.hardware import Cluster, HardwareError, load_cluster, offload_unknown
from tetrad.plan.plot import plan_figure
from tetrad.plan.recipe import sized_training
from tetrad.plan.search import plan
from tetrad.plan.stacks import STACKS
from tetrad.plan.text import describe, plan_text, ramp_lines, why_no_layout, why_nothing_fits


def _cluster(ref: str, gpus: int | None) -> Cluster:
    cluster = load_cluster(ref)
    if gpus is not None:
        if gpus > cluster.world:
            raise HardwareError(f"--gpus {gpus} is more than the cluster's {cluster.world} GPUs")
        if gpus % cluster.gpus_per_node and gpus > cluster.gpus_per_node:
            raise HardwareError(f"--gpus {gpus} is not a whole number of {cluster.gpus_per_node}-GPU nodes")
        per_node = min(gpus, cluster.gpus_per_node)
        cluster = dataclasses.replace(cluster, gpus_per_node=per_node, nodes=gpus // per_node)
    return cluster


def estimate_command(argv: list[str], model_from_inputs: Callable[[dict], dict] | None = None) -> int:
    """`model_from_inputs` (load_config's): the [model] keys the config's data and init_from weights
    decide, as `tetrad train` takes them, so that the model estimated is the one it would train."""
    ap = argparse.ArgumentParser(prog="tetrad estimate", description="The cost model for one layout.",
                                 epilog="Any --section.key=value overrides the config.")
    ap.add_argument("config", nargs="?", help="a config TOML (default: the built-in defaults)")
    ap.add_argument("--cluster", required=True, help="a built-in cluster name or a cluster TOML file")
    ap.add_argument("--stack", default="tetrad", choices=list(STACKS), help="software stack to model")
    ap.add_argument("--json", action="store_true", help="print the JSON object of the contract")
    args, overrides = ap.parse_known_args(argv)
    try:
        cfg = _weights_exist(load_config(args.config, overrides, runtime=False, model_from_inputs=model_from_inputs))
        check_config(cfg)
        cluster = load_cluster(args.cluster)
    except (ConfigError, HardwareError) as e:
        print(f"tetrad estimate: {e}", file=sys.stderr)
        return 2
    if cfg.parallel.world_size > cluster.world:
        print(f"tetrad estimate: the layout needs {cfg.parallel.world_size} GPUs, the cluster has {cluster.world}",
              file=sys.stderr)
        return 2
    try:
        est = estimate(cfg, cluster, args.stack)
    except HardwareError as e:  # offload where the profile cannot cost it
        print(f"tetrad estimate: {e}", file=sys.stderr)
        return 2
    print(json.dumps(est.to_json(), indent=2) if args.json else "\n".join([describe(est),
                                                                            *ramp_lines(est, cluster, args.stack)]))
    return 0 if est.fits else 1


def _weights_exist(cfg: Config) -> Config:
    """The model is the shape of checkpoint.init_from's weights: a path that is not there would
    cost the preset's model instead, without a word."""
    source = cfg.checkpoint.init_from
    if source and not Path(source).exists():
        raise ConfigError(f"checkpoint.init_from={source!r} does not exist; name a tetrad checkpoint or an HF folder "
                          "(the model costed is the shape of its weights)")
    return cfg


def _base_config(args, overrides: list[str], model_from_inputs: Callable[[dict], dict] | None) -> Config:
    """The model and training settings to plan for: a preset or a config file, then the flags and
    overrides. The layout in it is irrelevant (the plan chooses one), so it starts at micro_batch=1."""
    path = args.config or (args.model if args.model.endswith(".toml") else None)
    flags = ["train.micro_batch=1"] + ([] if path else [f"model.preset={args.model}"])
    flags += [f"train.global_batch={args.global_batch}"] if args.global_batch is not None else []
    flags += [f"model.seq_len={args.seq_len}"] if args.seq_len is not None else []
    if args.dtype or "train.dtype" not in _user_keys(args, overrides):  # bf16: what clusters run
        flags += [f"train.dtype={args.dtype or 'bf16'}"]
    cfg = _weights_exist(load_config(path, flags + overrides, runtime=False, model_from_inputs=model_from_inputs))
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=1, tp=1, pp=1, cp=1, ep=1, vpp=1,
                                                                 schedule="1f1b"))


def plan_command(argv: list[str], model_from_inputs: Callable[[dict], dict] | None = None) -> int:
    """`model_from_inputs` as estimate_command's."""
    ap = argparse.ArgumentParser(prog="tetrad plan", description="Rank every legal layout by predicted step time.",
                                 epilog="Any --section.key=value overrides the model or training settings.")
    ap.add_argument("config", nargs="?", help="a config TOML whose model and training settings to plan for")
    ap.add_argument("--model", default="tiny", help="a preset name or a config TOML (default: tiny)")
    ap.add_argument("--cluster", required=True, help="a built-in cluster name or a cluster TOML file")
    ap.add_argument("--gpus", type=whole_number, help="plan for this many of the cluster's GPUs (default: all)")
    ap.add_argument("--global-batch", type=int, help="sequences per optimizer step (default: the config's "
                    "train.global_batch, 16 unless it sets one)")
    ap.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's seq_len)")
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16", "fp8"],
                    help="training precision (default: the config's train.dtype if it sets one, else bf16)")
    ap.add_argument("--stack", default="tetrad", choices=list(STACKS), help="software stack to model")
    ap.add_argument("--top", type=whole_number, default=10, help="how many layouts to rank (default: 10)")
    ap.add_argument("--json", action="store_true", help="print the ranked estimates as a JSON list")
    ap.add_argument("--out", "--write", dest="out", help="write the best layout as a runnable config TOML")
    ap.add_argument("--plot", help="draw step time vs memory per GPU of the candidates to this PNG")
    args, overrides = ap.parse_known_args(argv)
    try:
        base = _base_config(args, overrides, model_from_inputs)
        cluster = _cluster(args.cluster, args.gpus)
        if base.train.offload_optimizer and offload_unknown(cluster):
            raise HardwareError(offload_unknown(cluster))
    except (ConfigError, HardwareError) as e:
        print(f"tetrad plan: {e}", file=sys.stderr)
        return 2
    base = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, ranks_per_node=cluster.gpus_per_node))
    # Offload, and the head's loss in chunks, where only they fit, unless the user set them (then as set).
    user = _user_keys(args, overrides)
    result = plan(base, cluster, args.top, args.stack, offload="train.offload_optimizer" not in user,
                  chunk_loss="train.loss_chunk_tokens" not in user)
    if not result.considered:  # the global batch does not split over these GPUs: bad input
        print(f"tetrad plan: {why_no_layout(base, cluster)}", file=sys.stderr)
        return 2
    best = result.ranked[0] if result.ranked and result.ranked[0].fits else None
    print(json.dumps([e.to_json() for e in result.ranked], indent=2) if args.json else plan_text(result, base, cluster))
    if best is None and result.ranked and args.json:
        print(f"tetrad plan: {why_nothing_fits(result.ranked[0], cluster)}", file=sys.stderr)
    if args.out and best is not None:
        try:
            _write(best, args, overrides, sys.stderr if args.json else sys.stdout)
        except ConfigError as e:
            print(f"tetrad plan: {e}", file=sys.stderr)
            return 2
    if args.plot:
        m = base.model
        title = (f"tetrad plan: {m.preset} on {cluster.world} x {cluster.gpu.name}, global batch "
                 f"{base.train.global_batch} x {m.seq_len}, {base.train.dtype}")
        plan_figure(result, cluster, title).savefig(args.plot, dpi=150)
    return 0 if best is not None else 1


def _user_keys(args, overrides: list[str]) -> set[str]:
    """The "section.key"s the user set: in the config file, as overrides, or by a flag."""
    keys = _flagged(overrides)
    keys |= {"train.global_batch"} if args.global_batch is not None else set()
    path = args.config or (args.model if args.model.endswith(".toml") else None)
    if path:
        raw = tomllib.loads(Path(path).read_text())
        keys |= {f"{section}.{key}" for section, table in raw.items() if isinstance(table, dict) for key in table}
    return keys


def _flagged(overrides: list[str]) -> set[str]:
    """The "section.key"s of `--section.key=value` flags."""
    return {item.lstrip("-").split("=", 1)[0] for item in overrides}


def _own_folders(cfg: Config, flagged: set[str]) -> tuple[Config, list[str]]:
    """`cfg` with run.dir (and a checkpoint.dir the config set) in a folder of the layout's own,
    RUN_DIR-dpD-tpT-ppP-cpC (-epE under expert parallelism), unless set by a flag (`flagged`): the config planned for is often a run's
    own, and the written one, run, would write its metrics and checkpoints into that run's folder,
    then resume its checkpoints (a plan of a written config replaces its tag). A checkpoint.dir inside
    run.dir moves with it: left in the old run's folder, deleting that run would delete the new one's
    checkpoints. One note each."""
    p = cfg.parallel
    tag = f"-dp{p.dp}-tp{p.tp}-pp{p.pp}-cp{p.cp}" + (f"-ep{p.ep}" if p.ep > 1 else "")
    run, ckpt = cfg.run.dir, cfg.checkpoint.dir
    new_run = _tagged(run, tag) if run and "run.dir" not in flagged else run
    new_ckpt = ckpt
    if ckpt and "checkpoint.dir" not in flagged:
        inside = run and Path(ckpt).is_relative_to(run)
        new_ckpt = str(Path(new_run) / Path(ckpt).relative_to(run)) if inside else _tagged(ckpt, tag)
    notes = [f"{key} = {new!r}: the layout's own folder, apart from {old!r}'s run (--{key}=... chooses another)"
             for key, old, new in (("run.dir", run, new_run), ("checkpoint.dir", ckpt, new_ckpt)) if new != old]
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, dir=new_run),
                               checkpoint=dataclasses.replace(cfg.checkpoint, dir=new_ckpt)), notes


def _refuse_trained(cfg: Config, flagged: set[str]) -> None:
    """A ConfigError where the checkpoint folder the written config would train in (chosen here,
    not by a flag: a checkpoint.dir inside run.dir is --run.dir's) already holds a complete
    checkpoint (`complete`, the rule `tetrad train` resumes by): the layout's folder of an earlier
    plan, trained since. There `tetrad train` resumes it (checkpoint.resume = "auto") or refuses to
    start over it, so the written config would not start the run planned."""
    ckpt, run = cfg.checkpoint.dir, cfg.run.dir
    root = Path(ckpt or Path(run) / "checkpoints")
    follows_run = not ckpt or bool(run) and Path(ckpt).is_relative_to(run)  # moved with run.dir (_own_folders)
    if "checkpoint.dir" in flagged or ("run.dir" in flagged and follows_run) or not complete(root):
        return
    key, folder = ("checkpoint.dir", cfg.checkpoint.dir) if cfg.checkpoint.dir else ("run.dir", cfg.run.dir)
    resume = cfg.checkpoint.resume
    # as train/checkpoint/preflight.py: "never" refuses a root holding checkpoints, a path one
    # holding checkpoints later than the path's (recovery.refuse_later)
    older = "" if resume == "never" else " from an older checkpoint"
    does, also = ("would resume", "") if resume == "auto" else (
        f"refuses to train over{older} (checkpoint.resume = {resume!r})", " --checkpoint.resume=auto")
    raise ConfigError(f"{key} = {folder!r}, the layout's own folder, already holds checkpoints of a run "
                      f"({complete(root)[0]}), which `tetrad train` {does}; give the plan --{key}=NEW for a "
                      f"fresh run, or --{key}={folder}{also} to resume it")


def _tagged(folder: str, tag: str) -> str:
    """`folder` with the layout's `tag` in place of one a plan gave it before."""
    return re.sub(r"-dp\d+-tp\d+-pp\d+-cp\d+(-ep\d+)?$", "", folder.rstrip("/")) + tag


def _write(best: Estimate, args, overrides: list[str], out) -> None:
    """Write the best layout as a config, with training settings sized to the model where the user
    set none, each stated in the file's header and printed; a ConfigError (nothing written) where
    its folder holds an earlier run's checkpoints."""
    cfg, notes = sized_training(best.cfg, _user_keys(args, overrides), best.step_time_s)
    cfg, moved = _own_folders(cfg, _flagged(overrides))
    _refuse_trained(cfg, _flagged(overrides))
    notes += moved
    header = [f"# Written by tetrad plan: {best.step_time_s:.3g} s per step predicted, MFU {100 * best.mfu:.1f}%, "
              f"{best.peak_memory_gib:.1f} GiB per GPU."]
    if notes:
        header += ["# Set for the model's size and the layout (where the plan's inputs did not):"] + [f"#   {n}" for n in notes]
    if cfg.train.dtype == "fp8":
        header.append("# train.dtype='fp8' is for estimates only: set bf16 to train it")
    Path(args.out).write_text("\n".join(header) + "\n\n" + cfg.to_toml())
    print(f"wrote the best layout to {args.out}", file=out)
    for line in header[1:]:
        print(line.lstrip("# "), file=out)
