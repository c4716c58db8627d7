"""The planner's speed and accuracy, printed (never asserted):

1. `tetrad plan` wall time for llama3-70b on 1024 H100 (8 per node), global batch 1024 x 8192
   tokens, and llama3-405b on 16384 H100 (targets: under 2 s and 10 s on a 2-core machine);
2. the reference runs (src/tetrad/plan/reference_runs/published_runs.csv): the calibration
   rows, as tests/test_plan_calibration.py checks them, and the held-out ones (only torchtitan's 8B FSDP
   rows informed a constant, the 500 W H100's two efficiencies, with the cp=1 calibration row;
   the others fitted nothing, so their error is the honest one);
with MAPE and Kendall's tau per source and per category after each table (plan/reference.agreement).

    .venv/bin/python bench/bench_plan.py [--skip-plan]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from tetrad.plan.reference import (agreement, best_estimate, format_agreement, predicted_value, ranking_group,
                                   read_rows)

# The two commands of the speed target, timed as a user runs them (a fresh process, so
# start-up and imports count).
PLAN_COMMANDS = (
    (["--model", "llama3-70b", "--cluster", "h100x1024", "--global-batch", "1024", "--seq-len", "8192"], 2),
    (["--model", "llama3-405b", "--cluster", "h100x16384", "--global-batch", "1024", "--seq-len", "8192"], 10),
)


def bench_plan() -> None:
    print("`tetrad plan` wall time (this machine, bf16, --top 10):")
    for args, target in PLAN_COMMANDS:
        cmd = [sys.executable, "-m", "tetrad", "plan", *args, "--dtype", "bf16", "--top", "10", "--json"]
        start = time.perf_counter()
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
        seconds = time.perf_counter() - start
        best = json.loads(out)[0]
        p, t = best["parallel"], best["train"]
        print(f"  tetrad plan {' '.join(args)}: {seconds:.2f} s (target < {target} s); best tp={p['tp']} pp={p['pp']} "
              f"cp={p['cp']} dp={p['dp']} {p['schedule']} vpp={p['vpp']} zero={p['zero']} mb={t['micro_batch']} "
              f"{t['recompute']}: {best['step_time_s']:.2f} s, MFU {100 * best['mfu']:.1f}%, "
              f"{best['peak_memory_gib']:.1f} GiB")


def _table(rows: list[dict]) -> None:
    """Each row's published and predicted figure, then MAPE and Kendall's tau per source and per
    category (reference.agreement)."""
    results = []
    for r in rows:
        published, predicted = float(r["value"]), predicted_value(r, best_estimate(r))
        results.append((r, published, predicted))
        print(f"  {r['id']:<24}{r['metric']:<22}{published:>10.4g}{predicted:>10.4g}"
              f"{100 * (predicted / published - 1):>+8.1f}%  {r['category']:<18}{r['stack']}")
    for key in ("source", "category"):
        summary = agreement([(r[key], ranking_group(r), pub, pred) for r, pub, pred in results])
        print("  " + format_agreement(summary).replace("source", key, 1).replace("\n", "\n  "))


def bench_reference() -> None:
    print("reference runs, calibration (src/tetrad/plan/reference_runs/published_runs.csv, held_out = no):")
    _table(read_rows(held_out=False))
    print("published runs held out (held_out = yes: they informed no constant, except the two tt-8B-fsdp rows):")
    _table(read_rows(held_out=True))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--skip-plan", action="store_true")
    args = ap.parse_args()
    if not args.skip_plan:
        bench_plan()
    bench_reference()


if __name__ == "__main__":
    main()
