"""`tetrad compare RUN_A RUN_B`: do two runs of one training in different layouts agree?

tetrad's layouts compute the same training: the same seed gives the same initial weights and
the same global batches in any layout, so the first step's loss (the forward) and gradient norm
(the backward), taken before any update, differ between two layouts only by the order of sums.
That is the check here, to the tolerances tetrad's layout fuzzer holds every layout to against
one process (tools/fuzz_layouts.py), by precision. Later steps drift apart as AdamW amplifies
rounding: their differences are shown, not judged, unless they exceed `--drift` (a wrong
layout, not rounding). Keys that change the training itself (model, data, optimizer, precision,
a lossy gradient codec) are named first: then nothing is expected to agree exactly.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tetrad.config import load_config, read_toml
from tetrad.viz.report import new_figure, style_axes
from tetrad.config.arguments import non_negative

# Keys that change how a step is computed, not what: the layout and how it runs.
EXECUTION_SECTIONS = ("parallel", "run", "checkpoint")
EXECUTION_KEYS = {"train.micro_batch", "train.recompute", "train.loss_chunk_tokens", "train.device",
                  "train.offload_optimizer", "train.compile", "train.eval_every", "train.eval_steps", "train.tf32",
                  "train.profile"}
TRAINING_KEYS_INSIDE = {"parallel.grad_codec", "checkpoint.init_from"}  # in those sections, but change the math
# First-step tolerances by precision, as tools/fuzz_layouts.py holds layouts to one process:
# (loss, absolute; gradient norm, relative). fp32 matmuls on TF32 tensor cores (CUDA's train.tf32)
# take bf16's: TF32 keeps 10 mantissa bits to bf16's 7, so a layout beyond them is not rounding.
# Tightest first: two runs are held to the looser of their precisions'.
FIRST_STEP = {"fp32": (1e-5, 1e-5), "fp16": (1e-2, 4e-4), "tf32": (2e-2, 4e-3), "bf16": (2e-2, 4e-3)}


def config_differences(a: Path, b: Path) -> tuple[list[str], list[str]]:
    """(execution keys that differ, training keys that differ), as `key: A -> B`; keys a run's
    config.toml lacks (an older tetrad's) at their defaults."""
    flat_a, flat_b = (_flat(load_config(run / "config.toml", runtime=False).to_dict()) for run in (a, b))
    execution, training = [], []
    for key in sorted(set(flat_a) | set(flat_b)):
        if flat_a.get(key) != flat_b.get(key):
            line = f"{key}: {_shown(flat_a.get(key, '(unset)'))} -> {_shown(flat_b.get(key, '(unset)'))}"
            executes = key.split(".")[0] in EXECUTION_SECTIONS or key in EXECUTION_KEYS
            (execution if executes and key not in TRAINING_KEYS_INSIDE else training).append(line)
    return execution, training


def _shown(value) -> str:
    """A value as the difference lines show it: an empty string (an unset path) as ''."""
    return "''" if value == "" else str(value)


def _flat(table: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in table.items():
        if isinstance(value, dict) and key != "comm_options":
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def by_step(run: Path) -> dict[int, dict]:
    """The run's records by step; a step logged twice (a resume from before it) keeps the last."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r for r in (json.loads(line) for line in lines if line.strip())}


def precision(run: Path, first: dict) -> str:
    dtype = read_toml(run / "config.toml")["train"].get("dtype", "fp32")
    return "tf32" if dtype == "fp32" and first.get("tf32") else dtype


def compare(a: Path, b: Path, drift: float) -> tuple[list[str], bool]:
    """The report's lines, and whether the runs agree."""
    execution, training = config_differences(a, b)
    lines = [f"layout and execution keys that differ: {', '.join(execution) or 'none'}"]
    if training:
        lines.append(f"training keys that differ: {', '.join(training)}: these runs train differently, "
                     "so their losses are not expected to agree")
    steps_a, steps_b = by_step(a), by_step(b)
    common = sorted(set(steps_a) & set(steps_b))
    if not common:
        return lines + ["no step in common"], False
    lines.append(f"steps in common: {common[0]}-{common[-1]} ({len(common)})")
    agree = not training
    if 1 in common:
        ra, rb = steps_a[1], steps_b[1]
        kind = max(precision(a, ra), precision(b, rb), key=list(FIRST_STEP).index)
        loss_tol, norm_tol = FIRST_STEP[kind]
        loss_diff = abs(ra["loss"] - rb["loss"])
        norm_diff = abs(ra["grad_norm"] - rb["grad_norm"]) / max(abs(rb["grad_norm"]), 1e-30)
        ok = loss_diff <= loss_tol and norm_diff <= norm_tol
        agree &= ok
        lines += [f"step 1 loss {ra['loss']:.6f} vs {rb['loss']:.6f}: difference {loss_diff:.2e} "
                  f"({'within' if loss_diff <= loss_tol else 'BEYOND'} {kind} rounding, {loss_tol:.0e})",
                  f"step 1 gradient norm {ra['grad_norm']:.6g} vs {rb['grad_norm']:.6g}: relative difference "
                  f"{norm_diff:.2e} ({'within' if norm_diff <= norm_tol else 'BEYOND'} {kind} rounding, {norm_tol:.0e})"]
    else:
        lines.append("step 1 is not in both runs: the first-step check needs both from the start")
    rel = {s: abs(steps_a[s]["loss"] - steps_b[s]["loss"]) / abs(steps_b[s]["loss"]) for s in common}
    worst = max(rel, key=rel.get)
    lines.append(f"largest loss difference: {rel[worst]:.2e} relative at step {worst} "
                 f"({'BEYOND' if rel[worst] > drift else 'within'} --drift {drift:g})")
    agree &= rel[worst] <= drift
    val = [s for s in common if "val_loss" in steps_a[s] and "val_loss" in steps_b[s]]
    if val:
        s = val[-1]
        lines.append(f"validation loss at step {s}: {steps_a[s]['val_loss']:.6f} vs {steps_b[s]['val_loss']:.6f}")
    return lines, agree


def plot(a: Path, b: Path, path: Path) -> None:
    steps_a, steps_b = by_step(a), by_step(b)
    common = sorted(set(steps_a) & set(steps_b))
    fig = new_figure(height=4.6)
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(2, 1))
    for steps, run, style in ((steps_a, a, "-"), (steps_b, b, "--")):
        top.plot(sorted(steps), [steps[s]["loss"] for s in sorted(steps)], ls=style, lw=1.5, label=str(run))
    top.legend(fontsize=8, frameon=False)
    style_axes(top, "Training loss of two runs", "", "loss (mean per token)")
    bottom.semilogy(common, [max(abs(steps_a[s]["loss"] - steps_b[s]["loss"]) / abs(steps_b[s]["loss"]), 1e-12)
                             for s in common], color="#444444", lw=1.2)
    style_axes(bottom, "", "step", "relative difference")
    fig.savefig(path)


def compare_command(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="tetrad compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_a")
    ap.add_argument("run_b")
    ap.add_argument("--drift", type=non_negative, default=0.05,
                    help="largest relative loss difference at any step before the runs are said to disagree")
    ap.add_argument("--out", help="also draw both loss curves and their difference to this PNG")
    args = ap.parse_args(argv)
    runs = Path(args.run_a), Path(args.run_b)
    for run in runs:
        if not (run / "metrics.jsonl").is_file() or not (run / "config.toml").is_file():
            print(f"tetrad: {run} holds no metrics.jsonl and config.toml; give the run.dir of a `tetrad train` run",
                  file=sys.stderr)
            return 2
    lines, agree = compare(*runs, args.drift)
    print("\n".join(lines))
    if args.out:
        plot(*runs, Path(args.out))
        print(f"figure: {args.out}")
    print(f"tetrad: the runs {'agree' if agree else 'DISAGREE'}")
    return 0 if agree else 1
