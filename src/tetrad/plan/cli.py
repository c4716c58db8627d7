"""`tetrad estimate` and `tetrad plan`: the cost model for one layout, and the ranking of all.

Exit codes: 0 the layout (the plan's winner) fits; 1 it does not fit in memory (the estimate is
still printed, with its per-part breakdown); 2 bad input (unknown GPU, cluster or config key).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from tetrad.config import Config, ConfigError, load_config
from tetrad.parallel.pipeline.registry import check_config
from tetrad.plan.cost import Estimate, estimate
from tetrad.plan.hardware import Cluster, HardwareError, load_cluster
from tetrad.plan.reference import CALIBRATION_MAPE
from tetrad.plan.search import Plan, plan
from tetrad.plan.stacks import STACKS


def _layout(e: Estimate) -> str:
    p, t = e.cfg.parallel, e.cfg.train
    cp = f" cp={p.cp}{'' if p.cp == 1 else '/' + p.cp_algo}"
    sched = p.schedule + (f" vpp={p.vpp}" if p.vpp > 1 else "")
    return (f"tp={p.tp} pp={p.pp}{cp} dp={p.dp} zero={p.zero} {sched} mb={t.micro_batch} "
            f"recompute={t.recompute}")


def _row(e: Estimate) -> str:
    b = e.breakdown
    comm = sum(v for k, v in b.items() if k.endswith("_comm")) / e.step_time_s
    fit = "" if e.fits else "  DOES NOT FIT"
    return (f"{_layout(e):<64} {e.step_time_s:9.3f} s {e.tokens_per_s / e.cfg.parallel.world_size:9,.0f} "
            f"{100 * e.mfu:5.1f}% {e.peak_memory_gib:7.1f} GiB  bubble {100 * e.bubble_fraction:4.1f}%  "
            f"comm {100 * comm:4.1f}%{fit}")


HEADER = f"{'layout':<64} {'step':>11} {'tok/s/GPU':>9} {'MFU':>6} {'memory':>11}"


def describe(e: Estimate) -> str:
    """The readable report of one estimate: time, memory and utilisation broken down."""
    lines = [_layout(e), "",
             f"  step time      {e.step_time_s:.4f} s    tokens/s {e.tokens_per_s:,.0f} "
             f"({e.tokens_per_s / e.cfg.parallel.world_size:,.0f} per GPU)",
             f"  MFU / HFU      {100 * e.mfu:.1f}% / {100 * e.hfu:.1f}%    model TFLOP/s per GPU "
             f"{e.model_tflops_per_gpu:.1f}",
             f"  bubble         {100 * e.bubble_fraction:.1f}% of pipeline rank-time", "",
             "  time per step, busiest pipeline rank (exposed parts only):"]
    lines += [f"    {k:<18} {v:10.4f} s  {100 * v / e.step_time_s:5.1f}%" for k, v in e.breakdown.items()]
    verdict = "fits" if e.fits else "DOES NOT FIT"
    lines += ["", f"  memory per GPU, worst pipeline rank: {e.peak_memory_gib:.2f} GiB of {e.usable_gib:.1f} usable "
                  f"({e.hbm_gib:.1f} GiB) -> {verdict}"]
    lines += [f"    {k:<12} {v:9.2f} GiB" for k, v in e.memory.gib().items()]
    if not e.fits:
        lines.append("  to fit: more recompute, a higher ZeRO stage, a smaller micro-batch, or more tp/pp "
                     "(`tetrad plan` ranks the layouts that fit)")
    return "\n".join(lines)


def _cluster(ref: str, gpus: int | None) -> Cluster:
    cluster = load_cluster(ref)
    if gpus:
        if gpus % cluster.gpus_per_node and gpus > cluster.gpus_per_node:
            raise HardwareError(f"--gpus {gpus} is not a whole number of {cluster.gpus_per_node}-GPU nodes")
        per_node = min(gpus, cluster.gpus_per_node)
        cluster = dataclasses.replace(cluster, gpus_per_node=per_node, nodes=gpus // per_node)
    return cluster


def estimate_command(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tetrad estimate", description="The cost model for one layout.",
                                 epilog="Any --section.key=value overrides the config.")
    ap.add_argument("config", nargs="?", help="a config TOML (default: the built-in defaults)")
    ap.add_argument("--cluster", required=True, help="a built-in cluster name or a cluster TOML file")
    ap.add_argument("--stack", default="tetrad", choices=list(STACKS), help="software stack to model")
    ap.add_argument("--json", action="store_true", help="print the JSON object of the contract")
    args, overrides = ap.parse_known_args(argv)
    try:
        cfg = load_config(args.config, overrides, runtime=False)
        check_config(cfg)
        cluster = load_cluster(args.cluster)
    except (ConfigError, HardwareError) as e:
        print(f"tetrad estimate: {e}", file=sys.stderr)
        return 2
    if cfg.parallel.world_size > cluster.world:
        print(f"tetrad estimate: the layout needs {cfg.parallel.world_size} GPUs, the cluster has {cluster.world}",
              file=sys.stderr)
        return 2
    est = estimate(cfg, cluster, args.stack)
    print(json.dumps(est.to_json(), indent=2) if args.json else describe(est))
    return 0 if est.fits else 1


def _base_config(args, overrides: list[str]) -> Config:
    """The model and training settings to plan for: a preset or a config file, then the flags and
    overrides. The layout in it is irrelevant (the plan chooses one), so it starts at micro_batch=1."""
    path = args.config or (args.model if args.model.endswith(".toml") else None)
    flags = ["train.micro_batch=1"] + ([] if path else [f"model.preset={args.model}"])
    flags += [f"train.global_batch={args.global_batch}"] if args.global_batch else []
    flags += [f"model.seq_len={args.seq_len}"] if args.seq_len else []
    flags += [f"train.dtype={args.dtype}"] if args.dtype else []
    cfg = load_config(path, flags + overrides, runtime=False)
    return dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, dp=1, tp=1, pp=1, cp=1, vpp=1,
                                                                 schedule="1f1b"))


def plan_command(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tetrad plan", description="Rank every legal layout by predicted step time.",
                                 epilog="Any --section.key=value overrides the model or training settings.")
    ap.add_argument("config", nargs="?", help="a config TOML whose model and training settings to plan for")
    ap.add_argument("--model", default="tiny", help="a preset name or a config TOML (default: tiny)")
    ap.add_argument("--cluster", required=True, help="a built-in cluster name or a cluster TOML file")
    ap.add_argument("--gpus", type=int, help="plan for this many of the cluster's GPUs (default: all)")
    ap.add_argument("--global-batch", type=int, help="sequences per optimizer step")
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--dtype", choices=["fp32", "bf16", "fp16", "fp8"])
    ap.add_argument("--stack", default="tetrad", choices=list(STACKS), help="software stack to model")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", action="store_true", help="print the ranked estimates as a JSON list")
    ap.add_argument("--out", "--write", dest="out", help="write the best layout as a runnable config TOML")
    ap.add_argument("--plot", help="draw step time vs memory per GPU of the candidates to this PNG")
    args, overrides = ap.parse_known_args(argv)
    try:
        base = _base_config(args, overrides)
        cluster = _cluster(args.cluster, args.gpus)
    except (ConfigError, HardwareError) as e:
        print(f"tetrad plan: {e}", file=sys.stderr)
        return 2
    base = dataclasses.replace(base, parallel=dataclasses.replace(base.parallel, ranks_per_node=cluster.gpus_per_node))
    result = plan(base, cluster, args.top, args.stack)
    if args.json:
        print(json.dumps([e.to_json() for e in result.ranked], indent=2))
    else:
        print(_plan_text(result, base, cluster))
    best = result.ranked[0] if result.ranked else None
    if args.out and best is not None and best.fits:
        Path(args.out).write_text(best.cfg.to_toml())
        fp8 = best.cfg.train.dtype == "fp8"
        note = " (train.dtype='fp8' is for estimates only: set bf16 to train it)" if fp8 else ""
        print(f"wrote the best layout to {args.out}{note}", file=sys.stderr if args.json else sys.stdout)
    if args.plot:
        _plot(result, cluster, args.plot)
    return 0 if best is not None and best.fits else 1


def _plan_text(result: Plan, base: Config, cluster: Cluster) -> str:
    m = base.model
    lines = [f"{cluster.world} x {cluster.gpu.name} ({cluster.gpus_per_node} per node), {m.preset}: {m.n_layers} "
             f"layers, d_model {m.d_model}; global batch {base.train.global_batch} x {m.seq_len} tokens, "
             f"{base.train.dtype}", f"{result.considered} legal layouts, {result.estimated} estimated in full", ""]
    if not result.ranked or not result.ranked[0].fits:
        lines.append("NO LAYOUT FITS IN MEMORY. The closest:")
    lines += [HEADER] + [_row(e) for e in result.ranked]
    if result.ranked:
        lines += ["", _confidence(result.ranked), "", "why the best wins:", describe(result.ranked[0])]
    if result.rejected:
        lines += ["", "faster on compute alone, but out of memory:"]
        lines += [f"  {_layout(e)}: {e.peak_memory_gib:.1f} GiB > {e.usable_gib:.1f} usable "
                  f"(activations {e.memory.gib()['activations']:.1f}, model states "
                  f"{sum(e.memory.gib()[k] for k in ('weights', 'grads', 'optimizer')):.1f})" for e in result.rejected]
    return "\n".join(lines)


def _confidence(ranked: list[Estimate]) -> str:
    """Each layout's step time with the spread the calibration error implies, and which layouts
    the model cannot tell from the best (their spreads overlap)."""
    err = CALIBRATION_MAPE
    best = ranked[0].step_time_s
    lines = [f"predicted step time +- {100 * err:.1f}% (the model's mean error on the published runs it was "
             f"checked against, docs/planner.md):"]
    lines += [f"  #{i + 1:<3}{e.step_time_s:9.3f} s  [{e.step_time_s * (1 - err):.3f}, {e.step_time_s * (1 + err):.3f}]"
              for i, e in enumerate(ranked)]
    close = [i + 1 for i, e in enumerate(ranked[1:], 1) if e.step_time_s * (1 - err) <= best * (1 + err)]
    if close:
        lines.append(f"  #{', #'.join(map(str, close))} within that spread of #1: the model cannot order them; "
                     "time the first steps of each")
    else:
        lines.append("  #1 is ahead of the others by more than that spread")
    return "\n".join(lines)


def _plot(result: Plan, cluster: Cluster, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(8, 5))
    for exact, colour, label in ((False, "#bbbbbb", "lower bound (pruned)"), (True, "#1f77b4", "estimated")):
        pts = [(m, t) for m, t, x in result.points if x == exact]
        if pts:
            ax.scatter(*zip(*pts), s=8, c=colour, label=label)
    if result.ranked:
        best = result.ranked[0]
        ax.scatter([best.peak_memory_gib], [best.step_time_s], s=120, marker="*", c="#d62728", label="chosen")
    usable = result.ranked[0].usable_gib if result.ranked else cluster.gpu.hbm_gib
    ax.axvline(usable, color="#d62728", linestyle="--", linewidth=1, label="usable memory")
    ax.set_xlabel("peak memory per GPU (GiB)")
    ax.set_ylabel("step time (s)")
    ax.set_yscale("log")
    ax.set_title(f"tetrad plan: candidates on {cluster.world} x {cluster.gpu.name}")
    ax.legend(loc="best", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
