"""`tetrad estimate` and `tetrad plan`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from tetrad.config import load_config
from tetrad.plan.cost import Estimate, estimate
from tetrad.plan.hardware import load_cluster
from tetrad.plan.search import plan


def _row(e: Estimate) -> str:
    p = e.cfg.parallel
    layout = f"tp={p.tp} pp={p.pp} cp={p.cp} dp={p.dp} vpp={p.vpp} {p.schedule} zero={p.zero}"
    return (f"{layout:<44} mb={e.cfg.train.micro_batch:<2} rc={e.cfg.train.recompute:<9} "
            f"{e.step_time_s:9.3f} s  {100 * e.mfu:5.1f}%  {e.peak_memory_gib:7.1f} GiB  "
            f"bubble {100 * e.bubble_fraction:4.1f}%{'' if e.fits else '  DOES NOT FIT'}")


def _describe(e: Estimate) -> str:
    mem = e.memory.gib()
    lines = [_row(e), "",
             f"  step time      {e.step_time_s:.4f} s   tokens/s {e.tokens_per_s:,.0f}",
             f"  MFU / HFU      {100 * e.mfu:.1f}% / {100 * e.hfu:.1f}%   model TFLOP/s per GPU "
             f"{e.model_tflops_per_gpu:.1f}",
             f"  bubble         {100 * e.bubble_fraction:.1f}% of the pipeline time", "  time (s):"]
    lines += [f"    {k:<40} {v:.4g}" for k, v in e.breakdown.items()]
    lines.append(f"  memory per GPU (GiB), worst stage: {e.peak_memory_gib:.2f} of {e.hbm_gib:.0f}"
                 f"{'' if e.fits else '  -> DOES NOT FIT'}")
    lines += [f"    {k:<12} {v:8.2f}" for k, v in mem.items()]
    return "\n".join(lines)


def estimate_command(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tetrad estimate", description="The cost model for one layout.")
    ap.add_argument("config", nargs="?")
    ap.add_argument("--cluster", required=True, help="built-in cluster name or cluster TOML file")
    ap.add_argument("--json", action="store_true")
    args, overrides = ap.parse_known_args(argv)
    cfg = load_config(args.config, overrides, runtime=False)
    cluster = load_cluster(args.cluster)
    if cfg.parallel.world_size != cluster.world:
        print(f"tetrad: note: the layout uses {cfg.parallel.world_size} GPUs of the cluster's {cluster.world}",
              file=sys.stderr)
    est = estimate(cfg, cluster)
    print(json.dumps(est.to_json(), indent=2) if args.json else _describe(est))
    return 0


def plan_command(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tetrad plan", description="Rank every legal layout by predicted step time.")
    ap.add_argument("--model", default="tiny", help="a preset name or a config TOML")
    ap.add_argument("--cluster", required=True)
    ap.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    ap.add_argument("--seq-len", type=int)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--out", help="write the best layout as a runnable config")
    args, overrides = ap.parse_known_args(argv)
    is_file = Path(args.model).suffix == ".toml"
    model = {} if is_file else {"preset": args.model}
    if args.seq_len:
        model["seq_len"] = args.seq_len
    base = load_config(args.model if is_file else None, overrides, runtime=False) if not model else \
        load_config(args.model if is_file else None,
                    {"model": model, "train": {"global_batch": args.global_batch, "micro_batch": 1,
                                               "dtype": args.dtype}}, runtime=False)
    base = dataclasses.replace(base, train=dataclasses.replace(base.train, global_batch=args.global_batch))
    cluster = load_cluster(args.cluster)
    ranked = plan(base, cluster, args.top)
    if args.json:
        print(json.dumps([e.to_json() for e in ranked], indent=2))
    else:
        print(f"{cluster.world} x {cluster.gpu.name}, {base.model.preset}, global batch {args.global_batch} x "
              f"{base.model.seq_len} tokens")
        print(f"{'layout':<44} {'':<18} {'step':>11}  {'MFU':>6}  {'memory':>11}")
        for e in ranked:
            print(_row(e))
    if args.out and ranked:
        Path(args.out).write_text(ranked[0].cfg.to_toml())
        print(f"wrote the best layout to {args.out}")
    return 0 if ranked and ranked[0].fits else 1
